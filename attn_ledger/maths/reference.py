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
from typing import TYPE_CHECKING, Any

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
    from attn_ledger.maths import masks

    allow = None
    if is_causal:
        allow = masks.causal(tq, tk, "bottom-right", device=device)[None, None]  # [1, 1, Tq, Tk]
    if allow_mask is not None:
        allow = allow_mask if allow is None else (allow & allow_mask)
    return allow


# long by its documented arguments (soft-cap, sinks, bias); the code is under 30 lines
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
    softcap: float | None = None,
    sinks: "torch.Tensor | None" = None,
    bias: "torch.Tensor | None" = None,
) -> dict[str, "torch.Tensor"]:
    """Plain attention in float64 (or ``dtype``), returning every intermediate.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]``.
        allow_mask: bool, broadcastable to ``[B, Nh, Tq, Tk]``, True = may attend.
        is_causal: bottom-right aligned causal relation, combined with ``allow_mask`` by AND.
        scale: None means ``1/sqrt(Dh)``.
        empty_rows: what a query with every key blocked returns: ``"zeros"`` or ``"nan"``.
        softcap: the scaled scores become ``softcap * tanh(s / softcap)`` before the mask
            (Gemma 2's logit soft-capping); None: no cap.
        sinks: ``[Nh]`` one logit per head in the softmax's denominator only (gpt-oss's ``s_aux``): the
            weights over the keys sum to one minus the sink's share; a row with no allowed key is zeros.
        bias: added to the (capped) scores before the mask, broadcastable to ``[B, Nh, Tq, Tk]`` (T5's
            ``position_bias``, ALiBi): part of the scores stage.

    Returns:
        dict with ``scores`` (scaled, capped, biased, unmasked), ``masked_scores``, ``weights``, ``out``,
        each ``[B, Nh, Tq, *]``, and ``allow`` (or None); with sinks also ``sink_share`` ``[B, Nh, Tq]``.
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
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # [B, Nh, Tq, Tk], within (-softcap, softcap)
    if bias is not None:
        scores = scores + bias.to(dtype)  # [B, Nh, Tq, Tk]
    allow = combined_allow(b, nh, tq, tk, allow_mask, is_causal, device=q.device)
    if sinks is not None:
        return _with_sinks(scores, allow, sinks.to(dtype), v64)
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


def _with_sinks(scores: "torch.Tensor", allow: "torch.Tensor | None", sinks: "torch.Tensor",
                v64: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """The stages from the scores on with one sink logit per head as an extra key column, dropped before the mix."""
    import torch

    b, nh, tq, _ = scores.shape
    masked = scores if allow is None else torch.where(allow, scores, float("-inf"))  # [B, Nh, Tq, Tk]
    col = sinks.reshape(1, nh, 1, 1).expand(b, nh, tq, 1)  # [B, Nh, Tq, 1]: the sink, never masked
    both = torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)  # [B, Nh, Tq, Tk + 1]
    weights = both[..., :-1]  # [B, Nh, Tq, Tk]
    return {"scores": scores, "masked_scores": masked, "weights": weights, "out": torch.matmul(weights, v64),
            "allow": allow, "sink_share": both[..., -1]}


def reference_attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None, empty_rows="zeros", dtype=None,
                        softcap=None, sinks=None):
    """The kernel protocol's reference output ``[B, Nh, Tq, Dv]`` in float64 (see :func:`reference_stages`)."""
    return reference_stages(
        q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale, empty_rows=empty_rows, dtype=dtype,
        softcap=softcap, sinks=sinks,
    )["out"]


