"""Same-seed paired comparison: a port of one reference seed judged against that seed's run.

Seed bands cannot see a numerics change whose effect stays inside the seeds' spread (a
port computing its matmuls in bfloat16, a changed reduction order): seeds differ by the
whole spread of training noise, while a port that starts from the *same* initial weights
and reads the *same* data order tracks its seed closely.  How closely is what this module
measures and judges.

**Divergence of a pair.** With ``r(t)`` the reference seed's value of a metric at step
``t`` and ``c(t)`` the port's, the pair's divergence is the running maximum

    D(t) = max_{s <= t} |c(s) - r(s)|

over the steps both logged with a finite reference value (a non-finite candidate value
where the reference is finite counts as infinite).  Two runs that log the same schedule
numbered differently (every step of one is the other's plus a constant, ``step_shift``)
have no such divergence: equal step numbers are other points of training.  The running
maximum makes ``D`` monotone: a signed difference crossing zero is not a re-convergence.

**Why a band that is a function of step.** Training is chaotic: two trajectories that
start ``delta_0`` apart separate roughly as ``delta_0 exp(lambda t)`` (the largest Lyapunov
exponent ``lambda`` of the training map) until the separation saturates at the seed-to-seed
spread.  A benign port perturbs the computation at its working precision (float32
rounding, ``u = 2^-24``, amplified by a changed summation order); a port that computes its
matmuls in bfloat16 perturbs it at ``u = 2^-8``, 2^16 times (4.8 decades) larger, and
TF32 at ``2^-11`` (3.9 decades).  Under the same growth law the lower-precision port's
divergence curve runs the same course shifted up by that factor, i.e. it reaches each
level ``ln(ratio)/lambda`` steps sooner.  A fixed tolerance cannot separate the two (late
in the run both reach the seed spread); a band that follows a known-good pair's own
divergence curve can, at every step of the growth phase.

**Band.** From K >= 1 known-good pairs (a rerun of the reference with a declared numerical
perturbation, or a port known to be good), each with divergence ``D_k``:

    E(t)     = max_k D_k(t)                       (the known-good envelope; a D_k is held
                                                   at its last value after its last step)
    floor    = min { E(t) : E(t) > 0 }            (the metric's rounding quantum as recorded)
    band(t)  = max_ratio * max(E(t), floor)

and a candidate passes when ``D_c(t) <= band(t)`` at every compared step; the first step
where it does not is where the pair first diverged.  ``max_ratio`` is the structural factor
``2^6.5 ~ 90.5``: the geometric middle, in decades, between float32 rounding (``2^-24``)
and TF32's (``2^-11``), so a perturbation at float32 precision, even amplified by an order
of magnitude more than the known-good one, passes, and one at TF32 precision or coarser
(bfloat16) fails.  With K >= 2 known-good pairs, each is also judged against the envelope
of the others (leave-one-out); when one needs more than the structural factor, the
known-good evidence itself disagrees by that much and ``max_ratio`` is raised to the worst
need (rounded up), which the file states.

References: the exponential separation of nearby trajectories and its saturation are the
textbook behaviour of chaotic maps (Strogatz, *Nonlinear Dynamics and Chaos*, 2nd ed.,
2015, sec. 9.3 and 10.5); unit roundoffs of float32, TF32 and bfloat16 from their
significand widths (24, 11 and 8 bits; Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., 2002, sec. 2.1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from refrun import identity, numerics, schema
from refrun.comparison import RunData, resolve_series
from refrun.comparison.alignment import shift_note, step_shift
from refrun.errors import RefrunInputError
from refrun.pairing import declares_pair, is_known_good

if TYPE_CHECKING:
    from refrun.acceptance.precision import TwinLookup

# Not refrun.acceptance.runview (it imports the criteria model, which imports the checks,
# which import this module: a cycle); its two helpers needed here are inlined below.

# sqrt(u_tf32 / u_fp32) = sqrt(2^-11 / 2^-24) = 2^6.5: see the module docstring.
STRUCTURAL_MAX_RATIO = 2.0 ** 6.5
# Band knots: a new knot only where the envelope grew by this factor (<= 10 % coarser
# than the curve, far inside the x90 margin), at most MAX_KNOTS of them.
KNOT_GROWTH = 1.1
MAX_KNOTS = 400
MAX_LISTED = 20


# --- pure measures ------------------------------------------------------------------------
@dataclass(frozen=True)
class Divergence:
    """The running maximum ``D(t)`` of |candidate - reference| over the steps compared."""

    steps: np.ndarray  # int64, increasing
    running: np.ndarray  # float64, non-decreasing (inf once the candidate is non-finite)
    diff: np.ndarray  # the signed candidate - reference at those steps


def divergence_curve(ref_steps: np.ndarray, ref_values: np.ndarray, cand_steps: np.ndarray,
                     cand_values: np.ndarray) -> Divergence:
    """``D(t) = max_{s<=t} |c(s) - r(s)|`` at the steps both series have and where the
    reference is finite; a non-finite candidate value there counts as ``inf``."""
    common, ri, ci = np.intersect1d(np.asarray(ref_steps), np.asarray(cand_steps),
                                    return_indices=True)
    r = np.asarray(ref_values, dtype=float)[ri]
    c = np.asarray(cand_values, dtype=float)[ci]
    ok = np.isfinite(r)
    common, r, c = common[ok], r[ok], c[ok]
    d = c - r
    ad = np.where(np.isfinite(d), np.abs(d), np.inf)
    running = np.maximum.accumulate(ad) if len(ad) else ad
    return Divergence(common.astype(np.int64), running.astype(float), d)


def _held(curve: Divergence, steps: np.ndarray) -> np.ndarray:
    """``curve`` as a step function at ``steps``: its value at the last step <= t (0
    before its first step; its last value after its last step)."""
    idx = np.searchsorted(curve.steps, steps, side="right") - 1
    out = np.where(idx >= 0, curve.running[np.clip(idx, 0, None)], 0.0)
    return out.astype(float)


def envelope(curves: Sequence[Divergence]) -> tuple[np.ndarray, np.ndarray, float]:
    """``(steps, E, floor)``: the known-good envelope ``E(t) = max_k D_k(t)`` on the union of
    the curves' steps and its floor (smallest positive value; nan when every value is 0)."""
    steps = np.unique(np.concatenate([c.steps for c in curves]))
    e = np.max(np.vstack([_held(c, steps) for c in curves]), axis=0)
    pos = e[(e > 0) & np.isfinite(e)]
    return steps, e, float(pos.min()) if len(pos) else math.nan


