"""Directional finite-difference check: function evaluations vs parameter count.

A PyTorch MLP ``d → d → 1`` (tanh, MSE, float64) is checked with
``check_finite_differences`` for widths giving ~1k to ~1M parameters.  The table prints,
per model, the parameter count, the function and gradient evaluations the check made,
the wall time, the verdict, and how many evaluations a per-coordinate central
difference (2 per parameter per step size) would have needed.  Run::

    .venv/bin/python benchmarks/bench_gradcheck.py [--directions 3] [--max-width 1000]

Expected: evaluations = 2 · steps · directions (60 with the defaults) for every model.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def build(width: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 1)).double()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, width))
    y = rng.standard_normal((32, 1))
    return model, x, y


def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def main() -> None:
    import torch

    from refrun.gradcheck import DEFAULT_STEPS, check_finite_differences

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--directions", type=int, default=3)
    ap.add_argument("--max-width", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    widths = [w for w in (31, 100, 316, 1000) if w <= args.max_width]
    print(f"{'params':>10} {'f evals':>8} {'grad evals':>10} {'seconds':>8} "
          f"{'verdict':>9} {'best err':>9} {'per-coordinate evals':>21}")
    for w in widths:
        model, x, y = build(w)
        n = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        r = check_finite_differences(loss, model, (x, y), framework="torch", dtype="float64",
                                     directions=args.directions)
        dt = time.perf_counter() - t0
        print(f"{n:>10,} {r.function_evaluations:>8} {r.gradient_evaluations:>10} {dt:>8.2f} "
              f"{r.verdict:>9} {r.best_error:>9.1e} {2 * n * len(DEFAULT_STEPS):>21,}")


if __name__ == "__main__":
    main()
