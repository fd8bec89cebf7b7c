"""Reference workloads for the checks, their tests, the docs and ``--self-test``.

* :func:`torch_mse` / :func:`jax_mse`: seed 000's loss ``mean((w·x − y)²)``; at w=1,
  x=[1, 2], y=[0, 0] the loss is 2.5 and dL/dw = 5.
* :func:`make_ebm_loss`: seed 002's 0-D energy balance model, a 1,200-step (100-year,
  monthly) rollout of ``T ← T + dt/C · (S0(1−α(T))/4 − ε σ T⁴)`` compressed into
  ``(T_final − 290 K)²``, differentiated w.r.t. the emissivity ε.
* :class:`TorchMLP` / :func:`jax_mlp_loss`: a two-layer tanh MLP and its JAX port
  (Dense kernels ``(in, out)``), with :data:`MLP_MAPPING` between their names.
* :func:`clipping_update_demo`: a linear regression trained data-parallel on N JAX
  devices, gradients clipped once after averaging (correct) or per device before
  averaging (seed 004's four-chip defect).

Frameworks are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError
from refrun.gradcheck.parity import ParamMap

SEED000 = {"params": 1.0, "args": ([1.0, 2.0], [0.0, 0.0]), "loss": 2.5, "grad": 5.0}

S0, SIGMA_SB = 1361.0, 5.67e-8
EBM_STEPS = 1200
EBM_EMISSIVITY = 0.61


def torch_mse(w: Any, x: Any, y: Any) -> Any:
    """``mean((w·x − y)²)`` in PyTorch."""
    return ((w * x - y) ** 2).mean()


def jax_mse(w: Any, x: Any, y: Any) -> Any:
    """``mean((w·x − y)²)`` in JAX."""
    import jax.numpy as jnp

    return jnp.mean((w * x - y) ** 2)


def make_ebm_loss(dtype: Any, stop_gradient: bool = False) -> Callable[[Any], Any]:
    """Seed 002's energy-balance loss in JAX for ``dtype`` (all constants in that dtype).

    ``stop_gradient=True`` inserts ``jax.lax.stop_gradient`` on the emissivity inside the
    step, the seed's exercise 1.
    """
    import jax
    import jax.numpy as jnp

    def albedo(t: Any) -> Any:
        return 0.28 + 0.34 * 0.5 * (1.0 - jnp.tanh((t - 263.0) / 5.0))

    def ebm_loss(emissivity: Any) -> Any:
        eps = jax.lax.stop_gradient(emissivity) if stop_gradient else emissivity

        def step(t: Any, _: Any) -> tuple[Any, None]:
            imbalance = S0 * (1 - albedo(t)) / 4 - eps * SIGMA_SB * t ** 4
            return t + jnp.asarray(86400.0 * 30 / 4e8, dtype) * imbalance, None

        t, _ = jax.lax.scan(step, jnp.asarray(288.0, dtype), None, length=EBM_STEPS)
        return (t - 290.0) ** 2

    return ebm_loss


# --- MLP and its JAX port -------------------------------------------------------------
MLP_MAPPING: dict[str, ParamMap] = {
    "fc1.weight": ParamMap("fc1.kernel", "transpose"),
    "fc1.bias": ParamMap("fc1.bias"),
    "fc2.weight": ParamMap("fc2.kernel", "transpose"),
    "fc2.bias": ParamMap("fc2.bias"),
}


def torch_mlp(n_in: int = 5, n_hidden: int = 7, n_out: int = 3, seed: int = 0) -> Any:
    """A ``Linear → tanh → Linear`` PyTorch module (float64, seeded)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(n_in, n_hidden))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("fc2", torch.nn.Linear(n_hidden, n_out))
    return model.double()


def torch_mlp_loss(model: Any, x: Any, y: Any) -> Any:
    """Mean squared error of the PyTorch MLP."""
    return ((model(x) - y) ** 2).mean()


def jax_mlp_loss(params: Any, x: Any, y: Any) -> Any:
    """The same MLP in JAX: ``params = {"fc1": {"kernel", "bias"}, "fc2": {...}}``."""
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
    out = h @ params["fc2"]["kernel"] + params["fc2"]["bias"]
    return jnp.mean((out - y) ** 2)


def mlp_batch(n: int = 16, n_in: int = 5, n_out: int = 3, seed: int = 1
              ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n_in)), rng.standard_normal((n, n_out))


