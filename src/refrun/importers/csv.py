"""CSV curves: a header row, a step column and one column per metric.

An empty cell means "not logged at this step" (no point); ``nan``/``inf`` are kept as
non-finite points.
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from refrun.errors import RefrunInputError
from refrun.importers.curves import (
    ImportedCurves,
    check_name,
    parse_step,
    parse_value,
    read_text,
    shown,
)
from refrun.importers.record import create_run

FORMAT = "csv"


def parse_csv(path: str | os.PathLike[str], step_column: str = "step",
              metrics: Sequence[str] | None = None) -> ImportedCurves:
    """Validate and read a CSV file (comma-separated, first row = header).

    Every row must have as many cells as the header; steps must be integers; values
    numbers (or empty).  Errors name the file, line and column.
    """
    p, text = read_text(path)
    reader = csv.reader(io.StringIO(text))
    try:
        return _parse_rows(p, reader, step_column, metrics)
    except csv.Error as exc:  # a cell past csv's field limit, a stray quote ...
        raise RefrunInputError(f"{p}:{reader.line_num}: not valid CSV ({exc})") from None


def _columns_shown(header: list[str], limit: int = 10) -> str:
    """The header's first columns for an error line (a file may have 100,000)."""
    more = f", ... ({len(header):,} columns)" if len(header) > limit else ""
    return ", ".join(shown(c, quote=False) for c in header[:limit]) + more


def _parse_rows(p: Any, reader: Any, step_column: str,
                metrics: Sequence[str] | None) -> ImportedCurves:
    header: list[str] | None = None
    for row in reader:
        if any(c.strip() for c in row):
            header = [c.strip() for c in row]
            break
    if header is None:
        raise RefrunInputError(f"{p}: empty file")
    hline = reader.line_num
    # Linear in the number of columns (a 100,000-column file is read in a second).
    dup = sorted(c for c, n in Counter(header).items() if n > 1)
    if dup:
        raise RefrunInputError(f"{p}:{hline}: duplicate column names "
                               f"{[shown(c, quote=False) for c in dup[:10]]}"
                               + (f" ({len(dup):,} in all)" if len(dup) > 10 else ""))
    if step_column not in header:
        raise RefrunInputError(f"{p}:{hline}: no step column {step_column!r} "
                               f"(columns: {_columns_shown(header)})")
    istep = header.index(step_column)
    cols = [(i, c) for i, c in enumerate(header) if i != istep]
    if metrics:
        present = set(header)
        missing = [m for m in metrics if m not in present]
        if missing:
            raise RefrunInputError(f"{p}:{hline}: no column {missing[0]!r} "
                                   f"(columns: {_columns_shown(header)})")
        wanted = set(metrics)
        cols = [(i, c) for i, c in cols if c in wanted]
    if not cols:
        raise RefrunInputError(f"{p}:{hline}: no metric column besides {step_column!r}")
    for _, name in cols:
        check_name(name, f"{p}:{hline}: column {shown(name)}")
    names: list[str] = []
    steps: list[int] = []
    values: list[float] = []
    rows = 0
    for row in reader:
        line = reader.line_num
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise RefrunInputError(f"{p}:{line}: expected {len(header)} columns, got {len(row)}")
        step = parse_step(row[istep].strip(), f"{p}:{line}: column {step_column!r}")
        rows += 1
        for i, name in cols:
            cell = row[i].strip()
            if not cell:
                continue
            value = parse_value(cell)
            if value is None:
                raise RefrunInputError(f"{p}:{line}: column {name!r}: {shown(cell)} is not a "
                                       "number (or out of the range of a float)")
            names.append(name)
            steps.append(step)
            values.append(value)
    if not rows:
        raise RefrunInputError(f"{p}: no data rows after the header")
    if not names:
        raise RefrunInputError(f"{p}: every metric cell is empty")
    return ImportedCurves.from_columns(FORMAT, [p], names, steps, values,
                                       {"import.step_column": step_column})


def import_csv(path: str | os.PathLike[str], *, workload: str, role: str, hardware: str,
               step_column: str = "step", metrics: Sequence[str] | None = None,
               **kwargs: Any) -> str:
    """Import a CSV file as a new run; returns its run id (``kwargs`` as for
    :func:`refrun.importers.record.create_run`)."""
    return create_run(parse_csv(path, step_column, metrics), workload=workload, role=role,
                      hardware=hardware, **kwargs)
