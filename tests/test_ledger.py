"""The ledger on the built-in pipeline and on saved tensors: stages, checks, faults, seed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import config_stages, ledger_on_qkv, run_ledger, run_ledger_tensors, tensor_stages
from attn_ledger.render.notes import note_text, notes_text

# The table: where each deliberate fault must first be caught (stage, highest allowed level).
FAULT_TABLE = [
    ("split-reshape", {}, "head_roundtrip", 2),
    ("merge-reshape", {}, "head_roundtrip", 2),
    ("k-transpose", {}, "scores", 1),
    ("k-transpose", {"num_heads": 4, "embed_dim": 16, "seq_len": 4}, "scores", 4),  # Nh == T == Dh: no raise
    ("softmax-axis", {}, "weights", 3),
    ("no-scale", {}, "scores", 4),
    ("mask-polarity", {}, "masked_scores", 3),
]


def ledger(**overrides):
    return run_ledger(load_config(overrides=overrides))


def test_default_is_healthy_and_every_check_holds():
    led = ledger()
    assert led.first_finding is None
    assert led.verdict == "pass" and led.exit_code == 0
    assert [r.name for r in led.rows] == list(config_stages())
    for row in led.rows:
        assert row.status == "pass"
        assert row.checks or row.name == "input", row.name  # the input row states what was validated
        assert all(c.status == "pass" for c in row.checks), row.name


@pytest.mark.parametrize("fault,extra,stage,max_level", FAULT_TABLE, ids=[f"{f}{'-square' if e else ''}" for f, e, _, _ in FAULT_TABLE])
def test_fault_is_caught_where_the_table_says(fault, extra, stage, max_level):
    led = ledger(fault=fault, **extra)
    d = led.first_finding
    assert d is not None and d.row == stage and d.level <= max_level
    assert led.exit_code == 1
    after = [r for r in led.rows[[r.name for r in led.rows].index(stage) + 1:]]
    assert all(r.status == "not_reached" for r in after)
    assert all(c.status == "not_reached" for r in after for c in r.checks)


def test_mask_after_softmax_is_caught_at_masked_scores_or_weights():
    d = ledger(fault="mask-after-softmax").first_finding
    assert (d.row, d.level) in {("masked_scores", 3), ("weights", 3)}


def test_raising_stage_is_level_one_with_the_error_in_detail():
    led = ledger(fault="k-transpose")
    d = led.first_finding
    assert d.name == "computes" and d.check.data["exception"] == "RuntimeError" and "size" in d.check.data["message"]
    assert led.row("masked_scores").status == "not_reached"


def test_detection_does_not_depend_on_the_fault_name(monkeypatch):
    """The same broken function under no fault name is still caught: checks look at tensors only."""
    import attn_ledger.maths.pipeline as P

    broken = P.ops_for("softmax-axis")
    monkeypatch.setattr(P, "HEALTHY", broken)
    monkeypatch.setattr(P, "ops_for", lambda fault: broken)
    d = ledger().first_finding
    assert (d.row, d.level, d.name) == ("weights", 3, "key_row_sums")


# Each check failing on a case built to break it (keep_going so later rows are judged too).
FAILING = [
    ("split-reshape", {}, "head_roundtrip", "roundtrip_exact"),
    ("split-reshape", {}, "head_roundtrip", "split_head_slices"),
    ("merge-reshape", {}, "head_roundtrip", "merge_head_slices"),
    ("split-reshape", {}, "q", "matches_reference"),
    ("split-reshape", {}, "k", "matches_reference"),
    ("split-reshape", {}, "v", "matches_reference"),
    ("k-transpose", {}, "scores", "computes"),
    ("no-scale", {}, "scores", "matches_reference"),
    ("mask-polarity", {}, "masked_scores", "no_fully_blocked_query"),
    ("mask-polarity", {}, "masked_scores", "allowed_kept"),
    ("mask-after-softmax", {}, "masked_scores", "forbidden_excluded"),
    ("mask-polarity", {}, "weights", "finite"),
    ("mask-polarity", {}, "weights", "forbidden_weight"),
    ("softmax-axis", {}, "weights", "key_row_sums"),
    ("softmax-axis", {}, "weights", "matches_reference"),
    ("softmax-axis", {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"}, "weights", "empty_rows_zero"),
    ("mask-polarity", {}, "context", "finite"),
    ("no-scale", {}, "context", "matches_reference"),
    ("no-scale", {}, "context", "matches_sdpa"),
    ("merge-reshape", {}, "merged", "merge_head_slices"),
    ("merge-reshape", {}, "merged", "matches_reference"),
    ("no-scale", {}, "output", "matches_reference"),
    ("no-scale", {}, "output", "matches_sdpa"),
    ("mask-polarity", {}, "output", "finite"),
]


@pytest.mark.parametrize("fault,extra,stage,check", FAILING, ids=[f"{s}.{c}<-{f}" for f, _, s, c in FAILING])
def test_check_fails_on_a_case_built_to_break_it(fault, extra, stage, check):
    led = run_ledger(load_config(overrides={"fault": fault, **extra}), keep_going=True)
    c = led.check(stage, check)
    # the first failing stage's checks fail; later stages' failures are downstream evidence
    assert c.status == ("fail" if stage == led.first_finding.row else "downstream"), c
    healthy = run_ledger(load_config(overrides=extra), keep_going=True)
    if check == "computes":  # only a stage that raised carries this check
        assert all(c.name != "computes" for r in healthy.rows for c in r.checks)
    else:
        assert healthy.check(stage, check).status == "pass"


def test_keep_going_marks_later_failures_downstream():
    led = run_ledger(load_config(overrides={"fault": "mask-polarity"}), keep_going=True)
    statuses = {r.name: r.status for r in led.rows}
    assert statuses["masked_scores"] == "fail"
    assert statuses["weights"] == "downstream" and statuses["context"] == "downstream"
    assert led.first_finding.row == "masked_scores"


def test_lowest_failing_level_of_a_stage_is_reported():
    led = run_ledger(load_config(overrides={"fault": "split-reshape"}), keep_going=True)
    q_row = led.row("q")
    levels = sorted(c.level for c in q_row.checks if c.status == "downstream")
    assert levels == [4]
    # masked_scores under mask-polarity fails three L3 checks; the reported one is L3 and the first listed
    d = ledger(fault="mask-polarity").first_finding
    assert d.level == 3 and d.name == "no_fully_blocked_query"


@pytest.mark.parametrize(
    "overrides",
    [
        {"mask": "none"},
        {"mask": "causal", "query_len": 3, "key_len": 7},
        {"mask": "causal-top-left", "query_len": 3, "key_len": 7},
        {"mask": "padding", "valid_lengths": [5, 2]},
        {"mask": "causal+padding", "valid_lengths": [5, 3]},
        {"mask": "sliding-window", "window": 2},
        {"mask": "prefix-lm", "prefix_len": 2},
        {"mask": "segments", "segment_lengths": [2, 3]},
        {"num_heads": 4, "embed_dim": 16, "num_kv_heads": 2},
        {"num_heads": 4, "embed_dim": 16, "num_kv_heads": 1},
        {"value_dim": 3},
        {"dtype": "float64"},
        {"input": "arange"},
        {"batch_size": 1, "seq_len": 1},
        {"batch_size": 0},
        {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_healthy_variants_pass(overrides):
    led = ledger(**overrides)
    assert led.first_finding is None, led.first_finding


def test_fully_blocked_rows_fail_unless_declared():
    d = ledger(mask="padding", valid_lengths=[5, 0]).first_finding
    assert (d.row, d.name) == ("masked_scores", "no_fully_blocked_query")
    assert ledger(mask="padding", valid_lengths=[5, 0], empty_rows="zeros").first_finding is None


def test_cross_attention_uses_bottom_right_causal():
    led = ledger(mask="causal", query_len=3, key_len=7, keep_grids=True)
    allowed = torch.isfinite(led.tensors["masked_scores"][0, 0])
    expected = torch.tensor([[j <= i + 4 for j in range(7)] for i in range(3)])
    assert torch.equal(allowed, expected)
    assert any("[5, 6, 7]" in n for n in notes_text(led))


def test_gqa_pairing_probe_runs_and_reports_pairs():
    led = ledger(num_heads=4, embed_dim=16, num_kv_heads=2)
    c = led.check("k", "kv_head_pairing")
    assert c.status == "pass" and c.data["read"] == [0, 0, 1, 1]


def test_mask_row_shows_counts_and_picture():
    led = ledger()
    assert "q4     1   1   1   1   1" in note_text(led.row("masked_scores").note)
    assert "allowed keys per query (b=0, h=0): [1, 2, 3, 4, 5]" in notes_text(led)


# --- tensors mode -------------------------------------------------------------------------

def seed000():
    q = torch.tensor([[[0.0, 3.0], [2.0, -1.0]]], dtype=torch.float64)
    k = torch.tensor([[[3.0, 0.0], [-1.0, 2.0]]], dtype=torch.float64)
    v = torch.tensor([[[3.0, -3.0], [1.0, 3.0]]], dtype=torch.float64)
    return q, k, v


def test_seed000_fixture_reproduces_the_worked_numbers():
    led = run_ledger_tensors("fixtures/tensors/seed000.safetensors")
    assert led.first_finding is None
    assert [r.name for r in led.rows] == list(tensor_stages())
    w = led.tensors["weights"][0, 0]
    out = led.tensors["context"][0, 0]
    assert torch.allclose(w, torch.tensor([[0.014166, 0.985834], [0.999151, 0.000849]], dtype=w.dtype), atol=1e-6)
    assert torch.allclose(out, torch.tensor([[1.028332, 2.915004], [2.998303, -2.994908]], dtype=out.dtype), atol=1e-6)
    scores = led.tensors["scores"][0, 0]
    assert torch.allclose(scores, torch.tensor([[0.0, 4.242641], [4.242641, -2.828427]], dtype=scores.dtype), atol=1e-6)
    assert "[[0.014166, 0.985834], [0.999151, 0.000849]]" in note_text(led.row("weights").note)
    assert "[[1.028332, 2.915004], [2.998303, -2.994908]]" in note_text(led.row("context").note)


def test_seed000_boundaries():
    q, k, v = seed000()
    # one token: its only key gets weight one and the output is its value
    led = ledger_on_qkv(q[:, :1], k[:, :1], torch.tensor([[[5.0, -2.0]]], dtype=torch.float64))
    assert torch.equal(led.tensors["weights"][0, 0], torch.ones(1, 1, dtype=torch.float64))
    assert torch.allclose(led.tensors["context"][0, 0], torch.tensor([[5.0, -2.0]], dtype=torch.float64))
    # equal keys give uniform rows
    led = ledger_on_qkv(q, torch.ones(1, 2, 2, dtype=torch.float64), v)
    assert torch.allclose(led.tensors["weights"][0, 0], torch.full((2, 2), 0.5, dtype=torch.float64))
    # Dv != Dh: values [1, 2, 1] give output [1, 2, 1]
    led = ledger_on_qkv(q, k, v[..., :1])
    assert led.first_finding is None and led.row("context").shape == (1, 1, 2, 1)
    # empty batch
    led = ledger_on_qkv(torch.zeros(0, 2, 2), torch.zeros(0, 2, 2), torch.zeros(0, 2, 3))
    assert led.first_finding is None and led.row("context").shape == (0, 1, 2, 3)
    # joint permutation of positions permutes the output rows
    perm = torch.tensor([1, 0])
    a = ledger_on_qkv(q, k, v).tensors["context"][0, 0]
    b = ledger_on_qkv(q[:, perm], k[:, perm], v[:, perm]).tensors["context"][0, 0]
    assert torch.allclose(a[perm], b)


def test_user_intermediates_are_compared_stage_by_stage():
    led = run_ledger_tensors("fixtures/tensors/seed000_wrong_axis.pt")
    d = led.first_finding
    assert (d.row, d.level, d.name) == ("weights", 3, "user_weights_key_row_sums")
    assert led.check("scores", "user_scores_matches_reference").status == "pass"


def test_user_out_with_top_left_decode_mask_fails_at_context_level_4():
    led = run_ledger_tensors("fixtures/tensors/decode_topleft_out.safetensors")
    d = led.first_finding
    assert (d.row, d.level, d.name) == ("context", 4, "user_out_matches_reference")
    assert any("bottom-right" in n for n in notes_text(led))


def test_user_checks_pass_on_correct_intermediates():
    q, k, v = seed000()
    s = q @ k.transpose(-2, -1) / math.sqrt(2)
    w = torch.softmax(s, -1)
    led = ledger_on_qkv(q, k, v, scores=s, weights=w, out=w @ v)
    assert led.first_finding is None
    names = [c.name for r in led.rows for c in r.checks if c.name.startswith("user_")]
    assert {"user_scores_matches_reference", "user_weights_key_row_sums", "user_out_matches_reference"} <= set(names)


def test_user_intermediate_with_wrong_shape_is_a_level_one_finding():
    q, k, v = seed000()
    led = ledger_on_qkv(q, k, v, weights=torch.zeros(1, 3, 2, dtype=torch.float64))
    d = led.first_finding
    assert (d.row, d.level, d.name) == ("weights", 1, "user_weights_shape")


def test_user_out_outside_value_range_fails():
    q, k, v = seed000()
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(2), -1)
    led = ledger_on_qkv(q, k, v, out=(w @ v) * 2, keep_going=True)
    assert led.check("context", "user_out_in_value_range").status == "fail"
    assert led.check("context", "user_out_matches_reference").status == "fail"


def test_user_weights_on_forbidden_keys_fail():
    q, k, v = seed000()
    allow = torch.tensor([[True, False], [True, True]])
    led = ledger_on_qkv(q, k, v, allow_mask=allow, weights=torch.full((1, 2, 2), 0.5, dtype=torch.float64), keep_going=True)
    assert led.check("weights", "user_weights_forbidden_weight").status == "fail"
    assert led.check("weights", "forbidden_weight").status == "pass"


def test_saved_masks_are_placed_by_named_axes():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g) for _ in range(3))
    allow_b = torch.ones(2, 4, 4, dtype=torch.bool).tril()  # [B, Tq, Tk]
    allow_b[1, :, 3] = False
    led = ledger_on_qkv(q, k, v, allow_mask=allow_b, keep_grids=True)
    assert led.first_finding is None
    m = led.tensors["masked_scores"]
    assert torch.isneginf(m[1, :, :, 3]).all() and not torch.isneginf(m[0, :, 3, 3]).any()
    key_valid = torch.tensor([[True] * 4, [True, True, False, False]])
    led = ledger_on_qkv(q, k, v, key_valid=key_valid, keep_grids=True)
    assert torch.isneginf(led.tensors["masked_scores"][1, :, :, 2:]).all()
    assert (led.tensors["weights"][1, :, :, 2:] == 0).all()


def test_saved_mask_alignment_is_named():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 1, 2, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g)
    tl = torch.ones(2, 5, dtype=torch.bool).tril()
    led = ledger_on_qkv(q, k, v, allow_mask=tl)
    assert any("top-left" in n for n in notes_text(led))


def test_tensor_mode_causal_relation_by_name():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    led = ledger_on_qkv(q, k, v, mask="causal", keep_grids=True)
    assert led.first_finding is None
    assert torch.isneginf(led.tensors["masked_scores"][0, 0, 0, 1:]).all()


def test_overflowing_half_scores_are_non_finite_at_scores():
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 4, 8, generator=g) * 300).half()
    k = (torch.randn(1, 4, 8, generator=g) * 300).half()
    v = torch.randn(1, 4, 8, generator=g).half()
    led = ledger_on_qkv(q, k, v)
    d = led.first_finding
    assert (d.row, d.level, d.name) == ("scores", 3, "finite")
    assert any(c.name == "exp_headroom" for _, c in led.warnings())


def test_masked_scores_finite_check_fails_on_nan_scores():
    q, k, v = seed000()
    bad = torch.tensor([[[float("nan"), 0.0], [0.0, 0.0]]], dtype=torch.float64)
    led = ledger_on_qkv(q, k, v, scores=bad, keep_going=True)
    assert led.check("scores", "user_scores_matches_reference").status == "fail"


@pytest.mark.parametrize("stage,field", [("masked_scores", "mask"), ("weights", "softmax"), ("context", "mix")])
def test_streamed_stage_with_a_wrong_shape_fails_its_shape_check(monkeypatch, stage, field):
    """A stage function that returns a tensor of another shape (which could broadcast) is an L1 divergence there."""
    import dataclasses

    import attn_ledger.maths.pipeline as P

    wrong = {
        "mask": lambda scores, allow: P.apply_mask(scores, allow)[:, :1],  # drops all heads but one
        "softmax": lambda masked, allow, zero: P.softmax_keys(masked, allow, zero)[..., :1, :],  # one query row
        "mix": lambda w, v: P.mix_values(w, v)[..., :1],  # one value coordinate
    }[field]
    broken = dataclasses.replace(P.HEALTHY, **{field: wrong})
    monkeypatch.setattr(P, "ops_for", lambda fault: broken)
    d = ledger().first_finding
    assert (d.row, d.level, d.name) == (stage, 1, "shape")
    assert ledger().row(stage).status == "fail"


def test_without_a_relation_the_exclusion_check_is_not_applicable_rather_than_passing():
    c = ledger(mask="none").check("masked_scores", "forbidden_excluded")
    assert c.status == "not_applicable"
    assert ledger(mask="none").first_finding is None


@pytest.mark.parametrize("shape", [(3,), (2, 2, 4, 7), (2, 2, 4), (1, 2, 4, 8)], ids=str)
def test_saved_out_of_the_wrong_shape_is_a_level_one_finding(tmp_path, shape):
    """A given ``out`` that is not [B, Nh, Tq, Dv] is user_out_shape at context, exit 1 (never a pass)."""
    import json

    from typer.testing import CliRunner

    from attn_ledger.cli import app
    from attn_ledger.inputs.tensorio import save_tensor_file

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "qkv_out.safetensors"
    save_tensor_file({**{n: torch.randn(2, 2, 4, 8, generator=g) for n in ("q", "k", "v")}, "out": torch.zeros(shape)}, path)
    r = CliRunner().invoke(app, ["run", "--tensors", str(path), "--format", "json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)["first_finding"]
    assert (d["row"], d["level"], d["check"], d["status"]) == ("context", 1, "user_out_shape", "fail")
    led = run_ledger_tensors(str(path))
    c = led.check("context", "user_out_shape")
    assert c.status == "fail" and c.data["got"] == list(shape) and c.data["expected"] == [2, 2, 4, 8]
    assert led.check("context", "matches_sdpa").status == "pass"  # the pipeline itself is healthy


def test_mask_picture_and_counts_follow_the_example_that_diverged(monkeypatch):
    """Padding differs by example; a softmax wrong only in example 1 shows example 1's relation."""
    import attn_ledger.maths.pipeline as P

    def wrong_in_example_1(masked, allow, empty_rows_zero):
        w = P.softmax_keys(masked, allow, empty_rows_zero).clone()
        w[1] *= 1.1
        return w

    monkeypatch.setattr(P, "ops_for", lambda fault: P.Ops(softmax=wrong_in_example_1))
    led = ledger(mask="causal+padding", valid_lengths=[5, 3])
    assert (led.first_finding.row, led.first_finding.name) == ("weights", "key_row_sums")
    assert led.first_finding.check.location["example"] == 1
    shown = led.details["relation_shown"]
    assert (shown["example"], shown["head"], shown["at_divergence"]) == (1, 0, True)
    assert shown["allowed_keys_per_query"] == [1, 2, 3, 3, 3]
    picture = note_text(led.row("masked_scores").note).splitlines()
    assert picture[-1].split() == ["q4", "1", "1", "1", ".", "."]  # keys 3 and 4 are padding in example 1


