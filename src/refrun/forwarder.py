"""The delivery process: moves a live run's spool into MLflow outside the training process.

MLflow's client does its work in Python (building entities, SQLAlchemy for a local
sqlite store: ~0.1 ms a point).  Done on a thread of the training process it would hold
the GIL for milliseconds at a time, and every framework call that released the GIL would
wait to get it back.  So the training process only appends points to its spool (a thread
that formats lines and calls ``write``), and this separate process, started by
``start_run``, delivers them::

    python -m refrun.forwarder SPOOL_DIR INTERVAL_S

It reads the spool every ``INTERVAL_S`` and delivers new lines (see :mod:`refrun.delivery`).
Its standard input is a pipe from the training process: the line ``close`` means the run
closed; end-of-file, or being re-parented, means the process died.  It then waits for the
session's lock (released by ``close()``, or by the kernel when the process died) and
finishes the spool like ``refrun sync`` does — a run whose process died without closing
is marked KILLED.  It holds ``forwarder.lock`` while it
lives, so ``refrun sync`` leaves the spool alone.  Its state for the training process's
warnings goes to ``delivery.json``; its own log to ``forwarder.log``.

Exit codes: 0 delivered, 3 the store stayed unreachable (the spool stays for
``refrun sync``).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from refrun.delivery import deliver_pending
from refrun.spool import Spool, _atomic_write

FORWARDER_LOCK = "forwarder.lock"
STATUS_FILE = "delivery.json"
# After the training process is gone, keep trying the store this long before leaving the
# spool to `refrun sync`.
FINAL_TIMEOUT_S = float(os.environ.get("REFRUN_FORWARDER_FINAL_TIMEOUT_S", "600"))


def spawn(spool: Spool, interval_s: float) -> subprocess.Popen | None:
    """Start the forwarder for ``spool``; None when it cannot be started."""
    try:
        log = open(spool.path / "forwarder.log", "ab")  # noqa: SIM115 - handed to the child
        return subprocess.Popen(
            [sys.executable, "-m", "refrun.forwarder", str(spool.path), str(interval_s)],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C on the training terminal must not kill delivery.
            start_new_session=True, close_fds=True,
        )
    except OSError:
        return None


def forwarder_alive(spool: Spool) -> bool:
    """True while a forwarder process holds the spool's ``forwarder.lock``."""
    path = spool.path / FORWARDER_LOCK
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def read_status(spool: Spool) -> dict | None:
    try:
        return json.loads((spool.path / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_status(spool: Spool, ok: bool, error: str | None) -> None:
    _atomic_write(spool.path / STATUS_FILE, json.dumps({"ok": ok, "error": error,
                                                        "time": time.time()}))


def _wait_for_session_lock(spool: Spool) -> None:
    while True:
        fd = spool.try_lock()
        if fd is not None:
            Spool.unlock(fd)
            return
        time.sleep(0.05)


def run(spool: Spool, interval_s: float) -> int:
    lock_fd = os.open(spool.path / FORWARDER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another forwarder owns this spool
    spool.update_meta(lambda m: m.update(forwarder_pid=os.getpid()))
    stdin = sys.stdin.fileno()
    parent = os.getppid()
    backoff, retry_at, ok = 0.0, 0.0, True
    while True:
        readable, _, _ = select.select([stdin], [], [], interval_s)
        data = os.read(stdin, 4096) if readable else None
        # The session writes "close"; end-of-file or a new parent means it died.  (EOF alone
        # is not enough: a forked child of the trainer, e.g. a DataLoader worker, may still
        # hold the pipe open.)
        if data == b"" or (data and b"close" in data) or os.getppid() != parent:
            break
        if time.monotonic() < retry_at:
            continue
        try:
            deliver_pending(spool)
        except Exception as exc:
            backoff = min(30.0, max(1.0, backoff * 2))
            retry_at = time.monotonic() + backoff
            if ok:
                ok = False
                _write_status(spool, False, f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        if not ok:
            ok = True
            _write_status(spool, True, None)
        backoff = 0.0

    from refrun.sync import sync_spool

    _wait_for_session_lock(spool)
    deadline = time.monotonic() + FINAL_TIMEOUT_S
    backoff = 0.5
    while True:
        result = sync_spool(spool, forwarder=True)
        if result.outcome in ("delivered", "complete"):
            return 0
        print(f"refrun forwarder: {result.outcome}: {result.detail}", flush=True)
        if time.monotonic() > deadline:
            return 3
        time.sleep(backoff)
        backoff = min(30.0, backoff * 2)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run(Spool(Path(args[0])), float(args[1]))


if __name__ == "__main__":
    sys.exit(main())
