"""The architecture as a test: readers never load the recording stack, one client factory.

See docs/architecture.md for the layout and the one-way rule these check.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "refrun"


@pytest.mark.parametrize("reader", ["refrun.comparison", "refrun.report", "refrun.store",
                                    "refrun.store.client", "refrun.runs"])
def test_readers_do_not_import_the_recording_stack(reader: str) -> None:
    code = (f"import sys, {reader}\n"
            "print(sorted(m for m in sys.modules if m.startswith('refrun.recording')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC.parent), "PATH": ""})
    assert out.stdout.strip() == "[]", out.stdout


def _calls_named(tree: ast.AST, name: str) -> int:
    return sum(isinstance(n, ast.Call) and (
        getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
        for n in ast.walk(tree))


def test_one_module_constructs_mlflow_clients() -> None:
    makers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                    if _calls_named(ast.parse(p.read_text(encoding="utf-8")), "MlflowClient"))
    assert makers == ["store/client.py"]
