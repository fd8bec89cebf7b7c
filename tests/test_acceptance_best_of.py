"""``best_of``: a workload that reports its best checkpoint's evaluation keeps doing so.

Real runs recorded with refrun's session into a real sqlite store; ``refrun calibrate``
finds the relation in the references (the one-value ``eval/final_val_loss`` is the min of
the periodic ``eval/val_loss`` in every reference, and the min is not the last point), and
``refrun accept`` judges it within each candidate's own run.  Expected values are computed
with numpy from the logged arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import STEPS, N, base_loss, record

from refrun.acceptance.assess import assess_ids
from refrun.acceptance.calibration import calibrate_ids, write_file
from refrun.acceptance.criteria import load_criteria

EVERY = 10


@pytest.fixture(autouse=True)
def _thread_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")


def _val_loss(seed: int) -> np.ndarray:
    """A validation loss that falls, then rises (over-fitting): its min is mid-run."""
    rng = np.random.default_rng(seed)
    return 1.0 + 0.002 * (STEPS - 60.0) ** 2 / 36 + rng.normal(0, 0.01, N)


def _logged(values: np.ndarray, every: int) -> np.ndarray:
    """The points ``record`` logs for an eval/ metric: every ``every`` steps and the last."""
    keep = (STEPS % every == every - 1) | (STEPS == N - 1)
    return values[keep]


def _run(uri: str, spool: Path, role: str, seed: int, report: str, every: int = EVERY,
         monotone: bool = False) -> tuple[str, float, float]:
    """One run; ``report``: 'best' (the min of its logged val_loss) or 'last'.  Returns
    (run id, the value reported, the min of its logged val_loss)."""
    val = _val_loss(seed)
    if monotone:
        val = np.sort(val)[::-1].copy()
    logged = _logged(val, every)
    final = float(logged.min() if report == "best" else logged[-1])
    one = np.full(N, np.nan)
    one[-1] = final
    rng = np.random.default_rng(seed + 1000)
    acc = np.full(N, np.nan)
    acc[-1] = 0.9 + rng.normal(0, 0.005)
    run = record(uri, spool, role, {"loss": base_loss() + rng.normal(0, 0.01, N),
                                     "eval/val_loss": val, "eval/final_val_loss": one,
                                     "eval/test_accuracy": acc},
                 seed=seed, eval_every=every)
    return run.run_id, final, float(logged.min())


def _calibrated(tmp: Path, monotone: bool = False):
    uri, spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    refs = [_run(uri, spool, "reference", s, "best", monotone=monotone)[0] for s in range(5)]
    path = tmp / "c.toml"
    write_file(calibrate_ids(refs, uri), str(path))
    return uri, spool, refs, load_criteria(path)


def test_calibrate_finds_the_relation_and_accept_judges_it_within_each_run(
        tmp_path: Path) -> None:
    uri, spool, refs, crit = _calibrated(tmp_path)
    rel = [c for c in crit.criteria if c.KIND == "best_of"]
    assert [(c.metric, c.of, c.best, c.level) for c in rel] == [
        ("eval/final_val_loss", "eval/val_loss", "min", "L2")]
    c = rel[0]
    # A port reporting its best evaluation, at its own cadence too, passes; one reporting
    # its last evaluation (no best-checkpoint reload) fails, and says so.
    for seed, report, every, outcome in ((21, "best", EVERY, "pass"),
                                         (22, "best", 20, "pass"),
                                         (23, "last", EVERY, "fail")):
        cand, final, best = _run(uri, spool, "candidate", seed, report, every)
        a, _ = assess_ids(crit, refs[:4], cand, uri)
        r = a.result(c.id)
        assert r.outcome == outcome, r.reason
        assert r.evidence["value"] == pytest.approx(final, rel=1e-12)
        assert r.evidence["best"] == pytest.approx(best, rel=1e-12)
        if outcome == "fail":
            assert "the best checkpoint was not the one reported" in r.reason
            assert best < final  # the last point of a rising curve is not its min


def test_no_relation_when_the_best_is_always_the_last_point(tmp_path: Path) -> None:
    """A falling validation loss: the reported value is the min *and* the last point in
    every reference, so nothing says it is a selection; no best_of criterion is written."""
    _, _, _, crit = _calibrated(tmp_path, monotone=True)
    assert [c for c in crit.criteria if c.KIND == "best_of"] == []
