"""``refrun report``: the self-contained HTML comparison report of one or more candidates.

Compares each candidate with the reference run(s), assesses it when ``--criteria`` is
given, writes one HTML file (plotly.js embedded unless ``--plotlyjs cdn|PATH``; with
several candidates it opens with the candidates x criteria matrix, also written as JSON
with ``--json``), records each comparison as an MLflow run (or reuses
``--comparison-run``), tags it with the report's summary and logs the page as that run's
artifact ``refrun/report.html``.  Output paths are checked before anything is compared
or recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from refrun import schema
from refrun.cli import add_tracking_uri
from refrun.comparison import CompareOptions, Comparison, compare, record_comparison
from refrun.errors import RefrunInputError
from refrun.identity import check_workloads
from refrun.report import ARTIFACT_REPORT, Candidate, PageBuilder, log_report, write_html
from refrun.report.assessment import assessment_dict
from refrun.report.downsample import DEFAULT_MAX_POINTS
from refrun.report.mlflow_summary import log_summary
from refrun.report.overview import Departure
from refrun.store.uri import existing_store_uri
from refrun.util.outputs import check_output


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write the HTML comparison report of a candidate run")
    p.add_argument("--reference", nargs="+", action="extend", required=True,
                   metavar="RUN_ID", help="reference run id(s); several = a group of seeds")
    p.add_argument("--candidate", required=True, nargs="+", action="extend",
                   metavar="RUN_ID", help="candidate run id(s); several = one page with a "
                                          "candidates x criteria matrix")
    p.add_argument("--html", required=True, metavar="OUT", help="HTML file to write")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the candidates x criteria matrix (and ranked "
                        "departures) as JSON")
    p.add_argument("--redact-path", action="append", default=[], metavar="PREFIX",
                   help="remove this path prefix from the page and the JSON (repeatable; "
                        "e.g. the checkout and home directory, for a report that travels)")
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
    p.add_argument("--axis", choices=schema.AXES, default=None,
                   help="align on steps, or on cumulative samples/tokens seen (default: step)")
    p.add_argument("--max-points", type=int, default=None,
                   help=f"most points drawn per trace (default {DEFAULT_MAX_POINTS}, fewer "
                        "on a page of many candidates: sweep_max_points); numbers always "
                        "use every point")
    rec = p.add_mutually_exclusive_group()
    rec.add_argument("--comparison-run", default=None, metavar="RUN_ID",
                     help="log the report into this existing comparison run")
    rec.add_argument("--no-record", action="store_true",
                     help="record no comparison run and log no artifact")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="report on a candidate of another workload than the references' "
                        "(or the criteria file's); refused otherwise")
    p.add_argument("--mlflow-ui", default=None, metavar="URL",
                   help="address of the MLflow UI on this store, e.g. http://127.0.0.1:5000: "
                        "each comparison run is linked to its page there (default: the "
                        "tracking URI when it is an http(s) server)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def _metrics(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [m.strip() for m in arg.split(",") if m.strip()]
    if not names:
        raise RefrunInputError("--metrics: no metric name given")
    return names


def _assess(args: argparse.Namespace, candidate: str, metrics: list[str] | None
            ) -> tuple[Comparison, Any]:
    """Compare with the criteria file's settings and assess (refrun.acceptance)."""
    if args.keep is not None or args.interpolate is not None or args.axis is not None:
        raise RefrunInputError("--keep/--interpolate/--axis: with --criteria the criteria file's "
                               "[settings] decide how runs are aligned")
    try:
        from refrun.acceptance.assess import (
            assess,
            compare_options,
            load_candidate,
            load_references,
            pair_for,
        )
        from refrun.acceptance.criteria import load_criteria
    except ImportError as exc:
        raise RefrunInputError(f"--criteria {args.criteria}: refrun.acceptance is not "
                               f"available ({exc})") from exc
    crit = load_criteria(args.criteria)
    if candidate in args.reference:
        raise RefrunInputError(f"--candidate {candidate}: also given as a reference")
    # The references are loaded once for every candidate of the page: each comparison
    # shares the same runs (and their resolved series) instead of holding its own copy.
    if getattr(args, "loaded_references", None) is None:
        args.loaded_references = load_references(args.reference, args.tracking_uri)
    loaded = args.loaded_references
    refs = loaded.runs
    cand, latest = load_candidate(crit, loaded, candidate, args.tracking_uri,
                                  args.allow_cross_workload)
    cmp = compare(refs, cand, metrics=metrics, options=compare_options(crit), progress=False)
    # The pair (and a precision twin) looked up as refrun accept does, so the page's
    # outcomes are accept's.
    pair = pair_for(crit, cand, refs, args.tracking_uri, latest)
    assessment = assess(crit, refs, cand, latest, args.allow_cross_workload, pair=pair)
    return cmp, with_calibration(assessment.to_dict(), crit)


