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
import pandas as pd
import pytest

from refrun import pairing, schema
from refrun.acceptance.paired import derive_band, divergence_curve, judge
from refrun.acceptance.performance import run_busy, run_throughput
from refrun.acceptance.runview import steady_start, steady_step_times
from refrun.comparison import RunData
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


def assert_matmul_cross_check(source: Path) -> dict[str, dict]:
    """Each matmul load's busy share as the chip sampler read it (the mean of its
    ``sys/tpu0_duty_cycle_pct`` values in the store) within 5 points of the share known
    without the profiler (the record's manifest); the checks by variant."""
    manifest = json.loads((source / "manifest.json").read_text(encoding="utf-8"))
    checks = {c["variant"]: c for c in manifest["matmul_check"]}
    assert set(checks) == {"matmul-dense", "matmul-sparse"}
    for check in checks.values():
        (values,) = zip(*source_rows(source, f"SELECT value FROM metrics WHERE key = '{BUSY}'"
                                             f" AND run_uuid = '{check['run_id']}'"),
                        strict=True)
        assert abs(float(np.mean(values)) - check["expected_busy_pct"]) < 5.0, \
            (check, values)
    return checks


def test_the_matmul_cross_check_reads_the_known_busy_share(merged) -> None:
    """The load's busy share known without the profiler (matmul time over step wall,
    timed on the chip): the sampler's reading within 5 points of it."""
    source, _, _ = merged
    checks = assert_matmul_cross_check(source)
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
    assert set(r["ratios"]) == {"probed", "buffered", "buffer-only", "bare", "no-monitors",
                                "no-log", "window", "burn"}
    assert all(len(v) == 3 for v in r["buffer_only_vs_bare"].values())
    assert all(len(v["geometric"]) == 3 for v in r["ratios"].values())
    assert r["window_cost_s"] and all(isinstance(c, float) for c in r["window_cost_s"])
    assert r["chip_busy_source"].startswith("unavailable: ")  # no device plane on the CPU
    assert proc.stdout.count("digits ") >= 2  # its row once measured, then the table


def test_the_chip_dispatch_diagnostics_run_here_and_print_every_variant(tmp_path: Path) -> None:
    """The two diagnostics the seventh session ran on the chip (``dispatch_costs.py``: what
    each further array of a dispatch costs; ``buffer_costs.py``: a metrics buffer's cost
    split by variant, built on ``probe_cost.py``'s workloads) still run against the code
    they diagnose: every row printed with numbers, and no buffer refused or dropped."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}",
           "JAX_PLATFORMS": "cpu"}
    tpu = root / "benchmarks" / "tpu"
    proc = subprocess.run([sys.executable, str(tpu / "dispatch_costs.py"), "--steps", "20"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      proc.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 5, 9, 17], proc.stdout
    assert all(float(x) > 0 for r in rows for x in r[1:])
    assert proc.stdout.count("each array beyond the first") == 4
    proc = subprocess.run([sys.executable, str(tpu / "buffer_costs.py"), "--workloads",
                           "digits", "--steps", "20", "--blocks", "1"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = re.findall(r"^  (\S+)\s+CPU\s+[\d.]+ \(\s*[-+][\d.]+\)\s+wall\s+[\d.]+",
                     proc.stdout, re.M)
    assert got == ["plain", "rewrapped", "buffer", "step-only", "buffer+probe",
                   "buffer-only+probe"], proc.stdout
    assert "metrics buffer held" not in proc.stdout + proc.stderr  # no buffer refused


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


# --- the third record: the TPU's own known-good evidence (paired bands by hardware) -------------
THIRD = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-06-third.tgz"
# The CPU side of that record's assessment: each workload's reference seeds 0 and 1 and its
# known-good JAX port of seed 1 recorded on this CPU (the loss of each step, as assess.py's
# store held it: benchmarks/tpu/results/assess-2026-12-06-third.*).
CPU_PAIRS = Path(__file__).parent / "fixtures" / "tpu" / "cpu-pairs-2026-12-06-third.csv.gz"
TPU_RUNS = {  # workload -> (exact port of seed 0, known-good port of seed 1, bf16 port)
    "digits": ("tpu-jax-pair-seed0-highest", "tpu-knowngood-jax-seed1-highest",
               "tpu-jax-bf16-highest"),
    "charlm": ("tpu-charlm-jax-seed0-highest", "tpu-charlm-knowngood-jax-seed1-highest",
               "tpu-charlm-jax-bf16-highest"),
    "markov": ("tpu-markov-jax-seed0-highest", "tpu-markov-knowngood-jax-seed1-highest",
               "tpu-markov-jax-bf16-highest"),
}


def _tpu_runs(tmp: Path) -> dict[str, RunData]:
    """The third record's runs by ``pipeline.variant``: every tag and the loss of each step
    (its last value), read straight from the chip's sqlite file."""
    with tarfile.open(THIRD) as tar:
        tar.extractall(tmp, filter="data")
    src = tmp / "tpu-store"
    out = {}
    for (rid,) in source_rows(src, "SELECT run_uuid FROM runs"):
        tags = dict(source_rows(src, f"SELECT key, value FROM tags WHERE run_uuid = '{rid}'"))
        pts = source_rows(src, f"SELECT step, value FROM metrics WHERE run_uuid = '{rid}' "
                               "AND key = 'loss' ORDER BY step, timestamp")
        last = dict(pts)
        df = pd.DataFrame({"metric": "loss", "step": list(last), "value": list(last.values())})
        out[tags.get("pipeline.variant", rid)] = RunData.from_curves(df, rid, tags)
    return out


