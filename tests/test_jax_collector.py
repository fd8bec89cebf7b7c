"""The JAX probe's collector at its real cost (issue 51): what a step keeps, and how a
block of steps reaches the session, on real JAX (CPU):

* the sliced split of a block into columns (a loop that logs the same names each step)
  gives exactly what splitting value by value gives, on blocks of every shape;
* a column read without looking at each value stays exact when its values are not of one
  dtype (an int32 past float32's 24 bits beside float32 values);
* progress and counters, written where a counter moved, are exact across many blocks;
* a step keeps no object of its own for the garbage collector to count beyond what was
  logged (Python's own allocation counter), so a probed loop does not make the collector
  run more often than its values require.
"""

from __future__ import annotations

import gc
import random
import time

import jax
import jax.numpy as jnp
import pytest

import refrun
import refrun.jax
from refrun import schema
from refrun.probes import jax_blocks
from refrun.probes.jax_blocks import Column, ColumnReader, Tree, columns

pytestmark = pytest.mark.usefixtures("deliver_in_process")


def _by_value(flat, names_of):
    return jax_blocks._columns_by_value(flat[0::3], flat[1::3], flat[2::3], names_of)


def _as_tuples(cols: dict[str, Column]):
    return {k: (c.steps, [id(v) if not isinstance(v, float | int) else v for v in c.values],
                sorted(c.logged_as)) for k, c in cols.items()}


def test_sliced_columns_equal_value_by_value_columns_on_any_block() -> None:
    rng = random.Random(7)
    tree2 = jax.tree_util.tree_structure({"a": 0, "b": 0})
    tree1 = jax.tree_util.tree_structure({"a": 0})

    def names_of(name, treedef):
        return [f"{name}/{k}" for k in ("a", "b")[:treedef.num_leaves]]

    shapes = 0
    for case in range(300):
        names = ["loss", "g", "h", "g/a"][:rng.randint(1, 4)]
        steps = rng.randint(0, 6)
        flat = []
        for n in range(steps):
            order = names if case % 3 else rng.sample(names, rng.randint(1, len(names)))
            for name in order:
                if name == "g":
                    td = tree2 if case % 5 else rng.choice([tree1, tree2])
                    v = Tree(td, [object() for _ in range(td.num_leaves)])
                else:
                    v = rng.choice([object(), float(n), n])
                flat += [n, name, v]
        fast = jax_blocks._periodic_columns(flat[0::3], flat[1::3], flat[2::3], names_of)
        shapes += fast is not None
        assert _as_tuples(columns(flat, names_of)) == _as_tuples(_by_value(flat, names_of))
    assert 50 < shapes < 300  # both paths were taken


@pytest.mark.parametrize("per_value", [False, True])
def test_a_column_of_mixed_dtypes_is_read_exactly(per_value: bool) -> None:
    big = 2 ** 24 + 1  # not a float32
    ints = [jnp.int32(big + i) for i in range(70)]
    floats = [jnp.float32(i / 3) for i in range(70)]
    mixed = [x for pair in zip(ints, floats, strict=True) for x in pair]
    uniform = [jnp.float32(i / 7) for i in range(130)]
    reader = ColumnReader(per_value=per_value)
    for _ in range(2):  # the second time the column is known to be mixed
        cols = {"m": Column("m"), "u": Column("u")}
        cols["m"].values, cols["u"].values = list(mixed), list(uniform)
        reader.read(cols)
        assert cols["m"].values == [float(x) for x in mixed]  # jax's own reads, one by one
        assert cols["u"].values == [float(x) for x in uniform]
        assert reader.mixed == (set() if per_value else {"m"})


@pytest.mark.parametrize("per_value", [False, True])
def test_a_deleted_array_in_a_column_is_lost_and_the_rest_exact(per_value: bool) -> None:
    vals = [jnp.float32(i / 9) for i in range(100)]
    expected = [float(x) for x in vals]
    gone = jnp.float32(5.0)
    gone.delete()
    col = Column("loss")
    col.values = [*vals[:40], gone, *vals[40:]]
    ColumnReader(per_value=per_value).read({"loss": col})
    assert type(col.values[40]) is jax_blocks.LostValue
    assert col.values[:40] + col.values[41:] == expected


