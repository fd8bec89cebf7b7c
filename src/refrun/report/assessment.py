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

from refrun import schema
from refrun.acceptance.criterion_evidence import (
    FirstDivergence,
    Interval,
    PairedEvidence,
    RestoreEvidence,
    RestoreRecord,
)
from refrun.report.html import Raw, esc, is_number, join, kv_table, num, table, tag

LEVEL_NAMES = schema.LEVELS


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


def folded_evidence(r: dict[str, Any]) -> Raw:
    """The key number in view, every evidence value folded below it."""
    ev = r.get("evidence", {})
    kn = key_number(r)
    head = join([tag("code", kn[0]), " = ", _value(kn[1])]) if kn else Raw("")
    n = len(ev) if isinstance(ev, dict) else 1
    return join([head, Raw(f"<details><summary>all evidence ({n})</summary>"),
                 evidence_cell(ev), Raw("</details>")])


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


STEP_KEYS = (schema.EV_FIRST_DIVERGENCE_STEP, "first_step_outside", "first_bad_step",
             "step_of_max_abs_z", "step_of_max_abs_diff", "step")
# Evidence that describes the check rather than its result: never the "key number".
SETTING_KEYS = frozenset({"over", "abs_tol", "rel_tol", "k", "n_steps", "first_step",
                          "last_step", "n_references", "n_reference", "min_fraction",
                          "band", "warmup_steps", "alpha", "interval"})
KEY_NUMBER_PREFERENCE = ("fraction_within", "fraction_inside", "fraction_outside",
                         "max_abs_z", "judged_ratio", "ratio", "p_value", "statistic",
                         "max_abs_diff", "mean_abs_diff", "total", "value", "candidate")


def results(a: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The criterion results of an assessment dict (tolerant of older shapes)."""
    if not a:
        return []
    got = a.get("results") or a.get("criteria_results") or []
    return [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []


def key_number(r: dict[str, Any]) -> tuple[str, Any] | None:
    """The one evidence value that best summarises a criterion's result (a matrix cell):
    the first of :data:`KEY_NUMBER_PREFERENCE` present, else the first numeric evidence
    value that is not a setting; None when there is none."""
    ev = r.get("evidence")
    if not isinstance(ev, dict):
        return None
    for k in KEY_NUMBER_PREFERENCE:
        if is_number(ev.get(k)):
            return k, ev[k]
    for k, v in ev.items():
        if is_number(v) and k not in SETTING_KEYS and not k.endswith("step"):
            return str(k), v
    return None


def failing_marks(a: dict[str, Any] | None, metric: str) -> list[tuple[str, int]]:
    """``(criterion id, step)`` of each failing criterion on ``metric`` whose evidence
    names a step (the first of :data:`STEP_KEYS`)."""
    out = []
    for r in results(a):
        if r.get("outcome") != "fail" or r.get("metric") != metric:
            continue
        ev = r.get("evidence") if isinstance(r.get("evidence"), dict) else {}
        step = next((ev[k] for k in STEP_KEYS if is_number(ev.get(k))), None)
        if step is not None:
            out.append((str(r.get("id", "")), int(step)))
    return out


def assessed_envelope_k(a: dict[str, Any] | None, metric: str, default: float = 3.0
                        ) -> float:
    """Band width (in seed σ) of the envelope criterion on ``metric``, else ``default``."""
    for r in results(a):
        ev = r.get("evidence") if isinstance(r.get("evidence"), dict) else {}
        if r.get("metric") == metric and r.get("kind") == "envelope" and is_number(ev.get("k")):
            return float(ev["k"])
    return default


def first_divergence_mark(r: dict[str, Any]) -> Raw:
    """Where a failing per-step criterion's candidate first left its band (the evidence's
    ``first_divergence``: axis value, step, side), or nothing."""
    fd = FirstDivergence.of_result(r.get("evidence"))
    if r.get("outcome") != "fail" or fd is None:
        return Raw("")
    return join([tag("b", f"first left the band at {fd.where()}" + (
        f", {fd.direction}" if fd.direction else ""), "first-divergence",
        data_step=str(fd.step)), " "])


def verdict_banner(a: dict[str, Any] | None, ns: str = "") -> Raw:
    """The answer first: verdict, highest level, a chip per level, the failing
    criteria (links into the acceptance section)."""
    if a is None:
        return Raw(f'<div class="banner none" id="{esc(ns)}verdict"><div class="big">'
                   'no criteria applied</div><div>The ranking below is descriptive; '
                   "<code>refrun report --criteria FILE</code> adds the verdict and "
                   "levels L0–L4.</div></div>")
    verdict = str(a.get("verdict") or "—")
    chips = []
    for lv in a.get("levels") or []:
        if isinstance(lv, dict):
            st = str(lv.get("status") or "")
            chips.append(Raw(f'<span class="chip {esc(st)}" title="{esc(st)}">'
                             f"{esc(lv.get('level', '?'))}</span>"))
    rs = results(a)
    counts = {o: sum(1 for r in rs if r.get("outcome") == o)
              for o in ("pass", "fail", "not_evaluable")}
    failing = [r for r in rs if r.get("outcome") in ("fail", "not_evaluable")][:4]
    fails = join(join([badge(r.get("outcome")), " ", tag("code", str(r.get("id", ""))),
                       " ", first_divergence_mark(r),
                       tag("span", str(r.get("reason") or "").split(schema.FIRST_LEFT_REASON)[0],
                           "caption"), Raw("<br>")])
                 for r in failing)
    return join([
        Raw(f'<div class="banner {esc(verdict.lower())}" id="{esc(ns)}verdict">'),
        Raw('<div class="big">'), tag("span", verdict.upper(), "verdict",
                                      data_verdict=verdict), Raw("</div>"),
        Raw("<div>"), tag("div", f"highest level reached: {a.get('highest_level') or 'none'}",
                          "hl"),
        Raw('<div class="chips">'), *chips, Raw("</div>"),
        tag("div", f"{counts['pass']} passed · {counts['fail']} failed · "
                   f"{counts['not_evaluable']} not evaluable", "caption"),
        Raw("</div>"), Raw('<div class="fails">'), fails, Raw("</div></div>")])


def _interval(r: dict[str, Any]) -> Raw:
    iv = Interval.from_dict(r.get("evidence"))
    parts: list[str] = []
    if iv is not None and iv.interval is not None:
        parts += ["[", num(iv.interval[0]), ", ", num(iv.interval[1]), "]"]
    if iv is not None and iv.n_reference is not None:
        parts += [" n=" if parts else "n=", num(iv.n_reference)]
    return join(parts)


def calibration_table(a: dict[str, Any]) -> Raw:
    """Where the thresholds came from: the criteria's ``[calibration]`` (flattened)."""
    cal = a.get("calibration")
    crit = a.get("criteria")
    if cal is None and isinstance(crit, dict):
        cal = crit.get("calibration")
    if not isinstance(cal, dict) or not cal:
        return Raw("")
    rows: list[tuple[str, Any]] = []
    for k, v in cal.items():
        if isinstance(v, dict):
            rows += [(f"{k}.{kk}", vv if is_number(vv) or isinstance(vv, str)
                      else json.dumps(vv, default=str)) for kk, vv in v.items()]
        else:
            rows.append((str(k), v if is_number(v) or isinstance(v, str)
                         else json.dumps(v, default=str)))
    return join([tag("h3", "Calibration provenance"),
                 tag("p", "How the statistical thresholds were derived ([calibration] in "
                          "the criteria file).", "note"),
                 kv_table(rows, table_id="calibration")])


