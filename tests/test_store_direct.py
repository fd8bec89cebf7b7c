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
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
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
    against the new schema (this file) before its release is added to KNOWN_SCHEMAS."""
    store.client().search_experiments()
    assert direct.schema_revision(_db(store.tracking_uri)) in direct.KNOWN_REVISIONS
    assert isinstance(store_client(store.tracking_uri, direct=True), direct.DirectClient)


def test_the_schema_gate_agrees_with_mlflow_and_pyproject(store, tmp_path) -> None:
    """The releases the direct path serves are ones pyproject allows, the installed one
    among them with the head revision of its own migration scripts; any other release
    or revision is MLflow's client's (expected values from MLflow and pyproject)."""
    import tomllib

    import mlflow.version
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    from packaging.requirements import Requirement

    installed = mlflow.version.VERSION
    assert direct.mlflow_version() == installed
    head = ScriptDirectory.from_config(_get_alembic_config("sqlite://")).get_current_head()
    assert direct.KNOWN_SCHEMAS[installed] == head
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    core = [Requirement(r) for r in project["project"]["dependencies"]]
    (skinny,) = [r for r in core if r.name == "mlflow-skinny"]
    assert all(skinny.specifier.contains(v) for v in direct.KNOWN_SCHEMAS)
    path = _db(store.tracking_uri)
    store.client().search_experiments()
    assert direct.decline_reason(path) is None
    other = "3.16.0"
    assert other not in direct.KNOWN_SCHEMAS and skinny.specifier.contains(other)
    assert "not a release this module was tested with" in direct.decline_reason(
        path, version=other)
    older = tmp_path / "older.db"
    older.write_bytes(path.read_bytes())
    with contextlib.closing(sqlite3.connect(older)) as con, con:
        con.execute("UPDATE alembic_version SET version_num = '1971f2d9a75b'")
    assert f"is not MLflow {installed}'s {head}" in direct.decline_reason(older)


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


def test_a_tree_of_artifacts_is_published_a_whole_file_at_a_time(store, tmp_path) -> None:
    """``log_artifacts`` publishes each file of the tree as ``log_artifact`` does (a hidden
    staging file, then a rename): while a file is still being copied, the run's listing
    does not show it and its final path does not exist.  The file being copied is a named
    pipe, so the copy is held open, part written, until the test lets it finish."""
    run_id = write_complete_run(_complete("tree"), store.tracking_uri)
    tree = tmp_path / "tree"
    (tree / "refrun" / "ranks").mkdir(parents=True)
    (tree / "refrun" / "ranks" / "1.json").write_text('{"rank": 1}')
    os.mkfifo(tree / "refrun" / "big.bin")
    c = store_client(store.tracking_uri, direct=True)
    assert isinstance(c, direct.DirectClient)
    root = Path(store.client().get_run(run_id).info.artifact_uri.removeprefix("file://"))
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            c.log_artifacts(run_id, str(tree))
        except BaseException as exc:  # reported by the test's thread below
            failed.append(exc)

    worker = threading.Thread(target=upload)
    worker.start()
    part, rest = b"\x00" * 70_000, b"\x01" * 30_000
    deadline = time.monotonic() + 30
    while True:  # the pipe opens for writing once the copy opened it for reading
        try:
            fd = os.open(tree / "refrun" / "big.bin", os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: no reader yet
            assert worker.is_alive() and time.monotonic() < deadline, failed
            time.sleep(0.01)
    os.set_blocking(fd, True)
    with open(fd, "wb") as pipe:
        pipe.write(part)
        pipe.flush()
        staged = root / "refrun"
        while not [f for f in staged.iterdir() if f.name.startswith(direct.UPLOADING_PREFIX)
                   and f.stat().st_size > 0]:  # part of the data written
            assert time.monotonic() < deadline, "the copy never started"
            time.sleep(0.01)
        assert not (staged / "big.bin").exists()
        listed = {f.path for f in store.client().list_artifacts(run_id, "refrun")}
        assert "refrun/big.bin" not in listed
        pipe.write(rest)
    worker.join(30)
    assert not worker.is_alive() and not failed
    assert (staged / "big.bin").read_bytes() == part + rest
    assert (staged / "ranks" / "1.json").read_text() == '{"rank": 1}'
    assert not [f for f in staged.rglob("*") if f.name.startswith(direct.UPLOADING_PREFIX)]


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


# --- one store behaviour, whichever path serves it: every call, a matrix of features -------
CALLS = Path(__file__).with_name("store_calls.py")
WS_ON = {"MLFLOW_ENABLE_WORKSPACES": "true"}


def _script(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict:
    proc = subprocess.run([sys.executable, str(CALLS), *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "MLFLOW_TRACKING_URI": "", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def feature_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Two stores written by MLflow's client: one single-tenant, one with workspaces
    teamA and teamB; each holds NaN and +-inf history, a repeated step, a renamed run, a
    deleted run, a RUNNING run, a deleted experiment, an experiment whose artifacts are
    elsewhere on disk (file://) and one whose artifacts are on another system (s3://)."""
    stores = {name: tmp_path_factory.mktemp(f"features-{name}") / "store"
              for name in ("off", "on")}  # one process, one MLflow import: off, then on
    plans = _script("build", *(a for name, d in stores.items() for a in (str(d), name)))
    return {name: (d, plan) for (name, d), plan in zip(stores.items(), plans, strict=True)}


