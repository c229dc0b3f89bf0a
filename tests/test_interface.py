"""``check --protocol transformers``: a function registered in transformers' AttentionInterface.

The parts that need no transformers (detection, ids, the reference, the declaration) always run;
calling a function needs transformers' mask functions, and those tests skip cleanly without the
``real`` extra. In-process, on the protocol's small cases: a few seconds each.
"""

import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.probes.interface.cases import allowed, case_tensors, interface_cases, parse_icase
from attn_ledger.probes.interface.check import Declaration, declaration, is_interface, reference

ROOT = Path(__file__).resolve().parents[1]
CUSTOM = ROOT / "fixtures" / "interface" / "custom.py"
sys.path.insert(0, str(CUSTOM.parent))
import custom as C  # noqa: E402

ALL = ("window", "softcap", "sinks")
runner = CliRunner()


def _check(fn, decl=None, ids=None, **kw):
    pytest.importorskip("transformers")
    from attn_ledger.probes.interface.check import check_interface

    return check_interface(fn, ids, target=f"custom.py:{fn.__name__}", declaration=decl or Declaration(supports=ALL), **kw)


# --- without transformers -------------------------------------------------------------------------


def test_detects_the_interface_signature():
    assert is_interface(inspect.signature(C.my_attention))
    assert not is_interface(inspect.signature(lambda q, k, v, allow_mask=None: q))
    assert not is_interface(inspect.signature(lambda module, q, k, v, mask: q))
    assert not is_interface("no signature")


def test_ids_round_trip_and_refuse_what_no_layer_calls():
    for c in interface_cases(ALL):
        assert parse_icase(c.id) == c
    with pytest.raises(InputError, match="mask 'none'"):
        parse_icase("b2-h4kv2-tq6tk6-d8-lpad2-none-f32")
    with pytest.raises(InputError, match="expected an id like"):
        parse_icase("b2-h4kv2-tq6tk6-d8-lpad2-flash-f32")


def test_cases_follow_the_declaration():
    plain = interface_cases()
    assert not any(c.softcap or c.sinks for c in plain)  # windows are in every plain case's mask, never passed
    assert not any(c.mask == "none" and c.window for c in plain)
    assert {c.mask for c in interface_cases(masks=("eager",))} == {"eager"}
    assert any(c.sinks for c in interface_cases(("sinks",))) and not any(c.sinks for c in interface_cases(("softcap",)))
    assert any(c.mask == "none" and c.window for c in interface_cases(("window",)))
    assert any(c.tq < c.tk for c in plain) and any(c.pad.startswith("lpad") for c in plain)
    assert {c.dtype for c in plain} == {"f32", "f16", "bf16"} and any(c.train for c in plain)


def test_declaration_reads_and_refuses():
    d = declaration({"masks": "eager", "supports": "sinks,window", "dtypes": ["f32"]})
    assert d == Declaration(masks=("eager",), dtypes=("float32",), supports=("window", "sinks"))
    with pytest.raises(InputError, match="supports: got 'bogus'"):
        declaration({"supports": "bogus"})
    with pytest.raises(InputError, match="gqa: does not apply"):
        declaration({"gqa": False})


def test_reference_counts_the_sink_in_the_denominator_only():
    case = parse_icase("b2-h4kv2-tq5tk5-d8-nopad-eager-f32-sinks")
    t = case_tensors(case)
    out, w = reference(case, t)
    plain, pw = reference(case, {k: v for k, v in t.items() if k != "sinks"} | {"sinks": t["sinks"]}, sinks=False)
    assert bool((w.sum(-1) < 1 - 1e-6).all()) and torch.allclose(pw.sum(-1), torch.ones(()).double())
    assert not torch.allclose(out, plain)


