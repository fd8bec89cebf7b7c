"""Numerics configuration as run identity: the settings, made outside the training code,
that decide how its float32 arithmetic is carried out -- read from this process
(:func:`current`) and interpreted for the platform that ran it (:func:`of_run`).

**Why it is identity.**  The same JAX code computes a float32 matmul in float32 on a CPU,
as TF32 on an A100 and as one bfloat16 pass on a TPU, at JAX's default precision; at
``'highest'`` in (about) float32 everywhere.  A same-seed port's divergence from its seed
is set by the coarsest arithmetic in its step (docs/acceptance.md, "Same-seed paired
comparison"), so an exact port at a TPU's default precision diverges as far as one that
casts its matmuls to bfloat16 (measured on a TPU v5e: per-step loss RMS 1.27e-4 against
1.21e-4; 4.2e-6 at ``'highest'``).  Set with ``jax.config.update`` the precision was
recorded nowhere, and the failing verdict gave no hint of its cause.

**What is read** (``refrun.numerics.*`` tags, :mod:`refrun.schema` section 15), only for
frameworks the process imported itself (never an import):

* JAX: ``jax_default_matmul_precision`` as in force on the calling thread (a context
  manager's value, else ``jax.config.update``'s or ``JAX_DEFAULT_MATMUL_PRECISION``'s;
  ``default`` when unset) and who set it, ``jax_enable_x64``, the platform (and a GPU's
  compute capability);
* PyTorch: ``torch.get_float32_matmul_precision()``, ``torch.backends.cuda.matmul.
  allow_tf32``, ``torch.backends.cudnn.allow_tf32``, torch >= 2.9's ``fp32_precision``
  settings, the reduced-precision-reduction switches of bfloat16/float16 matmuls, the
  default dtype, where it computes (CUDA and its compute capability, or the CPU and
  whether oneDNN has bfloat16 matmul kernels there);
* PyTorch/XLA: ``torch_xla.backends.get_mat_mul_precision()`` and ``PJRT_DEVICE``;
* every process: the numerics-changing flags of ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``
  (:data:`FLAG_PATTERNS`) and the numerics environment variables set
  (:data:`NUMERICS_ENV`).

Reading costs tens of microseconds (config lookups, no device work), so it is done at
``start_run`` and by the probes at start, at the end of the first step (inside a context
manager that wraps the loop) and every ``recheck_every`` steps -- never in every step.

**What it means** (:func:`of_run`, pure, from a run's tags): how float32 matmuls and
convolutions were carried out on that platform, as an :class:`Arithmetic` with its
significand bits (unit roundoff ``2^-bits``):

========================  ===============  ===================  ===============
setting                   TPU              GPU (CUDA >= 8.0)    CPU
========================  ===============  ===================  ===============
JAX default / bfloat16    bfloat16, 1 pass TF32 (11 bits)       float32
JAX high / tensorfloat32  bfloat16, 3 pass TF32                 float32
JAX highest / float32     bfloat16, 6 pass float32              float32
torch highest             --               float32 (+ TF32      float32
                                           convs: cudnn)
torch high                --               TF32                 float32
torch medium              --               TF32                 bfloat16 where
                                                                oneDNN has it
torch_xla default/high/   as JAX on the PJRT device; XLA_USE_BF16 / XLA_DOWNCAST_BF16:
highest                   every float32 tensor in bfloat16
========================  ===============  ===================  ===============

Sources: JAX's ``jax.lax.Precision`` and "Matmul precision" documentation (DEFAULT is
bfloat16 on TPU, TF32 on A100/H100, float32 on V100; HIGH 3 bfloat16 passes on TPU, TF32
on GPU; HIGHEST 6 passes on TPU, float32 on GPU); torch_xla.backends (TPU ``high`` ~14
bits, ``highest`` ~22 bits); PyTorch's ``torch.set_float32_matmul_precision``.  XLA:CPU
ignores the precision: measured with jax 0.10.2, every setting and the BF16_BF16_F32
algorithm give the float32 result (unsupported algorithms raise).  torch's ``medium`` on
a CPU with bfloat16 support (AVX512-BF16/AMX) computes float32 matmuls in bfloat16
(measured: torch 2.9, max error 0.19 against 3.1e-5 at ``highest`` for a 64x256 @ 256x64
product); without it, float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refrun import schema

NONE = "none"
#: Environment variables that change numerics, recorded when set (``NAME=value``).
NUMERICS_ENV = ("JAX_DEFAULT_MATMUL_PRECISION", "JAX_ENABLE_X64", "NVIDIA_TF32_OVERRIDE",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "XLA_USE_BF16", "XLA_DOWNCAST_BF16",
                "XLA_USE_FP16", "XLA_DOWNCAST_FP16", "ONEDNN_DEFAULT_FPMATH_MODE",
                "DNNL_DEFAULT_FPMATH_MODE")
#: Where XLA reads its flags (JAX, PyTorch/XLA) and libtpu reads its own.
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
#: A flag of those variables is recorded when its name contains one of these.  The XLA
#: flags they select in jaxlib 0.10.2 (the names in its library): xla_enable_fast_math,
#: xla_cpu_enable_fast_math, xla_cpu_fast_math_honor_{nans,infs,division,functions},
#: xla_{cpu,gpu}_enable_fast_min_max, xla_allow_excess_precision, xla_{cpu,gpu}_ftz,
#: xla_cpu_{enable,disable}_platform_dependent_math, xla_cpu_strict_dot_conv_math,
#: xla_gpu_default_to_alg_dot_bf16_bf16_f32, xla_gpu_deterministic_ops,
#: xla_gpu_exclude_nondeterministic_ops, xla_gpu_enable_scatter_determinism_expander,
#: xla_gpu_enable_reassociation_for_converted_ar; the patterns also select libtpu's and
#: later XLA versions' flags of the same kinds (fast math, excess precision, flush to
#: zero, reduced-precision types, determinism), which are not listed anywhere.  Left out
#: on purpose: flags that only choose among float32 kernels (autotuning, Triton, cuBLASLt,
#: oneDNN/XNNPACK on the CPU): they change summation order at float32 precision, which the
#: paired band already allows for.
FLAG_PATTERNS = ("fast_math", "fast_min_max", "excess_precision", "precision", "ftz",
                 "denormal", "tf32", "bf16", "f16", "fp8", "f8e", "downcast", "determinis",
                 "platform_dependent_math", "strict_dot_conv_math", "reassociation")
MAX_CHANGES = 20  # entries of refrun.numerics.changes (later changes only counted)
CPU_BF16 = "cpu, bf16 matmul kernels"  # torch's device tag where "medium" means bfloat16
_TRUE = ("1", "true", "yes", "on")


# --- reading this process ------------------------------------------------------------------
def numerics_flags(text: str) -> list[str]:
    """The numerics-changing flags (:data:`FLAG_PATTERNS`) among the whitespace-separated
    ``--name[=value]`` tokens of ``text``, in order."""
    out = []
    for token in text.split():
        name = token.lstrip("-").split("=", 1)[0].lower()
        if name and any(p in name for p in FLAG_PATTERNS):
            out.append(token)
    return out


def flags_value(env: Mapping[str, str]) -> str:
    """``XLA_FLAGS: --a=1; LIBTPU_INIT_ARGS: --b`` (the numerics flags of each variable
    that has some), or ``none``."""
    parts = []
    for var in FLAG_VARIABLES:
        found = numerics_flags(env.get(var, ""))
        if found:
            parts.append(f"{var}: {' '.join(found)}")
    return "; ".join(parts) or NONE


def env_value(env: Mapping[str, str]) -> str:
    """``NAME=value ...`` of the :data:`NUMERICS_ENV` variables that are set, or ``none``."""
    return " ".join(f"{k}={env[k]}" for k in NUMERICS_ENV if k in env) or NONE


def _jax_set_by(env: Mapping[str, str]) -> str:
    """Who set ``jax_default_matmul_precision``: a context manager (a thread-local value
    is set), ``JAX_DEFAULT_MATMUL_PRECISION`` (the global value equals it),
    ``jax.config.update`` (another global value) or nobody (``unset``).  Reads JAX's
    private config state; ``?`` where that is not what this JAX has."""
    try:
        from jax._src import config as jc  # the State object's local and global values

        state = jc.default_matmul_precision
        local, glob = state.get_local(), state.get_global()
        unset = jc.config_ext.unset
    except Exception:
        return "?"
    if local is not unset:
        return "context manager"
    if glob is None:
        return "unset"
    if env.get("JAX_DEFAULT_MATMUL_PRECISION", "").strip().lower() == str(glob).lower():
        return "JAX_DEFAULT_MATMUL_PRECISION"
    return "jax.config.update"


def _jax_tags(jax: Any, env: Mapping[str, str]) -> dict[str, str]:
    value = jax.config.jax_default_matmul_precision  # the thread's value (context managers)
    platform = str(jax.default_backend())
    if platform not in ("cpu", "tpu"):
        with contextlib.suppress(Exception):
            cc = getattr(jax.devices()[0], "compute_capability", None)
            platform = f"{platform} {cc}" if cc else platform
    return {schema.TAG_NUMERICS_JAX_MATMUL: "default" if value is None else str(value),
            schema.TAG_NUMERICS_JAX_MATMUL_SET_BY: _jax_set_by(env),
            schema.TAG_NUMERICS_JAX_X64: str(bool(jax.config.jax_enable_x64)).lower(),
            schema.TAG_NUMERICS_JAX_PLATFORM: platform}


_CPU_BF16_SEEN: dict[tuple[str, str], bool] = {}


def _cpu_bf16(torch: Any) -> bool:
    """Whether the setting in force computes float32 matmuls on this CPU in bfloat16: oneDNN
    has bfloat16 matmul kernels here, the setting asks for them (``medium``, or
    ``mkldnn.matmul`` = ``bf16``), and a 64x256 @ 256x64 product made with it errs like
    one bfloat16 pass against float64 (above 7e-3: one pass errs ~1e-1 there, float32 or
    three bfloat16 passes ~1e-5).  Measured once per
    setting and process: an AMD EPYC with avx512_bf16 reports the kernels, yet its
    ``medium`` products err 1.4x float32's, not the ~1000x of a bfloat16 pass; asking
    oneDNN alone named such a run's float32 arithmetic bfloat16.  The product is made on
    the calling thread with CPU tensors and its own generator (no global state touched)."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        precision = str(torch.get_float32_matmul_precision())
        mm = str(getattr(getattr(getattr(torch.backends, "mkldnn", None), "matmul", None),
                         "fp32_precision", ""))
    except Exception:
        return False
    if precision != "medium" and mm != "bf16":
        return False
    key = (precision, mm)
    if key not in _CPU_BF16_SEEN:
        try:
            g = torch.Generator().manual_seed(5)
            a = torch.randn(64, 256, generator=g)
            b = torch.randn(256, 64, generator=g)
            with torch.no_grad():
                err = float((a @ b - a.double() @ b.double()).abs().max())
            # 256 unit-variance products: float32 errs ~1e-5, a bfloat16 pass (8-bit
            # mantissa: 2^-9 relative per operand) ~1e-1; 7.3e-3 lies between, far from both
            _CPU_BF16_SEEN[key] = err > 30 * 256 * 2.0 ** -24 * 16
        except Exception:
            return False
    return _CPU_BF16_SEEN[key]


