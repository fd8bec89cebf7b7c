"""Host reads of jax.Arrays inside the step (``xfer/host_syncs``) on real JAX (CPU): every
form counted, the probe's own reads not, no sync and no compilation added.

The expected counts are the reads each loop makes by construction; "no sync" is shown by a
step whose result is still being computed when the step exits; "no compilation" by JAX's
own compile events and the jitted function's cache size.
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import refrun
import refrun.jax
from refrun import schema
from refrun.probes import host_reads


def start(store) -> refrun.RunSession:
    return refrun.start_run("jax-host-reads", "candidate", hardware="cpu", backend="jax",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False)


def per_step(store, run_id: str, metric: str) -> list[float]:
    return [v for _, v in sorted(store.points(run_id, metric))]  # counters made dense


@jax.jit
def train_step(w, x, y):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss


X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32))
Y = jnp.asarray(np.random.default_rng(1).normal(size=16).astype(np.float32))

# Each form of host read a training step might make, with how many reads it is.
FORMS = {
    "float": lambda loss, w: float(loss),
    "int": lambda loss, w: int(loss > 0),  # the comparison is a new array: one read
    "bool": lambda loss, w: bool(loss > 0),
    "item": lambda loss, w: loss.item(),
    "tolist": lambda loss, w: w.tolist(),
    "np.asarray": lambda loss, w: np.asarray(w),
    "print": lambda loss, w: print(loss, file=io.StringIO()),
    "format": lambda loss, w: f"{loss:.3f}",
    "device_get": lambda loss, w: jax.device_get(loss),
}


def test_every_form_of_host_read_is_counted_once_per_step(store) -> None:
    run = start(store)
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step])
    names = ["none", *FORMS, "float", "twice"]
    for n, name in enumerate(names):
        with probe.step(n):
            w, loss = train_step(w, X, Y)
            probe.log(loss=loss)
            if name == "twice":
                float(loss), np.asarray(w)
            elif name != "none":
                FORMS[name](loss, w)
        float(loss)  # between steps (a progress print): not inside the step
    probe.close()
    run.close()
    expected = [0.0 if n == "none" else 2.0 if n == "twice" else 1.0 for n in names]
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS) == expected
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_JAX_HOST_READS] == \
        "counted: value reads and buffer-protocol reads"


def test_clean_jitted_step_counts_zero_and_the_probes_own_reads_are_not_counted(store) -> None:
    run = start(store)
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step])
    losses = []
    for n in range(8):
        with probe.step(n):
            w, loss = train_step(w, X, Y)
            probe.log(loss=loss, w0=w[0])  # read by the probe between steps
        losses.append(loss)
    probe.close()  # reads whatever is still pending
    run.close()
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS) == [0.0] * 8
    # the probe did read every value (so its reads ran, uncounted)
    assert per_step(store, run.run_id, "loss") == [float(v) for v in losses]


def heavy(a):
    return jax.lax.fori_loop(0, 60, lambda i, b: jnp.tanh(b @ a), a).sum()


def test_counting_adds_no_sync_and_no_compilation(store) -> None:
    heavy_jit = jax.jit(heavy)
    a = jnp.ones((500, 500), jnp.float32) / 500
    heavy_jit(a).block_until_ready()  # compiled before the run
    compiles: list[str] = []

    def on_compile(ev: str, secs: float, **kw: object) -> None:
        if ev.endswith("backend_compile_duration"):
            compiles.append(ev)

    run = start(store)
    # fresh_caches=False keeps the executable above: any compilation in the steps would be
    # the counter's (the probe's own, when it starts, are made before the loop)
    probe = refrun.jax.instrument(run, step_fns=[heavy_jit], fresh_caches=False)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        ready_at_exit, read_ready = [], []
        for n in range(4):
            with probe.step(n):
                r = heavy_jit(a)
                if n == 3:  # the defect: a host read inside the step waits for r
                    float(r)
            ready_at_exit.append(r.is_ready())
            r.block_until_ready()
            read_ready.append(r.is_ready())
        probe.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
        run.close()
    # with the counter installed the step still returns before the device is done: the
    # counter made no read and no wait (only the read in step 3 waited)
    assert ready_at_exit == [False, False, False, True]
    assert read_ready == [True] * 4
    assert compiles == [] and heavy_jit._cache_size() == 1
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS) == [0.0, 0.0, 0.0, 1.0]


def test_hooks_removed_at_close_and_off_when_asked(store) -> None:
    original = ArrayImpl.__dict__["_value"]
    count = host_reads.ReadCount()
    run = start(store)
    probe = refrun.jax.instrument(run)
    assert ArrayImpl.__dict__["_value"] is not original
    probe.close()
    assert ArrayImpl.__dict__["_value"] is original
    # after close neither path counts, even for an active sink
    prev = host_reads.activate(count)
    try:
        v = jnp.ones(3) * 2
        float(v[0]), np.asarray(v)
    finally:
        host_reads.activate(prev)
    assert count.n == 0
    probe2 = refrun.jax.instrument(run, count_host_reads=False)
    with probe2.step(0):
        float(jnp.ones(()) * 3)
    probe2.close()
    run.close()
    assert ArrayImpl.__dict__["_value"] is original
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_JAX_HOST_READS].startswith("off")
    assert store.client().get_metric_history(run.run_id, schema.M_HOST_SYNCS) == []


def test_failed_buffer_export_falls_back_and_keeps_jax_errors() -> None:
    """A deleted array: numpy falls back to ``__array__``, which raises JAX's own error."""
    host_reads.install()
    try:
        d = jnp.ones(3) * 2
        d.delete()
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(d)
    finally:
        host_reads.remove()
