"""Criterion kind ``compilation``: its TOML model and its check, side by side."""

from __future__ import annotations

from typing import Any

from refrun import schema
from refrun.acceptance.checks import MAX_LISTED, Context, counters_at_most
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import CriterionResult


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
    def total(per_step: dict[int, float], ev: dict[str, Any]) -> tuple[float, str]:
        n = float(sum(per_step.values()))
        ev.update(total_after_warmup=n, max=c.max,
                  steps_with_compilation=[s for s, v in per_step.items() if v > 0][:MAX_LISTED])
        return n, f"{n:g} compilation(s) after warm-up (step >= {ev['warmup_end_step']})"
    return counters_at_most(c, ctx, c.metrics, c.warmup_steps, c.max, total)
