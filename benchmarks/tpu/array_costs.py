"""What one logged scalar costs the process on this machine, operation by operation (a
diagnostic for docs/tpu.md, sixth session 2026-12-06): a step's loss kept by the probe is
later read, and freed on the thread that drops it, so each operation's CPU is one the
training thread may wait for.

For ``--count`` ready float32 scalars, each a fresh output of a one-output program (as a
step's loss is), microseconds a value, best of three, wall clock and this thread's CPU:
``float(x)``; ``np.asarray`` after ``copy_to_host_async`` of all; ``jax.device_get`` of
the list; ``copy_to_host_async`` alone; dropping the list (the buffers freed); the
``jax.device_put`` copy the probe makes of a value it suspects donated; and the
dispatch of the one-output program itself (what the plain loop pays per array).

    python benchmarks/tpu/array_costs.py --count 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import jax
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=4096)
    args = ap.parse_args()
    count = args.count
    step = jax.jit(lambda x: x + 1.0)
    x = jax.device_put(np.float32(0))

    def fresh() -> list[jax.Array]:
        out = [step(x) for _ in range(count)]
        jax.block_until_ready(out)
        return out

    def measure(what: str, op: Callable[[list[jax.Array]], object]) -> None:
        walls, cpus = [], []
        for _ in range(3):
            vals = fresh()
            t0, c0 = time.perf_counter(), time.thread_time()
            op(vals)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
        wall, cpu = min(walls) / count * 1e6, min(cpus) / count * 1e6
        print(f"  {what:55s} {wall:7.2f} us wall {cpu:7.2f} us CPU")

    def async_then_read(v: list[jax.Array]) -> None:
        for a in v:
            a.copy_to_host_async()
        for a in v:
            float(np.asarray(a))

    def drop(v: list[jax.Array]) -> None:
        v.clear()

    def dispatch(v: list[jax.Array]) -> None:
        out = [step(x) for _ in range(len(v))]
        jax.block_until_ready(out[-1])

    fresh()
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"{count} ready scalars, us a value")
    measure("float(x)", lambda v: [float(a) for a in v])
    measure("copy_to_host_async all, then np.asarray each", async_then_read)
    measure("jax.device_get(list)", jax.device_get)
    measure("copy_to_host_async alone", lambda v: [a.copy_to_host_async() for a in v])
    measure("drop the list (buffers freed)", drop)
    measure("jax.device_put(list, may_alias=False) (a device copy)",
            lambda v: jax.block_until_ready(jax.device_put(v, may_alias=False)))
    measure("dispatch of a one-output program (the plain loop's)", dispatch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
