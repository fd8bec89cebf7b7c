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
from typing import TYPE_CHECKING, Any

import torch

from refrun.probes.base import Probe
from refrun.probes.hardware import declared_hardware
from refrun.probes.job import warn_if_not_a_job
from refrun.probes.monitors import resolve_monitors
from refrun.probes.options import ProbeOptions, probe_options, require_session
from refrun.probes.torch import (
    TorchBackend,
    check_torch_objects,
    device_name,
    model_device,
    normalise_expected,
)

if TYPE_CHECKING:
    from refrun import RunSession

__all__ = ["ProbeOptions", "instrument"]


def instrument(
    run: RunSession,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    options: ProbeOptions | None = None,
    count_cuda_syncs: bool = True,
    **keywords: Any,
) -> Probe:
    """A :class:`~refrun.probes.base.Probe` recording ``run`` through the PyTorch backend.

    ``options``: the :class:`~refrun.probes.options.ProbeOptions` every probe takes
    (``hardware``, ``warmup_steps``, ``monitors``, ``sample_interval_s``,
    ``recheck_every``), or the same fields as keywords.  ``hardware`` here may also be a
    device, ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or ``"accelerator"`` (any non-CPU device;
    ``expect_device=`` is its old name); default: ``"accelerator"`` when the run declares
    non-CPU hardware.  Parameters, optimizer state or logged values elsewhere produce the
    placement warning.
    ``count_cuda_syncs``: with the model on CUDA, count the synchronizing CUDA calls of
    each step (``torch.cuda.set_sync_debug_mode("warn")`` inside the step) as
    ``xfer/host_syncs``; nothing is counted on the CPU (tag ``refrun.torch.cuda_syncs``).

    Raises :class:`RefrunInputError` for arguments of the wrong kind.
    """
    if keywords.get("expect_device") is not None:  # the old name keeps its meaning: a device
        device_name(keywords["expect_device"], "expect_device")
    opts = probe_options(options, keywords, f"{__name__}.instrument")
    require_session(run)
    check_torch_objects(model, optimizer)
    expected = normalise_expected(opts.hardware, declared_hardware(run))
    device = model_device(model, optimizer)
    backend = TorchBackend(model=model, optimizer=optimizer, expected=expected, device=device,
                           count_cuda_syncs=bool(count_cuda_syncs))
    mons = resolve_monitors(opts.monitors, gpu_indices=_nvml_indices(device))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        warn_if_not_a_job(run, torch.distributed.get_world_size(),
                          "torch.distributed.get_world_size()")
    return Probe(run, backend, warmup_steps=opts.warmup_steps, monitors=mons,
                 sample_interval_s=opts.sample_interval_s, recheck_every=opts.recheck_every)


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