def _cpu_runs(workload: str) -> dict[str, RunData]:
    df = pd.read_csv(CPU_PAIRS)
    out = {}
    for variant, d in df[df.workload == workload].groupby("variant"):
        r = d.iloc[0]
        tags = {schema.TAG_HARDWARE: r.hardware, schema.TAG_BACKEND: r.backend,
                schema.TAG_SEED: str(r.seed)}
        if not pd.isna(r.known_good):
            tags |= pairing.pair_tags(int(r.pair_seed), known_good=r.known_good)
        curves = pd.DataFrame({"metric": "loss", "step": d.step, "value": d.loss})
        name = "knowngood" if not pd.isna(r.known_good) else str(variant).rsplit("-", 1)[-1]
        out[name] = RunData.from_curves(curves, r.run_id, tags)
    return out


def _running(a: RunData, b: RunData) -> tuple[np.ndarray, np.ndarray]:
    """Steps both logged and the running max |a - b| there (numpy, not refrun)."""
    sa, va, _ = a.series("loss")
    sb, vb, _ = b.series("loss")
    common, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    return common, np.maximum.accumulate(np.abs(va[ia] - vb[ib]))


def test_the_tpus_own_known_good_evidence_admits_its_exact_port(tmp_path: Path) -> None:
    """Each pipeline's exact JAX port of seed 0 at ``highest`` on the TPU stays within 90.5 x
    the envelope of the known-good evidence recorded on the TPU and on the CPU (computed
    here with numpy), and refrun's hardware band agrees; its bfloat16-matmul port leaves
    that band on every workload; and markov's exact port leaves the CPU evidence's band
    alone, the miss the TPU's own evidence corrects (docs/tpu.md, second and third record)."""
    tpu = _tpu_runs(tmp_path)
    for workload, (exact, kg, bf16) in TPU_RUNS.items():
        cpu = _cpu_runs(workload)
        refs = [cpu["seed0"], cpu["seed1"]]
        band, note = derive_band([cpu["knowngood"], tpu[kg]], refs, "loss")
        assert band is not None and set(band.hardware) == {"tpu"}, note
        hb = band.hardware["tpu"]
        steps, e_cpu = _running(cpu["knowngood"], cpu["seed1"])
        steps_t, e_tpu = _running(tpu[kg], cpu["seed1"])
        assert np.array_equal(steps, steps_t)
        env = np.maximum(e_cpu, e_tpu)
        env = np.maximum(env, env[env > 0].min())  # the floor
        for run, inside in ((exact, True), (bf16, False)):
            s, d = _running(tpu[run], cpu["seed0"])
            assert np.array_equal(s, steps)
            worst = float(np.max(d / env))
            assert (worst <= hb.max_ratio) is inside, (workload, run, worst)
            j = judge(divergence_curve(*cpu["seed0"].series("loss")[:2],
                                       *tpu[run].series("loss")[:2]),
                      hb.band_steps, hb.band_values, hb.max_ratio)
            assert (j.first_divergence_step is None) is inside, (workload, run, j)
            # refrun's knots thin the envelope by at most 10 % between knots
            assert worst <= j.max_ratio_observed <= worst * 1.1 * (1 + 1e-9)
        if workload == "markov":  # the CPU's evidence alone rejects the exact port
            j = judge(divergence_curve(*cpu["seed0"].series("loss")[:2],
                                       *tpu[exact].series("loss")[:2]),
                      band.band_steps, band.band_values, band.max_ratio)
            assert j.first_divergence_step is not None


