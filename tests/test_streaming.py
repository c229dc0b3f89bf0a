"""Streaming over query blocks: any block size gives the same first divergence and the same verdicts.

The grids here are larger than SMALL_GRID so the key hull, the mask band and the
value-chunk ranges are in play; block sizes 1 and 3 and the whole grid are compared.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_ledger.engine import checks as C
from attn_ledger import tolerance
from attn_ledger.inputs.config import load_config
from attn_ledger.engine import execute as X
from attn_ledger.engine import measure as M
from attn_ledger.engine import plan as PL
from attn_ledger.engine.judge import Tally
from attn_ledger.maths.relations import Relation
from attn_ledger.ledger import ledger_on_qkv, run_ledger
from attn_ledger.render.notes import notes_text

BASE = {"batch_size": 1, "seq_len": 190, "embed_dim": 16, "num_heads": 2}  # grid 72200 > SMALL_GRID
BLOCKS = [1, 3, None]

CASES = [
    ("healthy causal", {}),
    ("healthy sliding-window", {"mask": "sliding-window", "window": 7}),
    ("healthy causal+padding zeros", {"mask": "causal+padding", "valid_lengths": [150], "empty_rows": "zeros",
                                      "padding_side": "left"}),
    ("mask-polarity", {"fault": "mask-polarity"}),
    ("mask-after-softmax", {"fault": "mask-after-softmax"}),
    ("softmax-axis", {"fault": "softmax-axis"}),
    ("no-scale", {"fault": "no-scale"}),
]


def _verdicts(led) -> dict[tuple[str, str], bool | None]:
    return {(r.name, c.name): c.status for r in led.rows for c in r.checks}


def _first(led):
    d = led.first_finding
    return None if d is None else (d.row, d.level, d.name)


@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_block_size_does_not_change_the_diagnosis(name, extra):
    found = {}
    for bs in BLOCKS:
        led = run_ledger(load_config(overrides={**BASE, **extra, "block_size": bs}), keep_going=True)
        found[bs] = (_first(led), _verdicts(led), led.row("masked_scores").checks)
    first = {bs: f for bs, (f, _, _) in found.items()}
    assert len({f and f[:2] for f in first.values()}) == 1, first  # same stage and level
    assert (first[None] is None) == name.startswith("healthy")
    if name == "softmax-axis":
        # normalising over the query axis gives block-dependent weights: one-row blocks with a
        # fully excluded key come out NaN (finite fails) rather than summing wrongly over keys
        assert first[3] == first[None] == ("weights", 3, "key_row_sums") and first[1] == ("weights", 3, "finite")
        return
    assert len(set(first.values())) == 1, first
    assert found[1][1] == found[3][1] == found[None][1]
    if first[None] is None or name == "mask-polarity":  # the hull then spans the same keys at any block size
        counts = {bs: [(c.name, c.value) for c in checks if c.name != "shape"] for bs, (_, _, checks) in found.items()}
        assert counts[1] == counts[3] == counts[None]  # pair counts are exact, whatever the blocking


def test_block_choice_and_streaming_note():
    led = run_ledger(load_config(overrides={**BASE, "block_size": 3}))
    assert any(n.startswith("score-grid stages ran in 64 query blocks of 3 rows") for n in notes_text(led))
    led = run_ledger(load_config(overrides=BASE))  # above SMALL_GRID: at least MIN_BLOCKS even blocks
    assert any(n.startswith("score-grid stages ran in 4 query blocks of 48 rows") for n in notes_text(led))
    led = run_ledger(load_config(overrides={**BASE, "seq_len": 100}))  # 20000 entries: one block, kept whole
    assert not any("query blocks" in n for n in notes_text(led))
    assert PL.choose_blocks(1, 8, 8192, 8192, None)[:2] == [(0, 64), (64, 128)]  # BLOCK_TARGET entries a block
    assert PL.choose_blocks(1, 64, 8192, 8192, None)[:2] == [(0, 32), (32, 64)]  # MIN_BLOCK_ROWS


def _qkv(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def test_random_allow_mask_takes_the_exact_path_and_matches_whole_grid():
    """An irregular relation varies in every key column: counted pair by pair, same numbers."""
    q, k, v = _qkv((1, 2, 190, 8))
    g = torch.Generator().manual_seed(5)
    allow = torch.rand(190, 190, generator=g) < 0.7
    allow[:, 0] = True
    led = {bs: ledger_on_qkv(q, k, v, allow_mask=allow, block_size=bs) for bs in BLOCKS}
    assert all(x.first_finding is None for x in led.values())
    pairs = {bs: x.check("masked_scores", "forbidden_excluded").value for bs, x in led.items()}
    assert len(set(pairs.values())) == 1


def test_off_by_one_causal_relation_is_caught_at_any_block_size(monkeypatch):
    """The pipeline blocks the diagonal too (``triu(diagonal=0)`` for ``triu(diagonal=1)``).

    The pipeline's own relation then differs from the intended one in the key columns the
    mask runs on, so the dropped allowed pairs are counted exactly whatever the blocking.
    """
    import attn_ledger.maths.pipeline as P

    def drop_diagonal(allow):
        if allow is None:
            return None
        shifted = torch.zeros_like(allow)
        shifted[..., :-1] = allow[..., 1:]  # query i may use key j iff j + 1 <= i
        return shifted

    monkeypatch.setattr(P, "ops_for", lambda fault: P.Ops(polarity=drop_diagonal))
    for bs in BLOCKS:
        led = run_ledger(load_config(overrides={**BASE, "block_size": bs}), keep_going=True)
        c = led.check("masked_scores", "allowed_kept")
        assert (c.status, c.value) == ("fail", 2 * 190), bs  # Nh * Tq diagonal pairs
        assert _first(led)[:2] == ("masked_scores", 3)


def test_float64_reference_on_a_sample_of_blocks_is_noted(monkeypatch):
    monkeypatch.setattr(PL, "F64_BUDGET", 2 * 2 * 10 * 190)  # two blocks' worth
    monkeypatch.setattr(PL, "F64_SAMPLE", 2 * 2 * 10 * 190)
    q, k, v = _qkv((1, 2, 190, 8))
    led = ledger_on_qkv(q, k, v, mask="causal", block_size=10)
    assert led.first_finding is None
    note = next(n for n in notes_text(led) if n.startswith("float64 reference on a sample"))
    assert note.startswith("float64 reference on a sample of 18 of 190 query rows (rows 0..5, 94..99, 184..189)")
    assert note.endswith("SDPA on all rows")
    assert led.check("context", "matches_reference").status == "pass"


def test_sdpa_still_covers_every_block_when_float64_is_sampled(monkeypatch):
    """A wrong output in a block the float64 reference skips is still caught against SDPA."""
    import attn_ledger.maths.pipeline as P

    monkeypatch.setattr(PL, "F64_BUDGET", 2 * 2 * 10 * 190)
    monkeypatch.setattr(PL, "F64_SAMPLE", 2 * 2 * 10 * 190)

    def mix_wrong_in_block_5(w, v):
        out = P.mix_values(w, v)
        return out * 1.01 if w.shape[-1] == 60 else out  # block 5 (rows 50..59) has a 60-key hull

    monkeypatch.setattr(P, "ops_for", lambda fault: P.Ops(mix=mix_wrong_in_block_5))
    led = run_ledger(load_config(overrides={**BASE, "block_size": 10}), keep_going=True)
    assert led.check("context", "matches_sdpa").status == "fail"
    assert led.check("context", "matches_reference").status == "pass"  # rows 50..59 are not in the float64 sample


def test_sampled_blocks_include_first_and_last():
    blocks = [(i, i + 1) for i in range(100)]
    assert PL.sample_rows(blocks, 1, 1, 10) == {i: (0, 1) for i in range(100)}
    budget = PL.F64_SAMPLE
    big = [(i * 10, i * 10 + 10) for i in range(100)]
    picked = PL.sample_rows(big, 1, 1, budget // 30)
    assert min(picked) == 0 and max(picked) == 99 and 2 <= len(picked) <= PL.F64_SAMPLES
    assert picked[0][0] == 0 and picked[99][1] == 10  # first rows of the first block, last rows of the last


# --- the faster measurements equal the plain ones -------------------------------------

def test_excess_equals_checks_excess_error():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 4, 50, 60, generator=g)
    e = a.double() + 1e-3 * torch.randn(3, 4, 50, 60, generator=g, dtype=torch.float64)
    assert M.excess(a, e, 2e-5, 3e-5) == C.excess_error(a, e, 2e-5, 3e-5)
    e[0, 0, 0, 0] = math.nan
    got, want = M.excess(a, e, 2e-5, 3e-5), C.excess_error(a, e, 2e-5, 3e-5)
    assert all(math.isnan(x) for x in got + want)
    e64 = e.clone()
    M.excess(e64, e64 * 2, 0.0, 0.0)
    assert torch.equal(e64.nan_to_num(), e.nan_to_num())  # inputs are not changed in place


def test_group_sdpa_comparison_equals_block_by_block():
    g = torch.Generator().manual_seed(2)
    ctx = torch.randn(2, 3, 40, 8, generator=g)
    sd = ctx + 1e-5 * torch.randn(2, 3, 40, 8, generator=g)
    sd[:, :, 10:20] *= 5  # one block with a larger scale for atol
    blocks = [(0, 10), (10, 20), (20, 30), (30, 40)]
    grouped = Tally.of(M.sdpa_group(ctx, sd, blocks, 2e-5, 2e-5)).agreement("context", "pipeline", "sdpa")
    single = Tally.of(m for blk in blocks for m in M.sdpa_group(ctx, sd, [blk], 2e-5, 2e-5)).agreement(
        "context", "pipeline", "sdpa")
    assert grouped.diff == single.diff
    assert grouped.excess == pytest.approx(single.excess, rel=1e-12, abs=1e-15)


def test_value_span_from_chunks_equals_direct_min_max():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(1, 2, 1000, 5, generator=g)
    chunks = M.value_chunks(v)
    for lo, hi in [(0, 1000), (3, 997), (64, 128), (100, 101), (0, 200), (650, 999)]:
        got = M.value_span(v, chunks, lo, hi)
        assert torch.equal(got[0], v[:, :, lo:hi].amin(dim=-2, keepdim=True))
        assert torch.equal(got[1], v[:, :, lo:hi].amax(dim=-2, keepdim=True))


def test_single_row_blocks_keep_a_forbidden_key():
    """Blocks of one query row still see a key the relation forbids, so an unapplied mask is caught."""
    led = run_ledger(load_config(overrides={**BASE, "fault": "mask-after-softmax", "block_size": 1}))
    d = led.first_finding
    assert (d.row, d.name) == ("masked_scores", "forbidden_excluded")
    assert led.check("masked_scores", "forbidden_excluded").value == 2 * 189  # one forbidden key per row but the last


def test_band_is_where_the_relation_varies():
    causal = torch.ones(4, 10, dtype=torch.bool).tril(6)[None, None]  # rows 0..3 allow keys 0..6+i
    cols = PL.column_counts(causal)
    assert cols[1] == 4 and cols[0].tolist() == [4] * 7 + [3, 2, 1]
    assert PL.band_of(cols, 0, 10) == (7, 10)
    assert PL.band_of(cols, 2, 10) == (5, 8)  # offsets from the start of the key range
    assert PL.band_of(None, 0, 10) == (0, 0)
    assert PL.band_of(PL.column_counts(torch.ones(1, 1, 4, 10, dtype=torch.bool)), 0, 10) == (0, 0)
    assert PL.hull(cols, tk=10) == (0, 10)
    late = torch.zeros(1, 1, 4, 10, dtype=torch.bool)
    late[..., 3:6] = True
    assert PL.hull(PL.column_counts(late), tk=10) == (3, 6)
    assert PL.hull(PL.column_counts(late), None, tk=10) == (0, 10)  # a relation without a mask allows every key


@pytest.mark.parametrize("tq,tk", [(12, 12), (5, 12), (12, 5), (1, 1), (1, 7), (7, 1)])
@pytest.mark.parametrize("full_keys", [False, True])
@pytest.mark.parametrize("step", [1, 4])
def test_causal_layout_by_arithmetic_equals_the_measured_one(tq, tk, full_keys, step):
    """The shortcut for a relation known to be top-left causal gives the generic layout exactly,
    also with key ranges widened to a multiple of ``step``."""
    from attn_ledger.maths import masks

    part = (lambda q0, q1: masks.causal(tq, tk, "top-left", q0, q1)[None, None],)
    known = Relation("causal (top-left)", part, top_left_causal=True)
    unknown = Relation("causal (top-left)", part)
    for size in range(1, tq + 1):
        for q0 in range(0, tq, size):
            q1 = min(q0 + size, tq)
            a = known.block(q0, q1)
            got = PL.layout(known, a, a, q0, q1, tk, full_keys, step)
            want = PL.layout(unknown, a, a, q0, q1, tk, full_keys, step)
            assert got == want, (size, q0, q1)
            lo, hi = got.lo, got.hi
            assert full_keys or (hi - lo) % step == 0 or (lo, hi) == (0, tk), (size, q0, q1)
            assert bool(a[..., :lo].logical_not().all()) and bool(a[..., hi:].logical_not().all())  # nothing allowed is cut


def test_widening_key_ranges():
    assert PL.widen(0, 100, 4096, 256) == (0, 256)
    assert PL.widen(3900, 4096, 4096, 256) == (3840, 4096)  # no room on the right: grows to the left
    assert PL.widen(5, 9, 10, 8) == (2, 10)
    assert PL.widen(0, 3, 2, 8) == (0, 2)  # never wider than the keys there are
    assert PL.widen(3, 7, 100, 1) == (3, 7)


@pytest.mark.parametrize("fault", [None, "mask-after-softmax", "mask-polarity"])
def test_bfloat16_streaming_with_widened_key_ranges(fault):
    """bfloat16 blocks compute key ranges in steps of Tk/16 (fewer oneDNN shapes): same verdicts."""
    overrides = {**BASE, "dtype": "bfloat16", "seq_len": 300, "block_size": 32, "fault": fault}
    led = run_ledger(load_config(overrides=overrides), keep_going=True)
    if fault is None:
        assert led.first_finding is None
        return
    assert led.first_finding.row == "masked_scores"
    if fault == "mask-after-softmax":
        assert led.first_finding.name == "forbidden_excluded"
    else:  # every pair wrong, counted exactly over the widened ranges
        assert led.check("masked_scores", "forbidden_excluded").value == 2 * 300 * 299 // 2
        assert led.check("masked_scores", "allowed_kept").value == 2 * 300 * 301 // 2


@pytest.mark.parametrize("nkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_reference_in_head_chunks_equals_whole(monkeypatch, nkv):
    from attn_ledger.maths.reference import reference_stages

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, nkv, 9, 8, generator=g), torch.randn(2, nkv, 9, 5, generator=g)
    allow = torch.rand(2, 4, 6, 9, generator=g) < 0.8
    whole = reference_stages(q, k, v, allow_mask=allow, scale=0.3, empty_rows="zeros")
    monkeypatch.setattr(X, "REF_CHUNK_BYTES", 1)  # one kv head at a time
    chunked = X.reference_block(q, k, v, allow, 0.3, "zeros", torch.float64)
    for key in ("scores", "masked_scores", "weights", "out"):
        assert torch.equal(chunked[key], whole[key]), key


@pytest.mark.parametrize("seq_len,block_size", [(5, None), (300, 64)])
def test_inverted_polarity_counts_both_wrong_kinds_exactly(seq_len, block_size):
    """Every allowed pair excluded and every forbidden pair kept: both counts exact, whole or streamed."""
    overrides = {"fault": "mask-polarity", "seq_len": seq_len}
    if block_size:
        overrides["block_size"] = block_size
    led = run_ledger(load_config(overrides=overrides), keep_going=True)
    pairs = 2 * 3  # batch x heads of the default config
    allowed, forbidden = seq_len * (seq_len + 1) // 2, seq_len * (seq_len - 1) // 2
    assert led.check("masked_scores", "allowed_kept").value == pairs * allowed
    assert led.check("masked_scores", "forbidden_excluded").value == pairs * forbidden


def test_value_range_on_large_blocks_is_noted_and_still_fails_an_output_outside_it(monkeypatch):
    import attn_ledger.maths.pipeline as P

    cfg = load_config(overrides={**BASE, "seq_len": 400, "block_size": 64})
    healthy = run_ledger(cfg)
    assert healthy.check("context", "in_value_range").status == "pass"
    assert any(n.startswith("context in_value_range: blocks over 2^18") for n in notes_text(healthy))
    def shifted_on_wide_blocks(w, v):  # only blocks whose check takes the looser, block-wide range
        return P.mix_values(w, v) + (100.0 if w.shape[-1] > 320 else 0.0)

    monkeypatch.setattr(P, "ops_for", lambda fault: P.Ops(mix=shifted_on_wide_blocks))
    shifted = run_ledger(cfg, keep_going=True)
    assert shifted.check("context", "in_value_range").status == "fail"
    small = run_ledger(load_config(overrides={**BASE, "seq_len": 8}))
    assert not any(n.startswith("context in_value_range") for n in notes_text(small))


def test_returned_tensors_are_ordinary_tensors():
    """The engine runs in inference mode; nothing it hands back is an inference tensor."""
    q, k, v = _qkv((1, 2, 6, 4))
    for led in (ledger_on_qkv(q, k, v, mask="causal"), run_ledger(load_config())):
        assert led.tensors and not any(t.is_inference() for t in led.tensors.values())
        w = torch.ones_like(led.tensors["context"], requires_grad=True)
        (w * led.tensors["context"]).sum().backward()  # usable in autograd and in place afterwards
        led.tensors["context"].add_(1.0)


def test_garbage_on_a_forbidden_key_does_not_loosen_the_scores_tolerance():
    """The scores' absolute tolerance scales with the allowed scores, not a padded key's garbage."""
    scores = torch.tensor([[[[0.5, -1.0, 5e4]]]], dtype=torch.float64)  # [B, Nh, 1 row, Tk]; key 2 is padding
    masked = scores.clone()
    masked[..., 2] = -math.inf
    ref = {"scores": scores, "masked_scores": masked, "weights": torch.zeros_like(scores),
           "out": torch.zeros(1, 1, 1, 2, dtype=torch.float64)}
    sample = X.Sample(ref, ((0, 1),))
    sample.put("scores", 0, (scores + torch.tensor([1e-3, 0.0, 0.0], dtype=torch.float64)).float())
    rtol, atol = tolerance.reference(torch.float32)
    found = Tally.of(sample.agreements(rtol, atol)).agreement("scores", "pipeline", "float64")
    assert found.excess > 0  # 1e-3 off on an allowed key is a divergence
    assert (found.where.query, found.where.key) == (0, 0)
    sample = X.Sample(ref, ((0, 1),))
    sample.put("scores", 0, scores.float())
    assert Tally.of(sample.agreements(rtol, atol)).agreement("scores", "pipeline", "float64").excess <= 0
