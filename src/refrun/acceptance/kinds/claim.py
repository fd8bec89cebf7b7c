"""Criterion kind ``claim``: its TOML model and its check, side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, one_point, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("claim", one_of=(("at_least", "at_most"),))
class Claim(Criterion):
    """a final value at least / at most a published number; optionally, when the reference also
    misses it, matching the reference within a tolerance counts as preserving behaviour"""

    metric: str = key("metric holding the claimed quantity, e.g. 'eval/accuracy'")
    at_least: float | None = key("claim: value >= this", None)
    at_most: float | None = key("claim: value <= this", None)
    statistic: str = key("value of a run: its last finite value, max, min, or mean of its "
                         "last window_points values", "last",
                         enum=("last", "max", "min", "final_mean"))
    window_points: int = key("points averaged by statistic = final_mean", 1, ge=1)
    match_reference_abs_tol: float | None = key(
        "enables the reference rule: if the reference misses the claim, a candidate within "
        "this absolute tolerance of the reference passes", None, ge=0)
    match_reference_rel_tol: float | None = key(
        "as match_reference_abs_tol, relative to |reference|", None, ge=0)

    def check(self, ctx: Context) -> CriterionResult:
        return claim(self, ctx)


def claim(c: Claim, ctx: Context) -> CriterionResult:
    """Candidate's value (``statistic`` of its own finite series) against the claim.  With
    ``match_reference_*_tol``: if the reference (mean of the reference runs' values) also
    misses the claim, a candidate with |cand - ref| <= abs + rel * |ref| passes as
    preserving the reference's behaviour.  When the reference meets the claim, matching it
    is not enough."""
    cand = one_point(ctx.candidate, c.metric, c.statistic, c.window_points, ctx.keep)
    if cand is None:
        return result(c, NOT_EVALUABLE, f"candidate run {ctx.candidate.run_id} has no "
                      f"finite {c.metric!r} value")
    at_least = c.at_least is not None
    target = c.at_least if at_least else c.at_most
    assert target is not None

    def meets(x: float) -> bool:
        return x >= target if at_least else x <= target

    refs = [one_point(r, c.metric, c.statistic, c.window_points, ctx.keep)
            for r in ctx.references]
    ref_vals = [x for x in refs if x is not None]
    ref = float(np.mean(ref_vals)) if ref_vals else None
    rule_on = c.match_reference_abs_tol is not None or c.match_reference_rel_tol is not None
    ev: dict[str, Any] = {"statistic": c.statistic, "claim": target,
                          "direction": "at_least" if at_least else "at_most",
                          "candidate_value": cand, "reference_values": refs,
                          "reference_value": ref, "candidate_meets_claim": meets(cand),
                          "reference_meets_claim": None if ref is None else meets(ref),
                          "reference_rule": rule_on}
    op = ">=" if at_least else "<="
    if meets(cand):
        return result(c, PASS, f"candidate {rv.fnum(cand)} {op} claim {rv.fnum(target)}",
                      {**ev, "rule_applied": "claim"})
    if rule_on and ref is not None and not meets(ref):
        abs_t, rel_t = c.match_reference_abs_tol or 0.0, c.match_reference_rel_tol or 0.0
        allowed = abs_t + rel_t * abs(ref)
        ev.update(diff_from_reference=cand - ref, allowed=allowed)
        if abs(cand - ref) <= allowed:
            return result(c, PASS, f"claim {rv.fnum(target)} missed by reference "
                          f"{rv.fnum(ref)} too; candidate {rv.fnum(cand)} matches it within "
                          f"{rv.fnum(allowed)} (preserves the reference's behaviour)",
                          {**ev, "rule_applied": "matches_reference"})
        return result(c, FAIL, f"candidate {rv.fnum(cand)} misses claim {rv.fnum(target)}; "
                      f"reference {rv.fnum(ref)} misses it too but the candidate differs by "
                      f"{rv.fnum(abs(cand - ref))} > {rv.fnum(allowed)}",
                      {**ev, "rule_applied": "none"})
    tail = "" if ref is None else f" (reference {rv.fnum(ref)}" + (
        " meets it)" if meets(ref) else " misses it too)")
    return result(c, FAIL, f"candidate {rv.fnum(cand)} misses claim {op} "
                  f"{rv.fnum(target)}{tail}", {**ev, "rule_applied": "none"})
