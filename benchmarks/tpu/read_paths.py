"""How a JAX workload's logged scalars read on this machine, by path (a diagnostic for
docs/tpu.md, fifth session 2026-12-06): the arrays' signature, whether the probe's
stack hits its compiled program, and microseconds per value for the stack's dispatch,
its host copy, the collector's column read and ``jax.device_get`` of a list.

    python benchmarks/tpu/read_paths.py --workloads digits,charlm --steps 640

Caution (sixth session): each figure is the best of three passes over the *same* arrays,
and a read keeps its host copy, so the one-by-one reads (``float(x)``, ``device_get``)
after the first pass read cached copies: their 1.4 and 3.4 us on the chip are not what a
fresh value costs there (450-510 us and 84 us: ``benchmarks/tpu/array_costs.py``, which
makes fresh arrays for every pass).  The stacked figures make a new stack each pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import numpy as np

from benchmarks.tpu.probe_cost import make_workload
from refrun.probes import jax_blocks


def per_value(fn, count: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / count * 1e6


def report(name: str, losses: list[jax.Array]) -> None:
    a = losses[-1]
    print(f"[{name}] {type(a).__name__} dtype={a.dtype} weak={a.weak_type} "
          f"shape={a.shape} committed={a.committed} sharding={a.sharding!r}; "
          f"distinct sharding objects: {len({id(x.sharding) for x in losses})}")
    chunks = [losses[i:i + 64] for i in range(0, len(losses) - 63, 64)]
    count = 64 * len(chunks)
    stack = jax_blocks._stack_uniform
    before = stack._cache_size()
    jax.block_until_ready([stack(*c) for c in chunks])
    print(f"  stack cache size {before} -> {stack._cache_size()} after {len(chunks)} chunks")
    disp = per_value(lambda: jax.block_until_ready([stack(*c) for c in chunks]), count)
    copy = per_value(lambda: [np.asarray(o).tolist() for o in [stack(*c) for c in chunks]],
                     count)

    def column() -> None:
        col = jax_blocks.Column("loss", values=list(losses[:count]))
        jax_blocks.ColumnReader().read({"loss": col})

    get = per_value(lambda: jax.device_get(losses[:count]), count)
    one = per_value(lambda: [float(x) for x in losses[:256]], 256)
    print(f"  us a value: stack dispatch+run {disp:.2f}; stack, then host copy one by one "
          f"{copy:.2f}; column read {per_value(column, count):.2f}; jax.device_get(list) "
          f"{get:.2f}; float(x) {one:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="digits,charlm")
    ap.add_argument("--steps", type=int, default=640)
    args = ap.parse_args()
    jax_blocks.precompile()
    for name in args.workloads.split(","):
        w = make_workload(name, None)
        state, losses = w.init(), []
        for n in range(args.steps):
            state, loss, _ = w.step(state, n)
            losses.append(loss)
        jax.block_until_ready(losses)
        report(name, losses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
