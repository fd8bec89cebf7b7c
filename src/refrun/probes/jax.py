"""The JAX backend of :class:`refrun.probes.base.Probe`.

What it measures, and how, without adding a host sync to the loop:

* **Values** given to ``probe.log``: ``copy_to_host_async()`` is started at once; the value
  is read when ``arr.is_ready()`` says the device is done (checked at the next step
  entry), blockingly only at close.
* **Step time** (``perf/step_time_s``, kind ``ready``): JAX dispatch is asynchronous, so the
  wall time of the Python step body is only the dispatch time.  The probe notes the wall
  time at step entry, and a watcher thread notes the time at which the step's logged
  device values became ready (it waits on them off the training thread).  The step
  time is ``ready_n - max(entry_n, ready_{n-1})``: from when step ``n`` could start on
  the device (entered, and the previous step's outputs done) to when its outputs were
  done.  A step that logs no device value gets the wall time of its body (kind
  ``wall``); the tag ``refrun.perf.step_time_kind`` says which was measured.
* **Compilations** through :mod:`jax.monitoring`: every XLA compilation emits
  ``/jax/core/compile/backend_compile_duration`` with ``fun_name`` (``jit(train_step)``),
  a start scalar before it and ``/jax/compilation_cache/cache_hits`` inside it when the
  persistent cache served it.  A compilation started *inside* ``probe.step`` of a step
  function counts as ``compile/graphs`` (``compile/recompiles`` when that function was
  compiled before); every other compilation as ``compile/other``: eager ``jnp`` ops,
  ``jax.random`` helpers and JAX's own jitted library functions (``jax.nn.log_softmax``,
  the ``-x`` of an array), and *anything* compiled between steps (an evaluation helper),
  whatever its name.  Persistent-cache hits are ``compile/cache_hits``, never
  compilations; ``compile/time_s`` is the backend compile time (including cache
  retrieval).  So that the counts do not depend on what ran earlier in the process, the
  probe clears JAX's in-memory compilation caches when it starts (``fresh_caches``): the
  first step compiles as it would in a fresh process.
* **Transfers**: an optional ``jax.transfer_guard`` level around the step.  With ``log``
  the runtime writes one line per implicit host-to-device transfer to the process's
  stderr; the probe counts those lines (``xfer/h2d``) and passes everything through.
  With ``disallow`` a completed step had no implicit transfer (``xfer/h2d`` = 0).
* **Host reads** of ``jax.Array`` values inside the step (``float(x)``, ``int(x)``,
  ``x.item()``, ``x.tolist()``, ``np.asarray(x)``, printing): each waits for the device,
  the ``.item()`` class of silent slowdowns; counted as ``xfer/host_syncs`` on every
  platform, CPU included (:mod:`refrun.probes.host_reads`: the array type's read entry
  points are wrapped while the probe is open and count into a thread-local; the read
  already waits, the count adds no sync).  The probe's own reads of logged values are
  made between steps with counting suspended and are never counted.
* **Placement** (``refrun.placement``, ``refrun.exec.*`` tags) from the devices and
  shardings of the parameters and batches, and ``refrun.placement.warning`` when the
  run declared an accelerator but the arrays live on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import re
import select
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from refrun import limits, schema
from refrun.probes import host_reads
from refrun.probes.base import BackendBase, Probe
from refrun.probes.hardware import is_accelerator
from refrun.probes.optim import lr_names

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
M_COMPILE_OTHER = schema.M_COMPILE_OTHER
TRANSFER_LEVELS = ("log", "disallow", "log_explicit", "disallow_explicit")
H2D_MARKER = b"host-to-device transfer"
NO_DETAIL = "(repeated transfer: the runtime printed no detail)"
_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax,)) + tuple(
    os.path.dirname(sys.modules[n].__file__) + os.sep
    for n in ("jaxlib",) if n in sys.modules and getattr(sys.modules[n], "__file__", None)
)
# Entry points through which user code runs its own compiled function.
_USER_ENTRY_FILES = ("pjit.py", "pmap.py")
_WRAPPED_NAME = re.compile(r"^\w+\((.*)\)$")
MAX_COMPILE_EVENTS = 10_000


class LostValue(float):
    """A value that could not be read (deleted or donated buffer); never emitted."""


LOST = LostValue("nan")


# --- compilation attribution -------------------------------------------------------------
def function_name(fun_name: str) -> str:
    """``jit(train_step)`` -> ``train_step`` (the name JAX gives the compiled module)."""
    m = _WRAPPED_NAME.match(fun_name)
    return m.group(1) if m else fun_name


def jitted_function(frame: Any) -> Any:
    """The Python function being compiled: the ``fun`` of the innermost ``cache_miss``
    frame of ``pjit.py`` (JAX's jit entry point); None when not found."""
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_name == "cache_miss" and code.co_filename.endswith("pjit.py"):
            return f.f_locals.get("fun")
        f = f.f_back
    return None


def is_library_function(fun: Any) -> bool:
    """True when ``fun`` (unwrapped through ``functools.partial`` and ``__wrapped__``) is
    defined inside JAX itself: ``jax.nn.log_softmax``, ``jnp.negative`` (``-x``) ...
    Such a compilation is never the user's step, whatever called it."""
    seen = 0
    while seen < 16:  # unwrap partials and decorators, bounded
        seen += 1
        inner = getattr(fun, "func", None) or getattr(fun, "__wrapped__", None)
        if inner is None:
            break
        fun = inner
    code = getattr(fun, "__code__", None)
    return code is not None and code.co_filename.startswith(_JAX_DIRS)


def called_from_user_jit(frame: Any) -> bool:
    """True when the compilation was started by user code calling a jitted/pmapped
    function, False when a JAX library function (eager ``jnp`` op, ``jax.random`` ...)
    started it.  Decided by the JAX frame that user code called into."""
    entry = None
    f = frame
    while f is not None:
        fname = f.f_code.co_filename
        if not fname.startswith(_JAX_DIRS):
            if not fname.endswith(os.path.join("refrun", "probes", "jax.py")):
                break
        elif not fname.endswith("traceback_util.py"):
            entry = fname
        f = f.f_back
    return entry is not None and entry.endswith(_USER_ENTRY_FILES)


@dataclass
class _Compile:
    fun_name: str
    is_step: bool
    cache_hit: bool = False


@dataclass
class CompileTracker:
    """Counts compilations from :mod:`jax.monitoring` events; see module doc.

    ``step_names``: names of the step functions (``train_step``); None means "any function
    user code called through ``jit``/``pmap``" (eager helpers excluded by call site).
    """

    step_names: frozenset[str] | None = None
    in_step: bool = False  # set by the backend around probe.step
    graphs: int = 0
    recompiles: int = 0
    cache_hits: int = 0
    other: int = 0
    time_s: float = 0.0
    by_function: Counter[str] = field(default_factory=Counter)
    events: list[dict[str, Any]] = field(default_factory=list)
    current_step: int | None = None
    _seen: set[str] = field(default_factory=set)
    _tls: threading.local = field(default_factory=threading.local)
    _installed: bool = False

    def install(self) -> None:
        jax.monitoring.register_scalar_listener(self._on_start)
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        self._installed = True

    def remove(self) -> None:
        """Unregister the listeners (safe to call twice)."""
        if not self._installed:
            return
        self._installed = False
        for unregister, cb in (
            (jax.monitoring.unregister_scalar_listener, self._on_start),
            (jax.monitoring.unregister_event_listener, self._on_event),
            (jax.monitoring.unregister_event_duration_listener, self._on_duration),
        ):
            with contextlib.suppress(AssertionError, ValueError):
                unregister(cb)

    def is_step(self, fun_name: str, frame: Any) -> bool:
        """A step compilation: started inside ``probe.step``, of a named step function
        (or, without names, of a user function called through ``jit``/``pmap``)."""
        if not self.in_step:
            return False  # between steps: an evaluation helper, data preparation ...
        if self.step_names is not None:
            return function_name(fun_name) in self.step_names
        if is_library_function(jitted_function(frame)):
            return False
        return called_from_user_jit(frame)

    def _stack(self) -> list[_Compile]:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _on_start(self, event: str, value: float, **kw: Any) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        name = str(kw.get("fun_name", "?"))
        self._stack().append(_Compile(name, self.is_step(name, sys._getframe(1))))

    def _on_event(self, event: str, **kw: Any) -> None:
        if event == CACHE_HIT_EVENT:
            st = self._stack()
            if st:
                st[-1].cache_hit = True

    def _on_duration(self, event: str, secs: float, **kw: Any) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        name = str(kw.get("fun_name", "?"))
        st = self._stack()
        c = st.pop() if st and st[-1].fun_name == name else _Compile(
            name, self.is_step(name, sys._getframe(1)))
        self.time_s += float(secs)
        kind = "cache_hit" if c.cache_hit else "graph" if c.is_step else "other"
        if c.cache_hit:
            self.cache_hits += 1
        elif c.is_step:
            self.graphs += 1
            if name in self._seen:
                self.recompiles += 1
                kind = "recompile"
        else:
            self.other += 1
        if c.is_step:
            self._seen.add(name)
        self.by_function[f"{name} [{kind}]"] += 1
        if len(self.events) < MAX_COMPILE_EVENTS:
            where = "step" if self.in_step else "between_steps"
            self.events.append({"step": self.current_step, "where": where,
                                "function": name, "kind": kind,
                                "seconds": round(float(secs), 6)})

    def counters(self) -> dict[str, float]:
        return {schema.M_COMPILE_GRAPHS: self.graphs,
                schema.M_COMPILE_RECOMPILES: self.recompiles,
                schema.M_COMPILE_CACHE_HITS: self.cache_hits,
                M_COMPILE_OTHER: self.other,
                schema.M_COMPILE_TIME: self.time_s}


def forget_compiled() -> None:
    """Forget every in-memory compiled executable (``jax.clear_caches``), outside any step.

    Executables compiled earlier in this process (a previous run, a notebook cell, an
    evaluation helper) would make this run compile less than a fresh process does, so its
    counts would depend on what ran before.  After this, the step function and every
    helper compile at their first use, as in a fresh process (the persistent compilation
    cache, when configured, still serves them and is counted as ``compile/cache_hits``)."""
    jax.clear_caches()


# --- host-to-device transfer counting ----------------------------------------------------
@dataclass
class TransferSite:
    """One distinct transfer-guard line (what was transferred, where to), how often."""

    text: str
    count: int
    first_step: int | None


class StderrLineCounter:
    """Counts the lines containing ``marker`` written to file descriptor 2 (where the JAX
    runtime writes transfer-guard lines) and summarises them instead of flooding stderr.

    fd 2 is replaced by a pipe for the counter's lifetime; a thread forwards the bytes so
    the writer can never block on a full pipe.  Every other line is forwarded unchanged;
    of the marker lines only the first ``echo_first`` are forwarded, the rest are counted,
    and the first ``max_sites`` distinct ones are kept (:attr:`sites`) for the
    ``refrun/jax_transfers.json`` summary.  :meth:`count` first drains what is already in
    the pipe, so a step's lines are attributed to that step.
    """

    def __init__(self, marker: bytes = H2D_MARKER, echo_first: int = 3,
                 max_sites: int = 20) -> None:
        self.marker = marker
        self.echo_first = echo_first
        self.max_sites = max_sites
        self.total = 0
        self.suppressed = 0
        self.step: int | None = None  # attributed to sites first seen now
        self.sites: dict[str, TransferSite] = {}
        self._partial = b""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._r, w = os.pipe()
        os.set_blocking(self._r, False)
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(target=self._pump, daemon=True,
                                        name="refrun-jax-stderr")
        self._thread.start()

    def _line(self, line: bytes) -> bytes:
        """What to forward for one complete line (with its newline)."""
        at = line.find(self.marker)
        if at < 0:
            return line
        self.total += 1
        site = line[at + len(self.marker):].strip(b": \r\n").decode("utf-8", "replace")
        site = site or NO_DETAIL  # the runtime details a transfer site only the first time
        known = self.sites.get(site)
        if known is not None:
            known.count += 1
        elif len(self.sites) < self.max_sites:
            self.sites[site] = TransferSite(site, 1, self.step)
        if self.total <= self.echo_first:
            return line
        self.suppressed += 1
        return b""

    def _read_available(self) -> None:
        while True:
            try:
                chunk = os.read(self._r, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            data = self._partial + chunk
            lines = data.split(b"\n")
            self._partial = lines.pop()
            if len(self._partial) > 65536:  # a huge line without newline: pass it on
                lines.append(self._partial)
                self._partial = b""
            out = b"".join(self._line(ln + b"\n") for ln in lines)
            if out:
                os.write(self._saved, out)

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self._r], [], [], 0.2)
            except (OSError, ValueError):
                return
            if readable:
                with self._lock:
                    self._read_available()

    def count(self) -> int:
        """Marker lines written so far."""
        with self._lock:
            self._read_available()
            return self.total

    def close(self) -> None:
        """Restore fd 2, forward anything still in the pipe, and say once how many
        transfer lines were summarised instead of printed."""
        if self._stop.is_set():
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        with self._lock:
            self._read_available()
            os.dup2(self._saved, 2)
            self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            self._read_available()
            if self._partial:
                os.write(self._saved, self._line(self._partial))
                self._partial = b""
            os.close(self._r)
            os.close(self._saved)
        if self.suppressed:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"refrun: {self.suppressed} more JAX host-to-device transfer "
                                 f"lines not printed ({self.total} in all); counts per step "
                                 f"and the first {len(self.sites)} distinct transfers are in "
                                 f"{schema.ARTIFACT_JAX_TRANSFERS}\n")


