"""Regenerate the digits pipeline's criteria files by `refrun calibrate` alone.

    .venv/bin/python scripts/make_criteria.py            # pipelines/criteria/digits.toml
    .venv/bin/python scripts/make_criteria.py --quick    # pipelines/criteria/digits-quick.toml

Trains 8 PyTorch reference seeds of the digits MLP (``--quick``: 400 steps, else 600) into
a scratch store, runs ``refrun calibrate`` on them with the options below, and writes the
file with the block of hand-made choices on top (~1 min on 2 cores).  Nothing below that
block is edited by hand: ``tests/test_criteria_fresh.py`` makes the ``--quick`` file anew
and fails when the committed one differs from what the current ``refrun calibrate``
writes (naming both commands), so a change of calibrate reaches the main job's criteria
(``make demo``) the day it is made.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = tuple(range(8))
# The options chosen by hand; HEADER says why.
CALIBRATE_ARGS = ("--group-size", "3", "--exclude", "step_time")
HEADER = """\
# The digits-mlp criteria for {what}.
# Written by `refrun calibrate` from {n} PyTorch reference seeds; nothing below the next
# block was edited by hand.  To regenerate (~1 minute on 2 CPU cores):
#   .venv/bin/python scripts/make_criteria.py{flag}
# (trains seeds {seeds} of pipelines.digits.train_torch{flag} into a scratch store, then
#   refrun calibrate --reference <their run ids> {args})
# Choices made by hand, and why:
#   --group-size 3       the demo accepts every candidate against 3 reference seeds.
#   --exclude step_time  here one CPU stands in for the GPU and the TPU and the pipeline
#                        trains two variants at a time on a shared machine: a step-time
#                        ratio says nothing about the migration.  Calibrate step time
#                        from reference seeds recorded on the target hardware.
#
"""


# What two calibrations of the same seeds differ in: the run ids and the date.
VOLATILE = ("runs", "date", "refrun_version")
REL_TOL = 0.02  # another CPU's float kernels move thresholds in their last digits
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def differences(committed: str, made: str) -> list[str]:
    """Where a committed criteria file differs from one made now (``key.path: committed !=
    made``): the hand-made block byte for byte; every table, criterion and key of the
    TOML, numbers within ``REL_TOL`` (in text too: the power notes quote them); the
    calibration's run ids and date left out."""
    import tomllib

    out = []
    if _hand_block(committed) != _hand_block(made):
        out.append("the hand-made block differs from scripts/make_criteria.py's HEADER")
    a, b = tomllib.loads(committed), tomllib.loads(made)
    for doc in (a, b):
        for k in VOLATILE:
            doc.get("calibration", {}).pop(k, None)
    return out + _diff(a, b, "")


def _hand_block(text: str) -> str:
    return text.split("# Criteria of workload", 1)[0]


def _diff(a: object, b: object, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))]
    if isinstance(a, list) and isinstance(b, list):
        # criteria by id (the others by position)
        ia = {_label(x, i): x for i, x in enumerate(a)}
        ib = {_label(x, i): x for i, x in enumerate(b)}
        out = []
        gone, new = [k for k in ia if k not in ib], [k for k in ib if k not in ia]
        if gone or new:
            out.append(f"{path}: only in the committed file {gone}, only in the one made "
                       f"now {new}")
        elif list(ia) != list(ib):
            out.append(f"{path}: another order: {list(ia)} != {list(ib)}")
        return out + [d for k in ia if k in ib for d in _diff(ia[k], ib[k], f"{path}[{k}]")]
    if isinstance(a, str) and isinstance(b, str) and a != b:
        na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
        if _NUMBER.sub("#", a) == _NUMBER.sub("#", b) and all(
                _close(float(x), float(y)) for x, y in zip(na, nb, strict=True)):
            return []
    elif isinstance(a, int | float) and isinstance(b, int | float) \
            and not isinstance(a, bool) and not isinstance(b, bool) and _close(a, b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


def _label(x: object, i: int) -> str:
    return str(x["id"]) if isinstance(x, dict) and "id" in x else str(i)


def _close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=1e-12)


def target(quick: bool) -> Path:
    return ROOT / "pipelines" / "criteria" / ("digits-quick.toml" if quick else "digits.toml")


def header(quick: bool) -> str:
    return HEADER.format(
        what="--quick runs (400 steps: the test suite, make demo ARGS=--quick)" if quick
        else "full runs (600 steps: make demo)",
        n=len(SEEDS), flag=" --quick" if quick else "", seeds=f"{SEEDS[0]}-{SEEDS[-1]}",
        args=" ".join(CALIBRATE_ARGS))


def train(seed: int, quick: bool, uri: str) -> str:
    """Train reference seed ``seed`` into ``uri``; returns its run id."""
    cmd = [sys.executable, "-m", "pipelines.digits.train_torch", "--seed", str(seed),
           "--role", "reference", "--quiet", "--tracking-uri", uri]
    done = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT,
                          capture_output=True, text=True)
    run = re.search(r"\] run ([0-9a-f]{32}) ", done.stdout)
    if done.returncode != 0 or run is None:
        raise SystemExit(f"reference seed {seed} failed (exit {done.returncode}):\n"
                         + done.stderr[-2000:])
    return run.group(1)


def make(quick: bool, out: Path, jobs: int = 2,
         trained: tuple[str, list[str]] | None = None) -> None:
    """Train the seeds, calibrate, write ``out`` (only once calibrate succeeded).

    ``trained``: (tracking URI, run ids) of the reference seeds ``SEEDS`` already trained
    by the same training code (``--quick`` or not as ``quick`` says; the test suite's
    cached store), calibrated instead of training them again."""
    with tempfile.TemporaryDirectory(prefix="refrun-criteria-") as tmp:
        if trained is not None:
            uri, ids = trained
        else:
            uri = f"sqlite:///{tmp}/refs.db"
            ids = [train(SEEDS[0], quick, uri)]  # creates the store before parallel writers
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                ids += pool.map(lambda s: train(s, quick, uri), SEEDS[1:])
        written = Path(tmp) / "criteria.toml"
        cal = subprocess.run([sys.executable, "-m", "refrun", "calibrate", "--reference",
                              *ids, "--tracking-uri", uri, *CALIBRATE_ARGS,
                              "-o", str(written)], cwd=ROOT, capture_output=True, text=True)
        if cal.returncode != 0:
            raise SystemExit(f"refrun calibrate failed (exit {cal.returncode}):\n"
                             + cal.stderr[-2000:])
        out.write_text(header(quick) + written.read_text(encoding="utf-8"), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 400-step runs' file")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write (default: the committed file)")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at a time")
    ap.add_argument("--trained", nargs="+", metavar=("URI", "RUN_ID"), default=None,
                    help=f"calibrate these {len(SEEDS)} reference runs of store URI, already "
                         "trained (seeds in order), instead of training them")
    args = ap.parse_args(argv)
    out = args.out or target(args.quick)
    trained = None
    if args.trained is not None:
        if len(args.trained) != 1 + len(SEEDS):
            ap.error(f"--trained takes a store URI and {len(SEEDS)} run ids "
                     f"(got {len(args.trained) - 1})")
        trained = (args.trained[0], args.trained[1:])
    make(args.quick, out, args.jobs, trained)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
