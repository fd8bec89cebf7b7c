"""The learning rate, recorded by the PyTorch and PyTorch/XLA probes and judged by
calibrated criteria (refrun.probes.optim; docs/acceptance.md, "Schedules").

A spot check on a Lightning workload found a removed learning-rate warmup passing every
criterion: the loss converged to the references' end state and nothing recorded the rate.
The probes now read every parameter group's rate at each step's entry (the rate the
step's update uses) from ``param_groups``; calibrate judges a metric that every reference
logged identically at every step (a schedule) at every step, and scopes criteria on
``opt/`` metrics to the backends whose probes record them.  Expected rates are computed
here from the schedule's formula; expected fractions with numpy."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported (also conftest)
torch = pytest.importorskip("torch")
try:  # the XLA device must exist before the process's first backward pass (autograd
    # sizes its device queues then), so it is created at collection
    import torch_xla

    XLA_DEVICE = torch_xla.device()
except ImportError:  # the XLA test skips; the others need only torch
    torch_xla = XLA_DEVICE = None

import refrun  # noqa: E402
import refrun.torch  # noqa: E402
from refrun import schema  # noqa: E402
from refrun.acceptance.assess import assess_ids  # noqa: E402
from refrun.acceptance.calibration import CalibrationOptions, calibrate_ids, write_file  # noqa: E402
from refrun.acceptance.criteria import load_criteria  # noqa: E402
from tests.acceptance_helpers import STEPS, N, record  # noqa: E402

# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")

WARMUP = 5  # steps of linear warmup: 5 % of the acceptance runs' 100 steps
BASE, BASE_PG1 = 0.1, 0.5


def warmup_rate(base: float, n: int) -> float:
    """The rate LambdaLR(min(1, (s + 1) / WARMUP)) gives the update of step n (n calls of
    scheduler.step() before it)."""
    return base * min(1.0, (n + 1) / WARMUP)


def history(client, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, metric))


def _torch_run(store, *, schedule_inside: bool, steps: int = 9) -> str:
    """Two parameter groups, a warmup schedule stepped inside or after the step scope."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([{"params": [model.weight]},
                           {"params": [model.bias], "lr": BASE_PG1}], lr=BASE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    with refrun.start_run("lr-test", "reference", backend="torch", seed=0,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False) as run, \
            refrun.torch.instrument(run, model=model, optimizer=opt) as probe:
        for n in range(steps):
            with probe.step(n):
                loss = model(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss)
                if schedule_inside:
                    sched.step()
            if not schedule_inside:
                sched.step()
    assert run.run_id is not None
    return run.run_id


def test_the_torch_probe_records_each_groups_rate_as_the_step_used_it(store) -> None:
    """Wherever the loop steps its scheduler (inside the step scope or after it), step n
    records the rate its update used, for every parameter group."""
    client = store.client()
    for inside in (True, False):
        run_id = _torch_run(store, schedule_inside=inside)
        for metric, base in ((schema.M_LR, BASE), (f"{schema.M_LR}/pg1", BASE_PG1)):
            got = history(client, run_id, metric)
            assert [s for s, _ in got] == list(range(9)), (inside, metric)
            assert [v for _, v in got] == pytest.approx(
                [warmup_rate(base, n) for n in range(9)], rel=1e-12), (inside, metric)


def test_a_host_tensor_rate_is_read_and_a_device_rate_is_not(store) -> None:
    """A rate held as a CPU tensor is a memory load: recorded.  (The XLA test below shows
    a rate on a device is never read.)"""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05))
    with refrun.start_run("lr-test", "reference", backend="torch", seed=0,
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                          snapshot_environment=False) as run, \
            refrun.torch.instrument(run, model=model, optimizer=opt) as probe:
        for n in range(3):
            with probe.step(n):
                probe.log(loss=1.0)
    assert [v for _, v in history(store.client(), run.run_id, schema.M_LR)] == \
        pytest.approx([0.05] * 3)


