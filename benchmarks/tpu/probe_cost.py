"""What refrun's JAX probe costs a training step, measured paired in one process.

    python benchmarks/tpu/probe_cost.py [--rounds 12] [--steps 350] [--quick]
        [--workloads gru,gru-small,digits,charlm,markov] [--json FILE] [--timeline] [--known-load]

Runs on whatever JAX finds (the TPU on a TPU VM, the CPU elsewhere: the mechanism can be
checked without a chip) and needs only numpy, jax and refrun's recording core (the
``mlflow-skinny`` install of a TPU VM; no torch, no scipy needed).

Workloads (each a real training step, state donated as the pipelines donate it):

* ``gru``: a GRU language model (embedding, ``lax.scan`` GRU, softmax head, Adam; the
  lead's reconnaissance model) sized to about 1 ms on a TPU v5e (``--gru-size``, default
  ``V,E,H,T,B = 96,64,768,64,128`` on a TPU, the reconnaissance's ``96,64,128,64,32`` on
  the CPU);
* ``gru-small``: the reconnaissance's size on every platform (0.06 ms on the chip, a
  host-bound 0.29 ms step on the TPU VM: the probe's worst case);
* ``digits``, ``charlm``, ``markov``: the pipelines' JAX ports (their own ``make_train_step``
  on a one-device mesh, their configuration), on synthetic batches of their shapes (the
  probe's cost does not depend on the data's values), logging ``loss`` and ``grad_norm``
  every step as the pipelines do.

Arms, each a block of ``--steps`` steps per round, in an order drawn at random per round
(seeded), every block ending when the device is done:

* ``plain``: the loop without refrun;
* ``probed``: ``refrun.jax.instrument`` as a user gets it (psutil, device memory, chip
  utilisation) with ``probe.step`` + ``probe.log`` each step;
* ``buffered``: as ``probed``, the step's scalars written into a metrics buffer inside
  the jitted step (``probe.metrics_buffer`` + ``probe.log_buffer``: the step compiled
  once more with the buffer as an argument, donated) instead of ``probe.log``;
* ``buffer-only``: as ``buffered``, the step returning its scalars in the buffer alone (not
  also as outputs of their own): on a TPU host every output of a dispatched step costs
  the dispatching thread ~7.5 us (``dispatch_costs.py``), so a step whose scalars are
  only logged returns them once;
* ``bare``: the plain loop with the step returning its state alone (its scalars nowhere):
  the baseline a ``buffer-only`` step is measured against as well as ``plain`` (a port
  that logs nothing would not return its scalars either), printed as ``buffer-only /
  bare``;
* ``no-monitors``: the same as ``probed`` with ``monitors=None`` (the hot path, collector
  and delivery alone);
* ``no-log``: ``probe.step`` only (``monitors=None``);
* ``window``: ``no-monitors`` plus one profiler window of the chip-utilisation sampler
  forced into the middle of every block (what one window costs the training thread);
* ``burn``: plain plus 1 % of the plain step of Python work after each step (the
  positive control: does the design resolve a 1 % cost on this machine now?).

Each arm's block over the same round's plain block is one paired sample; the table gives
their geometric mean with a 95 % t-interval and the Hodges-Lehmann estimate with its
signed-rank interval (docs/research/xla-probe-cost.md, benchmarks/bench_xla_probe.py).
Also: the probe's own thread CPU per step (an empty step with one logged scalar), reading
logged scalars (``jax.device_get`` of a list against the probe's stacked read, per
value), one psutil sample, and the chip-utilisation source the ``probed`` runs recorded.

``--known-load`` checks the chip sampler's windows against bf16 matmuls run back to back
(~100 % busy expected) and with ``block_until_ready`` and a 2 ms sleep after each (one
matmul's wall time over a step's: a figure that does not come from the profiler).

``--timeline`` also records, for the ``plain`` and ``probed`` arms of every workload,
each step's dispatch entry and exit and the time its loss became ready (a watcher thread
waits on each), and one device-only profiler window's programs: whether the runtime
blocks dispatch when it is far ahead (the queue depth: steps dispatched but not ready),
and the device time per step.  The step-time definition ``interval`` (docs/jax.md) is
exact for a device-bound loop only with that back-pressure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO / "src", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import refrun  # noqa: E402
import refrun.jax  # noqa: E402
from refrun import schema  # noqa: E402
from refrun.probes import jax_blocks  # noqa: E402
from refrun.probes.chip_busy import BusySampling, ProfilerWindows, jax_sessions  # noqa: E402
from refrun.probes.jax_blocks import ColumnReader, precompile, read_arrays  # noqa: E402
from refrun.probes.monitors import PsutilMonitor  # noqa: E402

ARMS = ("plain", "probed", "buffered", "buffer-only", "bare", "no-monitors", "no-log",
        "window", "burn")
PROBED_ARMS = ("probed", "buffered", "buffer-only", "no-monitors", "no-log", "window")
BUFFER_ARMS = ("buffered", "buffer-only")


# --- statistics --------------------------------------------------------------------------------
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042,
         40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    """The 97.5 % point of Student's t with ``df`` degrees of freedom (a table; the next
    smaller tabulated ``df`` above 20, which errs wide)."""
    if df in _T975:
        return _T975[df]
    return _T975[max(k for k in _T975 if k <= df)] if df > 1 else float("nan")


def geometric_ratio(arm: list[float], plain: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``arm[i] / plain[i]`` with its 95 % t-interval: ``exp`` of the
    mean of ``y_i = log(arm_i / plain_i)`` and of its interval (the arithmetic mean of
    ratios is biased up by ``sigma^2 / 2``: benchmarks/bench_xla_probe.py)."""
    y = [math.log(a / p) for a, p in zip(arm, plain, strict=True)]
    m = statistics.fmean(y)
    if len(y) < 2:
        return math.exp(m), float("nan"), float("nan")
    half = t975(len(y) - 1) * statistics.stdev(y) / len(y) ** 0.5
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def hodges_lehmann(arm: list[float], plain: list[float]) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate of the paired log ratio with its Wilcoxon signed-rank 95 %
    interval, as ratios (Hollander & Wolfe 1999, sec. 3.2-3.3; normal approximation)."""
    y = np.log(np.asarray(arm) / np.asarray(plain))
    n = len(y)
    i, j = np.triu_indices(n)
    w = np.sort((y[i] + y[j]) / 2)
    c = math.floor(len(w) / 2 - 1.959964 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
    if c < 0:
        return math.exp(float(np.median(w))), float("nan"), float("nan")
    return (math.exp(float(np.median(w))), math.exp(float(w[c])),
            math.exp(float(w[len(w) - 1 - c])))


# --- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    """A training step: ``init()`` a fresh state, ``step(state, n)`` one step (its host
    work included) returning ``(state, loss, norms or None)``; ``fns``: the jitted step."""

    name: str
    what: str
    init: Callable[[], Any]
    step: Callable[[Any, int], tuple[Any, Any, Any]]
    fns: list[Any]
    # The ``buffered`` arm: the step calls ``call[0]`` (the jitted step, or a wrapper
    # that also writes the step's scalars into a metrics buffer); ``donate``: the jitted
    # step's donated arguments; ``metrics``: a step output's logged scalars by name.
    call: list[Any] = field(default_factory=list)
    donate: tuple[int, ...] = ()
    metrics: Callable[[tuple[Any, ...]], dict[str, Any]] = lambda out: {"loss": out[-1]}
    metric_outputs: int = 1  # the step's last outputs that ``metrics`` reads


def gru(size: tuple[int, int, int, int, int], name: str = "gru") -> Workload:
    """The reconnaissance's GRU language model (Adam, state donated)."""
    V, E, H, T, B = size

    def init_params(key: jax.Array) -> dict[str, jax.Array]:
        k = jax.random.split(key, 4)
        return {"emb": jax.random.normal(k[0], (V, E)) * 0.1,
                "wx": jax.random.normal(k[1], (E, 3 * H)) / math.sqrt(E),
                "wh": jax.random.normal(k[2], (H, 3 * H)) / math.sqrt(H),
                "b": jnp.zeros(3 * H),
                "wo": jax.random.normal(k[3], (H, V)) / math.sqrt(H), "bo": jnp.zeros(V)}

    def loss_fn(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        xs = jnp.einsum("bte,eg->tbg", p["emb"][x], p["wx"]) + p["b"]

        def cell(h: jax.Array, xg: jax.Array) -> tuple[jax.Array, jax.Array]:
            hg = h @ p["wh"]
            r = jax.nn.sigmoid(xg[:, :H] + hg[:, :H])
            z = jax.nn.sigmoid(xg[:, H:2 * H] + hg[:, H:2 * H])
            n = jnp.tanh(xg[:, 2 * H:] + r * hg[:, 2 * H:])
            h = (1 - z) * n + z * h
            return h, h

        _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], H)), xs)
        logits = jnp.einsum("tbh,hv->btv", hs, p["wo"]) + p["bo"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))

    def gru_step(p, m, v, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        p = jax.tree.map(lambda p, m, v: p - 1e-3 * (m / (1 - 0.9 ** t))
                         / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8), p, m, v)
        return p, m, v, t + 1, loss

    fn = jax.jit(gru_step, donate_argnums=(0, 1, 2))
    call = [fn]
    rng = np.random.default_rng(0)
    data = [jnp.asarray(rng.integers(0, V, (B, T + 1)), jnp.int32) for _ in range(16)]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]

    def init() -> Any:
        p = init_params(jax.random.PRNGKey(0))
        return (p, jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.zeros_like, p),
                jnp.float32(1.0))

    def step(state: Any, n: int) -> tuple[Any, Any, Any]:
        p, m, v, t = state
        p, m, v, t, loss = call[0](p, m, v, t, *batches[n % 16])
        return (p, m, v, t), loss, None

    return Workload(name, f"GRU LM V,E,H,T,B={V},{E},{H},{T},{B}, Adam", init, step, [fn],
                    call, (0, 1, 2))


