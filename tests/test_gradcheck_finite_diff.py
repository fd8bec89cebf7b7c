"""Finite differences read as a V curve (seed 002), on NumPy, JAX and PyTorch functions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refrun.errors import RefrunInputError
from refrun.gradcheck import (
    DEFAULT_STEPS,
    check_finite_differences,
    check_objective,
    classify,
    objective_from_callables,
)
from refrun.gradcheck.examples import EBM_EMISSIVITY, EBM_STEPS, S0, SIGMA_SB, make_ebm_loss
from refrun.gradcheck.finite_diff import has_v_shape


def sin_objective(n: int, grad_scale: float = 1.0, noise: float = 0.0):
    """f(x) = Σ sin(x) (+ optional noise): a framework-free objective with a known gradient."""
    rng = np.random.default_rng(1)
    x0 = {"x": np.linspace(-1.0, 1.0, n)}

    def value(p):
        return float(np.sum(np.sin(p["x"]))) + (noise * rng.standard_normal() if noise else 0.0)

    def grad(p):
        return {"x": grad_scale * np.cos(p["x"])}

    return objective_from_callables(value, grad, x0, label="sin")


def test_sweep_is_1e2_to_1e11():
    assert DEFAULT_STEPS[0] == 1e-2 and DEFAULT_STEPS[-1] == pytest.approx(1e-11)
    assert len(DEFAULT_STEPS) == 10


def test_correct_gradient_is_verified_with_a_v():
    r = check_objective(sin_objective(50))
    assert r.verdict == "verified", r.summary()
    for c in r.curves:
        assert c.v_shape
        # truncation branch: central differences are O(h²), so 10x smaller h -> 100x
        assert c.rel_error[0] / c.rel_error[1] == pytest.approx(100, rel=0.05)
        assert c.best_error < 1e-8
        assert c.rel_error[-1] > 10 * c.best_error  # roundoff branch


def test_wrong_gradient_is_wrong_and_noise_is_suspect():
    assert check_objective(sin_objective(50, grad_scale=2.0)).verdict == "wrong"
    assert check_objective(sin_objective(50, grad_scale=1.00005)).verdict == "suspect"
    noisy = check_objective(sin_objective(50, noise=1e-9))
    assert noisy.verdict == "suspect", noisy.summary()


def test_classify_rule():
    assert classify(1e-10) == "verified"
    assert classify(1e-3) == "suspect"
    assert classify(0.5) == "wrong"
    assert classify(float("nan")) == "wrong"
    assert has_v_shape([1e-2, 1e-6, 1e-9, 1e-5]) and not has_v_shape([1e-9, 1e-6, 1e-3])


@pytest.mark.parametrize("n", [10, 100_000])
def test_evaluations_do_not_depend_on_parameter_count(n):
    r = check_objective(sin_objective(n), directions=3)
    assert r.function_evaluations == 2 * len(DEFAULT_STEPS) * 3
    assert r.gradient_evaluations == 1
    assert r.n_params == n


def test_bad_steps_and_directions():
    with pytest.raises(RefrunInputError, match="steps"):
        check_objective(sin_objective(3), steps=[1e-3, 0.0])
    with pytest.raises(RefrunInputError, match="directions"):
        check_objective(sin_objective(3), directions=0)


# --- seed 002: the energy balance model --------------------------------------------------
jax = pytest.importorskip("jax", reason="JAX is an optional extra")
jnp = jax.numpy


def numpy_ebm_loss(emissivity: float) -> float:
    """Independent float64 NumPy re-implementation of the seed's 100-year rollout."""
    t = 288.0
    dt_c = 86400.0 * 30 / 4e8
    for _ in range(EBM_STEPS):
        albedo = 0.28 + 0.34 * 0.5 * (1.0 - math.tanh((t - 263.0) / 5.0))
        t = t + dt_c * (S0 * (1 - albedo) / 4 - emissivity * SIGMA_SB * t**4)
    return (t - 290.0) ** 2


@pytest.fixture(scope="module")
def ebm64():
    return check_finite_differences(make_ebm_loss(jnp.float64), np.float64(EBM_EMISSIVITY),
                                    framework="jax", dtype="float64", directions=1,
                                    label="ebm")


def test_ebm_float64_v_bottoms_near_1e9_to_1e10(ebm64):
    c = ebm64.curves[0]
    assert ebm64.verdict == "verified"
    assert 1e-11 < c.best_error < 1e-8  # seed: "best agreement: 9.8e-10 at h = 1e-07"
    assert c.best_step in (1e-6, pytest.approx(1e-7))
    assert c.v_shape
    # the gradient itself: the seed prints -24.69132; check against our NumPy model
    h = 1e-6
    fd = (numpy_ebm_loss(EBM_EMISSIVITY + h) - numpy_ebm_loss(EBM_EMISSIVITY - h)) / (2 * h)
    assert abs(c.autodiff) == pytest.approx(abs(fd), rel=1e-7)
    assert c.autodiff == pytest.approx(-24.69132, abs=1e-5)


def test_ebm_stop_gradient_is_wrong():
    r = check_finite_differences(make_ebm_loss(jnp.float64, stop_gradient=True),
                                 np.float64(EBM_EMISSIVITY), framework="jax", directions=1)
    assert r.verdict == "wrong"
    assert "blocked derivative" in r.reason
    assert min(r.curve) == pytest.approx(1.0)


def test_ebm_float32_check_loses_its_floor():
    r = check_finite_differences(make_ebm_loss(jnp.float32), np.float32(EBM_EMISSIVITY),
                                 framework="jax", dtype="float32", directions=1)
    assert r.verdict == "suspect" and "float64" in r.reason
    assert 1e-5 < r.best_error < 1e-2  # seed: "a verification floor of 1e-4"


def test_jax_pytree_params_and_torch_stop():
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")

    def jloss(p, x):
        return jnp.sum(jnp.tanh(x @ p["a"]["w"]) ** 2) + jnp.sum(p["b"] ** 3)

    def tloss(p, x):
        return (torch.tanh(x @ p["a"]["w"].detach()) ** 2).sum() + (p["b"] ** 3).sum()

    rng = np.random.default_rng(0)
    params = {"a": {"w": rng.standard_normal((4, 3))}, "b": rng.standard_normal(5)}
    x = rng.standard_normal((6, 4))
    ok = check_finite_differences(jloss, params, (x,), framework="jax")
    assert ok.verdict == "verified", ok.summary()
    assert ok.n_params == 17
    # detaching one of two parameters: directional derivatives are off by order one
    bad = check_finite_differences(tloss, params, (x,), framework="torch")
    assert bad.verdict == "wrong", bad.summary()
