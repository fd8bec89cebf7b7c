"""Recording an assessment on a comparison run in MLflow, and reading it back.

The comparison run (role ``comparison``, tags ``refrun.compared.reference`` /
``refrun.compared.candidate``) carries:

* tags ``refrun.acceptance.verdict``, ``refrun.acceptance.highest_level``,
  ``refrun.acceptance.L0`` ... ``refrun.acceptance.L4`` (each level's status),
  ``refrun.acceptance.criteria_sha256``, ``refrun.acceptance.evidence_sha256``,
  ``refrun.acceptance.criteria_file``;
* artifacts ``refrun/assessment.json`` (the full assessment), ``refrun/evidence.json``
  (the canonical evidence the digest is computed over) and ``refrun/criteria.toml``
  (the exact bytes of the criteria file used).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refrun import schema
from refrun.acceptance.criteria import CriteriaFile
from refrun.acceptance.results import Assessment
from refrun.errors import RefrunInputError
from refrun.identity import canonical_hardware
from refrun.store import mlflow_ui
from refrun.store.client import client as store_client
from refrun.store.client import refusals
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    write_complete_run,
)

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from refrun.store.surface import StoreClient

TAG_PREFIX = schema.TAG_ACCEPTANCE_PREFIX
TAG_VERDICT = schema.TAG_ACCEPTANCE_VERDICT
TAG_HIGHEST = schema.TAG_ACCEPTANCE_HIGHEST
TAG_CRITERIA_SHA = schema.TAG_ACCEPTANCE_CRITERIA_SHA
TAG_EVIDENCE_SHA = schema.TAG_ACCEPTANCE_EVIDENCE_SHA
TAG_CRITERIA_FILE = schema.TAG_ACCEPTANCE_CRITERIA_FILE
ARTIFACT_ASSESSMENT = schema.ARTIFACT_ASSESSMENT
ARTIFACT_EVIDENCE = schema.ARTIFACT_EVIDENCE
ARTIFACT_CRITERIA = schema.ARTIFACT_CRITERIA
ARTIFACT_SIGNOFF = schema.ARTIFACT_SIGNOFF


def level_tags(a: Assessment) -> dict[str, str]:
    """The tags an assessment sets on its comparison run."""
    tags = {TAG_VERDICT: a.verdict, TAG_HIGHEST: a.highest_level or "none",
            TAG_CRITERIA_SHA: a.criteria_sha256, TAG_EVIDENCE_SHA: a.evidence_sha256,
            TAG_CRITERIA_FILE: Path(a.criteria_path).name}
    tags.update({TAG_PREFIX + lv.level: lv.status for lv in a.levels})
    return tags


def ui_verdict(a: Assessment) -> mlflow_ui.Verdict:
    """The verdict as the comparison run's name and description show it."""
    return mlflow_ui.Verdict(
        a.verdict, a.highest_level,
        tuple((r.id, r.reason) for r in a.results if r.outcome == "fail"),
        tuple(r.id for r in a.results if r.outcome == "not_evaluable"))


def assessment_run(a: Assessment, crit: CriteriaFile, evidence: dict[str, Any],
                   candidate_hardware: str | None = None,
                   run_names: Mapping[str, str] | None = None) -> CompleteRun:
    """The comparison run that records ``a``: identity and level tags, the assessment,
    the evidence and the criteria file's exact bytes, and no points (an assessment is
    a document; its measurements are in ``refrun/assessment.json``).  Its name and
    description (which link to the run's own id) are set as it is finished;
    ``run_names`` (run id -> name) spares looking the compared runs' names up."""
    # A legacy free-text hardware tag must not stop recording (as for a comparison): the
    # canonical name when there is one, and the stored text kept in its own tag.
    hardware = canonical_hardware(candidate_hardware)
    tags = identity_tags(a.workload or "acceptance", "comparison", hardware=hardware,
                         backend="acceptance")
    if candidate_hardware and candidate_hardware != hardware:
        tags[schema.TAG_COMPARED_CANDIDATE_HARDWARE] = candidate_hardware
    tags.update({schema.TAG_COMPARED_REFERENCE: ",".join(a.reference_ids),
                 schema.TAG_COMPARED_CANDIDATE: a.candidate_id, **level_tags(a)})
    verdict = ui_verdict(a)

    def ui_tags(client: StoreClient, run_id: str) -> dict[str, str]:
        return mlflow_ui.comparison_ui_tags(client, run_id, "accept", verdict, run_names)

    return CompleteRun(
        experiment=tags[schema.TAG_WORKLOAD], tags=tags,
        table=curves_table([], [], [], now_ms()),
        run_name=mlflow_ui.comparison_run_name("accept", a.candidate_id[:8],
                                               len(a.reference_ids), a.verdict),
        file_artifacts={
            # The same JSON text the run session wrote (``default=str``, NaN kept): the
            # evidence digest is recomputed from these bytes by `refrun verify`.
            ARTIFACT_ASSESSMENT: _json_bytes(a.to_dict()),
            ARTIFACT_EVIDENCE: _json_bytes(evidence),
            ARTIFACT_CRITERIA: crit.text.encode("utf-8"),
        },
        tags_for_run=ui_tags)


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, default=str).encode("utf-8")


