"""Measures for any metric kind and the reference group, checked against numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from refrun import schema
from refrun.comparison import CompareOptions, RunData, compare
from refrun.errors import RefrunInputError

RNG = np.random.default_rng(7)


def run(run_id: str, **metrics: tuple[np.ndarray, np.ndarray]) -> RunData:
    frames = [pd.DataFrame({"metric": name.replace("__", "/"), "step": s, "value": v})
              for name, (s, v) in metrics.items()]
    return RunData.from_curves(pd.concat(frames, ignore_index=True), run_id,
                               tags={schema.TAG_ROLE: "reference"})


def test_probe_metrics_step_time_and_counters() -> None:
    steps = np.arange(200)
    rt = np.r_[np.full(20, 5.0), RNG.uniform(0.1, 0.2, 180)]
    ct = np.r_[np.full(20, 9.0), RNG.uniform(0.2, 0.3, 180)]
    rg = np.r_[np.ones(5), np.zeros(195)]
    cg = np.r_[np.ones(5) * 3, np.zeros(190), np.ones(5)]
    ref = run("r", perf__step_time_s=(steps, rt), compile__graphs=(steps, rg),
              xfer__d2h=(steps, rg * 2), fallback__ops=(steps, rg))
    cand = run("c", perf__step_time_s=(steps, ct), compile__graphs=(steps, cg),
               xfer__d2h=(steps, cg * 2), fallback__ops=(steps, cg))
    cmp = compare(ref, cand, options=CompareOptions(warmup_steps=25))
    st = cmp.metrics["perf/step_time_s"]
    assert st.kind == "step_time" and st.step_time.warmup_end_step == 25
    assert st.step_time.ratio == pytest.approx(np.median(ct[25:]) / np.median(rt[25:]),
                                               rel=1e-12)
    for name, k in (("compile/graphs", 1), ("xfer/d2h", 2), ("fallback/ops", 1)):
        c = cmp.metrics[name].counters
        assert cmp.metrics[name].kind == "counter"
        assert (c.reference_total, c.candidate_total) == (5 * k, 20 * k)
        assert (c.reference_after_warmup, c.candidate_after_warmup) == (0, 5 * k)
    # default warm-up: ceil(10% of the 200-step span)
    default = compare(ref, cand).metrics["perf/step_time_s"].step_time
    assert default.warmup_end_step == 20
    assert default.ratio == pytest.approx(np.median(ct[20:]) / np.median(rt[20:]), rel=1e-12)


def test_eval_points_and_final_window_options() -> None:
    es = np.array([0, 100, 200, 300])
    r, c = np.array([0.1, 0.5, 0.7, 0.8]), np.array([0.1, 0.45, 0.72, 0.79])
    cmp = compare(run("r", eval__accuracy=(es, r)), run("c", eval__accuracy=(es, c)),
                  options=CompareOptions(final_points=2))
    m = cmp.metrics["eval/accuracy"]
    assert m.kind == "eval"
    assert [p.step for p in m.eval_points] == es.tolist()
    np.testing.assert_allclose([p.diff for p in m.eval_points], c - r, atol=1e-15)
    assert m.measures.final_window.n == 2 and m.measures.final_window.first_step == 200
    assert m.measures.final_window.mean_abs_diff == pytest.approx(np.mean(np.abs(c - r)[2:]))
    frac = compare(run("r", eval__accuracy=(es, r)), run("c", eval__accuracy=(es, c)),
                   options=CompareOptions(final_fraction=0.5)).metrics["eval/accuracy"]
    assert frac.measures.final_window.n == 2


def test_reference_group_envelope_and_seed_units() -> None:
    steps = np.arange(50)
    seeds = np.vstack([np.exp(-steps / 20) + RNG.normal(0, 0.01, 50) for _ in range(4)])
    cand = np.exp(-steps / 20) + RNG.normal(0, 0.02, 50)
    refs = [run(f"s{i}", loss=(steps, seeds[i])) for i in range(4)]
    cmp = compare(refs, run("c", loss=(steps, cand)))
    m = cmp.metrics["loss"]
    lo, hi = seeds.min(0), seeds.max(0)
    mean, std = seeds.mean(0), seeds.std(0, ddof=1)
    outside = (cand < lo) | (cand > hi)
    z = (cand - mean) / std
    g = m.group
    assert g.n_references == 4 and g.steps_outside == outside.sum()
    assert g.fraction_outside == pytest.approx(outside.mean(), abs=1e-15)
    assert g.mean_abs_z == pytest.approx(np.abs(z).mean(), rel=1e-12)
    assert g.max_abs_z == pytest.approx(np.abs(z).max(), rel=1e-12)
    assert g.z_at_last_step == pytest.approx(z[-1], rel=1e-12)
    pairs = [np.abs(seeds[i] - seeds[j]).mean() for i in range(4) for j in range(i + 1, 4)]
    assert g.seed_mean_abs_diff == pytest.approx(np.mean(pairs), rel=1e-12)
    f = m.frame
    np.testing.assert_allclose(f["reference"], mean, rtol=1e-15)
    np.testing.assert_allclose(f["ref_std"], std, rtol=1e-12)
    np.testing.assert_allclose(f["z"], z, rtol=1e-12)
    assert m.measures.mean_abs_diff == pytest.approx(np.abs(cand - mean).mean(), rel=1e-12)
    # a seed missing a step leaves that step out of the group, and says so
    refs[1] = run("s1", loss=(steps[1:], seeds[1][1:]))
    again = compare(refs, run("c", loss=(steps, cand))).metrics["loss"]
    assert again.alignment.group_incomplete_steps == 1 and again.alignment.aligned_steps == 49


def test_references_that_agree_exactly_have_no_spread() -> None:
    """Three references logging the same learning rate have zero spread and that rate as
    their mean, not float64 rounding of them (numpy's mean of three 0.05 is
    0.05000000000000001, their sample std ~8.5e-18): a candidate logging the same rate
    stands nowhere, and one logging another rate is off seeds that never vary."""
    steps = np.arange(20)
    lr = np.full(20, 0.05)
    refs_matrix = np.vstack([lr] * 3)
    assert refs_matrix.std(0, ddof=1)[0] > 0 and refs_matrix.mean(0)[0] != 0.05  # the case
    loss = [np.exp(-steps / 10) + RNG.normal(0, 0.01, 20) for _ in range(3)]
    refs = [run(f"s{i}", opt__lr=(steps, lr), loss=(steps, loss[i])) for i in range(3)]
    same = compare(refs, run("c", opt__lr=(steps, lr), loss=(steps, loss[0]))).metrics
    f = same["opt/lr"].frame
    assert (f["ref_std"] == 0).all() and (f["reference"] == 0.05).all()
    assert (f["diff"] == 0).all() and f["z"].isna().all()
    g = same["opt/lr"].group
    assert g.zero_spread_steps == 20 and g.mean_abs_z is None
    assert same["loss"].group.zero_spread_steps == 0  # seeds that vary keep their spread
    other = compare(refs, run("c", opt__lr=(steps, lr * 2), loss=(steps, loss[0]))).metrics
    assert (other["opt/lr"].frame["diff"] == 0.05).all()
    assert other["opt/lr"].group.steps_outside == 20


def test_json_is_strict_and_documented_keys(tmp_path) -> None:
    steps = np.arange(10)
    ref = run("r", loss=(steps, np.linspace(1, 0, 10)), extra=(steps, np.ones(10)))
    vals = np.linspace(1, 0, 10) + 0.01
    vals[3] = np.nan
    cmp = compare(ref, run("c", loss=(steps, vals), only__cand=(steps, np.ones(10))))
    out = json.loads(cmp.write_json(tmp_path / "c.json").read_text())
    assert out["format"] == "refrun.comparison" and out["format_version"] == "1"
    assert out["metrics_only_in_reference"] == ["extra"]
    assert out["metrics_only_in_candidate"] == ["only/cand"]
    loss = out["metrics"]["loss"]
    assert set(loss) == {"kind", "notes", "alignment", "measures", "eval_points", "step_time",
                         "counters", "group", "first_divergence"}
    assert loss["alignment"]["candidate"]["nan"] == 1
    assert loss["alignment"]["excluded_nonfinite"] == 1
    assert loss["measures"]["n"] == 9
    assert math.isclose(loss["measures"]["bias"], 0.01, abs_tol=1e-12)


def test_bad_input_metric_in_one_run_and_no_common_steps() -> None:
    ref = run("r", loss=(np.arange(5), np.ones(5)))
    cand = run("c", loss=(np.arange(10, 15), np.ones(5)), other=(np.arange(3), np.ones(3)))
    with pytest.raises(RefrunInputError, match="metric 'other': not recorded in run r"):
        compare(ref, cand, metrics=["other"])
    with pytest.raises(RefrunInputError, match="metric 'loss': no common steps"):
        compare(ref, cand, metrics=["loss"])
    with pytest.raises(RefrunInputError, match="no common metric with aligned finite steps"):
        compare(ref, cand)
    with pytest.raises(RefrunInputError, match="keep"):
        CompareOptions(keep="middle")


def test_straggler_ratio_by_hand() -> None:
    from refrun.comparison.measures import straggler

    s = straggler({0: np.array([1.0, 1.0, 1.2]), 1: np.array([1.0, 1.1, 0.9]),
                   2: np.array([2.0, 2.2, np.nan]), 3: np.array([1.1, 1.1, 1.1])})
    # medians 1.0, 1.0, 2.1, 1.1 -> median of medians 1.05; slowest rank 2: 2.1 / 1.05 = 2
    assert s is not None and s.slowest_rank == 2 and s.ranks == 4
    assert math.isclose(s.ratio, 2.0) and math.isclose(s.median_of_medians_s, 1.05)
    assert straggler({0: np.array([np.nan])}) is None