def band_knots(steps: np.ndarray, e: np.ndarray, floor: float) -> tuple[list[int], list[float]]:
    """Knots of ``max(E, floor)`` as a step function: a knot at the first step and wherever
    the value grew by :data:`KNOT_GROWTH` since the last knot (at most :data:`MAX_KNOTS`;
    the growth factor is raised until they fit)."""
    v = np.maximum(e, floor)
    growth = KNOT_GROWTH
    while True:
        ks, kv = [int(steps[0])], [float(v[0])]
        for s, x in zip(steps[1:], v[1:], strict=True):
            if x >= kv[-1] * growth:
                ks.append(int(s))
                kv.append(float(x))
        if len(ks) <= MAX_KNOTS:
            return ks, kv
        growth *= growth


def band_at(steps: np.ndarray, knot_steps: Sequence[int], knot_values: Sequence[float]
            ) -> np.ndarray:
    """The known-good envelope at ``steps`` from its knots: the value of the last knot at or
    before each step (the first knot's before it, the last knot's after it)."""
    ks, kv = np.asarray(knot_steps, dtype=np.int64), np.asarray(knot_values, dtype=float)
    idx = np.clip(np.searchsorted(ks, steps, side="right") - 1, 0, len(ks) - 1)
    return kv[idx]


@dataclass(frozen=True)
class PairJudgement:
    """A pair's divergence against the band ``max_ratio * envelope``."""

    steps_compared: int
    first_step: int | None
    last_step: int | None
    first_divergence_step: int | None  # first step with D > band (None: never)
    divergence_at_first: float | None
    band_at_first: float | None
    steps_outside: int
    fraction_outside: float
    max_ratio_observed: float | None  # max_t D(t) / envelope(t)
    step_of_max_ratio: int | None
    divergence_at_last: float | None
    band_at_last: float | None
    steps_beyond_band: int  # compared steps after the band's last knot step


