"""refrun: record a reference and a migrated training run the same way, compare them,
and decide with the workload's own criteria whether the migration preserved behaviour.

``start_run``, its two typed values (``RunIdentity``: who the run is; ``RecordingOptions``:
how it is recorded) and ``RunSession`` are loaded on first use, so that importing a light
sub-module (the pytest plugin ``refrun.testing``, ``refrun.schema``) does not import MLflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from refrun._version import __version__

if TYPE_CHECKING:
    from refrun.identity import RunIdentity
    from refrun.recording.config import RecordingOptions
    from refrun.recording.session import RunSession, start_run

__all__ = ["RecordingOptions", "RunIdentity", "RunSession", "__version__", "start_run"]


def __getattr__(name: str) -> Any:
    # Plain imports (not importlib with a name): the import-graph test sees these edges.
    if name in ("start_run", "RunSession"):
        from refrun.recording import session

        return getattr(session, name)
    if name == "RecordingOptions":
        from refrun.recording.config import RecordingOptions

        return RecordingOptions
    if name == "RunIdentity":
        from refrun.identity import RunIdentity

        return RunIdentity
    raise AttributeError(f"module 'refrun' has no attribute {name!r}")
