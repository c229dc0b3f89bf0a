"""``attn-ledger scan``'s parts that need no transformers: the generated inputs, the expectations read from a
config, the per-call judge on calls built here (correct, and each bug it names), and bad input on the CLI.

The real models are in tests/test_scan_real.py (the ``real`` extra).
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.maths.rotary import RotarySpec, apply_rotary
from attn_ledger.probes.model.expect import Declared, Expected, expect
from attn_ledger.probes.model.inputs import InputPlan, generate_positions, make_inputs, pad_counts, valid_positions
from attn_ledger.probes.model.judge import Call, Sides, judge_call, sample_rows
from attn_ledger.probes.model.scan import Judge, ScanOptions, scan_report
from attn_ledger.probes.model.targets import parse_set, target, tiny_defaults

runner = CliRunner()


# --- inputs ---------------------------------------------------------------------------------------------


def test_padding_leaves_the_first_example_whole_and_pads_the_last_by_half():
    assert pad_counts(2, 24, "left") == [0, 12]
    assert pad_counts(3, 10, "right") == [0, 2, 5]
    assert pad_counts(1, 24, "left") == [6]
    assert pad_counts(2, 24, "none") == [0, 0]
    v = valid_positions([0, 3], 6, "left")
    assert v.tolist() == [[True] * 6, [False] * 3 + [True] * 3]
    assert valid_positions([0, 3], 6, "right")[1].tolist() == [True] * 3 + [False] * 3


def test_position_ids_are_made_as_generate_makes_them():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert generate_positions(mask).tolist() == [[0, 1, 2, 3], [1, 1, 0, 1]]


def test_inputs_follow_the_architecture_and_the_seed():
    facts = {"architecture": "decoder", "vocab_size": 50, "pad_token_id": 0, "takes_position_ids": True}
    a = make_inputs(InputPlan(2, 8, "left", 3), facts)
    b = make_inputs(InputPlan(2, 8, "left", 3), facts)
    assert all(torch.equal(a[n], b[n]) for n in a) and set(a) == {"input_ids", "attention_mask", "position_ids"}
    assert a["attention_mask"].tolist()[1] == [0] * 4 + [1] * 4
    assert (a["input_ids"][1, :4] == 0).all() and (a["input_ids"][a["attention_mask"] == 1] > 0).all()
    assert not torch.equal(a["input_ids"], make_inputs(InputPlan(2, 8, "left", 4), facts)["input_ids"])
    t5 = make_inputs(InputPlan(2, 8, "right", 0, decoder_len=5),
                     {"architecture": "encoder-decoder", "vocab_size": 50, "pad_token_id": 0, "decoder_start_token_id": 0})
    assert t5["decoder_input_ids"].shape == (2, 5) and "position_ids" not in t5 and (t5["decoder_input_ids"][:, 0] == 0).all()
    with pytest.raises(InputError, match="--decoder-len"):
        make_inputs(InputPlan(2, 8, "none", 0, decoder_len=4), facts)
    with pytest.raises(InputError, match="--padding"):
        InputPlan(2, 8, "middle")
    with pytest.raises(InputError, match="--seq-len: got 1"):
        InputPlan(2, 1)


def test_set_values_read_as_json_where_they_are_json():
    assert parse_set(["num_hidden_layers=4", "rope_theta=5e5", "use_sliding_window=false", "act=gelu",
                      "layer_types=[\"full_attention\"]"]) == (
        ("num_hidden_layers", 4), ("rope_theta", 5e5), ("use_sliding_window", False), ("act", "gelu"),
        ("layer_types", ["full_attention"]))
    for bad in ("num_hidden_layers", "=3", "a b=1"):
        with pytest.raises(InputError, match="--set"):
            parse_set([bad])


def test_targets_refuse_what_does_not_fit_before_any_model_is_built():
    with pytest.raises(InputError, match="--tiny"):
        target("transformers", "llama", tiny=True)
    with pytest.raises(InputError, match="--register"):
        target("transformers", "llama", register="x.py:f")
    with pytest.raises(InputError, match="--register"):
        target("transformers", "llama", register="x.py:f", implementation="sdpa")
    with pytest.raises(InputError, match="--mask-format"):
        target("transformers", "llama", mask_format="eager")
    with pytest.raises(InputError, match="--set"):
        target("factory", "x.py:make", overrides=["a=1"])


def test_small_defaults_bind_the_window_and_keep_family_keys():
    assert tiny_defaults("mistral", ["hidden_size", "sliding_window"])["sliding_window"] == 16
    assert tiny_defaults("gemma2")["query_pre_attn_scalar"] == 24
    assert "hidden_size" not in tiny_defaults("gpt2") and tiny_defaults("gpt2")["n_layer"] == 2
    assert set(tiny_defaults("llama", ["hidden_size", "vocab_size"])) == {"hidden_size", "vocab_size"}


# --- expectations from the config -------------------------------------------------------------------------


def _model(model_type, arch="decoder", **config):
    return {"model_type": model_type, "architecture": arch, "config": config}


def test_expectations_follow_the_config():
    llama = expect(_model("llama", head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                   {"path": "layers.1.self_attn", "width": 16})
    assert (llama.relation, llama.window, llama.layer, llama.rotary["pairing"]) == ("causal", None, 1, "half")
    assert math.isclose(llama.scale, 0.25)
    gemma = _model("gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=50.0,
                   layer_types=["sliding_attention", "full_attention"])
    g0, g1 = (expect(gemma, {"path": f"layers.{i}.self_attn", "layer": i}) for i in (0, 1))
    assert (g0.window, g1.window, g0.softcap) == (16, None, 50.0) and math.isclose(g0.scale, 24 ** -0.5)
    gpt2 = _model("gpt2", n_embd=64, n_head=4, scale_attn_by_inverse_layer_idx=True)
    assert math.isclose(expect(gpt2, {"path": "h.2.attn", "layer": 2}).scale, 0.25 / 3)
    t5 = _model("t5", "encoder-decoder", d_kv=16)
    cross = expect(t5, {"path": "decoder.block.0.layer.1.EncDecAttention", "cross": True})
    dec = expect(t5, {"path": "decoder.block.0.layer.0.SelfAttention"})
    enc = expect(t5, {"path": "encoder.block.0.layer.0.SelfAttention"})
    assert (cross.relation, cross.queries, cross.keys, cross.scale) == ("bidirectional", "decoder", "input", 1.0)
    assert (dec.relation, dec.keys, enc.relation) == ("causal", "decoder", "bidirectional")
    assert expect(_model("bert", "encoder", hidden_size=64, num_attention_heads=4), {"path": "x"}).relation == "bidirectional"
    yarn = expect(_model("gpt_oss", rope_parameters={"rope_type": "yarn", "rope_theta": 1e5}), {"path": "layers.0.x"})
    assert yarn.rotary is None and "yarn" in yarn.rotary_note and yarn.sinks


def test_a_model_of_ones_own_is_judged_against_declarations_or_reported():
    assert expect({}, {"path": "blocks.0.attn"}, Declared()).relation == "found"
    d = expect({}, {"path": "blocks.0.attn"}, Declared(window=4))
    assert (d.relation, d.window, d.judged) == ("causal", 4, True)
    assert expect({}, {"path": "x"}, Declared(causal=False)).relation == "bidirectional"


# --- the judge on calls built here ------------------------------------------------------------------------

B, NH, NKV, T, D = 2, 4, 2, 12, 8
PADS = [0, 5]


def _call(bug: str | None = None, *, window: int | None = None, side: str = "left", seed: int = 0,
          rotary: str | None = None) -> tuple[Call, Expected, Sides]:
    """A call as transformers' eager makes it (additive mask, float32 softmax), or with one bug."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (NH, NKV, NKV))
    valid = valid_positions(PADS, T, side)
    positions = generate_positions(valid.long())
    q_pre = k_pre = None
    if rotary is not None:
        q_pre, k_pre = q, k
        spec = RotarySpec(rotary)
        q, k = (apply_rotary(x, spec, positions=positions[:, None, :]) for x in (q_pre, k_pre))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    w_used = window + (1 if bug == "wide" else 0) if window is not None else None
    rel = (j <= i) & ((j > i - w_used) if w_used is not None else True)
    allow = rel[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
    if bug == "padding":
        allow = rel[None, None].expand(B, 1, T, T)
    scale = D ** -0.5
    kk, vv = ((x.repeat(1, NH // NKV, 1, 1) if bug == "tiled" else x.repeat_interleave(NH // NKV, 1)) for x in (k, v))
    s = q @ kk.transpose(-2, -1) * (1.0 if bug == "scale" else scale)
    mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)
    used = torch.where(~allow, 0.0, torch.finfo(torch.float32).min) if bug == "polarity" else mask
    w = torch.softmax(s + used, dim=-1)
    ctx = w @ vv  # [B, Nh, T, D]
    if bug == "joined":  # the batch laid end to end under one causal mask, its own mask unused
        flat = [x.transpose(0, 1).reshape(1, NH, B * T, D) for x in (q, kk, vv)]
        one = torch.ones(B * T, B * T, dtype=torch.bool).tril()
        wj = torch.softmax((flat[0] @ flat[1].transpose(-2, -1) * scale).masked_fill(~one, float("-inf")), dim=-1)
        ctx = (wj @ flat[2]).reshape(NH, B, T, D).transpose(0, 1)
    if bug == "nan_padded":
        ctx[1, :, 0] = float("nan")
    if bug == "garbage_padded":  # rows nobody reads may hold anything finite
        ctx[1][:, ~valid[1]] = 123.0
    returned = ctx if bug == "heads_first" else ctx.transpose(1, 2).contiguous()
    window_mask = mask if window is None else torch.where(
        rel[None, None] & (j > i - window) & valid[:, None, None, :], 0.0, torch.finfo(torch.float32).min)
    facts = {"entry": 0, "call": 0, "path": "layers.0.self_attn", "via": "interface", "implementation": "eager",
             "kwargs": {"scaling": scale}, "context_layout": "bthd", "module": {"is_causal": True}}
    call = Call(facts, q, k, v, returned, None, None if bug == "joined" else w, window_mask if bug != "wide" else mask, None, None, q_pre, k_pre)
    rot = {"pairing": "half", "base": 10000.0, "rotated_dim": None} if rotary is not None else None
    exp = Expected("causal", window, scale, "1/sqrt(head_dim 8)", rot, "", None, False, "input", "input", 0)
    return call, exp, Sides({"input": valid}, positions)


def _first(bug=None, **kw):
    call, exp, sides = _call(bug, **kw)
    v = judge_call(call, exp, sides)
    return v, v.first_failure()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("window", [None, 4])
def test_a_correct_call_passes_and_its_padded_rows_are_judged_only_as_finite(side, window):
    for bug in (None, "garbage_padded"):
        v, first = _first(bug, window=window, side=side)
        assert first is None, first
        ref = next(c for c in v.checks if c.name == "reference")
        assert ref.passed and ref.data["ratio"] < 0.5  # the margin a correct call keeps under its bound


@pytest.mark.parametrize("bug, check, words", [
    ("tiled", "reference", "kv heads tiled"),
    ("scale", "reference", "no scale applied"),
    ("polarity", "forbidden_weight", "wrong polarity"),
    ("padding", "forbidden_weight", "padding ignored"),
    ("heads_first", "layout", "transposed back"),
    ("nan_padded", "finite", ""),
    ("joined", "reference", "the batch read as one sequence"),
])
def test_each_bug_is_named_at_its_check_with_its_diagnosis(bug, check, words):
    _, first = _first(bug)
    assert first is not None and first.name == check, first
    assert words in first.reason + str(first.data.get("diagnosis", ""))


def test_a_window_one_too_wide_is_named():
    _, first = _first("wide", window=4)
    assert first.name == "forbidden_weight" and "one wider than sliding_window=4" in first.reason


def test_rotary_is_judged_from_the_projections():
    v, first = _first(rotary="half")
    assert first is None and next(c for c in v.checks if c.name == "rotary").passed
    _, first = _first(rotary="interleaved")
    assert first.name == "rotary" and "adjacent pairs" in first.reason


def test_a_large_layer_is_sampled_saying_so():
    assert sample_rows(1, 12, 64, 64, budget=1 << 22) is None
    rows = sample_rows(1, 12, 1024, 1024, budget=1 << 22)
    assert rows[0] == 0 and rows[-1] == 1023 and len(rows) == (1 << 22) // (12 * 1024)


def test_calls_after_the_first_wrong_one_are_downstream_unless_kept_going():
    for keep in (False, True):
        judge = Judge({}, _call()[2], ScanOptions(keep_going=keep, declared=Declared(causal=True)))
        for i, bug in enumerate(("tiled", None, "tiled")):
            call, _, _ = _call(bug, side="left")
            facts = {**call.facts, "entry": i, "path": f"layers.{i}.self_attn", "mask": {"key": f"m{i}", "new": True}}
            tensors = {"q": call.q, "k": call.k, "v": call.v, "context": call.returned, "weights": call.weights,
                       "mask": call.mask}
            judge.take(facts, tensors)
        report = scan_report({}, judge, {"calls": 3}, {"given": None}, "synthetic")
        assert report.first_finding.row == "layers.0.self_attn" and report.exit_code == 1
        statuses = [r.status for r in report.rows]
        assert statuses == (["fail", "pass", "downstream"] if keep else ["fail", "downstream", "downstream"])


# --- the command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    ([], "exactly one of"),
    (["x.py:make", "--transformers", "llama"], "exactly one of"),
    (["--transformers", "llama", "--set", "hidden_size"], "--set: got 'hidden_size'"),
    (["--transformers", "llama", "--tiny"], "--tiny"),
    (["--transformers", "llama", "--register", "x.py:f"], "--register"),
    (["--transformers", "llama", "--padding", "middle"], "--padding"),
    (["--transformers", "llama", "--batch", "0"], "--batch: got 0"),
    (["--transformers", "llama", "--causal"], "--causal/--no-causal"),
    (["--transformers", "missing.json"], "--transformers"),
    (["--transformers", "llama", "--save", "README.md"], "--save"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    result = runner.invoke(app, ["scan", *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output


# --- the stage ledger: an additive bias and the context's layout in run --tensors --------------------------


def _biased(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6, generator=g)
    allow = torch.ones(6, 6, dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2) * 8 ** -0.5 + bias).masked_fill(~allow, float("-inf"))
    return q, k, v, bias, allow, torch.softmax(s, dim=-1) @ v  # out [B, Nh, Tq, Dv]


def test_a_bias_joins_the_scores_stage_in_the_pipeline_and_every_reference():
    from attn_ledger.ledger import ledger_on_qkv

    q, k, v, bias, allow, out = _biased()
    assert ledger_on_qkv(q, k, v, allow_mask=allow, out=out, bias=bias).verdict == "pass"
    assert ledger_on_qkv(q, k, v, allow_mask=allow, out=out.transpose(1, 2), bias=bias, out_layout="bthd").verdict == "pass"
    r = ledger_on_qkv(q, k, v, allow_mask=allow, out=out)  # the same output judged without the bias it was made with
    assert (r.first_finding.row, r.first_finding.name) == ("context", "user_out_matches_reference")
    r = ledger_on_qkv(q, k, v, allow_mask=allow, out=out, bias=-bias)
    assert r.first_finding.row == "context"
    for bad, words in (({"bias": bias[..., :5]}, "bias: got shape"), ({"bias": bias, "grad": True}, "grad: got it"),
                       ({"bias": bias.masked_fill(allow, float("nan"))}, "NaN"),
                       ({"out": out, "out_layout": "thbd"}, "out_layout")):
        with pytest.raises(InputError, match=words):
            ledger_on_qkv(q, k, v, allow_mask=allow, **{"out": out, **bad})


def test_out_layout_is_for_saved_tensors_only():
    result = runner.invoke(app, ["run", "--out-layout", "bthd"])
    assert result.exit_code == 2 and "--out-layout" in result.output


def test_the_first_wrong_call_opens_onto_its_stage_ledger_and_saved_calls_replay(tmp_path):
    from attn_ledger.ledger import run_ledger_tensors
    from attn_ledger.probes.model.scan import first_ledger

    _, exp, sides = _call()
    judge = Judge({}, sides, ScanOptions(keep_going=True, declared=Declared(causal=True)))
    judge.save_dir = str(tmp_path)
    for i, bug in enumerate((None, "tiled")):
        call, _, _ = _call(bug)
        facts = {**call.facts, "entry": i, "index": i, "path": f"layers.{i}.self_attn",
                 "mask": {"key": f"m{i}", "new": True}}
        judge.take(facts, {"q": call.q, "k": call.k, "v": call.v, "context": call.returned, "weights": call.weights,
                           "mask": call.mask})
    ledger = first_ledger(judge)
    assert ledger.command == "run" and "layers.1.self_attn, example" in ledger.title
    assert ledger.first_finding.row in ("weights", "context")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["000-layers.0.self_attn-b0.safetensors", "000-layers.0.self_attn-b1.safetensors",
                     "001-layers.1.self_attn-b0.safetensors", "001-layers.1.self_attn-b1.safetensors"]
    verdicts = [run_ledger_tensors(tmp_path / f, out_layout="bthd").verdict for f in files]
    assert verdicts == ["pass", "pass", "fail", "fail"]


# --- faces: JUnit, GitHub, JSON; a model of one's own; the pytest helper -----------------------------------


def _synthetic_report(keep_going: bool = True):
    judge = Judge({}, _call()[2], ScanOptions(keep_going=keep_going, declared=Declared(causal=True)))
    for i, bug in enumerate((None, "tiled", "tiled")):
        call, _, _ = _call(bug)
        facts = {**call.facts, "entry": i, "index": i, "path": f"layers.{i}.self_attn",
                 "mask": {"key": f"m{i}", "new": True}}
        judge.take(facts, {"q": call.q, "k": call.k, "v": call.v, "context": call.returned, "weights": call.weights,
                           "mask": call.mask})
    from attn_ledger.probes.model.scan import first_ledger

    return scan_report({}, judge, {"calls": 3}, {"given": None}, "synthetic", first_ledger(judge))


def test_junit_has_one_case_per_call_and_github_one_error_per_failing_call():
    import xml.etree.ElementTree as ET

    from attn_ledger.render import render

    report = _synthetic_report()
    suite = ET.fromstring(render(report, "junit")).find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [f"layers.{i}.self_attn" for i in range(3)]
    assert [c.find("failure") is not None for c in cases] == [False, True, False]
    assert cases[2].find("skipped").get("message").startswith("downstream")  # judged, and behind the first finding
    errors = [ln for ln in render(report, "github").splitlines() if ln.startswith("::error")]
    assert len(errors) == 1 and "layers.1.self_attn L4 reference" in errors[0]


def test_the_json_document_carries_the_ledger_and_meets_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import json

    from attn_ledger.render import render
    from attn_ledger.render.jsondoc import schema

    doc = json.loads(render(_synthetic_report(), "json"))
    jsonschema.validate(doc, schema())
    assert doc["command"] == "scan" and doc["first_finding"]["row"] == "layers.1.self_attn"
    assert doc["ledger"]["command"] == "run" and doc["ledger"]["verdict"] == "fail"
    assert [r["status"] for r in doc["rows"]] == ["pass", "fail", "downstream"]


def _own(*causal: bool):
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    sys.path.insert(0, str(here))
    try:
        import own
    finally:
        sys.path.remove(str(here))
    return own._made(list(causal))


def test_a_model_of_ones_own_has_its_attention_modules_found_and_judged_against_declarations():
    from attn_ledger.probes.model.scan import scan_model

    model, x = _own(True, True, False, True)
    report = scan_model(model, x, causal=True)
    assert [r.name for r in report.rows] == ["0", "1", "2", "3"] and report.first_finding.row == "2"
    assert "no causal mask" in report.first_finding.check.reason
    assert scan_model(model, x, causal=True, keep_going=True).rows[3].status == "pass"
    undeclared = scan_model(*_own(True, False))
    assert undeclared.exit_code == 0 and undeclared.coverage.missing == ("relation",)  # reported, not judged


def test_the_pytest_helper_passes_a_correct_model_and_names_the_first_wrong_call():
    from attn_ledger.testing import assert_model_attention_ok

    assert_model_attention_ok(*_own(True, True), causal=True)
    with pytest.raises(AssertionError) as info:
        assert_model_attention_ok(*_own(True, False, True), causal=True, label="stack")
    text = str(info.value)
    assert "first wrong call 1: L4 relation" in text and "stage ledger of 1:" in text
    assert "  2 " in text and "downstream" in text
