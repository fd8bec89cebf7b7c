"""Durability: a real `mlflow server` that dies and comes back, a SIGKILLed training
process, and re-delivery that must not duplicate."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import refrun
from refrun import schema
from refrun.recording import delivery
from refrun.recording.spool import Cursor, Spool, list_spools
from refrun.recording.sync import sync_all
from refrun.store.curves import read_curves
from tests.conftest import MlflowServer, free_port

pytestmark = pytest.mark.server


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delivery tries a store that failed at least every second
    (``$REFRUN_DELIVERY_RETRY_MAX_S=1``, default 30 s): a test that brings the store back
    after the trainer closed waits for the background delivery to resume, which the default
    back-off, doubling while the server restarts, put off by ~6 s."""
    monkeypatch.setenv("REFRUN_DELIVERY_RETRY_MAX_S", "1")


def _loop(run, steps: int, on_step=None, sleep_s: float = 0.01) -> list[float]:
    durations = []
    for step in range(steps):
        t0 = time.perf_counter()
        run.log(step, loss=1.0 / (step + 1), lr=0.1)
        time.sleep(sleep_s)  # stands in for a training step
        durations.append(time.perf_counter() - t0 - sleep_s)
        if on_step:
            on_step(step)
    return durations


def _assert_exactly_once(client: MlflowClient, run_id: str, steps: int) -> None:
    for key in ("loss", "lr"):
        history = client.get_metric_history(run_id, key)
        got = sorted(m.step for m in history)
        assert got == list(range(steps)), f"{key}: {len(got)} points for {steps} steps"
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert all(loss[s] == 1.0 / (s + 1) for s in range(steps))


def test_server_killed_mid_run_and_restarted(mlflow_server, tmp_path):
    restarted = threading.Event()

    def warned() -> bool:
        return any("unreachable" in w["message"] for w in run.warnings)

    def restart() -> None:
        # The operator restarts the server once the run has seen it gone: on a busy
        # machine the delivery process (lower priority than training) may not try the
        # store again within a fixed number of steps.  No warning: restarted anyway, and
        # the assertion below fails.
        with contextlib.suppress(AssertionError):
            wait_for(warned, "the run to warn that the store is unreachable", timeout=120)
        mlflow_server.start()
        restarted.set()

    def chaos(step: int) -> None:
        if step == 80:
            mlflow_server.kill()
        if step == 160:  # restart off the training thread, as an operator would
            threading.Thread(target=restart, daemon=True).start()

    with refrun.start_run(workload="durable", role="candidate", tracking_uri=mlflow_server.url,
                          spool_dir=tmp_path / "spool", flush_interval_s=0.1) as run:
        durations = _loop(run, 400, chaos)
        assert restarted.wait(300)
        offline_warned = warned()
    assert offline_warned
    # The logging call never waited on the dead server: no stall anywhere in the loop.
    # A call that waited on the store would take seconds (connection refused, restart).
    assert max(durations) < 0.5, f"slowest log call {max(durations):.3f} s"
    client = MlflowClient(mlflow_server.url)
    _assert_exactly_once(client, run.run_id, 400)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(run.run_id, schema.ARTIFACT_DIR)}
    assert schema.ARTIFACT_CURVES in arts


def test_server_unreachable_at_start(tmp_path):
    server = MlflowServer(tmp_path, free_port())
    (tmp_path / "artifacts").mkdir()
    t0 = time.perf_counter()
    run = refrun.start_run(workload="late", role="reference", tracking_uri=server.url,
                           spool_dir=tmp_path / "spool", flush_interval_s=0.1)
    assert time.perf_counter() - t0 < 10  # started without the store
    assert run.run_id is None
    try:
        _loop(run, 50, sleep_s=0.0)
        server.start()
        assert run.close() is True
        assert run.run_id is not None
        _assert_exactly_once(MlflowClient(server.url), run.run_id, 50)
    finally:
        server.kill()


def test_close_with_server_down_thread_delivery_leaves_spool_for_sync(tmp_path):
    server = MlflowServer(tmp_path, free_port())
    server.start()
    try:
        run = refrun.start_run(workload="w", role="candidate", tracking_uri=server.url,
                               spool_dir=tmp_path / "spool", flush_interval_s=0.05,
                               delivery="thread")
        _loop(run, 30, sleep_s=0.0)
        server.kill()
        assert run.close() is False  # not delivered, nothing lost
        assert run.spool.path.exists()
        server.start()
        results = sync_all(tmp_path / "spool")
        assert [r.outcome for r in results] == ["delivered"]
        client = MlflowClient(server.url)
        _assert_exactly_once(client, run.run_id, 30)
        assert client.get_run(run.run_id).info.status == "FINISHED"
        assert not run.spool.path.exists()  # pruned once delivered
        assert sync_all(tmp_path / "spool") == []
    finally:
        server.kill()


@pytest.mark.usefixtures("quick_retries")
def test_close_with_server_down_delivery_process_finishes_later(tmp_path):
    server = MlflowServer(tmp_path, free_port())
    server.start()
    try:
        run = refrun.start_run(workload="w", role="candidate", tracking_uri=server.url,
                               spool_dir=tmp_path / "spool", flush_interval_s=0.05)
        _loop(run, 30, sleep_s=0.0)
        server.kill()
        run.close_timeout_s = 3
        assert run.close() is False  # the delivery process goes on in the background
        assert [r.outcome for r in sync_all(tmp_path / "spool")] == ["live"]
        server.start()
        client = MlflowClient(server.url)
        _wait_for_status(client, run.run_id, "FINISHED")
        _assert_exactly_once(client, run.run_id, 30)
    finally:
        server.kill()


