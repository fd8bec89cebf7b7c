"""The JAX port of the character-level transformer LM: data parallel over 1 or N devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m pipelines.charlm.train_jax --seed 0 --devices 4

Same algorithm as the PyTorch reference (``train_torch``): per device the mean
next-character cross-entropy of its shard of the batch, gradients averaged across devices,
the *global* gradient clipped once, Adam with torch's arithmetic and the same learning-rate
schedule.  The step is one ``jax.jit`` of a ``jax.shard_map`` over a 1-D ``data`` mesh; the
learning rate and Adam's bias corrections are arguments (data), so the step compiles once.
Weights start from the same named NumPy arrays as every other port, batches and dropout
masks are the same arrays.

On the CPU, N devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set
before JAX is imported (the pipelines start each run in its own process with it).
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
from pipelines.charlm import cli
from pipelines.charlm.config import MASKED, Config, schedule
from pipelines.charlm.data import (
    VOCAB,
    batch_starts,
    dropout_mask,
    eval_keep,
    eval_starts,
    load,
    windows,
)
from pipelines.charlm.model import LN_EPS, group_of, init_params
from pipelines.jax_buffered import buffered_step, metric_names
from pipelines.jax_cpu import one_step_in_flight

Params = dict[str, jax.Array]


def layer_norm(h: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """torch.nn.LayerNorm over the last axis (biased variance, eps inside the sqrt)."""
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) / jnp.sqrt(var + LN_EPS) * w + b


def matmul(a: jax.Array, b: jax.Array, bf16: bool = False) -> jax.Array:
    """``a @ b`` in float32, or (``bf16``, the defect) with bfloat16 inputs and float32
    accumulation, as a mixed-precision port computes it."""
    if not bf16:
        return a @ b
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def linear(p: Params, name: str, h: jax.Array, bf16: bool = False) -> jax.Array:
    return matmul(h, p[f"{name}.weight"].T, bf16) + p[f"{name}.bias"]


def attention(p: Params, b: str, a: jax.Array, n_head: int, leak: bool, scale: bool,
              bf16: bool = False) -> jax.Array:
    """Causal self-attention of block ``b`` (``leak``/``scale``: see train_torch.Attention)."""
    bsz, t, d = a.shape
    dh = d // n_head
    q, k, v = (z.reshape(bsz, t, n_head, dh).transpose(0, 2, 1, 3)
               for z in jnp.split(linear(p, f"{b}.attn.qkv", a, bf16), 3, axis=-1))
    scores = matmul(q, k.transpose(0, 1, 3, 2), bf16)
    if scale:
        scores = scores / math.sqrt(dh)
    allowed = jnp.tril(jnp.ones((t, t), dtype=bool), int(leak))
    scores = jnp.where(allowed, scores, MASKED)
    out = matmul(jax.nn.softmax(scores, axis=-1), v, bf16)
    return linear(p, f"{b}.attn.proj", out.transpose(0, 2, 1, 3).reshape(bsz, t, d), bf16)


def forward(p: Params, x: jax.Array, keep: jax.Array | None, cfg: Config,
            leak: bool = False, scale: bool = True, bf16: bool = False) -> jax.Array:
    """Logits ``(B, T, VOCAB)`` of the model in :mod:`pipelines.charlm.model`
    (``bf16``: every matmul in bfloat16, the defect)."""
    h = p["tok_emb.weight"][x] + p["pos_emb.weight"][: x.shape[1]]
    if keep is not None:
        h = h * keep
    for i in range(cfg.n_layer):
        b = f"blocks.{i}"
        h = h + attention(p, b, layer_norm(h, p[f"{b}.ln1.weight"], p[f"{b}.ln1.bias"]),
                          cfg.n_head, leak, scale, bf16)
        m = layer_norm(h, p[f"{b}.ln2.weight"], p[f"{b}.ln2.bias"])
        h = h + linear(p, f"{b}.mlp.proj", jax.nn.gelu(linear(p, f"{b}.mlp.fc", m, bf16),
                                                       approximate=True), bf16)
    return linear(p, "head", layer_norm(h, p["ln_f.weight"], p["ln_f.bias"]), bf16)


def lm_loss(logits: jax.Array, y: jax.Array, double_shift: bool = False) -> jax.Array:
    """Mean next-character cross-entropy (``double_shift``: see train_torch.lm_loss)."""
    if double_shift:
        logits, y = logits[:, :-1], y[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()


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


def make_loss(cfg: Config, defects: frozenset[str]):
    """``(params, x, y, keep) -> loss``: the training loss of this port, with the model
    defects (the step differentiates it; the gradient check compares it)."""
    leak, scale = "causal_leak" in defects, "no_attn_scale" not in defects
    double_shift, bf16 = "double_shift" in defects, "bf16_matmul" in defects

    def loss_fn(p: Params, x: jax.Array, y: jax.Array, keep: jax.Array) -> jax.Array:
        return lm_loss(forward(p, x, keep, cfg, leak, scale, bf16), y, double_shift)

    return loss_fn


def make_train_step(mesh: Mesh, cfg: Config, defects: frozenset[str]):
    """The jitted data-parallel step
    ``(params, m, v, x, y, keep, sched) -> (params, m, v, loss, group norms)``."""
    per_device = "clip_per_device" in defects
    mean = partial(jax.lax.pmean, axis_name="data")
    loss_of = make_loss(cfg, defects)

    def per_device_step(params, m, v, x, y, keep, sched):
        loss, grads = jax.value_and_grad(loss_of)(params, x, y, keep)
        if per_device:  # the defect: each device clips its own gradient, then average
            grads = mean(clip_by_global_norm(grads, cfg.clip_norm))
        else:           # correct: average across devices, clip the global gradient once
            grads = clip_by_global_norm(mean(grads), cfg.clip_norm)
        lr, bc1, bc2 = sched[0], sched[1], sched[2]
        m = {k: cfg.beta1 * m[k] + (1.0 - cfg.beta1) * grads[k] for k in params}
        v = {k: cfg.beta2 * v[k] + (1.0 - cfg.beta2) * grads[k] * grads[k] for k in params}
        params = {k: params[k] - lr * (m[k] / bc1) / (jnp.sqrt(v[k] / bc2) + cfg.eps)
                  for k in params}
        return params, m, v, mean(loss), group_norms(grads)

    # check_vma=False: the gradient of a replicated parameter is each device's own local
    # gradient, reduced explicitly above (see pipelines/digits/train_jax.py for why).
    sharded = jax.shard_map(per_device_step, mesh=mesh,
                            in_specs=(P(), P(), P(), P("data"), P("data"), P("data"), P()),
                            out_specs=(P(), P(), P(), P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1, 2))


def make_evaluate(cfg: Config, bf16: bool = False):
    """Jitted ``(params, x, y, keep) -> (mean cross-entropy, accuracy)`` on fixed windows
    (``bf16``: the port's matmuls in bfloat16, the defect)."""
    @jax.jit
    def evaluate(params: Params, x: jax.Array, y: jax.Array, keep: jax.Array):
        logits = forward(params, x, keep, cfg, bf16=bf16)
        return lm_loss(logits, y), jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return evaluate


def _or_ones(mask: np.ndarray | None, ones: np.ndarray) -> np.ndarray:
    """The evaluation's mask, all ones when it applies none (one compiled program)."""
    return ones if mask is None else mask


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
    corpus = load(cfg.files, cfg.val_fraction, cfg.test_fraction)
    starts = batch_starts(args.seed, cfg.steps, cfg.batch, len(corpus.train), cfg.context)
    val = windows(corpus.val, eval_starts(len(corpus.val), cfg.context, cfg.eval_windows),
                  cfg.context)
    test = windows(corpus.test, eval_starts(len(corpus.test), cfg.context, cfg.eval_windows),
                   cfg.context)
    eval_shape = (cfg.eval_windows, cfg.context, cfg.d_model)
    no_drop = np.ones(eval_shape, dtype=np.float32)

    weights = init_params(VOCAB, cfg.context, cfg.d_model, cfg.n_layer, cfg.mlp_ratio, args.seed)
    params = jax.device_put({k: jnp.asarray(w) for k, w in weights.items()}, replicated)
    m = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    v = jax.device_put({k: jnp.zeros_like(w) for k, w in params.items()}, replicated)
    train_step = make_train_step(mesh, cfg, args.defects)
    # Every step logged and the loss never read on the host: the step's scalars go
    # through a metrics buffer (pipelines.jax_buffered), else through probe.log.
    use_buffer = cfg.log_every == 1 and not args.has("float_loss")
    step_fn = buffered_step(train_step, (0, 1, 2)) if use_buffer else train_step
    evaluate = make_evaluate(cfg, args.has("bf16_matmul"))
    eval_steps = set(cfg.eval_steps())
    replay_from = None if args.resume is None else args.resume.interrupt
    ckpt_dir = tempfile.TemporaryDirectory(prefix="charlm-ckpt-")
    ckpt = Path(ckpt_dir.name) / "checkpoint.npz"

    serial = one_step_in_flight(devices)
    with cli.start_run(args, hardware=devices[0].platform, corpus_sha256=corpus.sha256) as run:
        probe = refrun.jax.instrument(run, params=params, step_fns=[step_fn], mesh=mesh)
        buf = None
        for step in args.step_order():
            x, y = windows(corpus.train, starts[step], cfg.context)
            keep = dropout_mask(args.seed, step, (*x.shape, cfg.d_model), cfg.dropout)
            sched = schedule(cfg, step, not args.has("no_warmup"))
            if use_buffer and buf is None:
                names = metric_names(train_step, params, m, v, x, y, keep, sched)
                buf = probe.metrics_buffer(*names, sharding=replicated)
            with probe.step(step):
                if use_buffer:
                    params, m, v, buf = step_fn(buf, params, m, v, x, y, keep, sched)
                    buf = probe.log_buffer(buf)
                else:
                    params, m, v, loss, norms = train_step(params, m, v, x, y, keep, sched)
                    if args.has("float_loss") and not math.isfinite(float(loss)):
                        continue  # a NaN guard: a host read of the loss in every step
                    if step % cfg.log_every == 0 or step == cfg.steps - 1:
                        probe.log(loss=loss, grad_norm=norms)
            if serial:  # several CPU devices: see pipelines.jax_cpu
                jax.block_until_ready(params)
            if step in eval_steps:
                keep_eval = _or_ones(eval_keep(args.defects, "val", step, eval_shape,
                                               cfg.dropout), no_drop)
                val_loss, val_acc = evaluate(params, *val, keep_eval)
                probe.log_eval(step, val_loss=val_loss, val_accuracy=val_acc)
                cli.progress(args, step, float(val_loss))  # outside the step
            if args.resume is not None and step == args.resume.checkpoint:
                np.savez(ckpt, **{f"{kind}/{k}": np.asarray(a) for kind, tree in
                                  (("params", params), ("m", m), ("v", v))
                                  for k, a in tree.items()})
            if step == replay_from:  # the "crash": restart from the checkpoint
                replay_from = None
                with np.load(ckpt) as z:
                    params, m, v = ({k: jax.device_put(jnp.asarray(z[f"{kind}/{k}"]), replicated)
                                     for k in weights} for kind in ("params", "m", "v"))
        keep_test = _or_ones(eval_keep(args.defects, "test", cfg.steps, eval_shape,
                                       cfg.dropout), no_drop)
        test_loss, test_acc = evaluate(params, *test, keep_test)
        probe.log_eval(cfg.steps - 1, test_loss=test_loss, test_accuracy=test_acc)
        probe.close()
    ckpt_dir.cleanup()
    print(f"[{args.variant}] run {run.run_id}  test loss {float(test_loss):.4f}  "
          f"test acc {float(test_acc):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
