"""Terminal heatmaps of a run: the weights per head, or what masking did per head (``run --show``).

Each (query, key) cell is two characters wide: queries are rows, keys are columns, one
panel per head, panels side by side and wrapping onto further lines to fit the width. A
cell's first character shows its value (a shade for weights, a category for the mask);
its second repeats it, or shows the mark of a failing check that points at the cell.
A mark after a query's label flags a whole row. On a terminal the shades are block
characters and marked cells are red; elsewhere (a pipe, a file) plain ASCII.

Up to :data:`TERMINAL_LIMIT` queries and keys every cell is drawn (fewer when the width
leaves less room); larger grids are pooled (the legend says how), and runs that kept no
whole grids get one paragraph saying so instead of a picture.
"""

from __future__ import annotations

from typing import Sequence

from attn_ledger.render.pictures import MASK_CATEGORIES, MASK_MEANING, Mark, NotDrawn, Picture, build_picture, mark_text
from attn_ledger.render.table import Line, Segment, plain, wrap_words
from attn_ledger.report import Report

TERMINAL_LIMIT = 32  # queries and keys drawn cell by cell; larger grids are pooled to this many cells a side
GAP = "   "  # between head panels
SHADES = {"unicode": " ░▒▓█", "ascii": " .:+#"}  # weight 0, up to 1/4, 1/2, 3/4, 1
MASK_GLYPH = {
    "unicode": {"allowed": "█", "forbidden": "·", "dropped": "o", "leaked": "X"},
    "ascii": {"allowed": "#", "forbidden": ".", "dropped": "o", "leaked": "X"},
}
NOT_FINITE = "?"
ROW_MARK = "!"
# the mark a failing check leaves in the second character of the cells it points at
MARK_GLYPH = {
    "forbidden_excluded": "X",
    "forbidden_weight": "X",
    "user_weights_forbidden_weight": "X",
    "allowed_kept": "o",
    "finite": "!",
    "user_weights_finite": "!",
}
OTHER_MARK = "*"
MARK_STYLE = "bold red"


