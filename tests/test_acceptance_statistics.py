"""The statistics behind the equivalence and convergence criteria and the calibration,
each checked against a published example or an independent computation (numpy and
scipy.stats by hand, never the code under test)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from scipy import stats as sps

from refrun.acceptance.criteria import Criterion
from refrun.acceptance.statistics import (
    mlperf_limits,
    olympic,
    steps_to_target,
    tolerance_factor,
    tost,
    upper_limit,
    window_mean_error,
    window_mean_prediction,
)

MLPERF_POINTS = [16, 14, 16, 17, 16, 16, 15, 16, 15, 16]


def test_mlperf_rules_example_by_hand() -> None:
    # MLPerf Training rules, "Reference Convergence Points": 10 reference runs, 5
    # submission runs; both olympic-scored (3 submission values remain).
    pts = np.sort(np.array(MLPERF_POINTS, dtype=float))[1:-1]
    mean, sd = pts.mean(), pts.std()  # population std, as the RCP checker (np.std)
    t = sps.t.ppf(0.95, len(pts) + 3 - 2)
    min_mean = mean - t * sd * math.sqrt(1 / len(pts) + 1 / 3)
    # the published numbers
    assert round(mean, 2) == 15.75 and round(sd, 2) == 0.43
    assert round(min_mean, 2) == 15.21 and round((mean / min_mean - 1) * 100, 2) == 3.53
    lim = mlperf_limits(np.array(MLPERF_POINTS), n_candidate=3)
    assert lim.rcp_mean == pytest.approx(mean) and lim.rcp_std == pytest.approx(sd)
    assert lim.n_reference == 8 and lim.n_candidate == 3
    assert lim.min_acceptable_mean == pytest.approx(min_mean, abs=1e-9)
    assert lim.max_speedup == pytest.approx(mean / min_mean)
    assert lim.max_acceptable_mean == pytest.approx(2 * mean - min_mean)


def test_mlperf_limit_is_what_the_rcp_checker_bisection_finds() -> None:
    # The MLPerf checker bisects on the p-value of scipy's pooled two-sample t-test.
    pts = olympic(np.array(MLPERF_POINTS, dtype=float))
    mean, sd, n_r, n_s = pts.mean(), pts.std(), len(pts), 3
    lo, hi = 0.0, mean
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        t, p = sps.ttest_ind_from_stats(mid, sd, n_s, mean, sd, n_r, equal_var=True)
        p_one = p / 2 if t < 0 else 1 - p / 2
        lo, hi = (lo, mid) if p_one > 0.05 else (mid, hi)
    assert mlperf_limits(np.array(MLPERF_POINTS), 3).min_acceptable_mean == \
        pytest.approx(lo, abs=1e-6)


def test_olympic_needs_three_values_and_drops_one_min_and_one_max() -> None:
    assert olympic(np.array([3.0, 1.0, 1.0, 9.0, 9.0])).tolist() == [1.0, 3.0, 9.0]
    with pytest.raises(ValueError):
        olympic(np.array([1.0, 2.0]))


def test_tost_two_samples_matches_scipy_one_sided_t_tests() -> None:
    rng = np.random.default_rng(3)
    ref, cand = rng.normal(0.86, 0.004, 6), rng.normal(0.861, 0.004, 4)
    m = 0.01
    r = tost(ref, cand, -m, m, alpha=0.05)
    # H0: diff <= -m  <=> cand - (-m) not greater than ref: one-sided pooled t-test
    p_low = sps.ttest_ind(cand + m, ref, equal_var=True, alternative="greater").pvalue
    p_up = sps.ttest_ind(cand - m, ref, equal_var=True, alternative="less").pvalue
    assert r.p_lower == pytest.approx(p_low) and r.p_upper == pytest.approx(p_up)
    assert r.p == pytest.approx(max(p_low, p_up)) and r.df == 8
    sp2 = (5 * ref.var(ddof=1) + 3 * cand.var(ddof=1)) / 8
    half = sps.t.ppf(0.95, 8) * math.sqrt(sp2 * (1 / 6 + 1 / 4))
    d = cand.mean() - ref.mean()
    assert r.interval == pytest.approx((d - half, d + half))
    assert r.equivalent == (d - half > -m and d + half < m)


def test_tost_one_candidate_by_hand_and_the_interval_rule() -> None:
    ref = np.array([0.9632, 0.9521, 0.9509, 0.9599, 0.9454])
    s, n = ref.std(ddof=1), len(ref)
    se = s * math.sqrt(1 / n + 1)
    tq = sps.t.ppf(0.95, n - 1)
    for cand, margin in ((0.955, 0.03), (0.955, 0.01), (0.90, 0.03)):
        d = cand - ref.mean()
        r = tost(ref, np.array([cand]), -margin, margin)
        assert r.se == pytest.approx(se) and r.df == n - 1 and r.n_reference == 5
        assert r.interval == pytest.approx((d - tq * se, d + tq * se))
        inside = bool(d - tq * se > -margin and d + tq * se < margin)
        assert r.equivalent is inside
        assert r.p_lower == pytest.approx(1 - sps.t.cdf((d + margin) / se, n - 1))
    assert tost(ref, np.array([0.955]), -0.03, 0.03).equivalent
    assert not tost(ref, np.array([0.955]), -0.01, 0.01).equivalent
    assert not tost(ref, np.array([0.90]), -0.03, 0.03).equivalent


def test_tolerance_factor_matches_published_table() -> None:
    # One-sided normal tolerance factor, n = 10, 90 % coverage, 95 % confidence: 2.355
    # (Odeh & Owen tables; NIST/SEMATECH e-Handbook 7.2.6.3).
    assert tolerance_factor(10, 0.90, 0.95) == pytest.approx(2.355, abs=5e-4)
    # it shrinks towards z_coverage as n grows
    assert tolerance_factor(3, 0.95, 0.9) > tolerance_factor(8, 0.95, 0.9) > \
        tolerance_factor(1000, 0.95, 0.9) > sps.norm.ppf(0.95)


def test_upper_limit_never_below_worst_and_counts_seeds_not_trials() -> None:
    v = np.array([[1.0, 1.2], [0.9, 1.1], [1.4, 1.0]])
    lim, worst = upper_limit(v, 0.95, 0.9, n=3)
    flat = v.ravel()
    k = tolerance_factor(3, 0.95, 0.9)
    assert worst == 1.4 and lim == pytest.approx(max(1.4, flat.mean() + k * flat.std(ddof=1)))
    assert upper_limit(np.zeros(5), 0.95, 0.9) == (0.0, 0.0)


def test_steps_to_target() -> None:
    steps = np.array([0, 10, 20, 30])
    assert steps_to_target(steps, np.array([2.0, 1.0, 0.4, 0.3]), 0.5, "at_most") == 20
    assert steps_to_target(steps, np.array([0.1, np.nan, 0.9, 0.95]), 0.9, "at_least") == 20
    assert steps_to_target(steps, np.array([2.0, 1.0, 0.9, 0.8]), 0.5, "at_most") is None


def test_a_kind_without_a_check_cannot_be_constructed() -> None:
    # Refused when the class is defined (refrun.acceptance.kinds: each kind's model holds
    # its own check), so no criterion of it can ever be constructed.
    with pytest.raises(TypeError, match="check"):
        @dataclass(frozen=True, kw_only=True)
        class Bogus(Criterion):
            KIND: ClassVar[str] = "bogus"


def test_symmetric_limit_by_hand_and_its_miss_rate_against_a_fit_to_abs() -> None:
    from refrun.acceptance.statistics import symmetric_limit, tolerance_factor, upper_limit

    d = np.array([0.010, -0.004, 0.002, -0.012, 0.006])
    k2 = tolerance_factor(5, 1 - 0.01 / 2, 0.9)
    lim, worst = symmetric_limit(d, 0.99, 0.9)
    assert worst == 0.012
    assert lim == pytest.approx(abs(d.mean()) + k2 * d.std(ddof=1))
    # Simulated: 5 held-out signed differences ~ N(0, 1), then one more draw.  The limit
    # fitted to the signed values misses the new |d| about as often as its coverage says;
    # a normal fit to |d| (half-normal) misses it far more often.
    rng = np.random.default_rng(7)
    sims, cov = 4000, 0.99
    draws = rng.normal(size=(sims, 5))
    new = np.abs(rng.normal(size=sims))
    sym = np.array([symmetric_limit(x, cov, 0.9)[0] for x in draws])
    fit_abs = np.array([upper_limit(np.abs(x), cov, 0.9)[0] for x in draws])
    miss_sym, miss_abs = np.mean(new > sym), np.mean(new > fit_abs)
    assert miss_sym <= 1 - cov + 0.005
    assert miss_abs > 2 * miss_sym


def _ar1_line(rng: np.random.Generator, k: int, rho: float, sd: float) -> np.ndarray:
    """A straight line plus stationary AR(1) noise of std ``sd`` (scipy.signal.lfilter)."""
    from scipy.signal import lfilter

    e = rng.normal(0, sd * math.sqrt(1 - rho * rho), k + 200)
    noise = lfilter([1.0], [1.0, -rho], e)[200:]  # 200 burn-in points
    return 0.5 - 0.001 * np.arange(k) + noise


def test_window_mean_error_by_hand() -> None:
    """Issue 52 item 5: a window mean's standard error from the residuals about the
    window's line (scipy.stats.linregress) and the AR(1) correlation matrix summed in
    full (1/k^2 sum_ij rho^|i-j|), not the code's series form; the lag-1 with Kendall's
    bias correction."""
    x = _ar1_line(np.random.default_rng(3), 40, 0.5, 0.02)
    got = window_mean_error(x)
    t = np.arange(40)
    fit = sps.linregress(t, x)
    r = x - (fit.intercept + fit.slope * t)
    sd2 = float(np.sum(r ** 2) / 38)
    r1 = float(np.sum(r[:-1] * r[1:]) / np.sum(r ** 2))
    rho = r1 + (1 + 3 * r1) / 40  # Kendall's (1954) bias correction
    corr = rho ** np.abs(np.subtract.outer(t, t))
    var_mean = sd2 * float(corr.sum()) / 40 ** 2
    assert got.lag1 == pytest.approx(rho, rel=1e-9) and 0 < rho < 1
    assert got.sd == pytest.approx(math.sqrt(sd2), rel=1e-9)
    assert got.se == pytest.approx(math.sqrt(var_mean), rel=1e-9)
    assert got.n_eff == pytest.approx(sd2 / var_mean, rel=1e-9) and got.n_eff < 40
    # A lag-1 that corrects to below 0 is taken as 0: se = sd / sqrt(k).
    w = 1.0 + np.tile([0.1, -0.1], 25)
    e = window_mean_error(w)
    assert e.lag1 == 0.0 and e.se == pytest.approx(e.sd / math.sqrt(50), rel=1e-12)
    assert window_mean_error(np.array([1.0, 2.0])).se == 0.0  # too few points


def test_window_mean_error_matches_the_spread_of_simulated_window_means() -> None:
    """What the estimate is for: over 2000 simulated windows (k = 30, AR(1) 0.6), the
    root-mean-square estimated se is within 15 % of the standard deviation of the window
    means themselves; the white-noise se (sd / sqrt(k)) is under three quarters of it."""
    rng = np.random.default_rng(11)
    xs = [_ar1_line(rng, 30, 0.6, 0.05) for _ in range(2000)]
    true_sd = float(np.std([x.mean() for x in xs], ddof=1))
    est = math.sqrt(float(np.mean([window_mean_error(x).se ** 2 for x in xs])))
    naive = math.sqrt(float(np.mean([window_mean_error(x).sd ** 2 for x in xs])) / 30)
    assert est == pytest.approx(true_sd, rel=0.15), (est, true_sd)
    assert naive < 0.75 * true_sd


def test_window_mean_prediction_by_hand() -> None:
    """sqrt((1 + 1/N)(t^2 tau^2 + z^2 se^2)), tau^2 = max(0, s^2 - mean se^2): quantiles
    from scipy.stats; with no sampling error it is the textbook prediction interval
    (Hahn, Meeker & Escobar eq. 4.7: t_{1-a/2,N-1} s sqrt(1 + 1/N))."""
    means = np.array([1.00, 1.02, 0.99, 1.01, 1.03])
    ses = np.array([0.004, 0.005, 0.003, 0.004, 0.006])
    t = sps.t.ppf(0.975, 4)
    z = sps.norm.ppf(0.975)
    s2 = float(np.var(means, ddof=1))
    se2 = float(np.mean(ses ** 2))
    want = math.sqrt(1.2 * (t ** 2 * (s2 - se2) + z ** 2 * se2))
    assert window_mean_prediction(means, ses, 0.95) == pytest.approx(want, rel=1e-12)
    assert window_mean_prediction(means, np.zeros(5), 0.95) == pytest.approx(
        t * math.sqrt(s2) * math.sqrt(1.2), rel=1e-12)
    # Unlucky seeds: means closer together than their windows' own noise allows.
    close = np.array([1.0, 1.0001, 0.9999, 1.0, 1.0])
    big = np.full(5, 0.01)
    assert window_mean_prediction(close, big, 0.95) == pytest.approx(
        z * 0.01 * math.sqrt(1.2), rel=1e-12)
    with pytest.raises(ValueError):
        window_mean_prediction(np.array([1.0]), np.array([0.1]), 0.95)


def test_window_mean_prediction_covers_one_more_seed() -> None:
    """Simulated: 5 references and one more seed per trial, each window mean = seed level
    (sd 0.01) + a window of 20 white-noise points (sd 0.05, so se 0.011), se estimated
    from each window.  Over 3000 trials the 95 % bound holds one more seed's difference in
    93-97.5 % of them, as the textbook interval from the 5 means alone does (t s
    sqrt(1 + 1/N), exact on average); on the unluckiest tenth of the reference sets (the
    smallest spread of their means: issue 52's "5 references whose final-window std is a
    third of the population's") it still holds in >= 85 %, where the textbook one holds
    in under 80 %."""
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(3000):
        wins = 0.01 * rng.normal(size=(6, 1)) + rng.normal(0, 0.05, (6, 20))
        means = wins.mean(1)
        ses = np.array([window_mean_error(w).se for w in wins[:5]])
        d = abs(means[5] - means[:5].mean())
        s = float(np.std(means[:5], ddof=1))
        rows.append((s, d <= window_mean_prediction(means[:5], ses, 0.95),
                     d <= sps.t.ppf(0.975, 4) * s * math.sqrt(1.2)))
    a = np.array(rows, dtype=float)
    assert 0.93 <= a[:, 1].mean() <= 0.975, a[:, 1].mean()
    unlucky = a[a[:, 0] <= np.quantile(a[:, 0], 0.1)]
    assert unlucky[:, 1].mean() >= 0.85, unlucky[:, 1].mean()
    assert unlucky[:, 2].mean() < 0.8, unlucky[:, 2].mean()
