"""Criterion kind ``cost``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("cost", any_of=(("max_ratio", "max_cost"),))
class Cost(Criterion):
    """cost per run = hours x price per hour ([prices]); candidate / mean reference cost <=
    max_ratio and/or candidate cost <= max_cost"""

    max_ratio: float | None = key("largest allowed cost ratio", None, gt=0)
    max_cost: float | None = key("largest allowed candidate cost, in [prices] currency",
                                 None, ge=0)
    time_source: str = key("'run_wall': MLflow end - start time of the run; "
                           "'step_time_sum': sum of perf/step_time_s", "run_wall",
                           enum=("run_wall", "step_time_sum"))

    def check(self, ctx: Context) -> CriterionResult:
        return cost(self, ctx)


def cost(c: Cost, ctx: Context) -> CriterionResult:
    """Cost per run = hours x price per hour; ratio = candidate cost / mean reference cost."""
    prices = ctx.criteria.prices
    rows = []
    for role, run in [*(("reference", r) for r in ctx.references),
                      ("candidate", ctx.candidate)]:
        hours, hnote = rv.run_hours(run, c.time_source, keep=ctx.keep)
        hw, price, pnote = rv.hardware_price(run, prices)
        rows.append({"run_id": run.run_id, "role": role, "hours": hours, "time": hnote,
                     "hardware": hw, "price_per_hour": price, "price": pnote,
                     "cost": None if hours is None or price is None else hours * price})
    ev: dict[str, Any] = {"currency": prices.currency, "time_source": c.time_source,
                          "per": prices.per, "runs": rows, "max_ratio": c.max_ratio,
                          "max_cost": c.max_cost}
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
    return result(c, PASS, summary, ev, metric=None)
