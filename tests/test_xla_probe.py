"""refrun.xla.instrument on real torch_xla (PJRT CPU): compilations, transfers, host syncs,
CPU fallback, logged values, device truth and the end-of-run summary.

Every expected count is read by the test itself from torch_xla's own counters around the
body of each step (the user's part of the step), independently of the probe.  torch_xla
caches compiled graphs per process, so each test builds a model of its own width: no test
can hit a graph another test compiled.
"""

from __future__ import annotations

import gc
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported (also conftest)
torch = pytest.importorskip("torch")
torch_xla = pytest.importorskip("torch_xla")
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import refrun  # noqa: E402
import refrun.xla  # noqa: E402
from refrun import schema  # noqa: E402
from refrun.errors import RefrunInputError  # noqa: E402
from refrun.probes.tpu_monitor import TpuMonitor  # noqa: E402
from refrun.probes.xla import (  # noqa: E402
    COPY_FROM,
    HOST_SYNC_OP,
    ROW_NAMES,
    TO_COPY,
    TO_CPU,
    SummaryTally,
    XlaSummary,
)

# What these tests read is what the runs record; the delivery process is tested elsewhere
# (conftest.deliver_in_process says where and what it saves).
pytestmark = pytest.mark.usefixtures("deliver_in_process")

DEV = torch_xla.device()
IN = 6


def start(store, hardware: str = "cpu", **options: Any) -> refrun.RunSession:
    return refrun.start_run("xla-probe-test", "candidate", hardware=hardware,
                            backend="torch_xla", tracking_uri=store.tracking_uri,
                            spool_dir=store.spool_dir, snapshot_environment=False,
                            **options)


