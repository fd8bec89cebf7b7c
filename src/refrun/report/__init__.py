"""The self-contained HTML comparison report (plotly; offline by default).

::

    from refrun.comparison import compare
    from refrun.report import write_report

    cmp = compare(reference_ids, candidate_id, tracking_uri=uri)
    write_report(cmp, "report.html")                  # plotly.js embedded once (~4.6 MB)
    write_report(cmp, "small.html", plotlyjs="cdn")   # needs network to draw the plots

Sections: summary (runs, acceptance levels when an assessment is given, headline
differences), per-metric curves + difference + measures, evaluation metrics, runtime
evidence (step time, counters, CPU fallbacks, device truth, utilization) and what
alignment did.  See docs/report.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from refrun import schema
from refrun._version import __version__
from refrun.comparison import Comparison
from refrun.errors import RefrunInputError
from refrun.report import labels as L
from refrun.report import matrix as M
from refrun.report import sections as S
from refrun.report.assessment import assessment_dict
from refrun.report.downsample import DEFAULT_MAX_POINTS
from refrun.report.figures import FigureSpec, Reduction, run_labels
from refrun.report.html import (
    Raw,
    deferred_plotlyjs_tag,
    esc,
    join,
    json_default,
    page,
    plotlyjs_tag,
    script_json,
    tag,
)
from refrun.report.overview import Departure
from refrun.util.outputs import check_output

ARTIFACT_REPORT = schema.ARTIFACT_REPORT
__all__ = ["ARTIFACT_REPORT", "Candidate", "PageBuilder", "Report", "build_multi_report",
           "build_report", "log_report", "write_html", "write_multi_report",
           "write_report"]


@dataclass(frozen=True, eq=False)
class Report:
    """A rendered report: the page text, its figures, and how long building took."""

    html: str
    figures: list[dict[str, Any]] = field(repr=False)
    """Every figure's plotly JSON (``id``, ``title``, ``data``, ``layout``; the page's shared
    template ``plotly_white`` is left out of each layout), candidate by candidate.  As a
    plotly figure: ``go.Figure(f["data"], {**f["layout"], "template": "plotly_white"})``."""
    build_s: float = 0.0
    matrix: dict[str, Any] = field(default_factory=dict, repr=False)


def _template() -> dict[str, Any]:
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def _figure_json(spec: FigureSpec) -> dict[str, Any]:
    d = spec.figure.to_plotly_json()
    layout = dict(d.get("layout", {}))
    layout.pop("template", None)  # one shared template for the page, set by the script
    return {"id": spec.id, "title": spec.title, "data": d["data"], "layout": layout}


@dataclass(frozen=True, eq=False)
class Candidate:
    """One candidate of a report: its comparison, assessment (optional) and the MLflow
    comparison run that records it (optional)."""

    comparison: Comparison
    assessment: Any = None
    comparison_run_id: str | None = None
    comparison_url: str | None = None
    """The comparison run's page in the MLflow UI, when the UI's address is known."""


def _check(max_points: int, method: str) -> None:
    if max_points < 10:
        raise RefrunInputError(f"max_points: {max_points} is too small (at least 10)")
    if method not in ("minmax", "lttb"):
        raise RefrunInputError(f"method: {method!r} is not 'minmax' or 'lttb'")


def _candidate_sections(c: Candidate, a: dict[str, Any] | None, ids: S.FigureIds,
                        red: Reduction, ns: str) -> tuple[list[S.Section], list[Departure]]:
    cmp = c.comparison
    overview, deps = S.overview_section(cmp, a, ids, ns)
    secs = [overview, S.timeline_section(cmp, ids, red, deps, ns),
            S.metrics_section(cmp, ids, red, deps, a, ns),
            S.eval_section(cmp, ids, red, deps, a, ns),
            S.acceptance_section(a, ns),
            S.runtime_section(cmp, ids, red, ns, deps),
            S.runs_section(cmp, c.comparison_run_id, ns),
            S.alignment_section(cmp, ns)]
    return [s for s in secs if s is not None], deps


def _title(h: _Head, n: int, title: str | None) -> str:
    if title:
        return title
    if n > 1:
        return f"refrun report: {h.workload}: {n} candidates vs {h.ref_hw}"
    return f"refrun report: {h.workload}: {h.ref_hw} vs {h.cand_hw}"


REDACTED = "…"
NAV_MAX_CANDIDATES = 12  # candidates linked from the sticky navigation bar


def redact(text: str, prefixes: Sequence[str]) -> str:
    """``text`` with every occurrence of each prefix (e.g. the machine's checkout or home
    directory; raw, HTML-escaped and JSON-escaped forms) replaced by ``…``: a report
    that travels (an example store, an email) names no path of the machine that made it.
    Longest prefixes first, so a parent never leaves a child's tail behind."""
    for p in sorted((p for p in prefixes if p), key=len, reverse=True):
        forms = {p, esc(p), json.dumps(p)[1:-1].replace("&", "\\u0026")
                 .replace("<", "\\u003c").replace(">", "\\u003e")}
        for f in forms:
            text = text.replace(f, REDACTED)
    return text