def assessment_section(a: dict[str, Any]) -> Raw:
    """Verdict, highest level, the level boxes and the criteria table."""
    head = kv_table([
        ("verdict", badge(a.get("verdict"))),
        ("highest level reached", a.get("highest_level") or "none"),
        ("criteria file", _criteria_file(a.get("criteria"))),
        ("assessed", a.get("created_utc") or ""),
        ("evidence sha256", a.get("evidence_sha256") or ""),
    ], table_id="acceptance-summary")
    rs = results(a)
    # the column when a statistical criterion states its interval or seeds
    with_iv = any(isinstance(r.get("evidence"), dict) and (
        schema.EV_INTERVAL in r["evidence"] or schema.EV_N_REFERENCE in r["evidence"])
        for r in rs)
    rows = []
    for r in rs:
        name = join([tag("code", str(r.get("id", ""))), Raw("<br>"),
                     tag("span", str(r.get("description") or ""), "caption")])
        row = [r.get("level", ""), name, r.get("kind", ""), r.get("metric") or "",
               badge(r.get("outcome")), r.get("reason", "")]
        if with_iv:
            row.append(_interval(r))
        rows.append((*row, folded_evidence(r)))
    head_cols = ["level", "criterion", "kind", "metric", "outcome", "reason"]
    if with_iv:
        head_cols.append("interval (n reference)")
    crit = table((*head_cols, "evidence"), rows, "criteria", "acceptance-criteria") \
        if rows else Raw('<p class="note">The assessment lists no criterion results.</p>')
    return join([head, _levels(a), Raw('<div class="scroll">'), crit, Raw("</div>"),
                 paired_table(a), restore_table(a), calibration_table(a)])


