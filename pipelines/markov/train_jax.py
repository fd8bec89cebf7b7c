"""The JAX port of the GRU sequence classifier: data parallel over 1 or N devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m pipelines.markov.train_jax --seed 0 --devices 4

Same algorithm as the PyTorch reference (``train_torch``): per device the mean
cross-entropy of its shard of the batch, gradients averaged across devices, the *global*
gradient clipped once, Adam with torch's arithmetic.  The GRU is a ``jax.lax.scan`` over
time with torch.nn.GRU's gate equations; the step is one ``jax.jit`` of a
``jax.shard_map`` over a 1-D ``data`` mesh, with the learning rate and Adam's bias
corrections as arguments (data), so the step compiles once.  Weights start from the same
named NumPy arrays as every other port, batches are the same arrays.

Defects only this port has (each runs without an error): ``clip_per_device`` (N devices),
``bf16_matmul`` (every matmul's inputs cast to bfloat16, accumulated in float32: a
numerics change whose curves stay inside the seeds' spread), ``float_loss``
(``float(loss)`` in the step: a host read of a device array every step).
"""

from __future__ import annotations

import math
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import refrun.jax
from pipelines.jax_buffered import buffered_step, metric_names
from pipelines.jax_cpu import one_step_in_flight
from pipelines.markov import cli
from pipelines.markov.config import Config, schedule
from pipelines.markov.data import batch_indices, load
from pipelines.markov.model import group_of, init_params

Params = dict[str, jax.Array]


def matmul(a: jax.Array, b: jax.Array, bf16: bool) -> jax.Array:
    """``a @ b`` in float32, or (``bf16``, the defect) with bfloat16 inputs and float32
    accumulation, as a mixed-precision port computes it."""
    if not bf16:
        return a @ b
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def forward(p: Params, x: jax.Array, gate_swap: bool = False, bf16: bool = False
            ) -> jax.Array:
    """Logits ``(B, classes)`` of the model in :mod:`pipelines.markov.model`."""
    e = p["emb.weight"][x]                                            # (B, T, E)
    gi = matmul(e, p["gru.weight_ih"].T, bf16) + p["gru.bias_ih"]     # (B, T, 3H)
    hidden = p["gru.weight_hh"].shape[1]

    def cell(h: jax.Array, gi_t: jax.Array) -> tuple[jax.Array, None]:
        gh = matmul(h, p["gru.weight_hh"].T, bf16) + p["gru.bias_hh"]
        i_r, i_z, i_n = jnp.split(gi_t, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(i_r + h_r)
        z = jax.nn.sigmoid(i_z + h_z)
        n = jnp.tanh(i_n + r * h_n)
        return (z * n + (1 - z) * h if gate_swap else (1 - z) * n + z * h), None

    h0 = jnp.zeros((x.shape[0], hidden), dtype=e.dtype)
    h, _ = jax.lax.scan(cell, h0, jnp.swapaxes(gi, 0, 1))
    return matmul(h, p["head.weight"].T, bf16) + p["head.bias"]


def cross_entropy(logits: jax.Array, y: jax.Array, reduction: str = "mean") -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
    return nll.sum() if reduction == "sum" else nll.mean()


def clip_by_global_norm(grads: Params, max_norm: float) -> Params:
    """torch.nn.utils.clip_grad_norm_: scale by ``min(1, max_norm / (‖g‖₂ + 1e-6))``."""
    total = jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))
    scale = jnp.minimum(1.0, max_norm / (total + 1e-6))
    return {k: g * scale for k, g in grads.items()}


def group_norms(grads: Params) -> dict[str, jax.Array]:
    """L2 norm of the applied gradient of each module group (:func:`model.group_of`)."""
    sq: dict[str, jax.Array] = {}
    for k, g in grads.items():
        sq[group_of(k)] = sq.get(group_of(k), 0.0) + jnp.sum(g * g)
    return {k: jnp.sqrt(s) for k, s in sq.items()}


def make_loss(defects: frozenset[str]):
    """``(params, x, y) -> loss`` of one device's shard, with the model defects."""
    swap, bf16 = "gate_swap" in defects, "bf16_matmul" in defects
    reduction = "sum" if "sum_loss" in defects else "mean"

    def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return cross_entropy(forward(params, x, swap, bf16), y, reduction)
    return loss_fn


