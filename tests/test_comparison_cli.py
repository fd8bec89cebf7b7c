"""``refrun compare`` end to end on a real sqlite store: table, JSON, comparison run, and
bad input as one line with exit code 2 and nothing written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refrun.cli import main
from refrun.importers import import_csv


def _count_runs(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(exps)) if exps else 0


def _csv(path: Path, steps: np.ndarray, loss: np.ndarray) -> Path:
    lines = ["step,loss,perf/step_time_s"] + [f"{s},{float(v)!r},0.5" for s, v in zip(steps, loss,
                                                                              strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_compare_cli_table_json_and_comparison_run(store, tmp_path: Path, capsys) -> None:
    steps = np.arange(0, 40)
    ref_loss = np.exp(-steps / 10.0)
    cand_loss = ref_loss * 1.01
    kw = {"tracking_uri": store.tracking_uri, "spool_dir": store.spool_dir}
    ref = import_csv(_csv(tmp_path / "r.csv", steps, ref_loss), workload="w",
                     role="reference", hardware="a100", **kw)
    cand = import_csv(_csv(tmp_path / "c.csv", steps[::2], cand_loss[::2]), workload="w",
                      role="candidate", hardware="tpu", **kw)
    out_json = tmp_path / "out" / "cmp.json"
    capsys.readouterr()
    rc = main(["compare", "--reference", ref, "--candidate", cand, "--metrics", "loss",
               "--json", str(out_json), "--tracking-uri", store.tracking_uri])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mean_abs_diff" in out and "cadence differs" in out
    doc = json.loads(out_json.read_text())
    loss = doc["metrics"]["loss"]
    r, c = ref_loss[::2], cand_loss[::2]
    assert loss["alignment"]["aligned_steps"] == 20
    assert loss["alignment"]["only_in_reference"] == 20
    assert abs(loss["measures"]["mean_abs_diff"] - np.mean(np.abs(c - r))) < 1e-12
    assert doc["reference"][0]["run_id"] == ref and doc["candidate"]["run_id"] == cand
    # points loaded: loss only (--metrics), 20 steps
    assert doc["candidate"]["source"] == "artifact" and doc["candidate"]["points"] == 20
    assert doc["candidate"]["points_from"].startswith("curves artifact refrun/curves.parquet")
    assert f"candidate: {cand} (FINISHED; points from curves artifact" in out
    comparison_id = out.strip().splitlines()[-1].split()[-1]
    from mlflow.tracking import MlflowClient

    crun = MlflowClient(store.tracking_uri).get_run(comparison_id)
    assert crun.data.tags["refrun.role"] == "comparison"
    assert crun.data.tags["refrun.compared.candidate"] == cand
    assert "diff/loss" in crun.data.metrics and "reldiff/loss" in crun.data.metrics

    before = _count_runs(store.tracking_uri)
    bad = [
        (["--reference", "0123456789abcdef", "--candidate", cand], "run '0123456789abcdef'"),
        (["--reference", ref, "--candidate", cand, "--metrics", "nope"],
         "metric 'nope': not recorded in run"),
    ]
    late = import_csv(_csv(tmp_path / "late.csv", steps + 1000, ref_loss), workload="w",
                      role="candidate", hardware="tpu", **kw)
    before += 1
    bad.append((["--reference", ref, "--candidate", late, "--metrics", "loss"],
                "no common steps"))
    capsys.readouterr()
    for args, needle in bad:
        rc = main(["compare", *args, "--tracking-uri", store.tracking_uri])
        err = [ln for ln in capsys.readouterr().err.splitlines() if "refrun" in ln]
        assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert _count_runs(store.tracking_uri) == before
    # the real command in its own process exits 2 too
    env = {**os.environ, "MLFLOW_TRACKING_URI": store.tracking_uri}
    proc = subprocess.run([sys.executable, "-m", "refrun", "compare", "--reference", "x",
                           "--candidate", cand, "--no-record"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "run 'x': not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_comparison_run_history_is_a_bounded_view_with_first_last_and_spikes(
        store, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from refrun.comparison import compare, record_comparison
    from refrun.comparison.loading import read_curves_fast
    from refrun.util.thinning import MLFLOW_MAX_POINTS

    n = 10_000
    steps = np.arange(n)
    ref_loss = 3.0 * np.exp(-steps / 3000.0) + 0.1
    rng = np.random.default_rng(3)
    cand_loss = ref_loss + 1e-4 * rng.standard_normal(n)
    cand_loss[4_321] += 2.0  # one-step spikes at steps not divisible by 3
    cand_loss[7_777] -= 1.5
    kw = {"tracking_uri": store.tracking_uri}
    ref = import_csv(_csv(tmp_path / "r.csv", steps, ref_loss), workload="w",
                     role="reference", hardware="a100", **kw)
    cand = import_csv(_csv(tmp_path / "c.csv", steps, cand_loss), workload="w",
                      role="candidate", hardware="tpu", **kw)
    cmp = compare(ref, cand, metrics=["loss"], tracking_uri=store.tracking_uri,
                  progress=False)
    run_id = record_comparison(cmp, tracking_uri=store.tracking_uri)
    client = MlflowClient(store.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    d = cand_loss - ref_loss  # independent of the code under test
    rel = np.abs(d) / np.maximum(np.maximum(np.abs(cand_loss), np.abs(ref_loss)), 1e-12)
    for name, want in (("diff/loss", d), ("reldiff/loss", rel)):
        hist = {h.step: h.value for h in client.get_metric_history(run_id, name)}
        assert len(hist) <= MLFLOW_MAX_POINTS + 1 and len(hist) < n / 3
        assert 0 in hist and n - 1 in hist  # first and last aligned step always
        for spike in (4_321, 7_777):
            assert hist[spike] == pytest.approx(want[spike], abs=1e-12)
    # the run's curves artifact keeps every aligned step
    art = client.download_artifacts(run_id, "refrun/curves.parquet", str(tmp_path))
    curves = read_curves_fast(Path(art))
    full = curves[curves["metric"] == "diff/loss"].sort_values("step")
    np.testing.assert_array_equal(full["step"].to_numpy(), steps)
    np.testing.assert_allclose(full["value"].to_numpy(), d, rtol=0, atol=1e-12)
    names = {f.path for f in client.list_artifacts(run_id, "refrun")}
    assert "refrun/comparison.json" in names


def test_help_lists_every_sub_command_without_importing_mlflow() -> None:
    from refrun.cli import COMMANDS, build_parser

    code = ("import sys\nfrom refrun.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "heavy = [m for m in ('mlflow', 'pandas', 'plotly', 'torch', 'jax') "
            "if m in sys.modules]\nprint('HEAVY', heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    for name, (_, help_) in COMMANDS.items():
        assert f"    {name}" in proc.stdout and help_ in " ".join(proc.stdout.split())
    assert "HEAVY []" in proc.stdout
    version = subprocess.run([sys.executable, "-m", "refrun", "--version"],
                             capture_output=True, text=True, timeout=120, check=True)
    assert version.stdout.startswith("refrun ")
    # Each table entry's module really registers that name, with the table's help line.
    for name, (_, help_) in COMMANDS.items():
        parser = build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps[name] == help_, name
        assert sub.choices[name].add_help  # the real parser, not the placeholder


def test_compare_records_a_run_whose_hardware_tag_predates_validation(store, capsys) -> None:
    """A store written before hardware validation holds free-text refrun.hardware tags
    (written here straight through MlflowClient): recording the comparison still works,
    the comparison run's hardware is unset and the text is kept in its own tag."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.tracking_uri)
    exp = client.create_experiment("legacy")
    ids = {}
    for role, hw, scale in (("reference", "a100", 1.0), ("candidate", "H100 (sxm)", 1.5)):
        rid = client.create_run(exp, tags={"refrun.workload": "legacy", "refrun.role": role,
                                           "refrun.hardware": hw}).info.run_id
        client.log_batch(rid, metrics=[Metric("loss", scale * (10 - i), 1000 + i, i)
                                       for i in range(10)])
        client.set_terminated(rid, "FINISHED")
        ids[role] = rid
    capsys.readouterr()
    rc = main(["compare", "--reference", ids["reference"], "--candidate", ids["candidate"],
               "--tracking-uri", store.tracking_uri])
    assert rc == 0, capsys.readouterr().err
    (cmp_run,) = client.search_runs([exp], "tags.`refrun.role` = 'comparison'")
    tags = cmp_run.data.tags
    assert "refrun.hardware" not in tags
    assert tags["refrun.compared.candidate_hardware"] == "H100 (sxm)"
    assert tags["refrun.compared.candidate"] == ids["candidate"]
    # diff/loss = candidate - reference = 0.5 * (10 - step), computed by hand
    hist = client.get_metric_history(cmp_run.info.run_id, "diff/loss")
    assert [(m.step, m.value) for m in hist] == [(i, 0.5 * (10 - i)) for i in range(10)]
