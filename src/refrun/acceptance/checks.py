"""Evaluating one criterion: each kind is a function ``(criterion, context) ->
CriterionResult`` that states the evidence values it used.  Missing evidence (a metric or
tag the run does not have) gives ``not_evaluable`` with the reason, never a guess."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from refrun import identity, schema
from refrun.acceptance import paired as pairs
from refrun.acceptance import runview as rv
from refrun.acceptance import statistics as stats
from refrun.acceptance.results import (
    FAIL,
    NOT_APPLICABLE,
    NOT_EVALUABLE,
    PASS,
    CriterionResult,
)
from refrun.comparison import Comparison, RunData, step_time_ratio
from refrun.comparison.divergence import effective_sustain, first_sustained
from refrun.comparison.measures import final_window_size, steady_points
from refrun.thinning import sorted_unique

if TYPE_CHECKING:  # annotations only: the criteria model imports no check (no cycle)
    from refrun.acceptance.criteria import (
        Claim,
        Closeness,
        Compilation,
        Convergence,
        CriteriaFile,
        Criterion,
        Envelope,
        Equivalence,
        Fallback,
        Gradcheck,
        Hardware,
        HostTransfers,
        StepTime,
        Utilization,
    )
    from refrun.acceptance.criteria import Cost as CostCriterion

# Tag written by the XLA probe: JSON {op name: executions}.
TAG_FALLBACK_OPS = schema.TAG_FALLBACK_OPS  # one name, defined in schema.py
UTIL_PATTERN = re.compile(r"^sys/(gpu|tpu)\d+_(util|duty_cycle)_pct$")
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


def _result(c: Criterion, outcome: str, reason: str, evidence: dict[str, Any] | None = None,
            metric: str | None = None) -> CriterionResult:
    return CriterionResult(id=c.id, level=c.level, kind=c.KIND, outcome=outcome,
                           reason=reason, evidence=evidence or {},
                           metric=metric or getattr(c, "metric", None),
                           description=c.description)


def _missing_in(ctx: Context, metric: str) -> str | None:
    """Which run lacks ``metric`` (a reason for not_evaluable), or None."""
    for r in [*ctx.references, ctx.candidate]:
        if metric not in r.metric_names:
            role = "candidate" if r is ctx.candidate else "reference"
            return f"metric {metric!r} not recorded in {role} run {r.run_id}"
    return None


def _aligned_frame(ctx: Context, c: Criterion, metric: str):
    """The comparison's aligned frame for ``metric`` or a reason it is not available."""
    missing = _missing_in(ctx, metric)
    if missing:
        return None, missing
    if ctx.comparison is None:
        return None, f"no comparison: {ctx.comparison_error}"
    if metric not in ctx.comparison.metrics:
        why = ctx.comparison.skipped.get(metric, "not compared")
        return None, f"metric {metric!r}: {why}"
    return ctx.comparison.metrics[metric].frame, ""


def first_left(sel, outside: np.ndarray, above: np.ndarray, axis: str) -> dict[str, Any] | None:
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
    return {"axis": axis, "at": _num(at[i]), "step": int(steps[i]),
            "first_outside_at": _num(at[j]), "sustain": k,
            "direction": "above" if bool(above[i]) else "below",
            "outside_points": int(outside.sum()), "points": n}


def _num(x: Any) -> int | float:
    v = float(x)
    return int(v) if v.is_integer() else v


def _where(fl: dict[str, Any] | None) -> str:
    if fl is None:
        return ""
    at = f"{fl['axis']} {fl['at']:g}" + (f" (step {fl['step']})" if fl["axis"] != "step"
                                         else "")
    return f"{schema.FIRST_LEFT_REASON}{at}, {fl['direction']}"


def _select(frame, over: str, wpoints: int | None, wfrac: float | None, ctx: Context):
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


