"""Measure the reference seeds' noise floor behind pipelines/criteria/digits.toml.

    # 1. record N reference seeds into a scratch store
    for s in 0 1 2 3 4 5 6 7; do .venv/bin/python -m pipelines.digits.train_torch \\
        --seed $s --role reference --quiet --tracking-uri sqlite:////tmp/noise.db; done
    # 2. hold each seed out against every group of 3 others and print what a benign
    #    candidate needs from each criterion
    .venv/bin/python -m pipelines.digits.noise_floor sqlite:////tmp/noise.db

Per-step metrics: the fraction of steps inside ``mean +- k std`` of the 3-seed group
(worst trial, 5th percentile, median).  One-point metrics: how far the held-out seed falls
outside the group's min-max band (worst trial, 95th percentile).
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

from refrun.comparison import compare, find_run_ids, load_run

PER_STEP = ("loss", "eval/val_loss", "grad_norm/fc1.weight")
ONE_POINT = ("eval/final_val_loss", "eval/test_accuracy")


def main(argv: list[str] | None = None) -> int:
    uri = (argv or sys.argv[1:])[0]
    runs = [load_run(i, tracking_uri=uri, progress=False)
            for i in find_run_ids("digits-mlp", "reference", tracking_uri=uri)]
    print(f"{len(runs)} reference runs; groups of 3, each seed held out")
    fractions: dict[str, list[np.ndarray]] = {m: [] for m in PER_STEP}
    for i, cand in enumerate(runs):
        others = [r for j, r in enumerate(runs) if j != i]
        for group in itertools.combinations(others, 3):
            cmp = compare(list(group), cand, metrics=list(PER_STEP), progress=False)
            for m in PER_STEP:
                f = cmp.metrics[m].frame
                fractions[m].append(np.abs((f["candidate"] - f["ref_mean"]) / f["ref_std"])
                                    .to_numpy())
    for m in PER_STEP:
        for k in (3, 4, 5, 6):
            fr = np.array([np.mean(z <= k) for z in fractions[m]])
            print(f"{m:24s} k={k}: fraction inside min {fr.min():.3f} p5 "
                  f"{np.percentile(fr, 5):.3f} median {np.median(fr):.3f}")
    for m in ONE_POINT:
        v = np.array([r.series(m)[1][-1] for r in runs])
        need = []
        for i in range(len(v)):
            for group in itertools.combinations(np.delete(v, i), 3):
                need.append(max(0.0, min(group) - v[i], v[i] - max(group)))
        print(f"{m:24s} outside the 3-seed min-max: max {max(need):.4f} "
              f"p95 {np.percentile(need, 95):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
