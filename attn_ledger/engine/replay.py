"""Replay: run the computation a second time and check the two runs bitwise (``replay_bitwise``, L4).

The built-in pipeline's whole forward (projections to the output), the forward on given
tensors (to the context), and the backward (Q-bar, K-bar, V-bar; :mod:`attn_ledger.engine.backward_rows`)
are each compared element by element, byte by byte; the first element that differs is located.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attn_ledger.engine.measure import unravel
from attn_ledger.report import Check

if TYPE_CHECKING:
    from torch import Tensor

    from attn_ledger.inputs.config import RunConfig
    from attn_ledger.engine.builtin import Inputs
    from attn_ledger.engine.grid import Grid
    from attn_ledger.maths.relations import Relation


def replay_check(pairs: list[tuple[str, "Tensor", "Tensor | None"]], axes: tuple[str, ...]) -> Check:
    """L4: two runs bitwise equal; the first element that differs when not."""
    import torch

    differ, first = 0, None
    for name, a, b in pairs:
        if b is None or a.shape != b.shape:
            return Check(4, "replay_bitwise", "fail", reason=f"the second run of {name} did not produce its tensor",
                         data={"tensor": name})
        size = a.element_size()
        bad = a.contiguous().view(-1).view(torch.uint8).reshape(a.numel(), size) != \
            b.contiguous().view(-1).view(torch.uint8).reshape(b.numel(), size)  # [N, bytes]: bitwise
        per = bad.any(dim=-1)  # [N]
        n = int(per.sum())
        if n and first is None:
            at = int(torch.argmax(per.to(torch.uint8)))
            idx = unravel(at, tuple(a.shape))
            first = {"tensor": name, "index": list(idx), "first_run": float(a.reshape(-1)[at]),
                     "second_run": float(b.reshape(-1)[at])}
            location = {"tensor": name, **dict(zip(axes[-len(idx):], idx))}
        differ += n
    if first is None:
        return Check(4, "replay_bitwise", "pass", "elements that differ between two runs", 0, 0, "<=",
                     data={"elements": sum(a.numel() for _, a, _ in pairs)})
    return Check(4, "replay_bitwise", "fail", "elements that differ between two runs", differ, 0, "<=",
                 location=location, data={"elements": sum(a.numel() for _, a, _ in pairs), "first": first})


def replay_config(ops: Any, cfg: "RunConfig", inp: "Inputs", spec: Any, relation: "Relation", plan: Any,
                  scale: float, first: "Tensor") -> Check:
    """The whole forward again, from the projections to the output, compared bitwise with the first run."""
    from attn_ledger.engine.execute import replay_context
    from attn_ledger.maths.pipeline import project

    nh, nkv = cfg.num_heads, cfg.nkv
    w = inp.weights
    q, k, v = ops.split(project(inp.x, w.wq), nh), ops.split(project(inp.x_kv, w.wk), nkv), ops.split(project(inp.x_kv, w.wv), nkv)
    if spec is not None:
        q, k, v = ops.rope(q, k, v, spec, cfg.tk - cfg.tq)
    ctx = replay_context(plan, relation, ops, q, ops.expand(k, nh), ops.expand(v, nh), scale, cfg.empty_rows == "zeros")
    second = project(ops.merge(ctx), w.wo)  # [B, Tq, E]
    return replay_check([("output", first, second)], ("example", "query", "feature"))


def replay_tensors(grid: "Grid", relation: "Relation", q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", scale: float,
                   empty_zero: bool, ops: Any = None) -> Check:
    """The forward on given tensors again (through ``ops``, the healthy stages by default), to the context,
    compared bitwise with the first run."""
    from attn_ledger.engine.execute import replay_context
    from attn_ledger.maths.pipeline import HEALTHY

    second = replay_context(grid.plan, relation, ops or HEALTHY, q, k_exp, v_exp, scale, empty_zero)
    return replay_check([("context", grid.context, second)], ("example", "head", "query", "feature"))
