"""Seconds each importer takes to answer each file of the hostile corpus (issue 55).

The corpus is tests/test_edges_importers.py's (deep nesting, numbers out of a float's
range, /dev/zero and a named pipe, a byte-order mark, duplicate keys, truncation, 100,000
columns).  Each file is handed to a fresh ``python -m refrun import`` process (start-up
included, as a user sees it) against one sqlite store made beforehand; the table prints
the exit code, the wall time and whether it is within the 5 s target.  The suite asserts
what happens to each file; this script shows how fast.

    PYTHONPATH=src:. python benchmarks/bench_import_hostile.py [--only csv-wide ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 5.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, metavar="FORMAT-CASE",
                    help="cases to run, e.g. csv-wide (default: every case)")
    args = ap.parse_args()
    from tests.test_edges_importers import CORPUS  # the suite's corpus, one definition

    root = Path(tempfile.mkdtemp(prefix="refrun-bench-hostile-"))
    uri = f"sqlite:///{root}/mlflow.db"
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).search_experiments()  # created and migrated outside the timings
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for (fmt, case), (content, _expected) in sorted(CORPUS.items()):
        label = f"{fmt}-{case}"
        if args.only and label not in args.only:
            continue
        work = root / label
        work.mkdir()
        if callable(content):
            path = content(work)
        else:
            path = work / ("events.out.tfevents.1.host" if fmt == "tensorboard" else "in")
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "refrun", "import", fmt, str(path),
                               "--workload", f"bench-{label}", "--role", "reference",
                               "--hardware", "cpu", "--tracking-uri", uri],
                              capture_output=True, text=True, env=env, timeout=600)
        rows.append((label, done.returncode, time.perf_counter() - t0))
    print(f"{'file':<28} {'exit':>4} {'seconds':>8}  within {TARGET_S:g} s")
    for label, rc, s in rows:
        print(f"{label:<28} {rc:>4} {s:>8.2f}  {'yes' if s <= TARGET_S else 'NO'}")
    worst = max((s for _, _, s in rows), default=0.0)
    print(f"slowest: {worst:.2f} s over {len(rows)} files")
    return 0 if worst <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
