"""Criterion kind ``throughput``: its TOML model and its check, side by side."""

from __future__ import annotations

import numpy as np

from refrun import schema
from refrun.acceptance import performance as perf
from refrun.acceptance.checks import Context, result
from refrun.acceptance.kinds.step_time import contention, judged
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("throughput")
class Throughput(Criterion):
    """steady throughput (samples or tokens per second of step time, warm-up and compilation
    steps left out; the median of the rates of 0.1 s blocks of steps), candidate / mean of
    the references' >= min_ratio: a migration's speed, whatever the hardware or framework
    (written by refrun calibrate --goal throughput>=RATIOx)"""

    min_ratio: float = key("least allowed ratio (< 1: the candidate may be slower)", gt=0)
    unit: str = key("what a step's work is counted in: 'auto' (tokens when every run records "
                    "them, else samples, else steps when no run records samples), or "
                    "'tokens', 'samples', 'steps'", "auto", enum=perf.UNIT_CHOICES)
    metric: str = key("step-time metric, seconds", schema.M_STEP_TIME)
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)
    compile_metrics: list[str] = key(
        "per-step compilation counters: a step where one is > 0 is left out of every run "
        "([] keeps every step)", list(schema.STEP_TIME_COMPILE_METRICS))

    def check(self, ctx: Context) -> CriterionResult:
        return throughput(self, ctx)


def throughput(c: Throughput, ctx: Context) -> CriterionResult:
    """Candidate's steady throughput / mean of the references' >= ``min_ratio``
    (:func:`refrun.acceptance.performance.run_throughput` on every run, in one unit).  A
    fail on a machine that took CPU from the candidate is not judged, as for step time
    (:func:`refrun.acceptance.kinds.step_time.judged`)."""
    runs = [*ctx.references, ctx.candidate]
    unit, note = perf.choose_unit(runs, c.unit)
    if unit is None:
        return result(c, NOT_EVALUABLE, note, {"unit": c.unit}, metric=None)
    figs = [perf.run_throughput(r, unit, ctx.keep,
                                lambda steps: ctx.warmup(steps, c.warmup_steps), c.metric,
                                c.compile_metrics) for r in runs]
    ev = {"unit": unit, "unit_note": note, "min_ratio": c.min_ratio,
          "runs": [{"run_id": r.run_id, "role": role, "per_s": f.per_s,
                    "mean_per_s": f.mean_per_s, "steady_steps": f.steps, "blocks": f.blocks,
                    "compile_steps_excluded": f.compile_steps,
                    "warmup_end_step": f.warmup_end_step}
                   for r, f, role in zip(runs, figs, [*(["reference"] * len(ctx.references)),
                                                       "candidate"], strict=True)]}
    missing = next((f for f in (figs[-1], *figs[:-1]) if f.per_s is None), None)
    if missing is not None:
        return result(c, NOT_EVALUABLE, missing.why, ev)
    ref = float(np.mean([f.per_s for f in figs[:-1]]))
    cand = figs[-1].per_s
    assert cand is not None
    ratio = cand / ref
    ev.update(candidate_per_s=cand, reference_per_s=ref, ratio=ratio)
    ok = ratio >= c.min_ratio
    reason = (f"steady throughput {perf.fmt(cand)} vs {perf.fmt(ref)} {unit}/s: ratio "
              f"{ratio:.3f} "
              f"{'>=' if ok else '<'} {c.min_ratio:g}" + (f" ({note})" if note else ""))
    return judged(c, PASS if ok else FAIL, reason, ev,
                  contention(ctx.candidate, list(ctx.references), ctx.keep), "throughput")
