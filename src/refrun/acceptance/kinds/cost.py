"""Criterion kind ``cost``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from refrun import schema
from refrun.acceptance import performance as perf
from refrun.acceptance import runview as rv
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


@kind("cost", any_of=(("max_ratio", "max_cost"),))
class Cost(Criterion):
    """cost per run = hours x price per hour ([prices]); candidate / mean reference cost <=
    max_ratio and/or candidate cost <= max_cost"""

    max_ratio: float | None = key("largest allowed cost ratio", None, gt=0)
    max_cost: float | None = key("largest allowed candidate cost, in [prices] currency",
                                 None, ge=0)
    time_source: str = key("'run_wall': MLflow end - start time of the run, less refrun's "
                           "own start-up where the run records it; "
                           "'step_time_sum': sum of perf/step_time_s", "run_wall",
                           enum=("run_wall", "step_time_sum"))
    same_work: bool = key(
        "price every run for the same work: its hours x (the references' mean work / its "
        "own), work counted in tokens, samples or steps as throughput counts it "
        "(progress/*, refrun.global_batch); a candidate that ran another batch or another "
        "number of steps is priced for the references' work. Default false: the hours as "
        "run", False)

    def check(self, ctx: Context) -> CriterionResult:
        return cost(self, ctx)


def _row(run: RunData, role: str, c: Cost, ctx: Context, factor: float | None
         ) -> dict[str, Any]:
    rc = perf.run_cost(run, ctx.criteria.prices, ctx.keep, c.time_source, factor)
    return {"run_id": run.run_id, "role": role, "hours": rc.billed_hours, "time": rc.time,
            "hardware": rc.hardware, "price_per_hour": rc.price_per_hour, "price": rc.price,
            "cost": rc.cost}


def cost(c: Cost, ctx: Context) -> CriterionResult:
    """Cost per run = hours x price per hour (``same_work``: hours for the references'
    mean work); ratio = candidate cost / mean reference cost.  A ratio's pass against
    references recorded beside busier neighbours than the candidate is not judged (the
    references' rule, :func:`refrun.acceptance.contention.judged`): their hours hold
    what those neighbours cost them, unless their own CPU time keeps the ratio within the
    limit on an idle machine.  A fail on a machine that took CPU from the candidate is not
    judged either, unless the candidate's own CPU time puts its cost on an idle machine over
    the limit: its hours hold what its neighbours cost it (both: :class:`CpuCostBound`)."""
    prices = ctx.criteria.prices
    factors: dict[str, float] = {}
    work_ev: dict[str, Any] = {}
    if c.same_work:
        unit, why = perf.choose_unit([*ctx.references, ctx.candidate])
        if unit is not None:
            factors, ref_work, why = perf.work_factors(ctx.references, [ctx.candidate],
                                                       unit, ctx.keep)
            work_ev = {"unit": unit, "reference_work": ref_work, "work_factor": factors}
        if why:
            return result(c, NOT_EVALUABLE, why, {"same_work": True, **work_ev},
                          metric=None)
    rows = [_row(run, role, c, ctx, factors.get(run.run_id) if c.same_work else None)
            for role, run in [*(("reference", r) for r in ctx.references),
                              ("candidate", ctx.candidate)]]
    ev: dict[str, Any] = {"currency": prices.currency, "time_source": c.time_source,
                          "per": prices.per, "runs": rows, "max_ratio": c.max_ratio,
                          "max_cost": c.max_cost}
    if c.same_work:
        ev.update(same_work=True, **work_ev)
    cand = rows[-1]
    if cand["cost"] is None:
        return result(c, NOT_EVALUABLE, cand["time"] if cand["hours"] is None
                      else cand["price"], ev, metric=None)
    ev["candidate_cost"] = cand["cost"]
    problems, ratio_failed = [], False
    if c.max_ratio is not None:
        ref_costs = [r["cost"] for r in rows[:-1]]
        if any(x is None for x in ref_costs):
            bad = next(r for r in rows[:-1] if r["cost"] is None)
            return result(c, NOT_EVALUABLE, bad["time"] if bad["hours"] is None
                          else bad["price"], ev, metric=None)
        ref_cost = float(np.mean(ref_costs))
        ratio = cand["cost"] / ref_cost if ref_cost > 0 else math.inf
        ev.update(reference_cost=ref_cost, ratio=ratio)
        if ratio_failed := ratio > c.max_ratio:
            problems.append(f"ratio {ratio:.3f} > {c.max_ratio:g}")
    if cost_failed := c.max_cost is not None and cand["cost"] > c.max_cost:
        problems.append(f"cost {cand['cost']:.4g} > {c.max_cost:g} {prices.currency}")
    summary = (f"candidate {cand['cost']:.4g} {prices.currency}"
               + (f" vs reference {ev['reference_cost']:.4g} (ratio {ev['ratio']:.3f})"
                  if "ratio" in ev else ""))
    refs = list(ctx.references)
    cont = contention(ctx.candidate, refs, ctx.keep)
    if problems:
        # The candidate's rule (contention.judged): a candidate beside neighbours that
        # took CPU from it ran longer, so cost more, than it would alone.
        floor = None
        if cont.took_cpu:
            floor = cpu_cost_bound(
                "candidate", [ctx.candidate], (cont.candidate_cores,), (cont.logical_cpus,),
                rows[-1:], [factors.get(ctx.candidate.run_id)], ctx.keep, c.time_source,
                prices.currency,
                ev.get("reference_cost"), c.max_ratio if ratio_failed else None,
                c.max_cost if cost_failed else None)
        return judged(c, FAIL, summary + ": " + "; ".join(problems), ev, cont, "cost",
                      floor=floor, limit=None if floor is None else floor.limit)
    if c.max_ratio is None:  # an absolute price: the references' machine plays no part
        return result(c, PASS, summary, ev, metric=None)
    # The references' rule (contention.judged): references recorded beside busier
    # neighbours ran longer, so cost more, than they would alone; a candidate can look
    # cheap enough against them while it is not, so such a pass is not judged unless
    # their own CPU time proves it.
    ceiling = cpu_cost_bound(
        "references", refs, cont.reference_cores, cont.reference_logical_cpus, rows[:-1],
        [factors.get(r.run_id) for r in refs], ctx.keep, c.time_source, prices.currency,
        cand["cost"], c.max_ratio, None) if cont.references_busier else None
    return judged(c, PASS, summary, ev, cont, "cost", limit=c.max_ratio, ceiling=ceiling)


Side = Literal["references", "candidate"]
Against = Literal["ratio", "cost"]


@dataclass(frozen=True)
class CpuCostBound:
    """What runs' own CPU seconds say about a cost result the machine's load made not
    judgeable: the cost counterpart of throughput's
    :class:`~refrun.acceptance.kinds.throughput.CpuRateBound`.

    A run's steps run one after the other inside its priced time (its wall less refrun's
    own start-up and close, or the sum of its step times), and the rest of that time takes
    no less than nothing.  Each step takes at least its training thread's CPU seconds
    ``c_i`` (a thread accrues CPU time only while it runs), which neighbours using ``o`` of
    ``n`` CPUs lengthen by at most ``B = cpu_inflation_bound(o, n)`` (shared hardware
    only).  So on an idle machine a run would be billed at least ``sum(c_i) / B / 3600``
    hours (x its same-work factor), at least its price per hour times that
    (``costs_lower``, one per bounded run; the sum over every step with a finite
    ``perf/step_cpu_s``: a step without one adds nothing, still a lower bound).

    * side "candidate" (a fail on a machine that took CPU from the candidate):
      ``cost_lower`` its floor, ``ratio_bound`` = ``cost_lower`` / the references' mean
      cost (``against_cost``), a lower bound on its ratio on an idle machine.  Read against
      ``against`` ``ratio`` (``max_ratio``) or ``cost`` (``max_cost``): the limit it settles
      when it settles one (the ratio first), else the first that failed.  The fail stands
      when the figure exceeds ``limit``.
    * side "references" (a ``max_ratio`` pass against references busier than the
      candidate): ``cost_lower`` the mean of their floors, ``ratio_bound`` = the
      candidate's cost (``against_cost``) / ``cost_lower``, an upper bound on the ratio
      against them on an idle machine; the pass stands when it is at most ``limit``.

    ``usable``: every bounded run has such values, its machine's load and CPU count are
    known and its thread CPU clock resolves its median step (``clock_step_s``, the
    coarsest, at most ``clock_fraction`` of it); ``why``: why not, when not."""

    evidence_key: ClassVar[str] = schema.EV_CPU_COST_BOUND
    usable: bool
    side: Side
    metric: str
    against: Against
    limit: float
    currency: str
    why: str = ""
    steps: tuple[int, ...] | None = None
    cpu_s: tuple[float, ...] | None = None
    others_cores: tuple[float, ...] | None = None
    logical_cpus: tuple[float, ...] | None = None
    inflation_bounds: tuple[float, ...] | None = None
    clock_step_s: float | None = None
    clock_fraction: float = CPU_CLOCK_FRACTION
    costs_lower: tuple[float, ...] | None = None
    cost_lower: float | None = None
    against_cost: float | None = None
    ratio_bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = finite_dict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @property
    def figure(self) -> float | None:
        return self.cost_lower if self.against == "cost" else self.ratio_bound

    def holds(self, limit: float) -> bool:
        """The bound settles the result against ``limit``: the fail stands (candidate) or
        the pass stands (references) whatever the neighbours did."""
        f = self.figure
        if not self.usable or f is None:
            return False
        return f > limit if self.side == "candidate" else f <= limit

    def versus(self, limit: float) -> str:
        above = self.figure is not None and self.figure > limit
        return f" > {limit:g}" if above else f" <= {limit:g}"

    def summary(self) -> str:
        whose = "the candidate's" if self.side == "candidate" else "the references'"
        if not self.usable:
            return f"{whose} CPU time per step cannot bound it ({self.why})"
        if self.side == "references":
            infl = ", ".join(f"{b:.2f}x" for b in self.inflation_bounds or ())
            return (f"the references' own CPU time in their steps, which their neighbours "
                    f"inflate at most {infl}, puts the cost ratio on an idle machine at <= "
                    f"{self.ratio_bound:.3f}")
        assert self.cpu_s and self.steps and self.others_cores and self.logical_cpus \
            and self.inflation_bounds
        what = (f"its cost ratio at >= {self.ratio_bound:.3f}" if self.against == "ratio"
                else f"its cost at >= {self.cost_lower:.4g} {self.currency}")
        return (f"the candidate's own CPU time in its steps ({rv.fnum(self.cpu_s[0])} s over "
                f"{self.steps[0]} steps), which neighbours using {self.others_cores[0]:.2f} "
                f"of {self.logical_cpus[0]:g} CPUs inflate at most "
                f"{self.inflation_bounds[0]:.2f}x, puts {what} on an idle machine")


def _step_cpu(run: RunData, keep: str, time_source: str) -> np.ndarray:
    """The run's finite, non-negative ``perf/step_cpu_s`` values, of the steps its priced
    hours cover: every step for ``run_wall`` (its steps run inside its wall), only those
    with a finite step time for ``step_time_sum`` (the hours are the sum of those)."""
    r = rv.resolved(run, schema.M_STEP_CPU, keep)
    if r is None:
        return np.empty(0)
    ok = np.isfinite(r.values) & (r.values >= 0)
    if time_source == "step_time_sum":
        t = rv.resolved(run, schema.M_STEP_TIME, keep)
        timed = np.empty(0, dtype=np.int64) if t is None else t.steps[np.isfinite(t.values)]
        ok &= np.isin(r.steps, timed)
    return r.values[ok]


def cpu_cost_bound(side: Side, runs: Sequence[RunData],
                   others: Sequence[float | None] | None, cpus: Sequence[float | None] | None,
                   rows: Sequence[dict[str, Any]], factors: Sequence[float | None],
                   keep: str, time_source: str, currency: str, against_cost: float | None,
                   max_ratio: float | None, max_cost: float | None) -> CpuCostBound:
    """The :class:`CpuCostBound` of ``runs`` (the candidate alone, or the references):
    ``others`` and ``cpus`` each run's median other processes' cores and CPU count
    (:class:`~refrun.acceptance.criterion_evidence.Contention`), ``rows`` their cost rows
    as :func:`cost` priced them (their hours from ``time_source``) and ``factors`` their
    same-work factors (None: as run);
    ``against_cost``: the references' mean cost (side "candidate") or the candidate's
    cost (side "references"); ``max_ratio`` and ``max_cost``: the limits it may be read
    against (side "candidate": those that failed; side "references": ``max_ratio``)."""
    metric = schema.M_STEP_CPU
    first: Against = "ratio" if max_ratio is not None else "cost"
    limit = max_ratio if max_ratio is not None else max_cost
    assert limit is not None
    base: dict[str, Any] = {"side": side, "metric": metric, "currency": currency,
                            "against_cost": against_cost}
    n = len(runs)
    others, cpus = per_run(others, n), per_run(cpus, n)
    steps, totals, infls, ticks, costs = [], [], [], [], []
    for run, o, cpu_n, row, factor in zip(runs, others, cpus, rows, factors, strict=True):
        cpu = _step_cpu(run, keep, time_source)
        infl, tick, why = run_cpu_inflation(run.run_id, o, cpu_n, cpu,
                                            f"has no {metric} values")
        if why:
            return CpuCostBound(False, against=first, limit=limit, why=why,
                                clock_step_s=None if math.isnan(tick) else tick, **base)
        hours = float(cpu.sum()) / infl / 3600.0 * (1.0 if factor is None else factor)
        steps.append(len(cpu))
        totals.append(float(cpu.sum()))
        infls.append(infl)
        ticks.append(tick)
        costs.append(hours * row["price_per_hour"])
    mean = float(np.mean(costs))
    if side == "candidate":
        ratio = None if against_cost is None else (
            mean / against_cost if against_cost > 0 else math.inf)
    else:
        ratio = (against_cost or 0.0) / mean if mean > 0 else math.inf
    against: Against = first
    if side == "candidate" and not (max_ratio is not None and ratio is not None
                                    and ratio > max_ratio) \
            and max_cost is not None and mean > max_cost:
        against, limit = "cost", max_cost
    return CpuCostBound(True, against=against, limit=limit, steps=tuple(steps),
                        cpu_s=tuple(totals), others_cores=tuple(float(o) for o in others
                                                                if o is not None),
                        logical_cpus=tuple(float(x) for x in cpus if x),
                        inflation_bounds=tuple(infls), clock_step_s=max(ticks),
                        costs_lower=tuple(costs), cost_lower=mean, ratio_bound=ratio, **base)
