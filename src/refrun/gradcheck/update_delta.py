"""Update-delta parity: the same optimizer steps in the reference and the candidate.

From identical parameters and identical batches, both sides run ``k`` steps; the
parameter *updates* ``Δ = params_k − params_0`` are compared by name with
:func:`refrun.gradcheck.parity.compare_by_name` (relative error
``‖Δ_a − Δ_b‖ / max(‖Δ_a‖, ‖Δ_b‖, eps_safe)``).  This covers what a gradient check
cannot: the optimizer, the clipping, the averaging across devices — e.g. gradients
clipped per device before averaging (a different update whenever device gradients
exceed the clip norm) versus clipped once after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError
from refrun.gradcheck import named as nm
from refrun.gradcheck.parity import ParamMap, ParityResult, compare_by_name


@dataclass
class UpdateDeltaResult:
    """Per-parameter parity of the updates, and their sizes."""

    label: str
    steps: int
    parity: ParityResult
    update_norm_a: dict[str, float]
    update_norm_b: dict[str, float]
    kind = "update_delta"

    @property
    def passed(self) -> bool:
        return self.parity.passed

    @property
    def failed_names(self) -> list[str]:
        return self.parity.failed_names

    def summary(self) -> str:
        return f"{self.label} ({self.steps} step(s)): {self.parity.summary()}"

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        return self.parity.record_metrics()


def update_deltas(before: Any, after: Any) -> dict[str, np.ndarray]:
    """``name -> after − before`` in float64 (same names required)."""
    b = nm.to_named_numpy(before)
    a = nm.to_named_numpy(after)
    nm.check_same_names(b, a, "params after the step")
    for k in b:
        if a[k].shape != b[k].shape:
            raise RefrunInputError(f"params after the step[{k!r}]: shape {a[k].shape} != "
                                   f"{b[k].shape} before")
    return {k: a[k].astype(np.float64) - b[k].astype(np.float64) for k in b}


def compare_updates(params0_a: Any, after_a: Any, params0_b: Any, after_b: Any,
                    mapping: Mapping[str, str | ParamMap] | None = None, *, tol: float = 1e-5,
                    steps: int = 1, label: str = "update_delta", label_a: str = "reference",
                    label_b: str = "candidate", eps_safe: float = 1e-12) -> UpdateDeltaResult:
    """Compare the updates of two sides given their parameters before and after."""
    da = update_deltas(params0_a, after_a)
    db = update_deltas(params0_b, after_b)
    parity = compare_by_name(da, db, mapping, tol=tol, eps_safe=eps_safe, label_a=label_a,
                             label_b=label_b, label=label)
    return UpdateDeltaResult(label=label, steps=steps, parity=parity,
                             update_norm_a={k: float(np.linalg.norm(v)) for k, v in da.items()},
                             update_norm_b={k: float(np.linalg.norm(v)) for k, v in db.items()})


def update_delta_parity(reference_step: Callable[[Any, Any], Any],
                        candidate_step: Callable[[Any, Any], Any], params: Any,
                        batches: Any | Sequence[Any], *, steps: int = 1,
                        mapping: Mapping[str, str | ParamMap] | None = None,
                        tol: float = 1e-5, label: str = "update_delta",
                        to_reference: Callable[[Any], Any] = lambda p: p,
                        to_candidate: Callable[[Any], Any] = lambda p: p) -> UpdateDeltaResult:
    """Run ``steps`` optimizer steps on each side from the same ``params`` and compare.

    ``reference_step(params, batch) -> params`` (and ``candidate_step``) are pure step
    functions (close over optimizer state).  ``batches``: one batch reused every step, or
    a list of ``steps`` batches.  ``to_reference`` / ``to_candidate`` convert the
    NumPy ``params`` into each side's arrays (default: passed as is).
    """
    if steps < 1:
        raise RefrunInputError(f"steps: need at least 1, got {steps}")
    seq = list(batches) if isinstance(batches, list) else [batches] * steps
    if len(seq) != steps:
        raise RefrunInputError(f"batches: {len(seq)} given for {steps} steps")
    p0 = nm.to_named_numpy(params)
    results = []
    for step, convert in ((reference_step, to_reference), (candidate_step, to_candidate)):
        p = convert(nm.unflatten(params, {k: v.copy() for k, v in p0.items()}))
        start = nm.to_named_numpy(p)
        for batch in seq:
            p = step(p, batch)
        results.append((start, p))
    (sa, pa), (sb, pb) = results
    return compare_updates(sa, pa, sb, pb, mapping, tol=tol, steps=steps, label=label)
