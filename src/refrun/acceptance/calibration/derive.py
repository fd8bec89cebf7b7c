"""Deriving thresholds: pure functions from the reference seeds' data to frozen results
(:class:`Calibrated`, one :class:`Derived` per criterion); nothing here reads a store or
writes a file (:mod:`.render` writes the file, :mod:`.check` re-checks one).

The method is described in :mod:`refrun.acceptance.calibration`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun import identity, schema
from refrun.acceptance import paired as pairs
from refrun.acceptance import runview as rv
from refrun.acceptance.calibration import evaluation
from refrun.acceptance.calibration.goals import PerformanceGoal, parse_performance_goal
from refrun.acceptance.calibration.render import clean_float, render
from refrun.acceptance.contention import run_median
from refrun.acceptance.criteria import CriteriaSettings, Prices
from refrun.acceptance.kinds.best_of import BEST_OF_REL_TOL, best_index, reports
from refrun.acceptance.kinds.quantile import run_quantile
from refrun.acceptance.statistics import (
    NEED_MAX_STEPS,
    ar1_mean_variance,
    log_mad_null,
    need_quantile,
    point_prediction,
    prediction_z,
    proportion_error,
    proportion_size,
    symmetric_limit,
    tost,
    upper_limit,
    window_mean_error,
    window_mean_prediction,
)
from refrun.comparison import RunData, warmup_end
from refrun.comparison.divergence import is_parameter_metric
from refrun.comparison.measures import final_window_size
from refrun.errors import RefrunInputError
from refrun.pairing import declares_pair

MIN_RUNS = 3
# Backends whose refrun probe records each integrity counter (docs/{jax,xla}.md): a
# criterion on evidence only these record is scoped to them.
# Host syncs: torch_xla (``.item()``-style) and JAX (host reads of jax.Arrays in the step,
# refrun.probes.host_reads); PyTorch records them only on CUDA, so it joins the scope only
# when the references themselves record them.  Device-to-host copies: torch_xla.
RECORDED_BY: dict[str, tuple[str, ...]] = {
    schema.M_COMPILE_GRAPHS: ("jax", "torch_xla"),
    schema.M_HOST_SYNCS: ("jax", "torch_xla"),
    schema.M_XFER_D2H: ("torch_xla",),
    schema.TAG_FALLBACK_OPS: ("torch_xla",),
}
# Structural defaults (no reference evidence): a steady loop compiles nothing new, but a
# program run for the first time after warm-up (validation and test evaluation, a
# checkpoint copy, a final evaluation) compiles once; a recompilation per step exceeds
# this within a few steps.  A host sync (or a device-to-host copy) inside the step adds 1
# per step: half a transfer per step separates "none" from "one per step" whatever the
# step count.  Both are counted inside the step only (the probes' step scope), so
# evaluation between steps, at whatever cadence, adds nothing.
STRUCTURAL_MAX_COMPILATIONS = 4
# Compilation warm-up is counted in calls of the step, not as a fraction of the run: a
# step function compiles on its first call and, under XLA, once more on its second (when
# the optimizer state and donated buffers first exist), whatever the run's length.  A
# fractional warm-up (10 % of 600 steps) hid a recompilation storm that ended by step 16.
COMPILE_WARMUP_CALLS = 2
STRUCTURAL_SYNCS_PER_STEP = 0.5
# Step time: medians of identical runs on a shared machine varied by 1.0-1.6x (issue 21's
# measurement on the 2-core machine); N back-to-back reference runs do not show it.  1.5
# still catches a step twice as slow; what a busy machine adds beyond it is not judged
# rather than failed (the contention rules, refrun.acceptance.kinds.step_time), which is
# why the floor need not cover all of it.  On dedicated hardware, lower it with
# --step-time-floor.
STEP_TIME_FLOOR = 1.5
# ... and the ratio judged is that of the fastest 5 % of the steady steps: two CPU-spinning
# processes beside a 4.5 ms step on the loaded 2-core machine raised
# its median 3-5x, its 10 % quantile 1.1-2.2x and its 5 % quantile 1.0x (Python's timeit
# documentation: higher values are "typically ... other processes interfering").
STEP_TIME_LOW_QUANTILE = 0.05
# The slowdown a step-time criterion exists to catch (issue 21: "a candidate twice as slow
# per step was not caught"): a calibrated max_ratio at or above it cannot, and calibrate
# says so (step_time_note) instead of writing it silently.
STEP_TIME_SLOW = 2.0
# TOST equivalence of a one-value quantity is written when each group has at least this
# many references: with one candidate the interval is t_{1-alpha, g-1} wide, and at g = 2
# (t = 6.3) it says nothing a min-max envelope does not.
TOST_MIN_GROUP = 3
TOST_ALPHA = 0.05
NO_CONVERGENCE = ("no convergence (MLPerf steps-to-target) criterion written: steps to a "
                  "target are counted at evaluation points, so a candidate evaluating at "
                  "another cadence would be judged by its cadence, and the target is the "
                  "project's to declare; add one by hand (kind = \"convergence\") when the "
                  "candidates evaluate at the references' cadence")
# Run-level quantiles of each per-step training metric (kind ``quantile``): written from
# this many reference seeds on.  Their range criterion is floored by the Student-t
# prediction bound of one new seed with g - 1 degrees of freedom at the Bonferroni
# coverage (range_tol_floor): at coverage 0.9992 that is t_{0.9996,3} = 13.9 for 5 seeds
# (groups of 4), so a run-level value would detect only shifts of more than ten seed
# standard deviations, adding criteria without power; for 10 seeds t_{0.9996,8} = 5.2.
# See docs/acceptance.md, "Run-level quantiles".
QUANTILE_MIN_RUNS = 10
RUN_QUANTILES = (0.5, 0.9)  # location and upper tail of a metric over the run
QUANTILE_MIN_POINTS = 20  # and at least half the points the references share
SKIP_PREFIXES = (schema.SYS_PREFIX, "perf/", *schema.COUNTER_PREFIXES)


@dataclass(frozen=True)
class Goal:
    """A project goal given on the command line: ``metric >= value`` or ``<= value``."""

    metric: str
    at_least: bool  # True: metric >= value; False: metric <= value
    value: float

    @property
    def op(self) -> str:
        return ">=" if self.at_least else "<="


_GOAL = re.compile(r"^\s*(?P<metric>[^<>=\s][^<>=]*?)\s*(?P<op>>=|<=)\s*(?P<value>\S+)\s*$")


def parse_goal(text: str) -> Goal | PerformanceGoal:
    """``"eval/accuracy>=0.9"`` -> :class:`Goal` (an L3 claim on a metric);
    ``"throughput>=0.9x"``, ``"cost<=1.2x"``, ``"utilization>=50%"`` -> an L4
    :class:`~refrun.acceptance.calibration.goals.PerformanceGoal`; a one-line
    :class:`RefrunInputError` naming ``--goal`` otherwise."""
    l4 = parse_performance_goal(text)
    if l4 is not None:
        return l4
    m = _GOAL.match(text)
    value = math.nan
    if m:
        with contextlib.suppress(ValueError):
            value = float(m.group("value"))
    if not m or not math.isfinite(value):
        raise RefrunInputError(f"--goal {text!r}: expected METRIC>=VALUE or METRIC<=VALUE "
                               "with a finite number, e.g. --goal eval/accuracy>=0.9")
    return Goal(m.group("metric"), m.group("op") == ">=", value)


# Every held-out group is judged up to this many per seed: each costs ~3 ms, and a sample
# makes thresholds depend on which groups it drew (a 20-group sample of 8 seeds' 35 gave
# one criterion an abs_tol of 0.01 in one run order and none in another).
MAX_GROUPS = 100


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    """How ``refrun calibrate`` derives thresholds."""

    false_alarm_rate: float = 0.05  # target P(a benign candidate fails any criterion)
    confidence: float = 0.9  # confidence of each tolerance limit
    group_size: int | None = None  # references per group (default N - 1)
    min_fraction: float = 0.9  # steps that must stay inside a per-step envelope
    # Tails of the model that floors a per-step envelope's k (Student t degrees of freedom
    # of each seed's per-step deviations; None: normal): see envelope_k.
    envelope_tail_df: float | None = 3.0
    # Groups per held-out seed: every combination up to this many (8 seeds in groups of 3
    # have 35; 10 in groups of 3, 84), else a fixed sample (see groups_for).
    max_groups: int = MAX_GROUPS
    min_steps: int = 3  # fewer common points: a one-point metric
    # Metrics declared as evaluation series (``--eval-metric``), beside those recognised
    # by how they were logged, their names or their cadence (calibration.evaluation).
    eval_metrics: tuple[str, ...] = ()
    metrics: tuple[str, ...] | None = None  # only these metrics (default: all shared)
    exclude_kinds: tuple[str, ...] = ()  # leave out criteria of these kinds
    # Require a passed gradient-check run for every candidate (an L1 `gradcheck`
    # criterion, no threshold): off by default, so no workload without recorded checks
    # gets a new failure.
    require_gradcheck: bool = False
    # Step time: the smallest max_ratio written (run-to-run noise on a shared machine that
    # N back-to-back reference runs do not show; see step_time_limits).
    step_time_floor: float = STEP_TIME_FLOOR
    # Reference seeds from which run-level quantile criteria are written (QUANTILE_MIN_RUNS).
    quantile_min_runs: int = QUANTILE_MIN_RUNS
    # Keep reference seeds named as outliers in the thresholds (they are named anyway).
    keep_outliers: bool = False
    # The project's stated goals (``--goal METRIC>=VALUE``): one L3 ``claim`` each; and its
    # L4 goals for a migration (``--goal throughput>=0.9x`` ...): one L4 criterion each.
    goals: tuple[Goal | PerformanceGoal, ...] = ()
    # Machine prices written as the file's [prices] (``--price HARDWARE=PER_HOUR``): what
    # a cost goal, and the cost a migration's L4 figures show, price runs with.
    prices: Prices = field(default_factory=Prices)
    settings: CriteriaSettings = field(default_factory=CriteriaSettings)

    def __post_init__(self) -> None:
        if not 0 < self.false_alarm_rate <= 0.5:
            raise RefrunInputError(f"--false-alarm-rate: {self.false_alarm_rate} not in (0, 0.5]")
        if not 0 < self.confidence < 1:
            raise RefrunInputError(f"--confidence: {self.confidence} not in (0, 1)")
        if not 0 < self.min_fraction <= 1:
            raise RefrunInputError(f"--min-fraction: {self.min_fraction} not in (0, 1]")
        if self.max_groups < 1:
            raise RefrunInputError(f"--max-groups: {self.max_groups} must be >= 1")
        if not 1.0 <= self.step_time_floor < 100:
            raise RefrunInputError(f"--step-time-floor: {self.step_time_floor} not in "
                                   "[1, 100)")


@dataclass(frozen=True)
class Derived:
    """One calibrated (or structural) criterion, ready to be written."""

    table: dict[str, Any]  # the [[criteria]] keys
    worst: float | None  # worst held-out need (None: structural)
    margin: float | None  # threshold - worst
    detectable: str  # the power statement
    comment: list[str]
    n_seeds: int = 0

    @property
    def id(self) -> str:
        return str(self.table["id"])


@dataclass(frozen=True)
class Calibrated:
    """The result of a calibration: the criteria and how they were derived."""

    run_ids: list[str]
    workload: str
    backend: str
    group_size: int
    options: CalibrationOptions
    criteria: list[Derived]
    skipped: dict[str, str]
    created_utc: str
    notes: list[str] = field(default_factory=list)  # said in the file and by the CLI
    outliers: list[Outlier] = field(default_factory=list)  # reference seeds named
    # The L0 finite-loss check's metric when the references' training loss is not called
    # `loss` (evaluation.training_loss); written as the file's [l0] loss_metric.
    loss_metric: str | None = None

    def text(self) -> str:
        """The criteria file (TOML)."""
        return render(self)

    def power(self) -> list[str]:
        """One line per criterion: the smallest shift it detects."""
        return [f"{d.id}: {d.detectable}" for d in self.criteria]


# --- trials ------------------------------------------------------------------------------
def canonical_order(runs: Sequence[RunData]) -> list[RunData]:
    """``runs`` in run-id order: what calibration and its check derive from, so that the
    same runs given in another order (``--reference`` as typed, ``--workload`` by start
    time, seeds trained side by side) give the same file."""
    return sorted(runs, key=lambda r: r.run_id)


def groups_for(n: int, held_out: int, size: int, max_groups: int) -> list[tuple[int, ...]]:
    """Groups of ``size`` run indices without ``held_out``: all combinations when there are
    at most ``max_groups``, else a fixed sample (numpy seed ``held_out``).  Indices are
    positions in the run-id order :func:`calibrate` puts the references in, so a sample
    depends on which runs are given, never on the order they are given in."""
    others = [i for i in range(n) if i != held_out]
    combos = list(itertools.combinations(others, size))
    if len(combos) <= max_groups:
        return combos
    pick = np.random.default_rng(held_out).choice(len(combos), max_groups, replace=False)
    return [combos[i] for i in sorted(pick)]


@dataclass(frozen=True)
class _Series:
    steps: np.ndarray
    values: np.ndarray


def _series(run: RunData, metric: str, keep: str) -> _Series:
    r = rv.resolved(run, metric, keep)
    assert r is not None
    f = rv.finite(r)
    return _Series(f.steps, f.values)


def _common(group: list[_Series], cand: _Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, group matrix, candidate values) at the steps every series has."""
    steps = cand.steps
    for g in group:
        steps = np.intersect1d(steps, g.steps)
    mat = np.vstack([g.values[np.searchsorted(g.steps, steps)] for g in group])
    return steps, mat, cand.values[np.searchsorted(cand.steps, steps)]


