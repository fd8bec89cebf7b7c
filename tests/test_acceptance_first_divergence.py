"""First divergence in the evidence (issue 21, item 5): each failing per-step criterion
carries where the candidate first left its band (axis value and step); it is in the
signed evidence, so `refrun verify` names an edit of it; the report's failing-criteria
list shows it (read in a real browser).

Real runs in a real sqlite store (refrun's session), the real CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, N, base_loss, record, write_criteria
from mlflow.tracking import MlflowClient

from refrun.cli import main

BODY = """
[[criteria]]
id = "loss-band"
level = "L1"
kind = "envelope"
metric = "loss"
k = 4.0
min_fraction = 0.9

[[criteria]]
id = "loss-close"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.05
min_fraction = 0.9

[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "loss"
at_most = 5.0
"""
DEPART = 60  # the candidate's loss leaves the seeds from this step on


def _by_hand(out: np.ndarray, sustain: int) -> int:
    """Independent: the first index from which `sustain` consecutive points are out (or
    out until the end, at least 2)."""
    n = len(out)
    for i in range(n):
        run = 0
        while i + run < n and out[i + run]:
            run += 1
        if run >= sustain or (i + run == n and run >= min(sustain, 2)):
            return i
    raise AssertionError("never left")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from conftest import migrated_sqlite

    tmp = tmp_path_factory.mktemp("first-divergence")
    uri = migrated_sqlite(tmp / "mlflow.db", tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFRUN_DELIVERY", "thread")  # in-process delivery: a cheap fixture
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(tmp)
        rng = np.random.default_rng(0)
        refs = [record(uri, tmp / "spool", "reference",
                       {"loss": base_loss() + rng.normal(0, 0.01, N)}, seed=s)
                for s in range(3)]
        cand_loss = (base_loss() + rng.normal(0, 0.01, N)
                     + np.where(STEPS >= DEPART, 0.3, 0.0))
        cand = record(uri, tmp / "spool", "candidate", {"loss": cand_loss}, seed=9)
        crit = write_criteria(tmp, BODY)
        out = tmp / "a.json"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["accept", "--criteria", str(crit), "--reference",
                       *[r.run_id for r in refs], "--candidate", cand.run_id, "--json",
                       str(out)])
    printed = buf.getvalue()
    assert rc == 1, printed
    comp = printed.split("recorded on comparison run ")[1].split()[0]
    return {"uri": uri, "tmp": tmp, "refs": refs, "cand": cand, "crit": crit, "comp": comp,
            "printed": printed, "a": json.loads(out.read_text(encoding="utf-8")),
            "cand_loss": cand_loss}


@pytest.fixture(autouse=True)
def _in_store(world: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world["uri"])
    monkeypatch.chdir(world["tmp"])


def test_failing_per_step_criteria_carry_where_the_candidate_left_the_band(world) -> None:
    res = {r["id"]: r for r in world["a"]["results"]}
    ref = np.vstack([r.metrics["loss"] for r in world["refs"]])
    mean, std = ref.mean(0), ref.std(0, ddof=1)
    cand = world["cand_loss"]
    sustain = min(5, int(np.ceil(N / 10)))
    for cid, out in (("loss-band", np.abs(cand - mean) > 4.0 * std),
                     ("loss-close", np.abs(cand - mean) > 0.05)):
        r = res[cid]
        assert r["outcome"] == "fail"
        fd = r["evidence"]["first_divergence"]
        expected = int(STEPS[_by_hand(out, sustain)])
        assert expected >= DEPART - 1
        assert fd == {"axis": "step", "at": expected, "step": expected,
                      "first_outside_at": int(STEPS[np.argmax(out)]), "sustain": sustain,
                      "direction": "above", "outside_points": int(out.sum()), "points": N}
        assert r["evidence"]["first_divergence_step"] == expected
        assert f"first left the band at step {expected}, above" in r["reason"]
        assert f"first left the band at step {expected}" in world["printed"]
    assert res["goal"]["outcome"] == "pass"


def test_verify_covers_the_first_divergence(world, tmp_path: Path, capsys) -> None:
    comp = world["comp"]
    assert main(["signoff", "--comparison", comp, "--decision", "reject", "--by", "Ada"]) == 0
    capsys.readouterr()
    client = MlflowClient(world["uri"])

    def verify() -> tuple[int, str]:
        rc = main(["verify", comp])
        return rc, capsys.readouterr().out

    assert verify()[0] == 0
    for name, edit in (
            ("refrun/assessment.json",
             lambda d: next(r for r in d["results"] if r["id"] == "loss-band")["evidence"]
             ["first_divergence"].update(at=3, step=3)),
            ("refrun/evidence.json",
             lambda d: d["results"]["loss-band"]["evidence"]["first_divergence"].update(
                 step=3))):
        src = Path(client.download_artifacts(comp, name, str(tmp_path / "orig")))
        original = src.read_bytes()
        doc = json.loads(original)
        edit(doc)
        put = tmp_path / "put" / name.split("/")[-1]
        put.parent.mkdir(exist_ok=True)
        put.write_text(json.dumps(doc), encoding="utf-8")
        client.log_artifact(comp, str(put), "refrun")
        rc, out = verify()
        assert rc == 1 and name in out, out
        put.write_bytes(original)
        client.log_artifact(comp, str(put), "refrun")
        assert verify()[0] == 0


@pytest.mark.browser
def test_report_failing_list_shows_where_it_started(world, tmp_path: Path, capsys) -> None:
    from playwright.sync_api import sync_playwright

    html = tmp_path / "r.html"
    assert main(["report", "--reference", *[r.run_id for r in world["refs"]],
                 "--candidate", world["cand"].run_id, "--criteria", str(world["crit"]),
                 "--html", str(html), "--no-record"]) == 0
    capsys.readouterr()
    step = next(r for r in world["a"]["results"] if r["id"] == "loss-band")[
        "evidence"]["first_divergence_step"]
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium",
                              args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = b.new_page()
        page.goto(html.as_uri())
        marks = page.locator("[id$=verdict] .fails .first-divergence")
        texts = [marks.nth(i).inner_text() for i in range(marks.count())]
        b.close()
    assert f"first left the band at step {step}, above" in texts and len(texts) == 2


def test_older_evidence_is_recomputed_without_it(world) -> None:
    # A sign-off recorded before the first divergence entered the evidence (format 2)
    # still verifies against unchanged data: its results are compared without it.
    from refrun.acceptance.evidence import result_as_version

    r = next(x for x in world["a"]["results"] if x["id"] == "loss-band")
    old = result_as_version(r, "2")
    assert "first_divergence" not in old["evidence"]
    assert "first_divergence_step" not in old["evidence"]
    assert "first left the band" not in old["reason"] and old["reason"] in r["reason"]
    assert result_as_version(r, "3") == r