_ID_ATTR = re.compile(r' id="(?!fig-)([^"]+)"')


def namespace_ids(markup: str, ns: str) -> str:
    """Prefix every element id in ``markup`` (built here: run strings are escaped, so
    `` id="`` only ever comes from this package) with ``ns`` unless it already has it, so
    several candidates' sections on one page keep unique ids.  Figure ids (``fig-N``)
    are unique across the page already and stay as the figures' JSON names them."""
    return _ID_ATTR.sub(lambda m: m.group(0) if m.group(1).startswith(ns)
                        else f' id="{ns}{m.group(1)}"', markup)


POOL_MIN_ITEMS = 16
"""Plain arrays shorter than this stay inline: a pool reference would not save much."""


def _pool_key(o: Any) -> str | None:
    """The identity under which ``o`` may be shared by the page's figures: a typed array
    (``{"dtype", "bdata"}``) by its bytes, a plain array of at least
    :data:`POOL_MIN_ITEMS` scalars (hover text, category labels; or a NumPy array) by its
    JSON text; None for anything else (recursed into)."""
    if isinstance(o, dict):
        b = o.get("bdata")
        return f"b:{b}" if isinstance(b, str) else None
    if isinstance(o, np.ndarray):
        return f"j:{json.dumps(o, default=json_default)}" if o.size >= POOL_MIN_ITEMS \
            else None
    if isinstance(o, list | tuple) and len(o) >= POOL_MIN_ITEMS and not any(
            isinstance(v, dict | list | tuple | np.ndarray) for v in o):
        return f"j:{json.dumps(o, default=json_default)}"
    return None


def _figure_blocks(docs: list[list[dict[str, Any]]]) -> tuple[list[Any], list[dict]]:
    """The figures' JSON (:func:`_figure_json`) of several candidates with every array
    that occurs more than once (the references' curves, drawn in each candidate's
    figures; the step ranges of every heatmap's hover text) stored once in a shared pool
    and replaced by ``{"pool": k}``: lossless, and it keeps a page of a hundred
    candidates from repeating the same arrays a hundred times."""
    seen: dict[str, int] = {}

    def count(o: Any) -> None:
        key = _pool_key(o)
        if key is not None:
            seen[key] = seen.get(key, 0) + 1
        elif isinstance(o, dict):
            for v in o.values():
                count(v)
        elif isinstance(o, list | tuple):
            for v in o:
                count(v)

    count(docs)
    pool: list[Any] = []
    index: dict[str, int] = {}

    def swap(o: Any) -> Any:
        key = _pool_key(o)
        if key is not None and seen.get(key, 0) > 1:
            if key not in index:
                index[key] = len(pool)
                pool.append(o)
            return {"pool": index[key]}
        if isinstance(o, dict) and key is None:
            return {k: swap(v) for k, v in o.items()}
        if isinstance(o, list | tuple) and key is None:
            return [swap(v) for v in o]
        return o

    return pool, [{"figures": swap(d)} for d in docs]


