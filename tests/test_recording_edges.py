"""Issue 22 at ``log()``: every value the session refuses is counted and named, long tag
and param values are cut with a counted warning, and a param logged again is handled one
way whatever the timing; points a hard kill took are estimated by ``refrun sync``.  A real
sqlite store; the session's own delivery process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import refrun
from refrun import schema
from tests.test_durability import wait_for


def _warnings_doc(client, run_id: str, tmp: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, schema.ARTIFACT_WARNINGS,
                                                     str(tmp))).read_text())


def test_every_refused_value_is_counted_and_named(store, tmp_path: Path) -> None:
    bad = {"s": "0.5", "n": None, "b": True, "c": 1j, "a": np.zeros(3), "big": 10**400}
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        run.log(0, loss=1.0)
        run.log(7, loss=0.5, **bad)
        run.log(8, big=10**400)  # the same refusal again: counted, listed once
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.tags[schema.TAG_REFUSED] == str(len(bad) + 1)
    refused = {e["name"]: e for e in _warnings_doc(client, run.run_id, tmp_path)["refused"]}
    assert set(refused) == set(bad)
    for name, value in bad.items():
        e = refused[name]
        assert e["first_step"] == 7 and f"metric {name!r} at step 7" in e["reason"], e
        if name != "big":
            assert f"type {type(value).__name__}" in e["reason"], e
    assert refused["big"]["count"] == 2 and "too large for a float" in refused["big"]["reason"]
    # The 10**400 warning names the metric and the step.
    messages = [w["message"] for w in run.warnings]
    assert any("metric 'big' at step 7" in m and "401 digits" in m for m in messages)
    assert [m.step for m in client.get_metric_history(run.run_id, "loss")] == [0, 7]


def test_long_values_are_cut_with_a_counted_warning(store) -> None:
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH  # MLflow's own limits: 8,000

    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                          params={"cfg": "p" * 7000},
                          tags={"start": "s" * (MAX_TAG_VAL_LENGTH + 1)}) as run:
        run.set_tags({"notes": "n" * 9000, "short": "ok", "fits": "f" * MAX_TAG_VAL_LENGTH})
    r = store.client().get_run(run.run_id)
    assert r.data.tags[schema.TAG_TRUNCATED] == "3"
    assert r.data.params["cfg"] == "p" * 6000  # MLflow's param limit
    assert r.data.tags["start"] == "s" * MAX_TAG_VAL_LENGTH
    assert r.data.tags["notes"] == "n" * MAX_TAG_VAL_LENGTH
    assert r.data.tags["short"] == "ok" and r.data.tags["fits"] == "f" * MAX_TAG_VAL_LENGTH
    messages = " | ".join(w["message"] for w in run.warnings)
    for needle in ("param 'cfg': value of 7,000 characters cut to MLflow's limit of 6,000",
                   f"tag 'start': value of {MAX_TAG_VAL_LENGTH + 1:,} characters cut",
                   "tag 'notes': value of 9,000 characters cut"):
        assert needle in messages


@pytest.mark.parametrize("delivered_first", [False, True])
def test_a_param_logged_again_keeps_its_first_value(store, delivered_first: bool) -> None:
    # Before: the outcome depended on whether the first value had reached the store (kept
    # silently, or refused by the store and counted in refrun.skipped).  Now one rule.
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05,
                          params={"lr": 0.1}) as run:
        if delivered_first:
            wait_for(lambda: "lr" in store.client().get_run(run.run_id).data.params,
                     "the first value in the store")
        run.log_params({"lr": 0.1, "wd": 0.0})  # same value again: nothing to say
        run.log_params({"lr": 0.2})
        run.log(0, loss=1.0)
    r = store.client().get_run(run.run_id)
    assert r.data.params == {"lr": "0.1", "wd": "0.0"}
    assert r.data.tags[schema.TAG_REFUSED] == "1"
    assert schema.TAG_SKIPPED not in r.data.tags
    assert any("param 'lr' already logged as '0.1', the new value '0.2' is refused"
               in w["message"] for w in run.warnings)


def _exited(pid: int) -> bool:
    """True once ``pid`` has exited (gone, or a zombie: its descriptors and locks are
    released); the process is not this test's child, so it cannot be waited for."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


LOST_TRAINER = textwrap.dedent("""
    import time, refrun
    run = refrun.start_run(workload="lost", role="candidate", flush_interval_s=1.0)
    print(run._process.pid, flush=True)
    due, step = time.monotonic(), 0
    while True:  # at most 1,000 steps/s, 2 metrics a step: 2,000 points/s
        while time.monotonic() < due:
            pass
        # Paced from this step, never from the start: a trainer slowed by a busy machine
        # does not catch up in a burst faster than the rate the estimate has seen.
        due = time.monotonic() + 0.001
        run.log(step, loss=1.0 / (step + 1), lr=0.1)
        step += 1
        if step % 50 == 0:
            print(step, flush=True)  # after log(): at least 2 * step points accepted
""")


def test_points_lost_to_a_hard_kill_are_estimated_by_sync(store, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(LOST_TRAINER)
    env = store.trainer_env()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    assert proc.stdout is not None
    delivery_pid = int(proc.stdout.readline())
    printed = 0
    try:
        for line in proc.stdout:  # until at least two appends reached the spool
            printed = int(line)
            spools = list(store.spool_dir.iterdir())
            if printed >= 3000 and spools and (spools[0] / "points.tsv").stat().st_size \
                    > 60_000:
                break
    finally:
        for pid in (proc.pid, delivery_pid):  # the node goes away: both at once
            os.kill(pid, signal.SIGKILL)
        rest = proc.stdout.read().split()
        proc.wait(timeout=60)
    # SIGKILL is asynchronous: a process inside a disk write (sqlite's fsync on a busy CI
    # disk) exits only when the write returns, and until then it holds the spool's
    # delivery lock, so ``sync`` rightly calls the spool live.  The node is gone only when
    # its processes are.
    wait_for(lambda: _exited(delivery_pid), f"the killed delivery process {delivery_pid} "
             "to exit", timeout=120)
    printed = int(rest[-1]) if rest else printed
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and "status KILLED" in out.stdout, out.stdout + out.stderr
    client = store.client()
    run = client.search_runs([client.get_experiment_by_name("lost").experiment_id])[0]
    kept = int(run.data.tags[schema.TAG_STEPS_COUNT]) * 2
    accepted_at_least = 2 * printed
    estimate = int(run.data.tags[schema.TAG_LOST_ESTIMATE])
    # At most one flush interval at the paced rate (2,000 points) was unspooled; the
    # estimate says a number in that range, and not less than what was really lost (the
    # time of death is unknown to sync: it is an upper bound) up to timing slack.
    assert 0 < estimate <= 3000
    assert accepted_at_least - kept <= 1.5 * estimate + 200, (accepted_at_least, kept,
                                                              estimate)
