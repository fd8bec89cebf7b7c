"""What a run records about where and how it ran: framework versions, device, git, environment,
and the vocabulary of its identity names (backend, role, hardware) with their normalisers.

Everything here is collected once at run start, off the training step, and never
imports a framework that the process has not imported itself (importing torch or jax
just to read a version would cost seconds and could initialise a device).
"""

from __future__ import annotations

import importlib.metadata as md
import numbers
import os
import platform
import re
import socket
import subprocess
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

from refrun import numerics, schema
from refrun.errors import RefrunInputError

FRAMEWORKS = ("torch", "torch_xla", "jax", "jaxlib", "mlflow", "numpy", "pandas")


def framework_versions() -> dict[str, str]:
    """Installed versions of the frameworks refrun knows, plus Python (``name -> version``)."""
    out = {"python": platform.python_version()}
    for name in FRAMEWORKS:
        try:
            out[name] = md.version(name.replace("_", "-")) if name != "torch_xla" else md.version(
                "torch_xla"
            )
        except md.PackageNotFoundError:
            continue
    return out


def device_description() -> str:
    """A human description of the compute the process sees, without initialising anything new.

    Frameworks already imported by the process are asked; others are not imported.
    """
    parts: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            # get_device_name would create a CUDA context; only ask once CUDA is in use.
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                name = torch.cuda.get_device_name(0) if torch.cuda.is_initialized() else "?"
                parts.append(f"cuda x{n}: {name}")
        except Exception:  # a broken CUDA install must not stop the run
            pass
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            devs = jax.devices()
            parts.append(f"jax {jax.default_backend()} x{len(devs)}: {devs[0].device_kind}")
        except Exception:
            pass
    cpu = platform.processor() or platform.machine()
    parts.append(f"cpu: {cpu} x{os.cpu_count()}")
    return "; ".join(parts)


def git_state(path: Path | None = None) -> dict[str, str]:
    """Commit and dirtiness of the git tree containing ``path`` (default: the main script)."""
    if path is None:
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        path = Path(main_file).resolve().parent if main_file else Path.cwd()
    try:
        commit = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": "true" if dirty else "false"}


def environment_tags() -> dict[str, str]:
    """The tags describing this process (device, host, framework versions, git state of
    the main script, numerics configuration: :func:`refrun.numerics.current`), for a run
    this process made: a live run or a gradient check."""
    tags = {schema.TAG_DEVICE: device_description(), schema.TAG_HOST: socket.gethostname()}
    tags.update(numerics.current())
    tags.update({schema.TAG_FW_PREFIX + k: v for k, v in framework_versions().items()})
    git = git_state()
    if git:
        tags[schema.TAG_GIT_COMMIT] = git["commit"]
        tags[schema.TAG_GIT_DIRTY] = git["dirty"]
    return tags


def environment_snapshot() -> dict[str, Any]:
    """Installed packages, Python and OS, for the ``refrun/environment.json`` artifact."""
    packages = sorted(
        {(d.metadata["Name"] or "?", d.version) for d in md.distributions()},
        key=lambda p: p[0].lower(),
    )
    return {
        "python": sys.version,
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "packages": {name: version for name, version in packages},
        "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "PJRT_", "JAX_",
                                                                     "CUDA_", "TPU_"))},
    }


# --- identity names: backend, role, hardware (area: trust, no silent pass) ------------------
# A free-text name is a silent way to a wrong verdict: a candidate tagged ``torch-xla`` made
# every criterion scoped to ``torch_xla`` "not applicable", so its host syncs passed.  Every
# place a name enters (run start, criteria files) goes through the normalisers below: a
# known alias becomes the canonical name, anything else is a one-line RefrunInputError.

Backend = Literal["torch", "torch_xla", "jax", "tensorflow", "numpy", "import",
                  "comparison", "acceptance"]
#: Canonical ``refrun.backend`` values: the framework that executed the step (``numpy``: a
#: plain-numpy oracle, e.g. gradcheck's), or what made the run (``import``: converted from
#: a file; ``comparison``/``acceptance``: refrun's own records).
BACKENDS: tuple[Backend, ...] = typing.get_args(Backend)
#: Spellings seen in the wild -> canonical name (looked up after lower-casing and turning
#: ``-``, ``.`` and spaces into ``_``).  ``xla`` alone is deliberately absent: JAX runs on
#: XLA too.
BACKEND_ALIASES: dict[str, Backend] = {
    "pytorch": "torch", "pt": "torch",
    "pytorch_xla": "torch_xla", "ptxla": "torch_xla", "torchxla": "torch_xla",
    "pt_xla": "torch_xla", "torch/xla": "torch_xla",
    "flax": "jax", "jax_numpy": "jax",
    "tf": "tensorflow", "keras_tensorflow": "tensorflow",
    "imported": "import",
}
#: ``refrun.role`` aliases (roles themselves: :data:`refrun.schema.ROLES`).
ROLE_ALIASES: dict[str, str] = {"ref": "reference", "baseline": "reference",
                                "cand": "candidate", "compare": "comparison"}
