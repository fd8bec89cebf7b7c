"""Loading recorded runs from the MLflow store into pandas (:class:`RunData`).

Fast path: the run's full-resolution ``refrun/curves.parquet`` artifact.  Fallback for runs
without it: MLflow metric history, one request per metric, with a progress bar (for runs
recorded by refrun it is a bounded view, not every point, and it is slow for long
histories).  :attr:`RunData.points_from` always says which of the two was read.

Never compare partial data silently: a run that is still RUNNING (or not finished and
without its curves artifact) is waited for, at most :func:`wait_for_runs` seconds (the
CLI's ``--wait``), with progress on stderr, and then refused with a one-line
:class:`RefrunInputError`.  Only a reader that watches a run in progress passes
``allow_partial=True``.

MLflow stores +-inf as +-1.7976931348623157e308 (the largest float); values read from the
metric history are mapped back to +-inf, so a genuine value of exactly +-float max reads
as infinite (indistinguishable in MLflow's store; the curves artifact keeps it exact).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from refrun import schema
from refrun.comparison.alignment import Series, resolve_series
from refrun.comparison.ranks import JobSummary, derived_points, job_summary, world_size_of
from refrun.errors import RefrunInputError
from refrun.store.client import client as store_client
from refrun.store.client import refusals
from refrun.store.direct import FLOAT_MAX, DirectClient, local_path
from refrun.store.runs import list_runs
from refrun.store.uri import resolve_tracking_uri

if TYPE_CHECKING:
    from refrun.store.surface import RunView as Run
    from refrun.store.surface import StoreClient

T = TypeVar("T")
CURVE_DTYPES = {"step": "int64", "value": "float64", "timestamp_ms": "int64", "seq": "int64"}

# Where a run's points came from: its curves artifact (every point), MLflow's metric
# history (for refrun runs a bounded view), memory (tests, notebooks), a live spool.
Source = Literal["artifact", "history", "memory", "spool"]

DEFAULT_WAIT_S = 60.0
_WAIT_S: ContextVar[float] = ContextVar("refrun_wait_s", default=DEFAULT_WAIT_S)
_POLL_S = 1.0  # how often an incomplete run is looked at again while waiting
_PROGRESS_EVERY_S = 10.0
# Statuses of a run still being recorded; FINISHED/FAILED/KILLED are terminal.
_ACTIVE = ("RUNNING", "SCHEDULED")
# A read the store answered with a transient error (unreachable, timeout, 5xx, 429) is
# tried again after these pauses (s), then refused with one line: never taken for "no
# curves artifact" (that would compare the run on MLflow's bounded view).
READ_RETRY_PAUSES_S = (0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True, eq=False)
class RunData:
    """One run as loaded for comparison.

    ``curves`` is the long table ``(metric, step, value, timestamp_ms, seq)`` with
    ``metric`` categorical; ``seq`` is the logging order.  ``source`` says where the points
    came from: ``"artifact"`` (every point) or ``"history"`` (MLflow metric history).
    """

    run_id: str
    tags: dict[str, str]
    params: dict[str, str]
    status: str
    start_time_ms: int | None
    end_time_ms: int | None
    curves: pd.DataFrame = field(repr=False)
    source: Source = "artifact"
    experiment_id: str = ""
    job: JobSummary | None = None
    """The ranks of a multi-process run (how many reported, straggler); None otherwise."""
    latest_metrics: dict[str, float] | None = field(default=None, repr=False)
    """MLflow's latest value of each metric, read with the run's tags (the same request);
    None for a run not loaded from a store."""
    gap: str | None = None
    """What this run is missing (points dropped or lost, its curves artifact), stated in
    :attr:`points_from` and so in every verdict's evidence; None for a whole run.  Only a
    caller that asked for it (``load_run(allow_gaps=True)``) gets a run with a gap."""

    @property
    def points(self) -> int:
        """Number of points loaded (rows of ``curves``)."""
        return len(self.curves)

    @property
    def points_from(self) -> str:
        """One sentence saying where the points came from and how many there are (and
        what is missing, for a run that is not whole)."""
        said = self._points_from()
        return said if self.gap is None else f"{said}; NOT WHOLE: {self.gap}"

    def _points_from(self) -> str:
        n = f"{self.points:,} point{'s' if self.points != 1 else ''}"
        if self.source == "artifact":
            return f"curves artifact {schema.ARTIFACT_CURVES}: {n} (every point)"
        if self.source == "history":
            return (f"MLflow metric history: {n} (no curves artifact {schema.ARTIFACT_CURVES}; "
                    "for a run recorded by refrun this is a bounded view, not every point)")
        if self.source == "spool":
            return f"live spool of a run in progress: {n}"
        return f"in memory: {n}"

    @classmethod
    def from_curves(cls, curves: pd.DataFrame, run_id: str = "local",
                    tags: dict[str, str] | None = None,
                    params: dict[str, str] | None = None) -> RunData:
        """An in-memory run from a long curves table (``seq`` defaults to row order)."""
        df = curves.copy()
        if "seq" not in df:
            df["seq"] = np.arange(len(df), dtype=np.int64)
        if "timestamp_ms" not in df:
            df["timestamp_ms"] = np.zeros(len(df), dtype=np.int64)
        df = df[list(schema.CURVE_COLUMNS)].astype(CURVE_DTYPES)
        df["metric"] = df["metric"].astype("category")
        return cls(run_id=run_id, tags=dict(tags or {}), params=dict(params or {}),
                   status="FINISHED", start_time_ms=None, end_time_ms=None, curves=df,
                   source="memory")

    def _tag(self, key: str) -> str | None:
        return self.tags.get(key)

    @property
    def workload(self) -> str | None:
        return self._tag(schema.TAG_WORKLOAD)

    @property
    def role(self) -> str | None:
        return self._tag(schema.TAG_ROLE)

    @property
    def hardware(self) -> str | None:
        return self._tag(schema.TAG_HARDWARE)

    @property
    def backend(self) -> str | None:
        return self._tag(schema.TAG_BACKEND)

    @property
    def seed(self) -> str | None:
        return self._tag(schema.TAG_SEED)

    @property
    def metric_names(self) -> list[str]:
        """Metrics with at least one point, sorted by name."""
        return sorted(self._index())

    def series(self, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, values, seq)`` of one metric, in stored row order (not resolved)."""
        rows = self._index().get(metric)
        if rows is None:
            raise RefrunInputError(f"run {self.run_id}: no metric {metric!r}")
        c = self.curves
        return (c["step"].to_numpy()[rows], c["value"].to_numpy()[rows],
                c["seq"].to_numpy()[rows])

    def resolved(self, metric: str, keep: str = "last") -> Series:
        """The metric with one value per step (:func:`~refrun.comparison.alignment.
        resolve_series`), computed once per ``(metric, keep)``: a sweep compares every
        candidate with the same reference runs, whose series are resolved only once."""
        cache: dict[tuple[str, str], Series] = self.__dict__.setdefault("_resolved", {})
        key = (metric, keep)
        if key not in cache:
            steps, values, seq = self.series(metric)
            cache[key] = resolve_series(steps, values, seq, keep=keep)  # type: ignore[arg-type]
        return cache[key]

    def _index(self) -> dict[str, np.ndarray]:
        # Row positions per metric, computed once from the integer category codes: a
        # 5M-row table is split in milliseconds instead of one string scan per metric.
        cache = self.__dict__.get("_rows")
        if cache is None:
            col = self.curves["metric"]
            if not isinstance(col.dtype, pd.CategoricalDtype):
                col = col.astype("category")
            codes = col.cat.codes.to_numpy()
            cache = {}
            for i, name in enumerate(col.cat.categories):
                rows = np.flatnonzero(codes == i)
                if len(rows):
                    cache[str(name)] = rows
            object.__setattr__(self, "_rows", cache)
        return cache


