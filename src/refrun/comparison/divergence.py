"""First divergence: where a candidate leaves the reference band and stays out.

Reviewers ask "where does it start to go wrong?".  Per metric, :func:`first_divergence`
finds the first aligned point (step, or samples/tokens with an axis) from which the
candidate is outside the reference band for a sustained stretch; across metrics,
:func:`divergence_summary` orders the metrics by that point, and does the same for
per-parameter gradient norms (``grad_norm/<param>`` ...) so a blocked or differently
clipped gradient is traced to the parameter that departed first.  Pure functions on aligned
finite values (see :mod:`refrun.comparison.alignment`); no verdict.

The band at each aligned point (units of the metric)::

    tol = rtol * |mean of the references| + atol
    lower = min over reference runs - tol,   upper = max over reference runs + tol

(one reference run: its value +- tol; a group of seeds: their envelope widened by tol).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_RTOL = 0.02
DEFAULT_ATOL = 0.0
DEFAULT_SUSTAIN = 5
# Metric name prefixes of per-parameter gradient norms (``grad_norm/layer1.weight``).
PARAMETER_PREFIXES = ("grad_norm/", "grad_norms/", "grads/")


@dataclass(frozen=True)
class Divergence:
    """Where one metric's candidate left the reference band (axis units: ``axis``).

    ``first_step`` is None when it never left it for ``sustain`` points; ``first_outside_step``
    is the first point outside at all (possibly transient)."""

    metric: str
    axis: str
    first_step: int | None
    first_outside_step: int | None
    outside_points: int
    aligned_points: int
    sustain: int  # consecutive outside points required (or outside until the last point)
    direction: str | None  # "above" | "below" the band at first_step
    candidate_at_first: float | None
    band_at_first: tuple[float, float] | None
    rtol: float
    atol: float


def reference_band(reference: np.ndarray, rtol: float = DEFAULT_RTOL,
                   atol: float = DEFAULT_ATOL) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper band per aligned point from ``reference`` (runs x points); see the
    module doc for the formula."""
    ref = np.atleast_2d(np.asarray(reference, dtype=np.float64))
    tol = rtol * np.abs(ref.mean(axis=0)) + atol
    return ref.min(axis=0) - tol, ref.max(axis=0) + tol


def effective_sustain(n: int, sustain: int = DEFAULT_SUSTAIN) -> int:
    """Consecutive points required: ``sustain``, but at most ``ceil(n / 10)`` (at least 1),
    so a metric with few points (an evaluation every epoch) can diverge at all."""
    return max(1, min(int(sustain), math.ceil(n / 10)))


def first_divergence(metric: str, steps: np.ndarray, reference: np.ndarray,
                     candidate: np.ndarray, *, axis: str = "step", rtol: float = DEFAULT_RTOL,
                     atol: float = DEFAULT_ATOL, sustain: int = DEFAULT_SUSTAIN) -> Divergence:
    """The first aligned point from which ``candidate`` stays outside the reference band.

    Sustained: ``effective_sustain(n, sustain)`` consecutive points outside, or outside from
    that point to the last aligned point (at least 2 points: the candidate never came back).

    Args:
      steps: aligned axis values (increasing).
      reference: one row per reference run, one column per aligned point.
      candidate: candidate values at the aligned points.
    """
    steps = np.asarray(steps)
    cand = np.asarray(candidate, dtype=np.float64)
    n = len(steps)
    lo, hi = reference_band(reference, rtol, atol) if n else (cand, cand)
    above, below = cand > hi, cand < lo
    out = above | below
    k = effective_sustain(n, sustain)
    first = _first_sustained(out, k)
    first_any = int(np.argmax(out)) if out.any() else None
    return Divergence(
        metric=metric, axis=axis,
        first_step=int(steps[first]) if first is not None else None,
        first_outside_step=int(steps[first_any]) if first_any is not None else None,
        outside_points=int(np.count_nonzero(out)), aligned_points=n, sustain=k,
        direction=None if first is None else ("above" if above[first] else "below"),
        candidate_at_first=None if first is None else float(cand[first]),
        band_at_first=None if first is None else (float(lo[first]), float(hi[first])),
        rtol=rtol, atol=atol,
    )


def first_sustained(out: np.ndarray, k: int) -> int | None:
    """Index of the first stretch of ``True`` in ``out`` of length >= ``k``, or reaching
    the end with length >= min(k, 2); None when there is none (the rule of
    :func:`first_divergence`, for a caller with its own band)."""
    return _first_sustained(np.asarray(out, dtype=bool), k)


def _first_sustained(out: np.ndarray, k: int) -> int | None:
    """Index of the first run of ``True`` of length >= k, or reaching the end with length
    >= min(k, 2)."""
    if not out.any():
        return None
    m = np.concatenate(([False], out, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    starts, ends = edges[0::2], edges[1::2]  # [start, end) of each outside run
    n = len(out)
    for a, b in zip(starts, ends, strict=True):
        length = b - a
        if length >= k or (b == n and length >= min(k, 2)):
            return int(a)
    return None


@dataclass(frozen=True)
class FirstDeparture:
    """One metric in the order of departure: where it first left the band (not to be
    confused with the report's :class:`refrun.report.overview.Departure`, how far a metric
    departs)."""

    metric: str
    first_step: int


@dataclass(frozen=True)
class DivergenceSummary:
    """Across metrics (per-parameter gradient norms included): which departed first
    (``first_metric`` at ``first_step``, ties all listed in ``first_metrics``), the full
    order, and the same among per-parameter gradient norms only (``first_parameter``: the
    parameter name without its metric prefix)."""

    axis: str
    first_metric: str | None
    first_metrics: list[str]
    first_step: int | None
    order: list[FirstDeparture]
    never_departed: list[str]
    first_parameter: str | None
    first_parameter_metric: str | None
    first_parameter_step: int | None
    parameter_order: list[FirstDeparture]


def is_parameter_metric(metric: str) -> bool:
    """True for a per-parameter gradient norm (``grad_norm/<param>`` ...)."""
    return metric.startswith(PARAMETER_PREFIXES)


def parameter_name(metric: str) -> str:
    """``grad_norm/layer1.weight`` -> ``layer1.weight``."""
    for p in PARAMETER_PREFIXES:
        if metric.startswith(p):
            return metric[len(p):]
    return metric


def divergence_summary(divs: list[Divergence], axis: str = "step") -> DivergenceSummary:
    """Order metrics by their first sustained departure (earliest first; ties by name)."""
    departed = sorted((d for d in divs if d.first_step is not None),
                      key=lambda d: (d.first_step, d.metric))
    order = [FirstDeparture(d.metric, int(d.first_step)) for d in departed]  # type: ignore[arg-type]
    params = [o for o in order if is_parameter_metric(o.metric)]
    first = order[0] if order else None
    ties = [o.metric for o in order if first is not None and o.first_step == first.first_step]
    p0 = params[0] if params else None
    return DivergenceSummary(
        axis=axis,
        first_metric=first.metric if first else None, first_metrics=ties,
        first_step=first.first_step if first else None, order=order,
        never_departed=sorted(d.metric for d in divs if d.first_step is None),
        first_parameter=parameter_name(p0.metric) if p0 else None,
        first_parameter_metric=p0.metric if p0 else None,
        first_parameter_step=p0.first_step if p0 else None,
        parameter_order=params,
    )
