"""``RunSession.log_columns``: a block of steps accepted at once has exactly the outcome of
``log_metrics`` called step by step -- the same points (values, steps, time stamps) in the
store, the same per-metric counts, refusals and warnings -- whether the block takes the
column-wise fast path or not.  A real sqlite store; the session's own delivery."""

from __future__ import annotations

import math

import pytest

import refrun

T0 = 1_700_000_000_000  # explicit time stamps, so the two runs' points can be compared


# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")


def _record(store, blocks, by_columns: bool):
    run = refrun.start_run(workload="cols", role="candidate", flush_interval_s=0.05,
                           snapshot_environment=False)
    for steps, columns in blocks:
        stamps = [T0 + 10 * s if isinstance(s, int) else T0 for s in steps]
        if by_columns:
            run.log_columns(steps, columns, stamps)
        else:
            for i, (step, ts) in enumerate(zip(steps, stamps, strict=True)):
                run.log_metrics(step, {k: c[i] for k, c in columns.items()}, ts)
    stats = {k: (v.first, v.last, v.count, v.repeated, v.backwards, v.nonfinite)
             for k, v in run.step_stats().items()}
    refused, warned = run.points_refused, sorted(w["message"] for w in run.warnings)
    assert run.close()
    client = store.client()
    points = {}
    for key in stats:
        hist = client.get_metric_history(run.run_id, key)
        points[key] = sorted((m.step, m.timestamp, m.value if not math.isnan(m.value)
                              else "nan") for m in hist)
    return stats, refused, warned, points


CASES = {
    # the fast path: increasing int steps, float values, new names, then more of them
    "floats": [([0, 1, 2], {"a": [0.5, 0.25, 0.125], "b": [1.0, 2.0, 3.0]}),
               ([5, 9], {"a": [0.1, 0.2], "b": [4.0, 5.0], "c": [7.0, 8.0]})],
    # non-finite values are recorded as is and counted once per name
    "nonfinite": [([0, 1, 2], {"a": [1.0, math.inf, math.nan]})],
    # a block that starts at a step already logged: repeated and backwards steps
    "repeat": [([0, 1, 2], {"a": [1.0, 2.0, 3.0]}), ([2, 1, 3], {"a": [4.0, 5.0, 6.0]})],
    # ints, a bool, a string and a too-large int: accepted, refused and counted as log_metrics does
    "types": [([0, 1, 2, 3], {"a": [1, True, "x", 10**400], "b": [1.0, 2.0, 3.0, 4.0]})],
    # a name MLflow refuses, beside a good one
    "bad-name": [([0, 1], {"ok": [1.0, 2.0], "bad name!": [3.0, 4.0]})],
    # steps that are not ints or out of range
    "bad-steps": [([0, -1, 1.5, 2], {"a": [1.0, 2.0, 3.0, 4.0]})],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_block_has_exactly_the_outcome_of_logging_step_by_step(store, case: str) -> None:
    by_steps = _record(store, CASES[case], by_columns=False)
    by_columns = _record(store, CASES[case], by_columns=True)
    assert by_columns == by_steps
    _, _, _, points = by_columns
    assert points and all(points.values())  # something was recorded, so compared


def test_a_column_of_another_length_is_refused_by_name(store) -> None:
    run = refrun.start_run(workload="cols", role="candidate", snapshot_environment=False)
    run.log_columns([0, 1, 2], {"a": [1.0, 2.0, 3.0], "short": [1.0, 2.0]})
    assert run.points_refused == 2
    assert any("metric 'short': 2 values for 3 steps" in w["message"] for w in run.warnings)
    assert run.close()
    client = store.client()
    assert [m.value for m in client.get_metric_history(run.run_id, "a")] == [1.0, 2.0, 3.0]
    assert client.get_metric_history(run.run_id, "short") == []


def test_a_queued_block_is_written_as_the_lines_of_its_points_in_row_order(tmp_path) -> None:
    """A block queued as one object (:class:`PointBlock`) is spooled as exactly the lines
    point-by-point logging writes, row by row, between single points, and the writer's
    count of queued points counts its points (the queue's memory bound)."""
    import os
    import time

    from refrun.recording.spool import PointBlock, Spool, SpoolMeta, read_points_file
    from refrun.recording.writer import SpoolWriter

    spool = Spool.create(tmp_path / "spool", SpoolMeta(
        local_id="20260101T000000-abc", tracking_uri="sqlite:///x.db", experiment="w",
        start_ms=int(time.time() * 1000)))
    writer = SpoolWriter(spool, flush_interval_s=60, max_queue=100,
                         on_warning=lambda *a: None, deliver_inline=False)
    writer.queue.append(("x", 0, T0, 0.5))
    writer.put_block(PointBlock(["a", "b"], [1, 2, 3], [T0 + 1, T0 + 2, T0 + 3],
                                [[0.1, 0.2, math.nan], [1.0, 2.0, 3.0]]))
    writer.queue.append(("x", 4, T0 + 4, -0.0))
    assert writer.queued_points() == 8
    fd = spool.open_points()
    try:
        writer._spool_queued(fd)
    finally:
        os.close(fd)
    assert writer.queued_points() == 0 and writer.points_spooled == 8
    # what each point logged on its own writes, in that order
    expected = [("x", 0, T0, 0.5)]
    for i, (step, ts) in enumerate(zip([1, 2, 3], [T0 + 1, T0 + 2, T0 + 3], strict=True)):
        expected += [("a", step, ts, [0.1, 0.2, math.nan][i]), ("b", step, ts, float(i + 1))]
    expected.append(("x", 4, T0 + 4, -0.0))
    lines = spool.points_path.read_text().splitlines()
    assert lines == [f"{k}\t{s}\t{t}\t{v!r}" for k, s, t, v in expected]
    got = read_points_file(spool.points_path)
    assert len(got) == 8 and math.copysign(1.0, got["value"].iloc[-1]) == -1.0


def test_a_block_formats_as_its_points_one_line_each_for_any_floats() -> None:
    """The writer's column-wise formatting of a block is the per-point line format,
    ``key\\tstep\\tstamp\\trepr(value)``, for floats of every kind (random bits, nan,
    +-inf, -0.0, subnormals); an empty block writes nothing; columns of the wrong length
    are refused, not truncated."""
    import struct

    import numpy as np

    from refrun.recording.spool import PointBlock, format_points

    rng = np.random.default_rng(3)
    n = 257
    bits = rng.integers(0, 2**63, size=3 * n, dtype=np.int64)
    weird = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.0]
    vals = [struct.unpack("<d", struct.pack("<q", int(b)))[0] for b in bits] + weird
    keys = ["loss", "grad_norm/w", "perf/step_time_s"]
    steps = list(range(10, 10 + len(vals) // 3))
    stamps = [T0 + 7 * i for i in range(len(steps))]
    cols = [vals[j::3][:len(steps)] for j in range(3)]
    block = PointBlock(keys, steps, stamps, cols)
    expected = "".join(f"{k}\t{s}\t{t}\t{v!r}\n" for k, s, t, v in block.points())
    assert format_points([("x", 1, T0, 2.5), block]).decode() == f"x\t1\t{T0}\t2.5\n" + expected
    assert format_points([PointBlock(keys, [], [], [[], [], []])]) == b""
    with pytest.raises(ValueError, match="one value per step"):
        format_points([PointBlock(keys, steps, stamps, [c[:-1] for c in cols])])