def judge(div: Divergence, knot_steps: Sequence[int], knot_values: Sequence[float],
          max_ratio: float) -> PairJudgement:
    """Where ``D(t)`` exceeds ``max_ratio * envelope(t)`` (see the module docstring)."""
    n = len(div.steps)
    if n == 0:
        return PairJudgement(0, None, None, None, None, None, 0, 0.0, None, None, None, None, 0)
    env = band_at(div.steps, knot_steps, knot_values)
    band = max_ratio * env
    out = div.running > band
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(env > 0, div.running / env, np.inf)
    i_max = int(np.argmax(ratio))
    first = int(np.argmax(out)) if out.any() else None
    return PairJudgement(
        steps_compared=n, first_step=int(div.steps[0]), last_step=int(div.steps[-1]),
        first_divergence_step=None if first is None else int(div.steps[first]),
        divergence_at_first=None if first is None else float(div.running[first]),
        band_at_first=None if first is None else float(band[first]),
        steps_outside=int(out.sum()), fraction_outside=float(out.mean()),
        max_ratio_observed=float(ratio[i_max]), step_of_max_ratio=int(div.steps[i_max]),
        divergence_at_last=float(div.running[-1]), band_at_last=float(band[-1]),
        steps_beyond_band=int((div.steps > knot_steps[-1]).sum()))


def leave_one_out_needs(curves: Sequence[Divergence]) -> list[float]:
    """For each known-good curve: ``max_t D_k(t) / max(E_{-k}(t), floor_{-k})``, the factor
    it needs above the envelope of the others (empty with fewer than two curves)."""
    if len(curves) < 2:
        return []
    needs = []
    for k, ck in enumerate(curves):
        others = [c for j, c in enumerate(curves) if j != k]
        steps, e, floor = envelope(others)
        if not math.isfinite(floor):
            needs.append(math.inf)
            continue
        ks, kv = band_knots(steps, e, floor)
        needs.append(float(judge(ck, ks, kv, 1.0).max_ratio_observed or 0.0))
    return needs


def metric_series(run: RunData, metric: str, keep: str = "last"
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """One value per step of ``metric`` in ``run`` (None when the run lacks it)."""
    if metric not in run.metric_names:
        return None
    steps, values, seq = run.series(metric)
    r = resolve_series(steps, values, seq, keep=keep)  # type: ignore[arg-type]
    return np.asarray(r.steps, dtype=np.int64), np.asarray(r.values, dtype=float)


@dataclass(frozen=True)
class PairDivergence:
    """:func:`divergence_curve` of a metric between a run and its pair, or why there is
    none (``curve`` None, ``problem`` a sentence)."""

    curve: Divergence | None
    problem: str = ""


def pair_divergence(reference: RunData, candidate: RunData, metric: str, keep: str = "last"
                    ) -> PairDivergence:
    """:func:`divergence_curve` of ``metric`` between two runs, unless one lacks the
    metric, they share no step of it, or the candidate numbers the same steps differently
    (:func:`~refrun.comparison.alignment.step_shift`: its step ``s`` is the reference's
    ``s - d``, so a divergence at equal step numbers would measure ``d`` steps of
    training, not the port)."""
    r, c = metric_series(reference, metric, keep), metric_series(candidate, metric, keep)
    if r is None or c is None:
        who = reference.run_id if r is None else candidate.run_id
        return PairDivergence(None, f"metric {metric!r} not recorded in run {who}")
    shift = step_shift(r[0], c[0])
    if shift is not None:
        return PairDivergence(None, f"{metric!r} of run {candidate.run_id} against its pair "
                              f"{reference.run_id}: {shift_note(shift, r[0], c[0])}")
    div = divergence_curve(r[0], r[1], c[0], c[1])
    if not len(div.steps):
        return PairDivergence(None, f"no common step of {metric!r} between run "
                              f"{candidate.run_id} and its pair {reference.run_id}")
    return PairDivergence(div)


# --- which reference run is the candidate's pair ---------------------------------------------
@dataclass(frozen=True)
class PairLookup:
    """The candidate's same-seed reference, or why there is none.

    ``declared``: what the candidate (or ``--pair``) declares; empty when nothing.
    ``run``: the pair (None when not found); ``source``: ``--pair``, ``tag
    refrun.pair.reference``, ``references`` (found among the assessment's references) or
    ``store``; ``problem``: why a declared pair was not found (ambiguous, missing ...).
    ``twin``: the candidate's precision twin, looked up when the candidate ran at coarser
    numerics than its pair or ``--twin`` names one (:mod:`refrun.acceptance.precision`).
    """

    declared: str
    run: RunData | None = None
    source: str = ""
    problem: str = ""
    twin: TwinLookup | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"declared": self.declared, "run_id": self.run.run_id if self.run else None,
               "source": self.source, "problem": self.problem}
        if self.twin is not None:  # only then: assessments recorded before it verify
            out["twin"] = self.twin.to_dict()
        return out