def heads_of(x: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """Reference head split ``[B, T, n*D] -> [B, n, T, D]``, written apart from the pipeline's."""
    b, t, e = x.shape
    return x.view(b, t, n_heads, e // n_heads).permute(0, 2, 1, 3)


def join_heads(x: "torch.Tensor") -> "torch.Tensor":
    """Reference head merge ``[B, n, T, D] -> [B, T, n*D]``, written apart from the pipeline's."""
    b, n, t, d = x.shape
    return x.permute(0, 2, 1, 3).contiguous().view(b, t, n * d)


# --- gradients: float64 autograd of the plain attention ------------------------------------

def _rotated(x: "torch.Tensor", rope: "tuple | None", positions: "torch.Tensor") -> "torch.Tensor":
    """``x`` rotated at ``positions`` by ``rope = (spec, ...)`` (differentiable), or ``x`` itself."""
    if rope is None:
        return x
    from attn_ledger.maths.rotary import apply_rotary

    return apply_rotary(x, rope[0], positions=positions)


def _rotated_stages(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", q_positions: "torch.Tensor",
                    rope: "tuple | None", **attend: Any) -> dict[str, "torch.Tensor"]:
    """:func:`reference_stages` with q rotated at ``q_positions`` and key j at j by ``rope`` (differentiable)."""
    import torch

    qr = _rotated(q, rope, q_positions)  # [B, Nh, R, Dh]
    kr = _rotated(k, rope, torch.arange(k.shape[-2], device=k.device))  # [B, Nkv, Tk, Dh]
    return reference_stages(qr, kr, v, **attend)


def reference_gradients(
    q_rows: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    grad_context: "torch.Tensor",
    *,
    q_positions: "torch.Tensor",
    allow_mask: "torch.Tensor | None" = None,
    scale: float,
    empty_rows: str = "zeros",
    rope: "tuple | None" = None,
    dtype: "torch.dtype | None" = None,
    softcap: float | None = None,
    sinks: "torch.Tensor | None" = None,
) -> dict[str, "torch.Tensor"]:
    """Float64 autograd of :func:`reference_stages` for some query rows, with ``O-bar`` on those rows.

    The loss is ``sum(O * O-bar)`` over the given rows only, so the key and value gradients
    are the part those rows contribute (all of it when every row is given).

    Args:
        q_rows: ``[B, Nh, R, Dh]`` the queries of R rows (before any rotation).
        k, v: ``[B, Nkv, Tk, Dh]``, ``[B, Nkv, Tk, Dv]`` (before any rotation).
        grad_context: ``O-bar`` on those rows, ``[B, Nh, R, Dv]``.
        q_positions: ``[R]`` the position of each row (query i sits at ``i + Tk - Tq``).
        allow_mask: bool, broadcastable to ``[B, Nh, R, Tk]``.
        rope: ``(RotarySpec, ...)`` to rotate q and k before the scores, or None.
        sinks: ``[Nh]`` sink logits (see :func:`reference_stages`); their gradient is returned too.

    Returns:
        ``grad_q`` ``[B, Nh, R, Dh]``, ``grad_k`` ``[B, Nkv, Tk, Dh]``, ``grad_values`` ``[B, Nkv, Tk, Dv]``
        (each before rotation), ``grad_weights`` and ``grad_scores`` ``[B, Nh, R, Tk]``, and ``out``;
        with sinks, ``grad_sinks`` ``[Nh]``.
    """
    import torch

    dtype = dtype or torch.float64
    with torch.enable_grad():
        q64, k64, v64 = (t.detach().to(dtype).requires_grad_(True) for t in (q_rows, k, v))
        s64 = None if sinks is None else sinks.detach().to(dtype).requires_grad_(True)
        st = _rotated_stages(q64, k64, v64, q_positions, rope, allow_mask=allow_mask, scale=scale, empty_rows=empty_rows,
                             dtype=dtype, softcap=softcap, sinks=s64)
        loss = (st["out"] * grad_context.to(dtype)).sum()
        wanted = (q64, k64, v64, st["weights"], st["scores"]) + (() if s64 is None else (s64,))
        gq, gk, gv, gw, gs, *gsink = torch.autograd.grad(loss, wanted)
    found = {"grad_q": gq, "grad_k": gk, "grad_values": gv, "grad_weights": gw, "grad_scores": gs,
             "out": st["out"].detach()}
    if gsink:
        found["grad_sinks"] = gsink[0]
    return found


def reference_chain_gradients(
    x: "torch.Tensor",
    x_kv: "torch.Tensor | None",
    weights: tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"],
    n_heads: int,
    n_kv: int,
    rows: "torch.Tensor",
    grad_output: "torch.Tensor",
    *,
    rope: "tuple | None" = None,
    **attend: Any,
) -> dict[str, "torch.Tensor"]:
    """Float64 autograd of the whole multi-head attention (projections, heads, attention, merge, output).

    The loss is ``sum(output * O-bar)`` over the query rows ``rows`` only.

    Args:
        x: ``[B, Tq, E]``; x_kv: ``[B, Tk, E]`` for cross-attention, None for self-attention.
        weights: ``wq [Nh*Dh, E]``, ``wk [Nkv*Dh, E]``, ``wv [Nkv*Dv, E]``, ``wo [E, Nh*Dv]`` (nn.Linear layout).
        rows: ``[R]`` the query rows; grad_output: ``O-bar`` of the output on them, ``[B, R, E]``.
        rope: ``(RotarySpec, q_start)``: q and k rotated, query i at ``i + q_start``.
        attend: ``allow_mask`` (bool, broadcastable to ``[B, Nh, R, Tk]``), ``scale`` (required),
            ``empty_rows`` and ``dtype``, as :func:`reference_gradients` takes them.

    Returns:
        ``grad_context`` ``[B, Nh, R, Dv]``, ``grad_weights``/``grad_scores`` ``[B, Nh, R, Tk]``, ``grad_q``
        ``[B, Nh, R, Dh]``, ``grad_k``/``grad_values`` ``[B, Nkv, Tk, *]``, ``grad_wq``..``grad_wo``,
        ``grad_x`` ``[B, Tq, E]`` and ``grad_x_kv`` ``[B, Tk, E]`` (None for self-attention); with ``sinks``
        in ``attend``, ``grad_sinks`` ``[Nh]``.
    """
    import torch

    dtype = attend.pop("dtype", None) or torch.float64
    with torch.enable_grad():
        if attend.get("sinks") is not None:
            attend["sinks"] = attend["sinks"].detach().to(dtype).requires_grad_(True)
        sinks = attend.get("sinks")
        xs = [t.detach().to(dtype).requires_grad_(True) for t in (x, x if x_kv is None else x_kv)]
        ws = [w.detach().to(dtype).requires_grad_(True) for w in weights]
        x64, xkv64 = xs[0], (xs[0] if x_kv is None else xs[1])
        q = heads_of(x64 @ ws[0].T, n_heads)  # [B, Nh, Tq, Dh]
        k = heads_of(xkv64 @ ws[1].T, n_kv)  # [B, Nkv, Tk, Dh]
        v = heads_of(xkv64 @ ws[2].T, n_kv)  # [B, Nkv, Tk, Dv]
        q_start = 0 if rope is None else rope[1]
        st = _rotated_stages(q[:, :, rows], k, v, rows.to(q.device) + q_start, rope, dtype=dtype, **attend)
        out = join_heads(st["out"]) @ ws[3].T  # [B, R, E]
        loss = (out * grad_output.to(dtype)).sum()
        wanted = (st["out"], st["weights"], st["scores"], q, k, v, *ws, xs[0]) + (() if x_kv is None else (xs[1],))
        found = torch.autograd.grad(loss, wanted + (() if sinks is None else (sinks,)))
    names = ("grad_context", "grad_weights", "grad_scores", "grad_q", "grad_k", "grad_values", "grad_wq", "grad_wk",
             "grad_wv", "grad_wo", "grad_x") + (() if x_kv is None else ("grad_x_kv",))
    got = dict(zip(names, found))
    if sinks is not None:
        got["grad_sinks"] = found[-1]
    got["grad_q"] = got["grad_q"][:, :, rows]  # [B, Nh, R, Dh]: other rows get nothing from this loss
    got.setdefault("grad_x_kv", None)
    return got
