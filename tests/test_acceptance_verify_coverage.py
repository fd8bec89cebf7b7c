"""``verify`` covers everything a reader of the verdict sees, and ``signoff`` signs only
what the evidence supports: in a real store, each recorded piece (assessment.json, the
verdict and level tags, the stored criteria, the evidence, the sign-off record, a curve) is
rewritten in turn; verify fails naming it, and passes again once it is restored."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from acceptance_helpers import GOAL_CLAIM, N, base_loss, error_line, record, write_criteria
from mlflow.tracking import MlflowClient

from refrun.cli import main
from refrun.store.curves import read_curves, write_curves

BODY = """
[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.1
""" + GOAL_CLAIM


def _accept(crit: Path, ref: str, cand: str, capsys) -> str:
    rc = main(["accept", "--criteria", str(crit), "--reference", ref, "--candidate", cand])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    return out.split("recorded on comparison run ")[1].split()[0]


def _artifact(client: MlflowClient, run_id: str, name: str, tmp: Path) -> bytes:
    return Path(client.download_artifacts(run_id, name, str(tmp))).read_bytes()


def _put(client: MlflowClient, run_id: str, name: str, data: bytes, tmp: Path) -> None:
    (tmp / "put").mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=tmp / "put"))
    (d / Path(name).name).write_bytes(data)
    client.log_artifact(run_id, str(d / Path(name).name), str(Path(name).parent))


def _verify(comp: str, capsys, tmp: Path) -> tuple[int, str, list[dict]]:
    out = tmp / "v.json"
    rc = main(["verify", comp, "--json", str(out)])
    return rc, capsys.readouterr().out, json.loads(out.read_text())["changes"]


def test_verify_names_every_rewritten_piece(store, tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    ref = record(store.tracking_uri, store.spool_dir, "reference",
                 {"loss": base_loss() + rng.normal(0, 0.01, N)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate",
                  {"loss": base_loss() + rng.normal(0, 0.01, N)}, seed=1)
    comp = _accept(write_criteria(tmp_path, BODY), ref.run_id, cand.run_id, capsys)
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Ada"]) == 0
    capsys.readouterr()
    client = MlflowClient(store.tracking_uri)
    # A sqlite store authenticates nobody: the name is as typed, and the record says so.
    tags = client.get_run(comp).data.tags
    assert tags["refrun.signoff.by"] == "Ada"
    assert tags["refrun.signoff.authentication"] == "unauthenticated"
    assert _verify(comp, capsys, tmp_path)[0] == 0

    def rewrite_json(name: str, edit, expect: list[str]) -> None:
        original = _artifact(client, comp, name, tmp_path / "orig")
        doc = json.loads(original)
        edit(doc)
        _put(client, comp, name, json.dumps(doc).encode(), tmp_path)
        rc, out, changes = _verify(comp, capsys, tmp_path)
        assert rc == 1, out
        for text in expect:
            assert text in out, out
        assert changes
        _put(client, comp, name, original, tmp_path)
        assert _verify(comp, capsys, tmp_path)[0] == 0

    # assessment.json: the verdict, the highest level, one result's outcome.
    rewrite_json("refrun/assessment.json", lambda d: d.update(verdict="fail"),
                 ["[assessment] stored refrun/assessment.json",
                  "[assessment] refrun/assessment.json: verdict: pass -> fail"])
    rewrite_json("refrun/assessment.json", lambda d: d.update(highest_level="L4"),
                 ["refrun/assessment.json: highest_level: L3 -> L4"])
    rewrite_json("refrun/assessment.json",
                 lambda d: d["results"][-1].update(outcome="fail"),
                 ["refrun/assessment.json: results.goal.outcome: pass -> fail"])
    # The evidence document and the sign-off record itself.
    rewrite_json("refrun/evidence.json", lambda d: d["results"]["loss"].update(outcome="x"),
                 ["[evidence] stored refrun/evidence.json"])
    rewrite_json("refrun/signoff.json", lambda d: d.update(by="Mallory"),
                 ["[signoff] refrun/signoff.json"])

    # The verdict and level tags the MLflow UI shows.
    for tag, fake, signed in (("refrun.acceptance.verdict", "fail", "pass"),
                              ("refrun.acceptance.highest_level", "L4", "L3"),
                              ("refrun.acceptance.L2", "fail", "no_criteria")):
        client.set_tag(comp, tag, fake)
        rc, out, _ = _verify(comp, capsys, tmp_path)
        assert rc == 1 and f"[tags] tag {tag}: {signed} -> {fake}" in out, out
        client.set_tag(comp, tag, signed)
        assert _verify(comp, capsys, tmp_path)[0] == 0

    # The stored criteria (a threshold loosened in the copy).
    original = _artifact(client, comp, "refrun/criteria.toml", tmp_path / "orig")
    _put(client, comp, "refrun/criteria.toml", original.replace(b"0.1", b"0.9"), tmp_path)
    rc, out, _ = _verify(comp, capsys, tmp_path)
    assert rc == 1 and "[criteria] stored copy refrun/criteria.toml" in out
    _put(client, comp, "refrun/criteria.toml", original, tmp_path)
    assert _verify(comp, capsys, tmp_path)[0] == 0

    # A curve of the candidate (its full-resolution artifact).
    path = Path(client.download_artifacts(cand.run_id, "refrun/curves.parquet",
                                          str(tmp_path / "c")))
    df = read_curves(path)
    df.loc[df["metric"] == "loss", "value"] += pd.Series(0.05, index=df.index)
    write_curves(df, tmp_path / "new" / "curves.parquet")
    client.log_artifact(cand.run_id, str(tmp_path / "new" / "curves.parquet"), "refrun")
    rc, out, _ = _verify(comp, capsys, tmp_path)
    assert rc == 1 and f"[runs] run {cand.run_id} (candidate): curves.loss" in out


def test_signoff_refuses_an_edited_verdict(store, tmp_path: Path, capsys) -> None:
    """A failed assessment whose assessment.json and verdict tag were rewritten to "pass"
    is not accepted without --override: the verdict signed is the one the data gives."""
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": base_loss()})
    cand = record(store.tracking_uri, store.spool_dir, "candidate", {"loss": base_loss() + 1})
    comp = _accept(write_criteria(tmp_path, BODY), ref.run_id, cand.run_id, capsys)
    client = MlflowClient(store.tracking_uri)
    doc = json.loads(_artifact(client, comp, "refrun/assessment.json", tmp_path / "o"))
    assert doc["verdict"] == "fail"
    doc["verdict"] = "pass"
    _put(client, comp, "refrun/assessment.json", json.dumps(doc).encode(), tmp_path)
    client.set_tag(comp, "refrun.acceptance.verdict", "pass")
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Ada"]) == 2
    err = error_line(capsys.readouterr().err)
    assert "the recorded assessment differs from its evidence" in err
    assert "refrun/assessment.json: verdict: fail -> pass" in err
    assert "refrun.signoff.decision" not in client.get_run(comp).data.tags
