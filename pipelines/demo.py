"""The main job: reference seeds, migrated candidates and silent defects of one real
workload, recorded, compared, assessed and reported.

    make demo            # or: .venv/bin/python -m pipelines.demo [--quick] [--jobs 2]

1. trains every variant of :mod:`pipelines.digits.variants` (one subprocess each, so JAX's
   device count and PJRT's device are set before the framework loads), recording into the
   default store (``sqlite:///mlflow.db`` in the working directory, or
   ``$MLFLOW_TRACKING_URI``);
2. assesses every candidate against the reference seeds with
   ``pipelines/criteria/digits.toml`` (``refrun.acceptance``), records the assessment as a
   comparison run, and writes an HTML report per candidate (``refrun.report``);
3. prints a table: candidate, what it mirrors, highest level reached, failing criteria
   and their evidence, and whether that is what the variant was built to show;
4. ends with the command that opens the MLflow UI on the store and where the reports are.

Exit code 0 when every defect failed its intended criterion and no benign candidate
failed any; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.digits.variants import Plan, Variant, plan
from refrun.store.uri import resolve_tracking_uri

if TYPE_CHECKING:
    from refrun.acceptance.criteria import CriteriaFile

CRITERIA = Path(__file__).parent / "criteria" / "digits.toml"
# Calibrated on --quick reference seeds: thresholds hold for the run length they were
# measured on (a 400-step run is another configuration than a 600-step one).
CRITERIA_QUICK = Path(__file__).parent / "criteria" / "digits-quick.toml"
EXPERIMENT = "digits-mlp"  # the workload name: refrun.start_run's default experiment
_RUN_ID = re.compile(r"\] run ([0-9a-f]{32}) ")
_print_lock = threading.Lock()


@dataclass
class Outcome:
    """One candidate's assessment, as the table shows it."""

    variant: Variant
    run_id: str
    highest_level: str
    verdict: str
    failing: list[tuple[str, str]] = field(default_factory=list)  # (criterion id, reason)
    not_evaluable: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)  # scoped to other backends
    report: Path | None = None

    @property
    def as_intended(self) -> bool:
        """A defect fails every criterion it was built to trip; a benign run fails none."""
        failed = {cid for cid, _ in self.failing}
        if self.variant.kind == "defect":
            return set(self.variant.expect) <= failed
        return not failed


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def train(v: Variant, *, quick: bool, uri: str, spool_dir: str | None,
          mlflow_every: int = 1) -> str:
    """Run one variant's training process, echoing its progress; returns its run id."""
    t0 = time.perf_counter()
    say(f"> {v.name:<26} {v.backend:<9} seed {v.seed}  {v.mirrors}")
    proc = subprocess.Popen(v.command(quick=quick, tracking_uri=uri, spool_dir=spool_dir,
                                      mlflow_every=mlflow_every),
                            env=v.environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_id, tail = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-30:], line]
        if line.startswith(f"  [{v.name}]"):
            say(line)
        m = _RUN_ID.search(line)
        if m:
            run_id = m.group(1)
    rc = proc.wait()
    if rc != 0 or run_id is None:
        raise RuntimeError(f"variant {v.name} failed (exit {rc}):\n" + "\n".join(tail))
    say(f"< {v.name:<26} done in {time.perf_counter() - t0:.0f} s (run {run_id})")
    return run_id


