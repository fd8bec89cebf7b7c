"""The HTML report without a browser: reduction, escaping, numbers, CLI and MLflow artifact."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from report_helpers import (
    CRITERIA,
    NAN_STEP,
    SPIKE_STEP,
    XSS_NAME,
    XSS_PARAM,
    XSS_TAG,
    Runs,
    raw_loss,
    record_good_candidate,
    record_runs,
)

from refrun.cli import main
from refrun.comparison import RunData, compare
from refrun.report import build_report, write_report
from refrun.report.downsample import lttb_indices, reduce_indices
from refrun.report.overview import binned_max, first_departure, rank_departures
from refrun.util.thinning import minmax_indices


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return record_runs(tmp_path_factory.mktemp("report-store"))


def _data_blob(html: str, element_id: str) -> dict:
    m = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>',
                  html, re.S)
    assert m, element_id
    return json.loads(m.group(1))


def _table_values(html: str, table_id: str) -> dict[str, str]:
    """``{row label: data-value}`` of a two-column (kv) table."""
    m = re.search(rf'<table class="[^"]*" id="{re.escape(table_id)}">(.*?)</table>', html,
                  re.S)
    assert m, table_id
    rows = re.findall(r'<tr><td>(.*?)</td><td><span class="num[^"]*" '
                      r'data-value="([^"]*)"', m.group(1))
    return dict(rows)


# --- reduction ---------------------------------------------------------------------------

def test_minmax_keeps_every_bucket_extreme_and_spike() -> None:
    rng = np.random.default_rng(1)
    y = rng.normal(0, 1, 1_000_003)
    y[777_777] = 50.0  # a one-step spike
    y[10] = np.nan
    idx = minmax_indices(y, 800)
    assert len(idx) <= 3 * 800 + 1 + 1
    assert 777_777 in idx and 10 in idx and 0 in idx and len(y) - 1 in idx
    # Independent check: per bucket, the reduced points span the same range as all points.
    edges = np.linspace(0, len(y), 801).astype(int)
    for a, b in itertools.pairwise(edges):
        full = y[a:b][np.isfinite(y[a:b])]
        sel = idx[(idx >= a) & (idx < b)]
        kept = y[sel][np.isfinite(y[sel])]
        assert kept.min() == full.min() and kept.max() == full.max()


def test_lttb_keeps_ends_shape_and_gaps() -> None:
    x = np.arange(10_000, dtype=float)
    y = np.sin(x / 500.0)
    y[5000] = 9.0
    y[7000] = np.inf
    idx = lttb_indices(x, y, 500)
    assert idx[0] == 0 and idx[-1] == 9999
    assert 499 <= len(idx) <= 502
    assert 5000 in idx  # the spike makes the largest triangle of its bucket
    assert 7000 in idx  # the non-finite point stays, as a gap
    assert np.all(np.diff(idx) > 0)
    # Short series are not reduced.
    assert np.array_equal(reduce_indices(x[:100], y[:100], 2400), np.arange(100))


# --- report content from real runs -------------------------------------------------------

def test_report_numbers_equal_engine_json_and_numpy(runs: Runs, tmp_path: Path) -> None:
    cmp = compare(runs.references, runs.candidate, tracking_uri=runs.uri, progress=False)
    out = write_report(cmp, tmp_path / "r.html")
    html = out.read_text(encoding="utf-8")
    engine = cmp.to_dict()
    # The embedded machine-readable comparison is the engine's JSON.
    assert _data_blob(html, "refrun-data")["comparison"] == json.loads(json.dumps(engine))
    shown = _table_values(html, "measures-loss")
    m = engine["metrics"]["loss"]["measures"]
    for key in ("mean_abs_diff", "max_abs_diff", "step_of_max_abs_diff", "bias", "rms_diff",
                "mean_rel_diff", "diff_at_last_step"):
        assert float(shown[key]) == m[key], key
    assert float(shown["final window mean_abs_diff"]) == m["final_window"]["mean_abs_diff"]
    # Independent computation from the raw artifacts: last value per step, mean of the
    # two references, steps where every value is finite.
    curves = [raw_loss(runs.uri, r) for r in [*runs.references, runs.candidate]]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    ref = np.array([[c[s] for s in steps] for c in curves[:2]]).mean(axis=0)
    cand = np.array([curves[2][s] for s in steps])
    ok = np.isfinite(ref) & np.isfinite(cand)
    d = cand[ok] - ref[ok]
    assert NAN_STEP not in np.asarray(steps)[ok]
    assert float(shown["mean_abs_diff"]) == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert float(shown["max_abs_diff"]) == pytest.approx(np.abs(d).max(), rel=1e-12)
    assert int(shown["step_of_max_abs_diff"]) == SPIKE_STEP
    assert float(shown["bias"]) == pytest.approx(d.mean(), rel=1e-9)


def test_hostile_strings_never_become_markup(runs: Runs) -> None:
    cmp = compare(runs.references, runs.candidate, tracking_uri=runs.uri, progress=False)
    html = build_report(cmp).html
    for s in (XSS_NAME, XSS_TAG, XSS_PARAM.split(" &")[0]):
        assert s not in html
    # Five script elements: plotly.js, two JSON blocks, the renderer, and nothing else.
    assert len(re.findall(r"<script\b", html)) == 4
    assert "<img" not in html
    assert "&lt;img src=x onerror=&quot;document.title=&#x27;pwned&#x27;&quot;&gt;" in html
    # In the JSON blocks, <, > and & only ever appear as escapes.
    for block in re.findall(r'<script type="application/json"[^>]*>(.*?)</script>', html,
                            re.S):
        assert "<" not in block and ">" not in block and "&" not in block


def test_report_without_plotly_embedded_is_small(runs: Runs, tmp_path: Path) -> None:
    cmp = compare(runs.references, runs.candidate, tracking_uri=runs.uri, progress=False)
    big = write_report(cmp, tmp_path / "big.html")
    small = write_report(cmp, tmp_path / "small.html", plotlyjs="cdn")
    assert big.stat().st_size > 4_000_000
    assert small.stat().st_size < 1_000_000
    text = small.read_text(encoding="utf-8")
    assert re.search(r'src="https://cdn\.plot\.ly/plotly-[\d.]+\.min\.js"', text)


def test_in_memory_single_reference_and_assessment_dict(tmp_path: Path) -> None:
    steps = np.arange(50)
    base = pd.DataFrame({"metric": "loss", "step": steps, "value": 1.0 / (steps + 1)})
    ref = RunData.from_curves(base, "r1", tags={"refrun.role": "reference"})
    cand = RunData.from_curves(base.assign(value=base["value"] + 0.5), "c1",
                               tags={"refrun.role": "candidate"})
    cmp = compare(ref, cand, progress=False)
    assessment = {"verdict": "fail", "highest_level": "L1",
                  "levels": [{"level": "L2", "status": "fail", "passed": 0, "failed": 1,
                              "not_evaluable": 0}],
                  "results": [{"id": "loss-close", "level": "L2", "kind": "closeness",
                               "outcome": "fail", "metric": "loss",
                               "reason": "<i>49 of 50 steps</i> outside",
                               "evidence": {"max_abs_diff": 0.5, "steps": 50}}]}
    html = build_report(cmp, assessment=assessment).html
    assert 'id="acceptance-criteria"' in html
    assert "&lt;i&gt;49 of 50 steps&lt;/i&gt; outside" in html
    assert '<span class="badge fail">fail</span>' in html
    assert 'data-value="0.5"' in html
    blob = _data_blob(html, "refrun-figures")
    # The all-metric picture (heatmap + first-departure crosses) and one metric figure
    # (reference, candidate, difference); no runtime figures.
    assert [len(f["data"]) for f in blob["figures"]] == [2, 3]
    # The failing criterion names no step: no marker, but the banner lists it.
    assert 'data-verdict="fail"' in html and "highest level reached: L1" in html
    no_assessment = build_report(cmp).html
    assert 'id="acceptance-criteria"' not in no_assessment
    assert "No acceptance criteria were applied" in no_assessment


def test_runs_table_says_where_each_runs_points_came_from() -> None:
    """The runs table shows points_from (short; the full sentence as the cell's title),
    not the bare source: a run read from MLflow's history is a bounded view."""
    import dataclasses

    steps = np.arange(1200)
    base = pd.DataFrame({"metric": "loss", "step": steps, "value": 1.0 / (steps + 1)})
    ref = dataclasses.replace(RunData.from_curves(base, "r1", tags={"refrun.role": "reference"}),
                              source="artifact")
    cand = dataclasses.replace(RunData.from_curves(base.iloc[:51], "c1",
                                                   tags={"refrun.role": "candidate"}),
                               source="history")
    html = build_report(compare(ref, cand, progress=False)).html
    body = re.search(r'<table class="runs" id="runs-table">.*?<tbody>(.*?)</tbody>', html,
                     re.S).group(1)
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)]
    last = {row[1]: row[-1] for row in cells}
    assert re.fullmatch(r'<span title="curves artifact refrun/curves.parquet: 1,200 points '
                        r'\(every point\)">artifact: 1,200 points</span>',
                        last["<code>r1</code>"])
    assert last["<code>c1</code>"].endswith(">MLflow history: 51 points</span>")
    assert 'title="MLflow metric history: 51 points (no curves artifact' in last[
        "<code>c1</code>"]


