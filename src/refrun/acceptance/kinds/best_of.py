"""Criterion kind ``best_of``: its TOML model and its check, side by side.

A workload that keeps its best checkpoint reports, at the end, the evaluation of that
checkpoint: a one-value metric (``eval/final_val_loss``) equal to the best point of a
periodic evaluation (the min of ``eval/val_loss``).  A port that never reloads the best
checkpoint reports its last evaluation instead and runs without an error (the migration
study's "best checkpoint never reloaded"); a seed band may not see it when the last and
the best evaluations are close.  This kind judges the relation within the candidate's own
run, so it holds whatever the candidate's evaluation cadence or numerics.
"""

from __future__ import annotations

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, one_point, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult

# How equal "equal" is: a reloaded checkpoint re-evaluated in float32, logged as float64
# by MLflow, gives the recorded value to about 1e-7 relative.
BEST_OF_REL_TOL = 1e-6


def best_index(values: np.ndarray, best: str) -> int:
    """Index of the best point of ``values``: ``argmin`` for ``"min"``, ``argmax`` for
    ``"max"`` (the first one on ties, as NumPy returns)."""
    return int(np.argmin(values) if best == "min" else np.argmax(values))


def reports(value: float, best_value: float, rel_tol: float = BEST_OF_REL_TOL) -> bool:
    """Whether ``value`` is ``best_value`` as reported: ``|value - best| <= rel_tol |best|``."""
    return abs(value - best_value) <= rel_tol * abs(best_value)


@kind("best_of")
class BestOf(Criterion):
    """a one-value metric equals the best point (min or max) of a per-step metric of the same
    run within rel_tol, as in every reference run (the best checkpoint reloaded and
    reported)"""

    metric: str = key("one-value metric reported at the end, e.g. 'eval/final_val_loss'")
    of: str = key("per-step metric whose best point it reports, e.g. 'eval/val_loss'")
    best: str = key("'min' (a loss) or 'max' (an accuracy)", enum=("min", "max"))
    rel_tol: float = key("largest allowed |value - best| / |best|", BEST_OF_REL_TOL, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return best_of(self, ctx)

    def used_metrics(self) -> tuple[str, ...]:
        return (self.metric, self.of)


def best_of(c: BestOf, ctx: Context) -> CriterionResult:
    """``|v - b| <= rel_tol * |b|``, ``v`` the candidate's last finite ``metric`` value and
    ``b`` the min (or max) of its own finite ``of`` series."""
    value = one_point(ctx.candidate, c.metric, "last", 1, ctx.keep)
    r = rv.resolved(ctx.candidate, c.of, ctx.keep)
    series = rv.finite(r) if r is not None else None
    if value is None or series is None or not len(series.values):
        missing = c.metric if value is None else c.of
        return result(c, NOT_EVALUABLE, f"candidate run {ctx.candidate.run_id} has no "
                      f"finite {missing!r} value")
    i = best_index(series.values, c.best)
    b, last = float(series.values[i]), float(series.values[-1])
    diff = abs(value - b)
    ok = reports(value, b, c.rel_tol)
    ev = {"value": value, "best": b, "best_step": int(series.steps[i]), "last": last,
          "last_step": int(series.steps[-1]), "rel_diff": diff / abs(b) if b else None,
          "rel_tol": c.rel_tol}
    said = f"{c.metric} {value:.6g} {'is' if ok else 'is not'} the {c.best} of {c.of} " \
           f"({b:.6g} at step {ev['best_step']}"
    if not ok and reports(value, last, c.rel_tol):
        said += f"; it is the last evaluation, step {ev['last_step']}: the best checkpoint " \
                "was not the one reported"
    return result(c, PASS if ok else FAIL, said + ")", ev, metric=c.metric)
