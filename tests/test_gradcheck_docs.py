"""The runnable example of docs/gradcheck.md runs and prints what the page says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "gradcheck.md"


def test_docs_example_runs(tmp_path):
    pytest.importorskip("jax", reason="JAX is an optional extra")
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    script = tmp_path / "example.py"  # a file: mean->sum recompiles functions from source
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, check=True, cwd=tmp_path).stdout
    assert "known_answer: 8 assertions passed (float32)" in out
    assert "FAIL JAX gradient oracle [w]: 0 vs expected 5" in out
    assert "\nwrong\n" in out
    assert "caught stop_gradient(arg0)" in out and "caught mean->sum" in out
