"""Criterion kind ``envelope``: its TOML model and its check, side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from refrun.acceptance.checks import (
    MAX_LISTED,
    Context,
    aligned_frame,
    first_left,
    first_left_evidence,
    result,
    select,
    where,
)
from refrun.acceptance.model import Criterion, key
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@dataclass(frozen=True, kw_only=True)
class Envelope(Criterion):
    KIND: ClassVar[str] = "envelope"
    DOC: ClassVar[str] = ("candidate inside the reference group's band (seed mean +- k std, "
                          "or min-max) for at least min_fraction of the selected steps; "
                          "needs at least two reference runs")

    metric: str = key("metric to compare")
    band: str = key("'std': |candidate - seed mean| <= k * std + abs_tol; 'minmax': "
                    "min - abs_tol <= candidate <= max + abs_tol", "std",
                    enum=("std", "minmax"))
    k: float = key("width of the std band in standard deviations (ddof=1)", 3.0, gt=0)
    abs_tol: float = key("slack added to the band (covers steps where the seeds agree "
                         "exactly)", 0.0, ge=0)
    min_fraction: float = key("fraction of selected steps that must be inside", 1.0,
                              ge=0, le=1)
    over: str = key("which aligned steps", "all", enum=("all", "final_window", "last"))
    window_points: int | None = key("final window size in steps", None, ge=1)
    window_fraction: float | None = key("final window as a fraction", None, gt=0, le=1)

    def check(self, ctx: Context) -> CriterionResult:
        return envelope(self, ctx)


def envelope(c: Envelope, ctx: Context) -> CriterionResult:
    """Inside the reference group's band at each selected step: std band
    |cand - mean| <= k * std + abs_tol (std with ddof=1), or min-max band widened by
    abs_tol; pass when the fraction inside >= min_fraction."""
    if len(ctx.references) < 2:
        return result(c, NOT_EVALUABLE, f"an envelope needs at least 2 reference runs "
                      f"(seeds), got {len(ctx.references)}")
    frame, why = aligned_frame(ctx, c, c.metric)
    if frame is None:
        return result(c, NOT_EVALUABLE, why)
    sel = select(frame, c.over, c.window_points, c.window_fraction, ctx)
    steps = sel["step"].to_numpy()
    cand = sel["candidate"].to_numpy()
    mean, std = sel["ref_mean"].to_numpy(), sel["ref_std"].to_numpy()
    lo_band, hi_band = sel["ref_min"].to_numpy(), sel["ref_max"].to_numpy()
    if c.band == "std":
        lo, hi = mean - c.k * std - c.abs_tol, mean + c.k * std + c.abs_tol
    else:
        lo, hi = lo_band - c.abs_tol, hi_band + c.abs_tol
    inside = (cand >= lo) & (cand <= hi)
    frac = float(inside.mean())
    outside = steps[~inside]
    fl = first_left(sel, ~inside, cand > hi, ctx.criteria.settings.axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, (cand - mean) / std, np.nan)
    az = np.abs(z[np.isfinite(z)])
    ev = {"band": c.band, "k": c.k if c.band == "std" else None, "abs_tol": c.abs_tol,
          "over": c.over, "n_references": len(ctx.references), "n_steps": len(steps),
          "steps_inside": int(inside.sum()), "fraction_inside": frac,
          "min_fraction": c.min_fraction, "steps_outside": len(outside),
          "first_step_outside": int(outside[0]) if len(outside) else None,
          "outside_steps_listed": outside[:MAX_LISTED].tolist(),
          "max_abs_z": float(az.max()) if len(az) else None,
          "zero_spread_steps": int((std <= 0).sum()), **first_left_evidence(fl)}
    ok = frac >= c.min_fraction - 1e-12
    band = f"mean +- {c.k:g} std" if c.band == "std" else "min-max"
    reason = (f"{int(inside.sum())}/{len(steps)} steps inside the "
              f"{band} band "
              f"({frac:.1%}, need {c.min_fraction:.1%})" + ("" if ok else where(fl)))
    return result(c, PASS if ok else FAIL, reason, ev)
