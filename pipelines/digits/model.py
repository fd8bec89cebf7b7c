"""The MLP's parameters by name, initialised once in NumPy and copied into every port.

Names and layouts follow PyTorch (``fc1.weight`` is ``(out, in)``, ``fc1.bias`` is
``(out,)``); the JAX port keeps the same layout (it computes ``x @ W.T + b``), so weights
are copied by name with no transpose.  Initialisation is PyTorch's default for
``nn.Linear`` (uniform in ``±1/sqrt(fan_in)`` for weight and bias) drawn from
``numpy.random.default_rng(seed)``, so every port starts from bit-identical weights.
"""

from __future__ import annotations

import numpy as np


def layer_names(sizes: tuple[int, ...]) -> list[str]:
    """``["fc1", "fc2", ...]``: one name per Linear layer."""
    return [f"fc{i + 1}" for i in range(len(sizes) - 1)]


def init_params(sizes: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    """``{"fc1.weight": (out, in) float32, "fc1.bias": (out,) float32, ...}``."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for name, fan_in, fan_out in zip(layer_names(sizes), sizes[:-1], sizes[1:], strict=True):
        bound = 1.0 / np.sqrt(fan_in)
        params[f"{name}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        params[f"{name}.bias"] = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
    return params
