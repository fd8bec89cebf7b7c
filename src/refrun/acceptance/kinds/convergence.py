"""Criterion kind ``convergence``: its TOML model and its check, side by side."""

from __future__ import annotations

import math

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance import statistics as stats
from refrun.acceptance.checks import Context, result
from refrun.acceptance.criterion_evidence import Interval
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData


@kind("convergence")
class Convergence(Criterion):
    """steps to reach a target value, judged with MLPerf Training's reference-convergence-point
    rule: olympic mean of the reference runs (min and max dropped), one-sided Student t-test at
    alpha; needs at least three reference runs"""

    metric: str = key("metric that reaches the target, e.g. 'eval/val_loss'")
    target: float = key("target value of the metric")
    direction: str = key("'at_most': reached when value <= target (a loss); 'at_least': "
                         "value >= target (an accuracy)", "at_most",
                         enum=("at_most", "at_least"))
    side: str = key("'both': fail when significantly faster or slower than the reference; "
                    "'faster': only significantly faster (MLPerf's check)", "both",
                    enum=("both", "faster"))
    alpha: float = key("level of the one-sided t-test (MLPerf: 0.05)", 0.05, gt=0, le=0.5)
    samples_per_step: float | None = key("report samples instead of steps (steps x this); "
                                         "the test is the same", None, gt=0)

    def check(self, ctx: Context) -> CriterionResult:
        return convergence(self, ctx)


def convergence(c: Convergence, ctx: Context) -> CriterionResult:
    """Steps to reach ``target`` with MLPerf's reference-convergence-point rule
    (:func:`refrun.acceptance.statistics.mlperf_limits`, one candidate run): fail when
    the candidate is significantly faster (below the minimum acceptable mean) or, with
    ``side = both``, significantly slower (above the maximum); a candidate that never
    reaches the target fails."""
    if len(ctx.references) < 3:
        return result(c, NOT_EVALUABLE, f"convergence needs at least 3 reference runs "
                      f"(olympic scoring drops the min and max), got {len(ctx.references)}",
                      Interval(None, len(ctx.references)).to_dict())
    scale = c.samples_per_step or 1.0
    unit = "samples" if c.samples_per_step else "steps"

    def reach(run: RunData) -> float | None:
        r = rv.resolved(run, c.metric, ctx.keep)
        if r is None:
            return None
        s = stats.steps_to_target(r.steps, r.values, c.target, c.direction)
        return None if s is None else s * scale

    refs = [reach(r) for r in ctx.references]
    never = [r.run_id for r, x in zip(ctx.references, refs, strict=True) if x is None]
    if never:
        return result(c, NOT_EVALUABLE, f"reference run(s) {', '.join(never)} never reach "
                      f"{c.metric} {'<=' if c.direction == 'at_most' else '>='} "
                      f"{c.target:g}: the target is not a reference convergence point",
                      {"reference_values": refs})
    lim = stats.mlperf_limits(np.array(refs, dtype=float), 1, c.alpha)
    cand = reach(ctx.candidate)
    ev = {"unit": unit, "target": c.target, "direction": c.direction, "side": c.side,
          "reference_values": refs, "candidate_value": cand, "rcp_mean": lim.rcp_mean,
          "rcp_std": lim.rcp_std, "alpha": c.alpha,
          "min_acceptable": lim.min_acceptable_mean,
          "max_acceptable": lim.max_acceptable_mean if c.side == "both" else None,
          "max_speedup": lim.max_speedup,
          **Interval(tuple(lim.interval) if c.side == "both"
                     else (lim.min_acceptable_mean, None), lim.n_reference).to_dict(),
          "n_reference_runs": len(refs)}
    op = "<=" if c.direction == "at_most" else ">="
    if cand is None:
        return result(c, FAIL, f"candidate never reaches {c.metric} {op} {c.target:g} "
                      f"(reference olympic mean {rv.fnum(lim.rcp_mean)} {unit})", ev)
    hi = lim.max_acceptable_mean if c.side == "both" else math.inf
    ok = lim.min_acceptable_mean <= cand <= hi
    rng = (f"[{rv.fnum(lim.min_acceptable_mean)}, {rv.fnum(hi)}]" if c.side == "both"
           else f">= {rv.fnum(lim.min_acceptable_mean)}")
    verdict = "within" if ok else ("significantly faster than" if
                                   cand < lim.min_acceptable_mean else
                                   "significantly slower than")
    return result(c, PASS if ok else FAIL,
                  f"candidate reaches {c.metric} {op} {c.target:g} in {cand:g} {unit}: "
                  f"{verdict} the reference (olympic mean {rv.fnum(lim.rcp_mean)}, "
                  f"acceptable {rng}, n_reference={lim.n_reference}, "
                  f"one-sided t-test alpha={c.alpha:g})", ev)
