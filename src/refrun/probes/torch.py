"""The PyTorch backend of :class:`refrun.probes.base.Probe` (CPU and CUDA).

What it does inside a training step, and why none of it synchronises the host:

* **Values** given to ``probe.log``: a CUDA tensor is copied ``non_blocking`` into a pinned
  host buffer and a CUDA event is recorded after the copy on the current stream; the value
  is read once ``event.query()`` says the copy has landed.  A CPU tensor is read at log
  time through ``.numpy()``, a plain memory load that never dispatches
  ``aten::_local_scalar_dense`` (what ``.item()`` does) and cannot wait for anything: CPU
  ops have completed when they return.  Reading it then, like the CUDA copy enqueued then,
  records the value as logged even if the tensor is changed in place later (a scheduler's
  ``lr`` tensor, a running sum).  Either way the value goes through the same pending queue
  and reaches the session after the step, with its own step number.  Python numbers pass.
* **Step time**: two timing CUDA events recorded on the current stream around the step,
  read with ``elapsed_time`` once the end event has completed (``cuda_event``); on CPU
  ``time.perf_counter`` around the step (``wall``), exact because CPU ops run eagerly.
* **Compilation**: cumulative counters from ``torch._dynamo.utils.counters``
  (``stats/unique_graphs``, ``graph_break``, ``inductor/fxgraph_cache_hit``) and from
  ``torch._dynamo.callback_handler`` start/end callbacks (recompilations = Dynamo
  compilations of a frame already compiled before, compile time).  The probe logs their
  per-step deltas from the first step in which something compiled (an eager run records
  none).  Dynamo is never imported by the probe, only read once the process imported it.
* **Host syncs on CUDA** (``xfer/host_syncs``): inside each step the probe sets
  ``torch.cuda.set_sync_debug_mode("warn")`` (restoring the user's mode at step exit), so
  every synchronizing CUDA call the step makes from Python (``.item()``, ``float(t)``,
  ``.cpu()``/``.tolist()``/``.numpy()`` of a CUDA tensor, ``torch.nonzero``, a blocking
  copy, ``torch.cuda.synchronize()``) raises PyTorch's "called a synchronizing CUDA
  operation" warning; the probe counts those warnings and swallows them (a warnings filter
  and ``warnings.showwarning`` hook while the probe is open) instead of printing one per
  step (a user who set ``"warn"`` still sees them; one who set ``"error"`` keeps it: the
  sync raises, as asked).  The probe's own CUDA work is asynchronous, so a clean step
  counts 0.  Only when the model is on CUDA (:class:`CudaSyncCounter`); on the CPU no
  sync exists and no such counter is recorded (tag ``refrun.torch.cuda_syncs`` says which).
* **Placement**: the devices of parameters, optimizer state and logged tensors, with a
  warning when an accelerator was expected (``hardware``, or a non-CPU declared
  hardware) or is present but the model or the logged values live on the CPU.

Pools of pinned buffers and events are reused so a warm step allocates nothing.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.identity import normalize_hardware
from refrun.probes.base import BackendBase
from refrun.probes.hardware import is_accelerator
from refrun.probes.tensors import count_devices, host_float, optimizer_state_tensors

ACCELERATOR = "accelerator"  # hardware value meaning "any non-CPU device"


# --- pending values ------------------------------------------------------------------
@dataclass(slots=True)
class _CudaValue:
    """A non-blocking device-to-host copy in flight: read ``buf`` once ``event`` completes."""

    buf: torch.Tensor
    event: Any


@dataclass(slots=True)
class _CudaTiming:
    start: Any
    end: Any


tensor_to_float = host_float  # the shared reader (refrun.probes.tensors)


class _Pool:
    """Free lists of reusable objects keyed by a hashable (pinned buffers per dtype, events)."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make = make
        self._free: dict[Any, list[Any]] = {}

    def take(self, key: Any) -> Any:
        free = self._free.get(key)
        return free.pop() if free else self._make(key)

    def give(self, key: Any, obj: Any) -> None:
        self._free.setdefault(key, []).append(obj)

    def clear(self) -> None:
        self._free.clear()


