"""Regenerate ``mlruns.example/``: a small MLflow store made by the digits pipeline.

    .venv/bin/python scripts/make_example_store.py            # ~1-2 min on 2 cores

Trains a reduced set of the pipeline's variants (``--quick`` steps) into a scratch store,
assesses every candidate against the reference seeds with the workload's criteria, records
the comparison runs with their reports, and copies the result to ``mlruns.example/``:

* ``mlruns.example/mlflow.db``: the sqlite backend store;
* ``mlruns.example/artifacts/<experiment id>/<run id>/artifacts/``: every run's artifacts.

Artifact locations in the database are made *relative* (``mlruns.example/artifacts/...``),
so the store works from any clone location when opened from the clone's root::

    .venv/bin/mlflow ui --backend-store-uri sqlite:///mlruns.example/mlflow.db --port 5000

(the server, and ``refrun``'s loaders with ``tracking_uri="sqlite:///mlruns.example/mlflow.db"``,
resolve a relative artifact location against the working directory).

To stay well under 10 MB: per-step metrics go to MLflow every 10th step (the curves
artifact, which comparisons read, keeps every point), and the logged reports load
plotly.js from its CDN instead of embedding it (4.8 MB each); ``make demo`` embeds it.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `pipelines` is a directory of the clone, not installed

from pipelines.demo import assess_all, init_store, table, train_all  # noqa: E402
from pipelines.digits.variants import Plan, plan  # noqa: E402

# The reduced set: the reference seeds, one benign candidate (another backend and chip
# count) and three defects caught at three different levels (L1 numerics, L2 execution
# integrity, L3 project goal).
CANDIDATES = ("jax-4dev", "jax-4dev-clip-per-device", "xla-host-sync", "jax-no-best-reload")
MLFLOW_EVERY = 10
MAX_BYTES = 10 * 2**20


def reduced_plan(names: tuple[str, ...] = CANDIDATES) -> Plan:
    """The pipeline's reference seeds and the named candidates, in the pipeline's order."""
    full = plan()
    by_name = {v.name: v for v in full.candidates}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(by_name)}")
    return Plan(full.references, [by_name[n] for n in names])


def local_dir(uri: str) -> Path:
    """The local directory of a ``file://`` URI or plain path."""
    parsed = urlparse(uri)
    return Path(url2pathname(parsed.path)) if parsed.scheme == "file" else Path(uri)


def relocate(db: Path, out: Path, prefix: str) -> None:
    """Copy every experiment's artifacts under ``out/artifacts/<experiment id>/`` and
    rewrite the database's artifact locations to ``<prefix>/artifacts/<experiment id>``
    (experiments) and ``<prefix>/artifacts/<experiment id>/<run id>/artifacts`` (runs):
    relative paths, resolved against the working directory of whoever opens the store."""
    con = sqlite3.connect(db)
    try:
        for exp_id, location in con.execute(
                "SELECT experiment_id, artifact_location FROM experiments").fetchall():
            src = local_dir(location)
            dst = out / "artifacts" / str(exp_id)
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True)
        con.execute("UPDATE experiments SET artifact_location = ? || experiment_id",
                    (f"{prefix}/artifacts/",))
        con.execute("UPDATE runs SET artifact_uri = ? || experiment_id || '/' || run_uuid "
                    "|| '/artifacts'", (f"{prefix}/artifacts/",))
        con.commit()
        con.execute("VACUUM")
    finally:
        con.close()


def check_relative(db: Path) -> None:
    """Fail when any artifact location in the store is still absolute."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT artifact_location FROM experiments UNION ALL "
                           "SELECT artifact_uri FROM runs").fetchall()
    finally:
        con.close()
    absolute = [r[0] for r in rows if r[0].startswith(("/", "file:"))]
    if absolute:
        raise SystemExit(f"{db}: absolute artifact locations left: {absolute[:3]}")


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "mlruns.example",
                    help="the store directory to (re)write (default: mlruns.example)")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at a time")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    try:
        prefix = out.relative_to(ROOT).as_posix()
    except ValueError:
        prefix = out.name  # outside the clone: open it from its parent directory
    t0 = time.perf_counter()
    p = reduced_plan()
    with tempfile.TemporaryDirectory(prefix="refrun-example-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work}/mlflow.db"
        init_store(uri)
        ids = train_all(p, quick=True, uri=uri, spool_dir=str(work / "spool"),
                        jobs=args.jobs, mlflow_every=MLFLOW_EVERY)
        outcomes = assess_all(p, ids, uri=uri, reports=work / "reports",
                              logged_plotlyjs="cdn")
        print("\n" + table(outcomes))
        if not all(o.as_intended for o in outcomes):
            print("a variant did not come out as intended: mlruns.example left unchanged")
            return 1
        staged = work / "store"
        staged.mkdir()
        shutil.copyfile(work / "mlflow.db", staged / "mlflow.db")
        relocate(staged / "mlflow.db", staged, prefix)
        check_relative(staged / "mlflow.db")
        size = size_of(staged)
        if size > MAX_BYTES:
            print(f"the store is {size / 2**20:.1f} MB (> {MAX_BYTES / 2**20:.0f} MB): "
                  "mlruns.example left unchanged")
            return 1
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
    print(f"\nwrote {out} ({size / 2**20:.2f} MB, {len(ids)} training runs + "
          f"{len(outcomes)} comparison runs) in {time.perf_counter() - t0:.0f} s")
    print(f"browse it from {out.parent}:\n  .venv/bin/mlflow ui --backend-store-uri "
          f"sqlite:///{prefix}/mlflow.db --port 5000")
    return 0


if __name__ == "__main__":
    sys.exit(main())
