"""The report's sections as escaped markup plus the figures they place.

Each ``*_section`` function returns a :class:`Section` (anchor id, heading, markup, the
:class:`~refrun.report.figures.FigureSpec` objects whose containers the markup holds).
All numbers come from the comparison engine's results (full data) or, for the runtime
evidence that the engine does not summarise (step-time distributions), from the runs'
full curves.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from refrun import numerics, schema
from refrun.comparison import Comparison, MetricComparison, RunData
from refrun.report import figures as F
from refrun.report import overview as O
from refrun.report.html import Raw, esc, join, kv_table, num, table, tag

DEVICE_TAG_PREFIXES = schema.DEVICE_TAG_PREFIXES
EVAL_TABLE_ROWS = 400  # eval points shown in full up to this many, else first/last half


@dataclass
class Section:
    """One ``<section>`` of the page."""

    id: str
    heading: str
    body: Raw
    figures: list[F.FigureSpec] = field(default_factory=list)

    def html(self) -> Raw:
        return Raw(f'<section id="{esc(self.id)}"><h2>{esc(self.heading)}</h2>'
                   f"{self.body}</section>")


class FigureIds:
    """Sequential DOM ids for figure containers (never derived from run strings)."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def __call__(self) -> str:
        return f"fig-{next(self._n)}"


def figure_div(spec: F.FigureSpec) -> Raw:
    cap = tag("p", spec.caption, "caption") if spec.caption else ""
    return Raw(f'<div class="figure"><div class="plot" id="{esc(spec.id)}" '
               f'data-title="{esc(spec.title)}" data-traces="{spec.traces}"></div>{cap}</div>')


def _add(figs: list[F.FigureSpec], ids: FigureIds, title: str, fig: go.Figure | None,
         caption: str = "") -> Raw:
    if fig is None:
        return Raw("")
    spec = F.FigureSpec(ids(), title, fig, caption)
    figs.append(spec)
    return figure_div(spec)


# --- summary ---------------------------------------------------------------------------

