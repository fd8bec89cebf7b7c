"""The recording path's fault handling, each with real processes and a real store:
bad names and steps refused where they enter, store refusals skipped at delivery, `sync`
handling each spool on its own, a full disk, eight trainers on a new sqlite store, a server
that never answers, and MLflow's bounded view of a long metric."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import refrun
from refrun import schema
from refrun.recording import delivery
from refrun.recording.spool import Spool, append_points, list_spools
from refrun.store.curves import read_curves
from tests.test_durability import wait_for


def _curves(client, run_id: str, tmp: Path):
    return read_curves(Path(client.download_artifacts(run_id, schema.ARTIFACT_CURVES,
                                                      str(tmp))))


def _warnings(client, run_id: str, tmp: Path) -> str:
    path = client.download_artifacts(run_id, schema.ARTIFACT_WARNINGS, str(tmp))
    return " | ".join(w["message"] for w in json.loads(Path(path).read_text())["warnings"])


# --- item 4: validation where a point enters, refusals skipped at delivery --------------
BAD_NAMES = ["a//b", "/abs", "trail/", "./dot", "a/../b", "x" * 300]


def test_names_and_steps_mlflow_refuses_are_refused_at_log(store, tmp_path):
    t0 = time.monotonic()
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        for s in range(20):
            run.log(s, loss=float(s), **{"größe/ü": 2.0 * s, "損失": -s})
        for name in BAD_NAMES:
            run.log(3, **{name: 1.0})
        run.log(2**63, loss=1.0)
        run.log(-(2**63) - 1, loss=1.0)
        run.set_tags({"ok.tag": "v", "bad//tag": "v"})
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    # 6 names + 2 steps + 1 tag key, each refused with MLflow's own reason.
    assert r.data.tags[schema.TAG_REFUSED] == "9"
    assert run.points_refused == 9
    msgs = " | ".join(w["message"] for w in run.warnings)
    assert "'a//b' would resolve to 'a/b'" in msgs
    assert "has 300 characters (MLflow's limit: 250)" in msgs
    assert "does not fit a signed 64-bit integer" in msgs
    assert "'bad//tag'" in msgs and r.data.tags["ok.tag"] == "v" and "bad//tag" not in r.data.tags
    # Non-ASCII names MLflow accepts are recorded.
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "größe/ü")) == \
        list(range(20))
    assert len(client.get_metric_history(run.run_id, "損失")) == 20
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == \
        list(range(20))
    curves = _curves(client, run.run_id, tmp_path)
    assert set(curves.metric) == {"loss", "größe/ü", "損失"}
    assert time.monotonic() - t0 < 120  # the old code blocked close() for 120 s here


def test_points_and_params_the_store_refuses_are_skipped_not_blocking(store, tmp_path):
    run = refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                           delivery="thread")
    run.log_params({"lr": 0.1})

    def first_params_delivered() -> bool:
        # log_params is queued: until the writer thread puts it into the spool's metadata,
        # the metadata's earlier version is delivered and would end this wait too early
        m = run.spool.read_meta()
        return m.params.get("lr") == "0.1" and m.tags_delivered >= m.tags_version

    wait_for(first_params_delivered, "the first params to be delivered")
    run.log_params({"lr": 0.2})  # refused at entry: params keep their first value
    assert run.points_refused == 1

    def change_behind_the_session(m) -> None:  # e.g. an older refrun, another tool
        m.params["lr"] = "0.2"
        m.tags_version += 1

    run.spool.update_meta(change_behind_the_session)  # MLflow refuses this one
    for s in range(50):
        run.log(s, loss=float(s))
    # Lines written into the spool by something other than this session's checks
    # (an older refrun, another tool): a name and a step MLflow refuses.
    fd = run.spool.open_points()
    try:
        append_points(fd, [("a//b", 7, 1, 1.0), ("loss", 2**63, 1, 1.0)])
    finally:
        os.close(fd)
    assert run.close() is True
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["lr"] == "0.1"
    assert int(r.data.tags[schema.TAG_SKIPPED]) == 3  # the param, the name, the step
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == \
        list(range(50))
    msgs = _warnings(client, run.run_id, tmp_path)
    assert "refused by the store" in msgs and "would resolve to 'a/b'" in msgs


SPOOL_SCRIPT = textwrap.dedent("""
    import os, sys, refrun
    run = refrun.start_run(workload=sys.argv[1], role="candidate", flush_interval_s=0.05,
                           delivery="thread", start_wait_s=0)
    for step in range(40):
        run.log(step, loss=float(step))
    run._writer.stop()
    print(run.spool.path, flush=True)
    os._exit(9)  # dies without closing: its spool is left for `refrun sync`
