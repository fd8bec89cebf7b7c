"""Evaluating one criterion: the context every check reads, the helpers the kinds' checks
share, and :func:`evaluate`, which scopes a criterion to the candidate's backend and calls
its kind's check (``Criterion.check``, defined beside the kind's model in
:mod:`refrun.acceptance.kinds`).  A check states the evidence values it used; missing
evidence (a metric or tag the run does not have) gives ``not_evaluable`` with the reason,
never a guess."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from refrun import schema
from refrun.acceptance import paired as pairs
from refrun.acceptance import runview as rv
from refrun.acceptance.criterion_evidence import FirstDivergence
from refrun.acceptance.migration import configuration, migration, undecided
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import Comparison, RunData
from refrun.comparison.divergence import effective_sustain, first_sustained
from refrun.comparison.measures import final_window_size
from refrun.util.thinning import sorted_unique

if TYPE_CHECKING:  # annotations only: the kinds' modules import this one
    from refrun.acceptance.criteria import CriteriaFile
    from refrun.acceptance.model import Criterion

MAX_LISTED = 20


@dataclass
class Context:
    """What every check may read: the runs, the criteria file and the comparison."""

    criteria: CriteriaFile
    references: list[RunData]
    candidate: RunData
    comparison: Comparison | None
    comparison_error: str = ""
    cache: dict[str, Any] = field(default_factory=dict)
    # Gradient-check runs recorded for the candidate (refrun.acceptance.gradchecks); None
    # when nobody looked them up (no tracking store): a gradcheck criterion is then not
    # evaluable, never passed.
    gradchecks: list[Any] | None = None
    # The candidate's same-seed reference (refrun.acceptance.paired.find_pair); None when
    # nobody looked in a store: a `paired` check then looks among the references only.
    pair: pairs.PairLookup | None = None

    @property
    def keep(self) -> str:
        return self.criteria.settings.keep

    def warmup(self, steps: np.ndarray, override: int | None) -> int:
        s = self.criteria.settings
        return rv.steady_start(steps, override if override is not None else s.warmup_steps,
                               s.warmup_fraction)


def result(c: Criterion, outcome: str, reason: str, evidence: dict[str, Any] | None = None,
           metric: str | None = None) -> CriterionResult:
    """The result of criterion ``c`` (its id, level, kind and metric carried over)."""
    return CriterionResult(id=c.id, level=c.level, kind=c.KIND, outcome=outcome,
                           reason=reason, evidence=evidence or {},
                           metric=metric or getattr(c, "metric", None),
                           description=c.description)


def missing_in(ctx: Context, metric: str) -> str | None:
    """Which run lacks ``metric`` (a reason for not_evaluable), or None."""
    for r in [*ctx.references, ctx.candidate]:
        if metric not in r.metric_names:
            role = "candidate" if r is ctx.candidate else "reference"
            return f"metric {metric!r} not recorded in {role} run {r.run_id}"
    return None


def aligned_frame(ctx: Context, c: Criterion, metric: str):
    """The comparison's aligned frame for ``metric`` or a reason it is not available."""
    missing = missing_in(ctx, metric)
    if missing:
        return None, missing
    if ctx.comparison is None:
        return None, f"no comparison: {ctx.comparison_error}"
    if metric not in ctx.comparison.metrics:
        why = ctx.comparison.skipped.get(metric, "not compared")
        return None, f"metric {metric!r}: {why}"
    return ctx.comparison.metrics[metric].frame, ""


def selected(ctx: Context, c: Any):
    """The aligned points of ``c.metric`` that ``c.over`` selects (:func:`select`, with the
    criterion's ``window_points`` / ``window_fraction``), or None and why the metric's
    aligned frame is not available (:func:`aligned_frame`)."""
    frame, why = aligned_frame(ctx, c, c.metric)
    if frame is None:
        return None, why
    return select(frame, c.over, c.window_points, c.window_fraction, ctx), ""


