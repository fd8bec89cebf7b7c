"""What a run records about where and how it ran: framework versions, device, git, environment.

Everything here is collected once at run start, off the training step, and never
imports a framework that the process has not imported itself (importing torch or jax
just to read a version would cost seconds and could initialise a device).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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
