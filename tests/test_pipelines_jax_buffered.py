"""The pipelines' JAX steps recording through a metrics buffer (``pipelines.jax_buffered``),
on real JAX (CPU, a one-device mesh as the ports use) into a real sqlite store:

* the buffer's metric names are those ``probe.log(loss=..., grad_norm=norms)`` gives the
  same outputs (``loss``, ``grad_norm/<key>``), found without running the step;
* the buffered step returns the step's own state bit for bit, and what the run records at
  every step is the step's own loss and norms, as the unbuffered step computes them
  (read by the test from a second, unbuffered chain started from the same state);
* the step compiles once and reads nothing from the host (refrun's counters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import refrun
import refrun.jax
from pipelines.jax_buffered import buffered_step, metric_names
from refrun import schema

pytestmark = pytest.mark.usefixtures("deliver_in_process")


def _port_step():
    """A port-shaped step: ``(w, mom, x) -> (w, mom, loss, {"a": |g_a|, "b": |g_b|})``,
    the state donated."""
    def step(w, mom, x):
        def loss_fn(w):
            return jnp.mean((w["a"] * x - 1.0) ** 2) + jnp.mean((w["b"] - x) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(w)
        mom = {k: 0.9 * mom[k] + g[k] for k in w}
        w = {k: w[k] - 0.05 * mom[k] for k in w}
        return w, mom, loss, {k: jnp.linalg.norm(g[k]) for k in g}

    return jax.jit(step, donate_argnums=(0, 1))


def test_a_buffered_port_step_records_the_steps_own_values_under_probe_log_names(
        store) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(3)
    xs = [rng.random(4, dtype=np.float32) for _ in range(40)]

    def fresh():
        w = {"a": jnp.ones(4, jnp.float32), "b": jnp.zeros(4, jnp.float32)}
        return jax.device_put(w, rep), jax.device_put(jax.tree.map(jnp.zeros_like, w), rep)

    step = _port_step()
    # The unbuffered chain: the values the run must record, read after it ran.
    w, mom = fresh()
    want = []
    for x in xs:
        w, mom, loss, norms = step(w, mom, x)
        want.append({"loss": float(loss), "grad_norm/a": float(norms["a"]),
                     "grad_norm/b": float(norms["b"])})
    want_w = jax.device_get(w)

    names = metric_names(step, *fresh(), xs[0])
    assert sorted(names) == ["grad_norm/a", "grad_norm/b", "loss"]
    run = refrun.start_run("jax-buffered-port", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False)
    fn = buffered_step(step, (0, 1))
    probe = refrun.jax.instrument(run, step_fns=[fn], monitors=None)
    buf = probe.metrics_buffer(*names, capacity=16, sharding=rep)  # 2 full + 8 at close
    w, mom = fresh()
    for n, x in enumerate(xs):
        with probe.step(n):
            w, mom, buf = fn(buf, w, mom, x)
            buf = probe.log_buffer(buf)
    probe.close()
    run.close()

    assert all(np.array_equal(jax.device_get(w)[k], want_w[k]) for k in want_w)
    for name in names:
        got = store.points(run.run_id, name)
        assert [s for s, _ in got] == list(range(len(xs)))
        assert [v for _, v in got] == [row[name] for row in want]  # float32, kept exactly
    assert fn._cache_size() == 1
    metrics = store.client().get_run(run.run_id).data.metrics
    assert metrics[schema.M_COMPILE_RECOMPILES] == 0.0
    assert metrics[schema.M_HOST_SYNCS] == 0.0
    tags = store.client().get_run(run.run_id).data.tags
    assert int(tags.get(schema.TAG_DROPPED, "0")) == 0
