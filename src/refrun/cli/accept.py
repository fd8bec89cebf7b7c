"""``refrun accept --criteria FILE --reference ID... --candidate ID``: assess a candidate
against a workload's criteria, level by level, and record the assessment.

Exit codes: 0 every criterion passed, 1 one failed or could not be evaluated, 2 bad usage
or input (nothing recorded).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from refrun import schema
from refrun.acceptance.alignment import with_axis
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.criteria import load_criteria
from refrun.acceptance.record import record_assessment
from refrun.cli import add_tracking_uri
from refrun.store.uri import existing_store_uri


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("accept", help="assess a candidate run against a criteria file (L0-L4)")
    p.add_argument("--criteria", required=True, type=Path, help="criteria file (TOML)")
    p.add_argument("--reference", required=True, nargs="+", action="extend", metavar="ID",
                   help="reference run id(s); several ids form a group of seeds")
    p.add_argument("--candidate", required=True, metavar="ID", help="candidate run id")
    p.add_argument("--axis", choices=schema.AXES, default=None,
                   help="align on steps or cumulative samples/tokens seen, when the criteria "
                        "file's [settings] axis does not say (a different one: exit 2)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write the full assessment as JSON to OUT")
    p.add_argument("--no-record", action="store_true",
                   help="do not record the assessment as a comparison run")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="assess a candidate of another workload than the criteria file's "
                        "or the references' (refused otherwise; the verdict says so)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def _hardware(uri: str, run_id: str) -> str | None:
    """The candidate's ``refrun.hardware`` tag, for the comparison run's identity."""
    from refrun.store.client import client as store_client

    return store_client(uri).get_run(run_id).data.tags.get(schema.TAG_HARDWARE)


def run(args: argparse.Namespace) -> int:
    crit = with_axis(load_criteria(args.criteria), args.axis)
    uri = existing_store_uri(args.tracking_uri)
    assessment, evidence = assess_ids(crit, args.reference, args.candidate, uri,
                                      args.allow_cross_workload)
    print(assessment.table())
    al = assessment.alignment
    print(f"aligned on {al.get('axis')} (from {al.get('source')})")
    for r in assessment.results:  # statistical criteria: the interval and its seeds
        if schema.EV_INTERVAL in r.evidence:
            lo, hi = r.evidence[schema.EV_INTERVAL]
            print(f"{r.id}: interval [{lo}, {hi}] from "
                  f"{r.evidence.get(schema.EV_N_REFERENCE)} reference seed(s)")
    if assessment.calibration_sha256:
        print(f"calibration sha256 {assessment.calibration_sha256}")
    if args.json is not None:
        assessment.write_json(args.json)
    if not args.no_record:
        run_id = record_assessment(assessment, crit, evidence, tracking_uri=uri,
                                   candidate_hardware=_hardware(uri, args.candidate))
        print(f"recorded on comparison run {run_id} "
              f"(evidence sha256 {assessment.evidence_sha256})")
    return assessment.exit_code
