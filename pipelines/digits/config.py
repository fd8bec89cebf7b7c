"""The workload configuration (``config.toml``) as a typed, frozen dataclass."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from refrun.errors import RefrunInputError

CONFIG_PATH = Path(__file__).with_name("config.toml")


@dataclass(frozen=True)
class Config:
    """Hyperparameters shared by every port; see config.toml for what each means."""

    workload: str
    split_seed: int
    n_train: int
    n_val: int
    sizes: tuple[int, ...]
    steps: int
    batch: int
    lr: float
    momentum: float
    clip_norm: float
    eval_every: int
    log_every: int

    def with_overrides(self, *, quick: bool = False, steps: int | None = None,
                       log_every: int | None = None, eval_every: int | None = None,
                       quick_table: dict | None = None, batch: int | None = None,
                       lr: float | None = None) -> Config:
        """A copy with the ``[quick]`` table and explicit overrides applied (in that order)."""
        cfg = self
        if quick and quick_table:
            cfg = replace(cfg, **quick_table)
        changes = {k: v for k, v in (("steps", steps), ("log_every", log_every),
                                     ("eval_every", eval_every), ("batch", batch),
                                     ("lr", lr))
                   if v is not None}
        return replace(cfg, **changes)

    def eval_steps(self) -> list[int]:
        """Steps after which the validation set is evaluated: every ``eval_every``-th step
        (0-based: eval_every-1, 2*eval_every-1, ...) and the last step."""
        steps = list(range(self.eval_every - 1, self.steps, self.eval_every))
        if not steps or steps[-1] != self.steps - 1:
            steps.append(self.steps - 1)
        return steps


def load_config(path: Path = CONFIG_PATH, *, quick: bool = False, steps: int | None = None,
                log_every: int | None = None, eval_every: int | None = None,
                batch: int | None = None, lr: float | None = None) -> Config:
    """Read ``path``; raises :class:`RefrunInputError` naming the file and key when a key is
    missing or has the wrong type."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RefrunInputError(f"{path}: {exc}") from None
    try:
        d, m, t = raw["data"], raw["model"], raw["train"]
        cfg = Config(
            workload=str(raw["workload"]["name"]), split_seed=int(d["split_seed"]),
            n_train=int(d["n_train"]), n_val=int(d["n_val"]),
            sizes=tuple(int(s) for s in m["sizes"]), steps=int(t["steps"]),
            batch=int(t["batch"]), lr=float(t["lr"]), momentum=float(t["momentum"]),
            clip_norm=float(t["clip_norm"]), eval_every=int(t["eval_every"]),
            log_every=int(t["log_every"]),
        )
    except KeyError as exc:
        raise RefrunInputError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise RefrunInputError(f"{path}: bad value ({exc})") from None
    quick_table = {k: int(v) for k, v in raw.get("quick", {}).items()}
    return cfg.with_overrides(quick=quick, steps=steps, log_every=log_every,
                              eval_every=eval_every, quick_table=quick_table, batch=batch,
                              lr=lr)
