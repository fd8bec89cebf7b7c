"""A learning rate scaled with the global batch by a known rule (linear for SGD, square
root for Adam) is judged divided by its factor, and the assessment says so; any other
factor, or the same factor without a batch change, is judged as logged (issue 52)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from acceptance_helpers import write_criteria
from conftest import Store

from refrun import schema
from refrun.acceptance.batch_scaling import divided, scaled_learning_rate
from refrun.cli import main
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    write_complete_run,
)

# An envelope on the learning rate as calibrate writes one for a constant rate (the
# references' own spread: none), and the loss by data seen.
CRITERIA = """
workload = "scaled-lr"

[[criteria]]
id = "opt-lr-close"
level = "L2"
kind = "closeness"
metric = "opt/lr"
abs_tol = 1e-7
rel_tol = 0.0

[[criteria]]
id = "loss-close"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.001
rel_tol = 0.0
"""


def record(store: Store, role: str, batch: int, steps: int, lr: float) -> str:
    samples = (np.arange(steps) + 1) * batch
    loss = 2.0 * np.exp(-samples / 400.0) + 0.1  # the same curve by data seen
    tags = identity_tags("scaled-lr", role, hardware="cpu", backend="torch")
    tags.update({schema.TAG_GLOBAL_BATCH: str(batch), schema.TAG_PLANNED_STEPS: str(steps)})
    steps_ = np.concatenate([np.arange(steps), np.arange(steps)])
    table = curves_table(["loss"] * steps + [schema.M_LR] * steps, steps_,
                         np.concatenate([loss, np.full(steps, np.float32(lr))]), now_ms())
    return write_complete_run(CompleteRun(experiment="scaled-lr", tags=tags, table=table,
                                          run_name=f"{role}-b{batch}-lr{lr:.4g}"),
                              store.tracking_uri)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    tmp = tmp_path_factory.mktemp("scaled-lr")
    return Store(tmp, f"sqlite:///{tmp}/mlflow.db", tmp / "spool")


@pytest.fixture(scope="module")
def reference(store: Store) -> str:
    return record(store, "reference", 32, 40, 0.1)


@pytest.mark.parametrize(("batch", "lr", "verdict", "rule"), [
    (64, 0.2, "pass", "linear"),                     # SGD's rule
    (64, 0.1 * math.sqrt(2.0), "pass", "square root"),  # Adam's rule
    (64, 0.15, "fail", None),                        # another factor: judged as logged
    (32, 0.2, "fail", None),                         # no batch change: judged as logged
])
def test_a_batch_scaled_learning_rate_is_judged_by_its_rule(
        store, reference, tmp_path: Path, batch: int, lr: float, verdict: str,
        rule: str | None) -> None:
    cand = record(store, "candidate", batch, 40 * 32 // batch, lr)
    crit = write_criteria(tmp_path, CRITERIA)
    out = tmp_path / "a.json"
    code = main(["accept", "--criteria", str(crit), "--reference", reference, "--candidate",
                 cand, "--tracking-uri", store.tracking_uri, "--axis", "samples",
                 "--no-record", "--json", str(out)])
    data = json.loads(out.read_text())
    assert (code, data["verdict"]) == ((0, "pass") if verdict == "pass" else (1, "fail"))
    said = [w for w in data["warnings"] if "scaling rule" in w]
    lr_row = next(r for r in data["results"] if r["id"] == "opt-lr-close")
    if rule is None:
        assert said == [] and lr_row["outcome"] == "fail"
    else:
        factor = lr / 0.1
        assert said == [f"the candidate's learning rate is {factor:.6g}x the references' "
                        f"with 2x their global batch ({schema.TAG_GLOBAL_BATCH}): the {rule} "
                        f"scaling rule ({'Goyal' if rule == 'linear' else 'Malladi'} et al. "
                        f"{2017 if rule == 'linear' else 2022}); opt/lr is judged divided by "
                        f"{factor:.6g}"]
        assert lr_row["outcome"] == "pass"


def test_the_rule_is_recognised_only_on_agreeing_references() -> None:
    # float32 learning rates: 0.2 and 0.1 rounded differently still match (1e-6)
    f32 = float(np.float32(0.1))
    assert scaled_learning_rate(64, [32, 32], float(np.float32(0.2)), [f32, f32]).rule \
        == "linear"
    assert scaled_learning_rate(128, [32], 0.2, [0.1]).rule == "square root"  # sqrt(4)
    assert scaled_learning_rate(16, [32], 0.05, [0.1]).factor == 0.5  # half the batch
    assert scaled_learning_rate(64, [32, 48], 0.2, [0.1, 0.1]) is None  # two batches
    assert scaled_learning_rate(64, [32, 32], 0.2, [0.1, 0.12]) is None  # two peaks
    assert scaled_learning_rate(64, [32], 0.2, [None]) is None  # no learning rate
    assert scaled_learning_rate(None, [32], 0.2, [0.1]) is None  # batch not tagged
    assert scaled_learning_rate(64, [32], 0.2 * (1 + 1e-4), [0.1]) is None


def test_divided_touches_only_learning_rates() -> None:
    t = curves_table(["loss", schema.M_LR, f"{schema.M_LR}/pg1", "opt/lr_like"], [0] * 4,
                     [1.0, 0.2, 0.4, 3.0], 0)
    got = divided(t, 2.0)
    assert got["value"].tolist() == [1.0, 0.1, 0.2, 3.0]
    assert t["value"].tolist() == [1.0, 0.2, 0.4, 3.0]  # a copy
    assert isinstance(got["metric"].dtype, pd.CategoricalDtype)
