"""refrun.torch: the PyTorch probe against real torch (CPU) and a real sqlite MLflow store."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import refrun
import refrun.torch
from refrun import schema
from refrun.errors import RefrunInputError
from refrun.probes.monitors import NvmlMonitor, PsutilMonitor, default_monitors
from refrun.probes.torch import frame_compile_index
from refrun.store.curves import read_curves

# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")

SYS_KEYS = {"sys/cpu_pct", "sys/mem_used_bytes", "sys/mem_pct", "sys/proc_cpu_pct",
            "sys/rss_bytes", schema.M_SYS_RUN_CPU_CORES, schema.M_SYS_OTHERS_CPU_CORES,
            schema.M_SYS_LOGICAL_CPUS}


def _start(store, hardware: str = "cpu", **kw):
    return refrun.start_run("torch-probe", "reference", hardware=hardware, backend="torch",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False, **kw)


def _curves(store, run_id: str) -> pd.DataFrame:
    path = store.client().download_artifacts(run_id, schema.ARTIFACT_CURVES, str(store.tmp))
    return read_curves(Path(path))


def _series(df: pd.DataFrame, metric: str) -> dict[int, float]:
    sub = df[df.metric == metric].sort_values("seq")
    return dict(zip(sub.step.astype(int), sub.value, strict=True))


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)


class LocalScalarCounter(TorchDispatchMode):
    """Counts aten::_local_scalar_dense (what .item(), float(t), bool(t) dispatch to)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


# --- values and step times ---------------------------------------------------------------
def test_logged_losses_equal_the_loop_values_and_step_times_are_plausible(store):
    model, (x, y) = _mlp(), _data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps, sleep_s = 30, 0.002
    loop_losses, outer_s = [], []
    with _start(store) as run:
        probe = refrun.torch.instrument(run, model=model, optimizer=opt,
                                        sample_interval_s=0.05)
        for n in range(steps):
            t0 = time.perf_counter()
            with probe.step(n):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                time.sleep(sleep_s)  # a floor the step time must respect
                probe.log(loss=loss, lr=1e-2)
            outer_s.append(time.perf_counter() - t0)
            loop_losses.append(loss.detach().clone())
            if n % 10 == 9:
                probe.log_eval(n, mse=torch.nn.functional.mse_loss(model(x), y).detach())
        probe.close()
        stats = probe.step_time_stats()
    df = _curves(store, run.run_id)
    logged = _series(df, "loss")
    assert sorted(logged) == list(range(steps))
    np.testing.assert_array_equal([logged[n] for n in range(steps)],
                                  np.array([t.numpy() for t in loop_losses], dtype=np.float64))
    assert _series(df, "lr") == dict.fromkeys(range(steps), 1e-2)
    assert sorted(_series(df, "eval/mse")) == [9, 19, 29]
    assert not df.metric.str.startswith("compile/").any()  # eager: nothing compiled

    times = _series(df, schema.M_STEP_TIME)
    assert sorted(times) == list(range(steps))
    for n in range(steps):  # inside the outer bracket, above the sleep inside the step
        assert sleep_s <= times[n] <= outer_s[n]
    steady = np.array([times[n] for n in range(5, steps)])
    assert stats is not None and stats.count == steps - 5
    assert stats.median_s == pytest.approx(float(np.median(steady)))
    assert stats.p90_s == pytest.approx(float(np.percentile(steady, 90)))

    tags = store.client().get_run(run.run_id).data.tags
    assert tags["refrun.perf.step_time_kind"] == "wall"
    assert float(tags["refrun.perf.step_time_median_s"]) == pytest.approx(
        float(np.median(steady)), rel=1e-5)
    placement = json.loads(tags[schema.TAG_PLACEMENT])
    assert placement["params"] == {"cpu": 4} and placement["logged"] == {"cpu": steps + 3}
    assert placement["optimizer_state"] == {"cpu": 8}  # exp_avg(_sq) of 4 tensors
    assert tags[schema.TAG_EXEC_HARDWARE] == "cpu"
    assert schema.TAG_PLACEMENT_WARNING not in tags

    # utilisation: each sys metric at most once per training step, inside the run's steps
    for key in SYS_KEYS:
        sub = df[df.metric == key]
        assert len(sub) >= 1, key
        assert sub.step.is_unique and sub.step.between(0, steps - 1).all()
    rss = df[df.metric == "sys/rss_bytes"].value
    assert (rss > 1e7).all()  # a process with torch loaded holds well over 10 MB
    import psutil

    assert (df[df.metric == schema.M_SYS_LOGICAL_CPUS].value == psutil.cpu_count()).all()
    assert (df[df.metric == schema.M_SYS_OTHERS_CPU_CORES].value >= 0).all()


