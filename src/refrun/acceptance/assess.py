"""Assessing a candidate against a workload's criteria, level by level.

:func:`assess` works on loaded runs (:class:`refrun.comparison.RunData`) and is pure apart
from the clock; :func:`assess_ids` loads the runs from the store, checks that every metric
the criteria name exists in some run, and adds MLflow's latest metric values to the
evidence.  Levels L0-L3 are all evaluated (they are ordered assessments, not a strict
hierarchy); L4 only when L3 passed.  A criterion scoped by ``backends`` to other backends
than the candidate's is ``not_applicable`` at any level.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from refrun import identity, numerics, schema
from refrun.acceptance import checks, levels, performance, precision
from refrun.acceptance import paired as pairs
from refrun.acceptance import runview as rv
from refrun.acceptance.alignment import alignment_of, batch_hint
from refrun.acceptance.batch_scaling import divided, scaled_learning_rate
from refrun.acceptance.batch_scaling import peak as lr_peak
from refrun.acceptance.comparing import compare_options, run_comparison  # noqa: F401 (re-export)
from refrun.acceptance.criteria import CriteriaFile, Criterion, calibration_digest, locate
from refrun.acceptance.evidence import build_evidence, latest_metrics, sha256_of
from refrun.acceptance.gradchecks import GradcheckRun, find_gradchecks
from refrun.acceptance.results import (
    NO_CRITERIA,
    NOT_APPLICABLE,
    NOT_EVALUABLE,
    PASS,
    Assessment,
    CriterionResult,
)
from refrun.comparison import Comparison, RunData, load_run
from refrun.errors import RefrunInputError

# Metrics reported as L1 measurements: values and evaluations, not counters or system data.
_MEASURED_KINDS = ("value", "eval")


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def check_metrics_exist(crit: CriteriaFile, runs: Sequence[RunData],
                        candidate: RunData | None = None) -> None:
    """Raise :class:`RefrunInputError` (file, line, key path) for a metric written in the
    criteria file that no run has: almost always a typo, not missing evidence.  Default
    metric names (e.g. ``perf/step_time_s``) that no run has are missing evidence instead
    (the criterion is not evaluable).  With ``candidate``, criteria that do not apply to its
    backend (``backends``; or scoped while the backend is unknown) are not checked: their
    evidence may exist only for other backends' runs."""
    have = set().union(*(set(r.metric_names) for r in runs))
    lines = crit.text.splitlines()
    for section, entries in (("criteria", crit.criteria), ("stopping", crit.stopping)):
        for i, c in enumerate(entries):
            key = "metric" if hasattr(c, "metric") else "metrics"
            if not hasattr(c, key) or _is_default(c, key):
                continue
            if candidate is not None and isinstance(c, Criterion) and \
                    not c.applies_to(candidate.backend):
                continue
            for name in c.used_metrics():
                if name in have:
                    continue
                line = locate(lines, (section, i, key))
                where = f"{crit.path}:{line}" if line else crit.path
                raise RefrunInputError(
                    f"{where}: {section}[{i}].{key} (id {c.id!r}): metric {name!r} is not "
                    f"recorded in any of the runs ({', '.join(r.run_id for r in runs)}); "
                    f"known metrics: {', '.join(sorted(have)[:30])}")


def _is_default(c: Any, key: str) -> bool:
    f = next(f for f in dataclasses.fields(c) if f.name == key)
    if f.default_factory is not dataclasses.MISSING:
        return getattr(c, key) == f.default_factory()
    return f.default is not dataclasses.MISSING and getattr(c, key) == f.default


def measurements(comparison: Comparison | None) -> list[dict[str, Any]]:
    """L1: the observed differences of every value/eval metric (no verdict)."""
    if comparison is None:
        return []
    table = comparison.summary()
    return [row for row in table.to_dict("records") if row["kind"] in _MEASURED_KINDS]


