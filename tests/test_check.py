"""``attn-ledger check`` and :mod:`attn_ledger.kernelcheck`: the grid, every check passing and failing, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from attn_ledger import catalogue
from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.kernelcheck import (
    CHECK_ORDER,
    DEFAULT_GRID,
    Case,
    case_inputs,
    check_case,
    check_kernel,
    parse_case,
)
from attn_ledger.userload import load_object

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


def manual_nan_rows(q, k, v, **kw):
    return load_object(f"{KERNELS / 'manual_nan_rows.py'}:attention")(q, k, v, **kw)


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
]


@pytest.mark.parametrize("name,kernel,case_id,level,first", BREAKERS, ids=[b[0] for b in BREAKERS])
def test_each_check_fails_on_a_kernel_built_to_break_it(name, kernel, case_id, level, first):
    result = check_case(kernel, parse_case(case_id))
    assert result.check(name).ok is False, result.check(name).detail
    assert result.first_failure.level == level
    if first is not None:
        assert result.first_failure.name == first
    # the same case passes that check on the correct kernel
    assert check_case(good_attention, parse_case(case_id)).check(name).ok is True


def test_every_check_breaker_is_listed():
    assert {b[0] for b in BREAKERS} == {name for _, name in CHECK_ORDER}


def test_good_kernel_passes_the_default_grid_and_every_check_runs():
    report = check_kernel(good_attention, target=GOOD)
    assert report.exit_code == 0, report.diagnosis()
    assert report.skipped == ()  # float16 and bfloat16 run on this CPU build
    evaluated = {c.name for r in report.results for c in r.checks if c.ok is True}
    assert evaluated == {name for _, name in CHECK_ORDER}
    assert report.smallest_failing is None and report.reproduction() is None


def test_no_scale_passes_levels_1_to_3_everywhere():
    report = check_kernel(catalogue.no_scale)
    assert report.first_level == 4
    assert {r.first_failure.name for r in report.failing} == {"reference"}


def test_empty_row_contract_is_stated_not_silent():
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32")
    assert check_case(manual_nan_rows, case).check("empty_rows").ok is False
    assert check_case(manual_nan_rows, case, empty_rows="nan").check("empty_rows").ok is True
    assert check_case(manual_nan_rows, case, empty_rows="any").check("empty_rows").ok is None  # not judged
    assert check_case(good_attention, case, empty_rows="nan").check("empty_rows").ok is False
    with pytest.raises(InputError):
        check_case(good_attention, case, empty_rows="ones")


def test_sdpa_is_causal_is_wrong_for_decode_shapes_only():
    fn = load_object(f"{KERNELS / 'sdpa_is_causal.py'}:attention")
    report = check_kernel(fn)
    failing = {r.case.id for r in report.failing}
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
    res = runner.invoke(app, ["check", GOOD, "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"])
    assert res.exit_code == 0, res.output
    assert "all 1 cases pass" in res.output


def test_cli_finding_json_names_smallest_case_and_reproduction():
    fn = f"{KERNELS / 'sdpa_is_causal.py'}:attention"
    cases = ["b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32", "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32",
             "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32"]
    args = ["check", fn, "--format", "json"] + [a for c in cases for a in ("--case", c)]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["command"] == "check" and data["verdict"] == "fail" and data["tool"] == "attn-ledger"
    assert data["cases_total"] == 3 and data["cases_failed"] == 2
    small = data["smallest_failing"]
    assert small["case"] == "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32"
    assert (small["level"], small["check"]) == (4, "reference")
    assert small["reproduce_cli"] == f"attn-ledger check {fn} --case {small['case']}"
    # the reproduction line reproduces
    again = runner.invoke(app, small["reproduce_cli"].split()[1:] + ["--format", "json"])
    assert again.exit_code == 1 and json.loads(again.stdout)["cases_failed"] == 1


def test_cli_markdown_has_the_ledger_and_the_summary():
    res = runner.invoke(app, ["check", f"{KERNELS / 'manual_nan_rows.py'}:attention", "--format", "markdown",
                              "--case", "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32"])
    assert res.exit_code == 1
    assert "| L3 | empty_rows | FIRST |" in res.stdout and "## Cases" in res.stdout


def test_cli_empty_rows_option():
    args = ["check", f"{KERNELS / 'manual_nan_rows.py'}:attention", "--case", "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32"]
    assert runner.invoke(app, args + ["--empty-rows", "nan"]).exit_code == 0
    assert runner.invoke(app, args + ["--empty-rows", "any"]).exit_code == 0
    assert runner.invoke(app, args + ["--empty-rows", "ones"]).exit_code == 2


def test_cli_kernel_that_raises_on_a_legal_case_is_a_level_1_finding(tmp_path):
    src = tmp_path / "square_only.py"
    src.write_text("def attention(q, k, v, **kw):\n    raise RuntimeError('only square shapes')\n")
    res = runner.invoke(app, ["check", f"{src}:attention", "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32",
                              "--format", "json"])
    assert res.exit_code == 1
    first = json.loads(res.stdout)["cases"][0]["first_failure"]
    assert (first["level"], first["check"]) == (1, "call") and "only square shapes" in first["detail"]


@pytest.mark.parametrize("args", [
    ["check", "missing.py:attention"],
    ["check", f"{KERNELS / 'good.py'}:nope"],
    ["check", "no_colon_here"],
    ["check"],
    ["check", GOOD, "--module", "x.py:F"],
    ["check", GOOD, "--case", "not-a-case"],
    ["check", GOOD, "--embed-dim", "12"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "10", "--heads", "3"],
    ["check", "--module", f"{KERNELS / 'good_module.py'}:make", "--embed-dim", "12", "--heads", "3",
     "--case", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"],
], ids=["missing-file", "missing-name", "bad-spec", "no-target", "both", "bad-case", "embed-dim-without-module",
        "module-without-sizes", "indivisible", "case-with-module"])
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
    assert json.loads(good.stdout)["protocol"] == "module"
    bad = runner.invoke(app, ["check", "--module", "attn_ledger.catalogue:_batch_first_module",
                              "--embed-dim", "12", "--heads", "3", "--no-causal", "--format", "json"])
    assert bad.exit_code == 1
    first = json.loads(bad.stdout)["first_finding"]
    assert (first["level"], first["check"]) == (2, "batch_independence")


def test_check_help_and_docs_show_the_options():
    res = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    docs = (ROOT / "README.md").read_text()
    for opt in ("--case", "--empty-rows", "--module", "--embed-dim", "--heads", "--causal", "--format", "--seed"):
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
    assert data["verdict"] == "pass" and data["cases"][0]["case"]["id"] == "b2-h4kv2-tq5tk9-dh8dv4-pad-empty-rand-f64"
    assert data["cases"][0]["checks"][0] == {"level": 1, "name": "call", "ok": True, "value": None,
                                             "detail": "attention(q, k, v, allow_mask=key_padding(lengths=[8, 0])"
                                                       "[B, 1, 1, Tk]) returned", "severity": "error"}


def test_explicit_scale_cases_catch_a_kernel_that_ignores_scale():
    from attn_ledger import catalogue
    from attn_ledger.kernelcheck import DEFAULT_GRID, check_kernel, parse_case

    scaled = [c for c in DEFAULT_GRID if c.scale is not None]
    assert scaled, "the default grid must pass an explicit scale somewhere"
    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-s0.125")
    assert case.scale == 0.125 and case.id.endswith("-s0.125") and "scale=0.125" in case.call_text()
    bad = check_kernel(catalogue.scale_ignored, [case])
    first = bad.results[0].first_failure
    assert (first.level, first.name) == (4, "reference")
    good = check_kernel(catalogue.scale_ignored, [parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")])
    assert good.exit_code == 0  # without an explicit scale the fault is invisible, which is why the grid has one


def test_index_inputs_say_where_a_wrong_value_came_from():
    from attn_ledger import catalogue
    from attn_ledger.kernelcheck import check_kernel, parse_case

    r = check_kernel(catalogue.causal_top_left, [parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-index-f32")])
    detail = r.results[0].check("reference").detail
    assert "index decode" in detail and "batch 0, kv head 0" in detail and "keys 0..4" in detail
    r = check_kernel(catalogue.causal_top_left, [parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32")])
    assert "index decode" not in r.results[0].check("reference").detail
