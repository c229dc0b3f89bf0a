"""One self-contained HTML page for a report (``--html FILE``).

The page carries everything inline (CSS, SVG heatmaps, one small script) and loads nothing:
its Content-Security-Policy forbids every network resource, so it reads the same offline.
It holds the tool version and command line, the verdict, the first finding (the ledger row
it sits on carries ``data-first-finding``), for ``check`` the failing cases with the reproduction,
for ``scan`` a strip of the model's attention calls coloured by status, each opening (a click, or the
page's address ending in ``#call-N``) onto its checks, its stage ledger and its mask picture,
for ``compare`` a plot of each block's total and added error against its bound (:mod:`.layerplot`), each block
opening (a click on its column, or ``#layer-N``) onto its checks and, for the first adder, each run's stage
ledger of its attention calls,
for ``run`` the mask picture and the weight heatmaps per head (pooled beyond :data:`HTML_LIMIT`
cells a side, and named so), the ledger with every status, then the notes and the details as
in ``--format json``. It prints on paper with its colours (print CSS).

The one script records uncaught script errors into the ``data-errors`` attribute of the
root element, so that anyone reading the page's DOM (a test in a headless browser, say) can
tell that it rendered without any.
"""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Sequence

from attn_ledger._version import __version__
from attn_ledger.render.hints import hint_lines
from attn_ledger.render.jsondoc import details_json, dumps
from attn_ledger.render.notes import cli_line, note_text, notes_text, python_lines
from attn_ledger.render.pictures import MASK_CATEGORIES, MASK_MEANING, NotDrawn, Picture, build_picture, mark_text
from attn_ledger.render.text import LEVEL_NAMES, STATUS_WORD, check_line, describe, fmt_value, shape_text
from attn_ledger.report import Check, Report, Row

HTML_LIMIT = 64  # queries and keys drawn cell by cell; larger grids are pooled to this many cells a side
WEIGHT_STOPS = ((0.0, (255, 255, 255)), (0.25, (198, 219, 239)), (0.5, (107, 174, 214)),
                (0.75, (33, 113, 181)), (1.0, (8, 48, 107)))
NOT_FINITE_FILL = "#9e9e9e"
MASK_FILL = {"allowed": "#37474f", "forbidden": "#f1f1f1", "dropped": "#f4a259", "leaked": "#d62828"}
MARK_STROKE = "#d62828"

CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

ERROR_RECORDER = """
(function () {
  var root = document.documentElement;
  function record(text) { root.setAttribute('data-errors', (root.getAttribute('data-errors') || '') + text + '\\n'); }
  window.addEventListener('error', function (e) { record(e.message || 'error'); });
  window.addEventListener('unhandledrejection', function (e) { record('unhandled rejection: ' + e.reason); });
})();
"""

OPEN_CALL = """
(function () {
  function open(id) {
    var d = document.getElementById(id);
    if (d && d.tagName === 'DETAILS') { d.open = true; }
  }
  document.addEventListener('DOMContentLoaded', function () {
    if (location.hash) { open(location.hash.slice(1)); }
    var cells = document.querySelectorAll('a.layer, a.plot-layer');
    for (var i = 0; i < cells.length; i++) {
      cells[i].addEventListener('click', function (e) { open(e.currentTarget.getAttribute('href').slice(1)); });
    }
  });
  window.addEventListener('hashchange', function () { open(location.hash.slice(1)); });
})();
"""

