"""refrun.jax.instrument on real JAX (CPU): compilations, values, step time, transfers,
placement, several devices and the persistent compilation cache.

Scenarios that need a fresh JAX (4 CPU devices; a persistent cache configured before the
first compilation) run in a subprocess: tests/jax_helpers/probe_worker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring as jax_monitoring  # listener lists (no public getter)

import refrun
import refrun.jax
from refrun import schema
from refrun.errors import RefrunInputError

# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")

WORKER = Path(__file__).parent / "jax_helpers" / "probe_worker.py"


def make_train_step():
    """A freshly jitted step (its own compilation cache) for each test."""

    def train_step(w, x, y):
        def loss_fn(w):
            return jnp.mean((x @ w - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, loss

    return jax.jit(train_step)


def batch(n: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + n)
    return (rng.normal(size=(rows, 3)).astype(np.float32),
            rng.normal(size=rows).astype(np.float32))


def start(store, hardware: str = "cpu") -> refrun.RunSession:
    return refrun.start_run("jax-probe-test", "candidate", hardware=hardware, backend="jax",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False)


def history(store, run_id: str, metric: str) -> list[tuple[int, float]]:
    return store.points(run_id, metric)  # as readers get it (counters made dense)


def values(store, run_id: str, metric: str) -> list[float]:
    return [v for _, v in sorted(history(store, run_id, metric))]


# --- compilations, values, step time ------------------------------------------------------
@pytest.mark.parametrize("named", [True, False], ids=["step_fns", "by-call-site"])
def test_compilations_per_step_values_and_pytrees(store, named: bool) -> None:
    train_step = make_train_step()
    listeners_before = len(jax_monitoring.get_event_duration_listeners())
    run = start(store)
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, params=w, step_fns=[train_step] if named else ())
    # 5 steps of one shape, then 3 new shapes; every step also runs an eager jnp helper
    # on a shape it has not seen, so helpers compile in every step.
    rows = [8] * 5 + [9, 10, 11]
    offset = 100 if named else 200  # helper shapes unseen by the other parametrization
    loop_losses, loop_helpers = [], []
    for n, r in enumerate(rows):
        x, y = (jnp.asarray(a) for a in batch(n, r))
        with probe.step(n):
            w, loss = train_step(w, x, y)
            helper = jnp.arange(n + offset, dtype=jnp.float32).sum()  # eager: compiles
            probe.log(loss=loss, parts=(loss * 2, {"helper": helper}))
        loop_losses.append(loss)
        loop_helpers.append(helper)
    probe.close()
    assert len(jax_monitoring.get_event_duration_listeners()) == listeners_before
    run.close()
    rid = run.run_id

    new_shape = [1.0 if n == 0 or rows[n] != rows[n - 1] else 0.0 for n in range(len(rows))]
    assert values(store, rid, schema.M_COMPILE_GRAPHS) == new_shape
    assert values(store, rid, schema.M_COMPILE_RECOMPILES) == [0.0, *new_shape[1:]]
    assert values(store, rid, schema.M_COMPILE_CACHE_HITS) == [0.0] * len(rows)
    assert all(v >= 1 for v in values(store, rid, "compile/other"))  # helpers, not the step
    assert all(v > 0 for v in values(store, rid, schema.M_COMPILE_TIME))

    # every logged value equals what the loop computed (pytree leaves named by path)
    assert values(store, rid, "loss") == [float(v) for v in loop_losses]
    assert values(store, rid, "parts/0") == [float(v) * 2 for v in loop_losses]
    assert values(store, rid, "parts/1/helper") == [float(np.arange(n + offset).sum())
                                                     for n in range(len(rows))]
    times = values(store, rid, schema.M_STEP_TIME)
    assert len(times) == len(rows) and all(0 < t < 60 for t in times)

    tags = store.client().get_run(rid).data.tags
    assert tags["refrun.perf.step_time_kind"] == "interval"  # entry to next entry
    assert tags[schema.TAG_EXEC_HARDWARE] == "cpu"
    art = store.client().download_artifacts(rid, "refrun/jax_compilations.json",
                                            str(store.tmp))
    compiles = json.loads(Path(art).read_text())
    assert compiles["by_function"]["jit(train_step) [graph]"] == 1
    assert compiles["by_function"]["jit(train_step) [recompile]"] == 3
    assert not any("train_step" in k and "other" in k for k in compiles["by_function"])


def heavy(a):
    return jax.lax.fori_loop(0, 40, lambda i, b: jnp.tanh(b @ a), a).sum()


def test_step_adds_no_blocking_and_time_covers_device_work(store) -> None:
    heavy_jit = jax.jit(heavy)
    a = jnp.ones((500, 500), jnp.float32) / 500
    heavy_jit(a).block_until_ready()  # compile outside the run

    def count_compiles(fn) -> int:
        seen = []
        cb = lambda ev, secs, **kw: seen.append(ev) if ev.endswith(  # noqa: E731
            "backend_compile_duration") else None
        jax.monitoring.register_event_duration_secs_listener(cb)
        try:
            fn()
        finally:
            jax.monitoring.unregister_event_duration_listener(cb)
        return len(seen)

    run = start(store)
    # fresh_caches=False: keep the executable compiled above, so any compilation in the
    # loop would be the probe's doing
    probe = refrun.jax.instrument(run, step_fns=[heavy_jit], fresh_caches=False)
    ready_at_exit, body_s = [], []

    def loop() -> None:
        for n in range(3):
            t0 = time.perf_counter()
            with probe.step(n):
                r = heavy_jit(a)
                probe.log(loss=r)
            body_s.append(time.perf_counter() - t0)
            ready_at_exit.append(r.is_ready())
            r.block_until_ready()  # the loop's own sync, after the step

    compiles_wrapped = count_compiles(loop)
    probe.close()
    run.close()
    # JAX's own compile events: the probe made JAX compile nothing
    assert compiles_wrapped == 0
    # the step returned while the device was still computing: nothing blocked on it
    assert ready_at_exit == [False, False, False]
    # the recorded step time covers the device work, not only the dispatch
    times = values(store, run.run_id, schema.M_STEP_TIME)
    assert all(t > b for t, b in zip(times, body_s, strict=True))


# --- transfers --------------------------------------------------------------------------------
def test_transfer_guard_log_counts_implicit_h2d(store) -> None:
    train_step = make_train_step()
    run = start(store)
    w = jnp.zeros(3)
    train_step(w, *(jnp.asarray(a) for a in batch(0, 8)))  # compile outside the run
    probe = refrun.jax.instrument(run, step_fns=[train_step], transfer_guard="log")
    implicit = []
    for n in range(4):
        x, y = batch(n, 8)
        on_host = n % 2 == 0  # even steps pass NumPy arrays: implicit transfers
        if not on_host:
            x, y = jax.device_put(x), jax.device_put(y)  # explicit, outside the step
        with probe.step(n):
            w, loss = train_step(w, x, y)
            probe.log(loss=loss)
        implicit.append(float(sum(isinstance(v, np.ndarray) for v in (x, y))))
    probe.close()
    run.close()
    assert values(store, run.run_id, schema.M_XFER_H2D) == implicit
    assert store.client().get_run(run.run_id).data.tags["refrun.jax.transfer_guard"] == "log"


def test_transfer_guard_disallow_is_applied_to_the_step(store) -> None:
    train_step = make_train_step()
    run = start(store)
    w = jnp.zeros(3)
    probe = refrun.jax.instrument(run, step_fns=[train_step], transfer_guard="disallow")
    x, y = (jnp.asarray(a) for a in batch(0, 8))
    with probe.step(0):
        w, loss = train_step(w, x, y)
        probe.log(loss=loss)
    with pytest.raises(Exception, match=r"[Dd]isallowed host-to-device"), probe.step(1):
        train_step(w, *batch(1, 8))
    # outside the step the user's own setting applies again
    train_step(w, *batch(2, 8))
    probe.close()
    run.close()
    assert history(store, run.run_id, schema.M_XFER_H2D)[0] == (0, 0.0)


# --- placement, memory, bad input -----------------------------------------------------------
def test_declared_accelerator_on_cpu_is_flagged(store) -> None:
    run = start(store, hardware="tpu-v5e")
    probe = refrun.jax.instrument(run, params={"w": jnp.zeros(3)})
    with probe.step(0):
        probe.log(loss=jnp.float32(1.5))
    probe.close()
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert "tpu-v5e" in tags[schema.TAG_PLACEMENT_WARNING]
    assert any("tpu-v5e" in w["message"] for w in run.warnings)
    placement = json.loads(tags[schema.TAG_PLACEMENT])
    assert placement["params"]["platforms"] == ["cpu"]
    assert "refrun.exec.memory_peak_bytes" not in tags  # memory_stats() is None on CPU


def test_cpu_run_has_no_placement_warning_and_no_memory_monitor(store) -> None:
    run = start(store, hardware="cpu")
    probe = refrun.jax.instrument(run, params=jnp.zeros(3))
    assert not [m for m in probe.monitors if m.name == "jax_memory"]  # CPU: stats are None
    with probe.step(0):
        probe.log(loss=1.0)
    probe.close()
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert schema.TAG_PLACEMENT_WARNING not in tags
    assert run.warnings == []


def test_bad_input(store) -> None:
    run = start(store)
    with pytest.raises(RefrunInputError, match="transfer_guard"):
        refrun.jax.instrument(run, transfer_guard="sometimes")
    with pytest.raises(RefrunInputError, match="step_fns"):
        refrun.jax.instrument(run, step_fns=[3])
    probe = refrun.jax.instrument(run)
    with probe.step(0):
        probe.log(loss=jnp.ones(4), ok=jnp.float32(2.0))  # a vector is not a scalar
    probe.close()
    run.close()
    assert values(store, run.run_id, "ok") == [2.0]
    assert history(store, run.run_id, "loss") == []
    assert any("shape (4,)" in w["message"] for w in run.warnings)


# --- fresh processes: 4 devices, persistent cache ------------------------------------------
def run_worker(scenario: str, tmp: Path, env: dict[str, str] | None = None,
               stderr_out: list[str] | None = None) -> dict:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, str(WORKER), scenario, str(tmp)],
                          capture_output=True, text=True, timeout=240, env=full_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr_out is not None:
        stderr_out.append(proc.stderr)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow  # a fresh JAX + MLflow process: ~10-20 s on a loaded 2-core machine
def test_four_cpu_devices_record_devices_mesh_and_batch_sharding(store) -> None:
    out = run_worker("mesh", store.tmp,
                     {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert out["devices"] == 4
    tags = store.client().get_run(out["run_id"]).data.tags
    assert tags[schema.TAG_EXEC_DEVICES] == "4"
    assert json.loads(tags[schema.TAG_MESH]) == {"data": 4}
    placement = json.loads(tags[schema.TAG_PLACEMENT])
    assert placement["batch"]["devices"] == [f"cpu:{i}" for i in range(4)]
    assert list(placement["batch"]["shardings"]) == [out["batch_sharding"]]
    assert "spec=P('data',)" in out["batch_sharding"]
    assert values(store, out["run_id"], "loss") == out["losses"]
    assert values(store, out["run_id"], schema.M_COMPILE_GRAPHS) == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.slow  # a fresh JAX + MLflow process
def test_persistent_cache_hits_are_not_compilations(store) -> None:
    out = run_worker("cache", store.tmp)
    assert any(f.startswith("jit_train_step") for f in out["cache_files"])
    rid = out["run_id"]
    # step 0 compiles; step 1 (in-memory caches cleared) is served by the persistent cache
    assert values(store, rid, schema.M_COMPILE_GRAPHS) == [1.0, 0.0, 0.0]
    hits = values(store, rid, schema.M_COMPILE_CACHE_HITS)
    assert hits[0] == 0.0 and hits[1] >= 1.0
    assert values(store, rid, "loss") == out["losses"]
    art = store.client().download_artifacts(rid, "refrun/jax_compilations.json", str(store.tmp))
    by_fn = json.loads(Path(art).read_text())["by_function"]
    assert by_fn["jit(train_step) [graph]"] == 1
    assert by_fn["jit(train_step) [cache_hit]"] == 1


@pytest.mark.slow  # a fresh JAX + MLflow process
def test_eager_helpers_and_process_history_never_count_as_step_compilations(store) -> None:
    """Issue 13: an evaluation helper between steps (unary minus, jax.nn.log_softmax) and an
    eager ``-loss`` inside the step are ``compile/other``; the step compiles once, at step 0,
    in every run of the process (the second identical loop included), with or without
    ``step_fns``."""
    out = run_worker("eval_between", store.tmp)
    for r in out["runs"]:
        rid = r["run_id"]
        # one shape, one step function: exactly one compilation, at step 0
        assert values(store, rid, schema.M_COMPILE_GRAPHS) == [1.0, 0, 0, 0, 0, 0], rid
        assert values(store, rid, schema.M_COMPILE_RECOMPILES) == [0.0] * 6, rid
        other = values(store, rid, schema.M_COMPILE_OTHER)
        assert other[2] >= 2 and other[0] >= 1, other  # helper compiled before step 2
        art = store.client().download_artifacts(rid, "refrun/jax_compilations.json",
                                                str(store.tmp / rid))
        doc = json.loads(Path(art).read_text())
        kinds = {e["function"]: e["kind"] for e in doc["events"]}
        assert kinds["jit(log_softmax)"] == "other" and kinds["jit(negative)"] == "other"
        between = {e["function"] for e in doc["events"] if e["where"] == "between_steps"}
        assert "jit(log_softmax)" in between
        assert [k for k in doc["by_function"] if k.endswith(("[graph]", "[recompile]"))] \
            == ["jit(train_step) [graph]"]
        assert values(store, rid, "eval/loss") == r["evals"]
    # counts independent of what ran before: every run records the same per-step counts
    per_run = [values(store, r["run_id"], schema.M_COMPILE_OTHER) for r in out["runs"]]
    assert all(p == per_run[0] for p in per_run), per_run


@pytest.mark.slow  # a fresh JAX + MLflow process (its stderr is the subject)
def test_transfer_log_is_summarised_not_flooded(store) -> None:
    """Issue 15: transfer_guard="log" printed one line per transfer (~12,800 lines for 8
    small runs); now the first 3 are printed, one summary line says how many were not,
    every line is counted per step, and the distinct transfers are in the artifact."""
    err: list[str] = []
    out = run_worker("transfers", store.tmp, stderr_out=err)
    steps, per_step = out["steps"], out["per_step"]
    total = steps * per_step  # two NumPy arrays per step, by construction
    lines = err[0].splitlines()
    assert sum("host-to-device transfer:" in ln for ln in lines) == 3
    summary = [ln for ln in lines if "more JAX host-to-device transfer lines" in ln]
    assert len(summary) == 1 and f"{total - 3} more" in summary[0]
    assert "after-close line" in lines  # stderr restored and passed through
    rid = out["run_id"]
    assert values(store, rid, schema.M_XFER_H2D) == [float(per_step)] * steps
    art = store.client().download_artifacts(rid, schema.ARTIFACT_JAX_TRANSFERS, str(store.tmp))
    doc = json.loads(Path(art).read_text())
    assert doc["total"] == total and doc["printed"] == 3
    assert doc["per_step"] == {str(n): per_step for n in range(steps)}
    # x is float32[8,3], y float32[8]: two distinct transfers, first seen at step 0 (the
    # runtime details a site only once; later lines carry no detail)
    sites = {s["text"].split(", dst_sharding")[0]: s for s in doc["sites"]}
    detailed = sorted(k for k in sites if k.startswith("aval="))
    assert detailed == ["aval=ShapedArray(float32[8,3])", "aval=ShapedArray(float32[8])"]
    assert all(sites[k]["first_step"] == 0 for k in detailed)
    assert sum(s["count"] for s in doc["sites"]) == total
    tags = store.client().get_run(rid).data.tags
    assert tags[schema.TAG_JAX_TRANSFERS] == str(total)


def test_clearing_caches_under_an_open_probe_that_compiled_is_refused(store) -> None:
    """Probes opened together and stepped in turn may each clear JAX's caches at start
    (nothing has compiled yet); once one probe's steps have compiled, a second probe with
    ``fresh_caches=True`` is refused before it clears anything (the first then counts no
    recompilation it did not cause), one with ``fresh_caches=False`` is not, and after the
    first closes the refusal is gone."""
    train_step = make_train_step()
    runs = [start(store) for _ in range(4)]
    first = refrun.jax.instrument(runs[0], step_fns=[train_step])
    early = refrun.jax.instrument(runs[1], step_fns=[train_step])  # nothing compiled yet
    early.close()
    w = jnp.zeros(3)
    for n in range(3):
        x, y = (jnp.asarray(a) for a in batch(n, 8))
        with first.step(n):
            w, loss = train_step(w, x, y)
            first.log(loss=loss)
        if n == 0:
            with pytest.raises(RefrunInputError, match="fresh_caches=False"):
                refrun.jax.instrument(runs[2], step_fns=[train_step])
            keeps = refrun.jax.instrument(runs[2], step_fns=[train_step], fresh_caches=False)
    first.close()
    keeps.close()
    after = refrun.jax.instrument(runs[3], step_fns=[train_step])  # the compiled one closed
    after.close()
    for r in runs:
        r.close()
    assert values(store, runs[0].run_id, schema.M_COMPILE_GRAPHS) == [1.0, 0.0, 0.0]
    assert values(store, runs[0].run_id, schema.M_COMPILE_RECOMPILES) == [0.0, 0.0, 0.0]
