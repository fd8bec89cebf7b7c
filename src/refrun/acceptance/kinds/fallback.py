"""Criterion kind ``fallback``: its TOML model and its check, side by side."""

from __future__ import annotations

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import MAX_LISTED, Context, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("fallback")
class Fallback(Criterion):
    """no CPU-fallback operation outside the allowlist (tag refrun.fallback.ops, else the
    fallback/ops counter)"""

    allow: list[str] = key("operation names allowed to fall back, e.g. 'aten::nonzero'", [])

    def check(self, ctx: Context) -> CriterionResult:
        return fallback(self, ctx)


def fallback(c: Fallback, ctx: Context) -> CriterionResult:
    """CPU-fallback operations outside ``allow`` (op names from the probe's tag; the
    ``fallback/ops`` counter total when names are unknown)."""
    run = ctx.candidate
    ops = rv.tag_json(run, schema.TAG_FALLBACK_OPS)
    allow = set(c.allow)
    if isinstance(ops, dict):
        bad = {k: v for k, v in ops.items() if k not in allow and v}
        ev = {"source": schema.TAG_FALLBACK_OPS, "ops": ops, "allow": sorted(allow),
              "outside_allowlist": bad}
        if bad:
            return result(c, FAIL, f"{len(bad)} op(s) fell back to the CPU outside the "
                          f"allowlist: {', '.join(f'{k} x{v}' for k, v in sorted(bad.items()))}",
                          ev)
        return result(c, PASS, f"no fallback outside the allowlist ({len(ops)} op name(s) "
                      "recorded)", ev)
    r = rv.resolved(run, schema.M_FALLBACK_OPS, ctx.keep)
    if r is None:
        return result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has neither the "
                      f"{schema.TAG_FALLBACK_OPS} tag nor the {schema.M_FALLBACK_OPS!r} metric")
    f = rv.finite(r)
    total = float(f.values.sum())
    ev = {"source": schema.M_FALLBACK_OPS, "total": total, "allow": sorted(allow),
          "steps_with_fallback": f.steps[f.values > 0][:MAX_LISTED].tolist()}
    if total == 0:
        return result(c, PASS, f"{schema.M_FALLBACK_OPS} total 0 over {len(f.values)} steps",
                      ev)
    if allow:
        return result(c, NOT_EVALUABLE, f"{total:g} fallback op executions but their names "
                      f"are unknown (no {schema.TAG_FALLBACK_OPS} tag) to check the allowlist", ev)
    return result(c, FAIL, f"{total:g} CPU-fallback op executions (no allowlist)", ev)
