"""Criterion kind ``gradcheck``: its TOML model and its check, side by side."""

from __future__ import annotations

from typing import Any

from refrun import schema
from refrun.acceptance.checks import Context, result
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult


@kind("gradcheck", needs={"gradchecks"})
class Gradcheck(Criterion):
    """every gradient-check run recorded for the candidate (role gradcheck, tag
    refrun.gradcheck.candidate = the candidate's run id, refrun.gradcheck.record) finished and
    passed; a candidate without one fails"""

    labels: list[str] = key("labels of checks that must be among those recorded (and "
                            "passed), e.g. 'parity/loss'; default: any", [])

    def check(self, ctx: Context) -> CriterionResult:
        return gradcheck(self, ctx)


def gradcheck(c: Gradcheck, ctx: Context) -> CriterionResult:
    """Every gradcheck run recorded for the candidate finished and passed, and together
    they hold the required ``labels``.  No run at all is a failure: the file requires the
    evidence (a missing check must never read as a pass)."""
    runs = ctx.gradchecks
    if runs is None:
        return result(c, NOT_EVALUABLE, "gradient-check runs were not looked up (the "
                      "assessment had no tracking store)")
    cand = ctx.candidate.run_id
    ev: dict[str, Any] = {"gradcheck_runs": [r.run_id for r in runs],
                          "statuses": {r.run_id: r.status for r in runs},
                          "failed_checks": {r.run_id: r.failed for r in runs if r.failed},
                          "labels": sorted({lab for r in runs for lab in r.labels}),
                          "required_labels": list(c.labels)}
    if not runs:
        return result(c, FAIL, f"no gradient-check run recorded for candidate {cand} (role "
                      f"gradcheck, tag {schema.TAG_GRADCHECK_CANDIDATE}); the criteria "
                      "file requires one", ev)
    bad = [r for r in runs if not r.ok]
    if bad:
        why = "; ".join(
            f"run {r.run_id}: " + (f"status {r.status}" if r.status != "FINISHED" else
                                   f"failed {', '.join(r.failed)}" if r.failed else
                                   f"{schema.TAG_GRADCHECK_PASSED} = "
                                   f"{'missing' if r.passed is None else 'false'}")
            for r in bad[:5])
        return result(c, FAIL, f"{len(bad)}/{len(runs)} gradient-check run(s) did not pass: "
                      f"{why}", ev)
    missing = [lab for lab in c.labels if lab not in ev["labels"]]
    if missing:
        return result(c, FAIL, f"required check(s) not recorded: {', '.join(missing)}", ev)
    return result(c, PASS, f"{len(runs)} gradient-check run(s) passed "
                  f"({len(ev['labels'])} checks)", ev)
