"""Load: concurrent trainers logging fast into one `mlflow server` on PostgreSQL.

Starts a throw-away PostgreSQL cluster and an `mlflow server` on it (127.0.0.1), then N
trainer processes (default 8) that each log 5 metrics a step at a paced rate (default
2,000 steps/s) for a bounded time, with the default process delivery.  Every run is then
read back and checked: points accepted by the session, rows in its curves artifact, points
in MLflow's bounded view, duplicates in either, and the slowest single ``log`` call.

Usage: python benchmarks/bench_load.py [--trainers 8] [--rate 2000] [--seconds 10]
(needs PostgreSQL's server binaries, as tests/test_postgres.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from refrun import schema
from refrun.store.curves import read_curves
from tests.conftest import MlflowServer, Postgres, _postgres_bin, free_port

TRAINER = textwrap.dedent("""
    import json, sys, time, refrun
    uri, rate, seconds, name = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    run = refrun.start_run(workload="load", role="candidate", run_name=name,
                           tracking_uri=uri, snapshot_environment=False)
    stall, steps = 0.0, 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        if now - t0 >= seconds:
            break
        due = int((now - t0) * rate)  # paced: log every step that is due
        while steps < due:
            a = time.perf_counter()
            run.log(steps, loss=1.0 / (steps + 1), lr=0.1, gnorm=float(steps % 97),
                    tokens=float(steps), ppl=2.0)
            stall = max(stall, time.perf_counter() - a)
            steps += 1
        time.sleep(0.0005)
    elapsed = time.perf_counter() - t0
    c0 = time.perf_counter()
    run.close()
    print(json.dumps({"run_id": run.run_id, "steps": steps, "rate": steps / elapsed,
                      "stall_s": stall, "dropped": run.points_dropped,
                      "close_s": time.perf_counter() - c0}), flush=True)
""")
METRICS = ("loss", "lr", "gnorm", "tokens", "ppl")


def main() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainers", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2000.0, help="steps/s per trainer")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    bindir = _postgres_bin()
    if bindir is None:
        sys.exit("PostgreSQL server binaries not found (scripts/bootstrap.sh --with-test-deps)")
    tmp = Path(tempfile.mkdtemp(prefix="refrun-load-"))
    data = Path(tempfile.mkdtemp(prefix="refrun-load-pg-"))
    if os.geteuid() == 0:
        import shutil

        shutil.chown(data, "postgres")
    pg = Postgres(bindir, data, free_port())
    pg.start()
    server = MlflowServer(tmp, free_port())
    server.command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", pg.uri,
                      "--artifacts-destination", str(tmp / "artifacts"), "--host",
                      "127.0.0.1", "--port", str(server.port), "--workers", "2"]
    try:
        server.start(timeout=300)
        script = tmp / "trainer.py"
        script.write_text(TRAINER)
        # Wait for the delivery to finish at close (this measures completeness, not exit).
        env = {**os.environ, "REFRUN_SPOOL_DIR": str(tmp / "spool"),
               "REFRUN_CLOSE_TIMEOUT_S": "600"}
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(script), server.url, str(args.rate),
                                   str(args.seconds), f"t{i}"], stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=tmp) for i in range(args.trainers)]
        results = [json.loads(p.communicate(timeout=3600)[0].strip().splitlines()[-1])
                   for p in procs]
        wall = time.perf_counter() - t0
        client = MlflowClient(server.url)
        print(f"{args.trainers} trainers x 5 metrics, paced at {args.rate:.0f} steps/s for "
              f"{args.seconds:.0f} s; PostgreSQL-backed mlflow server; wall {wall:.0f} s")
        print(f"{'run':<5}{'steps/s':>9}{'accepted':>10}{'in curves':>11}{'curve dups':>11}"
              f"{'in MLflow':>11}{'MLflow dups':>12}{'dropped':>9}{'status':>10}"
              f"{'max log (ms)':>13}{'close (s)':>10}")
        for i, r in enumerate(results):
            run = client.get_run(r["run_id"])
            curves = read_curves(Path(client.download_artifacts(
                r["run_id"], schema.ARTIFACT_CURVES, str(tmp / f"dl{i}"))))
            curve_dups = int(curves.duplicated(["metric", "step"]).sum())
            view, view_dups = 0, 0
            for m in METRICS:
                steps = [x.step for x in client.get_metric_history(r["run_id"], m)]
                view += len(steps)
                view_dups += len(steps) - len(set(steps))
            print(f"t{i:<4}{r['rate']:>9.0f}{r['steps'] * 5:>10}{len(curves):>11}"
                  f"{curve_dups:>11}{view:>11}{view_dups:>12}{r['dropped']:>9}"
                  f"{run.info.status:>10}{r['stall_s'] * 1e3:>13.2f}{r['close_s']:>10.1f}")
    finally:
        server.kill()
        pg.stop()


if __name__ == "__main__":
    main()
