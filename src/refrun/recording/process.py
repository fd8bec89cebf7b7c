"""The delivery process: moves a live run's spool into MLflow outside the training process.

MLflow's client does its work in Python (building entities, SQLAlchemy for a local
sqlite store: ~0.1 ms a point).  Done on a thread of the training process it would hold
the GIL for milliseconds at a time, and every framework call that released the GIL would
wait to get it back.  So the training process only appends points to its spool, and this
separate process, started by ``start_run``, delivers them::

    python -m refrun.recording.process SPOOL_DIR INTERVAL_S

The session takes the spool's ``delivery.lock`` *before* starting the process and hands
the locked descriptor over (``pass_fds``), so from the moment ``start_run`` returns the
spool has a live delivery owner and ``refrun sync`` leaves it alone.

It delivers new lines every ``INTERVAL_S`` (:func:`refrun.recording.delivery.deliver_pending`)
and reports its state and a heartbeat in ``delivery.json``.  Its standard input is a pipe
from the training process: the line ``close`` means the run closed; end-of-file, or being
re-parented, means the process died.  It then waits for the session's lock and finishes the
spool (:func:`refrun.recording.delivery.finish_spool`; a run whose process died without
closing is sealed as KILLED), retrying an unreachable store for
``REFRUN_DELIVERY_FINAL_TIMEOUT_S``.  Its own log goes to ``delivery.log``.

Exit codes: 0 delivered, 3 the store stayed unreachable (the spool stays for
``refrun sync``).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from refrun.recording import delivery
from refrun.recording.spool import Spool, SpoolMeta, unlock
from refrun.settings import settings
from refrun.store.client import bound_http_requests

LOG_FILE = "delivery.log"


def spawn(spool: Spool, interval_s: float) -> subprocess.Popen | None:
    """Start the delivery process for ``spool``; None when it cannot be started.

    The delivery lock is taken here and inherited by the child, so the spool is never
    without a live owner between this call and the child's start.
    """
    lock_fd = spool.try_lock(delivery.DELIVERY_LOCK)
    if lock_fd is None:
        return None
    try:
        with open(spool.path / LOG_FILE, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "refrun.recording.process", str(spool.path),
                 str(interval_s), str(lock_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                # Its own session: Ctrl-C on the training terminal must not kill delivery.
                start_new_session=True, close_fds=True, pass_fds=(lock_fd,),
            )
    except OSError:
        unlock(lock_fd)
        return None
    os.close(lock_fd)  # the child's copy holds the lock now (flock follows the file)

    def record(m: SpoolMeta) -> None:
        m.delivery_pid = proc.pid

    with contextlib.suppress(OSError):  # disk full: the pid is only for diagnosis
        spool.update_meta(record)
    return proc


def _heartbeat(spool: Spool, ok: bool, error: str | None, changed: float) -> None:
    with contextlib.suppress(OSError):  # a full disk must not stop delivery
        delivery.write_status(spool, delivery.DeliveryStatus(ok, error, changed, time.time()))


def _live(spool: Spool, interval_s: float) -> None:
    """Deliver while the training process lives; returns when it closed or died."""
    stdin = sys.stdin.fileno()
    parent = os.getppid()
    backoff = delivery.Backoff()
    ok, changed = True, time.time()
    _heartbeat(spool, ok, None, changed)
    while True:
        readable, _, _ = select.select([stdin], [], [], interval_s)
        data = os.read(stdin, 4096) if readable else None
        # The session writes "close"; end-of-file or a new parent means it died.  (EOF alone
        # is not enough: a forked child of the trainer, e.g. a DataLoader worker, may still
        # hold the pipe open.)
        if data == b"" or (data and b"close" in data) or os.getppid() != parent:
            return
        if not backoff.ready():
            continue
        try:
            delivery.deliver_pending(spool)
        except Exception as exc:
            backoff.failed()
            if ok:
                ok, changed = False, time.time()
                _heartbeat(spool, ok, f"{type(exc).__name__}: {str(exc)[:300]}", changed)
            continue
        backoff.succeeded()
        if not ok:
            ok, changed = True, time.time()
        _heartbeat(spool, ok, None, changed)


def _drain(spool: Spool) -> None:
    """Deliver the backlog a few batches at a time, with a heartbeat after each, so the
    closing session sees progress; stops at the first error (the final loop retries)."""
    while True:
        before = spool.read_cursor().lines
        try:
            delivery.deliver_pending(spool, max_batches=20)
        except Exception:
            return
        if spool.read_cursor().lines == before:
            return
        _heartbeat(spool, True, None, time.time())


def _warm_up(spool: Spool) -> None:
    """Import MLflow and open the store (local work, seconds on a busy machine) with a
    heartbeat meanwhile, so a closing session does not mistake it for a silent store."""
    done = threading.Event()
    changed = time.time()

    def beat() -> None:
        while not done.wait(0.5):
            _heartbeat(spool, True, None, changed)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        delivery.client_for(spool.read_meta().tracking_uri)
    except Exception as exc:  # the delivery loop retries and reports it
        print(f"refrun delivery: opening the store failed: {exc}", flush=True)
    finally:
        done.set()
        t.join()


def run(spool: Spool, interval_s: float) -> int:
    s = settings()
    bound_http_requests(s)
    _heartbeat(spool, True, None, time.time())
    _warm_up(spool)
    _live(spool, interval_s)
    while spool.locked(delivery.SESSION_LOCK):
        time.sleep(0.05)  # the session releases its lock when it closed or died
    _drain(spool)
    deadline = time.monotonic() + s.final_timeout_s
    backoff = delivery.Backoff(first_s=0.5)
    while True:
        try:
            result = delivery.finish_spool(spool, as_delivery_process=True)
        except OSError as exc:  # disk full: nothing more can be written
            print(f"refrun delivery: {exc}", flush=True)
            return 3
        if result.outcome in ("delivered", "complete"):
            _heartbeat(spool, True, None, time.time())
            delivery.shrink_delivered(spool, keep=s.keep_spool)
            return 0
        print(f"refrun delivery: {result.outcome}: {result.detail}", flush=True)
        _heartbeat(spool, False, result.detail, time.time())
        if time.monotonic() > deadline:
            return 3
        time.sleep(backoff.failed())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # argv[2], the inherited delivery-lock descriptor, stays open for the process's life.
    return run(Spool(Path(args[0])), float(args[1]))


if __name__ == "__main__":
    sys.exit(main())
