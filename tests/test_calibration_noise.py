"""Tolerances that respect cadence and noise (issue 21, item 3 of "what to build"):

* a seed logging its loss every 10 steps passes the final-window closeness calibrated on
  references logging every step (the tolerance accounts for the window's points), while a
  real shift logged at that cadence still fails;
* the step-time limit includes run-to-run noise back-to-back references do not show (a
  within-run block bootstrap and a floor): identical code timed with CPU-busy processes
  beside it does not fail, a step twice as slow still does;
* a reference seed that is an outlier among the others is named (output and file) and
  left out of the thresholds.

Real runs recorded with refrun's session into a real sqlite store (in-process delivery).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

import refrun
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import (
    CalibrationOptions,
    block_bootstrap_sd,
    calibrate_ids,
    write_file,
)
from refrun.acceptance.criteria import CriteriaFile, load_criteria
from refrun.cli import main

N = 200


@pytest.fixture(autouse=True)
def _thread_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")  # in-process delivery: cheap runs


def _loss(seed: int, tau_scale: float = 1.0) -> np.ndarray:
    """A noisy loss: the per-step noise (0.05) dominates the seeds' spread at the end."""
    rng = np.random.default_rng(seed)
    t = np.arange(N)
    tau = 40.0 * tau_scale * (1 + 0.03 * rng.normal())
    return 2.3 * np.exp(-t / tau) + 0.3 + rng.normal(0, 0.05, N)


def _record(uri: str, spool: Path, role: str, seed: int, loss: np.ndarray, every: int = 1
            ) -> str:
    rng = np.random.default_rng(seed + 500)
    with refrun.start_run("noisy", role, backend="torch", seed=seed, tracking_uri=uri,
                          spool_dir=spool, planned_steps=N,
                          snapshot_environment=False) as run:
        for i in range(N):
            if i % every == every - 1:
                run.log(i, loss=float(loss[i]))
        run.log_eval(N - 1, accuracy=0.9 + rng.normal(0, 0.004))
    assert run.run_id is not None
    return run.run_id


def _calibrated(tmp_path: Path) -> tuple[str, Path, list[str], CriteriaFile]:
    """Five reference seeds logging every step, and the file calibrate writes from them."""
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    refs = [_record(uri, spool, "reference", s, _loss(s)) for s in range(5)]
    path = tmp_path / "c.toml"
    write_file(calibrate_ids(refs, uri, CalibrationOptions(group_size=4)), str(path))
    crit = load_criteria(path)
    return uri, spool, refs, crit


def test_final_window_tolerance_accounts_for_the_points_the_window_holds(
        tmp_path: Path) -> None:
    uri, spool, refs, crit = _calibrated(tmp_path)
    fw = crit.criterion("loss-final-window")
    assert fw.window_calibrated_points == 20 and fw.window_noise_rel > 0
    # By hand: the per-point noise from first differences of the references' last 20
    # steps (var(diff) / 2), relative to the references' window mean.
    last = np.vstack([_loss(s)[-20:] for s in range(5)])
    noise = math.sqrt(np.mean(np.var(np.diff(last, axis=1), axis=1, ddof=1) / 2))
    assert fw.window_noise_rel == pytest.approx(noise / abs(last.mean()), rel=1e-3)
    for seed in (21, 22, 23):  # other seeds logging every 10 steps: 2 points per window
        loss = _loss(seed)
        cand = _record(uri, spool, "candidate", seed, loss, every=10)
        a, _ = assess_ids(crit, refs[:4], cand, uri)
        r = a.result("loss-final-window")
        assert r.outcome == "pass", r.reason
        steps = np.arange(N)[np.arange(N) % 10 == 9][-2:]  # the candidate's own steps
        ref_mean = np.vstack([_loss(s)[steps] for s in range(4)]).mean()
        extra = fw.window_noise_z * fw.window_noise_rel * abs(ref_mean) * math.sqrt(
            (1 + 1 / 4) * (1 / 2 - 1 / 20))
        assert r.evidence["window_points"] == 2
        assert r.evidence["allowed"] == pytest.approx(
            math.hypot(fw.rel_tol * abs(ref_mean), extra), rel=1e-9)
        assert r.evidence["candidate_mean"] == pytest.approx(loss[steps].mean())
    # A real change logged at that cadence still fails: the final loss doubled (a window
    # of 2 points cannot see much less than the per-point noise).
    shifted = _loss(24) + np.where(np.arange(N) >= 150, 0.3, 0.0)
    cand = _record(uri, spool, "candidate", 24, shifted, every=10)
    a, _ = assess_ids(crit, refs[:4], cand, uri)
    assert a.result("loss-final-window").outcome == "fail"


