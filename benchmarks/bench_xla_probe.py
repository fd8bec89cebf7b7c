"""Cost of refrun.xla.instrument on PJRT CPU, per model shape, measured in one process.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_xla_probe.py \
        [--models mlp,gru-lm,conv] [--rounds 100] [--block-s 0.5] [--seed 0]

Each model shape runs at its own step length (one line each in the summary table):

* ``mlp``: a 64-256-256-1 tanh MLP, batch 128, SGD;
* ``gru-lm``: a GRU language model (embedding 256 x 64, one GRU layer of 128, linear
  head, batch 16 x 32 tokens; AdamW, gradient clipping at norm 1, a LambdaLR warm-up,
  an evaluation on a held-out batch every 20 steps); ``nn.GRU`` is what torch_xla makes
  of it, its scan-based GRU, since the model is built after ``import torch_xla``;
* ``conv``: a 1-D CNN forecaster (three Conv1d layers over a window of 96, max-pool,
  average-pool, a linear head to 8 values; batch 64, Adam);
* also, by name only: ``gru-lm-torch``, the same language model with PyTorch's own
  ``nn.GRU`` (a model built before ``import torch_xla`` has it: its in-place ops run
  through Python meta kernels on XLA, issue 52), and ``rnn``, a ``GRUCell`` unrolled over
  ``--seq`` time steps with Adam (the step of the earlier runs in docs/xla.md).

For each model: one instance (model, optimizer, batches), whose steps run either in a
plain loop or inside ``probe.step`` with ``probe.log(loss=...)`` (the probe given the model
and the optimizer: it also reads the learning rate at every step), and with ``--burn US``
a third arm, the plain step plus US microseconds of thread CPU in a Python loop (a
positive control: a known cost, so the table shows whether the design resolves a cost of
that size on this machine at this hour).  The arms share the instance so that the only
difference between them is the probe: two instances of the same graph (``--twins``, the
design before 2026-12-07, eleventh session) differed by themselves by 1-3 % from run to
run on this machine (docs/xla.md, eighth session), as large as the cost to be bounded.
The probe sees only its own arm's steps; the plain arm's run between them, outside any
probed step.

Run it under ``taskset -c 0`` on a machine of few cores: on the 2-vCPU machine of
docs/xla.md the MLP's step flips between a ~0.9 ms and a ~1.6 ms mode as the scheduler
puts the XLA runtime's threads beside the training thread or not, and the paired blocks'
ratios scattered by 14-17 % (one core: 2-3 %).  On one core every CPU second refrun
spends (its threads, its delivery process, which inherits the CPU set) is taken from the
step: the strictest reading of the probe's cost.  The header prints the CPU set.

Each round runs one block of every arm, in an order drawn at
random for each round (seeded); a block is ``--steps`` steps, or by default as many as
take about ``--block-s`` seconds of plain steps (at least 16), measured after the
warm-up.  An arm's block over the same round's plain block is one paired sample; the table
gives their geometric mean with a 95 % t-interval, their Hodges-Lehmann estimate with its
signed-rank interval, and the same pairs analysed as a cross-over
(:func:`crossover_ratio`): whether a block ran first or second in its pair moves its time
by itself (a position effect: bench_callbacks' Keras/JAX A/A test found the first block
of a round 4-7 % faster), which a random order turns into noise and this analysis
estimates and removes.  **The target (issue 52: <= 1.01 for every shape) is read on the
cross-over row's upper end**; the probe's cost per step in milliseconds is
``(ratio - 1) x`` the plain step, with the interval's ends likewise.
``--null`` runs the probed arm's blocks without the probe: an A/A test of the design, whose
truth is 1.  ``--dump F.json`` writes every block's seconds per step and each round's
order, per model.  Each block ends by waiting for the device, so every probed block
starts on an idle device and the probe hands the previous block's logged values to its
copier thread then; ``--continuous`` steps of one unbroken probed stretch (between two
plain ones) give the probe's own work as a run without pauses has it.
``--counter-costs`` also prints what one read of torch_xla's counters costs.
The probe's own work (thread CPU in its entry, exit and ``log``) is read by hooks around
those calls in ``--own-blocks`` probed blocks after the paired rounds, never during them
(the hooks' own ``thread_time`` calls would be in the probed arm's time; they were until
2026-12-06, sixth session, and ``--hooked-rounds`` puts them back), less what a hook
reads around a call that does nothing.

torch_xla keeps the last ``XLA_METRICS_SAMPLES`` (default 1024) samples of every metric and
``metric_data`` copies them all, so a timed metric's read costs ~0.1 ms once the windows
are full: ``--fill`` plain steps of the first model run first, as in a long run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch_xla

import refrun
import refrun.xla
from refrun.probes.xla import XlaCounters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from children_cpu import children_cpu_s

DEV = torch_xla.device()
# torch.nn.GRU as PyTorch defines it (importing torch_xla replaced torch.nn.GRU)
TORCH_GRU = getattr(torch.nn.GRU, "_orig", None) or torch.nn.GRU


# --- the model shapes ----------------------------------------------------------------------
@dataclass
class Arm:
    """One instance of a model shape and its own step counter: what a block runs."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: list[Any]
    scheduler: Any = None
    clip_norm: float | None = None
    eval_every: int = 0
    eval_batch: Any = None
    step: int = 0

    def train(self, n: int) -> torch.Tensor:
        """One training step on batch ``n`` (cycled), ending with the ``sync``."""
        loss = self.loss_of(self.model, self.batches[n % len(self.batches)])
        loss.backward()
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        torch_xla.sync()
        return loss

    def evaluate(self) -> torch.Tensor:
        """The held-out loss (an XLA tensor, synced, not read)."""
        with torch.no_grad():
            loss = self.loss_of(self.model, self.eval_batch)
        torch_xla.sync()
        return loss