@dataclass(frozen=True, eq=False)
class _Part:
    """What the page keeps of one candidate once its comparison is dropped: its markup,
    its figures as plotly JSON, its matrix row's inputs and its machine-readable record
    (kilobytes), never its aligned series (megabytes)."""

    run_id: str
    name: str
    own_label: str
    properties: dict[str, str]
    markup: str
    nav: list[tuple[str, str]]
    figures: list[dict[str, Any]]
    assessment: dict[str, Any] | None
    departures: list[Departure]
    record: dict[str, Any]
    comparison_run_id: str | None
    comparison_url: str | None


@dataclass(frozen=True)
class _Head:
    """The page title's and subtitle's facts, from the first candidate."""

    workload: str
    ref_hw: str
    cand_hw: str
    candidate: str
    references: int
    metrics: int


class PageBuilder:
    """Builds the page one candidate at a time, so a page of many candidates holds one
    candidate's aligned data at a time (a hundred candidates x 100k steps held together
    needed > 4.6 GB): :meth:`add` turns a :class:`Candidate` into its sections, figure
    JSON and matrix inputs, after which the caller drops the comparison; :meth:`build`
    labels the candidates (labels depend on all of them), lays out the matrix and
    returns the :class:`Report`.  ``multi``: a page of several candidates (folded,
    namespaced sections under a matrix), known before the first :meth:`add` because
    every element id of a section carries its candidate's namespace."""

    def __init__(self, *, multi: bool, max_points: int = DEFAULT_MAX_POINTS,
                 method: str = "minmax") -> None:
        _check(max_points, method)
        self.multi = multi
        self._red = Reduction(max_points, method)
        self._ids = S.FigureIds()
        self._parts: list[_Part] = []
        self._head: _Head | None = None
        self._t0 = time.perf_counter()
        self._build_s = 0.0

    def add(self, c: Candidate) -> None:
        """Render candidate ``c``'s sections now; nothing of its comparison is kept."""
        t0 = time.perf_counter()
        if self._parts and not self.multi:
            raise RefrunInputError("report: a single-candidate page has one candidate")
        cmp = c.comparison
        i = len(self._parts)
        ns = f"c{i}-" if self.multi else ""
        a = assessment_dict(c.assessment)
        secs, deps = _candidate_sections(c, a, self._ids, self._red, ns)
        cand_label = run_labels(cmp)[1]
        if self._head is None:
            first = cmp.reference[0]
            self._head = _Head(cmp.candidate.workload or first.workload or "runs",
                               first.hardware or run_labels(cmp)[0][0],
                               cmp.candidate.hardware or cand_label, cmp.candidate.run_id,
                               len(cmp.reference), len(cmp.metrics))
        r = cmp.candidate
        markup = "".join(s.html() for s in secs)
        self._parts.append(_Part(
            r.run_id, r.tags.get(schema.TAG_RUN_NAME) or cand_label, cand_label,
            L.properties(r.params, r.tags),
            namespace_ids(markup, ns) if self.multi else markup,
            [(s.id, s.heading) for s in secs],
            [_figure_json(f) for s in secs for f in s.figures], a, deps,
            {"comparison": cmp.to_dict(), "assessment": a,
             "comparison_run_id": c.comparison_run_id},
            c.comparison_run_id, c.comparison_url))
        self._build_s += time.perf_counter() - t0

    def labels(self) -> list[str]:
        """Distinct labels of the candidates added: run name (else the role/hardware
        label) and the params and tags in which they differ
        (:mod:`refrun.report.labels`); the run's label alone on a single-candidate page."""
        if not self.multi:
            return [p.own_label for p in self._parts]
        return L.distinct_labels([L.Labelled(p.run_id, p.name, p.properties)
                                  for p in self._parts])

    def build(self, *, plotlyjs: str = "embed", title: str | None = None,
              redact_paths: Sequence[str] = ()) -> Report:
        """The page of every candidate added (nothing is written)."""
        if not self._parts or self._head is None:
            raise RefrunInputError("report: no candidate given")
        t0 = time.perf_counter()
        multi, parts, h = self.multi, self._parts, self._head
        labels = self.labels()
        body, nav, rows, records = [], [], [], []
        for i, (p, label) in enumerate(zip(parts, labels, strict=True)):
            anchor = f"cand-{i}" if multi else "overview"
            rows.append(M.row(p.run_id, label, anchor, p.assessment, p.comparison_run_id,
                              p.departures, p.comparison_url))
            records.append({**p.record, "label": label,
                            "departures": [d.to_dict() for d in p.departures]})
            if not multi:
                body.append(p.markup)
                nav += p.nav
                continue
            verdict = (p.assessment or {}).get("verdict")
            head = (f'<h2>Candidate {i + 1}: {esc(label)} <code>{esc(p.run_id)}</code>'
                    + (f" {M.badge(verdict)}" if verdict else "") + "</h2>")
            body.append(f'<details class="candidate" id="{anchor}"><summary>{head}'
                        f'<span class="caption">{len(p.figures)} figure(s), drawn when '
                        f"opened</span></summary>{p.markup}"
                        '<p class="note"><a href="#matrix">back to the matrix</a></p>'
                        "</details>")
            if len(parts) <= NAV_MAX_CANDIDATES:  # else the matrix is the index
                nav.append((anchor, f"{i + 1}: {label}"))
        mtx = M.matrix(rows)
        figures = [f for p in parts for f in p.figures]
        if multi:
            intro = S.Section("matrix", "Candidates × criteria", join([
                tag("p", "Verdict by criterion at a glance (a column per candidate; hover "
                         "for its name, click to open it), then one row per candidate: "
                         "verdict, highest level, the metric that departs most (mean |z|, "
                         "or mean rel diff with one reference) and each criterion's "
                         "outcome with its key number. Candidates are named by run name "
                         "and the params and tags in which they differ, your own first. "
                         "Sort by any column; filter by verdict, level or failing "
                         "criterion. Click a candidate to open its section (its figures "
                         "are drawn then).", "note"),
                M.matrix_section_body(rows)]))
            body.insert(0, intro.html())
            nav.insert(0, ("matrix", "matrix"))
            pool, blocks = _figure_blocks([p.figures for p in parts])
            data = Raw(script_json({"template": _template(), "figures": [], "pool": pool,
                                    "lazy": True}, "refrun-figures")
                       + "".join(script_json(b, f"refrun-figures-cand-{i}")
                                 for i, b in enumerate(blocks)))
        else:
            data = script_json({"template": _template(), "figures": figures},
                               "refrun-figures")
        blob: dict[str, Any] = dict(records[0]) if not multi else {"candidates": records}
        blob.update(matrix=mtx, refrun_version=__version__)
        record = script_json(blob, "refrun-data")
        page_title = _title(h, len(parts), title)
        created = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        what = f"candidate {h.candidate}" if not multi else f"{len(parts)} candidates"
        sub = (f"{h.references} reference run(s) vs {what} · {h.metrics} metrics compared · "
               f"generated {created} by refrun {__version__}")
        # Several candidates, plotly.js embedded: inert text until a section opens.
        js = (deferred_plotlyjs_tag() if multi and plotlyjs == "embed"
              else plotlyjs_tag(plotlyjs))
        html = page(page_title, sub, nav, "".join(body) + record, data, js,
                    "Every number is computed on full data; plotted traces are reduced "
                    "for display (values drawn as float32). The machine-readable "
                    "comparison is in the element #refrun-data.")
        if redact_paths:
            html = redact(html, redact_paths)
            mtx = json.loads(redact(json.dumps(mtx), redact_paths))
        return Report(html, figures, self._build_s + time.perf_counter() - t0, mtx)


