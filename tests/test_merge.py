"""refrun merge: a store recorded elsewhere (a TPU VM's local sqlite file, brought back
with its artifact folder) copied into the team's store, sqlite or a real `mlflow server`,
without losing identity, artifacts or points; idempotent; bad input refused whole."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, base_loss, loss_envelope_criteria, record, write_criteria
from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.pairing import pair_tags

WORKLOAD = "accept-test"
pytestmark = pytest.mark.slow  # a store recorded once (~30 s), each test merges it anew


@dataclass(frozen=True)
class Snapshot:
    """Everything a run held where it was recorded, read before the store moved."""

    run_id: str
    experiment: str
    name: str
    status: str
    start: int
    end: int | None
    tags: dict[str, str]
    params: dict[str, str]
    history: list[tuple[str, int, int, float]]
    files: dict[str, str]  # artifact path -> sha256


def snapshot(client: MlflowClient, run_id: str, tmp: Path) -> Snapshot:
    run = client.get_run(run_id)
    history = sorted((m.key, m.step, m.timestamp, m.value) for key in run.data.metrics
                     for m in client.get_metric_history(run_id, key))
    dest = Path(client.download_artifacts(run_id, "", str(tmp / f"dl-{run_id}")))
    files = {p.relative_to(dest).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(dest.rglob("*")) if p.is_file()}
    return Snapshot(run_id, client.get_experiment(run.info.experiment_id).name,
                    run.info.run_name, run.info.status, run.info.start_time, run.info.end_time,
                    dict(run.data.tags), dict(run.data.params), history, files)


def same_history(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        x[:3] == y[:3] and (x[3] == y[3] or (math.isnan(x[3]) and math.isnan(y[3])))
        for x, y in zip(a, b, strict=True))


def cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refrun", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def accept_json(uri: str, refs: list[str], cand: str, criteria: Path, out: Path) -> dict:
    proc = cli("accept", "--criteria", criteria, "--reference", *refs, "--candidate", cand,
               "--tracking-uri", uri, "--no-record", "--json", out)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tpu_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A store recorded "on the TPU" (3 reference seeds, a same-seed candidate with a NaN,
    a FAILED run, a comparison run), snapshotted, then moved: the folder it was recorded
    in is gone, its copy lies elsewhere, as a store brought back from another machine."""
    root = tmp_path_factory.mktemp("merge")
    home = root / "tpu-home"
    home.mkdir()
    uri = f"sqlite:///{home}/tpu.db"
    spool = home / "spool"
    import os

    cwd = Path.cwd()
    os.chdir(home)  # MLflow puts a new sqlite store's artifacts in ./mlruns
    try:
        refs = [record(uri, spool, "reference", {"loss": base_loss() + 0.01 * s,
                                                 "eval/acc": STEPS / 100.0}, seed=s).run_id
                for s in range(3)]
        loss = base_loss() + 0.005
        loss[50] = np.nan
        cand = record(uri, spool, "candidate", {"loss": loss, "eval/acc": STEPS / 100.0},
                      hardware="tpu-v5e", backend="jax", seed=0,
                      tags=pair_tags(0, reference=refs[0])).run_id
        failed = record(uri, spool, "candidate", {"loss": base_loss()}, hardware="tpu-v5e",
                        backend="jax", seed=1, fail=True).run_id
    finally:
        os.chdir(cwd)
    criteria = write_criteria(root, loss_envelope_criteria(WORKLOAD))
    proc = cli("accept", "--criteria", criteria, "--reference", *refs, "--candidate", cand,
               "--tracking-uri", uri)  # records a comparison run in the source
    assert proc.returncode in (0, 1), proc.stderr
    before = accept_json(uri, refs, cand, criteria, root / "before.json")
    client = MlflowClient(uri)
    snaps = {r: snapshot(client, r, root) for r in [*refs, cand, failed]}
    assert snaps[failed].status == "FAILED" and snaps[cand].status == "FINISHED"
    assert snaps[cand].tags[schema.TAG_PAIR_REFERENCE] == refs[0]
    back = root / "brought-back"
    shutil.copytree(home, back)
    shutil.rmtree(home)
    return {"root": root, "source": f"sqlite:///{back}/tpu.db", "back": back, "refs": refs,
            "cand": cand, "failed": failed, "snaps": snaps, "criteria": criteria,
            "before": before}


def check_merged(tpu: dict, target_uri: str, tmp: Path) -> dict[str, str]:
    """Every run of the source is in the target as it was; returns source id -> target id."""
    client = MlflowClient(target_uri)
    found = {r.data.tags[schema.TAG_ORIGIN_RUN_ID]: r.info.run_id
             for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
             if schema.TAG_ORIGIN_RUN_ID in r.data.tags}
    assert set(found) == set(tpu["snaps"])  # not the comparison run
    for src, snap in tpu["snaps"].items():
        got = snapshot(client, found[src], tmp)
        want_tags = {**snap.tags, schema.TAG_ORIGIN_RUN_ID: src}
        if schema.TAG_PAIR_REFERENCE in want_tags:
            want_tags[schema.TAG_PAIR_REFERENCE] = found[snap.tags[schema.TAG_PAIR_REFERENCE]]
        assert got.tags == want_tags
        assert (got.experiment, got.name, got.status, got.start, got.end, got.params) == (
            snap.experiment, snap.name, snap.status, snap.start, snap.end, snap.params)
        assert same_history(got.history, snap.history), src
        assert got.files == snap.files and schema.ARTIFACT_CURVES in got.files
    return found


