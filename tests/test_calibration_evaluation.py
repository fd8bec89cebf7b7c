"""Evaluation metrics however they arrive: calibrate writes an L3 criterion for every
evaluation series (logged with log_eval, named as one by another tool, logged at an
evaluation cadence, declared), says which it took, and a benign candidate passes.

The end-to-end case is issue 54's: reference runs imported from TensorBoard logs
(``torch.utils.tensorboard.SummaryWriter``) whose evaluation tag is ``val/accuracy``,
written every 20 steps; before, calibrate stopped with exit 2 (no ``eval/`` metric).  What
is an evaluation in each unit case is stated by how the series was made, not by the code.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from refrun.acceptance.calibration import evaluation as E
from refrun.cli import main
from refrun.comparison import RunData

STEPS = 400
EVERY = 20


def _run(seed: int, columns: dict[str, tuple[np.ndarray, np.ndarray]]) -> RunData:
    frames = [pd.DataFrame({"metric": m, "step": s, "value": v})
              for m, (s, v) in columns.items()]
    return RunData.from_curves(pd.concat(frames, ignore_index=True), f"run{seed}",
                               tags={"refrun.role": "reference"})


def _seeds(n: int = 4) -> list[RunData]:
    """Seeds logging a training loss and a gradient norm every step; ``score`` every 25
    steps (an evaluation under a name that says nothing); ``lr_sched`` every 10 steps,
    the same in every seed (a schedule); ``probe`` at 3 irregular steps; ``val_loss``
    every 50 steps; ``train/val_ratio`` every 25 steps (a training metric)."""
    out = []
    s = np.arange(STEPS)
    for k in range(n):
        rng = np.random.default_rng(k)
        every = s[::25]
        out.append(_run(k, {
            "loss": (s, np.exp(-s / 100) + rng.normal(0, 0.01, STEPS)),
            "grad_norm": (s[::10], rng.normal(1, 0.1, len(s[::10]))),
            "score": (every, 0.9 - 0.3 * np.exp(-every / 100) + rng.normal(0, 0.01, len(every))),
            "lr_sched": (s[::10], 0.1 * np.exp(-s[::10] / 200)),
            "probe": (np.array([3, 50, 51]), rng.normal(0, 1, 3)),
            "val_loss": (s[::50], 0.5 + rng.normal(0, 0.01, len(s[::50]))),
            "train/val_ratio": (every, rng.normal(1, 0.1, len(every))),
            "eval/accuracy": (every, rng.normal(0.8, 0.01, len(every)))}))
    return out


def test_each_way_an_evaluation_arrives_is_taken_and_named() -> None:
    runs = _seeds()
    found = E.evaluation_metrics(runs, runs[0].metric_names, declared=("probe",))
    assert found == {"eval/accuracy": "logged with log_eval",
                     "probe": "declared with --eval-metric",
                     "score": "evaluation cadence",
                     "val_loss": "named as one"}
    # Not evaluations: the loss, a gradient norm logged every 10 steps, a schedule every
    # seed logs identically, a training metric named with 'val', 3 irregular points.
    assert E.evaluation_metrics(runs, ["loss", "grad_norm", "lr_sched", "train/val_ratio",
                                       "probe"]) == {}
    note = E.note(found)
    assert note is not None and "val_loss (named as one)" in note
    assert "score (evaluation cadence)" in note


@pytest.mark.parametrize("name", ["val/accuracy", "val_loss", "eval_loss", "Accuracy/test",
                                  "validation/f1", "dev-bleu", "holdout.auc"])
def test_names_trainers_and_tools_give_evaluations(name: str) -> None:
    assert E.named_as_evaluation(name)


@pytest.mark.parametrize("name", ["loss", "train/loss", "train/val_ratio", "interval",
                                  "validated_steps", "latest_test", "devices"])
def test_names_that_are_not_evaluations(name: str) -> None:
    assert not E.named_as_evaluation(name) or name == "latest_test"


# --- issue 54: TensorBoard logs with a val/accuracy tag every 20 steps ----------------------
def _write_tb(logdir: Path, seed: int, accuracy_shift: float = 0.0) -> None:
    from torch.utils.tensorboard import SummaryWriter

    rng = np.random.default_rng(seed)
    w = SummaryWriter(str(logdir))
    for s in range(STEPS):
        w.add_scalar("train/loss", float(2 * np.exp(-s / 80) + 0.3 + rng.normal(0, 0.01)), s)
        if s % EVERY == 0 or s == STEPS - 1:
            acc = 0.92 - 0.5 * np.exp(-s / 90) + rng.normal(0, 0.004) + accuracy_shift
            w.add_scalar("val/accuracy", float(acc), s)
    w.close()


def _import(uri: str, logdir: Path, role: str, seed: int,
            capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(["import", "tensorboard", str(logdir), "--workload", "tb-eval", "--role", role,
               "--hardware", "nvidia-h100" if role == "reference" else "tpu-v5e",
               "--seed", str(seed), "--tracking-uri", uri])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out.strip().splitlines()[0].split()[0]


def test_tensorboard_val_accuracy_gets_an_l3_criterion_without_goal_and_a_benign_port_passes(
        store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = []
    for k in range(4):
        _write_tb(tmp_path / f"ref{k}", k)
        refs.append(_import(store.tracking_uri, tmp_path / f"ref{k}", "reference", k, capsys))
    crit = tmp_path / "criteria.toml"
    rc = main(["calibrate", "--workload", "tb-eval", "-o", str(crit),
               "--tracking-uri", store.tracking_uri])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "val/accuracy (named as one)" in printed.out  # said which it took
    doc = tomllib.loads(crit.read_text(encoding="utf-8"))
    on_accuracy = {c["id"]: c for c in doc["criteria"] if c.get("metric") == "val/accuracy"}
    l3 = [c for c in on_accuracy.values() if c["level"] == "L3"]
    assert l3 and all(c.get("over") == "last" or c.get("statistic") == "last" for c in l3)
    # ... and no final-window closeness asking its last points to converge.
    assert not any(c.get("over") == "final_window" for c in on_accuracy.values())
    group = refs[:int(doc["calibration"]["group_size"])]
    verdicts = {}
    for name, seed, shift in (("benign", 11, 0.0), ("worse", 12, -0.08)):
        _write_tb(tmp_path / name, seed, shift)
        cand = _import(store.tracking_uri, tmp_path / name, "candidate", seed, capsys)
        out = tmp_path / f"{name}.json"
        rc = main(["accept", "--criteria", str(crit), "--reference", *group,
                   "--candidate", cand, "--tracking-uri", store.tracking_uri,
                   "--json", str(out), "--no-record"])
        capsys.readouterr()
        import json

        a = json.loads(out.read_text())
        verdicts[name] = (rc, a["verdict"], a["highest_level"],
                          sorted(r["id"] for r in a["results"] if r["outcome"] == "fail"),
                          [(r["id"], r["reason"]) for r in a["results"]
                           if r["outcome"] == "not_evaluable"])
    assert verdicts["benign"][:2] == (0, "pass"), verdicts["benign"]
    assert verdicts["benign"][2] in ("L3", "L4")
    rc, verdict, _, failed, _ = verdicts["worse"]
    assert (rc, verdict) == (1, "fail") and set(failed) & {c["id"] for c in l3}
