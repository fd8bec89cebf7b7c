"""A single end-of-run value (a test accuracy, a final evaluation) judged with its own
sampling error (docs/acceptance.md, "Fourteenth session").

An accuracy over n examples is a proportion: besides the seeds' spread it carries a
binomial error ``sqrt(p (1 - p) / n)`` that five references landing within one example of
each other do not show (the digits workload's ``val_accuracy-final`` and
``test_accuracy`` rejected a benign held-out seed now and then).  Calibrate reads n from
the values themselves (every value is k/n) and floors the range's ``abs_tol`` and the
TOST margin with the prediction bound of one new value, ``sqrt(1 + 1/g) max(t s,
sqrt(t^2 tau^2 + z^2 se^2))``.  Expected numbers by hand with numpy and scipy, on runs in
a real sqlite store."""

from __future__ import annotations

import itertools
import math
import tomllib

import numpy as np
import pytest
from scipy import stats as sps

from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file
from refrun.acceptance.calibration.derive import tost_margin_floor
from refrun.acceptance.criteria import load_criteria
from refrun.acceptance.statistics import proportion_size
from tests.acceptance_helpers import STEPS, N, record

EXAMPLES = 400
# Five references within one example of each other (a small-sample accident the next
# seed need not repeat); groups of 4.
COUNTS = [388, 389, 389, 388, 389]
COVERAGE = 1 - 0.05 / 4  # loss envelope and final window, accuracy range and TOST


def _acc(count: int) -> float:
    return float(np.float32(count / EXAMPLES))  # logged as a float32 accuracy


@pytest.mark.parametrize(("values", "resolution", "n"), [
    ([_acc(c) for c in COUNTS], 1 / EXAMPLES, EXAMPLES),
    ([852 / 897, 854 / 897, 851 / 897], 1 / 897, 897),
    # every count even: the lattice of 200 is found first (a larger error, a wider band)
    ([388 / 400, 390 / 400, 386 / 400], 2 / 400, 200),
    ([0.1234567, 0.2345671, 0.9876543], 0.1111104, None),  # continuous
    ([1.5, 2.0, 2.5], 0.5, None),  # not a proportion
    ([0.97, 0.97, 0.97], 0.0, None),  # one value: no lattice to read
])
def test_the_evaluation_set_size_is_read_from_the_values(values, resolution, n) -> None:
    assert proportion_size(np.array(values), resolution) == n


def _one_value(value: float) -> np.ndarray:
    v = np.full(N, None, dtype=object)
    v[-1] = value
    return v


def _record(uri, spool, role: str, seed: int, count: int):
    rng = np.random.default_rng(seed)
    loss = 2.3 * np.exp(-STEPS / 25.0) + 0.2 + rng.normal(0, 0.01, N)
    return record(uri, spool, role, {"loss": loss, "eval/test_accuracy": _one_value(_acc(count))},
                  seed=seed)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("single-point")
    uri, spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    refs = [_record(uri, spool, "reference", s, c) for s, c in enumerate(COUNTS)]
    cands = {"six-below": _record(uri, spool, "candidate", 31, min(COUNTS) - 6),
             "thirty-below": _record(uri, spool, "candidate", 32, min(COUNTS) - 30)}
    path = tmp / "c.toml"
    write_file(calibrate_ids([r.run_id for r in refs], uri, CalibrationOptions()), str(path))
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    return {"uri": uri, "refs": refs, "cands": cands, "path": path,
            "crit": {c["id"]: c for c in doc["criteria"]}}


def _by_hand() -> dict[str, float]:
    """The floors of the range's abs_tol and of the TOST margin, with and without the
    binomial error, for groups of g = 4 of the five values."""
    v = np.array([_acc(c) for c in COUNTS])
    g, a = 4, 1 - COVERAGE
    s = v.std(ddof=1)
    se = math.sqrt(v.mean() * (1 - v.mean()) / EXAMPLES)
    t, z = sps.t.ppf(1 - a / 2, g - 1), sps.norm.ppf(1 - a / 2)
    tau2 = max(0.0, s * s - se * se)
    narrowest = min(np.ptp(v[list(c)]) for c in itertools.combinations(range(5), g))
    with_se = math.sqrt(1 + 1 / g) * max(t * s, math.sqrt(t * t * tau2 + z * z * se * se))
    seeds_only = math.sqrt(1 + 1 / g) * t * s
    half = s * math.sqrt(1 + 1 / g) * sps.t.ppf(0.95, g - 1)  # the TOST interval's
    return {"se": se, "range": with_se - narrowest / 2, "range_old": seeds_only - narrowest / 2,
            "margin": with_se + half, "margin_old": seeds_only + half}


def test_the_band_is_floored_by_the_accuracy_own_binomial_error(world: dict) -> None:
    env, eq = world["crit"]["test_accuracy-envelope"], world["crit"]["test_accuracy-equivalence"]
    want = _by_hand()
    for c in (env, eq):
        assert c["calibration"]["examples"] == EXAMPLES
        assert c["calibration"]["point_se"] == pytest.approx(want["se"], rel=1e-5)
    # the floors decide: five references within one example need little on their own
    assert env["abs_tol"] == pytest.approx(want["range"], rel=1e-3)
    assert eq["margin"] == pytest.approx(want["margin"], rel=1e-3)
    assert want["range"] > 2 * want["range_old"]  # the seeds' spread alone: half as wide
    v = np.array([_acc(c) for c in COUNTS])
    assert tost_margin_floor(v, 4, COVERAGE) == pytest.approx(want["margin_old"], rel=1e-9)


def test_a_seed_six_examples_away_passes_and_thirty_fail(world: dict) -> None:
    """Six examples (0.015) below the references' lowest is 1.8 binomial errors: a benign
    seed; the seeds' spread alone allowed 0.0070.  Thirty (0.075) fails both criteria."""
    crit = load_criteria(world["path"])
    refs = [r.run_id for r in world["refs"][:4]]
    want = _by_hand()
    assert want["range_old"] < 6 / EXAMPLES < want["range"] < 30 / EXAMPLES
    for name, outcome in (("six-below", "pass"), ("thirty-below", "fail")):
        a, _ = assess_ids(crit, refs, world["cands"][name].run_id, world["uri"])
        for cid in ("test_accuracy-envelope", "test_accuracy-equivalence"):
            assert a.result(cid).outcome == outcome, (name, cid, a.result(cid).reason)


def test_a_continuous_one_value_metric_keeps_the_seeds_spread_alone(world: dict) -> None:
    """The loss's final window is no proportion: nothing is read, nothing written."""
    assert "examples" not in world["crit"]["loss-final-window"]["calibration"]
    assert "point_se" not in world["crit"]["loss-envelope"]["calibration"]
