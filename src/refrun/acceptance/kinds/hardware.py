"""Criterion kind ``hardware``: its TOML model and its check, side by side."""

from __future__ import annotations

from refrun import schema
from refrun.acceptance.checks import Context, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("hardware")
class Hardware(Criterion):
    """the executing hardware (probe tag refrun.exec.hardware) is the expected one, and no
    placement warning was recorded"""

    expected: str = key("expected hardware, e.g. 'tpu' or 'cuda: NVIDIA H100'")
    match: str = key("'contains': case-insensitive substring; 'exact': case-insensitive "
                     "equality", "contains", enum=("contains", "exact"))
    allow_placement_warning: bool = key("do not fail on refrun.placement.warning", False)

    def check(self, ctx: Context) -> CriterionResult:
        return hardware(self, ctx)


def hardware(c: Hardware, ctx: Context) -> CriterionResult:
    """Executing hardware tag equals / contains ``expected`` (case-insensitive) and no
    placement warning unless allowed."""
    run = ctx.candidate
    hw = run.tags.get(schema.TAG_EXEC_HARDWARE)
    warning = run.tags.get(schema.TAG_PLACEMENT_WARNING)
    ev = {"expected": c.expected, "match": c.match, "exec_hardware": hw,
          "declared_hardware": run.hardware, "placement_warning": warning,
          "exec_devices": run.tags.get(schema.TAG_EXEC_DEVICES)}
    if hw is None:
        return result(c, NOT_EVALUABLE, f"candidate run {run.run_id} has no "
                      f"{schema.TAG_EXEC_HARDWARE} tag (recorded without a framework "
                      "probe)", ev)
    exp = c.expected.strip().lower()
    ok_hw = hw.strip().lower() == exp if c.match == "exact" else exp in hw.lower()
    if not ok_hw:
        return result(c, FAIL, f"executed on {hw!r}, expected {c.expected!r} ({c.match})", ev)
    if warning and not c.allow_placement_warning:
        return result(c, FAIL, f"executed on {hw!r} but placement warning: {warning}", ev)
    return result(c, PASS, f"executed on {hw!r}" + (f" (placement warning allowed: "
                                                     f"{warning})" if warning else ""), ev)