# --- command line and MLflow -------------------------------------------------------------

def test_cli_writes_report_and_logs_it_to_the_comparison_run(runs: Runs, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    out = tmp_path / "out" / "report.html"
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               "--html", str(out), "--tracking-uri", runs.uri])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    run_id = re.search(r"comparison run: (\w+)", text).group(1)
    client = MlflowClient(runs.uri)
    run = client.get_run(run_id)
    assert run.data.tags["refrun.role"] == "comparison"
    assert run.data.tags["refrun.compared.reference"] == ",".join(runs.references)
    assert run.data.tags["refrun.compared.candidate"] == runs.candidate
    assert "diff/loss" in run.data.metrics
    listed = {f.path for f in client.list_artifacts(run_id, "refrun")}
    assert "refrun/report.html" in listed
    logged = Path(client.download_artifacts(run_id, "refrun/report.html", str(tmp_path)))
    assert logged.read_bytes() == out.read_bytes()
    assert run_id in out.read_text(encoding="utf-8")
    # Reusing that comparison run logs a new report into it, recording no new run.
    before = len(client.search_runs([run.info.experiment_id]))
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               "--html", str(tmp_path / "again.html"), "--comparison-run", run_id,
               "--plotlyjs", "cdn", "--tracking-uri", runs.uri])
    assert rc == 0
    assert len(client.search_runs([run.info.experiment_id])) == before


