"""Criterion kind ``cost``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from refrun import schema
from refrun.acceptance import performance as perf
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result
from refrun.acceptance.contention import (
    CPU_CLOCK_FRACTION,
    clock_step,
    clock_unresolved,
    contention,
    cpu_inflation_bound,
    finite_dict,
    judged,
)
from refrun.acceptance.criterion_evidence import Contention
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
    what those neighbours cost them.  A fail on a machine that took CPU from the
    candidate is not judged either, unless the candidate's own CPU time per step puts its
    cost on an idle machine over the limit (:class:`CpuCostFloor`): its hours hold what its
    neighbours cost it."""
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
    problems = []
    if c.max_ratio is not None:
        ref_costs = [r["cost"] for r in rows[:-1]]
        if any(x is None for x in ref_costs):
            bad = next(r for r in rows[:-1] if r["cost"] is None)
            return result(c, NOT_EVALUABLE, bad["time"] if bad["hours"] is None
                          else bad["price"], ev, metric=None)
        ref_cost = float(np.mean(ref_costs))
        ratio = cand["cost"] / ref_cost if ref_cost > 0 else math.inf
        ev.update(reference_cost=ref_cost, ratio=ratio)
        if ratio > c.max_ratio:
            problems.append(f"ratio {ratio:.3f} > {c.max_ratio:g}")
    if c.max_cost is not None and cand["cost"] > c.max_cost:
        problems.append(f"cost {cand['cost']:.4g} > {c.max_cost:g} {prices.currency}")
    summary = (f"candidate {cand['cost']:.4g} {prices.currency}"
               + (f" vs reference {ev['reference_cost']:.4g} (ratio {ev['ratio']:.3f})"
                  if "ratio" in ev else ""))
    cont = contention(ctx.candidate, list(ctx.references), ctx.keep)
    if problems:
        floor = cpu_cost_floor(
            ctx.candidate, c, ctx.keep, cand, factors.get(ctx.candidate.run_id),
            prices.currency, ev.get("reference_cost"), cont,
            ratio_failed=c.max_ratio is not None and ev["ratio"] > c.max_ratio
        ) if cont.took_cpu else None
        return judged(c, FAIL, summary + ": " + "; ".join(problems), ev, cont, "cost",
                      floor=floor, limit=None if floor is None else floor.limit)
    if c.max_ratio is None:  # an absolute price: the references' machine plays no part
        return result(c, PASS, summary, ev, metric=None)
    # The references' rule (contention.judged): references recorded beside busier
    # neighbours ran longer, so cost more, than they would alone; a candidate can look
    # cheap enough against them while it is not, so such a pass is not judged.
    return judged(c, PASS, summary, ev, cont, "cost")


Against = Literal["ratio", "cost"]


@dataclass(frozen=True)
class CpuCostFloor:
    """What the candidate's own CPU seconds per step say about a cost fail on a machine
    that took CPU from it: the cost counterpart of step time's
    :class:`~refrun.acceptance.kinds.step_time.CpuFloor`.

    A step takes at least its training thread's CPU seconds ``c_i`` (a thread accrues CPU
    time only while it runs), which neighbours using ``o`` of ``n`` CPUs lengthen by at
    most ``B = cpu_inflation_bound(o, n)``; the steps run one after the other inside the
    priced time (the run's wall less refrun's own start-up and close, or the sum of its
    step times), and the rest of it takes no less than nothing.  So on an idle machine the
    run would be billed at least ``hours_lower = sum(c_i) / B / 3600`` hours (x the
    same-work ``factor``), for ``cost_lower = hours_lower x price_per_hour``, and its ratio
    against the references' mean cost would be at least ``ratio_lower``.  The sum is over
    every step with a finite ``perf/step_cpu_s`` (a step without one adds nothing: still a
    lower bound).

    ``against``: the limit the bound is read against (``ratio``: ``max_ratio``, ``cost``:
    ``max_cost``), the one it settles when it settles one; ``limit``: that limit.  The fail
    stands when the bound exceeds it.  ``usable``: the candidate has such values, its
    machine's load and CPU count are known and its thread CPU clock resolves its median
    step (``clock_step_s`` at most ``clock_fraction`` of it); ``why``: why not."""

    evidence_key: ClassVar[str] = schema.EV_CPU_COST_BOUND
    usable: bool
    metric: str
    against: Against
    limit: float
    currency: str
    why: str = ""
    steps: int = 0
    candidate_cpu_s: float | None = None
    others_cores: float | None = None
    logical_cpus: float | None = None
    inflation_bound: float | None = None
    clock_step_s: float | None = None
    clock_fraction: float = CPU_CLOCK_FRACTION
    factor: float | None = None
    price_per_hour: float | None = None
    hours_lower: float | None = None
    cost_lower: float | None = None
    reference_cost: float | None = None
    ratio_lower: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return finite_dict(self)

    @property
    def figure(self) -> float | None:
        return self.ratio_lower if self.against == "ratio" else self.cost_lower

    def holds(self, limit: float) -> bool:
        """The fail stands: even on an idle machine the figure exceeds ``limit``."""
        return self.usable and self.figure is not None and self.figure > limit

    def versus(self, limit: float) -> str:
        return f" > {limit:g}" if self.holds(limit) else f" <= {limit:g}"

    def summary(self) -> str:
        if not self.usable:
            return f"the candidate's CPU time per step cannot bound it ({self.why})"
        what = (f"its cost ratio at >= {self.ratio_lower:.3f}" if self.against == "ratio"
                else f"its cost at >= {self.cost_lower:.4g} {self.currency}")
        return (f"the candidate's own CPU time in its steps ({rv.fnum(self.candidate_cpu_s)}"
                f" s over {self.steps} steps), which neighbours using {self.others_cores:.2f}"
                f" of {self.logical_cpus:g} CPUs inflate at most {self.inflation_bound:.2f}x,"
                f" puts {what} on an idle machine")


