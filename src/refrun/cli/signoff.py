"""``refrun signoff --comparison ID --decision accept|reject --by NAME`` and
``refrun verify ID``: record a sign-off of an assessment, and check later that nothing it
vouched for changed.

``verify`` exits 0 when runs, criteria and evidence are unchanged, 1 when something
changed (each change is listed), 2 on bad input (e.g. the comparison is not signed off).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

from refrun.acceptance.signoff import DECISIONS, sign_off, signed_by, verify
from refrun.cli import add_tracking_uri
from refrun.errors import RefrunInputError
from refrun.util.outputs import OutputRefused, check_output, write_output
from refrun.util.printable import escape

T = TypeVar("T")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("signoff", help="record a sign-off of a recorded assessment")
    p.add_argument("--comparison", required=True, metavar="ID",
                   help="comparison run id printed by `refrun accept`")
    p.add_argument("--decision", required=True, choices=DECISIONS)
    p.add_argument("--by", default=None, metavar="NAME",
                   help="who signs off; required when the tracking store does not "
                        "authenticate users (recorded as 'unauthenticated'); with MLflow's "
                        "authentication the authenticated user is recorded and NAME is only "
                        "kept beside it")
    p.add_argument("--note", default="", help="free text kept with the sign-off")
    p.add_argument("--override", action="store_true",
                   help="required to accept an assessment that did not pass (recorded)")
    add_tracking_uri(p)
    p.set_defaults(func=run_signoff)

    v = sub.add_parser("verify", help="check that a signed-off assessment is unchanged")
    v.add_argument("comparison", metavar="ID", help="comparison run id")
    v.add_argument("--criteria", type=Path, default=None,
                   help="also check that this criteria file is the one signed")
    v.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write the verification as JSON to OUT")
    add_tracking_uri(v)
    v.set_defaults(func=run_verify)


def _recorded(comparison: str, call: Callable[[], T]) -> T:
    """``call()``; an error from the recorded artifacts' content that their checks
    (:func:`refrun.acceptance.record.load_recorded`) let through is one line naming the
    comparison run, exit 2 (a damaged artifact is never a crash or a verdict)."""
    try:
        return call()
    except (RefrunInputError, OutputRefused):
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
        raise RefrunInputError(
            f"comparison run {comparison}: its recorded artifacts are not in the form "
            f"refrun writes ({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); "
            "damaged or edited") from exc


def run_signoff(args: argparse.Namespace) -> int:
    so = _recorded(args.comparison, lambda: sign_off(
        args.comparison, args.decision, args.by, args.note, args.override,
        args.tracking_uri))
    # The name may come from the server (its authenticated user): escaped like verify's.
    print(f"signed off {escape(so.comparison_id)}: {signed_by(asdict(so))}"
          + (" (override of a failed assessment)" if so.override else ""))
    print(f"evidence sha256 {so.evidence_sha256}; criteria sha256 {so.criteria_sha256}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    if args.json is not None:  # before anything is read
        check_output(args.json, "--json")
    result = _recorded(args.comparison,
                       lambda: verify(args.comparison, args.tracking_uri, args.criteria))
    print(result.text())
    if args.json is not None:
        write_output(args.json, json.dumps({**asdict(result), "ok": result.ok}, indent=1)
                     + "\n", "--json")
    return 0 if result.ok else 1
