"""The spool writer: the only thread of the training process that touches the spool.

The training thread appends points to an in-memory deque (bounded, never blocking) and
returns.  Every ``flush_interval_s`` this thread appends the queued points to the spool
file (so a SIGKILL loses at most one interval).  Delivery to MLflow is normally done by the
delivery process (:mod:`refrun.recording.process`), whose reported state this thread turns
into warnings; with ``deliver_inline`` (``delivery="thread"``, or when no process could be
started) this thread also delivers, through :mod:`refrun.recording.delivery`.

A full disk never stops the thread: the batch that did not fit is cut back, the spool's
reserve is given back (so the end of the run can still be recorded) and from then on
points are counted as dropped instead of written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from refrun.recording import delivery
from refrun.recording.spool import (
    Point,
    PointBlock,
    Spool,
    SpoolMeta,
    append_points,
    count_points,
    disk_full,
)

log = logging.getLogger("refrun")

# Per loop iteration, deliver at most this many batches so that draining the queue to
# the spool (the durability guarantee) is never starved by a long backlog.
_MAX_BATCHES_PER_ITERATION = 20


class SpoolWriter(threading.Thread):
    """Drains accepted points to the spool (and, inline, to MLflow), off the training thread."""

    def __init__(
        self,
        spool: Spool,
        *,
        flush_interval_s: float,
        max_queue: int,
        on_warning: Callable[[str, str], None],
        deliver_inline: bool = True,
    ) -> None:
        super().__init__(name=f"refrun-writer-{spool.local_id}", daemon=True)
        self.spool = spool
        self.flush_interval_s = flush_interval_s
        self.max_queue = max_queue
        self._warn = on_warning
        self.queue: deque[Point | PointBlock] = deque()
        # Points in queued blocks beyond one an item: added by the accepting thread,
        # taken off by this one (queued_points).
        self.block_points_in = 0
        self.block_points_out = 0
        self._in_lock = threading.Lock()
        # Tag/param changes: applied to the spool's metadata here, never on the training
        # thread (updating it takes an flock shared with the delivery process and fsyncs).
        self.meta_changes: deque[Callable[[SpoolMeta], None]] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deliver = threading.Event()
        if deliver_inline:
            self._deliver.set()
        self._backoff = delivery.Backoff()
        self._last_change: float | None = None
        self._offline = False
        self.points_spooled = 0
        self.points_dropped = 0
        self.disk_full = False
        self.error: BaseException | None = None

    # --- called from the training thread ----------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to spool everything queued and exit; wait up to ``timeout`` s."""
        self._deliver.clear()  # the closing thread does the final delivery itself
        self._stopping.set()
        self._wake.set()
        self.join(timeout)

    def deliver_inline(self) -> None:
        """Deliver from this thread (when no delivery process could be started)."""
        self._deliver.set()

    # --- the thread ---------------------------------------------------------
    def run(self) -> None:
        fd = -1
        try:
            fd = self.spool.open_points()
            while True:
                stopping = self._stopping.is_set()
                self._spool_queued(fd)
                self.apply_meta_changes()
                if stopping:
                    self._spool_queued(fd)
                    self.apply_meta_changes()
                    return
                if self._deliver.is_set():
                    self._try_deliver()
                else:
                    self._relay_delivery_status()
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
        except BaseException as exc:  # the writer must never take training down
            self.error = exc
            self._warn("writer", f"refrun writer stopped: {exc!r}; points stay in "
                       f"{self.spool.path}")
        finally:
            if fd >= 0:
                os.close(fd)

    def apply_meta_changes(self) -> None:
        """Apply the queued tag/param changes in one metadata update (also called by the
        closing thread once this thread has stopped, for changes queued meanwhile)."""
        q = self.meta_changes
        n = len(q)
        if not n:
            return
        # Taken off the queue only once written: ``RunSession.tags`` reads the spool's
        # metadata plus the queue, so a change waiting here for the metadata lock must
        # stay visible in the queue (applying it twice is harmless: a change sets values).
        changes = [q[i] for i in range(n)]

        def change_all(meta: SpoolMeta) -> None:
            for change in changes:
                change(meta)

        try:
            self.spool.update_meta(change_all)
        except Exception as exc:
            self._warn("meta", f"tags/params not recorded: {exc}")
        finally:
            for _ in range(n):
                q.popleft()

    def put_block(self, block: PointBlock) -> None:
        """Queue a block of points (any thread)."""
        with self._in_lock:
            self.block_points_in += len(block) - 1
        self.queue.append(block)

    def queued_points(self) -> int:
        """Points waiting in :attr:`queue` (a :class:`PointBlock` counts its points): what
        :meth:`put_block` added beyond one an item, less what this thread took off."""
        return len(self.queue) + self.block_points_in - self.block_points_out

    def _spool_queued(self, fd: int) -> None:
        q = self.queue
        k = len(q)
        if not k:
            return
        points = [q.popleft() for _ in range(k)]
        n = count_points(points)
        self.block_points_out += n - k
        if self.disk_full:
            self.points_dropped += n
            return
        try:
            append_points(fd, points)
            self.points_spooled += n
        except OSError as exc:
            if not disk_full(exc):
                raise
            self.disk_full = True
            self.points_dropped += n
            self.spool.release_reserve()
            self._warn("disk-full", f"spool disk full ({exc.strerror}) at {self.spool.path}: "
                       "training continues; from now on points are counted in "
                       "refrun.dropped, not kept")

    def _relay_delivery_status(self) -> None:
        # The delivery process cannot reach the session's warnings; it reports through
        # the spool and this thread turns changes of its state into warnings.
        status = delivery.read_status(self.spool)
        if status is None or status.changed == self._last_change:
            return
        self._last_change = status.changed
        self._set_offline(not status.ok, status.error)

    def _set_offline(self, offline: bool, error: str | None) -> None:
        if offline and not self._offline:
            self._warn("offline", f"tracking store unreachable ({error}); training "
                       f"continues, points are kept in {self.spool.path}")
        elif not offline and self._offline:
            self._warn("online", "tracking store reachable again; delivering spooled points")
        self._offline = offline

    def _try_deliver(self) -> None:
        if not self._backoff.ready():
            return
        try:
            delivery.deliver_pending(self.spool, _MAX_BATCHES_PER_ITERATION)
        except Exception as exc:
            self._backoff.failed()
            self._set_offline(True, f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        self._backoff.succeeded()
        self._set_offline(False, None)