def declared_seed(run: RunData) -> int | None:
    """The reference seed a run declares it shares its start with (``refrun.pair.seed``)."""
    v = run.tags.get(schema.TAG_PAIR_SEED, "").strip()
    try:
        return int(v) if v else None
    except ValueError:
        return None


def _describe(candidate: RunData) -> str:
    seed = candidate.tags.get(schema.TAG_PAIR_SEED, "").strip()
    ref = candidate.tags.get(schema.TAG_PAIR_REFERENCE, "").strip()
    parts = ([f"{schema.TAG_PAIR_SEED} = {seed}"] if seed else []) + (
        [f"{schema.TAG_PAIR_REFERENCE} = {ref}"] if ref else [])
    return ", ".join(parts)


def pair_among(candidate: RunData, references: Sequence[RunData]) -> PairLookup:
    """The pair found without a store: among ``references`` by the declared run id or
    seed.  ``run`` None with an empty ``problem`` means: look in the store."""
    if not declares_pair(candidate.tags):
        return PairLookup("")
    declared = _describe(candidate)
    want_id = candidate.tags.get(schema.TAG_PAIR_REFERENCE, "").strip()
    if want_id:
        hit = [r for r in references if r.run_id == want_id]
        return PairLookup(declared, hit[0], "references") if hit else PairLookup(declared)
    seed = declared_seed(candidate)
    if seed is None:
        return PairLookup(declared, problem=f"{schema.TAG_PAIR_SEED} "
                          f"{candidate.tags.get(schema.TAG_PAIR_SEED)!r} is not an integer")
    hit = [r for r in references if r.seed == str(seed) and not declares_pair(r.tags)]
    if len(hit) > 1:
        return PairLookup(declared, problem=f"{len(hit)} references have seed {seed} "
                          f"({', '.join(r.run_id for r in hit)}): name one with --pair")
    return PairLookup(declared, hit[0], "references") if hit else PairLookup(declared)


def find_pair(candidate: RunData, references: Sequence[RunData],
              tracking_uri: str | None = None, explicit: str | None = None) -> PairLookup:
    """The candidate's same-seed reference run.

    In order: ``explicit`` (``refrun accept --pair ID``); the run named by the candidate's
    ``refrun.pair.reference`` tag; the reference among ``references`` whose seed is the
    candidate's ``refrun.pair.seed``; else the one FINISHED ``role = reference`` run of the
    candidate's workload with that seed in the store that is not itself a pair of another
    run.  Raises :class:`RefrunInputError` for an explicit id that is not a reference run of
    the candidate's workload or whose seed contradicts the candidate's declaration.
    """
    from refrun.comparison import load_run

    if explicit:
        run = load_run(explicit, tracking_uri=tracking_uri, progress=False)
        if run.run_id == candidate.run_id:
            raise RefrunInputError(f"--pair {explicit}: that is the candidate itself")
        if (run.workload or "") != (candidate.workload or ""):
            raise RefrunInputError(f"--pair {explicit}: workload {run.workload!r}, the "
                                   f"candidate's is {candidate.workload!r}")
        seed = declared_seed(candidate)
        if seed is not None and run.seed not in (None, "", str(seed)):
            raise RefrunInputError(f"--pair {explicit}: seed {run.seed}, but candidate "
                                   f"{candidate.run_id} declares {schema.TAG_PAIR_SEED} = "
                                   f"{seed}")
        return PairLookup(f"--pair {explicit}", run, "--pair")
    found = pair_among(candidate, references)
    if found.run is not None or found.problem or not found.declared:
        return found
    want_id = candidate.tags.get(schema.TAG_PAIR_REFERENCE, "").strip()
    if want_id:
        try:
            run = load_run(want_id, tracking_uri=tracking_uri, progress=False)
        except RefrunInputError as exc:
            return PairLookup(found.declared, problem=str(exc))
        return PairLookup(found.declared, run, f"tag {schema.TAG_PAIR_REFERENCE}")
    seed = declared_seed(candidate)
    ids = _store_references(candidate.workload or "", seed, tracking_uri)
    if not ids:
        return PairLookup(found.declared, problem=f"no finished reference run of workload "
                          f"{candidate.workload!r} with seed {seed} in the store")
    if len(ids) > 1:
        return PairLookup(found.declared, problem=f"{len(ids)} finished reference runs of "
                          f"seed {seed} ({', '.join(ids[:5])}): name one with --pair or "
                          f"{schema.TAG_PAIR_REFERENCE}")
    return PairLookup(found.declared, load_run(ids[0], tracking_uri=tracking_uri,
                                               progress=False), "store")