# torch >= 2.9's fp32_precision settings (ieee | tf32 | bf16 | none: as the parent says).
_TORCH_FP32 = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv",
               "mkldnn.rnn")


def _torch_tags(torch: Any) -> dict[str, str]:
    back = torch.backends
    with warnings.catch_warnings():  # torch 2.9 warns that the TF32 switches will go
        warnings.simplefilter("ignore")
        out = {schema.TAG_NUMERICS_TORCH_MATMUL: str(torch.get_float32_matmul_precision()),
               schema.TAG_NUMERICS_TORCH_CUDA_TF32: str(bool(back.cuda.matmul.allow_tf32)
                                                        ).lower(),
               schema.TAG_NUMERICS_TORCH_CUDNN_TF32: str(bool(back.cudnn.allow_tf32)).lower()}
    fp32 = []
    for path in _TORCH_FP32:
        obj: Any = back
        for part in path.split("."):
            obj = getattr(obj, part, None)
        value = getattr(obj, "fp32_precision", None)
        if isinstance(value, str):
            fp32.append(f"{path}={value}")
    if fp32:
        out[schema.TAG_NUMERICS_TORCH_FP32_PRECISION] = " ".join(fp32)
    mm = back.cuda.matmul
    out[schema.TAG_NUMERICS_TORCH_REDUCED_REDUCTION] = (
        f"bf16={str(bool(getattr(mm, 'allow_bf16_reduced_precision_reduction', False))).lower()}"
        f" fp16={str(bool(getattr(mm, 'allow_fp16_reduced_precision_reduction', False))).lower()}")
    out[schema.TAG_NUMERICS_TORCH_DEFAULT_DTYPE] = str(torch.get_default_dtype()).replace(
        "torch.", "")
    device = CPU_BF16 if _cpu_bf16(torch) else "cpu"
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():  # never initialise CUDA to ask
            major, minor = torch.cuda.get_device_capability()
            device = f"cuda {major}.{minor}"
    out[schema.TAG_NUMERICS_TORCH_DEVICE] = device
    return out


