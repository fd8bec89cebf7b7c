"""Recording validated imported curves as one complete, FINISHED refrun run.

An import is not a live run: every point is known before anything is written.  So it
does not go through the session's spool and delivery process (whose cost grows with the
number of points, ~10k points/s into MLflow): the whole long table is written once as
the run's ``refrun/curves.parquet`` artifact (every point), MLflow's metric history gets
only a bounded spike-preserving view per metric (:func:`refrun.thinning.bounded_view`:
first and last step always, each bucket's first point and extremes and its first
non-finite value, every point when there are few), and :func:`create_run` returns once
the run is FINISHED.  A 1.75M-point file takes seconds (benchmarks/bench_import.py).

Identity tags are built by the same function as a recorded run's, so imported runs are
found and compared like any other.  A store error after the run was created marks it
FAILED and deletes it, so nothing half-written is left visible.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pandas as pd
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.importers.curves import ImportedCurves
from refrun.keys import key_problem
from refrun.thinning import MLFLOW_MAX_POINTS, bounded_view
from refrun.tracking import resolve_tracking_uri

try:  # the recording path is moving into refrun.recording (issue 14); either layout
    from refrun.recording.curves import summary_tags, write_curves
except ImportError:  # pragma: no cover - layout before the move
    from refrun.curves import summary_tags, write_curves  # type: ignore[no-redef]
try:
    from refrun.recording.session import _identity_tags as identity_tags
except ImportError:  # pragma: no cover - layout before the move
    from refrun.session import _identity_tags as identity_tags  # type: ignore[no-redef]

BACKEND = "import"
# MLflow's documented log_batch limits.
_METRICS_PER_BATCH = 1000
_TAGS_PER_BATCH = 100


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def _check_identity(workload: str, role: str, hardware: str, seed: int | None,
                    chips: int | None, tags: dict[str, Any]) -> None:
    if not workload or not isinstance(workload, str):
        raise RefrunInputError("workload: a non-empty name is required")
    if role not in schema.ROLES:
        raise RefrunInputError(f"role: {role!r} is not one of {', '.join(schema.ROLES)}")
    if not hardware:
        raise RefrunInputError("hardware: a non-empty name is required")
    for name, val in (("seed", seed), ("chips", chips)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
            raise RefrunInputError(f"{name}: expected an integer, got {val!r}")
    for key in tags:
        problem = key_problem(key, "tag key")
        if problem is not None:
            raise RefrunInputError(f"tags: {problem}")


def curves_table(curves: ImportedCurves, timestamp_ms: int) -> pd.DataFrame:
    """The curves artifact's long table (:mod:`refrun.recording.curves` schema): the
    imported points in logging order, ``seq`` 0, 1, 2 ..., every point stamped with the
    import time (the file carries no times)."""
    f = curves.frame
    return pd.DataFrame({
        "metric": f["metric"],
        "step": f["step"].to_numpy(np.int64),
        "value": f["value"].to_numpy(np.float64),
        "timestamp_ms": np.full(len(f), timestamp_ms, dtype=np.int64),
        "seq": np.arange(len(f), dtype=np.int64),
    })


def mlflow_view(table: pd.DataFrame, max_points: int) -> list[Metric]:
    """The points sent to MLflow's metric history: per metric, in step order (logging
    order within a step), the :func:`~refrun.thinning.bounded_view` of at most about
    ``max_points`` points."""
    out: list[Metric] = []
    codes = table["metric"].cat.codes.to_numpy()
    steps = table["step"].to_numpy()
    values = table["value"].to_numpy()
    stamps = table["timestamp_ms"].to_numpy()
    for i, name in enumerate(table["metric"].cat.categories):
        rows = np.flatnonzero(codes == i)
        if not len(rows):
            continue
        rows = rows[np.argsort(steps[rows], kind="stable")]
        keep = rows[bounded_view(values[rows], max_points)]
        out.extend(Metric(str(name), float(v), int(t), int(s))
                   for s, v, t in zip(steps[keep].tolist(), values[keep].tolist(),
                                      stamps[keep].tolist(), strict=True))
    return out


def _experiment_id(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # created meanwhile by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def create_run(curves: ImportedCurves, *, workload: str, role: str, hardware: str,
               seed: int | None = None, chips: int | None = None,
               run_name: str | None = None, tracking_uri: str | None = None,
               spool_dir: str | os.PathLike[str] | None = None,
               tags: dict[str, Any] | None = None,
               max_points: int = MLFLOW_MAX_POINTS) -> str:
    """Record validated ``curves`` as a complete, FINISHED refrun run (backend ``import``)
    and return its MLflow run id.

    ``max_points``: most points per metric in MLflow's metric history (the curves
    artifact keeps every point).  ``spool_dir`` is accepted for compatibility and unused:
    imports write the store directly.  Raises :class:`RefrunInputError` for bad identity
    arguments or tag keys before anything is written, and for a store error (the
    half-written run is then marked FAILED and deleted).
    """
    del spool_dir
    user_tags = dict(tags or {})
    _check_identity(workload, role, hardware, seed, chips, user_tags)
    if not len(curves):
        raise RefrunInputError(f"{curves.sources[0]}: no points to import")
    now = time.time_ns() // 1_000_000
    table = curves_table(curves, now)
    view = mlflow_view(table, max_points)
    all_tags = identity_tags(workload, role, hardware, BACKEND, seed, chips, None, None,
                             False)
    all_tags.update({
        # The importing machine is not the one that trained: say where the data came from.
        schema.TAG_DEVICE: f"imported from {curves.format} file",
        schema.TAG_IMPORT_FORMAT: curves.format,
        schema.TAG_IMPORT_SOURCE: ", ".join(p.name for p in curves.sources),
        schema.TAG_IMPORT_SHA256: _sha256(curves.sources),
        **{k: str(v)[:5000] for k, v in user_tags.items()},
    })
    uri = resolve_tracking_uri(tracking_uri)
    try:
        client = MlflowClient(uri)
        exp_id = _experiment_id(client, workload)
        run_id = client.create_run(exp_id, start_time=now, tags=all_tags,
                                   run_name=run_name or f"import {curves.sources[0].name}"
                                   ).info.run_id
    except (MlflowException, OSError) as exc:
        raise RefrunInputError(f"tracking store {uri}: cannot create the run "
                               f"({type(exc).__name__}: {str(exc)[:300]})") from exc
    try:
        _fill(client, run_id, curves, table, view, max_points)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
            client.delete_run(run_id)
        if isinstance(exc, MlflowException | OSError):
            raise RefrunInputError(f"tracking store {uri}: import failed, run {run_id} "
                                   f"deleted ({type(exc).__name__}: {str(exc)[:300]})"
                                   ) from exc
        raise
    return run_id


def _fill(client: MlflowClient, run_id: str, curves: ImportedCurves, table: pd.DataFrame,
          view: list[Metric], max_points: int) -> None:
    """Params, the metric view, the curves artifact, the end-of-run tags, FINISHED."""
    params = [Param(k, str(v)[:6000]) for k, v in curves.params.items()]
    for i in range(0, len(params), _TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[i:i + _TAGS_PER_BATCH])
    for i in range(0, len(view), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=view[i:i + _METRICS_PER_BATCH])
    artifact = PurePosixPath(schema.ARTIFACT_CURVES)
    with tempfile.TemporaryDirectory(prefix="refrun-import-") as tmp:
        path = write_curves(table, Path(tmp) / artifact.name)
        client.log_artifact(run_id, str(path), artifact_path=str(artifact.parent))
    end_tags = {
        **summary_tags(table),
        schema.TAG_DROPPED: "0",
        schema.TAG_WARNINGS: "0",
        schema.TAG_IMPORT_NONFINITE: str(curves.nonfinite),
        schema.TAG_MLFLOW_VIEW: f"bounded_view max_points={max_points}: {len(view)} of "
                                f"{len(table)} points; every point in "
                                f"{schema.ARTIFACT_CURVES}",
    }
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in end_tags.items()])
    client.set_terminated(run_id, "FINISHED", end_time=time.time_ns() // 1_000_000)
