"""The probe design shared by the PyTorch, PyTorch/XLA and JAX wrappers.

A probe sits between a training loop and a :class:`refrun.session.RunSession`::

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
* reads the backend's cumulative counters at step entry and exit and logs the deltas
  (compilations, transfers, fallbacks ...) under the shared names of :mod:`refrun.schema`,
* starts a non-blocking fetch for every device value given to :meth:`Probe.log` and
  hands it to the session once the backend says it is ready, with its own step number,
* runs :class:`Monitor` samplers on a background thread, logged against the training
  step that was current when each sample was taken.

A backend never raises into the loop: failures become recorded warnings.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from refrun import schema
from refrun.session import RunSession


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
        """Cumulative counters keyed by schema metric names (``compile/graphs`` ...)."""

    def describe(self) -> Mapping[str, Any]:
        """Device truth and placement, recorded as tags at start and at close."""

    def close(self) -> None:
        """Remove listeners/hooks the backend installed."""


class Monitor(Protocol):
    """One source of utilisation samples (psutil, NVML, TPU runtime ...)."""

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
    warmup_steps: int = 5
    monitors: Sequence[Monitor] = ()
    sample_interval_s: float = 1.0
    _pending: deque[tuple[int, str, Any]] = field(default_factory=deque, repr=False)
    _step: int | None = None
    _in_step: bool = False
    _last_counters: dict[str, float] = field(default_factory=dict, repr=False)
    _step_times: list[tuple[int, float]] = field(default_factory=list, repr=False)
    _nonfinite_warned: bool = False
    _sampler: threading.Thread | None = field(default=None, repr=False)
    _stop_sampler: threading.Event = field(default_factory=threading.Event, repr=False)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._guard(lambda: self.run.set_tags(_describe_tags(self.backend.describe())))
        self._last_counters = dict(self._guard(self.backend.counters) or {})
        if self.monitors:
            self._sampler = threading.Thread(target=self._sample_loop, daemon=True,
                                             name="refrun-sampler")
            self._sampler.start()

    # --- the loop surface -----------------------------------------------------
    @property
    def current_step(self) -> int | None:
        return self._step

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[Probe]:
        """Context manager around training step ``n``: times it and records counter deltas."""
        if self._in_step:
            self.run.warn_once("probe-nested", f"step {n} entered while step {self._step} "
                               "was still open; the inner one is not timed", n)
            yield self
            return
        self._in_step = True
        self._step = n
        self._drain()
        token = self._guard(lambda: self.backend.begin_step(n))
        try:
            yield self
        finally:
            self._in_step = False
            pending_time = self._guard(lambda: self.backend.end_step(n, token))
            if pending_time is not None:
                self._pending.append((n, schema.M_STEP_TIME, pending_time))
            self._record_counters(n)

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record metrics for ``step`` (default: the current step).  Device values are
        fetched without blocking and logged once ready."""
        n = self._step if step is None else step
        if n is None:
            self.run.warn_once("probe-nostep", "probe.log called before any probe.step(); "
                               "pass step= explicitly", None)
            return
        for name, value in _flatten(metrics):
            handle = self._guard(lambda v=value: self.backend.fetch(v))
            if handle is not None:
                self._pending.append((n, name, handle))

    def log_eval(self, step: int | None = None, **metrics: Any) -> None:
        """Evaluation metrics, recorded as ``eval/<name>``."""
        self.log(step, **{schema.EVAL_PREFIX + k: v for k, v in metrics.items()})

    # --- resolution -----------------------------------------------------------
    def _drain(self, block: bool = False) -> None:
        """Hand every ready value to the session, in order; stop at the first not ready."""
        q = self._pending
        while q:
            n, name, handle = q[0]
            value = self._guard(lambda h=handle: self.backend.wait(h) if block
                                else self.backend.ready(h))
            if value is None and not block:
                return
            q.popleft()
            if value is None:
                continue
            self._emit(n, name, value)

    def _emit(self, n: int, name: str, value: float) -> None:
        if name == schema.M_STEP_TIME:
            self._step_times.append((n, value))
        if not math.isfinite(value) and name == schema.M_LOSS and not self._nonfinite_warned:
            self._nonfinite_warned = True
            self.run.warn_once("probe-loss-nonfinite", f"loss is {value} at step {n}", n)
        self.run.log_metrics(n, {name: value})

    def _record_counters(self, n: int) -> None:
        now = self._guard(self.backend.counters)
        if now is None:
            return
        deltas = {k: v - self._last_counters.get(k, 0.0) for k, v in now.items()}
        self._last_counters = dict(now)
        if deltas:
            self.run.log_metrics(n, deltas)

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # a probe must never break the loop
            self.run.warn_once(f"probe:{type(exc).__name__}:{str(exc)[:40]}",
                               f"{self.backend.name} probe: {type(exc).__name__}: {exc}",
                               self._step)
            return None

    # --- samplers -------------------------------------------------------------
    def _sample_loop(self) -> None:
        while not self._stop_sampler.wait(self.sample_interval_s):
            self.sample_now()

    def sample_now(self) -> None:
        """Take one sample from every monitor, logged against the current training step."""
        n = self._step
        if n is None:
            return
        for m in self.monitors:
            values = self._guard(m.sample)
            if values:
                self.run.log_metrics(n, dict(values))

    # --- end ------------------------------------------------------------------
    def step_time_stats(self) -> StepTimes | None:
        """Median/p90/mean of recorded step times after ``warmup_steps`` steps."""
        times = [t for _, t in self._step_times[self.warmup_steps:]]
        if not times:
            return None
        arr = np.asarray(times)
        return StepTimes(len(arr), float(np.median(arr)), float(np.percentile(arr, 90)),
                         float(arr.mean()), self.warmup_steps)

    def close(self) -> None:
        """Resolve every pending value (blocking: training is over), stop samplers,
        remove the backend's hooks, and record the summary tags."""
        if self._closed:
            return
        self._closed = True
        self._stop_sampler.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        self._drain(block=True)
        stats = self.step_time_stats()
        tags: dict[str, Any] = _describe_tags(self._guard(self.backend.describe) or {})
        if stats is not None:
            tags["refrun.perf.step_time_median_s"] = f"{stats.median_s:.6g}"
            tags["refrun.perf.step_time_p90_s"] = f"{stats.p90_s:.6g}"
            tags["refrun.perf.warmup_steps"] = stats.warmup_steps
        self.run.set_tags(tags)
        for m in self.monitors:
            self._guard(m.close)
        self._guard(self.backend.close)

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested dicts become ``a/b`` names (pytrees of scalars, dicts of tensors)."""
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _describe_tags(desc: Mapping[str, Any]) -> dict[str, Any]:
    """Backend description keys are schema tag names already, or get ``refrun.`` prefixed."""
    return {(k if k.startswith(schema.PREFIX) else schema.PREFIX + k): v for k, v in desc.items()}
