"""The delivery writes a run's points, tags and params to a local sqlite store through
refrun's own access (:mod:`refrun.store.direct`) where it may, and the store then holds
exactly what MLflow's client would have written."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sqlite3
from pathlib import Path

import refrun
from refrun import schema
from refrun.recording import delivery
from refrun.store.direct import DirectClient


def _record(root: Path) -> str:
    """One run with what a training run logs: per-step points, NaN and +-inf, a step
    logged twice with the same value, evaluation points, params and tags (one changed
    while it runs); returns its run id."""
    with refrun.start_run("direct-delivery", "candidate", seed=3, hardware="cpu",
                          tracking_uri=f"sqlite:///{root}/mlflow.db",
                          spool_dir=str(root / "spool"), snapshot_environment=False,
                          params={"lr": 0.01, "batch": 32}) as run:
        for step in range(300):
            run.log(step, loss=1.0 / (step + 1), grad_norm=float(step % 7))
            if step % 50 == 0:
                run.log_eval(step, accuracy=step / 300)
        run.log(300, loss=math.nan, grad_norm=math.inf)
        run.log(301, loss=-math.inf)
        run.log(5, loss=1.0 / 6)  # a step logged again with its value
        run.set_tags({"phase": "one"})
        run.set_tags({"phase": "two"})
        return run.run_id


def _stored(root: Path, run_id: str) -> dict[str, list[tuple]]:
    """The rows a run has in MLflow's tables, without the run id and the times: the
    metric points as the set of (key, value, step, is_nan) a history shows (a step logged
    again with its value is one row or two as the two loggings fall in one millisecond
    or not, whichever client writes it)."""
    con = sqlite3.connect(root / "mlflow.db")
    try:
        return {
            "metrics": sorted(set(con.execute(
                "SELECT key, value, step, is_nan FROM metrics WHERE run_uuid = ?",
                (run_id,)).fetchall())),
            "latest": sorted(con.execute(
                "SELECT key, value, step, is_nan FROM latest_metrics WHERE run_uuid = ?",
                (run_id,)).fetchall()),
            "params": sorted(con.execute(
                "SELECT key, value FROM params WHERE run_uuid = ?", (run_id,)).fetchall()),
            "tags": sorted(con.execute(
                "SELECT key, value FROM tags WHERE run_uuid = ? AND key NOT IN "
                "('mlflow.runName', 'refrun.local_id', 'refrun.perf.recording_start_s', "
                "'refrun.perf.recording_close_s') "
                "AND key NOT LIKE '%time%' "
                "AND key NOT LIKE 'refrun.env.%' AND key NOT LIKE 'refrun.host%'",
                (run_id,)).fetchall()),
        }
    finally:
        con.close()


def test_a_run_delivered_directly_is_stored_as_mlflow_stores_it(tmp_path, monkeypatch) -> None:
    """The same run recorded twice, delivered on the training process's thread: once with
    MLflow's SQL ``log_batch`` made to fail (every point, tag and param still arrives:
    refrun's own access wrote them), once through MLflow's client
    (``REFRUN_SQLITE_DIRECT=0``); the store holds the same rows either way."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    def refuse(*args, **kwargs):
        raise AssertionError("MLflow's log_batch was called")

    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    monkeypatch.setenv("REFRUN_CLOSE_TIMEOUT_S", "2")
    monkeypatch.delenv("REFRUN_SQLITE_DIRECT", raising=False)
    with monkeypatch.context() as m:
        m.setattr(SqlAlchemyStore, "log_batch", refuse)
        direct = _stored(tmp_path / "direct", _record(tmp_path / "direct"))
    assert isinstance(delivery.points_client(f"sqlite:///{tmp_path}/direct/mlflow.db"),
                      DirectClient)
    monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "0")
    mlflow = _stored(tmp_path / "mlflow", _record(tmp_path / "mlflow"))
    assert {r[2] for r in direct["metrics"] if r[0] == "loss"} == set(range(302))
    assert ("loss", 0.0, 300, 1) in direct["metrics"]  # NaN as MLflow keeps it
    assert ("lr", "0.01") in direct["params"] and ("phase", "two") in direct["tags"]
    for part in ("metrics", "latest", "params", "tags"):
        assert direct[part] == mlflow[part], part


