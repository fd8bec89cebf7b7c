"""Precision drift (seed 002's 0.7 %) and NaN hunting with the frameworks' debug modes."""

from __future__ import annotations

import numpy as np
import pytest

from refrun.gradcheck import hunt_nonfinite, precision_drift
from refrun.gradcheck.examples import EBM_EMISSIVITY, make_ebm_loss

jax = pytest.importorskip("jax", reason="JAX is an optional extra")
torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
jnp = jax.numpy


def test_ebm_float32_drifts_about_0_7_percent():
    r = precision_drift(make_ebm_loss(jnp.float32), np.float64(EBM_EMISSIVITY),
                        framework="jax", fn_high=make_ebm_loss(jnp.float64), label="ebm")
    # seed 002: float64 -24.69132, float32 -24.52714 "(0.7% off)"
    assert r.grad_norm_high == pytest.approx(24.69132, abs=1e-5)
    assert r.grad_norm_low == pytest.approx(24.52714, abs=5e-4)
    seed_drift = abs(-24.52714 - -24.69132) / 24.69132
    assert r.drift == pytest.approx(seed_drift, rel=0.02)
    assert 0.006 < r.drift < 0.008
    assert not r.passed  # above the default 0.1 % tolerance
    assert "0.66%" in r.summary()


def test_mlp_float32_drift_is_small():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4))
    x = rng.standard_normal((16, 8))

    def loss(w, x):
        return torch.tanh(x @ w).pow(2).mean()

    r = precision_drift(loss, w, (x,), framework="torch")
    assert r.passed and r.drift < 1e-5
    # independent float64 reference in NumPy
    h = np.tanh(x @ w)
    g = x.T @ (2 * h * (1 - h**2)) / h.size
    assert r.grad_norm_high == pytest.approx(np.linalg.norm(g), rel=1e-12)


def suspicious(x):
    return jnp.where(x > 0.0, jnp.sqrt(x), 0.0)  # seed 002's trap


def fixed(x):
    return jnp.where(x > 0.0, jnp.sqrt(jnp.where(x > 0.0, x, 1.0)), 0.0)


POINTS = [np.float32(v) for v in (2.0, 1.0, 0.0, -1.0)]


def test_jax_nan_found_and_located_with_debug_nans():
    r = hunt_nonfinite(suspicious, POINTS, framework="jax")
    assert not r.passed
    assert [(f.point, f.where, f.kind) for f in r.findings] == [(2, "gradient", "nan"),
                                                                (3, "gradient", "nan")]
    assert r.origin_point == 2
    assert "nan" in r.origin and "mul" in r.origin  # "invalid value (nan) encountered in mul"
    assert not jax.config.jax_debug_nans  # restored


def test_jax_double_where_fix_is_clean():
    r = hunt_nonfinite(fixed, POINTS, framework="jax")
    assert r.passed and r.points == 4 and r.origin is None


def test_torch_nan_located_with_detect_anomaly():
    def tsuspicious(x):
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))

    r = hunt_nonfinite(tsuspicious, POINTS, framework="torch", label="torch sqrt")
    assert [f.point for f in r.findings] == [2, 3]
    assert "SqrtBackward0" in r.origin
    assert not torch.is_anomaly_enabled()


def test_forward_inf_in_loss():
    def log_loss(x):
        return jnp.log(x)

    r = hunt_nonfinite(log_loss, [np.float32(1.0), np.float32(0.0)], framework="jax")
    assert r.findings[0].where == "loss" and r.findings[0].kind == "inf"
