"""Issue 55, round two at the recording API: artifact names confined to the run, identity
tags that cannot change after start_run, every refused value counted (the PyTorch probe's
included), a missing artifact file counted instead of raised, and a damaged spool salvaged
by ``refrun sync``.  Real sqlite stores, real runs, a real killed trainer and the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import refrun
from refrun import schema
from refrun.recording.session import artifact_name_problem
from tests.test_durability import wait_for


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def _warnings_doc(client, run_id: str, tmp: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, schema.ARTIFACT_WARNINGS,
                                                     str(tmp))).read_text())


@pytest.mark.parametrize("name", ["../../../x.json", "/ABS/x.json", "..", "a/../../x.json",
                                  "a/./../../b/x.json", "", ".", "a/"])
def test_artifact_name_problem_refuses_names_outside_the_run(name: str, tmp_path: Path
                                                             ) -> None:
    name = name.replace("/ABS", str(tmp_path))
    assert artifact_name_problem(name) is not None


@pytest.mark.parametrize("name", ["x.json", "refrun/x.json", "a/b/c.txt", "..x", "x..json",
                                  "./x.json"])
def test_artifact_name_problem_accepts_names_inside(name: str) -> None:
    assert artifact_name_problem(name) is None


def test_artifact_names_that_leave_the_run_write_nothing(store, tmp_path: Path) -> None:
    """``run.log_json("../../../x.json")``, an absolute name and ``log_artifact(name="..")``
    write nothing outside the run's artifacts: refused, warned, counted, never raised."""
    work = tmp_path / "w" / "x" / "y"
    work.mkdir(parents=True)
    src = tmp_path / "payload.txt"
    src.write_text("payload")
    outside = tmp_path / "abs-target.json"
    before = _files_under(tmp_path)
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        spool = run.spool.path
        run.log(0, loss=1.0)
        run.log_json("../../../x.json", {"a": 1})
        run.log_json("../x.json", {"a": 1})
        run.log_json(str(outside), {"a": 1})
        run.log_artifact(src, name="..")
        run.log_artifact(src, name="../../escaped.txt")
        run.log_artifact(src, name=str(tmp_path / "abs-copy.txt"))
        run.log_json("ok/inside.json", {"fine": True})  # an ordinary name still works
        created = _files_under(tmp_path) - before
        # Everything new lies in the run's spool (or the store's own files).
        assert all(p.is_relative_to(spool) or p.is_relative_to(tmp_path / "mlruns")
                   or p.name.startswith("mlflow.db") for p in created), created
    assert not outside.exists() and not (tmp_path / "abs-copy.txt").exists()
    assert not list(tmp_path.rglob("x.json")) and not list(tmp_path.rglob("escaped.txt"))
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.tags[schema.TAG_REFUSED] == "6"
    refused = _warnings_doc(client, run.run_id, tmp_path / "dl")["refused"]
    assert {e["reason"].split(" refused: ")[0] for e in refused} >= {
        "artifact name '../../../x.json'", "artifact name '..'"}
    arts = {a.path for a in client.list_artifacts(run.run_id, "ok")}
    assert arts == {"ok/inside.json"}


def test_log_artifact_of_a_missing_file_is_counted_not_raised(store, tmp_path: Path) -> None:
    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        run.log(0, loss=1.0)
        run.log_artifact(tmp_path / "no-such-file.bin")
        run.log_artifact(tmp_path)  # a directory is no file either
        run.log(1, loss=0.5)  # the loop goes on
    client = store.client()
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED" and r.data.tags[schema.TAG_REFUSED] == "2"
    assert [m.step for m in client.get_metric_history(run.run_id, "loss")] == [0, 1]
    assert any("no-such-file.bin" in w["message"] and "not copied" in w["message"]
               for w in run.warnings)