def test_the_relation_is_transformers_mask():
    mu = pytest.importorskip("transformers.masking_utils")
    from attn_ledger.probes.interface.cases import padding_mask

    for c in interface_cases(ALL):
        fn = mu.causal_mask_function if c.window is None else mu.sliding_window_causal_mask_function(c.window)
        theirs = mu.sdpa_mask(batch_size=c.b, q_length=c.tq, kv_length=c.tk, q_offset=c.tk - c.tq, mask_function=fn,
                              attention_mask=padding_mask(c), allow_is_causal_skip=False)
        assert torch.equal(theirs.expand(c.b, 1, c.tq, c.tk), allowed(c)), c.id


# --- calling functions --------------------------------------------------------------------------


def test_correct_custom_function_passes_every_case():
    report = _check(C.my_attention)
    assert report.exit_code == 0, report.first_finding
    assert report.details["cases_total"] == len(interface_cases(ALL, Declaration().masks)) and report.details["protocol"] == "transformers"


@pytest.mark.parametrize("fn, level, check, words", [
    (C.kv_not_repeated, 1, "call", "num_key_value_groups"),
    (C.kv_tiled, 2, "kv_head_isolation", "tiled"),
    (C.scaling_ignored, 4, "reference", "scaling ignored"),
    (C.mask_flipped, 3, "weights_sum", "wrong polarity"),
    (C.softcap_ignored, 4, "reference", "softcap ignored"),
    (C.sinks_dropped, 3, "weights_sum", "sinks"),
    (C.heads_first, 1, "layout", "[B, H, Tq, D]"),
    (C.window_too_wide, 4, "reference", "one wider than sliding_window"),
])
def test_each_bug_is_caught_at_its_level_and_named(fn, level, check, words):
    report = _check(fn)
    first = report.first_finding
    assert report.exit_code == 1 and (first.level, first.name) == (level, check), first
    assert words in first.check.reason, first.check.reason


def test_an_undeclared_feature_is_never_passed():
    seen = []

    def records(module, query, key, value, attention_mask, **kwargs):
        seen.append(set(kwargs))
        return C.my_attention(module, query, key, value, attention_mask, **kwargs)

    assert _check(records, Declaration()).exit_code == 0
    assert seen and all(k <= {"dropout", "scaling"} for k in seen)


