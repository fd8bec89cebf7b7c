"""The markov pipeline's parity and update-delta check (pipelines/markov/gradcheck.py):
benign JAX ports on 1 and 4 devices agree with the PyTorch reference to float32 rounding;
a changed function (bfloat16 matmuls, a summed loss) fails the gradients; a host read
changes nothing; and per-device clipping fails the update delta exactly when a device's
local gradient norm exceeds the clip in the checked steps, which is computed here
independently, from the reference's own trajectory in PyTorch.

JAX's host device count is fixed when JAX starts, so the checks run in a child process
with four CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

_SCRIPT = r"""
import json
from dataclasses import replace

import torch

from pipelines.markov.config import load_config
from pipelines.markov.gradcheck import STEPS, check, first_batches
from pipelines.markov.train_torch import adam_update, build_model, loss_of, schedule


def summary(results):
    out = {}
    for r in results:
        params = r.parity.params if hasattr(r, "parity") else r.params
        out[r.label] = {"passed": r.passed, "max": max(p.rel_error for p in params)}
    return out


def largest_local_norm(cfg, seed, devices):
    # The reference's own trajectory (global clip); at each step the gradient norm each
    # device's shard of the batch would have on its own.
    model = build_model(cfg, seed)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    largest = 0.0
    for step, (xb, yb) in enumerate(first_batches(cfg, seed, STEPS)):
        x, y = torch.from_numpy(xb).long(), torch.from_numpy(yb).long()
        for xs, ys in zip(x.chunk(devices), y.chunk(devices)):
            g = torch.autograd.grad(loss_of(model(xs), ys), params)
            largest = max(largest, float(torch.sqrt(sum((t * t).sum() for t in g))))
        for p in params:
            p.grad = None
        loss_of(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        adam_update(params, m, v, torch.from_numpy(schedule(cfg, step)), cfg)
    return largest


cfg = load_config(quick=True)
tight = replace(cfg, clip_norm=0.05)
print(json.dumps({
    "benign1": summary(check("jax", cfg, 6, [], 1)),
    "benign4": summary(check("jax", cfg, 7, [], 4)),
    "clip4": summary(check("jax", cfg, 5, ["clip_per_device"], 4)),
    "clip4_local": largest_local_norm(cfg, 5, 4),
    "clip4_tight": summary(check("jax", tight, 5, ["clip_per_device"], 4)),
    "clip1_tight": summary(check("jax", tight, 5, ["clip_per_device"], 1)),
    "bf16": summary(check("jax", cfg, 0, ["bf16_matmul"], 1)),
    "sum_loss": summary(check("jax", cfg, 5, ["sum_loss"], 1)),
    "float_loss": summary(check("jax", cfg, 5, ["float_loss"], 1)),
    "clip_norm": cfg.clip_norm,
}))
"""


@pytest.fixture(scope="module")
def outcome() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_benign_ports_on_one_and_four_devices_agree_with_the_reference(outcome) -> None:
    from pipelines.markov.gradcheck import TOL

    for case in ("benign1", "benign4"):
        r = outcome[case]
        assert set(r) == {"parity/loss", "parity/grads", "update_delta"}
        assert all(x["passed"] for x in r.values()), (case, r)
        assert max(x["max"] for x in r.values()) < TOL / 5, (case, r)


def test_per_device_clipping_fails_the_update_delta_when_a_device_norm_exceeds_the_clip(
        outcome) -> None:
    from pipelines.markov.gradcheck import TOL

    r = outcome["clip4"]
    # the gradient of the first batch is the same function: only the step differs
    assert r["parity/loss"]["passed"] and r["parity/grads"]["passed"]
    exceeds = outcome["clip4_local"] > outcome["clip_norm"]
    assert r["update_delta"]["passed"] is not exceeds, (outcome["clip4_local"], r)
    if exceeds:
        assert r["update_delta"]["max"] > 100 * TOL
    # with a clip every device's norm exceeds, the 4-device step always departs ...
    assert not outcome["clip4_tight"]["update_delta"]["passed"]
    # ... and on one device clipping "per device" is the global clip: no defect at all
    assert all(x["passed"] for x in outcome["clip1_tight"].values())


def test_a_changed_function_fails_and_a_host_read_does_not(outcome) -> None:
    assert not outcome["bf16"]["parity/grads"]["passed"]
    assert not outcome["sum_loss"]["parity/loss"]["passed"]
    assert not outcome["sum_loss"]["parity/grads"]["passed"]
    assert all(x["passed"] for x in outcome["float_loss"].values())
