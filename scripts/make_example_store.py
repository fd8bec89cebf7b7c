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

To stay under 12 MB: per-step metrics go to MLflow every 10th step (the curves artifact,
which comparisons read, keeps every point), and plotly.js (4.8 MB) is stored ONCE, as
``mlruns.example/plotly.min.js``, instead of embedded in every report (``make demo``
embeds it).  Each logged report loads that copy by a relative path, so it draws offline
when opened from the store (``mlruns.example/artifacts/<exp>/<run>/artifacts/refrun/
report.html`` in a browser); in the MLflow UI's artifact view, where a page cannot reach
a sibling file (MLflow shows it from a ``blob:`` URL), it falls back to plotly's CDN.

``--trained DIR`` skips the training: ``DIR`` holds the reduced plan's runs trained by
:func:`train_reduced` (``mlflow.db`` and ``mlruns/``, what it leaves in its directory), and
a copy of it is assessed and staged as above.  The test suite trains them once per session
into its cached build (tests/builds.py), which the freshness test and the pipeline's tests
read alike.

Freshness: the store carries ``DESCRIPTION.json`` and ``DIGEST``, the deterministic
content that matters (run names, descriptions, acceptance tags, tag/param/metric names,
each report's structure) and its SHA-256 (``pipelines/example_store.py``);
``tests/test_example_store_fresh.py`` fails when the current code would produce another.

No path of the machine that made the store stays in it: the criteria file is named
relative to the clone, and every text artifact (``environment.json``,
``assessment.json``, the reports) has the clone root, the scratch directory, the Python
installation and the home directory replaced (``<clone>``-relative, ``<scratch>``,
``<python>``, ``~``); the result is then searched byte for byte -- database included --
and the store is left unchanged if any remains.
"""

from __future__ import annotations

import argparse
import os
import re
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

from pipelines import example_store  # noqa: E402
from pipelines.demo import CRITERIA_QUICK, assess_all, init_store, table, train_all  # noqa: E402
from pipelines.digits.variants import Plan, plan  # noqa: E402

# The reduced set: the reference seeds, one benign candidate (another backend and chip
# count) and three defects caught at three different levels (L1 numerics, L2 execution
# integrity, L3 project goal).
CANDIDATES = ("jax-4dev", "jax-4dev-clip-per-device", "xla-host-sync", "jax-no-best-reload")
MLFLOW_EVERY = 10
MAX_BYTES = 12 * 2**20
NOTEBOOK = ROOT / "notebooks" / "explore.ipynb"
PLOTLY_NAME = "plotly.min.js"
# From <store>/artifacts/<exp>/<run>/artifacts/refrun/report.html up to <store>/.
PLOTLY_FROM_REPORT = "../../../../../" + PLOTLY_NAME
TEXT_SUFFIXES = (".json", ".html", ".toml", ".txt", ".yaml", ".md", ".csv")
# Never rewritten: digests cover these files byte for byte (the sign-off's evidence, the
# criteria file's exact bytes).
UNTOUCHABLE = ("evidence.json", "criteria.toml")


def reduced_plan(names: tuple[str, ...] = CANDIDATES) -> Plan:
    """The pipeline's reference seeds and the named candidates, in the pipeline's order."""
    full = plan()
    by_name = {v.name: v for v in full.candidates}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(by_name)}")
    return Plan(full.references, [by_name[n] for n in names])


def train_reduced(work: Path, jobs: int) -> dict[str, str]:
    """Train the reduced plan (``--quick``, MLflow every ``MLFLOW_EVERY``-th step) into a
    new store in ``work``: ``mlflow.db``, the artifacts under ``mlruns/`` (init_store puts
    them next to the database), the spool under ``spool/``.  Returns variant -> run id."""
    uri = f"sqlite:///{work}/mlflow.db"
    init_store(uri)
    return train_all(reduced_plan(), quick=True, uri=uri, spool_dir=str(work / "spool"),
                     jobs=jobs, mlflow_every=MLFLOW_EVERY)


def copy_trained(src: Path, work: Path) -> None:
    """Copy the store :func:`train_reduced` left in ``src`` into ``work`` (its database and
    ``mlruns/``), the artifact locations rewritten to the copy: what ``work`` holds after
    :func:`train_reduced` there."""
    shutil.copyfile(src / "mlflow.db", work / "mlflow.db")
    if (src / "mlruns").is_dir():
        shutil.copytree(src / "mlruns", work / "mlruns")
    old, new = src.resolve(), work.resolve()
    con = sqlite3.connect(work / "mlflow.db")
    try:
        # file:// URIs first (init_store's locations), then plain paths (MLflow's default
        # experiment); neither form of ``new`` contains ``old``.
        for a, b in ((old.as_uri(), new.as_uri()), (str(old), str(new))):
            con.execute("UPDATE experiments SET artifact_location = "
                        "replace(artifact_location, ?, ?)", (a, b))
            con.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?)", (a, b))
        con.commit()
    finally:
        con.close()


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


def machine_paths(work: Path, *scratch: Path) -> dict[str, str]:
    """Paths of this machine that may leak into a store, each with what replaces it,
    longest first (a path inside another is replaced before its parent).  ``scratch``:
    other directories the runs were made in (``--trained``), replaced like ``work``."""
    found = {str(d): "<scratch>" for w in (work, *scratch) for d in (w, w.resolve())}
    found |= {str(ROOT) + os.sep: "", str(ROOT): ".",
              sys.prefix: "<python>", sys.base_prefix: "<python>",
              str(Path.home()): "~"}
    return dict(sorted(((k, v) for k, v in found.items() if len(k) > 1),
                       key=lambda kv: -len(kv[0])))


def scrub(store: Path, paths: dict[str, str]) -> list[Path]:
    """Replace ``paths`` in every text artifact under ``store`` (not the signed evidence);
    returns the files changed."""
    changed = []
    for f in sorted(store.rglob("*")):
        if not f.is_file() or f.suffix not in TEXT_SUFFIXES or f.name in UNTOUCHABLE:
            continue
        text = original = f.read_text(encoding="utf-8")
        for path, repl in paths.items():
            text = text.replace(path, repl)
        if text != original:
            f.write_text(text, encoding="utf-8")
            changed.append(f)
    return changed


def leaks(store: Path, paths: dict[str, str]) -> list[str]:
    """``file: path`` for every machine path still found, byte for byte, in any file."""
    needles = [p.encode() for p in paths if len(p) > 1 and p != os.sep]
    return [f"{f.relative_to(store)}: {n.decode()}" for f in sorted(store.rglob("*"))
            if f.is_file() for n in needles if n in f.read_bytes()]


_PLOTLY_TAG = re.compile(r'<script type="text/javascript" charset="utf-8" src="'
                         + re.escape(PLOTLY_FROM_REPORT) + r'"></script>')


def with_cdn_fallback(html: str, cdn_url: str) -> str:
    """The report loading plotly.js from the store's copy, then -- where that file cannot
    be reached (MLflow's artifact view) -- from ``cdn_url``, before the page draws."""
    tag, n = _PLOTLY_TAG.subn(lambda m: m.group(0) + (
        '<script type="text/javascript">window.Plotly||document.write('
        f"'<script type=\"text/javascript\" src=\"{cdn_url}\"><\\/script>');</script>"),
        html, count=1)
    if n != 1:
        raise SystemExit("a report does not load plotly.js from the store's copy")
    return tag


def add_fallbacks(store: Path) -> int:
    from plotly.offline import get_plotlyjs_version

    cdn = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
    reports = sorted(store.rglob("refrun/report.html"))
    for f in reports:
        f.write_text(with_cdn_fallback(f.read_text(encoding="utf-8"), cdn), encoding="utf-8")
    return len(reports)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "mlruns.example",
                    help="the store directory to (re)write (default: mlruns.example)")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at a time")
    ap.add_argument("--no-notebook", dest="notebook", action="store_false",
                    help="do not re-execute notebooks/explore.ipynb on the new store")
    ap.add_argument("--trained", type=Path, metavar="DIR", default=None,
                    help="assess a copy of the reduced plan's runs that train_reduced left "
                         "in DIR (mlflow.db, mlruns/) instead of training them again")
    args = ap.parse_args(argv)
    if args.trained is not None and not (args.trained / "mlflow.db").is_file():
        ap.error(f"--trained {args.trained}: no mlflow.db there")
    out = args.out.resolve()
    try:
        prefix = out.relative_to(ROOT).as_posix()
    except ValueError:
        prefix = out.name  # outside the clone: open it from its parent directory
    t0 = time.perf_counter()
    p = reduced_plan()
    os.chdir(ROOT)  # the criteria file is then recorded by its path in the clone
    with tempfile.TemporaryDirectory(prefix="refrun-example-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work}/mlflow.db"
        scratch: tuple[Path, ...] = ()
        if args.trained is None:
            ids = train_reduced(work, args.jobs)
        else:
            copy_trained(args.trained, work)
            scratch = (args.trained,)
            ids = example_store.training_ids(work)
            if sorted(ids) != sorted(v.name for v in p.all):
                ap.error(f"--trained {args.trained}: its training runs are {sorted(ids)}, "
                         f"not the reduced plan's {sorted(v.name for v in p.all)}")
        outcomes = assess_all(p, ids, uri=uri, reports=work / "reports",
                              criteria=CRITERIA_QUICK.relative_to(ROOT),
                              logged_plotlyjs=PLOTLY_FROM_REPORT)
        print("\n" + table(outcomes))
        if not all(o.as_intended for o in outcomes):
            print("a variant did not come out as intended: mlruns.example left unchanged")
            return 1
        staged = work / "store"
        staged.mkdir()
        shutil.copyfile(work / "mlflow.db", staged / "mlflow.db")
        relocate(staged / "mlflow.db", staged, prefix)
        check_relative(staged / "mlflow.db")
        shutil.copyfile(work / "reports" / PLOTLY_NAME, staged / PLOTLY_NAME)
        print(f"reports drawing from the store's {PLOTLY_NAME}: {add_fallbacks(staged)}")
        paths = machine_paths(work, *scratch)
        print(f"machine paths replaced in {len(scrub(staged, paths))} files")
        # after the scrub (it describes what is committed), before the leak check
        description = example_store.describe(
            staged, ids, example_store.comparison_ids(staged, ids))
        print(f"content digest {example_store.write(staged, description)} "
              f"({example_store.DESCRIPTION}, {example_store.DIGEST})")
        left = leaks(staged, paths)
        if left:
            print("machine paths left in the store: mlruns.example left unchanged\n  "
                  + "\n  ".join(left[:10]))
            return 1
        size = size_of(staged)
        if size > MAX_BYTES:
            print(f"the store is {size / 2**20:.1f} MB (> {MAX_BYTES / 2**20:.0f} MB): "
                  "mlruns.example left unchanged")
            return 1
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
        if args.notebook and out == ROOT / "mlruns.example":
            # The notebook's committed outputs (tables, plots as PNG) come from this store.
            import nbformat

            nb = example_store.execute_notebook(NOTEBOOK, ROOT, work / "nb")
            nbformat.write(nb, NOTEBOOK)
            print(f"executed {NOTEBOOK.relative_to(ROOT)} on the new store (outputs saved)")
    print(f"\nwrote {out} ({size / 2**20:.2f} MB, {len(ids)} training runs + "
          f"{len(outcomes)} comparison runs) in {time.perf_counter() - t0:.0f} s")
    print(f"browse it from {out.parent}:\n  .venv/bin/mlflow ui --backend-store-uri "
          f"sqlite:///{prefix}/mlflow.db --port 5000")
    return 0


if __name__ == "__main__":
    sys.exit(main())