def train_all(p: Plan, *, quick: bool, uri: str, spool_dir: str | None, jobs: int,
              mlflow_every: int = 1) -> dict[str, str]:
    """Run id of every variant; ``jobs`` training processes at a time."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {v.name: pool.submit(train, v, quick=quick, uri=uri, spool_dir=spool_dir,
                                       mlflow_every=mlflow_every)
                   for v in p.all}
        return {name: f.result() for name, f in futures.items()}


def assess_all(p: Plan, ids: dict[str, str], *, uri: str, reports: Path,
               criteria: Path = CRITERIA, logged_plotlyjs: str = "embed") -> list[Outcome]:
    """Assess, record and report every candidate against the reference group.

    Two copies of each report: ``reports/<candidate>.html`` loads one shared
    ``reports/plotly.min.js`` (13 pages stay small on disk), and the copy logged as the
    comparison run's artifact ``refrun/report.html`` has plotly.js as ``logged_plotlyjs``
    says: ``"embed"`` (default; ~4.8 MB, it opens standalone in the MLflow UI's artifact
    view, where no sibling file is reachable) or ``"cdn"`` (small; draws with network).
    """
    from refrun.acceptance.criteria import load_criteria

    crit = load_criteria(criteria)
    ref_ids = [ids[v.name] for v in p.references]
    reports.mkdir(parents=True, exist_ok=True)
    plotly = _plotly_file(reports)
    out = []
    with _in_process_delivery():
        for v in p.candidates:
            out.append(_assess_one(v, crit, ref_ids, ids[v.name], uri=uri, reports=reports,
                                   plotly=plotly, logged_plotlyjs=logged_plotlyjs))
    return out


@contextlib.contextmanager
def _in_process_delivery():
    """Deliver the comparison runs from this process (``REFRUN_DELIVERY=thread``) while
    the block runs: they protect no training loop, and a delivery process per comparison
    run would cost a Python start and a wait at each close."""
    old = os.environ.get("REFRUN_DELIVERY")
    os.environ["REFRUN_DELIVERY"] = "thread"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("REFRUN_DELIVERY", None)
        else:
            os.environ["REFRUN_DELIVERY"] = old


def _assess_one(v: Variant, crit: CriteriaFile, ref_ids: list[str], cand_id: str, *,
                uri: str, reports: Path, plotly: Path, logged_plotlyjs: str) -> Outcome:
    """Assess one candidate, record the comparison run, write and log its report."""
    from refrun.acceptance.assess import assess, load_for_assessment, run_comparison
    from refrun.acceptance.evidence import build_evidence
    from refrun.acceptance.record import record_assessment
    from refrun.report import log_report, write_report

    refs, cand, latest = load_for_assessment(crit, ref_ids, cand_id, uri)
    a = assess(crit, refs, cand, latest)
    evidence = build_evidence(crit.sha256, a.results, refs, cand, latest)
    cmp_run = record_assessment(a, crit, evidence, tracking_uri=uri,
                                candidate_hardware=cand.hardware)
    comparison, _ = run_comparison(crit, refs, cand)
    report = None
    if comparison is not None:
        kw = {"assessment": a, "comparison_run_id": cmp_run,
              "title": f"digits-mlp: reference seeds vs {v.name}"}
        report = write_report(comparison, reports / f"{v.name}.html",
                              plotlyjs=plotly.name, **kw)
        with tempfile.TemporaryDirectory(prefix="refrun-demo-") as tmp:
            logged = write_report(comparison, Path(tmp) / "report.html",
                                  plotlyjs=logged_plotlyjs, **kw)
            log_report(logged, cmp_run, uri)
    o = Outcome(v, cand_id, a.highest_level or "none", a.verdict,
                [(r.id, r.reason) for r in a.results if r.outcome == "fail"],
                [r.id for r in a.results if r.outcome == "not_evaluable"],
                [r.id for r in a.results if r.outcome == "not_applicable"], report)
    say(f"  assessed {v.name:<26} highest level {o.highest_level:<4} "
        f"{'as intended' if o.as_intended else 'NOT AS INTENDED'}")
    return o


def _plotly_file(reports: Path) -> Path:
    """plotly.js written once next to the reports (each page loads it by relative path)."""
    from plotly.offline import get_plotlyjs

    path = reports / "plotly.min.js"
    if not path.exists():
        path.write_text(get_plotlyjs(), encoding="utf-8")
    return path


def ids_from_store(p: Plan, uri: str) -> dict[str, str]:
    """The newest finished run of each variant (tag ``pipeline.variant``) in the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        raise SystemExit(f"{uri}: no digits-mlp experiment; run the demo without --assess-only")
    ids = {}
    for v in p.all:
        runs = client.search_runs([exp.experiment_id],
                                  f"tags.`pipeline.variant` = '{v.name}' and "
                                  "attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"{uri}: no finished run of variant {v.name}")
        ids[v.name] = runs[0].info.run_id
    return ids


def init_store(uri: str, experiment: str = EXPERIMENT) -> None:
    """Create the store's tables and the workload's experiment once, before parallel
    training processes would race to create them (sqlite schema creation is not safe from
    two processes at once).

    For a sqlite store the experiment's artifacts go next to the database file
    (``<db dir>/mlruns/<experiment>``), not into ``./mlruns`` of whatever directory the
    demo was started from: a store given as ``--tracking-uri sqlite:////tmp/x/mlflow.db``
    then keeps everything under ``/tmp/x``.
    """
    from mlflow.tracking import MlflowClient

    from refrun.store.client import ensure_experiment

    client = MlflowClient(uri)
    client.search_experiments(max_results=1)
    db = sqlite_path(uri)
    if db is not None and client.get_experiment_by_name(experiment) is None:
        location = (db.parent / "mlruns" / experiment).resolve()
        try:
            client.create_experiment(experiment, artifact_location=location.as_uri())
        except Exception:  # created meanwhile by another process: keep its location
            ensure_experiment(client, experiment)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative to the working directory with
    three slashes, absolute with four), None for any other store."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix):]) if uri.startswith(prefix) else None


