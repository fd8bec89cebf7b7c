"""How refrun's experiments and runs look in the MLflow UI, without a browser: the
experiment kind written (and a user's kind kept), default run names and descriptions from
identity, comparison runs named by their candidate and outcome with the failing criteria
in their description.  Values are read back from the sqlite file itself or MLflow's client.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

import refrun
from refrun import schema
from refrun.acceptance import assess, load_criteria
from refrun.acceptance.evidence import build_evidence
from refrun.acceptance.record import record_assessment
from refrun.comparison import compare, load_run, record_comparison
from refrun.store import mlflow_ui

STEPS = np.arange(40)
# The candidate's final accuracy (0.70) is below the claim (0.80): "goal" fails; "ran" passes.
CRITERIA = """
[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "eval/accuracy"
at_least = 0.80
description = "accuracy reaches 0.80"
"""


def experiment_tags(db: Path) -> dict[str, dict[str, str]]:
    """experiment name -> its tags, straight from the sqlite file."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT e.name, t.key, t.value FROM experiments e "
                           "JOIN experiment_tags t ON t.experiment_id = e.experiment_id")
        out: dict[str, dict[str, str]] = {}
        for name, key, value in rows:
            out.setdefault(name, {})[key] = value
        return out
    finally:
        con.close()


def run_row(db: Path, run_id: str) -> tuple[str, dict[str, str]]:
    """(name column, tags) of a run, straight from the sqlite file."""
    con = sqlite3.connect(db)
    try:
        (name,) = con.execute("SELECT name FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)))
        return name, tags
    finally:
        con.close()


def record(uri: str, spool: Path, role: str, seed: int, accuracy: float,
           run_name: str | None = None, **identity: object) -> str:
    with refrun.start_run("ui-test", role, seed=seed, run_name=run_name, tracking_uri=uri,
                          spool_dir=spool, snapshot_environment=False, delivery="thread",
                          **identity) as run:  # type: ignore[arg-type]
        for s in STEPS:
            run.log(int(s), loss=float(2.0 * np.exp(-s / 10) + 0.01 * seed))
        run.log_eval(int(STEPS[-1]), accuracy=accuracy)
    assert run.run_id is not None
    return run.run_id


def test_names_and_links_are_pure_text() -> None:
    assert mlflow_ui.comparison_run_name("accept", "jax-sum-loss", 3, "fail") == \
        "accept jax-sum-loss vs 3 refs: fail"
    assert mlflow_ui.comparison_run_name("compare", "x", 1) == "compare x vs 1 ref"
    tags = {schema.TAG_ROLE: "candidate", schema.TAG_BACKEND: "jax",
            schema.TAG_HARDWARE: "tpu-v5e", schema.TAG_CHIPS: "4", schema.TAG_SEED: "0"}
    assert mlflow_ui.default_run_name(tags) == "candidate jax tpu-v5e x4 seed 0"
    assert mlflow_ui.needs_kind({}) and mlflow_ui.needs_kind({schema.TAG_EXPERIMENT_KIND: " "})
    assert not mlflow_ui.needs_kind({schema.TAG_EXPERIMENT_KIND: "genai_development"})
    link = mlflow_ui.chart_link("7", ["a1", "b2"])
    path, query = link.split("?", 1)
    assert path == "#/experiments/7"
    q = urllib.parse.parse_qs(query)
    assert q == {"searchFilter": ["attributes.run_id IN ('a1', 'b2')"],
                 "compareRunsMode": ["CHART"]}
    # names from users' runs cannot make links or emphasis in the description
    text = mlflow_ui.comparison_description(
        kind="compare", experiment_id="1", run_id="c", candidate=("x", "[evil](http://e)"),
        references=[("r", "*r*")], verdict=None)
    assert "[evil](http://e)" not in text and "\\[evil\\]\\(http://e\\)" in text
    assert "\\*r\\*" in text


def test_store_runs_and_comparisons_say_what_they_are(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    uri, spool = f"sqlite:///{db}", tmp_path / "spool"
    # a kind somebody chose stays; an existing experiment without one gets marked
    client = MlflowClient(uri)
    client.create_experiment("theirs", tags={schema.TAG_EXPERIMENT_KIND: "finetuning"})
    client.create_experiment("ui-test")
    refs = [record(uri, spool, "reference", s, 0.9, backend="torch", hardware="cpu")
            for s in (0, 1)]
    cand = record(uri, spool, "candidate", 7, 0.70, run_name="jax-sum-loss",
                  backend="jax", hardware="cpu", chips=4)
    with refrun.start_run("theirs", "reference", tracking_uri=uri, spool_dir=spool,
                          snapshot_environment=False, delivery="thread"):
        pass
    kinds = {n: t.get(schema.TAG_EXPERIMENT_KIND) for n, t in experiment_tags(db).items()}
    assert kinds == {"theirs": "finetuning", "ui-test": "custom_model_development"}

    name, tags = run_row(db, refs[1])
    assert name == "reference torch cpu seed 1"
    assert tags[schema.TAG_NOTE].startswith("**reference** run of workload `ui-test`")
    assert "seed `1`" in tags[schema.TAG_NOTE]
    assert run_row(db, cand)[0] == "jax-sum-loss"  # a given name is kept

    crit = load_criteria(_write(tmp_path / "c.toml", CRITERIA))
    ref_data = [load_run(r, tracking_uri=uri, progress=False) for r in refs]
    cand_data = load_run(cand, tracking_uri=uri, progress=False)
    a = assess(crit, ref_data, cand_data)
    assert a.verdict == "fail" and a.result("goal").outcome == "fail"
    evidence = build_evidence(crit.sha256, a.results, ref_data, cand_data, None)
    cmp_id = record_assessment(a, crit, evidence, tracking_uri=uri)
    name, tags = run_row(db, cmp_id)
    assert name == "accept jax-sum-loss vs 2 refs: fail"
    assert tags[schema.TAG_RUN_NAME] == name
    note = tags[schema.TAG_NOTE]
    assert "**Verdict: FAIL**" in note and "`goal`" in note
    assert a.result("goal").reason.split()[0] in note
    exp_id = client.get_run(cmp_id).info.experiment_id
    assert f"[jax\\-sum\\-loss](#/experiments/{exp_id}/runs/{cand})" in note
    view_id = mlflow_ui.comparison_view_id(refs, cand)
    assert mlflow_ui.view_link(exp_id, view_id, chart=True) in note
    views = {k[len("mlflow.sharedViewState."):]: json.loads(v)
             for k, v in experiment_tags(db)["ui-test"].items()
             if k.startswith("mlflow.sharedViewState.")}
    assert set(views) == {"refrun-runs", view_id}
    state = json.loads(views[view_id]["state"])
    assert state["searchFilter"] == f"attributes.run_id IN ('{refs[0]}', '{refs[1]}', '{cand}')"
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "refrun.role"}]
    assert "tags.`refrun.acceptance.verdict`" in state["selectedColumns"]
    assert views["refrun-runs"]["name"] == "refrun: runs by role"

    cmp = compare(refs, cand, tracking_uri=uri, progress=False)
    plain = record_comparison(cmp, tracking_uri=uri)
    assert plain is not None
    assert run_row(db, plain)[0] == "compare jax-sum-loss vs 2 refs"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_a_given_comparison_name_is_kept(tmp_path: Path) -> None:
    given = "mine"
    uri, spool = f"sqlite:///{tmp_path}/m.db", tmp_path / "spool"
    # an experiment already holding the most saved views refrun writes: no new one
    full = {f"mlflow.sharedViewState.refrun-old{i}": "{}"
            for i in range(mlflow_ui.MAX_REFRUN_VIEWS)}
    MlflowClient(uri).create_experiment("ui-test", tags=full)
    refs = [record(uri, spool, "reference", 0, 0.9, backend="torch", hardware="cpu")]
    cand = record(uri, spool, "candidate", 1, 0.9, backend="torch", hardware="cpu")
    cmp = compare(refs, cand, tracking_uri=uri, progress=False)
    run_id = record_comparison(cmp, tracking_uri=uri, run_name=given)
    assert run_id is not None
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.run_name == given
    note = run.data.tags[schema.TAG_NOTE]
    assert f"[Chart the candidate against its references]" \
           f"({mlflow_ui.chart_link(run.info.experiment_id, [*refs, cand])})" in note
    assert "viewStateShareKey" not in note
    tags = MlflowClient(uri).get_experiment(run.info.experiment_id).tags
    assert sorted(k for k in tags if "sharedViewState" in k) == sorted(full)
