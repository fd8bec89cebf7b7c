"""`refrun calibrate` alone writes a file that reaches a verdict (issue 21, item 1).

A workload that logs its loss every step and evaluates every 10 steps (no one-value
metric): 5 reference seeds recorded by refrun's own session into a real sqlite store, then
`refrun calibrate --workload W -o c.toml` and `refrun accept` with nothing edited.  Benign
candidates (another seed, another evaluation cadence, a resume that replays steps) pass;
a candidate whose final evaluation is worse fails at L3; `--goal` writes the project's
goal as a claim; without any L3 criterion calibrate says so in one line (exit 2) and
`refrun accept` says why L4 is held back.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import refrun
from refrun.cli import main
from tests.acceptance_helpers import error_line

W = "evalw"
STEPS = 60


def _curves(seed: int, acc_shift: float = 0.0) -> dict[str, np.ndarray]:
    """One seed of the workload: its own decay rate and noise at every step."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    tau = 15.0 * (1 + 0.03 * rng.normal())
    return {"loss": 2.3 * np.exp(-t / tau) + 0.2 + rng.normal(0, 0.02, STEPS),
            "eval/val_loss": 2.3 * np.exp(-t / (1.1 * tau)) + 0.25 + rng.normal(0, 0.01, STEPS),
            "eval/val_accuracy": 0.95 - 0.6 * np.exp(-t / tau) + rng.normal(0, 0.005, STEPS)
            - acc_shift * (t >= STEPS - 10),
            "perf/step_time_s": np.r_[2.0, 2.0, 0.1 + rng.normal(0, 0.003, STEPS - 2)]}


def _record(uri: str, spool: Path, role: str, seed: int, *, eval_every: int = 10,
            resume_at: int | None = None, acc_shift: float = 0.0) -> str:
    """Log like a training loop: loss and step time every step, the evaluation metrics
    every ``eval_every`` steps (and at the last step).  ``resume_at``: the run stops at
    step 44 and resumes from a checkpoint of step ``resume_at``, replaying the steps in
    between; a faithful restore (model, optimizer, scheduler and data position) repeats
    the values the first pass logged, which the calibrated ``restore`` criterion checks
    (the step times, a measurement of the machine, are measured again)."""
    c = _curves(seed, acc_shift)
    redo = _curves(seed + 1000, acc_shift)  # the step times the resumed job measures
    order = list(range(STEPS))
    if resume_at is not None:
        order = list(range(45)) + list(range(resume_at, STEPS))
    seen: set[int] = set()
    with refrun.start_run(W, role, hardware="cpu", backend="torch", seed=seed, chips=1,
                          tracking_uri=uri, spool_dir=spool, planned_steps=STEPS,
                          snapshot_environment=False) as run:
        for i in order:
            timing = redo if i in seen else c
            seen.add(i)
            point = {"loss": float(c["loss"][i]),
                     "perf/step_time_s": float(timing["perf/step_time_s"][i])}
            if i % eval_every == eval_every - 1 or i == STEPS - 1:
                point.update({m: float(c[m][i]) for m in c if m.startswith("eval/")})
            run.log_metrics(i, point)
    assert run.run_id is not None
    return run.run_id


@dataclass
class World:
    uri: str
    spool: Path
    tmp: Path
    refs: list[str] = field(default_factory=list)
    cand: dict[str, str] = field(default_factory=dict)
    path: Path = Path()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("evalw")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFRUN_DELIVERY", "thread")  # in-process delivery: a cheap fixture
        w = World(f"sqlite:///{tmp}/mlflow.db", tmp / "spool", tmp)
        w.refs = [_record(w.uri, w.spool, "reference", s) for s in range(5)]
        w.cand = {"seed": _record(w.uri, w.spool, "candidate", 11),
                  "eval_cadence": _record(w.uri, w.spool, "candidate", 12, eval_every=15),
                  "resume": _record(w.uri, w.spool, "candidate", 13, resume_at=30),
                  "worse": _record(w.uri, w.spool, "candidate", 14, acc_shift=0.05)}
    w.path = tmp / "c.toml"
    assert main(["calibrate", "--workload", W, "--tracking-uri", w.uri, "-o",
                 str(w.path)]) == 0
    return w


