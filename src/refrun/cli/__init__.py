"""The ``refrun`` command line.

Each sub-command lives in its own module of this package with ``register(subparsers)``;
:data:`COMMANDS` lists them in the order ``refrun --help`` shows.  Exit codes: 0 success,
1 a negative result (e.g. an acceptance criterion failed), 2 bad usage or input (one line
on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from refrun._version import __version__
from refrun.errors import RefrunInputError

COMMANDS = (
    "runs",
    "sync",
    "compare",
    "imports",
    "gradcheck",
    "report",
    "accept",
    "watch",
    "signoff",
    "calibrate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refrun",
        description="Record, compare and accept ML training runs moved to other hardware.",
    )
    parser.add_argument("--version", action="version", version=f"refrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"refrun.cli.{name.replace('-', '_')}").register(sub)
    return parser


def add_tracking_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    # MLflow announces database migrations on INFO; a CLI's stderr is for its own errors.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RefrunInputError as exc:
        print(f"refrun {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refrun: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
