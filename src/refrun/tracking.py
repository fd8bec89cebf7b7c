"""Where runs are stored: resolving MLflow tracking URIs.

Kept apart from the recording stack so that readers (comparison, acceptance, report, CLI)
can find a store without importing the session, the spool or the delivery process.
"""

from __future__ import annotations

import os
from pathlib import Path

from refrun.errors import RefrunInputError


def resolve_tracking_uri(uri: str | None) -> str:
    """The store to use: ``uri``, else ``$MLFLOW_TRACKING_URI``, else MLflow's default
    (``sqlite:///mlflow.db`` in the working directory).  Relative sqlite paths are made
    absolute so that ``refrun sync`` from another directory finds the same store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///") :]).absolute())
    elif "://" not in uri:
        raise RefrunInputError(
            f"tracking URI {uri!r}: use sqlite:///PATH, http(s)://HOST:PORT or another "
            "MLflow store URI (the file store is not supported by MLflow 3)"
        )
    return uri


def existing_store_uri(uri: str | None) -> str:
    """:func:`resolve_tracking_uri` for readers: a sqlite store that does not exist is an
    error instead of being created empty."""
    resolved = resolve_tracking_uri(uri)
    if resolved.startswith("sqlite:///"):
        path = Path(resolved[len("sqlite:///") :])  # absolute after resolve_tracking_uri
        if not path.is_file():
            raise RefrunInputError(f"tracking URI {resolved}: no such store "
                                   f"({path} does not exist)")
    return resolved
