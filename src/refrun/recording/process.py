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
import io
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from refrun import settings as settings_mod
from refrun.errors import RefrunInputError
from refrun.recording import delivery
from refrun.recording.spool import Spool, SpoolMeta, unlock
from refrun.settings import settings
from refrun.store.client import bound_store_waits
from refrun.store.client import client as store_client

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
                # Its own process group: Ctrl-C on the training terminal (sent to the
                # foreground group) must not kill delivery.  Not its own session: with the
                # scheduler's autogroups (Linux's default on desktops and many servers) a
                # new session is a new group that gets as much CPU as the trainer's whole
                # session, whatever its nice value (measured: a CPU-bound trainer beside one
                # busy process had half a core and steps 2.4x slower than with delivery on a
                # thread; docs/session.md, "The delivery process's CPU").
                process_group=0, close_fds=True, pass_fds=(lock_fd,),
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


class _NeverRaises(io.TextIOBase):
    """stdout/stderr of the delivery process (its log file): a write the full disk refuses
    is dropped instead of raising inside whatever printed (MLflow prints a run's URL when
    it terminates it: on a full disk that would abort the termination)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            self._stream.write(s)
            self._stream.flush()
        return len(s)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()


def _say(message: str) -> None:
    """A line in delivery.log; never raises (on a full disk the log cannot grow either)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"refrun delivery: {message}", flush=True)


def _heartbeat(spool: Spool, ok: bool, error: str | None, changed: float) -> None:
    with contextlib.suppress(OSError):  # a full disk must not stop delivery
        delivery.write_status(spool, delivery.DeliveryStatus(ok, error, changed, time.time()))


def _live(spool: Spool, interval_s: float) -> tuple[bool, delivery.Ending | None]:
    """Deliver while the training process lives; returns ``(closed, ending)`` when it
    closed (``ending``: how it ended the run, when it said) or died (``closed`` False)."""
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
        if data and b"close" in data:
            while not data.endswith(b"\n"):  # the rest of the close line
                more = os.read(stdin, 4096)
                if not more:
                    break
                data += more
            return True, delivery.Ending.from_line(data)
        if data == b"" or os.getppid() != parent:
            return False, None
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


def _warm_up(spool: Spool, open_timeout_s: float) -> None:
    """Import MLflow and open the store (local work, seconds on a busy machine) with a
    heartbeat meanwhile, so a closing session does not mistake it for a silent store; for
    at most ``open_timeout_s``: an opening that never ends (the sqlite store's creation
    lock held by a process that hangs, a database server that accepts and never answers)
    is not progress, and must not hold a closing trainer for ever."""
    done = threading.Event()
    changed = time.time()

    def beat() -> None:
        deadline = time.monotonic() + open_timeout_s
        while not done.wait(0.5):
            if time.monotonic() > deadline:
                _say(f"the store has not opened in {open_timeout_s:g} s "
                     "($REFRUN_STORE_OPEN_TIMEOUT_S); still trying, but a closing session "
                     "no longer waits for it")
                return
            _heartbeat(spool, True, None, changed)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        store_client(spool.read_meta().tracking_uri, create=True, direct=True)
    except Exception as exc:  # the delivery loop retries and reports it
        _say(f"opening the store failed: {exc}")
    finally:
        done.set()
        t.join()


def run(spool: Spool, interval_s: float) -> int:
    s = settings()
    bound_store_waits(s)
    # Under a file-size limit (ulimit -f) a write past it raises SIGXFSZ, which kills by
    # default; ignored, the write fails with EFBIG and is handled like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.stdout, sys.stderr = _NeverRaises(sys.stdout), _NeverRaises(sys.stderr)
    _heartbeat(spool, True, None, time.time())
    _warm_up(spool, s.store_open_timeout_s)
    closed, ending = _live(spool, interval_s)
    if not closed:  # the trainer died: when, for the estimate of its unspooled points
        died_ms = time.time_ns() // 1_000_000

        def record(m: SpoolMeta) -> None:
            m.died_ms = died_ms

        with contextlib.suppress(OSError):
            spool.update_meta(record)
    while spool.locked(delivery.SESSION_LOCK):
        time.sleep(0.05)  # the session releases its lock when it closed or died
    _drain(spool)
    deadline = time.monotonic() + s.final_timeout_s
    backoff = delivery.Backoff(first_s=0.5)
    while True:
        try:
            result = delivery.finish_spool(spool, as_delivery_process=True)
        except OSError as exc:  # disk full: nothing more can be written here
            _say(f"{exc}")
            _end_in_store(spool, ending, exc)
            return 3
        if result.outcome in ("delivered", "complete"):
            _heartbeat(spool, True, None, time.time())
            delivery.shrink_delivered(spool, keep=s.keep_spool)
            return 0
        _say(f"{result.outcome}: {result.detail}")
        _heartbeat(spool, False, result.detail, time.time())
        if time.monotonic() > deadline:
            return 3
        time.sleep(backoff.failed())


def _end_in_store(spool: Spool, ending: delivery.Ending | None, why: OSError) -> None:
    # The run must not stay RUNNING in the store because this disk is full: terminate it
    # there (no local write needed) and leave the spool for `refrun sync`.
    try:
        run_id = delivery.terminate_in_store(spool, ending, why)
        _say(f"run {run_id} terminated in the store; spool left for `refrun sync`")
    except Exception as exc:
        _say(f"could not terminate the run in the store: {exc!r}")


DELIVERY_NICE = settings_mod.DEFAULT_DELIVERY_NICE  # see _yield_to_training


def _yield_to_training() -> None:
    """Lower this process's CPU priority (``$REFRUN_DELIVERY_NICE``, default
    ``DELIVERY_NICE``) and ignore the terminal's hang-up: delivery must only use CPU the
    training does not (its spool holds what it has not delivered yet), and it outlives a
    closed terminal as it did in a session of its own.  Where the priority cannot be
    changed, it stays as it was; a malformed setting is not this process's to refuse
    (the trainer goes on): the default applies."""
    try:
        nice = settings_mod.delivery_nice()
    except RefrunInputError:
        nice = DELIVERY_NICE
    with contextlib.suppress(OSError, AttributeError):
        if nice:
            os.nice(nice)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    _yield_to_training()
    # argv[2], the inherited delivery-lock descriptor, stays open for the process's life,
    # and only in this process: a child it started (anything MLflow runs) would otherwise
    # hold the lock after this process died, and ``refrun sync`` would call the spool live.
    if len(args) > 2:
        with contextlib.suppress(OSError, ValueError):
            os.set_inheritable(int(args[2]), False)
    return run(Spool(Path(args[0])), float(args[1]))


if __name__ == "__main__":
    sys.exit(main())
