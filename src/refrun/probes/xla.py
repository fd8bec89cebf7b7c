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
Both are counted between the step's entry and exit only (the counters are read at
``begin_step`` and ``end_step``): a deliberate host read between steps (a progress print,
an evaluation) is not the step's, whatever the evaluation cadence.

Compilation and transfer counts are exact per step (recorded on the training thread);
execution counts and times are recorded by the runtime when an asynchronous execution
finishes, so they can land in the following step.

**Values** given to ``probe.log`` never cause a graph, a transfer or a wait inside the step:
the backend keeps a reference to the tensor (no new op, so the traced graph is unchanged);
once a ``sync`` has materialised it, it asks the runtime for a readiness callback
(``_XLAC._on_ready_callback``), and only when the device buffer is complete are all ready
values copied to the host in one batched ``_xla_get_cpu_tensors`` call, at a step entry
before the step's counting starts, when the device is idle (or after 256 values / 5 s, see
:meth:`XlaBackend.ready`).  That copy is a device-to-host transfer of finished buffers;
made outside the step it is never counted (one made inside a step, which the probe never
does today, would be bracketed by counter reads and subtracted) so ``xfer/d2h`` shows only
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refrun import schema
from refrun.probes.base import BackendBase
from refrun.probes.hardware import family as hardware_family
from refrun.probes.tensors import (
    count_devices,
    host_float,
    optimizer_state_tensors,
    parameters_of,
)

HOST_SYNC_OP = "aten::_local_scalar_dense"
# Logged values wait on the device until it is idle, at most this many or this long
# (see XlaBackend.ready); the device keeps a scalar buffer per waiting value.
TRANSFER_MAX_WAITING = 256
TRANSFER_MAX_AGE_S = 5.0
_MARK_STEP = "MarkStep"


@dataclass(slots=True)
class _XlaValue:
    """A logged XLA tensor: read once a sync materialised it and its buffer is complete."""

    tensor: torch.Tensor
    version: int
    marks: int  # MarkStep count when last checked (a sync since then may have materialised it)
    event: threading.Event | None = None
    value: float | None = None


@dataclass
class StepRecord:
    """Counter deltas of one recorded step (schema names) plus fallback ops by name."""

    step: int
    deltas: dict[str, float]
    fallback: dict[str, int]


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


def summarize(records: Iterable[StepRecord], warmup_steps: int) -> XlaSummary:
    """Summary over recorded steps.  "After warm-up" is every step after the first
    ``warmup_steps`` recorded ones; per-step means are over those steps (all steps when the
    run is shorter than the warm-up)."""
    recs = list(records)
    after = recs[warmup_steps:]
    steady = after or recs

    def total(rs: list[StepRecord], key: str) -> float:
        return sum(r.deltas.get(key, 0.0) for r in rs)

    def mean(key: str) -> float:
        return total(steady, key) / len(steady) if steady else 0.0

    ops: dict[str, int] = {}
    first: dict[str, int] = {}
    for r in recs:
        for name, n in r.fallback.items():
            ops[name] = ops.get(name, 0) + n
            first.setdefault(name, r.step)
    return XlaSummary(
        steps=len(recs), warmup_steps=warmup_steps,
        compiles_total=int(total(recs, schema.M_COMPILE_GRAPHS)),
        compiles_after_warmup=int(total(after, schema.M_COMPILE_GRAPHS)),
        compile_steps_after_warmup=[r.step for r in after
                                    if r.deltas.get(schema.M_COMPILE_GRAPHS, 0) > 0],
        d2h_per_step=mean(schema.M_XFER_D2H), h2d_per_step=mean(schema.M_XFER_H2D),
        host_syncs_per_step=mean(schema.M_HOST_SYNCS),
        fallback_ops_total=sum(ops.values()), fallback_ops=ops, fallback_first_step=first,
        compile_time_s=total(recs, schema.M_COMPILE_TIME),
        exec_count_per_step=mean(schema.M_EXECUTIONS),
    )


