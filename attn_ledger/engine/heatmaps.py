"""What the heatmaps draw, taken from the kept grids once, as plain data (:class:`~attn_ledger.report.Heatmap`).

Two kinds:

* ``weights``: the attention weights ``[Nh, Tq, Tk]`` of one example (the given weights when the
  user supplied their own), as numbers in [0, 1];
* ``mask``: per head, what masking did to each (query, key) pair against the intended relation, as
  an index into :data:`MASK_CATEGORIES`.

The example drawn is the one the first finding points at (its check's ``location``), else the first
example holding a marked cell, else example 0. Cells a failing check points at
(``tensors["marks"]``, :func:`attn_ledger.engine.locate.locate`) are marked. A view draws at most
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


def _pool(t: "Tensor", qp: int, kp: int) -> "Tensor":
    """Block-wise max of ``[Nh, Tq, Tk]`` over ``qp x kp`` blocks, the blocks at the edges cut short
    (a max pool with ``ceil_mode``: what lies past the edge takes no part)."""
    import torch
    import torch.nn.functional as F

    if (qp, kp) == (1, 1):
        return t
    x = t if t.dtype in (torch.float32, torch.float64) else t.float()  # exact for every value these grids hold
    return F.max_pool2d(x[None], (qp, kp), (qp, kp), ceil_mode=True)[0]  # [Nh, ceil(Tq/qp), ceil(Tk/kp)]


def _pool_rows(t: "Tensor", qp: int) -> "Tensor":
    """Any-of over blocks of ``qp`` query rows of ``[Nh, Tq]`` marks (0 or 1)."""
    import torch.nn.functional as F

    if qp == 1:
        return t
    nh, tq = t.shape
    rq = -(-tq // qp)
    return F.pad(t, (0, rq * qp - tq), value=0).reshape(nh, rq, qp).any(dim=2)


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


def _marked(marks: list[tuple[HeatMark, "Tensor"]], nh: int, tq: int, tk: int, qp: int, kp: int) -> tuple[list, list]:
    """The marks pooled by ``qp x kp``: per drawn cell, and per drawn query row, a set of bits (bit k: marks[k])."""
    import torch

    rq, rk = -(-tq // qp), -(-tk // kp)
    cells = torch.zeros(nh, rq, rk, dtype=torch.int64)  # [Nh, rows, cols]
    rows = torch.zeros(nh, rq, dtype=torch.int64)  # [Nh, rows]
    for idx, (mk, m) in enumerate(marks):
        if mk.rows:
            rows |= _pool_rows(m, qp).long() << idx
        else:
            cells |= (_pool(m, qp, kp) > 0).long() << idx
    return cells.tolist(), rows.tolist()


def heatmap(report: Report, kind: str, marked: dict | None = None) -> Heatmap | None:
    """The heatmap of ``kind`` (``weights`` or ``mask``) from the report's kept grids; None when none were kept.
    ``marked``: the marks pooled so far, by example and pooling, shared between the two kinds."""
    marked = {} if marked is None else marked
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
        values, intended_only = grid[example], False  # [Nh, Tq, Tk]
    else:
        values, intended_only = _mask_values(t, grid, example)
    values = values if values.is_floating_point() else values.float()  # pooled as floats: convert once, not per level
    marks = [(mk, m.float()) for mk, m in marks]
    pools = sorted({(-(-tq // n), -(-tk // n)) for n in HEATMAP_LIMITS})
    levels = {}
    for p in pools:
        pooled = _pool(values, *p)  # [Nh, rows, cols]
        grid = pooled.int().tolist() if kind == "mask" else pooled.double().tolist()
        if (example, p) not in marked:  # the same for both kinds: pooled once
            marked[(example, p)] = _marked(marks, nh, tq, tk, *p)
        levels[p] = HeatLevel(grid, *marked[(example, p)])
    return Heatmap(kind, source, example, b, chosen, tq, tk, tuple(mk for mk, _ in marks), levels, intended_only)


def with_heatmaps(report: Report) -> Report:
    """The report with :attr:`~attn_ledger.report.Report.heatmaps` filled from its kept grids."""
    from dataclasses import replace

    marked: dict = {}
    found = {kind: h for kind in ("mask", "weights") if (h := heatmap(report, kind, marked)) is not None}
    return replace(report, heatmaps=found) if found else report
