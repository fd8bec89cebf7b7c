"""One process of a 2-process ``jax.distributed`` job on CPU, recorded through the JAX probe.

Used by tests/test_multiprocess_jax.py::

    python distributed_worker.py COORDINATOR_ADDRESS PROCESS_ID NUM_PROCESSES STEPS OUT_DIR

Data parallel over one CPU device per process (gloo collectives): the global batch is the
processes' local batches; the loss is the global mean (the same on every process).  The
run is started with ``rank=jax.process_index(), world_size=jax.process_count()`` and the
job id from ``$REFRUN_JOB_ID``.  Writes the losses it read itself to
``OUT_DIR/losses.rank<k>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> int:
    addr, pid, nproc, steps, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                    int(sys.argv[4]), Path(sys.argv[5]))
    jax.distributed.initialize(coordinator_address=addr, num_processes=nproc, process_id=pid)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import refrun
    import refrun.jax

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())

    @jax.jit
    def train_step(w, x, y):
        def loss_fn(w):
            return jnp.mean((x @ w - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, loss

    rng = np.random.default_rng(100 + jax.process_index())
    w = jax.make_array_from_process_local_data(replicated, np.zeros(3, np.float32))
    local_batch = 4
    losses = []
    with refrun.start_run("jax-dist", "candidate", hardware="cpu", backend="jax", seed=0,
                          chips=jax.process_count(), global_batch=local_batch * nproc,
                          rank=jax.process_index(), world_size=jax.process_count()) as run:
        probe = refrun.jax.instrument(run, params=w, step_fns=[train_step], warmup_steps=1)
        for step in range(steps):
            xl = rng.normal(size=(local_batch, 3)).astype(np.float32)
            yl = (xl @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
            x = jax.make_array_from_process_local_data(rows, xl)
            y = jax.make_array_from_process_local_data(rows, yl)
            with probe.step(step):
                w, loss = train_step(w, x, y)
                probe.log(loss=loss)
            losses.append(float(loss))  # the loop's own number, outside the step
        probe.close()
    (out / f"losses.rank{jax.process_index()}.json").write_text(json.dumps(losses))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
