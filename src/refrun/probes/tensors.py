"""Torch tensor helpers shared by the PyTorch and PyTorch/XLA backends.

Reading a one-element host tensor must not dispatch ``aten::_local_scalar_dense`` (what
``.item()`` does: a host sync on an accelerator, a counted fallback on XLA), and counting
where tensors live must not touch their data.  Imported only by torch-based backends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

# Dtypes NumPy cannot hold; read as float64 (after the step).
_NUMPY_LESS = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2}


def host_float(t: torch.Tensor) -> float:
    """Value of a one-element host (CPU) tensor as a Python float.

    ``Tensor.tolist()`` reads a CPU tensor's memory directly (no operator is dispatched,
    so never ``aten::_local_scalar_dense``, and no autograd ``detach``); it is ~10x cheaper
    than ``detach().numpy()``.  Any dtype, bfloat16 and bool included."""
    if t.is_cpu:
        return float(t.tolist() if t.dim() == 0 else t.reshape(-1).tolist()[0])
    t = t.detach()
    if t.dtype in _NUMPY_LESS or t.dtype == torch.bool:
        t = t.to(torch.float64)
    return float(t.numpy().reshape(-1)[0])


def count_devices(tensors: Iterable[Any]) -> dict[str, int]:
    """Tensors per device string (``"cpu"``, ``"cuda:0"``, ``"xla:0"``); non-tensors ignored."""
    # counted by device object, named once per device (str of a device costs more than
    # hashing it; equal devices hash and name alike)
    c: Counter[Any] = Counter(t.device for t in tensors if isinstance(t, torch.Tensor))
    out: dict[str, int] = {}
    for d, n in c.items():
        out[str(d)] = out.get(str(d), 0) + n
    return out


def parameters_of(model: torch.nn.Module | None,
                  optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The model's parameters, then the optimizer's (the order device lookups use)."""
    params: list[torch.Tensor] = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    return params


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Tensors of the optimizer state, without the scalar ``step`` counters of Adam & co.
    (those live on the CPU by design unless capturable/fused, so they say nothing about
    where the state is)."""
    if optimizer is None:
        return []
    return [v for st in optimizer.state.values() for k, v in st.items()
            if k != "step" and isinstance(v, torch.Tensor)]