def test_no_added_host_sync(store):
    """The wrapper adds no aten::_local_scalar_dense: same count wrapped and unwrapped,
    including the loop's own deliberate .item() calls."""

    def loop(probe=None) -> tuple[int, list[float]]:
        model, (x, y) = _mlp(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        user_items: list[float] = []
        with LocalScalarCounter() as counter:
            for n in range(12):
                ctx = probe.step(n) if probe is not None else _null()
                with ctx:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if n % 4 == 0:
                        user_items.append(loss.item())  # the user's own sync, counted
                    if probe is not None:
                        probe.log(loss=loss, gnorm=model[0].weight.detach().norm(), n=n)
            if probe is not None:
                probe.close()
        return counter.count, user_items

    unwrapped, items_plain = loop()
    with _start(store) as run:
        probe = refrun.torch.instrument(run, model=None, monitors=None)
        wrapped, items_wrapped = loop(probe)
    assert unwrapped == 3 == wrapped  # the mode does see syncs: the loop's own three
    assert items_plain == items_wrapped
    df = _curves(store, run.run_id)
    assert len(_series(df, "loss")) == 12 and len(_series(df, "gnorm")) == 12


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_value_kinds_are_read_exactly(store):
    with _start(store) as run:
        probe = refrun.torch.instrument(run, monitors=None)
        with probe.step(0):
            probe.log(bf16=torch.tensor(1.5, dtype=torch.bfloat16),
                      i64=torch.tensor([7]), f64=torch.tensor(0.1, dtype=torch.float64),
                      npy=np.float32(2.5), py=3, nested={"a": torch.tensor(4.0)})
        probe.close()
    df = _curves(store, run.run_id)
    got = {m: _series(df, m)[0] for m in ("bf16", "i64", "f64", "npy", "py", "nested/a")}
    assert got == {"bf16": 1.5, "i64": 7.0, "f64": 0.1, "npy": 2.5, "py": 3.0,
                   "nested/a": 4.0}


# --- compilation -----------------------------------------------------------------------
def _compiled_run(store, backend: str, batches: list[int]):
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cmodel = torch.compile(model, dynamic=False, backend=backend)
    torch_graphs: dict[int, int] = {}
    guard_fail_steps: set[int] = set()
    with _start(store) as run:
        probe = refrun.torch.instrument(run, model=cmodel, optimizer=opt, monitors=None)
        for n, bs in enumerate(batches):
            g0 = counters["stats"]["unique_graphs"]
            f0 = sum(len(v) for v in guard_failures.values())
            with probe.step(n):
                x = torch.randn(bs, 8)
                loss = cmodel(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss)
            torch_graphs[n] = counters["stats"]["unique_graphs"] - g0
            if sum(len(v) for v in guard_failures.values()) > f0:
                guard_fail_steps.add(n)
        probe.close()
    return run, torch_graphs, guard_fail_steps


def _first_seen_steps(batches: list[int]) -> set[int]:
    seen: set[int] = set()
    out = set()
    for n, bs in enumerate(batches):
        if bs not in seen:
            out.add(n)
            seen.add(bs)
    return out


def test_recompilations_per_step_follow_the_shape_changes(store):
    batches = [4, 4, 6, 6, 6, 9, 4, 9, 5, 5]
    run, torch_graphs, guard_fail_steps = _compiled_run(store, "aot_eager", batches)
    df = _curves(store, run.run_id)
    steps = len(batches)
    recompiles = _series(df, schema.M_COMPILE_RECOMPILES)
    graphs = _series(df, schema.M_COMPILE_GRAPHS)
    new_shapes = _first_seen_steps(batches)  # {0, 2, 5, 8}
    expected_recompiles = {n: float(n in new_shapes and n != 0) for n in range(len(batches))}
    assert recompiles == expected_recompiles
    assert graphs == {n: float(n in new_shapes) for n in range(len(batches))}
    # ... and agree with torch's own records taken around each step by this test
    assert graphs == {n: float(v) for n, v in torch_graphs.items()}
    assert {n for n, v in recompiles.items() if v} == guard_fail_steps
    times = _series(df, schema.M_COMPILE_TIME)
    assert all(times[n] > 0 for n in new_shapes)
    assert all(times[n] == 0 for n in range(steps) if n not in new_shapes)
    assert _series(df, schema.M_COMPILE_GRAPH_BREAKS) == dict.fromkeys(range(steps), 0.0)


def test_graph_breaks_are_counted(store):
    import torch._dynamo

    torch._dynamo.reset()

    def fn(x):
        x = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return x.sum()

    cfn = torch.compile(fn, backend="eager")
    with _start(store) as run:
        probe = refrun.torch.instrument(run, monitors=None)
        for n in range(3):
            with probe.step(n):
                probe.log(loss=cfn(torch.ones(3)))
        torch._dynamo.utils.counters.clear()  # a test suite's reset must not go negative
        with probe.step(3):
            probe.log(loss=cfn(torch.ones(3)))
        probe.close()
    df = _curves(store, run.run_id)
    assert _series(df, schema.M_COMPILE_GRAPH_BREAKS) == {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert _series(df, schema.M_COMPILE_GRAPHS) == {0: 2.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert _series(df, "loss")[3] == pytest.approx(3 * 2 * math.sin(1.0), rel=1e-6)


@pytest.mark.slow
def test_recompilations_with_inductor(store):
    batches = [4, 6, 6, 4]
    run, torch_graphs, guard_fail_steps = _compiled_run(store, "inductor", batches)
    df = _curves(store, run.run_id)
    assert _series(df, schema.M_COMPILE_RECOMPILES) == {0: 0.0, 1: 1.0, 2: 0.0, 3: 0.0}
    assert guard_fail_steps == {1}
    assert _series(df, schema.M_COMPILE_GRAPHS) == {n: float(v) for n, v in
                                                    torch_graphs.items()}


@pytest.mark.parametrize(("cid", "idx"), [("3/2", 2), ("0/0", 0), ("3/0_1", 0),
                                          ("!0/3/1", 1), ("garbage", -1), ("1/x", -1)])
def test_frame_compile_index(cid, idx):
    assert frame_compile_index(cid) == idx


# --- placement -------------------------------------------------------------------------
def _short_loop(probe, model, steps: int = 4, on_step=None) -> None:
    x, y = _data(16)
    for n in range(steps):
        if on_step is not None:
            on_step(n)
        with probe.step(n):
            probe.log(loss=torch.nn.functional.mse_loss(model(x), y).detach())
    probe.close()


@pytest.mark.parametrize("hardware", ["a100", "tpu-v5e"])
def test_model_left_on_cpu_while_an_accelerator_is_declared_warns(store, hardware):
    model = _mlp()
    with _start(store, hardware=hardware) as run:
        _short_loop(refrun.torch.instrument(run, model=model, monitors=None), model)
        warnings = [w["message"] for w in run.warnings]
    tags = store.client().get_run(run.run_id).data.tags
    warning = tags[schema.TAG_PLACEMENT_WARNING]
    assert "model parameters on cpu" in warning and "logged values" in warning
    assert any(m.startswith("placement:") and "model parameters on cpu" in m
               for m in warnings)
    assert json.loads(tags[schema.TAG_PLACEMENT])["expected"] == "accelerator"


def test_expect_device_cuda_with_cpu_model_warns_and_cpu_does_not(store):
    model = _mlp()
    with _start(store, hardware=None) as run:
        _short_loop(refrun.torch.instrument(run, model=model, expect_device="cuda",
                                            monitors=None), model)
    tags = store.client().get_run(run.run_id).data.tags
    assert "but cuda was expected" in tags[schema.TAG_PLACEMENT_WARNING]

    with _start(store, hardware="cpu") as run2:
        _short_loop(refrun.torch.instrument(run2, model=model, expect_device="cpu",
                                            monitors=None), model)
    tags2 = store.client().get_run(run2.run_id).data.tags
    if not torch.cuda.is_available():  # with CUDA present a CPU model is warned about
        assert schema.TAG_PLACEMENT_WARNING not in tags2


def test_placement_is_rechecked_during_the_run(store):
    model = _mlp()

    def move_a_parameter_away(n: int) -> None:
        if n == 5:  # a parameter appears on another device mid-run
            model.extra = torch.nn.Parameter(torch.zeros(2, device="meta"))

    with _start(store) as run:
        probe = refrun.torch.instrument(run, model=model, expect_device="cpu",
                                        monitors=None, recheck_every=2)
        _short_loop(probe, model, steps=10, on_step=move_a_parameter_away)
        warnings = [w for w in run.warnings if w["message"].startswith("placement:")]
    assert len(warnings) == 1 and "meta" in warnings[0]["message"]
    assert warnings[0]["step"] == 5  # found at the first re-check after the change
    tags = store.client().get_run(run.run_id).data.tags
    assert json.loads(tags[schema.TAG_PLACEMENT])["params"] == {"cpu": 4, "meta": 1}


# --- bad input ------------------------------------------------------------------------
def test_nonfinite_loss_is_recorded_counted_and_warned_once(store):
    values = [1.0, float("nan"), 0.5, float("inf"), 0.25]
    with _start(store) as run:
        probe = refrun.torch.instrument(run, monitors=None)
        for n, v in enumerate(values):
            with probe.step(n):
                probe.log(loss=torch.tensor(v))
        probe.close()
        warnings = [w for w in run.warnings if "loss is" in w["message"]]
    assert len(warnings) == 1 and warnings[0]["step"] == 1 and "nan" in warnings[0]["message"]
    got = [_series(_curves(store, run.run_id), "loss")[n] for n in range(len(values))]
    np.testing.assert_array_equal(got, values)
    assert store.client().get_run(run.run_id).data.tags[schema.TAG_NONFINITE] == "2"


def test_bad_usage_is_recorded_never_raised_into_the_loop(store):
    class NoParams(torch.nn.Module):
        def forward(self, x):
            return x * 2

    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3, device="meta"))
    opt = torch.optim.SGD([a, b], lr=0.1)
    with _start(store) as run:
        probe = refrun.torch.instrument(run, model=NoParams(), optimizer=opt, monitors=None)
        probe.log(loss=1.0)  # before any step: warned, ignored
        for n in range(3):
            with probe.step(n):
                with probe.step(n):  # entered twice
                    probe.log(loss=torch.tensor(float(n)))
                probe.log(vec=torch.ones(4), text="x", flag=True,
                          meta=torch.ones((), device="meta"))
        t = torch.tensor(5.0)
        with probe.step(3):
            probe.log(loss=t)
            t.add_(1)  # modified after logging: the logged value is the one recorded
        probe.close()
        messages = " | ".join(w["message"] for w in run.warnings)
    for needle in ("model has no parameters", "mixed devices: cpu, meta", "was still open",
                   "before any probe.step", "shape (4,)", "type str", "type bool",
                   "device meta"):
        assert needle in messages, needle
    assert _series(_curves(store, run.run_id), "loss") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 5.0}