# --- compile evidence ------------------------------------------------------------------
@dataclass
class CompileWatch:
    """Recompilations and compile time from Dynamo's compile callbacks.

    A Dynamo compile id is ``"<frame_id>/<frame_compile_id>"``; ``frame_compile_id > 0``
    means the frame was compiled before, i.e. a recompilation (guard failure).  The callbacks
    only fire for the outermost compilation, which is what a user's step triggers."""

    recompiles: int = 0
    compiles: int = 0
    time_s: float = 0.0
    _started: float | None = None
    _installed: bool = False
    _handler: Any = None

    def install(self) -> None:
        """Register the callbacks if Dynamo is already imported (never imports it), and
        again after ``torch._dynamo.reset()`` cleared them."""
        if self._installed:
            if self._on_start in self._handler.start_callbacks:
                return
            self._installed = False
        mod = sys.modules.get("torch._dynamo.callback")
        if mod is None:
            return
        self._handler = mod.callback_handler
        self._handler.register_start_callback(self._on_start)
        self._handler.register_end_callback(self._on_end)
        self._installed = True

    def _on_start(self, args: Any) -> None:
        self._started = time.perf_counter()
        if getattr(getattr(args, "callback_trigger", None), "name", "") != "DYNAMO":
            return
        self.compiles += 1
        if frame_compile_index(str(getattr(args, "compile_id", ""))) > 0:
            self.recompiles += 1

    def _on_end(self, args: Any) -> None:
        if self._started is not None:
            self.time_s += time.perf_counter() - self._started
            self._started = None

    def remove(self) -> None:
        if self._installed and self._handler is not None:
            for fn, remove in ((self._on_start, self._handler.remove_start_callback),
                               (self._on_end, self._handler.remove_end_callback)):
                with contextlib.suppress(ValueError):  # cleared by torch._dynamo.reset()
                    remove(fn)
        self._installed = False


def frame_compile_index(compile_id: str) -> int:
    """The per-frame compile index of a Dynamo compile id (``"3/2"`` -> 2, ``"3/0_1"`` -> 0,
    compiled-autograd ids ``"!0/3/1"`` -> 1); -1 when it cannot be parsed."""
    parts = compile_id.split("/")
    if len(parts) < 2:
        return -1
    try:
        return int(parts[-1].split("_")[0])
    except ValueError:
        return -1


