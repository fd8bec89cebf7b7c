"""What one more argument and output of a jitted step costs the host thread that dispatches
it: a diagnostic for the chip (docs/tpu.md, seventh session), where a step's dispatch is
what a ~1 ms host-bound step waits on.

For n = 1, 2, 3, 5, 9, 17 small float32 arrays, a program that takes n arrays and returns
them updated is dispatched in a chain (each output the next input), donated or not; the
training thread's CPU time (``time.thread_time``) and wall time per dispatch are printed,
the least of three blocks, and the cost of each array beyond the first (least squares).

    python benchmarks/tpu/dispatch_costs.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def per_dispatch(n: int, donate: bool, steps: int) -> tuple[float, float]:
    """(CPU us, wall us) per dispatch of an n-array program chained ``steps`` times."""
    fn = jax.jit(lambda *xs: tuple(x + 1 for x in xs),
                 donate_argnums=tuple(range(n)) if donate else ())
    xs = tuple(jnp.zeros((4,), jnp.float32) + i for i in range(n))
    xs = jax.block_until_ready(fn(*xs))  # compiled outside the timing
    best_cpu = best_wall = float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            xs = fn(*xs)
        jax.block_until_ready(xs)
        best_wall = min(best_wall, (time.perf_counter() - t0) / steps * 1e6)
        best_cpu = min(best_cpu, (time.thread_time() - c0) / steps * 1e6)
    return best_cpu, best_wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    sizes = (1, 2, 3, 5, 9, 17)
    print(f"JAX {jax.__version__} on {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}); us per dispatch, least of 3 blocks of "
          f"{args.steps}")
    print(f"  {'arrays':>6}  {'CPU':>9}  {'wall':>9}  {'CPU donated':>11}  {'wall donated':>12}")
    rows = []
    for n in sizes:
        plain, donated = per_dispatch(n, False, args.steps), per_dispatch(n, True, args.steps)
        rows.append((n, *plain, *donated))
        print(f"  {n:6d}  {plain[0]:9.2f}  {plain[1]:9.2f}  {donated[0]:11.2f}  "
              f"{donated[1]:12.2f}")
    a = np.array(rows)
    for col, what in ((1, "CPU"), (2, "wall"), (3, "CPU donated"), (4, "wall donated")):
        slope = np.polyfit(a[:, 0], a[:, col], 1)[0]
        print(f"  each array beyond the first, {what}: {slope:.2f} us")


if __name__ == "__main__":
    main()
