"""``benchmarks/tpu/assess.py --json``: each TPU run's object carries ``l4_goals``, the
result of every L4 goal of the goals file (the ``migration_only`` L4 criteria ``refrun
calibrate --goal`` writes) with its outcome, reason and the evidence that says why, under
refrun.schema's names; no other criterion's result, and every earlier field as it was.
The whole script, on the real TPU record's stores, is docs/tpu.md's business (minutes)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from refrun import schema
from refrun.acceptance import load_criteria
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult

ROOT = Path(__file__).resolve().parents[1]
GOALS = """version = 1
workload = "tpu-json-test"

[prices]
hourly = { tpu = 1.2, cpu = 0.1 }

[[criteria]]
id = "step-time"
level = "L4"
kind = "step_time"
max_ratio = 1.5

[[criteria]]
id = "goal-throughput"
level = "L4"
kind = "throughput"
min_ratio = 1.0
migration_only = true

[[criteria]]
id = "goal-cost"
level = "L4"
kind = "cost"
max_ratio = 1.2
same_work = true
migration_only = true

[[criteria]]
id = "goal-utilization"
level = "L4"
kind = "utilization"
min_pct = 50.0
migration_only = true
"""


@pytest.fixture
def tpu_assess(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """benchmarks/tpu/assess.py as a module; sys.path and the modules it imported by their
    bare names (plan, bench_detection) put back afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("tpu_assess",
                                                  ROOT / "benchmarks" / "tpu" / "assess.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tpu_assess", mod)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    yield mod
    for name in ("plan", "bench_detection"):
        if name not in before:
            sys.modules.pop(name, None)


def test_the_json_carries_each_l4_goals_outcome_reason_and_evidence(
        tpu_assess: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "goals.toml"
    path.write_text(GOALS)
    crit = load_criteria(path)
    contention = {"references_busier": True, "reference_cores": [0.9, 0.6]}
    bound = {"usable": True, "ratio_bound": 1.14, "side": "references"}
    results = [
        CriterionResult("step-time", "L4", "step_time", FAIL, "slower",
                        {"ratio": 2.0, schema.EV_CONTENTION: contention}),
        CriterionResult("goal-throughput", "L4", "throughput", PASS, "ratio 1.954 >= 1",
                        {"ratio": 1.954, "unit": "samples", schema.EV_CONTENTION: contention,
                         schema.EV_CPU_RATE_BOUND: bound}),
        CriterionResult("goal-cost", "L4", "cost", NOT_EVALUABLE, "no price",
                        {"ratio": math.nan, "currency": "USD"}),
        CriterionResult("goal-utilization", "L4", "utilization", FAIL, "mean 3.2% < 50%",
                        {"mean_pct": 3.2}),
    ]
    got = tpu_assess.goal_results(crit, results)
    assert got == [
        {"id": "goal-throughput", "kind": "throughput", "outcome": PASS,
         "reason": "ratio 1.954 >= 1",
         "evidence": {"ratio": 1.954, schema.EV_CONTENTION: contention,
                      schema.EV_CPU_RATE_BOUND: bound}},
        # a non-finite figure is written as null (strict JSON)
        {"id": "goal-cost", "kind": "cost", "outcome": NOT_EVALUABLE, "reason": "no price",
         "evidence": {"ratio": None, schema.EV_CONTENTION: None}},
        {"id": "goal-utilization", "kind": "utilization", "outcome": FAIL,
         "reason": "mean 3.2% < 50%",
         "evidence": {"ratio": None, schema.EV_CONTENTION: None}}]

    # the run's object: every earlier field, and l4_goals
    det, plan = tpu_assess.det, tpu_assess.plan
    v = next(x for x in plan.plan("digits") if x.kind == "benign")
    out = det.Outcome(v.base, "pass", "L4")
    goals = det.Outcome(v.base, "fail", "L3", [("goal-utilization", "mean 3.2% < 50%", ())])
    row = tpu_assess.Row(v, "r1", out, (), {"busy_pct": "3.2"}, l4={"throughput": "1.95x"},
                         goals=goals, l4_goals=got)
    obj = json.loads(json.dumps(tpu_assess.as_json(row), allow_nan=False))
    assert list(obj) == ["variant", "workload", "precision", "kind", "run_id", "verdict",
                         "as_intended", "failing", "intent", "chip", "l4", "with_goals",
                         "error", "l4_goals"]
    assert obj["with_goals"] == ["fail", [["goal-utilization", "mean 3.2% < 50%"]]]
    assert [(g["id"], g["outcome"]) for g in obj["l4_goals"]] == \
        [("goal-throughput", PASS), ("goal-cost", NOT_EVALUABLE), ("goal-utilization", FAIL)]
    assert obj["l4_goals"][0]["evidence"][schema.EV_CPU_RATE_BOUND]["ratio_bound"] == 1.14

