"""Does the delivery process take CPU from a CPU-bound trainer on a busy machine?

The charlm reference trainer (``pipelines.charlm.train_torch --quick``: 150 steps, a
small transformer on the CPU, its loss, gradient norms, step time and counters recorded
every step) runs with refrun's two deliveries, interleaved repeat by repeat, each beside
one busy process started from this script's session (so a 2-core machine is saturated,
as with a second training job):

* ``process``: the default, a delivery process (``python -m refrun.recording.process``);
* ``thread``: ``REFRUN_DELIVERY=thread``, delivery on a thread of the trainer, no second
  process (the baseline: the trainer has the CPU it would have without refrun's process).

Prints per repeat and delivery the median and fastest-5 % steady step time (steps from 20
on) and the run's own CPU (``sys/run_cpu_cores``, the trainer and its children) against
the trainer's (``sys/proc_cpu_pct``), then the ratio of the medians, process / thread.
Before the delivery process yielded (its own session, hence its own scheduler autogroup)
this ratio was about 2.4 on a 2-core machine; see docs/session.md.

    python benchmarks/bench_delivery_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DELIVERIES = {"process": {}, "thread": {"REFRUN_DELIVERY": "thread"}}


def train(delivery: str, rep: int, uri: str, spool: str) -> str:
    """One recorded charlm reference run; returns its run id."""
    env = dict(os.environ, **DELIVERIES[delivery])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"),
                                         env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.charlm.train_torch", "--seed", "1", "--role",
         "reference", "--variant", f"{delivery}-{rep}", "--tracking-uri", uri, "--quick",
         "--spool-dir", spool], env=env, capture_output=True, text=True, check=True)
    found = re.search(r"run ([0-9a-f]{32})", out.stdout)
    if found is None:
        raise RuntimeError(f"no run id in the trainer's output:\n{out.stdout[-2000:]}")
    return found.group(1)


def figures(run_id: str, uri: str) -> tuple[float, float, float, float]:
    """(median step s, fastest-5 % step s, run cores, trainer cores), steps >= 20."""
    from refrun.acceptance import runview as rv
    from refrun.comparison import load_run

    run = load_run(run_id, tracking_uri=uri, progress=False)
    steps = rv.resolved(run, "perf/step_time_s", "last")
    own = rv.resolved(run, "sys/run_cpu_cores", "last")
    proc = rv.resolved(run, "sys/proc_cpu_pct", "last")
    st = steps.values[steps.steps >= 20]
    return (float(np.median(st)), float(np.quantile(st, 0.05)),
            float(np.median(own.values)), float(np.median(proc.values)) / 100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-delivery-cpu-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ids: dict[str, list[str]] = {d: [] for d in DELIVERIES}
    try:
        for rep in range(args.repeats):
            for d in DELIVERIES:
                ids[d].append(train(d, rep, uri, str(tmp / "spool")))
    finally:
        busy.kill()
    print(f"{os.cpu_count()} logical CPUs; one busy process beside every run\n")
    print("| delivery | repeat | median step | fastest 5 % | run cores | trainer cores |")
    print("|---|---|---|---|---|---|")
    medians: dict[str, list[float]] = {d: [] for d in DELIVERIES}
    for d, runs in ids.items():
        for rep, run_id in enumerate(runs):
            med, low, own, proc = figures(run_id, uri)
            medians[d].append(med)
            print(f"| {d} | {rep} | {med * 1e3:.2f} ms | {low * 1e3:.2f} ms | {own:.2f} "
                  f"| {proc:.2f} |")
    ratio = np.median(medians["process"]) / np.median(medians["thread"])
    print(f"\nmedian step, process / thread delivery: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
