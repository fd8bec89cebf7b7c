"""Real runs for the report tests: recorded with refrun.start_run into a sqlite store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import refrun

N_STEPS = 600
SPIKE_STEP = 400
NAN_STEP = 123
XSS_NAME = "<img src=x onerror=\"document.title='pwned'\">"
XSS_TAG = "</script><script>document.title='pwned'</script>"
XSS_PARAM = "<b onmouseover=alert(1)>bold</b> & \u2028"
FALLBACK = '{"aten::nonzero": 12, "aten::_unique2": 3}'


@dataclass
class Runs:
    uri: str
    spool: Path
    references: list[str]
    candidate: str


def _loss(seed: int, steps: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 2.0 * np.exp(-steps / 200.0) + 0.3 + rng.normal(0, 0.01, len(steps))


def _record(uri: str, spool: Path, role: str, hardware: str, seed: int, *,
            name: str, tags: dict[str, str], params: dict[str, str],
            steps: list[int], loss_shift: float, spike: bool, nan: bool) -> str:
    s = np.asarray(steps)
    loss = _loss(seed, s) + loss_shift
    if spike:
        loss[s == SPIKE_STEP] += 1.0
    st = 0.05 + 0.001 * (seed % 3) + (0.01 if role == "candidate" else 0.0)
    with refrun.start_run(workload="rep", role=role, hardware=hardware, backend="torch",
                          seed=seed, chips=1, run_name=name, tags=tags, params=params,
                          tracking_uri=uri, spool_dir=spool,
                          snapshot_environment=False,
                          delivery="thread") as run:  # in-process: these test the report
        for i, step in enumerate(steps):
            value = float("nan") if nan and step == NAN_STEP else float(loss[i])
            run.log(step, loss=value,
                    **{"perf/step_time_s": (1.0 if step < 3 else st + 0.002 * (step % 5)),
                       "compile/graphs": 1.0 if step == 0 or (role == "candidate"
                                                             and step == 250) else 0.0,
                       "xfer/d2h": 2.0, "sys/cpu_pct": 40.0 + 10 * np.sin(step / 30)})
            if step % 100 == 0:
                run.log_eval(step, accuracy=0.5 + step / 2000 + (0.01 if role == "candidate"
                                                                  else 0.0))
    assert run.run_id is not None
    return run.run_id


def record_runs(tmp: Path) -> Runs:
    """Two reference seeds and a candidate that was restarted (steps 300-349 written
    twice), has a NaN loss at step 123, a loss spike at step 400, a recompilation at step
    250, CPU-fallback ops, and a hostile run name, tag and param."""
    uri = f"sqlite:///{tmp}/mlflow.db"
    spool = tmp / "spool"
    # Artifacts inside the test's directory (not ./mlruns of whoever runs the tests).
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).create_experiment("rep", artifact_location=(tmp / "artifacts").as_uri())
    full = list(range(N_STEPS))
    refs = [_record(uri, spool, "reference", "h100", seed, name=f"ref seed {seed}",
                    tags={}, params={"lr": "3e-4"}, steps=full, loss_shift=0.0,
                    spike=False, nan=False) for seed in (0, 1)]
    restarted = list(range(350)) + list(range(300, N_STEPS))
    cand = _record(uri, spool, "candidate", "tpu-v5e", 7, name=XSS_NAME,
                   tags={"note": XSS_TAG, "refrun.fallback.ops": FALLBACK,
                         "refrun.exec.hardware": "TPU v5 lite"},
                   params={"lr": "3e-4", "comment": XSS_PARAM}, steps=restarted,
                   loss_shift=0.02, spike=True, nan=True)
    return Runs(uri, spool, refs, cand)


def record_good_candidate(runs: Runs) -> str:
    """A second candidate that behaves like a third reference seed (no shift, no spike,
    no NaN, no restart) on hardware ``gpu-x``."""
    return _record(runs.uri, runs.spool, "candidate", "gpu-x", 2, name="good candidate",
                   tags={}, params={"lr": "3e-4"}, steps=list(range(N_STEPS)),
                   loss_shift=0.0, spike=False, nan=False)


# Criteria that the shifted candidate (+0.02 on the loss, seed noise 0.01) fails and a
# third seed passes: |diff| <= 0.03 on 95 % of the steps; eval accuracy within 0.02.
CRITERIA = """version = 1
workload = "rep"

[[criteria]]
id = "loss-close"
kind = "closeness"
level = "L2"
metric = "loss"
abs_tol = 0.03
min_fraction = 0.95
description = "loss within 0.03 of the seed mean on 95 % of the steps"

[[criteria]]
id = "accuracy-close"
kind = "closeness"
level = "L2"
metric = "eval/accuracy"
abs_tol = 0.02
min_fraction = 1.0
description = "evaluation accuracy within 0.02"
"""


def raw_loss(uri: str, run_id: str) -> dict[int, float]:
    """The loss curve read straight from the run's curves artifact, last value per step
    (independent of refrun.comparison)."""
    import tempfile

    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as d:
        path = MlflowClient(uri).download_artifacts(run_id, "refrun/curves.parquet", d)
        t = pq.read_table(path).to_pandas()
    t = t[t["metric"] == "loss"].sort_values("seq")
    out: dict[int, float] = {}
    for step, value in zip(t["step"], t["value"], strict=True):
        out[int(step)] = float(value)
    return out
