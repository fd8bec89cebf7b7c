"""Multi-process identity without launching anything: the job-id rule, the validation of
rank / world size / job, and what a rank > 0 session writes (no run, artifacts renamed)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.settings import default_job_id, job_identity

LAUNCHER_VARS = ("REFRUN_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID",
                 "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_job_id_rule_in_order(clean_env) -> None:
    m = clean_env
    assert job_identity().job is None and job_identity().world_size is None
    m.setenv("WORLD_SIZE", "4")
    m.setenv("RANK", "2")
    m.setenv("MASTER_ADDR", "10.0.0.1")
    m.setenv("MASTER_PORT", "29500")
    fallback = job_identity()
    assert (fallback.rank, fallback.world_size) == (2, 4)
    host, ppid, _start, addr, port, world = fallback.job.split(":")
    assert (host, int(ppid), addr, port, world) == (socket.gethostname(), os.getppid(),
                                                    "10.0.0.1", "29500", "4")
    m.setenv("SLURM_JOB_ID", "77")
    m.setenv("SLURM_STEP_ID", "3")
    assert job_identity().job == "slurm:77.3"
    m.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rendezvous id: not unique
    assert job_identity().job == "slurm:77.3"
    m.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert job_identity().job == "torchelastic:abc"
    m.setenv("REFRUN_JOB_ID", "my-job")
    assert job_identity().job == "my-job"
    m.setenv("WORLD_SIZE", "1")
    assert job_identity().job is None  # one process: no job
    assert default_job_id(None) is not None  # REFRUN_JOB_ID still names it when asked


def test_bad_launcher_variable_is_one_line_error(clean_env) -> None:
    clean_env.setenv("WORLD_SIZE", "four")
    with pytest.raises(RefrunInputError, match=r"\$WORLD_SIZE='four'"):
        job_identity()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rank": 2, "world_size": 2, "job": "j"}, "rank: expected 0 <= rank < world_size=2"),
    ({"rank": None, "world_size": 2, "job": "j"}, "rank: expected"),
    ({"rank": 0, "world_size": 0, "job": "j"}, "world_size: must be >= 1"),
    ({"rank": 0, "world_size": 2, "job": "a'b"}, "job: a multi-process job needs an id"),
    ({"rank": True, "world_size": 2, "job": "j"}, "rank: expected an integer"),
])
def test_bad_rank_world_size_job_refused_before_anything_is_written(store, clean_env, kwargs,
                                                                     match) -> None:
    import refrun

    with pytest.raises(RefrunInputError, match=match):
        refrun.start_run("w", "candidate", **kwargs)
    assert not store.spool_dir.exists() or not any(store.spool_dir.iterdir())


def test_secondary_rank_creates_no_run_and_renames_its_artifacts(store, clean_env) -> None:
    import refrun

    with socket.socket() as s:  # a store nobody listens on: close() cannot deliver
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    run = refrun.start_run("w", "candidate", rank=1, world_size=2, job="job-1",
                           delivery="thread", close_timeout_s=0, tracking_uri=dead)
    run.log(0, loss=1.0)
    run.log_json("refrun/extra.json", {"a": 1})
    spool = run.spool.path
    meta = json.loads((spool / "meta.json").read_text())
    assert (meta["rank"], meta["world_size"], meta["job"]) == (1, 2, "job-1")
    assert meta["tags"][schema.TAG_JOB_RANK] == "1"
    assert (spool / "artifacts" / schema.rank_artifact(1, "refrun/extra.json")).is_file()
    assert (spool / "artifacts" / schema.rank_artifact(1, schema.ARTIFACT_ENVIRONMENT)).is_file()
    assert not run.close()  # rank 0's run cannot be found: nothing delivered, spool kept
    assert run.run_id is None  # and this rank never created a run of its own
    assert (spool / "artifacts" / schema.rank_curves_artifact(1)).is_file()
    assert not (spool / "artifacts" / schema.ARTIFACT_CURVES).exists()


def test_probe_notices_a_job_the_run_was_not_told_about() -> None:
    from refrun.probes.job import job_mismatch

    assert job_mismatch(None, 1, "x") is None  # one process, one run
    assert job_mismatch(4, 4, "x") is None  # the run knows the job
    msg = job_mismatch(None, 2, "jax.process_count()")
    assert msg is not None and "world_size=1" in msg and "rank= and world_size=" in msg
    assert job_mismatch(2, 4, "torch.distributed.get_world_size()") is not None


def test_one_sync_delivers_a_job_whose_rank0_never_reached_the_store(tmp_path, clean_env,
                                                                      monkeypatch) -> None:
    """Both ranks' spools left behind (the store was unreachable for the whole job): one
    ``refrun sync`` creates rank 0's run first, then adds rank 1 to it, whatever the order
    of the spool directories."""
    import refrun
    from refrun.recording.sync import sync_all

    monkeypatch.setenv("REFRUN_SPOOL_DIR", str(tmp_path / "spool"))
    blocker = tmp_path / "store"
    blocker.write_text("a file where the store's directory should be")  # unreachable store
    uri = f"sqlite:///{blocker}/mlflow.db"
    runs = {}
    for rank in (1, 0):
        run = refrun.start_run("w", "candidate", rank=rank, world_size=2, job="job-s",
                               tracking_uri=uri, delivery="thread", close_timeout_s=0)
        run.log(0, loss=float(rank))
        assert not run.close()
        runs[rank] = run
    # rank 1's spool sorts first by name: sync must still do rank 0's first.
    (tmp_path / "spool" / runs[1].local_id).rename(tmp_path / "spool" / ("0" + runs[1].local_id))
    blocker.unlink()
    blocker.mkdir()
    results = sync_all(tmp_path / "spool")
    assert [r.outcome for r in results] == ["delivered", "delivered"], results
    assert results[0].local_id == runs[0].local_id
    assert results[0].run_id == results[1].run_id
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (only,) = client.search_runs([client.get_experiment_by_name("w").experiment_id])
    assert only.data.tags[f"{schema.TAG_JOB_REPORTED_PREFIX}rank-1"] == "FINISHED"


def test_job_summary_by_hand(tmp_path) -> None:
    """Straggler over each rank's steady step times (its own warm-up skipped), computed by
    hand; a missing rank leaves the ratio out of the derived metrics."""
    import numpy as np
    import pandas as pd

    from refrun.comparison.ranks import derived_points, job_summary

    def curves(times: list[float]) -> pd.DataFrame:
        n = len(times)
        return pd.DataFrame({"metric": [schema.M_STEP_TIME] * n, "step": np.arange(n),
                             "value": times, "timestamp_ms": np.zeros(n, np.int64),
                             "seq": np.arange(n)})

    data = {"r1": curves([9.0, 1.0, 3.0, 2.0]), "r2": curves([5.0, 4.0, 4.0, 6.0])}
    summary1 = tmp_path / "rank-1.json"  # rank 1's summary: its status and warm-up tag
    summary1.write_text(json.dumps({"status": "KILLED",
                                    "tags": {schema.TAG_WARMUP_STEPS: "1"}}))
    rank_files = {1: ("r1", summary1), 2: ("r2", None)}
    tags = {schema.TAG_JOB_WORLD_SIZE: "3", schema.TAG_JOB_ID: "j",
            schema.TAG_WARMUP_STEPS: "0"}
    s = job_summary(tags, curves([2.0, 2.0, 2.0]), rank_files, lambda p, m: data[p],
                    "FINISHED")
    # medians: rank 0 median(2,2,2)=2; rank 1 (1 warm-up step) median(1,3,2)=2; rank 2 (no
    # summary: no warm-up) median(5,4,4,6)=4.5; median of medians 2 -> ratio 4.5/2.
    assert s is not None and s.straggler is not None
    assert (s.straggler.slowest_rank, s.straggler.ratio) == (2, 2.25)
    assert s.rank_status == {0: "FINISHED", 1: "KILLED", 2: "unknown"}
    assert s.complete and s.ranks_finished == 1
    pts = derived_points(s, 7)
    assert dict(zip(pts["metric"], pts["value"], strict=True)) == {
        schema.M_JOB_RANKS_REPORTED: 3.0, schema.M_JOB_RANKS_FINISHED: 1.0,
        schema.M_JOB_STRAGGLER: 2.25}
    missing = job_summary(tags, curves([2.0]), {1: rank_files[1]}, lambda p, m: data[p])
    assert missing is not None and missing.missing_ranks == [2] and not missing.complete
    assert schema.M_JOB_STRAGGLER not in set(derived_points(missing, 0)["metric"])
    assert job_summary({}, None, {}, lambda p, m: data[p]) is None  # not a job
