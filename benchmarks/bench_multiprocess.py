"""Overhead of recording a multi-process job, as ratios measured in one run.

A 2-rank DDP job (``pipelines.scaling.ddp_job`` under ``torchrun --standalone``, gloo on
CPU) with a step of a few ms (the digits MLP plus a ``--per-step-ms`` busy wait) is run
unrecorded and recorded (``refrun.torch.instrument`` on every rank, sqlite store, psutil
sampler on), interleaved ``--repeats`` times.  The table prints:

* the median steady step time over ranks (after 10 warm-up steps) of each and their ratio;
* the time from the end of the last rank's training loop until every rank's data is on the
  run (the newest inode change time of rank 0's ``refrun/curves.parquet`` and the
  ``refrun/ranks/rank-<k>`` artifacts in the local artifact store, after checking the run
  FINISHED and every rank reported), and until the last rank's ``close()`` returned.

Wall-clock numbers on a shared machine are noisy: read the median of several runs.

Usage: python benchmarks/bench_multiprocess.py [--steps 300] [--per-step-ms 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
WARMUP = 10


def launch(tmp: Path, steps: int, per_step_ms: float, recorded: bool) -> dict[str, float]:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db",
               REFRUN_SPOOL_DIR=str(tmp / "spool"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("REFRUN_JOB_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(RANKS), "-m", "pipelines.scaling.ddp_job", "--steps", str(steps),
           "--per-step-ms", str(per_step_ms), "--timing", str(tmp / "timing.json"),
           "--workload", "bench-multiprocess"]
    if not recorded:
        cmd.append("--unrecorded")
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    timings = [json.loads((tmp / f"timing.json.rank{k}").read_text()) for k in range(RANKS)]
    steady = [statistics.median(t["step_s"][WARMUP:]) for t in timings]
    loop_end = max(t["loop_end"] for t in timings)
    out = {"step_s": statistics.median(steady),
           "closed_s": max(t["closed"] for t in timings) - loop_end}
    if recorded:
        out["arrived_s"] = _arrived(env["MLFLOW_TRACKING_URI"]) - loop_end
    return out


def _arrived(uri: str) -> float:
    """Wall time the last of the job's data reached the run: the newest inode change time
    of rank 0's curves and every rank's artifact in the (local) artifact store, checked to
    be complete first (rank 0 FINISHED, every rank > 0 reported)."""
    from mlflow.tracking import MlflowClient

    from refrun import schema

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bench-multiprocess")
    (run,) = client.search_runs([exp.experiment_id])
    want = [schema.TAG_JOB_REPORTED_PREFIX + schema.rank_name(k) for k in range(1, RANKS)]
    assert run.info.status == "FINISHED" and all(w in run.data.tags for w in want), run.data.tags
    root = Path(run.info.artifact_uri.removeprefix("file://"))
    files = [root / schema.ARTIFACT_CURVES] + [root / schema.rank_curves_artifact(k)
                                               for k in range(1, RANKS)]
    # st_ctime: when the file's inode last changed, i.e. when the store wrote it (its mtime
    # is the spool file's, kept by the copy).
    return max(f.stat().st_ctime for f in files)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--per-step-ms", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    plain, rec = [], []
    for i in range(a.repeats):
        for recorded, into in ((False, plain), (True, rec)):
            with tempfile.TemporaryDirectory(prefix="refrun-bench-mp-") as tmp:
                into.append(launch(Path(tmp), a.steps, a.per_step_ms, recorded))
        print(f"repeat {i + 1}/{a.repeats}: unrecorded {plain[-1]['step_s'] * 1e3:.3f} ms, "
              f"recorded {rec[-1]['step_s'] * 1e3:.3f} ms", flush=True)
    p_step = statistics.median(r["step_s"] for r in plain)
    r_step = statistics.median(r["step_s"] for r in rec)
    print(f"\n{RANKS}-rank DDP job, {a.steps} steps, median steady step over ranks "
          f"({a.repeats} interleaved repeats)")
    print(f"| {'':<34} | {'value':>12} |")
    print(f"|{'-' * 36}|{'-' * 14}|")
    print(f"| {'step, unrecorded (ms)':<34} | {p_step * 1e3:>12.3f} |")
    print(f"| {'step, recorded (ms)':<34} | {r_step * 1e3:>12.3f} |")
    print(f"| {'ratio recorded / unrecorded':<34} | {r_step / p_step:>12.4f} |")
    print(f"| {'all ranks on the run after exit (s)':<34} | "
          f"{statistics.median(r['arrived_s'] for r in rec):>12.2f} |")
    print(f"| {'last close() returned after (s)':<34} | "
          f"{statistics.median(r['closed_s'] for r in rec):>12.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
