"""Safe HTML building blocks and the self-contained page shell of the report.

Rules that make the page safe whatever a run contains:

* every string that reaches markup goes through :func:`esc` (``html.escape``);
* data for the page's script travels as JSON inside ``<script type="application/json">``
  with ``<``, ``>`` and ``&`` written as ``\\u003c``, ``\\u003e``, ``\\u0026``
  (:func:`script_json`), so no run string can close the element or start markup;
* the only executable scripts are the constants :data:`RENDER_JS` and
  :data:`refrun.report.matrix.MATRIX_JS` (and plotly.js itself).

Numbers are shown rounded (6 significant digits) with the exact value in the cell's
``data-value`` attribute (Python ``repr``: round-trips to the same float).
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from refrun.util.jsonsafe import json_safe

Cell = Any  # str (escaped here), number, None, or Raw


class Raw(str):
    """Markup built by this module's functions (already escaped): inserted as is."""


def esc(s: object) -> str:
    """Text for HTML content and attribute values (``& < > " '`` escaped)."""
    return html.escape(str(s), quote=True)


def is_number(v: object) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


def fmt_number(v: float | int) -> str:
    """Display form: integers in full, floats with 6 significant digits."""
    if isinstance(v, int | np.integer):
        return str(int(v))
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return f"{f:.6g}"


def num(v: object, pct: bool = False) -> Raw:
    """A number as ``<span class="num" data-value="exact">rounded</span>``; None as a dash."""
    if v is None:
        return Raw('<span class="num none" data-value="null">—</span>')
    if not is_number(v):
        return Raw(esc(v))
    exact = str(int(v)) if isinstance(v, int | np.integer) else repr(float(v))
    shown = f"{float(v) * 100:.3g} %" if pct and math.isfinite(float(v)) else fmt_number(v)
    return Raw(f'<span class="num" data-value="{esc(exact)}">{esc(shown)}</span>')


def cell(v: Cell) -> str:
    if isinstance(v, Raw):
        return v
    if v is None or is_number(v):
        return num(v)
    return esc(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], cls: str = "",
          table_id: str = "") -> Raw:
    """An HTML table; headers and cells are escaped unless they are :class:`Raw`."""
    attrs = f' class="{esc(cls)}"' if cls else ""
    if table_id:
        attrs += f' id="{esc(table_id)}"'
    head = "".join(f"<th>{cell(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return Raw(f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def kv_table(pairs: Iterable[tuple[str, Cell]], cls: str = "kv", table_id: str = "") -> Raw:
    """A two-column table (name, value)."""
    return table(("", ""), pairs, cls, table_id)


def tag(name: str, content: str, cls: str = "", **attrs: str) -> Raw:
    """``<name class=...>content</name>``; ``content`` is escaped unless it is Raw."""
    a = f' class="{esc(cls)}"' if cls else ""
    a += "".join(f' {k.replace("_", "-")}="{esc(v)}"' for k, v in attrs.items())
    return Raw(f"<{name}{a}>{cell(content)}</{name}>")


def join(parts: Iterable[str]) -> Raw:
    """Concatenate pieces that are each Raw or escaped text."""
    return Raw("".join(cell(p) for p in parts))


def json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def script_json(obj: Any, element_id: str) -> Raw:
    """``obj`` as ``<script type="application/json" id=...>`` content that can never end
    the element early or be read as markup: ``<``, ``>`` and ``&`` are JSON escapes."""
    text = json.dumps(json_safe(obj), default=json_default, allow_nan=False,
                      separators=(",", ":"))
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return Raw(f'<script type="application/json" id="{esc(element_id)}">{text}</script>')


@functools.cache
def _gzipped_plotlyjs() -> str:
    """plotly.js gzip-compressed (deterministic: no timestamp) and base64-encoded."""
    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=9,
                                          mtime=0)).decode("ascii")


def deferred_plotlyjs_tag() -> Raw:
    """plotly.js embedded as inert text (``type="text/plain"``), gzip-compressed and
    base64-encoded (about 1.9 MB instead of 4.6 MB), decompressed by the browser
    (``DecompressionStream``: Chrome 80, Firefox 113, Safari 16.4) and run by the page
    script only when a figure is first drawn: a page of many folded candidates shows its
    first screen without parsing and running 4.6 MB of JavaScript, and carries a third of
    it.  Base64 only: the text holds no ``<``, so it can never end the element."""
    return Raw('<script type="text/plain" id="refrun-plotlyjs" data-encoding="gzip-base64">'
               f"{_gzipped_plotlyjs()}</script>")


