"""The one MLflow client factory, with bounded waits, and the store operations every
writer shares.

:func:`client` is the only place in refrun that constructs an ``MlflowClient``:

* **bounded HTTP**: before the first client, MLflow's request settings are bounded unless
  the user set them: no retries inside one request (refrun's writers retry with their own
  back-off; a reader fails and says so) and a connect/read timeout of two thirds of
  ``$REFRUN_STORE_TIMEOUT_S`` (default 15 s, so 10 s).  MLflow's defaults (7 retries with
  exponential back-off, 120 s per request) held a command for about four minutes on a
  closed port.
* **bounded database connections**: the same timeout for a PostgreSQL store's connection
  (``PGCONNECT_TIMEOUT``, unless set); libpq's default waits for ever on a server that
  accepts and never answers.  A sqlite store's creation lock is waited for at most
  ``$REFRUN_STORE_OPEN_TIMEOUT_S`` (120 s).
* **a reader never creates a store** (``create=False``, the default): a sqlite file is
  checked before MLflow opens it (:func:`refrun.store.health.check_sqlite`: missing,
  empty, not SQLite, truncated, locked, not an MLflow store), and a server must answer
  one cheap request; either failure is one :class:`RefrunStoreError` line naming the store.
* **writers** (``create=True``: the live delivery, complete runs, imports) may create a
  sqlite store at a path where nothing exists yet; several processes doing that at once
  would race MLflow's migrations (``table _alembic_tmp_... already exists``), so the
  store is opened under an exclusive file lock beside the database.  An existing file is
  checked as for a reader.

One client per process and URI is kept (MLflow's clients are thread-safe and hold the
engine / HTTP session).

``direct=True`` (a command that loads runs or writes a complete run) gets a
:class:`refrun.store.surface.StoreClient`: a :class:`refrun.store.direct.DirectClient`
where that module may serve the store (a local sqlite store of an MLflow release and
schema it knows, MLflow's workspaces honoured: :func:`refrun.store.direct.decline_reason`),
the same calls without importing MLflow; MLflow's client otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from refrun.errors import RefrunStoreError
from refrun.settings import Settings, settings
from refrun.store import direct as direct_store
from refrun.store import health
from refrun.store.surface import StoreClient
from refrun.store.uri import database_server, resolve_tracking_uri, sqlite_path

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

T = TypeVar("T")
_clients: dict[tuple[str, bool], MlflowClient | direct_store.DirectClient] = {}
_checked: set[str] = set()  # URIs a reader has seen answer in this process
_lock = threading.Lock()
_last_uri: list[str] = []  # the store this process used last (for error messages)


def bound_store_waits(s: Settings | None = None) -> None:
    """Bound MLflow's HTTP client before it is first used in this process, and a database
    store's connection (values the user set in MLflow's or libpq's own variables win).  See
    the module docstring."""
    s = s or settings()
    timeout = str(int(max(1, s.http_timeout_s)))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", timeout)
    # libpq (psycopg2, MLflow's PostgreSQL driver) reads it at each connection; without it
    # a server that accepts and never answers held start_run and every command for ever.
    os.environ.setdefault("PGCONNECT_TIMEOUT", timeout)


@overload
def client(uri: str | None = None, *, create: bool = False,
           direct: Literal[False] = False) -> MlflowClient: ...


@overload
def client(uri: str | None = None, *, create: bool = False,
           direct: Literal[True]) -> StoreClient: ...


def client(uri: str | None = None, *, create: bool = False, direct: bool = False
           ) -> MlflowClient | StoreClient:
    """An MLflow client for the store ``uri`` (resolved by
    :func:`~refrun.store.uri.resolve_tracking_uri`) that is known to be usable.

    ``create=False`` (readers): the store must exist and answer.  ``create=True``
    (writers): a sqlite store may be created where no file exists.  ``direct=True``: a
    :class:`~refrun.store.surface.StoreClient`, refrun's own
    :class:`~refrun.store.direct.DirectClient` where :func:`refrun.store.direct.usable`
    allows, else MLflow's.  Raises :class:`RefrunStoreError` (one line naming the store
    and the cause) otherwise.
    """
    direct = direct and direct_store.enabled()
    cached = _clients.get((uri, direct)) if uri else None  # the delivery asks every step
    if cached is not None and (create or uri in _checked):
        _last_uri[:] = [uri]
        return cached
    resolved = resolve_tracking_uri(uri)
    _last_uri[:] = [resolved]
    s = settings()
    bound_store_waits(s)
    with _lock:
        made = _clients.get((resolved, direct)) or _open(resolved, create, s, direct)
        _clients[(resolved, direct)] = made
    if not create and resolved not in _checked:
        _answers(made, resolved)
        _checked.add(resolved)
    return made


def _open(uri: str, create: bool, s: Settings, direct: bool = False
          ) -> MlflowClient | direct_store.DirectClient:
    path = sqlite_path(uri)
    if path is None:
        if database_server(uri):
            health.check_database(uri)
        return _guarded(uri, lambda: _new_client(uri))

    def ours() -> direct_store.DirectClient | None:
        if direct and direct_store.usable(path, s.http_timeout_s):
            return direct_store.DirectClient(
                uri, path, s.http_timeout_s,
                workspaces=bool(direct_store.workspaces_enabled()))
        return None

    def made() -> MlflowClient | direct_store.DirectClient:
        if (c := ours()) is not None:
            return c
        if not create:
            _no_tables_to_create(uri, path, s.http_timeout_s)
        mlflow_client = _guarded(uri, lambda: _new_client(uri))
        # A store that did not exist: MLflow's client has just created it (tables and all),
        # so refrun's own access may serve it from now on (this client is kept per process).
        return (ours() if direct and create else None) or mlflow_client

    # Checked and opened under the lock a writer holds while MLflow creates and migrates a
    # new store (exclusive for writers, shared for readers), so nobody sees it half-made.
    lock = Path(f"{path}.refrun-init.lock")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not lock.exists():
        health.check_sqlite(path, uri, create=False, timeout_s=s.http_timeout_s)
        return made()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(lock, os.O_RDONLY)
    try:
        _flock(fd, fcntl.LOCK_EX if create else fcntl.LOCK_SH, lock, uri,
               s.store_open_timeout_s)
        health.check_sqlite(path, uri, create=create, timeout_s=s.http_timeout_s)
        return made()
    finally:
        os.close(fd)


def _flock(fd: int, mode: int, lock: Path, uri: str, timeout_s: float) -> None:
    """Take ``lock`` (``mode``: shared or exclusive), waiting at most ``timeout_s``: the
    process creating the store holds it for seconds, but one that hangs while holding it
    would otherwise hold every writer and reader of the store, a starting trainer too.
    Raises :class:`RefrunStoreError` naming the lock."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise RefrunStoreError(
                    f"tracking store {uri}: {lock} held by another process for "
                    f"{timeout_s:g} s ($REFRUN_STORE_OPEN_TIMEOUT_S): a store being "
                    "created, or a process that hangs creating it") from None
            time.sleep(pause)  # a lock has no wake-up to wait on; back off to 50 ms
            pause = min(pause * 2, 0.05)