def make_train_step(mesh: Mesh, cfg: Config, defects: frozenset[str]):
    """The jitted data-parallel step
    ``(params, m, v, x, y, sched) -> (params, m, v, loss, group norms)``."""
    per_device = "clip_per_device" in defects
    summed = "sum_loss" in defects
    mean = partial(jax.lax.pmean, axis_name="data")
    # A summed loss is summed across devices (so the defect means the same on 1 or N).
    reduce = partial(jax.lax.psum, axis_name="data") if summed else mean
    loss_fn = make_loss(defects)

    def per_device_step(params, m, v, x, y, sched):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if per_device:  # the defect: each device clips its own gradient, then average
            grads = reduce(clip_by_global_norm(grads, cfg.clip_norm))
        else:           # correct: combine across devices, clip the global gradient once
            grads = clip_by_global_norm(reduce(grads), cfg.clip_norm)
        lr, bc1, bc2 = sched[0], sched[1], sched[2]
        m = {k: cfg.beta1 * m[k] + (1.0 - cfg.beta1) * grads[k] for k in params}
        v = {k: cfg.beta2 * v[k] + (1.0 - cfg.beta2) * grads[k] * grads[k] for k in params}
        params = {k: params[k] - lr * (m[k] / bc1) / (jnp.sqrt(v[k] / bc2) + cfg.eps)
                  for k in params}
        return params, m, v, reduce(loss), group_norms(grads)

    # check_vma=False: the gradient of a replicated parameter is each device's own local
    # gradient, reduced explicitly above (see pipelines/digits/train_jax.py for why).
    sharded = jax.shard_map(per_device_step, mesh=mesh,
                            in_specs=(P(), P(), P(), P("data"), P("data"), P()),
                            out_specs=(P(), P(), P(), P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1, 2))


def make_evaluate(defects: frozenset[str]):
    """Jitted ``(params, x, y) -> (mean cross-entropy, accuracy)`` over a whole split."""
    swap, bf16 = "gate_swap" in defects, "bf16_matmul" in defects

    @jax.jit
    def evaluate(params: Params, x: jax.Array, y: jax.Array):
        logits = forward(params, x, swap, bf16)
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return evaluate


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(argv, "jax", __doc__.splitlines()[0])
    cfg = args.config
    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: JAX sees {len(jax.devices())} device(s); on "
                         f"the CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{args.devices} before starting Python")
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    data = load(cfg.data_seed, cfg.classes, cfg.symbols, cfg.length, cfg.mix,
                cfg.concentration, cfg.n_train, cfg.n_val)
    batches = batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train)
    x_val, y_val = jnp.asarray(data.val.x), jnp.asarray(data.val.y)

    weights = init_params(cfg.symbols, cfg.embed, cfg.hidden, cfg.classes, args.seed)
    params = jax.device_put({k: jnp.asarray(w) for k, w in weights.items()}, replicated)
    m = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    v = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    train_step = make_train_step(mesh, cfg, args.defects)
    # Every step logged and the loss never read on the host: the step's scalars go
    # through a metrics buffer (pipelines.jax_buffered), else through probe.log.
    use_buffer = cfg.log_every == 1 and not args.has("float_loss")
    step_fn = buffered_step(train_step, (0, 1, 2)) if use_buffer else train_step
    evaluate = make_evaluate(args.defects)
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="markov-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.npz"

    serial = one_step_in_flight(devices)
    with cli.start_run(args, hardware=devices[0].platform) as run:
        probe = refrun.jax.instrument(run, params=params, step_fns=[step_fn], mesh=mesh)
        buf = None
        for step in args.step_order():
            idx = batches[step]
            x, y = data.train.x[idx], data.train.y[idx]
            sched = schedule(cfg, step)
            if use_buffer and buf is None:
                names = metric_names(train_step, params, m, v, x, y, sched)
                buf = probe.metrics_buffer(*names, sharding=replicated)
            with probe.step(step):
                if use_buffer:
                    params, m, v, buf = step_fn(buf, params, m, v, x, y, sched)
                    buf = probe.log_buffer(buf)
                else:
                    params, m, v, loss, norms = train_step(params, m, v, x, y, sched)
                    if args.has("float_loss") and not math.isfinite(float(loss)):
                        continue  # a NaN guard: a host read of the loss in every step
                    if args.logs(step):
                        probe.log(loss=loss, grad_norm=norms)
            if serial:  # several CPU devices: see pipelines.jax_cpu
                jax.block_until_ready(params)
            if step in eval_steps:
                val_loss, val_acc = evaluate(params, x_val, y_val)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss), float(val_acc))  # outside the step
            if args.resume is not None and step == args.resume.checkpoint:
                np.savez(ckpt, **{f"{kind}/{k}": np.asarray(a) for kind, tree in
                                  (("params", params), ("m", m), ("v", v))
                                  for k, a in tree.items()})
            if step == replay_from:  # the "crash": restart from the checkpoint
                replay_from = None
                with np.load(ckpt) as z:
                    params, m, v = ({k: jax.device_put(jnp.asarray(z[f"{kind}/{k}"]), replicated)
                                     for k in weights} for kind in ("params", "m", "v"))
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  val loss {float(val_loss):.4f}  "
          f"val acc {float(val_acc):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
