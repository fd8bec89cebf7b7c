"""The PyTorch/XLA port of the character-level transformer LM (TPU, GPU, or PJRT's CPU
device here).

    PJRT_DEVICE=CPU python -m pipelines.charlm.train_xla --seed 0

The reference's loop (``train_torch``: same model class, same Adam update) with the
usual PyTorch/XLA changes: the model is moved to the XLA device, batches, dropout masks and
the step's ``[lr, bias corrections]`` are sent to the device as data (a Python float would
be a constant of the graph, recompiled whenever the schedule changes it), and
``torch_xla.sync()`` ends each step so the step runs as one compiled graph.  Logged values
are XLA tensors handed to the probe after the sync (never ``.item()`` in the step).

Defects only this port has (each runs without an error):

* ``host_sync``: a NaN guard calls ``loss.item()`` inside the step, which executes the
  graph early and waits for it on every step;
* ``shape_storm``: ragged sequence lengths (a loader that neither pads nor packs) give
  the step a new input shape, hence a new XLA compilation, for each of 8 lengths;
* ``cpu_fallback``: a robust-loss monitor (``median`` of the per-sequence losses) has no
  XLA lowering and runs on the CPU every step.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import torch_xla

import refrun.xla
from pipelines.charlm import cli
from pipelines.charlm.data import batch_starts, dropout_mask, eval_keep, eval_starts, load, windows
from pipelines.charlm.train_torch import (
    adam_update,
    build_model,
    evaluate,
    group_norms,
    lm_loss,
    schedule,
)


def ragged_length(step: int, context: int) -> int:
    """Sequence length the ``shape_storm`` loader yields at ``step``: 8 distinct lengths
    from ``context - 7`` to ``context``, all met within the first 8 steps."""
    return context - (step * 3) % 8


def _on(mask, device):
    """A NumPy dropout mask on the device (None stays None)."""
    return None if mask is None else torch.from_numpy(mask).to(device)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch_xla", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    device = torch_xla.device()
    corpus = load(cfg.files, cfg.val_fraction, cfg.test_fraction)
    starts = batch_starts(args.seed, cfg.steps, cfg.batch, len(corpus.train), cfg.context)

    def on_device(split_ids, count):
        xs, ys = windows(split_ids, eval_starts(len(split_ids), cfg.context, count), cfg.context)
        return torch.from_numpy(xs).long().to(device), torch.from_numpy(ys).long().to(device)

    x_val, y_val = on_device(corpus.val, cfg.eval_windows)
    x_test, y_test = on_device(corpus.test, cfg.eval_windows)
    eval_shape = (cfg.eval_windows, cfg.context, cfg.d_model)

    model = build_model(cfg, args.seed, args.defects).to(device)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="charlm-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.pt"

    import torch_xla.core.xla_model as xm

    hardware = str(xm.xla_device_hw(device)).lower()
    with cli.start_run(args, hardware=hardware, corpus_sha256=corpus.sha256) as run:
        probe = refrun.xla.instrument(run, model=model)
        for step in args.step_order():
            xs, ys = windows(corpus.train, starts[step], cfg.context)
            if args.has("shape_storm"):
                t = ragged_length(step, cfg.context)
                xs, ys = xs[:, :t], ys[:, :t]
            x = torch.from_numpy(xs).long().to(device)
            y = torch.from_numpy(ys).long().to(device)
            keep = torch.from_numpy(dropout_mask(args.seed, step, (*xs.shape, cfg.d_model),
                                                 cfg.dropout)).to(device)
            lr, bc1, bc2 = torch.from_numpy(schedule(cfg, step, not args.has("no_warmup"))
                                            ).to(device)
            with probe.step(step):
                logits = model(x, keep)
                loss = lm_loss(logits, y, args.has("double_shift"))
                if args.has("host_sync") and not math.isfinite(loss.item()):
                    continue  # a NaN guard: harmless on the GPU, a sync on every XLA step
                if args.has("cpu_copy") and not torch.isfinite(loss.detach().cpu()):
                    continue  # the same guard spelt .cpu(): a device-to-host copy per step
                for p in params:
                    p.grad = None
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                adam_update(params, m, v, lr, bc1, bc2, cfg)
                norms = group_norms(named)
                extra = {}
                if args.has("cpu_fallback"):
                    per_seq = F.cross_entropy(logits.detach().transpose(1, 2), y,
                                              reduction="none").mean(1)
                    extra["loss_median"] = per_seq.median(dim=0).values
                torch_xla.sync()
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    probe.log(loss=loss.detach(), grad_norm=norms, **extra)
            if step in eval_steps:
                keep_eval = _on(eval_keep(args.defects, "val", step, eval_shape, cfg.dropout),
                                device)
                val_loss, val_acc = evaluate(model, x_val, y_val, keep_eval)
                torch_xla.sync()
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss.cpu()))  # outside the step
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
        keep_test = _on(eval_keep(args.defects, "test", cfg.steps, eval_shape, cfg.dropout),
                        device)
        test_loss, test_acc = evaluate(model, x_test, y_test, keep_test)
        torch_xla.sync()
        probe.log_eval(cfg.steps - 1, test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  test loss {float(test_loss.cpu()):.4f}  "
          f"test acc {float(test_acc.cpu()):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