def _no_tables_to_create(uri: str, path: Path, timeout_s: float) -> None:
    """Refuse, for a reader, a sqlite store MLflow's client would add tables to: it
    creates every table of its ORM that is missing and migrates on opening a store
    (``mlflow.store.db.utils._all_tables_exist``), which a read command must never do."""
    import mlflow.store.db.utils  # noqa: F401  (fills Base.metadata with every table)
    from mlflow.store.db.base_sql_model import Base

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
        with contextlib.closing(con):
            have = {r[0] for r in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise RefrunStoreError(f"tracking store {uri}: {health.cause(exc)}") from exc
    missing = sorted(set(Base.metadata.tables) - have)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more"
                                          if len(missing) > 4 else "")
        raise RefrunStoreError(
            f"tracking store {uri}: lacks tables of this MLflow's schema ({shown}); a read "
            "command never creates or migrates tables: upgrade it with `mlflow db upgrade "
            f"{uri}` (after a backup) or read it with the MLflow release that wrote it")


def _new_client(uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)  # the only construction in refrun


def _guarded(uri: str, make: Callable[[], T]) -> T:
    try:
        return make()
    except Exception as exc:
        if health.from_store_library(exc):
            raise RefrunStoreError(f"tracking store {uri}: {health.cause(exc)}") from exc
        raise