def _client(tracking_uri: str | None) -> tuple[StoreClient, str]:
    """The store's reader: refrun's own sqlite access where it applies
    (:mod:`refrun.store.direct`: no MLflow import), else MLflow's client."""
    uri = resolve_tracking_uri(tracking_uri)
    return store_client(uri, direct=True), uri


def _artifact_reader(client: StoreClient, uri: str, run: Run) -> StoreClient:
    """``client``, or MLflow's when the run's artifacts are not on this machine (only
    MLflow's client downloads from an object store or a server)."""
    if isinstance(client, DirectClient) and local_path(run.info.artifact_uri) is None:
        return store_client(uri)
    return client


@contextlib.contextmanager
def wait_for_runs(seconds: float) -> Iterator[None]:
    """Within the block, :func:`load_run` waits at most ``seconds`` for an incomplete run
    (default :data:`DEFAULT_WAIT_S`; 0 refuses at once).  Used by the CLI's ``--wait``."""
    if not seconds >= 0:
        raise RefrunInputError(f"--wait {seconds}: must be a number of seconds >= 0")
    token = _WAIT_S.set(float(seconds))
    try:
        yield
    finally:
        _WAIT_S.reset(token)


def incomplete_reason(status: str, has_artifact: bool,
                      tags: Mapping[str, str] | None = None) -> str | None:
    """Why a run with this status cannot be compared yet, or None when it can.

    Incomplete: RUNNING/SCHEDULED (still being recorded or delivered), ended with spooled
    points not delivered yet (``refrun.sync.pending``: its spool's disk was full), or
    ended without FINISHED and without its curves artifact (points may be partly
    delivered).
    """
    if status in _ACTIVE:
        return f"is {status} (still being recorded or delivered)"
    if tags and schema.TAG_SYNC_PENDING in tags:
        return f"has {tags[schema.TAG_SYNC_PENDING]}"
    if status != "FINISHED" and not has_artifact:
        return f"is {status} and has no curves artifact {schema.ARTIFACT_CURVES}"
    return None


