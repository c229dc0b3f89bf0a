"""Decode paths built to break one decode diagnosis each, beyond the fixtures in fixtures/modules/decode_modules.py.

The ``Einsum*`` module computes its scores with ``torch.einsum``, which the core observer does not
read, so its decode bugs must be found from outside (changed tokens, modified sequences).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attn_ledger.inputs.userload import load_object

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "decode_modules.py"


def fixture(name: str):
    return load_object(f"{FIXTURE}:{name}")


causal_allowed = fixture("causal_allowed")
PlainAttention = fixture("PlainAttention")


class EinsumAttention(PlainAttention):
    """Causal attention without positions whose scores come from ``torch.einsum`` (not observed)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, Nh, Tq, Tk]
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)  # [B, Nh, Tq, Dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.merge(self.attend(q, k, v, causal_allowed(x.shape[1], x.shape[1])))


def einsum(embed_dim: int, num_heads: int) -> nn.Module:
    return EinsumAttention(embed_dim, num_heads)


def _lists(cache):
    return cache if cache is not None else ([], [])


def decode_einsum(module, x_new, cache):
    past_k, past_v = _lists(cache)
    q, k, v = module.heads(x_new)
    keys, values = torch.cat(past_k + [k], dim=2), torch.cat(past_v + [v], dim=2)
    return module.merge(module.attend(q, keys, values, causal_allowed(q.shape[2], keys.shape[2]))), \
        (past_k + [k], past_v + [v])


def decode_einsum_one_short(module, x_new, cache):
    """Bug: the last cached position is dropped before attending."""
    past_k, past_v = _lists(cache)
    q, k, v = module.heads(x_new)
    keys, values = k, v
    if past_k:
        keys = torch.cat([torch.cat(past_k, dim=2)[:, :, :-1], k], dim=2)  # [B, Nh, Tk - 1, Dh]
        values = torch.cat([torch.cat(past_v, dim=2)[:, :, :-1], v], dim=2)
    return module.merge(module.attend(q, keys, values, causal_allowed(q.shape[2], keys.shape[2]))), \
        (past_k + [k], past_v + [v])


def decode_einsum_one_long(module, x_new, cache):
    """Bug: the new keys and values are attended twice."""
    past_k, past_v = _lists(cache)
    q, k, v = module.heads(x_new)
    keys, values = torch.cat(past_k + [k, k[:, :, -1:]], dim=2), torch.cat(past_v + [v, v[:, :, -1:]], dim=2)
    return module.merge(module.attend(q, keys, values, causal_allowed(q.shape[2], keys.shape[2]))), \
        (past_k + [k], past_v + [v])


def decode_einsum_unshifted_mask(module, x_new, cache):
    """Bug: the chunk's mask is the plain causal one, aligned top-left, for chunks of more than one token."""
    past_k, past_v = _lists(cache)
    q, k, v = module.heads(x_new)
    keys, values = torch.cat(past_k + [k], dim=2), torch.cat(past_v + [v], dim=2)
    t, tk = q.shape[2], keys.shape[2]
    allowed = torch.ones(t, tk, dtype=torch.bool).tril() if t > 1 else causal_allowed(t, tk)
    return module.merge(module.attend(q, keys, values, allowed)), (past_k + [k], past_v + [v])


def decode_list_one_long(module, x_new, cache):
    """Bug (observed through SDPA): the newest key and value appear twice."""
    past_k, past_v = _lists(cache)
    offset = sum(k.shape[2] for k in past_k)
    q, k, v = module.heads(x_new, offset)
    keys = torch.cat(past_k + [k, k[:, :, -1:]], dim=2)  # [B, Nh, Tk + 1, Dh]
    values = torch.cat(past_v + [v, v[:, :, -1:]], dim=2)
    t, tk = q.shape[2], keys.shape[2]
    ctx = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=causal_allowed(t, tk))
    return module.merge(ctx), (past_k + [k], past_v + [v])


