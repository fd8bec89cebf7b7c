"""Mutated copies of loss functions and the gate self-test (incl. `refrun gradcheck`)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from refrun.cli import main
from refrun.errors import RefrunInputError
from refrun.gradcheck import (
    MEAN_TO_SUM,
    check_known_answer,
    detach_mutation,
    mean_to_sum,
    self_test_gate,
    stop_gradient_mutation,
    stop_gradient_on,
)
from refrun.gradcheck.examples import SEED000, jax_mse, torch_mse

jax = pytest.importorskip("jax", reason="JAX is an optional extra")
torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
jnp = jax.numpy


def method_mean(w, x, y):
    return ((w * x - y) ** 2).mean(axis=0)


def functional_mse(w, x, y):
    return torch.nn.functional.mse_loss(w * x, y, reduction="mean")


def make_closure(scale):
    def scaled(w, x, y):
        return scale * jnp.mean((w * x - y) ** 2)

    return scaled


def no_mean(w, x, y):
    return jnp.sum((w * x - y) ** 2)


X, Y = np.array([1.0, 2.0]), np.array([0.0, 0.0])


@pytest.mark.parametrize(("fn", "to"), [
    (jax_mse, jnp.asarray), (method_mean, jnp.asarray), (make_closure(3.0), jnp.asarray),
    (functional_mse, torch.as_tensor),
])
def test_mean_to_sum_turns_every_mean_into_sum(fn, to):
    mutated = mean_to_sum(fn)
    w, x, y = to(np.float64(1.5)), to(X), to(Y)
    assert float(mutated(w, x, y)) == pytest.approx(float(fn(w, x, y)) * len(X))
    assert mutated.__refrun_mutation__ == "mean->sum"


def test_mean_to_sum_refuses_what_it_cannot_mutate():
    with pytest.raises(RefrunInputError, match="no mean reduction in no_mean"):
        mean_to_sum(no_mean)
    with pytest.raises(RefrunInputError, match="lambdas"):
        mean_to_sum(lambda w: jnp.mean(w))


def test_stop_gradient_on_a_named_leaf_only():
    def loss(p):
        return jnp.sum(p["a"] ** 2) + jnp.sum(p["b"] ** 2)

    p = {"a": jnp.ones(2), "b": jnp.ones(3)}
    g = jax.grad(stop_gradient_on(loss, 0, "b"))(p)
    np.testing.assert_array_equal(g["a"], 2 * np.ones(2))
    np.testing.assert_array_equal(g["b"], np.zeros(3))
    with pytest.raises(RefrunInputError, match="parameter 'c' not found"):
        jax.grad(stop_gradient_on(loss, 0, "c"))(p)


def oracle_check(framework):
    def check(fn):
        kw = {"torch_fn": fn} if framework == "torch" else {"jax_fn": fn}
        return check_known_answer(params=SEED000["params"], args=SEED000["args"],
                                  expected_loss=2.5, expected_grad=5.0, root="w", **kw)

    return check


def test_gate_catches_its_mutations_in_both_frameworks():
    g = self_test_gate(oracle_check("jax"), jax_mse, [stop_gradient_mutation(), MEAN_TO_SUM])
    assert g.passed and g.baseline_passed
    assert [o.mutation for o in g.outcomes if o.caught] == ["stop_gradient(arg0)", "mean->sum"]
    assert "JAX gradient oracle" in g.outcomes[0].detail
    t = self_test_gate(oracle_check("torch"), torch_mse, [detach_mutation(), MEAN_TO_SUM])
    assert t.passed
    assert "PyTorch loss oracle" in t.outcomes[1].detail


def test_a_gate_that_cannot_fail_is_reported():
    blind = self_test_gate(lambda fn: True, jax_mse, [stop_gradient_mutation()], "blind")
    assert blind.baseline_passed and not blind.passed
    assert "MISSED stop_gradient" in blind.summary()


def test_unappliable_mutation_counts_as_missed():
    g = self_test_gate(lambda fn: True, no_mean, [MEAN_TO_SUM], "sum only")
    assert not g.passed
    assert g.outcomes[0].detail.startswith("not applied: mean_to_sum: no mean reduction")


def test_cli_self_test_subset(capsys):
    assert main(["gradcheck", "--self-test", "--only", "oracle-jax", "--only", "fd-torch",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"]
    caught = {m["mutation"]: m["caught"] for c in out["checks"] for m in c["mutations"]}
    assert caught == {"stop_gradient(arg0)": True, "mean->sum": True, "detach(arg0)": True}


def test_cli_self_test_recorded_as_gradcheck_run(store, capsys):
    assert main(["gradcheck", "--self-test", "--only", "oracle-torch", "--workload", "gate",
                 "--tracking-uri", store.tracking_uri]) == 0
    assert "2/2 mutations caught; 1/1 baselines pass: OK" in capsys.readouterr().out
    client = store.client()
    (run,) = client.search_runs([client.get_experiment_by_name("gate").experiment_id])
    assert run.data.tags["refrun.role"] == "gradcheck"
    assert run.data.tags["refrun.gradcheck.passed"] == "true"
    caught = {k: v for k, v in run.data.metrics.items() if k.endswith("/caught")}
    assert len(caught) == 2 and set(caught.values()) == {1.0}


def test_cli_bad_usage_exits_2(capsys):
    assert main(["gradcheck"]) == 2
    assert main(["gradcheck", "--self-test", "--only", "nope"]) == 2
    assert "no such case" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_full_self_test_catches_everything():
    proc = subprocess.run([sys.executable, "-m", "refrun.cli", "gradcheck", "--self-test"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MISSED" not in proc.stdout
    for name in ("stop_gradient(fc2.kernel)", "mapping without transpose(fc1.weight)",
                 "clip per device before averaging", "detach(arg0)", "mean->sum"):
        assert f"caught {name}" in proc.stdout
    assert "10/10 mutations caught; 6/6 baselines pass: OK" in proc.stdout