@dataclass(frozen=True)
class Shape:
    """A model shape: a one-line description and a factory of identical :class:`Arm` s."""

    name: str
    what: str
    build: Callable[[], Arm]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp() -> Arm:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(DEV)
    g = _gen(1)
    batches = [(torch.randn(128, 64, generator=g).to(DEV),
                torch.randn(128, 1, generator=g).to(DEV)) for _ in range(8)]
    return Arm(model, torch.optim.SGD(model.parameters(), lr=1e-3),
               lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batches)


VOCAB, EMBED, HIDDEN, LM_BATCH, LM_SEQ = 256, 64, 128, 16, 32


class LanguageModel(torch.nn.Module):
    """Embedding, one GRU layer, a linear head over the vocabulary."""

    def __init__(self, gru_class: type) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, EMBED)
        self.gru = gru_class(EMBED, HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.emb(tokens))
        return self.head(out)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a batch of ``LM_SEQ + 1`` tokens per row."""
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             tokens[:, 1:].reshape(-1))


def gru_lm(gru_class: type = torch.nn.GRU) -> Arm:
    torch.manual_seed(0)
    model = LanguageModel(gru_class).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 100))
    g = _gen(2)
    batches = [torch.randint(0, VOCAB, (LM_BATCH, LM_SEQ + 1), generator=g).to(DEV)
               for _ in range(8)]
    held_out = torch.randint(0, VOCAB, (LM_BATCH, LM_SEQ + 1), generator=g).to(DEV)
    return Arm(model, opt, lm_loss, batches, scheduler=sched, clip_norm=1.0,
               eval_every=20, eval_batch=held_out)


WINDOW, HORIZON = 96, 8


def conv() -> Arm:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(1, 32, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 32, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool1d(2),
        torch.nn.Conv1d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(),
        torch.nn.Linear(64, HORIZON)).to(DEV)
    g = _gen(3)
    series = torch.randn(8, 64, WINDOW + HORIZON, generator=g).cumsum(-1)
    batches = [(s[:, None, :WINDOW].to(DEV), s[:, WINDOW:].to(DEV)) for s in series]
    return Arm(model, torch.optim.Adam(model.parameters(), lr=1e-3),
               lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batches)


class GRUStep(torch.nn.Module):
    """A GRU cell unrolled over a sequence, then a linear head."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.cell = torch.nn.GRUCell(32, 64)
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 64, device=x.device)
        for t in range(self.seq):
            h = self.cell(x[:, t], h)
        return self.head(h)


