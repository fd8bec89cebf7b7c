"""Delivering spools left behind by runs that ended without reaching the store.

A spool is left when the tracking store was down at the end of a run, or when the
process was killed (SIGKILL, OOM, node loss).  A spool whose lock is held belongs to a
live session and is skipped.  A run that never closed is terminated as KILLED.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from refrun import schema
from refrun.curves import seal
from refrun.delivery import finalize
from refrun.forwarder import forwarder_alive
from refrun.spool import Spool, list_spools


@dataclass
class SyncResult:
    local_id: str
    outcome: str  # delivered | complete | live | error
    run_id: str | None
    points: int
    detail: str = ""


def sync_spool(spool: Spool, forwarder: bool = False) -> SyncResult:
    """Deliver one spool completely; see the module docstring.

    ``forwarder``: the caller is the spool's own delivery process (which holds
    ``forwarder.lock``); anyone else leaves a spool with a live forwarder alone.
    """
    if not forwarder and forwarder_alive(spool):
        return SyncResult(spool.local_id, "live", spool.read_meta().get("run_id"), 0,
                          "its delivery process is still running")
    fd = spool.try_lock()
    if fd is None:
        return SyncResult(spool.local_id, "live", spool.read_meta().get("run_id"), 0,
                          "a running session holds it")
    try:
        meta = spool.read_meta()
        if meta.get("complete"):
            return SyncResult(spool.local_id, "complete", meta.get("run_id"), 0)
        before, _ = spool.read_cursor()
        curves = spool.artifacts_dir / schema.ARTIFACT_CURVES
        if meta.get("status", "RUNNING") == "RUNNING" or not curves.exists():
            # The owning process died without closing: its curves artifact and end-of-run
            # tags were never written, and it did not end normally (KILLED).
            seal(spool)
        try:
            finalize(spool)
        except Exception as exc:
            after, _ = spool.read_cursor()
            return SyncResult(spool.local_id, "error", spool.read_meta().get("run_id"),
                              after - before, f"{type(exc).__name__}: {str(exc)[:200]}")
        after, _ = spool.read_cursor()
        meta = spool.read_meta()
        return SyncResult(spool.local_id, "delivered", meta.get("run_id"), after - before,
                          f"status {meta.get('status')}")
    finally:
        Spool.unlock(fd)


def sync_all(root: Path, prune: bool = True) -> list[SyncResult]:
    """Sync every spool under ``root``; with ``prune`` (default) delete the completely
    delivered ones afterwards (the store holds everything they had)."""
    results = []
    for spool in list_spools(root):
        result = sync_spool(spool)
        results.append(result)
        if prune and result.outcome in ("delivered", "complete"):
            shutil.rmtree(spool.path, ignore_errors=True)
    return results
