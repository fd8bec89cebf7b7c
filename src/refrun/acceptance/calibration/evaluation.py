"""Which metrics of the reference seeds are evaluation series, whatever their names.

calibrate judges an evaluation metric by its final evaluation at L3 (the project goal
level), and does not ask its last points to converge to one value as a training metric's
final window does.  An evaluation reaches the store in several ways, and each is taken:

* **logged with** ``log_eval`` (refrun's probes and callbacks record ``eval/<name>``);
* **declared**: ``refrun calibrate --eval-metric NAME`` (for a name no rule below sees);
* **named as one**, as trainer frameworks and other tools name them: a path part or a
  ``_``-separated word of the name is one of :data:`EVAL_WORDS` (``val/accuracy`` from a
  TensorBoard log, ``val_loss`` from Keras or Lightning, ``eval_loss`` from Hugging
  Face, ``Accuracy/test``), and none is one of :data:`TRAIN_WORDS` (``train/val_ratio``
  is a training metric);
* **logged at an evaluation cadence** (``run.log(step, val_loss=...)`` every N steps
  under any name): in every reference seed, at least 2 and at most half as many steps
  as the seed's most frequently logged metric, at a regular interval (most gaps between
  its steps equal, at least 2 steps), with values that differ between seeds (a schedule
  every seed logs identically is not a measurement).  Never a gradient norm, an
  optimizer metric (``opt/``: a learning-rate schedule), the training loss, a counter,
  a system or performance metric.

:func:`evaluation_metrics` says which rule took each metric; calibrate writes that in the
file's notes.  Its counterpart, :func:`training_loss`, names the training loss when it is
not called ``loss`` (``train/loss`` from a TensorBoard log), for the L0 check that every
loss value is finite.  Pure functions over loaded runs; nothing here reads a store.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.comparison import RunData
from refrun.comparison.divergence import is_parameter_metric

Why = Literal["logged with log_eval", "declared with --eval-metric", "named as one",
              "evaluation cadence"]
EVAL_WORDS = frozenset({"eval", "evaluation", "val", "valid", "validation", "test",
                        "dev", "holdout"})
"""Words that name an evaluation split in the metric names of trainers and tools."""
TRAIN_WORDS = frozenset({"train", "training"})
NOT_EVALUATIONS = (schema.SYS_PREFIX, "perf/", schema.OPT_PREFIX, schema.PROGRESS_PREFIX,
                   *schema.COUNTER_PREFIXES)
"""Prefixes of metrics that are never an evaluation, whatever their cadence or words."""
TIMED = (schema.SYS_PREFIX, "perf/")  # sampled by time, not by step: no measure of density
MIN_REGULAR = 0.5  # share of an evaluation's step gaps equal to its most common gap
_SPLIT = re.compile(r"[/_.\-\s]+")


def words(metric: str) -> set[str]:
    """The lower-cased words of a metric name (split at ``/ _ . -`` and spaces)."""
    return {w for w in _SPLIT.split(metric.lower()) if w}


def named_as_evaluation(metric: str) -> bool:
    """A name that says evaluation (see the module docstring)."""
    w = words(metric)
    return bool(w & EVAL_WORDS) and not w & TRAIN_WORDS


def never_evaluation(metric: str) -> bool:
    """Training-side metrics no rule takes: system, performance, optimizer, progress and
    counter metrics, gradient norms, the training loss, a name with a training word
    (``train/accuracy`` every 10 steps is a training metric logged sparsely)."""
    return (metric.startswith(NOT_EVALUATIONS) or metric == schema.M_LOSS
            or is_parameter_metric(metric) or metric.rsplit("/", 1)[-1] == "grad_norm"
            or bool(words(metric) & TRAIN_WORDS))


def _steps(run: RunData, metric: str, keep: str) -> np.ndarray:
    r = rv.resolved(run, metric, keep)
    return np.asarray(rv.finite(r).steps) if r is not None else np.array([], np.int64)


def regular(steps: np.ndarray) -> bool:
    """Steps at a regular interval of at least 2: most gaps equal to the commonest."""
    gaps = np.diff(np.unique(steps))
    if not len(gaps):
        return False
    values, counts = np.unique(gaps, return_counts=True)
    common = values[np.argmax(counts)]
    return bool(common >= 2 and counts.max() >= MIN_REGULAR * len(gaps))


def at_evaluation_cadence(runs: Sequence[RunData], metric: str, densest: Mapping[str, int],
                          keep: str) -> bool:
    """In every run: 2 <= points <= half its densest metric's, at a regular interval, and
    values that differ between runs at the steps they share."""
    series = []
    for r in runs:
        steps = _steps(r, metric, keep)
        n = len(np.unique(steps))
        if n < 2 or 2 * n > densest[r.run_id] or not regular(steps):
            return False
        series.append(rv.finite(rv.resolved(r, metric, keep)))  # type: ignore[arg-type]
    shared = series[0].steps
    for s in series[1:]:
        shared = np.intersect1d(shared, s.steps)
    if not len(shared):
        return False
    rows = [s.values[np.searchsorted(s.steps, shared)] for s in series]
    return not all(np.array_equal(rows[0], row, equal_nan=True) for row in rows[1:])


def evaluation_metrics(runs: Sequence[RunData], metrics: Collection[str], *,
                       declared: Collection[str] = (), keep: str = "last"
                       ) -> dict[str, Why]:
    """Which of ``metrics`` (shared by every run of ``runs``) are evaluation series, and
    the rule that took each (in the order of the module docstring)."""
    stepped = [m for m in metrics if not m.startswith(TIMED)]
    densest = {r.run_id: max((len(np.unique(_steps(r, m, keep))) for m in stepped),
                             default=0) for r in runs}
    out: dict[str, Why] = {}
    for m in sorted(metrics):
        if m.startswith(schema.EVAL_PREFIX):
            out[m] = "logged with log_eval"
        elif m in declared:
            out[m] = "declared with --eval-metric"
        elif never_evaluation(m):
            continue
        elif named_as_evaluation(m):
            out[m] = "named as one"
        elif at_evaluation_cadence(runs, m, densest, keep):
            out[m] = "evaluation cadence"
    return out


def note(found: Mapping[str, Why]) -> str | None:
    """The calibration note saying which metrics were taken as evaluations, and why."""
    if not found:
        return None
    by: dict[str, list[str]] = {}
    for m, why in found.items():
        by.setdefault(why, []).append(m)
    parts = [f"{', '.join(ms)} ({why})" for why, ms in by.items()]
    return ("evaluation metrics, each judged at L3 by its final evaluation (no final-window "
            "closeness): " + "; ".join(parts))


def training_loss(metrics: Collection[str]) -> str | None:
    """The training loss among ``metrics`` when none is called ``loss``: the one metric
    whose words include ``loss`` and a training word (``train/loss``, ``train_loss``,
    ``loss/train``), else the one whose words include ``loss`` and that is no evaluation
    and no other kind of metric (``total_loss``); None when there is ``loss``, or no such
    metric, or several (the file keeps the default ``loss`` and its L0 check says so)."""
    if schema.M_LOSS in metrics:
        return None
    losses = [m for m in metrics if "loss" in words(m) and not m.startswith(NOT_EVALUATIONS)
              and not m.startswith(schema.EVAL_PREFIX) and not named_as_evaluation(m)]
    trained = [m for m in losses if words(m) & TRAIN_WORDS]
    pick = trained if trained else losses
    return pick[0] if len(pick) == 1 else None