def build_multi_report(candidates: Iterable[Candidate], *, plotlyjs: str = "embed",
                       max_points: int = DEFAULT_MAX_POINTS, method: str = "minmax",
                       title: str | None = None,
                       redact_paths: Sequence[str] = ()) -> Report:
    """Render one page for one or several candidates (nothing is written).

    With several candidates the page opens with the candidates x criteria matrix
    (:mod:`refrun.report.matrix`), each row linking to that candidate's own section (its
    overview, plots and evidence), folded: a candidate's figures are kept as JSON and
    drawn when its section is opened, so the first screen is the matrix alone however
    many candidates there are.  Candidates are labelled by run name and by the params
    and tags in which they differ.  With one candidate it is the single-candidate report.
    To hold one candidate's comparison at a time, use :class:`PageBuilder` (as
    ``refrun report`` does).
    """
    candidates = list(candidates)
    if not candidates:
        raise RefrunInputError("report: no candidate given")
    builder = PageBuilder(multi=len(candidates) > 1, max_points=max_points, method=method)
    for c in candidates:
        builder.add(c)
    return builder.build(plotlyjs=plotlyjs, title=title, redact_paths=redact_paths)


def build_report(comparison: Comparison, *, assessment: Any = None,
                 plotlyjs: str = "embed", comparison_run_id: str | None = None,
                 max_points: int = DEFAULT_MAX_POINTS, method: str = "minmax",
                 title: str | None = None, redact_paths: Sequence[str] = ()) -> Report:
    """Render the report page for ``comparison`` (nothing is written).

    ``assessment``: an acceptance ``Assessment`` (or its ``to_dict()``), shown in the
    summary when given.  ``plotlyjs``: ``"embed"`` (default), ``"cdn"`` or a path/URL.
    ``max_points``: the most points drawn per trace (``method`` ``"minmax"`` or
    ``"lttb"``); numbers are always computed on all points.
    """
    return build_multi_report([Candidate(comparison, assessment, comparison_run_id)],
                              plotlyjs=plotlyjs, max_points=max_points, method=method,
                              title=title, redact_paths=redact_paths)


