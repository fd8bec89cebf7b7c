"""Loading runs: artifact fast path, metric-history fallback, and queries by identity tags."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mlflow.entities import Metric

from refrun import start_run
from refrun.comparison import compare, find_run_ids, load_query, load_run
from refrun.errors import RefrunInputError


def test_session_run_loads_from_artifact_with_repeats(store) -> None:
    with start_run("wl", "reference", hardware="cpu", backend="torch", seed=1,
                   tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                   snapshot_environment=False) as run:
        for s in range(10):
            run.log(s, loss=1.0 / (s + 1))
        for s in range(5, 10):  # restart from a checkpoint at step 5
            run.log(s, loss=2.0)
        run.log(10, loss=float("nan"))
    data = load_run(run.run_id, tracking_uri=store.tracking_uri)
    assert data.source == "artifact" and data.status == "FINISHED" and data.seed == "1"
    assert data.start_time_ms is not None and data.end_time_ms is not None
    assert len(data.curves) == 16 and data.metric_names == ["loss"]
    assert find_run_ids("wl", "reference", hardware="cpu", seed=1,
                        tracking_uri=store.tracking_uri) == [run.run_id]
    assert find_run_ids("wl", "candidate", tracking_uri=store.tracking_uri) == []
    with pytest.raises(RefrunInputError, match="no runs match"):
        load_query("wl", "candidate", tracking_uri=store.tracking_uri)
    (again,) = load_query("wl", "reference", tracking_uri=store.tracking_uri)
    cmp = compare(again, again)
    rep = cmp.metrics["loss"].alignment.candidate
    assert rep.repeated_ranges == [[5, 9, 5]] and rep.nan == 1
    assert cmp.metrics["loss"].measures.n == 10


def test_metric_history_fallback_without_artifact(store) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.tracking_uri)
    exp = client.create_experiment("plain")
    rid = client.create_run(exp, tags={"refrun.workload": "plain"}).info.run_id
    vals = np.linspace(3, 1, 50)
    client.log_batch(rid, metrics=[Metric("loss", float(v), 1000 + i, i)
                                   for i, v in enumerate(vals)])
    client.log_batch(rid, metrics=[Metric("loss", 9.0, 5000, 3)])  # a later repeat of step 3
    data = load_run(rid, tracking_uri=store.tracking_uri, progress=False)
    assert data.source == "history" and len(data.curves) == 51
    s = compare(data, data).metrics["loss"]
    assert s.alignment.candidate.repeated_steps == 1
    assert s.frame.loc[s.frame.step == 3, "reference"].item() == 9.0  # last (by time) wins
    assert math.isclose(s.frame["reference"].iloc[-1], 1.0)


def test_comparison_and_importers_never_import_a_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, refrun.comparison, refrun.importers, refrun.cli.compare, "
            "refrun.cli.imports; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'torch_xla', 'jax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "[]"