def not_whole(tags: Mapping[str, str], curves: pd.DataFrame | None) -> str | None:
    """What a complete run is missing, or None when it is whole: points dropped while
    recording (``refrun.dropped``: the in-memory queue or the spool's disk full), points a
    hard kill took with the trainer (``refrun.lost.estimate``), or, for a run recorded by
    refrun (``refrun.local_id``), its curves artifact (MLflow's metric history holds a
    bounded view of it, not every point).  Each with the fraction missing and where."""
    if curves is None and schema.TAG_LOCAL_ID in tags:
        why = tags.get(schema.TAG_CURVES_MISSING) or "not in its artifact store"
        return (f"recorded by refrun, but its curves artifact {schema.ARTIFACT_CURVES} is "
                f"missing ({' '.join(why.split())[:160]}); MLflow's metric history holds "
                "only a bounded view of it, not every point")
    have = 0 if curves is None else len(curves)
    said = []
    for tag, what, where in (
            (schema.TAG_DROPPED, "dropped while recording",
             "the first step is named in refrun/warnings.json"),
            (schema.TAG_LOST_ESTIMATE, "estimated lost with the trainer when it was "
             "killed", "after its last recorded step")):
        try:
            n = int(tags.get(tag) or 0)
        except ValueError:
            n = 1  # a count that does not read as one is not "none"
        if n > 0:
            said.append(f"{n:,} points {what} ({tag}; {n / (n + have):.1%} of "
                        f"{n + have:,}; {where})")
    return "; ".join(said) or None


def sparse_counters(tags: Mapping[str, str]) -> list[str]:
    """The counters a run's probe wrote only where not 0 (``TAG_SPARSE_COUNTERS``)."""
    text = tags.get(schema.TAG_SPARSE_COUNTERS) or ""
    return [n for n in (t.strip() for t in text.split(",")) if n]


def dense_counters(curves: pd.DataFrame, names: Sequence[str]) -> pd.DataFrame:
    """``curves`` with each counter of ``names`` given a point at every
    ``perf/step_time_s`` point, stamped and ordered (``seq``) as that step-time point: its
    written value there (the k-th at a step, for the step's k-th step time: a replayed
    step keeps its own), else 0.  A probe writes such counters only where they are not 0
    (:data:`refrun.schema.TAG_SPARSE_COUNTERS`), after the step times of the same steps;
    every reader gets them back as a probe that writes each step would have written them.
    A counter point at no step time is kept as written."""
    if not names or curves.empty:
        return curves
    metric = curves["metric"].astype(str)
    st = curves[metric == schema.M_STEP_TIME]
    if st.empty:
        return curves
    base = st[["step", "timestamp_ms", "seq"]].sort_values("seq")
    out = [curves[~metric.isin(names)].astype({"metric": "string"})]
    for name in names:
        own = curves.loc[metric == name, ["step", "value", "timestamp_ms", "seq"]]
        # A counter point belongs to the last step time of its step written before it
        # (a probe writes a block's counters right after its step times).
        owner = pd.merge_asof(own.sort_values("seq"),
                              base[["step", "seq"]].rename(columns={"seq": "at"}),
                              left_on="seq", right_on="at", by="step", direction="backward")
        kept = owner[owner["at"].isna()]
        owned = owner.dropna(subset=["at"]).drop_duplicates("at", keep="last")
        joined = base.merge(owned[["at", "value"]].astype({"at": "int64"}),
                            left_on="seq", right_on="at", how="left")
        joined["value"] = joined["value"].fillna(0.0)
        joined["metric"] = name
        out.append(joined[list(schema.CURVE_COLUMNS)].astype({"metric": "string"}))
        if len(kept):
            out.append(kept.assign(metric=name)[list(schema.CURVE_COLUMNS)]
                       .astype({"metric": "string"}))
    dense = pd.concat(out, ignore_index=True).astype(CURVE_DTYPES)
    dense["metric"] = dense["metric"].astype("category")
    return dense.sort_values(["seq", "metric"], kind="stable", ignore_index=True)


