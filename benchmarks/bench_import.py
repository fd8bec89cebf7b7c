"""Import and CLI speed at the size of real references (issue 14, "Done when").

Measures, each with the real ``refrun`` command in its own process against a fresh sqlite
store in a temporary directory:

* ``refrun import megatron`` of a valid golden-values file of 1.75M points (5 metrics x
  350,000 steps, ~50 MB) until the command returns with a FINISHED run whose curves
  artifact holds every point (checked), beside the time pandas/pyarrow take to write the
  same long frame to Parquet (the floor: what any importer must at least do);
* the same for 100,000 points;
* ``refrun import tensorboard`` of an event file of 1M scalars (4 tags x 250,000 steps,
  ``simple_value`` as ``torch.utils.tensorboard.SummaryWriter`` writes them), checked
  complete; the file is framed here with the writer's format (SummaryWriter itself needs
  ~2.5 min for 1M scalars on this machine), and TensorBoard's own ``EventFileLoader``
  reads its first records back identically before it is timed;
* ``refrun compare`` of the two 1.75M-point runs with recording and with ``--no-record``;
* ``refrun --version`` and ``refrun --help``.

Run: ``.venv/bin/python benchmarks/bench_import.py [--steps 350000]``.
Targets: 1.75M points <= 10 s, 100k points <= 2 s, 1M TensorBoard scalars <= 10 s,
compare with recording within 1.5x of
``--no-record``, ``--version``/``--help`` <= 0.5 s.  Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ("lm loss", "iteration-time", "num-zeros", "mem-allocated-bytes", "grad-norm")


def golden_values(path: Path, steps: int, seed: int) -> int:
    """Write a valid Megatron golden-values file of ``5 x steps`` points; returns that."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1)
    doc = {}
    for i, name in enumerate(METRICS):
        v = np.exp(-s / steps * 3) * 10 + rng.normal(0, 1e-3, steps) + i
        vals: list[float | str] = np.round(v, 6).tolist()
        vals[steps // 2] = "nan"  # golden files carry "nan" strings
        doc[name] = {"start_step": 1, "end_step": steps, "step_interval": 1,
                     "values": dict(zip(map(str, s.tolist()), vals, strict=True))}
    path.write_text(json.dumps(doc))
    return steps * len(METRICS)


TB_TAGS = ("train/loss", "lr", "grad_norm", "eval/acc")


def event_file(path: Path, scalars: int) -> int:
    """An event file of ``scalars`` scalars (``simple_value``, 4 tags per step) in the
    TFRecord framing TensorBoard writes; returns the number of scalars."""
    import struct

    import google_crc32c
    from tensorboard.compat.proto import event_pb2, summary_pb2

    def masked(data: bytes) -> int:
        c = google_crc32c.value(data)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def record(ev: event_pb2.Event) -> bytes:
        data = ev.SerializeToString()
        head = struct.pack("<Q", len(data))
        return head + struct.pack("<I", masked(head)) + data + struct.pack("<I", masked(data))

    steps = scalars // len(TB_TAGS)
    rng = np.random.default_rng(4)
    out = [record(event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2"))]
    for s, noise in enumerate(rng.normal(0, 1e-3, steps).tolist()):
        for i, tag in enumerate(TB_TAGS):
            out.append(record(event_pb2.Event(
                wall_time=1.7e9 + s * 0.01, step=s,
                summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(
                    tag=tag, simple_value=10.0 / (s + 1) + noise + i)]))))
    path.write_bytes(b"".join(out))
    return steps * len(TB_TAGS)


def check_event_file(path: Path, records: int = 1000) -> None:
    """TensorBoard's own loader reads the file's first ``records`` events as written."""
    import itertools

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    got = list(itertools.islice(EventFileLoader(str(path)).Load(), records))
    assert got[0].file_version == "brain.Event:2"
    tags = [v.tag for ev in got[1:] for v in ev.summary.value]
    assert tags == list(TB_TAGS) * ((records - 1) // 4) + list(TB_TAGS)[:(records - 1) % 4]


def _children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def refrun(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds the ``refrun`` command takes in its own process, and its stdout."""
    t = time.perf_counter()
    # Run in the benchmark's temporary directory: a sqlite store's default artifact root is
    # ./mlruns of the working directory (~30 MB per recorded comparison), removed with it.
    proc = subprocess.run([sys.executable, "-m", "refrun", *args], capture_output=True,
                          text=True, env=env, check=False,
                          cwd=Path(env["REFRUN_SPOOL_DIR"]).parent)
    sec = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"refrun {' '.join(args)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    return sec, proc.stdout


def import_file(path: Path, role: str, uri: str, env: dict[str, str]) -> tuple[float, str]:
    sec, out = refrun(["import", "megatron", str(path), "--workload", "bench", "--role", role,
                       "--hardware", "h100", "--tracking-uri", uri], env)
    return sec, out.strip().splitlines()[-1]


def check_complete(run_id: str, uri: str, points: int) -> str:
    """The run is FINISHED and its curves artifact has every point."""
    from mlflow.tracking import MlflowClient

    from refrun.comparison import load_run

    run = MlflowClient(uri).get_run(run_id)
    data = load_run(run_id, tracking_uri=uri, progress=False)
    ok = run.info.status == "FINISHED" and data.source == "artifact" and data.points == points
    return (f"{run.info.status}, artifact {data.points:,} of {points:,} points"
            + ("" if ok else "  <-- INCOMPLETE"))


def pandas_floor(path: Path, steps: int) -> float:
    """Seconds to write the same long frame with pandas/pyarrow (zstd Parquet)."""
    n = steps * len(METRICS)
    df = pd.DataFrame({
        "metric": pd.Categorical(np.repeat(np.array(METRICS, dtype=object), steps)),
        "step": np.tile(np.arange(1, steps + 1, dtype=np.int64), len(METRICS)),
        "value": np.random.default_rng(0).random(n),
        "timestamp_ms": np.full(n, 1_700_000_000_000, dtype=np.int64),
        "seq": np.arange(n, dtype=np.int64),
    })
    t = time.perf_counter()
    df.to_parquet(path, engine="pyarrow", compression="zstd", index=False)
    return time.perf_counter() - t


def startup(args: list[str], env: dict[str, str], repeats: int) -> float:
    return statistics.median(refrun(args, env)[0] for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=350_000, help="steps per metric (x5)")
    ap.add_argument("--small-steps", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5, help="startup timings (median)")
    ap.add_argument("--tb-scalars", type=int, default=1_000_000)
    args = ap.parse_args()
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="refrun-bench-import-") as tmp_s:
        tmp = Path(tmp_s)
        uri = f"sqlite:///{tmp}/mlflow.db"
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "REFRUN_SPOOL_DIR": str(tmp / "sp")}
        # The store's first use creates its tables (~1-2 s): not part of any import.
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).search_experiments()

        small = tmp / "golden_values_small.json"
        n_small = golden_values(small, args.small_steps, 1)
        sec, rid = import_file(small, "reference", uri, env)
        rows.append((f"import megatron, {n_small:,} points (target <= 2 s)", sec,
                     check_complete(rid, uri, n_small)))

        tb_dir = tmp / "tb"
        tb_dir.mkdir()
        tb_file = tb_dir / "events.out.tfevents.1700000000.bench"
        n_tb = event_file(tb_file, args.tb_scalars)
        check_event_file(tb_file)
        cpu0 = _children_cpu()
        sec, out = refrun(["import", "tensorboard", str(tb_dir), "--workload", "bench-tb",
                           "--role", "reference", "--hardware", "h100",
                           "--tracking-uri", uri], env)
        rows.append((f"import tensorboard, {n_tb:,} scalars, "
                     f"{tb_file.stat().st_size / 1e6:.0f} MB (target <= 10 s)", sec,
                     f"{check_complete(out.split()[-1], uri, n_tb)}; "
                     f"{_children_cpu() - cpu0:.2f} s CPU (the machine's load inflates wall)"))

        big_a, big_b = tmp / "golden_values_a.json", tmp / "golden_values_b.json"
        n_big = golden_values(big_a, args.steps, 2)
        golden_values(big_b, args.steps, 3)
        size_mb = big_a.stat().st_size / 1e6
        sec_a, ref = import_file(big_a, "reference", uri, env)
        floor = pandas_floor(tmp / "floor.parquet", args.steps)
        rows.append((f"import megatron, {n_big:,} points, {size_mb:.0f} MB (target <= 10 s)",
                     sec_a, f"{check_complete(ref, uri, n_big)}; "
                     f"{sec_a / floor:.1f}x pandas.to_parquet of the frame"))
        rows.append(("  pandas/pyarrow to_parquet of the same frame", floor, "the floor"))
        _, cand = import_file(big_b, "candidate", uri, env)

        cmp = ["compare", "--reference", ref, "--candidate", cand, "--tracking-uri", uri]
        no_rec, _ = refrun([*cmp, "--no-record"], env)
        rec, _ = refrun(cmp, env)
        rows.append((f"compare {args.steps:,} steps x 5 metrics, --no-record", no_rec, ""))
        rows.append(("compare, recording the comparison run", rec,
                     f"{rec / no_rec:.2f}x --no-record (target <= 1.5x)"))

        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import mlflow.tracking, pandas, pyarrow"],
                       check=True, env=env)
        rows.append(("python -c 'import mlflow.tracking, pandas, pyarrow'",
                     time.perf_counter() - t, "the fixed cost of any command using MLflow"))
        rows.append(("refrun --version (median)", startup(["--version"], env, args.repeats),
                     "target <= 0.5 s"))
        rows.append(("refrun --help (median)", startup(["--help"], env, args.repeats),
                     "target <= 0.5 s"))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'seconds':>8}  note")
    for what, sec, note in rows:
        print(f"{what:<{width}}  {sec:>8.2f}  {note}")


if __name__ == "__main__":
    main()
