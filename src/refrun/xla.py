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

from typing import TYPE_CHECKING, Any

from refrun.probes.base import Probe
from refrun.probes.job import warn_if_not_a_job
from refrun.probes.monitors import resolve_monitors
from refrun.probes.options import ProbeOptions, probe_options, require_session

if TYPE_CHECKING:
    from refrun import RunSession


def instrument(
    run: RunSession,
    *,
    model: Any = None,
    optimizer: Any = None,
    device: Any = None,
    options: ProbeOptions | None = None,
    tpu_monitor: bool = True,
    **keywords: Any,
) -> Probe:
    """A :class:`refrun.probes.base.Probe` recording a PyTorch/XLA training loop into ``run``.

    ``model`` / ``optimizer``: used for device truth and placement only (never modified).
    ``device``: the XLA device (default: the first XLA parameter's, else ``torch_xla.device()``).
    ``options``: the :class:`~refrun.probes.options.ProbeOptions` every probe takes
    (``hardware``, ``warmup_steps``, ``monitors``, ``sample_interval_s``,
    ``recheck_every``), or the same fields as keywords; ``warmup_steps`` also bounds the
    "compilations after warm-up" count of the end-of-run summary.
    ``tpu_monitor``: with ``monitors="auto"``, also sample HBM where a source answers
    and chip utilisation (``sys/tpu<i>_duty_cycle_pct`` from libtpu where it answers,
    else from sampled windows of torch_xla's profiler; the tag ``refrun.exec.utilization_source``
    says which, or why neither: :mod:`refrun.probes.chip_busy`).

    Raises :class:`RefrunInputError` for a ``model`` that is not a ``torch.nn.Module``,
    an ``optimizer`` that is not a ``torch.optim.Optimizer``, or a bad option.
    """
    opts = probe_options(options, keywords, f"{__name__}.instrument")
    require_session(run)
    import torch

    from refrun.probes.chip_busy import ChipBusyMonitor, torch_xla_sessions
    from refrun.probes.torch import check_torch_objects
    from refrun.probes.tpu_monitor import TpuMonitor
    from refrun.probes.xla import XlaBackend

    check_torch_objects(model, optimizer)
    # Values are copied to the host as often as the session's spool writes them: sooner
    # reaches no reader, later delays every reader (see refrun.probes.xla.ARM_INTERVAL_S).
    backend = XlaBackend(model=model, optimizer=optimizer, device=device,
                         declared_hardware=opts.declared(run), warmup_steps=opts.warmup_steps,
                         arm_interval_s=run.config.options.flush_interval_s)
    own = [lambda: TpuMonitor.create(backend.device),
           lambda: ChipBusyMonitor.create(torch_xla_sessions(), _platform(),
                                          opts.warmup_steps)] if tpu_monitor else []
    try:
        all_monitors = resolve_monitors(opts.monitors, own)
        warn_if_not_a_job(run, _process_count(torch), "the XLA runtime's process count")
        return Probe(run, backend, warmup_steps=opts.warmup_steps, monitors=all_monitors,
                     sample_interval_s=opts.sample_interval_s,
                     recheck_every=opts.recheck_every)
    except BaseException:
        backend.close()  # one open backend a process: a failed start leaves none open
        raise


def _platform() -> str:
    """The PJRT device type in lower case (``tpu``, ``cpu``); ``""`` when unknown."""
    try:
        import torch_xla.runtime as xr

        return str(xr.device_type() or "").lower()
    except Exception:
        return ""


def _process_count(torch: Any) -> int:
    # torch.distributed when the job initialised it (the xla backend or gloo), else the
    # PJRT runtime's process count (not world_size(): that counts devices under SPMD, one
    # process driving four chips is not a job of four); 1 when unknown.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    try:
        import torch_xla.runtime as xr

        return int(xr.process_count())
    except Exception:  # an older torch_xla or a runtime that cannot say: no warning
        return 1


__all__ = ["ProbeOptions", "instrument"]