STYLE = """
:root { --fail: #b71c1c; --pass: #1b5e20; --warn: #8a6d00; --dim: #6b6b6b; --line: #d9d9d9; }
* { box-sizing: border-box; -webkit-print-color-adjust: exact; print-color-adjust: exact; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 1.5rem auto; max-width: 78rem; padding: 0 1rem; color: #1d1d1d; background: #fff; }
code, pre, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f6f6; padding: .5rem .7rem; margin: .3rem 0; }
h1 { font-size: 1.5rem; margin: 0 0 .2rem; } h2 { font-size: 1.2rem; margin: 1.6rem 0 .5rem; border-bottom: 1px solid var(--line); }
h3 { font-size: 1.05rem; margin: 1.1rem 0 .4rem; }
.title { font-family: ui-monospace, "DejaVu Sans Mono", monospace; margin: .2rem 0 .6rem; }
dl.meta { display: grid; grid-template-columns: max-content 1fr; gap: .15rem .8rem; margin: 0; }
td.name, .case h3 { white-space: nowrap; }
dl.meta dt { color: var(--dim); } dl.meta dd { margin: 0; }
.verdict { display: inline-block; font-weight: 700; padding: .1rem .6rem; border-radius: .25rem; color: #fff; }
.verdict.fail { background: var(--fail); } .verdict.pass { background: var(--pass); }
.finding { border-left: 6px solid var(--fail); background: #fdecea; padding: .6rem .9rem; margin: 1rem 0; }
.finding.none { border-left-color: var(--pass); background: #edf7ee; }
.finding .hint { color: var(--warn); font-weight: 600; }
table.ledger { border-collapse: collapse; width: 100%; }
table.ledger th, table.ledger td { text-align: left; vertical-align: top; padding: .35rem .5rem; border-bottom: 1px solid var(--line); }
table.ledger td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr[data-first-finding] { outline: 3px solid var(--fail); outline-offset: -3px; background: #fff5f5; }
.badge { font-weight: 600; white-space: nowrap; }
.status-pass > .badge, li.status-pass { color: var(--pass); }
.status-fail > .badge, li.status-fail { color: var(--fail); }
.status-warn > .badge, .status-inconclusive > .badge, .status-downstream > .badge,
li.status-warn, li.status-inconclusive, li.status-downstream { color: var(--warn); }
.status-skipped > .badge, .status-not_applicable > .badge, .status-not_reached > .badge,
li.status-skipped, li.status-not_applicable, li.status-not_reached { color: var(--dim); }
ul.checks { list-style: none; margin: 0; padding: 0; }
ul.checks li { margin: .05rem 0; } ul.checks li .why { color: #444; }
li[data-finding-check] { font-weight: 700; }
.axes, .note, .dim { color: var(--dim); } .note { white-space: pre-wrap; margin-top: .3rem; }
.heads { display: flex; flex-wrap: wrap; gap: 1rem 1.4rem; }
figure.head { margin: 0; break-inside: avoid; } figure.head figcaption { font-weight: 600; margin-bottom: .2rem; }
svg.heatmap text { font: 10px ui-monospace, "DejaVu Sans Mono", monospace; fill: #555; }
.legend { display: flex; flex-wrap: wrap; gap: .3rem 1.1rem; align-items: center; margin: .3rem 0 .7rem; }
.swatch { display: inline-block; width: 14px; height: 14px; vertical-align: -2px; border: 1px solid #bbb; margin-right: .3rem; }
.swatch.marked { border: 2px solid #d62828; }
.not-drawn { border-left: 6px solid var(--warn); background: #fff8e1; padding: .5rem .8rem; }
.case { border: 1px solid var(--line); padding: .5rem .8rem; margin: .6rem 0; break-inside: avoid; }
.strip { display: flex; flex-wrap: wrap; gap: 3px; margin: .4rem 0 .8rem; }
a.layer { display: inline-flex; align-items: center; justify-content: center; min-width: 2.4rem; height: 2rem;
          padding: 0 .3rem; border-radius: 3px; color: #fff; text-decoration: none; font-weight: 600; background: var(--dim); }
a.layer.status-pass { background: var(--pass); } a.layer.status-fail { background: var(--fail); }
a.layer.status-downstream, a.layer.status-warn, a.layer.status-inconclusive { background: var(--warn); }
a.layer.first { outline: 3px solid #000; outline-offset: 1px; }
details.call { border: 1px solid var(--line); border-left-width: 6px; margin: .4rem 0; padding: .3rem .7rem; }
details.call.status-pass { border-left-color: var(--pass); } details.call.status-fail { border-left-color: var(--fail); }
details.call.status-downstream { border-left-color: var(--warn); }
details.call summary { cursor: pointer; }
svg.layer-plot text { font: 11px ui-monospace, "DejaVu Sans Mono", monospace; fill: #555; }
svg.layer-plot a.plot-layer:hover rect.hit { fill: rgba(0, 0, 0, .05); } figure.plot { margin: .4rem 0; }
.call-ledger { margin: .5rem 0 .2rem 1rem; }
footer { margin-top: 2rem; color: var(--dim); font-size: 12px; }
@page { margin: 12mm; }
@media print {
  body { margin: 0; max-width: none; font-size: 10pt; }
  h2 { break-after: avoid; } tr, figure.head, .finding, .case { break-inside: avoid; }
  a { color: inherit; text-decoration: none; }
  pre { background: none; border: 1px solid var(--line); }
}
"""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _attrs(**attrs: Any) -> str:
    return "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in attrs.items() if v is not None)


