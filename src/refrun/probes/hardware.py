"""What the run declared: one rule, for every backend, for "is this an accelerator?".

``refrun.hardware`` is free text (``a100``, ``tpu-v5e``, ``cpu``, ``host``).  Every probe
asks the same two questions of it: did the run declare an accelerator (so arrays on the
CPU are a placement problem), and which family (so ``tpu`` executing on ``gpu`` is one).
"""

from __future__ import annotations

from typing import Any, Literal

from refrun import schema

Family = Literal["tpu", "gpu", "cpu"]

# Declared-hardware words that name a GPU (vendor names and common model names).
_GPU_WORDS = ("gpu", "cuda", "rocm", "a100", "h100", "h200", "b200", "v100", "l4", "a10",
              "t4", "rtx", "mi2", "mi3")


def is_accelerator(hardware: str | None) -> bool:
    """True when the declared ``hardware`` names an accelerator.

    The rule: empty/None (nothing declared), ``cpu`` (and ``cpu-...``, ``cpu:...``),
    ``host`` and ``none`` are not accelerators; every other name is.  Case and surrounding
    spaces are ignored."""
    if hardware is None:
        return False
    s = str(hardware).strip().lower()
    return s not in schema.CPU_HARDWARE_NAMES and not s.startswith(("cpu", "host"))


def family(hardware: str | None) -> Family | None:
    """``"tpu"``, ``"gpu"`` or ``"cpu"`` for a declared or executing hardware name; None when
    the name says nothing checkable (``"neuron"``, empty ...).  Consistent with
    :func:`is_accelerator`: every name it calls a CPU is ``"cpu"`` here."""
    if not hardware or not str(hardware).strip():
        return None
    s = str(hardware).strip().lower()
    if not is_accelerator(s):
        return "cpu"
    if "tpu" in s:
        return "tpu"
    if any(w in s for w in _GPU_WORDS):
        return "gpu"
    return None


def declared_hardware(run: Any) -> str | None:
    """The run's ``refrun.hardware`` tag (what the user said the run uses), or None."""
    try:
        return run.tags.get(schema.TAG_HARDWARE)
    except Exception:  # an unreadable spool just means "nothing declared"
        return None
