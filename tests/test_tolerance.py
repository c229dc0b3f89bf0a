"""The one tolerance policy: the numbers each rule gives, by dtype object or name alike."""

from __future__ import annotations

import pytest
import torch

from attn_ledger import tolerance


@pytest.mark.parametrize("dtype,rtol,atol", [("float64", 1e-9, 1e-9), ("float32", 2e-5, 2e-5),
                                            ("bfloat16", 3e-2, 1e-2), ("float16", 4e-3, 2e-3)])
def test_reference_tolerance(dtype, rtol, atol):
    assert tolerance.reference(dtype) == tolerance.reference(getattr(torch, dtype)) == (rtol, atol)


def test_row_sum_half_and_kernel_rules():
    assert tolerance.row_sum("float64") == 1e-5  # never tighter than MIN_ROW_SUM
    assert tolerance.row_sum("float32") == pytest.approx(2e-4)
    assert tolerance.is_half(torch.bfloat16) and not tolerance.is_half("float32")
    assert (tolerance.half_floor("float16"), tolerance.half_floor("bfloat16")) == (1e-3, 8e-3)
    assert tolerance.kernel("float32", 1e-6, 3.0) == pytest.approx(4 * 1e-6 + 2e-6 * 4.0)


def test_assert_close_defaults_match_torch_testing():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        rtol, atol = tolerance.assert_close(dtype)
        a = torch.ones(3, dtype=dtype)
        torch.testing.assert_close(a + (atol + rtol) * 0.5, a)  # within both
        with pytest.raises(AssertionError):
            torch.testing.assert_close(a + (atol + rtol) * 4, a)
    assert tolerance.relative("float32") == pytest.approx(1e-5 + 1.3e-6)


def test_observed_core_rules():
    assert tolerance.eps(torch.float32) == torch.finfo(torch.float32).eps
    assert tolerance.eps("bfloat16") == torch.finfo(torch.bfloat16).eps
    assert tolerance.norm_pattern("float64") == 1e-6  # float32 rotary tables inside a float64 module
    assert tolerance.norm_pattern("bfloat16") == pytest.approx(8 * 2 ** -7)
    # logits: never tighter than float32's, growing with their size
    assert tolerance.logit("float64", 0.0) == tolerance.logit("float32", 0.0) == pytest.approx(64 * 2 ** -23)
    assert tolerance.logit("float32", 9.0) == pytest.approx(10 * tolerance.logit("float32", 0.0))
    assert (tolerance.fitted_scale("float32"), tolerance.fitted_scale(torch.float16)) == (1e-3, 5e-2)
    assert tolerance.GRADCHECK["eps"] < tolerance.GRADCHECK_FLOAT32_INSIDE["eps"]


def test_rounding_rule_c_and_eps_per_quantity_and_dtype():
    for quantity in tolerance.ROUNDING_QUANTITIES:
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            c, eps = tolerance.rounding(quantity, dtype)
            assert c == tolerance.rounding(quantity, tolerance.dtype_name(dtype))[0] > 0
            assert eps == torch.finfo(dtype).eps
    assert tolerance.rounding_c("dv", "float16") > tolerance.rounding_c("dv", "float32")  # dO rounds to float16
    assert tolerance.tiny("bfloat16") == torch.finfo(torch.bfloat16).tiny
    with pytest.raises(ValueError, match="quantity"):
        tolerance.rounding("dx", "float32")


def test_the_suites_view_is_kept_as_data():
    assert tolerance.SUITES["flash_attention"]["factor"] == {"out": 2.0, "dq": 2.0, "dk": 2.0, "dv": 2.0}
    assert tolerance.SUITES["pytorch"]["factor"] == {"out": 4.0, "dq": 160.0, "dk": 25.0, "dv": 8.0}
    assert 1.0 < tolerance.HALF_PRECISION_RATIO < 2.0  # correct kernels reach 1.0, a float16 accumulator 2.25