def test_identity_tags_cannot_change_after_start(store, tmp_path: Path) -> None:
    with refrun.start_run(workload="w", role="reference", hardware="cpu", seed=3,
                          flush_interval_s=0.05,
                          tags={schema.TAG_ROLE: "candidate", "team": "a"}) as run:
        run.log(0, loss=1.0)
        run.set_tags({schema.TAG_ROLE: "candidate", schema.TAG_WORKLOAD: "other",
                      schema.TAG_SEED: 4, "note": "kept"})
        run.set_tags({schema.TAG_HARDWARE: "cpu"})  # the same value: a no-op, not refused
        run.set_tags({schema.TAG_TOKENS_PER_SAMPLE: 8})  # not set at start: first value
        run.set_tags({schema.TAG_TOKENS_PER_SAMPLE: 9})  # then fixed
        assert run.tags[schema.TAG_ROLE] == "reference"
    r = store.client().get_run(run.run_id)
    tags = r.data.tags
    assert (tags[schema.TAG_ROLE], tags[schema.TAG_WORKLOAD], tags[schema.TAG_SEED]) == (
        "reference", "w", "3")
    assert tags[schema.TAG_TOKENS_PER_SAMPLE] == "8"
    assert tags["note"] == "kept" and tags["team"] == "a"
    # start_run's tags= role, then role, workload, seed and tokens_per_sample later.
    assert tags[schema.TAG_REFUSED] == "5"
    refused = _warnings_doc(store.client(), run.run_id, tmp_path)["refused"]
    assert {e["name"] for e in refused} == {schema.TAG_ROLE, schema.TAG_WORKLOAD,
                                            schema.TAG_SEED, schema.TAG_TOKENS_PER_SAMPLE}
    assert all(e["reason"].startswith("identity tag") for e in refused)


def test_torch_probe_log_refusals_are_counted(store, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import refrun.torch

    with refrun.start_run(workload="w", role="candidate", flush_interval_s=0.05) as run:
        probe = refrun.torch.instrument(run, monitors=None)
        probe.log(early=1.0)  # before any step: no step to record it at
        for n in range(3):
            with probe.step(n):
                probe.log(loss=torch.tensor(1.0 / (n + 1)), vec=torch.ones(3),
                          text="x", cplx=torch.tensor(1j))
        probe.close()
    client = store.client()
    r = client.get_run(run.run_id)
    # 3 steps x (vec, text, cplx) + the value logged before a step.
    assert r.data.tags[schema.TAG_REFUSED] == "10", r.data.tags
    refused = {e["name"]: e for e in _warnings_doc(client, run.run_id, tmp_path)["refused"]}
    assert {"vec", "text", "cplx", "early"} <= set(refused)
    assert refused["vec"]["count"] == 3 and "shape (3,)" in refused["vec"]["reason"]
    assert len(client.get_metric_history(run.run_id, "loss")) == 3


# --- a damaged spool -------------------------------------------------------------------
TRAINER = textwrap.dedent("""
    import os, sys
    import refrun
    run = refrun.start_run(workload="damaged", role="candidate", flush_interval_s=0.05,
                           delivery="thread")
    for step in range(100):
        run.log(step, loss=1.0 / (step + 1))
    print(run.spool.path, flush=True)
    sys.stdin.readline()  # the test waits for the spool to hold every point
    os._exit(0)  # a hard death: no close, no seal
""")


def test_sync_salvages_a_damaged_spool_and_says_what_was_lost(store, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = store.trainer_env()
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert proc.stdin is not None and proc.stdout is not None
    spool = Path(proc.stdout.readline().strip())
    points = spool / "points.tsv"
    wait_for(lambda: points.read_bytes().count(b"\n") == 100, "100 spooled points")
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=120) == 0
    # The disk gives back garbage after the 100 points: a NUL block (a crash's unwritten
    # page), a line that is not UTF-8, then more of the trainer's points.
    more = b"".join(f"loss\t{s}\t{1_700_000_000_000 + s}\t{0.001 * s!r}\n".encode()
                    for s in range(100, 120))
    with open(points, "ab") as f:
        f.write(b"\0" * 4096 + b"\n" + b"loss\t100\t1\t\xff\xfe\n" + more)
    out = subprocess.run([sys.executable, "-m", "refrun", "sync"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and "status KILLED" in out.stdout, out.stdout + out.stderr
    client = store.client()
    exp = client.get_experiment_by_name("damaged")
    run = client.search_runs([exp.experiment_id])[0]
    assert run.info.status == "KILLED"  # ended, never RUNNING for ever
    tags = run.data.tags
    assert tags[schema.TAG_STEPS_COUNT] == "120"  # every valid line, before and after
    assert "2 damaged lines" in tags[schema.TAG_SPOOL_DAMAGED]
    assert int(tags[schema.TAG_DROPPED]) >= 2
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step for m in history} == set(range(120))
    warnings = _warnings_doc(client, run.info.run_id, tmp_path / "dl")["warnings"]
    assert any("damaged lines" in w["message"] for w in warnings)
    assert not spool.exists()  # delivered: pruned