def _quantile_need(z: np.ndarray, q: float) -> float:
    """Smallest k with fraction(z <= k) >= q."""
    zs = np.sort(z)
    idx = max(0, math.ceil(q * len(zs) - 1e-9) - 1)
    return float(zs[idx])


# --- per-metric derivations ----------------------------------------------------------------
def _worst_by_seed(n: int, opts: CalibrationOptions, g: int, need) -> np.ndarray:
    """The need of every held-out trial (``need(held_out, group)``), one row per held-out
    seed (the limit treats the rows, not the trials, as the independent draws)."""
    return np.array([[need(i, grp) for grp in groups_for(n, i, g, opts.max_groups)]
                     for i in range(n)])


def _cov(opts: CalibrationOptions, n_criteria: int) -> float:
    return 1.0 - opts.false_alarm_rate / max(1, n_criteria)


def is_gradient_norm(metric: str) -> bool:
    """A gradient norm: per parameter (``grad_norm/<param>``) or any metric whose last
    path part is ``grad_norm`` (``train/grad_norm``)."""
    return is_parameter_metric(metric) or metric.rsplit("/", 1)[-1] == "grad_norm"


def has_final_window(metric: str, evaluations: Collection[str] = ()) -> bool:
    """Whether calibrate writes a final-window closeness for a per-step metric.

    Not for evaluation metrics (their last shared point is judged as a one-value metric)
    and not for gradient norms (``grad_norm/<param>``, or any metric whose last path part
    is ``grad_norm``): a final window asserts that seeds converge to one value, which
    holds for the objective and not for a gradient norm, whose end-of-run level depends
    on the minimum each seed reached (measured: about 1 in 10 seeds of the digits MLP
    ends at twice the others' norms).  Their envelope still judges every step.
    ``evaluations``: the evaluation metrics (:func:`evaluation.evaluation_metrics`);
    ``eval/...`` is one in any case."""
    return not (metric in evaluations or metric.startswith(schema.EVAL_PREFIX)
                or is_gradient_norm(metric))


def _slug(metric: str) -> str:
    return metric.removeprefix(schema.EVAL_PREFIX).replace("/", "-")


def _unique_ids(out: list[Derived]) -> list[Derived]:
    """Criterion ids made unique and unambiguous: ``_slug`` drops the ``eval/`` prefix for
    readable ids, so a workload logging both ``loss`` and ``eval/loss`` would get two
    ``loss-envelope`` criteria (a file the loader refuses), and an ``eval/loss`` criterion
    without a training-loss namesake (``loss-final``) would read as one on the training
    loss.  So every criterion of an ``eval/`` metric whose short name is another metric of
    the file, or whose id collides, keeps the prefix (``eval-loss-envelope``,
    ``eval-loss-final``); others are unchanged."""
    seen: dict[str, int] = {}
    for d in out:
        seen[d.id] = seen.get(d.id, 0) + 1
    metrics = {d.table.get("metric") for d in out}
    for d in out:
        m = d.table.get("metric")
        if isinstance(m, str) and m.startswith(schema.EVAL_PREFIX) and (
                seen[d.id] > 1 or _slug(m) in metrics):
            short = _slug(m)
            d.table["id"] = d.id.replace(short, m.replace("/", "-"), 1)
    return out


def _round_up(x: float, sig: int = 4) -> float:
    """x rounded up to ``sig`` significant digits, as the float nearest that decimal: the
    product alone can land one ulp above it (2465 * 0.01 == 24.650000000000002), and a
    limit printed from it would then round differently from the same limit read back from
    the file (``24.7`` against ``24.6``)."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - sig + 1
    return round(math.ceil(x / 10 ** e - 1e-9) * 10 ** e, -e) if e < 0 else float(
        math.ceil(x / 10 ** e) * 10 ** e)


@dataclass(frozen=True)
class EnvelopeK:
    """A calibrated std envelope (:func:`envelope_k`)."""

    k: float  # the band's half-width in group stds
    worst: float  # the largest held-out need
    std: float  # median over the common steps of the seeds' std (the detectable shift's unit)
    needs: np.ndarray  # every held-out need, one row per seed
    k_model: float  # the need model's k (:func:`model_k`)
    points: int  # steps common to every reference (the fraction's calibrated_points)
    effects: SeedEffects  # the seed level and scale the model's k was drawn with
    abs_tol: float = 0.0  # slack for steps where a group agreed exactly (agreeing_gap)
    fraction: FractionLimit | None = None  # the steps required inside (envelope_fraction)


@dataclass(frozen=True)
class FractionLimit:
    """The fraction of steps a per-step envelope requires inside (:func:`envelope_fraction`).

    ``required``: what the criterion's ``min_fraction`` is; ``limit``: the upper tolerance
    limit of the held-out shortfalls (``1 - fraction inside``); ``worst``: the largest
    shortfall; ``shortfalls``: every held-out trial's, one row per seed; ``floor``: the
    least fraction ever required (``2 min_fraction - 1``)."""

    required: float
    limit: float
    worst: float
    shortfalls: np.ndarray
    floor: float


def envelope_fraction(series: list[_Series], opts: CalibrationOptions, g: int, cov: float,
                      k: float, abs_tol: float = 0.0) -> FractionLimit:
    """The fraction of steps a per-step envelope of half-width ``k std + abs_tol`` (as
    written: rounded) requires inside, from how far the references' own steps stray from
    it.

    Leave-one-out, as every threshold: each reference seed ``i`` is judged against groups
    of ``g`` others (:func:`groups_for`), and its *shortfall* in a trial is the fraction of
    the common steps outside the group's band, ``u = 1 - mean_t 1{|x_t - mean_t| <= k s_t
    + abs_tol}``.  The shortfall of one more seed is bounded by the upper tolerance limit
    of those trials, ``U = max(worst, mean(u) + k_N sd(u))``
    (:func:`refrun.acceptance.statistics.upper_limit`: ``k_N`` the one-sided normal
    tolerance factor for N seeds at the criterion's Bonferroni coverage and
    ``--confidence``; Natrella, NBS Handbook 91, 1963, 2-5; NIST/SEMATECH e-Handbook
    7.2.6.3), the small-sample allowance: with 5 seeds the factor is about 6, so a
    metric whose seeds stray from the band by different amounts (a run-long excursion in
    one, none in another) gets room for a seed that strays more.  Then

        required = min(min_fraction, max(1 - U, 2 min_fraction - 1))

    * never above ``min_fraction`` (``--min-fraction``, 0.9): ``k`` was fitted so that a
      new seed keeps that fraction of its steps inside (:func:`envelope_k`); references
      far inside their band say that ``k`` is wide, not that a seed may be held to more;
    * never below ``2 min_fraction - 1`` (80 % at the default): at most twice the
      allowance ``k`` was fitted for.  A seed outside on more steps than that strays like
      a defect that shows on a fifth of the run (a warmup left out, per-device clipping
      in the early steps); a metric whose references need more room than that needs a
      wider band, which :func:`envelope_k`'s need model and held-out needs already give.
    """
    def shortfall(i: int, grp: tuple[int, ...]) -> float:
        dev, std = _deviations(series, i, grp)
        if len(dev) == 0:
            return 0.0
        return float(np.mean(dev > k * std + abs_tol))

    u = _worst_by_seed(len(series), opts, g, shortfall)
    limit, worst = upper_limit(u, cov, opts.confidence, n=len(series))
    floor = 2.0 * opts.min_fraction - 1.0
    required = min(opts.min_fraction, max(1.0 - limit, floor))
    return FractionLimit(_round_down(required), limit, worst, u, floor)


def _round_down(x: float, digits: int = 4) -> float:
    """``x`` rounded down to ``digits`` decimals (a required fraction as written: never
    above the one derived)."""
    return math.floor(x * 10 ** digits + 1e-9) / 10 ** digits


def envelope_k(series: list[_Series], opts: CalibrationOptions, g: int, cov: float
               ) -> EnvelopeK | None:
    """The :class:`EnvelopeK` of a per-step std envelope.

    Each held-out seed needs the ``min_fraction`` quantile of ``z = |x - mean| / std``
    over the common steps (mean and std, ddof=1, of a group of ``g`` others).  Then

        k = max(worst need, min(k_model, k_pred))

    * ``k_model``: the ``cov`` quantile of the need of a new seed against a *new* group
      under a heavy-tailed AR(1) model of seed deviations with run-long seed levels and
      scales estimated from the references (:func:`model_k`, :func:`seed_effects`).  N
      leave-one-out needs share most of their groups, so 5 seeds that happen to agree
      look tight to any rule fitted to them (measured: 5 of 20 held-out seeds of a
      150-step transformer LM rejected at k 3.4 where they needed up to 4.2; with 15
      references, a group of 14 whose fresh seeds needed 1.92-2.00 on four gradient
      norms where any other 14 gave 1.66-1.83).  An earlier rule also took the upper
      tolerance limit of the N seeds' log needs, ``exp(L)``; with 5 seeds it scattered
      to k 5.5-19 on workloads whose fresh seeds needed under 4, and the seed level now
      carries what it covered;
    * ``k_pred = sqrt(1 + 1/g) t_{1-a/2, g-1}``, ``a = 1 - cov``
      (:func:`refrun.acceptance.statistics.prediction_z`): if a seed's value at a step is
      a normal draw exchangeable with the group's, ``P(z > k_pred) = a`` at every step,
      whatever the spread, so a candidate-seed is rejected with probability at most
      ``a`` when its deviations persist over the steps (the worst case of a fraction
      rule) and less when they do not.  The cap matters with few seeds and few points
      (5 seeds, 12 evaluation points): there the needs scatter widely and the
      tolerance factor for N = 5 at Bonferroni coverage turned log-limits into k of
      about 110 (a blind envelope).  The simulation in
      ``tests/test_calibration_envelope.py`` measures both false-alarm rates on null
      data.
    """
    def need(i: int, grp: tuple[int, ...], abs_tol: float) -> float:
        dev, std = _deviations(series, i, grp)
        if len(dev) == 0:
            return math.nan
        # as the check applies abs_tol: |x - mean| <= k std + abs_tol
        dev = np.maximum(dev - abs_tol, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(std > 0, dev / std, np.where(dev == 0, 0.0, np.inf))
        return _quantile_need(z, opts.min_fraction)

    abs_tol = 0.0
    needs = _worst_by_seed(len(series), opts, g, lambda i, grp: need(i, grp, 0.0))
    if np.any(np.isinf(needs)):
        abs_tol = agreeing_gap(series, opts, g)
        needs = _worst_by_seed(len(series), opts, g, lambda i, grp: need(i, grp, abs_tol))
    if not np.all(np.isfinite(needs)):
        return None
    worst = float(needs.max())
    common = _all_common(series)
    per_step = 1.0 - (1.0 - cov) * max(1.0 - opts.min_fraction, 1.0 / max(len(common), 1))
    effects = seed_effects(series)
    k_model = model_k(series, opts, g, cov, effects)
    k = max(worst, min(k_model, prediction_z(g, per_step)))
    std = np.median(np.std(np.vstack([s.values[np.searchsorted(s.steps, common)]
                                      for s in series]), 0, ddof=1))
    frac = envelope_fraction(series, opts, g, cov, _round_up(k),
                             _round_up(abs_tol) if abs_tol > 0 else 0.0)
    return EnvelopeK(k, worst, float(std), needs, k_model, len(common), effects, abs_tol,
                     frac)


def _deviations(series: list[_Series], i: int, grp: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(|x - mean|, std)`` of held-out seed ``i`` against the group ``grp`` (mean and
    std, ddof=1) at the steps they all have."""
    _, mat, x = _common([series[j] for j in grp], series[i])
    return np.abs(x - mat.mean(0)), mat.std(0, ddof=1)


