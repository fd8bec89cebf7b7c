"""The JAX backend of :class:`refrun.probes.base.Probe`.

What it measures, and how, without adding a host sync to the loop:

* **Values** given to ``probe.log``: the array is kept as the step returned it (appended
  to a list: nothing is read, copied or handed to a thread on the training thread); a
  collector thread reads a block of them once per flush interval in one stacked transfer
  (:mod:`refrun.probes.jax_blocks`).  An array the loop donates (or deletes) after logging
  it would be gone by then, so the first value of every name is copied on the device and
  the name watched: if the original is deleted by the end of the next step, every value
  of that name is copied when logged (tag ``refrun.jax.donated_logged``); otherwise none
  is.  A value found deleted later anyway is lost, said in a warning, counted in
  ``refrun.dropped`` (a run with a gap is never judged whole), and its name copied from
  then on.
* **Step time** (``perf/step_time_s``, kind ``interval``): the time from a step's entry to
  the next step's entry (the last step's: to ``probe.close()``), one clock read per step on
  the training thread.  Exact for a host-bound loop; a device-bound loop is paced by the
  runtime's queue of dispatched work once it is full (see
  :mod:`refrun.probes.jax_blocks`).
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
  made on its collector thread (or at close with counting suspended) and are never
  counted.
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
import re
import select
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.array import ArrayImpl
from jax.tree_util import tree_flatten

from refrun import limits, schema
from refrun.errors import RefrunInputError
from refrun.keys import key_problem
from refrun.probes import host_reads
from refrun.probes.base import BackendBase, Probe, _flush_interval, _StepScope
from refrun.probes.hardware import is_accelerator
from refrun.probes.jax_blocks import (
    LOST,
    BlockCollector,
    Column,
    ColumnReader,
    LostValue,
    Tree,
    choose_read_path,
    columns,
    counter_changes,
    precompile,
    step_intervals,
    take,
)
from refrun.probes.jax_buffer import (
    BUFFER_DTYPES,
    MAX_CAPACITY,
    FullBuffer,
    MetricsBuffer,
    empty_buffer,
    read_buffer,
    same_placement,
)
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

__all__ = ["LOST", "CompileTracker", "JaxBackend", "JaxMemoryMonitor", "JaxProbe",
           "LostValue", "flatten_pytree"]


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
    activity: int = 0
    """+1 at the start and +1 at the end of every compilation counted here (a step's,
    an evaluation's, a cache hit's): odd while one is under way; the compile events of
    :data:`refrun.probes.chip_busy.Progress`."""
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

    def ignore_this_thread(self, ignore: bool = True) -> None:
        """Count no compilation made on the calling thread (the probe's own: its collector
        compiles the stack that reads logged values)."""
        self._tls.ignore = ignore

    @contextlib.contextmanager
    def ignoring(self) -> Iterator[None]:
        """:meth:`ignore_this_thread` for the duration of a ``with`` block."""
        prev = getattr(self._tls, "ignore", False)
        self._tls.ignore = True
        try:
            yield
        finally:
            self._tls.ignore = prev

    def _stack(self) -> list[_Compile]:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _on_start(self, event: str, value: float, **kw: Any) -> None:
        if event != BACKEND_COMPILE_EVENT or getattr(self._tls, "ignore", False):
            return
        self.activity += 1
        name = str(kw.get("fun_name", "?"))
        self._stack().append(_Compile(name, self.is_step(name, sys._getframe(1))))

    def _on_event(self, event: str, **kw: Any) -> None:
        if event == CACHE_HIT_EVENT and not getattr(self._tls, "ignore", False):
            st = self._stack()
            if st:
                st[-1].cache_hit = True

    def _on_duration(self, event: str, secs: float, **kw: Any) -> None:
        if event != BACKEND_COMPILE_EVENT or getattr(self._tls, "ignore", False):
            return
        self.activity += 1
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
# Several JAX probes may be open in one process and stepped in turn (they do not interfere:
# each counts the compilations of its own steps).  One thing does: clearing JAX's compiled
# caches (fresh_caches=True) under a probe whose steps have compiled makes that probe
# count their recompilation as a recompile at its next step.
_OPEN_BACKENDS: weakref.WeakSet[JaxBackend] = weakref.WeakSet()


def _refuse_clearing_compiled_steps_of_others() -> None:
    """:class:`RefrunInputError` when another open JAX probe has counted a compilation:
    clearing the caches now would show that probe a recompilation it never caused."""
    for other in list(_OPEN_BACKENDS):
        if not other._closed and other.compiles.graphs + other.compiles.cache_hits:
            raise RefrunInputError(
                "refrun.jax.instrument(fresh_caches=True) while another JAX probe of this "
                "process is open and its steps have compiled: clearing JAX's compilation "
                "caches would make that probe count a recompilation at its next step. "
                "Pass fresh_caches=False, or close the other probe first")


class JaxBackend(BackendBase):
    """:class:`refrun.probes.base.Backend` for JAX; see the module doc for what it records.

    :class:`JaxProbe` drives it: :meth:`begin_step` / :meth:`end_step` around the user's
    step (compilation attribution, transfer guard, host-read counting), and
    :meth:`cumulative` -- the cumulative counters of :attr:`cumulative_names` as a tuple --
    kept per step and turned into per-step deltas off the training thread."""

    name = "jax"

    def __init__(self, *, step_fns: Iterable[Any] = (), transfer_guard: str | None = None,
                 hardware: str | None = None, mesh: Any = None,
                 fresh_caches: bool = True, count_host_reads: bool = True) -> None:
        super().__init__()
        names = [f if isinstance(f, str) else getattr(f, "__name__", None) for f in step_fns]
        self.compiles = CompileTracker(frozenset(n for n in names if n) or None)
        self.fresh_caches = fresh_caches
        if fresh_caches:
            _refuse_clearing_compiled_steps_of_others()
            forget_compiled()
        self.transfer_guard = transfer_guard
        self.declared_hardware = hardware
        self.mesh = mesh
        self.placement: dict[str, dict[str, Any]] = {}
        self.read_path = "stacked (not measured)"  # how logged values are read (the probe)
        # Logged names -> whether the loop donates (deletes) their arrays after logging
        # them: True copies each value when logged, False never; absent/None: not known
        # yet (the first value is copied and watched: JaxProbe).
        self.donated: dict[str, bool | None] = {}
        self._guard_cm: Any = None
        self._h2d: StderrLineCounter | None = None
        self._h2d_checked = 0
        self._h2d_by_step: dict[int, int] = {}
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
        self.cumulative_names, self.cumulative = self._counter_reader()
        self._closed = False
        _OPEN_BACKENDS.add(self)

    def _counter_reader(self) -> tuple[tuple[str, ...], Callable[[], tuple[Any, ...]]]:
        """The names of the cumulative counters and a reader of them as one tuple, built
        once for this configuration (one tuple per step, no dictionary)."""
        c, reads, h2d = self.compiles, self._reads, self._h2d
        names: tuple[str, ...] = (schema.M_COMPILE_GRAPHS, schema.M_COMPILE_RECOMPILES,
                                  schema.M_COMPILE_CACHE_HITS, M_COMPILE_OTHER,
                                  schema.M_COMPILE_TIME)
        if reads is not None:
            names += (schema.M_HOST_SYNCS,)
        if self.transfer_guard is not None:
            names += (schema.M_XFER_H2D,)
        if reads is not None and h2d is None and self.transfer_guard is None:
            return names, lambda: (c.graphs, c.recompiles, c.cache_hits, c.other, c.time_s,
                                   reads.n)
        if reads is None and self.transfer_guard is None:
            return names, lambda: (c.graphs, c.recompiles, c.cache_hits, c.other, c.time_s)

        def read() -> tuple[Any, ...]:  # with a transfer guard: the diagnostic mode
            row: tuple[Any, ...] = (c.graphs, c.recompiles, c.cache_hits, c.other, c.time_s)
            if reads is not None:
                row += (reads.n,)
            # "log": the lines the runtime wrote (drained so each step gets its own);
            # "disallow": 0, a completed step had no implicit transfer
            return (*row, h2d.count() if h2d is not None else 0)

        return names, read

    # --- step ---------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.compiles.current_step = step
        self.compiles.in_step = True
        if self._h2d is not None:
            self._h2d.step = step  # transfer sites first seen from now on
        if self.transfer_guard is not None:
            cm = jax.transfer_guard(self.transfer_guard)
            cm.__enter__()
            self._guard_cm = cm
        if self._reads is not None:
            host_reads.activate(self._reads)  # last: only the user's step is counted

    def end_step(self) -> None:
        if self._reads is not None:
            host_reads.activate(None)
        self.compiles.in_step = False  # until the next step: "between steps"
        if self._guard_cm is not None:
            cm, self._guard_cm = self._guard_cm, None
            cm.__exit__(None, None, None)
            if self.transfer_guard.startswith("disallow"):  # type: ignore[union-attr]
                self._h2d_checked += 1  # a completed step had no implicit transfer

    def transfers_at(self, step: int, count: float) -> None:
        """The implicit transfers counted at ``step`` (the transfer summary's per_step)."""
        if count > 0:
            self._h2d_by_step[step] = int(count)

    # --- counters and description ---------------------------------------------------------
    def counters(self) -> dict[str, float]:
        return dict(zip(self.cumulative_names, map(float, self.cumulative()), strict=True))

    def observe(self, **trees: Any) -> None:
        """Record where the given pytrees' arrays live (``params=``, ``batch=`` ...)."""
        for what, tree in trees.items():
            if tree is not None:
                self.placement[what] = placement_summary(tree)

    def step_time_kind(self) -> str:
        return schema.STEP_TIME_INTERVAL

    def describe(self, final: bool = False) -> dict[str, Any]:
        devices = jax.devices()
        used: set[str] = set()
        meshes: list[dict[str, int]] = []
        for p in dict(self.placement).values():  # a copy: observe() may run meanwhile
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
            schema.TAG_SPARSE_COUNTERS: ",".join(self.cumulative_names),
            schema.TAG_JAX_TRANSFER_GUARD: self.transfer_guard or "off",
            schema.TAG_JAX_FRESH_CACHES: str(self.fresh_caches).lower(),
            schema.TAG_JAX_HOST_READS: self.read_coverage.text(),
            schema.TAG_JAX_READ_PATH: self.read_path,
            schema.TAG_JAX_STEP_FUNCTIONS: ",".join(sorted(self.compiles.step_names))
            if self.compiles.step_names else "(called through jit/pmap)",
        }
        if mesh:
            desc[schema.TAG_MESH] = json.dumps(mesh)
        donated = sorted(k for k, v in dict(self.donated).items() if v)
        if donated:
            desc[schema.TAG_JAX_DONATED_LOGGED] = ",".join(donated)
        desc[schema.TAG_PLACEMENT_WARNING] = placement_warnings(
            self.declared_hardware, jax.default_backend(), self.placement)
        peak = memory_peak_bytes()
        if peak is not None:
            desc[schema.TAG_EXEC_MEMORY_PEAK] = peak
        return desc

    def close(self) -> None:
        self._closed = True
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


