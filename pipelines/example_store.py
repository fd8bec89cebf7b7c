"""The content digest of ``mlruns.example/``: what makes the committed store stale.

The store is made by ``scripts/make_example_store.py`` (training the pipeline's reduced
plan, then assessing and reporting every candidate).  Training takes minutes; everything
after it -- the comparison runs, their names, descriptions, tags and params, the reports
-- is a deterministic function of the stored training runs and the current code.  So
freshness is decided on a *description* (:func:`describe`), never on timestamps or bytes:

* ``generator``: the generator's inputs -- the reduced plan (each variant's name, kind,
  backend, flags and the criteria it must trip), ``MLFLOW_EVERY`` and the SHA-256 of the
  criteria file;
* ``training_runs``, per variant: run name; its description as the *current*
  ``refrun.store.mlflow_ui.run_description`` writes it from the stored tags; the sorted names of
  its tags, params and MLflow metrics (values left out: times, hosts, ids; ``sys/`` samples
  left out of the MLflow metrics, where which of them land on a kept step depends on the
  machine's speed) and of the metrics in its curves artifact (every one it recorded);
* ``comparison_runs``, per candidate: run name, description, verdict, highest level,
  failing criteria, the level tags, the sorted names of its tags, params and metrics, and
  its report's structure: every heading, every table header cell in order, and the
  first five rows of the "which signals depart" ranking.

Run ids are replaced by ``<variant>`` (training runs) or ``<cmp:variant>`` (comparison
runs) wherever they appear, so two stores made from the same inputs describe alike.

Saved views' share keys (a hash of the run ids a view shows) are replaced too.

The generator writes ``DESCRIPTION.json`` (the description) and ``DIGEST`` (its SHA-256)
into the store.  ``tests/test_example_store_fresh.py`` checks it two ways and fails,
printing the differing entries:

* a copy of the committed store *re-assessed by the current code* (training skipped,
  ~30 s of assessment and reports) must describe exactly as committed;
* a store *made anew* by the generator in a scratch directory (~1 min of training on 2
  cores) must record what the committed one does: every training run's names and curves,
  each candidate's acceptance and report structure.  This is what catches a change of
  what the training records (a probe's new metric).  Measured values (the comparison
  runs' descriptions, the report's ranking) are compared by the first check only: they
  are exact on the committed runs, and a store trained on another CPU may differ in the
  last digits.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DESCRIPTION = "DESCRIPTION.json"
DIGEST = "DIGEST"
RANKED_ROWS = 5
_RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")
# A saved view's key is a hash of the run ids it shows (``comparison_view_id``).
_VIEW_KEY = re.compile(r"viewStateShareKey=refrun-[0-9a-f]+")
# Tags whose values differ between two stores made from the same inputs.
_VOLATILE = ("refrun.local_id", "refrun.acceptance.evidence_sha256", "refrun.version")


def digest(description: Mapping[str, Any]) -> str:
    """SHA-256 of the description's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write(store: Path, description: Mapping[str, Any]) -> str:
    """Write ``DESCRIPTION.json`` and ``DIGEST`` into ``store``; returns the digest."""
    d = digest(description)
    (store / DESCRIPTION).write_text(json.dumps(description, indent=1, sort_keys=True,
                                                ensure_ascii=False) + "\n", encoding="utf-8")
    (store / DIGEST).write_text(d + "\n", encoding="utf-8")
    return d


