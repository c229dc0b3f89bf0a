"""Float64 attention on an observed call's q, k and v, in query blocks, with the rounding bound of each element.

Written apart from any model's code: the relation, scale, soft-cap, additive bias and sinks are the
ones the config implies (or a variant the diagnosis tries), never the call's own. For the rows
asked (every query, or a sample of a large layer), :func:`attend64` gives the context and, per
element, the magnitude ``M`` of its summands, so that an implementation in dtype ``d`` may err by
``c * eps(d) * M`` (:func:`attn_ledger.tolerance.rounding`, quantity ``out``). ``M`` follows the
ledger's rule (:mod:`attn_ledger.engine.rounding`): each score's own rounding,
``|q| |k| |scale| (1 + sqrt(Dh)) + |s| + |bias|``, carried through the row's normaliser into the
weights and summed over the values, ``(P + E) |V| (1 + sqrt(Tk))``.

Axes: B, Nh query heads, Nkv kv heads (kv head j serves query heads j*g to (j+1)*g - 1, as
transformers' ``repeat_kv`` lays them out), R the rows computed, Tk keys, Dh, Dv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

BLOCK_BYTES = 1 << 25
"""Float64 working memory of one query block (about six grids of ``[B, Nh, rows, Tk]``)."""


@dataclass(frozen=True)
class Attended:
    """Float64 results on the rows asked.

    Attributes:
        context: ``[B, Nh, R, Dv]``.
        magnitude: ``[B, Nh, R, Dv]``: ``M`` of each context element (in units of the dtype's eps).
        key_share: ``[B, Nh, R]``: the keys' share of each row's softmax (1 without sinks, 0 for a row
            with no allowed key).
        live: ``[B, 1 or Nh, R]``: rows with at least one allowed key.
    """

    context: "Tensor"
    magnitude: "Tensor"
    key_share: "Tensor"
    live: "Tensor"


def expand_kv(x: "Tensor", n_heads: int, tiled: bool = False) -> "Tensor":
    """``[B, Nkv, T, D] -> [B, Nh, T, D]``: each kv head repeated for its group (``tiled``: the whole set repeated)."""
    group = n_heads // x.shape[1]
    if group == 1:
        return x
    return x.repeat(1, group, 1, 1) if tiled else x.repeat_interleave(group, dim=1)


def block_rows(b: int, nh: int, tk: int) -> int:
    """Query rows per block so that one block's float64 grids stay near :data:`BLOCK_BYTES`."""
    return max(1, BLOCK_BYTES // (6 * 8 * max(1, b * nh * tk)))


# long: one chain of grids per block (scores, cap, bias, mask, softmax with sinks, mix, and the bound beside each)
def attend64(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor", scale: float, *, rows: "Tensor | None" = None,
             softcap: float | None = None, bias: "Tensor | None" = None, sinks: "Tensor | None" = None,
             tiled: bool = False, accumulate: float = 1.0, tiny: float = 0.0) -> Attended:
    """Float64 attention and its rounding magnitude on ``rows`` of the queries (all of them when None).

    Args:
        q: ``[B, Nh, Tq, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]`` (any dtype; cast).
        allow: bool broadcastable to ``[B, Nh, Tq, Tk]``, True = may attend.
        bias: added to the (capped) scores before the mask, broadcastable to ``[B, Nh, Tq, Tk]``.
        sinks: ``[Nh]`` one logit per head, in the softmax's denominator only.
        tiled: kv heads repeated as a whole set (a bug's variant), not per group.
        accumulate, tiny: as :func:`attn_ledger.engine.rounding.stage_magnitudes` takes them.
    """
    import torch

    f64 = torch.float64
    b, nh, tq, dh = q.shape
    tk = k.shape[-2]
    idx = torch.arange(tq) if rows is None else rows
    kk = expand_kv(k.detach().to(f64), nh, tiled)  # [B, Nh, Tk, Dh]
    vv = expand_kv(v.detach().to(f64), nh, tiled)  # [B, Nh, Tk, Dv]
    ka, va = kk.abs().transpose(-2, -1), vv.abs()  # [B, Nh, Dh, Tk], [B, Nh, Tk, Dv]
    sink = None if sinks is None else sinks.detach().to(f64).reshape(1, nh, 1, 1)
    dot = 1.0 + accumulate * math.sqrt(dh)
    over_keys = 1.0 + accumulate * math.sqrt(max(tk, 1))
    outs, mags, shares, lives = [], [], [], []
    step = block_rows(b, nh, tk)
    neg = torch.tensor(float("-inf"), dtype=f64)
    for r0 in range(0, len(idx), step):
        sel = idx[r0:r0 + step]
        qb = q.detach()[:, :, sel].to(f64)  # [B, Nh, r, Dh]
        s = torch.matmul(qb * scale, kk.transpose(-2, -1))  # [B, Nh, r, Tk]
        a = torch.matmul(qb.abs_().mul_(abs(scale)), ka).mul_(dot)  # [B, Nh, r, Tk]: |q| |k| |scale| (1 + sqrt(Dh))
        if softcap is not None:
            s = torch.tanh(s.div_(softcap)).mul_(softcap)
        if bias is not None:
            bb = _rows(bias, sel).to(f64)  # [1|B, 1|Nh, r, Tk]
            s.add_(bb)
            a.add_(bb.abs())
        ok = _rows(allow, sel).expand(b, nh, len(sel), tk)  # [B, Nh, r, Tk]
        live = ok.any(dim=-1, keepdim=True)  # [B, Nh, r, 1]
        blocked = ~ok
        err_s = a.add_(s.abs()).masked_fill_(blocked, 0.0)  # each allowed score's bound (eps units)
        logits = s.masked_fill_(blocked, neg).masked_fill_(~live, 0.0)
        if sink is not None:
            col = sink.expand(b, nh, len(sel), 1)
            p = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(logits, dim=-1)
        p.masked_fill_(~live, 0.0)  # [B, Nh, r, Tk]
        row = (p * err_s).sum(dim=-1, keepdim=True) + err_s.amax(dim=-1, keepdim=True) + over_keys
        if sink is not None:
            row = row + sink.abs()
        e = err_s.add_(row).mul_(p)  # the weights' bound (eps units); zero where p is
        if tiny:
            e.add_(torch.where(ok & live, tiny, 0.0))
        outs.append(torch.matmul(p, vv))  # [B, Nh, r, Dv]
        mags.append(torch.matmul(e.add_(p), va).mul_(over_keys) + tiny * live)
        shares.append(p.sum(dim=-1))
        lives.append(live[..., 0])
        del s, a, p, e, err_s, logits, ok, blocked
    return Attended(torch.cat(outs, dim=2), torch.cat(mags, dim=2), torch.cat(shares, dim=2), torch.cat(lives, dim=2))


def _rows(t: "Tensor", sel: "Tensor") -> "Tensor":
    """Rows ``sel`` of a grid broadcastable over queries (a grid with one query row is kept as is)."""
    return t if t.shape[-2] == 1 else t[..., sel, :]
