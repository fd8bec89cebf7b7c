"""Many candidates at once: one row per candidate, one column per criterion.

A sign-off is usually about several candidates (each port, each chip count, each defect
fixed).  :func:`matrix` turns each candidate's assessment and ranked departures into one
row - the outcome and the key number of every criterion, the verdict, the highest level
and the largest departure - as plain data (written with ``refrun report --json``) that
:func:`matrix_table` renders with a link from each row to the candidate's section.

A sweep of a hundred candidates must read on its first screen: :func:`heat_map` shows
verdict by criterion in a few hundred pixels, and the matrix sorts by any column and
filters by verdict, highest level and failing criterion (:data:`MATRIX_JS`, a constant
script that reads the rows' ``data-*`` attributes; ``tests/test_report_sweep_browser.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from refrun import schema
from refrun.report.assessment import badge, key_number, results
from refrun.report.html import Raw, cell, esc, join, num, tag
from refrun.report.overview import Departure

FORMAT = schema.FORMAT_REPORT_MATRIX
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class Cell:
    """One criterion's result for one candidate."""

    outcome: str
    level: str
    key: str | None = None
    value: float | int | None = None


@dataclass(frozen=True)
class Row:
    """One candidate: identity, verdict and one :class:`Cell` per criterion id."""

    candidate: str
    label: str
    anchor: str
    comparison_run_id: str | None
    verdict: str | None
    highest_level: str | None
    cells: dict[str, Cell] = field(default_factory=dict)
    top_departure: Departure | None = None
    departures: list[Departure] = field(default_factory=list)
    comparison_url: str | None = None


def row(candidate: str, label: str, anchor: str, assessment: dict[str, Any] | None,
        comparison_run_id: str | None, departures: list[Departure],
        comparison_url: str | None = None) -> Row:
    """A candidate's row from its assessment dict (may be None) and ranked departures."""
    cells = {}
    for r in results(assessment):
        kn = key_number(r)
        cells[str(r.get("id"))] = Cell(str(r.get("outcome")), str(r.get("level", "")),
                                       kn[0] if kn else None, kn[1] if kn else None)
    a = assessment or {}
    return Row(candidate, label, anchor, comparison_run_id, a.get("verdict"),
               a.get("highest_level"), cells, departures[0] if departures else None,
               departures, comparison_url)


def criteria_ids(rows: Sequence[Row]) -> list[str]:
    """Every criterion id of any row, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rows:
        for cid in r.cells:
            seen.setdefault(cid, None)
    return list(seen)


def matrix(rows: Sequence[Row]) -> dict[str, Any]:
    """The candidates x criteria matrix as JSON-ready data (``refrun report --json``)."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION,
            "criteria": criteria_ids(rows),
            "candidates": [asdict(r) for r in rows]}


def comparison_cell(r: Row) -> Raw:
    """The comparison run: a link to its MLflow page when the UI's address is known,
    else its id; a dash when nothing was recorded."""
    if not r.comparison_run_id:
        return Raw("—")
    code = f"<code>{esc(r.comparison_run_id[:12])}</code>"
    if r.comparison_url:
        return Raw(f'<a class="mlflow" href="{esc(r.comparison_url)}" target="_blank" '
                   f'rel="noopener" title="{esc(r.comparison_run_id)}">{code}</a>')
    return Raw(f'<span title="{esc(r.comparison_run_id)}">{code}</span>')


VERDICTS = ("fail", "incomplete", "pass")
LEVELS = ("L0", "L1", "L2", "L3", "L4")


def _failed(r: Row) -> list[str]:
    return [cid for cid, c in r.cells.items() if c.outcome == "fail"]


def _row_attrs(i: int, r: Row) -> str:
    """What the page's script sorts and filters a row by (``data-*``; run strings are
    escaped, the failing ids travel as a JSON array)."""
    top = r.top_departure
    dep = "" if top is None or top.score is None else repr(float(top.score))
    return (f' data-i="{i}" data-label="{esc(r.label)}" data-verdict="{esc(r.verdict or "")}"'
            f' data-level="{esc(r.highest_level or "none")}" data-departure="{esc(dep)}"'
            f' data-failed="{esc(json.dumps(_failed(r)))}"')


def _sort_header(text: Any, key: str) -> str:
    return (f'<th data-sort="{esc(key)}"><button type="button" class="sort" '
            f'title="sort by this column (again: the other way)">{cell(text)}</button></th>')


