"""The same guarantees against a tracking server backed by a real PostgreSQL.

Teams outgrow sqlite by pointing refrun at an `mlflow server` with a PostgreSQL backend;
nothing in refrun changes. These tests start a throw-away PostgreSQL cluster and check
that re-delivery stays exactly-once on it (its primary key rejects the duplicate batch,
MLflow retries only the new points) and that a server on it can die mid-run.
"""

from __future__ import annotations

import sys
import threading

import pytest
from mlflow.tracking import MlflowClient

import refrun
from refrun.recording import delivery
from refrun.recording.spool import Cursor, list_spools
from tests.conftest import MlflowServer, free_port
from tests.test_durability import _assert_exactly_once, _loop

pytestmark = pytest.mark.server


def test_redelivery_on_postgres_store_is_not_duplicated(postgres, tmp_path):
    run = refrun.start_run(workload="pg", role="candidate", tracking_uri=postgres.uri,
                           spool_dir=tmp_path / "spool", delivery="thread",
                           flush_interval_s=0.05)
    for step in range(1500):
        run.log(step, loss=float(step) / 7)
    run._writer.stop()
    spool = list_spools(tmp_path / "spool")[0]
    client = MlflowClient(postgres.uri)
    run_id = delivery.ensure_run(spool)
    delivery.deliver_points(spool, client, run_id)
    spool.write_cursor(Cursor())  # a crash after log_batch, before the cursor: send all again
    delivery.deliver_points(spool, client, run_id)
    assert run.close() is True
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, s / 7) for s in range(1500)]


def test_postgres_backed_server_killed_mid_run(postgres, tmp_path):
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root, free_port())
    server.command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres.uri,
        "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
        "--port", str(server.port), "--workers", "1",
    ]
    server.start()
    restarted = threading.Event()

    def chaos(step: int) -> None:
        if step == 60:
            server.kill()
        if step == 120:
            threading.Thread(target=lambda: (server.start(), restarted.set()),
                             daemon=True).start()

    try:
        with refrun.start_run(workload="pg", role="candidate", tracking_uri=server.url,
                              spool_dir=tmp_path / "spool", flush_interval_s=0.1) as run:
            durations = _loop(run, 250, chaos)
            assert restarted.wait(120)
        assert max(durations) < 0.5
        client = MlflowClient(server.url)
        _assert_exactly_once(client, run.run_id, 250)
        assert client.get_run(run.run_id).info.status == "FINISHED"
        # The same run read straight from PostgreSQL: the server really stored it there.
        assert MlflowClient(postgres.uri).get_run(run.run_id).info.status == "FINISHED"
    finally:
        server.kill()
