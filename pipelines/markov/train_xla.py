"""The PyTorch/XLA port of the GRU sequence classifier (TPU, GPU, or PJRT's CPU device here).

    PJRT_DEVICE=CPU python -m pipelines.markov.train_xla --seed 0

The reference's loop (``train_torch``: same model class, same Adam update) with the usual
PyTorch/XLA changes: the model and the data are moved to the XLA device, the step's
``[lr, bias corrections]`` are sent to the device as data (a Python float would be a
constant of the graph, recompiled whenever it changes), and ``torch_xla.sync()`` ends each
step so the step runs as one compiled graph.  Logged values are XLA tensors handed to the
probe after the sync.

Defect only this port has (it runs without an error): ``cpu_copy``, a NaN guard that
copies the loss to the host with ``.cpu()`` inside every step, which executes the graph
early and waits for it on every step (``.item()`` is the usual spelling; ``.cpu()`` is the
same transfer under another name).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch_xla

import refrun.xla
from pipelines.markov import cli
from pipelines.markov.data import batch_indices, load
from pipelines.markov.train_torch import (
    adam_update,
    build_model,
    evaluate,
    group_norms,
    loss_of,
    schedule,
)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch_xla", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    device = torch_xla.device()
    data = load(cfg.data_seed, cfg.classes, cfg.symbols, cfg.length, cfg.mix,
                cfg.concentration, cfg.n_train, cfg.n_val)
    x_train, y_train = torch.from_numpy(data.train.x).long(), torch.from_numpy(data.train.y).long()
    x_val = torch.from_numpy(data.val.x).long().to(device)
    y_val = torch.from_numpy(data.val.y).long().to(device)
    batches = torch.from_numpy(batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train))

    model = build_model(cfg, args.seed, args.defects).to(device)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="markov-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.pt"

    import torch_xla.core.xla_model as xm

    hardware = str(xm.xla_device_hw(device)).lower()
    with cli.start_run(args, hardware=hardware) as run:
        probe = refrun.xla.instrument(run, model=model)
        for step in args.step_order():
            idx = batches[step]
            x, y = x_train[idx].to(device), y_train[idx].to(device)
            sched = torch.from_numpy(schedule(cfg, step)).to(device)
            with probe.step(step):
                loss = loss_of(model(x), y, args.has("sum_loss"))
                if args.has("cpu_copy") and not torch.isfinite(loss.detach().cpu()):
                    continue  # a NaN guard: harmless on the GPU, a transfer on every XLA step
                for p in params:
                    p.grad = None
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                adam_update(params, m, v, sched, cfg)
                norms = group_norms(named)
                torch_xla.sync()
                if args.logs(step):
                    probe.log(loss=loss.detach(), grad_norm=norms)
            if step in eval_steps:
                val_loss, val_acc = evaluate(model, x_val, y_val)
                torch_xla.sync()
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss.cpu()), float(val_acc.cpu()))
            if args.resume is not None and step == args.resume.checkpoint:
                torch.save({"params": [p.detach().cpu() for p in params],
                            "m": [t.cpu() for t in m], "v": [t.cpu() for t in v]}, ckpt)
            if step == replay_from:  # the "crash": restart from the checkpoint
                replay_from = None
                state = torch.load(ckpt)
                with torch.no_grad():
                    for dst, src in zip([*params, *m, *v],
                                        [*state["params"], *state["m"], *state["v"]],
                                        strict=True):
                        dst.copy_(src.to(device))
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  val loss {float(val_loss.cpu()):.4f}  "
          f"val acc {float(val_acc.cpu()):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
