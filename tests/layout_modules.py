"""Attention modules written the ways real code writes them, each correct unless a bug is asked for.

Every factory takes ``(embed_dim, num_heads)`` (the module protocol) and returns a module
``[B, T, E] -> [B, T, E]``; the bug is a keyword chosen by the test. Nothing here uses
attn-ledger's own code (the opaque core is loaded from the fixtures as a user's file is):
rotary, masks and splits are written out as the libraries they imitate write them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attn_ledger.inputs.userload import load_object


def _causal_allow(t: int, device=None) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T], True = may attend


# --- separate projections under unusual names -------------------------------------------------

class WqWkWv(nn.Module):
    """wq/wk/wv/wo, hand-written causal core; ``scale`` picks the softmax scale.

    ``flat_scores`` takes the scores with ``baddbmm`` on ``[B*Nh, T, Dh]`` and views them as
    ``[B, Nh, T, T]`` before the weights meet v (transformers' GPT-NeoX eager path did so in 4.x).
    """

    def __init__(self, embed_dim: int, num_heads: int, scale: str = "head", causal: bool = True,
                 merge_no_transpose: bool = False, mask: str = "causal", flat_scores: bool = False) -> None:
        super().__init__()
        self.nh, self.dh, self.scale, self.causal = num_heads, embed_dim // num_heads, scale, causal
        self.merge_no_transpose, self.mask, self.flat_scores = merge_no_transpose, mask, flat_scores
        self.wq = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wk = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wv = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wo = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (w(x).view(b, t, self.nh, self.dh).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        factor = {"head": self.dh ** -0.5, "model": e ** -0.5, "none": 1.0, "times": self.dh ** 0.5}[self.scale]
        if self.flat_scores:
            qf, kf = q.reshape(b * self.nh, t, self.dh), k.reshape(b * self.nh, t, self.dh)  # [B*Nh, T, Dh]
            zeros = torch.zeros(b * self.nh, t, t, dtype=x.dtype)
            scores = torch.baddbmm(zeros, qf, kf.transpose(1, 2), beta=1.0, alpha=factor).view(b, self.nh, t, t)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * factor  # [B, Nh, T, T]
        if self.causal:
            allow = _causal_allow(t, x.device).tril(-1 if self.mask == "strict" else 0)
            scores = scores.masked_fill(~allow, float("-inf"))
        axis = -2 if self.mask == "softmax-over-queries" else -1
        ctx = torch.matmul(F.softmax(scores, dim=axis), v)  # [B, Nh, T, Dh]
        if self.merge_no_transpose:
            return self.wo(ctx.reshape(b, t, e))  # the bug: heads and positions mixed
        return self.wo(ctx.transpose(1, 2).reshape(b, t, e))


# --- a fused to_qkv, chunked (lucidrains / ViT style) -----------------------------------------

class ToQKV(nn.Module):
    """``to_qkv(x).chunk(3)``, einsum scores; bidirectional. ``twice`` applies the scale to q and to the scores."""

    def __init__(self, embed_dim: int, num_heads: int, twice: bool = False, own_scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.twice = num_heads, twice
        self.scale = own_scale if own_scale is not None else (embed_dim // num_heads) ** -0.5
        self.to_qkv = nn.Linear(embed_dim, embed_dim * 3, bias=False)
        self.to_out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        if self.twice:
            q = q * self.scale
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale  # [B, Nh, T, T]
        attn = dots.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)  # [B, Nh, T, Dh]
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, e))


# --- a fused query_key_value, per-head interleaved (GPT-NeoX / Bloom style) ----------------------

class QueryKeyValue(nn.Module):
    """``query_key_value`` laid out ``[Nh, 3, Dh]``, causal SDPA; ``no_transpose`` splits heads by a bare reshape."""

    def __init__(self, embed_dim: int, num_heads: int, no_transpose: bool = False) -> None:
        super().__init__()
        self.nh, self.dh, self.no_transpose = num_heads, embed_dim // num_heads, no_transpose
        self.query_key_value = nn.Linear(embed_dim, 3 * embed_dim)
        self.dense = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        qkv = self.query_key_value(x)  # [B, T, Nh * 3 * Dh]
        if self.no_transpose:
            qkv = qkv.reshape(b, self.nh, t, 3 * self.dh)  # the bug: positions and heads mixed
        else:
            qkv = qkv.view(b, t, self.nh, 3 * self.dh).permute(0, 2, 1, 3)  # [B, Nh, T, 3 * Dh]
        q, k, v = qkv.split(self.dh, dim=-1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, Nh, T, Dh]
        return self.dense(ctx.permute(0, 2, 1, 3).reshape(b, t, e))


# --- GPT-2 with its own Conv1D (weight [in, out], addmm) ------------------------------------------

class Conv1D(nn.Module):
    """GPT-2's Conv1D: a linear layer with the weight transposed, applied with addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    """c_attn/c_proj as Conv1D, a causal ``bias`` buffer; ``masked`` False forgets the mask."""

    def __init__(self, embed_dim: int, num_heads: int, masked: bool = True, max_positions: int = 64) -> None:
        super().__init__()
        self.nh, self.dh, self.masked = num_heads, embed_dim // num_heads, masked
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
                             .view(1, 1, max_positions, max_positions), persistent=False)
        self.c_attn = Conv1D(3 * embed_dim, embed_dim)
        self.c_proj = Conv1D(embed_dim, embed_dim)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.size()[:-1] + (self.nh, self.dh)).permute(0, 2, 1, 3)  # [B, Nh, T, Dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = self.c_attn(x).split(self.nh * self.dh, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        w = torch.matmul(query, key.transpose(-1, -2)) / torch.full([], value.size(-1) ** 0.5, dtype=query.dtype)
        if self.masked:
            t = query.size(-2)
            causal = self.bias[:, :, :t, :t]
            w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        w = F.softmax(w, dim=-1)
        a = torch.matmul(w, value).permute(0, 2, 1, 3).contiguous()  # [B, T, Nh, Dh]
        return self.c_proj(a.view(a.size()[:-2] + (self.nh * self.dh,)))