def test_block_bootstrap_matches_the_median_standard_error() -> None:
    # Independent value: for iid normal log-times the median's standard error is
    # sqrt(pi / 2) sigma / sqrt(n) (asymptotic relative efficiency of the median).  A
    # bootstrap estimate of it scatters (relative error ~ n^(-1/4)): average 10 samples.
    expected = math.sqrt(math.pi / 2) * 0.1 / math.sqrt(400)
    got = [block_bootstrap_sd(np.exp(np.random.default_rng(s).normal(0, 0.1, 400)))
           for s in range(10)]
    assert float(np.mean(got)) == pytest.approx(expected, rel=0.2)
    assert block_bootstrap_sd(np.ones(3)) == 0.0


def _timed_run(uri: str, spool: Path, role: str, seed: int, work: float = 1.0,
               timed: bool = True) -> str:
    """A step that waits like a device-bound step (4 ms) and computes on the host (about
    0.5 ms x work); its wall time is the recorded step time.  ``timed=False``: no wait and
    no work, the step time recorded as 4.5 ms x work x a 5 % log-normal scatter (what a
    test of the recorded numbers needs, whatever else the machine is doing)."""
    rng = np.random.default_rng(seed)
    with refrun.start_run("timed", role, backend="torch", seed=seed, tracking_uri=uri,
                          spool_dir=spool, planned_steps=80,
                          snapshot_environment=False) as run:
        for i in range(80):
            t0 = time.perf_counter()
            if timed:
                time.sleep(0.004 * work)
                sum(range(int(20_000 * work)))
            step_s = (time.perf_counter() - t0 if timed
                      else 0.0045 * work * math.exp(rng.normal(0, 0.05)))
            run.log(i, loss=1.0 / (i + 1) + rng.normal(0, 0.001),
                    **{"perf/step_time_s": step_s})
        run.log_eval(79, accuracy=0.9 + rng.normal(0, 0.004))
    assert run.run_id is not None
    return run.run_id


def _busy(n: int) -> list[subprocess.Popen[str]]:
    """n processes spinning on the CPU, returned once each has started spinning."""
    code = "import sys\nprint('spinning', flush=True)\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "spinning"
    return procs


def test_identical_code_on_a_busy_machine_does_not_fail_step_time(tmp_path: Path) -> None:
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    refs = [_timed_run(uri, spool, "reference", s) for s in range(5)]  # back to back
    path = tmp_path / "c.toml"
    write_file(calibrate_ids(refs, uri, CalibrationOptions(group_size=4)), str(path))
    crit = load_criteria(path)
    st = crit.criterion("step-time")
    cal = st.calibration
    assert {"held_out_ratio", "bootstrap_ratio", "floor"} <= set(cal)
    assert st.max_ratio >= max(cal["held_out_ratio"], cal["bootstrap_ratio"], cal["floor"])
    assert "floor" in st.description and "bootstrap" in st.description
    procs = _busy(os.cpu_count() or 2)
    try:
        busy = _timed_run(uri, spool, "candidate", 7)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    a, _ = assess_ids(crit, refs[:4], busy, uri)
    r = a.result("step-time")
    assert r.outcome == "pass", r.reason
    # Judged on the raw times: the steady median ratio (and, when the median is over the
    # limit, the 5 % quantile's) by hand from the recorded values is what decided.
    assert st.low_quantile == 0.05
    slow = _timed_run(uri, spool, "candidate", 8, work=2.2)  # a step more than twice as slow
    a, _ = assess_ids(crit, refs[:4], slow, uri)
    assert a.result("step-time").outcome == "fail", a.result("step-time").reason