def decode_scaled(module, x_new, cache):
    """Bug of no usual kind: every decoded output is 1% too large."""
    y, cache = fixture("decode_list")(module, x_new, cache)
    return 1.01 * y, cache


_CALLS = {"n": 0}


def decode_drifting(module, x_new, cache):
    """Bug: a counter kept outside the cache, never reset, nudges every output."""
    _CALLS["n"] += 1
    y, cache = fixture("decode_list")(module, x_new, cache)
    return y + 1e-3 * _CALLS["n"], cache


def decode_lagging(module, x_new, cache):
    """Bug: returns the previous call's output for single tokens (the first call returns its own)."""
    inner, previous = cache if cache is not None else (None, None)
    y, inner = fixture("decode_list")(module, x_new, inner)
    return (y if previous is None else previous), (inner, y)


def decode_raises(module, x_new, cache):
    if cache is not None:
        raise RuntimeError("no cache support")
    return fixture("decode_list")(module, x_new, cache)


def decode_wrong_shape(module, x_new, cache):
    y, cache = fixture("decode_list")(module, x_new, cache)
    return y.transpose(0, 1), cache


def decode_not_a_pair(module, x_new, cache):
    return fixture("decode_list")(module, x_new, cache)[0]


def decode_two_arguments(module, x_new):
    return module(x_new), None


def decode_meta(module, x_new, cache):
    y, cache = fixture("decode_list")(module, x_new, cache)
    return y.to("meta"), cache


class GroupedRotary(PlainAttention):
    """Rotary grouped-query attention (Nkv = Nh / 2) that hands SDPA its Nkv kv heads (``enable_gqa``) in
    the full forward, while its decode path repeats them to Nh and passes a mask, as transformers' SDPA
    path does over a cache: the kv heads entering attention differ in number between the two."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__(embed_dim, num_heads, rotary=True)
        self.num_kv = num_heads // 2
        kv_width = self.num_kv * (embed_dim // num_heads)
        self.wk = nn.Linear(embed_dim, kv_width, bias=False)
        self.wv = nn.Linear(embed_dim, kv_width, bias=False)

    def heads(self, x: torch.Tensor, offset: int = 0):
        b, t, e = x.shape
        dh = e // self.num_heads
        q = self.wq(x).reshape(b, t, self.num_heads, dh).transpose(1, 2)  # [B, Nh, t, Dh]
        k = self.wk(x).reshape(b, t, self.num_kv, dh).transpose(1, 2)  # [B, Nkv, t, Dh]
        v = self.wv(x).reshape(b, t, self.num_kv, dh).transpose(1, 2)  # [B, Nkv, t, Dh]
        return rope(q, offset), rope(k, offset), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))  # [B, T, E]


rope = fixture("rope")


def grouped_rotary(embed_dim: int, num_heads: int) -> nn.Module:
    return GroupedRotary(embed_dim, num_heads)


def _decode_grouped(module, x_new, cache, shift: int):
    past_k, past_v = _lists(cache)
    offset = sum(k.shape[2] for k in past_k)
    q, k, v = module.heads(x_new, offset + (shift if past_k else 0))
    keys, values = torch.cat(past_k + [k], dim=2), torch.cat(past_v + [v], dim=2)  # [B, Nkv, Tk, Dh]
    g = q.shape[1] // keys.shape[1]
    allowed = causal_allowed(q.shape[2], keys.shape[2])
    ctx = F.scaled_dot_product_attention(q, keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1),
                                         attn_mask=allowed)  # [B, Nh, t, Dh]
    return module.merge(ctx), (past_k + [k], past_v + [v])


def decode_grouped(module, x_new, cache):
    return _decode_grouped(module, x_new, cache, 0)


def decode_grouped_off_by_one(module, x_new, cache):
    """Bug: the position offset counts one too many once a cache exists."""
    return _decode_grouped(module, x_new, cache, 1)
