"""Instrumented JAX training: ``probe = refrun.jax.instrument(run, ...)``.

::

    probe = refrun.jax.instrument(run, params=params, batch=batch, step_fns=[train_step])
    for n, batch in enumerate(batches):
        with probe.step(n):
            params, loss = train_step(params, batch)
            probe.log(loss=loss)              # jax array, number, or pytree of scalars
    probe.close()

What is recorded and how is described in :mod:`refrun.probes.jax` and docs/jax.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from refrun.errors import RefrunInputError
from refrun.probes.base import (
    DEFAULT_RECHECK_EVERY,
    DEFAULT_SAMPLE_INTERVAL_S,
    DEFAULT_WARMUP_STEPS,
    Monitor,
    Probe,
)
from refrun.probes.hardware import declared_hardware
from refrun.probes.jax import TRANSFER_LEVELS, JaxBackend, JaxMemoryMonitor, LostValue
from refrun.probes.job import warn_if_not_a_job
from refrun.probes.monitors import resolve_monitors

if TYPE_CHECKING:
    from refrun import RunSession


@dataclass
class JaxProbe(Probe):
    """A :class:`Probe` whose ``log`` also accepts pytrees (tuples, lists, dataclasses
    registered with JAX ...) and which can record placement again with :meth:`observe`."""

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record scalars for ``step`` (default: the current step).  Values may be jax
        arrays of one element, numbers, or pytrees of them; a pytree leaf is named by its
        path (``grads/0/w``)."""
        if all(isinstance(v, jax.Array | float | int) for v in metrics.values()):
            super().log(step, **metrics)  # fast path: nothing to flatten
            return
        try:
            flat = flatten_pytree(metrics)
        except Exception as exc:
            self.run.warn_once("jax-log-flatten", f"probe.log: values not recorded: {exc}",
                               self._step)
            return
        super().log(step, **flat)

    def observe(self, **trees: Any) -> None:
        """Record where ``params=``, ``batch=`` (any pytrees) live; cheap enough for an
        occasional call, not for every step of a large model (it walks the pytree)."""
        backend: JaxBackend = self.backend  # type: ignore[assignment]
        self._guard(lambda: backend.observe(**trees))
        self._describe()  # changed tags; a placement warning also becomes a run warning

    def _emit(self, n: int, name: str, value: float) -> None:
        if isinstance(value, LostValue):
            self.run.warn_once(f"jax-lost:{name}", f"{name} at step {n} could not be read "
                               "(its buffer was deleted or donated before it was ready)", n)
            return
        super()._emit(n, name, value)


def flatten_pytree(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a": (x, {"b": y})}`` -> ``{"a/0": x, "a/1/b": y}``: pytree leaves named by path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(dict(metrics))
    return {"/".join(_key_text(k) for k in path): leaf for path, leaf in leaves}


def _key_text(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k).strip("[].'\"")


def instrument(
    run: RunSession,
    *,
    params: Any = None,
    batch: Any = None,
    step_fns: Iterable[Any] = (),
    transfer_guard: str | None = None,
    hardware: str | None = None,
    mesh: Any = None,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    monitors: Sequence[Monitor] | str | None = "auto",
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
    memory: bool = True,
    fresh_caches: bool = True,
    recheck_every: int = DEFAULT_RECHECK_EVERY,
    count_host_reads: bool = True,
) -> JaxProbe:
    """Wrap a JAX training loop's recording in a :class:`JaxProbe`.

    ``params``/``batch``: pytrees whose devices and shardings are recorded (again with
    ``probe.observe``).  ``step_fns``: the jitted step function(s) (or their names);
    their compilations are ``compile/graphs``, all others ``compile/other``; without
    it, any function user code calls through ``jit``/``pmap`` counts as a step function.
    ``transfer_guard``: ``log`` or ``disallow`` (or the ``*_explicit`` variants) applied
    around each step; ``log`` counts implicit host-to-device transfers (``xfer/h2d``).
    ``hardware``: the intended accelerator (default: the run's ``refrun.hardware`` tag);
    running on the CPU instead sets ``refrun.placement.warning``.  ``mesh``: a
    ``jax.sharding.Mesh`` or ``{axis: size}`` (e.g. the pmap axis) for ``refrun.exec.mesh``;
    otherwise taken from NamedShardings of ``params``/``batch``.  ``monitors``: ``"auto"``
    (psutil, NVML where available: the same ``sys/*`` metrics as every backend), None or a
    list.  ``memory``: with ``"auto"``, also sample ``device.memory_stats()`` where the
    devices report it (not on CPU).  ``recheck_every``: steps between placement re-checks.
    ``fresh_caches``: clear JAX's in-memory compilation caches at start (outside any step)
    so the compilation counts do not depend on what ran earlier in the process; False
    keeps them (counts then start from whatever the process has already compiled).
    ``count_host_reads``: count host reads of ``jax.Array`` values inside the step
    (``float(x)``, ``np.asarray(x)``, printing ...) as ``xfer/host_syncs``, on every
    platform (:mod:`refrun.probes.host_reads`); False records no such counter.

    Raises :class:`RefrunInputError` for an unknown ``transfer_guard`` level or a
    ``step_fns`` entry that is neither a function nor a name.
    """
    if transfer_guard is not None and transfer_guard not in TRANSFER_LEVELS:
        raise RefrunInputError(f"transfer_guard: {transfer_guard!r} is not one of "
                               f"{', '.join(TRANSFER_LEVELS)}")
    fns = list(step_fns)
    for f in fns:
        if not (isinstance(f, str) or getattr(f, "__name__", None)):
            raise RefrunInputError(f"step_fns: {f!r} is neither a function nor a name")
    if hardware is None:
        hardware = declared_hardware(run)
    backend = JaxBackend(step_fns=fns, transfer_guard=transfer_guard, hardware=hardware,
                         mesh=mesh, fresh_caches=fresh_caches,
                         count_host_reads=count_host_reads)
    backend.observe(params=params, batch=batch)
    mons = resolve_monitors(monitors, [JaxMemoryMonitor.available] if memory else [])
    warn_if_not_a_job(run, jax.process_count(), "jax.process_count()")
    return JaxProbe(run=run, backend=backend, warmup_steps=warmup_steps, monitors=mons,
                    sample_interval_s=sample_interval_s, recheck_every=recheck_every)


__all__ = ["JaxProbe", "flatten_pytree", "instrument"]