def make(width: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same MLP twice: on the XLA device and on the CPU (an independent reference)."""
    torch.manual_seed(seed)
    cpu = torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.Tanh(),
                              torch.nn.Linear(width, 1))
    xla = torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.Tanh(),
                              torch.nn.Linear(width, 1))
    xla.load_state_dict(cpu.state_dict())
    return xla.to(DEV), cpu


def batch(n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + n)
    x = torch.randn(rows, IN, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


class ProbeCopies:
    """The test's own count of ``_xla_get_cpu_tensors`` calls made off the test's thread:
    the probe's copier thread, which copies logged values at any moment (each call one
    sample of torch_xla's ``TransferFromDeviceTime``).  The user's copies in these tests
    all run on the test's thread."""

    def __init__(self) -> None:
        self.started = self.made = self.finished = 0
        self.cv = threading.Condition()
        # when set: each copier call, once its copy is made, signals `copied` and does not
        # return before `release` is set (a copy in flight for as long as a test wants)
        self.gate: tuple[threading.Event, threading.Event] | None = None

    def wrap(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                return f(*args, **kwargs)
            with self.cv:
                self.started += 1
            try:
                out = f(*args, **kwargs)
            finally:
                with self.cv:
                    self.made += 1  # its sample is in torch_xla's count
                    self.cv.notify_all()
            if self.gate is not None:
                copied, release = self.gate
                copied.set()
                release.wait(timeout=30)
            self.finished += 1
            return out
        return counted

    def user_d2h(self) -> int:
        """torch_xla's copy count less the copier's copies, read while none is being made."""
        while True:
            done = self.made
            d2h = met.metric_data("TransferFromDeviceTime")
            if self.started == done:
                return (d2h[0] if d2h else 0) - done
            with self.cv:
                self.cv.wait_for(lambda: self.started == self.made, timeout=10)


PROBE_COPIES = ProbeCopies()


@pytest.fixture(autouse=True, scope="module")
def _count_probe_copies():
    real = torch_xla._XLAC._xla_get_cpu_tensors
    torch_xla._XLAC._xla_get_cpu_tensors = PROBE_COPIES.wrap(real)
    yield
    torch_xla._XLAC._xla_get_cpu_tensors = real


def raw() -> dict[str, int]:
    """torch_xla's own cumulative counts, read by the test (copies: the user's only)."""
    return {"uncached": met.counter_value("UncachedCompile") or 0,
            "cached": met.counter_value("CachedCompile") or 0,
            "d2h": PROBE_COPIES.user_d2h(),
            "syncs": met.counter_value("aten::_local_scalar_dense") or 0,
            "nonzero": met.counter_value("aten::nonzero") or 0,
            "exec": met.counter_value("ExecuteComputation") or 0}


def diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def train(model: torch.nn.Module, rows: list[int], probe=None, *, item: bool = False,
          extra: Callable[[int], None] | None = None) -> tuple[list[dict[str, int]], list]:
    """The user's loop: SGD on ``model``, one sync per step; ``probe`` optional.
    Returns the test's own per-step counts (body of the step) and the loss tensors."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    own, losses = [], []
    for n, r in enumerate(rows):
        x, y = batch(n, r)
        ctx = probe.step(n) if probe is not None else _Nothing()
        with ctx:
            before = raw()
            xd, yd = x.to(DEV), y.to(DEV)
            loss = ((model(xd) - yd) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if extra is not None:
                extra(n)
            torch_xla.sync()
            if item:
                loss.item()  # the user's own host sync
            if probe is not None:
                probe.log(loss=loss)
            own.append(diff(before, raw()))
        losses.append(loss)
    return own, losses


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def history(store, run_id: str, metric: str) -> list[float]:
    return [m.value for m in sorted(store.client().get_metric_history(run_id, metric),
                                    key=lambda m: m.step)]


def per_step(store, run_id: str, metric: str, steps: int) -> list[float]:
    """A counter's value at steps 0..steps-1; the probe logs counters sparsely (a step
    without a change is absent, meaning 0)."""
    got = {m.step: m.value for m in store.client().get_metric_history(run_id, metric)}
    assert set(got) <= set(range(steps)), got
    return [got.get(s, 0.0) for s in range(steps)]


def artifact(store, run_id: str, name: str) -> dict:
    return json.loads(store.artifact_text(run_id, name))


# --- compilations ---------------------------------------------------------------------
def test_uncached_compilations_per_step_match_torch_xla(store) -> None:
    model, _ = make(width=11)
    rows = [8] * 4 + [9, 10, 11, 12]  # fixed shape, then a new batch size every step
    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=4) as probe:
        own, _ = train(model, rows, probe)
    run.close()
    recorded = per_step(store, run.run_id, schema.M_COMPILE_GRAPHS, 8)
    assert recorded == [1, 0, 0, 0, 1, 1, 1, 1]
    assert recorded == [o["uncached"] for o in own]
    assert per_step(store, run.run_id, schema.M_COMPILE_CACHE_HITS, 8) == [o["cached"] for o in own]
    assert all(t > 0 for t in per_step(store, run.run_id, schema.M_COMPILE_TIME, 8)[4:])
    tags = store.client().get_run(run.run_id).data.tags
    assert tags["refrun.summary.compiles_after_warmup"] == "4"
    assert tags["refrun.summary.compiles_total"] == "5"
    summary = artifact(store, run.run_id, "refrun/xla_summary.json")
    assert summary["compile_steps_after_warmup"] == [4, 5, 6, 7]


# --- transfers and host syncs -----------------------------------------------------------
def test_item_in_step_is_one_transfer_and_logging_adds_none(store) -> None:
    rows = [8] * 5
    # The user's .item() inside each step: one transfer and one host sync per step.
    model, _ = make(width=13)
    run = start(store)
    with refrun.xla.instrument(run, model=model) as probe:
        own_item, _ = train(model, rows, probe, item=True)
    run.close()
    assert [o["d2h"] for o in own_item] == [1] * 5
    assert per_step(store, run.run_id, schema.M_XFER_D2H, 5) == [1] * 5
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS, 5) == [o["syncs"] for o in own_item]
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS, 5) == [1] * 5

    # The same loop unwrapped, then wrapped with only the probe's logging (new widths, so
    # both compile from scratch): the wrapper adds no compilation, execution or transfer
    # to the step, and its own fetches are not counted as the user's.
    plain, _ = make(width=14)
    start_plain = raw()
    own_plain, _ = train(plain, rows)
    xm.wait_device_ops()
    total_plain = diff(start_plain, raw())
    logged, _ = make(width=15)
    run2 = start(store)
    start_logged = raw()
    with refrun.xla.instrument(run2, model=logged) as probe2:
        own_logged, _ = train(logged, rows, probe2)
        xm.wait_device_ops()
        total_logged = diff(start_logged, raw())
    run2.close()
    for key in ("uncached", "cached", "d2h", "syncs"):
        assert [o[key] for o in own_logged] == [o[key] for o in own_plain], key
    assert [o["d2h"] for o in own_logged] == [0] * 5
    assert total_logged["exec"] == total_plain["exec"]
    assert total_logged["uncached"] == total_plain["uncached"] == 1
    assert total_logged["syncs"] == total_plain["syncs"] == 0
    assert per_step(store, run2.run_id, schema.M_XFER_D2H, 5) == [0] * 5
    assert per_step(store, run2.run_id, schema.M_HOST_SYNCS, 5) == [0] * 5
    assert len(history(store, run2.run_id, schema.M_LOSS)) == 5
    assert per_step(store, run2.run_id, schema.M_XFER_H2D, 5)[1:] == [2] * 4  # x and y per step


# Each way a step copies a tensor to the host (``.numpy()`` of an XLA tensor raises, so
# the NumPy form is ``.cpu().numpy()``).
D2H_FORMS: dict[str, Callable[[torch.Tensor], object]] = {
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.detach().cpu().numpy(),
    "tolist": lambda t: t.tolist(),
    "print": lambda t: print(t, file=io.StringIO()),
    "item": lambda t: t.item(),
}


def copy_forms(probe, model: torch.nn.Module, forms: list[str],
               copy: dict[str, Callable[[torch.Tensor], object]],
               between: Callable[[torch.Tensor], None] | None = None) -> list[dict[str, int]]:
    """The user's loop making the host copy ``copy[forms[n]]`` of one weight right after
    step n's sync ("none": no copy), then ``between(loss)`` after the step; returns
    torch_xla's own counts of each step's body."""
    w = model[0].weight.detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    own = []
    for n, form in enumerate(forms):
        x, y = batch(n, 8)
        with probe.step(n):
            before = raw()
            loss = ((model(x.to(DEV)) - y.to(DEV)) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            if form != "none":
                copy[form](w[0, 0])
            probe.log(loss=loss)
            own.append(diff(before, raw()))
        if between is not None:
            between(loss)
    return own


def test_every_device_to_host_copy_in_the_step_is_counted_and_reads_between_steps_not(
        store) -> None:
    model, _ = make(width=23)
    forms = ["none", *D2H_FORMS, "none"]
    between = []

    def progress_print(loss: torch.Tensor) -> None:  # a deliberate read between steps
        b0 = raw()
        float(loss.detach().cpu())
        between.append(diff(b0, raw())["d2h"])

    run = start(store)
    with refrun.xla.instrument(run, model=model) as probe:
        own = copy_forms(probe, model, forms, D2H_FORMS, progress_print)
    run.close()
    assert [o["d2h"] for o in own] == [0, 1, 1, 1, 1, 1, 0]  # torch_xla's own count
    assert per_step(store, run.run_id, schema.M_XFER_D2H, len(forms)) == \
        [o["d2h"] for o in own]
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS, len(forms)) == \
        [1 if f == "item" else 0 for f in forms] == [o["syncs"] for o in own]
    assert all(b >= 1 for b in between)  # those reads happened, and were not counted


def test_steady_steps_count_every_copy_but_read_the_exact_count_only_after_one(
        store, tmp_path) -> None:
    """After warm-up the probe reads torch_xla's exact copy count (a metric read copies up
    to 1024 samples) only when a cheap counter moved: every form of copy in a steady step
    is still counted -- ``xm.save``'s direct ``_xla_get_cpu_tensors`` call included -- and
    a step that copies nothing reads no metric."""
    model, _ = make(width=29)
    forms = ["none", "none", *D2H_FORMS, "xm.save", "none", "none"]
    copy = {**D2H_FORMS, "xm.save": lambda t: xm.save({"w": t}, str(tmp_path / "w.pt"))}
    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
        transfers = probe.backend._transfers
        reads = []
        exact = transfers.user_copies
        transfers.user_copies = lambda: reads.append(1) or exact()  # type: ignore[method-assign]
        own = copy_forms(probe, model, forms, copy)
    run.close()
    copies = [0 if f == "none" else 1 for f in forms]
    assert [o["d2h"] for o in own] == copies  # torch_xla's own count
    assert per_step(store, run.run_id, schema.M_XFER_D2H, len(forms)) == copies
    # Step 0 (warm-up) reads at entry and exit; a steady step reads once, at exit, and
    # only when it copied; no read at all for the steps that copy nothing.
    assert len(reads) == 2 + sum(copies[1:])


def test_the_probe_s_own_copy_in_flight_during_an_exact_read_is_not_the_user_s(
        store) -> None:
    """The probe copies logged values on a thread of its own, at any moment, and each copy
    is one sample of torch_xla's exact count.  Here the copier's copy is made and held in
    flight (it has not returned) while the step's exit reads the exact count after the
    user's ``.cpu()``: the read holds both samples, and the probe must count one."""
    model, _ = make(width=33)
    w = model[0].weight.detach()
    copied, release = threading.Event(), threading.Event()
    run = start(store)
    met_in_flight = []
    with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
        backend = probe.backend
        exact = backend._counters.d2h

        def read_then_release() -> int:  # the copy returns right after this read
            n = exact()
            met_in_flight.append(backend._copier.started != backend._copier.finished)
            release.set()
            return n

        def copy_in_flight_then_user_copy(n: int) -> None:
            if n == 3:
                held = (w * 2.0).sum()
                torch_xla.sync()  # `held` (and any loss still waiting) holds device data
                probe.log(held=held)
                PROBE_COPIES.gate = (copied, release)
                backend._send(backend._materialised())
                assert copied.wait(30)  # the probe's copy is made, and held
                backend._counters.d2h = read_then_release  # type: ignore[method-assign]
                w.cpu()  # the user's copy

        try:
            own, _ = train(model, [8] * 6, probe, extra=copy_in_flight_then_user_copy)
        finally:
            PROBE_COPIES.gate = None
            release.set()
    run.close()
    assert [o["d2h"] for o in own] == [0, 0, 0, 1, 0, 0]  # the test's own count
    assert met_in_flight[0] is True  # the first exact read did meet the copy in flight
    assert per_step(store, run.run_id, schema.M_XFER_D2H, 6) == [0, 0, 0, 1, 0, 0]
    assert len(history(store, run.run_id, schema.M_LOSS)) == 6


