"""The observer, relation naming, score fits and head tracing, each on tensors built by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layout_modules as L
from attn_ledger.probes.module.fit import compare_relations, fit_scores, recognise_bias, relation_of
from attn_ledger.probes.module.heads import layout_of, locate, trace_vectors
from attn_ledger.probes.common.observe import observe_module, probe_weights

B, T, E, NH = 2, 6, 32, 4


def x_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))  # [B, T, E]


def built(cls, **kw) -> nn.Module:
    torch.manual_seed(0)
    return cls(E, NH, **kw).eval()


# --- the observer -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, kw, kind, ops, weights", [
    (L.WqWkWv, {}, "matmul", ["linear"] * 3, ["wq.weight", "wk.weight", "wv.weight"]),
    (L.ToQKV, {}, "matmul", ["linear"], ["to_qkv.weight"]),
    (L.GPT2Attention, {}, "matmul", ["addmm"], ["c_attn.weight"]),
    (L.QueryKeyValue, {}, "sdpa", ["linear"], ["query_key_value.weight"]),
    (L.MHACausal, {}, "sdpa", ["linear"], ["attn.in_proj_weight"]),
    (L.MHACausal, {"need_weights": True}, "matmul", ["linear"], ["attn.in_proj_weight"]),
], ids=["linear-matmul", "einsum", "conv1d-addmm", "sdpa", "mha-sdpa", "mha-bmm"])
def test_projections_and_core_are_found_by_their_calls(cls, kw, kind, ops, weights):
    m = built(cls, **kw)
    x = x_input()
    obs = observe_module(m, x)
    assert [p.op for p in obs.projections] == ops and [p.weight for p in obs.projections] == weights
    assert all(tuple(p.output.shape[:2]) == (B, T) for p in obs.projections)
    assert obs.core is not None and obs.core.kind == kind and obs.cores == 1
    assert tuple(obs.core.q.shape) == (B, NH, T, 8) and tuple(obs.core.context.shape) == (B, NH, T, 8)
    assert obs.out_projection is not None and obs.out_projection.inputs
    assert obs.mha == (cls is L.MHACausal)


def test_a_projection_output_keeps_the_input_positions():
    """MHA reads [T, B, E] (batch_first undone); GPT-2's Conv1D reads [B*T, E]: both come back [B, T, F]."""
    x = x_input()
    mha = built(L.MHACausal)
    out = observe_module(mha, x).projections[0].output  # [B, T, 3E]
    ref = F.linear(x, mha.attn.in_proj_weight, mha.attn.in_proj_bias)
    assert torch.allclose(out, ref, atol=1e-6)
    gpt2 = built(L.GPT2Attention)
    out = observe_module(gpt2, x).projections[0].output
    assert torch.allclose(out, x @ gpt2.c_attn.weight + gpt2.c_attn.bias, atol=1e-6)


def test_probe_weights_are_the_softmax_and_the_mask():
    m = built(L.WqWkWv)
    x = x_input()
    core = observe_module(m, x).core
    w, w0 = probe_weights(m, x, core)
    scores = core.q.double() @ core.k.double().transpose(-2, -1) / math.sqrt(8)
    allow = torch.ones(T, T, dtype=torch.bool).tril()
    want = scores.masked_fill(~allow, float("-inf")).softmax(-1)
    assert torch.allclose(w.double(), want, atol=1e-6)
    assert torch.equal(w0 > 0, allow.expand(B, NH, T, T))
    assert torch.allclose(w0[0, 0, 3, :4].double(), torch.full((4,), 0.25, dtype=torch.float64))