def test_instrument_rejects_wrong_arguments(store):
    with _start(store) as run:
        with pytest.raises(RefrunInputError, match="model"):
            refrun.torch.instrument(run, model="resnet")
        with pytest.raises(RefrunInputError, match="optimizer"):
            refrun.torch.instrument(run, optimizer=torch.nn.Linear(2, 2))
        with pytest.raises(RefrunInputError, match="expect_device"):
            refrun.torch.instrument(run, expect_device="gpu-please")
        with pytest.raises(RefrunInputError, match="recheck_every"):
            refrun.torch.instrument(run, recheck_every=-1)
        with pytest.raises(RefrunInputError, match="monitors"):
            refrun.torch.instrument(run, monitors="nvml")
    with pytest.raises(RefrunInputError, match="run"):
        refrun.torch.instrument(object())


# --- monitors -------------------------------------------------------------------------
def test_psutil_monitor_reads_this_process():
    import psutil

    mon = PsutilMonitor.create()
    assert mon is not None
    sample = mon.sample()
    assert set(sample) == SYS_KEYS
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss <= sample["sys/rss_bytes"] <= 2 * rss
    assert 0 <= sample["sys/mem_pct"] <= 100 and sample["sys/mem_used_bytes"] > 0
    mon.close()


def test_nvml_monitor_is_off_cleanly_without_a_gpu_driver():
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_driver = True
    except Exception:
        has_driver = False
    mon = NvmlMonitor.create()
    if has_driver:
        pytest.skip("an NVIDIA driver is present: covered by benchmarks/gpu_check_torch.py")
    assert mon is None
    assert [m.name for m in default_monitors()] == ["psutil"]