def _torch_xla_tags(torch_xla: Any, env: Mapping[str, str]) -> dict[str, str]:
    out = {schema.TAG_NUMERICS_TORCH_XLA_DEVICE: env.get("PJRT_DEVICE", "") or "?"}
    with contextlib.suppress(Exception):
        out[schema.TAG_NUMERICS_TORCH_XLA_MATMUL] = str(
            torch_xla._XLAC._xla_get_mat_mul_precision())
    return out


def current(modules: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's numerics configuration as ``refrun.numerics.*`` tags (see the module
    doc): the frameworks in ``modules`` (default ``sys.modules``; never imported here) and
    the numerics flags and variables of ``env`` (default ``os.environ``).  Never raises: a
    framework that cannot be read is left out."""
    modules = sys.modules if modules is None else modules
    env = os.environ if env is None else env
    out = {schema.TAG_NUMERICS_XLA_FLAGS: flags_value(env),
           schema.TAG_NUMERICS_ENV: env_value(env)}
    for name, read in (("jax", lambda m: _jax_tags(m, env)), ("torch", _torch_tags),
                       ("torch_xla", lambda m: _torch_xla_tags(m, env))):
        module = modules.get(name)
        if module is not None:
            with contextlib.suppress(Exception):  # a reading must never stop a run
                out.update(read(module))
    return out


def change_entries(previous: Mapping[str, str], now: Mapping[str, str], step: int | None,
                   before_training: bool) -> list[dict[str, Any]]:
    """One ``{"step", "tag", "from", "to", "before_training"}`` per numerics *setting*
    (:data:`refrun.schema.NUMERICS_SETTING_TAGS`) that ``previous`` had and ``now`` has
    with another value (a framework read for the first time is no change)."""
    return [{"step": step, "tag": k, "from": previous[k], "to": now[k],
             "before_training": before_training}
            for k in schema.NUMERICS_SETTING_TAGS
            if k in previous and k in now and previous[k] != now[k]]


def changes_of(tags: Mapping[str, str]) -> list[dict[str, Any]]:
    """The recorded changes (``refrun.numerics.changes``); [] when none or unreadable."""
    try:
        got = json.loads(tags.get(schema.TAG_NUMERICS_CHANGES, "") or "[]")
    except ValueError:
        return []
    return [c for c in got if isinstance(c, dict) and "tag" in c] if isinstance(got, list) \
        else []


# --- meaning: how float32 matmuls and convolutions were carried out --------------------------
@dataclass(frozen=True)
class Arithmetic:
    """How one family of float32 operations (matmuls, convolutions) is carried out:
    ``name`` and its significand bits (unit roundoff ``2^-bits``; None: unknown)."""

    name: str
    bits: float | None

    @property
    def known(self) -> bool:
        return self.bits is not None


FLOAT32 = Arithmetic("float32", 24)
FLOAT64 = Arithmetic("float64", 53)
BF16_6X = Arithmetic("6-pass bfloat16 (~float32)", 22)  # torch_xla: ~22 bits
BF16_3X = Arithmetic("3-pass bfloat16", 14)  # torch_xla: ~14 bits
TF32_3X = Arithmetic("3-pass TF32 (~float32)", 21)
TF32 = Arithmetic("TF32", 11)
FLOAT16 = Arithmetic("float16", 11)
BF16 = Arithmetic("1-pass bfloat16", 8)
FLOAT8 = Arithmetic("float8", 4)
UNKNOWN = Arithmetic("unknown", None)

# JAX's legacy names -> level; its dot algorithm presets -> arithmetic wherever supported.
_JAX_LEVEL = {"default": "default", "bfloat16": "default", "fastest": "default",
              "high": "high", "tensorfloat32": "high", "highest": "highest",
              "float32": "highest"}
_JAX_PRESET = {"F32_F32_F32": FLOAT32, "F64_F64_F64": FLOAT64, "BF16_BF16_F32": BF16,
               "BF16_BF16_BF16": BF16, "BF16_BF16_F32_X3": BF16_3X,
               "BF16_BF16_F32_X6": BF16_6X, "BF16_BF16_F32_X9": FLOAT32,
               "TF32_TF32_F32": TF32, "TF32_TF32_F32_X3": TF32_3X, "F16_F16_F16": FLOAT16,
               "F16_F16_F32": FLOAT16}


def _gpu_has_tf32(platform: str) -> bool:
    """Whether a GPU ``platform`` tag (``gpu 8.0``) has TF32 (compute capability >= 8.0);
    True when the capability is not known (the coarser reading: said as "may")."""
    cc = platform.partition(" ")[2]
    try:
        return float(cc) >= 8.0
    except ValueError:
        return True


def xla_arithmetic(precision: str, platform: str, flags: str = "") -> Arithmetic:
    """Float32 dots at XLA precision ``precision`` (JAX's or torch_xla's names, or a dot
    algorithm preset) on ``platform`` (``cpu``, ``tpu``, ``gpu 8.0`` ...; PJRT names too)."""
    plat = platform.partition(" ")[0].lower()
    p = (precision or "default").strip()
    if plat == "cpu":
        return FLOAT32  # XLA:CPU computes float32 dots in float32 whatever is asked
    if p.upper() in _JAX_PRESET:
        return _JAX_PRESET[p.upper()]
    level = _JAX_LEVEL.get(p.lower())
    if level is None:
        return UNKNOWN
    if plat == "tpu":
        return {"default": BF16, "high": BF16_3X, "highest": BF16_6X}[level]
    if plat in ("gpu", "cuda", "rocm"):
        if level == "default" and "xla_gpu_default_to_alg_dot_bf16_bf16_f32=true" in \
                flags.lower():
            return BF16
        return TF32 if level != "highest" and _gpu_has_tf32(platform) else FLOAT32
    return UNKNOWN


def _env(tags: Mapping[str, str]) -> dict[str, str]:
    text = tags.get(schema.TAG_NUMERICS_ENV, "")
    return dict(p.split("=", 1) for p in text.split() if "=" in p)


def _fp32(tags: Mapping[str, str]) -> dict[str, str]:
    text = tags.get(schema.TAG_NUMERICS_TORCH_FP32_PRECISION, "")
    return dict(p.split("=", 1) for p in text.split() if "=" in p)


@dataclass(frozen=True)
class Reading:
    """What one configuration means: float32 matmuls and convolutions, what decides them
    (``setting``), and how to run the same code at full float32 precision (``rerun``)."""

    matmul: Arithmetic
    conv: Arithmetic
    setting: str
    rerun: str


def _jax_reading(tags: Mapping[str, str]) -> Reading:
    p = tags.get(schema.TAG_NUMERICS_JAX_MATMUL, "default")
    plat = tags.get(schema.TAG_NUMERICS_JAX_PLATFORM, "?")
    a = xla_arithmetic(p, plat, tags.get(schema.TAG_NUMERICS_XLA_FLAGS, ""))
    by = tags.get(schema.TAG_NUMERICS_JAX_MATMUL_SET_BY, "")
    setting = f"jax_default_matmul_precision={p} on {plat}" + (
        f", set by {by}" if by not in ("", "?", "unset") else "")
    rerun = ("with jax.default_matmul_precision('highest') around the training loop"
             if by == "context manager" else
             "JAX_DEFAULT_MATMUL_PRECISION=highest (or jax.config.update("
             "'jax_default_matmul_precision', 'highest') before the step is traced)")
    return Reading(a, a, setting, rerun)


def _torch_reading(tags: Mapping[str, str]) -> Reading:
    prec = tags.get(schema.TAG_NUMERICS_TORCH_MATMUL, "highest")
    device = tags.get(schema.TAG_NUMERICS_TORCH_DEVICE, "cpu")
    fp32, env = _fp32(tags), _env(tags)
    mm_tf32 = tags.get(schema.TAG_NUMERICS_TORCH_CUDA_TF32) == "true"
    conv_tf32 = tags.get(schema.TAG_NUMERICS_TORCH_CUDNN_TF32) == "true"
    setting = f"torch float32_matmul_precision={prec}"
    if device.startswith("cuda"):
        tf32_ok = _gpu_has_tf32("gpu " + device.partition(" ")[2]) and \
            env.get("NVIDIA_TF32_OVERRIDE") != "0"
        mm_new = fp32.get("cuda.matmul", "none")
        mm = (mm_new == "tf32") if mm_new != "none" else (
            mm_tf32 or prec in ("high", "medium")
            or env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") in _TRUE)
        conv_new = fp32.get("cudnn.conv", "none")
        conv = (conv_new == "tf32") if conv_new != "none" else conv_tf32
        setting += (f", cuda.matmul.allow_tf32={str(mm_tf32).lower()}, "
                    f"cudnn.allow_tf32={str(conv_tf32).lower()} on {device}")
        return Reading(TF32 if mm and tf32_ok else FLOAT32, TF32 if conv and tf32_ok
                       else FLOAT32, setting,
                       "torch.set_float32_matmul_precision('highest') and "
                       "torch.backends.cudnn.allow_tf32 = False (or NVIDIA_TF32_OVERRIDE=0)")
    bf16_ok = device == CPU_BF16
    mm = bf16_ok and (prec == "medium" or fp32.get("mkldnn.matmul") == "bf16")
    conv = bf16_ok and fp32.get("mkldnn.conv") == "bf16"
    where = "a cpu with bfloat16 matmul kernels" if mm or conv else "cpu"
    return Reading(BF16 if mm else FLOAT32, BF16 if conv else FLOAT32,
                   f"{setting} on {where}",
                   "torch.set_float32_matmul_precision('highest')")


def _torch_xla_reading(tags: Mapping[str, str]) -> Reading:
    env = _env(tags)
    device = tags.get(schema.TAG_NUMERICS_TORCH_XLA_DEVICE, "?")
    for names, a in ((("XLA_USE_BF16", "XLA_DOWNCAST_BF16"), BF16),
                     (("XLA_USE_FP16", "XLA_DOWNCAST_FP16"), FLOAT16)):
        on = [n for n in names if env.get(n, "").lower() in _TRUE]
        if on:
            every = Arithmetic(f"{a.name} (every float32 tensor)", a.bits)
            return Reading(every, every, f"{'='.join((on[0], env[on[0]]))} on {device}",
                           f"without {' / '.join(names)}")
    p = tags.get(schema.TAG_NUMERICS_TORCH_XLA_MATMUL, "default")
    a = xla_arithmetic(p, device, tags.get(schema.TAG_NUMERICS_XLA_FLAGS, ""))
    return Reading(a, a, f"torch_xla mat_mul_precision={p} on PJRT_DEVICE={device}",
                   "torch_xla.backends.set_mat_mul_precision('highest')")


_READERS = {"jax": (schema.TAG_NUMERICS_JAX_MATMUL, _jax_reading),
            "torch": (schema.TAG_NUMERICS_TORCH_MATMUL, _torch_reading),
            "torch_xla": (schema.TAG_NUMERICS_TORCH_XLA_MATMUL, _torch_xla_reading)}


def _framework(tags: Mapping[str, str]) -> str:
    """The framework whose settings decide the run's arithmetic: its ``refrun.backend``."""
    backend = tags.get(schema.TAG_BACKEND, "").strip().lower().replace("-", "_")
    return {"pytorch": "torch", "pytorch_xla": "torch_xla", "flax": "jax"}.get(backend,
                                                                               backend)