def test_a_periodic_exact_check_that_meets_a_probe_copy_in_flight_waits_for_the_next_step(
        store, monkeypatch) -> None:
    """Logged values go to the copier whenever 64 wait, so a periodic exact check (one
    steady step in EXACT_EVERY) can meet the probe's own copy in flight, and reading the
    exact count then waits for that copy.  Here the copy is held in flight across the
    check's step entry: no exact read is made while it is in flight (no wait), the check
    is made at a later step, and every step's count is still the test's own."""
    import refrun.probes.xla as xla_probe

    monkeypatch.setattr(xla_probe, "EXACT_EVERY", 4)  # steps 4, 8 ... are checked
    model, _ = make(width=34)
    w = model[0].weight.detach()
    copied, release = threading.Event(), threading.Event()
    run = start(store)
    reads: list[tuple[int, bool]] = []  # (step entered so far, a copy in flight)
    with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
        backend, transfers = probe.backend, probe.backend._transfers
        exact = transfers.user_copies

        def recorded() -> int:
            copier = backend._copier
            reads.append((transfers.steps, copier.started != copier.finished))
            return exact()

        transfers.user_copies = recorded  # type: ignore[method-assign]

        def hold_a_copy_over_step_4(n: int) -> None:
            if n == 3:
                held = (w * 3.0).sum()
                torch_xla.sync()
                probe.log(held=held)
                PROBE_COPIES.gate = (copied, release)
                backend._send(backend._materialised())
                assert copied.wait(30)  # the probe's copy is made, and held
            if n == 4:
                release.set()

        try:
            own, _ = train(model, [8] * 8, probe, extra=hold_a_copy_over_step_4)
        finally:
            PROBE_COPIES.gate = None
            release.set()
    run.close()
    assert [o["d2h"] for o in own] == [0] * 8  # the test's own count
    assert per_step(store, run.run_id, schema.M_XFER_D2H, 8) == [0] * 8
    assert not any(in_flight for _, in_flight in reads), reads  # never waited
    assert any(entered > 5 for entered, _ in reads), reads  # the check made later


def test_a_probe_copy_that_never_returns_stalls_no_step_for_longer_than_one_wait(
        store, monkeypatch) -> None:
    """A copier whose copy never returns (a device that stops answering) is waited for
    once, ``COPY_WAIT_S``, by the first exact read that meets it; later reads and the
    probe's close do not wait, and the user's copies are still counted."""
    from refrun.probes import xla as px

    monkeypatch.setattr(px, "COPY_WAIT_S", 0.5)
    model, _ = make(width=35)
    w = model[0].weight.detach()
    copied, release = threading.Event(), threading.Event()
    waits = []
    run = start(store)
    try:
        with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
            backend = probe.backend
            real_wait = backend._copier.wait_idle

            def timed_wait(timeout: float = 0.5) -> bool:
                t0 = time.monotonic()
                try:
                    return real_wait(timeout)
                finally:
                    waits.append(time.monotonic() - t0)

            backend._copier.wait_idle = timed_wait  # type: ignore[method-assign]

            def stuck_copy_then_user_copies(n: int) -> None:
                if n == 2:
                    held = (w * 2.0).sum()
                    torch_xla.sync()
                    probe.log(held=held)
                    PROBE_COPIES.gate = (copied, release)  # the copy never returns
                    backend._send(backend._materialised())
                    assert copied.wait(30)
                if n >= 2:
                    w.cpu()

            own, _ = train(model, [8] * 6, probe, extra=stuck_copy_then_user_copies)
            assert backend._copier.stuck
    finally:
        PROBE_COPIES.gate = None
        release.set()
    run.close()
    assert [o["d2h"] for o in own] == [0, 0, 1, 1, 1, 1]  # the test's own count
    assert per_step(store, run.run_id, schema.M_XFER_D2H, 6) == [0, 0, 1, 1, 1, 1]
    assert len([t for t in waits if t >= 0.5]) == 1, waits  # one wait of COPY_WAIT_S
    assert all(t < 0.4 for t in waits if t < 0.5), waits  # and none after it
    losses = history(store, run.run_id, schema.M_LOSS)
    assert all(math.isfinite(v) for v in losses)  # a value not copied is absent, never NaN
    assert len(losses) < 6
    assert any("not copied to the host within 0.5 s" in w["message"] for w in run.warnings)


class CounterReads:
    """torch_xla's ``_XLAC`` as the probe's counters reach it, counting the probe's reads
    of each counter by name; every call goes through to torch_xla."""

    def __init__(self, xlac: Any) -> None:
        self._xlac = xlac
        self.reads: dict[str, int] = {}

    def _xla_counter_value(self, name: str) -> Any:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self._xlac._xla_counter_value(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xlac, name)


def test_copies_and_syncs_are_counted_exactly_with_the_counters_read_only_where_they_can_move(
        store) -> None:
    """A step boundary reads ``xla::_copy_from`` only where ``xla::_to_copy`` moved lately,
    and the host sync count only where ``xla::_to_cpu`` moved (2026-12-06, sixth session:
    four counter reads a step less in a loop whose data is already on the device).  Every
    step's copies and host syncs must still be torch_xla's own count of the step: in a
    loop that moves nothing to the device, then at the step where it starts to (the
    boundary before it read no ``_copy_from``: the exact count decides), in steps that
    move data to the device and copy to the host, and after a copy into a device tensor
    between steps (``copy_`` moves ``_copy_from`` alone)."""
    model, _ = make(width=37)
    w = model[0].weight.detach()
    buf = torch.zeros(2, device=DEV)
    torch_xla.sync()
    data = [tuple(t.to(DEV) for t in batch(n, 8)) for n in range(4)]  # on the device
    plan = ["none", "none", "none", "none", "item", "none", "none", "cpu", "none", "none",
            "h2d+cpu", "h2d", "h2d", "h2d+cpu", "copy_ before, h2d+cpu", "h2d"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = start(store)
    own, reads, exact_reads = [], [], []
    with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
        spy = CounterReads(torch_xla._XLAC)
        probe.backend._counters._x = spy
        transfers = probe.backend._transfers
        exact = transfers.user_copies
        transfers.user_copies = lambda: exact_reads.append(n) or exact()  # type: ignore[method-assign]
        for n, form in enumerate(plan):
            if form.startswith("copy_ before"):
                buf.copy_(torch.ones(2))  # between steps: not the step's, no copy to the host
            r0 = dict(spy.reads)
            with probe.step(n):
                before = raw()
                x, y = data[n % len(data)]
                if "h2d" in form:
                    y = y + torch.ones(1).to(DEV)  # data moved to the device in the step
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch_xla.sync()
                if "cpu" in form:
                    w[0, 0].cpu()
                if form == "item":
                    loss.item()
                probe.log(loss=loss)
                own.append(diff(before, raw()))
            reads.append({k: v - r0.get(k, 0) for k, v in spy.reads.items()})
    run.close()
    copies = [1 if "cpu" in f or f == "item" else 0 for f in plan]
    assert [o["d2h"] for o in own] == copies  # torch_xla's own count
    assert [o["syncs"] for o in own] == [1 if f == "item" else 0 for f in plan]
    assert per_step(store, run.run_id, schema.M_XFER_D2H, len(plan)) == copies
    assert per_step(store, run.run_id, schema.M_HOST_SYNCS, len(plan)) == \
        [o["syncs"] for o in own]
    # What was read: two reads each of _to_copy and _to_cpu a step; _copy_from only at
    # the boundaries where _to_copy moved or had moved in one of the two intervals before
    # (the first reading, a .cpu() at step 7, data moved to the device from step 10 on);
    # the host sync count at the first reading and where .item() moved _to_cpu (step 4).
    assert all(r.get(TO_COPY, 0) == r.get(TO_CPU, 0) == 2 for r in reads), reads
    assert [r.get(COPY_FROM, 0) for r in reads] == \
        [2, 1, 0, 0, 0, 0, 0, 1, 2, 0, 1, 2, 2, 2, 2, 2], reads
    assert [r.get(HOST_SYNC_OP, 0) for r in reads] == \
        [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], reads
    # The exact count is read at the warm-up step and where a step copied (at step 10
    # the boundary before lacked _copy_from: the exact count decided); never at step 14's
    # entry, after the copy_ between steps.
    assert sorted(set(exact_reads)) == [0, 4, 7, 10, 13, 14], exact_reads
    assert exact_reads.count(14) == 1


def test_a_copy_no_counter_sees_is_found_at_a_checked_step_and_then_counted_exactly(
        store) -> None:
    """The cheap counters are checked against the exact count at one steady step in
    ``EXACT_EVERY``: a copy path none of them sees (here the function under the probe's
    wrapper, standing for C++ code of another library) is missed until that step, counted
    there, and from then on every step is read exactly, with a run warning."""
    from refrun.probes import xla as px

    model, _ = make(width=31)
    w = model[0].weight.detach()
    steps = px.EXACT_EVERY + 4
    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=0) as probe:
        hidden = px.DIRECT_COPIES.original  # not the wrapper: no counter moves
        assert hidden is not None

        def unseen_copy(n: int) -> None:
            if n >= 1:
                torch_xla.sync()
                hidden([w[0, 0]])

        own, _ = train(model, [4] * steps, probe, extra=unseen_copy)
    run.close()
    assert [o["d2h"] for o in own] == [0] + [1] * (steps - 1)  # torch_xla's own count
    recorded = per_step(store, run.run_id, schema.M_XFER_D2H, steps)
    first = px.EXACT_EVERY  # the first checked step after step 0
    assert recorded == [0] * first + [1] * (steps - first)
    warnings = artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"]
    assert any("xfer/d2h is read exactly" in w["message"] and w["step"] == first
               for w in warnings)
    tags = store.client().get_run(run.run_id).data.tags
    assert float(tags["refrun.summary.d2h_per_step"]) > 0  # host-copies-per-step sees it


