"""Public entry point of the PyTorch/XLA wrapper: ``refrun.xla.instrument(run, ...)``.

::

    import refrun, refrun.xla, torch_xla
    with refrun.start_run("my-workload", "candidate", hardware="tpu-v5e",
                          backend="torch_xla") as run:
        with refrun.xla.instrument(run, model=model, optimizer=opt) as probe:
            for n, (x, y) in enumerate(loader):
                with probe.step(n):
                    loss = loss_fn(model(x), y)
                    loss.backward(); opt.step(); opt.zero_grad()
                    torch_xla.sync()
                    probe.log(loss=loss)      # an XLA tensor: read after the sync, no .item()

Importing this module does not import ``torch_xla``; :func:`instrument` does.  See
:mod:`refrun.probes.xla` for what is recorded and how.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from refrun.errors import RefrunInputError
from refrun.probes.base import (
    DEFAULT_RECHECK_EVERY,
    DEFAULT_SAMPLE_INTERVAL_S,
    DEFAULT_WARMUP_STEPS,
    Monitor,
    Probe,
)
from refrun.probes.hardware import declared_hardware
from refrun.probes.monitors import resolve_monitors

if TYPE_CHECKING:
    from refrun import RunSession


def instrument(
    run: RunSession,
    *,
    model: Any = None,
    optimizer: Any = None,
    device: Any = None,
    hardware: str | None = None,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    tpu_monitor: bool = True,
    monitors: Sequence[Monitor] | str | None = "auto",
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
    recheck_every: int = DEFAULT_RECHECK_EVERY,
) -> Probe:
    """A :class:`refrun.probes.base.Probe` recording a PyTorch/XLA training loop into ``run``.

    ``model`` / ``optimizer``: used for device truth and placement only (never modified).
    ``device``: the XLA device (default: the first XLA parameter's, else ``torch_xla.device()``).
    ``hardware``: the hardware the run is meant to use (default: the run's ``refrun.hardware``
    tag); a run declaring a TPU or GPU that executes on the CPU gets a placement warning.
    ``warmup_steps``: steps excluded from the steady-state statistics and from the
    "compilations after warm-up" count of the end-of-run summary.
    ``tpu_monitor``: with ``monitors="auto"``, also sample TPU duty cycle / HBM where a
    source answers (off elsewhere).
    ``monitors``: ``"auto"`` (psutil, NVML where available, TPU as above: the same
    ``sys/*`` metrics as every backend), None, or a list.
    ``recheck_every``: steps between placement re-checks (0: at start and close only).

    Raises :class:`RefrunInputError` for a ``model`` that is not a ``torch.nn.Module``,
    an ``optimizer`` that is not a ``torch.optim.Optimizer``, or a negative count.
    """
    import torch

    from refrun.probes.tpu_monitor import TpuMonitor
    from refrun.probes.xla import XlaBackend

    if model is not None and not isinstance(model, torch.nn.Module):
        raise RefrunInputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise RefrunInputError("optimizer: expected a torch.optim.Optimizer, got "
                               f"{type(optimizer).__name__}")
    for key, val in (("warmup_steps", warmup_steps), ("recheck_every", recheck_every)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise RefrunInputError(f"{key}: expected an integer >= 0, got {val!r}")
    if not sample_interval_s > 0:
        raise RefrunInputError(f"sample_interval_s: must be > 0, got {sample_interval_s!r}")
    if hardware is None:
        hardware = declared_hardware(run)
    backend = XlaBackend(model=model, optimizer=optimizer, device=device,
                         declared_hardware=hardware, warmup_steps=warmup_steps)
    own = [lambda: TpuMonitor.create(backend.device)] if tpu_monitor else []
    all_monitors = resolve_monitors(monitors, own)
    return Probe(run, backend, warmup_steps=warmup_steps, monitors=all_monitors,
                 sample_interval_s=sample_interval_s, recheck_every=recheck_every)


__all__ = ["instrument"]
