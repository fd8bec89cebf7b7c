"""Known-answer checks (seed 000): w=1, x=[1, 2], y=[0, 0], MSE -> loss 2.5, gradient 5."""

from __future__ import annotations

import numpy as np
import pytest

from refrun.errors import RefrunInputError
from refrun.gradcheck import check_known_answer
from refrun.gradcheck.examples import SEED000, jax_mse, torch_mse

jax = pytest.importorskip("jax", reason="JAX is an optional extra")
torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
jnp = jax.numpy

X, Y = np.array([1.0, 2.0]), np.array([0.0, 0.0])


def independent_oracle(w: float) -> tuple[float, float]:
    """The seed's hand calculation, in NumPy: L = mean((wx-y)^2), dL/dw = mean(2x(wx-y))."""
    r = w * X - Y
    return float(np.mean(r**2)), float(np.mean(2 * X * r))


def jax_loss_with_defect(w, x, y):
    w = jax.lax.stop_gradient(w)  # seed 000's one-line migration defect
    return jnp.mean((w * x - y) ** 2)


def torch_loss_with_defect(w, x, y):
    return ((w.detach() * x - y) ** 2).mean()


def run(torch_fn=torch_mse, jax_fn=jax_mse, dtype="float32"):
    loss, grad = independent_oracle(SEED000["params"])
    return check_known_answer(params=SEED000["params"], args=(X, Y), expected_loss=loss,
                              expected_grad=grad, torch_fn=torch_fn, jax_fn=jax_fn,
                              dtype=dtype, root="w")


def test_oracle_values_are_the_seeds():
    assert independent_oracle(1.0) == (2.5, 5.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_both_frameworks_pass_without_defect(dtype):
    r = run(dtype=dtype)
    assert r.passed, r.summary()
    labels = [a.label for a in r.assertions]
    assert labels == ["PyTorch finite values", "JAX finite values", "PyTorch loss oracle",
                      "JAX loss oracle", "forward parity", "PyTorch gradient oracle",
                      "JAX gradient oracle", "gradient parity"]
    assert r.losses == {"torch": pytest.approx(2.5), "jax": pytest.approx(2.5)}


def test_jax_stop_gradient_fails_on_jax_gradient_oracle_forward_passes():
    r = run(jax_fn=jax_loss_with_defect)
    assert not r.passed
    by_label = {(a.label, a.parameter): a for a in r.assertions}
    for label in ("PyTorch loss oracle", "JAX loss oracle", "forward parity"):
        assert by_label[(label, None)].passed
    assert by_label[("PyTorch gradient oracle", "w")].passed
    first = r.failures[0]
    assert (first.label, first.framework, first.quantity, first.parameter) == (
        "JAX gradient oracle", "jax", "gradient", "w")
    assert "0 vs expected 5" in first.detail
    with pytest.raises(AssertionError, match=r"JAX gradient oracle \[w\]"):
        r.raise_if_failed()


def test_torch_detach_fails_on_pytorch_gradient_oracle():
    r = run(torch_fn=torch_loss_with_defect)
    assert [a.label for a in r.failures] == ["PyTorch gradient oracle", "gradient parity"]
    assert all(a.passed for a in r.assertions if a.quantity == "loss")


def test_single_framework_and_dict_params():
    def loss(p, x, y):
        return jnp.mean((p["w"] * x + p["b"] - y) ** 2)

    w, b = 1.5, -0.5
    r_ = w * X + b - Y
    r = check_known_answer(params={"w": w, "b": b}, args=(X, Y),
                           expected_loss=float(np.mean(r_**2)),
                           expected_grad={"w": float(np.mean(2 * X * r_)),
                                          "b": float(np.mean(2 * r_))},
                           jax_fn=loss, dtype="float64")
    assert r.passed, r.summary()
    assert {a.parameter for a in r.assertions if a.quantity == "gradient"} == {"w", "b"}


def test_non_finite_values_are_labelled():
    def nan_loss(w, x, y):
        return jnp.mean(jnp.sqrt(w * x - 3.0))  # sqrt of negative numbers

    r = check_known_answer(params=1.0, args=(X, Y), expected_loss=1.0, expected_grad=1.0,
                           jax_fn=nan_loss, root="w")
    finite = r.assertions[0]
    assert finite.label == "JAX finite values" and not finite.passed
    assert "loss" in finite.detail and "w" in finite.detail


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"expected_loss": float("nan"), "expected_grad": 5.0}, "expected_loss"),
    ({"expected_loss": 2.5, "expected_grad": float("inf")}, r"expected_grad\['w'\]: non-finite"),
    ({"expected_loss": 2.5, "expected_grad": [5.0, 1.0]}, r"expected_grad\['w'\]: shape"),
    ({"expected_loss": 2.5, "expected_grad": {"v": 5.0}}, "expected_grad"),
])
def test_bad_oracle_is_named(kwargs, message):
    with pytest.raises(RefrunInputError, match=message):
        check_known_answer(params=1.0, args=(X, Y), jax_fn=jax_mse, root="w", **kwargs)


def test_non_scalar_loss_is_named():
    def per_example(w, x, y):
        return (w * x - y) ** 2

    with pytest.raises(RefrunInputError, match=r"must return a scalar loss, returned shape \(2,\)"):
        check_known_answer(params=1.0, args=(X, Y), expected_loss=2.5, expected_grad=5.0,
                           torch_fn=per_example, root="w")


def test_no_function_given():
    with pytest.raises(RefrunInputError, match="torch_fn and/or jax_fn"):
        check_known_answer(params=1.0, expected_loss=2.5, expected_grad=5.0)
