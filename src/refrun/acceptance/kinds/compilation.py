"""Criterion kind ``compilation``: its TOML model and its check, side by side."""

from __future__ import annotations

from refrun import schema
from refrun.acceptance.checks import MAX_LISTED, Context, counter_sum, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("compilation")
class Compilation(Criterion):
    """compilations after warm-up (sum of per-step counters) <= max"""

    max: float = key("largest allowed number of compilations after warm-up", ge=0)
    metrics: list[str] = key("per-step counters summed", [schema.M_COMPILE_GRAPHS],
                             min_items=1)
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return compilation(self, ctx)


def compilation(c: Compilation, ctx: Context) -> CriterionResult:
    """Sum of the compile counters over steps >= warm-up end <= ``max``."""
    per_step, ev, why = counter_sum(ctx, c, c.metrics, c.warmup_steps)
    if per_step is None:
        return result(c, NOT_EVALUABLE, why, metric=c.metrics[0])
    total = float(sum(per_step.values()))
    ev.update(total_after_warmup=total, max=c.max,
              steps_with_compilation=[s for s, v in per_step.items() if v > 0][:MAX_LISTED])
    ok = total <= c.max
    return result(c, PASS if ok else FAIL,
                  f"{total:g} compilation(s) after warm-up (step >= {ev['warmup_end_step']})"
                  f" {'<=' if ok else '>'} {c.max:g}", ev, metric=c.metrics[0])
