"""Host syncs inside a PyTorch step on CUDA (``xfer/host_syncs`` through
``torch.cuda.set_sync_debug_mode``): counted on a GPU, and off, saying so, on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import refrun
import refrun.torch
from refrun import schema
from refrun.probes.torch import CUDA_SYNC_WARNING, CudaSyncCounter


def start(store) -> refrun.RunSession:
    hw = "cuda" if torch.cuda.is_available() else "cpu"
    return refrun.start_run("torch-cuda-syncs", "candidate", hardware=hw, backend="torch",
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False)


def train(probe, model, device, read_at: set[int], steps: int = 6) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for n in range(steps):
        x = torch.randn(8, 4, generator=g).to(device)
        with probe.step(n):
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if n in read_at:
                loss.item()  # the user's host sync
            probe.log(loss=loss.detach())
        float(loss.detach().cpu())  # between steps: not the step's


def test_on_the_cpu_nothing_is_counted_and_the_tag_says_why(store) -> None:
    show_before = warnings.showwarning
    run = start(store)
    model = torch.nn.Linear(4, 1)  # on the CPU, whether or not the machine has a GPU
    with refrun.torch.instrument(run, model=model) as probe:
        assert warnings.showwarning is show_before  # no hook installed on the CPU
        train(probe, model, torch.device("cpu"), read_at={3, 4})
    run.close()
    assert not any(f[1] is not None and "synchronizing" in f[1].pattern
                   for f in warnings.filters)  # no filter of ours either
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_TORCH_CUDA_SYNCS].startswith("off (the model is on cpu")
    assert store.client().get_metric_history(run.run_id, schema.M_HOST_SYNCS) == []


def test_sync_warnings_are_counted_only_while_active_and_others_pass_through() -> None:
    """The counting half of the CUDA path (which needs no GPU): PyTorch's warning text is
    counted and swallowed while a step is open; every other warning is forwarded."""
    seen: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda m, *a, **k: seen.append(str(m))
        c = CudaSyncCounter()
        c.install()
        c.active = True  # what begin() sets after switching the sync debug mode on
        for _ in range(3):
            warnings.warn(CUDA_SYNC_WARNING, UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        c.active = False
        warnings.warn(CUDA_SYNC_WARNING, UserWarning, stacklevel=1)  # outside a step
        c.remove()
        assert c.n == 3
        assert seen == ["something else", CUDA_SYNC_WARNING]
        assert warnings.showwarning is not c._show


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                    "(torch.cuda.is_available() is False on this machine)")
def test_item_in_a_cuda_step_is_one_host_sync_and_the_probe_adds_none(store) -> None:
    dev = torch.device("cuda")
    model = torch.nn.Linear(4, 1).to(dev)
    run = start(store)
    mode_before = torch.cuda.get_sync_debug_mode()
    with refrun.torch.instrument(run, model=model) as probe:
        train(probe, model, dev, read_at={3, 4, 5})
        assert torch.cuda.get_sync_debug_mode() == mode_before  # restored between steps
    run.close()
    hist = store.client().get_metric_history(run.run_id, schema.M_HOST_SYNCS)
    per_step = [m.value for m in sorted(hist, key=lambda m: m.step)]
    assert per_step == [0, 0, 0, 1, 1, 1]  # the loop's own .item() calls, nothing else
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_TORCH_CUDA_SYNCS].startswith("counted")
