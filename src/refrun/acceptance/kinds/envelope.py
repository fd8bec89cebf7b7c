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
    # Cadence-aware fraction (refrun calibrate): fewer points, a noisier fraction.
    calibrated_points: int | None = key(
        "steps the references shared when min_fraction was calibrated: a candidate "
        "aligned at n < calibrated_points steps (logging less often) needs "
        "min_fraction - points_noise_z * sqrt(min_fraction (1 - min_fraction) (1/n - "
        "1/calibrated_points)) inside", None, ge=1)
    points_noise_z: float = key("normal quantile applied to the extra noise of a fraction "
                                "over fewer points", 3.0, ge=0)

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
    need = c.min_fraction - fraction_allowance(c, len(inside))
    j = steps_inside(sel, inside, cand > hi, need, ctx)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, (cand - mean) / std, np.nan)
    az = np.abs(z[np.isfinite(z)])
    ev = {"band": c.band, "k": c.k if c.band == "std" else None, "abs_tol": c.abs_tol,
          "over": c.over, "n_references": len(ctx.references), "n_steps": j.points,
          "steps_inside": j.inside, "fraction_inside": j.fraction, **j.evidence,
          "max_abs_z": float(az.max()) if len(az) else None,
          "zero_spread_steps": int((std <= 0).sum()),
          "calibrated_min_fraction": c.min_fraction, "calibrated_points": c.calibrated_points}
    band = f"mean +- {c.k:g} std" if c.band == "std" else "min-max"
    reason = (f"{j.inside}/{j.points} steps inside the {band} band "
              f"({j.fraction:.1%}, need {need:.1%}" + fewer_points(c, need, j.points) + ")"
              + j.where())
    return result(c, PASS if j.ok else FAIL, reason, ev)


def fraction_allowance(c: Envelope, n: int) -> float:
    """How much lower the fraction inside may be for a candidate aligned at ``n`` points
    when ``min_fraction`` was calibrated at ``N = calibrated_points`` (0 when n >= N, or
    nothing was calibrated).

    The fraction of n points inside is a binomial proportion: with probability ``p`` of a
    point inside and points independent, its variance is ``p (1 - p) / n``.  The calibrated
    ``min_fraction`` already covers the noise of N points, so n points add
    ``p (1 - p) (1/n - 1/N)``, taken at ``p = min_fraction`` and ``points_noise_z``
    standard deviations (the same rule as the final window's cadence allowance,
    :func:`refrun.acceptance.kinds.closeness.window_noise_allowance`).  A candidate that
    logs every 10th step of a 400-step run (41 points) needs 76.7 % inside, not 90 %."""
    big = c.calibrated_points
    if big is None or n >= big or n < 1:
        return 0.0
    p = c.min_fraction
    return float(min(p, c.points_noise_z * np.sqrt(p * (1 - p) * (1 / n - 1 / big))))


def fewer_points(c: Envelope, need: float, n: int) -> str:
    return ("" if need >= c.min_fraction else
            f": {c.min_fraction:.1%} calibrated at {c.calibrated_points} steps, {n} here")