def table(outcomes: list[Outcome]) -> str:
    """The result table: one block per candidate, failing criteria with their evidence."""
    lines = [f"{'candidate':<26} {'kind':<7} {'level':<5} {'verdict':<10} "
             f"{'as intended':<11} failing criteria (evidence)", "-" * 110]
    for o in outcomes:
        v = o.variant
        first = o.failing[0] if o.failing else ("-", "")
        lines.append(f"{v.name:<26} {v.kind:<7} {o.highest_level:<5} {o.verdict:<10} "
                     f"{'yes' if o.as_intended else 'NO':<11} {first[0]}"
                     + (f": {first[1]}" if first[1] else ""))
        for cid, reason in o.failing[1:]:
            lines.append(f"{'':<63}{cid}: {reason}")
        lines.append(f"{'':<4}mirrors: {v.mirrors}"
                     + (f"; expected to fail: {', '.join(v.expect)}" if v.expect else ""))
        if o.not_evaluable:
            lines.append(f"{'':<4}not evaluable (evidence missing): "
                         f"{', '.join(o.not_evaluable)}")
        if o.not_applicable:
            lines.append(f"{'':<4}not applicable to backend {v.backend}: "
                         f"{', '.join(o.not_applicable)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps ([quick] in config.toml)")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at a time")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--spool-dir", default=None)
    ap.add_argument("--reports", default="refrun-reports", help="directory of HTML reports")
    ap.add_argument("--assess-only", action="store_true",
                    help="train nothing: assess the newest run of each variant in the store")
    args = ap.parse_args(argv)
    uri = resolve_tracking_uri(args.tracking_uri)
    p = plan()
    t0 = time.perf_counter()
    print(f"refrun demo: {len(p.references)} reference seeds + {len(p.candidates)} "
          f"candidates of the digits MLP, recorded into {uri}", flush=True)
    init_store(uri)
    if args.assess_only:
        ids = ids_from_store(p, uri)
    else:
        ids = train_all(p, quick=args.quick, uri=uri, spool_dir=args.spool_dir,
                        jobs=args.jobs)
    print(f"\ntrained {len(ids)} runs in {time.perf_counter() - t0:.0f} s; assessing with "
          f"{CRITERIA.relative_to(Path(__file__).parent.parent)}", flush=True)
    reports = Path(args.reports).absolute()
    outcomes = assess_all(p, ids, uri=uri, reports=reports,
                          criteria=CRITERIA_QUICK if args.quick else CRITERIA)
    print("\n" + table(outcomes))
    ok = all(o.as_intended for o in outcomes)
    n_def = sum(o.variant.kind == "defect" for o in outcomes)
    caught = sum(o.variant.kind == "defect" and o.as_intended for o in outcomes)
    benign_ok = sum(o.variant.kind == "benign" and o.as_intended for o in outcomes)
    n_ben = len(outcomes) - n_def
    print(f"\n{caught}/{n_def} silent defects caught by their intended criteria; "
          f"{benign_ok}/{n_ben} benign candidates passed every criterion "
          f"({time.perf_counter() - t0:.0f} s in all)")
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    print(f"\n  reports:    {reports}/<candidate>.html (also artifact refrun/report.html of "
          "each comparison run)")
    print(f"  MLflow UI:  {mlflow_bin} ui --backend-store-uri {shlex.quote(uri)} --port 5000")
    print("              then open http://127.0.0.1:5000, switch the sidebar to 'Model "
          "training' and open\n              experiment 'digits-mlp' (docs/report.md, "
          "'In the MLflow UI')")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
