"""The JAX probe's amortised hot path (issue 51, item 5), on real JAX (CPU):

* values read in blocks off the training thread are exact and in order, over many
  blocks (a short flush interval), pytrees and host numbers included;
* a value the loop donates after logging it is still exact (the probe copies it on the
  device when it learns the name is donated), and one deleted later than the next step
  is said lost in a warning, its later values exact;
* the probe's own compilations (the stack that reads values of a new dtype) are never
  counted: the run's counts equal what this thread saw JAX compile;
* ``perf/step_time_s`` is the interval from a step's entry to the next one's (the last
  step's to ``close``).
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import refrun
import refrun.jax
from refrun import schema
from refrun.comparison.loading import dense_counters, sparse_counters
from refrun.errors import RefrunInputError
from refrun.probes.jax_blocks import (
    ColumnReader,
    LostValue,
    Tree,
    columns,
    counter_changes,
    step_intervals,
)

# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")


def start(store, **kw) -> refrun.RunSession:
    return refrun.start_run("jax-blocks", "candidate", hardware="cpu", backend="jax",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False, **kw)


def history(store, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted(store.points(run_id, metric))  # as readers get it (counters made dense)


def values(store, run_id: str, metric: str) -> list[float]:
    return [v for _, v in history(store, run_id, metric)]


def test_pure_parts() -> None:
    assert step_intervals([1.0, 1.5, 3.0], None) == [0.5, 1.5]
    assert step_intervals([1.0, 1.5, 3.0], 3.25) == [0.5, 1.5, 0.25]
    assert step_intervals([], 2.0) == []
    # deltas at the rows where the counters moved (row 0 first when asked for)
    assert counter_changes((1, 0), [(0, (1, 2)), (1, (4, 2)), (3, (4, 5))]) == [
        (0, [0.0, 2.0]), (1, [3.0, 0.0]), (3, [0.0, 3.0])]
    assert counter_changes((1, 0), [(2, (1, 1))], with_first=True) == [
        (0, [0.0, 0.0]), (2, [0.0, 1.0])]
    assert counter_changes((1, 0), [], with_first=False) == []


def test_a_block_becomes_one_column_per_metric_read_in_place() -> None:
    """Pytree leaves are split into their own columns (in log order, steps kept), host
    numbers become floats, arrays their values, and a deleted array stays LOST (not a
    nan that would be recorded)."""
    f = jax.jit(lambda i: (i * 2.0, {"a": i + 0.5, "b": jnp.int32(7) * i.astype(jnp.int32)}))
    outs = [f(jnp.float32(i)) for i in range(3)]
    gone = f(jnp.float32(9))[0]
    gone.delete()
    tree = jax.tree_util.tree_flatten(outs[0][1])[1]
    block = [(n, "loss", outs[n][0]) for n in range(3)]
    block += [(n, "g", Tree(tree, jax.tree_util.tree_leaves(outs[n][1]))) for n in range(3)]
    block += [(3, "loss", gone), (3, "h", 5), (4, "h", 0.25)]
    cols = columns([x for entry in block for x in entry],  # flat, as the probe keeps it
                   lambda name, _: [f"{name}/a", f"{name}/b"])
    assert list(cols) == ["loss", "g/a", "g/b", "h"]
    ColumnReader().read(cols)
    assert cols["loss"].steps == [0, 1, 2, 3]
    assert cols["loss"].values[:3] == [0.0, 2.0, 4.0]
    assert type(cols["loss"].values[3]) is LostValue
    assert cols["g/a"].values == [0.5, 1.5, 2.5] and cols["g/a"].logged_as == {"g"}
    assert cols["g/b"].values == [0.0, 7.0, 14.0]
    assert all(type(v) is float for c in ("g/b", "h") for v in cols[c].values)
    assert (cols["h"].steps, cols["h"].values) == ([3, 4], [5.0, 0.25])


def test_sparse_counters_are_made_dense_at_every_step_time() -> None:
    """Each counter gets a point at every step-time point, stamped and ordered as it: its
    written value there (a replayed step's own), else 0; a counter point at no step time
    is kept as written."""
    st = schema.M_STEP_TIME
    rows = [(st, 0, 0.5, 10, 0), (st, 1, 0.4, 11, 1), (st, 2, 0.4, 12, 2),
            ("c", 0, 2.0, 10, 3), ("c", 2, 1.0, 12, 4),  # written after the step times
            (st, 1, 0.6, 13, 5), ("c", 1, 3.0, 13, 6),   # step 1 replayed, with a count
            ("loss", 1, 3.0, 13, 7), ("c", 9, 4.0, 20, 8)]
    curves = pd.DataFrame(rows, columns=list(schema.CURVE_COLUMNS))
    curves["metric"] = curves["metric"].astype("category")
    dense = dense_counters(curves, ["c", "d"])
    got = [(r.metric, r.step, r.value, r.timestamp_ms, r.seq) for r in dense.itertuples()
           if r.metric in ("c", "d")]
    assert got == [("c", 0, 2.0, 10, 0), ("d", 0, 0.0, 10, 0),
                   ("c", 1, 0.0, 11, 1), ("d", 1, 0.0, 11, 1),
                   ("c", 2, 1.0, 12, 2), ("d", 2, 0.0, 12, 2),
                   ("c", 1, 3.0, 13, 5), ("d", 1, 0.0, 13, 5),
                   ("c", 9, 4.0, 20, 8)]
    assert [r.metric for r in dense.itertuples() if r.metric not in ("c", "d")] == [
        st, st, st, st, "loss"]
    assert dense_counters(curves, []) is curves
    assert sparse_counters({schema.TAG_SPARSE_COUNTERS: "a, b,,"}) == ["a", "b"]


def test_values_over_many_blocks_are_exact_and_in_order(store) -> None:
    run = start(store, flush_interval_s=0.05)  # many blocks in a short loop
    f = jax.jit(lambda w, x: (w * 0.99 + x, jnp.sum(w * x)))
    w = jnp.ones(4)
    probe = refrun.jax.instrument(run, params=w, step_fns=[f], monitors=None)
    losses, sums = [], []
    n_steps = 600
    for n in range(n_steps):
        x = jnp.full(4, n / 100, jnp.float32)
        with probe.step(n):
            w, loss = f(w, x)
            # a float32 array, a pytree with an int32 array and a host number, a bf16 one
            tree = {"i": jnp.int32(n * 3), "h": n / 7}
            sums.append(jnp.sum(w))
            probe.log(loss=loss, tree=tree, half=loss.astype(jnp.bfloat16),
                      norms={"w": sums[-1], "x": x[0]})  # arrays only: the fast path
        losses.append(loss)
        if n % 100 == 0:
            time.sleep(0.06)  # let a block be collected while the loop runs
    probe.close()
    run.close()
    rid = run.run_id
    assert history(store, rid, "loss") == [(n, float(v)) for n, v in enumerate(losses)]
    assert values(store, rid, "tree/i") == [float(3 * n) for n in range(n_steps)]
    assert values(store, rid, "tree/h") == [n / 7 for n in range(n_steps)]
    assert values(store, rid, "half") == [float(v.astype(jnp.bfloat16)) for v in losses]
    assert values(store, rid, "norms/x") == [float(np.float32(n / 100)) for n in range(n_steps)]
    assert values(store, rid, "norms/w") == [float(v) for v in sums]
    assert [s for s, _ in history(store, rid, schema.M_STEP_TIME)] == list(range(n_steps))
    assert values(store, rid, schema.M_COMPILE_GRAPHS) == [1.0] + [0.0] * (n_steps - 1)
    # ... as readers get them; the store holds the counters only where they are not 0
    # (and at the first step), and the run says which counters it wrote so.
    client = store.client()
    sparse = client.get_run(rid).data.tags[schema.TAG_SPARSE_COUNTERS].split(",")
    assert schema.M_COMPILE_GRAPHS in sparse and schema.M_HOST_SYNCS in sparse
    assert [(m.step, m.value) for m in client.get_metric_history(
        rid, schema.M_COMPILE_GRAPHS)] == [(0, 1.0)]
    assert [m.step for m in client.get_metric_history(rid, schema.M_HOST_SYNCS)] == [0]
    assert run.warnings == []


def test_a_logged_value_the_loop_donates_stays_exact(store) -> None:
    run = start(store)

    @jax.jit
    def _step(state):
        t, w = state
        w = w * 0.5 + t
        return (t + 1.0, w), jnp.sum(w)

    step = jax.jit(_step, donate_argnums=0)
    state = (jnp.float32(0.0), jnp.ones(3))
    probe = refrun.jax.instrument(run, step_fns=["_step"], monitors=None)
    ts, losses, deleted = [], [], []
    for n in range(6):
        with probe.step(n):
            state, loss = step(state)
            probe.log(t=state[0], loss=loss)  # t is donated by the next step
        ts.append(float(state[0]))  # read now, before the next step donates it
        losses.append(float(loss))
        deleted.append(state[0])
    probe.close()
    run.close()
    # the premise: the loop did donate every logged t but the last
    assert [a.is_deleted() for a in deleted] == [True] * 5 + [False]
    assert values(store, run.run_id, "t") == ts == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert values(store, run.run_id, "loss") == losses
    assert run.warnings == []
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_JAX_DONATED_LOGGED] == "t"  # loss is not donated: never copied
    assert probe.backend.donated == {"t": True, "loss": False}


def test_a_value_deleted_later_is_said_lost_and_its_name_copied_after(store) -> None:
    run = start(store)
    f = jax.jit(lambda x: x + 1.0)
    x = jnp.float32(0.0)
    probe = refrun.jax.instrument(run, step_fns=[f], monitors=None)
    kept = []
    for n in range(8):
        with probe.step(n):
            x = f(x)
            probe.log(v=x)
        kept.append((x, float(x)))
        if n == 4:  # step 0's decision (not donated) is made; now the loop deletes it
            x.delete()
            x = jnp.float32(kept[-1][1])
    probe.close()
    run.close()
    with pytest.raises(RefrunInputError, match="1 points dropped while recording"):
        history(store, run.run_id, "v")  # a run with a point missing is never read as whole
    got = sorted(store.points(run.run_id, "v", allow_gaps=True))
    assert [n for n, _ in got] == [0, 1, 2, 3, 5, 6, 7]  # step 4's value was gone
    assert [v for _, v in got] == [kept[n][1] for n in (0, 1, 2, 3, 5, 6, 7)]
    assert any("v at step 4 could not be read" in w["message"] for w in run.warnings)
    assert probe.backend.donated["v"] is True
    assert store.client().get_run(run.run_id).data.tags[schema.TAG_DROPPED] == "1"


def test_the_probes_own_compilations_are_not_counted(store) -> None:
    """Values of dtypes the stack was not compiled for (int32, bfloat16, weak-typed) make
    the collector compile; the run's compilation counts are exactly what this thread saw
    JAX compile (an independent listener, on this thread only)."""
    seen: list[str] = []
    me = threading.get_ident()

    def on_compile(ev: str, secs: float, **kw: object) -> None:
        if ev.endswith("backend_compile_duration") and threading.get_ident() == me:
            seen.append(str(kw.get("fun_name")))

    run = start(store, flush_interval_s=0.05)
    f = jax.jit(lambda x: (x * 2.0, jnp.int32(3) + x.astype(jnp.int32)))
    x = jnp.ones((), jnp.float32)
    probe = refrun.jax.instrument(run, step_fns=[f], monitors=None)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        for n in range(40):
            with probe.step(n):
                x, i = f(x)
                probe.log(i=i, h=x.astype(jnp.bfloat16), w=jnp.asarray(2.0) * n)
            time.sleep(0.005)
        probe.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    run.close()
    counted = (sum(values(store, run.run_id, schema.M_COMPILE_GRAPHS))
               + sum(values(store, run.run_id, schema.M_COMPILE_OTHER)))
    assert counted == len(seen) > 0
    assert values(store, run.run_id, "w") == [2.0 * n for n in range(40)]


def test_step_time_is_the_interval_between_entries(store) -> None:
    run = start(store)
    probe = refrun.jax.instrument(run, monitors=None)
    body, between = 0.02, 0.01
    t_first = t_entered = 0.0
    for n in range(5):
        if n == 0:
            t_first = time.perf_counter()
        with probe.step(n):
            if n == 0:
                t_entered = time.perf_counter()
            time.sleep(body)
        time.sleep(between)
    t_before_close = time.perf_counter()
    probe.close()
    t_closed = time.perf_counter()
    run.close()
    times = values(store, run.run_id, schema.M_STEP_TIME)
    assert len(times) == 5
    # each covers its body and what the loop did before the next entry
    assert all(t >= body + between for t in times[:4]), times
    # together: from the first entry to close
    assert t_before_close - t_entered <= sum(times) <= t_closed - t_first
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_STEP_TIME_KIND] == "interval"


def test_hot_path_keeps_no_device_read_and_no_thread_handoff(store) -> None:
    """The step's entry and exit append to lists and read attributes: no thread is woken
    per step (the collector wakes on its timer), nothing is read on the training thread."""
    run = start(store, flush_interval_s=30.0)  # no collection during the loop
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 30, lambda i, b: jnp.tanh(b @ b), x).sum())
    a = jnp.ones((300, 300), jnp.float32) / 300
    f(a).block_until_ready()
    probe = refrun.jax.instrument(run, step_fns=[f], monitors=None, fresh_caches=False)
    ready = []
    for n in range(3):
        with probe.step(n):
            r = f(a)
            probe.log(loss=r)
        ready.append(r.is_ready())  # the probe read nothing: still computing
        assert len(probe._step_rows) == 2 * (n + 1) and len(probe._logged) == 3 * (n + 1)
    assert ready == [False, False, False]
    probe.close()
    run.close()
    assert len(values(store, run.run_id, "loss")) == 3


@pytest.mark.parametrize("bad", [jnp.ones(4), np.ones(3), True, "text"])
def test_what_cannot_be_logged_is_warned_and_skipped(store, bad) -> None:
    run = start(store)
    probe = refrun.jax.instrument(run, monitors=None)
    with probe.step(0):
        probe.log(bad=bad, ok=jnp.float32(2.0))
    probe.close()
    run.close()
    assert values(store, run.run_id, "ok") == [2.0]
    assert history(store, run.run_id, "bad") == []
    assert len(run.warnings) == 1 and "bad" in run.warnings[0]["message"]