def _port_metrics(out: tuple[Any, ...]) -> dict[str, Any]:
    """A port step's logged scalars, named as ``probe.log(loss=..., grad_norm=...)``
    names them."""
    return refrun.jax.flatten_pytree({"loss": out[-2], "grad_norm": out[-1]})


def buffered_call(w: Workload, arm: Arm, only: bool = False) -> Callable[..., Any]:
    """``w``'s jitted step with the same arguments and outputs, compiled once more with a
    metrics buffer (``arm.buf``) written inside it and donated with the step's own
    donated arguments: what a user of ``probe.metrics_buffer`` writes.  ``only``: the
    step's scalars are returned in the buffer alone (the call gives None for each)."""
    fn = w.fns[0]
    dropped = w.metric_outputs if only else 0

    def with_buffer(buf: Any, *args: Any) -> tuple[Any, Any]:
        out = fn(*args)
        return out[:len(out) - dropped], buf.record(**w.metrics(out))

    jitted = jax.jit(with_buffer, donate_argnums=(0, *(i + 1 for i in w.donate)))

    def call(*args: Any) -> Any:
        out, arm.buf = jitted(arm.buf, *args)
        return (*out, *(None,) * dropped) if dropped else out

    return call


def bare_call(w: Workload) -> Callable[..., Any]:
    """``w``'s jitted step compiled once more returning its state alone (the call gives
    None for each scalar output): the ``bare`` arm's step."""
    fn, dropped = w.fns[0], w.metric_outputs

    def state_only(*args: Any) -> Any:
        out = fn(*args)
        return out[:len(out) - dropped]

    jitted = jax.jit(state_only, donate_argnums=w.donate)

    def call(*args: Any) -> Any:
        return (*jitted(*args), *(None,) * dropped)

    return call


