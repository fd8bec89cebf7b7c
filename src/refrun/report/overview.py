"""The first screen of the report: which signals depart, where, and by how much.

Everything here is a pure function of the comparison JSON (``Comparison.to_dict()``) and
the assessment dict, so the numbers the page ranks by are *the* numbers of that JSON
(the browser tests compare them), plus one binned picture computed from the aligned
frames.

Departure is measured relative to the seeds' own spread: with a reference group,
``z = (candidate - mean of the references) / std of the references`` per step (the
engine's :class:`~refrun.comparison.group.GroupEnvelope`), and metrics are ranked by
their mean ``|z|`` over the aligned steps.  With a single reference there is no spread to
measure; metrics are then ranked by the mean relative difference
``|c - r| / max(|c|, |r|, eps)`` and the page says so.

Two groups are ranked separately (:func:`signal_group`): training and evaluation signals
first -- what numerical agreement is about -- then system and runtime metrics
(``schema.RUNTIME_PREFIXES``: ``sys/*``, ``perf/*``, ``xfer/*``, ``compile/*`` ...), whose
departure on another framework or backend (process memory, step time, compilations)
says nothing about the numbers.  A metric compared between runs of different backends
is marked (:attr:`Departure.cross_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from refrun import schema
from refrun.comparison import Comparison

Measure = Literal["mean_abs_z", "mean_rel_diff"]
Group = Literal["training", "runtime"]
FirstSource = Literal["engine", "outside_seed_range", "none"]

STRIP_BINS = 240  # columns of the all-metric picture (bins over the step axis)


@dataclass(frozen=True)
class Departure:
    """How far one metric's candidate departs from the reference (numbers from the JSON).

    ``score`` is the ranking key, the value of ``measure`` (``mean_abs_z``: mean over the
    aligned steps of ``|z|``, in units of the seeds' standard deviation; ``mean_rel_diff``
    when there is a single reference).  ``first_step`` is the first step the candidate
    left the reference band (see :func:`first_departure`)."""

    metric: str
    kind: str
    measure: Measure
    score: float | None
    max_abs_z: float | None
    step_of_max_abs_z: int | None
    fraction_outside: float | None
    first_step: int | None
    first_step_source: FirstSource
    max_abs_diff: float | None
    step_of_max_abs_diff: int | None
    aligned_steps: int
    group: Group = "training"
    cross_backend: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_departure(metric: Mapping[str, Any]) -> tuple[int | None, FirstSource]:
    """The first step at which the candidate left the reference band, from one metric's
    comparison JSON.

    Prefers the comparison engine's own first divergence when the comparison carries one
    (``first_divergence``: ``{"first_step": ...}`` - the first point of a *sustained*
    departure from the band, :mod:`refrun.comparison.divergence`; ``None`` there means
    the candidate never left it for long, which is the answer).  Otherwise the first
    aligned step strictly outside the reference runs' min-max range
    (``group.first_step_outside``).  ``(None, "none")`` when neither exists (a single
    reference from an engine without first divergence)."""
    fd = metric.get("first_divergence")
    if isinstance(fd, Mapping):
        step = fd.get("first_step", fd.get("step"))
        return (None if step is None else int(step)), "engine"
    if isinstance(fd, int | float) and not isinstance(fd, bool):
        return int(fd), "engine"
    group = metric.get("group") or {}
    step = group.get("first_step_outside")
    if step is not None:
        return int(step), "outside_seed_range"
    return None, "none"


def signal_group(name: str, kind: str) -> Group:
    """``runtime`` for system and runtime metrics (a name under
    ``schema.RUNTIME_PREFIXES``, or the step-time kind), else ``training`` (the loss,
    gradient norms, evaluation metrics, ``health/*``)."""
    if kind == "step_time" or name.startswith(schema.RUNTIME_PREFIXES):
        return "runtime"
    return "training"


def backends(comparison: Mapping[str, Any]) -> tuple[set[str], str | None]:
    """The reference runs' backends and the candidate's, from the comparison JSON."""
    refs = comparison.get("reference") or []
    ref_b = {str(r["backend"]) for r in refs if isinstance(r, Mapping) and r.get("backend")}
    cand = comparison.get("candidate") or {}
    cb = cand.get("backend") if isinstance(cand, Mapping) else None
    return ref_b, (str(cb) if cb else None)


def is_cross_backend(comparison: Mapping[str, Any]) -> bool:
    """True when the candidate ran on a backend none of the references ran on (both
    known): every metric is then compared across backends."""
    ref_b, cb = backends(comparison)
    return bool(ref_b) and cb is not None and cb not in ref_b


def departure(name: str, metric: Mapping[str, Any], cross_backend: bool = False
              ) -> Departure:
    """One metric's :class:`Departure` from its comparison JSON."""
    group = metric.get("group") or None
    measures = metric.get("measures") or {}
    first, source = first_departure(metric)
    return Departure(
        metric=name, kind=str(metric.get("kind", "")),
        measure="mean_abs_z" if group else "mean_rel_diff",
        score=group.get("mean_abs_z") if group else measures.get("mean_rel_diff"),
        max_abs_z=group.get("max_abs_z") if group else None,
        step_of_max_abs_z=group.get("step_of_max_abs_z") if group else None,
        fraction_outside=group.get("fraction_outside") if group else None,
        first_step=first, first_step_source=source,
        max_abs_diff=measures.get("max_abs_diff"),
        step_of_max_abs_diff=measures.get("step_of_max_abs_diff"),
        aligned_steps=int((metric.get("alignment") or {}).get("aligned_steps") or 0),
        group=signal_group(name, str(metric.get("kind", ""))), cross_backend=cross_backend,
    )


def rank_departures(comparison: Mapping[str, Any]) -> list[Departure]:
    """Every compared metric: training and evaluation signals first, then system and
    runtime metrics (:func:`signal_group`); within each group largest departure first,
    metrics without a score last by their fraction of steps outside the reference range
    (stable: ties keep the comparison's order).  So ``[0]`` is never a ``sys/*`` metric
    while any training or evaluation signal was compared."""
    xb = is_cross_backend(comparison)
    deps = [departure(k, m, xb) for k, m in (comparison.get("metrics") or {}).items()]
    return [d for g in ("training", "runtime")
            for d in _ranked([d for d in deps if d.group == g])]


def _ranked(deps: list[Departure]) -> list[Departure]:
    scored = sorted((d for d in deps if d.score is not None), key=lambda d: -float(d.score))
    # No z (the seeds agree exactly, e.g. counters or deterministic evals): by the
    # fraction of steps outside the seeds' range.
    rest = sorted((d for d in deps if d.score is None),
                  key=lambda d: -(d.fraction_outside or 0.0))
    return scored + rest


# --- the all-metric picture ------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Strip:
    """Binned departure of every metric over the common step axis.

    ``values[i, j]`` = the largest departure of ``metrics[i]`` in step bin ``j``
    (``[edges[j], edges[j+1])``; NaN where the metric has no aligned step in the bin)."""

    metrics: list[str]
    edges: np.ndarray
    values: np.ndarray
    measure: Literal["|z|", "|rel diff|"]


def binned_max(steps: np.ndarray, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per bin ``[edges[j], edges[j+1])`` (the last bin closed) the largest finite value of
    ``values`` at ``steps``; NaN for bins without one.  O(n)."""
    out = np.full(len(edges) - 1, np.nan)
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    if not ok.any():
        return out
    b = np.clip(np.searchsorted(edges, np.asarray(steps)[ok], side="right") - 1,
                0, len(out) - 1)
    np.fmax.at(out, b, v[ok])
    return out


def departure_values(frame: Any, col: str, saturate: float) -> np.ndarray:
    """``|frame[col]|`` per aligned step; where the seeds agree exactly (std 0, so no z)
    but the candidate differs, ``saturate`` (the picture's darkest colour) instead of a
    gap: a departure from seeds that never vary is the clearest departure there is."""
    if col not in frame:
        return np.full(len(frame), np.nan)
    v = np.abs(frame[col].to_numpy(dtype=np.float64))
    if "ref_std" in frame:
        d = frame["diff"].to_numpy(dtype=np.float64)
        agree = (frame["ref_std"].to_numpy() == 0) & np.isfinite(d) & (d != 0)
        v = np.where(np.isnan(v) & agree, saturate, v)
    return v


def strip(cmp: Comparison, order: Sequence[str], bins: int = STRIP_BINS,
          saturate: float = 6.0) -> Strip | None:
    """The |z| (reference group) or |rel diff| (single reference) of each metric in
    ``order``, binned over the union of the metrics' aligned steps."""
    frames = [(m, cmp.metrics[m].frame) for m in order
              if m in cmp.metrics and len(cmp.metrics[m].frame)]
    if not frames:
        return None
    group = len(cmp.reference) > 1
    col = "z" if group else "reldiff"
    lo = min(float(f["step"].iloc[0]) for _, f in frames)
    hi = max(float(f["step"].iloc[-1]) for _, f in frames)
    n = max(1, min(bins, int(hi - lo) + 1))
    edges = np.linspace(lo, hi + 1, n + 1)
    rows = [binned_max(f["step"].to_numpy(), departure_values(f, col, saturate), edges)
            for _, f in frames]
    return Strip([m for m, _ in frames], edges, np.vstack(rows),
                 "|z|" if group else "|rel diff|")
