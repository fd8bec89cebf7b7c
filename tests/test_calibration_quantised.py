"""`refrun calibrate` on a quantised evaluation metric whose seeds tie at some evaluations.

An accuracy over a small evaluation set moves in steps of 1/n; reference seeds that all
score the same at one evaluation have a std of 0 there, so a held-out seed one example
away needs an infinite k.  Calibrate used to drop the metric's whole envelope for that ("a
held-out seed differs from a zero-spread group"), even where the fraction rule would have
tolerated those steps (a spot check on a Hugging Face workload: two seeds at exactly 0.932
at several evaluations left `eval/accuracy` without a per-step criterion).  It now writes
``abs_tol``: the largest distance of a held-out seed from a group that agreed exactly, at
least one quantum, and ``k`` from needs computed as the check applies both
(``|x - mean| <= k std + abs_tol``).  Expected numbers are recomputed here with numpy."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file
from refrun.acceptance.criteria import load_criteria
from tests.acceptance_helpers import STEPS, N, eval_steps, record

QUANTUM = 1 / 50  # an accuracy over 50 examples
NREF = 3  # seeds, so groups of 2 (the spot check had 3 after an outlier was left out)
EVALS = eval_steps()  # every 10 steps: 9, 19, ..., 99


def _metrics(seed: int, acc_shift: float = 0.0) -> dict[str, np.ndarray]:
    """A seed's loss (continuous) and accuracy over 50 examples, which saturates at 1.0,
    so the seeds tie there."""
    rng = np.random.default_rng(seed)
    tau = 25.0 * (1 + 0.05 * rng.normal())
    loss = 2.3 * np.exp(-STEPS / tau) + 0.2 + rng.normal(0, 0.02, N)
    acc = 1.03 - 0.9 * np.exp(-STEPS / tau) + rng.normal(0, 0.015, N) + acc_shift
    acc = np.round(np.clip(acc, 0.0, 1.0) / QUANTUM) * QUANTUM
    return {"loss": loss, "eval/val_accuracy": acc}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("quantised")
    uri, spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    refs = [record(uri, spool, "reference", _metrics(s), seed=s) for s in range(NREF)]
    cands = {"fresh": record(uri, spool, "candidate", _metrics(31), seed=31),
             "worse": record(uri, spool, "candidate", _metrics(32, acc_shift=-0.1), seed=32)}
    path = tmp / "c.toml"
    write_file(calibrate_ids([r.run_id for r in refs], uri, CalibrationOptions()), str(path))
    return {"uri": uri, "refs": refs, "cands": cands, "path": path}


def _acc(logged) -> np.ndarray:
    return logged.metrics["eval/val_accuracy"][EVALS]


def test_the_seeds_tie_where_a_held_out_seed_differs(world: dict) -> None:
    """The precondition, by hand: a held-out seed differs from its agreeing group at more
    than 10 % of the evaluations, so without abs_tol its need is infinite."""
    acc = np.vstack([_acc(r) for r in world["refs"]])
    worst = max(sum(np.ptp(np.delete(acc, i, 0)[:, t]) == 0
                    and acc[i, t] != np.delete(acc, i, 0)[0, t] for t in range(len(EVALS)))
                for i in range(NREF))
    assert worst > 0.1 * len(EVALS), worst


def test_calibrate_writes_the_envelope_with_the_agreeing_groups_gap(world: dict) -> None:
    doc = tomllib.loads(world["path"].read_text(encoding="utf-8"))
    env = next(c for c in doc["criteria"] if c["id"] == "val_accuracy-envelope")
    assert env["band"] == "std"
    # abs_tol: the largest |held-out - group mean| where the group had std 0, and at
    # least one quantum (each seed against the others: the only group of NREF - 1).
    acc = np.vstack([_acc(r) for r in world["refs"]])
    gaps = [abs(acc[i, t] - np.delete(acc, i, 0)[:, t].mean())
            for i in range(NREF) for t in range(len(EVALS))
            if np.ptp(np.delete(acc, i, 0)[:, t]) == 0]
    assert env["abs_tol"] == pytest.approx(max(max(gaps), QUANTUM), rel=1e-3)
    # k is at least every held-out seed's need, computed as the check applies abs_tol:
    # the 90 % quantile over the evaluations of max(|x - mean| - abs_tol, 0) / std.
    for i in range(NREF):
        grp = np.delete(acc, i, 0)
        mean, std = grp.mean(0), grp.std(0, ddof=1)
        dev = np.maximum(np.abs(acc[i] - mean) - env["abs_tol"], 0.0)
        z = np.where(std > 0, dev / np.where(std > 0, std, 1.0), np.where(dev > 0, np.inf, 0))
        need = np.sort(z)[int(np.ceil(0.9 * len(z))) - 1]
        assert np.isfinite(need) and need <= env["k"] + 1e-9
    power = doc["calibration"]["power"]["val_accuracy-envelope"]
    assert f"plus {env['abs_tol']:.3g}" in power


@pytest.mark.parametrize(("name", "outcome"), [("fresh", "pass"), ("worse", "fail")])
def test_the_envelope_judges_candidates(world: dict, name: str, outcome: str) -> None:
    crit = load_criteria(world["path"])
    refs = [r.run_id for r in world["refs"][:NREF - 1]]
    a, _ = assess_ids(crit, refs, world["cands"][name].run_id, world["uri"])
    assert a.result("val_accuracy-envelope").outcome == outcome, \
        a.result("val_accuracy-envelope").reason


def test_every_reference_held_out_passes_its_own_envelope(world: dict) -> None:
    """The file's thresholds accept each reference seed against the others (what
    calibrate measured), ties included."""
    crit = load_criteria(world["path"])
    ids = [r.run_id for r in world["refs"]]
    for held in ids:
        others = [r for r in ids if r != held]
        a, _ = assess_ids(crit, others, held, world["uri"])
        r = a.result("val_accuracy-envelope")
        assert r.outcome == "pass", (held, r.reason)
