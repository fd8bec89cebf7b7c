"""Whether a candidate is a migration: it ran on other hardware, another backend or another
chip count than its references.

A candidate on the references' own configuration (another seed, another logging cadence)
is judged for speed by the same-machine ``step_time`` criterion.  A migrated one is not
(a step-time ratio between frameworks or chips says nothing against a limit calibrated on
one machine); what L4 judges for it is throughput, cost and chip busy fraction against
the references' (:mod:`refrun.acceptance.performance`), and criteria with
``migration_only = true`` apply to it alone.  Pure functions of the runs' identity tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refrun import identity, schema
from refrun.comparison import RunData


@dataclass(frozen=True)
class Configuration:
    """Where and how one run executed, from its tags: hardware (declared
    ``refrun.hardware``, else the executing ``refrun.exec.hardware``), backend
    (``refrun.backend``) and chips (``refrun.chips``, else ``refrun.exec.devices``).
    ``None``: not recorded."""

    hardware: str | None
    backend: str | None
    chips: int | None

    def text(self) -> str:
        """``jax on tpu-v5e x4`` (``?`` for what the run does not say)."""
        chips = f" x{self.chips}" if self.chips is not None else ""
        return f"{self.backend or '?'} on {self.hardware or '?'}{chips}"

    def comparable_with(self, other: Configuration) -> bool:
        """True when both runs record at least one of the three fields."""
        return any(a is not None and b is not None for a, b in (
            (self.hardware, other.hardware), (self.backend, other.backend),
            (self.chips, other.chips)))

    def differs_from(self, other: Configuration) -> bool:
        """True when a field both runs record differs (a field one run does not record
        cannot tell a migration from the same configuration)."""
        return any(a is not None and b is not None and a != b for a, b in (
            (self.hardware, other.hardware), (self.backend, other.backend),
            (self.chips, other.chips)))


def _int_tag(run: RunData, tag: str) -> int | None:
    v = run.tags.get(tag)
    return int(v) if v is not None and v.strip().isdigit() else None


def configuration(run: RunData) -> Configuration:
    """The run's :class:`Configuration` (names in canonical form, alias-aware)."""
    hw = None
    for tag in (schema.TAG_HARDWARE, schema.TAG_EXEC_HARDWARE):
        v = run.tags.get(tag)
        if v and v.strip():
            hw = identity.canonical_hardware(v) or v.strip().lower()
            break
    b = run.backend
    backend = (identity.canonical_backend(b) or b.strip().lower()) if b and b.strip() else None
    chips = _int_tag(run, schema.TAG_CHIPS)
    if chips is None:
        chips = _int_tag(run, schema.TAG_EXEC_DEVICES)
    return Configuration(hw, backend, chips)


def migration(candidate: RunData, references: Sequence[RunData]) -> str | None:
    """``"torch on nvidia-l4 x1 -> jax on tpu-v5e x1"`` when the candidate's configuration
    differs from every reference's (:meth:`Configuration.differs_from`), else None (the
    candidate runs as one of the references did, or the tags cannot tell)."""
    cand = configuration(candidate)
    refs = [configuration(r) for r in references]
    if not refs or not all(cand.differs_from(r) for r in refs):
        return None
    ref_text = ", ".join(sorted({r.text() for r in refs}))
    return f"{ref_text} -> {cand.text()}"


def undecided(candidate: RunData, references: Sequence[RunData]) -> str | None:
    """Why the tags cannot tell whether the candidate is a migration (it and a reference
    share no recorded field, or there is no reference), else None."""
    cand = configuration(candidate)
    refs = [(r.run_id, configuration(r)) for r in references]
    if not refs:
        return "no reference run"
    blind = [rid for rid, c in refs if not cand.comparable_with(c)]
    if blind:
        return (f"the candidate ({cand.text()}) and reference {blind[0]} share no recorded "
                f"{schema.TAG_HARDWARE}, {schema.TAG_BACKEND} or {schema.TAG_CHIPS}: "
                "whether it is a migration is unknown")
    return None