def matrix_table(rows: Sequence[Row]) -> Raw:
    """The matrix: a row per candidate (linking to its section), verdict, highest level,
    largest departure, its comparison run (linked to MLflow when known), then outcome +
    key number per criterion.  Every column but the comparison run sorts (the page's
    :data:`MATRIX_JS`), and each row carries what the filters select on."""
    ids = criteria_ids(rows)
    body = []
    for i, r in enumerate(rows):
        top = r.top_departure
        dep = join([tag("code", top.metric), " ", num(top.score)]) if top else Raw("—")
        cells: list[Any] = [
            Raw(f'<a href="#{esc(r.anchor)}">{esc(r.label)}</a><br>'
                f'<code class="caption">{esc(r.candidate)}</code>'),
            badge(r.verdict) if r.verdict else Raw('<span class="caption">no criteria</span>'),
            r.highest_level or "—", dep, comparison_cell(r)]
        for cid in ids:
            c = r.cells.get(cid)
            if c is None:
                cells.append(Raw("—"))
                continue
            kn = join([Raw("<br>"), tag("span", c.key or "", "caption"), " ", num(c.value)]) \
                if c.key else Raw("")
            cells.append(Raw(f'<div class="cell" data-criterion="{esc(cid)}" '
                             f'data-outcome="{esc(c.outcome)}">{badge(c.outcome)}{kn}</div>'))
        body.append(f"<tr{_row_attrs(i, r)}>" + "".join(f"<td>{cell(c)}</td>" for c in cells)
                    + "</tr>")
    head = ([_sort_header("candidate", "label"), _sort_header("verdict", "verdict"),
             _sort_header("highest level", "level"),
             _sort_header("largest departure", "departure"), "<th>comparison run</th>"]
            + [_sort_header(Raw(f"<code>{esc(c)}</code>"), f"crit:{c}") for c in ids])
    return Raw(f'<table class="matrix" id="candidate-matrix"><thead><tr>{"".join(head)}'
               f'</tr></thead><tbody>{"".join(body)}</tbody></table>')


def _options(label: str, element_id: str, values: Sequence[tuple[str, str]]) -> str:
    opts = "".join(f'<option value="{esc(v)}">{esc(text)}</option>' for v, text in values)
    return (f'<label>{esc(label)} <select id="{element_id}"><option value="">all</option>'
            f"{opts}</select></label>")


def matrix_controls(rows: Sequence[Row]) -> Raw:
    """Filters of the matrix and the heat map: verdict, highest level, a failing
    criterion (only values some candidate has, with their counts)."""
    def counted(values: list[str], order: Sequence[str]) -> list[tuple[str, str]]:
        return [(v, f"{v} ({values.count(v)})") for v in order if v in values]

    verdicts = [r.verdict or "" for r in rows]
    levels = [r.highest_level or "none" for r in rows]
    failed = [cid for r in rows for cid in _failed(r)]
    return Raw('<div class="matrix-controls" id="matrix-controls">'
               + _options("verdict", "filter-verdict", counted(verdicts, VERDICTS))
               + _options("highest level", "filter-level", counted(levels, ("none", *LEVELS)))
               + _options("failing criterion", "filter-failed",
                          counted(failed, criteria_ids(rows)))
               + f'<span class="caption" id="matrix-count">{len(rows)} of {len(rows)} '
                 "candidates</span></div>")


def heat_map(rows: Sequence[Row]) -> Raw:
    """Verdict by criterion at a glance: a row per criterion (and the verdict on top), a
    column per candidate in the matrix's order, a square per outcome; hovering names the
    candidate, clicking opens its section.  Sorted and filtered with the matrix."""
    ids = criteria_ids(rows)

    def square(i: int, r: Row, outcome: str | None, what: str) -> str:
        cls = outcome or "missing"
        return (f'<td class="h {esc(cls)}" data-i="{i}" title="{esc(r.label)}: {esc(what)} '
                f'{esc((outcome or "—").replace("_", " "))}"><a href="#{esc(r.anchor)}">'
                "</a></td>")

    lines = ['<tr><th class="hl">verdict</th>' + "".join(
        square(i, r, r.verdict, "verdict") for i, r in enumerate(rows)) + "</tr>"]
    for cid in ids:
        cells = "".join(square(i, r, r.cells[cid].outcome if cid in r.cells else None, cid)
                        for i, r in enumerate(rows))
        lines.append(f'<tr><th class="hl"><code>{esc(cid)}</code></th>{cells}</tr>')
    return Raw(f'<table class="heat" id="heat-map"><tbody>{"".join(lines)}</tbody></table>')


MATRIX_CSS = """
table.heat { border-collapse: separate; border-spacing: 1px; margin: 4px 0 10px; }
table.heat th.hl { font-weight: 400; font-size: 12px; padding: 0 8px 0 0; text-align: right;
                   white-space: nowrap; }
table.heat td.h { width: 9px; min-width: 9px; height: 13px; padding: 0; border: none;
                  background: #e8ecf0; }
table.heat td.h a { display: block; width: 100%; height: 100%; }
table.heat td.pass { background: #2e7d32; } table.heat td.fail { background: #c62828; }
table.heat td.not_evaluable, table.heat td.incomplete { background: #f2c94c; }
table.heat td.not_applicable { background: #c5d0dc; }
.matrix-controls { display: flex; gap: 18px; align-items: center; margin: 6px 0; font-size: 13px; }
table.matrix th button.sort { font: inherit; color: inherit; background: none; border: none;
                              padding: 0; cursor: pointer; }
table.matrix th[aria-sort] button.sort::after { content: " \\25B4"; }
table.matrix th[aria-sort="descending"] button.sort::after { content: " \\25BE"; }
"""