# --- the ledger -----------------------------------------------------------------------------


def _check_item(c: Check, first: bool, full: bool) -> str:
    text = check_line(c)
    why = describe(c) if full or c.status != "pass" else ""
    body = _e(text) + (f' <span class="why">&mdash; {_e(why)}</span>' if why else "")
    marker = ' data-finding-check="true"' if first else ""
    return (f'<li class="check status-{c.status}"{_attrs(data_check=c.name, data_level=c.level, data_status=c.status)}'
            f"{marker}>{body}</li>")


def _row(report: Report, r: Row, fields: Sequence[str], has_shape: bool, prefix: str = "") -> str:
    finding = report.first_finding
    is_first = finding is not None and finding.row == r.name
    shown = [c for c in r.checks if report.show_passing or not c.passed or (is_first and c is finding.check)]
    items = [_check_item(c, is_first and c is finding.check, report.show_passing) for c in shown]
    n_pass = sum(1 for c in r.checks if c.passed) - sum(1 for c in shown if c.passed)
    if n_pass:
        items.append(f'<li class="dim">({n_pass} checks pass)</li>')
    cells = [f'<td class="name mono">{_e(r.name)}</td>',
             f'<td class="status-{r.status}"><span class="badge">{_e(STATUS_WORD[r.status])}</span></td>']
    if has_shape:
        cells.append(f'<td class="mono">{_e(shape_text(r.shape))}<br><span class="axes">{_e(r.axes)}</span></td>')
    cells += [f'<td class="num mono">{_e(fmt_value(r.fields.get(k)))}</td>' for k in fields]
    note = f'<div class="note mono">{_e(note_text(r.note))}</div>' if r.note else ""
    cells.append(f'<td><ul class="checks">{"".join(items)}</ul>{note}</td>')
    attrs = _attrs(id=f"{prefix}row-{r.name}", data_row=r.name, data_status=r.status)
    marker = ' data-first-finding="true"' if is_first else ""
    return f'<tr class="row status-{r.status}"{attrs}{marker}>{"".join(cells)}</tr>'


def _table(report: Report, prefix: str = "") -> str:
    fields: list[str] = []
    for r in report.rows:
        fields += [k for k in r.fields if k not in fields]
    has_shape = any(r.shape is not None or r.axes for r in report.rows)
    head = [report.row_label, "status"] + (["shape / axes"] if has_shape else []) + fields + ["checks"]
    rows = "\n".join(_row(report, r, fields, has_shape, prefix) for r in report.rows)
    ths = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f'<table class="ledger"><thead><tr>{ths}</tr></thead><tbody>\n{rows}\n</tbody></table>'


def _ledger(report: Report) -> str:
    return f'<section id="ledger"><h2>Ledger</h2>{_table(report)}</section>'


# --- scan: the strip of calls, each opening onto its stage ledger ----------------------------------------


def _call_body(report: Report, r: Row, i: int) -> str:
    first = report.first_finding is not None and report.first_finding.row == r.name
    items = "".join(_check_item(c, first and c is report.first_finding.check, True) for c in r.checks)
    nested = report.ledgers.get(r.name) or (report.ledger if first else None)
    if nested is None:
        ledger = '<p class="dim">no stage ledger of this call (not judged, or not replayable)</p>'
    else:
        ledger = _stage_ledger(nested, r.name, f"call-{i}-")
    return f'<ul class="checks">{items}</ul>{ledger}'


