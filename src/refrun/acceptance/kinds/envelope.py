"""Criterion kind ``envelope``: its TOML model and its check, side by side."""

from __future__ import annotations

import numpy as np

from refrun.acceptance.checks import Context, result, selected, steps_inside
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("envelope")
class Envelope(Criterion):
    """candidate inside the reference group's band (seed mean +- k std, or min-max) for at least
    min_fraction of the selected steps; needs at least two reference runs"""

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
    sel, why = selected(ctx, c)
    if sel is None:
        return result(c, NOT_EVALUABLE, why)
    cand = sel["candidate"].to_numpy()
    mean, std = sel["ref_mean"].to_numpy(), sel["ref_std"].to_numpy()
    lo_band, hi_band = sel["ref_min"].to_numpy(), sel["ref_max"].to_numpy()
    if c.band == "std":
        lo, hi = mean - c.k * std - c.abs_tol, mean + c.k * std + c.abs_tol
    else:
        lo, hi = lo_band - c.abs_tol, hi_band + c.abs_tol
    inside = (cand >= lo) & (cand <= hi)
    j = steps_inside(sel, inside, cand > hi, c.min_fraction, ctx)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, (cand - mean) / std, np.nan)
    az = np.abs(z[np.isfinite(z)])
    ev = {"band": c.band, "k": c.k if c.band == "std" else None, "abs_tol": c.abs_tol,
          "over": c.over, "n_references": len(ctx.references), "n_steps": j.points,
          "steps_inside": j.inside, "fraction_inside": j.fraction, **j.evidence,
          "max_abs_z": float(az.max()) if len(az) else None,
          "zero_spread_steps": int((std <= 0).sum())}
    band = f"mean +- {c.k:g} std" if c.band == "std" else "min-max"
    reason = (f"{j.inside}/{j.points} steps inside the {band} band "
              f"({j.fraction:.1%}, need {c.min_fraction:.1%})" + j.where())
    return result(c, PASS if j.ok else FAIL, reason, ev)