def test_mask_picture_stays_on_example_0_when_examples_agree_or_nothing_diverged():
    shown = ledger(mask="causal+padding", valid_lengths=[5, 3]).details["relation_shown"]
    assert (shown["example"], shown["at_divergence"], shown["allowed_keys_per_query"]) == (0, False, [1, 2, 3, 4, 5])
    shown = ledger(fault="softmax-axis").details["relation_shown"]  # causal: the same relation in every example
    assert (shown["example"], shown["head"], shown["at_divergence"]) == (0, 0, False)


def test_given_weights_wrong_in_one_example_show_that_examples_relation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 4, 8, generator=g) for _ in range(3))
    key_valid = torch.tensor([[True] * 4, [True, True, False, False]])
    w = torch.full((2, 1, 4, 4), 0.25)
    w[1] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    w[1, 0, 3] = torch.tensor([0.4, 0.4, 0.2, 0.0])  # example 1, query 3: weight on padded key 2
    led = ledger_on_qkv(q, k, v, key_valid=key_valid, weights=w)
    assert (led.first_finding.row, led.first_finding.name) == ("weights", "user_weights_forbidden_weight")
    assert led.first_finding.check.location == {"example": 1, "head": 0, "query": 3, "key": 2}
    shown = led.details["relation_shown"]
    assert (shown["example"], shown["allowed_keys_per_query"]) == (1, [2, 2, 2, 2])
