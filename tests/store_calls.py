"""Every call of :class:`refrun.store.surface.StoreClient`, made through one client, its
answers printed as JSON: what ``tests/test_store_direct.py`` compares between refrun's own
sqlite access and MLflow's client.  Run as a script, in its own process: MLflow keeps one
store per process and URI, fixed when it is first opened (workspaces on or off).

    python tests/store_calls.py build STORE_DIR off STORE_DIR on   # stores with every feature
    python tests/store_calls.py calls PLAN_JSON direct|mlflow=STORE_DIR ...

``calls`` takes one or more copies of a store, each with the path that serves it, and
answers for each in turn (in its directory, a store and URI of its own; the environment
as it was for each), one MLflow import for all: ``direct=COPY1 mlflow=COPY2`` answers
through refrun's direct access, then through MLflow's client (``REFRUN_SQLITE_DIRECT=0``).

``build`` writes each store (``on``: with workspaces, ``MLFLOW_ENABLE_WORKSPACES=true`` from
then on, so ``off`` comes first) through MLflow's client only (and, for artifacts on another
system, the location a server started with ``--default-artifact-root s3://...`` records)
and prints the plans: every experiment, run, metric key and artifact directory in each.
``calls`` runs the plan's reads, then the writes refrun makes (a complete run, a rename,
refusals), then reads what was written back through MLflow's client.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKSPACES = ("teamA", "teamB")
RUN_NAME = "mlflow.runName"


# --- building a store ---------------------------------------------------------------------
def _history(seed: int) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp, step): NaN, +-inf, a step logged twice (a resume, later
    timestamp), two metrics, one point logged twice exactly (one point for MLflow)."""
    pts = [("loss", 3.0 + seed, 1000, 0), ("loss", math.nan, 1001, 1),
           ("loss", math.inf, 1002, 2), ("loss", 1.5, 1003, 3), ("loss", 2.5, 1500, 1),
           ("grad_norm", -math.inf, 1000, 0), ("grad_norm", 0.5, 1001, 1),
           ("grad_norm", 0.5, 1001, 1), ("grad_norm", 0.25, 999, 5)]
    return pts


def _fill(c: Any, exp: str, name: str, tmp: Path, *, artifacts: bool = True,
          finish: bool = True) -> str:
    from mlflow.entities import Metric, Param, RunTag

    run = c.create_run(exp, start_time=1_700_000_000_000, run_name=name,
                       tags={"mlflow.user": "alice", "user.note": name})
    rid = run.info.run_id
    c.log_batch(rid, metrics=[Metric(k, v, t, s) for k, v, t, s in _history(len(name))],
                params=[Param("lr", "0.1"), Param("name", name)],
                tags=[RunTag("refrun.workload", "w")])
    if artifacts:
        tree = tmp / f"tree-{rid}"
        (tree / "refrun" / "sub").mkdir(parents=True)
        (tree / "refrun" / "a.json").write_text('{"a": 1}\n')
        (tree / "refrun" / "sub" / "b.bin").write_bytes(b"\x00\x01")
        (tree / "refrun" / ".artifact.uploading.c").write_bytes(b"half")
        (tree / "top.txt").write_text("top\n")
        c.log_artifacts(rid, str(tree))
    if finish:
        c.set_terminated(rid, "FINISHED", end_time=1_700_000_100_000)
    return rid


def build(root: Path, workspaces: bool) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    root.mkdir(parents=True, exist_ok=True)
    os.chdir(root)  # MLflow's default artifact root: ./mlruns
    uri = f"sqlite:///{root / 'mlflow.db'}"
    tmp = Path(tempfile.mkdtemp(dir=root))
    for ws in WORKSPACES if workspaces else (None,):
        if ws is not None:
            os.environ["MLFLOW_WORKSPACE"] = ws
        c = MlflowClient(uri)
        shared = c.create_experiment("shared")
        _fill(c, shared, "plain", tmp)
        renamed = _fill(c, shared, "before", tmp)
        c.set_tag(renamed, RUN_NAME, "after")
        gone = _fill(c, shared, "deleted", tmp)
        c.delete_run(gone)
        _fill(c, shared, "running", tmp, artifacts=False, finish=False)
        c.set_experiment_tag(shared, "team", ws or "none")
        c.delete_experiment(c.create_experiment("dropped"))
        for name, where in (("elsewhere", (root / f"other-disk-{ws}").as_uri()),
                            ("remote", f"s3://refrun-test-bucket/{ws}/remote")):
            if ws is None:
                exp = c.create_experiment(name, artifact_location=where)
            else:  # workspaces: the location a server's --default-artifact-root makes
                exp = c.create_experiment(name)
                _relocate(root, exp, where)
            _fill(c, exp, "moved", tmp, artifacts=name == "elsewhere")
    return plan(root)


