"""The charlm pipeline's parity gradient check (pipelines/charlm/gradcheck.py): the JAX
port with no defect agrees with the PyTorch reference (same weights, same batch) on the
loss, every gradient and the evaluation logits; a missing attention scale fails the
gradients, dropout left on in evaluation fails the evaluation logits, and a defect of
the step (per-device clipping) is not this check's business.  (The PyTorch/XLA port runs
the same check in ``benchmarks/bench_detection.py``; its compilation is too slow here.)"""

from __future__ import annotations

import pytest

from pipelines.charlm.config import load_config
from pipelines.charlm.gradcheck import TOL, check

# Imports and compiles JAX and PyTorch models (~15 s quiet, ~70 s on the loaded 2-core
# machine); the three later checks reuse the compiled functions' caches (~3-6 s each).
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def cfg():
    return load_config(quick=True)


def _by_label(results) -> dict:
    return {r.label: r for r in results}


def test_benign_jax_port_agrees_with_the_reference(cfg) -> None:
    r = _by_label(check("jax", cfg, 6, []))
    assert set(r) == {"parity/loss", "parity/grads", "parity/eval_logits"}
    assert all(x.passed for x in r.values())
    assert max(x.max_rel_error for x in r.values()) < TOL / 10
    assert not r["parity/grads"].unmatched_a and not r["parity/grads"].unmatched_b


@pytest.mark.parametrize(("defect", "fails"), [("no_attn_scale", "parity/grads"),
                                               ("eval_dropout", "parity/eval_logits")])
def test_computation_defects_fail_the_check(cfg, defect: str, fails: str) -> None:
    r = _by_label(check("jax", cfg, 6, [defect]))
    assert not r[fails].passed
    assert r[fails].max_rel_error > 100 * TOL


def test_step_defect_is_not_a_parity_failure(cfg) -> None:
    assert all(x.passed for x in check("jax", cfg, 6, ["clip_per_device"]))
