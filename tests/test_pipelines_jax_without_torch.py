"""The pipelines' JAX ports run where torch is not installed (a TPU VM's index has no
torch_xla and only a CPU torch): importing them must not import torch (docs/tpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("workload", ["digits", "charlm", "markov"])
def test_jax_port_imports_without_torch(workload: str) -> None:
    # sys.modules[name] = None makes `import name` raise ImportError, as on a machine
    # without the package; the check fails if the port (or what it imports) needs torch.
    code = ("import sys\n"
            "for m in ('torch', 'torch_xla'): sys.modules[m] = None\n"
            f"import pipelines.{workload}.train_jax as port\n"
            "assert callable(port.main)\n"
            "assert not any(k == 'torch' or k.startswith('torch.') for k in sys.modules "
            "if sys.modules[k] is not None)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