# --- step time to readiness ----------------------------------------------------------------
@dataclass
class PendingStepTime:
    """Step time resolved by the watcher thread once the step's outputs are ready."""

    step: int
    entry_s: float
    exit_s: float
    arrays: list[Any]
    value: float | None = None
    done: threading.Event = field(default_factory=threading.Event)


class ReadyWatcher:
    """Waits, off the training thread, for each step's logged outputs and computes
    ``ready_n - max(entry_n, ready_{n-1})`` (seconds, ``time.perf_counter`` clock)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[PendingStepTime | None] = queue.SimpleQueue()
        self._prev_ready = -math.inf
        self.failures = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="refrun-jax-ready")
        self._thread.start()

    def submit(self, p: PendingStepTime) -> None:
        self._q.put(p)

    def _run(self) -> None:
        while True:
            p = self._q.get()
            if p is None:
                return
            try:
                for a in p.arrays:
                    a.block_until_ready()  # this thread only; releases the GIL
                ready = time.perf_counter()
                p.value = ready - max(p.entry_s, self._prev_ready)
                self._prev_ready = ready
            except Exception:  # a deleted/donated output: fall back to the wall time
                self.failures += 1
                p.value = p.exit_s - p.entry_s
            p.arrays = []
            p.done.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


# --- placement ----------------------------------------------------------------------------
def _sharding_text(s: Any) -> str:
    return re.sub(r"\s+", " ", str(s))


def mesh_of(sharding: Any) -> dict[str, int] | None:
    """Axis name -> size of a NamedSharding's mesh (None for other shardings)."""
    mesh = getattr(sharding, "mesh", None)
    shape = getattr(mesh, "shape", None)
    if shape is None:
        return None
    return {str(k): int(v) for k, v in dict(shape).items()}


