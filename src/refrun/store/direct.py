"""A local MLflow sqlite store read and written with the standard library's ``sqlite3``,
for the operations of a command that owns its process (``refrun accept``, ``compare``,
``report``, ``import``).

Why: a command's own work (loading, alignment, the checks, writing one comparison run)
takes well under half a second; importing MLflow's client and its SQLAlchemy store takes
two to four (``mlflow/__init__`` imports its GenAI, model and server layers; SQLAlchemy,
alembic and 68 migration scripts are loaded to check the schema).  Assessing one
candidate must cost what it does, not what MLflow's start-up does (issue 25).

It is a second implementation of a small part of MLflow's SQL store, so it serves a store
only where it is known to give MLflow's client's answer, and declines otherwise
(:func:`decline_reason`; the caller then uses MLflow's client, which applies its own
rules, refusals included):

* the ``mlflow`` package that MLflow's client would import is a release of
  :data:`KNOWN_SCHEMAS` (read from its ``version.py``, without importing it), and the
  store's schema revision (``alembic_version``) is that release's: MLflow's client
  refuses a store of another revision (``mlflow db upgrade``), and a release refrun was
  not tested with may change what a call means.  Every other release pyproject allows
  (``mlflow-skinny>=3.0,<4``) is served by MLflow's client;
* MLflow's workspaces (``MLFLOW_ENABLE_WORKSPACES``, ``MLFLOW_WORKSPACE``; MLflow
  3.17.2's ``WorkspaceAwareSqlAlchemyStore``): with workspaces on, every experiment and
  run outside the active workspace does not exist (the workspace is read at each call,
  as MLflow reads it: ``mlflow.set_workspace()`` in this process, else
  ``$MLFLOW_WORKSPACE``); on without an active workspace, or off on a store holding
  experiments of other workspaces (MLflow refuses to open it then), it declines;
* the calls of :class:`refrun.store.surface.StoreClient` (what loading a run and writing a
  complete run use), with MLflow's semantics and error codes: ``get_run``'s metrics are
  the latest values (by step, then time, then value); NaN is stored as 0 with
  ``is_nan``, +-inf as +-float max; setting ``mlflow.runName`` renames the run; a param
  cannot change value; a deleted run is read but not written; the metric history of a
  run that does not exist is empty (MLflow's single-tenant store) or an error (its
  workspace store);
* one transaction per call: a read of a run (its row, latest metrics, params, tags) sees
  one state of the store; a write is ``BEGIN IMMEDIATE`` (the write lock at once, waiting
  up to the store timeout for another writer's, as MLflow's own writes do);
* entities are small frozen dataclasses with MLflow's attribute names (``run.info.run_id``,
  ``run.data.tags`` ...), so the code that reads them does not know which client it has.

``tests/test_store_direct.py`` runs every call both ways on a matrix of store features
(workspaces on and off, NaN and +-inf, a renamed run, a deleted run, artifacts elsewhere)
and compares the answers.  ``$REFRUN_SQLITE_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import sqlite3
import sys
import tempfile
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

KNOWN_SCHEMAS: dict[str, str] = {
    "3.17.2": "dc11669786a5",
}
"""MLflow release -> the schema revision (``alembic_version.version_num``) it creates and
accepts: the releases this module was tested against (``tests/test_store_direct.py``)."""
KNOWN_REVISIONS = frozenset(KNOWN_SCHEMAS.values())

ENABLE_WORKSPACES_ENV = "MLFLOW_ENABLE_WORKSPACES"  # MLflow's own settings, read as it does
WORKSPACE_ENV = "MLFLOW_WORKSPACE"
DEFAULT_WORKSPACE = "default"
FLOAT_MAX = 1.7976931348623157e308  # how MLflow's SQL stores keep +-inf
RUN_NAME_TAG = schema.TAG_RUN_NAME
USER_TAG = schema.TAG_MLFLOW_USER
ARTIFACTS_FOLDER = "artifacts"
UPLOADING_PREFIX = ".artifact.uploading."  # MLflow's local repository hides these files
_ACTIVE = "active"
_DELETED = "deleted"
_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
NOT_FOUND, BAD_VALUE = "RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"
NO_WORKSPACE = ("Active workspace is required. Configure a default workspace or call "
                "mlflow.set_workspace() before interacting with the store.")


class DirectStoreError(Exception):
    """A request the store refuses, with MLflow's error code (``RESOURCE_DOES_NOT_EXIST``,
    ``INVALID_PARAMETER_VALUE``, ``INVALID_STATE``)."""

    def __init__(self, message: str, error_code: str) -> None:
        super().__init__(message)
        self.error_code = error_code

    def get_http_status_code(self) -> int:
        """As ``MlflowException``'s: 404 for a missing resource, else 400."""
        return 404 if self.error_code == NOT_FOUND else 400


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