# --- nn.MultiheadAttention with a boolean mask ------------------------------------------------------

class MHACausal(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)`` with a boolean causal mask; ``allow_polarity`` passes it
    True = may attend, where MHA reads True = blocked. ``need_weights`` as MHA's own default (True)
    takes its bmm path instead of SDPA."""

    def __init__(self, embed_dim: int, num_heads: int, allow_polarity: bool = False, need_weights: bool = False) -> None:
        super().__init__()
        self.allow_polarity, self.need_weights = allow_polarity, need_weights
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        allow = _causal_allow(x.shape[1], x.device)
        mask = allow if self.allow_polarity else ~allow
        return self.attn(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]


# --- grouped-query attention with narrow k/v projections ------------------------------------------

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotary_tables(t: int, dim: int, base: float, offset: int = 0, interleaved: bool = False, stretch: float = 1.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    pos = torch.arange(offset, offset + t, dtype=torch.float32) / stretch
    freqs = torch.outer(pos, inv_freq)  # [T, dim/2]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)  # [T, dim]
    return emb.cos(), emb.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotate_every_two: (x0, x1) -> (-x1, x0) for each interleaved pair."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class GQAttention(nn.Module):
    """Llama/Mistral-style attention: q_proj to Nh heads, k_proj/v_proj to Nkv heads, repeat_kv.

    Options: ``rotary`` (``None``, ``"half"`` as Llama's rotate_half, ``"interleaved"`` as
    GPT-J), ``rotary_dim`` (partial rotary: only the first features of each head), ``window``
    (sliding window of that many keys, Mistral), and the bugs: ``pairing="repeat"`` (kv heads
    tiled instead of interleaved), ``rotate_v``, ``k_offset`` (k rotated at shifted
    positions), ``only_q``, ``window_off_by_one``; ``stretch`` divides the positions (linear
    position interpolation, a rotary variant the recognition does not model); ``bidirectional``
    drops the causal mask (an encoder).
    """

    def __init__(self, embed_dim: int, num_heads: int, kv_heads: int | None = None, rotary: str | None = None,
                 rotary_dim: int | None = None, base: float = 10000.0, window: int | None = None,
                 pairing: str = "interleave", rotate_v: bool = False, k_offset: int = 0, only_q: bool = False,
                 window_off_by_one: bool = False, sdpa_gqa: bool = False, stretch: float = 1.0,
                 bidirectional: bool = False) -> None:
        super().__init__()
        self.nh = num_heads
        self.nkv = kv_heads or max(1, num_heads // 2)
        self.dh = embed_dim // num_heads
        self.rotary, self.rotary_dim, self.base = rotary, rotary_dim or self.dh, base
        self.window, self.pairing, self.rotate_v = window, pairing, rotate_v
        self.k_offset, self.only_q, self.window_off_by_one, self.sdpa_gqa = k_offset, only_q, window_off_by_one, sdpa_gqa
        self.stretch = stretch  # linear position interpolation: positions divided by this
        self.bidirectional = bidirectional
        self.q_proj = nn.Linear(embed_dim, self.nh * self.dh, bias=False)
        self.k_proj = nn.Linear(embed_dim, self.nkv * self.dh, bias=False)
        self.v_proj = nn.Linear(embed_dim, self.nkv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.nh * self.dh, embed_dim, bias=False)

    def _rope(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        rd = self.rotary_dim
        inter = self.rotary == "interleaved"
        cos, sin = _rotary_tables(x.shape[-2], rd, self.base, offset, inter, self.stretch)
        rot, rest = x[..., :rd], x[..., rd:]
        turned = rot * cos + (_rotate_pairs(rot) if inter else _rotate_half(rot)) * sin
        return torch.cat((turned, rest), dim=-1)

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        g = self.nh // self.nkv
        if self.pairing == "repeat":
            return t.repeat(1, g, 1, 1)  # the bug: head h reads kv head h % Nkv
        b, n, s, d = t.shape
        return t[:, :, None].expand(b, n, g, s, d).reshape(b, n * g, s, d)  # Llama's repeat_kv

    def _mask(self, t: int, device) -> torch.Tensor:
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(t, device=device)[None, :]
        allow = (j <= i) | self.bidirectional
        if self.window:
            reach = self.window + 1 if self.window_off_by_one else self.window
            allow = allow & (i - j < reach)
        return torch.zeros(t, t, device=device).masked_fill(~allow, float("-inf"))  # additive [T, T]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.dh).transpose(1, 2)  # [B, Nh, T, Dh]
        k = self.k_proj(x).view(b, t, self.nkv, self.dh).transpose(1, 2)  # [B, Nkv, T, Dh]
        v = self.v_proj(x).view(b, t, self.nkv, self.dh).transpose(1, 2)  # [B, Nkv, T, Dh]
        if self.rotary:
            q = self._rope(q)
            if not self.only_q:
                k = self._rope(k, self.k_offset)
            if self.rotate_v:
                v = self._rope(v)
        if self.sdpa_gqa and not self.window:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = self._repeat(k), self._repeat(v)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(t, x.device))  # [B, Nh, T, Dh]
        return self.o_proj(ctx.transpose(1, 2).reshape(b, t, self.nh * self.dh))


# --- a fused projection in Falcon's grouped layout -------------------------------------------------

class FalconGrouped(nn.Module):
    """``query_key_value`` laid out ``[Nkv, g + 2, Dh]``: per kv group, its g query heads, then k, then v."""

    def __init__(self, embed_dim: int, num_heads: int, kv_heads: int = 2) -> None:
        super().__init__()
        self.nh, self.nkv, self.dh = num_heads, kv_heads, embed_dim // num_heads
        self.query_key_value = nn.Linear(embed_dim, (num_heads + 2 * kv_heads) * self.dh, bias=False)
        self.dense = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        g = self.nh // self.nkv
        fused = self.query_key_value(x).view(b, t, self.nkv, g + 2, self.dh)
        q = fused[:, :, :, :g].reshape(b, t, self.nh, self.dh).transpose(1, 2)  # [B, Nh, T, Dh]
        k = fused[:, :, :, g].transpose(1, 2).repeat_interleave(g, dim=1)  # [B, Nh, T, Dh]
        v = fused[:, :, :, g + 1].transpose(1, 2).repeat_interleave(g, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(ctx.transpose(1, 2).reshape(b, t, e))


# --- designs that differ on purpose ------------------------------------------------------------------

class BiasedScores(nn.Module):
    """A hand-written causal core whose scores get a design of its own: ``alibi``, ``t5`` (a learned
    relative bias by offset), ``softcap`` (Gemma 2's tanh capping), or ``table`` (a learned bias per
    query-key pair, no recognised form). ``gain`` scales the projection's weights (small scores: far
    below a cap)."""

    def __init__(self, embed_dim: int, num_heads: int, design: str = "alibi", cap: float = 2.0,
                 gain: float = 1.0) -> None:
        super().__init__()
        self.nh, self.dh, self.design, self.cap = num_heads, embed_dim // num_heads, design, cap
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        with torch.no_grad():
            self.qkv.weight.mul_(gain)
        self.out = nn.Linear(embed_dim, embed_dim)
        if design == "t5":
            self.rel = nn.Parameter(torch.randn(num_heads, 127) * 0.5)  # one value per head and offset
        if design == "table":
            self.table = nn.Parameter(torch.randn(num_heads, 64, 64) * 0.5)

    def _bias(self, t: int) -> torch.Tensor:
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        if self.design == "alibi":
            slopes = torch.tensor([2 ** (-8 * (h + 1) / self.nh) for h in range(self.nh)])
            return -slopes[:, None, None] * (i - j).abs()  # [Nh, T, T]
        if self.design == "t5":
            return self.rel[:, (j - i + 63).clamp(0, 126)]  # [Nh, T, T]
        if self.design == "table":
            return self.table[:, :t, :t]
        return torch.zeros(self.nh, t, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.nh, self.dh).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        s = q @ k.transpose(-2, -1) * self.dh ** -0.5  # [B, Nh, T, T]
        if self.design == "softcap":
            s = self.cap * torch.tanh(s / self.cap)
        s = s + self._bias(t)
        s = s.masked_fill(~_causal_allow(t), float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


# --- a core that cannot be observed: the fixtures' own, one custom op between q, k, v and the context ----

OpaqueCore = load_object(f"{Path(__file__).resolve().parents[1] / 'fixtures' / 'modules' / 'attention_modules.py'}:OpaqueCore")


def factory(cls, **options):
    """``factory(embed_dim, num_heads)`` for a class and its options, with a readable name."""
    made = partial(cls, **options)
    made.__name__ = cls.__name__ + "".join(f"_{k}_{v}" for k, v in options.items())  # type: ignore[attr-defined]
    return made


class _WrongBackward(torch.autograd.Function):
    """Identity forward; the backward returns twice the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class WrongGradient(GQAttention):
    """Correct forward, a custom autograd function with a wrong backward on the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WrongBackward.apply(super().forward(x))


class Float32Softmax(WqWkWv):
    """Correct, but its softmax runs in float32 whatever the input dtype (as many implementations do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (w(x).view(b, t, self.nh, self.dh).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) * self.dh ** -0.5
        scores = scores.masked_fill(~_causal_allow(t, x.device), float("-inf"))
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.wo((weights @ v).transpose(1, 2).reshape(b, t, e))
