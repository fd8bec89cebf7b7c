"""The transformer's parameters by name, initialised once in NumPy and copied into every port.

Names and layouts follow PyTorch (``blocks.0.attn.qkv.weight`` is ``(out, in)``, a layer
computes ``x @ W.T + b``); the JAX port keeps the same names and layouts, so weights are
copied by name with no transpose.  GPT-2's initialisation: weights and embeddings
``N(0, 0.02²)``, the two projections that write into the residual stream
``N(0, (0.02/sqrt(2·n_layer))²)``, biases 0, LayerNorm scales 1; drawn from
``numpy.random.default_rng(seed)`` in the order of :func:`param_shapes`, so every port
starts from bit-identical weights.

The architecture every port implements (pre-LayerNorm GPT, no weight tying)::

    h = (tok_emb[x] + pos_emb[:T]) * dropout_mask
    for each block:  h += proj(causal_attention(ln1(h)));  h += mlp.proj(gelu_tanh(mlp.fc(ln2(h))))
    logits = head(ln_f(h))

with attention scores ``q·k / sqrt(d_head)`` masked to keys ``j <= i``, LayerNorm eps 1e-5.
"""

from __future__ import annotations

import numpy as np

LN_EPS = 1e-5


def param_shapes(vocab: int, context: int, d: int, n_layer: int, mlp_ratio: int
                 ) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` in initialisation order."""
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (vocab, d),
                                          "pos_emb.weight": (context, d)}
    for i in range(n_layer):
        b = f"blocks.{i}"
        shapes.update({
            f"{b}.ln1.weight": (d,), f"{b}.ln1.bias": (d,),
            f"{b}.attn.qkv.weight": (3 * d, d), f"{b}.attn.qkv.bias": (3 * d,),
            f"{b}.attn.proj.weight": (d, d), f"{b}.attn.proj.bias": (d,),
            f"{b}.ln2.weight": (d,), f"{b}.ln2.bias": (d,),
            f"{b}.mlp.fc.weight": (mlp_ratio * d, d), f"{b}.mlp.fc.bias": (mlp_ratio * d,),
            f"{b}.mlp.proj.weight": (d, mlp_ratio * d), f"{b}.mlp.proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "head.weight": (vocab, d),
                   "head.bias": (vocab,)})
    return shapes


def init_params(vocab: int, context: int, d: int, n_layer: int, mlp_ratio: int, seed: int
                ) -> dict[str, np.ndarray]:
    """Initial weights by name, float32 (see the module docstring for the scheme)."""
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / np.sqrt(2 * n_layer)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(vocab, context, d, n_layer, mlp_ratio).items():
        if name.startswith("ln") or ".ln" in name:
            value = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("bias"):
            value = np.zeros(shape)
        elif name.endswith("proj.weight"):
            value = rng.normal(0.0, residual_std, shape)
        else:
            value = rng.normal(0.0, 0.02, shape)
        params[name] = value.astype(np.float32)
    return params


def group_of(name: str) -> str:
    """The module group a parameter's gradient norm is logged under: ``embed``,
    ``block<i>`` or ``head`` (``grad_norm/<group>``)."""
    if name.startswith(("tok_emb", "pos_emb")):
        return "embed"
    if name.startswith("blocks."):
        return "block" + name.split(".")[1]
    return "head"