def _coarsest(a: Arithmetic, b: Arithmetic) -> Arithmetic:
    if a.bits is None or b.bits is None:
        return UNKNOWN if a.bits is None else a
    return a if a.bits <= b.bits else b


@dataclass(frozen=True)
class RunNumerics:
    """A run's numerics configuration and what it meant (:func:`of_run`).

    ``known``: the run recorded the settings of the framework that computed its step
    (its ``refrun.backend``); ``matmul`` / ``conv``: the coarsest arithmetic in force
    during training (a setting changed mid-run counts with both values); ``setting``: what
    decides them; ``rerun``: how to run the same code at full float32 precision;
    ``flags``: the numerics XLA flags (``none``); ``changes``: settings changed after the
    first step, one sentence each."""

    known: bool
    framework: str
    matmul: Arithmetic
    conv: Arithmetic
    setting: str
    rerun: str
    flags: str
    changes: tuple[str, ...] = ()

    def summary(self) -> str:
        """``float32 matmuls: bfloat16, 1 pass (jax_default_matmul_precision=default on
        tpu)``; convolutions named only when they differ from matmuls."""
        if not self.known:
            return "not recorded"
        conv = "" if self.conv == self.matmul else f", convolutions: {self.conv.name}"
        extra = "" if self.flags in ("", NONE) else f"; {self.flags}"
        mixed = f"; changed during the run: {', '.join(self.changes)}" if self.changes else ""
        return f"float32 matmuls: {self.matmul.name}{conv} ({self.setting}{extra}){mixed}"


