"""Check functions on their own, each passing and failing on a tensor built to break it."""

from __future__ import annotations

import math

import torch

from attn_ledger.engine import checks as C
from attn_ledger.engine.judge import _headroom
from attn_ledger.engine.measure import range_excess
from attn_ledger.maths.pipeline import expand_kv, merge_heads, split_heads


def test_shape_check():
    assert C.shape_check((2, 3), (2, 3), "[B,T]").status == "pass"
    bad = C.shape_check((3, 2), (2, 3), "[B,T]")
    assert bad.status == "fail" and bad.level == 1 and bad.data["got"] == [3, 2] and bad.data["expected"] == [2, 3]


def test_finite_check_and_counts():
    assert C.finite_check(C.nonfinite_count(torch.ones(3))).status == "pass"
    t = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])
    assert C.nonfinite_count(t) == 3 and C.finite_check(3).status == "fail"
    assert C.nonfinite_count(t, allow_neg_inf=True) == 2
    assert C.all_finite(torch.tensor([0.0, -math.inf]), allow_neg_inf=True)
    assert not C.all_finite(torch.tensor([0.0, math.nan]), allow_neg_inf=True)
    assert not C.all_finite(torch.tensor([0.0, math.inf]), allow_neg_inf=True)


def test_roundtrip_and_head_slices():
    x = torch.arange(2 * 5 * 12, dtype=torch.float64).reshape(2, 5, 12)
    good = split_heads(x, 3)
    assert C.roundtrip_check(x, merge_heads(good)).status == "pass"
    assert C.head_slices_check("split_head_slices", good, x, 3, "split").status == "pass"
    bad = x.reshape(2, 3, 5, 4)  # the reshape-only split
    assert C.head_slices_check("split_head_slices", bad, x, 3, "split").status == "fail"
    assert C.roundtrip_check(x, bad.reshape(2, 5, 12).roll(1, 1)).status == "fail"


def test_kv_pairing_check_catches_repeat_instead_of_repeat_interleave():
    assert C.kv_pairing_check(expand_kv, 8, 2).status == "pass"

    def tiled(x, n_heads):  # heads paired as 0,1,0,1,... instead of 0,0,1,1,...
        return x.repeat(1, n_heads // x.shape[1], 1, 1)

    bad = C.kv_pairing_check(tiled, 8, 2)
    assert bad.status == "fail" and bad.level == 2 and bad.data["read"][:4] == [0, 1, 0, 1] and bad.value == 4
    # with one kv head (multi-query) the two pairings agree, so the probe rightly passes
    assert C.kv_pairing_check(tiled, 8, 1).status == "pass"


def test_excess_error_and_compare_check():
    a = torch.tensor([1.0, 2.0])
    d, ex = C.excess_error(a, a + 1e-7, 1e-5, 1e-5)
    assert C.compare_check("m", d, ex, 1e-5, 1e-5, "ref").status == "pass"
    d, ex = C.excess_error(a, a + 0.1, 1e-5, 1e-5)
    assert C.compare_check("m", d, ex, 1e-5, 1e-5, "ref").status == "fail"
    d, ex = C.excess_error(torch.tensor([math.nan]), torch.tensor([1.0]), 1e-5, 1e-5)
    assert math.isnan(d) and C.compare_check("m", d, ex, 1e-5, 1e-5, "ref").status == "fail"
    d, ex = C.excess_error(torch.tensor([math.nan]), torch.tensor([math.nan]), 1e-5, 1e-5)
    assert C.compare_check("m", d, ex, 1e-5, 1e-5, "ref").status == "pass"


def test_bound_and_count_checks():
    assert C.bound_check(3, "x", 1e-7, 1e-5, "err").status == "pass"
    assert C.bound_check(3, "x", 1e-3, 1e-5, "err").status == "fail"
    assert C.bound_check(3, "x", math.nan, 1e-5, "err").status == "fail"
    assert C.count_check(3, "x", 0, "bad").status == "pass" and C.count_check(3, "x", 2, "bad").status == "fail"


def test_value_range_exact_and_block_span():
    v = torch.tensor([[[[0.0, 1.0], [2.0, 3.0], [10.0, 10.0]]]])  # [1, 1, Tk=3, Dv=2]
    allow = torch.tensor([[True, True, False]])[None, None]  # [1, 1, 1, 3]
    inside = torch.tensor([[[[1.0, 2.0]]]])
    assert range_excess(inside, v, allow, 1e-5, 1e-5)[0] <= 0
    outside = torch.tensor([[[[5.0, 2.0]]]])  # 5 exceeds the allowed keys' max 2, though key 2 holds 10
    assert range_excess(outside, v, allow, 1e-5, 1e-5)[0] > 0
    assert range_excess(outside, v, None, 1e-5, 1e-5)[0] <= 0  # without a relation, every key is in range
    assert range_excess(torch.tensor([[[[11.0, 2.0]]]]), v, None, 1e-5, 1e-5)[0] > 0


def test_headroom_warning():
    ok = _headroom(5.0, "float16")
    assert ok.status == "pass" and ok.limit == math.log(65504.0)
    warn = _headroom(20.0, "float16")
    assert warn.status == "warn" and not warn.failed and warn.value == 20.0
    assert _headroom(20.0, "float32").status == "pass"


def test_factor_check():
    assert C.factor_check("m", 2e-3, 1e-3, 1e-4, "ref").status == "pass"
    bad = C.factor_check("m", 1e-2, 1e-3, 1e-4, "ref")
    assert bad.status == "fail" and bad.data["factor"] == 10.0 and bad.limit == 4e-3
    assert C.factor_check("m", math.nan, 1e-3, 1e-4, "ref").status == "fail"
