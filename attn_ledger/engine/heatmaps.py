"""What the heatmaps draw, taken from the kept grids once, as plain data (:class:`~attn_ledger.report.Heatmap`).

Two kinds:

* ``weights``: the attention weights ``[Nh, Tq, Tk]`` of one example (the given weights when the
  user supplied their own), as numbers in [0, 1];
* ``mask``: per head, what masking did to each (query, key) pair against the intended relation, as
  an index into :data:`MASK_CATEGORIES`.

The example drawn is the one the first finding points at (its check's ``location``), else the first
example holding a marked cell, else example 0. Cells a failing check points at
(``tensors["marks"]``, :func:`attn_ledger.cells.locate`) are marked. A view draws at most
``limit`` cells a side, for any limit in :data:`HEATMAP_LIMITS`; the grid is kept pooled for each of
them: a pooled cell holds the largest weight of its block, the most severe mask category, and is
marked when any of its cells is. Runs that kept no whole grids get no heatmap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attn_ledger.report import HEATMAP_LIMITS, MASK_CATEGORIES, HeatLevel, HeatMark, Heatmap, Report

if TYPE_CHECKING:
    from torch import Tensor


def _grid(t: Any) -> bool:
    return t is not None and hasattr(t, "dim") and t.dim() == 4


def chosen_example(report: Report) -> tuple[int, dict[str, Any]]:
    """The example to draw and why: the first finding's, else the first marked one, else 0."""
    finding = report.first_finding
    where = finding.check.location if finding is not None else None
    if where and "example" in where:
        return int(where["example"]), {"by": "finding", "row": finding.row, "check": finding.name}  # type: ignore[union-attr]
    for key, mark in report.tensors.get("marks", {}).items():
        hits = mark.reshape(mark.shape[0], -1).any(dim=1).nonzero()
        if hits.numel():
            return int(hits[0, 0]), {"by": "mark", "key": key}
    if finding is not None:
        return 0, {"by": "off_grid", "row": finding.row, "check": finding.name}
    return 0, {"by": "none"}


def _pool(t: "Tensor", qp: int, kp: int, fill: float) -> "Tensor":
    """Block-wise max of ``[Nh, Tq, Tk]`` over ``qp x kp`` blocks (edges padded with ``fill``)."""
    import torch.nn.functional as F

    if (qp, kp) == (1, 1):
        return t
    nh, tq, tk = t.shape
    rq, rk = -(-tq // qp), -(-tk // kp)
    padded = F.pad(t, (0, rk * kp - tk, 0, rq * qp - tq), value=fill)  # [Nh, rq*qp, rk*kp]
    return padded.reshape(nh, rq, qp, rk, kp).amax(dim=(2, 4))  # [Nh, rq, rk]


def _pool_rows(t: "Tensor", qp: int) -> "Tensor":
    """Any-of over blocks of ``qp`` query rows of ``[Nh, Tq]`` bools."""
    import torch.nn.functional as F

    if qp == 1:
        return t
    nh, tq = t.shape
    rq = -(-tq // qp)
    return F.pad(t, (0, rq * qp - tq), value=False).reshape(nh, rq, qp).any(dim=2)


def _marks(report: Report, example: int, tq: int, tk: int) -> list[tuple[HeatMark, "Tensor"]]:
    found = []
    for key, mark in report.tensors.get("marks", {}).items():
        stage, _, name = key.partition(".")
        try:
            report.check(stage, name)
        except KeyError:
            continue
        rows = mark.dim() == 3
        if tuple(mark.shape[2:]) != ((tq,) if rows else (tq, tk)) or example >= mark.shape[0]:
            continue
        m = mark[example]  # [Nh, Tq] or [Nh, Tq, Tk]
        found.append((HeatMark(key, rows, int(m.sum())), m))
    return found


def _mask_values(t: Any, grid: "Tensor", example: int) -> tuple["Tensor", bool]:
    """Mask category indices ``[Nh, Tq, Tk]`` for one example, and whether only the relation was kept."""
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
    return cat, intended_only


def _level(values: "Tensor", fill: float, marks: list[tuple[HeatMark, "Tensor"]], qp: int, kp: int) -> HeatLevel:
    """The example's grid ``[Nh, Tq, Tk]`` pooled by ``qp x kp``, with the marks of each drawn cell and row."""
    import torch

    nh, tq, tk = values.shape
    pooled = _pool(values, qp, kp, fill)  # [Nh, rows, cols]
    grid = pooled.double().tolist() if values.is_floating_point() else pooled.tolist()
    rq, rk = -(-tq // qp), -(-tk // kp)
    cells: list[list[list[tuple[int, ...]]]] = [[[() for _ in range(rk)] for _ in range(rq)] for _ in range(nh)]
    rows: list[list[tuple[int, ...]]] = [[() for _ in range(rq)] for _ in range(nh)]
    for idx, (mk, m) in enumerate(marks):
        if mk.rows:
            for h, i in _pool_rows(m, qp).nonzero().tolist():
                rows[h][i] += (idx,)
        else:
            for h, i, j in _pool(m.to(torch.uint8), qp, kp, 0).nonzero().tolist():
                cells[h][i][j] += (idx,)
    return HeatLevel(grid, cells, rows)


def heatmap(report: Report, kind: str) -> Heatmap | None:
    """The heatmap of ``kind`` (``weights`` or ``mask``) from the report's kept grids; None when none were kept."""
    t = report.tensors
    if kind == "weights":
        source = "given weights" if _grid(t.get("user_weights")) else "weights"
        grid = t.get("user_weights") if source == "given weights" else t.get("weights")
    else:
        source = "mask"
        grid = t.get("masked_scores") if _grid(t.get("masked_scores")) else t.get("allow")
    if not _grid(grid) or grid.shape[0] == 0:  # no grid kept, or an empty batch
        return None
    b, nh, tq, tk = (int(n) for n in grid.shape)
    example, chosen = chosen_example(report)
    example = min(example, b - 1)
    marks = _marks(report, example, tq, tk)
    if kind == "weights":
        values, fill, intended_only = grid[example], float("-inf"), False  # [Nh, Tq, Tk]
    else:
        (values, intended_only), fill = _mask_values(t, grid, example), -1
    pools = sorted({(-(-tq // n), -(-tk // n)) for n in HEATMAP_LIMITS})
    levels = {p: _level(values, fill, marks, *p) for p in pools}
    return Heatmap(kind, source, example, b, chosen, tq, tk, tuple(mk for mk, _ in marks), levels, intended_only)


def with_heatmaps(report: Report) -> Report:
    """The report with :attr:`~attn_ledger.report.Report.heatmaps` filled from its kept grids."""
    from dataclasses import replace

    found = {kind: h for kind in ("mask", "weights") if (h := heatmap(report, kind)) is not None}
    return replace(report, heatmaps=found) if found else report
