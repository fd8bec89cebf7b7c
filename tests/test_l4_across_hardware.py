"""L4 across hardware, judged end to end (issue 51, item 4).

Four PyTorch reference seeds of a small classifier are recorded with
``refrun.torch.instrument`` as runs on ``nvidia-l4``; JAX ports of reference seed 0 (the
same initial weights and batches) are recorded with ``refrun.jax.instrument`` as runs on
``tpu-v5e`` (a migration: another backend and another declared hardware, both on the
CPU here; each step waits for its "device": a sleep in the PyTorch step, a sleep inside
the jitted JAX step, so that other processes move the figures little).  ``refrun
calibrate`` writes the criteria from the references alone, with the
project's L4 goals (``--goal throughput>=0.9x --goal cost<=1.2x``) and prices
(``--price``), or without goals.

* The clean port is faster per step (its chip's 1 ms against the GPU's 4 ms, and JAX's
  compiled step against PyTorch's eager one) and priced ten times higher: it passes its
  throughput goal and fails its cost goal, after passing L0-L3 with the calibrated
  criteria.  On a machine other processes keep busy (the brief's two CPU-bound
  neighbours on 2 cores), the JAX step's thread hand-offs stretch more than the sleeps and
  the port can read slower than the references (0.548 once): refrun then leaves the
  throughput goal not evaluable, with the contention and the would-be verdict in its
  reason, which the tests assert instead of a pass (``busy_not_judged``).
* A port with a host check in every step (``float(loss)``, every parameter read to the
  host and its first layer run on the validation set in NumPy) really takes longer per
  step: the host-sync counter rejects it at L2 and its throughput fails the throughput
  goal (or, on a machine other processes kept busy, is "not judged" with the fail it
  would be).  On the CPU a host read alone costs little (a tiny JAX step finishes in
  microseconds; on a TPU it is the wait for the chip), so the check's own work is what
  makes this step slower here.
* Without goals the three figures are measured and shown (``refrun accept``, the report's
  first screen) and change no verdict.

Expected figures are recomputed here from what MLflow stored (the metric histories, the
runs' start and end times) with NumPy, independently of ``refrun.acceptance.performance``.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

import refrun
from refrun import schema
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.criteria import load_criteria
from refrun.cli import main

# Four references and four ports in the module fixture: ~1 min on a quiet machine.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

WORKLOAD = "l4-migration"
STEPS, EVAL_EVERY, BATCH, IN, WIDTH, CLASSES = 150, 25, 32, 16, 64, 4
N_TRAIN, N_VAL = 1024, 2048
LR = 0.1
REF_HW, CAND_HW = "nvidia-l4", "tpu-v5e"
# Each step's device time, waited inside the step: the references' GPU kernels (a sleep in
# the PyTorch step, as a CUDA sync waits) and the port's TPU program (a sleep inside the
# jitted step, through jax.pure_callback, which XLA:CPU runs synchronously).  Waits, not
# computation, so that other processes on the machine move no figure much.
# The references' 4 ms against the port's 1 ms: the port stays faster per step however
# much a busy machine stretches each sleep and the steps' own work (2 ms against 1 ms did
# not: 0.99x with two other test workers and two helpers' processes on 2 cores).
REF_DEVICE_S, CAND_DEVICE_S = 0.004, 0.001
# The host check runs the model's first layer on HOST_CHECKS x the validation set in
# every step (~20 ms on the quiet 2-core test machine, against the steps' ~1.5-5 ms).
HOST_CHECKS = 32
PRICES = {REF_HW: 0.71, CAND_HW: 7.1}  # per hour: the candidate's hardware 10x the price


def dataset() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A fixed classification task (a random linear teacher), generated, never downloaded."""
    rng = np.random.default_rng(12345)
    teacher = rng.normal(size=(IN, CLASSES))
    x = rng.normal(size=(N_TRAIN + N_VAL, IN)).astype(np.float32)
    y = np.argmax(x @ teacher + rng.normal(0, 0.5, (len(x), CLASSES)), axis=1)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


X, Y, XV, YV = dataset()