def placement_summary(tree: Any, max_shardings: int = 8) -> dict[str, Any]:
    """Where a pytree's arrays live: leaf counts, devices, platforms and the distinct
    shardings (at most ``max_shardings`` listed)."""
    leaves = jax.tree_util.tree_leaves(tree)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    devices: set[str] = set()
    platforms: set[str] = set()
    shardings: dict[str, int] = {}
    meshes: list[dict[str, int]] = []
    for a in arrays:
        s = a.sharding
        devs = s.device_set
        devices.update(str(d) for d in devs)
        platforms.update(d.platform for d in devs)
        key = _sharding_text(s)
        shardings[key] = shardings.get(key, 0) + 1
        m = mesh_of(s)
        if m is not None and m not in meshes:
            meshes.append(m)
    return {
        "leaves": len(leaves),
        "arrays": len(arrays),
        "host_leaves": len(leaves) - len(arrays),
        "devices": sorted(devices),
        "platforms": sorted(platforms),
        "shardings": dict(list(shardings.items())[:max_shardings]),
        "meshes": meshes,
    }


declares_accelerator = is_accelerator  # the one rule (refrun.probes.hardware)


def placement_warnings(declared: str | None, backend: str,
                       parts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Sentences for a run that declares an accelerator (or whose default backend is one)
    but whose JAX backend or observed arrays are on the CPU; empty when placement is
    consistent (the shape every backend's placement check has)."""
    out: list[str] = []
    if declares_accelerator(declared) and backend == "cpu":
        out.append(f"run declares hardware {declared!r} but JAX runs on the CPU "
                   f"(jax.default_backend() == 'cpu')")
    for what, p in parts.items():
        plats = set(p.get("platforms", ()))
        if plats == {"cpu"} and (backend != "cpu" or declares_accelerator(declared)):
            out.append(f"{what} live on the CPU while the run declares {declared!r} and the "
                       f"default JAX backend is {backend!r}")
    return out


# --- the backend ---------------------------------------------------------------------------
class JaxBackend(BackendBase):
    """:class:`refrun.probes.base.Backend` for JAX; see the module doc for what it records."""

    name = "jax"

    def __init__(self, *, step_fns: Iterable[Any] = (), transfer_guard: str | None = None,
                 hardware: str | None = None, mesh: Any = None,
                 fresh_caches: bool = True, count_host_reads: bool = True) -> None:
        super().__init__()
        names = [f if isinstance(f, str) else getattr(f, "__name__", None) for f in step_fns]
        self.compiles = CompileTracker(frozenset(n for n in names if n) or None)
        self.fresh_caches = fresh_caches
        if fresh_caches:
            forget_compiled()
        self.transfer_guard = transfer_guard
        self.declared_hardware = hardware
        self.mesh = mesh
        self.placement: dict[str, dict[str, Any]] = {}
        self.ready_steps = 0
        self.wall_steps = 0
        self.lost_values = 0
        self._step_arrays: list[Any] | None = None
        self._guard_cm: Any = None
        self._h2d: StderrLineCounter | None = None
        self._h2d_checked = 0
        self._h2d_last = 0
        self._h2d_by_step: dict[int, int] = {}
        self._ended_step: int | None = None
        self._watcher = ReadyWatcher()
        self.compiles.install()
        # Host reads inside the step (xfer/host_syncs); None when not counted.
        self._reads: host_reads.ReadCount | None = None
        self.read_coverage = host_reads.Coverage(False, False, "count_host_reads=False")
        if count_host_reads:
            self.read_coverage = host_reads.install()
            if self.read_coverage.value_property:
                self._reads = host_reads.ReadCount()
            else:
                host_reads.remove()
        if transfer_guard in ("log", "log_explicit"):
            self._h2d = StderrLineCounter()

    # --- step ---------------------------------------------------------------------------
    def begin_step(self, step: int) -> float:
        self.compiles.current_step = step
        self.compiles.in_step = True
        if self._h2d is not None:
            self._h2d.step = step  # transfer sites first seen from now on
        self._step_arrays = []
        if self.transfer_guard is not None:
            cm = jax.transfer_guard(self.transfer_guard)
            cm.__enter__()
            self._guard_cm = cm
        if self._reads is not None:
            host_reads.activate(self._reads)  # last: only the user's step is counted
        return time.perf_counter()

    def end_step(self, step: int, token: float) -> PendingStepTime | float:
        now = time.perf_counter()
        if self._reads is not None:
            host_reads.activate(None)
        self.compiles.in_step = False  # until the next step: "between steps"
        self._ended_step = step
        if self._guard_cm is not None:
            cm, self._guard_cm = self._guard_cm, None
            cm.__exit__(None, None, None)
            if self.transfer_guard.startswith("disallow"):
                self._h2d_checked += 1  # a completed step had no implicit transfer
        arrays, self._step_arrays = self._step_arrays or [], None
        if not arrays:
            self.wall_steps += 1
            return now - token
        self.ready_steps += 1
        p = PendingStepTime(step, token, now, arrays)
        self._watcher.submit(p)
        return p

    # --- values -------------------------------------------------------------------------
    def fetch(self, value: Any) -> Any:
        if isinstance(value, jax.Array):
            if value.size != 1:
                raise ValueError(f"probe.log takes scalars; got a jax array of shape "
                                 f"{value.shape} (reduce it first)")
            value.copy_to_host_async()
            if self._step_arrays is not None:
                self._step_arrays.append(value)
            return value
        if isinstance(value, np.ndarray | np.generic):
            return float(np.asarray(value).reshape(()))
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError(f"probe.log: cannot record a value of type {type(value).__name__}")

    def ready(self, pending: Any) -> float | None:
        if isinstance(pending, PendingStepTime):
            return pending.value
        if isinstance(pending, float):
            return pending
        prev = host_reads.activate(None)  # the probe's own read is never the user's
        try:
            if not pending.is_ready():
                return None
            return float(np.asarray(pending).reshape(()))
        except Exception:  # deleted or donated before it was read
            self.lost_values += 1
            return LOST
        finally:
            host_reads.activate(prev)

    def wait(self, pending: Any) -> float:
        if isinstance(pending, PendingStepTime):
            pending.done.wait(timeout=60)
            return pending.value if pending.value is not None else LOST
        if isinstance(pending, float):
            return pending
        prev = host_reads.activate(None)
        try:
            return float(np.asarray(pending).reshape(()))
        except Exception:
            self.lost_values += 1
            return LOST
        finally:
            host_reads.activate(prev)

    # --- counters and description ---------------------------------------------------------
    def counters(self) -> dict[str, float]:
        out = self.compiles.counters()
        if self._reads is not None:
            out[schema.M_HOST_SYNCS] = float(self._reads.n)
        if self._h2d is not None:
            total = self._h2d.count()
            if self._ended_step is not None and total > self._h2d_last:
                self._h2d_by_step[self._ended_step] = total - self._h2d_last
            self._h2d_last = total
            out[schema.M_XFER_H2D] = total
        elif self.transfer_guard is not None:
            out[schema.M_XFER_H2D] = 0.0
        return out

    def observe(self, **trees: Any) -> None:
        """Record where the given pytrees' arrays live (``params=``, ``batch=`` ...)."""
        for what, tree in trees.items():
            if tree is not None:
                self.placement[what] = placement_summary(tree)

    def step_time_kind(self) -> str:
        if self.ready_steps and self.wall_steps:
            return "ready+wall"
        return "wall" if self.wall_steps and not self.ready_steps else "ready"


    def describe(self) -> dict[str, Any]:
        devices = jax.devices()
        used: set[str] = set()
        meshes: list[dict[str, int]] = []
        for p in self.placement.values():
            used.update(p["devices"])
            meshes.extend(m for m in p["meshes"] if m not in meshes)
        mesh = mesh_of(self.mesh) if self.mesh is not None and not isinstance(
            self.mesh, Mapping) else (dict(self.mesh) if self.mesh is not None else None)
        if mesh is None and meshes:
            mesh = meshes[0]
        desc: dict[str, Any] = {
            schema.TAG_EXEC_HARDWARE: exec_hardware(devices),
            schema.TAG_EXEC_DEVICE_KIND: devices[0].device_kind if devices else "",
            schema.TAG_EXEC_DEVICES: len(used) if used else jax.device_count(),
            schema.TAG_EXEC_VISIBLE_DEVICES: jax.device_count(),
            schema.TAG_EXEC_WORLD_SIZE: jax.process_count(),
            schema.TAG_PLACEMENT: json.dumps(
                {"default_backend": jax.default_backend(), **self.placement},
                sort_keys=True)[:limits.TAG_VALUE_LENGTH],
            schema.TAG_STEP_TIME_KIND: self.step_time_kind(),
            schema.TAG_STEP_TIME_WALL_STEPS: self.wall_steps,
            schema.TAG_JAX_TRANSFER_GUARD: self.transfer_guard or "off",
            schema.TAG_JAX_FRESH_CACHES: str(self.fresh_caches).lower(),
            schema.TAG_JAX_HOST_READS: self.read_coverage.text(),
            schema.TAG_JAX_STEP_FUNCTIONS: ",".join(sorted(self.compiles.step_names))
            if self.compiles.step_names else "(called through jit/pmap)",
        }
        if mesh:
            desc[schema.TAG_MESH] = json.dumps(mesh)
        desc[schema.TAG_PLACEMENT_WARNING] = placement_warnings(
            self.declared_hardware, jax.default_backend(), self.placement)
        peak = memory_peak_bytes()
        if peak is not None:
            desc[schema.TAG_EXEC_MEMORY_PEAK] = peak
        return desc

    def close(self) -> None:
        self.compiles.remove()
        if self._reads is not None:
            self._reads = None
            host_reads.remove()
        if self._guard_cm is not None:
            with contextlib.suppress(Exception):
                self._guard_cm.__exit__(None, None, None)
            self._guard_cm = None
        if self._h2d is not None:
            self._h2d.close()
        self._watcher.close()

    def summary_tags(self) -> Mapping[str, Any]:
        if self._h2d is None:
            return {}
        return {schema.TAG_JAX_TRANSFERS: self._h2d.total}

    def artifacts(self) -> Mapping[str, Any]:
        """The compilation log and, with ``transfer_guard="log"``, the transfer summary."""
        c = self.compiles
        out: dict[str, Any] = {schema.ARTIFACT_JAX_COMPILATIONS: {
            "step_functions": sorted(c.step_names) if c.step_names else None,
            "fresh_caches": self.fresh_caches,
            "by_function": dict(c.by_function),
            "events": c.events,
        }}
        if self._h2d is not None:
            out[schema.ARTIFACT_JAX_TRANSFERS] = {
                "total": self._h2d.total,
                "printed": self._h2d.total - self._h2d.suppressed,
                "per_step": {str(k): v for k, v in sorted(self._h2d_by_step.items())},
                "sites": [dataclasses.asdict(t) for t in self._h2d.sites.values()],
                "max_sites": self._h2d.max_sites,
            }
        return out


def exec_hardware(devices: list[Any]) -> str:
    """``cpu``, or ``<platform>: <device kind>`` (``gpu: NVIDIA H100``) for accelerators."""
    backend = jax.default_backend()
    if backend == "cpu" or not devices:
        return backend
    return f"{backend}: {devices[0].device_kind}"


# --- memory --------------------------------------------------------------------------------
def memory_peak_bytes() -> int | None:
    """Largest ``peak_bytes_in_use`` over local devices; None where unsupported (CPU)."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class JaxMemoryMonitor:
    """``sys/<platform><id>_mem_bytes``, ``..._mem_peak_bytes`` and ``..._mem_limit_bytes``
    from ``device.memory_stats()`` (``bytes_in_use``, ``peak_bytes_in_use``,
    ``bytes_limit``; bytes); only built where a device reports them (not the CPU)."""

    name = "jax_memory"
    _FIELDS = (("bytes_in_use", schema.MEM_SUFFIX), ("peak_bytes_in_use", schema.MEM_PEAK_SUFFIX),
               ("bytes_limit", schema.MEM_LIMIT_SUFFIX))

    def __init__(self, devices: list[Any]) -> None:
        self.devices = devices

    @classmethod
    def available(cls) -> JaxMemoryMonitor | None:
        devs = [d for d in jax.local_devices() if d.memory_stats()]
        return cls(devs) if devs else None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.devices:
            stats = d.memory_stats() or {}
            for key, suffix in self._FIELDS:
                if key in stats:
                    out[schema.device_metric(d.platform, d.id, suffix)] = float(stats[key])
        return out

    def close(self) -> None:
        self.devices = []


# --- the probe: pytrees in log(), placement again with observe() -------------------------
@dataclass
class JaxProbe(Probe):
    """A :class:`Probe` whose ``log`` also accepts pytrees (tuples, lists, dataclasses
    registered with JAX ...) and which can record placement again with :meth:`observe`."""

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record scalars for ``step`` (default: the current step).  Values may be jax
        arrays of one element, numbers, or pytrees of them; a pytree leaf is named by its
        path (``grads/0/w``)."""
        if all(isinstance(v, jax.Array | float | int) for v in metrics.values()):
            super().log(step, **metrics)  # fast path: nothing to flatten
            return
        try:
            flat = flatten_pytree(metrics)
        except Exception as exc:
            self.run.warn_once("jax-log-flatten", f"probe.log: values not recorded: {exc}",
                               self._step)
            return
        super().log(step, **flat)

    def observe(self, **trees: Any) -> None:
        """Record where ``params=``, ``batch=`` (any pytrees) live; cheap enough for an
        occasional call, not for every step of a large model (it walks the pytree)."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        self._guard(lambda: backend.observe(**trees))
        self._describe()  # changed tags; a placement warning also becomes a run warning

    def _take(self, n: int, name: str, value: Any) -> bool:
        if isinstance(value, LostValue):
            self.run.warn_once(f"jax-lost:{name}", f"{name} at step {n} could not be read "
                               "(its buffer was deleted or donated before it was ready)", n)
            return False
        return super()._take(n, name, value)


# --- the optimizer's state: learning rates and update count (optax) -----------------------
LR_KEYS = ("learning_rate", "lr")  # optax's name for the rate, then a common one
MAX_STATE_DEPTH = 64


def optimizer_metrics(opt_state: Any) -> dict[str, Any]:
    """The learning rate(s) and update count an optax state holds, named as the PyTorch
    probes name a torch optimizer's (:mod:`refrun.probes.optim`): ``opt/lr`` (then
    ``opt/lr/pg1`` ... for further rates, in the state's order) and ``opt/steps``.

    The rates are those ``optax.inject_hyperparams`` keeps in the state: after an update,
    ``hyperparams["learning_rate"]`` is the rate *that update used* (the schedule at the
    update's count), as the torch probes record the rate of step ``n``'s update.  The count
    is the state's ``count`` (the first met, outermost first): the updates applied,
    this step's included.  Without ``inject_hyperparams`` the state holds no rate and only
    ``opt/steps`` is returned.

    Call it **inside the jitted step**, on the state the update returned, and return the
    dict with the step's outputs::

        params, opt_state, loss, opt = train_step(params, opt_state, batch)
        probe.log(loss=loss, **opt)

    The values are then fresh outputs of the step: the probe copies them to the host
    asynchronously like the loss (no host sync, no extra compilation, and they survive
    the state being donated to the next step).  Nothing is kept between calls: a state
    restored from a checkpoint into a new pytree is read as it is.  Only optax's
    structure is walked (tuples, named tuples, dicts of states), never a pytree of
    parameters (moments)."""
    rates: list[Any] = []
    count: Any = None
    for node in _state_nodes(opt_state, 0):
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, Mapping):
            rate = next((hp[k] for k in LR_KEYS if k in hp), None)
            if rate is not None:
                rates.append(rate)
        if count is None and "count" in node._fields:
            count = node.count
    out: dict[str, Any] = dict(zip(lr_names(len(rates)), rates, strict=True)) if rates else {}
    if count is not None:
        out[schema.M_OPT_STEPS] = count
    return out


def _is_leaf_value(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | int | float)


def _state_nodes(tree: Any, depth: int) -> Iterable[Any]:
    """The named-tuple nodes of an optax state, outermost first.  A plain container whose
    first value is an array holds parameters (moments, a mask), never a state: not
    entered, so the walk costs the state's nesting, not the model's size."""
    if depth > MAX_STATE_DEPTH:
        return
    named = isinstance(tree, tuple) and hasattr(tree, "_fields")
    if named:
        yield tree
        children = [getattr(tree, f) for f in tree._fields]
    elif isinstance(tree, tuple | list):
        children = list(tree)
    elif isinstance(tree, Mapping):
        children = list(tree.values())
    else:
        return
    if not named and children and _is_leaf_value(children[0]):
        return
    for child in children:
        if not _is_leaf_value(child):
            yield from _state_nodes(child, depth + 1)


def flatten_pytree(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a": (x, {"b": y})}`` -> ``{"a/0": x, "a/1/b": y}``: pytree leaves named by path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(dict(metrics))
    return {"/".join(_key_text(k) for k in path): leaf for path, leaf in leaves}


def _key_text(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k).strip("[].'\"")
