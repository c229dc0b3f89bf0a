"""The built-in multi-head attention, written as small named stage functions.

Each stage is a pure function of its inputs. A :class:`Ops` bundle holds the functions
the pipeline uses; :func:`ops_for` returns the healthy bundle or one with a single
deliberate fault swapped in. Nothing downstream ever looks at which fault it was.

The backward stages are written by hand too (``grad_weights``, ``grad_values``,
``softmax_backward``, ``grad_q``, ``grad_k``), so a fault can be injected into them the same
way; :func:`attend` and :func:`attend_backward` chain the score-grid stages on whole tensors
(probes, gradcheck), as the engine chains them block by block.

Axes: B batch, Tq/Tk query/key positions, E model width, Nh query heads, Nkv kv heads,
Dh query/key head width, Dv value head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.seeding import generator

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.maths.rotary import RotarySpec


# --- healthy stage functions -------------------------------------------------------

def split_heads(x: "Tensor", n_heads: int) -> "Tensor":
    """``[B, T, Nh*D] -> [B, Nh, T, D]``: partition the feature axis, then move heads outward."""
    b, t, e = x.shape
    return x.reshape(b, t, n_heads, e // n_heads).transpose(1, 2)  # [B, Nh, T, D]


def merge_heads(x: "Tensor") -> "Tensor":
    """``[B, Nh, T, D] -> [B, T, Nh*D]``: move heads back inside, then join the last two axes."""
    b, nh, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, nh * d)  # [B, T, Nh*D]


def expand_kv(x: "Tensor", n_heads: int) -> "Tensor":
    """``[B, Nkv, Tk, D] -> [B, Nh, Tk, D]``: query head h uses kv head h // (Nh // Nkv)."""
    nkv = x.shape[1]
    return x if nkv == n_heads else x.repeat_interleave(n_heads // nkv, dim=1)


def matmul(a: "Tensor", b: "Tensor") -> "Tensor":
    """``a @ b``. float16 on the CPU is multiplied in float32 and rounded back to float16.

    That is the arithmetic of torch's own float16 CPU product too (float32 accumulation, so
    the same accuracy; only the summation order differs, by an ulp in a few entries), which
    on CPUs without float16 matrix units runs about a hundred times slower.
    """
    import torch

    if a.dtype == torch.float16 and a.device.type == "cpu":
        return (a.float() @ b.float()).to(torch.float16)
    return a @ b


def qk_scores(q: "Tensor", k: "Tensor", scale: float) -> "Tensor":
    """``[B, Nh, Tq, Dh] @ [B, Nh, Dh, Tk] -> [B, Nh, Tq, Tk]``, scaled.

    The scale is applied to q before the product, which is the same scores without a
    second pass over the whole grid.
    """
    return matmul(q * scale, k.transpose(-2, -1))  # [B, Nh, Tq, Tk]


def soft_cap(scores: "Tensor", cap: float) -> "Tensor":
    """``cap * tanh(s / cap)`` on the scaled scores, before the mask (Gemma 2's logit soft-capping)."""
    import torch

    return torch.tanh(scores / cap) * cap  # [B, Nh, Tq, Tk], within (-cap, cap)


def apply_mask(scores: "Tensor", allow: "Tensor | None") -> "Tensor":
    """Forbidden (query, key) pairs become -inf before normalisation."""
    import torch

    if allow is None:
        return scores
    return torch.where(allow, scores, float("-inf"))  # [B, Nh, Tq, Tk]


def softmax_keys(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    """Normalise each query row over the key axis; rows with no allowed key become zeros if declared."""
    import torch

    weights = torch.softmax(masked, dim=-1)  # [B, Nh, Tq, Tk]
    if empty_rows_zero and allow is not None:
        dead = ~allow.any(dim=-1, keepdim=True)  # [.., Tq, 1]: queries with no allowed key
        if bool(dead.any()):
            weights = weights.masked_fill(dead, 0.0)
    return weights


def sink_softmax(softmax: Callable, masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool,
                 sinks: "Tensor") -> "Tensor":
    """Softmax over the keys plus one sink per head (gpt-oss's ``s_aux``), the sink's column dropped before the mix.

    ``sinks`` ``[Nh]``: one logit per head, in the denominator only. The weights over the real keys
    sum to one minus the sink's share; a query with no allowed key gives the sink everything and its
    keys zeros. ``softmax`` (the plain stage) is not used: the sink's column changes the normaliser.
    """
    import torch

    b, nh, r, _ = masked.shape
    col = sinks.to(masked.dtype).reshape(1, nh, 1, 1).expand(b, nh, r, 1)  # [B, Nh, rows, 1]
    return torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)[..., :-1]  # [B, Nh, rows, Tk]


def sink_share(masked: "Tensor", sinks: "Tensor") -> "Tensor":
    """The sink's share of each query row, ``exp(s) / (exp(s) + sum_j exp(m_j))``, ``[B, Nh, rows]``, in float32 or wider."""
    import torch

    wide = torch.float32 if masked.dtype in (torch.float16, torch.bfloat16) else masked.dtype
    m = masked.to(wide)
    s = sinks.to(wide).reshape(1, -1, 1).expand(m.shape[0], m.shape[1], m.shape[2])  # [B, Nh, rows]
    return torch.sigmoid(s - torch.logsumexp(m, dim=-1))  # logsumexp of an all -inf row is -inf: share 1


def mix_values(weights: "Tensor", v: "Tensor") -> "Tensor":
    """``[B, Nh, Tq, Tk] @ [B, Nh, Tk, Dv] -> [B, Nh, Tq, Dv]``; the key axis is contracted."""
    return matmul(weights, v)


def rotate(q: "Tensor", k: "Tensor", v: "Tensor", spec: "RotarySpec", q_start: int) -> tuple["Tensor", "Tensor", "Tensor"]:
    """Rotary positions on q and k, never v: query i sits at position ``q_start + i``, key j at j.

    ``q_start`` is Tk - Tq, so the last query and the last key share a position (decode,
    cross-attention over a longer context).
    """
    from attn_ledger.maths.rotary import apply_rotary

    return apply_rotary(q, spec, offset=q_start), apply_rotary(k, spec), v


def unrotate(g: "Tensor", spec: "RotarySpec", positions: "Tensor") -> "Tensor":
    """The gradient through a rotation: each vector turned back (a rotation's transpose is its inverse).

    ``g`` is ``[..., T, D]``; ``positions`` ``[T]`` (integers) the position each row was rotated at.
    """
    from attn_ledger.maths.rotary import apply_rotary

    return apply_rotary(g, spec, positions=-positions.to(g.device))  # the same angles, turned back


def grad_weights(grad_context: "Tensor", v: "Tensor") -> "Tensor":
    """``A-bar = O-bar V^T``: ``[B, Nh, Tq, Dv] @ [B, Nh, Dv, Tk] -> [B, Nh, Tq, Tk]``."""
    return matmul(grad_context, v.transpose(-2, -1))  # [B, Nh, Tq, Tk]


def grad_values(weights: "Tensor", grad_context: "Tensor") -> "Tensor":
    """``V-bar = A^T O-bar``: ``[B, Nh, Tk, Tq] @ [B, Nh, Tq, Dv] -> [B, Nh, Tk, Dv]``."""
    return matmul(weights.transpose(-2, -1), grad_context)  # [B, Nh, Tk, Dv]


def softmax_backward(weights: "Tensor", grad_w: "Tensor") -> "Tensor":
    """Per query row: ``S-bar = A * (A-bar - sum_j A_j A-bar_j)`` (forbidden keys and empty rows get 0 from A = 0)."""
    import torch

    wide = torch.float32 if weights.dtype in (torch.float16, torch.bfloat16) else weights.dtype
    w, gw = weights.to(wide), grad_w.to(wide)
    dot = (w.unsqueeze(-2) @ gw.unsqueeze(-1)).squeeze(-1)  # [B, Nh, Tq, 1]: sum_j A_j A-bar_j in one pass
    return torch.sub(gw, dot).mul_(w).to(weights.dtype)  # [B, Nh, Tq, Tk]


def grad_q(grad_s: "Tensor", k: "Tensor", scale: float) -> "Tensor":
    """``Q-bar = scale * S-bar K``: ``[B, Nh, Tq, Tk] @ [B, Nh, Tk, Dh] -> [B, Nh, Tq, Dh]``."""
    return matmul(grad_s, k) * scale  # [B, Nh, Tq, Dh]


def grad_k(grad_s: "Tensor", q: "Tensor", scale: float) -> "Tensor":
    """``K-bar = scale * S-bar^T Q``: ``[B, Nh, Tk, Tq] @ [B, Nh, Tq, Dh] -> [B, Nh, Tk, Dh]``."""
    return matmul(grad_s.transpose(-2, -1), q) * scale  # [B, Nh, Tk, Dh]


def grad_sinks(share: "Tensor", weights: "Tensor", grad_w: "Tensor") -> "Tensor":
    """The sinks' gradient, ``[Nh]``: per head, ``-sum over examples and rows of share * sum_j A_j A-bar_j``.

    The sink is one more column of each row's softmax whose value is zero, so its A-bar is zero and
    the softmax backward gives it ``share * (0 - sum_j A_j A-bar_j)``; ``share`` ``[B, Nh, rows]`` is its
    weight (:func:`sink_share`), ``weights`` and ``grad_w`` ``[B, Nh, rows, Tk]`` the keys' A and A-bar.
    """
    import torch

    wide = torch.float32 if weights.dtype in (torch.float16, torch.bfloat16) else weights.dtype
    dot = (weights.to(wide) * grad_w.to(wide)).sum(dim=-1)  # [B, Nh, rows]: sum_j A_j A-bar_j
    return -(share.to(wide) * dot).sum(dim=(0, 2))  # [Nh]


def reduce_kv(g: "Tensor", n_kv: int) -> "Tensor":
    """The gradient through :func:`expand_kv`: ``[B, Nh, Tk, D] -> [B, Nkv, Tk, D]``, each group summed."""
    b, nh, tk, d = g.shape
    return g if nh == n_kv else g.reshape(b, n_kv, nh // n_kv, tk, d).sum(dim=2)  # [B, Nkv, Tk, D]


def invert_none(allow: "Tensor | None") -> "Tensor | None":
    return allow


# --- deliberate faults ------------------------------------------------------------
# Each fault is registered where its function is written: its name, the Ops field it replaces and one line
# on what it does (the fault tables of the docs are generated from these lines, in this order).

_CHANGES: dict[str, dict[str, Any]] = {}
FAULT_SUMMARIES: dict[str, str] = {}


def _register(name: str, summary: str, **changes: Any) -> None:
    """Fault ``name``: the :class:`Ops` fields it changes, and its summary (given once, with its first change)."""
    _CHANGES.setdefault(name, {}).update(changes)
    if summary:
        FAULT_SUMMARIES[name] = summary


def _fault(name: str, field: str, summary: str = "") -> Callable[[Callable], Callable]:
    """Register the decorated function as what fault ``name`` puts in the :class:`Ops` field ``field``."""
    def register(fn: Callable) -> Callable:
        _register(name, summary, **{field: fn})
        return fn
    return register


@_fault("split-reshape", "split", "heads split by reshape alone, without moving the head axis")
def _split_by_reshape(x: "Tensor", n_heads: int) -> "Tensor":
    b, t, e = x.shape
    return x.reshape(b, n_heads, t, e // n_heads)  # right shape, positions cut across heads


@_fault("merge-reshape", "merge", "heads merged by reshape alone, without moving the head axis back")
def _merge_by_reshape(x: "Tensor") -> "Tensor":
    b, nh, t, d = x.shape
    return x.reshape(b, t, nh * d)  # head axis never moved back inside


@_fault("k-transpose", "scores", "scores from k.transpose(1, 2) instead of a transpose of the last two axes")
def _scores_wrong_transpose(q: "Tensor", k: "Tensor", scale: float) -> "Tensor":
    return (q * scale) @ k.transpose(1, 2)  # swaps heads with key positions


@_fault("softmax-axis", "softmax", "softmax over queries instead of keys")
def _softmax_over_queries(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    import torch

    return torch.softmax(masked, dim=-2)


_register("no-scale", "no 1/sqrt(Dh) on the scores", unscaled=True)


@_fault("mask-polarity", "polarity", "the allow relation applied inverted, as if True meant blocked")
def _invert(allow: "Tensor | None") -> "Tensor | None":
    import torch

    if allow is None:
        return None
    return torch.logical_not(allow)


@_fault("mask-after-softmax", "mask", "softmax over every key, then the forbidden weights set to zero")
def _mask_after_softmax(scores: "Tensor", allow: "Tensor | None") -> "Tensor":
    return scores  # the mask is applied later, to the weights


@_fault("mask-after-softmax", "softmax")
def _softmax_then_zero(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    import torch

    weights = torch.softmax(masked, dim=-1)
    return weights if allow is None else weights.masked_fill(~allow, 0.0)


# --- deliberate faults in the backward stages ----------------------------------------

@_fault("softmax-backward-no-rowsum", "softmax_backward",
        "softmax backward without the row-sum term: S-bar = A * A-bar")
def _softmax_backward_no_rowsum(weights: "Tensor", grad_w: "Tensor") -> "Tensor":
    return weights * grad_w  # the row-sum term dropped: S-bar = A * A-bar


@_fault("grad-k-no-scale", "grad_k", "K-bar without the score scale")
def _grad_k_unscaled(grad_s: "Tensor", q: "Tensor", scale: float) -> "Tensor":
    return matmul(grad_s.transpose(-2, -1), q)  # the scale forgotten on the key side only


@_fault("grad-values-untransposed", "grad_values", "V-bar = A O-bar instead of A^T O-bar")
def _grad_values_untransposed(weights: "Tensor", grad_context: "Tensor") -> "Tensor":
    return matmul(weights, grad_context)  # A O-bar instead of A^T O-bar: [Tq, Tk] @ [Tq, Dv] needs Tk == Tq


# --- deliberate faults in rotary positions ------------------------------------------

@_fault("rope-on-v", "rope", "rotary positions applied to v as well as q and k")
def _rotate_v_too(q: "Tensor", k: "Tensor", v: "Tensor", spec: "RotarySpec", q_start: int):
    from attn_ledger.maths.rotary import apply_rotary

    q, k, v = rotate(q, k, v, spec, q_start)
    return q, k, apply_rotary(v, spec)  # values carry content, not positions


@_fault("rope-query-offset", "rope", "queries rotated one position ahead of the keys")
def _rotate_query_ahead(q: "Tensor", k: "Tensor", v: "Tensor", spec: "RotarySpec", q_start: int):
    from attn_ledger.maths.rotary import apply_rotary

    return apply_rotary(q, spec, offset=q_start + 1), apply_rotary(k, spec), v  # queries one position ahead


@_fault("rope-q-only", "rope", "only q rotated, k left as it was")
def _rotate_q_only(q: "Tensor", k: "Tensor", v: "Tensor", spec: "RotarySpec", q_start: int):
    from attn_ledger.maths.rotary import apply_rotary

    return apply_rotary(q, spec, offset=q_start), k, v  # the key rotation forgotten


# --- deliberate faults that break a boundary property --------------------------------

@_fault("softmax-plus-one", "softmax",
        "softmax with an extra 1 in the denominator, so a lone key gets less than weight 1")
def _softmax_plus_one(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    """``exp(s) / (1 + sum exp(s))``: an extra "none of these" slot, so a lone key gets less than 1."""
    import torch

    top = masked.amax(dim=-1, keepdim=True).clamp(min=0.0)  # [B, Nh, Tq, 1], >= 0 so the 1 stays exact
    e = torch.exp(masked - top)  # [B, Nh, Tq, Tk]
    return e / (torch.exp(-top) + e.sum(dim=-1, keepdim=True))


@_fault("scores-key-bias", "scores", "a leftover bias of 0.1 per key position added to the scores")
def _scores_key_bias(q: "Tensor", k: "Tensor", scale: float) -> "Tensor":
    import torch

    bias = 0.1 * torch.arange(k.shape[-2], dtype=q.dtype, device=q.device)  # [Tk]: a leftover bias on key positions
    return qk_scores(q, k, scale) + bias  # [B, Nh, Tq, Tk]


@_fault("context-rows-shifted", "mix", "each query's context written one row late")
def _mix_rows_shifted(weights: "Tensor", v: "Tensor") -> "Tensor":
    return matmul(weights, v).roll(1, dims=-2)  # each query's context written one row late


@_fault("values-batch-mix", "mix", "values reshaped with B and Nh confused, so examples swap values")
def _mix_batch_heads(weights: "Tensor", v: "Tensor") -> "Tensor":
    mixed = v.transpose(0, 1).reshape(v.shape)  # B and Nh confused in a reshape: examples swap values
    return matmul(weights, mixed)


@_fault("softmax-global-max", "softmax",
        "softmax stabilised by the largest score of the whole tensor, which an empty batch has not")
def _softmax_global_max(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    """Stabilised by the largest score of the whole tensor, not of each row: ``max()`` of an empty batch raises."""
    import torch

    e = torch.exp(masked - masked.max())  # [B, Nh, Tq, Tk]
    weights = e / e.sum(dim=-1, keepdim=True)
    if empty_rows_zero and allow is not None:
        weights = weights.masked_fill(~allow.any(dim=-1, keepdim=True), 0.0)
    return weights


def _sink_ignored(softmax: Callable, masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool,
                  sinks: "Tensor") -> "Tensor":
    return softmax(masked, allow, empty_rows_zero)  # the sinks accepted and never used: rows sum to one


def _sink_in_numerator(softmax: Callable, masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool,
                       sinks: "Tensor") -> "Tensor":
    import torch

    b, nh, r, _ = masked.shape
    col = sinks.to(masked.dtype).reshape(1, nh, 1, 1).expand(b, nh, r, 1)  # [B, Nh, rows, 1]
    return torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)[..., 1:]  # the wrong end dropped: sink mixed as a value


_register("sink-dropped", "the attention sinks accepted and dropped: softmax over the keys alone, rows sum to one",
          sink_softmax=_sink_ignored)
_register("sink-in-numerator", "the sink's column kept for the mix and the first key's dropped: the sink's weight is "
          "mixed as if it were the last key's value", sink_softmax=_sink_in_numerator)


@_fault("grad-sinks-no-share", "grad_sinks", "the sinks' gradient without the sink's own weight: -sum_j A_j A-bar_j "
        "summed over rows, where share * (0 - sum_j A_j A-bar_j) was meant")
def _grad_sinks_no_share(share: "Tensor", weights: "Tensor", grad_w: "Tensor") -> "Tensor":
    import torch

    wide = torch.float32 if weights.dtype in (torch.float16, torch.bfloat16) else weights.dtype
    return -(weights.to(wide) * grad_w.to(wide)).sum(dim=(0, 2, 3))  # [Nh]: the share factor left out


@_fault("window-too-wide", "polarity", "the sliding window one key wider than W: each query also keeps the key W "
        "positions back (every allowed band widened by one key on the left)")
def _window_one_wider(allow: "Tensor | None") -> "Tensor | None":
    if allow is None:
        return None
    wider = allow.clone()
    wider[..., :-1] |= allow[..., 1:]  # key j kept where key j + 1 is: W + 1 keys, the query's own among them
    return wider

_register("softcap-after-mask", "the soft-cap applied after the mask, not to the scores: a forbidden key's -inf "
          "becomes -cap", cap_after_mask=True)


@dataclass(frozen=True)
class Ops:
    """The functions one pipeline run uses, stage by stage (the backward stages included)."""

    split: Callable = split_heads
    merge: Callable = merge_heads
    expand: Callable = expand_kv
    rope: Callable = rotate
    scores: Callable = qk_scores
    polarity: Callable = invert_none
    mask: Callable = apply_mask
    softmax: Callable = softmax_keys
    mix: Callable = mix_values
    grad_weights: Callable = grad_weights
    grad_values: Callable = grad_values
    softmax_backward: Callable = softmax_backward
    grad_q: Callable = grad_q
    grad_k: Callable = grad_k
    grad_sinks: Callable = grad_sinks
    sink_softmax: Callable = sink_softmax
    unscaled: bool = False
    cap_after_mask: bool = False
    sinks: Any = None  # [Nh] the sink logits the softmax stage counts (with_sinks), or None
    keys_softmax: Any = None  # the softmax stage over the keys alone, before with_sinks wrapped it

    def scale_for(self, dh: int, scale: float | None = None) -> float:
        """The score scale this pipeline applies: ``scale`` (default ``1/sqrt(Dh)``), or 1 when it forgets it."""
        if self.unscaled:
            return 1.0
        return 1.0 / math.sqrt(dh) if scale is None else scale


HEALTHY = Ops()

_FAULTY = {name: replace(HEALTHY, **changes) for name, changes in _CHANGES.items()}


def ops_for(fault: str | None) -> Ops:
    """The healthy ops, or the ops with one named fault injected."""
    if fault is None:
        return HEALTHY
    return _FAULTY[str(fault)]


def with_softcap(ops: Ops, cap: float | None) -> Ops:
    """``ops`` whose scores stage ends in :func:`soft_cap` (or, with the fault, whose mask stage does)."""
    if cap is None:
        return ops
    if ops.cap_after_mask:
        mask = ops.mask
        return replace(ops, mask=lambda s, allow: soft_cap(mask(s, allow), cap))  # -inf becomes -cap: a weight
    scores = ops.scores
    return replace(ops, scores=lambda q, k, scale: soft_cap(scores(q, k, scale), cap))


def with_sinks(ops: Ops, sinks: "Tensor | None") -> Ops:
    """``ops`` whose softmax stage counts one sink logit per head (``[Nh]``) in its denominator (:func:`sink_softmax`)."""
    if sinks is None:
        return ops
    plain, with_sink = ops.softmax, ops.sink_softmax
    return replace(ops, softmax=lambda m, allow, empty_zero: with_sink(plain, m, allow, empty_zero, sinks),
                   sinks=sinks, keys_softmax=plain)


def without_sinks(ops: Ops) -> Ops:
    """``ops`` as they were before :func:`with_sinks` (the properties probe, whose heads are a few of them)."""
    return ops if ops.sinks is None else replace(ops, softmax=ops.keys_softmax, sinks=None, keys_softmax=None)


def attend(ops: Ops, q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
           empty_rows_zero: bool) -> dict[str, "Tensor"]:
    """The score-grid stages on whole tensors, as the engine runs one block that computes every key.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k, v: ``[B, Nh, Tk, Dh]``, ``[B, Nh, Tk, Dv]`` (kv heads expanded).
        allow: the intended relation, bool ``[B|1, Nh|1, Tq, Tk]``, True = may attend, or None.

    Returns:
        ``scores``, ``masked_scores``, ``weights`` ``[B, Nh, Tq, Tk]`` and ``context`` ``[B, Nh, Tq, Dv]``.
    """
    applied = ops.polarity(allow)
    s = ops.scores(q, k, scale)  # [B, Nh, Tq, Tk]
    m = ops.mask(s, applied)  # [B, Nh, Tq, Tk]
    w = ops.softmax(m, applied, empty_rows_zero)  # [B, Nh, Tq, Tk]
    return {"scores": s, "masked_scores": m, "weights": w, "context": ops.mix(w, v)}  # context [B, Nh, Tq, Dv]


def attend_backward(ops: Ops, grad_context: "Tensor", q: "Tensor", k: "Tensor", v: "Tensor", weights: "Tensor",
                    scale: float) -> dict[str, "Tensor"]:
    """The backward stages on whole tensors, from ``O-bar`` ``[B, Nh, Tq, Dv]`` and the forward's weights.

    Returns:
        ``grad_weights``, ``grad_scores`` ``[B, Nh, Tq, Tk]``, ``grad_values`` ``[B, Nh, Tk, Dv]``,
        ``grad_q`` ``[B, Nh, Tq, Dh]`` and ``grad_k`` ``[B, Nh, Tk, Dh]`` (kv heads still expanded).
    """
    gw = ops.grad_weights(grad_context, v)  # [B, Nh, Tq, Tk]
    gv = ops.grad_values(weights, grad_context)  # [B, Nh, Tk, Dv]
    gs = ops.softmax_backward(weights, gw)  # [B, Nh, Tq, Tk]
    return {"grad_weights": gw, "grad_values": gv, "grad_scores": gs, "grad_q": ops.grad_q(gs, k, scale),
            "grad_k": ops.grad_k(gs, q, scale)}


# --- weights and inputs from a config ---------------------------------------------

@dataclass(frozen=True)
class Weights:
    """Projection weights in ``nn.Linear`` layout ``[out, in]``, no biases."""

    wq: "Tensor"  # [Nh*Dh, E]
    wk: "Tensor"  # [Nkv*Dh, E]
    wv: "Tensor"  # [Nkv*Dv, E]
    wo: "Tensor"  # [E, Nh*Dv]


def make_weights(e: int, nh: int, nkv: int, dh: int, dv: int, seed: int, dtype: "torch.dtype", device=None) -> Weights:
    """Seeded projection weights with ``nn.Linear``'s default scale, made in float64 then cast."""
    import torch

    g = generator(seed + 1)

    def lin(out_f: int, in_f: int) -> "Tensor":
        bound = 1.0 / math.sqrt(in_f)
        w = (torch.rand(out_f, in_f, generator=g, dtype=torch.float64) * 2 - 1) * bound
        return w.to(dtype=dtype, device=device)

    return Weights(lin(nh * dh, e), lin(nkv * dh, e), lin(nkv * dv, e), lin(e, nh * dv))


def make_input(b: int, t: int, e: int, kind: str, seed: int, dtype: "torch.dtype", device=None, offset: int = 0) -> "Tensor":
    """``[B, T, E]`` input: seeded standard normal, or a scaled arange whose values name their coordinates."""
    import torch

    if kind == "arange":
        n = b * t * e
        x = (torch.arange(n, dtype=torch.float64) + offset) / max(n + offset, 1)
        return x.reshape(b, t, e).to(dtype=dtype, device=device)
    g = generator(seed + offset)
    return torch.randn(b, t, e, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def project(x: "Tensor", w: "Tensor") -> "Tensor":
    """``[B, T, in] -> [B, T, out]`` with an ``nn.Linear``-layout weight."""
    return x @ w.transpose(0, 1)
