"""The pipelines' JAX steps recording their scalars through a refrun metrics buffer.

A port's jitted step returns ``(*state, loss, norms)``; :func:`buffered_step` compiles it
once more as ``(buf, *args) -> (*state, buf)``: the loss and the gradient norms are written
into the buffer inside the step and are no outputs of their own (on a TPU host every
output of a dispatched step costs the dispatching thread its own work; docs/tpu.md,
"seventh session"), and the loop hands the buffer to ``probe.log_buffer`` each step
(docs/jax.md, "Millisecond steps: metrics buffers").  The metric names are the ones
``probe.log(loss=loss, grad_norm=norms)`` gives: ``loss``, ``grad_norm/<group>``.

A loop that logs every ``log_every`` > 1 steps, or reads the loss on the host (the
``float_loss`` defect), keeps ``probe.log``: a buffer records every step it is passed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

import refrun.jax


def scalars(out: tuple[Any, ...]) -> dict[str, Any]:
    """A port step's last two outputs by the names ``probe.log(loss=..., grad_norm=...)``
    gives them."""
    return refrun.jax.flatten_pytree({"loss": out[-2], "grad_norm": out[-1]})


def metric_names(step: Callable[..., Any], *args: Any) -> tuple[str, ...]:
    """:func:`scalars`' names, from the step's output shapes alone (``jax.eval_shape``:
    nothing runs)."""
    return tuple(scalars(jax.eval_shape(step, *args)))


def buffered_step(step: Callable[..., Any], donate: Sequence[int]) -> Callable[..., Any]:
    """``step`` (``(*args) -> (*state, loss, norms)``) as a jitted
    ``(buf, *args) -> (*state, buf)`` whose buffer holds the loss and the norms; the
    buffer is donated with ``step``'s own donated arguments (``donate``: their indices
    among ``args``)."""
    def with_buffer(buf: Any, *args: Any) -> tuple[Any, ...]:
        out = step(*args)
        return (*out[:-2], buf.record(**scalars(out)))

    return jax.jit(with_buffer, donate_argnums=(0, *(i + 1 for i in donate)))