""")


def _leave_spool(tmp_path: Path, env: dict, workload: str) -> Path:
    script = tmp_path / "leave.py"
    script.write_text(SPOOL_SCRIPT)
    out = subprocess.run([sys.executable, str(script), workload], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 9, out.stderr
    return Path(out.stdout.split()[-1])


def test_sync_delivers_each_spool_on_its_own_and_names_the_failing_one(store, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store.tracking_uri,
           "REFRUN_SPOOL_DIR": str(store.spool_dir)}
    broken = _leave_spool(tmp_path, env, "first")
    good = _leave_spool(tmp_path, env, "second")
    (broken / "cursor.json").write_text("not json")  # a damaged spool raises while syncing
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr  # never 1 ("candidate failed")
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.strip()}
    assert "error" in lines[broken.name] and "JSONDecodeError" in lines[broken.name]
    assert "delivered" in lines[good.name]
    client = store.client()
    run = client.search_runs([client.get_experiment_by_name("second").experiment_id])[0]
    assert run.info.status == "KILLED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == \
        list(range(40))
    assert broken.exists() and not good.exists()


# --- item 5: a full disk -----------------------------------------------------------------
@pytest.fixture
def small_disk():
    """A real 2 MiB tmpfs (needs root to mount); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="refrun-full-"))
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        shutil.rmtree(path, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}); run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


FULL_SCRIPT = textwrap.dedent("""
    import sys, time, refrun
    run = refrun.start_run(workload="full", role="candidate", spool_dir=sys.argv[1],
                           flush_interval_s=0.05, delivery="thread")
    n = 0
    for step in range(int(sys.argv[2])):
        run.log(step, a=step * 1.1, b=step * 2.2, c=step * 3.3, d=step * 4.4, e=step * 5.5)
        n += 5
        if step % 2000 == 0:
            time.sleep(0.01)  # let the writer spool as it goes
    before_close = time.time_ns() // 1_000_000
    print(run.spool.path, n, before_close, flush=True)
    run.close()
    print(run.run_id, run.points_dropped, flush=True)
""")


