"""The rounding rule of ``check``: each element of out, dq, dk and dv within ``c * eps * M`` of float64,
``M`` the magnitude of its summands; the half-precision bar; rows with no allowed key under ``any``.

Correct kernels in several styles pass with half their bound to spare; a kernel just past the bound
(the scale off by 1%) fails, naming the rule's parts; the precision fixtures warn or fail as they should.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.probes.kernel.cases import case_inputs, parse_case
from attn_ledger.probes.kernel.check import check_case
from attn_ledger.probes.kernel.reference import Computed, Magnitudes, attention, judge_rounding, magnitudes
from attn_ledger.render.notes import notes_text
from attn_ledger.render.text import describe
from attn_ledger.tolerance import EPS, rounding, tiny
from attn_ledger.inputs.userload import load_object

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fixtures" / "kernels"
runner = CliRunner()
ISSUE_CASE = "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-large-f32"  # SDPA's fused backward failed grad_k here
BOUNDED = ("reference", "grad_q", "grad_k", "grad_v")


def kernel(spec: str):
    file, _, name = spec.partition(":")
    return load_object(f"{KERNELS / file}.py:{name or 'attention'}")


def sdpa_gqa_bottom_right(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """SDPA with enable_gqa and an explicit bottom-right causal mask (the issue's kernel)."""
    if is_causal:
        tq, tk = q.shape[-2], k.shape[-2]
        i = torch.arange(tq)[:, None]
        causal = torch.arange(tk)[None, :] <= i + (tk - tq)  # [Tq, Tk]
        allow_mask = causal if allow_mask is None else allow_mask & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allow_mask, scale=scale, enable_gqa=True)


