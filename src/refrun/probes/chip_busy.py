"""Chip utilisation from a source that answers: ``sys/<platform><i>_duty_cycle_pct``.

The share of wall time a device executed programs, per device, from the first source
that works on this machine, and the tag ``refrun.exec.utilization_source`` saying which one, or
why none did (never a blank, never a zero in place of "not known"):

1. **libtpu's runtime metrics** (``libtpu.sdk.tpumonitoring.get_metric("duty_cycle_pct")``),
   what ``tpu-info`` shows.  They come from the runtime's metrics service: on a TPU v5e VM
   without that service (``TPU_RUNTIME_METRICS_PORTS`` empty, no sockets) libtpu lists
   the metric and returns no data for it, idle or under load.
2. **The device's own timeline**: a device-only profiler window (host and Python tracing
   off, nothing written to disk) taken now and then, off the training thread, turned
   into ``busy = |∪ XLA Modules events ∩ window| / window`` per ``/device:<PLATFORM>:<i>``
   plane (:func:`refrun.probes.xspace.busy_fraction`).  On a TPU the chip times each
   executed program itself; on the CPU a trace has no device plane, so there is nothing
   to read and the tag says so.

**When windows are taken** (:class:`BusySampling`): the first once the loop is steady
(past its warm-up steps, steps advancing, no compilation started or ended between two looks 50 ms
apart: a window over a compilation measures the compiler), then again after
``max(min_period_s, cost / budget)`` capped at ``max_period_s``, where ``cost`` is the wall
time the last window spent in profiler calls (open, stop, read).  Those calls may hold
Python's lock and take the training thread's time; bounding their sum by ``budget`` (0.2 %)
of the run's wall time keeps the sampler within the probe's 1 % whatever they cost on a
given machine: on the TPU v5e VM a session with default options took 50 ms to open and
0.55-0.96 s to stop; device-only sessions on the CPU take 0.02 ms and 0.07 ms.  A window
that starts at a time unrelated to the step's phase measures the duty cycle without bias
whatever its length; short windows keep the trace small.  The windows' values are means
over a window each: average them (the L4 busy fraction), do not take a median of them.
A window spans ``window_steps`` (50) steps at the rate the last look saw, within
``[min_window_s, window_s]`` (10 ms, 0.2 s), so that a loop of a few hundred
sub-millisecond steps gets a window that ends before it does.  The sampler looks at the
loop ``looks_per_window`` times during a window: a window in which the loop compiled is
read over its longest stretch that ran steps without compiling (:func:`steady_span`), and
dropped only when it has none of ``min_window_s`` (or the loop stood still).

A window never disturbs the user's own profiling: it is taken under JAX's (or
torch_xla's) profiler lock, skipped while the user's trace is running, and a user trace
started during a window waits for it (at most ``window_s + steady_wait_s`` plus the stop).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.probes.xspace import Timeline, XSpaceError, busy_fraction, read_timeline

Progress = Callable[[], tuple[int, int]]
"""``() -> (steps done, compile events)``: what the sampler asks the probe to tell a steady
loop.  The count goes up by one when a compilation starts and by one when it ends (an odd
count: one is under way); a probe that sees no compilations gives 0."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BusySampling:
    """How often and how long the device's timeline is sampled (see the module doc)."""

    window_s: float = 0.2
    """Longest profiler window, seconds."""
    window_steps: int = 50
    """Steps a window spans when the loop is faster (its length: this many steps at the
    rate the last look saw, at least ``min_window_s``): a short loop gets a window that
    ends before it does."""
    min_window_s: float = 0.01
    """Shortest profiler window, seconds."""
    budget: float = 0.002
    """Largest share of wall time spent in profiler calls (open, stop, read)."""
    min_period_s: float = 10.0
    """Least time between two windows' starts, seconds."""
    max_period_s: float = 300.0
    """Most time between two windows' starts, seconds (however dear a window was)."""
    empty_windows: int = 3
    """Windows without any device's programs after which an accelerator's timeline is
    taken to be unreadable here (on the CPU the first one decides)."""
    retry_s: float = 0.5
    """Seconds before the next window while none has been read and the last one was not
    (no device's programs in it, or no steady stretch in it): a run of a
    few seconds still gets its reading (on a TPU v5e 11 of 23 runs of 2-9 s had none
    when the next try waited ``min_period_s``)."""
    quick_retries: int = 4
    """Tries after ``retry_s`` before the first reading; past them the period rule
    applies (a loop that compiles all the time is not profiled over and over)."""
    steady_poll_s: float = 0.05
    """Seconds between two looks at the loop's progress when waiting for a steady loop
    (a sleeping thread woken 20 times a second only until it takes a window)."""
    looks_per_window: int = 20
    """Looks at the loop's progress during a window's length (at least ``look_gap_s``
    apart): a window is read over its longest stretch between two looks that ran steps
    and compiled nothing (:func:`steady_span`), not dropped whole when the loop compiled
    in it."""
    look_gap_s: float = 0.002
    """Least seconds between two looks during a window (each look takes Python's lock
    from the training thread for a moment)."""
    steady_wait_s: float = 1.0
    """Longest a window stays open beyond its length waiting for a loop that stands
    still without compiling (an evaluation running, a host pause) to run that length
    steadily.  A window in which a compilation starts ends at once instead: read over
    the steady stretch before it, or dropped and tried again soon (``retry_s``) once the
    loop is steady again, so that the profiler is never held through a compilation (a
    user's own trace waits for a window to end).  On a TPU v5e 11 of 26 runs' first
    window opened as the loop began compiling its evaluation (0.5-2.4 s there), and a
    run of 3-4 s has time for about two windows (their profiler calls take 0.5-1 s)."""

    def __post_init__(self) -> None:
        for name in ("window_steps", "empty_windows", "quick_retries", "looks_per_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RefrunInputError(f"BusySampling.{name}: expected an integer >= 1, "
                                       f"got {v!r}")
        if self.min_window_s > self.window_s:
            raise RefrunInputError(f"BusySampling: min_window_s {self.min_window_s} > "
                                   f"window_s {self.window_s}")
        for name in ("window_s", "min_window_s", "min_period_s", "max_period_s",
                     "steady_poll_s", "retry_s", "look_gap_s", "steady_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise RefrunInputError(f"BusySampling.{name}: expected seconds > 0, got {v!r}")
        if not 0 < self.budget < 1:
            raise RefrunInputError(f"BusySampling.budget: expected a share in (0, 1), got "
                                   f"{self.budget!r}")
        if self.min_period_s > self.max_period_s:
            raise RefrunInputError(f"BusySampling: min_period_s {self.min_period_s} > "
                                   f"max_period_s {self.max_period_s}")
        if self.window_s >= self.min_period_s:
            raise RefrunInputError(f"BusySampling: window_s {self.window_s} must be shorter "
                                   f"than min_period_s {self.min_period_s}")

    def window_for(self, step_s: float | None) -> float:
        """The window's length for steps of ``step_s`` seconds (None: not known):
        ``window_steps`` of them within ``[min_window_s, window_s]``."""
        if step_s is None or not step_s > 0:
            return self.window_s
        return min(self.window_s, max(self.min_window_s, self.window_steps * step_s))

    def period_s(self, cost_s: float) -> float:
        """Seconds from one window's start to the next: ``cost_s / budget`` within
        ``[min_period_s, max_period_s]``."""
        return min(self.max_period_s, max(self.min_period_s, cost_s / self.budget))

    def wait_after(self, outcome: str, cost_s: float, read: int, tries: int) -> float:
        """Seconds from a window's start to the next one's, after a window whose
        ``outcome`` is ``"read"``, ``"empty"`` (no device's programs), ``"dropped"`` (the
        loop had no steady stretch in it) or ``"failed"``, when ``read`` windows have
        been read and ``tries`` windows taken in all: ``retry_s`` while nothing was read
        and the quick tries last, else :meth:`period_s`."""
        if outcome in ("empty", "dropped") and read == 0 and tries <= self.quick_retries:
            return self.retry_s
        return self.period_s(cost_s)


Look = tuple[int, int, int]
"""``(time.time_ns(), steps done, compilations so far)``: one look at the loop."""


def steady_span(looks: Sequence[Look], min_ns: int, min_steps: int = 1
                ) -> tuple[int, int] | None:
    """The longest stretch ``(t_i, t_j)`` between two looks during which the loop ran
    steps and compiled nothing, or None when no stretch of at least ``min_ns`` and
    ``min_steps`` steps is.

    Compilation happens on the loop's own thread, inside a step's call (or an
    evaluation's), so it can be bounded by the steps that completed around it without
    knowing whether the compilation count moves at its start or at its end:

    * after the count moved between looks ``a - 1`` and ``a``, the stretch starts at the
      first look whose step count is above look ``a``'s (a step completed after the
      count moved, so the compilation was over); looks before any move start at once;
    * before the count moves between looks ``b`` and ``b + 1``, the stretch ends at look
      ``k - 1`` for the last ``k <= b`` whose step count is above look ``k - 1``'s (a step
      completed in ``(t_{k-1}, t_k]``, so the compilation had not begun at ``t_{k-1}``);
      the last look ends the stretch when nothing compiled after it.

    The busy share over such a stretch is the steady loop's; its ends are set by the
    sampler's looks, unrelated to the step's phase, so they add no bias.
    """
    best: tuple[int, int] | None = None
    n = len(looks)
    a = 0
    while a < n:
        b = a
        while b + 1 < n and looks[b + 1][2] == looks[a][2]:
            b += 1
        i = a
        if a > 0:  # a compilation ended before looks[a]: wait for a step after it
            i = next((k for k in range(a, b + 1) if looks[k][1] > looks[a][1]), b + 1)
        j = b
        if b + 1 < n:  # a compilation follows: end before the last step seen before it
            j = next((k - 1 for k in range(b, i, -1) if looks[k][1] > looks[k - 1][1]), i)
        if j > i and looks[j][1] - looks[i][1] >= min_steps \
                and looks[j][0] - looks[i][0] >= min_ns \
                and (best is None or looks[j][0] - looks[i][0] > best[1] - best[0]):
            best = (looks[i][0], looks[j][0])
        a = b + 1
    return best


@dataclass(frozen=True)
class WindowResult:
    """One window: each device's busy share in percent (metric name -> %), the window
    on ``time.time_ns()``'s clock, and the wall time spent in profiler calls."""

    busy_pct: dict[str, float]
    start_ns: int
    end_ns: int
    cost_s: float


def window_busy(timeline: Timeline, window: tuple[int, int], platform: str = ""
                ) -> tuple[dict[str, float], str]:
    """``({metric name: busy %}, why not)`` of one trace over ``window``: every device plane
    with an ``XLA Modules`` line gets ``sys/<platform><i>_duty_cycle_pct``; ``why not`` says
    what the trace lacked when no device could be read (empty otherwise; ``platform``, the
    devices' platform, is named in it)."""
    out: dict[str, float] = {}
    lacking = []
    for d in timeline.devices:
        if d.modules is None:
            lacking.append(d.plane)
            continue
        name = schema.device_metric(d.platform, d.index, schema.DUTY_CYCLE_SUFFIX)
        out[name] = 100.0 * busy_fraction(d.modules, window)
    if out:
        return out, ""
    if lacking:
        return out, f"no 'XLA Modules' line on {', '.join(lacking)}"
    on = f"{platform} devices; " if platform else ""
    return out, f"no device plane in the trace ({on}planes: {', '.join(timeline.planes)})"


# --- sessions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionSource:
    """How to open a profiler session in this process: ``open()`` returns an object whose
    ``stop()`` returns the serialized XSpace; ``state`` is the framework's profiler state
    (``.lock``, ``.profile_session``: the user's own trace), None when unknown; ``what``
    names it in the tag."""

    open: Callable[[], Any]
    state: Any
    what: str


def jax_sessions() -> SessionSource | None:
    """Device-only in-memory sessions of jaxlib's profiler; None where it is missing."""
    try:
        from jax._src import profiler as jax_profiler
        from jax._src.lib import _profiler
    except Exception:  # an older or stripped jaxlib: no source
        return None

    def open_session() -> Any:
        opts = _profiler.ProfileOptions()
        opts.host_tracer_level = 0  # the device's timeline only: no host events
        opts.python_tracer_level = 0
        opts.enable_hlo_proto = False
        return _profiler.ProfilerSession(opts)

    return SessionSource(open_session, getattr(jax_profiler, "_profile_state", None),
                         "jax profiler")


def torch_xla_sessions() -> SessionSource | None:
    """torch_xla's in-memory profiler session (its default options: host tracing on);
    None without torch_xla."""
    try:
        import torch_xla
        import torch_xla.debug.profiler as xp
    except Exception:
        return None
    wrapper = getattr(getattr(torch_xla._XLAC, "profiler", None), "TslProfilerSessionWrapper",
                      None)
    if wrapper is None:
        return None
    return SessionSource(wrapper, getattr(xp, "_profile_state", None), "torch_xla profiler")


# --- the sampler -------------------------------------------------------------------------
@dataclass
class ProfilerWindows:
    """Takes the windows on a thread of its own (see the module doc); :meth:`take` hands
    finished windows over, :attr:`why_not` says why there are none (yet)."""

    source: SessionSource
    sampling: BusySampling = field(default_factory=BusySampling)
    warmup_steps: int = 0
    discover_at_start: bool = False
    """Take one window at once, steady or not (a platform known to have no device
    timeline: the window finds none, and no later one is taken)."""
    progress: Progress | None = None
    platform: str = ""
    completed: int = 0
    """Windows that read a device (their results handed over by :meth:`take` or not)."""
    reported: int = 0
    """Windows handed over by :meth:`take` (the values a run records)."""
    why_not: str | None = "no window yet: the first is taken once the loop is steady"
    stopped: bool = False
    empty: int = 0
    """Windows whose trace held no device's programs."""
    dropped: int = 0
    """Windows dropped because the loop had no steady stretch in them (it compiled
    throughout, or stood still)."""
    trimmed: int = 0
    """Windows read over their stretch without compilation only (:func:`steady_span`)."""
    tries: int = 0
    """Windows taken (read, empty, dropped or failed)."""
    looks: int = 0
    """Looks at the loop's progress while waiting for it to be steady."""
    in_window: bool = False
    """A profiler session of the sampler's is open now."""
    _done: list[WindowResult] = field(default_factory=list, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _last: tuple[int, int, float] | None = field(default=None, repr=False)
    _step_s: float | None = field(default=None, repr=False)
    _empty_why: str | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Started, not closed, and still sampling."""
        return self._thread is not None and not self._stop.is_set() and not self.stopped

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="refrun-chip-busy")
            self._thread.start()

    def take(self) -> list[WindowResult]:
        out, self._done = self._done, []
        self.reported += len(out)
        return out

    def close(self) -> None:
        """Stop sampling (a window in progress ends first); :meth:`take` still hands over
        what finished."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.completed == 0 and not self.stopped:
            self.why_not = ended_unread(self.warmup_steps, self.empty, self.dropped,
                                        self._empty_why)

    # -- the thread --
    def _run(self) -> None:
        if self.discover_at_start:  # only to see the trace's planes: the shortest window
            self._window(self.sampling.min_window_s, discover=True)
        while not self.stopped and self._wait_steady():
            began = time.monotonic()
            taken = self._window()
            if taken is None:
                continue  # skipped: the user's own trace was running
            cost, outcome = taken
            self.tries += 1
            if self.stopped:
                return
            wait = self.sampling.wait_after(outcome, cost, self.completed, self.tries)
            if self._stop.wait(max(0.0, began + wait - time.monotonic())):
                return

    def _steady(self) -> bool:
        """One look at the loop: steady when more than ``warmup_steps`` steps are done,
        steps advanced since the previous look, and nothing compiled in between (the
        seconds per step of that stretch are kept for the window's length)."""
        if self.progress is None:
            return True
        self.looks += 1
        try:
            now = self.progress()
        except Exception:
            return False
        t = time.monotonic()
        last, self._last = self._last, (now[0], now[1], t)
        if last is None or not (now[0] > self.warmup_steps and now[0] > last[0]
                                and now[1] == last[1]):
            return False
        self._step_s = (t - last[2]) / (now[0] - last[0])
        return True

    def _wait_steady(self) -> bool:
        """Until the loop is steady (True) or the sampler stops (False)."""
        self._last = None
        while not self._stop.is_set():
            if self._steady():
                return True
            self._stop.wait(self.sampling.steady_poll_s)
        return False

    def _window(self, length: float | None = None, discover: bool = False
                ) -> tuple[float, str] | None:
        """One window (of ``length`` seconds; default: ``window_steps`` steps, see
        :meth:`BusySampling.window_for`): the seconds spent in profiler calls and the
        outcome (see :meth:`BusySampling.wait_after`), None when skipped."""
        state = self.source.state
        lock = getattr(state, "lock", None)
        if length is None:
            length = self.sampling.window_for(self._step_s)
        with lock if lock is not None else contextlib.nullcontext():
            if state is not None and getattr(state, "profile_session", None) is not None:
                if self.completed == 0:
                    self.why_not = "the user's own profiler trace was running"
                self._stop.wait(self.sampling.min_period_s)
                return None
            t0 = time.perf_counter()
            try:
                session = self.source.open()
            except Exception as exc:
                return self._failed(f"{self.source.what}: session refused ({exc})", t0)
            self.in_window = True
            try:
                start_ns = time.time_ns()
                opened = time.perf_counter()
                looks = self._looks(length, look=not discover)
                end_ns = time.time_ns()
                stopping = time.perf_counter()
                try:
                    xspace = session.stop()
                except Exception as exc:
                    return self._failed(f"{self.source.what}: stop failed ({exc})", t0)
            finally:
                self.in_window = False
        try:
            timeline = read_timeline(xspace)
        except XSpaceError as exc:
            return self._failed(f"unreadable trace ({exc})", t0)
        cost = (opened - t0) + (time.perf_counter() - stopping)
        if looks:
            span = steady_span(looks, int(self.sampling.min_window_s * 1e9))
            if span is None:
                # the loop stood still or kept compiling: not the steady loop's share (and
                # a trace without the device's programs says nothing about the machine)
                self.dropped += 1
                return cost, "dropped"
            if span != (looks[0][0], looks[-1][0]):
                self.trimmed += 1  # read over the stretch without compilation only
            start_ns, end_ns = span
        busy, why = window_busy(timeline, (start_ns, end_ns), self.platform)
        if not busy:
            self.empty += 1
            self._empty_why = why
            if self.discover_at_start or self.platform == "cpu" \
                    or self.empty >= self.sampling.empty_windows:
                # this machine's traces have no device timeline: no later window
                self.why_not, self.stopped = (why if self.empty == 1 else
                                              f"{why} (in each of {self.empty} windows)"), True
                return cost, "empty"
            # On an accelerator a trace without the device's programs is one window's
            # accident, not the machine's answer: look again (BusySampling.wait_after).
            if self.completed == 0:
                self.why_not = f"{why} (window {self.empty}; another follows)"
            return cost, "empty"
        self.completed += 1
        self.why_not = None
        self._done.append(WindowResult(busy, start_ns, end_ns, cost))
        return cost, "read"

    def _looks(self, length: float, look: bool = True) -> list[Look]:
        """Looks at the loop from the window's opening until the loop has run ``length``
        seconds steadily (the current stretch of :func:`steady_span` reaches it), a
        compilation starts, ``steady_wait_s`` more have passed, or the run closes; without
        a progress reader (or with ``look`` false) none: the window lasts ``length`` and
        is read whole.  A look that fails ends them.  (The current stretch is tested
        with :func:`steady_span`'s start rule kept one look at a time: calling it at
        every look would cost the sampler, which holds Python's lock, O(n^2).)"""
        if self.progress is None or not look:
            self._stop.wait(length)
            return []
        gap = max(length / self.sampling.looks_per_window, self.sampling.look_gap_s)
        need = int(length * 1e9)
        deadline = time.monotonic() + length + self.sampling.steady_wait_s
        out: list[Look] = []
        a = i = 0  # the current compile count's first look; its stretch's first look
        while True:
            if out and self._stop.wait(gap):
                break  # the run is closing: what was seen so far
            try:
                steps, compiles = self.progress()
            except Exception:
                break
            out.append((time.time_ns(), steps, compiles))
            k = len(out) - 1
            if k and compiles != out[k - 1][2]:
                if compiles % 2:
                    break  # a compilation began: never hold the profiler through it
                a, i = k, -1  # one ended: a stretch starts after a step after it
            elif i < 0 and steps > out[a][1]:
                i = k
            if i >= 0 and steps > out[i][1] and out[k][0] - out[i][0] >= need:
                break  # a steady stretch of the window's length
            if time.monotonic() >= deadline:
                break
        return out

    def _failed(self, why: str, t0: float) -> tuple[float, str]:
        if self.completed == 0:
            self.why_not = why
        return time.perf_counter() - t0, "failed"


def ended_unread(warmup_steps: int, empty: int, dropped: int, empty_why: str | None) -> str:
    """Why a run that ended has no window read: never taken (the loop was not steady
    long enough), or taken and not read (each kind counted)."""
    if not empty and not dropped:
        return ("the run ended before a window was taken (windows start once the loop "
                f"has run {warmup_steps} warm-up steps and steps advance without compiling)")
    parts = []
    if empty:
        parts.append(f"{empty} without the device's programs"
                     + (f" ({empty_why})" if empty_why else ""))
    if dropped:
        parts.append(f"{dropped} dropped (no stretch of it ran steps without compiling)")
    return f"the run ended before a window was read: {empty + dropped} taken, " \
        + ", ".join(parts)


# --- the monitor ---------------------------------------------------------------------------
def libtpu_duty_cycle() -> tuple[Callable[[], dict[str, float]] | None, str]:
    """A reader of libtpu's ``duty_cycle_pct`` per chip (``sys/tpu<i>_duty_cycle_pct``),
    or None and why not (not installed; no data)."""
    try:
        from libtpu.sdk import tpumonitoring  # type: ignore[import-not-found]
    except Exception:
        return None, "not installed"

    def read() -> dict[str, float]:
        values = numbers(tpumonitoring.get_metric("duty_cycle_pct").data())
        return {schema.device_metric("tpu", i, schema.DUTY_CYCLE_SUFFIX): v
                for i, v in enumerate(values)}

    try:
        first = read()
    except Exception as exc:
        return None, f"duty_cycle_pct unreadable ({type(exc).__name__}: {exc})"
    if not first:
        return None, "returned no data for duty_cycle_pct"
    return read, ""


def numbers(values: Any) -> list[float]:
    """libtpu returns one string per chip (sometimes ``"chip: value"``); the numbers."""
    out: list[float] = []
    for v in values or ():
        s = str(v).rsplit(":", 1)[-1].strip().rstrip("%")
        try:
            out.append(float(s))
        except ValueError:
            continue
    return out


@dataclass
class ChipBusyMonitor:
    """:class:`refrun.probes.base.Monitor` of chip utilisation: libtpu where it answers,
    else profiler windows; :meth:`tags` gives ``refrun.exec.utilization_source`` (and the window
    count).  The probe calls :meth:`attach` with its progress before sampling starts."""

    libtpu: Callable[[], dict[str, float]] | None = None
    libtpu_why: str = ""
    windows: ProfilerWindows | None = None
    profiler_why: str = ""
    name: str = "chip_busy"

    @classmethod
    def create(cls, sessions: SessionSource | None, platform: str, warmup_steps: int = 0,
               sampling: BusySampling | None = None) -> ChipBusyMonitor:
        """The monitor of this machine's chips.  ``sessions``: how to open a profiler
        session here (None: no profiler); ``platform``: the devices' (``cpu``: one window
        at start confirms there is no device timeline)."""
        read, why = libtpu_duty_cycle()
        if read is not None:
            return cls(libtpu=read)
        if sessions is None:
            return cls(libtpu_why=why, profiler_why="no in-memory profiler session here")
        windows = ProfilerWindows(sessions, sampling or BusySampling(), warmup_steps,
                                  discover_at_start=platform == "cpu", platform=platform)
        return cls(libtpu_why=why, windows=windows)

    def attach(self, progress: Progress) -> None:
        """Start sampling; ``progress`` tells the sampler when the loop is steady."""
        if self.windows is not None and self.windows._thread is None:
            self.windows.progress = progress
            self.windows.start()

    def sample(self) -> dict[str, float]:
        if self.libtpu is not None:
            return self.libtpu()
        out: dict[str, float] = {}
        if self.windows is not None:
            for w in self.windows.take():
                out.update(w.busy_pct)
        return out

    def source(self) -> str:
        """The ``refrun.exec.utilization_source`` text (see :mod:`refrun.schema`)."""
        if self.libtpu is not None:
            return "libtpu: duty_cycle_pct"
        libtpu = f"libtpu: {self.libtpu_why}"
        w = self.windows
        if w is not None and w.reported:
            s = w.sampling
            trimmed = (f"; {w.trimmed} of them read over their stretch without "
                       f"compilation" if w.trimmed else "")
            return (f"profiler: busy time of the device timeline's 'XLA Modules' over "
                    f"windows of {s.window_steps} steps ({s.min_window_s:g}-{s.window_s:g} "
                    f"s, every {s.min_period_s:g}-{s.max_period_s:g} s; "
                    f"{w.source.what}{trimmed}); {libtpu}")
        why = w.why_not if w is not None else self.profiler_why
        if w is not None and w.reported == 0 and w.running:
            return f"pending: {why}; {libtpu}"
        return f"{schema.UTILIZATION_UNAVAILABLE}: {libtpu}; profiler: {why}"

    def tags(self) -> dict[str, Any]:
        out: dict[str, Any] = {schema.TAG_UTILIZATION_SOURCE: self.source()}
        if self.windows is not None and self.windows.reported:
            out[schema.TAG_UTILIZATION_WINDOWS] = self.windows.reported
        return out

    def stop(self) -> None:
        """No more windows (the probe then takes a last sample)."""
        if self.windows is not None:
            self.windows.close()

    def close(self) -> None:
        self.stop()
