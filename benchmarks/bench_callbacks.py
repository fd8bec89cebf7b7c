"""Overhead of the trainer callbacks on a step of a few ms, as ratios measured in one run.

For each trainer (PyTorch Lightning, Hugging Face ``Trainer``, Keras 3 on JAX) the same
training (a small local model, ``--steps`` steps after ``--warmup``) runs three ways:

* ``plain``: no refrun at all;
* ``probe``: the backend's probe driven by hand, the minimum a recording needs (a bench
  callback / step wrapper entering ``probe.step(n)``, ``probe.log(loss=...)`` and leaving
  the step): the probe's own cost inside that trainer;
* ``callback``: ``refrun.<trainer>.RefrunCallback``.

Every variant records into a local sqlite store with the psutil sampler on (1 s).  The
variants are interleaved (plain, probe, callback, plain, ...) ``--repeats`` times so drift
on a shared machine hits all three; the table prints the median time per steady step of
each (from the start of step ``warmup`` to the end of the last step, measured by the same
tiny timing hook in every variant: run start, probe creation and close are outside it,
and the run's delivery process has finished starting before the fit: see
``children_settled``)
and the ratios callback/plain and callback/probe.  Target: callback/probe <= 1.01, read
as the upper end of a 95 % interval: each ABC round gives one paired ratio
callback/probe (same round, so drift between rounds cancels), and the table prints their
geometric mean with a t-interval on the log ratios, on wall time and on the process's CPU
time (all threads; less sensitive to other processes on a shared machine).  Start-up (run
start, probe creation, the delivery process) is outside the timed steps; its cost is
stated separately in docs/lightning.md.

The ``blocks`` design (``--design blocks``, and first under ``both``) measures the same
ratio inside one fit: a hand-driven probe on one run and the callback on a second run are
both installed behind a gate that hands each step's hooks to one of them, in rounds of
four blocks of ``--block`` steps, ABBA (:class:`Blocks`).  Each round is one paired
ratio callback/probe of whole steps (everything the trainer does between two block
starts), on wall time, process CPU time and the training thread's CPU time, and the table
prints their geometric mean with a 95 % t-interval over every round of ``--fits`` fits.
``--null`` runs the hand-driven probe in both halves (an A/A test whose truth is 1): the
design's own bias and noise.  With ``--fits`` 3 or more it also prints the interval over
fits (each fit's own ratio one observation, :func:`fits_ci`): fits of the same code differ
by more than one fit's rounds say.  Every second fit sets the callback's half up first,
and with 6 or more fits the 1.01 target is read over pairs of fits (:func:`pairs_ci`).
Rounds that hold an epoch start are left out (:meth:`Blocks.crosses_epoch`).

Usage: python benchmarks/bench_callbacks.py [--steps 400] [--warmup 20] [--repeats 5]
       [--only lightning|hf|keras] [--design fits|blocks|both] [--block 25]
       [--rounds lightning=240,hf=40,keras=120] [--fits 2] [--null] [--dump F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("USE_TORCH_XLA", "0")  # keep the HF Trainer on the CPU device

import numpy as np
import torch

import refrun

# One intra-op thread: on a shared 2-core machine more threads make every variant's step
# time depend on who else runs, and the ratios drown in that noise.
torch.set_num_threads(1)

Variant = Literal["plain", "probe", "callback"]
VARIANTS: tuple[Variant, ...] = ("plain", "probe", "callback")
WIDTH = 256
KERAS_HIDDEN = 1024
BATCH = 64
# Batches held in memory: a longer run goes through them again (another epoch).  Without a
# cap the blocks design's long fits held every batch (24 GB for 96k Lightning steps).
POOL_STEPS = 2000


class Clock:
    """The timing hook shared by all variants: ``t0`` at the start of the first steady
    step, ``t1`` at the end of the last one."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0 = self.t1 = (0.0, 0.0)

    @staticmethod
    def now() -> tuple[float, float, float]:
        """(wall seconds, this process's CPU seconds: every thread, refrun's included, the
        calling thread's CPU seconds)."""
        return time.perf_counter(), time.process_time(), time.thread_time()

    def per_step(self, steps: int) -> tuple[float, float]:
        return ((self.t1[0] - self.t0[0]) / steps, (self.t1[1] - self.t0[1]) / steps)


class HookTimer:
    """CPU time of this thread spent inside a callback's per-step hooks (what the
    callback or the hand-driven probe adds to the step, without the step's own noise)."""

    def __init__(self) -> None:
        self.ns = 0
        self.steps = 0

    def wrap(self, obj: Any, names: tuple[str, ...], counting: str) -> None:
        for name in names:
            fn = getattr(obj, name)

            def timed(*a: Any, _fn: Any = fn, _count: bool = name == counting, **k: Any):
                t = time.thread_time_ns()
                try:
                    return _fn(*a, **k)
                finally:
                    self.ns += time.thread_time_ns() - t
                    self.steps += _count

            setattr(obj, name, timed)

    def per_step_us(self) -> float:
        return self.ns / 1e3 / max(self.steps, 1)


