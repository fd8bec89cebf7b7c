"""The architecture as a test: readers never load the recording stack, one client factory.

See docs/architecture.md for the layout and the one-way rule these check.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "refrun"


@pytest.mark.parametrize("reader", ["refrun.comparison", "refrun.report", "refrun.store",
                                    "refrun.store.client", "refrun.store.runs"])
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


# --- the import graph -------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(m) for n in ast.walk(tree)
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for m in ast.walk(n)}


def _imports(name: str, path: Path) -> set[str]:
    """refrun modules ``name`` imports anywhere (functions included: a lazy import is still
    a dependency), except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    found: list[str] = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            found += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (n.level - 1)]
                base = ".".join(pkg + ([n.module] if n.module else []))
            subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in MODULES]
            if len(subs) < len(n.names):
                found.append(base)  # names from the module itself, not only submodules
            found += subs
    out = set()
    for m in found:
        while m not in MODULES and "." in m:
            m = m.rsplit(".", 1)[0]
        if m in MODULES and m != name:
            out.add(m)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def unit(module: str) -> str:
    """The package or top-level module a module belongs to (``refrun.store.client`` ->
    ``store``; ``refrun`` itself -> ``refrun``, the public API)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "refrun"


# The one-way rule (docs/architecture.md): each unit and the units it may import.
VOCABULARY = {"_version", "errors", "schema", "keys", "limits", "settings", "identity",
              "pairing", "numerics", "util"}
STORE = VOCABULARY | {"store"}
READERS = STORE | {"comparison"}
FRAMEWORKS = STORE | {"recording", "probes", "refrun"}
ALLOWED: dict[str, set[str]] = {
    **{v: VOCABULARY for v in VOCABULARY},
    "util": set(),  # pure helpers: no refrun import at all
    "store": VOCABULARY,
    "recording": STORE,
    "importers": STORE,
    "gradcheck": STORE,
    "comparison": STORE,
    "acceptance": READERS | {"gradcheck"},
    "report": READERS | {"acceptance"},
    "probes": STORE | {"recording", "refrun"},
    "torch": FRAMEWORKS, "xla": FRAMEWORKS, "jax": FRAMEWORKS,
    "lightning": FRAMEWORKS | {"torch"},
    "hf": FRAMEWORKS | {"torch"},
    "keras": FRAMEWORKS | {"jax", "torch"},
    "testing": FRAMEWORKS | {"gradcheck"},
    "cli": READERS | {"acceptance", "report", "importers", "gradcheck", "recording",
                      "refrun"},
    "refrun": STORE | {"recording"},
    "__main__": {"cli"},
}
# Known exceptions, each to be removed (named, never a blanket skip).  None left: gradient
# checks are complete runs (refrun.store.complete) and the in-loop watcher names the
# session in annotations only.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# The acceptance/ cycles are gone (criterion registry, acceptance.comparing): none known.
KNOWN_CYCLES: list[set[str]] = []


def test_every_unit_has_a_place_in_the_one_way_rule() -> None:
    assert {unit(m) for m in MODULES} <= set(ALLOWED), \
        "a new package or top-level module: give it a place in ALLOWED and the docs"


def test_no_upward_import_between_packages() -> None:
    bad = sorted((m, t) for m, targets in GRAPH.items() for t in targets
                 if unit(t) != unit(m) and unit(t) not in ALLOWED.get(unit(m), set())
                 and (m, t) not in KNOWN_UPWARD)
    assert not bad, "imports against the one-way rule (docs/architecture.md): " + str(bad)
    stale = {e for e in KNOWN_UPWARD if e[1] not in GRAPH.get(e[0], set())}
    assert not stale, f"fixed: remove {stale} from KNOWN_UPWARD"


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unknown, f"import cycles: {unknown}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not stale, f"removed or changed: update KNOWN_CYCLES ({stale})"


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# --- one home per name ------------------------------------------------------------------
def _docstring_nodes(tree: ast.AST) -> set[int]:
    return {id(body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and (body := n.body) and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)}


def test_every_refrun_name_is_defined_in_schema_only() -> None:
    """A tag, artifact or format name (``"refrun.…"`` with no space) written outside
    schema.py is a second definition waiting for a rename.  Module paths
    (``"refrun.cli.runs"``) are not names of the store."""
    name = re.compile(r"refrun\.[A-Za-z0-9_.]*")
    found = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "schema.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstring_nodes(tree)
        found += [f"{path.relative_to(SRC)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and id(n) not in docs and name.fullmatch(n.value)
                  and n.value.rstrip(".") not in MODULES]
    assert not found, "define these in refrun/schema.py: " + "; ".join(found)


def test_schema_defines_each_name_once() -> None:
    from refrun import schema

    names = [(k, v) for k, v in vars(schema).items()
             if k.isupper() and isinstance(v, str) and v.startswith(("refrun.", "mlflow."))]
    values = [v for _, v in names]
    assert len(values) == len(set(values)), sorted(
        (k, v) for k, v in names if values.count(v) > 1)
    text = (SRC / "schema.py").read_text(encoding="utf-8")
    assigned = re.findall(r"^([A-Z][A-Z0-9_]*) = ", text, re.M)
    assert len(assigned) == len(set(assigned)), "a name assigned twice in schema.py"
