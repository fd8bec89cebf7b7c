"""Every criterion kind with a passing and a failing candidate, on real recorded runs; the
evidence values are checked against numpy on the raw logged arrays.  Also level ordering,
the highest level, the CLI's exit codes and the recorded comparison run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, Logged, N, base_loss, eval_steps, record, write_criteria
from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.acceptance import assess, load_criteria
from refrun.acceptance.record import ARTIFACT_ASSESSMENT, ARTIFACT_CRITERIA
from refrun.cli import main
from refrun.comparison import load_run


class World:
    uri: str
    spool: Path
    refs: list[Logged]
    good: Logged
    bad: Logged
    short: Logged


def _acc(level: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return level - 0.05 * np.exp(-STEPS / 20.0) + rng.normal(0, 0.001, N)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("accept")
    w = World()
    w.uri, w.spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    w.refs = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        w.refs.append(record(w.uri, w.spool, "reference", {
            "loss": base_loss() + rng.normal(0, 0.02, N),
            "eval/accuracy": _acc(0.8653, seed),
            "perf/step_time_s": 0.10 + rng.normal(0, 0.002, N),
        }, seed=seed, tags={"refrun.exec.hardware": "cuda: NVIDIA L4"}))
    rng = np.random.default_rng(10)
    good_time = 0.08 + rng.normal(0, 0.002, N)
    good_time[:5] = 3.0  # compilation steps, skipped by the warm-up
    w.good = record(w.uri, w.spool, "candidate", {
        "loss": base_loss() + rng.normal(0, 0.02, N),
        "eval/accuracy": _acc(0.8654, 10),
        "perf/step_time_s": good_time,
        "compile/graphs": np.r_[3.0, np.zeros(N - 1)],
        "xfer/d2h": np.ones(N),
        "sys/tpu0_duty_cycle_pct": np.r_[np.full(10, 5.0), np.full(N - 10, 80.0)],
    }, hardware="tpu-v5e", seed=10, hold_s=0.02,
        tags={"refrun.exec.hardware": "TPU", "refrun.fallback.ops": '{"aten::nonzero": 4}'})
    rng = np.random.default_rng(11)
    drift = np.where(STEPS >= 60, 0.4, 0.0)
    w.bad = record(w.uri, w.spool, "candidate", {
        "loss": base_loss() + rng.normal(0, 0.02, N) + drift,
        "eval/accuracy": _acc(0.8489, 11),
        "perf/step_time_s": 0.35 + rng.normal(0, 0.002, N),
        "compile/graphs": np.where(STEPS % 25 == 0, 1.0, 0.0),
        "xfer/d2h": np.r_[np.ones(50), np.full(N - 50, 4.0)],
        "sys/tpu0_duty_cycle_pct": np.full(N, 13.0),
    }, hardware="tpu-v5e", seed=11, hold_s=0.02,
        tags={"refrun.exec.hardware": "CPU", "refrun.placement.warning": "params on cpu",
              "refrun.fallback.ops": '{"aten::nonzero": 4, "aten::_unique2": 7}'})
    short_loss = (base_loss() + 0.01)[:60]
    short_loss[30] = np.nan
    w.short = record(w.uri, w.spool, "candidate", {"loss": short_loss}, seed=12)
    return w


def _load(w: World, logged: Logged):
    return load_run(logged.run_id, tracking_uri=w.uri, progress=False)


def _assess(w: World, tmp: Path, body: str, cand: Logged, refs: list[Logged] | None = None):
    crit = load_criteria(write_criteria(tmp, body))
    return assess(crit, [_load(w, r) for r in (refs or w.refs[:1])], _load(w, cand))


def _ref_mean(w: World, metric: str, refs: list[Logged]) -> np.ndarray:
    return np.mean([r.metrics[metric] for r in refs], axis=0)


def test_closeness_point_and_final_window(world: World, tmp_path: Path) -> None:
    body = """
