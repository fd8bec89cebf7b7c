"""Every ``REFRUN_*`` environment variable refrun reads, read here and only here.

==================================  =========  ==============================================
variable                            default    meaning
==================================  =========  ==============================================
``REFRUN_SPOOL_DIR``                ``./.refrun/spool``  root of the per-run spool directories
``REFRUN_DELIVERY``                 ``process``  ``process`` or ``thread`` (see ``start_run``)
``REFRUN_KEEP_SPOOL``               ``0``      ``1`` keeps a delivered spool (debugging)
``REFRUN_CLOSE_TIMEOUT_S``          ``5``      seconds ``close()`` waits for delivery that
                                               makes no progress before leaving it to the
                                               delivery process in the background
``REFRUN_STORE_OPEN_TIMEOUT_S``     ``120``    the longest opening a store may take: the
                                               wait for a sqlite store's creation lock
                                               (held while another process creates the
                                               store), and how long the delivery process's
                                               start-up (MLflow import, store opening) counts
                                               as progress for a closing trainer, which
                                               then waits ``REFRUN_CLOSE_TIMEOUT_S`` more
``REFRUN_START_WAIT_S``             ``3``      seconds ``start_run`` waits for the store to
                                               create the run before training goes on
``REFRUN_DELIVERY_FINAL_TIMEOUT_S`` ``600``    seconds a delivery process whose trainer is
                                               gone keeps retrying an unreachable store
``REFRUN_DELIVERY_RETRY_MAX_S``     ``30``     longest pause between two tries of a store
                                               that failed (delivery's back-off doubles up
                                               to it): how long after a store's return
                                               delivery may take to resume, against how
                                               often a store that is down is tried
``REFRUN_STORE_TIMEOUT_S``          ``15``     the longest one store call waits on a store
                                               that does not answer (a server that is down
                                               or silent, a locked sqlite file) before the
                                               store is reported unreachable; see
                                               :mod:`refrun.store.client`
``REFRUN_SQLITE_DIRECT``            ``1``      ``0``: a local sqlite store is always read and
                                               written through MLflow's client, never by
                                               :mod:`refrun.store.direct`
``REFRUN_DELIVERY_NICE``            ``10``     added to the delivery process's nice value
                                               (0-19): it yields the CPU to training; 0
                                               where nothing is to be yielded to (a test
                                               suite beside CPU-bound processes)
``REFRUN_TRACEBACK``                ``0``      ``1``: a command that fails on an error refrun
                                               did not foresee (a bug) prints the traceback
                                               before its one line (exit 2 either way)
``REFRUN_JOB_ID``                   (derived)  id shared by every process of one multi-process
                                               job (see :func:`job_identity`)
``RANK`` / ``WORLD_SIZE``           unset      this process's rank and the job's process count
                                               (set by torchrun and most launchers)
==================================  =========  ==============================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from refrun.errors import RefrunInputError

Delivery = Literal["process", "thread"]
DELIVERIES: tuple[Delivery, ...] = ("process", "thread")
DEFAULT_SPOOL_ROOT = ".refrun/spool"
DEFAULT_STORE_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Settings:
    """The recording path's environment, read once per call of :func:`settings`."""

    spool_root: Path
    """Absolute spool root."""
    delivery: Delivery
    keep_spool: bool
    close_timeout_s: float
    """Seconds without delivery progress after which ``close()`` stops waiting."""
    store_open_timeout_s: float
    """Longest wait for a sqlite store's creation lock; also how long the delivery
    process's start-up (MLflow import, store opening) counts as delivery progress for a
    closing session."""
    start_wait_s: float
    """Seconds ``start_run`` waits for the MLflow run to be created."""
    final_timeout_s: float
    """Seconds an orphaned delivery process keeps retrying the store."""
    store_timeout_s: float
    """Longest wait (s) of one store call on a store that does not answer."""

    @property
    def http_timeout_s(self) -> float:
        """Connect/read timeout of one HTTP request: two thirds of ``store_timeout_s`` (10 s
        by default), leaving the rest for the command's own start and its error path."""
        return max(1.0, self.store_timeout_s * 2 / 3)


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise RefrunInputError(f"${name}={raw!r}: expected a number of seconds") from exc
    if value < 0:
        raise RefrunInputError(f"${name}={raw!r}: must be >= 0")
    return value


