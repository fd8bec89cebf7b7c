"""refrun's own gate self-test: every check against the mutations it exists to catch.

Each case pairs a check, a correct reference workload (:mod:`refrun.gradcheck.examples`)
and mutations of that workload; the check must pass the original and fail every
mutation.  ``refrun gradcheck --self-test`` runs :func:`run_self_test`.

=====================  ======================================  ============================
check                  workload                                mutations
=====================  ======================================  ============================
known-answer (JAX)     seed 000 MSE                            stop_gradient(w), mean->sum
known-answer (PyTorch) seed 000 MSE                            detach(w), mean->sum
finite differences     seed 002 energy balance (JAX, float64)  stop_gradient(emissivity)
finite differences     seed 000 MSE (PyTorch, float64)         detach(w)
parity by name         MLP, PyTorch vs JAX port                stop_gradient(fc2.kernel),
                                                               mean->sum, transpose left out
update-delta parity    linear regression on 4 JAX devices      clip per device, then average
=====================  ======================================  ============================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from refrun.gradcheck import examples as ex
from refrun.gradcheck import named as nm
from refrun.gradcheck.finite_diff import check_finite_differences
from refrun.gradcheck.mutations import (
    MEAN_TO_SUM,
    GateSelfTest,
    Mutation,
    MutationOutcome,
    detach_mutation,
    self_test_gate,
    stop_gradient_mutation,
)
from refrun.gradcheck.objective import make_objective
from refrun.gradcheck.oracle import check_known_answer
from refrun.gradcheck.parity import ParamMap, compare_by_name
from refrun.gradcheck.update_delta import compare_updates


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[], GateSelfTest]
    needs: tuple[str, ...]  # frameworks


def _known_answer(framework: str) -> GateSelfTest:
    s = ex.SEED000

    def check(fn: Callable[..., Any]) -> Any:
        kw = {"torch_fn": fn} if framework == "torch" else {"jax_fn": fn}
        return check_known_answer(params=s["params"], args=s["args"], expected_loss=s["loss"],
                                  expected_grad=s["grad"], root="w", **kw)

    if framework == "torch":
        return self_test_gate(check, ex.torch_mse, [detach_mutation(), MEAN_TO_SUM],
                              "known-answer oracle (PyTorch, seed 000)")
    return self_test_gate(check, ex.jax_mse, [stop_gradient_mutation(), MEAN_TO_SUM],
                          "known-answer oracle (JAX, seed 000)")


def _fd_ebm() -> GateSelfTest:
    import jax.numpy as jnp

    def check(fn: Callable[..., Any]) -> Any:
        return check_finite_differences(fn, np.float64(ex.EBM_EMISSIVITY), framework="jax",
                                        dtype="float64", directions=1, label="ebm")

    return self_test_gate(check, ex.make_ebm_loss(jnp.float64),
                          [stop_gradient_mutation(0, None)],
                          "finite differences (JAX energy-balance model, seed 002)")


def _fd_torch() -> GateSelfTest:
    s = ex.SEED000

    def check(fn: Callable[..., Any]) -> Any:
        return check_finite_differences(fn, s["params"], s["args"], framework="torch")

    return self_test_gate(check, ex.torch_mse, [detach_mutation()],
                          "finite differences (PyTorch MSE, seed 000)")


def mlp_gradients(jax_loss: Callable[..., Any] = ex.jax_mlp_loss
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Float64 gradients of the example MLP in PyTorch and of its JAX port (weights
    copied through :data:`examples.MLP_MAPPING`)."""
    from refrun.gradcheck.parity import apply_mapping

    model = ex.torch_mlp()
    x, y = ex.mlp_batch()
    jax_params = nm.unflatten({"fc1": {"kernel": 0, "bias": 0}, "fc2": {"kernel": 0, "bias": 0}},
                              apply_mapping(dict(model.named_parameters()), ex.MLP_MAPPING))
    ot = make_objective(ex.torch_mlp_loss, model, (x, y), framework="torch", dtype="float64")
    oj = make_objective(jax_loss, jax_params, (x, y), framework="jax", dtype="float64")
    return ot.value_and_grad(ot.x0)[1], oj.value_and_grad(oj.x0)[1]


def _parity() -> GateSelfTest:
    g_torch, _ = mlp_gradients()

    def check(fn: Callable[..., Any]) -> Any:
        _, g_jax = mlp_gradients(fn)
        return compare_by_name(g_torch, g_jax, ex.MLP_MAPPING, tol=1e-8, label_a="torch",
                               label_b="jax")

    gate = self_test_gate(check, ex.jax_mlp_loss,
                          [stop_gradient_mutation(0, "fc2.kernel"), MEAN_TO_SUM],
                          "parity by name (MLP, PyTorch vs JAX)")
    # the mapping itself mutated: a Linear weight compared without its transpose
    _, g_jax = mlp_gradients()
    bad = dict(ex.MLP_MAPPING, **{"fc1.weight": ParamMap("fc1.kernel")})
    res = compare_by_name(g_torch, g_jax, bad, tol=1e-8)
    gate.outcomes.append(MutationOutcome("mapping without transpose(fc1.weight)",
                                         caught=not res.passed, detail=res.summary()[:300]))
    return gate


def _update_delta() -> GateSelfTest:
    r = ex.clipping_update_demo_subprocess(4)

    def check(candidate: str) -> Any:
        return compare_updates(r["params0"], r["reference"], r["params0"], r[candidate],
                               tol=1e-4, label="update-delta")

    base = check("sharded_correct")
    gate = GateSelfTest(check="update-delta parity (linear regression, 4 JAX CPU devices)",
                        baseline_passed=base.passed, baseline_detail=base.summary()[:300])
    bad = check("sharded_per_device")
    gate.outcomes.append(MutationOutcome("clip per device before averaging",
                                         caught=not bad.passed, detail=bad.summary()[:300]))
    return gate


CASES: tuple[Case, ...] = (
    Case("oracle-jax", lambda: _known_answer("jax"), ("jax",)),
    Case("oracle-torch", lambda: _known_answer("torch"), ("torch",)),
    Case("fd-ebm", _fd_ebm, ("jax",)),
    Case("fd-torch", _fd_torch, ("torch",)),
    Case("parity-mlp", _parity, ("torch", "jax")),
    Case("update-delta-clipping", _update_delta, ("jax",)),
)


def available(frameworks: tuple[str, ...]) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(f) is not None for f in frameworks)


def run_self_test(only: tuple[str, ...] = ()) -> list[GateSelfTest]:
    """Run every case whose frameworks are installed (or only the named cases).

    A case whose frameworks are missing is reported as a failing gate with that reason,
    never silently dropped.
    """
    out = []
    for case in CASES:
        if only and case.name not in only:
            continue
        if not available(case.needs):
            out.append(GateSelfTest(case.name, False, f"not run: needs {', '.join(case.needs)}"))
            continue
        out.append(case.run())
    return out


__all__ = ["CASES", "Case", "Mutation", "mlp_gradients", "run_self_test"]
