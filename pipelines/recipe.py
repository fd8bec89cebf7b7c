"""The training recipe's knobs the three pipelines share: the ``--lr`` option and the rule
that scales a learning rate with the global batch.

The rule lives here, not in refrun: refrun's probes record the learning rate a run used
(``opt/lr``), not which optimiser family it belongs to, so only the training code can say
which rule applies; the pipelines' variants use it to write the recipe of a run at another
global batch (``pipelines/*/variants.py``, the ``*-batch2x`` candidates).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from refrun.acceptance.batch_scaling import LINEAR, SQUARE_ROOT, factor

# Optimiser family -> scaling rule (see :func:`scaled_lr`; the rules themselves live in
# refrun.acceptance.batch_scaling, which recognises them in a candidate's learning rate).
RULES: dict[str, str] = {"sgd": LINEAR, "adam": SQUARE_ROOT, "adamw": SQUARE_ROOT}


def scaled_lr(lr: float, batch: int, new_batch: int, optimizer: str) -> float:
    """The learning rate for ``new_batch`` samples per step given ``lr`` at ``batch``, by
    the scaling rule of ``optimizer`` (``sgd`` with or without momentum, ``adam``,
    ``adamw``), with ``kappa = new_batch / batch``:

    * SGD (with momentum): linear, ``lr' = kappa * lr`` (Goyal et al. 2017, "Accurate,
      Large Minibatch SGD: Training ImageNet in 1 Hour", section 2.1: ``k`` steps of
      batch ``B`` at ``lr`` approximate one step of batch ``kB`` at ``k * lr`` while the
      gradient changes little over those steps; the approximation fails early in training,
      which the paper bridges with a gradual warm-up, and the momentum is kept).
    * Adam / AdamW: square root, ``lr' = sqrt(kappa) * lr`` (Malladi et al. 2022, "On the
      SDEs and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS: the rule that
      keeps Adam's SDE approximation; their full rule also sets ``1 - beta_i' = kappa (1 -
      beta_i)`` and ``eps' = eps / sqrt(kappa)``, which this function does not compute:
      it returns the learning rate only).

    Raises ValueError for a non-positive or non-finite ``lr``, a batch below 1 or an
    optimiser family it has no rule for."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"learning rate {lr!r}: expected a positive finite number")
    if batch < 1 or new_batch < 1:
        raise ValueError(f"batch {batch} -> {new_batch}: expected positive batch sizes")
    rule = RULES.get(optimizer.lower())
    if rule is None:
        raise ValueError(f"optimizer {optimizer!r}: no scaling rule (known: "
                         f"{', '.join(RULES)})")
    kappa = new_batch / batch
    return lr * factor(rule, kappa)


def lr_option(text: str) -> float:
    """argparse ``type=`` of ``--lr``: a positive finite float (a usage error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr {text!r}: expected a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--lr {text!r}: expected a positive finite number")
    return value


@dataclass(frozen=True)
class ScaledRecipe:
    """A pipeline's command-line arguments for its reference recipe at ``factor`` times the
    global batch (:func:`batch_scaled`): ``args`` for every run, ``quick_args`` /
    ``full_args`` for a ``--quick`` / full one (the steps depend on the run's size)."""

    args: tuple[str, ...]
    quick_args: tuple[str, ...]
    full_args: tuple[str, ...]


def batch_scaled(*, batch: int, lr: float, optimizer: str, quick_steps: int,
                 full_steps: int, factor: int = 2,
                 warmup_steps: int | None = None) -> ScaledRecipe:
    """The reference recipe at ``factor`` x the global batch, per sample seen as the
    references: the learning rate by :func:`scaled_lr`, the steps (and a warm-up counted
    in steps) divided by ``factor`` (rounded up), so that the run ends, and a schedule
    defined in steps warms up and decays, at the samples the references' do."""
    if factor < 1:
        raise ValueError(f"factor {factor}: expected 1 or more")
    new_lr = scaled_lr(lr, batch, batch * factor, optimizer)
    args = ("--batch", str(batch * factor), "--lr", repr(new_lr))
    if warmup_steps is not None:
        args += ("--warmup-steps", str(-(-warmup_steps // factor)))
    return ScaledRecipe(args, ("--steps", str(-(-quick_steps // factor))),
                        ("--steps", str(-(-full_steps // factor))))
