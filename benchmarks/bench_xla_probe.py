"""Overhead of refrun.xla.instrument on PJRT CPU, measured in one process.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_xla_probe.py [--steps 100] [--rounds 5]

Prints a table:

* per-step time of the same SGD loop unwrapped and wrapped (``probe.step`` + ``probe.log``
  of the loss), in interleaved rounds so that drift hits both equally; the ratio is
  wrapped / unwrapped of the medians over rounds;
* the cost of one read of torch_xla's counters (``XlaCounters.read``, what the probe does
  after every step), measured once the metric sample windows are full;
* the cost of the backend's ``counters()`` (the read plus the deltas kept for the summary);
* the cost of the two in-step reads of the transfer and sync counts
  (``XlaCounters.sentinels`` at the step's entry and exit: counters only; the exact
  count is read only when they moved, see ``refrun.probes.xla.TransferCount``).

``--model rnn`` measures a realistic step instead: a GRU cell unrolled over a sequence
(``--seq`` steps, batch 16, hidden 64, Adam), hundreds of small operations per graph,
where tracing the next step overlaps the device's execution of the previous one.  Each
round runs one block of ``--steps`` steps of every arm in one process, in an order drawn
at random for each round (seeded): plain, probed, and with ``--burn US`` a positive
control, a plain step that then spends US microseconds of thread CPU in a Python loop (a
known cost, so the table shows whether the design resolves a cost of that size on this
machine at this hour).  An arm's block over the same round's plain block is one paired
sample; the table gives their geometric mean with a 95 % t-interval, their Hodges-Lehmann
estimate with its signed-rank interval, and the same pairs analysed as
a cross-over (:func:`crossover_ratio`): whether a block ran first or second in its pair
moves its time by itself (a position effect: bench_callbacks' Keras/JAX A/A test found
the first block of a round 4-7 % faster), which a random order turns into noise and this
analysis estimates and removes.  The "Done when" target is an upper end <= 1.01.  The
probed loop records the same counters as the default run.
``--null`` runs the probed arm's blocks without the probe: an A/A test of the design (two
model instances of the same graph), whose truth is 1.  ``--dump F.json`` writes every
block's seconds per step and each round's order.
Each block ends by waiting for the device, so every probed block starts on an idle device
and the probe hands the previous block's logged values to its copier thread then;
``--continuous`` steps of one unbroken probed stretch (between two plain ones) give the
probe's own work as a run without pauses has it.

torch_xla keeps the last ``XLA_METRICS_SAMPLES`` (default 1024) samples of every metric and
``metric_data`` copies them all, so the counter read costs ~0.1 ms per timed metric once
the windows are full; run with ``XLA_METRICS_SAMPLES=16`` to see the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch_xla

import refrun
import refrun.xla
from refrun.probes.xla import XlaCounters

DEV = torch_xla.device()


class GRUStep(torch.nn.Module):
    """A GRU cell unrolled over a sequence, then a linear head (a realistic step)."""

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


def make_rnn(seq: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GRUStep(seq).to(DEV)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


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


def bench_rnn(args: argparse.Namespace) -> None:
    """The realistic step: plain / probed (/ positive-control) blocks in a random order
    per round, paired ratios with a CI."""
    tmp = tempfile.mkdtemp(prefix="refrun-bench-xla-rnn-")
    x = torch.randn(16, args.seq, 32).to(DEV)
    y = torch.randn(16, 1).to(DEV)
    arms = ["plain", "probed"] + (["burn"] if args.burn else [])
    models = {arm: make_rnn(args.seq) for arm in arms}
    plain_m, plain_o = models["plain"]
    probed_m, probed_o = models["probed"]
    run = refrun.start_run("bench-xla", "candidate", hardware="cpu", backend="torch_xla",
                           tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                           spool_dir=f"{tmp}/spool", snapshot_environment=False)
    probe = refrun.xla.instrument(run, model=probed_m, optimizer=probed_o)
    hooks = time_hooks(probe)
    t0 = time.perf_counter()
    run_steps(plain_m, plain_o, x, y, 5, 0)  # warm-up: compile the graphs
    run_steps(probed_m, probed_o, x, y, 5, 0, probe)
    if args.burn:
        run_steps(*models["burn"], x, y, 5, 0, burn_us=args.burn)
    warm = time.perf_counter() - t0
    if args.fill:  # fill torch_xla's metric windows as a long run has them
        run_steps(plain_m, plain_o, x, y, args.fill, 0)
    for k in hooks:
        hooks[k] = 0.0
    # --null: the probed arm runs without the probe (an A/A test whose truth is 1)
    arm_probe = None if args.null else probe
    per_arm: dict[str, list[float]] = {arm: [] for arm in arms}
    orders: list[list[str]] = []
    rng = random.Random(args.seed)
    step = 5
    for _ in range(args.rounds):
        order = list(arms)
        rng.shuffle(order)  # a fixed order can line up with a periodic effect of the machine
        orders.append(order)
        for arm in order:
            m_, o_ = models[arm]
            if arm == "probed":
                per_arm[arm].append(run_steps(m_, o_, x, y, args.steps, step, arm_probe))
                step += args.steps
            else:
                per_arm[arm].append(run_steps(m_, o_, x, y, args.steps, 0,
                                             burn_us=args.burn if arm == "burn" else 0))
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({**per_arm, "order": orders}, f)
    plain, probed = per_arm["plain"], per_arm["probed"]
    n_probed = args.rounds * args.steps
    blocks = dict(hooks)
    # A continuous run as users have it: no pause between blocks, so the probe never finds
    # the device idle because a plain block drained it; one long probed stretch between two
    # long plain ones.
    for k in hooks:
        hooks[k] = 0.0
    cont_plain = [run_steps(plain_m, plain_o, x, y, args.continuous, 0)]
    cont_probed = run_steps(probed_m, probed_o, x, y, args.continuous, step, probe)
    cont_plain.append(run_steps(plain_m, plain_o, x, y, args.continuous, 0))
    cont = dict(hooks)
    probe.close()
    run.close()
    m, lo, hi, n = round_ratio(probed, plain)
    recorded = sorted(k for k in probe.backend.counters())
    hook_us = sum(blocks.values()) / n_probed * 1e6
    plain_cpu = statistics.median(plain) * 1e6
    cont_us = sum(cont.values()) / args.continuous * 1e6
    cont_plain_us = statistics.fmean(cont_plain) * 1e6
    rows = [
        ("step", f"GRU cell x {args.seq} time steps, batch 16, hidden 64, Adam"),
        ("warm-up (compile the graphs)", f"{warm:.1f} s"),
        ("plain step (median of blocks)", f"{statistics.median(plain) * 1e3:.2f} ms"),
        ("probed step (median of blocks)", f"{statistics.median(probed) * 1e3:.2f} ms"),
        ("probed / plain, paired blocks: geometric mean [95 % CI]",
         f"{m:.4f} [{lo:.4f}, {hi:.4f}]"),
        ("probed / plain, paired blocks: Hodges-Lehmann [95 % signed-rank interval]",
         "{:.4f} [{:.4f}, {:.4f}]".format(*hodges_lehmann_ratio(probed, plain))),
        ("probed / plain, paired blocks, position in the round taken out (cross-over): "
         "ratio [95 % CI]", crossover_row(probed, plain, first_of(orders, "probed"))),
        ("paired blocks x steps", f"{n} x {args.steps}, order drawn per round (seed "
         f"{args.seed})"
         + (" (A/A: the probed model's blocks ran without the probe)" if args.null else "")),
        *([(f"positive control: plain + {args.burn:g} us of thread CPU a step / plain, "
            "paired: geometric mean [95 % CI]",
            "{:.4f} [{:.4f}, {:.4f}]".format(*round_ratio(per_arm["burn"], plain)[:3])
            + f" (the known cost alone: {1 + args.burn / plain_cpu:.4f})"),
           ("  the same, cross-over", crossover_row(per_arm["burn"], plain,
                                                    first_of(orders, "burn")))]
          if args.burn else []),
        ("metric windows filled first", f"{args.fill} steps"),
        ("probe's own work on the training thread (thread CPU in probe.step entry/exit "
         "and probe.log), per step", f"{hook_us:.0f} us = {hook_us / plain_cpu:.2%} of the "
         "plain step (wall)"),
        ("  of which entry / exit / log", " / ".join(
            f"{blocks[k] / n_probed * 1e6:.0f} us" for k in ("enter", "exit", "log"))),
        (f"continuous run of {args.continuous} steps: plain (mean of before and after) / "
         "probed step", f"{cont_plain_us / 1e3:.2f} ms / {cont_probed * 1e3:.2f} ms "
         f"(ratio {cont_probed * 1e6 / cont_plain_us:.4f}, one sample)"),
        ("  probe's own work on the training thread there, per step",
         f"{cont_us:.0f} us = {cont_us / cont_plain_us:.2%} of the plain step: " + " / ".join(
             f"{cont[k] / args.continuous * 1e6:.0f} us" for k in ("enter", "exit", "log"))
         + " (entry / exit / log)"),
        ("counters still recorded per step", ", ".join(recorded)),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def time_hooks(probe) -> dict[str, float]:
    """Thread CPU seconds spent in the probe's per-step calls (step entry and exit, log),
    accumulated from now on: the probe's own work on the training thread, which a paired
    wall-time ratio on a shared machine cannot resolve to 1 %."""
    acc = {"enter": 0.0, "exit": 0.0, "log": 0.0}
    for name, key in (("_enter_step", "enter"), ("_exit_step", "exit"), ("log", "log")):
        f = getattr(probe, name)

        def timed(*a, _f=f, _k=key, **kw):
            t = time.thread_time()
            try:
                return _f(*a, **kw)
            finally:
                acc[_k] += time.thread_time() - t

        setattr(probe, name, timed)
    return acc


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(DEV)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def burn(us: float) -> None:
    """Spend ``us`` microseconds of this thread's CPU in Python (the positive control)."""
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


