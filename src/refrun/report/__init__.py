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
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refrun._version import __version__
from refrun.comparison import Comparison
from refrun.errors import RefrunInputError
from refrun.report import sections as S
from refrun.report.assessment import assessment_dict
from refrun.report.downsample import DEFAULT_MAX_POINTS
from refrun.report.figures import FigureSpec, Reduction, run_labels
from refrun.report.html import page, plotlyjs_tag, script_json

ARTIFACT_REPORT = "refrun/report.html"
__all__ = ["ARTIFACT_REPORT", "Report", "build_report", "log_report", "write_report"]


@dataclass(frozen=True, eq=False)
class Report:
    """A rendered report: the page text, its figures, and how long building took."""

    html: str
    figures: list[FigureSpec] = field(repr=False)
    build_s: float = 0.0


def _template() -> dict[str, Any]:
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def _figure_json(spec: FigureSpec) -> dict[str, Any]:
    d = spec.figure.to_plotly_json()
    layout = dict(d.get("layout", {}))
    layout.pop("template", None)  # one shared template for the page, set by the script
    return {"id": spec.id, "data": d["data"], "layout": layout}


def build_report(comparison: Comparison, *, assessment: Any = None,
                 plotlyjs: str = "embed", comparison_run_id: str | None = None,
                 max_points: int = DEFAULT_MAX_POINTS, method: str = "minmax",
                 title: str | None = None) -> Report:
    """Render the report page for ``comparison`` (nothing is written).

    ``assessment``: an acceptance ``Assessment`` (or its ``to_dict()``), shown in the
    summary when given.  ``plotlyjs``: ``"embed"`` (default), ``"cdn"`` or a path/URL.
    ``max_points``: the most points drawn per trace (``method`` ``"minmax"`` or
    ``"lttb"``); numbers are always computed on all points.
    """
    if max_points < 10:
        raise RefrunInputError(f"max_points: {max_points} is too small (at least 10)")
    if method not in ("minmax", "lttb"):
        raise RefrunInputError(f"method: {method!r} is not 'minmax' or 'lttb'")
    t0 = time.perf_counter()
    a = assessment_dict(assessment)
    red = Reduction(max_points, method)
    ids = S.FigureIds()
    secs = [S.summary_section(comparison, a, comparison_run_id),
            S.metrics_section(comparison, ids, red),
            S.eval_section(comparison, ids, red),
            S.runtime_section(comparison, ids, red),
            S.alignment_section(comparison)]
    present = [s for s in secs if s is not None]
    figs = [f for s in present for f in s.figures]
    data = script_json({"template": _template(), "figures": [_figure_json(f) for f in figs]},
                       "refrun-figures")
    record = script_json({"comparison": comparison.to_dict(), "assessment": a,
                          "comparison_run_id": comparison_run_id,
                          "refrun_version": __version__}, "refrun-data")
    refs, cand = run_labels(comparison)
    workload = comparison.candidate.workload or comparison.reference[0].workload or "runs"
    ref_hw = comparison.reference[0].hardware or refs[0]
    page_title = title or f"refrun report: {workload}: {ref_hw} vs " \
                          f"{comparison.candidate.hardware or cand}"
    created = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sub = (f"{len(comparison.reference)} reference run(s) vs candidate "
           f"{comparison.candidate.run_id} · {len(comparison.metrics)} metrics compared · "
           f"generated {created} by refrun {__version__}")
    body = "".join(s.html() for s in present) + record
    html = page(page_title, sub, [(s.id, s.heading) for s in present], body, data,
                plotlyjs_tag(plotlyjs),
                "Every number is computed on full data; plotted traces are reduced for "
                "display (values drawn as float32). The machine-readable comparison is in "
                "the element #refrun-data.")
    return Report(html, figs, time.perf_counter() - t0)


def write_report(comparison: Comparison, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write the report for ``comparison`` to ``path`` (UTF-8) and return the path.

    Keyword arguments are those of :func:`build_report`.  The file is written to a
    temporary name first and renamed, so a failure never leaves a half-written report.
    """
    out = Path(path)
    if out.is_dir():
        raise RefrunInputError(f"--html {out}: is a directory")
    rep = build_report(comparison, **kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(rep.html, encoding="utf-8")
    os.replace(tmp, out)
    return out


def log_report(path: str | os.PathLike[str], run_id: str,
               tracking_uri: str | None = None) -> str:
    """Log the report file as artifact ``refrun/report.html`` of ``run_id`` (e.g. the
    comparison run) so it opens from the MLflow UI's artifact view; returns the artifact
    path."""
    from mlflow.tracking import MlflowClient

    from refrun.tracking import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    with tempfile.TemporaryDirectory(prefix="refrun-report-") as tmp:
        named = Path(tmp) / Path(ARTIFACT_REPORT).name
        shutil.copyfile(path, named)
        client.log_artifact(run_id, str(named), artifact_path=str(Path(ARTIFACT_REPORT).parent))
    return ARTIFACT_REPORT
