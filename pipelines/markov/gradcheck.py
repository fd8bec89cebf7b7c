"""Parity and update-delta check of a markov port against the PyTorch reference, recorded
for a candidate run (role ``gradcheck``, tag ``refrun.gradcheck.candidate``).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m pipelines.markov.gradcheck --backend jax --devices 4 --seed 7 \\
        --candidate RUN_ID --tracking-uri sqlite:///store.db

With the candidate's seed's named initial weights on both sides
(:func:`pipelines.markov.model.init_params`) and the candidate's own first ``STEPS``
batches, it compares by parameter name (relative L2 error ≤ ``TOL``):

* ``parity/loss`` and ``parity/grads``: the first batch's loss and every parameter's
  gradient, the port's model with the candidate's defects against the reference's;
* ``update_delta``: the parameter updates ``params_K − params_0`` after ``STEPS`` of the
  port's *own* training step (the JAX port's jitted ``shard_map`` step on the candidate's
  ``--devices``; the XLA port's loop body on the XLA device) against the reference's
  (:func:`refrun.gradcheck.update_delta.compare_updates`).

The gradient check sees a changed function (a swapped gate, a summed loss, bfloat16
matmuls); the update delta also sees what the step does after the gradient — the
clipping and the averaging across devices, so gradients clipped on each device before
averaging differ from the reference whenever a device's local gradient norm exceeds the
clip in those steps (seed bands cannot see that at this workload's scale: docs/acceptance.md,
"Why markov's per-device clip is still accepted").  A benign port agrees to float32
rounding.  The port code is the port's own (``train_jax.make_loss`` and ``make_train_step``;
``train_torch``'s model, ``loss_of`` and ``adam_update``), never a copy.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines import gradcheck_cli
from pipelines.markov.cli import PORT_DEFECTS
from pipelines.markov.config import Config, load_config
from pipelines.markov.data import batch_indices, load
from pipelines.markov.model import init_params

TOL = 1e-4    # relative L2 error; float32 ports agree to ~1e-6, a changed computation >> 1e-3
STEPS = 5     # optimizer steps of the update-delta check: the run's first five batches

Batches = list[tuple[np.ndarray, np.ndarray]]


def first_batches(cfg: Config, seed: int, steps: int = STEPS) -> Batches:
    """The candidate's first ``steps`` training batches ``(x, y)``, as its run saw them."""
    data = load(cfg.data_seed, cfg.classes, cfg.symbols, cfg.length, cfg.mix,
                cfg.concentration, cfg.n_train, cfg.n_val)
    return [(data.train.x[i], data.train.y[i])
            for i in batch_indices(seed, steps, cfg.batch, cfg.n_train)]


def torch_side(cfg: Config, seed: int, defects: frozenset[str], batches: Batches,
               device: Any = None) -> dict[str, Any]:
    """First-batch loss and gradients, then the parameters after ``len(batches)`` steps of
    the reference's loop body (the XLA port's with ``device`` an XLA device)."""
    import torch

    from pipelines.markov.train_torch import adam_update, build_model, loss_of, schedule

    model = build_model(cfg, seed, defects)
    if device is not None:
        model = model.to(device)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    out: dict[str, Any] = {}
    for step, (xb, yb) in enumerate(batches):
        x, y = torch.from_numpy(xb).long(), torch.from_numpy(yb).long()
        sched = torch.from_numpy(schedule(cfg, step))
        if device is not None:
            x, y, sched = x.to(device), y.to(device), sched.to(device)
        loss = loss_of(model(x), y, "sum_loss" in defects)
        for p in params:
            p.grad = None
        loss.backward()
        if step == 0:
            out["loss"] = loss.detach().cpu().numpy()
            # a copy: on the CPU .numpy() shares the tensor's memory, and the clip below
            # rescales the gradient in place
            out["grads"] = {n: p.grad.detach().cpu().numpy().copy() for n, p in named}
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        adam_update(params, m, v, sched, cfg)
    out["after"] = {n: p.detach().cpu().numpy().copy() for n, p in named}
    return out


