"""Which store: resolving MLflow tracking URIs.

Kept light (no MLflow import) so that the session, the readers and the CLI resolve a store
the same way without loading any of the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from refrun.errors import RefrunInputError, RefrunStoreError

DEFAULT_URI = "sqlite:///mlflow.db"
_SQLITE = "sqlite:///"


def resolve_tracking_uri(uri: str | None) -> str:
    """The store to use: ``uri``, else ``$MLFLOW_TRACKING_URI``, else MLflow's default
    (``sqlite:///mlflow.db`` in the working directory).  Relative sqlite paths are made
    absolute so that ``refrun sync`` from another directory finds the same store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith(_SQLITE) and not uri.startswith("sqlite:////"):
        uri = _SQLITE + str(Path(uri[len(_SQLITE):]).absolute())
    elif "://" not in uri:
        raise RefrunInputError(
            f"tracking URI {uri!r}: use sqlite:///PATH, http(s)://HOST:PORT or another "
            "MLflow store URI (the file store is not supported by MLflow 3)"
        )
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a resolved ``sqlite:///`` URI (query string dropped), else None."""
    if not uri.startswith(_SQLITE):
        return None
    return Path(uri[len(_SQLITE):].split("?", 1)[0])


def local_store(uri: str) -> bool:
    """True for a store in a local database file (it answers or fails by itself)."""
    return uri.startswith("sqlite:")


def database_server(uri: str) -> bool:
    """True for a store on a database server (``postgresql[+driver]://``, ``mysql``,
    ``mssql``: MLflow's database stores other than sqlite)."""
    return uri.split(":", 1)[0].split("+", 1)[0].lower() in ("postgresql", "mysql", "mssql")


def existing_store_uri(uri: str | None) -> str:
    """:func:`resolve_tracking_uri` for readers: a sqlite store that does not exist is an
    error instead of being created empty (the full checks are in
    :func:`refrun.store.health.check_sqlite`, run by :func:`refrun.store.client.client`)."""
    resolved = resolve_tracking_uri(uri)
    path = sqlite_path(resolved)
    if path is not None and path.is_symlink() and not path.exists():
        raise RefrunStoreError(f"tracking store {resolved}: {path} is a dangling symbolic "
                               f"link (to {os.readlink(path)}); point it at a store or "
                               "remove it")
    if path is not None and not path.is_file():
        raise RefrunStoreError(f"tracking store {resolved}: no such store "
                               f"({path} does not exist)")
    return resolved