TRAINER = """
import sys
import refrun
from refrun import schema
with refrun.start_run("direct-delivery", "candidate", seed=int(sys.argv[2]), hardware="cpu",
                      tracking_uri=sys.argv[1], params={"lr": 0.01}) as run:
    for step in range(120):
        run.log(step, loss=1.0 / (step + 1))
        if step % 40 == 0:
            run.log_eval(step, accuracy=step / 120)
    run.set_tags({"phase": "done"})
print(run.run_id)
print("mlflow" in sys.modules, "sqlalchemy" in sys.modules)
"""


def _train(tmp_path: Path, uri: str, seed: int, env: dict[str, str]) -> tuple[str, str]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TRAINER, uri, str(seed)],
                          env={**os.environ, **env}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id, imported = proc.stdout.strip().splitlines()[-2:]
    return run_id, imported


def test_a_trainer_recording_into_an_existing_store_never_imports_mlflow(tmp_path) -> None:
    """Into a store whose experiment exists, a trainer and its delivery process (refrun's
    default) create, fill, upload and end the run without MLflow: MLflow is made
    unimportable for both, and the run still reads back through MLflow's client FINISHED,
    with every point, its artifacts and the same tags and params as a run recorded
    through MLflow's client (``REFRUN_SQLITE_DIRECT=0``)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {"REFRUN_DELIVERY": "process", "REFRUN_SQLITE_DIRECT": "1"}
    first, imported = _train(tmp_path, uri, 0, env)  # a new store: MLflow creates it
    assert imported == "True True"
    blocked = tmp_path / "no-mlflow" / "mlflow"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('mlflow imported')\n")
    # its version file stays readable: refrun reads it (without importing MLflow) to know
    # the release whose schema the store has
    real = importlib.util.find_spec("mlflow").submodule_search_locations[0]
    shutil.copy(Path(real) / "version.py", blocked / "version.py")
    no_mlflow = {**env, "PYTHONPATH": os.pathsep.join(
        [str(blocked.parent), os.environ.get("PYTHONPATH", "")])}
    direct, imported = _train(tmp_path, uri, 1, no_mlflow)
    assert imported == "False False"
    through_mlflow, _ = _train(tmp_path, uri, 1, {**env, "REFRUN_SQLITE_DIRECT": "0"})
    c = MlflowClient(uri)
    runs = {k: c.get_run(r) for k, r in (("direct", direct), ("mlflow", through_mlflow))}
    for k, run in runs.items():
        assert run.info.status == "FINISHED" and run.info.end_time >= run.info.start_time, k
        assert [m.step for m in c.get_metric_history(run.info.run_id, "loss")] == \
            list(range(120)), k
    arts = {k: sorted(a.path for a in c.list_artifacts(r.info.run_id, "refrun"))
            for k, r in runs.items()}
    assert "refrun/curves.parquet" in arts["direct"] and arts["direct"] == arts["mlflow"]
    assert runs["direct"].data.params == runs["mlflow"].data.params == {"lr": "0.01"}
    varying = ("mlflow.runName", "refrun.local_id", "refrun.host", "refrun.pid",
               schema.TAG_RECORDING_START_S, schema.TAG_RECORDING_CLOSE_S)  # durations
    tags = {k: {t: v for t, v in r.data.tags.items()
                if t not in varying and "time" not in t and not t.startswith("refrun.env.")}
            for k, r in runs.items()}
    assert tags["direct"] == tags["mlflow"] and tags["direct"]["phase"] == "done"
    assert first != direct != through_mlflow