# --- L1 / L3: values against the reference ---------------------------------------------
def closeness(c: Closeness, ctx: Context) -> CriterionResult:
    """Per step: within when |cand - ref| <= abs_tol + rel_tol * |ref| (ref = mean of the
    reference runs); pass when the fraction within >= min_fraction.  ``aggregate = mean``
    compares the means over the selected steps once."""
    frame, why = _aligned_frame(ctx, c, c.metric)
    if frame is None:
        return _result(c, NOT_EVALUABLE, why)
    sel = _select(frame, c.over, c.window_points, c.window_fraction, ctx)
    steps = sel["step"].to_numpy()
    ref, cand = sel["reference"].to_numpy(), sel["candidate"].to_numpy()
    ev: dict[str, Any] = {"over": c.over, "abs_tol": c.abs_tol, "rel_tol": c.rel_tol,
                          "n_steps": len(steps), "first_step": int(steps[0]),
                          "last_step": int(steps[-1]),
                          "n_references": len(ctx.references)}
    d = cand - ref
    ad = np.abs(d)
    imax = int(np.argmax(ad))
    ev.update(max_abs_diff=float(ad[imax]), step_of_max_abs_diff=int(steps[imax]),
              mean_abs_diff=float(ad.mean()),
              reference_at_last_step=float(ref[-1]), candidate_at_last_step=float(cand[-1]))
    if c.aggregate == "mean":
        rm, cm = float(ref.mean()), float(cand.mean())
        limit = c.abs_tol + c.rel_tol * abs(rm)
        extra = window_noise_allowance(c, len(steps), len(ctx.references), abs(rm))
        if extra > 0:
            ev.update(calibrated_allowed=limit, window_points=len(steps),
                      window_calibrated_points=c.window_calibrated_points,
                      window_noise_allowance=extra)
            limit = math.hypot(limit, extra)
        ev.update(aggregate="mean", reference_mean=rm, candidate_mean=cm,
                  diff_of_means=cm - rm, allowed=limit)
        ok = abs(cm - rm) <= limit
        reason = (f"mean over {len(steps)} steps: candidate {rv.fnum(cm)} vs reference "
                  f"{rv.fnum(rm)}, |diff| {rv.fnum(abs(cm - rm))} "
                  f"{'<=' if ok else '>'} allowed {rv.fnum(limit)}")
        return _result(c, PASS if ok else FAIL, reason, ev)
    within = rv.isclose(cand, ref, c.abs_tol, c.rel_tol)
    frac = float(within.mean())
    outside = steps[~within]
    fl = first_left(sel, ~within, d > 0, ctx.criteria.settings.axis)
    ev.update(aggregate="point", steps_within=int(within.sum()), fraction_within=frac,
              min_fraction=c.min_fraction, steps_outside=len(outside),
              first_step_outside=int(outside[0]) if len(outside) else None,
              outside_steps_listed=outside[:MAX_LISTED].tolist(),
              **{schema.EV_FIRST_DIVERGENCE: fl,
                 schema.EV_FIRST_DIVERGENCE_STEP: None if fl is None else fl["step"]})
    ok = frac >= c.min_fraction - 1e-12
    reason = (f"{int(within.sum())}/{len(steps)} steps within tolerance "
              f"({frac:.1%}, need {c.min_fraction:.1%}); max |diff| {rv.fnum(ad[imax])} at "
              f"step {int(steps[imax])}" + ("" if ok else _where(fl)))
    return _result(c, PASS if ok else FAIL, reason, ev)


def window_noise_allowance(c: Closeness, k: int, g: int, scale: float) -> float:
    """Extra allowance of a window mean over ``k`` points when the tolerance was
    calibrated on windows of ``K = window_calibrated_points`` points (0 when k >= K or no
    noise was calibrated).

    With per-point noise ``sigma`` (relative ``window_noise_rel`` times ``scale`` =
    |reference window mean|) independent between points, the difference of the
    candidate's window mean and the mean of ``g`` references' window means has noise
    variance ``sigma^2 (1 + 1/g) / k``; the calibrated tolerance already covers it at
    ``K`` points, so a window of ``k`` points needs the variance
    ``sigma^2 (1 + 1/g) (1/k - 1/K)`` more, taken at ``window_noise_z`` standard
    deviations and added in quadrature to the calibrated tolerance (variances of
    independent terms add)."""
    big_k = c.window_calibrated_points
    if not c.window_noise_rel or big_k is None or k >= big_k or k < 1 or g < 1:
        return 0.0
    var = (1 + 1 / g) * (1 / k - 1 / big_k)
    return float(c.window_noise_z * c.window_noise_rel * scale * math.sqrt(var))