def test_spool_disk_full_keeps_training_counts_every_lost_point(store, tmp_path, small_disk):
    script = tmp_path / "full.py"
    script.write_text(FULL_SCRIPT)
    env = {**os.environ, "REFRUN_KEEP_SPOOL": "1"}
    out = subprocess.run([sys.executable, str(script), str(small_disk), "40000"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr  # training went on to the end
    (spool_path, logged, before_close), (run_id, dropped) = (
        ln.split() for ln in out.stdout.strip().splitlines()[-2:])
    assert out.stderr.count("spool disk full") == 1  # said once on stderr
    kept = Path(spool_path, "points.tsv").read_bytes().count(b"\n")
    assert 0 < kept < int(logged)
    assert int(dropped) == int(logged) - kept  # every point not kept is counted
    client = store.client()
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert int(before_close) <= r.info.end_time <= time.time_ns() // 1_000_000
    assert r.data.tags[schema.TAG_DROPPED] == str(int(logged) - kept)
    # The curves artifact holds exactly what was kept, or the run says why it has none.
    if schema.TAG_CURVES_MISSING in r.data.tags:
        assert "No space left" in r.data.tags[schema.TAG_CURVES_MISSING]
    else:
        assert len(_curves(client, run_id, tmp_path)) == kept


def test_refrun_sync_on_a_full_disk_is_one_line_exit_2(store, tmp_path, small_disk):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store.tracking_uri,
           "REFRUN_SPOOL_DIR": str(small_disk)}
    spool = _leave_spool(tmp_path, env, "w")
    with open(small_disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "No space left" in out.stderr and str(spool) in out.stderr
    (small_disk / "filler").unlink()
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and "delivered" in out.stdout, out.stdout + out.stderr


# --- item 6: eight trainers at once on a new sqlite store ----------------------------------
CONCURRENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.01)
    import refrun
    with refrun.start_run(workload="many", role="candidate", run_name=sys.argv[1],
                          flush_interval_s=0.05) as run:
        for step in range(100):
            run.log(step, loss=float(step))
    print(run.run_id, flush=True)
""")


@pytest.mark.fresh_store
def test_eight_trainers_start_at_once_on_a_new_sqlite_store(store, tmp_path):
    script = tmp_path / "many.py"
    script.write_text(CONCURRENT_SCRIPT)
    go = tmp_path / "go"
    assert not (store.tmp / "mlflow.db").exists()
    # Thread delivery: the store is opened by start_run either way, and eight more
    # delivery processes would only slow a 2-core CI machine down.
    env = {**os.environ, "REFRUN_DELIVERY": "thread"}
    procs = [subprocess.Popen([sys.executable, str(script), f"t{i}", str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=env) for i in range(8)]
    go.touch()  # all eight open the new store at the same moment
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [e[-2000:] for _, e in outs]
    assert not any("already exists" in e for _, e in outs)
    client = store.client()
    exp = client.get_experiment_by_name("many")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"t{i}" for i in range(8)]
    for r in runs:
        assert r.info.status == "FINISHED"
        steps = sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss"))
        assert steps == list(range(100))


# --- item 7: a server that accepts connections and never answers --------------------------
def test_silent_server_neither_stalls_start_nor_holds_exit(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes connections; nobody ever reads or answers
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    t0 = time.monotonic()
    run = refrun.start_run(workload="w", role="candidate", tracking_uri=uri,
                           spool_dir=tmp_path / "spool", start_wait_s=1, close_timeout_s=2,
                           snapshot_environment=False)
    started = time.monotonic() - t0
    pid = run.spool.read_meta().delivery_pid
    try:
        for s in range(20):
            run.log(s, loss=float(s))
        t1 = time.monotonic()
        assert run.close() is False  # not delivered; the delivery process goes on
        closed = time.monotonic() - t1
        # MLflow's own default would wait 120 s per request.  The bounds leave room for what
        # a busy machine adds (MLflow's import here and in the delivery process, whose
        # start-up counts as progress): beside two CPU-bound processes close took 15.7 s.
        assert started < 60, f"start_run took {started:.1f} s"
        assert closed < 60, f"close took {closed:.1f} s"
        assert "did not answer within 1 s" in " | ".join(w["message"] for w in run.warnings)
        assert run.run_id is None
        assert delivery.owner(run.spool) == "delivery"  # still trying in the background
        assert run.spool.read_all()["step"].tolist() == list(range(20))  # nothing lost
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGKILL)
        silent.close()


# --- item 2: MLflow's bounded, spike-preserving view ---------------------------------------
def _expected_view(values: np.ndarray) -> set[int]:
    """The documented rule, computed independently: all of the first 1000 points; then
    levels L=1,2,... of 1000*2**(L-1) points in 125 buckets each (first, argmin, argmax,
    first non-finite per bucket); the last point."""
    n = len(values)
    keep = set(range(min(n, 1000)))
    start, level_len = 1000, 1000
    while start < n:
        size = level_len // 125
        for b0 in range(start, min(start + level_len, n), size):
            seg = values[b0:min(b0 + size, n)]
            fin = np.isfinite(seg)
            keep.add(b0)
            if fin.any():
                idx = np.flatnonzero(fin)
                keep.add(b0 + int(idx[np.argmin(seg[fin])]))
                keep.add(b0 + int(idx[np.argmax(seg[fin])]))
            if (~fin).any():
                keep.add(b0 + int(np.flatnonzero(~fin)[0]))
        start += level_len
        level_len *= 2
    keep.add(n - 1)
    return keep


def test_mlflow_gets_a_bounded_spike_preserving_view_curves_keep_everything(store, tmp_path):
    rng = np.random.default_rng(0)
    n = 6000
    values = 1.0 / np.arange(1, n + 1) + 0.01 * rng.standard_normal(n)
    values[3333] = 50.0  # a one-step spike
    values[4444] = math.nan
    values[5001] = -7.0
    with refrun.start_run(workload="w", role="reference", flush_interval_s=0.05) as run:
        for s, v in enumerate(values):
            run.log(s, loss=float(v))
        run.log_eval(n - 1, acc=0.5)
    client = store.client()
    history = client.get_metric_history(run.run_id, "loss")
    got = sorted(m.step for m in history)
    assert len(got) == len(set(got))  # no duplicates
    assert set(got) == _expected_view(values)
    assert len(got) < 1000 + 4 * 125 * 3 + 1  # 3 levels cover 6000 points
    assert {3333, 4444, 5001, 0, n - 1} <= set(got)
    by_step = {m.step: m.value for m in history}
    assert by_step[3333] == 50.0 and math.isnan(by_step[4444])
    curves = _curves(client, run.run_id, tmp_path)
    loss = curves[curves.metric == "loss"].sort_values("seq")
    assert len(loss) == n
    np.testing.assert_array_equal(loss["value"].to_numpy(), values)
    assert len(client.get_metric_history(run.run_id, "eval/acc")) == 1


def test_view_survives_a_killed_delivery_without_gaps_or_duplicates(store, tmp_path):
    """The view's state lives in the cursor: re-delivery from a killed process's spool
    gives the same view as one uninterrupted delivery."""
    run = refrun.start_run(workload="w", role="reference", flush_interval_s=0.05,
                           delivery="thread")
    values = np.sin(np.arange(4000) / 50.0)
    for s, v in enumerate(values):
        run.log(s, loss=float(v))
    run._writer.stop()
    spool = list_spools(store.spool_dir)[0]
    # Deliver in two halves, as a delivery process killed in between would.
    delivery.deliver_pending(spool, max_batches=2)
    assert 0 < spool.read_cursor().lines < 4000
    assert run.close() is True
    got = sorted(m.step for m in store.client().get_metric_history(run.run_id, "loss"))
    assert got == sorted(_expected_view(values))
    assert not Spool(spool.path).path.exists()


def test_recording_modules_import_without_mlflow():
    """The trainer and the delivery process start light: MLflow loads on first store use."""
    code = ("import sys, refrun, refrun.recording.session, refrun.recording.process, "
            "refrun.recording.sync; print('mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "False"


def test_set_tags_never_waits_on_the_spools_metadata_lock(store, tmp_path):
    # Probes set tags from inside the training step (the placement re-check every 100
    # steps).  Updating the spool's metadata takes an flock shared with the delivery
    # process and fsyncs; the training thread must never wait for either.
    import fcntl
    import threading

    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        fd = os.open(run.spool.path / "meta.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the delivery process would, for a while
        try:
            done = threading.Event()
            caller = threading.Thread(
                target=lambda: (run.set_tags({"probe.tag": "x"}), done.set()), daemon=True)
            caller.start()
            assert done.wait(60), "set_tags waited on the metadata lock"
            assert run.tags["probe.tag"] == "x"  # visible at once to the session
        finally:
            os.close(fd)  # release: the writer thread applies the change
        wait_for(lambda: Spool(run.spool.path).read_meta().tags.get("probe.tag") == "x",
                 "the tag reaching the spool's metadata")
        run.log(0, loss=1.0)
    assert store.client().get_run(run.run_id).data.tags["probe.tag"] == "x"