def test_the_xla_probe_records_the_rate_and_adds_nothing_to_the_step(store) -> None:
    """PyTorch/XLA, the block path: the rate of every step is recorded, and reading it
    adds no compilation, execution, transfer or host sync (torch_xla's own counters, the
    same loop probed without the optimizer); a rate held as an XLA tensor is not read
    (no host sync: torch_xla's ``_local_scalar_dense`` counter does not move) and the run
    says so."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    import torch_xla.debug.metrics as met

    import refrun.xla

    dev = XLA_DEVICE

    def counts() -> dict[str, int]:
        # Device-to-host copies through torch (the probe's own batched copies of logged
        # values go through _xla_get_cpu_tensors, as many as the device was found idle).
        return {"uncached": met.counter_value("UncachedCompile") or 0,
                "cached": met.counter_value("CachedCompile") or 0,
                "exec": met.counter_value("ExecuteComputation") or 0,
                "to_cpu": met.counter_value("xla::_to_cpu") or 0,
                "syncs": met.counter_value("aten::_local_scalar_dense") or 0}

    def loop(width: int, *, give_optimizer: bool, device_rate: bool = False
             ) -> tuple[str, dict[str, int]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                    torch.nn.Linear(width, 1)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=BASE)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
        x, y = torch.randn(8, 4).to(dev), torch.randn(8, 1).to(dev)
        rate_holder = opt
        if device_rate:  # the probe sees a group whose rate is an XLA tensor
            rate_holder = torch.optim.SGD([torch.zeros(1, device=dev)],
                                          lr=torch.tensor(BASE, device=dev))
        torch_xla.sync()  # the set-up's tensors are device data before the loop
        run = refrun.start_run("lr-test", "candidate", backend="torch_xla", hardware="cpu",
                               seed=0, tracking_uri=store.tracking_uri,
                               spool_dir=store.spool_dir, snapshot_environment=False)
        before = counts()
        with refrun.xla.instrument(run, model=model,
                                   optimizer=rate_holder if give_optimizer else None) as probe:
            for n in range(8):
                with probe.step(n):
                    loss = ((model(x) - y) ** 2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    torch_xla.sync()
                    probe.log(loss=loss)
                sched.step()
            torch_xla._XLAC._xla_wait_device_ops([])
            during = counts()
        run.close()
        assert run.run_id is not None
        return run.run_id, {k: during[k] - before[k] for k in before}

    plain_id, plain = loop(21, give_optimizer=False)
    rated_id, rated = loop(22, give_optimizer=True)
    assert rated == plain, (rated, plain)  # new widths: both compile from scratch
    assert plain["syncs"] == plain["to_cpu"] == 0
    client = store.client()
    assert all(v == 0 for _, v in history(client, rated_id, schema.M_XFER_D2H))
    assert history(client, plain_id, schema.M_LR) == []
    got = history(client, rated_id, schema.M_LR)
    assert [s for s, _ in got] == list(range(8))
    assert [v for _, v in got] == pytest.approx([warmup_rate(BASE, n) for n in range(8)])

    device_id, on_device = loop(23, give_optimizer=True, device_rate=True)
    assert on_device["syncs"] == 0 and on_device == plain
    assert history(client, device_id, schema.M_LR) == []
    warnings = json.loads(store.artifact_text(device_id, schema.ARTIFACT_WARNINGS))["warnings"]
    assert any("learning rate of parameter group 0" in w["message"]
               and "not recorded" in w["message"] for w in warnings), warnings


# --- calibrate and assess --------------------------------------------------------------
NREF = 4


def _rates(warmup: int) -> np.ndarray:
    return BASE * np.minimum(1.0, (STEPS + 1) / warmup) if warmup else np.full(N, BASE)


def _metrics(seed: int, warmup: int = WARMUP, lr: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"loss": 2.3 * np.exp(-STEPS / 30.0) + 0.2 + rng.normal(0, 0.02, N),
           "eval/accuracy": 0.9 - 0.5 * np.exp(-STEPS / 20.0) + rng.normal(0, 0.01, N)}
    if lr:
        out[schema.M_LR] = _rates(warmup)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lr")
    uri, spool = f"sqlite:///{tmp}/mlflow.db", tmp / "spool"
    refs = [record(uri, spool, "reference", _metrics(s), seed=s) for s in range(NREF)]
    cands = {
        "xla": record(uri, spool, "candidate", _metrics(10), seed=10, backend="torch_xla",
                      hardware="tpu-v5e"),
        "no-warmup": record(uri, spool, "candidate", _metrics(11, warmup=0), seed=11,
                            backend="torch_xla", hardware="tpu-v5e"),
        "jax": record(uri, spool, "candidate", _metrics(12, lr=False), seed=12,
                      backend="jax", hardware="tpu-v5e"),
    }
    # The candidates are recorded without a probe: no XLA or JAX runtime counters to judge.
    cal = calibrate_ids([r.run_id for r in refs], uri,
                        CalibrationOptions(group_size=NREF - 1, exclude_kinds=(
                            "compilation", "host_transfers", "fallback")))
    path = tmp / "c.toml"
    write_file(cal, path)
    return {"uri": uri, "refs": refs, "cands": cands, "path": path}


def test_calibrate_judges_a_schedule_at_every_step_on_the_backends_that_record_it(
        world: dict) -> None:
    crit = load_criteria(world["path"])
    lr = [c for c in crit.criteria if getattr(c, "metric", None) == schema.M_LR]
    assert lr, [c.id for c in crit.criteria]
    for c in lr:
        assert c.backends == list(schema.OPT_BACKENDS), c.id
    env = crit.criterion("opt-lr-envelope")
    assert env.min_fraction == 1.0
    # The loss, a measurement, keeps an allowance for run-to-run noise (derived from the
    # references: between 2 x 0.9 - 1 and --min-fraction 0.9); so does an evaluation.
    assert 0.8 <= crit.criterion("loss-envelope").min_fraction <= 0.9
    assert 0.8 <= crit.criterion("accuracy-envelope").min_fraction <= 0.9  # eval/accuracy


@pytest.mark.parametrize(("name", "outcome"), [("xla", "pass"), ("no-warmup", "fail"),
                                               ("jax", "not_applicable")])
def test_a_removed_warmup_fails_and_another_framework_is_not_applicable(
        world: dict, name: str, outcome: str) -> None:
    crit = load_criteria(world["path"])
    refs = [r.run_id for r in world["refs"][:NREF - 1]]
    a, _ = assess_ids(crit, refs, world["cands"][name].run_id, world["uri"])
    res = next(r for r in a.results if r.id == "opt-lr-envelope")
    assert res.outcome == outcome, res
    if name == "no-warmup":
        # Steps 0..WARMUP-2 differ (at step WARMUP-1 the warmup reaches the base rate):
        # 4 of 100 steps, inside the 10 % a measurement is allowed, so only the every-step
        # rule catches it.
        inside = np.isclose(_rates(0), _rates(WARMUP), rtol=0, atol=1e-9)
        assert res.evidence["fraction_inside"] == pytest.approx(inside.mean())
        assert inside.mean() >= 0.9
    if name == "jax":  # the scope is the reason, and the verdict is not held by it
        assert "torch" in res.reason and "torch_xla" in res.reason, res.reason
        assert a.verdict != "incomplete", a.verdict


def test_a_group_added_mid_run_is_recorded_from_its_first_step(store) -> None:
    """PyTorch/XLA keeps a block of steps before handing them to the session: a parameter
    group added inside a block (``add_param_group``) gives that block rows with two name
    sets, and every row's rates must still reach the run (group 0 at every step, group 1
    from the step after it was added)."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    import refrun.xla

    dev = XLA_DEVICE
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(dev)
    extra = torch.nn.Parameter(torch.zeros(1, device=dev))
    opt = torch.optim.SGD(model.parameters(), lr=BASE)
    x = torch.randn(8, 4).to(dev)
    run = refrun.start_run("lr-test", "candidate", backend="torch_xla", hardware="cpu",
                           seed=0, tracking_uri=store.tracking_uri,
                           spool_dir=store.spool_dir, snapshot_environment=False,
                           flush_interval_s=30.0)  # one block for the whole run
    with refrun.xla.instrument(run, model=model, optimizer=opt) as probe:
        for n in range(6):
            with probe.step(n):
                loss = (model(x) ** 2).mean() + extra.sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch_xla.sync()
                probe.log(loss=loss)
            if n == 2:
                opt.add_param_group({"params": [extra], "lr": BASE_PG1})
    run.close()
    client = store.client()
    assert history(client, run.run_id, schema.M_LR) == [(n, pytest.approx(BASE))
                                                        for n in range(6)]
    assert history(client, run.run_id, f"{schema.M_LR}/pg1") == [
        (n, pytest.approx(BASE_PG1)) for n in range(3, 6)]


