"""Structure of refrun.acceptance (issue 21, item 6): no import cycle between its modules
(imports at module level and inside functions alike; ``if TYPE_CHECKING:`` imports are
annotations, never executed), and one registry of criterion kinds, each model beside its
check."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
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
                subs = [f"{base}.{a.name}" for a in node.names
                        if f"{base}.{a.name}"[len(PKG) + 1:] in paths]
                # the module itself too when a name is no submodule of it
                names = subs + ([base] if len(subs) < len(node.names) else [])
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


def test_the_graph_sees_the_subpackages() -> None:
    graph = import_graph()
    assert "model" in graph["kinds.closeness"] and "checks" in graph["kinds.closeness"]
    assert "kinds" in graph["criteria"]
    # calibration: deriving, rendering and re-checking are separate layers; the re-check
    # rests on the assessment's own comparison
    assert graph["calibration.check"] >= {"comparing", "checks", "calibration.derive"}
    assert "calibration.check" not in graph["calibration.derive"]
    assert not {"calibration.derive", "calibration.check"} & graph["calibration.render"]


def test_every_kind_in_the_toml_schema_has_one_registered_definition_with_its_check() -> None:
    from refrun.acceptance.checks import Context, evaluate
    from refrun.acceptance.json_schema import shipped_schema_path
    from refrun.acceptance.kinds import KINDS
    from refrun.acceptance.model import Criterion

    defs = json.loads(shipped_schema_path().read_text(encoding="utf-8"))["$defs"]
    in_schema = sorted(k.split(".", 1)[1] for k in defs if k.startswith("criterion."))
    assert sorted(KINDS) == in_schema and len(in_schema) == 18
    for name, model in KINDS.items():
        assert name == model.KIND and issubclass(model, Criterion)
        assert "check" in vars(model), name  # its own check, not the base's
        # defined in its own module of refrun.acceptance.kinds, beside its check
        assert model.__module__ == f"{PKG}.kinds.{name}", model.__module__
        # what a kind needs looked up is a field of the context its check reads
        assert all(n in {f.name for f in fields(Context)} for n in model.NEEDS), name
    assert {k for k, m in KINDS.items() if m.NEEDS} == {"gradcheck", "paired"}
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


def test_kind_defines_a_frozen_keyword_only_model_documented_by_its_docstring() -> None:
    from dataclasses import FrozenInstanceError

    from refrun.acceptance.criteria import STOP_KINDS, StopRule
    from refrun.acceptance.kinds import KINDS, registry
    from refrun.acceptance.model import Criterion, key, kind

    @kind("two_keys", any_of=(("a", "b"),), needs={"pair"})
    class TwoKeys(Criterion):
        """a description written over
        two lines"""

        a: float | None = key("first", None)
        b: float | None = key("second", None)

        def check(self, ctx):  # pragma: no cover - never evaluated
            raise AssertionError

    assert (TwoKeys.KIND, TwoKeys.DOC) == ("two_keys", "a description written over two lines")
    assert (TwoKeys.ANY_OF, TwoKeys.ONE_OF) == ((("a", "b"),), ())
    assert sorted(TwoKeys.NEEDS) == ["pair"] and isinstance(TwoKeys.NEEDS, frozenset)
    t = TwoKeys(id="t", kind="two_keys", level="L1", a=1.0)
    with pytest.raises(FrozenInstanceError):
        t.a = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        TwoKeys("t", "two_keys", "L1")  # type: ignore[misc]  # keyword-only
    assert registry((TwoKeys,)) == {"two_keys": TwoKeys}
    # @kind runs once the class exists: a kind without its check still fails at definition
    with pytest.raises(TypeError, match="check"):
        @kind("no_check")
        class NoCheck(Criterion):
            """no check"""

    # a model not defined with @kind has no kind name: the registry refuses it
    @dataclass(frozen=True, kw_only=True)
    class Unnamed(Criterion):
        def check(self, ctx):  # pragma: no cover - never evaluated
            raise AssertionError

    with pytest.raises(TypeError, match="@kind"):
        registry((Unnamed,))
    # every registered kind and stopping rule is documented (the JSON Schema's description)
    for name, model in [*KINDS.items(), *STOP_KINDS.items()]:
        assert name == model.KIND and model.DOC and "\n" not in model.DOC, name
    assert all(issubclass(m, StopRule) for m in STOP_KINDS.values())


def test_a_kind_name_typo_is_one_line_naming_the_key() -> None:
    text = ('[[criteria]]\nid = "loss"\nkind = "closenes"\nlevel = "L1"\n'
            'metric = "loss"\nabs_tol = 0.1\n')
    with pytest.raises(RefrunInputError) as e:
        parse_criteria(text, "c.toml")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("c.toml:3: criteria[0].kind (id 'loss'): 'closenes' is not one "
                          "of: closeness, envelope,"), msg


# --- the typed evidence ---------------------------------------------------------------------
def _run(run_id: str, loss: np.ndarray, acc: float | None = None) -> RunData:
    steps = np.arange(len(loss))
    rows = {"metric": ["loss"] * len(loss), "step": steps, "value": loss}
    df = pd.DataFrame(rows)
    if acc is not None:
        df = pd.concat([df, pd.DataFrame({"metric": ["eval/acc"], "step": [len(loss) - 1],
                                          "value": [acc]})], ignore_index=True)
    return RunData.from_curves(df, run_id, tags={schema.TAG_BACKEND: "torch"})


def test_evidence_shape_round_trips_what_the_checks_write() -> None:
    from refrun.acceptance.checks import Context, evaluate
    from refrun.acceptance.comparing import run_comparison
    from refrun.acceptance.criterion_evidence import FirstDivergence, Interval

    n, depart = 40, 25
    base = np.linspace(2.0, 1.0, n)
    refs = [_run(f"r{i}", base + 0.01 * d, acc)
            for i, (d, acc) in enumerate([(-1, 0.80), (0, 0.82), (1, 0.81)])]
    cand_loss = base.copy()
    cand_loss[depart:] += 0.5  # leaves the band at step 25 and stays out (above)
    cand = _run("c", cand_loss, 0.81)
    crit = parse_criteria('''
[[criteria]]
id = "band"
kind = "envelope"
level = "L1"
metric = "loss"
k = 3.0
abs_tol = 0.01
[[criteria]]
id = "tost"
kind = "equivalence"
level = "L3"
metric = "eval/acc"
margin = 0.2
''')
    comparison, why = run_comparison(crit, refs, cand)
    ctx = Context(crit, refs, cand, comparison, why)
    band, tost = (evaluate(c, ctx) for c in crit.criteria)
    assert band.outcome == "fail"
    fd = FirstDivergence.of_result(band.evidence)
    assert fd is not None and (fd.step, fd.at, fd.direction) == (depart, depart, "above")
    assert (fd.outside_points, fd.points) == (n - depart, n)
    # the JSON written is the dataclass's, and reads back to the same value
    written = band.evidence[schema.EV_FIRST_DIVERGENCE]
    assert fd.to_dict() == written and list(written) == [
        "axis", "at", "step", "first_outside_at", "sustain", "direction", "outside_points",
        "points"]
    assert FirstDivergence.from_dict(json.loads(json.dumps(written))) == fd
    assert band.evidence[schema.EV_FIRST_DIVERGENCE_STEP] == depart
    iv = Interval.from_dict(tost.evidence)
    assert iv is not None and iv.n_reference == 3 and iv.interval is not None
    assert iv.to_dict() == {k: tost.evidence[k] for k in (schema.EV_INTERVAL,
                                                         schema.EV_N_REFERENCE)}
    lo, hi = iv.interval
    assert lo < 0.81 - np.mean([0.80, 0.82, 0.81]) < hi  # the CI holds the difference
    # evidence of a format before version 3 (no first_divergence) reads as "none"
    old = {k: v for k, v in band.evidence.items() if k != schema.EV_FIRST_DIVERGENCE}
    assert FirstDivergence.of_result(old) is None and Interval.from_dict({"k": 3}) is None


def test_paired_evidence_round_trips_in_the_order_written() -> None:
    from refrun.acceptance.criterion_evidence import PairedEvidence
    from refrun.acceptance.paired import PairJudgement

    j = PairJudgement(steps_compared=50, first_step=0, last_step=49,
                      first_divergence_step=12, divergence_at_first=0.3, band_at_first=0.1,
                      steps_outside=38, fraction_outside=0.76, max_ratio_observed=9.5,
                      step_of_max_ratio=40, divergence_at_last=0.5, band_at_last=0.2,
                      steps_beyond_band=0)
    pe = PairedEvidence(pair={"declared": "seed 1", "run_id": "r1", "source": "tag",
                              "problem": ""}, max_ratio=3.0, band_first_step=0,
                        band_last_step=49, pair_run="r1", pair_seed=1, judgement=j)
    d = json.loads(json.dumps(pe.to_dict()))
    assert list(d) == ["pair", "max_ratio", "band_first_step", "band_last_step", "pair_run",
                       "pair_seed", "steps_compared", "first_step", "last_step",
                       schema.EV_FIRST_DIVERGENCE_STEP, "divergence_at_first",
                       "band_at_first", "steps_outside", "fraction_outside",
                       "max_ratio_observed", "step_of_max_ratio", "divergence_at_last",
                       "band_at_last", "steps_beyond_band"]
    assert PairedEvidence.from_dict(d) == pe and pe.first_divergence_step == 12
    unjudged = PairedEvidence(pe.pair, 3.0, 0, 49)
    assert list(unjudged.to_dict()) == ["pair", "max_ratio", "band_first_step",
                                        "band_last_step"]
    assert PairedEvidence.from_dict(unjudged.to_dict()) == unjudged
    assert PairedEvidence.from_dict({"k": 3.0}) is None


def test_the_criteria_model_loads_without_the_check_stack() -> None:
    """Reading the criteria module (a command's --help, the JSON Schema's model) does not
    import the checks' comparison stack; the kinds load on first use."""
    code = ("import sys\nimport refrun.acceptance.criteria as c\n"
            "heavy = sorted(m for m in ('mlflow', 'pandas', 'scipy') if m in sys.modules)\n"
            "print(heavy, len(c.CRITERION_KINDS), c.Closeness.KIND)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "[] 18 closeness", out
