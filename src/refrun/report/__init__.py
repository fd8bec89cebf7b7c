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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    page,
    plotlyjs_tag,
    script_json,
    tag,
)
from refrun.report.output import check_writable
from refrun.report.overview import Departure

ARTIFACT_REPORT = schema.ARTIFACT_REPORT
__all__ = ["ARTIFACT_REPORT", "Candidate", "Report", "build_multi_report", "build_report",
           "check_writable", "log_report", "write_multi_report", "write_report"]


@dataclass(frozen=True, eq=False)
class Report:
    """A rendered report: the page text, its figures, and how long building took."""

    html: str
    figures: list[FigureSpec] = field(repr=False)
    build_s: float = 0.0
    matrix: dict[str, Any] = field(default_factory=dict, repr=False)


def _template() -> dict[str, Any]:
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def _figure_json(spec: FigureSpec) -> dict[str, Any]:
    d = spec.figure.to_plotly_json()
    layout = dict(d.get("layout", {}))
    layout.pop("template", None)  # one shared template for the page, set by the script
    return {"id": spec.id, "data": d["data"], "layout": layout}


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


def _title(cmps: list[Comparison], title: str | None) -> str:
    first = cmps[0]
    refs, cand = run_labels(first)
    workload = first.candidate.workload or first.reference[0].workload or "runs"
    ref_hw = first.reference[0].hardware or refs[0]
    if title:
        return title
    if len(cmps) > 1:
        return f"refrun report: {workload}: {len(cmps)} candidates vs {ref_hw}"
    return f"refrun report: {workload}: {ref_hw} vs {first.candidate.hardware or cand}"


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


def candidate_labels(candidates: Sequence[Candidate]) -> list[str]:
    """Distinct labels of the candidates of one page: run name (else the role/hardware
    label) and the params and tags in which they differ (:mod:`refrun.report.labels`)."""
    runs = []
    for c in candidates:
        r = c.comparison.candidate
        name = r.tags.get(schema.TAG_RUN_NAME) or run_labels(c.comparison)[1]
        runs.append(L.Labelled(r.run_id, name, L.properties(r.params, r.tags)))
    return L.distinct_labels(runs)


