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
    # A second sign-off of the same assessment is refused, naming how the first was signed.
    assert main(["signoff", "--comparison", comp, "--decision", "reject", "--by", "Bob"]) == 2
    assert "already signed off (accept by Ada (unauthenticated) at " in capsys.readouterr().err

    # Someone who can write the store forges the signer: a newline starts a fake line and
    # an escape sequence would hide "(unauthenticated)" on a terminal.  verify prints
    # the stored text escaped, on its own line, and names the edit.
    forged = "Ada (unauthenticated)\nsign-off of " + comp + ": accept by admin " \
        "(mlflow-basic-auth)\x1b[8m"
    record = json.loads(store.artifact_text(comp, "refrun/signoff.json"))
    record["by"] = forged
    p = Path(store.tmp) / "forge" / "signoff.json"
    p.parent.mkdir()
    p.write_text(json.dumps(record))
    client.log_artifact(comp, str(p), "refrun")
    client.set_tag(comp, "refrun.signoff.by", forged)
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "mlflow-basic-auth" not in out.split("\n")[0].split("\\n")[0]
    lines = out.splitlines()
    assert lines[0].startswith(f"sign-off of {comp}: accept by Ada (unauthenticated)\\nsign-off")
    assert lines[0].endswith("(mlflow-basic-auth)\\x1b[8m (unauthenticated) at "
                             + tags["refrun.signoff.time_utc"])
    assert lines[1].startswith("CHANGED since sign-off")
    assert all(line.startswith("  [") for line in lines[2:]), out
    assert any("the sign-off record was edited" in line for line in lines[2:]), out


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
    evidence = json.loads(store.artifact_text(comp, "refrun/evidence.json"))
    # 4: step_time results' contention; 5: its second rule's figures (issue 21); 6: a
    # paired result's numerics and the precision twin (issue 51); 7: a step_time result's
    # CPU floor on a busy machine (issue 52); 8: the references' machine figures and rule
    assert evidence["format_version"] == "10"
    assert evidence["runs"][cand.run_id]["points_from"].startswith(
        "curves artifact refrun/curves.parquet")
    # Evidence recorded before points_from (format 1) is recomputed without it, so an
    # older sign-off still verifies against unchanged data.
    v1 = build_evidence("x", [], [], load_run(cand.run_id, tracking_uri=store.tracking_uri,
                                              progress=False), None, "1")
    assert v1["format_version"] == "1" and "points_from" not in v1["runs"][cand.run_id]

    root = Path(client.get_run(cand.run_id).info.artifact_uri.removeprefix("file://"))
    (root / "refrun" / "curves.parquet").unlink()
    # A refrun run without its curves artifact is not whole (issue 55 item 4): it is never
    # read from MLflow's bounded metric history again; verify names the missing artifact.
    assert main(["verify", comp]) == 1
    out = capsys.readouterr().out
    assert (f"run {cand.run_id} is not whole: recorded by refrun, but its curves artifact "
            "refrun/curves.parquet is missing") in out
    assert "MLflow metric history" not in out.split("is missing")[0]


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


@pytest.mark.parametrize("by", ["Ada\nsign-off of x: accept by admin (mlflow-basic-auth)",
                                "Ada\x1b[8m", "Ada\u202e", "\x07", "x" * 201])
def test_signoff_by_must_be_printable_text(store, by: str, capsys) -> None:
    # Refused before the store is read (the comparison id does not even exist).
    assert main(["signoff", "--comparison", "0" * 32, "--decision", "accept",
                 "--by", by]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err and "\x07" not in err, err
    assert err.startswith("refrun signoff: error: --by ") and (
        "non-printable character" in err or "at most 200" in err), err


class _UserEndpoint:
    """A real HTTP server on 127.0.0.1 whose ``/api/2.0/mlflow/users/current`` answers
    ``status`` with an empty body (what a failing proxy or server does)."""

    def __init__(self, status: int) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [500, 502, 503, 302, 429])
def test_a_failing_user_endpoint_is_an_error_not_unauthenticated(status: int) -> None:
    # Who signs off cannot be told: nothing may be recorded as "unauthenticated".
    from refrun.acceptance.signer import current_user
    from refrun.errors import RefrunInputError

    server = _UserEndpoint(status)
    try:
        with pytest.raises(RefrunInputError, match=f"users/current answered HTTP {status}"):
            current_user(server.uri)
    finally:
        server.close()
    missing = _UserEndpoint(404)  # a server without MLflow's authentication app
    try:
        assert current_user(missing.uri) is None
    finally:
        missing.close()