def _stage_ledger(nested: Report, key: str, prefix: str, heading: str = "Stage ledger") -> str:
    """A call's stage ledger, nested in the page: its verdict, its table (row ids under ``prefix``), its mask."""
    where = f" at {nested.first_finding.row}" if nested.first_finding is not None else ""
    return (f'<div class="call-ledger" data-ledger="{_e(key)}"><h4>{_e(heading)}: '
            f'<span class="verdict {nested.verdict}">{_e(nested.verdict)}{_e(where)}</span></h4>'
            f'<p class="title">{_e(nested.title)}</p>{_table(nested, prefix=prefix)}'
            f'{_heatmaps(nested, "mask", "Mask")}</div>')


def _layers(report: Report) -> str:
    if report.command != "scan" or not report.rows:
        return ""
    cells, calls = [], []
    finding = report.first_finding
    for i, r in enumerate(report.rows):
        first = finding is not None and finding.row == r.name
        layer = r.fields.get("layer")
        bad = r.first_failing()
        tip = f"{r.name}: {STATUS_WORD[r.status]}" + (f", L{bad.level} {bad.name}" if bad is not None else "")
        cells.append(f'<a class="layer status-{r.status}{" first" if first else ""}" href="#call-{i}"'
                     f'{_attrs(data_call=r.name, data_status=r.status, title=tip)}>{_e(layer if layer is not None else i)}</a>')
        calls.append(f'<details class="call status-{r.status}" id="call-{i}"{_attrs(data_call=r.name)}'
                     f'{" open" if first else ""}><summary><span class="badge">{_e(STATUS_WORD[r.status])}</span> '
                     f'<span class="mono">{_e(r.name)}</span>' + (f" &mdash; L{bad.level} {_e(bad.name)}" if bad else "")
                     + f"</summary>{_call_body(report, r, i)}</details>")
    return (f'<section id="layers"><h2>Attention calls, layer by layer</h2><div class="strip">{"".join(cells)}</div>'
            f'{"".join(calls)}</section>')


# --- compare: the plot of blocks, each opening onto its first adder's stage ledgers ----------------------


def _block_ledgers(report: Report, r: Row, i: int) -> str:
    """The stage ledgers a block opens onto: the first adder's attention calls, run by run; other blocks say why
    they have none."""
    first = (report.details or {}).get("first_adder") or {}
    if r.fields.get("mark") != "first adder" or first.get("block") != r.name:
        return ('<p class="dim no-ledger">no stage ledger: only the first adder\'s attention calls are put through '
                "the stage ledger</p>")
    attention = first.get("attention")
    if not isinstance(attention, dict):
        kind = ((report.details or {}).get("vary") or {}).get("kind", "")
        return (f'<p class="dim no-ledger">no stage ledger: the attention calls of this block are not captured under '
                f"--vary {_e(kind)}</p>")
    parts = []
    for j, call in enumerate(attention.get("calls") or []):
        what = ", ".join(f"{k} {call[k]}" for k in ("check", "diagnosis", "stage") if call.get(k))
        head = (f'<p class="call-summary status-{_e(call["status"])}" data-run="{_e(call["run"])}"><span class="badge">'
                f'{_e(STATUS_WORD.get(call["status"], call["status"]))}</span> run {_e(call["run"])}: '
                f'<span class="mono">{_e(call["call"])}</span>' + (f" &mdash; {_e(what)}" if what else "") + "</p>")
        nested = report.ledgers.get(call.get("ledger") or "")
        parts.append(head + ('<p class="dim no-ledger">no stage ledger of this call</p>' if nested is None else
                             _stage_ledger(nested, call["ledger"], f"layer-{i}-{j}-", f"Run {call['run']}, stage ledger")))
    if attention.get("why"):
        parts.append(f'<p class="dim no-ledger">{_e(attention["why"])}</p>')
    return "".join(parts)


