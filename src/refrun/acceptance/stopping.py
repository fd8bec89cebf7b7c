"""Stopping rules for a run in progress or a smoke test.

Each rule yields ``investigate`` (with the evidence), ``continue`` or ``not_evaluable``;
never a rejection: the paper behind refrun found six false alarms in seven smoke-test
stops, so a triggered rule asks a person to look.

* ``budget``: projected total time = elapsed wall time + remaining steps x per-step time,
  where per-step time is the median of ``perf/step_time_s`` after warm-up (else the
  wall-clock rate of the logged steps); projected cost = projected hours x price per hour
  (``[prices]``).  Steps count from 0: ``remaining = planned - (last step + 1)``.
* ``smoke``: the fraction of steps so far within ``abs_tol + rel_tol * |reference|`` of
  the reference below ``min_fraction``.
* ``no_progress``: L0 not reached ``after_hours`` after the start, or no new point for
  ``stall_minutes``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.criteria import Budget, CriteriaFile, NoProgress, Smoke, StopRule
from refrun.acceptance.results import clean
from refrun.comparison import RunData, compare
from refrun.errors import RefrunInputError

INVESTIGATE, CONTINUE, NOT_EVALUABLE = "investigate", "continue", "not_evaluable"


@dataclass(frozen=True)
class StopFinding:
    """The outcome of one stopping rule."""

    id: str
    kind: str
    outcome: str  # investigate | continue | not_evaluable
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StopReport:
    """All stopping rules evaluated on one snapshot of a run."""

    run_id: str
    now_ms: int
    status: str
    findings: list[StopFinding]

    @property
    def investigate(self) -> list[StopFinding]:
        return [f for f in self.findings if f.outcome == INVESTIGATE]

    def to_dict(self) -> dict[str, Any]:
        return clean({"run_id": self.run_id, "now_ms": self.now_ms, "status": self.status,
                      "investigate": [f.id for f in self.investigate],
                      "findings": [vars(f) for f in self.findings]})

    def text(self) -> str:
        lines = [f"run {self.run_id} ({self.status}):"]
        lines += [f"  {f.outcome.upper():<14} {f.id} [{f.kind}] {f.reason}"
                  for f in self.findings]
        return "\n".join(lines)


def _start_ms(run: RunData) -> int | None:
    if run.start_time_ms is not None:
        return int(run.start_time_ms)
    ts = run.curves["timestamp_ms"]
    return int(ts.min()) if len(ts) else None


def _main_metric(run: RunData, crit: CriteriaFile) -> str | None:
    """The loss metric, else (without it) the metric with most points stands for progress."""
    if crit.l0.loss_metric in run.metric_names:
        return crit.l0.loss_metric
    if not run.metric_names:
        return None
    return str(run.curves["metric"].value_counts().index[0])


def projected_time(rule: Budget, run: RunData, crit: CriteriaFile, now_ms: int
                   ) -> tuple[dict[str, Any], str]:
    """Evidence of the time projection (seconds), or a reason it cannot be made."""
    planned = rule.planned_steps or crit.l0.planned_steps or rv.tag_int(
        run, schema.TAG_PLANNED_STEPS)
    if planned is None:
        return {}, f"no planned step count (rule planned_steps or tag {schema.TAG_PLANNED_STEPS})"
    metric = _main_metric(run, crit)
    main = rv.resolved(run, metric, crit.settings.keep) if metric else None
    start = _start_ms(run)
    if main is None or start is None:
        return {}, "no step logged yet"
    last = int(main.steps[-1])
    remaining = max(0, planned - (last + 1))
    elapsed_s = max(0.0, (now_ms - start) / 1000.0)
    s = crit.settings
    st = rv.resolved(run, rule.metric, s.keep)
    ev: dict[str, Any] = {"planned_steps": planned, "last_step": last,
                          "remaining_steps": remaining, "elapsed_s": elapsed_s}
    if st is not None:
        f = rv.finite(st)
        if len(f.values):
            w = rv.steady_start(f.steps, rule.warmup_steps if rule.warmup_steps is not None
                                else s.warmup_steps, s.warmup_fraction)
            steady = f.values[f.steps >= w]
            ev.update(per_step_source=rule.metric, warmup_end_step=w, steady_steps=len(steady))
            if len(steady) < rule.min_steps:
                return ev, f"only {len(steady)} steady {rule.metric!r} values (min_steps " \
                           f"{rule.min_steps})"
            per_step = float(np.median(steady))
        else:
            return ev, f"no finite {rule.metric!r} value yet"
    else:
        rows = run.curves[run.curves["metric"] == metric]
        g = rows.groupby("step")["timestamp_ms"].max().sort_index()
        w = rv.steady_start(g.index.to_numpy(), rule.warmup_steps if rule.warmup_steps is not
                            None else s.warmup_steps, s.warmup_fraction)
        g = g[g.index >= w]
        ev.update(per_step_source="wall-clock rate of logged steps", warmup_end_step=w,
                  steady_steps=len(g))
        if len(g) < max(2, rule.min_steps):
            return ev, f"only {len(g)} steady steps logged (min_steps {rule.min_steps})"
        per_step = (g.iloc[-1] - g.iloc[0]) / 1000.0 / (g.index[-1] - g.index[0])
    projected = elapsed_s + remaining * per_step
    ev.update(per_step_s=float(per_step), projected_total_s=float(projected),
              projected_total_h=float(projected) / 3600.0)
    return ev, ""


def budget(rule: Budget, run: RunData, crit: CriteriaFile, now_ms: int) -> StopFinding:
    """Projected total time and cost of the run against the budget."""
    ev, why = projected_time(rule, run, crit, now_ms)
    if why:
        return StopFinding(rule.id, rule.KIND, NOT_EVALUABLE, why, ev)
    hours = ev["projected_total_h"]
    over = []
    if rule.max_hours is not None:
        ev["max_hours"] = rule.max_hours
        if hours > rule.max_hours:
            over.append(f"projected {hours:.3g} h > budget {rule.max_hours:g} h")
    if rule.max_cost is not None:
        hw, price, note = rv.hardware_price(run, crit.prices)
        ev.update(hardware=hw, price_per_hour=price, price=note, max_cost=rule.max_cost,
                  currency=crit.prices.currency)
        if price is None:
            return StopFinding(rule.id, rule.KIND, NOT_EVALUABLE, note, ev)
        ev["projected_cost"] = hours * price
        if hours * price > rule.max_cost:
            over.append(f"projected cost {hours * price:.4g} > budget {rule.max_cost:g} "
                        f"{crit.prices.currency}")
    summary = (f"{ev['last_step'] + 1}/{ev['planned_steps']} steps, {ev['per_step_s']:.4g} "
               f"s/step: projected {hours:.3g} h"
               + (f", {ev['projected_cost']:.4g} {crit.prices.currency}"
                  if "projected_cost" in ev else ""))
    if over:
        return StopFinding(rule.id, rule.KIND, INVESTIGATE, summary + "; " + "; ".join(over), ev)
    return StopFinding(rule.id, rule.KIND, CONTINUE, summary + " (within budget)", ev)


def smoke(rule: Smoke, run: RunData, refs: Sequence[RunData], crit: CriteriaFile
          ) -> StopFinding:
    """Steps so far within the threshold of the reference, as a fraction."""
    if not refs:
        return StopFinding(rule.id, rule.KIND, NOT_EVALUABLE, "no reference run given")
    from refrun.acceptance.comparing import compare_options

    try:
        cmp = compare(list(refs), run, metrics=[rule.metric], options=compare_options(crit),
                      progress=False)
    except RefrunInputError as exc:
        return StopFinding(rule.id, rule.KIND, NOT_EVALUABLE, str(exc))
    f = cmp.frame(rule.metric)
    if rule.over == "last":
        f = f.iloc[-rule.window_points:]
    n = len(f)
    if n < rule.min_steps:
        return StopFinding(rule.id, rule.KIND, CONTINUE, f"only {n} aligned steps so far "
                           f"(min_steps {rule.min_steps})", {"n_steps": n})
    ref, cand, steps = f["reference"].to_numpy(), f["candidate"].to_numpy(), f["step"].to_numpy()
    within = rv.isclose(cand, ref, rule.abs_tol, rule.rel_tol)
    ad = np.abs(cand - ref)
    frac = float(within.mean())
    ev = {"n_steps": n, "first_step": int(steps[0]), "last_step": int(steps[-1]),
          "fraction_within": frac, "min_fraction": rule.min_fraction,
          "abs_tol": rule.abs_tol, "rel_tol": rule.rel_tol,
          "max_abs_diff": float(ad.max()), "step_of_max_abs_diff": int(steps[int(ad.argmax())]),
          "first_step_outside": int(steps[~within][0]) if (~within).any() else None}
    text = f"{int(within.sum())}/{n} steps within threshold ({frac:.1%}); max |diff| " \
           f"{ad.max():.4g} at step {ev['step_of_max_abs_diff']}"
    if frac < rule.min_fraction - 1e-12:
        return StopFinding(rule.id, rule.KIND, INVESTIGATE,
                           text + f" < {rule.min_fraction:.1%}: look before the full run "
                           "(the reference setup itself can cause this)", ev)
    return StopFinding(rule.id, rule.KIND, CONTINUE, text, ev)


def no_progress(rule: NoProgress, run: RunData, crit: CriteriaFile, now_ms: int
                ) -> StopFinding:
    """L0 not reached after ``after_hours``, or no new point for ``stall_minutes``."""
    from refrun.acceptance.levels import builtin_l0

    start = _start_ms(run)
    ev: dict[str, Any] = {"status": run.status}
    reasons = []
    if rule.after_hours is not None and start is not None:
        hours = (now_ms - start) / 3.6e6
        l0 = builtin_l0(run, [], crit.l0, crit.settings.keep)
        reached = all(r.outcome == "pass" for r in l0)
        ev.update(hours_since_start=hours, after_hours=rule.after_hours, l0_reached=reached,
                  l0=[{"id": r.id, "outcome": r.outcome, "reason": r.reason} for r in l0])
        if hours > rule.after_hours and not reached:
            reasons.append(f"L0 not reached {hours:.3g} h after the start "
                           f"(limit {rule.after_hours:g} h)")
    if rule.stall_minutes is not None and run.status == "RUNNING":
        ts = run.curves["timestamp_ms"]
        last = int(ts.max()) if len(ts) else start
        if last is not None:
            idle = (now_ms - last) / 60000.0
            ev.update(minutes_since_last_point=idle, stall_minutes=rule.stall_minutes)
            if idle > rule.stall_minutes:
                reasons.append(f"no new point for {idle:.3g} min (limit "
                               f"{rule.stall_minutes:g} min)")
    if reasons:
        return StopFinding(rule.id, rule.KIND, INVESTIGATE, "; ".join(reasons), ev)
    return StopFinding(rule.id, rule.KIND, CONTINUE, "progressing", ev)


def evaluate_stopping(crit: CriteriaFile, run: RunData, references: Sequence[RunData] = (),
                      now_ms: int | None = None) -> StopReport:
    """Evaluate every ``[[stopping]]`` rule of ``crit`` on a (partial) run at ``now_ms``
    (default: the current time)."""
    now = int(time.time() * 1000) if now_ms is None else int(now_ms)
    findings = []
    for rule in crit.stopping:
        findings.append(_one(rule, run, references, crit, now))
    return StopReport(run.run_id, now, run.status, findings)


def _one(rule: StopRule, run: RunData, refs: Sequence[RunData], crit: CriteriaFile,
         now: int) -> StopFinding:
    try:
        if isinstance(rule, Budget):
            return budget(rule, run, crit, now)
        if isinstance(rule, Smoke):
            return smoke(rule, run, refs, crit)
        if isinstance(rule, NoProgress):
            return no_progress(rule, run, crit, now)
        raise TypeError(rule)
    except Exception as exc:  # a broken rule must not hide the others
        return StopFinding(rule.id, rule.KIND, NOT_EVALUABLE,
                           f"could not evaluate: {type(exc).__name__}: {exc}")
