"""``refrun compare``: a candidate against one or more reference runs, as a table and JSON.

Prints a readable table (one row per metric, then step time and counters), writes the
documented JSON with ``--json OUT`` and records the comparison as an MLflow run (role
``comparison``) unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import json
import sys

import pandas as pd

from refrun.cli import add_tracking_uri
from refrun.comparison.engine import CompareOptions, Comparison, compare
from refrun.comparison.record import record_comparison
from refrun.errors import RefrunInputError
from refrun.identity import check_workloads
from refrun.schema import AXES
from refrun.util.outputs import check_output, write_output


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare a candidate run with reference run(s)")
    p.add_argument("--reference", action="extend", nargs="+", required=True,
                   metavar="RUN_ID",
                   help="reference run id(s); several (or repeated) = a group of seeds")
    p.add_argument("--candidate", required=True, metavar="RUN_ID", help="candidate run id")
    p.add_argument("--metrics", default=None, help="comma-separated metric names "
                   "(default: every metric present in all runs)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the JSON result here")
    p.add_argument("--keep", choices=("last", "first"), default="last",
                   help="value kept for a step written more than once (default: last)")
    p.add_argument("--interpolate", choices=("none", "candidate", "reference"),
                   default="none", help="interpolate one run onto the other's steps")
    p.add_argument("--axis", choices=AXES, default="step",
                   help="align on steps, or on cumulative samples/tokens seen (default: step)")
    p.add_argument("--final-fraction", type=float, default=0.1,
                   help="final window: the last fraction of aligned steps (default 0.1)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps skipped for step time and counters (default: first 10%%)")
    p.add_argument("--no-record", action="store_true",
                   help="do not record the comparison as an MLflow run")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="compare a candidate of another workload than the references' "
                        "(refused otherwise; the table and JSON say so)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    metrics = None
    if args.metrics is not None:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        if not metrics:
            raise RefrunInputError("--metrics: no metric name given")
    if args.json:  # before anything is read or recorded
        check_output(args.json, "--json")
    options = CompareOptions(keep=args.keep, interpolate=args.interpolate, axis=args.axis,
                             final_fraction=args.final_fraction,
                             warmup_steps=args.warmup_steps)
    cmp = compare(args.reference, args.candidate, metrics=metrics, options=options,
                  tracking_uri=args.tracking_uri, progress=sys.stderr.isatty())
    note = check_workloads(cmp.candidate, cmp.reference, allow=args.allow_cross_workload)
    print(format_table(cmp) + (f"\nWARNING: {note}" if note else ""))
    if args.json:
        out = cmp.write_json(args.json)
        if note:  # the JSON says so too
            write_output(out, json.dumps({**json.loads(out.read_text()),
                                          "cross_workload": note}, indent=1) + "\n", "--json")
        print(f"\nJSON written to {out}")
    if not args.no_record:
        run_id = record_comparison(cmp, tracking_uri=args.tracking_uri)
        print(f"comparison run: {run_id}")
    return 0


def format_table(cmp: Comparison) -> str:
    """The terminal table: runs, per-metric measures, then step time / counters / notes."""
    lines = [f"reference: {r.run_id} ({r.status}; points from {r.points_from})"
             for r in cmp.reference]
    c = cmp.candidate
    lines += [f"candidate: {c.run_id} ({c.status}; points from {c.points_from})", ""]
    with pd.option_context("display.width", 200, "display.max_columns", 50,
                           "display.float_format", "{:.6g}".format):
        lines.append(cmp.summary().to_string(index=False))
        extra = []
        for name, m in cmp.metrics.items():
            if m.step_time is not None:
                st = m.step_time
                extra.append(f"{name}: median reference {st.reference_median} s, candidate "
                             f"{st.candidate_median} s, ratio {st.ratio} (steps >= "
                             f"{st.warmup_end_step})")
            if m.counters is not None:
                c = m.counters
                extra.append(f"{name}: total reference {c.reference_total:g}, candidate "
                             f"{c.candidate_total:g}; after warm-up (steps >= "
                             f"{c.warmup_end_step}) reference {c.reference_after_warmup:g}, "
                             f"candidate {c.candidate_after_warmup:g}")
            extra += [f"{name}: {n}" for n in m.alignment.notes]
        if extra:
            lines += ["", *extra]
    if cmp.metrics_only_in_reference:
        lines.append(f"only in reference: {', '.join(cmp.metrics_only_in_reference)}")
    if cmp.metrics_only_in_candidate:
        lines.append(f"only in candidate: {', '.join(cmp.metrics_only_in_candidate)}")
    lines += [f"skipped {k}: {v}" for k, v in cmp.skipped.items()]
    return "\n".join(lines)
