"""``refrun import {megatron,torchtitan,csv} PATH``: existing curves as a new refrun run.

The whole file is validated before the run is created (a bad metric name, step or value
is a one-line error naming the file and line or key, exit 2, nothing recorded); prints
the new run id once the run is complete and FINISHED.
"""

from __future__ import annotations

import argparse

from refrun import schema
from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError
from refrun.importers.csv import parse_csv
from refrun.importers.curves import ImportedCurves
from refrun.importers.megatron import parse_megatron
from refrun.importers.record import create_run
from refrun.importers.torchtitan import parse_torchtitan

FORMATS = ("megatron", "torchtitan", "csv")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="import reference curves (Megatron, torchtitan, CSV)")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("path", help="the file to import")
    p.add_argument("--workload", required=True)
    p.add_argument("--role", required=True, choices=schema.ROLES)
    p.add_argument("--hardware", required=True)
    p.add_argument("--metric", action="append", default=None, metavar="NAME",
                   help="torchtitan: name of the values (default loss); megatron/csv: "
                        "import only this metric (repeatable)")
    p.add_argument("--resumed", default=None, metavar="PATH",
                   help="megatron: the resumed second half (_2nd.json) of the same run")
    p.add_argument("--step-column", default="step", help="csv: name of the step column")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chips", type=int, default=None)
    p.add_argument("--run-name", default=None)
    add_tracking_uri(p)
    p.set_defaults(func=run)


def parse(args: argparse.Namespace) -> ImportedCurves:
    """Validate the file(s) named by the arguments (nothing is written)."""
    if args.resumed is not None and args.format != "megatron":
        raise RefrunInputError("--resumed: only for the megatron format")
    if args.format == "torchtitan":
        metric = args.metric[-1] if args.metric else schema.M_LOSS
        return parse_torchtitan(args.path, metric)
    if args.format == "megatron":
        return parse_megatron(args.path, args.resumed, args.metric)
    return parse_csv(args.path, args.step_column, args.metric)


def run(args: argparse.Namespace) -> int:
    curves = parse(args)
    run_id = create_run(curves, workload=args.workload, role=args.role,
                        hardware=args.hardware, seed=args.seed, chips=args.chips,
                        run_name=args.run_name, tracking_uri=args.tracking_uri)
    print(run_id)
    return 0
