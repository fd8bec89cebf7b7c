"""One-off (fifteenth session): the goal-throughput result of every TPU run in an
``assess.py`` store, with its contention figures and its CPU bound (``cpu_rate_bound``).

    PYTHONPATH=src PJRT_DEVICE=CPU .venv/bin/python \\
        benchmarks/tpu/results/fifteenth/throughput_reasons.py /tmp/aN
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path[:0] = ["benchmarks/tpu", "benchmarks", "."]

import assess as tpu_assess  # noqa: E402

from refrun.acceptance.assess import assess_ids  # noqa: E402
from refrun.acceptance.criteria import load_criteria  # noqa: E402

det = tpu_assess.det


def main(store: Path) -> None:
    uri = f"sqlite:///{store / 'tpu-assess.db'}"
    for name in ("digits", "charlm", "markov"):
        w = det.WORKLOADS[name](0)
        ids = det.ids_from_store(replace(w, candidates=[], held_out=[]), uri, missing_ok=True)
        ref_ids = [ids[v.name] for v in w.references]
        group = ref_ids[: det.group_size(store / f"{w.name}.toml", len(ref_ids))]
        tpu = tpu_assess.tpu_ids(uri, w.name)
        goals = load_criteria(store / f"{w.name}-l4-goals.toml")
        for v in tpu_assess.plan.plan(name):
            if v.kind == "evidence" or v.name not in tpu:
                continue
            a, _ = assess_ids(goals, group, tpu[v.name], uri)
            r = next((x for x in a.results if x.id == "goal-throughput"), None)
            if r is None:
                print(name, v.name, "no goal-throughput")
                continue
            b = r.evidence.get("cpu_rate_bound")
            cont = r.evidence.get("contention") or {}
            bound = None if b is None else (b["usable"], b.get("ratio_bound"),
                                            b.get("inflation_bounds"), b.get("why"))
            print(f"{name:7s} {v.name:38s} {r.outcome:14s} "
                  f"ratio={r.evidence.get('ratio', float('nan')):.3f} "
                  f"refs_busier={cont.get('references_busier')} "
                  f"ref_others={cont.get('reference_cores')} bound={bound}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
