"""A store refrun can always open or name (issue 55 item 1).

Real faults on real sqlite MLflow stores: a writer SIGKILLed mid-transaction (a hot
``mlflow.db-journal``), another application's alembic-managed sqlite file, an MLflow
store lacking tables of the installed MLflow's schema, damaged pages, a dangling symbolic
link as the store path.  Before: every refrun command refused a store with a hot journal
for ever ("attempt to write a readonly database"); `refrun runs` on the foreign file
printed a 118-line traceback, exit 1, and created MLflow's tables in it; `import` wrote
into a store with damaged pages; the dangling link held `start_run` for 103 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_store_faults import commands, run_all

import refrun
from refrun.cli import main

# A writer that holds a transaction open with its changes spilled into the database file
# (a one-page cache), says so, and waits to be killed.
WRITER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE experiments SET name = name || '-half-written'")
con.execute("CREATE TABLE ballast (b BLOB)")
con.executemany("INSERT INTO ballast VALUES (?)", [(b'x' * 4000,)] * 200)
print("in transaction", flush=True)
sys.stdin.read()
"""


def refrun_cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``refrun ARGV`` as a user types it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "refrun", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def db_of(uri: str) -> Path:
    return Path(uri[len("sqlite:///"):])


def kill_writer_mid_transaction(db: Path) -> None:
    """SIGKILL a real sqlite writer once it is inside a transaction whose pages are
    already in the database file: what a trainer killed with its delivery leaves."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "in transaction"  # waits on the writer
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_a_hot_journal_left_by_a_killed_writer_is_rolled_back_by_the_next_refrun_runs(
        store, tmp_path: Path) -> None:
    db = db_of(store.tracking_uri)
    assert main(commands(tmp_path, store.tracking_uri)["import"]) == 0  # one run of "w"
    kill_writer_mid_transaction(db)
    journal = Path(f"{db}-journal")
    assert journal.stat().st_size > 0
    with (contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con,
          pytest.raises(sqlite3.OperationalError, match="readonly")):
        con.execute("SELECT name FROM experiments").fetchall()  # the lock-out, real

    p = refrun_cli("runs", "--workload", "w", "--tracking-uri", store.tracking_uri)
    assert p.returncode == 0, p.stderr
    assert "reference" in p.stdout  # the imported run, listed
    assert not journal.exists()
    with contextlib.closing(sqlite3.connect(db)) as con:  # rolled back, not committed
        names = [r[0] for r in con.execute("SELECT name FROM experiments")]
        assert names and not any("half-written" in n for n in names)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file: no refusal to see")
def test_a_hot_journal_refrun_may_not_roll_back_is_one_line(store) -> None:
    db = db_of(store.tracking_uri)
    kill_writer_mid_transaction(db)
    db.parent.chmod(0o555)
    try:
        p = refrun_cli("runs", "--workload", "w", "--tracking-uri", store.tracking_uri)
    finally:
        db.parent.chmod(0o755)
    assert p.returncode == 2
    assert "hot journal" in one_line(p.stderr)


def foreign_alembic_db(path: Path) -> Path:
    """Another application's sqlite database, managed by alembic like MLflow's."""
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))")
        con.execute("INSERT INTO alembic_version VALUES ('3f1a2b4c5d6e')")
        con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        con.execute("INSERT INTO users (name) VALUES ('ada'), ('grace')")
    return path


def test_a_foreign_alembic_sqlite_file_is_refused_untouched_by_every_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = foreign_alembic_db(tmp_path / "other.db")
    before = db.read_bytes()
    uri = f"sqlite:///{db}"
    # From a shell first, as the attack ran it.
    p = refrun_cli("runs", "--workload", "w", "--tracking-uri", uri)
    assert p.returncode == 2, p.stderr
    line = one_line(p.stderr)
    assert f"tracking store {uri}" in line and "not an MLflow store" in line
    assert db.read_bytes() == before
    # Then every command, writers included (a file is there: nothing is created).
    for name, (code, err, _) in run_all(tmp_path, uri, capsys).items():
        assert code == 2, (name, err)
        assert "not an MLflow store" in one_line(err), (name, err)
    assert db.read_bytes() == before
    # No journal, no new store; the writers' creation lock beside it is the one new file.
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["other.db", "other.db.refrun-init.lock", "criteria.toml", "loss.csv", "spool"])


def test_a_read_command_never_creates_missing_mlflow_tables(
        store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An MLflow store lacking tables of the installed MLflow's schema (as an older
    # release's store does): MLflow's client creates and migrates them on opening; a
    # read command refuses.  REFRUN_SQLITE_DIRECT=0: through MLflow's client, where it
    # would happen.
    db = db_of(store.tracking_uri)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute("DROP TABLE IF EXISTS webhooks")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    assert "webhooks" not in tables and "experiments" in tables
    before = db.read_bytes()
    monkeypatch.setenv("REFRUN_SQLITE_DIRECT", "0")
    p = subprocess.run([sys.executable, "-m", "refrun", "runs", "--workload", "w",
                        "--tracking-uri", store.tracking_uri], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    line = one_line(p.stderr)
    assert "webhooks" in line and "never creates or migrates" in line
    assert db.read_bytes() == before


def damage_a_page(db: Path) -> None:
    """Overwrite the root page of the ``experiments`` table with noise (the header page
    and the schema stay intact, so the file still opens)."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'experiments'"
                           ).fetchone()[0]
    with db.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes([0xA5]) * page_size)


def test_a_store_with_damaged_pages_is_never_written_to(
        store, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    db = db_of(store.tracking_uri)
    damage_a_page(db)
    before = db.read_bytes()
    argv = commands(tmp_path, store.tracking_uri)
    assert main(argv["import"]) == 2
    assert "corrupt" in one_line(capsys.readouterr().err)
    # A trainer: start_run refuses the store in one warning and trains offline; the
    # store is not written to.
    run = refrun.start_run("w", "reference", hardware="cpu", seed=0,
                           tracking_uri=store.tracking_uri, spool_dir=tmp_path / "sp",
                           snapshot_environment=False, delivery="thread")
    with run:
        run.log_metrics(0, {"loss": 1.0})
    assert run.run_id is None
    assert "corrupt (damaged pages" in caplog.text
    assert db.read_bytes() == before
    # A reader meets the damage in one line too.
    code = main(argv["runs"])
    err = capsys.readouterr().err
    assert code == 2 and "corrupt" in one_line(err), err


def test_a_dangling_symlink_as_the_store_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    link = tmp_path / "mlflow.db"
    link.symlink_to(tmp_path / "gone" / "mlflow.db")
    uri = f"sqlite:///{link}"
    for name, (code, err, _) in run_all(tmp_path, uri, capsys).items():
        assert code == 2, (name, err)
        assert "dangling symbolic link" in one_line(err), (name, err)
    run = refrun.start_run("w", "reference", hardware="cpu", seed=0, tracking_uri=uri,
                           spool_dir=tmp_path / "sp", snapshot_environment=False,
                           delivery="thread")
    assert run.run_id is None  # refused at start (was: 103 s of MLflow's retries)
    assert "dangling symbolic link" in caplog.text
    run.close()
    assert link.is_symlink() and not (tmp_path / "gone").exists()
    shutil.rmtree(tmp_path / "sp", ignore_errors=True)
