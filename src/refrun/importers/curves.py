"""Validated imported curves: every point of a file, checked before anything is recorded.

Every importer parses and validates the whole file into :class:`ImportedCurves` first (a
columnar table in logging order); only then :func:`refrun.importers.record.create_run`
touches the store, so a bad file writes nothing.  Metric names and steps are checked with
MLflow's own rules (:mod:`refrun.keys`) where the file is read, so the error names the
file and the line or key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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


def read_text(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The file's text; a missing, unreadable, empty or too large file is bad input.

    A leading UTF-8 byte-order mark (what spreadsheet programs write in front of a CSV
    file) is not part of the text: ``utf-8-sig`` drops it, so the first column's name is
    what the user sees.
    """
    p = Path(path)
    limit = max_import_bytes()
    try:
        size = p.stat().st_size
        if size > limit:
            raise RefrunInputError(f"{p}: {size:,} bytes, larger than the import limit of "
                                   f"{limit:,} bytes ($REFRUN_IMPORT_MAX_BYTES)")
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError as exc:
        raise RefrunInputError(f"{p}: no such file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RefrunInputError(f"{p}: cannot read ({type(exc).__name__}: {exc})") from exc
    if not text.strip():
        raise RefrunInputError(f"{p}: empty file")
    return p, text


def parse_value(text: str | float) -> float | None:
    """A float from text (or a number), accepting nan/inf spellings; None when it is not
    a number or too large for a float."""
    try:
        return float(text)
    except (TypeError, ValueError, OverflowError):
        return None


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
        raise RefrunInputError(f"{where}: step {text!r} is not an integer") from None
    problem = step_problem(step)
    if problem is not None:
        raise RefrunInputError(f"{where}: {problem}")
    return step
