"""A reference group (several seeds): the seed-to-seed noise floor and where the candidate
stands in it.  Pure functions on aligned arrays; no verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np


@dataclass(frozen=True)
class GroupStats:
    """Per-step statistics across reference runs (rows: runs, columns: steps)."""

    min: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    std: np.ndarray  # sample standard deviation (ddof=1)


@dataclass(frozen=True)
class GroupEnvelope:
    """Position of the candidate relative to the reference group.

    ``z = (candidate - group mean) / group std`` per step, in units of the seed spread;
    steps where the group std is 0 have no z (counted in ``zero_spread_steps``).
    Outside the envelope means strictly below the group min or above the group max.
    """

    n_references: int
    n: int
    steps_outside: int
    fraction_outside: float
    steps_above: int
    steps_below: int
    first_step_outside: int | None
    mean_z: float | None
    mean_abs_z: float | None
    max_abs_z: float | None
    step_of_max_abs_z: int | None
    z_at_last_step: float | None
    final_mean_abs_z: float | None
    zero_spread_steps: int
    seed_mean_abs_diff: float | None


def group_stats(matrix: np.ndarray) -> GroupStats:
    """Per-step min, max, mean and sample std (ddof=1) over the rows of ``matrix``.

    Where every row holds the same value the mean is that value and the std exactly 0:
    float64 arithmetic would make them ``0.05000000000000001`` and ~8.5e-18 for three
    references logging a learning rate of 0.05, and a candidate logging the same 0.05
    would then stand ~0.8 seed standard deviations away."""
    m = np.asarray(matrix, dtype=np.float64)
    lo, hi = m.min(axis=0), m.max(axis=0)
    std = m.std(axis=0, ddof=1) if m.shape[0] > 1 else np.full(m.shape[1], np.nan)
    if m.shape[0] > 1:
        std = np.where(lo == hi, 0.0, std)
    return GroupStats(lo, hi, _mean(m, lo, hi), std)


def group_mean(matrix: np.ndarray) -> np.ndarray:
    """Per-step mean over the rows of ``matrix``; where every row holds the same value,
    that value (the float64 mean of identical values can be off in the last bit)."""
    m = np.asarray(matrix, dtype=np.float64)
    return _mean(m, m.min(axis=0), m.max(axis=0))


def _mean(m: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`group_mean` given the per-step min and max (which :func:`group_stats` has)."""
    return np.where(lo == hi, lo, m.mean(axis=0))


def z_scores(cand: np.ndarray, stats: GroupStats) -> np.ndarray:
    """``(cand - mean) / std`` per step; NaN where the std is 0 (no spread to measure)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (cand - stats.mean) / stats.std
    return np.where(stats.std > 0, z, np.nan)


def seed_mean_abs_diff(matrix: np.ndarray) -> float | None:
    """Mean over all pairs of reference runs of their mean |a - b| (metric units)."""
    m = np.asarray(matrix, dtype=np.float64)
    pairs = list(combinations(range(m.shape[0]), 2))
    if not pairs or m.shape[1] == 0:
        return None
    return float(np.mean([np.abs(m[i] - m[j]).mean() for i, j in pairs]))


def envelope_position(steps: np.ndarray, cand: np.ndarray, matrix: np.ndarray,
                      final_points: int = 1, stats: GroupStats | None = None
                      ) -> GroupEnvelope:
    """Where ``cand`` stands relative to the reference runs ``matrix`` at aligned steps.

    ``final_points``: size of the final window for ``final_mean_abs_z`` (the last points).
    ``stats``: :func:`group_stats` of ``matrix`` when the caller has it already.
    """
    stats = stats if stats is not None else group_stats(matrix)
    n = len(steps)
    above = cand > stats.max
    below = cand < stats.min
    out = above | below
    z = z_scores(cand, stats)
    has_z = np.isfinite(z)
    az = np.abs(z)
    k = max(1, min(n, final_points))
    tail = az[n - k:][has_z[n - k:]]
    imax = int(np.nanargmax(az)) if has_z.any() else None
    return GroupEnvelope(
        n_references=int(matrix.shape[0]),
        n=n,
        steps_outside=int(out.sum()),
        fraction_outside=float(out.mean()) if n else 0.0,
        steps_above=int(above.sum()),
        steps_below=int(below.sum()),
        first_step_outside=int(steps[np.argmax(out)]) if out.any() else None,
        mean_z=float(z[has_z].mean()) if has_z.any() else None,
        mean_abs_z=float(az[has_z].mean()) if has_z.any() else None,
        max_abs_z=float(az[imax]) if imax is not None else None,
        step_of_max_abs_z=int(steps[imax]) if imax is not None else None,
        z_at_last_step=float(z[-1]) if n and has_z[-1] else None,
        final_mean_abs_z=float(tail.mean()) if len(tail) else None,
        zero_spread_steps=int(n - has_z.sum()),
        seed_mean_abs_diff=seed_mean_abs_diff(matrix),
    )