# --- CPU fallback -----------------------------------------------------------------------
def test_fallback_op_recorded_by_name(store) -> None:
    model, _ = make(width=17)

    def nonzero_at_step_2(n: int) -> None:
        if n == 2:
            torch.nonzero(torch.tensor([0.0, 1.0, 0.0, 3.0], device=DEV) > 0)

    run = start(store)
    with refrun.xla.instrument(run, model=model) as probe:
        own, _ = train(model, [8] * 4, probe, extra=nonzero_at_step_2)
    run.close()
    assert [o["nonzero"] for o in own] == [0, 0, 1, 0]
    assert per_step(store, run.run_id, schema.M_FALLBACK_OPS, 4) == [0, 0, 1, 0]
    tags = store.client().get_run(run.run_id).data.tags
    assert json.loads(tags["refrun.fallback.ops"]) == {"aten::nonzero": 1}
    ops = artifact(store, run.run_id, "refrun/fallback_ops.json")["ops"]
    assert ops == {"aten::nonzero": {"count": 1, "first_step": 2}}
    warnings = artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"]
    assert any("aten::nonzero" in w["message"] and w["step"] == 2 for w in warnings)


def test_a_fallback_op_first_run_after_warm_up_is_recorded_without_relisting(store) -> None:
    """After warm-up the probe lists torch_xla's counter names again only when
    ``xla::_to_cpu`` moved (XlaCounters.fallback): a new fallback op at a steady step,
    which is not an exact-check step, must still be recorded at that step.  ``histc``
    runs through the CPU fallback on PJRT CPU and nothing else in this suite calls it,
    so its counter name is new to the process here."""
    model, _ = make(width=19)
    before = met.counter_value("aten::histc") or 0

    def histc_at_step_3(n: int) -> None:
        if n == 3:
            torch.histc(torch.tensor([0.0, 1.0, 2.0, 3.0], device=DEV), bins=4)

    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=1) as probe:
        train(model, [8] * 6, probe, extra=histc_at_step_3)
    run.close()
    assert (met.counter_value("aten::histc") or 0) - before == 1  # torch_xla's own count
    assert per_step(store, run.run_id, schema.M_FALLBACK_OPS, 6) == [0, 0, 0, 1, 0, 0]
    tags = store.client().get_run(run.run_id).data.tags
    assert json.loads(tags["refrun.fallback.ops"]) == {"aten::histc": 1}


# --- end-of-run summary ------------------------------------------------------------------
def test_the_summary_of_a_run_whose_rows_were_folded_every_few_steps(store) -> None:
    """The backend adds its kept counter rows to the summary's sums every ``fold_rows``
    steps (SummaryTally), so a long run holds a bounded number of rows.  With folds every
    3 steps, the summary must still equal the one computed from torch_xla's own counts of
    each step: recompilations at two steady steps (new batch shapes), a CPU fallback op,
    and the user's host sync at every step."""
    model, _ = make(width=33)
    rows = [8, 8, 8, 8, 5, 8, 8, 8, 9, 8, 8]
    kept: list[int] = []
    probe_ref: list = []

    def steps_with(n: int) -> None:
        kept.append(len(probe_ref[0].backend._rows))
        if n == 6:
            torch.nonzero(torch.tensor([0.0, 1.0, 0.0, 3.0], device=DEV) > 0)

    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=2) as probe:
        probe.backend.fold_rows = 3
        probe_ref.append(probe)
        own, _ = train(model, rows, probe, item=True, extra=steps_with)
    run.close()
    assert max(kept) < 3  # never more rows kept than the fold size
    s = artifact(store, run.run_id, schema.ARTIFACT_XLA_SUMMARY)
    steady = own[2:]
    expected_compile_steps = [n for n, o in enumerate(own) if n >= 2 and o["uncached"]]
    # the test's premise: recompilations at steady steps (new batch shapes at 4 and 8; the
    # fallback op's graph at 6 too when no earlier test compiled it)
    assert {4, 8} <= set(expected_compile_steps)
    assert s["steps"] == len(rows)
    assert s["compiles_total"] == sum(o["uncached"] for o in own)
    assert s["compiles_after_warmup"] == sum(o["uncached"] for o in steady)
    assert s["compile_steps_after_warmup"] == expected_compile_steps
    assert s["d2h_per_step"] == pytest.approx(sum(o["d2h"] for o in steady) / len(steady))
    assert s["host_syncs_per_step"] == pytest.approx(
        sum(o["syncs"] for o in steady) / len(steady))
    assert s["host_syncs_per_step"] >= 1  # the user's .item() at every step
    assert s["exec_count_per_step"] == pytest.approx(
        sum(o["exec"] for o in steady) / len(steady))
    assert s["fallback_ops"] == {"aten::nonzero": sum(o["nonzero"] for o in own)} \
        == {"aten::nonzero": 1}
    ops = artifact(store, run.run_id, schema.ARTIFACT_FALLBACK_OPS)
    assert ops["ops"] == {"aten::nonzero": {"count": 1, "first_step": 6}}
    assert ops["steps"] == {"6": {"aten::nonzero": 1}}


