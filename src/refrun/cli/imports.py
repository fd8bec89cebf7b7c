"""``refrun import {megatron,torchtitan,csv,tensorboard,mlperf} PATH``: existing curves as
new refrun runs.

The whole input is validated before any run is created (a bad metric name, step or value
is a one-line error naming the file and line, key or byte offset, exit 2, nothing
recorded); prints each new run id (one a line; a TensorBoard log directory holds one run
per directory of event files, in run-name order) once the runs are complete and FINISHED.
"""

from __future__ import annotations

import argparse
import sys

from refrun import schema
from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError
from refrun.importers.csv import parse_csv
from refrun.importers.curves import ImportedCurves
from refrun.importers.megatron import parse_megatron
from refrun.importers.record import create_run
from refrun.importers.torchtitan import parse_torchtitan

FORMATS = ("megatron", "torchtitan", "csv", "tensorboard", "mlperf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help="import reference curves (Megatron, torchtitan, CSV, TensorBoard, "
                       "MLPerf result logs)",
        description="Import existing curves as new refrun runs (backend 'import'). "
                    "megatron: golden-values JSON; torchtitan: 'STEP LOSS' lines; csv: a "
                    "step column and one column per metric; tensorboard: an event file or "
                    "a log directory (every run inside it, scalars by tag, wall time "
                    "kept); mlperf: an MLPerf Training result log (:::MLLOG lines: "
                    "eval accuracy by samples_count/epoch_num with progress/samples for "
                    "--axis samples, run start/stop and submission metadata as params).")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("path", help="the file to import (tensorboard: an event file or a log "
                                "directory)")
    p.add_argument("--workload", required=True)
    p.add_argument("--role", required=True, choices=schema.ROLES)
    p.add_argument("--hardware", required=True)
    p.add_argument("--metric", action="append", default=None, metavar="NAME",
                   help="torchtitan: name of the values (default loss); megatron/csv/"
                        "tensorboard: import only this metric or tag (repeatable)")
    p.add_argument("--rename", action="append", default=None, metavar="TAG=NAME",
                   help="tensorboard: record tag TAG as metric NAME (repeatable), e.g. "
                        "--rename train/loss=loss to compare with recorded runs")
    p.add_argument("--resumed", default=None, metavar="PATH",
                   help="megatron: the resumed second half (_2nd.json) of the same run")
    p.add_argument("--step-column", default="step", help="csv: name of the step column")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chips", type=int, default=None)
    p.add_argument("--run-name", default=None,
                   help="the run's name (tensorboard, several runs: prefix of each name)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def _rename(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        tag, sep, name = item.partition("=")
        if not sep or not tag or not name:
            raise RefrunInputError(f"--rename {item!r}: expected TAG=NAME")
        out[tag] = name
    return out


def parse_all(args: argparse.Namespace) -> list[tuple[str | None, ImportedCurves]]:
    """Every run the arguments name, validated (nothing is written): ``[(name, curves)]``
    where ``name`` is the TensorBoard run's directory (None for single-file formats)."""
    if args.rename is not None and args.format != "tensorboard":
        raise RefrunInputError("--rename: only for the tensorboard format")
    # Imported here: these two need the `importers` extra, the other formats do not.
    if args.format == "tensorboard":
        from refrun.importers.tensorboard import parse_tensorboard

        return list(parse_tensorboard(args.path, args.metric, _rename(args.rename)))
    if args.format == "mlperf":
        from refrun.importers.mlperf import parse_mlperf

        if args.metric:
            raise RefrunInputError("--metric: not for the mlperf format (every evaluation "
                                   "metric is imported)")
        return [(None, parse_mlperf(args.path))]
    return [(None, parse(args))]


def _global_batch(curves: ImportedCurves) -> int | None:
    if curves.format != "mlperf":
        return None
    from refrun.importers.mlperf import global_batch

    return global_batch(curves)


def parse(args: argparse.Namespace) -> ImportedCurves:
    """Validate the file(s) named by the arguments (nothing is written)."""
    if args.resumed is not None and args.format != "megatron":
        raise RefrunInputError("--resumed: only for the megatron format")
    if args.format in ("tensorboard", "mlperf"):
        runs = parse_all(args)
        if len(runs) != 1:
            raise RefrunInputError(f"{args.path}: {len(runs)} runs (one expected)")
        return runs[0][1]
    if args.format == "torchtitan":
        metric = args.metric[-1] if args.metric else schema.M_LOSS
        return parse_torchtitan(args.path, metric)
    if args.format == "megatron":
        return parse_megatron(args.path, args.resumed, args.metric)
    return parse_csv(args.path, args.step_column, args.metric)


def run(args: argparse.Namespace) -> int:
    if args.resumed is not None and args.format != "megatron":
        raise RefrunInputError("--resumed: only for the megatron format")
    runs = parse_all(args)
    for name, curves in runs:
        run_name = args.run_name
        if len(runs) > 1:  # TensorBoard runs: <run-name>/<run> or the run's directory
            run_name = f"{args.run_name}/{name}" if args.run_name else name
        run_id = create_run(curves, workload=args.workload, role=args.role,
                            hardware=args.hardware, seed=args.seed, chips=args.chips,
                            global_batch=_global_batch(curves), run_name=run_name,
                            tracking_uri=args.tracking_uri)
        if len(runs) > 1:
            print(f"refrun import: {name} -> {run_id} ({len(curves)} points)",
                  file=sys.stderr)
        print(run_id, flush=True)
    return 0