# --- the probe ---------------------------------------------------------------------------
_MISSING = object()
_SCALAR_TYPES = (float, int)


@dataclass
class JaxProbe(Probe):
    """A :class:`Probe` for JAX whose training-thread work per step is two list appends
    and a few attribute reads (see :mod:`refrun.probes.jax_blocks`); its ``log`` also
    accepts pytrees (tuples, lists, dicts, dataclasses registered with JAX ...), and it can
    record placement again with :meth:`observe`."""

    # Flat lists of numbers and references (GC-untracked contents: a retained tuple a
    # step is an allocation the garbage collector counts, see jax_blocks): a step's row
    # is (step, entry time); a logged value (step, name, value).
    _step_rows: list[Any] = field(default_factory=list, repr=False)
    _logged: list[Any] = field(default_factory=list, repr=False)
    # (row index, cumulative counters, progress override) where a counter moved or the
    # step said its own progress; a row index counts every step's row since the start.
    _row_events: list[tuple[int, tuple[Any, ...], Any]] = field(default_factory=list,
                                                                repr=False)
    _cum_seen: tuple[Any, ...] = field(default=(), repr=False)
    _events_ahead: list[tuple[int, tuple[Any, ...], Any]] = field(default_factory=list,
                                                                  repr=False)
    _entry: float = field(default=0.0, repr=False)
    _scope: Any = field(default=None, repr=False)
    _collector: BlockCollector | None = field(default=None, repr=False)
    _pending_row: tuple[int, float, int] | None = field(default=None, repr=False)
    _last_cum: tuple[Any, ...] = field(default=(), repr=False)
    _wall_offset: float = field(default=0.0, repr=False)
    _rows_seen: int = field(default=0, repr=False)
    # (logged name, the arrays as logged, steps done when the decision is due)
    _probing: list[tuple[str, list[Any], int]] = field(default_factory=list, repr=False)
    _leaf_names: dict[tuple[str, Any], list[str]] = field(default_factory=dict, repr=False)
    _donated: dict[str, bool | None] = field(default_factory=dict, repr=False)
    # Steps done at the next numerics reading (on the training thread: JAX's precision
    # contexts are thread-local): the first step's end, then every recheck_every steps.
    _numerics_due: int = field(default=1, repr=False)
    _reader: ColumnReader = field(default_factory=ColumnReader, repr=False)
    _treedefs: dict[str, Any] = field(default_factory=dict, repr=False)  # by logged name
    # Metrics buffers (refrun.probes.jax_buffer): the steps of the rows of the buffer in
    # use, when it was started, the last one log_buffer saw, and full ones for the
    # collector.
    _buf_steps: list[int] = field(default_factory=list, repr=False)
    _buf_started: float = field(default=0.0, repr=False)
    _buf_current: MetricsBuffer | None = field(default=None, repr=False)
    _buf_full: list[FullBuffer] = field(default_factory=list, repr=False)
    # an empty buffer the collector made for the next hand-over (its transfer to the
    # device then never runs on the training thread)
    _buf_spare: MetricsBuffer | None = field(default=None, repr=False)
    _buf_every_s: float = field(default=1.0, repr=False)  # the collector's interval,
    # kept here: one attribute read a step in log_buffer

    def __post_init__(self) -> None:
        super().__post_init__()
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        self._last_cum = self._cum_seen = tuple(self._guard(backend.cumulative) or ())
        self._donated = backend.donated  # the same dict, one attribute read less per log
        self._wall_offset = time.time() - time.perf_counter()
        self._scope = _JaxStep(self)
        with backend.compiles.ignoring():  # the probe's own compilations, not the run's
            self._guard(precompile)
            path = self._guard(choose_read_path)
        if path is not None:
            self._reader = ColumnReader(per_value=path.per_value)
            backend.read_path = path.text()
        self._buf_every_s = _flush_interval(self.run)
        self._collector = BlockCollector(self._collect, self._buf_every_s)
        self._collector.start(backend.compiles.ignore_this_thread)

    # --- the loop surface ------------------------------------------------------------
    def step(self, n: int) -> Any:
        """Context manager around training step ``n`` (see :class:`_JaxStep`)."""
        if self._in_step or self._closed:
            return _StepScope(self, n) if not self._closed else _ClosedStep(self, n)
        scope = self._scope
        scope.n = n
        return scope

    def progress_marker(self) -> tuple[int, int]:
        # every compilation's start and end, not the step's count: an evaluation compiled
        # between steps stalls the loop and idles the chip as much (on a TPU v5e the
        # sampler's first window opened as the evaluation began compiling, 11 runs in 26)
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        return self._steps_done, backend.compiles.activity

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record scalars for ``step`` (default: the current step).  Values may be jax
        arrays of one element, numbers, or pytrees of them; a pytree leaf is named by its
        path (``grads/0/w``).  Nothing is read here: values are read off the training
        thread once per flush interval."""
        n = self._step if step is None else step
        if n is None:
            self._refuse_unstepped(metrics)
            return
        extend = self._logged.extend
        donated = self._donated
        treedefs = self._treedefs
        for name, v in metrics.items():
            t = type(v)
            if t is ArrayImpl and not (v.shape and v.size != 1):
                if donated.get(name, _MISSING) is not False:
                    v = self._protected(name, [v])[0]
                extend((n, name, v))
            elif t in _SCALAR_TYPES:
                extend((n, name, v))
            elif t is dict and (tree := _scalar_arrays(v, treedefs.get(name))) is not None:
                treedefs[name] = tree[0]  # the structure kept: one object for all steps
                if donated.get(name, _MISSING) is not False:
                    tree = Tree(tree.treedef, self._protected(name, tree.leaves))
                extend((n, name, tree))
            else:
                try:
                    self._log_other(n, name, v)
                except Exception as exc:  # a probe must never break the loop
                    self._refuse_value(name, n, exc)

    def metrics_buffer(self, *names: str, capacity: int = 1024, dtype: Any = None,
                       sharding: Any = None) -> MetricsBuffer:
        """An empty :class:`~refrun.probes.jax_buffer.MetricsBuffer` for ``names``: pass
        it to the jitted step, return ``buf.record(name=value, ...)`` from it, and hand
        each step's result to :meth:`log_buffer` (see :mod:`refrun.probes.jax_buffer`).
        ``sharding``: where the step's outputs live when its inputs are committed to
        devices (a mesh-sharded state: e.g. ``NamedSharding(mesh, P())``), so the first
        buffer has the signature of the ones the step returns; None: the default device,
        uncommitted, as ``jnp.zeros`` makes arrays.
        One buffer is in use at a time: a new one hands the rows of the one in use to the
        collector.  Raises :class:`RefrunInputError` for no names, a repeated name, a name
        that is not a metric name, a capacity outside 1 .. 2**24 - 1, or a dtype other than
        float32 and float64 (the row count is kept in the buffer, exactly)."""
        bad = [n for n in names if not isinstance(n, str) or key_problem(n)]
        if not names or bad or len(set(names)) != len(names) or not (
                isinstance(capacity, int) and 1 <= capacity <= MAX_CAPACITY):
            raise RefrunInputError(
                f"probe.metrics_buffer: needs distinct metric names and 1 <= capacity <= "
                f"{MAX_CAPACITY} (got names {list(names)}, capacity {capacity!r}"
                + (f"; not metric names: {bad}" if bad else "") + ")")
        if dtype is None:  # every float the step makes, exactly (float64 only with x64)
            dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        try:
            kind = np.dtype(dtype)
        except TypeError:
            kind = None
        if kind is None or kind not in BUFFER_DTYPES:  # (a dtype equals None: float64)
            raise RefrunInputError(
                f"probe.metrics_buffer: dtype {dtype!r} cannot hold its metrics and count its "
                f"rows exactly; use float32 or float64 (a bfloat16 value is kept exactly in "
                f"both)")
        self._hand_over_current()  # one buffer at a time: keep the rows of the one in use
        self._buf_started = time.perf_counter()
        return empty_buffer(tuple(names), capacity, dtype, sharding=sharding)

    def log_buffer(self, buf: MetricsBuffer) -> MetricsBuffer:
        """Count the row the step just wrote into ``buf`` (at the current step) and return
        the buffer to pass to the next step: ``buf`` itself, or, once it is full or has
        held rows for a flush interval, a fresh one (``buf`` goes to the collector, which
        reads it in one transfer).  Nothing is read here."""
        n = self._step
        if type(buf) is not MetricsBuffer or n is None or self._closed:
            self._refuse_buffer(buf)
            return buf
        steps = self._buf_steps
        if not steps:  # the buffer's first row: its flush interval starts here
            self._buf_started = self._entry
        steps.append(n)
        self._buf_current = buf
        if len(steps) < buf.capacity and self._entry - self._buf_started < self._buf_every_s:
            return buf
        self._buf_full.append(FullBuffer(buf, steps))
        self._buf_steps = []
        self._buf_current = None
        self._buf_started = self._entry
        spare = self._buf_spare
        self._buf_spare = None
        if spare is not None and same_placement(spare, buf):
            return spare
        try:
            with jax.transfer_guard("allow"):  # the probe's own buffer, never the user's
                return empty_buffer(buf.names, buf.capacity, buf.data.dtype, like=buf)
        except Exception as exc:  # a probe must never break the loop: the same one
            self._warn_exc(exc)
            return buf

    def _hand_over_current(self) -> None:
        """The buffer in use, if it holds rows, to the collector's list (on the training
        thread, or at close)."""
        if self._buf_current is not None and self._buf_steps:
            self._buf_full.append(FullBuffer(self._buf_current, self._buf_steps))
        self._buf_current, self._buf_steps = None, []

    def _refuse_buffer(self, buf: Any) -> None:
        """``log_buffer`` of something that is not a buffer, outside any step, or after
        close: counted as refused, never raised into the loop."""
        if type(buf) is not MetricsBuffer:
            self._refuse_value("log_buffer", self._step, TypeError(
                f"probe.log_buffer takes the MetricsBuffer the step returned, not "
                f"{type(buf).__name__}"))
        elif self._closed:
            self.run.warn_once("probe-closed", "probe.log_buffer after probe.close(): not "
                               "recorded", self._step)
        else:
            self._refuse_unstepped(dict.fromkeys(buf.names))

    def _emit_buffers(self, final: bool) -> None:
        """Read the full metrics buffers (and, at close, the one in use) and hand their
        columns to the session; a buffer that cannot be read, or whose row count differs
        from its steps, is counted in ``refrun.dropped``."""
        if final:  # training is over: the buffer in use too
            self._hand_over_current()
        (full,) = take(self._buf_full)
        for f in full:
            try:
                got = read_buffer(f)
            except Exception as exc:  # deleted (donated by a later step) or failed
                got = None
                why = (f"a metrics buffer of {len(f.steps)} steps could not be read "
                       f"({type(exc).__name__}: {exc}); pass log_buffer's result to the "
                       "next step")
            else:
                why = got.refused
            if got is None or why is not None:
                self.run.drop("jax-buffer", f"{why} (counted in {schema.TAG_DROPPED})",
                              f.steps[0] if f.steps else None,
                              n=max(1, len(f.steps) * len(f.buffer.names)))
                continue
            if schema.M_LOSS in got.columns:
                self._warn_nonfinite_loss(got.steps, got.columns[schema.M_LOSS])
            if got.steps:
                self.run.log_columns(got.steps, got.columns)
        if full and self._buf_spare is None and not final:
            b = full[-1].buffer
            self._buf_spare = empty_buffer(b.names, b.capacity, b.data.dtype, like=b)

    def _log_other(self, n: int, name: str, value: Any) -> None:
        """A value off the fast path: numpy scalars (read now: they are mutable), pytrees
        (flattened now, named off the thread), and what cannot be recorded (warned)."""
        if isinstance(value, bool):
            raise TypeError(f"probe.log: cannot record a value of type bool ({name})")
        if isinstance(value, np.ndarray | np.generic):
            self._logged.extend((n, name, _host_scalar(name, value)))
            return
        if isinstance(value, jax.Array):
            _check_scalar(name, value)
            self._logged.extend((n, name, value))
            return
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a leaf of another type
            raise TypeError(f"probe.log: cannot record a value of type "
                            f"{type(value).__name__} ({name})")
        out: list[Any] = []
        arrays: list[int] = []
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                _check_scalar(name, leaf)
                arrays.append(len(out))
                out.append(leaf)
            elif isinstance(leaf, np.ndarray | np.generic):
                out.append(_host_scalar(name, leaf))
            elif isinstance(leaf, bool) or not isinstance(leaf, int | float):
                raise TypeError(f"probe.log: cannot record a leaf of type "
                                f"{type(leaf).__name__} in {name}")
            else:
                out.append(leaf)
        donated = self.backend.donated  # type: ignore[attr-defined]
        if arrays and donated.get(name, _MISSING) is not False:
            copies = self._protected(name, [out[i] for i in arrays])
            for i, c in zip(arrays, copies, strict=True):
                out[i] = c
        self._logged.extend((n, name, Tree(treedef, out)))

    def _protected(self, name: str, arrays: list[Any]) -> list[Any]:
        """Copies of ``arrays`` on their devices, made now (before the loop can donate
        them); the first time ``name`` is seen its arrays are also watched, to learn
        whether the loop donates them (decided at the end of the next step)."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        if backend.donated.get(name, _MISSING) is _MISSING:
            backend.donated[name] = None
            self._probing.append((name, arrays,
                                  self._steps_done + (1 if self._in_step else 0)))
        try:
            with jax.transfer_guard("allow"):  # a device-side copy, never the user's
                return list(jax.device_put(arrays, may_alias=False))
        except Exception as exc:  # a probe must never break the loop: keep the original
            self._warn_exc(exc)
            return arrays

    def _decide_donation(self) -> None:
        """At a step's exit: the watched names whose next step has run are decided."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        waiting = []
        for name, arrays, due in self._probing:
            if self._steps_done < due + 1:
                waiting.append((name, arrays, due))
            else:
                backend.donated[name] = any(a.is_deleted() for a in arrays)
        self._probing = waiting

    def observe(self, **trees: Any) -> None:
        """Record where ``params=``, ``batch=`` (any pytrees) live; cheap enough for an
        occasional call, not for every step of a large model (it walks the pytree)."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        self._guard(lambda: backend.observe(**trees))
        self._describe()  # changed tags; a placement warning also becomes a run warning

    def _numerics_now(self) -> None:
        """At a step's exit, on the training thread (where a precision context set around
        the loop applies): the numerics configuration, as every probe reads it at the end
        of the first step and every ``recheck_every`` steps."""
        first = self._steps_done == 1
        self._read_numerics(before_training=first)
        every = self.recheck_every
        self._numerics_due = ((self._steps_done // every + 1) * every if every > 0
                              else -1)

    # --- off the training thread ---------------------------------------------------------
    def _collect(self, final: bool) -> None:
        """One block (the collector thread), or the last one (``final``, at close): the
        rows' step times, counter deltas and progress, and the logged values, handed to
        the session.  Never raises."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        try:
            # The rows first, then the events: a step appends its event before its row,
            # so every row taken has its event taken too (one taken early waits).
            rows, values = take(self._step_rows, self._logged)
            (events,) = take(self._row_events)
            with backend.compiles.ignoring(), host_reads.suspended(), \
                    jax.transfer_guard("allow"):
                self._emit_rows(rows, events, final)
                self._emit_values(values)
                self._emit_buffers(final)
            self._record_backend_warnings()
            if self.recheck_every > 0 and self._rows_seen // self.recheck_every \
                    > (self._rows_seen - len(rows) // 2) // self.recheck_every:
                self._describe()
        except Exception as exc:  # a probe must never break the loop
            self._warn_exc(exc)

    def _emit_rows(self, rows: list[Any], events: list[tuple[int, tuple[Any, ...], Any]],
                   final: bool) -> None:
        """A block's rows (flat: step, entry time, ...) as columns: the step times,
        progress and, where a counter moved (and at the run's first step), the counter
        deltas."""
        base = self._rows_seen  # the row index of the block's first row
        self._rows_seen += len(rows) // 2
        steps, entries = rows[0::2], rows[1::2]
        if self._pending_row is not None:
            n, entry, base = self._pending_row
            steps.insert(0, n)
            entries.insert(0, entry)
        events = self._events_ahead + events
        if not steps:
            self._events_ahead = events
            return
        if final:
            self._pending_row = None
            nxt = self._close_entry or time.perf_counter()
        else:  # the last row's interval ends at the next entry, not seen yet
            held = base + len(steps) - 1
            self._pending_row = (steps.pop(), entries.pop(), held)
            nxt = self._pending_row[1]
        end = base + len(steps)
        self._events_ahead = [e for e in events if e[0] >= end]
        if not steps:
            return
        mine = [e for e in events if e[0] < end]
        times = step_intervals(entries, nxt)
        first = base == 0  # the run's first row: every counter gets a point there
        changes = counter_changes(self._last_cum, [(e[0] - base, e[1]) for e in mine],
                                  with_first=first)
        if mine:
            self._last_cum = mine[-1][1]
        columns: dict[str, list[float]] = {schema.M_STEP_TIME: times}
        columns.update(self._progress_columns(
            len(steps), {e[0] - base: e[2] for e in mine if e[2]}))
        self._step_times.extend(times)
        stamps = ((np.asarray(entries) + self._wall_offset) * 1000).astype(np.int64).tolist()
        self.run.log_columns(steps, columns, stamps)
        if changes:
            self._log_counters(steps, stamps, changes, first)

    def _log_counters(self, steps: list[int], stamps: list[int],
                      changes: list[tuple[int, list[float]]], first: bool) -> None:
        """Counters at the steps where they are not 0 (``TAG_SPARSE_COUNTERS``: readers
        put the 0s back), and every counter at the run's ``first`` step (each metric
        exists from the start); one ``log_columns`` per set of steps."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        groups: dict[tuple[int, ...], dict[str, list[float]]] = {}
        for j, name in enumerate(backend.cumulative_names):
            kept = [(i, d[j]) for i, d in changes if d[j] != 0.0 or (first and i == 0)]
            if kept:
                at, vals = zip(*kept, strict=True)
                groups.setdefault(at, {})[name] = list(vals)
            if name == schema.M_XFER_H2D and backend._h2d is not None:
                for i, d in changes:
                    backend.transfers_at(steps[i], d[j])
        for at, cols in groups.items():
            self.run.log_columns([steps[i] for i in at], cols, [stamps[i] for i in at])

    def _progress_columns(self, k: int, overrides: Mapping[int, Mapping[str, Any]]
                          ) -> dict[str, list[float]]:
        """Cumulative ``progress/samples`` and ``progress/tokens`` at each of ``k`` rows
        (host integers: the declared batch, or what :meth:`progress` said for that row,
        ``overrides[i]``)."""
        if self.global_batch is None and not overrides:
            return {}
        if not overrides and type(self.global_batch) is int:  # one range, no loop
            batch, per_sample = self.global_batch, self.tokens_per_sample
            before = self._samples
            samples = [before + batch * i for i in range(1, k + 1)]
            self._samples = samples[-1]
            out = {schema.M_PROGRESS_SAMPLES: list(map(float, samples))}
            if per_sample is not None:
                tokens = [self._tokens + (s - before) * per_sample for s in samples]
                self._tokens = tokens[-1]
                out[schema.M_PROGRESS_TOKENS] = list(map(float, tokens))
            return out
        samples: list[float] = []
        tokens: list[float] = []
        for i in range(k):
            over = overrides.get(i) or {}
            s = over.get("samples", self.global_batch)
            t = over.get("tokens")
            if t is None and s is not None and self.tokens_per_sample is not None:
                t = s * self.tokens_per_sample
            if s is not None:
                self._samples += s
                samples.append(float(self._samples))
            if t is not None:
                self._tokens += t
                tokens.append(float(self._tokens))
        out = {}
        if len(samples) == k:
            out[schema.M_PROGRESS_SAMPLES] = samples
        if len(tokens) == k:
            out[schema.M_PROGRESS_TOKENS] = tokens
        return out

    def _emit_values(self, values: list[tuple[int, str, Any]]) -> None:
        """A block's logged values to the session: one column per metric, read in one
        batched transfer, and one :meth:`RunSession.log_columns` call per set of metrics
        logged at the same steps (the outcome of logging them point by point)."""
        if not values:
            return
        cols = columns(values, self._names_of)
        self._reader.read(cols)
        groups: dict[tuple[int, ...], dict[str, list[float]]] = {}
        for name, col in cols.items():
            steps, vals = self._take_column(name, col)
            if steps:
                groups.setdefault(tuple(steps), {})[name] = vals
        for steps, group in groups.items():
            self.run.log_columns(steps, group)

    def _take_column(self, name: str, col: Column) -> tuple[list[int], list[float]]:
        """:meth:`_take` for a whole column: values that could not be read are dropped
        (warned once, counted in ``refrun.dropped``; their name is copied when
        logged from now on), a non-finite loss warns once."""
        steps, vals = col.steps, col.values
        if any(type(v) is LostValue for v in vals):
            backend: JaxBackend = self.backend  # type: ignore[assignment]
            for logged_as in col.logged_as:
                backend.donated[logged_as] = True  # copied from now on
            kept = [(n, v) for n, v in zip(steps, vals, strict=True)
                    if type(v) is not LostValue or not self._lost(n, name)]
            steps, vals = [n for n, _ in kept], [v for _, v in kept]
        if name == schema.M_STEP_TIME:
            self._step_times.extend(vals)
        if name == schema.M_LOSS:
            self._warn_nonfinite_loss(steps, vals)
        return steps, vals

    def _warn_nonfinite_loss(self, steps: list[int], losses: list[float]) -> None:
        """The first non-finite loss of a column goes through :meth:`_take` (which warns
        once a run)."""
        if not self._nonfinite_warned:
            for n, v in zip(steps, losses, strict=True):
                if not math.isfinite(v):
                    self._take(n, schema.M_LOSS, v)
                    break

    def _names_of(self, name: str, treedef: Any) -> list[str]:
        """The leaf names of a pytree logged as ``name`` (made once per structure)."""
        key = (name, treedef)
        names = self._leaf_names.get(key)
        if names is None:
            shape = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
            names = self._leaf_names[key] = list(flatten_pytree({name: shape}))
        return names

    def _lost(self, n: int, name: str) -> bool:
        """A value that could not be read: counted in ``refrun.dropped`` and warned once
        per name; True."""
        self.run.drop(f"jax-lost:{name}", f"{name} at step {n} could not be read (its "
                      "buffer was deleted or donated before the probe read it; counted in "
                      f"{schema.TAG_DROPPED}); later values of it are copied when logged", n)
        return True

    def flush(self) -> None:
        """Hand everything logged so far to the session now, on the calling thread (what
        the collector thread does once per flush interval): before a long pause, or where
        a benchmark charges a block of steps with its own collection.  Never raises."""
        if self._collector is not None and not self._closed:
            self._guard(self._collector.collect_now)

    # --- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Collect what is left (waiting for the last values: training is over), then
        close as every probe does."""
        if self._closed:
            return
        self._close_entry = time.perf_counter()
        if self._in_step:  # closed inside a step: that step ends here
            self._scope.__exit__(None, None, None)
        if self._collector is not None:
            self._guard(self._collector.finish)
        super().close()


class _JaxStep:
    """What ``probe.step(n)`` returns (one object per probe, re-armed per step): at entry
    the backend's step flags and one clock read; at exit the flags back and one row
    ``(step, entry time, cumulative counters, progress)`` appended.  Without a transfer
    guard (the usual configuration) the backend's :meth:`JaxBackend.begin_step` and
    :meth:`JaxBackend.end_step` are done here inline: the same assignments, a tenth of a
    microsecond less a step."""

    __slots__ = ("_backend", "_compiles", "_cumulative", "_events", "_guarded", "_probe",
                 "_reads", "_rows", "_tls", "n")

    def __init__(self, probe: JaxProbe) -> None:
        self._probe = probe
        b: JaxBackend = probe.backend  # type: ignore[assignment]
        self._backend = b
        self._compiles = b.compiles
        self._cumulative = b.cumulative
        self._guarded = b.transfer_guard is not None
        self._reads = b._reads
        self._tls = host_reads.thread_state()
        self._rows = probe._step_rows
        self._events = probe._row_events
        self.n = 0

    def __enter__(self) -> JaxProbe:
        p = self._probe
        p._in_step = True
        p._step = n = self.n
        p._entry = time.perf_counter()
        if self._guarded:
            try:
                self._backend.begin_step(n)
            except Exception as exc:  # a probe must never break the loop
                p._warn_exc(exc)
            return p
        c = self._compiles
        c.current_step = n
        c.in_step = True
        if self._reads is not None:
            self._tls.sink = self._reads  # last: only the user's step is counted
        return p

    def __exit__(self, *exc: object) -> None:
        p = self._probe
        if not p._in_step:
            return
        if self._guarded:
            try:
                self._backend.end_step()
            except Exception as e:  # a probe must never break the loop
                p._warn_exc(e)
        else:
            if self._reads is not None:
                self._tls.sink = None
            self._compiles.in_step = False
        p._in_step = False
        over = p._progress_override
        if over:
            p._progress_override = {}
        cum = self._cumulative()
        if over or cum != p._cum_seen:  # before the row: see JaxProbe._collect
            self._events.append((p._steps_done, cum, over or None))
            p._cum_seen = cum
        self._rows.extend((self.n, p._entry))
        p._steps_done += 1
        if p._steps_done == p._numerics_due:
            p._numerics_now()
        if p._probing:
            p._decide_donation()


class _ClosedStep:
    """``probe.step(n)`` after ``close()``: the step runs, nothing is recorded."""

    def __init__(self, probe: JaxProbe, n: int) -> None:
        probe.run.warn_once("probe-closed", f"probe.step({n}) after probe.close(): not "
                            "recorded", n)
        self._probe = probe

    def __enter__(self) -> JaxProbe:
        return self._probe

    def __exit__(self, *exc: object) -> None:
        return None


def _scalar_arrays(value: dict[Any, Any], known: Any = None) -> Tree | None:
    """A dictionary of one-element ``jax.Array`` values (gradient norms, per-layer
    metrics: the commonest pytree logged a step), flattened, its structure ``known`` when
    equal to it (the structure flattening made is then dropped, not kept a step); None
    for anything else, which takes :meth:`JaxProbe._log_other`'s checks."""
    leaves, treedef = tree_flatten(value)
    for leaf in leaves:
        if type(leaf) is not ArrayImpl or (leaf.shape and leaf.size != 1):
            return None
    return Tree(known if known is not None and treedef == known else treedef, leaves)


def _check_scalar(name: str, value: Any) -> None:
    if value.size != 1:
        raise ValueError(f"probe.log takes scalars; got a jax array of shape {value.shape} "
                         f"for {name} (reduce it first)")


def _host_scalar(name: str, value: Any) -> float:
    a = np.asarray(value)
    if a.size != 1:
        raise ValueError(f"probe.log takes scalars; got an array of shape {a.shape} for "
                         f"{name} (reduce it first)")
    return float(a.reshape(()))


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

    The values are then fresh outputs of the step: the probe reads them off the training
    thread a block at a time like the loss (no host sync, no extra compilation, and they
    survive the state being donated to the next step).  Nothing is kept between calls: a state
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
