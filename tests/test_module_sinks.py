"""``check --module`` and attention sinks: recognised in an observed core, declared with ``--sinks``.

A core with one sink logit per head (gpt-oss's) gives q-zeroed weights that sum to ``n / (n + e^s)``
per row: the sinks are read from them, named in the design, and the core passes against a float64
reference that counts them. Declared sinks the core does not apply fail; a plain core names none.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attn_ledger.errors import InputError
from attn_ledger.probes.module.check import check_module
from attn_ledger.probes.module.core import recognise_sinks
from attn_ledger.render.notes import notes_text

LOGITS = (-0.5, 0.5, 1.5)


class SinkAttention(nn.Module):
    """Causal attention with a hand-written core and one sink logit per head, optionally left out."""

    def __init__(self, embed_dim: int, num_heads: int, drop_sink: bool = False) -> None:
        super().__init__()
        self.num_heads, self.drop_sink = num_heads, drop_sink
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out = nn.Linear(embed_dim, embed_dim, bias=False)
        self.sinks = nn.Parameter(torch.tensor(LOGITS[:num_heads]))

    def forward(self, x):
        b, t, e = x.shape
        h = self.num_heads
        q, k, v = (p.reshape(b, t, h, e // h).transpose(1, 2) for p in self.qkv(x).chunk(3, dim=-1))
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        if self.drop_sink:
            w = torch.softmax(s, dim=-1)
        else:
            col = self.sinks.reshape(1, h, 1, 1).expand(b, h, t, 1)
            w = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
        return self.out((w @ v).transpose(1, 2).reshape(b, t, e))


def with_sinks(e, h):
    return SinkAttention(e, h)


def sinks_dropped(e, h):
    return SinkAttention(e, h, drop_sink=True)


def plain(e, h):
    return SinkAttention(e, h, drop_sink=True)


def design(report):
    return next(c for c in report.row("core").checks if c.name == "score_design")


def test_an_undeclared_sink_passes_named():
    report = check_module(with_sinks, 12, 3, seed=0)
    assert report.exit_code == 0 and report.first_finding is None
    d = design(report)
    assert d.passed and d.data["design"] == "sinks"
    assert d.data["sinks"] == pytest.approx(LOGITS, abs=1e-4)
    assert any("attention sinks with logits -0.5,0.5,1.5: declare them with --sinks" in n for n in notes_text(report))


def test_declared_sinks_the_core_applies_pass():
    report = check_module(with_sinks, 12, 3, seed=1, sinks="-0.5,0.5,1.5")
    assert report.exit_code == 0
    assert report.details["sinks"] == list(LOGITS)
    assert not any("declare them with --sinks" in n for n in notes_text(report))


def test_declared_sinks_the_core_drops_fail():
    report = check_module(sinks_dropped, 12, 3, seed=0, sinks=list(LOGITS))
    assert report.exit_code == 1
    found = report.first_finding
    assert (found.row, found.name, found.level) == ("core", "score_design", 4)
    assert "the declared --sinks -0.5,0.5,1.5 are not applied" in design(report).reason


def test_a_plain_core_names_no_sink():
    report = check_module(plain, 12, 3, seed=0)
    assert report.first_finding is None
    d = design(report)
    assert d.passed and "sinks" not in d.data["design"] and "sinks" not in d.data
    assert not any("attention sinks" in n for n in notes_text(report))


def test_recognition_needs_one_logit_per_head():
    t = 5
    n = torch.arange(1, t + 1, dtype=torch.float64)  # causal: query i has i + 1 keys
    allow = torch.ones(t, t, dtype=torch.bool).tril()
    s = torch.tensor([0.0, 1.0], dtype=torch.float64)
    w0 = torch.where(allow, 1 / (n[:, None] + s.exp()[:, None, None]), 0.0)[None]  # [1, 2, T, T]
    assert recognise_sinks(w0, torch.float32) == pytest.approx((0.0, 1.0))
    assert recognise_sinks(torch.where(allow, 1 / n[:, None], 0.0)[None, None], torch.float32) is None  # no sink
    skewed = w0.clone()
    skewed[0, 1, 3] *= 0.8  # one row's shortfall not the head's logit
    assert recognise_sinks(skewed, torch.float32) is None


def test_bad_sinks_declarations_are_input_errors():
    with pytest.raises(InputError, match="sinks: got 2 values"):
        check_module(with_sinks, 12, 3, sinks="1,2")
    with pytest.raises(InputError, match="sinks: got nan"):
        check_module(with_sinks, 12, 3, sinks=float("nan"))



def test_a_tiny_gpt_oss_attention_layer_passes_naming_its_sinks():
    """transformers' own gpt-oss attention (eager), random weights, a tiny config (the ``real`` extra)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    class Layer(nn.Module):
        def __init__(self, e, h):
            super().__init__()
            cfg = GptOssConfig(hidden_size=e, num_attention_heads=h, num_key_value_heads=h, head_dim=e // h,
                               num_hidden_layers=1, layer_types=["full_attention"], attn_implementation="eager")
            self.attn = GptOssAttention(cfg, layer_idx=0)
            self.rope = GptOssRotaryEmbedding(cfg)
            with torch.no_grad():
                self.attn.sinks.copy_(torch.tensor(LOGITS[:h]))

        def forward(self, x):
            b, t, _ = x.shape
            pos = torch.arange(t)[None].expand(b, t)
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
            return self.attn(x, position_embeddings=self.rope(x, pos), attention_mask=mask)[0]

    report = check_module(lambda e, h: Layer(e, h), 12, 3, seed=0)
    assert design(report).data.get("sinks") == pytest.approx(LOGITS, abs=1e-3), (transformers.__version__,
                                                                                   report.first_finding)


def test_declared_sinks_other_than_the_cores_fail_naming_the_head():
    report = check_module(with_sinks, 12, 3, seed=0, sinks="-0.5,0.5,2.5")
    found = report.first_finding
    assert (found.row, found.name) == ("core", "score_design")
    assert "head 2 declared 2.5, the weights show 1.5" in design(report).reason


def test_the_catalogue_catches_unused_sinks_at_score_design():
    from attn_ledger.probes import catalogue

    fault = next(f for f in catalogue.CATALOGUE if f.name == "sinks-unused")
    row = catalogue.check_fault(fault)
    assert row.status == "pass" and (row.fields["level"], row.fields["check"]) == (4, "score_design")
    healthy = check_module(fault.target, catalogue.MODULE_EMBED_DIM, catalogue.MODULE_HEADS, seed=0)
    assert healthy.first_finding is None  # undeclared, the same layer passes: nothing claims it has sinks
