"""The scaling candidate: the digits MLP trained data-parallel (DDP, gloo on CPU), one
process per rank, launched by torchrun and recorded with refrun.

::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m pipelines.scaling.ddp_job --steps 100 --batch 32 --losses /tmp/losses.json

Each step takes global batch ``batch x world size`` from the digits workload's seeded batch
order (:func:`pipelines.digits.data.batch_indices`); rank k trains on the k-th slice of it
and DDP averages the gradients, so the update is the global batch's (mean cross-entropy,
gradient-norm clipping and SGD with momentum from ``pipelines/digits/config.toml``).
Recorded through :func:`refrun.torch.instrument` on every rank: rank, world size and job id
come from torchrun's environment (docs/multiprocess.md); ``refrun.global_batch`` is the
global batch, so the run lines up with a reference by samples.  Rank 0 evaluates the
validation set at the last step.

For tests and the benchmark: ``--losses`` writes each rank's own losses (read after each
step, outside it) to ``<losses>.rank<k>`` and rank 0's also to ``<losses>``;
``--unrecorded`` runs the same loop without refrun; ``--per-step-ms`` adds a busy wait to
each step; ``--hang-rank K`` makes rank K wait after its last step without closing its run
(a test SIGKILLs it); ``--timing`` writes each rank's step times (s), the wall time its
loop ended and the wall time its run was closed (delivered) to ``<timing>.rank<k>``.
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
import torch.nn.functional as F

from pipelines.digits.config import load_config
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params
from pipelines.digits.train_torch import MLP, evaluate


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="per-rank batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="digits-mlp-scaling")
    p.add_argument("--role", default="candidate")
    p.add_argument("--losses", type=Path, default=None)
    p.add_argument("--unrecorded", action="store_true")
    p.add_argument("--per-step-ms", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int, default=-1,
                   help="this rank waits (for a SIGKILL) after its last step, never closing")
    p.add_argument("--timing", type=Path, default=None, help="write step times (s) here")
    a = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # small matrices: threads only add noise to step times
    cfg = load_config()
    data = load(cfg.split_seed, cfg.n_train, cfg.n_val)
    x_train, y_train = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y).long()
    global_batch = a.batch * world
    batches = torch.from_numpy(batch_indices(a.seed, a.steps, global_batch, cfg.n_train))
    model = MLP(cfg.sizes)
    model.load_state_dict({k: torch.from_numpy(v)
                           for k, v in init_params(cfg.sizes, a.seed).items()})
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    losses: list[float] = []
    times: list[float] = []

    run_cm: contextlib.AbstractContextManager = contextlib.nullcontext()
    if not a.unrecorded:
        import refrun
        import refrun.torch

        run_cm = refrun.start_run(a.workload, a.role, hardware="cpu", backend="torch",
                                  seed=a.seed, chips=world, global_batch=global_batch,
                                  params={"lr": cfg.lr, "per_rank_batch": a.batch})
    with run_cm as run:
        probe = None if run is None else refrun.torch.instrument(run, model=ddp, optimizer=opt,
                                                                 warmup_steps=2)
        for step in range(a.steps):
            t0 = time.perf_counter()
            with probe.step(step) if probe is not None else contextlib.nullcontext():
                idx = batches[step][rank * a.batch:(rank + 1) * a.batch]
                opt.zero_grad(set_to_none=False)
                loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip_norm)
                opt.step()
                if a.per_step_ms:
                    _busy(a.per_step_ms)
                if probe is not None:
                    probe.log(loss=loss)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))  # the loop's own numbers, outside the step
        loop_end = time.time()
        if probe is not None and rank == 0:
            val_loss, val_acc = evaluate(model, torch.from_numpy(data.val.x),
                                         torch.from_numpy(data.val.y).long())
            probe.log_eval(a.steps - 1, val_loss=val_loss, val_accuracy=val_acc)
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
    if rank == 0 and run is not None:
        print(f"[scaling candidate] run {run.run_id} ({world} ranks, global batch "
              f"{global_batch})", flush=True)
    if a.timing is not None:
        _write(a.timing.with_name(a.timing.name + f".rank{rank}"),
               {"step_s": times, "loop_end": loop_end, "closed": time.time()})
    dist.destroy_process_group()
    return 0


def _write(path: Path, values: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(values))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
