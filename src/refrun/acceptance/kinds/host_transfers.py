"""Criterion kind ``host_transfers``: its TOML model and its check, side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from refrun import schema
from refrun.acceptance.checks import Context, counters_at_most
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import CriterionResult


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
    def per_step_statistic(per_step: dict[int, float], ev: dict[str, Any]
                           ) -> tuple[float | None, str]:
        if not per_step:
            return None, "no step after warm-up"
        vals = np.array(list(per_step.values()))
        stat = float(vals.mean() if c.statistic == "mean" else vals.max())
        ev.update(per_step_mean=float(vals.mean()), per_step_max=float(vals.max()),
                  statistic=c.statistic, value=stat, max=c.max)
        return stat, f"{c.statistic} {stat:.4g} transfers/step after warm-up"
    return counters_at_most(c, ctx, c.metrics, c.warmup_steps, c.max, per_step_statistic)