def _relocate(root: Path, exp: str, where: str) -> None:
    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as con, con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                    (where, int(exp)))


def plan(root: Path) -> dict[str, Any]:
    """Every experiment, run and metric key of the store (all workspaces), and ids that
    exist nowhere."""
    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as con:
        exps = [str(r[0]) for r in con.execute("SELECT experiment_id FROM experiments "
                                               "ORDER BY experiment_id")]
        names = sorted({r[0] for r in con.execute("SELECT name FROM experiments")})
        runs = [r[0] for r in con.execute("SELECT run_uuid FROM runs ORDER BY run_uuid")]
        keys = sorted({r[0] for r in con.execute("SELECT key FROM metrics")})
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "experiments": [*exps, "987654"],
            "names": [*names, "no such experiment"], "runs": [*runs, "0" * 32],
            "keys": [*keys, "no_such_metric"],
            "dirs": [None, "refrun", "refrun/ranks", "refrun/sub", "refrun/a.json", "missing"]}


# --- answers --------------------------------------------------------------------------------
def plain(o: Any) -> Any:
    """An answer as JSON: entities by the attributes refrun reads (StoreClient's views)."""
    if o is None or isinstance(o, bool | int | str):
        return o
    if isinstance(o, float):
        return "nan" if math.isnan(o) else o
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in sorted(o.items())}
    if isinstance(o, list | tuple) or type(o).__name__ == "PagedList":
        return [plain(v) for v in o]
    fields = {
        "Run": ("info", "data"),
        "RunInfo": ("run_id", "experiment_id", "run_name", "user_id", "status",
                    "start_time", "end_time", "artifact_uri", "lifecycle_stage"),
        "RunData": ("metrics", "params", "tags"),
        "Experiment": ("experiment_id", "name", "artifact_location", "lifecycle_stage",
                       "tags"),
        "Metric": ("key", "value", "timestamp", "step"),
        "FileInfo": ("path", "is_dir", "file_size"),
    }[type(o).__name__]
    return {f: plain(getattr(o, f)) for f in fields}


def answer(call: Callable[[], Any]) -> dict[str, Any]:
    """``{"ok": answer}`` or ``{"error": MLflow's error code}`` (or the exception type)."""
    try:
        return {"ok": plain(call())}
    except Exception as exc:
        return {"error": getattr(exc, "error_code", None) or type(exc).__name__}


def reads(c: Any, p: dict[str, Any], local_only: bool = True) -> dict[str, Any]:
    out = {"search": answer(lambda: c.search_experiments())}
    for name in p["names"]:
        out[f"by name {name}"] = answer(lambda n=name: c.get_experiment_by_name(n))
    for e in p["experiments"]:
        out[f"experiment {e}"] = answer(lambda e=e: c.get_experiment(e))
    for r in p["runs"]:
        got = answer(lambda r=r: c.get_run(r))
        out[f"run {r}"] = got
        for k in p["keys"]:
            out[f"history {r} {k}"] = answer(lambda r=r, k=k: c.get_metric_history(r, k))
        uri = got.get("ok", {}).get("info", {}).get("artifact_uri", "")
        if local_only and uri.startswith("s3://"):
            continue  # on another system: see test_artifacts_elsewhere_are_left_to_mlflow
        for d in p["dirs"]:
            out[f"artifacts {r} {d}"] = answer(lambda r=r, d=d: c.list_artifacts(r, d))
    return out


