"""Benchmark: HTML report generation time, file size and time to render in Chromium.

Two reference seeds and a candidate x 5 metrics (loss, grad_norm, perf/step_time_s,
compile/graphs, sys/cpu_pct) at 10k, 100k and 1M steps, built in memory with
``RunData.from_curves`` (a reference group: the heaviest page - seed bands, ±kσ, z panels,
the all-metric picture and the timeline).  Targets (issues 8 and 16): for 1M steps the
report adds <= 1 MB to the embedded plotly.js and is generated in <= 5 s; the last column
says whether both hold.  Render time needs /usr/bin/chromium.

    .venv/bin/python benchmarks/bench_report.py [--steps 10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from plotly.offline import get_plotlyjs

from refrun.comparison import RunData, compare
from refrun.report import write_report

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def make_run(n: int, seed: int, role: str) -> RunData:
    rng = np.random.default_rng(seed)
    s = np.arange(n, dtype=np.int64)
    loss = 3 * np.exp(-s / (n / 5)) + 0.5 + rng.normal(0, 0.02, n)
    loss[rng.integers(0, n, 5)] += 2.0  # spikes the reduction must keep
    metrics = {
        "loss": loss,
        "grad_norm": np.abs(rng.normal(1, 0.2, n)),
        "perf/step_time_s": 0.1 + rng.gamma(2, 0.005, n),
        "compile/graphs": (rng.random(n) < 1e-4).astype(float),
        "sys/cpu_pct": 50 + 10 * np.sin(s / 500) + rng.normal(0, 1, n),
    }
    df = pd.concat([pd.DataFrame({"metric": k, "step": s, "value": v})
                    for k, v in metrics.items()], ignore_index=True)
    tags = {"refrun.workload": "bench", "refrun.role": role,
            "refrun.hardware": "h100" if role == "reference" else "tpu-v5e"}
    return RunData.from_curves(df, run_id=f"{role}-{seed}", tags=tags)


def render_seconds(path: Path) -> float | None:
    if not Path(CHROMIUM).exists():
        return None
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-rendered='true']", state="attached",
                               timeout=120_000)
        dt = time.perf_counter() - t0
        b.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="10000,100000,1000000")
    args = ap.parse_args()
    plotly_bytes = len(get_plotlyjs().encode("utf-8"))
    print(f"plotly.js embedded: {plotly_bytes / 1e6:.2f} MB")
    print(f"{'steps':>9} {'compare s':>10} {'report s':>9} {'file MB':>8} "
          f"{'beyond plotly.js MB':>20} {'cdn file MB':>12} {'render s':>9} "
          f"{'<=5 s and <=1 MB':>17}")
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        for n in [int(x) for x in args.steps.split(",")]:
            refs = [make_run(n, 0, "reference"), make_run(n, 1, "reference")]
            cand = make_run(n, 2, "candidate")
            t0 = time.perf_counter()
            cmp = compare(refs, cand, progress=False)
            t1 = time.perf_counter()
            path = write_report(cmp, Path(tmp) / f"r{n}.html")
            t2 = time.perf_counter()
            small = write_report(cmp, Path(tmp) / f"c{n}.html", plotlyjs="cdn")
            size = path.stat().st_size
            render = render_seconds(path)
            ok = (t2 - t1) <= 5.0 and size - plotly_bytes <= 1_000_000
            print(f"{n:>9} {t1 - t0:>10.2f} {t2 - t1:>9.2f} {size / 1e6:>8.2f} "
                  f"{(size - plotly_bytes) / 1e6:>20.3f} {small.stat().st_size / 1e6:>12.3f} "
                  f"{'n/a' if render is None else f'{render:.2f}':>9} "
                  f"{'yes' if ok else 'NO':>17}", flush=True)


if __name__ == "__main__":
    main()
