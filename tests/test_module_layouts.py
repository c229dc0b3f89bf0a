"""check --module on attention written in the layouts real code uses: each correct one passes with
zero findings, each planted bug is caught at the check and level that names it."""

from __future__ import annotations

import math

import pytest

import layout_modules as L
from attn_ledger.probes.module.check import check_module
from attn_ledger.report import Report

E, NH = 32, 4  # Dh = 8; the GQA modules use Nkv = 2


def run(factory, **kw) -> Report:
    return check_module(factory, E, NH, **kw)


def check(report: Report, name: str):
    return next(c for _, c in report.checks() if c.name == name)


def not_passing(report: Report) -> list:
    return [(row, c.name, c.status) for row, c in report.checks()
            if c.status not in ("pass", "not_applicable")]


CORRECT = [
    ("wq-wk-wv-wo", L.factory(L.WqWkWv), {}, "separate q, k, v projections, heads [Nh=4, Dh=8]"),
    ("baddbmm-flat-scores", L.factory(L.WqWkWv, flat_scores=True), {},
     "separate q, k, v projections, heads [Nh=4, Dh=8]"),
    ("to_qkv-chunked", L.factory(L.ToQKV), {"causal": False}, "fused q, k, v projection, chunked [3, Nh, Dh]"),
    ("query_key_value-interleaved", L.factory(L.QueryKeyValue), {},
     "fused q, k, v projection, per-head interleaved [Nh, 3, Dh]"),
    ("gpt2-conv1d", L.factory(L.GPT2Attention), {}, "fused q, k, v projection, chunked [3, Nh, Dh]"),
    ("multihead-attention", L.factory(L.MHACausal), {}, "fused q, k, v projection, chunked [3, Nh, Dh]"),
    ("gqa-narrow-kv", L.factory(L.GQAttention), {}, "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
    ("falcon-grouped", L.factory(L.FalconGrouped), {}, "fused q, k, v projection, grouped [Nkv, g + 2, Dh] with g = 2"),
    ("llama-rotary-half", L.factory(L.GQAttention, rotary="half"), {},
     "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
    ("rotary-interleaved", L.factory(L.GQAttention, rotary="interleaved"), {},
     "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
    ("partial-rotary", L.factory(L.GQAttention, rotary="half", rotary_dim=4), {},
     "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
    ("sdpa-enable-gqa", L.factory(L.GQAttention, rotary="interleaved", sdpa_gqa=True), {},
     "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
    ("mistral-window", L.factory(L.GQAttention, rotary="half", window=4), {"window": 4, "seq_len": 8},
     "separate q, k, v projections, heads [Nh=4, Nkv=2, Dh=8]"),
]


@pytest.mark.parametrize("factory, options, layout", [c[1:] for c in CORRECT], ids=[c[0] for c in CORRECT])
def test_correct_layout_passes_with_zero_findings(factory, options, layout):
    report = run(factory, **options)
    assert report.exit_code == 0 and report.first_finding is None, report.failures()
    assert not_passing(report) == []
    assert report.coverage is None
    assert report.details["layout"] == layout
    assert check(report, "attention_core").value <= check(report, "attention_core").limit
    scale = check(report, "effective_scale")
    assert math.isclose(scale.value, 1 / math.sqrt(8), rel_tol=1e-3) and scale.data["named"] == []
    relation = check(report, "mask_relation").data
    want = "sliding-window" if options.get("window") else "causal" if options.get("causal", True) else "bidirectional"
    assert relation["applied"] == want and relation["comparison"] == "same"


def test_rotary_is_named_on_a_correct_module():
    half = check(run(L.factory(L.GQAttention, rotary="half")), "rotary_positions")
    assert half.data["spec"] == {"pairing": "half", "base": 10000.0, "rotated_dim": 8, "head_dim": 8}
    inter = check(run(L.factory(L.GQAttention, rotary="interleaved")), "rotary_positions")
    assert inter.data["spec"]["pairing"] == "interleaved"
    partial = check(run(L.factory(L.GQAttention, rotary="half", rotary_dim=4)), "rotary_positions")
    assert partial.data["spec"]["rotated_dim"] == 4
    plain = check(run(L.factory(L.GQAttention)), "rotary_positions")
    assert plain.data["spec"] is None and plain.data["q"]["kind"] == "none"


def test_window_declared_is_named():
    report = run(L.factory(L.GQAttention, rotary="half", window=4), window=4, seq_len=8)
    relation = check(report, "mask_relation")
    assert relation.data["applied"] == "sliding-window" and relation.data["window"] == 4
    assert report.details["relation"] == "sliding window 4"


# --- the planted bugs ------------------------------------------------------------------------------

def test_scale_by_model_width_is_named_at_l4():
    report = run(L.factory(L.WqWkWv, scale="model"))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("core", 4, "effective_scale")
    assert first.check.data["named"] == ["1/sqrt(E)"]
    assert math.isclose(first.check.value, E ** -0.5, rel_tol=1e-3)
    assert first.check.limit == pytest.approx(8 ** -0.5)
    assert check(report, "attention_core").data["explained_by"] == ["effective_scale"]


def test_flat_scores_by_model_width_is_named_at_l4():
    # scores on [B*Nh, T, Dh], weights on [B, Nh, T, T]: the core is still observed and judged
    report = run(L.factory(L.WqWkWv, flat_scores=True, scale="model"))
    first = report.first_finding
    assert report.coverage is None and (first.row, first.level, first.name) == ("core", 4, "effective_scale")
    assert first.check.data["named"] == ["1/sqrt(E)"]


def test_fused_to_qkv_scaled_twice_is_named_at_l4():
    report = run(L.factory(L.ToQKV, twice=True), causal=False)
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("core", 4, "effective_scale")
    assert first.check.data["named"] == ["1/Dh"]
    assert math.isclose(first.check.value, 1 / 8, rel_tol=1e-3)
    # q was scaled before the scores: the factor is found from q's norms, not assumed
    assert math.isclose(first.check.data["qk_factor"], 8 ** -0.5, rel_tol=1e-5)


def test_interleaved_split_by_reshape_without_transpose_fails_head_split():
    report = run(L.factory(L.QueryKeyValue, no_transpose=True))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("axes", 2, "head_split")
    assert first.check.data["role"] == "q" and first.check.value > 0
    assert first.check.location == {"example": 0, "head": 0, "position": 1}
    # head 0 position 1 of the bad split holds position 0's second head: it came from another position
    assert first.check.data["source"]["position"] == 0 and first.check.data["source"]["projection"] == "query_key_value.weight"


def test_conv1d_without_causal_mask_fails_l4_causal_and_names_the_relation():
    report = run(L.factory(L.GPT2Attention, masked=False))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("core", 4, "mask_relation")  # the cause, over the leak
    assert check(report, "causal_intervention_no_grad").status == "fail"
    relation = check(report, "mask_relation")
    assert relation.status == "fail" and relation.data["applied"] == "bidirectional"
    assert relation.data["comparison"] == "wider" and relation.data["extra_pairs"] == 15  # T = 6: 6*5/2 future pairs


def test_multihead_attention_given_an_allow_mask_fails_l3_finite():
    report = run(L.factory(L.MHACausal, allow_polarity=True))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("numerics", 3, "finite_output")
    assert check(report, "causal_intervention_no_grad").status == "fail"
    relation = check(report, "mask_relation")
    assert relation.data["applied"] == "future-only" and relation.data["comparison"] == "different"


def test_gqa_pairing_by_repeat_fails_kv_pairing():
    report = run(L.factory(L.GQAttention, pairing="repeat"))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("axes", 2, "kv_pairing")
    assert first.check.data["expected"] == [0, 0, 1, 1] and first.check.data["k"] == [0, 1, 0, 1]
    assert first.check.value == 2 and first.check.location == {"head": 1}


ROTARY_BUGS = [(pairing, bug, finding) for pairing in ("half", "interleaved")
               for bug, finding in ((("rotate_v", True), "v_rotated"), (("k_offset", 3), "qk_offset"),
                                    (("only_q", True), "only_q_rotated"))]


@pytest.mark.parametrize("pairing, bug, finding", ROTARY_BUGS, ids=[f"{p}-{f}" for p, _, f in ROTARY_BUGS])
def test_rotary_bugs_fail_rotary_positions(pairing, bug, finding):
    report = run(L.factory(L.GQAttention, rotary=pairing, **dict([bug])))
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("core", 4, "rotary_positions")
    assert first.check.data["findings"] == [finding]
    assert first.check.data["q"]["spec"]["pairing"] == pairing  # the rotary is named
    if finding == "qk_offset":
        assert first.check.value == -3 and first.check.data["offset_between"] == -3
    # the core itself is consistent attention on what entered it
    assert check(report, "attention_core").status == "pass"


def test_mistral_window_off_by_one_fails_mask_relation_naming_it():
    report = run(L.factory(L.GQAttention, rotary="half", window=4, window_off_by_one=True), window=4, seq_len=8)
    first = report.first_finding
    assert (first.row, first.level, first.name) == ("core", 4, "mask_relation")
    data = first.check.data
    assert (data["applied"], data["window"], data["comparison"]) == ("sliding-window", 5, "wider")
    assert data["declared"] == "sliding window 4" and data["extra_pairs"] == 4  # queries 4..7 reach one key further
    assert first.check.location == {"example": 0, "head": 0, "query": 4, "key": 0}
    assert check(report, "rotary_positions").status == "pass"  # the rest of the module is right


def test_unobservable_core_says_black_box_coverage():
    report = run(L.factory(L.OpaqueCore))
    assert report.exit_code == 0
    assert report.coverage.scope == "black-box"
    assert set(report.coverage.missing) == {"head_split", "kv_pairing", "head_merge", "key_row_sums", "mask_relation",
                                            "effective_scale", "rotary_positions", "score_design", "attention_core"}
    assert "causal_attention" in report.coverage.reason
    assert {check(report, n).status for n in report.coverage.missing} == {"skipped"}
    assert report.details["layout"] is None and report.details["observed"] is None
