"""Precision spot check: the same gradient in a low and a high precision (seed 002).

The drift is ``‖g_low − g_high‖₂ / max(‖g_high‖₂, eps_safe)`` over all parameters
together (float64 arithmetic), plus the same measure per parameter.  Seed 002's
1,200-step energy-balance model drifts by 0.7 % in float32; a feed-forward network's
gradient typically by ~1e-6.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refrun.gradcheck.objective import make_objective
from refrun.gradcheck.parity import relative_error


@dataclass
class PrecisionResult:
    """Gradient drift between two precisions."""

    label: str
    framework: str
    low: str
    high: str
    drift: float  # relative, all parameters together
    per_param: dict[str, float]
    loss_low: float
    loss_high: float
    grad_norm_low: float
    grad_norm_high: float
    tol: float
    kind = "precision"

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.drift)) and self.drift <= self.tol

    @property
    def loss_drift(self) -> float:
        return abs(self.loss_low - self.loss_high) / max(abs(self.loss_high), 1e-300)

    def summary(self) -> str:
        return (f"{self.label}: {self.low} gradient drifts {self.drift:.2%} from {self.high} "
                f"(tolerance {self.tol:.2%}); loss drift {self.loss_drift:.2e}")

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        out = {"drift": self.drift, "loss_drift": self.loss_drift, "passed": float(self.passed)}
        out.update({f"{k}/drift": v for k, v in self.per_param.items()})
        return out


def precision_drift(fn: Callable[..., Any], params: Any, args: Sequence[Any] = (), *,
                    framework: str | None = None, low: str = "float32",
                    high: str = "float64", fn_high: Callable[..., Any] | None = None,
                    tol: float = 1e-3, eps_safe: float = 1e-30,
                    label: str = "") -> PrecisionResult:
    """Gradient of ``fn(params, *args)`` in ``low`` vs ``high`` precision.

    ``fn_high``: a separate implementation for ``high`` when ``fn`` fixes its own
    constants' dtype (as seed 002's ``make_loss(dtype)`` does); default ``fn``.
    ``tol``: the largest acceptable relative drift (default 0.1 %).
    """
    lo = make_objective(fn, params, args, framework=framework, dtype=low, label=label)
    hi = make_objective(fn_high or fn, params, args, framework=lo.framework, dtype=high,
                        label=label)
    loss_lo, g_lo = lo.value_and_grad(lo.x0)
    loss_hi, g_hi = hi.value_and_grad(hi.x0)
    flat_lo = np.concatenate([np.ravel(g_lo[k]).astype(np.float64) for k in g_hi])
    flat_hi = np.concatenate([np.ravel(g_hi[k]).astype(np.float64) for k in g_hi])
    per = {k: relative_error(g_lo[k], g_hi[k], eps_safe) for k in g_hi}
    drift = float(np.linalg.norm(flat_lo - flat_hi)) / max(float(np.linalg.norm(flat_hi)),
                                                            eps_safe)
    return PrecisionResult(label=lo.label, framework=lo.framework, low=low, high=high,
                           drift=drift, per_param=per, loss_low=loss_lo, loss_high=loss_hi,
                           grad_norm_low=float(np.linalg.norm(flat_lo)),
                           grad_norm_high=float(np.linalg.norm(flat_hi)), tol=tol)
