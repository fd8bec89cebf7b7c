"""Every ``loss``, ``eval/*`` and ``train/*`` value of every run of two TPU records,
compared value by value (bitwise), run by run (matched by variant name).

    python benchmarks/tpu/results/sixteenth/compare_records.py /tmp/t10/tpu-store /tmp/t11/tpu-store
"""

from __future__ import annotations

import json
import sqlite3
import sys

Row = tuple[str, int, float]
QUERY = ("select key, step, value from metrics where run_uuid = ? "
         "order by key, step, timestamp")


def watched(key: str) -> bool:
    return key == "loss" or key.startswith(("eval/", "train/"))


def load(store: str) -> tuple[dict, dict[str, list[Row]]]:
    """The record's manifest and, per variant, its watched metric rows."""
    with open(f"{store}/manifest.json") as f:
        manifest = json.load(f)
    db = sqlite3.connect(f"{store}/mlflow.db")
    runs = [*manifest["runs"], *(manifest.get("matmul_check") or [])]
    return manifest, {r["variant"]: [row for row in db.execute(QUERY, (r["run_id"],))
                                     if watched(row[0])] for r in runs}


def main(first: str, second: str) -> int:
    ma, a = load(first)
    mb, b = load(second)
    print("jax", ma["jax"], mb["jax"], "runs", len(a), len(b))
    same = 0
    for variant in sorted(set(a) | set(b)):
        x, y = a.get(variant, []), b.get(variant, [])
        if x and x == y:
            same += 1
            continue
        first_diff = next(((p, q) for p, q in zip(x, y, strict=False) if p != q), None)
        print("DIFF", variant, len(x), len(y), first_diff)
    print("identical", same, "different", len(set(a) | set(b)) - same)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