def test_cli_bad_input_exits_2_and_writes_nothing(runs: Runs, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    client = MlflowClient(runs.uri)
    exp = client.get_experiment_by_name("rep").experiment_id
    before = len(client.search_runs([exp]))
    out = tmp_path / "r.html"
    rc = main(["report", "--reference", "nope", "--candidate", runs.candidate,
               "--html", str(out), "--tracking-uri", runs.uri])
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err and len(err.strip().splitlines()) == 1
    rc = main(["report", "--reference", runs.references[0], "--candidate", runs.candidate,
               "--html", str(out), "--metrics", "no/such", "--tracking-uri", runs.uri])
    assert rc == 2 and "no/such" in capsys.readouterr().err
    rc = main(["report", "--reference", runs.references[0], "--candidate", runs.candidate,
               "--html", str(out), "--comparison-run", runs.references[1],
               "--tracking-uri", runs.uri])
    assert rc == 2 and "refrun.role" in capsys.readouterr().err
    assert not out.exists()
    assert len(client.search_runs([exp])) == before


def test_cli_with_criteria_shows_levels_and_escaped_notes(runs: Runs, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture
                                                          ) -> None:
    crit = tmp_path / "criteria.toml"
    crit.write_text('''version = 1
workload = "rep"

[[criteria]]
id = "loss-close"
kind = "closeness"
level = "L2"
metric = "loss"
abs_tol = 0.05
min_fraction = 0.95
description = "<script>document.title='pwned'</script> within 0.05"
''', encoding="utf-8")
    out = tmp_path / "crit.html"
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               "--html", str(out), "--criteria", str(crit), "--no-record",
               "--tracking-uri", runs.uri])
    assert rc == 0, capsys.readouterr().err
    html = out.read_text(encoding="utf-8")
    blob = _data_blob(html, "refrun-data")["assessment"]
    ids = [r["id"] for r in blob["results"]]
    assert "loss-close" in ids
    assert 'id="acceptance-levels"' in html and 'id="acceptance-criteria"' in html
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt; within 0.05" in html
    assert "<script>document.title" not in html
    for lv in blob["levels"]:
        assert f"<b>{lv['level']}</b>" in html


# --- the first screen: ranked departures ---------------------------------------------------

