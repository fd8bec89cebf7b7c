"""The scale-out stack as teams run it, with real processes only: ``mlflow server`` on a
PostgreSQL backend, artifacts proxied (``--serve-artifacts``) into an S3-compatible object
store (moto's standalone S3 server), eight trainers recording through it, the object
store going away mid-run, then ``refrun accept`` and ``refrun report`` reading through
the server.  Nothing may be lost and every run must end FINISHED after recovery.

The outage: the trainers, the server and the test reach the object store only through a
TCP gate on its own port.  The gate is killed mid-run (every connection dropped, the port
refusing: what clients see when an object-store node or its load balancer goes away) and
started again on the same port.  moto keeps its buckets in memory, so killing moto itself
would also delete every object already stored, which no deployed object store does (its
data is on disks); the gate simulates the outage of the service, not the loss of its disks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import MlflowServer, free_port

from refrun import schema
from tests.test_durability import wait_for

TRAINERS = 8
STEPS = 1500
METRICS = ("loss", "grad_norm")
BUCKET = "refrun-artifacts"

TRAINER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, refrun
    k, half, resume = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    role = "candidate" if k == 0 else "reference"
    rng = np.random.default_rng(k)
    with refrun.start_run(workload="scaleout", role=role, hardware="cpu", backend="numpy",
                          seed=k, planned_steps=%(steps)d, flush_interval_s=0.1) as run:
        for step in range(%(steps)d):
            if step == %(steps)d // 2:
                half.touch()           # the test takes the object store away now
                while not resume.exists():
                    time.sleep(0.01)
            loss = 2.3 * np.exp(-step / 400) + 0.2 + 0.002 * rng.standard_normal()
            run.log(step, loss=float(loss), grad_norm=float(1.0 + 0.01 * step))
    print(run.local_id, flush=True)  # the run id may not be known yet on a loaded server
""") % {"steps": STEPS}


