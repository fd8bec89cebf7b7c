"""A local MLflow sqlite store read and written with the standard library's ``sqlite3``,
for the operations of a command that owns its process (``refrun accept``, ``compare``).

Why: a command's own work (loading, alignment, the checks, writing one comparison run)
takes well under half a second; importing MLflow's client and its SQLAlchemy store takes
two to four (``mlflow/__init__`` imports its GenAI, model and server layers; SQLAlchemy,
alembic and 68 migration scripts are loaded to check the schema).  Assessing one
candidate must cost what it does, not what MLflow's start-up does (issue 25).

Scope, kept small on purpose:

* only a ``sqlite:///`` store whose schema revision (``alembic_version``) is one of
  :data:`KNOWN_REVISIONS`: the schemas of MLflow releases this module was tested against
  (``tests/test_store_direct.py`` writes through both and reads both back through MLflow).
  Any other revision, a store that does not exist yet, an experiment that does not exist
  yet, or a run whose artifacts are not on this machine goes through MLflow's client as
  before (:func:`usable` says which), so a newer MLflow never meets a writer that does
  not know its schema;
* the methods of ``MlflowClient`` that loading a run and writing a complete run call, with
  the same arguments and the same semantics as MLflow's SQLAlchemy store (``get_run``'s
  metrics are the latest values; NaN is stored as 0 with ``is_nan``, +-inf as +-float max;
  setting ``mlflow.runName`` renames the run; a param cannot change value; runs are
  written with MLflow's defaults for every column MLflow fills);
* entities are small frozen dataclasses with MLflow's attribute names (``run.info.run_id``,
  ``run.data.tags`` ...), so the code that reads them does not know which client it has.

``$REFRUN_SQLITE_DIRECT=0`` turns it off (every store access through MLflow's client).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from refrun import schema
from refrun.settings import sqlite_direct

KNOWN_REVISIONS = frozenset({
    "dc11669786a5",  # MLflow 3.17.2
})
"""``alembic_version.version_num`` of the MLflow schemas this module reads and writes."""

FLOAT_MAX = 1.7976931348623157e308  # how MLflow's SQL stores keep +-inf
RUN_NAME_TAG = schema.TAG_RUN_NAME
USER_TAG = schema.TAG_MLFLOW_USER
_ACTIVE = "active"
_DELETED = "deleted"
_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")


class DirectStoreError(Exception):
    """A request the store refuses, with MLflow's error code
    (``RESOURCE_DOES_NOT_EXIST``, ``INVALID_PARAMETER_VALUE``, ``INVALID_STATE``)."""

    def __init__(self, message: str, error_code: str) -> None:
        super().__init__(message)
        self.error_code = error_code

    def get_http_status_code(self) -> int:
        """As ``MlflowException``'s: 404 for a missing resource, else 400."""
        return 404 if self.error_code == "RESOURCE_DOES_NOT_EXIST" else 400


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric point (``mlflow.entities.Metric``'s fields)."""

    key: str
    value: float
    timestamp: int
    step: int


@dataclass(frozen=True, slots=True)
class Param:
    key: str
    value: str


@dataclass(frozen=True, slots=True)
class RunTag:
    key: str
    value: str


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: str
    experiment_id: str
    run_name: str
    user_id: str
    status: str
    start_time: int | None
    end_time: int | None
    artifact_uri: str
    lifecycle_stage: str


@dataclass(frozen=True, slots=True)
class RunData:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Run:
    info: RunInfo
    data: RunData


@dataclass(frozen=True, slots=True)
class Experiment:
    experiment_id: str
    name: str
    artifact_location: str
    lifecycle_stage: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FileInfo:
    path: str
    is_dir: bool
    file_size: int | None


def enabled() -> bool:
    """False when ``$REFRUN_SQLITE_DIRECT`` is ``0`` (declared in :mod:`refrun.settings`)."""
    return sqlite_direct()


def schema_revision(path: Path, timeout_s: float = 15.0) -> str | None:
    """The store's ``alembic_version``, or None when it cannot be read (left to the
    checks of :mod:`refrun.store.health`, which run before any use)."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error:
        return None
    with contextlib.closing(con):
        try:
            rows = con.execute("SELECT version_num FROM alembic_version").fetchall()
        except sqlite3.Error:
            return None
    return str(rows[0][0]) if len(rows) == 1 else None


def local_path(uri: str | None) -> Path | None:
    """The directory an artifact URI names when it is on this machine's file system."""
    if not uri:
        return None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    if parsed.scheme == "":
        return Path(uri)
    return None


def usable(path: Path | None, timeout_s: float = 15.0) -> bool:
    """True when the sqlite store at ``path`` exists and has a schema this module knows
    (and direct access is not turned off)."""
    return (path is not None and enabled() and path.is_file()
            and schema_revision(path, timeout_s) in KNOWN_REVISIONS)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _stored(value: float) -> tuple[float, int]:
    """(value, is_nan) as MLflow's SQL store keeps a metric value."""
    if math.isnan(value):
        return 0.0, 1
    if math.isinf(value):
        return (FLOAT_MAX if value > 0 else -FLOAT_MAX), 0
    return float(value), 0


def _read(value: float, is_nan: int) -> float:
    return math.nan if is_nan else float(value)


class DirectClient:
    """The subset of ``MlflowClient`` refrun's loading and complete-run writing call, on a
    local sqlite store of a known schema (:func:`usable`).  One connection per call, so
    an instance may be shared by threads; writes are single transactions that wait up to
    ``timeout_s`` for another writer's lock, as MLflow's own do."""

    def __init__(self, uri: str, path: Path, timeout_s: float = 15.0) -> None:
        self.tracking_uri = uri
        self.path = path
        self.timeout_s = timeout_s

    # -- connections ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _db(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        try:
            con.execute("PRAGMA foreign_keys = ON")
            if write:
                con.execute("BEGIN IMMEDIATE")  # the write lock now, not at the first write
                try:
                    yield con
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
                con.execute("COMMIT")
            else:
                yield con
        finally:
            con.close()

    # -- experiments ---------------------------------------------------------------------
    def _experiment(self, con: sqlite3.Connection, where: str, arg: Any) -> Experiment | None:
        row = con.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage "
                          f"FROM experiments WHERE {where}", (arg,)).fetchone()
        if row is None:
            return None
        tags = dict(con.execute("SELECT key, value FROM experiment_tags WHERE "
                                "experiment_id = ?", (row[0],)).fetchall())
        return Experiment(str(row[0]), row[1], row[2] or "", row[3], tags)

    def get_experiment_by_name(self, name: str) -> Experiment | None:
        with self._db() as con:
            return self._experiment(con, "name = ? AND workspace = 'default'", name)

    def get_experiment(self, experiment_id: str) -> Experiment:
        with self._db() as con:
            exp = self._experiment(con, "experiment_id = ?", int(experiment_id))
        if exp is None:
            raise DirectStoreError(f"No Experiment with id={experiment_id} exists",
                                   "RESOURCE_DOES_NOT_EXIST")
        return exp

    def search_experiments(self, max_results: int = 1000) -> list[Experiment]:
        with self._db() as con:
            ids = [r[0] for r in con.execute(
                "SELECT experiment_id FROM experiments WHERE lifecycle_stage = ? "
                "ORDER BY creation_time DESC, experiment_id LIMIT ?",
                (_ACTIVE, int(max_results))).fetchall()]
            found = [self._experiment(con, "experiment_id = ?", i) for i in ids]
        return [e for e in found if e is not None]

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        with self._db(write=True) as con:
            exp = self._experiment(con, "experiment_id = ?", int(experiment_id))
            if exp is None or exp.lifecycle_stage != _ACTIVE:
                raise DirectStoreError(f"experiment {experiment_id} is not active",
                                       "INVALID_STATE")
            con.execute("INSERT INTO experiment_tags (key, value, experiment_id) "
                        "VALUES (?, ?, ?) ON CONFLICT (key, experiment_id) DO UPDATE "
                        "SET value = excluded.value", (key, value, int(experiment_id)))

    # -- runs: reading -------------------------------------------------------------------
    def get_run(self, run_id: str) -> Run:
        with self._db() as con:
            row = con.execute(
                "SELECT run_uuid, experiment_id, name, user_id, status, start_time, "
                "end_time, artifact_uri, lifecycle_stage FROM runs WHERE run_uuid = ?",
                (run_id,)).fetchone()
            if row is None:
                raise DirectStoreError(f"Run with id={run_id} not found",
                                       "RESOURCE_DOES_NOT_EXIST")
            metrics = {k: _read(v, n) for k, v, n in con.execute(
                "SELECT key, value, is_nan FROM latest_metrics WHERE run_uuid = ?",
                (run_id,))}
            params = dict(con.execute("SELECT key, value FROM params WHERE run_uuid = ?",
                                      (run_id,)).fetchall())
            tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?",
                                    (run_id,)).fetchall())
        info = RunInfo(run_id=row[0], experiment_id=str(row[1]), run_name=row[2] or "",
                       user_id=row[3] or "", status=row[4], start_time=row[5],
                       end_time=row[6], artifact_uri=row[7] or "", lifecycle_stage=row[8])
        return Run(info, RunData(metrics, params, tags))

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        """Every point of ``key``, ordered as MLflow orders them (timestamp, step, value)."""
        with self._db() as con:
            if con.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() \
                    is None:  # a missing run is an error, as in MLflow
                raise DirectStoreError(f"Run with id={run_id} not found",
                                       "RESOURCE_DOES_NOT_EXIST")
            rows = con.execute(
                "SELECT value, is_nan, timestamp, step FROM metrics WHERE run_uuid = ? AND "
                "key = ? ORDER BY timestamp, step, value", (run_id, key)).fetchall()
        return [Metric(key, _read(v, n), int(t), int(s)) for v, n, t, s in rows]

    def _artifact_root(self, run_id: str) -> Path:
        root = local_path(self.get_run(run_id).info.artifact_uri)
        if root is None:
            raise DirectStoreError(f"run {run_id}: its artifacts are not on this machine",
                                   "INVALID_STATE")
        return root

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[FileInfo]:
        """As MLflow's local artifact repository lists them: the entries of one
        directory, paths relative to the run's artifact root; empty when it is missing."""
        root = self._artifact_root(run_id)
        where = root / path if path else root
        if not where.is_dir():
            return []
        out = []
        for entry in sorted(where.iterdir()):
            rel = entry.relative_to(root).as_posix()
            out.append(FileInfo(rel, True, None) if entry.is_dir()
                       else FileInfo(rel, False, entry.stat().st_size))
        return out

    # -- runs: writing -------------------------------------------------------------------
    def create_run(self, experiment_id: str, start_time: int | None = None,
                   tags: dict[str, str] | None = None, run_name: str | None = None) -> Run:
        tags = dict(tags or {})
        if run_name and tags.get(RUN_NAME_TAG, run_name) != run_name:
            raise DirectStoreError(f"Both 'run_name' argument and '{RUN_NAME_TAG}' tag are "
                                   "specified, but with different values",
                                   "INVALID_PARAMETER_VALUE")
        exp = self.get_experiment(experiment_id)
        if exp.lifecycle_stage != _ACTIVE:
            raise DirectStoreError(f"experiment {experiment_id} is not active",
                                   "INVALID_STATE")
        run_name = run_name or tags.get(RUN_NAME_TAG) or f"run-{uuid.uuid4().hex[:8]}"
        tags[RUN_NAME_TAG] = run_name
        run_id = uuid.uuid4().hex
        artifact_uri = f"{exp.artifact_location.rstrip('/')}/{run_id}/artifacts"
        with self._db(write=True) as con:
            con.execute(
                "INSERT INTO runs (run_uuid, name, source_type, source_name, "
                "entry_point_name, user_id, status, start_time, end_time, source_version, "
                "lifecycle_stage, artifact_uri, experiment_id, deleted_time) VALUES "
                "(?, ?, 'UNKNOWN', '', '', ?, 'RUNNING', ?, NULL, '', ?, ?, ?, NULL)",
                (run_id, run_name, tags.get(USER_TAG, "unknown"),
                 start_time if start_time is not None else _now_ms(), _ACTIVE,
                 artifact_uri, int(experiment_id)))
            con.executemany("INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?)",
                            [(k, v, run_id) for k, v in tags.items()])
        return self.get_run(run_id)

    def _active(self, con: sqlite3.Connection, run_id: str) -> None:
        row = con.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?",
                          (run_id,)).fetchone()
        if row is None:
            raise DirectStoreError(f"Run with id={run_id} not found",
                                   "RESOURCE_DOES_NOT_EXIST")
        if row[0] != _ACTIVE:
            raise DirectStoreError(f"The run {run_id} must be in the 'active' state",
                                   "INVALID_STATE")

    def log_batch(self, run_id: str, metrics: Sequence[Any] = (),
                  params: Sequence[Any] = (), tags: Sequence[Any] = ()) -> None:
        """Params, tags and metric points in one transaction (MLflow's ``log_batch``)."""
        with self._db(write=True) as con:
            self._active(con, run_id)
            self._params(con, run_id, params)
            self._tags(con, run_id, tags)
            self._metrics(con, run_id, metrics)

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.log_batch(run_id, tags=[RunTag(key, str(value))])

    @staticmethod
    def _params(con: sqlite3.Connection, run_id: str, params: Iterable[Any]) -> None:
        for p in params:
            old = con.execute("SELECT value FROM params WHERE run_uuid = ? AND key = ?",
                              (run_id, p.key)).fetchone()
            if old is None:
                con.execute("INSERT INTO params (key, value, run_uuid) VALUES (?, ?, ?)",
                            (p.key, str(p.value), run_id))
            elif old[0] != str(p.value):
                raise DirectStoreError(f"Changing param values is not allowed. Param with "
                                       f"key='{p.key}' was already logged with "
                                       f"value='{old[0]}' for run ID='{run_id}'",
                                       "INVALID_PARAMETER_VALUE")

    @staticmethod
    def _tags(con: sqlite3.Connection, run_id: str, tags: Iterable[Any]) -> None:
        for t in tags:
            con.execute("INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?) "
                        "ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value",
                        (t.key, str(t.value), run_id))
            if t.key == RUN_NAME_TAG:  # MLflow keeps the name in two places
                con.execute("UPDATE runs SET name = ? WHERE run_uuid = ?",
                            (str(t.value), run_id))

    @staticmethod
    def _metrics(con: sqlite3.Connection, run_id: str, metrics: Sequence[Any]) -> None:
        if not metrics:
            return
        rows = []
        latest: dict[str, tuple[int, int, float, int]] = {}
        for m in metrics:
            value, is_nan = _stored(float(m.value))
            step, stamp = int(m.step), int(m.timestamp)
            rows.append((m.key, value, stamp, run_id, step, is_nan))
            best = latest.get(m.key)
            if best is None or (step, stamp, value) > best[:3]:
                latest[m.key] = (step, stamp, value, is_nan)
        # The same point twice is one point (MLflow's primary key; it drops duplicates).
        con.executemany("INSERT OR IGNORE INTO metrics (key, value, timestamp, run_uuid, "
                        "step, is_nan) VALUES (?, ?, ?, ?, ?, ?)", rows)
        for key, (step, stamp, value, is_nan) in latest.items():
            old = con.execute("SELECT step, timestamp, value FROM latest_metrics WHERE "
                              "run_uuid = ? AND key = ?", (run_id, key)).fetchone()
            if old is not None and (step, stamp, value) <= tuple(old):
                continue
            con.execute("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, "
                        "run_uuid) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key, run_uuid) "
                        "DO UPDATE SET value = excluded.value, timestamp = "
                        "excluded.timestamp, step = excluded.step, is_nan = excluded.is_nan",
                        (key, value, stamp, step, is_nan, run_id))

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None
                      ) -> None:
        """Copy the tree under ``local_dir`` into the run's artifact directory (what
        MLflow's local artifact repository does)."""
        root = self._artifact_root(run_id)
        dest = root / artifact_path if artifact_path else root
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(local_dir, dest, dirs_exist_ok=True)

    def set_terminated(self, run_id: str, status: str = "FINISHED",
                       end_time: int | None = None) -> None:
        if status not in _STATUSES:
            raise DirectStoreError(f"unknown run status {status!r}",
                                   "INVALID_PARAMETER_VALUE")
        with self._db(write=True) as con:
            self._active(con, run_id)
            con.execute("UPDATE runs SET status = ?, end_time = ? WHERE run_uuid = ?",
                        (status, end_time if end_time is not None else _now_ms(), run_id))

    def delete_run(self, run_id: str) -> None:
        with self._db(write=True) as con:
            self._active(con, run_id)
            con.execute("UPDATE runs SET lifecycle_stage = ?, deleted_time = ? "
                        "WHERE run_uuid = ?", (_DELETED, _now_ms(), run_id))

