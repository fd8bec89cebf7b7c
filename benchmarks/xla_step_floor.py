"""What this machine can resolve of a PyTorch/XLA probe's cost on a sub-millisecond step.

Paired blocks of ``bench_xla_probe.py``'s MLP (PJRT CPU), its arms in a random order each
round, every arm stepping one model instance (``--twins``: each arm its own instance, the
design before 2026-12-07, eleventh session, which measured instance bias of 1-3 %; run
it under ``taskset -c 0`` on a machine of few cores, as bench_xla_probe.py says why):

* ``plain``: the step alone (the baseline);
* ``plain-again``: the same (an A/A arm: its ratio's truth is 1, so its interval is the
  resolution of the design on this machine; with ``--twins`` instance bias included);
* ``boundary``: the least a Python step boundary does: two ``perf_counter`` reads, one
  list append, the last ``--keep`` losses kept alive (torch_xla's ``sync`` sees every live
  XLA tensor);
* ``exact-boundary`` (with ``--arms``): the least a boundary that records each step's
  own counts reads, inlined in the loop, no call of its own: ``boundary`` plus the two
  transfer sentinels at entry and exit, the compilation, cache-hit and execution counters
  at exit and ``thread_time`` at both (seven counter reads, four clocks, one tuple a
  step): what the XLA probe reads at a steady step, without anything else it does;
* ``probe``: ``refrun.xla.instrument(run, model=..., optimizer=...)``, ``probe.step`` and
  ``probe.log(loss=...)`` as ``bench_xla_probe.py`` uses them;
* ``probe-step`` (with ``--arms``): a probe of its own run around the step, nothing logged
  (no value held, none copied): the probe's counter reads and clocks alone.

``--gc-freeze``: ``gc.freeze()`` after the warm-up (the objects alive then are never
scanned again), to see what the probe's extra objects cost in garbage collections.
After the table: the CPU seconds the runs' delivery processes used per probed step (they
write the points to the store beside the training process, on the same cores).

Each ratio is the geometric mean of the paired block ratios with its 95 % t-interval.
Issue 52 asks ``bench_xla_probe.py`` for an upper end <= 1.01 on this MLP; this script
says whether a probe that costs nothing could show that here (the A/A row) and what a
minimal Python boundary reads (the boundary row).

    PJRT_DEVICE=CPU python benchmarks/xla_step_floor.py --rounds 300
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_xla_probe as bench
from children_cpu import children_cpu_s

ARMS = ("plain", "plain-again", "boundary", "probe")
EXTRA_ARMS = ("probe-step", "exact-boundary")


class StepOnly:
    """A probe's step boundary with nothing logged."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe

    def step(self, n: int) -> Any:
        return self.probe.step(n)

    def log(self, **values: Any) -> None:
        pass

    def log_eval(self, step: int, **values: Any) -> None:
        pass


class Boundary:
    """Two clock reads and one append a step; the last ``keep`` losses kept alive."""

    def __init__(self, keep: int) -> None:
        self.keep, self.kept, self.seconds = keep, [], []
        self._t0 = 0.0

    def step(self, n: int) -> Boundary:
        return self

    def __enter__(self) -> Boundary:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds.append(time.perf_counter() - self._t0)
        del self.seconds[:-64]

    def log(self, **values: Any) -> None:
        self.kept.append(values)
        if len(self.kept) > self.keep:
            del self.kept[0]

    def log_eval(self, step: int, **values: Any) -> None:
        pass