def one_device_mesh() -> Any:
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def replicated(mesh: Any, tree: Any) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    return jax.device_put(tree, NamedSharding(mesh, P()))


def digits() -> Workload:
    from pipelines.digits.config import load_config
    from pipelines.digits.model import init_params, layer_names
    from pipelines.digits.train_jax import make_train_step

    cfg = load_config()
    mesh = one_device_mesh()
    names = tuple(layer_names(cfg.sizes))
    fn = make_train_step(mesh, names, cfg.lr, cfg.momentum, cfg.clip_norm, reduction="mean",
                         clip_per_device=False, block_first=False)
    call = [fn]
    rng = np.random.default_rng(0)
    xs = rng.random((16, cfg.batch, cfg.sizes[0]), dtype=np.float32)
    ys = rng.integers(0, cfg.sizes[-1], (16, cfg.batch)).astype(np.int32)

    def init() -> Any:
        p = replicated(mesh, {k: jnp.asarray(v) for k, v in init_params(cfg.sizes, 0).items()})
        return p, replicated(mesh, {k: jnp.zeros_like(v) for k, v in p.items()})

    def step(state: Any, n: int) -> tuple[Any, Any, Any]:
        params, mom, loss, norms = call[0](*state, xs[n % 16], ys[n % 16])  # NumPy batches
        return (params, mom), loss, norms

    return Workload("digits", f"pipelines.digits JAX port, MLP {cfg.sizes}, batch "
                    f"{cfg.batch}, SGD momentum", init, step, [fn], call, (0, 1), _port_metrics,
                    2)


def charlm() -> Workload:
    from pipelines.charlm.config import load_config, schedule
    from pipelines.charlm.data import VOCAB, dropout_mask
    from pipelines.charlm.model import init_params
    from pipelines.charlm.train_jax import make_train_step

    cfg = load_config()
    mesh = one_device_mesh()
    fn = make_train_step(mesh, cfg, frozenset())
    call = [fn]
    rng = np.random.default_rng(0)
    xs = rng.integers(0, VOCAB, (16, cfg.batch, cfg.context + 1)).astype(np.int32)
    keeps = [dropout_mask(0, n, (cfg.batch, cfg.context, cfg.d_model), cfg.dropout)
             for n in range(16)]

    def init() -> Any:
        w = init_params(VOCAB, cfg.context, cfg.d_model, cfg.n_layer, cfg.mlp_ratio, 0)
        p = replicated(mesh, {k: jnp.asarray(v) for k, v in w.items()})
        m = replicated(mesh, {k: jnp.zeros_like(v) for k, v in p.items()})
        return p, m, replicated(mesh, {k: jnp.zeros_like(v) for k, v in p.items()})

    def step(state: Any, n: int) -> tuple[Any, Any, Any]:
        w = xs[n % 16]
        params, m, v, loss, norms = call[0](*state, w[:, :-1], w[:, 1:], keeps[n % 16],
                                       schedule(cfg, n % cfg.steps, True))
        return (params, m, v), loss, norms

    return Workload("charlm", f"pipelines.charlm JAX port, transformer d={cfg.d_model} "
                    f"L={cfg.n_layer} T={cfg.context}, batch {cfg.batch}, Adam", init, step,
                    [fn], call, (0, 1, 2), _port_metrics, 2)


def markov() -> Workload:
    from pipelines.markov.config import load_config, schedule
    from pipelines.markov.model import init_params
    from pipelines.markov.train_jax import make_train_step

    cfg = load_config()
    mesh = one_device_mesh()
    fn = make_train_step(mesh, cfg, frozenset())
    call = [fn]
    rng = np.random.default_rng(0)
    xs = rng.integers(0, cfg.symbols, (16, cfg.batch, cfg.length)).astype(np.int32)
    ys = rng.integers(0, cfg.classes, (16, cfg.batch)).astype(np.int32)

    def init() -> Any:
        w = init_params(cfg.symbols, cfg.embed, cfg.hidden, cfg.classes, 0)
        p = replicated(mesh, {k: jnp.asarray(v) for k, v in w.items()})
        m = replicated(mesh, {k: jnp.zeros_like(v) for k, v in p.items()})
        return p, m, replicated(mesh, {k: jnp.zeros_like(v) for k, v in p.items()})

    def step(state: Any, n: int) -> tuple[Any, Any, Any]:
        params, m, v, loss, norms = call[0](*state, xs[n % 16], ys[n % 16], schedule(cfg, n))
        return (params, m, v), loss, norms

    return Workload("markov", f"pipelines.markov JAX port, GRU E={cfg.embed} H={cfg.hidden} "
                    f"T={cfg.length}, batch {cfg.batch}, Adam", init, step, [fn], call,
                    (0, 1, 2), _port_metrics, 2)


