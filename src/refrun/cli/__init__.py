"""The ``refrun`` command line.

Each sub-command lives in its own module of this package with ``register(subparsers)``.
:data:`COMMANDS` maps every sub-command name to that module and its one-line help, in the
order ``refrun --help`` shows them.  Only the module of the command being run is imported:
``refrun --help`` and ``refrun --version`` never import MLflow, pandas or a framework, so
they answer in a fraction of a second (benchmarks/bench_import.py measures it).

Adding a sub-command is one line in :data:`COMMANDS` (a module may register several
names, e.g. ``signoff`` and ``verify``).  Commands listed in :data:`READS_RUNS` get the
``--wait SECONDS`` option: how long to wait for a run that is still being recorded
before refusing it (see :mod:`refrun.comparison.loading`).

Exit codes (docs/reliability.md, "Exit codes"): 0 success, 1 a negative result only (the
candidate failed a criterion, a verified assessment changed, a gradient check missed a
defect, a stopping rule fired, a calibration did not validate), 2 anything else: bad usage
or input, a broken or missing artifact, an unusable store, and an error refrun did not
foresee (a bug): one line on stderr naming the file, run or store, never a traceback
(``REFRUN_TRACEBACK=1`` prints it for a bug report).  Python's own exit code for an
uncaught exception is 1, which would read as "the candidate failed".
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from refrun._version import __version__
from refrun.errors import RefrunInputError
from refrun.util.outputs import OutputRefused

# name -> (module, help).  One line per sub-command; keep the help in step with the
# module's own ``add_parser(..., help=...)`` (tests/test_comparison_cli.py checks both).
COMMANDS: dict[str, tuple[str, str]] = {
    "runs": ("refrun.cli.runs", "list the runs of a workload"),
    "sync": ("refrun.cli.sync", "deliver spooled points to the tracking store"),
    "merge": ("refrun.cli.merge", "copy the runs of one store into another"),
    "compare": ("refrun.cli.compare", "compare a candidate run with reference run(s)"),
    "import": ("refrun.cli.imports", "import reference curves (Megatron, torchtitan, CSV, "
                                     "TensorBoard, MLPerf result logs)"),
    "gradcheck": ("refrun.cli.gradcheck",
                  "gradient checks: prove the gate rejects its defects"),
    "report": ("refrun.cli.report", "write the HTML comparison report of a candidate run"),
    "accept": ("refrun.cli.accept",
               "assess a candidate run against a criteria file (L0-L4)"),
    "watch": ("refrun.cli.watch", "evaluate stopping rules on a run in progress"),
    "signoff": ("refrun.cli.signoff", "record a sign-off of a recorded assessment"),
    "verify": ("refrun.cli.signoff", "check that a signed-off assessment is unchanged"),
    "calibrate": ("refrun.cli.calibrate",
                  "write a criteria file from reference seeds (held-out validation)"),
}

# Modules of refrun's optional extras (pyproject.toml), by top-level name: a command that
# meets one missing says which extra installs it, in one line (docs/dependencies.md).
EXTRA_OF_MODULE: dict[str, str] = {
    "scipy": "analysis", "plotly": "analysis", "torch": "torch", "torch_xla": "xla",
    "jax": "jax", "tensorboard": "importers", "google_crc32c": "importers",
    "mlperf_logging": "importers",
}
# Sub-commands that need an extra whatever their input: checked before they start, so
# nothing is read or written first.  The core (recording, sync, runs, compare, merge)
# needs none.
COMMAND_NEEDS: dict[str, str] = {
    "accept": "analysis", "calibrate": "analysis", "report": "analysis", "watch": "analysis",
}

# Sub-commands that load recorded runs for a comparison: they get ``--wait SECONDS``.
READS_RUNS = ("compare", "report", "accept")
DEFAULT_WAIT_S = 60.0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``refrun`` parser.  Only ``command``'s module is imported and registered in
    full; every other sub-command is a placeholder carrying its help line."""
    parser = argparse.ArgumentParser(
        prog="refrun",
        description="Record, compare and accept ML training runs moved to other hardware.",
    )
    parser.add_argument("--version", action="version", version=f"refrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = COMMANDS[command][0] if command in COMMANDS else None
    for name, (mod, help_) in COMMANDS.items():
        if mod == module:
            if name not in sub.choices:  # the module registers all of its names at once
                importlib.import_module(mod).register(sub)
                if name in READS_RUNS:
                    add_wait(sub.choices[name])
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def add_tracking_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)",
    )


