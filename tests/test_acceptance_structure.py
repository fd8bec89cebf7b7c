"""Structure of refrun.acceptance (issue 21, item 6): no import cycle between its modules
(imports at module level and inside functions alike; ``if TYPE_CHECKING:`` imports are
annotations, never executed), and one registry of criterion kinds, each model beside its
check."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd
import pytest

import refrun.acceptance as pkg
from refrun import schema
from refrun.acceptance.criteria import parse_criteria
from refrun.comparison import RunData
from refrun.errors import RefrunInputError

PKG = "refrun.acceptance"
ROOT = Path(pkg.__file__).parent


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run (not under ``if TYPE_CHECKING:``)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def _module(path: Path) -> str:
    """``kinds/closeness.py`` -> ``kinds.closeness``; ``kinds/__init__.py`` -> ``kinds``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (subpackages included:
    ``kinds.closeness``; the package ``__init__`` itself is left out)."""
    paths = {_module(p): p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for m, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                if not name.startswith(PKG + "."):
                    continue
                target = name[len(PKG) + 1:]
                while target not in paths and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in paths and target != m:
                    graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by depth-first search (each reported once)."""
    found: set[tuple[str, ...]] = set()

    def dfs(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cyc = path[path.index(nxt):]
                i = cyc.index(min(cyc))
                found.add(tuple(cyc[i:] + cyc[:i]))
            elif len(path) < len(graph):
                dfs(nxt, [*path, nxt])

    for start in sorted(graph):
        dfs(start, [start])
    return [list(c) for c in sorted(found)]


def test_no_import_cycle_inside_acceptance() -> None:
    graph = import_graph()
    assert cycles(graph) == [], cycles(graph)
    # The finder finds a cycle when there is one (the shape assess <-> calibration had).
    assert cycles({"assess": {"calibration"}, "calibration": {"assess"}}) == [
        ["assess", "calibration"]]


def test_the_graph_sees_the_kinds_subpackage() -> None:
    graph = import_graph()
    assert "model" in graph["kinds.closeness"] and "checks" in graph["kinds.closeness"]
    assert "kinds" in graph["criteria"]


def test_every_kind_in_the_toml_schema_has_one_registered_definition_with_its_check() -> None:
    from refrun.acceptance.checks import Context, evaluate
    from refrun.acceptance.json_schema import shipped_schema_path
    from refrun.acceptance.kinds import KINDS
    from refrun.acceptance.model import Criterion

    defs = json.loads(shipped_schema_path().read_text(encoding="utf-8"))["$defs"]
    in_schema = sorted(k.split(".", 1)[1] for k in defs if k.startswith("criterion."))
    assert sorted(KINDS) == in_schema and len(in_schema) == 14
    for name, model in KINDS.items():
        assert name == model.KIND and issubclass(model, Criterion)
        assert "check" in vars(model), name  # its own check, not the base's
        # defined in its own module of refrun.acceptance.kinds, beside its check
        assert model.__module__ == f"{PKG}.kinds.{name}", model.__module__
    # evaluate dispatches to the kind's own check (no table of kind names elsewhere)
    crit = parse_criteria(
        '[[criteria]]\nid = "hw"\nkind = "hardware"\nlevel = "L2"\nexpected = "tpu"\n')
    curves = pd.DataFrame({"metric": ["loss"], "step": [0], "value": [1.0]})
    run = RunData.from_curves(curves, "c1", tags={schema.TAG_EXEC_HARDWARE: "cpu"})
    r = evaluate(crit.criteria[0], Context(crit, [run], run, None))
    assert (r.kind, r.outcome) == ("hardware", "fail") and "expected 'tpu'" in r.reason


def test_a_kind_without_its_check_cannot_be_defined() -> None:
    from refrun.acceptance.kinds import registry
    from refrun.acceptance.kinds.closeness import Closeness
    from refrun.acceptance.model import Criterion

    with pytest.raises(TypeError, match="check"):
        @dataclass(frozen=True, kw_only=True)
        class NoCheck(Criterion):
            KIND: ClassVar[str] = "no_check"
    with pytest.raises(TypeError, match="registered twice"):
        registry((Closeness, Closeness))


def test_a_kind_name_typo_is_one_line_naming_the_key() -> None:
    text = ('[[criteria]]\nid = "loss"\nkind = "closenes"\nlevel = "L1"\n'
            'metric = "loss"\nabs_tol = 0.1\n')
    with pytest.raises(RefrunInputError) as e:
        parse_criteria(text, "c.toml")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("c.toml:3: criteria[0].kind (id 'loss'): 'closenes' is not one "
                          "of: closeness, envelope,"), msg
