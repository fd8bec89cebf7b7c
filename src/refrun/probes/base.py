"""The probe design shared by the PyTorch, PyTorch/XLA and JAX wrappers.

A probe sits between a training loop and a :class:`refrun.recording.session.RunSession`::

    probe = refrun.torch.instrument(run, model=model, optimizer=opt)
    for n, batch in enumerate(loader):
        with probe.step(n):
            loss = train_step(batch)
            probe.log(loss=loss)           # device value or Python number
    probe.close()                          # or: with probe: ...

The first promise: the probe adds no host synchronisation, recompilation or blocking
call to the step.  Everything framework-specific is behind the small :class:`Backend`
interface below; the probe itself only

* times the step with the backend's timer (device-true where the backend allows),
* reads the backend's cumulative counters at start and at every step exit and logs the
  per-step deltas (compilations, transfers, fallbacks ...) under the shared names of
  :mod:`refrun.schema`, at every step (zeros included).  A backend that offers
  ``counter_names`` and ``counter_row()`` (the cumulative counters as a tuple in that
  order) takes the block path: a step's exit keeps the step time and that tuple, and
  once per flush interval the probe turns the kept rows into deltas and hands them to the
  session in one :meth:`~refrun.recording.session.RunSession.log_columns` call -- the
  same points, at a fraction of the per-step work (PyTorch/XLA: see docs/xla.md),
* records the learning rate of every parameter group of the backend's torch optimizer
  (a backend with an ``optimizer`` attribute: PyTorch, PyTorch/XLA) for every step, read
  at the step's entry -- the rate its update uses, wherever the loop steps its scheduler
  -- from the optimizer's current ``param_groups`` (a checkpoint's ``load_state_dict``
  replaces the list), and the optimizer's update count at the step's exit
  (:mod:`refrun.probes.optim`: Python numbers, never a device read); a new optimizer over
  the same parameters is followed, and :meth:`Probe.observe` names replaced objects,
* starts a non-blocking fetch for every device value given to :meth:`Probe.log` and
  hands it to the session once the backend says it is ready, with its own step number,
* runs :class:`Monitor` samplers on a background thread, logged against the training
  step that was current when each sample was taken (several samples taken during one
  step are averaged, so a step is never logged twice for the same ``sys/...`` name),
* asks the backend to describe device truth and placement at start, every
  ``recheck_every`` steps (default 100, the same for every backend) and at close; a
  ``refrun.placement.warning`` it reports becomes a recorded run warning as well as a tag,
* reads the process's numerics configuration (:func:`refrun.numerics.current`: matmul
  precision, TF32 switches, numerics XLA flags ...) at start, at the end of the first step
  (a context manager around the loop is in force there) and every ``recheck_every``
  steps -- never at close, which may run outside that context manager -- and records the
  ``refrun.numerics.*`` tags that changed; a setting that changes after the first step is
  also a run warning, and every change is listed in ``refrun.numerics.changes``,
* at close, records what the backend adds to the end of a run through the no-op hooks
  of :class:`BackendBase`: ``summary_tags()`` and ``artifacts()``; warnings a backend
  notices (``take_warnings()``) are recorded by the probe after each step.  So no backend
  writes to the session itself: the probe is the only writer.

A backend never raises into the loop: failures become recorded warnings.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from refrun import numerics, schema
from refrun.errors import RefrunInputError
from refrun.probes.optim import LearningRates, Rates

if TYPE_CHECKING:
    from refrun import RunSession

DEFAULT_RECHECK_EVERY = 100  # steps between placement re-checks, every backend
DEFAULT_SAMPLE_INTERVAL_S = 1.0  # seconds between sys/* samples, every backend
DEFAULT_WARMUP_STEPS = 5  # step times left out of the median/p90 summary, every backend
# The block path hands rows to the session once per flush interval, or at this many.
MAX_BLOCK_ROWS = 1024


@dataclass(frozen=True)
class BackendWarning:
    """A warning a backend noticed (recorded once per ``key`` by the probe)."""

    key: str
    message: str
    step: int | None = None


class Backend(Protocol):
    """What a framework must provide to a :class:`Probe`.  All methods must be cheap and
    must not synchronise the host with the device."""

    name: str

    def begin_step(self, step: int) -> Any:
        """Start timing ``step``; returns an opaque token for :meth:`end_step`."""

    def end_step(self, step: int, token: Any) -> Any:
        """Stop timing; returns a pending time (read later with :meth:`ready`) or seconds."""

    def fetch(self, value: Any) -> Any:
        """Start a non-blocking fetch of a device value; returns a pending handle, or a
        float when the value is already on the host."""

    def ready(self, pending: Any) -> float | None:
        """The fetched value (or step time) as a float if available now, else None."""

    def wait(self, pending: Any) -> float:
        """Block until the value is available (only called after training, at close)."""

    def counters(self) -> Mapping[str, float]:
        """Cumulative counters keyed by schema metric names (``compile/graphs`` ...).
        Optional instead (the block path, see the module doc): ``counter_names``, a tuple
        of those names, and ``counter_row()``, the counters as a tuple in that order; such a
        backend's ``end_step`` returns seconds (a float) at every step or at none."""

    def describe(self, final: bool = False) -> Mapping[str, Any]:
        """Device truth and placement, recorded as tags at start, at each placement
        re-check and at close (``final``); placement problems as a list of sentences under
        ``schema.TAG_PLACEMENT_WARNING``.  Running counts (values logged per device) belong
        in the ``final`` description only: a tag that changes at every re-check makes the
        session rewrite the spool's metadata and the delivery re-send every tag."""

    def close(self) -> None:
        """Remove listeners/hooks the backend installed."""

    def summary_tags(self) -> Mapping[str, Any]:
        """End-of-run tags (after the last value was resolved)."""

    def artifacts(self) -> Mapping[str, Any]:
        """End-of-run JSON artifacts: artifact path -> JSON-able payload."""

    def take_warnings(self) -> list[BackendWarning]:
        """Warnings noticed since the last call (the probe records them)."""


