"""The PyTorch/XLA port of the digits MLP (TPU, GPU, or PJRT's CPU device here).

    PJRT_DEVICE=CPU python -m pipelines.digits.train_xla --seed 0

The reference's loop (``train_torch``) with the usual PyTorch/XLA changes: the model is
moved to the XLA device before the optimizer is built, batches are sent to the device,
and ``torch_xla.sync()`` ends each step so the step runs as one compiled graph.  Logged
values are XLA tensors handed to the probe after the sync (never ``.item()`` in the step).

Defects only this port has (each runs without an error):

* ``shape_storm``: ragged batches (a loader that neither drops nor pads) give the step a
  new input shape, hence a new XLA compilation, on each of the first steps;
* ``host_sync``: a NaN guard calls ``loss.item()`` inside the step, which executes the
  graph early and waits for it on every step;
* ``cpu_fallback``: a robust-loss monitor (``median`` of the per-sample losses) has no XLA
  lowering and runs on the CPU every step.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
import torch.nn.functional as F
import torch_xla

import refrun.xla
from pipelines.digits import cli
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params
from pipelines.digits.train_torch import MLP, evaluate, grad_norms


def ragged_size(step: int, batch: int) -> int:
    """Batch size the ``shape_storm`` loader yields at ``step``: ``batch // 4`` distinct
    sizes between ``3/4 batch`` and ``batch`` (16 for a batch of 64), all met within the
    first ``batch // 4`` steps, so most of them are compiled after the warm-up.  (More
    sizes only make the defect run slower: each is a full compilation of the step.)"""
    return batch - (step * 7) % (batch // 4)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch_xla", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    device = torch_xla.device()
    data = load(cfg.split_seed, cfg.n_train, cfg.n_val)
    x_train, y_train = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y).long()
    x_val, y_val = torch.from_numpy(data.val.x).to(device), torch.from_numpy(data.val.y).long()
    y_val = y_val.to(device)
    x_test = torch.from_numpy(data.test.x).to(device)
    y_test = torch.from_numpy(data.test.y).long().to(device)
    batches = torch.from_numpy(batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train))

    model = MLP(cfg.sizes, block_first=args.has("blocked_grad"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in
                           init_params(cfg.sizes, args.seed).items()})
    model.to(device)  # before the optimizer, so it updates the device parameters
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # The stale-copy defect: evaluation reads a copy the optimizer never updates.
    eval_model = copy.deepcopy(model) if args.has("stale_eval_copy") else model
    reduction = "sum" if args.has("sum_loss") else "mean"
    named = list(model.named_parameters())
    eval_steps = set(cfg.eval_steps())
    best_loss = float("inf")
    best_state = {k: v.clone() for k, v in model.state_dict().items()}

    import torch_xla.core.xla_model as xm

    with cli.start_run(args, hardware=str(xm.xla_device_hw(device)).lower()) as run:
        probe = refrun.xla.instrument(run, model=model, optimizer=opt)
        for step in range(cfg.steps):
            idx = batches[step]
            if args.has("shape_storm"):
                idx = idx[: ragged_size(step, cfg.batch)]
            xb, yb = x_train[idx].to(device), y_train[idx].to(device)
            with probe.step(step):
                opt.zero_grad(set_to_none=False)
                nll = F.cross_entropy(model(xb), yb, reduction="none")
                loss = nll.sum() if reduction == "sum" else nll.mean()
                if args.has("host_sync") and not math.isfinite(loss.item()):
                    continue  # a NaN guard: harmless on the GPU, a sync on every XLA step
                if args.has("cpu_copy") and not torch.isfinite(loss.detach().cpu()):
                    continue  # the same guard spelt .cpu(): a device-to-host copy per step
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                norms = grad_norms(named)
                extra = {"loss_median": nll.median(dim=0).values} \
                    if args.has("cpu_fallback") else {}
                torch_xla.sync()
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    probe.log(loss=loss.detach(), grad_norm=norms, **extra)
            if step in eval_steps:
                val_loss, val_acc = evaluate(eval_model, x_val, y_val)
                torch_xla.sync()
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                host_loss = float(val_loss.cpu())  # outside the step: a deliberate host read
                if host_loss < best_loss:
                    best_loss = host_loss
                    best_state = {k: v.clone() for k, v in model.state_dict().items()}
                cli.progress(args, step, host_loss, float(val_acc.cpu()))
        # Final evaluation of the model the run delivers: the best checkpoint, reloaded.
        if not args.has("no_best_reload"):
            model.load_state_dict(best_state)
        final_loss, final_acc = evaluate(eval_model, x_val, y_val)
        test_loss, test_acc = evaluate(eval_model, x_test, y_test)
        torch_xla.sync()
        probe.log_eval(cfg.steps - 1, final_val_loss=final_loss, final_val_accuracy=final_acc,
                       test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    print(f"[{args.variant}] run {run.run_id}  test acc {float(test_acc.cpu()):.4f}  "
          f"test loss {float(test_loss.cpu()):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
