"""A step's scalars written on the device and read by the probe a buffer at a time
(:mod:`refrun.probes.jax_buffer`, issue 51), on real JAX (CPU) into a real sqlite store:

* the recorded values are the step's own values (read independently by the test after
  the loop, and recomputed in NumPy), at their steps, across buffers handed over when
  full (the next one made by the collector) and the one in use at close; the step
  compiles once (JAX's own cache and refrun's
  counter) and reads nothing from the host inside the step (refrun's host-read counter);
* a buffer held longer than the flush interval is handed over before it is full;
* a buffer whose rows do not match the steps counted (``record`` twice in a step) is
  counted in ``refrun.dropped`` and recorded nowhere;
* bad names are refused when the buffer is made, and ``record`` with other names fails
  when the step is traced; ``log_buffer`` of something else, or outside a step, is
  counted as refused, not raised into the loop;
* a second buffer made while one is in use keeps the first one's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import refrun
import refrun.jax
from refrun import schema
from refrun.errors import RefrunInputError

pytestmark = pytest.mark.usefixtures("deliver_in_process")


def _run(store, name: str, **kw):
    return refrun.start_run(name, "candidate", hardware="cpu", backend="jax",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False, **kw)


@functools.partial(jax.jit, donate_argnames=("buf",))
def _step(w, x, buf):
    def loss_fn(w):
        return jnp.mean((w * x - 1.0) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss, buf.record(loss=loss, grad_norm=jnp.sqrt(jnp.sum(g * g)))


def _data(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.random(4, dtype=np.float32) for _ in range(n)]


def test_buffered_values_are_the_steps_own_at_their_steps_compiled_once_no_host_read(
        store) -> None:
    run = _run(store, "jax-buffer")
    probe = refrun.jax.instrument(run, step_fns=[_step], monitors=None)
    buf = probe.metrics_buffer("loss", "grad_norm", capacity=16)
    w = jnp.ones(4, jnp.float32)
    losses, ws = [], []
    steps = list(range(100, 150))  # 3 full buffers and 2 rows in the one at close
    for n, x in zip(steps, _data(50), strict=True):
        ws.append(w)
        with probe.step(n):
            w, loss, buf = _step(w, x, buf)
            buf = probe.log_buffer(buf)
        losses.append(loss)
        if n == 120:  # a collection now: it reads the first buffer and makes a spare,
            probe.flush()  # which the next hand-over passes to the step
            spare = probe._buf_spare
            assert spare is not None
        if n == 131:
            assert buf is spare and probe._buf_spare is None
    probe.close()
    run.close()

    want_loss = [float(v) for v in losses]  # read by the test, after the loop
    # The gradient norm recomputed in NumPy (float64) from each step's inputs.
    want_norm = [float(np.linalg.norm(2 * (np.asarray(wi) * x - 1) * x / 4))
                 for wi, x in zip(ws, _data(50), strict=True)]
    got_loss = store.points(run.run_id, "loss")
    got_norm = store.points(run.run_id, "grad_norm")
    assert [s for s, _ in got_loss] == steps and [s for s, _ in got_norm] == steps
    assert [v for _, v in got_loss] == want_loss  # float32 values, kept exactly
    assert np.allclose([v for _, v in got_norm], want_norm, rtol=1e-5)
    assert _step._cache_size() == 1  # JAX's own: the fresh buffers did not recompile
    # one device array a step takes and returns (each costs a TPU host's dispatch)
    assert len(jax.tree_util.tree_leaves(buf)) == 1
    metrics = store.client().get_run(run.run_id).data.metrics
    assert metrics[schema.M_COMPILE_RECOMPILES] == 0.0
    assert metrics[schema.M_HOST_SYNCS] == 0.0
    tags = store.client().get_run(run.run_id).data.tags
    assert int(tags.get(schema.TAG_DROPPED, "0")) == 0


def test_a_buffer_held_for_a_flush_interval_is_handed_over_before_it_is_full(store) -> None:
    run = _run(store, "jax-buffer-time", flush_interval_s=0.05)
    probe = refrun.jax.instrument(run, step_fns=[_step], monitors=None)
    buf = probe.metrics_buffer("loss", "grad_norm", capacity=100_000)
    w, n = jnp.ones(4, jnp.float32), 0
    x = _data(1)[0]
    # Step until the probe handed a buffer to its collector (a condition, not a sleep):
    # it does so at the first step that starts a flush interval after the buffer's first
    # row.
    while probe._buf_steps or n == 0:
        with probe.step(n):
            w, _, buf = _step(w, x, buf)
            buf = probe.log_buffer(buf)
        n += 1
        assert n < 1_000_000
    handed = n  # however slow the steps (a busy machine): before the buffer was full
    assert 1 <= handed < 100_000
    probe.close()
    run.close()
    assert [s for s, _ in store.points(run.run_id, "loss")] == list(range(handed))


def test_a_buffer_whose_rows_differ_from_its_steps_is_dropped_not_misrecorded(store) -> None:
    @functools.partial(jax.jit, donate_argnames=("buf",))
    def twice(w, buf):
        loss = jnp.sum(w)
        return w + 1.0, buf.record(loss=loss).record(loss=loss + 1.0)

    run = _run(store, "jax-buffer-bad")
    probe = refrun.jax.instrument(run, step_fns=[twice], monitors=None)
    buf = probe.metrics_buffer("loss", capacity=8)
    w = jnp.zeros(2, jnp.float32)
    for n in range(4):  # 8 rows for 4 steps: the count says so
        with probe.step(n):
            w, buf = twice(w, buf)
            buf = probe.log_buffer(buf)
    probe.close()
    run.close()
    assert store.points(run.run_id, "loss", allow_gaps=True) == []
    tags = store.client().get_run(run.run_id).data.tags
    assert int(tags[schema.TAG_DROPPED]) == 4
    warnings = store.artifact_text(run.run_id, schema.ARTIFACT_WARNINGS)
    assert "a metrics buffer held 8 rows for 4 steps" in warnings


def test_bad_buffer_names_are_refused_when_made_and_when_traced(store) -> None:
    run = _run(store, "jax-buffer-names")
    probe = refrun.jax.instrument(run, monitors=None)
    for names, capacity in (((), 4), (("loss", "loss"), 4), (("loss", "bad//name"), 4),
                            (("loss",), 0), (("loss",), 2**24)):
        with pytest.raises(RefrunInputError, match=r"probe\.metrics_buffer"):
            probe.metrics_buffer(*names, capacity=capacity)
    # a dtype that cannot count its rows exactly past 256 (or is no dtype) is refused
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32, "no-such-type"):
        with pytest.raises(RefrunInputError, match="float32 or float64"):
            probe.metrics_buffer("loss", capacity=4, dtype=dtype)
    buf = probe.metrics_buffer("loss", capacity=4)
    with pytest.raises(ValueError, match="differ from the buffer's"):
        jax.jit(lambda b: b.record(los=jnp.float32(1)))(buf)
    # Before any step, or not a buffer: refused and counted, never raised into the loop.
    assert probe.log_buffer(buf) is buf
    with probe.step(0):
        assert probe.log_buffer({"loss": 1.0}) == {"loss": 1.0}
    probe.close()
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert int(tags[schema.TAG_REFUSED]) == 2


def test_a_new_buffer_keeps_the_rows_of_the_one_in_use(store) -> None:
    run = _run(store, "jax-buffer-two")
    probe = refrun.jax.instrument(run, step_fns=[_step], monitors=None)
    w = jnp.ones(4, jnp.float32)
    got = []
    for names in (("loss", "grad_norm"), ("loss", "grad_norm")):
        buf = probe.metrics_buffer(*names, capacity=64)
        for x in _data(5):
            n = len(got)
            with probe.step(n):
                w, loss, buf = _step(w, x, buf)
                buf = probe.log_buffer(buf)
            got.append(loss)
    probe.close()
    run.close()
    assert store.points(run.run_id, "loss") == [(i, float(v)) for i, v in enumerate(got)]


@pytest.mark.parametrize("path", ["log", "buffer"])
def test_a_non_finite_loss_warns_once_at_its_step_by_either_path(store, path: str) -> None:
    """The first non-finite loss of the run warns once, naming its step, whether it was
    logged with ``probe.log`` or written into a metrics buffer."""
    run = _run(store, f"jax-nonfinite-{path}")
    probe = refrun.jax.instrument(run, monitors=None)
    step = jax.jit(lambda k: (jnp.log(4.0 - k), jnp.sqrt(k)))  # nan from k = 5 on
    buf = probe.metrics_buffer("loss", "other", capacity=4) if path == "buffer" else None
    record = jax.jit(lambda b, loss, other: b.record(loss=loss, other=other))
    for n in range(8):
        with probe.step(n):
            loss, other = step(jnp.float32(n))
            if buf is None:
                probe.log(loss=loss, other=other)
            else:
                buf = probe.log_buffer(record(buf, loss, other))
    probe.close()
    run.close()
    text = store.artifact_text(run.run_id, schema.ARTIFACT_WARNINGS)
    assert text.count("loss is ") == 1 and "loss is -inf at step 4" in text


def test_a_buffer_read_with_more_steps_than_rows_is_refused_not_truncated() -> None:
    """``log_buffer`` hands a buffer over at its capacity; a direct reader given more steps
    than rows (the overflow written into the count's row) gets a refusal, never the rows
    that were kept as if they were all."""
    from refrun.probes.jax_buffer import FullBuffer, empty_buffer, read_buffer

    buf = empty_buffer(("loss",), 3)
    step = jax.jit(lambda b, v: b.record(loss=v))
    for v in range(5):
        buf = step(buf, jnp.float32(v))
    got = read_buffer(FullBuffer(buf, [0, 1, 2, 3, 4]))  # count 5, 5 steps, 3 rows
    assert got.steps == [] and got.columns == {}
    assert got.refused is not None and "more steps than its 3 rows" in got.refused
    ok = read_buffer(FullBuffer(step(empty_buffer(("loss",), 3), jnp.float32(7)), [9]))
    assert ok.refused is None and ok.steps == [9] and ok.columns == {"loss": [7.0]}
