"""The sequences every port trains and evaluates on, and the batch order it replays.

``classes`` Markov chains over ``symbols`` symbols, generated from ``data_seed``: a shared
transition matrix ``S`` and one own matrix ``O_c`` per class, each row drawn from
``Dirichlet(concentration)``; class ``c`` moves by ``(1 - mix)·S + mix·O_c``.  A sequence
starts at a uniform symbol and takes ``length - 1`` steps of its class's chain.  Classes
are balanced round-robin.  The train and validation sets are fixed (``data_seed`` only);
which train sequences form each step's batch depends only on the training seed and the
step, so two ports given the same seed see the same batches, and a run resumed from a
checkpoint replays exactly what it would have done.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    """Symbol sequences ``(n, length)`` int32 and their classes ``(n,)`` int32."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class Data:
    train: Split
    val: Split


def chains(rng: np.random.Generator, classes: int, symbols: int, mix: float,
           concentration: float) -> np.ndarray:
    """Transition matrices ``(classes, symbols, symbols)``, rows summing to 1."""
    alpha = np.full(symbols, concentration)
    shared = rng.dirichlet(alpha, size=symbols)
    own = rng.dirichlet(alpha, size=(classes, symbols))
    return (1.0 - mix) * shared[None] + mix * own


def sample(rng: np.random.Generator, trans: np.ndarray, n: int, length: int) -> Split:
    """``n`` sequences, class ``i % classes`` for the i-th, each a walk of its chain."""
    classes, symbols, _ = trans.shape
    y = np.arange(n) % classes
    cum = np.cumsum(trans, axis=-1)
    x = np.empty((n, length), dtype=np.int32)
    x[:, 0] = rng.integers(0, symbols, size=n)
    for t in range(1, length):
        u = rng.random(n)
        row = cum[y, x[:, t - 1]]                       # (n, symbols)
        x[:, t] = np.minimum((row < u[:, None]).sum(1), symbols - 1)
    return Split(x, y.astype(np.int32))


def load(data_seed: int, classes: int, symbols: int, length: int, mix: float,
         concentration: float, n_train: int, n_val: int) -> Data:
    """The fixed train and validation sets of ``data_seed``."""
    rng = np.random.default_rng(data_seed)
    trans = chains(rng, classes, symbols, mix, concentration)
    return Data(sample(rng, trans, n_train, length), sample(rng, trans, n_val, length))


def batch_indices(seed: int, steps: int, batch: int, n: int) -> np.ndarray:
    """(steps, batch) train indices: a fresh permutation per epoch, seeded by ``seed``."""
    rng = np.random.default_rng(1_000_003 + seed)
    per_epoch = n // batch
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(n)[: per_epoch * batch] for _ in range(epochs)])
    return order[: steps * batch].reshape(steps, batch)
