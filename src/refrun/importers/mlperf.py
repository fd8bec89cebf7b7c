"""MLPerf Training result logs: the ``:::MLLOG`` lines of a run's log.

A result log's line is what mlperf-logging's logger writes (``mllog``: its
``LOG_TEMPLATE``, ``:::MLLOG {json}``): the JSON after the token is read with the standard
library, text before the token on a line (e.g. a rank prefix) is dropped as the compliance
checker does, and the file's line numbers are kept for errors.  Only mlperf-logging's
public logger package (``mlperf_logging.mllog``: the line template and the key names of
``mllog.constants``) is used, in every release pyproject allows (>= 4.1.1, the oldest on
the index; ``scripts/check_mlperf_logging.py`` imports logs written by a given release).
The compliance checker's parsers are versioned modules (``mlp_parser.ruleset_610``
exists from a later 4.1 release on) and are not imported.  What becomes of the keys:

* ``eval_accuracy`` -> metric ``eval/accuracy``; any other ``eval_<x>`` key with a number
  and a progress field -> ``eval/<x>``; ``train_loss`` -> ``loss``.  A point's progress is
  ``metadata.samples_count`` when logged, else ``metadata.epoch_num``;
* the step of a point: ``samples / global_batch_size`` (rounded) when both are known,
  otherwise the progress value itself (samples, or epochs);
* metric ``progress/samples`` at each of those steps: the samples seen (``samples_count``;
  or ``epoch_num x train_samples`` when only epochs are logged and ``train_samples`` is),
  so ``--axis samples`` aligns an MLPerf reference with a run of another global batch;
* ``global_batch_size`` -> the run's ``refrun.global_batch`` tag;
* ``run_start`` / ``run_stop`` -> params ``mlperf.run_start_ms``, ``mlperf.run_stop_ms``,
  ``mlperf.run_status`` (``run_stop``'s ``metadata.status``; ``missing`` when the log has no
  ``run_stop``) and ``mlperf.time_to_train_s``, the benchmark's score;
* every other key logged once with a scalar value (``submission_*``, hyperparameters such
  as ``opt_base_learning_rate``, ``seed``) -> param ``mlperf.<key>``; keys logged several
  times without being a metric (``epoch_start``, ``block_stop`` ...) are counted in param
  ``import.mlperf.other_lines``.

Every point keeps its line's ``time_ms`` as its timestamp.  A ``:::MLLOG`` line that is not
valid JSON (or lacks ``key``/``time_ms``) is an error naming the file and line, except the
file's last line when it has no newline: a log cut off mid-line (a killed job) keeps its
complete lines and the cut is counted (param ``import.mlperf.truncated_lines``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from mlperf_logging.mllog import constants as mlc
from mlperf_logging.mllog.mllog import LOG_TEMPLATE

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.importers.curves import ImportedCurves, check_name, load_json, read_text, shown
from refrun.importers.record import create_run

FORMAT = "mlperf"
TOKEN = LOG_TEMPLATE.split("{", 1)[0]  # ":::MLLOG ", as the logger writes it
PARAM_PREFIX = "mlperf."
# MLPerf keys with a fixed refrun metric name; other eval_<x> keys become eval/<x>.
METRICS = {mlc.EVAL_ACCURACY: schema.EVAL_PREFIX + "accuracy", "train_loss": schema.M_LOSS}
# Keys that describe the run's structure, never a measurement.
NOT_METRICS = {mlc.EVAL_START, mlc.EVAL_STOP, mlc.EVAL_SAMPLES}


def _number(v: Any) -> float | None:
    """A JSON number as a float; None for anything else (or a number no float holds,
    which :func:`refrun.importers.curves.load_json` has refused already)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _metric_name(key: str) -> str | None:
    if key in METRICS:
        return METRICS[key]
    if key.startswith("eval_") and key not in NOT_METRICS:
        return schema.EVAL_PREFIX + key[len("eval_"):]
    return None


def _lines(p: Path, text: str) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """``[(line number, parsed line)]`` of the ``:::MLLOG`` lines, and 1 when the file's last
    line is an unterminated, unparsable one (a cut-off log), else 0."""
    out = []
    lines = text.split("\n")
    for lineno, raw in enumerate(lines, start=1):
        i = raw.find(TOKEN)
        if i < 0:
            continue
        line = raw[i:].strip()
        try:
            # Nesting bounded and numbers out of a float's range refused, naming the line.
            doc = load_json(line[len(TOKEN):], p, lineno, object_pairs_hook=_unique_keys)
            if not isinstance(doc, dict) or "key" not in doc or "time_ms" not in doc:
                raise ValueError("expected an object with key, value, time_ms")
            if not math.isfinite(float(doc["time_ms"])):
                raise ValueError(f"time_ms {shown(doc['time_ms'])} is not a finite number")
        except RefrunInputError:  # too deep, or a number out of range: named already
            raise
        except (ValueError, TypeError) as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                return out, 1
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise RefrunInputError(f"{p}:{lineno}: not a valid :::MLLOG line ({msg})"
                                   ) from None
        out.append((lineno, doc))
    return out, 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: a key given twice in one object is refused (``json`` would keep
    the last silently: which ``value`` or ``samples_count`` the line meant is unknown)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {shown(k)} appears twice in one object")
            seen.add(k)
    return d


