"""Issue 55, round two at the importers: every importer, fed a hostile corpus (deep nesting,
numbers out of a float's range, special files, a byte-order mark, duplicate keys,
truncation, 100,000 columns), answers each file in one line with exit 2 naming the file,
or imports it correctly.  The corpus is generated here (nothing big is committed); real
`refrun import` invocations into a real sqlite store.  Speed is shown by
benchmarks/bench_import_hostile.py, not asserted here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from refrun import schema
from refrun.cli import main

WIDE = 100_000
BOM = "\ufeff"


# --- writers of each format ------------------------------------------------------------
def _csv(rows: int = 3) -> str:
    return "step,loss,lr\n" + "".join(f"{s},{1 / (s + 1)},0.1\n" for s in range(rows))


def _titan(rows: int = 3) -> str:
    return "".join(f"{s} {1 / (s + 1)}\n" for s in range(rows))


def _megatron(rows: int = 3) -> str:
    values = ", ".join(f'"{s}": {1 / (s + 1)}' for s in range(rows))
    return '{"lm loss": {"start_step": 0, "end_step": 2, "step_interval": 1, "values": {' \
        + values + "}}}"


def _mllog(key: str, value: str, meta: str = "{}", t: int = 1000) -> str:
    return (f':::MLLOG {{"namespace": "", "time_ms": {t}, "event_type": "POINT_IN_TIME", '
            f'"key": "{key}", "value": {value}, "metadata": {meta}}}\n')


def _mlperf(evals: int = 3) -> str:
    head = _mllog("global_batch_size", "32") + _mllog("run_start", "null")
    return head + "".join(_mllog("eval_accuracy", str(0.5 + s / 10),
                                 f'{{"samples_count": {32 * (s + 1)}}}', 2000 + s)
                          for s in range(evals))


def _tf_record(data: bytes) -> bytes:
    import google_crc32c

    def masked(b: bytes) -> int:
        c = google_crc32c.value(b)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked(header)) + data + struct.pack("<I", masked(data))


def _tb_events(values_per_event: list[dict[str, float]], wall: float = 1.7e9) -> bytes:
    from tensorboard.compat.proto import event_pb2

    out = [_tf_record(event_pb2.Event(wall_time=wall, file_version="brain.Event:2")
                      .SerializeToString())]
    for step, values in enumerate(values_per_event):
        ev = event_pb2.Event(wall_time=wall + step, step=step)
        for tag, v in values.items():
            ev.summary.value.add(tag=tag, simple_value=v)
        out.append(_tf_record(ev.SerializeToString()))
    return b"".join(out)


def _tb(rows: int = 3) -> bytes:
    return _tb_events([{"loss": 1 / (s + 1)} for s in range(rows)])


# --- the corpus -------------------------------------------------------------------------
# (format, case) -> (file contents or a special-file maker, what must happen):
#   "error": exit 2, one stderr line naming the file;  an int: exit 0 and a run holding
#   that many points.
Maker = Callable[[Path], Path]


def _special(kind: str) -> Maker:
    def make(tmp: Path) -> Path:
        if kind == "zero":
            return Path("/dev/zero")
        p = tmp / "events.out.tfevents.fifo"
        os.mkfifo(p)
        return p
    return make


DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "9" * 400
HUGE_INT = "1" * 100_000

CORPUS: dict[tuple[str, str], tuple[str | bytes | Maker, str | int]] = {}
for fmt in ("csv", "torchtitan", "megatron", "mlperf", "tensorboard"):
    CORPUS[fmt, "dev-zero"] = (_special("zero"), "error")
    CORPUS[fmt, "fifo"] = (_special("fifo"), "error")
CORPUS.update({
    # deep nesting
    ("megatron", "deep"): ('{"lm loss": {"values": {"1": ' + DEEP + "}}}", "error"),
    ("mlperf", "deep"): (_mlperf() + _mllog("eval_accuracy", DEEP, '{"samples_count": 1}'),
                         "error"),
    ("csv", "deep"): ("step,loss\n0," + "[" * 100_000 + "\n", "error"),
    ("torchtitan", "deep"): ("0 " + "[" * 100_000 + "\n", "error"),
    # protobuf groups nested 100,000 deep inside an Event record
    ("tensorboard", "deep"): (_tf_record(b"\x7b" * 100_000), "error"),
    # numbers out of a float's range
    ("megatron", "range-float"): ('{"lm loss": {"values": {"1": 1e999}}}', "error"),
    ("megatron", "range-digits"): ('{"lm loss": {"values": {"1": ' + HUGE_INT + "}}}",
                                   "error"),
    ("megatron", "range-string"): ('{"lm loss": {"values": {"1": "' + HUGE_INT + '"}}}',
                                   "error"),
    ("megatron", "range-step"): ('{"lm loss": {"values": {"' + BIG_INT + '": 1.0}}}',
                                 "error"),
    ("mlperf", "range-samples"): (_mlperf() + _mllog("eval_accuracy", "0.9",
                                                     f'{{"samples_count": {BIG_INT}}}'),
                                  "error"),
    ("mlperf", "range-value"): (_mlperf() + _mllog("eval_accuracy", HUGE_INT,
                                                   '{"samples_count": 320}'), "error"),
    ("csv", "range"): ("step,loss\n0,1e999\n", "error"),
    ("csv", "range-step"): (f"step,loss\n{BIG_INT},1.0\n", "error"),
    ("torchtitan", "range"): ("0 " + HUGE_INT + "\n", "error"),
    ("tensorboard", "range-wall"): (_tb_events([{"loss": 1.0}], wall=1e300), "error"),
    # a byte-order mark in front: text formats read it as what it is, binary ones refuse
    ("csv", "bom"): (BOM + _csv(), 6),
    ("torchtitan", "bom"): (BOM + _titan(), 3),
    ("megatron", "bom"): (BOM + _megatron(), 3),
    ("mlperf", "bom"): (BOM + _mlperf(), 6),  # 3 evaluations + 3 progress/samples
    ("tensorboard", "bom"): (BOM.encode() + _tb(), "error"),
    # duplicate keys
    ("csv", "dup"): ("step,loss,loss\n0,1,2\n", "error"),
    ("megatron", "dup"): ('{"lm loss": {"values": {"1": 1.0, "1": 2.0}}}', "error"),
    ("mlperf", "dup"): (_mlperf() + _mllog("eval_accuracy", "0.9",
                                           '{"samples_count": 320, "samples_count": 640}'),
                        "error"),
    ("torchtitan", "dup"): ("0 1.0\n0 2.0\n", 2),  # a repeated step: both kept, as logged
    ("tensorboard", "dup"): (_tb_events([{"loss": 1.0}, {"loss": 2.0}, {"loss": 2.0}]), 3),
    # truncation
    ("csv", "cut"): (_csv()[:-12], "error"),  # the last row cut inside its second cell
    ("torchtitan", "cut"): (_titan() + "3", "error"),
    ("megatron", "cut"): (_megatron()[:-3], "error"),
    ("mlperf", "cut"): (_mlperf() + _mlperf(1).splitlines()[-1][:-9], 6),  # last line cut
    ("tensorboard", "cut"): (_tb()[:-5], 2),  # the cut record is counted, not imported
    # 100,000 columns (or keys, or tags)
    ("csv", "wide"): ("step," + ",".join(f"m{i}" for i in range(WIDE)) + "\n0,"
                      + ",".join("0.5" for _ in range(WIDE)) + "\n", WIDE),
    ("torchtitan", "wide"): ("0 " + " ".join("0.5" for _ in range(WIDE)) + "\n", "error"),
    ("megatron", "wide"): ('{"lm loss": {"values": {'
                           + ", ".join(f'"{s}": 0.5' for s in range(WIDE)) + "}}}", WIDE),
    ("mlperf", "wide"): (_mlperf() + _mllog("eval_accuracy", "0.9", "{"
                         + ", ".join(f'"k{i}": {i}' for i in range(WIDE))
                         + ', "samples_count": 320}'), 8),
    ("tensorboard", "wide"): (_tb_events([{f"m{i}": 0.5 for i in range(WIDE)}]), WIDE),
})


def _run_points(uri: str) -> list[int]:
    """Points in the curves artifact of each run in the store.  Read from the store's own
    tables: MLflow's search_runs and get_run load every metric's latest value, ~10 s for
    a run of 100,000 metrics (the import itself takes a few seconds)."""
    import sqlite3
    from urllib.parse import urlparse

    import pandas as pd

    db = uri.removeprefix("sqlite:///")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        locations = [row[0] for row in con.execute("SELECT artifact_uri FROM runs")]
    return [len(pd.read_parquet(Path(urlparse(loc).path if "://" in loc else loc)
                                / schema.ARTIFACT_CURVES)) for loc in locations]


@pytest.mark.parametrize(("fmt", "case"), sorted(CORPUS))
def test_every_importer_answers_every_hostile_file(store, tmp_path: Path, capsys,
                                                   fmt: str, case: str) -> None:
    content, expected = CORPUS[fmt, case]
    name = "events.out.tfevents.1.host" if fmt == "tensorboard" else f"{case}.in"
    if callable(content):
        path = content(tmp_path)
    else:
        path = tmp_path / name
        data = content.encode("utf-8") if isinstance(content, str) else content
        path.write_bytes(data)
    rc = main(["import", fmt, str(path), "--workload", "w", "--role", "reference",
               "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
    out = capsys.readouterr()
    err = out.err.strip()
    if expected == "error":
        assert rc == 2, (rc, err[:500])
        assert len(err.splitlines()) == 1 and str(path) in err, err[:500]
        assert len(err) < 600, err[:600]  # a 100,000-character value is not echoed
        assert _run_points(store.tracking_uri) == []  # nothing recorded
    else:
        assert rc == 0, err[:500]
        assert _run_points(store.tracking_uri) == [expected]


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_tensorboard_honours_the_import_size_limit(store, tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   layout: str) -> None:
    """$REFRUN_IMPORT_MAX_BYTES bounds the TensorBoard importer like every other: one file
    over it, or a run whose files together are over it, is refused before it is held."""
    events = _tb(50)
    run_dir = tmp_path / "logs" / "run"
    run_dir.mkdir(parents=True)
    if layout == "file":
        path = run_dir / "events.out.tfevents.1.host"
        path.write_bytes(events)
    else:  # two files each under the limit, together over it
        (run_dir / "events.out.tfevents.1.host").write_bytes(events)
        (run_dir / "events.out.tfevents.2.host").write_bytes(events)
        path = tmp_path / "logs"
    limit = len(events) + 10 if layout == "directory" else len(events) - 1
    monkeypatch.setenv("REFRUN_IMPORT_MAX_BYTES", str(limit))
    rc = main(["import", "tensorboard", str(path), "--workload", "w", "--role", "reference",
               "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "import limit" in err and len(err.splitlines()) == 1, err
    if layout == "directory":
        assert "2 event files of" in err and "bytes together" in err, err
    assert _run_points(store.tracking_uri) == []
    monkeypatch.setenv("REFRUN_IMPORT_MAX_BYTES", str(2 * len(events) + 10))
    rc = main(["import", "tensorboard", str(path), "--workload", "w", "--role", "reference",
               "--hardware", "cpu", "--tracking-uri", store.tracking_uri])
    assert rc == 0, capsys.readouterr().err
    assert _run_points(store.tracking_uri) == [50 if layout == "file" else 100]
