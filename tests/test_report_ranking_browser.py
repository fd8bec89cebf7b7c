"""The first screen ranks what matters: on a cross-backend candidate (JAX against PyTorch
reference seeds) whose process memory and step time depart by hundreds of seed sigmas,
the ranking of the first screen is led by the loss or an evaluation metric, never by a
sys/ or perf/ metric; those are ranked apart in the runtime evidence, and every row is
marked as compared across backends.  Checked in real Chromium for a passing and a failing
candidate, with criteria.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_report_browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT_H, open_report

import refrun
from refrun.cli import main

pytestmark = [pytest.mark.browser, pytest.mark.slow]

STEPS = 150
CRITERIA = """version = 1
workload = "xb"

[[criteria]]
id = "loss-close"
kind = "closeness"
level = "L1"
metric = "loss"
abs_tol = 0.03
min_fraction = 0.95
description = "loss within 0.03 of the seed mean on 95 % of the steps"

[[criteria]]
id = "accuracy-close"
kind = "closeness"
level = "L1"
metric = "eval/accuracy"
abs_tol = 0.02
min_fraction = 1.0
description = "evaluation accuracy within 0.02"
"""


def _record(uri: str, spool: Path, role: str, backend: str, seed: int, *,
            loss_shift: float, rss: float, step_time: float) -> str:
    rng = np.random.default_rng(seed)
    s = np.arange(STEPS)
    loss = 2.0 * np.exp(-s / 50.0) + 0.3 + rng.normal(0, 0.01, STEPS) + loss_shift
    with refrun.start_run(workload="xb", role=role, hardware="tpu-v5e" if backend == "jax"
                          else "h100", backend=backend, seed=seed, chips=1,
                          tracking_uri=uri, spool_dir=spool,
                          snapshot_environment=False, delivery="thread") as run:
        for i in range(STEPS):
            run.log(i, loss=float(loss[i]),
                    **{"sys/rss_bytes": rss + float(rng.normal(0, 1e6)),
                       "perf/step_time_s": step_time + float(rng.normal(0, 1e-3))})
            if i % 25 == 0:
                run.log_eval(i, accuracy=0.5 + i / 500 + float(rng.normal(0, 0.002)))
    assert run.run_id is not None
    return run.run_id


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("xb")
    uri = f"sqlite:///{tmp}/mlflow.db"
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).create_experiment("xb", artifact_location=(tmp / "art").as_uri())
    spool = tmp / "spool"
    refs = [_record(uri, spool, "reference", "torch", k, loss_shift=0.0, rss=1.0e9,
                    step_time=0.05) for k in (0, 1, 2)]
    # Another framework: three times the memory, less than half the step time.
    cands = {"pass": _record(uri, spool, "candidate", "jax", 3, loss_shift=0.0, rss=3.0e9,
                             step_time=0.02),
             "fail": _record(uri, spool, "candidate", "jax", 4, loss_shift=0.05, rss=3.0e9,
                             step_time=0.02)}
    crit = tmp / "criteria.toml"
    crit.write_text(CRITERIA)
    out = {}
    for name, cand in cands.items():
        html = tmp / f"{name}.html"
        rc = main(["report", "--reference", *refs, "--candidate", cand, "--criteria",
                   str(crit), "--html", str(html), "--tracking-uri", uri])
        assert rc in (0, 1) and html.exists()
        out[name] = html
    return out


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


ROWS = """id => Array.from(document.querySelectorAll('#' + id + ' tbody tr')).map(tr => ({
    metric: tr.querySelector('code').textContent,
    badge: (tr.querySelector('.badge.xb') || {}).textContent || null,
    score: Number(tr.querySelectorAll('.num')[1].dataset.value)}))"""


@pytest.mark.parametrize("verdict", ["pass", "fail"])
def test_cross_backend_first_screen_is_led_by_training_signals(  # type: ignore[no-untyped-def]
        browser, reports: dict[str, Path], verdict: str) -> None:
    page, visit = open_report(browser, reports[verdict])
    try:
        assert visit.console_errors == []
        # The verdict, the ranking and the all-metric picture, all in the first viewport.
        for id_ in ("verdict", "departures", "strip"):
            box = page.evaluate(f"document.getElementById('{id_}').getBoundingClientRect()"
                                ".toJSON()")
            assert box["height"] > 0 and box["top"] >= 0 and box["bottom"] <= VIEWPORT_H
        assert verdict in page.inner_text("#verdict").lower()
        first = page.evaluate(ROWS, "departures")
        runtime = page.evaluate(ROWS, "runtime-departures")
        engine = page.evaluate(
            "JSON.parse(document.getElementById('refrun-data').textContent).comparison")
        z = {k: m["group"]["mean_abs_z"] for k, m in engine["metrics"].items()}
        # The memory and step time of another framework depart far more than the loss:
        # ranked by |z| alone, sys/rss_bytes would lead the first screen.
        training = [r["metric"] for r in first]
        assert min(z["sys/rss_bytes"], z["perf/step_time_s"]) > max(z[m] for m in training)
        assert first[0]["metric"] in ("loss", "eval/accuracy")
        assert [r["metric"] for r in first] == sorted(
            (r["metric"] for r in first), key=lambda m: -z[m])
        assert not any(r["metric"].startswith(("sys/", "perf/")) for r in first)
        assert {r["metric"] for r in runtime} == {"sys/rss_bytes", "perf/step_time_s"}
        assert {r["metric"] for r in first} | {r["metric"] for r in runtime} \
            == set(engine["metrics"])
        # Every metric is marked as compared across backends (torch references, JAX).
        assert all(r["badge"] == "cross-backend torch → jax" for r in first + runtime)
        # The runtime ranking sits in the runtime evidence, not on the first screen.
        top = page.evaluate("document.getElementById('runtime-departures')"
                            ".getBoundingClientRect().top")
        assert top > VIEWPORT_H
        assert page.evaluate("document.getElementById('runtime-departures')"
                             ".closest('section').id") == "runtime"
        if verdict == "fail":
            assert first[0]["metric"] == "loss"  # the shifted loss leads
    finally:
        page.close()
