"""Same-seed paired comparison of an evaluation metric, on a tiny real torch model (CPU).

A port whose *evaluation* alone differs from its seed's trains exactly as that seed did, so
no training-loss criterion can see it, and when its effect on the evaluation metric is
inside the seeds' spread no seed band can either.  Here: 5 reference seeds of a 16-64-4
tanh MLP (200 SGD steps, validation loss every 20 steps), a known-good rerun of seed 0
with its input features permuted (the same sums in another order, in training and in
evaluation), a benign port of seed 4 (first layer accumulated in float64), and a port of
seed 2 that trains in float32 like its seed but evaluates with bfloat16 matmuls.
`refrun calibrate` writes a ``paired`` criterion on ``eval/val_loss`` beside the loss's;
it alone rejects the bfloat16 evaluation.  Expected numbers are recomputed with numpy from
the logged values, independently of refrun.acceptance.paired."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import refrun
from refrun import schema
from refrun.acceptance.criteria import load_criteria
from refrun.acceptance.paired import STRUCTURAL_MAX_RATIO
from refrun.pairing import pair_tags
from tests.conftest import migrated_sqlite
from tests.test_acceptance_paired import (
    EVAL_X,
    EVAL_Y,
    STEPS,
    assess_run,
    make_world,
    mlp,
)
from tests.test_acceptance_paired import World as PairedWorld

EVERY = 20
EVAL_STEPS = np.arange(EVERY - 1, STEPS, EVERY)  # 19, 39, ..., 199


def train(seed: int, mode: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """(per-step training losses, validation losses at EVAL_STEPS) of
    :func:`tests.test_acceptance_paired.mlp` (seed).  ``mode``: ``fp32`` the
    reference, ``perm`` input features permuted everywhere, ``f64`` first layer accumulated
    in float64 everywhere, ``eval-bf16`` the reference's training with every evaluation
    matmul in bfloat16."""
    m = mlp(seed)
    w1, b1, w2, b2, opt, xs, ys, perm = m.w1, m.b1, m.w2, m.b2, m.opt, m.xs, m.ys, m.perm

    def forward(x: torch.Tensor, evaluating: bool) -> torch.Tensor:
        if mode == "perm":
            h = x[:, perm] @ w1[:, perm].T + b1
        elif mode == "f64":
            h = (x.double() @ w1.double().T).float() + b1
        elif mode == "eval-bf16" and evaluating:
            h = (x.bfloat16() @ w1.bfloat16().T).float() + b1
        else:
            h = x @ w1.T + b1
        if mode == "eval-bf16" and evaluating:
            return (torch.tanh(h).bfloat16() @ w2.bfloat16().T).float() + b2
        return torch.tanh(h) @ w2.T + b2

    losses, evals = np.empty(STEPS), []
    for s in range(STEPS):
        loss = torch.nn.functional.cross_entropy(forward(xs[s], False), ys[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[s] = loss.item()
        if s in EVAL_STEPS:
            with torch.no_grad():
                evals.append(torch.nn.functional.cross_entropy(forward(EVAL_X, True),
                                                               EVAL_Y).item())
    return losses, np.array(evals)


@dataclass
class World(PairedWorld):
    """The paired test's store, with each run's (training losses, evaluations)."""

    curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def _record(w: World, name: str, role: str, seed: int, curves: tuple[np.ndarray, np.ndarray],
            tags: dict[str, str] | None = None, eval_every: int = 1,
            shift: tuple[int, int] = (0, 0)) -> str:
    """Record ``curves``; ``eval_every`` k logs every k-th evaluation only (another
    evaluation cadence); ``shift`` (loss, evaluation) adds a constant to the step numbers
    (another way of numbering the same steps)."""
    losses, evals = curves
    with refrun.start_run("paired-eval-mlp", role, backend="torch", hardware="cpu",
                          seed=seed, planned_steps=STEPS, tracking_uri=w.uri,
                          spool_dir=w.tmp / "spool", tags=tags or {},
                          snapshot_environment=False, delivery="thread") as run:
        for s, v in enumerate(losses):
            run.log(s + shift[0], loss=float(v))
        for s, v in list(zip(EVAL_STEPS, evals, strict=True))[eval_every - 1::eval_every]:
            run.log_eval(int(s) + shift[1], val_loss=float(v))
    assert run.run_id is not None
    w.curves[name] = curves
    return run.run_id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("paired-eval")

    def extra(w: World) -> None:
        w.runs["eval_bf16"] = _record(w, "eval_bf16", "candidate", 2, train(2, "eval-bf16"),
                                      pair_tags(2))
        w.runs["benign_cadence"] = _record(w, "benign_cadence", "candidate", 4,
                                           w.curves["benign"], pair_tags(4), eval_every=2)
        # The benign port's values, numbered by steps completed (1, 2, ...) instead of the
        # index of the step just ended: evaluations only, then every step.
        for name, shift in (("eval_counted", (0, 1)), ("all_counted", (1, 1))):
            w.runs[name] = _record(w, name, "candidate", 4, w.curves["benign"],
                                   pair_tags(4), shift=shift)
        # Known-good evidence numbered that way measures steps of training, not rounding.
        w.runs["known_good_counted"] = _record(
            w, "known_good_counted", "candidate", 1, train(1, "perm"),
            pair_tags(1, known_good="input features permuted, steps numbered from 1"),
            shift=(1, 1))

    return make_world(World(uri=migrated_sqlite(tmp / "mlflow.db", tmp_path_factory),
                            tmp=tmp), _record, train, extra)



def _eval_div(w: World, a: str, b: str) -> np.ndarray:
    """Running max of |a - b| over the evaluations (numpy, independent of refrun)."""
    return np.maximum.accumulate(np.abs(w.curves[a][1] - w.curves[b][1]))


def test_calibrate_writes_a_paired_criterion_for_the_evaluation_metric(world: World) -> None:
    doc = tomllib.loads(world.path.read_text())
    paired = {c["metric"]: c for c in doc["criteria"] if c["kind"] == "paired"}
    assert set(paired) == {"loss", "eval/val_loss"}
    p = paired["eval/val_loss"]
    assert p["id"] == "val_loss-paired" and p["level"] == "L1"
    assert p["max_ratio"] == pytest.approx(STRUCTURAL_MAX_RATIO, rel=1e-5)
    # Its band is the known-good rerun's own divergence on the evaluations (knots at
    # evaluation steps, 4 significant digits), not the training loss's.
    e = _eval_div(world, "known_good", "seed0")
    expect = np.maximum(e, e[e > 0].min())
    idx = np.searchsorted(EVAL_STEPS, p["band_steps"])
    assert np.all(EVAL_STEPS[idx] == p["band_steps"])
    np.testing.assert_allclose(p["band_values"], expect[idx], rtol=1e-3)
    assert p["band_values"] != paired["loss"]["band_values"][:len(p["band_values"])]


def test_only_the_evaluation_pair_sees_a_port_that_evaluates_in_bfloat16(
        world: World) -> None:
    a, _ = assess_run(world, "eval_bf16")
    # It trains exactly as its seed: the loss pair has not diverged at all ...
    np.testing.assert_array_equal(world.curves["eval_bf16"][0], world.curves["seed2"][0])
    assert a.result("loss-paired").outcome == "pass"
    # ... and every seed band accepts its evaluations (the effect is inside the spread).
    bands = [r for r in a.results if r.kind in ("envelope", "closeness", "equivalence")]
    assert {r.metric for r in bands} >= {"loss", "eval/val_loss"}
    assert all(r.outcome == "pass" for r in bands), \
        [(r.id, r.reason) for r in bands if r.outcome != "pass"]
    # The evaluation pair rejects it where numpy says it first leaves the band.
    p = a.result("val_loss-paired")
    assert p.outcome == "fail" and a.verdict == "fail"
    assert p.evidence["pair_run"] == world.refs[2]
    crit = load_criteria(world.path).criterion(p.id)
    div = _eval_div(world, "eval_bf16", "seed2")
    band = np.array(crit.band_values)[np.searchsorted(crit.band_steps, EVAL_STEPS,
                                                      side="right") - 1] * crit.max_ratio
    first = int(EVAL_STEPS[np.argmax(div > band)])
    assert np.any(div > band)
    assert p.evidence[schema.EV_FIRST_DIVERGENCE_STEP] == first
    assert f"first diverges at step {first}" in p.reason


def test_the_benign_port_passes_both_pairs(world: World) -> None:
    a, _ = assess_run(world, "benign")
    for cid in ("loss-paired", "val_loss-paired"):
        r = a.result(cid)
        assert r.outcome == "pass", (cid, r.reason)
        assert r.evidence["pair_run"] == world.refs[4]
    assert a.result("val_loss-paired").evidence["divergence_at_last"] == pytest.approx(
        _eval_div(world, "benign", "seed4")[-1])
    assert a.verdict == "pass", a.table()


def test_a_port_evaluating_half_as_often_is_judged_at_the_shared_steps(world: World) -> None:
    """Another evaluation cadence (every 40 steps against 20): the evaluation pair compares
    the steps both evaluated, and the benign port still passes."""
    a, _ = assess_run(world, "benign_cadence")
    p = a.result("val_loss-paired")
    assert p.outcome == "pass", p.reason
    shared = EVAL_STEPS[1::2]
    assert p.evidence["steps_compared"] == len(shared)
    full = np.abs(world.curves["benign"][1] - world.curves["seed4"][1])
    assert p.evidence["divergence_at_last"] == pytest.approx(full[1::2].max())
    assert a.verdict == "pass", a.table()


def test_runs_numbering_the_same_steps_differently_are_never_paired(world: World) -> None:
    """The benign port's own values, logged at step numbers one higher (steps completed
    against the reference's index of the step just ended).  Compared at equal step numbers
    a pair would measure one step of training: the loss pair failed such a port at its
    first step before ``step_shift``.  Now each pair is not evaluable and says why (the
    verdict is incomplete, never a pass or a fail), and known-good evidence numbered so is
    left out of calibration."""
    for name, shifted in (("eval_counted", {"val_loss-paired"}),
                          ("all_counted", {"loss-paired", "val_loss-paired"})):
        a, _ = assess_run(world, name)
        for cid in ("loss-paired", "val_loss-paired"):
            r = a.result(cid)
            if cid in shifted:
                assert r.outcome == "not_evaluable", (name, cid, r.reason)
                assert "shifted by +1" in r.reason and "number steps differently" in r.reason
            else:
                assert r.outcome == "pass", (name, cid, r.reason)
        assert a.verdict == "incomplete", a.table()
        # The seed bands on the loss still judge it (one step's shift is inside them).
        assert a.result("loss-envelope").outcome == "pass"
    # The envelope on the evaluations has no common step and names the shift.
    a, _ = assess_run(world, "eval_counted")
    r = a.result("val_loss-envelope")
    assert r.outcome == "not_evaluable" and "shifted by +1 (20..200 against 19..199" in r.reason
    # Calibration left the shifted known-good run out, with the reason, and its band is the
    # unshifted known-good pair's alone (test_calibrate_writes_a_paired_criterion...).
    text = world.path.read_text()
    assert f"{world.runs['known_good_counted']}: 'loss' of run" in text
    assert "shifted by +1 (1..200 against 0..199, 200 each)" in text