def _states(tags: Mapping[str, str]) -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """The configurations in force during training: the latest tags, and before each
    change seen after training began, the value it replaced (newest first)."""
    state = dict(tags)
    states, said = [dict(state)], []
    for c in reversed(changes_of(tags)):
        if c.get("before_training"):
            continue
        state[str(c["tag"])] = str(c.get("from"))
        states.append(dict(state))
        said.insert(0, f"{str(c['tag']).removeprefix(schema.NUMERICS_PREFIX)} "
                       f"{c.get('from')} -> {c.get('to')} at step {c.get('step')}")
    return states, tuple(said)


def of_run(tags: Mapping[str, str]) -> RunNumerics:
    """What a run's recorded numerics configuration meant (see the module doc); unknown
    (``known`` False, arithmetic :data:`UNKNOWN`) when the run recorded no setting of the
    framework its ``refrun.backend`` names (recorded before numerics were, imported, or
    a backend refrun does not read)."""
    fw = _framework(tags)
    flags = tags.get(schema.TAG_NUMERICS_XLA_FLAGS, "")
    key, read = _READERS.get(fw, (None, None))
    if key is None or read is None or key not in tags:
        return RunNumerics(False, fw, UNKNOWN, UNKNOWN, "", "", flags)
    states, changes = _states(tags)
    readings = [read(s) for s in states]
    mm, conv = readings[0].matmul, readings[0].conv
    for r in readings[1:]:
        mm, conv = _coarsest(mm, r.matmul), _coarsest(conv, r.conv)
    return RunNumerics(True, fw, mm, conv, readings[0].setting, readings[0].rerun, flags,
                       changes)


