"""The delivery process yields the CPU to the training it records, and outlives the
terminal's Ctrl-C and hang-up (refrun.recording.process).

A real trainer process (its own session, as a terminal's job is) records into a real
sqlite store through a real delivery process.  What would break: a delivery process in a
session of its own (with Linux's scheduler autogroups it then gets as much CPU as the
whole training session, whatever its nice value; docs/session.md, "The delivery
process's CPU"), one at the trainer's priority, or one in the trainer's process group (a
Ctrl-C on the terminal would kill it with the trainer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from refrun.recording.process import DELIVERY_NICE, LOG_FILE
from tests.test_durability import wait_for

TRAINER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    import refrun
    # A terminal's foreground job takes Ctrl-C; a job started in the background by a
    # non-interactive shell (nohup, "&") inherits SIGINT ignored, and so would this one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stacks on a hang
    run = refrun.start_run(workload="w", role="candidate", tracking_uri=sys.argv[1],
                           spool_dir=sys.argv[2], snapshot_environment=False)
    print(run.spool.read_meta().delivery_pid, run.run_id, flush=True)
    with run:
        step = 0
        while True:  # until the terminal's Ctrl-C
            run.log(step, loss=float(step))
            step += 1
            if step == 50:
                print("ready", flush=True)
            time.sleep(0.005)
""")


def test_delivery_process_yields_cpu_and_outlives_ctrl_c_and_hangup(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {k: v for k, v in os.environ.items() if k != "REFRUN_DELIVERY_NICE"}  # the default
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, uri, str(tmp_path / "spool")], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid = None
    try:
        assert trainer.stdout is not None
        pid_text, run_id = trainer.stdout.readline().split()
        pid = int(pid_text)
        # One scheduling group with the trainer (its session), one signal group of its own.
        assert os.getsid(pid) == os.getsid(trainer.pid)
        assert os.getpgid(pid) != os.getpgid(trainer.pid)
        # It lowers its own priority as it starts (before importing MLflow).
        want = min(19, os.getpriority(os.PRIO_PROCESS, trainer.pid) + DELIVERY_NICE)
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, pid) == want,
                 f"the delivery process at nice {want}", timeout=60)
        assert trainer.stdout.readline().strip() == "ready"
        os.kill(pid, signal.SIGHUP)  # the terminal closed: ignored
        os.killpg(trainer.pid, signal.SIGINT)  # Ctrl-C: the foreground group only
        try:
            _, err = trainer.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say where it waits
            os.kill(trainer.pid, signal.SIGUSR1)
            try:
                _, tail = trainer.communicate(timeout=5)
            except subprocess.TimeoutExpired as e:
                tail = e.stderr or ""
            if isinstance(tail, bytes):
                tail = tail.decode(errors="replace")
            log = next((tmp_path / "spool").rglob(LOG_FILE), None)
            raise AssertionError(
                f"the trainer did not end within 120 s of Ctrl-C; its threads (stderr tail):"
                f"\n{tail[-6000:]}\ndelivery.log: "
                f"{log.read_text()[-2000:] if log else 'none'}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
    # The trainer stopped on KeyboardInterrupt and its delivery process, alive, finished
    # the run: KILLED in the store with every logged point, nothing left undelivered.
    assert trainer.returncode != 0 and "KeyboardInterrupt" in err
    assert "not fully delivered" not in err, err[-2000:]
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert len(steps) >= 50 and steps == list(range(len(steps)))


def test_the_delivery_nice_setting_is_checked(monkeypatch) -> None:
    from refrun.errors import RefrunInputError
    from refrun.settings import DEFAULT_DELIVERY_NICE, delivery_nice, settings

    monkeypatch.delenv("REFRUN_DELIVERY_NICE", raising=False)
    assert delivery_nice() == DEFAULT_DELIVERY_NICE == DELIVERY_NICE == 10
    monkeypatch.setenv("REFRUN_DELIVERY_NICE", "0")
    assert delivery_nice() == 0
    for bad in ("20", "-1", "ten", "1.5"):
        monkeypatch.setenv("REFRUN_DELIVERY_NICE", bad)
        with pytest.raises(RefrunInputError, match="REFRUN_DELIVERY_NICE"):
            settings()  # refused where a run starts, in one line