class TcpGate:
    """A TCP forwarder on a fixed port in front of ``target``; :meth:`stop` closes the
    port and every connection through it, :meth:`start` opens it again."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        # While the gate is down a bound socket that does not listen keeps the port: Linux
        # refuses connections to it (what an absent service looks like), and no outgoing
        # connection of another process can take the port as its ephemeral local port
        # (which made start() fail with EADDRINUSE on a busy CI machine).
        self._holder: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @staticmethod
    def _bound(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        return s

    def start(self) -> None:
        s = self._bound(self.port)
        s.listen(128)
        self._listener = s
        if self._holder is not None:  # the port is served again: let go of the placeholder
            self._holder.close()
            self._holder = None
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop(self, *, release: bool = False) -> None:
        if self._listener is not None:
            if not release and self._holder is None:
                self._holder = self._bound(self.port)
            self._listener.close()
            self._listener = None
        if release and self._holder is not None:
            self._holder.close()
            self._holder = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture
def object_store(tmp_path: Path) -> Iterator[TcpGate]:
    """moto's standalone S3 server (a real S3 API over HTTP) behind a :class:`TcpGate`."""
    port = free_port()
    log = open(tmp_path / "moto.log", "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    gate = TcpGate(port)
    try:
        def up() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                    return True
            except OSError:
                return proc.poll() is not None  # died: fail below
        wait_for(up, "moto's S3 server", 120)
        assert proc.poll() is None, (tmp_path / "moto.log").read_text()[-2000:]
        gate.start()
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{gate.port}",
                     aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield gate
    finally:
        gate.stop(release=True)
        proc.kill()
        proc.wait(timeout=30)


S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
          "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.e2e
@pytest.mark.slow  # PostgreSQL, an S3 server, an mlflow server, 8 trainers: ~1 min quiet
def test_eight_trainers_through_postgres_and_s3_survive_an_object_store_outage(
        postgres, object_store: TcpGate, tmp_path: Path) -> None:
    t_start = time.monotonic()
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root, free_port())
    # One worker: uvicorn's supervisor of several workers kills a worker that answers its
    # health check late, which on a loaded 2-core machine is every worker still importing.
    server.command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres.uri,
        "--serve-artifacts", "--artifacts-destination", f"s3://{BUCKET}/mlflow",
        "--host", "127.0.0.1", "--port", str(server.port), "--workers", "1"]
    s3_env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{object_store.port}"}
    old_env = {k: os.environ.get(k) for k in s3_env}
    os.environ.update(s3_env)  # the server inherits them
    try:
        server.start(timeout=240)
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    procs: list[subprocess.Popen] = []
    try:
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.url,
               "REFRUN_SPOOL_DIR": str(tmp_path / "spool"), "REFRUN_KEEP_SPOOL": "1",
               # The trainers use the documented wait; delivery then goes on in the
               # background, retrying while the object store is away.
               "REFRUN_CLOSE_TIMEOUT_S": "5", "REFRUN_DELIVERY_FINAL_TIMEOUT_S": "300",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                              os.environ.get("PYTHONPATH", "")])}
        resume = tmp_path / "resume"
        halves = [tmp_path / f"half-{k}" for k in range(TRAINERS)]
        procs = [subprocess.Popen([sys.executable, str(script), str(k), str(halves[k]),
                                   str(resume)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
                 for k in range(TRAINERS)]
        wait_for(lambda: all(h.exists() for h in halves) or any(
            p.poll() is not None for p in procs), "every trainer half-way", 300)
        object_store.stop()  # the object store goes away mid-run
        t_down = time.monotonic()
        resume.touch()
        outs = [p.communicate(timeout=300) for p in procs]
        assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
        local_ids = [o.split()[0] for o, _ in outs]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.url)

        def delivery_errors() -> int:
            return sum(Path(s, "delivery.log").read_text().count("refrun delivery: error")
                       for s in (tmp_path / "spool").iterdir()
                       if (Path(s) / "delivery.log").exists())

        def finished_ids() -> list[str] | None:
            exp = client.get_experiment_by_name("scaleout")
            runs = {r.data.tags.get(schema.TAG_LOCAL_ID): r for r in client.search_runs(
                [exp.experiment_id], max_results=1000)} if exp else {}
            if all(i in runs and runs[i].info.status == "FINISHED" for i in local_ids):
                return [runs[i].info.run_id for i in local_ids]
            return None

        # The store stays away until background delivery has met it (on a busy machine the
        # trainers' 5 s close wait can pass before any delivery reaches its artifacts), or
        # until every run finished without it, which the assertions below then refuse.
        wait_for(lambda: delivery_errors() > 0 or finished_ids() is not None,
                 "delivery meets the absent object store", 300, every=0.5)
        object_store.start()
        outage_s = time.monotonic() - t_down

        run_ids = wait_for(finished_ids, "every run FINISHED after the object store came back",
                           300)
        t_finished = time.monotonic()
        # Nothing lost: every point of every run in its curves artifact (read back through
        # the server and the object store), each once.
        from refrun.comparison.loading import load_run

        for k, run_id in enumerate(run_ids):
            data = load_run(run_id, tracking_uri=server.url, wait_s=0)
            assert data.source == "artifact"
            c = data.curves
            assert len(c) == STEPS * len(METRICS), (k, len(c))
            for m in METRICS:
                steps = np.sort(c.loc[c["metric"] == m, "step"].to_numpy())
                np.testing.assert_array_equal(steps, np.arange(STEPS))
            assert client.get_run(run_id).data.tags[schema.TAG_DROPPED] == "0"
        # The outage reached delivery: finishing a run was retried while it lasted.
        retries = delivery_errors()
        assert retries >= 1
        # accept and report read everything through the server and the object store.
        crit = tmp_path / "criteria.toml"
        crit.write_text('[[criteria]]\nid = "loss"\nlevel = "L1"\nkind = "closeness"\n'
                        'metric = "loss"\nabs_tol = 0.1\n', encoding="utf-8")
        cli = [sys.executable, "-m", "refrun"]
        accept = subprocess.run([*cli, "accept", "--criteria", str(crit), "--reference",
                                 *run_ids[1:], "--candidate", run_ids[0], "--tracking-uri",
                                 server.url], capture_output=True, text=True, env=env,
                                cwd=tmp_path, timeout=600)
        assert accept.returncode == 0, accept.stdout + accept.stderr
        assert "recorded on comparison run " in accept.stdout
        html = tmp_path / "report.html"
        report = subprocess.run([*cli, "report", "--reference", *run_ids[1:], "--candidate",
                                 run_ids[0], "--html", str(html), "--no-record",
                                 "--tracking-uri", server.url], capture_output=True,
                                text=True, env=env, cwd=tmp_path, timeout=600)
        assert report.returncode == 0, report.stdout + report.stderr
        assert html.stat().st_size > 10_000
        print(f"\nscale-out figures: runs={TRAINERS} points={TRAINERS * STEPS * len(METRICS)}"
              f" outage_s={outage_s:.1f} finished_after_recovery_s="
              f"{t_finished - t_down - outage_s:.1f} delivery_retries={retries}"
              f" total_s={time.monotonic() - t_start:.1f}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.kill()
