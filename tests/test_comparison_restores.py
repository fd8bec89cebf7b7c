"""Finding restores in a run's curves and judging them (refrun.comparison.restores, the
``restore`` criterion): the definitions of docs/comparison.md ("Restores") on logging
orders built by hand, each expected value written out from the definition; the band
path (a step that is not bit-for-bit deterministic) on curves whose divergence is known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from refrun import schema
from refrun.acceptance.checks import Context
from refrun.acceptance.criteria import parse_criteria
from refrun.comparison import RunData
from refrun.comparison.restores import replays


def series(steps: list[int], values: list[float] | None = None):
    v = values if values is not None else [float(s) for s in steps]
    return np.array(steps), np.array(v, dtype=float), np.arange(len(steps))


def test_a_run_that_never_went_back_has_no_restore_and_micro_batches_are_not_one() -> None:
    assert replays(*series(list(range(10)))) == []
    # three points per step (micro-batches of one optimizer step): the frontier repeats
    assert replays(*series([0, 0, 0, 1, 1, 1, 2, 2, 2])) == []
    # logging order is seq, not row order: rows shuffled, seq says 0..9 in order
    steps, values, seq = series(list(range(10)))
    perm = np.random.default_rng(0).permutation(10)
    assert replays(steps[perm], values[perm], seq[perm]) == []


def test_one_restore_is_found_with_where_it_resumed_and_where_it_was_interrupted() -> None:
    order = list(range(8)) + list(range(3, 12))  # checkpoint after 2, crash after 7
    vals = [float(s) for s in order]
    vals[8 + 2] = 99.0  # the replay of step 5 differs
    (r,) = replays(*series(order, vals), metric="loss")
    assert (r.metric, r.step, r.after_step) == ("loss", 3, 7)
    assert r.steps.tolist() == [3, 4, 5, 6, 7]  # 8..11 are new ground
    assert r.first.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert r.replay.tolist() == [3.0, 4.0, 99.0, 6.0, 7.0]
    assert not r.identical and r.steps[r.first_difference] == 5
    e, d = r.divergence()
    assert e.tolist() == [0, 1, 2, 3, 4] and d.tolist() == [0, 0, 94.0, 94.0, 94.0]


def test_a_second_restore_compares_with_the_first_pass_not_with_the_first_replay() -> None:
    # 0..9, back to 4..7 (replay 1, values +1), back to 6..12 (replay 2, identical)
    order = list(range(10)) + list(range(4, 8)) + list(range(6, 13))
    vals = [float(s) for s in range(10)] + [s + 1.0 for s in range(4, 8)] + \
        [float(s) for s in range(6, 13)]
    r1, r2 = replays(*series(order, vals))
    assert (r1.step, r1.after_step, r1.steps.tolist()) == (4, 9, [4, 5, 6, 7])
    assert (r1.max_abs_diff, r1.identical) == (1.0, False)
    assert (r2.step, r2.after_step, r2.steps.tolist()) == (6, 9, [6, 7, 8, 9])
    assert r2.identical  # against the first pass (6.0 ...), not replay 1's 7.0


def test_nan_replays_nan_identically_and_a_nan_against_a_number_is_infinite() -> None:
    order = [0, 1, 2, 1, 2]
    (r,) = replays(*series(order, [0.0, np.nan, 2.0, np.nan, 2.0]))
    assert r.identical
    (r,) = replays(*series(order, [0.0, 1.0, 2.0, np.nan, 2.0]))
    assert r.divergence()[1].tolist() == [np.inf, np.inf]


def test_replayed_micro_batches_are_matched_occurrence_by_occurrence() -> None:
    order = [0, 0, 1, 1, 2, 2, 1, 1, 2, 2, 2]  # the replay logs step 2 three times
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 1.0, 1.5, 2.0, 2.5, 7.0]
    (r,) = replays(*series(order, vals))
    assert r.steps.tolist() == [1, 1, 2, 2] and r.identical and r.unmatched == 1


def run_with_replay(diffs: list[float]) -> RunData:
    """Loss 0..29, then steps 10..29 again, the replay off by ``diffs`` at steps 10..;
    the learning rate replayed identically."""
    first = list(range(30))
    replay = list(range(10, 30))
    loss = [1.0 / (1 + s) for s in first] + \
        [1.0 / (1 + s) + (diffs[i] if i < len(diffs) else diffs[-1])
         for i, s in enumerate(replay)]
    lr = [0.1 * 0.9 ** s for s in first + replay]
    ordered = []
    for i, s in enumerate(first + replay):  # per step: the rate, then the loss
        ordered += [(schema.M_LR, s, lr[i]), ("loss", s, loss[i])]
    df = pd.DataFrame(ordered, columns=["metric", "step", "value"])
    return RunData.from_curves(df, run_id="cand", tags={schema.TAG_BACKEND: "torch"})


CRITERIA = """version = 1
workload = "w"
[[criteria]]
id = "resume-reproduces"
level = "L2"
kind = "restore"
metric = "loss"
{band}
"""
BAND = "band_steps = [0, 5]\nband_values = [1e-7, 1e-6]\nmax_ratio = 10.0"


def judge(run: RunData, band: str = ""):
    crit = parse_criteria(CRITERIA.format(band=band), "c.toml")
    c = crit.criteria[0]
    return c.check(Context(crit, [run], run, None))


@pytest.mark.parametrize(("diffs", "band", "outcome"), [
    ([0.0], "", "pass"),                   # bit for bit
    ([0.0, 1e-9], "", "fail"),             # not bit for bit, no band
    # inside 10 x the band counted from the restore: 5e-7 <= 1e-6 up to 4 steps after it,
    # 5e-6 <= 1e-5 from 5 steps after it on
    ([0.0, 1e-9, 5e-7, 5e-7, 5e-7, 5e-6], BAND, "pass"),
    ([0.0, 1e-9, 5e-6], BAND, "fail"),     # 5e-6 two steps after: band there 1e-7 x 10
])
def test_the_replayed_loss_is_bit_for_bit_or_within_the_same_seed_band(
        diffs: list[float], band: str, outcome: str) -> None:
    r = judge(run_with_replay(diffs), band)
    assert r.outcome == outcome, r.reason
    (rec,) = r.evidence["restores"]
    assert (rec["step"], rec["after_step"], rec["replayed"]) == (10, 29, 20)
    assert rec["state"][0]["identical"] and rec["state"][0]["metric"] == schema.M_LR
    if band and outcome == "fail":
        assert "leaves 10 x the same-seed band" in r.reason
        assert rec["band_ratio"] == pytest.approx(5e-6 / 1e-7)


def test_a_band_needs_all_three_keys() -> None:
    from refrun.errors import RefrunInputError

    with pytest.raises(RefrunInputError, match="go together"):
        parse_criteria(CRITERIA.format(band="max_ratio = 10.0"), "c.toml")