def first_left(sel, outside: np.ndarray, above: np.ndarray, axis: str
               ) -> FirstDivergence | None:
    """Where the candidate first left a criterion's band among the selected aligned
    points, by the comparison's divergence rule
    (:func:`refrun.comparison.divergence.first_sustained`: ``effective_sustain(n)``
    consecutive points outside, or outside until the last point): its axis value (the
    step, or samples/tokens seen when aligned on them), the candidate's own step there,
    the first point outside at all, and the side; None when it never left the band."""
    n = len(outside)
    k = effective_sustain(n)
    i = first_sustained(outside, k)
    if i is None:
        return None
    steps = sel["step"].to_numpy()
    at = sel[axis].to_numpy() if axis in sel.columns else steps
    j = int(np.argmax(outside))
    return FirstDivergence(axis=axis, at=num(at[i]), step=int(steps[i]),
                           first_outside_at=num(at[j]), sustain=k,
                           direction="above" if bool(above[i]) else "below",
                           outside_points=int(outside.sum()), points=n)


def first_left_evidence(fl: FirstDivergence | None) -> dict[str, Any]:
    """The evidence keys of a first divergence (``None`` values when it never left)."""
    return {schema.EV_FIRST_DIVERGENCE: None if fl is None else fl.to_dict(),
            schema.EV_FIRST_DIVERGENCE_STEP: None if fl is None else fl.step}


@dataclass(frozen=True)
class Inside:
    """How many of the selected aligned points lie inside a criterion's band, judged
    against ``min_fraction``, with the evidence every per-step band criterion carries."""

    ok: bool
    inside: int
    points: int
    fraction: float
    first: FirstDivergence | None
    evidence: dict[str, Any]

    def where(self) -> str:
        """'' when passing, else where the candidate first left the band."""
        return "" if self.ok else where(self.first)


def steps_inside(sel, inside: np.ndarray, above: np.ndarray, min_fraction: float,
                 ctx: Context) -> Inside:
    """Fraction of the selected points inside (``inside``; ``above``: outside on the high
    side) >= ``min_fraction`` (1e-12 slack for the float fraction), the steps outside
    (count, first, the first ``MAX_LISTED``) and where the candidate first left the band
    (:func:`first_left`)."""
    steps = sel["step"].to_numpy()
    frac = float(inside.mean())
    outside = steps[~inside]
    fl = first_left(sel, ~inside, above, ctx.criteria.settings.axis)
    ev = {"min_fraction": min_fraction, "steps_outside": len(outside),
          "first_step_outside": int(outside[0]) if len(outside) else None,
          "outside_steps_listed": outside[:MAX_LISTED].tolist(), **first_left_evidence(fl)}
    return Inside(ok=frac >= min_fraction - 1e-12, inside=int(inside.sum()),
                  points=len(steps), fraction=frac, first=fl, evidence=ev)


def num(x: Any) -> int | float:
    v = float(x)
    return int(v) if v.is_integer() else v


def where(fl: FirstDivergence | None) -> str:
    return "" if fl is None else f"{schema.FIRST_LEFT_REASON}{fl.where()}, {fl.direction}"


def select(frame, over: str, wpoints: int | None, wfrac: float | None, ctx: Context):
    n = len(frame)
    if over == "last":
        return frame.iloc[n - 1:]
    if over == "final_window":
        s = ctx.criteria.settings
        if wpoints is None and wfrac is None:
            k = final_window_size(n, s.final_fraction, s.final_points)
        else:
            k = final_window_size(n, wfrac or 1.0, wpoints)
        return frame.iloc[n - k:]
    return frame


def counter_sum(ctx: Context, c: Criterion, metrics: list[str], warmup: int | None
                ) -> tuple[dict[int, float] | None, dict[str, Any], str]:
    """Per-step sums of counters after warm-up (steps >= warm-up end of the counters'
    combined span); None with a reason when no counter is recorded."""
    run = ctx.candidate
    series = {m: rv.resolved(run, m, ctx.keep) for m in metrics}
    have = {m: rv.finite(s) for m, s in series.items() if s is not None}
    if not have:
        return None, {}, (f"candidate run {run.run_id} has none of the metrics "
                          f"{', '.join(metrics)}")
    all_steps = sorted_unique(np.concatenate([s.steps for s in have.values()]))
    start = ctx.warmup(all_steps, warmup)
    per_step: dict[int, float] = {int(s): 0.0 for s in all_steps if s >= start}
    totals = {}
    for m, s in have.items():
        keep = s.steps >= start
        totals[m] = float(s.values[keep].sum())
        for st, v in zip(s.steps[keep].tolist(), s.values[keep].tolist(), strict=True):
            per_step[st] += v
    ev = {"metrics": metrics, "missing_metrics": [m for m in metrics if m not in have],
          "warmup_end_step": start, "steps_after_warmup": len(per_step),
          "totals_after_warmup": totals}
    return per_step, ev, ""


