"""What a comparison run carries so that MLflow's own UI compares candidates usefully.

MLflow's run table and compare view show tags as columns and single-valued metrics as
bars/parallel coordinates.  ``refrun report`` therefore logs onto each comparison run
(names in :mod:`refrun.schema`): the verdict, highest level, failing criteria and the
metric that departs most as tags, and per compared metric its mean/max ``|z|``, fraction
of steps outside the seeds' range and first step out of band (or the mean relative
difference with a single reference) as metrics at step 0.  Select the comparison runs
(``tags."refrun.role" = "comparison"``), press Compare, and chart
``report/mean_abs_z/<metric>``.  Run names and descriptions are left to
:mod:`refrun.store.mlflow_ui`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from refrun import limits, schema
from refrun.keys import key_problem
from refrun.report.assessment import results
from refrun.report.overview import Departure


def summary_tags(deps: Sequence[Departure], assessment: dict[str, Any] | None
                 ) -> dict[str, str]:
    """Tags of the comparison run: verdict, highest level, failing ids, top departure."""
    a = assessment or {}
    tags = {schema.TAG_REPORT_VERDICT: str(a.get("verdict") or "none"),
            schema.TAG_REPORT_HIGHEST_LEVEL: str(a.get("highest_level") or "none")}
    failed = [str(r.get("id")) for r in results(assessment) if r.get("outcome") == "fail"]
    tags[schema.TAG_REPORT_FAILED] = ",".join(failed)[:limits.TAG_VALUE_LENGTH]
    if deps and deps[0].score is not None:
        tags[schema.TAG_REPORT_TOP_DEPARTURE] = deps[0].metric
    return tags


def summary_metrics(deps: Sequence[Departure], assessment: dict[str, Any] | None
                    ) -> dict[str, float]:
    """Single-valued metrics of the comparison run (finite values only; names MLflow
    would refuse are left out)."""
    out: dict[str, float] = {}
    for d in deps:
        vals = {schema.M_REPORT_MEAN_ABS_Z: d.score if d.measure == "mean_abs_z" else None,
                schema.M_REPORT_MEAN_REL_DIFF: d.score if d.measure == "mean_rel_diff"
                else None,
                schema.M_REPORT_MAX_ABS_Z: d.max_abs_z,
                schema.M_REPORT_OUTSIDE: d.fraction_outside,
                schema.M_REPORT_FIRST_OUT: d.first_step}
        for prefix, v in vals.items():
            name = prefix + d.metric
            if v is not None and math.isfinite(float(v)) and key_problem(name) is None:
                out[name] = float(v)
    if assessment is not None:
        rs = results(assessment)
        for name, outcome in ((schema.M_REPORT_CRITERIA_PASSED, "pass"),
                              (schema.M_REPORT_CRITERIA_FAILED, "fail"),
                              (schema.M_REPORT_CRITERIA_NOT_EVALUABLE, "not_evaluable")):
            out[name] = float(sum(1 for r in rs if r.get("outcome") == outcome))
    return out


def log_summary(run_id: str, tracking_uri: str, deps: Sequence[Departure],
                assessment: dict[str, Any] | None) -> None:
    """Set :func:`summary_tags` and log :func:`summary_metrics` on ``run_id`` (one batch)."""
    import time

    from mlflow.entities import Metric, RunTag

    from refrun.store.client import client as store_client

    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in summary_metrics(deps, assessment).items()]
    tags = [RunTag(k, v) for k, v in summary_tags(deps, assessment).items()]
    client = store_client(tracking_uri)
    batch = limits.METRICS_PER_BATCH
    for i in range(0, max(len(metrics), 1), batch):
        client.log_batch(run_id, metrics=metrics[i:i + batch], tags=tags if i == 0 else [])
