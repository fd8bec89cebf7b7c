"""The second way to write a run: one whose every point is known up front, in one pass.

Imports and comparison runs are not live runs: all their points exist before anything is
written.  They do not go through the session's spool and delivery process (whose cost
grows with the number of points, ~10k points/s into MLflow).  Instead, in one pass:

1. the run is created with its identity tags (built by the same function as a recorded
   run's, so it is found and compared like any other);
2. params, then MLflow's metric history gets a bounded spike-preserving view per metric
   (:func:`refrun.util.thinning.bounded_view`: every point when there are few; otherwise the
   first and last step, each bucket's first point, extremes and first non-finite value);
3. the ``refrun/curves.parquet`` artifact gets every point, plus any JSON artifacts;
4. end-of-run tags (step counts, non-finite count, the view's size), then FINISHED.

:func:`write_complete_run` returns only then.  A store error after the run was created
marks it FAILED and deletes it, so nothing half-written stays visible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from refrun import limits, schema
from refrun.errors import RefrunStoreError
from refrun.identity import RunIdentity
from refrun.store import health, mlflow_ui
from refrun.store.client import entities_for, run_writer, store_failures
from refrun.store.curves import SCHEMA, summary_tags, write_curves
from refrun.store.direct import Metric, Param, RunTag
from refrun.store.uri import resolve_tracking_uri
from refrun.util.thinning import MLFLOW_MAX_POINTS, bounded_view, sorted_unique

if TYPE_CHECKING:
    from refrun.store.surface import StoreClient

log = logging.getLogger("refrun")

__all__ = [
    "CompleteRun",
    "CopiedRun",
    "curves_table",
    "identity_tags",
    "mlflow_view",
    "table_summary_tags",
    "write_complete_run",
    "write_copied_run",
    "write_curves",
]


def identity_tags(workload: str, role: str, *, hardware: str | None, backend: str,
                  seed: int | None = None, chips: int | None = None,
                  global_batch: int | None = None) -> dict[str, str]:
    """The identity tags a recorded run gets (:meth:`refrun.identity.RunIdentity.tags`,
    as the session's, so imported and comparison runs are found and compared like any
    other), for a run this process did not train.  Raises :class:`RefrunInputError` for a
    bad workload, role, hardware, backend, seed, chips or global batch."""
    return RunIdentity(workload=workload, role=role, hardware=hardware, backend=backend,
                       seed=seed, chips=chips, global_batch=global_batch).tags()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def curves_table(metrics: Sequence[str] | np.ndarray | pd.Categorical,
                 steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
                 timestamp_ms: int | np.ndarray) -> pd.DataFrame:
    """The curves artifact's long table from columns in logging order: ``metric``
    categorical, ``seq`` 0, 1, 2 ..., every point stamped ``timestamp_ms``: one time (the
    time the run is written, for files and comparisons without per-point times) or one per
    point (an imported file's own wall times)."""
    n = len(steps)
    stamps = (np.asarray(timestamp_ms, dtype=np.int64) if np.ndim(timestamp_ms)
              else np.full(n, timestamp_ms, dtype=np.int64))
    return pd.DataFrame({
        "metric": metrics if isinstance(metrics, pd.Categorical) else pd.Categorical(metrics),
        "step": np.asarray(steps, dtype=np.int64),
        "value": np.asarray(values, dtype=np.float64),
        "timestamp_ms": stamps,
        "seq": np.arange(n, dtype=np.int64),
    }, copy=False)  # no consolidation of the int64 columns into one block: 40x faster


def mlflow_view(table: pd.DataFrame, max_points: int = MLFLOW_MAX_POINTS) -> list[Metric]:
    """The points sent to MLflow's metric history: per metric, in step order (logging
    order within a step), the :func:`~refrun.util.thinning.bounded_view` of at most about
    ``max_points`` points (first and last step always; every point when there are few)."""
    out: list[Metric] = []
    col = table["metric"]
    if not isinstance(col.dtype, pd.CategoricalDtype):
        col = col.astype("category")
    codes = col.cat.codes.to_numpy()
    steps = table["step"].to_numpy()
    values = table["value"].to_numpy()
    stamps = table["timestamp_ms"].to_numpy()
    # One stable sort by (metric, step) keeps logging order within a step, then each
    # metric is a slice: linear in the number of metrics (a mask per metric made 100,000
    # metrics cost 100,000 passes over every point).
    order = np.lexsort((steps, codes))
    counts = np.bincount(codes[codes >= 0], minlength=len(col.cat.categories))
    start = int(np.count_nonzero(codes < 0))  # no metric name (sorted first): no point
    for name, count in zip(col.cat.categories, counts.tolist(), strict=True):
        rows = order[start:start + count]
        start += count
        if not count:
            continue
        keep = rows[bounded_view(values[rows], max_points)]
        out.extend(Metric(str(name), float(v), int(t), int(s))
                   for s, v, t in zip(steps[keep].tolist(), values[keep].tolist(),
                                      stamps[keep].tolist(), strict=True))
    return out


def write_categorical_curves(table: pd.DataFrame, path: Path) -> Path:
    """:func:`~refrun.store.curves.write_curves` for a table whose ``metric`` is
    categorical (as :func:`curves_table` makes it): the categories become the Parquet
    dictionary directly, without a string per row (3x faster for millions of points).
    Same schema (:data:`refrun.store.curves.SCHEMA`), compression and file."""
    metric = table["metric"].array
    if not isinstance(metric, pd.Categorical):
        return write_curves(table, path)
    codes = pa.array(metric.codes.astype(np.int32))
    dictionary = pa.array([str(c) for c in metric.categories], type=pa.string())
    columns = [pa.DictionaryArray.from_arrays(codes, dictionary)]
    columns += [pa.array(table[c].to_numpy()) for c in schema.CURVE_COLUMNS[1:]]
    path.parent.mkdir(parents=True, exist_ok=True)
    # Dictionary-encode only the metric names: trying it on millions of distinct steps and
    # values costs CPU (a hash per value until the dictionary overflows) and file size.
    pq.write_table(pa.Table.from_arrays(columns, schema=SCHEMA), path, compression="zstd",
                   use_dictionary=["metric"])
    return path


@dataclass(frozen=True, eq=False)
class CompleteRun:
    """Everything a run holds, ready to be written in one pass."""

    experiment: str
    tags: dict[str, str]
    """Tags set when the run is created (identity first)."""
    table: pd.DataFrame = field(repr=False)
    """Every point (:func:`curves_table`); written as the curves artifact."""
    params: dict[str, str] = field(default_factory=dict)
    run_name: str | None = None
    json_artifacts: dict[str, Any] = field(default_factory=dict)
    """Artifact path (``refrun/comparison.json``) -> JSON-able document."""
    file_artifacts: dict[str, bytes] = field(default_factory=dict)
    """Artifact path -> its exact bytes (e.g. the criteria file an assessment used)."""
    end_tags: dict[str, str] = field(default_factory=dict)
    """Tags set once everything else is written."""
    max_points: int = MLFLOW_MAX_POINTS
    """Most points per metric in MLflow's metric history."""
    tags_for_run: Callable[[StoreClient, str], dict[str, str]] | None = None
    """Tags that need the new run's id (e.g. links to it), set with ``end_tags``."""


def write_complete_run(run: CompleteRun, tracking_uri: str | None = None) -> str:
    """Write ``run`` into the store and return its MLflow run id once it is FINISHED.

    Raises :class:`RefrunInputError` (one line) when the store cannot be reached or
    fails midway; a run created before the failure is marked FAILED and deleted.
    """
    uri = resolve_tracking_uri(tracking_uri)
    cut: list[str] = []
    tags = _fitted(run.tags, limits.TAG_VALUE_LENGTH, "tag", cut)
    with tempfile.TemporaryDirectory(prefix="refrun-run-") as tmp, \
            ThreadPoolExecutor(1, thread_name_prefix="refrun-artifacts") as pool:
        # The artifact files (and the table's summary tags) are made on a second thread
        # while this one creates the run and logs the view: Parquet encoding and zstd run
        # in Arrow without the GIL, the store's work is Python and fsyncs, so on two cores
        # the artifact costs no wall time.  Nothing is uploaded before the run exists.
        files = pool.submit(_write_artifact_tree, run, Path(tmp))
        view = mlflow_view(run.table, run.max_points)
        client, run_id = _create(uri, run.experiment, start_time=now_ms(), tags={
            schema.TAG_NOTE: mlflow_ui.run_description(run.tags), **tags},
            run_name=run.run_name or mlflow_ui.default_run_name(run.tags))
        with _deleted_on_failure(client, uri, run_id):
            _fill(client, run_id, run, view, files, Path(tmp), cut)
    return run_id


@dataclass(frozen=True, eq=False)
class CopiedRun:
    """A run recorded elsewhere (another store), copied as it is: every tag and param,
    every point of MLflow's metric history with its step and timestamp, the artifact files
    byte for byte (the curves artifact among them), its status and start and end times."""

    experiment: str
    run_name: str
    tags: dict[str, str]
    """Every tag, set when the run is created (so an interrupted copy is recognisable)."""
    params: dict[str, str]
    history: list[Metric] = field(repr=False)
    artifacts: Path
    """A folder whose tree is the run's artifacts."""
    status: str
    start_time: int | None
    end_time: int | None


def write_copied_run(run: CopiedRun, tracking_uri: str | None = None) -> str:
    """Write ``run`` into the store and return its new MLflow run id once it holds
    everything and has its status (the same one-pass writer as :func:`write_complete_run`:
    a store error after the run was created marks it FAILED and deletes it)."""
    uri = resolve_tracking_uri(tracking_uri)
    client, run_id = _create(uri, run.experiment, start_time=run.start_time,
                             tags=dict(run.tags), run_name=run.run_name)
    with _deleted_on_failure(client, uri, run_id):
        params = entities_for(client, [Param(k, v) for k, v in run.params.items()])
        for i in range(0, len(params), limits.TAGS_PER_BATCH):
            client.log_batch(run_id, params=params[i:i + limits.TAGS_PER_BATCH])
        history = entities_for(client, run.history)
        for i in range(0, len(history), limits.METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=history[i:i + limits.METRICS_PER_BATCH])
        if any(run.artifacts.iterdir()):
            client.log_artifacts(run_id, str(run.artifacts))
        client.set_terminated(run_id, run.status, end_time=run.end_time)
    return run_id


def _create(uri: str, experiment: str, *, start_time: int | None, tags: dict[str, str],
            run_name: str) -> tuple[StoreClient, str]:
    """The writing client and a new run in ``experiment`` (created when missing)."""
    try:
        client, exp_id = run_writer(uri, experiment)
        mlflow_ui.prepare_experiment(client, exp_id)  # training kind, saved view
        run_id = client.create_run(exp_id, start_time=start_time, tags=tags,
                                   run_name=run_name).info.run_id
    except store_failures() as exc:  # RefrunStoreError passes through
        raise RefrunStoreError(f"tracking store {uri}: cannot create the run "
                               f"({health.cause(exc)})") from exc
    return client, run_id


@contextlib.contextmanager
def _deleted_on_failure(client: StoreClient, uri: str, run_id: str) -> Iterator[None]:
    """Anything raised while the run is filled marks it FAILED and deletes it, so nothing
    half-written stays visible; a store failure becomes one :class:`RefrunStoreError`."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
            client.delete_run(run_id)
        if isinstance(exc, store_failures()):
            raise RefrunStoreError(f"tracking store {uri}: writing run {run_id} failed, "
                                   f"run deleted ({health.cause(exc)})") from exc
        raise


def _fill(client: StoreClient, run_id: str, run: CompleteRun, view: list[Metric],
          files: Future[dict[str, str]], tree: Path, cut: list[str]) -> None:
    params = entities_for(client, [Param(k, v) for k, v in _fitted(
        run.params, limits.PARAM_VALUE_LENGTH, "param", cut).items()])
    for i in range(0, len(params), limits.TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[i:i + limits.TAGS_PER_BATCH])
    view = entities_for(client, view)
    for i in range(0, len(view), limits.METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=view[i:i + limits.METRICS_PER_BATCH])
    summary = files.result()  # raises what the writer raised
    client.log_artifacts(run_id, str(tree))  # the artifact tree, uploaded in one call
    end = {
        **summary,
        schema.TAG_DROPPED: "0",
        schema.TAG_REFUSED: "0",
        schema.TAG_WARNINGS: "0",
        schema.TAG_MLFLOW_VIEW: mlflow_view_note(run.max_points, len(view), len(run.table)),
        **run.end_tags,
        **(run.tags_for_run(client, run_id) if run.tags_for_run is not None else {}),
    }
    end = _fitted(end, limits.TAG_VALUE_LENGTH, "tag", cut)
    if cut:  # set only when something was cut: the tags of a complete run stay as they were
        end[schema.TAG_TRUNCATED] = str(len(cut))
    tags = entities_for(client, [RunTag(k, v) for k, v in end.items()])
    for i in range(0, len(tags), limits.TAGS_PER_BATCH):
        client.log_batch(run_id, tags=tags[i:i + limits.TAGS_PER_BATCH])
    client.set_terminated(run_id, "FINISHED", end_time=now_ms())


def _write_artifact_tree(run: CompleteRun, root: Path) -> dict[str, str]:
    """The run's artifacts laid out as their tree (``refrun/curves.parquet`` ...); returns
    the table's summary tags (computed here, off the thread that talks to the store)."""
    write_categorical_curves(run.table, root / schema.ARTIFACT_CURVES)
    for name, doc in run.json_artifacts.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    for name, data in run.file_artifacts.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return table_summary_tags(run.table)


def table_summary_tags(table: pd.DataFrame, main_metric: str = schema.M_LOSS) -> dict[str, str]:
    """:func:`refrun.store.curves.summary_tags` of a :func:`curves_table` (categorical
    ``metric``, rows in ``seq`` order), computed on the category codes with NumPy: no sort
    by ``seq``, no group-by, no string comparison per row (2x faster on millions of rows).

    Same definitions: ``repeated``/``backwards`` count points whose step equals / is below
    the previous step of the same metric in logging order; step counts come from
    ``main_metric``, else from the metric with most points (the first such category)."""
    col = table["metric"].array
    seq = table["seq"].to_numpy()
    if not isinstance(col, pd.Categorical) or (len(seq) > 1 and (np.diff(seq) <= 0).any()):
        return summary_tags(table, main_metric)
    codes = col.codes.astype(np.int64)
    steps = table["step"].to_numpy()
    values = table["value"].to_numpy()
    tags = {schema.TAG_NONFINITE: str(int(np.count_nonzero(~np.isfinite(values))))}
    present = np.count_nonzero(np.bincount(codes)) if len(codes) else 0
    if len(codes) and np.count_nonzero(np.diff(codes)) != present - 1:
        order = np.argsort(codes, kind="stable")  # metrics interleaved: group them, in order
        codes, steps = codes[order], steps[order]
    same = codes[1:] == codes[:-1]
    d = np.diff(steps)
    tags[schema.TAG_STEPS_REPEATED] = str(int(np.count_nonzero(same & (d == 0))))
    tags[schema.TAG_STEPS_BACKWARDS] = str(int(np.count_nonzero(same & (d < 0))))
    if len(codes):
        counts = np.bincount(codes, minlength=len(col.categories))
        names = [str(c) for c in col.categories]
        main = names.index(main_metric) if main_metric in names and counts[
            names.index(main_metric)] else int(np.argmax(counts))
        main_steps = steps[codes == main]
        tags[schema.TAG_STEPS_COUNT] = str(len(sorted_unique(main_steps)))
        tags[schema.TAG_STEPS_FIRST] = str(int(main_steps.min()))
        tags[schema.TAG_STEPS_LAST] = str(int(main_steps.max()))
    return tags


def mlflow_view_note(max_points: int, sent: int, total: int) -> str:
    """The ``refrun.mlflow_view`` tag: how MLflow's history relates to the artifact."""
    return (f"bounded_view max_points={max_points} per metric: {sent} of {total} points; "
            f"every point in {schema.ARTIFACT_CURVES}")


def string_tags(tags: Mapping[str, Any]) -> dict[str, str]:
    """Tag values as strings (JSON for containers).  Values over MLflow's length are cut
    by :func:`write_complete_run`, which warns about each and counts them."""
    return {k: (v if isinstance(v, str) else json.dumps(v, default=str)
                if isinstance(v, dict | list | tuple) else str(v))
            for k, v in tags.items()}


def _fitted(values: Mapping[str, Any], limit: int, what: str, cut: list[str]
            ) -> dict[str, str]:
    """``values`` as strings of at most ``limit`` characters; each key whose value was cut
    is appended to ``cut`` and warned about (logger ``refrun``), never cut silently."""
    out = {}
    for k, v in values.items():
        text = str(v)
        if len(text) > limit:
            cut.append(k)
            log.warning("%s %r: value of %s characters cut to MLflow's limit of %s "
                        "(counted in %s)", what, k, f"{len(text):,}", f"{limit:,}",
                        schema.TAG_TRUNCATED)
            text = text[:limit]
        out[k] = text
    return out