def paired_table(a: dict[str, Any]) -> Raw:
    """Same-seed paired comparisons (``paired`` criteria): the candidate's pair and where
    the pair first diverged beyond the known-good band; empty without such a criterion."""
    rows = []
    for r in results(a):
        if r.get("kind") != "paired":
            continue
        pe = PairedEvidence.from_dict(r.get("evidence"))
        pair = pe.pair if pe else {}
        j = pe.judgement if pe else None
        first = pe.first_divergence_step if pe else None
        where = ("never left the band" if first is None and pe and pe.pair_run else
                 "—" if first is None else f"step {first}")
        rows.append((tag("code", str(r.get("id", ""))), badge(r.get("outcome")),
                     f"{pair.get('run_id') or 'none'} ({pair.get('source') or 'not found'})",
                     where, j.divergence_at_first if j else None,
                     j.band_at_first if j else None, j.max_ratio_observed if j else None,
                     pe.max_ratio if pe else None, j.steps_compared if j else None,
                     _precision_cell(pe.numerics if pe else None), r.get("reason", "")))
    if not rows:
        return Raw("")
    return join([tag("h3", "Same-seed pair"),
                 tag("p", "A port of one reference seed compared with that seed's run: the "
                          "running max of |candidate − reference| against max_ratio × the "
                          "known-good pairs' divergence at the same step.", "note"),
                 table(("criterion", "outcome", "pair run (found by)", "first diverges",
                        "|diff| so far there", "band there", "max ratio to known-good",
                        "max_ratio", "steps", "precision (twin)", "reason"), rows,
                       "criteria", "paired")])


def _precision_cell(num: dict[str, Any] | None) -> Raw | str:
    """The candidate's numerics against its pair's: ``as its pair's``, or the coarser
    arithmetic, its precision twin and what the divergence is attributed to
    (:func:`refrun.acceptance.precision.decide`)."""
    if not num:
        return "—"
    if not num.get("reduced"):
        return "as precise as its pair's"
    twin = num.get("twin") or {}
    j = twin.get("judgement") or {}
    said = ["; ".join(num.get("coarser") or [])]
    if twin.get("run_id") and j:
        first = j.get("first_divergence_step")
        said.append(f"twin {twin['run_id']} ({twin.get('source')}): " + (
            "never left the band" if first is None else f"first diverges at step {first}"))
    else:
        said.append(f"no twin: re-run with {num.get('rerun')}")
    said.append(f"attribution: {num.get('attribution')}")
    return join([tag("span", s) if i == 0 else join([Raw("<br>"), s])
                 for i, s in enumerate(said)])


def _state_cell(rec: RestoreRecord, metric: str) -> Raw | str:
    """``replay (first pass)`` of one ``opt/`` metric at the restore, marked when it
    differed at some replayed step; empty when the run did not record it."""
    st = next((x for x in rec.state if x.metric == metric), None)
    if st is None:
        return ""
    cell = join([num(st.replay_at_restore), " (first pass ", num(st.first_at_restore), ")"])
    if st.identical:
        return cell
    return join([cell, Raw("<br>"), tag("span", f"differs from step "
                                                f"{st.first_difference_step}", "caption")])


def restore_table(a: dict[str, Any]) -> Raw:
    """Restores (``restore`` criteria): each time the candidate went back to a checkpoint
    and replayed steps, from which step, what state it resumed with (the learning rate
    and the optimizer's update count, against the first pass's) and whether the replay
    reproduced the first pass; empty without such a criterion or restore."""
    rows = []
    for r in results(a):
        ev = RestoreEvidence.from_dict(r.get("evidence")) if r.get("kind") == "restore" \
            else None
        if ev is None:
            continue
        for rec in ev.restores:
            if rec.replayed == 0:
                replay: Any = "not logged while replaying"
            elif rec.identical:
                replay = "bit for bit"
            else:
                replay = join([f"differs from step {rec.first_difference_step}, max |diff| ",
                               num(rec.max_abs_diff)]
                              + ([", ", num(rec.band_ratio), " x the same-seed band"]
                                 if rec.band_ratio is not None else []))
            rows.append((tag("code", str(r.get("id", ""))), badge(r.get("outcome")),
                          rec.step, rec.after_step, rec.replayed, replay,
                          _state_cell(rec, schema.M_LR),
                          _state_cell(rec, schema.M_OPT_STEPS)))
    if not rows:
        return Raw("")
    return join([tag("h3", "Restores"),
                 tag("p", "Where the candidate resumed from a checkpoint and replayed steps "
                          "it had logged: the state it resumed with and its replayed values "
                          "against the first pass's (refrun.comparison.restores).", "note"),
                 table(("criterion", "outcome", "resumed at step", "after step",
                        "replayed points", "replayed metric", "learning rate at the restore",
                        "optimizer updates after it"), rows, "criteria", "restores")])


def _criteria_file(c: Any) -> str:
    if isinstance(c, dict):
        return " ".join(str(c.get(k, "")) for k in ("path", "sha256") if c.get(k))
    return "" if c is None else str(c)
