"""Hugging Face Transformers: ``refrun.hf.RefrunCallback`` records a ``Trainer`` run.

::

    import refrun, refrun.hf
    from transformers import Trainer, TrainingArguments

    with refrun.start_run("tiny-gpt2", "reference", hardware="cpu", backend="torch") as run:
        trainer = Trainer(model=model, args=TrainingArguments(..., logging_steps=1),
                          train_dataset=train, eval_dataset=val,
                          callbacks=[refrun.hf.RefrunCallback(run)])
        trainer.train()

A thin layer on :func:`refrun.torch.instrument` (see :mod:`refrun.probes.trainer`): each optimizer
step is a probe step (``state.global_step`` at its start, so step ``n`` is the ``n+1``-th
update); ``loss`` and evaluation metrics come from the Trainer's own ``on_log`` (the
Trainer has already read them to the host, averaged over ``logging_steps``: use
``logging_steps=1`` for a per-step loss), ``eval_<name>`` recorded as ``eval/<name>``.
Samples per step: the run's ``refrun.global_batch``, else ``per_device_train_batch_size x
gradient_accumulation_steps x world_size``.  Requires the ``hf`` extra
(``pip install refrun[hf]``); importing refrun never imports transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from refrun.probes.trainer import TrainerRecorder

if TYPE_CHECKING:
    from refrun import RunSession

__all__ = ["RefrunCallback"]

# Trainer log keys recorded as train/<key>, and evaluation keys that are bookkeeping.
_TRAIN = frozenset({"grad_norm", "learning_rate"})
_EVAL_SKIP = frozenset({"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"})


class RefrunCallback(TrainerCallback):
    """Records a Transformers ``Trainer`` run through the PyTorch probe.

    ``run``: an open :class:`~refrun.RunSession` (or None with ``start_run`` keyword
    arguments: started at train begin, ended at train end).  ``instrument``: keyword
    arguments for :func:`refrun.torch.instrument`.  ``grad_norm`` and ``learning_rate``
    from the Trainer's logs are recorded as ``train/grad_norm`` and ``train/learning_rate``.
    """

    def __init__(self, run: RunSession | None = None, *,
                 instrument: dict[str, Any] | None = None, **start_run: Any) -> None:
        self._kwargs = dict(instrument or {})
        self._model: Any = None
        self._optimizer: Any = None
        self.recorder = TrainerRecorder(self._make_probe, run, start_run)

    def _make_probe(self, run: RunSession) -> Any:
        import refrun.torch

        return refrun.torch.instrument(run, model=self._model, optimizer=self._optimizer,
                                       **self._kwargs)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._model, self._optimizer = model, optimizer
        self.recorder.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        samples = None
        if self.recorder.needs_samples:  # args.world_size is a property chain: only then
            samples = (int(args.per_device_train_batch_size)
                       * int(args.gradient_accumulation_steps) * int(args.world_size))
        self.recorder.begin_step(state.global_step, samples)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.end_step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not logs:
            return
        step = max(int(state.global_step) - 1, 0)  # the step that just ended
        train: dict[str, float] = {}
        evals: dict[str, float] = {}
        for k, v in logs.items():  # one pass: this runs every step with logging_steps=1
            if not isinstance(v, int | float):
                continue
            if k == "loss":
                train["loss"] = float(v)
            elif k in _TRAIN:
                train[f"train/{k}"] = float(v)
            elif k.startswith("eval_") and k not in _EVAL_SKIP:
                evals[k[len("eval_"):]] = float(v)
        self.recorder.log(step, **train)
        self.recorder.log_eval(step, evals)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.close()