def check_accepts_the_same(tpu: dict, target_uri: str, ids: dict[str, str], out: Path) -> None:
    after = accept_json(target_uri, [ids[r] for r in tpu["refs"]], ids[tpu["cand"]],
                        tpu["criteria"], out)
    text = json.dumps(tpu["before"])
    for src, dst in ids.items():
        text = text.replace(src, dst)
    want = json.loads(text)
    assert after["results"] and after["measurements"]
    for key in ("verdict", "highest_level", "levels", "results", "measurements", "alignment",
                "reference", "candidate", "warnings"):
        assert after[key] == want[key], key


def merged_lines(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    last = proc.stdout.strip().splitlines()[-1]
    numbers = [int(w) for w in last.replace(",", "").split() if w.isdigit()]
    return dict(zip(("merged", "present", "left out"), numbers, strict=True))


def test_sqlite_into_sqlite(tpu_store: dict, tmp_path: Path) -> None:
    target = f"sqlite:///{tmp_path}/team.db"
    proc = cli("merge", tpu_store["source"], "--into", target)
    assert proc.returncode == 0, proc.stderr
    assert merged_lines(proc) == {"merged": 5, "present": 0, "left out": 0}
    ids = check_merged(tpu_store, target, tmp_path)
    check_accepts_the_same(tpu_store, target, ids, tmp_path / "after.json")
    # Again: nothing new (recognised by origin id), the same runs.
    again = cli("merge", tpu_store["source"], "--into", target)
    assert again.returncode == 0 and merged_lines(again) == {
        "merged": 0, "present": 5, "left out": 0}, again.stdout
    assert check_merged(tpu_store, target, tmp_path) == ids
    # Merging the merged store onward keeps the first origin: into a third store and back
    # into the second recognises every run.
    third = f"sqlite:///{tmp_path}/third.db"
    assert cli("merge", target, "--into", third).returncode == 0
    back = cli("merge", third, "--into", target)
    assert merged_lines(back) == {"merged": 0, "present": 5, "left out": 0}, back.stdout


def test_into_a_tracking_server(tpu_store: dict, shared_mlflow_server,
                                tmp_path: Path) -> None:
    # The worker's shared server: the only test that merges this store into it, so the
    # server holds no other copy of these runs (check_merged reads every experiment).
    mlflow_server = shared_mlflow_server
    proc = cli("merge", tpu_store["source"], "--into", mlflow_server.url)
    assert proc.returncode == 0, proc.stderr
    ids = check_merged(tpu_store, mlflow_server.url, tmp_path)
    check_accepts_the_same(tpu_store, mlflow_server.url, ids, tmp_path / "after.json")
    again = cli("merge", tpu_store["source"], "--into", mlflow_server.url)
    assert merged_lines(again) == {"merged": 0, "present": 5, "left out": 0}


def test_an_interrupted_copy_is_replaced(tpu_store: dict, tmp_path: Path) -> None:
    # What a merge killed mid-run leaves: a RUNNING copy carrying the origin id.
    target = f"sqlite:///{tmp_path}/team.db"
    c = MlflowClient(target)
    exp = c.create_experiment(WORKLOAD)
    half = c.create_run(exp, tags={schema.TAG_ORIGIN_RUN_ID: tpu_store["cand"],
                                   schema.TAG_SCHEMA: "1"}).info.run_id
    proc = cli("merge", tpu_store["source"], "--into", target)
    assert proc.returncode == 0 and merged_lines(proc)["merged"] == 5, proc.stdout
    assert c.get_run(half).info.lifecycle_stage == "deleted"
    check_merged(tpu_store, target, tmp_path)


def test_unfinished_runs_are_left_out_and_named(tpu_store: dict, tmp_path: Path) -> None:
    moved = tmp_path / "src"
    shutil.copytree(tpu_store["back"], moved)
    source = f"sqlite:///{moved}/tpu.db"
    MlflowClient(source).update_run(tpu_store["failed"], status="RUNNING")
    target = f"sqlite:///{tmp_path}/team.db"
    proc = cli("merge", source, "--into", target, "--artifacts-root", moved)
    assert proc.returncode == 2  # not 1: that is "candidate failed" (issue 55 item 3)
    assert merged_lines(proc) == {"merged": 4, "present": 0, "left out": 1}
    line = next(ln for ln in proc.stdout.splitlines() if tpu_store["failed"] in ln)
    assert line.startswith("left out") and "RUNNING" in line


def test_missing_artifacts_refuse_the_whole_merge(tpu_store: dict, tmp_path: Path) -> None:
    moved = tmp_path / "src"
    shutil.copytree(tpu_store["back"], moved)
    gone = next(moved.glob(f"mlruns/*/{tpu_store['cand']}"))
    shutil.rmtree(gone)
    target = tmp_path / "team.db"
    proc = cli("merge", f"{moved}/tpu.db", "--into", f"sqlite:///{target}")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and tpu_store["cand"] in proc.stderr, proc.stderr
    assert "--artifacts-root" in proc.stderr
    assert not target.exists()  # nothing written, not even the store


def test_a_store_into_itself_is_refused(tpu_store: dict) -> None:
    proc = cli("merge", tpu_store["source"], "--into", tpu_store["source"])
    assert proc.returncode == 2 and "into itself" in proc.stderr
    assert proc.stderr.count("\n") == 1