def write_html(html: str, path: str | os.PathLike[str]) -> Path:
    """Write a built page (:attr:`Report.html`) to ``path`` through a temporary name, so
    a failure never leaves a half-written report."""
    from refrun.util.outputs import write_output

    return write_output(path, html, "--html")


def write_report(comparison: Comparison, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write the report for ``comparison`` to ``path`` (UTF-8) and return the path.

    Keyword arguments are those of :func:`build_report`.  The file is written to a
    temporary name first and renamed, so a failure never leaves a half-written report.
    """
    check_output(path, "--html")
    return write_html(build_report(comparison, **kwargs).html, path)


def write_multi_report(candidates: list[Candidate], path: str | os.PathLike[str],
                       **kwargs: Any) -> tuple[Path, dict[str, Any]]:
    """Write the page of :func:`build_multi_report` to ``path``; return the path and the
    candidates x criteria matrix (the ``--json`` data)."""
    check_output(path, "--html")
    rep = build_multi_report(candidates, **kwargs)
    return write_html(rep.html, path), rep.matrix


def log_report(path: str | os.PathLike[str], run_id: str,
               tracking_uri: str | None = None) -> str:
    """Log the report file as artifact ``refrun/report.html`` of ``run_id`` (e.g. the
    comparison run) so it opens from the MLflow UI's artifact view; returns the artifact
    path."""

    from refrun.store.client import client as store_client

    client = store_client(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="refrun-report-") as tmp:
        named = Path(tmp) / Path(ARTIFACT_REPORT).name
        shutil.copyfile(path, named)
        client.log_artifact(run_id, str(named), artifact_path=str(Path(ARTIFACT_REPORT).parent))
    return ARTIFACT_REPORT
