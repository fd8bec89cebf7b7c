"""A real TPU v5e record run, read here (issue 51): the store `benchmarks/tpu/run.sh
record` wrote on the chip on 2026-12-06 (tests/fixtures/tpu/record-2026-12-06.tgz: the
pipelines' JAX ports and the matmul cross-check), merged into a store on this machine.

* every run comes across whole (``refrun merge``), and what L4 reads from each is what
  the chip recorded: the busy fraction is the mean of the run's
  ``sys/tpu0_duty_cycle_pct`` values read straight from the source's sqlite file (the
  independent reading), HBM present on every run;
* a run without a busy fraction says why in its tag (never a blank or a 0);
* the matmul cross-check's reading agrees with the load's known busy share.
"""

from __future__ import annotations

import json
import sqlite3
import tarfile
from pathlib import Path

import numpy as np
import pytest

from refrun import schema
from refrun.acceptance.performance import run_busy
from refrun.acceptance.runview import steady_start
from refrun.comparison.loading import load_run
from refrun.store.merge import merge

FIXTURE = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-06.tgz"
BUSY = "sys/tpu0_duty_cycle_pct"


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, str]]:
    """(the source store folder, the target's URI, source run id -> target run id)."""
    tmp = tmp_path_factory.mktemp("tpu-record")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp, filter="data")
    source = tmp / "tpu-store"
    uri = f"sqlite:///{tmp / 'here.db'}"
    result = merge(str(source / "mlflow.db"), uri)
    assert result.count("left out") == 0, result
    return source, uri, {r.source_id: r.target_id for r in result.runs}


def source_rows(source: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(source / "mlflow.db")
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_every_tpu_run_arrives_with_what_the_chip_recorded(merged) -> None:
    source, uri, ids = merged
    runs = dict(source_rows(source, "SELECT run_uuid, status FROM runs"))
    assert len(runs) == 25 and set(runs.values()) == {"FINISHED"} and set(ids) == set(runs)
    busy = {}
    for rid, value in source_rows(source, f"SELECT run_uuid, value FROM metrics "
                                          f"WHERE key = '{BUSY}'"):
        busy.setdefault(rid, []).append(value)
    hbm = {rid for (rid,) in source_rows(source, "SELECT DISTINCT run_uuid FROM metrics "
                                                 "WHERE key = 'sys/tpu0_mem_peak_bytes'")}
    assert hbm == set(runs)  # HBM on every run
    for src_id, dst_id in ids.items():
        run = load_run(dst_id, tracking_uri=uri, progress=False)
        got = run_busy(run, "last", lambda s: steady_start(s, None, 0.1))
        if src_id in busy:
            assert got.pct == pytest.approx(float(np.mean(busy[src_id])), rel=1e-12)
            assert got.source.startswith("profiler: busy time of the device timeline")
        else:  # no reading: the tag says why
            assert got.pct is None
            assert got.why.startswith(f"run {dst_id}: unavailable: ") and \
                "the run ended before a window was read" in got.why, got.why
    assert len(busy) >= 20  # what the record said: 23 of 25


def test_the_matmul_cross_check_reads_the_known_busy_share(merged) -> None:
    """The load's busy share known without the profiler (matmul time over step wall,
    timed on the chip): the sampler's reading within 5 points of it."""
    source, _, _ = merged
    manifest = json.loads((source / "manifest.json").read_text(encoding="utf-8"))
    checks = {c["variant"]: c for c in manifest["matmul_check"]}
    assert set(checks) == {"matmul-dense", "matmul-sparse"}
    for check in checks.values():
        (values,) = zip(*source_rows(source, f"SELECT value FROM metrics WHERE key = '{BUSY}'"
                                             f" AND run_uuid = '{check['run_id']}'"),
                        strict=True)
        assert abs(float(np.mean(values)) - check["expected_busy_pct"]) < 5.0, \
            (check, values)
    assert checks["matmul-dense"]["expected_busy_pct"] > 80 > 20 > \
        checks["matmul-sparse"]["expected_busy_pct"]
    tags = dict(source_rows(source, f"SELECT key, value FROM tags WHERE run_uuid = "
                                    f"'{checks['matmul-dense']['run_id']}'"))
    assert tags[schema.TAG_UTILIZATION_SOURCE].startswith("profiler: ")


def test_the_probe_cost_benchmark_runs_here_and_keeps_each_workload_as_it_ends(
        tmp_path: Path) -> None:
    """CI has no TPU, so the chip benchmark's script is run here (JAX on the CPU, tiny
    blocks): every arm's paired ratio for each workload, written to the JSON after each
    workload (a command stopped at the device's limit keeps what it finished), the
    forced profiler window's cost read (it broke unseen once when the sampler's window
    began to return its outcome)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "cost.json"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "tpu" / "probe_cost.py"),
                           "--workloads", "digits", "--rounds", "2", "--steps", "10",
                           "--warmup", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    (r,) = doc["results"]
    assert r["workload"] == "digits" and r["rounds"] == 2 and r["steps"] == 10
    assert set(r["ratios"]) == {"probed", "no-monitors", "no-log", "window", "burn"}
    assert all(len(v["geometric"]) == 3 for v in r["ratios"].values())
    assert r["window_cost_s"] and all(isinstance(c, float) for c in r["window_cost_s"])
    assert r["chip_busy_source"].startswith("unavailable: ")  # no device plane on the CPU
    assert proc.stdout.count("digits ") >= 2  # its row once measured, then the table


def test_the_tpu_plan_and_the_summary_of_a_real_assessment(tmp_path: Path) -> None:
    """record.py's plan (derived from the detection benchmark's variants) names every run
    the committed TPU store holds, and summary.py turns the committed assessment of that
    store into one row per run with its verdict and as-intended mark."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    tpu = root / "benchmarks" / "tpu"
    plan = subprocess.run([sys.executable, str(tpu / "record.py"), "--store", str(tmp_path),
                           "--dry-run"], capture_output=True, text=True, timeout=120, env=env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = {line.split()[1] for line in plan.stdout.splitlines() if line.strip()}
    with tarfile.open(FIXTURE) as tar:
        manifest = json.load(tar.extractfile("tpu-store/manifest.json"))
    recorded = {r["variant"] for r in manifest["runs"]}
    assert recorded <= planned and len(recorded) == 23, (recorded - planned)
    results = root / "benchmarks" / "tpu" / "results" / "assess-2026-12-06.json"
    rows = json.loads(results.read_text(encoding="utf-8"))
    out = subprocess.run([sys.executable, str(tpu / "summary.py"), str(results)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    body = [ln for ln in out.stdout.splitlines() if ln.startswith("| ")][1:]
    assert len(body) == len(rows) == 23
    for line, r in zip(body, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == r["variant"].removeprefix("tpu-") and cells[4] == r["verdict"]
        assert cells[5] == ("yes" if r["as_intended"] else "**no**")