def run_steps(model, opt, x, y, steps: int, start: int, probe=None, burn_us: float = 0
              ) -> float:
    """Seconds per step of ``steps`` steps (the loop waits for the device at the end);
    ``burn_us``: a plain step that then spends that much thread CPU (see :func:`burn`)."""
    t0 = time.perf_counter()
    for n in range(start, start + steps):
        if probe is None:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            if burn_us:
                burn(burn_us)
        else:
            with probe.step(n):
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch_xla.sync()
                probe.log(loss=loss)
    torch_xla._XLAC._xla_wait_device_ops([])
    return (time.perf_counter() - t0) / steps


def time_call(fn, repeat: int = 2000) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` calls, timed in blocks of 100."""
    blocks = []
    for _ in range(repeat // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        blocks.append((time.perf_counter() - t0) / 100 * 1e6)
    return statistics.median(blocks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", choices=("mlp", "rnn"), default="mlp")
    ap.add_argument("--seq", type=int, default=16, help="rnn: time steps per sequence")
    ap.add_argument("--continuous", type=int, default=400,
                    help="rnn: steps of the continuous plain / probed / plain stretch whose "
                         "probe work is reported apart from the alternating blocks'")
    ap.add_argument("--fill", type=int, default=1100,
                    help="rnn: plain steps run first so that torch_xla's metric sample "
                         "windows (1024) are full, as in a long run")
    ap.add_argument("--null", action="store_true",
                    help="rnn: A/A test, the second model's alternating blocks run without "
                         "the probe, so the design's own bias and noise show")
    ap.add_argument("--burn", type=float, default=0.0, metavar="US",
                    help="rnn: add a positive-control arm, a plain step plus US microseconds "
                         "of thread CPU (e.g. the probe's own work)")
    ap.add_argument("--seed", type=int, default=0, help="rnn: seed of the block order")
    ap.add_argument("--dump", default=None, help="rnn: write every block's time here (JSON)")
    args = ap.parse_args()
    if args.model == "rnn":
        bench_rnn(args)
        return
    tmp = tempfile.mkdtemp(prefix="refrun-bench-xla-")
    x = torch.randn(128, 64).to(DEV)
    y = torch.randn(128, 1).to(DEV)
    plain_m, plain_o = make_model()
    wrapped_m, wrapped_o = make_model()
    run = refrun.start_run("bench-xla", "candidate", hardware="cpu", backend="torch_xla",
                           tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                           spool_dir=f"{tmp}/spool", snapshot_environment=False)
    probe = refrun.xla.instrument(run, model=wrapped_m, optimizer=wrapped_o)
    run_steps(plain_m, plain_o, x, y, 20, 0)  # warm-up: compile both graphs
    run_steps(wrapped_m, wrapped_o, x, y, 20, 0, probe)
    plain, wrapped = [], []
    step = 20
    for _ in range(args.rounds):
        plain.append(run_steps(plain_m, plain_o, x, y, args.steps, 0))
        wrapped.append(run_steps(wrapped_m, wrapped_o, x, y, args.steps, step, probe))
        step += args.steps

    counters = XlaCounters(torch_xla._XLAC)
    read_us = time_call(counters.read)
    window_us = 2 * time_call(counters.sentinels)
    backend = probe.backend
    bookkeeping_us = time_call(backend.counters)
    probe.close()
    run.close()

    p, w = statistics.median(plain), statistics.median(wrapped)
    rows = [
        ("unwrapped step (median of rounds)", f"{p * 1e3:.3f} ms"),
        ("wrapped step (median of rounds)", f"{w * 1e3:.3f} ms"),
        ("ratio wrapped / unwrapped", f"{w / p:.4f}"),
        ("rounds x steps", f"{args.rounds} x {args.steps}"),
        ("XLA_METRICS_SAMPLES", os.environ.get("XLA_METRICS_SAMPLES", "default (1024)")),
        ("XlaCounters.read (per step)", f"{read_us:.1f} us"),
        ("backend.counters incl. deltas (per step)", f"{bookkeeping_us:.1f} us"),
        ("XlaCounters.sentinels at entry + exit (per step)", f"{window_us:.1f} us"),
        ("all counter reads / unwrapped step", f"{(read_us + window_us) * 1e-6 / p:.4%}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  value")
    print("-" * (width + 16))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