def rnn(seq: int) -> Arm:
    torch.manual_seed(0)
    model = GRUStep(seq).to(DEV)
    x, y = torch.randn(16, seq, 32).to(DEV), torch.randn(16, 1).to(DEV)
    return Arm(model, torch.optim.Adam(model.parameters(), lr=1e-3),
               lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), [(x, y)])


def shapes(seq: int) -> dict[str, Shape]:
    lm = (f"GRU language model: embedding {VOCAB} x {EMBED}, GRU {HIDDEN}, batch "
          f"{LM_BATCH} x {LM_SEQ}, AdamW, clip, LambdaLR, eval every 20 steps")
    return {s.name: s for s in (
        Shape("mlp", "MLP 64-256-256-1, batch 128, SGD", mlp),
        Shape("gru-lm", lm + " (torch_xla's scan GRU)", gru_lm),
        Shape("conv", f"1-D CNN forecaster: 3 Conv1d over {WINDOW} steps, batch 64, Adam",
              conv),
        Shape("gru-lm-torch", lm + " (PyTorch's own nn.GRU)", lambda: gru_lm(TORCH_GRU)),
        Shape("rnn", f"GRU cell x {seq} time steps, batch 16, hidden 64, Adam",
              lambda: rnn(seq)),
    )}


# --- statistics -------------------------------------------------------------------------
def round_ratio(arm: list[float], plain: list[float]) -> tuple[float, float, float, int]:
    """Geometric mean of arm[i] / plain[i] (blocks of the same round) and its 95 %
    t-interval: (ratio, low, high, n).

    ``exp(mean(y))`` with ``y_i = log(arm_i / plain_i)``, the interval ``exp`` of the
    t-interval of ``mean(y)``.  Why not the mean of the ratios: with log ratios spread by
    ``sigma``, ``E[arm / plain] = exp(mu + sigma^2 / 2)``, so the arithmetic mean is
    biased up by ``sigma^2 / 2`` (0.67 % at this machine's sigma of 0.116 in an A/A run,
    2026-12-05, which read 1.0113 for a truth of 1) and is not the reciprocal of
    ``plain / arm``'s; the log scale has neither fault (bench_callbacks.py uses it too)."""
    from scipy import stats

    y = [math.log(a / p) for a, p in zip(arm, plain, strict=True)]
    n = len(y)
    m = statistics.fmean(y)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(y) / n ** 0.5 if n > 1 else float("nan")
    return math.exp(m), math.exp(m - half), math.exp(m + half), n


