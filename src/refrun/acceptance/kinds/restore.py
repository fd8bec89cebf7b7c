"""Criterion kind ``restore``: its TOML model and its check, side by side.

Resuming from a checkpoint is the most common event of a long training run, and one a
migration breaks silently: a checkpoint that leaves out the optimizer's moments, or a
scheduler whose position is not restored, trains on without an error, and the loss may
end where the reference's ends.  A run that resumes and replays steps it had already
logged carries the evidence itself: the replayed values against the first pass's
(:mod:`refrun.comparison.restores`).  The optimizer's state the probes record (``opt/``
metrics: each group's learning rate, the optimizer's update count) is a function of the
position in training, so a faithful restore repeats it exactly; the measured metric (the
loss) repeats bit for bit where the step is deterministic (the replay runs in the same
process, on the same machine, with the same data), and otherwise stays within the
divergence of known-good same-seed evidence (:mod:`refrun.acceptance.paired`), counted
from the restore.  Judged within the candidate's own run: no reference is needed, and a
candidate that never went back is not_applicable.
"""

from __future__ import annotations

import numpy as np

from refrun import schema
from refrun.acceptance import paired as pairs
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result
from refrun.acceptance.criterion_evidence import (
    MAX_RESTORES,
    ReplayedState,
    RestoreEvidence,
    RestoreRecord,
)
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison.restores import Replay, run_replays


@kind("restore")
class Restore(Criterion):
    """a run that logged steps it had already logged (resumed from a checkpoint and
    replaying them) reproduces them: every replayed value of the optimizer's state (opt/
    metrics: the learning rates, the update count) equals the first pass's, and the
    replayed metric equals the first pass's bit for bit or, with a same-seed band, stays
    within max_ratio x the band counted from the restore (refrun.comparison.restores); not
    applicable to a run that replays no step"""

    metric: str = key("per-step metric whose replayed values are compared with the first "
                      "pass's", schema.M_LOSS)
    band_steps: list[int] | None = key(
        "steps since the restore of the same-seed band's knots, from 0, increasing (written "
        "by refrun calibrate from known-good same-seed pairs); without a band the replay "
        "must be bit for bit", None, min_items=1, ge=0)
    band_values: list[float] | None = key(
        "known-good divergence (running max of |diff|, metric units) from each knot on",
        None, min_items=1, gt=0)
    max_ratio: float | None = key("largest allowed ratio of a replay's divergence to the "
                                  "band", None, gt=1)

    def check(self, ctx: Context) -> CriterionResult:
        return restore(self, ctx)

    def problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        given = [k for k in ("band_steps", "band_values", "max_ratio")
                 if getattr(self, k) is not None]
        if given and len(given) < 3:
            return [((given[0],), "band_steps, band_values and max_ratio go together (a "
                     "same-seed band), or none of them (bit for bit)")]
        if self.band_steps is not None and self.band_values is not None:
            if len(self.band_steps) != len(self.band_values):
                return [(("band_values",), f"has {len(self.band_values)} values for "
                         f"{len(self.band_steps)} band_steps")]
            if any(b <= a for a, b in zip(self.band_steps, self.band_steps[1:],
                                          strict=False)):
                return [(("band_steps",), "must be strictly increasing")]
        return []

    @property
    def has_band(self) -> bool:
        return self.band_steps is not None


def restore(c: Restore, ctx: Context) -> CriterionResult:
    """``restore``: every restore of the candidate reproduces its first pass (module doc).

    Outcomes: *not_evaluable* when the candidate lacks ``metric``; *not_applicable* when
    it replays no step of it nor of an ``opt/`` metric; *fail* when a replayed ``opt/``
    value differs from the first pass's, or the replayed metric differs (without a band)
    or leaves ``max_ratio`` x the band; else *pass*."""
    run = ctx.candidate
    if c.metric not in run.metric_names:
        return result(c, NOT_EVALUABLE, f"metric {c.metric!r} not recorded in candidate run "
                      f"{run.run_id}")
    main = [r for r in run_replays(run, c.metric) if len(r.steps)]
    state = [r for m in sorted(run.metric_names) if m.startswith(schema.OPT_PREFIX)
             for r in run_replays(run, m) if len(r.steps)]
    if not main and not state:
        return result(c, NOT_APPLICABLE, f"candidate run {run.run_id} replays no step (no "
                      f"{c.metric} or {schema.OPT_PREFIX} value logged after a later step: "
                      "no resume from a checkpoint to judge)",
                      RestoreEvidence(c.metric, c.has_band, c.max_ratio, 0).to_dict())
    records = [_record(c, r, [s for s in state if _overlaps(r, s)]) for r in main]
    alone = [s for s in state if not any(_overlaps(r, s) for r in main)]
    records += [_state_only(c, s) for s in alone]
    records.sort(key=lambda r: (r.step, r.after_step))
    ev = RestoreEvidence(c.metric, c.has_band, c.max_ratio, len(records),
                         tuple(records[:MAX_RESTORES])).to_dict()
    bad = [r for r in records if r.state_differs or r.within_band is False
           or (not r.identical and not c.has_band)]
    if bad:
        return result(c, FAIL, f"{len(bad)} of {len(records)} restore(s) did not reproduce "
                      f"the first pass: {_why(c, bad[0])}", ev)
    return result(c, PASS, f"{len(records)} restore(s) reproduced the first pass: "
                  + "; ".join(_how(c, r) for r in records[:3])
                  + ("; ..." if len(records) > 3 else ""), ev)