def _accept(w: World, cand: str, tmp: Path, crit: Path | None = None) -> tuple[int, dict]:
    out = tmp / f"{cand}.json"
    rc = main(["accept", "--criteria", str(crit or w.path), "--reference", *w.refs[:4],
               "--candidate", w.cand[cand], "--tracking-uri", w.uri, "--json", str(out),
               "--no-record"])
    return rc, json.loads(out.read_text(encoding="utf-8"))


def test_calibrate_writes_l3_from_the_final_evaluation(world: World) -> None:
    doc = tomllib.loads(world.path.read_text(encoding="utf-8"))
    by_id = {c["id"]: c for c in doc["criteria"]}
    for m in ("val_loss", "val_accuracy"):
        fin = by_id[f"{m}-final"]
        assert fin["level"] == "L3" and fin["over"] == "last" and fin["band"] == "minmax"
        assert fin["calibration"]["step"] == STEPS - 1  # the last evaluation they share
        eq = by_id[f"{m}-equivalence"]  # groups of 4 support TOST
        assert eq["kind"] == "equivalence" and eq["level"] == "L3" and eq["margin"] > 0
    # By hand: each held-out seed's final accuracy lies within abs_tol of the range of
    # every group of 4 others (here the only group), as a benign candidate's must.
    acc = np.array([_curves(s)["eval/val_accuracy"][-1] for s in range(5)])
    tol = by_id["val_accuracy-final"]["abs_tol"]
    for i in range(5):
        others = np.delete(acc, i)
        assert others.min() - tol <= acc[i] <= others.max() + tol
    text = world.path.read_text(encoding="utf-8")
    assert "val_accuracy-equivalence: a final value shifted by more than" in text
    assert "no convergence (MLPerf steps-to-target) criterion written" in text


@pytest.mark.parametrize("name", ["seed", "eval_cadence", "resume"])
def test_benign_candidates_pass_with_nothing_edited(world: World, tmp_path: Path,
                                                    name: str) -> None:
    rc, a = _accept(world, name, tmp_path)
    bad = [(r["id"], r["reason"]) for r in a["results"]
           if r["outcome"] not in ("pass", "not_applicable")]
    assert (rc, a["verdict"]) == (0, "pass"), bad
    assert a["highest_level"] == "L4"  # L3 passed, so step time was judged
    assert next(r for r in a["results"] if r["id"] == "step-time")["outcome"] == "pass"
    restore = next(r for r in a["results"] if r["kind"] == "restore")
    # the resume is judged (15 replayed steps, bit for bit); the others replay nothing
    assert restore["outcome"] == ("pass" if name == "resume" else "not_applicable")
    if name == "resume":
        assert [(x["step"], x["after_step"], x["replayed"], x["identical"])
                for x in restore["evidence"]["restores"]] == [(30, 44, 15, True)]
    if name == "eval_cadence":  # judged at the last evaluation it shares: the final one
        fin = next(r for r in a["results"] if r["id"] == "val_accuracy-final")
        assert fin["evidence"]["n_steps"] == 1 and fin["evidence"]["steps_inside"] == 1


def test_a_worse_final_evaluation_fails_at_l3(world: World, tmp_path: Path) -> None:
    rc, a = _accept(world, "worse", tmp_path)
    failed = {r["id"] for r in a["results"] if r["outcome"] == "fail"}
    assert rc == 1 and {"val_accuracy-final", "val_accuracy-equivalence"} <= failed


def _power_block(out: str) -> dict[str, str]:
    """The power lines `refrun accept` printed: {criterion id: sentence}."""
    lines = out.splitlines()
    head = [i for i, ln in enumerate(lines) if ln.startswith("power: ")]
    if not head:
        return {}
    block = []
    for ln in lines[head[0] + 1:]:
        if not ln.startswith("  "):
            break
        block.append(ln.strip().split(": ", 1))
    return dict(block)