HOOK_US: dict[tuple[str, Variant], list[float]] = {}


class Blocks:
    """Probe and callback interleaved step-block by step-block inside one fit.

    After ``warmup`` steps (which alternate the two, so both code paths are warm), the
    steps run in rounds of four blocks of ``block`` steps, ABBA: probe, callback,
    callback, probe or the mirror, so a drift that is linear over a round cancels within
    it.  Which of the two a round runs is drawn at random (seeded by ``seed``), not
    alternated: with alternation the pattern repeats every two rounds, and anything of the
    trainer or the runtime that recurs at a multiple of that period lands in the same half
    every time.  On Keras/JAX it did: in A/A fits (the same probe in both halves) the first
    block of every even round, always the probe's, ran 4-7 % faster than its round's mean,
    with no such effect in odd rounds, and the A/A read 1.01-1.05 (2026-12-03; neither the
    probes' periodic re-description nor Python's GC: it stayed with each turned off).
    Each round gives one paired ratio
    ``(callback blocks) / (probe blocks)`` on each clock (:data:`CLOCKS`): the whole step
    (everything the trainer does between two block starts), measured in one process, with
    the machine's slow drift common to both halves.  After the last round: the probe."""

    def __init__(self, warmup: int, block: int, rounds: int, swap: bool = False,
                 seed: int = 0) -> None:
        self.warmup, self.block, self.rounds = warmup, block, rounds
        # Per round: does the callback run the round's first and last block?
        rng = random.Random(seed)
        self.cb_first = [rng.random() < 0.5 for _ in range(rounds)]
        # Which half is set up first (its run started, its probe built): the probe's when
        # False, the callback's when True (:func:`start_halves`, :func:`in_order`).
        self.swap = swap
        self.marks: list[tuple[float, float, float]] = []  # Clock.now() at block starts

    @property
    def total(self) -> int:
        """Steps to run: warm-up, the rounds, and one step whose start closes the last."""
        return self.warmup + 4 * self.block * self.rounds + 1

    def at(self, i: int) -> Variant:
        """The variant of step ``i`` (0-based), marking the clocks at each block start."""
        if i < self.warmup:
            return "probe" if i % 2 else "callback"
        b, k = divmod(i - self.warmup, self.block)
        if k == 0 and b <= 4 * self.rounds:
            self.marks.append(Clock.now())
        if b >= 4 * self.rounds:
            return "probe"
        r, pos = divmod(b, 4)
        first, second = ("callback", "probe") if self.cb_first[r] else ("probe", "callback")
        return first if pos in (0, 3) else second

    def crosses_epoch(self, r: int) -> bool:
        """Round ``r`` holds an epoch's start (a step ``m * POOL_STEPS``, m >= 1, after its
        first step and up to the next round's first step, whose set-up ends the round):
        the trainer's per-epoch work (a new data iterator, Keras's end-of-epoch read of
        the logs) lands in whichever half runs there.  With 100-step rounds after 20
        warm-up steps and the alternating order used then, every epoch start fell in the
        same position, a callback block:
        about 1 point of Keras's 3 % "cost" and of its A/A test's 1.03-1.05 (2026-12-03;
        the rest of that bias is not explained, docs/lightning.md)."""
        start = self.warmup + 4 * self.block * r
        end = start + 4 * self.block
        first = (start // POOL_STEPS + 1) * POOL_STEPS  # the first epoch start after `start`
        return first <= end

    def ratios(self) -> list[tuple[float, ...]]:
        """(wall, cpu, thread) ratio callback/probe of each complete round that holds no
        epoch start (:meth:`crosses_epoch`)."""
        out = []
        for r in range(min(self.rounds, (len(self.marks) - 1) // 4)):
            if self.crosses_epoch(r):
                continue
            d = [tuple(b - a for a, b in zip(self.marks[4 * r + j], self.marks[4 * r + j + 1],
                                              strict=True)) for j in range(4)]
            cb_first = self.cb_first[r]
            cb = [d[j] for j in ((0, 3) if cb_first else (1, 2))]
            pr = [d[j] for j in ((1, 2) if cb_first else (0, 3))]
            out.append(tuple((cb[0][c] + cb[1][c]) / (pr[0][c] + pr[1][c]) for c in CLOCKS))
        return out


# The clocks of :meth:`Clock.now`.  "thread": the training thread's CPU time: everything
# the trainer, the step and the hooks do on it, without the other threads of the process
# (refrun's sampler, the framework's pools: the same in both variants of a fit) and without
# time the thread waits or is preempted; on JAX, where the computation runs on XLA's
# threads, it is the dispatch side only, so its ratio overstates a hook's share of the step.
CLOCKS = (0, 1, 2)
CLOCK_NAMES = ("wall", "cpu", "thread")
# --null: the "callback" blocks run a second hand-driven probe on the second run, so the
# design's own bias and noise show (an A/A test: the ratio's truth is 1).
NULL_TEST = [False]


def start(store: Path, name: str, backend: str) -> refrun.RunSession:
    run = refrun.start_run(f"bench-callbacks-{name}", "candidate", hardware="cpu",
                           backend=backend, tracking_uri=f"sqlite:///{store}/mlflow.db",
                           spool_dir=store / "spool", snapshot_environment=False,
                           global_batch=BATCH)
    children_settled()
    return run


def start_halves(store: Path, name: str, backend: str, variant: Variant,
                 blocks: Blocks | None) -> tuple[refrun.RunSession | None,
                                                 refrun.RunSession | None]:
    """``(run, run_b)``: the probe half's run and, in the blocks design, the callback
    half's, started in the order ``blocks.swap`` says.  The Keras A/A test (2026-12-03:
    1.03-1.05 per fit with the same code in both halves) suggested the half set up second
    is slower; swapping the order every second fit showed no such effect (1.032 in both
    orders), and the pairs keep any that a change brings from biasing the ratio."""
    if blocks is None:
        return (start(store, name, backend) if variant != "plain" else None), None
    if blocks.swap:
        run_b = start(store, f"{name}-callback", backend)
        return start(store, name, backend), run_b
    run = start(store, name, backend)
    return run, start(store, f"{name}-callback", backend)


def in_order(blocks: Blocks, delegates: dict[Variant, Any]) -> dict[Variant, Any]:
    """The Gate's delegates in set-up order (the Gate builds their probes in dict order)."""
    return dict(reversed(delegates.items())) if blocks.swap else delegates


def children_settled(window_s: float = 0.25, idle_cpu_s: float = 0.01,
                     deadline_s: float = 60.0) -> float:
    """Wait until this process's children (the run's delivery process) are idle: less than
    ``idle_cpu_s`` CPU seconds in each of two consecutive ``window_s`` windows; returns
    their CPU seconds spent while waiting.

    Why: the delivery process starts a Python interpreter and imports MLflow (about 1 s
    of CPU).  A fit of a few hundred 2-ms steps started at once runs entirely inside
    that start-up, so on a 2-core machine the step loses the second core that
    JAX's async dispatch overlaps with (measured on Keras/JAX: 3.6 ms wall = 3.6 ms CPU
    per step instead of 2.1 ms wall / 3.9 ms CPU), and the recorded variants looked
    serialised while the probe added no wait of its own.  A real run pays it once."""
    from children_cpu import children_cpu_s  # beside this script

    t_end, first, last, quiet = (time.monotonic() + deadline_s, children_cpu_s(),
                                 children_cpu_s(), 0)
    while quiet < 2 and time.monotonic() < t_end:
        time.sleep(window_s)
        now = children_cpu_s()
        quiet = quiet + 1 if now - last < idle_cpu_s else 0
        last = now
    return last - first


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, WIDTH)).astype("float32")
    return x, x[:, :1].copy()


# --- Lightning ----------------------------------------------------------------------------
def lightning_fit(variant: Variant, steps: int, warmup: int, store: Path,
                  blocks: Blocks | None = None) -> tuple[float, float]:
    import pytorch_lightning as pl
    from lightning_fabric.accelerators.xla import XLAAccelerator

    import refrun.lightning
    import refrun.torch

    XLAAccelerator.is_available = staticmethod(lambda: False)  # no TPU metadata query
    torch.manual_seed(0)

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

    total = warmup + steps
    clock = Clock(warmup)

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == clock.warmup:  # batch_idx restarts each epoch
                clock.t0 = clock.now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.t1 = clock.now()

    class ByHand(pl.Callback):
        """The probe's own cost: step in, log the loss tensor, step out."""

        def __init__(self, run: refrun.RunSession) -> None:
            self.run, self.probe, self.cm = run, None, None

        def on_fit_start(self, trainer, pl_module):
            self.probe = refrun.torch.instrument(self.run, pl_module, trainer.optimizers[0])

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.cm = self.probe.step(trainer.global_step)
            self.cm.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.probe.log(loss=outputs["loss"])
            self.cm.__exit__(None, None, None)

        def on_fit_end(self, trainer, pl_module):
            self.probe.close()

    class Gate(pl.Callback):
        """Each step's hooks go to the variant of its block (:class:`Blocks`)."""

        def __init__(self, delegates: dict[Variant, Any]) -> None:
            self.delegates, self.cur = delegates, None

        def on_fit_start(self, trainer, pl_module):
            for d in self.delegates.values():
                d.on_fit_start(trainer, pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.cur = self.delegates[blocks.at(trainer.global_step)]  # across epochs
            self.cur.on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.cur.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

        def on_fit_end(self, trainer, pl_module):
            for d in self.delegates.values():
                d.on_fit_end(trainer, pl_module)

    total = blocks.total if blocks else total
    x, y = (torch.from_numpy(a) for a in data(BATCH * min(total, POOL_STEPS)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=BATCH)
    run, run_b = start_halves(store, "lightning", "torch", variant, blocks)
    cbs: list[Any] = [Timer()]
    if blocks:
        cbs.append(Gate(in_order(blocks, {
            "probe": ByHand(run), "callback": ByHand(run_b) if NULL_TEST[0]
                         else refrun.lightning.RefrunCallback(run_b)})))
    elif variant == "probe":
        cbs.append(ByHand(run))
    elif variant == "callback":
        cbs.append(refrun.lightning.RefrunCallback(run))
    hooks = HookTimer()
    if variant != "plain" and not blocks:
        hooks.wrap(cbs[-1], ("on_train_batch_start", "on_train_batch_end"),
                   "on_train_batch_end")
    trainer = pl.Trainer(max_epochs=-1, max_steps=total, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", callbacks=cbs)
    trainer.fit(M(), loader)
    if not blocks:
        HOOK_US.setdefault(("lightning", variant), []).append(hooks.per_step_us())
    for r in (run, run_b):
        if r:
            r.close()
    return clock.per_step(steps)


# --- Hugging Face --------------------------------------------------------------------------
def hf_train(variant: Variant, steps: int, warmup: int, store: Path,
             blocks: Blocks | None = None) -> tuple[float, float]:
    import transformers

    import refrun.hf
    import refrun.torch

    total = warmup + steps
    clock = Clock(warmup)

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == clock.warmup:
                clock.t0 = clock.now()

        def on_step_end(self, args, state, control, **kw):
            clock.t1 = clock.now()

    class ByHand(transformers.TrainerCallback):
        """The probe's own cost: step in/out, the loss the Trainer logged (a float)."""

        def __init__(self, run: refrun.RunSession) -> None:
            self.run, self.probe, self.cm = run, None, None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            self.probe = refrun.torch.instrument(self.run, model, optimizer)

        def on_step_begin(self, args, state, control, **kw):
            self.cm = self.probe.step(state.global_step)
            self.cm.__enter__()

        def on_step_end(self, args, state, control, **kw):
            self.cm.__exit__(None, None, None)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:  # the values the callback records
                self.probe.log(state.global_step - 1, loss=logs["loss"],
                               **{f"train/{k}": logs[k] for k in ("grad_norm", "learning_rate")
                                  if k in logs})

        def on_train_end(self, args, state, control, **kw):
            self.probe.close()

    class Gate(transformers.TrainerCallback):
        """Each step's hooks go to the variant of its block (:class:`Blocks`)."""

        def __init__(self, delegates: dict[Variant, Any]) -> None:
            self.delegates, self.cur = delegates, None

        def on_train_begin(self, args, state, control, **kw):
            for d in self.delegates.values():
                d.on_train_begin(args, state, control, **kw)

        def on_step_begin(self, args, state, control, **kw):
            self.cur = self.delegates[blocks.at(state.global_step)]
            self.cur.on_step_begin(args, state, control, **kw)

        def on_step_end(self, args, state, control, **kw):
            self.cur.on_step_end(args, state, control, **kw)

        def on_log(self, args, state, control, **kw):
            self.cur.on_log(args, state, control, **kw)

        def on_train_end(self, args, state, control, **kw):
            for d in self.delegates.values():
                d.on_train_end(args, state, control, **kw)

    total = blocks.total if blocks else total
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    ids = np.random.default_rng(0).integers(0, 64, size=(8 * min(total, POOL_STEPS), 32))
    rows = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in ids]
    tmp = tempfile.mkdtemp(prefix="bench-hf-", dir=store)
    args = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=8, max_steps=total, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    run, run_b = start_halves(store, "hf", "torch", variant, blocks)
    cbs: list[Any] = [Timer()]
    if blocks:
        cbs.append(Gate(in_order(blocks, {
            "probe": ByHand(run), "callback": ByHand(run_b) if NULL_TEST[0]
                         else refrun.hf.RefrunCallback(run_b)})))
    elif variant == "probe":
        cbs.append(ByHand(run))
    elif variant == "callback":
        cbs.append(refrun.hf.RefrunCallback(run))
    hooks = HookTimer()
    if variant != "plain" and not blocks:
        hooks.wrap(cbs[-1], ("on_step_begin", "on_step_end", "on_log"), "on_step_end")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=cbs)
    trainer.train()
    if not blocks:
        HOOK_US.setdefault(("hf", variant), []).append(hooks.per_step_us())
    for r in (run, run_b):
        if r:
            r.close()
    return clock.per_step(steps)


# --- Keras ----------------------------------------------------------------------------------
def keras_fit(variant: Variant, steps: int, warmup: int, store: Path,
              blocks: Blocks | None = None) -> tuple[float, float]:
    import keras

    import refrun.jax
    import refrun.keras

    total = warmup + steps
    clock = Clock(warmup)

    class Timer(keras.callbacks.Callback):
        """No batch-end method: that alone would make Keras read the logs to the host on
        the training thread every batch.  ``t1`` at epoch end: Keras has read the epoch's
        logs there, so every step has finished on the device."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == clock.warmup and not clock.t0[0]:  # the first epoch's
                clock.t0 = clock.now()

        def on_epoch_end(self, epoch, logs=None):
            clock.t1 = clock.now()

    class ByHand(keras.callbacks.Callback):
        """The probe's own cost: each call of Keras's compiled train function is a probe
        step that logs the loss device value (the probe reads it without a sync)."""

        def __init__(self, run: refrun.RunSession) -> None:
            super().__init__()
            self.run, self.probe, self.n, self.fn = run, None, 0, None

        def on_train_begin(self, logs=None):
            params = [v.value for v in self.model.trainable_variables]  # as the callback
            self.probe = refrun.jax.instrument(self.run, params=params, fresh_caches=False)
            self.fn = fn = self.model.train_function

            def wrapped(state, iterator):
                with self.probe.step(self.n):
                    out, state = fn(state, iterator)
                    self.probe.log(loss=out["loss"])
                self.n += 1
                return out, state

            self.model.train_function = wrapped

        def on_train_end(self, logs=None):
            self.model.train_function = self.fn
            self.probe.close()

    class Gate(keras.callbacks.Callback):
        """Each call of the train function goes to the variant of its block
        (:class:`Blocks`): Keras's own function wrapped by the hand-driven probe or by
        the callback, each installed as it installs itself and then taken back."""

        def __init__(self, delegates: dict[Variant, Any]) -> None:
            super().__init__()
            self.delegates, self.fns, self.n = delegates, {}, 0

        def set_model(self, model):
            super().set_model(model)
            for d in self.delegates.values():
                d.set_model(model)

        def on_train_begin(self, logs=None):
            own = self.model.train_function
            for v, d in self.delegates.items():
                self.model.train_function = own
                d.on_train_begin(logs)
                self.fns[v] = self.model.train_function

            def dispatch(state, iterator):
                fn = self.fns[blocks.at(self.n)]
                self.n += 1
                return fn(state, iterator)

            self.model.train_function = dispatch

        def on_epoch_end(self, epoch, logs=None):
            for d in self.delegates.values():
                d.on_epoch_end(epoch, logs)

        def on_train_end(self, logs=None):
            for d in self.delegates.values():
                d.on_train_end(logs)

    total = blocks.total if blocks else total
    keras.utils.set_random_seed(0)
    x, y = data(BATCH * min(total, POOL_STEPS))
    # wider than the torch models: XLA's fused CPU step is fast; this gives a few ms
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(KERAS_HIDDEN, "relu"),
                              keras.layers.Dense(KERAS_HIDDEN, "relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # compile
    run, run_b = start_halves(store, "keras", "jax", variant, blocks)
    cbs: list[Any] = [Timer()]
    if blocks:
        cbs.append(Gate(in_order(blocks, {
            "probe": ByHand(run), "callback": ByHand(run_b) if NULL_TEST[0]
                         else refrun.keras.RefrunCallback(run_b,
                                                          instrument={"fresh_caches": False})})))
    elif variant == "probe":
        cbs.append(ByHand(run))
    elif variant == "callback":
        cbs.append(refrun.keras.RefrunCallback(run, instrument={"fresh_caches": False}))
    model.fit(x, y, batch_size=BATCH, epochs=-(-total // POOL_STEPS), verbose=0, callbacks=cbs,
              shuffle=False)
    for r in (run, run_b):
        if r:
            r.close()
    return clock.per_step(steps)


# --- hook loops: the per-step hooks alone, called many times on real trainer objects ---------
def lightning_hooks(variant: Variant, n: int, store: Path) -> float:
    """Thread CPU microseconds per step of the two per-step hooks (no training: what the
    probe, or the callback, costs the training thread, without the step's noise)."""
    import pytorch_lightning as pl

    import refrun.lightning
    import refrun.torch

    module = pl.LightningModule()
    module.net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    steps = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    batch, outputs = (torch.randn(BATCH, 8), torch.randn(BATCH, 1)), {"loss": torch.tensor(1.)}
    run = start(store, "lightning-hooks", "torch")
    probe = refrun.torch.instrument(run, module, opt)
    cb = refrun.lightning.RefrunCallback(run)
    cb._module, cb._optimizer = module, opt
    cb.recorder.probe = probe  # the same probe for both variants' code paths
    t = time.thread_time_ns()
    for i in range(n):
        steps.total.completed = i  # trainer.global_step
        if variant == "callback":
            cb.on_train_batch_start(trainer, module, batch, i)
            cb.on_train_batch_end(trainer, module, outputs, batch, i)
        else:  # what the bench's ByHand callback does
            cm = probe.step(trainer.global_step)
            cm.__enter__()
            probe.log(loss=outputs["loss"])
            cm.__exit__(None, None, None)
    us = (time.thread_time_ns() - t) / n / 1e3
    probe.close()
    run.close()
    return us


def hf_hooks(variant: Variant, n: int, store: Path) -> float:
    """As :func:`lightning_hooks` for the Hugging Face callback (with ``on_log`` of the
    Trainer's per-step logs: loss, grad_norm, learning_rate, epoch)."""
    import transformers

    import refrun.hf
    import refrun.torch

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = transformers.TrainingArguments(output_dir=str(store / "hf"), use_cpu=True,
                                          per_device_train_batch_size=BATCH, report_to=[])
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    run = start(store, "hf-hooks", "torch")
    probe = refrun.torch.instrument(run, model, opt)
    cb = refrun.hf.RefrunCallback(run)
    cb.recorder.probe = probe
    t = time.thread_time_ns()
    for i in range(n):
        state.global_step = i
        logs = {"loss": 1.0 / (i + 1), "grad_norm": 0.5, "learning_rate": 1e-3, "epoch": 0.1}
        if variant == "callback":
            cb.on_step_begin(args, state, control)
            cb.on_step_end(args, state, control)
            state.global_step = i + 1
            cb.on_log(args, state, control, logs=logs)
        else:
            cm = probe.step(state.global_step)
            cm.__enter__()
            cm.__exit__(None, None, None)
            state.global_step = i + 1
            probe.log(i, loss=logs["loss"], **{f"train/{k}": logs[k]
                                                for k in ("grad_norm", "learning_rate")})
    us = (time.thread_time_ns() - t) / n / 1e3
    probe.close()
    run.close()
    return us


def keras_hooks(variant: Variant, n: int, store: Path) -> float:
    """As :func:`lightning_hooks` for the Keras callback: its ``train_function`` wrapper
    around a function that returns an already computed loss array, against the bench's
    hand-written wrapper (the probe step and ``probe.log`` of the loss)."""
    import jax.numpy as jnp
    import keras

    import refrun.jax
    import refrun.keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    out = ({"loss": jnp.float32(1.0)}, None)
    model.train_function = lambda state, data: out
    run = start(store, "keras-hooks", "jax")
    probe = refrun.jax.instrument(run, params=[v.value for v in model.trainable_variables],
                                  fresh_caches=False)
    cb = refrun.keras.RefrunCallback(run)
    cb.set_model(model)
    cb.recorder.probe = probe
    cb.on_train_begin()
    fn = cb._train_function
    t = time.thread_time_ns()
    if variant == "callback":
        for _ in range(n):
            model.train_function(None, None)
    else:
        for i in range(n):
            with probe.step(i):
                logs, _ = fn(None, None)
                probe.log(loss=logs["loss"])
    us = (time.thread_time_ns() - t) / n / 1e3
    probe.close()
    run.close()
    return us


HOOK_LOOPS: dict[str, Callable[[Variant, int, Path], float]] = {
    "lightning": lightning_hooks, "hf": hf_hooks, "keras": keras_hooks}


TRAINERS: dict[str, Callable[[Variant, int, int, Path], tuple[float, float]]] = {
    "lightning": lightning_fit, "hf": hf_train, "keras": keras_fit}


def paired_ci(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios ``other[i] / base[i]`` (the same repeat of an
    interleaved ABC round: drift between rounds cancels) and its 95 % t-interval, computed
    on the log ratios: ``exp(mean +- t(0.975, n-1) * sd / sqrt(n))``."""
    import math

    from scipy import stats

    logs = [math.log(o / b) for b, o in zip(base, other, strict=True)]
    n = len(logs)
    m = statistics.fmean(logs)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n) if n > 1 \
        else float("inf")
    return math.exp(m), math.exp(m - half), math.exp(m + half)


PAIRED: dict[str, dict[Variant, list[tuple[float, float]]]] = {}


def interleave(fn: Callable[..., tuple[float, float]], block: int, rounds: int, warmup: int,
               fits: int, root: Path) -> list[list[tuple[float, ...]]]:
    """Per fit, the (wall, cpu, thread) callback/probe ratio of each round of :class:`Blocks`,
    after one short untimed fit (first-use costs of the process)."""
    out = []
    for i in range(fits + 1):
        store = root / f"{fn.__name__}-blocks-{i}"
        store.mkdir()
        # Fits 1, 3, ... set the probe's half up first, 2, 4, ... the callback's.
        blocks = Blocks(warmup, block, rounds if i else 2, swap=i > 0 and i % 2 == 0, seed=i)
        fn("probe", blocks.total, warmup, store, blocks)
        if i:
            out.append(blocks.ratios())
    return out


def fits_ci(per_fit: list[list[tuple[float, ...]]], c: int) -> tuple[float, float, float]:
    """Geometric mean of the fits' own ratios on clock ``c`` (each fit's mean log ratio over
    its rounds) and its 95 % t-interval with ``fits - 1`` degrees of freedom: the fit, not
    the round, is the unit of replication.  Fits of the same code differ by more than their
    rounds' interval says (Lightning, 2026-12-03: per-fit 1.0046, 1.0075 in one run, 1.0006,
    1.0002 in the next, 0.9931 in a third, each from 300-1500 rounds with a within-fit
    interval of about +-0.5 %): something fixed for a fit (where its objects landed in
    memory, the runs' stores) moves the ratio, and the rounds of one fit all share it."""
    import math

    means = [statistics.fmean(math.log(r[c]) for r in fit) for fit in per_fit if fit]
    return paired_ci([1.0] * len(means), [math.exp(m) for m in means])


def pairs_ci(per_fit: list[list[tuple[float, ...]]], c: int) -> tuple[float, float, float]:
    """As :func:`fits_ci` over pairs of consecutive fits (1-2, 3-4, ...), the second of each
    with its halves set up in the other order: each pair's value is the mean of its two
    fits' mean log ratios, so an effect of set-up order cancels within the pair."""
    import math

    means = [statistics.fmean(math.log(r[c]) for r in fit) for fit in per_fit if fit]
    pair = [math.exp((a + b) / 2) for a, b in zip(means[0::2], means[1::2], strict=False)]
    return paired_ci([1.0] * len(pair), pair)


def print_interleaved(name: str, per_fit: list[list[tuple[float, ...]]]) -> None:
    """Per clock: the interval over every round of every fit, each fit's estimate, and the
    interval over fits (:func:`fits_ci`), which is what the target is read on when there
    are at least 3 fits (the rounds' interval leaves out the fits' own spread)."""
    import math

    for c, clock in zip(CLOCKS, CLOCK_NAMES, strict=True):
        pooled = [r[c] for fit in per_fit for r in fit]
        g, lo, hi = paired_ci([1.0] * len(pooled), pooled)
        fits = ", ".join(f"{math.exp(statistics.fmean(math.log(r[c]) for r in fit)):.4f}"
                         for fit in per_fit)
        print(f"{name:<10} {clock:<6} callback/probe over {len(pooled)} ABBA rounds in "
              f"{len(per_fit)} fit(s): {g:.4f} [95 % CI {lo:.4f}, {hi:.4f}]; per fit {fits}",
              flush=True)
        if len(per_fit) >= 3:
            g, lo, hi = fits_ci(per_fit, c)
            print(f"{name:<10} {clock:<6} callback/probe over {len(per_fit)} fits: {g:.4f} "
                  f"[95 % CI {lo:.4f}, {hi:.4f}]", flush=True)
        if len(per_fit) >= 6:
            g, lo, hi = pairs_ci(per_fit, c)
            ok = "<= 1.01" if hi <= 1.01 else "> 1.01"
            print(f"{name:<10} {clock:<6} callback/probe over {len(per_fit) // 2} fit pairs "
                  f"(set-up order swapped within each): {g:.4f} [95 % CI {lo:.4f}, "
                  f"{hi:.4f}] upper end {ok}", flush=True)


def measure(fn: Callable[[Variant, int, int, Path], tuple[float, float]], steps: int, warmup: int,
            repeats: int, root: Path) -> dict[Variant, tuple[float, float]]:
    """Median (wall, process CPU) seconds per steady step of each variant, interleaved
    ABCABC... after one untimed round (first-use costs of the process); every round's
    values are kept in :data:`PAIRED` for the paired intervals."""
    times: dict[Variant, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    PAIRED[fn.__name__] = times
    for i in range(repeats + 1):
        for v in VARIANTS:
            store = root / f"{fn.__name__}-{v}-{i}"
            store.mkdir()
            got = fn(v, steps if i else max(steps // 4, 10), warmup, store)
            if i:
                times[v].append(got)
    return {v: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for v, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=tuple(TRAINERS), default=None)
    ap.add_argument("--hook-steps", type=int, default=3000)
    ap.add_argument("--design", choices=("fits", "blocks", "both"), default="both",
                    help="fits: whole fits interleaved ABC (--repeats); blocks: probe and "
                         "callback interleaved block by block inside one fit (--block, "
                         "--rounds, --fits)")
    ap.add_argument("--block", type=int, default=25, help="steps per block (blocks design)")
    ap.add_argument("--rounds", default="lightning=240,hf=40,keras=120",
                    help="ABBA rounds per fit, per trainer (blocks design)")
    ap.add_argument("--fits", type=int, default=2,
                    help="fits per trainer (blocks design; 3 or more: the interval over "
                         "fits, on which the target is read)")
    ap.add_argument("--null", action="store_true",
                    help="blocks design, A/A: the callback blocks run the hand-driven probe "
                         "too (on the second run), so the design's own noise and bias show")
    ap.add_argument("--dump", default=None, help="write every round's ratios here (JSON)")
    ap.add_argument("--skip-training", action="store_true", help="hook loops only")
    ap.add_argument("--skip-hooks", action="store_true", help="no hook loops")
    ap.add_argument("--gc-off", action="store_true",
                    help="disable Python's cyclic GC (tells GC pauses, which land in whichever "
                         "code allocates when a collection is due, from refrun's own work)")
    args = ap.parse_args()
    if args.gc_off:
        import gc

        gc.disable()
    root = Path(tempfile.mkdtemp(prefix="bench-callbacks-"))
    dumped: dict[str, list[list[tuple[float, ...]]]] = {}
    NULL_TEST[0] = args.null
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus); "
          f"{args.steps} steady steps after {args.warmup}, {args.repeats} repeats ABC")
    print("per steady step, medians; 'cpu' = the process's CPU time (all threads), robust "
          "to other processes' load; 'wall' = elapsed time")
    print(f"{'trainer':<10} {'clock':<5} {'plain ms':>9} {'probe ms':>9} {'callback ms':>12} "
          f"{'probe/plain':>12} {'cb/plain':>9} {'cb/probe':>9}")
    for name, fn in TRAINERS.items():
        if args.only not in (None, name) or args.skip_training:
            continue
        if args.design in ("blocks", "both"):
            rounds = dict(kv.split("=") for kv in args.rounds.split(","))
            per_fit = interleave(fn, args.block, int(rounds[name]), args.warmup, args.fits, root)
            print_interleaved(name, per_fit)
            if args.dump:
                dumped[name] = per_fit
                Path(args.dump).write_text(json.dumps(dumped))
        if args.design == "blocks":
            continue
        m = measure(fn, args.steps, args.warmup, args.repeats, root)
        for i, clock in ((0, "wall"), (1, "cpu")):
            a, b, c = (m[v][i] for v in VARIANTS)
            print(f"{name:<10} {clock:<5} {a * 1e3:>9.3f} {b * 1e3:>9.3f} {c * 1e3:>12.3f} "
                  f"{b / a:>12.3f} {c / a:>9.3f} {c / b:>9.3f}", flush=True)
        rounds = PAIRED[fn.__name__]
        if args.repeats > 1:
            for i, clock in ((0, "wall"), (1, "cpu")):
                pr, cb = ([t[i] for t in rounds[v]] for v in ("probe", "callback"))
                r, lo, hi = paired_ci(pr, cb)
                ok = "<= 1.01" if hi <= 1.01 else "> 1.01"
                print(f"{name:<10} {clock:<5} callback/probe paired over {args.repeats} rounds: "
                      f"{r:.4f} [95 % CI {lo:.4f}, {hi:.4f}] upper end {ok}", flush=True)
        probe_us, cb_us = (HOOK_US.get((name, v)) for v in ("probe", "callback"))
        if probe_us and cb_us:
            # the untimed first round included; medians
            print(f"{name:<10} hooks (thread CPU per step): probe "
                  f"{statistics.median(probe_us):.1f} us, callback "
                  f"{statistics.median(cb_us):.1f} us", flush=True)
    if args.skip_hooks:
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
        return
    print(f"hook loops ({args.hook_steps} steps, {args.repeats} repeats interleaved; thread "
          "CPU per step of the per-step hooks alone, same probe object for both):")
    for name, fn in HOOK_LOOPS.items():
        if args.only not in (None, name):
            continue
        us: dict[str, list[float]] = {"probe": [], "callback": []}
        for i in range(args.repeats):
            for v in ("probe", "callback"):
                store = root / f"hooks-{name}-{v}-{i}"
                store.mkdir()
                us[v].append(fn(v, args.hook_steps, store))  # type: ignore[arg-type]
        p, c = (statistics.median(us[v]) for v in ("probe", "callback"))
        print(f"{name:<10} probe {p:7.2f} us  callback {c:7.2f} us  callback - probe "
              f"{c - p:+6.2f} us/step", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