# --- comparing two runs ----------------------------------------------------------------------
@dataclass(frozen=True)
class Coarser:
    """One family of float32 operations a run carried out more coarsely than another by
    more than ``factor`` (a ratio of unit roundoffs): what, and both arithmetics."""

    what: str  # "matmuls" | "convolutions" | "matmuls and convolutions"
    run: Arithmetic
    other: Arithmetic
    assumed: bool = False  # the other run recorded nothing: taken as float32

    def text(self) -> str:
        other = ("recorded none (taken as float32)" if self.assumed else
                 f"ran as {self.other.name}")
        return f"float32 {self.what} as {self.run.name} where its pair's {other}"


def coarser(run: RunNumerics, other: RunNumerics, factor: float) -> list[Coarser]:
    """The families ``run`` carried out coarser than ``other`` by more than ``factor``
    (``2^(bits_other - bits_run) > factor``).  An ``other`` that recorded nothing counts
    as float32 (a reference recorded before numerics were); a ``run`` that recorded
    nothing is never coarser (nothing says it was)."""
    if not run.known:
        return []
    out = []
    for what, a, b in (("matmuls", run.matmul, other.matmul), ("convolutions", run.conv,
                                                                other.conv)):
        assumed = not (other.known and b.known)
        b = FLOAT32 if assumed else b
        if a.bits is not None and b.bits is not None and \
                2.0 ** (b.bits - a.bits) > factor:
            out.append(Coarser(what, a, b, assumed))
    if len(out) == 2 and (out[0].run, out[0].other) == (out[1].run, out[1].other):
        return [dataclasses.replace(out[0], what="matmuls and convolutions")]
    return out