class XlaCounters:
    """Cumulative torch_xla counters under schema names, read through ``_XLAC``.

    ``read()`` costs a handful of C calls plus one pass over the counter names (for the
    ``aten::*`` fallback counters); see ``benchmarks/bench_xla_probe.py``."""

    def __init__(self, xlac: Any) -> None:
        self._x = xlac

    def _counter(self, name: str) -> int:
        v = self._x._xla_counter_value(name)
        return int(v) if v is not None else 0

    def _metric(self, name: str) -> tuple[int, float]:
        d = self._x._xla_metric_data(name)
        return (int(d[0]), float(d[1])) if d is not None else (0, 0.0)

    def marks(self) -> int:
        """Number of ``sync``/``mark_step`` calls so far."""
        return self._counter(_MARK_STEP)

    def d2h(self) -> int:
        return self._metric("TransferFromDeviceTime")[0]

    def host_syncs(self) -> int:
        return self._counter(HOST_SYNC_OP)

    def fallback(self) -> dict[str, int]:
        """``aten::*`` counters (ops executed through the CPU fallback) except the host sync."""
        x = self._x
        return {n: int(x._xla_counter_value(n) or 0) for n in x._xla_counter_names()
                if n.startswith("aten::") and n != HOST_SYNC_OP}

    def window(self) -> tuple[int, int]:
        """(device-to-host transfers, host syncs) so far: read at a step's entry and exit."""
        return self.d2h(), self.host_syncs()

    def read(self) -> tuple[dict[str, float], dict[str, int]]:
        """(schema-named cumulative counters, fallback counts by op name).  Device-to-host
        transfers and host syncs are not here: :class:`XlaBackend` counts them inside the
        step with :meth:`window`."""
        _, compile_ns = self._metric("CompileTime")
        exec_n, exec_ns = self._metric("ExecuteTime")
        executions = self._x._xla_counter_value("ExecuteComputation")
        fb = self.fallback()
        return {
            schema.M_COMPILE_GRAPHS: float(self._counter("UncachedCompile")),
            schema.M_COMPILE_CACHE_HITS: float(self._counter("CachedCompile")),
            schema.M_COMPILE_TIME: compile_ns / 1e9,
            schema.M_EXECUTIONS: float(executions if executions is not None else exec_n),
            schema.M_EXECUTE_TIME: exec_ns / 1e9,
            schema.M_XFER_H2D: float(self._metric("TransferToDeviceTime")[0]),
            schema.M_FALLBACK_OPS: float(sum(fb.values())),
        }, fb