def scale_off_by_one_percent(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    s = (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale) * 1.01
    return sdpa_gqa_bottom_right(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=s)


CORRECT = {"sdpa_gqa": sdpa_gqa_bottom_right, "sdpa_adapter": kernel("sdpa_adapter"), "good": kernel("good"),
           "online_softmax": kernel("online_softmax"), "float32_softmax": kernel("float32_softmax")}


@pytest.mark.parametrize("case_id", [ISSUE_CASE, "b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32",
                                     "b2-h4kv2-tq1tk257-dh64dv64-lpad128-rand-bf16",
                                     "b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-f16"])
@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_kernels_stay_within_half_their_bound(name, case_id):
    for seed in (0, 1):
        res = check_case(CORRECT[name], parse_case(case_id), seed=seed)
        assert res.first_failure is None, (name, seed, res.first_failure)
        for check_name in BOUNDED:
            tol = res.check(check_name).data["tolerance"]
            assert tol["ratio"] <= 0.5, (name, seed, check_name, tol)


def test_a_bounded_check_names_its_parts_and_its_limit_is_the_rule_at_the_worst_element():
    ref = check_case(CORRECT["sdpa_gqa"], parse_case(ISSUE_CASE)).check("grad_k")
    tol = ref.data["tolerance"]
    assert tol["rule"] == "c * eps * M" and tol["dtype"] == "float32" and tol["eps"] == EPS["float32"]
    assert tol["bound"] == pytest.approx(tol["c"] * tol["eps"] * (tol["M"] + tol["underflow"]))
    assert tol["ratio"] == pytest.approx(tol["error"] / tol["bound"])
    # value <= limit exactly when every element is within its bound: limit = max error / worst ratio
    assert ref.value == tol["max_error"] and ref.limit == pytest.approx(ref.value / tol["ratio"])
    # the suites' view is kept beside the rule: flash-attention's 2x and PyTorch's grad_key fudge of 25
    suites = tol["suites"]
    assert suites["flash_attention"]["factor"] == 2.0 and suites["pytorch"]["factor"] == 25.0
    assert suites["pytorch"]["limit"] == pytest.approx(25.0 * tol["plain_error"])


def test_the_scale_off_by_one_percent_fails_the_reference_check_naming_the_rule():
    res = check_case(scale_off_by_one_percent, parse_case("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32"))
    ref = res.check("reference")
    tol = ref.data["tolerance"]
    assert ref.failed and tol["ratio"] > 1.0 and ref.value > ref.limit
    text = describe(ref)
    assert f"c {tol['c']:g} x eps" in text and "x M " in text and "error / bound" in text
    for name in ("grad_q", "grad_k", "grad_v"):
        assert res.check(name).failed


def test_judge_rounding_is_elementwise_just_past_the_bound_fails_just_within_passes():
    torch.manual_seed(0)
    ref = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    m = torch.rand(1, 2, 3, 4, dtype=torch.float64) + 0.5  # [B, N, T, D] per-element magnitudes
    zero = torch.zeros_like(m)
    mags = Magnitudes(Computed(m), Computed(zero), accumulate=0.0)  # no growth: the bound is c * eps * m
    c, eps = rounding("out", "float32")
    where = torch.ones(1, 2, 3, dtype=torch.bool)
    names = ("example", "head", "query")
    within = judge_rounding(ref + 0.99 * c * eps * m, ref, mags, "out", "float32", where, names)
    assert within.ratio == pytest.approx(0.99) and within.max_error <= within.limit
    bump = ref.clone()
    bump[0, 1, 2, 3] += 1.01 * c * eps * m[0, 1, 2, 3]  # one element past its own bound
    past = judge_rounding(bump, ref, mags, "out", "float32", where, names)
    assert past.ratio == pytest.approx(1.01) and past.max_error > past.limit
    assert past.at == {"example": 0, "head": 1, "query": 2} and past.parts["at"]["dim"] == 3
    assert int(past.wrong.sum()) == 1
    # an element with a zero bound (no summand) must be exact; NaN against a number never passes
    exact = judge_rounding(zero + 1e-30, zero, Magnitudes(Computed(zero), Computed(zero)), "out", "float32", where, names)
    grown = judge_rounding(ref, ref, Magnitudes(Computed(m), Computed(zero), (("out", 16),)), "out", "float32", where, names)
    assert grown.parts["terms"] == 16 and grown.parts["growth"] == 1 + 4.0  # a sum of 16 terms: 1 + sqrt(16)
    assert math.isinf(exact.ratio)
    nan = ref.clone()
    nan[0, 0, 0, 0] = math.nan
    assert math.isinf(judge_rounding(nan, ref, mags, "out", "float32", where, names).ratio)


def test_magnitudes_are_the_absolute_value_computation():
    q, k, v, kw = case_inputs("b1-h2kv1-tq3tk4-dh4dv2-none-rand-f32")
    d_out = torch.randn(1, 2, 3, 2, dtype=torch.float64)
    scale = 0.5
    mags = magnitudes(q, k, v, None, scale, d_out)
    ref = attention(q, k, v, None, scale, compute=torch.float64)
    qd, kd, vd = (t.double().repeat_interleave(2 // t.shape[1], dim=1) for t in (q, k, v))
    p = torch.softmax(qd @ kd.transpose(-2, -1) * scale, dim=-1)  # [B, Nh, Tq, Tk]
    s = qd @ kd.transpose(-2, -1) * scale
    a = qd.abs() @ kd.abs().transpose(-2, -1) * scale
    acc = 1 + math.sqrt(4)  # float32 accumulates q . k over Dh = 4 products in float32
    e = p * (s.abs() + acc * a + (p * s.abs()).sum(-1, keepdim=True) + 1 + math.log(4) + acc * a.amax(dim=-1, keepdim=True))
    torch.testing.assert_close(mags.summands.out, (p + e) @ vd.abs())
    assert bool((mags.summands.out >= ref.out.abs()).all())  # M bounds the quantity itself
    torch.testing.assert_close(mags.underflow.out, torch.ones_like(mags.underflow.out))  # no weight underflows
    small = magnitudes(q, k, v, None, scale, d_out, tiny=2.0)  # as if every weight were below the smallest normal
    torch.testing.assert_close(small.underflow.out, torch.ones_like(p) @ (vd.abs() + 1) + 1)
    assert (mags.length("out"), mags.length("dv")) == (4, 3 * 2)  # Tk; Tq times the query heads per kv head
    dv = ((p + e).transpose(-2, -1) @ d_out.abs()).sum(dim=1, keepdim=True)  # two query heads share kv head 0
    torch.testing.assert_close(mags.summands.dv, dv)
    assert mags.summands.dq.shape == q.shape and mags.summands.dk.shape == k.shape
    assert tiny("float16") == torch.finfo(torch.float16).tiny and tiny("float32") == torch.finfo(torch.float32).tiny


# --- the half-precision bar -----------------------------------------------------------------------

F16_BLOCKED = "b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-f16"
F16_REAL = "b2-h4kv2-tq128tk128-dh64dv64-pad-causal-rand-f16"


def precision_of(spec: str, case_id: str, **kw):
    return check_case(kernel(f"precision/{spec}"), parse_case(case_id), **kw).check("precision")


def test_softmax_in_bfloat16_gets_a_precision_warning_naming_the_ratio():
    c = precision_of("bf16_softmax", F16_BLOCKED)
    assert c.status == "warn" and c.value > c.limit and c.data["out"]["ratio"] == c.value
    assert f"= {c.value:.3g} (limit {c.limit:g})" in describe(c)
    assert precision_of("bf16_softmax", F16_BLOCKED, strict_precision=True).status == "fail"


def test_a_float16_accumulator_for_p_at_v_gets_a_precision_warning():
    c = precision_of("fp16_accumulator", F16_REAL)
    assert c.status == "warn" and c.value > c.limit
    res = check_case(kernel("precision/fp16_accumulator"), parse_case(F16_REAL))
    assert res.first_failure is None  # imprecise, not wrong: every other check holds


@pytest.mark.parametrize("name", ["sdpa_adapter", "good", "online_softmax"])
def test_correct_half_kernels_pass_the_precision_bar(name):
    for case_id in (F16_BLOCKED, F16_REAL, F16_BLOCKED.replace("f16", "bf16")):
        c = check_case(CORRECT[name], parse_case(case_id)).check("precision")
        assert c.status == "pass", (name, case_id, c.value)


def test_a_float32_finfo_min_bias_added_in_float16_fails_the_default_tier_on_fully_blocked_rows():
    bad = kernel("precision/half_finfo_min_bias")
    res = check_case(bad, parse_case(F16_BLOCKED))
    assert res.first_failure is not None and res.check("empty_rows").failed
    # bfloat16 rounds finfo(float32).min past its largest finite value too; float32 holds it
    assert check_case(bad, parse_case(F16_BLOCKED.replace("f16", "bf16"))).check("empty_rows").failed
    assert check_case(bad, parse_case(F16_BLOCKED.replace("f16", "f32"))).first_failure is None
    out = runner.invoke(app, ["check", f"{KERNELS}/precision/half_finfo_min_bias.py:attention", "--format", "json"])
    assert out.exit_code == 1
    assert json.loads(out.stdout)["first_finding"]["row"].endswith("f16")


# --- rows with no allowed key under --empty-rows any -----------------------------------------------


@pytest.mark.parametrize("case_id", ["b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32", F16_BLOCKED.replace("f16", "f32"),
                                     "b2-h4kv2-tq113tk113-dh64dv64-lpad64-causal-rand-f32"])
def test_uniform_weights_on_a_fully_blocked_row_pass_under_any_and_fail_under_zeros(case_id):
    eager = kernel("eager_additive")
    anything = check_case(eager, parse_case(case_id), empty_rows="any")
    assert anything.first_failure is None, anything.first_failure
    assert anything.check("forbidden_keys").status in ("pass", "not_applicable")
    zeros = check_case(eager, parse_case(case_id))
    assert zeros.check("empty_rows").failed


def test_under_any_a_leak_from_a_forbidden_key_into_a_row_with_an_allowed_key_still_fails():
    def leaky(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
        out = kernel("eager_additive")(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)
        return out + 1e-3 * v[:, :1, -1:].mean()  # every row moves with the last key, forbidden or not

    res = check_case(leaky, parse_case("b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32"), empty_rows="any")
    assert res.check("forbidden_keys").failed


def test_the_report_names_half_precision_warnings_apart_from_float64_ones():
    from attn_ledger.probes.kernel.check import HALF_PRECISION_WARNING, check_kernel

    report = check_kernel(kernel("precision/fp16_accumulator"), [parse_case(F16_BLOCKED), parse_case(F16_REAL)])
    notes = [n for n in notes_text(report) if "precise" in n]
    assert notes == [f"2 cases are {HALF_PRECISION_WARNING.removeprefix('is ')} (warning; smallest {F16_BLOCKED}); "
                     "--strict-precision makes it a failure"]
    assert report.verdict == "pass"
