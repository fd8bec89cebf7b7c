"""A 2-process ``jax.distributed`` job on CPU records ONE MLflow run (docs/multiprocess.md).

Two real processes (tests/jax_helpers/distributed_worker.py) with gloo collectives, recorded
through the JAX probe with ``rank=jax.process_index(), world_size=jax.process_count()``; the
job id is left to the default rule (both processes share their launcher: this test).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refrun import schema
from refrun.store.curves import read_curves

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "jax_helpers" / "distributed_worker.py"
STEPS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_jax_distributed_two_processes_one_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from refrun.comparison import load_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, REFRUN_SPOOL_DIR=str(tmp_path / "spool"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    for k in ("REFRUN_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANK", "WORLD_SIZE",
              "XLA_FLAGS"):
        env.pop(k, None)
    addr = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"w{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    procs = [subprocess.Popen([sys.executable, str(WORKER), addr, str(i), "2", str(STEPS),
                               str(tmp_path)], env=env, cwd=tmp_path, stdout=logs[i],
                              stderr=subprocess.STDOUT) for i in range(2)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        logs[i].close()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("jax-dist")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # process 1 created no run
    run = runs[0]
    tags = run.data.tags
    assert (tags[schema.TAG_JOB_RANK], tags[schema.TAG_JOB_WORLD_SIZE]) == ("0", "2")
    # Default job id: shared launcher (this process) on this host.
    assert tags[schema.TAG_JOB_ID].startswith(f"{socket.gethostname()}:{os.getpid()}:")
    assert tags[f"{schema.TAG_JOB_REPORTED_PREFIX}rank-1"] == "FINISHED"
    own = [json.loads((tmp_path / f"losses.rank{k}.json").read_text()) for k in range(2)]
    hist = sorted(client.get_metric_history(run.info.run_id, schema.M_LOSS), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(STEPS))
    np.testing.assert_allclose([m.value for m in hist], own[0], rtol=0, atol=1e-6)
    root = Path(run.info.artifact_uri.removeprefix("file://"))
    df = read_curves(root / schema.rank_curves_artifact(1))
    loss = df[df["metric"] == schema.M_LOSS].sort_values("step")
    np.testing.assert_allclose(loss["value"], own[1], rtol=0, atol=1e-6)
    assert (df["metric"] == schema.M_STEP_TIME).sum() == STEPS
    data = load_run(run.info.run_id, tracking_uri=uri, progress=False)
    assert data.job is not None and data.job.reported == "2 of 2 ranks reported"
    meds = []
    for k in range(2):
        c = read_curves(root / (schema.ARTIFACT_CURVES if k == 0
                                else schema.rank_curves_artifact(k)))
        st = c[c["metric"] == schema.M_STEP_TIME].sort_values("step")["value"].to_numpy()[1:]
        meds.append(float(np.median(st)))
    assert data.job.straggler is not None
    assert data.job.straggler.ratio == pytest.approx(max(meds) / float(np.median(meds)),
                                                     rel=1e-12)