def answering(uri: str | None = None, *, create: bool = False) -> MlflowClient:
    """:func:`client`, and the store answers one request now (for a writer too: ``refrun
    sync`` refuses a store that is down in one line instead of failing spool by spool)."""
    c = client(uri, create=create)
    resolved = resolve_tracking_uri(uri)
    if resolved not in _checked:
        _answers(c, resolved)
        _checked.add(resolved)
    return c


def _answers(c: MlflowClient | direct_store.DirectClient, uri: str) -> None:
    """One cheap request, so that a reader finds out now, in one line, that the store is
    unreachable, instead of later as "run not found"."""
    _guarded(uri, lambda: c.search_experiments(max_results=1))


def last_uri() -> str | None:
    """The store this process last asked :func:`client` for (named in error messages)."""
    return _last_uri[0] if _last_uri else None


def store_error(exc: BaseException) -> RefrunStoreError | None:
    """``exc`` as one line naming the store, when a store library raised it; else None."""
    if isinstance(exc, RefrunStoreError):
        return exc
    if not health.from_store_library(exc):
        return None
    return RefrunStoreError(f"tracking store {last_uri() or '(unknown)'}: {health.cause(exc)}")


def refusals() -> tuple[type[Exception], ...]:
    """The exception types of a store's answer to a request (MLflow's ``MlflowException``
    once MLflow is imported; :class:`~refrun.store.direct.DirectStoreError`), for
    ``except refusals():`` without importing MLflow where it was not used."""
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    found: tuple[type[Exception], ...] = (direct_store.DirectStoreError,)
    if mlflow_exceptions is not None:
        found += (mlflow_exceptions.MlflowException,)
    return found


def store_failures() -> tuple[type[Exception], ...]:
    """:func:`refusals` and the errors of a store that did not answer (OS, sqlite3)."""
    return (*refusals(), OSError, sqlite3.Error)


def transient(exc: BaseException) -> bool:
    """True for a store error worth retrying (unreachable, timeout, 5xx, database busy);
    False for a refusal of the request itself (MLflow's 4xx: a bad name, value or step)."""
    if not isinstance(exc, refusals()):
        return True
    return not 400 <= exc.get_http_status_code() < 500 or exc.get_http_status_code() == 429


def run_writer(uri: str, experiment: str) -> tuple[StoreClient, str]:
    """The client that writes a run of ``experiment`` and the experiment's id: refrun's own
    sqlite access (:mod:`refrun.store.direct`) where the store's schema is known and the
    experiment exists with its artifacts on this machine; MLflow's client otherwise (a new
    store or experiment is made by MLflow, with MLflow's defaults).  Importing MLflow and
    building its client costs a process ~2.3 s of CPU; a recording trainer or an import
    into a store that has its experiment never pays it."""
    c = client(uri, create=True, direct=True)  # a new sqlite store: created once, locked
    if not isinstance(c, direct_store.DirectClient):
        return c, ensure_experiment(c, experiment)

    def ours() -> str | None:
        exp = c.get_experiment_by_name(experiment)
        if (exp is not None and exp.lifecycle_stage == "active"
                and direct_store.local_path(exp.artifact_location) is not None):
            return exp.experiment_id
        return None

    exp_id = ours()
    if exp_id is not None:
        return c, exp_id
    mlflow_client = client(uri, create=True)
    exp_id = ensure_experiment(mlflow_client, experiment)
    # MLflow made the experiment; the run is written by refrun's own access when it can
    # (MLflow's ORM takes ~20 s for a run of 100,000 metrics, refrun's ~2 s).
    return (c, exp_id) if ours() == exp_id else (mlflow_client, exp_id)


def entities_for(c: StoreClient, items: list[Any]) -> list[Any]:
    """``items`` (:mod:`refrun.store.direct`'s Metric, Param, RunTag) as the client ``c``
    takes them: as they are for refrun's sqlite access, as MLflow's entities for MLflow's
    (imported only then)."""
    if isinstance(c, direct_store.DirectClient) or not items:
        return items
    from mlflow import entities

    kind = getattr(entities, type(items[0]).__name__)
    return [kind(**{f: getattr(x, f) for f in x.__slots__}) for x in items]


def ensure_experiment(c: MlflowClient, name: str) -> str:
    """Id of the experiment called ``name``, created if missing (safe under races)."""
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name)
    except Exception:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id