[[criteria]]
id = "c"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.1
rel_tol = 0.02
min_fraction = 0.98
"""
    ref = world.refs[0].metrics["loss"]
    for cand, outcome in ((world.good, "pass"), (world.bad, "fail")):
        r = _assess(world, tmp_path, body, cand).result("c")
        c = cand.metrics["loss"]
        within = np.isclose(c, ref, rtol=0.02, atol=0.1)
        assert r.outcome == outcome, r.reason
        assert r.evidence["steps_within"] == int(within.sum())
        assert r.evidence["fraction_within"] == pytest.approx(within.mean())
        assert r.evidence["max_abs_diff"] == pytest.approx(np.abs(c - ref).max())
        assert r.evidence["step_of_max_abs_diff"] == int(np.argmax(np.abs(c - ref)))
    # Final window, mean aggregate: mean of the last ceil(0.1 * 100) = 10 steps.
    body2 = body.replace('min_fraction = 0.98', 'over = "final_window"\naggregate = "mean"')
    r = _assess(world, tmp_path, body2, world.bad).result("c")
    c = world.bad.metrics["loss"]
    assert r.evidence["n_steps"] == 10 and r.evidence["first_step"] == 90
    assert r.evidence["diff_of_means"] == pytest.approx(c[-10:].mean() - ref[-10:].mean())
    assert r.outcome == "fail"


def test_closeness_eval_points_and_last(world: World, tmp_path: Path) -> None:
    body = """
[[criteria]]
id = "acc"
level = "L1"
kind = "closeness"
metric = "eval/accuracy"
over = "eval_points"
abs_tol = 0.005
"""
    ev = eval_steps()
    ref = world.refs[0].metrics["eval/accuracy"][ev]
    good = _assess(world, tmp_path, body, world.good).result("acc")
    bad = _assess(world, tmp_path, body, world.bad).result("acc")
    assert good.outcome == "pass" and bad.outcome == "fail"
    assert good.evidence["n_steps"] == len(ev)
    cand = world.bad.metrics["eval/accuracy"][ev]
    assert bad.evidence["steps_within"] == int(np.isclose(cand, ref, rtol=0, atol=0.005).sum())
    last = _assess(world, tmp_path, body.replace("eval_points", "last"), world.bad).result("acc")
    assert last.evidence["n_steps"] == 1 and last.evidence["first_step"] == N - 1


def test_envelope_std_and_minmax(world: World, tmp_path: Path) -> None:
    body = """
[[criteria]]
id = "env"
level = "L1"
kind = "envelope"
metric = "loss"
band = "std"
k = 4.0
min_fraction = 0.9
"""
    m = np.array([r.metrics["loss"] for r in world.refs])
    mean, std = m.mean(0), m.std(0, ddof=1)
    for cand, outcome in ((world.good, "pass"), (world.bad, "fail")):
        r = _assess(world, tmp_path, body, cand, world.refs).result("env")
        c = cand.metrics["loss"]
        inside = np.abs(c - mean) <= 4.0 * std
        assert r.outcome == outcome, r.reason
        assert r.evidence["steps_inside"] == int(inside.sum())
        assert r.evidence["n_references"] == 3
    r = _assess(world, tmp_path, body.replace('"std"', '"minmax"'), world.bad,
                world.refs).result("env")
    c = world.bad.metrics["loss"]
    assert r.evidence["steps_inside"] == int(((c >= m.min(0)) & (c <= m.max(0))).sum())
    assert r.outcome == "fail"
    one = _assess(world, tmp_path, body, world.good).result("env")
    assert one.outcome == "not_evaluable" and "at least 2 reference" in one.reason


def test_claim_and_the_reference_rule(world: World, tmp_path: Path) -> None:
    # The paper's four-chip case: published 85.6%, GPU 86.53%, candidate 84.89%.
    body = """
[[criteria]]
id = "claim"
level = "L3"
kind = "claim"
metric = "eval/accuracy"
at_least = 0.856
match_reference_abs_tol = 0.005
"""
    ref_last = world.refs[0].metrics["eval/accuracy"][-1]
    good = _assess(world, tmp_path, body, world.good).result("claim")
    bad = _assess(world, tmp_path, body, world.bad).result("claim")
    assert good.outcome == "pass" and good.evidence["rule_applied"] == "claim"
    assert bad.outcome == "fail" and bad.evidence["reference_meets_claim"] is True
    assert bad.evidence["candidate_value"] == pytest.approx(world.bad.metrics["eval/accuracy"][-1])
    assert bad.evidence["reference_value"] == pytest.approx(ref_last)
    # A claim the reference misses too: matching the reference preserves behaviour.
    body2 = body.replace("0.856", "0.95")
    good2 = _assess(world, tmp_path, body2, world.good).result("claim")
    bad2 = _assess(world, tmp_path, body2, world.bad).result("claim")
    assert good2.outcome == "pass" and good2.evidence["rule_applied"] == "matches_reference"
    assert good2.evidence["diff_from_reference"] == pytest.approx(
        world.good.metrics["eval/accuracy"][-1] - ref_last)
    assert bad2.outcome == "fail"
    # Without the rule, missing the claim fails even when matching the reference.
    body3 = body2.replace("match_reference_abs_tol = 0.005\n", "")
    assert _assess(world, tmp_path, body3, world.good).result("claim").outcome == "fail"


INTEGRITY = """
[[criteria]]
id = "hw"
level = "L2"
kind = "hardware"
expected = "tpu"

