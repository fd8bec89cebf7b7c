"""Is this store usable?  Checked before MLflow opens it, and one-line causes after.

MLflow opens a sqlite store by creating it: a missing path, a 0-byte file or an SQLite
file without tables silently becomes a new, empty store, and random bytes, a truncated
file or a locked database surface as a SQLAlchemy traceback of some 80 lines.
:func:`check_sqlite` looks at the file first, with the standard library only:

* missing: an error for a reader; a writer (``create=True``) may create it;
* not a regular file, empty (0 bytes), no ``SQLite format 3`` header: not a store;
* shorter than the page count its header declares (valid when the header's
  version-valid-for number equals its change counter, https://sqlite.org/fileformat.html
  section 1.3): truncated;
* a dangling symbolic link: refused at once (SQLite cannot open it, and MLflow retried
  that for some 100 s);
* a hot journal (``PATH-journal`` a writer killed mid-transaction left behind): a
  read-only connection cannot roll it back ("attempt to write a readonly database"), so
  the file is opened read-write once, which rolls it back as SQLite and MLflow's own
  client do; where the file or its directory is not writable, one line says so;
* a read of ``alembic_version`` (MLflow's schema version table) and of MLflow's core
  tables under a busy timeout: locked by another process, corrupt (``malformed``), or
  not an MLflow store (no ``alembic_version``, or another application's alembic-managed
  database without MLflow's tables): refused untouched, never given to MLflow, which
  would create its tables in it;
* for a writer, ``PRAGMA quick_check`` within :data:`QUICK_CHECK_BUDGET_S`: a store with
  damaged pages is refused before anything is written into it.

:func:`check_database` opens one connection to a database server store first (MLflow
retries for ~100 s).  :func:`cause` turns an error raised later by MLflow, SQLAlchemy or
``requests`` into the short reason a user can act on (connection refused, no answer,
locked, ...).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from refrun.errors import RefrunStoreError

SQLITE_MAGIC = b"SQLite format 3\x00"
# Tables every MLflow store has had since MLflow 1.0 (its initial schema): a database
# with an ``alembic_version`` table but without these is another application's.
MLFLOW_CORE_TABLES = ("experiments", "runs", "metrics", "params", "tags")
# A writer checks a store's pages (PRAGMA quick_check) for at most this long; a store too
# large to check in that time is used unchecked (a reader meets damage as "malformed").
# Measured on the shared 2-core machine: a 73 MB store 1.4 s from a cold cache, a 124 MB
# one 0.1 s from a warm one.  Kept below REFRUN_START_WAIT_S (3 s) so that a trainer's
# start is not pushed offline by the check alone.
QUICK_CHECK_BUDGET_S = 2.0
_LIBRARIES = ("mlflow", "sqlalchemy", "sqlite3", "requests", "urllib3")
_DIRECT = "refrun.store.direct"  # refrun's own sqlite access speaks for the store too
_CAUSES = (  # substring of an error's text (any in its chain) -> what the user is told
    ("connection refused", "unreachable (connection refused)"),
    ("name or service not known", "unreachable (unknown host)"),
    ("temporary failure in name resolution", "unreachable (unknown host)"),
    ("no route to host", "unreachable (no route to host)"),
    ("read timed out", "no answer (read timed out)"),
    ("connect timeout", "no answer (connect timed out)"),
    ("timed out", "no answer (timed out)"),
    ("timeout expired", "no answer (timed out)"),  # libpq's connect_timeout
    ("database is locked", "locked by another process"),
    ("file is not a database", "not an SQLite database (corrupt)"),
    ("malformed", "corrupt (database disk image is malformed)"),
    ("unable to open database", "cannot open the database file"),
)


def check_sqlite(path: Path, uri: str, *, create: bool, timeout_s: float) -> bool:
    """Raise :class:`RefrunStoreError` (one line naming ``uri``) unless ``path`` is a
    usable MLflow sqlite store.  Returns False when the store does not exist yet and
    ``create`` allows MLflow to create it, True when it exists and is usable."""
    def refuse(why: str) -> RefrunStoreError:
        return RefrunStoreError(f"tracking store {uri}: {why}")

    if path.is_symlink() and not path.exists():
        raise refuse(f"{path} is a dangling symbolic link (to {os.readlink(path)}); "
                     "point it at a store or remove it")
    if not path.exists():
        if create:
            return False
        raise refuse(f"no such store ({path} does not exist)")
    if not path.is_file():
        raise refuse("not a regular file")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header = f.read(100)
    except OSError as exc:
        raise refuse(f"cannot read {path} ({exc.strerror or exc})") from exc
    if size == 0:
        raise refuse("empty file (0 bytes), not an MLflow store; remove it to let "
                     "a writer create a new store there")
    if not header.startswith(SQLITE_MAGIC):
        raise refuse("not an SQLite database (corrupt, or another kind of file)")
    declared = declared_size(header)
    if declared is not None and size < declared:
        raise refuse(f"truncated ({size} of the {declared} bytes its header "
                     "declares)")
    _read_schema_version(path, timeout_s, refuse, pages=create)
    return True


def check_database(uri: str) -> None:
    """Raise :class:`RefrunStoreError` (one line naming ``uri``) unless one connection to
    the database server of ``uri`` opens.  MLflow tries ten times, sleeping 0.1 s doubling
    in between, before it reports one: about 100 s on a server that is down, and with
    libpq's default no end on one that accepts and never answers.  One attempt here,
    bounded by the connection timeout :func:`refrun.store.client.bound_store_waits`
    sets."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    try:
        engine = sqlalchemy.create_engine(uri, poolclass=NullPool)
        with engine.connect():
            pass
    except ModuleNotFoundError as exc:
        raise RefrunStoreError(f"tracking store {uri}: its database driver is not "
                               f"installed ({missing_driver(uri, exc.name or '')})") from exc
    except Exception as exc:
        raise RefrunStoreError(f"tracking store {uri}: {cause(exc)}") from exc