def cpu_cost_floor(candidate: RunData, c: Cost, keep: str, row: dict[str, Any],
                   factor: float | None, currency: str, reference_cost: float | None,
                   cont: Contention, ratio_failed: bool) -> CpuCostFloor:
    """The :class:`CpuCostFloor` of a failing candidate (its cost ``row`` as :func:`cost`
    priced it, its same-work ``factor`` when one applied) on a machine that took CPU from
    it.  Read against
    ``max_ratio`` when the ratio failed and the bound settles it, else against
    ``max_cost`` when that failed and the bound settles it, else against whichever
    failed (ratio first)."""
    metric = schema.M_STEP_CPU
    cost_failed = c.max_cost is not None and row["cost"] > c.max_cost
    first: Against = "ratio" if ratio_failed else "cost"
    base: dict[str, Any] = {
        "metric": metric, "currency": currency, "factor": factor,
        "others_cores": cont.candidate_cores, "logical_cpus": cont.logical_cpus,
        "reference_cost": reference_cost, "price_per_hour": row["price_per_hour"]}

    def limit_of(a: Against) -> float:
        v = c.max_ratio if a == "ratio" else c.max_cost
        assert v is not None
        return v

    r = rv.resolved(candidate, metric, keep)
    cpu = rv.finite(r).values if r is not None else np.empty(0)
    cpu = cpu[cpu >= 0]
    if not len(cpu):
        return CpuCostFloor(False, against=first, limit=limit_of(first),
                            why=f"no {metric} values", **base)
    if cont.candidate_cores is None or not cont.logical_cpus:
        return CpuCostFloor(False, against=first, limit=limit_of(first), steps=len(cpu),
                            why="the machine's CPU count is not known", **base)
    tick, total = clock_step(cpu), float(cpu.sum())
    infl = cpu_inflation_bound(cont.candidate_cores, cont.logical_cpus)
    base.update(steps=len(cpu), candidate_cpu_s=total, inflation_bound=infl,
                clock_step_s=tick)
    if why := clock_unresolved(tick, float(np.median(cpu))):
        return CpuCostFloor(False, against=first, limit=limit_of(first), why=why, **base)
    hours = total / infl / 3600.0 * (1.0 if factor is None else factor)
    cost_lower = hours * row["price_per_hour"]
    ratio_lower = (cost_lower / reference_cost if reference_cost else
                   (math.inf if reference_cost == 0 else None))
    base.update(hours_lower=hours, cost_lower=cost_lower, ratio_lower=ratio_lower)
    against = first
    if ratio_failed and ratio_lower is not None and ratio_lower > limit_of("ratio"):
        against = "ratio"
    elif cost_failed and cost_lower > limit_of("cost"):
        against = "cost"
    return CpuCostFloor(True, against=against, limit=limit_of(against), **base)