def _compare_blocks(report: Report) -> str:
    from attn_ledger.render.layerplot import blocks, layer_plot, plot_legend

    rows = blocks(report) if report.command == "compare" else []
    if not rows:
        return ""
    sections = []
    for i, r in enumerate(rows):
        first = r.fields.get("mark") == "first adder"
        numbers = ", ".join(f"{k} {fmt_value(r.fields[k])}" for k in ("total", "added", "bound", "room")
                            if r.fields.get(k) is not None)
        items = "".join(_check_item(c, report.first_finding is not None and c is report.first_finding.check, True)
                        for c in r.checks)
        attrs = _attrs(id=f"layer-{i}", data_block=r.name, data_layer=r.fields["layer"])
        sections.append(f'<details class="call status-{r.status}"{attrs}{" open" if first else ""}><summary><span class="badge">{_e(STATUS_WORD[r.status])}</span> '
                        f'<span class="mono">{_e(r.name)}</span>{" (first adder)" if first else ""} &mdash; {_e(numbers)}'
                        f'</summary><ul class="checks">{items}</ul>{_block_ledgers(report, r, i)}</details>')
    return (f'<section id="layers"><h2>Blocks: total and added error against the bound</h2>'
            f'<figure class="plot">{layer_plot(report)}</figure>{plot_legend()}{"".join(sections)}</section>')


def _finding(report: Report) -> str:
    f = report.first_finding
    hints = "".join(f'<p class="hint">{_e(h)}</p>' for h in hint_lines(report))  # what to try next, under it
    if f is None:
        return ('<section id="first-finding" class="finding none"><h2>First finding</h2><p>none: no check failed</p>'
                f"{hints}</section>")
    c = f.check
    return (f'<section id="first-finding" class="finding"><h2>First finding</h2>'
            f'<p><a href="#row-{_e(f.row)}" class="mono">{_e(f.row)}</a>, L{c.level} {_e(LEVEL_NAMES[c.level])}: '
            f'<b class="mono">{_e(c.name)}</b> ({_e(STATUS_WORD[c.status])})</p><p>{_e(describe(c))}</p>{hints}</section>')


# --- the heatmaps ---------------------------------------------------------------------------


def weight_fill(value: float) -> str:
    """A weight's colour: white at 0 to dark blue at 1 (clipped), grey when not finite."""
    if value != value or value in (float("inf"), float("-inf")):
        return NOT_FINITE_FILL
    v = min(1.0, max(0.0, value))
    for (a, ca), (b, cb) in zip(WEIGHT_STOPS, WEIGHT_STOPS[1:]):
        if v <= b:
            t = (v - a) / (b - a)
            return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))
    return "#%02x%02x%02x" % WEIGHT_STOPS[-1][1]


