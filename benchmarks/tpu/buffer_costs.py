"""Where a metrics buffer's cost to the training thread comes from, piece by piece: a
diagnostic for the chip (docs/tpu.md, seventh session), where the ``buffered`` arm of
``probe_cost.py`` cost charlm +40 us of training-thread CPU a step over ``probe.step``
alone, against the ~7.5 us one more donated array costs a dispatch there.

For each port, the training thread's CPU time and wall time per step (least of three
blocks, the variants interleaved) of:

* ``plain``: the port's jitted step;
* ``rewrapped``: the same step inside a second ``jax.jit`` (the wrapper the buffered arm
  compiles), no buffer;
* ``buffer``: the rewrapped step writing a metrics buffer (one more donated argument and
  output), no probe;
* ``step-only``: ``plain`` inside ``probe.step`` (no monitors), nothing logged;
* ``buffer+probe``: ``buffer`` inside ``probe.step`` with ``probe.log_buffer`` (no
  monitors): the ``buffered`` arm without monitors;
* ``buffer-only+probe``: the same with the step's scalars returned in the buffer alone
  (the ``buffer-only`` arm without monitors).

    python benchmarks/tpu/buffer_costs.py [--workloads charlm,digits] [--steps 3000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_cost

import refrun
import refrun.jax
from refrun.probes.jax_buffer import empty_buffer

VARIANTS = ("plain", "rewrapped", "buffer", "step-only", "buffer+probe", "buffer-only+probe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="charlm,digits")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="buffer-costs-"))
    print(f"JAX {jax.__version__} on {jax.default_backend()}; training thread, us a step, "
          f"least of {args.blocks} interleaved blocks of {args.steps}")
    for name in args.workloads.split(","):
        w = probe_cost.make_workload(name, None)
        fn = w.fns[0]
        donated = (0, *(i + 1 for i in w.donate))
        rewrapped = jax.jit(lambda *a, _f=fn: _f(*a), donate_argnums=tuple(
            i - 1 for i in donated[1:]))
        runs = [refrun.start_run(f"buffer-costs-{name}-{i}", "candidate",
                                 hardware=jax.default_backend(), backend="jax", seed=0,
                                 tracking_uri=f"sqlite:///{tmp}/s.db",
                                 spool_dir=str(tmp / f"spool{i}"), snapshot_environment=False)
                for i in range(2)]  # one buffer in use a probe: a probe each
        probe, probe2 = (refrun.jax.instrument(r, step_fns=w.fns, monitors=None) for r in runs)
        _, loss, norms = w.step(w.init(), 0)
        names = tuple(w.metrics((loss,) if norms is None else (loss, norms)))
        holder = probe_cost.Arm("buffer+probe", None)  # the probe's buffer
        holder.buf = probe.metrics_buffer(*names, capacity=1024)
        buffered = probe_cost.buffered_call(w, holder)
        only = probe_cost.Arm("buffer-only+probe", None)
        only.buf = probe2.metrics_buffer(*names, capacity=1024)
        alone = probe_cost.Arm("buffer", None)  # no probe: it fills and counts on, unread
        alone.buf = empty_buffer(names, 1024)
        states = {v: w.init() for v in VARIANTS}
        calls = {"plain": fn, "rewrapped": rewrapped, "buffer": probe_cost.buffered_call(w, alone),
                 "step-only": fn,
                 "buffer+probe": buffered,
                 "buffer-only+probe": probe_cost.buffered_call(w, only, only=True)}
        best = {v: (float("inf"), float("inf")) for v in VARIANTS}
        step_no = 0
        for b in range(args.blocks + 1):  # the first round warms every variant up
            for v in VARIANTS:
                w.call[0] = calls[v]
                state = states[v]
                n0 = step_no
                t0, c0 = time.perf_counter(), time.thread_time()
                for i in range(args.steps):
                    n = n0 + i
                    if v in ("step-only", "buffer+probe", "buffer-only+probe"):
                        p = probe2 if v == "buffer-only+probe" else probe
                        with p.step(n):
                            state, _, _ = w.step(state, n)
                            if v == "buffer+probe":
                                holder.buf = p.log_buffer(holder.buf)
                            elif v == "buffer-only+probe":
                                only.buf = p.log_buffer(only.buf)
                    else:
                        state, _, _ = w.step(state, n)
                jax.block_until_ready(state)
                cpu = (time.thread_time() - c0) / args.steps * 1e6
                wall = (time.perf_counter() - t0) / args.steps * 1e6
                step_no += args.steps
                states[v] = state
                if b:
                    best[v] = (min(best[v][0], cpu), min(best[v][1], wall))
        w.call[0] = fn
        for p, r in ((probe, runs[0]), (probe2, runs[1])):
            p.close()
            r.close()
        base = best["plain"]
        print(f"[{name}] {w.what}")
        for v in VARIANTS:
            cpu, wall = best[v]
            print(f"  {v:14s} CPU {cpu:8.1f} ({cpu - base[0]:+7.1f})   wall {wall:8.1f} "
                  f"({wall - base[1]:+7.1f})")


if __name__ == "__main__":
    main()
