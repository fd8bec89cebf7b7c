"""The probes' part of multi-process jobs: noticing a job the run was not told about.

A framework knows it runs in a job of several processes (``jax.process_count()``,
``torch.distributed.get_world_size()``), but the run's identity is fixed by ``start_run``
before a probe exists.  When the framework says "N processes" and the run says "one", every
process records its own run instead of one run per job (docs/multiprocess.md): the probe
warns once, naming the fix.  Nothing is changed and nothing is raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refrun import RunSession


def job_mismatch(run_world_size: int | None, process_count: int, source: str) -> str | None:
    """The warning when the framework reports ``process_count`` processes but the run was
    started for ``run_world_size`` (None or 1: a single-process run); else None."""
    if process_count <= 1 or (run_world_size or 1) == process_count:
        return None
    return (f"{source} reports {process_count} processes but this run was started with "
            f"world_size={run_world_size or 1}: each process records its own run.  Pass "
            f"rank= and world_size= (and job= or $REFRUN_JOB_ID) to refrun.start_run to "
            "record the job as one run (docs/multiprocess.md)")


def warn_if_not_a_job(run: RunSession, process_count: int, source: str) -> None:
    """Record :func:`job_mismatch`'s warning on ``run`` (once)."""
    message = job_mismatch(run.config.options.world_size, process_count, source)
    if message is not None:
        run.warn_once("job-mismatch", message)
