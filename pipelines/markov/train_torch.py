"""The reference: the GRU sequence classifier trained with PyTorch (CPU here, CUDA on a GPU
machine).

    python -m pipelines.markov.train_torch --seed 0 --role reference

One step: a batch of training sequences, mean cross-entropy of the classes from the last
hidden state, backward, the global gradient norm clipped once, Adam (``torch.optim.Adam``'s
update, written out in :func:`adam_update` so that the PyTorch/XLA port runs it unchanged
with the bias corrections as device tensors).  Every ``eval_every`` steps and at the end
the validation set is evaluated.  Recorded with ``refrun.torch.instrument``: ``loss``,
``grad_norm/<group>`` (norm of the applied gradient of ``embed``, ``gru``, ``head``),
``eval/val_loss``, ``eval/val_accuracy``, step times.  No one-value metric: the workload's
only evaluation is the periodic one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import refrun.torch
from pipelines.markov import cli
from pipelines.markov.config import Config, schedule
from pipelines.markov.data import batch_indices, load
from pipelines.markov.model import group_of, init_params


class GRU(torch.nn.Module):
    """One GRU layer with torch.nn.GRU's parameters and equations (h₀ = 0), unrolled over
    time; returns the last hidden state.  ``gate_swap`` (defect): ``h = z·n + (1−z)·h``."""

    def __init__(self, embed: int, hidden: int, gate_swap: bool = False) -> None:
        super().__init__()
        self.weight_ih = torch.nn.Parameter(torch.empty(3 * hidden, embed))
        self.weight_hh = torch.nn.Parameter(torch.empty(3 * hidden, hidden))
        self.bias_ih = torch.nn.Parameter(torch.empty(3 * hidden))
        self.bias_hh = torch.nn.Parameter(torch.empty(3 * hidden))
        self.hidden, self.gate_swap = hidden, gate_swap

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        gi = e @ self.weight_ih.T + self.bias_ih               # (B, T, 3H): all inputs at once
        h = torch.zeros(e.shape[0], self.hidden, dtype=e.dtype, device=e.device)
        for t in range(e.shape[1]):
            gh = h @ self.weight_hh.T + self.bias_hh
            i_r, i_z, i_n = gi[:, t].chunk(3, dim=-1)
            h_r, h_z, h_n = gh.chunk(3, dim=-1)
            r = torch.sigmoid(i_r + h_r)
            z = torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = z * n + (1 - z) * h if self.gate_swap else (1 - z) * n + z * h
        return h


class Classifier(torch.nn.Module):
    """Embedding, GRU, linear head on the last hidden state (:mod:`pipelines.markov.model`)."""

    def __init__(self, cfg: Config, gate_swap: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(cfg.symbols, cfg.embed)
        self.gru = GRU(cfg.embed, cfg.hidden, gate_swap)
        self.head = torch.nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x)))


def build_model(cfg: Config, seed: int, defects: frozenset[str] = frozenset()) -> Classifier:
    """The model with the named initial weights of ``seed`` (and the model defects)."""
    model = Classifier(cfg, gate_swap="gate_swap" in defects)
    weights = init_params(cfg.symbols, cfg.embed, cfg.hidden, cfg.classes, seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


@torch.no_grad()
def adam_update(params: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
                sched: torch.Tensor, cfg: Config) -> None:
    """One Adam step in place (Kingma & Ba; ``torch.optim.Adam``'s arithmetic):
    ``m = β1·m + (1−β1)·g``, ``v = β2·v + (1−β2)·g²``,
    ``p −= lr · (m / bc1) / (sqrt(v / bc2) + eps)`` with ``bc_i = 1 − β_i^t``.
    ``sched = [lr, bc1, bc2]`` is a tensor: on XLA it is data, not constants baked into
    (and recompiling) the step."""
    lr, bc1, bc2 = sched[0], sched[1], sched[2]
    for p, mi, vi in zip(params, m, v, strict=True):
        g = p.grad
        mi.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
        vi.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
        p.sub_(lr * (mi / bc1) / ((vi / bc2).sqrt() + cfg.eps))


def group_norms(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """L2 norm of the applied gradient of each module group (:func:`model.group_of`)."""
    sq: dict[str, torch.Tensor] = {}
    for n, p in named:
        g = group_of(n)
        sq[g] = sq[g] + p.grad.pow(2).sum() if g in sq else p.grad.pow(2).sum()
    return {g: s.sqrt() for g, s in sq.items()}


def loss_of(logits: torch.Tensor, y: torch.Tensor, sum_loss: bool = False) -> torch.Tensor:
    """Cross-entropy over the batch: mean (``sum_loss``, the defect: summed)."""
    return F.cross_entropy(logits, y, reduction="sum" if sum_loss else "mean")


@torch.no_grad()
def evaluate(model: Classifier, x: torch.Tensor, y: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) over a whole split, 0-d tensors."""
    logits = model(x)
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small matrices: threads only add noise to step times
    data = load(cfg.data_seed, cfg.classes, cfg.symbols, cfg.length, cfg.mix,
                cfg.concentration, cfg.n_train, cfg.n_val)
    x_train, y_train = torch.from_numpy(data.train.x).long(), torch.from_numpy(data.train.y).long()
    x_val, y_val = torch.from_numpy(data.val.x).long(), torch.from_numpy(data.val.y).long()
    batches = torch.from_numpy(batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train))

    model = build_model(cfg, args.seed, args.defects)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="markov-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.pt"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with cli.start_run(args, hardware=device) as run:
        probe = refrun.torch.instrument(run, model=model)
        for step in args.step_order():
            idx = batches[step]
            sched = torch.from_numpy(schedule(cfg, step))
            with probe.step(step):
                loss = loss_of(model(x_train[idx]), y_train[idx], args.has("sum_loss"))
                for p in params:
                    p.grad = None
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                adam_update(params, m, v, sched, cfg)
                if args.logs(step):
                    probe.log(loss=loss.detach(), grad_norm=group_norms(named))
            if step in eval_steps:
                val_loss, val_acc = evaluate(model, x_val, y_val)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss), float(val_acc))  # outside the step
            if args.resume is not None and step == args.resume.checkpoint:
                torch.save({"params": [p.detach().clone() for p in params], "m": m, "v": v},
                           ckpt)
            if step == replay_from:  # the "crash": restart from the checkpoint
                replay_from = None
                state = torch.load(ckpt)
                with torch.no_grad():
                    for dst, src in zip([*params, *m, *v],
                                        [*state["params"], *state["m"], *state["v"]],
                                        strict=True):
                        dst.copy_(src)
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  val loss {float(val_loss):.4f}  "
          f"val acc {float(val_acc):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
