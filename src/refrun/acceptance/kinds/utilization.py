"""Criterion kind ``utilization``: its TOML model and its check, side by side."""

from __future__ import annotations

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("utilization")
class Utilization(Criterion):
    """mean accelerator utilization after warm-up (sys/gpu<i>_util_pct,
    sys/tpu<i>_duty_cycle_pct) >= min_pct"""

    min_pct: float = key("least mean utilization, percent", ge=0, le=100)
    metrics: list[str] = key("utilization metrics (default: every sys/gpu<i>_util_pct and "
                             "sys/tpu<i>_duty_cycle_pct of the candidate)", [])
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return utilization(self, ctx)


def utilization(c: Utilization, ctx: Context) -> CriterionResult:
    """Mean over devices of each utilization metric's mean after warm-up >= ``min_pct``."""
    run = ctx.candidate
    metrics = list(c.metrics) or [m for m in run.metric_names if rv.UTIL_PATTERN.match(m)]
    means, starts = rv.busy_means(run, metrics, ctx.keep,
                               lambda steps: ctx.warmup(steps, c.warmup_steps))
    if not means:
        wanted = ", ".join(metrics) or "sys/gpu<i>_util_pct, sys/tpu<i>_duty_cycle_pct"
        return result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has no utilization "
                      f"metric ({wanted})", metric=None)
    overall = float(np.mean(list(means.values())))
    ev = {"metrics": sorted(means), "mean_by_metric": means, "warmup_end_step": starts,
          "mean_pct": overall, "min_pct": c.min_pct}
    ok = overall >= c.min_pct
    return result(c, PASS if ok else FAIL, f"mean utilization {overall:.1f}% "
                  f"{'>=' if ok else '<'} {c.min_pct:g}% ({len(means)} device metric(s))",
                  ev, metric=sorted(means)[0])
