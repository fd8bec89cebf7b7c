"""Aligning runs by step, with every rule applied stated in an :class:`AlignmentReport`.

Rules (documented in docs/comparison.md):

* **Logging order**: points are put in logging order (``seq``) first, then ordered by step;
  a permuted logging order changes nothing but the ``backwards`` count.
* **Repeated steps** (a restart from a checkpoint): one value per step, by default the last
  one written (``keep="last"``); ``keep="first"`` keeps the first, as Megatron's tests do.
  The repeated step ranges are reported.
* **Same cadence**: an inner join on step; steps only in one run are counted.
* **Different cadence**: compared on the common steps; optionally one side is linearly
  interpolated onto the other's steps inside its own step range (never extrapolated).
* **NaN/±Inf**: counted per run and excluded from the measures, never replaced by a number.
* **Steps numbered differently** (:func:`step_shift`): two runs whose steps are the same
  schedule shifted by a constant (one labelling a step by the steps completed, 1, 2, ...,
  the other by the index of the step just ended, 0, 1, ...) are still compared at equal
  step numbers; a note says so, and a same-seed pair refuses to compare them.
* **Axis** (``step``, ``samples``, ``tokens``): with ``samples`` or ``tokens`` each run's
  steps are first mapped to the samples (tokens) it had seen at the end of that step
  (:func:`axis_map`, :func:`to_axis`), so a candidate with twice the global batch lines up
  with its reference at equal data seen; the mapping of every run is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from typing import Literal

import numpy as np

from refrun.comparison.group import group_mean
from refrun.util.thinning import sorted_unique

Keep = Literal["last", "first"]
Interpolate = Literal["none", "candidate", "reference"]
Axis = Literal["step", "samples", "tokens"]
AxisSource = Literal["recorded", "global_batch", "global_batch*tokens_per_sample"]

MAX_RANGES = 50


@dataclass(frozen=True)
class SeriesReport:
    """What one run's points for one metric looked like before alignment."""

    points: int
    steps: int
    first_step: int | None
    last_step: int | None
    cadence: float | None
    repeated_points: int
    repeated_steps: int
    repeated_ranges: list[list[int]]
    backwards: int
    nonfinite: int
    nan: int
    posinf: int
    neginf: int
    first_nonfinite_step: int | None


@dataclass(frozen=True, eq=False)
class Series:
    """One value per step (sorted, unique steps) and the report of how it was resolved."""

    steps: np.ndarray
    values: np.ndarray
    report: SeriesReport


@dataclass(frozen=True)
class AlignmentReport:
    """How a metric's runs were aligned; ``notes`` states each rule that applied."""

    keep: str
    interpolate: str
    interpolated: str | None
    aligned_steps: int
    common_steps: int
    only_in_reference: int
    only_in_candidate: int
    excluded_nonfinite: int
    first_aligned_step: int | None
    last_aligned_step: int | None
    cadence_differs: bool
    reference: SeriesReport | list[SeriesReport]
    candidate: SeriesReport
    group_incomplete_steps: int = 0
    notes: list[str] = field(default_factory=list)
    axis: str = "step"  # what aligned_steps/first_/last_aligned_step count
    axis_mapping: list[AxisMapping] = field(default_factory=list)  # one per run
    step_shift: int | None = None  # the candidate's steps are the references' + this


@dataclass(frozen=True)
class AxisMapping:
    """How one run's steps were mapped onto the comparison axis (reported per run)."""

    run: str  # "reference", "reference[1]", "candidate"
    axis: str
    source: str  # AxisSource: the recorded progress metric, or derived from tags
    per_step: float | None  # median axis units per step (the global batch for samples)
    first: int | None  # axis value at the run's first mapped step
    last: int | None
    unmapped_steps: int  # metric steps outside the progress record (dropped)


@dataclass(frozen=True, eq=False)
class AxisMap:
    """A run's cumulative progress: ``values[i]`` samples (tokens) seen at the end of
    ``steps[i]`` (sorted, unique steps)."""

    steps: np.ndarray
    values: np.ndarray
    source: str


