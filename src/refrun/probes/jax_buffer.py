"""A step's scalars written on the device, read by the probe once per buffer: the JAX
probe's recording for steps so short that reading each logged scalar from the host shows.

Measured on a TPU v5e (2026-12-06, docs/tpu.md "sixth session"): logging a step's loss and
gradient norms with ``probe.log`` costs the pipelines' ~1 ms host-bound ports 3-10 % of
their throughput, all of it in the values' path (the same probe with ``probe.step`` alone:
1.005): every logged scalar is a device array the probe keeps until its collector reads
it (a stacked read per 64, a garbage-collector object a value) and a spool line.  A
:class:`MetricsBuffer` moves that to the device: the jitted step writes its scalars into
one row of a ``[capacity + 1, k]`` array it takes and returns (an in-place update when the
buffer is donated), and the probe hands a full buffer to its collector, which reads it in
one transfer.  The training thread's work per step is one more argument and output of the
step and one host call, :meth:`refrun.probes.jax.JaxProbe.log_buffer`, that counts.

::

    buf = probe.metrics_buffer("loss", "grad_norm", capacity=1024)

    @functools.partial(jax.jit, donate_argnames=("state", "buf"))
    def train_step(state, batch, buf):
        ...
        return state, buf.record(loss=loss, grad_norm=gnorm)

    for n, batch in enumerate(batches):
        with probe.step(n):
            state, buf = train_step(state, batch, buf)
            buf = probe.log_buffer(buf)

The values are recorded as the buffer's dtype (float32, float64 where ``jax_enable_x64``
is on, or ``dtype=``; a float32 or bfloat16 value is kept exactly in either).  Row ``i``
of a buffer is the ``i``-th call of ``record`` since the buffer was made; its step is the
probe's step at the ``i``-th ``log_buffer`` call.  The number of rows written is kept on
the device too, and a buffer whose count differs from the host's (``record`` called twice
in a step, or not at all) is refused with a warning rather than recorded at the wrong
steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Float dtypes a buffer keeps its row count in exactly (up to 2**24 rows: the capacity's
# limit); bfloat16 and float16 would lose the count past 256 and 2048.
BUFFER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
MAX_CAPACITY = 2**24 - 1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MetricsBuffer:
    """One device array ``data`` of ``capacity + 1`` rows: ``data[i, j]`` is metric
    ``names[j]`` at the ``i``-th :meth:`record` since the buffer was made, and the last
    row's first element counts the rows written (``names`` is static: part of the
    compiled step's signature).  One array, not rows and a count apart: on a TPU host every
    argument and output of a dispatched step costs the training thread its own host work
    (docs/tpu.md, seventh session)."""

    data: jax.Array
    names: tuple[str, ...] = field(metadata={"static": True})

    @property
    def capacity(self) -> int:
        return int(self.data.shape[0]) - 1

    def record(self, **metrics: Any) -> MetricsBuffer:
        """This buffer with ``metrics`` (one scalar each, every name of :attr:`names`)
        written as row ``count``, inside the jitted step (traced: no host work, no
        transfer).  A full buffer keeps its rows and counts on, so that the probe sees
        the overflow and refuses the buffer instead of recording wrong steps."""
        missing = set(self.names) - set(metrics)
        extra = set(metrics) - set(self.names)
        if missing or extra:
            raise ValueError(f"MetricsBuffer.record: names {sorted(metrics)} differ from the "
                             f"buffer's {list(self.names)}")
        data, cap = self.data, self.data.shape[0] - 1
        row = jnp.stack([jnp.asarray(metrics[n]).reshape(()).astype(data.dtype)
                         for n in self.names])
        count = data[cap, 0]
        # a full buffer writes its overflow into the count's row, which the count then
        # overwrites: its rows stay, and the count keeps moving (refused when read)
        at = jnp.minimum(count, cap).astype(jnp.int32)
        data = jax.lax.dynamic_update_slice(data, row[None, :], (at, jnp.int32(0)))
        return MetricsBuffer(data.at[cap, 0].set(count + 1), self.names)


def empty_buffer(names: tuple[str, ...], capacity: int, dtype: Any = jnp.float32,
                 like: MetricsBuffer | None = None, sharding: Any = None) -> MetricsBuffer:
    """A buffer with no rows: placed like ``like`` (a fresh buffer for the same compiled
    step has the signature of the one the step returned -- sharding and whether it is
    committed to its devices -- so the step is not compiled again), or with ``sharding``
    (committed), or on the default device, uncommitted (as ``jnp.zeros`` makes it)."""
    data = np.zeros((capacity + 1, len(names)), dtype=np.dtype(dtype))
    if like is not None:
        sharding = like.data.sharding if like.data.committed else None
    if sharding is None:
        return MetricsBuffer(jax.device_put(data), names)
    return MetricsBuffer(jax.device_put(data, sharding), names)


def same_placement(a: MetricsBuffer, b: MetricsBuffer) -> bool:
    """Whether ``a`` can replace ``b`` as the step's argument without a recompilation:
    the same names, shape and dtype, and the same sharding and commitment."""
    da, db = a.data, b.data
    return (a.names == b.names and da.shape == db.shape and da.dtype == db.dtype
            and da.committed == db.committed and da.sharding == db.sharding)


@dataclass(frozen=True)
class FullBuffer:
    """A buffer handed to the collector: its device arrays and the steps of its rows."""

    buffer: MetricsBuffer
    steps: list[int]


@dataclass(frozen=True)
class BufferColumns:
    """What a read buffer records: ``columns[name]`` at ``steps``; ``refused`` says why
    nothing is recorded (its count differs from the steps the probe saw)."""

    steps: list[int]
    columns: dict[str, list[float]]
    refused: str | None = None


def read_buffer(full: FullBuffer) -> BufferColumns:
    """One transfer (the rows and their count); the rows written, as columns."""
    data = np.asarray(jax.device_get(full.buffer.data))
    rows, count = data[:-1], int(data[-1, 0])
    k = len(full.steps)
    if count != k or k > len(rows):
        why = (f"more steps than its {len(rows)} rows" if k > len(rows) else
               "record() was called more often than log_buffer()" if count > k else
               "log_buffer() was called on steps whose step function did not record()")
        return BufferColumns([], {}, f"a metrics buffer held {count} rows for {k} steps "
                                     f"({why}); its values were not recorded")
    values = np.asarray(rows[:k], dtype=np.float64)
    return BufferColumns(list(full.steps),
                         {n: values[:, j].tolist() for j, n in enumerate(full.buffer.names)})
