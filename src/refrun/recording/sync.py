"""``refrun sync``: delivering spools left behind by runs that ended without reaching the store.

A spool is left when the tracking store was down at the end of a run, or when the process
and its delivery process were killed (SIGKILL, OOM, node loss).  Each spool is handled on
its own through :func:`refrun.recording.delivery.finish_spool`: one that fails is reported
and the others are still delivered.  A full disk stops the whole command with one line
(:class:`refrun.errors.RefrunResourceError`): nothing can be written until space is freed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from refrun.errors import RefrunResourceError
from refrun.recording.delivery import SpoolResult, finish_spool
from refrun.recording.spool import Spool, disk_full, list_spools


def sync_all(root: Path, prune: bool = True) -> list[SpoolResult]:
    """Deliver every spool under ``root``; with ``prune`` (default) delete the completely
    delivered ones afterwards (the store holds everything they had)."""
    results = []
    for spool in sorted(list_spools(root), key=_rank_last):
        try:
            result = finish_spool(spool)
        except Exception as exc:
            if disk_full(exc):
                raise RefrunResourceError(
                    f"{spool.path}: {getattr(exc, 'strerror', None) or exc} while delivering; "
                    "free disk space and run `refrun sync` again (nothing was lost)") from exc
            result = SpoolResult(spool.local_id, "error", None, 0,
                                 f"{type(exc).__name__}: {str(exc)[:200]}")
        results.append(result)
        if prune and result.outcome in ("delivered", "complete"):
            shutil.rmtree(spool.path, ignore_errors=True)
    return results


def _rank_last(spool: Spool) -> bool:
    # Spools of ranks > 0 after the others: when rank 0 of a job was killed too, its run
    # must exist before its ranks' data can be added to it (one `refrun sync`, not two).
    try:
        return spool.read_meta().secondary_rank is not None
    except (OSError, ValueError):
        return False