def hodges_lehmann_ratio(arm: list[float], plain: list[float]) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate of the paired log ratio with its Wilcoxon signed-rank 95 %
    interval, as ratios: (ratio, low, high).

    With ``y_i = log(arm_i / plain_i)`` and the ``N = n(n+1)/2`` Walsh averages
    ``(y_i + y_j) / 2, i <= j``, sorted as ``w_(1) .. w_(N)``: the estimate is their
    median, the interval ``[w_(c+1), w_(N-c)]`` with ``c`` the signed-rank statistic's
    lower 2.5 % point, ``floor(N/2 - 1.96 sqrt(n(n+1)(2n+1)/24))`` (normal approximation;
    Hollander & Wolfe, *Nonparametric Statistical Methods*, 2nd ed., 1999, sec. 3.2-3.3).
    Its one assumption is that ``y`` is symmetric about the shift, which a random order
    per round gives by design: a round's log ratio is the difference of two exchangeable
    block times plus the arm's shift.  Heavy tails (a block that met a busy host) widen it
    less than they widen the t-interval."""
    import numpy as np

    y = np.log(np.asarray(arm) / np.asarray(plain))
    n = len(y)
    i, j = np.triu_indices(n)
    w = np.sort((y[i] + y[j]) / 2)
    c = math.floor(len(w) / 2 - 1.959964 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
    if c < 0:
        return math.exp(float(np.median(w))), float("nan"), float("nan")
    return (math.exp(float(np.median(w))), math.exp(float(w[c])),
            math.exp(float(w[len(w) - 1 - c])))


def crossover_ratio(arm: list[float], plain: list[float], arm_first: list[bool]
                    ) -> tuple[float, float, float, int, float]:
    """Ratio arm / plain of paired blocks, adjusted for the blocks' position in their round:
    (ratio, low, high, n, first-block factor).

    A paired AB/BA cross-over analysed on the log scale (S. Senn, *Cross-over Trials in
    Clinical Research*, 2nd ed., Wiley 2002, ch. 3): with ``y_i = log(arm_i / plain_i)``
    and ``s_i = +1`` where the arm's block ran before the plain one, ``-1`` after,
    ``y_i = mu + pi * s_i + e_i``.  Then ``mu = (mean(y | s=+1) + mean(y | s=-1)) / 2``,
    ``pi = (mean(y | s=+1) - mean(y | s=-1)) / 2``, the residual variance pools both
    groups with ``n - 2`` degrees of freedom, ``Var(mu) = sigma^2 / 4 * (1/n+ + 1/n-)``,
    and the 95 % t-interval is returned as ``exp`` of its ends.  ``exp(pi)`` is how much
    faster (< 1) or slower a block runs first in its pair than second, whichever arm it
    is.  With the order drawn at random that effect is unbiased noise in the plain
    paired ratio (:func:`round_ratio`); here it is estimated and taken out."""
    from scipy import stats

    y = [math.log(a / p) for a, p in zip(arm, plain, strict=True)]
    first = [v for v, f in zip(y, arm_first, strict=True) if f]
    second = [v for v, f in zip(y, arm_first, strict=True) if not f]
    n = len(y)
    if len(first) < 2 or len(second) < 2:
        return float("nan"), float("nan"), float("nan"), n, float("nan")
    m1, m2 = statistics.fmean(first), statistics.fmean(second)
    mu, pi = (m1 + m2) / 2, (m1 - m2) / 2
    rss = sum((v - m1) ** 2 for v in first) + sum((v - m2) ** 2 for v in second)
    se = (rss / (n - 2)) ** 0.5 * (0.25 / len(first) + 0.25 / len(second)) ** 0.5
    half = stats.t.ppf(0.975, n - 2) * se
    return math.exp(mu), math.exp(mu - half), math.exp(mu + half), n, math.exp(pi)


def first_of(orders: list[list[str]], arm: str) -> list[bool]:
    """Per round, whether ``arm``'s block ran before the plain block."""
    return [o.index(arm) < o.index("plain") for o in orders]


def crossover_row(arm: list[float], plain: list[float], arm_first: list[bool]) -> str:
    """:func:`crossover_ratio` as the table prints it."""
    r, lo, hi, _, first = crossover_ratio(arm, plain, arm_first)
    return (f"{r:.4f} [{lo:.4f}, {hi:.4f}] (a block run first in its pair / second: "
            f"{first:.4f}; {sum(arm_first)} of {len(arm_first)} rounds ran the arm first)")




# --- one model shape ------------------------------------------------------------------------
def burn(us: float) -> None:
    """Spend ``us`` microseconds of this thread's CPU in Python (the positive control)."""
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