# --- per-device clipping ------------------------------------------------------------
def clipping_batch(n_devices: int, per_device: int = 8, n_features: int = 4, seed: int = 0
                   ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Initial params and one global batch whose device shards have different gradients."""
    rng = np.random.default_rng(seed)
    n = n_devices * per_device
    x = rng.standard_normal((n, n_features)).astype(np.float32)
    # shard-dependent scale so per-device gradient norms differ (the defect's trigger)
    x *= np.repeat(np.arange(1, n_devices + 1, dtype=np.float32), per_device)[:, None]
    y = (x @ rng.standard_normal(n_features) + 0.5).astype(np.float32)
    params = {"w": np.zeros(n_features, np.float32), "b": np.zeros((), np.float32)}
    return params, x, y


def clipping_update_demo(n_devices: int = 4, max_norm: float = 1.0, lr: float = 0.1,
                         steps: int = 1) -> dict[str, Any]:
    """Parameter updates after ``steps`` SGD steps of a clipped linear regression.

    Returns ``{"params0", "batch", "reference", "sharded_correct", "sharded_per_device"}``
    (updated params as lists): ``reference`` on one device, clipping the full-batch
    gradient; ``sharded_correct`` on ``n_devices`` devices, averaging (``pmean``) then
    clipping; ``sharded_per_device`` clipping each device's gradient before averaging.
    Needs ``n_devices`` JAX devices (set ``XLA_FLAGS=--xla_force_host_platform_device_count``
    before importing jax, or use :func:`clipping_update_demo_subprocess`).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    if jax.device_count() < n_devices:
        raise RefrunInputError(
            f"n_devices: {n_devices} JAX devices needed, {jax.device_count()} present; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices} before jax loads")
    params0, x, y = clipping_batch(n_devices)

    def loss(p: Any, xb: Any, yb: Any) -> Any:
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

    def clip(g: Any) -> Any:
        norm = jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree_util.tree_leaves(g)))
        scale = jnp.minimum(1.0, max_norm / (norm + 1e-12))
        return jax.tree_util.tree_map(lambda v: v * scale, g)

    def sgd(p: Any, g: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)

    @jax.jit
    def reference(p: Any, xb: Any, yb: Any) -> Any:
        return sgd(p, clip(jax.grad(loss)(p, xb, yb)))

    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("d",))
    spec_b, spec_p = PartitionSpec("d"), PartitionSpec()

    def sharded(per_device_clip: bool) -> Callable[..., Any]:
        def body(p: Any, xb: Any, yb: Any) -> Any:
            g = jax.grad(loss)(p, xb, yb)
            # the defect clips local gradients, then averages
            g = jax.lax.pmean(clip(g), "d") if per_device_clip else clip(jax.lax.pmean(g, "d"))
            return sgd(p, g)

        # check_vma=False: per-device gradients stay local (with varying-axis checks JAX
        # would psum the replicated parameters' cotangent inside grad, hiding the defect)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_p, spec_b, spec_b),
                                     out_specs=spec_p, check_vma=False))

    out: dict[str, Any] = {"params0": _tolist(params0), "batch": {"x": x.tolist(),
                                                                 "y": y.tolist()},
                           "n_devices": n_devices, "max_norm": max_norm, "lr": lr,
                           "steps": steps}
    for name, step in (("reference", reference), ("sharded_correct", sharded(False)),
                       ("sharded_per_device", sharded(True))):
        p = {k: jnp.asarray(v) for k, v in params0.items()}
        for _ in range(steps):
            p = step(p, jnp.asarray(x), jnp.asarray(y))
        out[name] = _tolist({k: np.asarray(v) for k, v in p.items()})
    return out


def _tolist(named: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: np.asarray(v).tolist() for k, v in named.items()}


def clipping_update_demo_subprocess(n_devices: int = 4, timeout_s: float = 120.0,
                                    **kwargs: Any) -> dict[str, Any]:
    """:func:`clipping_update_demo` in a fresh Python process with ``n_devices`` CPU
    devices (a process's device count is fixed when jax is first imported)."""
    env = dict(os.environ)
    flag = f"--xla_force_host_platform_device_count={n_devices}"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import json, sys; from refrun.gradcheck.examples import clipping_update_demo; "
            f"print(json.dumps(clipping_update_demo(n_devices={n_devices}, **{kwargs!r})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"clipping demo subprocess failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("params0", "reference", "sharded_correct", "sharded_per_device"):
        out[key] = {k: np.asarray(v, dtype=np.float32) for k, v in out[key].items()}
    out["batch"] = {k: np.asarray(v, dtype=np.float32) for k, v in out["batch"].items()}
    return out