def plotlyjs_tag(mode: str = "embed") -> Raw:
    """plotly.js for the page: ``"embed"`` (default, offline, ~4.6 MB, once per page),
    ``"cdn"`` (the matching cdn.plot.ly URL) or a path/URL the page should load it from
    (an existing local file is referenced by its absolute ``file://`` URI)."""
    if mode == "embed":
        js = get_plotlyjs()
        # plotly.js is embedded verbatim as plotly.py does; guard the one sequence that
        # would end the element.
        js = js.replace("</script", "<\\/script")
        return Raw(f'<script type="text/javascript">{js}</script>')
    if mode == "cdn":
        src = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
    else:
        p = Path(mode).expanduser()
        src = p.resolve().as_uri() if "://" not in mode and p.exists() else mode
    return Raw(f'<script type="text/javascript" charset="utf-8" src="{esc(src)}"></script>')


# The page's only script besides plotly.js.  It contains no run data.  A single
# candidate's page draws every figure at load.  A page of several candidates ("lazy")
# draws none at load: each candidate's figures are in their own JSON block
# (#refrun-figures-cand-N) and are drawn when its <details> section is opened (a click,
# or a link to it or into it); arrays shared by several candidates' figures are in the
# pool of #refrun-figures and stand as {"pool": k} in the figures.  Tests and benchmarks
# wait for body[data-rendered="true"] (the first screen is drawn) and, for a section,
# details[data-rendered="true"].
RENDER_JS = """
(function () {
  var blob = JSON.parse(document.getElementById('refrun-figures').textContent);
  var pool = blob.pool || [];
  function fail(figures, msg) {
    figures.forEach(function (f) {
      var el = document.getElementById(f.id);
      if (el) { el.textContent = msg; el.className += ' missing'; }
    });
  }
  var plotlyReady = null;
  function gunzip(b64) {
    var bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) { bytes[i] = bin.charCodeAt(i); }
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    return new Response(stream).text();
  }
  function loadPlotly() {
    // A page of many candidates carries plotly.js as inert (gzip-compressed) text: run
    // it on first use. Resolves to whether Plotly is then defined.
    if (typeof Plotly !== 'undefined') { return Promise.resolve(true); }
    var inert = document.getElementById('refrun-plotlyjs');
    if (!inert) { return Promise.resolve(false); }
    if (!plotlyReady) {
      var gz = inert.getAttribute('data-encoding') === 'gzip-base64';
      var text = !gz ? Promise.resolve(inert.textContent)
          : typeof DecompressionStream === 'undefined'
          ? Promise.reject(new Error('no DecompressionStream'))
          : gunzip(inert.textContent);
      plotlyReady = text.then(function (src) {
        var s = document.createElement('script');
        s.text = src;
        document.head.appendChild(s);
        return typeof Plotly !== 'undefined';
      }, function () { return false; });
    }
    return plotlyReady;
  }
  var deferred = !!document.getElementById('refrun-plotlyjs');
  var noPlotly = !deferred && typeof Plotly === 'undefined';
  var missing = 'plotly.js could not be loaded: this report references it instead of' +
      ' embedding it (written with --plotlyjs cdn or a path); open it with network' +
      ' access or write it again with the default --plotlyjs embed.';
  var config = {displaylogo: false, responsive: true, showLink: false,
                modeBarButtonsToRemove: ['sendDataToCloud', 'lasso2d', 'select2d']};
  function resolve(o) {
    if (Array.isArray(o)) { return o.map(resolve); }
    if (o !== null && typeof o === 'object') {
      var keys = Object.keys(o);
      if (keys.length === 1 && keys[0] === 'pool' && typeof o.pool === 'number') {
        var p = pool[o.pool], copy = {};
        if (Array.isArray(p)) { return p.slice(); }  // hover text, labels
        Object.keys(p).forEach(function (k) { copy[k] = p[k]; });  // a typed array
        return copy;
      }
      var out = {};
      keys.forEach(function (k) { out[k] = resolve(o[k]); });
      return out;
    }
    return o;
  }
  function draw(figures) {
    return Promise.all(figures.map(function (f) {
      var el = document.getElementById(f.id);
      f.layout.template = blob.template;
      return Plotly.newPlot(el, resolve(f.data), f.layout, config);
    }));
  }
  if (!blob.lazy) {
    if (noPlotly) {
      fail(blob.figures, missing);
      document.body.setAttribute('data-rendered', 'error');
      return;
    }
    draw(blob.figures).then(function () {
      document.body.setAttribute('data-rendered', 'true');
    }, function (err) {
      document.body.setAttribute('data-rendered', 'error');
      throw err;
    });
    return;
  }
  var undecodable = 'plotly.js is embedded compressed and this browser could not' +
      ' decompress it (DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later);' +
      ' open it in a newer browser or write it again with --plotlyjs cdn or a path.';
  function open(section) {
    if (section.getAttribute('data-rendered')) { return; }
    var block = document.getElementById('refrun-figures-' + section.id);
    var figures = block ? JSON.parse(block.textContent).figures : [];
    if (noPlotly) {
      fail(figures, missing);
      section.setAttribute('data-rendered', 'error');
      return;
    }
    // 'pending' while plotly.js is decompressed and the figures drawn; tests and
    // benchmarks wait for 'true' (or 'error').
    section.setAttribute('data-rendered', 'pending');
    loadPlotly().then(function (ok) {
      if (!ok) {
        fail(figures, deferred ? undecodable : missing);
        section.setAttribute('data-rendered', 'error');
        return;
      }
      return draw(figures).then(function () {
        section.setAttribute('data-rendered', 'true');
      });
    }).catch(function (err) {
      section.setAttribute('data-rendered', 'error');
      throw err;
    });
  }
  var sections = document.querySelectorAll('details.candidate');
  Array.prototype.forEach.call(sections, function (d) {
    d.addEventListener('toggle', function () { if (d.open) { open(d); } });
  });
  function fromHash() {
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id ? document.getElementById(id) : null;
    var section = target ? target.closest('details.candidate') : null;
    if (!section) { return; }
    if (!section.open) { section.open = true; }  // its toggle event draws it
    target.scrollIntoView();
  }
  window.addEventListener('hashchange', fromHash);
  fromHash();
  document.body.setAttribute('data-rendered', noPlotly ? 'error' : 'true');
})();
"""

