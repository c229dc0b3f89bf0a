"""``compare``'s plot: each block's total and added error and its bound, one column per block, as inline SVG.

The plot is made from the report's rows alone (a block's row carries ``layer``, ``total``, ``added`` and
``bound`` as fields, and ``mark`` on the first adder). The y axis is logarithmic where the finite positive values
span :data:`LOG_SPAN` or more, else linear from 0. A value the log axis cannot place (0) sits on the axis floor,
and a value that is not finite at the top edge, each saying so in its tooltip. Each block's column is a link
to its section of the page (``#layer-N``), which opens onto its stage ledger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any, Sequence

from attn_ledger.render.text import fmt_value
from attn_ledger.report import Report, Row

LOG_SPAN = 10.0  # largest / smallest positive value from which the y axis is logarithmic
SERIES = (("total", "total error (B against A)", "#1f6fb4"),
          ("added", "added error (B's block on A's input)", "#e76f51"),
          ("bound", "bound", "#2a9d8f"))
OFFSET = {"total": -5.0, "added": 5.0, "bound": 0.0}  # total and added side by side, so that neither hides the other
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 280, 64, 16, 18, 40


@dataclass(frozen=True)
class Axis:
    """The y axis: ``log`` or linear, from ``low`` to ``high`` (decades' exponents when ``log``)."""

    log: bool
    low: float
    high: float

    def y(self, value: float) -> float:
        """The SVG y of ``value``: the top edge where it is not finite, the floor where the log axis has no place."""
        if not math.isfinite(value):
            return TOP
        if self.log:
            t = 0.0 if value <= 0 else (math.log10(value) - self.low) / (self.high - self.low)
        else:
            t = (value - self.low) / (self.high - self.low)
        return TOP + (1 - min(1.0, max(0.0, t))) * (HEIGHT - TOP - BOTTOM)

    def ticks(self) -> list[tuple[float, str]]:
        if self.log:
            return [(10.0 ** e, f"1e{e}") for e in range(int(self.low), int(self.high) + 1)]
        return [(self.low + (self.high - self.low) * i / 4, fmt_value(self.low + (self.high - self.low) * i / 4))
                for i in range(5)]


def blocks(report: Report) -> list[Row]:
    """The rows that are blocks (they carry a ``layer``), in the report's order."""
    return [r for r in report.rows if r.fields.get("layer") is not None]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def axis_of(values: Sequence[float]) -> Axis:
    """Log where the finite positive values span :data:`LOG_SPAN` or more, else linear from 0 to the largest."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not positive:
        return Axis(False, 0.0, 1.0)
    low, high = min(positive), max(positive)
    if high / low >= LOG_SPAN:
        return Axis(True, float(math.floor(math.log10(low))), float(max(math.ceil(math.log10(high)),
                                                                        math.floor(math.log10(low)) + 1)))
    return Axis(False, 0.0, high * 1.1)


def _point(series: str, colour: str, x: float, y: float, row: Row, value: float, first: bool) -> str:
    where = "" if math.isfinite(value) else " (not finite: drawn at the top edge)"
    tip = f"{row.name}: {series} {fmt_value(value)}{where}"
    attrs = (f'class="pt {series}{" first" if first else ""}" data-series="{series}" '
             f'data-layer="{row.fields["layer"]}" data-block="{escape(row.name)}" data-value="{fmt_value(value)}"')
    if series == "bound":
        return (f'<line {attrs} x1="{x - 9:.1f}" x2="{x + 9:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" '
                f'stroke-width="3"><title>{escape(tip)}</title></line>')
    shape = (f'<circle {attrs} cx="{x:.1f}" cy="{y:.1f}" r="4"' if series == "total"
             else f'<rect {attrs} x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8"')
    fill = "#fff" if not math.isfinite(value) else colour
    side = (x - 7, "end") if series == "total" else (x + 7, "start")  # total's word left of it, added's right
    word = "" if math.isfinite(value) else (f'<text class="nonfinite-label" x="{side[0]:.1f}" y="{y + 4:.1f}" '
                                            f'text-anchor="{side[1]}" fill="{colour}">{fmt_value(value)}</text>')
    return f'{shape} fill="{fill}" stroke="{colour}" stroke-width="1.5"><title>{escape(tip)}</title>' + (
        "</circle>" if series == "total" else "</rect>") + word


def _grid(axis: Axis) -> list[str]:
    out = []
    for value, label in axis.ticks():
        y = axis.y(value)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
                   f'<text class="tick" x="{LEFT - 6}" y="{y + 3:.1f}" text-anchor="end">{escape(label)}</text>')
    return out


def _column(row: Row, i: int, x: float, step: float, first: bool) -> str:
    """Block ``i``'s column: a link to its section, its number under the axis, the first adder shaded."""
    band = (f'<rect class="first-adder" data-layer="{row.fields["layer"]}" x="{x - step / 2:.1f}" y="{TOP}" '
            f'width="{step:.1f}" height="{HEIGHT - TOP - BOTTOM}" fill="#fdecea"/>'
            f'<text class="first-adder-label" x="{x:.1f}" y="{TOP - 5}" text-anchor="middle" fill="#b71c1c">'
            "first adder</text>") if first else ""
    return (f'{band}<a class="plot-layer" href="#layer-{i}" data-block="{escape(row.name)}">'
            f'<title>{escape(row.name)}: open its section</title>'
            f'<rect class="hit" x="{x - step / 2:.1f}" y="{TOP}" width="{step:.1f}" height="{HEIGHT - TOP}" '
            f'fill="transparent"/><text class="tick layer-tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" '
            f'text-anchor="middle">{escape(str(row.fields["layer"]))}</text></a>')


def layer_plot(report: Report) -> str:
    """The SVG plot of every block's total and added error and its bound ("" where the report has no block)."""
    rows = blocks(report)
    if not rows:
        return ""
    values = {s: [_number(r.fields.get(s)) for r in rows] for s, _, _ in SERIES}
    axis = axis_of([v for vs in values.values() for v in vs if v is not None])
    step = (WIDTH - LEFT - RIGHT) / len(rows)
    xs = [LEFT + step * (i + 0.5) for i in range(len(rows))]
    firsts = [r.fields.get("mark") == "first adder" for r in rows]
    out = [f'<svg class="layer-plot" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" data-scale="{"log" if axis.log else "linear"}" '
           'aria-label="total and added error per block, and the bound">']
    out += [_column(r, i, x, step, f) for i, (r, x, f) in enumerate(zip(rows, xs, firsts))]
    out += _grid(axis)
    out.append(f'<text class="tick" x="{(LEFT + WIDTH - RIGHT) / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
               f'block (layer){", log scale" if axis.log else ""}</text>')
    for series, _, colour in SERIES:
        points = [(x + OFFSET[series], axis.y(v), r, v, f) for x, r, v, f in zip(xs, rows, values[series], firsts)
                  if v is not None]
        finite = [(x, y) for x, y, _, v, _ in points if math.isfinite(v)]  # a value that is not finite: no line to it
        if len(finite) > 1:
            dash = ' stroke-dasharray="5 4"' if series == "bound" else ""
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in finite)
            out.append(f'<polyline class="series {series}" points="{line}" fill="none" stroke="{colour}" '
                       f'stroke-width="1.5"{dash}/>')
        out += [_point(series, colour, x, y, r, v, f) for x, y, r, v, f in points]
    out.append("</svg>")
    return "".join(out)


def plot_legend() -> str:
    """What each mark of the plot is, as HTML."""
    shapes = {"total": "&#9679;", "added": "&#9632;", "bound": "&#9644;"}
    items = "".join(f'<span><span style="color:{c}">{shapes[s]}</span> {escape(words)}</span>'
                    for s, words, c in SERIES)
    return (f'<div class="legend">{items}<span><span class="swatch" style="background:#fdecea"></span>'
            "the first adder (the first block whose checks fail)</span></div>")
