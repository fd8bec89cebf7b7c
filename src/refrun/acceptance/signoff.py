"""Sign-off of an assessment and its verification.

:func:`sign_off` re-assesses the candidate with the recorded criteria on the runs' current
data; only when the evidence digest still equals the recorded one does it store the
sign-off: who, when (UTC), the decision, the criteria file's SHA-256, the run ids and the
evidence digest.  Accepting a candidate whose assessment did not pass requires
``override=True``, which is recorded.

:func:`verify` recomputes everything and reports exactly what changed since the sign-off:
the criteria (the stored copy, or a file given to compare), the runs (status, tags, params,
latest metric values, each curve) and the evidence (each assessed value).

The digests detect change; they are not a cryptographic signature against someone who can
rewrite the whole store.  Keep the evidence digest in your ticket as well.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from refrun import schema
from refrun._version import __version__
from refrun.acceptance.alignment import recorded_axis, with_axis
from refrun.acceptance.assess import (
    assess,
    gradchecks_for,
    load_for_assessment,
    pair_for,
    pair_run,
    twin_run,
)
from refrun.acceptance.criteria import CriteriaFile, parse_criteria
from refrun.acceptance.evidence import (
    FORMAT_VERSION,
    _change,
    _leaf_diffs,
    build_evidence,
    diff_evidence,
    result_as_version,
    sha256_of,
)
from refrun.acceptance.record import (
    ARTIFACT_ASSESSMENT,
    ARTIFACT_CRITERIA,
    ARTIFACT_EVIDENCE,
    ARTIFACT_SIGNOFF,
    TAG_CRITERIA_SHA,
    TAG_EVIDENCE_SHA,
    TAG_HIGHEST,
    TAG_PREFIX,
    TAG_VERDICT,
    Recorded,
    client_for,
    load_recorded,
)
from refrun.acceptance.results import PASS, Assessment
from refrun.acceptance.signer import UNAUTHENTICATED, check_by, current_user, resolve_signer
from refrun.errors import RefrunInputError
from refrun.util.printable import escape

TAG_SIGNOFF_PREFIX = schema.TAG_SIGNOFF_PREFIX
DECISIONS = ("accept", "reject")


@dataclass(frozen=True)
class SignOff:
    """A recorded sign-off (also the content of ``refrun/signoff.json``)."""

    comparison_id: str
    decision: str
    by: str
    time_utc: str
    note: str
    override: bool
    assessment_verdict: str
    highest_level: str | None
    criteria_sha256: str
    criteria_file: str
    reference_ids: list[str]
    candidate_id: str
    evidence_sha256: str
    # Canonical-JSON digest of refrun/assessment.json and the refrun.acceptance.* tags as
    # signed: verify names an edit of either (empty in sign-offs of older versions).
    assessment_sha256: str = ""
    acceptance_tags: dict[str, str] = field(default_factory=dict)
    # How ``by`` is known: the tracking server's authenticated user ("mlflow-basic-auth"),
    # or typed by hand ("unauthenticated"); by_declared keeps what --by said.
    authentication: str = UNAUTHENTICATED
    by_declared: str = ""
    # The calibration the thresholds rest on (refrun.acceptance.calibration); None when the
    # criteria file has no [calibration] table.
    calibration_sha256: str | None = None
    refrun_version: str = __version__
    record_sha256: str = ""  # digest of every field above

    def body(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("record_sha256")
        return d


@dataclass(frozen=True)
class Verification:
    """The result of :func:`verify`: ``ok`` when nothing changed."""

    comparison_id: str
    signoff: dict[str, Any]
    changes: list[dict[str, str]] = field(default_factory=list)
    current_evidence_sha256: str | None = None

    @property
    def ok(self) -> bool:
        return not self.changes

    def text(self) -> str:
        """What ``refrun verify`` prints.  Every value read from the store is escaped
        (:func:`refrun.util.printable.escape`): a stored newline or terminal escape can neither
        add a line nor hide one."""
        s = self.signoff
        head = f"sign-off of {escape(self.comparison_id)}: {signed_by(s)}" + (
            " (override)" if s.get("override") else "")
        if self.ok:
            return head + "\nverified: runs, criteria and evidence unchanged " \
                          f"(evidence sha256 {escape(s.get('evidence_sha256'))})"
        lines = [head, f"CHANGED since sign-off ({len(self.changes)} change(s)):"]
        lines += [f"  [{escape(c['what'])}] {escape(c['key'])}: {escape(c['change'])}"
                  for c in self.changes]
        return "\n".join(lines)


def signed_by(s: dict[str, Any]) -> str:
    """``accept by NAME (authentication) at TIME`` of a recorded sign-off, escaped; the
    authentication marker is always shown (a record without one is "unauthenticated")."""
    return (f"{escape(s.get('decision'))} by {escape(s.get('by'))} "
            f"({escape(s.get('authentication') or UNAUTHENTICATED)}) at "
            f"{escape(s.get('time_utc'))}")


def signoff_from_tags(tags: dict[str, str]) -> dict[str, Any] | None:
    """What the ``refrun.signoff.*`` tags of a run say about its sign-off (the fields of
    :class:`SignOff` they carry), or None when it has none."""
    found = {k.removeprefix(TAG_SIGNOFF_PREFIX): v for k, v in tags.items()
             if k.startswith(TAG_SIGNOFF_PREFIX)}
    if not found:
        return None
    found["override"] = found.get("override") == "true"
    return found


def run_problems(rec: Recorded, tracking_uri: str | None) -> list[dict[str, str]]:
    """The runs an assessment names (its comparison run, references, candidate, pair and
    twin) that are deleted in the store (MLflow keeps a deleted run readable until garbage
    collection, so re-assessing alone would not notice) or not there at all."""
    from refrun.store.client import refusals

    a = rec.assessment
    pair = a.get("pair") or {}
    named = [("comparison run", rec.run_id)]
    named += [("reference", str(r)) for r in a.get("reference", [])]
    named += [("candidate", str(a.get("candidate") or "")), ("pair", pair.get("run_id")),
              ("twin", (pair.get("twin") or {}).get("run_id"))]
    client = client_for(tracking_uri)
    out: list[dict[str, str]] = []
    for role, run_id in named:
        if not run_id:
            continue
        try:
            stage = client.get_run(run_id).info.lifecycle_stage
        except refusals():
            out.append({"what": "runs", "key": f"{role} {run_id}",
                        "change": "missing from the store"})
            continue
        if stage == "deleted":
            out.append({"what": "runs", "key": f"{role} {run_id}",
                        "change": "deleted (`mlflow runs delete`); `mlflow runs restore` "
                                  "brings it back"})
    return out


def missing_artifacts(rec: Recorded) -> list[dict[str, str]]:
    """Artifacts a signed-off assessment is verified against that are not on its run."""
    missing = [name for name, present in ((ARTIFACT_EVIDENCE, bool(rec.evidence)),
                                          (ARTIFACT_CRITERIA, bool(rec.criteria_bytes)))
               if not present]
    return [{"what": "artifacts", "key": name, "change": "missing from the comparison run"}
            for name in missing]


def _stored_criteria(rec: Recorded) -> CriteriaFile:
    path = rec.assessment.get("criteria", {}).get("path") or "criteria.toml"
    try:
        return parse_criteria(rec.criteria_bytes.decode("utf-8"), path,
                              sha256=hashlib.sha256(rec.criteria_bytes).hexdigest())
    except RefrunInputError as exc:  # the stored copy, not the file at that path now
        raise RefrunInputError(f"comparison run {rec.run_id}: its stored copy "
                               f"{ARTIFACT_CRITERIA} does not load: {exc}") from exc


def _reassess(rec: Recorded, crit: CriteriaFile, tracking_uri: str | None
              ) -> tuple[Assessment, dict[str, Any]]:
    refs_ids = list(rec.assessment.get("reference", []))
    cand_id = rec.assessment.get("candidate", "")
    # A cross-workload assessment was allowed explicitly (and says so): re-assess alike.
    cross = bool(rec.assessment.get("cross_workload"))
    crit = with_axis(crit, recorded_axis(rec.assessment))  # the basis it was assessed on
    refs, cand, latest = load_for_assessment(crit, refs_ids, cand_id, tracking_uri, cross)
    # A pair given on the command line (--pair) is used again; one found from the
    # candidate's tags is looked up again (a changed store shows as changed evidence).
    recorded_pair = rec.assessment.get("pair") or {}
    recorded_twin = recorded_pair.get("twin") or {}
    pair = pair_for(crit, cand, refs, tracking_uri, latest,
                    recorded_pair.get("run_id") if recorded_pair.get("source") == "--pair"
                    else None,
                    recorded_twin.get("run_id") if recorded_twin.get("source") == "--twin"
                    else None)
    a = assess(crit, refs, cand, latest, cross,
               gradchecks=gradchecks_for(crit, cand, tracking_uri), pair=pair)
    # Recomputed in the recorded evidence's format version (older evidence lacks newer keys).
    version = str((rec.evidence or {}).get("format_version", FORMAT_VERSION))
    return a, build_evidence(crit.sha256, a.results, refs, cand, latest, version,
                             pair=pair_run(pair, refs), twin=twin_run(pair))


# What a reader of the verdict sees, compared field by field.  ``created_utc`` is when the
# assessment ran (a re-assessment runs now); the criteria path is where the file was read.
_NOT_COMPARED = ("created_utc",)


def _readable(assessment: dict[str, Any]) -> dict[str, Any]:
    """The recorded assessment keyed for a readable diff (results by id, levels by name)."""
    d = {k: v for k, v in assessment.items() if k not in _NOT_COMPARED}
    d["results"] = {r.get("id"): r for r in d.get("results") or []}
    d["levels"] = {lv.get("level"): lv for lv in d.get("levels") or []}
    d["measurements"] = {m.get("metric"): m for m in d.get("measurements") or []}
    return d


def assessment_changes(recorded: dict[str, Any], current: Assessment,
                       version: str | None = None) -> list[dict[str, str]]:
    """Every field of the recorded ``refrun/assessment.json`` that differs from the same
    assessment recomputed now (verdict, highest level, levels, each result and its reason,
    measurements, warnings ...), as ``{"what": "assessment", "key", "change"}`` with
    ``change`` "recomputed -> recorded"."""
    fresh = json.loads(json.dumps(current.to_dict()))  # the form it is stored in
    if "performance" not in recorded:  # recorded before a migration's L4 figures existed
        fresh.pop("performance", None)
    if version is not None:  # recorded before later evidence keys existed: compare alike
        fresh["results"] = [result_as_version(r, version) for r in fresh.get("results", [])]
        if int(version) < 3:  # the "L4 held back" warning came with version 3
            fresh["warnings"] = [w for w in fresh.get("warnings", [])
                                 if not w.startswith("L4 held back")]
    # "supported -> recorded": what the data gives, then what the store says now.
    return [{"what": "assessment", "key": f"{ARTIFACT_ASSESSMENT}: " + ".".join(path),
             "change": _change(x, y)}
            for path, x, y in _leaf_diffs(_readable(fresh), _readable(recorded), ())]


def expected_tags(assessment: dict[str, Any]) -> dict[str, str]:
    """The ``refrun.acceptance.*`` tags the recorded assessment implies."""
    tags = {TAG_VERDICT: str(assessment.get("verdict")),
            TAG_HIGHEST: assessment.get("highest_level") or "none",
            TAG_CRITERIA_SHA: str(assessment.get("criteria", {}).get("sha256")),
            TAG_EVIDENCE_SHA: str(assessment.get("evidence_sha256"))}
    tags.update({TAG_PREFIX + lv["level"]: lv["status"]
                 for lv in assessment.get("levels", []) if "level" in lv})
    return tags


def tag_changes(tags: dict[str, str], expected: dict[str, str]) -> list[dict[str, str]]:
    """Acceptance tags of the comparison run that differ from ``expected`` (what the
    MLflow UI shows beside the run: a rewritten verdict or highest level is named)."""
    return [{"what": "tags", "key": f"tag {k}", "change": f"{v} -> {tags.get(k)}"}
            for k, v in sorted(expected.items()) if tags.get(k) != v]


def _recorded_changes(rec: Recorded, current: Assessment) -> list[dict[str, str]]:
    """What the recorded assessment and its tags say that the data no longer supports."""
    version = str((rec.evidence or {}).get("format_version", FORMAT_VERSION))
    return [*assessment_changes(rec.assessment, current, version),
            *tag_changes(rec.tags, expected_tags(json.loads(json.dumps(current.to_dict()))))]


def sign_off(comparison_id: str, decision: str, by: str | None, note: str = "",
             override: bool = False, tracking_uri: str | None = None) -> SignOff:
    """Record a sign-off on the comparison run (see the module docstring).  ``by``: the
    signer's name when the store does not authenticate users; with MLflow's
    authentication the authenticated user is recorded and ``by`` is only kept beside it
    (:mod:`refrun.acceptance.signer`)."""
    if decision not in DECISIONS:
        raise RefrunInputError(f"--decision {decision!r}: not one of {', '.join(DECISIONS)}")
    check_by(by)  # before the store is read: a forged name is refused whatever the store
    client = client_for(tracking_uri)
    user = current_user(client.tracking_uri)  # first: refused credentials say so at once
    rec = load_recorded(comparison_id, tracking_uri)
    signer = resolve_signer(client.tracking_uri, user, by, client.get_run(
        comparison_id).info.experiment_id, f"comparison {comparison_id}")
    if rec.signoff is not None:
        raise RefrunInputError(f"comparison {comparison_id}: already signed off "
                               f"({signed_by(rec.signoff)}); record a new assessment")
    tagged = signoff_from_tags(rec.tags)
    if tagged is not None:  # its record deleted: a new one must not replace the old tags
        raise RefrunInputError(f"comparison {comparison_id}: its tags name a sign-off "
                               f"({signed_by(tagged)}) whose {ARTIFACT_SIGNOFF} is missing; "
                               "record a new assessment")
    recorded_sha = rec.assessment.get("criteria", {}).get("sha256")
    crit = _stored_criteria(rec)
    if crit.sha256 != recorded_sha:
        raise RefrunInputError(f"comparison {comparison_id}: the stored criteria copy changed "
                               f"since the assessment ({recorded_sha} -> {crit.sha256})")
    current, evidence = _reassess(rec, crit, tracking_uri)
    digest = sha256_of(evidence)
    if digest != rec.assessment.get("evidence_sha256"):
        changes = diff_evidence(rec.evidence, evidence)
        listed = "; ".join(f"{c['key']}: {c['change']}" for c in changes[:5])
        raise RefrunInputError(f"comparison {comparison_id}: the evidence changed since the "
                               f"assessment ({listed}); run `refrun accept` again")
    # The verdict signed is the one the data supports: an edited assessment.json or an
    # edited verdict tag is refused, never signed.
    edited = _recorded_changes(rec, current)
    if edited:
        listed = "; ".join(f"{c['key']}: {c['change']}" for c in edited[:5])
        raise RefrunInputError(f"comparison {comparison_id}: the recorded assessment "
                               f"differs from its evidence ({listed}); run `refrun accept` "
                               "again")
    verdict = current.verdict
    if decision == "accept" and verdict != PASS and not override:
        raise RefrunInputError(f"comparison {comparison_id}: the assessment verdict is "
                               f"{verdict!r}; accepting it needs --override (recorded)")
    body = SignOff(
        comparison_id=comparison_id, decision=decision, by=signer.name,
        authentication=signer.authentication, by_declared=signer.declared,
        time_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        note=note, override=bool(override), assessment_verdict=verdict,
        highest_level=rec.assessment.get("highest_level"), criteria_sha256=crit.sha256,
        criteria_file=rec.assessment.get("criteria", {}).get("path", ""),
        reference_ids=list(rec.assessment.get("reference", [])),
        candidate_id=rec.assessment.get("candidate", ""), evidence_sha256=digest,
        assessment_sha256=sha256_of(rec.assessment),
        calibration_sha256=current.calibration_sha256,
        acceptance_tags={k: rec.tags.get(k, "") for k in sorted(rec.tags)
                         if k.startswith(TAG_PREFIX)})
    so = SignOff(**{**body.body(), "record_sha256": sha256_of(body.body())})
    _store(so, tracking_uri)
    return so


def _tags(so: SignOff) -> dict[str, str]:
    return {TAG_SIGNOFF_PREFIX + k: str(v) for k, v in (
        ("decision", so.decision), ("by", so.by), ("authentication", so.authentication),
        ("time_utc", so.time_utc),
        ("override", str(so.override).lower()), ("evidence_sha256", so.evidence_sha256),
        ("criteria_sha256", so.criteria_sha256), ("record_sha256", so.record_sha256))}


def _store(so: SignOff, tracking_uri: str | None) -> None:
    client = client_for(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="refrun-signoff-") as tmp:
        p = Path(tmp) / Path(ARTIFACT_SIGNOFF).name
        p.write_text(json.dumps(asdict(so), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        client.log_artifact(so.comparison_id, str(p), str(Path(ARTIFACT_SIGNOFF).parent))
    for k, v in _tags(so).items():
        client.set_tag(so.comparison_id, k, v)


def verify(comparison_id: str, tracking_uri: str | None = None,
           criteria_path: str | Path | None = None) -> Verification:
    """Recompute the evidence of a signed-off comparison and list every change."""
    rec = load_recorded(comparison_id, tracking_uri)
    if rec.signoff is None:
        tagged = signoff_from_tags(rec.tags)
        if tagged is None:
            raise RefrunInputError(f"comparison {comparison_id}: not signed off "
                                   "(`refrun signoff --comparison ID ...`)")
        # The tags still say who signed: the record was removed, not never made.
        return Verification(comparison_id, tagged, [{
            "what": "signoff", "key": ARTIFACT_SIGNOFF,
            "change": f"missing from the run, while its {TAG_SIGNOFF_PREFIX}* tags still "
                      f"name the sign-off ({signed_by(tagged)}): the record was deleted"}])
    s = rec.signoff
    # Runs of the assessment deleted (`mlflow runs delete`) or gone, and artifacts of the
    # assessment missing: named, whatever the recomputed evidence says.
    changes: list[dict[str, str]] = [*run_problems(rec, tracking_uri),
                                     *missing_artifacts(rec)]
    body = {k: v for k, v in s.items() if k != "record_sha256"}
    if sha256_of(body) != s.get("record_sha256"):
        changes.append({"what": "signoff", "key": ARTIFACT_SIGNOFF,
                        "change": "the sign-off record was edited (record digest differs)"})
    for k, v in _tags(SignOff(**s)).items():
        if rec.tags.get(k) != v:
            changes.append({"what": "signoff", "key": f"tag {k}",
                            "change": f"{v} -> {rec.tags.get(k)}"})
    crit = _stored_criteria(rec)
    if crit.sha256 != s["criteria_sha256"]:
        changes.append({"what": "criteria", "key": "stored copy refrun/criteria.toml",
                        "change": f"sha256 {s['criteria_sha256']} -> {crit.sha256}"})
    if criteria_path is not None:
        p = Path(criteria_path)
        try:
            cur = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError as exc:
            raise RefrunInputError(f"--criteria {p}: cannot read ({exc.strerror})") from exc
        if cur != s["criteria_sha256"]:
            changes.append({"what": "criteria", "key": f"file {p}",
                            "change": f"sha256 {s['criteria_sha256']} -> {cur} (the file "
                                      "differs from the signed criteria)"})
    if sha256_of(rec.evidence) != s["evidence_sha256"]:
        changes.append({"what": "evidence", "key": f"stored {ARTIFACT_EVIDENCE}",
                        "change": "differs from the signed evidence digest"})
    if s.get("assessment_sha256") and sha256_of(rec.assessment) != s["assessment_sha256"]:
        changes.append({"what": "assessment", "key": f"stored {ARTIFACT_ASSESSMENT}",
                        "change": "differs from the signed assessment digest"})
    signed_tags = s.get("acceptance_tags") or {}
    now_tags = {k: v for k, v in rec.tags.items() if k.startswith(TAG_PREFIX)}
    changes += [{"what": "tags", "key": f"tag {k}",
                 "change": f"{signed_tags.get(k)} -> {now_tags.get(k)}"}
                for k in sorted(set(signed_tags) | set(now_tags))
                if signed_tags and signed_tags.get(k) != now_tags.get(k)]
    try:
        assessment, current = _reassess(rec, crit, tracking_uri)
    except RefrunInputError as exc:
        changes.append({"what": "runs", "key": "loading", "change": str(exc)})
        return Verification(comparison_id, s, changes, None)
    if "calibration_sha256" in s and s["calibration_sha256"] != assessment.calibration_sha256:
        changes.append({"what": "calibration", "key": "[calibration] of the criteria",
                        "change": f"{s['calibration_sha256']} -> "
                                  f"{assessment.calibration_sha256}"})
    digest = sha256_of(current)
    if digest == s["evidence_sha256"]:
        # The data still gives the signed evidence, so any difference between the recorded
        # assessment (or its tags) and the one recomputed now is an edit: named field by
        # field (the verdict, a level, a result); tags already listed are not repeated.
        seen = {c["key"] for c in changes}
        changes += [c for c in _recorded_changes(rec, assessment) if c["key"] not in seen]
    else:
        # A changed stored criteria copy is reported once (above); runs and evidence here.
        changes += [c for c in diff_evidence(rec.evidence, current)
                    if c["what"] != "criteria"]
        if not any(c["what"] in ("runs", "evidence") for c in changes):
            changes.append({"what": "evidence", "key": "digest",
                            "change": f"{s['evidence_sha256']} -> {digest}"})
    return Verification(comparison_id, s, changes, digest)


__all__ = ["DECISIONS", "TAG_PREFIX", "SignOff", "Verification", "sign_off", "signed_by", "verify"]
