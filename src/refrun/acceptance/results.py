"""Results of an assessment: one :class:`CriterionResult` per criterion, one
:class:`LevelResult` per level L0-L4, and the :class:`Assessment` that holds them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.util.jsonsafe import json_safe as clean

PASS, FAIL, NOT_EVALUABLE = "pass", "fail", "not_evaluable"
# A criterion scoped to other backends (its ``backends`` key): neither a pass nor a gap.
NOT_APPLICABLE = "not_applicable"
OUTCOMES = (PASS, FAIL, NOT_EVALUABLE, NOT_APPLICABLE)
# Level statuses: the outcomes (not_applicable: no criterion of the level applies to the
# candidate's backend), plus a level without criteria, plus L4 held back.
NO_CRITERIA, NOT_EVALUATED = "no_criteria", "not_evaluated"
FORMAT = schema.FORMAT_ASSESSMENT
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class CriterionResult:
    """The outcome of one criterion with the evidence values it was decided on."""

    id: str
    level: str
    kind: str
    outcome: str  # pass | fail | not_evaluable | not_applicable
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    metric: str | None = None
    description: str = ""
    evaluated: bool = True  # False: held back (L4 while L3 has not passed)

    def to_dict(self) -> dict[str, Any]:
        return clean(asdict(self))


@dataclass(frozen=True)
class LevelResult:
    """Status of a level: pass, fail, not_evaluable, not_applicable, no_criteria or
    not_evaluated."""

    level: str
    status: str
    passed: int
    failed: int
    not_evaluable: int
    note: str = ""
    not_applicable: int = 0


@dataclass(frozen=True)
class Assessment:
    """A candidate assessed against a workload's criteria, level by level."""

    criteria_path: str
    criteria_sha256: str
    workload: str
    reference_ids: list[str]
    candidate_id: str
    results: list[CriterionResult]
    levels: list[LevelResult]
    highest_level: str | None
    verdict: str  # pass (every applicable criterion passed) | fail (one failed) | incomplete
    measurements: list[dict[str, Any]]  # L1: observed differences per metric
    created_utc: str
    evidence_sha256: str = ""
    calibration_sha256: str | None = None  # refrun.acceptance.calibration.calibration_digest
    # Things a reader must see beside the verdict: criteria scoped to a backend no compared
    # run has, a candidate backend refrun does not know, a cross-workload assessment.
    warnings: list[str] = field(default_factory=list)
    cross_workload: str = ""  # the note when --allow-cross-workload let workloads differ
    # The axis runs were aligned on and its source (refrun.acceptance.alignment).
    alignment: dict[str, str] = field(default_factory=dict)
    # The candidate's same-seed pair (refrun.acceptance.paired.PairLookup.to_dict()): what
    # it declared, the run found and how; empty when it declares none.
    pair: dict[str, Any] = field(default_factory=dict)
    # Where the candidate's numerics configuration differs from the references'
    # (refrun.acceptance.assess.numerics_differences); empty when it does not.
    numerics: dict[str, Any] = field(default_factory=dict)
    # A migrated candidate's throughput, cost per run and chip busy fraction against its
    # references' (refrun.acceptance.performance.Performance.to_dict()): measurements,
    # judged only by the file's L4 criteria; empty for a candidate on the references'
    # configuration.
    performance: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 when every criterion passed or was not applicable, else 1 (the CLI's
        contract)."""
        return 0 if self.verdict == PASS else 1

    def result(self, cid: str) -> CriterionResult:
        for r in self.results:
            if r.id == cid:
                return r
        raise KeyError(cid)

    def level(self, name: str) -> LevelResult:
        return next(lv for lv in self.levels if lv.level == name)

    def to_dict(self) -> dict[str, Any]:
        # "pair" only when the candidate declared one: assessments recorded before it
        # existed still verify unchanged.
        extra: dict[str, Any] = {"pair": self.pair} if self.pair else {}
        if self.numerics:  # likewise
            extra["numerics"] = self.numerics
        if self.performance:  # a migration only: other assessments are as they were
            extra["performance"] = self.performance
        return clean({
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "created_utc": self.created_utc, "workload": self.workload,
            "criteria": {"path": self.criteria_path, "sha256": self.criteria_sha256},
            "reference": self.reference_ids, "candidate": self.candidate_id,
            "verdict": self.verdict, "highest_level": self.highest_level,
            "evidence_sha256": self.evidence_sha256,
            "calibration_sha256": self.calibration_sha256,
            "levels": [asdict(lv) for lv in self.levels],
            "results": [r.to_dict() for r in self.results],
            "measurements": self.measurements,
            "warnings": self.warnings, "cross_workload": self.cross_workload,
            "alignment": self.alignment, **extra,
        })

    def write_json(self, path: str | Path) -> Path:
        from refrun.util.outputs import write_output

        return write_output(path, json.dumps(self.to_dict(), indent=1, allow_nan=False)
                            + "\n", "--json")

    def table(self) -> str:
        """A plain-text table: level, criterion, outcome, reason."""
        rows = [("level", "criterion", "kind", "outcome", "evidence / reason")]
        for r in self.results:
            rows.append((r.level, r.id, r.kind, r.outcome.upper(), r.reason))
        w = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row[:4])) + "  " + row[4]
                 for row in rows]
        lines.append("")
        lines.append("levels: " + ", ".join(f"{lv.level} {lv.status}" for lv in self.levels))
        lines.append(f"highest level reached: {self.highest_level or 'none'}; "
                     f"verdict: {self.verdict}"
                     + (f" ({self.cross_workload})" if self.cross_workload else ""))
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


