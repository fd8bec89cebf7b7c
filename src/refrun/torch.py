"""Record a PyTorch training run (CPU or CUDA, eager or ``torch.compile``) with refrun.

::

    import refrun, refrun.torch

    with refrun.start_run(workload="mlp", role="reference", hardware="a100") as run:
        probe = refrun.torch.instrument(run, model=model, optimizer=opt)
        for n, (x, y) in enumerate(loader):
            with probe.step(n):
                loss = loss_fn(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
                probe.log(loss=loss)        # a device tensor: no .item(), no sync
        probe.log_eval(n, accuracy=acc)
        probe.close()

See ``docs/torch.md``; the work is done by :mod:`refrun.probes.torch`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import refrun
from refrun.errors import RefrunInputError
from refrun.probes.base import (
    DEFAULT_RECHECK_EVERY,
    DEFAULT_SAMPLE_INTERVAL_S,
    DEFAULT_WARMUP_STEPS,
    Monitor,
    Probe,
)
from refrun.probes.hardware import declared_hardware
from refrun.probes.job import warn_if_not_a_job
from refrun.probes.monitors import resolve_monitors
from refrun.probes.torch import TorchBackend, model_device, normalise_expected

if TYPE_CHECKING:
    from refrun import RunSession

__all__ = ["instrument"]


def instrument(
    run: RunSession,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    expect_device: str | None = None,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    monitors: Sequence[Monitor] | str | None = "auto",
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
    recheck_every: int = DEFAULT_RECHECK_EVERY,
    count_cuda_syncs: bool = True,
) -> Probe:
    """A :class:`~refrun.probes.base.Probe` recording ``run`` through the PyTorch backend.

    ``expect_device``: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or ``"accelerator"`` (any
    non-CPU device); default: ``"accelerator"`` when the run declares non-CPU hardware.
    Parameters, optimizer state or logged values elsewhere produce the placement warning.
    ``monitors``: ``"auto"`` (psutil, and NVML where available), None, or a list.
    ``sample_interval_s``: seconds between utilisation samples.
    ``recheck_every``: steps between placement re-checks (also checked at start and close).
    ``warmup_steps``: step times excluded from the median/p90 summary tags.
    ``count_cuda_syncs``: with the model on CUDA, count the synchronizing CUDA calls of
    each step (``torch.cuda.set_sync_debug_mode("warn")`` inside the step) as
    ``xfer/host_syncs``; nothing is counted on the CPU (tag ``refrun.torch.cuda_syncs``).

    Raises :class:`RefrunInputError` for arguments of the wrong kind.
    """
    _validate(run, model, optimizer, warmup_steps, sample_interval_s, recheck_every)
    declared = declared_hardware(run)
    try:
        expected = normalise_expected(expect_device, declared)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise RefrunInputError(f"expect_device: {expect_device!r} is not a device ({exc})")\
            from None
    device = model_device(model, optimizer)
    backend = TorchBackend(model=model, optimizer=optimizer, expected=expected, device=device,
                           count_cuda_syncs=bool(count_cuda_syncs))
    mons = resolve_monitors(monitors, gpu_indices=_nvml_indices(device))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        warn_if_not_a_job(run, torch.distributed.get_world_size(),
                          "torch.distributed.get_world_size()")
    return Probe(run, backend, warmup_steps=warmup_steps, monitors=mons,
                 sample_interval_s=sample_interval_s, recheck_every=recheck_every)


def _validate(run: Any, model: Any, optimizer: Any, warmup_steps: Any,
              sample_interval_s: Any, recheck_every: Any) -> None:
    if not isinstance(run, refrun.RunSession):
        raise RefrunInputError(f"run: expected the RunSession of refrun.start_run, got "
                               f"{type(run).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise RefrunInputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise RefrunInputError(f"optimizer: expected a torch.optim.Optimizer, got "
                               f"{type(optimizer).__name__}")
    for name, val in (("warmup_steps", warmup_steps), ("recheck_every", recheck_every)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise RefrunInputError(f"{name}: expected an integer >= 0, got {val!r}")
    if not isinstance(sample_interval_s, int | float) or not sample_interval_s > 0:
        raise RefrunInputError(f"sample_interval_s: expected seconds > 0, got "
                               f"{sample_interval_s!r}")


def _nvml_indices(device: torch.device) -> list[int] | None:
    """NVML index of the GPU the model is on (NVML ignores CUDA_VISIBLE_DEVICES, so map
    through it); None (all GPUs) when the model is not on CUDA or the mapping is unknown."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [idx]
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if idx < len(ids) and ids[idx].isdigit():
        return [int(ids[idx])]
    return None  # UUIDs or MIG ids: sample every GPU rather than guess
