"""Criterion kind ``host_transfers``: its TOML model and its check, side by side."""

from __future__ import annotations

import numpy as np

from refrun import schema
from refrun.acceptance.checks import Context, counter_sum, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("host_transfers")
class HostTransfers(Criterion):
    """host transfers per step after warm-up (mean or max) <= max"""

    max: float = key("largest allowed transfers per step", ge=0)
    metrics: list[str] = key("per-step counters added up", [schema.M_XFER_D2H], min_items=1)
    statistic: str = key("per-step statistic compared with max", "mean",
                         enum=("mean", "max"))
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return host_transfers(self, ctx)


def host_transfers(c: HostTransfers, ctx: Context) -> CriterionResult:
    """Transfers per step after warm-up (counters added per step; mean or max) <= ``max``."""
    per_step, ev, why = counter_sum(ctx, c, c.metrics, c.warmup_steps)
    if per_step is None:
        return result(c, NOT_EVALUABLE, why, metric=c.metrics[0])
    if not per_step:
        return result(c, NOT_EVALUABLE, "no step after warm-up", ev, metric=c.metrics[0])
    vals = np.array(list(per_step.values()))
    stat = float(vals.mean() if c.statistic == "mean" else vals.max())
    ev.update(per_step_mean=float(vals.mean()), per_step_max=float(vals.max()),
              statistic=c.statistic, value=stat, max=c.max)
    ok = stat <= c.max
    return result(c, PASS if ok else FAIL,
                  f"{c.statistic} {stat:.4g} transfers/step after warm-up "
                  f"{'<=' if ok else '>'} {c.max:g}", ev, metric=c.metrics[0])
