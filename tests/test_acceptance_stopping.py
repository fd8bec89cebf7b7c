"""Stopping rules on a partial (RUNNING) run: the projected time and cost follow from the
known step times; smoke and no-progress rules say "investigate", never reject; the
in-loop Watcher evaluates without blocking and records a warning."""

from __future__ import annotations

import time

import numpy as np
import pytest
from acceptance_helpers import base_loss, error_line, record, write_criteria
from mlflow.tracking import MlflowClient

import refrun
from refrun.acceptance import Watcher, evaluate_stopping, load_criteria
from refrun.cli import main
from refrun.comparison import load_run

RULES = """
[settings]
warmup_steps = 10

[prices.hourly]
tpu-v5e = 1.20

[[stopping]]
id = "budget"
kind = "budget"
max_hours = 0.1
max_cost = 0.1
min_steps = 20

[[stopping]]
id = "smoke"
kind = "smoke"
metric = "loss"
abs_tol = 0.1
min_fraction = 0.9
min_steps = 20

[[stopping]]
id = "stall"
kind = "no_progress"
after_hours = 0.5
stall_minutes = 5
"""

DONE, PLANNED = 100, 1000


def _step_times() -> np.ndarray:
    t = 0.5 + 0.01 * (np.arange(DONE) % 7)
    t[:10] = 5.0  # compilation during warm-up: must not enter the median
    return t


def _wait_for(client: MlflowClient, run_id: str, key: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(client.get_metric_history(run_id, key)) < n:
        assert time.monotonic() < deadline, "points not delivered"
        time.sleep(0.2)


@pytest.fixture
def partial(store):
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": base_loss()})
    run = refrun.start_run("accept-test", "candidate", hardware="tpu-v5e", backend="torch",
                           planned_steps=PLANNED, tracking_uri=store.tracking_uri,
                           spool_dir=store.spool_dir, flush_interval_s=0.1,
                           snapshot_environment=False)
    times = _step_times()
    loss = base_loss()[:DONE] + np.where(np.arange(DONE) >= 50, 0.5, 0.0)
    for i in range(DONE):
        run.log_metrics(i, {"loss": float(loss[i]), "perf/step_time_s": float(times[i])})
    _wait_for(MlflowClient(store.tracking_uri), run.run_id, "perf/step_time_s", DONE)
    yield run, ref, times
    run.close()


def test_budget_projection_on_partial_run(store, partial, tmp_path) -> None:
    run, ref, times = partial
    crit = load_criteria(write_criteria(tmp_path, RULES))
    rd = load_run(run.run_id, tracking_uri=store.tracking_uri, progress=False,
                  allow_partial=True)
    assert rd.status == "RUNNING"
    start = MlflowClient(store.tracking_uri).get_run(run.run_id).info.start_time
    now = start + 90_000  # 90 s after the start
    report = evaluate_stopping(crit, rd, [load_run(ref.run_id, progress=False)], now_ms=now)
    b = next(f for f in report.findings if f.id == "budget")
    per_step = float(np.median(times[10:]))  # steps >= warm-up end (first step 0 + 10)
    projected = 90.0 + (PLANNED - DONE) * per_step
    assert b.evidence["per_step_s"] == pytest.approx(per_step)
    assert b.evidence["remaining_steps"] == PLANNED - DONE
    assert b.evidence["projected_total_s"] == pytest.approx(projected)
    assert b.evidence["projected_cost"] == pytest.approx(projected / 3600 * 1.20)
    assert b.outcome == "investigate"  # 0.15 h > 0.1 h budget
    # A budget the projection fits in says continue.
    crit2 = load_criteria(write_criteria(tmp_path, RULES.replace("max_hours = 0.1",
                                                                 "max_hours = 1.0")
                                         .replace("max_cost = 0.1", "max_cost = 1.0")))
    b2 = next(f for f in evaluate_stopping(crit2, rd, [], now_ms=now).findings
              if f.id == "budget")
    assert b2.outcome == "continue"
    smoke = next(f for f in report.findings if f.id == "smoke")
    assert smoke.outcome == "investigate"
    assert smoke.evidence["fraction_within"] == pytest.approx(0.5)  # steps 50..99 are off
    assert smoke.evidence["first_step_outside"] == 50
    stall = next(f for f in report.findings if f.id == "stall")
    assert stall.outcome == "continue"
    late = evaluate_stopping(crit, rd, [], now_ms=start + 3_600_000)
    stall = next(f for f in late.findings if f.id == "stall")
    assert stall.outcome == "investigate" and "L0 not reached" in stall.reason
    assert "no new point" in stall.reason


def test_watch_cli_once(store, partial, tmp_path, capsys) -> None:
    run, ref, _ = partial
    crit = write_criteria(tmp_path, RULES)
    rc = main(["watch", "--criteria", str(crit), "--run", run.run_id, "--reference",
               ref.run_id, "--once", "--json", str(tmp_path / "w.json")])
    assert rc == 1
    out = capsys.readouterr().out
    assert "INVESTIGATE" in out and "smoke" in out
    assert "reject" not in out.lower()
    # The workload rule of accept/compare/report: a criteria file for another workload is
    # refused before any check (one line, exit 2), unless --allow-cross-workload.
    other = write_criteria(tmp_path, 'workload = "other-wl"\n' + RULES, "other.toml")
    args = ["watch", "--criteria", str(other), "--run", run.run_id, "--reference",
            ref.run_id, "--once"]
    assert main(args) == 2
    cap = capsys.readouterr()
    assert "INVESTIGATE" not in cap.out
    line = error_line(cap.err)
    assert f"candidate {run.run_id} is workload 'accept-test'" in line
    assert f"criteria file {other} is for 'other-wl'" in line
    assert main([*args, "--allow-cross-workload"]) == 1
    out = capsys.readouterr().out
    assert "note: cross-workload (" in out and "INVESTIGATE" in out


def test_watcher_inside_the_loop(store, tmp_path) -> None:
    crit = load_criteria(write_criteria(tmp_path, RULES))
    ref = record(store.tracking_uri, store.spool_dir, "reference", {"loss": base_loss()})
    with refrun.start_run("accept-test", "candidate", hardware="tpu-v5e", planned_steps=PLANNED,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          flush_interval_s=0.05, snapshot_environment=False) as run:
        watcher = Watcher(crit, run, references=[ref.run_id], every_s=0.0)
        for i in range(60):
            run.log_metrics(i, {"loss": float(base_loss()[i] + (1.0 if i >= 30 else 0.0))})
        time.sleep(0.3)  # let the writer spool the points
        watcher.check()
        report = watcher.wait(60)
        assert watcher.error is None
        assert report is not None and [f.id for f in report.investigate] == ["smoke"]
        assert any("stopping rule 'smoke' says investigate" in w["message"]
                   for w in run.warnings)
    assert run.status == "FINISHED"  # never stopped by the watcher
