"""The numerics configuration as run identity (refrun.numerics): read from the real
frameworks however it was set, recorded at start and whenever it changes -- never in every
step -- and what it means on each platform (the documented table: JAX's and PyTorch's own
documentation, measured where this machine can measure it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import refrun
import refrun.jax
import refrun.torch
from refrun import numerics, schema
from refrun.numerics import BF16, BF16_3X, BF16_6X, FLOAT16, FLOAT32, TF32, of_run

ROOT = Path(__file__).resolve().parents[1]
JAX_MM = schema.TAG_NUMERICS_JAX_MATMUL
SET_BY = schema.TAG_NUMERICS_JAX_MATMUL_SET_BY


@pytest.fixture
def jax_precision() -> Iterator[None]:
    """JAX's global matmul precision restored to unset after the test."""
    jax.config.update("jax_default_matmul_precision", None)
    yield
    jax.config.update("jax_default_matmul_precision", None)


@pytest.fixture
def torch_precision() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cuda.matmul.allow_tf32 = old[1]


# --- reading ---------------------------------------------------------------------------------
def test_jax_precision_is_read_however_it_was_set(jax_precision: None) -> None:
    now = numerics.current()
    assert (now[JAX_MM], now[SET_BY]) == ("default", "unset")
    assert now[schema.TAG_NUMERICS_JAX_X64] == "false"
    assert now[schema.TAG_NUMERICS_JAX_PLATFORM] == jax.default_backend() == "cpu"
    jax.config.update("jax_default_matmul_precision", "highest")
    assert (numerics.current()[JAX_MM], numerics.current()[SET_BY]) == (
        "highest", "jax.config.update")
    with jax.default_matmul_precision("bfloat16"):
        assert (numerics.current()[JAX_MM], numerics.current()[SET_BY]) == (
            "bfloat16", "context manager")
    assert numerics.current()[JAX_MM] == "highest"


def test_jax_precision_from_the_environment() -> None:
    code = ("import json, jax; from refrun import numerics; "
            "print(json.dumps(numerics.current()))")
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "tensorfloat32",
           "JAX_ENABLE_X64": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                        "--xla_cpu_enable_fast_math=true"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    tags = json.loads(out.strip().splitlines()[-1])
    assert tags[JAX_MM] == "tensorfloat32"
    assert tags[SET_BY] == "JAX_DEFAULT_MATMUL_PRECISION"
    assert tags[schema.TAG_NUMERICS_JAX_X64] == "true"
    assert tags[schema.TAG_NUMERICS_ENV] == \
        "JAX_DEFAULT_MATMUL_PRECISION=tensorfloat32 JAX_ENABLE_X64=1"
    # The device count is no numerics flag; fast math is.
    assert tags[schema.TAG_NUMERICS_XLA_FLAGS] == "XLA_FLAGS: --xla_cpu_enable_fast_math=true"
    assert "torch" not in " ".join(tags)  # never imported to be read


def test_numerics_flags_of_xla_and_libtpu() -> None:
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_allow_excess_precision=false "
                        "--xla_gpu_deterministic_ops --xla_gpu_autotune_level=0 "
                        "--xla_gpu_default_to_alg_dot_bf16_bf16_f32=true",
           "LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=true "
                               "--xla_jf_bf16_conv=true --xla_tpu_ftz=false"}
    got = numerics.current(modules={}, env=env)
    assert got == {
        schema.TAG_NUMERICS_XLA_FLAGS:
            "XLA_FLAGS: --xla_allow_excess_precision=false --xla_gpu_deterministic_ops "
            "--xla_gpu_default_to_alg_dot_bf16_bf16_f32=true; "
            "LIBTPU_INIT_ARGS: --xla_jf_bf16_conv=true --xla_tpu_ftz=false",
        schema.TAG_NUMERICS_ENV: "none"}
    assert numerics.current(modules={}, env={})[schema.TAG_NUMERICS_XLA_FLAGS] == "none"