# --- logged values ----------------------------------------------------------------------
def test_every_logged_loss_equals_the_loop_value(store) -> None:
    model, cpu = make(width=19, seed=3)
    rows = [8, 8, 8, 10, 8, 12]
    run = start(store)
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe:
        _, losses = train(model, rows, probe)
    run.close()
    recorded = history(store, run.run_id, schema.M_LOSS)
    fetched = [float(t.detach().cpu()) for t in losses]  # the test's own fetch, after training
    assert recorded == fetched
    # Independently: the same training computed by eager PyTorch on the CPU.
    opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    expected = []
    for n, r in enumerate(rows):
        x, y = batch(n, r)
        loss = ((cpu(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    assert recorded == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_at_most_a_bounded_number_of_logged_values_stay_live_on_the_device(store) -> None:
    """A logged value waits on the device as a live XLA tensor, which every sync walks:
    without the device found idle (an hour's flush interval: one readiness callback for
    the whole run), at most ``TRANSFER_MAX_WAITING`` values wait at a step's start, every
    one is still recorded as the loop computed it, and the copies made while steps run
    are neither the steps' transfers nor a compilation or execution of their own."""
    from refrun.probes.xla import TRANSFER_MAX_WAITING

    model, _ = make(width=28, seed=4)
    rows = [8] * (3 * TRANSFER_MAX_WAITING)
    waiting: list[int] = []
    run = start(store, flush_interval_s=3600.0)
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe:
        own, losses = train(model, rows, probe,
                            extra=lambda n: waiting.append(len(probe.backend._waiting)))
    run.close()
    assert max(waiting) <= TRANSFER_MAX_WAITING
    assert history(store, run.run_id, schema.M_LOSS) == \
        [float(t.detach().cpu()) for t in losses]  # the test's own fetch, after the run
    steps = len(rows)
    for metric, key in ((schema.M_XFER_D2H, "d2h"), (schema.M_COMPILE_GRAPHS, "uncached"),
                        (schema.M_COMPILE_CACHE_HITS, "cached")):
        assert per_step(store, run.run_id, metric, steps) == [o[key] for o in own], metric


def test_values_of_several_names_reach_the_session_as_logged(store) -> None:
    # Ready values go to the session in as few calls as keep their order: a run of steps
    # that log the same names as columns, steps whose names differ one call each.  Here
    # the loss is logged every step, a second value every third step and a third (a host
    # number) at step 4 only; every recorded history must be the loop's own values.
    model, _ = make(width=27, seed=5)
    rows = [8] * 9
    run = start(store)
    expected: dict[str, dict[int, float]] = {"loss": {}, "scaled": {}, "lr": {}}
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kept = []
        for n, r in enumerate(rows):
            x, y = batch(n, r)
            with probe.step(n):
                loss = ((model(x.to(DEV)) - y.to(DEV)) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                scaled = loss.detach() * 3.0
                torch_xla.sync()
                values = {"loss": loss}
                if n % 3 == 0:
                    values["scaled"] = scaled
                if n == 4:
                    values["lr"] = 0.05
                probe.log(**values)
                kept.append((n, values))
    run.close()
    for n, values in kept:  # the test's own reads, after training
        for name, v in values.items():
            expected[name][n] = float(v.detach().cpu()) if isinstance(v, torch.Tensor) else v
    for name, want in expected.items():
        got = {m.step: m.value for m in store.client().get_metric_history(run.run_id, name)}
        assert got == want, name


def test_values_piled_up_are_copied_up_to_the_first_one_not_materialised() -> None:
    # When values pile up (TRANSFER_MAX_WAITING or TRANSFER_MAX_AGE_S), only those that
    # hold device data are copied, from the first in log order up to the first still an IR
    # node (copying that one would run a graph).  The test knows which tensors it synced;
    # the last case logs a value an earlier sync materialised after a pending one, and it
    # waits for the pending one.
    from refrun.probes.xla import XlaBackend

    backend = XlaBackend(device=DEV, warmup_steps=0)
    try:
        w = torch.arange(1.0, 4.0, device=DEV)
        for synced, pending in ((23, 14), (1, 0), (0, 3), (5, 1)):
            made = [(w * (i + 1)).sum() for i in range(synced)]
            torch_xla.sync()
            made += [(w * -(i + 1)).sum() for i in range(pending)]  # still IR nodes
            handles = [backend.fetch(t) for t in made]
            assert backend._materialised() == synced
            backend._send(synced)
            backend._copier.flush()
            assert [h.value for h in handles[:synced]] == \
                [float(6 * (i + 1)) for i in range(synced)]
            assert all(h.value is None for h in handles[synced:])
            assert backend._waiting == handles[synced:]
            torch_xla.sync()  # the pending ones are materialised now: all are copied
            assert backend._materialised() == pending
            backend._send(len(backend._waiting))
            backend._copier.flush()
            assert [h.value for h in handles[synced:]] == \
                [float(-6 * (i + 1)) for i in range(pending)]
        early = (w * 2.5).sum()
        torch_xla.sync()  # device data from here on
        pending = (w * 7).sum()
        handles = [backend.fetch(pending), backend.fetch(early)]
        assert backend._materialised() == 0
        # The newest value is complete, so the device looks idle: still nothing is copied
        # and no graph runs before the pending value's sync.
        torch_xla._XLAC._xla_wait_device_ops([])  # every execution so far is counted
        executions = met.counter_value("ExecuteComputation") or 0
        assert backend.ready(handles[1]) is None  # asks for the readiness callback
        assert handles[1].event is not None and handles[1].event.wait(10)
        assert backend.ready(handles[0]) is None
        assert [h.value for h in handles] == [None, None]
        torch_xla._XLAC._xla_wait_device_ops([])
        assert (met.counter_value("ExecuteComputation") or 0) == executions
        torch_xla.sync()
        assert backend._materialised() == 2
        backend._send(len(backend._waiting))
        backend._copier.flush()
        assert [h.value for h in handles] == [42.0, 15.0]
    finally:
        backend.close()


@pytest.mark.parametrize("flush_s", [0.01, 3600.0])
def test_values_are_copied_as_often_as_the_session_flushes(store, monkeypatch,
                                                           flush_s: float) -> None:
    # The probe asks the runtime for a readiness callback, and so copies logged values to
    # the host, at most once per the session's flush interval (sooner reaches no reader):
    # with 10 ms it asks at every 20 ms step, with an hour once for the whole run.  A
    # constant interval (the 1 s default) would ask once in this 0.2 s run either way.

    requests = []
    real = torch_xla._XLAC._on_ready_callback

    def counted(tensor, callback):  # passes through to torch_xla, counting the requests
        requests.append(1)
        return real(tensor, callback)

    monkeypatch.setattr(torch_xla._XLAC, "_on_ready_callback", counted)
    model, _ = make(width=21)
    rows = [8] * 8
    run = start(store, flush_interval_s=flush_s)
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe:
        assert probe.backend.arm_interval_s == flush_s
        # each step lasts 20 ms, longer than the short interval (the user's work)
        train(model, rows, probe, extra=lambda n: time.sleep(0.02))
        during = len(requests)
    run.close()
    if flush_s < 0.02:
        assert during >= len(rows) - 1
    else:
        assert during == 1
    assert len(history(store, run.run_id, schema.M_LOSS)) == len(rows)


@pytest.mark.parametrize("flush_s", [0.01, 3600.0])
def test_step_counters_reach_the_session_a_flush_interval_at_a_time(store,
                                                                    flush_s: float) -> None:
    # The block path: a step's exit keeps the step time and the raw counters, and the
    # probe hands the kept steps to the session once per flush interval (each step's
    # counters as deltas, exactly as before).  With 10 ms they reach the session during
    # the run; with an hour, at close -- and every step is there either way.

    model, _ = make(width=23)
    rows = [8] * 8
    run = start(store, flush_interval_s=flush_s)
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe:
        own, _ = train(model, rows, probe, extra=lambda n: time.sleep(0.02))
        during = {k: run.step_stats()[k].count if k in run.step_stats() else 0
                  for k in (schema.M_COMPILE_GRAPHS, schema.M_STEP_TIME)}
    run.close()
    if flush_s < 0.02:
        assert min(during.values()) >= len(rows) - 1, during
    else:
        assert during == {schema.M_COMPILE_GRAPHS: 0, schema.M_STEP_TIME: 0}
    assert per_step(store, run.run_id, schema.M_COMPILE_GRAPHS, 8) == [o["uncached"]
                                                                       for o in own]
    assert per_step(store, run.run_id, schema.M_COMPILE_CACHE_HITS, 8) == [o["cached"]
                                                                           for o in own]
    assert len(history(store, run.run_id, schema.M_STEP_TIME)) == len(rows)
    # ... and the training thread's CPU seconds of every step, in the same block (issue
    # 52): the 20 ms each step sleeps is no CPU time, so the steady steps' median is
    # under it (the first steps compile on this thread).
    cpu = history(store, run.run_id, schema.M_STEP_CPU)
    assert len(cpu) == len(rows) and min(cpu) >= 0
    assert sorted(cpu[2:])[len(cpu[2:]) // 2] < 0.02, cpu


def test_a_step_whose_counters_cannot_be_read_has_none_never_zeros(store) -> None:
    # A failed read must not become a recorded 0 ("nothing compiled") for its step: the
    # step has no counter points, and its counts land in the next step's delta.
    model, _ = make(width=25)
    rows = [8, 8, 9, 10, 11, 8]  # new shapes compile at steps 2-4
    run = start(store)
    with refrun.xla.instrument(run, model=model, warmup_steps=2) as probe:
        real, calls = probe.backend.counter_row, []

        def failing_once():  # the read after step 3 fails (fault injection)
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("counter read failed")
            return real()

        probe._counter_row = failing_once
        own, _ = train(model, rows, probe)
    run.close()
    got = {m.step: m.value
           for m in store.client().get_metric_history(run.run_id, schema.M_COMPILE_GRAPHS)}
    assert 3 not in got
    expected = [o["uncached"] for o in own]
    assert [got[s] for s in (0, 1, 2, 5)] == [expected[s] for s in (0, 1, 2, 5)]
    assert got[4] == expected[3] + expected[4] == 2
    assert any("counter read failed" in w["message"] for w in run.warnings)


def test_a_logged_tensor_does_not_keep_its_autograd_graph_alive(store) -> None:
    # The probe holds a logged value until it copies it to the host (several steps later).
    # Holding the tensor itself kept its step's autograd graph, and everything the graph
    # saved, alive until then; freeing it in the probe's call cost ~0.3 ms a value on a
    # GRU step.  The graph must go when the loop drops the tensor, as without the probe.
    import gc
    import weakref

    model, _ = make(width=5)
    run = start(store)
    with refrun.xla.instrument(run, model=model, optimizer=None) as probe, probe.step(0):
        x, y = batch(0, 8)
        saved = x.to(DEV).requires_grad_(False) * 1.0  # saved by the graph only
        ref = weakref.ref(saved)
        loss = ((model(saved) * saved[:, :1] - y.to(DEV)) ** 2).mean()
        del saved
        torch_xla.sync()
        probe.log(loss=loss)
        assert ref() is not None  # the graph (through `loss`) still holds it
        del loss
        gc.collect()
        assert ref() is None, "the probe kept the logged loss's graph alive"
    run.close()
    assert history(store, run.run_id, schema.M_LOSS)  # ... and the value was recorded


def test_a_loss_updated_in_place_after_log_is_never_recorded_with_its_new_value(
        store) -> None:
    # The probe keeps a loss as the value it had at probe.log (the functional wrapper's
    # inner tensor).  Updating the loss in place afterwards either leaves that value, which
    # is then recorded, or donates its buffer to the update: the value is then missing,
    # with a warning that says why.  Never the updated value.
    w = torch.ones(3, device=DEV, requires_grad=True)
    at_log = {}
    run = start(store)
    with refrun.xla.instrument(run, model=None) as probe:
        for n in range(4):
            with probe.step(n):
                loss = (w * (n + 1)).sum()
                loss.backward()
                torch_xla.sync()
                probe.log(loss=loss)
                at_log[n] = float(loss.detach().cpu())  # the test's own read
                with torch.no_grad():
                    loss.mul_(10)
                torch_xla.sync()
    run.close()
    got = {m.step: m.value for m in store.client().get_metric_history(run.run_id, "loss")}
    assert at_log == {n: 3.0 * (n + 1) for n in range(4)}
    assert all(got[n] == at_log[n] for n in got), got
    # the test's own read is the step's one copy; the probe's copies, failed ones included
    # (each is one sample of torch_xla's count), are not the user's
    assert per_step(store, run.run_id, schema.M_XFER_D2H, 4) == [1, 1, 1, 1]
    if len(got) < len(at_log):
        assert any("is not recorded" in w["message"] and "in place" in w["message"]
                   for w in run.warnings), run.warnings


def test_log_accepts_numbers_rejects_vectors_without_breaking_the_loop(store) -> None:
    model, _ = make(width=21)
    run = start(store)
    with refrun.xla.instrument(run, model=model) as probe:
        for n in range(3):
            with probe.step(n):
                v = torch.ones(3, device=DEV) * n
                torch_xla.sync()
                probe.log(lr=0.1 * n, vec=v, scalar=v.sum())
    run.close()
    assert history(store, run.run_id, "lr") == pytest.approx([0.0, 0.1, 0.2])
    assert history(store, run.run_id, "scalar") == [0.0, 3.0, 6.0]
    assert history(store, run.run_id, "vec") == []
    warnings = artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"]
    assert any("shape (3,)" in w["message"] for w in warnings)


# --- what runs inside the step --------------------------------------------------------------
# torch.nn.GRU as PyTorch defines it: importing torch_xla replaces torch.nn.GRU by its
# scan-based GRU and keeps the original as ``_orig``; a model built before that import has it.
TORCH_GRU = getattr(torch.nn.GRU, "_orig", None) or torch.nn.GRU


def gru_lm(gru_class: type, hidden: int) -> tuple[torch.nn.ModuleDict, Any, Any]:
    """A small GRU language model on the XLA device with AdamW and a LambdaLR warm-up."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(16, 8),
                                 "gru": gru_class(8, hidden, batch_first=True),
                                 "head": torch.nn.Linear(hidden, 16)}).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))


def dispatch_state() -> tuple[Any, ...]:
    """What decides which kernels run besides the tensors: dispatch modes, torch-function
    modes, and this thread's included / excluded dispatch keys."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return (tuple(type(m).__name__ for m in _get_current_dispatch_mode_stack()),
            torch._C._len_torch_function_stack(), torch._C._is_torch_function_mode_enabled(),
            str(torch._C._dispatch_tls_local_include_set()),
            str(torch._C._dispatch_tls_local_exclude_set()))


def python_calls(body: Callable[[], Any]) -> tuple[Any, dict[tuple[str, str], int]]:
    """``body()``'s result and every Python function called on this thread while it ran
    (file, function name) -> calls: hooks, modes, Python kernels and decompositions
    included, whoever installed them.  The garbage collector is held off meanwhile: its
    callbacks (JAX registers one) run whenever it happens to, not as part of the step."""
    calls: dict[tuple[str, str], int] = {}
    gc.collect()
    gc.disable()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            key = (frame.f_code.co_filename, frame.f_code.co_name)
            calls[key] = calls.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        out = body()
    finally:
        sys.setprofile(None)
        gc.enable()
    return out, calls


@pytest.mark.parametrize("gru_class", [torch.nn.GRU, TORCH_GRU],
                         ids=["torch_xla-scan-gru", "pytorch-gru"])
def test_the_probed_step_runs_the_same_python_and_kernels_as_the_plain_one(
        store, gru_class: type) -> None:
    """Issue 52: a GRU language model's probed step was seen 3x slower, with PyTorch's GRU
    running its in-place ops through torch._refs.  Whatever the GRU, the probe changes
    nothing that runs inside the step: the same Python calls, one by one, and the same
    dispatch state as the same step without it."""
    hidden = 31 if gru_class is torch.nn.GRU else 33
    plain, probed = gru_lm(gru_class, hidden), gru_lm(gru_class, hidden)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (4, 5), generator=g).to(DEV)
    y = torch.randint(0, 16, (4, 5), generator=g).to(DEV)

    def body(model, opt, sched, seen: list) -> torch.Tensor:
        seen.append(dispatch_state())
        out, _ = model["gru"](model["emb"](x))
        loss = torch.nn.functional.cross_entropy(model["head"](out).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        torch_xla.sync()
        return loss

    run = start(store)
    seen_plain: list = []
    seen_probed: list = []
    with refrun.xla.instrument(run, model=probed[0], optimizer=probed[1]) as probe:
        for n in range(6):  # 0-2 compile and warm up, 3-5 are compared
            _, plain_calls = python_calls(lambda: body(*plain, seen_plain))
            with probe.step(n):
                loss, probed_calls = python_calls(lambda: body(*probed, seen_probed))
                probe.log(loss=loss)
            if n >= 3:
                assert probed_calls == plain_calls, n
    run.close()
    assert seen_probed == seen_plain
    assert seen_plain[-1][:3] == ((), 0, False)  # no mode of anybody's
    refs = sum(k for (f, _), k in plain_calls.items() if f"torch{os.sep}_refs" in f)
    if gru_class is TORCH_GRU:  # the path of the report, in both arms
        assert refs > 0
    # the model was built after torch_xla was imported: no warning about its classes
    assert "xla-module-built-before-import" not in str(
        artifact(store, run.run_id, schema.ARTIFACT_WARNINGS))


def test_a_module_built_before_torch_xla_was_imported_is_named(store) -> None:
    assert TORCH_GRU is not torch.nn.GRU  # importing torch_xla replaced torch.nn.GRU
    model = torch.nn.ModuleDict({"enc": TORCH_GRU(4, 35), "dec": torch.nn.GRU(4, 35),
                                 "both_ways": TORCH_GRU(4, 35, bidirectional=True),
                                 "head": torch.nn.Linear(35, 1)}).to(DEV)
    run = start(store)
    with refrun.xla.instrument(run, model=model) as probe, probe.step(0):
        probe.log(loss=1.0)
    run.close()
    warnings = artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"]
    named = [w["message"] for w in warnings if "import torch_xla" in w["message"]]
    assert len(named) == 1
    assert named[0].startswith("enc (torch.nn.GRU): built from PyTorch's own class")
    assert "dec" not in named[0] and "both_ways" not in named[0]


# --- device truth -----------------------------------------------------------------------
def test_declared_tpu_executing_on_cpu_is_flagged(store) -> None:
    model, _ = make(width=23)
    run = start(store, hardware="tpu-v5e")
    with refrun.xla.instrument(run, model=model) as probe:
        train(model, [8, 8], probe)
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_EXEC_HARDWARE] == "cpu"  # xm.xla_device_hw on PJRT CPU
    assert tags[schema.TAG_EXEC_DEVICES] == "1"
    assert tags[schema.TAG_EXEC_WORLD_SIZE] == "1"
    assert "tpu-v5e" in tags[schema.TAG_PLACEMENT_WARNING]
    warnings = artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"]
    assert any("executes on CPU" in w["message"] for w in warnings)


def test_honest_cpu_run_has_no_warning_and_model_left_on_cpu_is_flagged(store) -> None:
    model, cpu_model = make(width=25)
    run = start(store, hardware="cpu")
    with refrun.xla.instrument(run, model=model) as probe:
        train(model, [8, 8], probe)
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert schema.TAG_PLACEMENT_WARNING not in tags
    assert json.loads(tags[schema.TAG_PLACEMENT])["params"] == {"xla:0": 4}

    run2 = start(store, hardware="cpu")
    probe2 = refrun.xla.instrument(run2, model=cpu_model)  # never moved to the XLA device
    probe2.close()
    run2.close()
    tags2 = store.client().get_run(run2.run_id).data.tags
    assert "model parameters on cpu" in tags2[schema.TAG_PLACEMENT_WARNING]


def test_placement_is_counted_again_at_every_recheck(store) -> None:
    """The runtime's answers about the device are asked once, placement at every
    re-check: a model moved off the XLA device mid-run is flagged at the next re-check,
    counted from the parameters themselves (``torch.nn.Module.to`` keeps the parameter
    objects and replaces their data)."""
    from refrun.probes.tensors import count_devices

    model, _ = make(width=27)
    run = start(store, hardware="cpu")
    with refrun.xla.instrument(run, model=model, recheck_every=2) as probe:
        train(model, [8, 8], probe)
        assert schema.TAG_PLACEMENT_WARNING not in run.tags
        model.to("cpu")
        for n in range(2, 4):
            with probe.step(n):
                probe.log(loss=1.0)
        tags = dict(run.tags)
    run.close()
    assert "model parameters on cpu" in tags[schema.TAG_PLACEMENT_WARNING]
    assert json.loads(tags[schema.TAG_PLACEMENT])["params"] == {"cpu": 4}
    assert tags[schema.TAG_EXEC_HARDWARE] == str(xm.xla_device_hw(DEV)).lower()
    # counted by device, non-tensors left out
    mixed = [torch.zeros(1), torch.zeros(2, device=DEV), "x", torch.zeros(3, device=DEV)]
    assert count_devices(mixed) == {"cpu": 1, str(DEV): 2}


def test_tpu_monitor_is_off_cleanly_on_pjrt_cpu(store) -> None:
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
        xm.get_memory_info(DEV)  # the premise: PJRT CPU has no memory stats
    assert TpuMonitor.create(DEV) is None
    run = start(store)
    probe = refrun.xla.instrument(run, model=make(width=27)[0])
    # the shared sys/* sampler, and the chip monitor saying why there is no utilisation
    assert [m.name for m in probe.monitors] == ["psutil", "chip_busy"]
    probe.close()
    run.close()
    assert artifact(store, run.run_id, schema.ARTIFACT_WARNINGS)["warnings"] == []
    source = store.client().get_run(run.run_id).data.tags[schema.TAG_UTILIZATION_SOURCE]
    assert source.startswith("unavailable: libtpu: "), source
    assert "profiler: no device plane in the trace (cpu devices;" in source


# --- pure parts and bad input --------------------------------------------------------------
SUMMARY_NAMES = (*ROW_NAMES, schema.M_XFER_D2H, schema.M_HOST_SYNCS)


def cumulative(base: float, deltas: list[dict[str, float]]) -> list[tuple[float, ...]]:
    """The backend's cumulative counter rows (SUMMARY_NAMES order) after steps whose
    per-step deltas are ``deltas``, starting from ``base`` in every column."""
    cum, rows = dict.fromkeys(SUMMARY_NAMES, base), []
    for d in deltas:
        cum = {k: v + d.get(k, 0.0) for k, v in cum.items()}
        rows.append(tuple(cum[k] for k in SUMMARY_NAMES))
    return rows


def test_summary_counts_after_warmup() -> None:
    deltas = [{schema.M_COMPILE_GRAPHS: g, schema.M_XFER_D2H: d} for g, d in
              [(2, 0), (0, 1), (1, 3), (0, 0)]]
    ops = [None, None, {"aten::nonzero": 2}, {"aten::nonzero": 1, "aten::unique2": 1}]

    def summary(warmup: int) -> XlaSummary:
        tally = SummaryTally(warmup)
        rows = list(zip(range(4), cumulative(0.0, deltas), ops, strict=True))
        tally.add_rows(SUMMARY_NAMES, (0.0,) * len(SUMMARY_NAMES), rows)
        return tally.summary()

    s = summary(warmup=1)
    assert (s.steps, s.compiles_total, s.compiles_after_warmup) == (4, 3, 1)
    assert s.compile_steps_after_warmup == [2]
    assert s.d2h_per_step == pytest.approx(4 / 3)
    assert s.fallback_ops == {"aten::nonzero": 3, "aten::unique2": 1}
    assert s.fallback_first_step == {"aten::nonzero": 2, "aten::unique2": 3}
    assert summary(warmup=10).d2h_per_step == pytest.approx(1.0)  # all steps


def expected_summary(steps: list[int], deltas: list[dict[str, float]],
                     ops: list[dict[str, int] | None], warmup: int) -> XlaSummary:
    """The summary of per-step deltas, computed step by step (the definition the
    backend's sums of cumulative rows must agree with)."""
    steady = list(range(warmup, len(steps))) or list(range(len(steps)))

    def mean(key: str) -> float:
        return sum(deltas[i].get(key, 0.0) for i in steady) / len(steady)

    def total(key: str, start: int = 0) -> float:
        return sum(d.get(key, 0.0) for d in deltas[start:])

    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for step, o in zip(steps, ops, strict=True):
        for name, n in (o or {}).items():
            counts[name] = counts.get(name, 0) + n
            first.setdefault(name, step)
    return XlaSummary(
        steps=len(steps), warmup_steps=warmup,
        compiles_total=int(total(schema.M_COMPILE_GRAPHS)),
        compiles_after_warmup=int(total(schema.M_COMPILE_GRAPHS, warmup)),
        compile_steps_after_warmup=[steps[i] for i in range(warmup, len(steps))
                                    if deltas[i][schema.M_COMPILE_GRAPHS] > 0],
        d2h_per_step=mean(schema.M_XFER_D2H), h2d_per_step=mean(schema.M_XFER_H2D),
        host_syncs_per_step=mean(schema.M_HOST_SYNCS),
        fallback_ops_total=sum(counts.values()), fallback_ops=counts,
        fallback_first_step=first, compile_time_s=total(schema.M_COMPILE_TIME),
        exec_count_per_step=mean(schema.M_EXECUTIONS))


@pytest.mark.parametrize("warmup", [0, 3, 10, 60])
@pytest.mark.parametrize("fold", [1, 3, 7, 50])
def test_summary_from_cumulative_rows_in_blocks(warmup: int, fold: int) -> None:
    """SummaryTally.add_rows (the backend's fold: sums as differences of cumulative rows)
    gives the summary of the per-step differences, however the rows are split into
    blocks and wherever warm-up ends (inside a block, at its edge, after the run)."""
    import random

    rng = random.Random(warmup * 100 + fold)
    steps = list(range(10, 60))
    deltas = [{k: float(rng.choice([0, 0, 1, 2])) for k in SUMMARY_NAMES} for _ in steps]
    ops = [{"aten::x": 1} if rng.random() < 0.2 else None for _ in steps]
    base = (5.0,) * len(SUMMARY_NAMES)
    rows = list(zip(steps, cumulative(5.0, deltas), ops, strict=True))
    tally, last = SummaryTally(warmup), base
    for i in range(0, len(rows), fold):
        block = rows[i:i + fold]
        tally.add_rows(SUMMARY_NAMES, last, block)
        last = block[-1][1]
    got = tally.summary()
    want = expected_summary(steps, deltas, ops, warmup)
    assert got == want  # every count is an integer: the sums are exact


def test_bad_arguments_raise_input_errors(store) -> None:
    run = start(store)
    with pytest.raises(RefrunInputError, match="model"):
        refrun.xla.instrument(run, model="not a module")
    with pytest.raises(RefrunInputError, match="warmup_steps"):
        refrun.xla.instrument(run, warmup_steps=-1)
    run.close()


def test_a_second_probe_open_at_once_is_refused_and_one_after_close_is_not(store) -> None:
    """torch_xla's counters are process-wide: a second probe open beside the first would
    take the first one's copies (its copier thread's) for transfers inside its own steps.
    So it is refused with an input error naming the cause, and accepted once the first
    is closed (its run's close closes it too)."""
    first_run = start(store)
    first = refrun.xla.instrument(first_run)
    second_run = start(store)
    with pytest.raises(RefrunInputError, match="another PyTorch/XLA probe is open"):
        refrun.xla.instrument(second_run)
    first.close()
    second = refrun.xla.instrument(second_run)  # the first one closed: no error
    with pytest.raises(RefrunInputError, match="another PyTorch/XLA probe is open"):
        refrun.xla.instrument(first_run)
    second_run.close()  # closes its probe
    assert second.closed
    third = refrun.xla.instrument(first_run)
    third.close()
    # a probe whose start failed (here: a model whose parameters cannot be listed) and
    # that is still held, as a notebook's last traceback holds it, blocks no later probe
    class Unlistable(torch.nn.Module):
        def parameters(self, recurse: bool = True):
            raise RuntimeError("parameters unavailable")

    with pytest.raises(RuntimeError, match="parameters unavailable") as failed:
        refrun.xla.instrument(first_run, model=Unlistable())
    fourth = refrun.xla.instrument(first_run)
    assert failed.traceback  # the failed start's frames are still held here
    fourth.close()
    first_run.close()


def test_refrun_never_imports_torch_xla_itself() -> None:
    code = ("import sys, refrun, refrun.xla, refrun.probes.base, refrun.probes.xla, "
            "refrun.probes.tpu_monitor, refrun.recording.session; "
            "print('torch_xla' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"
