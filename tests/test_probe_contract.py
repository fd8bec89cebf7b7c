"""One probe contract for every backend (issue 15.1): one hardware classification, one way
to add end-of-run tags and artifacts, the same defaults, no doubled log prefix."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import pytest

import refrun
from refrun import schema
from refrun.probes.base import DEFAULT_RECHECK_EVERY, BackendBase, BackendWarning, Probe
from refrun.probes.hardware import family, is_accelerator


def start(store, hardware: str = "cpu", backend: str = "torch") -> refrun.RunSession:
    return refrun.start_run("contract-test", "candidate", hardware=hardware, backend=backend,
                            tracking_uri=store.tracking_uri, spool_dir=store.spool_dir,
                            snapshot_environment=False)


@pytest.mark.parametrize(("name", "accel", "fam"), [
    (None, False, None), ("", False, None), ("cpu", False, "cpu"), ("CPU ", False, "cpu"),
    ("cpu-x86", False, "cpu"), ("host", False, "cpu"), ("none", False, "cpu"),
    ("a100", True, "gpu"), ("H100-80GB", True, "gpu"), ("tpu-v5e", True, "tpu"),
    ("cuda", True, "gpu"), ("neuron", True, None),
])
def test_one_hardware_classification(name: str | None, accel: bool, fam: str | None) -> None:
    assert is_accelerator(name) is accel
    assert family(name) == fam


def test_every_backend_applies_the_same_rule_to_host() -> None:
    """``hardware="host"`` was CPU for torch and XLA but an accelerator for JAX."""
    import jax.numpy as jnp

    from refrun.probes.jax import placement_summary
    from refrun.probes.jax import placement_warnings as jax_placement
    from refrun.probes.torch import normalise_expected
    from refrun.probes.xla import placement_warnings

    parts = {"params": placement_summary(jnp.zeros(3))}  # really on the CPU
    for name in ("host", "cpu", "none"):
        assert normalise_expected(None, name) is None  # torch: no accelerator expected
        assert placement_warnings(name, "CPU", {}) == []  # xla: no family mismatch
        assert jax_placement(name, "cpu", parts) == []  # jax: no warning
    assert normalise_expected(None, "a100") == "accelerator"
    assert placement_warnings("a100", "CPU", {})
    assert jax_placement("a100", "cpu", parts)


def test_the_same_options_for_every_backend() -> None:
    """One option set (ProbeOptions): the same names and defaults for every backend, the
    same validation (jax validated none of them), the old torch name an alias."""
    import refrun.jax
    import refrun.torch
    import refrun.xla
    from refrun.errors import RefrunInputError
    from refrun.probes.options import ProbeOptions

    opts = ProbeOptions()
    assert (opts.recheck_every, opts.monitors, opts.warmup_steps, opts.sample_interval_s,
            opts.hardware) == (DEFAULT_RECHECK_EVERY, "auto", 5, 1.0, None)
    for mod in (refrun.torch, refrun.xla, refrun.jax):
        params = inspect.signature(mod.instrument).parameters
        assert params["options"].default is None, mod.__name__
        assert not {"warmup_steps", "hardware", "monitors"} & set(params), mod.__name__
        for bad, match in (({"warmup_steps": -1}, "warmup_steps: expected an integer"),
                           ({"sample_interval_s": 0}, "sample_interval_s: expected seconds"),
                           ({"recheck_every": 1.5}, "recheck_every: expected an integer"),
                           ({"monitors": "all"}, "monitors: 'all'")):
            with pytest.raises(RefrunInputError, match=match):
                mod.instrument(None, **bad)
        with pytest.raises(TypeError, match="old name of 'hardware'"):
            mod.instrument(None, hardware="cpu", expect_device="cpu")
        with pytest.raises(TypeError, match="not both"):
            mod.instrument(None, options=opts, warmup_steps=2)
        with pytest.raises(TypeError, match="unexpected keyword argument 'warmup'"):
            mod.instrument(None, warmup=2)
        with pytest.raises(RefrunInputError, match="run: expected the RunSession"):
            mod.instrument(object())  # torch alone checked this
    # torch's hardware: a device (its old expect_device values) or a hardware name.
    from refrun.probes.torch import normalise_expected

    assert [normalise_expected(h, "cpu") for h in ("cuda:1", "accelerator", "a100", "host")
            ] == ["cuda:1", "accelerator", "accelerator", "cpu"]
    with pytest.raises(RefrunInputError, match="hardware: 'a 100!'"):
        normalise_expected("a 100!", None)


class _Summarising(BackendBase):
    """A minimal backend that only adds end-of-run tags, artifacts and a warning."""

    name = "summarising"

    def begin_step(self, step: int) -> float:
        return 0.0

    def end_step(self, step: int, token: Any) -> float:
        if step == 1:
            self.warn("odd", "step one was odd", step)
        return 0.001

    def fetch(self, value: Any) -> float:
        return float(value)

    def ready(self, pending: Any) -> float:
        return pending

    def wait(self, pending: Any) -> float:
        return pending

    def counters(self) -> dict[str, float]:
        return {}

    def describe(self, final: bool = False) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None

    def summary_tags(self) -> dict[str, Any]:
        return {schema.TAG_SUMMARY_PREFIX + "custom": 7}

    def artifacts(self) -> dict[str, Any]:
        return {"refrun/custom_summary.json": {"answer": 42}}


def test_backend_end_of_run_hooks_are_written_by_the_probe(store) -> None:
    run = start(store)
    probe = Probe(run, _Summarising(), monitors=())
    for n in range(3):
        with probe.step(n):
            probe.log(loss=float(n))
    probe.close()
    run.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert tags["refrun.summary.custom"] == "7"
    art = store.client().download_artifacts(run.run_id, "refrun/custom_summary.json",
                                            str(store.tmp))
    assert json.loads(Path(art).read_text()) == {"answer": 42}
    assert [w["message"] for w in run.warnings] == ["step one was odd"]


class _AskedWarnings(_Summarising):
    """Warnings made when the probe asks (``take_warnings`` overridden), never queued."""

    def take_warnings(self) -> list[BackendWarning]:
        return [BackendWarning("asked", "made when asked", 0)]


def test_a_backend_s_warnings_are_recorded_queued_or_made_when_asked(store) -> None:
    """A step exit calls ``take_warnings`` only when BackendBase's queue holds something,
    unless the backend overrides it: then at every step, as before."""
    run = start(store)
    probe = Probe(run, _AskedWarnings(), monitors=())
    with probe.step(0):
        probe.log(loss=0.0)
    queued = [w["message"] for w in run.warnings]
    probe.close()
    run.close()
    assert queued == ["made when asked"]


def test_base_hooks_are_no_ops() -> None:
    b = BackendBase()
    assert b.summary_tags() == {} and b.artifacts() == {} and b.take_warnings() == []


def test_jax_records_sys_metrics_by_default(store) -> None:
    """JAX recorded no sys/* metrics by default while torch did."""
    import jax.numpy as jnp

    import refrun.jax

    run = start(store, backend="jax")
    probe = refrun.jax.instrument(run, params=jnp.zeros(3))
    # psutil as torch on a CPU machine, and the chip monitor (it says why a CPU has no
    # chip utilisation: refrun.exec.utilization_source)
    assert [m.name for m in probe.monitors] == ["psutil", "chip_busy"]
    with probe.step(0):
        probe.log(loss=jnp.float32(1.0))
    probe.close()
    run.close()
    metrics = store.client().get_run(run.run_id).data.metrics
    assert "sys/rss_bytes" in metrics and metrics["sys/rss_bytes"] > 0


def test_warning_log_line_has_one_prefix(store, caplog: pytest.LogCaptureFixture) -> None:
    """The XLA fallback warning printed ``WARNING:refrun:refrun: ...``."""
    run = start(store)
    with caplog.at_level(logging.WARNING, logger="refrun"):
        run.warn_once("x", "CPU fallback op aten::nonzero first executed at step 3", 3)
    run.close()
    msgs = [r.getMessage() for r in caplog.records if r.name == "refrun"]
    assert msgs == ["CPU fallback op aten::nonzero first executed at step 3"]
