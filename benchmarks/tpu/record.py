"""Record every pipeline's JAX port on the TPU (``plan.py``), in one process: the chip is
opened once (~10 s on a TPU VM) and each run is the port's own ``main(argv)`` with the
matmul precision set by ``jax.config.update`` (the way users set it, and the way that
left it unrecorded before).  Then one known matmul load recorded through the probe, the
cross-check of the chip busy fraction.

    python benchmarks/tpu/record.py --store /tmp/tpu-store [--only digits] [--dry-run]

Run from the clone's root on the TPU machine (``benchmarks/tpu/run.sh`` does).  The store
is a sqlite MLflow store in ``--store`` (its artifacts beside it: MLflow puts a sqlite
store's artifacts under ``./mlruns`` of the working directory, so the script changes into
``--store``).  ``manifest.json`` there lists each run: variant, precision, run id, seconds,
error.  A run that raises is listed with its error and the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import time
import traceback
from importlib import import_module
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import plan  # noqa: E402

MATMUL_N = 4096  # the known load on a TPU: bf16 N x N matmuls (2 N^3 flops each)
MATMUL_N_CPU = 256  # on the CPU (a dry check of the script): 4096^3 would take minutes


def set_precision(precision: str) -> None:
    """JAX's default matmul precision for the next run: ``default`` (None: the
    platform's own) or ``highest``."""
    import jax

    jax.config.update("jax_default_matmul_precision",
                      None if precision == "default" else precision)


def record_variant(v: plan.TpuVariant, uri: str, spool: str) -> dict[str, object]:
    """Train and record one variant in this process; its manifest row."""
    set_precision(v.precision)
    out = io.StringIO()
    t0 = time.perf_counter()
    row: dict[str, object] = {"workload": v.workload, "variant": v.name,
                              "base": v.base.name, "precision": v.precision,
                              "defects": list(v.base.defects)}
    try:
        with contextlib.redirect_stdout(out):
            rc = import_module(v.base.module()).main(v.argv(tracking_uri=uri,
                                                            spool_dir=spool))
        row["rc"] = rc
    except BaseException as exc:  # one failing variant must not stop the others
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        set_precision("default")
    row["seconds"] = round(time.perf_counter() - t0, 2)
    m = re.search(r"run ([0-9a-f]{32})", out.getvalue())
    row["run_id"] = m.group(1) if m else None
    row["stdout_tail"] = out.getvalue()[-400:]
    return row


def matmul_check(uri: str, steps: int = 300) -> list[dict[str, object]]:
    """The chip busy fraction cross-check: two runs whose steps are a known matmul load
    recorded through ``refrun.jax.instrument``: ``dense`` (8 matmuls a step, waited for:
    busy close to 100 %) and ``sparse`` (1 matmul, waited for, then the host sleeps 3 ms).
    The expected busy fraction is computed from the chip's own matmul time measured
    beforehand (20 back-to-back matmuls, timed by the host) and the median of the steps'
    wall times (timed here, each step waited for): ``matmuls x t_matmul / median wall``.
    The median, not the mean: one step of a short run holds the profiler window's stall
    (~1.5 s on the TPU v5e), which a mean spreads over every step (the first record run's
    expected 21.5 % and 2.7 % against a read 99.6 % and 16.6 %)."""
    import jax
    import jax.numpy as jnp

    import refrun
    import refrun.jax

    mm = jax.jit(lambda a, b: a @ b)
    n = MATMUL_N if jax.default_backend() != "cpu" else MATMUL_N_CPU
    a = jnp.ones((n, n), jnp.bfloat16)
    mm(a, a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        c = mm(a, a)
    c.block_until_ready()
    t_mm = (time.perf_counter() - t0) / 20
    rows = []
    for name, per_step, sleep_s in (("dense", 8, 0.0), ("sparse", 1, 0.003)):
        with refrun.start_run(workload="tpu-matmul-check", role="candidate",
                              hardware="tpu-v5e", backend="jax", seed=0, planned_steps=steps,
                              tracking_uri=uri, run_name=f"matmul-{name}",
                              params={"matmul_n": n, "per_step": per_step,
                                      "sleep_s": sleep_s}) as run:
            probe = refrun.jax.instrument(run, step_fns=[mm])
            w0 = time.perf_counter()
            walls = []
            for n in range(steps):
                t = time.perf_counter()
                with probe.step(n):
                    for _ in range(per_step):
                        c = mm(a, a)
                    probe.log(loss=c[0, 0].astype(jnp.float32))
                c.block_until_ready()
                if sleep_s:
                    time.sleep(sleep_s)
                walls.append(time.perf_counter() - t)
            mean_wall = (time.perf_counter() - w0) / steps
            probe.close()
            run_id = run.run_id
        wall = statistics.median(walls)
        rows.append({"variant": f"matmul-{name}", "run_id": run_id, "t_matmul_s": t_mm,
                     "wall_per_step_s": wall, "mean_wall_per_step_s": mean_wall,
                     "max_wall_per_step_s": max(walls),
                     "expected_busy_pct": 100.0 * min(1.0, per_step * t_mm / wall)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, type=Path)
    ap.add_argument("--only", action="append", choices=plan.WORKLOADS, default=[])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    ap.add_argument("--no-matmul-check", action="store_true")
    args = ap.parse_args(argv)
    variants = [v for w in (args.only or plan.WORKLOADS) for v in plan.plan(w)]
    if args.dry_run:
        for v in variants:
            print(v.workload, v.name, " ".join(v.argv(tracking_uri="URI", spool_dir=None)))
        return 0
    store = args.store.resolve()
    store.mkdir(parents=True, exist_ok=True)
    os.chdir(store)  # MLflow's ./mlruns: the artifacts land beside the store
    uri = f"sqlite:///{store / 'mlflow.db'}"
    spool = str(store / "spool")
    import jax

    manifest: dict[str, object] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind, "runs": []}
    path = store / "manifest.json"
    for v in variants:
        row = record_variant(v, uri, spool)
        manifest["runs"].append(row)  # type: ignore[union-attr]
        path.write_text(json.dumps(manifest, indent=1))
        print(f"{v.name:<44} {row.get('run_id') or row.get('error')} {row['seconds']} s",
              flush=True)
    if not args.no_matmul_check:
        try:
            manifest["matmul_check"] = matmul_check(uri)
        except Exception as exc:  # the recordings above stand on their own
            manifest["matmul_check_error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(manifest.get("matmul_check") or manifest.get("matmul_check_error")),
              flush=True)
    manifest["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    path.write_text(json.dumps(manifest, indent=1))
    failed = [r["variant"] for r in manifest["runs"] if not r.get("run_id")]  # type: ignore
    print(f"{len(variants) - len(failed)}/{len(variants)} runs recorded"
          + (f"; failed: {failed}" if failed else ""), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