def load_run(run_id: str, metrics: Sequence[str] | None = None,
             tracking_uri: str | None = None, progress: bool = True, *,
             wait_s: float | None = None, allow_partial: bool = False,
             allow_gaps: bool = False) -> RunData:
    """Load one run by MLflow run id (curves artifact, else metric history).

    A run that is incomplete (:func:`incomplete_reason`) is waited for at most ``wait_s``
    seconds (None: the :func:`wait_for_runs` setting, default 60 s), polling every second
    with a progress line on stderr every 10 s, then refused.  ``allow_partial=True``
    loads whatever is there now (for watching a run in progress).

    A complete run that is not whole (:func:`not_whole`: points dropped or lost, a refrun
    run without its curves artifact) is refused, unless ``allow_gaps=True``: then it is
    loaded with :attr:`RunData.gap` saying what is missing, which every verdict's
    evidence states (``points_from``).  The CLI never allows gaps.

    Raises :class:`RefrunInputError` naming the run id when the store does not know it,
    it stays incomplete, or it is not whole.
    """
    client, uri = _client(tracking_uri)
    run = _get_run(client, uri, run_id)
    client = _artifact_reader(client, uri, run)
    sparse = sparse_counters(run.data.tags)
    if metrics:  # a sparse counter is made dense from the step times: read them too
        sparse = [m for m in sparse if m in metrics]
    read = metrics
    if sparse and metrics and schema.M_STEP_TIME not in metrics:
        read = [*metrics, schema.M_STEP_TIME]
    curves = _read_artifact(client, uri, run_id, run.info.artifact_uri, read)
    if not allow_partial:
        run, curves = _wait_until_complete(client, uri, run, curves, read,
                                           _WAIT_S.get() if wait_s is None else wait_s)
    gap = None if allow_partial else not_whole(run.data.tags, curves)
    if gap is not None and not allow_gaps:
        raise RefrunInputError(f"run {run_id} is not whole: {gap}; refused: refrun never "
                               "judges a run with a gap as if it were whole")
    source: Source = "artifact"
    if curves is None:
        source = "history"
        curves = _read_history(client, run_id, list(run.data.metrics), read, progress)
    if sparse:
        curves = dense_counters(curves, sparse)
        if read is not metrics:
            curves = curves[curves["metric"].astype(str) != schema.M_STEP_TIME]
            curves = curves.reset_index(drop=True)
            curves["metric"] = curves["metric"].cat.remove_unused_categories()
    job = None
    if world_size_of(run.data.tags) is not None:
        job, curves = _with_job(client, uri, run, curves, source, metrics)
    return RunData(run_id=run_id, tags=dict(run.data.tags), params=dict(run.data.params),
                   status=run.info.status, start_time_ms=run.info.start_time,
                   end_time_ms=run.info.end_time, curves=curves, source=source,
                   experiment_id=run.info.experiment_id, job=job,
                   latest_metrics=dict(run.data.metrics), gap=gap)


