"""Reading evidence out of a loaded run (:class:`refrun.comparison.RunData`): one value per
step, tags as numbers, warm-up boundaries, the price of its hardware.  Pure functions."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from refrun import schema
from refrun.comparison import RunData, warmup_end
from refrun.comparison.measures import steady_points
from refrun.util.thinning import sorted_unique

if TYPE_CHECKING:  # annotations only: the model does not depend on this reader
    from refrun.acceptance.criteria import Prices


@dataclass(frozen=True)
class Resolved:
    """One value per step (sorted unique steps) of one metric of one run."""

    steps: np.ndarray
    values: np.ndarray


def resolved(run: RunData, metric: str, keep: str = "last") -> Resolved | None:
    """The metric's series with one value per step (``keep`` decides repeated steps);
    None when the run has no such metric."""
    if metric not in run.metric_names:
        return None
    s = run.resolved(metric, keep)  # resolved once per run (a sweep reuses its references)
    return Resolved(np.asarray(s.steps, dtype=np.int64), np.asarray(s.values, dtype=float))


def finite(r: Resolved) -> Resolved:
    ok = np.isfinite(r.values)
    return Resolved(r.steps[ok], r.values[ok])


def steady_start(steps: np.ndarray, warmup_steps: int | None, warmup_fraction: float) -> int:
    """First step after warm-up for a series (see ``refrun.comparison.warmup_end``)."""
    return warmup_end(int(steps[0]), int(steps[-1]), warmup_steps, warmup_fraction)


def tag_int(run: RunData, tag: str) -> int | None:
    v = run.tags.get(tag)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def tag_float(run: RunData, tag: str) -> float | None:
    """The tag as a finite number, else None (absent, empty or not a number)."""
    try:
        v = float(run.tags.get(tag) or "nan")
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def tag_json(run: RunData, tag: str) -> object | None:
    v = run.tags.get(tag)
    if v is None:
        return None
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return None


def hardware_price(run: RunData, prices: Prices) -> tuple[str | None, float | None, str]:
    """``(hardware key, price per hour, note)``: the price of the run's declared hardware
    (``refrun.hardware``), else of its executing hardware (``refrun.exec.hardware``),
    matched case-insensitively, times ``refrun.chips`` when prices are per chip."""
    table = {k.lower(): (k, v) for k, v in prices.hourly.items()}
    for tag in (schema.TAG_HARDWARE, schema.TAG_EXEC_HARDWARE):
        hw = run.tags.get(tag)
        if hw and hw.lower() in table:
            name, price = table[hw.lower()]
            if prices.per == "chip":
                chips = tag_int(run, schema.TAG_CHIPS)
                if chips is None:
                    return name, None, f"prices are per chip but run {run.run_id} has no " \
                                       f"{schema.TAG_CHIPS} tag"
                return name, price * chips, f"{price} x {chips} chips"
            return name, price, f"{tag} = {hw!r}"
    declared = run.tags.get(schema.TAG_HARDWARE), run.tags.get(schema.TAG_EXEC_HARDWARE)
    return None, None, (f"no price for run {run.run_id}: hardware {declared[0]!r} / executing "
                        f"{declared[1]!r} not in [prices.hourly] ({', '.join(prices.hourly)})")


def run_hours(run: RunData, source: str, step_metric: str = schema.M_STEP_TIME,
              keep: str = "last") -> tuple[float | None, str]:
    """Hours the run took: ``run_wall`` = (end - start) of the MLflow run, less refrun's own
    start-up and close where the run says them (``refrun.perf.recording_start_s``: the
    store's opening and the run's creation come after its start time;
    ``refrun.perf.recording_close_s``: the probes' pending values and summaries come before
    its end time; both depend on how it was recorded, not on the workload);
    ``step_time_sum`` = sum of the finite per-step times (seconds) / 3600."""
    if source == "run_wall":
        if run.status == "RUNNING" or run.end_time_ms is None or run.start_time_ms is None:
            return None, f"run {run.run_id} has no end time (status {run.status})"
        wall_s = (run.end_time_ms - run.start_time_ms) / 1e3
        own = [(what, s) for what, tag in (("start-up", schema.TAG_RECORDING_START_S),
                                           ("close", schema.TAG_RECORDING_CLOSE_S))
               if (s := tag_float(run, tag)) is not None and s >= 0]
        own_s = sum(s for _, s in own)
        # the tags and the times are in milliseconds: within half of one they are equal
        if not own or own_s > wall_s + 5e-4:  # none said, or not of this run: its whole wall
            return wall_s / 3600.0, "MLflow end - start time"
        said = " and ".join(f"{what} ({s:.3g} s)" for what, s in own)
        if own_s >= wall_s - 5e-4:
            return None, (f"run {run.run_id}: its whole MLflow run time ({wall_s:.3g} s) was "
                          f"refrun's own {said}: no time of its own to price")
        return (wall_s - own_s) / 3600.0, f"MLflow end - start time, less refrun's own {said}"
    r = resolved(run, step_metric, keep)
    if r is None:
        return None, f"run {run.run_id} has no metric {step_metric!r}"
    f = finite(r)
    if not len(f.values):
        return None, f"run {run.run_id}: no finite {step_metric!r} value"
    return float(f.values.sum()) / 3600.0, f"sum of {len(f.values)} {step_metric} values"


def nonfinite_count(run: RunData, metric: str) -> int:
    """NaN/Inf points of ``metric`` among every recorded point (not only the kept ones)."""
    _, values, _ = run.series(metric)
    return int((~np.isfinite(values)).sum())


def isclose(cand: np.ndarray, ref: np.ndarray, abs_tol: float, rel_tol: float) -> np.ndarray:
    """Within tolerance per step: ``|cand - ref| <= abs_tol + rel_tol * |ref|`` (the
    numpy.isclose rule with the reference as the expected value)."""
    return np.abs(cand - ref) <= abs_tol + rel_tol * np.abs(ref)


def fnum(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def compile_steps(run: RunData, metrics: list[str], keep: str) -> np.ndarray:
    """Steps at which one of the per-step compilation counters ``metrics`` is > 0."""
    hit = [r.steps[r.values > 0] for r in (resolved(run, m, keep) for m in metrics)
           if r is not None]
    return sorted_unique(np.concatenate(hit)) if hit else np.empty(0, dtype=np.int64)


def steady_step_times(run: RunData, metric: str, compile_metrics: list[str], keep: str,
                      start: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(steps, seconds, steps left out)``: the run's steady step times
    (:func:`refrun.comparison.measures.steady_points`: finite, at steps >= ``start``, the
    warm-up end) without its compilation steps (a step where a ``compile_metrics``
    counter moved) and, for step times of kind ``interval``, the intervals that hold
    what is not a step (:func:`interval_exclusions`)."""
    r = resolved(run, metric, keep)
    if r is None:
        return np.empty(0, dtype=np.int64), np.empty(0), 0
    comp = compile_steps(run, compile_metrics, keep) if compile_metrics else None
    if run.tags.get(schema.TAG_STEP_TIME_KIND) == schema.STEP_TIME_INTERVAL and len(r.steps):
        between = (compile_steps(run, [schema.M_COMPILE_OTHER], keep)
                   if schema.M_COMPILE_OTHER in compile_metrics else None)
        comp = interval_exclusions(comp, between, int(r.steps.max()))
    return steady_points(r.steps, r.values, start, comp)


