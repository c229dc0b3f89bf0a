"""check --module on attention from a widely used package: Hugging Face transformers' own layers.

Each model is built from a tiny config with random weights, one layer deep, and fed through
``inputs_embeds`` so the module protocol ``[B, T, E] -> [B, T, E]`` holds while the layer's
own code builds its own masks and rotary tables. The word embedding is unused on that path
and frozen, so it is not reported as a parameter without a gradient.

Skipped when transformers is absent (``pip install -e '.[real]'`` installs it).
"""

from __future__ import annotations

import logging

import pytest
from torch import nn

transformers = pytest.importorskip("transformers", minversion="4.48")

from attn_ledger.modulecheck import check_module  # noqa: E402
from attn_ledger.report import Report  # noqa: E402

E, NH = 32, 4  # Dh = 8


@pytest.fixture(autouse=True)
def quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


class FromEmbeddings(nn.Module):
    """A one-layer transformers model read as ``[B, T, E] -> [B, T, E]`` through ``inputs_embeds``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        for p in model.get_input_embeddings().parameters():
            p.requires_grad_(False)  # unused when inputs_embeds is given

    def forward(self, x):
        return self.model(inputs_embeds=x).last_hidden_state


def llama(impl: str, **extra):
    def make(e: int, nh: int) -> nn.Module:
        cfg = transformers.LlamaConfig(hidden_size=e, intermediate_size=2 * e, num_hidden_layers=1,
                                       num_attention_heads=nh, num_key_value_heads=nh // 2, vocab_size=16,
                                       max_position_embeddings=64, attn_implementation=impl, **extra)
        return FromEmbeddings(transformers.LlamaModel(cfg))
    return make


def mistral(impl: str, window: int):
    def make(e: int, nh: int) -> nn.Module:
        cfg = transformers.MistralConfig(hidden_size=e, intermediate_size=2 * e, num_hidden_layers=1,
                                         num_attention_heads=nh, num_key_value_heads=nh // 2, vocab_size=16,
                                         max_position_embeddings=64, sliding_window=window, attn_implementation=impl)
        return FromEmbeddings(transformers.MistralModel(cfg))
    return make


def gpt2(impl: str, **extra):
    def make(e: int, nh: int) -> nn.Module:
        cfg = transformers.GPT2Config(n_embd=e, n_layer=1, n_head=nh, vocab_size=16, n_positions=64,
                                      bos_token_id=None, eos_token_id=None, attn_implementation=impl, **extra)
        return FromEmbeddings(transformers.GPT2Model(cfg))
    return make


def gpt_neox(impl: str):
    def make(e: int, nh: int) -> nn.Module:
        cfg = transformers.GPTNeoXConfig(hidden_size=e, intermediate_size=2 * e, num_hidden_layers=1,
                                         num_attention_heads=nh, vocab_size=16, max_position_embeddings=64,
                                         rotary_pct=0.5, bos_token_id=None, eos_token_id=None,
                                         attn_implementation=impl)
        return FromEmbeddings(transformers.GPTNeoXModel(cfg))
    return make


def bert(impl: str):
    def make(e: int, nh: int) -> nn.Module:
        cfg = transformers.BertConfig(hidden_size=e, intermediate_size=2 * e, num_hidden_layers=1,
                                      num_attention_heads=nh, vocab_size=16, max_position_embeddings=64,
                                      attn_implementation=impl)
        return FromEmbeddings(transformers.BertModel(cfg, add_pooling_layer=False))
    return make


def check(report: Report, name: str):
    return next(c for _, c in report.checks() if c.name == name)


CORRECT = [
    (f"{name}-{impl}", make(impl), sizes, options, layout, rotary)
    for impl in ("eager", "sdpa")
    for name, make, sizes, options, layout, rotary in (
        ("llama", llama, (E, NH), {}, "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]",
         {"pairing": "half", "base": 10000.0, "rotated_dim": 8, "head_dim": 8}),
        ("mistral", lambda i: mistral(i, 4), (E, NH), {"window": 4, "seq_len": 8},
         "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]",
         {"pairing": "half", "base": 10000.0, "rotated_dim": 8, "head_dim": 8}),
        ("gpt2", gpt2, (E, NH), {}, "fused q, k, v projection, chunked [3, Nh, Dh]", None),
        ("gpt-neox", gpt_neox, (64, NH), {}, "fused q, k, v projection, per-head interleaved [Nh, 3, Dh]",
         {"pairing": "half", "base": 10000.0, "rotated_dim": 8, "head_dim": 16}),
        ("bert", bert, (E, NH), {"causal": False}, "separate q, k, v projections, heads [Nh=4, Dh=8]", None),
    )
]


@pytest.mark.parametrize("make, sizes, options, layout, rotary", [c[1:] for c in CORRECT], ids=[c[0] for c in CORRECT])
def test_transformers_attention_passes_with_what_it_applies_named(make, sizes, options, layout, rotary):
    report = check_module(make, *sizes, **options)
    assert report.exit_code == 0, report.failures()
    assert [(r, c.name) for r, c in report.checks() if c.status in ("fail", "warn")] == []
    assert report.coverage is None
    assert report.details["layout"] == layout
    assert check(report, "rotary_positions").data["spec"] == rotary
    applied = check(report, "mask_relation").data
    want = "sliding-window" if "window" in options else "causal" if options.get("causal", True) else "bidirectional"
    assert applied["applied"] == want
    assert check(report, "effective_scale").status == "pass"
    # BERT adds learned position embeddings before attention: order matters, legitimately
    perm = [c for _, c in report.checks() if c.name == "permutation_equivariance"]
    assert all(c.status == "inconclusive" for c in perm)


def test_gpt2_without_its_scale_is_named():
    report = check_module(gpt2("eager", scale_attn_weights=False), E, NH)
    first = report.first_finding
    assert (first.row, first.name) == ("core", "effective_scale") and first.check.data["named"] == ["1"]


def test_mistral_configured_with_another_window_than_declared():
    report = check_module(mistral("sdpa", 5), E, NH, window=4, seq_len=8)
    first = report.first_finding
    assert (first.row, first.name) == ("core", "mask_relation")
    assert (first.check.data["applied"], first.check.data["window"], first.check.data["comparison"]) == \
        ("sliding-window", 5, "wider")
