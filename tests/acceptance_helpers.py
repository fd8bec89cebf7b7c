"""Real runs for the acceptance tests, recorded with refrun.start_run into a sqlite store.

The arrays each run logs are kept (``Logged``) so that tests can check evidence values
against numpy computed on the raw data, independently of the code under test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import refrun

N = 100  # steps 0..99
STEPS = np.arange(N)


@dataclass
class Logged:
    run_id: str
    metrics: dict[str, np.ndarray]  # metric -> values at STEPS (NaN: not logged)
    tags: dict[str, str] = field(default_factory=dict)


def loss_envelope_criteria(workload: str) -> str:
    """A criteria file with one wide loss envelope (k = 5 std, 90 % of steps)."""
    return f"""\
version = 1
workload = "{workload}"

[[criteria]]
id = "loss-envelope"
level = "L1"
kind = "envelope"
metric = "loss"
band = "std"
k = 5.0
min_fraction = 0.9
"""


def base_loss() -> np.ndarray:
    return 2.3 * np.exp(-STEPS / 30.0) + 0.2


def record(uri: str, spool: Path, role: str, metrics: dict[str, np.ndarray], *,
           hardware: str = "nvidia-l4", backend: str | None = "torch", seed: int = 0,
           tags: dict[str, str] | None = None,
           planned_steps: int | None = N, eval_every: int = 10,
           fail: bool = False, hold_s: float = 0.0) -> Logged:
    """Record one run: per-step metrics at every step where the value is not None;
    ``eval/...`` metrics only every ``eval_every`` steps and at the last step.
    ``hold_s``: the run's own time after its points (a workload that takes that long:
    the hours L4 cost prices, refrun's start-up left out)."""
    run = refrun.start_run("accept-test", role, hardware=hardware, backend=backend, seed=seed,
                           chips=1, tracking_uri=uri, spool_dir=spool, tags=tags or {},
                           planned_steps=planned_steps, snapshot_environment=False,
                           # in-process delivery: these tests are about acceptance, and a
                           # delivery process per run (an MLflow import each) cost CI minutes
                           delivery="thread")
    try:
        with run:
            n = max(len(v) for v in metrics.values())
            for i in range(n):
                point = {}
                for m, v in metrics.items():
                    if i >= len(v):
                        continue
                    if m.startswith("eval/") and not (i % eval_every == eval_every - 1
                                                      or i == n - 1):
                        continue
                    if v[i] is None or (isinstance(v[i], float) and np.isnan(v[i])
                                        and m.startswith("eval/")):
                        continue
                    point[m] = float(v[i])
                run.log_metrics(i, point)
            time.sleep(hold_s)  # the workload's own time, not a wait for a condition
            if fail:
                raise RuntimeError("simulated crash")
    except RuntimeError:
        pass
    assert run.run_id is not None
    return Logged(run.run_id, metrics, dict(tags or {}))


def eval_steps(n: int = N, every: int = 10) -> np.ndarray:
    s = [i for i in range(n) if i % every == every - 1 or i == n - 1]
    return np.array(sorted(set(s)))


# An L3 goal on the loss (a file without L3 holds L4 back): for files that judge L4.
GOAL_CLAIM = """
[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "loss"
at_most = 1.0
"""


def write_criteria(tmp: Path, body: str, name: str = "criteria.toml") -> Path:
    p = tmp / name
    p.write_text(body, encoding="utf-8")
    return p


def error_line(err: str) -> str:
    """The CLI's one-line error (MLflow's own INFO log lines on stderr are not refrun's)."""
    mine = [line for line in err.splitlines() if line.startswith("refrun ")]
    assert len(mine) == 1, err
    return mine[0]
