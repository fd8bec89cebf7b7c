"""What the JAX probe keeps per step, and how a block of steps reaches the session.

The training thread of a millisecond TPU step has a few microseconds to spare (1 % of it),
so a step leaves only two small records behind, appended to lists (no copy, no thread
hand-off, no dictionary):

* a **row** per step: ``(step, entry time, cumulative counters ...)``, the counters being
  plain integers the probe already keeps (compilations, host reads, transfer lines);
* a **value** per logged name: ``(step, name, value)``, the value a ``jax.Array`` as the
  step returned it (or a Python number, or the leaves of a pytree).

A :class:`BlockCollector` thread wakes once per flush interval, takes what was appended
since (list slicing and deletion are single operations, so nothing the training thread
appends meanwhile is lost), and does the rest off the training thread:

* **values**: read in one batched transfer per chunk of :data:`CHUNK` arrays of one dtype
  and sharding -- a once-compiled ``jnp.stack`` of the chunk, then one host copy -- instead
  of one read per array (on this machine 0.7 us a value against 22 us for
  ``jax.device_get`` of a list, 16 us for ``float(x)``: the transfer's fixed cost dominates
  a scalar).  The stack runs on the device after the arrays it reads; waiting for it
  releases the GIL.  Its compilations (one per dtype, weak type, sharding, commitment
  and shape; the commonest compiled when the probe starts, outside any step) are the
  probe's own and never counted (:meth:`refrun.probes.jax.CompileTracker.ignore_this_thread`);
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

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class Tree(NamedTuple):
    """A logged pytree: its structure and leaves, flattened on the training thread (the
    names of its leaves are made off it, once per structure).  A named tuple: made a
    step on the training thread, where a frozen dataclass's ``__init__`` costs twice as
    much."""

    treedef: Any
    leaves: list[Any]


@jax.jit
def _stack(*xs: jax.Array) -> jax.Array:
    return jnp.stack([x.reshape(()) for x in xs])


def precompile() -> None:
    """Compile the stack for the commonest signature (float32 scalars on the default
    device, as a jitted step returns them) now, outside any step: a loop that logs only
    such values makes the probe compile nothing while it runs."""
    x = jax.device_put(np.float32(0))
    _stack(*[x] * CHUNK).block_until_ready()


def read_arrays(arrays: Sequence[jax.Array]) -> list[float]:
    """The values of one-element arrays, in order, as floats (:data:`LOST` for one that
    was deleted or donated): one stacked transfer per chunk of arrays of one dtype, weak
    type, sharding, commitment and shape, falling back to reading one at a time where a
    chunk cannot be stacked."""
    out: list[float] = [LOST] * len(arrays)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, a in enumerate(arrays):
        # What makes the stack compile again, the sharding by identity: hashing and
        # comparing sharding objects runs Python code (2 us a value); equal shardings that
        # are not the same object only make one more chunk.  A deleted array fails its
        # chunk's stack, which then falls back to reading one at a time.
        key = (a.dtype, a.weak_type, id(a.sharding), a.committed, a.shape)
        group = groups.get(key)
        if group is None:
            groups[key] = [i]
        else:
            group.append(i)
    for idx in groups.values():
        for at in range(0, len(idx), CHUNK):
            part = idx[at:at + CHUNK]
            chunk = [arrays[i] for i in part]
            chunk += [chunk[-1]] * (CHUNK - len(chunk))
            try:
                values = np.asarray(_stack(*chunk)).tolist()  # floats (ints for ints)
            except Exception:  # a deleted array, an odd sharding: one at a time
                values = [_read_one(arrays[i]) for i in part]  # floats, LOST kept
            for i, v in zip(part, values, strict=False):
                out[i] = v if type(v) is float or type(v) is LostValue else float(v)
    return out


def _read_one(a: jax.Array) -> float:
    try:
        return float(np.asarray(a).reshape(()))
    except Exception:
        return LOST


class Column:
    """One metric's points of a block, in log order: ``steps[i]`` and ``values[i]`` (a
    ``jax.Array`` until :func:`read_columns`, then a float; :data:`LOST` where it could
    not be read), and the names it was logged under (a pytree leaf: its tree's name)."""

    __slots__ = ("logged_as", "steps", "values")

    def __init__(self, logged_as: str) -> None:
        self.steps: list[int] = []
        self.values: list[Any] = []
        self.logged_as = {logged_as}


def columns(values: Iterable[tuple[int, str, Any]],
            leaf_names: Callable[[str, Any], list[str]]) -> dict[str, Column]:
    """A block's logged values as one :class:`Column` per metric, pytrees split into their
    leaves (named by ``leaf_names(name, treedef)``): a dictionary lookup and two appends a
    value, where handing values over one at a time cost several microseconds each on the
    collector thread (time the training thread of a host-bound step waits for the GIL)."""
    out: dict[str, Column] = {}
    get = out.get
    for n, name, v in values:
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


def read_columns(cols: Iterable[Column]) -> None:
    """Replace every column's arrays by their values (one :func:`read_arrays` for the
    whole block) and its Python numbers by floats, in place."""
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


@dataclass
class Block:
    """What a collection took: the rows and values appended since the last one."""

    rows: list[tuple[Any, ...]]
    values: list[tuple[int, str, Any]]


def take(rows: list[Any], values: list[Any]) -> Block:
    """The items appended so far, removed from the shared lists (each ``del`` removes what
    was read; an append meanwhile lands after it and stays for the next block)."""
    k, j = len(rows), len(values)
    block = Block(rows[:k], values[:j])
    del rows[:k]
    del values[:j]
    return block


def step_intervals(entries: Sequence[float], next_entry: float | None) -> list[float]:
    """``entry_{n+1} - entry_n`` for each step of ``entries`` (seconds), the last one's
    to ``next_entry``; without ``next_entry`` the last step has none (yet)."""
    out = [b - a for a, b in itertools.pairwise(entries)]
    if next_entry is not None and entries:
        out.append(next_entry - entries[-1])
    return out


def counter_deltas(previous: Sequence[float], rows: Iterable[Sequence[float]]
                   ) -> list[list[float]]:
    """Per-step deltas of cumulative counter rows: column ``j`` of step ``i`` is
    ``rows[i][j] - rows[i-1][j]`` (``previous`` before the first row)."""
    out = []
    last = previous
    for r in rows:
        out.append([b - a for a, b in zip(last, r, strict=True)])
        last = r
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

    def finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        with self._lock:
            self.collect(True)
