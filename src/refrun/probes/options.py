"""The one option set every probe takes (``refrun.torch/xla/jax.instrument``).

The options shared by every backend have one name, one default and one validation here;
what only one framework has (``count_cuda_syncs``, ``tpu_monitor``, ``transfer_guard`` ...)
stays a keyword of that framework's ``instrument``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refrun.errors import RefrunInputError
from refrun.probes.base import (
    DEFAULT_RECHECK_EVERY,
    DEFAULT_SAMPLE_INTERVAL_S,
    DEFAULT_WARMUP_STEPS,
    Monitor,
)
from refrun.probes.hardware import declared_hardware


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RefrunInputError(f"{name}: expected an integer >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeOptions:
    """What every probe is told, by the same names for every framework; invalid values
    raise :class:`RefrunInputError` from ``__post_init__``."""

    hardware: str | None = None
    """Where the run is meant to execute; default: the run's ``refrun.hardware`` tag.  A
    run meant for an accelerator that executes on the CPU (or a TPU run on a GPU) gets the
    placement warning.  PyTorch also takes a device here: ``"cuda"``, ``"cuda:1"``,
    ``"cpu"`` or ``"accelerator"`` (any non-CPU device)."""
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    """Step times left out of the steady-state summary (median/p90) and, for XLA, out of
    the "compilations after warm-up" count."""
    monitors: Sequence[Monitor] | str | None = "auto"
    """``"auto"`` (psutil, NVML where available, the backend's own sources: the same
    ``sys/*`` metrics for every backend), None (no sampling), or a list of monitors."""
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    """Seconds between ``sys/*`` samples."""
    recheck_every: int = DEFAULT_RECHECK_EVERY
    """Steps between placement re-checks (0: at start and close only)."""

    def __post_init__(self) -> None:
        if self.hardware is not None and (not isinstance(self.hardware, str)
                                          or not self.hardware.strip()):
            raise RefrunInputError(f"hardware: expected a hardware or device name, got "
                                   f"{self.hardware!r}")
        _count("warmup_steps", self.warmup_steps)
        _count("recheck_every", self.recheck_every)
        if isinstance(self.sample_interval_s, bool) or not isinstance(
                self.sample_interval_s, int | float) or not self.sample_interval_s > 0:
            raise RefrunInputError(f"sample_interval_s: expected seconds > 0, got "
                                   f"{self.sample_interval_s!r}")
        if isinstance(self.monitors, str) and self.monitors != "auto":
            raise RefrunInputError(f"monitors: {self.monitors!r}; use 'auto', None or a list")

    def declared(self, run: Any) -> str | None:
        """``hardware``, else what the run declared (its ``refrun.hardware`` tag)."""
        return self.hardware if self.hardware is not None else declared_hardware(run)


FIELDS = frozenset(f.name for f in dataclasses.fields(ProbeOptions))
#: Names ``instrument`` accepted before the option set was one: old name -> field.
ALIASES = {"expect_device": "hardware"}


def probe_options(options: ProbeOptions | None, keywords: Mapping[str, Any],
                  what: str) -> ProbeOptions:
    """The options of an ``instrument`` call: ``options=`` or the same fields as keywords
    (an old name of :data:`ALIASES` accepted), never both.

    Raises:
        TypeError: a keyword that is no field, or a field given twice.
        RefrunInputError: a value the field refuses.
    """
    given: dict[str, Any] = {}
    for key, value in keywords.items():
        name = ALIASES.get(key, key)
        if name not in FIELDS:
            raise TypeError(f"{what}() got an unexpected keyword argument {key!r} "
                            f"(probe options: {sorted(FIELDS)})")
        if name in given:
            raise TypeError(f"{what}(): {key!r} is the old name of {name!r}; pass one")
        given[name] = value
    if options is not None and given:
        raise TypeError(f"{what}(): pass the probe options either as options= or as "
                        f"keywords, not both (got {sorted(given)} beside options=)")
    return options if options is not None else ProbeOptions(**given)


def require_session(run: Any) -> None:
    """Refuse anything but the :class:`~refrun.recording.session.RunSession` of
    ``refrun.start_run`` as a probe's run (every backend alike, before any work)."""
    from refrun.recording.session import RunSession

    if not isinstance(run, RunSession):
        raise RefrunInputError(f"run: expected the RunSession of refrun.start_run, got "
                               f"{type(run).__name__}")