def envelope(c: Envelope, ctx: Context) -> CriterionResult:
    """Inside the reference group's band at each selected step: std band
    |cand - mean| <= k * std + abs_tol (std with ddof=1), or min-max band widened by
    abs_tol; pass when the fraction inside >= min_fraction."""
    if len(ctx.references) < 2:
        return _result(c, NOT_EVALUABLE, f"an envelope needs at least 2 reference runs "
                       f"(seeds), got {len(ctx.references)}")
    frame, why = _aligned_frame(ctx, c, c.metric)
    if frame is None:
        return _result(c, NOT_EVALUABLE, why)
    sel = _select(frame, c.over, c.window_points, c.window_fraction, ctx)
    steps = sel["step"].to_numpy()
    cand = sel["candidate"].to_numpy()
    mean, std = sel["ref_mean"].to_numpy(), sel["ref_std"].to_numpy()
    lo_band, hi_band = sel["ref_min"].to_numpy(), sel["ref_max"].to_numpy()
    if c.band == "std":
        lo, hi = mean - c.k * std - c.abs_tol, mean + c.k * std + c.abs_tol
    else:
        lo, hi = lo_band - c.abs_tol, hi_band + c.abs_tol
    inside = (cand >= lo) & (cand <= hi)
    frac = float(inside.mean())
    outside = steps[~inside]
    fl = first_left(sel, ~inside, cand > hi, ctx.criteria.settings.axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, (cand - mean) / std, np.nan)
    az = np.abs(z[np.isfinite(z)])
    ev = {"band": c.band, "k": c.k if c.band == "std" else None, "abs_tol": c.abs_tol,
          "over": c.over, "n_references": len(ctx.references), "n_steps": len(steps),
          "steps_inside": int(inside.sum()), "fraction_inside": frac,
          "min_fraction": c.min_fraction, "steps_outside": len(outside),
          "first_step_outside": int(outside[0]) if len(outside) else None,
          "outside_steps_listed": outside[:MAX_LISTED].tolist(),
          "max_abs_z": float(az.max()) if len(az) else None,
          "zero_spread_steps": int((std <= 0).sum()),
          schema.EV_FIRST_DIVERGENCE: fl,
          schema.EV_FIRST_DIVERGENCE_STEP: None if fl is None else fl["step"]}
    ok = frac >= c.min_fraction - 1e-12
    band = f"mean +- {c.k:g} std" if c.band == "std" else "min-max"
    reason = (f"{int(inside.sum())}/{len(steps)} steps inside the "
              f"{band} band "
              f"({frac:.1%}, need {c.min_fraction:.1%})" + ("" if ok else _where(fl)))
    return _result(c, PASS if ok else FAIL, reason, ev)


def _statistic(run: RunData, c: Claim, keep: str) -> float | None:
    r = rv.resolved(run, c.metric, keep)
    if r is None:
        return None
    v = rv.finite(r).values
    if not len(v):
        return None
    if c.statistic == "max":
        return float(v.max())
    if c.statistic == "min":
        return float(v.min())
    if c.statistic == "final_mean":
        return float(v[-c.window_points:].mean())
    return float(v[-1])


def claim(c: Claim, ctx: Context) -> CriterionResult:
    """Candidate's value (``statistic`` of its own finite series) against the claim.  With
    ``match_reference_*_tol``: if the reference (mean of the reference runs' values) also
    misses the claim, a candidate with |cand - ref| <= abs + rel * |ref| passes as
    preserving the reference's behaviour.  When the reference meets the claim, matching it
    is not enough."""
    cand = _statistic(ctx.candidate, c, ctx.keep)
    if cand is None:
        return _result(c, NOT_EVALUABLE, f"candidate run {ctx.candidate.run_id} has no "
                       f"finite {c.metric!r} value")
    at_least = c.at_least is not None
    target = c.at_least if at_least else c.at_most
    assert target is not None

    def meets(x: float) -> bool:
        return x >= target if at_least else x <= target

    refs = [_statistic(r, c, ctx.keep) for r in ctx.references]
    ref_vals = [x for x in refs if x is not None]
    ref = float(np.mean(ref_vals)) if ref_vals else None
    rule_on = c.match_reference_abs_tol is not None or c.match_reference_rel_tol is not None
    ev: dict[str, Any] = {"statistic": c.statistic, "claim": target,
                          "direction": "at_least" if at_least else "at_most",
                          "candidate_value": cand, "reference_values": refs,
                          "reference_value": ref, "candidate_meets_claim": meets(cand),
                          "reference_meets_claim": None if ref is None else meets(ref),
                          "reference_rule": rule_on}
    op = ">=" if at_least else "<="
    if meets(cand):
        return _result(c, PASS, f"candidate {rv.fnum(cand)} {op} claim {rv.fnum(target)}",
                       {**ev, "rule_applied": "claim"})
    if rule_on and ref is not None and not meets(ref):
        abs_t, rel_t = c.match_reference_abs_tol or 0.0, c.match_reference_rel_tol or 0.0
        allowed = abs_t + rel_t * abs(ref)
        ev.update(diff_from_reference=cand - ref, allowed=allowed)
        if abs(cand - ref) <= allowed:
            return _result(c, PASS, f"claim {rv.fnum(target)} missed by reference "
                           f"{rv.fnum(ref)} too; candidate {rv.fnum(cand)} matches it within "
                           f"{rv.fnum(allowed)} (preserves the reference's behaviour)",
                           {**ev, "rule_applied": "matches_reference"})
        return _result(c, FAIL, f"candidate {rv.fnum(cand)} misses claim {rv.fnum(target)}; "
                       f"reference {rv.fnum(ref)} misses it too but the candidate differs by "
                       f"{rv.fnum(abs(cand - ref))} > {rv.fnum(allowed)}",
                       {**ev, "rule_applied": "none"})
    tail = "" if ref is None else f" (reference {rv.fnum(ref)}" + (
        " meets it)" if meets(ref) else " misses it too)")
    return _result(c, FAIL, f"candidate {rv.fnum(cand)} misses claim {op} "
                   f"{rv.fnum(target)}{tail}", {**ev, "rule_applied": "none"})