def writes(c: Any, p: dict[str, Any], tmp: Path) -> tuple[dict[str, Any], list[str]]:
    """What refrun writes (a complete run: create, params, metrics, tags, a rename,
    artifacts, FINISHED; the saved view's experiment tag; a failed run deleted) and what
    the store must refuse; returns the answers and the ids of the runs made."""
    from refrun.store.client import entities_for as _entities
    from refrun.store.direct import Metric, Param, RunTag

    out: dict[str, Any] = {}
    made: list[str] = []
    shared = c.get_experiment_by_name("shared")
    exp = shared.experiment_id if shared is not None else "0"

    def create(key: str, *args: Any, **kwargs: Any) -> str | None:
        got = answer(lambda: c.create_run(*args, **kwargs))
        out[key] = got
        rid = got.get("ok", {}).get("info", {}).get("run_id")
        if rid:
            made.append(rid)
        return rid

    rid = create("create", exp, start_time=1_700_000_000_000,
                 tags={"mlflow.user": "bob", "refrun.role": "candidate"},
                 run_name="written")
    if rid is None:
        return out, made
    pts = [Metric(k, v, t, s) for k, v, t, s in _history(7)]
    out["params"] = answer(lambda: c.log_batch(rid, params=_entities(
        c, [Param("lr", "0.2"), Param("opt", "adam")])))
    out["metrics"] = answer(lambda: c.log_batch(rid, metrics=_entities(c, pts)))
    out["metrics again"] = answer(lambda: c.log_batch(rid, metrics=_entities(c, pts[:3])))
    out["tags"] = answer(lambda: c.log_batch(rid, tags=_entities(
        c, [RunTag(RUN_NAME, "renamed"), RunTag("k", "v")])))
    out["set_tag"] = answer(lambda: c.set_tag(rid, "k", "w"))
    out["param changed"] = answer(lambda: c.log_batch(rid, params=_entities(
        c, [Param("lr", "0.3")])))
    out["experiment tag"] = answer(lambda: c.set_experiment_tag(exp, "view", "state"))
    tree = tmp / "tree"
    (tree / "refrun").mkdir(parents=True, exist_ok=True)
    (tree / "refrun" / "curves.parquet").write_bytes(b"PAR1")
    out["artifacts"] = answer(lambda: c.log_artifacts(rid, str(tree)))
    one = tmp / "summary.json"
    one.write_text('{"rank": 1}')
    out["artifact"] = answer(lambda: c.log_artifact(rid, str(one), artifact_path="refrun/ranks"))
    out["artifact at root"] = answer(lambda: c.log_artifact(rid, str(one)))
    out["delete tag"] = answer(lambda: c.delete_tag(rid, "k"))
    out["delete missing tag"] = answer(lambda: c.delete_tag(rid, "never-set"))
    out["finished"] = answer(lambda: c.set_terminated(rid, "FINISHED",
                                                      end_time=1_700_000_200_000))
    out["name clash"] = answer(lambda: c.create_run(exp, tags={RUN_NAME: "a"},
                                                    run_name="b"))
    gone = create("create doomed", exp, start_time=5, run_name="doomed")
    if gone is not None:
        out["failed"] = answer(lambda: c.set_terminated(gone, "FAILED", end_time=6))
        out["deleted"] = answer(lambda: c.delete_run(gone))
        out["deleted again"] = answer(lambda: c.delete_run(gone))
        out["tag on deleted"] = answer(lambda: c.log_batch(gone, tags=_entities(
            c, [RunTag("late", "x")])))
        out["end deleted"] = answer(lambda: c.set_terminated(gone, "FINISHED", end_time=7))
        out["delete tag of deleted"] = answer(lambda: c.delete_tag(gone, "late"))
    for e in p["experiments"]:  # other workspaces', deleted, missing experiments
        if e != exp:
            create(f"create in {e}", e, start_time=5, run_name="elsewhere")
            out[f"tag experiment {e}"] = answer(lambda e=e: c.set_experiment_tag(e, "x", "y"))
    for r in p["runs"]:  # other workspaces', deleted, finished, missing runs
        out[f"tag run {r}"] = answer(lambda r=r: c.log_batch(r, tags=_entities(
            c, [RunTag("late", "x")])))
        out[f"delete run {r}"] = answer(lambda r=r: c.delete_run(r))
    return out, made


def calls(uri: str, kind: str, p: dict[str, Any]) -> dict[str, Any]:
    from refrun.store.client import client as store_client

    out: dict[str, Any] = {}
    try:
        if kind == "direct":
            c: Any = store_client(uri, direct=True)
        else:
            os.environ["REFRUN_SQLITE_DIRECT"] = "0"
            c = store_client(uri, direct=True)  # MLflow's client, as the fallback gives it
    except Exception as exc:
        return {"client": None, "open": type(exc).__name__, "message": str(exc)}
    out["client"] = type(c).__name__
    out["reads"] = reads(c, p)
    with tempfile.TemporaryDirectory() as tmp:
        out["writes"], made = writes(c, p, Path(tmp))
    from mlflow.tracking import MlflowClient  # what was written, read as MLflow reads it

    mine = MlflowClient(uri)
    out["written"] = reads(mine, {**p, "runs": made, "experiments": [], "names": []})
    out["made"] = made
    return out


def each_copy(p: dict[str, Any], jobs: list[str]) -> list[dict[str, Any]]:
    """``calls`` on each ``KIND=STORE_DIR`` in turn, from that directory."""
    out = []
    for job in jobs:
        kind, where = job.split("=", 1)
        env, cwd = dict(os.environ), os.getcwd()
        os.chdir(where)
        try:
            out.append(calls(f"sqlite:///{Path(where) / 'mlflow.db'}", kind, p))
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "build":
        plans = []
        for where, workspaces in zip(argv[1::2], argv[2::2], strict=True):
            if workspaces == "on":
                os.environ["MLFLOW_ENABLE_WORKSPACES"] = "true"
            plans.append(build(Path(where), workspaces == "on"))
        print(json.dumps(plans))
    else:
        print(json.dumps(each_copy(json.loads(argv[1]), argv[2:])))


if __name__ == "__main__":
    main(sys.argv[1:])
