"""The PyTorch/XLA backend of :class:`refrun.probes.base.Probe` (TPU, GPU or PJRT CPU).

PyTorch/XLA traces a step lazily and runs it as one compiled graph at ``torch_xla.sync()``
(``xm.mark_step``).  A step that silently compiles again, pulls data to the host or falls
back to the CPU keeps training, only tens of times slower; this backend records each of
those per step, and what hardware really executed.

Counters (cumulative; the probe logs per-step deltas under :mod:`refrun.schema` names),
read from ``torch_xla.debug.metrics`` through the cheap ``_XLAC`` accessors:

=========================  =============================================================
``compile/graphs``         ``UncachedCompile`` counter (a new XLA graph compiled)
``compile/cache_hits``     ``CachedCompile`` counter (graph found in the in-memory cache)
``compile/time_s``         ``CompileTime`` metric accumulator (ns) / 1e9
``exec/count``             ``ExecuteComputation`` counter (``ExecuteTime`` count if absent)
``exec/time_s``            ``ExecuteTime`` accumulator (ns) / 1e9
``xfer/d2h``               ``TransferFromDeviceTime`` sample count inside the step
``xfer/h2d``               ``TransferToDeviceTime`` sample count
``xfer/host_syncs``        ``aten::_local_scalar_dense`` counter inside the step
``fallback/ops``           sum of the other ``aten::*`` counters (ops run on the CPU)
=========================  =============================================================

``xfer/d2h`` counts every device-to-host copy the step makes: ``.cpu()``, ``.to("cpu")``,
``.cpu().numpy()``, ``.tolist()``, printing or formatting a tensor, and ``.item()`` /
``float()`` / ``bool()`` (each one ``TransferFromDevice``, verified against torch_xla
2.9 on PJRT CPU; ``.numpy()`` of an XLA tensor raises); ``xfer/host_syncs`` the subset
that goes through ``aten::_local_scalar_dense`` (``.item()``, ``float()``, ``bool()``).
Both are counted between the step's entry and exit only: a deliberate host read between
steps (a progress print, an evaluation) is not the step's, whatever the evaluation
cadence.  The exact count (``TransferFromDeviceTime``) is a metric whose read copies up to
1024 samples, so it is read only when a cheap counter shows a copy may have happened
(:class:`TransferCount`, checked exactly at every warm-up step and one step in 64).

Compilation and transfer counts are exact per step (recorded on the training thread);
execution counts and times are recorded by the runtime when an asynchronous execution
finishes, so they can land in the following step.

**Values** given to ``probe.log`` never cause a graph, a transfer or a wait inside the step:
the backend keeps a reference to the value (no new op, so the traced graph is unchanged;
see :func:`_held`); once a ``sync`` has materialised it, it asks the runtime for a readiness
callback (``_XLAC._on_ready_callback``), and when the device buffer is complete -- the
device idle -- or 64 values or 30 s have piled up (see :meth:`XlaBackend.ready`), the
materialised values are handed to the backend's copier thread (:class:`_Copier`), which
copies them to the host in one batched ``_xla_get_cpu_tensors`` call (waiting there, not
on the training thread, for a buffer still being computed).  That copy is a device-to-host
transfer made at any moment, steps included; each is one sample of torch_xla's
exact count, which :meth:`TransferCount.user_copies` subtracts, so ``xfer/d2h`` shows only
the user's transfers.

**Device truth**: the XLA device prints as ``xla:0`` whatever it is, so the tags record
``xm.xla_device_hw`` (``refrun.exec.hardware``), ``torch_xla.runtime.device_type()``,
the global device count and the world size.  A run that declares TPU or GPU hardware but
executes on the CPU, or whose parameters are not on the XLA device, gets
``refrun.placement.warning`` (the probe records it as a run warning too).

**Summary** at close: compilations after warm-up, transfers per step, fallback ops by
name, as ``refrun.summary.*`` / ``refrun.fallback.ops`` tags and the
``refrun/xla_summary.json`` and ``refrun/fallback_ops.json`` artifacts, handed to the probe
through the :class:`~refrun.probes.base.BackendBase` hooks (the backend never writes to
the run itself).

``torch_xla`` is imported only when an :class:`XlaBackend` is created.
"""

from __future__ import annotations

import json
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refrun import schema
from refrun.probes.base import BackendBase, OnePerProcess
from refrun.probes.hardware import family as hardware_family
from refrun.probes.tensors import (
    count_devices,
    host_float,
    optimizer_state_tensors,
    parameters_of,
)

HOST_SYNC_OP = "aten::_local_scalar_dense"
# torch's dispatcher copies an XLA tensor to the host through these ops, each a torch_xla
# counter (~0.3 us to read): ``.cpu()``, ``.to("cpu")``, ``.tolist()``, printing
# (``xla::_to_copy`` without ``xla::_copy_from``); ``.item()``, ``float()``, ``bool()``
# (``xla::_to_cpu`` and the host sync ``aten::_local_scalar_dense``).  A copy to the device
# or a dtype cast on it moves ``xla::_to_copy`` *and* ``xla::_copy_from`` (torch_xla 2.9).
TO_COPY, COPY_FROM, TO_CPU = "xla::_to_copy", "xla::_copy_from", "xla::_to_cpu"
# Every warm-up step and one steady step in this many is also counted exactly, which checks
# the sentinels against torch_xla's exact count (see TransferCount).
EXACT_EVERY = 64
# Logged values wait on the device until it is idle, at most this many or this long
# (see XlaBackend.ready); the device keeps a scalar buffer per waiting value.  The count is
# small because a waiting value is a live XLA tensor, and every ``torch_xla.sync()`` walks
# the device's live tensors: each one held cost the training thread 0.1-0.25 us a step
# on PJRT CPU (a plain MLP loop holding 1,000 logged losses: +130 us of thread CPU a
# 1 ms step, docs/xla.md), which at one flush interval of values (~1,000 on a 1 ms step)
# was three times the probe's own work.
TRANSFER_MAX_WAITING = 64
TRANSFER_MAX_AGE_S = 30.0
# How often a readiness callback is asked for (on the newest logged value), and so how often
# ready values are copied, unless the session says otherwise: a callback costs ~0.1-0.25 ms
# and a copy ~0.5 ms on a step of many operations, however few values it holds.  Values
# handed to the session sooner than the spool writes them (every ``flush_interval_s``)
# reach no reader sooner, so ``refrun.xla.instrument`` sets the backend's interval to the
# session's flush interval; this default (the flush interval's default) is for a backend
# built by hand.  At 0.25 s the two were ~40 us of a 21 ms GRU step
# (bench_xla_probe.py --model rnn).
ARM_INTERVAL_S = 1.0
# Ended steps' counter rows kept before they are added to the end-of-run summary's sums
# (SummaryTally): bounds the backend's memory on long runs at the cost of one fold on the
# training thread in this many steps.
FOLD_ROWS = 4096
# The longest the training thread waits for the copier thread's copy in flight (an exact
# copy count read while it runs; see TransferCount.user_copies), and close for each value:
# one batched copy of finished buffers takes milliseconds, so a wait this long means the
# device does not answer, and from then on nobody waits for the copier.
COPY_WAIT_S = 10.0


