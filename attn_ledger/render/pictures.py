"""What the heatmaps draw, read from a report's heatmap data: one example, every head, the marks.

Both picture views (the terminal heatmap and the HTML report) draw a :class:`Picture`:

* ``weights``: the attention weights ``[Nh, Tq, Tk]`` of one example (the given weights
  when the user supplied their own), as numbers in [0, 1];
* ``mask``: per head, what masking did to each (query, key) pair against the intended
  relation, as one of :data:`MASK_CATEGORIES`.

The example drawn is the one the first finding points at (its check's ``location``), else
the first example holding a marked cell, else example 0; the picture says which and why.
Cells a failing check points at are marked. Grids larger than a view's ``limit`` on either
axis are pooled to at most ``limit`` cells a side: a pooled cell holds the largest weight of
its block, the most severe mask category, and is marked when any of its cells is. The
engine computes all of that from the kept tensors (:mod:`attn_ledger.engine.heatmaps`, into
``report.heatmaps``); this module only reads it. Runs that kept no whole grids cannot be
drawn: the view says so (:class:`NotDrawn`) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from attn_ledger.render.text import describe
from attn_ledger.report import HEATMAP_LIMITS, Check, Report
from attn_ledger.report import MASK_CATEGORIES  # noqa: F401 - the views read the categories from here

Kind = Literal["weights", "mask"]
MASK_MEANING = {
    "allowed": "allowed and kept",
    "forbidden": "forbidden and excluded",
    "dropped": "allowed but excluded",
    "leaked": "forbidden but kept (a leak)",
}


@dataclass(frozen=True)
class Mark:
    """One failing check that points at cells (or whole query rows) of the grid."""

    key: str  # "stage.check"
    stage: str
    check: Check
    rows: bool  # True: it points at whole query rows; False: at (query, key) cells
    count: int  # marked cells (or rows) in the example drawn, over every head


@dataclass(frozen=True)
class HeadGrid:
    """One head of the example drawn.

    ``values[i][j]``: the weight (``weights``) or an index into :data:`MASK_CATEGORIES`
    (``mask``). ``marked[i][j]``: indices into :attr:`Picture.marks` of the checks that point
    at the cell; ``marked_rows[i]``: those that point at query row ``i``.
    """

    head: int
    values: list[list[float]]
    marked: list[list[tuple[int, ...]]]
    marked_rows: list[tuple[int, ...]]


@dataclass(frozen=True)
class Picture:
    """A heatmap of one example, every head, ready to draw."""

    kind: Kind
    source: str  # what the values are: "weights", "given weights", "mask"
    example: int
    examples: int
    why: str  # why this example
    tq: int
    tk: int
    pool: tuple[int, int]  # (queries, keys) per drawn cell; (1, 1) when every cell is drawn
    heads: tuple[HeadGrid, ...]
    marks: tuple[Mark, ...]
    intended_only: bool = False  # mask: the pipeline's masked scores were not kept, only the relation is drawn

    @property
    def pooled(self) -> bool:
        return self.pool != (1, 1)

    @property
    def rows(self) -> int:
        return -(-self.tq // self.pool[0])

    @property
    def cols(self) -> int:
        return -(-self.tk // self.pool[1])

    def pooling_text(self) -> str:
        """Names the pooling, or says every cell is drawn."""
        if not self.pooled:
            return f"every cell drawn (Tq={self.tq}, Tk={self.tk})"
        qp, kp = self.pool
        what = "the largest weight" if self.kind == "weights" else "the most severe category"
        return (f"pooled: Tq={self.tq}, Tk={self.tk} drawn as {self.rows} x {self.cols} cells, each cell "
                f"{what} over {qp} queries x {kp} keys, marked when any of its cells is")


@dataclass(frozen=True)
class NotDrawn:
    """Why a picture cannot be drawn for this report."""

    reason: str


def why_text(chosen: Mapping[str, Any]) -> str:
    """Why this example is drawn, from :attr:`~attn_ledger.report.Heatmap.chosen`."""
    by = chosen.get("by")
    if by == "finding":
        return f"where the first finding, {chosen['row']}.{chosen['check']}, points"
    if by == "mark":
        return f"the first example that {chosen['key']} points at"
    if by == "off_grid":
        return f"example 0: the first finding ({chosen['row']}.{chosen['check']}) is not on a score grid"
    return "example 0: no finding"


def build_picture(report: Report, kind: Kind, limit: int) -> Picture | NotDrawn:
    """The picture of ``kind`` for this report, pooled to at most ``limit`` cells a side (4 to 64)."""
    data = report.heatmaps.get(kind)
    if data is None:
        if report.command != "run":
            return NotDrawn(f"`{report.command}` checks from outside: it keeps no score grids to draw")
        return NotDrawn("this run kept no whole score grids (large runs stream them block by block, and a stage "
                        "that fails before the grids are built leaves none); --keep-grids keeps them, and the "
                        "heatmaps are then pooled beyond the size they draw cell by cell")
    limit = min(max(limit, HEATMAP_LIMITS[0]), HEATMAP_LIMITS[-1])
    pool = (-(-data.tq // limit), -(-data.tk // limit))
    level = data.levels[pool]
    marks = []
    for mk in data.marks:
        stage, _, name = mk.key.partition(".")
        marks.append(Mark(mk.key, stage, report.check(stage, name), mk.rows, mk.count))
    def which(bits: int) -> tuple[int, ...]:
        return tuple(k for k in range(len(marks)) if bits >> k & 1)

    heads = tuple(HeadGrid(h, level.values[h], [[which(b) for b in row] for row in level.marked[h]],
                           [which(b) for b in level.marked_rows[h]]) for h in range(len(level.values)))
    return Picture(kind, data.source, data.example, data.examples, why_text(data.chosen), data.tq, data.tk, pool,
                   heads, tuple(marks), data.intended_only)


def mark_text(mark: Mark) -> str:
    """``masked_scores.forbidden_excluded (forbidden ... = 60 (limit 0) ...): 20 cells here``."""
    unit = "query rows" if mark.rows else "cells"
    return f"{mark.key}: {describe(mark.check)}; {mark.count} {unit} in this example"
