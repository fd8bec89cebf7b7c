"""Re-checking a criteria file on held-out reference seeds with the assessment's own
comparison (:func:`refrun.acceptance.comparing.run_comparison`) and checks, so the
re-check judges exactly what ``refrun accept`` judges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refrun.acceptance import checks
from refrun.acceptance.calibration.derive import (
    CalibrationOptions,
    canonical_order,
    check_runs,
    groups_for,
)
from refrun.acceptance.comparing import run_comparison
from refrun.acceptance.criteria import CriteriaFile
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData


# --- re-measuring a file ------------------------------------------------------------------------
@dataclass(frozen=True)
class Rejection:
    """A criterion that rejected (or could not judge) a held-out reference seed."""

    criterion: str
    held_out: str
    group: list[str]
    outcome: str
    reason: str


@dataclass(frozen=True)
class CheckReport:
    """``refrun calibrate --check``: every criterion judged on held-out seeds."""

    path: str
    run_ids: list[str]
    group_size: int
    trials: int
    judged: dict[str, int]  # criterion id -> trials in which it was evaluated
    rejections: list[Rejection]
    not_evaluable: list[Rejection]

    @property
    def ok(self) -> bool:
        return not self.rejections

    def rejecting(self) -> list[str]:
        return sorted({r.criterion for r in self.rejections})

    def text(self) -> str:
        lines = [f"{self.path}: {self.trials} held-out trials ({len(self.run_ids)} seeds, "
                 f"groups of {self.group_size})"]
        for cid, n in self.judged.items():
            rej = [r for r in self.rejections if r.criterion == cid]
            lines.append(f"  {cid:<36} {'REJECTS' if rej else 'ok':<8} "
                         f"{len(rej)}/{n} held-out seeds rejected")
            for r in rej[:3]:
                lines.append(f"      seed run {r.held_out}: {r.reason}")
        for r in self.not_evaluable[:5]:
            lines.append(f"  note: {r.criterion} not evaluable for {r.held_out}: {r.reason}")
        lines.append("every criterion accepts every held-out seed" if self.ok else
                     f"criteria that reject a held-out seed: {', '.join(self.rejecting())}")
        return "\n".join(lines)


def check_file(crit: CriteriaFile, references: Sequence[RunData], group_size: int | None = None,
               max_groups: int = 5) -> CheckReport:
    """Judge every criterion of ``crit`` with the real checks on each reference seed held
    out against groups of the others (group size: the file's ``[calibration]
    group_size``, else N - 1); lists every criterion that rejects a held-out seed."""
    runs = canonical_order(references)  # the held-out groups calibrate judged
    g = group_size or (crit.calibration.group_size if crit.calibration and
                       crit.calibration.group_size else len(runs) - 1)
    check_runs(runs, CalibrationOptions(group_size=min(g, len(runs) - 1)))
    g = min(g, len(runs) - 1)
    judged = {c.id: 0 for c in crit.criteria}
    rejections, gaps = [], []
    trials = 0
    for i, cand in enumerate(runs):
        for grp in groups_for(len(runs), i, g, max_groups):
            trials += 1
            refs = [runs[j] for j in grp]
            # The assessment's own comparison: the re-check judges what accept judges.
            comparison, why = run_comparison(crit, refs, cand)
            ctx = checks.Context(crit, refs, cand, comparison, why)
            for c in crit.criteria:
                r: CriterionResult = checks.evaluate(c, ctx)
                if r.outcome == FAIL:
                    rejections.append(Rejection(c.id, cand.run_id, [x.run_id for x in refs],
                                                r.outcome, r.reason))
                elif r.outcome == NOT_EVALUABLE:
                    gaps.append(Rejection(c.id, cand.run_id, [x.run_id for x in refs],
                                          r.outcome, r.reason))
                if r.outcome in (FAIL, PASS):
                    judged[c.id] += 1
    return CheckReport(crit.path, [r.run_id for r in runs], g, trials, judged, rejections,
                       gaps)
