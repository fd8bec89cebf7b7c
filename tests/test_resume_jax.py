"""A JAX run resumed from a checkpoint: the optax state is restored into a new pytree and
steps are replayed; ``refrun.jax.optimizer_metrics`` (returned by the jitted step) records
the rate and the update count the optimizer really had at every step, with no host read
inside the step and no compilation after the first step (the probe's own JAX counters),
and the ``restore`` criterion passes the faithful resume and fails one that restarted
the optimizer (its moments and count lost).  The expected rates come from the schedule's
formula, computed here with numpy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import refrun  # noqa: E402
import refrun.jax  # noqa: E402
from refrun import schema  # noqa: E402
from refrun.acceptance.assess import assess_ids  # noqa: E402
from refrun.acceptance.criteria import parse_criteria  # noqa: E402
from refrun.comparison import load_run  # noqa: E402

STEPS, CHECKPOINT, INTERRUPT = 30, 10, 19
ORDER = list(range(INTERRUPT + 1)) + list(range(CHECKPOINT + 1, STEPS))
PEAK, END, WARMUP = 0.05, 0.001, 5


def rate(n: int) -> float:
    """optax.warmup_cosine_decay_schedule(0, PEAK, WARMUP, STEPS, END) at count n: a linear
    warmup from 0, then a cosine from PEAK down to END."""
    if n < WARMUP:
        return PEAK * n / WARMUP
    t = min(n - WARMUP, STEPS - WARMUP) / (STEPS - WARMUP)
    return END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * t))


def make_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, STEPS, END)
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule)


def init_params(seed: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (6, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}


def train(store, tmp: Path, resume: str | None, seed: int = 0) -> str:
    tx = make_tx()
    rng = np.random.default_rng(1000 + seed)
    x = rng.normal(size=(STEPS, 16, 6)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True)).astype(np.float32)

    def train_step(params, opt_state, xb, yb):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - yb) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, refrun.jax.optimizer_metrics(opt_state)

    step = jax.jit(train_step, donate_argnums=(0, 1))
    params = init_params(seed)
    opt_state = tx.init(params)
    ckpt = tmp / f"ckpt-{resume}.npz"
    with refrun.start_run("resume-jax", "candidate", hardware="cpu", backend="jax", seed=seed,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False, delivery="thread") as run:
        probe = refrun.jax.instrument(run, params=params, step_fns=[step])
        crashed = False
        for n in (ORDER if resume else range(STEPS)):
            with probe.step(n):
                params, opt_state, loss, opt = step(params, opt_state, x[n], y[n])
                probe.log(loss=loss, **opt)
            if resume and n == CHECKPOINT and not crashed:  # a host read between steps
                leaves = jax.tree_util.tree_leaves(jax.device_get((params, opt_state)))
                np.savez(ckpt, *leaves)
            if resume and n == INTERRUPT and not crashed:
                crashed = True
                # The restart: a new pytree of the same structure, filled from the file.
                fresh_params = init_params(seed)
                fresh_state = tx.init(fresh_params)
                treedef = jax.tree_util.tree_structure((fresh_params, fresh_state))
                with np.load(ckpt) as f:
                    saved = [jnp.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
                params, opt_state = jax.tree_util.tree_unflatten(treedef, saved)
                if resume == "fresh_optimizer":  # the weights only: the optimizer restarts
                    opt_state = tx.init(params)
        probe.close()
    return run.run_id


def points(store, run_id: str, metric: str) -> list[tuple[int, float]]:
    steps, values, seq = load_run(run_id, tracking_uri=store.tracking_uri).series(metric)
    o = np.argsort(seq)
    return list(zip(steps[o].tolist(), values[o].tolist(), strict=True))


def test_a_resumed_jax_run_records_the_optimizers_rate_and_count_at_every_step(
        store, tmp_path: Path) -> None:
    run_id = train(store, tmp_path, "faithful")
    lr = points(store, run_id, schema.M_LR)
    assert [s for s, _ in lr] == ORDER
    assert [v for _, v in lr] == pytest.approx([rate(s) for s in ORDER], rel=1e-6, abs=1e-9)
    assert points(store, run_id, schema.M_OPT_STEPS) == [(s, float(s + 1)) for s in ORDER]
    # Nothing read on the host inside a step, and the restored pytree compiled nothing.
    syncs = points(store, run_id, schema.M_HOST_SYNCS)
    assert len(syncs) == len(ORDER) and {v for _, v in syncs} == {0.0}
    graphs = points(store, run_id, schema.M_COMPILE_GRAPHS)
    assert [v for _, v in graphs] == [1.0] + [0.0] * (len(ORDER) - 1)


def test_the_restore_criterion_passes_a_faithful_jax_resume_and_fails_a_fresh_optimizer(
        store, tmp_path: Path) -> None:
    crit = parse_criteria('version = 1\nworkload = "resume-jax"\n[[criteria]]\n'
                          'id = "resume-reproduces"\nlevel = "L2"\nkind = "restore"\n',
                          "c.toml")
    ref = train(store, tmp_path, None)
    out = {}
    for how in ("faithful", "fresh_optimizer"):
        a, _ = assess_ids(crit, [ref], train(store, tmp_path, how, seed=1),
                          store.tracking_uri)
        out[how] = next(r for r in a.results if r.kind == "restore")
    assert out["faithful"].outcome == "pass", out["faithful"].reason
    assert "bit for bit" in out["faithful"].reason
    bad = out["fresh_optimizer"]
    assert bad.outcome == "fail"
    # The fresh optimizer's first update uses the schedule at count 0 (rate 0) and counts 1.
    assert f"{schema.M_LR} at replayed step {CHECKPOINT + 1} is 0 where the first pass had" \
        in bad.reason
    state = {s["metric"]: s for s in bad.evidence["restores"][0]["state"]}
    assert (state[schema.M_OPT_STEPS]["replay_at_restore"],
            state[schema.M_OPT_STEPS]["first_at_restore"]) == (1.0, CHECKPOINT + 2.0)


def test_optimizer_metrics_reads_the_rates_and_count_by_the_states_structure() -> None:
    """Without inject_hyperparams only the count; two injected rates (multi_transform of
    two labels) in the state's order, named as the torch probes name parameter groups."""
    p = {"a": jnp.zeros(3), "b": {"c": jnp.zeros(2)}}
    assert list(refrun.jax.optimizer_metrics(optax.adam(0.1).init(p))) == [schema.M_OPT_STEPS]
    tx = optax.multi_transform(
        {"x": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
         "y": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2)},
        {"a": "x", "b": {"c": "y"}})
    m = refrun.jax.optimizer_metrics(tx.init(p))
    assert list(m) == [schema.M_LR, f"{schema.M_LR}/pg1", schema.M_OPT_STEPS]
    assert [float(m[schema.M_LR]), float(m[f"{schema.M_LR}/pg1"])] == pytest.approx([0.1, 0.2])
