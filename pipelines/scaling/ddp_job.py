"""A small DDP job recorded with refrun, one process per rank (launched by torchrun).

::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m pipelines.scaling.ddp_job --steps 20 --losses /tmp/losses.json

Each rank trains the same tiny MLP on its own shard of random data (gloo on CPU), records
through :func:`refrun.torch.instrument` (rank, world size and job id come from torchrun's
environment), and writes the losses it computed itself to ``--losses`` (rank 0) and
``<losses>.rank<k>`` (every rank) so a test can compare the store with the loop's own
numbers.  ``--unrecorded`` runs the same loop without refrun (the benchmark's baseline);
``--per-step-ms`` adds a busy wait to each step (a few-ms step for the benchmark);
``--stall-rank K --stall-ms T`` makes rank K slower (a straggler).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="per-rank batch")
    p.add_argument("--workload", default="ddp-mlp")
    p.add_argument("--role", default="candidate")
    p.add_argument("--losses", type=Path, default=None)
    p.add_argument("--unrecorded", action="store_true")
    p.add_argument("--per-step-ms", type=float, default=0.0)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-ms", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int, default=-1,
                   help="this rank waits (for a SIGKILL) after its last step, never closing")
    p.add_argument("--timing", type=Path, default=None, help="write step times (s) here")
    a = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    losses: list[float] = []
    times: list[float] = []

    run_cm: contextlib.AbstractContextManager = contextlib.nullcontext()
    if not a.unrecorded:
        import refrun
        import refrun.torch

        run_cm = refrun.start_run(a.workload, a.role, hardware="cpu", backend="torch", seed=0,
                                  chips=world, global_batch=a.batch * world)
    with run_cm as run:
        probe = None if run is None else refrun.torch.instrument(run, model=ddp, optimizer=opt,
                                                                 warmup_steps=2)
        for step in range(a.steps):
            t0 = time.perf_counter()
            with probe.step(step) if probe is not None else contextlib.nullcontext():
                x = torch.randn(a.batch, 16, generator=gen)
                y = x[:, :1] * 0.5 - x[:, 1:2]
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if a.per_step_ms:
                    _busy(a.per_step_ms)
                if rank == a.stall_rank:
                    _busy(a.stall_ms)
                if probe is not None:
                    probe.log(loss=loss)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))  # the loop's own numbers, outside the step
        if rank == a.hang_rank:
            if probe is not None:
                probe.close()  # every point accepted; the run itself is never closed
            if a.losses is not None:
                _write(a.losses.with_name(a.losses.name + f".rank{rank}"), losses)
            Path(str(a.losses) + f".rank{rank}.hanging").touch()
            while True:  # the test SIGKILLs this rank: its run is never closed
                time.sleep(0.05)
    if a.losses is not None:
        _write(a.losses.with_name(a.losses.name + f".rank{rank}"), losses)
        if rank == 0:
            _write(a.losses, losses)
    if a.timing is not None:
        _write(a.timing.with_name(a.timing.name + f".rank{rank}"), times)
    dist.destroy_process_group()
    return 0


def _write(path: Path, values: list[float]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(values))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
