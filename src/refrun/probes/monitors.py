"""Utilisation samplers (:class:`refrun.probes.base.Monitor`), one small class per source.

Shaped like MLflow's ``system_metrics`` monitors, but sampled by the probe's own thread
and logged against the *training step* current at the time (MLflow's system metrics use
their own counter, which cannot be aligned with training steps).

* :class:`PsutilMonitor`: system and process CPU and memory (psutil).
* :class:`NvmlMonitor`: NVIDIA GPU utilisation, memory and power (nvidia-ml-py/pynvml).

Each ``create()`` returns ``None`` when its library or device is missing, so
:func:`default_monitors` gives exactly the samplers this machine supports.

Metric names (all ``sys/...``; ``<i>`` is the NVML device index):

====================  =========================================================
``sys/cpu_pct``       system-wide CPU utilisation since the previous sample, %
``sys/mem_used_bytes`` system memory in use (total - available), bytes
``sys/mem_pct``       system memory in use, %
``sys/proc_cpu_pct``  this process's CPU since the previous sample, % of one core
``sys/rss_bytes``     this process's resident memory, bytes
``sys/gpu<i>_util_pct``  GPU busy time over NVML's last sampling period, %
``sys/gpu<i>_mem_bytes`` GPU memory in use, bytes
``sys/gpu<i>_mem_pct``   GPU memory in use / total, %
``sys/gpu<i>_power_w``   board power draw, watts
====================  =========================================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refrun import schema


@dataclass
class PsutilMonitor:
    """System and process CPU/memory through psutil (a dependency of refrun)."""

    name: str = "psutil"
    _psutil: Any = field(default=None, repr=False)
    _proc: Any = field(default=None, repr=False)

    @classmethod
    def create(cls, pid: int | None = None) -> PsutilMonitor | None:
        try:
            import psutil
        except ImportError:
            return None
        proc = psutil.Process(pid or os.getpid())
        # cpu_percent(None) measures since the previous call; the first call primes it.
        psutil.cpu_percent(None)
        proc.cpu_percent(None)
        return cls(_psutil=psutil, _proc=proc)

    def sample(self) -> dict[str, float]:
        ps = self._psutil
        vm = ps.virtual_memory()
        p = schema.SYS_PREFIX
        return {
            p + "cpu_pct": float(ps.cpu_percent(None)),
            p + "mem_used_bytes": float(vm.total - vm.available),
            p + "mem_pct": float(vm.percent),
            p + "proc_cpu_pct": float(self._proc.cpu_percent(None)),
            p + "rss_bytes": float(self._proc.memory_info().rss),
        }

    def close(self) -> None:
        return None


@dataclass
class NvmlMonitor:
    """NVIDIA GPUs through NVML.  A reading the device does not support (power on some
    boards, utilisation under MIG) is dropped after its first failure instead of being
    retried at every sample."""

    handles: dict[int, Any]
    name: str = "nvml"
    _nvml: Any = field(default=None, repr=False)
    _unsupported: set[tuple[int, str]] = field(default_factory=set, repr=False)

    @classmethod
    def create(cls, indices: Sequence[int] | None = None) -> NvmlMonitor | None:
        """A monitor over NVML devices ``indices`` (default: all); None without
        nvidia-ml-py, without the NVML library (no driver) or without devices."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            wanted = range(count) if indices is None else [i for i in indices if i < count]
            handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        except pynvml.NVMLError:
            return None
        if not handles:
            _shutdown(pynvml)
            return None
        return cls(handles=handles, _nvml=pynvml)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, h in self.handles.items():
            prefix = f"{schema.SYS_PREFIX}gpu{i}_"
            for key, read in (("util_pct", self._util), ("mem", self._mem),
                              ("power_w", self._power)):
                if (i, key) in self._unsupported:
                    continue
                try:
                    out.update({prefix + k: v for k, v in read(h).items()})
                except self._nvml.NVMLError:
                    self._unsupported.add((i, key))
        return out

    def _util(self, h: Any) -> dict[str, float]:
        return {"util_pct": float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)}

    def _mem(self, h: Any) -> dict[str, float]:
        m = self._nvml.nvmlDeviceGetMemoryInfo(h)
        return {"mem_bytes": float(m.used), "mem_pct": 100.0 * m.used / m.total if m.total
                else 0.0}

    def _power(self, h: Any) -> dict[str, float]:
        return {"power_w": self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0}  # milliwatts

    def close(self) -> None:
        _shutdown(self._nvml)


def _shutdown(pynvml: Any) -> None:
    # shutting down a half-initialised NVML must not raise at close
    with contextlib.suppress(Exception):
        pynvml.nvmlShutdown()


def default_monitors(gpu_indices: Sequence[int] | None = None) -> list[Any]:
    """Every sampler this machine supports: psutil always, NVML where a driver and
    NVIDIA devices exist."""
    found: list[Any] = []
    for mon in (PsutilMonitor.create(), NvmlMonitor.create(gpu_indices)):
        if mon is not None:
            found.append(mon)
    return found


def resolve_monitors(monitors: Sequence[Any] | str | None,
                     backend_monitors: Sequence[Callable[[], Any | None]] = (),
                     gpu_indices: Sequence[int] | None = None) -> list[Any]:
    """The one way every backend builds its samplers (so every backend records the same
    ``sys/*`` metrics by default).

    ``monitors="auto"`` (the default of every ``instrument``): :func:`default_monitors`
    plus the backend's own (``backend_monitors``: factories for the TPU runtime, JAX device
    memory ...; a factory returns None where this machine lacks the source).  ``None``: no
    sampling.  A list: exactly those.

    Raises :class:`~refrun.errors.RefrunInputError` for any other string.
    """
    from refrun.errors import RefrunInputError

    if monitors is None:
        return []
    if isinstance(monitors, str):
        if monitors != "auto":
            raise RefrunInputError(f"monitors: {monitors!r}; use 'auto', None or a list")
        own = [make() for make in backend_monitors]
        return default_monitors(gpu_indices) + [m for m in own if m is not None]
    return list(monitors)
