"""Multi-process jobs under torchrun record ONE MLflow run (docs/multiprocess.md).

Real processes: ``python -m torch.distributed.run --standalone --nproc-per-node 4``, the
digits MLP in DDP on gloo (CPU), a real sqlite store; one launch shared by the assertions (a
module-scoped fixture).  Rank 3 is SIGKILLed with its delivery process after its last step,
so the job also shows a killed rank delivered by ``refrun sync``.  The 2-rank torchrun job is
the scaling demo's candidate (tests/test_pipeline_scaling.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from refrun import schema

pytestmark = pytest.mark.slow  # two torchrun launches (2 and 4 ranks), shared by the tests

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
BATCH = 16
WORKLOAD = "ddp-mlp"


def wait_for(condition, what: str, timeout: float = 240.0, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@dataclass
class Job:
    tmp: Path
    uri: str
    spool: Path
    world: int
    env: dict[str, str]
    rc: int

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)

    def losses(self, rank: int) -> list[float]:
        return json.loads((self.tmp / f"losses.json.rank{rank}").read_text())

    def runs(self):
        c = self.client()
        exp = c.get_experiment_by_name(WORKLOAD)
        return c.search_runs([exp.experiment_id]) if exp else []


def job_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db",
               REFRUN_SPOOL_DIR=str(tmp / "spool"), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                   [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]))
    env.pop("REFRUN_JOB_ID", None)
    return env


def torchrun(tmp: Path, world: int, *extra: str) -> subprocess.Popen:
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(world), "-m", "pipelines.scaling.ddp_job", "--steps", str(STEPS), "--batch",
         str(BATCH), "--workload", WORKLOAD, "--losses", str(tmp / "losses.json"), *extra],
        cwd=tmp, env=job_env(tmp), stdout=open(tmp / "torchrun.log", "wb"),
        stderr=subprocess.STDOUT)


def spool_of(spool_root: Path, rank: int) -> Path:
    for d in spool_root.iterdir():
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("rank") == rank:
            return d
    raise AssertionError(f"no spool of rank {rank} under {spool_root}")


def loss_lines(spool: Path) -> int:
    p = spool / "points.tsv"
    return sum(1 for line in p.read_text().splitlines() if line.startswith("loss\t"))


KILLED_RANK = 3


@pytest.fixture(scope="module")
def job4(tmp_path_factory) -> Job:
    """4 ranks; rank 3 hangs after its last step and is SIGKILLed with its delivery process;
    ranks 0-2 end normally (their data is waited for)."""
    tmp = tmp_path_factory.mktemp("job4")
    proc = torchrun(tmp, 4, "--hang-rank", str(KILLED_RANK))
    try:
        # Ranks 0-2 closed their runs (each rank writes its losses after its run closed):
        # rank 3's SIGKILL makes torchrun terminate every rank still running.
        wait_for(lambda: all((tmp / f"losses.json.rank{k}").exists() for k in (0, 1, 2))
                 and (tmp / f"losses.json.rank{KILLED_RANK}.hanging").exists(),
                 "ranks 0-2 done, rank 3 hanging")
        spool = spool_of(tmp / "spool", KILLED_RANK)
        wait_for(lambda: loss_lines(spool) == STEPS and schema.TAG_WARMUP_STEPS in json.loads(
            (spool / "meta.json").read_text())["tags"], "rank 3's points and probe tags spooled")
        meta = json.loads((spool / "meta.json").read_text())
        os.kill(meta["delivery_pid"], signal.SIGKILL)
        os.kill(meta["pid"], signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    job = Job(tmp, f"sqlite:///{tmp}/mlflow.db", tmp / "spool", 4, job_env(tmp), rc)
    wait_for(lambda: len(job.runs()) == 1 and all(
        f"{schema.TAG_JOB_REPORTED_PREFIX}rank-{k}" in job.runs()[0].data.tags
        for k in (1, 2)), "ranks 1 and 2 on the run")
    return job


@pytest.fixture(scope="module")
def synced(job4: Job) -> Job:
    """The same job after ``refrun sync`` delivered the killed rank's spool (a no-op when
    test_killed_rank_delivered_by_refrun_sync, which runs first, already did)."""
    out = subprocess.run([sys.executable, "-m", "refrun", "sync", "--spool-dir",
                          str(job4.spool)], env=job4.env, cwd=job4.tmp, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return job4


def rank_curves(job: Job, run_id: str, rank: int) -> pd.DataFrame:
    from refrun.store.curves import read_curves

    root = Path(job.client().get_run(run_id).info.artifact_uri.removeprefix("file://"))
    path = root / (schema.ARTIFACT_CURVES if rank == 0 else schema.rank_curves_artifact(rank))
    return read_curves(path)


def steady(df: pd.DataFrame, warmup: int) -> np.ndarray:
    v = df[df["metric"] == schema.M_STEP_TIME].sort_values("step")["value"].to_numpy()
    return v[warmup:]


def test_four_ranks_record_one_run_with_rank0_curves(job4: Job) -> None:
    runs = job4.runs()
    assert len(runs) == 1  # ranks > 0 create no run
    run = runs[0]
    tags = run.data.tags
    assert tags[schema.TAG_JOB_RANK] == "0"
    assert tags[schema.TAG_JOB_WORLD_SIZE] == "4"
    assert tags[schema.TAG_JOB_ID].startswith("torchelastic:")
    assert run.info.status == "FINISHED"
    # The run's loss is rank 0's own numbers (not another rank's, not a mean).
    hist = job4.client().get_metric_history(run.info.run_id, schema.M_LOSS)
    assert [m.step for m in hist] == list(range(STEPS))
    np.testing.assert_allclose([m.value for m in hist], job4.losses(0), rtol=0, atol=1e-7)
    assert not np.allclose(job4.losses(0), job4.losses(1))  # ranks differ: it matters which
    # No point duplicated: the history holds each step once per metric.
    assert len({m.step for m in hist}) == len(hist)


def test_killed_rank_delivered_by_refrun_sync(job4: Job) -> None:
    from refrun.comparison import load_run

    job = job4
    assert job.rc != 0  # torchrun saw its worker killed
    (run,) = job.runs()
    rid = run.info.run_id
    # Before sync: the killed rank's data is only in its spool.
    listed = {a.path for a in job.client().list_artifacts(rid, schema.ARTIFACT_RANKS_DIR)}
    assert schema.rank_curves_artifact(KILLED_RANK) not in listed
    before = load_run(rid, tracking_uri=job.uri, progress=False)
    assert before.job is not None
    assert before.job.reported == "3 of 4 ranks reported (missing: 3)"
    # A rank missing: no straggler ratio a criterion could pass on, only the count.
    assert schema.M_JOB_STRAGGLER not in before.metric_names
    assert before.series(schema.M_JOB_RANKS_REPORTED)[1].tolist() == [3.0]
    assert straggler_claim(before, 1e9) == "not_evaluable"
    out = subprocess.run([sys.executable, "-m", "refrun", "sync", "--spool-dir", str(job.spool)],
                         env=job.env, cwd=job.tmp, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    run = job.client().get_run(rid)
    assert run.data.tags[f"{schema.TAG_JOB_REPORTED_PREFIX}rank-{KILLED_RANK}"] == "KILLED"
    df = rank_curves(job, rid, KILLED_RANK)
    loss = df[df["metric"] == schema.M_LOSS].sort_values("step")
    np.testing.assert_allclose(loss["value"], job.losses(KILLED_RANK), rtol=0, atol=1e-7)
    assert len(job.runs()) == 1  # sync created no second run
    after = load_run(rid, tracking_uri=job.uri, progress=False)
    assert after.job is not None and after.job.reported == "4 of 4 ranks reported"
    assert after.job.rank_status[KILLED_RANK] == "KILLED"
    assert after.job.complete and schema.M_JOB_STRAGGLER in after.metric_names
    assert after.job.rank_status == {0: "FINISHED", 1: "FINISHED", 2: "FINISHED", 3: "KILLED"}
    # Reported is not finished: a criterion can require every rank to have FINISHED.
    assert after.series(schema.M_JOB_RANKS_FINISHED)[1].tolist() == [3.0]


def test_four_ranks_artifacts_and_tags(synced: Job) -> None:
    job4 = synced
    run = job4.runs()[0]
    rid = run.info.run_id
    listed = {a.path for a in job4.client().list_artifacts(rid, schema.ARTIFACT_RANKS_DIR)}
    for k in range(1, 4):
        assert schema.rank_curves_artifact(k) in listed
        assert schema.rank_summary_artifact(k) in listed
        assert run.data.tags[f"{schema.TAG_JOB_REPORTED_PREFIX}rank-{k}"] == (
            "KILLED" if k == KILLED_RANK else "FINISHED")
        df = rank_curves(job4, rid, k)
        loss = df[df["metric"] == schema.M_LOSS].sort_values("step")
        assert loss["step"].tolist() == list(range(STEPS))
        np.testing.assert_allclose(loss["value"], job4.losses(k), rtol=0, atol=1e-7)
        assert (df["metric"] == schema.M_STEP_TIME).sum() == STEPS  # step time kept
        assert df["metric"].str.startswith("sys/").any()  # system metrics kept
    assert schema.rank_curves_artifact(0) not in listed  # rank 0's are the run's own curves


def test_four_ranks_straggler_matches_numpy(synced: Job) -> None:
    from refrun.comparison import load_run

    job4 = synced
    rid = job4.runs()[0].info.run_id
    data = load_run(rid, tracking_uri=job4.uri, progress=False)
    assert data.job is not None
    assert data.job.ranks_reported == [0, 1, 2, 3] and data.job.missing_ranks == []
    assert data.job.reported == "4 of 4 ranks reported"
    # Independent: median of each rank's step times after its 2 warm-up steps; the
    # slowest over the median of those medians.
    meds = [float(np.median(steady(rank_curves(job4, rid, k), 2))) for k in range(4)]
    expected = max(meds) / float(np.median(meds))
    s = data.job.straggler
    assert s is not None and s.ranks == 4
    assert s.ratio == pytest.approx(expected, rel=1e-12)
    assert s.slowest_rank == int(np.argmax(meds))
    # ... and available to criteria as a metric of the run.
    steps, values, _ = data.series(schema.M_JOB_STRAGGLER)
    assert values.tolist() == [pytest.approx(expected, rel=1e-12)]
    assert steps.tolist() == [STEPS - 1]
    assert data.series(schema.M_JOB_RANKS_REPORTED)[1].tolist() == [4.0]
    assert data.series(schema.M_JOB_RANKS_FINISHED)[1].tolist() == [3.0]  # rank 3 KILLED


def straggler_claim(run, at_most: float) -> str:
    """Outcome of a criteria-file bound on the straggler ratio for candidate ``run``."""
    from refrun.acceptance import checks
    from refrun.acceptance.criteria import parse_criteria

    crit = parse_criteria(f"""
workload = "{WORKLOAD}"
[[criteria]]
id = "straggler"
level = "L2"
kind = "claim"
metric = "{schema.M_JOB_STRAGGLER}"
at_most = {at_most}
""")
    return checks.evaluate(crit.criteria[0], checks.Context(crit, [run], run, None)).outcome


def test_criteria_bound_the_straggler_ratio(synced: Job) -> None:
    from refrun.comparison import load_run

    job4 = synced
    data = load_run(job4.runs()[0].info.run_id, tracking_uri=job4.uri, progress=False)
    ratio = data.job.straggler.ratio
    assert straggler_claim(data, ratio * 1.01) == "pass"
    assert straggler_claim(data, ratio * 0.99) == "fail"
