"""Recording a comparison as an MLflow run, so the UI charts the differences by the runs.

The run has role ``comparison``, tags ``refrun.compared.reference`` (comma-separated run
ids) and ``refrun.compared.candidate``, metrics ``diff/<metric>`` (candidate - reference,
metric units) and ``reldiff/<metric>``, and the comparison JSON as artifact
``refrun/comparison.json``.  Its ``refrun/curves.parquet`` artifact holds ``diff/*`` and
``reldiff/*`` at every aligned step; MLflow's metric history holds the bounded view of
:func:`refrun.util.thinning.bounded_view` (every aligned step when there are at most
``max_points``; otherwise the first and last aligned step and each bucket's first point,
extremes and first non-finite value, so a spike is never lost).

Written directly (:mod:`refrun.store.complete`): FINISHED when the call returns, at a cost
that no longer grows with the number of aligned steps beyond the view.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from refrun import schema
from refrun.comparison.engine import Comparison
from refrun.identity import canonical_hardware
from refrun.store import mlflow_ui
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    string_tags,
    write_complete_run,
)
from refrun.util.thinning import MLFLOW_MAX_POINTS

if TYPE_CHECKING:
    from refrun.store.surface import StoreClient

ARTIFACT_COMPARISON = schema.ARTIFACT_COMPARISON


def difference_columns(comparison: Comparison) -> tuple[pd.Categorical, np.ndarray,
                                                           np.ndarray]:
    """``(metric names, steps, values)`` of every ``diff/<m>`` and ``reldiff/<m>`` point
    at every aligned step, metric by metric."""
    names: list[str] = []
    codes, steps, values = [], [], []
    for metric, mc in comparison.metrics.items():
        f = mc.frame
        s = f["step"].to_numpy(np.int64)
        for prefix, col in ((schema.DIFF_PREFIX, "diff"), (schema.RELDIFF_PREFIX, "reldiff")):
            codes.append(np.full(len(s), len(names), dtype=np.int32))
            names.append(prefix + metric)
            steps.append(s)
            values.append(f[col].to_numpy(np.float64))
    if not names:
        return (pd.Categorical([]), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))
    return (pd.Categorical.from_codes(np.concatenate(codes), categories=names),
            np.concatenate(steps), np.concatenate(values))


def record_comparison(comparison: Comparison, tracking_uri: str | None = None,
                      spool_dir: str | os.PathLike[str] | None = None,
                      run_name: str | None = None,
                      max_points: int = MLFLOW_MAX_POINTS) -> str:
    """Record ``comparison`` as a FINISHED run and return its MLflow run id.

    ``max_points``: most points per ``diff/*`` / ``reldiff/*`` metric in MLflow's metric
    history; every aligned step is in the run's curves artifact and the comparison's
    frames.  ``spool_dir`` is accepted for compatibility and unused.  Raises
    :class:`~refrun.errors.RefrunInputError` when the store cannot be written.
    """
    del spool_dir
    cand = comparison.candidate
    ref0 = comparison.reference[0]
    # A legacy free-text hardware tag must not stop recording: the canonical name when
    # there is one, else unset, and the stored text kept in its own tag.
    hardware = canonical_hardware(cand.hardware)
    tags = identity_tags(cand.workload or ref0.workload or "comparison", "comparison",
                         hardware=hardware, backend="comparison")
    if cand.hardware and cand.hardware != hardware:
        tags[schema.TAG_COMPARED_CANDIDATE_HARDWARE] = cand.hardware
    tags.update(string_tags({
        schema.TAG_COMPARED_REFERENCE: ",".join(comparison.reference_ids),
        schema.TAG_COMPARED_CANDIDATE: cand.run_id,
        schema.TAG_COMPARED_METRICS: ",".join(comparison.metrics),
    }))
    name = run_name or mlflow_ui.comparison_run_name(
        "compare", cand.tags.get(schema.TAG_RUN_NAME) or cand.run_id[:8], len(comparison.reference))
    table = curves_table(*difference_columns(comparison), now_ms())
    params = string_tags({f"option.{k}": v for k, v in vars(comparison.options).items()})
    keep_name = run_name is not None

    def ui_tags(client: StoreClient, run_id: str) -> dict[str, str]:
        # Name and description (they link to the run's own id), set with the end-of-run
        # tags through the client already open: no second client, no writes after FINISHED.
        ui = mlflow_ui.comparison_ui_tags(client, run_id, "compare")
        if keep_name:
            ui.pop(schema.TAG_RUN_NAME)
        return ui

    return write_complete_run(CompleteRun(
        experiment=tags[schema.TAG_WORKLOAD], tags=tags, table=table, params=params,
        run_name=name, json_artifacts={ARTIFACT_COMPARISON: comparison.to_dict()},
        max_points=max_points, tags_for_run=ui_tags,
    ), tracking_uri)