def record_assessment(a: Assessment, crit: CriteriaFile, evidence: dict[str, Any],
                      tracking_uri: str | None = None,
                      spool_dir: str | os.PathLike[str] | None = None,
                      candidate_hardware: str | None = None,
                      run_names: Mapping[str, str] | None = None) -> str:
    """Record ``a`` as a new comparison run, FINISHED when this returns; returns its MLflow
    run id.  ``run_names``: the compared runs' names by run id, when known (else looked
    up).

    Written directly as a complete run (:mod:`refrun.store.complete`): its content is known,
    so no run session, spool or delivery process is involved.  ``spool_dir`` is accepted
    for compatibility and unused.  Raises :class:`RefrunInputError` (one line) when the
    store cannot be written; a run created before the failure is deleted.
    """
    del spool_dir
    return write_complete_run(assessment_run(a, crit, evidence, candidate_hardware,
                                             run_names), tracking_uri)


@dataclass(frozen=True)
class Recorded:
    """An assessment as stored on its comparison run."""

    run_id: str
    tags: dict[str, str]
    assessment: dict[str, Any]
    evidence: dict[str, Any]
    criteria_bytes: bytes
    signoff: dict[str, Any] | None


def client_for(tracking_uri: str | None) -> MlflowClient:
    """The store's client for a reader (:func:`refrun.store.client.client`)."""
    return store_client(tracking_uri)


def load_recorded(comparison_id: str, tracking_uri: str | None = None) -> Recorded:
    """Read the assessment recorded on comparison run ``comparison_id``."""
    client = client_for(tracking_uri)
    try:
        run = client.get_run(comparison_id)
    except refusals() as exc:
        raise RefrunInputError(f"comparison run {comparison_id!r}: not found") from exc
    listed = {f.path for f in client.list_artifacts(comparison_id, "refrun")}
    if ARTIFACT_ASSESSMENT not in listed:
        raise RefrunInputError(f"run {comparison_id}: no recorded assessment "
                               f"({ARTIFACT_ASSESSMENT}); run `refrun accept` first")
    with tempfile.TemporaryDirectory(prefix="refrun-verify-") as tmp:
        def read(name: str) -> bytes | None:
            if name not in listed:
                return None
            return Path(client.download_artifacts(comparison_id, name, tmp)).read_bytes()

        assessment = _object(comparison_id, ARTIFACT_ASSESSMENT, read(ARTIFACT_ASSESSMENT),
                             ASSESSMENT_SHAPE)
        evidence = _object(comparison_id, ARTIFACT_EVIDENCE, read(ARTIFACT_EVIDENCE) or b"{}",
                           EVIDENCE_SHAPE)
        crit = read(ARTIFACT_CRITERIA) or b""
        signoff_raw = read(ARTIFACT_SIGNOFF)
    _fields(comparison_id, ARTIFACT_ASSESSMENT + ": criteria", assessment["criteria"],
            {"sha256": str, "path": str})
    for key in ("results", "levels", "measurements"):
        if any(not isinstance(x, dict) for x in assessment.get(key) or []):
            raise _damaged(comparison_id, ARTIFACT_ASSESSMENT, f"{key}: not a list of objects")
    try:
        crit.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _damaged(comparison_id, ARTIFACT_CRITERIA, f"not UTF-8 text ({exc.reason} at "
                       f"byte {exc.start})") from exc
    signoff = None
    if signoff_raw is not None:
        signoff = _object(comparison_id, ARTIFACT_SIGNOFF, signoff_raw, SIGNOFF_SHAPE,
                          closed=True)
    return Recorded(comparison_id, dict(run.data.tags), assessment, evidence, crit, signoff)