def _svg_head(pic: Picture, h: int) -> str:
    """One head as an SVG grid: key numbers on top, query numbers at the left, one rect a cell.

    Each cell rect carries its class (``wcell`` for weights, ``mcell`` for the mask), its
    query and key (the first of its block when pooled), a tooltip, and, when a failing check
    points at it, the class ``marked``, a red outline and ``data-marks``.
    """
    grid = pic.heads[h]
    qp, kp = pic.pool
    size = max(6, min(28, 360 // max(pic.rows, pic.cols)))
    left, top = 8 + 7 * len(str((pic.rows - 1) * qp)), 16
    step = 1 if pic.cols <= 10 else 5
    width, height = left + size * pic.cols + 2, top + size * pic.rows + 2
    out = [f'<svg class="heatmap {pic.kind}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="head {grid.head}">']
    for j in range(0, pic.cols, step):
        out.append(f'<text x="{left + j * size + 1}" y="{top - 4}">{j * kp}</text>')
    for i in range(pic.rows):
        y = top + i * size
        if pic.rows <= 10 or i % 5 == 0 or grid.marked_rows[i]:
            out.append(f'<text x="1" y="{y + min(size, 12) - 2}">{i * qp}</text>')
        if grid.marked_rows[i]:
            keys = " ".join(pic.marks[m].key for m in grid.marked_rows[i])
            out.append(f'<rect class="rowmark" x="{left - 5}" y="{y}" width="4" height="{size}" fill="{MARK_STROKE}" '
                       f'data-query="{i * qp}" data-marks="{_e(keys)}"><title>query {i * qp}: {_e(keys)}</title></rect>')
        for j, (value, marks) in enumerate(zip(grid.values[i], grid.marked[i])):
            out.append(_svg_cell(pic, value, marks, left + j * size, y, size, i * qp, j * kp))
    out.append("</svg>")
    return "".join(out)


def _svg_cell(pic: Picture, value: float, marks: tuple[int, ...], x: int, y: int, size: int, q: int, k: int) -> str:
    if pic.kind == "weights":
        fill, cls = weight_fill(value), "wcell"
        tip = f"query {q}, key {k}: " + ("not finite" if fill == NOT_FINITE_FILL else f"weight {fmt_value(value)}")
    else:
        category = MASK_CATEGORIES[int(value)]
        fill, cls = MASK_FILL[category], "mcell"
        tip = f"query {q}, key {k}: {MASK_MEANING[category]}"
    extra = ""
    if marks:
        keys = " ".join(pic.marks[m].key for m in marks)
        cls += " marked"
        tip += f"; marked by {keys}"
        extra = f' stroke="{MARK_STROKE}" stroke-width="2" data-marks="{_e(keys)}"'
    pad = 1 if marks else 0
    return (f'<rect class="{cls}" x="{x + pad}" y="{y + pad}" width="{size - 2 * pad}" height="{size - 2 * pad}" '
            f'fill="{fill}" data-query="{q}" data-key="{k}"{extra}><title>{_e(tip)}</title></rect>')


def _picture_legend(pic: Picture) -> str:
    items = []
    if pic.kind == "weights":
        for v in (0.0, 0.25, 0.5, 0.75, 1.0):
            items.append(f'<span><span class="swatch" style="background:{weight_fill(v)}"></span>{fmt_value(v)}</span>')
        items.append(f'<span><span class="swatch" style="background:{NOT_FINITE_FILL}"></span>not finite</span>')
    else:
        shown = ("allowed", "forbidden") if pic.intended_only else MASK_CATEGORIES
        for c in shown:
            items.append(f'<span><span class="swatch" style="background:{MASK_FILL[c]}"></span>{_e(MASK_MEANING[c])}</span>')
    if pic.marks:
        items.append('<span><span class="swatch marked"></span>a cell (or, at the left edge, a query row) '
                     "that a failing check points at</span>")
    marks = "".join(f'<li class="mark" data-mark="{_e(m.key)}">{_e(mark_text(m))}</li>' for m in pic.marks)
    return f'<div class="legend">{"".join(items)}</div>' + (f'<ul class="marks">{marks}</ul>' if marks else "")


def _heatmaps(report: Report, kind: str, title: str) -> str:
    pic = build_picture(report, kind, HTML_LIMIT)  # type: ignore[arg-type]
    if isinstance(pic, NotDrawn):
        return (f'<h3>{_e(title)}</h3><p class="not-drawn" data-not-drawn="{_e(kind)}">{_e(pic.reason)}. '
                f"The page draws up to Tq, Tk = {HTML_LIMIT} cell by cell and pools larger grids it has.</p>")
    what = {"weights": "the attention weights", "given weights": "the given weights",
            "mask": "what masking did to each (query, key) pair, against the intended relation"}[pic.source]
    heads = "".join(f'<figure class="head" data-head="{h.head}"><figcaption>head {h.head}</figcaption>'
                    f"{_svg_head(pic, i)}</figure>" for i, h in enumerate(pic.heads))
    note = ("the pipeline's masked scores were not kept: the intended relation alone; " if pic.intended_only else "")
    return (f'<h3>{_e(title)}</h3><p>{_e(what)}; queries as rows, keys as columns; example {pic.example} of '
            f'{pic.examples} ({_e(pic.why)}); {_e(note)}<span class="pooling" data-pooled="{str(pic.pooled).lower()}">'
            f'{_e(pic.pooling_text())}</span></p>{_picture_legend(pic)}'
            f'<div class="heads" data-picture="{_e(kind)}" data-example="{pic.example}">{heads}</div>')


def _pictures(report: Report) -> str:
    if report.command != "run":
        return ""
    return (f'<section id="pictures"><h2>Pictures</h2>{_heatmaps(report, "mask", "Mask")}'
            f'{_heatmaps(report, "weights", "Weights per head")}</section>')


# --- check: the failing cases ------------------------------------------------------------------


def _reproduction(report: Report) -> str:
    repro = report.details.get("reproduce") if isinstance(report.details, dict) else None
    if not isinstance(repro, dict) or not repro.get("case"):
        return ""
    return (f'<section id="reproduce"><h2>Reproduce the first finding</h2><p>smallest failing case '
            f'<code>{_e(repro["case"])}</code></p>{_case_reproduction(repro, str(repro["case"]))}</section>')


def _case_reproduction(repro: Any, case: str) -> str:
    """The first finding's reproduction lines with this case in place of its own."""
    if not isinstance(repro, dict) or not repro.get("case"):
        return ""
    data = {**repro, "case": case}
    return (f'<pre class="repro-cli">{_e(cli_line(data))}</pre>'
            f'<pre class="repro-python">{_e(chr(10).join(python_lines(data)))}</pre>')


def _failing_cases(report: Report) -> str:
    if report.command != "check":
        return ""
    failing = [r for r in report.rows if r.failing()]
    if not failing:
        return ""
    repro = report.details.get("reproduce")
    blocks = []
    for r in failing:
        checks = "".join(_check_item(c, False, True) for c in r.checks if not c.passed)
        note = f'<div class="note mono">{_e(note_text(r.note))}</div>' if r.note else ""
        blocks.append(f'<div class="case" data-case="{_e(r.name)}"><h3 class="mono">{_e(r.name)}</h3>'
                      f'<ul class="checks">{checks}</ul>{note}{_case_reproduction(repro, r.name)}</div>')
    what = report.row_label if len(failing) == 1 else f"{report.row_label}s"
    return f'<section id="failing-cases"><h2>Failing {_e(what)} ({len(failing)})</h2>{"".join(blocks)}</section>'


# --- the page ---------------------------------------------------------------------------------


def _notes(report: Report) -> str:
    lines = notes_text(report)
    if report.coverage is not None:
        cov = report.coverage
        lines.append(f"coverage: {cov.scope}" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
                     + (f" ({cov.reason})" if cov.reason else ""))
    lines += [f"warning at {row}: {c.name}: {describe(c)}" for row, c in report.warnings()]
    if not lines:
        return ""
    return f'<section id="notes"><h2>Notes</h2><pre>{_e(chr(10).join(lines))}</pre></section>'


def _details(report: Report) -> str:
    if not report.details:
        return ""
    text = dumps(details_json(report.details))
    return f'<section id="details"><h2>Details (as in --format json)</h2><pre>{_e(text)}</pre></section>'


def _header(report: Report, command_line: str) -> str:
    where = f" at {report.first_finding.row}" if report.first_finding is not None else ""
    return (f'<header><h1>attn-ledger {_e(report.command)}</h1><p class="title">{_e(report.title)}</p>'
            f'<p><span class="verdict {report.verdict}" data-verdict="{report.verdict}">{_e(report.verdict)}{_e(where)}</span></p>'
            f'<dl class="meta"><dt>command line</dt><dd><code class="command-line">{_e(command_line)}</code></dd>'
            f'<dt>version</dt><dd class="version">attn-ledger {_e(__version__)}</dd>'
            f"<dt>exit status</dt><dd>{report.exit_code}</dd></dl></header>")


def render_html(report: Report, command_line: str = "") -> str:
    """The report as one self-contained HTML page (see the module docstring)."""
    title = f"attn-ledger {report.command}: {report.verdict}" + (
        f" at {report.first_finding.row}" if report.first_finding is not None else "")
    body = "\n".join(part for part in (
        _header(report, command_line), _finding(report), _reproduction(report), _failing_cases(report),
        _pictures(report), _layers(report), _compare_blocks(report), _ledger(report), _notes(report), _details(report),
        f"<footer>written by attn-ledger {_e(__version__)}; this page loads nothing from the network</footer>",
    ) if part)
    return ("<!DOCTYPE html>\n"
            f'<html lang="en" data-verdict="{report.verdict}" data-command="{_e(report.command)}">\n<head>\n'
            f'<meta charset="utf-8">\n<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<meta name="generator" content="attn-ledger {_e(__version__)}">\n<title>{_e(title)}</title>\n'
            f"<script>{ERROR_RECORDER}</script>\n"
            + (f"<script>{OPEN_CALL}</script>\n" if report.command in ("scan", "compare") else "")
            + f"<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def command_line_text(argv: Iterable[str]) -> str:
    """The command line as a shell would take it back."""
    import shlex

    return "attn-ledger " + shlex.join(list(argv))

