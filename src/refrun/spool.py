"""The durable local spool that backs every run.

Every point the session accepts is appended here before it is sent anywhere, so a
tracking server that is down, or a process killed with SIGKILL, loses nothing that
reached the spool.  A spool is one directory::

    <root>/<local_id>/
        meta.json     run identity, tracking URI, MLflow run id once created, status
        points.tsv    append-only, one point a line: key \\t step \\t timestamp_ms \\t value
        cursor        "<lines> <bytes>" already delivered to MLflow (atomic rewrite)
        artifacts/    files to upload to the run (curves.parquet, environment.json ...)
        lock          held (flock) by the live session; ``refrun sync`` skips locked spools

Delivery is at-least-once from the cursor; it is exactly-once in the store because a
re-sent point carries the same (key, step, timestamp, value), which MLflow's SQL stores
de-duplicate on their primary key.  The window for a re-send is one batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

DEFAULT_ROOT_ENV = "REFRUN_SPOOL_DIR"
DEFAULT_ROOT = ".refrun/spool"

Point = tuple[str, int, int, float]  # key, step, timestamp_ms, value


def default_root() -> Path:
    """Spool root: ``$REFRUN_SPOOL_DIR`` or ``./.refrun/spool`` (absolute)."""
    return Path(os.environ.get(DEFAULT_ROOT_ENV, DEFAULT_ROOT)).absolute()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def format_points(points: list[Point]) -> str:
    """Serialise points to spool lines; ``repr`` keeps every float bit and nan/inf."""
    return "".join(f"{k}\t{s}\t{t}\t{v!r}\n" for k, s, t, v in points)


@dataclass
class Spool:
    """One run's spool directory; see the module docstring for the layout."""

    path: Path
    # Serialises read-modify-write of meta.json between the training and writer threads.
    _meta_lock: threading.RLock = field(default_factory=threading.RLock, repr=False,
                                        compare=False)

    @property
    def local_id(self) -> str:
        return self.path.name

    @property
    def points_path(self) -> Path:
        return self.path / "points.tsv"

    @property
    def artifacts_dir(self) -> Path:
        return self.path / "artifacts"

    # --- creation and metadata -------------------------------------------
    @classmethod
    def create(cls, root: Path, local_id: str, meta: dict[str, Any]) -> Spool:
        path = Path(root) / local_id
        (path / "artifacts").mkdir(parents=True, exist_ok=False)
        spool = cls(path)
        spool.points_path.touch()
        _atomic_write(path / "cursor", "0 0\n")
        spool.write_meta(meta)
        return spool

    def read_meta(self) -> dict[str, Any]:
        return json.loads((self.path / "meta.json").read_text(encoding="utf-8"))

    def write_meta(self, meta: dict[str, Any]) -> None:
        _atomic_write(self.path / "meta.json", json.dumps(meta, indent=1, sort_keys=True))

    def update_meta(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to meta.json in place, atomically with respect to other threads
        and to the delivery process (a thread lock plus an flock on ``meta.lock``)."""
        with self._meta_lock:
            fd = os.open(self.path / "meta.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                meta = self.read_meta()
                change(meta)
                self.write_meta(meta)
                return meta
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    # --- locking -------------------------------------------------------------
    def try_lock(self) -> int | None:
        """Take the spool's exclusive lock without waiting; None when another holds it."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    # --- points --------------------------------------------------------------
    def append(self, fh: Any, points: list[Point]) -> None:
        """Append points through an open binary-append handle and flush to the OS.

        A flush (not an fsync) is what survives SIGKILL: the data is in the kernel.
        """
        fh.write(format_points(points).encode("utf-8"))
        fh.flush()

    def read_cursor(self) -> tuple[int, int]:
        lines, nbytes = (self.path / "cursor").read_text().split()
        return int(lines), int(nbytes)

    def write_cursor(self, lines: int, nbytes: int) -> None:
        _atomic_write(self.path / "cursor", f"{lines} {nbytes}\n")

    def iter_undelivered(self, max_points: int) -> Iterator[tuple[list[Point], int, int]]:
        """Yield (points, lines_after, bytes_after) batches from the cursor onwards.

        Only complete lines are read: a line torn by a kill at write time is left for later.
        """
        lines, offset = self.read_cursor()
        with open(self.points_path, "rb") as f:
            f.seek(offset)
            batch: list[Point] = []
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                offset += len(raw)
                lines += 1
                batch.append(parse_line(raw))
                if len(batch) >= max_points:
                    yield batch, lines, offset
                    batch = []
            if batch:
                yield batch, lines, offset

    def read_all(self) -> pd.DataFrame:
        """Every complete point as the curves table (metric, step, value, timestamp_ms, seq)."""
        return read_points_file(self.points_path)


def parse_line(raw: bytes) -> Point:
    key, step, ts, value = raw.decode("utf-8").rstrip("\n").split("\t")
    return key, int(step), int(ts), float(value)


def read_points_file(path: Path) -> pd.DataFrame:
    """Parse a spool points file into the long curves table; a torn last line is ignored."""
    data = Path(path).read_bytes()
    end = data.rfind(b"\n") + 1
    rows = [line.split("\t") for line in data[:end].decode("utf-8").splitlines()]
    if not rows:
        return empty_curves()
    keys, steps, ts, vals = zip(*rows, strict=True)
    return pd.DataFrame(
        {
            "metric": pd.Series(keys, dtype="string"),
            "step": np.asarray(steps, dtype=np.int64),
            "value": np.asarray([float(v) for v in vals], dtype=np.float64),
            "timestamp_ms": np.asarray(ts, dtype=np.int64),
            "seq": np.arange(len(rows), dtype=np.int64),
        }
    )


def empty_curves() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "metric": pd.Series([], dtype="string"),
            "step": np.array([], dtype=np.int64),
            "value": np.array([], dtype=np.float64),
            "timestamp_ms": np.array([], dtype=np.int64),
            "seq": np.array([], dtype=np.int64),
        }
    )


def list_spools(root: Path) -> list[Spool]:
    root = Path(root)
    if not root.is_dir():
        return []
    return [Spool(p) for p in sorted(root.iterdir()) if (p / "meta.json").is_file()]