def agreeing_gap(series: list[_Series], opts: CalibrationOptions, g: int) -> float:
    """The slack a std envelope needs where its group of seeds agreed exactly: the largest
    ``|x - mean|`` of a held-out seed at a step where its group's std is 0, and at least
    the metric's resolution (:func:`resolution_of`).

    A quantised metric (an accuracy over n examples moves in steps of 1/n) often has every
    seed of a small group at the same value, most of all where it saturates; the group's
    std of 0 there is the quantisation, not a spread of 0, and a seed one example away
    would need an infinite ``k``.  With the slack the band is ``mean +- (k std +
    abs_tol)``, so such steps are judged by the slack and the others by ``k``; the
    fraction rule still tolerates a few steps outside."""
    gap = 0.0
    for i in range(len(series)):
        for grp in groups_for(len(series), i, g, opts.max_groups):
            dev, std = _deviations(series, i, grp)
            tied = dev[std == 0]
            if len(tied):
                gap = max(gap, float(tied.max()))
    return max(gap, resolution_of(series))


def _standardised_deviations(series: list[_Series]) -> np.ndarray:
    """``r_it = (x_it - mean_t) / s_t`` (mean and s, ddof=1, over the seeds) at the steps
    every seed has and where ``s_t > 0``: one row per seed."""
    steps = _all_common(series)
    mat = np.vstack([s.values[np.searchsorted(s.steps, steps)] for s in series])
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (mat - mat.mean(0)) / mat.std(0, ddof=1)
    return r[:, np.all(np.isfinite(r), axis=0)]


def _lag1(r: np.ndarray) -> float:
    if r.shape[1] < 3:
        return 0.0
    den = float(np.sum(r[:, :-1] ** 2))
    return float(np.sum(r[:, :-1] * r[:, 1:]) / den) if den > 0 else 0.0


def lag1_autocorrelation(series: list[_Series]) -> float:
    """Lag-1 autocorrelation of the seeds' standardised deviations from their mean,
    ``r_it = (x_it - mean_t) / s_t`` at the steps every seed has, pooled over the seeds:
    ``sum r_it r_i,t+1 / sum r_it^2`` (0 with fewer than 3 usable steps)."""
    return _lag1(_standardised_deviations(series))


@dataclass(frozen=True)
class SeedEffects:
    """How seeds differ beyond an AR(1) process (:func:`seed_effects`); the terms of
    :func:`refrun.acceptance.statistics.need_quantile`'s model."""

    level: float  # share of a deviation's variance that is one run-long level per seed
    scale_sd: float  # sd of a seed's log scale
    lag1: float  # lag-1 autocorrelation of the AR(1) part (the level's share removed)


def seed_effects(series: list[_Series]) -> SeedEffects:
    """The seed level and scale of the need model, by the method of moments.

    On the standardised deviations ``r_it`` (:func:`lag1_autocorrelation`; unit variance
    over the seeds at every step), with ``N`` seeds and ``T`` common steps:

    * level: under ``d_it = sqrt(lam) L_i + sqrt(1 - lam) e_it``, a seed's time mean
      ``m_i = mean_t r_it`` has variance ``V = lam + (1 - lam) v(T, rho)`` with ``v``
      the AR(1)'s (:func:`refrun.acceptance.statistics.ar1_mean_variance`) and ``rho``
      the AR(1) part's lag-1, ``r1 = lam + (1 - lam) rho`` the observed pooled lag-1.
      ``V`` is estimated by ``sum m_i^2 / (N - 1)`` (the ``m_i`` sum to zero); ``lam``
      and ``rho`` are solved for jointly by fixed-point iteration, ``lam`` in [0, 0.9];
    * scale: the variance over the seeds of ``log MAD_i`` (the median absolute deviation
      of a seed's ``r_it`` from its own median, which the level does not move), less its
      variance when no scale differs (:func:`refrun.acceptance.statistics.log_mad_null`),
      floored at 0: ``scale_sd = sqrt(max(0, var - null))``.

    Both are noisy with few seeds (4 degrees of freedom with 5), and a level makes the
    need model wider, never narrower: an over-estimate costs detection power, an
    under-estimate false alarms.  Fewer than 3 seeds or 3 steps: no effects."""
    r = _standardised_deviations(series)
    n, t = r.shape
    if n < 3 or t < 3:
        return SeedEffects(0.0, 0.0, _lag1(r))
    r1 = min(0.95, max(0.0, _lag1(r)))
    v_obs = float(np.sum(r.mean(1) ** 2) / (n - 1))
    lam, rho = 0.0, r1
    for _ in range(50):
        v = ar1_mean_variance(t, rho)
        lam_new = min(0.9, max(0.0, (v_obs - v) / (1 - v))) if v < 1 else 0.0
        rho = max(0.0, (r1 - lam_new) / (1 - lam_new))
        if abs(lam_new - lam) < 1e-6:
            lam = lam_new
            break
        lam = lam_new
    mad = np.median(np.abs(r - np.median(r, axis=1, keepdims=True)), axis=1)
    if np.any(mad <= 0):
        return SeedEffects(lam, 0.0, rho)
    var_log = float(np.var(np.log(mad), ddof=1))
    null = log_mad_null(n, min(t, NEED_MAX_STEPS), math.ceil(rho * 20 - 1e-9) / 20)
    return SeedEffects(lam, math.sqrt(max(0.0, var_log - null)), rho)


def model_k(series: list[_Series], opts: CalibrationOptions, g: int, cov: float,
            effects: SeedEffects | None = None) -> float:
    """The need model's k: :func:`refrun.acceptance.statistics.need_quantile` at the
    references' common steps and ``min_fraction``, with their :func:`seed_effects`
    (``effects``, estimated here when not given) and ``opts.envelope_tail_df``."""
    fx = effects or seed_effects(series)
    return need_quantile(g, len(_all_common(series)), fx.lag1, opts.min_fraction, cov,
                         opts.envelope_tail_df, level=fx.level, scale_sd=fx.scale_sd)


def _all_common(series: list[_Series]) -> np.ndarray:
    steps = series[0].steps
    for s in series[1:]:
        steps = np.intersect1d(steps, s.steps)
    return steps


def final_window_tol(series: list[_Series], opts: CalibrationOptions, g: int, cov: float
                     ) -> tuple[float, float, np.ndarray]:
    """``(rel_tol, worst, needs)`` of a final-window closeness of means: the need is
    (window mean of the held-out seed - window mean of the group mean) / |the latter|
    over the last ceil(final_fraction n) common steps (relative, so that it holds for a
    longer or shorter run of the same workload as well)."""
    s = opts.settings

    def need(i: int, grp: tuple[int, ...]) -> float:
        steps, mat, x = _common([series[j] for j in grp], series[i])
        k = final_window_size(len(steps), s.final_fraction, s.final_points)
        ref = float(mat.mean(0)[-k:].mean())
        return float((x[-k:].mean() - ref) / max(abs(ref), s.eps))

    # Signed differences: the limit is fitted to d, not |d| (see symmetric_limit).
    signed = _worst_by_seed(len(series), opts, g, need)
    lim, worst = symmetric_limit(signed, cov, opts.confidence, n=len(series))
    return lim, worst, np.abs(signed)


@dataclass(frozen=True)
class WindowBound:
    """The final-window tolerance's floor (:func:`window_bound`): ``rel``, the prediction
    bound of one more seed's window mean relative to |the references' mean|; ``se_rel``,
    the references' root-mean-square window-mean standard error, relative; ``n_eff``, the
    mean effective number of independent points of a window; ``points``: its points."""

    rel: float
    se_rel: float
    n_eff: float
    points: int


def window_bound(series: list[_Series], opts: CalibrationOptions, cov: float) -> WindowBound:
    """The floor of a final-window tolerance (issue 52: unlucky seeds): the held-out
    limit rests on N window means, which a few references can place closer together than
    their own windows' noise allows.  Each reference's final window (the last ``K``
    common steps, as the check takes it) gives its mean and that mean's standard error
    (:func:`refrun.acceptance.statistics.window_mean_error`); the bound is
    :func:`refrun.acceptance.statistics.window_mean_prediction` of them at ``cov``,
    relative to |the mean of the means|."""
    st = opts.settings
    common = _all_common(series)
    k = final_window_size(len(common), st.final_fraction, st.final_points)
    wins = [s.values[np.searchsorted(s.steps, common[-k:])] for s in series]
    means = np.array([float(w.mean()) for w in wins])
    errs = [window_mean_error(w) for w in wins]
    ses = np.array([e.se for e in errs])
    scale = max(abs(float(means.mean())), st.eps)
    if len(series) < 2:
        return WindowBound(0.0, 0.0, float(k), k)
    rel = window_mean_prediction(means, ses, cov) / scale
    return WindowBound(rel, math.sqrt(float(np.mean(ses ** 2))) / scale,
                       float(np.mean([e.n_eff for e in errs])), k)


@dataclass(frozen=True)
class WindowNoise:
    """The per-point noise of a metric in the final window (see :func:`window_noise`)."""

    rel: float  # std of one logged point / |window mean of the references|
    points: int  # points the final window holds at the references' common steps
    z: float  # two-sided normal quantile at the criterion's coverage


def window_noise(series: list[_Series], opts: CalibrationOptions, cov: float
                 ) -> WindowNoise:
    """Per-point noise in the final window, for the cadence-aware tolerance of
    :func:`refrun.acceptance.kinds.closeness.window_noise_allowance`.

    Over the last ``max(K, 8)`` common steps (``K`` the final window's points) of each
    reference, the std of one point is estimated from first differences, which remove
    a smooth trend: ``sigma_i^2 = var(diff x) / 2`` (white noise: ``var(x_t - x_{t-1}) =
    2 sigma^2``; von Neumann, Ann. Math. Statist. 12:367, 1941).  ``rel`` =
    ``sqrt(mean sigma_i^2) / |mean of the window means|``; ``z = Phi^-1(1 - (1-cov)/2)``.
    Autocorrelated noise (a smoothed loss) is under-estimated, so the allowance errs on
    the side of judging."""
    from scipy import stats as sps

    st = opts.settings
    common = _all_common(series)
    k = final_window_size(len(common), st.final_fraction, st.final_points)
    tail = common[-max(k, 8):]
    mat = np.vstack([s.values[np.searchsorted(s.steps, tail)] for s in series])
    var = float(np.mean(np.var(np.diff(mat, axis=1), axis=1, ddof=1) / 2)) \
        if mat.shape[1] >= 3 else 0.0
    scale = abs(float(mat[:, -k:].mean()))
    rel = math.sqrt(var) / max(scale, st.eps) if var > 0 else 0.0
    return WindowNoise(rel, k, float(sps.norm.ppf(1 - (1 - cov) / 2)))


def one_point_tol(values: np.ndarray, opts: CalibrationOptions, g: int, cov: float,
                  resolution: float = 0.0, point_se: float = 0.0
                  ) -> tuple[float, float, np.ndarray]:
    """``(abs_tol, worst, needs)`` of a min-max envelope of one value per run: the need is
    the signed distance of the held-out value outside the group's range (negative
    inside); never below :func:`range_tol_floor` (with the value's own sampling error
    ``point_se``, :func:`point_error`)."""
    def need(i: int, grp: tuple[int, ...]) -> float:
        v = values[list(grp)]
        return float(max(v.min() - values[i], values[i] - v.max()))

    needs = _worst_by_seed(len(values), opts, g, need)
    lim, worst = upper_limit(needs, cov, opts.confidence, n=len(values))
    return max(0.0, lim, range_tol_floor(values, g, cov, resolution, point_se)), worst, needs


def resolution_of(series: list[_Series]) -> float:
    """The smallest positive gap between distinct values a metric took in any reference
    run: its resolution where it is quantised (an accuracy over 400 examples moves in
    steps of 0.0025), negligible for a continuous metric."""
    v = np.unique(np.concatenate([s.values[np.isfinite(s.values)] for s in series]))
    gaps = np.diff(v)
    gaps = gaps[gaps > 0]
    return float(gaps.min()) if len(gaps) else 0.0


def range_tol_floor(values: np.ndarray, g: int, cov: float, resolution: float = 0.0,
                    point_se: float = 0.0) -> float:
    """The least ``abs_tol`` of a min-max band of ``g`` reference values that one more seed
    meets with probability about ``cov``, whatever the few held-out needs showed.

    The band ``[min - tol, max + tol]`` must hold the Student-t prediction interval of one
    new draw, ``mean +- z s`` with ``z = sqrt(1 + 1/g) t_{1-a/2, g-1}``
    (:func:`refrun.acceptance.statistics.prediction_z`; ``s`` the std of all N seeds'
    values), so ``tol >= z s - r/2`` with ``r`` the range of the narrowest group of ``g``
    seeds (the band is centred on its group; the narrowest is the worst case).  Never below
    the metric's ``resolution``: held-out needs of a quantised metric are often exactly
    0 (five seeds on two adjacent accuracy values), and a tolerance of 0 fails the next
    seed one example away.

    ``point_se``: the value's own sampling error where it is known (a proportion's
    binomial error, :func:`point_error`); the prediction interval is then
    :func:`refrun.acceptance.statistics.point_prediction`, which is never narrower than
    ``z point_se sqrt(1 + 1/g)`` however closely the seeds happen to agree (``z_k s``
    exactly when ``point_se`` is 0)."""
    v = np.asarray(values, dtype=float)
    floor = float(resolution)
    s = float(np.std(v, ddof=1)) if len(v) >= 2 else 0.0
    if len(v) >= 3 and g >= 2 and (s > 0 or point_se > 0):
        k = min(g, len(v) - 1)
        narrowest = min(float(np.ptp(v[list(c)])) for c in itertools.islice(
            itertools.combinations(range(len(v)), k), 200))
        floor = max(floor, point_prediction(s, point_se, k, cov) - narrowest / 2)
    return floor


