"""Which of refrun's threads spends the CPU a probed JAX step costs, and on what (a
diagnostic for docs/tpu.md, sixth session 2026-12-06).

A probed loop of ``--steps`` steps per workload (``probe.step`` + ``probe.log`` as the
pipelines log, the default flush interval, monitors as a user gets them), run twice: first
without a profiler (each refrun thread's CPU per step, from its own clock), then with
``cProfile`` on each thread's own CPU clock in every thread refrun starts (the functions
that take each thread's CPU, time waiting for the GIL or a lock left out; the profiler's
own overhead inflates Python-heavy code, not C calls).

    python benchmarks/tpu/thread_profile.py --workloads charlm,digits --steps 5000
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax

import refrun
import refrun.jax
from benchmarks.tpu.probe_cost import make_workload


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live thread named ``refrun*`` (ids stripped)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.name.startswith("refrun") and t.ident is not None:
            with contextlib.suppress(OSError, AttributeError):
                key = re.sub(r"-[0-9a-f]{6,}$", "", t.name)
                out[key] = out.get(key, 0.0) + time.clock_gettime(
                    time.pthread_getcpuclockid(t.ident))
    return out


def probed(name: str, steps: int, profiles: dict[str, cProfile.Profile] | None
           ) -> tuple[dict[str, float], float]:
    """Each refrun thread's CPU over ``steps`` probed steps (us a step), and the loop's
    wall time a step (us)."""
    w = make_workload(name, None)
    tmp = tempfile.mkdtemp(prefix="refrun-threads-")

    def hook(frame, event, arg):  # first call in a new thread: profile it from now on
        t = threading.current_thread()
        if profiles is not None and t.name.startswith("refrun"):
            prof = profiles.setdefault(re.sub(r"-[0-9a-f]{6,}$", "", t.name),
                                       cProfile.Profile(time.thread_time))
            with contextlib.suppress(ValueError):  # one profiler a thread
                prof.enable()
                return None
        sys.setprofile(None)

    if profiles is not None:
        threading.setprofile(hook)
    try:
        run = refrun.start_run(f"threads-{name}", "candidate",
                               hardware=jax.default_backend(), backend="jax",
                               tracking_uri=f"sqlite:///{tmp}/m.db",
                               spool_dir=f"{tmp}/spool", snapshot_environment=False)
        probe = refrun.jax.instrument(run, step_fns=w.fns)
    finally:
        threading.setprofile(None)
    state = w.init()
    for n in range(200):  # compile, learn names, first collection
        with probe.step(n):
            state, loss, norms = w.step(state, n)
            probe.log(loss=loss) if norms is None else probe.log(loss=loss, grad_norm=norms)
    jax.block_until_ready(state)
    c0 = thread_cpu()
    t0 = time.perf_counter()
    for n in range(200, 200 + steps):
        with probe.step(n):
            state, loss, norms = w.step(state, n)
            probe.log(loss=loss) if norms is None else probe.log(loss=loss, grad_norm=norms)
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t0) * 1e6 / steps
    c1 = thread_cpu()
    probe.close()
    run.close()
    for prof in (profiles or {}).values():
        with contextlib.suppress(Exception):
            prof.disable()
    return {k: (v - c0.get(k, 0.0)) * 1e6 / steps for k, v in c1.items()}, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="charlm,digits")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    print(f"JAX {jax.__version__} on {jax.default_backend()}; {args.steps} probed steps")
    for name in args.workloads.split(","):
        cpu, wall = probed(name, args.steps, None)
        print(f"[{name}] {wall:.1f} us a step; refrun threads' CPU, us a step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda x: -x[1])))
        profiles: dict[str, cProfile.Profile] = {}
        cpu, wall = probed(name, args.steps, profiles)
        print(f"[{name}] profiled: {wall:.1f} us a step; "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda x: -x[1])))
        for thread, prof in profiles.items():
            s = io.StringIO()
            try:
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
            except TypeError:  # nothing recorded
                continue
            body = s.getvalue()
            keep = body[body.find("ncalls"):] if "ncalls" in body else body
            print(f"--- {name} / {thread} (sorted by own time)\n{keep.rstrip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
