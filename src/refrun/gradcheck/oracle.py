"""Known-answer checks: a loss and its gradient against an analytically computed oracle.

Framework agreement alone is weak evidence (two ports can share a mistake), so each
framework is asserted against the independent answer first, then against each other::

    result = check_known_answer(
        params=1.0, args=([1.0, 2.0], [0.0, 0.0]),
        expected_loss=2.5, expected_grad=5.0,          # mean((w*x - y)^2) at w=1
        torch_fn=torch_loss, jax_fn=jax_loss, dtype="float32")
    result.raise_if_failed()       # AssertionError naming e.g. "JAX gradient oracle [params]"

Assertions, in order: finite values per framework, ``<fw> loss oracle``, ``forward
parity``, ``<fw> gradient oracle`` per parameter, ``gradient parity`` per parameter.  A
value passes when ``|actual - expected| <= atol + rtol * |expected|`` elementwise
(NumPy's ``allclose`` rule), shapes compared first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError
from refrun.gradcheck import named as nm
from refrun.gradcheck.objective import LABELS, make_objective


@dataclass(frozen=True)
class Assertion:
    """One labelled check: which framework, loss or gradient, which parameter."""

    label: str
    quantity: str  # "finite" | "loss" | "gradient"
    framework: str | None  # None for a parity assertion between frameworks
    parameter: str | None
    passed: bool
    max_abs_error: float
    detail: str

    def __str__(self) -> str:
        where = f" [{self.parameter}]" if self.parameter else ""
        return f"{'PASS' if self.passed else 'FAIL'} {self.label}{where}: {self.detail}"


@dataclass
class KnownAnswerResult:
    """All assertions of one known-answer check (none is skipped after a failure)."""

    assertions: list[Assertion]
    dtype: str
    rtol: float
    atol: float
    label: str = "known_answer"
    losses: dict[str, float] = field(default_factory=dict)
    kind = "known_answer"

    @property
    def passed(self) -> bool:
        return all(a.passed for a in self.assertions)

    @property
    def failures(self) -> list[Assertion]:
        return [a for a in self.assertions if not a.passed]

    def summary(self) -> str:
        if self.passed:
            return f"{self.label}: {len(self.assertions)} assertions passed ({self.dtype})"
        return f"{self.label}: " + "; ".join(str(a) for a in self.failures)

    def raise_if_failed(self) -> None:
        """Raise ``AssertionError`` whose message starts with the first failing label."""
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        out = {f"{a.label}{'/' + a.parameter if a.parameter else ''}/abs_error":
               a.max_abs_error for a in self.assertions if a.quantity != "finite"}
        out["passed"] = float(self.passed)
        return out


def check_known_answer(*, params: Any, expected_loss: float, expected_grad: Any,
                       args: Sequence[Any] = (), torch_fn: Callable[..., Any] | None = None,
                       jax_fn: Callable[..., Any] | None = None, dtype: str = "float32",
                       rtol: float = 1e-5, atol: float = 1e-6,
                       label: str = "known_answer", root: str = "params") -> KnownAnswerResult:
    """Assert ``fn(params, *args)`` and its gradient w.r.t. ``params`` against the oracle.

    ``params`` / ``args`` are framework-neutral (Python numbers, lists, NumPy arrays,
    dicts of them) and converted to each framework in ``dtype``.  ``expected_grad`` has
    the structure of ``params``.  Raises :class:`RefrunInputError` for a non-finite or
    mis-shaped oracle, or when neither function is given.  ``root`` names a bare-array
    ``params`` in labels (e.g. ``"w"``).
    """
    fns = {fw: f for fw, f in (("torch", torch_fn), ("jax", jax_fn)) if f is not None}
    if not fns:
        raise RefrunInputError("check_known_answer: give torch_fn and/or jax_fn")
    p0 = {k: np.asarray(v, dtype=dtype) for k, v in nm.flatten(params, root).items()}
    want_loss, want_grad = _oracle(expected_loss, expected_grad, p0, root)
    np_params = nm.unflatten(params, p0, root)
    np_args = [np.asarray(a, dtype=dtype) if np.asarray(a).dtype.kind == "f" else a
               for a in args]
    losses: dict[str, float] = {}
    grads: dict[str, dict[str, np.ndarray]] = {}
    out: list[Assertion] = []
    for fw, f in fns.items():
        obj = make_objective(f, np_params, np_args, framework=fw, dtype=dtype,
                             jit=False, label=f"{LABELS[fw]} loss", root=root)
        losses[fw], grads[fw] = obj.value_and_grad(obj.x0)
        out.append(_finite(fw, losses[fw], grads[fw]))
    tol = (rtol, atol)
    for fw in fns:
        out.append(_close(f"{LABELS[fw]} loss oracle", "loss", fw, None,
                          np.float64(losses[fw]), want_loss, tol))
    if len(fns) == 2:
        out.append(_close("forward parity", "loss", None, None, np.float64(losses["jax"]),
                          np.float64(losses["torch"]), tol))
    for fw in fns:
        for name, want in want_grad.items():
            out.append(_close(f"{LABELS[fw]} gradient oracle", "gradient", fw, name,
                              grads[fw][name], want, tol))
    if len(fns) == 2:
        for name in want_grad:
            out.append(_close("gradient parity", "gradient", None, name, grads["jax"][name],
                              grads["torch"][name], tol))
    return KnownAnswerResult(assertions=out, dtype=str(np.dtype(dtype)), rtol=rtol, atol=atol,
                             label=label, losses=losses)


def _oracle(expected_loss: float, expected_grad: Any,
            p0: Mapping[str, np.ndarray], root: str) -> tuple[np.float64, dict[str, np.ndarray]]:
    loss = np.asarray(expected_loss, dtype=np.float64)
    if loss.size != 1 or not np.isfinite(loss).all():
        raise RefrunInputError(f"expected_loss: must be one finite number, got {expected_loss!r}")
    grad = {k: np.asarray(v, dtype=np.float64) for k, v in nm.flatten(expected_grad, root).items()}
    nm.check_same_names(p0, grad, "expected_grad")
    for k, g in grad.items():
        if g.shape != p0[k].shape:
            raise RefrunInputError(f"expected_grad[{k!r}]: shape {g.shape} does not match the "
                                   f"parameter's shape {p0[k].shape}")
        if not np.isfinite(g).all():
            raise RefrunInputError(f"expected_grad[{k!r}]: non-finite oracle value")
    return loss.reshape(()), grad


def _finite(fw: str, loss: float, grads: Mapping[str, np.ndarray]) -> Assertion:
    bad = [k for k, g in grads.items() if not np.isfinite(g).all()]
    if not np.isfinite(loss):
        bad.insert(0, "loss")
    detail = "loss and gradients finite" if not bad else f"non-finite: {', '.join(bad)}"
    return Assertion(label=f"{LABELS[fw]} finite values", quantity="finite", framework=fw,
                     parameter=None, passed=not bad, max_abs_error=0.0, detail=detail)


def _close(label: str, quantity: str, fw: str | None, param: str | None, actual: Any,
           expected: Any, tol: tuple[float, float]) -> Assertion:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Assertion(label, quantity, fw, param, False, float("inf"),
                         f"shape {a.shape} != expected shape {e.shape}")
    rtol, atol = tol
    err = np.abs(a - e)
    ok = bool(np.all(err <= atol + rtol * np.abs(e)))
    worst = float(err.max()) if err.size else 0.0
    shown = f"{float(a.reshape(-1)[0]):.7g} vs expected {float(e.reshape(-1)[0]):.7g}" \
        if a.size == 1 else f"max |error| {worst:.3g}"
    return Assertion(label, quantity, fw, param, ok, worst,
                     f"{shown} (rtol={rtol:g}, atol={atol:g})")