# The pip package of each database driver SQLAlchemy may ask for (module -> package).
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary",
                   "pg8000": "pg8000", "pymysql": "pymysql", "MySQLdb": "mysqlclient",
                   "pyodbc": "pyodbc"}


def missing_driver(uri: str, module: str) -> str:
    """What to install for a driver module SQLAlchemy could not import.  A URI that names
    no driver (``postgresql://``) gets SQLAlchemy's default, psycopg 3 since SQLAlchemy
    2.1, where MLflow's own documentation and older installs meant psycopg2: the line
    says how to name the other."""
    package = DRIVER_PACKAGES.get(module)
    text = module if package is None else f"{module}: pip install '{package}'"
    scheme = uri.split(":", 1)[0]
    if "+" not in scheme and scheme.lower() == "postgresql":
        text += ", or name an installed driver in the URI: postgresql+psycopg2://"
    return text


def declared_size(header: bytes) -> int | None:
    """Bytes an SQLite file's 100-byte header says the database has, or None when the
    header's page count is not valid (written by a library older than 3.7.0)."""
    if len(header) < 100:
        return 0 if header else None  # a header cut short: nothing valid declared
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    change_counter, valid_for = header[24:28], header[92:96]
    if pages == 0 or change_counter != valid_for:
        return None
    return pages * page_size


def _read_schema_version(path: Path, timeout_s: float,
                         refuse: Callable[[str], RefrunStoreError], *,
                         pages: bool = False) -> None:
    """Read the schema version and MLflow's core tables read-only; roll back a hot journal
    first when one is in the way; with ``pages``, check the pages too."""
    try:
        _read_only_checks(path, timeout_s, refuse, pages)
    except _HotJournal:
        roll_back_hot_journal(path, timeout_s, refuse)
        _read_only_checks(path, timeout_s, refuse, pages)


class _HotJournal(Exception):
    """A read-only connection met a journal it must roll back first."""


def _read_only_checks(path: Path, timeout_s: float,
                      refuse: Callable[[str], RefrunStoreError], pages: bool) -> None:
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error as exc:
        raise refuse(f"cannot open {path} ({exc})") from exc
    try:
        with contextlib.closing(con):
            con.execute("SELECT version_num FROM alembic_version").fetchall()
            tables = {r[0] for r in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            missing = [t for t in MLFLOW_CORE_TABLES if t not in tables]
            if missing:
                raise refuse("an SQLite database with an alembic_version table but not "
                             f"an MLflow store (no {', '.join(missing)} table"
                             f"{'s' if len(missing) > 1 else ''}; another application's "
                             "database?); left untouched")
            if pages:
                _quick_check(con, refuse)
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if "readonly" in text or "read-only" in text:
            raise _HotJournal() from exc  # SQLITE_READONLY_ROLLBACK / _RECOVERY
        if "no such table" in text:
            raise refuse("an SQLite database but not an MLflow store (no "
                         "alembic_version table); left untouched") from exc
        if "locked" in text:
            raise refuse(f"locked by another process (waited {timeout_s:g} s; set "
                         "$REFRUN_STORE_TIMEOUT_S to wait longer)") from exc
        raise refuse(cause(exc)) from exc
    except sqlite3.DatabaseError as exc:
        raise refuse(cause(exc)) from exc


def _quick_check(con: sqlite3.Connection, refuse: Callable[[str], RefrunStoreError]
                 ) -> None:
    """``PRAGMA quick_check`` for at most :data:`QUICK_CHECK_BUDGET_S`: damaged pages are
    refused before a writer adds to them; a store too large to check in time passes."""
    deadline = time.monotonic() + QUICK_CHECK_BUDGET_S
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        found = con.execute("PRAGMA quick_check(1)").fetchall()
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            return  # out of budget: unchecked, as every store was before
        raise
    finally:
        con.set_progress_handler(None, 0)
    if found and found[0][0] != "ok":
        raise refuse(f"corrupt (damaged pages: {' '.join(str(found[0][0]).split())[:160]}); "
                     "nothing written")


def roll_back_hot_journal(path: Path, timeout_s: float,
                          refuse: Callable[[str], RefrunStoreError]) -> None:
    """Roll back the transaction a killed writer left in ``PATH-journal``: the first read
    of a read-write connection does it (SQLite's own recovery, what MLflow's client does on
    opening the store).  One line when the file cannot be written here."""
    journal = Path(f"{path}-journal")
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        raise refuse(f"has a hot journal {journal} left by a writer killed mid-transaction, "
                     "and this user may not write the store or its directory to roll it "
                     "back; run any refrun or MLflow command on it as a user who may")
    try:
        con = sqlite3.connect(path, timeout=timeout_s)
        with contextlib.closing(con):
            con.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.Error as exc:
        raise refuse(f"has a hot journal {journal} that could not be rolled back "
                     f"({cause(exc)})") from exc


def from_store_library(exc: BaseException) -> bool:
    """True for an error raised by the libraries that talk to the store (MLflow,
    SQLAlchemy, sqlite3, requests, urllib3), not by refrun's own code."""
    return any(c.__module__.split(".")[0] in _LIBRARIES or c.__module__ == _DIRECT
               for c in type(exc).__mro__)


def cause(exc: BaseException) -> str:
    """A one-line, actionable reason for a store error (its chain searched for a known
    cause; else the exception's type and first 200 characters)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen and len(seen) < 8:
        seen.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(x) for x in seen).lower()
    for needle, reason in _CAUSES:
        if needle in text:
            return reason
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