[[criteria]]
id = "fb"
level = "L2"
kind = "fallback"
allow = ["aten::nonzero"]

[[criteria]]
id = "comp"
level = "L2"
kind = "compilation"
max = 0
warmup_steps = 5

[[criteria]]
id = "xfer"
level = "L2"
kind = "host_transfers"
max = 1
warmup_steps = 10

[[criteria]]
id = "util"
level = "L2"
kind = "utilization"
min_pct = 50
warmup_steps = 10
"""


def test_integrity_kinds(world: World, tmp_path: Path) -> None:
    good = _assess(world, tmp_path, INTEGRITY, world.good)
    bad = _assess(world, tmp_path, INTEGRITY, world.bad)
    for cid in ("hw", "fb", "comp", "xfer", "util"):
        assert good.result(cid).outcome == "pass", good.result(cid).reason
        assert bad.result(cid).outcome == "fail", bad.result(cid).reason
    assert bad.result("hw").evidence["exec_hardware"] == "CPU"
    assert bad.result("fb").evidence["outside_allowlist"] == {"aten::_unique2": 7}
    comp = world.bad.metrics["compile/graphs"]
    assert bad.result("comp").evidence["total_after_warmup"] == comp[STEPS >= 5].sum()
    assert good.result("comp").evidence["total_after_warmup"] == 0
    x = world.bad.metrics["xfer/d2h"][STEPS >= 10]
    assert bad.result("xfer").evidence["per_step_mean"] == pytest.approx(x.mean())
    u = world.good.metrics["sys/tpu0_duty_cycle_pct"][STEPS >= 10]
    assert good.result("util").evidence["mean_pct"] == pytest.approx(u.mean())
    # The references were recorded without these counters: not evaluable, with the reason.
    ref_as_cand = _assess(world, tmp_path, INTEGRITY, world.refs[1])
    assert ref_as_cand.result("comp").outcome == "not_evaluable"
    assert "has none of the metrics compile/graphs" in ref_as_cand.result("comp").reason
    assert ref_as_cand.result("util").outcome == "not_evaluable"


PERF = """
[prices]
currency = "USD"
[prices.hourly]
nvidia-l4 = 0.71
tpu-v5e = 1.20

[[criteria]]
id = "speed"
level = "L4"
kind = "step_time"
max_ratio = 1.0
warmup_steps = 5

[[criteria]]
id = "cost"
level = "L4"
kind = "cost"
max_ratio = 5.0
time_source = "step_time_sum"