# --- the fourth record: the ports recording through metrics buffers on the chip ----------------
FOURTH = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-06-fourth.tgz"


def _store_runs(fixture: Path, tmp: Path) -> dict[str, dict]:
    """A record's pipeline runs by ``pipeline.variant``: the loss of each step (its last
    value in MLflow's table), the refrun tags, the compilations artifact and the
    ``xfer/host_syncs`` points of ``refrun/curves.parquet``, read from the files alone."""
    with tarfile.open(fixture) as tar:
        tar.extractall(tmp, filter="data")
    src = tmp / "tpu-store"
    out = {}
    for rid, variant in source_rows(src, "SELECT r.run_uuid, t.value FROM runs r JOIN tags t "
                                         "ON t.run_uuid = r.run_uuid AND "
                                         "t.key = 'pipeline.variant'"):
        art = next(src.glob(f"mlruns/*/{rid}/artifacts/refrun"))
        curves = pd.read_parquet(art / "curves.parquet")
        out[variant] = {
            "loss": dict(source_rows(src, f"SELECT step, value FROM metrics WHERE run_uuid = "
                                          f"'{rid}' AND key = 'loss' ORDER BY step, timestamp")),
            "tags": dict(source_rows(src, f"SELECT key, value FROM tags WHERE run_uuid = "
                                          f"'{rid}'")),
            "compiles": json.loads((art / "jax_compilations.json").read_text()),
            "syncs": curves[curves.metric == schema.M_HOST_SYNCS],
            "curve_loss": curves[curves.metric == "loss"]}
    return out


def test_the_ports_recorded_through_metrics_buffers_on_the_chip_change_no_value(
        tmp_path: Path) -> None:
    """The fourth record (the pipelines' JAX ports recording through metrics buffers,
    ``pipelines/jax_buffered.py``) against the third (the same ports with ``probe.log``),
    both recorded on the TPU v5e: every run's loss at every step is the same number, bit
    for bit; each buffered run compiled its step once, as ``with_buffer``, counted no host
    sync, and dropped or refused nothing; the three ``float(loss)`` defects kept
    ``probe.log`` and their one host read a step (docs/tpu.md, fourth record)."""
    third = _store_runs(THIRD, tmp_path / "third")
    fourth = _store_runs(FOURTH, tmp_path / "fourth")
    assert set(fourth) == set(third) and len(fourth) == 26
    for variant, run in fourth.items():
        before = third[variant]["loss"]
        assert run["loss"] == before, variant  # the same steps and the same values
        assert run["loss"] == dict(zip(run["curve_loss"].step, run["curve_loss"].value,
                                       strict=True)), variant
        assert sorted(run["loss"]) == list(range(len(run["loss"]))), variant
        assert run["tags"][schema.TAG_DROPPED] == run["tags"][schema.TAG_REFUSED] == "0"
        graphs = {f: n for f, n in run["compiles"]["by_function"].items()
                  if f.endswith("[graph]")}
        syncs = run["syncs"]
        steps = len(run["loss"])
        if "float-loss" in variant:  # the defect reads the loss on the host: probe.log
            assert "with_buffer" not in run["compiles"]["step_functions"], variant
            assert syncs.value.sum() == steps, variant  # one read a step, counted
        else:
            assert run["compiles"]["step_functions"] == ["with_buffer"], variant
            assert graphs == {"jit(with_buffer) [graph]": 1}, (variant, graphs)
            assert syncs.value.sum() == 0, variant
    # and the chip sampler, beside buffers, still reads the known matmul loads' share
    assert_matmul_cross_check(tmp_path / "fourth" / "tpu-store")