def add_wait(p: argparse.ArgumentParser) -> None:
    """``--wait SECONDS``: how long to wait for a run still being recorded."""
    if "--wait" in p._option_string_actions:
        return
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="wait at most this long for a run that is still RUNNING or not "
                        f"fully delivered, then refuse it (default {DEFAULT_WAIT_S:g})")


def _command_of(argv: Sequence[str]) -> str | None:
    # The top-level parser has only options without values, so the first argument that
    # is not an option names the sub-command.
    return next((a for a in argv if not a.startswith("-")), None)


def _own_process_gc() -> None:
    """Garbage-collector settings for a command that owns its (short-lived) process.

    A command imports MLflow, SQLAlchemy and pandas: about a million long-lived objects
    that every full collection scans again, and interpreter exit collects repeatedly while
    it tears the modules down.  Measured on ``refrun import`` of 100k points this was a
    third of the command's CPU time.  A higher first-generation threshold keeps collections
    rare while the command runs (the garbage it makes is freed by reference counting:
    NumPy arrays, frames, rows); :func:`gc.freeze` at the end moves everything left to the
    permanent generation so exit does not scan it again.  Only for the process entry
    point (``argv`` None): a program calling ``main([...])`` keeps its own settings."""
    gc.set_threshold(100_000, 50, 100)
    atexit.register(gc.freeze)  # registered first, so it runs after every other handler


def _one_line(text: str) -> str:
    return " ".join(text.split())


def missing_extra(command: str | None) -> str | None:
    """One line naming the modules of the extra ``command`` needs that are not installed,
    or None (all there, or the command needs no extra)."""
    extra = COMMAND_NEEDS.get(command or "")
    if extra is None:
        return None
    import importlib.util

    missing = [m for m, e in EXTRA_OF_MODULE.items()
               if e == extra and importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"needs {' and '.join(missing)} (refrun's {extra!r} extra), not installed "
            f"here: pip install 'refrun[{extra}]'")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        _own_process_gc()
    # MLflow announces database migrations on INFO; a CLI's stderr is for its own errors.
    # MLflow resets its loggers when it is imported (lazily, later), from this variable;
    # the levels cover an MLflow already imported.  The CLI only: never in library use.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    needs = missing_extra(args.command)
    if needs is not None:
        print(f"refrun {args.command}: error: {needs}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "wait", None) is not None:
            from refrun.comparison.loading import wait_for_runs

            with wait_for_runs(args.wait):
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except (RefrunInputError, OutputRefused) as exc:
        from refrun.util.printable import escape

        # One line, whatever the message quotes (a tag, a file name, a --by value).
        print(f"refrun {args.command}: error: {escape(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # An optional framework or extra the command reached: say which extra, not a
        # traceback.  A module of no extra is refrun's own bug: unforeseen, exit 2.
        top = (exc.name or "").split(".")[0]
        if top not in EXTRA_OF_MODULE:
            return _unforeseen(args.command, exc)
        extra = EXTRA_OF_MODULE[top]
        print(f"refrun {args.command}: error: needs {top} (refrun's {extra!r} extra), not "
              f"installed here: pip install 'refrun[{extra}]'", file=sys.stderr)
        return 2
    except Exception as exc:
        # The store failed under the command (corrupt, locked, gone mid-way): one line
        # naming the store and the cause, not a library's traceback.  Anything else is
        # unforeseen: one line, exit 2 (never Python's exit 1, "the candidate failed").
        from refrun.store.client import store_error

        err = store_error(exc)
        if err is None:
            return _unforeseen(args.command, exc)
        print(f"refrun {args.command}: error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refrun: interrupted", file=sys.stderr)
        return 130


def _unforeseen(command: str, exc: BaseException) -> int:
    """An error refrun did not foresee (a bug, or input no check caught): exit 2 with one
    line, never Python's exit 1 (which reads as "the candidate failed")."""
    from refrun.settings import show_traceback
    from refrun.util.printable import escape

    if show_traceback():
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    text = _one_line(str(exc))[:300]
    print(f"refrun {command}: error: unforeseen {type(exc).__name__}"
          f"{': ' + escape(text) if text else ''} (a bug in refrun or an input it does "
          "not check: please report it; REFRUN_TRACEBACK=1 shows where)", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