def backend_scope(crit: CriteriaFile, runs: Sequence[RunData], candidate: RunData,
                  results: list[CriterionResult]) -> tuple[list[CriterionResult], list[str]]:
    """Make every backend-scoped skip visible: ``(results, warnings)``.

    * The candidate's ``refrun.backend`` tag is not a known backend (a typo recorded before
      names were validated): whether a scoped criterion applies is unknown, so its
      not_applicable becomes not_evaluable (never a pass), with a warning (the user
      should fix the tag).
    * A criterion scoped to backends that no compared run has keeps not_applicable, its
      row's reason saying so.  Not a warning: the criteria reader refuses a scope naming
      no known backend (``'tpu_xla' is not a known backend``), so such a skip is by design
      (a torch_xla host-copy criterion on a JAX candidate), nothing to act on; a sweep of
      30 JAX candidates printed 60 such lines.
    """
    have = sorted({identity.canonical_backend(r.backend) or r.backend.strip().lower()
                   for r in runs if r.backend and r.backend.strip()})
    cand = candidate.backend
    unknown = bool(cand and cand.strip()) and identity.canonical_backend(cand) is None
    out, warnings = [], []
    for r in results:
        c = next((c for c in crit.criteria if c.id == r.id), None)
        if r.outcome != NOT_APPLICABLE or c is None or not c.backends:
            out.append(r)
            continue
        scope = ", ".join(c.backends)
        if unknown:
            out.append(dataclasses.replace(r, outcome=NOT_EVALUABLE, reason=(
                f"candidate's {schema.TAG_BACKEND} {cand!r} is not a known backend (valid: "
                f"{', '.join(identity.BACKENDS)}): whether this criterion (scoped to "
                f"{scope}) applies is unknown")))
            warnings.append(f"candidate backend {cand!r} is not a known backend name; "
                            f"criterion {r.id!r} (scoped to {scope}) not evaluable")
            continue
        if not set(c.backends) & set(have):
            why = f"scoped to {scope}; no compared run has that backend (runs: " \
                  f"{', '.join(have) or 'none tagged'})"
            out.append(dataclasses.replace(r, reason=f"{r.reason}; {why}"))
            continue
        out.append(r)
    return out, warnings


def assess(crit: CriteriaFile, references: Sequence[RunData], candidate: RunData,
           latest: dict[str, dict] | None = None,
           allow_cross_workload: bool = False,
           gradchecks: list[GradcheckRun] | None = None,
           pair: pairs.PairLookup | None = None) -> Assessment:
    """Assess ``candidate`` against ``references`` with the criteria ``crit``.

    Every criterion yields pass, fail, not_evaluable or not_applicable (scoped by
    ``backends`` to other backends) with its evidence values; L4 criteria are evaluated
    only when L3 passed; the evidence digest covers the criteria
    file, the results and the runs' data (see :mod:`refrun.acceptance.evidence`).
    """
    return assess_with_evidence(crit, references, candidate, latest, allow_cross_workload,
                                gradchecks, pair)[0]


