"""What the heatmaps draw, read from a report's kept grids: one example, every head, the marks.

Both picture views (the terminal heatmap and the HTML report) draw a :class:`Picture`:

* ``weights``: the attention weights ``[Nh, Tq, Tk]`` of one example (the given weights
  when the user supplied their own), as numbers in [0, 1];
* ``mask``: per head, what masking did to each (query, key) pair against the intended
  relation, as one of :data:`MASK_CATEGORIES`.

The example drawn is the one the first finding points at (its check's ``location``), else
the first example holding a marked cell, else example 0; the picture says which and why.
Cells a failing check points at (``report.tensors["marks"]``, set by the ledger) are marked.
Grids larger than a view's ``limit`` on either axis are pooled to at most ``limit`` cells a
side: a pooled cell holds the largest weight of its block, the most severe mask category,
and is marked when any of its cells is. Runs that kept no whole grids cannot be drawn: the
view says so (:class:`NotDrawn`) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from attn_ledger.render.text import describe
from attn_ledger.report import Check, Report

Kind = Literal["weights", "mask"]

# Mask categories, in order of severity (a pooled cell shows the most severe of its cells).
MASK_CATEGORIES = ("forbidden", "allowed", "dropped", "leaked")
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


def _grid(t: Any) -> bool:
    return t is not None and hasattr(t, "dim") and t.dim() == 4


def chosen_example(report: Report) -> tuple[int, str]:
    """The example to draw and why: the first finding's, else the first marked one, else 0."""
    finding = report.first_finding
    where = finding.check.location if finding is not None else None
    if where and "example" in where:
        return int(where["example"]), f"where the first finding, {finding.row}.{finding.name}, points"
    for key, mark in report.tensors.get("marks", {}).items():
        hits = mark.reshape(mark.shape[0], -1).any(dim=1).nonzero()
        if hits.numel():
            return int(hits[0, 0]), f"the first example that {key} points at"
    if finding is not None:
        return 0, f"example 0: the first finding ({finding.row}.{finding.name}) is not on a score grid"
    return 0, "example 0: no finding"


def _pool(t: Any, qp: int, kp: int, fill: float) -> Any:
    """Block-wise max of ``[Nh, Tq, Tk]`` over ``qp x kp`` blocks (edges padded with ``fill``)."""
    import torch.nn.functional as F

    if (qp, kp) == (1, 1):
        return t
    nh, tq, tk = t.shape
    rq, rk = -(-tq // qp), -(-tk // kp)
    padded = F.pad(t, (0, rk * kp - tk, 0, rq * qp - tq), value=fill)  # [Nh, rq*qp, rk*kp]
    return padded.reshape(nh, rq, qp, rk, kp).amax(dim=(2, 4))  # [Nh, rq, rk]


def _pool_rows(t: Any, qp: int) -> Any:
    """Any-of over blocks of ``qp`` query rows of ``[Nh, Tq]`` bools."""
    import torch.nn.functional as F

    if qp == 1:
        return t
    nh, tq = t.shape
    rq = -(-tq // qp)
    return F.pad(t, (0, rq * qp - tq), value=False).reshape(nh, rq, qp).any(dim=2)


def _marks(report: Report, example: int, tq: int, tk: int) -> list[tuple[Mark, Any]]:
    found = []
    for key, mark in report.tensors.get("marks", {}).items():
        stage, _, name = key.partition(".")
        try:
            check = report.check(stage, name)
        except KeyError:
            continue
        rows = mark.dim() == 3
        if tuple(mark.shape[2:]) != ((tq,) if rows else (tq, tk)) or example >= mark.shape[0]:
            continue
        m = mark[example]  # [Nh, Tq] or [Nh, Tq, Tk]
        found.append((Mark(key, stage, check, rows, int(m.sum())), m))
    return found


def build_picture(report: Report, kind: Kind, limit: int) -> Picture | NotDrawn:
    """The picture of ``kind`` for this report, pooled to at most ``limit`` cells a side."""
    import torch

    t = report.tensors
    if kind == "weights":
        source = "given weights" if _grid(t.get("user_weights")) else "weights"
        grid = t.get("user_weights") if source == "given weights" else t.get("weights")
    else:
        source = "mask"
        grid = t.get("masked_scores") if _grid(t.get("masked_scores")) else t.get("allow")
    if not _grid(grid):
        if report.command != "run":
            return NotDrawn(f"`{report.command}` checks from outside: it keeps no score grids to draw")
        return NotDrawn("this run kept no whole score grids (large runs stream them block by block, and a stage "
                        "that fails before the grids are built leaves none); --keep-grids keeps them, and the "
                        "heatmaps are then pooled beyond the size they draw cell by cell")
    b, nh, tq, tk = (int(n) for n in grid.shape)
    example, why = chosen_example(report)
    example = min(example, b - 1)
    qp, kp = -(-tq // limit), -(-tk // limit)
    marks = _marks(report, example, tq, tk)
    if kind == "weights":
        values = _pool(grid[example], qp, kp, float("-inf")).double().tolist()  # [Nh, rows, cols]
        intended_only = False
    else:
        values, intended_only = _mask_values(t, grid, example, qp, kp)
    rq, rk = -(-tq // qp), -(-tk // kp)
    cells = [[[() for _ in range(rk)] for _ in range(rq)] for _ in range(nh)]  # [Nh][rows][cols]
    rows: list[list[tuple[int, ...]]] = [[() for _ in range(rq)] for _ in range(nh)]
    for idx, (mk, m) in enumerate(marks):
        if mk.rows:
            for h, i in _pool_rows(m, qp).nonzero().tolist():
                rows[h][i] += (idx,)
        else:
            for h, i, j in _pool(m.to(torch.uint8), qp, kp, 0).nonzero().tolist():
                cells[h][i][j] += (idx,)
    heads = [HeadGrid(h, values[h], cells[h], rows[h]) for h in range(nh)]
    return Picture(kind, source, example, b, why, tq, tk, (qp, kp), tuple(heads), tuple(mk for mk, _ in marks),
                   intended_only)


def _mask_values(t: Any, grid: Any, example: int, qp: int, kp: int) -> tuple[list, bool]:
    """Mask category indices ``[Nh, rows, cols]`` for one example, and whether only the relation was kept."""
    import torch

    allow = t.get("allow")
    if allow is None or not _grid(allow):
        allow = torch.ones(grid.shape, dtype=torch.bool, device=grid.device)
    allow = allow[example].bool()  # [Nh, Tq, Tk]
    intended_only = grid.dtype == torch.bool  # no masked scores kept: the relation alone
    kept = allow if intended_only else ~torch.isneginf(grid[example])  # [Nh, Tq, Tk]: pairs the pipeline kept
    code = {name: i for i, name in enumerate(MASK_CATEGORIES)}
    cat = torch.full(allow.shape, code["forbidden"], dtype=torch.int8)  # [Nh, Tq, Tk]
    cat[allow & kept] = code["allowed"]
    cat[allow & ~kept] = code["dropped"]
    cat[~allow & kept] = code["leaked"]
    return _pool(cat, qp, kp, -1).tolist(), intended_only


def mark_text(mark: Mark) -> str:
    """``masked_scores.forbidden_excluded (forbidden ... = 60 (limit 0) ...): 20 cells here``."""
    unit = "query rows" if mark.rows else "cells"
    return f"{mark.key}: {describe(mark.check)}; {mark.count} {unit} in this example"
