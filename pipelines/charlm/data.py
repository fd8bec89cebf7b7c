"""The text, its characters as token ids, the fixed splits, and what every port replays:
the batch windows and the dropout masks of each step.

The corpus is a fixed, sorted selection of the running Python's standard-library sources
(``config.toml`` ``[data] files``), concatenated: nothing is downloaded.  The vocabulary is
fixed and independent of the text: ``"\\n"``, the 95 printable ASCII characters, and one
id for any other character (97 ids).  The splits are the text's head (train) and tail
(validation, then test).  Batch windows depend only on the training seed and the step;
dropout masks only on the seed and the step, so two ports given the same seed see the same
windows and drop the same activations at every step, and a run resumed from a checkpoint
replays exactly what it would have done.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(ALPHABET)          # id of every character outside ALPHABET
VOCAB = len(ALPHABET) + 1        # 97
_LOOKUP = np.full(0x110000, UNKNOWN, dtype=np.int32)
_LOOKUP[[ord(c) for c in ALPHABET]] = np.arange(len(ALPHABET), dtype=np.int32)


@dataclass(frozen=True)
class Corpus:
    """Token ids of each split (int32) and the sha256 of the text they come from."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    sha256: str


def stdlib_dir() -> Path:
    """``Lib/`` of the running Python (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_text(files: tuple[str, ...]) -> str:
    """The named standard-library modules' sources, sorted by name, concatenated."""
    root = stdlib_dir()
    return "".join((root / f"{name}.py").read_text(encoding="utf-8") for name in sorted(files))


def encode(text: str) -> np.ndarray:
    """Token ids (int32) of ``text``: index in ALPHABET, else UNKNOWN."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _LOOKUP[codes]


def load(files: tuple[str, ...], val_fraction: float, test_fraction: float) -> Corpus:
    """The three splits: the head of the text for training, then validation, then test."""
    text = corpus_text(files)
    ids = encode(text)
    n = len(ids)
    a = round(n * (1.0 - val_fraction - test_fraction))
    b = round(n * (1.0 - test_fraction))
    return Corpus(ids[:a], ids[a:b], ids[b:], hashlib.sha256(text.encode()).hexdigest())


def windows(ids: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each ``(len(starts), context)`` int32: ``ids[s:s+context]`` and
    the next character of each, ``ids[s+1:s+context+1]``."""
    offsets = starts[:, None] + np.arange(context)[None, :]
    return ids[offsets], ids[offsets + 1]


def batch_starts(seed: int, steps: int, batch: int, n: int, context: int) -> np.ndarray:
    """(steps, batch) window starts in a split of ``n`` ids, uniform, seeded by ``seed``."""
    rng = np.random.default_rng(1_000_003 + seed)
    return rng.integers(0, n - context - 1, size=(steps, batch))


def eval_starts(n: int, context: int, count: int) -> np.ndarray:
    """``count`` fixed, evenly spaced window starts over a split of ``n`` ids."""
    return np.linspace(0, n - context - 1, count).astype(np.int64)


def dropout_mask(seed: int, step: int, shape: tuple[int, ...], rate: float) -> np.ndarray:
    """Inverted-dropout multipliers for one step: 0 with probability ``rate``, else
    ``1 / (1 - rate)``, float32, from ``default_rng([2_000_003 + seed, step])``."""
    if rate <= 0.0:
        return np.ones(shape, dtype=np.float32)
    keep = np.random.default_rng([2_000_003 + seed, step]).random(shape) >= rate
    return (keep / (1.0 - rate)).astype(np.float32)


EVAL_MASK_SEED = {"val": 3_000_017, "test": 3_000_019}


def eval_keep(defects: frozenset[str], split: str, step: int, shape: tuple[int, ...],
              rate: float) -> np.ndarray | None:
    """The dropout multipliers an evaluation applies: None (no dropout, the correct
    evaluation) unless the ``eval_dropout`` defect leaves dropout on."""
    if "eval_dropout" not in defects:
        return None
    return dropout_mask(EVAL_MASK_SEED[split], step, shape, rate)