def test_a_step_time_limit_too_wide_to_catch_a_2x_slower_step_is_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """References whose step times differ by about 3x between seeds (two recorded with
    three times the work) widen the calibrated limit past 2: calibrate says so in one line,
    with the seeds' spread of the judged statistic (by hand from the stored step times),
    in its output and in the file; references recorded alike get no such line."""
    from mlflow import MlflowClient

    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    alike = [_timed_run(uri, spool, "reference", s) for s in range(3)]
    slow = [_timed_run(uri, spool, "reference", s, work=3.0) for s in (3, 4)]
    quiet = calibrate_ids([*alike, _timed_run(uri, spool, "reference", 9)], uri,
                          CalibrationOptions(group_size=3))
    assert not [n for n in quiet.notes if n.startswith("step-time:")]
    # The same references with a floor set above 2 by hand: the floor is what to change.
    floored = calibrate_ids(quiet.run_ids, uri,
                            CalibrationOptions(group_size=3, step_time_floor=2.5))
    said = [n for n in floored.notes if n.startswith("step-time:")]
    assert len(said) == 1 and "set by the floor" in said[0], floored.notes
    assert said[0].endswith("lower --step-time-floor")
    path = tmp_path / "c.toml"
    assert main(["calibrate", "--reference", *alike, *slow, "--tracking-uri", uri,
                 "--keep-outliers", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("note: step-time:")]
    assert len(lines) == 1, out
    st = load_criteria(path).criterion("step-time")
    assert st.max_ratio >= 2.0
    assert f"max_ratio {st.max_ratio:g}" in lines[0]
    assert "lets a candidate 2x slower per step pass" in lines[0]
    # By hand: each run's 5 % quantile of its steady step times (from the warm-up end the
    # file states), max over min.
    start = st.calibration["warmup_end_step"]
    client = MlflowClient(uri)
    lows = []
    for rid in alike + slow:
        pts = [m.value for m in client.get_metric_history(rid, "perf/step_time_s")
               if m.step >= start]
        lows.append(float(np.quantile(pts, 0.05)))
    assert f"differ by up to {max(lows) / min(lows):.2f}x" in lines[0]
    comments = " ".join(ln.lstrip("# ").strip() for ln in
                        path.read_text(encoding="utf-8").splitlines() if ln.startswith("#"))
    assert " ".join(lines[0][len("note: "):].split()) in " ".join(comments.split())


def test_an_outlier_reference_seed_is_named_and_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    good = [_record(uri, spool, "reference", s, _loss(s)) for s in range(5)]
    odd = _record(uri, spool, "reference", 5, _loss(5, tau_scale=3.0))  # decays 3x slower
    # Five exchangeable seeds: nobody is named.
    assert calibrate_ids(good, uri).outliers == []
    path = tmp_path / "c.toml"
    assert main(["calibrate", "--reference", *good, odd, "--tracking-uri", uri, "-o",
                 str(path)]) == 0
    out = capsys.readouterr().out
    named = [ln for ln in out.splitlines() if ln.startswith("outlier:")]
    assert len(named) == 1 and odd in named[0] and "left out" in named[0]
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    assert doc["calibration"]["outliers"] == [odd]
    assert doc["calibration"]["outliers_excluded"] is True
    assert doc["calibration"]["runs"] == sorted(good) and doc["calibration"]["n"] == 5
    assert f"reference run {odd} (seed 5) is an outlier" in path.read_text(encoding="utf-8")
    # By hand: the odd seed's final-window loss mean, leave one out, against t_{N-2}.
    means = np.array([_loss(s)[-20:].mean() for s in range(5)] + [_loss(5, 3.0)[-20:].mean()])
    others = means[:5]
    t = abs(means[5] - others.mean()) / (others.std(ddof=1) * math.sqrt(1 + 1 / 5))
    assert t > sps.t.ppf(1 - 0.05 / (6 * 2) / 2, 4)  # 2 quantities: loss, accuracy
    # The thresholds are those of the five others alone.
    alone = tomllib.loads(calibrate_ids(good, uri).text())
    k = {c["id"]: c.get("k") for c in doc["criteria"]}
    assert k["loss-envelope"] == {c["id"]: c.get("k") for c in alone["criteria"]}[
        "loss-envelope"]
    # --keep-outliers keeps it in (and still names it).
    assert main(["calibrate", "--reference", *good, odd, "--tracking-uri", uri,
                 "--keep-outliers", "-o", str(path)]) == 0
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    assert doc["calibration"]["runs"] == sorted([*good, odd])
    assert doc["calibration"]["outliers_excluded"] is False


def test_envelope_fraction_accounts_for_the_points_the_candidate_logged(
        tmp_path: Path) -> None:
    """A candidate logging every 10th step is judged on 20 points, not 200: its fraction
    inside is binomially noisier, and the calibrated ``min_fraction`` is lowered by
    ``z sqrt(p (1 - p) (1/n - 1/N))`` (by hand below), not applied as is."""
    uri, spool, refs, crit = _calibrated(tmp_path)
    env = crit.criterion("loss-envelope")
    # the fraction calibrated at N points (derived from the references: <= 0.9)
    p = env.min_fraction
    assert env.calibrated_points == N and 0.8 <= p <= 0.9
    need = p - env.points_noise_z * math.sqrt(p * (1 - p) * (1 / 20 - 1 / N))
    logged = np.arange(N)[np.arange(N) % 10 == 9]  # the 20 steps a candidate logs
    band = np.vstack([_loss(s)[logged] for s in range(4)])  # the group, by hand
    mean, sd = band.mean(0), band.std(0, ddof=1)
    for seed, pushed, outcome in ((31, 3, "pass"), (32, 7, "fail")):
        loss = _loss(seed)
        loss[logged[1:1 + 2 * pushed:2]] += 5.0  # far outside the band at `pushed` points
        inside = int(np.sum(np.abs(loss[logged] - mean) <= env.k * sd))
        assert need <= inside / 20 < p if outcome == "pass" else inside / 20 < need
        cand = _record(uri, spool, "candidate", seed, loss, every=10)
        a, _ = assess_ids(crit, refs[:4], cand, uri)
        r = a.result("loss-envelope")
        assert r.evidence["n_steps"] == 20 and r.evidence["steps_inside"] == inside
        assert r.evidence["min_fraction"] == pytest.approx(need, rel=1e-12)
        assert r.outcome == outcome, r.reason


def test_a_calibrated_limit_is_the_float_of_its_rounded_up_decimal() -> None:
    """Calibrate rounds each limit up to 4 significant digits; the value it keeps must be
    the float the file's decimal reads back as, or a limit printed from it rounds
    differently from the same limit read from the file (CI saw "max_ratio 24.7" said and
    24.65 written).  Expected values by the decimal module's ceiling at 4 digits."""
    from decimal import ROUND_CEILING, Context

    from refrun.acceptance.calibration.derive import _round_up

    ceiling = Context(prec=4, rounding=ROUND_CEILING)
    rng = np.random.default_rng(0)
    for x in [24.6412, 0.0123456, 3.3333, 1.0031, 1234.5, 98765.4,
              *10 ** rng.uniform(-9, 5, 2000)]:
        got = _round_up(float(x))
        assert got == float(ceiling.create_decimal(float(x))), x
        assert got == float(f"{got:.4g}") and f"{got:.3g}" == f"{float(repr(got)):.3g}"


def test_a_reference_seed_recorded_on_a_busier_machine_is_not_an_outlier(
        tmp_path: Path) -> None:
    """A seed whose steps took three times as long (what a loaded machine did to one of
    the 8 seeds of scripts/make_criteria.py) but whose numbers are exchangeable with the
    others' is not named an outlier, so it stays in every numerical threshold: the step
    time says how busy the machine was, not how the workload computes."""
    from mlflow import MlflowClient

    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    # The step times as recorded (not this machine's): measured ones made the premise
    # below depend on how busy the machine running the test was (t = 3.1 with other test
    # workers beside it, where 10 was meant).
    alike = [_timed_run(uri, spool, "reference", s, timed=False) for s in range(5)]
    slow = _timed_run(uri, spool, "reference", 5, work=3.0, timed=False)
    cal = calibrate_ids([*alike, slow], uri, CalibrationOptions(group_size=3))
    assert cal.outliers == []
    doc = tomllib.loads(cal.text())
    assert slow in doc["calibration"]["runs"] and doc["calibration"]["n"] == 6
    # By hand: the slow seed's log median step time, leave one out, is far outside any
    # limit the outlier rule uses (t_{N-2} at a Bonferroni level: under 10 here).
    client = MlflowClient(uri)
    meds = np.log([np.median([m.value for m in client.get_metric_history(r, "perf/step_time_s")])
                   for r in [*alike, slow]])
    others = meds[:5]
    t = abs(meds[5] - others.mean()) / (others.std(ddof=1) * math.sqrt(1 + 1 / 5))
    assert t > 10


def test_unlucky_reference_seeds_do_not_set_the_final_window_tolerance(
        tmp_path: Path) -> None:
    """Issue 52 item 5: five references whose final-window means happen to agree far
    better than their own windows' noise allows (each window shifted onto the five's
    common mean: the unluckiest draw there is).  The held-out limit alone would be that
    agreement; calibrate's tolerance is at least the prediction bound of one more seed's
    window mean (window sampling error included), and fresh seeds pass."""
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    losses = [_loss(s) for s in range(5)]
    target = float(np.mean([x[-20:].mean() for x in losses]))
    for x in losses:
        x[-20:] += target - x[-20:].mean()
    refs = [_record(uri, spool, "reference", s, x) for s, x in enumerate(losses)]
    path = tmp_path / "c.toml"
    opts = CalibrationOptions(group_size=4)
    write_file(calibrate_ids(refs, uri, opts), str(path))
    fw = load_criteria(path).criterion("loss-final-window")
    cal = fw.calibration
    assert cal["held_out_limit"] < 1e-6  # the five agree to rounding
    # By hand (scipy): each window's residual sd about its line, the lag-1 corrected by
    # (1 + 3 r1) / k and clamped to [0, 0.95], the AR(1) variance of a 20-point mean
    # summed in full; then sqrt((1 + 1/5) z^2 mean se^2) (tau^2 = 0: the means agree),
    # relative to |the common mean|, at the file's coverage (its window_noise_z: the same
    # normal quantile, written rounded up).
    t = np.arange(20)
    ses = []
    for x in losses:
        w = x[-20:]
        fit = sps.linregress(t, w)
        r = w - (fit.intercept + fit.slope * t)
        r1 = float(np.sum(r[:-1] * r[1:]) / np.sum(r * r))
        rho = min(0.95, max(0.0, r1 + (1 + 3 * r1) / 20))
        var = float(np.sum(r * r)) / 18 * float(
            (rho ** np.abs(np.subtract.outer(t, t))).sum()) / 400
        ses.append(var)
    crit = load_criteria(path)
    want = fw.window_noise_z * math.sqrt(1.2 * float(np.mean(ses))) / abs(target)
    assert cal["prediction_bound"] == pytest.approx(want, rel=2e-3)
    assert fw.rel_tol >= cal["prediction_bound"]
    for seed in range(30, 40):  # fresh seeds of the same workload
        cand = _record(uri, spool, "candidate", seed, _loss(seed))
        a, _ = assess_ids(crit, refs, cand, uri)
        r = a.result("loss-final-window")
        assert r.outcome == "pass", (seed, r.reason)