def test_samples_are_logged_against_the_step_current_when_taken(store):
    mon = PsutilMonitor.create()
    with _start(store) as run:
        probe = refrun.torch.instrument(run, monitors=[mon], sample_interval_s=3600)
        for n in range(6):
            with probe.step(n):
                if n in (1, 4):
                    probe.sample_now()
                    probe.sample_now()  # two samples in one step: one averaged point
        probe.close()  # takes a final sample at the last step
    rss = _series(_curves(store, run.run_id), "sys/rss_bytes")
    assert sorted(rss) == [1, 4, 5]


def test_values_of_a_step_reach_the_session_in_logging_order_with_repeats_counted(store):
    # The probe hands a step's host values to the session in one call at step exit; a name
    # logged twice in one step, or a value for another step, must still arrive in the order
    # it was logged, counted as repeated by the session (not silently overwritten).
    with _start(store) as run:
        probe = refrun.torch.instrument(run, monitors=None)
        for n in range(3):
            with probe.step(n):
                probe.log(loss=torch.tensor(float(n)))
                probe.log(loss=n + 0.5)  # the same name again in this step
                probe.log(step=n + 100, ahead=float(n))  # another step's value
        probe.log(late=7.0)  # after the last step: recorded at the last step
        probe.close()
        stats = run.step_stats()
    df = _curves(store, run.run_id)
    loss = df[df.metric == "loss"].sort_values("seq")
    assert loss.step.tolist() == [0, 0, 1, 1, 2, 2]
    assert loss.value.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert stats["loss"].repeated == 3 and stats["loss"].count == 6
    assert _series(df, "ahead") == {100: 0.0, 101: 1.0, 102: 2.0}
    assert _series(df, "late") == {2: 7.0}
    assert sorted(_series(df, schema.M_STEP_TIME)) == [0, 1, 2]