#: Hardware kinds refrun knows by name.  Hardware is open-ended (new chips appear every
#: year), so any name of the :data:`HARDWARE_PATTERN` form is accepted too; these are the
#: names a message suggests and the aliases below map onto.
HARDWARE_KINDS = ("cpu", "host", "gpu", "cuda", "rocm", "mps", "tpu", "neuron",
                  "a100", "h100", "h200", "b200", "l4", "nvidia-l4", "t4", "v100", "a10g",
                  "mi250x", "mi300x", "mi350x", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")
HARDWARE_ALIASES = {"x86_64": "cpu", "amd64": "cpu", "aarch64": "cpu", "arm64": "cpu"}
#: A hardware name after normalisation (lower case; spaces and ``_`` become ``-``):
#: lower-case letters and digits in groups joined by single ``-`` or ``.``, at most 64
#: characters, e.g. ``a100``, ``a100-80gb``, ``tpu-v5e``, ``v5e``, ``nvidia-l4``.
HARDWARE_PATTERN = re.compile(r"[a-z0-9]+(?:[.-][a-z0-9]+)*")
_HARDWARE_MAX = 64


def _key(name: str) -> str:
    return re.sub(r"[\s.\-]+", "_", name.strip().lower())


def canonical_backend(name: str | None) -> Backend | None:
    """The canonical backend for ``name`` (alias-aware, case-insensitive), None when it
    is absent or not a known backend.  For reading stored tags, which may predate
    validation."""
    if not isinstance(name, str) or not name.strip():
        return None
    k = _key(name)
    if k in BACKENDS:
        return k  # type: ignore[return-value]
    return BACKEND_ALIASES.get(k) or BACKEND_ALIASES.get(name.strip().lower())


def normalize_backend(name: str, what: str = "backend") -> Backend:
    """The canonical backend for ``name``; raises :class:`RefrunInputError` (one line,
    naming ``what`` and every valid name) when it is not a known backend or alias."""
    canonical = canonical_backend(name)
    if canonical is None:
        raise RefrunInputError(
            f"{what}: {name!r} is not a known backend (valid: {', '.join(BACKENDS)}; "
            f"aliases: {', '.join(sorted(BACKEND_ALIASES))})")
    return canonical


def normalize_role(name: str, what: str = "role") -> str:
    """The canonical role for ``name`` (:data:`refrun.schema.ROLES` or an alias of
    :data:`ROLE_ALIASES`, case-insensitive); raises :class:`RefrunInputError` otherwise."""
    k = name.strip().lower() if isinstance(name, str) else ""
    if k in schema.ROLES:
        return k
    if k in ROLE_ALIASES:
        return ROLE_ALIASES[k]
    raise RefrunInputError(f"{what}: {name!r} is not a known role (valid: "
                           f"{', '.join(schema.ROLES)}; aliases: {', '.join(ROLE_ALIASES)})")


def canonical_hardware(name: str | None) -> str | None:
    """``name`` in canonical form (lower case, spaces and ``_`` as ``-``, aliases mapped),
    None when absent or not of the :data:`HARDWARE_PATTERN` form."""
    if not isinstance(name, str) or not name.strip():
        return None
    k = re.sub(r"[\s_]+", "-", name.strip().lower())
    k = HARDWARE_ALIASES.get(k.replace("-", "_"), k)
    if len(k) > _HARDWARE_MAX or not HARDWARE_PATTERN.fullmatch(k):
        return None
    return k


def normalize_hardware(name: str, what: str = "hardware") -> str:
    """The canonical hardware name (see :data:`HARDWARE_PATTERN`); raises
    :class:`RefrunInputError` naming the rule and the known kinds otherwise."""
    canonical = canonical_hardware(name)
    if canonical is None:
        raise RefrunInputError(
            f"{what}: {name!r} is not a hardware name (lower-case letters and digits joined "
            f"by '-' or '.', at most {_HARDWARE_MAX} characters; known kinds: "
            f"{', '.join(HARDWARE_KINDS)})")
    return canonical


class IdentityNames(NamedTuple):
    """The validated, canonical names of a run's identity (unpacks as a tuple)."""

    role: str
    backend: Backend | None
    hardware: str | None


def validate_identity(role: str, backend: str | None, hardware: str | None
                      ) -> IdentityNames:
    """Validate and normalise the names a run starts with (one call from ``start_run``):
    ``role`` is required; ``backend`` and ``hardware`` are optional (None: not declared)."""
    return IdentityNames(normalize_role(role),
                         None if backend is None else normalize_backend(backend),
                         None if hardware is None else normalize_hardware(hardware))


def require_int_or_none(name: str, value: object) -> None:
    """Raise :class:`RefrunInputError` unless ``value`` is None or an integer (not a bool)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise RefrunInputError(f"{name}: expected an integer, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunIdentity:
    """Who a run is: the values its ``refrun.*`` identity tags are made of, validated once.

    Shared by both ways of writing a run (the live session and complete runs: imports,
    comparisons, assessments), so a run is found and compared by the same tags however it
    was written.  Invalid values raise :class:`RefrunInputError` from ``__post_init__``;
    role, backend and hardware are stored in canonical form (aliases normalised).
    """

    workload: str
    """Workload name (``refrun.workload``); also the default experiment name."""
    role: str
    """One of :data:`refrun.schema.ROLES` (aliases such as ``ref`` accepted)."""
    hardware: str | None = None
    """Where it ran (``refrun.hardware``): a kind of :data:`HARDWARE_KINDS` or a model name."""
    backend: str | None = None
    """Framework path (``refrun.backend``): one of :data:`refrun.schema.BACKENDS`."""
    seed: int | None = None
    chips: int | None = None
    """Accelerator chips (or processes) the run used."""
    global_batch: int | None = None
    """Samples per optimizer step over all chips."""
    planned_steps: int | None = None
    """Steps the run is meant to take (lets a reader tell "short" from "still running")."""

    def __post_init__(self) -> None:
        if not self.workload or not isinstance(self.workload, str):
            raise RefrunInputError("workload: a non-empty name is required")
        names = validate_identity(self.role, self.backend, self.hardware)
        object.__setattr__(self, "role", names.role)
        object.__setattr__(self, "backend", names.backend)
        object.__setattr__(self, "hardware", names.hardware)
        for name in ("seed", "chips", "global_batch", "planned_steps"):
            require_int_or_none(name, getattr(self, name))

    def tags(self) -> dict[str, str]:
        """The run's identity tags (schema version, refrun version and source included)."""
        from refrun._version import __version__

        tags = {
            schema.TAG_SCHEMA: schema.SCHEMA_VERSION,
            schema.TAG_WORKLOAD: self.workload,
            schema.TAG_ROLE: self.role,
            schema.TAG_VERSION: __version__,
            schema.TAG_MLFLOW_SOURCE: schema.SOURCE_NAME,
        }
        optional = {
            schema.TAG_HARDWARE: self.hardware, schema.TAG_BACKEND: self.backend,
            schema.TAG_SEED: self.seed, schema.TAG_CHIPS: self.chips,
            schema.TAG_GLOBAL_BATCH: self.global_batch,
            schema.TAG_PLANNED_STEPS: self.planned_steps,
        }
        tags.update({k: str(v) for k, v in optional.items() if v is not None})
        return tags


# --- one workload per verdict (area: trust) -------------------------------------------------
class Identified(Protocol):
    """A run as the workload check sees it (``refrun.comparison.RunData`` is one)."""

    @property
    def run_id(self) -> str: ...

    @property
    def workload(self) -> str | None: ...


def check_workloads(candidate: Identified, references: Sequence[Identified],
                    criteria_workload: str = "", criteria_path: str = "",
                    allow: bool = False) -> str:
    """Refuse to judge a candidate of another workload than its criteria file's and its
    references' (a criteria file for workload A says nothing about workload B, so "pass"
    would be silent nonsense).

    Compared by exact ``refrun.workload`` tag; a run without the tag counts as different
    (its workload is unknown).  The criteria file's ``workload`` key is compared when set.

    Returns:
        "" when every workload agrees; otherwise, with ``allow``, a one-line note saying
        which differ (for the verdict and the JSON).
    Raises:
        RefrunInputError: they differ and ``allow`` is False.
    """
    want = candidate.workload
    odd = [f"reference {r.run_id} is {r.workload!r}" for r in references
           if r.workload != want]
    if criteria_workload and criteria_workload != want:
        odd.insert(0, f"criteria file {criteria_path or '<criteria>'} is for "
                      f"{criteria_workload!r}")
    if not odd:
        return ""
    note = f"candidate {candidate.run_id} is workload {want!r} but " + "; ".join(odd)
    if not allow:
        raise RefrunInputError(f"{note}: refusing to compare across workloads "
                               "(--allow-cross-workload to do it anyway, said in the verdict)")
    return f"cross-workload ({note}), allowed by --allow-cross-workload"
