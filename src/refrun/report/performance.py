"""The first screen's L4 panel of a migrated candidate: throughput, cost per run and chip
busy fraction, the references' against the candidate's, and the file's L4 goal on each
(or "measured only" when none is declared).

Its numbers are the assessment's ``performance``
(:meth:`refrun.acceptance.performance.Performance.to_dict`); a report without criteria
measures them from the compared runs (no prices: the cost says why it is not measured).
Nothing for a candidate on the references' configuration: its speed is the step-time
criterion's.
"""

from __future__ import annotations

from typing import Any

from refrun.acceptance import performance as perf
from refrun.acceptance.criteria import CriteriaSettings, Prices
from refrun.comparison import Comparison
from refrun.report.assessment import badge
from refrun.report.html import Raw, esc, join, num, table, tag

# The kind of the L4 criterion that judges each figure (calibrate --goal writes one each).
GOAL_KINDS = {"throughput": "throughput", "cost": "cost", "busy": "utilization"}


def figures(cmp: Comparison, a: dict[str, Any] | None) -> dict[str, Any] | None:
    """The migration's figures: the assessment's, else measured from the compared runs
    with the default settings and no prices; None when the candidate is no migration."""
    if a is not None:
        return a.get("performance") or None
    measured = perf.measure(cmp.candidate, cmp.reference, Prices(), CriteriaSettings())
    return None if measured is None else measured.to_dict()


def _missing(why: str | None) -> Raw:
    return tag("span", f"{perf.NOT_MEASURED}{why or 'unknown'}", "caption not-measured")


def _goal(results: list[dict[str, Any]], figure: str) -> Raw:
    """The outcome of the L4 criteria of ``figure``'s kind, or that none judges it."""
    mine = [r for r in results if r.get("level") == "L4"
            and r.get("kind") == GOAL_KINDS[figure] and r.get("outcome") != "not_applicable"]
    if not mine:
        return tag("span", "no goal: measured only", "caption")
    return join(join([badge(r.get("outcome")), " ", tag("code", str(r.get("id", ""))), " ",
                      tag("span", str(r.get("reason") or ""), "caption"), Raw("<br>")])
                for r in mine)


def _pair(cand: Any, ref: Any, unit: str, cand_why: str | None, ref_why: str | None
          ) -> Raw:
    """``candidate X vs references Y unit``, a side not measured saying why."""
    sides = []
    for side, v, why in (("candidate", cand, cand_why), ("references", ref, ref_why)):
        sides.append(join([f"{side} ", num(v), f" {unit}"]) if v is not None else
                     join([f"{side} ", _missing(why)]))
    return join([sides[0], " vs ", sides[1]])


def panel(cmp: Comparison, a: dict[str, Any] | None, ns: str = "") -> Raw:
    """The L4 panel (``#<ns>l4``), or nothing for a candidate that is no migration: one
    row per figure (ratio, both sides or why a side is not measured, the L4 goal on it),
    compact enough to leave the ranking on the first screen."""
    d = figures(cmp, a)
    if d is None:
        return Raw("")
    results = [r for r in (a or {}).get("results") or [] if isinstance(r, dict)]
    unit, cur = d.get("unit") or "units", d.get("currency") or ""
    tp, cost, busy = d.get("throughput") or {}, d.get("cost") or {}, d.get("busy") or {}
    rows = [
        ("throughput", num(tp.get("ratio")),
         _pair(tp.get("candidate_per_s"), tp.get("reference_per_s"), f"{unit}/s",
               tp.get("candidate_why"), tp.get("reference_why")),
         _goal(results, "throughput")),
        ("cost per run", num(cost.get("ratio")),
         _pair(cost.get("candidate"), cost.get("reference"), cur, cost.get("candidate_why"),
               cost.get("reference_why")), _goal(results, "cost")),
        ("chip busy", num(None),
         _pair(busy.get("candidate_pct"), busy.get("reference_pct"), "%",
               busy.get("candidate_why"), busy.get("reference_why")),
         _goal(results, "busy")),
    ]
    judged = any(r.get("level") == "L4" and r.get("kind") in GOAL_KINDS.values()
                 and r.get("outcome") != "not_applicable" for r in results)
    how = ("judged by the criteria file's L4 goals" if judged else
           "measured only: no L4 goal declared (refrun calibrate --goal throughput>=0.9x, "
           "cost<=1.2x, utilization>=50%)")
    method = ("Throughput: units consumed / step time over the steady steps (warm-up and "
              "compilation steps left out), the median of the rates of 0.1 s blocks of "
              "steps. Cost per run: the run's "
              "wall hours for the references' work (its hours x their mean work / its own) x "
              "its hardware's price per hour ([prices]). Chip busy: mean over chips of each "
              "chip's mean utilisation after warm-up. Ratios: candidate / mean of the "
              "references. L4 is judged only after L3 passed."
              + (f" {d['unit_note']}." if d.get("unit_note") else ""))
    return join([
        Raw(f'<div class="l4" id="{esc(ns)}l4">'),
        tag("h3", "Performance and cost across hardware"),
        tag("p", f"{d.get('migration', '')}: {how}", "note"),
        table(("figure", "candidate / references", "measured", "L4 goal"), rows,
              "l4-table", f"{ns}l4-table"),
        Raw("<details><summary>how these are measured</summary>"), tag("p", method, "note"),
        Raw("</details></div>")])
