"""The gradient-check runs recorded for a candidate: evidence of the ``gradcheck`` criterion.

A run of role ``gradcheck`` (:func:`refrun.gradcheck.record.record_gradcheck`) names the
candidate run it checked in the tag ``refrun.gradcheck.candidate``; it lives in the
candidate's experiment (the workload).  The lookup reads tags and step-0 metrics only
(no artifact), so it costs one MLflow search.
"""

from __future__ import annotations

from dataclasses import dataclass

from refrun import schema
from refrun.comparison import RunData

PASSED_SUFFIX = "/passed"


@dataclass(frozen=True)
class GradcheckRun:
    """One recorded gradient-check run, as the criterion reads it."""

    run_id: str
    status: str  # MLflow run status (FINISHED, FAILED, RUNNING, KILLED), DELETED if deleted
    passed: bool | None  # tag refrun.gradcheck.passed; None when the tag is missing
    failed: list[str]  # labels of failing checks (tag refrun.gradcheck.failed)
    labels: list[str]  # labels of every recorded check (metrics gradcheck/<label>/passed)

    @property
    def ok(self) -> bool:
        """Finished, and its passed tag says true."""
        return self.status == "FINISHED" and self.passed is True


def labels_of(metric_names: list[str]) -> list[str]:
    """Check labels from metric names ``gradcheck/<label>/passed``, sorted."""
    p, s = schema.GRADCHECK_METRIC_PREFIX, PASSED_SUFFIX
    return sorted(m[len(p):-len(s)] for m in metric_names
                  if m.startswith(p) and m.endswith(s) and len(m) > len(p) + len(s))


def find_gradchecks(candidate: RunData, tracking_uri: str | None = None
                    ) -> list[GradcheckRun]:
    """Every gradcheck run of the candidate's experiment whose
    ``refrun.gradcheck.candidate`` tag is the candidate's run id, oldest first (any
    status, deleted ones included: a run that did not finish, or a failed check deleted
    afterwards, is reported, never skipped)."""
    from mlflow.entities import ViewType

    from refrun.store.client import client as store_client

    client = store_client(tracking_uri)
    exp = candidate.experiment_id or client.get_run(candidate.run_id).info.experiment_id
    filt = (f"tags.`{schema.TAG_ROLE}` = 'gradcheck' and "
            f"tags.`{schema.TAG_GRADCHECK_CANDIDATE}` = '{candidate.run_id}'")
    runs = client.search_runs([exp], filt, run_view_type=ViewType.ALL, max_results=1000,
                              order_by=["attributes.start_time ASC"])
    out = []
    for r in runs:
        tag = r.data.tags.get(schema.TAG_GRADCHECK_PASSED)
        failed = [x for x in r.data.tags.get(schema.TAG_GRADCHECK_FAILED, "").split(",") if x]
        status = "DELETED" if r.info.lifecycle_stage == "deleted" else r.info.status
        out.append(GradcheckRun(r.info.run_id, status,
                                None if tag is None else tag.strip().lower() == "true",
                                failed, labels_of(list(r.data.metrics))))
    return out
