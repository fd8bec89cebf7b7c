"""The finite-difference V curve as a plotly figure (run artifact and HTML reports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from refrun.gradcheck.finite_diff import FiniteDiffResult

_COLORS = {"verified": "#2ca02c", "suspect": "#ff7f0e", "wrong": "#d62728"}


def fd_figure(results: Sequence[FiniteDiffResult], title: str = "") -> Any:
    """Log-log relative error vs step size, one line per (result, direction), the step
    axis reversed as in seed 002 (large steps on the left)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in results:
        for c in r.curves:
            fig.add_trace(go.Scatter(
                x=list(r.steps), y=[max(e, 1e-18) for e in c.rel_error], mode="lines+markers",
                name=f"{r.label} [{r.dtype}] d{c.direction}: {c.verdict}",
                line={"color": _COLORS.get(c.verdict)},
                hovertemplate="h=%{x:.0e}<br>relative error=%{y:.2e}<extra></extra>"))
    fig.update_xaxes(type="log", autorange="reversed", title="finite-difference step h")
    fig.update_yaxes(type="log", title="relative error vs autodiff", exponentformat="e")
    fig.update_layout(title=title or "Finite-difference check: truncation (left) meets "
                      "roundoff (right)", template="plotly_white", height=450)
    return fig


def fd_html(results: Sequence[FiniteDiffResult], *, full_html: bool = True,
            include_plotlyjs: bool | str = True) -> str:
    """The figure as HTML; ``include_plotlyjs=True`` embeds plotly.js (works offline),
    ``full_html=False`` gives a ``<div>`` to embed in a larger report."""
    return fd_figure(results).to_html(full_html=full_html, include_plotlyjs=include_plotlyjs)