def test_the_readers_give_the_optimizers_own_rate_and_count_through_a_reload() -> None:
    """What the probes read at every step (:class:`refrun.probes.optim.LearningRates`),
    against the optimizer's own ``param_groups`` and ``state``: a one-group float rate
    (the readers' shortest path), the count of a 0-d CPU tensor updated in place, the
    same after ``load_state_dict`` of an older checkpoint (a new state dict and new
    tensors: the count goes back), of the optimizer's own live state (the same tensors),
    a group added, and an optimizer with no state (SGD) or no update yet."""
    import copy

    from refrun.probes.optim import LearningRates

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    reader = LearningRates(opt)
    assert reader.steps() is None  # no update yet: no count to record
    assert reader.read() == ((schema.M_LR,), (0.1,))

    def update() -> None:
        model(torch.randn(2, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    saved = None
    for n in range(5):
        update()
        if n == 1:
            saved = copy.deepcopy(opt.state_dict())  # after 2 updates
        assert reader.read() == ((schema.M_LR,), (opt.param_groups[0]["lr"],))
        assert reader.steps() == float(opt.state[model.weight]["step"]) == n + 1
    assert reader.read()[1] == (0.1 * 0.5 ** 5,)
    opt.load_state_dict(saved)  # back to the checkpoint: 2 updates, the rate then
    assert reader.steps() == 2.0
    assert reader.read()[1] == (saved["param_groups"][0]["lr"],) == (0.1 * 0.5 ** 2,)
    update()
    assert reader.steps() == float(opt.state[model.weight]["step"]) == 3.0
    opt.load_state_dict(opt.state_dict())  # the live state again: the same count tensors
    update()
    assert reader.steps() == float(opt.state[model.weight]["step"]) == 4.0
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5})
    assert reader.read() == ((schema.M_LR, f"{schema.M_LR}/pg1"),
                             (opt.param_groups[0]["lr"], 0.5))

    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    plain = LearningRates(sgd)
    model(torch.randn(2, 3)).sum().backward()
    sgd.step()
    assert not sgd.state and plain.steps() is None  # SGD keeps no count
    assert plain.read() == ((schema.M_LR,), (0.01,))
