"""Shared fixtures: a real sqlite MLflow store per test, and a real `mlflow server`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Keep tests away from the user's own store and spool.
os.environ.pop("MLFLOW_TRACKING_URI", None)


@dataclass
class Store:
    """A real sqlite MLflow store and a spool directory inside the test's tmp_path."""

    tmp: Path
    tracking_uri: str
    spool_dir: Path

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spool = tmp_path / "spool"
    monkeypatch.setenv("REFRUN_SPOOL_DIR", str(spool))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return Store(tmp_path, uri, spool)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MlflowServer:
    """A real `mlflow server` process on 127.0.0.1 (sqlite backend, local artifacts)."""

    root: Path
    port: int
    proc: subprocess.Popen | None = None
    command: list[str] | None = None  # another server command line (default: below)
    cwd: Path | None = None  # its working directory (relative store paths resolve here)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        cmd = self.command or [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root}/server.db",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_tail = (self.root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server exited: {log_tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not become healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root, free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()