def run_block(arm: Arm, steps: int, probe: Any = None, burn_us: float = 0,
              after: Callable[[], Any] | None = None) -> float:
    """Seconds per step of ``steps`` steps of ``arm`` (with its evaluations, which run
    between steps and are logged through ``probe.log_eval`` when probed), then a wait for
    the device; ``burn_us``: a plain step that then spends that much thread CPU;
    ``after``: called after each plain step (the hooks' calibration)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        n = arm.step
        arm.step += 1
        if probe is None:
            arm.train(n)
            if burn_us:
                burn(burn_us)
            if after is not None:
                after()
        else:
            with probe.step(n):
                loss = arm.train(n)
                probe.log(loss=loss)
        if arm.eval_every and (n + 1) % arm.eval_every == 0:
            val = arm.evaluate()
            if probe is not None:
                probe.log_eval(n, val_loss=val)
    torch_xla._XLAC._xla_wait_device_ops([])
    return (time.perf_counter() - t0) / steps


HOOKED = ("_enter_step", "_exit_step", "log")


def hooked(f: Callable[..., Any], acc: dict[str, float], key: str) -> Callable[..., Any]:
    """``f``, adding the thread CPU seconds of each call to ``acc[key]`` and counting the
    calls in ``acc["calls"]``."""
    def timed(*a: Any, **kw: Any) -> Any:
        acc["calls"] += 1
        t = time.thread_time()
        try:
            return f(*a, **kw)
        finally:
            acc[key] += time.thread_time() - t
    return timed


def time_hooks(probe: Any) -> dict[str, float]:
    """Thread CPU seconds spent in the probe's per-step calls (step entry and exit, log),
    accumulated from now on until :func:`remove_hooks`: the probe's own work on the
    training thread, which a paired wall-time ratio on a shared machine cannot resolve to
    1 %.  The hooks cost time of their own (two ``thread_time`` calls each, a system call
    of ~2 us on this VM: ~13 us a step for the three), so they are never on the probe
    during the paired blocks, whose ratio they would inflate (they were until 2026-12-06,
    sixth session: docs/xla.md), and what each adds to its own reading is measured
    (:func:`hook_bias`) and taken out."""
    acc = {"enter": 0.0, "exit": 0.0, "log": 0.0, "calls": 0.0}
    for name, key in zip(HOOKED, ("enter", "exit", "log"), strict=True):
        setattr(probe, name, hooked(getattr(probe, name), acc, key))
    return acc


def remove_hooks(probe: Any) -> None:
    for name in HOOKED:
        vars(probe).pop(name, None)  # the instance attribute shadowed the method


def hook_bias(arm: Arm, steps: int) -> float:
    """Thread CPU seconds one hook reads around a call that does nothing, called after
    each step of a plain block (where the probe's calls are: right after a ``sync``, when
    every call costs more than on an idle host): what each hooked call's reading holds
    beyond the call."""
    acc = {"noop": 0.0, "calls": 0.0}
    run_block(arm, steps, after=hooked(lambda: None, acc, "noop"))
    return acc["noop"] / steps


@dataclass(frozen=True)
class ShapeResult:
    """What the summary table shows of one model shape."""

    name: str
    what: str
    plain_ms: float  # median of the plain blocks' seconds per step
    crossover: tuple[float, float, float]  # the target read: ratio, low, high
    hodges_lehmann: tuple[float, float, float]
    geometric: tuple[float, float, float]
    own_us: float  # the probe's thread CPU per step in the hooked blocks, hooks' own taken out
    own_raw_us: float  # the same as the hooks read it
    rounds: int
    steps: int
    null: bool


def bench_shape(shape: Shape, args: argparse.Namespace, fill: int) -> ShapeResult:
    """Plain / probed (/ positive-control) blocks of one model shape in a random order per
    round; prints its rows and returns its line of the summary table."""
    tmp = tempfile.mkdtemp(prefix=f"refrun-bench-xla-{shape.name}-")
    arms = ["plain", "probed"] + (["burn"] if args.burn else [])
    one = None if args.twins else shape.build()
    state = {arm: one or shape.build() for arm in arms}
    plain_a, probed_a = state["plain"], state["probed"]
    run = refrun.start_run(f"bench-xla-{shape.name}", "candidate", hardware="cpu",
                           backend="torch_xla", tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                           spool_dir=f"{tmp}/spool", snapshot_environment=False)
    probe = refrun.xla.instrument(run, model=probed_a.model, optimizer=probed_a.optimizer)
    t0 = time.perf_counter()
    run_block(plain_a, 25)  # warm-up: compile the graphs (evaluation's too, at step 20)
    run_block(probed_a, 25, probe)
    if args.burn:
        run_block(state["burn"], 5, burn_us=args.burn)
    warm = time.perf_counter() - t0
    if fill:  # fill torch_xla's metric windows as a long run has them
        run_block(plain_a, fill)
    steps = args.steps or max(16, round(args.block_s / run_block(plain_a, 16)))
    arm_probe = None if args.null else probe  # --null: an A/A test whose truth is 1
    per_arm: dict[str, list[float]] = {arm: [] for arm in arms}
    orders: list[list[str]] = []
    rng = random.Random(args.seed)
    hooks = time_hooks(probe) if args.hooked_rounds else None  # the design before 2026-12-06
    cpu0 = children_cpu_s()
    for _ in range(args.rounds):
        order = list(arms)
        rng.shuffle(order)  # a fixed order can line up with a periodic effect of the machine
        orders.append(order)
        for arm in order:
            per_arm[arm].append(run_block(state[arm], steps,
                                          arm_probe if arm == "probed" else None,
                                          burn_us=args.burn if arm == "burn" else 0))
    delivery_us = (children_cpu_s() - cpu0) / (args.rounds * steps) * 1e6
    plain, probed = per_arm["plain"], per_arm["probed"]
    # The probe's own work: hooked probed blocks after the paired ones (each after a plain
    # block, as in the rounds), and what the hooks add to their reading, measured the same
    # way and taken out.
    if hooks is None:
        hooks = time_hooks(probe)
        own_blocks = 0 if args.null else args.own_blocks
        for k in hooks:
            hooks[k] = 0.0
        for _ in range(own_blocks):
            run_block(plain_a, steps)
            run_block(probed_a, steps, probe)
    else:
        own_blocks = 0 if args.null else args.rounds
    blocks = dict(hooks)
    bias = hook_bias(plain_a, steps)
    # A continuous run as users have it: no pause between blocks, so the probe never finds
    # the device idle because a plain block drained it.
    for k in hooks:
        hooks[k] = 0.0
    cont = args.continuous
    cont_plain = cont_probed = 0.0
    if cont:
        cont_plain = run_block(plain_a, cont)
        cont_probed = run_block(probed_a, cont, probe)
        cont_plain = (cont_plain + run_block(plain_a, cont)) / 2
    cont_hooks = dict(hooks)
    remove_hooks(probe)
    recorded = sorted(probe.backend.counters())
    probe.close()
    run.close()
    n_own = max(1, own_blocks * steps)
    plain_s = statistics.median(plain)
    calls = blocks.pop("calls")
    own_raw_us = sum(blocks.values()) / n_own * 1e6
    own_us = own_raw_us - calls / n_own * bias * 1e6 if own_blocks else 0.0
    first = first_of(orders, "probed")
    cross = crossover_ratio(probed, plain, first)[:3]
    result = ShapeResult(shape.name, shape.what, plain_s * 1e3, cross,
                         hodges_lehmann_ratio(probed, plain),
                         round_ratio(probed, plain)[:3], own_us, own_raw_us, args.rounds,
                         steps, args.null)
    if args.dump:
        dumped: dict[str, Any] = {}
        if os.path.exists(args.dump):
            with open(args.dump) as f:
                dumped = json.load(f)
        dumped[shape.name] = {**per_arm, "order": orders, "steps": steps}
        with open(args.dump, "w") as f:
            json.dump(dumped, f)
    rows = [
        ("model", f"{shape.name}: {shape.what}"),
        ("warm-up (compile the graphs)", f"{warm:.1f} s"),
        ("plain / probed step (median of blocks)",
         f"{plain_s * 1e3:.2f} / {statistics.median(probed) * 1e3:.2f} ms"),
        ("probed / plain, paired blocks: geometric mean [95 % CI]",
         "{:.4f} [{:.4f}, {:.4f}]".format(*result.geometric)),
        ("probed / plain, paired blocks: Hodges-Lehmann [95 % signed-rank interval]",
         "{:.4f} [{:.4f}, {:.4f}]".format(*result.hodges_lehmann)),
        ("probed / plain, paired blocks, position in the round taken out (cross-over): "
         "ratio [95 % CI]", crossover_row(probed, plain, first)),
        ("delivery process's CPU per probed step (beside the training process)",
         f"{delivery_us:.0f} us"),
        ("paired blocks x steps", f"{args.rounds} x {steps}, order drawn per round (seed "
         f"{args.seed}), " + ("two instances (--twins)" if args.twins else "one instance")
         + (" (A/A: the probed model's blocks ran without the probe)" if args.null else "")),
        *([(f"positive control: plain + {args.burn:g} us of thread CPU a step / plain, "
            "paired: geometric mean [95 % CI]",
            "{:.4f} [{:.4f}, {:.4f}]".format(*round_ratio(per_arm["burn"], plain)[:3])
            + f" (the known cost alone: {1 + args.burn * 1e-6 / plain_s:.4f})"),
           ("  the same, cross-over", crossover_row(per_arm["burn"], plain,
                                                    first_of(orders, "burn")))]
          if args.burn else []),
        ("probe's own work on the training thread (thread CPU in probe.step entry/exit "
         "and probe.log), per step, the hooks' own taken out",
         f"{own_us:.0f} us = {own_us * 1e-6 / plain_s:.2%} of the plain step (wall); "
         f"as read {own_raw_us:.0f} us: " + " / ".join(
             f"{blocks[k] / n_own * 1e6:.0f} us" for k in ("enter", "exit", "log"))
         + f" (entry / exit / log), less {calls / n_own:.2f} calls x {bias * 1e6:.1f} us "
         "(a hooked no-op's "
         f"reading after a plain step); {own_blocks} blocks"
         + (" (the paired rounds, hooked)" if args.hooked_rounds else " after the rounds")),
        *([(f"continuous run of {cont} steps: plain (mean of before and after) / probed "
            "step", f"{cont_plain * 1e3:.2f} ms / {cont_probed * 1e3:.2f} ms (ratio "
            f"{cont_probed / cont_plain:.4f}, one sample); probe's own work there "
            + " / ".join(f"{cont_hooks[k] / cont * 1e6:.0f} us"
                         for k in ("enter", "exit", "log")) + " (entry / exit / log)")]
          if cont else []),
        ("counters recorded per step", ", ".join(recorded)),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", flush=True)
    print(flush=True)
    return result


def summary_table(results: list[ShapeResult]) -> str:
    """One Markdown row per model shape: the paired ratio with its interval, the probe's
    cost per step in milliseconds beside it (``(ratio - 1) x`` the plain step, interval
    ends likewise), and whether the upper end meets the target."""
    head = ("| model | plain step | probed / plain, cross-over [95 % CI] (target read) "
            "| cost per step [95 % CI] | Hodges-Lehmann [95 %] | geometric mean [95 %] "
            "| probe's own work (thread CPU) | rounds x steps | upper end <= 1.01 |\n"
            "|---|---:|---|---|---|---|---|---:|---|")
    lines = [head]
    for r in results:
        c, lo, hi = r.crossover
        cost = f" [{(lo - 1) * r.plain_ms:+.3f}, {(hi - 1) * r.plain_ms:+.3f}]"
        lines.append(
            f"| {r.name}{' (A/A)' if r.null else ''} | {r.plain_ms:.2f} ms "
            f"| {c:.4f} [{lo:.4f}, {hi:.4f}] | {(c - 1) * r.plain_ms:+.3f} ms{cost} "
            "| {:.4f} [{:.4f}, {:.4f}] ".format(*r.hodges_lehmann)
            + "| {:.4f} [{:.4f}, {:.4f}] ".format(*r.geometric)
            + f"| {r.own_us:.0f} us ({r.own_us * 1e-3 / r.plain_ms:.2%}) "
            f"| {r.rounds} x {r.steps} | {'yes' if hi <= 1.01 else 'no'} |")
    return "\n".join(lines)


# --- the cost of one counter read ----------------------------------------------------------
def time_call(fn: Callable[[], Any], repeat: int = 2000) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` calls, timed in blocks of 100."""
    blocks = []
    for _ in range(repeat // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        blocks.append((time.perf_counter() - t0) / 100 * 1e6)
    return statistics.median(blocks)


def counter_costs() -> None:
    """What one read of torch_xla's counters costs now (the metric windows as they are)."""
    counters = XlaCounters(torch_xla._XLAC)
    rows = [
        ("XLA_METRICS_SAMPLES", os.environ.get("XLA_METRICS_SAMPLES", "default (1024)")),
        ("XlaCounters.read", f"{time_call(counters.read):.1f} us"),
        ("XlaCounters.sentinels at entry + exit",
         f"{2 * time_call(lambda: counters.sentinels(copy_from=False)):.1f} us"),
    ]
    for name, value in rows:
        print(f"{name:<40}  {value}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", "--model", default="mlp,gru-lm,conv",
                    help="comma-separated model shapes: mlp, gru-lm, conv, gru-lm-torch, rnn "
                         "(--model rnn: the earlier runs' command)")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--steps", type=int, default=0,
                    help="steps per block (default: about --block-s of plain steps, >= 16)")
    ap.add_argument("--block-s", type=float, default=0.5,
                    help="seconds of plain steps a block lasts when --steps is not given")
    ap.add_argument("--seq", type=int, default=16, help="rnn: time steps per sequence")
    ap.add_argument("--continuous", type=int, default=100,
                    help="steps of the continuous plain / probed / plain stretch whose "
                         "probe work is reported apart from the alternating blocks'")
    ap.add_argument("--fill", type=int, default=1100,
                    help="plain steps of the first model run first so that torch_xla's "
                         "metric sample windows (1024) are full, as in a long run")
    ap.add_argument("--null", action="store_true",
                    help="A/A test: the probed arm's blocks run without the probe, so the "
                         "design's own bias and noise show")
    ap.add_argument("--burn", type=float, default=0.0, metavar="US",
                    help="add a positive-control arm, a plain step plus US microseconds "
                         "of thread CPU (e.g. the probe's own work)")
    ap.add_argument("--own-blocks", type=int, default=10,
                    help="hooked probed blocks after the paired rounds (each after a plain "
                         "block) that measure the probe's own work")
    ap.add_argument("--hooked-rounds", action="store_true",
                    help="hook the probe during the paired rounds too (the design before "
                         "2026-12-06, sixth session: the ratio then includes the hooks)")
    ap.add_argument("--twins", action="store_true",
                    help="one model instance per arm (the design before 2026-12-07), "
                         "instead of one instance for every arm")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block order")
    ap.add_argument("--dump", default=None, help="write every block's time here (JSON)")
    ap.add_argument("--counter-costs", action="store_true",
                    help="also print what one read of torch_xla's counters costs")
    args = ap.parse_args()
    known = shapes(args.seq)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(f"--models: unknown {unknown or names}; choose from {', '.join(known)}")
    if args.dump and os.path.exists(args.dump):
        os.remove(args.dump)
    print(f"CPUs this process may run on: {sorted(os.sched_getaffinity(0))} of "
          f"{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    results = [bench_shape(known[n], args, args.fill if i == 0 else 0)
               for i, n in enumerate(names)]
    print(summary_table(results))
    if args.counter_costs:
        print()
        counter_costs()


if __name__ == "__main__":
    main()
