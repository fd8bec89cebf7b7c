"""Whether the number of live device buffers changes what a dispatch, a read and a free
cost on this machine (a diagnostic for docs/tpu.md, sixth session 2026-12-06): the JAX
probe keeps each logged scalar alive until its collector reads it (about a second of
steps: 500-5,000 arrays on the chip's ports).

For each count of extra live one-element arrays (kept alive as the probe keeps logged
losses), microseconds a call, best of three, wall and this thread's CPU:

* ``dispatch``: 1,024 calls of a one-output program, each output dropped at once (the
  plain loop's pattern), then waited for;
* ``dispatch+wait``: the same, each call waited for (the device's round trip);
* ``float``: reading 256 ready fresh outputs one at a time;
* ``stack64``: reading 256 ready fresh outputs four stacks of 64 at a time (the probe's
  stacked read);
* ``free``: dropping 1,024 ready outputs.

    python benchmarks/tpu/live_buffers.py --live 0,1024,8192
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def best(op: Callable[[], object], setup: Callable[[], object] = lambda: None,
         n: int = 1) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(3):
        arg = setup()
        t0, c0 = time.perf_counter(), time.thread_time()
        op() if arg is None else op(arg)  # type: ignore[call-arg]
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return min(walls) / n * 1e6, min(cpus) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", default="0,1024,8192")
    args = ap.parse_args()
    step = jax.jit(lambda x: x + 1.0)
    stack = jax.jit(lambda *xs: jnp.stack(xs))
    x = jax.device_put(np.float32(0))
    warm = [step(x) for _ in range(64)]
    jax.block_until_ready(stack(*warm))
    print(f"JAX {jax.__version__} on {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}); us a call (wall / CPU)")

    def fresh(k: int) -> list[jax.Array]:
        out = [step(x) for _ in range(k)]
        jax.block_until_ready(out)
        return out

    def dispatch() -> None:
        y = None
        for _ in range(1024):
            y = step(x)
        jax.block_until_ready(y)

    def dispatch_wait() -> None:
        for _ in range(256):
            step(x).block_until_ready()

    for live in map(int, args.live.split(",")):
        kept = fresh(live)
        rows = {
            "dispatch": best(dispatch, n=1024),
            "dispatch+wait": best(dispatch_wait, n=256),
            "float": best(lambda v: [float(a) for a in v], lambda: fresh(256), n=256),
            "stack64": best(lambda v: [np.asarray(stack(*v[i:i + 64])).tolist()
                                       for i in range(0, 256, 64)], lambda: fresh(256), n=256),
            "free": best(lambda v: v.clear(), lambda: fresh(1024), n=1024),
        }
        print(f"live {live:6d}: " + "  ".join(f"{k} {w:.2f}/{c:.2f}" for k, (w, c) in rows.items()))
        del kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
