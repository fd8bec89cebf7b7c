"""The bounded, spike-preserving view of a live run's metrics that goes to MLflow.

The run's ``refrun/curves.parquet`` artifact keeps every point; readers must use it.
MLflow's metric history only gets a view whose size grows with the logarithm of the run's
length, so delivery cost stops growing with it.  Per metric, in logging order:

* the first ``BUDGET`` (1,000) points are all sent;
* after that the points fall in *levels*: level ``L = 1, 2, ...`` holds the next
  ``BUDGET * 2**(L-1)`` points, cut into ``BUCKETS_PER_LEVEL`` (125) consecutive buckets
  (8, 16, 32 ... points: the bucket size doubles every level).  Of each bucket the view
  keeps the first point, the smallest and the largest finite value and the first
  non-finite value — the per-bucket rule of :func:`refrun.util.thinning.minmax_indices`,
  computed here as a stream because the points arrive a batch at a time and the state
  must fit in the delivery cursor;
* at the end of the run (:func:`owed_at_end`) the open bucket's extremes and the metric's
  last point.

So a metric of ``n > BUDGET`` points shows at most ``BUDGET + 4 * 125 * ceil(log2(n /
BUDGET)) + 1`` points (≈ 6,000 for a million), every spike and NaN among them.
Evaluation metrics (``eval/...``) are rare and always sent in full.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from refrun import schema
from refrun.recording.spool import Point

BUDGET = 1000
BUCKETS_PER_LEVEL = 125

Sample = tuple[int, int, float]  # step, timestamp_ms, value


def bucket_of(ordinal: int) -> tuple[int, int, int]:
    """``(level, offset in level, bucket size)`` of a metric's ``ordinal``-th point
    (0-based, ``ordinal >= BUDGET``).  Level ``L`` starts at ``BUDGET * 2**(L-1)``."""
    level = (ordinal // BUDGET).bit_length()
    start = BUDGET << (level - 1)
    return level, ordinal - start, max(1, start // BUCKETS_PER_LEVEL)


@dataclass(slots=True)
class MetricView:
    """Streaming state of one metric's view (kept in the delivery cursor as JSON)."""

    n: int = 0
    """Points of this metric seen so far."""
    lo: tuple[int, Sample] | None = None
    """(ordinal, sample) of the open bucket's smallest finite value."""
    hi: tuple[int, Sample] | None = None
    first: int = -1
    """Ordinal of the open bucket's first point (already sent)."""
    nonfinite_sent: bool = False
    last: tuple[int, Sample] | None = None
    last_sent: bool = True

    def add(self, sample: Sample) -> list[Sample]:
        """Take the next point; returns the samples to send now."""
        i = self.n
        self.n += 1
        self.last = (i, sample)
        if i < BUDGET:
            self.last_sent = True
            return [sample]
        _, offset, size = bucket_of(i)
        out: list[Sample] = []
        finite = math.isfinite(sample[2])
        if offset % size == 0:  # a new bucket: its first point goes at once
            self.first, self.lo, self.hi = i, None, None
            self.nonfinite_sent = not finite
            out.append(sample)
        elif not finite and not self.nonfinite_sent:
            self.nonfinite_sent = True
            out.append(sample)
        if finite:
            if self.lo is None or sample[2] < self.lo[1][2]:
                self.lo = (i, sample)
            if self.hi is None or sample[2] > self.hi[1][2]:
                self.hi = (i, sample)
        self.last_sent = bool(out)
        if offset % size == size - 1:  # the bucket is complete
            out.extend(self._close_bucket(i))
        return out

    def _close_bucket(self, current: int) -> list[Sample]:
        out: list[Sample] = []
        sent = {self.first}
        for ext in (self.lo, self.hi):
            if ext is not None and ext[0] not in sent:
                sent.add(ext[0])
                out.append(ext[1])
                if ext[0] == current:
                    self.last_sent = True
        if current in sent:
            self.last_sent = True
        self.lo = self.hi = None
        return out

    def owed_at_end(self) -> list[Sample]:
        """End of the run: the open bucket's extremes and the last point, once."""
        if self.last is None:
            return []
        out = self._close_bucket(self.last[0]) if self.n > BUDGET else []
        if not self.last_sent:
            out.append(self.last[1])
            self.last_sent = True
        return out

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> MetricView:
        v = cls(**raw)
        v.lo = _sample_pair(v.lo)
        v.hi = _sample_pair(v.hi)
        v.last = _sample_pair(v.last)
        return v


def _sample_pair(raw: object) -> tuple[int, Sample] | None:
    if raw is None:
        return None
    i, (step, ts, value) = raw  # type: ignore[misc]  # JSON lists from to_json
    return int(i), (int(step), int(ts), float(value))


def always_sent(key: str) -> bool:
    """Metrics the view never reduces (evaluation points are rare and each one matters)."""
    return key.startswith(schema.EVAL_PREFIX)


def select(points: list[Point], state: dict[str, dict], every: int = 1) -> list[Point]:
    """The points of one delivery batch that go to MLflow; updates ``state`` (JSON-able,
    per metric) in place.  ``every`` > 1 first keeps only steps divisible by it (the older
    ``mlflow_every`` thinning; evaluation metrics excepted)."""
    out: list[Point] = []
    views: dict[str, MetricView] = {}
    for key, step, ts, value in points:
        if always_sent(key):
            out.append((key, step, ts, value))
            continue
        if every > 1 and step % every:
            continue
        v = views.get(key)
        if v is None:
            raw = state.get(key)
            v = views[key] = MetricView.from_json(raw) if raw else MetricView()
        out.extend((key, s, t, x) for s, t, x in v.add((step, ts, value)))
    for key, v in views.items():
        state[key] = v.to_json()
    return out


def owed_at_end(state: dict[str, dict]) -> list[Point]:
    """The points still owed to the view at the end of the run; updates ``state``."""
    out: list[Point] = []
    for key, raw in state.items():
        v = MetricView.from_json(raw)
        out.extend((key, s, t, x) for s, t, x in v.owed_at_end())
        state[key] = v.to_json()
    return out