CSS = """
:root { --ref: #1f77b4; --cand: #d62728; --muted: #5f6b7a; --line: #dde3ea; }
* { box-sizing: border-box; }
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 0; color: #1d2733; background: #f6f8fa; }
header { background: #1d2733; color: #fff; padding: 14px 28px; }
header h1 { margin: 0 0 4px; font-size: 20px; font-weight: 600; }
header .sub { color: #c5d0dc; font-size: 13px; }
nav { position: sticky; top: 0; z-index: 5; background: #fff; border-bottom: 1px solid var(--line);
      padding: 6px 28px; font-size: 13px; }
nav a { margin-right: 16px; color: #0b5cad; text-decoration: none; }
main { padding: 8px 28px 40px; max-width: 1400px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px;
          padding: 6px 18px 14px; margin: 14px 0; }
h2 { font-size: 17px; margin: 12px 0 8px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
h3 code, td code { font-size: 13px; }
p.note, .caption { color: var(--muted); font-size: 13px; margin: 4px 0 8px; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 10px 3px 0; text-align: left;
         vertical-align: top; }
th { color: var(--muted); font-weight: 600; white-space: nowrap; }
td .num { font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv td:first-child { color: var(--muted); padding-right: 18px; }
table.kv thead { display: none; }
.scroll { overflow-x: auto; }
table.runs td:first-child { white-space: nowrap; }
table.runs td:nth-child(9) { font-size: 12px; color: var(--muted); min-width: 240px; }
.plot { width: 100%; min-height: 220px; }
.plot.missing { color: #a33; padding: 20px; border: 1px dashed #d99; }
.grid { display: grid; grid-template-columns: minmax(0, 3fr) minmax(300px, 2fr); gap: 16px; }
@media (max-width: 1000px) { .grid { grid-template-columns: 1fr; } }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
         font-weight: 600; background: #e8ecf0; color: #333; }
.badge.pass { background: #d8f3dc; color: #1b5e20; }
.badge.fail { background: #fddede; color: #a01818; }
.badge.not_evaluable, .badge.incomplete, .badge.not_evaluated { background: #fff1c2;
         color: #6b4e00; }
.levels { display: flex; gap: 8px; flex-wrap: wrap; margin: 6px 0 10px; }
.level { border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; min-width: 110px; }
.level b { display: block; font-size: 15px; }
ul.notes { margin: 4px 0 10px; padding-left: 20px; color: #333; }
.warn { color: #a01818; font-weight: 600; }
.badge.xb { background: #e8eaf6; color: #283593; font-size: 11px; white-space: nowrap; }
footer { color: var(--muted); font-size: 12px; padding: 0 28px 30px; }
details { margin: 6px 0 10px; }
details > summary { cursor: pointer; color: #0b5cad; font-size: 13px; }
.banner { display: flex; gap: 26px; align-items: center; border-radius: 8px;
          padding: 10px 20px; margin: 10px 0 6px; border: 1px solid var(--line);
          background: #fff; }
.banner .big { font-size: 28px; font-weight: 700; letter-spacing: 0.04em; min-width: 150px; }
.banner.pass { background: #e9f7ec; border-color: #9fd5a9; }
.banner.pass .big { color: #1b5e20; }
.banner.fail { background: #fdecec; border-color: #eba3a3; }
.banner.fail .big { color: #a01818; }
.banner.incomplete { background: #fff6d6; border-color: #e6cd73; }
.banner.incomplete .big { color: #6b4e00; }
.banner.none .big { font-size: 18px; color: var(--muted); }
.banner .hl { font-size: 15px; font-weight: 600; }
.banner .fails { font-size: 13px; flex: 1; }
.chips { margin: 4px 0; }
.chip { display: inline-block; min-width: 30px; text-align: center; border-radius: 4px;
        margin-right: 4px; padding: 1px 6px; font-size: 12px; font-weight: 600;
        background: #e8ecf0; color: #333; }
.chip.pass { background: #2e7d32; color: #fff; }
.chip.fail { background: #c62828; color: #fff; }
.chip.not_evaluable, .chip.incomplete { background: #f2c94c; color: #333; }
.l4 { margin: 4px 0 14px; }
.l4 table.l4-table td { vertical-align: top; }
.l4 .not-measured { font-size: 12px; }
.ov-grid { display: grid; grid-template-columns: minmax(0, 7fr) minmax(0, 5fr); gap: 18px; }
@media (max-width: 1100px) { .ov-grid { grid-template-columns: 1fr; } }
table.ranking td { padding-top: 2px; padding-bottom: 2px; }
table.ranking td { white-space: nowrap; }
table.ranking .at { color: var(--muted); font-size: 12px; }
.bar { display: inline-block; height: 9px; border-radius: 2px; margin-right: 6px;
       max-width: 60px; vertical-align: middle; }
.bar.low { background: #9fd5a9; } .bar.mid { background: #f2b84b; }
.bar.high { background: #d7301f; } .bar.none { background: transparent; }
table.matrix td { vertical-align: middle; }
details.candidate { background: #fff; border: 2px solid #c5d0dc; border-radius: 6px;
                    padding: 4px 18px; margin: 10px 0; }
details.candidate > summary { cursor: pointer; }
details.candidate > summary h2 { display: inline; margin-right: 10px; }
details.candidate > section { border: none; padding: 0; }
a.mlflow code { color: #0b5cad; }
"""


def page(title: str, header_sub: str, nav: Sequence[tuple[str, str]], body: str,
         data: Raw, plotlyjs: Raw, footer: str) -> str:
    """The complete document.  ``title``, ``header_sub``, nav labels and ``footer`` are
    plain text (escaped here); ``body`` is Raw markup; ``data`` the figures' JSON block."""
    links = "".join(f'<a href="#{esc(a)}">{esc(label)}</a>' for a, label in nav)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<meta name=\"generator\" content=\"refrun report, plotly {esc(plotly.__version__)}\">"
        f"<title>{esc(title)}</title><style>{CSS}</style>{plotlyjs}</head>\n"
        f"<body><header><h1>{esc(title)}</h1><div class=\"sub\">{esc(header_sub)}</div>"
        f"</header><nav>{links}</nav><main>{body}</main>"
        f"<footer>{esc(footer)}</footer>\n{data}\n"
        f"<script type=\"text/javascript\">{RENDER_JS}</script></body></html>\n"
    )