def test_padded_rows_follow_the_finite_contract():
    def nan_rows(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out, w = C.my_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            dead = ~attention_mask.any(-1)  # [B, 1, Tq]
            out = out.masked_fill(dead.transpose(1, 2)[..., None], float("nan"))
        return out, w

    ids = ["b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32", "b2-h4kv2-tq6tk6-d8-lpad4-eager-f32"]
    report = _check(nan_rows, ids=ids)
    assert report.exit_code == 1 and report.first_finding.name == "padded_rows"
    assert _check(C.my_attention, ids=ids).exit_code == 0  # eager's uniform rows and sdpa's zeros both finite
    assert _check(nan_rows, ids=ids, empty_rows="any").exit_code == 0


def test_dropout_is_never_applied_in_eval():
    def always_drops(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return C.my_attention(module.train(), query, key, value, attention_mask, module.attention_dropout, scaling)

    report = _check(always_drops, Declaration(), ids=["b2-h4kv2-tq5tk5-d8-nopad-eager-f32"])
    assert report.exit_code == 1 and "dropout applied in eval" in report.first_finding.check.reason
    train = _check(C.my_attention, Declaration(), ids=["b2-h4kv2-tq5tk5-d8-nopad-eager-f32-train0.5"])
    assert train.exit_code == 0 and train.rows[0].check("reference").status == "not_applicable"


# --- L2: what leaks between examples and heads ----------------------------------------------------


def _leaks_example_0(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Every example's values carry half of example 0's."""
    return C.my_attention(module, query, key, value + 0.5 * value[:1], attention_mask, dropout, scaling, **kwargs)


def _leaks_query_heads(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Each query head's q carries half of the previous head's (the last head's reaches head 0)."""
    return C.my_attention(module, query + 0.5 * query.roll(1, dims=1), key, value, attention_mask, dropout, scaling,
                          **kwargs)


def _zeros(module, query, key, value, attention_mask, **kwargs):
    return query.new_zeros(query.shape).transpose(1, 2), None


ISOLATION = ("batch_isolation", "kv_head_isolation", "q_head_isolation")


def test_isolation_probes_pass_on_a_correct_function():
    report = _check(C.my_attention, ids=["b2-h4kv2-tq6tk6-d8-lpad4-eager-f32", "b2-h6kv2-tq4tk4-d8-nopad-sdpa-f32"])
    assert report.exit_code == 0
    for row in report.rows:
        for name in ISOLATION:
            check = row.check(name)
            assert (check.status, check.value) == ("pass", 0.0), (row.name, check)  # the rows that must stay, bit for bit
            assert check.data["moved_max"] > check.limit  # and those fed by the new inputs moved
    one = _check(C.my_attention, ids=["b1-h1kv1-tq3tk3-d8-nopad-sdpa-f32"]).rows[0]
    assert [one.check(n).status for n in ISOLATION] == ["not_applicable"] * 3


@pytest.mark.parametrize("fn, name, words", [
    (_leaks_example_0, "batch_isolation", "new inputs for example 0 moved the output of examples [0, 1], expected [0]"),
    (C.kv_tiled, "kv_head_isolation", "new keys and values for kv head 1 moved query heads [1, 3], expected [2, 3]: "
                                      "kv heads tiled (repeat) instead of repeated per group"),
    (_leaks_query_heads, "q_head_isolation", "a new query for head 3 moved the output of query heads [0, 3], "
                                             "expected [3]"),
])
def test_isolation_probes_name_what_leaks_where(fn, name, words):
    report = _check(fn, ids=["b2-h4kv2-tq5tk5-d8-nopad-sdpa-f32"])
    first = report.first_finding
    assert report.exit_code == 1 and (first.level, first.name) == (2, name), first
    assert words in first.check.reason and first.check.value > first.check.limit
    others = [c for c in report.rows[0].checks if c.name in ISOLATION and c.name != name]
    assert all(c.status == "pass" for c in others), others  # each probe names its own axis only


def test_an_isolation_probe_whose_rows_never_move_proves_nothing():
    row = _check(_zeros, ids=["b2-h4kv2-tq5tk5-d8-nopad-sdpa-f32"]).rows[0]
    assert {row.check(n).status for n in ISOLATION} == {"inconclusive"}
    assert row.check("reference").status == "fail"


# --- tiers ----------------------------------------------------------------------------------------


def test_the_full_tier_holds_every_allowed_pair_of_its_axes():
    import itertools

    from attn_ledger.probes.interface import cases as IC

    for axes in (IC._FULL_AXES, IC._FULL_FEATURE_AXES):
        names = list(axes)
        allowed_pairs = set()
        for values in itertools.product(*axes.values()):
            p = dict(zip(names, values))
            if IC._full_valid(p):
                allowed_pairs.update(((x, p[x]), (y, p[y])) for x, y in itertools.combinations(names, 2))

        def values(c):
            v = {"heads": (c.b, c.h, c.hkv), "lengths": (c.tq, c.tk), "d": c.d, "pad": c.pad, "mask": c.mask,
                 "dtype": c.dtype, "scaling": c.scaling, "window": c.window,
                 "features": tuple(f for f in ("window", "softcap", "sinks") if f in IC.needs(c))}
            return {k: v[k] for k in names}

        picked = [values(g.case) for g in IC.GRID if g.tier == "full" and g.reason.startswith("pairwise:")
                  and bool(IC.needs(g.case)) == ("features" in axes)]
        held = {((x, p[x]), (y, p[y])) for p in picked for x, y in itertools.combinations(names, 2)}
        assert allowed_pairs <= held, allowed_pairs - held


def test_the_full_tier_adds_real_sizes_groupings_and_feature_combinations():
    default = interface_cases(ALL, ("sdpa", "eager", "none"))
    full = interface_cases(ALL, ("sdpa", "eager", "none"), tier="full")
    assert set(default) < set(full) and all(parse_icase(c.id) == c for c in full)
    new = [c for c in full if c not in default]
    assert {c.groups for c in new} >= {1, 2, 3, 4, 8} and any(c.hkv == 1 and c.h > 1 for c in new)
    assert any(c.tq == 1 and c.tk >= 1024 for c in new) and any(1 < c.tq < c.tk for c in new)
    assert {c.dtype for c in new} == {"f32", "f16", "bf16"} and {c.d for c in new} >= {64, 128}
    assert any(c.softcap and c.sinks for c in new) and any(c.window and c.sinks for c in new)
    assert any(c.window and c.softcap for c in new) and any(c.mask == "none" and c.window for c in new)
    plain = interface_cases((), ("sdpa", "eager"), tier="full")
    assert not any(c.softcap or c.sinks or c.mask == "none" and c.window for c in plain)
    with pytest.raises(InputError, match="tier: got 'nightly'"):
        interface_cases(tier="nightly")


@pytest.mark.slow
def test_a_correct_function_passes_the_full_tier():
    report = _check(C.my_attention, tier="full")
    assert report.exit_code == 0, report.first_finding
    assert report.details["tier"] == "full" and report.details["cases_total"] > 90


def test_cli_lists_the_transformers_cases():
    res = runner.invoke(app, ["check", "--list-cases", "--protocol", "transformers", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    from attn_ledger.probes.interface.cases import GRID

    assert data["protocol"] == "transformers" and [c["id"] for c in data["cases"]] == [g.case.id for g in GRID]
    assert {c["tier"] for c in data["cases"]} == {"default", "features", "full"} and all(c["reason"] for c in data["cases"])
    table = runner.invoke(app, ["check", "--list-cases", "--protocol", "transformers"])
    assert table.exit_code == 0 and "b2-h4kv2-tq6tk6-d8-lpad4-flex-f32" in table.stdout
    assert f"--full adds {sum(g.tier == 'full' for g in GRID)};" in table.stdout


# --- transformers' own functions (the real extra) -------------------------------------------------


def _theirs(path, name):
    pytest.importorskip("transformers")
    import importlib

    return getattr(importlib.import_module(path), name)


@pytest.mark.parametrize("path, masks, supports", [
    ("transformers.models.llama.modeling_llama", ("eager",), ()),
    ("transformers.models.gemma2.modeling_gemma2", ("eager",), ("softcap",)),
    ("transformers.models.gpt_oss.modeling_gpt_oss", ("eager",), ("sinks",)),
])
def test_transformers_eager_functions_pass(path, masks, supports):
    fn = _theirs(path, "eager_attention_forward")
    report = _check(fn, Declaration(masks=masks, supports=supports))
    assert report.exit_code == 0, report.first_finding
    assert report.details["cases_total"] >= 14


def test_transformers_sdpa_function_passes_declaring_no_softcap_and_no_sinks():
    fn = _theirs("transformers.integrations.sdpa_attention", "sdpa_attention_forward")
    assert _check(fn, Declaration()).exit_code == 0
    with_cap = _check(fn, Declaration(supports=("softcap",)), ids=["b2-h4kv2-tq5tk5-d8-nopad-eager-f32-cap1.5"])
    assert with_cap.first_finding.name == "call"  # it raises on a soft-cap
    dropped = _check(fn, Declaration(supports=("sinks",)), ids=["b2-h4kv2-tq5tk5-d8-nopad-eager-f32-sinks"])
    assert dropped.exit_code == 1  # it ignores s_aux


FLEX = "transformers.integrations.flex_attention"
FLEX_IDS = ["b2-h4kv2-tq5tk5-d8-nopad-flex-f32", "b2-h4kv2-tq6tk6-d8-lpad4-flex-f32"]


@pytest.mark.slow
def test_transformers_flex_function_passes_on_block_masks_from_flex_attention_mask():
    fn = _theirs(FLEX, "flex_attention_forward")  # on CPU every new shape compiles (mask and forward)
    report = _check(fn, Declaration(masks=("flex",), supports=("softcap",)))
    assert report.exit_code == 0, report.first_finding
    assert report.details["cases_total"] == 4 and all("-flex-" in r.name for r in report.rows)
    padded = next(r for r in report.rows if r.name == FLEX_IDS[1])
    assert padded.check("padded_rows").status == "pass"  # flex gives a fully padded row zeros: finite
    assert {padded.check(n).status for n in ISOLATION} == {"pass"}
    assert padded.check("weights_sum").status == "not_applicable"  # no weights on the CPU (None)
    # transformers' flex applies sinks through the log-sum-exp, which it does not ask for on the CPU:
    sinks = _check(fn, Declaration(masks=("flex",), supports=("sinks",)), ids=[FLEX_IDS[0] + "-sinks"])
    assert sinks.first_finding.name == "call" and "cannot be run on CPU" in sinks.first_finding.check.reason


@pytest.mark.slow
def test_block_masks_reach_a_custom_function_and_a_misread_one_is_caught():
    pytest.importorskip("transformers")

    def tensor_masks_only(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        s = torch.matmul(query, key.repeat_interleave(2, dim=1).transpose(2, 3)) * scaling + attention_mask
        return torch.matmul(torch.softmax(s, -1), value.repeat_interleave(2, dim=1)).transpose(1, 2), None

    decl = Declaration(masks=("flex",))
    assert _check(C.my_attention, decl, ids=FLEX_IDS).exit_code == 0  # reads the BlockMask through its mask_mod
    flipped = _check(C.mask_flipped, decl, ids=FLEX_IDS)
    assert flipped.exit_code == 1 and "wrong polarity" in flipped.first_finding.check.reason
    raised = _check(tensor_masks_only, decl, ids=FLEX_IDS[:1]).first_finding
    assert (raised.level, raised.name) == (1, "call") and "BlockMask" in raised.check.reason


# --- the command ------------------------------------------------------------------------------


def test_cli_detects_the_protocol_and_says_so():
    pytest.importorskip("transformers")
    res = runner.invoke(app, ["check", f"{CUSTOM}:my_attention", "--supports", "window,softcap,sinks",
                              "--in-process", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["details"]["protocol"] == "transformers" and data["details"]["detected"] is True
    table = runner.invoke(app, ["check", f"{CUSTOM}:heads_first", "--in-process"])
    assert table.exit_code == 1 and "detected from the signature" in table.stdout
    assert "layer_call(" in table.stdout and "--protocol transformers" in table.stdout


def test_cli_without_transformers_is_one_line_exit_2(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    res = runner.invoke(app, ["check", f"{CUSTOM}:my_attention", "--protocol", "transformers", "--in-process"])
    assert res.exit_code == 2
    assert "needs transformers" in res.output and len(res.output.strip().splitlines()) == 1


def test_cli_refuses_kernel_options_with_the_transformers_protocol():
    res = runner.invoke(app, ["check", f"{CUSTOM}:my_attention", "--protocol", "transformers", "--no-gqa"])
    assert res.exit_code == 2 and "--gqa/--no-gqa" in res.output


def test_pytest_helper_takes_the_protocol():
    pytest.importorskip("transformers")
    from attn_ledger.testing import assert_attention_matches

    assert_attention_matches(C.my_attention, "b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32")
    with pytest.raises(AssertionError, match="layout"):
        assert_attention_matches(C.heads_first, "b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32")
    assert_attention_matches(C.my_attention, "b2-h4kv2-tq5tk5-d8-nopad-eager-f32-sinks", supports=["sinks"],
                             protocol="transformers")