def jax_side(cfg: Config, seed: int, defects: frozenset[str], batches: Batches,
             devices: int) -> dict[str, Any]:
    """The same quantities from the JAX port's own functions: its model for the loss and
    gradients, its jitted data-parallel step on ``devices`` devices for the update."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipelines.markov.train_jax import make_loss, make_train_step
    from pipelines.markov.train_torch import schedule

    if len(jax.devices()) < devices:
        raise SystemExit(f"--devices {devices}: JAX sees {len(jax.devices())} device(s); on the "
                         f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={devices}")
    weights = init_params(cfg.symbols, cfg.embed, cfg.hidden, cfg.classes, seed)
    x0, y0 = batches[0]
    loss, grads = jax.value_and_grad(make_loss(defects))(
        {k: jnp.asarray(w) for k, w in weights.items()}, jnp.asarray(x0), jnp.asarray(y0))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put({k: jnp.asarray(w) for k, w in weights.items()}, replicated)
    m = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    v = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    step_fn = make_train_step(mesh, cfg, defects)
    for step, (x, y) in enumerate(batches):
        params, m, v, _, _ = step_fn(params, m, v, x, y, schedule(cfg, step))
    return {"loss": np.asarray(loss), "grads": {k: np.asarray(g) for k, g in grads.items()},
            "after": {k: np.asarray(a) for k, a in params.items()}}


def port_side(backend: str, cfg: Config, seed: int, defects: frozenset[str],
              batches: Batches, devices: int) -> dict[str, Any]:
    if backend == "jax":
        return jax_side(cfg, seed, defects, batches, devices)
    if backend == "torch_xla":
        import torch_xla

        return torch_side(cfg, seed, defects, batches, device=torch_xla.device())
    return torch_side(cfg, seed, defects, batches)


def check(backend: str, cfg: Config, seed: int, defects: Sequence[str], devices: int = 1,
          steps: int = STEPS) -> list[Any]:
    """``[parity/loss, parity/grads, update_delta]`` of the port ``backend`` with
    ``defects`` on ``devices`` devices against the reference (PyTorch, CPU, no defect),
    same weights, same batches."""
    from refrun.gradcheck.parity import compare_by_name
    from refrun.gradcheck.update_delta import compare_updates

    if backend == "torch_xla":  # the XLA device must exist before autograd's first use
        import torch_xla

        torch_xla.device()
    batches = first_batches(cfg, seed, steps)
    ref = torch_side(cfg, seed, frozenset(), batches)
    port = port_side(backend, cfg, seed, frozenset(defects), batches, devices)
    start = init_params(cfg.symbols, cfg.embed, cfg.hidden, cfg.classes, seed)
    port_label = backend if devices == 1 else f"{backend} x{devices}"
    lab = {"label_a": port_label, "label_b": "reference (torch)"}
    return [compare_by_name({"loss": port["loss"]}, {"loss": ref["loss"]}, tol=TOL,
                            label="parity/loss", **lab),
            compare_by_name(port["grads"], ref["grads"], tol=TOL, label="parity/grads", **lab),
            compare_updates(start, port["after"], start, ref["after"], tol=TOL, steps=steps,
                            label="update_delta", **lab)]


def record(backend: str, cfg: Config, seed: int, defects: Sequence[str], candidate: str,
           tracking_uri: str | None, devices: int = 1) -> tuple[str | None, bool]:
    """Run :func:`check` and record it for the candidate run; ``(run id, passed)``."""
    from refrun.gradcheck.record import record_gradcheck

    results = check(backend, cfg, seed, defects, devices)
    rid = record_gradcheck(results, workload=cfg.workload, tracking_uri=tracking_uri,
                           backend=backend, candidate_run_id=candidate,
                           run_name=f"gradcheck-{backend}-seed{seed}", plot=False)
    return rid, all(r.passed for r in results)


def main(argv: list[str] | None = None) -> int:
    ns = gradcheck_cli.parse(argv, __doc__.splitlines()[0], PORT_DEFECTS,
                             "the candidate's device count (the update runs on as many)",
                             several_devices=("jax",))
    cfg = load_config(quick=ns.quick)
    rid, ok = record(ns.backend, cfg, ns.seed, ns.defect, ns.candidate, ns.tracking_uri,
                     ns.devices)
    return gradcheck_cli.report(ns.candidate, rid, ok)


if __name__ == "__main__":
    sys.exit(main())