# The form of the recorded artifacts as refrun writes them: key -> type (a tuple: any of
# these; a key in REQUIRED must be there).  Checked when they are read back, so a damaged
# or hand-edited artifact is one line naming it (exit 2), never a traceback (issue 55).
_Shape = dict[str, "type | tuple[type, ...]"]
ASSESSMENT_SHAPE: _Shape = {
    "reference": list, "candidate": str, "criteria": dict, "verdict": str,
    "highest_level": (str, type(None)), "evidence_sha256": str, "results": list,
    "levels": list, "measurements": list, "warnings": list, "pair": (dict, type(None)),
    "cross_workload": (str, bool, type(None))}
ASSESSMENT_REQUIRED = ("reference", "candidate", "criteria", "evidence_sha256")
EVIDENCE_SHAPE: _Shape = {"format_version": (str, int), "criteria_sha256": (str, type(None)),
                          "runs": dict, "results": dict}
SIGNOFF_SHAPE: _Shape = {
    "comparison_id": str, "decision": str, "by": str, "time_utc": str, "note": str,
    "override": bool, "assessment_verdict": str, "highest_level": (str, type(None)),
    "criteria_sha256": str, "criteria_file": str, "reference_ids": list,
    "candidate_id": str, "evidence_sha256": str, "assessment_sha256": str,
    "acceptance_tags": dict, "authentication": str, "by_declared": str,
    "calibration_sha256": (str, type(None)), "refrun_version": str, "record_sha256": str}
SIGNOFF_REQUIRED = ("comparison_id", "decision", "by", "time_utc", "note", "override",
                    "assessment_verdict", "highest_level", "criteria_sha256",
                    "criteria_file", "reference_ids", "candidate_id", "evidence_sha256")
_REQUIRED = {ARTIFACT_ASSESSMENT: ASSESSMENT_REQUIRED, ARTIFACT_SIGNOFF: SIGNOFF_REQUIRED}


def _damaged(run_id: str, name: str, why: str) -> RefrunInputError:
    return RefrunInputError(f"comparison run {run_id}: {name}: {why}; the recorded artifact "
                            "is damaged or was edited (record the assessment again with "
                            "`refrun accept`)")


def _object(run_id: str, name: str, raw: bytes | None, shape: _Shape, *,
            closed: bool = False) -> dict[str, Any]:
    """The JSON object of artifact ``name``, checked against ``shape`` (``closed``: no
    other keys); a one-line :class:`RefrunInputError` naming it otherwise."""
    try:
        doc = json.loads((raw or b"").decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _damaged(run_id, name, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
                       ) from exc
    except ValueError as exc:  # json.JSONDecodeError, a RecursionError's ValueError kin
        raise _damaged(run_id, name, f"not JSON ({exc})") from exc
    except RecursionError as exc:
        raise _damaged(run_id, name, "JSON nested too deep") from exc
    if not isinstance(doc, dict):
        raise _damaged(run_id, name, f"a JSON {type(doc).__name__}, not an object")
    missing = [k for k in _REQUIRED.get(name, ()) if k not in doc]
    if missing:
        raise _damaged(run_id, name, f"no {', '.join(missing)}")
    if closed and set(doc) - set(shape):
        raise _damaged(run_id, name, f"unknown key {sorted(set(doc) - set(shape))[0]!r}")
    _fields(run_id, name, doc, shape)
    return doc


def _fields(run_id: str, name: str, doc: Any, shape: _Shape) -> None:
    if not isinstance(doc, dict):
        raise _damaged(run_id, name, f"a JSON {type(doc).__name__}, not an object")
    for key, want in shape.items():
        if key in doc and not isinstance(doc[key], want):
            raise _damaged(run_id, name, f"{key}: a {type(doc[key]).__name__} where refrun "
                           "writes " + (want.__name__ if isinstance(want, type) else
                                        " or ".join(t.__name__ for t in want)))
