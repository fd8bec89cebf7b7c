"""Chip utilisation from the device's own timeline (issue 51, item 3).

* refrun's own XSpace reader, on real TPU v5e traces (tests/fixtures/tpu/), gives the same
  ``XLA Modules`` events as JAX's ``ProfileData`` (the independent reading), and the busy
  fraction of the known matmul loads (~100 % dense, 17.7 % with sleeps between) equals the
  one computed here from ``ProfileData``'s events;
* on the CPU a real device-only profiler window finds no device plane, and a JAX run's
  ``refrun.exec.utilization_source`` says so (``unavailable: ...``), with no utilisation metric;
* windows are taken only once the loop is steady, never while the user's own trace runs,
  and never break it.
"""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src import monitoring as jax_monitoring  # no public unregister
from jax.profiler import ProfileData

import refrun
import refrun.jax
from refrun import schema
from refrun.errors import RefrunInputError
from refrun.probes.chip_busy import (
    BusySampling,
    ChipBusyMonitor,
    ProfilerWindows,
    jax_sessions,
    steady_span,
    window_busy,
)
from refrun.probes.xspace import XSpaceError, busy_fraction, read_timeline

FIXTURES = Path(__file__).parent / "fixtures" / "tpu"


def xspace(name: str) -> bytes:
    return gzip.decompress((FIXTURES / f"{name}.xspace.pb.gz").read_bytes())


def profile_data_modules(raw: bytes) -> tuple[int, list[tuple[float, float]]]:
    """JAX's own reading: the session start and ``XLA Modules`` events of TPU 0."""
    pd = ProfileData.from_serialized_xspace(raw)
    start = dict(pd.find_plane_with_name("Task Environment").stats)["profile_start_time"]
    plane = pd.find_plane_with_name("/device:TPU:0")
    # (ProfileData gives float nanoseconds of whole values: kept exact as ints)
    events = [(int(e.start_ns), int(e.start_ns + e.duration_ns)) for line in plane.lines
              if line.name == "XLA Modules" for e in line.events]
    return start, events