def assess_with_evidence(crit: CriteriaFile, references: Sequence[RunData],
                         candidate: RunData, latest: dict[str, dict] | None = None,
                         allow_cross_workload: bool = False,
                         gradchecks: list[GradcheckRun] | None = None,
                         pair: pairs.PairLookup | None = None
                         ) -> tuple[Assessment, dict[str, Any]]:
    """:func:`assess`, and the evidence document its digest is computed over (built
    once: digesting every curve of every run is a good part of an assessment's cost).
    ``pair``: the candidate's same-seed reference (:func:`pair_for`), for ``paired``
    criteria; its run's fingerprint joins the evidence when it is not a reference."""
    refs = list(references)
    if not refs:
        raise RefrunInputError("reference: at least one reference run is required")
    cross = identity.check_workloads(candidate, refs, crit.workload, crit.path,
                                     allow=allow_cross_workload)
    # A learning rate scaled with the global batch by a known rule is judged divided by
    # its factor (batch_scaling); the evidence keeps the run as logged.
    scaled = scaled_learning_rate(
        _data_per_step(candidate)[0], [_data_per_step(r)[0] for r in refs],
        lr_peak(candidate.curves), [lr_peak(r.curves) for r in refs])
    judged = candidate if scaled is None else dataclasses.replace(
        candidate, curves=divided(candidate.curves, scaled.factor))
    comparison, why = run_comparison(crit, refs, judged)
    ctx = checks.Context(crit, refs, judged, comparison, why, gradchecks=gradchecks,
                         pair=pair)
    results: list[CriterionResult] = levels.builtin_l0(candidate, refs, crit.l0, crit.settings.keep)
    for lv in ("L0", "L1", "L2", "L3"):
        results += [checks.evaluate(c, ctx) for c in crit.criteria if c.level == lv]
    gate = levels.level_status([r for r in results if r.level == levels.L4_GATE])
    for c in (c for c in crit.criteria if c.level == "L4"):
        skipped = checks.applicability(c, candidate, refs)
        if skipped is not None and skipped.outcome == NOT_APPLICABLE:
            results.append(skipped)
        elif gate == PASS:
            results.append(checks.evaluate(c, ctx))
        else:
            results.append(CriterionResult(
                id=c.id, level=c.level, kind=c.KIND, outcome=NOT_EVALUABLE,
                reason=f"not evaluated: L4 is judged only after {levels.L4_GATE} passed "
                       f"({levels.L4_GATE} status: {gate})",
                metric=getattr(c, "metric", None), description=c.description,
                evaluated=False))
    results, warnings = backend_scope(crit, [*refs, candidate], candidate, results)
    warnings += [f"criterion {r.id!r} not applied: {r.reason}" for r in results
                 if r.kind == "paired" and r.outcome != PASS and r.reason.startswith(
                     pairs.NO_PAIR)]
    held = held_back(crit, gate)
    if held:
        warnings.append(held)
    hint = batch_hint(crit.settings.axis, _data_per_step(candidate),
                      [_data_per_step(r) for r in refs])
    if hint:
        warnings.append(hint)
    if scaled is not None:
        warnings.append(scaled.line())
    if cross:
        warnings.insert(0, cross)
    measured = performance.measure(candidate, refs, crit.prices, crit.settings)
    lvls = levels.summarize(results)
    assessment = Assessment(
        criteria_path=crit.path, criteria_sha256=crit.sha256,
        workload=crit.workload or candidate.workload or "", reference_ids=[r.run_id for r in refs],
        candidate_id=candidate.run_id, results=results, levels=lvls,
        highest_level=levels.highest_level(lvls), verdict=levels.verdict(results),
        measurements=measurements(comparison), created_utc=utc_now(), warnings=warnings,
        cross_workload=cross, alignment=alignment_of(crit),
        pair=pair.to_dict() if pair is not None and pair.declared else {},
        numerics=numerics_differences(candidate, refs),
        performance=measured.to_dict() if measured is not None else {})
    evidence = build_evidence(crit.sha256, results, refs, candidate, latest,
                              pair=pair_run(pair, refs), twin=twin_run(pair))
    return dataclasses.replace(assessment, evidence_sha256=sha256_of(evidence),
                               calibration_sha256=calibration_digest(crit)), evidence


def _data_per_step(run: RunData) -> tuple[int | None, int | None]:
    """``(global batch, tokens per sample)`` as the run's tags say (None: not tagged)."""
    return (rv.tag_int(run, schema.TAG_GLOBAL_BATCH),
            rv.tag_int(run, schema.TAG_TOKENS_PER_SAMPLE))


def held_back(crit: CriteriaFile, gate: str) -> str:
    """One line when the file's L4 criteria are held back because it has no L3 criterion
    at all (nothing a candidate could pass to reach L4), else ""."""
    if gate != NO_CRITERIA or not any(c.level == "L4" for c in crit.criteria):
        return ""
    return (f"L4 held back: {crit.path} has no {levels.L4_GATE} (project goal) criterion, "
            f"and L4 is judged only after {levels.L4_GATE} passed; add one (refrun "
            "calibrate --goal METRIC>=VALUE, or a [[criteria]] table with level = \"L3\")")


@dataclass(frozen=True, eq=False)
class References:
    """Reference runs loaded once for any number of candidates, with MLflow's latest
    metric values of each (for the evidence)."""

    runs: list[RunData]
    latest: dict[str, dict]

    @property
    def ids(self) -> list[str]:
        return [r.run_id for r in self.runs]


def load_references(reference_ids: Sequence[str], tracking_uri: str | None = None
                    ) -> References:
    """Load the reference runs (each once) and their latest metric values."""
    if not reference_ids:
        raise RefrunInputError("--reference: at least one reference run id is required")
    refs = [load_run(r, tracking_uri=tracking_uri, progress=False) for r in reference_ids]
    return References(refs, latest_of(refs, tracking_uri))


def latest_of(runs: Sequence[RunData], tracking_uri: str | None) -> dict[str, dict]:
    """MLflow's latest metric values per run: read with each run when it was loaded from
    the store (one request per run, not two), else asked for."""
    known = {r.run_id: dict(r.latest_metrics) for r in runs if r.latest_metrics is not None}
    missing = [r.run_id for r in runs if r.latest_metrics is None]
    return {**known, **(latest_metrics(missing, tracking_uri) if missing else {})}