def _figure_blocks(per_candidate: list[list[FigureSpec]]) -> tuple[list[Any], list[dict]]:
    """The figures' JSON of several candidates with every array that occurs more than
    once (the references' curves, drawn in each candidate's figures) stored once in a
    shared pool and replaced by ``{"pool": k}``: lossless, and it keeps a page of a
    hundred candidates from repeating the same reference curves a hundred times."""
    docs = [[_figure_json(f) for f in figs] for figs in per_candidate]
    seen: dict[str, int] = {}

    def count(o: Any) -> None:
        if isinstance(o, dict):
            if isinstance(o.get("bdata"), str):
                seen[o["bdata"]] = seen.get(o["bdata"], 0) + 1
                return
            for v in o.values():
                count(v)
        elif isinstance(o, list | tuple):
            for v in o:
                count(v)

    count(docs)
    pool: list[Any] = []
    index: dict[str, int] = {}

    def swap(o: Any) -> Any:
        if isinstance(o, dict):
            b = o.get("bdata")
            if isinstance(b, str) and seen.get(b, 0) > 1:
                if b not in index:
                    index[b] = len(pool)
                    pool.append(o)
                return {"pool": index[b]}
            return {k: swap(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [swap(v) for v in o]
        return o

    return pool, [{"figures": swap(d)} for d in docs]


def build_multi_report(candidates: list[Candidate], *, plotlyjs: str = "embed",
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
    """
    if not candidates:
        raise RefrunInputError("report: no candidate given")
    _check(max_points, method)
    t0 = time.perf_counter()
    red = Reduction(max_points, method)
    ids = S.FigureIds()
    multi = len(candidates) > 1
    labels = candidate_labels(candidates) if multi else [
        run_labels(candidates[0].comparison)[1]]
    body, nav, figs, rows, records = [], [], [], [], []
    per_candidate: list[list[FigureSpec]] = []
    for i, c in enumerate(candidates):
        a = assessment_dict(c.assessment)
        ns = f"c{i}-" if multi else ""
        secs, deps = _candidate_sections(c, a, ids, red, ns)
        mine = [f for s in secs for f in s.figures]
        figs += mine
        per_candidate.append(mine)
        cand_label = labels[i]
        anchor = f"cand-{i}" if multi else "overview"
        rows.append(M.row(c.comparison.candidate.run_id, cand_label, anchor, a,
                          c.comparison_run_id, deps, c.comparison_url))
        records.append({"comparison": c.comparison.to_dict(), "assessment": a,
                        "comparison_run_id": c.comparison_run_id, "label": cand_label,
                        "departures": [d.to_dict() for d in deps]})
        inner = "".join(s.html() for s in secs)
        if multi:
            inner = namespace_ids(inner, ns)
            verdict = (a or {}).get("verdict")
            head = (f'<h2>Candidate {i + 1}: {esc(cand_label)} '
                    f"<code>{esc(c.comparison.candidate.run_id)}</code>"
                    + (f" {M.badge(verdict)}" if verdict else "") + "</h2>")
            body.append(f'<details class="candidate" id="{anchor}"><summary>{head}'
                        f'<span class="caption">{len(mine)} figure(s), drawn when opened'
                        f"</span></summary>{inner}"
                        '<p class="note"><a href="#matrix">back to the matrix</a></p>'
                        "</details>")
            if len(candidates) <= NAV_MAX_CANDIDATES:  # else the matrix is the index
                nav.append((anchor, f"{i + 1}: {cand_label}"))
        else:
            body.append(inner)
            nav += [(s.id, s.heading) for s in secs]
    mtx = M.matrix(rows)
    if multi:
        head = S.Section("matrix", "Candidates × criteria", join([
            tag("p", "One row per candidate: verdict, highest level, the metric that "
                     "departs most (mean |z|, or mean rel diff with one reference) and each "
                     "criterion's outcome with its key number. Candidates are named by "
                     "run name and the params and tags in which they differ. Click a "
                     "candidate to open its section (its figures are drawn then).",
                "note"),
            Raw('<div class="scroll">'), M.matrix_table(rows), Raw("</div>")]))
        body.insert(0, head.html())
        nav.insert(0, ("matrix", "matrix"))
        pool, blocks = _figure_blocks(per_candidate)
        data = script_json({"template": _template(), "figures": [], "pool": pool,
                            "lazy": True}, "refrun-figures")
        data = Raw(data + "".join(script_json(b, f"refrun-figures-cand-{i}")
                                  for i, b in enumerate(blocks)))
    else:
        data = script_json({"template": _template(),
                            "figures": [_figure_json(f) for f in figs]}, "refrun-figures")
    first = candidates[0]
    blob: dict[str, Any] = dict(records[0]) if not multi else {"candidates": records}
    blob.update(matrix=mtx, refrun_version=__version__)
    record = script_json(blob, "refrun-data")
    cmps = [c.comparison for c in candidates]
    page_title = _title(cmps, title)
    created = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    what = (f"candidate {first.comparison.candidate.run_id}" if not multi
            else f"{len(candidates)} candidates")
    sub = (f"{len(first.comparison.reference)} reference run(s) vs {what} · "
           f"{len(first.comparison.metrics)} metrics compared · generated {created} by "
           f"refrun {__version__}")
    # Several candidates, plotly.js embedded: kept as inert text until a section opens.
    js = deferred_plotlyjs_tag() if multi and plotlyjs == "embed" else plotlyjs_tag(plotlyjs)
    html = page(page_title, sub, nav, "".join(body) + record, data, js,
                "Every number is computed on full data; plotted traces are reduced for "
                "display (values drawn as float32). The machine-readable comparison is in "
                "the element #refrun-data.")
    if redact_paths:
        html = redact(html, redact_paths)
        mtx = json.loads(redact(json.dumps(mtx), redact_paths))
    return Report(html, figs, time.perf_counter() - t0, mtx)


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


def _write(html: str, path: str | os.PathLike[str]) -> Path:
    out = check_writable(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RefrunInputError(f"--html {path}: cannot write ({exc.strerror or exc})") from exc
    return out


def write_report(comparison: Comparison, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write the report for ``comparison`` to ``path`` (UTF-8) and return the path.

    Keyword arguments are those of :func:`build_report`.  The file is written to a
    temporary name first and renamed, so a failure never leaves a half-written report.
    """
    check_writable(path)
    return _write(build_report(comparison, **kwargs).html, path)


def write_multi_report(candidates: list[Candidate], path: str | os.PathLike[str],
                       **kwargs: Any) -> tuple[Path, dict[str, Any]]:
    """Write the page of :func:`build_multi_report` to ``path``; return the path and the
    candidates x criteria matrix (the ``--json`` data)."""
    check_writable(path)
    rep = build_multi_report(candidates, **kwargs)
    return _write(rep.html, path), rep.matrix


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
