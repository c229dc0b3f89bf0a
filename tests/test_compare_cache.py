"""``compare --vary cache``: the full forward against a prefill and token-by-token decode through the model's cache.

Correct decoders pass with each block's added error under its bound; a Llama whose decode step advances rotary
positions by one too many (fixtures/models/cache.py) is named at the position ids its blocks receive and at its
first block; an encoder is not applicable; inputs that cannot be decoded are refused with exit 2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.probes.model.compare import Vary, parse_vary
from attn_ledger.probes.model.inputs import DECODE_STEPS, pad_counts, prefill_length

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_cache_parses_and_other_values_are_refused():
    assert parse_vary("cache") == Vary("cache", "full", "cached")
    assert parse_vary("cache=full,cached") == Vary("cache", "full", "cached")
    with pytest.raises(InputError, match="--vary: got 'cache=a,b', expected cache"):
        parse_vary("cache=a,b")


@pytest.mark.parametrize("seq_len, batch, padding, expected", [
    (24, 2, "left", 24 - DECODE_STEPS),  # example 1 keeps 12 real tokens: 8 decoded
    (10, 2, "none", 10 - DECODE_STEPS),
    (6, 2, "left", 4),  # 3 real tokens in example 1: 2 decoded, one left for the prefill
    (2, 2, "left", 0),  # an example with one real token: nothing to both prefill and decode
], ids=["T24-left", "T10-none", "T6-left", "T2-left"])
def test_the_prefill_keeps_a_real_token_of_every_example(seq_len, batch, padding, expected):
    pads = pad_counts(batch, seq_len, padding)
    assert prefill_length(seq_len, pads) == expected
    if expected:
        assert all(expected > p for p in pads)


@pytest.mark.parametrize("argv, field", [
    (["--padding", "right"], "--padding: got right with --vary cache"),
    (["--seq-len", "2"], "--seq-len: got 2 with --vary cache"),
    (["--vary", "cache=x,y"], "--vary: got 'cache=x,y'"),
], ids=["right-padding", "too-short", "bad-value"])
def test_inputs_that_cannot_be_decoded_exit_2_with_one_line(argv, field):
    args = ["compare", "--transformers", "llama", "--vary", "cache", *argv]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert field in result.output
    assert "Traceback" not in result.output


transformers = pytest.importorskip("transformers")


def _run(model_type: str, *, implementation: str | None = None, padding: str = "left", seq_len: int = 24,
         dtype: str = "float32"):
    from attn_ledger.probes.model.compare import compare, runs
    from attn_ledger.probes.model.driver import LocalModel, setup
    from attn_ledger.probes.model.inputs import InputPlan

    r = runs(parse_vary("cache"), model_type, implementation=implementation, dtype=dtype,
             plan=InputPlan(2, seq_len, padding, 0))
    loaded, _ = setup(r.args())
    return compare(LocalModel(loaded), r)


CORRECT = [("llama", "sdpa", "left", 24, "float32"), ("llama", "eager", "none", 24, "float32"),
           ("mistral", "sdpa", "left", 24, "float32"), ("mistral", "eager", "none", 40, "float32"),
           ("gpt2", "sdpa", "left", 24, "float32"), ("gpt2", "eager", "none", 24, "float32"),
           ("llama", "sdpa", "left", 24, "bfloat16"), ("gpt2", "eager", "left", 24, "bfloat16")]


@pytest.mark.parametrize("family, implementation, padding, seq_len, dtype", CORRECT,
                         ids=[f"{f}-{i}-{p}-T{t}-{d}" for f, i, p, t, d in CORRECT])
def test_a_correct_decoder_decoded_through_its_cache_agrees_with_its_full_forward(family, implementation, padding,
                                                                                  seq_len, dtype):
    report = _run(family, implementation=implementation, padding=padding, seq_len=seq_len, dtype=dtype)
    assert report.exit_code == 0, report.first_finding
    assert report.details["cache"] == {"prefill": seq_len - DECODE_STEPS, "decoded": DECODE_STEPS}
    blocks = [r for r in report.rows if r.fields.get("layer") is not None]
    assert len(blocks) == 2
    for row in blocks:
        added, bound = row.fields["added"], row.fields["bound"]
        assert added <= bound, row  # decoding reorders the sums: rounding, within the bound
        assert row.fields["room"] is None if added == 0 else row.fields["room"] == pytest.approx(bound / added)
    assert report.row("position_ids").status == "pass"  # the blocks receive position ids in every family here


def test_the_cli_decodes_llama_through_its_cache_in_the_worker_and_exits_0():
    result = runner.invoke(app, ["compare", "--transformers", "llama", "--vary", "cache", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    names = [r["name"] for r in data["rows"]]
    assert names == ["embeddings", "masks", "position_ids", "position_embeddings", "model.layers.0",
                     "model.layers.1", "logits"]
    assert all(r["status"] == "pass" for r in data["rows"])
    assert data["details"]["vary"] == {"kind": "cache", "a": "full", "b": "cached"}


def test_an_encoder_is_not_applicable_and_exits_0():
    report = _run("bert")
    assert report.exit_code == 0
    assert [(r.name, r.status) for r in report.rows] == [("cache", "not_applicable")]
    assert "a cache is a decoder's" in report.rows[0].checks[0].reason


def _fixture():
    spec = importlib.util.spec_from_file_location("cache_fixture", ROOT / "fixtures" / "models" / "cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_positions_one_ahead_in_the_decode_step_are_named_at_the_position_ids_and_block_0(implementation):
    from attn_ledger.probes.model.compare import compare_models

    reference, broken = _fixture().positions_one_ahead(implementation)
    assert compare_models(reference, reference, cache=True).exit_code == 0  # the same path, decoded right
    report = compare_models(reference, broken, cache=True)
    assert report.exit_code == 1
    first = report.first_finding
    assert first.row == "position_ids"  # read where the blocks receive them, not from the inputs the tool made
    # the first decoded token of example 0 (no padding): the prefill is right, the decode one ahead
    assert first.check.location == {"block": 0, "example": 0, "token": 24 - DECODE_STEPS, "a": 16, "b": 17}
    first_adder = dict(report.details["first_adder"])
    calls = first_adder.pop("attention")["calls"]
    assert first_adder == {"block": "model.layers.0", "layer": 0}
    # the stage diagnosis, from block 0's attention calls: run A's full forward and run B's prefill agree with their
    # references; every decode step of run B got q and k rotated one position ahead, its attention itself right
    assert [(c["call"], c["status"]) for c in calls[:3]] == [
        ("model.layers.0.self_attn", "pass"), ("model.layers.0.self_attn, tokens 0..15", "pass"),
        ("model.layers.0.self_attn, token 16", "fail")]
    decoded = calls[2:]
    assert len(decoded) == DECODE_STEPS and all(c["check"] == "rotary" and c["stage"] == "input" for c in decoded)
    assert decoded[0]["diagnosis"].startswith("rotary positions 1 ahead: q and k rotated as position 17 where the "
                                              "token is at 16")
    assert report.ledgers["B: model.layers.0.self_attn, token 16"].verdict == "pass"
    assert "run B's model.layers.0.self_attn, token 16 fails rotary" in report.row("model.layers.0").first_failing().reason
    block0 = report.row("model.layers.0")
    assert block0.fields["mark"] == "first adder" and block0.fields["added"] > 1e3 * block0.fields["bound"]
    assert block0.check("added_error").location["token"] >= 24 - DECODE_STEPS  # only decoded tokens are wrong
    assert report.row("position_embeddings").status == "fail"


def test_assert_models_agree_under_cache_passes_the_model_itself_and_fails_the_broken_path():
    from attn_ledger.testing import assert_models_agree

    reference, broken = _fixture().positions_one_ahead()
    assert_models_agree(reference, reference, cache=True)
    with pytest.raises(AssertionError, match="first finding position_ids: L2 position_ids"):
        assert_models_agree(reference, broken, cache=True)
    with pytest.raises(InputError, match="--padding: got right with --vary cache"):
        assert_models_agree(reference, reference, cache=True, padding="right")


def test_given_inputs_that_cannot_be_decoded_are_refused():
    import torch

    from attn_ledger.probes.model.compare import compare_models

    reference, _ = _fixture().positions_one_ahead()
    right = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    with pytest.raises(InputError, match="inputs: attention_mask has padding after a real token"):
        compare_models(reference, reference, right, cache=True)
    short = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 0, 9]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 0, 1]])}
    with pytest.raises(InputError, match="inputs: an example has fewer than two real tokens"):
        compare_models(reference, reference, short, cache=True)
    left = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
            "position_ids": torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]])}
    report = compare_models(reference, reference, left, cache=True)
    assert report.exit_code == 0 and report.details["cache"] == {"prefill": 3, "decoded": 1}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_a_correct_decode_steps_attention_calls_pass_the_judge_each_on_its_own_tokens(implementation, padding):
    """The judge of the first adder's attention sees each decode step as it was run: its query tokens' positions,
    the keys in the cache so far, and k's new rows against the k projection (the rest is the cache)."""
    from attn_ledger.probes.model.adder import RUNS
    from attn_ledger.probes.model.driver import LocalModel, model_facts
    from attn_ledger.probes.model.inputs import InputPlan, make_inputs
    from attn_ledger.probes.model.pair import pair_of
    from attn_ledger.probes.model.scan import Judge, ScanOptions, sides_of

    reference, broken = _fixture().positions_one_ahead(implementation)
    verdicts = {}
    for name, model in (("reference", reference), ("broken", broken)):
        pair = pair_of(reference, model, "llama", "llama", model_facts, cached=True)
        inputs = make_inputs(InputPlan(2, 24, padding, 0), pair.facts)
        judges = {side: Judge(pair.facts, sides_of(inputs), ScanOptions(keep_going=True)) for side, _ in RUNS}
        LocalModel(pair).compare_calls(inputs, inputs, 0, lambda f, t: judges[f["side"]].take(f, t))
        entries = judges["b"].entries
        assert [e.facts["tokens"] for e in entries] == [[0, 24 - DECODE_STEPS - 1]] + [[t, t] for t in range(24 - DECODE_STEPS, 24)]
        verdicts[name] = [{c.name: c.status for c in e.verdict.checks} for e in entries]
        assert all(c.status != "fail" for e in judges["a"].entries for c in e.verdict.checks)
    assert all(v["rotary"] == "pass" and "fail" not in v.values() for v in verdicts["reference"])
    assert verdicts["broken"][0]["rotary"] == "pass"  # the prefill is right
    assert all(v["rotary"] == "fail" for v in verdicts["broken"][1:])  # every decoded token one position ahead