def load_candidate(crit: CriteriaFile, refs: References, candidate_id: str,
                   tracking_uri: str | None = None, allow_cross_workload: bool = False
                   ) -> tuple[RunData, dict[str, dict]]:
    """Load a candidate against already loaded references: refuse one of another
    workload (unless ``allow_cross_workload``), check the criteria's metrics against the
    runs; returns the run and the latest metric values of references and candidate."""
    if candidate_id in refs.ids:
        raise RefrunInputError(f"--candidate {candidate_id}: also given as a reference")
    cand = load_run(candidate_id, tracking_uri=tracking_uri, progress=False)
    identity.check_workloads(cand, refs.runs, crit.workload, crit.path,
                             allow=allow_cross_workload)
    check_metrics_exist(crit, [*refs.runs, cand], cand)
    return cand, {**refs.latest, **latest_of([cand], tracking_uri)}


def load_for_assessment(crit: CriteriaFile, reference_ids: Sequence[str], candidate_id: str,
                        tracking_uri: str | None = None, allow_cross_workload: bool = False
                        ) -> tuple[list[RunData], RunData, dict[str, dict]]:
    """Load the runs, refuse a candidate of another workload (unless
    ``allow_cross_workload``), check the criteria's metrics against them, and read MLflow's
    latest metric values (for the evidence)."""
    if not reference_ids:
        raise RefrunInputError("--reference: at least one reference run id is required")
    if candidate_id in reference_ids:
        raise RefrunInputError(f"--candidate {candidate_id}: also given as a reference")
    refs = load_references(reference_ids, tracking_uri)
    cand, latest = load_candidate(crit, refs, candidate_id, tracking_uri, allow_cross_workload)
    return refs.runs, cand, latest


def gradchecks_for(crit: CriteriaFile, candidate: RunData, tracking_uri: str | None
                   ) -> list[GradcheckRun] | None:
    """The gradient-check runs recorded for ``candidate`` when a criterion of the file
    needs them (``gradcheck``: ``NEEDS``; one MLflow search), else None (not looked up)."""
    if not any("gradchecks" in c.NEEDS for c in crit.criteria):
        return None
    return find_gradchecks(candidate, tracking_uri)


def pair_for(crit: CriteriaFile, candidate: RunData, references: Sequence[RunData],
             tracking_uri: str | None, latest: dict[str, dict],
             explicit: str | None = None, twin: str | None = None
             ) -> pairs.PairLookup | None:
    """The candidate's same-seed reference when a criterion needs it (``paired``: ``NEEDS``; or
    ``explicit``, ``refrun accept --pair``, is given), else None (not looked up), with the
    candidate's precision twin when it ran at coarser numerics than its pair or ``twin``
    (``refrun accept --twin``) names one (:func:`refrun.acceptance.precision.find_twin`);
    adds the pair's and the twin's latest MLflow metric values to ``latest`` (their
    evidence fingerprints)."""
    needed = any("pair" in c.NEEDS for c in crit.criteria)
    if twin and not needed:
        raise RefrunInputError(f"--twin {twin}: {crit.path} has no paired criterion, which "
                               "is what a precision twin is judged by")
    if not explicit and not needed:
        return None
    lookup = pairs.find_pair(candidate, references, tracking_uri, explicit)
    if lookup.run is not None and (twin or precision.pair_numerics(candidate,
                                                                   lookup.run).reduced):
        lookup = dataclasses.replace(lookup, twin=precision.find_twin(
            candidate, lookup.run, tracking_uri, twin))
    elif twin:
        why = lookup.problem or "it declares none"
        raise RefrunInputError(f"--twin {twin}: candidate {candidate.run_id} has no "
                               f"same-seed pair to judge a twin against ({why})")
    for run in (pair_run(lookup, references), twin_run(lookup)):
        if run is not None and run.run_id not in latest:
            latest.update(latest_of([run], tracking_uri))
    return lookup


def pair_run(pair: pairs.PairLookup | None, references: Sequence[RunData]) -> RunData | None:
    """The pair's run when it is not already one of the references (its own evidence)."""
    if pair is None or pair.run is None:
        return None
    return None if any(r.run_id == pair.run.run_id for r in references) else pair.run


