"""PyTorch Lightning: ``refrun.lightning.RefrunCallback`` records a ``Trainer.fit`` run.

::

    import lightning.pytorch as pl   # or: import pytorch_lightning as pl
    import refrun, refrun.lightning

    with refrun.start_run("mlp", "reference", hardware="cpu", backend="torch",
                          global_batch=32) as run:
        trainer = pl.Trainer(max_epochs=2, callbacks=[refrun.lightning.RefrunCallback(run)])
        trainer.fit(model, train_loader, val_loader)

A thin layer on :func:`refrun.torch.instrument` (see :mod:`refrun.probes.trainer`): each optimizer
step is a probe step (``trainer.global_step`` at its start), the loss ``training_step``
returned is logged without a host sync, validation metrics (``trainer.callback_metrics``
after validation) become ``eval/<name>``.  Requires the ``lightning`` extra
(``pip install refrun[lightning]``); importing refrun never imports Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from refrun.probes.trainer import TrainerRecorder

try:  # the unified package first, then the standalone one
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning.callbacks import Callback as _Callback

if TYPE_CHECKING:
    from refrun import RunSession

__all__ = ["RefrunCallback"]


def batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (tuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            n = batch_size(item)
            if n is not None:
                return n
    return None


class RefrunCallback(_Callback):
    """Records a Lightning run through the PyTorch probe.

    ``run``: an open :class:`~refrun.RunSession` (or None with ``start_run`` keyword
    arguments: the callback starts the run at fit start and ends it at fit end).
    ``instrument``: keyword arguments for :func:`refrun.torch.instrument` (``monitors``,
    ``warmup_steps`` ...).  Samples per step: the run's ``refrun.global_batch``, else the
    batch's first dimension times the trainer's world size.
    """

    def __init__(self, run: RunSession | None = None, *,
                 instrument: dict[str, Any] | None = None, **start_run: Any) -> None:
        super().__init__()
        self._kwargs = dict(instrument or {})
        self.recorder = TrainerRecorder(self._make_probe, run, start_run)
        self._module: Any = None
        self._optimizer: Any = None
        self._world_size = 1

    def _make_probe(self, run: RunSession) -> Any:
        import refrun.torch

        return refrun.torch.instrument(run, model=self._module, optimizer=self._optimizer,
                                       **self._kwargs)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._module = pl_module
        opts = trainer.optimizers
        self._optimizer = opts[0] if opts else None
        self._world_size = int(trainer.world_size)  # fixed for a fit; a property chain
        self.recorder.start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        # Walk the batch only when the run declared no global batch (the per-step cost a
        # callback adds beyond the probe's own; see docs/callbacks.md).
        n = batch_size(batch) if self.recorder.needs_samples else None
        self.recorder.begin_step(trainer.global_step,
                                 None if n is None else n * self._world_size)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor | float):
            self.recorder.end_step(loss=loss)
        else:
            self.recorder.end_step()

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: v for k, v in trainer.callback_metrics.items()
                   if k.startswith("val") and isinstance(v, torch.Tensor | float)}
        step = int(trainer.global_step) - 1
        self.recorder.log_eval(step if step >= 0 else None, metrics)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.recorder.close()