def generator_inputs() -> dict[str, Any]:
    """What the generator is told to make (``scripts/make_example_store.py``)."""
    import importlib.util

    from pipelines.demo import CRITERIA_QUICK

    spec = importlib.util.spec_from_file_location(
        "make_example_store", Path(__file__).resolve().parent.parent / "scripts"
        / "make_example_store.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    p = gen.reduced_plan()
    return {
        "variants": [_variant(v) for v in p.all],
        "mlflow_every": gen.MLFLOW_EVERY,
        "criteria_sha256": hashlib.sha256(CRITERIA_QUICK.read_bytes()).hexdigest(),
    }


def _variant(v: Any) -> dict[str, Any]:
    fields = getattr(v, "__dataclass_fields__", {})
    return {k: _plain(getattr(v, k)) for k in sorted(fields)}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return str(x)


def _rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def _by_run(db: Path, table: str) -> dict[str, dict[str, Any]]:
    """run id -> {key: value} of MLflow's ``tags``, ``params`` or ``latest_metrics``."""
    out: dict[str, dict[str, Any]] = {}
    for run, key, value in _rows(db, f"SELECT run_uuid, key, value FROM {table}"):
        out.setdefault(run, {})[key] = value
    return out


def report_structure(html: str) -> dict[str, Any]:
    """Headings, table header cells (in order) and the ranking's first rows of a report."""
    def text(s: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", s)).strip()

    headings = [text(h) for h in re.findall(r"<h[1-4][^>]*>(.*?)</h[1-4]>", html, re.S)]
    headers = [text(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", html, re.S)]
    ranked: list[str] = []
    i = html.find("Which signals depart")
    if i >= 0:
        end = html.find("</table>", i)
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", html[i:end], re.S):
            cells = [text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            if len(cells) > 1:
                ranked.append(cells[1])
    return {"headings": headings, "table_headers": headers, "ranked": ranked[:RANKED_ROWS]}


def describe(store: Path, training: Mapping[str, str], comparisons: Mapping[str, str]
             ) -> dict[str, Any]:
    """The description of the store at ``store`` (its ``mlflow.db`` and ``artifacts/``):
    ``training`` maps variant -> training run id, ``comparisons`` candidate variant ->
    comparison run id."""
    from refrun import schema
    from refrun.store import mlflow_ui

    db = store / "mlflow.db"
    tags = _by_run(db, "tags")
    params = _by_run(db, "params")
    metrics = _by_run(db, "latest_metrics")
    names = dict(_rows(db, "SELECT run_uuid, name FROM runs"))
    where = dict(_rows(db, "SELECT run_uuid, experiment_id FROM runs"))
    placeholder = {rid: v for v, rid in training.items()}
    placeholder |= {rid: f"cmp:{v}" for v, rid in comparisons.items()}

    def norm(s: str) -> str:
        s = _VIEW_KEY.sub("viewStateShareKey=<view of these runs>", s)
        return _RUN_ID.sub(lambda m: f"<{placeholder.get(m.group(0), 'run')}>", s)

    def keys(run: str) -> dict[str, list[str]]:
        return {"tags": sorted(tags.get(run, {})), "params": sorted(params.get(run, {})),
                "metrics": sorted(metrics.get(run, {}))}

    out_train = {}
    for variant, rid in sorted(training.items()):
        t = tags[rid]
        k = keys(rid)
        # System samples are taken every few seconds, so which of them land on a step the
        # store keeps in MLflow (every MLFLOW_EVERY-th) depends on the machine's speed;
        # the curves artifact, which keeps every point, says which were recorded.
        k["metrics"] = [m for m in k["metrics"] if not m.startswith(schema.SYS_PREFIX)]
        curves = store / "artifacts" / str(where[rid]) / rid / "artifacts" \
            / schema.ARTIFACT_CURVES
        out_train[variant] = {"name": names[rid],
                              "description": norm(mlflow_ui.run_description(t)), **k,
                              "curves": curve_names(curves)}
    out_cmp = {}
    for variant, rid in sorted(comparisons.items()):
        t = tags[rid]
        report = (store / "artifacts" / str(where[rid]) / rid / "artifacts"
                  / schema.ARTIFACT_REPORT)
        out_cmp[variant] = {
            "name": norm(names[rid]),
            "description": norm(t.get(schema.TAG_NOTE, "")),
            "acceptance": {k: norm(v) for k, v in sorted(t.items())
                           if k.startswith("refrun.acceptance.") and k not in _VOLATILE},
            **keys(rid),
            "report": report_structure(report.read_text(encoding="utf-8"))
            if report.exists() else None,
        }
    return {"generator": generator_inputs(), "training_runs": out_train,
            "comparison_runs": out_cmp}


def curve_names(path: Path) -> list[str] | None:
    """The sorted metric names of a run's curves artifact (every metric it recorded, at
    every point), None when the run has none."""
    if not path.exists():
        return None
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return sorted(pc.unique(pq.read_table(path, columns=["metric"])["metric"]).to_pylist())


def training_ids(store: Path) -> dict[str, str]:
    """variant -> run id of the store's training runs (tag ``pipeline.variant``)."""
    rows = _rows(store / "mlflow.db", "SELECT t.run_uuid, t.value FROM tags t JOIN tags r "
                 "ON t.run_uuid = r.run_uuid WHERE t.key = 'pipeline.variant' AND "
                 "r.key = 'refrun.role' AND r.value != 'comparison'")
    return {v: rid for rid, v in rows}


def comparison_ids(store: Path, training: Mapping[str, str]) -> dict[str, str]:
    """candidate variant -> the newest comparison run of it in the store."""
    by_id = {rid: v for v, rid in training.items()}
    rows = _rows(store / "mlflow.db", "SELECT t.run_uuid, t.value, r.start_time FROM tags t "
                 "JOIN runs r ON r.run_uuid = t.run_uuid WHERE t.key = ? "
                 "ORDER BY r.start_time", "refrun.compared.candidate")
    out: dict[str, str] = {}
    for rid, cand, _ in rows:
        if cand in by_id:
            out[by_id[cand]] = rid  # later rows win: the newest comparison
    return out


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two descriptions differ (``path: committed != current``), for a readable
    failure."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and a != b and \
            all(isinstance(x, str) for x in a + b):
        gone = [x for x in a if x not in b]
        new = [x for x in b if x not in a]
        if gone or new:
            return [f"{path}: only in the committed store {gone}, only in the current "
                    f"code's {new}"]
        return [f"{path}: same items, another order: {a} != {b}"]
    if a != b:
        return [f"{path}: {json.dumps(a)[:300]} != {json.dumps(b)[:300]}"]
    return []


def execute_notebook(notebook: Path, root: Path, scratch: Path, timeout: int = 240) -> Any:
    """Execute ``notebook`` top to bottom against the store under ``root`` (the directory
    holding ``mlruns.example/``) with this interpreter as its kernel, returning the
    executed ``nbformat`` node; raises ``nbclient``'s ``CellExecutionError`` on the first
    failing cell.  Jupyter's and IPython's directories (and the kernelspec) live under
    ``scratch``: nothing is written to the home directory or the repository."""
    import os
    import sys

    import nbformat
    from nbclient import NotebookClient

    name = "refrun-venv"
    spec = scratch / "jupyter" / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "refrun venv", "language": "python"}))
    env = {"JUPYTER_PATH": "jupyter", "JUPYTER_RUNTIME_DIR": "runtime",
           "JUPYTER_DATA_DIR": "data", "JUPYTER_CONFIG_DIR": "config",
           "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "mpl"}
    old = {k: os.environ.get(k) for k in [*env, "REFRUN_EXAMPLE_ROOT", "MLFLOW_TRACKING_URI"]}
    os.environ.update({k: str(scratch / v) for k, v in env.items()})
    os.environ["REFRUN_EXAMPLE_ROOT"] = str(root)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        nb = nbformat.read(notebook, as_version=4)
        NotebookClient(nb, timeout=timeout, kernel_name=name,
                       resources={"metadata": {"path": str(root)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (refrun .venv)",
                                 "language": "python", "name": "python3"}
    return nb