def twin_run(pair: pairs.PairLookup | None) -> RunData | None:
    """The candidate's precision twin, when one was found (its own evidence)."""
    return pair.twin.run if pair is not None and pair.twin is not None else None


def numerics_differences(candidate: RunData, references: Sequence[RunData]
                         ) -> dict[str, Any]:
    """Where the candidate's numerics configuration differs from the references'
    (:func:`refrun.numerics.differences`), with what each meant; {} when it does not."""
    diffs = numerics.differences(candidate.tags, {r.run_id: r.tags for r in references})
    if not diffs:
        return {}
    return {"candidate": numerics.of_run(candidate.tags).summary(),
            "references": {r.run_id: numerics.of_run(r.tags).summary() for r in references},
            "differences": diffs}


@dataclass(frozen=True, eq=False)
class Assessed:
    """One candidate's assessment, its evidence document, its hardware tag (for the
    comparison run's identity) and the compared runs' names by run id."""

    assessment: Assessment
    evidence: dict[str, Any]
    candidate_hardware: str | None
    run_names: dict[str, str]


def check_candidate_ids(reference_ids: Sequence[str], candidate_ids: Sequence[str]) -> None:
    """Refuse an empty, repeated or reference candidate list before anything is loaded."""
    if not candidate_ids:
        raise RefrunInputError("--candidate: at least one candidate run id is required")
    seen: set[str] = set()
    for c in candidate_ids:
        if c in seen:
            raise RefrunInputError(f"--candidate {c}: given twice")
        if c in reference_ids:
            raise RefrunInputError(f"--candidate {c}: also given as a reference")
        seen.add(c)


def assess_many(crit: CriteriaFile, reference_ids: Sequence[str],
                candidate_ids: Sequence[str], tracking_uri: str | None = None,
                allow_cross_workload: bool = False,
                pair_id: str | None = None, twin_id: str | None = None
                ) -> Iterator[Assessed]:
    """Assess each candidate against the same references, loaded once.

    A generator: one candidate's runs are in memory at a time (a sweep of a hundred
    candidates of a million points each never holds them all).  Bad input (an unknown
    run, a metric no run has) raises :class:`RefrunInputError` when that candidate is
    reached.  ``pair_id`` (``--pair``): the same-seed reference of the one candidate;
    ``twin_id`` (``--twin``): its precision twin."""
    check_candidate_ids(reference_ids, candidate_ids)
    for opt, value in (("--pair", pair_id), ("--twin", twin_id)):
        if value and len(candidate_ids) != 1:
            raise RefrunInputError(f"{opt} {value}: names the {opt[2:]} of one candidate, "
                                   f"got {len(candidate_ids)} candidates")
    refs = load_references(reference_ids, tracking_uri)
    for cid in candidate_ids:
        cand, latest = load_candidate(crit, refs, cid, tracking_uri, allow_cross_workload)
        pair = pair_for(crit, cand, refs.runs, tracking_uri, latest, pair_id, twin_id)
        a, evidence = assess_with_evidence(crit, refs.runs, cand, latest,
                                           allow_cross_workload,
                                           gradchecks_for(crit, cand, tracking_uri), pair)
        names = {r.run_id: r.tags.get(schema.TAG_RUN_NAME, "") for r in [*refs.runs, cand]}
        yield Assessed(a, evidence, cand.hardware, names)


def assess_ids(crit: CriteriaFile, reference_ids: Sequence[str], candidate_id: str,
               tracking_uri: str | None = None, allow_cross_workload: bool = False,
               pair_id: str | None = None, twin_id: str | None = None
               ) -> tuple[Assessment, dict[str, Any]]:
    """Load the runs by id and assess; returns the assessment and its evidence document.
    ``pair_id``: the candidate's same-seed reference run (``refrun accept --pair``),
    overriding what its tags declare; ``twin_id``: its precision twin (``--twin``)."""
    refs, cand, latest = load_for_assessment(crit, reference_ids, candidate_id, tracking_uri,
                                             allow_cross_workload)
    pair = pair_for(crit, cand, refs, tracking_uri, latest, pair_id, twin_id)
    return assess_with_evidence(crit, refs, cand, latest, allow_cross_workload,
                                gradchecks_for(crit, cand, tracking_uri), pair)
