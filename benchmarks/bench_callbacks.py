"""Overhead of the trainer callbacks on a step of a few ms, as ratios measured in one run.

For each trainer (PyTorch Lightning, Hugging Face ``Trainer``, Keras 3 on JAX) the same
training is timed without and with ``RefrunCallback`` (recording into a local sqlite
store, psutil sampler on), interleaved ``--repeats`` times; the table prints the median
time per step of each and their ratio (target: within 1 % beyond the probe's own cost,
see benchmarks/bench_torch_probe.py).  Wall-clock ratios on a shared machine are noisy:
read the median of several runs, never one number.

Usage: python benchmarks/bench_callbacks.py [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("USE_TORCH_XLA", "0")  # keep the HF Trainer on the CPU device

import numpy as np
import torch

import refrun

WIDTH = 256


def start(store: Path, name: str, backend: str) -> refrun.RunSession:
    return refrun.start_run(f"bench-callbacks-{name}", "candidate", hardware="cpu",
                            backend=backend, tracking_uri=f"sqlite:///{store}/mlflow.db",
                            spool_dir=store / "spool", snapshot_environment=False)


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, WIDTH)).astype("float32")
    return x, x[:, :1].copy()


def lightning_fit(steps: int, store: Path | None) -> float:
    import pytorch_lightning as pl

    import refrun.lightning

    class M(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 512), torch.nn.ReLU(),
                                           torch.nn.Linear(512, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = (torch.from_numpy(a) for a in data(64 * steps))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    run = start(store, "lightning", "torch") if store else None
    cbs = [refrun.lightning.RefrunCallback(run)] if run else []
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", callbacks=cbs)
    t0 = time.perf_counter()
    trainer.fit(M(), loader)
    dt = time.perf_counter() - t0
    if run:
        run.close()
    return dt / steps


def hf_train(steps: int, store: Path | None) -> float:
    import transformers

    import refrun.hf

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    ids = np.random.default_rng(0).integers(0, 64, size=(8 * steps, 32))
    rows = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in ids]
    tmp = tempfile.mkdtemp(prefix="bench-hf-")
    args = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=8, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    run = start(store, "hf", "torch") if store else None
    cbs = [refrun.hf.RefrunCallback(run)] if run else []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=cbs)
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    if run:
        run.close()
    return dt / steps


def keras_fit(steps: int, store: Path | None) -> float:
    import keras

    import refrun.keras

    x, y = data(64 * steps)
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(512, "relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)  # compile outside
    class BatchNoOp(keras.callbacks.Callback):
        """Any batch-level callback makes Keras read the batch logs to the host every
        step; the baseline has one too, so the ratio is refrun's own cost."""

        def on_train_batch_end(self, batch, logs=None):
            return None

    run = start(store, "keras", "jax") if store else None
    cbs = [refrun.keras.RefrunCallback(run, instrument={"fresh_caches": False})] if run \
        else [BatchNoOp()]
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=cbs)
    dt = time.perf_counter() - t0
    if run:
        run.close()
    return dt / steps


def measure(fn: Callable[[int, Path | None], float], steps: int, repeats: int,
            root: Path) -> tuple[float, float]:
    plain, recorded = [], []
    for i in range(repeats):  # interleaved, so drift on a shared machine hits both
        plain.append(fn(steps, None))
        store = root / f"{fn.__name__}-{i}"
        store.mkdir()
        recorded.append(fn(steps, store))
    return statistics.median(plain), statistics.median(recorded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=("lightning", "hf", "keras"), default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-callbacks-"))
    print(f"{'trainer':<12} {'plain ms/step':>14} {'callback ms/step':>17} {'ratio':>7}")
    for name, fn in (("lightning", lightning_fit), ("hf", hf_train), ("keras", keras_fit)):
        if args.only not in (None, name):
            continue
        plain, rec = measure(fn, args.steps, args.repeats, root)
        print(f"{name:<12} {plain * 1e3:>14.2f} {rec * 1e3:>17.2f} {rec / plain:>7.3f}")


if __name__ == "__main__":
    main()
