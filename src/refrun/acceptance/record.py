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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from refrun import mlflow_ui, schema
from refrun.acceptance.criteria import CriteriaFile
from refrun.acceptance.results import Assessment
from refrun.errors import RefrunInputError
from refrun.recording.session import start_run
from refrun.store.client import client as store_client

TAG_PREFIX = "refrun.acceptance."
TAG_VERDICT = schema.TAG_ACCEPTANCE_VERDICT
TAG_HIGHEST = schema.TAG_ACCEPTANCE_HIGHEST
TAG_CRITERIA_SHA = TAG_PREFIX + "criteria_sha256"
TAG_EVIDENCE_SHA = TAG_PREFIX + "evidence_sha256"
TAG_CRITERIA_FILE = TAG_PREFIX + "criteria_file"
ARTIFACT_ASSESSMENT = "refrun/assessment.json"
ARTIFACT_EVIDENCE = "refrun/evidence.json"
ARTIFACT_CRITERIA = "refrun/criteria.toml"
ARTIFACT_SIGNOFF = "refrun/signoff.json"


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


def record_assessment(a: Assessment, crit: CriteriaFile, evidence: dict[str, Any],
                      tracking_uri: str | None = None,
                      spool_dir: str | os.PathLike[str] | None = None,
                      candidate_hardware: str | None = None) -> str:
    """Record ``a`` as a new comparison run; returns its MLflow run id."""
    tags = {schema.TAG_COMPARED_REFERENCE: ",".join(a.reference_ids),
            schema.TAG_COMPARED_CANDIDATE: a.candidate_id, **level_tags(a)}
    with tempfile.TemporaryDirectory(prefix="refrun-accept-") as tmp:
        crit_copy = Path(tmp) / "criteria.toml"
        crit_copy.write_text(crit.text, encoding="utf-8", newline="")
        with start_run(workload=a.workload or "acceptance", role="comparison",
                       hardware=candidate_hardware, backend="acceptance", tags=tags,
                       run_name=mlflow_ui.comparison_run_name(
                           "accept", a.candidate_id[:8], len(a.reference_ids), a.verdict),
                       tracking_uri=tracking_uri, spool_dir=spool_dir,
                       snapshot_environment=False) as run:
            if run.run_id is not None:  # names and links from the store (else: spooled)
                run.set_tags(mlflow_ui.comparison_ui_tags(
                    store_client(run.tracking_uri), run.run_id, "accept", ui_verdict(a)))
            run.log_json(ARTIFACT_ASSESSMENT, a.to_dict())
            run.log_json(ARTIFACT_EVIDENCE, evidence)
            run.log_artifact(crit_copy, ARTIFACT_CRITERIA)
    if run.run_id is None:
        raise RefrunInputError(f"tracking store {run.tracking_uri} unreachable: the "
                               f"assessment is spooled as {run.local_id} (`refrun sync`)")
    return run.run_id


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
    except MlflowException as exc:
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

        assessment = json.loads(read(ARTIFACT_ASSESSMENT) or b"{}")
        evidence = json.loads(read(ARTIFACT_EVIDENCE) or b"{}")
        crit = read(ARTIFACT_CRITERIA) or b""
        signoff_raw = read(ARTIFACT_SIGNOFF)
    return Recorded(comparison_id, dict(run.data.tags), assessment, evidence, crit,
                    json.loads(signoff_raw) if signoff_raw else None)