def test_the_placement_tag_changes_with_devices_not_with_each_recheck(store) -> None:
    """At every placement re-check the probe re-describes the run, but the placement tag
    names the devices values were logged on and counts them only at close: a tag that
    changed at each re-check had the session rewrite the spool's metadata (a lock and an
    fsync) and the delivery re-send every tag.  After the first step no re-check sets a
    tag; the close sets the counts."""
    model, (x, y) = _mlp(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    steps, seen, calls = 40, {}, []
    with _start(store) as run:
        set_tags = run.set_tags
        run.set_tags = lambda tags: (calls.append((len(seen), dict(tags))), set_tags(tags))
        probe = refrun.torch.instrument(run, model=model, optimizer=opt, recheck_every=5,
                                        monitors=[])
        for n in range(steps):
            with probe.step(n):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss)
            if n in (4, 19, 39):
                seen[n] = json.loads(run.tags[schema.TAG_PLACEMENT])
        probe.close()
    assert seen[4] == seen[19] == seen[39] and seen[4]["logged"] == {"cpu": None}
    assert [tags for after, tags in calls if 1 <= after < 3] == []  # steps 5-39: none
    final = json.loads(store.client().get_run(run.run_id).data.tags[schema.TAG_PLACEMENT])
    assert final["logged"] == {"cpu": steps} and final["params"] == seen[4]["params"]