# --- when this module may serve a store ------------------------------------------------------
def enabled() -> bool:
    """False when ``$REFRUN_SQLITE_DIRECT`` is ``0`` (declared in :mod:`refrun.settings`)."""
    return sqlite_direct()


def schema_revision(path: Path, timeout_s: float = 15.0) -> str | None:
    """The store's ``alembic_version``, or None when it cannot be read (left to the
    checks of :mod:`refrun.store.health`, which run before any use)."""
    found = _read_only(path, "SELECT version_num FROM alembic_version", timeout_s)
    return str(found[0][0]) if found is not None and len(found) == 1 else None


def _read_only(path: Path, sql: str, timeout_s: float) -> list[tuple[Any, ...]] | None:
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error:
        return None
    with contextlib.closing(con):
        try:
            return con.execute(sql).fetchall()
        except sqlite3.Error:
            return None


_VERSION_LINE = re.compile(r'^VERSION\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)


def mlflow_version() -> str | None:
    """The version of the ``mlflow`` package MLflow's client would import here (its
    ``version.py``, read without importing MLflow: ``import mlflow`` takes seconds), or
    None when there is none."""
    try:
        spec = importlib.util.find_spec("mlflow")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        m = _VERSION_LINE.search(text)
        if m:
            return m.group(1)
    return None


def workspaces_enabled() -> bool | None:
    """``$MLFLOW_ENABLE_WORKSPACES`` read as MLflow reads it (unset: off; ``true``/``1``,
    ``false``/``0`` in any case); None for any other value (MLflow refuses it)."""
    raw = os.environ.get(ENABLE_WORKSPACES_ENV)
    if raw is None:
        return False
    low = raw.lower()
    return True if low in ("true", "1") else False if low in ("false", "0") else None


def active_workspace() -> str | None:
    """The workspace MLflow's client would use now: the one ``mlflow.set_workspace()`` set
    in this context (only when MLflow is imported: nothing else can set it), else
    ``$MLFLOW_WORKSPACE``; None when neither names one."""
    context = sys.modules.get("mlflow.utils.workspace_context")
    if context is not None:
        found = context.get_request_workspace()
        return str(found) if found else None
    return (os.environ.get(WORKSPACE_ENV) or "").strip() or None


def decline_reason(path: Path | None, timeout_s: float = 15.0,
                   version: str | None = None) -> str | None:
    """Why this module must not serve the sqlite store at ``path`` (MLflow's client does
    then), or None when it may.  ``version``: the MLflow release to judge for (default:
    the installed one, :func:`mlflow_version`)."""
    if not enabled():
        return "$REFRUN_SQLITE_DIRECT=0"
    if path is None or not path.is_file():
        return "no sqlite store there yet (MLflow creates it)"
    version = version or mlflow_version()
    want = KNOWN_SCHEMAS.get(version or "")
    if want is None:
        return (f"MLflow {version or '(not installed)'} is not a release this module was "
                f"tested with ({', '.join(KNOWN_SCHEMAS)})")
    have = schema_revision(path, timeout_s)
    if have != want:
        return f"schema revision {have} is not MLflow {version}'s {want}"
    ws = workspaces_enabled()
    if ws is None:
        return f"${ENABLE_WORKSPACES_ENV}={os.environ.get(ENABLE_WORKSPACES_ENV)!r}"
    if ws and active_workspace() is None:
        return "workspaces on without an active workspace (MLflow refuses every call)"
    if not ws and _read_only(path, "SELECT 1 FROM experiments WHERE workspace IS NOT NULL "
                             f"AND workspace != '{DEFAULT_WORKSPACE}' LIMIT 1", timeout_s):
        return "workspaces off on a store with experiments in other workspaces"
    return None


def usable(path: Path | None, timeout_s: float = 15.0) -> bool:
    """True when this module may serve the sqlite store at ``path``
    (:func:`decline_reason` has nothing against it)."""
    return decline_reason(path, timeout_s) is None


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


def _not_found(run_id: str) -> DirectStoreError:
    return DirectStoreError(f"Run with id={run_id} not found", NOT_FOUND)


_RUN_COLUMNS = ("r.run_uuid, r.experiment_id, r.name, r.user_id, r.status, r.start_time, "
                "r.end_time, r.artifact_uri, r.lifecycle_stage")


def _publish(src: str, dest: Path) -> None:
    """Copy ``src`` to ``dest`` as MLflow's local artifact repository publishes a file:
    into a hidden file beside it (``.artifact.uploading.*``, which listings leave out),
    its times and mode kept, then renamed over ``dest``, so a reader never sees half a
    file and a failed copy leaves nothing."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=UPLOADING_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as data:
            shutil.copyfileobj(data, out)
        shutil.copystat(src, tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class DirectClient:
    """The calls of :class:`refrun.store.surface.StoreClient` on a local sqlite store this
    module may serve (:func:`usable`).  One connection and one transaction per call, so
    an instance may be shared by threads; a write waits up to ``timeout_s`` for another
    writer's lock, as MLflow's own do.  ``workspaces``: MLflow's workspaces are on (the
    active workspace is read at each call)."""

    def __init__(self, uri: str, path: Path, timeout_s: float = 15.0, *,
                 workspaces: bool = False) -> None:
        self.tracking_uri = uri
        self.path = path
        self.timeout_s = timeout_s
        self.workspaces = workspaces

    # -- connections and scope -----------------------------------------------------------
    @contextlib.contextmanager
    def _db(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection inside one transaction: ``BEGIN IMMEDIATE`` for a write (the write
        lock now, not at the first write), ``BEGIN`` for a read (every SELECT of the call
        sees one state of the store); committed at the end, rolled back on an error."""
        con = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        try:
            con.execute("PRAGMA foreign_keys = ON")
            con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    def _workspace(self) -> str | None:
        """The active workspace when workspaces are on (None when off): MLflow's error
        when none is active."""
        if not self.workspaces:
            return None
        ws = active_workspace()
        if ws is None:
            raise DirectStoreError(NO_WORKSPACE, BAD_VALUE)
        return ws

    def _scope(self, alias: str = "") -> tuple[str, tuple[str, ...]]:
        """(SQL condition, its argument) limiting experiments to the active workspace."""
        ws = self._workspace()
        col = f"{alias}.workspace" if alias else "workspace"
        return ("", ()) if ws is None else (f" AND {col} = ?", (ws,))

    # -- experiments ---------------------------------------------------------------------
    def _experiment(self, con: sqlite3.Connection, where: str, arg: Any) -> Experiment | None:
        cond, ws = self._scope()
        row = con.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage "
                          f"FROM experiments WHERE {where}{cond}", (arg, *ws)).fetchone()
        if row is None:
            return None
        tags = dict(con.execute("SELECT key, value FROM experiment_tags WHERE "
                                "experiment_id = ?", (row[0],)).fetchall())
        return Experiment(str(row[0]), row[1], row[2] or "", row[3], tags)

    def _experiment_by_id(self, con: sqlite3.Connection, experiment_id: str) -> Experiment:
        exp = self._experiment(con, "experiment_id = ?", int(experiment_id))
        if exp is None:
            raise DirectStoreError(f"No Experiment with id={experiment_id} exists", NOT_FOUND)
        return exp

    def get_experiment_by_name(self, name: str) -> Experiment | None:
        with self._db() as con:
            return self._experiment(con, "name = ?", name)

    def get_experiment(self, experiment_id: str) -> Experiment:
        with self._db() as con:
            return self._experiment_by_id(con, experiment_id)

    def search_experiments(self, max_results: int = 1000) -> list[Experiment]:
        """Active experiments, newest first (MLflow's default order and view)."""
        with self._db() as con:
            cond, ws = self._scope()
            ids = [r[0] for r in con.execute(
                f"SELECT experiment_id FROM experiments WHERE lifecycle_stage = ?{cond} "
                "ORDER BY creation_time DESC, experiment_id LIMIT ?",
                (_ACTIVE, *ws, int(max_results))).fetchall()]
            found = [self._experiment(con, "experiment_id = ?", i) for i in ids]
        return [e for e in found if e is not None]

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        with self._db(write=True) as con:
            exp = self._experiment_by_id(con, experiment_id)
            if exp.lifecycle_stage != _ACTIVE:
                raise DirectStoreError(f"The experiment {experiment_id} must be in the "
                                       f"'active' state. Current state is "
                                       f"{exp.lifecycle_stage}.", BAD_VALUE)
            con.execute("INSERT INTO experiment_tags (key, value, experiment_id) "
                        "VALUES (?, ?, ?) ON CONFLICT (key, experiment_id) DO UPDATE "
                        "SET value = excluded.value", (key, value, int(experiment_id)))

    # -- runs: reading -------------------------------------------------------------------
    def _run_row(self, con: sqlite3.Connection, run_id: str) -> tuple[Any, ...] | None:
        cond, ws = self._scope("e")
        return con.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs r JOIN experiments e ON e.experiment_id = "
            f"r.experiment_id WHERE r.run_uuid = ?{cond}", (run_id, *ws)).fetchone()

    def _run(self, con: sqlite3.Connection, run_id: str) -> Run:
        row = self._run_row(con, run_id)
        if row is None:
            raise _not_found(run_id)
        metrics = {k: _read(v, n) for k, v, n in con.execute(
            "SELECT key, value, is_nan FROM latest_metrics WHERE run_uuid = ?", (run_id,))}
        params = dict(con.execute("SELECT key, value FROM params WHERE run_uuid = ?",
                                  (run_id,)).fetchall())
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?",
                                (run_id,)).fetchall())
        info = RunInfo(run_id=row[0], experiment_id=str(row[1]), run_name=row[2] or "",
                       user_id=row[3] or "", status=row[4], start_time=row[5],
                       end_time=row[6], artifact_uri=row[7] or "", lifecycle_stage=row[8])
        return Run(info, RunData(metrics, params, tags))

    def get_run(self, run_id: str) -> Run:
        """The run, its latest metric values, params and tags, read in one transaction."""
        with self._db() as con:
            return self._run(con, run_id)

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        """Every point of ``key``, ordered as MLflow orders them (timestamp, step, value).
        A run that does not exist has none (MLflow's single-tenant store), unless
        workspaces are on (their store checks the run is in the active workspace)."""
        with self._db() as con:
            if self.workspaces and self._run_row(con, run_id) is None:
                raise _not_found(run_id)
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
        directory (files being uploaded left out), paths relative to the run's artifact
        root, sorted by path; empty when the directory is missing."""
        root = self._artifact_root(run_id)
        where = root / os.path.normpath(path) if path else root
        if not where.is_dir():
            return []
        out = []
        for entry in where.iterdir():
            if entry.name.startswith(UPLOADING_PREFIX):
                continue
            rel = entry.relative_to(root).as_posix()
            out.append(FileInfo(rel, True, None) if entry.is_dir()
                       else FileInfo(rel, False, entry.stat().st_size))
        return sorted(out, key=lambda f: f.path)

    # -- runs: writing -------------------------------------------------------------------
    def create_run(self, experiment_id: str, start_time: int | None = None,
                   tags: dict[str, str] | None = None, *, run_name: str) -> Run:
        """A RUNNING run in an active experiment, with MLflow's defaults for every column
        MLflow fills.  ``run_name`` is required: MLflow would draw a random name
        (``bold-fox-123``) from its own word lists, and refrun always names its runs."""
        tags = dict(tags or {})
        if tags.get(RUN_NAME_TAG, run_name) != run_name:
            raise DirectStoreError(f"Both 'run_name' argument and '{RUN_NAME_TAG}' tag are "
                                   f"specified, but with different values (run_name="
                                   f"'{run_name}', {RUN_NAME_TAG}='{tags[RUN_NAME_TAG]}').",
                                   BAD_VALUE)
        tags[RUN_NAME_TAG] = run_name
        run_id = uuid.uuid4().hex
        with self._db(write=True) as con:
            exp = self._experiment_by_id(con, experiment_id)
            if exp.lifecycle_stage != _ACTIVE:
                raise DirectStoreError(f"The experiment {experiment_id} must be in the "
                                       f"'active' state. Current state is "
                                       f"{exp.lifecycle_stage}.", BAD_VALUE)
            artifact_uri = "/".join((exp.artifact_location.rstrip("/"), run_id,
                                     ARTIFACTS_FOLDER))
            con.execute(
                "INSERT INTO runs (run_uuid, name, source_type, source_name, "
                "entry_point_name, user_id, status, start_time, end_time, source_version, "
                "lifecycle_stage, artifact_uri, experiment_id, deleted_time) VALUES "
                "(?, ?, 'UNKNOWN', '', '', ?, 'RUNNING', ?, NULL, '', ?, ?, ?, NULL)",
                (run_id, run_name, tags.get(USER_TAG, "unknown"), start_time or _now_ms(),
                 _ACTIVE, artifact_uri, int(experiment_id)))
            con.executemany("INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?)",
                            [(k, v, run_id) for k, v in tags.items()])
            return self._run(con, run_id)

    def _active(self, con: sqlite3.Connection, run_id: str) -> None:
        row = self._run_row(con, run_id)
        if row is None:
            raise _not_found(run_id)
        if row[8] != _ACTIVE:
            raise DirectStoreError(f"The run {run_id} must be in the 'active' state. "
                                   f"Current state is {row[8]}.", BAD_VALUE)

    def log_batch(self, run_id: str, metrics: Sequence[Any] = (),
                  params: Sequence[Any] = (), tags: Sequence[Any] = ()) -> None:
        """Params, tags and metric points in one transaction (MLflow's ``log_batch``)."""
        with self._db(write=True) as con:
            self._active(con, run_id)
            self._params(con, run_id, params)
            self._metrics(con, run_id, metrics)
            self._tags(con, run_id, tags)

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
                                       f"value='{old[0]}' for run ID='{run_id}'", BAD_VALUE)

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
        """Copy the tree under ``local_dir`` into the run's artifact directory, as MLflow's
        local artifact repository does (``shutil.copy2`` per file: times and mode kept),
        each file published as :meth:`log_artifact` publishes one: a reader listing the
        run while it is being filled never sees half a file (MLflow's copies in place)."""
        root = self._artifact_root(run_id)
        dest = root / artifact_path if artifact_path else root
        dest.mkdir(parents=True, exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(local_dir):
            into = dest / os.path.relpath(dirpath, local_dir)
            for d in dirnames:
                (into / d).mkdir(exist_ok=True)
            for f in filenames:
                _publish(os.path.join(dirpath, f), into / f)

    def log_artifact(self, run_id: str, local_file: str, artifact_path: str | None = None
                     ) -> None:
        """Copy one file into the run's artifact directory under ``artifact_path``, as
        MLflow's local artifact repository does: into a hidden file beside the target
        (``.artifact.uploading.*``, which listings leave out), then renamed over it, so a
        reader never sees half a file; the file's times and mode are kept."""
        root = self._artifact_root(run_id)
        dest_dir = root / os.path.normpath(artifact_path) if artifact_path else root
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / os.path.basename(local_file)
        if dest.exists() and os.path.samefile(local_file, dest):
            return
        _publish(local_file, dest)

    def delete_tag(self, run_id: str, key: str) -> None:
        """Delete a tag of an active run; a tag the run does not have is refused."""
        with self._db(write=True) as con:
            self._active(con, run_id)
            gone = con.execute("DELETE FROM tags WHERE run_uuid = ? AND key = ?",
                               (run_id, key)).rowcount
            if not gone:
                raise DirectStoreError(f"No tag with name: {key} in run with id {run_id}",
                                       NOT_FOUND)

    def set_terminated(self, run_id: str, status: str = "FINISHED",
                       end_time: int | None = None) -> None:
        if status not in _STATUSES:
            raise DirectStoreError(f"Could not get run status corresponding to string "
                                   f"{status}. Valid run status strings: {list(_STATUSES)}",
                                   BAD_VALUE)
        with self._db(write=True) as con:
            self._active(con, run_id)
            con.execute("UPDATE runs SET status = ?, end_time = ? WHERE run_uuid = ?",
                        (status, end_time or _now_ms(), run_id))

    def delete_run(self, run_id: str) -> None:
        """Mark the run deleted (MLflow's soft delete; a deleted run may be deleted again).
        Used on runs refrun itself just created, which no GenAI assessment refers to."""
        with self._db(write=True) as con:
            if self._run_row(con, run_id) is None:
                raise _not_found(run_id)
            con.execute("UPDATE runs SET lifecycle_stage = ?, deleted_time = ? "
                        "WHERE run_uuid = ?", (_DELETED, _now_ms(), run_id))
