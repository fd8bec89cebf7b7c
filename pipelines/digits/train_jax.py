"""The JAX port of the digits MLP: data parallel over 1 or N devices (``--devices N``).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m pipelines.digits.train_jax --seed 0 --devices 4

Same algorithm as the PyTorch reference (``train_torch``): per device the mean
cross-entropy of its shard, gradients averaged across devices, the *global* gradient
clipped once, SGD with momentum (torch's update rule: ``m = μ·m + g; p = p − lr·m``).
The step is one ``jax.jit`` of a ``jax.shard_map`` over a 1-D ``data`` mesh.  Weights
start from the same named NumPy arrays as every other port (``fc1.weight`` is ``(out, in)``
and the layer computes ``x @ W.T + b``, so nothing is transposed).

On the CPU, N devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set
before JAX is imported (the demo starts each run in its own process with it).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import refrun.jax
from pipelines.digits import cli
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params, layer_names
from pipelines.jax_buffered import buffered_step, metric_names
from pipelines.jax_cpu import one_step_in_flight

Params = dict[str, jax.Array]


def matmul(a: jax.Array, b: jax.Array, bf16: bool) -> jax.Array:
    """``a @ b`` in float32, or (``bf16``, the defect) with bfloat16 inputs and float32
    accumulation, as a mixed-precision port computes it."""
    if not bf16:
        return a @ b
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def forward(params: Params, x: jax.Array, names: tuple[str, ...], block_first: bool,
            bf16: bool = False) -> jax.Array:
    """Logits of the MLP; ``block_first`` stops the gradient at fc1's output (defect);
    ``bf16``: the matmuls in bfloat16 (defect)."""
    for i, name in enumerate(names):
        x = matmul(x, params[f"{name}.weight"].T, bf16) + params[f"{name}.bias"]
        if i == 0 and block_first:
            x = jax.lax.stop_gradient(x)
        if i < len(names) - 1:
            x = jax.nn.relu(x)
    return x


def cross_entropy(logits: jax.Array, y: jax.Array, reduction: str = "mean") -> jax.Array:
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]
    return nll.sum() if reduction == "sum" else nll.mean()


def clip_by_global_norm(grads: Params, max_norm: float) -> Params:
    """torch.nn.utils.clip_grad_norm_: scale by ``min(1, max_norm / (‖g‖₂ + 1e-6))``,
    ‖g‖₂ over all parameters together."""
    total = jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))
    scale = jnp.minimum(1.0, max_norm / (total + 1e-6))
    return {k: g * scale for k, g in grads.items()}


def make_train_step(mesh: Mesh, names: tuple[str, ...], lr: float, momentum: float,
                    clip_norm: float, reduction: str, clip_per_device: bool,
                    block_first: bool, bf16: bool = False):
    """The jitted data-parallel step ``(params, mom, x, y) -> (params, mom, loss, grad_norm)``."""
    # A mean loss is averaged across devices, a summed one summed (mean->sum defect).
    reduce = partial(jax.lax.pmean if reduction == "mean" else jax.lax.psum, axis_name="data")

    def per_device(params: Params, mom: Params, x: jax.Array, y: jax.Array):
        def loss_fn(p: Params) -> jax.Array:
            return cross_entropy(forward(p, x, names, block_first, bf16), y, reduction)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        if clip_per_device:  # the defect: each device clips its own gradient, then average
            grads = reduce(clip_by_global_norm(grads, clip_norm))
        else:                # correct: average across devices, clip the global gradient once
            grads = clip_by_global_norm(reduce(grads), clip_norm)
        mom = {k: momentum * mom[k] + grads[k] for k in params}
        params = {k: params[k] - lr * mom[k] for k in params}
        norms = {k: jnp.linalg.norm(g) for k, g in grads.items()}
        return params, mom, reduce(loss), norms

    # check_vma=False: the gradient of a replicated parameter is each device's own local
    # gradient, reduced explicitly above.  With varying-manual-axes checking JAX would insert
    # the cross-device sum itself when differentiating, and the per-device clip would then
    # act on an already summed gradient (4x the mean on 4 devices).
    sharded = jax.shard_map(per_device, mesh=mesh,
                            in_specs=(P(), P(), P("data"), P("data")),
                            out_specs=(P(), P(), P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1))


@partial(jax.jit, static_argnums=(3, 4))
def evaluate(params: Params, x: jax.Array, y: jax.Array, names: tuple[str, ...],
             bf16: bool = False):
    """(mean cross-entropy, accuracy) on a whole split, as device scalars."""
    logits = forward(params, x, names, block_first=False, bf16=bf16)
    return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, axis=1) == y)


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
    names = tuple(layer_names(cfg.sizes))
    data = load(cfg.split_seed, cfg.n_train, cfg.n_val)
    batches = batch_indices(args.seed, cfg.steps, cfg.batch, cfg.n_train)

    params = jax.device_put({k: jnp.asarray(v) for k, v in
                             init_params(cfg.sizes, args.seed).items()}, replicated)
    mom = jax.device_put({k: jnp.zeros_like(v) for k, v in params.items()}, replicated)
    train_step = make_train_step(
        mesh, names, cfg.lr, cfg.momentum, cfg.clip_norm,
        reduction="sum" if args.has("sum_loss") else "mean",
        clip_per_device=args.has("clip_per_device"), block_first=args.has("blocked_grad"),
        bf16=args.has("bf16_matmul"))
    bf16 = args.has("bf16_matmul")
    # Every step logged and the loss never read on the host: the step's scalars go
    # through a metrics buffer (pipelines.jax_buffered), else through probe.log.
    use_buffer = cfg.log_every == 1 and not args.has("float_loss")
    step_fn = buffered_step(train_step, (0, 1)) if use_buffer else train_step
    # The stale-copy defect: evaluation keeps reading the arrays it was given at the start
    # while the loop rebinds ``params`` to the updated ones.
    stale = jax.tree.map(jnp.copy, params) if args.has("stale_eval_copy") else None
    eval_steps = set(cfg.eval_steps())
    best_loss, best_params = float("inf"), params

    hardware = devices[0].platform
    serial = one_step_in_flight(devices)
    with cli.start_run(args, hardware=hardware) as run:
        probe = refrun.jax.instrument(run, params=params, step_fns=[step_fn], mesh=mesh)
        buf = None
        for step in range(cfg.steps):
            idx = batches[step]
            x, y = data.train.x[idx], data.train.y[idx]
            if use_buffer and buf is None:
                buf = probe.metrics_buffer(*metric_names(train_step, params, mom, x, y),
                                           sharding=replicated)
            with probe.step(step):
                if use_buffer:
                    params, mom, buf = step_fn(buf, params, mom, x, y)
                    buf = probe.log_buffer(buf)
                else:
                    params, mom, loss, norms = train_step(params, mom, x, y)
                    if args.has("float_loss") and not math.isfinite(float(loss)):
                        continue  # a NaN guard: a host read of the loss in every step
                    if step % cfg.log_every == 0 or step == cfg.steps - 1:
                        probe.log(loss=loss, grad_norm=norms)
            if serial:  # several CPU devices: see pipelines.jax_cpu
                jax.block_until_ready(params)
            if step in eval_steps:
                val_loss, val_acc = evaluate(stale or params, data.val.x, data.val.y, names, bf16)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                if float(val_loss) < best_loss:  # outside the step: a deliberate host read
                    best_loss, best_params = float(val_loss), jax.tree.map(jnp.copy, params)
                cli.progress(args, step, float(val_loss), float(val_acc))
        # Final evaluation of the model the run delivers: the best checkpoint, reloaded.
        if not args.has("no_best_reload"):
            params = best_params
        final = stale or params
        final_loss, final_acc = evaluate(final, data.val.x, data.val.y, names, bf16)
        test_loss, test_acc = evaluate(final, data.test.x, data.test.y, names, bf16)
        probe.log_eval(cfg.steps - 1, final_val_loss=final_loss, final_val_accuracy=final_acc,
                       test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    print(f"[{args.variant}] run {run.run_id}  test acc {float(test_acc):.4f}  "
          f"test loss {float(test_loss):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
