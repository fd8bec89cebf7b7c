"""Cost of the PyTorch probe (refrun.torch.instrument) on a CPU training step of a few ms.

Prints a table:
* per-step time of the unwrapped loop and of the same loop wrapped in ``probe.step`` with
  ``probe.log(loss=<tensor>, lr=<float>)``, psutil sampler on (1 s), medians over
  interleaved repeats in one process, and their ratio (target: <= 1.01);
* the probe's own cost per step, measured on an empty step, as wall time and as the main
  thread's CPU time (the latter is robust on a shared machine);
* sampler cost per sample (each monitor's ``sample()`` and a full ``Probe.sample_now``).

Usage: python benchmarks/bench_torch_probe.py [--steps 300] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import refrun
import refrun.torch
from refrun.probes.monitors import default_monitors


def make_step():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def plain_loop(step, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def probed_loop(probe, step, steps: int, first: int) -> float:
    t0 = time.perf_counter()
    for n in range(first, first + steps):
        with probe.step(n):
            loss = step()
            probe.log(loss=loss, lr=0.01)
    return (time.perf_counter() - t0) / steps


def empty_probe_cost(probe, steps: int, first: int) -> tuple[float, float]:
    """Wall and main-thread CPU seconds per empty probed step.  The CPU time excludes
    waiting for the GIL held by the session's writer thread and for other processes."""
    t = torch.tensor(1.0)
    t0, c0 = time.perf_counter(), time.thread_time()
    for n in range(first, first + steps):
        with probe.step(n):
            probe.log(loss=t, lr=0.01)
    return (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="refrun-bench-torch-"))
    model, opt, step = make_step()
    plain_loop(step, 50)  # warm up

    run = refrun.start_run(workload="bench-torch", role="reference", hardware="cpu",
                           tracking_uri=f"sqlite:///{tmp}/mlflow.db", spool_dir=tmp / "spool",
                           snapshot_environment=False)
    probe = refrun.torch.instrument(run, model=model, optimizer=opt, sample_interval_s=1.0)
    probed_loop(probe, step, 50, first=0)  # warm up the probe's path too

    base, wrapped, empty, empty_cpu = [], [], [], []
    first = 50
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        base.append(plain_loop(step, args.steps))
        wrapped.append(probed_loop(probe, step, args.steps, first))
        first += args.steps
        wall, cpu = empty_probe_cost(probe, args.steps, first)
        empty.append(wall)
        empty_cpu.append(cpu)
        first += args.steps

    sample_costs = {m.name: per_call(m.sample, 200) for m in probe.monitors}
    sample_now = per_call(probe.sample_now, 200)
    probe.close()
    run.close()

    b, w, e, ec = (statistics.median(v) for v in (base, wrapped, empty, empty_cpu))
    print(f"{'measure':<44}{'value':>14}")
    print("-" * 58)
    print(f"{'unwrapped step (median of repeats)':<44}{b * 1e3:>11.3f} ms")
    print(f"{'wrapped step (median of repeats)':<44}{w * 1e3:>11.3f} ms")
    print(f"{'ratio wrapped / unwrapped (target <= 1.01)':<44}{w / b:>14.4f}")
    print(f"{'ratio of the fastest repeats (min / min)':<44}{min(wrapped) / min(base):>14.4f}")
    print(f"{'ratio per repeat, min..max':<44}"
          f"{min(x / y for x, y in zip(wrapped, base, strict=True)):>7.3f}.."
          f"{max(x / y for x, y in zip(wrapped, base, strict=True)):.3f}")
    print(f"{'probe cost on an empty step, wall':<44}{e * 1e6:>11.1f} us")
    print(f"{'probe cost on an empty step, thread CPU':<44}{ec * 1e6:>11.1f} us")
    print(f"{'  thread CPU / unwrapped step':<44}{ec / b:>14.4f}")
    for name, cost in sample_costs.items():
        print(f"{'sampler ' + name + ' per sample':<44}{cost * 1e6:>11.1f} us")
    print(f"{'Probe.sample_now (all monitors)':<44}{sample_now * 1e6:>11.1f} us")
    print(f"{'monitors on this machine':<44}{', '.join(m.name for m in default_monitors()):>14}")
    print(f"steps per repeat {args.steps}, repeats {args.repeats}, torch threads 1")


if __name__ == "__main__":
    main()
