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
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.importers.curves import (
    ImportedCurves,
    check_name,
    load_json,
    parse_value,
    read_text,
    shown,
)
from refrun.importers.record import create_run
from refrun.keys import step_problem

FORMAT = "megatron"
RENAME = {"lm loss": schema.M_LOSS, "iteration-time": schema.M_STEP_TIME}


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: a key given twice is refused (``json`` would keep the last value
    silently, and a golden-values file with one step twice has no meaning to choose)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _RepeatedKey(k)
            seen.add(k)
    return d


def _load_json(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    p, text = read_text(path)
    try:
        return p, load_json(text, p, object_pairs_hook=_unique_object)
    except json.JSONDecodeError as exc:
        raise RefrunInputError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg}, column "
                               f"{exc.colno})") from None
    except _RepeatedKey as exc:
        raise RefrunInputError(f'{p}: key "{exc.key}" appears twice in one object (a '
                               "repeated step or metric; refused rather than keeping one "
                               "value silently)") from None


Series = tuple[np.ndarray, np.ndarray]  # (steps int64, values float64), sorted by step


def _read_values(p: Path, doc: Any) -> dict[str, Series]:
    """``{metric: (steps, values)}`` sorted by step, the whole file validated."""
    shape = '{metric: {"values": {"<step>": number | "nan"}}}'
    if not isinstance(doc, dict) or not doc:
        raise RefrunInputError(f"{p}: expected a JSON object {shape}, got "
                               f"{type(doc).__name__ if doc else 'an empty object'}")
    out: dict[str, Series] = {}
    for metric, entry in doc.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("values"), dict):
            raise RefrunInputError(f'{p}: key "{metric}": expected an object with "values" '
                                   f"(shape {shape})")
        values = entry["values"]
        if not values:
            raise RefrunInputError(f'{p}: key "{metric}".values: no values')
        steps, vals = _fast_series(values)
        if steps is None or vals is None:
            steps, vals = _checked_series(p, str(metric), values)
        order = np.argsort(steps, kind="stable")
        steps, vals = steps[order], vals[order]
        twice = np.flatnonzero(np.diff(steps) == 0)
        if len(twice):  # "1" and "01" are two JSON keys but one step
            raise RefrunInputError(f'{p}: key "{metric}".values: step {int(steps[twice[0]])} '
                                   f"given {int(np.count_nonzero(steps == steps[twice[0]]))} "
                                   "times (refused rather than keeping one value silently)")
        out[str(metric)] = (steps, vals)
    return out


def _fast_series(values: dict[str, Any]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Vectorised reading of a valid ``values`` object (a 350k-step metric in ~0.1 s);
    ``(None, None)`` when anything is off, so :func:`_checked_series` names the entry."""
    raw = values.values()
    # bool is an int to float(): only numbers and strings pass (the checked path says why).
    if not set(map(type, raw)) <= {float, int, str}:
        return None, None
    n = len(values)
    try:
        steps = np.fromiter(map(int, values), dtype=np.int64, count=n)
        vals = np.fromiter(map(float, raw), dtype=np.float64, count=n)
    except (ValueError, OverflowError):
        return None, None
    if np.isinf(vals).any():  # "inf", or digits past a float's range: the checked path
        return None, None
    return steps, vals


def _checked_series(p: Path, metric: str, values: dict[str, Any]) -> Series:
    """Entry-by-entry reading that raises naming the first bad key."""
    steps: list[int] = []
    vals: list[float] = []
    for k, v in values.items():
        where = f'{p}: key "{metric}".values."{shown(k, quote=False)}"'
        try:
            step = int(k)
        except ValueError:
            raise RefrunInputError(f"{where}: step is not an integer") from None
        problem = step_problem(step)
        if problem is not None:
            raise RefrunInputError(f"{where}: {problem}")
        value = None if isinstance(v, bool) or not isinstance(v, int | float | str) \
            else parse_value(v)
        if value is None:
            raise RefrunInputError(f'{where}: {shown(v)} is not a number (or is out of '
                                   'the range of a float) nor "nan"')
        steps.append(step)
        vals.append(value)
    return np.array(steps, dtype=np.int64), np.array(vals, dtype=np.float64)


def _select(values: dict[str, Series], p: Path, metrics: Sequence[str] | None,
            rename: bool) -> dict[str, Series]:
    names = {m: (RENAME.get(m, m) if rename else m) for m in values}
    if metrics:
        wanted = set(metrics)
        missing = [m for m in metrics if m not in names and m not in names.values()]
        if missing:
            raise RefrunInputError(f'{p}: no metric "{missing[0]}" (metrics: '
                                   f"{', '.join(values)})")
        values = {m: v for m, v in values.items() if m in wanted or names[m] in wanted}
    for m in values:
        check_name(names[m], f'{p}: key "{m}"')
    return {names[m]: v for m, v in values.items()}


def _by_step(values: dict[str, Series]) -> tuple[pd.Categorical, np.ndarray, np.ndarray]:
    """``(metrics, steps, values)`` in training order: step by step, every metric of a
    step together (metrics in file order within a step)."""
    names = list(values)
    codes = np.concatenate([np.full(len(s), i, dtype=np.int32)
                            for i, (s, _) in enumerate(values.values())])
    steps = np.concatenate([s for s, _ in values.values()])
    vals = np.concatenate([v for _, v in values.values()])
    order = np.argsort(steps, kind="stable")
    return pd.Categorical.from_codes(codes[order], categories=names), steps[order], vals[order]


def parse_megatron(path: str | os.PathLike[str], resumed: str | os.PathLike[str] | None = None,
                   metrics: Sequence[str] | None = None, rename: bool = True
                   ) -> ImportedCurves:
    """Validate and read a golden-values file (and optionally its resumed ``_2nd`` half).

    Errors name the file and the JSON key (``key "lm loss".values."12"``).
    """
    p, doc = _load_json(path)
    first = _select(_read_values(p, doc), p, metrics, rename)
    parts = [_by_step(first)]
    sources = [p]
    params = {"import.megatron.rename": json.dumps(RENAME if rename else {})}
    if resumed is not None:
        p2, doc2 = _load_json(resumed)
        second = _select(_read_values(p2, doc2), p2, metrics, rename)
        finite_steps = [int(s[np.isfinite(v)].min()) for s, v in second.values()
                        if np.isfinite(v).any()]
        if not finite_steps:
            raise RefrunInputError(f"{p2}: no finite value: cannot find the resume point")
        resume = min(finite_steps)
        second = {m: (s[s >= resume], v[s >= resume]) for m, (s, v) in second.items()}
        parts.append(_by_step(second))
        sources.append(p2)
        params["import.megatron.resume_step"] = str(resume)
    names = pd.api.types.union_categoricals([n for n, _, _ in parts])
    steps = np.concatenate([st for _, st, _ in parts])
    vals = np.concatenate([v for _, _, v in parts])
    return ImportedCurves.from_columns(FORMAT, sources, names, steps, vals, params)


def import_megatron(path: str | os.PathLike[str], *, workload: str, role: str,
                    hardware: str, resumed: str | os.PathLike[str] | None = None,
                    metrics: Sequence[str] | None = None, rename: bool = True,
                    **kwargs: Any) -> str:
    """Import a golden-values file (plus optional resumed half) as a new run; returns its
    run id (``kwargs`` as for :func:`refrun.importers.record.create_run`)."""
    curves = parse_megatron(path, resumed, metrics, rename)
    return create_run(curves, workload=workload, role=role, hardware=hardware, **kwargs)
