"""Property tests for alignment: messy logging gives the measures of the equivalent clean
pair (permuted order, restarts repeating steps, gaps, other cadences, non-finite values)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refrun.comparison import CompareOptions, RunData, compare, resolve_series
from refrun.comparison.alignment import interpolate_onto, step_shift
from refrun.errors import RefrunInputError

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def clean_pair(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    steps = np.array(sorted(draw(st.sets(st.integers(0, 500), min_size=3, max_size=40))))
    ref = np.array(draw(st.lists(values, min_size=len(steps), max_size=len(steps))))
    cand = np.array(draw(st.lists(values, min_size=len(steps), max_size=len(steps))))
    return steps, ref, cand


def run(steps: np.ndarray, vals: np.ndarray, run_id: str) -> RunData:
    """Points logged in row order (seq = row number)."""
    return RunData.from_curves(pd.DataFrame({"metric": "loss", "step": steps,
                                             "value": vals}), run_id)


def measures(ref: RunData, cand: RunData, **opts: object) -> dict:
    return dataclasses.asdict(compare(ref, cand, options=CompareOptions(**opts))
                              .metrics["loss"].measures)


def numpy_measures(r: np.ndarray, c: np.ndarray) -> tuple[float, float, float]:
    d = c - r
    rel = np.abs(d) / np.maximum(np.maximum(np.abs(r), np.abs(c)), 1e-12)
    return float(np.mean(np.abs(d))), float(np.mean(rel)), float(np.mean(d))


@SETTINGS
@given(clean_pair(), st.randoms(use_true_random=False))
def test_permuted_logging_order(pair, rnd) -> None:
    steps, r, c = pair
    clean = measures(run(steps, r, "r"), run(steps, c, "c"))
    perm = np.array(rnd.sample(range(len(steps)), len(steps)))
    cmp = compare(run(steps, r, "r"), run(steps[perm], c[perm], "c"))
    assert dataclasses.asdict(cmp.metrics["loss"].measures) == clean
    backwards = int(np.count_nonzero(np.diff(steps[perm]) < 0))
    assert cmp.metrics["loss"].alignment.candidate.backwards == backwards
    mad, mrd, bias = numpy_measures(r, c)
    assert clean["mean_abs_diff"] == pytest.approx(mad, abs=1e-9)
    assert clean["mean_rel_diff"] == pytest.approx(mrd, abs=1e-12)
    assert clean["bias"] == pytest.approx(bias, abs=1e-9)


@SETTINGS
@given(clean_pair(), st.data())
def test_restart_repeating_steps_last_or_first_wins(pair, data) -> None:
    steps, r, c = pair
    clean = measures(run(steps, r, "r"), run(steps, c, "c"))
    # a restart: the run reaches step index `upto`, then resumes from `resume` and writes
    # steps resume..upto again; the stale values differ from the kept ones.
    upto = data.draw(st.integers(1, len(steps) - 1))
    resume = data.draw(st.integers(0, upto))
    stale = c[resume:upto + 1] + 7.0
    # last wins: stale values first, then the real ones from `resume` on
    s_last = np.concatenate([steps[:upto + 1], steps[resume:]])
    v_last = np.concatenate([c[:resume], stale, c[resume:]])
    got = compare(run(steps, r, "r"), run(s_last, v_last, "c"))
    assert dataclasses.asdict(got.metrics["loss"].measures) == clean
    rep = got.metrics["loss"].alignment.candidate
    assert rep.repeated_steps == upto + 1 - resume
    assert rep.repeated_ranges == [[int(steps[resume]), int(steps[upto]), upto + 1 - resume]]
    # first wins: the real values first, the stale repeat after
    s_first = np.concatenate([steps[:upto + 1], steps[resume:]])
    v_first = np.concatenate([c[:upto + 1], stale, c[upto + 1:]])
    got = measures(run(steps, r, "r"), run(s_first, v_first, "c"), keep="first")
    assert got == clean


@SETTINGS
@given(clean_pair(), st.data())
def test_gaps_compare_on_common_steps(pair, data) -> None:
    steps, r, c = pair
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=len(steps),
                                       max_size=len(steps))))
    keep[data.draw(st.integers(0, len(steps) - 1))] = True
    got = compare(run(steps, r, "r"), run(steps[keep], c[keep], "c"))
    clean = measures(run(steps[keep], r[keep], "r"), run(steps[keep], c[keep], "c"))
    assert dataclasses.asdict(got.metrics["loss"].measures) == clean
    a = got.metrics["loss"].alignment
    assert (a.aligned_steps, a.only_in_reference, a.only_in_candidate) == (
        int(keep.sum()), int((~keep).sum()), 0)


@SETTINGS
@given(clean_pair(), st.integers(2, 5), st.floats(-3, 3), st.floats(-10, 10))
def test_different_cadence_common_steps_and_interpolation(pair, k, slope, icpt) -> None:
    steps, r, _ = pair
    dense = np.arange(int(steps[0]), int(steps[-1]) + 1)
    ref_vals = np.interp(dense, steps, r)
    lin = icpt + slope * dense  # a linear candidate: interpolation is exact
    sparse = dense[::k]
    got = compare(run(dense, ref_vals, "r"), run(sparse, lin[::k], "c"))
    clean = measures(run(sparse, ref_vals[::k], "r"), run(sparse, lin[::k], "c"))
    assert dataclasses.asdict(got.metrics["loss"].measures) == clean
    a = got.metrics["loss"].alignment
    assert a.only_in_reference == len(dense) - len(sparse)
    assert a.cadence_differs == (len(sparse) > 1)
    inside = dense[dense <= sparse[-1]]
    interp = compare(run(dense, ref_vals, "r"), run(sparse, lin[::k], "c"),
                     options=CompareOptions(interpolate="candidate")).metrics["loss"]
    assert interp.alignment.interpolated is not None
    assert interp.alignment.aligned_steps == len(inside)
    ideal = measures(run(inside, ref_vals[:len(inside)], "r"),
                     run(inside, lin[:len(inside)], "c"))
    for key in ("mean_abs_diff", "bias", "max_abs_diff"):
        assert dataclasses.asdict(interp.measures)[key] == pytest.approx(ideal[key], abs=1e-9)


@SETTINGS
@given(clean_pair(), st.integers(-1000, 1000))
def test_steps_numbered_differently_are_named_and_still_compared_at_equal_numbers(
        pair, d) -> None:
    """A candidate logging the reference's schedule with every step number moved by ``d``
    (steps completed against the index of the step just ended: d = 1) gets ``step_shift``
    d and a note, and is compared at the step numbers both hold, as before."""
    steps, r, c = pair
    common = np.intersect1d(steps, steps + d)  # numpy's own join, not refrun's
    named = f"shifted by {d:+d}"
    if not len(common):  # the only metric has no common step: the error says why
        with pytest.raises(RefrunInputError, match=f"0 common.*{re.escape(named)}"):
            compare(run(steps, r, "r"), run(steps + d, c, "c"))
        return
    got = compare(run(steps, r, "r"), run(steps + d, c, "c"))
    a = got.metrics["loss"].alignment
    assert a.step_shift == (d if d else None)
    assert any(named in n for n in a.notes) == (d != 0)
    assert a.aligned_steps == len(common)
    ri, ci = np.searchsorted(steps, common), np.searchsorted(steps + d, common)
    assert dataclasses.asdict(got.metrics["loss"].measures) == measures(
        run(common, r[ri], "r"), run(common, c[ci], "c"))


def test_a_shift_is_only_called_so_for_the_same_schedule() -> None:
    steps = np.arange(19, 200, 20)
    assert step_shift(steps, steps + 1) == 1
    assert step_shift(steps, steps - 19) == -19
    assert step_shift(steps, steps) is None
    assert step_shift(steps, steps[1:] + 1) is None  # fewer evaluations: another schedule
    assert step_shift(steps[:1], steps[:1] + 1) is None  # one lone point each
    other = steps + 1
    other[-1] += 1  # the last evaluation one step later again
    assert step_shift(steps, other) is None


@SETTINGS
@given(clean_pair(), st.data())
def test_nonfinite_counted_and_excluded_never_zero(pair, data) -> None:
    steps, r, c = pair
    bad = np.array(data.draw(st.lists(st.sampled_from([0.0, np.nan, np.inf, -np.inf]),
                                      min_size=len(steps), max_size=len(steps))))
    bad[0] = 0.0  # keep at least one finite step
    dirty = np.where(bad == 0.0, c, bad)
    ok = np.isfinite(dirty)
    got = compare(run(steps, r, "r"), run(steps, dirty, "c")).metrics["loss"]
    clean = measures(run(steps[ok], r[ok], "r"), run(steps[ok], c[ok], "c"))
    assert dataclasses.asdict(got.measures) == clean
    rep = got.alignment.candidate
    assert (rep.nan, rep.posinf, rep.neginf) == (int(np.isnan(bad).sum()),
                                                 int((bad == np.inf).sum()),
                                                 int((bad == -np.inf).sum()))
    assert got.alignment.excluded_nonfinite == int((~ok).sum())
    assert np.isfinite(got.frame["candidate"]).all()


def test_interpolation_never_bridges_a_nonfinite_neighbour() -> None:
    xp = np.array([0, 10, 20])
    fp = np.array([0.0, np.nan, 2.0])
    out = interpolate_onto(xp, fp, np.array([0, 5, 10, 15, 20]))
    assert out[0] == 0.0 and out[4] == 2.0
    assert np.isnan(out[1:4]).all()


def test_resolve_series_keep_first_like_megatron() -> None:
    s = resolve_series(np.array([1, 2, 3, 2, 3, 4]), np.array([1.0, 2, 3, 20, 30, 4]),
                       np.arange(6), keep="first")
    assert s.values.tolist() == [1.0, 2.0, 3.0, 4.0]
    s = resolve_series(np.array([1, 2, 3, 2, 3, 4]), np.array([1.0, 2, 3, 20, 30, 4]),
                       np.arange(6), keep="last")
    assert s.values.tolist() == [1.0, 20.0, 30.0, 4.0]
    assert s.report.repeated_ranges == [[2, 3, 2]] and s.report.backwards == 1
