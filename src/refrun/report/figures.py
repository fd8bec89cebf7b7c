"""The report's plotly figures, built from a :class:`~refrun.comparison.Comparison`.

Every figure is a :class:`FigureSpec`: an id, a title (plain text, escaped by the page),
and a ``plotly.graph_objects.Figure`` whose traces are reduced for display by
:mod:`refrun.report.downsample` (steps as int32 or float64, values as float32: display
precision only; every number in the report's tables comes from full data).

Strings that came from a run (metric names, run labels, op names) are passed through
:func:`plot_text`, so plotly shows them as text and never interprets them as its
HTML-like label markup.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from refrun import schema
from refrun.comparison import Comparison, MetricComparison, RunData, resolve_series
from refrun.report.downsample import DEFAULT_MAX_POINTS, reduce_indices, union_indices

REF_COLORS = ("#1f77b4", "#6baed6", "#08519c", "#9ecae1", "#3182bd", "#2171b5")
CAND_COLOR = "#d62728"
DIFF_COLOR = "#6a3d9a"
BAND_COLOR = "rgba(31,119,180,0.22)"


@dataclass(frozen=True, eq=False)
class FigureSpec:
    """One figure of the page: ``id`` is the DOM id of its container."""

    id: str
    title: str
    figure: go.Figure
    caption: str = ""

    @property
    def traces(self) -> int:
        """Number of traces (what the rendered SVG must contain)."""
        return len(self.figure.data)


@dataclass(frozen=True)
class Reduction:
    """How plotted traces are reduced (never the numbers)."""

    max_points: int = DEFAULT_MAX_POINTS
    method: str = "minmax"


def plot_text(s: object) -> str:
    """``s`` as plotly label text: ``<``, ``>`` and ``&`` become entities plotly prints
    literally, so a run string can never become plotly label markup."""
    return html.escape(str(s), quote=False)


def _steps_array(steps: np.ndarray) -> np.ndarray:
    s = np.asarray(steps)
    if len(s) and (s.max() >= 2**31 or s.min() < -(2**31)):
        return s.astype(np.float64)
    return s.astype(np.int32)


def _values_array(v: np.ndarray) -> np.ndarray:
    # float32 halves the embedded size; values beyond its range would become Inf.
    v = np.asarray(v, dtype=np.float64)
    finite = v[np.isfinite(v)]
    if len(finite) and np.abs(finite).max() > 3e38:
        return v
    return v.astype(np.float32)


def run_label(run: RunData, index: int | None = None) -> str:
    """``reference (h100, seed 0)``-style label of a run (plain text, not escaped)."""
    role = run.role or "run"
    if index is not None:
        role = f"{role} {index + 1}"
    bits = [b for b in (run.hardware, run.backend) if b]
    if run.seed is not None:
        bits.append(f"seed {run.seed}")
    return f"{role} ({', '.join(bits)})" if bits else role


def run_labels(cmp: Comparison) -> tuple[list[str], str]:
    """Labels of the reference runs and of the candidate."""
    many = len(cmp.reference) > 1
    refs = [run_label(r, i if many else None) for i, r in enumerate(cmp.reference)]
    return refs, run_label(cmp.candidate)


def _line(x: np.ndarray, y: np.ndarray, name: str, color: str, red: Reduction,
          **kw: object) -> go.Scatter:
    idx = reduce_indices(x, y, red.max_points, red.method)
    kw.setdefault("mode", "lines")
    line: dict[str, object] = {"color": color, "width": 1.4}
    if "line_dash" in kw:
        line["dash"] = kw.pop("line_dash")
    return go.Scatter(x=_steps_array(x[idx]), y=_values_array(y[idx]), name=plot_text(name),
                      line=line, **kw)


def _base_layout(fig: go.Figure, height: int, ytitle: str = "", xtitle: str = "step") -> None:
    fig.update_layout(
        height=height, margin={"l": 70, "r": 20, "t": 30, "b": 45}, hovermode="x",
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0,
                "traceorder": "normal"},
    )
    fig.update_xaxes(title_text=xtitle, row=None)
    if ytitle:
        fig.update_yaxes(title_text=plot_text(ytitle))


DEFAULT_K = 3.0  # the envelope criterion's default band width (acceptance.criteria)
LOG_DECADES = 2.0  # a positive curve spanning at least this many decades gets a log axis


@dataclass(frozen=True)
class Marker:
    """A vertical marker on a step axis: the first departure or a failing criterion."""

    step: float
    label: str
    color: str = "#b2182b"
    dash: str = "dash"


def spans_decades(*arrays: np.ndarray, decades: float = LOG_DECADES) -> bool:
    """True when every finite value is positive and max / min >= 10**decades."""
    vals = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    vals = vals[np.isfinite(vals)]
    if not len(vals) or vals.min() <= 0:
        return False
    return bool(np.log10(vals.max() / vals.min()) >= decades)


def _band(fig: go.Figure, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, red: Reduction,
          name: str, fill: str, row: int, line: dict[str, object] | None = None,
          legend: bool = True) -> None:
    # A band's two edges share one x array of their union: half the points each keeps
    # the band at about max_points (bands are context; spikes survive minmax buckets).
    half = max(10, red.max_points // 2)
    idx = union_indices(reduce_indices(x, lo, half, red.method),
                        reduce_indices(x, hi, half, red.method))
    xs = _steps_array(x[idx])
    edge = line or {"width": 0}
    fig.add_trace(go.Scatter(x=xs, y=_values_array(lo[idx]), mode="lines", line=edge,
                             name=plot_text(name), showlegend=False, hoverinfo="skip",
                             legendgroup=name), row=row, col=1)
    fig.add_trace(go.Scatter(x=xs, y=_values_array(hi[idx]), mode="lines", line=edge,
                             fill="tonexty", fillcolor=fill, name=plot_text(name),
                             legendgroup=name, showlegend=legend), row=row, col=1)


def add_markers(fig: go.Figure, markers: Sequence[Marker]) -> None:
    """Vertical lines across every panel of ``fig``, each labelled once at the top (labels
    alternate above and just inside the top edge, so neighbours do not overprint)."""
    for i, mk in enumerate(sorted(markers, key=lambda m: m.step)):
        fig.add_vline(x=mk.step, line={"color": mk.color, "width": 1.2, "dash": mk.dash})
        fig.add_annotation(x=mk.step, y=1.0, xref="x", yref="paper",
                           yanchor="bottom" if i % 2 == 0 else "top", xanchor="left",
                           text=plot_text(mk.label), showarrow=False,
                           bgcolor="rgba(255,255,255,0.8)",
                           font={"size": 10, "color": mk.color})


def metric_figure(mc: MetricComparison, ref_names: Sequence[str], cand_name: str,
                  red: Reduction, markers: bool = False, k: float = DEFAULT_K,
                  marks: Sequence[Marker] = ()) -> go.Figure:
    """Linked panels on the aligned steps (zooming one zooms all): the curves (the
    reference group as its min-max range and its mean +/- ``k`` standard deviations, the
    candidate on top), the difference candidate - reference and, for a group, ``z`` =
    (candidate - mean) / std with lines at +/- ``k``.  ``marks``: vertical markers (first
    departure, failing criteria).  The curve panel is logarithmic when the values span
    two decades or more."""
    f = mc.frame
    x = f["step"].to_numpy()
    group = "ref_min" in f
    rows = 3 if group else 2
    heights = [0.56, 0.22, 0.22] if group else [0.66, 0.34]
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        row_heights=heights)
    mode = "lines+markers" if markers else "lines"
    if group:
        _band(fig, x, f["ref_min"].to_numpy(), f["ref_max"].to_numpy(), red,
              f"seed range ({len(ref_names)} runs)", BAND_COLOR, 1)
        mean, std = f["ref_mean"].to_numpy(), f["ref_std"].to_numpy()
        _band(fig, x, mean - k * std, mean + k * std, red, f"mean ± {k:g}σ",
              "rgba(31,119,180,0.07)", 1,
              {"width": 0.8, "dash": "dot", "color": "rgba(31,119,180,0.6)"})
        ref_name = f"reference mean ({len(ref_names)} runs)"
    else:
        ref_name = ref_names[0]
    fig.add_trace(_line(x, f["reference"].to_numpy(), ref_name, REF_COLORS[0], red,
                        mode=mode), row=1, col=1)
    fig.add_trace(_line(x, f["candidate"].to_numpy(), cand_name, CAND_COLOR, red, mode=mode),
                  row=1, col=1)
    fig.add_trace(_line(x, f["diff"].to_numpy(), "difference (candidate - reference)",
                        DIFF_COLOR, red, mode=mode), row=2, col=1)
    if group:
        fig.add_trace(_line(x, f["z"].to_numpy(), "z (in seed σ)", "#e6550d", red, mode=mode),
                      row=3, col=1)
        for y in (-k, k):
            fig.add_hline(y=y, line={"color": "#e6550d", "width": 1, "dash": "dot"},
                          row=3, col=1)
        fig.update_yaxes(title_text="z (σ)", row=3, col=1)
    _base_layout(fig, 560 if group else 460)
    for r in range(1, rows):
        fig.update_xaxes(title_text="", row=r, col=1)
    fig.update_yaxes(title_text=plot_text(mc.metric), row=1, col=1)
    if spans_decades(f["reference"].to_numpy(), f["candidate"].to_numpy()):
        fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(title_text="difference", row=2, col=1)
    fig.add_hline(y=0, line={"color": "#999", "width": 1, "dash": "dot"}, row=2, col=1)
    add_markers(fig, marks)
    return fig


# Colours of |z| in the all-metric picture: within the seeds' spread pale, beyond 3σ red.
Z_COLORSCALE = [[0.0, "#f7f7f7"], [1 / 6, "#fde0c5"], [2 / 6, "#fdb366"],
                [3 / 6, "#f4663f"], [4 / 6, "#d7301f"], [1.0, "#7f0000"]]
Z_MAX = 6.0


def strip_figure(values: np.ndarray, edges: np.ndarray, metrics: Sequence[str],
                 measure: str, first_steps: Sequence[int | None]) -> go.Figure:
    """The all-metric picture: one row per metric (ranked, largest departure on top),
    colour = the largest ``measure`` in each step bin; a black cross marks the first step
    each metric left the reference band."""
    centres = (edges[:-1] + edges[1:]) / 2
    names = [plot_text(m) for m in metrics]
    zmax = Z_MAX if measure == "|z|" else max(1e-12, float(np.nanmax(values))
                                               if np.isfinite(values).any() else 1.0)
    text = np.char.add(np.char.add(np.floor(edges[:-1]).astype(np.int64).astype(str), "–"),
                       (np.ceil(edges[1:]) - 1).astype(np.int64).astype(str))
    fig = go.Figure(go.Heatmap(
        z=values.astype(np.float32), x=_steps_array(np.round(centres)) if
        np.all(np.diff(np.round(centres)) > 0) else centres, y=names,
        zmin=0, zmax=zmax, colorscale=Z_COLORSCALE if measure == "|z|" else "Oranges",
        colorbar={"title": {"text": measure, "side": "right"}, "thickness": 10, "len": 1,
                  "outlinewidth": 0},
        customdata=np.broadcast_to(text, values.shape),
        hovertemplate="%{y}<br>steps %{customdata}<br>max " + measure
                      + " = %{z:.3g}<extra></extra>",
        xgap=0, ygap=2, name="departure"))
    fx = [s for s in first_steps if s is not None]
    fy = [n for n, s in zip(names, first_steps, strict=True) if s is not None]
    fig.add_trace(go.Scatter(x=fx, y=fy, mode="markers", name="first step out of band",
                             marker={"symbol": "x-thin", "size": 11, "color": "#111",
                                     "line": {"width": 2, "color": "#111"}},
                             hovertemplate="%{y}: first out of band at step %{x}"
                                           "<extra></extra>"))
    fig.update_layout(height=int(70 + 26 * len(metrics)),
                      margin={"l": 10, "r": 10, "t": 10, "b": 40}, showlegend=False,
                      plot_bgcolor="#ffffff")
    fig.update_yaxes(autorange="reversed", automargin=True, type="category")
    fig.update_xaxes(title_text="step", showgrid=False)
    return fig


def timeline_figure(cmp: Comparison, primary: str | None, evals: Sequence[str],
                    step_time: str | None, counters: Sequence[tuple[str, list[str]]],
                    red: Reduction, marks: Sequence[Marker] = ()) -> go.Figure | None:
    """Everything on the loss's step axis, one linked panel each: the primary metric
    (reference band and candidate), the evaluation metrics, step time (log) and the
    per-step counter families (compilations, transfers, fallback ops)."""
    panels: list[tuple[str, list[go.Scatter], bool]] = []
    refs, cand = run_labels(cmp)
    # An overview: half the resolution of the per-metric figures below it.
    red = Reduction(max(10, red.max_points // 2), red.method)
    if primary is not None and primary in cmp.metrics:
        f = cmp.metrics[primary].frame
        x = f["step"].to_numpy()
        tr = []
        if "ref_min" in f:
            idx = union_indices(reduce_indices(x, f["ref_min"].to_numpy(), red.max_points,
                                               red.method),
                                reduce_indices(x, f["ref_max"].to_numpy(), red.max_points,
                                               red.method))
            xs = _steps_array(x[idx])
            tr.append(go.Scatter(x=xs, y=_values_array(f["ref_min"].to_numpy()[idx]),
                                 mode="lines", line={"width": 0}, hoverinfo="skip",
                                 showlegend=False, name="seed range"))
            tr.append(go.Scatter(x=xs, y=_values_array(f["ref_max"].to_numpy()[idx]),
                                 mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor=BAND_COLOR, name="reference seed range"))
        tr.append(_line(x, f["reference"].to_numpy(), "reference" + (" mean" if len(refs) > 1
                                                                    else ""),
                        REF_COLORS[0], red))
        tr.append(_line(x, f["candidate"].to_numpy(), cand, CAND_COLOR, red))
        panels.append((primary, tr, spans_decades(f["reference"].to_numpy(),
                                                  f["candidate"].to_numpy())))
    for name in evals:
        f = cmp.metrics[name].frame
        x = f["step"].to_numpy()
        panels.append((name, [
            _line(x, f["reference"].to_numpy(), f"{name} reference", REF_COLORS[0], red,
                  mode="lines+markers", showlegend=False),
            _line(x, f["candidate"].to_numpy(), f"{name} candidate", CAND_COLOR, red,
                  mode="lines+markers", showlegend=False)], False))
    families = ([(step_time, [step_time])] if step_time else []) + list(counters)
    for label, metrics in families:
        tr = []
        for metric in metrics:
            for i, (lab, run, color) in enumerate(runs_of(cmp)):
                if run is not cmp.candidate and i > 0:
                    continue  # one reference run is enough to show the pattern
                got = resolved(run, metric, cmp.options.keep)
                if got is not None:
                    tr.append(_line(got[0], got[1], f"{metric} · {lab}", color, red,
                                    showlegend=False))
        if tr:
            log = label == step_time and spans_decades(*[t.y for t in tr], decades=0.5)
            panels.append((label.replace("/", "/*", 1) if label != step_time else label,
                           tr, log))
    if len(panels) < 2:
        return None
    n = len(panels)
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.025,
                        row_heights=[2.0] + [1.0] * (n - 1))
    for r, (title, traces, log) in enumerate(panels, start=1):
        for t in traces:
            fig.add_trace(t, row=r, col=1)
        fig.update_yaxes(title_text=plot_text(title), title_font={"size": 11},
                         type="log" if log else None, nticks=4 if log else None,
                         row=r, col=1)
    _base_layout(fig, int(150 + 110 * (n + 1)))
    for r in range(1, n):
        fig.update_xaxes(title_text="", row=r, col=1)
    add_markers(fig, marks)
    return fig


def runs_of(cmp: Comparison) -> list[tuple[str, RunData, str]]:
    """``(label, run, color)`` for every reference run and the candidate."""
    refs, cand = run_labels(cmp)
    out = [(lab, r, REF_COLORS[i % len(REF_COLORS)])
           for i, (lab, r) in enumerate(zip(refs, cmp.reference, strict=True))]
    out.append((cand, cmp.candidate, CAND_COLOR))
    return out


def resolved(run: RunData, metric: str, keep: str) -> tuple[np.ndarray, np.ndarray] | None:
    """One value per step of ``metric`` in ``run`` (the comparison's ``keep`` rule), or None."""
    if metric not in run.metric_names:
        return None
    s = resolve_series(*run.series(metric), keep=keep)  # type: ignore[arg-type]
    return s.steps, s.values


def series_figure(cmp: Comparison, metrics: Sequence[str], red: Reduction,
                  ytitle: str = "", height: int = 320, log_y: bool = False
                  ) -> go.Figure | None:
    """Each metric of ``metrics`` over steps, one trace per (metric, run) that has it.
    ``log_y``: logarithmic y axis when every finite value is positive (step times: the
    warm-up spikes and the steady band both stay readable)."""
    positive = True
    fig = go.Figure()
    dashes = ("solid", "dot", "dash", "dashdot", "longdash")
    for mi, metric in enumerate(metrics):
        for label, run, color in runs_of(cmp):
            got = resolved(run, metric, cmp.options.keep)
            if got is None:
                continue
            name = f"{metric} · {label}" if len(metrics) > 1 else label
            fin = got[1][np.isfinite(got[1])]
            positive = positive and bool(len(fin)) and bool((fin > 0).all())
            fig.add_trace(_line(got[0], got[1], name, color, red,
                                line_dash=dashes[mi % len(dashes)]))
    if not fig.data:
        return None
    _base_layout(fig, height, ytitle or (metrics[0] if len(metrics) == 1 else ""))
    if log_y and positive:
        fig.update_yaxes(type="log")
    return fig


@dataclass(frozen=True)
class Distribution:
    """Histogram of one run's steady-window values (computed on every point)."""

    label: str
    color: str
    counts: np.ndarray
    edges: np.ndarray
    n: int


def step_time_distributions(cmp: Comparison, metric: str, warmup_end_step: int | None,
                            bins: int = 60) -> list[Distribution]:
    """Histograms of ``metric`` (seconds) per run over steps >= ``warmup_end_step``, on
    common bin edges spanning the 0.5th-99.5th percentile of all runs' values (the tails
    are counted in the outermost bins)."""
    data = []
    for label, run, color in runs_of(cmp):
        got = resolved(run, metric, cmp.options.keep)
        if got is None:
            continue
        steps, vals = got
        keep = np.isfinite(vals)
        if warmup_end_step is not None:
            keep &= steps >= warmup_end_step
        data.append((label, color, vals[keep]))
    pooled = np.concatenate([v for _, _, v in data]) if data else np.zeros(0)
    if not len(pooled):
        return []
    lo, hi = np.percentile(pooled, [0.5, 99.5])
    if hi <= lo:
        lo, hi = lo - 0.5 * abs(lo or 1) * 1e-3, hi + 0.5 * abs(hi or 1) * 1e-3
    edges = np.linspace(lo, hi, bins + 1)
    out = []
    for label, color, v in data:
        counts, _ = np.histogram(np.clip(v, lo, hi), bins=edges)
        out.append(Distribution(label, color, counts, edges, len(v)))
    return out


def distribution_figure(dists: Sequence[Distribution], xtitle: str) -> go.Figure | None:
    """Overlaid histograms (bars at the bin centres, fraction of each run's steps)."""
    if not dists:
        return None
    fig = go.Figure()
    for d in dists:
        centres = (d.edges[:-1] + d.edges[1:]) / 2
        frac = d.counts / max(d.n, 1)
        fig.add_trace(go.Bar(x=centres, y=frac, name=plot_text(f"{d.label} (n={d.n})"),
                             marker_color=d.color, opacity=0.6,
                             width=float(d.edges[1] - d.edges[0])))
    fig.update_layout(barmode="overlay")
    _base_layout(fig, 300, "fraction of steps", plot_text(xtitle))
    return fig


def fallback_ops(run: RunData) -> dict[str, float] | None:
    """CPU-fallback op counts by name from the XLA probe's tag, or None when the run has
    no such tag or it is not a JSON object of numbers."""
    raw = run.tags.get(schema.TAG_FALLBACK_OPS)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    out: dict[str, float] = {}
    for k, v in obj.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[str(k)] = float(v)
        elif isinstance(v, dict) and isinstance(v.get("count"), int | float):
            out[str(k)] = float(v["count"])
    return out


def fallback_figure(cmp: Comparison) -> go.Figure | None:
    """Horizontal bars: executions of each CPU-fallback op, one trace per run that
    recorded the fallback tag (runs with an empty ``{}`` are shown with no bars)."""
    per = [(label, color, fallback_ops(run)) for label, run, color in runs_of(cmp)]
    per = [(lab, col, ops) for lab, col, ops in per if ops is not None]
    names = sorted({k for _, _, ops in per for k in ops})
    if not names:
        return None
    fig = go.Figure()
    for label, color, ops in per:
        fig.add_trace(go.Bar(y=[plot_text(n) for n in names],
                             x=[ops.get(n, 0.0) for n in names], orientation="h",
                             name=plot_text(label), marker_color=color))
    fig.update_layout(barmode="group")
    _base_layout(fig, max(220, 40 + 26 * len(names) * len(per)), "", "executions")
    return fig


def counter_groups(cmp: Comparison) -> list[tuple[str, list[str]]]:
    """Per-step counter metrics present in any run, grouped by family prefix
    (``compile/``, ``xfer/`` ...); seconds-valued counters get their own group."""
    names = sorted({m for r in [*cmp.reference, cmp.candidate] for m in r.metric_names})
    groups: list[tuple[str, list[str]]] = []
    for prefix in cmp.options.counter_prefixes:
        family = [m for m in names if m.startswith(prefix)]
        counts = [m for m in family if not m.endswith("_s")]
        secs = [m for m in family if m.endswith("_s")]
        if counts:
            groups.append((prefix, counts))
        if secs:
            groups.append((prefix + " (seconds)", secs))
    return groups


def sys_metrics(cmp: Comparison) -> list[str]:
    """Utilization metrics (``sys/*``) present in any run."""
    return sorted({m for r in [*cmp.reference, cmp.candidate] for m in r.metric_names
                   if m.startswith(schema.SYS_PREFIX)})
