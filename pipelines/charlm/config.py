"""The charlm configuration (``config.toml``) as a typed, frozen dataclass."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError

CONFIG_PATH = Path(__file__).with_name("config.toml")
MASKED = -1e9  # score of a masked key (finite: the same constant in every port)


@dataclass(frozen=True)
class Config:
    """Hyperparameters shared by every port; see config.toml for what each means."""

    workload: str
    files: tuple[str, ...]
    val_fraction: float
    test_fraction: float
    eval_windows: int
    context: int
    d_model: int
    n_head: int
    n_layer: int
    mlp_ratio: int
    dropout: float
    steps: int
    batch: int
    lr: float
    warmup_steps: int
    min_lr_fraction: float
    beta1: float
    beta2: float
    eps: float
    clip_norm: float
    eval_every: int
    log_every: int

    def with_overrides(self, *, quick: bool = False, quick_table: dict[str, Any] | None = None,
                       **explicit: Any) -> Config:
        """A copy with the ``[quick]`` table and then explicit (non-None) overrides applied."""
        cfg = replace(self, **quick_table) if quick and quick_table else self
        return replace(cfg, **{k: v for k, v in explicit.items() if v is not None})

    def eval_steps(self) -> list[int]:
        """Steps after which the validation set is evaluated: every ``eval_every``-th step
        (0-based: eval_every-1, 2*eval_every-1, ...) and the last step."""
        steps = list(range(self.eval_every - 1, self.steps, self.eval_every))
        if not steps or steps[-1] != self.steps - 1:
            steps.append(self.steps - 1)
        return steps

    def learning_rate(self, step: int, *, warmup: bool = True) -> float:
        """Learning rate of 0-based ``step``: linear warm-up ``lr·(step+1)/warmup_steps``
        for the first ``warmup_steps`` steps, then cosine decay from ``lr`` to
        ``lr·min_lr_fraction`` at the last step.  ``warmup=False`` is the skipped-warm-up
        defect (the cosine starts at step 0)."""
        w = self.warmup_steps if warmup else 0
        if step < w:
            return self.lr * (step + 1) / w
        span = max(self.steps - 1 - w, 1)
        progress = min((step - w) / span, 1.0)
        floor = self.lr * self.min_lr_fraction
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))


def schedule(cfg: Config, step: int, warmup: bool) -> np.ndarray:
    """``[lr, 1 − β1^t, 1 − β2^t]`` of 0-based ``step`` (t = step + 1), float32: the Adam
    update's per-step scalars, shared by every port (framework-free, so the JAX port runs
    where torch is not installed, e.g. a TPU VM)."""
    t = step + 1
    return np.array([cfg.learning_rate(step, warmup=warmup), 1.0 - cfg.beta1 ** t,
                     1.0 - cfg.beta2 ** t], dtype=np.float32)


_INT = ("eval_windows", "context", "d_model", "n_head", "n_layer", "mlp_ratio", "steps",
        "batch", "warmup_steps", "eval_every", "log_every")
_FLOAT = ("val_fraction", "test_fraction", "dropout", "lr", "min_lr_fraction", "beta1",
          "beta2", "eps", "clip_norm")


def load_config(path: Path = CONFIG_PATH, *, quick: bool = False, **explicit: Any) -> Config:
    """Read ``path`` (``explicit``: keyword overrides such as ``steps=``, None ignored);
    raises :class:`RefrunInputError` naming the file and key when a key is missing or has
    the wrong type."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RefrunInputError(f"{path}: {exc}") from None
    try:
        flat = {**raw["data"], **raw["model"], **raw["train"]}
        values: dict[str, Any] = {"workload": str(raw["workload"]["name"]),
                                  "files": tuple(str(f) for f in flat["files"])}
        for k in _INT:
            values[k] = int(flat[k])
        for k in _FLOAT:
            values[k] = float(flat[k])
        cfg = Config(**values)
    except KeyError as exc:
        raise RefrunInputError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise RefrunInputError(f"{path}: bad value ({exc})") from None
    if cfg.d_model % cfg.n_head:
        raise RefrunInputError(f"{path}: d_model {cfg.d_model} is not a multiple of "
                               f"n_head {cfg.n_head}")
    quick_table = {k: (int(v) if k in _INT else float(v))
                   for k, v in raw.get("quick", {}).items()}
    return cfg.with_overrides(quick=quick, quick_table=quick_table, **explicit)
