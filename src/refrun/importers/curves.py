"""Validated imported curves: every point of a file, checked before anything is recorded.

Every importer parses and validates the whole file into :class:`ImportedCurves` first (a
columnar table in logging order); only then :func:`refrun.importers.record.create_run`
touches the store, so a bad file writes nothing.  Metric names and steps are checked with
MLflow's own rules (:mod:`refrun.keys`) where the file is read, so the error names the
file and the line or key.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from refrun.errors import RefrunInputError
from refrun.keys import key_problem, step_problem

# Columns of ImportedCurves.frame, in logging order (the curves artifact adds
# timestamp_ms and seq when the run is recorded).
COLUMNS = ("metric", "step", "value")


@dataclass(frozen=True, eq=False)
class ImportedCurves:
    """Points read from a file, in the order they are logged.

    ``frame``: columns ``metric`` (str), ``step`` (int64), ``value`` (float64; NaN and
    +-inf kept), one row per point in logging order.  ``params`` are recorded as run params.
    """

    format: str
    sources: list[Path]
    frame: pd.DataFrame = field(repr=False)
    params: dict[str, str] = field(default_factory=dict)
    timestamp_ms: np.ndarray | None = field(default=None, repr=False)
    """Each point's wall time (ms since the epoch) when the file records one (TensorBoard,
    MLPerf logs); None: the points are stamped with the time the run is written."""

    @classmethod
    def from_columns(cls, format: str, sources: Sequence[Path],
                     metrics: Sequence[str] | np.ndarray | pd.Categorical,
                     steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
                     params: dict[str, str] | None = None,
                     timestamp_ms: Sequence[int] | np.ndarray | None = None
                     ) -> ImportedCurves:
        """Curves from three (four, with wall times) equally long columns in logging
        order."""
        frame = pd.DataFrame({
            "metric": metrics if isinstance(metrics, pd.Categorical)
            else pd.Categorical(np.asarray(metrics, dtype=object)),
            "step": np.asarray(steps, dtype=np.int64),
            "value": np.asarray(values, dtype=np.float64),
        })
        stamps = None if timestamp_ms is None else np.asarray(timestamp_ms, dtype=np.int64)
        if stamps is not None and len(stamps) != len(frame):
            raise ValueError("timestamp_ms: one wall time per point")
        return cls(format, list(sources), frame, dict(params or {}), stamps)

    def __len__(self) -> int:
        return len(self.frame)

    @property
    def metric_names(self) -> list[str]:
        return sorted(str(m) for m in self.frame["metric"].unique())

    @property
    def nonfinite(self) -> int:
        """Number of NaN/+-inf points."""
        return int((~np.isfinite(self.frame["value"].to_numpy())).sum())

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """Steps and values of one metric in logging order."""
        rows = self.frame[self.frame["metric"] == metric]
        return rows["step"].tolist(), rows["value"].tolist()


# Largest file an importer reads (it is read whole into memory, then parsed): 1 GiB holds
# tens of millions of points in any of the formats; ``$REFRUN_IMPORT_MAX_BYTES`` changes it.
DEFAULT_MAX_BYTES = 1 << 30


def max_import_bytes() -> int:
    """The file-size bound of the importers (``$REFRUN_IMPORT_MAX_BYTES``, default 1 GiB)."""
    raw = os.environ.get("REFRUN_IMPORT_MAX_BYTES", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise RefrunInputError(f"$REFRUN_IMPORT_MAX_BYTES={raw!r}: expected a number of "
                               "bytes") from None
    if value <= 0:
        raise RefrunInputError(f"$REFRUN_IMPORT_MAX_BYTES={raw!r}: must be > 0")
    return value


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
               (stat.S_ISSOCK, "a socket"))


def read_bytes(path: str | os.PathLike[str], limit: int | None = None) -> tuple[Path, bytes]:
    """The bytes of the regular file ``path`` (a symlink to one is followed), at most
    ``limit`` (default :func:`max_import_bytes`).

    Anything else is refused in one line before a byte is read: a device (``/dev/zero``
    never ends), a named pipe (it blocks until a writer comes: opened without waiting,
    then refused), a socket, a directory.  The size is checked on the open file and the
    read stops one byte past the limit, so a file that grows while read is refused too.
    """
    p = Path(path)
    limit = max_import_bytes() if limit is None else limit
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RefrunInputError(f"{p}: no such file") from None
    except OSError as exc:
        raise RefrunInputError(f"{p}: cannot read ({type(exc).__name__}: "
                               f"{exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "a special file")
            raise RefrunInputError(f"{p}: {kind}, not a regular file (importers read files)")
        if st.st_size > limit:
            raise RefrunInputError(f"{p}: {st.st_size:,} bytes, larger than the import limit "
                                   f"of {limit:,} bytes ($REFRUN_IMPORT_MAX_BYTES)")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 24, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise RefrunInputError(f"{p}: more than the import limit of {limit:,} bytes "
                                   "($REFRUN_IMPORT_MAX_BYTES; the file grew while read)")
        return p, b"".join(chunks)
    except OSError as exc:
        raise RefrunInputError(f"{p}: cannot read ({type(exc).__name__}: "
                               f"{exc.strerror or exc})") from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The file's text; a missing, unreadable, empty, too large or special file
    (:func:`read_bytes`) is bad input, and so is text that is not UTF-8.

    A leading UTF-8 byte-order mark (what spreadsheet programs write in front of a CSV
    file) is not part of the text: ``utf-8-sig`` drops it, so the first column's name is
    what the user sees.
    """
    p, data = read_bytes(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RefrunInputError(f"{p}:{line}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise RefrunInputError(f"{p}: empty file")
    return p, text


# JSON numbers an importer accepts: what a float holds.  Python's parser turns 1e999 into
# inf and reads a 400-digit integer exactly (then float() overflows, or a 5,000-digit one
# hits Python's integer-conversion limit): both are refused with the line they are on.
# 309 digits: the first integer length float() cannot hold (float max ~1.8e308).
MAX_INT_DIGITS = 309
# Deepest JSON nesting an importer accepts; the formats are at most 4 levels deep.  Checked
# before parsing, so the parser never recurses towards Python's limit.
MAX_JSON_DEPTH = 64


class JsonNumberOutOfRange(ValueError):
    """A JSON number no float holds (raised from the parser's number hooks)."""

    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _parse_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):  # 1e999: out of range, not an infinity
        raise JsonNumberOutOfRange(literal)
    return value


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) >= MAX_INT_DIGITS:
        raise JsonNumberOutOfRange(literal)
    return int(literal)