# --- L2: integrity ---------------------------------------------------------------------
def hardware(c: Hardware, ctx: Context) -> CriterionResult:
    """Executing hardware tag equals / contains ``expected`` (case-insensitive) and no
    placement warning unless allowed."""
    run = ctx.candidate
    hw = run.tags.get(schema.TAG_EXEC_HARDWARE)
    warning = run.tags.get(schema.TAG_PLACEMENT_WARNING)
    ev = {"expected": c.expected, "match": c.match, "exec_hardware": hw,
          "declared_hardware": run.hardware, "placement_warning": warning,
          "exec_devices": run.tags.get(schema.TAG_EXEC_DEVICES)}
    if hw is None:
        return _result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has no "
                       f"{schema.TAG_EXEC_HARDWARE} tag (recorded without a framework "
                       "probe)", ev)
    exp = c.expected.strip().lower()
    ok_hw = hw.strip().lower() == exp if c.match == "exact" else exp in hw.lower()
    if not ok_hw:
        return _result(c, FAIL, f"executed on {hw!r}, expected {c.expected!r} ({c.match})", ev)
    if warning and not c.allow_placement_warning:
        return _result(c, FAIL, f"executed on {hw!r} but placement warning: {warning}", ev)
    return _result(c, PASS, f"executed on {hw!r}" + (f" (placement warning allowed: "
                                                     f"{warning})" if warning else ""), ev)


def fallback(c: Fallback, ctx: Context) -> CriterionResult:
    """CPU-fallback operations outside ``allow`` (op names from the probe's tag; the
    ``fallback/ops`` counter total when names are unknown)."""
    run = ctx.candidate
    ops = rv.tag_json(run, TAG_FALLBACK_OPS)
    allow = set(c.allow)
    if isinstance(ops, dict):
        bad = {k: v for k, v in ops.items() if k not in allow and v}
        ev = {"source": TAG_FALLBACK_OPS, "ops": ops, "allow": sorted(allow),
              "outside_allowlist": bad}
        if bad:
            return _result(c, FAIL, f"{len(bad)} op(s) fell back to the CPU outside the "
                           f"allowlist: {', '.join(f'{k} x{v}' for k, v in sorted(bad.items()))}",
                           ev)
        return _result(c, PASS, f"no fallback outside the allowlist ({len(ops)} op name(s) "
                       "recorded)", ev)
    r = rv.resolved(run, schema.M_FALLBACK_OPS, ctx.keep)
    if r is None:
        return _result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has neither the "
                       f"{TAG_FALLBACK_OPS} tag nor the {schema.M_FALLBACK_OPS!r} metric")
    f = rv.finite(r)
    total = float(f.values.sum())
    ev = {"source": schema.M_FALLBACK_OPS, "total": total, "allow": sorted(allow),
          "steps_with_fallback": f.steps[f.values > 0][:MAX_LISTED].tolist()}
    if total == 0:
        return _result(c, PASS, f"{schema.M_FALLBACK_OPS} total 0 over {len(f.values)} steps",
                       ev)
    if allow:
        return _result(c, NOT_EVALUABLE, f"{total:g} fallback op executions but their names "
                       f"are unknown (no {TAG_FALLBACK_OPS} tag) to check the allowlist", ev)
    return _result(c, FAIL, f"{total:g} CPU-fallback op executions (no allowlist)", ev)


