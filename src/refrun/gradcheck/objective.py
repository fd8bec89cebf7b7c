"""A scalar loss seen through one interface, whatever framework computes it.

``make_objective(fn, params, args)`` wraps ``fn(params, *args) -> scalar`` written in
PyTorch or JAX (or NumPy, value only) into an :class:`Objective` whose inputs and
outputs are ``name -> numpy array`` dicts (see :mod:`refrun.gradcheck.named`).  Every
check works on this interface, so a finite-difference sweep, a parity comparison or a
precision spot check is the same code for both frameworks.

The evaluation dtype is explicit: floating parameters and floating arguments are cast to
it before every call.  JAX float64 evaluations run inside ``jax.enable_x64(True)`` (a
context, so the rest of the process keeps its setting).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError
from refrun.gradcheck import named as nm
from refrun.gradcheck.named import Named

FRAMEWORKS = ("torch", "jax", "numpy")
LABELS = {"torch": "PyTorch", "jax": "JAX", "numpy": "NumPy"}


@dataclass
class Objective:
    """A scalar function of named parameters, with its gradient.

    ``x0`` is the point the objective was built at (in the evaluation dtype);
    ``evaluations`` counts function evaluations, ``gradient_evaluations`` gradient ones.
    """

    framework: str
    dtype: np.dtype
    x0: Named
    value_fn: Callable[[Named], float]
    grad_fn: Callable[[Named], tuple[float, Named]] | None
    evaluations: int = 0
    gradient_evaluations: int = 0
    label: str = ""
    _unused: tuple[str, ...] = field(default=(), repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.x0)

    @property
    def n_params(self) -> int:
        return int(sum(v.size for v in self.x0.values()))

    def value(self, x: Named) -> float:
        """Loss at ``x`` as a Python float (float64 copy of the framework's result)."""
        self.evaluations += 1
        return self.value_fn(x)

    def value_and_grad(self, x: Named) -> tuple[float, Named]:
        """Loss and ``name -> gradient`` at ``x``; a parameter the loss does not reach
        (detached, unused) gets a zero gradient, which is what autodiff means by it."""
        if self.grad_fn is None:
            raise RefrunInputError(f"{self.label or 'fn'}: no gradient available for a "
                                   f"{self.framework} function")
        self.gradient_evaluations += 1
        return self.grad_fn(x)


def make_objective(fn: Callable[..., Any], params: Any, args: Sequence[Any] = (), *,
                   framework: str | None = None, dtype: Any = None, jit: bool = True,
                   label: str = "", root: str = "params") -> Objective:
    """Wrap ``fn(params, *args)`` (a scalar loss) as an :class:`Objective`.

    ``params``: a tensor/array, a dict or list of them, an ``nn.Module`` (then ``fn``
    receives the module) or a JAX pytree.  ``framework``: ``"torch"``, ``"jax"`` or
    ``"numpy"``; guessed from ``params`` and ``args`` when omitted.  ``dtype``: evaluation
    dtype (e.g. ``"float64"``); default: the parameters' own.  ``jit``: compile the JAX
    function once (the finite-difference sweep calls it many times).
    """
    if not callable(fn):
        raise RefrunInputError(f"{label or 'fn'}: not callable")
    fw = framework or _guess_framework(params, args)
    if fw not in FRAMEWORKS:
        raise RefrunInputError(f"framework: {fw!r} is not one of {', '.join(FRAMEWORKS)}")
    x0 = nm.to_named_numpy(params, root)
    if not x0:
        raise RefrunInputError(f"{label or 'fn'}: params has no arrays")
    dt = np.dtype(dtype) if dtype is not None else _common_float_dtype(x0)
    x0 = {k: _cast(v, dt) for k, v in x0.items()}
    label = label or getattr(fn, "__name__", "fn")
    if fw == "torch":
        value_fn, grad_fn = _torch_fns(fn, params, args, dt, label, root)
    elif fw == "jax":
        value_fn, grad_fn = _jax_fns(fn, params, args, dt, label, root, jit)
    else:
        value_fn, grad_fn = _numpy_fns(fn, params, args, dt, label, root), None
    return Objective(framework=fw, dtype=dt, x0=x0, value_fn=value_fn, grad_fn=grad_fn,
                     label=label)


def objective_from_callables(value: Callable[[Named], float],
                             grad: Callable[[Named], Named] | None, x0: Mapping[str, Any],
                             label: str = "fn") -> Objective:
    """An :class:`Objective` from plain NumPy callables on named arrays (no framework)."""
    x = {k: np.asarray(v, dtype=np.float64) for k, v in x0.items()}

    def vg(p: Named) -> tuple[float, Named]:
        return float(value(p)), {k: np.asarray(v, np.float64) for k, v in grad(p).items()}

    return Objective(framework="numpy", dtype=np.dtype(np.float64), x0=x,
                     value_fn=lambda p: float(value(p)), grad_fn=vg if grad else None,
                     label=label)


def _guess_framework(params: Any, args: Sequence[Any]) -> str:
    for obj in (params, *args):
        fw = nm.framework_of(obj)
        if fw != "numpy":
            return fw
    raise RefrunInputError("framework: cannot tell from NumPy inputs whether fn is PyTorch or "
                           "JAX; pass framework='torch' or 'jax'")


def _common_float_dtype(x: Named) -> np.dtype:
    kinds = [v.dtype for v in x.values() if v.dtype.kind == "f"]
    return np.result_type(*kinds) if kinds else np.dtype(np.float32)


def _cast(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    return v.astype(dt) if v.dtype.kind in "fiu" else v


def _scalar(out: Any, label: str) -> Any:
    shape = tuple(getattr(out, "shape", ()))
    if int(np.prod(shape)) != 1:
        raise RefrunInputError(f"{label}: must return a scalar loss, returned shape {shape}")
    return out


# --- PyTorch --------------------------------------------------------------------------
def _torch_fns(fn: Callable[..., Any], params: Any, args: Sequence[Any], dt: np.dtype,
               label: str, root: str) -> tuple[Callable[[Named], float],
                                               Callable[[Named], tuple[float, Named]]]:
    import torch

    tdt = getattr(torch, dt.name)
    targs = [_torch_arg(a, tdt) for a in args]
    module = None
    if nm.is_torch_module(params):
        module = copy.deepcopy(params).to(tdt)  # never touch the caller's module

    def build(x: Named, grad: bool) -> tuple[Any, list[Any]]:
        if module is not None:
            named = dict(module.named_parameters())
            with torch.no_grad():
                for k, p in named.items():
                    p.copy_(torch.from_numpy(_contig(x[k])))
                    p.grad = None
            return module, list(named.values())
        leaves = {k: torch.from_numpy(_contig(v)).requires_grad_(
            grad and v.dtype.kind == "f") for k, v in x.items()}
        return nm.unflatten(params, leaves, root), list(leaves.values())

    def value(x: Named) -> float:
        with torch.no_grad():
            p, _ = build(x, grad=False)
            return float(_scalar(fn(p, *targs), label).detach().double().reshape(()))

    def value_and_grad(x: Named) -> tuple[float, Named]:
        with torch.enable_grad():
            p, leaves = build(x, grad=True)
            loss = _scalar(fn(p, *targs), label).reshape(())
            names = list(x)
            if loss.requires_grad:
                wrt = [t for t in leaves if t.requires_grad]
                got = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
                grads = [next(got) if t.requires_grad else None for t in leaves]
            else:  # every input detached: autodiff says the gradient is zero
                grads = [None] * len(leaves)
            out = {n: (np.zeros_like(x[n]) if g is None else g.detach().cpu().numpy().copy())
                   for n, g in zip(names, grads, strict=True)}
            return float(loss.detach().double()), out

    return value, value_and_grad


def _contig(v: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d array into shape (1,)
    v = np.asarray(v)
    return v if v.flags.c_contiguous and v.flags.writeable else v.copy()


def _torch_arg(a: Any, tdt: Any) -> Any:
    import torch

    if isinstance(a, torch.Tensor):
        return a.to(tdt) if a.is_floating_point() else a
    if isinstance(a, np.ndarray | list | tuple):
        arr = np.asarray(a)
        if arr.dtype.kind == "f":
            return torch.as_tensor(arr).to(tdt)
        if arr.dtype.kind in "iub":
            return torch.as_tensor(arr)
    return a  # Python scalars and other objects are passed as they are


# --- JAX ------------------------------------------------------------------------------
@contextlib.contextmanager
def jax_precision(dt: np.dtype) -> Iterator[None]:
    """Enable JAX 64-bit types for the duration when ``dt`` is a 64-bit dtype."""
    if dt.itemsize == 8:
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


def _jax_fns(fn: Callable[..., Any], params: Any, args: Sequence[Any], dt: np.dtype,
             label: str, root: str, jit: bool) -> tuple[Callable[[Named], float],
                                                        Callable[[Named], tuple[float, Named]]]:
    import jax
    import jax.numpy as jnp

    def as_jax(a: Any) -> Any:
        arr = np.asarray(a) if not nm.is_jax_leaf(a) else a
        if getattr(arr, "dtype", None) is not None and np.dtype(arr.dtype).kind == "f":
            return jnp.asarray(arr, dtype=dt)
        return a

    def call(x: Any, *a: Any) -> Any:
        return _scalar(fn(nm.unflatten(params, x, root), *a), label).reshape(())

    vg = jax.value_and_grad(call)
    f = call
    if jit:
        vg, f = jax.jit(vg), jax.jit(call)

    def inputs(x: Named) -> tuple[dict[str, Any], list[Any]]:
        return ({k: jnp.asarray(v, dtype=v.dtype) for k, v in x.items()},
                [as_jax(a) for a in args])

    def value(x: Named) -> float:
        with jax_precision(dt):
            p, a = inputs(x)
            return float(np.asarray(f(p, *a), dtype=np.float64))

    def value_and_grad(x: Named) -> tuple[float, Named]:
        with jax_precision(dt):
            p, a = inputs(x)
            loss, g = vg(p, *a)
            return float(np.asarray(loss, np.float64)), {k: np.asarray(v).copy()
                                                         for k, v in g.items()}

    return value, value_and_grad


# --- NumPy (value only) ---------------------------------------------------------------
def _numpy_fns(fn: Callable[..., Any], params: Any, args: Sequence[Any], dt: np.dtype,
               label: str, root: str) -> Callable[[Named], float]:
    def value(x: Named) -> float:
        out = np.asarray(fn(nm.unflatten(params, x, root), *args))
        return float(_scalar(out, label).reshape(()))

    return value
