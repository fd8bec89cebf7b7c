"""L0 completion from the run's step axis: a real PyTorch run (with the torch probe, which
records the step time at every step) that logs its loss every 5 steps ends its loss curve
at step 395 of 400 planned, and still completes; a run stopped early still does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from acceptance_helpers import write_criteria

import refrun
import refrun.torch
from refrun.acceptance import assess, load_criteria
from refrun.comparison import load_run

PLANNED = 400

BODY = """
[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 10.0
"""


def _train(store, role: str, steps: int, loss_every: int, seed: int) -> str:
    """A real tiny regression trained with SGD, probed; loss logged every ``loss_every``."""
    torch.manual_seed(seed)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with refrun.start_run("cadence", role, hardware="cpu", backend="torch", seed=seed,
                          planned_steps=PLANNED, tracking_uri=store.tracking_uri,
                          spool_dir=store.spool_dir, snapshot_environment=False,
                          delivery="thread") as run:
        probe = refrun.torch.instrument(run, model=model, optimizer=opt, monitors=None)
        for step in range(steps):
            with probe.step(step):
                opt.zero_grad()
                loss = ((model(x).squeeze(-1) - y) ** 2).mean()
                loss.backward()
                opt.step()
                if step % loss_every == 0:
                    probe.log(loss=loss.detach())
        probe.close()
    assert run.run_id is not None
    return run.run_id


def test_loss_every_5_steps_completes_l0(store, tmp_path: Path) -> None:
    ref = _train(store, "reference", PLANNED, 1, 0)
    cand = _train(store, "candidate", PLANNED, 5, 1)
    crit = load_criteria(write_criteria(tmp_path, BODY))
    cand_run = load_run(cand, tracking_uri=store.tracking_uri, progress=False)
    steps, _, _ = cand_run.series("loss")
    assert int(np.max(steps)) == 395  # the loss curve itself stops short of 399
    a = assess(crit, [load_run(ref, tracking_uri=store.tracking_uri, progress=False)],
               cand_run)
    r = a.result("L0.planned_steps")
    assert r.outcome == "pass", r.reason
    assert r.evidence["last_step"] == PLANNED - 1 and r.evidence["last_loss_step"] == 395
    assert a.level("L0").status == "pass"


def test_run_stopped_early_still_fails_l0(store, tmp_path: Path) -> None:
    ref = _train(store, "reference", PLANNED, 1, 0)
    cand = _train(store, "candidate", 300, 5, 1)
    crit = load_criteria(write_criteria(tmp_path, BODY))
    a = assess(crit, [load_run(ref, tracking_uri=store.tracking_uri, progress=False)],
               load_run(cand, tracking_uri=store.tracking_uri, progress=False))
    r = a.result("L0.planned_steps")
    assert r.outcome == "fail" and r.evidence["last_step"] == 299
    assert a.verdict == "fail"
