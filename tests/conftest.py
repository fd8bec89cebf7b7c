"""Shared fixtures: a real sqlite MLflow store per test, and a real `mlflow server`."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Keep tests away from the user's own store and spool.
os.environ.pop("MLFLOW_TRACKING_URI", None)
# On a busy CI machine a run's delivery can pause for longer than close()'s default wait
# (a few seconds without progress); tests that check a run right after close() need it done.
# Likewise start_run's wait for a server. Tests of the bounded waits pass them explicitly.
os.environ.setdefault("REFRUN_CLOSE_TIMEOUT_S", "300")
os.environ.setdefault("REFRUN_START_WAIT_S", "120")
# The delivery process yields the CPU to training (nice +10) in use; beside two CPU-bound
# processes at nice 0 it then gets ~10 % of a core and every test that waits for delivery
# waits on it (a fresh-clone suite beside two spinners passed a third of its tests in 42
# min).  The tests not about that priority run it at the trainer's; test_delivery_priority
# checks the default.
os.environ.setdefault("REFRUN_DELIVERY_NICE", "0")
# `mlflow server` (3.x) starts seven job-runner processes (huey consumers for MLflow's GenAI
# jobs), each importing MLflow: ~5 s more to start and ~15-20 s of CPU per server on two
# cores.  refrun never submits such a job; the tracking and artifact APIs the tests use are
# the same without them.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


DURATIONS = Path(__file__).with_name("durations.json")
# A file that durations.json does not know yet (a new one): guessed from its markers.
_GUESS_SLOW_S, _GUESS_S = 60.0, 5.0


def file_durations() -> dict[str, float]:
    """Seconds each test file took in a measured run of the whole suite, by path relative
    to the repository (tests/durations.json; `benchmarks/bench_suite.py --write` makes it)."""
    try:
        return json.loads(DURATIONS.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slowest files first (stable within a file): `make test` hands whole files to two
    # workers in collection order (--dist loadfile, so a module's fixtures run once), and a
    # long file picked up last leaves one worker idle while the other finishes it.  The
    # order comes from measured seconds; a file not measured yet counts as slow if it has
    # a slow test.
    known = file_durations()
    root = Path(str(config.rootpath))
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def seconds(path: Path) -> float:
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if rel in known:
            return known[rel]
        return _GUESS_SLOW_S if path in slow_files else _GUESS_S

    cost = {path: seconds(path) for path in {item.path for item in items}}
    items.sort(key=lambda item: -cost[item.path])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timings", metavar="PATH", default=None,
                     help="write every test phase's worker, start, stop and duration to "
                          "PATH (JSON; benchmarks/bench_suite.py reads it)")


_TIMINGS: list[dict] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Recorded by the controlling process (under xdist each report comes with the worker
    # that ran it); a worker's own call of this hook has no `node` and is left out there.
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", None)
    if node is None and os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _TIMINGS.append({"nodeid": report.nodeid, "when": report.when,
                     "worker": worker or "main", "outcome": report.outcome,
                     "start": getattr(report, "start", None),
                     "stop": getattr(report, "stop", None),
                     "duration": report.duration})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--timings")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and _TIMINGS:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"tests": _TIMINGS}), encoding="utf-8")
    # The interpreter's last collection walks the whole heap the suite built (torch, jax,
    # MLflow: ~3 GB, about 1.5 min on a busy machine) only to free memory the process is
    # about to return anyway; frozen objects are skipped by it.
    gc.freeze()


@pytest.fixture(scope="session")
def digits_quick():  # -> builds.TrainedStore
    """The digits pipeline's --quick runs (the plan and reference seeds 0-7), trained once
    into a cached store (tests/builds.py); a test that records into it uses a copy."""
    from builds import digits_quick_store

    return digits_quick_store()


@pytest.fixture(scope="session")
def example_training():  # -> builds.TrainedStore
    """The reduced plan of mlruns.example, trained by its generator's own training step
    once into a cached store (tests/builds.py; the digits build starts from it)."""
    from builds import example_training_store

    return example_training_store()[0]


@pytest.fixture
def deliver_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run the test starts delivers from a thread of its own process
    (``REFRUN_DELIVERY=thread``), subprocesses the test starts included.

    A delivery process per run is a Python start and refrun's imports, competing with the
    test's training for the two cores: 2-4 s a run, most of the time of a module that
    starts a run per test (test_torch_probe.py: 72 s with a process each, 11 s without).
    Modules whose subject is what a probe or the session records -- the same delivery code
    writes it either way -- use this (``pytestmark``); the delivery process itself is the
    subject of test_durability.py, test_delivery_priority.py and test_recording.py, and
    the default of test_session.py's runs."""
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")


