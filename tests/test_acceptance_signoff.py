"""Sign-off and verify: a change to the criteria file, a metric logged afterwards, or a
replaced curves artifact is reported; accepting a failed assessment needs --override."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from acceptance_helpers import N, base_loss, record, write_criteria
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
"""


def _accept(store, crit: Path, ref: str, cand: str, capsys) -> str:
    rc = main(["accept", "--criteria", str(crit), "--reference", ref, "--candidate", cand])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    return out.split("recorded on comparison run ")[1].split()[0]


@pytest.fixture
def signed(store, tmp_path: Path, capsys):
    rng = np.random.default_rng(0)
    ref = record(store.tracking_uri, store.spool_dir, "reference",
                 {"loss": base_loss() + rng.normal(0, 0.01, N)})
    cand = record(store.tracking_uri, store.spool_dir, "candidate",
                  {"loss": base_loss() + rng.normal(0, 0.01, N)}, hardware="tpu-v5e")
    crit = write_criteria(tmp_path, BODY)
    comp = _accept(store, crit, ref.run_id, cand.run_id, capsys)
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Ada",
                 "--note", "looks right"]) == 0
    capsys.readouterr()
    return comp, crit, ref, cand


def test_signoff_record_and_clean_verify(store, signed, capsys) -> None:
    comp, crit, _, _ = signed
    client = MlflowClient(store.tracking_uri)
    tags = client.get_run(comp).data.tags
    assert tags["refrun.signoff.decision"] == "accept" and tags["refrun.signoff.by"] == "Ada"
    assert tags["refrun.signoff.time_utc"].endswith("Z")
    assert tags["refrun.signoff.criteria_sha256"] == \
        hashlib.sha256(crit.read_bytes()).hexdigest()
    assert tags["refrun.signoff.evidence_sha256"] == tags["refrun.acceptance.evidence_sha256"]
    assert main(["verify", comp, "--criteria", str(crit)]) == 0
    assert "verified: runs, criteria and evidence unchanged" in capsys.readouterr().out
    # A second sign-off of the same assessment is refused.
    assert main(["signoff", "--comparison", comp, "--decision", "reject", "--by", "Bob"]) == 2
    assert "already signed off" in capsys.readouterr().err


def test_verify_reports_changed_criteria_file(signed, tmp_path: Path, capsys) -> None:
    comp, crit, _, _ = signed
    crit.write_text(BODY.replace("0.1", "0.5"))
    assert main(["verify", comp, "--criteria", str(crit), "--json",
                 str(tmp_path / "v.json")]) == 1
    out = capsys.readouterr().out
    assert "[criteria] file" in out and "differs from the signed criteria" in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert [c["what"] for c in data["changes"]] == ["criteria"] and data["ok"] is False


def test_verify_reports_metric_logged_afterwards(store, signed, capsys) -> None:
    comp, _, _, cand = signed
    MlflowClient(store.tracking_uri).log_metric(cand.run_id, "loss", 9.0, step=N + 5)
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert f"[runs] run {cand.run_id} (candidate): latest_metrics.loss" in out
    assert "-> 9.0" in out


def test_verify_reports_replaced_curves(store, signed, tmp_path: Path, capsys) -> None:
    comp, _, ref, _ = signed
    client = MlflowClient(store.tracking_uri)
    path = Path(client.download_artifacts(ref.run_id, "refrun/curves.parquet", str(tmp_path)))
    df = read_curves(path)
    df.loc[df["metric"] == "loss", "value"] += pd.Series(0.3, index=df.index)
    out_dir = tmp_path / "new"
    write_curves(df, out_dir / "curves.parquet")
    client.log_artifact(ref.run_id, str(out_dir / "curves.parquet"), "refrun")
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert f"[runs] run {ref.run_id} (reference): curves.loss" in out
    # The assessed values changed too, and say how.
    assert "[evidence] criterion loss: evidence.max_abs_diff" in out
    assert "[evidence] criterion loss: outcome: pass -> fail" in out


@pytest.mark.slow  # the signed fixture (two recorded runs, accept, sign-off): ~23 s on 2 cores
def test_verify_names_points_switching_from_artifact_to_history(store, signed,
                                                                 capsys) -> None:
    """The candidate's curves artifact deleted after sign-off: its points now come from
    MLflow's metric history, and verify says so by name (not only as a digest)."""
    from refrun.acceptance.evidence import build_evidence
    from refrun.comparison import load_run

    comp, _, _, cand = signed
    client = MlflowClient(store.tracking_uri)
    evidence = json.loads(Path(client.download_artifacts(comp, "refrun/evidence.json"))
                          .read_text())
    assert evidence["format_version"] == "2"
    assert evidence["runs"][cand.run_id]["points_from"].startswith(
        "curves artifact refrun/curves.parquet")
    # Evidence recorded before points_from (format 1) is recomputed without it, so an
    # older sign-off still verifies against unchanged data.
    v1 = build_evidence("x", [], [], load_run(cand.run_id, tracking_uri=store.tracking_uri,
                                              progress=False), None, "1")
    assert v1["format_version"] == "1" and "points_from" not in v1["runs"][cand.run_id]

    root = Path(client.get_run(cand.run_id).info.artifact_uri.removeprefix("file://"))
    (root / "refrun" / "curves.parquet").unlink()
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert (f"[runs] run {cand.run_id} (candidate): points_from: curves artifact "
            "refrun/curves.parquet") in out
    assert "-> MLflow metric history" in out


def test_accepting_a_failed_assessment_needs_override(store, tmp_path: Path, capsys) -> None:
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": base_loss()})
    cand = record(store.tracking_uri, store.spool_dir, "candidate", {"loss": base_loss() + 1})
    comp = _accept(store, write_criteria(tmp_path, BODY), ref.run_id, cand.run_id, capsys)
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Ada"]) == 2
    assert "needs --override" in capsys.readouterr().err
    assert "refrun.signoff.decision" not in MlflowClient(store.tracking_uri).get_run(
        comp).data.tags
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Ada",
                 "--override"]) == 0
    tags = MlflowClient(store.tracking_uri).get_run(comp).data.tags
    assert tags["refrun.signoff.override"] == "true"
    assert main(["verify", comp]) == 0
    assert "(override)" in capsys.readouterr().out
    # Rejecting a failed assessment needs no override; verify of an unsigned run is exit 2.
    comp2 = _accept(store, write_criteria(tmp_path, BODY), ref.run_id, cand.run_id, capsys)
    assert main(["verify", comp2]) == 2
    assert main(["signoff", "--comparison", comp2, "--decision", "reject", "--by", "Ada"]) == 0