def test_sdpa_probe_recalls_sdpa_with_its_own_arguments():
    m = built(L.GQAttention, sdpa_gqa=True)
    x = x_input()
    core = observe_module(m, x).core
    assert core.kind == "sdpa" and core.k.shape[1] == 2 and core.sdpa["enable_gqa"] is True
    w, w0 = probe_weights(m, x, core)
    assert tuple(w.shape) == (B, NH, T, T)
    assert torch.equal(w0[0, 0] > 0, torch.ones(T, T, dtype=torch.bool).tril())
    # weights @ v reproduces the context: the probe is the core's own computation
    v = core.v.repeat_interleave(2, dim=1)
    assert torch.allclose(w @ v, core.context, atol=1e-6)


def test_an_opaque_core_is_not_invented():
    obs = observe_module(built(L.OpaqueCore), x_input())
    assert obs.core is None and obs.cores == 0 and obs.out_projection is None
    assert "causal_attention" in obs.unexplained


def test_the_observer_leaves_the_output_unchanged():
    m = built(L.GQAttention, rotary="half")
    x = x_input()
    with torch.no_grad():
        plain = m(x)
    from attn_ledger.probes.common.observe import _mode, _Observer

    with torch.no_grad(), _mode(_Observer(x, {}, None)):
        seen = m(x)
    assert torch.equal(plain, seen)


# --- relations ------------------------------------------------------------------------------------

def _rel(t: int, fn) -> torch.Tensor:
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    return fn(i, j).expand(t, t)


