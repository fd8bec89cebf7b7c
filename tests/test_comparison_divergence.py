"""First divergence (issue 15.5): per metric, across metrics, per parameter."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from refrun.comparison import CompareOptions, RunData, compare
from refrun.comparison.divergence import (
    divergence_summary,
    effective_sustain,
    first_divergence,
    reference_band,
)


def test_band_formula_by_hand() -> None:
    ref = np.array([[1.0, 2.0], [3.0, 2.0]])
    lo, hi = reference_band(ref, rtol=0.1, atol=0.5)
    # point 0: mean 2 -> tol 0.1*2+0.5 = 0.7; min 1, max 3 -> [0.3, 3.7]
    # point 1: mean 2 -> tol 0.7; min = max = 2 -> [1.3, 2.7]
    assert lo.tolist() == pytest.approx([0.3, 1.3]) and hi.tolist() == pytest.approx([3.7, 2.7])


def test_transient_excursion_is_not_a_divergence_sustained_one_is() -> None:
    steps = np.arange(100)
    ref = np.ones((1, 100))
    cand = np.ones(100)
    cand[10:13] = 2.0  # out for 3 points, then back: transient
    cand[40:] = 1.5  # out from step 40 to the end
    d = first_divergence("loss", steps, ref, cand, rtol=0.02, sustain=5)
    assert d.first_outside_step == 10 and d.first_step == 40
    assert d.outside_points == 3 + 60 and d.direction == "above"
    assert d.band_at_first == pytest.approx((0.98, 1.02))
    same = first_divergence("loss", steps, ref, np.ones(100) * 1.01, rtol=0.02)
    assert same.first_step is None and same.first_outside_step is None


def test_few_points_and_a_tail_that_never_comes_back() -> None:
    assert effective_sustain(100, 5) == 5 and effective_sustain(8, 5) == 1
    steps = np.arange(0, 1000, 10)
    cand = np.zeros(100)
    cand[-2:] = -1.0  # the last two points: out until the end
    d = first_divergence("acc", steps, np.zeros((1, 100)), cand, atol=0.1)
    assert d.first_step == 980 and d.direction == "below"


def curves(values: dict[str, np.ndarray]) -> pd.DataFrame:
    return pd.concat([pd.DataFrame({"metric": k, "step": np.arange(len(v)), "value": v})
                      for k, v in values.items()], ignore_index=True)


def test_comparison_json_names_the_first_metric_and_parameter() -> None:
    """A gradient blocked on one parameter from step 30: its gradient norm departs first,
    the loss follows at step 50, the other parameter never departs."""
    n = 100
    base = {"loss": np.linspace(2, 1, n), "grad_norm/fc1.weight": np.full(n, 0.5),
            "grad_norm/fc2.weight": np.full(n, 0.3), "eval/acc": np.linspace(0.1, 0.9, n)}
    refs = [RunData.from_curves(curves({k: v * (1 + 0.001 * s) for k, v in base.items()}),
                                run_id=f"r{s}") for s in range(3)]
    cand_vals = dict(base)
    cand_vals["grad_norm/fc2.weight"] = np.where(np.arange(n) >= 30, 0.0, 0.3)
    cand_vals["loss"] = np.where(np.arange(n) >= 50, base["loss"] * 1.2, base["loss"])
    cand = RunData.from_curves(curves(cand_vals), run_id="c")
    cmp = compare(refs, cand, progress=False)
    doc = json.loads(json.dumps(cmp.to_dict()))
    div = doc["divergence"]
    assert div["first_metric"] == "grad_norm/fc2.weight" and div["first_step"] == 30
    assert div["first_parameter"] == "fc2.weight" and div["first_parameter_step"] == 30
    assert [o["metric"] for o in div["order"]] == ["grad_norm/fc2.weight", "loss"]
    assert div["never_departed"] == ["eval/acc", "grad_norm/fc1.weight"]
    assert doc["metrics"]["loss"]["first_divergence"]["first_step"] == 50
    assert doc["metrics"]["loss"]["first_divergence"]["direction"] == "above"
    assert doc["metrics"]["eval/acc"]["first_divergence"]["first_step"] is None
    assert cmp.summary().set_index("metric").loc["loss", "first_divergence"] == 50


def test_divergence_summary_ties_and_empty() -> None:
    steps = np.arange(10)
    a = first_divergence("a", steps, np.zeros((1, 10)), np.r_[np.zeros(3), np.ones(7)])
    b = first_divergence("b", steps, np.zeros((1, 10)), np.r_[np.zeros(3), np.ones(7)])
    s = divergence_summary([b, a])
    assert s.first_metrics == ["a", "b"] and s.first_step == 3 and s.first_parameter is None
    assert divergence_summary([]).first_metric is None
    with pytest.raises(Exception, match="divergence_sustain"):
        CompareOptions(divergence_sustain=0)
