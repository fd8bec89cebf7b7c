"""The acceptance section: levels L0-L4 reached and each criterion's outcome and evidence.

Accepts an ``Assessment`` from :mod:`refrun.acceptance` (anything with ``to_dict()``),
a dataclass, or the dict of its JSON (``{"verdict", "highest_level", "levels": [...],
"results": [...]}``).  Unknown or missing keys are tolerated: the section shows what is
there.  Every string (criterion ids, reasons, evidence, notes) is escaped.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from refrun.report.html import Raw, esc, is_number, join, kv_table, num, table, tag

LEVEL_NAMES = ("L0", "L1", "L2", "L3", "L4")


def assessment_dict(assessment: Any) -> dict[str, Any] | None:
    """The assessment as a plain dict (``to_dict()``, a dataclass, or a dict), or None."""
    if assessment is None:
        return None
    if hasattr(assessment, "to_dict"):
        out = assessment.to_dict()
    elif dataclasses.is_dataclass(assessment) and not isinstance(assessment, type):
        out = dataclasses.asdict(assessment)
    else:
        out = assessment
    if not isinstance(out, dict):
        raise TypeError(f"assessment: expected a dict or an object with to_dict(), "
                        f"got {type(assessment).__name__}")
    return out


def badge(outcome: object) -> Raw:
    """An outcome/status as a coloured badge (class from the lower-cased text)."""
    text = "—" if outcome is None else str(outcome)
    cls = text.lower().replace(" ", "_") if text.lower() in (
        "pass", "fail", "not_evaluable", "not_applicable", "incomplete", "not_evaluated",
        "no_criteria") else ""
    return tag("span", text.replace("_", " "), f"badge {cls}".strip())


def _value(v: Any) -> Raw:
    if v is None or is_number(v):
        return num(v)
    if isinstance(v, str | bool):
        return Raw(esc(v))
    return tag("code", json.dumps(v, default=str, separators=(", ", ": ")))


def evidence_cell(ev: Any) -> Raw:
    """Evidence values as ``name = value`` lines (numbers exact in ``data-value``)."""
    if isinstance(ev, dict):
        return join(join([tag("code", str(k)), " = ", _value(v), Raw("<br>")])
                    for k, v in ev.items())
    return _value(ev)


def _levels(a: dict[str, Any]) -> Raw:
    levels = a.get("levels")
    if not isinstance(levels, list):
        return Raw("")
    boxes = []
    for lv in levels:
        if not isinstance(lv, dict):
            continue
        counts = ", ".join(f"{lv.get(k, 0)} {k.replace('_', ' ')}"
                           for k in ("passed", "failed", "not_evaluable", "not_applicable")
                           if k in lv)
        boxes.append(join([Raw('<div class="level">'), tag("b", str(lv.get("level", "?"))),
                           badge(lv.get("status")), Raw("<br>"),
                           tag("span", counts, "caption"),
                           tag("div", str(lv.get("note") or ""), "caption"),
                           Raw("</div>")]))
    return join([Raw('<div class="levels" id="acceptance-levels">'), *boxes, Raw("</div>")])


def assessment_section(a: dict[str, Any]) -> Raw:
    """Verdict, highest level, the level boxes and the criteria table."""
    head = kv_table([
        ("verdict", badge(a.get("verdict"))),
        ("highest level reached", a.get("highest_level") or "none"),
        ("criteria file", _criteria_file(a.get("criteria"))),
        ("assessed", a.get("created_utc") or ""),
        ("evidence sha256", a.get("evidence_sha256") or ""),
    ], table_id="acceptance-summary")
    results = a.get("results") or a.get("criteria_results") or []
    rows = []
    for r in results if isinstance(results, list) else []:
        if not isinstance(r, dict):
            continue
        name = join([tag("code", str(r.get("id", ""))), Raw("<br>"),
                     tag("span", str(r.get("description") or ""), "caption")])
        rows.append((r.get("level", ""), name, r.get("kind", ""), r.get("metric") or "",
                     badge(r.get("outcome")), r.get("reason", ""),
                     evidence_cell(r.get("evidence", {}))))
    crit = table(("level", "criterion", "kind", "metric", "outcome", "reason", "evidence"),
                 rows, "criteria", "acceptance-criteria") if rows else Raw(
        '<p class="note">The assessment lists no criterion results.</p>')
    return join([head, _levels(a), Raw('<div class="scroll">'), crit, Raw("</div>")])


def _criteria_file(c: Any) -> str:
    if isinstance(c, dict):
        return " ".join(str(c.get(k, "")) for k in ("path", "sha256") if c.get(k))
    return "" if c is None else str(c)
