"""Sign-off against a real ``mlflow server --app-name basic-auth`` on 127.0.0.1: the
authenticated user is recorded (not what ``--by`` says), and a user without write
permission on the experiment cannot sign off (one line, exit 2, nothing recorded)."""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
from acceptance_helpers import N, base_loss, error_line, record, write_criteria
from conftest import MlflowServer, free_port
from mlflow.server import get_app_client
from mlflow.tracking import MlflowClient
from werkzeug.security import generate_password_hash

from refrun.cli import main

ADMIN, ADMIN_PW = "admin", "admin-Password-1234"
ALICE, ALICE_PW = "alice", "alice-Password-1234"
BOB, BOB_PW = "bob", "bob-Password-12345"

BODY = """
[[criteria]]
id = "loss"
level = "L1"
kind = "closeness"
metric = "loss"
abs_tol = 0.1
"""


def _as(monkeypatch: pytest.MonkeyPatch, user: str, password: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def _cheap_hash(server: MlflowServer, user: str, password: str) -> None:
    """Store ``user``'s password hash with one PBKDF2 round instead of werkzeug's default
    scrypt: the server still checks the password on every request (a wrong one is refused,
    asserted below), but each check costs microseconds instead of ~0.5-3 s of CPU, which
    made this test take minutes on a busy machine."""
    hashed = generate_password_hash(password, method="pbkdf2:sha256:1")
    with contextlib.closing(sqlite3.connect(server.root / "auth.db")) as con, con:
        assert con.execute("UPDATE users SET password_hash = ? WHERE username = ?",
                           (hashed, user)).rowcount == 1


@pytest.fixture
def auth_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "server"
    root.mkdir()
    ini = root / "basic_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = sqlite:///{root}/auth.db\n"
                   f"admin_username = {ADMIN}\nadmin_password = {ADMIN_PW}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
                   encoding="utf-8")
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(ini))
    # The auth app's CSRF protection needs a static key (any value, for this test only).
    monkeypatch.setenv("MLFLOW_FLASK_SERVER_SECRET_KEY", "refrun-test-" + root.name)
    port = free_port()
    server = MlflowServer(root, port, command=[
        sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
        "--backend-store-uri", f"sqlite:///{root}/server.db",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1"])
    server.start(timeout=240)  # polls /health until it answers
    _cheap_hash(server, ADMIN, ADMIN_PW)
    try:
        yield server
    finally:
        server.kill()


def test_signoff_records_the_authenticated_user(auth_server, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys) -> None:
    uri = auth_server.url
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spool = tmp_path / "spool"
    _as(monkeypatch, ADMIN, ADMIN_PW)
    rng = np.random.default_rng(0)
    ref = record(uri, spool, "reference", {"loss": base_loss() + rng.normal(0, 0.01, N)})
    cand = record(uri, spool, "candidate", {"loss": base_loss() + rng.normal(0, 0.01, N)},
                  seed=1)
    crit = write_criteria(tmp_path, BODY)
    assert main(["accept", "--criteria", str(crit), "--reference", ref.run_id,
                 "--candidate", cand.run_id, "--tracking-uri", uri]) == 0
    comp = capsys.readouterr().out.split("recorded on comparison run ")[1].split()[0]
    client = MlflowClient(uri)
    experiment = client.get_run(comp).info.experiment_id
    auth = get_app_client("basic-auth", tracking_uri=uri)
    auth.create_user(ALICE, ALICE_PW)
    auth.create_user(BOB, BOB_PW)
    _cheap_hash(auth_server, ALICE, ALICE_PW)
    _cheap_hash(auth_server, BOB, BOB_PW)
    auth.grant_user_permission(ALICE, "experiment", experiment, "EDIT")

    # Bob can read (default READ) but not write: refused before anything is recorded.
    _as(monkeypatch, BOB, BOB_PW)
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Alice",
                 "--tracking-uri", uri]) == 2
    err = error_line(capsys.readouterr().err)
    assert f"user 'bob' may not sign off comparison {comp}: permission READ on experiment " \
           f"{experiment} (needs EDIT or MANAGE)" in err
    _as(monkeypatch, ADMIN, ADMIN_PW)
    assert not any(k.startswith("refrun.signoff.") for k in client.get_run(comp).data.tags)

    # Alice may: her authenticated name is recorded, whatever --by says.
    _as(monkeypatch, ALICE, ALICE_PW)
    assert main(["signoff", "--comparison", comp, "--decision", "accept", "--by", "Mallory",
                 "--tracking-uri", uri]) == 0
    assert "by alice (mlflow-basic-auth)" in capsys.readouterr().out
    tags = MlflowClient(uri).get_run(comp).data.tags
    assert tags["refrun.signoff.by"] == ALICE
    assert tags["refrun.signoff.authentication"] == "mlflow-basic-auth"
    assert main(["verify", comp, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "by alice (mlflow-basic-auth)" in out and "unchanged" in out

    # Wrong credentials: one line, exit 2.
    _as(monkeypatch, ALICE, "not-her-password-000")
    assert main(["signoff", "--comparison", comp, "--decision", "reject",
                 "--tracking-uri", uri]) == 2
    assert "requires authentication" in capsys.readouterr().err
