"""Criterion kind ``paired``: its TOML model and its check, side by side (the pair
lookup, divergence and band arithmetic are :mod:`refrun.acceptance.paired`)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from refrun import identity, schema
from refrun.acceptance import paired as pairs
from refrun.acceptance import precision
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, result
from refrun.acceptance.criterion_evidence import PairedEvidence
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult


@dataclass(frozen=True, kw_only=True)
class HardwareBand:
    """The band for candidates on one hardware kind: the known-good envelope of the
    references' own evidence together with known-good evidence recorded on that hardware
    (written by refrun calibrate, refrun.acceptance.paired.derive_band)"""

    band_steps: list[int] = key("steps of this hardware's known-good envelope's knots, "  # noqa: RUF009
                                "increasing", min_items=1)
    band_values: list[float] = key("known-good divergence on this hardware (running max of "  # noqa: RUF009
                                   "|diff|, metric units) from each knot's step on",
                                   min_items=1, gt=0)
    max_ratio: float = key("largest allowed ratio of the candidate's divergence to this "
                           "hardware's known-good envelope at the same step", gt=1)


def band_problems(steps: list[int], values: list[float], at: tuple[str | int, ...] = ()
                  ) -> list[tuple[tuple[str | int, ...], str]]:
    """What is wrong with a band's knots (lengths differ, steps not increasing)."""
    if len(steps) != len(values):
        return [((*at, "band_values"), f"has {len(values)} values for {len(steps)} "
                 "band_steps")]
    if any(b <= a for a, b in itertools.pairwise(steps)):
        return [((*at, "band_steps"), "must be strictly increasing")]
    return []


@kind("paired", needs={"pair"})
class Paired(Criterion):
    """a port of one reference seed (same seed, initial weights and data order; tag
    refrun.pair.seed or refrun accept --pair) against that seed's run: the running max of
    |candidate - reference| stays within max_ratio x the known-good pairs' divergence at every
    step (refrun.acceptance.paired); not applicable to a candidate that declares no pair, not
    evaluable when its declared pair is missing"""

    metric: str = key("per-step metric compared with the same-seed reference", schema.M_LOSS)
    band_steps: list[int] = key("steps of the known-good envelope's knots, increasing "
                                "(written by refrun calibrate)", min_items=1)
    band_values: list[float] = key("known-good divergence (running max of |diff|, metric "
                                   "units) from each knot's step on", min_items=1, gt=0)
    max_ratio: float = key("largest allowed ratio of the candidate's divergence to the "
                           "known-good envelope at the same step", gt=1)
    hardware_bands: dict[str, HardwareBand] = key(
        "by candidate hardware (its refrun.hardware tag), the band known-good evidence "
        "recorded on that hardware gives (a table per hardware kind: band_steps, "
        "band_values, max_ratio); a candidate on any other hardware is judged by the band "
        "above", {}, names="hardware")

    def check(self, ctx: Context) -> CriterionResult:
        return paired(self, ctx)

    def problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        out = band_problems(self.band_steps, self.band_values)
        for hw, b in self.hardware_bands.items():
            out += band_problems(b.band_steps, b.band_values, ("hardware_bands", hw))
        return out

    def band_for(self, hardware: str | None) -> tuple[str | None, list[int], list[float], float]:
        """``(hardware, steps, values, max_ratio)`` of the band that judges a candidate on
        ``hardware``: its own hardware's when the file has one (the hardware named), else
        the references' (None)."""
        hw = identity.canonical_hardware(hardware)
        b = self.hardware_bands.get(hw) if hw else None
        if b is None:
            return None, self.band_steps, self.band_values, self.max_ratio
        return hw, b.band_steps, b.band_values, b.max_ratio


