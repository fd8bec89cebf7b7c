"""Reduced precision in a same-seed pair: telling a platform's default numerics from a
port defect with a *precision twin* (docs/acceptance.md, "Reduced precision: precision
twins").

**The problem.**  The paired band (:mod:`refrun.acceptance.paired`) separates float32
perturbations from TF32 or bfloat16 ones.  A platform whose *default* is coarser -- a TPU
runs JAX's float32 matmuls as one bfloat16 pass -- puts an exact port in the same place as
a port that casts its matmuls to bfloat16: measured on a TPU v5e, an exact GRU port at
JAX's default precision diverged 985x the known-good envelope, a bfloat16-matmul defect
872x (limit 90.5).  From that pair alone nobody can tell them apart; the cause is the
numerics configuration, now recorded (:mod:`refrun.numerics`).

**Decided.**  Known-good evidence stays at the references' precision: a band calibrated
from a reduced-precision pair would be as wide as bfloat16 and accept the bfloat16 defect
at every precision, so ``refrun calibrate`` leaves such evidence out and says why
(:func:`refrun.acceptance.paired.reduced_evidence`).  A candidate that ran coarser than
its pair (float32 matmuls or convolutions coarser by more than the band's structural
factor, :func:`refrun.numerics.coarser`) and leaves the band is judged through its
**precision twin**: the same port (same code, seed, pair, hardware and backend) run again
at its pair's precision, e.g. with ``JAX_DEFAULT_MATMUL_PRECISION=highest``.  The twin is
judged against the same pair with the same band:

* twin inside the band: the port matches its seed at full precision, and the candidate's
  divergence is what the platform's precision does to a correct port: **pass**, the
  reason naming the precision, both divergences and the twin;
* twin outside the band: the divergence is there at full precision too: **fail**, "a port
  defect, not the platform's precision" (a bfloat16-matmul port fails at every precision:
  its twin computes the same bfloat16 products);
* no twin: **fail**, the reason naming the precision and the rerun that would separate
  the two (the twin to record).

A candidate whose values are not finite where its pair's are fails whatever its twin
does: no precision explains that.  The twin is found by ``refrun accept --twin ID``, or
in the store as the one finished run of the workload declaring the candidate's pair seed
and port (``refrun.pair.port``, :func:`refrun.pairing.pair_tags`) on the same backend and
hardware, at its pair's precision (never coarser), and, when both record one, at the same
git commit.  Its fingerprint joins the evidence (role ``twin``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from refrun import identity, numerics, schema
from refrun.acceptance import paired as pairs
from refrun.acceptance.paired import STRUCTURAL_MAX_RATIO, PairJudgement, judge
from refrun.comparison import RunData
from refrun.errors import RefrunInputError
from refrun.pairing import declares_pair

FACTOR = STRUCTURAL_MAX_RATIO  # a precision difference the band already absorbs


@dataclass(frozen=True)
class TwinLookup:
    """The candidate's precision twin, or why there is none.

    ``declared``: ``--twin ID`` or the port (``refrun.pair.port = NAME``); empty when
    neither; ``run``: the twin (None when not found); ``source``: ``--twin`` or ``store``;
    ``problem``: why none was found."""

    declared: str
    run: RunData | None = None
    source: str = ""
    problem: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"declared": self.declared, "run_id": self.run.run_id if self.run else None,
                "source": self.source, "problem": self.problem}


@dataclass(frozen=True)
class PairNumerics:
    """The numerics of a candidate and its pair: what each meant, and where the
    candidate was coarser (``coarser``: beyond the band's structural factor)."""

    candidate: numerics.RunNumerics
    pair: numerics.RunNumerics
    coarser: list[numerics.Coarser]

    @property
    def reduced(self) -> bool:
        return bool(self.coarser)

    @property
    def flags_differ(self) -> bool:
        a, b = self.candidate.flags or numerics.NONE, self.pair.flags or numerics.NONE
        return a != b

    def said(self) -> str:
        """``float32 matmuls as bfloat16, 1 pass where its pair's ran as float32;
        jax_default_matmul_precision=default on tpu``."""
        return "; ".join([*(c.text() for c in self.coarser), self.candidate.setting])


def pair_numerics(candidate: RunData, pair: RunData) -> PairNumerics:
    """What the candidate's and its pair's recorded numerics meant, and where the candidate
    ran coarser (:func:`refrun.numerics.coarser` with the band's structural factor)."""
    c, p = numerics.of_run(candidate.tags), numerics.of_run(pair.tags)
    return PairNumerics(c, p, numerics.coarser(c, p, FACTOR))


# --- finding the twin ------------------------------------------------------------------------
def not_twin(candidate: RunData | dict[str, str], pair: RunData,
             twin_tags: dict[str, str]) -> str:
    """Why a run with ``twin_tags`` is not the candidate's precision twin (its pair is
    ``pair``), or "": it must declare the same pair, run on the same backend and hardware,
    at the same git commit when both record one, and at its pair's precision."""
    ctags = candidate.tags if isinstance(candidate, RunData) else candidate
    cseed, tseed = (t.get(schema.TAG_PAIR_SEED, "").strip() for t in (ctags, twin_tags))
    tref = twin_tags.get(schema.TAG_PAIR_REFERENCE, "").strip()
    if not declares_pair(twin_tags) or (cseed and tseed and cseed != tseed) or \
            (tref and tref != pair.run_id):
        return (f"it declares another pair ({schema.TAG_PAIR_SEED} {tseed or '-'}, "
                f"{schema.TAG_PAIR_REFERENCE} {tref or '-'}; the candidate's pair is "
                f"{pair.run_id})")
    for what, key, norm in (("backend", schema.TAG_BACKEND, identity.canonical_backend),
                            ("hardware", schema.TAG_EXEC_HARDWARE, _same),
                            ("hardware", schema.TAG_HARDWARE, identity.canonical_hardware),
                            ("code", schema.TAG_GIT_COMMIT, _same)):
        a, b = ctags.get(key, "").strip(), twin_tags.get(key, "").strip()
        if a and b and (norm(a) or a) != (norm(b) or b):
            return f"it ran {what} {b!r}, the candidate {a!r} ({key})"
    tw = numerics.of_run(twin_tags)
    if not tw.known:
        return "it recorded no numerics configuration (refrun.numerics.*)"
    coarse = numerics.coarser(tw, numerics.of_run(pair.tags), FACTOR)
    if coarse:
        return f"it ran at reduced precision too ({'; '.join(c.text() for c in coarse)})"
    return ""


def _same(v: str) -> str:
    return v


def find_twin(candidate: RunData, pair: RunData, tracking_uri: str | None = None,
              explicit: str | None = None) -> TwinLookup:
    """The candidate's precision twin: ``explicit`` (``refrun accept --twin ID``; one that
    is no twin, :func:`not_twin`, raises :class:`RefrunInputError`), else the one finished
    run of the workload that declares the candidate's pair seed and port
    (``refrun.pair.port``) and is its twin."""
    from refrun.comparison import load_run

    if explicit:
        run = load_run(explicit, tracking_uri=tracking_uri, progress=False)
        why = "that is the candidate itself" if run.run_id == candidate.run_id else (
            f"workload {run.workload!r}, the candidate's is {candidate.workload!r}"
            if (run.workload or "") != (candidate.workload or "") else
            not_twin(candidate, pair, run.tags))
        if why:
            raise RefrunInputError(f"--twin {explicit}: not a precision twin of candidate "
                                   f"{candidate.run_id}: {why}")
        return TwinLookup(f"--twin {explicit}", run, "--twin")
    port = candidate.tags.get(schema.TAG_PAIR_PORT, "").strip()
    if not port:
        return TwinLookup("", problem=f"candidate {candidate.run_id} declares no port "
                          f"({schema.TAG_PAIR_PORT}: refrun.pairing.pair_tags(seed, "
                          "port=NAME)) and no --twin was given")
    declared = f"{schema.TAG_PAIR_PORT} = {port}"
    if "'" in port or "\\" in port:
        return TwinLookup(declared, problem="the port's name has a quote or backslash")
    flt = (f"tags.`{schema.TAG_WORKLOAD}` = '{candidate.workload or ''}' and "
           f"tags.`{schema.TAG_PAIR_PORT}` = '{port}' and attributes.status = 'FINISHED'")
    hits, refused = [], []
    for r in pairs.search_runs(flt, tracking_uri):
        if r.info.run_id == candidate.run_id:
            continue
        why = not_twin(candidate, pair, dict(r.data.tags))
        (refused.append(f"{r.info.run_id}: {why}") if why else hits.append(r.info.run_id))
    if len(hits) == 1:
        return TwinLookup(declared, load_run(hits[0], tracking_uri=tracking_uri,
                                             progress=False), "store")
    if hits:
        return TwinLookup(declared, problem=f"{len(hits)} runs qualify "
                          f"({', '.join(hits[:5])}): name one with --twin")
    tail = f" (not twins: {'; '.join(refused[:3])})" if refused else ""
    return TwinLookup(declared, problem=f"no finished run of port {port!r} with the "
                      f"candidate's pair at its pair's precision in the store{tail}")


# --- judging through the twin ----------------------------------------------------------------
@dataclass(frozen=True)
class TwinJudgement:
    """The twin against the candidate's pair and band (``judgement``), and how far the
    platform's precision alone moves the port: ``precision_divergence``, the largest
    |candidate - twin| over their common steps (``None`` when not compared)."""

    judgement: PairJudgement | None
    precision_divergence: float | None
    problem: str = ""

    @property
    def passed(self) -> bool:
        return self.judgement is not None and self.judgement.first_divergence_step is None


def judge_twin(twin: RunData, pair: RunData, candidate: RunData, metric: str, keep: str,
               band_steps: list[int], band_values: list[float], max_ratio: float
               ) -> TwinJudgement:
    """The twin's divergence from the candidate's pair against the same band, and the
    candidate's divergence from its twin (what the precision alone does)."""
    tw = pairs.pair_divergence(pair, twin, metric, keep)
    if tw.curve is None:
        return TwinJudgement(None, None, tw.problem)
    between = pairs.pair_divergence(twin, candidate, metric, keep)
    p = float(between.curve.running[-1]) if between.curve is not None and \
        len(between.curve.running) else None
    return TwinJudgement(judge(tw.curve, band_steps, band_values, max_ratio), p)


@dataclass(frozen=True)
class Decision:
    """What numerics say about a paired result: ``outcome`` None keeps the band's own
    outcome and ``text`` is added to its reason; otherwise ``outcome`` replaces it and
    ``text`` is the whole reason.  ``evidence``: the result's ``numerics`` ({} when
    neither run recorded any)."""

    outcome: str | None
    text: str
    evidence: dict[str, Any]


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.4g}"


