"""``compare``: a reference run (or group of seeds) against a candidate, per metric.

The result is a :class:`Comparison`: per-metric alignment reports, measures and aligned
DataFrames, and ``to_dict()`` producing the JSON documented in docs/comparison.md.  It
states observed differences only; criteria and verdicts live in ``refrun.acceptance``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from refrun import schema
from refrun.comparison.alignment import (
    Aligned,
    AlignmentReport,
    AxisMap,
    Series,
    align,
    axis_map,
    mapping_report,
    shift_note,
    to_axis,
)
from refrun.comparison.divergence import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DEFAULT_SUSTAIN,
    Divergence,
    DivergenceSummary,
    divergence_summary,
    first_divergence,
)
from refrun.comparison.group import (
    GroupEnvelope,
    GroupStats,
    envelope_position,
    group_stats,
    z_scores,
)
from refrun.comparison.loading import RunData, load_run
from refrun.comparison.measures import (
    CounterTotals,
    DiffMeasures,
    EvalPoint,
    StepTimeMeasures,
    counter_totals,
    diff_measures,
    diffs,
    eval_points,
    final_window_size,
    step_time_ratio,
    warmup_end,
)
from refrun.errors import RefrunInputError
from refrun.util.jsonsafe import json_safe as _clean

FORMAT_VERSION = "1"


@dataclass(frozen=True)
class CompareOptions:
    """How runs are aligned and measured (all stated in the output)."""

    keep: str = "last"  # value kept for a repeated step: "last" | "first"
    interpolate: str = "none"  # "none" | "candidate" | "reference"
    # What runs are aligned on: "step" | "samples" | "tokens" (cumulative data seen, from
    # progress/samples|tokens or the refrun.global_batch tag; see alignment.axis_map).
    axis: str = "step"
    eps: float = 1e-12  # floor of the relative-difference denominator
    final_fraction: float = 0.1  # final window: last ceil(fraction * n) aligned points
    final_points: int | None = None  # ... or exactly this many last aligned points
    warmup_steps: int | None = None  # steps skipped for step time and counters
    warmup_fraction: float = 0.1  # ... default ceil(fraction * step span), at least 1
    step_time_metrics: tuple[str, ...] = (schema.M_STEP_TIME,)
    counter_prefixes: tuple[str, ...] = schema.COUNTER_PREFIXES
    eval_prefix: str = schema.EVAL_PREFIX
    max_eval_points: int = 10_000  # eval metrics with more aligned points: no point list
    # First divergence (comparison/divergence.py): band = reference envelope +- (rtol *
    # |reference mean| + atol); sustained = this many consecutive points outside.
    divergence_rtol: float = DEFAULT_RTOL
    divergence_atol: float = DEFAULT_ATOL
    divergence_sustain: int = DEFAULT_SUSTAIN

    def __post_init__(self) -> None:
        if self.keep not in ("last", "first"):
            raise RefrunInputError(f"keep: {self.keep!r} is not 'last' or 'first'")
        if self.axis not in schema.AXES:
            raise RefrunInputError(f"axis: {self.axis!r} is not one of {', '.join(schema.AXES)}")
        if self.interpolate not in ("none", "candidate", "reference"):
            raise RefrunInputError(f"interpolate: {self.interpolate!r} is not one of "
                                   "none, candidate, reference")
        if not 0 < self.final_fraction <= 1:
            raise RefrunInputError(f"final_fraction: {self.final_fraction} not in (0, 1]")
        if self.final_points is not None and self.final_points < 1:
            raise RefrunInputError(f"final_points: {self.final_points} must be >= 1")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise RefrunInputError(f"warmup_steps: {self.warmup_steps} must be >= 0")
        if self.divergence_rtol < 0 or self.divergence_atol < 0:
            raise RefrunInputError("divergence_rtol/divergence_atol: must be >= 0")
        if self.divergence_sustain < 1:
            raise RefrunInputError(f"divergence_sustain: {self.divergence_sustain} must "
                                   "be >= 1")

    def kind(self, metric: str) -> str:
        """``eval``, ``step_time``, ``counter`` or ``value`` (decides the extra measures)."""
        if metric.startswith(self.eval_prefix):
            return "eval"
        if metric in self.step_time_metrics:
            return "step_time"
        if metric.startswith(self.counter_prefixes):
            return "counter"
        return "value"


@dataclass(frozen=True, eq=False)
class MetricComparison:
    """Everything measured for one metric; ``frame`` holds the aligned values."""

    metric: str
    kind: str
    alignment: AlignmentReport
    measures: DiffMeasures
    frame: pd.DataFrame = field(repr=False)
    eval_points: list[EvalPoint] | None = None
    step_time: StepTimeMeasures | None = None
    counters: CounterTotals | None = None
    group: GroupEnvelope | None = None
    notes: list[str] = field(default_factory=list)
    divergence: Divergence | None = None  # value and eval metrics (not sys/*, counters)

    def to_dict(self) -> dict[str, Any]:
        return _clean({
            "kind": self.kind,
            "first_divergence": _asdict(self.divergence),
            "notes": self.notes,
            "alignment": dataclasses.asdict(self.alignment),
            "measures": dataclasses.asdict(self.measures),
            "eval_points": None if self.eval_points is None
            else [dataclasses.asdict(p) for p in self.eval_points],
            "step_time": _asdict(self.step_time),
            "counters": _asdict(self.counters),
            "group": _asdict(self.group),
        })


@dataclass(frozen=True, eq=False)
class Comparison:
    """A candidate compared with a reference run or a reference group, metric by metric."""

    reference: list[RunData]
    candidate: RunData
    options: CompareOptions
    metrics: dict[str, MetricComparison]
    metrics_only_in_reference: list[str]
    metrics_only_in_candidate: list[str]
    skipped: dict[str, str]
    created_ms: int

    @property
    def divergence(self) -> DivergenceSummary:
        """Which metric (and which parameter's gradient norm) departed first."""
        return divergence_summary([m.divergence for m in self.metrics.values()
                                   if m.divergence is not None], self.options.axis)

    @property
    def reference_ids(self) -> list[str]:
        return [r.run_id for r in self.reference]

    def frame(self, metric: str) -> pd.DataFrame:
        """Aligned values of ``metric``: step, reference, candidate, diff, reldiff, ..."""
        if metric not in self.metrics:
            raise RefrunInputError(f"metric {metric!r}: not in this comparison "
                                   f"({', '.join(self.metrics)})")
        return self.metrics[metric].frame

    def summary(self) -> pd.DataFrame:
        """One row per metric with the main counts and measures (for tables)."""
        rows = []
        for name, m in self.metrics.items():
            a, d = m.alignment, m.measures
            refs = a.reference if isinstance(a.reference, list) else [a.reference]
            row = {
                "metric": name, "kind": m.kind, "aligned": a.aligned_steps,
                "only_ref": a.only_in_reference, "only_cand": a.only_in_candidate,
                "repeated_ref": sum(r.repeated_steps for r in refs),
                "repeated_cand": a.candidate.repeated_steps,
                "nonfinite_ref": sum(r.nonfinite for r in refs),
                "nonfinite_cand": a.candidate.nonfinite,
                "mean_abs_diff": d.mean_abs_diff, "max_abs_diff": d.max_abs_diff,
                "step_of_max": d.step_of_max_abs_diff, "mean_rel_diff": d.mean_rel_diff,
                "bias": d.bias, "diff_last": d.diff_at_last_step,
                "final_mean_abs_diff": d.final_window.mean_abs_diff,
            }
            if m.divergence is not None:
                row["first_divergence"] = m.divergence.first_step
            if m.group is not None:
                row["outside_envelope"] = m.group.fraction_outside
                row["mean_abs_z"] = m.group.mean_abs_z
            rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON (docs/comparison.md, "JSON")."""
        return _clean({
            "format": schema.FORMAT_COMPARISON,
            "format_version": FORMAT_VERSION,
            "created_ms": self.created_ms,
            "reference": [_run_info(r) for r in self.reference],
            "candidate": _run_info(self.candidate),
            "options": dataclasses.asdict(self.options),
            "metrics_only_in_reference": self.metrics_only_in_reference,
            "metrics_only_in_candidate": self.metrics_only_in_candidate,
            "skipped": self.skipped,
            "divergence": dataclasses.asdict(self.divergence),
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
        })

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to ``path`` (strict JSON: non-finite numbers are null)."""
        from refrun.util.outputs import write_output

        return write_output(path, json.dumps(self.to_dict(), indent=1, allow_nan=False)
                            + "\n", "--json")


def _asdict(obj: Any) -> dict[str, Any] | None:
    return None if obj is None else dataclasses.asdict(obj)


def _run_info(r: RunData) -> dict[str, Any]:
    return {"run_id": r.run_id, "workload": r.workload, "role": r.role,
            "hardware": r.hardware, "backend": r.backend, "seed": r.seed,
            "status": r.status, "source": r.source, "points": r.points,
            "points_from": r.points_from,
            "job": None if r.job is None else r.job.to_dict()}  # multi-process: ranks


def _as_rundata(x: str | RunData, metrics: Sequence[str] | None,
                tracking_uri: str | None, progress: bool, axis: str = "step") -> RunData:
    if isinstance(x, RunData):
        return x
    if not isinstance(x, str) or not x:
        raise RefrunInputError(f"run: expected a run id or RunData, got {x!r}")
    if metrics is not None and axis != "step":
        metrics = [*metrics, schema.PROGRESS_PREFIX + axis]  # the axis itself
    return load_run(x, metrics, tracking_uri, progress)


def _int_tag(run: RunData, key: str) -> int | None:
    v = str(run.tags.get(key, "")).strip()
    return int(v) if v.isdigit() else None


def run_axis_map(run: RunData, axis: str, keep: str = "last") -> AxisMap:
    """The run's step -> ``axis`` mapping (recorded ``progress/<axis>``, else derived from
    ``refrun.global_batch`` [x ``refrun.tokens_per_sample``]); a one-line
    :class:`RefrunInputError` naming the run when neither exists."""
    name = schema.PROGRESS_PREFIX + axis
    recorded = None
    if name in run.metric_names:
        ser = _resolve(run, name, keep)
        recorded = (ser.steps, ser.values)
    amap = axis_map(axis, recorded, run.curves["step"].to_numpy(),  # type: ignore[arg-type]
                    _int_tag(run, schema.TAG_GLOBAL_BATCH),
                    _int_tag(run, schema.TAG_TOKENS_PER_SAMPLE))
    if amap is None:
        need = (f"{schema.TAG_GLOBAL_BATCH}" if axis == "samples" else
                f"{schema.TAG_GLOBAL_BATCH} and {schema.TAG_TOKENS_PER_SAMPLE}")
        raise RefrunInputError(f"axis {axis}: run {run.run_id} has no {name!r} metric and "
                               f"no {need} tag to derive it from")
    return amap


def compare(reference: str | RunData | Sequence[str | RunData], candidate: str | RunData,
            metrics: Sequence[str] | None = None, options: CompareOptions | None = None,
            tracking_uri: str | None = None, progress: bool = True) -> Comparison:
    """Compare ``candidate`` with ``reference`` (one run or a group of seeds).

    ``metrics``: the metrics to compare; each must exist in every run and have aligned
    steps, else :class:`RefrunInputError`.  Default: every metric present in all runs;
    those without aligned steps are listed in ``skipped`` with the reason.
    """
    opts = options or CompareOptions()
    ref_list = [reference] if isinstance(reference, str | RunData) else list(reference)
    if not ref_list:
        raise RefrunInputError("reference: at least one reference run is required")
    wanted = list(dict.fromkeys(metrics)) if metrics else None
    refs = [_as_rundata(r, wanted, tracking_uri, progress, opts.axis) for r in ref_list]
    cand = _as_rundata(candidate, wanted, tracking_uri, progress, opts.axis)
    maps = None
    if opts.axis != "step":
        maps = [run_axis_map(r, opts.axis, opts.keep) for r in [*refs, cand]]
    ref_names = set.intersection(*(set(r.metric_names) for r in refs))
    ref_any = set.union(*(set(r.metric_names) for r in refs))
    cand_names = set(cand.metric_names)
    if wanted:
        for m in wanted:
            for r in [*refs, cand]:
                if m not in r.metric_names:
                    raise RefrunInputError(f"metric {m!r}: not recorded in run {r.run_id} "
                                           f"({r.role or 'run'})")
        names = wanted
    else:
        # progress/* are axes, not measurements: identical by construction on their axis
        names = sorted(n for n in ref_names & cand_names
                       if not n.startswith(schema.PROGRESS_PREFIX))
    results: dict[str, MetricComparison] = {}
    skipped: dict[str, str] = {}
    for name in names:
        result, reason = _compare_metric(name, refs, cand, opts, maps)
        if result is not None:
            results[name] = result
            continue
        if wanted:
            raise RefrunInputError(f"metric {name!r}: {reason}")
        skipped[name] = reason
    if not results:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "no common metric names"
        raise RefrunInputError(
            f"runs {', '.join(r.run_id for r in refs)} and {cand.run_id} have no common "
            f"metric with aligned finite steps ({why})")
    return Comparison(
        reference=refs, candidate=cand, options=opts, metrics=results,
        metrics_only_in_reference=sorted(ref_any - cand_names),
        metrics_only_in_candidate=sorted(cand_names - ref_names),
        skipped=skipped, created_ms=time.time_ns() // 1_000_000,
    )


def _resolve(run: RunData, metric: str, keep: str) -> Series:
    return run.resolved(metric, keep)


def _span(series: list[Series]) -> tuple[int, int]:
    firsts = [s.steps[0] for s in series if len(s.steps)]
    lasts = [s.steps[-1] for s in series if len(s.steps)]
    return int(min(firsts)), int(max(lasts))


def _on_axis(ref_series: list[Series], cand_series: Series, opts: CompareOptions,
             maps: list[AxisMap] | None) -> tuple[list[Series], Series, list[Any]]:
    """The series mapped onto the options' axis, and how each run was mapped."""
    if maps is None:
        return ref_series, cand_series, []
    names = ([f"reference[{i}]" if len(ref_series) > 1 else "reference"
              for i in range(len(ref_series))] + ["candidate"])
    mapped, reports = [], []
    for nm, ser, amap in zip(names, [*ref_series, cand_series], maps, strict=True):
        m, dropped = to_axis(ser, amap, opts.keep)  # type: ignore[arg-type]
        mapped.append(m)
        reports.append(mapping_report(nm, opts.axis, amap, dropped))
    return mapped[:-1], mapped[-1], reports


def _axis_note(reports: list[Any]) -> str:
    parts = [f"{r.run}: {r.source}"
             + (f", {r.per_step:g} {r.axis}/step" if r.per_step is not None else "")
             + (f", {r.unmapped_steps} steps outside the progress record dropped"
                if r.unmapped_steps else "") for r in reports]
    return f"aligned by {reports[0].axis} seen, not by step ({'; '.join(parts)})"


def _compare_metric(name: str, refs: list[RunData], cand: RunData, opts: CompareOptions,
                    maps: list[AxisMap] | None = None) -> tuple[MetricComparison | None, str]:
    native_refs = [_resolve(r, name, opts.keep) for r in refs]
    native_cand = _resolve(cand, name, opts.keep)
    ref_series, cand_series, mapping = _on_axis(native_refs, native_cand, opts, maps)
    aligned = align(ref_series, cand_series, opts.interpolate, opts.keep)  # type: ignore[arg-type]
    if mapping:
        rep = dataclasses.replace(aligned.report, axis=opts.axis, axis_mapping=mapping,
                                  notes=[_axis_note(mapping), *aligned.report.notes])
        aligned = Aligned(aligned.steps, aligned.reference, aligned.candidate, rep)
    rep = aligned.report
    if rep.aligned_steps == 0:
        r0 = ref_series[0].report
        c0 = cand_series.report
        # the steps every reference has, as align compared them
        ref_steps = reduce(np.intersect1d, [r.steps for r in ref_series])
        shifted = [] if rep.step_shift is None else [
            shift_note(rep.step_shift, ref_steps, cand_series.steps)]
        return None, (f"no common steps with finite values (reference steps "
                      f"{r0.first_step}..{r0.last_step}, candidate steps "
                      f"{c0.first_step}..{c0.last_step}, {rep.common_steps} common, "
                      f"{rep.excluded_nonfinite} of them non-finite)"
                      + "".join(f": {n}" for n in shifted))
    kind = opts.kind(name)
    ref_curve = aligned.reference_mean
    d_rd = diffs(ref_curve, aligned.candidate, opts.eps)
    measures = diff_measures(aligned.steps, ref_curve, aligned.candidate, opts.eps,
                             opts.final_fraction, opts.final_points, precomputed=d_rd)
    # Step time and counters are per run, over each run's own steps (any axis).
    first, last = _span([*native_refs, native_cand])
    wend = warmup_end(first, last, opts.warmup_steps, opts.warmup_fraction)
    step_time = counters = None
    if kind == "step_time":
        step_time = step_time_ratio(
            np.concatenate([s.steps for s in native_refs]),
            np.concatenate([s.values for s in native_refs]),
            native_cand.steps, native_cand.values, wend)
    elif kind == "counter":
        counters = _group_counters(native_refs, native_cand, wend)
    group = None
    # The group's per-step statistics, computed once for the frame and the envelope.
    stats = group_stats(aligned.reference) if aligned.reference.shape[0] > 1 else None
    frame = _frame(aligned, ref_curve, d_rd, stats)
    if mapping and maps is not None:
        frame = _with_axis(frame, opts.axis, maps[-1])
    if len(refs) > 1:
        k = final_window_size(len(aligned.steps), opts.final_fraction, opts.final_points)
        group = envelope_position(aligned.steps, aligned.candidate, aligned.reference, k,
                                  stats=stats)
    div = None
    if kind in ("value", "eval") and not name.startswith(schema.SYS_PREFIX):
        div = first_divergence(name, aligned.steps, aligned.reference, aligned.candidate,
                               axis=opts.axis, rtol=opts.divergence_rtol,
                               atol=opts.divergence_atol, sustain=opts.divergence_sustain)
    points = None
    notes: list[str] = []
    if kind == "eval":
        if len(aligned.steps) <= opts.max_eval_points:
            points = eval_points(aligned.steps, ref_curve, aligned.candidate, opts.eps)
        else:
            notes.append(f"{len(aligned.steps)} evaluation points (> max_eval_points="
                         f"{opts.max_eval_points}): per-point values are in the frame only")
    return MetricComparison(
        metric=name, kind=kind, alignment=rep, measures=measures, frame=frame,
        eval_points=points, step_time=step_time, counters=counters, group=group,
        notes=notes, divergence=div,
    ), ""


def _group_counters(refs: list[Series], cand: Series, wend: int) -> CounterTotals:
    # With several references, the reference totals are the mean of the per-run totals
    # (a pooled sum would grow with the number of seeds).
    per = [counter_totals(r.steps, r.values, cand.steps, cand.values, wend) for r in refs]
    if len(per) == 1:
        return per[0]
    return dataclasses.replace(
        per[0],
        reference_total=float(np.mean([p.reference_total for p in per])),
        reference_after_warmup=float(np.mean([p.reference_after_warmup for p in per])),
        reference_steps=round(float(np.mean([p.reference_steps for p in per]))),
    )


def _with_axis(frame: pd.DataFrame, axis: str, cand_map: AxisMap) -> pd.DataFrame:
    """Aligned on ``axis``: the axis values in a column of that name, and ``step`` the
    candidate's own step at each (interpolated back through its progress record)."""
    x = frame["step"].to_numpy()
    back = np.rint(np.interp(x, cand_map.values.astype(np.float64),
                             cand_map.steps.astype(np.float64))).astype(np.int64)
    out = frame.rename(columns={"step": axis})
    out.insert(0, "step", back)
    return out


def _frame(aligned: Aligned, ref_curve: np.ndarray,
           d_rd: tuple[np.ndarray, np.ndarray], st: GroupStats | None = None) -> pd.DataFrame:
    d, rd = d_rd
    cols: dict[str, np.ndarray] = {"step": aligned.steps, "reference": ref_curve,
                                   "candidate": aligned.candidate, "diff": d, "reldiff": rd}
    if aligned.reference.shape[0] > 1:
        st = st if st is not None else group_stats(aligned.reference)
        cols.update(ref_min=st.min, ref_max=st.max, ref_mean=st.mean, ref_std=st.std,
                    z=z_scores(aligned.candidate, st))
    return pd.DataFrame(cols, copy=False)
