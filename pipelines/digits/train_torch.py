"""The reference: the digits MLP trained with PyTorch (CPU here, CUDA on a GPU machine).

    python -m pipelines.digits.train_torch --seed 0 --role reference

One step: cross-entropy (mean over the batch), backward, clip the global gradient norm
once, SGD with momentum.  Every ``eval_every`` steps the validation set is evaluated and
the best weights (lowest validation loss) are kept; at the end they are reloaded and the
test set is evaluated.  Recorded with ``refrun.torch.instrument``: loss, the norm of each
parameter's applied gradient (``grad_norm/<name>``), validation metrics (``eval/val_*``),
the delivered model's final metrics (``eval/final_val_*``, ``eval/test_*``), step times.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

import refrun.torch
from pipelines.digits import cli
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params, layer_names


class MLP(torch.nn.Module):
    """Linear layers fc1..fcN with ReLU between; ``block_first`` detaches fc1's output
    (the blocked-gradient defect: fc1 then never receives a gradient)."""

    def __init__(self, sizes: tuple[int, ...], block_first: bool = False) -> None:
        super().__init__()
        self.names = layer_names(sizes)
        for name, a, b in zip(self.names, sizes[:-1], sizes[1:], strict=True):
            self.add_module(name, torch.nn.Linear(a, b))
        self.block_first = block_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, name in enumerate(self.names):
            x = getattr(self, name)(x)
            if i == 0 and self.block_first:
                x = x.detach()
            if i < len(self.names) - 1:
                x = torch.relu(x)
        return x


def grad_norms(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """L2 norm of each parameter's applied (clipped) gradient; 0 where none arrived."""
    return {n: p.grad.norm() if p.grad is not None else torch.zeros(()) for n, p in named}


@torch.no_grad()
def evaluate(model: MLP, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) of ``model`` on a whole split, as 0-d tensors."""
    logits = model(x)
    return F.cross_entropy(logits, y), (logits.argmax(1) == y).float().mean()


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small matrices: threads only add noise to step times
    data = load(cfg.split_seed, cfg.n_train, cfg.n_val)
    x_train, y_train = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y).long()
    x_val, y_val = torch.from_numpy(data.val.x), torch.from_numpy(data.val.y).long()
    x_test, y_test = torch.from_numpy(data.test.x), torch.from_numpy(data.test.y).long()
    batches = torch.from_numpy(batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train))

    model = MLP(cfg.sizes, block_first=args.has("blocked_grad"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in
                           init_params(cfg.sizes, args.seed).items()})
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # The stale-copy defect: evaluation reads a copy the optimizer never updates.
    eval_model = copy.deepcopy(model) if args.has("stale_eval_copy") else model
    reduction = "sum" if args.has("sum_loss") else "mean"
    named = list(model.named_parameters())
    eval_steps = set(cfg.eval_steps())
    best_loss, best_state = float("inf"), copy.deepcopy(model.state_dict())

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with cli.start_run(args, hardware=device) as run:
        probe = refrun.torch.instrument(run, model=model, optimizer=opt)
        replay_from = None if args.resume is None else args.resume.interrupt
        ckpt: dict = {}
        for step in args.step_order():
            idx = batches[step]
            with probe.step(step):
                opt.zero_grad(set_to_none=False)
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx], reduction=reduction)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    probe.log(loss=loss.detach(), grad_norm=grad_norms(named))
            if step in eval_steps:
                val_loss, val_acc = evaluate(eval_model, x_val, y_val)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                if float(val_loss) < best_loss:  # outside the step: a deliberate host read
                    best_loss, best_state = float(val_loss), copy.deepcopy(model.state_dict())
                cli.progress(args, step, float(val_loss), float(val_acc))
            if args.resume is not None and step == args.resume.checkpoint:
                ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                      "best": (best_loss, best_state)})
            if step == replay_from:  # the "crash": restart from the checkpoint
                replay_from = None
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
                best_loss, best_state = copy.deepcopy(ckpt["best"])
        # Final evaluation of the model the run delivers: the best checkpoint, reloaded.
        if not args.has("no_best_reload"):
            model.load_state_dict(best_state)
        final_loss, final_acc = evaluate(eval_model, x_val, y_val)
        test_loss, test_acc = evaluate(eval_model, x_test, y_test)
        probe.log_eval(cfg.steps - 1, final_val_loss=final_loss, final_val_accuracy=final_acc,
                       test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    print(f"[{args.variant}] run {run.run_id}  test acc {float(test_acc):.4f}  "
          f"test loss {float(test_loss):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