def _overlaps(a: Replay, b: Replay) -> bool:
    """Two metrics' replays belong to one restore when their logging orders overlap."""
    return max(a.seq_first, b.seq_first) <= min(a.seq_last, b.seq_last)


def _state(r: Replay) -> ReplayedState:
    i = r.first_difference
    return ReplayedState(
        metric=r.metric, replayed=len(r.steps), identical=i is None, at_step=int(r.steps[0]),
        first_at_restore=float(r.first[0]), replay_at_restore=float(r.replay[0]),
        first_difference_step=None if i is None else int(r.steps[i]),
        first_at_difference=None if i is None else float(r.first[i]),
        replay_at_difference=None if i is None else float(r.replay[i]))


def _record(c: Restore, r: Replay, state: list[Replay]) -> RestoreRecord:
    i = r.first_difference
    ratio = within = None
    if i is not None and c.has_band:
        e, d = r.divergence()
        j = pairs.judge(pairs.Divergence(e, d, d), c.band_steps or [], c.band_values or [],
                        c.max_ratio or 1.0)
        ratio, within = j.max_ratio_observed, j.first_divergence_step is None
    return RestoreRecord(step=r.step, after_step=r.after_step, replayed=len(r.steps),
                         unmatched=r.unmatched, identical=i is None,
                         max_abs_diff=_finite(r.max_abs_diff),
                         first_difference_step=None if i is None else int(r.steps[i]),
                         band_ratio=_finite(ratio), within_band=within,
                         state=tuple(_state(s) for s in state))


def _state_only(c: Restore, s: Replay) -> RestoreRecord:
    """A restore seen in an ``opt/`` metric only (the metric was not logged while it
    replayed): its state is judged, the metric has nothing to compare."""
    return RestoreRecord(step=s.step, after_step=s.after_step, replayed=0, unmatched=0,
                         identical=True, max_abs_diff=None, first_difference_step=None,
                         state=(_state(s),))


def _finite(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def _hint(metric: str) -> str:
    if metric == schema.M_OPT_STEPS:
        return ("the optimizer's state was not restored: a new optimizer counts its "
                "updates from 0")
    if metric.startswith(schema.M_LR):
        return "the scheduler's position was not restored"
    return "the optimizer's state differs from the first pass's"


def _why(c: Restore, r: RestoreRecord) -> str:
    where = f"resumed at step {r.step} after step {r.after_step}"
    if r.state_differs:
        st = r.state_differs[0]
        return (f"{where}: {st.metric} at replayed step {st.first_difference_step} is "
                f"{rv.fnum(st.replay_at_difference, 6)} where the first pass had "
                f"{rv.fnum(st.first_at_difference, 6)} ({_hint(st.metric)})")
    diff = f"max |diff| {rv.fnum(r.max_abs_diff)}" if r.max_abs_diff is not None \
        else "a non-finite value where the first pass had a number"
    if c.has_band:
        return (f"{where}: replayed {c.metric} leaves {c.max_ratio:.3g} x the same-seed "
                f"band (up to {rv.fnum(r.band_ratio)} x the known-good divergence; {diff}, "
                f"first differs at step {r.first_difference_step})")
    return (f"{where}: replayed {c.metric} differs from the first pass from step "
            f"{r.first_difference_step} on ({diff}); a restore of model, optimizer and "
            "scheduler on the same machine repeats a deterministic step bit for bit (a "
            "step that is not deterministic needs a same-seed band: refrun calibrate with "
            "a known-good rerun)")


def _how(c: Restore, r: RestoreRecord) -> str:
    if r.replayed == 0:
        what = "no " + c.metric + " replayed"
    elif r.identical:
        what = f"{r.replayed} {c.metric} value(s) bit for bit"
    else:
        what = (f"{r.replayed} {c.metric} value(s) within the same-seed band (up to "
                f"{rv.fnum(r.band_ratio)} x; max |diff| {rv.fnum(r.max_abs_diff)})")
    names = ", ".join(s.metric for s in r.state)
    return (f"from step {r.step} after step {r.after_step}: {what}"
            + (f", {names} identical" if names else ""))
