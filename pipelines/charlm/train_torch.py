"""The reference: the character-level transformer LM trained with PyTorch (CPU here,
CUDA on a GPU machine).

    python -m pipelines.charlm.train_torch --seed 0 --role reference

One step: a batch of windows of the training text, the embeddings' dropout mask of this
step (from :mod:`pipelines.charlm.data`), mean next-character cross-entropy, backward,
the global gradient norm clipped once, Adam (``torch.optim.Adam``'s update, written out in
:func:`adam_update` so that the PyTorch/XLA port runs it unchanged with the learning rate
as a device tensor) with a linear warm-up and cosine decay.  Every ``eval_every`` steps
the validation windows are evaluated; at the end the test windows.  Recorded with
``refrun.torch.instrument``: ``loss``, ``grad_norm/<group>`` (norm of the applied
gradient of the embeddings, each block, the head), ``eval/val_loss``,
``eval/val_accuracy``, ``eval/test_loss``, ``eval/test_accuracy``, step times.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import refrun.torch
from pipelines.charlm import cli
from pipelines.charlm.config import MASKED, Config, schedule
from pipelines.charlm.data import (
    VOCAB,
    batch_starts,
    dropout_mask,
    eval_keep,
    eval_starts,
    load,
    windows,
)
from pipelines.charlm.model import LN_EPS, group_of, init_params


class Attention(torch.nn.Module):
    """Causal multi-head self-attention.  ``leak``: keys ``j <= i + 1`` (the off-by-one
    defect); ``scale``: divide scores by sqrt(d_head) (False: the missing-scale defect)."""

    def __init__(self, d: int, n_head: int, leak: bool, scale: bool) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.n_head, self.leak, self.scale = n_head, leak, scale

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        b, t, d = a.shape
        h, dh = self.n_head, d // self.n_head
        q, k, v = (z.reshape(b, t, h, dh).transpose(1, 2)
                   for z in self.qkv(a).split(d, dim=-1))
        scores = q @ k.transpose(-2, -1)
        if self.scale:
            scores = scores / math.sqrt(dh)
        allowed = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(int(self.leak))
        scores = scores.masked_fill(~allowed, MASKED)
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, d: int, n_head: int, mlp_ratio: int, leak: bool, scale: bool) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d, eps=LN_EPS)
        self.attn = Attention(d, n_head, leak, scale)
        self.ln2 = torch.nn.LayerNorm(d, eps=LN_EPS)
        self.mlp = torch.nn.Sequential()
        self.mlp.add_module("fc", torch.nn.Linear(d, mlp_ratio * d))
        self.mlp.add_module("act", torch.nn.GELU(approximate="tanh"))
        self.mlp.add_module("proj", torch.nn.Linear(mlp_ratio * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class CharLM(torch.nn.Module):
    """The pre-LayerNorm GPT of :mod:`pipelines.charlm.model` (parameter names match)."""

    def __init__(self, cfg: Config, *, leak: bool = False, scale: bool = True) -> None:
        super().__init__()
        d = cfg.d_model
        self.tok_emb = torch.nn.Embedding(VOCAB, d)
        self.pos_emb = torch.nn.Embedding(cfg.context, d)
        self.blocks = torch.nn.ModuleList(
            Block(d, cfg.n_head, cfg.mlp_ratio, leak, scale) for _ in range(cfg.n_layer))
        self.ln_f = torch.nn.LayerNorm(d, eps=LN_EPS)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, VOCAB)``; ``keep``: the dropout multipliers ``(B, T, d)``."""
        h = self.tok_emb(x) + self.pos_emb.weight[: x.shape[1]]
        if keep is not None:
            h = h * keep
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_model(cfg: Config, seed: int, defects: frozenset[str] = frozenset()) -> CharLM:
    """The model with the named initial weights of ``seed`` (and the model defects)."""
    model = CharLM(cfg, leak="causal_leak" in defects, scale="no_attn_scale" not in defects)
    weights = init_params(VOCAB, cfg.context, cfg.d_model, cfg.n_layer, cfg.mlp_ratio, seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


def lm_loss(logits: torch.Tensor, y: torch.Tensor, double_shift: bool = False) -> torch.Tensor:
    """Mean next-character cross-entropy.  ``double_shift`` (defect): the targets, already
    the next characters, are shifted once more (position i is scored on ``y[i+1]``)."""
    if double_shift:
        logits, y = logits[:, :-1], y[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def adam_update(params: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
                lr: torch.Tensor, bc1: torch.Tensor, bc2: torch.Tensor, cfg: Config) -> None:
    """One Adam step in place (Kingma & Ba; ``torch.optim.Adam``'s arithmetic):
    ``m = β1·m + (1−β1)·g``, ``v = β2·v + (1−β2)·g²``,
    ``p −= lr · (m / bc1) / (sqrt(v / bc2) + eps)`` with ``bc_i = 1 − β_i^t``.
    ``lr``, ``bc1``, ``bc2`` are 0-d tensors: on XLA they are data, not constants baked
    into (and recompiling) the step."""
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


def as_tensor(mask: np.ndarray | None) -> torch.Tensor | None:
    """A NumPy dropout mask as a tensor (None stays None)."""
    return None if mask is None else torch.from_numpy(mask)


@torch.no_grad()
def evaluate(model: CharLM, x: torch.Tensor, y: torch.Tensor,
             keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, next-character accuracy) over fixed windows, 0-d tensors."""
    logits = model(x, keep)
    return lm_loss(logits, y), (logits.argmax(-1) == y).float().mean()


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "torch", __doc__.splitlines()[0])
    cfg = args.config
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small matrices: threads only add noise to step times
    corpus = load(cfg.files, cfg.val_fraction, cfg.test_fraction)
    starts = batch_starts(args.seed, cfg.steps, cfg.batch, len(corpus.train), cfg.context)
    x_val, y_val = (torch.from_numpy(a).long() for a in windows(
        corpus.val, eval_starts(len(corpus.val), cfg.context, cfg.eval_windows), cfg.context))
    x_test, y_test = (torch.from_numpy(a).long() for a in windows(
        corpus.test, eval_starts(len(corpus.test), cfg.context, cfg.eval_windows), cfg.context))
    eval_shape = (cfg.eval_windows, cfg.context, cfg.d_model)

    model = build_model(cfg, args.seed, args.defects)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="charlm-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.pt"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with cli.start_run(args, hardware=device, corpus_sha256=corpus.sha256) as run:
        probe = refrun.torch.instrument(run, model=model)
        for step in args.step_order():
            x, y = (torch.from_numpy(a).long()
                    for a in windows(corpus.train, starts[step], cfg.context))
            keep = torch.from_numpy(dropout_mask(args.seed, step, (*x.shape, cfg.d_model),
                                                 cfg.dropout))
            lr, bc1, bc2 = torch.from_numpy(schedule(cfg, step, not args.has("no_warmup")))
            with probe.step(step):
                loss = lm_loss(model(x, keep), y, args.has("double_shift"))
                for p in params:
                    p.grad = None
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                adam_update(params, m, v, lr, bc1, bc2, cfg)
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    probe.log(loss=loss.detach(), grad_norm=group_norms(named))
            if step in eval_steps:
                keep_eval = as_tensor(eval_keep(args.defects, "val", step, eval_shape,
                                                cfg.dropout))
                val_loss, val_acc = evaluate(model, x_val, y_val, keep_eval)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss))  # outside the step
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
        keep_test = as_tensor(eval_keep(args.defects, "test", cfg.steps, eval_shape,
                                        cfg.dropout))
        test_loss, test_acc = evaluate(model, x_test, y_test, keep_test)
        probe.log_eval(cfg.steps - 1, test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  test loss {float(test_loss):.4f}  "
          f"test acc {float(test_acc):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