def axis_map(axis: Axis, recorded: tuple[np.ndarray, np.ndarray] | None,
             all_steps: np.ndarray, global_batch: int | None,
             tokens_per_sample: int | None = None) -> AxisMap | None:
    """A run's step -> cumulative samples (tokens) mapping, or None when it cannot be known.

    Args:
      axis: ``samples`` or ``tokens``.
      recorded: the run's own ``progress/<axis>`` series (resolved steps, values), used
        when present: it is what the run really consumed.
      all_steps: every step the run recorded (any metric), for the derived mapping.
      global_batch: samples per step (``refrun.global_batch``); derived mapping
        ``samples(s) = (s - s0 + 1) * global_batch`` with ``s0`` the run's first step.
      tokens_per_sample: for ``tokens`` without a recorded series:
        ``tokens(s) = samples(s) * tokens_per_sample``.
    """
    if recorded is not None and len(recorded[0]):
        st, v = recorded
        ok = np.isfinite(v)
        return AxisMap(np.asarray(st)[ok], np.rint(np.asarray(v)[ok]).astype(np.int64),
                       "recorded")
    if global_batch is None or global_batch <= 0 or not len(all_steps):
        return None
    per = global_batch
    source = "global_batch"
    if axis == "tokens":
        if tokens_per_sample is None or tokens_per_sample <= 0:
            return None
        per = global_batch * tokens_per_sample
        source = "global_batch*tokens_per_sample"
    steps = np.unique(np.asarray(all_steps, dtype=np.int64))
    return AxisMap(steps, (steps - steps[0] + 1) * np.int64(per), source)


def to_axis(series: Series, amap: AxisMap, keep: Keep = "last") -> tuple[Series, int]:
    """``series`` with its steps replaced by axis values (pure).

    A step present in the map takes its value; a step between two mapped steps is
    linearly interpolated (rounded to an integer); a step outside the map is dropped and
    counted.  Two steps landing on one axis value (a step that consumed nothing) keep
    the ``keep`` one.  The series report stays in the run's own steps.
    """
    st, av = amap.steps, amap.values
    if not len(st):
        return Series(series.steps[:0], series.values[:0], series.report), len(series.steps)
    inside = (series.steps >= st[0]) & (series.steps <= st[-1])
    steps = series.steps[inside]
    x = np.rint(interpolate_onto(st, av.astype(np.float64), steps))
    ok = np.isfinite(x)
    x, vals = x[ok].astype(np.int64), series.values[inside][ok]
    dropped = int(len(series.steps) - len(x))
    if len(x) > 1 and not np.all(x[1:] > x[:-1]):
        u, uv, _, _ = _dedup(x, vals, keep)
        x, vals = u, uv
    return Series(x, vals, series.report), dropped


def mapping_report(name: str, axis: str, amap: AxisMap, dropped: int) -> AxisMapping:
    """The :class:`AxisMapping` of one run (median axis units per step)."""
    per = None
    if len(amap.steps) > 1:
        per = float(np.median(np.diff(amap.values) / np.diff(amap.steps)))
    elif len(amap.steps) == 1:
        per = float(amap.values[0])
    return AxisMapping(name, axis, amap.source, per,
                       int(amap.values[0]) if len(amap.values) else None,
                       int(amap.values[-1]) if len(amap.values) else None, dropped)


@dataclass(frozen=True, eq=False)
class Aligned:
    """Aligned finite values: ``reference`` has one row per reference run."""

    steps: np.ndarray
    reference: np.ndarray
    candidate: np.ndarray
    report: AlignmentReport

    @property
    def reference_mean(self) -> np.ndarray:
        """The reference curve: the run itself, or the per-step mean of a group."""
        if self.reference.shape[0] == 1:
            return self.reference[0]
        return group_mean(self.reference)