def interval_exclusions(comp: np.ndarray | None, between: np.ndarray | None, last: int
                        ) -> np.ndarray:
    """The steps whose *interval* step time (entry to the next step's entry) is not a
    step's: ``comp``, the compilation steps, and

    * ``s - 1`` for each ``s`` in ``between``, the steps whose ``compile/other`` moved:
      a compilation between steps (an evaluation's, a checkpoint helper's) is counted at
      the next step's entry, ``s``, but its time lies in the interval of ``s - 1``.  A
      JAX port's first evaluation put a 2.2 s interval at the step before the one whose
      counter moved, and the steady throughput of its 150-step run read 903 or 7,432
      samples/s depending on how the batch-means blocks fell (docs/acceptance.md);
    * ``last``: the last step's interval ends at the probe's close, so it holds whatever
      the loop did after its last step (a final evaluation, a checkpoint)."""
    parts = [np.asarray(comp if comp is not None else [], dtype=np.int64),
             np.asarray(between if between is not None else [], dtype=np.int64) - 1,
             np.array([last], dtype=np.int64)]
    return sorted_unique(np.concatenate(parts))


UTIL_PATTERN = re.compile(r"^sys/(gpu|tpu)\d+_(util|duty_cycle)_pct$")


def run_step_span(run: RunData) -> np.ndarray | None:
    """``[first step, last step]`` over every point the run logged (None: no point)."""
    steps = run.curves.get("step")
    if steps is None or not len(steps):
        return None
    return np.array([int(steps.min()), int(steps.max())], dtype=np.int64)


def busy_means(run: RunData, metrics: Sequence[str], keep: str,
               start_of: Callable[[np.ndarray], int]
               ) -> tuple[dict[str, float], dict[str, int]]:
    """``({metric: mean after warm-up}, {metric: warm-up end step})`` for each chip
    utilisation metric of ``run`` (default: every ``sys/gpu<i>_util_pct`` and
    ``sys/tpu<i>_duty_cycle_pct`` it recorded) with a finite value at or after the run's
    warm-up end (``start_of`` of the run's first and last step).  A chip's busy fraction
    is the mean of its samples: each is the share of the sampling period the chip was
    busy."""
    names = list(metrics) or [m for m in run.metric_names if UTIL_PATTERN.match(m)]
    means: dict[str, float] = {}
    starts: dict[str, int] = {}
    # The warm-up ends where the run's own steps say, not a chip metric's: a sampler that
    # reads the device's timeline now and then logs a few points (one, at the last step,
    # in a run of seconds on a TPU v5e), whose own first-to-last span would put the
    # warm-up end past its only point.
    span = run_step_span(run)
    for m in names:
        r = resolved(run, m, keep)
        if r is None:
            continue
        f = finite(r)
        if not len(f.values):
            continue
        start = start_of(span if span is not None else f.steps)
        v = f.values[f.steps >= start]
        if len(v):
            means[m], starts[m] = float(v.mean()), start
    return means, starts
