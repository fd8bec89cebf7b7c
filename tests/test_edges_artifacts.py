"""Exit codes that cannot be misread, outputs only where a user meant them, whole runs or
a said gap (issue 55 items 2-4).

One real sqlite store, recorded once for the module (two references, a candidate that
passes, its assessment recorded and signed off); each test breaks one thing in it (an
artifact file, a tag, an output path), drives real CLI commands through it and puts it
back.  Before: an empty ``curves.parquet`` made `accept` print a 35-line pyarrow
traceback and exit 1 (the code for "candidate failed"); 11 of 13 malformed
assessment, sign-off and evidence artifacts crashed `verify`; `report --html` onto a FIFO
or a symlink turned it into a regular file, exit 0; a run that dropped 92 % of its points,
or a FINISHED refrun run without its curves artifact, was compared as whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from acceptance_helpers import N, base_loss, record, write_criteria
from conftest import migrated_sqlite
from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.cli import main
from refrun.store.direct import local_path

BODY = """
[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.5

[[stopping]]
id = "budget"
kind = "budget"
max_hours = 10
min_steps = 5
"""


@dataclass
class Recorded:
    tmp: Path
    uri: str
    refs: list[str]
    cand: str
    comparison: str
    crit: Path

    def artifact(self, run_id: str, name: str) -> Path:
        root = local_path(MlflowClient(self.uri).get_run(run_id).info.artifact_uri)
        assert root is not None
        return root / name


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    tmp = tmp_path_factory.mktemp("edges-artifacts")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        uri = migrated_sqlite(tmp / "mlflow.db", tmp_path_factory)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        rng = np.random.default_rng(0)
        spool = tmp / "spool"
        refs = [record(uri, spool, "reference", {"loss": base_loss() + rng.normal(0, 0.01, N)},
                       seed=s).run_id for s in (0, 1)]
        cand = record(uri, spool, "candidate", {"loss": base_loss() + rng.normal(0, 0.01, N)},
                      hardware="tpu-v5e").run_id
        crit = write_criteria(tmp, BODY)
        out = tmp / "accept.out"
        p = cli("accept", "--criteria", str(crit), "--reference", *refs, "--candidate", cand,
                cwd=tmp, env={"MLFLOW_TRACKING_URI": uri})
        assert p.returncode == 0, p.stdout + p.stderr
        out.write_text(p.stdout)
        comparison = p.stdout.split("recorded on comparison run ")[1].split()[0]
        p = cli("signoff", "--comparison", comparison, "--decision", "accept", "--by", "Ada",
                cwd=tmp, env={"MLFLOW_TRACKING_URI": uri})
        assert p.returncode == 0, p.stderr
        yield Recorded(tmp, uri, refs, cand, comparison, crit)


def cli(*argv: str, cwd: Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """``refrun ARGV`` in a fresh process, as typed in a shell."""
    return subprocess.run([sys.executable, "-m", "refrun", *argv], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env={**os.environ, **(env or {})})


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def reading_commands(r: Recorded, out: Path) -> dict[str, list[str]]:
    """Every command that loads the candidate (and the references) to judge it."""
    t = ["--tracking-uri", r.uri, "--wait", "0"]
    refs = ["--reference", *r.refs]
    return {
        "compare": ["compare", *refs, "--candidate", r.cand, "--no-record", *t],
        "accept": ["accept", "--criteria", str(r.crit), *refs, "--candidate", r.cand,
                   "--no-record", *t],
        "report": ["report", *refs, "--candidate", r.cand, "--html", str(out / "r.html"),
                   "--no-record", *t],
        "calibrate": ["calibrate", "--reference", *r.refs, r.cand, "--tracking-uri", r.uri],
    }


# --- broken curves artifacts and runs that are not whole --------------------------------
def empty(p: Path) -> None:
    p.write_bytes(b"")


def truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def garbage(p: Path) -> None:
    p.write_bytes(os.urandom(4096))


def other_columns(p: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2, 3]}), p)


def missing(p: Path) -> None:
    p.unlink()


CURVE_FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty": (empty, "not a readable curves artifact (0 bytes"),
    "truncated": (truncated, "not a readable curves artifact"),
    "garbage": (garbage, "not a readable curves artifact"),
    "other columns": (other_columns, "not a curves artifact (no column metric"),
    "missing": (missing, "not whole: recorded by refrun, but its curves artifact"),
}


@contextlib.contextmanager
def broken(path: Path, fault: Callable[[Path], None]) -> Iterator[None]:
    keep = path.with_name(path.name + ".kept")
    shutil.copy2(path, keep)
    fault(path)
    try:
        yield
    finally:
        os.replace(keep, path)


@pytest.mark.parametrize("fault", CURVE_FAULTS)
def test_every_command_on_a_broken_curves_artifact_is_one_line_exit_2(
        rec: Recorded, fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, said = CURVE_FAULTS[fault]
    argvs = reading_commands(rec, tmp_path)
    argvs["watch"] = ["watch", "--criteria", str(rec.crit), "--run", rec.cand, "--once",
                      "--tracking-uri", rec.uri]
    if fault == "missing":
        del argvs["watch"]  # watching a run in progress: no artifact yet is its normal state
    with broken(rec.artifact(rec.cand, schema.ARTIFACT_CURVES), make):
        for name, argv in argvs.items():
            code = main(argv)
            err = capsys.readouterr().err
            assert code == 2, (name, err)
            line = one_line(err)
            assert rec.cand in line and said in line, (name, line)
    assert not (tmp_path / "r.html").exists()


def test_accept_on_an_empty_curves_artifact_from_a_shell(rec: Recorded) -> None:
    with broken(rec.artifact(rec.cand, schema.ARTIFACT_CURVES), empty):
        p = cli("accept", "--criteria", str(rec.crit), "--reference", *rec.refs,
                "--candidate", rec.cand, "--no-record", "--tracking-uri", rec.uri,
                cwd=rec.tmp)
    assert p.returncode == 2, p.stderr  # was 1, "candidate failed", after a traceback
    line = one_line(p.stderr)
    assert line.startswith("refrun accept: error: run " + rec.cand)
    assert "curves.parquet" in line and "0 bytes" in line


@pytest.mark.parametrize("tag,value,said", [
    (schema.TAG_DROPPED, "1100", "1,100 points dropped while recording (refrun.dropped; "
                                 "91.7% of 1,200"),
    (schema.TAG_LOST_ESTIMATE, "25", "25 points estimated lost with the trainer"),
])
def test_a_run_that_dropped_or_lost_points_is_refused_with_the_gap_stated(
        rec: Recorded, tag: str, value: str, said: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from refrun.comparison.loading import load_run

    client = MlflowClient(rec.uri)
    before = client.get_run(rec.cand).data.tags.get(tag)
    client.set_tag(rec.cand, tag, value)
    try:
        for name, argv in reading_commands(rec, tmp_path).items():
            code = main(argv)
            err = capsys.readouterr().err
            assert code == 2, (name, err)
            line = one_line(err)
            assert f"run {rec.cand} is not whole" in line and said in line, (name, line)
        # A program that asks for it gets the run with the gap stated in its evidence.
        data = load_run(rec.cand, tracking_uri=rec.uri, progress=False, allow_gaps=True)
        assert data.gap is not None and said in data.points_from
    finally:
        if before is None:
            client.delete_tag(rec.cand, tag)
        else:
            client.set_tag(rec.cand, tag, before)
    assert main(reading_commands(rec, tmp_path)["accept"]) == 0  # whole again: judged


# --- malformed recorded assessment, sign-off and evidence: verify --------------------------
def _json_edit(edit: Callable[[dict], object]) -> Callable[[bytes], bytes]:
    return lambda raw: json.dumps(edit(json.loads(raw))).encode()


def _set(key: str, value: object) -> Callable[[bytes], bytes]:
    return _json_edit(lambda d: {**d, key: value})


def _drop(key: str) -> Callable[[bytes], bytes]:
    return _json_edit(lambda d: {k: v for k, v in d.items() if k != key})


ARTIFACT_FAULTS: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "assessment empty": ("refrun/assessment.json", lambda raw: b""),
    "assessment not JSON": ("refrun/assessment.json", lambda raw: b"{verdict: pass"),
    "assessment truncated": ("refrun/assessment.json", lambda raw: raw[: len(raw) // 2]),
    "assessment a list": ("refrun/assessment.json", lambda raw: b"[1, 2]"),
    "assessment not UTF-8": ("refrun/assessment.json", lambda raw: b"\xff\xfe" + raw),
    "assessment reference a number": ("refrun/assessment.json", _set("reference", 5)),
    "assessment results of strings": ("refrun/assessment.json", _set("results", ["x"])),
    "assessment criteria a string": ("refrun/assessment.json", _set("criteria", "x")),
    "assessment without candidate": ("refrun/assessment.json", _drop("candidate")),
    "signoff empty": ("refrun/signoff.json", lambda raw: b""),
    "signoff not JSON": ("refrun/signoff.json", lambda raw: b"signed"),
    "signoff a string": ("refrun/signoff.json", lambda raw: b'"accept"'),
    "signoff without by": ("refrun/signoff.json", _drop("by")),
    "signoff unknown key": ("refrun/signoff.json", _set("extra", 1)),
    "signoff override a string": ("refrun/signoff.json", _set("override", "yes")),
    "signoff reference_ids a string": ("refrun/signoff.json", _set("reference_ids", "r")),
    "evidence not JSON": ("refrun/evidence.json", lambda raw: b"\x00\x01"),
    "evidence a list": ("refrun/evidence.json", lambda raw: b"[]"),
    "evidence runs a list": ("refrun/evidence.json", _set("runs", [])),
    "criteria not UTF-8": ("refrun/criteria.toml", lambda raw: b"\xff" + raw),
    "criteria not TOML": ("refrun/criteria.toml", lambda raw: b"[[criteria]\nid ="),
}


def test_verify_answers_every_malformed_artifact_in_one_line_exit_2(
        rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", rec.comparison, "--tracking-uri", rec.uri]) == 0
    capsys.readouterr()
    for fault, (name, edit) in ARTIFACT_FAULTS.items():
        path = rec.artifact(rec.comparison, name)
        with broken(path, lambda p, edit=edit: p.write_bytes(edit(p.read_bytes()))):
            answers = {cmd: (main(argv), capsys.readouterr().err) for cmd, argv in (
                ("verify", ["verify", rec.comparison, "--tracking-uri", rec.uri]),
                ("signoff", ["signoff", "--comparison", rec.comparison, "--decision",
                             "reject", "--by", "Bob", "--tracking-uri", rec.uri]))}
        for cmd, (code, err) in answers.items():
            assert code == 2, (fault, cmd, err)
            line = one_line(err)
            assert rec.comparison in line, (fault, cmd, line)
            if name != "refrun/criteria.toml" and "already signed off" not in line:
                assert name in line, (fault, cmd, line)
    assert main(["verify", rec.comparison, "--tracking-uri", rec.uri]) == 0


# --- outputs only where a user meant them ----------------------------------------------
def test_report_html_onto_a_fifo_leaves_it_a_fifo_and_exits_2(rec: Recorded,
                                                              tmp_path: Path) -> None:
    fifo = tmp_path / "report.html"
    os.mkfifo(fifo)
    p = cli("report", "--reference", *rec.refs, "--candidate", rec.cand, "--html", str(fifo),
            "--no-record", "--tracking-uri", rec.uri, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "is a named pipe (FIFO)" in one_line(p.stderr)
    assert fifo.is_fifo()


def output_targets(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Paths no command may write to: (path, what the line says)."""
    fifo = tmp / "pipe"
    os.mkfifo(fifo)
    kept = tmp / "kept.txt"
    kept.write_text("the user's file\n")
    link = tmp / "link.json"
    link.symlink_to(kept)
    dangling = tmp / "dangling.json"
    dangling.symlink_to(tmp / "nowhere" / "x.json")
    (tmp / "adir").mkdir()
    return {"fifo": (fifo, "named pipe (FIFO)"), "symlink": (link, "symbolic link"),
            "dangling symlink": (dangling, "symbolic link"),
            "device": (Path("/dev/null"), "character device"),
            "proc": (Path("/proc/version"), "virtual file system /proc"),
            "directory": (tmp / "adir", "is a directory")}


def test_no_command_writes_onto_a_pipe_link_device_or_proc_file(
        rec: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = output_targets(tmp_path)
    t = ["--tracking-uri", rec.uri]
    refs = ["--reference", *rec.refs]
    html = str(tmp_path / "ok.html")

    def writers(out: str) -> dict[str, list[str]]:
        return {
            "report --html": ["report", *refs, "--candidate", rec.cand, "--html", out,
                              "--no-record", *t],
            "report --json": ["report", *refs, "--candidate", rec.cand, "--html", html,
                              "--json", out, "--no-record", *t],
            "accept --json": ["accept", "--criteria", str(rec.crit), *refs, "--candidate",
                              rec.cand, "--json", out, "--no-record", *t],
            "compare --json": ["compare", *refs, "--candidate", rec.cand, "--json", out,
                               "--no-record", *t],
            "verify --json": ["verify", rec.comparison, "--json", out, *t],
            "watch --json": ["watch", "--criteria", str(rec.crit), "--run", rec.cand,
                             "--once", "--json", out, *t],
            "calibrate -o": ["calibrate", "--reference", *rec.refs, "-o", out, *t],
        }

    before = {k: (os.lstat(p).st_mode, os.readlink(p) if p.is_symlink() else None)
              for k, (p, _) in targets.items()}
    for target, (path, said) in targets.items():
        for name, argv in writers(str(path)).items():
            code = main(argv)
            err = capsys.readouterr().err
            assert code == 2, (target, name, err)
            assert said in one_line(err), (target, name, err)
    after = {k: (os.lstat(p).st_mode, os.readlink(p) if p.is_symlink() else None)
             for k, (p, _) in targets.items()}
    assert after == before
    assert (tmp_path / "kept.txt").read_text() == "the user's file\n"
    assert not (tmp_path / "ok.html").exists() and not (tmp_path / "nowhere").exists()
    # A regular file is replaced (atomically), a new path written, each as asked.
    existing = tmp_path / "existing.json"
    existing.write_text("old")
    assert main(writers(str(existing))["accept --json"]) == 0
    assert json.loads(existing.read_text())["candidate"] == rec.cand
    assert main(writers(str(tmp_path / "new" / "m.json"))["compare --json"]) == 0
    assert "candidate" in json.loads((tmp_path / "new" / "m.json").read_text())
    capsys.readouterr()


def test_an_unforeseen_error_is_exit_2_in_one_line_never_exit_1(
        rec: Recorded, tmp_path: Path) -> None:
    # A bug stands in for every error refrun did not foresee: a sitecustomize that breaks
    # pandas' Parquet reader in the command's own process.
    (tmp_path / "sitecustomize.py").write_text(
        "import pandas\n"
        "def broken(*a, **k):\n    raise ZeroDivisionError('simulated bug')\n"
        "import pyarrow.parquet\npyarrow.parquet.read_table = broken\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = cli("compare", "--reference", *rec.refs, "--candidate", rec.cand, "--no-record",
            "--tracking-uri", rec.uri, cwd=tmp_path, env=env)
    assert p.returncode == 2, p.stderr
    line = one_line(p.stderr)
    assert "unforeseen ZeroDivisionError: simulated bug" in line
    p = cli("compare", "--reference", *rec.refs, "--candidate", rec.cand, "--no-record",
            "--tracking-uri", rec.uri, cwd=tmp_path, env={**env, "REFRUN_TRACEBACK": "1"})
    assert p.returncode == 2 and "Traceback" in p.stderr


def test_the_whole_pipeline_still_passes(rec: Recorded) -> None:
    # Guards the matrix above: unbroken, the same runs are judged (exit 0), so each exit 2
    # above is the fault's, not the set-up's.
    df = pd.read_parquet(rec.artifact(rec.cand, schema.ARTIFACT_CURVES))
    assert len(df) == N
    assert main(["compare", "--reference", *rec.refs, "--candidate", rec.cand,
                 "--no-record", "--tracking-uri", rec.uri]) == 0