def _duration(r: RunData) -> str:
    if r.start_time_ms is None or r.end_time_ms is None:
        return ""
    s = max(0, (r.end_time_ms - r.start_time_ms) // 1000)
    return str(_dt.timedelta(seconds=int(s)))


def _versions(r: RunData) -> str:
    fw = sorted((k[len(schema.TAG_FW_PREFIX):], v) for k, v in r.tags.items()
                if k.startswith(schema.TAG_FW_PREFIX))
    parts = [f"{k} {v}" for k, v in fw]
    if schema.TAG_VERSION in r.tags:
        parts.append(f"refrun {r.tags[schema.TAG_VERSION]}")
    return ", ".join(parts)


def points_from_cell(r: RunData) -> Raw:
    """Where the run's points came from, short (``artifact: N points`` / ``MLflow history:
    N points``), with :attr:`RunData.points_from`'s full sentence as the hover title: a
    history-read run is a bounded view, and the reader must see which one was compared."""
    n = f"{r.points:,} point{'s' if r.points != 1 else ''}"
    short = {"artifact": f"artifact: {n}", "history": f"MLflow history: {n}",
             "spool": f"live spool: {n}", "memory": f"in memory: {n}"
             }.get(r.source, f"{r.source}: {n}")
    return tag("span", short, title=r.points_from)


def runs_table(cmp: Comparison) -> Raw:
    """One row per run: identity, versions, status, duration, where its points came from."""
    rows = []
    for label, r, _ in F.runs_of(cmp):
        rows.append((label, tag("code", r.run_id), r.tags.get(schema.TAG_RUN_NAME, ""),
                     r.workload or "", r.hardware or "", r.backend or "",
                     r.tags.get(schema.TAG_CHIPS, ""), r.seed or "", _versions(r),
                     r.status, _duration(r), points_from_cell(r)))
    return table(("run", "run id", "name", "workload", "hardware", "backend", "chips", "seed",
                  "versions", "status", "duration", "points from"), rows, "runs",
                 "runs-table")


def all_tags_details(cmp: Comparison) -> Raw:
    """Every tag and param of every run (collapsed): nothing a run carries is hidden."""
    runs = F.runs_of(cmp)
    rows = []
    for kind, get in (("tag", lambda r: r.tags), ("param", lambda r: r.params)):
        keys = sorted({k for _, r, _ in runs for k in get(r)})
        rows += [(kind, tag("code", k), *[get(r).get(k, "") for _, r, _ in runs])
                 for k in keys]
    return join([Raw("<details><summary>All tags and params of the runs</summary>"
                     '<div class="scroll">'),
                 table(("", "key", *[label for label, _, _ in runs]), rows, "tags",
                       "tags-table"),
                 Raw("</div></details>")])


def headline_table(cmp: Comparison) -> Raw:
    """One row per compared metric with the main measures (all on full data)."""
    group = len(cmp.reference) > 1
    headers = ["metric", "kind", "aligned steps", "mean |diff|", "max |diff|", "at step",
               "mean rel diff", "bias", "diff at last step", "final window mean |diff|"]
    if group:
        headers += ["outside reference band", "mean |z|"]
    headers += ["step time / counter (ref → cand)"]
    rows = []
    for name, m in cmp.metrics.items():
        d = m.measures
        row: list[Any] = [tag("code", name), m.kind, m.alignment.aligned_steps,
                          d.mean_abs_diff, d.max_abs_diff, d.step_of_max_abs_diff,
                          d.mean_rel_diff, d.bias, d.diff_at_last_step,
                          d.final_window.mean_abs_diff]
        if group:
            row += [num(m.group.fraction_outside, pct=True) if m.group else None,
                    m.group.mean_abs_z if m.group else None]
        row.append(_other(m))
        rows.append(row)
    return table(headers, rows, "headline", "headline-table")


def _other(m: MetricComparison) -> Raw:
    if m.step_time is not None and m.step_time.ratio is not None:
        return join(["median ratio ", num(m.step_time.ratio)])
    if m.counters is not None:
        c = m.counters
        return join(["after warm-up ", num(c.reference_after_warmup), " → ",
                     num(c.candidate_after_warmup)])
    return Raw("")


def numerics_table(cmp: Comparison) -> Raw:
    """How each run carried out its float32 matmuls and convolutions
    (:func:`refrun.numerics.of_run`) and its numerics settings (``refrun.numerics.*``
    tags); a row where the candidate differs from a reference
    (:func:`refrun.numerics.differences`) is marked.  Empty when no run recorded any."""
    runs = F.runs_of(cmp)
    tagged = [numerics.setting_tags(r.tags) for _, r, _ in runs]
    if not any(tagged):
        return Raw("")
    differ = {d["what"] for d in numerics.differences(
        cmp.candidate.tags, {r.run_id: r.tags for r in cmp.reference})}
    nums = [numerics.of_run(r.tags) for _, r, _ in runs]
    rows = []
    for what, get in (("float32 matmuls", lambda n: n.matmul),
                      ("float32 convolutions", lambda n: n.conv)):
        both = "float32 matmuls and convolutions"
        cls = "warn" if what in differ or both in differ else ""
        rows.append((tag("span", what, cls), *[
            f"{get(n).name} ({n.setting})" if n.known else Raw("—") for n in nums]))
    for k in schema.NUMERICS_TAGS:
        vals = [t.get(k) for t in tagged]
        if any(v is not None for v in vals):
            rows.append((tag("code", k, "warn" if k in differ else ""),
                         *[Raw("—") if v is None else v for v in vals]))
    changes = [n.changes for n in nums]
    if any(changes):
        rows.append((tag("span", "changed during training", "warn"),
                     *[", ".join(c) or "—" for c in changes]))
    return join([tag("h3", "Numerics configuration"),
                 tag("p", "How each run carried out its float32 arithmetic, read from the "
                          "settings it recorded (matmul precision, TF32 switches, numerics "
                          "XLA flags: docs/numerics.md); marked: where the candidate "
                          "differs from a reference.", "note"),
                 Raw('<div class="scroll">'),
                 table(("", *[label for label, _, _ in runs]), rows, "", "numerics"),
                 Raw("</div>")])


def runs_section(cmp: Comparison, comparison_run_id: str | None, ns: str = "") -> Section:
    """The runs compared (identity, versions, where the points came from), their numerics
    configuration, every tag and param folded, and the metrics that were not compared."""
    parts: list[str] = [Raw('<div class="scroll">'), runs_table(cmp), Raw("</div>"),
                        numerics_table(cmp), all_tags_details(cmp)]
    if comparison_run_id:
        parts.append(join([Raw('<p class="note">Comparison run (MLflow): '),
                           tag("code", comparison_run_id), Raw("</p>")]))
    lists = []
    if cmp.metrics_only_in_reference:
        lists.append(("only in the reference", ", ".join(cmp.metrics_only_in_reference)))
    if cmp.metrics_only_in_candidate:
        lists.append(("only in the candidate", ", ".join(cmp.metrics_only_in_candidate)))
    for k, why in cmp.skipped.items():
        lists.append((f"skipped: {k}", why))
    if lists:
        parts += [tag("h3", "Metrics not compared"), kv_table(lists, table_id="not-compared")]
    return Section(ns + "runs", "Runs", join(parts))


def acceptance_section(assessment: dict[str, Any] | None, ns: str = "") -> Section:
    """Every criterion with its outcome, reason and evidence (and the calibration it
    was derived from, when the criteria carry one)."""
    from refrun.report.assessment import assessment_section

    if assessment is None:
        body = tag("p", "No acceptance criteria were applied to this report "
                        "(refrun report --criteria FILE adds them).", "note")
    else:
        body = assessment_section(assessment)
    return Section(ns + "acceptance", "Acceptance (levels L0–L4)", body)


def metric_anchor(ns: str, cmp: Comparison, name: str) -> str:
    """DOM id of a metric's heading (by position, never derived from the run's strings)."""
    return f"{ns}metric-{list(cmp.metrics).index(name)}"


def _severity(d: O.Departure) -> str:
    if d.score is None:
        return "none"
    if d.measure == "mean_abs_z":
        return "high" if d.score >= 3 else "mid" if d.score >= 1 else "low"
    return "high" if d.score >= 0.1 else "mid" if d.score >= 0.01 else "low"


def ranking_table(cmp: Comparison, deps: list[O.Departure], ns: str,
                  table_id: str = "departures") -> Raw:
    """The ranked departures: one row per metric, numbers exactly those of the JSON.  A
    metric compared across backends carries a ``cross-backend`` badge."""
    group = any(d.measure == "mean_abs_z" for d in deps)
    top = max((float(d.score) for d in deps if d.score is not None), default=0.0) or 1.0
    rows = []
    for i, d in enumerate(deps, start=1):
        px = 0 if d.score is None else max(2, round(60 * min(1.0, float(d.score) / top)))
        score = join([Raw(f'<span class="bar {_severity(d)}" style="width:{px}px"></span>'),
                      num(d.score)])
        m = cmp.metrics[d.metric]
        # Curves and evaluations have their own figure; counters, step time and sys/*
        # are drawn in the runtime evidence.
        target = metric_anchor(ns, cmp, d.metric) if _is_curve(d.metric, m) or \
            m.kind == "eval" else f"{ns}runtime"
        link = Raw(f'<a href="#{esc(target)}"><code>{esc(d.metric)}</code></a>')
        if d.cross_backend:
            link = join([link, Raw(" "), _cross_backend_badge(cmp, d)])
        row: list[Any] = [i, link, score]
        if group:
            row += [_at(d.max_abs_z, d.step_of_max_abs_z),
                    num(d.fraction_outside, pct=True) if d.fraction_outside is not None
                    else None]
        row += [d.first_step, _at(d.max_abs_diff, d.step_of_max_abs_diff)]
        rows.append(row)
    head = ["#", "metric", "mean |z|" if group else "mean rel diff"]
    if group:
        head += ["max |z| @ step", "outside seeds"]
    head += ["first out", "max |diff| @ step"]
    return table(head, rows, "ranking", f"{ns}{table_id}")


def _backend_pair(cmp: Comparison) -> str:
    ref_b = sorted({str(r.backend) for r in cmp.reference if r.backend})
    return f"{', '.join(ref_b)} → {cmp.candidate.backend}"


def _cross_backend_badge(cmp: Comparison, d: O.Departure) -> Raw:
    why = ("system/runtime metric of another backend: says how the run executed, not "
           "whether it computes the same numbers" if d.group == "runtime" else
           "compared across backends: the differences include the backends' numerics")
    return Raw(f'<span class="badge xb" title="{esc(why)}">cross-backend '
               f"{esc(_backend_pair(cmp))}</span>")


def _at(value: Any, step: Any) -> Raw:
    """``value @ step`` (both exact in their data-value attributes)."""
    if value is None:
        return num(None)
    return join([num(value), Raw('<span class="at"> @ '), num(step), Raw("</span>")])


def _first_marks(d: O.Departure | None) -> list[F.Marker]:
    if d is None or d.first_step is None:
        return []
    label = "first divergence" if d.first_step_source == "engine" else "first out of band"
    return [F.Marker(d.first_step, label, "#111", "dot")]


def overview_section(cmp: Comparison, assessment: dict[str, Any] | None,
                     ids: FigureIds, ns: str = "") -> tuple[Section, list[O.Departure]]:
    """The first screen: verdict and highest level, the metrics ranked by departure
    relative to the seeds' spread, and the all-metric picture."""
    from refrun.report.assessment import verdict_banner
    from refrun.report.performance import panel as performance_panel

    deps = O.rank_departures(cmp.to_dict())
    figs: list[F.FigureSpec] = []
    group = len(cmp.reference) > 1
    sources = {d.first_step_source for d in deps}
    first_how = ("the first step of a sustained departure from the reference band "
                 "(the comparison's first divergence)" if "engine" in sources else
                 "the first step outside the seeds' min–max range")
    how = ("mean |z| = mean over the aligned steps of |candidate − seed mean| / seed σ "
           f"({len(cmp.reference)} reference runs); outside seeds = fraction of steps "
           "outside the seeds' min–max range; first out = " + first_how + "; "
           "— = no z (the seeds agree exactly)" if group else
           "a single reference run has no seed spread: ranked by the mean relative "
           "difference |c − r| / max(|c|, |r|, eps); record several reference seeds to "
           "measure departures in units of their spread; first out = " + first_how)
    training = [d for d in deps if d.group == "training"]
    n_runtime = len(deps) - len(training)
    if n_runtime:
        how += (f"; {n_runtime} system and runtime metric(s) (sys/*, perf/*, xfer/*, "
                "compile/* ...) are ranked apart, in the runtime evidence")
    if deps and deps[0].cross_backend:
        how += ("; candidate and references ran on different backends ("
                f"{_backend_pair(cmp)}): every metric is compared across backends")
    st = O.strip(cmp, [d.metric for d in deps], saturate=F.Z_MAX)
    picture: Raw = tag("p", "Nothing to picture: no aligned steps.", "note")
    if st is not None:
        firsts = {d.metric: d.first_step for d in deps}
        fig = F.strip_figure(st.values, st.edges, st.metrics, st.measure,
                             [firsts.get(m) for m in st.metrics])
        picture = _add(figs, ids, "all-metric departure", fig,
                       f"Colour: largest {st.measure} in each of {st.values.shape[1]} step "
                       "bins (pale: within the seeds' spread; red: beyond 3σ; darkest also "
                       "where the seeds agree exactly and the candidate differs); "
                       "×: first out (as in the ranking).")
    body = join([
        verdict_banner(assessment, ns),
        performance_panel(cmp, assessment, ns),
        Raw('<div class="ov-grid"><div>'),
        tag("h3", "Which signals depart, ranked"),
        Raw('<div class="scroll">'),
        ranking_table(cmp, training, ns) if training else
        tag("p", "No training or evaluation signal was compared; system and runtime "
                 "metrics are ranked in the runtime evidence.", "note"),
        Raw("</div>"),
        tag("p", how, "note"),
        Raw("</div><div>"),
        tag("h3", "Where and when: every metric over the steps"),
        Raw(f'<div id="{esc(ns)}strip">'), picture, Raw("</div>"),
        Raw("</div></div>"),
        Raw("<details><summary>All headline differences (table)</summary>"
            '<div class="scroll">'), headline_table(cmp), Raw("</div></details>"),
    ])
    return Section(ns + "overview", "Overview", body, figs), deps


def timeline_section(cmp: Comparison, ids: FigureIds, red: F.Reduction,
                     deps: list[O.Departure], ns: str = "") -> Section | None:
    """The primary metric, evaluation metrics and runtime evidence on one step axis."""
    ranked = [d.metric for d in deps if _is_curve(d.metric, cmp.metrics[d.metric])]
    primary = "loss" if "loss" in cmp.metrics and _is_curve("loss", cmp.metrics["loss"]) \
        else (ranked[0] if ranked else None)
    evals = [k for k, m in cmp.metrics.items() if m.kind == "eval"][:4]
    st = schema.M_STEP_TIME if any(schema.M_STEP_TIME in r.metric_names
                                   for r in [*cmp.reference, cmp.candidate]) else None
    groups = [(p, ms[:4]) for p, ms in F.counter_groups(cmp) if not p.endswith("(seconds)")]
    dep = next((d for d in deps if d.metric == primary), None)
    fig = F.timeline_figure(cmp, primary, evals, st, groups, red, _first_marks(dep))
    if fig is None:
        return None
    figs: list[F.FigureSpec] = []
    div = _add(figs, ids, "timeline", fig,
               "Linked panels: zoom or pan one and all follow. Runtime panels show the "
               "first reference run and the candidate; the dotted line marks where "
               f"{primary or 'the primary metric'} first left the reference band.")
    return Section(ns + "timeline", "Everything on one step axis", div, figs)


# --- per metric ------------------------------------------------------------------------

def measures_table(m: MetricComparison) -> Raw:
    """The engine's measures of one metric, field by field (final window and group too)."""
    d = dataclasses.asdict(m.measures)
    fw = d.pop("final_window")
    pairs: list[tuple[str, Any]] = [(k, v) for k, v in d.items()]
    pairs += [(f"final window {k}", v) for k, v in fw.items()]
    if m.group is not None:
        pairs += [(f"group {k}", v) for k, v in dataclasses.asdict(m.group).items()]
    if m.step_time is not None:
        pairs += [(f"step time {k}", v) for k, v in dataclasses.asdict(m.step_time).items()]
    if m.counters is not None:
        pairs += [(f"counter {k}", v) for k, v in dataclasses.asdict(m.counters).items()]
    return kv_table([(k, v if not isinstance(v, list) else ", ".join(map(str, v)))
                     for k, v in pairs], "kv measures", f"measures-{m.metric}")


def _is_curve(name: str, m: MetricComparison) -> bool:
    return m.kind == "value" and not name.startswith(schema.SYS_PREFIX)


def metric_marks(name: str, deps: list[O.Departure],
                 assessment: dict[str, Any] | None) -> list[F.Marker]:
    """Markers of one metric's figure: its first departure and each failing criterion
    on it (at the step its evidence names)."""
    from refrun.report.assessment import failing_marks

    dep = next((d for d in deps if d.metric == name), None)
    return _first_marks(dep) + [F.Marker(step, f"✗ {cid}")
                                for cid, step in failing_marks(assessment, name)]


def _folded(title: str, content: Raw) -> Raw:
    return join([Raw(f"<details><summary>{esc(title)}</summary>"), content,
                 Raw("</details>")])


def metrics_section(cmp: Comparison, ids: FigureIds, red: F.Reduction,
                    deps: list[O.Departure] | None = None,
                    assessment: dict[str, Any] | None = None, ns: str = "") -> Section:
    from refrun.report.assessment import assessed_envelope_k

    refs, cand = F.run_labels(cmp)
    deps = deps or []
    parts: list[str] = []
    figs: list[F.FigureSpec] = []
    order = [d.metric for d in deps if d.metric in cmp.metrics] or list(cmp.metrics)
    for name in order:
        m = cmp.metrics[name]
        if not _is_curve(name, m):
            continue
        k = assessed_envelope_k(assessment, name)
        fig = F.metric_figure(m, refs, cand, red, k=k,
                              marks=metric_marks(name, deps, assessment))
        a = m.alignment
        cap = (f"{a.aligned_steps} aligned steps ({a.first_aligned_step}..."
               f"{a.last_aligned_step}); plotted traces reduced to at most about "
               f"{red.max_points} points each ({red.method} per bucket, spikes kept).")
        parts += [Raw(f'<h3 id="{esc(metric_anchor(ns, cmp, name))}"><code>{esc(name)}'
                      "</code></h3>"),
                  _add(figs, ids, name, fig, cap),
                  _folded("Statistics of " + name, measures_table(m))]
    if not parts:
        parts.append(tag("p", "No per-step value metric was compared.", "note"))
    return Section(ns + "metrics", "Metrics (largest departure first)", join(parts), figs)


def _eval_rows(m: MetricComparison) -> tuple[list[tuple[Any, ...]], int]:
    pts = m.eval_points or []
    rows = [(p.step, p.reference, p.candidate, p.diff, p.reldiff) for p in pts]
    if len(rows) <= EVAL_TABLE_ROWS:
        return rows, 0
    half = EVAL_TABLE_ROWS // 2
    return rows[:half] + rows[-half:], len(rows) - 2 * half


def eval_section(cmp: Comparison, ids: FigureIds, red: F.Reduction,
                 deps: list[O.Departure] | None = None,
                 assessment: dict[str, Any] | None = None, ns: str = "") -> Section | None:
    evals = {k: m for k, m in cmp.metrics.items() if m.kind == "eval"}
    if not evals:
        return None
    refs, cand = F.run_labels(cmp)
    parts: list[str] = []
    figs: list[F.FigureSpec] = []
    for name, m in evals.items():
        fig = F.metric_figure(m, refs, cand, red, markers=True,
                              marks=metric_marks(name, deps or [], assessment))
        rows, hidden = _eval_rows(m)
        note = (tag("p", f"{hidden} evaluation points in the middle are not listed "
                         "(all are in the measures).", "note") if hidden else "")
        stats = join([Raw('<div class="scroll">'),
                      table(("step", "reference", "candidate", "diff", "rel diff"), rows,
                            "evalpoints", f"{ns}eval-{list(evals).index(name)}"), note,
                      measures_table(m), Raw("</div>")])
        parts += [Raw(f'<h3 id="{esc(metric_anchor(ns, cmp, name))}"><code>{esc(name)}'
                      "</code></h3>"),
                  _add(figs, ids, name, fig, f"{len(m.eval_points or [])} evaluation points"),
                  _folded("Evaluation points and statistics of " + name, stats)]
    return Section(ns + "eval", "Evaluation metrics", join(parts), figs)


# --- runtime evidence ------------------------------------------------------------------

def _step_time_table(cmp: Comparison) -> Raw:
    rows = []
    for name, m in cmp.metrics.items():
        st = m.step_time
        if st is None:
            continue
        rows.append((tag("code", name), st.warmup_end_step, st.reference_n,
                     st.reference_median, st.candidate_n, st.candidate_median, st.ratio))
    if not rows:
        return Raw("")
    return table(("metric", "steady from step", "reference steps", "reference median (s)",
                  "candidate steps", "candidate median (s)",
                  "ratio (candidate / reference)"), rows, "", "step-time-table")


def _counter_table(cmp: Comparison) -> Raw:
    rows = []
    for name, m in cmp.metrics.items():
        c = m.counters
        if c is None:
            continue
        rows.append((tag("code", name), c.warmup_end_step, c.reference_total,
                     c.candidate_total, c.reference_after_warmup, c.candidate_after_warmup))
    if not rows:
        return Raw("")
    note = " (reference: mean over the reference runs)" if len(cmp.reference) > 1 else ""
    return join([tag("p", "Per-step counters summed over each run's steps" + note + ".",
                     "note"),
                 table(("counter", "warm-up ends at step", "reference total",
                        "candidate total", "reference after warm-up",
                        "candidate after warm-up"), rows, "", "counter-table")])


def _fallback_table(cmp: Comparison) -> Raw:
    per = [(label, F.fallback_ops(r), r.tags.get(schema.TAG_FALLBACK_OPS))
           for label, r, _ in F.runs_of(cmp)]
    if all(raw is None for _, _, raw in per):
        return tag("p", "No run carries CPU-fallback op names (tag refrun.fallback.ops, "
                        "written by the PyTorch/XLA probe).", "note")
    names = sorted({k for _, ops, _ in per if ops for k in ops})
    rows = [(tag("code", n), *[None if ops is None else ops.get(n, 0.0)
                               for _, ops, _ in per]) for n in names]
    unreadable = [label for label, ops, raw in per if raw is not None and ops is None]
    parts: list[str] = []
    if rows:
        parts.append(table(("op", *[label for label, _, _ in per]), rows, "",
                           "fallback-table"))
    else:
        parts.append(tag("p", "No CPU-fallback op was executed in the runs that record "
                              "them.", "note"))
    if unreadable:
        parts.append(tag("p", "Unreadable refrun.fallback.ops tag in: "
                         + ", ".join(unreadable), "note warn"))
    return join(parts)


def device_table(cmp: Comparison) -> Raw:
    """Declared identity next to what the probes saw the hardware do (tags per run)."""
    runs = F.runs_of(cmp)
    keys = sorted({k for _, r, _ in runs for k in r.tags
                   if k.startswith(DEVICE_TAG_PREFIXES)})
    keys = [schema.TAG_HARDWARE, schema.TAG_CHIPS, *keys]
    rows = []
    for k in keys:
        vals = [r.tags.get(k) for _, r, _ in runs]
        if all(v is None for v in vals):
            continue
        cls = "warn" if k == schema.TAG_PLACEMENT_WARNING else ""
        rows.append((tag("code", k, cls), *[Raw("—") if v is None else v for v in vals]))
    return table(("tag", *[label for label, _, _ in runs]), rows, "", "device-table")


def runtime_section(cmp: Comparison, ids: FigureIds, red: F.Reduction,
                    ns: str = "", deps: list[O.Departure] | None = None) -> Section:
    parts: list[str] = []
    figs: list[F.FigureSpec] = []
    runtime = [d for d in deps or [] if d.group == "runtime"]
    if runtime:
        parts += [tag("h3", "System and runtime metrics, ranked"),
                  tag("p", "How the run executed (memory, step time, compilations, "
                           "transfers), ranked by departure like the signals of the first "
                           "screen but apart from them: on another framework or backend "
                           "these differ by design and say nothing about numerical "
                           "agreement.", "note"),
                  Raw('<div class="scroll">'),
                  ranking_table(cmp, runtime, ns, "runtime-departures"), Raw("</div>")]
    add: Callable[..., Raw] = lambda title, fig, cap="": _add(figs, ids, title, fig, cap)  # noqa: E731
    st_metric = schema.M_STEP_TIME
    parts.append(tag("h3", "Step time"))
    fig = F.series_figure(cmp, [st_metric], red, "seconds (log)", log_y=True)
    if fig is None:
        parts.append(tag("p", f"No run recorded {st_metric}.", "note"))
    else:
        m = cmp.metrics.get(st_metric)
        wend = m.step_time.warmup_end_step if m is not None and m.step_time else None
        parts += [Raw('<div class="grid">'), add("step time over steps", fig),
                  add("step time distribution",
                      F.distribution_figure(F.step_time_distributions(cmp, st_metric, wend),
                                            "step time (s)"),
                      "Steps after warm-up" + (f" (from step {wend})" if wend is not None
                                               else "") + "; tails clipped into the "
                      "outermost bins."),
                  Raw("</div>")]
    parts.append(_folded("Step-time medians and ratio (table)", _step_time_table(cmp)))
    parts.append(tag("h3", "Compilations, transfers and other per-step counters"))
    groups = F.counter_groups(cmp)
    for prefix, metrics in groups:
        label = prefix.replace("/", "/*", 1)
        parts.append(add(f"{label} per step",
                         F.series_figure(cmp, metrics, red, f"{label} per step", 280)))
    if not groups:
        parts.append(tag("p", "No run recorded per-step counters (compile/*, xfer/*, "
                              "fallback/*, exec/*).", "note"))
    else:
        parts.append(_folded("Counter totals (table)", _counter_table(cmp)))
    parts += [tag("h3", "CPU-fallback operations by name"),
              add("CPU-fallback ops", F.fallback_figure(cmp)),
              _folded("Fallback ops by name (table)", _fallback_table(cmp))]
    parts += [tag("h3", "Device truth"),
              tag("p", "Declared hardware next to what the probes observed "
                       "(refrun.exec.*, placement, step-time kind, summaries).", "note"),
              Raw('<div class="scroll">'), device_table(cmp), Raw("</div>")]
    sys_names = F.sys_metrics(cmp)
    parts.append(tag("h3", "Utilization"))
    for name in sys_names:
        parts.append(add(name, F.series_figure(cmp, [name], red, name, 260)))
    if not sys_names:
        parts.append(tag("p", "No run recorded utilization (sys/*).", "note"))
    return Section(ns + "runtime", "Runtime evidence", join(parts), figs)


# --- alignment -------------------------------------------------------------------------

def gaps(r: Any) -> int | None:
    """Steps missing inside a run's step range at its median cadence:
    ``(last - first) / cadence + 1 - steps`` (0 for a regular series; None if unknown)."""
    if r.cadence is None or r.cadence <= 0 or r.first_step is None:
        return None
    return max(0, round((r.last_step - r.first_step) / r.cadence) + 1 - r.steps)


def _series_cells(r: Any) -> tuple[Any, ...]:
    ranges = ", ".join(f"{a}–{b} (×{n})" for a, b, n in r.repeated_ranges[:10])
    if len(r.repeated_ranges) > 10:
        ranges += f", … ({len(r.repeated_ranges)} ranges listed by the engine)"
    return (r.points, r.steps, r.first_step, r.last_step, r.cadence, gaps(r),
            r.repeated_steps, ranges, r.backwards, r.nonfinite,
            f"{r.nan} / {r.posinf} / {r.neginf}", r.first_nonfinite_step)


def _notable(m: MetricComparison) -> bool:
    a = m.alignment
    series = a.reference if isinstance(a.reference, list) else [a.reference]
    odd = any(r.repeated_steps or r.backwards or r.nonfinite or gaps(r)
              for r in [*series, a.candidate])
    return bool(odd or a.only_in_reference or a.only_in_candidate or a.excluded_nonfinite
                or a.cadence_differs or a.group_incomplete_steps or a.interpolated)


def alignment_section(cmp: Comparison, ns: str = "") -> Section:
    refs, cand = F.run_labels(cmp)
    o = cmp.options
    parts: list[str] = [tag("p", f"Repeated steps keep the {o.keep} value written; "
                                 f"interpolation: {o.interpolate}; non-finite values are "
                                 "counted and excluded from the measures, never replaced.",
                            "note")]
    rows = []
    for name, m in cmp.metrics.items():
        a = m.alignment
        series = a.reference if isinstance(a.reference, list) else [a.reference]
        every = [*series, a.candidate]
        rows.append((tag("code", name), a.aligned_steps, a.first_aligned_step,
                     a.last_aligned_step, a.only_in_reference, a.only_in_candidate,
                     sum(r.repeated_steps for r in every), sum(gaps(r) or 0 for r in every),
                     sum(r.nonfinite for r in every), a.excluded_nonfinite,
                     a.group_incomplete_steps, "yes" if a.cadence_differs else "no",
                     a.interpolated or "none"))
    parts += [Raw('<div class="scroll">'),
              table(("metric", "aligned", "first", "last", "only reference",
                     "only candidate", "repeated steps", "gaps", "non-finite",
                     "excluded non-finite", "not in every reference", "cadence differs",
                     "interpolation"), rows, "", "alignment-table"), Raw("</div>"),
              tag("p", "Repeated steps, gaps (steps missing at the median cadence) and "
                       "non-finite values are summed over the runs; per-run details follow "
                       "for every metric where alignment had something to do.", "note")]
    quiet = []
    for name, m in cmp.metrics.items():
        a = m.alignment
        if not _notable(m):
            quiet.append(name)
            continue
        series = a.reference if isinstance(a.reference, list) else [a.reference]
        srows = [(lab, *_series_cells(r)) for lab, r in zip(refs, series, strict=False)]
        srows.append((cand, *_series_cells(a.candidate)))
        parts += [tag("h3", Raw(f"<code>{esc(name)}</code>")), Raw('<div class="scroll">'),
                  table(("run", "points", "steps", "first", "last", "cadence", "gaps",
                         "repeated steps", "repeated ranges", "backwards", "non-finite",
                         "NaN / +Inf / −Inf", "first non-finite step"), srows, "series"),
                  Raw("</div>")]
        if a.notes:
            parts.append(Raw('<ul class="notes">' + "".join(
                f"<li>{esc(n)}</li>" for n in a.notes) + "</ul>"))
    if quiet:
        parts.append(tag("p", "Nothing to align in " + ", ".join(quiet) + ": every run has "
                         "one finite value per step on the same steps.", "note"))
    opts = kv_table([(k, ", ".join(v) if isinstance(v, tuple) else v)
                     for k, v in dataclasses.asdict(o).items()], table_id="options-table")
    parts += [tag("h3", "Comparison options"), opts]
    return Section(ns + "alignment", "What alignment did", join(parts))
