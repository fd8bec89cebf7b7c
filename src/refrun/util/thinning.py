"""Bounded, spike-preserving views of long curves (pure numpy, no framework, no MLflow).

Used wherever a long curve must be shown or stored in a bounded number of points: MLflow's
metric history of a run or of a comparison run (the curves artifact keeps every point) and
the report's plotted traces.  The reduction returns *indices* into the input, so several
arrays sharing the same steps can be reduced consistently.

:func:`minmax_indices` keeps, per bucket of consecutive points, the first point, the smallest
and the largest value and the first non-finite point, plus the very last point: drawn as a
line, the view covers exactly the vertical range of the full curve in every bucket, so a
one-step spike or a NaN is never lost.  O(n), vectorised.
"""

from __future__ import annotations

import numpy as np


def bucket_edges(n: int, buckets: int) -> np.ndarray:
    """Start offsets of ``buckets`` near-equal consecutive buckets over ``n`` points
    (``buckets + 1`` edges, first 0, last ``n``; fewer buckets when ``n < buckets``)."""
    buckets = max(1, min(int(buckets), n))
    return np.linspace(0, n, buckets + 1).astype(np.int64)


def minmax_indices(y: np.ndarray, buckets: int) -> np.ndarray:
    """Indices of the first point, the minimum, the maximum and the first non-finite
    point of each bucket of consecutive points, plus the last point; sorted and unique.

    At most ``3 * buckets + 1`` finite extrema plus one non-finite point per bucket that
    has one (so a NaN/Inf stays a visible gap in the drawn line).  ``y``: 1-D float array.
    """
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    edges = bucket_edges(n, buckets)
    starts = edges[:-1]
    finite = np.isfinite(y)
    lo = np.where(finite, y, np.inf)
    hi = np.where(finite, y, -np.inf)
    seg_min = np.minimum.reduceat(lo, starts)
    seg_max = np.maximum.reduceat(hi, starts)
    bucket = np.repeat(np.arange(len(starts)), np.diff(edges))
    picks = [starts, np.array([n - 1])]
    for seg, vals in ((seg_min, lo), (seg_max, hi)):
        hit = np.flatnonzero(vals == seg[bucket])
        # First hit per bucket; buckets with no finite value hit +-inf on every point,
        # which only adds a point that is a gap anyway.
        _, first = np.unique(bucket[hit], return_index=True)
        picks.append(hit[first])
    if not finite.all():
        bad = np.flatnonzero(~finite)
        _, first = np.unique(bucket[bad], return_index=True)
        picks.append(bad[first])
    return sorted_unique(np.concatenate(picks))


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for integers, by sorting: NumPy 2.x's default (hash-based) unique
    takes ~0.5 s for 350,000 integers, a sort and a mask ~3 ms."""
    a = np.sort(np.asarray(a).ravel())
    if len(a) < 2:
        return a
    keep = np.empty(len(a), dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def bounded_view(values: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of a view of at most about ``max_points`` points of a curve.

    All indices when ``len(values) <= max_points``; otherwise :func:`minmax_indices` with
    ``max_points // 3`` buckets (first and last point always kept, at most one extra
    non-finite point per bucket).  ``values``: 1-D array in step order.
    """
    n = len(values)
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    return minmax_indices(np.asarray(values, dtype=np.float64), max(1, max_points // 3))


# Most points per metric refrun sends to MLflow's metric history when the whole curve is
# known before it is written (imports, comparison runs' diff/* and reldiff/*).  MLflow's
# charts draw about a thousand points per line, and its store takes ~0.1 ms a point, so
# more would only cost time; the curves artifact / comparison frames keep every point.
MLFLOW_MAX_POINTS = 1000