@dataclass
class Store:
    """A real sqlite MLflow store and a spool directory inside the test's tmp_path."""

    tmp: Path
    tracking_uri: str
    spool_dir: Path

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)

    def trainer_env(self) -> dict[str, str]:
        """The environment of a training script run in a subprocess: this store, this
        spool directory, and refrun from this checkout's ``src``."""
        return {**os.environ, "MLFLOW_TRACKING_URI": self.tracking_uri,
                "REFRUN_SPOOL_DIR": str(self.spool_dir),
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                               os.environ.get("PYTHONPATH", "")])}

    def points(self, run_id: str, metric: str, allow_gaps: bool = False
               ) -> list[tuple[int, float]]:
        """``(step, value)`` of one metric as every reader gets it (``load_run``: the curves
        artifact, counters a probe wrote sparsely made dense), in logging order; a run with
        points missing is refused unless ``allow_gaps``."""
        from refrun.comparison import load_run

        run = load_run(run_id, [metric], tracking_uri=self.tracking_uri, progress=False,
                       allow_gaps=allow_gaps)
        if metric not in run.metric_names:
            return []
        steps, values, seq = run.series(metric)
        order = sorted(range(len(seq)), key=lambda i: int(seq[i]))
        return [(int(steps[i]), float(values[i])) for i in order]

    def artifact_text(self, run_id: str, name: str) -> str:
        """Artifact ``name`` of ``run_id`` as text, downloaded into a new directory under
        the test's own (without a destination MLflow makes a temporary directory that
        nobody removes)."""
        dest = tempfile.mkdtemp(dir=self.tmp)
        return Path(self.client().download_artifacts(run_id, name, dest)).read_text()


_TEMPLATE_DB: list[Path] = []  # the session's migrated store, created on first use


def migrated_sqlite(db: Path, factory: pytest.TempPathFactory) -> str:
    """A sqlite MLflow store at ``db``, already created and migrated; returns its URI.

    Creating a store runs MLflow's ~50 alembic migrations (2-3 s on a quiet 2-core machine,
    over 10 s on a busy one), once per test that opens a new store.  The session migrates
    one template and each test gets a byte copy of it.  The default experiment's artifact
    location is rewritten to what MLflow would have chosen here (``<cwd>/mlruns/0``, the
    fixture's cwd being the store's directory).  Tests of a *new* store's first use mark
    themselves ``fresh_store``.
    """
    if not _TEMPLATE_DB:
        from mlflow.tracking import MlflowClient

        template = factory.mktemp("template-store") / "mlflow.db"
        MlflowClient(f"sqlite:///{template}").search_experiments()
        _TEMPLATE_DB.append(template)
    shutil.copyfile(_TEMPLATE_DB[0], db)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                    (str(db.parent / "mlruns" / "0"),))
    return f"sqlite:///{db}"


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory:
          pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Store:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    if request.node.get_closest_marker("fresh_store") is None:
        uri = migrated_sqlite(tmp_path / "mlflow.db", tmp_path_factory)
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
    """A server of the test's own: for tests that stop, kill or break it."""
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root, free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server per worker process, started on first use (each start imports MLflow in
    a new process: 5-20 s on a busy 2-core machine).  For tests that only record into it
    and read back; never stop or break it (use ``mlflow_server``), and read only what the
    test itself wrote (other tests of the worker write there too)."""
    root = tmp_path_factory.mktemp("shared-server")
    server = MlflowServer(root, free_port())
    server.start(timeout=240)  # first use may land beside a training build
    try:
        yield server
    finally:
        server.kill()


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    return found[0].parent if found else None


@dataclass(frozen=True)
class Postgres:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (Debian's server binaries), and the
    database ``db`` in it that a test uses."""

    bindir: Path
    data: Path
    port: int
    db: str = "mlflow"

    @property
    def uri(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{self.db}"

    def _run(self, *cmd: str) -> None:
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_postgres, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        b = self.bindir
        self._run(str(b / "initdb"), "-D", str(self.data / "db"), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8")
        self._run(str(b / "pg_ctl"), "-D", str(self.data / "db"), "-l",
                  str(self.data / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1", "start")
        self.create_database(self.db)

    def create_database(self, name: str) -> None:
        self._run(str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                  "-U", "postgres", name)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data / "db"), "-m",
                      "immediate", "stop")


@pytest.fixture
def postgres(postgres_cluster: Postgres, request: pytest.FixtureRequest) -> Postgres:
    """A new, empty database of the worker's cluster for each test (what MLflow sees of
    a new PostgreSQL server: no tables yet).  The cluster itself is started once per
    worker (initdb and start: several seconds); no test stops it."""
    name = f"t{len(_PG_DATABASES)}"
    _PG_DATABASES.append(request.node.nodeid)
    postgres_cluster.create_database(name)
    return dataclasses.replace(postgres_cluster, db=name)


_PG_DATABASES: list[str] = []  # the tests that got a database of this worker's cluster


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Postgres]:
    bindir = _postgres_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries missing: `make test` installs them")
        pytest.skip("PostgreSQL server binaries not installed "
                    "(scripts/bootstrap.sh --with-test-deps installs them)")
    # Outside pytest's 0700 tmp tree: the server runs as the postgres user.
    data = Path(tempfile.mkdtemp(prefix="refrun-pg-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    pg = Postgres(bindir, data, free_port())
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(data, ignore_errors=True)