def test_the_retry_cap_setting_caps_the_back_off(monkeypatch) -> None:
    from refrun.errors import RefrunInputError
    from refrun.settings import DEFAULT_DELIVERY_RETRY_MAX_S, settings

    monkeypatch.delenv("REFRUN_DELIVERY_RETRY_MAX_S", raising=False)
    backoff = delivery.Backoff()
    assert [backoff.failed() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert DEFAULT_DELIVERY_RETRY_MAX_S == 30
    monkeypatch.setenv("REFRUN_DELIVERY_RETRY_MAX_S", "2.5")
    backoff = delivery.Backoff(first_s=0.5)
    assert [backoff.failed() for _ in range(5)] == [0.5, 1, 2, 2.5, 2.5]
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("REFRUN_DELIVERY_RETRY_MAX_S", bad)
        with pytest.raises(RefrunInputError, match="REFRUN_DELIVERY_RETRY_MAX_S"):
            settings()  # refused where the run starts


def _wait_for_status(client: MlflowClient, run_id: str, status: str, timeout: float = 300):
    wait_for(lambda: client.get_run(run_id).info.status == status,
             f"run {run_id} to reach {status}", timeout, every=0.5)


SIGKILL_SCRIPT = textwrap.dedent("""
    import sys, time, refrun
    run = refrun.start_run(workload="killed", role="candidate", flush_interval_s=0.2)
    print(run.run_id, run.spool.path, flush=True)
    for step in range(int(sys.argv[1])):
        run.log(step, loss=1.0 / (step + 1), lr=0.1)
    print("LOGGED", flush=True)
    time.sleep(600)
""")


def wait_for(condition, what: str, timeout: float = 180.0, every: float = 0.1):
    """Poll ``condition`` until it returns a true value; generous deadline, no fixed sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _spooled_lines(spool: Path) -> int:
    with contextlib.suppress(OSError):
        return (spool / "points.tsv").read_bytes().count(b"\n")
    return 0


def _start_and_sigkill(store, tmp_path) -> tuple[str, Path, dict]:
    script = tmp_path / "train.py"
    script.write_text(SIGKILL_SCRIPT)
    env = {**os.environ, "REFRUN_SPOOL_DIR": str(store.spool_dir),
           "MLFLOW_TRACKING_URI": store.tracking_uri}
    proc = subprocess.Popen([sys.executable, str(script), "3000"], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    run_id, spool = proc.stdout.readline().split()
    assert proc.stdout.readline().strip() == "LOGGED"
    # Everything accepted is in the spool (2 metrics x 3000 steps) before the kill.
    wait_for(lambda: _spooled_lines(Path(spool)) == 6000, "the spool to hold every point")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return run_id, Path(spool), env


def _assert_killed_run_complete(client: MlflowClient, run_id: str, tmp: Path) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags[schema.TAG_STEPS_COUNT] == "3000"
    # The curves artifact holds every point, exactly once.
    path = client.download_artifacts(run_id, schema.ARTIFACT_CURVES, str(tmp))
    curves = read_curves(Path(path))
    for key in ("loss", "lr"):
        assert sorted(curves.loc[curves.metric == key, "step"]) == list(range(3000))
    # MLflow holds the bounded view: no duplicate, the first 1000 steps, the last step.
    for key in ("loss", "lr"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: duplicates"
        assert set(range(1000)) <= set(steps) and 2999 in steps
    # The end time is the last point's, not the time of the delivery after the kill.
    assert run.info.end_time <= int(curves["timestamp_ms"].max()) + 1


def test_sigkilled_trainer_is_finished_by_its_delivery_process(store, tmp_path):
    run_id, spool, _ = _start_and_sigkill(store, tmp_path)
    client = store.client()
    _wait_for_status(client, run_id, "KILLED")
    _assert_killed_run_complete(client, run_id, tmp_path / "dl")
    # The delivered spool's bulk is freed by the delivery process (no trainer is left to
    # remove it); its small metadata goes with the next `refrun sync`.
    wait_for(lambda: not (spool / "points.tsv").exists(), "the delivered spool to be freed")
    assert not (spool / "artifacts").exists()


def test_sigkill_of_trainer_and_delivery_then_refrun_sync(store, tmp_path):
    run_id, spool, env = _start_and_sigkill(store, tmp_path)
    # Lose the delivery process too (a node or container going away).  Its pid is in the
    # spool before start_run returns: the session starts it and records it.
    pid = json.loads((spool / "meta.json").read_text())["delivery_pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: delivery.owner(Spool(spool)) is None, "the spool to have no owner")
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    # Delivered by sync, or (when it won the race with the kill) by the delivery process.
    assert "delivered" in out.stdout or "complete" in out.stdout, out.stdout
    _assert_killed_run_complete(store.client(), run_id, tmp_path / "dl")
    assert not spool.exists()


def test_redelivery_after_crash_between_send_and_cursor_is_not_duplicated(store):
    run = refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                           delivery="thread")
    for step in range(2500):
        run.log(step, loss=float(step))
    run._writer.stop()  # everything is in the spool and (partly) delivered
    spool = list_spools(store.spool_dir)[0]
    client = store.client()
    run_id = delivery.ensure_run(spool)
    delivery.deliver_points(spool, client, run_id)
    assert spool.read_cursor().lines == 2500
    first = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert set(range(1000)) <= set(first)  # the view: all of the first 1000, then buckets
    # A crash after log_batch but before the cursor was written: send it all again.
    spool.write_cursor(Cursor())
    delivery.deliver_points(spool, client, run_id)
    again = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert again == first  # nothing twice
    assert run.close() is True
    final = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert len(final) == len(set(final)) and 2499 in final