SMALL_GRU = (96, 64, 128, 64, 32)
TPU_GRU = (96, 64, 768, 64, 128)


def make_workload(name: str, gru_size: tuple[int, ...] | None) -> Workload:
    if name == "gru":
        size = gru_size or (TPU_GRU if jax.default_backend() == "tpu" else SMALL_GRU)
        return gru(tuple(size), "gru")  # type: ignore[arg-type]
    if name == "gru-small":
        return gru(SMALL_GRU, "gru-small")
    return {"digits": digits, "charlm": charlm, "markov": markov}[name]()


# --- arms ----------------------------------------------------------------------------------------
def burn(seconds: float) -> None:
    """Spend about ``seconds`` in a Python loop on this thread (the positive control).
    Counted in loop iterations calibrated once against ``time.perf_counter``, not timed
    with ``time.thread_time``: under gVisor (the TPU v5e VM) that clock advances in ticks
    of milliseconds, and a burn of 9 us waited for the next tick (the first TPU run's
    control read 11.6x the plain step instead of 1.01x)."""
    for _ in range(round(seconds * _spins_per_second())):
        pass


@functools.cache
def _spins_per_second() -> float:
    """Iterations of an empty Python loop per second here: the fastest of five timings
    of a loop long enough (~20 ms) for ``perf_counter``'s resolution."""
    n, best = 200_000, float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        best = min(best, time.perf_counter() - t0)
    return n / best


@dataclass
class Arm:
    name: str
    state: Any
    probe: Any = None
    run: Any = None
    log: bool = True
    step_no: int = 0
    blocks: list[float] = field(default_factory=list)
    # per block, the median interval between successive steps' returns: the steady step,
    # without the block's stalls (another thread's profiler window or GC landing in it)
    medians: list[float] = field(default_factory=list)
    buf: Any = None  # the buffered arm's metrics buffer, and its step
    call: Any = None


FLUSH_S: float | None = None
"""``--flush-interval``: the probed runs' flush interval (None: refrun's, 1 s).  The
probe's collector reads a block's values once per interval on its own thread; with
blocks shorter than the interval most of that work lands in whichever arm's block runs
next, the plain arm's included, and the paired ratio does not see it.  An interval of a
tenth of a block keeps ~90 % of it in the probed block (found 2026-12-06, fourth
session: the earlier port tables are lower bounds of the collector's share)."""


FLUSH_AT_END = False
"""``--flush-at-block-end``: each probed block ends with ``probe.flush()`` inside its timing,
so the block's mean step carries all of its collector's work however long the flush
interval (the default 1 s included) and none of it lands in the next arm's block (added
2026-12-06, fifth session).  The median step then excludes that collection: read the
block means."""


class GcCount:
    """Garbage collections (count, seconds) by generation while an arm's blocks run,
    from ``gc.callbacks``: a probe that keeps objects alive until its collector runs makes
    the collector of Python run more often than the plain loop."""

    def __init__(self) -> None:
        self.arm: str | None = None
        self.by_arm: dict[str, dict[int, list[float]]] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if self.arm is None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        gens = self.by_arm.setdefault(self.arm, {})
        g = gens.setdefault(int(info["generation"]), [0, 0.0])
        g[0] += 1
        g[1] += time.perf_counter() - self._t0


GC = GcCount()


def open_arm(name: str, w: Workload, store: str, spool: str) -> Arm:
    arm = Arm(name, w.init())
    if name == "bare":
        arm.call = bare_call(w)
    if name in PROBED_ARMS:
        extra = {} if FLUSH_S is None else {"flush_interval_s": FLUSH_S}
        arm.run = refrun.start_run(f"probe-cost-{w.name}", "candidate",
                                   hardware=jax.default_backend(), backend="jax", seed=0,
                                   tracking_uri=store, spool_dir=spool,
                                   snapshot_environment=False, run_name=f"{w.name}-{name}",
                                   **extra)
        kw: dict[str, Any] = {} if name in ("probed", *BUFFER_ARMS) else {"monitors": None}
        arm.probe = refrun.jax.instrument(arm.run, step_fns=w.fns, **kw)
        arm.log = name not in ("no-log", *BUFFER_ARMS)
        if name in BUFFER_ARMS:
            _, loss, norms = w.step(w.init(), 0)  # the names a step logs
            names = list(w.metrics((loss,) if norms is None else (loss, norms)))
            arm.buf = arm.probe.metrics_buffer(*names, capacity=1024)
            arm.call = buffered_call(w, arm, only=name == "buffer-only")
    return arm


