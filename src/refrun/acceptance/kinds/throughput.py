"""Criterion kind ``throughput``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from refrun import schema
from refrun.acceptance import performance as perf
from refrun.acceptance.checks import Context, result
from refrun.acceptance.contention import (
    CPU_CLOCK_FRACTION,
    contention,
    finite_dict,
    judged,
    per_run,
    run_cpu_inflation,
)
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData


@kind("throughput")
class Throughput(Criterion):
    """steady throughput (samples or tokens per second of step time, warm-up and compilation
    steps left out; the median of the rates of 0.1 s blocks of steps), candidate / mean of
    the references' >= min_ratio: a migration's speed, whatever the hardware or framework
    (written by refrun calibrate --goal throughput>=RATIOx)"""

    min_ratio: float = key("least allowed ratio (< 1: the candidate may be slower)", gt=0)
    unit: str = key("what a step's work is counted in: 'auto' (tokens when every run records "
                    "them, else samples, else steps when no run records samples), or "
                    "'tokens', 'samples', 'steps'", "auto", enum=perf.UNIT_CHOICES)
    metric: str = key("step-time metric, seconds", schema.M_STEP_TIME)
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)
    compile_metrics: list[str] = key(
        "per-step compilation counters: a step where one is > 0 is left out of every run "
        "([] keeps every step)", list(schema.STEP_TIME_COMPILE_METRICS))

    def check(self, ctx: Context) -> CriterionResult:
        return throughput(self, ctx)


def throughput(c: Throughput, ctx: Context) -> CriterionResult:
    """Candidate's steady throughput / mean of the references' >= ``min_ratio``
    (:func:`refrun.acceptance.performance.run_throughput` on every run, in one unit).  A
    fail on a machine that took CPU from the candidate, and a pass against references
    recorded beside busier neighbours, are not judged, as for step time
    (:func:`refrun.acceptance.contention.judged`), unless the runs' own CPU time per
    step settles them (:class:`CpuRateBound`)."""
    runs = [*ctx.references, ctx.candidate]
    unit, note = perf.choose_unit(runs, c.unit)
    if unit is None:
        return result(c, NOT_EVALUABLE, note, {"unit": c.unit}, metric=None)
    figs = [perf.run_throughput(r, unit, ctx.keep,
                                lambda steps: ctx.warmup(steps, c.warmup_steps), c.metric,
                                c.compile_metrics) for r in runs]
    ev = {"unit": unit, "unit_note": note, "min_ratio": c.min_ratio,
          "runs": [{"run_id": r.run_id, "role": role, "per_s": f.per_s,
                    "mean_per_s": f.mean_per_s, "steady_steps": f.steps, "blocks": f.blocks,
                    "compile_steps_excluded": f.compile_steps,
                    "warmup_end_step": f.warmup_end_step}
                   for r, f, role in zip(runs, figs, [*(["reference"] * len(ctx.references)),
                                                       "candidate"], strict=True)]}
    missing = next((f for f in (figs[-1], *figs[:-1]) if f.per_s is None), None)
    if missing is not None:
        return result(c, NOT_EVALUABLE, missing.why, ev)
    ref = float(np.mean([f.per_s for f in figs[:-1]]))
    cand = figs[-1].per_s
    assert cand is not None
    ratio = cand / ref
    ev.update(candidate_per_s=cand, reference_per_s=ref, ratio=ratio)
    ok = ratio >= c.min_ratio
    reason = (f"steady throughput {perf.fmt(cand)} vs {perf.fmt(ref)} {unit}/s: ratio "
              f"{ratio:.3f} "
              f"{'>=' if ok else '<'} {c.min_ratio:g}" + (f" ({note})" if note else ""))
    refs = list(ctx.references)
    cont = contention(ctx.candidate, refs, ctx.keep)
    bound = None
    if ok and cont.references_busier:
        bound = cpu_rate_bound("references", refs, cont.reference_cores,
                               cont.reference_logical_cpus, figs[:-1], unit, ctx.keep,
                               c.compile_metrics, cand)
    elif not ok and cont.took_cpu:
        bound = cpu_rate_bound("candidate", [ctx.candidate], (cont.candidate_cores,),
                               (cont.logical_cpus,), figs[-1:], unit, ctx.keep,
                               c.compile_metrics, ref)
    return judged(c, PASS if ok else FAIL, reason, ev, cont, "throughput",
                  floor=None if ok else bound, limit=c.min_ratio,
                  ceiling=bound if ok else None)


Side = Literal["references", "candidate"]


@dataclass(frozen=True)
class CpuRateBound:
    """What runs' own CPU seconds per step say about a throughput ratio the machine's load
    made not judgeable: the throughput counterpart of step time's
    :class:`~refrun.acceptance.kinds.step_time.CpuCeiling` (``side`` "references") and
    :class:`~refrun.acceptance.kinds.step_time.CpuFloor` (``side`` "candidate").

    A step takes at least its training thread's CPU seconds ``c`` (a thread accrues CPU
    time only while it runs), and neighbours using ``o`` of ``n`` CPUs lengthen those by
    at most ``B = cpu_inflation_bound(o, n)`` (shared hardware only), so on an idle
    machine each step would take at least ``c / B``.  A run's throughput on an idle
    machine is then at most the same statistic over those times: the median of the
    batch-means block rates (:func:`refrun.acceptance.performance.block_rates`) of its
    steady steps' units over ``c / B``, each bounded run's figure in
    ``rates_bound_per_s``.

    * side "references" (a pass against references busier than the candidate):
      ``ratio_bound`` = the candidate's throughput / the mean of the references' bounds,
      a lower bound on the ratio against the references on an idle machine; the pass
      stands when it is at least the criterion's ``min_ratio``.
    * side "candidate" (a fail on a machine that took CPU from the candidate):
      ``ratio_bound`` = the candidate's bound / the references' mean throughput, an upper
      bound on its ratio on an idle machine; the fail stands when it is below
      ``min_ratio``.

    ``usable``: every bounded run has steady ``perf/step_cpu_s`` values with known units,
    its machine's load and CPU count are known, and its thread CPU clock resolves its
    median step (``clock_step_s``, the coarsest, at most ``clock_fraction`` of it);
    ``why``: why not, when not."""

    evidence_key: ClassVar[str] = schema.EV_CPU_RATE_BOUND
    usable: bool
    side: Side
    metric: str
    why: str = ""
    rates_bound_per_s: tuple[float, ...] | None = None
    inflation_bounds: tuple[float, ...] | None = None
    clock_step_s: float | None = None
    clock_fraction: float = CPU_CLOCK_FRACTION
    ratio_bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = finite_dict(self)
        for k in ("rates_bound_per_s", "inflation_bounds"):
            d[k] = None if d[k] is None else list(d[k])
        return d

    def holds(self, limit: float) -> bool:
        """The bound settles the result against ``limit``: the pass stands (references)
        or the fail stands (candidate) whatever the neighbours did."""
        r = self.ratio_bound
        if not self.usable or r is None:
            return False
        return r >= limit if self.side == "references" else r < limit

    def versus(self, limit: float) -> str:
        above = self.ratio_bound is not None and self.ratio_bound >= limit
        return f" >= {limit:g}" if above else f" < {limit:g}"

    def summary(self) -> str:
        whose = "the references'" if self.side == "references" else "the candidate's"
        if not self.usable:
            return f"{whose} CPU time per step cannot bound it ({self.why})"
        infl = ", ".join(f"{b:.2f}x" for b in self.inflation_bounds or ())
        at = "at >=" if self.side == "references" else "at <="
        return (f"{whose} own CPU time per step, which their neighbours inflate at most "
                f"{infl}, puts the ratio on an idle machine {at} {self.ratio_bound:.3f}")


def cpu_rate_bound(side: Side, runs: Sequence[RunData],
                   others: Sequence[float | None] | None, cpus: Sequence[float | None] | None,
                   figs: Sequence[perf.RunThroughput], unit: perf.Unit, keep: str,
                   compile_metrics: Sequence[str], against: float) -> CpuRateBound:
    """The :class:`CpuRateBound` of ``runs`` (the references, or the candidate alone):
    each run's steady ``perf/step_cpu_s`` from its throughput's warm-up end (``figs``),
    compilation steps left out as for its step times; ``others`` and ``cpus`` each run's
    median other processes' cores and CPU count (:class:`Contention`); ``against``: the
    candidate's throughput (side "references") or the references' mean (side
    "candidate")."""
    base: dict[str, Any] = {"side": side, "metric": schema.M_STEP_CPU}
    bounds, infls, ticks = [], [], []
    n = len(runs)
    for run, o, cpu_n, fig in zip(runs, per_run(others, n), per_run(cpus, n), figs,
                                  strict=True):
        units, cpu, _ = perf.steady_units(run, unit, keep, fig.warmup_end_step or 0,
                                          schema.M_STEP_CPU, compile_metrics)
        infl, tick, why = run_cpu_inflation(
            run.run_id, o, cpu_n, cpu,
            f"has no steady {schema.M_STEP_CPU} values with a known {unit} count")
        if why:
            return CpuRateBound(False, why=why, clock_step_s=None if math.isnan(tick)
                                else tick, **base)
        bounds.append(float(np.median(perf.block_rates(units, cpu / infl))))
        infls.append(infl)
        ticks.append(tick)
    mean = float(np.mean(bounds))
    ratio = against / mean if side == "references" else mean / against
    return CpuRateBound(True, rates_bound_per_s=tuple(bounds), inflation_bounds=tuple(infls),
                        clock_step_s=max(ticks), ratio_bound=ratio, **base)
