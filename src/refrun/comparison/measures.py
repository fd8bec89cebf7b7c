"""Measures of the difference between two aligned curves: pure functions, no verdicts.

Conventions (every function): ``diff = candidate - reference`` in the metric's own units;
``reldiff = |candidate - reference| / max(|candidate|, |reference|, eps)`` (dimensionless,
in [0, 1] when the signs agree, up to 2 when they differ); inputs are aligned, finite
values at increasing steps (see :mod:`refrun.comparison.alignment`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_EPS = 1e-12


@dataclass(frozen=True)
class FinalWindow:
    """Measures over the last part of the aligned steps."""

    first_step: int
    last_step: int
    n: int
    mean_abs_diff: float
    max_abs_diff: float
    mean_rel_diff: float
    bias: float


@dataclass(frozen=True)
class DiffMeasures:
    """Differences between two aligned curves (units of the metric unless 'rel')."""

    n: int
    mean_abs_diff: float
    max_abs_diff: float
    step_of_max_abs_diff: int
    mean_rel_diff: float
    max_rel_diff: float
    bias: float
    rms_diff: float
    last_step: int
    reference_at_last_step: float
    candidate_at_last_step: float
    diff_at_last_step: float
    rel_diff_at_last_step: float
    final_window: FinalWindow


@dataclass(frozen=True)
class EvalPoint:
    """The two values at one evaluation step."""

    step: int
    reference: float
    candidate: float
    diff: float
    reldiff: float


@dataclass(frozen=True)
class StepTimeMeasures:
    """Step time over the steady window (steps >= ``warmup_end_step``), per run."""

    warmup_end_step: int
    reference_n: int
    candidate_n: int
    reference_median: float | None
    candidate_median: float | None
    ratio: float | None  # candidate median / reference median


@dataclass(frozen=True)
class CounterTotals:
    """Totals of a per-step counter (deltas) side by side: all steps and after warm-up."""

    warmup_end_step: int
    reference_total: float
    candidate_total: float
    reference_after_warmup: float
    candidate_after_warmup: float
    reference_steps: int
    candidate_steps: int


def diffs(ref: np.ndarray, cand: np.ndarray, eps: float = DEFAULT_EPS
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``diff = cand - ref`` and ``reldiff = |diff| / max(|ref|, |cand|, eps)``."""
    d = cand - ref
    scale = np.maximum(np.maximum(np.abs(ref), np.abs(cand)), eps)
    return d, np.abs(d) / scale


def final_window_size(n: int, final_fraction: float = 0.1, final_points: int | None = None
                      ) -> int:
    """Number of last aligned points in the final window: ``final_points`` when given,
    else ``ceil(final_fraction * n)``; at least 1 and at most ``n``."""
    if final_points is not None:
        k = int(final_points)
    else:
        if not 0 < final_fraction <= 1:
            raise ValueError(f"final_fraction must be in (0, 1], got {final_fraction}")
        k = math.ceil(final_fraction * n - 1e-9)
    return max(1, min(n, k))


def diff_measures(steps: np.ndarray, ref: np.ndarray, cand: np.ndarray,
                  eps: float = DEFAULT_EPS, final_fraction: float = 0.1,
                  final_points: int | None = None,
                  precomputed: tuple[np.ndarray, np.ndarray] | None = None) -> DiffMeasures:
    """All difference measures over aligned finite values (at least one point).

    mean_abs_diff = mean|c-r|; max_abs_diff = max|c-r| (first step where it occurs);
    mean_rel_diff = mean(|c-r| / max(|c|,|r|,eps)); bias = mean(c-r);
    rms_diff = sqrt(mean((c-r)^2)); final window = the last ``final_window_size`` points.
    ``precomputed``: ``diffs(ref, cand, eps)`` when the caller already has them.
    """
    n = len(steps)
    if n == 0:
        raise ValueError("diff_measures needs at least one aligned step")
    d, rd = precomputed if precomputed is not None else diffs(ref, cand, eps)
    ad = np.abs(d)
    imax = int(np.argmax(ad))
    k = final_window_size(n, final_fraction, final_points)
    wd, wad, wrd = d[n - k:], ad[n - k:], rd[n - k:]
    return DiffMeasures(
        n=n,
        mean_abs_diff=float(ad.mean()),
        max_abs_diff=float(ad[imax]),
        step_of_max_abs_diff=int(steps[imax]),
        mean_rel_diff=float(rd.mean()),
        max_rel_diff=float(rd.max()),
        bias=float(d.mean()),
        rms_diff=float(np.sqrt(np.mean(d * d))),
        last_step=int(steps[-1]),
        reference_at_last_step=float(ref[-1]),
        candidate_at_last_step=float(cand[-1]),
        diff_at_last_step=float(d[-1]),
        rel_diff_at_last_step=float(rd[-1]),
        final_window=FinalWindow(
            first_step=int(steps[n - k]), last_step=int(steps[-1]), n=k,
            mean_abs_diff=float(wad.mean()), max_abs_diff=float(wad.max()),
            mean_rel_diff=float(wrd.mean()), bias=float(wd.mean()),
        ),
    )