def search_runs(flt: str, tracking_uri: str | None) -> list[Any]:
    """MLflow's runs matching the filter ``flt`` in every experiment, oldest first."""
    from refrun.store.client import client as store_client

    client = store_client(tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(exps, flt, max_results=1000,
                                   order_by=["attributes.start_time ASC"]))


def _store_references(workload: str, seed: int | None, tracking_uri: str | None) -> list[str]:
    if seed is None:
        return []
    flt = (f"tags.`{schema.TAG_WORKLOAD}` = '{workload}' and tags.`{schema.TAG_ROLE}` = "
           f"'reference' and tags.`{schema.TAG_SEED}` = '{seed}' and "
           "attributes.status = 'FINISHED'")
    return [r.info.run_id for r in search_runs(flt, tracking_uri)
            if not declares_pair(r.data.tags)]


def known_good_ids(workload: str, tracking_uri: str | None = None) -> list[str]:
    """Finished runs of ``workload`` (any role) declared known-good pair evidence
    (``refrun.pair.known_good`` and a ``refrun.pair.seed`` / ``refrun.pair.reference``),
    oldest first."""
    flt = f"tags.`{schema.TAG_WORKLOAD}` = '{workload}' and attributes.status = 'FINISHED'"
    return [r.info.run_id for r in search_runs(flt, tracking_uri) if is_known_good(r.data.tags)]


NO_PAIR = "no same-seed pair"


# --- calibration: the band from known-good evidence ---------------------------------------------
@dataclass(frozen=True)
class PairedBand:
    """A calibrated ``paired`` criterion's numbers and where they came from.

    ``hardware``: by candidate hardware, the band its own known-good evidence gives
    (:func:`derive_band`); empty when all the evidence is on the references' hardware."""

    metric: str
    band_steps: list[int]
    band_values: list[float]
    max_ratio: float
    pairs: list[tuple[str, str, str]]  # (known-good run, its reference run, why benign)
    needs: list[float]  # leave-one-out needs (empty with one pair)
    floor: float
    hardware: dict[str, PairedBand] = field(default_factory=dict)


def reduced_evidence(known_good: RunData, pair: RunData) -> str:
    """Why a known-good run is no evidence for the band because it ran at coarser numerics
    than its pair (:func:`refrun.numerics.coarser` by more than the structural factor),
    or "".  A band from such a pair is as wide as that precision: it would accept every
    port at that precision, a bfloat16-matmul defect included, at every precision.  A port
    at a platform's reduced default is judged through its precision twin instead
    (:mod:`refrun.acceptance.precision`)."""
    run = numerics.of_run(known_good.tags)
    coarse = numerics.coarser(run, numerics.of_run(pair.tags), STRUCTURAL_MAX_RATIO)
    if not coarse:
        return ""
    return (f"ran at reduced precision ({'; '.join(c.text() for c in coarse)}; "
            f"{run.setting}): a band from it would accept that precision, a bfloat16 "
            "defect with it; record known-good evidence at its pair's precision (a port at "
            "a platform's reduced default is judged through its precision twin)")


@dataclass(frozen=True)
class _Evidence:
    """One usable known-good pair: its divergence curve, provenance and hardware."""

    curve: Divergence
    pair: tuple[str, str, str]
    hardware: str | None


