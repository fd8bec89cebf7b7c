"""MLflow's limits live in one module of refrun (:mod:`refrun.limits`), equal to MLflow's
own, and every MLflow tag name in one module (:mod:`refrun.schema`).

The expected values are MLflow's constants (``mlflow.utils.validation``) and its schema's
column types, never refrun's; the "nowhere else" checks read refrun's source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from refrun import limits

SRC = Path(__file__).resolve().parents[1] / "src" / "refrun"
HOME = {"limits.py", "schema.py"}


def _modules() -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(SRC.rglob("*.py"))]


@pytest.mark.parametrize("ours,theirs", sorted(limits.MLFLOW_NAMES.items()))
def test_each_limit_equals_mlflows(ours: str, theirs: str) -> None:
    from mlflow.utils import validation

    assert getattr(limits, ours) == getattr(validation, theirs)


def test_steps_are_mlflows_64_bit_column() -> None:
    import sqlalchemy as sa
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    for model in (SqlMetric, SqlLatestMetric):
        assert isinstance(model.__table__.c.step.type, sa.BigInteger)
    assert (limits.STEP_MIN, limits.STEP_MAX) == (-(2**63), 2**63 - 1)


def test_every_mlflow_limit_is_declared_in_one_module() -> None:
    """No other module names one of MLflow's limit constants, declares a constant of one
    of its lengths, cuts a string at such a length or a batch at such a size typed in."""
    lengths = {limits.KEY_LENGTH, limits.TAG_VALUE_LENGTH, limits.PARAM_VALUE_LENGTH,
               limits.EXPERIMENT_TAG_VALUE_LENGTH, 5000}  # 5000: the tag limit before 2.17
    batches = {limits.METRICS_PER_BATCH, limits.TAGS_PER_BATCH}
    mlflow_names = set(limits.MLFLOW_NAMES.values())

    def const(n: ast.AST | None, among: set[int]) -> bool:
        return isinstance(n, ast.Constant) and n.value in among

    found = []
    for rel, tree in _modules():
        if rel in HOME:
            continue
        for n in ast.walk(tree):
            what = None
            if isinstance(n, ast.Name | ast.Attribute):
                name = n.id if isinstance(n, ast.Name) else n.attr
                what = name if name in mlflow_names else None
            elif isinstance(n, ast.Assign) and const(n.value, lengths) and any(
                    isinstance(t, ast.Name) and t.id.isupper() for t in n.targets):
                what = ast.unparse(n)  # LIMIT = 8000
            elif isinstance(n, ast.Slice) and (const(n.upper, lengths) or (
                    isinstance(n.upper, ast.BinOp) and const(n.upper.right, batches))):
                what = ast.unparse(n)  # [:8000], [i:i + 1000]
            elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "range" \
                    and len(n.args) == 3 and const(n.args[2], batches):
                what = ast.unparse(n)  # range(0, n, 1000)
            if what is not None:
                found.append((rel, n.lineno, what))
    assert not found, found


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def test_every_mlflow_tag_name_is_typed_once_in_schema() -> None:
    """A tag name of MLflow's (``mlflow.utils.mlflow_tags``, and those refrun sets, from
    ``schema``) appears in code only in :mod:`refrun.schema` (docstrings may name them)."""
    import re

    from mlflow.utils import mlflow_tags

    from refrun import schema

    known = {v for mod in (mlflow_tags, schema) for v in vars(mod).values()
             if isinstance(v, str) and v.startswith("mlflow.")}
    assert "mlflow.runName" in known and "mlflow.sharedViewState." in known
    found = []
    for rel, tree in _modules():
        if rel == "schema.py":
            continue
        skip = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip:
                for word in re.findall(r"mlflow\.[A-Za-z0-9_.]+", n.value):
                    if word.rstrip(".") in known or any(
                            k.endswith(".") and word.startswith(k) for k in known):
                        found.append((rel, n.lineno, word))
    assert not found, found