@dataclass
class Monotonic:
    """Keeps cumulative counters cumulative when their source is cleared
    (``torch._dynamo.utils.counters.clear()`` is common in test suites)."""

    _last: dict[str, float] = field(default_factory=dict)
    _offset: dict[str, float] = field(default_factory=dict)

    def __call__(self, raw: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in raw.items():
            last = self._last.get(k, 0.0)
            if v < last:
                self._offset[k] = self._offset.get(k, 0.0) + last
            self._last[k] = v
            out[k] = v + self._offset.get(k, 0.0)
        return out


def dynamo_counters(watch: CompileWatch) -> dict[str, float]:
    """Cumulative compile counters under schema names; empty when Dynamo is not imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    watch.install()
    c = utils.counters
    stats = c.get("stats") or {}
    breaks = c.get("graph_break") or {}
    inductor = c.get("inductor") or {}
    return {
        schema.M_COMPILE_GRAPHS: float(stats.get("unique_graphs", 0)),
        schema.M_COMPILE_RECOMPILES: float(watch.recompiles),
        schema.M_COMPILE_GRAPH_BREAKS: float(sum(breaks.values())),
        schema.M_COMPILE_CACHE_HITS: float(inductor.get("fxgraph_cache_hit", 0)),
        schema.M_COMPILE_TIME: watch.time_s,
    }


# --- host syncs on CUDA -------------------------------------------------------------------
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class CudaSyncCounter:
    """Counts PyTorch's sync-debug warnings raised inside the step (see the module doc).

    ``torch.cuda.set_sync_debug_mode`` is process-wide: it is switched to ``warn`` at
    :meth:`begin` and back to the user's mode at :meth:`end`, so syncs between steps
    (evaluation, a progress print) are neither counted nor warned about.  Warnings of
    other text, or of sync debug mode outside a step, go to the previous
    ``warnings.showwarning`` unchanged."""

    def __init__(self) -> None:
        self.n = 0
        self.active = False
        self._prev_mode = 0
        self._prev_show: Any = None
        self._filter: Any = None

    def install(self) -> None:
        warnings.filterwarnings("always", message=re.escape(CUDA_SYNC_WARNING))
        self._filter = warnings.filters[0]
        self._prev_show = warnings.showwarning
        warnings.showwarning = self._show

    def _show(self, message: Any, category: Any, filename: str, lineno: int,
              file: Any = None, line: Any = None) -> None:
        if self.active and CUDA_SYNC_WARNING in str(message):
            self.n += 1
            if self._prev_mode == 0:  # the user asked for no warnings: counted, not shown
                return
        self._prev_show(message, category, filename, lineno, file, line)

    def begin(self) -> None:
        self._prev_mode = torch.cuda.get_sync_debug_mode()
        if self._prev_mode != 2:  # the user's "error" mode stays: a sync raises, as asked
            torch.cuda.set_sync_debug_mode(1)  # warn
        self.active = True

    def end(self) -> None:
        if self.active:
            self.active = False
            if self._prev_mode != 2:
                torch.cuda.set_sync_debug_mode(self._prev_mode)

    def remove(self) -> None:
        self.end()
        if warnings.showwarning == self._show:
            warnings.showwarning = self._prev_show
        with contextlib.suppress(ValueError):
            warnings.filters.remove(self._filter)
        with contextlib.suppress(AttributeError):  # drop the filter's cached decisions
            warnings._filters_mutated()  # type: ignore[attr-defined]


def cuda_sync_counter(device: torch.device, wanted: bool) -> tuple[CudaSyncCounter | None, str]:
    """(a counter, or None, and the ``refrun.torch.cuda_syncs`` tag saying why)."""
    if not wanted:
        return None, "off (count_cuda_syncs=False)"
    if device.type != "cuda":
        return None, f"off (the model is on {device.type}, not CUDA: no host sync to count)"
    if not hasattr(torch.cuda, "set_sync_debug_mode"):
        return None, "off (this PyTorch has no torch.cuda.set_sync_debug_mode)"
    counter = CudaSyncCounter()
    counter.install()
    return counter, "counted: torch.cuda.set_sync_debug_mode('warn') inside the step"


# --- placement ------------------------------------------------------------------------
@dataclass
class Placement:
    """Where a run's tensors live: device string -> number of tensors."""

    params: dict[str, int]
    optimizer_params: dict[str, int]
    optimizer_state: dict[str, int]
    logged: dict[str, int | None]  # device -> values logged there (None: not counted yet)
    accelerator: str | None
    expected: str | None

    def warnings(self, has_model: bool) -> list[str]:
        """Human sentences for every suspicious placement (empty when all is well)."""
        out: list[str] = []
        if has_model and not self.params:
            out.append("the model has no parameters")
        want = self.expected
        if want is None and self.accelerator is not None:
            want = ACCELERATOR
        if want is not None:
            reason = (f"{want} was expected" if self.expected else
                      f"an accelerator is present ({self.accelerator})")
            for what, devs in (("model parameters", self.params),
                               ("optimizer state", self.optimizer_state),
                               ("logged values (and so the batches)", self.logged)):
                off = sorted(d for d in devs if not _matches(d, want))
                if off:
                    out.append(f"{what} on {', '.join(off)} but {reason}")
        if len(self.optimizer_params) > 1:
            out.append("optimizer over parameters on mixed devices: "
                       + ", ".join(sorted(self.optimizer_params)))
        return out

    def to_json(self) -> str:
        return json.dumps({"params": self.params, "optimizer_params": self.optimizer_params,
                           "optimizer_state": self.optimizer_state, "logged": self.logged,
                           "accelerator": self.accelerator, "expected": self.expected},
                          sort_keys=True)


def _matches(device: str, want: str) -> bool:
    if want == ACCELERATOR:
        return not device.startswith(("cpu", "meta"))
    want_dev = torch.device(want)
    dev = torch.device(device)
    return dev.type == want_dev.type and (want_dev.index is None or dev.index == want_dev.index)


def accelerator_present() -> str | None:
    """``"cuda x<n>[: <name>]"`` when CUDA (or ROCm) devices are visible, else None.

    The name is only asked for when the process has initialised CUDA itself: asking would
    otherwise create a CUDA context (and take GPU memory) in a run that uses the CPU."""
    try:
        if not torch.cuda.is_available():
            return None
        desc = f"cuda x{torch.cuda.device_count()}"
        if torch.cuda.is_initialized():
            desc += f": {torch.cuda.get_device_name(0)}"
        return desc
    except Exception:  # a broken driver is "no accelerator" here; identity records it
        return None


def normalise_expected(hardware: str | None, declared_hardware: str | None) -> str | None:
    """The device the run must use: from ``hardware`` if given (a torch device such as
    ``"cuda:1"``, ``"accelerator"``, or a hardware name: an accelerator's name means any
    non-CPU device, a CPU's ``"cpu"``), else ``"accelerator"`` when the run declares
    non-CPU hardware, else None.

    Raises :class:`RefrunInputError` for a name that is neither a device nor hardware."""
    if hardware is None:
        return ACCELERATOR if is_accelerator(declared_hardware) else None
    try:
        return device_name(hardware)
    except RefrunInputError:
        pass  # not a device: a hardware name such as "a100" or "tpu-v5e"
    name = normalize_hardware(hardware, "hardware")
    return ACCELERATOR if is_accelerator(name) else "cpu"


def device_name(device: str, what: str = "hardware") -> str:
    """``device`` as torch writes it (``"cuda:1"``), or ``"accelerator"``; raises
    :class:`RefrunInputError` naming ``what`` when torch knows no such device."""
    if device == ACCELERATOR:
        return ACCELERATOR
    try:
        return str(torch.device(device))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise RefrunInputError(f"{what}: {device!r} is not a device ({exc})") from None


def rebind(backend: Any, model: Any = None, optimizer: Any = None, **other: Any) -> None:
    """A torch backend reads ``model`` / ``optimizer`` from now on (the objects a
    checkpoint reload built anew: :meth:`refrun.probes.base.Probe.observe`); those not
    given stay.  Raises :class:`RefrunInputError` for another keyword or a wrong kind."""
    if other:
        raise RefrunInputError(f"observe: {', '.join(sorted(other))}: the {backend.name} "
                               "probe reads model= and optimizer= only")
    check_torch_objects(model, optimizer)
    if model is not None:
        backend.model = model
    if optimizer is not None:
        backend.optimizer = optimizer


def check_torch_objects(model: Any, optimizer: Any) -> None:
    """Refuse a ``model`` that is not a ``torch.nn.Module`` or an ``optimizer`` that is
    not a ``torch.optim.Optimizer`` (the torch and XLA probes read them alike)."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise RefrunInputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise RefrunInputError(f"optimizer: expected a torch.optim.Optimizer, got "
                               f"{type(optimizer).__name__}")


# --- the backend -----------------------------------------------------------------------
@dataclass
class TorchBackend(BackendBase):
    """:class:`refrun.probes.base.Backend` for eager or compiled PyTorch on CPU or CUDA."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    expected: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    count_cuda_syncs: bool = True
    name: str = "torch"
    _syncs: CudaSyncCounter | None = None
    _syncs_tag: str = ""
    _watch: CompileWatch = field(default_factory=CompileWatch)
    _monotonic: Monotonic = field(default_factory=Monotonic)
    _compile_base: dict[str, float] | None = None
    _compiled: bool = False
    _quiet: tuple[int, int] | None = None
    _logged: Counter[torch.device] = field(default_factory=Counter)
    _logged_cpu: int = 0  # CPU tensors logged (kept apart from _logged: the hot path)
    _accelerator: str | None = None
    _buffers: _Pool | None = None
    _events: _Pool | None = None
    _timers: _Pool | None = None

    def __post_init__(self) -> None:
        BackendBase.__init__(self)
        self._accelerator = accelerator_present()
        if self.device.type == "cuda":
            self._buffers = _Pool(lambda dt: torch.empty((), dtype=dt, pin_memory=True))
            self._events = _Pool(lambda _: torch.cuda.Event())
            self._timers = _Pool(lambda _: torch.cuda.Event(enable_timing=True))
        self._watch.install()
        self._syncs, self._syncs_tag = cuda_sync_counter(self.device, self.count_cuda_syncs)

    @property
    def step_time_kind(self) -> str:
        return "cuda_event" if self._timers is not None else "wall"

    # --- timing -------------------------------------------------------------------
    def begin_step(self, step: int) -> Any:
        if self._timers is None:
            return time.perf_counter()
        if self._syncs is not None:
            self._syncs.begin()
        ev = self._timers.take(None)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def end_step(self, step: int, token: Any) -> Any:
        if self._timers is None:
            return time.perf_counter() - token
        if self._syncs is not None:
            self._syncs.end()
        ev = self._timers.take(None)
        ev.record(torch.cuda.current_stream(self.device))
        return _CudaTiming(token, ev)

    # --- values -------------------------------------------------------------------
    def fetch(self, value: Any) -> Any:
        if type(value) is float:
            return value
        if isinstance(value, torch.Tensor):
            return self._fetch_tensor(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"cannot record a value of type {type(value).__name__}; "
                            "log tensors or real numbers")
        return float(value)

    def _fetch_tensor(self, t: torch.Tensor) -> Any:
        if t.numel() != 1:
            raise ValueError(f"logged tensor has shape {tuple(t.shape)}; log one-element "
                             "tensors (reduce it in the step, e.g. .mean())")
        if t.is_cpu:  # the per-step path: counted without building a torch.device
            if t.is_complex():
                raise TypeError("cannot record a complex tensor")
            self._logged_cpu += 1
            return tensor_to_float(t)
        if t.dtype.is_complex:
            raise TypeError("cannot record a complex tensor")
        dev = t.device
        self._logged[dev] += 1
        if dev.type == "cuda":
            return self._copy_from_cuda(t)
        raise TypeError(f"tensor on device {dev}: the torch probe reads CPU and CUDA values "
                        "(use refrun.xla.instrument for XLA tensors)")

    def _copy_from_cuda(self, t: torch.Tensor) -> _CudaValue:
        if self._buffers is None:  # model on CPU but a value on CUDA: set up lazily
            self._buffers = _Pool(lambda dt: torch.empty((), dtype=dt, pin_memory=True))
            self._events = _Pool(lambda _: torch.cuda.Event())
        assert self._events is not None
        src = t.detach().reshape(())
        buf = self._buffers.take(src.dtype)
        buf.copy_(src, non_blocking=True)
        ev = self._events.take(None)
        ev.record(torch.cuda.current_stream(t.device))
        return _CudaValue(buf, ev)

    def ready(self, pending: Any) -> float | None:
        if isinstance(pending, float):
            return pending
        if isinstance(pending, _CudaValue):
            if not pending.event.query():
                return None
            return self._read_cuda(pending)
        if isinstance(pending, _CudaTiming):
            if not pending.end.query():
                return None
            return self._read_timing(pending)
        raise TypeError(f"unknown pending value {type(pending).__name__}")

    def wait(self, pending: Any) -> float:
        if isinstance(pending, _CudaValue):
            pending.event.synchronize()
        elif isinstance(pending, _CudaTiming):
            pending.end.synchronize()
        value = self.ready(pending)
        assert value is not None
        return value

    def _read_cuda(self, p: _CudaValue) -> float:
        value = tensor_to_float(p.buf)
        assert self._buffers is not None and self._events is not None
        self._buffers.give(p.buf.dtype, p.buf)
        self._events.give(None, p.event)
        return value

    def _read_timing(self, p: _CudaTiming) -> float:
        seconds = p.start.elapsed_time(p.end) / 1e3  # elapsed_time is in milliseconds
        assert self._timers is not None
        self._timers.give(None, p.start)
        self._timers.give(None, p.end)
        return seconds

    def observe(self, model: torch.nn.Module | None = None,
                optimizer: torch.optim.Optimizer | None = None, **other: Any) -> None:
        """Read ``model`` / ``optimizer`` from now on (:func:`rebind`)."""
        rebind(self, model, optimizer, **other)

    # --- counters and placement ------------------------------------------------------
    def counters(self) -> Mapping[str, float]:
        """Compile counters (:meth:`compile_counters`) and, on CUDA, the host syncs
        counted inside steps (``xfer/host_syncs``)."""
        out = self.compile_counters()
        if self._syncs is None:
            return out
        return {**out, schema.M_HOST_SYNCS: float(self._syncs.n)}

    def compile_counters(self) -> Mapping[str, float]:
        """Compile counters since this backend was created; empty until something has
        compiled, so an eager run records no ``compile/*`` metrics at all (absent means
        nothing compiled) and a compiled run records them from its first compiling step."""
        if not self._compiled:
            quiet = self._quiet_signature()
            if quiet is not None and quiet == self._quiet:
                return {}  # the eager fast path: two lookups, nothing compiled since
            self._quiet = quiet
        now = self._monotonic(dynamo_counters(self._watch))
        if self._compile_base is None:
            self._compile_base = now  # what the process compiled before the probe existed
        base = self._compile_base
        since = {k: v - base.get(k, 0.0) for k, v in now.items()}
        if not self._compiled:
            if not any(since.values()):
                return {}
            self._compiled = True
        return since

    def _quiet_signature(self) -> tuple[int, int] | None:
        """(compile callbacks seen, Dynamo graphs): unchanged means nothing compiled."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return None
        self._watch.install()
        stats = utils.counters.get("stats")
        return self._watch.compiles, (stats.get("unique_graphs", 0) if stats else 0)

    def placement(self, final: bool) -> Placement:
        """Current placement of parameters, optimizer state and logged tensors (how many
        were logged on each device when ``final``, else None for each device seen)."""
        params = count_devices(self.model.parameters()) if self.model is not None else {}
        opt_params: dict[str, int] = {}
        opt_state: dict[str, int] = {}
        if self.optimizer is not None:
            opt_params = count_devices(p for g in self.optimizer.param_groups
                                       for p in g["params"])
            opt_state = count_devices(optimizer_state_tensors(self.optimizer))
        logged: dict[str, int | None] = {str(d): n for d, n in self._logged.items()}
        if self._logged_cpu:
            logged["cpu"] = (logged.get("cpu") or 0) + self._logged_cpu
        if not final:
            logged = dict.fromkeys(logged)
        return Placement(params, opt_params, opt_state, logged, self._accelerator, self.expected)

    def describe(self, final: bool = False) -> Mapping[str, Any]:
        pl = self.placement(final)
        devices = {d for d in pl.params if not d.startswith("cpu")}
        out: dict[str, Any] = {
            schema.TAG_PLACEMENT: pl.to_json(),
            schema.TAG_EXEC_HARDWARE: self._hardware(pl),
            schema.TAG_EXEC_DEVICES: max(len(devices), 1),
            schema.TAG_STEP_TIME_KIND: self.step_time_kind,
            schema.TAG_TORCH_CUDA_SYNCS: self._syncs_tag,
        }
        out[schema.TAG_PLACEMENT_WARNING] = pl.warnings(self.model is not None)
        return out

    def _hardware(self, pl: Placement) -> str:
        used = sorted(set(pl.params) | set(pl.logged))
        if any(d.startswith("cuda") for d in used):
            try:
                return f"cuda: {torch.cuda.get_device_name(self.device)}"
            except Exception:
                return "cuda"
        return "cpu" if used or self.model is not None else "unknown"

    def close(self) -> None:
        self._watch.remove()
        if self._syncs is not None:
            self._syncs.remove()
        for pool in (self._buffers, self._events, self._timers):
            if pool is not None:
                pool.clear()


def model_device(model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None) -> torch.device:
    """The device of the first parameter (model first, then optimizer); CPU if none."""
    sources: list[Iterable[torch.Tensor]] = []
    if model is not None:
        sources.append(model.parameters())
    if optimizer is not None:
        sources.append(p for g in optimizer.param_groups for p in g["params"])
    for src in sources:
        for p in src:
            return p.device
    return torch.device("cpu")
