"""Where one collection of the JAX probe's collector spends its wall time, phase by phase,
on whatever JAX runs here (a diagnostic for docs/tpu.md, fifth session 2026-12-06).

A probed loop of ``--steps`` steps runs with no background collection (a flush interval of
an hour); then one collection is done on this thread in the phases of
``JaxProbe._collect``, each timed, as microseconds per step of the block.  ``--live``
collects right after the last step (the device may still run queued steps); otherwise the
device is idle first.  Then the spool writer's formatting of the queued points.

    python benchmarks/tpu/collect_phases.py --workloads charlm,digits --steps 2000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import itertools

import jax

import refrun
import refrun.jax
from benchmarks.tpu.probe_cost import make_workload
from refrun.probes import host_reads
from refrun.probes.jax_blocks import columns, take
from refrun.recording.spool import format_points


def phases(name: str, steps: int, reps: int, live: bool) -> dict[str, float]:
    w = make_workload(name, None)
    tmp = tempfile.mkdtemp(prefix="refrun-phases-")
    run = refrun.start_run(f"phases-{name}", "candidate", hardware=jax.default_backend(),
                           backend="jax", tracking_uri=f"sqlite:///{tmp}/m.db",
                           spool_dir=f"{tmp}/spool", snapshot_environment=False,
                           flush_interval_s=3600)
    probe = refrun.jax.instrument(run, step_fns=w.fns, monitors=None)
    backend = probe.backend
    print(f"[{name}] read path: {backend.read_path}")
    state, n = w.init(), 0
    sums: dict[str, float] = {}
    for rep in range(reps + 1):
        for _ in range(steps):
            with probe.step(n):
                state, loss, norms = w.step(state, n)
                if norms is None:
                    probe.log(loss=loss)
                else:
                    probe.log(loss=loss, grad_norm=norms)
            n += 1
        if not live:
            jax.block_until_ready(state)
        q0 = len(run._writer.queue)  # the writer does not drain it (flush interval 1 h)
        marks = [("start", time.perf_counter())]
        rows, values = take(probe._step_rows, probe._logged)
        (events,) = take(probe._row_events)
        marks.append(("take", time.perf_counter()))
        with backend.compiles.ignoring(), host_reads.suspended(), jax.transfer_guard("allow"):
            probe._emit_rows(rows, events, False)
            marks.append(("rows (step time, counters) to the session", time.perf_counter()))
            cols = columns(values, probe._names_of)
            marks.append(("values split into columns", time.perf_counter()))
            probe._reader.read(cols)
            marks.append(("values read (stack, copy, wait)", time.perf_counter()))
            groups: dict[tuple[int, ...], dict[str, list[float]]] = {}
            for metric, col in cols.items():
                got_steps, vals = probe._take_column(metric, col)
                groups.setdefault(tuple(got_steps), {})[metric] = vals
            for got_steps, group in groups.items():
                run.log_columns(list(got_steps), group)
            marks.append(("values to the session", time.perf_counter()))
        probe._record_backend_warnings()
        marks.append(("backend warnings", time.perf_counter()))
        probe._describe()
        marks.append(("describe (tags)", time.perf_counter()))
        queued = list(run._writer.queue)[q0:]
        marks.append(("(copy of the writer's queue)", time.perf_counter()))
        format_points(queued)
        marks.append(("writer: format the block's points", time.perf_counter()))
        if rep:  # the first block compiles and learns names
            for (_, a), (what, b) in itertools.pairwise(marks):
                sums[what] = sums.get(what, 0.0) + (b - a) * 1e6 / steps
    probe.close()
    run.close()
    return {k: v / reps for k, v in sums.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="charlm,digits")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--live", action="store_true")
    args = ap.parse_args()
    print(f"JAX {jax.__version__} on {jax.default_backend()}; us per step of a block of "
          f"{args.steps} steps, mean of {args.reps} blocks"
          f"{' (collected while the device may still run)' if args.live else ''}")
    for name in args.workloads.split(","):
        got = phases(name, args.steps, args.reps, args.live)
        print(f"[{name}] total {sum(got.values()):.2f} us a step")
        for what, us in got.items():
            print(f"  {what:45s} {us:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
