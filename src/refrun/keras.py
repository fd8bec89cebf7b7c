"""Keras 3 on the JAX backend: ``refrun.keras.RefrunCallback`` records a ``model.fit`` run.

::

    import os; os.environ["KERAS_BACKEND"] = "jax"
    import keras, refrun, refrun.keras

    with refrun.start_run("mlp", "candidate", hardware="cpu", backend="jax",
                          global_batch=32) as run:
        model.fit(x, y, batch_size=32, epochs=2, validation_data=(xv, yv),
                  callbacks=[refrun.keras.RefrunCallback(run)])

A thin layer on :func:`refrun.jax.instrument` (see :mod:`refrun.trainer`): each training
batch is a probe step (numbered from 0 over the whole fit), the batch ``loss`` Keras
reports is logged, ``val_<name>`` at epoch end is recorded as ``eval/<name>``, and Keras's
compiled train function counts as the step function (compilations by call site; eager
helpers are ``compile/other``).  Keras reads the batch logs to the host itself before
calling a callback, so the loss adds no sync of refrun's.  Requires the ``keras`` extra
(``pip install refrun[keras]``); importing refrun never imports Keras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

from refrun.errors import RefrunInputError
from refrun.trainer import TrainerRecorder

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
        self.recorder = TrainerRecorder(self._make_probe, run, start_run)

    def _make_probe(self, run: RunSession) -> Any:
        import refrun.jax

        params = [v.value for v in self.model.trainable_variables] if self.model else None
        return refrun.jax.instrument(run, params=params, **self._kwargs)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.recorder.start()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.recorder.begin_step(self._n)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        loss = (logs or {}).get("loss")
        self.recorder.end_step(loss=float(loss) if isinstance(loss, int | float) else None)
        self._n += 1

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        evals = {k[len("val_"):]: float(v) for k, v in (logs or {}).items()
                 if k.startswith("val_") and isinstance(v, int | float)}
        self.recorder.log_eval(self._n - 1 if self._n else None, evals)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.recorder.close()
