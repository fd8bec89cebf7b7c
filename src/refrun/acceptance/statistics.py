"""Statistical tests of the acceptance criteria, as pure functions on arrays (scipy).

* :func:`tost`: equivalence of a one-point metric by two one-sided t-tests (Schuirmann
  1987), with the (1 - 2 alpha) confidence interval of the difference;
* :func:`mlperf_limits`: MLPerf Training's rule for reference convergence points
  (olympic mean of the reference runs, one-sided Student t-test at alpha = 0.05);
* :func:`tolerance_factor`: the one-sided normal tolerance factor (noncentral t) that
  inflates small-N held-out spreads in :mod:`refrun.acceptance.calibration`;
* :func:`prediction_z`: the Student-t prediction bound of one new seed's standardised
  distance from a group's mean (caps the calibrated width of a per-step envelope);
* :func:`need_quantile`: the same seed's *need* over many steps under a heavy-tailed
  AR(1) model with run-long seed levels and scales, by Monte Carlo (a per-step
  envelope's width); :func:`ar1` and :func:`unit_draws` are its pieces,
  :func:`ar1_mean_variance` and :func:`log_mad_null` the moments its seed effects are
  estimated with;
* :func:`window_mean_error` and :func:`window_mean_prediction`: a final window mean's own
  sampling error (AR(1) effective sample size) and the prediction bound of one more
  seed's window mean from N references (calibrate's final-window tolerance floor).

No function here reads a run; the checks and the calibration pass arrays in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np


def _scipy_stats() -> ModuleType:
    """``scipy.stats``, imported on first use: it costs about a second of start-up and
    most commands (``refrun accept`` without a statistical criterion) never need it."""
    from scipy import stats

    return stats


@dataclass(frozen=True)
class Tost:
    """Two one-sided tests of ``low < mean(candidate) - mean(reference) < high``."""

    diff: float  # mean(candidate) - mean(reference)
    se: float  # standard error of diff
    df: float  # degrees of freedom of the t distribution
    low: float  # equivalence margin, lower bound of the difference
    high: float  # equivalence margin, upper bound
    p_lower: float  # H0: diff <= low
    p_upper: float  # H0: diff >= high
    p: float  # max(p_lower, p_upper): equivalence when p < alpha
    alpha: float
    interval: tuple[float, float]  # (1 - 2 alpha) confidence interval of diff
    n_reference: int
    n_candidate: int

    @property
    def equivalent(self) -> bool:
        return self.p < self.alpha


def tost(reference: np.ndarray, candidate: np.ndarray, low: float, high: float,
         alpha: float = 0.05) -> Tost:
    """Two one-sided t-tests (TOST) for ``low < mean(cand) - mean(ref) < high``.

    Args:
        reference: values of the reference seeds (at least 2).
        candidate: values of the candidate run(s) (at least 1).
        low, high: the declared equivalence margins of the difference (``low < high``).
        alpha: level of each one-sided test.

    Returns:
        :class:`Tost`.  With n_c >= 2 candidates: pooled-variance two-sample t (Student),
        ``se = s_p sqrt(1/n_r + 1/n_c)``, ``df = n_r + n_c - 2``.  With one candidate its
        variance is taken as the reference seeds' (the candidate is one more draw):
        ``se = s_r sqrt(1/n_r + 1)``, ``df = n_r - 1``.  ``t_L = (d - low)/se``,
        ``p_L = 1 - F_t(t_L)``; ``t_U = (d - high)/se``, ``p_U = F_t(t_U)``; equivalence
        iff ``max(p_L, p_U) < alpha``, i.e. iff the (1 - 2 alpha) interval
        ``d +- t_{1-alpha,df} se`` lies inside (low, high) (Schuirmann, J. Pharmacokin.
        Biopharm. 15:657, 1987).
    """
    r = np.asarray(reference, dtype=float)
    c = np.asarray(candidate, dtype=float)
    nr, nc = len(r), len(c)
    if nr < 2 or nc < 1:
        raise ValueError(f"tost needs >= 2 reference and >= 1 candidate values, got {nr}, {nc}")
    d = float(c.mean() - r.mean())
    if nc >= 2:
        df = nr + nc - 2
        sp2 = ((nr - 1) * r.var(ddof=1) + (nc - 1) * c.var(ddof=1)) / df
        se = math.sqrt(sp2 * (1 / nr + 1 / nc))
    else:
        df = nr - 1
        se = float(r.std(ddof=1)) * math.sqrt(1 / nr + 1)
    if se == 0:
        inside = low < d < high
        p_l = p_u = 0.0 if inside else 1.0
        return Tost(d, 0.0, df, low, high, p_l, p_u, max(p_l, p_u), alpha, (d, d), nr, nc)
    t_l, t_u = (d - low) / se, (d - high) / se
    p_l, p_u = float(_scipy_stats().t.sf(t_l, df)), float(_scipy_stats().t.cdf(t_u, df))
    half = float(_scipy_stats().t.ppf(1 - alpha, df)) * se
    return Tost(d, se, df, low, high, p_l, p_u, max(p_l, p_u), alpha, (d - half, d + half),
                nr, nc)


def olympic(values: np.ndarray) -> np.ndarray:
    """The values without one minimum and one maximum (MLPerf's olympic scoring);
    needs at least 3 values."""
    v = np.sort(np.asarray(values, dtype=float))
    if len(v) < 3:
        raise ValueError(f"olympic scoring needs >= 3 values, got {len(v)}")
    return v[1:-1]


@dataclass(frozen=True)
class ConvergenceLimits:
    """Reference convergence point (RCP) statistics and the acceptable candidate means."""

    rcp_mean: float  # olympic mean of the reference runs' steps-to-target
    rcp_std: float  # population std (ddof=0) of the olympic values, as MLPerf
    n_reference: int  # reference values after olympic scoring
    n_candidate: int  # candidate values the mean rests on
    alpha: float
    min_acceptable_mean: float  # faster than this: significantly faster than the RCP
    max_acceptable_mean: float  # slower than this: significantly slower
    max_speedup: float  # rcp_mean / min_acceptable_mean (MLPerf's "max speedup")

    @property
    def interval(self) -> tuple[float, float]:
        return self.min_acceptable_mean, self.max_acceptable_mean


def mlperf_limits(reference: np.ndarray, n_candidate: int = 1,
                  alpha: float = 0.05) -> ConvergenceLimits:
    """MLPerf Training's reference-convergence-point rule.

    Args:
        reference: steps (or samples, epochs) to reach the target of each reference run
            (at least 3; the smallest and largest are dropped: olympic scoring).
        n_candidate: how many candidate values the candidate's mean will rest on.
        alpha: level of the one-sided Student t-test (MLPerf: 0.05).

    Returns:
        :class:`ConvergenceLimits`.  With the olympic values' mean ``m`` and population
        std ``s`` (``numpy.std``, as the MLPerf RCP checker), the smallest candidate mean
        a one-sided pooled two-sample t-test (equal variances, ``df = n_r + n_c - 2``) does
        not find significantly smaller than ``m`` is
        ``m - t_{1-alpha,df} s sqrt(1/n_r + 1/n_c)`` (the value MLPerf's checker finds by
        bisection); the upper limit is its mirror image.  MLPerf Training rules, section
        "Reference Convergence Points": points [16,14,16,17,16,16,15,16,15,16] with 5
        submission runs (3 after olympic scoring) give mean 15.75, std 0.43, minimum
        acceptable mean 15.21, maximum speed-up 3.53 %.
    """
    o = olympic(reference)
    n_r = len(o)
    m, s = float(o.mean()), float(o.std())
    if s == 0:
        lo = hi = m
    else:
        half = float(_scipy_stats().t.ppf(1 - alpha, n_r + n_candidate - 2)) * s * \
            math.sqrt(1 / n_r + 1 / n_candidate)
        lo, hi = m - half, m + half
    return ConvergenceLimits(m, s, n_r, n_candidate, alpha, lo, hi,
                             m / lo if lo > 0 else math.inf)


def steps_to_target(steps: np.ndarray, values: np.ndarray, target: float,
                    direction: str) -> int | None:
    """First step at which ``values`` reaches ``target`` (``direction`` 'at_least':
    value >= target, 'at_most': value <= target); None when never reached."""
    v = np.asarray(values, dtype=float)
    hit = v >= target if direction == "at_least" else v <= target
    hit &= np.isfinite(v)
    idx = np.flatnonzero(hit)
    return int(np.asarray(steps)[idx[0]]) if len(idx) else None


def tolerance_factor(n: int, coverage: float, confidence: float) -> float:
    """One-sided normal tolerance factor k: with n draws of mean ``x`` and std ``s``
    (ddof=1), ``x + k s`` exceeds the ``coverage`` quantile of the population with
    probability ``confidence``.  ``k = t'_{confidence}(n-1, z_coverage sqrt(n)) / sqrt(n)``
    (noncentral t; Natrella, NBS Handbook 91, 1963, section 2-5; NIST/SEMATECH
    e-Handbook 7.2.6.3).  n >= 2."""
    if n < 2:
        raise ValueError(f"a tolerance factor needs n >= 2, got {n}")
    nc = float(_scipy_stats().norm.ppf(coverage)) * math.sqrt(n)
    return float(_scipy_stats().nct.ppf(confidence, n - 1, nc)) / math.sqrt(n)


def upper_limit(values: np.ndarray, coverage: float, confidence: float,
                n: int | None = None) -> tuple[float, float]:
    """``(limit, worst)``: an upper limit for one more draw of ``values``:
    ``max(worst, mean + k s)`` (s with ddof=1) with k from :func:`tolerance_factor` for
    ``n`` independent draws (default ``len(values)``; held-out trials that share seeds
    count as the number of seeds); never below the worst observed value."""
    v = np.asarray(values, dtype=float).ravel()
    worst = float(v.max())
    if len(v) < 2 or float(v.std(ddof=1)) == 0.0:
        return worst, worst
    k = tolerance_factor(min(n or len(v), len(v)), coverage, confidence)
    return max(worst, float(v.mean() + k * v.std(ddof=1))), worst


def symmetric_limit(values: np.ndarray, coverage: float, confidence: float,
                    n: int | None = None) -> tuple[float, float]:
    """``(limit, worst)``: an upper limit for ``|d|`` of one more draw of a *signed*
    difference ``d`` (a held-out seed's difference from its reference group).

    ``max(max|d|, |mean d| + k2 s)`` with ``s`` the std of the signed values (ddof=1) and
    ``k2`` the one-sided factor of :func:`tolerance_factor` at coverage
    ``1 - (1 - coverage) / 2`` (both tails).  Fitting a normal to the signed differences
    instead of to ``|d|`` matters with few seeds: ``|d|`` is half-normal, whose spread a
    normal fit to it under-states (for ``|Z|``: sd 0.60 vs 1.0 for ``Z``), so limits taken
    on ``|d|`` reject held-out seeds more often than the target rate.
    """
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    worst = float(np.abs(v).max())
    if len(v) < 2 or float(v.std(ddof=1)) == 0.0:
        return worst, worst
    k2 = tolerance_factor(min(n or len(v), len(v)), 1.0 - (1.0 - coverage) / 2.0, confidence)
    return max(worst, abs(float(v.mean())) + k2 * float(v.std(ddof=1))), worst



def prediction_z(group_size: int, coverage: float) -> float:
    """Two-sided prediction bound of ``|x - mean| / s`` for one new draw ``x``.

    ``mean`` and ``s`` (ddof=1) are those of a group of ``group_size`` = g independent
    draws of the same normal distribution as ``x``; then
    ``(x - mean) / (s sqrt(1 + 1/g))`` is Student t with g - 1 degrees of freedom, so
    ``P(|x - mean| / s > sqrt(1 + 1/g) t_{1-a/2, g-1}) = a`` exactly, ``a = 1 - coverage``
    (the normal prediction interval for one future observation: Hahn, Meeker & Escobar,
    *Statistical Intervals*, 2nd ed., Wiley 2017, eq. 4.7; NIST/SEMATECH e-Handbook
    7.1.4 "prediction interval").  It depends on no estimated spread, so it holds with
    few seeds where a tolerance limit fitted to a handful of held-out values explodes.
    g >= 2."""
    if group_size < 2:
        raise ValueError(f"a prediction bound needs a group of >= 2, got {group_size}")
    a = 1.0 - coverage
    return math.sqrt(1.0 + 1.0 / group_size) * float(_scipy_stats().t.ppf(1.0 - a / 2.0,
                                                                 group_size - 1))


NEED_MAX_STEPS = 200  # steps simulated at most (fewer steps: a wider, conservative quantile)


def ar1(u: np.ndarray, lag: float) -> np.ndarray:
    """A stationary AR(1) series along the last axis of innovations ``u``:
    ``e_0 = u_0``, ``e_t = lag e_{t-1} + sqrt(1 - lag^2) u_t``, so that ``Var e_t = Var u``
    at every t and ``corr(e_t, e_{t+k}) = lag^k`` (Box, Jenkins & Reinsel, *Time Series
    Analysis*, 4th ed., Wiley 2008, sec. 3.2.4).  ``0 <= lag < 1``."""
    e = np.empty_like(u)
    e[..., 0] = u[..., 0]
    c = math.sqrt(1 - lag * lag)
    for t in range(1, u.shape[-1]):
        e[..., t] = lag * e[..., t - 1] + c * u[..., t]
    return e


def unit_draws(rng: np.random.Generator, tail_df: float | None, shape: tuple[int, ...]
               ) -> np.ndarray:
    """Draws of unit variance: standard normal (``tail_df`` None) or Student t with
    ``tail_df`` > 2 degrees of freedom divided by its sd ``sqrt(df / (df - 2))``."""
    if not tail_df:
        return rng.standard_normal(shape)
    return rng.standard_t(tail_df, shape) / math.sqrt(tail_df / (tail_df - 2))


def need_quantile(group_size: int, n_steps: int, lag1: float, fraction: float,
                  coverage: float, tail_df: float | None, level: float = 0.0,
                  scale_sd: float = 0.0) -> float:
    """The ``coverage`` quantile of a new seed's *need* against a new group, by Monte Carlo.

    The need of a seed is the ``fraction`` quantile over the steps of
    ``z_t = |x_t - mean_t| / s_t`` (mean and s, ddof=1, of a group of ``g`` =
    ``group_size`` other seeds at step t): the smallest envelope width ``k`` that keeps the
    seed inside mean +- k s at ``fraction`` of the steps.  Model: the g + 1 seeds are
    independent; seed i's deviation from the common curve is

        d_it = sqrt(level) L_i + sqrt(1 - level) exp(scale_sd w_i) e_it

    * ``e_it``: a stationary AR(1) series over the steps (:func:`ar1` at ``lag1``) with
      innovations of unit variance, Student t with ``tail_df`` degrees of freedom
      (``None``: normal).  Heavy tails matter: gradient norms and losses spike, and 5
      seeds rarely show a spike that 20 more seeds do;
    * ``L_i``: a run-long level of the seed (unit variance, the same tails): seeds differ
      persistently (a seed's initial weights and data order shift its whole curve), which
      an AR(1) at the lag-1 autocorrelation does not reproduce: measured on three
      workloads, the variance of a seed's time-mean deviation was 3-30x the AR(1)'s;
    * ``exp(scale_sd w_i)``, ``w_i`` standard normal: a seed's own scale (some seeds'
      curves are noisier throughout).

    Unlike the held-out seeds' needs, this accounts for the *group's* randomness (a group
    of g seeds that happens to be tight makes every candidate need more), which
    leave-one-out trials, sharing g - 1 of their g members, under-state.

    ``n_steps`` is capped at :data:`NEED_MAX_STEPS` (the need's spread shrinks with more
    steps, so the cap only widens); ``lag1`` is rounded up to a multiple of 0.05 and
    capped at 0.95 (a fully persistent deviation is the prediction bound's case,
    :func:`prediction_z`); ``level`` (capped at 0.9) and ``scale_sd`` (capped at 1) are
    rounded up to multiples of 0.05.  Deterministic (seeded) and cached: calibration is
    repeatable, and with no level and no scale the draws are those of the AR(1) alone.
    """
    def up(x: float, cap: float) -> float:
        return min(cap, math.ceil(max(0.0, x) * 20 - 1e-9) / 20)

    return _need_quantile(group_size, min(n_steps, NEED_MAX_STEPS), up(lag1, 0.95), fraction,
                          round(coverage, 9), tail_df, up(level, 0.9), up(scale_sd, 1.0))


@functools.lru_cache(maxsize=256)
def _need_quantile(g: int, steps: int, lag: float, fraction: float, coverage: float,
                   tail_df: float | None, level: float, scale_sd: float) -> float:
    rng = np.random.default_rng(0)
    trials = int(min(20_000, max(2_000, math.ceil(20 / max(1e-9, 1 - coverage)))))
    idx = max(0, math.ceil(fraction * steps - 1e-9) - 1)
    needs = []
    for start in range(0, trials, 2_000):
        m = min(2_000, trials - start)
        e = ar1(unit_draws(rng, tail_df, (m, g + 1, steps)), lag)
        if scale_sd:
            e *= np.exp(scale_sd * rng.standard_normal((m, g + 1, 1)))
        if level:
            e = (math.sqrt(level) * unit_draws(rng, tail_df, (m, g + 1, 1))
                 + math.sqrt(1 - level) * e)
        grp, x = e[:, :g], e[:, g]
        z = np.abs(x - grp.mean(1)) / grp.std(1, ddof=1)
        needs.append(np.sort(z, axis=1)[:, idx])
    return float(np.quantile(np.concatenate(needs), coverage))


def ar1_mean_variance(n: int, lag: float) -> float:
    """Variance of the mean of ``n`` consecutive values of a stationary AR(1) series of
    unit variance: ``(1/n) [1 + 2 sum_{k=1}^{n-1} (1 - k/n) lag^k]`` (Box, Jenkins &
    Reinsel, *Time Series Analysis*, 4th ed., eq. 2.1.13 with ``rho_k = lag^k``)."""
    k = np.arange(1, n)
    return float((1 + 2 * np.sum((1 - k / n) * lag ** k)) / n)


@functools.lru_cache(maxsize=64)
def log_mad_null(n: int, steps: int, lag: float) -> float:
    """The null of a seed-scale estimate: the mean over 400 simulations of the variance
    (ddof=1) of ``log MAD_i`` over ``n`` seeds, ``MAD_i`` the median absolute deviation
    of seed i's ``r_it`` from its own median over ``steps`` steps, where ``r_it`` are
    AR(1) deviations (:func:`ar1` at ``lag``; Student t(3) innovations, the envelope's
    default tails) with no seed scale, standardised over the seeds at every step.
    Seeded and cached."""
    rng = np.random.default_rng(1)
    d = ar1(unit_draws(rng, 3.0, (400, n, steps)), min(lag, 0.95))
    r = (d - d.mean(1, keepdims=True)) / d.std(1, ddof=1, keepdims=True)
    mad = np.median(np.abs(r - np.median(r, axis=2, keepdims=True)), axis=2)
    return float(np.mean(np.var(np.log(mad), axis=1, ddof=1)))


# The lag-1 autocorrelation of a window's residuals is clamped to [0, WINDOW_MAX_LAG]: a
# negative one would shrink the standard error below the white-noise one (an
# over-differenced estimate, not a property to bank on), and at 1 the AR(1) variance has no
# finite effective sample size.
WINDOW_MAX_LAG = 0.95


@dataclass(frozen=True)
class WindowMeanError:
    """The sampling error of one run's window mean (:func:`window_mean_error`)."""

    se: float  # standard error of the window mean
    sd: float  # per-point scatter about the window's straight-line trend
    lag1: float  # lag-1 autocorrelation of that scatter (clamped to [0, WINDOW_MAX_LAG])
    n_eff: float  # effective number of independent points: sd^2 / se^2
    points: int


def window_mean_error(values: np.ndarray) -> WindowMeanError:
    """The standard error of the mean of ``values`` (one run's final window), as a
    stationary AR(1) series about a straight line.

    The window's least-squares line is removed (a loss still falls over its final window:
    the trend is the run's, not noise), leaving residuals ``r`` of ``k`` points with
    ``sd^2 = sum r^2 / (k - 2)`` and lag-1 autocorrelation ``rho = r1 + (1 + 3 r1) / k``,
    ``r1 = sum r_t r_{t+1} / sum r_t^2`` (the sample lag-1 of a short series is biased
    low by about ``(1 + 3 rho) / k``: Kendall, Biometrika 41:403, 1954), clamped to
    [0, :data:`WINDOW_MAX_LAG`].  The variance of the mean of
    ``k`` consecutive values of an AR(1) series is ``sd^2 (1/k)[1 + 2 sum_{j=1}^{k-1}
    (1 - j/k) rho^j]`` (:func:`ar1_mean_variance`; Box, Jenkins & Reinsel, *Time Series
    Analysis*, 4th ed., eq. 2.1.13), i.e. ``sd^2 / n_eff``: a smoothed metric (a running
    mean, momentum) has far fewer independent points than logged ones (von Storch &
    Zwiers, *Statistical Analysis in Climate Research*, 1999, section 6.6.7 "equivalent
    sample size").  Simulated (2000 windows), the estimate is within 10 % of the true
    spread of window means for k >= 30 at rho <= 0.6 and errs low for short, strongly
    autocorrelated windows (k = 20, rho = 0.8: 0.6 of it), where the removed line takes
    some of the slow noise.  Fewer than 3 finite points: no estimate (se 0)."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    k = len(x)
    if k < 3:
        return WindowMeanError(0.0, 0.0, 0.0, float(k), k)
    t = np.arange(k, dtype=float)
    slope, icept = np.polyfit(t, x, 1)
    r = x - (slope * t + icept)
    ss = float(np.sum(r * r))
    if ss <= 0:
        return WindowMeanError(0.0, 0.0, 0.0, float(k), k)
    sd = math.sqrt(ss / (k - 2))
    r1 = float(np.sum(r[:-1] * r[1:]) / ss)
    lag = min(WINDOW_MAX_LAG, max(0.0, r1 + (1 + 3 * r1) / k))
    v = ar1_mean_variance(k, lag)
    return WindowMeanError(sd * math.sqrt(v), sd, lag, 1.0 / v, k)


def window_mean_prediction(means: np.ndarray, ses: np.ndarray, coverage: float) -> float:
    """Half-width of a two-sided prediction bound, at ``coverage``, for ``d`` = one new
    run's window mean minus the mean of the ``N`` reference runs' window ``means`` (each
    with its sampling standard error ``ses``, :func:`window_mean_error`).

    Model: a run's window mean is ``mu + b + e``, ``b`` its seed's level (variance
    ``tau^2``), ``e`` the window's sampling error (variance ``se^2``, the references'
    mean ``se^2``; the new run logs like them).  Then ``Var d = (1 + 1/N)(tau^2 + se^2)``.
    The sample variance ``s^2`` (ddof 1) of the ``N`` means estimates ``tau^2 + se^2``
    with ``N - 1`` degrees of freedom; ``se^2`` is estimated from every logged point of
    every reference (many degrees of freedom).  So the between-seed part
    ``tau^2 = max(0, s^2 - se^2)`` is taken at Student's ``t_{1-a/2, N-1}`` (the normal
    prediction interval for one future observation: Hahn, Meeker & Escobar, *Statistical
    Intervals*, 2nd ed., 2017, eq. 4.7) and the sampling part at the normal
    ``z_{1-a/2}``, added in quadrature:
    ``sqrt((1 + 1/N)(t^2 tau^2 + z^2 se^2))``, ``a = 1 - coverage``.  With no sampling
    error it is eq. 4.7 itself (``t s sqrt(1 + 1/N)``); with references whose means
    agree better than their own windows' noise allows (unlucky seeds: ``s^2 < se^2``) it
    is still ``z se sqrt(1 + 1/N)``.  N >= 2."""
    m = np.asarray(means, dtype=float)
    n = len(m)
    if n < 2:
        raise ValueError(f"a prediction bound needs >= 2 references, got {n}")
    a = 1.0 - coverage
    st = _scipy_stats()
    se2 = float(np.mean(np.asarray(ses, dtype=float) ** 2))
    tau2 = max(0.0, float(np.var(m, ddof=1)) - se2)
    t = float(st.t.ppf(1.0 - a / 2.0, n - 1))
    z = float(st.norm.ppf(1.0 - a / 2.0))
    return math.sqrt((1.0 + 1.0 / n) * (t * t * tau2 + z * z * se2))


def point_prediction(s: float, se: float, group: int, coverage: float) -> float:
    """Half-width of a two-sided prediction bound, at ``coverage``, for one new run's
    single value (a final evaluation, a test accuracy) minus the mean of ``group``
    references' values, when each value carries a known sampling error ``se`` beside the
    seeds' spread.

    :func:`window_mean_prediction` for a window of one point: a run's value is
    ``mu + b + e``, ``b`` its seed's level (variance ``tau^2``), ``e`` the value's own
    sampling error (variance ``se^2``, known from outside the N values: a proportion's
    binomial error, :func:`proportion_error`).  ``s`` (the seeds' std, ddof=1) estimates
    ``tau^2 + se^2`` with ``group - 1`` degrees of freedom, so the between-seed part
    ``tau^2 = max(0, s^2 - se^2)`` is taken at Student's ``t_{1-a/2, group-1}`` and the
    sampling part at the normal ``z_{1-a/2}``:
    ``sqrt((1 + 1/group)(t^2 tau^2 + z^2 se^2))``, ``a = 1 - coverage``; and never below
    :func:`prediction_z` ``* s`` (Hahn, Meeker & Escobar eq. 4.7, the bound on the seeds'
    spread alone, which it is when ``se = 0``): a known sampling error only ever widens
    the bound.  With references that agree more closely than their own sampling error
    allows (``s < se``) it is still ``z se sqrt(1 + 1/group)``.  group >= 2."""
    if group < 2:
        raise ValueError(f"a prediction bound needs a group of >= 2, got {group}")
    a = 1.0 - coverage
    st = _scipy_stats()
    tau2 = max(0.0, s * s - se * se)
    t = float(st.t.ppf(1.0 - a / 2.0, group - 1))
    z = float(st.norm.ppf(1.0 - a / 2.0))
    return math.sqrt(1.0 + 1.0 / group) * max(t * s, math.sqrt(t * t * tau2 + z * z * se * se))


# A proportion's denominator is searched up to this many times the one its smallest gap
# implies (a gap of m/n between the closest two values when no two differ by one example).
PROPORTION_MAX_GAP_MULTIPLE = 64
PROPORTION_MAX_N = 10_000_000
FLOAT32_REL = 2.0 ** -23  # a value logged as float32 is within this of k/n, relatively


def proportion_size(values: np.ndarray, resolution: float) -> int | None:
    """The number of examples ``n`` behind a metric that is a proportion (an accuracy
    over a finite evaluation set), read from its values; None when they are not one.

    Every value of a proportion over n examples is ``k/n``: the values lie in [0, 1] and,
    times n, on integers (to float32 rounding, ``|v n - round(v n)| <= 2^-23 v n + 1e-9``).
    The gaps between values are multiples of ``1/n``, so ``n >= 1/resolution`` (the
    smallest gap, :func:`refrun.acceptance.calibration.derive.resolution_of`): ``n`` is the
    smallest integer from about ``1/resolution`` (less the gap's own float32 rounding)
    up to 64 times it on which every value lies.  A smaller lattice than the true one
    (every count even, say) gives a larger binomial error, a wider band: the error is on
    the side of no false alarm.  None with
    fewer than 2 distinct values, a value outside [0, 1], or no lattice found (a
    continuous metric)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(np.unique(v)) < 2 or resolution <= 0 or v.min() < 0 or v.max() > 1:
        return None
    # the gap itself carries the values' float32 rounding: relatively 2^-23 / resolution
    start = max(1, math.floor(1.0 / resolution * (1.0 - 1e-3 - 4 * FLOAT32_REL / resolution)))
    stop = min(PROPORTION_MAX_N, start * PROPORTION_MAX_GAP_MULTIPLE)
    u = np.unique(v)
    probe = u[np.linspace(0, len(u) - 1, min(len(u), 8)).astype(int)]  # a few, to sieve
    for lo in range(start, stop + 1, 8192):
        n = np.arange(lo, min(stop, lo + 8191) + 1, dtype=float)
        for cand in n[_on_lattice(probe, n)]:
            if _on_lattice(u, np.array([cand]))[0]:
                return int(cand)
    return None


def _on_lattice(values: np.ndarray, n: np.ndarray) -> np.ndarray:
    """For each ``n``: whether every value times ``n`` is an integer to float32 rounding."""
    x = values[None, :] * n[:, None]
    return np.all(np.abs(x - np.round(x)) <= FLOAT32_REL * x + 1e-9, axis=1)


def proportion_error(values: np.ndarray, n: int | None) -> float:
    """Binomial standard error of one proportion over ``n`` examples at the mean of
    ``values``: ``sqrt(p (1 - p) / n)`` (0 when ``n`` is None).  For a fixed evaluation
    set it bounds the seed-to-seed spread that evaluation sampling alone adds when the
    seeds' errors on different examples are independent (``mean p_j (1 - p_j) <= p (1 -
    p)`` over examples j), and it is exactly the error of a run evaluated on another draw
    of n examples (a port that shards or shuffles its evaluation set differently)."""
    if n is None:
        return 0.0
    p = float(np.mean(np.asarray(values, dtype=float)))
    return math.sqrt(max(0.0, p * (1.0 - p)) / n)
