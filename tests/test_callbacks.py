"""Trainer callbacks with the real libraries on tiny locally built models (no downloads):
PyTorch Lightning, Hugging Face Transformers Trainer, Keras 3 on JAX.  Each records the
probe's metrics and evidence; values are checked against the training loop's own numbers."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported anywhere
# torch_xla is installed (for the XLA probe): keep transformers/accelerate on the CPU device
os.environ.setdefault("USE_TORCH_XLA", "0")

import numpy as np
import pytest
import torch

import refrun
from refrun import schema


def start(store, role: str, backend: str, **kw) -> refrun.RunSession:
    return refrun.start_run("callback-test", role, hardware="cpu", backend=backend,
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False, **kw)


def history(store, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in store.client().get_metric_history(run_id, metric))


def test_lightning_callback_records_loss_eval_time_progress(store, monkeypatch) -> None:
    pl = pytest.importorskip("pytorch_lightning")  # an extra: the suite's venv has it
    from lightning_fabric.accelerators.xla import XLAAccelerator

    import refrun.lightning

    # torch_xla is installed (for the XLA probe), so Lightning asks torch_xla for TPU chips
    # when it logs device info; off a TPU VM that query reads the cloud metadata server and
    # can raise a TypeError Lightning does not catch.  There is no TPU here: say so.
    monkeypatch.setattr(XLAAccelerator, "is_available", staticmethod(lambda: False))

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)
            self.train_losses: list[float] = []
            self.val_losses: list[float] = []
            self.rates: list[float] = []  # the rate each step's update uses

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.fc(x), y)
            self.train_losses.append(float(loss.detach()))
            self.rates.append(self.optimizers().param_groups[0]["lr"])
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.fc(x), y)
            self.val_losses.append(float(loss))
            self.log("val_loss", loss)

        def configure_optimizers(self):  # a warmup stepped by Lightning after each batch
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup,
                                                       "interval": "step"}}

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:8], y[:8]),
                                      batch_size=8)
    model = Tiny()
    run = start(store, "reference", "torch")
    cb = refrun.lightning.RefrunCallback(run, instrument={"monitors": "auto"})
    trainer = pl.Trainer(max_epochs=2, callbacks=[cb], logger=False, accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, train, val)
    run.close()
    rid = run.run_id
    steps = len(model.train_losses)
    assert steps == 8  # 4 batches x 2 epochs
    assert [v for _, v in history(store, rid, "loss")] == pytest.approx(model.train_losses)
    assert [s for s, _ in history(store, rid, schema.M_STEP_TIME)] == list(range(steps))
    # the learning rate each step's update used (the warmup, then 0.1)
    assert model.rates == pytest.approx([0.1 * min(1.0, (n + 1) / 4) for n in range(steps)])
    assert history(store, rid, schema.M_LR) == [(n, pytest.approx(r))
                                                for n, r in enumerate(model.rates)]
    assert history(store, rid, schema.M_PROGRESS_SAMPLES) == [(n, 8.0 * (n + 1))
                                                              for n in range(steps)]
    # validation after each epoch, at the epoch's last step
    assert history(store, rid, "eval/val_loss") == [
        (3, pytest.approx(model.val_losses[0])), (7, pytest.approx(model.val_losses[1]))]
    data = store.client().get_run(rid).data
    assert data.tags[schema.TAG_EXEC_HARDWARE] == "cpu"
    assert schema.TAG_STEP_TIME_MEDIAN in data.tags
    assert "sys/rss_bytes" in data.metrics


def test_hf_trainer_callback_tiny_gpt2_from_config(store, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    import refrun.hf

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1,
                                  n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    rng = np.random.default_rng(0)
    rows = [{"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
            for ids in rng.integers(0, 40, size=(24, 12))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=6,
        logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, learning_rate=1e-3)
    run = start(store, "reference", "torch")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   eval_dataset=rows[:8],
                                   callbacks=[refrun.hf.RefrunCallback(run)])
    trainer.train()
    run.close()
    rid = run.run_id
    own = trainer.state.log_history  # the Trainer's own record
    losses = [(e["step"] - 1, e["loss"]) for e in own if "loss" in e]
    evals = [(e["step"] - 1, e["eval_loss"]) for e in own if "eval_loss" in e]
    assert len(losses) == 6 and len(evals) == 2
    assert history(store, rid, "loss") == [(s, pytest.approx(v)) for s, v in losses]
    assert history(store, rid, "eval/loss") == [(s, pytest.approx(v)) for s, v in evals]
    assert [s for s, _ in history(store, rid, schema.M_STEP_TIME)] == list(range(6))
    assert history(store, rid, schema.M_PROGRESS_SAMPLES)[-1] == (5, 24.0)  # 6 x 4
    # The Trainer's default schedule, linear decay over 6 updates without warmup: update n
    # (step n here) uses 1e-3 (6 - n) / 6.
    assert history(store, rid, schema.M_LR) == [(n, pytest.approx(1e-3 * (6 - n) / 6))
                                                for n in range(6)]
    assert store.client().get_run(rid).data.tags[schema.TAG_EXEC_HARDWARE] == "cpu"


def test_keras_jax_callback_records_compilations_by_step(store) -> None:
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.fail("Keras was imported with another backend before this test")
    import refrun.keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    class Own(keras.callbacks.Callback):
        """The loop's own per-batch numbers, as Keras reports them to any callback."""

        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    own = Own()
    run = start(store, "candidate", "jax", global_batch=16)
    hist = model.fit(x, y, batch_size=16, epochs=2, validation_data=(x[:16], y[:16]),
                     verbose=0, callbacks=[refrun.keras.RefrunCallback(run), own])
    run.close()
    rid = run.run_id
    assert len(own.losses) == 8
    assert [v for _, v in history(store, rid, "loss")] == pytest.approx(own.losses)
    assert history(store, rid, "eval/loss") == [
        (3, pytest.approx(hist.history["val_loss"][0])),
        (7, pytest.approx(hist.history["val_loss"][1]))]
    graphs = [v for _, v in history(store, rid, schema.M_COMPILE_GRAPHS)]
    # Keras's train function compiles at the first step only; the evaluation function,
    # compiled between steps, is compile/other
    assert graphs[0] >= 1 and sum(graphs[1:]) == 0
    assert sum(v for _, v in history(store, rid, schema.M_COMPILE_OTHER)) >= 1
    assert history(store, rid, schema.M_PROGRESS_SAMPLES)[-1] == (7, 128.0)