def settings() -> Settings:
    """The current ``REFRUN_*`` settings (defaults in the module docstring)."""
    delivery = os.environ.get("REFRUN_DELIVERY") or "process"
    if delivery not in DELIVERIES:
        raise RefrunInputError(f"$REFRUN_DELIVERY={delivery!r}: use 'process' or 'thread'")
    delivery_nice()  # malformed values are refused where the run starts, not in delivery
    delivery_retry_max_s()
    return Settings(
        spool_root=Path(os.environ.get("REFRUN_SPOOL_DIR") or DEFAULT_SPOOL_ROOT).absolute(),
        delivery=delivery,  # type: ignore[arg-type]  # checked against DELIVERIES above
        keep_spool=os.environ.get("REFRUN_KEEP_SPOOL", "") not in ("", "0"),
        close_timeout_s=_float("REFRUN_CLOSE_TIMEOUT_S", 5.0),
        store_open_timeout_s=_float("REFRUN_STORE_OPEN_TIMEOUT_S", 120.0),
        start_wait_s=_float("REFRUN_START_WAIT_S", 3.0),
        final_timeout_s=_float("REFRUN_DELIVERY_FINAL_TIMEOUT_S", 600.0),
        store_timeout_s=_float("REFRUN_STORE_TIMEOUT_S", DEFAULT_STORE_TIMEOUT_S),
    )



def sqlite_direct() -> bool:
    """``$REFRUN_SQLITE_DIRECT``: may refrun read and write a local sqlite store of a
    schema it knows without MLflow's client (default yes; ``0`` no)."""
    raw = os.environ.get("REFRUN_SQLITE_DIRECT", "").strip()
    if raw not in ("", "0", "1"):
        raise RefrunInputError(f"$REFRUN_SQLITE_DIRECT={raw!r}: use 0 or 1")
    return raw != "0"


def show_traceback() -> bool:
    """``$REFRUN_TRACEBACK``: print the traceback of an unforeseen error (default no: one
    line, exit 2)."""
    return os.environ.get("REFRUN_TRACEBACK", "").strip() not in ("", "0")


DEFAULT_DELIVERY_RETRY_MAX_S = 30.0


def delivery_retry_max_s() -> float:
    """``$REFRUN_DELIVERY_RETRY_MAX_S``: the cap of delivery's retry back-off (seconds,
    default 30; :class:`refrun.recording.delivery.Backoff`).  Above 0: a store that is down
    is never tried in a loop without pause."""
    value = _float("REFRUN_DELIVERY_RETRY_MAX_S", DEFAULT_DELIVERY_RETRY_MAX_S)
    if value == 0:
        raw = os.environ["REFRUN_DELIVERY_RETRY_MAX_S"]
        raise RefrunInputError(f"$REFRUN_DELIVERY_RETRY_MAX_S={raw!r}: must be > 0")
    return value


DEFAULT_DELIVERY_NICE = 10


def delivery_nice() -> int:
    """``$REFRUN_DELIVERY_NICE``: how much the delivery process lowers its CPU priority
    (default 10: CFS then gives it ~10 % of a core against one CPU-bound process at nice
    0, so it only uses CPU the training does not)."""
    raw = os.environ.get("REFRUN_DELIVERY_NICE", "").strip()
    if not raw:
        return DEFAULT_DELIVERY_NICE
    if not raw.isdigit() or not 0 <= int(raw) <= 19:
        raise RefrunInputError(f"$REFRUN_DELIVERY_NICE={raw!r}: use an integer from 0 to 19")
    return int(raw)


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """Where this process sits in a multi-process job, as its environment says."""

    rank: int | None
    world_size: int | None
    job: str | None
    """None when the environment names no job (single process, or no launcher variables)."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise RefrunInputError(f"${name}={raw!r}: expected an integer") from exc


def _ppid_start_ticks() -> str:
    # The launcher's start time (clock ticks since boot, /proc/<ppid>/stat field 22): two
    # launchers that happen to reuse a pid do not share a job id.
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def default_job_id(world_size: int | None) -> str | None:
    """The job id every process of one job derives alike, without talking to each other.

    In order: ``$REFRUN_JOB_ID``; ``$TORCHELASTIC_RUN_ID`` when set and not ``none``
    (torchrun: the rendezvous id, a fresh uuid with ``--standalone``); ``$SLURM_JOB_ID``
    (``.$SLURM_STEP_ID``); else, single-node only, ``host:launcher pid:launcher start
    time:MASTER_ADDR:MASTER_PORT:world size`` (processes started by one launcher share its
    pid).  Multi-node jobs without torchrun or SLURM must set ``REFRUN_JOB_ID`` (or pass
    ``job=``): processes on different hosts cannot derive a common id otherwise.
    """
    explicit = os.environ.get("REFRUN_JOB_ID", "").strip()
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic.lower() != "none":
        return f"torchelastic:{elastic}"
    slurm = os.environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        step = os.environ.get("SLURM_STEP_ID", "").strip()
        return f"slurm:{slurm}" + (f".{step}" if step else "")
    if world_size is None or world_size <= 1:
        return None
    import socket

    return ":".join([socket.gethostname(), str(os.getppid()), _ppid_start_ticks(),
                     os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                     str(world_size)])


def job_identity() -> JobIdentity:
    """Rank, world size (``$RANK``, ``$WORLD_SIZE``) and job id (:func:`default_job_id`)
    of this process; all None outside a launcher."""
    world = _env_int("WORLD_SIZE")
    return JobIdentity(rank=_env_int("RANK"), world_size=world,
                       job=default_job_id(world) if world is not None and world > 1 else None)