class BackendBase:
    """No-op end-of-run hooks: a backend overrides only what it adds to a run."""

    name = "backend"

    def __init__(self) -> None:
        self._warnings: list[BackendWarning] = []

    def warn(self, key: str, message: str, step: int | None = None) -> None:
        """Queue a warning for the probe to record (never raises, never blocks)."""
        self._warnings.append(BackendWarning(key, message, step))

    def take_warnings(self) -> list[BackendWarning]:
        out = self._warnings
        if out:  # most steps have none: no new list
            self._warnings = []
        return out

    def summary_tags(self) -> Mapping[str, Any]:
        return {}

    def artifacts(self) -> Mapping[str, Any]:
        return {}


class OnePerProcess:
    """At most one open backend of a kind in a process, for backends whose counters or
    hooks are process-wide (two open at once would count each other's work as their own
    steps').  :meth:`refuse_if_open` where a backend starts, before it installs anything;
    :meth:`register` once it is fully made, so that one whose start raised blocks
    nothing.  Weak: a backend nobody holds any more does not block the next; one held but
    never closed does (its hooks or threads still run)."""

    def __init__(self, refusal: str) -> None:
        self._refusal = refusal
        self._open: weakref.ref[Any] | None = None

    def refuse_if_open(self) -> None:
        """:class:`RefrunInputError` (the refusal given) when another backend is open."""
        other = self._open() if self._open is not None else None
        if other is not None and not other.closed:
            raise RefrunInputError(self._refusal)

    def register(self, backend: Any) -> None:
        """``backend`` (with a ``closed`` attribute) is this kind's open backend now."""
        self._open = weakref.ref(backend)


class Monitor(Protocol):
    """One source of utilisation samples (psutil, NVML, TPU runtime ...).

    Optional, looked up by the probe: ``tags()`` (tags describing the source, such as
    ``refrun.exec.utilization_source`` or ``refrun.sys.unavailable``: recorded with the backend's
    description, at start, at each placement re-check and at close), ``attach(progress)``
    (called once before sampling starts; ``progress()`` returns ``(steps done, step
    compilations so far)``, for a monitor that samples only a steady loop) and ``stop()``
    (end background work before the probe's last sample at close)."""

    name: str

    def sample(self) -> Mapping[str, float]:
        """Current readings keyed by ``sys/...`` metric names."""

    def close(self) -> None: ...


@dataclass
class StepTimes:
    """Steady-state step-time statistics in seconds (warm-up steps excluded)."""

    count: int
    median_s: float
    p90_s: float
    mean_s: float
    warmup_steps: int


