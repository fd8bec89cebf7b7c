"""``refrun report``: the self-contained HTML comparison report of a candidate run.

Compares the candidate with the reference run(s), assesses it when ``--criteria`` is
given, writes one HTML file (plotly.js embedded unless ``--plotlyjs cdn|PATH``), records
the comparison as an MLflow run (or reuses ``--comparison-run``) and logs the report as
that run's artifact ``refrun/report.html``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.cli import add_tracking_uri
from refrun.comparison import CompareOptions, Comparison, compare, record_comparison
from refrun.errors import RefrunInputError
from refrun.identity import check_workloads
from refrun.report import ARTIFACT_REPORT, log_report, write_report
from refrun.report.downsample import DEFAULT_MAX_POINTS
from refrun.tracking import existing_store_uri


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write the HTML comparison report of a candidate run")
    p.add_argument("--reference", nargs="+", action="extend", required=True,
                   metavar="RUN_ID", help="reference run id(s); several = a group of seeds")
    p.add_argument("--candidate", required=True, metavar="RUN_ID", help="candidate run id")
    p.add_argument("--html", required=True, metavar="OUT", help="HTML file to write")
    p.add_argument("--criteria", default=None, metavar="FILE",
                   help="workload criteria (TOML): show levels L0-L4 and each criterion")
    p.add_argument("--plotlyjs", default="embed", metavar="embed|cdn|PATH",
                   help="embed plotly.js (default, offline) or reference it from the CDN "
                        "or a path/URL (smaller file, needs that file or network)")
    p.add_argument("--metrics", default=None,
                   help="comma-separated metric names (default: all common metrics)")
    p.add_argument("--keep", choices=("last", "first"), default=None,
                   help="value kept for a repeated step (default last; with --criteria "
                        "the file's [settings] decide)")
    p.add_argument("--interpolate", choices=("none", "candidate", "reference"),
                   default=None, help="interpolate one run onto the other's steps")
    p.add_argument("--axis", choices=("step", "samples", "tokens"), default=None,
                   help="align on steps, or on cumulative samples/tokens seen (default: step)")
    p.add_argument("--max-points", type=int, default=DEFAULT_MAX_POINTS,
                   help=f"most points drawn per trace (default {DEFAULT_MAX_POINTS}); "
                        "numbers always use every point")
    rec = p.add_mutually_exclusive_group()
    rec.add_argument("--comparison-run", default=None, metavar="RUN_ID",
                     help="log the report into this existing comparison run")
    rec.add_argument("--no-record", action="store_true",
                     help="record no comparison run and log no artifact")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="report on a candidate of another workload than the references' "
                        "(or the criteria file's); refused otherwise")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def _metrics(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [m.strip() for m in arg.split(",") if m.strip()]
    if not names:
        raise RefrunInputError("--metrics: no metric name given")
    return names


def _assess(args: argparse.Namespace, metrics: list[str] | None
            ) -> tuple[Comparison, Any]:
    """Compare with the criteria file's settings and assess (refrun.acceptance)."""
    if args.keep is not None or args.interpolate is not None or args.axis is not None:
        raise RefrunInputError("--keep/--interpolate/--axis: with --criteria the criteria file's "
                               "[settings] decide how runs are aligned")
    try:
        from refrun.acceptance.assess import assess, compare_options, load_for_assessment
        from refrun.acceptance.criteria import load_criteria
    except ImportError as exc:
        raise RefrunInputError(f"--criteria {args.criteria}: refrun.acceptance is not "
                               f"available ({exc})") from exc
    crit = load_criteria(args.criteria)
    refs, cand, latest = load_for_assessment(crit, args.reference, args.candidate,
                                             args.tracking_uri, args.allow_cross_workload)
    cmp = compare(refs, cand, metrics=metrics, options=compare_options(crit), progress=False)
    return cmp, assess(crit, refs, cand, latest, args.allow_cross_workload)


def _check_comparison_run(run_id: str, cmp: Comparison, uri: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        tags = MlflowClient(uri).get_run(run_id).data.tags
    except MlflowException as exc:
        raise RefrunInputError(f"--comparison-run {run_id!r}: not found in {uri}") from exc
    want = {schema.TAG_ROLE: "comparison",
            schema.TAG_COMPARED_REFERENCE: ",".join(cmp.reference_ids),
            schema.TAG_COMPARED_CANDIDATE: cmp.candidate.run_id}
    for tag, value in want.items():
        if tags.get(tag) != value:
            raise RefrunInputError(f"--comparison-run {run_id}: tag {tag} is "
                                   f"{tags.get(tag)!r}, expected {value!r}")


def run(args: argparse.Namespace) -> int:
    uri = existing_store_uri(args.tracking_uri)
    out = Path(args.html)
    if out.is_dir():
        raise RefrunInputError(f"--html {out}: is a directory")
    if args.max_points < 10:
        raise RefrunInputError(f"--max-points {args.max_points}: at least 10")
    metrics = _metrics(args.metrics)
    args.tracking_uri = uri
    assessment = None
    if args.criteria:
        cmp, assessment = _assess(args, metrics)
    else:
        options = CompareOptions(keep=args.keep or "last",
                                 interpolate=args.interpolate or "none",
                                 axis=args.axis or "step")
        cmp = compare(args.reference, args.candidate, metrics=metrics, options=options,
                      tracking_uri=uri, progress=sys.stderr.isatty())
        if note := check_workloads(cmp.candidate, cmp.reference,
                                   allow=args.allow_cross_workload):
            print(f"WARNING: {note}")
    run_id = None
    if args.comparison_run:
        _check_comparison_run(args.comparison_run, cmp, uri)
        run_id = args.comparison_run
    elif not args.no_record:
        run_id = record_comparison(cmp, tracking_uri=uri)
    path = write_report(cmp, out, assessment=assessment, plotlyjs=args.plotlyjs,
                        comparison_run_id=run_id, max_points=args.max_points)
    print(f"report written to {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if assessment is not None:
        print(f"acceptance: verdict {assessment.verdict}, highest level "
              f"{assessment.highest_level or 'none'}")
        for warning in assessment.warnings:  # e.g. cross-workload, unused backend scope
            print(f"WARNING: {warning}")
    if run_id:
        log_report(path, run_id, uri)
        print(f"comparison run: {run_id} (artifact {ARTIFACT_REPORT})")
    elif not args.no_record:
        print("comparison run: store unreachable, spooled for `refrun sync`; "
              "report not logged", file=sys.stderr)
    return 0