def _with_job(client: StoreClient, uri: str, run: Run, curves: pd.DataFrame,
              source: Source, metrics: Sequence[str] | None
              ) -> tuple[JobSummary | None, pd.DataFrame]:
    """The run's :class:`JobSummary` (per-rank artifacts ``refrun/ranks/``) and its curves
    with the derived ``job/*`` points added (when wanted by ``metrics``)."""
    run_id = run.info.run_id
    with contextlib.ExitStack() as stack:
        root = local_path(run.info.artifact_uri)
        if root is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="refrun-ranks-")))
            root = _download_ranks(client, uri, run_id, tmp)
        files: dict[int, tuple[Path | None, Path | None]] = {}
        for k in range(1, int(world_size_of(run.data.tags) or 0)):
            c = root / schema.rank_curves_artifact(k)
            j = root / schema.rank_summary_artifact(k)
            files[k] = (c if c.is_file() else None, j if j.is_file() else None)
        rank0 = None
        if source == "artifact":
            own = root / schema.ARTIFACT_CURVES
            rank0 = (read_curves_fast(own, [schema.M_STEP_TIME]) if own.is_file()
                     else curves)
        elif not curves.empty:
            rank0 = curves
        job = job_summary(run.data.tags, rank0, files, read_curves_fast, run.info.status)
    if job is None:
        return None, curves
    wanted = [m for m in (schema.M_JOB_STRAGGLER, schema.M_JOB_RANKS_REPORTED,
                          schema.M_JOB_RANKS_FINISHED)
              if not metrics or m in metrics]
    if not wanted or curves.empty:
        return job, curves
    extra = derived_points(job, int(curves["step"].max()))
    extra = extra[extra["metric"].isin(wanted)]
    extra["seq"] = np.arange(len(extra), dtype=np.int64) + int(curves["seq"].max()) + 1
    merged = pd.concat([curves.astype({"metric": "string"}), extra], ignore_index=True)
    merged["metric"] = merged["metric"].astype("category")
    return job, merged


def _download_ranks(client: StoreClient, uri: str, run_id: str, tmp: Path) -> Path:
    """Download ``refrun/ranks/`` (and rank 0's curves for its step times) into ``tmp``;
    returns ``tmp`` laid out like the run's artifact root.  A file the store says is not
    there stays missing (the job summary names the rank); an error reading the store is
    retried like every other read, then a one-line error: a rank must never look absent
    because the store did not answer."""
    for path in (schema.ARTIFACT_RANKS_DIR, schema.ARTIFACT_CURVES):
        parent = path.rsplit("/", 1)[0]
        listed = retried(f"run {run_id}: listing {parent}/ in {uri}",
                         lambda parent=parent: _listed(client, uri, run_id, parent))
        if path not in listed:
            continue
        import mlflow.artifacts

        retried(f"run {run_id}: downloading {path} from {uri}",
                lambda path=path: mlflow.artifacts.download_artifacts(
                    run_id=run_id, artifact_path=path, dst_path=str(tmp), tracking_uri=uri))
    return tmp


def _listed(client: StoreClient, uri: str, run_id: str, directory: str) -> set[str]:
    """The paths in one artifact directory of a run; empty when the store says the
    directory does not exist.  Transient errors propagate (for :func:`retried`); any
    other answer is a one-line error."""
    try:
        return {f.path for f in client.list_artifacts(run_id, directory)}
    except refusals() as exc:
        if transient_read_error(exc):
            raise
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return set()  # the store says the directory is not there
        raise RefrunInputError(f"run {run_id}: listing its artifacts in {uri}: "
                               f"{' '.join(str(exc).split())[:200]}") from exc


def load_runs(run_ids: Sequence[str], metrics: Sequence[str] | None = None,
              tracking_uri: str | None = None, progress: bool = True) -> list[RunData]:
    """Load several runs (e.g. a reference group of seeds), in the given order."""
    return [load_run(r, metrics, tracking_uri, progress) for r in run_ids]


def find_run_ids(workload: str, role: str | None = None, *, hardware: str | None = None,
                 backend: str | None = None, seed: int | str | None = None,
                 chips: int | str | None = None, tracking_uri: str | None = None) -> list[str]:
    """Ids of runs matching identity tags (``refrun.workload`` ...), newest first."""
    table = list_runs(workload, role=role, tracking_uri=tracking_uri, hardware=hardware,
                      backend=backend, seed=None if seed is None else str(seed),
                      chips=None if chips is None else str(chips))
    return [str(r) for r in table["run_id"]]