# --- the sixth record: chip-busy windows that wait out the evaluation's compilation ----------
SIXTH = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-07-sixth.tgz"


def busy_points(source: Path) -> dict[str, int]:
    """The number of busy-fraction points of each pipeline run in a record, by
    ``pipeline.variant`` (0 for a run without any)."""
    return {v: n for v, n in source_rows(
        source, f"SELECT t.value, COUNT(m.value) FROM tags t LEFT JOIN metrics m ON "
                f"m.run_uuid = t.run_uuid AND m.key = '{BUSY}' WHERE t.key = "
                f"'pipeline.variant' GROUP BY t.value")}


def test_the_sampler_that_reads_around_compilations_changes_no_value_and_says_why_not(
        tmp_path: Path) -> None:
    """The sixth record (2026-12-07, code 5db3551: the sampler looks at the loop during a
    window, the JAX probe's progress moves with every compilation, a window that met the
    evaluation's compilation waits for the loop or is read over its steady stretch) against
    the fourth: every run's loss at every step the same, bit for bit; every run either has
    busy-fraction points or says in its tag why not, naming what its windows found; the
    windows read over a stretch are counted in the tag; the matmul cross-check holds."""
    fourth = _store_runs(FOURTH, tmp_path / "fourth")
    sixth = _store_runs(SIXTH, tmp_path / "sixth")
    assert set(sixth) == set(fourth) and len(sixth) == 26
    src = tmp_path / "sixth" / "tpu-store"
    busy = busy_points(src)
    trimmed = 0
    for variant, run in sixth.items():
        assert run["loss"] == fourth[variant]["loss"], variant
        source = run["tags"][schema.TAG_UTILIZATION_SOURCE]
        if busy[variant]:
            assert source.startswith("profiler: busy time of the device timeline"), variant
            trimmed += "read over their stretch without compilation" in source
        else:  # not blank: why, from the windows taken
            assert source.startswith("unavailable: libtpu: returned no data"), source
            assert "the run ended before a window was read: 1 taken, 1 dropped (no " \
                   "stretch of it ran steps without compiling)" in source, source
    # as recorded (docs/tpu.md, sixth record): 24 of 26 read, 9 of them over a steady
    # stretch (a window that met a compilation, read rather than dropped)
    assert sum(1 for n in busy.values() if n) == 24 and trimmed == 9
    assert_matmul_cross_check(src)


# --- the seventh record: a window that meets a compilation ends and is taken again ----------
SEVENTH = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-07-seventh.tgz"


def test_every_tpu_run_of_the_seventh_record_has_a_busy_fraction_and_the_same_losses(
        tmp_path: Path) -> None:
    """The seventh record (2026-12-07, code ea9075d: a window in which a compilation starts
    ends at once and is taken again once the loop is steady) against the fourth: every
    run's loss at every step the same, bit for bit; **every run has busy-fraction points**
    from the device timeline (the sixth record's two runs whose 2.4 s evaluation compile
    outlasted the window's wait included); the matmul cross-check holds."""
    fourth = _store_runs(FOURTH, tmp_path / "fourth")
    seventh = _store_runs(SEVENTH, tmp_path / "seventh")
    assert set(seventh) == set(fourth) and len(seventh) == 26
    src = tmp_path / "seventh" / "tpu-store"
    busy = busy_points(src)
    for variant, run in seventh.items():
        assert run["loss"] == fourth[variant]["loss"], variant
        assert busy[variant] >= 1, variant
        source = run["tags"][schema.TAG_UTILIZATION_SOURCE]
        assert source.startswith("profiler: busy time of the device timeline"), variant
    assert_matmul_cross_check(src)


