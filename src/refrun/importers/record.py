"""Recording validated imported curves as one complete, FINISHED refrun run.

Written directly (:mod:`refrun.store.complete`), not through the live session: the curves
artifact gets every point, MLflow's metric history a bounded spike-preserving view per
metric, and :func:`create_run` returns once the run is FINISHED.  A 1.75M-point file
takes seconds (benchmarks/bench_import.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.importers.curves import ImportedCurves
from refrun.keys import key_problem
from refrun.store.complete import (
    CompleteRun,
    curves_table,
    identity_tags,
    now_ms,
    string_tags,
    write_complete_run,
)
from refrun.util.thinning import MLFLOW_MAX_POINTS

BACKEND = "import"


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def _check_tags(tags: dict[str, Any]) -> None:
    for key in tags:
        problem = key_problem(key, "tag key")
        if problem is not None:
            raise RefrunInputError(f"tags: {problem}")


def create_run(curves: ImportedCurves, *, workload: str, role: str, hardware: str,
               seed: int | None = None, chips: int | None = None,
               global_batch: int | None = None, run_name: str | None = None,
               tracking_uri: str | None = None,
               spool_dir: str | os.PathLike[str] | None = None,
               tags: dict[str, Any] | None = None,
               max_points: int = MLFLOW_MAX_POINTS) -> str:
    """Record validated ``curves`` as a complete, FINISHED refrun run (backend ``import``)
    and return its MLflow run id.

    ``max_points``: most points per metric in MLflow's metric history (the curves
    artifact keeps every point).  ``spool_dir`` is accepted for compatibility and unused:
    imports write the store directly.  Raises :class:`RefrunInputError` for bad identity
    arguments or tag keys before anything is written, and for a store error (a run
    created before it is marked FAILED and deleted).
    """
    del spool_dir
    if not hardware:
        raise RefrunInputError("hardware: a non-empty name is required")
    all_tags = identity_tags(workload, role, hardware=hardware, backend=BACKEND, seed=seed,
                             chips=chips, global_batch=global_batch)
    user_tags = dict(tags or {})
    _check_tags(user_tags)
    if not len(curves):
        raise RefrunInputError(f"{curves.sources[0]}: no points to import")
    f = curves.frame
    # The file's own wall times when it has them (TensorBoard, MLPerf), else the import's.
    stamps = curves.timestamp_ms if curves.timestamp_ms is not None else now_ms()
    table = curves_table(f["metric"].array, f["step"].to_numpy(), f["value"].to_numpy(),
                         stamps)
    all_tags.update({
        # The importing machine is not the one that trained: say where the data came from.
        schema.TAG_DEVICE: f"imported from {curves.format} file",
        schema.TAG_IMPORT_FORMAT: curves.format,
        schema.TAG_IMPORT_SOURCE: ", ".join(p.name for p in curves.sources),
        schema.TAG_IMPORT_SHA256: _sha256(curves.sources),
        **string_tags(user_tags),
    })
    return write_complete_run(CompleteRun(
        experiment=workload, tags=all_tags, table=table, params=dict(curves.params),
        run_name=run_name,  # default: refrun.store.mlflow_ui.default_run_name
        end_tags={schema.TAG_IMPORT_NONFINITE: str(curves.nonfinite)},
        max_points=max_points,
    ), tracking_uri)