@dataclass(frozen=True)
class PointError:
    """A single value's own sampling error (:func:`point_error`): ``se``, and ``examples``,
    the evaluation set's size it was read from (None: not a proportion, ``se`` 0)."""

    se: float
    examples: int | None


def point_error(series: list[_Series], values: np.ndarray) -> PointError:
    """The sampling error of one end-of-run value of a metric, where its values tell it.

    A proportion over n examples (an accuracy on a finite evaluation set) takes values
    ``k/n`` only; n is read from every value the references logged
    (:func:`refrun.acceptance.statistics.proportion_size`) and the error is binomial at
    the references' mean, ``sqrt(p (1 - p) / n)``
    (:func:`refrun.acceptance.statistics.proportion_error`).  Five seeds that land within
    one example of each other (five test accuracies within 3 of 897 examples) say little
    about the next seed, whose accuracy on the same n examples moves by that error; a port
    that evaluates another draw of n examples (sharded, shuffled, the last partial batch
    dropped) moves by exactly it.  Any other metric: 0 (its seeds' spread alone)."""
    n = proportion_size(np.concatenate([s.values for s in series]), resolution_of(series))
    return PointError(proportion_error(values, n), n)


def final_values(series: list[_Series]) -> tuple[int, np.ndarray]:
    """``(step, values)``: each reference's value at the last evaluation step they all
    share (a periodically evaluated metric treated as a one-value metric)."""
    common = _all_common(series)
    step = int(common[-1])
    return step, np.array([s.values[np.searchsorted(s.steps, step)] for s in series])


def tost_half_width(values: np.ndarray, g: int, alpha: float = 0.05) -> float:
    """Typical half-width of TOST's (1 - 2 alpha) interval for one candidate against
    ``g`` references: ``t_{1-alpha, g-1} s sqrt(1 + 1/g)``, ``s`` the seeds' std."""
    from scipy import stats as sps

    return float(sps.t.ppf(1 - alpha, g - 1)) * float(np.std(values, ddof=1)) * \
        math.sqrt(1 + 1 / g)


def equivalence_margin(values: np.ndarray, opts: CalibrationOptions, g: int, cov: float,
                       point_se: float = 0.0) -> tuple[float, float, np.ndarray]:
    """``(margin, worst, needs)`` of a TOST equivalence criterion: a held-out seed needs
    the margin at which TOST just declares it equivalent to its group, the larger bound
    of the (1 - 2 alpha) interval of its difference from the group's mean,
    ``|d| + t_{1-alpha, g-1} s_g sqrt(1 + 1/g)``
    (:func:`refrun.acceptance.statistics.tost`); the margin is the upper tolerance limit
    of those needs."""
    def need(i: int, grp: tuple[int, ...]) -> float:
        t = tost(values[list(grp)], values[[i]], -1.0, 1.0, TOST_ALPHA)
        return float(max(abs(t.interval[0]), abs(t.interval[1])))

    needs = _worst_by_seed(len(values), opts, g, need)
    lim, worst = upper_limit(needs, cov, opts.confidence, n=len(values))
    return max(lim, tost_margin_floor(values, g, cov, point_se)), worst, needs


def tost_margin_floor(values: np.ndarray, g: int, cov: float, point_se: float = 0.0
                      ) -> float:
    """A margin one more seed meets with probability about ``cov`` whatever the few
    held-out needs showed: ``s (z_k + sqrt(1 + 1/g) t_{1-alpha, g-1})``, ``s`` the std of
    the N seeds' values: ``z_k = sqrt(1 + 1/k) t_{1-a/2, k-1}``, ``a = 1 - cov``,
    ``k = min(g, N - 1)`` (:func:`refrun.acceptance.statistics.prediction_z`) bounds the
    candidate's distance from a group mean, the second term is the TOST interval's
    half-width at the typical spread.  Five held-out needs alone left benign seeds outside
    the margin (their groups' spreads happened to be small).

    The prediction bound is the one :func:`range_tol_floor` uses for the same value, with
    ``k - 1`` degrees of freedom: the check judges the candidate against a group of ``g``
    references and estimates the spread from them.  It used ``N - 1`` before (the spread
    known from all N seeds), a much narrower bound at Bonferroni coverage (at ``a`` =
    0.0016, ``t_{1-a/2, 4}`` = 7.6 against ``t_{1-a/2, 3}`` = 11.0), and TOST then rejected
    about 7 in 100 held-out digits seeds whose value the range criterion accepted: five
    references that agree more closely than seeds do (test accuracies within 3 of 897
    examples, where 40 further seeds spread over 17).  With the value's own sampling
    error ``point_se`` (:func:`point_error`) the first term is
    :func:`refrun.acceptance.statistics.point_prediction` (``z_k s`` when it is 0), as in
    :func:`range_tol_floor`."""
    from scipy import stats as sps

    n = len(values)
    s = float(np.std(values, ddof=1))
    return point_prediction(s, point_se, min(g, n - 1), cov) \
        + s * math.sqrt(1 + 1 / g) * float(sps.t.ppf(1 - TOST_ALPHA, g - 1))


def step_time_limit(runs: list[RunData], opts: CalibrationOptions, g: int, cov: float,
                    metric: str = schema.M_STEP_TIME, quantile: float = 0.5
                    ) -> tuple[float, float, np.ndarray, int]:
    """``(max_ratio, worst ratio, needs, warm-up end)``: each held-out seed's steady median
    (or ``quantile``) over the group's pooled one (compilation steps left out, as the
    check does); the limit is taken on the log ratio."""
    keep = opts.settings.keep
    comp = list(schema.STEP_TIME_COMPILE_METRICS)
    spans = [_series(r, metric, keep).steps for r in runs]
    first, last = min(int(s[0]) for s in spans), max(int(s[-1]) for s in spans)
    start = warmup_end(first, last, opts.settings.warmup_steps, opts.settings.warmup_fraction)
    steady = [rv.steady_step_times(r, metric, comp, keep, start)[1] for r in runs]

    def need(i: int, grp: tuple[int, ...]) -> float:
        pooled = np.concatenate([steady[j] for j in grp])
        return float(np.log(np.quantile(steady[i], quantile) / np.quantile(pooled, quantile)))

    needs = _worst_by_seed(len(runs), opts, g, need)
    lim, worst = upper_limit(needs, cov, opts.confidence, n=len(runs))
    return math.exp(lim), math.exp(worst), needs, start


