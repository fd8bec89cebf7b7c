"""The MLflow UI as a person uses it, over the store the pipeline made (mlruns.example):
a real `mlflow server` on 127.0.0.1 and Debian's Chromium via Playwright.

From the landing page: the "Model training" switch, the experiment, its runs table (not
the GenAI overview) with the comparison runs named by candidate and outcome; then the
click path docs/report.md documents: a comparison run -> "Chart the candidate against its
references" (the saved view: the candidate and its reference group charted) -> back ->
Artifacts -> refrun/report.html (the report inside MLflow).  Expected names and ids are
read from the store's sqlite file.  Screenshots go to $REFRUN_TEST_ARTIFACTS, else
test-artifacts/ (docs/img/ holds the ones the docs show).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MlflowServer, free_port

pytestmark = [pytest.mark.browser, pytest.mark.server, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "mlruns.example"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
ARTIFACTS = Path(os.environ.get("REFRUN_TEST_ARTIFACTS") or ROOT / "test-artifacts")
WAIT_MS = 90_000  # generous: two shared cores, a cold server

if not Path(CHROMIUM).exists():  # pragma: no cover - CI installs it
    pytest.fail(f"{CHROMIUM} is missing: run scripts/bootstrap.sh --with-test-deps "
                "(apt-get install chromium)", pytrace=False)


def comparisons(db: Path) -> dict[str, dict[str, str]]:
    """comparison run id -> its tags plus ``candidate_name`` (the candidate run's name),
    straight from the sqlite file."""
    con = sqlite3.connect(db)
    try:
        names = dict(con.execute("SELECT run_uuid, name FROM runs"))
        tags: dict[str, dict[str, str]] = {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
            tags.setdefault(run, {})[key] = value
    finally:
        con.close()
    out = {}
    for run, t in tags.items():
        if t.get("refrun.role") == "comparison":
            out[run] = {**t, "name": names[run],
                        "candidate_name": names[t["refrun.compared.candidate"]]}
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    clone = tmp_path_factory.mktemp("ui-clone")
    shutil.copytree(STORE, clone / "mlruns.example")
    port = free_port()
    srv = MlflowServer(clone, port, command=[
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", "sqlite:///mlruns.example/mlflow.db",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], cwd=clone)
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def page(server: MlflowServer) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = b.new_page(viewport={"width": 1500, "height": 950})
        pg.set_default_timeout(WAIT_MS)
        yield pg
        b.close()


def shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"mlflow-ui-{name}.png"))


def close_assistant(page) -> None:  # type: ignore[no-untyped-def]
    """Close MLflow's assistant side panel when it is open (it only takes room)."""
    if page.get_by_role("button", name="New Chat").count():
        page.get_by_role("button", name="Close", exact=True).first.click()
        page.get_by_role("button", name="New Chat").wait_for(state="detached")


def test_landing_page_to_runs_table_chart_and_report(server: MlflowServer, page) -> None:  # type: ignore[no-untyped-def]
    cmps = comparisons(STORE / "mlflow.db")
    assert len(cmps) >= 2
    failing_id, failing = next((i, t) for i, t in cmps.items()
                               if t["refrun.acceptance.verdict"] == "fail")

    # 1. the landing page, the "Model training" switch, the experiment
    page.goto(server.url + "/")
    page.get_by_text("Model training", exact=True).first.click()
    page.get_by_role("link", name="digits-mlp").first.click()
    page.wait_for_url(re.compile(r"#/experiments/\d+/runs"))
    table = page.get_by_role("grid").first
    table.get_by_text(failing["name"], exact=True).wait_for()
    close_assistant(page)
    assert page.get_by_text("Usage", exact=True).count() == 0  # no GenAI overview
    shot(page, "1-runs-table")

    # 2. every comparison run is named by its candidate and its outcome
    for t in cmps.values():
        n_refs = len(t["refrun.compared.reference"].split(","))
        expected = f"accept {t['candidate_name']} vs {n_refs} refs: " \
                   f"{t['refrun.acceptance.verdict']}"
        assert t["name"] == expected
        assert table.get_by_text(expected, exact=True).count() == 1

    # 3. the saved view "refrun: runs by role": identity columns, runs grouped by role
    page.get_by_test_id("saved-views-trigger").click()
    page.get_by_text("refrun: runs by role", exact=True).first.click()
    page.get_by_text("Group: comparison").first.wait_for()
    for column in ("refrun.role", "refrun.backend", "refrun.acceptance.verdict"):
        assert page.get_by_role("columnheader", name=column, exact=True).count() >= 1, column
    shot(page, "1-runs-by-role")
    page.get_by_text("Exit shared view", exact=True).click()

    # 4. the comparison run's page: its description with the verdict and the links
    table = page.get_by_role("grid").first
    table.get_by_text(failing["name"], exact=True).click()
    page.wait_for_url(re.compile(rf"/runs/{failing_id}"))
    chart_link = page.get_by_role("link", name="Chart the candidate against its references")
    page.get_by_role("button", name="Expand description").click()
    chart_link.scroll_into_view_if_needed()
    description = page.get_by_test_id("note-editor-preview-content")
    description.get_by_text("Verdict: FAIL").wait_for()
    assessment = json.loads(next(STORE.glob(
        f"artifacts/*/{failing_id}/artifacts/refrun/assessment.json")).read_text())
    failed = [r["id"] for r in assessment["results"] if r["outcome"] == "fail"]
    assert failed
    text = description.inner_text()
    assert all(cid in text for cid in failed), (failed, text)
    shot(page, "2-comparison-run")

    # 5. the chart: the candidate against its reference group, from the saved view (the
    # description's links open in a new tab)
    run_page = page
    with page.context.expect_page() as opened:
        chart_link.click()
    page = opened.value
    page.set_viewport_size({"width": 1500, "height": 950})
    page.wait_for_url(re.compile(r"viewStateShareKey=refrun-.*compareRunsMode=CHART"))
    page.get_by_text("Group: candidate").first.wait_for()
    page.get_by_text("Group: reference").first.wait_for()
    page.get_by_placeholder("Search metric charts").fill("loss")
    chart_title = page.get_by_text("loss", exact=True).first
    chart_title.wait_for()
    page.locator("svg .scatterlayer .trace").first.wait_for()  # plotly drew lines
    shot(page, "3-candidate-vs-references")
    group_rows = page.get_by_text(re.compile(r"^Group: (candidate|reference)$"))
    assert group_rows.count() == 2
    assert page.get_by_text(failing["candidate_name"], exact=True).count() >= 1

    # 6. back to the comparison run -> Artifacts -> the report inside MLflow
    page.close()
    page = run_page
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("refrun", exact=True).first.click()
    page.get_by_text("report.html", exact=True).first.click()
    frame = page.frame_locator("iframe").first
    frame.get_by_text(failing["candidate_name"]).first.wait_for()
    assert frame.locator("body").inner_text().count(failing["refrun.compared.candidate"]) >= 1
    shot(page, "4-report-in-artifacts")