def init(seed: int) -> dict[str, np.ndarray]:
    """Initial weights of seed ``seed`` (torch.nn.Linear's uniform bounds), ``(out, in)``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(((IN, WIDTH), (WIDTH, WIDTH), (WIDTH, CLASSES))):
        bound = 1 / math.sqrt(a)
        out[f"{i}.weight"] = rng.uniform(-bound, bound, (b, a)).astype(np.float32)
        out[f"{i}.bias"] = rng.uniform(-bound, bound, b).astype(np.float32)
    return out


def batches(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).integers(0, N_TRAIN, (STEPS, BATCH))


def start(store, role: str, backend: str, hardware: str, seed: int) -> refrun.RunSession:
    return refrun.start_run(WORKLOAD, role, hardware=hardware, backend=backend, seed=seed,
                            chips=1, global_batch=BATCH, planned_steps=STEPS,
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False, delivery="thread")


def torch_run(store, seed: int, role: str = "reference") -> str:
    """The reference: an MLP trained with SGD in PyTorch (eager), on the CPU."""
    import torch
    import torch.nn.functional as F

    import refrun.torch

    torch.set_num_threads(1)
    layers = [torch.nn.Linear(IN, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
              torch.nn.Linear(WIDTH, CLASSES)]
    model = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(),
                                layers[2])
    weights = init(seed)
    with torch.no_grad():
        for i, lin in enumerate(layers):
            lin.weight.copy_(torch.from_numpy(weights[f"{i}.weight"]))
            lin.bias.copy_(torch.from_numpy(weights[f"{i}.bias"]))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    xv, yv = torch.from_numpy(XV), torch.from_numpy(YV)
    idx = torch.from_numpy(batches(seed))
    run = start(store, role, "torch", REF_HW, seed)
    with refrun.torch.instrument(run, model=model, optimizer=opt) as probe:
        for n in range(STEPS):
            with probe.step(n):
                opt.zero_grad()
                loss = F.cross_entropy(model(x[idx[n]]), y[idx[n]])
                loss.backward()
                opt.step()
                time.sleep(REF_DEVICE_S)  # the GPU's kernel time
                probe.log(loss=loss.detach())
            if n % EVAL_EVERY == EVAL_EVERY - 1:
                with torch.no_grad():
                    logits = model(xv)
                    probe.log_eval(n, val_loss=F.cross_entropy(logits, yv),
                                   val_accuracy=(logits.argmax(1) == yv).float().mean())
    run.close()
    assert run.run_id is not None
    return run.run_id


def jax_run(store, seed: int, host_check: bool = False) -> str:
    """The JAX port of reference seed ``seed``, declared on the TPU's hardware name.
    ``host_check``: in every step, ``float(loss)`` and a NumPy check on the host (every
    parameter read, the first layer run on the validation set; einsum without BLAS, whose
    threads beside PyTorch's cost a hundred times more on a busy machine): host syncs,
    and real work."""
    import jax
    import jax.numpy as jnp

    import refrun.jax

    def forward(p, x):
        h = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"])
        h = jax.nn.relu(h @ p["1.weight"].T + p["1.bias"])
        return h @ p["2.weight"].T + p["2.bias"]

    def loss_fn(p, x, y):
        logp = jax.nn.log_softmax(forward(p, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def on_the_chip(_after):  # the TPU program's time, once the loss is computed; it reads
        time.sleep(CAND_DEVICE_S)  # no value (a read in the step would count as a sync)
        return np.zeros((), np.float32)

    @jax.jit
    def train_step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        loss = loss + jax.pure_callback(on_the_chip, jax.ShapeDtypeStruct((), jnp.float32),
                                        loss)
        return jax.tree_util.tree_map(lambda a, d: a - LR * d, p, g), loss

    @jax.jit
    def evaluate(p, x, y):
        logits = forward(p, x)
        return loss_fn(p, x, y), jnp.mean(jnp.argmax(logits, axis=1) == y)

    def check_on_host(p) -> bool:  # the defect's host work: every parameter read, and
        w = {k: np.asarray(v) for k, v in p.items()}  # the first layer on the val rows
        ok = all(np.isfinite(v).all() for v in w.values())
        for _ in range(HOST_CHECKS):
            h = np.einsum("ij,kj->ik", XV, w["0.weight"], optimize=False) + w["0.bias"]
            ok = ok and bool(np.isfinite(h).all())
        return ok

    p = {k: jnp.asarray(v) for k, v in init(seed).items()}
    xv, yv = jnp.asarray(XV), jnp.asarray(YV)
    idx = batches(seed)
    run = start(store, "candidate", "jax", CAND_HW, seed)
    with refrun.jax.instrument(run, params=p, step_fns=[train_step]) as probe:
        for n in range(STEPS):
            with probe.step(n):  # the batch is cut on the host, as a data loader does
                p, loss = train_step(p, X[idx[n]], Y[idx[n]])
                if host_check:
                    assert math.isfinite(float(loss)) and check_on_host(p)
                probe.log(loss=loss)
            if n % EVAL_EVERY == EVAL_EVERY - 1:
                val_loss, val_acc = evaluate(p, xv, yv)
                probe.log_eval(n, val_loss=val_loss, val_accuracy=val_acc)
    run.close()
    assert run.run_id is not None
    return run.run_id


@dataclass
class World:
    store: object
    refs: list[str]
    tmp: Path
    files: dict[str, Path] = field(default_factory=dict)
    cands: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    from tests.conftest import Store, migrated_sqlite

    tmp = tmp_path_factory.mktemp("l4")
    store = Store(tmp, migrated_sqlite(tmp / "mlflow.db", tmp_path_factory), tmp / "spool")
    refs = [torch_run(store, s) for s in range(4)]
    w = World(store, refs, tmp)
    prices = [f"--price={hw}={p}" for hw, p in PRICES.items()]
    for name, goals in (("goals", ["--goal", "throughput>=0.9x", "--goal", "cost<=1.2x"]),
                        ("measured", [])):
        w.files[name] = tmp / f"{name}.toml"
        assert main(["calibrate", "--reference", *refs, "--tracking-uri",
                     store.tracking_uri, *goals, *prices, "-o", str(w.files[name])]) == 0
    w.cands["clean"] = jax_run(store, 0)
    w.cands["host-check"] = jax_run(store, 0, host_check=True)
    w.cands["same-machine"] = torch_run(store, 7, role="candidate")
    return w


# --- the figures, recomputed from what MLflow stored ---------------------------------------
def history(store, run_id: str, metric: str) -> dict[int, float]:
    from mlflow import MlflowClient

    return {m.step: m.value for m in MlflowClient(store.tracking_uri)
            .get_metric_history(run_id, metric)}


def throughput_by_hand(store, run_id: str) -> float:
    """Samples / step time over the steady steps (from the warm-up end, first step +
    ceil(10 % of the steps), compilation steps left out; a step's samples the increase of
    progress/samples there), the median over blocks of consecutive steps, each closed by
    the step that brings its own time to 0.1 s (an incomplete last block joins the one
    before; with fewer than 3 blocks, the whole window).  A JAX run's step times run from
    entry to entry: the step before one whose compile/other moved (a compilation between
    the two) and the last step (its interval ends at the probe's close) are left out too."""
    from mlflow import MlflowClient

    t = history(store, run_id, schema.M_STEP_TIME)
    seen = history(store, run_id, schema.M_PROGRESS_SAMPLES)
    compiled = {s for m in schema.STEP_TIME_COMPILE_METRICS
                for s, v in history(store, run_id, m).items() if v > 0}
    first, last = min(t), max(t)
    tags = MlflowClient(store.tracking_uri).get_run(run_id).data.tags
    if tags[schema.TAG_STEP_TIME_KIND] == "interval":
        compiled |= {last} | {s - 1 for s, v in history(store, run_id,
                                                        schema.M_COMPILE_OTHER).items() if v > 0}
    start = first + math.ceil(0.1 * (last - first + 1))
    assert all(seen[s] - seen.get(s - 1, 0.0) == BATCH for s in seen)  # what the probe logs
    blocks: list[list[float]] = [[0.0, 0.0]]  # [samples, seconds] per block
    for s in sorted(t):
        if s < start or s in compiled or t[s] <= 0:
            continue
        if blocks[-1][1] >= 0.1 * (1 - 1e-9):  # the block before is complete
            blocks.append([0.0, 0.0])
        blocks[-1][0] += seen[s] - seen.get(s - 1, 0.0)
        blocks[-1][1] += t[s]
    blocks = [b for b in blocks if b[1] > 0]
    if len(blocks) >= 2 and blocks[-1][1] < 0.1 * (1 - 1e-9):
        blocks[-2] = [blocks[-2][0] + blocks[-1][0], blocks[-2][1] + blocks[-1][1]]
        blocks.pop()
    if len(blocks) < 3:
        return sum(b[0] for b in blocks) / sum(b[1] for b in blocks)
    return float(np.median([b[0] / b[1] for b in blocks]))


def cost_by_hand(store, run_id: str) -> float:
    """MLflow's end - start of the run less refrun's own start-up and close (the seconds
    from the run's start time to the end of start_run, and from the call of close to the
    end time: its tags), in hours, x the price of its declared hardware (every run here
    processed STEPS x BATCH samples: the same work)."""
    from mlflow import MlflowClient

    run = MlflowClient(store.tracking_uri).get_run(run_id)
    own_s = (float(run.data.tags[schema.TAG_RECORDING_START_S])
             + float(run.data.tags[schema.TAG_RECORDING_CLOSE_S]))
    hours = (run.info.end_time - run.info.start_time - 1e3 * own_s) / 3.6e6
    return hours * PRICES[run.data.tags[schema.TAG_HARDWARE]]


def ratios_by_hand(w: World, cand: str, refs: list[str]) -> tuple[float, float]:
    tp = throughput_by_hand(w.store, cand) / np.mean([throughput_by_hand(w.store, r)
                                                      for r in refs])
    cost = cost_by_hand(w.store, cand) / np.mean([cost_by_hand(w.store, r) for r in refs])
    return float(tp), float(cost)


def busy_not_judged(r, tp: float) -> bool:  # type: ignore[no-untyped-def]
    """Whether the throughput goal was left unjudged because other processes kept the
    machine busy, and said so: the contention measured, the ratio and the would-be fail in
    its reason.  Under the brief's busy protocol (two CPU-bound processes beside the suite
    on 2 cores) the JAX step's thread hand-offs stretch far more than the sleeps do (the
    clean port read 0.548 of the references' throughput there), and refrun rightly does
    not call a ratio that contention can explain either way."""
    if r.outcome != "not_evaluable":
        return False
    cont = r.evidence[schema.EV_CONTENTION]
    if cont.get("references_busier"):  # the references' rule: a pass slowed refs may explain
        assert "(it would pass: steady throughput" in r.reason, r.reason
        assert f"ratio {tp:.3f} >= 0.9" in r.reason, r.reason
        return True
    assert cont["known"] and "(it would fail: steady throughput" in r.reason, r.reason
    assert f"ratio {tp:.3f} < 0.9" in r.reason, r.reason
    return True


def cost_busy_not_judged(r, cost: float) -> bool:  # type: ignore[no-untyped-def]
    """Whether the cost goal's fail was left unjudged because the machine took CPU from
    the candidate, and said so: its hours then hold what the neighbours cost it, and a JAX
    run records no CPU time per step that could bound its idle hours (the candidate's rule,
    docs/acceptance.md "Busy machines")."""
    if r.outcome != "not_evaluable":
        return False
    cont = r.evidence[schema.EV_CONTENTION]
    assert cont["known"] and "cost not judged (it would fail: candidate" in r.reason, r.reason
    assert f"ratio {cost:.3f} > 1.2" in r.reason, r.reason
    assert f"has no {schema.M_STEP_CPU} values)" in r.reason, r.reason
    return True


def assess(w: World, file: str, cand: str):  # type: ignore[no-untyped-def]
    a, _ = assess_ids(load_criteria(w.files[file]), w.refs[:3], w.cands[cand],
                      w.store.tracking_uri)
    return a


# --- the tests -----------------------------------------------------------------------------
def test_calibrate_writes_the_declared_l4_goals_and_prices(world: World) -> None:
    crit = load_criteria(world.files["goals"])
    tp, cost = crit.criterion("goal-throughput"), crit.criterion("goal-cost")
    assert (tp.KIND, tp.level, tp.min_ratio, tp.migration_only) == ("throughput", "L4", 0.9,
                                                                   True)
    assert (cost.KIND, cost.level, cost.max_ratio, cost.same_work, cost.migration_only) == \
        ("cost", "L4", 1.2, True, True)
    assert crit.prices.hourly == PRICES
    # The same seeds without goals: the same criteria otherwise (goals take no share of
    # the false-alarm budget), and the prices.
    plain = load_criteria(world.files["measured"])
    assert [c.id for c in plain.criteria] == [c.id for c in crit.criteria
                                              if not c.id.startswith("goal-")]
    assert {c.id: c for c in plain.criteria} == {c.id: c for c in crit.criteria
                                                 if not c.id.startswith("goal-")}
    assert plain.prices.hourly == PRICES
    # The same-machine step time stays as it was: judged on the references' backend only.
    st = crit.criterion("step-time")
    assert st.level == "L4" and not st.across_backends and not st.migration_only


def test_a_faster_but_costlier_migration_fails_its_cost_goal_and_passes_its_throughput_goal(
        world: World) -> None:
    a = assess(world, "goals", "clean")
    tp, cost = ratios_by_hand(world, world.cands["clean"], world.refs[:3])
    assert cost > 1.2  # costlier per run (ten times the price)
    assert a.result("host-syncs-per-step").evidence["per_step_mean"] == 0.0
    # L0-L3 pass with the calibrated criteria, so L4 is judged.
    assert [lv.status for lv in a.levels[:4]] == ["pass", "pass", "pass", "pass"], a.table()
    r_tp, r_cost = a.result("goal-throughput"), a.result("goal-cost")
    assert r_tp.evaluated, r_tp.reason
    if not busy_not_judged(r_tp, tp):  # faster per step, as on a quiet machine
        assert tp >= 0.9 and r_tp.outcome == "pass", r_tp.reason  # quiet: about 3x
    assert r_tp.evidence["ratio"] == pytest.approx(tp, rel=1e-9)
    assert r_tp.evidence["unit"] == "samples"
    cost_unjudged = cost_busy_not_judged(r_cost, cost)
    assert cost_unjudged or r_cost.outcome == "fail", r_cost.reason
    assert r_cost.evidence["ratio"] == pytest.approx(cost, rel=1e-6)
    assert r_cost.evidence["work_factor"] == {rid: 1.0 for rid in
                                              [*world.refs[:3], world.cands["clean"]]}
    # The same-machine step time is not applicable across backends, as before.
    assert a.result("step-time").outcome == "not_applicable"
    if not cost_unjudged:
        assert a.level("L4").status == "fail" and a.highest_level == "L3"
        assert a.verdict == "fail"
    else:  # nothing in L4 failed that the load cannot explain: never a pass
        assert a.verdict == "incomplete" and a.highest_level == "L3", a.table()
    # The figures the assessment carries are the same numbers.
    assert a.performance["throughput"]["ratio"] == pytest.approx(tp, rel=1e-9)
    assert a.performance["cost"]["ratio"] == pytest.approx(cost, rel=1e-6)
    assert a.performance["migration"] == "torch on nvidia-l4 x1 -> jax on tpu-v5e x1"


def test_a_migration_with_a_host_sync_in_every_step_fails_its_throughput_goal(
        world: World) -> None:
    a = assess(world, "goals", "host-check")
    tp, _ = ratios_by_hand(world, world.cands["host-check"], world.refs[:3])
    assert tp < 0.9
    assert a.result("host-syncs-per-step").outcome == "fail"  # the counter saw it (L2)
    assert a.level("L3").status == "pass"  # so L4 is judged
    r = a.result("goal-throughput")
    assert r.evaluated and r.evidence["ratio"] == pytest.approx(tp, rel=1e-9)
    cont = r.evidence[schema.EV_CONTENTION]
    if r.outcome == "not_evaluable":  # other processes kept this machine busy: not judged
        assert cont["known"] and "(it would fail: steady throughput" in r.reason, r.reason
        assert f"ratio {tp:.3f} < 0.9" in r.reason
    else:
        assert r.outcome == "fail", r.reason
        assert f"ratio {tp:.3f} < 0.9" in r.reason
    # The clean port of the same seed passes the same goal: the host check is the cause.
    r_clean = assess(world, "goals", "clean").result("goal-throughput")
    clean_tp, _ = ratios_by_hand(world, world.cands["clean"], world.refs[:3])
    assert busy_not_judged(r_clean, clean_tp) or r_clean.outcome == "pass", r_clean.reason


def test_without_goals_the_figures_are_measured_and_change_no_verdict(world: World) -> None:
    clean = assess(world, "measured", "clean")
    tp, cost = ratios_by_hand(world, world.cands["clean"], world.refs[:3])
    # Measured: the same figures as with goals ...
    assert clean.performance["throughput"]["ratio"] == pytest.approx(tp, rel=1e-9)
    assert clean.performance["cost"]["ratio"] == pytest.approx(cost, rel=1e-6)
    # ... chip busy said, never blank: the port's probe says why it has none (no device
    # timeline on the CPU); the references' probe wrote nothing, and they executed on the CPU
    busy = clean.performance["busy"]
    assert busy["candidate_pct"] is None and busy["reference_pct"] is None
    assert busy["candidate_why"].startswith(
        f"run {world.cands['clean']}: unavailable: libtpu: not installed; profiler: no device "
        "plane in the trace (cpu devices"), busy["candidate_why"]
    assert "executed on the CPU" in busy["reference_why"]
    # ... and no verdict: a cost 10x the references' judges nothing without a goal.
    assert cost > 1.2
    assert not [r for r in clean.results if r.kind in ("throughput", "cost", "utilization")]
    assert clean.verdict == "pass" and clean.highest_level == "L3"
    assert clean.level("L4").status == "not_applicable"  # step-time: same backend only
    slow = assess(world, "measured", "host-check")
    assert slow.performance["throughput"]["ratio"] < 0.9
    assert [r.id for r in slow.results if r.outcome == "fail"] == ["host-syncs-per-step"]


def test_accept_prints_the_figures_judged_or_measured(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    tp, cost = ratios_by_hand(world, world.cands["clean"], world.refs[:3])
    a = assess(world, "goals", "clean")
    judged, costed = (a.result(g).outcome.upper() for g in ("goal-throughput", "goal-cost"))
    for name, rc, head in (("measured", 0, "measured only (no L4 goal declared"),
                           ("goals", 1, f"judged by goal-throughput {judged}, goal-cost "
                                        f"{costed}")):
        assert main(["accept", "--criteria", str(world.files[name]), "--reference",
                     *world.refs[:3], "--candidate", world.cands["clean"], "--no-record",
                     "--tracking-uri", world.store.tracking_uri]) == rc
        out = capsys.readouterr().out
        lines = out.splitlines()
        i = next(i for i, ln in enumerate(lines) if ln.startswith("L4 across hardware"))
        assert lines[i].startswith("L4 across hardware (torch on nvidia-l4 x1 -> jax on "
                                   f"tpu-v5e x1): {head}"), lines[i]
        assert lines[i + 1].startswith(f"  throughput {tp:.3f}x: candidate ")
        assert lines[i + 2].startswith(f"  cost per run {cost:.3f}x: candidate ")
        assert re.match(r"  chip busy candidate not measured: run \w+: unavailable: libtpu: "
                        r"not installed; profiler: no device plane in the trace .*; "
                        r"references not measured: run \w+ executed on the CPU", lines[i + 3]), \
            lines[i + 3]


def test_a_candidate_on_the_references_configuration_is_judged_by_step_time_alone(
        world: World) -> None:
    a = assess(world, "goals", "same-machine")
    for cid in ("goal-throughput", "goal-cost"):
        r = a.result(cid)
        assert r.outcome == "not_applicable" and "migrations only" in r.reason, r.reason
    assert a.result("step-time").outcome in ("pass", "fail", "not_evaluable")
    assert a.result("step-time").outcome != "not_applicable"
    assert a.performance == {} and "performance" not in a.to_dict()


def test_the_report_shows_the_figures_on_its_first_screen(world: World) -> None:
    from html.parser import HTMLParser

    a = assess(world, "goals", "clean")
    html = world.tmp / "clean.html"
    assert main(["report", "--reference", *world.refs[:3], "--candidate",
                 world.cands["clean"], "--criteria", str(world.files["goals"]),
                 "--html", str(html), "--tracking-uri", world.store.tracking_uri]) in (0, 1)
    text = html.read_text(encoding="utf-8")

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.inside, self.rows, self.values = False, [], []

        def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
            d = dict(attrs)
            if tag == "table" and d.get("id") == "l4-table":
                self.inside = True
            if self.inside and tag == "tr":
                self.rows.append("")
            if self.inside and tag == "span" and "data-value" in d:
                self.values.append(d["data-value"])

        def handle_endtag(self, tag):  # type: ignore[no-untyped-def]
            if tag == "table":
                self.inside = False

        def handle_data(self, data):  # type: ignore[no-untyped-def]
            if self.inside and self.rows:
                self.rows[-1] += data

    p = Cells()
    p.feed(text)
    _, tp_row, cost_row, busy_row = p.rows
    r_tp = a.result("goal-throughput")
    shown_outcome = ("NOT EVALUABLE" if busy_not_judged(r_tp, r_tp.evidence["ratio"])
                     else "PASS")
    assert tp_row.startswith("throughput") and shown_outcome in tp_row.upper(), tp_row
    assert cost_row.startswith("cost per run") and "FAIL" in cost_row.upper()
    assert "not measured: run" in busy_row and "executed on the CPU" in busy_row
    perf = a.performance
    shown = [float(v) for v in p.values if v != "null"]
    for v in (perf["throughput"]["ratio"], perf["throughput"]["candidate_per_s"],
              perf["throughput"]["reference_per_s"], perf["cost"]["ratio"],
              perf["cost"]["candidate"], perf["cost"]["reference"]):
        assert any(x == pytest.approx(v, rel=1e-12) for x in shown), (v, shown)
    # On the first screen: right under the verdict, before the ranking.
    assert text.index('id="verdict"') < text.index('id="l4"') < text.index('id="departures"')


def test_a_report_without_criteria_measures_the_figures_without_prices(
        world: World) -> None:
    html = world.tmp / "plain.html"
    assert main(["report", "--reference", *world.refs[:3], "--candidate",
                 world.cands["clean"], "--html", str(html), "--tracking-uri",
                 world.store.tracking_uri]) == 0
    text = html.read_text(encoding="utf-8")
    panel = text[text.index('id="l4"'):text.index('id="departures"')]
    plain = re.sub(r"<[^>]+>", " ", panel)
    assert "measured only: no L4 goal declared" in plain
    assert "not measured: no [prices] table" in plain
    assert "no goal: measured only" in plain
    tp, _ = ratios_by_hand(world, world.cands["clean"], world.refs[:3])
    ratio = float(re.search(r'<td><span class="num" data-value="([^"]+)"', panel).group(1))
    assert ratio == pytest.approx(tp, rel=1e-9)


def test_a_sweep_line_carries_each_migrations_figures(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    cands = [world.cands["clean"], world.cands["host-check"], world.cands["same-machine"]]
    assert main(["accept", "--criteria", str(world.files["measured"]), "--reference",
                 *world.refs[:3], "--candidate", *cands, "--no-record",
                 "--tracking-uri", world.store.tracking_uri]) == 1
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()
             if ln.split() and ln.split()[0] in cands}
    for name in ("clean", "host-check"):
        tp, cost = ratios_by_hand(world, world.cands[name], world.refs[:3])
        assert f"L4 throughput {tp:.3g}x, cost {cost:.3g}x, busy not measured" in \
            lines[world.cands[name]]
    assert "L4 throughput" not in lines[world.cands["same-machine"]]  # step time judges it
