"""Mask relations, each by its exact allowed set, and each alignment where top-left and bottom-right differ."""

from __future__ import annotations

import pytest
import torch

from attn_ledger.maths import masks
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import ledger_on_qkv, run_ledger
from attn_ledger.render.notes import note_text, notes_text, relation_picture


def allowed_set(t: torch.Tensor) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in torch.nonzero(t)}


def test_causal_square_alignments_agree_and_match_the_lower_triangle():
    tl, br = masks.causal(5, 5, "top-left"), masks.causal(5, 5, "bottom-right")
    assert torch.equal(tl, br)
    assert torch.equal(tl, torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(~tl, torch.ones(5, 5, dtype=torch.bool).triu(diagonal=1))


@pytest.mark.parametrize("tq,tk", [(2, 6), (1, 4), (3, 7)])
def test_decode_shapes_alignments_differ(tq, tk):
    br = masks.causal(tq, tk, "bottom-right")
    tl = masks.causal(tq, tk, "top-left")
    assert allowed_set(br) == {(i, j) for i in range(tq) for j in range(tk) if j <= i + tk - tq}
    assert allowed_set(tl) == {(i, j) for i in range(tq) for j in range(tk) if j <= i}
    assert not torch.equal(br, tl)
    assert br[-1].all()  # the last query sees every key in a decode step


def test_tall_shapes_bottom_right_blocks_early_queries():
    br = masks.causal(5, 3, "bottom-right")  # Tq > Tk: the first Tq - Tk queries see nothing
    assert br.sum(-1).tolist() == [0, 0, 1, 2, 3]
    assert masks.causal(5, 3, "top-left").sum(-1).tolist() == [1, 2, 3, 3, 3]


def test_blocks_of_rows_equal_slices_of_the_whole():
    whole = masks.causal(7, 9)
    assert torch.equal(masks.causal(7, 9, q0=2, q1=5), whole[2:5])
    assert torch.equal(masks.sliding_window(7, 9, 3, q0=4, q1=7), masks.sliding_window(7, 9, 3)[4:7])


@pytest.mark.parametrize("tq,tk", [(1, 1), (3, 3), (3, 8), (8, 3), (6, 6)])
def test_every_block_of_every_relation_matches_its_definition(tq, tk):
    """Each row block (q0..q1) of each relation holds exactly the pairs its rule names."""
    def want(rule, q0, q1):
        return {(i - q0, j) for i in range(q0, q1) for j in range(tk) if rule(i, j)}

    for q0 in range(tq):
        for q1 in range(q0 + 1, tq + 1):
            for align, off in (("bottom-right", tk - tq), ("top-left", 0)):
                got = masks.causal(tq, tk, align, q0, q1)
                assert allowed_set(got) == want(lambda i, j: j <= i + off, q0, q1), (align, q0, q1)
            for w in (1, 2, 5):
                got = masks.sliding_window(tq, tk, w, q0, q1)
                assert allowed_set(got) == want(lambda i, j: i + tk - tq - w < j <= i + tk - tq, q0, q1), (w, q0, q1)
            for p in (0, 2, 9):
                got = masks.prefix_lm(tq, tk, p, q0, q1)
                assert allowed_set(got) == want(lambda i, j: j < p or j <= i + tk - tq, q0, q1), (p, q0, q1)


def test_sliding_window():
    w = masks.sliding_window(5, 5, 2)
    assert allowed_set(w) == {(i, j) for i in range(5) for j in range(5) if i - 2 < j <= i}
    assert w.sum(-1).tolist() == [1, 2, 2, 2, 2]


def test_prefix_lm():
    p = masks.prefix_lm(5, 5, 2)
    assert allowed_set(p) == {(i, j) for i in range(5) for j in range(5) if j < 2 or j <= i}
    assert p[0].tolist() == [True, True, False, False, False]


def test_segments():
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    s = masks.segments(ids, ids)  # [1, 1, T, T]
    assert s.shape == (1, 1, 5, 5)
    assert allowed_set(s[0, 0]) == {(i, j) for i in range(5) for j in range(5) if (i < 2) == (j < 2)}


def test_key_padding_is_placed_on_named_axes():
    valid = masks.valid_from_lengths([4, 2], 4)
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert masks.key_padding(valid).shape == (2, 1, 1, 4)
    left = masks.valid_from_lengths([4, 2], 4, side="left")
    assert left.tolist() == [[True] * 4, [False, False, True, True]]


def test_expand_to_grid_by_named_axes_and_rejects_mismatches():
    from attn_ledger.errors import InputError

    assert masks.expand_to_grid(torch.ones(3, 4, dtype=torch.bool), 2, 5, 3, 4).shape == (1, 1, 3, 4)
    assert masks.expand_to_grid(torch.ones(2, 3, 4, dtype=torch.bool), 2, 5, 3, 4).shape == (2, 1, 3, 4)
    assert masks.expand_to_grid(torch.ones(2, 5, 3, 4, dtype=torch.bool), 2, 5, 3, 4).shape == (2, 5, 3, 4)
    for bad in ((4, 3), (3, 3, 4), (2, 1, 3, 4)):
        with pytest.raises(InputError, match="allow_mask"):
            masks.expand_to_grid(torch.ones(*bad, dtype=torch.bool), 2, 5, 3, 4)


def test_api_conversions_name_the_destination():
    allow = masks.causal(3, 3)
    assert torch.equal(masks.to_sdpa_bool(allow), allow)
    assert torch.equal(masks.to_mha_bool(allow), ~allow)


def test_picture_has_queries_as_rows():
    pic = relation_picture(masks.causal(2, 4, "bottom-right").tolist())
    lines = pic.splitlines()
    assert lines[0].split() == ["k0", "k1", "k2", "k3"]
    assert lines[1].split() == ["q0", "1", "1", "1", "."]


def test_the_picture_is_drawn_up_to_16_queries_and_keys():
    assert "masked_scores" not in {r.name for r in run_ledger(load_config(overrides={"seq_len": 17})).rows
                                   if r.note}
    assert note_text(run_ledger(load_config(overrides={"seq_len": 16})).row("masked_scores").note).count("\n") == 17


# --- through the ledger --------------------------------------------------------------------

@pytest.mark.parametrize("mask,extra,want", [
    ("causal", {}, lambda i, j: j <= i + 4),
    ("causal-top-left", {}, lambda i, j: j <= i),
    ("sliding-window", {"window": 3}, lambda i, j: i + 4 - 3 < j <= i + 4),
    ("prefix-lm", {"prefix_len": 2}, lambda i, j: j < 2 or j <= i + 4),
    ("padding", {"valid_lengths": [7, 5]}, lambda i, j: j < 7),
])
def test_each_relation_reaches_the_score_grid(mask, extra, want):
    led = run_ledger(load_config(overrides={"mask": mask, "query_len": 3, "key_len": 7, "keep_grids": True, **extra}))
    assert led.first_finding is None, led.first_finding
    got = torch.isfinite(led.tensors["masked_scores"][0, 0])  # batch 0, head 0
    assert allowed_set(got) == {(i, j) for i in range(3) for j in range(7) if want(i, j)}
    forbidden = ~got
    assert (led.tensors["weights"][0, 0][forbidden] == 0).all()


def test_relations_combine_by_and():
    led = run_ledger(load_config(overrides={"mask": "causal+padding", "valid_lengths": [5, 3], "keep_grids": True}))
    got = torch.isfinite(led.tensors["masked_scores"][1, 0])
    assert allowed_set(got) == {(i, j) for i in range(5) for j in range(5) if j <= i and j < 3}
    assert any("[1, 2, 3, 4, 5]" in n for n in notes_text(led))


def test_segments_through_the_ledger():
    led = run_ledger(load_config(overrides={"mask": "segments", "segment_lengths": [2, 3], "keep_grids": True}))
    got = torch.isfinite(led.tensors["masked_scores"][0, 0])
    assert allowed_set(got) == {(i, j) for i in range(5) for j in range(5) if (i < 2) == (j < 2)}


def test_top_left_mask_in_a_decode_step_is_named_and_diverges_from_bottom_right_output():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    tl = masks.causal(2, 6, "top-left")
    br = masks.causal(2, 6, "bottom-right")
    led = ledger_on_qkv(q, k, v, allow_mask=tl)
    assert any("top-left" in n for n in notes_text(led))
    led = ledger_on_qkv(q, k, v, allow_mask=br)
    assert any("bottom-right" in n for n in notes_text(led))
    # an output computed top-left, judged against the bottom-right relation, fails at L4
    import torch.nn.functional as F

    out_tl = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA's own is_causal is top-left
    d = ledger_on_qkv(q, k, v, mask="causal", out=out_tl).first_finding
    assert (d.row, d.level) == ("context", 4)
    out_br = F.scaled_dot_product_attention(q, k, v, attn_mask=br)
    assert ledger_on_qkv(q, k, v, mask="causal", out=out_br).first_finding is None


def test_config_rejects_inconsistent_relations():
    from attn_ledger.errors import ConfigError

    for over, needle in (
        ({"mask": "causal+causal-top-left"}, "one causal alignment"),
        ({"mask": "none+causal"}, "'none' alone"),
        ({"mask": "sliding-window"}, "window"),
        ({"mask": "prefix-lm"}, "prefix_len"),
        ({"mask": "segments", "segment_lengths": [2, 2]}, "segment_lengths"),
        ({"mask": "padding", "valid_lengths": [9, 1]}, "valid_lengths"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(overrides=over)