def run_block(w: Workload, arm: Arm, steps: int, burn_s: float = 0.0,
              window: Callable[[], None] | None = None) -> tuple[float, float]:
    """Seconds per step of one block (ends when the device is done), and the median
    interval between successive steps' returns (every arm takes the same one clock read a
    step, so it costs them alike)."""
    state, probe = arm.state, arm.probe
    t0 = time.perf_counter()
    mid = steps // 2
    taking = None
    marks = [0.0] * steps
    if arm.call is not None:
        w.call[0] = arm.call
    for i in range(steps):
        n = arm.step_no + i
        if window is not None and i == mid:
            taking = threading.Thread(target=window, daemon=True)
            taking.start()
        if probe is None:
            state, loss, norms = w.step(state, n)
            if burn_s:
                burn(burn_s)
        else:
            with probe.step(n):
                state, loss, norms = w.step(state, n)
                if arm.log:
                    if norms is None:
                        probe.log(loss=loss)
                    else:
                        probe.log(loss=loss, grad_norm=norms)
                elif arm.buf is not None:
                    arm.buf = probe.log_buffer(arm.buf)
        marks[i] = time.perf_counter()
    w.call[0] = w.fns[0]
    if probe is not None and FLUSH_AT_END:
        probe.flush()  # the block's own collection, charged to it
    jax.block_until_ready(state)
    dt = (time.perf_counter() - t0) / steps
    arm.state, arm.step_no = state, arm.step_no + steps
    if taking is not None:  # a window that outlasts its block ends before the next block
        taking.join()
    return dt, float(np.median(np.diff(marks))) if steps > 1 else dt


def forced_window() -> tuple[Callable[[], None], ProfilerWindows | None, list[float]]:
    """A profiler window as the chip sampler takes one (its own session source and
    defaults), to run on a thread of its own; the wall seconds of its profiler calls."""
    src = jax_sessions()
    costs: list[float] = []
    if src is None:
        return (lambda: None), None, costs
    w = ProfilerWindows(src, BusySampling(), platform=jax.default_backend())

    def take() -> None:
        taken = w._window()  # (seconds in profiler calls, outcome), None when skipped
        if taken is not None:
            costs.append(taken[0])

    return take, w, costs


# --- diagnostics ---------------------------------------------------------------------------------
def hot_path_us(store: str, spool: str) -> float:
    """Thread CPU per step of an empty probed step that logs one ready scalar."""
    run = refrun.start_run("probe-cost-hot", "candidate", hardware=jax.default_backend(),
                           backend="jax", tracking_uri=store, spool_dir=spool,
                           snapshot_environment=False)
    probe = refrun.jax.instrument(run, monitors=None)
    x = jax.jit(lambda: jnp.float32(1.0))()
    n, reps = 0, []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(5000):
            with probe.step(n):
                probe.log(loss=x)
            n += 1
        reps.append((time.thread_time() - t0) / 5000 * 1e6)
    probe.close()
    run.close()
    return statistics.median(reps)


def read_costs(count: int = 512) -> tuple[float, float, float]:
    """Microseconds per value: ``jax.device_get`` of a list of ``count`` ready scalars, and
    the stacked read grouped value by value, and the collector's column read."""
    f = jax.jit(lambda x: (x * 1.0001, (x * 2).sum()))
    x, vals = jnp.ones(8), []
    for _ in range(count):
        x, loss = f(x)
        vals.append(loss)
    jax.block_until_ready(vals)
    precompile()
    read_arrays(vals[:64])

    def best(fn: Callable[[], Any]) -> float:
        out = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out) / count * 1e6

    def columns() -> None:  # a block of one column, as the probe's collector reads it
        ColumnReader().read({"loss": jax_blocks.Column("loss", values=list(vals))})

    return (best(lambda: jax.device_get(vals)), best(lambda: read_arrays(vals)),
            best(columns))


def psutil_sample_ms() -> float:
    mon = PsutilMonitor.create()
    if mon is None:
        return float("nan")
    mon.sample()
    t0 = time.perf_counter()
    for _ in range(5):
        mon.sample()
    return (time.perf_counter() - t0) / 5 * 1e3


def timeline(w: Workload, arm: Arm, steps: int) -> dict[str, Any]:
    """Per step: dispatch entry and exit, and when its loss was ready (a watcher thread
    waits on each in order), seconds from the block's start; and one profiler window's
    programs over the block's middle (device milliseconds per program)."""
    import queue

    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    ready: list[float] = []
    t0 = time.perf_counter()

    def watch() -> None:
        while (a := q.get()) is not None:
            a.block_until_ready()
            ready.append(time.perf_counter() - t0)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    src = jax_sessions()
    lock = getattr(getattr(src, "state", None), "lock", None)
    session = None
    device: list[dict[str, Any]] = []
    win0 = 0
    entries, exits = [], []
    state, probe = arm.state, arm.probe
    for i in range(steps):
        n = arm.step_no + i
        if src is not None and i == steps // 4:
            if lock is not None:  # as the chip sampler's windows: one session at a time
                lock.acquire()
            session = src.open()
            win0 = time.time_ns()
        entries.append(time.perf_counter() - t0)
        if probe is None:
            state, loss, _ = w.step(state, n)
        else:
            with probe.step(n):
                state, loss, _ = w.step(state, n)
                probe.log(loss=loss)
        exits.append(time.perf_counter() - t0)
        q.put(loss)
        if session is not None and i == 3 * steps // 4:
            win1 = time.time_ns()
            try:
                xs = session.stop()
            finally:
                session = None
                if lock is not None:
                    lock.release()
            from refrun.probes.xspace import busy_fraction, read_timeline
            tl = read_timeline(xs)
            device = [{"plane": d.plane, "programs": len(d.modules or ()),
                       "busy": busy_fraction(d.modules, (win0, win1)) if d.modules else None,
                       "ms_per_program": (sum(e - s for s, e in d.modules) / len(d.modules)
                                          / 1e6 if d.modules else None)}
                      for d in tl.devices]
    q.put(None)
    th.join()
    jax.block_until_ready(state)
    arm.state, arm.step_no = state, arm.step_no + steps
    e, r = np.array(entries), np.array(ready)
    depth = [int((e <= t).sum() - (r <= t).sum()) for t in e]
    half = steps // 2
    return {"entry": entries, "exit": exits, "ready": ready,
            "max_in_flight": max(depth),
            "entry_interval_ms_median_2nd_half": float(np.median(np.diff(e[half:])) * 1e3),
            "ready_interval_ms_median_2nd_half": float(np.median(np.diff(r[half:])) * 1e3),
            "device": device}


