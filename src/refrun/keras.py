"""Keras 3 on the JAX backend: ``refrun.keras.RefrunCallback`` records a ``model.fit`` run.

::

    import os; os.environ["KERAS_BACKEND"] = "jax"
    import keras, refrun, refrun.keras

    with refrun.start_run("mlp", "candidate", hardware="cpu", backend="jax",
                          global_batch=32) as run:
        model.fit(x, y, batch_size=32, epochs=2, validation_data=(xv, yv),
                  callbacks=[refrun.keras.RefrunCallback(run)])

A thin layer on :func:`refrun.jax.instrument` (see :mod:`refrun.probes.trainer`): each call of
Keras's compiled train function is a probe step (numbered from 0 over the whole fit), the
``loss`` it returns (Keras's running mean over the epoch, as in its logs) is logged as the
device value it is, ``val_<name>`` at epoch end is recorded as ``eval/<name>``, and the
train function counts as the step function (compilations by call site; evaluation and
eager helpers are ``compile/other``).

Why the callback wraps ``model.train_function`` instead of defining
``on_train_batch_begin``/``on_train_batch_end``: a callback that defines a batch-end
method (and is not ``async_safe``) makes Keras's ``CallbackList`` convert the batch logs
to Python floats on the training thread every batch (``pythonify_logs``: a host sync that
waits for the step), which on a few-ms step costs far more than the probe.  Without one,
Keras dispatches batch ends to its thread pool and the training thread never waits; the
wrapper logs the loss device value, which the probe reads without blocking (and whose
readiness times the step).  Requires the ``keras`` extra (``pip install refrun[keras]``);
importing refrun never imports Keras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

from refrun.errors import RefrunInputError
from refrun.probes.trainer import TrainerRecorder

if TYPE_CHECKING:
    from refrun import RunSession

__all__ = ["RefrunCallback"]


class RefrunCallback(keras.callbacks.Callback):
    """Records a Keras 3 ``fit`` through the JAX probe.

    ``run``: an open :class:`~refrun.RunSession` (or None with ``start_run`` keyword
    arguments: started at train begin, ended at train end).  ``instrument``: keyword
    arguments for :func:`refrun.jax.instrument`.  Samples per step: the run's
    ``refrun.global_batch`` (Keras does not tell a callback the batch size).

    Raises :class:`RefrunInputError` when Keras does not run on the JAX backend.
    """

    def __init__(self, run: RunSession | None = None, *,
                 instrument: dict[str, Any] | None = None, **start_run: Any) -> None:
        super().__init__()
        if keras.backend.backend() != "jax":
            raise RefrunInputError(f"refrun.keras: Keras runs on {keras.backend.backend()!r};"
                                   " set KERAS_BACKEND=jax before importing keras")
        self._kwargs = dict(instrument or {})
        self._n = 0
        self._train_function: Any = None
        self.recorder = TrainerRecorder(self._make_probe, run, start_run)

    def _make_probe(self, run: RunSession) -> Any:
        import refrun.jax

        params = [v.value for v in self.model.trainable_variables] if self.model else None
        return refrun.jax.instrument(run, params=params, **self._kwargs)

    def _step(self, state: Any, data: Any) -> Any:
        """Keras's train function inside a probe step: ``(logs, state)`` as it returns."""
        recorder = self.recorder
        recorder.begin_step(self._n)
        try:
            logs, state = self._train_function(state, data)
        except BaseException:
            recorder.end_step()
            self._restore()  # Keras skips on_train_end when fit raises
            raise
        loss = logs.get("loss") if isinstance(logs, dict) else None
        if loss is not None:
            recorder.end_step(loss=loss)
        else:
            recorder.end_step()
        self._n += 1
        return logs, state

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.recorder.start()
        # fit() made the train function just before this call; restored at train end.
        fn = getattr(self.model, "train_function", None)
        if fn is not None and self._train_function is None:
            self._train_function = fn
            self.model.train_function = self._step

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        evals = {k[len("val_"):]: float(v) for k, v in (logs or {}).items()
                 if k.startswith("val_") and isinstance(v, int | float)}
        self.recorder.log_eval(self._n - 1 if self._n else None, evals)

    def _restore(self) -> None:
        """Put Keras's own train function back (the wrapper lives only during a fit)."""
        if self._train_function is not None:
            if self.model is not None and self.model.train_function == self._step:
                self.model.train_function = self._train_function
            self._train_function = None

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._restore()
        self.recorder.close()