def decide(pn: PairNumerics, lookup: pairs.PairLookup, divergence: pairs.Divergence,
           j: PairJudgement, tj: TwinJudgement | None, max_ratio: float) -> Decision:
    """What a paired result says about numerics (the module doc's rules): a pass at
    reduced precision says so; a failure at reduced precision is decided by the twin
    (``tj``; None: no twin was found, ``lookup.twin`` says why) or names the rerun; a
    failure at the pair's precision says the divergence is not the platform's."""
    c = pn.candidate
    ev: dict[str, Any] = {"candidate": c.summary(), "pair": pn.pair.summary(),
                          "reduced": pn.reduced,
                          "coarser": [x.text() for x in pn.coarser],
                          "rerun": c.rerun if pn.reduced else ""}
    flags = (f"; its numerics XLA flags differ from its pair's ({c.flags or 'none'} / "
             f"{pn.pair.flags or 'none'})") if pn.flags_differ else ""
    passed = j.first_divergence_step is None
    if not pn.reduced:
        if passed or not c.known:
            return Decision(None, flags, ev if c.known or pn.pair.known else {})
        ev["attribution"] = "port"
        return Decision(None, f"; it ran as precisely as its pair ({c.summary()}): not the "
                        f"platform's precision{flags}", ev)
    if passed:
        ev["attribution"] = "none needed"
        return Decision(None, f"; at reduced precision ({pn.said()}){flags}", ev)
    twin = lookup.twin
    ev["twin"] = twin.to_dict() if twin is not None else None
    if not bool(np.all(np.isfinite(divergence.running))):
        ev["attribution"] = "port"
        return Decision(None, f"; ran at reduced precision ({pn.said()}), but its values are "
                        "not finite where its pair's are: no precision accounts for that"
                        + flags, ev)
    if tj is None or tj.judgement is None:
        ev["attribution"] = "undetermined"
        why = (tj.problem if tj is not None and tj.problem else
               twin.problem if twin is not None and twin.problem else "")
        return Decision(None, f"; ran at reduced precision ({pn.said()}), where a correct "
                        "port diverges this far too: this cannot tell the platform's "
                        "precision from a port defect; re-run the same code and seed on the "
                        f"same hardware with {c.rerun} (its precision twin: the same "
                        f"{schema.TAG_PAIR_PORT}, or refrun accept --twin ID) to separate "
                        f"them" + (f" (no twin: {why})" if why else "") + flags, ev)
    tjj = tj.judgement
    ev["twin"] = {**(ev["twin"] or {}), "numerics": _twin_summary(lookup),
                  "precision_divergence": tj.precision_divergence,
                  "judgement": dataclasses.asdict(tjj)}
    tid = lookup.twin.run.run_id if lookup.twin and lookup.twin.run else "?"
    if not tj.passed:
        ev["attribution"] = "port"
        return Decision(None, f"; ran at reduced precision ({pn.said()}), and its precision "
                        f"twin {tid} ({_twin_summary(lookup)}) diverges too: first at step "
                        f"{tjj.first_divergence_step}, up to {_num(tjj.max_ratio_observed)} "
                        "x: a port defect, not the platform's precision" + flags, ev)
    ev["attribution"] = "platform precision"
    pair = f"pair {lookup.run.run_id if lookup.run else '?'} (seed " \
           f"{lookup.run.seed if lookup.run else '?'})"
    return Decision("pass", f"{pair}: ran at reduced precision ({pn.said()}) and diverges "
                    f"up to {_num(j.max_ratio_observed)} x the known-good envelope (beyond "
                    f"{max_ratio:.3g} x from step {j.first_divergence_step}), as far as the "
                    "platform's precision moves this port (|candidate - twin| up to "
                    f"{_num(tj.precision_divergence)}); its precision twin {tid}, the same "
                    f"port at {_twin_summary(lookup)}, stays within {max_ratio:.3g} x (at "
                    f"most {_num(tjj.max_ratio_observed)} x): the port matches its seed, "
                    "the difference is the platform's precision" + flags, ev)


def _twin_summary(lookup: pairs.PairLookup) -> str:
    t = lookup.twin.run if lookup.twin is not None else None
    if t is None:
        return "?"
    n = numerics.of_run(t.tags)
    return f"{n.setting}: float32 matmuls as {n.matmul.name}"
