"""refrun's own access to a local sqlite store (:mod:`refrun.store.direct`) against
MLflow's: what it writes reads back through MLflow's client exactly as what MLflow's client
writes, what it reads equals what MLflow's client reads, and ``refrun accept`` on a local
store never imports MLflow.

The expected values come from MLflow itself (the same run written, or read, through
``MlflowClient`` with ``$REFRUN_SQLITE_DIRECT=0``), never from the code under test.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from acceptance_helpers import loss_envelope_criteria

from refrun import schema, start_run
from refrun.comparison import load_run
from refrun.store import direct
from refrun.store.client import client as store_client
from refrun.store.complete import CompleteRun, curves_table, identity_tags, write_complete_run
from refrun.store.uri import sqlite_path

EXPERIMENT = "direct-test"


def _db(uri: str) -> Path:
    path = sqlite_path(uri)
    assert path is not None
    return path


def _table(seed: int) -> pd.DataFrame:
    """Points with everything MLflow's store treats specially: NaN, +-inf, a step logged
    twice (a resume), two metrics interleaved, per-point times."""
    rng = np.random.default_rng(seed)
    steps = [0, 1, 2, 3, 2, 3, 4, 5, 0, 1, 2, 5]
    metrics = ["loss"] * 8 + ["grad_norm"] * 4
    values = rng.normal(2.0, 0.5, len(steps))
    values[3], values[6], values[9] = math.nan, math.inf, -math.inf
    stamps = 1_700_000_000_000 + np.arange(len(steps)) * 7
    return curves_table(pd.Categorical(metrics), steps, values, stamps)


def _complete(tag_name: str) -> CompleteRun:
    tags = identity_tags(EXPERIMENT, "reference", hardware="cpu", backend="torch", seed=3)
    return CompleteRun(
        EXPERIMENT, {**tags, "user.note": "kept"}, _table(3),
        params={"lr": "0.1", "option.long": "x" * 300},
        json_artifacts={"refrun/extra.json": {"a": [1, 2, 3]}},
        file_artifacts={"refrun/raw.bin": b"\x00\x01bytes"},
        end_tags={"end.note": "done"},
        # a tag that needs the run's id, and a rename (MLflow keeps the name twice)
        tags_for_run=lambda client, run_id: {"link": f"run {run_id}",
                                             schema.TAG_RUN_NAME: tag_name})


def _normalised(run, run_id: str) -> dict:
    """What a reader sees of a run, with its own id and times taken out."""
    def plain(v: str) -> str:
        return v.replace(run_id, "<id>")

    return {
        "status": run.info.status, "name": run.info.run_name,
        "lifecycle": run.info.lifecycle_stage, "user": run.info.user_id,
        "experiment": run.info.experiment_id,
        "artifact_uri": plain(run.info.artifact_uri),
        "times": (run.info.start_time is not None, run.info.end_time is not None),
        "tags": {k: plain(v) for k, v in run.data.tags.items()},
        "params": dict(run.data.params),
        "metrics": {k: ("nan" if math.isnan(v) else v) for k, v in run.data.metrics.items()},
    }


def _history(client, run_id: str, key: str) -> list[tuple]:
    return [(m.step, "nan" if math.isnan(m.value) else m.value, m.timestamp)
            for m in client.get_metric_history(run_id, key)]


def test_this_mlflow_creates_a_schema_refrun_knows(store) -> None:
    """Fails when MLflow's schema changes: refrun's direct access must then be checked
    against the new schema (this file) before its revision is added to KNOWN_REVISIONS."""
    store.client().search_experiments()
    assert direct.schema_revision(_db(store.tracking_uri)) in direct.KNOWN_REVISIONS
    assert isinstance(store_client(store.tracking_uri, direct=True), direct.DirectClient)


def test_a_run_written_directly_reads_back_as_mlflows_own(store, monkeypatch) -> None:
    created = []
    original = direct.DirectClient.create_run

    def recording_create_run(self, *args, **kwargs):  # the real method, counted
        created.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(direct.DirectClient, "create_run", recording_create_run)
    monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "0")
    by_mlflow = write_complete_run(_complete("renamed run"), store.tracking_uri)
    assert created == []
    monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "1")
    by_refrun = write_complete_run(_complete("renamed run"), store.tracking_uri)
    assert created == [1]  # the experiment existed: written without MLflow's client

    mlflow = store.client()  # both read through MLflow's own client
    a, b = mlflow.get_run(by_mlflow), mlflow.get_run(by_refrun)
    assert _normalised(b, by_refrun) == _normalised(a, by_mlflow)
    assert b.info.run_name == "renamed run" and b.data.tags["link"] == f"run {by_refrun}"
    assert math.isnan(b.data.metrics["loss"]) is False  # latest by step: step 5's value
    for key in ("loss", "grad_norm"):
        assert _history(mlflow, by_refrun, key) == _history(mlflow, by_mlflow, key)
    loss = [m.value for m in mlflow.get_metric_history(by_refrun, "loss")]
    grad = [m.value for m in mlflow.get_metric_history(by_refrun, "grad_norm")]
    assert direct.FLOAT_MAX in loss and -direct.FLOAT_MAX in grad  # +-inf as MLflow keeps it
    assert sum(math.isnan(v) for v in loss) == 1
    found = mlflow.search_runs([a.info.experiment_id], "tags.`user.note` = 'kept' and "
                               "params.lr = '0.1' and metrics.grad_norm < 1e309")
    assert {r.info.run_id for r in found} == {by_mlflow, by_refrun}

    def artifacts(run_id: str) -> dict[str, bytes]:
        files = {}
        for d in ("refrun",):
            for f in mlflow.list_artifacts(run_id, d):
                files[f.path] = Path(mlflow.download_artifacts(run_id, f.path,
                                                               str(store.tmp))).read_bytes()
        return files

    fa, fb = artifacts(by_mlflow), artifacts(by_refrun)
    assert sorted(fa) == sorted(fb) == sorted(["refrun/curves.parquet", "refrun/extra.json",
                                               "refrun/raw.bin"])
    assert fa["refrun/raw.bin"] == fb["refrun/raw.bin"] == b"\x00\x01bytes"
    assert json.loads(fb["refrun/extra.json"]) == {"a": [1, 2, 3]}


def test_reads_equal_mlflows_for_recorded_and_plain_runs(store, monkeypatch) -> None:
    from mlflow.entities import Metric

    with start_run(EXPERIMENT, "reference", hardware="cpu", backend="torch", seed=1,
                   tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                   snapshot_environment=False, params={"lr": 0.1}) as run:
        for s in range(20):
            run.log(s, loss=1.0 / (s + 1), grad_norm=float(s))
        run.log(20, loss=float("nan"))
    mlflow = store.client()
    exp = mlflow.create_experiment("plain")
    plain = mlflow.create_run(exp, tags={"refrun.workload": "plain"}).info.run_id
    mlflow.log_batch(plain, metrics=[Metric("loss", v, 1000 + i, i) for i, v in enumerate(
        [3.0, math.nan, math.inf, -math.inf, 1.0])] + [Metric("loss", 9.0, 5000, 1)])
    mlflow.set_terminated(plain, "FINISHED")

    for run_id, source in ((run.run_id, "artifact"), (plain, "history")):
        monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "0")
        expected = load_run(run_id, tracking_uri=store.tracking_uri, progress=False)
        monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "1")
        got = load_run(run_id, tracking_uri=store.tracking_uri, progress=False)
        assert got.source == expected.source == source
        for attr in ("tags", "params", "status", "start_time_ms", "end_time_ms",
                     "experiment_id"):
            assert getattr(got, attr) == getattr(expected, attr), attr
        assert got.latest_metrics.keys() == expected.latest_metrics.keys()
        np.testing.assert_array_equal(list(got.latest_metrics.values()),
                                      list(expected.latest_metrics.values()))
        pd.testing.assert_frame_equal(got.curves, expected.curves)


def test_a_write_that_fails_midway_leaves_no_visible_run(store) -> None:
    write_complete_run(_complete("first"), store.tracking_uri)  # the experiment exists now
    bad = CompleteRun(EXPERIMENT, {"k": "v"}, _table(1),
                      json_artifacts={"refrun/bad.json": {"x": math.nan}})  # not JSON
    with pytest.raises(ValueError, match="JSON"):
        write_complete_run(bad, store.tracking_uri)
    mlflow = store.client()
    exp = mlflow.get_experiment_by_name(EXPERIMENT).experiment_id
    assert [r.info.run_name for r in mlflow.search_runs([exp])] == ["first"]
    with contextlib.closing(sqlite3.connect(_db(store.tracking_uri))) as con:
        stages = con.execute("SELECT status, lifecycle_stage FROM runs WHERE name != 'first' "
                             "AND experiment_id = ?", (int(exp),)).fetchall()
    assert stages == [("FAILED", "deleted")]


def test_what_refrun_does_not_know_goes_through_mlflow(store, tmp_path) -> None:
    # A new experiment: created by MLflow, with MLflow's own artifact location.
    run_id = write_complete_run(_complete("new"), store.tracking_uri)
    mlflow = store.client()
    exp = mlflow.get_experiment_by_name(EXPERIMENT)
    assert mlflow.get_run(run_id).info.artifact_uri.startswith(exp.artifact_location)
    # A schema revision refrun was not tested against: MLflow's client only.
    other = tmp_path / "other.db"
    other.write_bytes(_db(store.tracking_uri).read_bytes())
    with contextlib.closing(sqlite3.connect(other)) as con, con:
        con.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    assert direct.usable(_db(store.tracking_uri)) and not direct.usable(other)
    assert not direct.usable(tmp_path / "missing.db")


def test_setting_is_checked(monkeypatch) -> None:
    from refrun.errors import RefrunInputError
    from refrun.settings import sqlite_direct

    monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "yes")
    with pytest.raises(RefrunInputError, match=r"\$REFRUN_SQLITE_DIRECT='yes'"):
        sqlite_direct()


CRITERIA = loss_envelope_criteria(EXPERIMENT)


def test_accept_on_a_local_store_never_imports_mlflow(store, tmp_path, monkeypatch) -> None:
    """``refrun accept`` reads the runs and records its assessment without MLflow's
    client, with the verdict and evidence it has through MLflow's."""
    def written(role: str, seed: int, shift: float) -> str:
        rng = np.random.default_rng(seed)
        s = np.arange(60)
        loss = 2 * np.exp(-s / 20) + 0.3 + rng.normal(0, 0.01, 60) + (s >= 30) * shift
        tags = identity_tags(EXPERIMENT, role, hardware="cpu", backend="torch", seed=seed)
        return write_complete_run(CompleteRun(EXPERIMENT, tags, curves_table(
            pd.Categorical(["loss"] * 60), s, loss, 1)), store.tracking_uri)

    refs = [written("reference", s, 0.0) for s in range(4)]
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    code = ("import sys, json\nfrom refrun.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "print(json.dumps([rc, 'mlflow' in sys.modules]))\n")
    outcomes = {}
    for cand, shift in (("good", 0.0), ("bad", 0.5)):
        cid = written("candidate", 10 + len(outcomes), shift)
        for setting in ("1", "0"):
            args = ["accept", "--criteria", str(crit), "--reference", *refs,
                    "--candidate", cid, "--tracking-uri", store.tracking_uri,
                    "--json", str(tmp_path / f"{cand}{setting}.json")]
            proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                                  text=True, timeout=300, cwd=store.tmp,
                                  env={**os.environ,
                                       "REFRUN_SQLITE_DIRECT": setting})
            assert proc.returncode == 0, proc.stderr[-2000:]
            rc, imported = json.loads(proc.stdout.strip().splitlines()[-1])
            doc = json.loads((tmp_path / f"{cand}{setting}.json").read_text())
            outcomes[(cand, setting)] = (rc, imported, doc["verdict"], doc["evidence_sha256"])
    assert outcomes[("good", "1")][:3] == (0, False, "pass")
    assert outcomes[("bad", "1")][:3] == (1, False, "fail")
    for cand in ("good", "bad"):  # the same verdict and evidence as through MLflow
        assert outcomes[(cand, "0")][1] is True
        assert outcomes[(cand, "1")][::2] == outcomes[(cand, "0")][::2]
        assert outcomes[(cand, "1")][3] == outcomes[(cand, "0")][3]
    recorded = store.client().search_runs(
        [store.client().get_experiment_by_name(EXPERIMENT).experiment_id],
        f"tags.`{schema.TAG_ROLE}` = 'comparison'")
    assert sorted(r.data.tags[schema.TAG_ACCEPTANCE_VERDICT] for r in recorded) == [
        "fail", "fail", "pass", "pass"]