def test_ranking_equals_comparison_json_and_numpy(runs: Runs) -> None:
    cmp = compare(runs.references, runs.candidate, tracking_uri=runs.uri, progress=False)
    engine = cmp.to_dict()
    deps = rank_departures(engine)
    assert {d.metric for d in deps} == set(engine["metrics"])
    # training and evaluation signals first, then system/runtime, each ranked on its own
    groups = [d.group for d in deps]
    assert groups == sorted(groups, key=["training", "runtime"].index)
    assert all((d.group == "runtime") == d.metric.startswith(("sys/", "perf/", "xfer/",
                                                              "compile/")) for d in deps)
    for g in ("training", "runtime"):
        scored = [d.score for d in deps if d.score is not None and d.group == g]
        assert scored == sorted(scored, reverse=True)
    assert len([d for d in deps if d.score is not None]) >= 2
    for d in deps:
        g = engine["metrics"][d.metric]["group"]
        assert d.measure == "mean_abs_z"
        assert (d.score, d.max_abs_z, d.step_of_max_abs_z, d.fraction_outside) == (
            g["mean_abs_z"], g["max_abs_z"], g["step_of_max_abs_z"], g["fraction_outside"])
    # Independent: z of the loss from the raw artifacts (last value per step, steps where
    # every run is finite, sample std over the two seeds).
    curves = [raw_loss(runs.uri, r) for r in [*runs.references, runs.candidate]]
    steps = np.array(sorted(set.intersection(*(set(c) for c in curves))))
    refs = np.array([[c[s] for s in steps] for c in curves[:2]])
    cand = np.array([curves[2][s] for s in steps])
    ok = np.isfinite(refs).all(axis=0) & np.isfinite(cand)
    steps, refs, cand = steps[ok], refs[:, ok], cand[ok]
    sd = refs.std(axis=0, ddof=1)
    z = (cand - refs.mean(axis=0))[sd > 0] / sd[sd > 0]
    loss = next(d for d in deps if d.metric == "loss")
    assert loss.score == pytest.approx(np.abs(z).mean(), rel=1e-9)
    assert loss.max_abs_z == pytest.approx(np.abs(z).max(), rel=1e-9)
    if engine["metrics"]["loss"].get("first_divergence") is None:
        outside = (cand < refs.min(axis=0)) | (cand > refs.max(axis=0))
        assert loss.first_step == int(steps[np.argmax(outside)])
        assert loss.first_step_source == "outside_seed_range"
    else:
        # The engine's sustained first divergence (docs/comparison.md): band = seeds'
        # min/max -+ 0.02 |seed mean|, out for min(5, ceil(n / 10)) consecutive steps.
        tol = 0.02 * np.abs(refs.mean(axis=0))
        out = (cand < refs.min(axis=0) - tol) | (cand > refs.max(axis=0) + tol)
        k = min(5, int(np.ceil(len(out) / 10)))
        runs_of_k = np.convolve(out.astype(int), np.ones(k, dtype=int), "valid") == k
        assert loss.first_step == int(steps[np.argmax(runs_of_k)])
        assert loss.first_step_source == "engine"


def test_first_departure_prefers_the_engines_own() -> None:
    group = {"group": {"first_step_outside": 40}}
    assert first_departure(group) == (40, "outside_seed_range")
    assert first_departure({**group, "first_divergence": {"first_step": 75}}) == (75, "engine")
    # The engine found no sustained departure: that is the answer, not the transient one.
    assert first_departure({**group, "first_divergence": {"first_step": None}}) == (
        None, "engine")
    assert first_departure({**group, "first_divergence": 90}) == (90, "engine")
    assert first_departure({"group": None}) == (None, "none")
    assert first_departure({"group": {"first_step_outside": None}}) == (None, "none")


def test_binned_max_equals_a_plain_loop() -> None:
    rng = np.random.default_rng(3)
    steps = np.sort(rng.choice(10_000, 3000, replace=False))
    vals = rng.normal(0, 1, 3000)
    vals[::97] = np.nan
    edges = np.linspace(0, 10_000, 41)
    got = binned_max(steps, vals, edges)
    for j in range(40):
        sel = (steps >= edges[j]) & (steps < edges[j + 1]) & np.isfinite(vals)
        want = vals[sel].max() if sel.any() else np.nan
        assert (np.isnan(got[j]) and np.isnan(want)) or got[j] == want, j