def test_the_read_path_is_the_faster_one_measured_and_recorded(store) -> None:
    path = jax_blocks.choose_read_path(count=64)
    assert path.per_value == (path.per_value_us < path.stacked_us)
    assert path.stacked_us > 0 and path.per_value_us > 0
    run = refrun.start_run("jax-read-path", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False)
    probe = refrun.jax.instrument(run, monitors=None)
    with probe.step(0):
        probe.log(loss=jnp.float32(0.5))
    probe.close()
    run.close()
    tag = store.client().get_run(run.run_id).data.tags[schema.TAG_JAX_READ_PATH]
    chosen = "per value" if probe._reader.per_value else "stacked"
    assert tag.startswith(chosen + " (measured at start: stacked ")
    assert sorted(store.points(run.run_id, "loss")) == [(0, 0.5)]


def test_progress_and_moved_counters_are_exact_across_many_blocks(store) -> None:
    """Samples and tokens from a declared batch with two steps that say their own, and a
    host read at known steps (a counter that moves there only), over blocks a few steps
    long (a short flush interval; the steps pause so blocks fall between them)."""
    run = refrun.start_run("jax-collect", "candidate", hardware="cpu", backend="jax",
                           tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                           snapshot_environment=False, flush_interval_s=0.01,
                           global_batch=32, tags={schema.TAG_TOKENS_PER_SAMPLE: 16})
    f = jax.jit(lambda w: (w * 0.5 + 1.0, jnp.sum(w)))
    w = jnp.ones(3)
    probe = refrun.jax.instrument(run, step_fns=[f], monitors=None)
    reads_at, own = {3, 4, 17, 40}, {10: (7, 100), 25: (5, None)}
    samples = tokens = 0
    expect_s, expect_t = [], []
    for n in range(60):
        with probe.step(n):
            w, loss = f(w)
            probe.log(loss=loss)
            if n in reads_at:
                float(loss)  # a host read: xfer/host_syncs moves at this step only
            s, t = own.get(n, (None, None))
            if s is not None:
                probe.progress(samples=s, tokens=t)
        samples += s if s is not None else 32
        tokens += t if t is not None else (s if s is not None else 32) * 16
        expect_s.append(float(samples))
        expect_t.append(float(tokens))
        if n % 7 == 0:
            time.sleep(0.02)
    probe.close()
    run.close()
    pts = {m: sorted(store.points(run.run_id, m)) for m in (
        schema.M_PROGRESS_SAMPLES, schema.M_PROGRESS_TOKENS, schema.M_HOST_SYNCS,
        schema.M_STEP_TIME)}
    assert [v for _, v in pts[schema.M_PROGRESS_SAMPLES]] == expect_s
    assert [v for _, v in pts[schema.M_PROGRESS_TOKENS]] == expect_t
    assert [n for n, v in pts[schema.M_HOST_SYNCS] if v] == sorted(reads_at)
    assert [v for n, v in pts[schema.M_HOST_SYNCS] if v] == [1.0] * len(reads_at)
    assert [n for n, _ in pts[schema.M_STEP_TIME]] == list(range(60))
    assert run.warnings == []


def test_a_probed_step_keeps_only_what_it_logged_for_the_garbage_collector() -> None:
    """Python's count of allocated, not yet freed container objects (generation 0 of the
    garbage collector), over 400 steps with no collection of the probe's blocks: a plain
    loop leaves it where it was; the probed loop adds the logged array and one object for
    the logged dictionary a step, nothing of its own (a row or a counter tuple kept per
    step would be one more each, and make the collector run that much more often)."""
    f = jax.jit(lambda w: (w * 0.99, jnp.sum(w), jnp.max(w)))
    w = jnp.ones(4)

    def growth(probe, start: int) -> float:
        nonlocal w
        gc.collect()
        gc.disable()
        try:
            c0 = gc.get_count()[0]
            for n in range(start, start + 400):
                if probe is None:
                    w, loss, top = f(w)
                    continue
                with probe.step(n):
                    w, loss, top = f(w)
                    probe.log(loss=loss, norms={"a": top, "b": loss})
            return (gc.get_count()[0] - c0) / 400
        finally:
            gc.enable()

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        run = refrun.start_run("jax-gc", "candidate", hardware="cpu", backend="jax",
                               tracking_uri=f"sqlite:///{d}/m.db", spool_dir=f"{d}/spool",
                               snapshot_environment=False, flush_interval_s=600,
                               delivery="thread")
        probe = refrun.jax.instrument(run, step_fns=[f], monitors=None)
        growth(probe, 0)  # first steps: the probe learns the names, compiles
        plain = growth(None, 0)
        probed = growth(probe, 400)
        probe.close()
        run.close()
    assert abs(plain) < 0.1
    # kept a step: loss and top (2 arrays) and the flattened dictionary (1 tuple)
    assert 2.9 < probed - plain < 3.2, (plain, probed)