def block_bootstrap_sd(x: np.ndarray, n_boot: int = 200, seed: int = 0,
                       quantile: float = 0.5) -> float:
    """Standard deviation of the log ``quantile`` (median) of ``x`` under the moving block
    bootstrap
    (Kuensch, Ann. Statist. 17:1217, 1989): blocks of ``b = ceil(n^(1/3))`` consecutive
    values (step times drift and come in bursts, so single values are not exchangeable)
    drawn with replacement until n values; ``n_boot`` replicates, a fixed seed (the file
    is reproducible).  0 for fewer than 4 values."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    if n < 4 or not np.all(x > 0):
        return 0.0
    b = max(1, math.ceil(n ** (1 / 3)))
    starts = np.arange(n - b + 1)
    nblocks = math.ceil(n / b)
    rng = np.random.default_rng(seed)
    picks = rng.choice(starts, size=(n_boot, nblocks))
    idx = (picks[:, :, None] + np.arange(b)[None, None, :]).reshape(n_boot, -1)[:, :n]
    meds = np.quantile(x[idx], quantile, axis=1)
    return float(np.std(np.log(meds), ddof=1))


@dataclass(frozen=True)
class StepTimeLimit:
    """How a calibrated ``max_ratio`` was composed (all ratios; stated in the file)."""

    held_out: float  # upper tolerance limit of the held-out seeds' ratios
    worst: float  # worst held-out ratio
    bootstrap: float  # exp(z sigma sqrt(1 + 1/g)), sigma: within-run block bootstrap
    floor: float  # the documented floor (--step-time-floor)
    start: int  # warm-up end step

    @property
    def max_ratio(self) -> float:
        return max(self.held_out, self.bootstrap, self.floor)

    @property
    def source(self) -> str:
        parts = {"held-out seeds": self.held_out, "within-run bootstrap": self.bootstrap,
                 "floor": self.floor}
        return max(parts, key=lambda k: parts[k])


def step_time_limits(runs: list[RunData], opts: CalibrationOptions, g: int, cov: float,
                     metric: str = schema.M_STEP_TIME) -> StepTimeLimit:
    """The calibrated step-time limit on the ratio of the fastest
    ``STEP_TIME_LOW_QUANTILE`` of the steady steps: the largest of

    * the held-out limit (:func:`step_time_limit`): what N back-to-back reference runs
      show of run-to-run spread;
    * ``exp(z sigma sqrt(1 + 1/g))``, ``z = Phi^-1(cov)``, ``sigma^2`` the mean over the
      references of the block-bootstrap variance of their log steady low quantile
      (:func:`block_bootstrap_sd`): the spread a run's statistic has from its own
      within-run variability, which back-to-back runs on a quiet machine may not show;
    * ``opts.step_time_floor``: run-to-run spread neither shows; medians of identical
      runs on a shared machine varied by 1.0-1.6x (issue 21), so identical code on a busy
      machine must not fail, while a 2x slower step still does.
    """
    from scipy import stats as sps

    q = STEP_TIME_LOW_QUANTILE
    held, worst, _, start = step_time_limit(runs, opts, g, cov, metric, q)
    comp = list(schema.STEP_TIME_COMPILE_METRICS)
    keep = opts.settings.keep
    sds = [block_bootstrap_sd(rv.steady_step_times(r, metric, comp, keep, start)[1],
                              quantile=q) for r in runs]
    sigma = math.sqrt(float(np.mean(np.square(sds))))
    boot = math.exp(float(sps.norm.ppf(cov)) * sigma * math.sqrt(1 + 1 / g))
    return StepTimeLimit(held, worst, boot, opts.step_time_floor, start)


# --- the whole file ------------------------------------------------------------------------
def shared_metrics(runs: Sequence[RunData]) -> list[str]:
    """Metrics with at least one finite point in every run, sorted."""
    names = set(runs[0].metric_names)
    for r in runs[1:]:
        names &= set(r.metric_names)
    return sorted(m for m in names
                  if all(len(rv.finite(rv.resolved(r, m)).values) for r in runs))  # type: ignore[arg-type]


def check_runs(runs: Sequence[RunData], opts: CalibrationOptions) -> tuple[int, str, str]:
    """``(group size, workload, backends)`` of reference seeds fit to calibrate on, or a
    one-line :class:`RefrunInputError` (too few, repeated, paired, mixed workloads)."""
    if len(runs) < MIN_RUNS:
        raise RefrunInputError(f"calibration needs at least {MIN_RUNS} reference runs "
                               f"(seeds), got {len(runs)}")
    ids = [r.run_id for r in runs]
    paired_runs = [r.run_id for r in runs if declares_pair(r.tags)]
    if paired_runs:
        raise RefrunInputError(f"run(s) {', '.join(paired_runs)} declare a same-seed pair "
                               f"({schema.TAG_PAIR_SEED}): not independent reference seeds")
    if len(set(ids)) != len(ids):
        raise RefrunInputError(f"reference runs given twice: {', '.join(ids)}")
    g = opts.group_size or len(runs) - 1
    if not 2 <= g <= len(runs) - 1:
        raise RefrunInputError(f"--group-size: {g} must be between 2 and N - 1 = "
                               f"{len(runs) - 1}")
    workloads = {r.workload or "" for r in runs}
    if len(workloads) > 1:
        raise RefrunInputError(f"reference runs of different workloads: "
                               f"{', '.join(sorted(workloads))}")
    # Canonical names (the criteria reader validates [calibration] backend against them).
    backends = {identity.canonical_backend(r.backend) or (r.backend or "").strip().lower()
                for r in runs}
    return g, workloads.pop(), ",".join(sorted(backends))


@dataclass(frozen=True)
class Outlier:
    """A reference seed far outside the others on one quantity (see :func:`outliers`)."""

    run_id: str
    seed: str | None
    quantity: str  # what was compared, e.g. "final-window mean of loss"
    value: float
    others_mean: float
    t: float  # |value - mean of the others| / (s_others sqrt(1 + 1/(N-1)))
    limit: float  # t_{1 - a/2, N-2}
    excluded: bool  # left out of every threshold

    def text(self) -> str:
        what = ("left out of every threshold" if self.excluded else
                "kept in the thresholds (--keep-outliers, or too few seeds without it)")
        seed = f" (seed {self.seed})" if self.seed not in (None, "") else ""
        return (f"reference run {self.run_id}{seed} is an outlier among the others: its "
                f"{self.quantity} {self.value:.4g} is {self.t:.1f} standard deviations of "
                f"the others from their mean {self.others_mean:.4g} (limit {self.limit:.1f}); "
                f"{what}; do not use it as a reference with refrun accept")


def _quantities(runs: list[RunData], opts: CalibrationOptions) -> dict[str, np.ndarray]:
    """One value per reference run for every numerical quantity a criterion rests on: the
    final-window mean of each per-step metric, the final (last shared) evaluation of each
    evaluated metric, and each one-value metric.  Never the step time: it says how busy
    the machine was during the run, and a seed recorded beside other work (2.2x the
    others' median on a loaded 2-vCPU machine) was named an outlier and left out of every
    numerical threshold (the step-time criterion's own spread covers a slow seed)."""
    keep, st = opts.settings.keep, opts.settings
    out: dict[str, np.ndarray] = {}
    shared = shared_metrics(runs)
    evals = evaluation.evaluation_metrics(runs, shared, declared=opts.eval_metrics, keep=keep)
    for m in shared:
        if m.startswith(schema.PROGRESS_PREFIX) or m.startswith(SKIP_PREFIXES):
            continue
        if opts.metrics is not None and m not in opts.metrics:
            continue
        series = [_series(r, m, keep) for r in runs]
        common = _all_common(series)
        if len(common) == 0:
            continue
        if m in evals or len(common) < opts.min_steps:
            out[f"final value of {m} (step {int(common[-1])})"] = final_values(series)[1]
            continue
        k = final_window_size(len(common), st.final_fraction, st.final_points)
        tail = common[-k:]
        out[f"final-window mean of {m}"] = np.array(
            [s.values[np.searchsorted(s.steps, tail)].mean() for s in series])
    return out


def outliers(runs: list[RunData], opts: CalibrationOptions) -> list[Outlier]:
    """Reference seeds that are outliers among the others, each with its most extreme
    quantity (:func:`_quantities`).

    Leave one out: with the other N - 1 seeds' mean and std ``s`` (ddof=1) of a quantity,
    ``t = |x - mean| / (s sqrt(1 + 1/(N-1)))`` is Student t with N - 2 degrees of freedom
    when the seed is exchangeable with the others (the prediction interval of one new
    observation; Hahn, Meeker & Escobar, *Statistical Intervals*, 2017, eq. 4.7).  A seed
    is named when ``t > t_{1 - a/2, N-2}``, ``a = false_alarm_rate / (N * quantities)``
    (Bonferroni over seeds and quantities: a set of benign seeds names none with
    probability >= 1 - false_alarm_rate).  Needs N >= 4; a quantity on which the others
    agree exactly is not judged (no scale)."""
    from scipy import stats as sps

    n = len(runs)
    if n < 4:
        return []
    qs = _quantities(runs, opts)
    if not qs:
        return []
    a = opts.false_alarm_rate / (n * len(qs))
    limit = float(sps.t.ppf(1 - a / 2, n - 2))
    found: dict[int, Outlier] = {}
    for name, v in qs.items():
        for i in range(n):
            others = np.delete(v, i)
            sd = float(np.std(others, ddof=1))
            if not sd > 0 or not np.all(np.isfinite(v)):
                continue
            mean = float(others.mean())
            t = abs(float(v[i]) - mean) / (sd * math.sqrt(1 + 1 / (n - 1)))
            if t > limit and (i not in found or t > found[i].t):
                found[i] = Outlier(runs[i].run_id, runs[i].seed, name, float(v[i]), mean, t,
                                   limit, False)
    return [found[i] for i in sorted(found)]


def calibrate(references: Sequence[RunData],
              options: CalibrationOptions | None = None,
              known_good: Sequence[RunData] = ()) -> Calibrated:
    """Derive a criteria file from ``references`` (N >= 3 seeds of one workload).

    ``known_good``: known-good same-seed pair evidence (runs tagged
    ``refrun.pair.known_good``, :func:`refrun.acceptance.paired.known_good_ids`); those whose
    pair is one of ``references`` give ``paired`` criteria on the loss and on each
    periodically evaluated metric (:func:`_paired_criteria`,
    :func:`refrun.acceptance.paired.derive_band`); otherwise ``notes`` says why none.

    Returns a :class:`Calibrated` (``.text()`` is the TOML file, ``.power()`` the
    smallest detectable shifts).  Raises :class:`RefrunInputError` for fewer than 3 runs,
    mixed workloads, or a group size outside 2..N-1.  A reference seed that is an outlier
    among the others (:func:`outliers`) is named in the file and left out of every
    threshold (unless ``keep_outliers``, or fewer than 3 seeds or the group size would
    remain), instead of silently widening every threshold around it.

    The file depends on which runs are given, not on their order: they are taken in run-id
    order (held-out groups, and the sample of them :func:`groups_for` draws when there are
    more than ``max_groups``, are positions in that order).
    """
    opts = options or CalibrationOptions()
    references, known_good = canonical_order(references), canonical_order(known_good)
    runs = list(references)
    check_runs(runs, opts)
    found = outliers(runs, opts)
    bad = {o.run_id for o in found}
    left = len(runs) - len(bad)
    if found and not opts.keep_outliers and left >= MIN_RUNS and (
            opts.group_size is None or opts.group_size <= left - 1):
        found = [dataclasses.replace(o, excluded=True) for o in found]
        runs = [r for r in runs if r.run_id not in bad]
    # Pairs are about numerics, not spread: a known-good rerun of an outlier seed still
    # measures how a benign perturbation diverges, so every given reference can be a pair.
    c = _calibrate(runs, opts, known_good, list(references))
    return dataclasses.replace(c, outliers=found)


def _calibrate(runs: list[RunData], opts: CalibrationOptions,
               known_good: Sequence[RunData] = (),
               pair_references: Sequence[RunData] = ()) -> Calibrated:
    g, workload, backend = check_runs(runs, opts)
    keep = opts.settings.keep
    metrics = shared_metrics(runs)
    if opts.metrics is not None:
        missing = [m for m in opts.metrics if m not in metrics]
        if missing:
            raise RefrunInputError(f"--metric: {', '.join(missing)} not recorded (with a "
                                   f"finite value) in every reference run")
        metrics = [m for m in metrics if m in opts.metrics]
    undeclared = [m for m in opts.eval_metrics if m not in metrics]
    if undeclared:
        raise RefrunInputError(f"--eval-metric: {', '.join(undeclared)} not recorded (with a "
                               f"finite value) in every reference run")
    skipped: dict[str, str] = {}
    per_step, one_point = [], []
    for m in metrics:
        if m.startswith(schema.PROGRESS_PREFIX):
            skipped[m] = "an alignment axis (samples or tokens seen), not a measurement"
            continue
        if m == schema.M_OPT_STEPS:
            skipped[m] = ("the optimizer's own update count: judged within a run where a "
                          "resume replays steps (the restore criterion), not across runs "
                          "(a loss scaler skips updates on one hardware and not another)")
            continue
        if m.startswith(SKIP_PREFIXES):
            if m != schema.M_STEP_TIME:
                skipped[m] = "counter or system metric (integrity criteria cover counters)"
            continue
        series = [_series(r, m, keep) for r in runs]
        n_common = len(_all_common(series))
        if all(len(s.steps) == 1 for s in series):
            one_point.append(m)
        elif n_common >= opts.min_steps:
            per_step.append(m)
        else:
            skipped[m] = f"only {n_common} step(s) common to every reference run"
    has_time = schema.M_STEP_TIME in metrics and bool(backend and "," not in backend) \
        and "step_time" not in opts.exclude_kinds
    if schema.M_STEP_TIME in metrics and not has_time:
        skipped[schema.M_STEP_TIME] = ("left out (--exclude step_time)"
                                       if "step_time" in opts.exclude_kinds
                                       else "references of different backends")
    # One-value quantities (judged at L3): one-point metrics as logged, and the final
    # evaluation of every periodically evaluated metric (its last shared point).
    evals = evaluation.evaluation_metrics(runs, per_step, declared=opts.eval_metrics,
                                          keep=keep)
    finals = {m: final_values([_series(r, m, keep) for r in runs])
              for m in per_step if m in evals}
    one_values = {m: (None, np.array([_series(r, m, keep).values[-1] for r in runs]))
                  for m in one_point}
    one_values.update(finals)
    tost_ok = g >= TOST_MIN_GROUP
    n_tost = sum(tost_ok and float(np.std(v)) > 0 for _, v in one_values.values())
    goals = [_goal(goal, runs, metrics, keep) for goal in opts.goals
             if isinstance(goal, Goal)]
    quantile_metrics = [m for m in per_step if m not in evals] \
        if len(runs) >= opts.quantile_min_runs and "quantile" not in opts.exclude_kinds \
        else []
    n_crit = (len(per_step) + sum(has_final_window(m, evals) for m in per_step)
              + len(one_values)
              + n_tost + len(goals) + int(bool(has_time))
              + len(quantile_metrics) * len(RUN_QUANTILES))
    cov = _cov(opts, n_crit)
    out: list[Derived] = []
    for m in per_step:
        series = [_series(r, m, keep) for r in runs]
        env = envelope_k(series, opts, g, cov)
        if env is None:
            skipped[m] = "a held-out seed differs from a zero-spread group (no finite k)"
        else:
            # An evaluation is a measurement even where every seed scored the same (a
            # saturated accuracy): it keeps the noise allowance.
            exact = float(np.max(np.abs(series[0].values))) if identical(series) \
                and m not in evals else None
            out.append(_envelope(m, env, opts, len(runs), g, exact))
        if has_final_window(m, evals):
            out.append(_final_window(m, final_window_tol(series, opts, g, cov), opts,
                                     len(runs), window_noise(series, opts, cov),
                                     window_bound(series, opts, cov)))
    notes: list[str] = []
    for m in quantile_metrics:
        series = [_series(r, m, keep) for r in runs]
        for q in RUN_QUANTILES:
            values = run_quantiles(series, q)
            if float(np.ptp(values)) == 0:  # a schedule, not a measurement of the run
                notes.append(f"{m}: no {q:g}-quantile criterion: every reference has the "
                             f"same value {values[0]:.6g}")
                continue
            out.append(_quantile(m, q, values, one_point_tol(values, opts, g, cov,
                                                             resolution_of(series)),
                                 len(runs), len(_all_common(series))))
    if per_step and not quantile_metrics and "quantile" not in opts.exclude_kinds:
        notes.append(f"no run-level quantile criteria: {len(runs)} reference seeds, "
                     f"written from {opts.quantile_min_runs} (with fewer, the range of "
                     "one run-level value detects only shifts of many seed standard "
                     "deviations)")
    envelope_only = [m for m in per_step
                     if m not in evals and is_gradient_norm(m)]
    if envelope_only:
        notes.append(f"{len(envelope_only)} gradient norm(s) ({', '.join(envelope_only[:3])}"
                     f"{', ...' if len(envelope_only) > 3 else ''}) judged by their "
                     "envelope only: no final-window closeness, since seeds end a run at "
                     "different gradient norms")
    for m, (step, values) in one_values.items():
        m_series = [_series(r, m, keep) for r in runs]
        res, pe = resolution_of(m_series), point_error(m_series, values)
        env_d = _one_point(m, values, one_point_tol(values, opts, g, cov, res, pe.se),
                           len(runs), step, pe)
        out.append(env_d)
        if not (tost_ok and float(np.std(values)) > 0):
            continue
        eq = _equivalence(m, values, equivalence_margin(values, opts, g, cov, pe.se), g,
                          step, pe)
        # Written only where it adds power: a TOST that detects no smaller shift than the
        # range criterion on the same value would only add false alarms.
        det_eq = float(eq.table["calibration"]["detectable_shift"])
        det_env = float(env_d.table["abs_tol"]) + float(np.ptp(values)) / 2
        if det_eq < det_env:
            out.append(eq)
        else:
            notes.append(f"{m}: no TOST equivalence criterion written: with {g} references "
                         f"and one candidate run it detects only shifts above "
                         f"{det_eq:.3g}, the range criterion {env_d.id} about "
                         f"{det_env:.3g} (abs_tol + half the seeds' range)")
    out += goals
    out += performance_goals([g for g in opts.goals if isinstance(g, PerformanceGoal)],
                             runs, opts.prices)
    out += best_of_relations(runs, one_point, [m for m in per_step
                                               if m in evals], keep)
    if has_time:
        lim = step_time_limits(runs, opts, g, cov)
        out.append(_step_time(lim, len(runs)))
        notes += [n] if (n := step_time_note(runs, lim, opts.settings.keep)) else []
    out += integrity(runs, opts, cov)
    if opts.require_gradcheck:
        out.append(_gradcheck())
    if "paired" not in opts.exclude_kinds:
        out += _paired_criteria(known_good, pair_references or runs, metrics,
                                [m for m in per_step if m in evals],
                                keep, notes)
    if "restore" not in opts.exclude_kinds:
        out += _restore_criterion(known_good, pair_references or runs, metrics, keep, notes)
    out = _unique_ids([d for d in out if d.table["kind"] not in opts.exclude_kinds])
    own = {identity.canonical_backend(r.backend) or "" for r in runs} - {""}
    out = [_scoped(d, own) for d in out]
    if not any(d.table["level"] == "L3" for d in out):
        raise RefrunInputError(
            "calibrate: no L3 (project goal) criterion can be derived from these "
            "references (no evaluation metric shared by all of them: none logged with "
            "log_eval, named as one (val/..., eval_..., .../test), logged at an evaluation "
            "cadence or declared with --eval-metric; no one-value metric), so no candidate "
            "could reach L3 or be judged at L4; state the project's goal with --goal "
            f"METRIC>=VALUE (or METRIC<=VALUE), e.g. --goal {schema.M_LOSS}<=0.5; "
            "nothing written")
    notes += [NO_CONVERGENCE] if finals else []
    notes += [n] if (n := evaluation.note(evals)) else []
    loss_metric = evaluation.training_loss(metrics)
    if loss_metric is not None:
        notes.append(f"{loss_metric}: the training loss (no metric is called "
                     f"{schema.M_LOSS!r}): L0 requires its every value to be finite "
                     "([l0] loss_metric)")
    out, wide = mark_too_wide(out, runs, keep)
    notes += [wide] if wide else []
    return Calibrated([r.run_id for r in runs], workload, backend, g, opts, out, skipped,
                      dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
                      .replace("+00:00", "Z"), notes, loss_metric=loss_metric)


def _paired_criteria(known_good: Sequence[RunData], references: Sequence[RunData],
                     metrics: Sequence[str], periodic: Sequence[str], keep: str,
                     notes: list[str]) -> list[Derived]:
    """``paired`` criteria from the known-good same-seed evidence: one on the training loss
    and one on every periodically evaluated metric (``periodic``: the evaluation metrics
    logged at several steps, :mod:`.evaluation`),
    each with the band of its own known-good divergence.  A port whose evaluation alone
    differs from its seed's (evaluated in lower precision, with dropout on, on stale
    weights) trains exactly as its seed did, so only an evaluation metric's pair can see
    it when the effect is inside the seeds' spread.  Why a metric gets none goes to
    ``notes``: once for the loss, and for an evaluation metric only when known-good
    evidence exists (without any, the loss's note says so for all)."""
    out: list[Derived] = []
    if schema.M_LOSS not in metrics:
        notes.append(f"{schema.M_LOSS}: no paired criterion: the references share no finite "
                     f"{schema.M_LOSS!r}")
    names = [schema.M_LOSS] if schema.M_LOSS in metrics else []
    for m in names + list(periodic):
        band, why = pairs.derive_band(known_good, references, m, keep)
        if band is not None:
            out.append(_paired(band))
        if why and (m == schema.M_LOSS or known_good):
            prefix = "" if m == schema.M_LOSS else f"{m}: "
            notes.append(prefix + why if band is None else f"paired: {prefix}{why}")
    return out


def _paired(b: pairs.PairedBand) -> Derived:
    structural = b.max_ratio == pairs.STRUCTURAL_MAX_RATIO
    src = (f"band = {b.max_ratio:.4g} x the running max |diff| of {len(b.pairs)} known-good "
           "pair(s) (" + "; ".join(f"{k} vs {r}: {why}" for k, r, why in b.pairs) + "); "
           + ("max_ratio is the structural 2^6.5 (geometric middle of float32 and TF32 "
              "rounding)" if structural else
              f"max_ratio raised to the known-good pairs' worst leave-one-out need "
              f"{max(b.needs):.4g}"))
    for hw, hb in b.hardware.items():
        own = [p for p in hb.pairs if p not in b.pairs]
        src += (f"; on {hw}: {hb.max_ratio:.4g} x the envelope of those and "
                + "; ".join(f"{k} vs {r}: {why}" for k, r, why in own))
    cal = {"pairs": float(len(b.pairs)), "floor": clean_float(b.floor),
           "structural": 1.0 if structural else 0.0}
    if b.needs:
        cal["worst"] = clean_float(max(b.needs))
    det = (f"a same-seed port whose divergence from its seed exceeds {b.max_ratio:.3g} x the "
           f"known-good pairs' at any step (e.g. bfloat16 or TF32 matmuls)")
    table = {"id": f"{_slug(b.metric)}-paired", "kind": "paired", "level": "L1",
             "metric": b.metric, "max_ratio": b.max_ratio, "band_steps": b.band_steps,
             "band_values": _knot_values(b.band_values),
             "description": "a port of one reference seed (same seed, initial weights "
                            "and data order) tracks that seed's run as closely as "
                            "known-good evidence does; " + src,
             "calibration": cal}
    if b.hardware:
        table["hardware_bands"] = {
            hw: {"band_steps": hb.band_steps, "band_values": _knot_values(hb.band_values),
                 "max_ratio": hb.max_ratio} for hw, hb in b.hardware.items()}
    return Derived(table, max(b.needs) if b.needs else None, None, det,
                   [src, f"detects: {det}"], len(b.pairs))


def _knot_values(values: Sequence[float]) -> list[float]:
    """A band's knot values as written: four significant digits (far finer than the
    band's ``max_ratio`` margin)."""
    return [float(f"{v:.4g}") for v in values]


def _range_comment(worst: float, tol: float, n: int, det: str) -> list[str]:
    """The comment lines of a min-max range criterion of one value per run."""
    return [_held_out_line(worst, tol - worst, n, "distance outside the range (negative: "
                           "inside)"), f"detects: {det}"]


def _held_out_line(worst: float, margin: float, n: int, what: str) -> str:
    return (f"held-out worst {what} {worst:.4g} over {n} seeds; threshold adds margin "
            f"{margin:.4g} (tolerance limit)")


# The slack of an envelope on a metric every reference logged identically (a schedule),
# relative to its largest |value|: float32 rounding is ~6e-8, a schedule that matters
# differs by far more than 1e-6.
EXACT_REL_TOL = 1e-6


# Criteria whose smallest detectable difference is an absolute shift of their metric.
ABSOLUTE_SHIFT_KINDS = ("envelope", "equivalence", "quantile")


def scale_of(series: list[_Series]) -> float:
    """A metric's own size in a reference run: the larger of how far the references' mean
    moves at the steps they share (a loss falling from 2.3 to 0.2: 2.1) and its mean
    magnitude there (a gradient norm hovering at 0.5: 0.5); for one value per run, its
    |mean|.  The yardstick of :func:`mark_too_wide`."""
    steps = _all_common(series)
    if not len(steps):  # one value per run, each logged at its own (last) step
        return abs(float(np.mean([s.values[-1] for s in series])))
    mean = np.mean([s.values[np.searchsorted(s.steps, steps)] for s in series], axis=0)
    return max(float(np.ptp(mean)), float(np.mean(np.abs(mean))))


def mark_too_wide(criteria: Sequence[Derived], runs: list[RunData], keep: str
                  ) -> tuple[list[Derived], str | None]:
    """``(criteria, note)``: every criterion whose detectable shift is at least its metric's
    own size (:func:`scale_of`) would pass a candidate whose metric is off by all of it
    (with 3 seeds the digits workload's accuracy envelope detected only a shift of 1.21),
    so its pass says little.  Its power sentence says so (``refrun accept`` prints it
    beside a pass) and one note names them all (None when there are none).  No threshold
    changes: more reference seeds are what narrows them."""
    out, weak = [], []
    scales: dict[str, float] = {}  # by metric: several criteria judge one metric
    for d in criteria:
        cal, m = d.table.get("calibration"), d.table.get("metric")
        if d.table["kind"] not in ABSOLUTE_SHIFT_KINDS or not isinstance(cal, dict) \
                or not isinstance(m, str) or "detectable_shift" not in cal:
            out.append(d)
            continue
        if m not in scales:
            scales[m] = scale_of([_series(r, m, keep) for r in runs])
        scale, shift = scales[m], float(cal["detectable_shift"])
        if not (scale > 0 and shift >= scale):
            out.append(d)
            continue
        weak.append(f"{d.id} (detects {shift:.3g}, {m} of size {scale:.3g})")
        wider = f"; too wide to see {m} itself (of size {scale:.3g} in the reference runs)"
        out.append(dataclasses.replace(d, detectable=d.detectable + wider,
                                       comment=[*d.comment, wider[2:]]))
    if not weak:
        return out, None
    return out, (f"{len(weak)} criteria cannot see a difference as large as their metric "
                 "itself (the larger of its mean |value| and how far it moves in a reference "
                 f"run), so their pass says little: {'; '.join(weak)}. With {len(runs)} "
                 "reference seeds the thresholds are this wide; more seeds narrow them")


def identical(series: list[_Series]) -> bool:
    """Whether every reference logged the same values at the same steps: the metric is a
    function of the configuration, not a measurement of the run (a learning-rate
    schedule), so no step of a candidate may differ from it."""
    first = series[0]
    return len(series) >= 2 and len(first.steps) > 0 and all(
        np.array_equal(s.steps, first.steps) and np.array_equal(s.values, first.values)
        for s in series[1:])


def _scoped(d: Derived, own: set[str] | frozenset[str] = frozenset()) -> Derived:
    """A criterion on an ``opt/`` metric applies to the backends whose probes record it
    (:data:`refrun.schema.OPT_BACKENDS`) and to the references' own (``own``: JAX
    references whose steps return the rate, ``refrun.jax.optimizer_metrics``, make a JAX
    candidate record it too): a candidate of another framework is not_applicable there,
    with the scope in its reason, instead of missing the metric."""
    if str(d.table.get("metric", "")).startswith(schema.OPT_PREFIX) \
            and "backends" not in d.table:
        d.table["backends"] = sorted(set(schema.OPT_BACKENDS) | set(own))
    return d


def _restore_criterion(known_good: Sequence[RunData], references: Sequence[RunData],
                       metrics: Sequence[str], keep: str, notes: list[str]) -> list[Derived]:
    """The ``restore`` criterion (L2) on the loss: a candidate that resumes from a
    checkpoint and replays steps reproduces them (:mod:`refrun.acceptance.kinds.restore`).
    It needs no threshold from the seeds: the replay is judged against the candidate's own
    first pass, bit for bit, or, where known-good same-seed evidence gives a band
    (:func:`refrun.acceptance.paired.derive_band`), within it counted from the restore (a
    step that is not deterministic).  Written whenever the references share the loss."""
    if schema.M_LOSS not in metrics:
        notes.append(f"no restore criterion: the references share no {schema.M_LOSS!r}")
        return []
    band, _ = pairs.derive_band(known_good, references, schema.M_LOSS, keep)
    table: dict[str, Any] = {
        "id": "resume-reproduces", "kind": "restore", "level": "L2", "metric": schema.M_LOSS}
    if band is None:
        how = ("bit for bit (no known-good same-seed evidence gave a band: on a machine whose "
               "step is not deterministic, a faithful resume needs one)")
        cal: dict[str, Any] = {"structural": 1.0}
    else:
        first = band.band_steps[0]
        table.update(band_steps=[s - first for s in band.band_steps],
                     band_values=[float(f"{v:.4g}") for v in band.band_values],
                     max_ratio=band.max_ratio)
        how = (f"within {band.max_ratio:.4g} x the divergence of {len(band.pairs)} "
               "known-good same-seed pair(s), counted from the restore")
        cal = {"pairs": float(len(band.pairs)), "structural": 0.0}
    det = ("a resume that lost the optimizer's state or the scheduler's position: a "
           "replayed learning rate or update count that is not the first pass's, or a "
           "replayed loss " + ("that differs from it" if band is None else "beyond the band"))
    src = ("the candidate's replayed steps against its own first pass: the optimizer's "
           f"state (opt/ metrics) exactly, the loss {how}")
    table.update(description="a run resumed from a checkpoint reproduces the steps it "
                             "replays; " + src, calibration=cal)
    return [Derived(table, None, None, det, [src, f"detects: {det}"], len(references))]


def _envelope(m: str, env: EnvelopeK, opts: CalibrationOptions, n: int, g: int,
              exact: float | None = None) -> Derived:
    """A std envelope.  ``exact``: the references are :func:`identical` and this is their
    largest |value|; then every step must be inside (the allowance of ``1 - min_fraction``
    of the steps is for run-to-run noise, which such a metric does not have, and would let
    a schedule that differs only early, a warmup left out, pass), to within
    ``EXACT_REL_TOL`` of that value (rounding: a rate computed in float32 on a device)."""
    worst, std, k_model, points = env.worst, env.std, env.k_model, env.points
    k = _round_up(env.k)
    tol = max(env.abs_tol, (EXACT_REL_TOL * exact) if exact else 0.0)
    tol = _round_up(tol) if tol > 0 else 0.0
    shift = k * std + tol
    level = "L1"
    fl = env.fraction if exact is None else None
    frac = 1.0 if exact is not None else fl.required if fl else opts.min_fraction
    slack = f" plus {tol:.3g}, the largest gap from seeds that agreed exactly" if tol else ""
    det = (f"a value off the references' own at any step by more than {tol:.3g} "
           f"({EXACT_REL_TOL:g} of its largest value)" if exact is not None else
           f"a shift of about {shift:.3g} ({k:.3g} x the median seed std {std:.3g}{slack}) "
           f"on more than {1 - frac:.1%} of the steps")
    table = {"id": f"{_slug(m)}-envelope", "kind": "envelope", "level": level, "metric": m,
             "band": "std", "k": k, **({"abs_tol": tol} if tol else {}),
             "min_fraction": frac, "calibrated_points": points,
             "description": f"{m} inside mean +- {'(k std + abs_tol)' if tol else 'k std'} "
                            f"of the reference group at >= {frac:.1%} of the steps "
                            + ("(every reference logged the same values at every step: a "
                               "schedule, not a measurement)" if exact is not None
                               else "(calibrated)"),
             "calibration": {"worst": clean_float(worst), "margin": clean_float(k - worst),
                             "seeds": n, "group_size": g, "model_k": clean_float(k_model),
                             "seed_level": clean_float(round(env.effects.level, 4)),
                             "seed_scale_sd": clean_float(round(env.effects.scale_sd, 4)),
                             "detectable_shift": clean_float(shift)}}
    comment = [_held_out_line(worst, k - worst, n, f"k needed for {opts.min_fraction:.0%}"
                              " of the steps")]
    if fl is not None:
        table["calibration"].update(shortfall_worst=clean_float(fl.worst),
                                    shortfall_limit=clean_float(fl.limit))
        comment.append(
            f"steps required inside {frac:.1%}: held-out seeds fell outside this band on "
            f"at most {fl.worst:.1%} of the steps, tolerance limit {fl.limit:.1%} "
            f"(between {fl.floor:.0%} and {opts.min_fraction:.0%} inside)")
    return Derived(table, worst, k - worst, det, [*comment, f"detects: {det}"], n)


def _final_window(m: str, fw: tuple[float, float, np.ndarray], opts: CalibrationOptions,
                  n: int, noise: WindowNoise | None = None,
                  bound: WindowBound | None = None) -> Derived:
    held, worst, _ = fw
    tol = _round_up(max(held, bound.rel if bound else 0.0, 1e-12))
    s = opts.settings
    det = (f"a change of the final-window mean by more than {tol:.3g} x the reference's "
           f"(window of {noise.points} points; wider for a candidate logging less often)"
           if noise and noise.rel > 0 else
           f"a change of the final-window mean by more than {tol:.3g} x the reference's")
    table = {"id": f"{_slug(m)}-final-window", "kind": "closeness", "level": "L1",
             "metric": m, "over": "final_window", "aggregate": "mean", "rel_tol": tol,
             "description": f"mean of {m} over the final window (last "
                            f"{s.final_points or f'{s.final_fraction:.0%}'} of the aligned "
                            "steps, at the candidate's own logged steps) close to the "
                            "reference group's (calibrated; a window of fewer points is "
                            "allowed its extra noise)",
             "calibration": {"worst": clean_float(worst), "margin": clean_float(tol - worst),
                             "seeds": n, "detectable_shift": clean_float(tol)}}
    comment = [_held_out_line(worst, tol - worst, n, "relative window mean difference")]
    if bound is not None:
        table["calibration"].update(held_out_limit=clean_float(held),
                                    prediction_bound=clean_float(bound.rel),
                                    window_se=clean_float(bound.se_rel),
                                    window_n_eff=clean_float(bound.n_eff))
        comment.append(
            f"{'decided by ' if bound.rel > held else ''}the prediction bound of one more "
            f"seed's window mean {bound.rel:.3g} (Student t on {n - 1} dof for the seeds' "
            f"spread, plus each window mean's own sampling error {bound.se_rel:.3g} x "
            f"|mean|, {bound.n_eff:.3g} effective of {bound.points} points) vs the "
            f"held-out limit {held:.3g}")
    if noise and noise.rel > 0:
        table.update(window_noise_rel=_round_up(noise.rel),
                     window_calibrated_points=noise.points,
                     window_noise_z=_round_up(noise.z))
        comment.append(f"per-point noise {noise.rel:.3g} x |mean| over a window of "
                       f"{noise.points} points: a window of k points is allowed "
                       f"sqrt(tol^2 + ({noise.z:.3g} noise)^2 (1 + 1/g)(1/k - "
                       f"1/{noise.points}))")
    return Derived(table, worst, tol - worst, det, [*comment, f"detects: {det}"], n)


def _one_point(m: str, values: np.ndarray, op: tuple[float, float, np.ndarray], n: int,
               step: int | None = None, pe: PointError | None = None) -> Derived:
    """A min-max envelope of one value per run (``step`` None), or of a periodically
    evaluated metric's final evaluation (``step``: the last evaluation step the
    references share; the check judges the last aligned evaluation).  ``pe``: the
    value's own sampling error (:func:`point_error`), written when known."""
    tol, worst, _ = op
    tol = _round_up(tol) if tol > 0 else 0.0
    spread = float(values.max() - values.min())
    det = (f"a value more than {tol:.3g} outside the reference group's range (seeds span "
           f"{spread:.3g})")
    cal = {"worst": clean_float(worst), "margin": clean_float(tol - worst),
           "seeds": n, "detectable_shift": clean_float(tol), **_point_error_keys(pe)}
    if step is None:
        table = {"id": f"{_slug(m)}-envelope", "kind": "envelope", "level": "L3",
                 "metric": m, "band": "minmax", "abs_tol": tol,
                 "description": f"{m} (one value per run) within the reference group's "
                                "range +- abs_tol (calibrated)", "calibration": cal}
    else:
        cal["step"] = float(step)
        table = {"id": f"{_slug(m)}-final", "kind": "envelope", "level": "L3",
                 "metric": m, "band": "minmax", "abs_tol": tol, "over": "last",
                 "description": f"final evaluation of {m} (the last evaluation the "
                                f"candidate shares with the references; calibrated at "
                                f"step {step}) within the reference group's range "
                                "+- abs_tol (calibrated)", "calibration": cal}
    return Derived(table, worst, tol - worst, det,
                   _range_comment(worst, tol, n, det) + _point_error_comment(pe), n)


def _point_error_keys(pe: PointError | None) -> dict[str, Any]:
    if pe is None or pe.examples is None:
        return {}
    return {"examples": float(pe.examples), "point_se": clean_float(pe.se)}


def _point_error_comment(pe: PointError | None) -> list[str]:
    if pe is None or pe.examples is None:
        return []
    return [f"a proportion of {pe.examples} examples (every value k/{pe.examples}): its "
            f"binomial error {pe.se:.3g} enters the prediction floor"]


def run_quantiles(series: list[_Series], q: float) -> np.ndarray:
    """Each reference's ``q``-quantile over the steps every reference logged (the check
    samples the references at the candidate's steps alike)."""
    steps = _all_common(series)
    return np.array([run_quantile(s.values[np.isin(s.steps, steps)], q) for s in series])


def _quantile(m: str, q: float, values: np.ndarray, op: tuple[float, float, np.ndarray],
              n: int, points: int) -> Derived:
    tol, worst, _ = op
    tol = _round_up(tol) if tol > 0 else 0.0
    det = (f"a run-level {q:g}-quantile more than {tol:.3g} outside the reference "
           f"group's range (seeds span {float(np.ptp(values)):.3g})")
    table = {"id": f"{_slug(m)}-p{round(q * 100)}", "kind": "quantile", "level": "L1",
             "metric": m, "q": q, "abs_tol": tol,
             "min_points": max(QUANTILE_MIN_POINTS, points // 2),
             "description": f"the {q:g}-quantile of {m} over the run, at the candidate's "
                            "own logged steps, within the reference group's range of the "
                            "same quantile +- abs_tol (calibrated)",
             "calibration": {"worst": clean_float(worst), "margin": clean_float(tol - worst),
                             "seeds": n, "detectable_shift": clean_float(tol),
                             "points": points}}
    return Derived(table, worst, tol - worst, det, _range_comment(worst, tol, n, det), n)


def _equivalence(m: str, values: np.ndarray, eq: tuple[float, float, np.ndarray], g: int,
                 step: int | None, pe: PointError | None = None) -> Derived:
    """A TOST ``equivalence`` criterion on a one-value quantity with a calibrated margin."""
    margin, worst, _ = eq
    margin = _round_up(margin)
    n = len(values)
    half = tost_half_width(values, g, TOST_ALPHA)
    det = (f"a final value shifted by more than about {max(margin - half, 0.0):.3g} from "
           f"the reference seeds' mean (margin {margin:.3g} minus the {1 - 2 * TOST_ALPHA:.0%} "
           f"interval's half-width {half:.3g} for {g} references)")
    what = "final evaluation" if step is not None else "value"
    cal = {"worst": clean_float(worst), "margin": clean_float(margin - worst), "seeds": n,
           "group_size": g, "detectable_shift": clean_float(max(margin - half, 0.0)),
           **_point_error_keys(pe)}
    if step is not None:
        cal["step"] = float(step)
    table = {"id": f"{_slug(m)}-equivalence", "kind": "equivalence", "level": "L3",
             "metric": m, "margin": margin, "alpha": TOST_ALPHA, "statistic": "last",
             "description": f"{what} of {m} equivalent to the reference seeds' (TOST, "
                            f"alpha {TOST_ALPHA:g}, margin calibrated on held-out seeds)",
             "calibration": cal}
    return Derived(table, worst, margin - worst, det,
                   [_held_out_line(worst, margin - worst, n, "TOST interval bound"),
                    *_point_error_comment(pe), f"detects: {det}"], n)


def _goal(goal: Goal, runs: list[RunData], shared: list[str], keep: str) -> Derived:
    """The project's stated goal as an L3 ``claim`` (last finite value of the run)."""
    if goal.metric not in shared:
        raise RefrunInputError(f"--goal {goal.metric}{goal.op}{goal.value:g}: metric "
                               f"{goal.metric!r} is not recorded (with a finite value) in "
                               f"every reference run; known: {', '.join(shared[:20])}")
    finals = [float(_series(r, goal.metric, keep).values[-1]) for r in runs]
    missed = [r.run_id for r, v in zip(runs, finals, strict=True)
              if not (v >= goal.value if goal.at_least else v <= goal.value)]
    src = (f"the project's goal (refrun calibrate --goal {goal.metric}{goal.op}{goal.value:g}); "
           f"reference final values {min(finals):.4g}..{max(finals):.4g}")
    if missed:
        src += (f"; {len(missed)} of {len(runs)} reference seeds miss it "
                f"({', '.join(missed)}): a benign candidate may miss it too")
    table = {"id": f"goal-{_slug(goal.metric)}", "kind": "claim", "level": "L3",
             "metric": goal.metric,
             ("at_least" if goal.at_least else "at_most"): float(goal.value),
             "statistic": "last", "description": src,
             "calibration": {"structural": 1.0, "seeds_missing_goal": float(len(missed))}}
    det = f"a final {goal.metric} {'below' if goal.at_least else 'above'} {goal.value:g}"
    return Derived(table, None, None, det, [src], len(runs))


def performance_goals(goals: Sequence[PerformanceGoal], runs: list[RunData],
                      prices: Prices) -> list[Derived]:
    """The project's L4 goals, one criterion each (declared, no threshold derived from the
    seeds).  A cost goal needs a price for every reference's hardware (one line naming
    ``--price`` otherwise; a candidate's hardware is priced, or not, when it is judged)."""
    for g in goals:
        if g.name != "cost":
            continue
        unpriced = sorted({f"{r.hardware or r.tags.get(schema.TAG_EXEC_HARDWARE) or '?'}"
                           for r in runs if rv.hardware_price(r, prices)[1] is None})
        if unpriced:
            raise RefrunInputError(
                f"--goal {g.text()}: no --price for the references' hardware "
                f"{', '.join(unpriced)} (e.g. --price {unpriced[0]}=1.0): a cost goal prices "
                "every run by its hardware; nothing written")
    return [Derived(g.table(), None, None, g.detectable(),
                    [f"declared L4 goal {g.text()} (not calibrated: judges migrated "
                     "candidates only)"], len(runs)) for g in goals]


def _step_time(lim: StepTimeLimit, n: int) -> Derived:
    worst, start = lim.worst, lim.start
    ratio = _round_up(lim.max_ratio)
    det = f"a steady median step time more than {ratio:.3g} x the reference group's"
    src = (f"max_ratio = the largest of the held-out seeds' limit {lim.held_out:.4g}, the "
           f"within-run block bootstrap {lim.bootstrap:.4g} and the floor {lim.floor:g} "
           f"(run-to-run noise back-to-back references do not show; --step-time-floor): "
           f"here the {lim.source}")
    table = {"id": "step-time", "kind": "step_time", "level": "L4", "max_ratio": ratio,
             "low_quantile": STEP_TIME_LOW_QUANTILE,
             "description": "steady median step time (warm-up and compilation steps left "
                            "out) against the references on the same backend (calibrated; "
                            "not applicable across backends); judged on the fastest "
                            f"{STEP_TIME_LOW_QUANTILE:.0%} of the steps (other processes "
                            "only add time: they measure the code) ; " + src,
             "calibration": {"worst": clean_float(worst), "margin": clean_float(ratio - worst),
                             "seeds": n, "warmup_end_step": start,
                             "held_out_ratio": clean_float(lim.held_out),
                             "bootstrap_ratio": clean_float(lim.bootstrap),
                             "floor": clean_float(lim.floor)}}
    return Derived(table, worst, ratio - worst, det,
                   [_held_out_line(worst, ratio - worst, n, "ratio"), src,
                    f"detects: {det}"], n)


def step_time_note(runs: list[RunData], lim: StepTimeLimit, keep: str) -> str | None:
    """One line when the calibrated step-time limit is too wide to catch a step
    ``STEP_TIME_SLOW`` times slower, saying what widened it: how far apart the references'
    steady step times are, and how much CPU other processes took while they ran
    (``sys/others_cpu_cores``, median per run).  None when the limit is narrower.

    The limit is not capped: a cap below what the references themselves show would fail
    a benign candidate recorded alike, and the references are the only evidence of the
    machine's spread.  The user is told instead, with what to do."""
    ratio = _round_up(lim.max_ratio)
    if ratio < STEP_TIME_SLOW:
        return None
    comp = list(schema.STEP_TIME_COMPILE_METRICS)
    # The statistic the criterion judges: the fastest STEP_TIME_LOW_QUANTILE of the steps.
    lows = [float(np.quantile(x, STEP_TIME_LOW_QUANTILE)) for r in runs
            if len(x := rv.steady_step_times(r, schema.M_STEP_TIME, comp, keep, lim.start)[1])]
    spread = max(lows) / min(lows) if lows and min(lows) > 0 else float("nan")
    others = [v for r in runs if (v := run_median(r, schema.M_SYS_OTHERS_CPU_CORES, keep))
              is not None]
    busy = (f"; other processes took up to {max(others):.2f} CPU cores (run median) while "
            "they ran") if others else ""
    todo = ("lower --step-time-floor" if lim.source == "floor" else
            "record the references where the candidates will run, with nothing else "
            "running, and calibrate again")
    return (f"step-time: max_ratio {ratio:g} (set by the {lim.source}) lets a candidate "
            f"{STEP_TIME_SLOW:g}x slower per step pass: the references' steady step times "
            f"(fastest {STEP_TIME_LOW_QUANTILE:.0%}) differ by up to {spread:.2f}x between "
            f"seeds{busy}; {todo}")


def best_of_relations(runs: list[RunData], one_point: list[str], periodic: list[str],
                      keep: str) -> list[Derived]:
    """A ``best_of`` criterion (L2) for every one-value metric that, in *every* reference,
    equals the min (or max) of a periodic evaluation metric of the same run to within
    ``BEST_OF_REL_TOL`` (:func:`refrun.acceptance.kinds.best_of.reports`, the check's own
    test): the workload reports its best checkpoint's evaluation.  Written
    only when at least one reference's best point is not its last one (else the value may
    just be the last evaluation, and a candidate whose last point is not its best would
    fail for nothing).  No threshold is calibrated: the relation holds within one run."""
    out: list[Derived] = []
    for m in one_point:
        values = [_series(r, m, keep).values[-1] for r in runs]
        for of in periodic:
            series = [rv.finite(_series(r, of, keep)) for r in runs]
            if not all(len(s.values) for s in series):
                continue
            for best in ("min", "max"):
                idx = [best_index(s.values, best) for s in series]
                bests = [float(s.values[i]) for s, i in zip(series, idx, strict=True)]
                if all(reports(v, b) for v, b in zip(values, bests, strict=True)) and \
                        any(i != len(s.values) - 1 for s, i in zip(series, idx, strict=True)):
                    out.append(_best_of(m, of, best, len(runs)))
    return out


def _best_of(m: str, of: str, best: str, n: int) -> Derived:
    why = (f"in all {n} reference runs {m} equals the {best} of {of} (the best checkpoint's "
           f"evaluation is reported), and in at least one the {best} is not the last point")
    det = f"a run that reports another evaluation than its {best} {of} (no best-checkpoint reload)"
    return Derived({"id": f"{_slug(m)}-is-{best}-of-{_slug(of)}", "kind": "best_of",
                    "level": "L2", "metric": m, "of": of, "best": best,
                    "rel_tol": BEST_OF_REL_TOL,
                    "description": f"{m} is the {best} of {of} within the run, as in every "
                                   "reference (calibrated: the relation, no threshold)",
                    "calibration": {"structural": 1.0, "seeds": n}}, None, None, det,
                   [why, f"detects: {det}"], n)


def _gradcheck() -> Derived:
    src = ("required by `refrun calibrate --require-gradcheck`: a broken computation whose "
           "effect on the curves is below the seeds' spread shows in a gradient check "
           "(parity of loss and gradients against the reference implementation), not in a "
           "seed-calibrated envelope")
    return Derived({"id": "gradient-checks", "kind": "gradcheck", "level": "L1",
                    "description": "every gradient-check run recorded for the candidate "
                                   "passed; none recorded fails. " + src,
                    "calibration": {"structural": 1.0}}, None, None,
                   "any failed gradient check, or none recorded for the candidate", [src])


# --- integrity counters ------------------------------------------------------------------------
def _scope(evidence_key: str, backends: set[str]) -> list[str]:
    return sorted(set(RECORDED_BY[evidence_key]) | backends)


def integrity(runs: list[RunData], opts: CalibrationOptions, cov: float) -> list[Derived]:
    """Compilation, host-sync, device-to-host-copy and CPU-fallback criteria: from the
    references' evidence when recorded, else the structural defaults (stated in the file
    as such)."""
    keep = opts.settings.keep
    own = {(r.backend or "").strip().lower() for r in runs} - {""}
    out = []
    # Compilations after warm-up.
    if all(schema.M_COMPILE_GRAPHS in r.metric_names for r in runs):
        totals = []
        for r in runs:
            x = _series(r, schema.M_COMPILE_GRAPHS, keep)
            start = int(x.steps[0]) + COMPILE_WARMUP_CALLS
            totals.append(float(x.values[x.steps >= start].sum()))
        lim, worst = upper_limit(np.array(totals), cov, opts.confidence)
        mx = float(math.ceil(lim))
        src = (f"from the references' own {schema.M_COMPILE_GRAPHS}: worst {worst:g} after "
               f"warm-up, limit {mx:g}")
        cal = {"worst": worst, "margin": mx - worst, "seeds": len(runs)}
    else:
        mx = float(STRUCTURAL_MAX_COMPILATIONS)
        src = ("structural default (the references record no compilation counter): a "
               "program run first after the step's warm-up (evaluation, checkpoint copy) "
               "compiles once; a recompilation per step exceeds this within a few steps")
        cal = {"structural": 1.0}
    out.append(Derived({"id": "compilations-after-warmup", "kind": "compilation",
                        "level": "L2", "max": mx, "metrics": [schema.M_COMPILE_GRAPHS],
                        "warmup_steps": COMPILE_WARMUP_CALLS,
                        "backends": _scope(schema.M_COMPILE_GRAPHS, own if cal.get("seeds")
                                           else set()),
                        "description": "no recompilation in the steady state; " + src,
                        "calibration": cal}, cal.get("worst"), cal.get("margin"),
                       f"more than {mx:g} compilations after warm-up", [src], len(runs)))
    out.append(_per_step_transfers(runs, opts, cov, own, HOST_SYNCS))
    out.append(_per_step_transfers(runs, opts, cov, own, HOST_COPIES))
    # CPU fallbacks.
    ops = [rv.tag_json(r, schema.TAG_FALLBACK_OPS) for r in runs]
    if all(isinstance(o, dict) for o in ops):
        allow = sorted({k for o in ops for k, v in o.items() if v})  # type: ignore[union-attr]
        src = "allowlist: the operations the references themselves fell back on"
        cal = {"seeds": len(runs)}
    else:
        allow = []
        src = ("structural default (the references record no fallback evidence): every "
               "operation runs on the device")
        cal = {"structural": 1.0}
    out.append(Derived({"id": "no-cpu-fallback", "kind": "fallback", "level": "L2",
                        "allow": allow,
                        "backends": _scope(schema.TAG_FALLBACK_OPS, own if cal.get("seeds")
                                           else set()),
                        "description": "no CPU fallback outside the allowlist; " + src,
                        "calibration": cal}, None, None,
                       "any CPU-fallback operation outside the allowlist", [src], len(runs)))
    return out


@dataclass(frozen=True)
class _TransferKind:
    """One per-step host-transfer criterion calibrate writes."""

    id: str
    metric: str
    what: str  # plural noun for the power statement
    description: str  # what the criterion asks for
    structural: str  # why the structural default separates none from one per step


HOST_SYNCS = _TransferKind(
    "host-syncs-per-step", schema.M_HOST_SYNCS, "host syncs",
    "no host synchronisation inside the training step (.item(), float(x), a host read of a "
    "jax.Array)",
    "a sync inside the step adds one per step; half a sync per step separates none from "
    "one per step")
HOST_COPIES = _TransferKind(
    "host-copies-per-step", schema.M_XFER_D2H, "device-to-host copies",
    "no device-to-host copy inside the training step (.cpu(), .tolist(), printing a "
    "tensor, .item())",
    "a copy inside the step adds one per step; half a copy per step separates none from "
    "one per step")


def _per_step_transfers(runs: list[RunData], opts: CalibrationOptions, cov: float,
                        own: set[str], kind: _TransferKind) -> Derived:
    """A ``host_transfers`` criterion on one per-step counter (mean after warm-up).

    With the references' own counter: ``max = round_up(L + 1/2)``, ``L`` the upper
    tolerance limit of the references' per-step means (so a reference that itself syncs
    once per step is the baseline, and one more per step still fails); scoped to the
    backends that record the counter plus the references' own.  Without it: the
    structural ``max = 1/2``, scoped to the backends whose probe records the counter
    (:data:`RECORDED_BY`); a criterion scoped to a backend that records nothing would
    leave every such candidate unjudged (not_evaluable), so the others are
    not_applicable instead."""
    keep, s = opts.settings.keep, opts.settings
    if all(kind.metric in r.metric_names for r in runs):
        means = []
        for r in runs:
            x = _series(r, kind.metric, keep)
            start = warmup_end(int(x.steps[0]), int(x.steps[-1]), s.warmup_steps,
                               s.warmup_fraction)
            means.append(float(x.values[x.steps >= start].mean()))
        lim, worst = upper_limit(np.array(means), cov, opts.confidence)
        mx = _round_up(lim + STRUCTURAL_SYNCS_PER_STEP)
        src = (f"from the references' own {kind.metric}: worst {worst:.3g}/step, "
               f"limit + half a transfer per step")
        cal: dict[str, Any] = {"worst": worst, "margin": mx - worst, "seeds": len(runs)}
    else:
        mx = STRUCTURAL_SYNCS_PER_STEP
        src = (f"structural default (the references record no {kind.metric}): "
               f"{kind.structural}")
        cal = {"structural": 1.0}
    table = {"id": kind.id, "kind": "host_transfers", "level": "L2",
             "metrics": [kind.metric], "statistic": "mean", "max": mx,
             "backends": _scope(kind.metric, own if cal.get("seeds") else set()),
             "description": f"{kind.description}; {src}", "calibration": cal}
    return Derived(table, cal.get("worst"), cal.get("margin"),
                   f"a mean above {mx:g} {kind.what} per step", [src], len(runs))