[[criteria]]
id = "wallcost"
level = "L4"
kind = "cost"
max_cost = 1000.0
"""


def test_step_time_and_cost(world: World, tmp_path: Path) -> None:
    ref_t = world.refs[0].metrics["perf/step_time_s"]
    for cand, outcome in ((world.good, "pass"), (world.bad, "fail")):
        a = _assess(world, tmp_path, PERF, cand)
        assert a.level("L3").status == "no_criteria"
        # L3 has no criteria, so L4 is held back ...
        assert a.result("speed").evaluated is False
        # ... which a real L3 criterion unlocks.
        a = _assess(world, tmp_path, PERF + CLAIM_PASS_ANY, cand)
        sp, co = a.result("speed"), a.result("cost")
        c_t = cand.metrics["perf/step_time_s"]
        # steady: after warm-up, and no step where a compile counter moved
        steady = (STEPS >= 5) & (cand.metrics["compile/graphs"] == 0)
        ratio = np.median(c_t[steady]) / np.median(ref_t[STEPS >= 5])
        assert sp.evidence["ratio"] == pytest.approx(ratio)
        assert sp.outcome == outcome
        cost_c, cost_r = c_t.sum() / 3600 * 1.20, ref_t.sum() / 3600 * 0.71
        assert co.evidence["candidate_cost"] == pytest.approx(cost_c)
        assert co.evidence["ratio"] == pytest.approx(cost_c / cost_r)
        assert co.outcome == ("pass" if cost_c / cost_r <= 5.0 else "fail")
        run = MlflowClient(world.uri).get_run(cand.run_id)
        own_ms = 1e3 * (float(run.data.tags[schema.TAG_RECORDING_START_S])
                        + float(run.data.tags[schema.TAG_RECORDING_CLOSE_S]))
        wall_h = (run.info.end_time - run.info.start_time - own_ms) / 3.6e6
        assert a.result("wallcost").evidence["candidate_cost"] == pytest.approx(wall_h * 1.20)
    assert co.outcome == "fail"  # the bad candidate: 3x slower at a higher price


CLAIM_PASS_ANY = """
[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "eval/accuracy"
at_least = 0.0
"""

CLAIM_FAIL = """
[[criteria]]
id = "goal"
level = "L3"
kind = "claim"
metric = "eval/accuracy"
at_least = 0.856
"""


def test_levels_order_and_highest_level(world: World, tmp_path: Path) -> None:
    body = INTEGRITY + CLAIM_FAIL + PERF
    good = _assess(world, tmp_path, body, world.good)
    assert [lv.status for lv in good.levels] == ["pass", "no_criteria", "pass", "pass", "pass"]
    assert good.highest_level == "L4" and good.verdict == "pass" and good.exit_code == 0
    bad = _assess(world, tmp_path, body, world.bad)
    assert bad.level("L3").status == "fail"
    for cid in ("speed", "cost", "wallcost"):
        r = bad.result(cid)
        assert r.evaluated is False and r.outcome == "not_evaluable"
        assert "only after L3 passed" in r.reason and r.evidence == {}
    assert bad.level("L4").status == "not_evaluated"
    assert bad.highest_level == "L0"  # L2 failed (hardware, fallback ...)
    assert bad.verdict == "fail" and bad.exit_code == 1
    # Integrity passes, goal fails: highest level is L2 and L4 is still not evaluated.
    sub = _assess(world, tmp_path, INTEGRITY + CLAIM_FAIL.replace("0.856", "0.99") + PERF,
                  world.good)
    assert sub.highest_level == "L2" and sub.result("speed").evaluated is False


def test_builtin_l0(world: World, tmp_path: Path) -> None:
    a = _assess(world, tmp_path, CLAIM_PASS_ANY, world.short)
    assert a.result("L0.finished").outcome == "pass"
    planned = a.result("L0.planned_steps")
    assert planned.outcome == "fail" and planned.evidence["last_step"] == 59
    assert planned.evidence["planned_steps"] == N
    finite = a.result("L0.finite_loss")
    assert finite.outcome == "fail" and finite.evidence["first_nonfinite_step"] == 30
    assert finite.evidence["nonfinite_points"] == int(np.isnan(world.short.metrics["loss"]).sum())
    assert a.highest_level is None
    ok = _assess(world, tmp_path, CLAIM_PASS_ANY, world.good)
    assert all(ok.result(c).outcome == "pass"
               for c in ("L0.finished", "L0.planned_steps", "L0.finite_loss"))


def test_cli_accept_records_and_exit_codes(world: World, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    crit = write_criteria(tmp_path, INTEGRITY + CLAIM_FAIL)
    client = MlflowClient(world.uri)
    out = tmp_path / "a.json"
    args = ["accept", "--criteria", str(crit), "--reference", world.refs[0].run_id,
            "--tracking-uri", world.uri]
    assert main([*args, "--candidate", world.good.run_id, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "highest level reached: L3" in text
    data = json.loads(out.read_text())
    assert data["verdict"] == "pass" and data["highest_level"] == "L3"
    comp_id = text.split("recorded on comparison run ")[1].split()[0]
    run = client.get_run(comp_id)
    assert run.data.tags["refrun.role"] == "comparison"
    assert run.data.tags["refrun.acceptance.L2"] == "pass"
    assert run.data.tags["refrun.acceptance.highest_level"] == "L3"
    assert run.data.tags["refrun.compared.candidate"] == world.good.run_id
    listed = {f.path for f in client.list_artifacts(comp_id, "refrun")}
    assert {ARTIFACT_ASSESSMENT, ARTIFACT_CRITERIA} <= listed
    assert main([*args, "--candidate", world.bad.run_id]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_metric_no_run_has_is_bad_input(world: World, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    crit = write_criteria(tmp_path, CLAIM_PASS_ANY.replace("eval/accuracy", "eval/acuracy"))
    client = MlflowClient(world.uri)
    exp = client.get_experiment_by_name("accept-test").experiment_id
    before = len(client.search_runs([exp]))
    rc = main(["accept", "--criteria", str(crit), "--reference", world.refs[0].run_id,
               "--candidate", world.good.run_id, "--tracking-uri", world.uri])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{crit}:6: criteria[0].metric (id 'goal'): metric 'eval/acuracy' is not recorded" \
        in err
    assert len(client.search_runs([exp])) == before  # nothing recorded
    rc = main(["accept", "--criteria", str(crit), "--reference", "nope",
               "--candidate", world.good.run_id, "--tracking-uri", world.uri])
    assert rc == 2 and "'nope'" in capsys.readouterr().err
