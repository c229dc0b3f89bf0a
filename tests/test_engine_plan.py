"""The plan on its own: blocks, key ranges, bands, float64 sample rows and SDPA groups from sizes
and a relation, with no attention run (any attention call here would raise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_ledger.engine import plan as PL
from attn_ledger.maths import relations


@pytest.fixture(autouse=True)
def no_attention(monkeypatch):
    """Planning must not compute attention: every product, softmax and SDPA call raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("the plan ran attention")

    monkeypatch.setattr(torch, "matmul", refuse)
    monkeypatch.setattr(torch, "softmax", refuse)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)


def _relation(mask="causal", b=1, nh=8, tq=512, tk=512, **params):
    spec = relations.resolve(mask, tq=tq, tk=tk, batch_size=b, **params)
    return relations.build(spec, b, nh, tq, tk)


def test_causal_512_plan():
    rel = _relation()
    plan = PL.make_plan(1, 8, 512, 512, rel)
    assert [(blk.q0, blk.q1) for blk in plan.blocks] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    # each block computes the keys up to its last query; the band starts after its first query
    assert [(blk.layout.lo, blk.layout.hi) for blk in plan.blocks] == [(0, 128), (0, 256), (0, 384), (0, 512)]
    assert [blk.layout.band for blk in plan.blocks] == [(1, 128), (129, 256), (257, 384), (385, 512)]
    assert all(blk.layout.all_live for blk in plan.blocks)
    # 2^21 grid entries > F64_BUDGET: 3 blocks sampled, 2 rows each (2^15 // (3 * 8 * 512))
    assert plan.reference_spans == ((0, 2), (382, 384), (510, 512))
    assert [blk.sample_at for blk in plan.sampled] == [0, 2, 4]
    assert plan.reference_rows == 6
    assert plan.sdpa_whole_causal is True
    assert plan.sdpa_groups == (PL.SdpaGroup(0, 512, 0, 4),)
    assert (plan.keep, plan.full_keys, plan.value_chunks) == (False, False, True)


def test_small_grid_is_one_kept_block_with_every_row_sampled():
    rel = _relation(b=2, nh=3, tq=5, tk=5)
    plan = PL.make_plan(2, 3, 5, 5, rel)
    assert len(plan.blocks) == 1 and (plan.blocks[0].q0, plan.blocks[0].q1) == (0, 5)
    assert (plan.keep, plan.full_keys) == (True, True)
    assert (plan.blocks[0].layout.lo, plan.blocks[0].layout.hi) == (0, 5)  # whole grids are kept: every key
    assert plan.reference_spans == ((0, 5),)


def test_padding_plan_measures_hull_band_and_dead_rows():
    """Padding differs by example: the hull is the longest example's keys, every one of them in the band."""
    rel = _relation("padding", b=2, nh=2, tq=200, tk=200, valid_lengths=[150, 0])
    plan = PL.make_plan(2, 2, 200, 200, rel, block_size=50)
    assert [(blk.q0, blk.q1) for blk in plan.blocks] == [(0, 50), (50, 100), (100, 150), (150, 200)]
    for blk in plan.blocks:
        assert (blk.layout.lo, blk.layout.hi) == (0, 150)  # keys 150.. are forbidden to every query: skipped
        assert blk.layout.band == (0, 150)  # example 1 has no key at all: every computed column varies
        assert blk.layout.all_live is False  # example 1's queries have no allowed key


def test_sliding_window_skips_keys_outside_every_window():
    rel = _relation("sliding-window", b=1, nh=1, tq=400, tk=400, window=8)
    plan = PL.make_plan(1, 1, 400, 400, rel, block_size=100)
    assert [(blk.layout.lo, blk.layout.hi) for blk in plan.blocks] == [(0, 100), (93, 200), (193, 300), (293, 400)]


def test_given_intermediates_and_kept_grids_take_every_key():
    rel = _relation(b=1, nh=8, tq=512, tk=512)
    for kw in ({"given": True}, {"keep_grids": True}):
        plan = PL.make_plan(1, 8, 512, 512, rel, **kw)
        assert all((blk.layout.lo, blk.layout.hi) == (0, 512) for blk in plan.blocks), kw


def test_bfloat16_key_ranges_come_in_steps():
    rel = _relation(b=1, nh=32, tq=4096, tk=4096)
    step = PL.key_step(torch.bfloat16, "cpu", 4096)
    assert step == 256 and PL.key_step(torch.float32, "cpu", 4096) == 1
    plan = PL.make_plan(1, 32, 4096, 4096, rel, width_step=step)
    assert all(blk.layout.width % step == 0 for blk in plan.blocks)
    assert len({blk.layout.width for blk in plan.blocks}) <= 4096 // step


def test_sdpa_groups_cover_every_block_once():
    rel = _relation("padding", b=1, nh=2, tq=190, tk=190, valid_lengths=[150])
    plan = PL.make_plan(1, 2, 190, 190, rel, block_size=3)
    covered = [i for g in plan.sdpa_groups for i in range(g.first, g.end)]
    assert covered == list(range(len(plan.blocks)))
    assert [(g.q0, g.q1) for g in plan.sdpa_groups] == [(0, 190)]  # 510 rows a group would exceed Tq: one group
    assert plan.sdpa_whole_causal is False


def test_plan_is_immutable():
    plan = PL.make_plan(1, 8, 512, 512, _relation())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.blocks = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.blocks[0].layout.lo = 3
