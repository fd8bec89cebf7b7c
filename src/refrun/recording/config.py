"""How a run is recorded (:class:`RecordingOptions`) and the one value ``start_run`` opens a
run from (:class:`RunConfig`: identity + options + what the run carries).

Every default is declared once: a literal here for the options nobody sets from the
environment, :mod:`refrun.settings` for those a ``REFRUN_*`` variable can change (read when
an options value is built, so ``RecordingOptions()`` means "as this environment says").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refrun.errors import RefrunInputError
from refrun.identity import RunIdentity, require_int_or_none
from refrun.settings import DELIVERIES, Delivery, default_job_id, job_identity, settings
from refrun.store.uri import resolve_tracking_uri


def _env_spool_root() -> Path:
    return settings().spool_root


def _env_delivery() -> Delivery:
    return settings().delivery


def _env_close_timeout_s() -> float:
    return settings().close_timeout_s


def _env_start_wait_s() -> float:
    return settings().start_wait_s


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordingOptions:
    """Where and how a run is recorded; nothing here changes what the run *is*
    (that is :class:`~refrun.identity.RunIdentity`).

    Invalid values raise :class:`RefrunInputError` from ``__post_init__``, before anything
    is written.  Built values are resolved: ``tracking_uri`` absolute, ``spool_dir`` an
    absolute :class:`~pathlib.Path`, the job fields filled from ``$RANK``/``$WORLD_SIZE``.
    """

    tracking_uri: str = field(default_factory=lambda: resolve_tracking_uri(None))
    """MLflow tracking URI (default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``);
    see :func:`refrun.store.uri.resolve_tracking_uri`."""
    experiment: str | None = None
    """MLflow experiment; None: the workload name."""
    spool_dir: str | os.PathLike[str] = field(default_factory=_env_spool_root)
    """Directory under which this run's spool directory is created (default
    ``$REFRUN_SPOOL_DIR`` or ``./.refrun/spool``)."""
    flush_interval_s: float = 1.0
    """Seconds between spool writes; a SIGKILL loses at most this much."""
    mlflow_every: int = 1
    """Send only every n-th step of per-step metrics into MLflow's (already bounded) view."""
    max_queue: int = 2_000_000
    """Points held in memory before further points are dropped and counted."""
    snapshot_environment: bool = True
    """Describe this process (versions, device, host, git, packages, job); False for runs
    recorded elsewhere, such as imports."""
    delivery: Delivery = field(default_factory=_env_delivery)
    """``"process"`` (default; ``$REFRUN_DELIVERY``) delivers to MLflow from a separate
    process so MLflow's client never holds this process's GIL; ``"thread"`` from the
    background thread (for short bursts such as imports)."""
    close_timeout_s: float = field(default_factory=_env_close_timeout_s)
    """Seconds ``close()`` waits for delivery that makes no progress
    (``$REFRUN_CLOSE_TIMEOUT_S``)."""
    start_wait_s: float = field(default_factory=_env_start_wait_s)
    """Seconds ``start_run`` waits for the store to create the run (``$REFRUN_START_WAIT_S``)."""
    rank: int | None = None
    """This process's rank in a multi-process job (0 owns the run; default ``$RANK``);
    see docs/multiprocess.md."""
    world_size: int | None = None
    """Processes in the job (default ``$WORLD_SIZE``); None or 1: a single-process run."""
    job: str | None = None
    """Id shared by every process of the job (how ranks > 0 find rank 0's run); default
    :func:`refrun.settings.default_job_id`."""

    @property
    def multi_process(self) -> bool:
        """True for one process of a job of more than one."""
        return self.world_size is not None and self.world_size > 1

    @property
    def secondary_rank(self) -> bool:
        """True for a rank > 0 of a multi-process job: it creates no MLflow run."""
        return self.multi_process and bool(self.rank)

    @property
    def spool_root(self) -> Path:
        """``spool_dir`` as the absolute path ``__post_init__`` made it."""
        return Path(self.spool_dir)

    def __post_init__(self) -> None:
        for name in ("mlflow_every", "max_queue", "rank", "world_size"):
            require_int_or_none(name, getattr(self, name))
        if self.mlflow_every < 1:
            raise RefrunInputError("mlflow_every: must be >= 1")
        if self.max_queue < 1:
            raise RefrunInputError("max_queue: must be >= 1")
        if not self.flush_interval_s > 0:
            raise RefrunInputError("flush_interval_s: must be > 0")
        for name in ("close_timeout_s", "start_wait_s"):
            if not getattr(self, name) >= 0:
                raise RefrunInputError(f"{name}: must be >= 0")
        if self.delivery not in DELIVERIES:
            raise RefrunInputError(f"delivery: {self.delivery!r} is not 'process' or 'thread'")
        object.__setattr__(self, "tracking_uri", resolve_tracking_uri(self.tracking_uri))
        object.__setattr__(self, "spool_dir", Path(self.spool_dir).absolute())
        if self.snapshot_environment:
            self._fill_job_from_environment()
        self._check_job()

    def _fill_job_from_environment(self) -> None:
        # Only for runs of this process: an import must not take the importer's $RANK.
        proc = job_identity()
        rank = proc.rank if self.rank is None else self.rank
        world = proc.world_size if self.world_size is None else self.world_size
        job = self.job
        if job is None and world is not None and world > 1:
            job = proc.job if proc.world_size == world else default_job_id(world)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "job", job)

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


