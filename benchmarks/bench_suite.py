"""Where the test suite's time goes: the 30 slowest tests and each worker's wall time.

    .venv/bin/python benchmarks/bench_suite.py                  # read the last `make test`
    .venv/bin/python benchmarks/bench_suite.py --run            # run the suite, then read it
    .venv/bin/python benchmarks/bench_suite.py --run -- -m "not e2e"   # any pytest arguments
    .venv/bin/python benchmarks/bench_suite.py --write          # and tests/durations.json

`make test` writes every test phase's worker, start and stop to test-artifacts/timings.json
(tests/conftest.py's ``--timings``).  This prints the slowest tests (setup + call +
teardown: a module fixture's cost lands on the test that first asks for it), each file's
total, and per worker: how many tests it ran, its busy seconds, and when it finished
(a worker that finished long before the other was idle for the rest: the scheduling's
failure).  ``--write`` stores each file's seconds in tests/durations.json, which orders the
files slowest first for the next run.  It only reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ROOT / "test-artifacts" / "timings.json"
DURATIONS = ROOT / "tests" / "durations.json"


@dataclass(frozen=True)
class TestTime:
    nodeid: str
    worker: str
    seconds: float  # setup + call + teardown
    start: float | None
    stop: float | None
    outcome: str  # the call's (or the failing phase's)

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass(frozen=True)
class WorkerTime:
    worker: str
    tests: int
    busy_s: float
    first_start: float
    last_stop: float


def load(path: Path) -> list[TestTime]:
    """One entry per test from a ``--timings`` file."""
    phases: dict[str, list[dict]] = defaultdict(list)
    for p in json.loads(path.read_text(encoding="utf-8"))["tests"]:
        phases[p["nodeid"]].append(p)
    out = []
    for nodeid, ps in phases.items():
        starts = [p["start"] for p in ps if p.get("start") is not None]
        stops = [p["stop"] for p in ps if p.get("stop") is not None]
        failed = [p["outcome"] for p in ps if p["outcome"] == "failed"]
        call = [p["outcome"] for p in ps if p["when"] == "call"]
        out.append(TestTime(nodeid, ps[0]["worker"], sum(p["duration"] for p in ps),
                            min(starts) if starts else None, max(stops) if stops else None,
                            (failed or call or ["skipped"])[0]))
    return out


def by_file(tests: list[TestTime]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for t in tests:
        files[t.file] += t.seconds
    return dict(files)


def by_worker(tests: list[TestTime]) -> list[WorkerTime]:
    groups: dict[str, list[TestTime]] = defaultdict(list)
    for t in tests:
        groups[t.worker].append(t)
    out = []
    for w, ts in sorted(groups.items()):
        starts = [t.start for t in ts if t.start is not None]
        stops = [t.stop for t in ts if t.stop is not None]
        out.append(WorkerTime(w, len(ts), sum(t.seconds for t in ts),
                              min(starts, default=0.0), max(stops, default=0.0)))
    return out


def report(tests: list[TestTime], top: int = 30) -> str:
    lines = [f"{len(tests)} tests", "", f"{top} slowest tests (setup + call + teardown):",
             f"{'seconds':>9}  {'worker':<6}  test"]
    for t in sorted(tests, key=lambda t: -t.seconds)[:top]:
        lines.append(f"{t.seconds:9.1f}  {t.worker:<6}  {t.nodeid}"
                     + ("" if t.outcome == "passed" else f"  [{t.outcome}]"))
    files = sorted(by_file(tests).items(), key=lambda kv: -kv[1])
    lines += ["", "slowest files:", f"{'seconds':>9}  file"]
    lines += [f"{s:9.1f}  {f}" for f, s in files[:15]]
    workers = by_worker(tests)
    if workers:
        t0 = min(w.first_start for w in workers)
        end = max(w.last_stop for w in workers)
        lines += ["", f"wall time {end - t0:.0f} s (first test start to last test end)",
                  f"{'worker':<6}  {'tests':>5}  {'busy s':>8}  {'wall s':>8}  "
                  f"{'idle at end s':>13}"]
        for w in workers:
            lines.append(f"{w.worker:<6}  {w.tests:5d}  {w.busy_s:8.1f}  "
                         f"{w.last_stop - w.first_start:8.1f}  {end - w.last_stop:13.1f}")
    return "\n".join(lines)


def durations_document(tests: list[TestTime], source: str) -> dict:
    return {"about": "seconds per test file in a measured run of the whole suite; "
                     "tests/conftest.py starts the slowest files first. Regenerate with "
                     "`.venv/bin/python benchmarks/bench_suite.py --write` after `make test`.",
            "source": source,
            "files": {f: round(s, 1) for f, s in sorted(by_file(tests).items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timings", type=Path, default=TIMINGS,
                    help="a --timings file of pytest (default: the last `make test`'s)")
    ap.add_argument("--run", action="store_true",
                    help="run the suite first as `make test` does (2 workers, files whole)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write", action="store_true",
                    help="store each file's seconds in tests/durations.json")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (--run)")
    args = ap.parse_args(argv)
    if args.run:
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist",
               "loadfile", "--timings", str(args.timings), *args.pytest_args]
        env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
        subprocess.run(cmd, cwd=ROOT, env=env)
    if not args.timings.is_file():
        if args.timings == TIMINGS:  # nothing measured yet (`make bench` on a new clone)
            print(f"no timings at {TIMINGS.relative_to(ROOT)} yet: run `make test` (or "
                  "this with --run) first")
            return 0
        print(f"error: no timings file {args.timings}", file=sys.stderr)
        return 2
    tests = load(args.timings)
    print(report(tests, args.top))
    if args.write:
        doc = durations_document(tests, f"{args.timings.relative_to(ROOT)}"
                                 if args.timings.is_relative_to(ROOT) else str(args.timings))
        DURATIONS.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {DURATIONS.relative_to(ROOT)} ({len(doc['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
