"""Structure of refrun.acceptance (issue 21, item 6): no import cycle between its modules
(imports at module level and inside functions alike; ``if TYPE_CHECKING:`` imports are
annotations, never executed), and every criterion kind has its check."""

from __future__ import annotations

import ast
from pathlib import Path

import refrun.acceptance as pkg

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


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time."""
    mods = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods:
        tree = ast.parse((ROOT / f"{m}.py").read_text(encoding="utf-8"))
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.module == PKG:
                names = [f"{PKG}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            for name in names:
                if name.startswith(PKG + "."):
                    target = name[len(PKG) + 1:].split(".")[0]
                    if target in mods and target != m:
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


def test_every_criterion_kind_has_its_check() -> None:
    from refrun.acceptance.checks import CHECKS
    from refrun.acceptance.criteria import CRITERION_KINDS

    assert set(CRITERION_KINDS) == set(CHECKS)
