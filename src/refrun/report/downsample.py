"""Reducing long curves for display while keeping every spike visible.

Only plotted traces are reduced; every number in the report is computed on full data.
Two pure reductions, both returning *indices* into the input (so several arrays sharing
the same steps can be reduced consistently):

* :func:`minmax_indices` - per bucket of consecutive points, the first, the smallest and
  the largest value and the first non-finite point.  Drawn as a line, the result covers
  exactly the same vertical range per bucket as the full curve: a one-step spike is never
  lost.  Vectorised, O(n).
* :func:`lttb_indices` - largest-triangle-three-buckets (Steinarsson 2013): one point per
  bucket, chosen to keep the visual shape; smoother, but a spike survives only if it makes
  the largest triangle in its bucket.

:func:`reduce_indices` picks one of them and returns all indices when the curve is already
short enough.
"""

from __future__ import annotations

import numpy as np

from refrun.util.thinning import bucket_edges, minmax_indices

DEFAULT_MAX_POINTS = 2400


def lttb_indices(x: np.ndarray, y: np.ndarray, n_out: int) -> np.ndarray:
    """Largest-triangle-three-buckets: ``n_out`` indices (first and last point kept).

    Each inner bucket keeps the point forming the largest triangle with the point kept in
    the previous bucket and the mean of the next bucket (area = |(xa-xc)(yb-ya) -
    (xa-xb)(yc-ya)| / 2).  Non-finite points are never chosen as extrema; the first
    non-finite point of each bucket is added so gaps stay visible.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n_out >= n or n < 3 or n_out < 3:
        return np.arange(n, dtype=np.int64)
    finite = np.isfinite(y)
    yf = np.where(finite, y, np.nan)
    edges = 1 + bucket_edges(n - 2, n_out - 2)
    out = np.empty(len(edges) + 1, dtype=np.int64)
    out[0], out[-1] = 0, n - 1
    a = 0
    for i in range(len(edges) - 1):
        s, e = edges[i], edges[i + 1]
        ns, ne = e, edges[i + 2] if i + 2 < len(edges) else n
        with np.errstate(all="ignore"):
            cx = x[ns:ne].mean()
            cy = np.nanmean(yf[ns:ne]) if finite[ns:ne].any() else yf[a]
            area = np.abs((x[a] - cx) * (yf[s:e] - yf[a]) - (x[a] - x[s:e]) * (cy - yf[a]))
        area = np.where(np.isfinite(area), area, -1.0)
        a = s + int(np.argmax(area))
        out[i + 1] = a
    extra = [out]
    if not finite.all():
        bad = np.flatnonzero(~finite)
        bucket = np.searchsorted(edges, bad, side="right")
        _, first = np.unique(bucket, return_index=True)
        extra.append(bad[first])
    return np.unique(np.concatenate(extra))


def reduce_indices(x: np.ndarray, y: np.ndarray, max_points: int = DEFAULT_MAX_POINTS,
                   method: str = "minmax") -> np.ndarray:
    """Indices of the points to draw: all of them when ``len(y) <= max_points``, else
    :func:`minmax_indices` with ``max_points // 3`` buckets (``method="minmax"``, the
    default: spikes always visible) or :func:`lttb_indices` (``method="lttb"``)."""
    n = len(y)
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    if method == "minmax":
        return minmax_indices(y, max(1, max_points // 3))
    if method == "lttb":
        return lttb_indices(x, y, max_points)
    raise ValueError(f"method must be 'minmax' or 'lttb', got {method!r}")


def union_indices(*indices: np.ndarray) -> np.ndarray:
    """Sorted union of index arrays (several curves on the same steps drawn together)."""
    if not indices:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(indices))
