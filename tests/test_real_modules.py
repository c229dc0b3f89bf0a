"""check --module on attention from a widely used package: Hugging Face transformers' own layers.

Each model is built from a tiny config with random weights, one layer deep, and fed through
``inputs_embeds`` so the module protocol ``[B, T, E] -> [B, T, E]`` holds while the layer's
own code builds its own masks and rotary tables (factories in ``tests/real_models.py``). The
word embedding is unused on that path and frozen, so it is not reported as a parameter without
a gradient. The decode tests run each model's own cache (``DynamicCache``) through
``check --module --decode``.

Skipped when transformers is absent (``pip install -e '.[real]'`` installs it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers", minversion="4.48")

from attn_ledger.probes.module.check import check_module  # noqa: E402
from attn_ledger.report import Report  # noqa: E402
import real_models  # noqa: E402
from attn_ledger.cli import app  # noqa: E402
from real_models import bert, gpt2, gpt_neox, llama, mistral  # noqa: E402

E, NH = 32, 4  # Dh = 8
runner = CliRunner()


@pytest.fixture(autouse=True)
def quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


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


# --- Gemma 2's soft-capped logits ------------------------------------------------------------------

GEMMA2 = [(0.02, "default init"), (0.1, "larger weights")]  # scores far below the cap of 50 either way


@pytest.mark.parametrize("init", [g[0] for g in GEMMA2], ids=[g[1] for g in GEMMA2])
def test_gemma2_passes_with_its_cap_declared_and_names_it_undeclared(init):
    make = real_models.gemma2("eager", initializer_range=init)
    declared = check_module(make, E, NH, scale=real_models.GEMMA2_SCALE, softcap=50)
    assert declared.exit_code == 0, declared.failures()
    assert [(r, c.name) for r, c in declared.checks() if c.status != "pass"] == []
    assert check(declared, "attention_core").data["bent"]["delta"] <= check(declared, "attention_core").limit
    undeclared = check_module(make, E, NH, scale=real_models.GEMMA2_SCALE)
    assert undeclared.exit_code == 0, undeclared.failures()
    assert [(r, c.name) for r, c in undeclared.checks() if c.status != "pass"] == []
    design = check(undeclared, "score_design")
    assert design.data["design"] == "soft-capping" and design.data["caps"] == pytest.approx([50.0] * NH, rel=1e-3)
    assert [(h.kind, h.data["option"]) for h in undeclared.hints] == [("declare_softcap", "--softcap 50")]


def test_gemma2_with_its_cap_dropped_fails_when_the_cap_is_declared():
    report = check_module(real_models.gemma2_cap_dropped, E, NH, scale=real_models.GEMMA2_SCALE, softcap=50)
    first = report.first_finding
    assert report.exit_code == 1 and (first.row, first.name) == ("core", "score_design")
    assert "the declared --softcap 50 is not applied" in first.check.reason
    core = check(report, "attention_core")
    assert core.status == "fail" and core.data["explained_by"] == ["score_design"]
    # on the draw alone the cap changes the context by less than float32 noise: only the probe shows it
    assert core.data["draw"]["delta"] <= core.data["draw"]["tolerance"]


def test_gemma2_from_the_command_line():
    base = ["check", "--module", "", "--embed-dim", str(E), "--heads", str(NH), "--scale",
            repr(real_models.GEMMA2_SCALE), "--softcap", "50", "--format", "json"]
    for factory, code in (("gemma2_softcap", 0), ("gemma2_cap_dropped", 1)):
        base[2] = f"{MODELS}:{factory}"
        res = runner.invoke(app, base)
        assert res.exit_code == code, res.output
        doc = json.loads(res.stdout)
        assert doc["details"]["softcap"] == 50.0
        assert (doc["first_finding"] or {}).get("check") == (None if code == 0 else "score_design")


# --- KV-cache decode with transformers' own cache --------------------------------------------------

DECODE_SCENARIOS = ("decode_tokens", "decode_chunks", "decode_prefill_5", "decode_prefill_17", "decode_two_sequences")
FIRST_CACHED = {"decode_tokens": 1, "decode_chunks": 3, "decode_prefill_5": 5, "decode_prefill_17": 17,
                "decode_two_sequences": 1}  # the first position decoded over a cache in each scenario
MODELS = str(Path(real_models.__file__))


def test_llama_decode_with_its_cache_passes_from_the_command_line():
    # rotary (half-split), grouped-query kv heads, SDPA: DynamicCache, position_ids from its length
    res = runner.invoke(app, ["check", "--module", f"{MODELS}:llama_decode", "--decode",
                              f"{MODELS}:decode_transformers", "--embed-dim", str(E), "--heads", str(NH),
                              "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["first_finding"] is None
    decoded = {r["name"]: r for r in doc["rows"] if r["name"].startswith("decode_")}
    assert list(decoded) == list(DECODE_SCENARIOS)
    for row in decoded.values():
        parity = next(c for c in row["checks"] if c["name"] == "decode_parity")
        assert parity["status"] == "pass" and parity["value"] <= parity["limit"]
        assert parity["data"]["bad_positions"] == 0
    assert [r["name"] for r in doc["rows"] if r["status"] != "pass"] == []


def test_gpt2_decode_with_its_cache_passes_with_zero_findings():
    report = check_module(real_models.gpt2_decode, E, NH, decode=real_models.decode_transformers)
    assert report.exit_code == 0 and report.first_finding is None
    assert [(r, c.name) for r, c in report.checks() if c.status in ("fail", "warn")] == []
    for name in DECODE_SCENARIOS:
        parity = report.check(name, "decode_parity")
        assert parity.status == "pass" and parity.data["bad_positions"] == 0


@pytest.mark.parametrize("factory, decode, restarting, offset", [
    ("llama_decode", "decode_transformers_off_by_one", False, 1),
    ("llama_decode", "decode_transformers_positions_restart", True, None),
    ("gpt2_decode", "decode_transformers_positions_restart", True, None),
], ids=["llama-position-ids-off-by-one", "llama-position-ids-restarting", "gpt2-position-ids-restarting"])
def test_wrong_position_ids_over_a_real_cache_are_positions_offset(factory, decode, restarting, offset):
    report = check_module(getattr(real_models, factory), E, NH, decode=getattr(real_models, decode))
    assert report.exit_code == 1 and report.first_finding.row == "decode_tokens"
    # the module's own checks still pass: the bug is in the decode path only
    assert [r for r, c in report.checks() if c.status == "fail" and not r.startswith("decode_")] == []
    for name, first in FIRST_CACHED.items():
        parity = report.check(name, "decode_parity")
        assert parity.status == "fail" and parity.value > parity.limit, name
        assert parity.location["position"] == first and parity.location["chunk"] == 1
        assert parity.data["diagnosis"] == "positions_offset" and parity.data["diagnosed_by"] == "observed q and k"
        evidence = parity.data["evidence"]
        assert evidence["restarting"] is restarting
        size = parity.location["chunk_size"]
        want = list(range(size)) if restarting else [first + offset + i for i in range(size)]
        assert evidence["query_positions"] == want and evidence["expected_query_positions"][0] == first
    if factory == "llama_decode":
        encoding = report.check("decode_tokens", "decode_parity").data["evidence"]["position_encoding"]
        assert encoding == {"kind": "rotary", "pairing": "half", "base": 10000.0, "rotated_dim": 8, "head_dim": 8}
