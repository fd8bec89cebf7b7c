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
``sys/rss_bytes``     this process's host memory: resident set less the device
                      mappings it holds (refrun.probes.host_memory), bytes
``sys/device_mapped_bytes`` the resident bytes of those device mappings (an
                      accelerator's memory windows); from the first sample that
                      finds one
``sys/run_cpu_cores`` CPU of this process and its descendants since the previous
                      sample, cores (the run's own work: workers, delivery process)
``sys/others_cpu_cores`` CPU of every other process since the previous sample, cores:
                      system busy cores (``cpu_pct`` x logical CPUs / 100) minus the
                      run's own, at least 0 (how busy others kept the machine)
``sys/logical_cpus``  the machine's logical CPU count
``sys/gpu<i>_util_pct``  GPU busy time over NVML's last sampling period, %
``sys/gpu<i>_mem_bytes`` GPU memory in use, bytes
``sys/gpu<i>_mem_pct``   GPU memory in use / total, %
``sys/gpu<i>_power_w``   board power draw, watts
====================  =========================================================

Readings that contradict what the process measures of itself are not recorded: where
``/proc/stat``'s CPU times do not advance, or their busy time advances less than half of
this process's own CPU time (a sandbox such as gVisor reports all zeros), ``sys/cpu_pct`` and
``sys/others_cpu_cores`` stop for the rest of the run and the tag
``refrun.sys.unavailable`` says why (:func:`cpu_contradiction`); a step-time criterion then
finds contention "not known" instead of an idle machine.  A monitor offers such tags
through ``tags()``, which the probe records with its description.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refrun import schema
from refrun.probes.host_memory import DeviceMappedReader

_CpuTimes = namedtuple("_CpuTimes", "user nice system idle iowait irq softirq steal guest "
                                    "guest_nice")


@dataclass
class PsutilMonitor:
    """System and process CPU/memory through psutil (a dependency of refrun).

    The CPU of other processes (``sys/others_cpu_cores``) is the system's busy cores less
    this process and its descendants: the run's children (the delivery process, DataLoader
    workers) are its own work, and a candidate slowed by its own work must not look like a
    busy machine.  Children are kept across samples (``cpu_percent(None)`` measures since
    the object's previous call); a child first seen at a sample counts from that sample on
    (its CPU before that counts as others'); a child that vanished is dropped.  Reading
    the tree costs one pass over ``/proc`` per sample, on the sampler thread.

    The system's figures are checked against the run's own at every sample
    (:func:`cpu_contradiction`); once they contradict it they are dropped for the rest of
    the run and :meth:`tags` says why.  ``system_times`` reads the system's CPU times
    (default ``psutil.cpu_times``; :func:`proc_stat_times` reads a ``/proc/stat`` text)."""

    name: str = "psutil"
    _psutil: Any = field(default=None, repr=False)
    _proc: Any = field(default=None, repr=False)
    _children: dict[int, Any] = field(default_factory=dict, repr=False)
    _ncpu: int = field(default=1, repr=False)
    _cpu_times: Any = field(default=None, repr=False)  # system CPU times at the last sample
    _system_times: Callable[[], Any] | None = field(default=None, repr=False)
    _last_wall: float = field(default=0.0, repr=False)
    _cpu_unavailable: str | None = field(default=None, repr=False)
    _mapped: DeviceMappedReader = field(default_factory=DeviceMappedReader, repr=False)
    _mapped_seen: bool = field(default=False, repr=False)

    @classmethod
    def create(cls, pid: int | None = None,
               system_times: Callable[[], Any] | None = None) -> PsutilMonitor | None:
        try:
            import psutil
        except ImportError:
            return None
        proc = psutil.Process(pid or os.getpid())
        # Process.cpu_percent(None) measures since the object's previous call; this primes
        # it.  The system's share is computed from cpu_times() kept here, not with
        # psutil.cpu_percent(None): psutil (>= 5.9.6) keeps that one's previous reading
        # per *thread*, so priming it here, on the creating thread, left the sampler
        # thread's first sample at 0.0 % (and others' CPU at 0), which halved the median
        # of a run with two samples.
        proc.cpu_percent(None)
        read = system_times or psutil.cpu_times
        mon = cls(_psutil=psutil, _proc=proc, _ncpu=psutil.cpu_count() or 1,
                  _cpu_times=read(), _system_times=read, _last_wall=time.monotonic(),
                  _mapped=DeviceMappedReader(str(pid) if pid else "self"))
        mon._children_cores()  # primes the children's counters too
        return mon

    def sample(self) -> dict[str, float]:
        ps = self._psutil
        vm = ps.virtual_memory()
        p = schema.SYS_PREFIX
        read = self._system_times or ps.cpu_times
        now, wall = read(), time.monotonic()
        before, self._cpu_times = self._cpu_times, now
        interval, self._last_wall = wall - self._last_wall, wall
        proc_pct = float(self._proc.cpu_percent(None))
        out = {
            p + "mem_used_bytes": float(vm.total - vm.available),
            p + "mem_pct": float(vm.percent),
            p + "proc_cpu_pct": proc_pct,
        }
        out.update(self._memory())
        children = self._children_cores()
        own = proc_pct / 100.0 + (children or 0.0)
        if self._cpu_unavailable is None:
            self._cpu_unavailable = cpu_contradiction(before, now, own * interval, interval,
                                                      self._ncpu)
        cpu_pct = None if self._cpu_unavailable else busy_percent(before, now)
        if cpu_pct is not None:
            out[schema.M_SYS_CPU_PCT] = cpu_pct
        if children is not None:  # the tree could not be read: no contention figures
            out[schema.M_SYS_RUN_CPU_CORES] = own
            if cpu_pct is not None:
                out[schema.M_SYS_OTHERS_CPU_CORES] = others_cpu_cores(cpu_pct, self._ncpu,
                                                                      own)
            out[schema.M_SYS_LOGICAL_CPUS] = float(self._ncpu)
        return out

    def _memory(self) -> dict[str, float]:
        """Host memory (the resident set less device mappings) and, once the process
        holds any, the device mappings' resident bytes."""
        rss = float(self._proc.memory_info().rss)
        mapped = self._mapped.read()
        out = {schema.M_SYS_RSS_BYTES: rss - (mapped or 0)}
        if mapped:
            self._mapped_seen = True
        if self._mapped_seen and mapped is not None:
            out[schema.M_SYS_DEVICE_MAPPED_BYTES] = float(mapped)
        return out

    def tags(self) -> dict[str, str]:
        """``refrun.sys.unavailable`` once a reading was dropped (see the class doc)."""
        why = []
        if self._cpu_unavailable:
            why.append(f"{schema.M_SYS_CPU_PCT}, {schema.M_SYS_OTHERS_CPU_CORES}: "
                       f"{self._cpu_unavailable}")
        if self._mapped.why_not:
            why.append(f"{schema.M_SYS_DEVICE_MAPPED_BYTES}: {self._mapped.why_not} "
                       f"({schema.M_SYS_RSS_BYTES} includes device mappings)")
        return {schema.TAG_SYS_UNAVAILABLE: "; ".join(why)} if why else {}

    def _children_cores(self) -> float | None:
        """Cores used by this process's descendants since the previous call (a new child
        primed, reading 0); None when the process table cannot be read at all."""
        ps = self._psutil
        try:
            now = {c.pid: c for c in self._proc.children(recursive=True)}
        except ps.Error:
            return None
        total = 0.0
        for pid, child in now.items():
            known = self._children.get(pid)
            # A reused pid is another process: psutil.Process compares by pid and start time.
            if known is None or known != child:
                self._children[pid] = child
                known = child
            try:
                total += known.cpu_percent(None) / 100.0
            except ps.Error:  # vanished (or hidden) since it was listed: skipped
                self._children.pop(pid, None)
        for gone in set(self._children) - set(now):
            del self._children[gone]
        return total

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

    def tags(self) -> dict[str, str]:
        """``refrun.exec.utilization_source``: NVML, or why not (utilisation unsupported on every
        device, e.g. under MIG)."""
        unread = [i for i in self.handles if (i, "util_pct") in self._unsupported]
        if unread and len(unread) == len(self.handles):
            return {schema.TAG_UTILIZATION_SOURCE: f"{schema.UTILIZATION_UNAVAILABLE}: nvml: "
                    f"utilisation not supported on gpu {', '.join(map(str, unread))}"}
        return {schema.TAG_UTILIZATION_SOURCE: "nvml: nvmlDeviceGetUtilizationRates().gpu, "
                "the share of NVML's sample period a kernel ran"}

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


def busy_percent(before: Any, after: Any) -> float:
    """System-wide busy CPU between two ``psutil.cpu_times()`` readings, in %.

    ``100 (busy_2 - busy_1) / (total_2 - total_1)`` with ``total`` the sum of the fields
    less ``guest`` and ``guest_nice`` (Linux counts them in ``user`` and ``nice``
    already) and ``busy = total - idle - iowait``: psutil's own definition
    (``psutil.cpu_percent``, psutil/__init__.py, ``_cpu_tot_time`` and
    ``_cpu_busy_time``), kept per monitor instead of per thread.  0.0 when no time
    passed."""
    def total(t: Any) -> float:
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def busy(t: Any) -> float:
        return total(t) - t.idle - getattr(t, "iowait", 0.0)

    all_delta = total(after) - total(before)
    if all_delta <= 0:
        return 0.0
    return round(min(100.0, max(0.0, 100.0 * (busy(after) - busy(before)) / all_delta)), 1)


def _cpu_seconds(t: Any) -> tuple[float, float]:
    """``(total, busy)`` CPU seconds of a ``cpu_times()`` reading (psutil's definitions,
    as in :func:`busy_percent`)."""
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total, total - t.idle - getattr(t, "iowait", 0.0)


# Below this much wall time between two readings, /proc/stat may rightly not have moved.
MIN_INTERVAL_S = 0.05
# The granularity of /proc/stat and of a process's CPU times: USER_HZ ticks (100 a second
# on Linux), per CPU for the system's counters.
TICK_S = 0.01


def cpu_contradiction(before: Any, after: Any, own_cpu_s: float, interval_s: float,
                      logical_cpus: int) -> str | None:
    """Why two system CPU readings contradict this run's own CPU use; None when they agree.

    The system's counters include every process's time, this run's too, so over an
    interval of ``interval_s`` wall seconds in which the run used ``own_cpu_s`` CPU
    seconds (its process tree, from ``/proc/<pid>/stat``):

    * their total (busy + idle) must advance when wall time passes (``interval_s >=``
      :data:`MIN_INTERVAL_S`): every CPU is either busy or idle;
    * their busy time must advance by at least half of ``own_cpu_s`` less the readings'
      granularity (:data:`TICK_S` per logical CPU and one for the process): the system's
      counters are sampled at ticks, a process's own time is not, so a busy time a few
      ticks short of the run's is sampling; one under half of it is not.

    A sandbox that serves a ``/proc/stat`` of zeros (gVisor) fails both; the system's
    busy share (``sys/cpu_pct``) and others' CPU (``sys/others_cpu_cores``) computed from
    it would read "idle" while the run itself kept three cores busy."""
    total_0, busy_0 = _cpu_seconds(before)
    total_1, busy_1 = _cpu_seconds(after)
    if interval_s >= MIN_INTERVAL_S and total_1 - total_0 <= 0:
        return (f"/proc/stat's CPU times did not advance in {interval_s:.2f} s "
                f"(this process used {own_cpu_s:.2f} CPU seconds)")
    slack = TICK_S * (logical_cpus + 1)
    if busy_1 - busy_0 + slack < 0.5 * own_cpu_s:
        return (f"/proc/stat's busy CPU time advanced {busy_1 - busy_0:.2f} s in "
                f"{interval_s:.2f} s while this process used {own_cpu_s:.2f} CPU seconds")
    return None


def proc_stat_times(text: str) -> Any:
    """The aggregate ``cpu`` line of a ``/proc/stat`` text as ``psutil.cpu_times()`` gives
    it: a named tuple of seconds (``user nice system idle iowait irq softirq steal guest
    guest_nice``; USER_HZ = 100 ticks a second, as psutil assumes on Linux)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(v) for v in fields[1:11]] + [0] * (11 - len(fields))
            return _CpuTimes(*(v * TICK_S for v in ticks[:10]))
    raise ValueError("/proc/stat: no aggregate 'cpu' line")


def others_cpu_cores(cpu_pct: float, logical_cpus: int, own_cores: float) -> float:
    """Cores used by other processes: ``max(0, cpu_pct / 100 * logical_cpus - own)``.

    ``cpu_pct`` is the system's busy share of all logical CPUs over an interval
    (``psutil.cpu_percent``), ``own_cores`` the run's process tree's CPU over the same
    interval in cores (``Process.cpu_percent`` / 100 summed); sampling both at slightly
    different instants can make the difference negative, clamped to 0."""
    return max(0.0, cpu_pct / 100.0 * logical_cpus - own_cores)


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