def shade(value: float, charset: str) -> str:
    """The shade of a weight: blank at 0, then four steps up to 1 (values outside [0, 1] clipped)."""
    if value != value or value in (float("inf"), float("-inf")):
        return NOT_FINITE
    chars = SHADES[charset]
    if value <= 0:
        return chars[0]
    return chars[min(4, max(1, -int(-value * 4 // 1)))]  # ceil(4 v), at least 1 for any positive weight


def mark_glyph(mark: Mark) -> str:
    return ROW_MARK if mark.rows else MARK_GLYPH.get(mark.check.name, OTHER_MARK)


def _cell(pic: Picture, value: float, marks: tuple[int, ...], charset: str) -> Segment:
    if pic.kind == "weights":
        first = shade(value, charset)
    else:
        first = MASK_GLYPH[charset][MASK_CATEGORIES[int(value)]]
    second = mark_glyph(pic.marks[marks[0]]) if marks else first
    style = MARK_STYLE if marks else ("red" if pic.kind == "mask" and first in "Xo" else "")
    return first + second, style


def _ticks(cols: int, step: int, pool: int, width: int) -> str:
    """Key numbers over the columns, each at its column, never overlapping or cut at the panel's edge."""
    out = [" "] * width
    end = -1
    for j in range(0, cols, step):
        text = str(j * pool)
        pos = 2 * j
        if pos <= end or pos + len(text) > width:
            continue
        out[pos:pos + len(text)] = text
        end = pos + len(text)
    return "".join(out)


def _panel(pic: Picture, h: int, charset: str) -> list[Line]:
    """One head: a title line, the key numbers, then one line per (pooled) query row."""
    grid = pic.heads[h]
    qp, kp = pic.pool
    label_w = len(f"q{(pic.rows - 1) * qp}") + 2  # label, row mark, space
    cells_w = 2 * pic.cols
    title = f"head {grid.head}"
    width = max(label_w + cells_w, len(title))
    lines: list[Line] = [[(title.ljust(width), "bold")]]
    step = 1 if pic.cols <= 10 else 5
    lines.append([(" " * label_w + _ticks(pic.cols, step, kp, cells_w).ljust(width - label_w), "dim")])
    for i in range(pic.rows):
        marks = grid.marked_rows[i]
        label = f"q{i * qp}" + (ROW_MARK if marks else "")
        line: Line = [(label.ljust(label_w), MARK_STYLE if marks else "")]
        line += [_cell(pic, v, m, charset) for v, m in zip(grid.values[i], grid.marked[i])]
        line.append((" " * (width - label_w - cells_w), ""))
        lines.append(line)
    return lines


def _side_by_side(panels: Sequence[list[Line]], width: int) -> list[Line]:
    """Panels left to right while they fit the width, then on further lines (heads wrap)."""
    out: list[Line] = []
    row: list[list[Line]] = []
    used = 0
    for p in panels:
        w = sum(len(t) for t, _ in p[0])
        if row and used + len(GAP) + w > width:
            out += _join(row) + [[]]
            row, used = [], 0
        used += (len(GAP) if row else 0) + w
        row.append(p)
    if row:
        out += _join(row)
    return out


def _join(panels: list[list[Line]]) -> list[Line]:
    height = max(len(p) for p in panels)
    lines: list[Line] = []
    for i in range(height):
        line: Line = []
        for k, p in enumerate(panels):
            if k:
                line.append((GAP, ""))
            w = sum(len(t) for t, _ in p[0])
            line += p[i] if i < len(p) else [(" " * w, "")]
        lines.append(line)
    return lines


def _legend(pic: Picture, charset: str, width: int) -> list[Line]:
    what = {"weights": "weights [B,Nh,Tq,Tk]", "given weights": "the given weights [B,Nh,Tq,Tk]",
            "mask": "masking [B,Nh,Tq,Tk] against the intended relation"}[pic.source]
    texts = [(f"{what}, example {pic.example} of {pic.examples} ({pic.why}); rows: queries, columns: keys; "
              f"{pic.pooling_text()}", "bold")]
    if pic.kind == "weights":
        s = SHADES[charset]
        texts.append((f"shade: blank 0, '{s[1]}' up to 0.25, '{s[2]}' up to 0.5, '{s[3]}' up to 0.75, "
                      f"'{s[4]}' up to 1, '{NOT_FINITE}' not finite", ""))
    else:
        glyphs = MASK_GLYPH[charset]
        shown = ("allowed", "forbidden") if pic.intended_only else ("allowed", "forbidden", "leaked", "dropped")
        texts.append(("cells: " + ", ".join(f"'{glyphs[c]}' {MASK_MEANING[c]}" for c in shown), ""))
        if pic.intended_only:
            texts.append(("the masked scores were not kept: this is the intended relation alone", "yellow"))
    for mark in pic.marks:
        where = "after a query's label" if mark.rows else "in a cell's second character"
        texts.append((f"'{mark_glyph(mark)}' {where}: {mark_text(mark)}", MARK_STYLE))
    lines: list[Line] = []
    for text, style in texts:
        lines += [[(ln, style)] for ln in wrap_words(text, width)]
    return lines


def heatmap_lines(report: Report, kind: str, width: int = 80, charset: str = "ascii",
                  limit: int = TERMINAL_LIMIT) -> list[Line]:
    """The heatmap of ``kind`` (``weights`` or ``mask``) as styled lines at most ``width`` wide."""
    # the widest panel that fits: a row label (up to "q9999!" and a space) and two characters a key
    fit = max(4, min(limit, (width - 7) // 2))
    pic = build_picture(report, kind, fit)  # type: ignore[arg-type]
    if isinstance(pic, NotDrawn):
        text = (f"{kind} heatmap not drawn: {pic.reason}. --show draws up to Tq, Tk = {limit} cell by cell "
                "and pools larger grids it has")
        return [[(ln, "yellow")] for ln in wrap_words(text, width)]
    panels = [_panel(pic, h, charset) for h in range(len(pic.heads))]
    return _legend(pic, charset, width) + [[]] + _side_by_side(panels, width)


def render_heatmap(report: Report, kind: str, width: int = 80, charset: str = "ascii") -> str:
    """The heatmap as plain text."""
    return plain(heatmap_lines(report, kind, width, charset))