@pytest.mark.parametrize(("name", "expected"), [("mm_dense", 0.9987), ("mm_sparse", 0.177)])
def test_busy_fraction_of_known_matmul_loads_on_a_real_tpu_trace(name: str,
                                                                 expected: float) -> None:
    raw = xspace(name)
    tl = read_timeline(raw)
    start, events = profile_data_modules(raw)
    assert tl.start_ns == start
    (dev,) = tl.devices
    assert (dev.platform, dev.index, dev.plane) == ("tpu", 0, "/device:TPU:0")
    # the same 20 programs, to the nanosecond, on the session's clock
    assert len(events) == 20
    assert [(s - start, e - start) for s, e in dev.modules] == events
    # busy over the span of the 20 programs, computed here from ProfileData's events
    # (one program at a time on the chip: the sum of durations over the span)
    span = (min(s for s, _ in events), max(e for _, e in events))
    want = sum(e - s for s, e in events) / (span[1] - span[0])
    window = (span[0] + start, span[1] + start)
    assert busy_fraction(dev.modules, window) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(expected, abs=0.001)  # the recorded loads: ~100 %, 17.7 %
    # a window over the first half of the span: each event clipped to it
    half = (span[0], (span[0] + span[1]) // 2)
    clipped = sum(max(0.0, min(e, half[1]) - max(s, half[0])) for s, e in events)
    assert busy_fraction(dev.modules, (half[0] + start, half[1] + start)) == pytest.approx(
        clipped / (half[1] - half[0]), rel=1e-12)
    # the metric the monitor records for that window
    busy, why = window_busy(tl, window)
    assert busy == {"sys/tpu0_duty_cycle_pct": pytest.approx(100 * want)} and why == ""


def test_busy_fraction_counts_overlaps_once_and_clips_to_the_window() -> None:
    # [0,4) and [2,6) overlap on [2,4): their union is [0,6); [8,12) is clipped at 10
    assert busy_fraction([(2, 6), (0, 4), (8, 12)], (0, 10)) == pytest.approx(8 / 10)
    assert busy_fraction([(0, 3)], (5, 10)) == 0.0
    assert busy_fraction([], (0, 1)) == 0.0
    assert busy_fraction([(-5, 50)], (0, 10)) == 1.0
    with pytest.raises(ValueError, match="empty"):
        busy_fraction([(0, 1)], (3, 3))


def test_a_truncated_trace_is_an_error_not_a_value() -> None:
    raw = xspace("mm_dense")
    with pytest.raises(XSpaceError):
        read_timeline(raw[: len(raw) // 2])


def test_the_reader_is_cheaper_than_profile_data_on_a_large_trace() -> None:
    """Not a speed target, a property: lines the reader does not need are jumped over,
    so reading the 20 modules of a trace does not grow with its other lines' events."""
    raw = xspace("mm_sparse")
    tl = read_timeline(raw)
    assert len(tl.devices[0].modules) == 20
    assert tl.planes[-1] == "Task Environment" and "/host:CPU" in tl.planes


def test_sampling_options_are_validated() -> None:
    for bad, match in (({"window_s": 0}, "window_s"), ({"budget": 1.5}, "budget"),
                       ({"min_period_s": 50, "max_period_s": 10}, "min_period_s"),
                       ({"window_s": 20.0}, "shorter")):
        with pytest.raises(RefrunInputError, match=match):
            BusySampling(**bad)
    with pytest.raises(RefrunInputError, match="window_steps"):
        BusySampling(window_steps=0)
    with pytest.raises(RefrunInputError, match="looks_per_window"):
        BusySampling(looks_per_window=0)
    with pytest.raises(RefrunInputError, match="min_window_s"):
        BusySampling(min_window_s=0.5, window_s=0.2)
    s = BusySampling(budget=0.002, min_period_s=10, max_period_s=300)
    # a window spans 50 steps, within [10 ms, 0.2 s]
    assert s.window_for(0.001) == pytest.approx(0.05)
    assert s.window_for(1e-5) == 0.01 and s.window_for(0.5) == 0.2
    assert s.window_for(None) == 0.2
    assert s.period_s(0.001) == 10  # cheap windows: the least period
    assert s.period_s(0.1) == pytest.approx(50)  # 0.1 s of profiler calls per 50 s
    assert s.period_s(5.0) == 300  # dear windows: the longest period


def looks_every_ms(steps: list[int], compiles: list[int]) -> list[tuple[int, int, int]]:
    """Looks one millisecond apart (time in ns) with the given step and compile counts."""
    return [(k * 1_000_000, s, c) for k, (s, c) in enumerate(zip(steps, compiles,
                                                                  strict=True))]


def test_a_window_in_which_the_loop_compiled_is_read_over_its_steady_stretch() -> None:
    """On a TPU v5e one run in 26 lost its only window because its evaluation compiled
    during it.  The window is read over its longest stretch that ran steps and compiled
    nothing, bounded by steps that completed around the compilation (whether the count
    moves at a compilation's start or end)."""
    # a step per look; the count moves between looks 10 and 11
    steps = list(range(21))
    comp = [0] * 11 + [1] * 10
    # before it: the last step seen before the move completed in (t9, t10], so the
    # compilation had not begun at t9: [0, 9] ms (9 ms); after it: the first step above
    # look 11's completes at look 12: [12, 20] ms (8 ms).  The longer one is read.
    assert steady_span(looks_every_ms(steps, comp), 0) == (0, 9_000_000)
    # the same with the move earlier: the stretch after it is the longer
    comp = [0] * 5 + [1] * 16
    assert steady_span(looks_every_ms(steps, comp), 0) == (6_000_000, 20_000_000)
    # nothing compiled: the whole window
    assert steady_span(looks_every_ms(steps, [3] * 21), 0) == (0, 20_000_000)
    # an evaluation: the loop stands still at step 10 while it compiles (looks 10-14),
    # the count moves between looks 12 and 13; steps resume at look 15
    steps = list(range(11)) + [10] * 4 + list(range(11, 17))
    comp = [0] * 13 + [1] * 8
    # before: last advance at look 10 (9 -> 10): ends at look 9 = 9 ms; after: the first
    # look above look 13's 10 steps is look 15: [15, 20] = 5 ms
    assert steady_span(looks_every_ms(steps, comp), 0) == (0, 9_000_000)
    # the least length and steps are kept
    assert steady_span(looks_every_ms(steps, comp), 9_500_000) is None
    assert steady_span(looks_every_ms(list(range(21)), [0] * 21), 0, min_steps=21) is None
    # a loop that stood still, or compiled at every look, has no steady stretch
    assert steady_span(looks_every_ms([5] * 21, [0] * 21), 0) is None
    assert steady_span(looks_every_ms(list(range(21)), list(range(21))), 0) is None
    assert steady_span([], 0) is None and steady_span([(0, 1, 0)], 0) is None


def test_a_steady_stretch_of_a_real_tpu_trace_is_read_as_its_programs_say() -> None:
    """The busy share over a stretch is computed over that stretch only: on the sparse
    matmul load (programs with sleeps between), a stretch cut by steady_span from looks on
    the trace's clock reads what ProfileData's events say about that stretch."""
    raw = xspace("mm_sparse")
    tl = read_timeline(raw)
    start, events = profile_data_modules(raw)
    t0, t1 = events[0][0] + start, events[-1][1] + start
    # looks every 1/40 of the span, a step at each, a compilation between looks 25 and 26
    gap = (t1 - t0) // 40
    looks = [(t0 + k * gap, k, int(k > 25)) for k in range(41)]
    span = steady_span(looks, 0)
    assert span == (t0, t0 + 24 * gap)
    covered = sum(max(0, min(e + start, span[1]) - max(s + start, span[0]))
                  for s, e in events)
    busy, why = window_busy(tl, span)
    assert why == "" and busy == {
        "sys/tpu0_duty_cycle_pct": pytest.approx(100 * covered / (span[1] - span[0]),
                                                 rel=1e-12)}


def cpu_sessions():
    src = jax_sessions()
    assert src is not None
    return src


def test_a_real_window_on_the_cpu_finds_no_device_plane() -> None:
    w = ProfilerWindows(cpu_sessions(), BusySampling(), discover_at_start=True,
                        platform="cpu")
    w.start()
    w._thread.join(timeout=30)  # one window, then it stops: nothing to read on the CPU
    assert not w._thread.is_alive() and w.stopped and w.completed == 0
    assert w.why_not.startswith("no device plane in the trace (cpu devices; planes: ")
    assert "/host:CPU" in w.why_not
    assert w.take() == []


def test_on_an_accelerator_one_window_without_the_device_is_not_the_answer() -> None:
    """On a TPU v5e about half the runs' first window held no device plane, and that one
    window left the whole run without a busy fraction.  A window without the device's
    programs on an accelerator is looked at again (``empty_windows`` times in all), not
    taken as the machine's answer; the CPU's real traces (no device plane) stand in for
    such windows here, with the platform named as an accelerator's."""
    steps = {"n": 0}
    sampling = BusySampling(min_period_s=0.2, window_s=0.05, min_window_s=0.01,
                            steady_poll_s=0.01, empty_windows=3)
    w = ProfilerWindows(cpu_sessions(), sampling, progress=lambda: (steps["n"], 0),
                        platform="tpu")
    w.start()
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 60
        while not w.stopped and time.monotonic() < deadline:
            steps["n"] += 1  # a loop that keeps stepping
            seen.add(w.why_not or "")
            time.sleep(0.002)
        assert w.stopped, w.why_not
    finally:
        w.close()
    assert w.empty == 3 and w.completed == 0 and w.take() == []
    assert w.why_not.startswith("no device plane in the trace (tpu devices; planes: ")
    assert w.why_not.endswith("(in each of 3 windows)")
    # while it looked again, it said so
    assert any(x.endswith("(window 1; another follows)") for x in seen)
    with pytest.raises(RefrunInputError, match="empty_windows"):
        BusySampling(empty_windows=0)


def test_before_the_first_reading_a_window_not_read_is_retried_soon() -> None:
    """A run of a few seconds on a TPU v5e had no reading when the try after an empty or
    dropped window waited ``min_period_s`` (11 of 23 runs): until one window is read the
    next try follows after ``retry_s``, for ``quick_retries`` tries; a read window, or a
    loop that keeps compiling, falls back to the budget's period."""
    s = BusySampling(retry_s=0.5, quick_retries=4, min_period_s=10, max_period_s=300,
                     budget=0.002)
    for outcome in ("empty", "dropped"):
        assert s.wait_after(outcome, 1.5, read=0, tries=1) == 0.5
        assert s.wait_after(outcome, 1.5, read=0, tries=4) == 0.5
        assert s.wait_after(outcome, 1.5, read=0, tries=5) == 300  # 1.5 / 0.002 = 750
        assert s.wait_after(outcome, 0.001, read=1, tries=2) == 10  # after a reading
    assert s.wait_after("read", 0.1, read=1, tries=1) == 50
    assert s.wait_after("failed", 0.1, read=0, tries=1) == 50
    for bad in ({"retry_s": 0}, {"quick_retries": 0}, {"quick_retries": 1.5}):
        with pytest.raises(RefrunInputError, match=next(iter(bad))):
            BusySampling(**bad)


def test_a_run_that_ended_unread_says_what_its_windows_found() -> None:
    steps = {"n": 0}
    w = ProfilerWindows(cpu_sessions(), BusySampling(retry_s=30, window_s=0.05,
                                                     min_window_s=0.01, steady_poll_s=0.01),
                        progress=lambda: (steps["n"], 0), platform="tpu")
    w.start()
    deadline = time.monotonic() + 30
    while w.tries == 0 and time.monotonic() < deadline:
        steps["n"] += 1
        time.sleep(0.002)
    w.close()  # the run ends during the wait before the second try
    w.close()  # (the monitor's stop and the run's close both close it)
    assert w.tries == 1 and w.empty == 1 and w.completed == 0
    assert w.why_not.startswith("the run ended before a window was read: 1 taken, "
                                "1 without the device's programs (no device plane in the "
                                "trace (tpu devices; planes: "), w.why_not
    assert w.why_not.count("the run ended") == 1 and w.why_not.endswith("))"), w.why_not


def test_windows_wait_for_a_steady_loop() -> None:
    """No window while the loop has not run its warm-up steps or stands still; one as
    soon as steps advance without compiling (here: a real loop on the CPU)."""
    steps = {"n": 0, "compiles": 0}
    w = ProfilerWindows(cpu_sessions(), BusySampling(steady_poll_s=0.05), warmup_steps=5,
                        progress=lambda: (steps["n"], steps["compiles"]), platform="cpu")
    f = jax.jit(lambda x: x * 2.0)
    x = jnp.ones(3)
    w.start()
    try:
        deadline = time.monotonic() + 30
        while w.looks < 6 and time.monotonic() < deadline:  # standing still at step 0
            time.sleep(0.01)
        assert w.looks >= 6 and w.tries == 0, (w.looks, w.tries)  # looked; not steady
        assert w.why_not.startswith("no window yet") and not w.stopped
        deadline = time.monotonic() + 30
        while not w.stopped and time.monotonic() < deadline:
            x = f(x)
            steps["n"] += 1
            time.sleep(0.001)
        assert w.stopped, "no window was taken in a steady loop"
        assert steps["n"] > 5
        assert w.why_not.startswith("no device plane")
    finally:
        w.close()


def test_the_users_own_trace_is_never_disturbed(tmp_path: Path) -> None:
    jax.profiler.start_trace(str(tmp_path / "trace"))
    try:
        w = ProfilerWindows(cpu_sessions(), BusySampling(min_period_s=0.5, window_s=0.1),
                            discover_at_start=True, platform="cpu")
        w.start()
        deadline = time.monotonic() + 10
        while w.why_not != "the user's own profiler trace was running":
            assert time.monotonic() < deadline, w.why_not
            time.sleep(0.01)
        w.close()
    finally:
        jax.profiler.stop_trace()  # the user's trace ends normally and is written
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))
    # and a user trace started during a window waits for it, then runs
    w = ProfilerWindows(cpu_sessions(), BusySampling(window_s=0.3, min_window_s=0.3),
                        discover_at_start=True, platform="cpu")
    w.start()
    deadline = time.monotonic() + 30
    while not w.in_window and time.monotonic() < deadline:  # the window has begun
        time.sleep(0.001)
    assert w.in_window
    done = threading.Event()
    during: list[bool] = []

    def user() -> None:
        jax.profiler.start_trace(str(tmp_path / "trace2"))
        during.append(w.in_window)  # the user's trace began only once the window ended
        jax.profiler.stop_trace()
        done.set()

    t = threading.Thread(target=user)
    t.start()
    t.join(timeout=30)
    w.close()
    assert done.is_set() and list((tmp_path / "trace2").rglob("*.xplane.pb"))
    assert during == [False]


def test_a_cpu_run_says_why_it_has_no_chip_utilisation(store) -> None:
    run = refrun.start_run("chip-busy", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False)
    f = jax.jit(lambda x: x * 0.5 + 1.0)
    x = jnp.ones(3)
    probe = refrun.jax.instrument(run, step_fns=[f], sample_interval_s=0.05)
    mon = next(m for m in probe.monitors if isinstance(m, ChipBusyMonitor))
    for n in range(20):
        with probe.step(n):
            x = f(x)
            probe.log(loss=x[0])
    mon.windows._thread.join(timeout=30)  # the discovery window at start
    probe.close()
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    source = tags[schema.TAG_UTILIZATION_SOURCE]
    assert source.startswith("unavailable: libtpu: "), source
    assert "; profiler: no device plane in the trace (cpu devices; planes:" in source
    assert schema.TAG_UTILIZATION_WINDOWS not in tags
    metrics = store.client().get_run(run.run_id).data.metrics
    assert not [k for k in metrics if k.endswith(schema.DUTY_CYCLE_SUFFIX)], sorted(metrics)
    assert any(k.startswith(schema.SYS_PREFIX) for k in metrics)  # psutil sampled


def test_the_loop_is_not_steady_while_anything_compiles(store) -> None:
    """On a TPU v5e the sampler's first window opened, in 11 of 26 runs, as the loop
    began compiling its evaluation: the steadiness it read counted the step function's
    compilations only.  The JAX probe's progress now moves at the start and the end of
    every compilation (an evaluation's between steps included), and stays put while
    compiled functions run."""
    run = refrun.start_run("chip-busy", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False)
    f = jax.jit(lambda x: x * 0.5 + 1.0)
    x = jnp.ones(3)
    probe = refrun.jax.instrument(run, step_fns=[f], chip_busy=False)
    try:
        for n in range(3):
            with probe.step(n):
                x = f(x)
        steps, before = probe.progress_marker()
        evaluate = jax.jit(lambda x: (x * x).sum())  # an evaluation, compiled between steps
        during: list[int] = []

        def seen(event: str, value: float, **kw: object) -> None:
            during.append(probe.progress_marker()[1])  # after the probe's own listener

        jax.monitoring.register_scalar_listener(seen)
        try:
            evaluate(x).block_until_ready()
        finally:
            jax_monitoring.unregister_scalar_listener(seen)
        _, after = probe.progress_marker()
        # one compilation: its start moved the count while it compiled, its end again
        assert steps == 3 and after == before + 2, (before, during, after)
        assert before + 1 in during, (before, during, after)
        # compiled functions running: the count stays
        for n in range(3, 6):
            with probe.step(n):
                x = f(x)
            evaluate(x).block_until_ready()
        assert probe.progress_marker() == (6, after)
        assert probe.backend.compiles.graphs == 1  # the step's own count is unchanged
    finally:
        probe.close()
        run.close()


def test_a_window_waits_for_a_still_loop_ends_when_it_compiles_and_is_not_empty_then() -> None:
    """A window that opens as the loop stands still (an evaluation running) stays open
    until the loop has run the window's length, within ``steady_wait_s``; one in which a
    compilation starts ends at once (the profiler is never held through a compilation)
    and another is taken once the loop is steady again; a window in which the loop never
    ran is dropped, not taken for a machine without a device timeline.  (The CPU's real
    traces, which have no device plane, stand in for the TPU's: so a window that saw the
    loop run is counted empty.)"""
    state = {"n": 0, "c": 0}
    # a long wait, so that the window outlasts the loop's 0.5 s stand-still below however
    # late this thread runs on a busy machine
    sampling = BusySampling(window_s=0.05, min_window_s=0.01, steady_poll_s=0.01,
                            steady_wait_s=5.0, min_period_s=10, retry_s=0.1)
    w = ProfilerWindows(cpu_sessions(), sampling, progress=lambda: (state["n"], state["c"]),
                        platform="tpu")

    def until(done: object, step: bool) -> None:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:  # type: ignore[operator]
            state["n"] += step
            time.sleep(0.002)
        assert done()  # type: ignore[operator]

    w.start()
    try:
        until(lambda: w.in_window, step=True)
        still_until = time.monotonic() + 0.5  # the loop stands still for 10 windows' length
        while time.monotonic() < still_until:
            assert w.in_window and w.tries == 0  # the window stays open
            time.sleep(0.01)
        until(lambda: w.tries == 1, step=True)  # it runs again: the window ends after 0.05 s
        assert (w.empty, w.dropped) == (1, 0)
        # the next window: a compilation starts in it, and it ends while that one lasts
        until(lambda: w.in_window, step=True)
        state["c"] += 1
        until(lambda: w.tries == 2, step=False)
        assert (w.empty, w.dropped) == (1, 1) and not w.in_window
        state["c"] += 1  # compiled: the loop runs on, and is sampled again
        until(lambda: w.tries == 3, step=True)
        assert (w.empty, w.dropped) == (2, 1)
        # a window in which the loop never runs: dropped once steady_wait_s has passed
        until(lambda: w.in_window, step=True)
        t0 = time.monotonic()
        until(lambda: w.tries == 4, step=False)
        assert time.monotonic() - t0 >= 2.5  # it waited, far beyond its 0.05 s length
        assert (w.empty, w.dropped) == (2, 2)
    finally:
        w.close()
    assert w.completed == 0 and w.why_not.startswith("the run ended before a window was "
                                                     "read: 4 taken, 2 without the "), w.why_not
    assert "2 dropped (no stretch of it ran steps without compiling)" in w.why_not


def test_chip_busy_off_and_bad_values(store) -> None:
    run = refrun.start_run("chip-busy", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False)
    with pytest.raises(RefrunInputError, match="chip_busy"):
        refrun.jax.instrument(run, chip_busy="yes")
    probe = refrun.jax.instrument(run, chip_busy=False)
    assert not [m for m in probe.monitors if isinstance(m, ChipBusyMonitor)]
    probe.close()
    run.close()
    assert schema.TAG_UTILIZATION_SOURCE not in store.client().get_run(run.run_id).data.tags
