"""Update-delta parity catches seed 004's four-chip defect: per-device clipping.

JAX runs on 4 CPU devices in a subprocess (a process's device count is fixed when jax is
first imported, and other test files in this pytest process import it first).
"""

from __future__ import annotations

import numpy as np
import pytest

from refrun.errors import RefrunInputError
from refrun.gradcheck import compare_updates, update_delta_parity
from refrun.gradcheck.examples import clipping_batch, clipping_update_demo_subprocess

pytest.importorskip("jax", reason="JAX is an optional extra")


def numpy_updates(params, x, y, n_devices, max_norm, lr):
    """Independent NumPy: one SGD step, clipped after averaging vs per device."""

    def grad(xb, yb):
        r = xb @ params["w"] + params["b"] - yb
        return np.concatenate([2 * xb.T @ r / len(r), [2 * r.mean()]])

    def clip(g):
        return g * min(1.0, max_norm / (np.linalg.norm(g) + 1e-12))

    shards = zip(np.split(x, n_devices), np.split(y, n_devices), strict=True)
    local = [grad(xb, yb) for xb, yb in shards]
    return -lr * clip(np.mean(local, 0)), -lr * np.mean([clip(g) for g in local], 0)


@pytest.fixture(scope="module")
def demo():
    return clipping_update_demo_subprocess(4)


def test_demo_ran_on_four_devices_and_matches_numpy(demo):
    assert demo["n_devices"] == 4
    p0, x, y = clipping_batch(4)
    np.testing.assert_array_equal(demo["batch"]["x"], x)
    after = {"correct": np.concatenate([demo["sharded_correct"]["w"],
                                        [demo["sharded_correct"]["b"]]]),
             "per_device": np.concatenate([demo["sharded_per_device"]["w"],
                                           [demo["sharded_per_device"]["b"]]])}
    want_once, want_per_device = numpy_updates(p0, x.astype(np.float64), y.astype(np.float64),
                                               4, demo["max_norm"], demo["lr"])
    np.testing.assert_allclose(after["correct"], want_once, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(after["per_device"], want_per_device, rtol=1e-5, atol=1e-7)
    assert np.linalg.norm(want_once - want_per_device) > 1e-3  # the defect is real here


def test_update_delta_parity_catches_per_device_clipping(demo):
    p0 = demo["params0"]
    ok = compare_updates(p0, demo["reference"], p0, demo["sharded_correct"], tol=1e-4)
    assert ok.passed, ok.summary()
    bad = compare_updates(p0, demo["reference"], p0, demo["sharded_per_device"], tol=1e-4)
    assert not bad.passed
    assert sorted(bad.failed_names) == ["b", "w"]
    assert all(p.rel_error > 0.05 for p in bad.parity.params)


def test_update_delta_parity_drives_k_steps_and_names_the_parameter():
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(3), "b": np.array(0.5)}
    batch = (rng.standard_normal((8, 3)), rng.standard_normal(8))

    def jax_step(p, b):
        x, y = (jnp.asarray(v, jnp.float32) for v in b)
        g = jax.grad(lambda q: jnp.mean((x @ q["w"] + q["b"] - y) ** 2))(p)
        return jax.tree_util.tree_map(lambda a, d: a - 0.1 * d, p, g)

    def torch_step(p, b, bias_lr=0.1):
        x, y = (torch.as_tensor(v, dtype=torch.float32) for v in b)
        q = {k: v.clone().requires_grad_(True) for k, v in p.items()}
        ((x @ q["w"] + q["b"] - y) ** 2).mean().backward()
        with torch.no_grad():
            return {"w": q["w"] - 0.1 * q["w"].grad, "b": q["b"] - bias_lr * q["b"].grad}

    to_jax = lambda p: {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}  # noqa: E731
    to_torch = lambda p: {k: torch.as_tensor(v, dtype=torch.float32)  # noqa: E731
                          for k, v in p.items()}
    ok = update_delta_parity(jax_step, torch_step, params, batch, steps=3, tol=1e-5,
                             to_reference=to_jax, to_candidate=to_torch)
    assert ok.passed, ok.summary()
    # one step: only the bias update differs (over k steps it leaks into w)
    bad = update_delta_parity(jax_step, lambda p, b: torch_step(p, b, bias_lr=0.2), params,
                              batch, steps=1, to_reference=to_jax, to_candidate=to_torch)
    assert bad.failed_names == ["b"]
    assert bad.parity.failures[0].rel_error == pytest.approx(0.5, rel=1e-5)
    with pytest.raises(RefrunInputError, match="2 given for 3 steps"):
        update_delta_parity(jax_step, jax_step, params, [batch, batch], steps=3,
                            to_reference=to_jax, to_candidate=to_jax)