def with_calibration(assessment: dict[str, Any], crit: Any) -> dict[str, Any]:
    """The assessment dict plus the criteria file's ``[calibration]`` table and each
    criterion's calibration data (the report's calibration provenance table)."""
    import dataclasses

    cal = getattr(crit, "calibration", None)
    if cal is None:
        return assessment
    table = dataclasses.asdict(cal) if dataclasses.is_dataclass(cal) else dict(cal)
    per = {c.id: c.calibration for c in crit.criteria if getattr(c, "calibration", None)}
    return {**assessment, "calibration": {**table, "criteria": per} if per else table}


def _check_comparison_run(run_id: str, cmp: Comparison, uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from refrun.store.client import client as store_client

    try:
        tags = store_client(uri).get_run(run_id).data.tags
    except MlflowException as exc:
        raise RefrunInputError(f"--comparison-run {run_id!r}: not found in {uri}") from exc
    want = {schema.TAG_ROLE: "comparison",
            schema.TAG_COMPARED_REFERENCE: ",".join(cmp.reference_ids),
            schema.TAG_COMPARED_CANDIDATE: cmp.candidate.run_id}
    for tag, value in want.items():
        if tags.get(tag) != value:
            raise RefrunInputError(f"--comparison-run {run_id}: tag {tag} is "
                                   f"{tags.get(tag)!r}, expected {value!r}")


def _compare(args: argparse.Namespace, candidate: str, metrics: list[str] | None
             ) -> tuple[Comparison, Any]:
    if args.criteria:
        return _assess(args, candidate, metrics)
    options = CompareOptions(keep=args.keep or "last", interpolate=args.interpolate or "none",
                             axis=args.axis or "step")
    if getattr(args, "reference_runs", None) is None:  # loaded once for every candidate
        from refrun.comparison import load_run

        args.reference_runs = [load_run(r, tracking_uri=args.tracking_uri,
                                        progress=sys.stderr.isatty())
                               for r in args.reference]
    cmp = compare(args.reference_runs, candidate, metrics=metrics, options=options,
                  tracking_uri=args.tracking_uri, progress=sys.stderr.isatty())
    if note := check_workloads(cmp.candidate, cmp.reference, allow=args.allow_cross_workload):
        print(f"WARNING: {note}")
    return cmp, None


def _describe_assessed(run_id: str, assessment: dict[str, Any], uri: str) -> None:
    """Name the comparison run ``accept <candidate> vs N refs: <verdict>`` and put the
    verdict and failing criteria in its description, like `refrun accept`'s run."""
    from refrun.store import mlflow_ui
    from refrun.store.client import client as store_client

    results = assessment.get("results") or []
    verdict = mlflow_ui.Verdict(
        str(assessment.get("verdict")), assessment.get("highest_level"),
        tuple((r["id"], r.get("reason", "")) for r in results if r.get("outcome") == "fail"),
        tuple(r["id"] for r in results if r.get("outcome") == "not_evaluable"))
    mlflow_ui.describe_comparison(store_client(uri), run_id, "accept", verdict)


def run(args: argparse.Namespace) -> int:
    # Every output is checked before anything is compared or recorded: a report that
    # cannot be written must not leave a comparison run behind.
    out = check_output(args.html, "--html")
    json_out = check_output(args.json, "--json") if args.json else None
    if json_out is not None and json_out == out:
        raise RefrunInputError(f"--json {args.json}: the same file as --html")
    if args.max_points is None:
        args.max_points = sweep_max_points(len(args.candidate))
    if args.max_points < 10:
        raise RefrunInputError(f"--max-points {args.max_points}: at least 10")
    if args.comparison_run and len(args.candidate) > 1:
        raise RefrunInputError("--comparison-run: only with a single --candidate")
    if len(set(args.candidate)) != len(args.candidate):
        raise RefrunInputError("--candidate: a run id is given twice")
    uri = existing_store_uri(args.tracking_uri)
    metrics = _metrics(args.metrics)
    args.tracking_uri = uri
    ui = ui_base(args.mlflow_ui, uri)
    # One candidate at a time: compared, recorded, rendered into the page's parts, then
    # its aligned data dropped; peak memory is the references plus one candidate,
    # however many candidates the page has.
    builder = PageBuilder(multi=len(args.candidate) > 1, max_points=args.max_points)
    recorded: list[tuple[str | None, dict[str, Any] | None]] = []
    for candidate in args.candidate:
        cmp, assessment = _compare(args, candidate, metrics)
        run_id = None
        if args.comparison_run:
            _check_comparison_run(args.comparison_run, cmp, uri)
            run_id = args.comparison_run
        elif not args.no_record:
            run_id = record_comparison(cmp, tracking_uri=uri)
            if assessment is not None:  # named and described as `refrun accept` does
                _describe_assessed(run_id, assessment, uri)
        builder.add(Candidate(cmp, assessment, run_id,
                              comparison_url(ui, run_id, uri) if run_id else None))
        recorded.append((run_id, assessment))
        del cmp
    rep = builder.build(plotlyjs=args.plotlyjs, redact_paths=args.redact_path)
    path, matrix = write_html(rep.html, out), rep.matrix
    print(f"report written to {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if json_out is not None:
        write_json(json_out, matrix)
        print(f"matrix written to {json_out}")
    for (run_id, assessment), row in zip(recorded, matrix["candidates"], strict=True):
        if assessment is not None:
            print(f"acceptance {row['candidate']}: verdict {assessment['verdict']}, "
                  f"highest level {assessment['highest_level'] or 'none'}")
            for warning in assessment.get("warnings", []):  # to act on: cross-workload ...
                print(f"WARNING: {warning}")
        if run_id:
            log_report(path, run_id, uri)
            deps = [Departure(**d) for d in row["departures"]]
            log_summary(run_id, uri, deps, assessment_dict(assessment))
            print(f"comparison run: {run_id} (artifact {ARTIFACT_REPORT})")
    return 0


def sweep_max_points(n_candidates: int) -> int:
    """Default points drawn per trace for a page of ``n_candidates``: the single-candidate
    default up to 8 candidates, then scaled down so the figure data of the page stays
    about that of 8 candidates (never under 400 points: minmax reduction keeps every
    bucket's extremes, so a spike stays visible).  A page of 100 candidates x 100k steps
    was ~40 MB at 2,400 points a trace."""
    if n_candidates <= 8:
        return DEFAULT_MAX_POINTS
    return max(400, DEFAULT_MAX_POINTS * 8 // n_candidates)


def ui_base(arg: str | None, uri: str) -> str | None:
    """The MLflow UI's address: ``--mlflow-ui``, else the tracking server's (an http(s)
    tracking URI serves the UI too), else None (a database store has no UI address)."""
    base = arg or (uri if uri.startswith(("http://", "https://")) else None)
    if arg is not None and not arg.startswith(("http://", "https://")):
        raise RefrunInputError(f"--mlflow-ui {arg}: not an http(s) address")
    return base.rstrip("/") if base else None


def comparison_url(base: str | None, run_id: str, uri: str) -> str | None:
    """The comparison run's page in the MLflow UI at ``base`` (None without one)."""
    if base is None:
        return None
    from refrun.store import mlflow_ui
    from refrun.store.client import client as store_client

    exp = store_client(uri).get_run(run_id).info.experiment_id
    return f"{base}/{mlflow_ui.run_link(exp, run_id)}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (non-finite numbers as null), written atomically."""
    from refrun.util.jsonsafe import json_safe
    from refrun.util.outputs import write_output

    write_output(path, json.dumps(json_safe(data), indent=1, allow_nan=False) + "\n",
                 "--json")
