"""torchtitan loss files: one ``STEP LOSS`` pair a line (tests/assets/losses/*.txt)."""

from __future__ import annotations

import os
from typing import Any

from refrun import schema
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

FORMAT = "torchtitan"


def parse_torchtitan(path: str | os.PathLike[str], metric: str = schema.M_LOSS
                     ) -> ImportedCurves:
    """Validate and read a torchtitan loss file; values recorded as ``metric``.

    Blank lines are skipped; every other line must be ``<int step> <float value>``
    (``nan``/``inf`` accepted and kept).  Errors name the file and line.
    """
    p, text = read_text(path)
    check_name(metric, f"{p}: --metric")
    steps: list[int] = []
    values: list[float] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise RefrunInputError(f"{p}:{lineno}: expected 2 columns 'STEP LOSS', got "
                                   f"{len(fields)}")
        steps.append(parse_step(fields[0], f"{p}:{lineno}"))
        value = parse_value(fields[1])
        if value is None:
            raise RefrunInputError(f"{p}:{lineno}: value {shown(fields[1])} is not a "
                                   "number (or out of the range of a float)")
        values.append(value)
    return ImportedCurves.from_columns(FORMAT, [p], [metric] * len(steps), steps, values)


def import_torchtitan(path: str | os.PathLike[str], *, workload: str, role: str,
                      hardware: str, metric: str = schema.M_LOSS, **kwargs: Any) -> str:
    """Import a torchtitan loss file as a new run; returns its run id.

    ``kwargs``: ``seed``, ``chips``, ``run_name``, ``tracking_uri``, ``spool_dir``, ``tags``
    (see :func:`refrun.importers.record.create_run`).
    """
    return create_run(parse_torchtitan(path, metric), workload=workload, role=role,
                      hardware=hardware, **kwargs)
