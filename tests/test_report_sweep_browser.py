"""A sweep page of 100 candidates in real Chromium: each candidate labelled by the user's own
tag in which the candidates differ (before refrun's infrastructure tags), a verdict by
criterion heat map on the first screen, and the matrix sorted and filtered by verdict,
highest level and failing criterion, the heat map following.

The candidates are built with known defects (a shifted loss every 7th, a lower final
accuracy every 11th); what each filter must show is computed from that construction, and
each sort order from the rows' verdicts and labels in Python, never from the page script.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_report_browser import CHROMIUM, CHROMIUM_ARGS

from refrun.acceptance.assess import assess
from refrun.acceptance.criteria import parse_criteria
from refrun.comparison import RunData, compare
from refrun.report import Candidate, build_multi_report

pytestmark = [pytest.mark.browser, pytest.mark.slow]

N = 100
STEPS = 120
VIEWPORT = {"width": 1400, "height": 1000}
CRITERIA = """version = 1
workload = "sweep-page"

[[criteria]]
id = "loss-envelope"
kind = "envelope"
level = "L1"
metric = "loss"
band = "std"
k = 6.0
min_fraction = 0.9

[[criteria]]
id = "accuracy-final"
kind = "claim"
level = "L3"
metric = "eval/accuracy"
statistic = "last"
at_least = 0.85
"""


def loss_defect(i: int) -> bool:
    return i % 7 == 3


def accuracy_defect(i: int) -> bool:
    return i % 11 == 5


def _run(rid: str, role: str, seed: int, *, shift: float = 0.0, acc: float = 0.0,
         tags: dict[str, str] | None = None) -> RunData:
    rng = np.random.default_rng(seed)
    s = np.arange(STEPS)
    loss = 2 * np.exp(-s / 30) + 0.3 + rng.normal(0, 0.01, STEPS) + (s >= 60) * shift
    e = s[::20]
    accuracy = 0.93 - 0.4 * np.exp(-e / 30) + rng.normal(0, 0.002, len(e)) + acc
    df = pd.concat([pd.DataFrame({"metric": "loss", "step": s, "value": loss}),
                    pd.DataFrame({"metric": "eval/accuracy", "step": e, "value": accuracy})],
                   ignore_index=True)
    base = {"refrun.workload": "sweep-page", "refrun.role": role, "refrun.seed": str(seed),
            "refrun.schema": "1"}
    return RunData.from_curves(df, rid, tags={**base, **(tags or {})})


def _candidate(i: int) -> RunData:
    """Candidate i: its own ``variant`` tag (the user's), and infrastructure that also
    differs between candidates (backend, device count, seed, framework version)."""
    backend = "jax" if i % 2 else "torch_xla"
    return _run(f"cand{i:03d}{'x' * 24}", "candidate", 100 + i,
                shift=0.5 if loss_defect(i) else 0.0, acc=-0.1 if accuracy_defect(i) else 0.0,
                tags={"variant": f"v{i:03d}", "refrun.backend": backend,
                      "refrun.exec.devices": str(1 + i % 4), f"refrun.fw.{backend}": "1.0",
                      "refrun.hardware": "tpu-v5e", "mlflow.runName": f"{backend} sweep"})


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    crit = parse_criteria(CRITERIA, "criteria.toml")
    refs = [_run(f"ref{k}{'r' * 28}", "reference", k, tags={"refrun.backend": "torch"})
            for k in range(3)]
    cands = []
    for i in range(N):
        c = _candidate(i)
        cands.append(Candidate(compare(refs, c, progress=False), assess(crit, refs, c)))
    out = tmp_path_factory.mktemp("sweep-page") / "sweep.html"
    out.write_text(build_multi_report(cands).html, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _open(browser, path: Path):  # type: ignore[no-untyped-def]
    tab = browser.new_page(viewport=VIEWPORT)
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.route("http*://**", lambda route: route.abort())
    tab.goto(path.resolve().as_uri())
    tab.wait_for_selector("body[data-rendered='true']", state="attached", timeout=60_000)
    tab.wait_for_selector("#candidate-matrix[data-ready='true']", state="attached")
    return tab, errors


ROWS = """() => Array.from(document.querySelectorAll('#candidate-matrix tbody tr'))
  .filter(tr => !tr.hidden).map(tr => ({i: +tr.dataset.i, verdict: tr.dataset.verdict,
    label: tr.dataset.label, level: tr.dataset.level,
    text: tr.querySelector('td a').textContent}))"""
HEAT = """() => Array.from(document.querySelectorAll('#heat-map tr:first-child td'))
  .filter(td => !td.hidden).map(td => +td.dataset.i)"""


def _visible(tab) -> list[dict]:  # type: ignore[no-untyped-def]
    return tab.evaluate(ROWS)


def test_labels_name_the_users_tag_and_the_heat_map_is_on_the_first_screen(
        browser, page: Path) -> None:
    tab, errors = _open(browser, page)
    rows = _visible(tab)
    assert [r["i"] for r in rows] == list(range(N))
    for r in rows:  # the user's own tag first, before backend, devices, seed, versions
        name, props = r["text"].split(" · ", 1)
        assert props.startswith(f"variant=v{r['i']:03d}"), r["text"]
        assert name in ("jax sweep", "torch_xla sweep")
    assert len({r["text"] for r in rows}) == N
    box = tab.evaluate("""() => { const r = document.getElementById('heat-map')
        .getBoundingClientRect(); return {top: r.top, bottom: r.bottom, width: r.width}; }""")
    assert box["top"] >= 0 and box["bottom"] <= VIEWPORT["height"], box
    assert box["width"] <= VIEWPORT["width"]
    cells = tab.evaluate("() => document.querySelectorAll('#heat-map td.h').length")
    columns = tab.evaluate("() => document.querySelectorAll("
                           "\"#candidate-matrix th[data-sort^='crit:']\").length")
    assert columns == 5  # the 3 built-in L0 checks and the file's 2 criteria
    assert cells == N * (1 + columns)  # the verdict and each criterion, a square each
    fails = tab.evaluate("() => Array.from(document.querySelectorAll("
                         "'#heat-map tr:first-child td.fail')).map(td => +td.dataset.i)")
    assert fails == [i for i in range(N) if loss_defect(i) or accuracy_defect(i)]
    assert errors == []


def test_the_matrix_sorts_by_verdict_label_and_criterion(browser, page: Path) -> None:
    tab, errors = _open(browser, page)
    base = _visible(tab)
    rank = {"fail": 0, "incomplete": 1, "pass": 2}
    tab.click("#candidate-matrix th[data-sort='verdict'] button")
    by_verdict = sorted(base, key=lambda r: (rank[r["verdict"]], r["i"]))
    assert [r["i"] for r in _visible(tab)] == [r["i"] for r in by_verdict]
    assert tab.evaluate(HEAT) == [r["i"] for r in by_verdict]  # the heat map follows
    tab.click("#candidate-matrix th[data-sort='verdict'] button")  # again: the other way
    back = sorted(base, key=lambda r: (-rank[r["verdict"]], r["i"]))
    assert [r["i"] for r in _visible(tab)] == [r["i"] for r in back]
    assert tab.get_attribute("#candidate-matrix th[data-sort='verdict']",
                             "aria-sort") == "descending"
    tab.click("#candidate-matrix th[data-sort='label'] button")
    by_label = sorted(base, key=lambda r: (r["label"].lower(), r["i"]))
    assert [r["i"] for r in _visible(tab)] == [r["i"] for r in by_label]
    tab.click("#candidate-matrix th[data-sort='crit:accuracy-final'] button")
    first = [r["i"] for r in _visible(tab)][:sum(map(accuracy_defect, range(N)))]
    assert sorted(first) == [i for i in range(N) if accuracy_defect(i)]
    assert errors == []


def test_the_matrix_filters_by_verdict_failing_criterion_and_level(browser,
                                                                   page: Path) -> None:
    tab, errors = _open(browser, page)
    base = {r["i"]: r for r in _visible(tab)}
    tab.select_option("#filter-verdict", "fail")
    failing = [i for i in range(N) if loss_defect(i) or accuracy_defect(i)]
    assert [r["i"] for r in _visible(tab)] == failing
    assert tab.evaluate(HEAT) == failing
    assert tab.text_content("#matrix-count") == f"{len(failing)} of {N} candidates"
    tab.select_option("#filter-verdict", "")
    tab.select_option("#filter-failed", "accuracy-final")
    assert [r["i"] for r in _visible(tab)] == [i for i in range(N) if accuracy_defect(i)]
    tab.select_option("#filter-failed", "loss-envelope")
    assert [r["i"] for r in _visible(tab)] == [i for i in range(N) if loss_defect(i)]
    tab.select_option("#filter-failed", "")
    levels = tab.evaluate("() => Array.from(document.querySelectorAll("
                          "'#filter-level option')).map(o => o.value).filter(v => v)")
    assert len(levels) >= 2
    for level in levels:
        tab.select_option("#filter-level", level)
        assert [r["i"] for r in _visible(tab)] == [i for i, r in base.items()
                                                   if r["level"] == level]
    tab.select_option("#filter-level", "")
    assert len(_visible(tab)) == N
    options = tab.evaluate("() => Array.from(document.querySelectorAll("
                           "'#filter-failed option')).map(o => o.textContent)")
    assert options == ["all", f"loss-envelope ({sum(map(loss_defect, range(N)))})",
                       f"accuracy-final ({sum(map(accuracy_defect, range(N)))})"]
    assert errors == []
    assert re.fullmatch(r"\d+ of 100 candidates", tab.text_content("#matrix-count"))
