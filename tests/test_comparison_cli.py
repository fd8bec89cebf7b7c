"""``refrun compare`` end to end on a real sqlite store: table, JSON, comparison run, and
bad input as one line with exit code 2 and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

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
