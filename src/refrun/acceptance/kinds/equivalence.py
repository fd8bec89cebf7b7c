"""Criterion kind ``equivalence``: its TOML model and its check, side by side."""

from __future__ import annotations

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance import statistics as stats
from refrun.acceptance.checks import Context, one_point, result
from refrun.acceptance.criterion_evidence import Interval
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("equivalence", any_of=(("margin", "rel_margin"),))
class Equivalence(Criterion):
    """two one-sided t-tests (TOST) on a one-point metric: the candidate minus the mean of the
    reference seeds lies within +-margin (and/or +-rel_margin * |reference mean|) at level
    alpha; reports the (1 - 2 alpha) confidence interval; needs at least two reference runs"""

    metric: str = key("metric compared, e.g. 'eval/test_accuracy'")
    margin: float | None = key("equivalence margin in the metric's units (declared, not "
                               "estimated)", None, gt=0)
    rel_margin: float | None = key("equivalence margin relative to |mean of the reference "
                                   "values|", None, gt=0)
    alpha: float = key("level of each one-sided test", 0.05, gt=0, le=0.5)
    statistic: str = key("value of a run: its last finite value, max, min, or mean of its "
                         "last window_points values", "last",
                         enum=("last", "max", "min", "final_mean"))
    window_points: int = key("points averaged by statistic = final_mean", 1, ge=1)

    def check(self, ctx: Context) -> CriterionResult:
        return equivalence(self, ctx)


def equivalence(c: Equivalence, ctx: Context) -> CriterionResult:
    """TOST (:func:`refrun.acceptance.statistics.tost`): pass when the (1 - 2 alpha)
    confidence interval of candidate - mean(reference seeds) lies inside +-margin
    (margin = ``margin``, or ``rel_margin`` x |reference mean|, the smaller when both)."""
    refs = [one_point(r, c.metric, c.statistic, c.window_points, ctx.keep)
            for r in ctx.references]
    vals = [x for x in refs if x is not None]
    cand = one_point(ctx.candidate, c.metric, c.statistic, c.window_points, ctx.keep)
    if cand is None:
        return result(c, NOT_EVALUABLE, f"candidate run {ctx.candidate.run_id} has no "
                      f"finite {c.metric!r} value")
    if len(vals) < 2:
        return result(c, NOT_EVALUABLE, f"equivalence needs a finite {c.metric!r} value "
                      f"in at least 2 reference runs, got {len(vals)}",
                      Interval(None, len(vals)).to_dict())
    ref_mean = float(np.mean(vals))
    margins = [m for m in (c.margin, None if c.rel_margin is None
                           else c.rel_margin * abs(ref_mean)) if m is not None]
    margin = min(margins)
    t = stats.tost(np.array(vals), np.array([cand]), -margin, margin, c.alpha)
    ev = {"statistic": c.statistic, "candidate_value": cand, "reference_values": vals,
          "reference_mean": ref_mean, "diff": t.diff, "se": t.se, "df": t.df,
          "margin": margin, "alpha": c.alpha, "p_lower": t.p_lower, "p_upper": t.p_upper,
          "p": t.p, "confidence": 1 - 2 * c.alpha,
          **Interval(tuple(t.interval), t.n_reference).to_dict(),
          "n_candidate": t.n_candidate}
    lo, hi = t.interval
    head = (f"diff {rv.fnum(t.diff)}, {1 - 2 * c.alpha:.0%} CI [{rv.fnum(lo)}, "
            f"{rv.fnum(hi)}] (n_reference={t.n_reference})")
    if t.equivalent:
        return result(c, PASS, f"{head} inside +-{rv.fnum(margin)}: equivalent "
                      f"(TOST p={t.p:.3g} < {c.alpha:g})", ev)
    return result(c, FAIL, f"{head} not inside +-{rv.fnum(margin)}: equivalence not "
                  f"shown (TOST p={t.p:.3g} >= {c.alpha:g})", ev)
