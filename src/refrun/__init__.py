"""refrun: record a reference and a migrated training run the same way, compare them,
and decide with the workload's own criteria whether the migration preserved behaviour."""

from refrun._version import __version__
from refrun.session import RunSession, start_run

__all__ = ["RunSession", "__version__", "start_run"]