def test_single_reference_ranks_by_relative_difference(tmp_path: Path) -> None:
    steps = np.arange(100)
    base = pd.DataFrame({"metric": "loss", "step": steps, "value": 1.0 + steps / 100})
    two = pd.concat([base, base.assign(metric="acc", value=0.5)])
    ref = RunData.from_curves(two, "r1", tags={"refrun.role": "reference"})
    cand_df = pd.concat([base.assign(value=base["value"] * 1.1),
                         base.assign(metric="acc", value=0.5 * 1.01)])
    cand = RunData.from_curves(cand_df, "c1", tags={"refrun.role": "candidate"})
    engine = compare(ref, cand, progress=False).to_dict()
    deps = rank_departures(engine)
    assert [d.metric for d in deps] == ["loss", "acc"]
    assert all(d.measure == "mean_rel_diff" for d in deps)
    if engine["metrics"]["loss"].get("first_divergence") is None:
        assert [d.first_step for d in deps] == [None, None]
    else:  # band = reference -+ 2 %: +10 % leaves it at once, +1 % never does
        assert [(d.first_step, d.first_step_source) for d in deps] == [(0, "engine"),
                                                                       (None, "engine")]
    # |c - r| / max(|c|, |r|) = 0.1 / 1.1 for the loss, 0.01 / 1.01 for acc.
    assert deps[0].score == pytest.approx(0.1 / 1.1, rel=1e-9)
    assert deps[1].score == pytest.approx(0.01 / 1.01, rel=1e-9)


# --- output paths ---------------------------------------------------------------------

def test_cli_unwritable_output_is_one_line_exit_2_before_any_run(
        runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    client = MlflowClient(runs.uri)
    exp = client.get_experiment_by_name("rep").experiment_id
    before = len(client.search_runs([exp]))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    base = ["report", "--reference", *runs.references, "--candidate", runs.candidate,
            "--tracking-uri", runs.uri]
    cases = [(["--html", "/proc/r.html"], "/proc/r.html"),
             (["--html", str(a_file / "r.html")], "is not a directory"),
             (["--html", str(tmp_path)], "is a directory"),
             (["--html", str(tmp_path / "ok.html"), "--json", "/proc/m.json"], "--json")]
    for extra, expected in cases:
        rc = main([*base, *extra])
        err = capsys.readouterr().err
        assert rc == 2, (extra, err)
        assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "ok.html").exists()
    assert len(client.search_runs([exp])) == before


# --- many candidates ------------------------------------------------------------------

def test_many_candidates_matrix_matches_refrun_accept(runs: Runs, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    good = record_good_candidate(runs)
    crit = tmp_path / "criteria.toml"
    crit.write_text(CRITERIA, encoding="utf-8")
    out, js = tmp_path / "many.html", tmp_path / "many.json"
    rc = main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
               good, "--criteria", str(crit), "--html", str(out), "--json", str(js),
               "--tracking-uri", runs.uri])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    matrix = json.loads(js.read_text(encoding="utf-8"))
    assert [r["candidate"] for r in matrix["candidates"]] == [runs.candidate, good]
    assert {"loss-close", "accuracy-close"} <= set(matrix["criteria"])
    verdicts = {}
    for row in matrix["candidates"]:
        acc = tmp_path / f"accept-{row['candidate']}.json"
        rc = main(["accept", "--criteria", str(crit), "--reference", *runs.references,
                   "--candidate", row["candidate"], "--json", str(acc), "--no-record",
                   "--tracking-uri", runs.uri])
        accepted = json.loads(acc.read_text(encoding="utf-8"))
        assert {r["id"]: r["outcome"] for r in accepted["results"]} == {
            cid: c["outcome"] for cid, c in row["cells"].items()}
        assert row["verdict"] == accepted["verdict"]
        assert rc == (0 if accepted["verdict"] == "pass" else 1)
        verdicts[row["candidate"]] = row["cells"]["loss-close"]["outcome"]
    assert verdicts == {runs.candidate: "fail", good: "pass"}
    html = out.read_text(encoding="utf-8")
    assert html.count('<details class="candidate" id="cand-') == 2
    # One page, two candidates: every element id unique, every in-page link resolves.
    ids = re.findall(r' id="([^"]+)"', html)
    assert len(ids) == len(set(ids))
    assert set(re.findall(r'href="#([^"]+)"', html)) <= set(ids)
    table = re.search(r'id="candidate-matrix">(.*?)</table>', html, re.S).group(1)
    assert re.findall(r'<a href="#(cand-\d)">', table) == ["cand-0", "cand-1"]
    # Each comparison run carries the report and the summary MLflow compares runs by.
    client = MlflowClient(runs.uri)
    run_ids = re.findall(r"comparison run: (\w+)", printed)
    assert len(run_ids) == 2
    for run_id, row in zip(run_ids, matrix["candidates"], strict=True):
        run = client.get_run(run_id)
        assert run.data.tags["refrun.compared.candidate"] == row["candidate"]
        assert run.data.tags["refrun.report.verdict"] == row["verdict"]
        loss = next(d for d in row["departures"] if d["metric"] == "loss")
        assert run.data.metrics["report/mean_abs_z/loss"] == loss["score"]
        assert run.data.metrics["report/criteria_failed"] == sum(
            c["outcome"] == "fail" for c in row["cells"].values())
        assert "refrun/report.html" in {f.path for f in client.list_artifacts(run_id,
                                                                             "refrun")}


