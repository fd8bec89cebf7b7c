"""Runs one instrumented JAX scenario in a fresh process and prints a JSON result line.

Used by tests/test_jax_probe.py for what needs a fresh JAX: several CPU devices
(``XLA_FLAGS`` must be set before JAX is imported) and a persistent compilation cache
(configured before the first compilation).  Usage::

    python probe_worker.py SCENARIO TMPDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import refrun
import refrun.jax


@jax.jit
def train_step(w, x, y):
    def loss_fn(w):
        return jnp.mean((x @ w - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss


def data(n: int, rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return rng.normal(size=(rows, 3)).astype(np.float32), rng.normal(size=rows).astype(
        np.float32)


def start(tmp: Path, workload: str) -> refrun.RunSession:
    return refrun.start_run(workload, "candidate", hardware="cpu", backend="jax",
                            tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                            spool_dir=tmp / "spool", snapshot_environment=False)


def mesh_run(tmp: Path) -> dict:
    """Data-parallel step over every device: batch sharded on 'data', params replicated."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    w = jax.device_put(jnp.zeros(3), NamedSharding(mesh, PartitionSpec()))
    x0, y0 = data(0)
    batch = (jax.device_put(x0, batch_sharding), jax.device_put(y0, batch_sharding))
    run = start(tmp, "jax-mesh")
    probe = refrun.jax.instrument(run, params=w, batch=batch, step_fns=[train_step])
    losses = []
    for n in range(4):
        x, y = data(n)
        x, y = jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding)
        with probe.step(n):
            w, loss = train_step(w, x, y)
            probe.log(loss=loss)
        losses.append(float(loss))
    probe.close()
    run.close()
    return {"run_id": run.run_id, "losses": losses, "devices": jax.device_count(),
            "batch_sharding": str(batch[0].sharding)}


def cache_run(tmp: Path) -> dict:
    """Step 0 compiles and fills the persistent cache; in-memory caches are then cleared
    between steps, so step 1 is served from the persistent cache."""
    jax.config.update("jax_compilation_cache_dir", str(tmp / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    w = jnp.zeros(3)
    run = start(tmp, "jax-cache")
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step])
    losses = []
    for n in range(3):
        x, y = (jnp.asarray(a) for a in data(n))
        if n == 1:
            jax.clear_caches()  # outside the step: forget the in-memory executable
        with probe.step(n):
            w, loss = train_step(w, x, y)
            probe.log(loss=loss)
        losses.append(float(loss))
    probe.close()
    run.close()
    files = sorted(p.name for p in (tmp / "jax-cache").iterdir())
    return {"run_id": run.run_id, "losses": losses, "cache_files": files}


def evaluate(w, x):
    """An evaluation helper run eagerly between steps: unary minus and jax.nn.log_softmax
    are JAX's own jitted functions, each compiled on first use in a process."""
    logits = jnp.stack([x @ w, -(x @ w)], axis=-1)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])


def eval_loop(tmp: Path, workload: str, named: bool) -> dict:
    """Six steps of one shape; the eval helper runs between steps 1-2, 3-4 and after 5,
    and an eager ``-loss`` runs inside every step."""
    run = start(tmp, workload)
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step] if named else ())
    evals = []
    for n in range(6):
        x, y = (jnp.asarray(a) for a in data(n))
        with probe.step(n):
            w, loss = train_step(w, x, y)
            probe.log(loss=loss, neg_loss=-loss)
        if n % 2 == 1:
            ev = evaluate(w, x)
            probe.log_eval(n, loss=ev)
            evals.append(float(ev))
    probe.close()
    run.close()
    return {"run_id": run.run_id, "evals": evals}


def eval_between(tmp: Path) -> dict:
    """The same loop twice in one process, with step_fns and by call site: every run must
    record the same compilation counts as the first run of a fresh process."""
    return {"runs": [eval_loop(tmp, f"jax-eval-{i}", named)
                     for i, named in enumerate((True, True, False, False))]}


def transfers(tmp: Path) -> dict:
    """40 steps, each given two NumPy arrays (two implicit host-to-device transfers) under
    ``transfer_guard="log"``: the runtime writes 80 lines; the probe must summarise them."""
    run = start(tmp, "jax-transfers")
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step], transfer_guard="log")
    for n in range(40):
        x, y = data(n)
        with probe.step(n):
            w, loss = train_step(w, x, y)
            probe.log(loss=loss)
    probe.close()
    run.close()
    sys.stderr.write("after-close line\n")
    return {"run_id": run.run_id, "steps": 40, "per_step": 2}


if __name__ == "__main__":
    scenario, tmpdir = sys.argv[1], Path(sys.argv[2])
    result = {"mesh": mesh_run, "cache": cache_run,
              "eval_between": eval_between, "transfers": transfers}[scenario](tmpdir)
    print("RESULT " + json.dumps(result))
