"""Overhead of refrun.jax.instrument per training step, as a ratio to the unwrapped loop.

A jitted MLP step of a few milliseconds on the CPU runs N steps unwrapped and N steps
wrapped (``probe.step`` + ``probe.log(loss=...)``), alternating rounds in one process;
each round ends with one ``block_until_ready`` so queued device work is counted.  The
table prints the median per-step time of each and their ratio.

The host-read counter (``xfer/host_syncs``, :mod:`refrun.probes.host_reads`) is measured
in the same process: a third loop, wrapped by a probe made with
``count_host_reads=False``, runs in the same interleaved rounds, and the table gives the
ratio counter on / counter off.  Then the cost of one host read (``float(x)`` and
``np.asarray(x)`` of a ready scalar) with the counting hooks installed and a step's count
active, against the same read without hooks: what the counter adds to a read a step makes
(a step that reads nothing runs none of its code).  On a shared machine the step ratios
drift by several percent between rounds, so the table also gives the median of the
per-round ratios (on and off alternate which runs first) and the counter's own cost
measured directly: the backend's per-step calls (``begin_step``, ``end_step``,
``cumulative``) with and without counting, and that difference over the unwrapped step.

Expected before the first run (written with the counter): ratio counter on / off within
the rounds' noise of 1.00 (no read happens in the step, so the counter adds two
thread-local writes and one more per-step metric); a counted ``float(x)`` costs < 1 us
more than an uncounted one, a counted ``np.asarray(x)`` (the buffer-protocol hook, a
ctypes trampoline) < 10 us more.  Run::

    .venv/bin/python benchmarks/bench_jax_probe.py [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import refrun
import refrun.jax
from refrun.probes import host_reads


def make_step(width: int):
    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    @jax.jit
    def train_step(params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree_util.tree_map(lambda p, d: p - 1e-3 * d, params, g), loss

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (width, width)) / width,
              "w2": jax.random.normal(k2, (width, 1)) / width}
    x = jax.random.normal(k3, (256, width))
    y = jnp.ones((256, 1))
    return train_step, params, x, y


def round_unwrapped(step, params, x, y, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        params, loss = step(params, x, y)
    loss.block_until_ready()
    return (time.perf_counter() - t0) / n


def round_wrapped(probe, step, params, x, y, n: int, offset: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        with probe.step(offset + i):
            params, loss = step(params, x, y)
            probe.log(loss=loss)
    loss.block_until_ready()
    return (time.perf_counter() - t0) / n


def read_cost_us(read, x, n: int = 20000) -> float:
    """Median over 5 repeats of the mean time of one ``read(x)``, microseconds."""
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            read(x)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def read_costs() -> list[tuple[str, float, float]]:
    """(read, uncounted us, counted us) for float(x) and np.asarray(x) of a ready scalar."""
    x = (jnp.ones(()) * 2).block_until_ready()
    rows = []
    for name, read in (("float(x)", float), ("np.asarray(x)", np.asarray)):
        plain = read_cost_us(read, x)
        host_reads.install()
        sink = host_reads.ReadCount()
        prev = host_reads.activate(sink)
        try:
            counted = read_cost_us(read, x)
        finally:
            host_reads.activate(prev)
            host_reads.remove()
        assert sink.n > 0, "the reads were not counted"
        rows.append((name, plain, counted))
    return rows


def bookkeeping_us(backend, n: int = 20000) -> float:
    """Median over 5 repeats of one step's backend calls with nothing in the step
    (``begin_step``, ``end_step``, ``cumulative``: what the probe calls per step),
    microseconds."""
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            backend.begin_step(i)
            backend.end_step()
            backend.cumulative()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    step, params, x, y = make_step(args.width)
    step(params, x, y)[1].block_until_ready()  # compile outside the measurement
    with tempfile.TemporaryDirectory() as tmp:
        run = refrun.start_run("bench-jax-probe", "candidate", hardware="cpu", backend="jax",
                               tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                               spool_dir=Path(tmp) / "spool", snapshot_environment=False)
        probe = refrun.jax.instrument(run, params=params, step_fns=[step])
        run_off = refrun.start_run("bench-jax-probe", "candidate", hardware="cpu",
                                   backend="jax", tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                                   spool_dir=Path(tmp) / "spool-off",
                                   snapshot_environment=False)
        probe_off = refrun.jax.instrument(run_off, params=params, step_fns=[step],
                                          count_host_reads=False, fresh_caches=False)
        plain, wrapped, off = [], [], []
        for r in range(args.rounds):
            plain.append(round_unwrapped(step, params, x, y, args.steps))
            # counter on and off alternate which goes first, so drift and the other
            # run's background delivery hit both alike
            order = [(probe, wrapped), (probe_off, off)]
            for pr, out in order if r % 2 == 0 else order[::-1]:
                out.append(round_wrapped(pr, step, params, x, y, args.steps,
                                         r * args.steps))
        book_on, book_off = bookkeeping_us(probe.backend), bookkeeping_us(probe_off.backend)
        probe_off.close()
        run_off.close()
        t0 = time.perf_counter()
        probe.close()
        close_s = time.perf_counter() - t0
        run.close()
    reads = read_costs()
    p, w, o = statistics.median(plain), statistics.median(wrapped), statistics.median(off)
    print(f"{'measure':<34}{'value':>14}")
    print(f"{'step, unwrapped (median ms)':<34}{p * 1e3:>14.3f}")
    print(f"{'step, wrapped (median ms)':<34}{w * 1e3:>14.3f}")
    print(f"{'overhead per step (us)':<34}{(w - p) * 1e6:>14.1f}")
    print(f"{'ratio wrapped / unwrapped':<34}{w / p:>14.4f}")
    print(f"{'step, wrapped, counter off (ms)':<34}{o * 1e3:>14.3f}")
    paired = statistics.median(a / b for a, b in zip(wrapped, off, strict=True))
    print(f"{'ratio counter on / counter off':<34}{w / o:>14.4f}")
    print(f"{'  same, median of per-round ratios':<34}{paired:>14.4f}")
    print(f"{'backend calls per step on/off (us)':<34}{book_on:>6.2f} / {book_off:<6.2f}")
    print(f"{'  counter cost / unwrapped step':<34}{(book_on - book_off) * 1e-6 / p:>14.5%}")
    for name, plain_us, counted_us in reads:
        print(f"{name + ' uncounted / counted (us)':<34}{plain_us:>6.2f} / {counted_us:<6.2f}")
    print(f"{'probe.close() (s)':<34}{close_s:>14.3f}")
    print(f"steps per round {args.steps}, rounds {args.rounds}, width {args.width}, "
          f"jax {jax.__version__}, backend {jax.default_backend()}")


if __name__ == "__main__":
    main()
