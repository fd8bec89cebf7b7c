"""Loading runs: artifact fast path, metric-history fallback, and queries by identity tags."""

from __future__ import annotations

import io
import json
import math
import sys
import threading

import numpy as np
import pytest
from mlflow.entities import Metric

from refrun import start_run
from refrun.cli import main
from refrun.comparison import compare, find_run_ids, load_query, load_run
from refrun.errors import RefrunInputError
from refrun.importers import import_csv


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
    client.set_terminated(rid, "FINISHED")
    data = load_run(rid, tracking_uri=store.tracking_uri, progress=False)
    assert data.source == "history" and len(data.curves) == 51
    assert data.points_from.startswith("MLflow metric history: 51 points (no curves artifact")
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


def _plain_run(client, name: str, values: list[float], status: str | None) -> str:
    """A run written with MLflow alone (no curves artifact), left in ``status``."""
    exp = client.create_experiment(name)
    rid = client.create_run(exp, tags={"refrun.workload": name}).info.run_id
    client.log_batch(rid, metrics=[Metric("loss", v, 1000 + i, i) for i, v in enumerate(values)])
    if status is not None:
        client.set_terminated(rid, status)
    return rid


class _Tee(io.StringIO):
    """stderr that also signals when refrun starts waiting (so the test acts then)."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event

    def write(self, text: str) -> int:
        if "waiting for run" in text:
            self.event.set()
        return super().write(text)


def test_running_run_is_waited_for_then_refused_and_accepted_once_finished(
        store, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.tracking_uri)
    ref = _plain_run(client, "ref", [3.0, 2.0, 1.0], "FINISHED")
    live = _plain_run(client, "live", [3.0, 2.5], None)  # still RUNNING
    failed = _plain_run(client, "dead", [3.0], "FAILED")  # ended early, no artifact
    for rid, why in ((live, "is RUNNING"), (failed, "is FAILED and has no curves artifact")):
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        rc = main(["compare", "--reference", ref, "--candidate", rid, "--wait", "0.5",
                   "--no-record", "--tracking-uri", store.tracking_uri])
        lines = err.getvalue().strip().splitlines()
        assert rc == 2, lines
        assert lines[0].startswith(f"refrun: waiting for run {rid}")  # progress first
        assert lines[-1].startswith("refrun compare: error: ") and why in lines[-1]
        assert "refused after waiting 0.5 s" in lines[-1]
    with pytest.raises(RefrunInputError, match="is RUNNING"):
        load_run(live, tracking_uri=store.tracking_uri, wait_s=0)
    # watching a run in progress reads it as it is
    assert load_run(live, tracking_uri=store.tracking_uri, allow_partial=True).points == 2
    # A run that finishes while refrun waits is compared, with every point it has.
    started = threading.Event()

    def finish() -> None:
        if started.wait(120):
            client.log_batch(live, metrics=[Metric("loss", 1.5, 3000, 2)])
            client.set_terminated(live, "FINISHED")

    monkeypatch.setattr(sys, "stderr", _Tee(started))
    t = threading.Thread(target=finish)
    t.start()
    try:
        cmp = compare(ref, live, tracking_uri=store.tracking_uri, progress=False)
    finally:
        started.set()
        t.join(120)
    assert started.is_set() and cmp.candidate.status == "FINISHED"
    assert cmp.metrics["loss"].alignment.aligned_steps == 3
    doc = cmp.to_dict()
    assert doc["candidate"]["source"] == "history" and doc["candidate"]["points"] == 3
    assert "no curves artifact" in doc["candidate"]["points_from"]


def test_infinite_values_read_from_history_stay_infinite(store, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.tracking_uri)
    values = [2.0, math.inf, -math.inf, math.nan, 1.0]
    rid = _plain_run(client, "inf", values, "FINISHED")
    # MLflow itself hands back float max for inf: the store keeps no inf.
    raw = [m.value for m in client.get_metric_history(rid, "loss")]
    assert raw[1] == np.finfo(np.float64).max
    data = load_run(rid, tracking_uri=store.tracking_uri, progress=False)
    assert data.source == "history"
    s, v, _ = data.series("loss")
    got = v[np.argsort(s)]
    assert got[1] == math.inf and got[2] == -math.inf and math.isnan(got[3])
    assert got[0] == 2.0 and got[4] == 1.0
    rep = compare(data, data).metrics["loss"].alignment.candidate
    assert (rep.posinf, rep.neginf, rep.nan) == (1, 1, 1)


def test_inf_loss_without_curves_artifact_fails_l0_finite_loss(store, tmp_path) -> None:
    """Issue 13: a candidate whose loss is inf, read from MLflow's history (no curves
    artifact), must fail L0 finite_loss through the public accept path."""
    from mlflow.tracking import MlflowClient

    steps = np.arange(20)
    loss = np.exp(-steps / 5.0)
    ref_csv = tmp_path / "ref.csv"
    ref_csv.write_text("step,loss\n" + "".join(f"{s},{v!r}\n" for s, v in
                                              zip(steps.tolist(), loss.tolist(), strict=True)))
    ref = import_csv(ref_csv, workload="infwl", role="reference", hardware="cpu",
                     tracking_uri=store.tracking_uri)
    client = MlflowClient(store.tracking_uri)
    exp = client.get_experiment_by_name("infwl").experiment_id
    tags = {"refrun.schema": "1", "refrun.workload": "infwl", "refrun.role": "candidate",
            "refrun.hardware": "tpu", "refrun.backend": "import"}
    cand = client.create_run(exp, tags=tags).info.run_id
    bad = loss.copy()
    bad[7] = math.inf
    client.log_batch(cand, metrics=[Metric("loss", float(v), 1000 + int(s), int(s))
                                    for s, v in zip(steps, bad, strict=True)])
    client.set_terminated(cand, "FINISHED")
    crit = tmp_path / "criteria.toml"
    crit.write_text('version = 1\nworkload = "infwl"\ndescription = "inf test"\n\n'
                    '[[criteria]]\nid = "goal"\nlevel = "L3"\nkind = "claim"\n'
                    'metric = "loss"\nat_least = -1e9\n')
    out = tmp_path / "a.json"
    rc = main(["accept", "--criteria", str(crit), "--reference", ref, "--candidate", cand,
               "--no-record", "--json", str(out), "--tracking-uri", store.tracking_uri])
    doc = json.loads(out.read_text())
    finite = next(r for r in doc["results"] if r["id"] == "L0.finite_loss")
    assert finite["outcome"] == "fail", finite
    assert finite["evidence"]["nonfinite_points"] == 1
    assert finite["evidence"]["first_nonfinite_step"] == 7
    assert rc == 1
