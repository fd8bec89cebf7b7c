"""Criterion kind ``cost``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refrun.acceptance import performance as perf
from refrun.acceptance.checks import Context, result
from refrun.acceptance.contention import contention, judged
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
    what those neighbours cost them.  A fail stands, as the candidate's load is not read
    here (see docs/acceptance.md, "L4 across hardware")."""
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
    if problems:
        return result(c, FAIL, summary + ": " + "; ".join(problems), ev, metric=None)
    if c.max_ratio is None:  # an absolute price: the references' machine plays no part
        return result(c, PASS, summary, ev, metric=None)
    # The references' rule (contention.judged): references recorded beside busier
    # neighbours ran longer, so cost more, than they would alone; a candidate can look
    # cheap enough against them while it is not, so such a pass is not judged.
    return judged(c, PASS, summary, ev, contention(ctx.candidate, list(ctx.references),
                                                   ctx.keep), "cost")