@pytest.mark.parametrize("fn, name, params", [
    (lambda i, j: torch.ones_like(i - j, dtype=torch.bool), "bidirectional", {}),
    (lambda i, j: j <= i, "causal", {}),
    (lambda i, j: (j <= i) & (i - j < 3), "sliding-window", {"window": 3}),
    (lambda i, j: (j <= i) | (j < 2), "prefix-lm", {"prefix_len": 2}),
    (lambda i, j: (i // 3) == (j // 3), "segments", {"lengths": [3, 3, 2], "within": "bidirectional"}),
    (lambda i, j: ((i // 4) == (j // 4)) & (j <= i), "segments", {"lengths": [4, 4], "within": "causal"}),
    (lambda i, j: (i - j).abs() < 2, "local-window", {"window": 2}),
    (lambda i, j: j < i, "strictly-causal", {}),
    (lambda i, j: j > i, "future-only", {}),
    (lambda i, j: torch.zeros_like(i - j, dtype=torch.bool), "no-keys", {}),
    (lambda i, j: (i + j) % 2 == 0, "other", {"allowed_pairs": 32}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_relations_are_named(fn, name, params):
    got = relation_of(_rel(8, fn))
    assert got["relation"] == name
    assert {k: v for k, v in got.items() if k not in ("relation", "text")} == params


def test_compare_relations_counts_and_places_the_difference():
    causal = _rel(5, lambda i, j: j <= i)
    wider = compare_relations(torch.ones(5, 5, dtype=torch.bool), causal)
    assert (wider["comparison"], wider["extra_pairs"], wider["missing_pairs"], wider["first_extra"]) == \
        ("wider", 10, 0, [0, 1])
    narrower = compare_relations(_rel(5, lambda i, j: j < i), causal)
    assert (narrower["comparison"], narrower["missing_pairs"], narrower["first_missing"]) == ("narrower", 5, [0, 0])
    assert compare_relations(causal, causal)["comparison"] == "same"
    assert compare_relations(_rel(5, lambda i, j: j >= i), causal)["comparison"] == "different"


# --- score fits -------------------------------------------------------------------------------------

def _weights(q, k, scale, allow, bias=None, cap=None):
    s = (q @ k.transpose(-2, -1)) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    return s.masked_fill(~allow, float("-inf")).softmax(-1)


def _qk(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, NH, T, 8, generator=g, dtype=torch.float64),
            torch.randn(B, NH, T, 8, generator=g, dtype=torch.float64))


def test_fit_recovers_a_scale_per_head_and_soft_capping():
    q, k = _qk()
    allow = torch.ones(T, T, dtype=torch.bool).tril()
    w0 = _weights(torch.zeros_like(q), k, 1.0, allow)
    fit0, bias = recognise_bias(w0, torch.float64)
    assert fit0.kind == "none"
    fit = fit_scores(q, k, _weights(q, k, 0.3, allow), w0, bias, torch.float64)
    assert fit.form == "linear" and fit.scales == pytest.approx([0.3] * NH, rel=1e-9)
    capped = fit_scores(q, k, _weights(q, k, 0.9, allow, cap=1.5), w0, bias, torch.float64)
    assert capped.form == "softcap"
    assert capped.caps == pytest.approx([1.5] * NH, rel=1e-6) and capped.scales == pytest.approx([0.9] * NH, rel=1e-6)


def test_bias_recognition():
    q, k = _qk()
    allow = torch.ones(T, T, dtype=torch.bool).tril()
    zero = torch.zeros_like(q)
    d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs().double()
    slopes = torch.tensor([2 ** (-8 * (h + 1) / NH) for h in range(NH)], dtype=torch.float64)
    alibi, _ = recognise_bias(_weights(zero, k, 1.0, allow, bias=-slopes[:, None, None] * d), torch.float64)
    assert alibi.kind == "alibi" and alibi.standard_slopes and alibi.slopes == pytest.approx(slopes.tolist())
    table = torch.randn(NH, 2 * T - 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rel = table[:, (torch.arange(T)[None, :] - torch.arange(T)[:, None]) + T - 1]  # [Nh, T, T], by offset
    relative, _ = recognise_bias(_weights(zero, k, 1.0, allow, bias=rel), torch.float64)
    assert relative.kind == "relative"
    free = torch.randn(NH, T, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert recognise_bias(_weights(zero, k, 1.0, allow, bias=free), torch.float64)[0].kind == "other"
    per_example = torch.randn(B, 1, T, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert recognise_bias(_weights(zero, k, 1.0, allow, bias=per_example), torch.float64)[0].kind == "content"


# --- head tracing ------------------------------------------------------------------------------------

def _heads(p: torch.Tensor, offsets: list[int], d: int) -> torch.Tensor:
    return torch.stack([p[:, :, o:o + d] for o in offsets], dim=1)  # [B, H, T, D]


def test_locate_finds_blocks_through_a_scale_and_names_the_layout():
    p = torch.randn(B, T, 3 * 4 * 8, generator=torch.Generator().manual_seed(1))  # [B, T, 3 * Nh * Dh]
    q = _heads(p, [24 * h for h in range(4)], 8) * 0.25  # [Nh, 3, Dh] layout, q scaled
    k = _heads(p, [24 * h + 8 for h in range(4)], 8)
    v = _heads(p, [24 * h + 16 for h in range(4)], 8)
    lq, lk, lv = (locate(t, [p], role=r, names=["qkv.weight"]) for r, t in (("q", q), ("k", k), ("v", v)))
    assert lq.offset == (0, 24, 48, 72) and lq.factor == pytest.approx(0.25, rel=1e-6)
    assert layout_of(lq, lk, lv, [p.shape[-1]], 8, 8)["name"] == \
        "fused q, k, v projection, per-head interleaved [Nh, 3, Dh]"


def test_trace_vectors_finds_a_split_that_moved_positions():
    p = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2))
    bad = p.reshape(B, 4, T, 8)  # reshape without transpose: head h, position t holds another position's head
    assert locate(bad, [p]) is None
    moved = trace_vectors(bad, [p])
    assert moved.traced == moved.total == B * 4 * T and moved.moved > 0
    b, h, t = moved.first
    sb, st, _, so = moved.source
    flat = h * T + t  # where the reshape took it from: position flat // 4, head flat % 4
    assert (sb, st, so) == (b, flat // 4, 8 * (flat % 4))
    good = trace_vectors(p.reshape(B, T, 4, 8).transpose(1, 2), [p])
    assert good.moved == 0 and good.traced == good.total
