"""The markov configuration (``config.toml``) as a typed, frozen dataclass."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError

CONFIG_PATH = Path(__file__).with_name("config.toml")


@dataclass(frozen=True)
class Config:
    """Hyperparameters shared by every port; see config.toml for what each means."""

    workload: str
    data_seed: int
    classes: int
    symbols: int
    length: int
    mix: float
    concentration: float
    n_train: int
    n_val: int
    embed: int
    hidden: int
    steps: int
    batch: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    clip_norm: float
    eval_every: int
    log_every: int

    def eval_steps(self) -> list[int]:
        """Steps after which the validation set is evaluated: every ``eval_every``-th step
        (0-based: eval_every-1, 2*eval_every-1, ...) and the last step."""
        steps = list(range(self.eval_every - 1, self.steps, self.eval_every))
        if not steps or steps[-1] != self.steps - 1:
            steps.append(self.steps - 1)
        return steps


def schedule(cfg: Config, step: int) -> np.ndarray:
    """``[lr, 1 − β1^t, 1 − β2^t]`` of 0-based ``step`` (t = step + 1), float32: the Adam
    update's per-step scalars, shared by every port (framework-free, so the JAX port runs
    where torch is not installed, e.g. a TPU VM)."""
    t = step + 1
    return np.array([cfg.lr, 1.0 - cfg.beta1 ** t, 1.0 - cfg.beta2 ** t], dtype=np.float32)


_INT = ("data_seed", "classes", "symbols", "length", "n_train", "n_val", "embed", "hidden",
        "steps", "batch", "eval_every", "log_every")
_FLOAT = ("mix", "concentration", "lr", "beta1", "beta2", "eps", "clip_norm")


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
        values: dict[str, Any] = {"workload": str(raw["workload"]["name"])}
        for k in _INT:
            values[k] = int(flat[k])
        for k in _FLOAT:
            values[k] = float(flat[k])
        cfg = Config(**values)
        quick_table = {k: (int(v) if k in _INT else float(v))
                       for k, v in raw.get("quick", {}).items()}
    except KeyError as exc:
        raise RefrunInputError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise RefrunInputError(f"{path}: bad value ({exc})") from None
    if quick:
        cfg = replace(cfg, **quick_table)
    return replace(cfg, **{k: v for k, v in explicit.items() if v is not None})
