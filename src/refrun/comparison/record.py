"""Recording a comparison as an MLflow run, so the UI charts the differences by the runs.

The run has role ``comparison``, tags ``refrun.compared.reference`` (comma-separated run
ids) and ``refrun.compared.candidate``, metrics ``diff/<metric>`` (candidate - reference,
metric units) and ``reldiff/<metric>`` at every aligned step, and the comparison JSON as
artifact ``refrun/comparison.json``.
"""

from __future__ import annotations

import math
import os

from refrun import schema
from refrun.comparison.engine import Comparison
from refrun.recording.session import start_run

ARTIFACT_COMPARISON = "refrun/comparison.json"


def record_comparison(comparison: Comparison, tracking_uri: str | None = None,
                      spool_dir: str | os.PathLike[str] | None = None,
                      run_name: str | None = None, mlflow_every: int | None = None) -> str | None:
    """Record ``comparison`` as a run and return its MLflow run id (None if the store was
    unreachable; the run is then spooled for ``refrun sync``).

    ``mlflow_every`` thins the per-step metrics sent to MLflow for very long runs; the
    run's curves artifact keeps every point.  Default: every step up to 10,000 aligned
    steps, beyond that every n-th step so that about 10,000 reach MLflow per metric (a
    chart cannot show more, and MLflow's metric writes cost ~0.1 ms a point).
    """
    cand = comparison.candidate
    frames = {m: mc.frame for m, mc in comparison.metrics.items()}
    total = sum(2 * len(f) for f in frames.values())
    longest = max((len(f) for f in frames.values()), default=0)
    if mlflow_every is None:
        mlflow_every = max(1, math.ceil(longest / 10_000))
    tags = {
        schema.TAG_COMPARED_REFERENCE: ",".join(comparison.reference_ids),
        schema.TAG_COMPARED_CANDIDATE: cand.run_id,
        "refrun.compared.metrics": ",".join(frames)[:5000],
    }
    ref0 = comparison.reference[0]
    name = run_name or f"compare {ref0.hardware or ref0.run_id[:8]} vs " \
                       f"{cand.hardware or cand.run_id[:8]}"
    with start_run(workload=cand.workload or ref0.workload or "comparison",
                   role="comparison", hardware=cand.hardware, backend="comparison",
                   tags=tags, run_name=name, tracking_uri=tracking_uri,
                   spool_dir=spool_dir, mlflow_every=mlflow_every,
                   max_queue=max(2_000_000, total + 1000),
                   snapshot_environment=False) as run:
        run.log_params({f"option.{k}": v for k, v in vars(comparison.options).items()})
        for metric, f in frames.items():
            dk, rk = f"diff/{metric}", f"reldiff/{metric}"
            for step, d, rd in zip(f["step"].tolist(), f["diff"].tolist(),
                                   f["reldiff"].tolist(), strict=True):
                run.log_metrics(step, {dk: d, rk: rd})
        run.log_json(ARTIFACT_COMPARISON, comparison.to_dict())
    return run.run_id
