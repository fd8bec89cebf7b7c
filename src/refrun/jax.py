"""Instrumented JAX training: ``probe = refrun.jax.instrument(run, ...)``.

::

    probe = refrun.jax.instrument(run, params=params, batch=batch, step_fns=[train_step])
    for n, batch in enumerate(batches):
        with probe.step(n):
            params, loss = train_step(params, batch)
            probe.log(loss=loss)              # jax array, number, or pytree of scalars
    probe.close()

Steps of about a millisecond, where reading each logged scalar from the host shows in the
step time: write them into a device-side buffer inside the jitted step instead
(``probe.metrics_buffer`` / ``buf.record(...)`` / ``probe.log_buffer``,
:mod:`refrun.probes.jax_buffer`, docs/jax.md "Millisecond steps").

The learning rate and update count of an optax optimizer: return
``refrun.jax.optimizer_metrics(opt_state)`` from the jitted step and log it
(:func:`refrun.probes.jax.optimizer_metrics`, docs/jax.md).

What is recorded and how is described in :mod:`refrun.probes.jax` (where :class:`JaxProbe`
lives) and docs/jax.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax

from refrun.errors import RefrunInputError
from refrun.probes.chip_busy import BusySampling, ChipBusyMonitor, jax_sessions
from refrun.probes.jax import (
    TRANSFER_LEVELS,
    JaxBackend,
    JaxMemoryMonitor,
    JaxProbe,
    flatten_pytree,
    optimizer_metrics,
)
from refrun.probes.jax_buffer import MetricsBuffer
from refrun.probes.job import warn_if_not_a_job
from refrun.probes.monitors import resolve_monitors
from refrun.probes.options import ProbeOptions, probe_options, require_session

if TYPE_CHECKING:
    from refrun import RunSession


def instrument(
    run: RunSession,
    *,
    params: Any = None,
    batch: Any = None,
    step_fns: Iterable[Any] = (),
    transfer_guard: str | None = None,
    mesh: Any = None,
    options: ProbeOptions | None = None,
    memory: bool = True,
    fresh_caches: bool = True,
    count_host_reads: bool = True,
    chip_busy: BusySampling | bool = True,
    **keywords: Any,
) -> JaxProbe:
    """Wrap a JAX training loop's recording in a :class:`JaxProbe`.

    ``params``/``batch``: pytrees whose devices and shardings are recorded (again with
    ``probe.observe``).  ``step_fns``: the jitted step function(s) (or their names);
    their compilations are ``compile/graphs``, all others ``compile/other``; without
    it, any function user code calls through ``jit``/``pmap`` counts as a step function.
    ``transfer_guard``: ``log`` or ``disallow`` (or the ``*_explicit`` variants) applied
    around each step; ``log`` counts implicit host-to-device transfers (``xfer/h2d``).
    ``options``: the :class:`~refrun.probes.options.ProbeOptions` every probe takes
    (``hardware``: running on the CPU when it names an accelerator sets
    ``refrun.placement.warning``; ``warmup_steps``, ``monitors``, ``sample_interval_s``,
    ``recheck_every``), or the same fields as keywords.  ``mesh``: a
    ``jax.sharding.Mesh`` or ``{axis: size}`` (e.g. the pmap axis) for ``refrun.exec.mesh``;
    otherwise taken from NamedShardings of ``params``/``batch``.
    ``memory``: with ``monitors="auto"``, also sample ``device.memory_stats()`` where the
    devices report it (not on CPU).
    ``fresh_caches``: clear JAX's in-memory compilation caches at start (outside any step)
    so the compilation counts do not depend on what ran earlier in the process; False
    keeps them (counts then start from whatever the process has already compiled).
    ``count_host_reads``: count host reads of ``jax.Array`` values inside the step
    (``float(x)``, ``np.asarray(x)``, printing ...) as ``xfer/host_syncs``, on every
    platform (:mod:`refrun.probes.host_reads`); False records no such counter.
    ``chip_busy``: with ``monitors="auto"``, also record chip utilisation
    (``sys/<platform><i>_duty_cycle_pct``, tag ``refrun.exec.utilization_source``): from libtpu
    where it answers, else from sampled device-only profiler windows
    (:mod:`refrun.probes.chip_busy`); a :class:`~refrun.probes.chip_busy.BusySampling`
    sets their length and period; False: not recorded.

    Raises :class:`RefrunInputError` for an unknown ``transfer_guard`` level, a
    ``step_fns`` entry that is neither a function nor a name, a ``chip_busy`` that is
    neither a bool nor a ``BusySampling``, or a bad option.
    """
    opts = probe_options(options, keywords, f"{__name__}.instrument")
    require_session(run)
    if transfer_guard is not None and transfer_guard not in TRANSFER_LEVELS:
        raise RefrunInputError(f"transfer_guard: {transfer_guard!r} is not one of "
                               f"{', '.join(TRANSFER_LEVELS)}")
    if not isinstance(chip_busy, bool | BusySampling):
        raise RefrunInputError(f"chip_busy: expected True, False or a BusySampling, got "
                               f"{chip_busy!r}")
    fns = list(step_fns)
    for f in fns:
        if not (isinstance(f, str) or getattr(f, "__name__", None)):
            raise RefrunInputError(f"step_fns: {f!r} is neither a function nor a name")
    backend = JaxBackend(step_fns=fns, transfer_guard=transfer_guard,
                         hardware=opts.declared(run),
                         mesh=mesh, fresh_caches=fresh_caches,
                         count_host_reads=count_host_reads)
    backend.observe(params=params, batch=batch)
    own: list[Any] = [JaxMemoryMonitor.available] if memory else []
    if chip_busy is not False:
        sampling = chip_busy if isinstance(chip_busy, BusySampling) else None
        own.append(lambda: ChipBusyMonitor.create(jax_sessions(), jax.default_backend(),
                                                  opts.warmup_steps, sampling))
    mons = resolve_monitors(opts.monitors, own)
    warn_if_not_a_job(run, jax.process_count(), "jax.process_count()")
    return JaxProbe(run=run, backend=backend, warmup_steps=opts.warmup_steps, monitors=mons,
                    sample_interval_s=opts.sample_interval_s, recheck_every=opts.recheck_every)


__all__ = ["BusySampling", "JaxProbe", "MetricsBuffer", "ProbeOptions", "flatten_pytree",
           "instrument", "optimizer_metrics"]