def _band(metric: str, own: Sequence[_Evidence], base: Sequence[_Evidence] = ()
          ) -> PairedBand:
    """The band of ``own`` evidence widened by ``base`` (the references' hardware's, for a
    hardware band): envelope over both, ``max_ratio`` raised only by leave-one-out needs
    within ``own`` and within ``base`` (a curve of one hardware is never judged against
    another hardware's envelope: that is the difference this band admits)."""
    curves = [e.curve for e in (*base, *own)]
    steps, e, floor = envelope(curves)
    ks, kv = band_knots(steps, e, floor)
    needs = leave_one_out_needs([x.curve for x in own]) + leave_one_out_needs(
        [x.curve for x in base])
    worst = max(needs) if needs else 0.0
    ratio = STRUCTURAL_MAX_RATIO if worst <= STRUCTURAL_MAX_RATIO else float(
        f"{math.ceil(worst * 1.0001 * 100) / 100:.6g}")
    return PairedBand(metric, ks, kv, ratio, [x.pair for x in (*base, *own)], needs, floor)


def derive_band(known_good: Sequence[RunData], references: Sequence[RunData], metric: str,
                keep: str = "last") -> tuple[PairedBand | None, str]:
    """The paired band from every known-good run whose pair is among ``references``
    (``(band, "")``), or ``(None, why none)``; the reason also names evidence left out.

    **Evidence by hardware.** A port's divergence from its seed depends on the hardware it
    runs on as well as on the port: a TPU's transcendental functions and summation order
    differ from a CPU's at float32 precision, and in a chaotic training map that start
    grows like any other.  Known-good evidence recorded on the references' hardware (or
    with no hardware tag) gives the band; evidence recorded on another hardware kind ``h``
    (the same known-good port run there at full precision) gives ``hardware[h]``: the
    envelope of the references' hardware's evidence and ``h``'s, so a candidate on ``h`` is
    never judged more strictly than one on the references' hardware.  Evidence on ``h``
    never widens the band of any other hardware.  When no evidence is on the references'
    hardware, all of it gives the one band (no hardware bands)."""
    usable, left = [], []
    ref_hw = {identity.canonical_hardware(r.hardware) for r in references}
    for kg in known_good:
        found = pair_among(kg, references)
        if found.run is None:
            why = found.problem or (f"its pair ({found.declared}) is not among the "
                                    "calibration references")
            left.append(f"{kg.run_id}: {why}")
            continue
        reduced = reduced_evidence(kg, found.run)
        if reduced:
            left.append(f"{kg.run_id}: {reduced}")
            continue
        pd = pair_divergence(found.run, kg, metric, keep)
        if pd.curve is None:
            left.append(f"{kg.run_id}: {pd.problem}")
            continue
        div = pd.curve
        if not np.any(div.running > 0):
            left.append(f"{kg.run_id}: identical to {found.run.run_id} at every step (its "
                        "declared perturbation changed nothing, so it measures no divergence)")
            continue
        if not np.all(np.isfinite(div.running)):
            left.append(f"{kg.run_id}: non-finite {metric!r} where its pair is finite")
            continue
        hw = identity.canonical_hardware(kg.hardware)
        usable.append(_Evidence(div, (kg.run_id, found.run.run_id,
                                      kg.tags.get(schema.TAG_PAIR_KNOWN_GOOD, "").strip()),
                                None if hw is None or hw in ref_hw else hw))
    tail = f" (left out: {'; '.join(left)})" if left else ""
    if not usable:
        if not known_good:
            return None, (f"no paired criterion: the store holds no known-good same-seed "
                          f"evidence (a finished run tagged {schema.TAG_PAIR_KNOWN_GOOD} with "
                          f"the {schema.TAG_PAIR_SEED} of a reference seed, e.g. a rerun of "
                          "the reference with a declared numerical perturbation; "
                          "refrun.pairing.pair_tags)")
        return None, f"no paired criterion: no usable known-good pair{tail}"
    base = [e for e in usable if e.hardware is None]
    if not base:
        return _band(metric, usable), tail.strip()
    others = sorted({e.hardware for e in usable if e.hardware is not None})
    bands = {h: _band(metric, [e for e in usable if e.hardware == h], base) for h in others}
    return replace(_band(metric, base), hardware=bands), tail.strip()