def _counter_sum(ctx: Context, c: Criterion, metrics: list[str], warmup: int | None
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


def compilation(c: Compilation, ctx: Context) -> CriterionResult:
    """Sum of the compile counters over steps >= warm-up end <= ``max``."""
    per_step, ev, why = _counter_sum(ctx, c, c.metrics, c.warmup_steps)
    if per_step is None:
        return _result(c, NOT_EVALUABLE, why, metric=c.metrics[0])
    total = float(sum(per_step.values()))
    ev.update(total_after_warmup=total, max=c.max,
              steps_with_compilation=[s for s, v in per_step.items() if v > 0][:MAX_LISTED])
    ok = total <= c.max
    return _result(c, PASS if ok else FAIL,
                   f"{total:g} compilation(s) after warm-up (step >= {ev['warmup_end_step']})"
                   f" {'<=' if ok else '>'} {c.max:g}", ev, metric=c.metrics[0])


def host_transfers(c: HostTransfers, ctx: Context) -> CriterionResult:
    """Transfers per step after warm-up (counters added per step; mean or max) <= ``max``."""
    per_step, ev, why = _counter_sum(ctx, c, c.metrics, c.warmup_steps)
    if per_step is None:
        return _result(c, NOT_EVALUABLE, why, metric=c.metrics[0])
    if not per_step:
        return _result(c, NOT_EVALUABLE, "no step after warm-up", ev, metric=c.metrics[0])
    vals = np.array(list(per_step.values()))
    stat = float(vals.mean() if c.statistic == "mean" else vals.max())
    ev.update(per_step_mean=float(vals.mean()), per_step_max=float(vals.max()),
              statistic=c.statistic, value=stat, max=c.max)
    ok = stat <= c.max
    return _result(c, PASS if ok else FAIL,
                   f"{c.statistic} {stat:.4g} transfers/step after warm-up "
                   f"{'<=' if ok else '>'} {c.max:g}", ev, metric=c.metrics[0])


def utilization(c: Utilization, ctx: Context) -> CriterionResult:
    """Mean over devices of each utilization metric's mean after warm-up >= ``min_pct``."""
    run = ctx.candidate
    metrics = list(c.metrics) or [m for m in run.metric_names if UTIL_PATTERN.match(m)]
    means: dict[str, float] = {}
    starts: dict[str, int] = {}
    for m in metrics:
        r = rv.resolved(run, m, ctx.keep)
        if r is None:
            continue
        f = rv.finite(r)
        if not len(f.values):
            continue
        start = ctx.warmup(f.steps, c.warmup_steps)
        v = f.values[f.steps >= start]
        if len(v):
            means[m], starts[m] = float(v.mean()), start
    if not means:
        wanted = ", ".join(metrics) or "sys/gpu<i>_util_pct, sys/tpu<i>_duty_cycle_pct"
        return _result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has no utilization "
                       f"metric ({wanted})", metric=None)
    overall = float(np.mean(list(means.values())))
    ev = {"metrics": sorted(means), "mean_by_metric": means, "warmup_end_step": starts,
          "mean_pct": overall, "min_pct": c.min_pct}
    ok = overall >= c.min_pct
    return _result(c, PASS if ok else FAIL, f"mean utilization {overall:.1f}% "
                   f"{'>=' if ok else '<'} {c.min_pct:g}% ({len(means)} device metric(s))",
                   ev, metric=sorted(means)[0])


# --- L4: performance and cost ------------------------------------------------------------
def _backend_key(run: RunData) -> str | None:
    b = run.backend
    # Alias-aware (a stored "torch-xla" is torch_xla): refrun.identity's vocabulary.
    return (identity.canonical_backend(b) or b.strip().lower()) if b and b.strip() else None


def compile_steps(run: RunData, metrics: list[str], keep: str) -> np.ndarray:
    """Steps at which one of the per-step compilation counters ``metrics`` is > 0."""
    hit = [r.steps[r.values > 0] for r in (rv.resolved(run, m, keep) for m in metrics)
           if r is not None]
    return sorted_unique(np.concatenate(hit)) if hit else np.empty(0, dtype=np.int64)