@dataclass
class XlaBackend(BackendBase):
    """:class:`refrun.probes.base.Backend` for PyTorch/XLA; see the module doc."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    device: Any = None
    declared_hardware: str | None = None
    warmup_steps: int = 5
    name: str = "torch_xla"
    _xla: Any = field(default=None, repr=False)
    _counters: XlaCounters = field(init=False, repr=False)
    _own_d2h: int = 0  # transfers made by this backend, not the user's step
    # (d2h, host syncs, own d2h) at the open step's entry; None between steps
    _at_begin: tuple[int, int, int] | None = field(default=None, repr=False)
    _step_d2h: int = 0  # cumulative user transfers inside steps
    _step_syncs: int = 0  # cumulative host syncs inside steps
    _waiting: list[_XlaValue] = field(default_factory=list, repr=False)
    _ready_since: float | None = None  # monotonic time a waiting value was first ready
    _records: list[StepRecord] = field(default_factory=list, repr=False)
    _prev: dict[str, float] | None = field(default=None, repr=False)
    _prev_fb: dict[str, int] = field(default_factory=dict, repr=False)
    _ended_step: int | None = None
    _logged_devices: dict[str, int] = field(default_factory=dict, repr=False)
    _inplace_warned: bool = False
    _closed: bool = False

    def __post_init__(self) -> None:
        import torch_xla  # lazy: only this backend and refrun.xla ever import torch_xla

        BackendBase.__init__(self)
        self._xla = torch_xla
        self._counters = XlaCounters(torch_xla._XLAC)
        if self.device is None:
            self.device = _param_device(self.model, self.optimizer) or torch_xla.device()

    # --- timing -------------------------------------------------------------------
    def begin_step(self, step: int) -> Any:
        self._at_begin = (*self._counters.window(), self._own_d2h)
        return time.perf_counter()

    def end_step(self, step: int, token: Any) -> Any:
        """Wall seconds of the step as the host saw it.  Under lazy execution a steady
        step is paced by the device (each sync waits for the previous execution), so the
        steady-state median is the device step time; warm-up steps include tracing."""
        elapsed = time.perf_counter() - token
        self._ended_step = step
        if self._at_begin is not None:
            d2h, syncs, own = self._at_begin
            d2h_now, syncs_now = self._counters.window()
            self._step_d2h += d2h_now - d2h - (self._own_d2h - own)
            self._step_syncs += syncs_now - syncs
            self._at_begin = None
        return elapsed

    # --- values -------------------------------------------------------------------
    def fetch(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"logged tensor has shape {tuple(value.shape)}; log "
                                 "one-element tensors (reduce it in the step, e.g. .mean())")
            dev = str(value.device)
            self._logged_devices[dev] = self._logged_devices.get(dev, 0) + 1
            if value.device.type != "xla":
                # A host tensor: reading it after the step is a memory load, not a sync.
                return _XlaValue(value.detach(), value._version, -1, None,
                                 host_float(value))
            h = _XlaValue(value, value._version, -1)
            self._waiting.append(h)
            return h
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"cannot record a value of type {type(value).__name__}; "
                            "log tensors or real numbers")
        return float(value)

    def ready(self, pending: Any) -> float | None:
        """The value once on the host.  Ready buffers are copied only when the device is
        idle -- every waiting value's buffer is complete, so no execution of a later sync
        is in flight -- or, to bound the delay, when ``TRANSFER_MAX_WAITING`` values or
        ``TRANSFER_MAX_AGE_S`` seconds have piled up.  A copy issued while an execution
        runs queues behind its operations on the runtime's threads: on a step of many
        small operations (a recurrent cell over a sequence) it waited for most of the
        execution at every step entry, serialising the host's tracing of step n+1 with
        the device's execution of step n that a plain loop overlaps."""
        if isinstance(pending, float):
            return pending
        if pending.value is not None:
            return pending.value
        self._arm_waiting()
        if pending.event is None or not pending.event.is_set():
            return None
        now = time.monotonic()
        if self._ready_since is None:
            self._ready_since = now
        idle = all(h.event is not None and h.event.is_set() for h in self._waiting)
        if idle or len(self._waiting) >= TRANSFER_MAX_WAITING or \
                now - self._ready_since >= TRANSFER_MAX_AGE_S:
            self._transfer([h for h in self._waiting
                            if h.event is not None and h.event.is_set()])
            self._ready_since = None
        return pending.value

    def wait(self, pending: Any) -> float:
        """Blocking read, only at close: materialises a value never synced (this may run a
        graph) and waits for its buffer."""
        if isinstance(pending, float):
            return pending
        if pending.value is None:
            if pending.event is not None:
                pending.event.wait(timeout=60)
            self._transfer([h for h in self._waiting if h.value is None])
        return float("nan") if pending.value is None else pending.value

    def _arm_waiting(self) -> None:
        """Ask for a readiness callback on every value a sync has materialised since the
        last look.  Values still pending in the lazy graph raise in ``_on_ready_callback``;
        they are only retried after the next ``sync``, so that costs one try per sync."""
        marks = self._counters.marks()
        on_ready = self._xla._XLAC._on_ready_callback
        for h in self._waiting:
            if h.event is not None or h.marks == marks:
                continue
            h.marks = marks
            ev = threading.Event()
            try:
                on_ready(h.tensor, ev.set)
            except RuntimeError:  # still an IR value: not computed yet
                continue
            h.event = ev

    def _transfer(self, handles: list[_XlaValue]) -> None:
        """Copy ``handles`` to the host in one call; the transfers it makes are counted as
        the probe's own and subtracted from ``xfer/d2h``."""
        if not handles:
            return
        for h in handles:
            if h.tensor._version != h.version and not self._inplace_warned:
                self._inplace_warned = True
                self.warn("xla-inplace-after-log", "a logged XLA tensor was "
                                   "modified in place after probe.log; the recorded value is "
                                   "the modified one (log a tensor you do not update in place)")
        inside = self._at_begin is not None  # only a copy inside a step needs bracketing
        before = self._counters.d2h() if inside else 0
        try:
            host = self._xla._XLAC._xla_get_cpu_tensors([h.tensor for h in handles])
        finally:
            if inside:
                self._own_d2h += self._counters.d2h() - before
        for h, t in zip(handles, host, strict=True):
            h.value = host_float(t)
            h.tensor = _RELEASED  # drop the device buffer reference
        done = {id(h) for h in handles}
        self._waiting = [h for h in self._waiting if id(h) not in done]

    # --- counters -------------------------------------------------------------------
    def counters(self) -> Mapping[str, float]:
        """Cumulative counters (schema names).  Called by the probe at start and after each
        step; the backend also keeps the per-step deltas for its end-of-run summary."""
        now, fb = self._counters.read()
        now[schema.M_XFER_D2H] = float(self._step_d2h)  # inside steps only (window())
        now[schema.M_HOST_SYNCS] = float(self._step_syncs)
        if self._prev is not None and self._ended_step is not None:
            deltas = {k: v - self._prev.get(k, 0.0) for k, v in now.items()}
            ops = {k: n - self._prev_fb.get(k, 0) for k, n in fb.items()
                   if n > self._prev_fb.get(k, 0)}
            self._records.append(StepRecord(self._ended_step, deltas, ops))
            for op in ops:
                self.warn(f"xla-fallback:{op}", f"CPU fallback op {op} first executed "
                                   f"at step {self._ended_step} (no XLA lowering or a "
                                   "data-dependent shape)", self._ended_step)
            self._ended_step = None
        self._prev, self._prev_fb = now, fb
        return now

    # --- device truth -----------------------------------------------------------------
    def describe(self) -> Mapping[str, Any]:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        hw = str(xm.xla_device_hw(self.device))
        out: dict[str, Any] = {
            schema.TAG_EXEC_HARDWARE: hw.lower(),
            schema.TAG_EXEC_DEVICE_TYPE: str(xr.device_type()),
            schema.TAG_EXEC_DEVICES: int(xr.global_runtime_device_count()),
            schema.TAG_EXEC_WORLD_SIZE: int(xr.world_size()),
            schema.TAG_STEP_TIME_KIND: "wall",
            schema.TAG_EXEC_XLA_DEVICE: str(self.device),
            schema.TAG_FW_PJRT_DEVICE: os.environ.get("PJRT_DEVICE", ""),
        }
        placement = self._placement()
        out[schema.TAG_PLACEMENT] = json.dumps(placement, sort_keys=True)
        out[schema.TAG_PLACEMENT_WARNING] = placement_warnings(self.declared_hardware, hw,
                                                                placement)
        return out

    def _placement(self) -> dict[str, Any]:
        params = count_devices(self.model.parameters()) if self.model is not None else {}
        opt_state = count_devices(optimizer_state_tensors(self.optimizer))
        return {"params": params, "optimizer_state": opt_state,
                "logged": dict(self._logged_devices),
                "declared_hardware": self.declared_hardware}

    # --- end ----------------------------------------------------------------------
    def summary(self) -> XlaSummary:
        return summarize(self._records, self.warmup_steps)

    def summary_tags(self) -> Mapping[str, Any]:
        """``refrun.summary.*`` and ``refrun.fallback.ops`` (recorded by the probe at close)."""
        return self.summary().tags()

    def artifacts(self) -> Mapping[str, Any]:
        """``refrun/xla_summary.json`` and ``refrun/fallback_ops.json``."""
        s = self.summary()
        return {
            schema.ARTIFACT_XLA_SUMMARY: {
                **dict(vars(s).items()),
                "names": {"tags": sorted(s.tags()), "per_step_metrics": sorted(
                    {k for r in self._records for k in r.deltas})},
            },
            schema.ARTIFACT_FALLBACK_OPS: {
                "ops": {op: {"count": n, "first_step": s.fallback_first_step[op]}
                        for op, n in sorted(s.fallback_ops.items())},
                "steps": {str(r.step): r.fallback for r in self._records if r.fallback},
            },
        }

    def close(self) -> None:
        """Release held tensors (the summary is read afterwards through the hooks)."""
        if self._closed:
            return
        self._closed = True
        self._waiting.clear()


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


class _Released:
    """Stands in for a tensor after its value was read (so the device buffer can be freed)."""

    _version = 0


_RELEASED: Any = _Released()


def _param_device(model: torch.nn.Module | None,
                  optimizer: torch.optim.Optimizer | None) -> Any:
    """The first XLA parameter's device (model first, then optimizer), else None."""
    for p in parameters_of(model, optimizer):
        if p.device.type == "xla":
            return p.device
    return None
