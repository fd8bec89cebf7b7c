"""Importers: validation names the file and line/key, nothing is written for a bad file,
and imported values are the file's values exactly (NaN kept as NaN)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from refrun.cli import main
from refrun.comparison import load_run
from refrun.errors import RefrunInputError
from refrun.importers import (
    import_csv,
    import_megatron,
    parse_csv,
    parse_megatron,
    parse_torchtitan,
)
from tests.refdata import DATA, needs_data

MEG = DATA / "megatron" / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, match", [
    ("", "empty file"),
    ("1 2.0\n2 3.0 4.0\n", r":2: expected 2 columns 'STEP LOSS', got 3"),
    ("1 2.0\nx 3.0\n", r":2: step 'x' is not an integer"),
    ("1 2.0\n\n3 abc\n", r":3: value 'abc' is not a number"),
])
def test_torchtitan_bad_files(tmp_path: Path, text: str, match: str) -> None:
    p = write(tmp_path, "loss.txt", text)
    with pytest.raises(RefrunInputError, match=match) as exc:
        parse_torchtitan(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


def test_torchtitan_nan_kept(tmp_path: Path) -> None:
    c = parse_torchtitan(write(tmp_path, "l.txt", "1 2.5\n2 nan\n3 inf\n"), metric="lm")
    steps, vals = c.series("lm")
    assert steps == [1, 2, 3] and vals[0] == 2.5 and math.isnan(vals[1]) and vals[2] == math.inf


@pytest.mark.parametrize("text, match", [
    ("step,loss\n1,2\n2,3,4\n", r":3: expected 2 columns, got 3"),
    ("step,loss\n1,2\n2,abc\n", r":3: column 'loss': 'abc' is not a number"),
    ("step,loss\n1.5,2\n", r":2: column 'step': step '1.5' is not an integer"),
    ("iter,loss\n1,2\n", r":1: no step column 'step'"),
    ("step,loss\n", "no data rows"),
    ("step,loss,loss\n1,2,3\n", "duplicate column"),
    ("step\n1\n", "no metric column"),
])
def test_csv_bad_files(tmp_path: Path, text: str, match: str) -> None:
    p = write(tmp_path, "c.csv", text)
    with pytest.raises(RefrunInputError, match=match) as exc:
        parse_csv(p)
    assert str(p) in str(exc.value)


def test_csv_empty_cell_is_missing_not_zero(tmp_path: Path) -> None:
    c = parse_csv(write(tmp_path, "c.csv", "step,loss,eval/acc\n0,1.0,\n1,0.5,0.9\n2,nan,\n"))
    assert c.series("eval/acc") == ([1], [0.9])
    steps, vals = c.series("loss")
    assert steps == [0, 1, 2] and math.isnan(vals[2])


@pytest.mark.parametrize("doc, match", [
    ("[1, 2]", "expected a JSON object"),
    ("{}", "empty object"),
    ('{"lm loss": [1, 2]}', 'key "lm loss": expected an object with "values"'),
    ('{"lm loss": {"values": {"a": 1}}}', r'key "lm loss".values."a": step is not an integer'),
    ('{"lm loss": {"values": {"1": "oops"}}}', r'key "lm loss".values."1": \'oops\' is not'),
    ('{"lm loss": {"values": {"1": null}}}', r'key "lm loss".values."1": None is not'),
    ('{"lm loss": {"values": {}}}', 'key "lm loss".values: no values'),
    ('{"lm loss": {"values": {"1": 2.0,}}}', r":1: not valid JSON"),
])
def test_megatron_bad_files(tmp_path: Path, doc: str, match: str) -> None:
    p = write(tmp_path, "g.json", doc)
    with pytest.raises(RefrunInputError, match=match) as exc:
        parse_megatron(p)
    assert str(p) in str(exc.value)


@needs_data
def test_megatron_resumed_parse_drops_only_placeholders() -> None:
    c = parse_megatron(MEG / "golden_values_dev_dgx_h100.json",
                       resumed=MEG / "golden_values_dev_dgx_h100_2nd.json")
    assert c.params["import.megatron.resume_step"] == "51"
    steps, vals = c.series("loss")
    assert steps == list(range(1, 101)) + list(range(51, 101))
    raw2 = json.loads((MEG / "golden_values_dev_dgx_h100_2nd.json").read_text())
    assert vals[100:] == [float(raw2["lm loss"]["values"][str(s)]) for s in range(51, 101)]
    # iteration-time has no value at the resume step itself: kept as NaN, not dropped
    st_steps, st_vals = c.series("perf/step_time_s")
    assert st_steps[99:] == list(range(51, 101)) and math.isnan(st_vals[99])
    alone = parse_megatron(MEG / "golden_values_dev_dgx_h100_2nd.json", rename=False)
    assert sum(math.isnan(v) for v in alone.series("lm loss")[1]) == 50


def _count_runs(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(exps)) if exps else 0


def test_bad_files_write_nothing_and_cli_exits_2(store, tmp_path: Path, capsys) -> None:
    good = write(tmp_path, "good.csv", "step,loss,acc\n0,1.0,0.1\n1,0.5,\n2,0.25,0.3\n")
    run_id = import_csv(good, workload="w", role="reference", hardware="cpu",
                        tracking_uri=store.tracking_uri, spool_dir=store.spool_dir)
    loaded = load_run(run_id, tracking_uri=store.tracking_uri)
    s, v, _ = loaded.series("loss")
    np.testing.assert_array_equal(v[np.argsort(s)], [1.0, 0.5, 0.25])
    assert loaded.series("acc")[0].tolist() == [0, 2]
    assert loaded.tags["refrun.backend"] == "import" and loaded.role == "reference"
    before = _count_runs(store.tracking_uri)
    bad_csv = write(tmp_path, "bad.csv", "step,loss\n0,1\n1,2\n2,x\n")
    bad_json = write(tmp_path, "bad.json", '{"lm loss": {"values": {"1": 1.0, "2": "x"}}}')
    bad_txt = write(tmp_path, "bad.txt", "1 2\n2\n")
    cases = [
        (["csv", str(bad_csv)], f"{bad_csv}:4"),
        (["megatron", str(bad_json)], 'key "lm loss".values."2"'),
        (["torchtitan", str(bad_txt)], f"{bad_txt}:2"),
        (["torchtitan", str(tmp_path / "missing.txt")], "no such file"),
    ]
    capsys.readouterr()
    for args, needle in cases:
        rc = main(["import", *args, "--workload", "w", "--role", "candidate",
                   "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    # a valid resumed pair with a bad second half writes nothing either
    with pytest.raises(RefrunInputError):
        import_megatron(write(tmp_path, "ok.json", '{"lm loss": {"values": {"1": 1.0}}}'),
                        resumed=bad_json, workload="w", role="candidate", hardware="cpu",
                        tracking_uri=store.tracking_uri)
    assert _count_runs(store.tracking_uri) == before
    rc = main(["import", "csv", str(good), "--workload", "w", "--role", "candidate",
               "--hardware", "tpu", "--metric", "acc", "--tracking-uri", store.tracking_uri])
    new_id = capsys.readouterr().out.strip()
    assert rc == 0 and _count_runs(store.tracking_uri) == before + 1
    assert load_run(new_id, tracking_uri=store.tracking_uri).metric_names == ["acc"]


def _megatron_doc(tmp_path: Path, steps: int) -> tuple[Path, dict[str, np.ndarray]]:
    """A valid golden-values file: 3 metrics over steps 1..steps, with a one-step spike in
    the loss, a NaN ("nan" string) and a negative spike in the step time."""
    rng = np.random.default_rng(7)
    s = np.arange(1, steps + 1)
    series = {
        "lm loss": 10.0 * np.exp(-s / (steps / 3)) + 0.01 * rng.standard_normal(steps),
        "iteration-time": 0.5 + 0.001 * rng.standard_normal(steps),
        "num-zeros": rng.integers(0, 1000, steps).astype(float),
    }
    series["lm loss"][12_345] = 99.0  # a one-step spike, far from any bucket edge
    series["iteration-time"][777] = -5.0
    series["num-zeros"][4_321] = np.nan
    doc = {name: {"start_step": 1, "end_step": steps, "step_interval": 1,
                  "values": {str(k): ("nan" if np.isnan(v) else float(v))
                             for k, v in zip(s.tolist(), vals.tolist(), strict=True)}}
           for name, vals in series.items()}
    path = tmp_path / "golden_values_big.json"
    path.write_text(json.dumps(doc))
    return path, series


def test_big_import_is_finished_with_every_point_and_a_bounded_spiky_history(
        store, tmp_path: Path, capsys) -> None:
    from mlflow.tracking import MlflowClient

    from refrun.util.thinning import MLFLOW_MAX_POINTS

    steps = 20_000
    path, series = _megatron_doc(tmp_path, steps)
    capsys.readouterr()
    rc = main(["import", "megatron", str(path), "--workload", "big", "--role", "reference",
               "--hardware", "h100", "--tracking-uri", store.tracking_uri])
    run_id = capsys.readouterr().out.strip()
    assert rc == 0
    client = MlflowClient(store.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time is not None  # on return
    assert run.data.tags["refrun.workload"] == "big"
    assert run.data.tags["refrun.backend"] == "import"
    assert run.data.tags["refrun.schema"] == "1"
    assert run.data.tags["refrun.steps.count"] == str(steps)
    assert run.data.tags["refrun.nonfinite"] == "1"
    data = load_run(run_id, tracking_uri=store.tracking_uri)
    assert data.source == "artifact" and data.points == 3 * steps
    assert "every point" in data.points_from
    names = {"lm loss": "loss", "iteration-time": "perf/step_time_s", "num-zeros": "num-zeros"}
    for raw, name in names.items():
        s, v, _ = data.series(name)
        order = np.argsort(s, kind="stable")
        np.testing.assert_array_equal(s[order], np.arange(1, steps + 1))
        np.testing.assert_array_equal(v[order], series[raw])  # NaN == NaN here
        hist = client.get_metric_history(run_id, name)
        hs = np.array([h.step for h in hist])
        hv = {h.step: h.value for h in hist}
        # bounded: at most 3 points per bucket plus the last and one non-finite
        assert len(hist) <= MLFLOW_MAX_POINTS + MLFLOW_MAX_POINTS // 3 + 1
        assert len(hist) < steps / 4
        assert hs.min() == 1 and hs.max() == steps  # first and last step always
        finite = np.where(np.isfinite(series[raw]), series[raw], np.nan)
        assert int(np.nanargmax(finite)) + 1 in hv  # the largest and smallest points
        assert int(np.nanargmin(finite)) + 1 in hv
    assert client.get_metric_history(run_id, "loss") and \
        {h.step: h.value for h in client.get_metric_history(run_id, "loss")}[12_346] == 99.0
    st = {h.step: h.value for h in client.get_metric_history(run_id, "perf/step_time_s")}
    assert st[778] == -5.0
    nz = {h.step: h.value for h in client.get_metric_history(run_id, "num-zeros")}
    assert math.isnan(nz[4_322])  # the NaN is kept in the view, not dropped


def test_names_and_steps_mlflow_refuses_are_one_line_errors_and_nothing_is_recorded(
        store, tmp_path: Path, capsys) -> None:
    long_name = "m" * 251
    cases = [
        ("csv", write(tmp_path, "a.csv", "step,a//b\n0,1.0\n"), ":1: column 'a//b'"),
        ("csv", write(tmp_path, "b.csv", "step,/abs\n0,1.0\n"), "'/abs' would resolve"),
        ("csv", write(tmp_path, "c.csv", f"step,{long_name}\n0,1.0\n"), "250"),
        ("csv", write(tmp_path, "d.csv", f"step,loss\n0,1.0\n{2**63},2.0\n"),
         ":3: column 'step': step 9223372036854775808 does not fit"),
        ("megatron", write(tmp_path, "e.json", '{"trail/": {"values": {"1": 1.0}}}'),
         'key "trail/"'),
        ("megatron", write(tmp_path, "f.json",
                           json.dumps({"lm loss": {"values": {"1": 1.0, str(2**63): 2.0}}})),
         f'key "lm loss".values."{2**63}": step {2**63} does not fit'),
        ("torchtitan", write(tmp_path, "g.txt", f"1 2.0\n{-(2**63) - 1} 3.0\n"), ":2: step"),
    ]
    capsys.readouterr()
    for fmt, path, needle in cases:
        rc = main(["import", fmt, str(path), "--workload", "names", "--role", "reference",
                   "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and str(path) in err, err
        assert len(err.splitlines()) == 1, err
    rc = main(["import", "torchtitan", str(write(tmp_path, "h.txt", "1 2.0\n")),
               "--metric", "./dot", "--workload", "names", "--role", "reference",
               "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
    assert rc == 2 and "'./dot'" in capsys.readouterr().err
    assert _count_runs(store.tracking_uri) == 0
    # MLflow accepts non-ASCII names and names up to 250 characters: so does the import.
    ok = write(tmp_path, "ok.csv", f"step,perte/époque,{'m' * 250}\n0,1.0,2.0\n1,0.5,1.0\n")
    run_id = import_csv(ok, workload="names", role="reference", hardware="cpu",
                        tracking_uri=store.tracking_uri)
    assert load_run(run_id, tracking_uri=store.tracking_uri).metric_names == \
        sorted(["perte/époque", "m" * 250])


# --- hostile files (issue 22) -------------------------------------------------------------
def test_csv_saved_with_a_bom_is_read(tmp_path: Path) -> None:
    # Spreadsheet programs write a UTF-8 byte-order mark in front of a CSV file.
    p = tmp_path / "sheet.csv"
    p.write_bytes(b"\xef\xbb\xbfstep,loss\n0,1.5\n1,0.75\n")
    assert parse_csv(p).series("loss") == ([0, 1], [1.5, 0.75])


def test_megatron_repeated_step_key_is_refused_not_collapsed(tmp_path: Path) -> None:
    # json.loads keeps the last of two equal keys silently; the file says two values.
    p = write(tmp_path, "g.json", '{"lm loss": {"values": {"1": 2.0, "2": 1.5, "1": 3.0}}}')
    with pytest.raises(RefrunInputError, match=r'key "1" appears twice') as exc:
        parse_megatron(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)
    # Two spellings of one step are two JSON keys but one step.
    p2 = write(tmp_path, "g2.json", '{"lm loss": {"values": {"1": 2.0, "01": 3.0}}}')
    with pytest.raises(RefrunInputError, match=r'key "lm loss".values: step 1 given 2 times'):
        parse_megatron(p2)


def test_hostile_files_are_one_line_errors_from_the_cli(store, tmp_path: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    deep = write(tmp_path, "deep.json", '{"lm loss": ' + "[" * 100_000 + "]" * 100_000 + "}")
    big = write(tmp_path, "big.txt", "".join(f"{i} 1.0\n" for i in range(2_000)))
    for args, needle, limit in [
        (["megatron", str(deep)], f"{deep}:1: JSON nested more than 64 levels deep", None),
        (["torchtitan", str(big)], f"{big}: {big.stat().st_size:,} bytes, larger than the "
                                   "import limit of 10,000 bytes", "10000"),
    ]:
        if limit:
            monkeypatch.setenv("REFRUN_IMPORT_MAX_BYTES", limit)
        rc = main(["import", *args, "--workload", "w", "--role", "reference",
                   "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert _count_runs(store.tracking_uri) == 0
