"""One short row per TPU run from ``assess.py --json``: the table docs/tpu.md keeps.

    .venv/bin/python benchmarks/tpu/summary.py assess.json [--manifest tpu-store/manifest.json]

Columns: workload, run, matmul precision, benign or defect, verdict, whether it came out
as intended (``assess.py``'s: a defect rejected by a criterion watching what it disturbs,
a benign run accepted), the criteria that failed (ids only; the full reasons are in the
JSON), the L4 figures measured against the CPU references, and the verdict with the L4
goals.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def short(value: str | None) -> str:
    """A figure, or ``n/a`` without the reason (the JSON keeps it)."""
    if value is None:
        return "-"
    return "n/a" if value.startswith("n/a") else value


def row(r: dict) -> str:
    failing = [f[0] for f in r.get("failing") or []]
    goals = r.get("with_goals")
    added = [g[0] for g in goals[1] if g[0] not in failing] if goals else []
    with_goals = "-" if not goals else goals[0] + (f" ({', '.join(added)})" if added else "")
    intended = {True: "yes", False: "**no**", None: "-"}[r.get("as_intended")]
    l4, chip = r.get("l4") or {}, r.get("chip") or {}
    return " | ".join([
        "", r["workload"], r["variant"].removeprefix("tpu-"), r.get("precision") or "-",
        r.get("kind") or "-", r.get("verdict") or r.get("error") or "-", intended,
        ", ".join(failing) or "-", short(l4.get("throughput")), short(l4.get("cost")),
        short(l4.get("busy_pct")), chip.get("hbm_peak_mib", "-"), with_goals, ""]).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    args = ap.parse_args(argv)
    rows = json.loads(args.json.read_text(encoding="utf-8"))
    print("| workload | run | precision | kind | verdict | as intended | failing criteria | "
          "throughput vs refs | cost vs refs | chip busy % | HBM peak MiB | with L4 goals |")
    print("|" + "---|" * 12)
    for r in rows:
        print(row(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