IDENTITY_FIELDS = frozenset(f.name for f in dataclasses.fields(RunIdentity))
OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(RecordingOptions))
# Options whose default comes from the environment: a keyword None means that default
# (as it did when start_run took them one by one).
_ENV_DEFAULTED = frozenset(f.name for f in dataclasses.fields(RecordingOptions)
                           if f.default_factory is not dataclasses.MISSING)


def from_keywords(workload: str | RunIdentity, role: str | None,
                  options: RecordingOptions | None, keywords: Mapping[str, Any]
                  ) -> tuple[RunIdentity, RecordingOptions]:
    """The identity and options of a keyword call ``start_run("w", "reference",
    seed=0, flush_interval_s=0.5)``: the one place the flat keywords become the two values.

    Raises:
        TypeError: a keyword that is no field of either, or a value given twice (an
            identity keyword beside a :class:`RunIdentity`, an option beside ``options=``).
    """
    unknown = sorted(set(keywords) - IDENTITY_FIELDS - OPTION_FIELDS)
    if unknown:
        raise TypeError(f"start_run() got unexpected keyword argument(s) {unknown} "
                        f"(identity: {sorted(IDENTITY_FIELDS)}; options: "
                        f"{sorted(OPTION_FIELDS)})")
    ident = {k: v for k, v in keywords.items() if k in IDENTITY_FIELDS}
    opts = {k: v for k, v in keywords.items()
            if k in OPTION_FIELDS and not (v is None and k in _ENV_DEFAULTED)}
    if isinstance(workload, RunIdentity):
        if role is not None or ident:
            raise TypeError("start_run(): pass the identity either as a RunIdentity or as "
                            f"keywords, not both (got role/{sorted(ident)} beside it)")
        identity = workload
    else:
        if role is None:
            raise TypeError("start_run() missing required argument: 'role'")
        identity = RunIdentity(workload=workload, role=role, **ident)
    if options is not None and opts:
        raise TypeError("start_run(): pass the recording options either as options= or as "
                        f"keywords, not both (got {sorted(opts)} beside options=)")
    return identity, options if options is not None else RecordingOptions(**opts)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything ``start_run`` opens a run from: who it is, how it is recorded, and what
    it carries from the start (validated by the two typed values themselves)."""

    identity: RunIdentity
    options: RecordingOptions
    params: Mapping[str, Any] = field(default_factory=dict)
    """Run parameters (values made strings and cut to MLflow's limit, with a warning)."""
    tags: Mapping[str, Any] = field(default_factory=dict)
    """User tags, beside the ``refrun.*`` identity tags."""
    run_name: str | None = None
    """MLflow run name; None: built from the identity (:mod:`refrun.store.mlflow_ui`)."""
