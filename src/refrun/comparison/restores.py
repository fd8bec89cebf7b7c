"""Restores: where a run logged steps it had already logged (a resume from a checkpoint
that replays them), and how each replayed value compares with the first one.

A run that reloads model, optimizer and scheduler state from a checkpoint some steps back
and trains on repeats those steps.  The curves artifact keeps every point with its
logging order (``seq``, :mod:`refrun.store.curves`), so the replay is evidence a reader
can judge without the recording stack: a faithful restore repeats what the first pass
logged (the learning rate of a schedule exactly, the loss bit for bit where the step is
deterministic), and one that lost the optimizer's moments or the scheduler's position does
not.  The comparison by step (:mod:`refrun.comparison.alignment`) keeps one value per step
(``keep``); these functions look at the points it lets go.

**Definitions** (points of one metric in logging order).  A point whose step is smaller
than the largest step logged before it starts a *restore*: the run went back.  The
restore goes on while points stay at or below that largest step (``after_step``: where
the run was interrupted) and their steps do not go back again (which starts another
restore); the first point past ``after_step`` is new ground.  A step logged several times
at the frontier (micro-batches of one optimizer step) is not a restore.  The ``k``-th
point of step ``t`` inside a restore is compared with the ``k``-th point of ``t`` logged
outside every restore: the *first pass* (for a step replayed twice, the original, never
the first replay).  A replayed point with no such counterpart is counted
(``unmatched``), not compared.

**Measures** of a restore: whether every replayed value is *identical* to the first
pass's (equal, NaN equal to NaN), the first step where one is not, and the divergence
``D(e) = max_{e' <= e} |replay - first|`` over the replayed steps in step order, ``e`` the
steps since the restore's first replayed step (a NaN against a number counts as
infinite), the shape :mod:`refrun.acceptance.paired` judges a same-seed pair by.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from refrun.comparison.loading import RunData


@dataclass(frozen=True)
class Replay:
    """One restore of one metric: the replayed points that have a first-pass value."""

    metric: str
    step: int  # the first step replayed (where the run resumed)
    after_step: int  # the largest step logged before the restore (where it was interrupted)
    seq_first: int  # logging order of the restore's first and last replayed points
    seq_last: int
    steps: np.ndarray  # int64: the replayed steps with a first-pass value, in logging order
    first: np.ndarray  # float64: the first pass's values there
    replay: np.ndarray  # float64: the replayed values
    unmatched: int = 0  # replayed points without a first-pass counterpart

    @property
    def same(self) -> np.ndarray:
        """Per compared point: the replayed value is the first one (NaN equals NaN)."""
        return (self.first == self.replay) | (np.isnan(self.first) & np.isnan(self.replay))

    @property
    def identical(self) -> bool:
        return bool(self.same.all())

    @property
    def first_difference(self) -> int | None:
        """Index (in logging order) of the first compared point that differs; None when
        identical."""
        same = self.same
        return None if same.all() else int(np.argmin(same))

    def divergence(self) -> tuple[np.ndarray, np.ndarray]:
        """``(e, D(e))``: steps since the restore and the running max of |replay - first|
        over the replayed steps in step order (see the module doc)."""
        order = np.argsort(self.steps, kind="stable")
        d = self.replay[order] - self.first[order]
        ad = np.where(self.same[order], 0.0, np.where(np.isfinite(d), np.abs(d), np.inf))
        running = np.maximum.accumulate(ad) if len(ad) else ad
        return (self.steps[order] - self.step).astype(np.int64), running.astype(float)

    @property
    def max_abs_diff(self) -> float:
        _, d = self.divergence()
        return float(d[-1]) if len(d) else 0.0


def replays(steps: np.ndarray, values: np.ndarray, seq: np.ndarray, metric: str = ""
            ) -> list[Replay]:
    """Every restore in one metric's points (``steps``, ``values``, ``seq`` in any order),
    oldest first; empty when the run never went back (see the module doc)."""
    order = np.argsort(np.asarray(seq), kind="stable")
    s = np.asarray(steps, dtype=np.int64)[order]
    v = np.asarray(values, dtype=float)[order]
    q = np.asarray(seq, dtype=np.int64)[order]
    n = len(s)
    if n < 2:
        return []
    prev_max = np.empty(n, dtype=np.int64)
    prev_max[0] = np.iinfo(np.int64).min
    prev_max[1:] = np.maximum.accumulate(s)[:-1]
    if not (s < prev_max).any():
        return []  # the usual run: nothing logged after a later step
    idx = np.arange(n)
    last_new = np.maximum.accumulate(np.where(s > prev_max, idx, -1))
    last_drop = np.maximum.accumulate(np.where(s < prev_max, idx, -1))
    replayed = last_drop > last_new
    went_back = np.r_[False, s[1:] < s[:-1]]
    starts = np.flatnonzero(replayed & (np.r_[True, ~replayed[:-1]] | went_back))
    first_pass = _first_pass(s[~replayed], v[~replayed])
    bounds = [*starts.tolist(), n]
    out = []
    for a, b in itertools.pairwise(bounds):
        stop = a + int(np.argmin(replayed[a:b])) if not replayed[a:b].all() else b
        out.append(_replay(metric, s[a:stop], v[a:stop], q[a:stop], int(prev_max[a]),
                           first_pass))
    return out


def _first_pass(steps: np.ndarray, values: np.ndarray) -> dict[int, np.ndarray]:
    """Step -> its first-pass values in logging order."""
    if not len(steps):
        return {}
    order = np.argsort(steps, kind="stable")
    s, v = steps[order], values[order]
    cuts = np.flatnonzero(np.diff(s)) + 1
    return {int(g[0]): vals for g, vals in zip(np.split(s, cuts), np.split(v, cuts),
                                               strict=True)}


def _replay(metric: str, s: np.ndarray, v: np.ndarray, q: np.ndarray, after: int,
            first_pass: dict[int, np.ndarray]) -> Replay:
    seen: dict[int, int] = {}
    keep, firsts = [], []
    for i, t in enumerate(s.tolist()):
        k = seen.get(t, 0)
        seen[t] = k + 1
        ref = first_pass.get(t)
        if ref is not None and k < len(ref):
            keep.append(i)
            firsts.append(ref[k])
    kept = np.asarray(keep, dtype=np.int64)
    return Replay(metric=metric, step=int(s[0]), after_step=after, seq_first=int(q[0]),
                  seq_last=int(q[-1]), steps=s[kept], first=np.asarray(firsts, dtype=float),
                  replay=v[kept], unmatched=len(s) - len(kept))


def run_replays(run: RunData, metric: str) -> list[Replay]:
    """:func:`replays` of ``metric`` in ``run`` (every point of its curves); empty when
    the run does not have the metric."""
    if metric not in run.metric_names:
        return []
    steps, values, seq = run.series(metric)
    return replays(steps, values, seq, metric)