_WRITER = """
import sys
import numpy as np
import pandas as pd
from refrun.store.complete import CompleteRun, curves_table, write_complete_run
uri, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    table = curves_table(pd.Categorical(["loss"] * 50), np.arange(50),
                         np.linspace(3, 1, 50) + i, 1)
    write_complete_run(CompleteRun("direct-test", {"who": who, "i": str(i)}, table), uri)
"""


def test_concurrent_writers_direct_and_mlflow_lose_nothing(store) -> None:
    """Several processes writing complete runs at once (a sweep split over CI jobs), three
    through refrun's sqlite access and one through MLflow's client: every run arrives
    FINISHED with its points, none is lost to a locked database."""
    write_complete_run(_complete("first"), store.tracking_uri)  # the experiment exists
    procs = [subprocess.Popen(
        [sys.executable, "-c", _WRITER, store.tracking_uri, who, "6"],
        env={**os.environ, "REFRUN_SQLITE_DIRECT": "0" if who == "mlflow" else "1"},
        cwd=store.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for who in ("a", "b", "c", "mlflow")]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    mlflow = store.client()
    exp = mlflow.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = [r for r in mlflow.search_runs([exp], max_results=1000) if "who" in r.data.tags]
    assert sorted((r.data.tags["who"], int(r.data.tags["i"])) for r in runs) == sorted(
        (w, i) for w in ("a", "b", "c", "mlflow") for i in range(6))
    for r in runs:
        assert r.info.status == "FINISHED"
        hist = mlflow.get_metric_history(r.info.run_id, "loss")
        assert len(hist) == 50
        assert hist[-1].value == pytest.approx(1 + int(r.data.tags["i"]))