def _param_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def parse_mlperf(path: str | os.PathLike[str]) -> ImportedCurves:
    """Validate and read an MLPerf Training result log (see the module docstring)."""
    p, text = read_text(path)
    lines, truncated = _lines(p, text)
    if not lines:
        raise RefrunInputError(f"{p}: no :::MLLOG line (not an MLPerf result log)")
    if truncated:
        print(f"refrun import: warning: {p}: the last line is cut off (a log stopped "
              "mid-line); the complete lines before it are imported", file=sys.stderr)
    counts = Counter(str(d["key"]) for _, d in lines)
    params: dict[str, str] = {}
    points: list[tuple[int, str, float, float | None, float | None, int]] = []
    run_start = run_stop = None
    status = "missing"
    other = 0
    for lineno, d in lines:
        key, value = str(d["key"]), d.get("value")
        meta = d.get("metadata") if isinstance(d.get("metadata"), dict) else {}
        time_ms = float(d["time_ms"])
        name = _metric_name(key)
        if key == mlc.RUN_START:
            run_start = time_ms
        elif key == mlc.RUN_STOP:
            run_stop = time_ms
            status = str(meta.get(mlc.STATUS, "unknown"))
        elif key == mlc.EVAL_ACCURACY and _number(value) is None:
            raise RefrunInputError(f"{p}:{lineno}: eval_accuracy {shown(value)} is not a number")
        elif name is not None and _number(value) is not None and (
                _number(meta.get(mlc.SAMPLES_COUNT)) is not None
                or _number(meta.get(mlc.EPOCH_NUM)) is not None):
            check_name(name, f"{p}:{lineno}: key {key!r}")
            points.append((lineno, name, float(value),  # type: ignore[arg-type]
                           _number(meta.get(mlc.SAMPLES_COUNT)),
                           _number(meta.get(mlc.EPOCH_NUM)), int(time_ms)))
        elif counts[key] == 1 and (value is None or isinstance(value, str | int | float)):
            params[PARAM_PREFIX + key] = _param_value(value)
        else:
            other += 1
    if not points:
        raise RefrunInputError(f"{p}: no evaluation point (eval_accuracy with epoch_num or "
                               "samples_count in its metadata)")
    gbs = _number(_json_value(params.get(PARAM_PREFIX + mlc.GLOBAL_BATCH_SIZE)))
    train_samples = _number(_json_value(params.get(PARAM_PREFIX + mlc.TRAIN_SAMPLES)))
    names: list[str] = []
    steps: list[int] = []
    values: list[float] = []
    stamps: list[int] = []
    progress: dict[int, tuple[float, int]] = {}
    unit = "samples_count"
    for _line, name, value, samples, epoch, t in points:
        if samples is None and epoch is not None and train_samples is not None:
            samples = epoch * train_samples
            unit = "epoch_num x train_samples"
        elif samples is None:
            unit = "epoch_num"
        x = samples if samples is not None else epoch
        assert x is not None
        step = round(x / gbs) if (samples is not None and gbs) else round(x)
        names.append(name)
        steps.append(step)
        values.append(value)
        stamps.append(t)
        if samples is not None:
            progress.setdefault(step, (samples, t))
    for step, (samples, t) in sorted(progress.items()):
        names.append(schema.M_PROGRESS_SAMPLES)
        steps.append(step)
        values.append(samples)
        stamps.append(t)
    params.update({
        "mlperf.run_status": status,
        "import.mlperf.step": ("samples_count / global_batch_size"
                               if gbs and unit != "epoch_num" else unit),
        "import.mlperf.other_lines": str(other),
        "import.mlperf.truncated_lines": str(truncated),
    })
    if run_start is not None:
        params["mlperf.run_start_ms"] = str(int(run_start))
    if run_stop is not None:
        params["mlperf.run_stop_ms"] = str(int(run_stop))
    if run_start is not None and run_stop is not None:
        params["mlperf.time_to_train_s"] = f"{(run_stop - run_start) / 1000.0:.3f}"
    order = np.argsort(np.asarray(steps, dtype=np.int64), kind="stable")
    return ImportedCurves.from_columns(
        FORMAT, [p], np.asarray(names, dtype=object)[order],
        np.asarray(steps, dtype=np.int64)[order], np.asarray(values)[order], params,
        timestamp_ms=np.asarray(stamps, dtype=np.int64)[order])


def _json_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def global_batch(curves: ImportedCurves) -> int | None:
    """The log's ``global_batch_size`` (a positive integer), else None."""
    v = _number(_json_value(curves.params.get(PARAM_PREFIX + mlc.GLOBAL_BATCH_SIZE)))
    return int(v) if v is not None and v > 0 and v == int(v) else None


def import_mlperf(path: str | os.PathLike[str], *, workload: str, role: str, hardware: str,
                  **kwargs: Any) -> str:
    """Import an MLPerf Training result log as a new run; returns its run id (``kwargs``
    as for :func:`refrun.importers.record.create_run`).  The log's ``global_batch_size``
    becomes the run's ``refrun.global_batch`` unless ``global_batch`` is given."""
    curves = parse_mlperf(path)
    kwargs.setdefault("global_batch", global_batch(curves))
    return create_run(curves, workload=workload, role=role, hardware=hardware, **kwargs)
