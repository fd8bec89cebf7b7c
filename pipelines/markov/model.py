"""The GRU classifier's parameters by name, initialised once in NumPy and copied into
every port.

Names and layouts follow PyTorch (``gru.weight_ih`` is ``(3·hidden, embed)`` with the
gates in torch.nn.GRU's order r, z, n; a layer computes ``x @ W.T + b``); the JAX port
keeps the same names and layouts, so weights are copied by name with no transpose.
Initialisation: embeddings ``N(0, 1)``, every other weight and bias
``U(−1/sqrt(fan), 1/sqrt(fan))`` with ``fan`` = hidden for the GRU and the head (PyTorch's
defaults), drawn from ``numpy.random.default_rng(seed)`` in the order of
:func:`param_shapes`, so every port starts from bit-identical weights.

The model every port implements (torch.nn.GRU's equations, h₀ = 0)::

    e_t = emb[x_t]
    r = σ(W_ir e_t + b_ir + W_hr h + b_hr)
    z = σ(W_iz e_t + b_iz + W_hz h + b_hz)
    n = tanh(W_in e_t + b_in + r ⊙ (W_hn h + b_hn))
    h = (1 − z) ⊙ n + z ⊙ h
    logits = head(h_T)
"""

from __future__ import annotations

import numpy as np


def param_shapes(symbols: int, embed: int, hidden: int, classes: int
                 ) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` in initialisation order."""
    return {"emb.weight": (symbols, embed),
            "gru.weight_ih": (3 * hidden, embed), "gru.weight_hh": (3 * hidden, hidden),
            "gru.bias_ih": (3 * hidden,), "gru.bias_hh": (3 * hidden,),
            "head.weight": (classes, hidden), "head.bias": (classes,)}


def init_params(symbols: int, embed: int, hidden: int, classes: int, seed: int
                ) -> dict[str, np.ndarray]:
    """Initial weights by name, float32 (see the module docstring for the scheme)."""
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(hidden)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(symbols, embed, hidden, classes).items():
        value = rng.normal(0.0, 1.0, shape) if name == "emb.weight" else \
            rng.uniform(-bound, bound, shape)
        params[name] = value.astype(np.float32)
    return params


def group_of(name: str) -> str:
    """The module group a parameter's gradient norm is logged under: ``embed``, ``gru``
    or ``head`` (``grad_norm/<group>``)."""
    return name.split(".")[0].replace("emb", "embed")
