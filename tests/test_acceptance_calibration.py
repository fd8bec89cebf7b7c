"""`refrun calibrate` on real runs in a sqlite MLflow store: a criteria file derived from
reference seeds by held-out validation, re-measured with --check; benign candidates (a
fresh seed, another cadence, another backend) accepted, shifted or slower ones rejected;
the step-time scope and compilation steps; the equivalence and convergence kinds."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from scipy import stats as sps

from refrun import schema
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import (
    CalibrationOptions,
    calibrate_ids,
    calibration_digest,
    write_file,
)
from refrun.acceptance.criteria import load_criteria, parse_criteria
from refrun.acceptance.json_schema import shipped_schema_path
from refrun.cli import main
from tests.acceptance_helpers import STEPS, Logged, N, record, write_criteria

NAN = np.full(N, np.nan)


def _seed_metrics(seed: int, *, tau: float | None = None, time_scale: float = 1.0
                  ) -> dict[str, np.ndarray]:
    """One training run of a seed: its own decay rate and noise, like a real seed."""
    rng = np.random.default_rng(seed)
    t = tau if tau is not None else 30.0 * (1 + 0.03 * rng.normal())
    loss = 2.3 * np.exp(-STEPS / t) + 0.2 + rng.normal(0, 0.02, N)
    val = 2.3 * np.exp(-STEPS / (t * 1.1)) + 0.25 + rng.normal(0, 0.01, N)
    acc = NAN.copy()
    acc[-1] = 0.95 + rng.normal(0, 0.004)
    times = time_scale * (0.10 + rng.normal(0, 0.003, N))
    times[:3] = 2.0  # first steps: compilation and caches
    return {"loss": loss, "grad_norm/fc1.weight": 1.5 * np.exp(-STEPS / 45.0) + 0.1
            + rng.normal(0, 0.01, N), "eval/val_loss": val, "eval/test_accuracy": acc,
            "perf/step_time_s": times}


@dataclass
class World:
    uri: str = ""
    spool: Path = Path()
    refs: list[Logged] = field(default_factory=list)
    cand: dict[str, Logged] = field(default_factory=dict)
    path: Path = Path()

    @property
    def ref_ids(self) -> list[str]:
        return [r.run_id for r in self.refs]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("calib")
    w = World(uri=f"sqlite:///{tmp}/mlflow.db", spool=tmp / "spool")
    w.refs = [record(w.uri, w.spool, "reference", _seed_metrics(s), seed=s) for s in range(5)]
    fresh = _seed_metrics(21)
    cadence = _seed_metrics(22)
    for m in ("loss", "grad_norm/fc1.weight", "perf/step_time_s"):
        cadence[m] = np.where(STEPS % 5 == 4, cadence[m], np.nan).astype(object)
        cadence[m][np.isnan(cadence[m].astype(float))] = None
    other = _seed_metrics(23, time_scale=3.0)  # another framework: slower on this CPU
    other["compile/graphs"] = np.r_[2.0, np.zeros(N - 1)]
    other["xfer/host_syncs"] = np.zeros(N)  # the JAX probe counts host reads in the step
    slow = _seed_metrics(25, time_scale=2.0)
    fast_conv = _seed_metrics(26, tau=12.0)
    for name, metrics, backend in (("fresh", fresh, "torch"), ("cadence", cadence, "torch"),
                                   ("other_backend", other, "jax"),
                                   ("slow", slow, "torch"),
                                   ("fast_convergence", fast_conv, "torch")):
        w.cand[name] = record(w.uri, w.spool, "candidate", metrics, backend=backend,
                              seed=hash(name) % 1000)
    opts = CalibrationOptions(group_size=3)
    w.path = tmp / "calibrated.toml"
    write_file(calibrate_ids(w.ref_ids, w.uri, opts), str(w.path))
    return w


def test_calibrated_file_loads_validates_and_states_its_provenance(world: World) -> None:
    text = world.path.read_text(encoding="utf-8")
    crit = load_criteria(world.path)
    shipped = json.loads(shipped_schema_path().read_text(encoding="utf-8"))
    jsonschema.validate(tomllib.loads(text), shipped)
    cal = crit.calibration
    # in run-id order: the file depends on which runs, not on the order given
    assert cal is not None and cal.runs == sorted(world.ref_ids) and cal.n == 5
    assert cal.group_size == 3 and cal.backend == "torch" and cal.refrun_version
    ids = {c.id for c in crit.criteria}
    assert {"loss-envelope", "loss-final-window", "grad_norm-fc1.weight-envelope",
            "val_loss-envelope", "test_accuracy-envelope", "step-time",
            "compilations-after-warmup", "host-syncs-per-step", "no-cpu-fallback"} <= ids
    # a gradient norm is judged by its envelope over every step, not by where it ends
    assert "grad_norm-fc1.weight-final-window" not in ids
    assert "judged by their envelope only" in text
    for c in crit.criteria:
        assert c.calibration, c.id  # provenance as data
        assert f"# {c.id}: " in text  # ... and as a comment
    env = crit.criterion("loss-envelope")
    assert env.calibration["margin"] == pytest.approx(env.k - env.calibration["worst"],
                                                      rel=1e-4, abs=1e-4)
    assert env.calibration["margin"] >= 0 and env.calibration["seeds"] == 5
    # the structural defaults say so, and are scoped to the backends that record them
    comp = crit.criterion("compilations-after-warmup")
    assert "structural default" in comp.description and comp.backends == ["jax", "torch_xla"]
    # host transfers: syncs where the JAX and XLA probes count them, copies where XLA does
    syncs, copies = crit.criterion("host-syncs-per-step"), crit.criterion(
        "host-copies-per-step")
    assert (syncs.metrics, syncs.max, syncs.backends) == (["xfer/host_syncs"], 0.5,
                                                          ["jax", "torch_xla"])
    assert (copies.metrics, copies.max, copies.backends) == (["xfer/d2h"], 0.5,
                                                             ["torch_xla"])
    assert "Power" in text and "detects" in text


def test_thresholds_cover_every_held_out_seed_by_hand(world: World) -> None:
    # Independent of the calibration code: each seed held out against every group of 3
    # others; the envelope's k must make >= min_fraction of the steps fall inside.
    crit = load_criteria(world.path)
    env = crit.criterion("loss-envelope")
    loss = np.vstack([r.metrics["loss"] for r in world.refs])
    acc = np.array([r.metrics["eval/test_accuracy"][-1] for r in world.refs])
    tol = crit.criterion("test_accuracy-envelope").abs_tol
    from itertools import combinations
    for i in range(5):
        for grp in combinations([j for j in range(5) if j != i], 3):
            g = loss[list(grp)]
            z = np.abs(loss[i] - g.mean(0)) / g.std(0, ddof=1)
            assert np.mean(z <= env.k) >= env.min_fraction
            a = acc[list(grp)]
            assert a.min() - tol <= acc[i] <= a.max() + tol


def test_check_accepts_the_references_and_names_a_too_tight_criterion(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["calibrate", "--reference", *world.ref_ids, "--tracking-uri", world.uri]
    assert main([*base, "--check", str(world.path)]) == 0
    assert "every criterion accepts every held-out seed" in capsys.readouterr().out
    crit = load_criteria(world.path)
    k = crit.criterion("loss-envelope").k
    tight = world.path.read_text().replace(f"k = {k!r}", "k = 0.2")
    assert tight != world.path.read_text()
    bad = write_criteria(tmp_path, tight, "tight.toml")
    assert main([*base, "--check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "criteria that reject a held-out seed: loss-envelope" in out


@pytest.mark.parametrize("name", ["fresh", "cadence", "other_backend"])
def test_benign_candidates_are_accepted(world: World, name: str) -> None:
    crit = load_criteria(world.path)
    a, _ = assess_ids(crit, world.ref_ids[:3], world.cand[name].run_id, world.uri)
    failed = [(r.id, r.reason) for r in a.results if r.outcome != "pass"
              and r.outcome != "not_applicable"]
    assert a.verdict == "pass", failed
    assert a.calibration_sha256 == calibration_digest(crit)
    assert a.to_dict()["calibration_sha256"] == calibration_digest(crit)
    if name == "other_backend":  # a 3x slower framework: no step-time verdict across
        st = a.result("step-time")
        assert st.outcome == "not_applicable" and "backend" in st.reason


def test_shifted_and_slower_candidates_are_rejected_by_the_right_criterion(
        world: World) -> None:
    crit = load_criteria(world.path)
    # The file's own power statement: a shift of `detectable_shift` on more than
    # 1 - min_fraction of the steps is caught.  Shift a fresh seed by 1.5x that from step 30.
    env = crit.criterion("loss-envelope")
    shift = 1.5 * env.calibration["detectable_shift"]
    m = _seed_metrics(24)
    m["loss"] = m["loss"] + np.where(STEPS >= 30, shift, 0.0)
    shifted = record(world.uri, world.spool, "candidate", m, backend="torch", seed=24)
    a, _ = assess_ids(crit, world.ref_ids[:3], shifted.run_id, world.uri)
    r = a.result("loss-envelope")
    assert r.outcome == "fail" and a.verdict == "fail", r.reason
    # the fraction inside, by hand
    loss = np.vstack([x.metrics["loss"] for x in world.refs[:3]])
    z = np.abs(m["loss"] - loss.mean(0)) / loss.std(0, ddof=1)
    assert r.evidence["fraction_inside"] == pytest.approx(np.mean(z <= env.k))
    a, _ = assess_ids(crit, world.ref_ids[:3], world.cand["slow"].run_id, world.uri)
    st = a.result("step-time")
    assert st.outcome == "fail", st.reason
    times = [r.metrics["perf/step_time_s"] for r in world.refs[:3]]
    start = st.evidence["warmup_end_step"]
    ref_med = np.median(np.concatenate([t[start <= STEPS] for t in times]))
    cand_med = np.median(world.cand["slow"].metrics["perf/step_time_s"][start <= STEPS])
    assert st.evidence["ratio"] == pytest.approx(cand_med / ref_med)


def test_calibration_digest_changes_with_the_calibration(world: World) -> None:
    text = world.path.read_text()
    crit = load_criteria(world.path)
    edited = parse_criteria(text.replace(f'runs = ["{min(world.ref_ids)}"',
                                         f'runs = ["{"0" * 32}"', 1))
    assert calibration_digest(crit) != calibration_digest(edited)
    assert len(calibration_digest(crit) or "") == 64
    plain = parse_criteria(text.split("[calibration]")[0] + text.split("[settings]")[1]
                           .split("\n", 1)[1])
    assert calibration_digest(plain) is None


def test_calibrate_bad_input_is_one_line_exit_2(world: World, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.toml"
    assert main(["calibrate", "--reference", *world.ref_ids[:2], "--tracking-uri",
                 world.uri, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "at least 3 reference runs" in err and len(err.splitlines()) == 1
    assert not out.exists()
    assert main(["calibrate", "--reference", *world.ref_ids, "--group-size", "5",
                 "--tracking-uri", world.uri]) == 2
    assert "--group-size" in capsys.readouterr().err
    for extra in ([], ["--check", str(world.path)]):  # calibrate and its check alike
        assert main(["calibrate", "--reference", *world.ref_ids, "--max-groups", "0",
                     "--tracking-uri", world.uri, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "--max-groups: 0 must be >= 1" in err and len(err.splitlines()) == 1


def test_calibrate_help_is_enough_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    for word in ("--workload", "--reference", "--check", "--false-alarm-rate",
                 "--group-size", "examples:", "refrun accept"):
        assert word in out


# --- step time ---------------------------------------------------------------------------
STEP_TIME = """
[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "eval/test_accuracy"
at_least = 0.0

[[criteria]]
id = "speed"
level = "L4"
kind = "step_time"
max_ratio = 1.5
"""


def test_step_time_leaves_out_compilation_steps(world: World, tmp_path: Path) -> None:
    m = _seed_metrics(30)
    recompile = (STEPS % 10 == 5)
    m["perf/step_time_s"] = np.where(recompile, 1.5, m["perf/step_time_s"])
    m["compile/graphs"] = np.where(recompile, 1.0, 0.0)  # 10 % of the steps recompile
    cand = record(world.uri, world.spool, "candidate", m, backend="torch", seed=30)
    crit = load_criteria(write_criteria(tmp_path, STEP_TIME))
    a, _ = assess_ids(crit, world.ref_ids[:3], cand.run_id, world.uri)
    r = a.result("speed")
    start = r.evidence["warmup_end_step"]
    keep = (start <= STEPS) & ~recompile
    assert r.evidence["candidate_median_s"] == pytest.approx(
        np.median(m["perf/step_time_s"][keep]))
    assert r.evidence["compile_steps_excluded"]["candidate"] == int(
        (recompile & (start <= STEPS)).sum())
    assert r.outcome == "pass"
    # across_backends = true judges another backend's ratio (3x slower: fail)
    body = STEP_TIME.replace("max_ratio = 1.5", "max_ratio = 1.5\nacross_backends = true")
    crit2 = load_criteria(write_criteria(tmp_path, body, "across.toml"))
    a2, _ = assess_ids(crit2, world.ref_ids[:3], world.cand["other_backend"].run_id,
                       world.uri)
    assert a2.result("speed").outcome == "fail"


# --- equivalence and convergence ------------------------------------------------------------
STATS = """
[[criteria]]
id = "acc-equivalent"
level = "L3"
kind = "equivalence"
metric = "eval/test_accuracy"
margin = 0.02

[[criteria]]
id = "val-converges"
level = "L3"
kind = "convergence"
metric = "eval/val_loss"
target = 0.6
direction = "at_most"
"""


def test_equivalence_and_convergence_on_real_runs(world: World, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = write_criteria(tmp_path, STATS)
    crit = load_criteria(path)
    refs = world.refs
    a, _ = assess_ids(crit, [r.run_id for r in refs], world.cand["fresh"].run_id, world.uri)
    eq = a.result("acc-equivalent")
    ref_acc = np.array([r.metrics["eval/test_accuracy"][-1] for r in refs])
    x = world.cand["fresh"].metrics["eval/test_accuracy"][-1]
    se = ref_acc.std(ddof=1) * math.sqrt(1 + 1 / 5)
    half = sps.t.ppf(0.95, 4) * se
    d = x - ref_acc.mean()
    assert eq.evidence[schema.EV_INTERVAL] == pytest.approx([d - half, d + half])
    assert eq.evidence[schema.EV_N_REFERENCE] == 5
    assert eq.outcome == ("pass" if d - half > -0.02 and d + half < 0.02 else "fail")

    def reach(v: np.ndarray) -> int:
        ev = [s for s in range(N) if s % 10 == 9 or s == N - 1]
        return next(s for s in ev if v[s] <= 0.6)

    pts = np.sort([reach(r.metrics["eval/val_loss"]) for r in refs]).astype(float)[1:-1]
    lo = pts.mean() - sps.t.ppf(0.95, len(pts) - 1) * pts.std() * math.sqrt(1 / len(pts) + 1)
    hi = 2 * pts.mean() - lo
    cv = a.result("val-converges")
    assert cv.evidence[schema.EV_INTERVAL] == pytest.approx([lo, hi])
    assert cv.evidence[schema.EV_N_REFERENCE] == 3
    x_reach = reach(world.cand["fresh"].metrics["eval/val_loss"])
    assert cv.outcome == ("pass" if lo <= x_reach <= hi else "fail")
    fast = world.cand["fast_convergence"]
    b, _ = assess_ids(crit, [r.run_id for r in refs], fast.run_id, world.uri)
    r = b.result("val-converges")
    assert r.outcome == "fail" and "significantly faster" in r.reason
    assert r.evidence["candidate_value"] == reach(fast.metrics["eval/val_loss"]) < lo
    # accept shows the interval and the seeds it rests on
    main(["accept", "--criteria", str(path), "--reference", *[x.run_id for x in refs],
          "--candidate", fast.run_id, "--tracking-uri", world.uri, "--no-record"])
    out = capsys.readouterr().out
    assert "val-converges: interval [" in out and "from 3 reference seed(s)" in out


def test_compilation_warm_up_is_counted_in_calls_so_an_early_storm_is_caught(
        world: World) -> None:
    # A recompilation storm that ends by step 8 of a 100-step run: a warm-up of 10 % of
    # the run hid it.  The calibrated criterion counts from the step's third call; a
    # benign XLA-like run (compiles at its first two calls and once at its first
    # evaluation) stays within the structural limit.
    crit = load_criteria(world.path)
    comp = crit.criterion("compilations-after-warmup")
    assert comp.warmup_steps == 2
    benign = _seed_metrics(31)
    benign["compile/graphs"] = np.zeros(N)
    benign["compile/graphs"][[0, 1, 25]] = 1.0
    storm = _seed_metrics(32)
    storm["compile/graphs"] = np.zeros(N)
    storm["compile/graphs"][[*range(9), 25]] = 1.0
    for m in (benign, storm):  # an XLA run records its host syncs and copies (none here)
        m["xfer/host_syncs"] = np.zeros(N)
        m["xfer/d2h"] = np.zeros(N)
    outcomes = {}
    for name, m in (("benign", benign), ("storm", storm)):
        run = record(world.uri, world.spool, "candidate", m, backend="torch_xla", seed=31)
        a, _ = assess_ids(crit, world.ref_ids[:3], run.run_id, world.uri)
        r = a.result("compilations-after-warmup")
        # by hand: compilations at steps >= first step + 2
        assert r.evidence["total_after_warmup"] == float(m["compile/graphs"][2:].sum())
        outcomes[name] = r.outcome
    assert outcomes == {"benign": "pass", "storm": "fail"}


def test_alignment_axes_are_not_calibrated_as_measurements(tmp_path: Path) -> None:
    # progress/samples is recorded by every probe as an axis: a criterion on it would
    # make every candidate without it "not evaluable".
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    refs = []
    for s in range(3):
        m = _seed_metrics(40 + s)
        m["progress/samples"] = 64.0 * (STEPS + 1)
        refs.append(record(uri, spool, "reference", m, seed=40 + s).run_id)
    cal = calibrate_ids(refs, uri, CalibrationOptions())
    crit = parse_criteria(cal.text(), "calibrated.toml")
    assert "loss-envelope" in {c.id for c in crit.criteria}
    data = [line for line in cal.text().splitlines() if not line.startswith("#")]
    assert not [line for line in data if "progress/" in line]
    assert "progress/samples: an alignment axis" in cal.text()
