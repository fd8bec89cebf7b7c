"""What the JAX probe keeps per step, and how a block of steps reaches the session.

The training thread of a millisecond TPU step has a few microseconds to spare (1 % of it),
so a step leaves only small records behind, extending flat lists (no copy, no thread
hand-off, no object of its own for the garbage collector to count):

* a **row** per step: ``step, entry time``; and, only where one of the cumulative
  counters (compilations, host reads, transfer lines: plain integers the probe already
  keeps) moved, an event ``(row index, counters, progress)``;
* a **value** per logged name: ``step, name, value``, the value a ``jax.Array`` as the
  step returned it (or a Python number, or a :class:`Tree`).

A :class:`BlockCollector` thread wakes once per flush interval, takes what was appended
since (list slicing and deletion are single operations, so nothing the training thread
appends meanwhile is lost), and does the rest off the training thread:

* **values**: read in one batched transfer per chunk of :data:`CHUNK` arrays of one dtype
  and sharding -- a once-compiled ``jnp.stack`` of the chunk, then one host copy -- instead
  of one read per array (on this machine 0.7 us a value against 22 us for
  ``jax.device_get`` of a list, 16 us for ``float(x)``: the transfer's fixed cost dominates
  a scalar).  The stack runs on the device after the arrays it reads; waiting for it
  releases the GIL.  Its compilations (one per :func:`signature`; the commonest compiled
  when the probe starts, outside any step) are the probe's own and never counted
  (:meth:`refrun.probes.jax.CompileTracker.ignore_this_thread`).  Where reading each
  array on its own is faster, the probe does that instead: measured when it starts
  (:func:`choose_read_path`; this CPU reads one by one, a TPU v5e stacked);
* **rows**: per-step counter deltas and the step time, handed to the session as columns
  in one :meth:`~refrun.recording.session.RunSession.log_columns` call per block.

**Step time** (``perf/step_time_s``, kind ``interval``): the time from a step's entry to the
next step's entry (the last step's: to ``probe.close()``), measured on the training thread
with one clock read per step.  In a host-bound loop this is the step.  In a device-bound
loop it is the device's step once the runtime's queue of dispatched work is full: PJRT
blocks a dispatch while too many executions are in flight (32 per device on the CPU,
measured: the 33rd dispatch of a 24 ms program waited for the first to finish), so in
steady state the loop enters a step each time the device finishes one.  The first steps
of a device-bound loop, before the queue fills, are dispatch times; a step followed by an
evaluation or a checkpoint between steps includes it (the median is not moved by either).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.array import ArrayImpl

CHUNK = 64
"""Arrays stacked per transfer (a chunk is padded to this length: one compilation per
dtype and sharding, whatever a block holds)."""


class LostValue(float):
    """A value that could not be read (deleted or donated buffer); never emitted."""


LOST = LostValue("nan")


class Tree(tuple):  # type: ignore[type-arg]
    """A logged pytree, flattened on the training thread: ``(treedef, leaf, leaf ...)``
    in one tuple, so that a step keeps one object for it (every object kept until the
    collector runs is an allocation the garbage collector counts, see
    :class:`BlockCollector`); the names of its leaves are made off the thread, once per
    structure."""

    __slots__ = ()

    def __new__(cls, treedef: Any, leaves: Sequence[Any]) -> Tree:
        return tuple.__new__(cls, (treedef, *leaves))

    @property
    def treedef(self) -> Any:
        return self[0]

    @property
    def leaves(self) -> tuple[Any, ...]:
        return self[1:]


def _stack_fn(*xs: jax.Array) -> jax.Array:
    return jnp.stack([x.reshape(()) for x in xs])


# Two compiled stacks: ``_stack`` for chunks grouped by signature (anything goes), and
# ``_stack_uniform`` for a column's chunks read without looking at each value, whose cache
# only ever keeps programs of one signature (see ColumnReader).
_stack = jax.jit(_stack_fn)
_stack_uniform = jax.jit(_stack_fn)


def precompile() -> None:
    """Compile the stacks for the commonest signature (float32 scalars on the default
    device, as a jitted step returns them) now, outside any step: a loop that logs only
    such values makes the probe compile nothing while it runs."""
    x = jax.device_put(np.float32(0))
    for stack in (_stack, _stack_uniform):
        stack(*[x] * CHUNK).block_until_ready()


def signature(a: jax.Array) -> tuple[Any, ...]:
    """What makes the stack compile again for ``a``, the sharding by identity: hashing and
    comparing sharding objects runs Python code (2 us a value); equal shardings that are
    not the same object only make one more chunk."""
    return (a.dtype, a.weak_type, id(a.sharding), a.committed, a.shape)


def read_arrays(arrays: Sequence[jax.Array]) -> list[float]:
    """The values of one-element arrays, in order, as floats (:data:`LOST` for one that
    was deleted or donated): one stacked transfer per chunk of arrays of one
    :func:`signature`, falling back to reading one at a time where a chunk cannot be
    stacked."""
    out: list[float] = [LOST] * len(arrays)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, a in enumerate(arrays):
        # A deleted array fails its chunk's stack, which then reads one at a time.
        key = signature(a)
        group = groups.get(key)
        if group is None:
            groups[key] = [i]
        else:
            group.append(i)
    dispatched: list[tuple[list[int], jax.Array | None]] = []
    for idx in groups.values():
        for at in range(0, len(idx), CHUNK):
            part = idx[at:at + CHUNK]
            chunk = [arrays[i] for i in part]
            chunk += [chunk[-1]] * (CHUNK - len(chunk))
            try:
                stacked = _stack(*chunk)
            except Exception:  # a deleted array, an odd sharding: one at a time
                stacked = None
            else:
                _copy_soon(stacked)
            dispatched.append((part, stacked))
    for part, stacked in dispatched:
        try:
            values = _floats(stacked) if stacked is not None else None
        except Exception:
            values = None
        if values is None:
            values = [_read_one(arrays[i]) for i in part]  # floats, LOST kept
        for i, v in zip(part, values, strict=False):
            out[i] = v
    return out


def _copy_soon(stacked: jax.Array) -> None:
    """Start the stack's copy to the host now, so that the copies of a block's chunks are
    in flight together: on the TPU v5e a stack dispatched and read one at a time cost
    16.5 us a value (a device round trip per chunk of 64), ``jax.device_get`` of a list,
    which starts every copy first, 3.4 us."""
    with contextlib.suppress(Exception):  # the read reports what failed
        stacked.copy_to_host_async()


def _floats(stacked: jax.Array) -> list[float]:
    """A stacked read's values as Python floats (ints and bools converted exactly as
    ``float()`` does; bfloat16 widened): one host copy, no Python per value."""
    return np.asarray(stacked).astype(np.float64).tolist()


def _read_one(a: jax.Array) -> float:
    try:
        return float(np.asarray(a).reshape(()))
    except Exception:
        return LOST


class Column:
    """One metric's points of a block, in log order: ``steps[i]`` and ``values[i]`` (a
    ``jax.Array`` until a :class:`ColumnReader` reads it, then a float; :data:`LOST` where it could
    not be read), and the names it was logged under (a pytree leaf: its tree's name)."""

    __slots__ = ("logged_as", "steps", "values")

    def __init__(self, logged_as: str, steps: list[int] | None = None,
                 values: list[Any] | None = None) -> None:
        self.steps: list[int] = [] if steps is None else steps
        self.values: list[Any] = [] if values is None else values
        self.logged_as = {logged_as}


def columns(values: list[Any],
            leaf_names: Callable[[str, Any], list[str]]) -> dict[str, Column]:
    """A block's logged values (flat: step, name, value, step, name, value ...) as one
    :class:`Column` per metric, pytrees split into their leaves (named by
    ``leaf_names(name, treedef)``), in log order.

    A loop that logs the same names in the same order every step (the usual one) is
    split by slicing (:func:`_periodic_columns`: no Python per value); any other block
    takes a dictionary lookup and two appends a value.  Either way this runs on the
    collector thread, where each microsecond is one a host-bound training thread waits
    for the GIL."""
    steps, names, vals = values[0::3], values[1::3], values[2::3]
    out = _periodic_columns(steps, names, vals, leaf_names)
    return out if out is not None else _columns_by_value(steps, names, vals, leaf_names)


def _periodic_columns(steps: list[int], names: list[str], vals: list[Any],
                      leaf_names: Callable[[str, Any], list[str]]
                      ) -> dict[str, Column] | None:
    """:func:`columns` for a block whose names repeat with a period ``k`` (entry ``i`` is
    named as entry ``i % k``, the first ``k`` names distinct), each name's values all
    arrays-or-numbers or all pytrees of one structure; None for any other block.

    Then the entries of name ``j`` are exactly those at ``j::k``: sliced (C loops),
    pytree leaves transposed with ``zip``."""
    m = len(names)
    if not m:
        return {}
    try:
        k = names.index(names[0], 1)
    except ValueError:
        k = m
    if m % k or len(set(names[:k])) != k:
        return None
    per = m // k
    if any(names[j::k].count(names[j]) != per for j in range(k)):
        return None
    out: dict[str, Column] = {}
    for j in range(k):
        name, col_steps, col_vals = names[j], steps[j::k], vals[j::k]
        kinds = set(map(type, col_vals))
        if Tree not in kinds:
            made = [(name, col_vals)]
        elif len(kinds) == 1 and len(set(map(_TREEDEF, col_vals))) == 1:
            leaves = itertools.islice(zip(*col_vals, strict=True), 1, None)  # 0: treedefs
            made = list(zip(leaf_names(name, col_vals[0].treedef), map(list, leaves),
                            strict=True))
        else:
            return None
        for metric, metric_vals in made:
            if metric in out:  # a leaf named as another logged name: merged value by value
                return None
            out[metric] = Column(name, list(col_steps), metric_vals)
    return out


_TREEDEF = operator.itemgetter(0)


def _columns_by_value(steps: list[int], names: list[str], vals: list[Any],
                      leaf_names: Callable[[str, Any], list[str]]) -> dict[str, Column]:
    out: dict[str, Column] = {}
    get = out.get
    for n, name, v in zip(steps, names, vals, strict=True):
        if type(v) is Tree:
            for leaf_name, leaf in zip(leaf_names(name, v.treedef), v.leaves, strict=True):
                col = get(leaf_name)
                if col is None:
                    col = out[leaf_name] = Column(name)
                elif name not in col.logged_as:
                    col.logged_as.add(name)
                col.steps.append(n)
                col.values.append(leaf)
            continue
        col = get(name)
        if col is None:
            col = out[name] = Column(name)
        col.steps.append(n)
        col.values.append(v)
    return out


class ColumnReader:
    """Reads a block's columns in place: arrays become their values, Python numbers
    floats, an array that could not be read :data:`LOST`.

    A column whose values are all ``jax.Array`` is read without looking at each value:
    its chunks go to ``_stack_uniform`` as they are, every chunk dispatched before the
    first is waited for.  A column of one signature (a step function's output, the usual
    case) hits that stack's compiled program each time; when a chunk makes it compile,
    the chunk's signatures are checked, and if they differ (a promoted value might not be
    exact) the program is dropped, the column is remembered in :attr:`mixed` and read by
    :func:`read_arrays`, grouped value by value, from then on.  Any other column (numbers,
    other array types) takes that path too.  Measured on the CPU (2026-12-06, a block of
    1,000 steps of a loss and four gradient norms): 1.7 -> 0.4 us a value."""

    def __init__(self, per_value: bool = False) -> None:
        self.mixed: set[str] = set()
        # Read each array on its own instead (see choose_read_path): faster where an
        # execution argument costs more than a device-to-host copy (this CPU).
        self.per_value = per_value

    def read(self, cols: Mapping[str, Column]) -> None:
        pending: list[tuple[list[Any], int, int, jax.Array]] = []
        general: list[Column] = []
        for name, col in cols.items():
            vals = col.values
            if name in self.mixed or set(map(type, vals)) != _ARRAY_ONLY:
                general.append(col)
                continue
            if self.per_value:
                vals[:] = map(_read_one, vals)
                continue
            for at in range(0, len(vals), CHUNK):
                stacked = None if name in self.mixed else self._stack_chunk(
                    name, vals[at:at + CHUNK])
                if stacked is None:
                    vals[at:at + CHUNK] = read_arrays(vals[at:at + CHUNK])
                else:
                    _copy_soon(stacked)
                    pending.append((vals, at, min(CHUNK, len(vals) - at), stacked))
        for vals, at, k, stacked in pending:
            try:
                vals[at:at + k] = _floats(stacked)[:k]
            except Exception:  # the stack failed on the device: one at a time
                vals[at:at + k] = [_read_one(a) for a in vals[at:at + k]]
        if general:
            _read_general(general)

    def _stack_chunk(self, name: str, chunk: list[jax.Array]) -> jax.Array | None:
        """The chunk's stack, dispatched; None when it must be read grouped (a deleted
        array, several signatures)."""
        padded = chunk + [chunk[-1]] * (CHUNK - len(chunk))
        before = _stack_uniform._cache_size()
        try:
            stacked = _stack_uniform(*padded)
        except Exception:
            return None
        if _stack_uniform._cache_size() != before and len(set(map(signature, chunk))) > 1:
            _stack_uniform.clear_cache()  # keep only programs of one signature
            self.mixed.add(name)
            return None
        return stacked


_ARRAY_ONLY = {ArrayImpl}


@dataclass(frozen=True)
class ReadPath:
    """How this machine reads a column of logged scalars fastest: ``per_value`` or
    stacked, with the microseconds a value each took when measured."""

    per_value: bool
    stacked_us: float
    per_value_us: float

    def text(self) -> str:
        chosen = "per value" if self.per_value else "stacked"
        return (f"{chosen} (measured at start: stacked {self.stacked_us:.2f} us, per value "
                f"{self.per_value_us:.2f} us a value)")


def choose_read_path(count: int = 512, repeats: int = 3) -> ReadPath:
    """Time both ways of reading ``count`` ready float32 scalars on the default device
    (fresh arrays each time: a read keeps its host copy), best of ``repeats``, and choose
    the faster.  Which one wins depends on the platform's cost of an execution argument
    against a device-to-host copy, measured 2026-12-06: the CPU reads stacked in 0.4-0.9
    us a value and one by one in 0.7-1.8 us; the TPU v5e stacked in 10.3 us and one by
    one in 496 us (a fresh scalar's read is a device round trip there: 450-510 us,
    ``benchmarks/tpu/array_costs.py``; an earlier 1.4 us read a cached host copy).  Run
    once when a probe
    starts, outside any step (one compilation, never counted)."""
    step = jax.jit(lambda x: x + 1.0)  # one output an execution, as a step's loss is
    x = jax.device_put(np.float32(0))

    def fresh() -> list[jax.Array]:
        out = [step(x) for _ in range(count)]
        jax.block_until_ready(out)
        return out

    def best(read: Callable[[list[jax.Array]], object]) -> float:
        times = []
        for _ in range(repeats):
            vals = fresh()
            t0 = time.perf_counter()
            read(vals)
            times.append(time.perf_counter() - t0)
        return min(times) / count * 1e6

    fresh()
    stacked = best(lambda v: ColumnReader().read({"x": Column("x", values=v)}))
    one = best(lambda v: [_read_one(a) for a in v])
    return ReadPath(one < stacked, stacked, one)


def _read_general(cols: Iterable[Column]) -> None:
    """Read columns value by value: numbers to floats, every array of all of them in one
    :func:`read_arrays`."""
    where: list[tuple[list[Any], int]] = []
    arrays: list[Any] = []
    for col in cols:
        vals = col.values
        for i, v in enumerate(vals):
            t = type(v)
            if t is float:
                continue
            if t is ArrayImpl or isinstance(v, jax.Array):
                where.append((vals, i))
                arrays.append(v)
            else:
                vals[i] = float(v)
    for (vals, i), value in zip(where, read_arrays(arrays), strict=True):
        vals[i] = value


def take(*shared: list[Any]) -> list[list[Any]]:
    """The items appended so far to each list, removed from it (each ``del`` removes what
    was read; an append meanwhile lands after it and stays for the next block)."""
    out = []
    for items in shared:
        k = len(items)
        out.append(items[:k])
        del items[:k]
    return out


def step_intervals(entries: Sequence[float], next_entry: float | None) -> list[float]:
    """``entry_{n+1} - entry_n`` for each step of ``entries`` (seconds), the last one's
    to ``next_entry``; without ``next_entry`` the last step has none (yet)."""
    ends = list(entries[1:])
    if next_entry is not None and entries:
        ends.append(next_entry)
    return list(map(operator.sub, ends, entries))


def counter_changes(previous: Sequence[float], at: Sequence[tuple[int, Sequence[float]]],
                    with_first: bool = False) -> list[tuple[int, list[float]]]:
    """``(i, deltas)`` for each ``(i, cumulative counters)`` of ``at`` -- the rows where a
    step's counters differed from the row before (``previous`` before the first), in
    order -- its deltas as floats, with row 0's (all 0) first when ``with_first`` and
    ``at`` has none for it.  The step compares its counters with the last ones it kept
    (one tuple comparison), so a block of steps that compiled and read nothing costs
    nothing here."""
    out: list[tuple[int, list[float]]] = []
    if with_first and (not at or at[0][0] != 0):
        out.append((0, [0.0] * len(previous)))
    last = previous
    for i, cum in at:
        out.append((i, [float(b - a) for a, b in zip(last, cum, strict=True)]))
        last = cum
    return out


@dataclass
class BlockCollector:
    """The thread that turns rows and values into points, one block per ``every_s``
    (see the module doc).  ``collect`` does one block; ``finish`` stops the thread and
    collects what is left, waiting for every value (training is over)."""

    collect: Callable[[bool], None]
    every_s: float = 1.0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    started_ns: int = field(default_factory=time.monotonic_ns)

    def start(self, on_thread: Callable[[], None] = lambda: None) -> None:
        def run() -> None:
            on_thread()
            while not self._stop.wait(self.every_s):
                with self._lock:
                    self.collect(False)

        self._thread = threading.Thread(target=run, daemon=True, name="refrun-jax-collect")
        self._thread.start()

    def collect_now(self) -> None:
        """One collection now, on the calling thread (between the thread's own)."""
        with self._lock:
            self.collect(False)

    def finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        with self._lock:
            self.collect(True)
