"""The background writer: the only thread that touches the disk spool and the store.

The training thread appends points to an in-memory deque (bounded, never blocking) and
returns.  Every ``flush_interval_s`` this thread moves the queued points to the spool
file (so a SIGKILL loses at most one interval).  Delivery to MLflow is normally done by a
separate process (:mod:`refrun.forwarder`), whose state this thread relays as warnings;
with ``deliver_inline`` (``delivery="thread"``, or when no process could be started) this
thread also delivers undelivered spool lines in batches of up to 1000.  A store error puts
inline delivery into back-off (1 s doubling to 30 s) while the spool keeps growing;
delivery resumes from the cursor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from refrun import delivery, forwarder
from refrun.spool import Point, Spool

log = logging.getLogger("refrun")

# Per loop iteration, deliver at most this many batches so that draining the queue to
# the spool (the durability guarantee) is never starved by a long backlog.
_MAX_BATCHES_PER_ITERATION = 20


class BackgroundWriter(threading.Thread):
    """Drains accepted points to the spool and delivers them to MLflow, off the training thread."""

    def __init__(
        self,
        spool: Spool,
        *,
        flush_interval_s: float = 1.0,
        max_queue: int = 2_000_000,
        on_warning: Callable[[str], None] = log.warning,
        deliver_inline: bool = True,
    ) -> None:
        super().__init__(name=f"refrun-writer-{spool.local_id}", daemon=True)
        self.spool = spool
        self.flush_interval_s = flush_interval_s
        self.max_queue = max_queue
        self._on_warning = on_warning
        self.queue: deque[Point] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deliver = threading.Event()
        if deliver_inline:
            self._deliver.set()
        self._last_status: float | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._offline = False
        self.points_spooled = 0
        self.delivery_errors = 0
        self.error: BaseException | None = None

    # --- called from the training thread ----------------------------------
    def full(self) -> bool:
        return len(self.queue) >= self.max_queue

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to spool everything queued and exit; wait up to ``timeout`` s."""
        self._deliver.clear()  # the closing thread does the final delivery itself
        self._stopping.set()
        self._wake.set()
        self.join(timeout)

    # --- the thread ---------------------------------------------------------
    def run(self) -> None:
        try:
            with open(self.spool.points_path, "ab") as fh:
                while True:
                    stopping = self._stopping.is_set()
                    self._spool_queued(fh)
                    if stopping:
                        self._spool_queued(fh)
                        return
                    if self._deliver.is_set():
                        self._try_deliver()
                    else:
                        self._relay_forwarder_status()
                    self._wake.wait(self.flush_interval_s)
                    self._wake.clear()
        except BaseException as exc:  # the writer must never take training down
            self.error = exc
            self._on_warning(f"refrun writer stopped: {exc!r}; points stay in {self.spool.path}")

    def _spool_queued(self, fh) -> None:
        q = self.queue
        n = len(q)
        if n:
            points = [q.popleft() for _ in range(n)]
            self.spool.append(fh, points)
            self.points_spooled += n

    def deliver_inline(self) -> None:
        """Deliver from this thread (when no delivery process could be started)."""
        self._deliver.set()

    def _relay_forwarder_status(self) -> None:
        # The delivery process cannot reach the session's warnings; it leaves its state in
        # the spool and this thread turns changes of it into warnings.
        status = forwarder.read_status(self.spool)
        if status is None or status.get("time") == self._last_status:
            return
        self._last_status = status.get("time")
        if not status.get("ok") and not self._offline:
            self._offline = True
            self._on_warning(f"tracking store unreachable ({status.get('error')}); training "
                             f"continues, points are kept in {self.spool.path}")
        elif status.get("ok") and self._offline:
            self._offline = False
            self._on_warning("tracking store reachable again; delivering spooled points")

    def _try_deliver(self) -> None:
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            delivery.deliver_pending(self.spool, _MAX_BATCHES_PER_ITERATION)
        except Exception as exc:
            self.delivery_errors += 1
            self._backoff_s = min(30.0, max(1.0, self._backoff_s * 2))
            self._retry_at = time.monotonic() + self._backoff_s
            if not self._offline:
                self._offline = True
                self._on_warning(
                    f"tracking store unreachable ({type(exc).__name__}: {str(exc)[:200]}); "
                    f"training continues, points are kept in {self.spool.path}"
                )
            return
        if self._offline:
            self._offline = False
            self._on_warning("tracking store reachable again; delivering spooled points")
        self._backoff_s = 0.0
