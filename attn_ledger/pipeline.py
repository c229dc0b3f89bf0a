"""The built-in multi-head attention, written as small named stage functions.

Each stage is a pure function of its inputs. A :class:`Ops` bundle holds the functions
the pipeline uses; :func:`ops_for` returns the healthy bundle or one with a single
deliberate fault swapped in. Nothing downstream ever looks at which fault it was.

Axes: B batch, Tq/Tk query/key positions, E model width, Nh query heads, Nkv kv heads,
Dh query/key head width, Dv value head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from attn_ledger.seeding import generator

if TYPE_CHECKING:
    import torch
    from torch import Tensor


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


def mix_values(weights: "Tensor", v: "Tensor") -> "Tensor":
    """``[B, Nh, Tq, Tk] @ [B, Nh, Tk, Dv] -> [B, Nh, Tq, Dv]``; the key axis is contracted."""
    return matmul(weights, v)


def invert_none(allow: "Tensor | None") -> "Tensor | None":
    return allow


# --- deliberate faults ------------------------------------------------------------

def _split_by_reshape(x: "Tensor", n_heads: int) -> "Tensor":
    b, t, e = x.shape
    return x.reshape(b, n_heads, t, e // n_heads)  # right shape, positions cut across heads


def _merge_by_reshape(x: "Tensor") -> "Tensor":
    b, nh, t, d = x.shape
    return x.reshape(b, t, nh * d)  # head axis never moved back inside


def _scores_wrong_transpose(q: "Tensor", k: "Tensor", scale: float) -> "Tensor":
    return (q * scale) @ k.transpose(1, 2)  # swaps heads with key positions


def _softmax_over_queries(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    import torch

    return torch.softmax(masked, dim=-2)


def _mask_after_softmax(scores: "Tensor", allow: "Tensor | None") -> "Tensor":
    return scores  # the mask is applied later, to the weights


def _softmax_then_zero(masked: "Tensor", allow: "Tensor | None", empty_rows_zero: bool) -> "Tensor":
    import torch

    weights = torch.softmax(masked, dim=-1)
    return weights if allow is None else weights.masked_fill(~allow, 0.0)


def _invert(allow: "Tensor | None") -> "Tensor | None":
    import torch

    if allow is None:
        return None
    return torch.logical_not(allow)


@dataclass(frozen=True)
class Ops:
    """The functions one pipeline run uses, stage by stage."""

    split: Callable = split_heads
    merge: Callable = merge_heads
    expand: Callable = expand_kv
    scores: Callable = qk_scores
    polarity: Callable = invert_none
    mask: Callable = apply_mask
    softmax: Callable = softmax_keys
    mix: Callable = mix_values
    unscaled: bool = False

    def scale_for(self, dh: int) -> float:
        return 1.0 if self.unscaled else 1.0 / math.sqrt(dh)


HEALTHY = Ops()

_FAULTY = {
    "split-reshape": replace(HEALTHY, split=_split_by_reshape),
    "merge-reshape": replace(HEALTHY, merge=_merge_by_reshape),
    "k-transpose": replace(HEALTHY, scores=_scores_wrong_transpose),
    "softmax-axis": replace(HEALTHY, softmax=_softmax_over_queries),
    "no-scale": replace(HEALTHY, unscaled=True),
    "mask-polarity": replace(HEALTHY, polarity=_invert),
    "mask-after-softmax": replace(HEALTHY, mask=_mask_after_softmax, softmax=_softmax_then_zero),
}


# What each fault does, in one line (the fault tables of the docs are generated from these).
FAULT_SUMMARIES = {
    "split-reshape": "heads split by reshape alone, without moving the head axis",
    "merge-reshape": "heads merged by reshape alone, without moving the head axis back",
    "k-transpose": "scores from k.transpose(1, 2) instead of a transpose of the last two axes",
    "softmax-axis": "softmax over queries instead of keys",
    "no-scale": "no 1/sqrt(Dh) on the scores",
    "mask-polarity": "the allow relation applied inverted, as if True meant blocked",
    "mask-after-softmax": "softmax over every key, then the forbidden weights set to zero",
}


def ops_for(fault: str | None) -> Ops:
    """The healthy ops, or the ops with one named fault injected."""
    if fault is None:
        return HEALTHY
    return _FAULTY[str(fault)]


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
