"""Criterion kind ``closeness``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result, selected, steps_inside
from refrun.acceptance.model import SELECT_OVER, Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("closeness", any_of=(("abs_tol", "rel_tol"),))
class Closeness(Criterion):
    """candidate within abs_tol + rel_tol * |reference| of the reference (mean of the reference
    runs) at the selected aligned steps"""

    metric: str = key("metric to compare, e.g. 'loss' or 'eval/accuracy'")
    over: str = key("which aligned steps: all, the final window, the last one, or the "
                    "evaluation points (metric must start with eval/)", "all",
                    enum=SELECT_OVER)
    abs_tol: float = key("absolute tolerance in the metric's units", 0.0, ge=0)
    rel_tol: float = key("relative tolerance, times |reference|", 0.0, ge=0)
    min_fraction: float = key("pass when at least this fraction of the selected steps is "
                              "within tolerance (Megatron tolerates 1 in 50: 0.98)",
                              1.0, ge=0, le=1)
    aggregate: str = key("'point': step by step; 'mean': compare the means over the selected "
                         "steps once", "point", enum=("point", "mean"))
    window_points: int | None = key("final window size in steps (default: settings)",
                                    None, ge=1)
    window_fraction: float | None = key("final window as a fraction of aligned steps",
                                        None, gt=0, le=1)
    # Cadence-aware tolerance of a window mean (aggregate = "mean"; refrun calibrate).
    window_noise_rel: float | None = key(
        "per-point noise of the metric in the final window, relative to |reference mean| "
        "(std of one logged point): with aggregate = 'mean', a window of k < "
        "window_calibrated_points aligned points (a candidate logging less often) is "
        "allowed sqrt(tol^2 + (window_noise_z * window_noise_rel * |ref| )^2 * (1 + 1/g) * "
        "(1/k - 1/window_calibrated_points)), g the reference runs", None, ge=0)
    window_calibrated_points: int | None = key(
        "points the final window held when the tolerance was calibrated", None, ge=1)
    window_noise_z: float = key("normal quantile applied to the extra noise of a shorter "
                                "window", 3.0, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return closeness(self, ctx)

    def problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        if self.over == "eval_points" and not self.metric.startswith(schema.EVAL_PREFIX):
            return [(("over",), f"'eval_points' needs an evaluation metric "
                     f"({schema.EVAL_PREFIX}<name>), got metric {self.metric!r}")]
        return []


def closeness(c: Closeness, ctx: Context) -> CriterionResult:
    """Per step: within when |cand - ref| <= abs_tol + rel_tol * |ref| (ref = mean of the
    reference runs); pass when the fraction within >= min_fraction.  ``aggregate = mean``
    compares the means over the selected steps once."""
    sel, why = selected(ctx, c)
    if sel is None:
        return result(c, NOT_EVALUABLE, why)
    steps = sel["step"].to_numpy()
    ref, cand = sel["reference"].to_numpy(), sel["candidate"].to_numpy()
    ev: dict[str, Any] = {"over": c.over, "abs_tol": c.abs_tol, "rel_tol": c.rel_tol,
                          "n_steps": len(steps), "first_step": int(steps[0]),
                          "last_step": int(steps[-1]),
                          "n_references": len(ctx.references)}
    d = cand - ref
    ad = np.abs(d)
    imax = int(np.argmax(ad))
    ev.update(max_abs_diff=float(ad[imax]), step_of_max_abs_diff=int(steps[imax]),
              mean_abs_diff=float(ad.mean()),
              reference_at_last_step=float(ref[-1]), candidate_at_last_step=float(cand[-1]))
    if c.aggregate == "mean":
        rm, cm = float(ref.mean()), float(cand.mean())
        limit = c.abs_tol + c.rel_tol * abs(rm)
        extra = window_noise_allowance(c, len(steps), len(ctx.references), abs(rm))
        if extra > 0:
            ev.update(calibrated_allowed=limit, window_points=len(steps),
                      window_calibrated_points=c.window_calibrated_points,
                      window_noise_allowance=extra)
            limit = math.hypot(limit, extra)
        ev.update(aggregate="mean", reference_mean=rm, candidate_mean=cm,
                  diff_of_means=cm - rm, allowed=limit)
        ok = abs(cm - rm) <= limit
        reason = (f"mean over {len(steps)} steps: candidate {rv.fnum(cm)} vs reference "
                  f"{rv.fnum(rm)}, |diff| {rv.fnum(abs(cm - rm))} "
                  f"{'<=' if ok else '>'} allowed {rv.fnum(limit)}")
        return result(c, PASS if ok else FAIL, reason, ev)
    within = rv.isclose(cand, ref, c.abs_tol, c.rel_tol)
    j = steps_inside(sel, within, d > 0, c.min_fraction, ctx)
    ev.update(aggregate="point", steps_within=j.inside, fraction_within=j.fraction,
              **j.evidence)
    reason = (f"{j.inside}/{j.points} steps within tolerance "
              f"({j.fraction:.1%}, need {c.min_fraction:.1%}); max |diff| {rv.fnum(ad[imax])} "
              f"at step {int(steps[imax])}" + j.where())
    return result(c, PASS if j.ok else FAIL, reason, ev)


def window_noise_allowance(c: Closeness, k: int, g: int, scale: float) -> float:
    """Extra allowance of a window mean over ``k`` points when the tolerance was
    calibrated on windows of ``K = window_calibrated_points`` points (0 when k >= K or no
    noise was calibrated).

    With per-point noise ``sigma`` (relative ``window_noise_rel`` times ``scale`` =
    |reference window mean|) independent between points, the difference of the
    candidate's window mean and the mean of ``g`` references' window means has noise
    variance ``sigma^2 (1 + 1/g) / k``; the calibrated tolerance already covers it at
    ``K`` points, so a window of ``k`` points needs the variance
    ``sigma^2 (1 + 1/g) (1/k - 1/K)`` more, taken at ``window_noise_z`` standard
    deviations and added in quadrature to the calibrated tolerance (variances of
    independent terms add)."""
    big_k = c.window_calibrated_points
    if not c.window_noise_rel or big_k is None or k >= big_k or k < 1 or g < 1:
        return 0.0
    var = (1 + 1 / g) * (1 / k - 1 / big_k)
    return float(c.window_noise_z * c.window_noise_rel * scale * math.sqrt(var))