def too_deep_at(text: str) -> int | None:
    """Index in ``text`` where JSON nesting first goes past :data:`MAX_JSON_DEPTH`
    levels (brackets outside strings, one linear pass), or None."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return None
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return i
        elif ch in "]}":
            depth -= 1
    return None


def load_json(text: str, p: Path, line: int | None = None,
              object_pairs_hook: Callable[[list[tuple[str, object]]], object] | None = None,
              ) -> object:
    """``json.loads(text)`` for an importer: nesting bounded (:data:`MAX_JSON_DEPTH`),
    numbers a float cannot hold refused, each in one line naming file ``p`` and the line
    (``line`` when ``text`` is that one line of the file, else found in ``text``).  Other
    errors of the parser (``json.JSONDecodeError``) and of ``object_pairs_hook``
    propagate."""

    def where(at: int) -> str:
        return f"{p}:{line if line is not None else text.count(chr(10), 0, max(at, 0)) + 1}"

    deep = too_deep_at(text)
    if deep is not None:
        raise RefrunInputError(f"{where(deep)}: JSON nested more than {MAX_JSON_DEPTH} "
                               "levels deep (the format has a few)")
    try:
        return json.loads(text, parse_float=_parse_float, parse_int=_parse_int,
                          object_pairs_hook=object_pairs_hook)
    except JsonNumberOutOfRange as exc:
        shown = exc.literal if len(exc.literal) <= 24 else \
            f"{exc.literal[:12]}... ({len(exc.literal):,} characters)"
        raise RefrunInputError(f"{where(text.find(exc.literal))}: number {shown} is out "
                               "of the range of a float") from None
    except RecursionError:  # a guard behind the depth check
        raise RefrunInputError(f"{where(0)}: JSON nested too deeply") from None


def shown(value: object, quote: bool = True, limit: int = 40) -> str:
    """``value`` for an error line: its repr (or str), cut to ``limit`` characters with
    its length, so a 100,000-character cell makes a one-line message."""
    text = repr(value) if quote else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}... ({len(text):,} characters)"


def parse_value(text: str | float) -> float | None:
    """A float from text (or a number), accepting nan/inf spellings; None when it is not
    a number or too large for a float ("1e999", or 400 digits: float() makes them inf,
    which only an infinity's own spelling may mean)."""
    try:
        value = float(text)
    except (TypeError, ValueError, OverflowError):
        return None
    if math.isinf(value) and not (isinstance(text, str) and text.strip().lstrip(
            "+-").lower() in ("inf", "infinity")) and not isinstance(text, float):
        return None
    return value


def check_name(name: str, where: str) -> str:
    """``name`` when MLflow accepts it as a metric name, else a one-line error that starts
    with ``where`` (the file and line or key)."""
    problem = key_problem(name, "metric name")
    if problem is not None:
        raise RefrunInputError(f"{where}: {problem}")
    return name


def parse_step(text: str, where: str) -> int:
    """An integer step that fits MLflow's signed 64-bit step column, else an error that
    starts with ``where``."""
    try:
        step = int(text)
    except ValueError:
        raise RefrunInputError(f"{where}: step {shown(text)} is not an integer") from None
    problem = step_problem(step)
    if problem is not None:
        raise RefrunInputError(f"{where}: {problem}")
    return step
