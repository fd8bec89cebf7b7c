"""The ranks of a multi-process run: which reported, their step times, the straggler measure.

A job of ``world_size > 1`` processes records one run (docs/multiprocess.md): rank 0's
curves are the run's curves; rank k > 0 adds ``refrun/ranks/rank-<k>.parquet`` (its full
curves) and ``refrun/ranks/rank-<k>.json`` (its summary) when it ends.  This module turns
those files into a :class:`JobSummary`; :mod:`refrun.comparison.loading` finds the files.
It reads no framework and writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from refrun import schema
from refrun.comparison.measures import Straggler, steady_values, straggler


@dataclass(frozen=True)
class RankData:
    """What one rank contributed: its status and its steady step times (seconds)."""

    rank: int
    status: str
    steady_step_times_s: np.ndarray = field(repr=False)
    warmup_steps: int = 0


@dataclass(frozen=True)
class JobSummary:
    """A multi-process run's ranks as loaded: ``ranks_reported`` of ``world_size`` (rank 0
    counts when the run has its curves), each rank's status, and the straggler measure over
    the ranks that have step times (None with fewer than one)."""

    job_id: str | None
    world_size: int
    ranks_reported: list[int]
    rank_status: dict[int, str]
    straggler: Straggler | None
    missing_ranks: list[int]

    @property
    def ranks_finished(self) -> int:
        """Ranks whose status is FINISHED (a killed or failed rank reported but did not)."""
        return sum(1 for s in self.rank_status.values() if s == "FINISHED")

    @property
    def complete(self) -> bool:
        """Every one of ``world_size`` ranks reported, each with step times."""
        return (not self.missing_ranks and self.straggler is not None
                and self.straggler.ranks == self.world_size)

    @property
    def reported(self) -> str:
        """``"3 of 4 ranks reported (missing: 2)"``."""
        n, w = len(self.ranks_reported), self.world_size
        miss = (f" (missing: {', '.join(map(str, self.missing_ranks))})"
                if self.missing_ranks else "")
        return f"{n} of {w} ranks reported{miss}"

    def to_dict(self) -> dict[str, object]:
        s = self.straggler
        return {"job_id": self.job_id, "world_size": self.world_size,
                "ranks_reported": self.ranks_reported, "missing_ranks": self.missing_ranks,
                "rank_status": {str(k): v for k, v in self.rank_status.items()},
                "reported": self.reported, "complete": self.complete,
                "ranks_finished": self.ranks_finished,
                "straggler": None if s is None else {
                    "ratio": s.ratio, "slowest_rank": s.slowest_rank,
                    "slowest_median_s": s.slowest_median_s,
                    "median_of_medians_s": s.median_of_medians_s, "ranks": s.ranks}}


def world_size_of(tags: Mapping[str, str]) -> int | None:
    """The job's world size from the run's ``refrun.job.world_size`` tag (None: not a
    multi-process run)."""
    raw = str(tags.get(schema.TAG_JOB_WORLD_SIZE, "")).strip()
    return int(raw) if raw.isdigit() and int(raw) > 1 else None


def curves_steady_step_times(curves: pd.DataFrame, warmup_steps: int) -> np.ndarray:
    """Finite ``perf/step_time_s`` values in step order (last value for a repeated step),
    without the first ``warmup_steps`` (compilation and cache warm-up)."""
    df = curves[curves["metric"].astype("string") == schema.M_STEP_TIME]
    df = df.sort_values("seq").drop_duplicates("step", keep="last").sort_values("step")
    steps = df["step"].to_numpy()
    warm = max(0, int(warmup_steps))  # the first ``warmup_steps`` distinct steps
    start = steps[warm] if warm < len(steps) else np.inf
    return steady_values(steps, df["value"].to_numpy(dtype=np.float64), start)


def _int(raw: object, default: int = 0) -> int:
    s = str(raw if raw is not None else "").strip()
    return int(s) if s.isdigit() else default


def job_summary(tags: Mapping[str, str], rank0_curves: pd.DataFrame | None,
                rank_files: Mapping[int, tuple[Path | None, Path | None]],
                read: Callable[[Path, list[str]], pd.DataFrame],
                run_status: str = "unknown") -> JobSummary | None:
    """The :class:`JobSummary` of a run, or None when it is not a multi-process run.

    ``rank0_curves``: rank 0's curves (at least ``perf/step_time_s``; None when the run has
    no curves artifact).  ``rank_files``: rank k -> (its curves parquet, its summary JSON),
    either None when absent.  ``read(path, metrics)`` reads a curves file.  ``run_status``:
    the run's status, which is rank 0's.  Step times of
    each rank skip that rank's own warm-up steps (tag ``refrun.perf.warmup_steps``).
    Straggler: :func:`refrun.comparison.measures.straggler` over every rank with step times.
    """
    world = world_size_of(tags)
    if world is None:
        return None
    ranks: dict[int, RankData] = {}
    if rank0_curves is not None:
        warm = _int(tags.get(schema.TAG_WARMUP_STEPS))
        ranks[0] = RankData(0, run_status, curves_steady_step_times(rank0_curves, warm), warm)
    for k, (curves_path, summary_path) in sorted(rank_files.items()):
        if curves_path is None:
            continue
        summary: dict = {}
        if summary_path is not None:
            try:
                summary = json.loads(summary_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                summary = {}
        rtags = summary.get("tags") or {}
        warm = _int(rtags.get(schema.TAG_WARMUP_STEPS))
        times = curves_steady_step_times(read(curves_path, [schema.M_STEP_TIME]), warm)
        ranks[k] = RankData(k, str(summary.get("status") or
                                   tags.get(schema.TAG_JOB_REPORTED_PREFIX + schema.rank_name(k))
                                   or "unknown"), times, warm)
    timed = {k: r.steady_step_times_s for k, r in ranks.items() if len(r.steady_step_times_s)}
    reported = sorted(ranks)
    return JobSummary(
        job_id=tags.get(schema.TAG_JOB_ID), world_size=world, ranks_reported=reported,
        rank_status={k: r.status for k, r in ranks.items()},
        straggler=straggler(timed) if timed else None,
        missing_ranks=[k for k in range(world) if k not in ranks])


def derived_points(summary: JobSummary, at_step: int) -> pd.DataFrame:
    """The job's derived values as curve rows at ``at_step`` (rank 0's last step), so that
    criteria can bound them like any metric: ``job/straggler_ratio`` (when computable),
    ``job/ranks_reported`` and ``job/ranks_finished``.  The straggler ratio only when every
    rank reported step times (:attr:`JobSummary.complete`)."""
    rows = [(schema.M_JOB_RANKS_REPORTED, float(len(summary.ranks_reported))),
            (schema.M_JOB_RANKS_FINISHED, float(summary.ranks_finished))]
    # Only over every rank: with ranks missing the slowest may be one that never reported,
    # so a bound on the ratio must not pass on what is there (not evaluable instead).
    if summary.complete:
        rows.append((schema.M_JOB_STRAGGLER, float(summary.straggler.ratio)))
    return pd.DataFrame({"metric": [r[0] for r in rows],
                         "step": np.full(len(rows), at_step, dtype=np.int64),
                         "value": np.array([r[1] for r in rows], dtype=np.float64),
                         "timestamp_ms": np.zeros(len(rows), dtype=np.int64),
                         "seq": np.zeros(len(rows), dtype=np.int64)})
