"""Validated imported curves and the one place that turns them into a refrun run.

Every importer parses and validates the whole file into :class:`ImportedCurves` first;
only then :func:`create_run` touches the store, so a bad file writes nothing.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.recording.session import start_run

BACKEND = "import"


@dataclass(frozen=True)
class ImportedCurves:
    """Points read from a file, in the order they are logged: ``(metric, step, value)``."""

    format: str
    sources: list[Path]
    points: list[tuple[str, int, float]]
    params: dict[str, str] = field(default_factory=dict)

    @property
    def metric_names(self) -> list[str]:
        return sorted({m for m, _, _ in self.points})

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """Steps and values of one metric in logging order."""
        pts = [(s, v) for m, s, v in self.points if m == metric]
        return [s for s, _ in pts], [v for _, v in pts]


def read_text(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The file's text; a missing, unreadable or empty file is bad input."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise RefrunInputError(f"{p}: no such file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RefrunInputError(f"{p}: cannot read ({type(exc).__name__}: {exc})") from exc
    if not text.strip():
        raise RefrunInputError(f"{p}: empty file")
    return p, text


def parse_value(text: str) -> float | None:
    """A float from text, accepting nan/inf spellings; None when it is not a number."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def create_run(curves: ImportedCurves, *, workload: str, role: str, hardware: str,
               seed: int | None = None, chips: int | None = None,
               run_name: str | None = None, tracking_uri: str | None = None,
               spool_dir: str | os.PathLike[str] | None = None,
               tags: dict[str, Any] | None = None) -> str:
    """Record validated ``curves`` as an ordinary refrun run (backend ``import``).

    Returns the MLflow run id.  Raises :class:`RefrunInputError` for bad identity
    arguments before anything is written.
    """
    if not hardware:
        raise RefrunInputError("hardware: a non-empty name is required")
    if not curves.points:
        raise RefrunInputError(f"{curves.sources[0]}: no points to import")
    all_tags = {
        # The importing machine is not the one that trained: say where the data came from.
        schema.TAG_DEVICE: f"imported from {curves.format} file",
        "refrun.import.format": curves.format,
        "refrun.import.source": ", ".join(p.name for p in curves.sources),
        "refrun.import.sha256": _sha256(curves.sources),
        **(tags or {}),
    }
    nonfinite = sum(1 for _, _, v in curves.points if not math.isfinite(v))
    with start_run(workload, role, hardware=hardware, backend=BACKEND, seed=seed,
                   chips=chips, params=curves.params, tags=all_tags,
                   run_name=run_name or f"import {curves.sources[0].name}",
                   tracking_uri=tracking_uri, spool_dir=spool_dir,
                   max_queue=max(2_000_000, len(curves.points) + 1000),
                   snapshot_environment=False) as run:
        for metric, step, value in curves.points:
            run.log_metrics(step, {metric: value})
        run.set_tags({"refrun.import.nonfinite_points": nonfinite})
    run_id = run.run_id
    if run_id is None:
        raise RefrunInputError(f"tracking store {run.tracking_uri} unreachable: the import "
                               f"is spooled as {run.local_id}; deliver it with `refrun sync`")
    return run_id