def known_load(seconds: float = 3.0) -> dict[str, Any]:
    """The chip sampler's windows over a known load, against a figure computed without the
    profiler: bf16 matmuls back to back (expected ~100 % busy) and the same with
    ``block_until_ready`` and a 2 ms sleep after each (expected: one matmul's time, timed
    back to back by the wall clock, over the mean wall time of such a step)."""
    n = 4096 if jax.default_backend() == "tpu" else 512
    mm = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), jnp.bfloat16)
    b = jnp.ones((n, n), jnp.bfloat16)
    mm(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(50):
        c = mm(a, b)
    c.block_until_ready()
    t_mm = (time.perf_counter() - t0) / 50
    out: dict[str, Any] = {"matmul": f"bf16 {n}x{n} @ {n}x{n}",
                           "matmul_ms_back_to_back": t_mm * 1e3}
    src = jax_sessions()
    for kind in ("dense", "sparse"):
        steps = [0]
        w = ProfilerWindows(src, BusySampling(min_period_s=0.5), platform=jax.default_backend(),
                            progress=lambda s=steps: (s[0], 0)) if src else None
        if w is not None:
            w.start()
        t0, end = time.perf_counter(), time.monotonic() + seconds
        while time.monotonic() < end:
            c = mm(a, b)
            if kind == "sparse":
                c.block_until_ready()
                time.sleep(0.002)
            steps[0] += 1
        c.block_until_ready()
        step_s = (time.perf_counter() - t0) / steps[0]
        if w is not None:
            w.close()
        got = [r.busy_pct for r in (w.take() if w is not None else [])]
        out[kind] = {"steps": steps[0], "step_ms": step_s * 1e3,
                     "expected_busy_pct": 100.0 if kind == "dense" else 100 * t_mm / step_s,
                     "windows": got, "why_not": None if got else (w.why_not if w else "no "
                                                                  "profiler")}
    return out


# --- the benchmark -------------------------------------------------------------------------------
def bench(w: Workload, args: argparse.Namespace, store: str, spool: str
          ) -> dict[str, Any]:
    t_start = time.perf_counter()
    chosen = arms_of(args)
    arms = {name: open_arm(name, w, store, spool) for name in chosen}  # probes first: each
    # clears JAX's caches once; then everything compiles once
    for arm in arms.values():
        run_block(w, arm, args.warmup)
    plain_step = statistics.median(run_block(w, arms["plain"], args.steps)[0]
                                   for _ in range(3))
    burn_s = args.burn * plain_step
    take_window, windows, window_costs = forced_window()
    GC.by_arm = {}
    rng = random.Random(args.seed)
    orders = []
    own0 = refrun_threads_cpu()
    main_cpu: dict[str, float] = dict.fromkeys(chosen, 0.0)
    for _ in range(args.rounds):
        order = list(chosen)
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            arm = arms[name]
            c0 = time.thread_time()
            GC.arm = name
            mean, median = run_block(w, arm, args.steps,
                                     burn_s=burn_s if name == "burn" else 0.0,
                                     window=take_window if name == "window" else None)
            GC.arm = None
            main_cpu[name] += time.thread_time() - c0
            arm.blocks.append(mean)
            arm.medians.append(median)
    own_cpu = refrun_threads_cpu() - own0
    probed_steps = args.rounds * args.steps * sum(1 for n in chosen if n in PROBED_ARMS)
    tl = {}
    if args.timeline:
        tl = {name: timeline(w, arms[name], args.steps) for name in ("plain", "probed")}
    source = None
    for name in (n for n in PROBED_ARMS if n in arms):
        arm = arms[name]
        arm.probe.close()
        arm.run.close()
        if source is None:  # the tag the first monitored arm recorded, as its monitor
            source = next((m.tags()[schema.TAG_UTILIZATION_SOURCE] for m in arm.probe.monitors
                           if m.name == "chip_busy"), None)  # wrote it ("probed" first)
    plain = arms["plain"].blocks
    out: dict[str, Any] = {
        "workload": w.name, "what": w.what, "steps": args.steps, "rounds": args.rounds,
        "seconds": time.perf_counter() - t_start, "orders": orders,
        "blocks": {name: arm.blocks for name, arm in arms.items()},
        "plain_step_ms": statistics.median(plain) * 1e3,
        "burn_fraction": args.burn, "chip_busy_source": source,
        "flush_interval_s": FLUSH_S,
        "window_cost_s": window_costs,
        "ratios": {name: {"geometric": geometric_ratio(arms[name].blocks, plain),
                          "hodges_lehmann": hodges_lehmann(arms[name].blocks, plain)}
                   for name in chosen if name != "plain"},
        # The same pairs on each block's median step interval (added 2026-12-06 after the
        # ports' blocks of 0.2-0.4 s varied by up to 2x in every arm, the plain one too):
        # the probe's cost in every step, its occasional costs (a profiler window, a psutil
        # sample) left to the window arm and the figures printed below the table.
        "medians": {name: arm.medians for name, arm in arms.items()},
        "median_ratios": {name: geometric_ratio(arms[name].medians, arms["plain"].medians)
                          for name in chosen if name != "plain"},
        # CPU a probed step costs on Python threads (added 2026-12-06, fourth session): in
        # a host-bound loop every microsecond of Python on refrun's threads is one the
        # training thread waits for the GIL, so this is the probe's cost the ratios try to
        # resolve, read directly.  Under gVisor thread clocks tick in milliseconds: these
        # are averages over all rounds.
        "refrun_threads_us_per_probed_step": 1e6 * own_cpu / max(probed_steps, 1),
        "training_thread_us_per_step": {name: 1e6 * c / (args.rounds * args.steps)
                                        for name, c in main_cpu.items()},
        "flush_at_block_end": FLUSH_AT_END,
        # per arm, generation -> [collections, seconds] per 1,000 steps
        "gc_per_1000_steps": {
            name: {str(g): [c * 1000 / (args.rounds * args.steps),
                            s * 1000 / (args.rounds * args.steps)]
                   for g, (c, s) in sorted(GC.by_arm.get(name, {}).items())}
            for name in chosen},
    }
    if "bare" in arms and "buffer-only" in arms:  # the same rounds' blocks, paired
        out["buffer_only_vs_bare"] = {
            "geometric": geometric_ratio(arms["buffer-only"].blocks, arms["bare"].blocks),
            "median": geometric_ratio(arms["buffer-only"].medians, arms["bare"].medians)}
    if windows is not None:
        out["window_note"] = windows.why_not
    if tl:
        out["timeline"] = tl
    return out


def refrun_threads_cpu() -> float:
    """CPU seconds so far of this process's threads whose names start with ``refrun``
    (collector, session writer, samplers), from their own clocks."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("refrun") and t.ident is not None:
            # a thread that ended meanwhile, or no such clock here: not counted
            with contextlib.suppress(OSError, AttributeError):
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.4f} [{r[1]:.4f}, {r[2]:.4f}]"


def arms_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The arms measured: ``--arms`` (``plain`` always among them), in :data:`ARMS` order.
    Fewer arms make a round shorter, so each arm's block sits closer in time to the plain
    block it is paired with (the ports' blocks drift by up to 2x within seconds)."""
    want = set(args.arms.split(",")) | {"plain"} if args.arms else set(ARMS)
    bad = want - set(ARMS)
    if bad:
        raise SystemExit(f"--arms: unknown {sorted(bad)} (arms: {', '.join(ARMS)})")
    return tuple(a for a in ARMS if a in want)


def print_table(results: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    shown = [a for a in ARMS if a != "plain" and all(a in r["ratios"] for r in results)]
    head = ("workload", "plain step", *[f"{a} / plain" for a in shown])
    rows = [head]
    for r in results:
        rows.append((r["workload"], f"{r['plain_step_ms']:.3f} ms",
                     *[fmt(r["ratios"][a]["geometric"]) for a in shown]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)))
    print("\n(geometric mean of paired block ratios [95 % t-interval]; Hodges-Lehmann in "
          "the JSON)")
    if all("median_ratios" in r for r in results):
        rows = [head]
        for r in results:
            rows.append((r["workload"], f"{statistics.median(r['medians']['plain']) * 1e3:.3f} ms",
                         *[fmt(r["median_ratios"][a]) for a in shown]))
        print()
        for row in rows:
            print("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)))
        print("\n(the same pairs on each block's median step interval: the cost in every "
              "step, a block's stalls left out)")
    for r in results:
        hl = r["ratios"].get("probed", {}).get("hodges_lehmann", (math.nan,) * 3)
        costs = r["window_cost_s"]
        win = (f"; one profiler window: {statistics.median(costs) * 1e3:.1f} ms in profiler "
               f"calls" if costs else f"; no window ({r.get('window_note')})")
        print(f"{r['workload']}: {r['what']}; {r['rounds']} rounds x {r['steps']} steps "
              f"(flush interval {r.get('flush_interval_s') or 'default'}), "
              f"{r['seconds']:.0f} s; probed Hodges-Lehmann {fmt(hl)}; burn = "
              f"{r['burn_fraction']:.0%} of the plain step{win}")
        print(f"  chip utilisation source of the first monitored arm: {r['chip_busy_source']}")
        vb = r.get("buffer_only_vs_bare")
        if vb:
            print(f"  buffer-only / bare (neither step returns its scalars): "
                  f"{fmt(vb['geometric'])} by block mean, {fmt(vb['median'])} by median step")
        tt = r.get("training_thread_us_per_step")
        if tt:
            per = ", ".join(f"{a} {v:.1f}" for a, v in tt.items())
            print(f"  CPU a step, us: refrun's threads {r['refrun_threads_us_per_probed_step']:.1f}"
                  f" per probed step; the training thread: {per}")
        gcs = r.get("gc_per_1000_steps")
        if gcs:
            per = "; ".join(f"{a} " + (", ".join(f"gen{g} {c:.1f} ({1e3 * t:.2f} ms)"
                                               for g, (c, t) in v.items()) or "none")
                            for a, v in gcs.items())
            print(f"  Python garbage collections per 1,000 steps: {per}")
        t = r.get("timeline")
        if t:
            for arm, d in t.items():
                dev = "; ".join(f"{x['plane']}: {x['programs']} programs, "
                                f"{(x['ms_per_program'] or 0):.3f} ms each, busy "
                                f"{(x['busy'] or 0):.1%}" for x in d["device"]) or "no device"
                print(f"  timeline {arm}: at most {d['max_in_flight']} steps in flight; "
                      f"2nd half medians: entry interval "
                      f"{d['entry_interval_ms_median_2nd_half']:.3f} ms, ready interval "
                      f"{d['ready_interval_ms_median_2nd_half']:.3f} ms; {dev}")
    for k, v in extra.items():
        print(f"{k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=350, help="steps per block")
    ap.add_argument("--warmup", type=int, default=30, help="steps per arm before the rounds")
    ap.add_argument("--quick", action="store_true", help="4 rounds of 100 steps")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated (default: gru,gru-small,digits,charlm,markov; on "
                         "the CPU gru-small is gru)")
    ap.add_argument("--gru-size", default=None, help="V,E,H,T,B of the gru workload")
    ap.add_argument("--burn", type=float, default=0.01,
                    help="the positive control's thread CPU per step, share of the plain step")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block orders")
    ap.add_argument("--arms", default=None,
                    help=f"comma-separated subset of {','.join(ARMS)} (plain always; "
                         "default: all)")
    ap.add_argument("--flush-interval", type=float, default=None, metavar="S",
                    help="the probed runs' flush interval (default refrun's, 1 s); keep it "
                         "a tenth of a block so that the collector's work for a block lands "
                         "in that block")
    ap.add_argument("--flush-at-block-end", action="store_true",
                    help="end each probed block with probe.flush() inside its timing: the "
                         "block mean then carries all of its collector's work (read the "
                         "block-mean table)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="arrays the probe stacks per read (default: refrun's CHUNK); a "
                         "diagnostic: how the read's fixed cost per chunk weighs on the step")
    ap.add_argument("--json", default=None,
                    help="write the results here (default: $OUT/probe_cost.json or "
                         "./probe_cost.json)")
    ap.add_argument("--timeline", action="store_true",
                    help="also record per-step entry/exit/ready times (back-pressure)")
    ap.add_argument("--store", default=None, help="tracking URI (default: a temporary sqlite)")
    ap.add_argument("--known-load", action="store_true",
                    help="also check the chip sampler against bf16 matmuls, dense and with "
                         "2 ms sleeps (3 s each)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 4, 100, 10
    if args.chunk is not None:  # before any probe starts: its precompile uses it
        jax_blocks.CHUNK = args.chunk
    global FLUSH_S, FLUSH_AT_END
    FLUSH_S = args.flush_interval
    FLUSH_AT_END = args.flush_at_block_end
    gc.callbacks.append(GC)
    names = (args.workloads.split(",") if args.workloads else
             ["gru", "gru-small", "digits", "charlm", "markov"] if jax.default_backend() != "cpu"
             else ["gru", "digits", "charlm", "markov"])
    gru_size = tuple(int(v) for v in args.gru_size.split(",")) if args.gru_size else None
    tmp = tempfile.mkdtemp(prefix="refrun-probe-cost-")
    store = args.store or f"sqlite:///{tmp}/mlflow.db"
    spool = f"{tmp}/spool"
    dev = jax.devices()[0]
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({dev.device_kind}), "
          f"{len(jax.devices())} device(s); Python {platform.python_version()}; "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}", flush=True)
    extra = {"probe's own thread CPU per step (empty step, one logged scalar)":
             f"{hot_path_us(store, spool):.2f} us"}
    dg, st, col = read_costs()
    extra["reading logged scalars, per value: jax.device_get(list) / read_arrays / the "
          "collector's column read"] = f"{dg:.2f} us / {st:.2f} us / {col:.2f} us"
    extra["one psutil sample (sampler thread, once a second)"] = f"{psutil_sample_ms():.2f} ms"
    if args.known_load:
        extra["known load (chip sampler's windows vs a wall-clock expectation)"] = \
            json.dumps(known_load())
    path = Path(args.json or Path(os.environ.get("OUT", ".")) / "probe_cost.json")

    def write(results: list[dict[str, Any]]) -> None:
        path.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "platform": jax.default_backend(), "device_kind": dev.device_kind,
            "jax": jax.__version__, "load": os.getloadavg()[0], "args": vars(args),
            "extra": extra, "results": results}, indent=1, default=str))

    results: list[dict[str, Any]] = []
    for name in names:
        w = make_workload(name, gru_size)
        print(f"[{name}] {w.what}", flush=True)
        results.append(bench(w, args, store, spool))
        # Each workload's row as soon as it is measured, and the JSON rewritten: a command
        # stopped at the device's time limit keeps what it finished (a first all-workload
        # run on the TPU printed nothing in 570 s).
        print_table(results[-1:], {})
        write(results)
    print()
    print_table(results, extra)
    write(results)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
