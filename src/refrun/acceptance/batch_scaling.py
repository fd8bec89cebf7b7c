"""A learning rate scaled with the global batch, recognised as such.

A candidate that trains with ``r`` times the references' global batch (the
``refrun.global_batch`` tags) runs a different recipe, and the usual way to keep its
training close to the references' is to scale the learning rate with the batch:

* **linear**, ``lr' = r * lr``, for SGD with momentum (Goyal et al. 2017, "Accurate,
  Large Minibatch SGD: Training ImageNet in 1 Hour", section 2.1);
* **square root**, ``lr' = sqrt(r) * lr``, for adaptive methods such as Adam
  (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms", Definition 2.4; Krizhevsky 2014 for SGD).

Such a candidate's ``opt/lr`` differs from the references' by exactly that factor at every
point, so criteria calibrated on the references' learning rate (an envelope with a
tolerance of 1e-7) would reject a recipe the user chose on purpose, and say nothing
about whether the *schedule* was kept.  :func:`scaled_learning_rate` recognises the case
from the runs alone: the batch ratio ``r`` from the tags, and the candidate's peak
learning rate over the references' equal (to :data:`RTOL`) to one of the two rules'
factors.  The assessment then judges the candidate's ``opt/lr`` series divided by that
factor (:func:`divided`), and says so in one line; everything else (loss, gradient
norms, evaluation) is judged as logged.  The peak is compared, not every point: with
another batch the run also takes another number of steps, and the schedule's points
line up only on the axis of samples seen, which the criteria choose.

Any other factor is left alone (the ``opt/lr`` criteria judge it as logged), so a
learning rate changed by mistake is not excused by a batch change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refrun import schema

if TYPE_CHECKING:  # the rules alone are imported by training code (pipelines/recipe.py)
    import pandas as pd

RTOL = 1e-6
"""Relative tolerance on the peak ratio: float32 learning rates carry ~1e-7."""

LINEAR = "linear"
SQUARE_ROOT = "square root"
RULES = ((LINEAR, "Goyal et al. 2017", lambda r: r),
         (SQUARE_ROOT, "Malladi et al. 2022", math.sqrt))
"""Each rule: its name, its reference, and the learning-rate factor for a batch ``r``
times larger (the one home of the rules: the pipelines' recipes use :func:`factor`)."""


def factor(rule: str, batch_ratio: float) -> float:
    """The learning-rate factor of ``rule`` (:data:`LINEAR` or :data:`SQUARE_ROOT`) for a
    global batch ``batch_ratio`` times the original."""
    for name, _, factor_of in RULES:
        if name == rule:
            return float(factor_of(batch_ratio))
    raise ValueError(f"scaling rule {rule!r}: known rules are {LINEAR!r}, {SQUARE_ROOT!r}")


@dataclass(frozen=True)
class ScaledLR:
    """The candidate's learning rate is the references' times ``factor``, which
    ``rule`` gives for a global batch ``batch_ratio`` times theirs."""

    batch_ratio: float
    factor: float
    rule: str
    reference: str

    def line(self) -> str:
        return (f"the candidate's learning rate is {self.factor:.6g}x the references' with "
                f"{self.batch_ratio:g}x their global batch ({schema.TAG_GLOBAL_BATCH}): the "
                f"{self.rule} scaling rule ({self.reference}); {schema.M_LR} is judged "
                f"divided by {self.factor:.6g}")


def peak(curves: pd.DataFrame, metric: str = schema.M_LR) -> float | None:
    """The largest finite value of ``metric`` in a run's long curves table, or None."""
    import pandas as pd

    v = pd.to_numeric(curves.loc[curves["metric"] == metric, "value"], errors="coerce")
    v = v[v.map(math.isfinite)] if len(v) else v
    return float(v.max()) if len(v) else None


def scaled_learning_rate(candidate_batch: int | None, reference_batches: Sequence[int | None],
                         candidate_peak: float | None,
                         reference_peaks: Sequence[float | None]) -> ScaledLR | None:
    """The scaling rule the candidate's learning rate follows, or None: when every
    reference has one global batch ``B`` and peak learning rate ``p`` (each to
    :data:`RTOL`), the candidate another batch ``B'`` and a peak ``p'`` with
    ``p' / p`` equal to a rule's factor for ``r = B' / B`` (and ``r != 1``)."""
    if candidate_batch is None or not reference_batches or candidate_peak is None \
            or any(b is None for b in reference_batches) \
            or any(p is None or p <= 0 for p in reference_peaks) or not reference_peaks:
        return None
    batches = {int(b) for b in reference_batches if b is not None}
    if len(batches) != 1 or candidate_batch <= 0:
        return None
    ref_b = batches.pop()
    peaks = [float(p) for p in reference_peaks if p is not None]
    ref_p = peaks[0]
    if ref_b <= 0 or candidate_batch == ref_b \
            or any(not math.isclose(p, ref_p, rel_tol=RTOL) for p in peaks):
        return None
    r = candidate_batch / ref_b
    ratio = candidate_peak / ref_p
    for rule, reference, factor_of in RULES:
        f = factor_of(r)
        if math.isclose(ratio, f, rel_tol=RTOL):
            return ScaledLR(r, f, rule, reference)
    return None


def divided(curves: pd.DataFrame, factor: float) -> pd.DataFrame:
    """A copy of a long curves table with every learning-rate series (``opt/lr`` and
    ``opt/lr/pg<i>``) divided by ``factor``; other metrics unchanged."""
    out = curves.copy()
    names = out["metric"].astype(str)
    lr = (names == schema.M_LR) | names.str.startswith(schema.M_LR + "/")
    out.loc[lr, "value"] = out.loc[lr, "value"] / factor
    return out
