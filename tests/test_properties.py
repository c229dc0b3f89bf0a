"""The properties row (boundary properties on a probe), run --replay, the rope stage, and the seed 002 fields."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.maths import pipeline as P
from attn_ledger.cli import app
from attn_ledger.inputs.config import PROPERTY_FAULTS, load_config
from attn_ledger.engine.properties import PROPERTIES
from attn_ledger.ledger import config_stages, ledger_on_qkv, run_ledger
from attn_ledger.render.jsondoc import schema
from attn_ledger.render.notes import note_text, notes_text

runner = CliRunner()


def ledger(keep_going: bool = False, ops=None, **overrides):
    return run_ledger(load_config(overrides=overrides), keep_going=keep_going, ops=ops)


# --- boundary properties ------------------------------------------------------------------------

def test_every_property_runs_and_holds_on_the_default_config():
    led = ledger(grad=True)
    row = led.row("properties")
    assert row.status == "pass"
    assert [c.name for c in row.checks] == list(PROPERTIES)
    assert all(c.status == "pass" for c in row.checks)
    assert row.fields["probe"] == [2, 2, 5, 5]
    assert config_stages().index("properties") == config_stages().index("output") + 1
    assert config_stages(grad=True).index("grad_context") == config_stages().index("properties") + 1


# each property, and the fault built to break it (caught earlier or not: under --keep-going it fails there too)
BREAKS = [
    ("single_token", "softmax-plus-one"),
    ("equal_keys_uniform", "scores-key-bias"),
    ("permutation_equivariant", "context-rows-shifted"),
    ("batch_independent", "values-batch-mix"),
    ("empty_batch", "softmax-global-max"),
]


@pytest.mark.parametrize("prop,fault", BREAKS, ids=[p for p, _ in BREAKS])
def test_a_fault_built_to_break_each_property_fails_it(prop, fault):
    c = ledger(keep_going=True, fault=fault).check("properties", prop)
    assert c.status in ("fail", "downstream"), c
    assert ledger(keep_going=True).check("properties", prop).status == "pass"


def test_property_faults_are_the_ones_listed():
    assert sorted(f for _, f in BREAKS) == sorted(PROPERTY_FAULTS)


def test_the_empty_batch_fault_passes_every_other_stage():
    """A softmax stabilised by the global max is right on every input but an empty batch: only the property sees it."""
    led = ledger(fault="softmax-global-max")
    f = led.first_finding
    assert (f.row, f.level, f.name) == ("properties", 1, "empty_batch") and f.check.data["exception"] == "RuntimeError"
    assert all(r.status == "pass" for r in led.rows[:led.rows.index(led.row("properties"))])


def test_single_token_zero_gradient_fails_when_one_key_still_moves_with_its_score():
    led = ledger(keep_going=True, grad=True, fault="softmax-plus-one")
    c = led.check("properties", "single_token_zero_grad")
    assert c.status == "downstream" and c.value > 1e-3
    assert ledger(grad=True).check("properties", "single_token_zero_grad").value == 0


def test_the_values_of_each_property():
    row = ledger(keep_going=True, fault="scores-key-bias").row("properties")
    assert row.check("equal_keys_uniform").value > 0.01
    row = ledger(keep_going=True, fault="softmax-plus-one").row("properties")
    assert row.check("single_token").data["weight_err"] > 0.1


def test_equal_keys_holds_a_probe_row_without_a_key_to_zeros():
    """Such a row is declared empty in the probe, so any weight in it is off the uniform target."""
    from attn_ledger.engine.properties import _equal_keys

    allow = torch.tensor([[True, True], [False, False]])[None, None]  # [1, 1, 2, 2]: query 1 has no key
    held = _equal_keys(torch.tensor([[0.5, 0.5], [0.0, 0.0]])[None, None], allow, 1e-6, 2)
    assert (held.status, held.value) == ("pass", 0.0)
    leaked = _equal_keys(torch.tensor([[0.5, 0.5], [0.5, 0.5]])[None, None], allow, 1e-6, 2)
    assert (leaked.status, leaked.value) == ("fail", 0.5)


def test_batch_independence_needs_two_examples():
    c = ledger(batch_size=1).check("properties", "batch_independent")
    assert c.status == "not_applicable"


def test_properties_with_an_empty_batch_are_not_applicable_but_the_empty_batch_one():
    row = ledger(batch_size=0).row("properties")
    assert {c.name: c.status for c in row.checks}["empty_batch"] == "pass"
    assert all(c.status == "not_applicable" for c in row.checks if c.name != "empty_batch")


@pytest.mark.parametrize("extra", [
    {"mask": "padding", "valid_lengths": [5, 3], "padding_side": "left"},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"query_len": 3, "key_len": 6},
    {"mask": "sliding-window", "window": 2},
    {"num_heads": 4, "num_kv_heads": 1, "embed_dim": 16},
    {"dtype": "float16"},
    {"seq_len": 1},
], ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_properties_hold_on_healthy_configs(extra):
    row = ledger(**extra).row("properties")
    assert row.status == "pass", [(c.name, c.status, c.value, c.reason) for c in row.checks]


def test_properties_on_saved_tensors():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    row = ledger_on_qkv(q, k, v, mask="causal").row("properties")
    assert row.status == "pass" and len(row.checks) == len(PROPERTIES) - 1  # no grad: no zero-gradient check


# --- replay ---------------------------------------------------------------------------------------

def _noisy_mix(weights, v):
    out = P.mix_values(weights, v)
    # a couple of ulps: inside every bound (the context's rounding rule among them), never the same bits twice
    return out * (1 + 2 * torch.finfo(out.dtype).eps * torch.randn_like(out))


def test_replay_is_bitwise_on_the_output_row():
    c = ledger(replay=True).check("output", "replay_bitwise")
    assert c.status == "pass" and c.value == 0 and c.data["elements"] == 2 * 5 * 12


def test_replay_names_the_first_differing_element():
    led = ledger(replay=True, ops=replace(P.HEALTHY, mix=_noisy_mix))
    f = led.first_finding
    assert (f.row, f.level, f.name) == ("output", 4, "replay_bitwise")
    assert f.check.value > 0 and f.check.location["tensor"] == "output"
    first = f.check.data["first"]
    assert first["index"] == [f.check.location["example"], f.check.location["query"], f.check.location["feature"]]
    assert first["first_run"] != first["second_run"]
    assert led.check("output", "matches_reference").status == "pass"  # the noise is inside the tolerance


def test_replay_of_the_backward_on_grad_k():
    assert ledger(replay=True, grad=True).check("grad_k", "replay_bitwise").status == "pass"
    noisy = replace(P.HEALTHY, grad_q=lambda gs, k, s: P.grad_q(gs, k, s) + 1e-7 * torch.randn(1).item())
    c = ledger(replay=True, grad=True, keep_going=True, ops=noisy).check("grad_k", "replay_bitwise")
    assert c.status in ("fail", "downstream") and c.location["tensor"] == "grad_q"


def test_replay_on_saved_tensors_is_on_the_context_row():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    c = ledger_on_qkv(q, k, v, mask="causal", replay=True).check("context", "replay_bitwise")
    assert c.status == "pass" and c.data["elements"] == 64


# --- rope -------------------------------------------------------------------------------------------

ROPE_FAULTS = [("rope-on-v", "v_rotated"), ("rope-query-offset", "qk_offset"), ("rope-q-only", "only_q_rotated")]


@pytest.mark.parametrize("fault,finding", ROPE_FAULTS, ids=[f for f, _ in ROPE_FAULTS])
def test_rope_fault_is_caught_at_the_rope_row(fault, finding):
    f = ledger(rope="half", fault=fault).first_finding
    assert (f.row, f.level, f.name) == ("rope", 2, "rotary_positions")
    assert f.check.data["findings"] == [finding]


def test_the_query_offset_fault_is_one_position():
    c = ledger(rope="half", fault="rope-query-offset").check("rope", "rotary_positions")
    assert c.data["offset_between"] == 1


def test_healthy_rope_passes_and_the_reference_rotates_too():
    for spec in ("half", "interleaved", "interleaved,base=500000,dim=2", "half,dim=2"):
        led = ledger(rope=spec, grad=True, replay=True, keep_going=True)
        assert led.first_finding is None, (spec, led.first_finding)
        assert [c.status for c in led.row("rope").checks] == ["pass"] * 5
    # the reference rotates its q and k: without that, the scores would disagree with it
    led = ledger(rope="half")
    assert led.check("scores", "matches_reference").value < 1e-5


def test_rope_with_cross_attention_puts_query_i_at_i_plus_tk_minus_tq():
    led = ledger(rope="half", query_len=3, key_len=7)
    assert led.first_finding is None
    assert "i+4 (i + Tk - Tq)" in note_text(led.row("rope").note)
    f = ledger(rope="half", query_len=3, key_len=7, fault="rope-query-offset").first_finding
    assert (f.row, f.name) == ("rope", "rotary_positions")


def test_relative_positions_fail_when_only_q_turns():
    c = ledger(rope="half", fault="rope-q-only", keep_going=True).check("rope", "relative_positions")
    assert c.status == "fail" and c.value > 0.01
    assert ledger(rope="half", fault="rope-on-v", keep_going=True).check("rope", "relative_positions").status == "pass"


def test_norms_preserved_fails_on_a_rotation_that_scales():
    def scaling(q, k, v, spec, start):
        q, k, v = P.rotate(q, k, v, spec, start)
        return q * 1.01, k, v

    c = ledger(rope="half", keep_going=True, ops=replace(P.HEALTHY, rope=scaling)).check("rope", "norms_preserved")
    assert c.status == "fail" and abs(c.value - 0.01) < 1e-3
    assert ledger(rope="half").check("rope", "norms_preserved").status == "pass"


def test_rope_on_saved_tensors_says_it_rotated_them():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    led = ledger_on_qkv(q, k, v, mask="causal", rope="half")
    assert led.first_finding is None and "the saved q and k rotated" in note_text(led.row("rope").note)
    assert [r.name for r in led.rows][:3] == ["input", "rope", "scores"]


@pytest.mark.parametrize("value,needle", [("spiral", "rope.pairing"), ("half,dim=8", "rope.rotated_dim"),
                                          ("half,base=x", "PAIRING"), ("half,base=1", "rope.base")])
def test_bad_rope_values_are_one_line_exit_2(value, needle):
    r = runner.invoke(app, ["run", "--rope", value])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- scale and temperature on run --------------------------------------------------------------------

def test_scale_and_temperature_set_one_scale_for_pipeline_and_references():
    led = ledger(scale=0.5, temperature=2.0)
    assert led.first_finding is None
    assert led.details["scale"] == {"S": 0.5, "temperature": 2.0, "effective": 0.25, "default": 0.5}
    assert any("S/tau" in n and "0.25" in n for n in notes_text(led))
    plain = ledger(keep_grids=True)
    sharp = ledger(keep_grids=True, temperature=0.5)
    assert torch.allclose(sharp.tensors["scores"], plain.tensors["scores"] * 2, atol=1e-6)


def test_the_no_scale_fault_is_seen_against_a_stated_scale():
    f = ledger(fault="no-scale", scale=0.25).first_finding
    assert (f.row, f.level, f.name) == ("scores", 4, "matches_reference")
    assert ledger(fault="no-scale", scale=1.0).first_finding is None  # asked for 1: nothing was forgotten


@pytest.mark.parametrize("args", [["--scale", "0"], ["--temperature", "-1"], ["--temperature", "inf"],
                                  ["--tensors", "fixtures/tensors/seed000.safetensors", "--scale", "nan"]])
def test_bad_scales_are_exit_2(args):
    r = runner.invoke(app, ["run", *args])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1


# --- seed 002's fields and the small arrays in the JSON --------------------------------------------------

def test_allowed_pairs_and_score_spread_are_fields():
    led = ledger(keep_grids=True)
    assert led.row("masked_scores").fields == {"allowed": 15, "pairs": 25}  # seed 002: allowed 15/25
    std = led.row("scores").fields["std"]
    assert std == pytest.approx(float(led.tensors["scores"].double().std()), rel=1e-6)
    padded = ledger(mask="padding", valid_lengths=[5, 3])
    assert padded.row("masked_scores").fields["allowed"] == 25


def test_small_tensors_are_arrays_in_the_json_and_the_json_validates():
    r = runner.invoke(app, ["run", "--grad", "--rope", "half", "--replay", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema())
    arrays = doc["details"]["arrays"]
    for name, shape in (("scores", [2, 3, 5, 5]), ("weights", [2, 3, 5, 5]), ("context", [2, 3, 5, 4]),
                        ("output", [2, 5, 12]), ("grad_q", [2, 3, 5, 4]), ("grad_k", [2, 3, 5, 4]),
                        ("grad_values", [2, 3, 5, 4]), ("grad_scores", [2, 3, 5, 5]), ("grad_x", [2, 5, 12])):
        got, dims = arrays[name], []
        while isinstance(got, list):
            dims.append(len(got))
            got = got[0]
        assert dims == shape, name
    assert arrays["masked_scores"][0][0][0][1] == "-inf"
    fields = {row["name"]: row["fields"] for row in doc["rows"]}
    assert fields["masked_scores"] == {"allowed": 15, "pairs": 25} and "std" in fields["scores"]


def test_tensors_over_4096_entries_stay_out_of_the_json():
    arrays = ledger(seq_len=64, embed_dim=32, num_heads=4, keep_grids=True).details["arrays"]
    assert "scores" not in arrays and "weights" not in arrays  # [2, 4, 64, 64]: 32768 entries
    assert "context" in arrays and "output" in arrays  # [2, 4, 64, 8] and [2, 64, 32]: 4096 each
