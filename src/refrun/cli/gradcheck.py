"""``refrun gradcheck --self-test``: show that each gradient check rejects its defect.

Runs :func:`refrun.gradcheck.selftest.run_self_test` and prints, per check, whether the
correct workload passes and which mutations were caught.  Exit 0 when every baseline
passes and every mutation is caught, 1 otherwise.  ``--tracking-uri`` also records the
outcome as a ``gradcheck`` run.
"""

from __future__ import annotations

import argparse
import json
import sys

from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gradcheck", help="gradient checks: prove the gate rejects its defects")
    p.add_argument("--self-test", action="store_true",
                   help="run every check against mutated copies of reference workloads")
    p.add_argument("--only", action="append", default=[], metavar="CASE",
                   help="run only this self-test case (repeatable): oracle-jax, oracle-torch, "
                        "fd-ebm, fd-torch, parity-mlp, update-delta-clipping")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.add_argument("--workload", default="refrun-gradcheck-selftest",
                   help="workload name when recording (with --tracking-uri)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.self_test:
        raise RefrunInputError("nothing to do: use --self-test (checks on your own code run "
                               "from Python or pytest; see docs/gradcheck.md)")
    from refrun.gradcheck.selftest import CASES, run_self_test

    names = {c.name for c in CASES}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        raise RefrunInputError(f"--only {unknown[0]!r}: no such case ({', '.join(sorted(names))})")
    gates = run_self_test(tuple(args.only))
    ok = all(g.passed for g in gates)
    if args.json:
        print(json.dumps({"passed": ok, "checks": [
            {"check": g.check, "baseline_passed": g.baseline_passed,
             "baseline": g.baseline_detail,
             "mutations": [{"mutation": o.mutation, "caught": o.caught, "detail": o.detail}
                           for o in g.outcomes]} for g in gates]}, indent=1))
    else:
        for g in gates:
            print(g.summary())
        caught = sum(o.caught for g in gates for o in g.outcomes)
        total = sum(len(g.outcomes) for g in gates)
        print(f"\n{caught}/{total} mutations caught; "
              f"{sum(g.baseline_passed for g in gates)}/{len(gates)} baselines pass: "
              f"{'OK' if ok else 'GATE FAILED'}")
    if args.tracking_uri:
        from refrun.gradcheck.record import record_gradcheck

        run_id = record_gradcheck(gates, workload=args.workload, tracking_uri=args.tracking_uri)
        print(f"recorded gradcheck run {run_id}", file=sys.stderr)
    return 0 if ok else 1