def load_query(workload: str, role: str | None = None, *, hardware: str | None = None,
               backend: str | None = None, seed: int | str | None = None,
               chips: int | str | None = None, metrics: Sequence[str] | None = None,
               tracking_uri: str | None = None, progress: bool = True) -> list[RunData]:
    """Load every run matching the identity tags; raises when none match."""
    ids = find_run_ids(workload, role, hardware=hardware, backend=backend, seed=seed,
                       chips=chips, tracking_uri=tracking_uri)
    if not ids:
        query = {k: v for k, v in dict(workload=workload, role=role, hardware=hardware,
                                       backend=backend, seed=seed, chips=chips).items()
                 if v is not None}
        raise RefrunInputError(f"no runs match {query}")
    return load_runs(ids, metrics, tracking_uri, progress)


def _get_run(client: StoreClient, uri: str, run_id: str) -> Run:
    try:
        return client.get_run(run_id)
    except refusals() as exc:
        raise RefrunInputError(f"run {run_id!r}: not found in {uri}") from exc


def _wait_until_complete(client: StoreClient, uri: str, run: Run,
                         curves: pd.DataFrame | None, metrics: Sequence[str] | None,
                         wait_s: float) -> tuple[Run, pd.DataFrame | None]:
    """``(run, curves)`` once the run is complete; refuses it after ``wait_s`` seconds."""
    run_id = run.info.run_id
    start = time.monotonic()
    shown = None
    while True:
        why = incomplete_reason(run.info.status, curves is not None, run.data.tags)
        if why is None:
            return run, curves
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise RefrunInputError(
                f"run {run_id} {why}; refused after waiting {wait_s:g} s: refrun never "
                "compares partial data (wait longer with --wait SECONDS, or deliver a "
                "stopped run with `refrun sync`)")
        if shown is None or waited - shown >= _PROGRESS_EVERY_S:
            shown = waited
            print(f"refrun: waiting for run {run_id}: it {why} ({waited:.0f} s of at most "
                  f"{wait_s:g} s)", file=sys.stderr, flush=True)
        time.sleep(min(_POLL_S, max(0.0, wait_s - waited)))
        run = _get_run(client, uri, run_id)
        curves = _read_artifact(client, uri, run_id, run.info.artifact_uri, metrics)


def transient_read_error(exc: BaseException) -> bool:
    """True for a store error worth retrying: no answer (connection refused or reset,
    timeout), a server error (5xx) or throttling (429).  False for an answer about the
    request itself (MLflow's 4xx: e.g. the path does not exist)."""
    if isinstance(exc, refusals()):
        code = exc.get_http_status_code()  # type: ignore[attr-defined]
        return code >= 500 or code == 429
    import requests

    return isinstance(exc, OSError | requests.exceptions.RequestException)


def retried(what: str, read: Callable[[], T], pauses: Sequence[float] | None = None) -> T:
    """``read()``, tried again after each of ``pauses`` (default
    :data:`READ_RETRY_PAUSES_S`) while it fails transiently (:func:`transient_read_error`);
    then a one-line :class:`RefrunInputError` naming ``what`` and the last error.  Other
    errors propagate at once."""
    pauses = READ_RETRY_PAUSES_S if pauses is None else pauses
    for attempt in range(len(pauses) + 1):
        try:
            return read()
        except Exception as exc:
            if not transient_read_error(exc):
                raise
            if attempt == len(pauses):
                msg = " ".join(str(exc).split())[:200]
                raise RefrunInputError(f"{what} failed {attempt + 1} times "
                                       f"({type(exc).__name__}: {msg}); not read, nothing "
                                       "compared on partial data") from exc
            time.sleep(pauses[attempt])
    raise AssertionError("unreachable")


