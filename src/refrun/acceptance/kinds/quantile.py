"""Criterion kind ``quantile``: its TOML model and its check, side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, aligned_frame, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult


@kind("quantile")
class Quantile(Criterion):
    """the q-quantile of a per-step metric over the whole run (at the candidate's own
    logged steps) within the reference group's range of the same quantile at the same
    steps +- abs_tol: a run-level summary that sees a shift every step shares, which a
    per-step band cannot (each step's seed noise hides it); not applicable to a candidate
    logging fewer than min_points aligned steps"""

    metric: str = key("per-step metric whose run-level quantile is compared")
    q: float = key("the quantile (0.5: the median; 0.9: the upper decile; 1: the maximum)",
                   0.5, gt=0, le=1)
    abs_tol: float = key("slack added to the reference group's range of the quantile, in "
                         "the metric's units", 0.0, ge=0)
    min_points: int = key("fewest aligned points of the candidate the quantile is judged "
                          "on: fewer (a candidate logging less often) and the criterion "
                          "does not apply (the per-step criteria judge it)", 20, ge=2)

    def check(self, ctx: Context) -> CriterionResult:
        return quantile(self, ctx)


def run_quantile(values: np.ndarray, q: float) -> float:
    """The ``q``-quantile of one run's values (numpy's default, linear interpolation
    between order statistics: Hyndman & Fan 1996, definition 7)."""
    return float(np.quantile(np.asarray(values, dtype=float), q))


def reference_values_at(ctx: Context, metric: str, steps: np.ndarray | None
                        ) -> list[np.ndarray]:
    """Each reference run's finite values of ``metric`` at ``steps`` (the candidate's own
    aligned steps, so both sides are sampled alike), or its whole curve when ``steps`` is
    None (aligned on samples or tokens, where steps of different runs do not match)."""
    out = []
    for r in ctx.references:
        s = rv.resolved(r, metric, ctx.keep)
        f = rv.finite(s) if s is not None else None
        if f is None or not len(f.steps):
            out.append(np.empty(0))
        elif steps is None:
            out.append(f.values)
        else:
            out.append(f.values[np.isin(f.steps, steps)])
    return out


def quantile(c: Quantile, ctx: Context) -> CriterionResult:
    """``min_i Q_q(ref_i) - abs_tol <= Q_q(candidate) <= max_i Q_q(ref_i) + abs_tol``, each
    ``Q_q`` taken over the aligned steps the candidate logged (:func:`run_quantile`)."""
    if len(ctx.references) < 2:
        return result(c, NOT_EVALUABLE, f"a quantile range needs at least 2 reference runs "
                      f"(seeds), got {len(ctx.references)}")
    frame, why = aligned_frame(ctx, c, c.metric)
    if frame is None:
        return result(c, NOT_EVALUABLE, why)
    cand = frame["candidate"].to_numpy(dtype=float)
    cand = cand[np.isfinite(cand)]
    if len(cand) < c.min_points:
        return result(c, NOT_APPLICABLE, f"the candidate has {len(cand)} aligned point(s) "
                      f"of {c.metric}, fewer than the {c.min_points} its run-level "
                      f"{c.q:g}-quantile is judged on (the per-step criteria judge it)")
    by_step = ctx.criteria.settings.axis == "step"
    refs = reference_values_at(ctx, c.metric, frame["step"].to_numpy() if by_step else None)
    short = [r.run_id for r, v in zip(ctx.references, refs, strict=True) if len(v) < 2]
    if short:
        return result(c, NOT_EVALUABLE, f"reference run(s) {', '.join(short)} have fewer "
                      f"than 2 finite points of {c.metric} at the candidate's steps")
    ref_q = np.array([run_quantile(v, c.q) for v in refs])
    got = run_quantile(cand, c.q)
    lo, hi = float(ref_q.min()) - c.abs_tol, float(ref_q.max()) + c.abs_tol
    sd = float(np.std(ref_q, ddof=1))
    ev: dict[str, Any] = {
        "q": c.q, "abs_tol": c.abs_tol, "candidate_quantile": got,
        "reference_quantiles": [float(x) for x in ref_q], "low": lo, "high": hi,
        "n_points": len(cand), "n_references": len(refs),
        "sampled_at": "candidate steps" if by_step else "each run's own steps",
        "z": (got - float(ref_q.mean())) / sd if sd > 0 else None}
    ok = lo <= got <= hi
    side = "" if ok else (" (below)" if got < lo else " (above)")
    reason = (f"{c.q:g}-quantile of {c.metric} over {len(cand)} steps {rv.fnum(got)} "
              f"{'inside' if ok else 'outside'} [{rv.fnum(lo)}, {rv.fnum(hi)}]{side}: the "
              f"{len(refs)} references' range +- {rv.fnum(c.abs_tol)}")
    return result(c, PASS if ok else FAIL, reason, ev)