_FRAMEWORK_PREFIX = {"jax": schema.NUMERICS_PREFIX + "jax.",
                     "torch": schema.NUMERICS_PREFIX + "torch.",
                     "torch_xla": schema.NUMERICS_PREFIX + "torch_xla."}


def _compared(key: str, fw: str, other_fw: str) -> bool:
    """Whether a numerics tag is compared between runs of frameworks ``fw`` and
    ``other_fw``: the flags and variables always; a framework's own settings only
    between runs that computed with that framework (a JAX setting in a PyTorch run's
    process says nothing about its arithmetic; the arithmetic lines compare those)."""
    own = [p for p in _FRAMEWORK_PREFIX.values() if key.startswith(p)]
    if not own:
        return True
    return fw == other_fw and _FRAMEWORK_PREFIX.get(fw, "\0") in own


def differences(candidate: Mapping[str, str], references: Mapping[str, Mapping[str, str]]
                ) -> list[dict[str, Any]]:
    """Where the candidate's numerics differ from the references': how float32 matmuls
    and convolutions were carried out (when either side recorded it; one line when both
    read alike), then every numerics tag both sides recorded with different values (a
    framework's own settings only between runs of that framework).  Each entry
    ``{"what", "candidate", "references": {run id: value}}``."""
    out: list[dict[str, Any]] = []
    c = of_run(candidate)
    rs = {rid: of_run(t) for rid, t in references.items()}
    if c.known or any(r.known for r in rs.values()):
        lines = []
        for what, get in (("float32 matmuls", lambda n: n.matmul),
                          ("float32 convolutions", lambda n: n.conv)):
            cv = _said(c, get(c))
            rv = {rid: _said(r, get(r)) for rid, r in rs.items()}
            lines.append({"what": what, "candidate": cv, "references": rv})
        mm, conv = lines
        if (mm["candidate"], mm["references"]) == (conv["candidate"], conv["references"]):
            lines = [{**mm, "what": "float32 matmuls and convolutions"}]
        out += [x for x in lines if any(v != x["candidate"] for v in x["references"].values())]
    for k in schema.NUMERICS_TAGS:
        if k not in candidate:
            continue
        rv = {rid: t[k] for rid, t in references.items()
              if k in t and _compared(k, c.framework, rs[rid].framework)}
        if rv and any(v != candidate[k] for v in rv.values()):
            out.append({"what": k, "candidate": candidate[k], "references": rv})
    return out


def _said(n: RunNumerics, a: Arithmetic) -> str:
    return f"{a.name} ({n.setting})" if n.known else "not recorded"


def bits_ratio(a: Arithmetic, b: Arithmetic) -> float:
    """``2^(bits_b - bits_a)``: how much coarser ``a``'s unit roundoff is (nan: unknown)."""
    if a.bits is None or b.bits is None:
        return math.nan
    return 2.0 ** (b.bits - a.bits)


def setting_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The ``refrun.numerics.*`` tags of a run (changes excluded), by name."""
    return {k: v for k, v in tags.items() if k in schema.NUMERICS_TAGS}


def join_values(values: Sequence[str]) -> str:
    """Distinct values in first-seen order, ``" | "``-joined (for one line)."""
    return " | ".join(dict.fromkeys(values))
