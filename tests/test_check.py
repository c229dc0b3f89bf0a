"""``attn-ledger check`` and :mod:`attn_ledger.probes.kernel.check`: the grid, every check passing and failing, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from xml.etree import ElementTree as ET

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from attn_ledger.probes import catalogue
from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.probes.kernel.check import CHECK_ORDER, DEFAULT_GRID, Case, check_case, check_kernel
from attn_ledger.probes.kernel.check import case_inputs, parse_case
from attn_ledger.render import render
from attn_ledger.render.jsondoc import report_json, schema
from attn_ledger.render.notes import call_text, note_text
from attn_ledger.inputs.userload import load_object

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fixtures" / "kernels"
GOOD = f"{KERNELS / 'good.py'}:attention"
good_attention = load_object(GOOD)
runner = CliRunner()


# --- kernels built to break one check each --------------------------------------------------


def raises_when_tq_differs(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Assumes self-attention: a legal cross-attention call raises."""
    if q.shape[-2] != k.shape[-2]:
        raise ValueError("expected Tq == Tk")
    return good_attention(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)


def heads_last(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Returns [B, Tq, Nh, Dv]."""
    return good_attention(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale).transpose(1, 2)


def always_float32(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    return good_attention(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale).float()


def q_centred_over_batch(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Subtracts the batch mean of q: every example's output depends on the others."""
    q = q - q.mean(dim=0, keepdim=True)
    return good_attention(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)


def q_heads_reversed(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Query head h reads query head Nh-1-h's q."""
    return good_attention(q.flip(1), k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)


def future_off_by_one(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Causal relation j <= i + 1 + (Tk - Tq): each query also sees the next key."""
    if is_causal:
        tq, tk = q.shape[-2], k.shape[-2]
        leak = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq + 1)
        allow_mask = leak if allow_mask is None else allow_mask & leak
    return good_attention(q, k, v, allow_mask=allow_mask, is_causal=False, scale=scale)


BROKEN = f"{KERNELS / 'broken_backward.py'}"


def broken(name):
    return load_object(f"{BROKEN}:{name}")


def hostile(name):
    """A kernel of fixtures/hostile/ that does something besides returning (never one that patches the tool)."""
    return load_object(f"{KERNELS.parent / 'hostile' / name}.py:attention")


def manual_nan_rows(q, k, v, **kw):
    return load_object(f"{KERNELS / 'manual_nan_rows.py'}:attention")(q, k, v, **kw)


def ignores_q(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Every query is the same zero vector: each row is the plain mean of the values it may use."""
    return good_attention(torch.zeros_like(q), k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)


# (check that must fail, kernel, case id, expected first level, expected first check)
BREAKERS = [
    ("call", raises_when_tq_differs, "b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32", 1, "call"),
    ("shape", heads_last, "b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32", 1, "shape"),
    ("dtype", always_float32, "b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f64", 1, "dtype"),
    ("batch_isolation", q_centred_over_batch, "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 2, "batch_isolation"),
    ("kv_head_isolation", catalogue.gqa_repeat, "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 2, "kv_head_isolation"),
    ("q_head_isolation", q_heads_reversed, "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 2, "q_head_isolation"),
    ("finite", catalogue.softmax_overflow, "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-large-f32", 3, "finite"),
    ("convex_range", catalogue.mask_after_softmax, "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32", 3, "convex_range"),
    ("forbidden_keys", future_off_by_one, "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32", 3, None),
    ("empty_rows", manual_nan_rows, "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32", 3, "empty_rows"),
    ("reference", catalogue.no_scale, "b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32", 4, "reference"),
    ("causal_intervention", future_off_by_one, "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32", 3, None),
    ("grad_call", broken("raising_backward"), "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 1, "grad_call"),
    ("grad_finite", broken("nan_dq"), "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 3, "grad_finite"),
    ("grad_blocked_keys", broken("dv_at_blocked_keys"), "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32", 3, "grad_blocked_keys"),
    ("grad_q", broken("wrong_dq"), "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 4, "grad_q"),
    ("grad_k", broken("wrong_dk_only"), "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32", 4, "grad_k"),
    ("grad_v", broken("dv_at_blocked_keys"), "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32", 3, "grad_blocked_keys"),
    ("inputs_unchanged", hostile("judge_clobbers"), "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32", 1, "inputs_unchanged"),
    ("reference_grad_mode", hostile("judge_grad_mode"), "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32", 4,
     "reference_grad_mode"),
]
# precision warns rather than fails unless asked: tests/test_check_depth.py breaks it
WARNERS = {"precision"}


@pytest.mark.parametrize("name,kernel,case_id,level,first", BREAKERS, ids=[b[0] for b in BREAKERS])
def test_each_check_fails_on_a_kernel_built_to_break_it(name, kernel, case_id, level, first):
    result = check_case(kernel, parse_case(case_id))
    bad = result.check(name)
    assert bad.status == "fail", bad
    assert result.first_failure.level == level
    if first is not None:
        assert result.first_failure.name == first
    if bad.limit is not None:  # a measured check: the number is past its limit, and says where
        assert bad.op == "<=" and not bad.value <= bad.limit
        assert set(bad.location) - {"tensor"} in ({"example", "head", "query"}, {"example", "kv_head", "key"})
    # the same case passes that check on the correct kernel, within the same kind of limit
    good = check_case(good_attention, parse_case(case_id)).check(name)
    assert good.status == "pass", good
    if good.limit is not None:
        assert good.value <= good.limit and good.location is None


def test_failed_checks_carry_their_facts():
    called = check_case(raises_when_tq_differs, parse_case("b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32")).check("call")
    assert (called.data["exception"], called.data["message"]) == ("ValueError", "expected Tq == Tk")
    shape = check_case(heads_last, parse_case("b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32")).check("shape")
    assert (shape.data["expected"], shape.data["got"]) == ([2, 4, 5, 4], [2, 5, 4, 4])
    dtype = check_case(always_float32, parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f64")).check("dtype")
    assert (dtype.data["expected"], dtype.data["got"]) == ("float64", "float32")
    # batch element 0 is perturbed: example 1 moves, so the leak is located there
    leak = check_case(q_centred_over_batch, parse_case("b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32")).check("batch_isolation")
    assert leak.data["perturbed"]["example"] == 0 and leak.location["example"] == 1
    # the reference bound is c x eps x M at each element; the limit is the max error over the worst ratio
    ref = check_case(catalogue.no_scale, parse_case("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32")).check("reference")
    tol = ref.data["tolerance"]
    assert tol["bound"] == pytest.approx(tol["c"] * tol["eps"] * (tol["M"] + tol["underflow"]))
    assert ref.limit == pytest.approx(ref.value / tol["ratio"])
    assert tol["dtype"] == "float32" and ref.value > 100 * ref.limit and tol["ratio"] > 100


def test_checks_after_a_failed_call_or_shape_are_not_reached():
    raised = check_case(raises_when_tq_differs, parse_case("b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32"))
    assert [c.status for c in raised.checks] == ["fail"] + ["not_reached"] * (len(CHECK_ORDER) - 1)
    wrong = check_case(heads_last, parse_case("b2-h4kv2-tq5tk9-dh8dv4-none-rand-f32"))
    assert [c.status for c in wrong.checks] == ["pass", "fail", "pass"] + ["not_reached"] * (len(CHECK_ORDER) - 3)
    assert [c.name for c in wrong.checks] == [name for _, name in CHECK_ORDER]


def test_probes_that_cannot_apply_are_not_applicable():
    result = check_case(good_attention, parse_case("b1-h1kv1-tq1tk1-dh4dv4-causal-flag-rand-f32"))
    for name in ("batch_isolation", "kv_head_isolation", "q_head_isolation", "forbidden_keys",
                 "empty_rows", "causal_intervention"):
        assert result.check(name).status == "not_applicable", name
    assert result.passed


def test_a_probe_that_moves_nothing_is_inconclusive_not_a_pass():
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32")
    probe = check_case(ignores_q, case).check("q_head_isolation")
    assert probe.status == "inconclusive"
    assert probe.value <= probe.limit and probe.data["moved"] <= probe.data["moved_min"]
    # the correct kernel's query head does move when its q changes
    moved = check_case(good_attention, case).check("q_head_isolation")
    assert moved.status == "pass" and moved.data["moved"] > moved.data["moved_min"]


def test_a_query_head_probe_over_thousands_of_keys_sharpens_until_it_has_power():
    # bf16, one query over 2048 keys: a fresh query of the inputs' spread leaves near-uniform weights whose
    # output moves less than bfloat16's floor; the probe retries with a wider query that must move it
    case = parse_case("b1-h8kv1-tq1tk2048-dh64dv64-lpad256-rand-bf16")
    probe = check_case(good_attention, case).check("q_head_isolation")
    assert probe.status == "pass" and probe.data["perturbed"]["sharpen"] == 8.0
    assert probe.data["moved"] > 10 * probe.data["moved_min"]
    leaked = check_case(q_heads_reversed, case).check("q_head_isolation")
    assert leaked.status == "fail" and leaked.value > leaked.limit
    assert check_case(ignores_q, case).check("q_head_isolation").status == "inconclusive"


def test_every_check_breaker_is_listed():
    assert {b[0] for b in BREAKERS} | WARNERS == {name for _, name in CHECK_ORDER}


def test_good_kernel_passes_the_default_grid_and_every_check_runs():
    report = check_kernel(good_attention, target=GOOD)
    assert report.exit_code == 0 and report.verdict == "pass" and report.first_finding is None
    assert report.details["skipped"] == []  # float16 and bfloat16 run on this CPU build
    assert sorted(r.name for r in report.rows) == sorted(c.id for c in DEFAULT_GRID)
    assert [r.fields["elements"] for r in report.rows] == sorted(c.size for c in DEFAULT_GRID)  # smallest first
    assert all(r.status == "pass" and r.fields["elements"] == parse_case(r.name).size for r in report.rows)
    evaluated = {c.name for _, c in report.checks() if c.passed}
    assert evaluated == {name for _, name in CHECK_ORDER}
    assert {c.status for _, c in report.checks()} == {"pass", "not_applicable"}
    d = report.details
    assert (d["cases_total"], d["cases_failed"], d["first_level"], d["reproduce"]) == (len(DEFAULT_GRID), 0, None, None)


def test_no_scale_passes_levels_1_to_3_wherever_its_product_stays_finite():
    report = check_kernel(catalogue.no_scale)
    first = {r.name: r.first_failing() for r in report.rows if r.failing()}
    # an unscaled float16 product of the 'huge' inputs overflows: non-finite output, and the check says why
    huge = {name: c for name, c in first.items() if parse_case(name).inputs == "huge"}
    assert {(c.level, c.name) for c in huge.values()} == {(3, "finite")}
    assert all(c.data["raw_product_max"] > c.data["dtype_max"] == 65504 for c in huge.values())
    # elsewhere at L4: the output's reference check, or (a bfloat16 softmax saturated on large scores
    # either way, its output within bfloat16's rounding bound) a gradient's
    l4 = {c.name for name, c in first.items() if name not in huge}
    assert "reference" in l4 and l4 <= {"reference", "grad_q", "grad_k", "grad_v"}
    assert report.details["failures"][0] == {"level": 3, "check": "finite", "cases": len(huge),
                                             "smallest_case": min(huge, key=lambda i: parse_case(i).size)}


def test_first_finding_is_the_smallest_failing_case():
    fn = load_object(f"{KERNELS / 'sdpa_is_causal.py'}:attention")
    ids = ["b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32", "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32",
           "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32"]
    report = check_kernel(fn, [parse_case(i) for i in ids], target="k.py:attention")
    # rows run smallest first: the second case is smaller (624 < 640 < 752 elements) though listed later
    assert [(r.name, r.status, r.fields["elements"]) for r in report.rows] == [
        (ids[1], "fail", 624), (ids[2], "pass", 640), (ids[0], "fail", 752)]
    first = report.first_finding
    assert (first.row, first.level, first.name) == (ids[1], 4, "reference")
    assert first.check == report.check(ids[1], "reference")
    d = report.details
    assert (d["cases_total"], d["cases_failed"], d["first_level"]) == (3, 2, 4)
    repro = report_json(report)["details"]["reproduce"]  # the data, and the lines written from it
    assert {k: repro[k] for k in ("case", "cli", "python")} == {
        "case": ids[1],
        "cli": f"attn-ledger check k.py:attention --case {ids[1]}",
        "python": f"from attn_ledger import case_inputs\nq, k, v, kw = case_inputs({ids[1]!r})\n"
                  "out = attention(q, k, v, **kw)",
    }
    assert (d["reproduce"]["case"], d["reproduce"]["options"], call_text(d["reproduce"]["call"])) == (
        ids[1], [], "attention(q, k, v, is_causal=True)")
    assert repro["call"] == "attention(q, k, v, is_causal=True)"  # the JSON writes the call's text, its data beside
    assert repro["call_data"] == {"function": "attention", "allow_mask": None, "is_causal": True, "scale": None,
                                  "softcap": None, "window": None, "sinks": False}
    seeded = report_json(check_kernel(fn, [parse_case(ids[1])], target="k.py:attention", seed=3, empty_rows="nan"))
    assert seeded["details"]["reproduce"]["cli"].endswith(f"--case {ids[1]} --seed 3 --empty-rows nan")
    assert f"case_inputs({ids[1]!r}, seed=3)" in seeded["details"]["reproduce"]["python"]


def test_empty_row_contract_is_stated_not_silent():
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32")  # example 1 has no key: 4 heads x 5 queries
    zeros = check_case(manual_nan_rows, case).check("empty_rows")
    assert (zeros.status, zeros.value, zeros.limit) == ("fail", 20, 0)
    assert (zeros.data["empty_rows"], zeros.data["rows_with_nan"]) == (20, 20)
    assert zeros.location == {"example": 1, "head": 0, "query": 0}
    nan = check_case(manual_nan_rows, case, empty_rows="nan").check("empty_rows")
    assert (nan.status, nan.value) == ("pass", 0)
    anything = check_case(manual_nan_rows, case, empty_rows="any").check("empty_rows")
    assert anything.status == "skipped" and anything.data == {"contract": "any", "empty_rows": 20}
    good_nan = check_case(good_attention, case, empty_rows="nan").check("empty_rows")
    assert (good_nan.status, good_nan.value) == ("fail", 20)  # zeros are not NaN
    good_zeros = check_case(good_attention, case).check("empty_rows")
    assert (good_zeros.status, good_zeros.value, good_zeros.data["largest_finite_abs"]) == ("pass", 0, 0.0)
    with pytest.raises(InputError):
        check_case(good_attention, case, empty_rows="ones")


def test_the_finite_contract_takes_any_finite_row_and_names_nan_or_inf():
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32")  # example 1 has no key: 4 heads x 5 queries
    uniform = load_object(f"{KERNELS / 'eager_additive.py'}:attention")  # finfo.min bias: uniform, finite rows
    eager = check_case(uniform, case, empty_rows="finite")
    assert (eager.check("empty_rows").status, eager.check("empty_rows").value) == ("pass", 0)
    assert eager.passed, eager.first_failure  # its rows are not zeros, and nothing else judges them
    assert check_case(uniform, case).check("empty_rows").status == "fail"  # the zeros contract names them
    zeros = check_case(good_attention, case, empty_rows="finite").check("empty_rows")
    assert (zeros.status, zeros.value) == ("pass", 0)
    nan = check_case(manual_nan_rows, case, empty_rows="finite")
    check = nan.check("empty_rows")
    assert (check.status, check.value, check.limit) == ("fail", 20, 0) and check.data["rows_with_nan"] == 20
    assert check.location == {"example": 1, "head": 0, "query": 0} and "NaN or inf" in check.measure
    assert nan.first_failure.name == "empty_rows"

    def inf_rows(q, k, v, **kw):
        out = good_attention(q, k, v, **kw)
        return out.masked_fill(out == 0, float("inf"))  # the empty rows (exactly zero) become inf

    inf = check_case(inf_rows, case, empty_rows="finite").check("empty_rows")
    assert (inf.status, inf.value) == ("fail", 20) and inf.data["rows_with_nan"] == 0


def test_sdpa_is_causal_is_wrong_for_decode_shapes_only():
    fn = load_object(f"{KERNELS / 'sdpa_is_causal.py'}:attention")
    report = check_kernel(fn)
    failing = {r.name for r in report.rows if r.status == "fail"}
    assert failing and all(parse_case(i).causal and parse_case(i).tq != parse_case(i).tk for i in failing)
    decode = check_case(fn, parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32"))
    assert (decode.first_failure.level, decode.first_failure.name) == (4, "reference")
    assert check_case(fn, parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")).passed


# --- the grid -------------------------------------------------------------------------------


def test_case_ids_round_trip_and_are_unique():
    ids = [c.id for c in DEFAULT_GRID]
    assert len(ids) == len(set(ids))
    assert all(parse_case(i) == c for i, c in zip(ids, DEFAULT_GRID))


@pytest.mark.parametrize("bad", ["", "b2-h4kv3-tq5tk5-dh8dv8-none-rand-f32", "b0-h1kv1-tq1tk1-dh4dv4-none-rand-f32",
                                 "b1-h1kv1-tq1tk1-dh4dv4-pad-empty-rand-f32", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f8"])
def test_bad_case_ids_are_input_errors(bad):
    with pytest.raises(InputError):
        parse_case(bad)


def _has(pred) -> bool:
    return any(pred(c) for c in DEFAULT_GRID)


@pytest.mark.parametrize("label,pred", [
    ("B = 1", lambda c: c.b == 1),
    ("T = 1", lambda c: c.tq == 1 and c.tk == 1),
    ("Dv != Dh", lambda c: c.dv != c.dh),
    ("Nkv = 1 < Nh", lambda c: c.nkv == 1 and c.nh > 1),
    ("Nh == Tk == Dh", lambda c: c.nh == c.tk == c.dh),
    ("GQA with >= 2 kv heads and >= 2 query heads each", lambda c: c.nkv >= 2 and c.nh // c.nkv >= 2),
    ("Tq != Tk with causal", lambda c: c.tq != c.tk and c.causal),
    ("Tq < Tk with causal (decode)", lambda c: c.tq < c.tk and c.causal),
    ("causal via allow_mask", lambda c: c.mask == "causal-mask"),
    ("padding with causal", lambda c: c.mask == "pad-causal"),
    ("padding", lambda c: c.mask == "pad"),
    ("no mask", lambda c: c.mask == "none"),
    ("B > 1 with several heads", lambda c: c.b > 1 and c.nh > 1),
    ("index inputs", lambda c: c.inputs == "index"),
    ("float64", lambda c: c.dtype == "f64"),
    ("large magnitudes in float16", lambda c: c.inputs == "large" and c.dtype == "f16"),
    ("large magnitudes in bfloat16", lambda c: c.inputs == "large" and c.dtype == "bf16"),
])
def test_grid_combines_the_axes(label, pred):
    assert _has(pred), label


def test_large_cases_reach_scores_above_100():
    for case in (c for c in DEFAULT_GRID if c.inputs == "large"):
        q, k, _, _ = case_inputs(case)
        s = q.double() @ k.double().repeat_interleave(case.nh // case.nkv, 1).transpose(-2, -1) / math.sqrt(case.dh)
        assert s.abs().max() > 100, case.id


def test_index_inputs_name_their_coordinates():
    q, k, v, _ = case_inputs("b2-h4kv2-tq5tk5-dh8dv8-none-index-f64")
    flat = torch.round((v + 1) * v.numel() / 2).long()
    assert torch.equal(flat.flatten(), torch.arange(v.numel()))


def test_case_inputs_reproduce_the_checked_call():
    q, k, v, kw = case_inputs("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32")
    assert kw["is_causal"] is True and kw["allow_mask"].shape == (2, 1, 1, 9)
    out = good_attention(q, k, v, **kw)
    q2, k2, v2, _ = case_inputs("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32")
    assert torch.equal(q, q2) and torch.equal(v, v2)
    assert out.shape == (2, 4, 5, 4)


# --- CLI ------------------------------------------------------------------------------------


def test_cli_good_kernel_one_case_exit_0():
    res = runner.invoke(app, ["check", GOOD, "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["verdict"], data["first_finding"]) == ("pass", None)
    assert (data["details"]["cases_total"], data["details"]["cases_failed"]) == (1, 0)
    table = runner.invoke(app, ["check", GOOD, "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"])
    assert table.exit_code == 0 and "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32" in table.output


def test_cli_finding_json_names_smallest_case_and_reproduction():
    fn = f"{KERNELS / 'sdpa_is_causal.py'}:attention"
    cases = ["b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32", "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32",
             "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32"]
    args = ["check", fn, "--format", "json"] + [a for c in cases for a in ("--case", c)]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    jsonschema.validate(data, schema())
    assert (data["schema_version"], data["command"], data["verdict"], data["tool"]) == (2, "check", "fail", "attn-ledger")
    details = data["details"]
    assert (details["protocol"], details["cases_total"], details["cases_failed"]) == ("kernel", 3, 2)
    assert "elapsed_s" not in details
    first = data["first_finding"]
    assert first["row"] == "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32"
    assert (first["level"], first["check"], first["status"], first["op"]) == (4, "reference", "fail", "<=")
    assert first["value"] > first["limit"] and first["location"] == {"example": 0, "head": 0, "query": 0}
    # rows run smallest first
    assert [(r["name"], r["status"]) for r in data["rows"]] == [(cases[1], "fail"), (cases[2], "pass"), (cases[0], "fail")]
    repro = details["reproduce"]
    assert repro["case"] == first["row"] and repro["cli"] == f"attn-ledger check {fn} --case {first['row']}"
    assert repro["cli"] in " ".join(data["notes"]).replace(" \\     --case ", " --case ")
    # the reproduction line reproduces
    again = runner.invoke(app, repro["cli"].split()[1:] + ["--format", "json"])
    assert again.exit_code == 1 and json.loads(again.stdout)["details"]["cases_failed"] == 1


def test_cli_json_is_byte_identical_between_runs_and_timings_only_on_request():
    args = ["check", GOOD, "--case", "b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32", "--format", "json"]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0 and first.stdout == second.stdout
    timed = runner.invoke(app, args + ["--timings"])
    assert timed.exit_code == 0 and json.loads(timed.stdout)["details"]["elapsed_s"] >= 0


def test_cli_junit_has_one_test_case_per_case_and_names_the_failing_check():
    fn = f"{KERNELS / 'manual_nan_rows.py'}:attention"
    cases = ["b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32", "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32",
             "b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32"]
    res = runner.invoke(app, ["check", fn, "--format", "junit"] + [a for c in cases for a in ("--case", c)])
    assert res.exit_code == 1, res.output
    suite = ET.fromstring(res.stdout).find("testsuite")
    tests = suite.findall("testcase")
    assert [t.get("name") for t in tests] == cases
    assert (suite.get("tests"), suite.get("failures")) == ("3", "2")
    failed = {t.get("name"): t.find("failure") for t in tests if t.find("failure") is not None}
    assert set(failed) == {cases[0], cases[2]}
    # the message names the check, its value and its limit
    assert failed[cases[2]].get("message") == f"{cases[2]}: L3 empty_rows = 20 (limit 0)"


def test_cli_markdown_has_the_cases_and_the_reproduction():
    fn = f"{KERNELS / 'manual_nan_rows.py'}:attention"
    case = "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32"
    res = runner.invoke(app, ["check", fn, "--format", "markdown", "--case", case])
    assert res.exit_code == 1
    assert f"| `{case}` | fail |" in res.stdout and "empty_rows" in res.stdout
    assert f"--case {case}" in res.stdout and f"case_inputs({case!r})" in res.stdout


def test_table_at_80_columns_keeps_every_token_whole():
    fn = load_object(f"{KERNELS / 'sdpa_is_causal.py'}:attention")
    ids = ["b2-h4kv2-tq5tk9-dh8dv4-causal-flag-index-f32", "b1-h3kv3-tq6tk3-dh4dv6-pad-causal-rand-f32"]
    report = check_kernel(fn, [parse_case(i) for i in ids], target=f"{KERNELS / 'sdpa_is_causal.py'}:attention")
    narrow, wide = render(report, "table", 80), render(report, "table", 400)
    # a split number or identifier would leave fragments that the wide table does not have
    # (the element count is a column when wide and a line of the checks cell when narrow: compare sets)
    assert {t for t in narrow.split() if set(t) != {"-"}} == {t for t in wide.split() if set(t) != {"-"}}
    assert all(i in narrow.split() for i in ids)


def test_table_at_80_columns_stays_within_80():
    report = check_kernel(catalogue.scale_ignored, [parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-s0.125")])
    assert max(len(ln) for ln in render(report, "table", 80).splitlines()) <= 80


def test_cli_empty_rows_option():
    args = ["check", f"{KERNELS / 'manual_nan_rows.py'}:attention", "--case", "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32"]
    assert runner.invoke(app, args + ["--empty-rows", "nan"]).exit_code == 0
    assert runner.invoke(app, args + ["--empty-rows", "any"]).exit_code == 0
    assert runner.invoke(app, args + ["--empty-rows", "ones"]).exit_code == 2
    finite = runner.invoke(app, args + ["--empty-rows", "finite"])  # its empty rows are NaN
    assert finite.exit_code == 1 and "empty_rows" in finite.stdout and "empty rows: finite" in finite.stdout
    uniform = ["check", f"{KERNELS / 'eager_additive.py'}:attention", "--case", args[-1]]
    assert runner.invoke(app, uniform + ["--empty-rows", "finite"]).exit_code == 0
    assert runner.invoke(app, uniform).exit_code == 1


def test_cli_kernel_that_raises_on_a_legal_case_is_a_level_1_finding(tmp_path):
    src = tmp_path / "square_only.py"
    src.write_text("def attention(q, k, v, **kw):\n    raise RuntimeError('only square shapes')\n")
    res = runner.invoke(app, ["check", f"{src}:attention", "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32",
                              "--format", "json"])
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    first = data["first_finding"]
    assert (first["level"], first["check"], first["status"]) == (1, "call", "fail")
    call = data["rows"][0]["checks"][0]
    assert call["data"] == {"exception": "RuntimeError", "message": "only square shapes"}
    assert {c["status"] for c in data["rows"][0]["checks"][1:]} == {"not_reached"}


@pytest.mark.parametrize("args", [
    ["check", "missing.py:attention"],
    ["check", f"{KERNELS / 'good.py'}:nope"],
    ["check", "no_colon_here"],
    ["check"],
    ["check", GOOD, "--module", "x.py:F"],
    ["check", GOOD, "--case", "not-a-case"],
    ["check", GOOD, "--embed-dim", "12"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "0", "--heads", "3"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "12", "--heads", "3",
     "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"],
    ["check", GOOD, "--window", "4"],
    ["check", GOOD, "--seq-len", "8"],
    *(["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "12", "--heads", "3", *extra]
      for extra in (["--window", "4", "--no-causal"], ["--window", "0"], ["--scale", "0"], ["--scale", "nan"],
                    ["--batch-size", "1"], ["--seq-len", "1"], ["--softcap", "0"], ["--softcap", "inf"])),
], ids=["missing-file", "missing-name", "bad-spec", "no-target", "both", "bad-case", "embed-dim-without-module",
        "module-without-sizes", "embed-dim-zero", "case-with-module", "window-without-module",
        "seq-len-without-module", "window-not-causal", "window-zero", "scale-zero", "scale-nan", "batch-size-one",
        "seq-len-one", "softcap-zero", "softcap-inf"])
def test_cli_setup_errors_exit_2_and_write_nothing(args, tmp_path):
    out = tmp_path / "report.json"
    res = runner.invoke(app, args + ["--output", str(out)])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and not out.exists()


def test_cli_import_error_in_user_file_is_setup_error(tmp_path):
    src = tmp_path / "broken.py"
    src.write_text("import not_a_module_anywhere\n")
    res = runner.invoke(app, ["check", f"{src}:attention"])
    assert res.exit_code == 2 and "ModuleNotFoundError" in res.output


def test_cli_module_protocol():
    good = runner.invoke(app, ["check", "--module", f"{KERNELS / 'good_module.py'}:make",
                               "--embed-dim", "12", "--heads", "3", "--format", "json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.stdout)["details"]["protocol"] == "module"
    bad = runner.invoke(app, ["check", "--module", "attn_ledger.probes.catalogue:_batch_first_module",
                              "--embed-dim", "12", "--heads", "3", "--no-causal", "--format", "json"])
    assert bad.exit_code == 1
    first = json.loads(bad.stdout)["first_finding"]
    assert (first["level"], first["check"]) == (2, "batch_independence")


def test_cli_module_sizes_and_declarations_reach_the_report():
    res = runner.invoke(app, ["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "12",
                              "--heads", "3", "--batch-size", "3", "--seq-len", "9", "--window", "9", "--scale",
                              "0.25", "--format", "json"])
    data = json.loads(res.stdout)
    assert data["details"]["sizes"] == {"B": 3, "T": 9, "E": 12, "Nh": 3}
    assert (data["details"]["window"], data["details"]["scale"]) == (9, 0.25)
    # a window of 9 at T = 9 never cuts, so the causal module matches it; its scale is the default
    # 1/sqrt(Dh) = 0.5, not the 0.25 declared
    checks = {c["name"]: c for r in data["rows"] for c in r["checks"]}
    assert checks["mask_relation"]["status"] == "pass"
    scale = checks["effective_scale"]
    assert (scale["status"], scale["limit"], scale["data"]["named"]) == ("fail", 0.25, ["1/sqrt(Dh)"])
    assert res.exit_code == 1 and data["first_finding"]["check"] == "effective_scale"


def test_check_help_and_docs_show_the_options():
    res = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    docs = (ROOT / "docs" / "check.md").read_text() + (ROOT / "docs" / "check-module.md").read_text()
    for opt in ("--case", "--empty-rows", "--module", "--embed-dim", "--heads", "--causal", "--format", "--seed",
                "--timeout", "--in-process", "--window", "--scale", "--softcap", "--batch-size", "--seq-len"):
        assert opt in res.output and opt in docs, opt
    assert "def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) -> Tensor" in docs


def test_benchmark_kernel_is_the_good_one():
    q, k, v, kw = case_inputs(Case(2, 4, 2, 5, 9, 8, 4, mask="causal-flag"))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(4))
    assert torch.allclose(good_attention(q, k, v, **kw), ref)


def test_cli_output_file_holds_the_json(tmp_path):
    out = tmp_path / "check.json"
    res = runner.invoke(app, ["check", GOOD, "--case", "b2-h4kv2-tq5tk9-dh8dv4-pad-empty-rand-f64",
                              "--format", "json", "--output", str(out)])
    assert res.exit_code == 0 and res.stdout == ""
    data = json.loads(out.read_text())
    jsonschema.validate(data, schema())
    assert data["verdict"] == "pass" and data["first_finding"] is None
    row = data["rows"][0]
    assert (row["name"], row["status"], row["fields"]) == ("b2-h4kv2-tq5tk9-dh8dv4-pad-empty-rand-f64", "pass",
                                                           {"elements": 752})
    assert [c["name"] for c in row["checks"]] == [name for _, name in CHECK_ORDER]
    empty = row["checks"][[name for _, name in CHECK_ORDER].index("empty_rows")]
    assert (empty["status"], empty["value"], empty["limit"], empty["data"]["empty_rows"]) == ("pass", 0, 0, 20)


def test_explicit_scale_cases_catch_a_kernel_that_ignores_scale():
    from attn_ledger.probes import catalogue
    from attn_ledger.probes.kernel.check import DEFAULT_GRID, check_kernel, parse_case

    scaled = [c for c in DEFAULT_GRID if c.scale is not None]
    assert scaled, "the default grid must pass an explicit scale somewhere"
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-s0.125")
    assert case.scale == 0.125 and case.id.endswith("-s0.125") and "scale=0.125" in case.call_text()
    bad = check_kernel(catalogue.scale_ignored, [case])
    first = bad.first_finding
    assert (first.row, first.level, first.name) == (case.id, 4, "reference")
    assert first.check.value > first.check.limit
    good = check_kernel(catalogue.scale_ignored, [parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")])
    assert good.exit_code == 0  # without an explicit scale the fault is invisible, which is why the grid has one


def test_index_inputs_say_where_a_wrong_value_came_from():
    from attn_ledger.probes import catalogue
    from attn_ledger.probes.kernel.check import check_kernel, parse_case

    case = "b2-h4kv2-tq5tk9-dh8dv4-causal-flag-index-f32"
    r = check_kernel(catalogue.causal_top_left, [parse_case(case)])
    ref = r.check(case, "reference")
    # top-left alignment: query 0 reads key 0 only, where bottom-right lets it mix keys 0..4
    assert ref.location == {"example": 0, "head": 0, "query": 0}
    assert ref.data["index_decode"] == {"source": {"example": 0, "kv_head": 0, "key": 0.0},
                                        "may_mix": {"example": 0, "kv_head": 0, "keys": [0, 4]}}
    assert "index decode" in note_text(r.row(case).note)  # the table shows it beside the case
    r = check_kernel(catalogue.causal_top_left, [parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32")])
    assert "index_decode" not in r.rows[0].check("reference").data


def test_cli_module_observation_in_the_worker_matches_in_process():
    args = ["check", "--module", f"{ROOT / 'fixtures' / 'modules' / 'attention_modules.py'}:mistral_window",
            "--embed-dim", "32", "--heads", "4", "--window", "4", "--seq-len", "8", "--format", "json"]
    worker = runner.invoke(app, args)
    here = runner.invoke(app, [*args, "--in-process"])
    assert worker.exit_code == here.exit_code == 0, worker.output
    assert worker.stdout == here.stdout
    observed = json.loads(worker.stdout)["details"]["observed"]
    assert observed["relation"] == "sliding window 4" and observed["rotary"]["pairing"] == "half"