def _normalised_answers(doc: dict, root: Path) -> dict:
    text = json.dumps({k: doc[k] for k in ("reads", "writes", "written")})
    for i, rid in enumerate(doc["made"]):
        text = text.replace(rid, f"<made {i}>")
    return json.loads(text.replace(str(root), "<root>"))


def _both(tmp_path: Path, store: Path, plan: dict, env: dict[str, str]) -> tuple[dict, ...]:
    """The plan's calls on two copies of ``store``: through refrun's direct access and
    through MLflow's client (``REFRUN_SQLITE_DIRECT=0``), in one process (one MLflow
    import), each copy a store and URI of its own."""
    copies = {kind: tmp_path / kind for kind in ("direct", "mlflow")}
    for copy in copies.values():
        shutil.copytree(store, copy)
    docs = _script("calls", json.dumps(plan), *(f"{k}={c}" for k, c in copies.items()),
                   env=env, cwd=tmp_path)
    assert len(docs) == 2
    return tuple(zip(copies.values(), docs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("config", ["single-tenant", "workspace teamB", "workspace default"])
def test_every_call_answers_as_mlflows_client(feature_stores, tmp_path, config) -> None:
    """Each read (experiments by name and id, a search, runs, every metric history,
    artifact listings) and each write refrun makes (a complete run with NaN and +-inf, a
    rename, artifacts, FINISHED; a failed run deleted; refusals: a changed param, a
    deleted run written, another workspace's run or experiment) answers the same through
    refrun's direct access as through MLflow's client, and leaves the same state."""
    store, plan = feature_stores["off" if config == "single-tenant" else "on"]
    env = {} if config == "single-tenant" else {**WS_ON,
                                                "MLFLOW_WORKSPACE": config.split()[1]}
    (dpath, d), (mpath, m) = _both(tmp_path, store, plan, env)
    assert (d["client"], m["client"]) == ("DirectClient", "MlflowClient")
    got, want = _normalised_answers(d, dpath), _normalised_answers(m, mpath)
    for part in ("reads", "writes", "written"):
        differ = sorted(k for k in set(got[part]) | set(want[part])
                        if got[part].get(k) != want[part].get(k))
        assert not differ, (part, [(k, got[part].get(k), want[part].get(k))
                                   for k in differ[:5]])
    outcomes = [v.get("error", "ok") for v in want["reads"].values()]
    assert outcomes.count("ok") >= (5 if config == "workspace default" else 40)
    assert len(want["written"]) >= 15  # two written runs: every read of each
    existing = set(plan["runs"][:-1])
    hidden = [k for k, v in want["reads"].items() if k.startswith("run ")
              and k.split()[1] in existing and v.get("error") == "RESOURCE_DOES_NOT_EXIST"]
    if config == "workspace teamB":  # teamA's runs (and default's none) do not exist here
        assert len(hidden) == len(existing) // 2
        assert want["reads"]["by name shared"]["ok"]["tags"]["team"] == "teamB"
    elif config == "workspace default":
        assert len(hidden) == len(existing)
        assert [e["name"] for e in want["reads"]["search"]["ok"]] == ["Default"]
    else:
        assert not hidden


@pytest.mark.slow
@pytest.mark.parametrize("env,cause", [
    ({"MLFLOW_ENABLE_WORKSPACES": "false"}, "Cannot disable workspaces"),
    (WS_ON, "Active workspace is required")])
def test_workspace_settings_mlflow_refuses_are_refused_the_same(feature_stores, tmp_path,
                                                                env, cause) -> None:
    """Workspaces off on a store with workspaces, or on without an active one: the direct
    path declines and the command fails as MLflow's client does, in one line."""
    store, plan = feature_stores["on"]
    (_, d), (_, m) = _both(tmp_path, store, plan, env)
    assert d["client"] is None and m["client"] is None
    assert d["open"] == m["open"] == "RefrunStoreError"
    assert cause in d["message"] and cause in m["message"]
    with_env = {**os.environ, **env}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in with_env.items():
            if k.startswith("MLFLOW_"):
                mp.setenv(k, v)
        mp.delenv("MLFLOW_WORKSPACE", raising=False)
        assert direct.decline_reason(store / "mlflow.db") is not None


def test_artifacts_elsewhere_are_left_to_mlflow(feature_stores) -> None:
    """A run whose artifacts are on another system (s3://): the direct path reads the run
    but declines its artifacts (only MLflow's client downloads from an object store), and
    loading hands them to MLflow's client."""
    from refrun.comparison.loading import _artifact_reader

    store, plan = feature_stores["off"]
    path = store / "mlflow.db"
    c = direct.DirectClient(f"sqlite:///{path}", path)
    remote = [r for r in plan["runs"][:-1]
              if c.get_run(r).info.artifact_uri.startswith("s3://")]
    assert len(remote) == 1
    with pytest.raises(direct.DirectStoreError) as err:
        c.list_artifacts(remote[0])
    assert err.value.error_code == "INVALID_STATE"
    reader = _artifact_reader(c, f"sqlite:///{path}", c.get_run(remote[0]))
    assert type(reader).__name__ == "MlflowClient"


_CLI = ("import sys, json\nfrom refrun.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print(json.dumps([rc, 'mlflow' in sys.modules]))\n")
_CLI_MANY = ("import contextlib, io, json, sys\nfrom refrun.cli import main\n"
             "out = []\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    buf, err = io.StringIO(), io.StringIO()\n"
             "    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):\n"
             "        rc = main(argv)\n"
             "    out.append([rc, buf.getvalue(), err.getvalue(), 'mlflow' in sys.modules])\n"
             "print(json.dumps(out))\n")
# One process for every workspace asked, one MLflow import: MLflow's client resolves the
# workspace from MLFLOW_WORKSPACE at each call (mlflow.utils.workspace_context
# .get_request_workspace), so the variable is set before each workspace's reads.
_SEEN = """
import json, os, sys
from mlflow.tracking import MlflowClient
seen = {}
for ws in json.loads(sys.argv[2]):
    os.environ["MLFLOW_WORKSPACE"] = ws
    c = MlflowClient(sys.argv[1])
    out = seen[ws] = {}
    for e in c.search_experiments():
        runs = c.search_runs([e.experiment_id], order_by=["attributes.run_name"])
        out[e.name] = sorted(
            [r.info.run_name, r.data.tags.get("refrun.role", ""),
             r.data.tags.get("refrun.seed", ""), r.data.tags.get("refrun.acceptance.verdict", ""),
             sorted(r.data.metrics), sorted(r.data.params), r.info.status] for r in runs)
print(json.dumps(seen))
"""


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, bool, str, str]:
    """``refrun ARGS`` in a fresh process: (exit code, MLflow imported, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-c", _CLI, *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd, env={**os.environ, **env})
    rc, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    return rc, imported, proc.stdout, proc.stderr


def _cli_many(commands: list[list[str]], env: dict[str, str], cwd: Path
              ) -> list[tuple[int, str, str, bool]]:
    """Several ``refrun`` commands in one fresh process (one MLflow import for all of
    them): each one's (exit code, stdout, stderr, MLflow imported by then: what the first
    command imported, for the later ones what any before them did)."""
    proc = subprocess.run([sys.executable, "-c", _CLI_MANY, json.dumps(commands)],
                          capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def _seen(uri: str, env: dict[str, str], workspaces: list[str]) -> dict:
    """What MLflow's client sees in the store in each of ``workspaces`` (``env``: with
    workspaces on): per workspace and experiment, every run's name, role, seed, verdict,
    metric and param names and status."""
    proc = subprocess.run([sys.executable, "-c", _SEEN, uri, json.dumps(workspaces)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_accept_report_with_workspaces_see_and_write_what_mlflow_would(
        tmp_path) -> None:
    """With workspaces on (``MLFLOW_WORKSPACE=teamB``), ``refrun import``, ``accept`` and
    ``report`` through refrun's direct access and through MLflow's client alone see the
    same runs and write the same into teamB's experiment, nothing into teamA's (which
    holds a namesake experiment) or the default workspace; a teamA run is not found."""
    def csv_file(name: str, seed: int) -> Path:
        s = np.arange(80)
        loss = 2 * np.exp(-s / 25) + 0.3 + np.random.default_rng(seed).normal(0, 0.01, 80)
        path = tmp_path / f"{name}.csv"
        path.write_text("step,loss\n" + "".join(f"{i},{float(v)!r}\n"
                                                for i, v in zip(s, loss, strict=True)))
        return path

    base = tmp_path / "base"
    base.mkdir()
    uri0 = f"sqlite:///{base / 'mlflow.db'}"
    team_a = {**WS_ON, "MLFLOW_WORKSPACE": "teamA", "REFRUN_SQLITE_DIRECT": "0"}
    rc, _, out, err = _cli(["import", "csv", str(csv_file("a", 99)), "--workload", EXPERIMENT,
                            "--role", "reference", "--hardware", "cpu", "--seed", "9",
                            "--tracking-uri", uri0], team_a, base)
    assert rc == 0, err[-2000:]
    team_a_run = out.strip().splitlines()[0].split()[0]
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    files = [csv_file(f"r{k}", k) for k in range(4)] + [csv_file("c", 50)]
    results = {}
    for setting in ("1", "0"):
        root = tmp_path / f"store{setting}"
        shutil.copytree(base, root)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        env = {**WS_ON, "MLFLOW_WORKSPACE": "teamB", "REFRUN_SQLITE_DIRECT": setting}
        ids = []
        imports = [["import", "csv", str(f), "--workload", EXPERIMENT, "--role",
                    "candidate" if k == len(files) - 1 else "reference", "--hardware", "cpu",
                    "--seed", str(k), "--run-name",
                    f"{'candidate' if k == len(files) - 1 else 'reference'} {k}",
                    "--tracking-uri", uri] for k, f in enumerate(files)]
        for rc, out, err, _ in _cli_many(imports, env, root):
            assert rc == 0, (out, err)
            ids.append(out.strip().splitlines()[0].split()[0])
        refs, cand = ids[:-1], ids[-1]
        accept = ["accept", "--criteria", str(crit), "--reference", *refs, "--candidate",
                  cand, "--tracking-uri", uri, "--json", str(root / "a.json")]
        # accept first in a fresh process, then report and a teamA run not found
        (rc, _, err, imported), (rc_r, _, err_r, _), (rc_a, _, err_a, _) = _cli_many(
            [accept,
             ["report", "--reference", *refs, "--candidate", cand, "--criteria", str(crit),
              "--html", str(root / "r.html"), "--json", str(root / "m.json"),
              "--tracking-uri", uri],
             ["accept", "--criteria", str(crit), "--reference", team_a_run, "--candidate",
              cand, "--tracking-uri", uri, "--no-record"]], env, root)
        assert rc == 0, err[-2000:]
        assert imported is (setting == "0")  # served without MLflow under workspaces
        doc = json.loads((root / "a.json").read_text())
        if setting == "1":  # the same runs assessed through MLflow's client: same evidence
            again = [*accept[:-1], str(root / "b.json"), "--no-record"]
            rc, imported, _, err = _cli(again, {**env, "REFRUN_SQLITE_DIRECT": "0"}, root)
            assert rc == 0 and imported, err[-2000:]
            mlflows = json.loads((root / "b.json").read_text())
            assert mlflows["evidence_sha256"] == doc["evidence_sha256"]
        assert rc_r == 0, err_r[-2000:]
        matrix = json.loads((root / "m.json").read_text())
        assert rc_a == 2 and f"run {team_a_run!r}: not found" in err_a, err_a
        results[setting] = {
            "verdict": doc["verdict"], "levels": doc["levels"],
            "matrix": [(c["verdict"], c["highest_level"], sorted(c["cells"]))
                       for c in matrix["candidates"]],
            **_seen(uri, WS_ON, ["teamB", "teamA", "default"])}
    assert results["1"] == results["0"]
    seen = results["1"]
    assert seen["verdict"] == "pass"
    assert [r[1] for r in seen["teamB"][EXPERIMENT]].count("reference") == 4
    assert [r[1] for r in seen["teamB"][EXPERIMENT]].count("comparison") == 2  # accept, report
    assert [r[1] for r in seen["teamA"][EXPERIMENT]] == ["reference"]
    assert EXPERIMENT not in seen["default"]
