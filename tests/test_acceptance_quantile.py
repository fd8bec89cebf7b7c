"""``quantile``: a run-level quantile of a per-step metric sees a shift that every step shares
but that each step's seed noise hides from the per-step band.

Real runs recorded with refrun's session into a real sqlite store; ``refrun calibrate``
writes the criteria (from ``QUANTILE_MIN_RUNS`` reference seeds on) and ``refrun accept``
judges candidates.  Expected quantiles are computed with numpy from the logged arrays.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import record

from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import calibrate_ids, write_file
from refrun.acceptance.calibration.derive import QUANTILE_MIN_RUNS, RUN_QUANTILES
from refrun.acceptance.criteria import load_criteria

METRIC = "grad_norm/total"
T = 400  # steps: a run-level median of 400 points moves ~1/20 of a point's noise
STEPS = np.arange(T)
NOISE = 0.05  # per-step noise of the metric: a per-step band is about +-3 of these wide
SHIFT = 0.03  # a shift every step shares: 0.6 per-step sd, about 8 run-level sd


@pytest.fixture(autouse=True)
def _thread_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")


def _metrics(seed: int, shift: float = 0.0, every: int = 1) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    g = 0.5 + 0.3 * np.exp(-STEPS / 40.0) + rng.normal(0, 0.002) + rng.normal(0, NOISE, T)
    g = g - shift
    val = 1.0 + np.exp(-STEPS / 30.0) + rng.normal(0, 0.01, T)
    logged = [float(x) if i % every == 0 else None for i, x in enumerate(g)]
    return {METRIC: logged, "eval/val_loss": val}


def _run(uri: str, spool: Path, role: str, seed: int, **kw) -> tuple[str, np.ndarray]:
    m = _metrics(seed, **kw)
    run = record(uri, spool, role, m, seed=seed, planned_steps=T, eval_every=50)
    return run.run_id, np.array([x for x in m[METRIC] if x is not None])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("quantile")
    uri, spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    refs = [_run(uri, spool, "reference", s) for s in range(QUANTILE_MIN_RUNS + 2)]
    return tmp, uri, spool, refs


def _calibrated(tmp: Path, uri: str, ids: list[str], name: str):
    path = tmp / name
    write_file(calibrate_ids(ids, uri), str(path))
    return path, load_criteria(path)


def test_written_from_enough_seeds_and_said_why_not_below(store) -> None:
    tmp, uri, _, refs = store
    ids = [r for r, _ in refs]
    _, crit = _calibrated(tmp, uri, ids, "many.toml")
    got = sorted((c.metric, c.q) for c in crit.criteria if c.KIND == "quantile")
    assert got == sorted((METRIC, q) for q in RUN_QUANTILES)
    assert all(c.level == "L1" and c.min_points == T // 2
               for c in crit.criteria if c.KIND == "quantile")
    path, few = _calibrated(tmp, uri, ids[:QUANTILE_MIN_RUNS - 1], "few.toml")
    assert [c for c in few.criteria if c.KIND == "quantile"] == []
    text = " ".join(ln.lstrip("# ") for ln in path.read_text().splitlines())
    said = re.search(r"no run-level quantile criteria: (\d+) reference seeds, written from "
                     r"(\d+)", text)
    assert said and int(said[1]) < QUANTILE_MIN_RUNS == int(said[2]), text[:300]


def test_a_shift_every_step_shares_fails_the_quantile_and_passes_the_band(store) -> None:
    tmp, uri, spool, refs = store
    ids = [r for r, _ in refs]
    _, crit = _calibrated(tmp, uri, ids, "c.toml")
    group = ids[:len(ids) - 1]  # calibrate's default group size, N - 1
    med = next(c for c in crit.criteria if c.KIND == "quantile" and c.q == 0.5)
    band = next(c for c in crit.criteria if c.KIND == "envelope" and c.metric == METRIC)
    for seed, shift, outcome in ((101, 0.0, "pass"), (102, SHIFT, "fail")):
        cand, values = _run(uri, spool, "candidate", seed, shift=shift)
        a, _ = assess_ids(crit, group, cand, uri)
        r = a.result(med.id)
        ref_q = [float(np.quantile(v, 0.5)) for _, v in refs[:len(group)]]
        got = float(np.quantile(values, 0.5))
        assert r.evidence["candidate_quantile"] == pytest.approx(got, rel=1e-12)
        assert r.evidence["reference_quantiles"] == pytest.approx(ref_q, rel=1e-12)
        lo, hi = min(ref_q) - med.abs_tol, max(ref_q) + med.abs_tol
        assert (lo <= got <= hi) == (outcome == "pass")
        assert r.outcome == outcome, r.reason
        # the per-step band accepts both: each step's noise hides the shift
        assert a.result(band.id).outcome == "pass", (seed, a.result(band.id).reason)
    assert "outside" in r.reason and "(below)" in r.reason


def test_a_candidate_logging_too_few_points_is_not_judged_by_it(store) -> None:
    tmp, uri, spool, refs = store
    ids = [r for r, _ in refs]
    _, crit = _calibrated(tmp, uri, ids, "sparse.toml")
    cand, values = _run(uri, spool, "candidate", 103, shift=SHIFT, every=10)
    a, _ = assess_ids(crit, ids[:len(ids) - 1], cand, uri)
    for c in (c for c in crit.criteria if c.KIND == "quantile"):
        r = a.result(c.id)
        assert r.outcome == "not_applicable", r.reason
        assert f"{len(values)} aligned point(s)" in r.reason and len(values) == T // 10
