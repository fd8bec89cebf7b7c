"""L4 across hardware: a migrated candidate's throughput, cost per run and chip busy
fraction, each measured on every run and as the candidate's ratio to its references'
(docs/acceptance.md, "L4 across hardware").

A candidate on other hardware, another backend or another chip count than its references
(:func:`refrun.acceptance.migration.migration`) is not judged by the same-machine
``step_time`` limit; what the migration study judged such a candidate on at L4 is what it
delivers against the references: 0.89x the GPU's throughput at 1.59x its cost per run
(unattractive), or 1.86x faster at 25 % lower cost.  Three figures, pure functions of the
loaded runs:

* **Throughput** (:func:`run_throughput`): units per second of the probe's step time,
  ``t`` the run's ``perf/step_time_s`` and ``u`` what a step consumed (the step's
  increase of the cumulative ``progress/tokens`` or ``progress/samples``, else
  ``refrun.global_batch`` [x ``refrun.tokens_per_sample``]), over its steady steps (after
  the run's own warm-up, without the steps where a compilation counter moved:
  :func:`refrun.acceptance.runview.steady_step_times`): the median of the rates
  ``sum(u) / sum(t)`` of consecutive blocks of at least :data:`BLOCK_S` of step time
  (:func:`block_rates`).  Sums, because a JAX step's time is an interval of a pipelined
  timeline that means something only summed; blocks and their median, because a stall
  (another process, a checkpoint) then moves one block and not the figure.  The whole
  window's rate is kept as ``mean_per_s``.  Every run is measured in one unit
  (:func:`choose_unit`).
* **Cost per run** (:func:`run_cost`): hours for the references' work x price per hour
  of the run's hardware (``[prices]``, :func:`refrun.acceptance.runview.hardware_price`):
  ``hours = (end - start of the MLflow run) x W_ref / W`` with ``W`` the units the run
  processed and ``W_ref`` the references' mean, so a candidate that took another batch
  or another number of steps is priced for the same work.  Wall time, not step time:
  compilation, evaluation and start-up are paid for too.
* **Chip busy fraction** (:func:`run_busy`): the mean over chips of each chip's mean
  utilisation after warm-up (``sys/gpu<i>_util_pct`` from NVML,
  ``sys/tpu<i>_duty_cycle_pct`` from the TPU monitors), the ``utilization`` criterion's
  reading; when a run has none, why (the source tag a monitor left, or that the run
  executed on the CPU), never a blank or a zero.

Ratios are candidate / mean of the references' (as the ``cost`` criterion's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.migration import configuration, migration
from refrun.comparison import RunData

Unit = Literal["tokens", "samples", "steps"]
UNITS: tuple[Unit, ...] = ("tokens", "samples", "steps")
UNIT_CHOICES = ("auto", *UNITS)
NOT_MEASURED = "not measured: "
_PROGRESS: dict[str, str] = {"tokens": schema.M_PROGRESS_TOKENS,
                             "samples": schema.M_PROGRESS_SAMPLES}


# --- units of work -------------------------------------------------------------------------
def units_per_step_tag(run: RunData, unit: Unit) -> int | None:
    """Units every step consumes by the run's declaration: ``refrun.global_batch`` samples
    (x ``refrun.tokens_per_sample`` tokens); None when undeclared; 1 for steps."""
    if unit == "steps":
        return 1
    batch = rv.tag_int(run, schema.TAG_GLOBAL_BATCH)
    if unit == "samples" or batch is None:
        return batch
    per = rv.tag_int(run, schema.TAG_TOKENS_PER_SAMPLE)
    return None if per is None else batch * per


def records(run: RunData, unit: Unit) -> bool:
    """Whether the run says how many ``unit`` each step consumed (a progress metric, or
    the declared batch)."""
    return unit == "steps" or (unit in _PROGRESS and _PROGRESS[unit] in run.metric_names) \
        or units_per_step_tag(run, unit) is not None


def choose_unit(runs: Sequence[RunData], wanted: str = "auto") -> tuple[Unit | None, str]:
    """``(unit, note)``, or ``(None, why)`` when the runs cannot be measured in one unit.
    ``auto``: tokens when every run records them, else samples when every run does; steps
    (stated in the note: the same work per step is assumed) only when no run records
    samples at all, never when some do (a run that declares nothing is not assumed to
    take another's batch)."""
    if wanted != "auto":
        unit = next(u for u in UNITS if u == wanted)
        lacking = [r.run_id for r in runs if not records(r, unit)]
        return (None, f"run {lacking[0]} records no {unit} count ({_PROGRESS[unit]} or "
                      f"{schema.TAG_GLOBAL_BATCH})") if lacking else (unit, "")
    for u in UNITS[:2]:  # tokens, then samples
        if all(records(r, u) for r in runs):
            return u, ""
    some = [r.run_id for r in runs if records(r, "samples")]
    if not some:
        return "steps", (f"no run records its samples ({schema.M_PROGRESS_SAMPLES} or "
                         f"{schema.TAG_GLOBAL_BATCH}): per step, assuming every run does "
                         "the same work per step")
    lacking = next(r.run_id for r in runs if not records(r, "samples"))
    return None, (f"run {lacking} records no sample count ({schema.M_PROGRESS_SAMPLES} or "
                  f"{schema.TAG_GLOBAL_BATCH}) while run {some[0]} does: they cannot be "
                  "measured in one unit")


def step_units(run: RunData, unit: Unit, steps: np.ndarray, keep: str) -> np.ndarray:
    """Units consumed at each of ``steps`` (NaN where unknown): from the cumulative
    progress metric, ``(c_i - c_{i-1}) / (k_i - k_{i-1})`` for every step in
    ``(k_{i-1}, k_i]`` (``c`` the value logged at step ``k``; 0 before the first point,
    which covers its own step only); else the declared batch (:func:`units_per_step_tag`)."""
    metric = _PROGRESS.get(unit)
    r = rv.resolved(run, metric, keep) if metric else None
    f = rv.finite(r) if r is not None else None
    if f is not None and len(f.steps):
        k, c = f.steps, f.values
        kk = np.concatenate([[k[0] - 1], k])
        per = np.diff(np.concatenate([[0.0], c])) / np.diff(kk)
        idx = np.searchsorted(k, steps, side="left")
        out = np.full(len(steps), np.nan)
        ok = (idx < len(k)) & (steps > kk[0])
        out[ok] = per[idx[ok]]
        return out
    per_step = units_per_step_tag(run, unit)
    return np.full(len(steps), np.nan if per_step is None else float(per_step))


def step_span(run: RunData) -> int | None:
    """Steps the run took: ``refrun.steps.last - refrun.steps.first + 1`` (the tags the
    session writes at its end), else from its step-time or loss points; None without."""
    first, last = rv.tag_int(run, schema.TAG_STEPS_FIRST), rv.tag_int(run, schema.TAG_STEPS_LAST)
    if first is None or last is None:
        spans = [run.series(m)[0] for m in (schema.M_STEP_TIME, schema.M_LOSS)
                 if m in run.metric_names]
        spans = [s for s in spans if len(s)]
        if not spans:
            return None
        first, last = min(int(s.min()) for s in spans), max(int(s.max()) for s in spans)
    return last - first + 1


def run_work(run: RunData, unit: Unit, keep: str) -> tuple[float | None, str]:
    """``(units the run processed, how it is known)``: the last cumulative progress value,
    else the steps it took x its declared batch; None with why."""
    metric = _PROGRESS.get(unit)
    r = rv.resolved(run, metric, keep) if metric else None
    if r is not None and len(f := rv.finite(r).values):
        return float(f[-1]), f"last {metric}"
    span, per = step_span(run), units_per_step_tag(run, unit)
    if span is None:
        return None, f"run {run.run_id} recorded no step"
    if per is None:
        return None, f"run {run.run_id} records no {unit} count"
    return float(span * per), (f"{span} steps" if unit == "steps" else
                                f"{span} steps x {per} {unit}")


# --- throughput --------------------------------------------------------------------------
# Throughput is judged over blocks of consecutive steady steps each spanning at least this
# much step time.  A JAX step's time is an interval of a pipelined timeline: the probe's
# watcher thread notes when each step's outputs became ready, and when it gets the
# interpreter back only after a while (the main thread dispatching; CPython's switch
# interval is 5 ms), it notes a batch of steps at once: one long interval, then
# near-zero ones.  Measured on the CPU (tests/test_l4_across_hardware.py's clean JAX port,
# 0.5 ms steps): runs of ~25 steps noted within microseconds after a 54 ms interval, a
# per-step median of 0.003 ms against a mean of 0.54 ms.  Only sums over a span longer
# than such a batch mean anything; 0.1 s is twice the longest seen.
BLOCK_S = 0.1
# With fewer blocks the median is no better than the whole window's rate.
MIN_BLOCKS = 3


def block_rates(units: np.ndarray, seconds: np.ndarray, block_s: float = BLOCK_S
                ) -> np.ndarray:
    """Rates ``sum(u) / sum(t)`` of consecutive blocks of steps: a block closes with the
    step that brings its own step time to ``block_s`` or more (a step longer than that is
    a block of its own), and an incomplete last block joins the one before.  The
    batch-means method of steady-state simulation output (Law, *Simulation Modeling and
    Analysis*, 5th ed., 2015, 9.5.3), here for a timeline whose single intervals are not
    meaningful but whose sums are.  Fewer than :data:`MIN_BLOCKS` blocks: the one rate of
    the whole window."""
    cum = np.cumsum(seconds)
    n, starts, base, i = len(seconds), [], 0.0, 0
    while i < n:
        starts.append(i)
        # the first step at which the block's own time reaches block_s (inclusive)
        j = int(np.searchsorted(cum, base + block_s * (1 - 1e-9), side="left")) + 1
        i = min(max(j, i + 1), n)
        base = float(cum[i - 1])
    if len(starts) >= 2 and cum[-1] - cum[starts[-1] - 1] < block_s * (1 - 1e-9):
        starts.pop()  # the incomplete last block joins the one before
    if len(starts) < MIN_BLOCKS:
        return np.array([units.sum() / seconds.sum()])
    return np.add.reduceat(units, starts) / np.add.reduceat(seconds, starts)


@dataclass(frozen=True)
class RunThroughput:
    """One run's steady throughput in ``unit`` per second (see the module docstring)."""

    per_s: float | None  # median of the block rates (block_rates)
    mean_per_s: float | None  # sum of units / sum of seconds over the same steps
    steps: int  # steady steps it rests on
    blocks: int  # blocks of at least BLOCK_S of step time (1: the whole window)
    compile_steps: int  # steps left out (rv.steady_step_times: compilations, between-step work)
    warmup_end_step: int | None
    why: str = ""  # why not measured (per_s None)


def steady_units(run: RunData, unit: Unit, keep: str, start: int, metric: str,
                 compile_metrics: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """``(units, seconds, steps left out)`` of the run's steady steps from ``start``
    (:func:`refrun.acceptance.runview.steady_step_times` of ``metric``), keeping the steps
    whose seconds are > 0 and whose units are known (:func:`step_units`)."""
    steps, secs, n_comp = rv.steady_step_times(run, metric, list(compile_metrics), keep, start)
    units = step_units(run, unit, steps, keep)
    ok = (secs > 0) & np.isfinite(units)
    return units[ok], secs[ok], n_comp


def run_throughput(run: RunData, unit: Unit, keep: str, start_of: Callable[[np.ndarray], int],
                   metric: str = schema.M_STEP_TIME,
                   compile_metrics: Sequence[str] = schema.STEP_TIME_COMPILE_METRICS
                   ) -> RunThroughput:
    """The run's steady throughput: the median of :func:`block_rates` of ``u(s)`` units
    over ``t(s)`` seconds at its steady steps ``s`` (after ``start_of(its step-time
    steps)``, compilation steps left out; a step time <= 0 or a step whose units are
    unknown is left out too)."""
    r = rv.resolved(run, metric, keep)
    f = rv.finite(r) if r is not None else None
    if f is None or not len(f.steps):
        return RunThroughput(None, None, 0, 0, 0, None,
                             f"run {run.run_id} has no finite {metric!r}")
    start = start_of(f.steps)
    u, t, n_comp = steady_units(run, unit, keep, start, metric, compile_metrics)
    if not len(u):
        return RunThroughput(None, None, 0, 0, n_comp, start,
                             f"run {run.run_id}: no steady {metric!r} value after step "
                             f"{start} with a known {unit} count ({n_comp} compilation "
                             "step(s) left out)")
    rates = block_rates(u, t)
    return RunThroughput(float(np.median(rates)), float(u.sum() / t.sum()), len(u),
                         len(rates), n_comp, start)


# --- cost ----------------------------------------------------------------------------------
def work_factors(references: Sequence[RunData], runs: Sequence[RunData], unit: Unit,
                 keep: str) -> tuple[dict[str, float], float | None, str]:
    """``({run id: W_ref / W}, W_ref, why not)``: the factor that turns each run's hours
    into hours for the references' mean work ``W_ref`` (:func:`run_work`)."""
    done = {r.run_id: run_work(r, unit, keep) for r in [*references, *runs]}
    missing = next((why if w is None else f"run {rid} processed no {unit}"
                    for rid, (w, why) in done.items() if not w), "")
    works = {rid: w for rid, (w, _) in done.items() if w}
    if missing:
        return {}, None, missing
    ref = float(np.mean([works[r.run_id] for r in references]))
    return {rid: ref / w for rid, w in works.items()}, ref, ""


@dataclass(frozen=True)
class RunCost:
    """One run's cost: billed hours x price per hour (see the module docstring)."""

    cost: float | None
    hours: float | None  # as run (time_source)
    billed_hours: float | None  # x the same-work factor, when one applies
    price_per_hour: float | None
    hardware: str | None  # the [prices.hourly] key that priced it
    time: str  # how the hours were measured (or why not)
    price: str  # where the price came from (or why none)
    why: str = ""  # why no cost


def run_cost(run: RunData, prices: Any, keep: str, time_source: str = "run_wall",
             factor: float | None = None) -> RunCost:
    """Hours (``time_source``: ``run_wall`` the MLflow run's end - start, ``step_time_sum``
    the sum of its step times) x ``factor`` (the same-work factor of
    :func:`work_factors`; None: as run) x the price per hour of its hardware."""
    hours, hnote = rv.run_hours(run, time_source, keep=keep)
    hw, price, pnote = rv.hardware_price(run, prices)
    billed = hours
    if hours is not None and factor is not None:
        billed, hnote = hours * factor, f"{hnote} x {factor:.4g} (the references' work)"
    if price is None and not prices.hourly:
        pnote = ("no [prices] table (refrun calibrate --price HARDWARE=PER_HOUR writes one, "
                 "with the criteria)")
    if billed is None or price is None:
        return RunCost(None, hours, billed, price, hw, hnote, pnote,
                       hnote if billed is None else pnote)
    return RunCost(billed * price, hours, billed, price, hw, hnote, pnote)


# --- chip busy fraction ----------------------------------------------------------------------
@dataclass(frozen=True)
class RunBusy:
    """One run's chip busy fraction (mean over chips, percent), or why none."""

    pct: float | None
    by_metric: dict[str, float] = field(default_factory=dict)
    source: str = ""  # the run's utilisation-source tag, when a monitor left one
    why: str = ""


def run_busy(run: RunData, keep: str, start_of: Callable[[np.ndarray], int]) -> RunBusy:
    """The run's chip busy fraction (:func:`refrun.acceptance.runview.busy_means`
    over every chip metric it recorded), or why it has none: the source tag its monitor
    wrote (``refrun.exec.utilization_source``), else that it executed on the CPU, else
    that no monitor recorded one."""
    means, _ = rv.busy_means(run, [], keep, start_of)
    source = run.tags.get(schema.TAG_UTILIZATION_SOURCE, "").strip()
    if means:
        return RunBusy(float(np.mean(list(means.values()))), means, source)
    executed = (run.tags.get(schema.TAG_EXEC_HARDWARE) or "").strip().lower()
    if source:
        why = f"run {run.run_id}: {source}"
    elif run.tags.get(schema.TAG_EXEC_HARDWARE) is not None and \
            executed in schema.CPU_HARDWARE_NAMES:
        why = (f"run {run.run_id} executed on the CPU ({schema.TAG_EXEC_HARDWARE} = "
               f"{executed!r}): no accelerator whose busy time a monitor samples")
    else:
        why = (f"run {run.run_id} recorded no chip utilisation (sys/gpu<i>_util_pct from "
               "NVML, sys/tpu<i>_duty_cycle_pct from the TPU monitors)")
    return RunBusy(None, {}, source, why)


# --- the three figures of a migration ---------------------------------------------------------
@dataclass(frozen=True)
class RunFigures:
    """The three figures of one run."""

    run_id: str
    role: str  # reference | candidate
    configuration: str  # "jax on tpu-v5e x1"
    throughput: RunThroughput
    cost: RunCost
    busy: RunBusy


def _mean(xs: Sequence[float | None]) -> float | None:
    """The mean, or None when a value is missing (or there is none)."""
    values = [x for x in xs if x is not None]
    return float(np.mean(values)) if values and len(values) == len(xs) else None


def _ratio(cand: float | None, ref: float | None) -> float | None:
    if cand is None or ref is None:
        return None
    return cand / ref if ref > 0 else math.inf


@dataclass(frozen=True)
class Performance:
    """A migrated candidate's throughput, cost and chip busy fraction against its
    references' (what ``refrun accept`` prints and the report's first screen shows)."""

    migration: str  # "torch on nvidia-l4 x1 -> jax on tpu-v5e x1"
    unit: str | None  # tokens | samples | steps
    unit_note: str  # why per step, or why no unit
    currency: str
    runs: tuple[RunFigures, ...]

    @property
    def candidate(self) -> RunFigures:
        return self.runs[-1]

    @property
    def references(self) -> tuple[RunFigures, ...]:
        return self.runs[:-1]

    def reference_throughput(self) -> float | None:
        return _mean([r.throughput.per_s for r in self.references])

    def throughput_ratio(self) -> float | None:
        return _ratio(self.candidate.throughput.per_s, self.reference_throughput())

    def reference_cost(self) -> float | None:
        return _mean([r.cost.cost for r in self.references])

    def cost_ratio(self) -> float | None:
        return _ratio(self.candidate.cost.cost, self.reference_cost())

    def reference_busy(self) -> float | None:
        return _mean([r.busy.pct for r in self.references])

    def why(self, figure: str, side: str) -> str:
        """Why ``figure`` (throughput, cost, busy) is not measured on ``side`` (candidate,
        reference: the first reference missing it), else ""."""
        runs = (self.candidate,) if side == "candidate" else self.references
        for r in runs:
            part = getattr(r, figure)
            value = part.per_s if figure == "throughput" else \
                part.cost if figure == "cost" else part.pct
            if value is None:
                return part.why or self.unit_note
        return ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``assessment.json``'s ``performance``): the ratios, each side's
        figure or why it is not measured, and every run's figures."""
        return {"migration": self.migration, "unit": self.unit, "unit_note": self.unit_note,
                "currency": self.currency,
                "throughput": {"candidate_per_s": self.candidate.throughput.per_s,
                               "reference_per_s": self.reference_throughput(),
                               "ratio": self.throughput_ratio(),
                               "candidate_why": self.why("throughput", "candidate"),
                               "reference_why": self.why("throughput", "reference")},
                "cost": {"candidate": self.candidate.cost.cost,
                         "reference": self.reference_cost(), "ratio": self.cost_ratio(),
                         "candidate_why": self.why("cost", "candidate"),
                         "reference_why": self.why("cost", "reference")},
                "busy": {"candidate_pct": self.candidate.busy.pct,
                         "reference_pct": self.reference_busy(),
                         "candidate_why": self.why("busy", "candidate"),
                         "reference_why": self.why("busy", "reference"),
                         "candidate_source": self.candidate.busy.source,
                         "reference_source": next((r.busy.source for r in self.references
                                                   if r.busy.source), "")},
                "runs": [asdict(r) for r in self.runs]}


def fmt(x: float | None) -> str:
    """A figure for a line of text: 4 significant digits, thousands separated."""
    return "n/a" if x is None else f"{x:,.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def figure_lines(d: Mapping[str, Any]) -> list[str]:
    """One line per figure of a :meth:`Performance.to_dict` (also read back from an
    assessment JSON)."""
    unit = d.get("unit") or "units"
    tp, cost, busy = d.get("throughput") or {}, d.get("cost") or {}, d.get("busy") or {}
    cur = d.get("currency") or ""
    out = []
    if tp.get("ratio") is not None:
        out.append(f"throughput {tp['ratio']:.3f}x: candidate {fmt(tp['candidate_per_s'])} "
                   f"{unit}/s vs references {fmt(tp['reference_per_s'])} {unit}/s (steady "
                   "steps, median of 0.1 s blocks)")
    else:
        out.append(f"throughput {NOT_MEASURED}{_why(tp)}")
    if cost.get("ratio") is not None:
        out.append(f"cost per run {cost['ratio']:.3f}x: candidate {cost['candidate']:.4g} "
                   f"{cur} vs references {cost['reference']:.4g} {cur} (hours for the same "
                   "work x price per hour)")
    else:
        out.append(f"cost per run {NOT_MEASURED}{_why(cost)}")
    parts = []
    for side, key in (("candidate", "candidate"), ("references", "reference")):
        pct, src = busy.get(f"{key}_pct"), busy.get(f"{key}_source")
        parts.append((f"{side} {pct:.1f}%" + (f" ({src})" if src else "")) if pct is not None
                     else f"{side} {NOT_MEASURED}{busy.get(f'{key}_why')}")
    out.append("chip busy " + "; ".join(parts))
    return out


def _why(figure: Mapping[str, Any]) -> str:
    """Why a figure has no ratio: the candidate's reason, else the references'."""
    return str(figure.get("candidate_why") or figure.get("reference_why") or "")


def assessment_lines(assessment: Any) -> list[str]:
    """What ``refrun accept`` prints for a migrated candidate
    (:class:`refrun.acceptance.results.Assessment` with ``performance``): its L4 figures,
    one line each, headed by the migration and whether the file's L4 criteria judged them
    or they are measurements only.  Nothing for a candidate on the references'
    configuration."""
    if not assessment.performance:
        return []
    judged = [r for r in assessment.results if r.level == "L4" and r.evaluated
              and r.outcome != "not_applicable"]
    held = [r for r in assessment.results if r.level == "L4" and not r.evaluated]
    head = f"L4 across hardware ({assessment.performance.get('migration')}): "
    if judged:
        head += "judged by " + ", ".join(f"{r.id} {r.outcome.upper()}" for r in judged)
    elif held:
        head += "not judged yet (L4 is judged only after L3 passed); measured"
    else:
        head += ("measured only (no L4 goal declared: refrun calibrate --goal "
                 "throughput>=RATIOx, cost<=RATIOx, utilization>=PCT%)")
    return [head] + [f"  {ln}" for ln in figure_lines(assessment.performance)]


def measure(candidate: RunData, references: Sequence[RunData], prices: Any,
            settings: Any) -> Performance | None:
    """The :class:`Performance` of a migrated candidate (None when it is no migration:
    :func:`refrun.acceptance.migration.migration`).  ``prices``: the criteria file's
    ``[prices]``; ``settings``: its ``[settings]`` (``keep``, warm-up)."""
    what = migration(candidate, references)
    if what is None:
        return None
    keep = settings.keep
    runs = [*references, candidate]

    def start_of(steps: np.ndarray) -> int:
        return rv.steady_start(steps, settings.warmup_steps, settings.warmup_fraction)

    unit, note = choose_unit(runs)
    factors: dict[str, float] = {}
    why = note
    if unit is not None:
        factors, _, why = work_factors(references, [candidate], unit, keep)
    figures = []
    for role, r in [*(("reference", x) for x in references), ("candidate", candidate)]:
        tp = run_throughput(r, unit, keep, start_of) if unit is not None else \
            RunThroughput(None, None, 0, 0, 0, None, note)
        cost = run_cost(r, prices, keep, factor=factors[r.run_id]) if not why else \
            RunCost(None, None, None, None, None, "", "", why)
        figures.append(RunFigures(r.run_id, role, configuration(r).text(), tp, cost,
                                  run_busy(r, keep, start_of)))
    return Performance(what, unit, note, prices.currency, tuple(figures))
