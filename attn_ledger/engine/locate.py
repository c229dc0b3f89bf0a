"""Which cells of the kept score grids a failing check points at.

The ledger counts and folds over blocks, so a check such as ``forbidden_excluded = 60``
says how many pairs went wrong but not which. Where the whole grids were kept (small
runs, or ``--keep-grids``), :func:`locate` finds them again from the kept tensors and the
check's own limit: each failing grid check gets the first such cell as its ``location``
(``example``, ``head``, ``query`` and, for a cell, ``key``), and the report's
``tensors["marks"]`` holds the cells themselves, from which :mod:`attn_ledger.engine.heatmaps` marks
the heatmaps.

A mark is a bool tensor: ``[B, Nh, Tq, Tk]`` for checks about (query, key) pairs, or
``[B, Nh, Tq]`` for checks about whole query rows. Its key is ``"stage.check"``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger.report import Check, Report, Row, first_finding_of

if TYPE_CHECKING:
    from torch import Tensor

MARKED = ("fail", "downstream")  # statuses whose cells are marked

Grids = Mapping[str, Any]  # the report's tensors: scores, masked_scores, weights, allow, user_weights


def _allow(g: Grids, like: "Tensor") -> "Tensor":
    """The intended relation on the grid, all True where the run had none."""
    import torch

    allow = g.get("allow")
    return torch.ones_like(like, dtype=torch.bool) if allow is None else allow.expand_as(like)


def _forbidden_kept(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
    import torch

    m = g["masked_scores"]  # [B, Nh, Tq, Tk]
    return ~_allow(g, m) & ~torch.isneginf(m)


def _allowed_dropped(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
    import torch

    m = g["masked_scores"]  # [B, Nh, Tq, Tk]
    return _allow(g, m) & torch.isneginf(m)


def _blocked_rows(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
    import torch

    m = g["masked_scores"]  # [B, Nh, Tq, Tk]
    dead = torch.isneginf(m).all(dim=-1)  # [B, Nh, Tq]
    return dead & _allow(g, m).any(dim=-1) if empty_zero else dead


def _nan_or_posinf(key: str) -> Callable[[Grids, Check, bool], "Tensor"]:
    def cells(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
        import torch

        return torch.isnan(g[key]) | torch.isposinf(g[key])

    return cells


def _nonfinite(key: str) -> Callable[[Grids, Check, bool], "Tensor"]:
    def cells(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
        import torch

        return ~torch.isfinite(g[key])

    return cells


def _over_limit(x: "Tensor", limit: float) -> "Tensor":
    return ~(x <= limit)  # NaN is over every limit, as it fails every bound


def _forbidden_weight(key: str) -> Callable[[Grids, Check, bool], "Tensor"]:
    def cells(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
        w = g[key]  # [B, Nh, Tq, Tk]
        return ~_allow(g, w) & _over_limit(w.abs(), float(c.limit or 0.0))

    return cells


def _row_sums(key: str) -> Callable[[Grids, Check, bool], "Tensor"]:
    def rows(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
        w = g[key]  # [B, Nh, Tq, Tk]
        live = _allow(g, w).any(dim=-1)  # [B, Nh, Tq]
        return live & _over_limit((w.sum(dim=-1) - 1).abs(), float(c.limit or 0.0))

    return rows


def _empty_rows(g: Grids, c: Check, empty_zero: bool) -> "Tensor":
    w = g["weights"]  # [B, Nh, Tq, Tk]
    dead = ~_allow(g, w).any(dim=-1)  # [B, Nh, Tq]
    return dead & _over_limit(w.abs().amax(dim=-1), float(c.limit or 0.0))


# (stage, check) -> (the grid it reads, what it marks: "cells" or "rows", the cells it points at)
POINTERS: dict[tuple[str, str], tuple[str, str, Callable[[Grids, Check, bool], "Tensor"]]] = {
    ("scores", "finite"): ("scores", "cells", _nonfinite("scores")),
    ("masked_scores", "finite"): ("masked_scores", "cells", _nan_or_posinf("masked_scores")),
    ("masked_scores", "no_fully_blocked_query"): ("masked_scores", "rows", _blocked_rows),
    ("masked_scores", "forbidden_excluded"): ("masked_scores", "cells", _forbidden_kept),
    ("masked_scores", "allowed_kept"): ("masked_scores", "cells", _allowed_dropped),
    ("weights", "finite"): ("weights", "cells", _nonfinite("weights")),
    ("weights", "key_row_sums"): ("weights", "rows", _row_sums("weights")),
    ("weights", "forbidden_weight"): ("weights", "cells", _forbidden_weight("weights")),
    ("weights", "empty_rows_zero"): ("weights", "rows", _empty_rows),
    ("weights", "user_weights_finite"): ("user_weights", "cells", _nonfinite("user_weights")),
    ("weights", "user_weights_key_row_sums"): ("user_weights", "rows", _row_sums("user_weights")),
    ("weights", "user_weights_forbidden_weight"): ("user_weights", "cells", _forbidden_weight("user_weights")),
}


def _grid_ok(g: Grids, key: str) -> bool:
    """The grid was kept whole (every query row), with the intended relation where it needs one."""
    t = g.get(key)
    if t is None or t.dim() != 4:
        return False
    allow = g.get("allow")
    return allow is None or tuple(allow.shape) == tuple(t.shape)


def first_cell(mark: "Tensor") -> dict[str, int] | None:
    """The first marked position in (example, head, query, key) order, as a location."""
    import torch

    hits = torch.nonzero(mark)
    if hits.shape[0] == 0:
        return None
    names = ("example", "head", "query", "key")
    return {names[i]: int(v) for i, v in enumerate(hits[0].tolist())}


def locate(report: Report, empty_zero: bool = False) -> Report:
    """The report with each failing grid check located, and ``tensors["marks"]`` set.

    Checks whose grid was not kept (large runs without ``--keep-grids``), or that no cell
    can explain (a comparison with the reference), are left as they are.
    """
    g = report.tensors
    marks: dict[str, Tensor] = {}
    rows: list[Row] = []
    for row in report.rows:
        found: list[Check] = []
        for c in row.checks:
            pointer = POINTERS.get((row.name, c.name))
            if c.status in MARKED and pointer is not None and _grid_ok(g, pointer[0]):
                mark = pointer[2](g, c, empty_zero)
                where = first_cell(mark)
                if where is not None:
                    marks[f"{row.name}.{c.name}"] = mark
                    c = replace(c, location=where)
            found.append(c)
        unchanged = all(a is b for a, b in zip(found, row.checks))
        rows.append(row if unchanged else replace(row, checks=tuple(found)))
    if not marks:
        return report
    tensors = {**g, "marks": marks}
    return replace(report, rows=tuple(rows), first_finding=first_finding_of(rows), tensors=tensors)

