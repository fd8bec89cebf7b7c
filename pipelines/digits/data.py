"""scikit-learn's bundled digits (1,797 8x8 images, shipped with the package: no download),
a fixed train/val/test split, and the batch order every port replays.

Images are scaled to [0, 1] (pixel / 16) as float32; labels are int32 (JAX's default
integer) and converted by the torch ports.  The split depends only on ``split_seed``;
the batch order depends only on the training seed, so two ports given the same seed see
the same batches in the same order.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Split:
    """Arrays of one split: ``x`` (n, 64) float32 in [0, 1], ``y`` (n,) int32 in 0..9."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class Digits:
    train: Split
    val: Split
    test: Split


def digits_csv() -> Path:
    """scikit-learn's bundled ``datasets/data/digits.csv.gz``, found without importing
    scikit-learn (importing ``sklearn.datasets`` costs ~2 s in each training process)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed: it ships the digits data set")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"


def raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 64) float64 in 0..16, labels (1797,) int64): the rows
    ``sklearn.datasets.load_digits()`` returns, read from the same file the same way."""
    table = np.loadtxt(digits_csv(), delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load(split_seed: int, n_train: int, n_val: int) -> Digits:
    """The three splits of a fixed permutation (``numpy.random.default_rng(split_seed)``)."""
    data, target = raw_digits()
    order = np.random.default_rng(split_seed).permutation(len(target))
    x = (data[order] / 16.0).astype(np.float32)
    y = target[order].astype(np.int32)
    a, b = n_train, n_train + n_val
    return Digits(Split(x[:a], y[:a]), Split(x[a:b], y[a:b]), Split(x[b:], y[b:]))


def batch_indices(seed: int, steps: int, batch: int, n: int) -> np.ndarray:
    """(steps, batch) training indices: epochs of a seeded permutation, cut into batches
    (an epoch's tail that does not fill a batch continues into the next epoch's order)."""
    rng = np.random.default_rng(1_000_003 + seed)
    need = steps * batch
    order = np.concatenate([rng.permutation(n) for _ in range(need // n + 1)])
    return order[:need].reshape(steps, batch)