# The matrix's script: sorting (click a column's header; again: the other way) and
# filtering (verdict, highest level, a failing criterion) of the candidates, applied to
# the matrix and the heat map alike.  Constant: it reads the rows' data-* attributes and
# holds no run data.  Tests wait for #candidate-matrix[data-ready="true"].
MATRIX_JS = """
(function () {
  var table = document.getElementById('candidate-matrix');
  if (!table) { return; }
  var tbody = table.tBodies[0];
  var rows = Array.prototype.slice.call(tbody.rows);
  var index = new Map(rows.map(function (tr, i) { return [tr, i]; }));
  var heat = document.getElementById('heat-map');
  var heatRows = heat ? Array.prototype.slice.call(heat.tBodies[0].rows).map(function (tr) {
    var cells = {};
    Array.prototype.forEach.call(tr.querySelectorAll('td[data-i]'), function (td) {
      cells[td.getAttribute('data-i')] = td;
    });
    return {tr: tr, cells: cells};
  }) : [];
  var VERDICT = {fail: 0, incomplete: 1, pass: 2};
  var OUTCOME = {fail: 0, not_evaluable: 1, not_applicable: 2, pass: 3};
  var failed = new Map(rows.map(function (tr) {
    return [tr, JSON.parse(tr.getAttribute('data-failed') || '[]')];
  }));
  function value(tr, key) {
    if (key === 'label') { return tr.getAttribute('data-label').toLowerCase(); }
    if (key === 'verdict') {
      var v = VERDICT[tr.getAttribute('data-verdict')];
      return v === undefined ? 3 : v;
    }
    if (key === 'level') {
      var l = tr.getAttribute('data-level');
      return l && l !== 'none' ? parseInt(l.slice(1), 10) : -1;
    }
    if (key === 'departure') {
      var d = tr.getAttribute('data-departure');
      return d === '' ? -Infinity : parseFloat(d);
    }
    var id = key.slice(5), found = null;
    Array.prototype.some.call(tr.querySelectorAll('.cell'), function (c) {
      if (c.getAttribute('data-criterion') === id) { found = c; return true; }
      return false;
    });
    var o = found ? OUTCOME[found.getAttribute('data-outcome')] : undefined;
    return o === undefined ? 4 : o;
  }
  var state = {key: null, dir: 1};
  function chosen(id) {
    var el = document.getElementById(id);
    return el ? el.value : '';
  }
  function apply() {
    var fv = chosen('filter-verdict'), fl = chosen('filter-level'),
        ff = chosen('filter-failed');
    var order = rows.slice();
    if (state.key) {
      var keyed = new Map(order.map(function (tr) { return [tr, value(tr, state.key)]; }));
      order.sort(function (a, b) {
        var x = keyed.get(a), y = keyed.get(b);
        if (x < y) { return -state.dir; }
        if (x > y) { return state.dir; }
        return index.get(a) - index.get(b);
      });
    }
    var shown = 0;
    order.forEach(function (tr) {
      var ok = (!fv || tr.getAttribute('data-verdict') === fv) &&
          (!fl || tr.getAttribute('data-level') === fl) &&
          (!ff || failed.get(tr).indexOf(ff) >= 0);
      tr.hidden = !ok;
      if (ok) { shown += 1; }
      tbody.appendChild(tr);
      var i = tr.getAttribute('data-i');
      heatRows.forEach(function (h) {
        var td = h.cells[i];
        if (td) { td.hidden = !ok; h.tr.appendChild(td); }
      });
    });
    var count = document.getElementById('matrix-count');
    if (count) { count.textContent = shown + ' of ' + rows.length + ' candidates'; }
  }
  Array.prototype.forEach.call(table.tHead.querySelectorAll('th[data-sort]'), function (th) {
    th.querySelector('button').addEventListener('click', function () {
      var key = th.getAttribute('data-sort');
      state.dir = state.key === key ? -state.dir : 1;
      state.key = key;
      Array.prototype.forEach.call(table.tHead.querySelectorAll('th'), function (o) {
        o.removeAttribute('aria-sort');
      });
      th.setAttribute('aria-sort', state.dir > 0 ? 'ascending' : 'descending');
      apply();
    });
  });
  ['filter-verdict', 'filter-level', 'filter-failed'].forEach(function (id) {
    var el = document.getElementById(id);
    if (el) { el.addEventListener('change', apply); }
  });
  table.setAttribute('data-ready', 'true');
})();
"""


def matrix_section_body(rows: Sequence[Row]) -> Raw:
    """The first screen of a page of several candidates: the heat map, the filters, the
    sortable matrix, and the matrix's own style and script."""
    return Raw(f"<style>{MATRIX_CSS}</style>" + heat_map(rows) + matrix_controls(rows)
               + '<div class="scroll">' + matrix_table(rows) + "</div>"
               + f'<script type="text/javascript">{MATRIX_JS}</script>')