def paired(c: Paired, ctx: Context) -> CriterionResult:
    """``paired``: the candidate's divergence from its same-seed reference, ``D(t)``,
    inside ``max_ratio x`` the known-good envelope at every compared step.

    Outcomes: *not_applicable* when the candidate declares no pair (it is not a port of
    one seed: the criterion's precondition does not hold; the reason and an assessment
    warning say so in one line); *not_evaluable* when it declares one that cannot be
    found (missing, ambiguous), that lacks the metric, or whose steps of it the candidate
    numbers differently (a constant shift: equal step numbers are then other points of
    training; a gap in the evidence, never a pass); otherwise *pass* / *fail*, the evidence
    naming where the pair first diverged.  A candidate that ran at coarser numerics than
    its pair and leaves the band is judged through its precision twin
    (:mod:`refrun.acceptance.precision`): pass when the twin stays inside, the reason
    naming the precision; otherwise fail, the reason naming the precision and the twin's
    divergence or the rerun that would separate the platform's precision from a port
    defect."""
    lookup = ctx.pair if ctx.pair is not None else pairs.pair_among(ctx.candidate, ctx.references)
    hw, steps, values, ratio = c.band_for(ctx.candidate.hardware)
    shape = PairedEvidence(pair=lookup.to_dict(), max_ratio=ratio, band_first_step=steps[0],
                           band_last_step=steps[-1], band_hardware=hw)
    ev = shape.to_dict()
    if not lookup.declared:
        return result(c, NOT_APPLICABLE, f"{pairs.NO_PAIR}: candidate {ctx.candidate.run_id} "
                      f"declares none ({schema.TAG_PAIR_SEED} / {schema.TAG_PAIR_REFERENCE} "
                      "tag, or refrun accept --pair ID), so it is not judged against one seed",
                      ev)
    if lookup.run is None:
        why = lookup.problem or "the pair was not looked up in a store"
        return result(c, NOT_EVALUABLE, f"{pairs.NO_PAIR} found for candidate "
                      f"{ctx.candidate.run_id} ({lookup.declared}): {why}", ev)
    pd = pairs.pair_divergence(lookup.run, ctx.candidate, c.metric, ctx.keep)
    if pd.curve is None:
        return result(c, NOT_EVALUABLE, pd.problem, ev)
    div = pd.curve
    j = pairs.judge(div, steps, values, ratio)
    decision = _numerics(c, ctx, lookup, div, j, (steps, values, ratio))
    ev = dataclasses.replace(shape, pair_run=lookup.run.run_id, pair_seed=lookup.run.seed,
                             judgement=j, numerics=decision.evidence or None).to_dict()
    pair = f"pair {lookup.run.run_id} (seed {lookup.run.seed})"
    # Whose known-good evidence the band rests on, when not the references' hardware alone.
    env = "known-good envelope" + (f" on {hw}" if hw else "")
    if decision.outcome is not None:  # decided by the precision twin
        return result(c, decision.outcome, decision.text, ev)
    if j.first_divergence_step is None:
        return result(c, PASS, f"{pair}: divergence stays within {ratio:.3g} x the "
                      f"{env} over {j.steps_compared} steps (at most "
                      f"{rv.fnum(j.max_ratio_observed)} x, at step {j.step_of_max_ratio})"
                      + decision.text, ev)
    return result(c, FAIL, f"{pair}: first diverges at step {j.first_divergence_step}: "
                  f"|diff| so far {rv.fnum(j.divergence_at_first)} > band "
                  f"{rv.fnum(j.band_at_first)} ({ratio:.3g} x the {env}); outside at "
                  f"{j.steps_outside}/{j.steps_compared} steps, up to "
                  f"{rv.fnum(j.max_ratio_observed)} x" + decision.text
                  + no_band_on(hw, ctx.candidate.hardware, lookup.run.hardware), ev)


def no_band_on(band_hardware: str | None, candidate: str | None, pair: str | None) -> str:
    """The clause a failing candidate gets when it ran on other hardware than its pair and
    the criteria hold no known-good evidence from that hardware: a correct port can
    diverge from its seed more on other hardware (docs/acceptance.md, "Known-good
    evidence by hardware"), so the failure does not yet separate a port defect from the
    hardware's own numerics.  "" when the band is the candidate's hardware's own, or the
    hardware is the pair's (or unknown)."""
    cand, ref = identity.canonical_hardware(candidate), identity.canonical_hardware(pair)
    if band_hardware is not None or not cand or not ref or cand == ref:
        return ""
    return (f"; the band is known-good evidence from {ref} only: no known-good run on "
            f"{cand} was calibrated, and a correct port can diverge more there; record one "
            f"(a known-good port on {cand}, another seed, at full precision) and calibrate "
            "again to tell a port defect from the hardware's numerics")


def _numerics(c: Paired, ctx: Context, lookup: pairs.PairLookup, div: pairs.Divergence,
              j: pairs.PairJudgement, band: tuple[list[int], list[float], float]
              ) -> precision.Decision:
    """What the candidate's and its pair's numerics say about this result
    (:func:`refrun.acceptance.precision.decide`): the twin is judged only when the
    candidate ran coarser than its pair and left the band, against the same ``band`` the
    candidate was (its hardware's: the twin runs on the candidate's hardware)."""
    assert lookup.run is not None
    steps, values, ratio = band
    pn = precision.pair_numerics(ctx.candidate, lookup.run)
    tj = None
    twin = lookup.twin.run if lookup.twin is not None else None
    if pn.reduced and j.first_divergence_step is not None and twin is not None:
        tj = precision.judge_twin(twin, lookup.run, ctx.candidate, c.metric, ctx.keep,
                                  steps, values, ratio)
    return precision.decide(pn, lookup, div, j, tj, ratio)