def test_accept_prints_what_each_passing_criterion_could_not_see(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pass says no criterion saw a difference, not that there was none: `refrun accept`
    prints, for each passing criterion, the smallest difference it detects, from the
    file's `[calibration.power]`, which holds calibrate's sentence for every criterion."""
    doc = tomllib.loads(world.path.read_text(encoding="utf-8"))
    power = doc["calibration"]["power"]
    assert set(power) == {c["id"] for c in doc["criteria"]}
    eq = next(c for c in doc["criteria"] if c["id"] == "val_accuracy-equivalence")
    assert power[eq["id"]].startswith(  # the number is the criterion's own provenance
        f"a final value shifted by more than about {eq['calibration']['detectable_shift']:.3g}")
    capsys.readouterr()
    rc, a = _accept(world, "worse", tmp_path)
    printed = _power_block(capsys.readouterr().out)
    # every passing criterion calibrate wrote (the built-in L0 checks have no power line)
    passed = [r["id"] for r in a["results"] if r["outcome"] == "pass" and r["id"] in power]
    failed = {r["id"] for r in a["results"] if r["outcome"] == "fail"}
    assert rc == 1 and failed and list(printed) == passed  # the failing ones not listed
    assert {cid: power[cid] for cid in passed} == printed
    # A file without power lines (hand-written, or calibrated before them) prints none.
    text = world.path.read_text(encoding="utf-8")
    start = text.index("[calibration.power]")
    bare = tmp_path / "bare.toml"
    bare.write_text(text[:start] + text[text.index("[settings]"):], encoding="utf-8")
    _accept(world, "seed", tmp_path, bare)
    assert _power_block(capsys.readouterr().out) == {}


def test_accept_warns_when_given_another_number_of_references_than_calibrated(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file was calibrated for groups of 4 (5 seeds, each held out against the other
    4); its false-alarm rate and power hold for 4 references, so 5 or 3 get a warning."""
    g = tomllib.loads(world.path.read_text(encoding="utf-8"))["calibration"]["group_size"]
    assert g == 4
    for n in (4, 5, 3):
        capsys.readouterr()
        rc = main(["accept", "--criteria", str(world.path), "--reference", *world.refs[:n],
                   "--candidate", world.cand["seed"], "--tracking-uri", world.uri,
                   "--no-record"])
        warned = [ln for ln in capsys.readouterr().out.splitlines()
                  if ln.startswith(f"WARNING: {n} references given;")]
        assert rc in (0, 1)
        assert warned == ([] if n == g else [
            f"WARNING: {n} references given; {world.path} was calibrated for groups of 4 "
            "(its false-alarm rate and power lines hold for 4: pass 4 of them)"])


def test_goal_is_written_as_a_claim_and_judged(world: World, tmp_path: Path) -> None:
    p = tmp_path / "goal.toml"
    assert main(["calibrate", "--reference", *world.refs, "--tracking-uri", world.uri,
                 "--goal", "eval/val_accuracy>=0.9", "--goal", "eval/val_loss <= 0.2",
                 "-o", str(p)]) == 0
    doc = tomllib.loads(p.read_text(encoding="utf-8"))
    goals = {c["id"]: c for c in doc["criteria"] if c["kind"] == "claim"}
    assert goals["goal-val_accuracy"]["at_least"] == 0.9
    assert goals["goal-val_loss"]["at_most"] == 0.2 and goals["goal-val_loss"]["level"] == "L3"
    # val_loss ends near 0.28 in every seed: the file says the references miss that goal
    assert "5 of 5 reference seeds miss it" in goals["goal-val_loss"]["description"]
    rc, a = _accept(world, "seed", tmp_path, p)
    res = {r["id"]: r for r in a["results"]}
    assert res["goal-val_accuracy"]["outcome"] == "pass"
    assert res["goal-val_loss"]["outcome"] == "fail" and rc == 1


def test_no_l3_is_one_line_exit_2_naming_goal_and_accept_says_why_l4_waits(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.toml"
    base = ["calibrate", "--reference", *world.refs, "--tracking-uri", world.uri]
    assert main([*base, "--metric", "loss", "perf/step_time_s", "-o", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "no L3" in line and "--goal" in line and not out.exists()
    assert main([*base, "--goal", "eval/val_accuracy=0.9"]) == 2
    assert "--goal" in error_line(capsys.readouterr().err)
    assert main([*base, "--goal", "eval/nothing>=1"]) == 2
    assert "eval/nothing" in error_line(capsys.readouterr().err)
    # A file without L3 (hand-written, or edited): accept names the reason L4 waits.
    text = world.path.read_text(encoding="utf-8")
    parts = text.split("[[criteria]]")
    kept = [p for p in parts[1:] if 'level = "L3"' not in p]
    no_l3 = tmp_path / "no-l3.toml"
    no_l3.write_text(parts[0] + "".join("[[criteria]]" + p for p in kept), encoding="utf-8")
    capsys.readouterr()
    rc, a = _accept(world, "seed", tmp_path, no_l3)
    printed = capsys.readouterr().out
    assert rc == 1 and a["verdict"] == "incomplete"
    held = [ln for ln in printed.splitlines() if "L4 held back" in ln]
    assert len(held) == 1 and "no L3" in held[0] and "--goal" in held[0]


def test_a_metric_and_its_eval_namesake_get_distinct_criteria(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A workload logging both ``loss`` (training) and ``eval/loss``: calibrate drops the
    ``eval/`` prefix from readable ids, which once gave two ``loss-envelope`` criteria and a
    file the loader refused ("duplicate id").  Both metrics get their own criteria."""
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    for seed in range(4):
        c = _curves(seed)
        with refrun.start_run("twin", "reference", hardware="cpu", backend="torch", seed=seed,
                              chips=1, tracking_uri=uri, spool_dir=spool,
                              snapshot_environment=False) as run:
            for i in range(STEPS):
                point = {"loss": float(c["loss"][i])}
                if i % 10 == 9:
                    point["eval/loss"] = float(c["eval/val_loss"][i])
                run.log_metrics(i, point)
    out = tmp_path / "twin.toml"
    assert main(["calibrate", "--workload", "twin", "--tracking-uri", uri, "-o", str(out)]) == 0
    crits = tomllib.loads(out.read_text(encoding="utf-8"))["criteria"]
    ids = [c["id"] for c in crits]
    assert len(ids) == len(set(ids)), ids
    by_metric = {(c.get("metric"), c["kind"]) for c in crits}
    assert ("loss", "envelope") in by_metric and ("eval/loss", "envelope") in by_metric
    # No id of an eval/loss criterion reads as one on the training loss, whether or not
    # the training loss has a criterion of that kind (eval-loss-final has no loss-final).
    evals = [c["id"] for c in crits if c.get("metric") == "eval/loss"]
    assert {"eval-loss-envelope", "eval-loss-final"} <= set(evals), evals
    assert all(i.startswith("eval-loss-") for i in evals), evals
    from refrun.acceptance.criteria import load_criteria
    assert {c.id for c in load_criteria(out).criteria} == set(ids)  # the loader takes it


def _quantised_run(uri: str, spool: Path, role: str, seed: int, final_acc: float) -> str:
    """Loss every step; an accuracy over 400 examples (steps of 0.0025) every 10 steps,
    ending at ``final_acc``."""
    c = _curves(seed)
    with refrun.start_run("quant", role, hardware="cpu", backend="torch", seed=seed, chips=1,
                          tracking_uri=uri, spool_dir=spool,
                          snapshot_environment=False) as run:
        for i in range(STEPS):
            point = {"loss": float(c["loss"][i])}
            if i % 10 == 9:
                acc = final_acc if i == STEPS - 1 else c["eval/val_accuracy"][i]
                point["eval/acc"] = round(float(acc) * 400) / 400
            run.log_metrics(i, point)
    assert run.run_id is not None
    return run.run_id


def test_a_quantised_final_evaluation_tolerates_the_next_seed(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Five seeds whose final accuracy lands on two adjacent values (0.9675, 0.97): every
    held-out need is exactly 0, and a tolerance fitted to those needs alone was 0, so a
    benign seed one example lower (0.965) failed `acc-final` (the digits workload's false
    alarms).  The band now holds the seeds' prediction interval (never below the metric's
    resolution), and a real drop still fails."""
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    uri, spool = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "spool"
    finals = [0.9675, 0.97, 0.97, 0.9675, 0.97]
    refs = [_quantised_run(uri, spool, "reference", s, a) for s, a in enumerate(finals)]
    benign = _quantised_run(uri, spool, "candidate", 21, 0.965)
    drop = _quantised_run(uri, spool, "candidate", 22, 0.93)
    out = tmp_path / "q.toml"
    assert main(["calibrate", "--workload", "quant", "--tracking-uri", uri, "-o", str(out)]) == 0
    crit = next(c for c in tomllib.loads(out.read_text(encoding="utf-8"))["criteria"]
                if c["id"] == "acc-final")
    # Independently: the band holds one quantum at least, and the benign value is inside it.
    assert crit["abs_tol"] >= 0.0025 - 1e-12
    assert min(finals) - crit["abs_tol"] <= 0.965
    for cand, want in ((benign, "pass"), (drop, "fail")):
        js = tmp_path / f"{cand}.json"
        main(["accept", "--criteria", str(out), "--reference", *refs[:4], "--candidate", cand,
              "--tracking-uri", uri, "--json", str(js), "--no-record"])
        res = {r["id"]: r for r in json.loads(js.read_text(encoding="utf-8"))["results"]}
        assert res["acc-final"]["outcome"] == want, res["acc-final"]


def _without_date(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith(("date = ", "# Criteria of workload")))


def test_the_same_references_in_any_order_give_the_same_file(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Calibrate derives from the runs it is given, not from the order they are given in.
    Groups of 2 from the 4 others of each held-out seed are 6; with ``--max-groups 3`` a
    sample of them is judged, which was drawn by position in the order given, so the
    same five runs typed in another order got other thresholds.  They are taken in run-id
    order now, so every order writes the same file (and the same runs list)."""
    files = []
    for k, order in enumerate((world.refs, world.refs[::-1], world.refs[2:] + world.refs[:2])):
        out = tmp_path / f"order{k}.toml"
        assert main(["calibrate", "--reference", *order, "--tracking-uri", world.uri,
                     "--group-size", "2", "--max-groups", "3", "-o", str(out)]) == 0
        files.append(_without_date(out.read_text(encoding="utf-8")))
    assert files[0] == files[1] == files[2]
    doc = tomllib.loads(files[0])
    assert doc["calibration"]["runs"] == sorted(world.refs)
    # The check judges the same held-out groups in every order too (a sample of 2 of 6).
    capsys.readouterr()
    checks = []
    for order in (world.refs, world.refs[::-1]):
        rc = main(["calibrate", "--check", str(tmp_path / "order0.toml"), "--reference",
                   *order, "--tracking-uri", world.uri, "--max-groups", "2"])
        checks.append((rc, capsys.readouterr().out))
    assert checks[0] == checks[1]
    assert "10 held-out trials (5 seeds, groups of 2)" in checks[0][1]  # 5 x a sample of 2


def test_eight_seeds_in_groups_of_three_are_judged_in_every_group() -> None:
    """By default every held-out group is judged while there are at most MAX_GROUPS per
    seed: 8 seeds in groups of 3 have C(7, 3) = 35, none left to a sample."""
    from itertools import combinations

    from refrun.acceptance.calibration.derive import CalibrationOptions, groups_for

    n = CalibrationOptions().max_groups
    for held_out in range(8):
        others = [i for i in range(8) if i != held_out]
        assert groups_for(8, held_out, 3, n) == list(combinations(others, 3))
    assert len(groups_for(12, 0, 3, n)) == n  # C(11, 3) = 165: a sample of n


def test_criteria_too_wide_to_see_their_metric_move_are_named(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With 3 reference seeds some thresholds are wider than the metric itself: calibrate
    names each criterion whose detectable shift is at least its metric's own size (the
    larger of how far the seeds' mean moves and its mean magnitude), in one note printed
    and written in the file, and in that criterion's power sentence, which `refrun accept`
    prints beside a pass.  Which ones is computed here from the curves themselves."""
    out = tmp_path / "three.toml"
    capsys.readouterr()
    assert main(["calibrate", "--reference", *world.refs[:3], "--tracking-uri", world.uri,
                 "-o", str(out)]) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("note: ") and "cannot see a difference" in ln]
    doc = tomllib.loads(out.read_text(encoding="utf-8"))
    expected = set()
    for c in doc["criteria"]:
        shift = c.get("calibration", {}).get("detectable_shift")
        if c["kind"] not in ("envelope", "equivalence", "quantile") or shift is None:
            continue
        m = c["metric"]
        steps = np.arange(STEPS) if not m.startswith("eval/") else \
            np.array([i for i in range(STEPS) if i % 10 == 9 or i == STEPS - 1])
        mean = np.mean([_curves(s)[m][steps] for s in range(3)], axis=0)
        size = max(np.ptp(mean), np.mean(np.abs(mean)))
        if shift >= size * (1 + 1e-9):
            expected.add(c["id"])
        elif shift >= size * (1 - 1e-9):
            pytest.skip(f"{c['id']}: shift {shift} at its metric's size {size}: a tie")
    assert expected, "3 seeds of this workload give no criterion this wide: test is vacuous"
    assert len(printed) == 1, printed
    named = {part.split(" (detects")[0] for part in
             printed[0].split("so their pass says little: ")[1].split(". With")[0].split("; ")}
    assert named == expected
    assert f"{len(expected)} criteria cannot see" in printed[0]
    assert "With 3 reference seeds" in printed[0]
    assert "cannot see a difference as large as their metric" in out.read_text(encoding="utf-8")
    # Each one's power sentence says so, which `refrun accept` prints beside a pass.
    power = doc["calibration"]["power"]
    wide = {cid for cid, sentence in power.items() if "; too wide to see " in sentence}
    assert wide == expected
    capsys.readouterr()
    main(["accept", "--criteria", str(out), "--reference", *world.refs[:2], "--candidate",
          world.cand["seed"], "--tracking-uri", world.uri, "--no-record"])
    printed_power = _power_block(capsys.readouterr().out)
    assert printed_power and all(power[cid] == line for cid, line in printed_power.items())
    assert expected & set(printed_power)  # a wide criterion passed: the user is told so
    assert {cid for cid, line in printed_power.items() if "too wide to see" in line} == \
        expected & set(printed_power)


def test_a_metric_s_size_is_its_movement_or_its_magnitude_whichever_is_larger() -> None:
    """The yardstick of the note above: a falling loss is as large as its fall, a metric
    hovering at one level as large as that level."""
    from refrun.acceptance.calibration.derive import _Series, scale_of

    steps = np.arange(50)
    falling = [_Series(steps, 2.3 * np.exp(-steps / 10) + 0.2 + d) for d in (0.0, 0.02)]
    mean = 2.3 * np.exp(-steps / 10) + 0.21
    assert scale_of(falling) == pytest.approx(mean.max() - mean.min())
    level = [_Series(steps, 0.5 + 0.01 * np.sin(steps + d)) for d in (0.0, 1.0)]
    assert scale_of(level) == pytest.approx(0.5, abs=0.01)
    assert scale_of([_Series(np.array([7]), np.array([-0.3]))] * 3) == pytest.approx(0.3)
    # one value per run, logged at each run's own last step
    ends = [_Series(np.array([n]), np.array([v])) for n, v in ((7, -0.3), (9, -0.5))]
    assert scale_of(ends) == pytest.approx(0.4)