def test_keras_callback_keeps_batch_ends_async_and_times_every_step(store) -> None:
    """With only refrun's callback, Keras keeps dispatching batch ends off the training
    thread (no per-batch ``pythonify_logs`` sync on it), yet every batch's loss is
    recorded (the train function's device value) and step times come from readiness."""
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.fail("Keras was imported with another backend before this test")
    import refrun.keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 3)).astype("float32")
    y = x.sum(1, keepdims=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    class Own(keras.callbacks.Callback):
        """Keras's own batch logs, read on Keras's worker threads (async_safe)."""

        async_safe = True

        def __init__(self) -> None:
            super().__init__()
            self.epoch = 0
            self.losses: dict[tuple[int, int], float] = {}

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.losses[(self.epoch, batch)] = float(logs["loss"])

    cb, own = None, Own()
    run = start(store, "candidate", "jax", global_batch=16)
    cb = refrun.keras.RefrunCallback(run)
    # Keras's own switch: batch ends go to its thread pool only when no callback
    # needs them synchronously on the training thread.
    assert keras.callbacks.CallbackList([cb, own], model=model)._async_train
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb, own])
    run.close()
    assert model.train_function is not None
    assert model.train_function != cb._step  # Keras's own function restored
    rid = run.run_id
    expected = [own.losses[k] for k in sorted(own.losses)]
    assert len(expected) == 6  # 3 batches x 2 epochs
    assert history(store, rid, "loss") == [(n, pytest.approx(v)) for n, v in
                                           enumerate(expected)]
    assert [s for s, _ in history(store, rid, schema.M_STEP_TIME)] == list(range(6))
    assert store.client().get_run(rid).data.tags[schema.TAG_STEP_TIME_KIND] == "interval"


def test_keras_callback_puts_the_train_function_back_when_fit_raises(store) -> None:
    """Keras skips on_train_end when fit raises: the wrapper must not outlive the fit."""
    keras = pytest.importorskip("keras")
    import refrun.keras

    class Boom(keras.Sequential):
        def train_step(self, state, data):
            raise ArithmeticError("boom in the train step")

    model = Boom([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), dtype="float32")
    run = start(store, "candidate", "jax")
    cb = refrun.keras.RefrunCallback(run, instrument={"monitors": None, "fresh_caches": False})
    with pytest.raises(ArithmeticError, match="boom"):
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    assert model.train_function is not None and model.train_function != cb._step
    run.close()
    assert cb.recorder.probe is not None and cb.recorder.probe.current_step == 0