def steady_step_times(run: RunData, metric: str, compile_metrics: list[str], keep: str,
                      start: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(steps, seconds, compilation steps left out)``: the run's steady step times
    (:func:`refrun.comparison.measures.steady_points`: finite, at steps >= ``start``, the
    warm-up end) without its compilation steps (a step where a ``compile_metrics``
    counter moved)."""
    r = rv.resolved(run, metric, keep)
    if r is None:
        return np.empty(0, dtype=np.int64), np.empty(0), 0
    comp = compile_steps(run, compile_metrics, keep) if compile_metrics else None
    return steady_points(r.steps, r.values, start, comp)


def step_time(c: StepTime, ctx: Context) -> CriterionResult:
    """Steady-state median step time, candidate / reference (reference points of all
    reference runs pooled) <= ``max_ratio``.  Steady: steps >= warm-up end that are no
    compilation step (``compile_metrics`` moved).  Same backend only unless
    ``across_backends``: a ratio between frameworks is ``not_applicable``."""
    missing = _missing_in(ctx, c.metric)
    if missing:
        return _result(c, NOT_EVALUABLE, missing)
    cand_b = _backend_key(ctx.candidate)
    ref_b = sorted({_backend_key(r) or "?" for r in ctx.references})
    scope = {"candidate_backend": ctx.candidate.backend, "reference_backends": ref_b,
             "across_backends": c.across_backends}
    if not c.across_backends:
        if cand_b is None or "?" in ref_b:
            return _result(c, NOT_EVALUABLE, f"cannot tell whether the candidate and the "
                           f"references share a backend (a run has no {schema.TAG_BACKEND} "
                           "tag); set across_backends = true to compare anyway", scope)
        if ref_b != [cand_b]:
            return _result(c, NOT_APPLICABLE, f"candidate backend {ctx.candidate.backend!r} "
                           f"differs from the references' ({', '.join(ref_b)}): a step-time "
                           "ratio between frameworks says nothing about the migration "
                           "(across_backends = true to judge it anyway)", scope)
    spans = [rv.resolved(r, c.metric, ctx.keep) for r in [*ctx.references, ctx.candidate]]
    all_steps = np.concatenate([rv.finite(s).steps for s in spans if s is not None])
    if not len(all_steps):
        return _result(c, NOT_EVALUABLE, f"no finite {c.metric!r} values")
    start = ctx.warmup(np.array([all_steps.min(), all_steps.max()]), c.warmup_steps)
    refs = [steady_step_times(r, c.metric, c.compile_metrics, ctx.keep, start)
            for r in ctx.references]
    cand = steady_step_times(ctx.candidate, c.metric, c.compile_metrics, ctx.keep, start)
    m = step_time_ratio(np.concatenate([s[0] for s in refs]),
                        np.concatenate([s[1] for s in refs]), cand[0], cand[1], start)
    ev = {**scope, "warmup_end_step": start, "reference_median_s": m.reference_median,
          "candidate_median_s": m.candidate_median, "reference_n": m.reference_n,
          "candidate_n": m.candidate_n, "ratio": m.ratio, "max_ratio": c.max_ratio,
          "compile_steps_excluded": {"candidate": cand[2],
                                     "references": int(sum(s[2] for s in refs))}}
    if m.ratio is None:
        return _result(c, NOT_EVALUABLE, f"no steady {c.metric!r} value after step {start} "
                       f"(reference n={m.reference_n}, candidate n={m.candidate_n})", ev)
    tail = f"({cand[2]} compilation step(s) of the candidate left out)"
    if c.low_quantile is None:
        ok = m.ratio <= c.max_ratio
        return _result(c, PASS if ok else FAIL,
                       f"steady median step time {rv.fnum(m.candidate_median)} s vs "
                       f"{rv.fnum(m.reference_median)} s: ratio {m.ratio:.3f} "
                       f"{'<=' if ok else '>'} {c.max_ratio:g} {tail}", ev)
    ref_low = float(np.quantile(np.concatenate([s[1] for s in refs]), c.low_quantile))
    cand_low = float(np.quantile(cand[1], c.low_quantile))
    low = cand_low / ref_low if ref_low > 0 else math.inf
    ok = low <= c.max_ratio
    ev.update(low_quantile=c.low_quantile, reference_low_s=ref_low, candidate_low_s=cand_low,
              low_quantile_ratio=low, judged_ratio=low)
    return _result(c, PASS if ok else FAIL,
                   f"fastest {c.low_quantile:.0%} of the steady steps "
                   f"{rv.fnum(cand_low)} s vs {rv.fnum(ref_low)} s: ratio {low:.3f} "
                   f"{'<=' if ok else '>'} {c.max_ratio:g} (medians {rv.fnum(m.candidate_median)} "
                   f"s vs {rv.fnum(m.reference_median)} s, ratio {m.ratio:.3f}) {tail}", ev)


def cost(c: CostCriterion, ctx: Context) -> CriterionResult:
    """Cost per run = hours x price per hour; ratio = candidate cost / mean reference cost."""
    prices = ctx.criteria.prices
    rows = []
    for role, run in [*(("reference", r) for r in ctx.references),
                      ("candidate", ctx.candidate)]:
        hours, hnote = rv.run_hours(run, c.time_source, keep=ctx.keep)
        hw, price, pnote = rv.hardware_price(run, prices)
        rows.append({"run_id": run.run_id, "role": role, "hours": hours, "time": hnote,
                     "hardware": hw, "price_per_hour": price, "price": pnote,
                     "cost": None if hours is None or price is None else hours * price})
    ev: dict[str, Any] = {"currency": prices.currency, "time_source": c.time_source,
                          "per": prices.per, "runs": rows, "max_ratio": c.max_ratio,
                          "max_cost": c.max_cost}
    cand = rows[-1]
    if cand["cost"] is None:
        return _result(c, NOT_EVALUABLE, cand["time"] if cand["hours"] is None
                       else cand["price"], ev, metric=None)
    ev["candidate_cost"] = cand["cost"]
    problems = []
    if c.max_ratio is not None:
        ref_costs = [r["cost"] for r in rows[:-1]]
        if any(x is None for x in ref_costs):
            bad = next(r for r in rows[:-1] if r["cost"] is None)
            return _result(c, NOT_EVALUABLE, bad["time"] if bad["hours"] is None
                           else bad["price"], ev, metric=None)
        ref_cost = float(np.mean(ref_costs))
        ratio = cand["cost"] / ref_cost if ref_cost > 0 else math.inf
        ev.update(reference_cost=ref_cost, ratio=ratio)
        if ratio > c.max_ratio:
            problems.append(f"ratio {ratio:.3f} > {c.max_ratio:g}")
    if c.max_cost is not None and cand["cost"] > c.max_cost:
        problems.append(f"cost {cand['cost']:.4g} > {c.max_cost:g} {prices.currency}")
    summary = (f"candidate {cand['cost']:.4g} {prices.currency}"
               + (f" vs reference {ev['reference_cost']:.4g} (ratio {ev['ratio']:.3f})"
                  if "ratio" in ev else ""))
    if problems:
        return _result(c, FAIL, summary + ": " + "; ".join(problems), ev, metric=None)
    return _result(c, PASS, summary, ev, metric=None)


# --- statistical criteria ----------------------------------------------------------------
def _one_point(run: RunData, metric: str, statistic: str, window: int, keep: str
               ) -> float | None:
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


def equivalence(c: Equivalence, ctx: Context) -> CriterionResult:
    """TOST (:func:`refrun.acceptance.statistics.tost`): pass when the (1 - 2 alpha)
    confidence interval of candidate - mean(reference seeds) lies inside +-margin
    (margin = ``margin``, or ``rel_margin`` x |reference mean|, the smaller when both)."""
    refs = [_one_point(r, c.metric, c.statistic, c.window_points, ctx.keep)
            for r in ctx.references]
    vals = [x for x in refs if x is not None]
    cand = _one_point(ctx.candidate, c.metric, c.statistic, c.window_points, ctx.keep)
    if cand is None:
        return _result(c, NOT_EVALUABLE, f"candidate run {ctx.candidate.run_id} has no "
                       f"finite {c.metric!r} value")
    if len(vals) < 2:
        return _result(c, NOT_EVALUABLE, f"equivalence needs a finite {c.metric!r} value "
                       f"in at least 2 reference runs, got {len(vals)}",
                       {schema.EV_N_REFERENCE: len(vals)})
    ref_mean = float(np.mean(vals))
    margins = [m for m in (c.margin, None if c.rel_margin is None
                           else c.rel_margin * abs(ref_mean)) if m is not None]
    margin = min(margins)
    t = stats.tost(np.array(vals), np.array([cand]), -margin, margin, c.alpha)
    ev = {"statistic": c.statistic, "candidate_value": cand, "reference_values": vals,
          "reference_mean": ref_mean, "diff": t.diff, "se": t.se, "df": t.df,
          "margin": margin, "alpha": c.alpha, "p_lower": t.p_lower, "p_upper": t.p_upper,
          "p": t.p, "confidence": 1 - 2 * c.alpha,
          schema.EV_INTERVAL: list(t.interval), schema.EV_N_REFERENCE: t.n_reference,
          "n_candidate": t.n_candidate}
    lo, hi = t.interval
    head = (f"diff {rv.fnum(t.diff)}, {1 - 2 * c.alpha:.0%} CI [{rv.fnum(lo)}, "
            f"{rv.fnum(hi)}] (n_reference={t.n_reference})")
    if t.equivalent:
        return _result(c, PASS, f"{head} inside +-{rv.fnum(margin)}: equivalent "
                       f"(TOST p={t.p:.3g} < {c.alpha:g})", ev)
    return _result(c, FAIL, f"{head} not inside +-{rv.fnum(margin)}: equivalence not "
                   f"shown (TOST p={t.p:.3g} >= {c.alpha:g})", ev)


def convergence(c: Convergence, ctx: Context) -> CriterionResult:
    """Steps to reach ``target`` with MLPerf's reference-convergence-point rule
    (:func:`refrun.acceptance.statistics.mlperf_limits`, one candidate run): fail when
    the candidate is significantly faster (below the minimum acceptable mean) or, with
    ``side = both``, significantly slower (above the maximum); a candidate that never
    reaches the target fails."""
    if len(ctx.references) < 3:
        return _result(c, NOT_EVALUABLE, f"convergence needs at least 3 reference runs "
                       f"(olympic scoring drops the min and max), got {len(ctx.references)}",
                       {schema.EV_N_REFERENCE: len(ctx.references)})
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
        return _result(c, NOT_EVALUABLE, f"reference run(s) {', '.join(never)} never reach "
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
          "max_speedup": lim.max_speedup, schema.EV_INTERVAL: list(lim.interval)
          if c.side == "both" else [lim.min_acceptable_mean, None],
          schema.EV_N_REFERENCE: lim.n_reference, "n_reference_runs": len(refs)}
    op = "<=" if c.direction == "at_most" else ">="
    if cand is None:
        return _result(c, FAIL, f"candidate never reaches {c.metric} {op} {c.target:g} "
                       f"(reference olympic mean {rv.fnum(lim.rcp_mean)} {unit})", ev)
    hi = lim.max_acceptable_mean if c.side == "both" else math.inf
    ok = lim.min_acceptable_mean <= cand <= hi
    rng = (f"[{rv.fnum(lim.min_acceptable_mean)}, {rv.fnum(hi)}]" if c.side == "both"
           else f">= {rv.fnum(lim.min_acceptable_mean)}")
    verdict = "within" if ok else ("significantly faster than" if
                                   cand < lim.min_acceptable_mean else
                                   "significantly slower than")
    return _result(c, PASS if ok else FAIL,
                   f"candidate reaches {c.metric} {op} {c.target:g} in {cand:g} {unit}: "
                   f"{verdict} the reference (olympic mean {rv.fnum(lim.rcp_mean)}, "
                   f"acceptable {rng}, n_reference={lim.n_reference}, "
                   f"one-sided t-test alpha={c.alpha:g})", ev)


def gradcheck(c: Gradcheck, ctx: Context) -> CriterionResult:
    """Every gradcheck run recorded for the candidate finished and passed, and together
    they hold the required ``labels``.  No run at all is a failure: the file requires the
    evidence (a missing check must never read as a pass)."""
    runs = ctx.gradchecks
    if runs is None:
        return _result(c, NOT_EVALUABLE, "gradient-check runs were not looked up (the "
                       "assessment had no tracking store)")
    cand = ctx.candidate.run_id
    ev: dict[str, Any] = {"gradcheck_runs": [r.run_id for r in runs],
                          "statuses": {r.run_id: r.status for r in runs},
                          "failed_checks": {r.run_id: r.failed for r in runs if r.failed},
                          "labels": sorted({lab for r in runs for lab in r.labels}),
                          "required_labels": list(c.labels)}
    if not runs:
        return _result(c, FAIL, f"no gradient-check run recorded for candidate {cand} (role "
                       f"gradcheck, tag {schema.TAG_GRADCHECK_CANDIDATE}); the criteria "
                       "file requires one", ev)
    bad = [r for r in runs if not r.ok]
    if bad:
        why = "; ".join(
            f"run {r.run_id}: " + (f"status {r.status}" if r.status != "FINISHED" else
                                   f"failed {', '.join(r.failed)}" if r.failed else
                                   f"{schema.TAG_GRADCHECK_PASSED} = "
                                   f"{'missing' if r.passed is None else 'false'}")
            for r in bad[:5])
        return _result(c, FAIL, f"{len(bad)}/{len(runs)} gradient-check run(s) did not pass: "
                       f"{why}", ev)
    missing = [lab for lab in c.labels if lab not in ev["labels"]]
    if missing:
        return _result(c, FAIL, f"required check(s) not recorded: {', '.join(missing)}", ev)
    return _result(c, PASS, f"{len(runs)} gradient-check run(s) passed "
                   f"({len(ev['labels'])} checks)", ev)


CHECKS: dict[str, Callable[[Any, Context], CriterionResult]] = {
    "closeness": closeness, "envelope": envelope, "claim": claim, "hardware": hardware,
    "fallback": fallback, "compilation": compilation, "host_transfers": host_transfers,
    "utilization": utilization, "step_time": step_time, "cost": cost,
    "equivalence": equivalence, "convergence": convergence, "gradcheck": gradcheck,
    "paired": pairs.check,
}


def applicability(c: Criterion, candidate: RunData) -> CriterionResult | None:
    """None when ``c`` applies to the candidate's backend (``refrun.backend`` tag, matched
    case-insensitively with the criterion's ``backends``); otherwise its result:
    not_applicable naming the backend, or not_evaluable when the candidate has no
    backend tag (whether the criterion applies is then unknown, which is no pass)."""
    applies = c.applies_to(candidate.backend)
    if applies:
        return None
    scope = ", ".join(c.backends or ())
    ev = {"candidate_backend": candidate.backend, "backends": list(c.backends or ())}
    if applies is None:
        return _result(c, NOT_EVALUABLE, f"criterion applies only to backends [{scope}] and "
                       f"the candidate has no {schema.TAG_BACKEND} tag", ev)
    return _result(c, NOT_APPLICABLE, f"not applicable to backend {candidate.backend!r} "
                   f"(criterion applies only to: {scope})", ev)


def evaluate(c: Criterion, ctx: Context) -> CriterionResult:
    """Evaluate one criterion (not_applicable when it is scoped to other backends); an
    unexpected error in a check is reported as not_evaluable (with the error) rather than
    hiding the other criteria."""
    skipped = applicability(c, ctx.candidate)
    if skipped is not None:
        return skipped
    try:
        return CHECKS[c.KIND](c, ctx)
    except Exception as exc:  # evidence we could not read is not a pass
        return _result(c, NOT_EVALUABLE, f"could not evaluate: {type(exc).__name__}: {exc}")
