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

from refrun.errors import RefrunResourceError, RefrunStoreError
from refrun.recording.delivery import SpoolResult, delivered_elsewhere, finish_spool
from refrun.recording.spool import Spool, disk_full, list_spools
from refrun.store.client import answering


def sync_all(root: Path, prune: bool = True) -> list[SpoolResult]:
    """Deliver every spool under ``root``; with ``prune`` (default) delete the completely
    delivered ones afterwards (the store holds everything they had).

    Each store is checked once before its spools (:func:`refrun.store.client.answering`;
    a missing sqlite store may be created): the spools of a store that is unusable (down,
    corrupt, locked ...) are kept and get outcome ``"store"`` with the store's one-line
    cause, without waiting on it once per spool."""
    results = []
    broken: dict[str, str] = {}
    for spool in sorted(list_spools(root), key=_rank_last):
        # A spool whose delivery process still runs is that process's to deliver, whatever
        # the store's state now (it retries): reported live, the store not consulted.
        if (owned := delivered_elsewhere(spool)) is not None:
            results.append(owned)
            continue
        uri = _store_of(spool)
        if uri is not None and uri not in broken:
            try:
                answering(uri, create=True)
            except RefrunStoreError as exc:
                broken[uri] = str(exc)
        if uri in broken:
            results.append(SpoolResult(spool.local_id, "store", None, 0, broken[uri]))
            continue
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


def _store_of(spool: Spool) -> str | None:
    try:
        return spool.read_meta().tracking_uri
    except (OSError, ValueError):
        return None  # an unreadable spool is reported by finish_spool


def _rank_last(spool: Spool) -> bool:
    # Spools of ranks > 0 after the others: when rank 0 of a job was killed too, its run
    # must exist before its ranks' data can be added to it (one `refrun sync`, not two).
    try:
        return spool.read_meta().secondary_rank is not None
    except (OSError, ValueError):
        return False
