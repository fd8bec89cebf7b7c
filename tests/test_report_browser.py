"""The report in a real browser: Debian's headless Chromium driven by Playwright.

Needs /usr/bin/chromium (scripts/bootstrap.sh --with-test-deps installs it; CI runs that).
Screenshots go to $REFRUN_TEST_ARTIFACTS, else test-artifacts/ (gitignored).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs
from report_helpers import XSS_NAME, XSS_PARAM, XSS_TAG, Runs, record_runs

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


def test_report_renders_offline_with_every_plot(browser, comparison: Comparison,  # type: ignore[no-untyped-def]
                                                tmp_path: Path) -> None:
    path = write_report(comparison, tmp_path / "report.html")
    page, visit = open_report(browser, path)
    try:
        assert page.get_attribute("body", "data-rendered") == "true"
        assert visit.console_errors == []
        assert visit.requests == [path.resolve().as_uri()]
        plots = page.evaluate("""() => Array.from(document.querySelectorAll('.plot')).map(
            e => ({title: e.dataset.title, expected: Number(e.dataset.traces),
                   svg: e.querySelectorAll('svg.main-svg').length,
                   traces: e.querySelectorAll('svg.main-svg g.trace').length,
                   data: e.data ? e.data.length : -1}))""")
        by_title = {p["title"]: p for p in plots}
        # Independent expectations for this comparison (2 reference seeds + candidate):
        # band low/high + reference mean + candidate + difference = 5 traces.
        expected = {"loss": 5, "eval/accuracy": 5, "step time over steps": 3,
                    "step time distribution": 3, "compile/* per step": 3,
                    "xfer/* per step": 3, "CPU-fallback ops": 1, "sys/cpu_pct": 3}
        assert set(expected) <= set(by_title), sorted(by_title)
        for title, n in expected.items():
            assert by_title[title]["traces"] == n, title
        for p in plots:
            assert p["svg"] >= 1 and p["traces"] == p["expected"] == p["data"], p
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
        assert shot.stat().st_size > 50_000
    finally:
        page.close()


def test_hostile_run_strings_show_as_text(browser, comparison: Comparison,  # type: ignore[no-untyped-def]
                                          tmp_path: Path) -> None:
    path = write_report(comparison, tmp_path / "xss.html")
    page, visit = open_report(browser, path)
    try:
        page.click("details summary")  # the all-tags table
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