def eval_points(steps: np.ndarray, ref: np.ndarray, cand: np.ndarray,
                eps: float = DEFAULT_EPS) -> list[EvalPoint]:
    """The difference at every evaluation point (aligned steps)."""
    d, rd = diffs(ref, cand, eps)
    return [EvalPoint(*row) for row in zip(np.asarray(steps).tolist(), ref.tolist(),
                                           cand.tolist(), d.tolist(), rd.tolist(), strict=True)]


def warmup_end(first_step: int, last_step: int, warmup_steps: int | None = None,
               warmup_fraction: float = 0.1) -> int:
    """First step of the steady window: ``first_step + warmup_steps`` when given, else
    ``first_step + ceil(warmup_fraction * (last_step - first_step + 1))``, at least one
    step of warm-up skipped (compilation and caches dominate the first steps)."""
    if warmup_steps is None:
        warmup_steps = max(1, math.ceil(warmup_fraction * (last_step - first_step + 1) - 1e-9))
    return int(first_step + warmup_steps)


def steady_points(steps: np.ndarray, values: np.ndarray, start: int | float,
                  exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The one definition of steady-state step times: ``(steps, values, left out)``, the
    finite ``values`` at ``steps >= start`` (the warm-up end; compilation and cache
    warm-up come before it) whose step is not in ``exclude`` (compilation steps after the
    warm-up), and how many steady points ``exclude`` left out."""
    ok = np.isfinite(values) & (steps >= start)
    hit = ok & np.isin(steps, exclude) if exclude is not None and len(exclude) else \
        np.zeros(len(steps), dtype=bool)
    keep = ok & ~hit
    return steps[keep], values[keep], int(hit.sum())


def steady_values(steps: np.ndarray, values: np.ndarray, start: int | float) -> np.ndarray:
    """The steady-state values of :func:`steady_points` (no step excluded)."""
    return steady_points(steps, values, start)[1]


def step_time_ratio(ref_steps: np.ndarray, ref_values: np.ndarray, cand_steps: np.ndarray,
                    cand_values: np.ndarray, warmup_end_step: int) -> StepTimeMeasures:
    """Median step time of each run over its own finite points at steps >=
    ``warmup_end_step`` (seconds), and ratio = candidate median / reference median
    (> 1: the candidate is slower).  None where a run has no steady point."""
    r = steady_values(ref_steps, ref_values, warmup_end_step)
    c = steady_values(cand_steps, cand_values, warmup_end_step)
    rm = float(np.median(r)) if len(r) else None
    cm = float(np.median(c)) if len(c) else None
    ratio = cm / rm if rm and cm is not None else None
    return StepTimeMeasures(warmup_end_step, len(r), len(c), rm, cm, ratio)


def counter_totals(ref_steps: np.ndarray, ref_values: np.ndarray, cand_steps: np.ndarray,
                   cand_values: np.ndarray, warmup_end_step: int) -> CounterTotals:
    """Sums of a per-step counter over each run's own finite points: all steps, and steps
    >= ``warmup_end_step`` (e.g. recompilations after warm-up should be 0)."""
    rf, cf = np.isfinite(ref_values), np.isfinite(cand_values)
    return CounterTotals(
        warmup_end_step=int(warmup_end_step),
        reference_total=float(ref_values[rf].sum()),
        candidate_total=float(cand_values[cf].sum()),
        reference_after_warmup=float(steady_values(ref_steps, ref_values, warmup_end_step).sum()),
        candidate_after_warmup=float(steady_values(cand_steps, cand_values, warmup_end_step).sum()),
        reference_steps=int(np.count_nonzero(rf)),
        candidate_steps=int(np.count_nonzero(cf)),
    )


@dataclass(frozen=True)
class Straggler:
    """How much the slowest rank lags (multi-process runs; seconds unless 'ratio')."""

    ranks: int
    slowest_rank: int
    slowest_median_s: float
    median_of_medians_s: float
    ratio: float  # slowest rank's median step time / median over ranks of their medians


def straggler(per_rank_step_times: dict[int, np.ndarray]) -> Straggler | None:
    """Straggler measure of a multi-process run from each rank's step times (seconds).

    ``ratio = max_r median(t_r) / median_r median(t_r)`` over the finite step times of each
    rank (1.0: no straggler; 1.5: the slowest rank's typical step is 50 % longer than the
    typical rank's).  None when fewer than one rank has a finite step time."""
    meds = {r: float(np.median(v[np.isfinite(v)])) for r, v in per_rank_step_times.items()
            if np.isfinite(np.asarray(v, dtype=np.float64)).any()}
    if not meds:
        return None
    slow = max(meds, key=lambda r: (meds[r], -r))
    mid = float(np.median(list(meds.values())))
    return Straggler(len(meds), slow, meds[slow], mid, meds[slow] / mid if mid > 0 else math.inf)
