"""Cross-framework gradient parity by named parameter (never by position).

A PyTorch module's gradients are matched to a JAX pytree's through an explicit mapping
``torch name -> ParamMap(jax name, transform)``; a ``Linear`` weight is ``(out, in)`` in
PyTorch and a Dense kernel ``(in, out)`` in JAX, so its entry carries ``"transpose"``::

    mapping = {"fc1.weight": ParamMap("fc1.kernel", "transpose"), "fc1.bias": "fc1.bias"}
    result = compare_by_name(torch_grads, jax_grads, mapping)

Per pair, after the transform, shapes are asserted first; then the relative error
``‖g_a − g_b‖₂ / max(‖g_a‖₂, ‖g_b‖₂, eps_safe)`` (Frobenius norms over the whole tensor)
must be ``<= tol``.  Names on either side that the mapping does not reach are listed in
``unmatched_a`` / ``unmatched_b`` and fail the result unless ``allow_unmatched=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError
from refrun.gradcheck import named as nm
from refrun.gradcheck.named import Named

Transform = str | Callable[[np.ndarray], np.ndarray] | None
TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "transpose": lambda a: np.swapaxes(a, -1, -2) if a.ndim >= 2 else a,
    "identity": lambda a: a,
    "flatten": lambda a: a.reshape(-1),
}


@dataclass(frozen=True)
class ParamMap:
    """Where a parameter of side A lives on side B, and how to bring A's layout to B's.

    ``transform``: ``"transpose"`` (swap the last two axes), ``"flatten"``, ``None`` or a
    callable ``ndarray -> ndarray``.
    """

    target: str
    transform: Transform = None

    def apply(self, a: np.ndarray) -> np.ndarray:
        t = self.transform
        if t is None:
            return a
        if isinstance(t, str):
            if t not in TRANSFORMS:
                raise RefrunInputError(f"mapping to {self.target!r}: unknown transform {t!r} "
                                       f"(one of {', '.join(TRANSFORMS)} or a callable)")
            return TRANSFORMS[t](a)
        return np.asarray(t(a))


@dataclass(frozen=True)
class ParamParity:
    """The comparison of one named parameter pair."""

    name_a: str
    name_b: str
    shape_a: tuple[int, ...]  # after the transform
    shape_b: tuple[int, ...]
    rel_error: float  # inf for a shape mismatch, nan when a value is not finite
    passed: bool
    reason: str  # "ok" | "shape" | "value" | "nonfinite"

    def __str__(self) -> str:
        if self.reason == "shape":
            return (f"{self.name_a} -> {self.name_b}: shape {self.shape_a} != {self.shape_b} "
                    "(missing transform?)")
        return f"{self.name_a} -> {self.name_b}: relative error {self.rel_error:.3g}"


@dataclass
class ParityResult:
    """Per-parameter parity plus every name the mapping left out on either side."""

    params: list[ParamParity]
    unmatched_a: list[str]
    unmatched_b: list[str]
    tol: float
    label_a: str = "a"
    label_b: str = "b"
    allow_unmatched: bool = False
    label: str = "parity"
    extra: dict[str, Any] = field(default_factory=dict)
    kind = "parity"

    @property
    def failures(self) -> list[ParamParity]:
        return [p for p in self.params if not p.passed]

    @property
    def failed_names(self) -> list[str]:
        """Side-A names of failing pairs, then unmatched names of both sides."""
        names = [p.name_a for p in self.failures]
        if not self.allow_unmatched:
            names += self.unmatched_a + self.unmatched_b
        return names

    @property
    def passed(self) -> bool:
        return not self.failed_names

    @property
    def max_rel_error(self) -> float:
        return max((p.rel_error for p in self.params), default=0.0)

    def summary(self) -> str:
        head = (f"{self.label} ({self.label_a} vs {self.label_b}, tol {self.tol:g}): "
                f"{len(self.params) - len(self.failures)}/{len(self.params)} parameters agree")
        parts = [head] + [f"FAIL {p}" for p in self.failures]
        if self.unmatched_a:
            parts.append(f"unmatched in {self.label_a}: {', '.join(self.unmatched_a)}")
        if self.unmatched_b:
            parts.append(f"unmatched in {self.label_b}: {', '.join(self.unmatched_b)}")
        return "; ".join(parts)

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        out = {f"{p.name_a}/rel_error": p.rel_error for p in self.params}
        out["unmatched"] = float(len(self.unmatched_a) + len(self.unmatched_b))
        out["passed"] = float(self.passed)
        return out


def relative_error(a: Any, b: Any, eps_safe: float = 1e-12) -> float:
    """``‖a − b‖₂ / max(‖a‖₂, ‖b‖₂, eps_safe)`` in float64 (seed 003's measure).

    0 when equal, 1 when one side is zero and the other not, up to 2 for opposite signs.
    ``eps_safe`` is the norm below which a gradient counts as zero.
    """
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    den = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)), eps_safe)
    return float(np.linalg.norm(x - y)) / den


def normalize_mapping(mapping: Mapping[str, str | ParamMap] | None,
                      names_a: Any, names_b: Any) -> dict[str, ParamMap]:
    """Validate a mapping against both name sets (identity on shared names when None).

    Raises :class:`RefrunInputError` naming a mapped parameter that does not exist or a
    target named twice.
    """
    names_a, names_b = list(names_a), list(names_b)
    if mapping is None:
        return {n: ParamMap(n) for n in names_a if n in set(names_b)}
    out: dict[str, ParamMap] = {}
    seen: dict[str, str] = {}
    for src, dst in mapping.items():
        pm = dst if isinstance(dst, ParamMap) else ParamMap(str(dst))
        if src not in names_a:
            raise RefrunInputError(f"mapping: parameter {src!r} does not exist on side A "
                                   f"({', '.join(names_a[:8])}"
                                   f"{' ...' if len(names_a) > 8 else ''})")
        if pm.target not in names_b:
            raise RefrunInputError(f"mapping[{src!r}]: target {pm.target!r} does not exist on "
                                   f"side B ({', '.join(names_b[:8])}"
                                   f"{' ...' if len(names_b) > 8 else ''})")
        if pm.target in seen:
            raise RefrunInputError(f"mapping: target {pm.target!r} named by both "
                                   f"{seen[pm.target]!r} and {src!r}")
        seen[pm.target] = src
        out[src] = pm
    return out


def compare_by_name(a: Any, b: Any, mapping: Mapping[str, str | ParamMap] | None = None, *,
                    tol: float = 1e-5, eps_safe: float = 1e-12, label_a: str = "a",
                    label_b: str = "b", allow_unmatched: bool = False,
                    label: str = "parity") -> ParityResult:
    """Compare two gradient (or parameter, or update) trees by name.

    ``a`` / ``b``: ``name -> array`` dicts, nested dicts, JAX pytrees or ``nn.Module``
    (its parameters' ``.grad``; see :func:`module_grads`).  Framework arrays are copied
    to the host.  ``tol`` bounds the per-parameter relative error.
    """
    na = _named(a)
    nb = _named(b)
    pmap = normalize_mapping(mapping, na, nb)
    params = [_compare_one(src, pm, na[src], nb[pm.target], tol, eps_safe)
              for src, pm in pmap.items()]
    targets = {pm.target for pm in pmap.values()}
    return ParityResult(params=params, unmatched_a=[n for n in na if n not in pmap],
                        unmatched_b=[n for n in nb if n not in targets], tol=tol,
                        label_a=label_a, label_b=label_b, allow_unmatched=allow_unmatched,
                        label=label)


def _named(tree: Any) -> Named:
    if nm.is_torch_module(tree):
        return module_grads(tree)
    return nm.to_named_numpy(tree)


def module_grads(module: Any) -> Named:
    """``name -> .grad`` of a PyTorch module's parameters (zeros where ``.grad`` is None,
    i.e. where backward never reached the parameter)."""
    return {n: (np.zeros(tuple(p.shape), dtype=nm.to_numpy(p).dtype) if p.grad is None
                else nm.to_numpy(p.grad)) for n, p in module.named_parameters()}


def _compare_one(src: str, pm: ParamMap, a: np.ndarray, b: np.ndarray, tol: float,
                 eps_safe: float) -> ParamParity:
    ta = pm.apply(a)
    if tuple(ta.shape) != tuple(b.shape):
        return ParamParity(src, pm.target, tuple(ta.shape), tuple(b.shape), float("inf"),
                           False, "shape")
    if not (np.isfinite(ta).all() and np.isfinite(b).all()):
        return ParamParity(src, pm.target, tuple(ta.shape), tuple(b.shape), float("nan"),
                           False, "nonfinite")
    err = relative_error(ta, b, eps_safe)
    return ParamParity(src, pm.target, tuple(ta.shape), tuple(b.shape), err, err <= tol,
                       "ok" if err <= tol else "value")


def apply_mapping(named_a: Mapping[str, Any], mapping: Mapping[str, str | ParamMap]
                  ) -> Named:
    """``named_a`` re-keyed and transformed into side B's names and layouts.

    Use it to copy PyTorch weights into a JAX port (then :func:`named.unflatten`).
    """
    out: Named = {}
    for src, dst in mapping.items():
        pm = dst if isinstance(dst, ParamMap) else ParamMap(str(dst))
        if src not in named_a:
            raise RefrunInputError(f"mapping: parameter {src!r} does not exist")
        out[pm.target] = np.array(pm.apply(nm.to_numpy(named_a[src])), order="C")
    return out