def test_xla_cpu_ignores_the_matmul_precision(jax_precision: None) -> None:
    """Why CPU tests emulate a TPU's default: on XLA:CPU every precision gives the float32
    product, while a TPU's default (one bfloat16 pass) would not."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 256)).astype(np.float32)
    b = rng.normal(size=(256, 64)).astype(np.float32)
    results = []
    for p in ("default", "bfloat16", "high", "highest", "BF16_BF16_F32"):
        with jax.default_matmul_precision(p):
            results.append(np.asarray(jax.jit(lambda x, y: x @ y)(a, b)))
    assert all(np.array_equal(results[0], r) for r in results[1:])
    one_pass = np.asarray(jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                  preferred_element_type=jnp.float32))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(one_pass - exact).max() > 100 * np.abs(results[0] - exact).max()
    for p in ("default", "bfloat16", "highest", "BF16_BF16_F32"):
        assert of_run(_jax(p, "cpu")).matmul == FLOAT32


def test_torch_settings_are_read(torch_precision: None) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
    got = numerics.current()
    assert got[schema.TAG_NUMERICS_TORCH_MATMUL] == "high"
    assert got[schema.TAG_NUMERICS_TORCH_CUDA_TF32] == "true"
    assert got[schema.TAG_NUMERICS_TORCH_DEFAULT_DTYPE] == "float32"
    assert got[schema.TAG_NUMERICS_TORCH_DEVICE] in ("cpu", numerics.CPU_BF16)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        assert "cuda.matmul=tf32" in got[schema.TAG_NUMERICS_TORCH_FP32_PRECISION]


def test_torch_xla_precision_is_read() -> None:
    if os.environ.get("PJRT_DEVICE") != "CPU":
        pytest.skip("PJRT_DEVICE=CPU is how the suite runs torch_xla")
    import torch_xla.backends as xb

    old = xb.get_mat_mul_precision()
    try:
        xb.set_mat_mul_precision("highest")
        got = numerics.current()
        assert got[schema.TAG_NUMERICS_TORCH_XLA_MATMUL] == "highest"
        assert got[schema.TAG_NUMERICS_TORCH_XLA_DEVICE] == "CPU"
    finally:
        xb.set_mat_mul_precision(old)
    assert numerics.current()[schema.TAG_NUMERICS_TORCH_XLA_MATMUL] == old


# --- meaning ---------------------------------------------------------------------------------
def _jax(precision: str, platform: str, **extra: str) -> dict[str, str]:
    return {schema.TAG_BACKEND: "jax", JAX_MM: precision, SET_BY: "unset",
            schema.TAG_NUMERICS_JAX_PLATFORM: platform, **extra}


def _torch(precision: str, device: str, tf32: str = "false", cudnn: str = "true",
           env: str = "none") -> dict[str, str]:
    return {schema.TAG_BACKEND: "torch", schema.TAG_NUMERICS_TORCH_MATMUL: precision,
            schema.TAG_NUMERICS_TORCH_CUDA_TF32: tf32,
            schema.TAG_NUMERICS_TORCH_CUDNN_TF32: cudnn,
            schema.TAG_NUMERICS_TORCH_DEVICE: device, schema.TAG_NUMERICS_ENV: env}


@pytest.mark.parametrize(("tags", "matmul", "conv"), [
    # JAX's Precision documentation: DEFAULT is bfloat16 on TPU, TF32 on A100/H100 and
    # float32 on V100; HIGH 3 bfloat16 passes on TPU; HIGHEST 6 passes, float32 on GPU.
    (_jax("default", "tpu"), BF16, BF16),
    (_jax("bfloat16", "tpu"), BF16, BF16),
    (_jax("high", "tpu"), BF16_3X, BF16_3X),
    (_jax("highest", "tpu"), BF16_6X, BF16_6X),
    (_jax("float32", "tpu"), BF16_6X, BF16_6X),
    (_jax("default", "gpu 8.0"), TF32, TF32),
    (_jax("high", "gpu 9.0"), TF32, TF32),
    (_jax("default", "gpu 7.0"), FLOAT32, FLOAT32),
    (_jax("default", "gpu"), TF32, TF32),  # unknown capability: the coarser reading
    (_jax("highest", "gpu 8.0"), FLOAT32, FLOAT32),
    (_jax("BF16_BF16_F32", "gpu 9.0"), BF16, BF16),
    (_jax("F32_F32_F32", "tpu"), FLOAT32, FLOAT32),
    (_jax("default", "gpu 8.0", **{schema.TAG_NUMERICS_XLA_FLAGS: "XLA_FLAGS: "
                                   "--xla_gpu_default_to_alg_dot_bf16_bf16_f32=true"}),
     BF16, BF16),
    # torch.set_float32_matmul_precision: highest float32; high / medium TF32 on CUDA;
    # cudnn.allow_tf32 (default True) makes convolutions TF32 on Ampere and later.
    (_torch("highest", "cuda 8.0"), FLOAT32, TF32),
    (_torch("highest", "cuda 8.0", cudnn="false"), FLOAT32, FLOAT32),
    (_torch("highest", "cuda 8.0", tf32="true"), TF32, TF32),
    (_torch("high", "cuda 9.0"), TF32, TF32),
    (_torch("high", "cuda 7.0"), FLOAT32, FLOAT32),  # no TF32 before Ampere
    (_torch("high", "cuda 8.0", env="NVIDIA_TF32_OVERRIDE=0"), FLOAT32, FLOAT32),
    (_torch("medium", numerics.CPU_BF16), BF16, FLOAT32),
    (_torch("medium", "cpu"), FLOAT32, FLOAT32),
    (_torch("high", numerics.CPU_BF16), FLOAT32, FLOAT32),
    # torch_xla: as XLA on the PJRT device; XLA_USE_BF16 stores every float32 as bfloat16.
    ({schema.TAG_BACKEND: "torch_xla", schema.TAG_NUMERICS_TORCH_XLA_MATMUL: "default",
      schema.TAG_NUMERICS_TORCH_XLA_DEVICE: "TPU"}, BF16, BF16),
    ({schema.TAG_BACKEND: "torch_xla", schema.TAG_NUMERICS_TORCH_XLA_MATMUL: "highest",
      schema.TAG_NUMERICS_TORCH_XLA_DEVICE: "CPU"}, FLOAT32, FLOAT32),
])
def test_what_a_configuration_means(tags: dict[str, str], matmul: Any, conv: Any) -> None:
    n = of_run(tags)
    assert n.known and (n.matmul.bits, n.conv.bits) == (matmul.bits, conv.bits)


def test_downcasting_torch_xla_and_unknown_runs() -> None:
    n = of_run({schema.TAG_BACKEND: "torch_xla", schema.TAG_NUMERICS_TORCH_XLA_MATMUL:
                "highest", schema.TAG_NUMERICS_TORCH_XLA_DEVICE: "TPU",
                schema.TAG_NUMERICS_ENV: "XLA_USE_FP16=1"})
    assert n.matmul.bits == FLOAT16.bits and "every float32 tensor" in n.matmul.name
    assert n.rerun == "without XLA_USE_FP16 / XLA_DOWNCAST_FP16"
    # A run of another backend, or recorded before numerics were: unknown, never coarser.
    assert not of_run({schema.TAG_BACKEND: "torch"}).known
    assert not of_run({schema.TAG_BACKEND: "import", JAX_MM: "default"}).known
    assert numerics.coarser(of_run({}), of_run(_jax("default", "tpu")), 90.5) == []


def test_coarser_is_beyond_the_bands_structural_factor() -> None:
    ref = of_run(_torch("highest", "cpu"))
    factor = 2.0 ** 6.5
    # TPU highest (6 passes, ~22 bits) is float32 to within 2^2: not coarser.
    assert numerics.coarser(of_run(_jax("highest", "tpu")), ref, factor) == []
    (c,) = numerics.coarser(of_run(_jax("high", "tpu")), ref, factor)
    assert c.what == "matmuls and convolutions" and c.run == BF16_3X
    # A GPU reference with TF32 convolutions: a TPU default is coarser in matmuls only
    # (bfloat16 against TF32 is 2^3, inside the factor).
    gpu = of_run(_torch("highest", "cuda 8.0"))
    (m,) = numerics.coarser(of_run(_jax("default", "tpu")), gpu, factor)
    assert m.what == "matmuls" and not m.assumed
    # Against a pair that recorded nothing, float32 is assumed, and said.
    (u,) = numerics.coarser(of_run(_jax("default", "tpu")), of_run({}), factor)
    assert u.assumed and "recorded none (taken as float32)" in u.text()


def test_a_change_during_training_counts_with_both_values() -> None:
    changes = [{"step": 0, "tag": JAX_MM, "from": "default", "to": "highest",
                "before_training": True},
               {"step": 49, "tag": JAX_MM, "from": "highest", "to": "default",
                "before_training": False}]
    tags = {**_jax("default", "tpu"), schema.TAG_NUMERICS_CHANGES: json.dumps(changes)}
    n = of_run(tags)
    assert n.matmul == BF16
    assert n.changes == ("jax.matmul_precision highest -> default at step 49",)
    tags[JAX_MM] = "highest"  # ended at highest after a stretch at default: still coarse
    changes[1].update({"from": "default", "to": "highest"})
    tags[schema.TAG_NUMERICS_CHANGES] = json.dumps(changes)
    assert of_run(tags).matmul == BF16
    assert "changed during the run: jax.matmul_precision default -> highest at step 49" \
        in of_run(tags).summary()


# --- recording -------------------------------------------------------------------------------
def _step() -> Any:
    @jax.jit
    def train_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    return train_step


def test_recorded_at_start_and_when_it_changes_never_per_step(
        store: Any, jax_precision: None, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = numerics.current

    def counted(*a: Any, **k: Any) -> dict[str, str]:
        reads.append(1)
        return real(*a, **k)

    monkeypatch.setattr(numerics, "current", counted)
    step, w = _step(), jnp.ones((3, 1))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), dtype=jnp.float32)
    with refrun.start_run("numerics-test", "candidate", backend="jax", hardware="cpu",
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir) as run:
        assert len(reads) == 1  # start_run (environment tags)
        probe = refrun.jax.instrument(run, step_fns=[step], recheck_every=5, monitors=None)
        for n in range(23):
            if n == 12:  # a user changes the precision mid-run (the step recompiles)
                jax.config.update("jax_default_matmul_precision", "highest")
            with probe.step(n):
                w, loss = step(w, x)
                probe.log(loss=loss)
        probe.close()
    # start_run, the probe's start, the first step's end and every 5th step: not per step.
    assert len(reads) == 1 + 1 + 1 + 23 // 5
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[JAX_MM] == "highest" and tags[SET_BY] == "jax.config.update"
    changes = json.loads(tags[schema.TAG_NUMERICS_CHANGES])
    # Seen at the recheck after step 14 (the 15th step); steps 0-11 ran at default.
    assert changes == [{"step": 14, "tag": JAX_MM, "from": "default", "to": "highest",
                        "before_training": False}]
    warnings = json.loads(store.artifact_text(run.run_id, schema.ARTIFACT_WARNINGS))
    said = [w["message"] for w in warnings["warnings"]]
    assert any("numerics changed during the run at step 14: jax.matmul_precision default "
               "-> highest" in m for m in said), said
    assert of_run(tags).changes == ("jax.matmul_precision default -> highest at step 14",)
    # The readings themselves compile nothing: only the user's change recompiled the step.
    graphs = [v for _, v in store.points(run.run_id, schema.M_COMPILE_GRAPHS)]
    assert sum(graphs) == 2


def test_torch_probe_records_a_precision_change(store: Any, torch_precision: None) -> None:
    import warnings

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    with refrun.start_run("numerics-test", "candidate", backend="torch", hardware="cpu",
                          tracking_uri=store.tracking_uri, spool_dir=store.spool_dir) as run:
        probe = refrun.torch.instrument(run, model, opt, recheck_every=4, monitors=None)
        for n in range(9):
            if n == 5:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.set_float32_matmul_precision("medium")
            with probe.step(n):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                probe.log(loss=loss.detach())
        probe.close()
    tags = store.client().get_run(run.run_id).data.tags
    assert tags[schema.TAG_NUMERICS_TORCH_MATMUL] == "medium"
    changes = json.loads(tags[schema.TAG_NUMERICS_CHANGES])
    assert [(c["step"], c["tag"], c["from"], c["to"], c["before_training"]) for c in changes
            if c["tag"] == schema.TAG_NUMERICS_TORCH_MATMUL] == [
        (7, schema.TAG_NUMERICS_TORCH_MATMUL, "highest", "medium", False)]
    n = of_run(tags)
    bf16_here = tags[schema.TAG_NUMERICS_TORCH_DEVICE] == numerics.CPU_BF16
    assert n.matmul == (BF16 if bf16_here else FLOAT32)
