"""The typed configuration of one recorded run, built by ``start_run`` and validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refrun.errors import RefrunInputError
from refrun.identity import RunIdentity, require_int_or_none
from refrun.settings import DELIVERIES, Delivery


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything ``start_run`` needs to open a run; invalid values raise
    :class:`RefrunInputError` from ``__post_init__``, before anything is written."""

    identity: RunIdentity
    """Who the run is (validated by :class:`~refrun.identity.RunIdentity` itself)."""
    tracking_uri: str
    """Resolved MLflow tracking URI (see :func:`refrun.store.uri.resolve_tracking_uri`)."""
    spool_root: Path
    """Absolute directory under which this run's spool directory is created."""
    params: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, Any] = field(default_factory=dict)
    run_name: str | None = None
    experiment: str | None = None
    """MLflow experiment; None: the workload name."""
    flush_interval_s: float = 1.0
    """Seconds between spool writes; a SIGKILL loses at most this much."""
    mlflow_every: int = 1
    """Send only every n-th step of per-step metrics into MLflow's (already bounded) view."""
    max_queue: int = 2_000_000
    """Points held in memory before further points are dropped and counted."""
    snapshot_environment: bool = True
    """Describe this process (versions, device, git); False for runs recorded elsewhere."""
    delivery: Delivery = "process"
    close_timeout_s: float = 5.0
    """Seconds ``close()`` waits for delivery that makes no progress."""
    start_wait_s: float = 3.0
    """Seconds ``start_run`` waits for the store to create the run."""
    rank: int | None = None
    """This process's rank in a multi-process job (0 owns the run); see docs/multiprocess.md."""
    world_size: int | None = None
    """Processes in the job; None or 1: an ordinary single-process run."""
    job: str | None = None
    """Id shared by every process of the job (how ranks > 0 find rank 0's run)."""

    @property
    def multi_process(self) -> bool:
        """True for one process of a job of more than one."""
        return self.world_size is not None and self.world_size > 1

    @property
    def secondary_rank(self) -> bool:
        """True for a rank > 0 of a multi-process job: it creates no MLflow run."""
        return self.multi_process and bool(self.rank)

    def __post_init__(self) -> None:
        for name in ("mlflow_every", "max_queue", "rank", "world_size"):
            require_int_or_none(name, getattr(self, name))
        if self.mlflow_every < 1:
            raise RefrunInputError("mlflow_every: must be >= 1")
        if not self.flush_interval_s > 0:
            raise RefrunInputError("flush_interval_s: must be > 0")
        for name in ("close_timeout_s", "start_wait_s"):
            if not getattr(self, name) >= 0:
                raise RefrunInputError(f"{name}: must be >= 0")
        self._check_job()
        if self.delivery not in DELIVERIES:
            raise RefrunInputError(f"delivery: {self.delivery!r} is not 'process' or 'thread'")

    def _check_job(self) -> None:
        if self.world_size is not None and self.world_size < 1:
            raise RefrunInputError(f"world_size: must be >= 1, got {self.world_size}")
        if not self.multi_process:
            return
        if self.rank is None or not 0 <= self.rank < (self.world_size or 0):
            raise RefrunInputError(f"rank: expected 0 <= rank < world_size={self.world_size} "
                                   f"in a multi-process job, got {self.rank!r}")
        if not isinstance(self.job, str) or not self.job.strip() or any(
                c in self.job for c in "'\"\\`"):
            raise RefrunInputError("job: a multi-process job needs an id shared by all its "
                                   "ranks, without quotes or backslashes (pass job=... or "
                                   f"set $REFRUN_JOB_ID); got {self.job!r}")
