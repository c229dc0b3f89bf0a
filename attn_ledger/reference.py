"""The trusted reference: a plain float64 attention, written apart from the pipeline.

The float64 path is written the plain way, from the raw inputs, with none of the
ledger's own stage functions, so a fault injected into the pipeline cannot leak into
the reference it is compared with.

Axis names: B batch, Nh query heads, Nkv key/value heads (Nkv divides Nh; query
head h uses kv head h // (Nh // Nkv)), Tq query positions, Tk key positions,
Dh query/key width, Dv value width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def repeat_kv(x: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """``[B, Nkv, Tk, D] -> [B, Nh, Tk, D]``: each kv head serves Nh // Nkv consecutive query heads."""
    nkv = x.shape[1]
    if nkv == n_heads:
        return x
    return x.repeat_interleave(n_heads // nkv, dim=1)


def combined_allow(
    b: int, nh: int, tq: int, tk: int, allow_mask: "torch.Tensor | None", is_causal: bool, device=None
) -> "torch.Tensor | None":
    """The relation a kernel-protocol call asks for, in allow polarity, broadcastable to ``[B, Nh, Tq, Tk]``."""
    from attn_ledger import masks

    allow = None
    if is_causal:
        allow = masks.causal(tq, tk, "bottom-right", device=device)[None, None]  # [1, 1, Tq, Tk]
    if allow_mask is not None:
        allow = allow_mask if allow is None else (allow & allow_mask)
    return allow


def reference_stages(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    *,
    allow_mask: "torch.Tensor | None" = None,
    is_causal: bool = False,
    scale: float | None = None,
    empty_rows: str = "zeros",
    dtype: "torch.dtype | None" = None,
) -> dict[str, "torch.Tensor"]:
    """Plain attention in float64 (or ``dtype``), returning every intermediate.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]``.
        allow_mask: bool, broadcastable to ``[B, Nh, Tq, Tk]``, True = may attend.
        is_causal: bottom-right aligned causal relation, combined with ``allow_mask`` by AND.
        scale: None means ``1/sqrt(Dh)``.
        empty_rows: what a query with every key blocked returns: ``"zeros"`` or ``"nan"``.

    Returns:
        dict with ``scores`` (scaled, unmasked), ``masked_scores``, ``weights``, ``out``,
        each ``[B, Nh, Tq, *]``, and ``allow`` (or None).
    """
    import torch

    dtype = dtype or torch.float64
    b, nh, tq, dh = q.shape
    tk = k.shape[-2]
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    q64 = q.to(dtype)
    k64 = repeat_kv(k.to(dtype), nh)  # [B, Nh, Tk, Dh]
    v64 = repeat_kv(v.to(dtype), nh)  # [B, Nh, Tk, Dv]
    scores = torch.matmul(q64, k64.transpose(-2, -1)).mul_(scale)  # [B, Nh, Tq, Tk]
    allow = combined_allow(b, nh, tq, tk, allow_mask, is_causal, device=q.device)
    if allow is None:
        masked = scores
        weights = torch.softmax(masked, dim=-1)
    else:
        masked = torch.where(allow, scores, float("-inf"))  # forbidden pairs -> -inf
        weights = torch.softmax(masked, dim=-1)
        if empty_rows == "zeros":
            dead = ~allow.any(dim=-1, keepdim=True)  # [.., Tq, 1]
            if bool(dead.any()):
                weights = weights.masked_fill(dead, 0.0)
    out = torch.matmul(weights, v64)  # [B, Nh, Tq, Dv]
    return {"scores": scores, "masked_scores": masked, "weights": weights, "out": out, "allow": allow}


def reference_attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None, empty_rows="zeros", dtype=None):
    """The kernel protocol's reference output ``[B, Nh, Tq, Dv]`` in float64 (see :func:`reference_stages`)."""
    return reference_stages(
        q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale, empty_rows=empty_rows, dtype=dtype
    )["out"]


def heads_of(x: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """Reference head split ``[B, T, n*D] -> [B, n, T, D]``, written apart from the pipeline's."""
    b, t, e = x.shape
    return x.view(b, t, n_heads, e // n_heads).permute(0, 2, 1, 3)


def join_heads(x: "torch.Tensor") -> "torch.Tensor":
    """Reference head merge ``[B, n, T, D] -> [B, T, n*D]``, written apart from the pipeline's."""
    b, n, t, d = x.shape
    return x.permute(0, 2, 1, 3).contiguous().view(b, t, n * d)