def counters_at_most(c: Criterion, ctx: Context, metrics: list[str], warmup: int | None,
                     limit: float,
                     measure: Callable[[dict[int, float], dict[str, Any]],
                                       tuple[float | None, str]]) -> CriterionResult:
    """The verdict of a per-step counter criterion: ``measure(per-step sums after warm-up,
    evidence)`` (:func:`counter_sum`; it adds its own evidence) gives ``(value, what the
    value is)``, and the criterion passes when value <= ``limit``.  Not evaluable when no
    counter is recorded, or when ``measure`` gives no value (``what`` then says why)."""
    per_step, ev, what = counter_sum(ctx, c, metrics, warmup)
    value = None
    if per_step is not None:
        value, what = measure(per_step, ev)
    if value is None:
        return result(c, NOT_EVALUABLE, what, ev, metric=metrics[0])
    ok = value <= limit
    return result(c, PASS if ok else FAIL, f"{what} {'<=' if ok else '>'} {limit:g}", ev,
                  metric=metrics[0])


def one_point(run: RunData, metric: str, statistic: str, window: int, keep: str
              ) -> float | None:
    """The one value of ``run`` a claim or an equivalence judges: its last finite
    ``metric`` value, the max, the min, or the mean of the last ``window`` finite values
    (``statistic``); None without a finite value."""
    r = rv.resolved(run, metric, keep)
    if r is None:
        return None
    v = rv.finite(r).values
    if not len(v):
        return None
    if statistic == "max":
        return float(v.max())
    if statistic == "min":
        return float(v.min())
    if statistic == "final_mean":
        return float(v[-window:].mean())
    return float(v[-1])


def applicability(c: Criterion, candidate: RunData, references: Sequence[RunData] = ()
                  ) -> CriterionResult | None:
    """None when ``c`` applies to the candidate: to its backend (``refrun.backend`` tag,
    matched case-insensitively with the criterion's ``backends``) and, for a
    ``migration_only`` criterion, to a candidate whose configuration differs from the
    ``references``' (:func:`refrun.acceptance.migration.migration`).  Otherwise its
    result: not_applicable naming the backend or the shared configuration, or
    not_evaluable when the candidate has no backend tag (whether the criterion applies is
    then unknown, which is no pass)."""
    applies = c.applies_to(candidate.backend)
    if applies and c.migration_only and migration(candidate, references) is None:
        unknown = undecided(candidate, references)
        if unknown:
            return result(c, NOT_EVALUABLE, f"criterion judges migrations only "
                          f"(migration_only) and {unknown}", {"migration_only": True})
        same = configuration(candidate).text()
        return result(c, NOT_APPLICABLE, f"not applicable: the candidate ran as the "
                      f"references did ({same}), and this criterion judges migrations only "
                      "(migration_only)", {"candidate_configuration": same,
                                           "migration_only": True})
    if applies:
        return None
    scope = ", ".join(c.backends or ())
    ev = {"candidate_backend": candidate.backend, "backends": list(c.backends or ())}
    if applies is None:
        return result(c, NOT_EVALUABLE, f"criterion applies only to backends [{scope}] and "
                      f"the candidate has no {schema.TAG_BACKEND} tag", ev)
    return result(c, NOT_APPLICABLE, f"not applicable to backend {candidate.backend!r} "
                  f"(criterion applies only to: {scope})", ev)


def evaluate(c: Criterion, ctx: Context) -> CriterionResult:
    """Evaluate one criterion (not_applicable when it is scoped to other backends); an
    unexpected error in a check is reported as not_evaluable (with the error) rather than
    hiding the other criteria."""
    skipped = applicability(c, ctx.candidate, ctx.references)
    if skipped is not None:
        return skipped
    try:
        return c.check(ctx)
    except Exception as exc:  # evidence we could not read is not a pass
        return result(c, NOT_EVALUABLE, f"could not evaluate: {type(exc).__name__}: {exc}")
