"""Moving a spool's contents into an MLflow tracking store.

Used by the session's background writer while the run is live and by ``refrun sync``
afterwards; both call the same functions, so a run delivered late is indistinguishable
from one delivered live.  Every function here may raise on a store error: callers decide
whether to retry (the writer) or report (sync).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from refrun import mlflow_ui
from refrun.spool import Spool

# MLflow's documented log_batch limits.
MAX_METRICS_PER_BATCH = 1000
MAX_TAGS_PER_BATCH = 100


def client_for(meta: dict[str, Any]) -> MlflowClient:
    return MlflowClient(tracking_uri=meta["tracking_uri"])


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """Id of the experiment called ``name``, created if missing (safe under races)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def ensure_run(spool: Spool, client: MlflowClient) -> str:
    """The spool's MLflow run id, creating the run (and experiment) the first time."""
    meta = spool.read_meta()
    if meta.get("run_id"):
        return meta["run_id"]
    exp_id = ensure_experiment(client, meta["experiment"])
    mlflow_ui.prepare_experiment(client, exp_id)  # training kind, saved view
    run = client.create_run(
        exp_id,
        start_time=meta["start_ms"],
        tags=meta["tags"],
        run_name=meta.get("run_name"),
    )
    spool.update_meta(lambda m: m.update(run_id=run.info.run_id, experiment_id=exp_id))
    return run.info.run_id


def deliver_tags_params(spool: Spool, client: MlflowClient, run_id: str) -> None:
    """Send every tag and param in the spool metadata (idempotent: values never change)."""
    meta = spool.read_meta()
    version = meta.get("tags_version", 0)
    if meta.get("tags_delivered", -1) >= version:
        return
    tags = [RunTag(k, str(v)) for k, v in meta["tags"].items()]
    params = [Param(k, str(v)) for k, v in meta.get("params", {}).items()]
    for i in range(0, max(len(tags), len(params)), MAX_TAGS_PER_BATCH):
        client.log_batch(
            run_id,
            tags=tags[i : i + MAX_TAGS_PER_BATCH],
            params=params[i : i + MAX_TAGS_PER_BATCH],
        )
    spool.update_meta(lambda m: m.update(tags_delivered=version))


def _sendable(key: str, step: int, every: int) -> bool:
    # Thinning applies to per-step training metrics only; evaluation points are rare and
    # each one matters.  The curves artifact is never thinned.
    return every <= 1 or step % every == 0 or key.startswith("eval/")


def deliver_points(
    spool: Spool,
    client: MlflowClient,
    run_id: str,
    every: int = 1,
    max_batches: int | None = None,
) -> int:
    """Send undelivered points from the cursor on; returns how many lines were consumed.

    The cursor is advanced only after the store accepted the batch.  ``max_batches`` bounds
    the work of one call (None: everything).
    """
    consumed = 0
    start_lines, _ = spool.read_cursor()
    for i, (batch, lines_after, bytes_after) in enumerate(
        spool.iter_undelivered(MAX_METRICS_PER_BATCH)
    ):
        if max_batches is not None and i >= max_batches:
            break
        metrics = [Metric(k, v, t, s) for k, s, t, v in batch if _sendable(k, s, every)]
        if metrics:
            client.log_batch(run_id, metrics=metrics)
        spool.write_cursor(lines_after, bytes_after)
        consumed = lines_after - start_lines
    return consumed


def deliver_pending(spool: Spool, max_batches: int | None = None) -> str:
    """Create the run if needed, then send tags, params and undelivered points (at most
    ``max_batches`` batches); returns the MLflow run id.  Raises on a store error."""
    meta = spool.read_meta()
    client = client_for(meta)
    run_id = ensure_run(spool, client)
    deliver_tags_params(spool, client, run_id)
    deliver_points(spool, client, run_id, meta.get("mlflow_every", 1), max_batches)
    return run_id


def deliver_artifacts(spool: Spool, client: MlflowClient, run_id: str) -> None:
    """Upload files in the spool's artifacts/ not yet uploaded (recorded in meta)."""
    meta = spool.read_meta()
    done = set(meta.get("artifacts_delivered", []))
    for path in sorted(Path(spool.artifacts_dir).rglob("*")):
        if not path.is_file() or path.name.endswith(".tmp"):
            continue
        rel = path.relative_to(spool.artifacts_dir).as_posix()
        stamp = f"{rel}@{path.stat().st_mtime_ns}"
        if stamp in done:
            continue
        parent = str(Path(rel).parent)
        client.log_artifact(run_id, str(path), artifact_path=None if parent == "." else parent)
        done.add(stamp)
        delivered = sorted(done)
        spool.update_meta(lambda m, d=delivered: m.update(artifacts_delivered=d))


def finish(spool: Spool, client: MlflowClient, run_id: str, status: str) -> None:
    """Mark the MLflow run terminated with ``status`` and the spool complete."""
    meta = spool.read_meta()
    client.set_terminated(run_id, status=status, end_time=meta.get("end_ms") or _now_ms())
    spool.update_meta(lambda m: m.update(status=status, complete=True))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def finalize(spool: Spool) -> bool:
    """Deliver a closed spool completely and terminate its MLflow run with its status.

    Used at the end of a live run and by ``refrun sync``.  Raises on a store error.
    """
    run_id = deliver_pending(spool)
    client = client_for(spool.read_meta())
    deliver_artifacts(spool, client, run_id)
    finish(spool, client, run_id, spool.read_meta().get("status") or "KILLED")
    return True
