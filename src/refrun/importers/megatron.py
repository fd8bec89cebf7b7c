"""Megatron-LM golden-values JSON (tests/functional_tests/test_cases/*/golden_values_*.json).

Shape: ``{metric: {"start_step", "end_step", "step_interval", "values": {"<step>": value}}}``
where a value is a number or the string ``"nan"``.  ``"nan"`` is kept as a NaN point
(counted and excluded by the comparison, never turned into a number).

Names: ``lm loss`` is recorded as ``loss`` and ``iteration-time`` (seconds) as
``perf/step_time_s`` so that imported runs compare with recorded ones; other names are kept
(``rename=False`` keeps all original names).  The mapping is stored in the run's params.

Resumed runs: ``*_2nd.json`` holds the second half of a run resumed from a checkpoint, with
``"nan"`` for the steps before the resume point.  Passed as ``resumed=`` it is appended to
the first file as one run: its steps before the resume point (the first step with a finite
value in any metric) are placeholders and are dropped; its remaining points are logged
after the first file's, so the resumed steps are *repeated steps* that the comparison
reports (last value wins by default; ``keep="first"`` keeps the first run's values).
Imported on its own, a ``_2nd`` file is an ordinary run whose leading NaNs are counted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.importers.curves import ImportedCurves, create_run, parse_value, read_text

FORMAT = "megatron"
RENAME = {"lm loss": schema.M_LOSS, "iteration-time": schema.M_STEP_TIME}


def _load_json(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    p, text = read_text(path)
    try:
        return p, json.loads(text)
    except json.JSONDecodeError as exc:
        raise RefrunInputError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg}, column "
                               f"{exc.colno})") from None


def _read_values(p: Path, doc: Any) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` sorted by step, the whole file validated."""
    shape = '{metric: {"values": {"<step>": number | "nan"}}}'
    if not isinstance(doc, dict) or not doc:
        raise RefrunInputError(f"{p}: expected a JSON object {shape}, got "
                               f"{type(doc).__name__ if doc else 'an empty object'}")
    out: dict[str, list[tuple[int, float]]] = {}
    for metric, entry in doc.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("values"), dict):
            raise RefrunInputError(f'{p}: key "{metric}": expected an object with "values" '
                                   f"(shape {shape})")
        values = entry["values"]
        if not values:
            raise RefrunInputError(f'{p}: key "{metric}".values: no values')
        pts = []
        for k, v in values.items():
            try:
                step = int(k)
            except ValueError:
                raise RefrunInputError(f'{p}: key "{metric}".values."{k}": step is not an '
                                       "integer") from None
            if isinstance(v, bool) or not isinstance(v, int | float | str):
                value = None
            else:
                value = parse_value(v) if isinstance(v, str) else float(v)
            if value is None:
                raise RefrunInputError(f'{p}: key "{metric}".values."{k}": {v!r} is not a '
                                       'number or "nan"')
            pts.append((step, value))
        out[str(metric)] = sorted(pts)
    return out


def _select(values: dict[str, list[tuple[int, float]]], p: Path,
            metrics: Sequence[str] | None, rename: bool) -> dict[str, list[tuple[int, float]]]:
    names = {m: (RENAME.get(m, m) if rename else m) for m in values}
    if metrics:
        wanted = set(metrics)
        missing = [m for m in metrics if m not in names and m not in names.values()]
        if missing:
            raise RefrunInputError(f'{p}: no metric "{missing[0]}" (metrics: '
                                   f"{', '.join(values)})")
        values = {m: v for m, v in values.items() if m in wanted or names[m] in wanted}
    return {names[m]: v for m, v in values.items()}


def _by_step(values: dict[str, list[tuple[int, float]]]) -> list[tuple[str, int, float]]:
    """Points in training order: step by step, every metric of a step together."""
    pts = [(s, m, v) for m, series in values.items() for s, v in series]
    pts.sort(key=lambda t: t[0])
    return [(m, s, v) for s, m, v in pts]


def parse_megatron(path: str | os.PathLike[str], resumed: str | os.PathLike[str] | None = None,
                   metrics: Sequence[str] | None = None, rename: bool = True
                   ) -> ImportedCurves:
    """Validate and read a golden-values file (and optionally its resumed ``_2nd`` half).

    Errors name the file and the JSON key (``key "lm loss".values."12"``).
    """
    p, doc = _load_json(path)
    first = _select(_read_values(p, doc), p, metrics, rename)
    points = _by_step(first)
    sources = [p]
    params = {"import.megatron.rename": json.dumps(RENAME if rename else {})}
    if resumed is not None:
        p2, doc2 = _load_json(resumed)
        second = _select(_read_values(p2, doc2), p2, metrics, rename)
        finite_steps = [s for series in second.values() for s, v in series if math.isfinite(v)]
        if not finite_steps:
            raise RefrunInputError(f"{p2}: no finite value: cannot find the resume point")
        resume = min(finite_steps)
        second = {m: [(s, v) for s, v in series if s >= resume]
                  for m, series in second.items()}
        points += _by_step(second)
        sources.append(p2)
        params["import.megatron.resume_step"] = str(resume)
    return ImportedCurves(FORMAT, sources, points, params)


def import_megatron(path: str | os.PathLike[str], *, workload: str, role: str,
                    hardware: str, resumed: str | os.PathLike[str] | None = None,
                    metrics: Sequence[str] | None = None, rename: bool = True,
                    **kwargs: Any) -> str:
    """Import a golden-values file (plus optional resumed half) as a new run; returns its
    run id (``kwargs`` as for :func:`refrun.importers.curves.create_run`)."""
    curves = parse_megatron(path, resumed, metrics, rename)
    return create_run(curves, workload=workload, role=role, hardware=hardware, **kwargs)
