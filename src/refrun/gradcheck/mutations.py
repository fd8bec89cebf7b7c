"""Mutated copies of a loss function, and the self-test that a gate rejects them.

A check is only worth running if it fails on the defect it exists for (seed 000: "a gate
should demonstrate that it can reject its intended defect").  The mutations:

* :func:`stop_gradient_on` / :func:`detach_on`: the function with
  ``jax.lax.stop_gradient`` / ``Tensor.detach()`` applied to one input (an argument, or
  one named leaf of a parameter tree) — forward value unchanged, derivative blocked.
* :func:`mean_to_sum`: the function recompiled from its source with every ``mean``
  reduction (``jnp.mean``, ``x.mean()``, ``torch.mean``, ``reduction="mean"``) turned into
  ``sum``.

:func:`self_test_gate` runs a check on the original function (it must pass) and on each
mutation (it must fail) and reports which mutations were caught.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refrun.errors import RefrunInputError
from refrun.gradcheck import named as nm


@dataclass(frozen=True)
class Mutation:
    """A named way of breaking a function: ``apply(fn) -> mutated fn``."""

    name: str
    description: str
    apply: Callable[[Callable[..., Any]], Callable[..., Any]]


def stop_gradient_on(fn: Callable[..., Any], argnum: int = 0,
                     name: str | None = None) -> Callable[..., Any]:
    """``fn`` with ``jax.lax.stop_gradient`` on argument ``argnum`` (or, when ``name`` is
    given, only on that dotted-name leaf of the argument's tree)."""
    def block(x: Any) -> Any:
        import jax

        return jax.lax.stop_gradient(x)

    return _blocked(fn, argnum, name, block, "stop_gradient")


def detach_on(fn: Callable[..., Any], argnum: int = 0,
              name: str | None = None) -> Callable[..., Any]:
    """``fn`` with ``.detach()`` on argument ``argnum`` (or one named leaf of it)."""
    return _blocked(fn, argnum, name, lambda x: x.detach(), "detach")


def _blocked(fn: Callable[..., Any], argnum: int, name: str | None,
             block: Callable[[Any], Any], what: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def mutated(*args: Any, **kwargs: Any) -> Any:
        if argnum >= len(args):
            raise RefrunInputError(f"{what} on argument {argnum}: {fn.__name__} got only "
                                   f"{len(args)} positional arguments")
        args = list(args)
        args[argnum] = _block_tree(args[argnum], name, block, what)
        return fn(*args, **kwargs)

    mutated.__refrun_mutation__ = f"{what}(arg {argnum}{'.' + name if name else ''})"
    return mutated


def _block_tree(tree: Any, name: str | None, block: Callable[[Any], Any], what: str) -> Any:
    if nm.is_torch_module(tree):
        raise RefrunInputError(f"{what}: cannot block a module's parameter in place; pass "
                               "the parameters as a dict (torch.func.functional_call)")
    leaves = nm.flatten(tree)
    if name is None:
        return nm.unflatten(tree, {k: block(v) for k, v in leaves.items()})
    if name not in leaves:
        raise RefrunInputError(f"{what}: parameter {name!r} not found "
                               f"(have {', '.join(leaves)})")
    return nm.unflatten(tree, {k: block(v) if k == name else v for k, v in leaves.items()})


class _MeanToSum(ast.NodeTransformer):
    def __init__(self) -> None:
        self.changed = 0

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "mean":
            node.func.attr = "sum"
            self.changed += 1
        for kw in node.keywords:
            if kw.arg == "reduction" and isinstance(kw.value, ast.Constant) \
                    and kw.value.value == "mean":
                kw.value = ast.copy_location(ast.Constant("sum"), kw.value)
                self.changed += 1
        return node


def mean_to_sum(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` recompiled with every ``mean`` reduction replaced by ``sum``.

    Works on ``def`` functions whose source is available (closures see their captured
    values).  Raises :class:`RefrunInputError` when there is no source or no ``mean``.
    """
    target = inspect.unwrap(fn)
    try:
        src = textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError) as exc:
        raise RefrunInputError(f"mean_to_sum: no source for {fn!r} ({exc})") from None
    tree = ast.parse(src)
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef):
        raise RefrunInputError(f"mean_to_sum: {getattr(fn, '__name__', fn)!r} is not a def "
                               "function (lambdas are not supported)")
    fdef.decorator_list = []
    tr = _MeanToSum()
    tr.visit(fdef)
    if not tr.changed:
        raise RefrunInputError(f"mean_to_sum: no mean reduction in {target.__name__}")
    ns = dict(target.__globals__)
    if target.__closure__:
        ns.update({v: c.cell_contents for v, c in zip(target.__code__.co_freevars,
                                                       target.__closure__, strict=True)})
    code = compile(ast.fix_missing_locations(tree), inspect.getsourcefile(target) or "<mut>",
                   "exec")
    exec(code, ns)  # the user's own function, recompiled with one reduction changed
    mutated = ns[fdef.name]
    mutated.__refrun_mutation__ = "mean->sum"
    return mutated


def stop_gradient_mutation(argnum: int = 0, name: str | None = None) -> Mutation:
    where = f"argument {argnum}" + (f" leaf {name!r}" if name else "")
    return Mutation(f"stop_gradient({name or f'arg{argnum}'})",
                    f"jax.lax.stop_gradient on {where}",
                    lambda f: stop_gradient_on(f, argnum, name))


def detach_mutation(argnum: int = 0, name: str | None = None) -> Mutation:
    where = f"argument {argnum}" + (f" leaf {name!r}" if name else "")
    return Mutation(f"detach({name or f'arg{argnum}'})", f".detach() on {where}",
                    lambda f: detach_on(f, argnum, name))


MEAN_TO_SUM = Mutation("mean->sum", "every mean reduction replaced by sum", mean_to_sum)


@dataclass(frozen=True)
class MutationOutcome:
    mutation: str
    caught: bool
    detail: str


@dataclass
class GateSelfTest:
    """Whether ``check`` passes the original and rejects every mutation."""

    check: str
    baseline_passed: bool
    baseline_detail: str
    outcomes: list[MutationOutcome] = field(default_factory=list)
    kind = "self_test"

    @property
    def passed(self) -> bool:
        return self.baseline_passed and all(o.caught for o in self.outcomes)

    @property
    def label(self) -> str:
        return self.check

    def summary(self) -> str:
        rows = [f"{self.check}: baseline {'passes' if self.baseline_passed else 'FAILS'}"]
        rows += [f"  {'caught' if o.caught else 'MISSED'} {o.mutation}: {o.detail}"
                 for o in self.outcomes]
        return "\n".join(rows)

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise AssertionError(self.summary())

    def record_metrics(self) -> dict[str, float]:
        out = {f"{o.mutation}/caught": float(o.caught) for o in self.outcomes}
        out["baseline_passed"] = float(self.baseline_passed)
        out["passed"] = float(self.passed)
        return out


def _verdict(result: Any) -> tuple[bool, str]:
    if isinstance(result, bool):
        return result, "passed" if result else "failed"
    summary = result.summary() if hasattr(result, "summary") else str(result)
    return bool(result.passed), summary.splitlines()[0][:300]


def self_test_gate(check: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any],
                   mutations: Sequence[Mutation], name: str = "check") -> GateSelfTest:
    """Run ``check(fn)`` (must pass) and ``check(mutation.apply(fn))`` for each mutation
    (must fail).  ``check`` returns a bool or a result with ``.passed``; an exception
    raised on a mutated function counts as a rejection and is reported; a mutation that
    cannot be applied to ``fn`` (e.g. mean->sum without source) counts as missed."""
    ok, detail = _verdict(check(fn))
    out = GateSelfTest(check=name, baseline_passed=ok, baseline_detail=detail)
    for m in mutations:
        try:
            mutated = m.apply(fn)
        except RefrunInputError as exc:  # an untested mutation is a gap, not a pass
            out.outcomes.append(MutationOutcome(m.name, caught=False,
                                                detail=f"not applied: {exc}"[:300]))
            continue
        try:
            passed, detail = _verdict(check(mutated))
        except (AssertionError, RefrunInputError, FloatingPointError, RuntimeError) as exc:
            passed, detail = False, f"raised {type(exc).__name__}: {exc}"[:300]
        out.outcomes.append(MutationOutcome(m.name, caught=not passed, detail=detail))
    return out