def _ranges(steps: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """Contiguous runs of ``mask`` over ``steps`` as ``[first, last, count]``."""
    if not mask.any():
        return []
    m = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    starts, ends = edges[0::2], edges[1::2] - 1
    return [[int(steps[a]), int(steps[b]), int(b - a + 1)]
            for a, b in zip(starts[:MAX_RANGES], ends[:MAX_RANGES], strict=True)]


def resolve_series(steps: np.ndarray, values: np.ndarray, seq: np.ndarray | None = None,
                   keep: Keep = "last") -> Series:
    """One value per step from raw points.

    Points are put in logging order (``seq``; row order when None), then for each step
    the last (or first) point written is kept.  Nothing is dropped for being non-finite:
    NaN/±Inf stay in the series and are counted.
    """
    if keep not in ("last", "first"):
        raise ValueError(f"keep must be 'last' or 'first', got {keep!r}")
    steps = np.asarray(steps, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    n = len(steps)
    if seq is not None and n > 1:
        seq = np.asarray(seq)
        if np.any(seq[1:] < seq[:-1]):
            order = np.argsort(seq, kind="stable")
            steps, values = steps[order], values[order]
    strictly_increasing = n < 2 or bool(np.all(steps[1:] > steps[:-1]))
    if strictly_increasing:  # the common case: nothing to reorder or deduplicate
        u, uv, counts = steps, values, np.ones(n, dtype=np.int64)
        backwards = 0
    else:
        u, uv, counts, backwards = _dedup(steps, values, keep)
    rep = counts > 1
    finite = np.isfinite(uv)
    nonfinite = int(len(uv) - np.count_nonzero(finite))
    nan = int(np.count_nonzero(np.isnan(uv))) if nonfinite else 0
    posinf = int(np.count_nonzero(uv == np.inf)) if nonfinite else 0
    report = SeriesReport(
        points=n,
        steps=len(u),
        first_step=int(u[0]) if len(u) else None,
        last_step=int(u[-1]) if len(u) else None,
        cadence=float(np.median(np.diff(u))) if len(u) > 1 else None,
        repeated_points=int(n - len(u)),
        repeated_steps=int(np.count_nonzero(rep)),
        repeated_ranges=_ranges(u, rep),
        backwards=backwards,
        nonfinite=nonfinite,
        nan=nan,
        posinf=posinf,
        neginf=nonfinite - nan - posinf,
        first_nonfinite_step=int(u[np.argmin(finite)]) if nonfinite else None,
    )
    return Series(u, uv, report)


def _dedup(steps: np.ndarray, values: np.ndarray, keep: Keep
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Unique steps, the kept value per step, points per step, and the backwards count
    (inputs in logging order)."""
    n = len(steps)
    backwards = int(np.count_nonzero(steps[1:] < steps[:-1]))
    # Sort by step keeping logging order inside a step (stable), then take the last or
    # first point of each step.
    if backwards:
        order = np.argsort(steps, kind="stable")
        s, v = steps[order], values[order]
    else:
        s, v = steps, values
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n) - 1
    pick = ends if keep == "last" else starts
    return s[starts], v[pick], ends - starts + 1, backwards


def interpolate_onto(xp: np.ndarray, fp: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Linear interpolation of ``(xp, fp)`` at ``x`` (all inside ``[xp[0], xp[-1]]``).

    Unlike ``np.interp``, a value at an exact step is returned as is, and a value between
    two steps is NaN when either neighbour is non-finite (a gap is never bridged).
    """
    if len(xp) == 1:
        return np.where(x == xp[0], fp[0], np.nan)
    i = np.clip(np.searchsorted(xp, x, side="right") - 1, 0, len(xp) - 2)
    x0, x1 = xp[i], xp[i + 1]
    y0, y1 = fp[i], fp[i + 1]
    exact0, exact1 = x == x0, x == x1
    with np.errstate(invalid="ignore"):
        t = (x - x0) / (x1 - x0)
        y = y0 + t * (y1 - y0)
    return np.where(exact0, y0, np.where(exact1, y1, y))


def step_shift(reference: np.ndarray, candidate: np.ndarray) -> int | None:
    """The constant ``d != 0`` with ``candidate[i] == reference[i] + d`` for every ``i``,
    when both hold the same number (at least 2) of sorted steps; else None.

    Such runs logged the same schedule and number its steps differently: a step labelled
    ``s`` in one is ``s - d`` in the other (e.g. ``d = 1``: steps completed against the
    index of the step just ended).  Equal step numbers are then not the same point of
    training.  Two lone points, or schedules of different lengths, are not called
    shifted: nothing but the numbers could tell a shift from another schedule."""
    a, b = np.asarray(reference), np.asarray(candidate)
    if len(a) < 2 or len(a) != len(b):
        return None
    d = b - a
    return int(d[0]) if d[0] != 0 and np.all(d == d[0]) else None


def shift_note(shift: int, reference: np.ndarray, candidate: np.ndarray) -> str:
    """One sentence on a :func:`step_shift` (``reference``/``candidate``: their steps)."""
    return (f"the candidate's steps are the reference's shifted by {shift:+d} "
            f"({candidate[0]}..{candidate[-1]} against {reference[0]}..{reference[-1]}, "
            f"{len(candidate)} each): the runs number steps differently (e.g. steps "
            "completed against the index of the step just ended), so equal step numbers "
            "are not the same point of training; log both runs' steps the same way")


def _take(series: Series, steps: np.ndarray) -> np.ndarray:
    """Values at ``steps`` (a subset of the series' steps)."""
    if len(steps) == len(series.steps):  # a subset of equal length is the same steps
        return series.values
    return series.values[np.searchsorted(series.steps, steps)]


def _intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted common steps of two sorted unique step arrays (fast when they are equal)."""
    if len(a) == len(b) and np.array_equal(a, b):
        return a
    return np.intersect1d(a, b, assume_unique=True)


def _inside(steps: np.ndarray, series: Series) -> np.ndarray:
    if not len(series.steps):
        return np.zeros(len(steps), dtype=bool)
    return (steps >= series.steps[0]) & (steps <= series.steps[-1])


def align(reference: Series | list[Series], candidate: Series,
          interpolate: Interpolate = "none", keep: Keep = "last") -> Aligned:
    """Align a reference (or a group of references) and a candidate on steps.

    ``interpolate="none"``: the steps present in every run.  ``"candidate"``: the candidate
    is interpolated onto the reference steps inside the candidate's step range;
    ``"reference"``: each reference is interpolated onto the candidate's steps.  Steps at
    which any value is non-finite are excluded and counted in ``excluded_nonfinite``.
    ``keep`` is only recorded in the report (series are resolved by :func:`resolve_series`).
    """
    refs = [reference] if isinstance(reference, Series) else list(reference)
    if not refs:
        raise ValueError("align needs at least one reference series")
    if interpolate not in ("none", "candidate", "reference"):
        raise ValueError(f"interpolate must be none|candidate|reference, got {interpolate!r}")
    ref_steps = reduce(_intersect, [r.steps for r in refs])
    group_incomplete = 0
    if len(refs) > 1 and any(len(r.steps) != len(ref_steps) for r in refs):
        # (Every run holding exactly the common steps: nothing is incomplete, no union.)
        # Sorted unique by sorting: NumPy 2.x's hash-based np.union1d takes ~0.3 s per
        # pair of 100k-step series, a sort a few ms.
        union = sorted_unique(np.concatenate([r.steps for r in refs]))
        group_incomplete = int(len(union) - len(ref_steps))
    interpolated = None
    if interpolate == "none":
        common = _intersect(ref_steps, candidate.steps)
        ref_vals = np.vstack([_take(r, common) for r in refs])
        cand_vals = _take(candidate, common)
        only_ref = len(ref_steps) - len(common)
        only_cand = len(candidate.steps) - len(common)
    elif interpolate == "candidate":
        inside = _inside(ref_steps, candidate)
        common = ref_steps[inside]
        ref_vals = np.vstack([_take(r, common) for r in refs])
        cand_vals = interpolate_onto(candidate.steps, candidate.values, common)
        only_ref = int(np.count_nonzero(~inside))
        only_cand = len(np.setdiff1d(candidate.steps, ref_steps, assume_unique=True))
        interpolated = ("candidate linearly interpolated onto the reference steps inside "
                        "its own step range (no extrapolation)")
    else:
        inside = np.logical_and.reduce([_inside(candidate.steps, r) for r in refs])
        common = candidate.steps[inside]
        ref_vals = np.vstack([interpolate_onto(r.steps, r.values, common) for r in refs])
        cand_vals = _take(candidate, common)
        only_cand = int(np.count_nonzero(~inside))
        only_ref = len(np.setdiff1d(ref_steps, candidate.steps, assume_unique=True))
        interpolated = ("reference linearly interpolated onto the candidate steps inside "
                        "its own step range (no extrapolation)")
    ok = np.isfinite(cand_vals) & np.isfinite(ref_vals).all(axis=0)
    steps = common[ok]
    shift = step_shift(ref_steps, candidate.steps)
    ref_cad = [r.report.cadence for r in refs]
    cadence_differs = any(c != candidate.report.cadence for c in ref_cad)
    report = AlignmentReport(
        keep=keep,
        interpolate=interpolate,
        interpolated=interpolated,
        aligned_steps=len(steps),
        common_steps=len(common),
        only_in_reference=int(only_ref),
        only_in_candidate=int(only_cand),
        excluded_nonfinite=int(len(common) - len(steps)),
        first_aligned_step=int(steps[0]) if len(steps) else None,
        last_aligned_step=int(steps[-1]) if len(steps) else None,
        cadence_differs=cadence_differs,
        reference=refs[0].report if len(refs) == 1 else [r.report for r in refs],
        candidate=candidate.report,
        group_incomplete_steps=group_incomplete,
        step_shift=shift,
        notes=_notes(refs, candidate, keep, interpolated, cadence_differs, len(common),
                     int(len(common) - len(steps)), group_incomplete, ref_steps, shift),
    )
    return Aligned(steps, ref_vals[:, ok], cand_vals[ok], report)


def _notes(refs: list[Series], cand: Series, keep: str, interpolated: str | None,
           cadence_differs: bool, common: int, excluded: int, group_incomplete: int,
           ref_steps: np.ndarray, shift: int | None) -> list[str]:
    notes: list[str] = []
    if shift is not None:
        notes.append(shift_note(shift, ref_steps, cand.steps))
    named = [(f"reference[{i}]" if len(refs) > 1 else "reference", r.report)
             for i, r in enumerate(refs)] + [("candidate", cand.report)]
    for name, r in named:
        if r.repeated_steps:
            spans = ", ".join(f"{a}-{b}" for a, b, _ in r.repeated_ranges[:5])
            notes.append(f"{name}: {r.repeated_steps} steps written more than once "
                         f"(ranges {spans}); the {keep} value written for each step is used")
        if r.backwards:
            notes.append(f"{name}: steps went backwards {r.backwards} time(s) in logging "
                         "order; points are ordered by step")
        if r.nonfinite:
            notes.append(f"{name}: {r.nonfinite} non-finite values (NaN {r.nan}, +Inf "
                         f"{r.posinf}, -Inf {r.neginf}; first at step "
                         f"{r.first_nonfinite_step}), excluded from the measures")
    if cadence_differs:
        cads = ", ".join(str(r.report.cadence) for r in refs)
        how = interpolated or f"compared on the {common} common steps only"
        notes.append(f"cadence differs (reference every {cads} steps, candidate every "
                     f"{cand.report.cadence}): {how}")
    elif interpolated:
        notes.append(interpolated)
    if excluded:
        notes.append(f"{excluded} common steps excluded because a value there is non-finite")
    if group_incomplete:
        notes.append(f"{group_incomplete} steps not present in every reference run are "
                     "left out of the group")
    return notes