def test_redacted_paths_leave_no_trace(tmp_path: Path) -> None:
    steps = np.arange(30)
    df = pd.DataFrame({"metric": "loss", "step": steps, "value": 1.0 / (steps + 1)})
    ref = RunData.from_curves(df, "r1", tags={"refrun.role": "reference"})
    here = tmp_path / "checkout & <co>"
    cand = RunData.from_curves(df.assign(value=df["value"] + 0.1), "c1",
                               tags={"refrun.role": "candidate",
                                     "mlflow.source.name": f"{here}/train.py"})
    a = {"verdict": "pass", "highest_level": "L1", "results": [],
         "criteria": {"path": f"{here}/criteria.toml", "sha256": "ab"}}
    cmp = compare(ref, cand, progress=False)
    plain = build_report(cmp, assessment=a, plotlyjs="cdn").html
    assert "checkout &amp; &lt;co&gt;" in plain  # the path is there unless redacted
    html = build_report(cmp, assessment=a, plotlyjs="cdn", redact_paths=[str(here)]).html
    for form in ("checkout", str(tmp_path)):
        assert form not in html
    assert "…/train.py" in html and "…/criteria.toml" in html
    assert _data_blob(html, "refrun-data")["assessment"]["criteria"]["path"] == \
        "…/criteria.toml"


CALIBRATION = '''
[calibration]
method = "held-out seeds (test)"
runs = ["r-a", "r-b"]
n = 2
group_size = 1
'''


def test_calibration_provenance_and_statistical_intervals_are_shown(runs: Runs,
                                                                   tmp_path: Path) -> None:
    crit = tmp_path / "criteria.toml"
    text = CRITERIA.replace('workload = "rep"\n', 'workload = "rep"\n' + CALIBRATION)
    text = text.replace('description = "loss within 0.03',
                        'calibration = {worst_held_out = 0.021}\ndescription = "loss within 0.03')
    crit.write_text(text, encoding="utf-8")
    out = tmp_path / "cal.html"
    assert main(["report", "--reference", *runs.references, "--candidate", runs.candidate,
                 "--criteria", str(crit), "--html", str(out), "--no-record",
                 "--plotlyjs", "cdn", "--tracking-uri", runs.uri]) == 0
    html = out.read_text(encoding="utf-8")
    table = re.search(r'<table class="kv" id="calibration">(.*?)</table>', html, re.S)
    cal = dict(re.findall(r'<tr><td>([^<]*)</td><td><span class="num" data-value="([^"]*)"',
                          table.group(1)))
    assert cal["n"] == "2" and cal["group_size"] == "1"
    assert "held-out seeds (test)" in html and "worst_held_out" in html
    # A statistical criterion's interval and n_reference get their own column.
    steps = np.arange(20)
    df = pd.DataFrame({"metric": "loss", "step": steps, "value": 1.0 + 0 * steps})
    cmp = compare(RunData.from_curves(df, "r"), RunData.from_curves(df, "c"), progress=False)
    a = {"verdict": "pass", "highest_level": "L3",
         "results": [{"id": "tost-loss", "level": "L3", "kind": "equivalence",
                      "outcome": "pass", "metric": "loss", "reason": "inside",
                      "evidence": {"interval": [-0.25, 0.5], "n_reference": 7}}]}
    page = build_report(cmp, assessment=a, plotlyjs="cdn").html
    assert "<th>interval (n reference)</th>" in page
    assert re.search(r'\[<span class="num" data-value="-0.25">-0.25</span>, '
                     r'<span class="num" data-value="0.5">0.5</span>\] n=<span class="num" '
                     r'data-value="7">7</span>', page)