def _read_artifact(client: StoreClient, uri: str, run_id: str, artifact_uri: str | None,
                   metrics: Sequence[str] | None) -> pd.DataFrame | None:
    """The run's curves artifact, or None only when the store says there is none."""
    local = local_path(artifact_uri)
    if local is not None:
        # Read in place: no copy of a multi-hundred-MB artifact, no download progress bar.
        path = local / schema.ARTIFACT_CURVES
        try:
            path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # unreadable is not absent
            raise RefrunInputError(f"run {run_id}: {path}: cannot read ({exc.strerror})"
                                   ) from exc
        return _of_run(run_id, lambda: read_curves_fast(path, metrics))

    listed = retried(f"run {run_id}: listing its artifacts in {uri}",
                     lambda: _listed(client, uri, run_id, schema.ARTIFACT_DIR))
    if schema.ARTIFACT_CURVES not in listed:
        return None
    with tempfile.TemporaryDirectory(prefix="refrun-load-") as tmp:
        import mlflow.artifacts

        path = retried(f"run {run_id}: downloading {schema.ARTIFACT_CURVES} from {uri}",
                       lambda: mlflow.artifacts.download_artifacts(
                           run_id=run_id, artifact_path=schema.ARTIFACT_CURVES,
                           dst_path=tmp, tracking_uri=uri))
        return _of_run(run_id, lambda: read_curves_fast(Path(path), metrics))


def _of_run(run_id: str, read: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """``read()``, its refusal naming the run whose artifact it is."""
    try:
        return read()
    except RefrunInputError as exc:
        raise RefrunInputError(f"run {run_id}: {exc}") from exc


def read_curves_fast(path: Path, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Read a curves artifact keeping ``metric`` categorical (no per-row string objects).

    A file that is not a curves artifact (empty or cut short by an interrupted upload, not
    Parquet, without the columns of :data:`refrun.schema.CURVE_COLUMNS`) is a one-line
    :class:`RefrunInputError` naming it: a broken artifact is never a verdict."""
    filters = [("metric", "in", list(metrics))] if metrics else None
    try:
        table = pq.read_table(path, filters=filters)
    except (pa.ArrowException, OSError, ValueError) as exc:
        size = _size(path)
        raise RefrunInputError(f"{path}: not a readable curves artifact ({size}; "
                               f"{' '.join(str(exc).split())[:160]}); refused, nothing "
                               "compared") from exc
    missing = [c for c in schema.CURVE_COLUMNS if c not in table.column_names]
    if missing:
        raise RefrunInputError(f"{path}: not a curves artifact (no column "
                               f"{', '.join(missing)}); refused, nothing compared")
    df = table.to_pandas()
    if not isinstance(df["metric"].dtype, pd.CategoricalDtype):
        df["metric"] = df["metric"].astype("category")
    return df


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size:,} bytes"
    except OSError as exc:
        return f"cannot stat: {exc.strerror}"


def history_values(values: np.ndarray) -> np.ndarray:
    """Values as logged, from values as MLflow's store returns them: +-float max
    (1.7976931348623157e308, how MLflow stores +-inf) becomes +-inf again, so a
    non-finite loss never reads as a finite number.  A value that really was float max
    reads as inf (MLflow keeps no difference)."""
    out = np.array(values, dtype=np.float64)
    out[out == FLOAT_MAX] = np.inf
    out[out == -FLOAT_MAX] = -np.inf
    return out


def _read_history(client: StoreClient, run_id: str, keys: list[str],
                  metrics: Sequence[str] | None, progress: bool) -> pd.DataFrame:
    from tqdm.auto import tqdm

    wanted = [k for k in sorted(keys) if not metrics or k in metrics]
    frames = []
    for key in tqdm(wanted, desc=f"metric history {run_id[:8]}", unit="metric",
                    disable=not progress or len(wanted) == 0, leave=False):
        hist = retried(f"run {run_id}: reading the metric history of {key!r}",
                       lambda k=key: client.get_metric_history(run_id, k))
        frames.append(pd.DataFrame({
            "metric": key,
            "step": np.fromiter((m.step for m in hist), np.int64, len(hist)),
            "value": history_values(np.fromiter((m.value for m in hist), np.float64,
                                                len(hist))),
            "timestamp_ms": np.fromiter((m.timestamp for m in hist), np.int64, len(hist)),
        }))
    if not frames:
        df = pd.DataFrame({c: pd.Series(dtype=t) for c, t in CURVE_DTYPES.items()})
        df.insert(0, "metric", pd.Series(dtype="category"))
        return df
    df = pd.concat(frames, ignore_index=True)
    # MLflow does not keep the logging order: (timestamp, step) is the best proxy, so
    # "last wins" for a repeated step follows the logged timestamps.
    df = df.sort_values(["metric", "timestamp_ms", "step"], kind="stable", ignore_index=True)
    df["seq"] = np.arange(len(df), dtype=np.int64)
    df["metric"] = df["metric"].astype("category")
    return df
