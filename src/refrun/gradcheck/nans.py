"""NaN/Inf hunting: scan a loss and its gradient over many inputs, then find the birth.

Every point is evaluated (loss and gradient).  For the first point with a non-finite
value the computation is re-run under the framework's own tracer to name the operation
where the NaN first appears: ``jax.debug_nans`` / ``jax.debug_infs`` for JAX (raises
``FloatingPointError`` at the op), ``torch.autograd.detect_anomaly(check_nan=True)`` for
PyTorch (raises naming the backward function, e.g. ``SqrtBackward0``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun.gradcheck import named as nm
from refrun.gradcheck.objective import jax_precision, make_objective


@dataclass(frozen=True)
class NonFinite:
    """One non-finite value: at which scanned point, in the loss or which gradient."""

    point: int
    where: str  # "loss" or "gradient"
    parameter: str | None
    kind: str  # "nan" | "inf"


@dataclass
class NanHuntResult:
    label: str
    framework: str
    points: int
    findings: list[NonFinite]
    origin: str | None = None  # the framework's report of where the first NaN/Inf appears
    origin_point: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    kind = "nans"

    @property
    def passed(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        if self.passed:
            return f"{self.label}: loss and gradients finite at all {self.points} points"
        f = self.findings[0]
        where = f"gradient of {f.parameter}" if f.where == "gradient" else "loss"
        return (f"{self.label}: {len(self.findings)} non-finite values; first: {f.kind} in "
                f"{where} at point {f.point}; origin: {self.origin or 'not located'}")

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        return {"nonfinite": float(len(self.findings)), "points": float(self.points),
                "passed": float(self.passed)}


def hunt_nonfinite(fn: Callable[..., Any], points: Iterable[Any], args: Sequence[Any] = (),
                   *, framework: str | None = None, dtype: Any = None,
                   label: str = "") -> NanHuntResult:
    """Evaluate ``fn(p, *args)`` and its gradient at every ``p`` in ``points``.

    ``points``: parameter values (same structure each time), e.g. a grid over the range
    an optimiser will explore.  Returns every non-finite value found and, for the first
    offending point, the origin reported by the framework's debug mode.
    """
    findings: list[NonFinite] = []
    first: tuple[int, Any] | None = None
    fw = framework
    n = 0
    for i, p in enumerate(points):
        n += 1
        obj = make_objective(fn, p, args, framework=fw, dtype=dtype, jit=False, label=label)
        fw = obj.framework
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, grads = obj.value_and_grad(obj.x0)
        found = _scan(i, loss, grads)
        if found and first is None:
            first = (i, p)
        findings += found
    label = label or getattr(fn, "__name__", "fn")
    result = NanHuntResult(label=label, framework=fw or "?", points=n, findings=findings)
    if first is not None:
        result.origin_point = first[0]
        result.origin = locate_origin(fn, first[1], args, fw or "jax", dtype)
    return result


def _scan(i: int, loss: float, grads: dict[str, np.ndarray]) -> list[NonFinite]:
    out = []
    if not np.isfinite(loss):
        out.append(NonFinite(i, "loss", None, "nan" if np.isnan(loss) else "inf"))
    for k, g in grads.items():
        if not np.isfinite(g).all():
            out.append(NonFinite(i, "gradient", k, "nan" if np.isnan(g).any() else "inf"))
    return out


def locate_origin(fn: Callable[..., Any], params: Any, args: Sequence[Any], framework: str,
                  dtype: Any = None) -> str | None:
    """The framework's own account of where the first NaN/Inf is born (one line), or
    None when its debug mode does not fire."""
    if framework == "jax":
        return _jax_origin(fn, params, args, dtype)
    if framework == "torch":
        return _torch_origin(fn, params, args, dtype)
    return None


def _jax_origin(fn: Callable[..., Any], params: Any, args: Sequence[Any],
                dtype: Any) -> str | None:
    import jax
    import jax.numpy as jnp

    dt = np.dtype(dtype) if dtype is not None else None
    with jax_precision(dt or np.dtype(np.float32)):
        p = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=dt), params)
        a = [jnp.asarray(x, dtype=dt) if np.asarray(x).dtype.kind == "f" else x for x in args]
        # NaNs first (the seed's question); an Inf is often the NaN's precursor, so it is
        # looked for only when no NaN op fires
        for mode in (jax.debug_nans, jax.debug_infs):
            try:
                with warnings.catch_warnings(), mode(True):
                    warnings.simplefilter("ignore")
                    jax.value_and_grad(fn)(p, *a)
            except FloatingPointError as exc:
                return _first_line(exc)
    return None


def _torch_origin(fn: Callable[..., Any], params: Any, args: Sequence[Any],
                  dtype: Any) -> str | None:
    import torch

    tdt = getattr(torch, np.dtype(dtype).name) if dtype is not None else None
    leaves = {k: torch.as_tensor(nm.to_numpy(v)).to(tdt or torch.get_default_dtype())
              .requires_grad_(True) for k, v in nm.flatten(params).items()}
    p = nm.unflatten(params, leaves)
    a = [torch.as_tensor(np.asarray(x)).to(tdt) if np.asarray(x).dtype.kind == "f" else x
         for x in args]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx = torch.autograd.detect_anomaly(check_nan=True)
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = fn(p, *a)
            if not torch.isfinite(loss).all():
                return f"forward: loss is {loss.item()} (detect_anomaly checks backward only)"
            loss.backward()
    except RuntimeError as exc:
        return _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    lines = [s for s in str(exc).splitlines() if s.strip()]
    return lines[0].strip() if lines else type(exc).__name__
