"""The detection benchmark's tally (benchmarks/bench_detection.py): a recipe change (correct
code, another recipe: twice the global batch at the same learning rate) is judged like a
defect, by its intended reason, and reported apart: it never counts as a benign candidate
nor against the targets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(monkeypatch: pytest.MonkeyPatch):  # -> benchmarks/bench_detection.py as a module
    spec = importlib.util.spec_from_file_location("bench_detection",
                                                  ROOT / "benchmarks" / "bench_detection.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    # dataclasses resolve annotations through sys.modules; removed after the test
    monkeypatch.setitem(sys.modules, "bench_detection", mod)
    spec.loader.exec_module(mod)
    return mod


def test_recipe_changes_are_judged_by_intent_and_left_out_of_the_targets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.digits.variants import Variant

    det = _bench(monkeypatch)
    benign = Variant("b", "torch", 1)
    defect = Variant("d", "jax", 1, defects=("sum_loss",), expect=("loss",))
    caught = Variant("r1", "torch", 2, recipe="2x batch, same lr", expect=("loss",))
    missed = Variant("r2", "torch", 3, recipe="2x batch, same lr", expect=("loss",))
    assert [v.kind for v in (benign, defect, caught, missed)] == \
        ["benign", "defect", "recipe", "recipe"]
    loss = ("loss-envelope", "outside", ("loss", "envelope"))
    held = [det.Outcome(Variant(f"h{i}", "torch", 100 + i), "pass", "L3") for i in range(20)]
    w = det.Workload("w", [], [benign, defect, caught, missed], [o.variant for o in held],
                     {"d": ("loss",), "r1": ("loss",), "r2": ("loss",)})
    r = det.Result(w, Path("c.toml"),
                   [det.Outcome(benign, "pass", "L3"), det.Outcome(defect, "fail", "L3", [loss]),
                    det.Outcome(caught, "fail", "L3", [loss]),
                    det.Outcome(missed, "pass", "L3")], held, 1.0)
    assert r.tally() == (1, 1, 1, 1)            # the recipe changes are neither
    assert r.tally("recipe") == (1, 1, 1, 2)    # one of two rejected for its reason
    assert r.as_intended(r.candidates[2]) and not r.as_intended(r.candidates[3])
    assert r.ok                                  # the missed recipe change is not a target
    assert "| 1/2 |" in det.summary([r], markdown=True)
    assert "recipe" in det.table(r)
    # the same miss by a defect does count
    r2 = det.Result(w, r.criteria, [det.Outcome(defect, "pass", "L3")], held, 1.0)
    assert not r2.ok