class ExactBoundary(Boundary):
    """:class:`Boundary` plus the counter reads and thread clocks of a step whose counts are
    recorded exactly (the XLA probe's steady-step reads), kept as one tuple a step."""

    def __init__(self, keep: int) -> None:
        super().__init__(keep)
        import torch_xla

        self._c = torch_xla._XLAC._xla_counter_value
        self._entry: tuple[float, ...] = ()
        self.rows: list[tuple[float, ...]] = []

    def __enter__(self) -> ExactBoundary:
        c = self._c
        self._entry = (time.perf_counter(), c("xla::_to_copy"), c("xla::_to_cpu"),
                       time.thread_time())
        return self

    def __exit__(self, *exc: Any) -> None:
        c, (t0, copies, to_cpu, cpu0) = self._c, self._entry
        self.rows.append((time.perf_counter() - t0, time.thread_time() - cpu0, copies,
                          to_cpu, c("xla::_to_copy"), c("xla::_to_cpu"),
                          c("UncachedCompile"), c("CachedCompile"), c("ExecuteComputation")))
        del self.rows[:-64]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--steps", type=int, default=400, help="steps per block")
    ap.add_argument("--keep", type=int, default=64, help="losses the boundary keeps alive")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block orders")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"arms to run, among {', '.join(ARMS + EXTRA_ARMS)} (plain always)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up")
    ap.add_argument("--twins", action="store_true",
                    help="each arm its own model instance (the design before 2026-12-07)")
    args = ap.parse_args()
    names = tuple(dict.fromkeys(["plain", *args.arms.split(",")]))
    unknown = set(names) - set(ARMS + EXTRA_ARMS)
    if unknown:
        ap.error(f"--arms: unknown {', '.join(sorted(unknown))}")

    import refrun
    import refrun.xla

    one = None if args.twins else bench.mlp()
    arms = {name: one or bench.mlp() for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        runs, loops = [], {}
        for name in names:
            loops[name] = (Boundary(args.keep) if name == "boundary" else
                           ExactBoundary(args.keep) if name == "exact-boundary" else None)
            if name.startswith("probe"):
                run = refrun.start_run(f"xla-step-floor-{name}", "candidate", hardware="cpu",
                                       backend="torch_xla",
                                       tracking_uri=f"sqlite:///{tmp}/{name}.db",
                                       spool_dir=f"{tmp}/spool-{name}")
                probe = refrun.xla.instrument(run, model=arms[name].model,
                                              optimizer=arms[name].optimizer)
                runs.append((run, probe))
                loops[name] = probe if name == "probe" else StepOnly(probe)
        for name in names:  # warm-up: compilations and the probe's first flush
            bench.run_block(arms[name], 1100, loops[name])
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        rng = random.Random(args.seed)
        blocks: dict[str, list[float]] = {a: [] for a in names}
        cpu0 = children_cpu_s()
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            order = list(names)
            rng.shuffle(order)
            for a in order:
                blocks[a].append(bench.run_block(arms[a], args.steps, loops[a]))
        delivery_cpu = children_cpu_s() - cpu0
        for run, probe in runs:
            probe.close()
            run.close()
    plain_ms = statistics.median(blocks["plain"]) * 1e3
    print(f"CPUs {sorted(os.sched_getaffinity(0))} of {os.cpu_count()}; "
          + ("one model instance per arm (--twins)" if args.twins else "one model instance"))
    print(f"MLP (bench_xla_probe.py), plain step {plain_ms:.3f} ms; "
          f"{args.rounds} rounds x {args.steps} steps, {time.perf_counter() - t0:.0f} s"
          + ("; gc.freeze() after the warm-up" if args.gc_freeze else ""))
    print("| arm | / plain [95 % CI] | upper end <= 1.01 |")
    print("|---|---|---|")
    for a in names[1:]:  # the paired blocks' geometric mean and its 95 % t-interval
        g, lo, hi, _ = bench.round_ratio(blocks[a], blocks["plain"])
        print(f"| {a} | {g:.4f} [{lo:.4f}, {hi:.4f}] | {'yes' if hi <= 1.01 else 'no'} |")
    probed = sum(1 for a in names if a.startswith("probe")) * args.rounds * args.steps
    if probed:
        print(f"delivery processes' CPU: {delivery_cpu:.1f} s over the rounds, "
              f"{1e6 * delivery_cpu / probed:.0f} us per probed step")


if __name__ == "__main__":
    main()
