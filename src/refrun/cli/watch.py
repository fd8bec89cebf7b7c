"""``refrun watch --criteria FILE --run ID [--reference ID...]``: evaluate the criteria
file's stopping rules on a run in progress, every ``--every`` seconds, until it ends.

A triggered rule prints ``INVESTIGATE`` with its evidence; nothing is stopped or rejected.
Exit codes: 0 no rule triggered at the last check, 1 a rule says investigate, 2 bad input
(including a run of another workload than the criteria file's or the references', unless
``--allow-cross-workload``, the rule of ``refrun accept``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from refrun.acceptance.criteria import load_criteria
from refrun.acceptance.stopping import StopReport
from refrun.acceptance.watcher import watch_run
from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError
from refrun.store.uri import existing_store_uri
from refrun.util.outputs import check_output, write_output


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="evaluate stopping rules on a run in progress")
    p.add_argument("--criteria", required=True, type=Path, help="criteria file (TOML)")
    p.add_argument("--run", required=True, metavar="ID", help="the run being watched")
    p.add_argument("--reference", nargs="*", action="extend", default=[], metavar="ID",
                   help="reference run id(s) for smoke rules")
    p.add_argument("--every", type=float, default=60.0, metavar="S",
                   help="seconds between checks (default 60)")
    p.add_argument("--once", action="store_true", help="check once and exit")
    p.add_argument("--max-checks", type=int, default=None, metavar="N")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write the last report as JSON to OUT")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="watch a run of another workload than the criteria file's or the "
                        "references' (refused otherwise; the output says so)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    crit = load_criteria(args.criteria)
    if not crit.stopping:
        raise RefrunInputError(f"{args.criteria}: no [[stopping]] rules to evaluate")
    if args.every <= 0:
        raise RefrunInputError(f"--every {args.every}: must be > 0")
    if args.json is not None:  # before the run is watched
        check_output(args.json, "--json")
    uri = existing_store_uri(args.tracking_uri)

    def show(report: StopReport) -> None:
        print(report.text(), flush=True)

    report = watch_run(crit, args.run, args.reference, args.every,
                       1 if args.once else args.max_checks, uri, show,
                       args.allow_cross_workload, lambda note: print(f"note: {note}"))
    if args.json is not None:
        write_output(args.json, json.dumps(report.to_dict(), indent=1) + "\n", "--json")
    return 1 if report.investigate else 0