EIGHTH = Path(__file__).parent / "fixtures" / "tpu" / "record-2026-12-07-eighth.tgz"


def _steady_of_record(fixture: Path, tmp: Path) -> dict[str, tuple]:
    """Per pipeline run of a record: (its steady steps and step times as
    :func:`steady_step_times` keeps them, its last step, the compilations counted between
    steps after the warm-up with their compile time, its steady throughput in samples/s)."""
    runs = _store_runs(fixture, tmp)
    src = tmp / "tpu-store"
    by_variant = dict(source_rows(src, "SELECT t.value, r.run_uuid FROM runs r JOIN tags t "
                                       "ON t.run_uuid = r.run_uuid AND "
                                       "t.key = 'pipeline.variant'"))

    def start_of(steps: np.ndarray) -> int:
        return steady_start(steps, None, 0.1)

    out = {}
    for variant, rec in runs.items():
        rid = by_variant[variant]
        curves = pd.read_parquet(next(src.glob(f"mlruns/*/{rid}/artifacts/refrun"))
                                 / "curves.parquet")
        run = RunData(rid, rec["tags"], {}, "FINISHED", None, None, curves)
        assert run.tags[schema.TAG_STEP_TIME_KIND] == schema.STEP_TIME_INTERVAL
        times = curves[curves.metric == schema.M_STEP_TIME]
        start = start_of(np.sort(times.step.to_numpy()))
        steps, secs, _ = steady_step_times(run, schema.M_STEP_TIME,
                                           list(schema.STEP_TIME_COMPILE_METRICS), "last",
                                           start)
        other = curves[(curves.metric == schema.M_COMPILE_OTHER) & (curves.value > 0)
                       & (curves.step > start)]
        compile_s = curves[curves.metric == schema.M_COMPILE_TIME]
        between = [(int(s), float(compile_s[compile_s.step == s].value.sum()))
                   for s in other.step]
        out[variant] = (steps, secs, int(times.step.max()), between,
                        run_throughput(run, "samples", "last", start_of).per_s)
    return out


def test_a_tpu_runs_steady_steps_leave_out_the_intervals_that_held_other_work(
        tmp_path: Path) -> None:
    """A JAX step time runs from a step's entry to the next one's (kind ``interval``), so
    the evaluation a port runs between steps, and the compilation of its evaluation
    function (counted as ``compile/other`` at the *next* step's entry), lie in the
    interval of the step before the counted one; the last step's interval runs to the
    probe's close.  On the seventh and eighth records (real TPU v5e runs of the same
    code): no steady step time is long enough to hold a compilation recorded between
    steps, the last step is left out, and each benign run (the exact ports of seed 0 at
    both precisions, the known-good ports of seed 1) has the same steady throughput in
    both records within 25 %.  Before, a charlm port's first evaluation put a 2.2 s
    interval among 133 steps of 1.3 ms, and its throughput read 903 samples/s in the
    seventh record and 7,432 in the eighth, as the batch-means blocks happened to fall."""
    seventh = _steady_of_record(SEVENTH, tmp_path / "seventh")
    eighth = _steady_of_record(EIGHTH, tmp_path / "eighth")
    assert set(seventh) == set(eighth) and len(seventh) == 26
    checked = 0
    for record in (seventh, eighth):
        for variant, (steps, secs, last, between, _) in record.items():
            assert len(steps) > 100 and last not in set(steps.tolist()), variant
            for s, took in between:  # a compilation between steps s - 1 and s
                assert took > 0.1 and secs.max() < took, (variant, s, took, secs.max())
                checked += 1
    # charlm's first evaluation (step 24) comes after its warm-up (15 of 150 steps)
    assert checked >= 2 * sum(1 for v in seventh if "charlm" in v) == 18
    benign = [v for v in seventh if "seed0" in v or "knowngood" in v]
    assert len(benign) == 9
    for v in benign:
        assert 0.8 < seventh[v][4] / eighth[v][4] < 1.25, (v, seventh[v][4], eighth[v][4])
