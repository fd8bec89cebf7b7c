"""The consistency levels L0-L4: the built-in L0 checks, each level's status, the
highest level reached, and the rule that L4 is judged only after L3 passed.

* **L0** executability (built in): the candidate finished, reached its planned step
  count on its step axis (the last step recorded on any metric), and logged no
  non-finite loss.
* **L1** numerical agreement: reported as measurements; criteria are optional.
* **L2** execution integrity, **L3** project-goal preservation: the workload's criteria.
* **L4** performance and cost: evaluated only when L3 passed (faster cannot make up for a
  changed computation); otherwise its criteria are ``not_evaluable`` / ``not_evaluated``.

Highest level reached: walking L0 -> L4, a level that passed raises it; a level without
criteria, or whose criteria all are not applicable to the candidate's backend, is
transparent (neither raises nor stops it); any other status stops the walk.

A ``not_applicable`` criterion (scoped by ``backends`` to other backends) is left out of
its level's status and of the verdict: it neither fails nor blocks anything.
"""

from __future__ import annotations

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.criteria import LEVELS, L0Options
from refrun.acceptance.results import (
    FAIL,
    NO_CRITERIA,
    NOT_APPLICABLE,
    NOT_EVALUABLE,
    NOT_EVALUATED,
    PASS,
    CriterionResult,
    LevelResult,
)
from refrun.comparison import RunData

L4_GATE = "L3"


def _l0(cid: str, outcome: str, reason: str, evidence: dict, metric: str | None = None
        ) -> CriterionResult:
    return CriterionResult(id=cid, level="L0", kind="builtin", outcome=outcome,
                           reason=reason, evidence=evidence, metric=metric,
                           description="built-in executability check")


def last_recorded_step(run: RunData) -> int | None:
    """The run's step axis: the highest step it recorded on any metric, or its recorded
    step counter (tag ``refrun.steps.last``, written when the run is sealed), whichever is
    larger; None when it recorded no step.  Logging cadence never matters: a run logging
    its loss every 5 steps but its step time every step ends at its last step."""
    last = rv.tag_int(run, schema.TAG_STEPS_LAST)
    for m in run.metric_names:
        steps, _, _ = run.series(m)
        if len(steps):
            top = int(np.max(steps))
            last = top if last is None else max(last, top)
    return last


def builtin_l0(candidate: RunData, references: list[RunData], opts: L0Options,
               keep: str = "last") -> list[CriterionResult]:
    """The three built-in L0 checks on the candidate run: finished; reached its planned
    step count on its step axis (:func:`last_recorded_step`; steps counted from 0 or 1, so
    ``last >= planned - 1``; without a planned count, the references' last step); no
    non-finite loss."""
    out = [_l0("L0.finished", PASS if candidate.status == "FINISHED" else FAIL,
               f"run status {candidate.status}", {"status": candidate.status})]
    loss = rv.resolved(candidate, opts.loss_metric, keep)
    planned = opts.planned_steps or rv.tag_int(candidate, schema.TAG_PLANNED_STEPS)
    last = last_recorded_step(candidate)
    if last is None:
        out.append(_l0("L0.planned_steps", NOT_EVALUABLE,
                       "candidate recorded no step on any metric", {}, None))
    else:
        ev = {"last_step": last, "planned_steps": planned, "step_axis": "any metric",
              "last_loss_step": None if loss is None else int(loss.steps[-1])}
        if planned is not None:
            # Steps may count from 0 (last = planned - 1) or from 1 (last = planned).
            ok = last >= planned - 1
            ev["source"] = "criteria l0.planned_steps" if opts.planned_steps else \
                schema.TAG_PLANNED_STEPS
            out.append(_l0("L0.planned_steps", PASS if ok else FAIL,
                           f"last step {last} of {planned} planned", ev))
        else:
            ref_last = [s for s in (last_recorded_step(r) for r in references)
                        if s is not None]
            if not ref_last:
                out.append(_l0("L0.planned_steps", NOT_EVALUABLE, "no planned step count "
                               f"(tag {schema.TAG_PLANNED_STEPS}) and no reference step "
                               "to compare with", ev))
            else:
                target = max(ref_last)
                ev.update(source="reference last step", reference_last_step=target)
                ok = last >= target
                out.append(_l0("L0.planned_steps", PASS if ok else FAIL,
                               f"last step {last}; reference ran to {target} (no planned "
                               "step count recorded)", ev))
    if loss is None:
        out.append(_l0("L0.finite_loss", NOT_EVALUABLE,
                       f"candidate has no {opts.loss_metric!r} metric", {}, opts.loss_metric))
    else:
        bad = rv.nonfinite_count(candidate, opts.loss_metric)
        steps, values, _ = candidate.series(opts.loss_metric)
        first = int(steps[~np.isfinite(values)].min()) if bad else None
        out.append(_l0("L0.finite_loss", PASS if bad == 0 else FAIL,
                       f"{bad} non-finite {opts.loss_metric!r} value(s)" +
                       (f", first at step {first}" if bad else ""),
                       {"nonfinite_points": bad, "first_nonfinite_step": first},
                       opts.loss_metric))
    return out


def level_status(results: list[CriterionResult]) -> str:
    """no_criteria (none), not_applicable (none applies to the candidate's backend);
    otherwise, over the applicable ones: not_evaluated (L4 held back), fail (one failed),
    not_evaluable (one could not be evaluated), pass (all passed)."""
    if not results:
        return NO_CRITERIA
    results = [r for r in results if r.outcome != NOT_APPLICABLE]
    if not results:
        return NOT_APPLICABLE
    if not all(r.evaluated for r in results):
        return NOT_EVALUATED
    if any(r.outcome == FAIL for r in results):
        return FAIL
    if any(r.outcome == NOT_EVALUABLE for r in results):
        return NOT_EVALUABLE
    return PASS


def summarize(results: list[CriterionResult]) -> list[LevelResult]:
    """One :class:`LevelResult` per level, in order."""
    out = []
    for lv in LEVELS:
        rs = [r for r in results if r.level == lv]
        status = level_status(rs)
        note = ""
        if lv == "L1" and status == NO_CRITERIA:
            note = "measured only (see measurements)"
        if status == NOT_EVALUATED:
            note = "L4 is judged only after L3 passed"
        if status == NOT_APPLICABLE:
            note = "no criterion applies to the candidate's backend"
        out.append(LevelResult(lv, status, sum(r.outcome == PASS for r in rs),
                               sum(r.outcome == FAIL for r in rs),
                               sum(r.outcome == NOT_EVALUABLE for r in rs), note,
                               not_applicable=sum(r.outcome == NOT_APPLICABLE for r in rs)))
    return out


def highest_level(levels: list[LevelResult]) -> str | None:
    """The highest level reached (see the module docstring); None when L0 did not pass."""
    best = None
    for lv in levels:
        if lv.status == PASS:
            best = lv.level
        elif lv.status not in (NO_CRITERIA, NOT_APPLICABLE):
            break
    return best


def verdict(results: list[CriterionResult]) -> str:
    """pass: every criterion passed or was not applicable to the candidate's backend;
    fail: one failed; incomplete: otherwise (one not evaluable or held back)."""
    if any(r.outcome == FAIL for r in results):
        return FAIL
    if all(r.outcome in (PASS, NOT_APPLICABLE) for r in results):
        return PASS
    return "incomplete"
