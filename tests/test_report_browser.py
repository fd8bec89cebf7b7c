"""The report in a real browser: Debian's headless Chromium driven by Playwright.

Needs /usr/bin/chromium (scripts/bootstrap.sh --with-test-deps installs it; CI runs that).
Screenshots go to $REFRUN_TEST_ARTIFACTS, else test-artifacts/ (gitignored); the first
screen is also written to the test's tmp dir.  Kept few: one page load per test.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import MlflowServer, free_port
from mlflow.tracking import MlflowClient
from plotly.offline import get_plotlyjs
from report_helpers import (
    CRITERIA,
    XSS_NAME,
    XSS_PARAM,
    XSS_TAG,
    Runs,
    record_good_candidate,
    record_runs,
)

from refrun.cli import main
from refrun.comparison import Comparison, compare
from refrun.report import write_report

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
ARTIFACTS = Path(os.environ.get("REFRUN_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[1] / "test-artifacts")

if not Path(CHROMIUM).exists():  # pragma: no cover - CI installs it
    pytest.fail(f"{CHROMIUM} is missing: run scripts/bootstrap.sh --with-test-deps "
                "(apt-get install chromium)", pytrace=False)


@dataclass
class Visit:
    """What happened while a page was open."""

    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return record_runs(tmp_path_factory.mktemp("report-browser-store"))


@pytest.fixture(scope="module")
def comparison(runs: Runs) -> Comparison:
    return compare(runs.references, runs.candidate, tracking_uri=runs.uri, progress=False)


def open_report(browser, path: Path, block_network: bool = True):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    visit = Visit()
    page.on("console", lambda m: visit.console_errors.append(m.text)
            if m.type == "error" else None)
    page.on("pageerror", lambda e: visit.console_errors.append(str(e)))
    page.on("request", lambda r: visit.requests.append(r.url))
    if block_network:
        page.route("http*://**", lambda route: route.abort())
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-rendered]", state="attached", timeout=60_000)
    return page, visit


VIEWPORT_H = 1000

# The first screen must show these, entirely within the first viewport.
FIRST_SCREEN = """() => ['verdict', 'departures', 'strip'].map(id => {
    const e = document.getElementById(id);
    const r = e.getBoundingClientRect();
    return {id: id, top: r.top, bottom: r.bottom, height: r.height,
            svg: e.querySelectorAll('svg.main-svg .heatmaplayer image, svg .hm').length};
  })"""

# The first screen's ranking (training and evaluation signals), then the system and runtime
# metrics' ranking of the runtime evidence, in page order.
RANKING = """() => Array.from(document.querySelectorAll(
    '#departures tbody tr, #runtime-departures tbody tr')).map(tr => {
    const nums = Array.from(tr.querySelectorAll('.num')).map(n => n.dataset.value);
    return {metric: tr.querySelector('code').textContent, nums: nums,
            table: tr.closest('table').id}; })"""


def test_first_screen_answers_and_every_plot_renders_offline(  # type: ignore[no-untyped-def]
        browser, comparison: Comparison, tmp_path: Path) -> None:
    path = write_report(comparison, tmp_path / "report.html")
    page, visit = open_report(browser, path)
    try:
        assert page.get_attribute("body", "data-rendered") == "true"
        assert visit.console_errors == []
        assert visit.requests == [path.resolve().as_uri()]
        # First viewport: the verdict, the ranked departures and the all-metric picture.
        boxes = page.evaluate(FIRST_SCREEN)
        for b in boxes:
            assert b["height"] > 0 and b["top"] >= 0 and b["bottom"] <= VIEWPORT_H, b
        assert "no criteria applied" in page.inner_text("#verdict")
        strip = page.evaluate("""() => { const p = document.querySelector('#strip .plot');
            return {traces: p.data.map(t => t.type), rows: p.data[0].y,
                    drawn: p.querySelectorAll('svg.main-svg').length}; }""")
        assert strip["traces"] == ["heatmap", "scatter"] and strip["drawn"] >= 1
        # The ranking's numbers are the comparison JSON's (exact, via data-value).
        engine = page.evaluate(
            "JSON.parse(document.getElementById('refrun-data').textContent).comparison")
        assert engine == comparison.to_dict()
        rows = page.evaluate(RANKING)
        assert [r["metric"] for r in rows] == strip["rows"]
        assert {r["metric"] for r in rows} == set(engine["metrics"])
        scores = []
        for r in rows:
            m = engine["metrics"][r["metric"]]
            g, d = m["group"], m["measures"]
            fd = m.get("first_divergence")  # the engine's sustained departure, if any
            first = fd["first_step"] if isinstance(fd, dict) else g["first_step_outside"]
            want = [g["mean_abs_z"], g["max_abs_z"], g["step_of_max_abs_z"],
                    g["fraction_outside"], first, d["max_abs_diff"],
                    d["step_of_max_abs_diff"]]
            got = [None if v == "null" else float(v) for v in r["nums"][1:]]  # after "#"
            if g["max_abs_z"] is None:  # "—" stands for max |z| and its step
                want = [want[0], None, *want[3:]]
            assert got == want, r
            scores.append((r["table"], g["mean_abs_z"]))
        runtime = ("sys/", "perf/", "xfer/", "compile/")
        assert all((r["table"] == "runtime-departures") == r["metric"].startswith(runtime)
                   for r in rows)
        for group in ("departures", "runtime-departures"):  # each ranked on its own
            g_scores = [v for t, v in scores if t == group]
            ranked = [v for v in g_scores if v is not None]
            assert ranked == sorted(ranked, reverse=True)
            assert g_scores[len(ranked):] == [None] * (len(g_scores) - len(ranked))
        # Every plot drawn with the traces it was given.
        plots = page.evaluate("""() => Array.from(document.querySelectorAll('.plot')).map(
            e => ({title: e.dataset.title, expected: Number(e.dataset.traces),
                   svg: e.querySelectorAll('svg.main-svg').length,
                   traces: e.querySelectorAll('svg.main-svg g.trace').length,
                   data: e.data ? e.data.length : -1}))""")
        by_title = {p["title"]: p for p in plots}
        # Independent expectations for this comparison (2 reference seeds + candidate):
        # seed range (2) + mean ± kσ (2) + reference mean + candidate + difference + z = 8;
        # timeline: loss band (2) + mean + candidate, then reference 1 and candidate for
        # eval/accuracy, step time, compile/*, xfer/* = 12.
        expected = {"loss": 8, "eval/accuracy": 8, "timeline": 12,
                    "all-metric departure": 2, "step time over steps": 3,
                    "step time distribution": 3, "compile/* per step": 3,
                    "xfer/* per step": 3, "CPU-fallback ops": 1, "sys/cpu_pct": 3}
        assert set(expected) <= set(by_title), sorted(by_title)
        for p in plots:
            assert p["svg"] >= 1 and p["expected"] == p["data"], p
            if p["title"] not in ("all-metric departure",):  # heatmaps draw no g.trace
                assert p["traces"] == p["expected"], p
        for title, n in expected.items():
            assert by_title[title]["data"] == n, title
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for shot in (tmp_path / "first-screen.png", ARTIFACTS / "report-first-screen.png"):
            page.screenshot(path=str(shot))
            assert shot.stat().st_size > 50_000
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        print(f"screenshots: {tmp_path / 'first-screen.png'}, {ARTIFACTS}")
    finally:
        page.close()


def test_hostile_run_strings_show_as_text(browser, comparison: Comparison,  # type: ignore[no-untyped-def]
                                          tmp_path: Path) -> None:
    path = write_report(comparison, tmp_path / "xss.html")
    page, visit = open_report(browser, path)
    try:
        page.click("summary:has-text(\"All tags and params of the runs\")")
        title = page.title()
        assert title == "refrun report: rep: h100 vs tpu-v5e"
        assert "pwned" not in title
        assert page.evaluate("document.querySelectorAll('img').length") == 0
        assert page.evaluate("document.querySelectorAll('script').length") == 4
        text = page.inner_text("body")
        assert XSS_NAME in text
        assert XSS_TAG in text
        assert XSS_PARAM.split(" &")[0] in text
        assert page.evaluate("document.querySelectorAll('b').length") == 0
        # plotly legends show the run label as text as well (no markup interpreted).
        legend = page.evaluate("""() => Array.from(document.querySelectorAll(
            '.legendtext')).map(e => e.textContent).join('|')""")
        assert "candidate (tpu-v5e, torch, seed 7)" in legend
        assert visit.console_errors == []
        assert page.title() != "pwned"
    finally:
        page.close()


def test_numbers_in_page_equal_engine_json(browser, comparison: Comparison,  # type: ignore[no-untyped-def]
                                           tmp_path: Path) -> None:
    path = write_report(comparison, tmp_path / "numbers.html")
    page, _ = open_report(browser, path)
    try:
        engine = comparison.to_dict()
        embedded = page.evaluate(
            "JSON.parse(document.getElementById('refrun-data').textContent).comparison")
        assert embedded == engine
        cells = page.evaluate("""() => {
            const t = document.getElementById('headline-table');
            const head = Array.from(t.querySelectorAll('thead th')).map(h => h.textContent);
            return Array.from(t.querySelectorAll('tbody tr')).map(tr => {
              const row = {};
              tr.querySelectorAll('td').forEach((td, i) => {
                const n = td.querySelector('.num');
                row[head[i]] = n ? n.dataset.value : td.textContent; });
              return row; }); }""")
        rows = {r["metric"]: r for r in cells}
        assert set(rows) == set(engine["metrics"])
        for name, r in rows.items():
            m = engine["metrics"][name]["measures"]
            assert float(r["mean |diff|"]) == m["mean_abs_diff"]
            assert float(r["max |diff|"]) == m["max_abs_diff"]
            assert int(r["at step"]) == m["step_of_max_abs_diff"]
            assert float(r["bias"]) == m["bias"]
            g = engine["metrics"][name]["group"]
            z = r["mean |z|"]
            assert (None if z == "null" else float(z)) == g["mean_abs_z"]
        step_time = engine["metrics"]["perf/step_time_s"]["step_time"]
        shown = page.evaluate("""() => Array.from(document.querySelectorAll(
            '#step-time-table tbody td .num')).map(n => n.dataset.value)""")
        assert float(shown[-1]) == step_time["ratio"]
    finally:
        page.close()


def test_plotlyjs_from_local_path_and_cdn_variant(browser, comparison: Comparison,  # type: ignore[no-untyped-def]
                                                  tmp_path: Path) -> None:
    js = tmp_path / "plotly.min.js"
    js.write_text(get_plotlyjs(), encoding="utf-8")
    local = write_report(comparison, tmp_path / "local.html", plotlyjs=str(js))
    assert local.stat().st_size < 1_000_000
    page, visit = open_report(browser, local)
    try:
        assert page.get_attribute("body", "data-rendered") == "true"
        assert visit.requests == [local.resolve().as_uri(), js.resolve().as_uri()]
        assert visit.console_errors == []
    finally:
        page.close()
    # The CDN variant opened offline says why the plots are missing instead of failing
    # silently (the one console error is the blocked request).
    cdn = write_report(comparison, tmp_path / "cdn.html", plotlyjs="cdn")
    page, visit = open_report(browser, cdn)
    try:
        assert page.get_attribute("body", "data-rendered") == "error"
        assert "plotly.js could not be loaded" in page.inner_text(".plot.missing >> nth=0")
        assert [u for u in visit.requests if u.startswith("https://cdn.plot.ly/")]
    finally:
        page.close()


def _accept_outcomes(runs: Runs, crit: Path, candidate: str, out: Path) -> dict[str, str]:
    main(["accept", "--criteria", str(crit), "--reference", *runs.references,
          "--candidate", candidate, "--json", str(out), "--no-record",
          "--tracking-uri", runs.uri])
    got = json.loads(out.read_text(encoding="utf-8"))
    return {r["id"]: r["outcome"] for r in got["results"]} | {"verdict": got["verdict"]}


def test_many_candidates_page_matches_refrun_accept(browser, runs: Runs,  # type: ignore[no-untyped-def]
                                                   tmp_path: Path) -> None:
    good = record_good_candidate(runs)
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    out = tmp_path / "many.html"
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               good, "--criteria", str(crit), "--html", str(out), "--no-record",
               "--tracking-uri", runs.uri])
    assert rc == 0
    expected = {c: _accept_outcomes(runs, crit, c, tmp_path / f"{c}.json")
                for c in (runs.candidate, good)}
    page, visit = open_report(browser, out)
    try:
        assert page.get_attribute("body", "data-rendered") == "true"
        assert visit.console_errors == [] and visit.requests == [out.resolve().as_uri()]
        rows = page.evaluate("""() => Array.from(document.querySelectorAll(
            '#candidate-matrix tbody tr')).map(tr => ({
              href: tr.querySelector('a').getAttribute('href'),
              id: tr.querySelector('td code').textContent,
              verdict: tr.querySelector('td:nth-child(2)').textContent,
              cells: Object.fromEntries(Array.from(tr.querySelectorAll('.cell')).map(
                c => [c.dataset.criterion, c.dataset.outcome]))}))""")
        assert [r["id"] for r in rows] == [runs.candidate, good]
        for r in rows:
            want = dict(expected[r["id"]])
            assert r["verdict"] == want.pop("verdict")
            assert r["cells"] == want
            # The row links to that candidate's own section, which names it.
            section = page.locator(r["href"])
            assert r["id"] in section.locator("h2").first.inner_text()
        assert expected[runs.candidate]["loss-close"] == "fail"
        assert expected[good]["loss-close"] == "pass"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(tmp_path / "matrix.png"))
        page.screenshot(path=str(ARTIFACTS / "report-matrix.png"))
        page.click(f"#candidate-matrix a[href='{rows[1]['href']}']")
        page.wait_for_function(f"location.hash === '{rows[1]['href']}'")
    finally:
        page.close()


def test_report_renders_in_mlflow_artifacts_tab(browser, runs: Runs,  # type: ignore[no-untyped-def]
                                                tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               "--html", str(out), "--tracking-uri", runs.uri])
    assert rc == 0
    client = MlflowClient(runs.uri)
    exp = client.get_experiment_by_name("rep").experiment_id
    run = client.search_runs([exp], "tags.`refrun.role` = 'comparison'",
                             order_by=["attributes.start_time DESC"])[0]
    root = tmp_path / "server"
    root.mkdir()
    port = free_port()
    server = MlflowServer(root, port, command=[
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", runs.uri,
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1"])
    server.start(timeout=180)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    outside: list[str] = []

    def only_local(route) -> None:  # type: ignore[no-untyped-def]
        url = route.request.url
        if re.match(r"^(http://127\.0\.0\.1:\d+/|blob:|data:|about:)", url):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    page.route("**/*", only_local)
    try:
        page.goto(f"{server.url}/#/experiments/{exp}/runs/{run.info.run_id}/artifactPath/"
                  "refrun/report.html")
        frame_el = page.wait_for_selector("iframe.mlflow-html-iframe", timeout=120_000)
        frame = frame_el.content_frame()
        assert frame is not None
        frame.wait_for_selector("body[data-rendered]", state="attached", timeout=120_000)
        assert frame.get_attribute("body", "data-rendered") == "true"
        drawn = frame.evaluate("""() => Array.from(document.querySelectorAll('.plot')).map(
            e => e.querySelectorAll('svg.main-svg').length)""")
        assert drawn and all(n >= 1 for n in drawn)
        assert "Which signals depart, ranked" in frame.inner_text("#overview")
        assert outside == []
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(tmp_path / "mlflow-artifacts.png"))
        page.screenshot(path=str(ARTIFACTS / "report-in-mlflow.png"))
    finally:
        page.close()
        server.kill()


def _sweep_run(rid: str, seed: int, params: dict[str, str], shift: float = 0.0):  # type: ignore[no-untyped-def]
    import numpy as np
    import pandas as pd

    from refrun.comparison import RunData

    rng = np.random.default_rng(seed)
    s = np.arange(2000)
    loss = np.exp(-s / 400) + 0.3 + rng.normal(0, 0.01, len(s)) + np.where(s > 1000, shift, 0)
    grad = np.abs(rng.normal(1, 0.05, len(s)))
    df = pd.concat([pd.DataFrame({"metric": "loss", "step": s, "value": loss}),
                    pd.DataFrame({"metric": "grad_norm", "step": s, "value": grad})])
    role = "reference" if rid.startswith("ref") else "candidate"
    tags = {"refrun.role": role, "refrun.backend": "torch" if role == "reference" else "jax",
            "mlflow.runName": "torch ref" if role == "reference" else "jax seed 0"}
    return RunData.from_curves(df, rid, tags=tags, params=params)


def test_sweep_page_labels_every_candidate_and_draws_a_section_when_opened(  # type: ignore[no-untyped-def]
        browser, tmp_path: Path) -> None:
    """Eight candidates all named ``jax seed 0`` (they differ by ``lr``): every matrix row
    reads differently; the first screen draws no figure; opening one candidate's section
    draws its figures (and only its)."""
    from refrun.report import Candidate, write_multi_report

    refs = [_sweep_run(f"ref{i}", i, {}) for i in range(3)]
    lrs = [f"{(i + 1) * 1e-3:g}" for i in range(8)]
    cands = [_sweep_run(f"cand{i}", 10 + i, {"lr": lr, "batch": "256"},
                        shift=0.5 if i == 5 else 0.0) for i, lr in enumerate(lrs)]
    cmps = [compare(refs, c, progress=False) for c in cands]
    out = tmp_path / "sweep.html"
    write_multi_report([Candidate(c, comparison_run_id=f"run{i:02d}",
                                  comparison_url=f"http://127.0.0.1:5000/#/experiments/1/runs/run{i:02d}")
                        for i, c in enumerate(cmps)], out)
    page, visit = open_report(browser, out)
    try:
        assert page.get_attribute("body", "data-rendered") == "true"
        assert visit.console_errors == []
        rows = page.evaluate("""() => Array.from(document.querySelectorAll(
            '#candidate-matrix tbody tr')).map(tr => ({
              label: tr.querySelector('td a').textContent,
              href: tr.querySelector('td a').getAttribute('href'),
              mlflow: tr.querySelector('a.mlflow').getAttribute('href')}))""")
        labels = [r["label"] for r in rows]
        assert labels == [f"jax seed 0 · lr={lr}" for lr in lrs]  # distinct, in order
        assert [r["mlflow"] for r in rows] == [
            f"http://127.0.0.1:5000/#/experiments/1/runs/run{i:02d}" for i in range(8)]
        # The first screen is the matrix: no figure drawn yet, every section folded.
        assert page.locator(".main-svg").count() == 0
        assert page.locator("details.candidate[open]").count() == 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report-sweep-matrix.png"))
        page.click(f"#candidate-matrix a[href='{rows[5]['href']}']")
        section = page.locator(rows[5]["href"])
        # 'pending' while the embedded (gzip-compressed) plotly.js is decompressed.
        page.wait_for_selector(f"{rows[5]['href']}[data-rendered]:not("
                               "[data-rendered='pending'])", state="attached",
                               timeout=60_000)
        assert section.get_attribute("data-rendered") == "true"
        # ... drawn by plotly.js decompressed from under half its 4.6 MB.
        assert page.evaluate("document.getElementById('refrun-plotlyjs').textContent"
                             ".length") < 2_300_000
        plots = section.locator(".plot")
        assert plots.count() > 0
        # Every figure of the section drawn, with the shared arrays resolved: the curves
        # hold their points as plotly decoded them (2,000 steps: all drawn).
        drawn = page.evaluate(f"""() => Array.from(document.querySelectorAll(
            '{rows[5]['href']} .plot')).map(el => (el._fullData || []).map(t =>
              t.x ? (t.x.length || 0) : 0))""")
        assert all(len(traces) > 0 for traces in drawn), drawn
        assert max(max(t) for t in drawn) == 2000
        # The heatmap's hover text comes from the pool as an array of rows (one per
        # metric) of step ranges, not as an object.
        hover = page.evaluate(f"""() => Array.from(document.querySelectorAll(
            '{rows[5]['href']} .plot')).flatMap(el => (el.data || []).filter(t =>
              t.type === 'heatmap').map(t => [Array.isArray(t.customdata),
              t.customdata.length, t.y.length, String(t.customdata[0][0])]))""")
        assert hover and all(h[0] and h[1] == h[2] and h[3].startswith("0–")
                             for h in hover), hover
        others = page.locator("details.candidate:not([data-rendered]) .main-svg").count()
        assert others == 0 and page.locator("details.candidate[data-rendered]").count() == 1
        assert visit.console_errors == []
        page.screenshot(path=str(ARTIFACTS / "report-sweep-section.png"))
    finally:
        page.close()