@dataclass(slots=True)
class _XlaValue:
    """A logged XLA tensor: read once a sync materialised it and its buffer is complete."""

    tensor: torch.Tensor
    version: int
    event: threading.Event | None = None  # readiness callback (only on some values)
    value: float | None = None  # set by the copier's thread
    sent: bool = False  # handed to the copier (no longer in the backend's waiting list)
    error: Exception | None = None  # the copy failed (set by the copier's thread)


class _Copier:
    """Copies logged values' device buffers to the host on a thread of its own.

    ``_xla_get_cpu_tensors`` costs ~0.15 ms of CPU per scalar buffer on PJRT CPU (1.2 ms
    for the eight values a second of a 115 ms GRU step logs: a quarter of the probe's own
    work on the training thread, docs/research/xla-probe-cost.md) and releases the GIL
    while it copies, so made here it costs the training thread nothing.

    ``started`` and ``finished`` count the copy calls begun and returned.  Each call adds
    one sample to torch_xla's ``TransferFromDeviceTime`` between its two increments (the
    metric is timed inside the runtime's transfer, failed transfers included), so a reading
    of that count taken while no call is in flight holds exactly ``finished`` of the
    probe's samples (:meth:`TransferCount.user_copies`)."""

    def __init__(self, xlac: Any) -> None:
        self._xlac = xlac
        self._cv = threading.Condition()
        self._queue: deque[list[_XlaValue]] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.started = 0
        self.finished = 0
        # A wait for a copy timed out (a device that does not answer): nobody waits again.
        self.stuck = False

    def submit(self, handles: list[_XlaValue]) -> None:
        """Queue one batched copy of ``handles`` (in log order); never waits."""
        for h in handles:
            h.sent = True
        with self._cv:
            self._queue.append(handles)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="refrun-xla-copier")
                self._thread.start()
            self._cv.notify()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no copy call is in flight (one batched copy at most: a few ms); False if
        one is still in flight after ``timeout`` or an earlier wait timed out."""
        return self._wait(lambda: self.started == self.finished, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Until every submitted copy has returned."""
        return self._wait(lambda: not self._queue and self.started == self.finished, timeout)

    def wait_done(self, h: _XlaValue, timeout: float | None = None) -> bool:
        """Until ``h`` (already submitted) has its value or its error."""
        return self._wait(lambda: h.value is not None or h.error is not None, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        with self._cv:
            if self.stuck:
                return done()
            if not self._cv.wait_for(done, COPY_WAIT_S if timeout is None else timeout):
                self.stuck = True
                return False
            return True

    def close(self, timeout: float | None = None) -> None:
        """Copy what is queued, then stop the thread (a stuck one is left, as a daemon)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and not self.stuck:
            thread.join(COPY_WAIT_S if timeout is None else timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self._closing:
                        return
                    self._cv.wait()
                handles = self._queue.popleft()
            if not self._copy(handles) and len(handles) > 1:
                for h in handles:  # one unreadable buffer fails the whole batch
                    self._copy([h])

    def _copy(self, handles: list[_XlaValue]) -> bool:
        with self._cv:
            self.started += 1
        try:
            get = DIRECT_COPIES.get_cpu_tensors(self._xlac)  # not counted as the user's
            values = [host_float(t) for t in get([h.tensor for h in handles])]
        except Exception as exc:  # e.g. a buffer donated by an in-place update
            error: Exception | None = exc
        else:
            error = None
        with self._cv:
            self.finished += 1
            for i, h in enumerate(handles):
                if error is None:
                    h.value = values[i]
                    h.tensor = _RELEASED  # drop the device buffer reference
                elif len(handles) == 1:
                    h.error = RuntimeError(
                        f"a logged value could not be copied to the host and is not "
                        f"recorded ({error}); updating a logged tensor in place can "
                        "reuse its buffer before the copy (log a tensor you do not update)")
            self._cv.notify_all()
        return error is None


@dataclass
class XlaSummary:
    """Per-run summary acceptance criteria can check (counts per step are means)."""

    steps: int
    warmup_steps: int
    compiles_total: int
    compiles_after_warmup: int
    compile_steps_after_warmup: list[int]
    d2h_per_step: float
    h2d_per_step: float
    host_syncs_per_step: float
    fallback_ops_total: int
    fallback_ops: dict[str, int]
    fallback_first_step: dict[str, int]
    compile_time_s: float
    exec_count_per_step: float

    def tags(self) -> dict[str, Any]:
        """Scalar fields as ``refrun.summary.*`` tags, fallback names as ``refrun.fallback.ops``."""
        p = schema.TAG_SUMMARY_PREFIX
        return {
            p + "steps": self.steps,
            p + "warmup_steps": self.warmup_steps,
            p + "compiles_total": self.compiles_total,
            p + "compiles_after_warmup": self.compiles_after_warmup,
            p + "compile_steps_after_warmup": len(self.compile_steps_after_warmup),
            p + "d2h_per_step": f"{self.d2h_per_step:.6g}",
            p + "h2d_per_step": f"{self.h2d_per_step:.6g}",
            p + "host_syncs_per_step": f"{self.host_syncs_per_step:.6g}",
            p + "fallback_ops": self.fallback_ops_total,
            schema.TAG_FALLBACK_OPS: json.dumps(self.fallback_ops, sort_keys=True),
        }


@dataclass
class SummaryTally:
    """:class:`XlaSummary`'s sums, kept as steps are added: what a run's summary needs
    without holding a record per step (a million-step run held ~150 MB of rows).

    "After warm-up" is every step after the first ``warmup_steps`` added ones; per-step
    means are over those steps, or over all steps when the run is shorter than the
    warm-up.  Fallback ops are kept by step only for the steps that ran one."""

    warmup_steps: int
    steps: int = 0
    total: dict[str, float] = field(default_factory=dict)  # over every step
    after: dict[str, float] = field(default_factory=dict)  # over steps after warm-up
    compile_steps_after: list[int] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    fallback_steps: dict[int, dict[str, int]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)  # every per-step counter seen

    def add_rows(self, names: Sequence[str], base: Sequence[float],
                 rows: Sequence[tuple[int, Sequence[float], dict[str, int] | None]]) -> None:
        """Add the steps whose cumulative counter rows (``names`` order) follow the reading
        ``base``: sums are differences of two rows, so only the compile column and the
        fallback ops are looked at step by step (a fold of 4,096 rows cost ~11 ms of the
        training thread through per-step records)."""
        if not rows:
            return
        w, before = self.warmup_steps, self.steps
        compile_at = names.index(schema.M_COMPILE_GRAPHS)
        prev = base[compile_at]
        for i, (step, row, ops) in enumerate(rows):
            if before + i >= w and row[compile_at] > prev:
                self.compile_steps_after.append(step)
            prev = row[compile_at]
            if ops:
                self._add_fallback(step, ops)
        last = rows[-1][1]
        # the cumulative reading at the end of warm-up, when it falls in or before this block
        start = base if before >= w else rows[w - before - 1][1] if before + len(rows) > w \
            else None
        for k, name in enumerate(names):
            self.total[name] = self.total.get(name, 0.0) + (last[k] - base[k])
            if start is not None:
                self.after[name] = self.after.get(name, 0.0) + (last[k] - start[k])
        self.names.update(names)
        self.steps += len(rows)

    def _add_fallback(self, step: int, ops: Mapping[str, int]) -> None:
        self.fallback_steps[step] = dict(ops)
        for name, n in ops.items():
            self.ops[name] = self.ops.get(name, 0) + n
            self.first.setdefault(name, step)

    def summary(self) -> XlaSummary:
        n_after = self.steps - min(self.steps, self.warmup_steps)
        steady, n = (self.after, n_after) if n_after else (self.total, self.steps)

        def mean(key: str) -> float:
            return steady.get(key, 0.0) / n if n else 0.0

        return XlaSummary(
            steps=self.steps, warmup_steps=self.warmup_steps,
            compiles_total=int(self.total.get(schema.M_COMPILE_GRAPHS, 0.0)),
            compiles_after_warmup=int(self.after.get(schema.M_COMPILE_GRAPHS, 0.0)),
            compile_steps_after_warmup=list(self.compile_steps_after),
            d2h_per_step=mean(schema.M_XFER_D2H), h2d_per_step=mean(schema.M_XFER_H2D),
            host_syncs_per_step=mean(schema.M_HOST_SYNCS),
            fallback_ops_total=sum(self.ops.values()), fallback_ops=dict(self.ops),
            fallback_first_step=dict(self.first),
            compile_time_s=self.total.get(schema.M_COMPILE_TIME, 0.0),
            exec_count_per_step=mean(schema.M_EXECUTIONS),
        )


class _DirectCopies:
    """Counts calls of ``torch_xla._XLAC._xla_get_cpu_tensors`` made by anyone but the
    probe while a backend is open: the one host copy no torch op (so no sentinel counter)
    sees -- ``xm.save``, ``xm.mesh_reduce`` and torch_xla's checkpointing call it directly.
    The wrapper passes every argument through and adds one integer increment per call;
    the probe's own copies call the original.  Installed by the first open backend,
    removed when the last one closes."""

    def __init__(self) -> None:
        self.calls = 0
        self.original: Any = None
        self._users = 0
        self._lock = threading.Lock()

    def install(self, xlac: Any) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            original = self.original = xlac._xla_get_cpu_tensors

            def _xla_get_cpu_tensors(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return original(*args, **kwargs)

            xlac._xla_get_cpu_tensors = _xla_get_cpu_tensors

    def remove(self, xlac: Any) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self.original is not None:
                xlac._xla_get_cpu_tensors = self.original
                self.original = None

    def get_cpu_tensors(self, xlac: Any) -> Any:
        """The unwrapped function (the probe's own copies are not counted here)."""
        return self.original or xlac._xla_get_cpu_tensors


DIRECT_COPIES = _DirectCopies()

# torch_xla's counters are process-wide: a second backend open at the same time would take
# the first one's copies (its copier thread's) for transfers inside its own steps, count
# them in ``xfer/d2h`` and fall back to exact reads at every step.
_ONE_OPEN = OnePerProcess(
    "refrun.xla.instrument: another PyTorch/XLA probe is open in this process; "
    "torch_xla's counters are process-wide, so two open probes count each other's "
    "copies as their own steps' transfers: close the first probe (or its run) "
    "before instrumenting another")


class XlaCounters:
    """Cumulative torch_xla counters under schema names, read through ``_XLAC``.

    ``read()`` costs a handful of C calls plus one pass over the counter names (for the
    ``aten::*`` fallback counters); see ``benchmarks/bench_xla_probe.py``."""

    def __init__(self, xlac: Any) -> None:
        self._x = xlac
        self._compiles: tuple[int, float] = (-1, 0.0)  # (UncachedCompile, CompileTime ns)
        self._timed: tuple[int, float, int] | None = None  # ExecuteTime n, ns; h2d
        self._aten: list[str] = []  # fallback counter names as last listed
        self._to_cpu_listed = -1  # xla::_to_cpu when they were listed
        self._to_cpu_now: int | None = None  # xla::_to_cpu as the last sentinels() read it
        self._syncs_at: tuple[int, int] = (-1, 0)  # (xla::_to_cpu, host syncs) last read

    def _counter(self, name: str) -> int:
        v = self._x._xla_counter_value(name)
        return int(v) if v is not None else 0

    def _metric(self, name: str) -> tuple[int, float]:
        d = self._x._xla_metric_data(name)
        return (int(d[0]), float(d[1])) if d is not None else (0, 0.0)

    def d2h(self) -> int:
        return self._metric("TransferFromDeviceTime")[0]

    def host_syncs(self) -> int:
        return self._counter(HOST_SYNC_OP)

    def fallback(self, relist: bool = True) -> dict[str, int]:
        """``aten::*`` counters (ops executed through the CPU fallback) except the host
        sync.  Listing torch_xla's counter names costs 0.2-0.4 ms on a step of many op
        kinds, so the names are listed again only when ``relist`` or when
        ``xla::_to_cpu`` moved since the last listing: the CPU fallback copies an op's
        inputs to the host through ``_to_cpu``, so a new fallback op moves it."""
        x = self._x
        # The sentinels of the step just ended read it a moment ago (nothing ran between):
        # each counter read costs several us on the training thread while the runtime
        # executes the step just synced, so the exit reads it once.
        to_cpu = self._to_cpu_now
        self._to_cpu_now = None
        if to_cpu is None:
            to_cpu = self._counter(TO_CPU)
        if not relist and to_cpu == self._to_cpu_listed and not self._aten:
            return {}
        if relist or to_cpu != self._to_cpu_listed:
            self._aten = [n for n in x._xla_counter_names()
                          if n.startswith("aten::") and n != HOST_SYNC_OP]
            self._to_cpu_listed = to_cpu
        return {n: int(x._xla_counter_value(n) or 0) for n in self._aten}

    def sentinels(self, at_exit: bool = False, copy_from: bool = True) -> Reading:
        """(``xla::_to_copy``, ``xla::_to_cpu``, direct copies, ``xla::_copy_from`` or
        None): two counter reads, three with ``copy_from``; no metric copy.  A
        device-to-host copy made through torch or ``_xla_get_cpu_tensors`` moves them as
        :func:`may_have_copied` tells.  ``_copy_from`` only tells a copy to the host from
        one to the device when ``_to_copy`` moved, so :class:`TransferCount` reads it only
        where ``_to_copy`` moved lately (a loop that moves no data to the device inside
        its steps never reads it)."""
        c = self._x._xla_counter_value  # direct: no Python frame per read (see fallback)
        to_cpu = c(TO_CPU) or 0
        self._to_cpu_now = to_cpu if at_exit else None  # for the exit's counter row
        return (c(TO_COPY) or 0, to_cpu, DIRECT_COPIES.calls,
                (c(COPY_FROM) or 0) if copy_from else None)

    def host_syncs_at(self, to_cpu: int) -> int:
        """``aten::_local_scalar_dense`` (host syncs), read only when ``xla::_to_cpu``
        (``to_cpu``, just read) moved since the last read: a host sync of an XLA tensor
        runs that op through the CPU fallback, which copies its input to the host through
        ``xla::_to_cpu`` in the same call (torch_xla 2.9), so while ``_to_cpu`` stands
        still the count does too.  One counter read less at each step boundary."""
        at = self._syncs_at
        if to_cpu != at[0]:
            at = self._syncs_at = (to_cpu, self._counter(HOST_SYNC_OP))
        return at[1]

    def _compile_ns(self, uncached: int) -> float:
        """``CompileTime``'s accumulator, read only when a compilation happened since the
        last read (a metric read copies up to XLA_METRICS_SAMPLES samples)."""
        if uncached != self._compiles[0]:
            self._compiles = (uncached, self._metric("CompileTime")[1])
        return self._compiles[1]

    def read(self, timed: bool = True) -> tuple[dict[str, float], dict[str, int]]:
        """(schema-named cumulative counters, fallback counts by op name).  Device-to-host
        transfers and host syncs are not here: :class:`TransferCount` counts them inside
        the step.  With ``timed`` False the two timed metrics (``ExecuteTime``,
        ``TransferToDeviceTime``: each read copies up to XLA_METRICS_SAMPLES samples, and
        the first such read after a step's ``sync`` costs ~1 ms of CPU on PJRT CPU) keep
        the values of their last read, and the fallback op names are listed again only
        when :meth:`fallback` sees a reason to."""
        row, fb = self.read_row(timed)
        return dict(zip(ROW_NAMES, row, strict=True)), fb

    def read_row(self, timed: bool = True, tail: tuple[float, ...] = ()
                 ) -> tuple[tuple[float, ...], dict[str, int]]:
        """:meth:`read` as a tuple in :data:`ROW_NAMES` order, ``tail`` appended: what a
        step's exit keeps (no dict is built on the training thread; the probe turns rows
        into deltas a block of steps at a time).  The steady step's path -- no compilation,
        no timed read, no fallback op ever seen and ``xla::_to_cpu`` still where the exit's
        sentinels left it -- makes three counter reads and no Python call."""
        c = self._x._xla_counter_value
        uncached = c("UncachedCompile") or 0
        compiles = self._compiles
        compile_ns = compiles[1] if uncached == compiles[0] else self._compile_ns(uncached)
        if timed or self._timed is None:
            exec_n, exec_ns = self._metric("ExecuteTime")
            self._timed = (exec_n, exec_ns, self._metric("TransferToDeviceTime")[0])
        exec_n, exec_ns, h2d = self._timed
        executions = c("ExecuteComputation")
        cached = c("CachedCompile") or 0
        to_cpu = self._to_cpu_now
        if not timed and not self._aten and to_cpu is not None \
                and to_cpu == self._to_cpu_listed:
            self._to_cpu_now = None  # what fallback() would return: nothing to list
            fb: dict[str, int] = {}
        else:
            fb = self.fallback(relist=timed)
        return (float(uncached), float(cached), compile_ns / 1e9,
                float(executions if executions is not None else exec_n), exec_ns / 1e9,
                float(h2d), float(sum(fb.values())) if fb else 0.0, *tail), fb


# The order of XlaCounters.read_row's values; XlaBackend's rows add the transfer counts.
ROW_NAMES = (schema.M_COMPILE_GRAPHS, schema.M_COMPILE_CACHE_HITS, schema.M_COMPILE_TIME,
             schema.M_EXECUTIONS, schema.M_EXECUTE_TIME, schema.M_XFER_H2D,
             schema.M_FALLBACK_OPS)


# A reading of the transfer sentinels (XlaCounters.sentinels): (xla::_to_copy,
# xla::_to_cpu, direct _xla_get_cpu_tensors calls, xla::_copy_from or None when not read).
Reading = tuple[int, int, int, int | None]


def may_have_copied(before: Reading, after: Reading) -> bool:
    """Whether a device-to-host copy may have happened between two :meth:`XlaCounters.
    sentinels` readings: any ``_to_cpu`` (a host sync moves it too) or direct
    ``_xla_get_cpu_tensors`` call, or more ``_to_copy`` calls than ``_copy_from`` calls
    (the copies that were not to the device or a cast on it) -- taken as yes when
    ``_to_copy`` moved and either reading lacks ``_copy_from``, so that the exact count
    decides.  A step that both copies to the host with ``.cpu()`` and copies into a
    device tensor with ``copy_`` can hide the first: the exact checks of
    :class:`TransferCount` catch such a pattern when it repeats."""
    if after[1] != before[1] or after[2] != before[2]:
        return True
    if after[0] == before[0]:
        return False
    b, a = before[3], after[3]
    return b is None or a is None or after[0] - before[0] > a - b


@dataclass
class TransferCount:
    """Device-to-host copies and host syncs inside steps, counted at the cost of a few
    counter reads.

    The exact copy count is the sample count of torch_xla's ``TransferFromDeviceTime``
    metric, but reading a metric copies its retained samples (up to
    ``XLA_METRICS_SAMPLES``, 1024): 0.1-0.6 ms, which at every step's entry and exit cost
    2-4 % of a 30 ms recurrent step (``benchmarks/bench_xla_probe.py --model rnn``).  Every
    copy the user's code makes through torch moves cheap counters (:func:`may_have_copied`),
    and every direct ``_xla_get_cpu_tensors`` call (``xm.save``, ``xm.mesh_reduce``) moves
    :data:`DIRECT_COPIES`, so the metric is read only when these moved since it was last
    read.  A step that copies nothing costs four counter reads (``_to_copy`` and ``_to_cpu``
    at entry and exit), six in a loop that moves data to the device (``_copy_from`` too,
    see :meth:`_sentinels`); the host sync count is read only at a boundary where
    ``_to_cpu`` moved (:meth:`XlaCounters.host_syncs_at`).  Until 2026-12-06 (sixth
    session) every step read all four sentinels at both ends: eight reads, 0.6-1 us each
    right after a ``sync`` (docs/xla.md).  ``known`` is the metric's count as last read
    less the probe's own copies (:meth:`user_copies`; they move no sentinel).

    The sentinels are checked against the exact count at every warm-up step and one steady
    step in ``EXACT_EVERY``: a step whose exact count moved while no sentinel did (a copy
    path this module does not know, e.g. from C++ code of another library) is counted, and
    from then on every step is counted exactly
    (``uncounted_at`` says where; the backend warns).  A copy between steps is never the
    step's: its sentinel move only makes the next step read the metric at entry.
    """

    counters: XlaCounters
    warmup_steps: int
    copier: _Copier
    exact: bool = False  # every step read exactly (after a copy no sentinel saw)
    uncounted_at: int | None = None  # step of the first copy no sentinel saw
    known: int | None = None  # user_copies() as last read, valid while nothing moved since `sent`
    sent: Reading | None = None  # the sentinels as last read
    hot: int = 0  # readings to come that read _copy_from too (see _sentinels)
    steps: int = 0
    d2h: int = 0  # cumulative copies inside steps (the user's)
    syncs: int = 0  # cumulative host syncs inside steps
    # (sentinels, syncs, baseline, checked) of the open step
    _open: tuple[Reading, int, int, bool] | None = None
    checked: bool = True  # the last step was read exactly (warm-up, 1 in EXACT_EVERY)
    check_next: bool = False  # the periodic check met a probe copy in flight: next step

    def user_copies(self) -> int:
        """torch_xla's count of device-to-host copies less the probe's own, which its
        copier thread makes at any time (:class:`_Copier`: one sample per call).  Read
        while a copy call is in flight, the count may or may not hold that call's sample,
        so the read is made again once the call returns: a wait of one batched copy at
        most (a few ms), and only when an exact read (at most every warm-up step, one step
        in EXACT_EVERY and a step that copied) meets the copy made once a flush interval."""
        copier = self.copier
        while True:
            done = copier.finished
            n = self.counters.d2h()
            if copier.started == done:
                return n - done
            if not copier.wait_idle():
                # A copy that never returns (a device that does not answer): its sample is
                # taken as made, and no later read waits (COPY_WAIT_S).
                return n - copier.started

    def _read(self, sent: Reading) -> int:
        self.known, self.sent = self.user_copies(), sent
        return self.known

    def _sentinels(self, at_exit: bool = False) -> tuple[Reading, int]:
        """(:meth:`XlaCounters.sentinels` now, host syncs: :meth:`XlaCounters.host_syncs_at`),
        in one call (each Python call costs ~0.3-1 us on the training thread right after
        a ``sync``).  ``_copy_from`` is read only where ``_to_copy`` moved since the last
        reading or in either of the two intervals before it (``hot``): a loop that moves
        data to the device inside its steps, or between them, has it at every boundary,
        and one that moves none never reads it.  A reading without it where ``_to_copy``
        then moves makes the exact count decide (once, at the change)."""
        counters = self.counters
        c = counters._x._xla_counter_value
        to_cpu = c(TO_CPU) or 0
        to_copy = c(TO_COPY) or 0
        counters._to_cpu_now = to_cpu if at_exit else None  # for the exit's counter row
        last, hot = self.sent, self.hot
        if last is None or to_copy != last[0]:
            self.hot = 2
            copy_from: int | None = c(COPY_FROM) or 0
        elif hot:
            self.hot = hot - 1
            copy_from = c(COPY_FROM) or 0
        else:
            copy_from = None
        at = counters._syncs_at
        syncs = at[1] if to_cpu == at[0] else counters.host_syncs_at(to_cpu)
        return (to_copy, to_cpu, DIRECT_COPIES.calls, copy_from), syncs

    def begin(self) -> None:
        sent, syncs = self._sentinels()
        steps = self.steps
        check = (self.exact or steps < self.warmup_steps or steps % EXACT_EVERY == 0
                 or self.check_next)
        if check:
            self.check_next = False
            if not self.exact and steps >= self.warmup_steps and \
                    self.copier.started != self.copier.finished:
                # The periodic check would wait for the probe's own copy in flight (see
                # user_copies), which may wait for the step the device is running: made
                # at the next step instead, with no wait.  A step whose sentinels moved
                # is still read exactly (below).
                check, self.check_next = False, True
        self.steps = steps + 1
        # The known count is still exact when nothing copied through torch (or the
        # wrapped _xla_get_cpu_tensors) since it was read.
        last, base = self.sent, self.known
        if check or base is None or last is None or (
                sent[:3] != last[:3] and may_have_copied(last, sent)):
            base = self._read(sent)
        self.sent = sent
        self._open = (sent, syncs, base, check)

    def end(self, step: int) -> None:
        if self._open is None:
            return
        sent0, syncs0, base, check = self._open
        self.checked = check
        sent, syncs = self._sentinels(at_exit=True)
        self._open = None
        if syncs != syncs0:
            self.syncs += syncs - syncs0
        moved = sent[:3] != sent0[:3] and may_have_copied(sent0, sent)
        if not moved and not check:
            self.sent = sent  # still exact: only copies to the device or casts since
            return
        n = self._read(sent) - base
        if n > 0 and not moved and not self.exact:
            self.exact, self.uncounted_at = True, step
        self.d2h += n


@dataclass
class XlaBackend(BackendBase):
    """:class:`refrun.probes.base.Backend` for PyTorch/XLA; see the module doc."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    device: Any = None
    declared_hardware: str | None = None
    warmup_steps: int = 5
    arm_interval_s: float = ARM_INTERVAL_S  # see ARM_INTERVAL_S
    fold_rows: int = FOLD_ROWS  # see FOLD_ROWS
    name: str = "torch_xla"
    _xla: Any = field(default=None, repr=False)
    _counters: XlaCounters = field(init=False, repr=False)
    _transfers: TransferCount = field(init=False, repr=False)
    _copier: _Copier = field(init=False, repr=False)
    _uncounted_warned: bool = False
    _waiting: list[_XlaValue] = field(default_factory=list, repr=False)  # in log order
    _next_arm: float = 0.0  # monotonic time of the next readiness callback request
    _ready_since: float | None = None  # monotonic time a waiting value was first ready
    _poll_due: float = 0.0  # monotonic time before which _poll has nothing to do
    _send_at: int = TRANSFER_MAX_WAITING  # waiting values that send without the device idle
    # (step, cumulative counter_row, fallback ops first counted then) of each ended step
    _rows: list[tuple[int, tuple[float, ...], dict[str, int] | None]] = field(
        default_factory=list, repr=False)
    # the cumulative row the next kept row's deltas start from (the start, then the last
    # folded row)
    _base_row: tuple[float, ...] | None = field(default=None, repr=False)
    _tally: SummaryTally = field(init=False, repr=False)  # rows folded so far
    _prev_fb: dict[str, int] = field(default_factory=dict, repr=False)
    _ended_step: int | None = None
    _logged_devices: dict[torch.device, int] = field(default_factory=dict, repr=False)
    _inplace_warned: bool = False
    _closed: bool = False
    # (device, (hardware, tags)): the runtime's answers for the device (see describe)
    _runtime: tuple[Any, tuple[str, dict[str, Any]]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        import torch_xla  # lazy: only this backend and refrun.xla ever import torch_xla

        _ONE_OPEN.refuse_if_open()
        BackendBase.__init__(self)
        self._xla = torch_xla
        if self.device is None:  # the user's objects first: a start they fail changes nothing
            self.device = _param_device(self.model, self.optimizer) or torch_xla.device()
        self._counters = XlaCounters(torch_xla._XLAC)
        self._tally = SummaryTally(self.warmup_steps)
        self._copier = _Copier(torch_xla._XLAC)
        self._transfers = TransferCount(self._counters, self.warmup_steps, self._copier)
        DIRECT_COPIES.install(torch_xla._XLAC)
        built_before = modules_built_before_torch_xla(self.model)
        if built_before:
            shown = ", ".join(built_before[:5]) + (" ..." if len(built_before) > 5 else "")
            self.warn("xla-module-built-before-import", (
                f"{shown}: built from PyTorch's own class, which importing torch_xla "
                "replaces in torch.nn (the model was built before `import torch_xla`). "
                "On an XLA device PyTorch's GRU sends each in-place op of each time step "
                "through a Python meta kernel (torch._refs): two to three times the "
                "training thread's time a step of a GRU language model on PJRT CPU "
                "(docs/xla.md). "
                "Import torch_xla before building the model."))
        _ONE_OPEN.register(self)

    # --- timing -------------------------------------------------------------------
    def begin_step(self, step: int) -> Any:
        self._transfers.begin()
        return time.perf_counter()

    def end_step(self, step: int, token: Any) -> Any:
        """Wall seconds of the step as the host saw it.  Under lazy execution a steady
        step is paced by the device (each sync waits for the previous execution), so the
        steady-state median is the device step time; warm-up steps include tracing."""
        elapsed = time.perf_counter() - token
        self._ended_step = step
        tc = self._transfers
        tc.end(step)
        if tc.uncounted_at is not None and not self._uncounted_warned:
            self._uncounted_warned = True
            self.warn("xla-d2h-uncounted", f"step {tc.uncounted_at} copied a tensor to the "
                      "host by a path neither a torch op nor _xla_get_cpu_tensors shows: "
                      "from then on xfer/d2h is read exactly at every step (slower)",
                      tc.uncounted_at)
        return elapsed

    # --- values -------------------------------------------------------------------
    def fetch(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"logged tensor has shape {tuple(value.shape)}; log "
                                 "one-element tensors (reduce it in the step, e.g. .mean())")
            # One device object per call, counted as is (named in describe()): each
            # tensor accessor costs ~1 us on the training thread while the runtime runs
            # the step just synced on the same cores (docs/research/xla-probe-cost.md).
            dev = value.device
            self._logged_devices[dev] = self._logged_devices.get(dev, 0) + 1
            if dev.type != "xla":
                # A host tensor: reading it after the step is a memory load, not a sync.
                return _XlaValue(value.detach(), value._version, None, host_float(value))
            # _held, inlined (a frame and a tuple less at every log): a result of autograd
            # ops is kept as the functional wrapper's inner tensor
            if value.requires_grad and not value.is_leaf:
                try:
                    h = _XlaValue(torch._from_functional_tensor(value), -1)
                except RuntimeError:  # functionalization off
                    h = _XlaValue(*_held(value))
            else:
                h = _XlaValue(*_held(value))
            self._waiting.append(h)
            return h
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"cannot record a value of type {type(value).__name__}; "
                            "log tensors or real numbers")
        return float(value)

    def ready(self, pending: Any) -> float | None:
        """The value once on the host (the copier thread sets it), else None; each call
        also polls the waiting values (:meth:`_poll`), whether or not ``pending`` is
        already with the copier."""
        if isinstance(pending, float):
            return pending
        if pending.value is not None:
            return pending.value
        if pending.error is not None:
            raise pending.error
        waiting = self._waiting
        if waiting:
            # _poll's own first test, here: most step entries have nothing to arm, no
            # armed value to look at and no bound reached, and skip its call
            now = time.monotonic()
            if now >= self._poll_due or waiting[-1].event is not None or \
                    len(waiting) >= self._send_at:
                self._poll(now)
        return pending.value

    def _poll(self, now: float | None = None) -> None:
        """Ask for a readiness callback on the newest waiting value (once an arm interval),
        and hand the waiting values to the copier only when the device is idle -- every
        waiting value's buffer is complete, so no execution of a later sync is in flight --
        or, to bound the delay and the live tensors every sync walks, when
        ``TRANSFER_MAX_WAITING`` values or ``TRANSFER_MAX_AGE_S`` seconds have piled up
        (a copy of buffers still being computed waits for them on the copier's thread).
        A copy issued while an execution runs queues behind its operations on the
        runtime's threads: on a step of many
        small operations (a recurrent cell over a sequence) it waited for most of the
        execution at every step entry, serialising the host's tracing of step n+1 with the
        device's execution of step n that a plain loop overlaps."""
        if now is None:
            now = time.monotonic()
        newest = self._waiting[-1]
        if now < self._poll_due and newest.event is None and \
                len(self._waiting) < self._send_at:
            return  # nothing to arm, no armed value to look at, no bound reached yet
        if self._ready_since is None:
            self._ready_since = now
        if newest.event is None and now >= self._next_arm:
            self._next_arm = now + self.arm_interval_s
            self._arm(newest)
        # Executions complete in order: the newest value's buffer complete means the device
        # is idle and every materialised value's buffer is complete.  Idle or not, only
        # materialised values are copied (a pending one would run a graph).
        idle = newest.event is not None and newest.event.is_set()
        if idle or len(self._waiting) >= self._send_at or \
                now - self._ready_since >= TRANSFER_MAX_AGE_S:
            self._send(self._materialised())
            self._ready_since = None
            # Values no sync has materialised yet stay; the count that sends again is
            # TRANSFER_MAX_WAITING more (not at every poll while they wait).
            self._send_at = len(self._waiting) + TRANSFER_MAX_WAITING
        # The next step entry that can do anything here (arm a value, or send the waiting
        # ones on their age): until then a poll of an unarmed value is one clock read.
        self._poll_due = 0.0 if self._ready_since is None else \
            min(self._next_arm, self._ready_since + TRANSFER_MAX_AGE_S)

    def wait(self, pending: Any) -> float:
        """Blocking read, only at close: materialises a value never synced (this may run a
        graph) and waits for its buffer and its copy."""
        if isinstance(pending, float):
            return pending
        if pending.value is None and pending.error is None:
            if not pending.sent:
                if pending.event is not None:
                    pending.event.wait(timeout=60)
                self._materialise_waiting()
                self._send(len(self._waiting))
            self._copier.wait_done(pending)
        if pending.error is not None:
            raise pending.error
        if pending.value is None:
            raise RuntimeError(f"a logged value was not copied to the host within "
                               f"{COPY_WAIT_S:g} s (the device does not answer); not recorded")
        return pending.value

    def _materialise_waiting(self) -> None:
        """Run, on the closing thread and with no time limit, the graph of the waiting
        values no sync materialised (a loop that never syncs is one lazy graph over the
        whole run).  Copied as IR values they would run that graph inside the copier's
        bounded wait: compiling a run-long graph on a busy machine took over
        ``COPY_WAIT_S`` and lost the values ("the device does not answer")."""
        n = self._materialised()
        if n < len(self._waiting):
            self._xla._XLAC._xla_sync_multi([h.tensor for h in self._waiting[n:]],
                                            devices=[], wait=True)

    def _materialised(self) -> int:
        """How many waiting values, from the first in log order, hold device data (a sync
        materialised them, or they were device data when logged): one
        ``_check_tensor_need_materialization`` call for all of them.  Copying a value still
        an IR node would run a graph outside any step (a compilation and an execution the
        run never asked for), so the count stops at the first; it waits for the next
        sync.  Values are not materialised in log order when a value computed earlier is
        logged after one still pending."""
        waiting = self._waiting
        if not waiting:
            return 0
        need = self._xla._XLAC._check_tensor_need_materialization([h.tensor for h in waiting])
        return next((i for i, pending in enumerate(need) if pending), len(need))

    def _arm(self, h: _XlaValue) -> None:
        """Ask the runtime to set ``h.event`` once ``h``'s buffer is complete; a value
        still pending in the lazy graph (no sync yet) raises and is asked again later."""
        ev = threading.Event()
        try:
            self._xla._XLAC._on_ready_callback(h.tensor, ev.set)
        except RuntimeError:  # still an IR value: not computed yet
            return
        h.event = ev

    def _send(self, n: int) -> None:
        """Hand the first ``n`` waiting values to the copier (one batched copy; the
        transfer it makes is the probe's own and never counted in ``xfer/d2h``)."""
        if n <= 0:
            return
        handles, self._waiting = self._waiting[:n], self._waiting[n:]
        for h in handles:
            if h.version >= 0 and h.tensor._version != h.version \
                    and not self._inplace_warned:
                self._inplace_warned = True
                self.warn("xla-inplace-after-log", "a logged XLA tensor was "
                                   "modified in place after probe.log; the recorded value is "
                                   "the modified one (log a tensor you do not update in place)")
        self._copier.submit(handles)

    # --- counters -------------------------------------------------------------------
    counter_names = (*ROW_NAMES, schema.M_XFER_D2H, schema.M_HOST_SYNCS)

    def counter_row(self) -> tuple[float, ...]:
        """Cumulative counters in :attr:`counter_names` order, at start and after each
        step (the probe's block path: a tuple, no dict).  The backend keeps the rows of
        ended steps for its end-of-run summary, folding them into its sums every
        ``fold_rows`` steps, and warns at once about a fallback op seen for the first time."""
        tc = self._transfers
        row, fb = self._counters.read_row(tc.checked, (float(tc.d2h), float(tc.syncs)))
        if self._ended_step is not None:
            ops = None
            if fb != self._prev_fb:
                ops = {k: n - self._prev_fb.get(k, 0) for k, n in fb.items()
                       if n > self._prev_fb.get(k, 0)}
                for op in ops:
                    self.warn(f"xla-fallback:{op}", f"CPU fallback op {op} first executed "
                              f"at step {self._ended_step} (no XLA lowering or a "
                              "data-dependent shape)", self._ended_step)
                self._prev_fb = fb
            self._rows.append((self._ended_step, row, ops))
            self._ended_step = None
            if len(self._rows) >= self.fold_rows:
                self._fold()
        elif not self._rows and not self._tally.steps:  # before the first step: the base
            self._base_row, self._prev_fb = row, fb
        return row

    def counters(self) -> Mapping[str, float]:
        """:meth:`counter_row` by name (the :class:`~refrun.probes.base.Backend` form)."""
        return dict(zip(self.counter_names, self.counter_row(), strict=True))

    def _fold(self) -> None:
        """Add the kept rows' per-step deltas to the summary's sums and drop them, keeping
        the last as the next delta's base: memory stays bounded by ``fold_rows`` rows."""
        rows = self._rows
        if not rows:
            return
        self._tally.add_rows(self.counter_names, self._base_row or rows[0][1], rows)
        self._base_row = rows[-1][1]
        self._rows = []

    def observe(self, model: torch.nn.Module | None = None,
                optimizer: torch.optim.Optimizer | None = None, **other: Any) -> None:
        """Read ``model`` / ``optimizer`` from now on (a checkpoint reload built them
        anew: :func:`refrun.probes.torch.rebind`)."""
        from refrun.probes.torch import rebind

        rebind(self, model, optimizer, **other)

    # --- device truth -----------------------------------------------------------------
    def describe(self, final: bool = False) -> Mapping[str, Any]:
        """Device truth and placement.  What the runtime says of the device (hardware,
        device type, device and process counts) is fixed once the runtime is up, so it is
        asked once; placement is counted at every call (parameters can move)."""
        runtime = self._runtime
        if runtime is None or runtime[0] is not self.device:
            runtime = self._runtime = (self.device, self._runtime_facts())
        hw, facts = runtime[1]
        out: dict[str, Any] = {
            **facts,
            schema.TAG_STEP_TIME_KIND: "wall",
            schema.TAG_EXEC_XLA_DEVICE: str(self.device),
            schema.TAG_FW_PJRT_DEVICE: os.environ.get("PJRT_DEVICE", ""),
        }
        placement = self._placement(final)
        out[schema.TAG_PLACEMENT] = json.dumps(placement, sort_keys=True)
        out[schema.TAG_PLACEMENT_WARNING] = placement_warnings(self.declared_hardware, hw,
                                                                placement)
        return out

    def _runtime_facts(self) -> tuple[str, dict[str, Any]]:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        hw = str(xm.xla_device_hw(self.device))
        return hw, {
            schema.TAG_EXEC_HARDWARE: hw.lower(),
            schema.TAG_EXEC_DEVICE_TYPE: str(xr.device_type()),
            schema.TAG_EXEC_DEVICES: int(xr.global_runtime_device_count()),
            schema.TAG_EXEC_WORLD_SIZE: int(xr.world_size()),
        }

    def _placement(self, final: bool) -> dict[str, Any]:
        """Devices of parameters, optimizer state and logged values (with how many values
        were logged on each when ``final``; None each before: a count that changes at
        every re-check would re-send every tag)."""
        params = count_devices(self.model.parameters()) if self.model is not None else {}
        opt_state = count_devices(optimizer_state_tensors(self.optimizer))
        return {"params": params, "optimizer_state": opt_state,
                "logged": {str(d): n if final else None
                           for d, n in self._logged_devices.items()},
                "declared_hardware": self.declared_hardware}

    # --- end ----------------------------------------------------------------------
    def summary(self) -> XlaSummary:
        self._fold()
        return self._tally.summary()

    def summary_tags(self) -> Mapping[str, Any]:
        """``refrun.summary.*`` and ``refrun.fallback.ops`` (recorded by the probe at close)."""
        return self.summary().tags()

    def artifacts(self) -> Mapping[str, Any]:
        """``refrun/xla_summary.json`` and ``refrun/fallback_ops.json``."""
        s = self.summary()
        return {
            schema.ARTIFACT_XLA_SUMMARY: {
                **dict(vars(s).items()),
                "names": {"tags": sorted(s.tags()),
                          "per_step_metrics": sorted(self._tally.names)},
            },
            schema.ARTIFACT_FALLBACK_OPS: {
                "ops": {op: {"count": n, "first_step": s.fallback_first_step[op]}
                        for op, n in sorted(s.fallback_ops.items())},
                "steps": {str(step): ops for step, ops in self._tally.fallback_steps.items()},
            },
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release held tensors (the summary is read afterwards through the hooks)."""
        if self._closed:
            return
        self._closed = True
        self._copier.close()
        self._waiting.clear()
        DIRECT_COPIES.remove(self._xla._XLAC)


def placement_warnings(declared: str | None, executed_hw: str,
                       placement: Mapping[str, Any]) -> list[str]:
    """Sentences for a run that declares one hardware but executes on another, or whose
    parameters / optimizer state are not on the XLA device."""
    out: list[str] = []
    # one classification for every backend (refrun.probes.hardware)
    want, got = hardware_family(declared), hardware_family(executed_hw)
    if want is not None and got is not None and want != got:
        out.append(f"declared hardware {declared!r} but torch_xla executes on {executed_hw} "
                   f"(PJRT_DEVICE={os.environ.get('PJRT_DEVICE', '')!r})")
    for what in ("params", "optimizer_state"):
        off = sorted(d for d in placement.get(what, {}) if not d.startswith("xla"))
        if off:
            label = "model parameters" if what == "params" else "optimizer state"
            out.append(f"{label} on {', '.join(off)}, not on the XLA device")
    return out


def _held(value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What the backend keeps of a logged XLA tensor until its copy, and the version the
    in-place check compares (-1: no check needed).

    Never the tensor itself when it carries an autograd graph: holding it kept the step's
    graph alive until the copy, and freeing it there cost the probe's call ~0.28 ms a value
    on a GRU step -- work a plain loop does when it drops the tensor.  A result of autograd
    ops (a loss) is kept as the functional wrapper's inner tensor
    (``torch._from_functional_tensor``: 18 us right after a ``sync`` on PJRT CPU, against
    57 us for ``detach``, which dispatches an alias op through functionalization).  The
    inner tensor is the value at ``log``: an in-place update of the wrapper afterwards
    replaces the wrapper's inner tensor and leaves this one as it was (if the update
    donates its buffer, the copy fails and the value is not recorded, with a warning).
    A tensor without a graph is kept as is, and a parameter detached (both alias what the
    loop updates in place, which the version check notes).  None of these adds a graph
    output or a compilation."""
    if not value.requires_grad:
        return value, value._version
    if not value.is_leaf:
        try:
            return torch._from_functional_tensor(value), -1
        except RuntimeError:  # functionalization off (XLA_DISABLE_FUNCTIONALIZATION=1)
            pass
    return value.detach(), value._version


class _Released:
    """Stands in for a tensor after its value was read (so the device buffer can be freed)."""

    _version = 0


_RELEASED: Any = _Released()


def modules_built_before_torch_xla(model: torch.nn.Module | None) -> list[str]:
    """``"name (torch.nn.Class)"`` for each module of ``model`` built from a class that
    importing torch_xla replaces in ``torch.nn``: the model was built before ``import
    torch_xla``.  torch_xla 2.x replaces ``nn.GRU`` by its scan-based GRU and keeps the
    original as the replacement's ``_orig``; a bidirectional module is left out, since
    the scan GRU is unidirectional and builds PyTorch's own for it.  Empty without a
    model."""
    if model is None:
        return []
    originals = {cls._orig: name for name, cls in vars(torch.nn).items()
                 if isinstance(cls, type) and isinstance(getattr(cls, "_orig", None), type)}
    if not originals:
        return []
    return [f"{name or 'model'} (torch.nn.{originals[type(m)]})"
            for name, m in model.named_modules()
            if type(m) in originals and not getattr(m, "bidirectional", False)]


def _param_device(model: torch.nn.Module | None,
                  optimizer: torch.optim.Optimizer | None) -> Any:
    """The first XLA parameter's device (model first, then optimizer), else None."""
    for p in parameters_of(model, optimizer):
        if p.device.type == "xla":
            return p.device
    return None
