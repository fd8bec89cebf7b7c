"""``refrun runs --workload W``: list a workload's runs with identity, status and step counts."""

from __future__ import annotations

import argparse

from refrun import schema
from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError
from refrun.store.runs import list_runs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="list the runs of a workload")
    p.add_argument("--workload", required=True, help="workload name (tag refrun.workload)")
    p.add_argument("--role", default=None, choices=schema.ROLES)
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    table = list_runs(args.workload, role=args.role, tracking_uri=args.tracking_uri)
    if table.empty:
        raise RefrunInputError(f"--workload {args.workload!r}: no runs found")
    print(table.to_string(index=False))
    return 0
