"""Many candidates at once: one row per candidate, one column per criterion.

A sign-off is usually about several candidates (each port, each chip count, each defect
fixed).  :func:`matrix` turns each candidate's assessment and ranked departures into one
row - the outcome and the key number of every criterion, the verdict, the highest level
and the largest departure - as plain data (written with ``refrun report --json``) that
:func:`matrix_table` renders with a link from each row to the candidate's section.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from refrun import schema
from refrun.report.assessment import badge, key_number, results
from refrun.report.html import Raw, esc, join, num, table, tag
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


def matrix_table(rows: Sequence[Row]) -> Raw:
    """The matrix: a row per candidate (linking to its section), verdict, highest level,
    largest departure, its comparison run (linked to MLflow when known), then outcome +
    key number per criterion."""
    ids = criteria_ids(rows)
    body = []
    for r in rows:
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
        body.append(cells)
    head = ["candidate", "verdict", "highest level", "largest departure", "comparison run",
            *[Raw(f"<code>{esc(c)}</code>") for c in ids]]
    return table(head, body, "matrix", "candidate-matrix")