@dataclass
class Probe:
    """Records one run's evidence through a framework :class:`Backend`; see module doc."""

    run: RunSession
    backend: Backend
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    monitors: Sequence[Monitor] = ()
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    # steps between placement re-checks (0: only at start and close)
    recheck_every: int = DEFAULT_RECHECK_EVERY
    # Samples per step for progress/samples (default: the run's refrun.global_batch tag)
    # and tokens per sample for progress/tokens (default: refrun.tokens_per_sample).
    global_batch: int | None = None
    tokens_per_sample: int | None = None
    _samples: int = 0
    _tokens: int = 0
    _progress_override: dict[str, int] = field(default_factory=dict, repr=False)
    _pending: deque[tuple[int, str, Any]] = field(default_factory=deque, repr=False)
    _step: int | None = None
    _in_step: bool = False
    _steps_done: int = 0
    _last_counters: dict[str, float] = field(default_factory=dict, repr=False)
    # Step times only, as 8-byte doubles: a million-step run costs 8 MB, not a list of tuples.
    _step_times: array = field(default_factory=lambda: array("d"), repr=False)
    _described: dict[str, Any] = field(default_factory=dict, repr=False)
    _nonfinite_warned: bool = False
    _sampler: threading.Thread | None = field(default=None, repr=False)
    _stop_sampler: threading.Event = field(default_factory=threading.Event, repr=False)
    _sample_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sample_step: int | None = None
    _sample_acc: dict[str, tuple[float, int]] = field(default_factory=dict, repr=False)
    _closed: bool = False
    # Host values of the current step, handed to the session in one call at step exit.
    _batch: dict[str, Any] = field(default_factory=dict, repr=False)
    # Value types seen in log() that are not mappings (so nested dicts are looked for
    # with a set lookup, not an ABC isinstance check per value).
    _scalar_types: set[type] = field(default_factory=lambda: {float, int}, repr=False)
    # The block path (a backend with counter_row): each ended step's (step, time stamp,
    # step time, cumulative counters, learning rates), handed to the session a block at
    # a time.
    _counter_row: Any = field(default=None, repr=False)
    _rows: list[tuple[int, int, float | None, tuple[float, ...] | None,
                      tuple[tuple[str, ...], tuple[float, ...]] | None, float]] = field(
        default_factory=list, repr=False)
    # The training thread's CPU clock at the open step's entry (time.thread_time): the
    # step's CPU seconds (schema.M_STEP_CPU) tell slower code from a busier machine, since
    # a thread waiting for a core accrues no CPU time (refrun.acceptance.kinds.step_time).
    _cpu_start: float = 0.0
    _rows_last: tuple[float, ...] = field(default=(), repr=False)
    _rows_due: float = 0.0
    _rows_every_s: float = 1.0
    # The learning rates of the backend's torch optimizer (refrun.probes.optim), read at
    # every step's entry and kept for its exit; None without an optimizer, or once a rate
    # could not be read without a sync.
    _lrs: LearningRates | None = field(default=None, repr=False)
    _step_lrs: tuple[tuple[str, ...], tuple[float, ...]] | None = field(default=None,
                                                                       repr=False)
    # The numerics configuration as last recorded (refrun.numerics tags) and its changes.
    _numerics: dict[str, str] = field(default_factory=dict, repr=False)
    _numerics_changes: list[dict[str, Any]] = field(default_factory=list, repr=False)
    # The backend's warnings are BackendBase's queue (take_warnings not overridden): a step
    # exit looks at the queue and calls take_warnings only when it holds something.
    _queued_warnings: bool = field(default=False, repr=False)
    # perf_counter() when close began: refrun's own close is counted from there (the run's
    # hours leave it out, RunSession.add_own_close_s); an interval step ends there.
    _close_entry: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Closed by the run at the latest, so pending values are never lost when the user
        # ends the run without closing the probe.
        self.run.add_close_hook(self.close)
        self._queued_warnings = isinstance(self.backend, BackendBase) and \
            type(self.backend).take_warnings is BackendBase.take_warnings
        tags = self._guard(lambda: dict(self.run.tags)) or {}
        self._progress_defaults(tags)
        for m in self.monitors:  # sampling sources started before their tags are read
            attach = getattr(m, "attach", None)
            if attach is not None:
                self._guard(lambda a=attach: a(self.progress_marker))
        self._describe()
        self._numerics = numerics.setting_tags(tags)
        self._numerics_changes = numerics.changes_of(tags)
        self._read_numerics(before_training=True)
        self._read_optimizer(getattr(self.backend, "optimizer", None))
        row = getattr(self.backend, "counter_row", None)
        if row is not None and getattr(self.backend, "counter_names", None):
            self._counter_row = row
            self._rows_last = tuple(self._guard(row) or ())
            self._rows_every_s = _flush_interval(self.run)
            self._rows_due = time.monotonic() + self._rows_every_s
        else:
            self._last_counters = dict(self._guard(self.backend.counters) or {})
        if self.monitors:
            self._sampler = threading.Thread(target=self._sample_loop, daemon=True,
                                             name="refrun-sampler")
            self._sampler.start()

    # --- the loop surface -----------------------------------------------------
    @property
    def current_step(self) -> int | None:
        return self._step

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the probe records nothing more)."""
        return self._closed

    def progress_marker(self) -> tuple[int, int]:
        """``(steps done, compile events)`` as :data:`refrun.probes.chip_busy.Progress`
        defines them, read by a monitor's thread to tell a steady loop (steps advancing,
        nothing compiling); this probe counts no compilations of its own (a backend that
        does overrides it)."""
        return self._steps_done, 0

    def step(self, n: int) -> _StepScope:
        """Context manager around training step ``n``: times it and records counter deltas."""
        return _StepScope(self, n)

    def _enter_step(self, n: int) -> Any:
        """Start step ``n`` (see :class:`_StepScope`); returns the backend's timing token."""
        self._in_step = True
        if self._pending or self._batch:
            self._drain()
        self._step = n
        if self._lrs is not None:  # the rate this step's update uses: read before it
            self._step_lrs = self._read_lrs(self._lrs)
        self._cpu_start = time.thread_time()
        try:
            return self.backend.begin_step(n)
        except Exception as exc:  # a probe must never break the loop
            self._warn_exc(exc)
            return None

    def _exit_step(self, n: int, token: Any) -> None:
        """End step ``n``: its step time, counter deltas and progress, and every value
        already on the host, go to the session in one call (one timestamp, one step check)."""
        self._in_step = False
        batch = self._batch
        try:
            pending_time = self.backend.end_step(n, token)
        except Exception as exc:
            self._warn_exc(exc)
            pending_time = None
        cpu = time.thread_time() - self._cpu_start
        if self._counter_row is not None:
            if type(pending_time) is float:
                self._keep_row(n, pending_time, cpu)
            else:  # a backend whose step times are pending: they go in log order
                if pending_time is not None:
                    self._pending.append((n, schema.M_STEP_TIME, pending_time))
                self._keep_row(n, None, cpu)
        else:
            batch[schema.M_STEP_CPU] = cpu
            if pending_time is not None:
                if type(pending_time) is float and not self._pending \
                        and schema.M_STEP_TIME not in batch:
                    batch[schema.M_STEP_TIME] = pending_time
                else:
                    self._pending.append((n, schema.M_STEP_TIME, pending_time))
            self._record_counters(n)
            if self._lrs is not None and (lrs := self._optimizer_row()) is not None:
                for name, rate in zip(*lrs, strict=True):
                    batch.setdefault(name, rate)  # a rate the user logged is kept
        if self._progress_override or self.global_batch is not None:
            self._record_progress(n)
        if batch:
            self._flush_batch(n)
        if not self._queued_warnings or self.backend._warnings:  # type: ignore[attr-defined]
            self._record_backend_warnings()
        self._steps_done += 1
        if self._steps_done == 1:  # inside what wraps the loop: the step's own numerics
            self._read_numerics(before_training=True)
        if self.recheck_every > 0 and self._steps_done % self.recheck_every == 0:
            self._describe()
            self._read_numerics(before_training=False)

    def _keep_row(self, n: int, step_time: float | None, cpu: float) -> None:
        """The block path's step exit: the step time (when already seconds) and the
        backend's raw cumulative counters are kept as one tuple; :meth:`_flush_rows` turns
        a block of them into per-step deltas in one session call, once per flush
        interval.  (Building dicts and deltas and the session's per-point checks at every
        exit cost ~30-40 us of a PyTorch/XLA step's host time, while the runtime executes
        the previous step on the same cores: docs/research/xla-probe-cost.md.)"""
        try:
            row: tuple[float, ...] | None = tuple(self._counter_row())
        except Exception as exc:
            self._warn_exc(exc)
            row = None
        if row is not None and len(row) != len(self._rows_last):
            if not self._rows_last:  # no reading at start: this one is the baseline
                self._rows_last = row
            row = None  # the step has no deltas
        lrs = self._optimizer_row() if self._lrs is not None else None
        self._rows.append((n, time.time_ns() // 1_000_000, step_time, row, lrs, cpu))
        if step_time is not None:
            self._step_times.append(step_time)
        if len(self._rows) >= MAX_BLOCK_ROWS or time.monotonic() >= self._rows_due:
            self._flush_rows()

    def _flush_rows(self) -> None:
        """Hand the kept rows to the session: the step times, and each counter's delta
        from the previous reading, as columns (:meth:`RunSession.log_columns`).  A step
        whose counters could not be read has none (its counts land in the next step's
        delta, as a delta computed then would have them); never a zero in their place."""
        rows = self._rows
        if not rows:
            return
        self._rows = []
        self._rows_due = time.monotonic() + self._rows_every_s
        counted = [r for r in rows if r[3] is not None]
        timed = [r for r in rows if r[2] is not None]
        counts: dict[str, list[float]] = {}
        if counted:
            cums = [self._rows_last] + [r[3] for r in counted]  # no generator: one call
            self._rows_last = cums[-1]  # type: ignore[assignment]
            for j, name in enumerate(self.backend.counter_names):  # type: ignore[attr-defined]
                column = [c[j] for c in cums]  # type: ignore[index]
                counts[name] = [b - a for a, b in itertools.pairwise(column)]
        times = {schema.M_STEP_TIME: [r[2] for r in timed]} if timed else {}
        cpus = {schema.M_STEP_CPU: [r[5] for r in rows]}
        # Rates by their names tuple (one object while the number of groups is the same).
        by_names: dict[tuple[str, ...], list[Any]] = {}
        for r in rows:
            if r[4] is not None:
                by_names.setdefault(r[4][0], []).append(r)
        rated = next(iter(by_names.values()), []) if len(by_names) <= 1 else None
        if len(counted) == len(timed) == len(rows) and rated is not None \
                and len(rated) in (0, len(rows)):
            # the usual case: one call
            self.run.log_columns([r[0] for r in rows],
                                 {**times, **cpus, **counts, **_rate_columns(rated)},
                                 [r[1] for r in rows])
            return
        groups = [(timed, times), (rows, cpus), (counted, counts),
                  *((g, _rate_columns(g)) for g in by_names.values())]
        for group, columns in groups:
            if columns:
                self.run.log_columns([r[0] for r in group], columns, [r[1] for r in group])

    def _optimizer_row(self) -> Rates | None:
        """The rates read at this step's entry and, read now (after the step's update),
        the optimizer's update count (:mod:`refrun.probes.optim`), as one ``(names,
        values)``; None when neither was read."""
        lrs, self._step_lrs = self._step_lrs, None
        reader = self._lrs
        if reader is None:
            return lrs
        try:
            count = reader.steps()
        except Exception as exc:  # a probe must never break the loop
            count = None
            self._warn_exc(exc)
        if count is None:
            if reader.count_why_not is not None:  # once: the count is on a device
                why, reader.count_why_not = reader.count_why_not, None
                self.run.warn_once("probe-opt-steps-not-read", why, self._step)
            return lrs
        if lrs is None:
            return reader.with_steps(()), (count,)
        return reader.with_steps(lrs[0]), (*lrs[1], count)

    def _read_lrs(self, lrs: LearningRates) -> Rates | None:
        """The optimizer's learning rates now; on a rate that cannot be read without a
        sync (or any error), a warning once and no more reads."""
        try:
            got = lrs.read()
        except Exception as exc:  # a probe must never break the loop
            self._lrs = None
            self._warn_exc(exc)
            return None
        if got is None:
            self._lrs = None
            self.run.warn_once("probe-lr-not-read", lrs.why_not or "learning rate not read",
                               self._step)
        return got

    def observe(self, **objects: Any) -> None:
        """Tell the probe about objects the loop replaced, between steps: the model or the
        optimizer a checkpoint reload built anew (PyTorch, PyTorch/XLA: ``model=``,
        ``optimizer=``), or pytrees whose placement to record again (JAX: ``params=``,
        ``batch=``).  From the next step on the probe reads the new ones (the learning
        rates and update count of the new optimizer), and records placement again.
        (``load_state_dict`` into the same objects needs no call: the probe reads the
        optimizer's current ``param_groups`` at every step.)

        Raises :class:`~refrun.errors.RefrunInputError` for an object the backend cannot
        read, or a backend that reads none."""
        observe = getattr(self.backend, "observe", None)
        if observe is None:
            raise RefrunInputError(f"{self.backend.name} probe: observe() takes nothing "
                                   "(this backend reads no model or optimizer)")
        observe(**objects)
        if "optimizer" in objects:
            self._read_optimizer(getattr(self.backend, "optimizer", None))
        self._describe()

    def _read_optimizer(self, opt: Any) -> None:
        """Read ``opt``'s rates and update count at every step (:mod:`refrun.probes.optim`),
        and follow a new optimizer over the same parameters (its ``follow``)."""
        if self._lrs is not None:
            self._lrs.unfollow()
        self._lrs = None
        if isinstance(getattr(opt, "param_groups", None), list):
            self._lrs = LearningRates(opt)
            self._guard(lambda: self._lrs.follow(self._optimizer_replaced))  # type: ignore[union-attr]

    def _optimizer_replaced(self, new: Any) -> None:
        """A new optimizer over the same parameters stepped (the loop built it after a
        reload): the probe reads it from now on, and this step's rate from it (read after
        its update: the rate the update used), and says so once."""
        self.backend.optimizer = new  # type: ignore[attr-defined]
        if self._in_step and self._lrs is not None:
            self._step_lrs = self._read_lrs(self._lrs)
        self.run.warn_once("probe-optimizer-followed", "a new optimizer over the model's "
                           f"parameters stepped at step {self._step}: the probe reads its "
                           "learning rates and update count from then on", self._step)

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record metrics for ``step`` (default: the current step).  Device values are
        fetched without blocking and logged once ready."""
        n = self._step if step is None else step
        if n is None:
            self._refuse_unstepped(metrics)
            return
        scalar_types = self._scalar_types
        for value in metrics.values():
            if type(value) not in scalar_types:
                if isinstance(value, Mapping):
                    items: Any = _flatten(metrics)
                    break
                scalar_types.add(type(value))
        else:
            items = metrics.items()
        # Values already on the host join the current step's batch, unless something logged
        # earlier is still pending (values reach the session in the order they were logged).
        fast = self._in_step and n == self._step
        batch, q, fetch = self._batch, self._pending, self.backend.fetch
        for name, value in items:
            try:
                handle = fetch(value)
            except Exception as exc:  # a probe must never break the loop
                self._refuse_value(name, n, exc)
                continue
            if handle is None:
                continue
            if fast and type(handle) is float and not q and name not in batch:
                batch[name] = handle
            else:
                q.append((n, name, handle))

    def progress(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Samples and/or tokens the current step consumed, when they differ from the
        default (``global_batch`` samples, ``tokens_per_sample`` tokens per sample): a
        last partial batch, variable-length sequences.  Python ints, never device values."""
        if samples is not None:
            self._progress_override["samples"] = int(samples)
        if tokens is not None:
            self._progress_override["tokens"] = int(tokens)

    def log_eval(self, step: int | None = None, **metrics: Any) -> None:
        """Evaluation metrics, recorded as ``eval/<name>``."""
        self.log(step, **{schema.EVAL_PREFIX + k: v for k, v in metrics.items()})

    # --- resolution -----------------------------------------------------------
    def _drain(self, block: bool = False) -> None:
        """Hand every ready value to the session, in order; stop at the first not ready."""
        if self._batch and self._step is not None:  # values of a step that did not exit
            self._flush_batch(self._step)
        q = self._pending
        backend = self.backend
        ready: list[tuple[int, str, float]] = []
        while q:
            n, name, handle = q[0]
            try:
                value = backend.wait(handle) if block else backend.ready(handle)
            except Exception as exc:  # a probe must never break the loop
                self._refuse_value(name, n, exc, "not readable")
                value = None
            else:
                if value is None and not block:
                    break
            q.popleft()
            if value is not None and self._take(n, name, value):
                ready.append((n, name, value))
        if ready:
            self._emit(ready)

    def _take(self, n: int, name: str, value: Any) -> bool:
        """What a ready value does before it goes to the session (a step time joins the
        step-time statistics; a non-finite loss warns once); False drops it."""
        if name == schema.M_STEP_TIME:
            self._step_times.append(value)
        if not math.isfinite(value) and name == schema.M_LOSS and not self._nonfinite_warned:
            self._nonfinite_warned = True
            self.run.warn_once("probe-loss-nonfinite", f"loss is {value} at step {n}", n)
        return True

    def _emit(self, ready: list[tuple[int, str, float]]) -> None:
        """Hand ready values to the session in log order, in as few calls as keep that
        order: consecutive values of one step as one point set, and a run of steps that
        all log the same names as columns in one :meth:`RunSession.log_columns` call
        (which has ``log_metrics``' outcome step by step).  Handing them over one call per
        value cost ~15 us each on the training thread when a backend copies values in
        batches (PyTorch/XLA: once a flush interval; docs/research/xla-probe-cost.md)."""
        steps: list[int] = []
        rows: list[dict[str, float]] = []
        for n, name, value in ready:
            if steps and steps[-1] == n and name not in rows[-1]:
                rows[-1][name] = value
            else:
                steps.append(n)
                rows.append({name: value})
        keys = rows[0].keys()
        if len(rows) > 1 and all(map(keys.__eq__, map(dict.keys, rows))):  # C-level
            self.run.log_columns(steps, {k: [r[k] for r in rows] for k in keys})
            return
        for n, row in zip(steps, rows, strict=True):
            self.run.log_metrics(n, row)

    def _flush_batch(self, n: int) -> None:
        """Hand the host values gathered for step ``n`` to the session in one call (what
        :meth:`_emit` does per value, for the whole batch)."""
        batch = self._batch
        t = batch.get(schema.M_STEP_TIME)
        if t is not None:
            self._step_times.append(t)
        loss = batch.get(schema.M_LOSS)
        if loss is not None and not self._nonfinite_warned and not math.isfinite(loss):
            self._nonfinite_warned = True
            self.run.warn_once("probe-loss-nonfinite", f"loss is {loss} at step {n}", n)
        try:
            self.run.log_metrics(n, batch)
        finally:
            batch.clear()  # the session copies what it accepts; the dict is reused

    def _record_counters(self, n: int) -> None:
        try:
            now = self.backend.counters()
        except Exception as exc:
            self._warn_exc(exc)
            return
        if not now:  # the eager fast path: nothing compiled, nothing to log
            if self._last_counters:
                self._last_counters = {}
            return
        last = self._last_counters
        batch = self._batch
        deltas = {k: v - last.get(k, 0.0) for k, v in now.items()}
        self._last_counters = dict(now)
        if not batch.keys() & deltas.keys():
            batch.update(deltas)  # sent with the step's batch
        else:
            self.run.log_metrics(n, deltas)

    def _progress_defaults(self, tags: Mapping[str, str]) -> None:
        for attr, tag in (("global_batch", schema.TAG_GLOBAL_BATCH),
                          ("tokens_per_sample", schema.TAG_TOKENS_PER_SAMPLE)):
            if getattr(self, attr) is None and str(tags.get(tag, "")).isdigit():
                setattr(self, attr, int(tags[tag]))
        if self.tokens_per_sample is not None and schema.TAG_TOKENS_PER_SAMPLE not in tags:
            self._guard(lambda: self.run.set_tags(
                {schema.TAG_TOKENS_PER_SAMPLE: self.tokens_per_sample}))

    def _record_progress(self, n: int) -> None:
        """Cumulative ``progress/samples`` and ``progress/tokens`` at the end of step ``n``
        (host integers only: from the declared batch, or :meth:`progress`)."""
        over = self._progress_override
        if over:
            self._progress_override = {}
        samples = over.get("samples", self.global_batch)
        tokens = over.get("tokens")
        if tokens is None and samples is not None and self.tokens_per_sample is not None:
            tokens = samples * self.tokens_per_sample
        out: dict[str, float] = {}
        if samples is not None:
            self._samples += samples
            out[schema.M_PROGRESS_SAMPLES] = float(self._samples)
        if tokens is not None:
            self._tokens += tokens
            out[schema.M_PROGRESS_TOKENS] = float(self._tokens)
        if out:
            if not self._batch.keys() & out.keys():
                self._batch.update(out)  # sent with the step's batch
            else:
                self.run.log_metrics(n, out)

    def _record_backend_warnings(self) -> None:
        take = getattr(self.backend, "take_warnings", None)
        if take is None:
            return
        try:
            warnings = take()
        except Exception as exc:  # a probe must never break the loop
            self._warn_exc(exc)
            return
        for w in warnings or ():
            self.run.warn_once(w.key, w.message, w.step)

    def _describe(self, final: bool = False) -> None:
        """Record the backend's description as tags (only those that changed); a placement
        warning also becomes a run warning, once per distinct text.  ``final``: at close,
        with the backend's running counts."""
        desc = dict(self._guard(functools.partial(self.backend.describe, final=final)) or {})
        for m in self.monitors:
            tags_of = getattr(m, "tags", None)
            if tags_of is not None:
                desc.update(self._guard(tags_of) or {})
        if not desc:
            return
        tags = _describe_tags(desc)
        changed = {k: v for k, v in tags.items() if self._described.get(k) != v}
        if not changed:
            return
        self._described.update(changed)
        self._guard(lambda: self.run.set_tags(changed))
        warning = changed.get(schema.TAG_PLACEMENT_WARNING)
        if warning:
            self.run.warn_once(f"placement:{str(warning)[:80]}", f"placement: {warning}",
                               self._step)

    def _read_numerics(self, before_training: bool) -> None:
        """Record the numerics tags that differ from those last recorded.  A setting
        that changed is listed in ``refrun.numerics.changes`` (``before_training``: no
        step ran with its old value -- seen at start or at the end of the first step, as
        when a context manager wraps the loop); one that changed later is also a run
        warning, since the run then computed with both."""
        now = self._guard(numerics.current) or {}
        new = {k: v for k, v in now.items() if self._numerics.get(k) != v}
        if not new:
            return
        entries = numerics.change_entries(self._numerics, now, self._step, before_training)
        self._numerics.update(new)
        tags: dict[str, Any] = dict(new)
        if entries:
            self._numerics_changes += entries
            tags[schema.TAG_NUMERICS_CHANGES] = json.dumps(
                self._numerics_changes[:numerics.MAX_CHANGES])
        for e in entries if not before_training else ():
            name = e["tag"].removeprefix(schema.NUMERICS_PREFIX)
            self.run.warn_once(f"numerics:{name}:{e['to']}"[:120],
                               f"numerics changed during the run at step {e['step']}: "
                               f"{name} {e['from']} -> {e['to']} (steps before it computed "
                               f"with {e['from']}; {schema.TAG_NUMERICS_CHANGES})", e["step"])
        self._guard(lambda: self.run.set_tags(tags))

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # a probe must never break the loop
            self._warn_exc(exc)
            return None

    def _refuse_value(self, name: str, n: int | None, exc: Exception,
                      kind: str = "not recordable") -> None:
        """A logged value the probe cannot record: counted by the session (``refrun.refused``,
        named in warnings.json) and warned once per metric and reason, like a value the
        session itself refuses."""
        self.run.refuse(str(name), f"{self.backend.name} probe: metric {name!r} at step {n}: "
                        f"{type(exc).__name__}: {exc}", n, kind)

    def _refuse_unstepped(self, metrics: Mapping[str, Any]) -> None:
        """``probe.log`` before any ``probe.step()`` and without ``step=``: no step to record
        the values at; each counted as refused."""
        self.run.refuse(",".join(sorted(map(str, metrics)))[:200],
                        "probe.log called before any probe.step(); pass step= explicitly",
                        None, "no step", n=max(1, len(metrics)))

    def _warn_exc(self, exc: Exception) -> None:
        self.run.warn_once(f"probe:{type(exc).__name__}:{str(exc)[:40]}",
                           f"{self.backend.name} probe: {type(exc).__name__}: {exc}",
                           self._step)

    # --- samplers -------------------------------------------------------------
    def _sample_loop(self) -> None:
        while not self._stop_sampler.wait(self.sample_interval_s):
            self.sample_now()

    def sample_now(self) -> None:
        """Take one sample from every monitor for the current training step.

        Samples are accumulated per step and logged (as the mean of the samples taken
        during that step) once the training step has moved on, or at :meth:`close`."""
        n = self._step
        if n is None:
            return
        values: dict[str, float] = {}
        for m in self.monitors:
            got = self._guard(m.sample)
            if got:
                values.update(got)
        with self._sample_lock:
            if self._sample_step is not None and self._sample_step != n:
                self._flush_samples()
            self._sample_step = n
            acc = self._sample_acc
            for k, v in values.items():
                s, c = acc.get(k, (0.0, 0))
                acc[k] = (s + float(v), c + 1)

    def _flush_samples(self) -> None:
        """Log the accumulated means for ``_sample_step`` (caller holds ``_sample_lock``)."""
        if self._sample_acc and self._sample_step is not None:
            self.run.log_metrics(self._sample_step,
                                 {k: s / c for k, (s, c) in self._sample_acc.items()})
        self._sample_acc = {}

    # --- end ------------------------------------------------------------------
    def step_time_stats(self) -> StepTimes | None:
        """Median/p90/mean of recorded step times after ``warmup_steps`` steps."""
        arr = np.frombuffer(self._step_times, dtype=np.float64)[self.warmup_steps:]
        if arr.size == 0:
            return None
        return StepTimes(len(arr), float(np.median(arr)), float(np.percentile(arr, 90)),
                         float(arr.mean()), self.warmup_steps)

    def close(self) -> None:
        """Resolve every pending value (blocking: training is over), stop samplers,
        remove the backend's hooks, and record the summary tags."""
        if self._closed:
            return
        self._closed = True
        if self._close_entry is None:
            self._close_entry = time.perf_counter()
        self._stop_sampler.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        for m in self.monitors:  # background sampling ends before the last sample
            stop = getattr(m, "stop", None)
            if stop is not None:
                self._guard(stop)
        if self.monitors:
            self.sample_now()  # short runs get at least one sample
            with self._sample_lock:
                self._flush_samples()
        for m in self.monitors:  # before the description: their final tags
            self._guard(m.close)
        self._flush_rows()
        self._drain(block=True)
        self._describe(final=True)
        stats = self.step_time_stats()
        tags: dict[str, Any] = {}
        if stats is not None:
            tags[schema.TAG_STEP_TIME_MEDIAN] = f"{stats.median_s:.6g}"
            tags[schema.TAG_STEP_TIME_P90] = f"{stats.p90_s:.6g}"
            tags[schema.TAG_WARMUP_STEPS] = stats.warmup_steps
            tags[schema.TAG_STEADY_STEPS] = stats.count
        if self._lrs is not None:
            self._guard(self._lrs.unfollow)
        self._guard(self.backend.close)
        self._record_backend_warnings()
        # End-of-run additions of the backend (no-op hooks on BackendBase).
        extra = getattr(self.backend, "summary_tags", None)
        tags.update(self._guard(extra) or {} if extra is not None else {})
        if tags:
            self._guard(lambda: self.run.set_tags(tags))
        arts = getattr(self.backend, "artifacts", None)
        for path, payload in (self._guard(arts) or {} if arts is not None else {}).items():
            self._guard(lambda p=path, d=payload: self.run.log_json(p, d))
        own = getattr(self.run, "add_own_close_s", None)  # a run of refrun's own session
        if own is not None:
            self._guard(lambda: own(time.perf_counter() - self._close_entry))

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StepScope:
    """What ``probe.step(n)`` returns: a small context manager (cheaper than a generator
    based one on every training step); a step entered inside another is not timed."""

    __slots__ = ("_n", "_nested", "_probe", "_token")

    def __init__(self, probe: Probe, n: int) -> None:
        self._probe = probe
        self._n = n
        self._token: Any = None
        self._nested = False

    def __enter__(self) -> Probe:
        p = self._probe
        if p._in_step:
            self._nested = True
            p.run.warn_once("probe-nested", f"step {self._n} entered while step {p._step} "
                            "was still open; the inner one is not timed", self._n)
            return p
        self._token = p._enter_step(self._n)
        return p

    def __exit__(self, *exc: object) -> None:
        if not self._nested:
            self._probe._exit_step(self._n, self._token)


def _rate_columns(rows: list[Any]) -> dict[str, list[float]]:
    """The learning-rate columns of kept rows that share one names tuple."""
    if not rows:
        return {}
    names = rows[0][4][0]
    return {name: [r[4][1][j] for r in rows] for j, name in enumerate(names)}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _flush_interval(run: Any) -> float:
    """The session's flush interval (how often points reach the spool): rows handed over
    sooner reach no reader sooner."""
    try:
        return float(run.config.options.flush_interval_s)
    except (AttributeError, TypeError, ValueError):
        return 1.0


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested dicts become ``a/b`` names (pytrees of scalars, dicts of tensors)."""
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _describe_tags(desc: Mapping[str, Any]) -> dict[str, Any]:
    """Backend description keys are schema tag names already, or get ``refrun.`` prefixed.
    Placement problems come from every backend in one shape, a list of sentences under
    ``TAG_PLACEMENT_WARNING`` (empty: none); the tag is their ``"; "``-joined text."""
    tags = {(k if k.startswith(schema.PREFIX) else schema.PREFIX + k): v
            for k, v in desc.items()}
    problems = tags.pop(schema.TAG_PLACEMENT_WARNING, None) or []
    if problems:
        tags[schema.TAG_PLACEMENT_WARNING] = "; ".join(problems)
    return tags
