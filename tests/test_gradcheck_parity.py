"""Parity by named parameter: a PyTorch MLP against its JAX port with copied weights."""

from __future__ import annotations

import numpy as np
import pytest

from refrun.errors import RefrunInputError
from refrun.gradcheck import ParamMap, apply_mapping, compare_by_name, relative_error
from refrun.gradcheck import named as nm
from refrun.gradcheck.examples import (
    MLP_MAPPING,
    jax_mlp_loss,
    mlp_batch,
    torch_mlp,
    torch_mlp_loss,
)

jax = pytest.importorskip("jax", reason="JAX is an optional extra")
torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
jnp = jax.numpy


def gradients(n_in=5, n_hidden=7):
    """PyTorch gradients via loss.backward() and JAX gradients via jax.grad, float64."""
    model = torch_mlp(n_in=n_in, n_hidden=n_hidden)
    x, y = mlp_batch(n_in=n_in)
    torch_mlp_loss(model, torch.from_numpy(x), torch.from_numpy(y)).backward()
    tree = {"fc1": {"kernel": 0, "bias": 0}, "fc2": {"kernel": 0, "bias": 0}}
    params = nm.unflatten(tree, apply_mapping(dict(model.named_parameters()), MLP_MAPPING))
    with jax.enable_x64(True):
        jgrads = jax.grad(jax_mlp_loss)(jax.tree_util.tree_map(jnp.asarray, params),
                                        jnp.asarray(x), jnp.asarray(y))
        jgrads = jax.tree_util.tree_map(np.asarray, jgrads)
    return model, jgrads, x, y


def test_mlp_parity_by_name_passes():
    model, jgrads, x, y = gradients()
    r = compare_by_name(model, jgrads, MLP_MAPPING, tol=1e-10, label_a="torch", label_b="jax")
    assert r.passed, r.summary()
    assert [p.name_a for p in r.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert r.max_rel_error < 1e-12
    # independent NumPy check of one gradient: dL/d(fc2.bias) = 2/(n*k) Σ_n (out - y)
    w1, b1 = (model.fc1.weight.detach().numpy(), model.fc1.bias.detach().numpy())
    w2, b2 = (model.fc2.weight.detach().numpy(), model.fc2.bias.detach().numpy())
    out = np.tanh(x @ w1.T + b1) @ w2.T + b2
    np.testing.assert_allclose(jgrads["fc2"]["bias"], 2 * (out - y).sum(0) / out.size,
                               rtol=1e-12)


def test_missing_transpose_fails_on_that_parameter_shape_first():
    model, jgrads, *_ = gradients()
    mapping = dict(MLP_MAPPING, **{"fc1.weight": ParamMap("fc1.kernel")})
    r = compare_by_name(model, jgrads, mapping)
    assert not r.passed
    assert r.failed_names == ["fc1.weight"]
    (f,) = r.failures
    assert f.reason == "shape" and f.shape_a == (7, 5) and f.shape_b == (5, 7)
    assert "fc1.weight" in r.summary() and "missing transform" in r.summary()


def test_missing_transpose_on_square_weight_fails_on_values():
    model, jgrads, *_ = gradients(n_in=6, n_hidden=6)
    mapping = dict(MLP_MAPPING, **{"fc1.weight": ParamMap("fc1.kernel")})
    r = compare_by_name(model, jgrads, mapping)
    assert r.failed_names == ["fc1.weight"]
    assert r.failures[0].reason == "value"
    g = model.fc1.weight.grad.numpy()
    assert r.failures[0].rel_error == pytest.approx(
        np.linalg.norm(g - g.T) / np.linalg.norm(g), rel=1e-9)


def test_unmatched_names_are_listed_and_fail():
    model, jgrads, *_ = gradients()
    partial = {k: v for k, v in MLP_MAPPING.items() if k != "fc2.bias"}
    r = compare_by_name(model, jgrads, partial)
    assert r.unmatched_a == ["fc2.bias"] and r.unmatched_b == ["fc2.bias"]
    assert not r.passed and "unmatched" in r.summary()
    assert compare_by_name(model, jgrads, partial, allow_unmatched=True).passed


def test_mapping_naming_a_missing_parameter_is_bad_input():
    model, jgrads, *_ = gradients()
    with pytest.raises(RefrunInputError, match=r"'fc3\.weight' does not exist"):
        compare_by_name(model, jgrads, {"fc3.weight": "fc1.kernel"})
    with pytest.raises(RefrunInputError, match=r"target 'fc1\.w' does not exist"):
        compare_by_name(model, jgrads, {"fc1.weight": ParamMap("fc1.w", "transpose")})
    with pytest.raises(RefrunInputError, match="named by both"):
        compare_by_name(model, jgrads, {"fc1.bias": "fc2.bias", "fc2.bias": "fc2.bias"})


def test_same_values_different_structure_never_match_by_position():
    a = {"w": np.ones(3), "b": np.zeros(2)}
    b = [np.ones(3), np.zeros(2)]  # same leaves in the same order, names "0" and "1"
    r = compare_by_name(a, b)
    assert r.params == [] and r.unmatched_a == ["w", "b"] and r.unmatched_b == ["0", "1"]
    assert not r.passed


def test_relative_error_formula():
    a, b = np.array([3.0, 4.0]), np.array([3.0, 0.0])
    assert relative_error(a, b) == pytest.approx(4.0 / 5.0)
    assert relative_error(np.zeros(2), np.zeros(2)) == 0.0
    assert relative_error(a, -a) == pytest.approx(2.0)
    assert relative_error(np.zeros(2), np.full(2, 1e-14), eps_safe=1e-12) == pytest.approx(
        np.sqrt(2) * 1e-2)
