"""TensorBoard event files: every scalar of every run in an event file or a log directory.

A *run* is what TensorBoard calls one: a directory holding ``*tfevents*`` files (the log
directory itself and each sub-directory, found recursively); the event files of one run
are read in name order (their names start with the writer's start time) and concatenated,
so a restarted writer's repeated steps reach the comparison as repeated steps.

Scalars, by tag: ``simple_value`` (``torch.utils.tensorboard.SummaryWriter``, TF1) and the
TF2 / ``new_style`` form, a rank-0 tensor of a tag whose first value carried the ``scalars``
plugin's metadata.  Every other summary (histograms, images, text, hparams, graphs) is
skipped and counted (param ``import.tensorboard.skipped_values``).  Each point keeps the
event's ``wall_time`` as its timestamp (curves artifact ``timestamp_ms`` and MLflow's
metric history).

Records are read with TensorBoard's own ``Event`` protobuf; the TFRecord framing (length,
masked CRC-32C of the length, payload, masked CRC-32C of the payload) is checked with
``google-crc32c`` because TensorBoard's pure-Python fallback reader (used when TensorFlow
is absent) computes CRCs byte by byte, ~100x too slow for a million scalars.

Hostile files: a record cut short at the end of a file (a writer killed mid-record) is
what TensorBoard itself tolerates; the complete records before it are imported and the
cut is counted (param ``import.tensorboard.truncated_files``) and printed as a warning.
A record whose CRC does not match, or a payload that is not an ``Event``, is an error
naming the file and byte offset.  A tag MLflow refuses as a metric name is an error
naming the file and tag (``--metric`` selects tags, ``--rename TAG=NAME`` renames them).
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pandas as pd
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from refrun.errors import RefrunInputError
from refrun.importers.curves import ImportedCurves, check_name, max_import_bytes, read_bytes
from refrun.importers.record import create_run

FORMAT = "tensorboard"
SCALARS_PLUGIN = "scalars"
_HEADER = struct.Struct("<QI")
# TFRecord framing: uint64 length, uint32 masked CRC-32C of the length, the payload, uint32
# masked CRC-32C of the payload; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 mod 2^32
# (tensorflow/core/lib/hash/crc32c.h, Mask).
_MASK_DELTA = 0xA282EAD8


@dataclass(frozen=True)
class TensorBoardRun:
    """One run found in a log directory: its name (path relative to the imported path,
    ``.`` for the path itself) and its event files in reading order."""

    name: str
    files: tuple[Path, ...]


# Largest wall time accepted (seconds since the epoch, year ~5138): far past any real
# event, far inside int64 milliseconds.
MAX_WALL_TIME_S = 1e11


def find_runs(path: str | os.PathLike[str]) -> list[TensorBoardRun]:
    """Runs under ``path`` (an event file: one run of that file), sorted by name."""
    p = Path(path)
    if not p.exists():
        raise RefrunInputError(f"{p}: no such file or directory")
    if not p.is_dir():  # an event file; a device, pipe or socket is refused by read_bytes
        return [TensorBoardRun(p.name, (p,))]
    by_dir: dict[Path, list[Path]] = {}
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames.sort()
        # TensorBoard's rule (io_wrapper.IsSummaryEventsFile): "tfevents" in the name.
        files = sorted(Path(dirpath) / f for f in filenames if "tfevents" in f)
        if files:
            by_dir[Path(dirpath)] = files
    if not by_dir:
        raise RefrunInputError(f"{p}: no TensorBoard event file (*tfevents*) in this "
                               "directory or below")
    return [TensorBoardRun(d.relative_to(p).as_posix(), tuple(f))
            for d, f in sorted(by_dir.items())]


@dataclass
class _Columns:
    """Points of one run, accumulated over its files in reading order."""

    tags: list[str]
    steps: list[int]
    values: list[float]
    wall: list[float]
    scalar_tensor_tags: set[str]
    skipped: int = 0
    truncated: int = 0


# TensorProto dtype (tensorboard/compat/proto/types.proto) -> (numpy dtype of
# tensor_content, the repeated field holding values otherwise).  TensorBoard's tensor_util
# does the same for every dtype but imports its TensorFlow stub (~0.5 s at start-up).
_TENSOR_DTYPES: dict[int, tuple[str, str]] = {
    1: ("<f4", "float_val"), 2: ("<f8", "double_val"), 3: ("<i4", "int_val"),
    9: ("<i8", "int64_val"), 19: ("<f2", "half_val"),
}


def _tensor_scalar(value: Any) -> float | None:
    """The number of a one-element float/int tensor (a TF2 scalar summary), else None."""
    t = value.tensor
    kind = _TENSOR_DTYPES.get(t.dtype)
    if kind is None or any(d.size != 1 for d in t.tensor_shape.dim):
        return None
    dtype, field_name = kind
    if t.tensor_content:
        arr = np.frombuffer(t.tensor_content, dtype=dtype)
        return float(arr[0]) if arr.size == 1 else None
    vals = getattr(t, field_name)
    if len(vals) != 1:
        return None
    if t.dtype == 19:  # half_val holds the float16 bit pattern in an int
        return float(np.array([vals[0]], dtype=np.uint16).view(np.float16)[0])
    return float(vals[0])


def _crc_error(p: Path, off: int, what: str) -> RefrunInputError:
    return RefrunInputError(f"{p}: byte {off}: record {what} fails its CRC check (not a "
                            "TFRecord event file, or corrupted)")


def _read_file(p: Path, cols: _Columns, limit: int) -> int:
    """Append the scalars of event file ``p`` (at most ``limit`` bytes, a regular file:
    :func:`refrun.importers.curves.read_bytes`) to ``cols``; returns its size.

    One flat loop over the records (framing, CRCs, ``Event`` decoding, scalar extraction)
    with every name bound locally: this is the import's hot path, ~3.5 us a scalar.  A
    record cut short at the end is counted in ``cols.truncated`` (TensorBoard's own
    reader stops there too)."""
    buf = read_bytes(p, limit)[1]
    crc = google_crc32c.value
    unpack = _HEADER.unpack_from
    from_bytes = int.from_bytes
    parse = event_pb2.Event.FromString
    tags, steps, values, wall = (cols.tags.append, cols.steps.append, cols.values.append,
                                 cols.wall.append)
    tensor_tags = cols.scalar_tensor_tags
    off, n = 0, len(buf)
    while off < n:
        if off + 12 > n:
            cols.truncated += 1
            break
        length, hcrc = unpack(buf, off)
        c = crc(buf[off:off + 8])
        if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != hcrc:
            raise _crc_error(p, off, "length")
        end = off + 12 + length
        if end + 4 > n:
            cols.truncated += 1
            break
        data = buf[off + 12:end]
        c = crc(data)
        if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != \
                from_bytes(buf[end:end + 4], "little"):
            raise _crc_error(p, off, "data")
        try:
            ev = parse(data)
        except (DecodeError, RecursionError):
            raise RefrunInputError(f"{p}: byte {off}: record is not a TensorBoard Event "
                                   "protobuf") from None
        off = end + 4
        for v in ev.summary.value:  # empty for file_version, graph_def, session_log ...
            kind = v.WhichOneof("value")
            if kind == "simple_value":
                number: float | None = v.simple_value
            elif kind == "tensor" and (v.tag in tensor_tags or (
                    v.HasField("metadata")
                    and v.metadata.plugin_data.plugin_name == SCALARS_PLUGIN)):
                tensor_tags.add(v.tag)  # later values of the tag omit the metadata
                number = _tensor_scalar(v)
            else:
                number = None
            if number is None:
                cols.skipped += 1
                continue
            tags(v.tag)
            steps(ev.step)
            values(number)
            wall(ev.wall_time)
    return n


def _check_names(p: TensorBoardRun, names: pd.Categorical,
                 rename: Mapping[str, str]) -> pd.Categorical:
    cats = [str(c) for c in names.categories]
    new = [rename.get(c, c) for c in cats]
    for old, name in zip(cats, new, strict=True):
        check_name(name, f"{p.files[0].parent}: tag {old!r} (select tags with --metric or "
                         "rename with --rename TAG=NAME)")
    if len(set(new)) != len(new):
        raise RefrunInputError(f"{p.files[0].parent}: --rename maps two tags to one name")
    return names.rename_categories(new)


def parse_run(run: TensorBoardRun, metrics: Sequence[str] | None = None,
              rename: Mapping[str, str] | None = None) -> ImportedCurves:
    """Validate and read one run's event files into curves (tags as metric names, after
    ``rename``; only ``metrics`` when given, by tag or new name)."""
    rename = dict(rename or {})
    cols = _Columns([], [], [], [], set())
    # $REFRUN_IMPORT_MAX_BYTES bounds a run's event files together (all are held at once).
    budget = limit = max_import_bytes()
    if len(run.files) > 1:
        total = sum(f.stat().st_size for f in run.files if f.is_file())
        if total > limit:
            raise RefrunInputError(f"{run.files[0].parent}: {len(run.files)} event files of "
                                   f"{total:,} bytes together, larger than the import limit "
                                   f"of {limit:,} bytes ($REFRUN_IMPORT_MAX_BYTES)")
    for f in run.files:
        budget -= _read_file(f, cols, budget)
    if cols.truncated:
        print(f"refrun import: warning: {run.name}: {cols.truncated} event file(s) end in a "
              "truncated record (a writer stopped mid-record); the complete records before "
              "it are imported", file=sys.stderr)
    where = run.files[0].parent if len(run.files) > 1 else run.files[0]
    if not cols.tags:
        raise RefrunInputError(f"{where}: no scalar in the event file(s)")
    names = pd.Categorical(cols.tags)
    steps = np.fromiter(cols.steps, dtype=np.int64, count=len(cols.steps))
    if metrics:
        known = {str(c) for c in names.categories}
        known |= {rename.get(c, c) for c in known}
        missing = [m for m in metrics if m not in known]
        if missing:
            raise RefrunInputError(f"{where}: no tag {missing[0]!r} (tags: "
                                   f"{', '.join(sorted(map(str, names.categories)))})")
        keep = np.isin(np.asarray(names.astype(str)),
                       [t for t in names.categories
                        if t in metrics or rename.get(t, t) in metrics])
        names = names[keep].remove_unused_categories()
        steps = steps[keep]
        vals = np.asarray(cols.values, dtype=np.float64)[keep]
        wall = np.asarray(cols.wall, dtype=np.float64)[keep]
    else:
        vals = np.asarray(cols.values, dtype=np.float64)
        wall = np.asarray(cols.wall, dtype=np.float64)
    names = _check_names(run, names, rename)
    params = {
        "import.tensorboard.run": run.name,
        "import.tensorboard.files": str(len(run.files)),
        "import.tensorboard.skipped_values": str(cols.skipped),
        "import.tensorboard.truncated_files": str(cols.truncated),
    }
    if rename:
        params["import.tensorboard.rename"] = ", ".join(f"{k}={v}"
                                                         for k, v in sorted(rename.items()))
    # A wall time no millisecond timestamp holds (NaN, inf, 1e300 s) would become garbage
    # in the cast below: refused, naming the point.
    bad = np.flatnonzero(~(np.abs(wall) <= MAX_WALL_TIME_S))
    if len(bad):
        i = int(bad[0])
        raise RefrunInputError(f"{where}: tag {str(names[i])!r} at step {int(steps[i])}: "
                               f"wall_time {wall[i]!r} s is out of range")
    timestamps = np.rint(wall * 1000.0).astype(np.int64)
    return ImportedCurves.from_columns(FORMAT, list(run.files), names, steps, vals, params,
                                       timestamp_ms=timestamps)


def parse_tensorboard(path: str | os.PathLike[str], metrics: Sequence[str] | None = None,
                      rename: Mapping[str, str] | None = None
                      ) -> list[tuple[str, ImportedCurves]]:
    """Every run under ``path`` (an event file or a log directory), validated before
    anything is written: ``[(run name, curves)]`` sorted by run name."""
    return [(r.name, parse_run(r, metrics, rename)) for r in find_runs(path)]


def import_tensorboard(path: str | os.PathLike[str], *, workload: str, role: str,
                       hardware: str, metrics: Sequence[str] | None = None,
                       rename: Mapping[str, str] | None = None, run_name: str | None = None,
                       **kwargs: Any) -> list[str]:
    """Import every run under ``path`` as a new refrun run each; returns their run ids in
    run-name order.  Every run is parsed before the first is written.  ``run_name`` names a
    single run; with several, each is named ``<run_name>/<run>`` (default: the run's
    directory).  ``kwargs`` as for :func:`refrun.importers.record.create_run`."""
    parsed = parse_tensorboard(path, metrics, rename)
    return [create_run(curves, workload=workload, role=role, hardware=hardware,
                       run_name=run_name_for(run_name, name, len(parsed)), **kwargs)
            for name, curves in parsed]


def run_name_for(base: str | None, run: str, n_runs: int) -> str | None:
    """The MLflow run name of TensorBoard run ``run`` out of ``n_runs``: ``base`` for a
    single run (None: refrun's default name), ``<base>/<run>`` (or ``<run>``) for several."""
    if n_runs == 1:
        return base
    return f"{base}/{run}" if base else run
