"""``attn-ledger compare``'s parts that need no transformers: --vary and its runs, the aligned inputs, and each
model-level check and the ratio rule on tensors built here, passing and failing; bad input on the command line.

The real models are in tests/test_compare_real.py (the ``real`` extra).
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.errors import AttnLedgerError, InputError
from attn_ledger.probes.model.compare import (
    aligned_inputs,
    block_row,
    logits_row,
    mask_check,
    parse_vary,
    positions_check,
    rotary_check,
    runs,
    token_rows,
)
from attn_ledger.probes.model.inputs import InputPlan, valid_positions
from attn_ledger.tolerance import COMPARE_FACTOR, compare_bound, eps

runner = CliRunner()
ROWS = token_rows(torch.tensor([[True, True, True], [True, True, False]]))  # 5 real rows: 3 and 2


PARSED = {  # --vary as written: (kind, run A, run B)
    "attn-implementation=eager,sdpa": ("attn-implementation", "eager", "sdpa"),
    "dtype=float32, bfloat16": ("dtype", "float32", "bfloat16"),
    "padding-side": ("padding-side", "left", "right"),
    "batch": ("batch", "alone", "batched"),
    "cache=full,cached": ("cache", "full", "cached"),
    "packing": ("packing", "apart", "packed"),
    "target=fixtures/models/port.py:port": ("target", "", "fixtures/models/port.py:port"),
}


@pytest.mark.parametrize("text", PARSED)
def test_vary_parses_each_kind(text):
    v = parse_vary(text)
    assert (v.kind, v.a, v.b) == PARSED[text]


@pytest.mark.parametrize("text, words", [
    ("attn-implementation=eager", "with two different values"),
    ("attn-implementation=sdpa,sdpa", "with two different values"),
    ("dtype=float32,int8", "dtype 'int8', expected two of float32"),
    ("target=other", "--vary target: got 'other', expected 'path/to/file.py:NAME'"),
    ("speed=1,2", "expected attn-implementation=A,B, dtype=A,B, padding-side, batch, cache, packing or target=FILE:FACTORY"),
    ("batch=2", "expected batch \\(each example alone against the batch\\)"),
], ids=["one", "same", "int8", "target-without-factory", "unknown", "batch-value"])
def test_bad_vary_is_a_one_line_error(text, words):
    with pytest.raises(AttnLedgerError, match=words):
        parse_vary(text)


def test_runs_refuse_what_does_not_pair():
    plan = InputPlan(2, 8, "left", 0)
    with pytest.raises(InputError, match="name given with --register"):
        runs(parse_vary("attn-implementation=eager,mine"), "llama", plan=plan)
    with pytest.raises(InputError, match="--register: .* expected one of the two"):
        runs(parse_vary("attn-implementation=eager,sdpa"), "llama", register="f.py:fn", plan=plan)
    with pytest.raises(InputError, match="--padding: cannot be given"):
        runs(parse_vary("padding-side"), "llama", plan=plan)
    r = runs(parse_vary("padding-side"), "llama", plan=InputPlan(2, 8, "none", 0))
    assert (r.plan_a["padding"], r.plan_b["padding"]) == ("left", "right") and r.target_a == r.target_b
    d = runs(parse_vary("dtype=float32,bfloat16"), "llama", plan=plan)
    assert d.dtypes == ("float32", "bfloat16")
    with pytest.raises(InputError, match="--map: got 'f.py:names' with --vary dtype=float32,bfloat16, expected --vary "
                                         "target=FILE:FACTORY"):
        runs(parse_vary("dtype=float32,bfloat16"), "llama", plan=plan, map="f.py:names")


def test_a_target_run_b_is_the_factory_named_by_vary_target_with_the_map():
    port = "fixtures/models/port.py"
    r = runs(parse_vary(f"target={port}:port"), "llama", plan=InputPlan(2, 8, "left", 3), map=f"{port}:from_llama")
    args = r.args()
    assert (r.target_a["kind"], r.target_a["source"]) == ("transformers", "llama")
    assert (r.target_b["kind"], r.target_b["source"], r.target_b["field"]) == ("factory", f"{port}:port", "--vary target")
    assert r.target_b["seed"] == 3 and args["map"] == f"{port}:from_llama" and args["vary"] == ["target", "llama", f"{port}:port"]
    assert r.plan_a == r.plan_b and r.dtypes == ("float32", "float32")
    with pytest.raises(AttnLedgerError, match="--map: got 'names', expected 'path/to/file.py:NAME'"):
        runs(parse_vary(f"target={port}:port"), "llama", plan=InputPlan(2, 8, "left", 0), map="names")


def test_each_example_alone_holds_its_real_tokens_and_lays_back_out_as_the_batch():
    from attn_ledger.probes.model.pair import _placed, _placed_mask, alone_inputs

    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
              "position_ids": torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]])}
    valid = inputs["attention_mask"].bool()
    one = alone_inputs(inputs, valid, 1)
    assert one["input_ids"].tolist() == [[9, 10]] and one["attention_mask"].tolist() == [[1, 1]]
    assert one["position_ids"].tolist() == [[0, 1]]
    h = [torch.arange(4.0).reshape(1, 4, 1), torch.tensor([[[7.0], [8.0]]])]
    assert _placed(h, valid)[..., 0].tolist() == [[0, 1, 2, 3], [0, 0, 7, 8]]
    assert _placed([h[0], None], valid) is None  # an example whose block got nothing: nothing to place
    causal = [torch.ones(4, 4, dtype=torch.bool).tril()[None, None], torch.ones(2, 2, dtype=torch.bool).tril()[None, None]]
    m = _placed_mask(causal, valid)[:, 0]  # [B, T, T]
    assert m[1].tolist() == [[False] * 4, [False] * 4, [False, False, True, False], [False, False, True, True]]
    assert _placed_mask([causal[0], None], valid) is None


def test_right_padded_inputs_hold_the_same_tokens_in_the_same_order():
    a = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
         "position_ids": torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]])}
    b = aligned_inputs(a, valid_positions([0, 2], 4, "right"))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["position_ids"][1, :2].tolist() == [0, 1]


# --- each check, passing and failing ---------------------------------------------------------------------


def _causal() -> torch.Tensor:
    return torch.cat([torch.ones(3, 3).tril(), torch.nn.functional.pad(torch.ones(2, 2).tril(), (0, 1))]).bool()


def test_masks_pass_when_both_runs_allow_the_same_keys_and_fail_naming_the_first_pair():
    a = _causal()
    good = mask_check({"a_mask_0": a, "b_mask_0": a.clone()}, [["tensor", "tensor"]], [ROWS])
    assert good.passed and good.value == 0
    wide = a.clone()
    wide[3, 1] = True  # example 1's first real token reads its second
    bad = mask_check({"a_mask_0": a, "b_mask_0": wide}, [["tensor", "tensor"]], [ROWS])
    assert bad.failed and bad.value == 1
    assert dict(bad.location) == {"block": 0, "example": 1, "token": 0, "key": 1, "a": False, "b": True}
    none = mask_check({"a_mask_0": a}, [["tensor", None]], [ROWS])
    assert none.status == "not_applicable"


def test_each_block_is_located_by_its_own_rows():
    """An encoder-decoder's decoder block has rows of its own (every decoder token): a difference there is named by
    the decoder's example and token, not the input's."""
    a = _causal()
    decoder_rows = {"example": [0, 0, 1, 1], "token": [0, 1, 0, 1], "counts": [2, 2]}
    dec = torch.ones(2, 2).tril().repeat(2, 1).bool()  # [4, 2]: each example's 2 decoder tokens, causal
    wide = dec.clone()
    wide[2, 1] = True  # the second example's first decoder token reads its second
    t = {"a_mask_0": a, "b_mask_0": a.clone(), "a_mask_1": dec, "b_mask_1": wide}
    bad = mask_check(t, [["tensor", "tensor"]] * 2, [ROWS, decoder_rows])
    assert bad.failed and bad.value == 1
    assert dict(bad.location) == {"block": 1, "example": 1, "token": 0, "key": 1, "a": False, "b": True}


def test_position_ids_must_be_equal_where_the_blocks_receive_them():
    pos = torch.tensor([0, 1, 2, 0, 1])
    assert positions_check({"a_pos_0": pos, "b_pos_0": pos.clone()}, 1, [ROWS]).passed
    bad = positions_check({"a_pos_0": pos, "b_pos_0": pos + torch.tensor([0, 0, 0, 1, 1])}, 1, [ROWS])
    assert bad.failed and bad.value == 2 and dict(bad.location)["example"] == 1
    assert positions_check({}, 1, [ROWS]).status == "not_applicable"


def test_position_embeddings_may_differ_by_the_coarser_dtypes_rounding_only():
    cos = torch.rand(5, 4)
    t = {"a_cos_0": cos, "b_cos_0": cos.bfloat16().float(), "a_sin_0": cos, "b_sin_0": cos}
    assert rotary_check(t, 1, ("float32", "bfloat16"), [ROWS]).passed
    assert rotary_check(t, 1, ("float32", "float32"), [ROWS]).failed  # bfloat16 rounding is not float32's
    t["b_sin_0"] = cos + 0.05
    bad = rotary_check(t, 1, ("float32", "bfloat16"), [ROWS])
    assert bad.failed and dict(bad.location)["part"] == "sin"


def _block(delta: float, plain: float = 1e-6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 8, generator=g)
    exact = a.double()
    return {"a_out": a, "b_out": a + 2 * delta, "b_replay": a + delta, "exact": exact,
            "plain_float32": (exact + plain).float()}


def test_a_block_passes_within_the_factor_of_the_plain_error_and_fails_beyond_it():
    good = block_row({"index": 0, "path": "layers.0"}, _block(2e-6), ("float32", "float32"), ROWS)
    assert good.status == "pass" and good.fields["added"] == pytest.approx(2e-6, rel=0.1)
    limit = good.check("added_error").limit
    assert limit == pytest.approx(COMPARE_FACTOR * 1e-6 + eps("float32") * 4, rel=0.5)
    bad = block_row({"index": 1, "path": "layers.1"}, _block(1e-4), ("float32", "float32"), ROWS)
    assert bad.status == "fail" and bad.fields["total"] > bad.fields["added"]
    nan = _block(0.0)
    nan["b_replay"][2, 3] = float("nan")
    assert block_row({"index": 0, "path": "x"}, nan, ("float32", "float32"), ROWS).status == "fail"


def test_a_block_whose_float64_replay_is_not_finite_is_inconclusive_not_failed():
    t = _block(2e-6)
    t["exact"][0, 0] = float("nan")
    row = block_row({"index": 0, "path": "layers.0"}, t, ("float32", "float32"), ROWS)
    assert row.status == "inconclusive" and row.check("added_error").status == "inconclusive"


def test_a_block_that_makes_a_padded_row_not_finite_fails_finite_naming_the_run_and_the_row():
    valid = {"a": [[True, True, True], [False, True, True]], "b": [[True, True, True], [True, True, False]]}
    made = torch.zeros(2, 3, dtype=torch.bool)  # [B, T]
    t = {**_block(2e-6), "a_made_nonfinite": made, "b_made_nonfinite": made.clone()}
    good = block_row({"index": 0, "path": "layers.0"}, t, ("float32", "float32"), ROWS, valid)
    assert good.status == "pass" and good.check("finite").value == 0
    t["a_made_nonfinite"] = made.clone().index_put_((torch.tensor([1]), torch.tensor([0])), torch.tensor(True))
    bad = block_row({"index": 0, "path": "layers.0"}, t, ("float32", "float32"), ROWS, valid)
    assert bad.status == "fail" and bad.check("added_error").status == "pass"  # the real rows agree
    assert bad.check("finite").value == 1
    assert bad.check("finite").location == {"run": "A", "example": 1, "position": 0, "padded": True}
    assert bad.first_failing().name == "finite"
    old = block_row({"index": 0, "path": "layers.0"}, _block(2e-6), ("float32", "float32"), ROWS)
    assert [c.name for c in old.checks] == ["added_error"]  # no rows sent: nothing to judge, no check


def test_the_bound_has_a_floor_of_one_eps_and_never_divides_by_a_zero_plain_error():
    bound, parts = compare_bound(0.0, 10.0, ("float32", "bfloat16"))
    assert bound == pytest.approx(10 * eps("bfloat16")) and parts["floor"] == bound
    assert compare_bound(float("nan"), 1.0, ("float32", "float32"))[1]["fallback"]


def test_logits_fail_by_the_ratio_rule_or_by_a_top_token_outside_the_others_top_k():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 50, generator=g)
    t = {"a_logits": a, "b_logits": a + 1e-7, "exact_logits": a.double(), "plain_float32_logits": a + 1e-6}
    row = logits_row(t, ("float32", "float32"), ROWS)
    assert row.status == "pass" and row.check("top_k").value == 0
    swapped = a.clone()
    swapped[4] = -a[4]  # the last token's ranking reversed
    t2 = {**t, "b_logits": swapped, "plain_float32_logits": a + 10.0}  # a plain error so large the ratio holds
    row2 = logits_row(t2, ("float32", "float32"), ROWS)
    assert row2.check("logits").passed and row2.check("top_k").failed
    assert dict(row2.check("top_k").location)["example"] == 1


# --- the command line ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--vary", "target=x"], "--vary target: got 'x', expected 'path/to/file.py:NAME' or 'package.module:NAME'"),
    (["--vary", "dtype=float32"], "--vary: got 'dtype=float32', expected dtype=A,B"),
    (["--vary", "padding-side", "--padding", "left"], "--padding: cannot be given with --vary padding-side"),
    (["--vary", "dtype=float32,bfloat16", "--dtype", "float16"], "--dtype: cannot be given with --vary dtype"),
    (["--vary", "batch", "--batch", "1"], "--batch: got 1 with --vary batch, expected at least 2"),
    (["--vary", "padding-side", "--map", "fixtures/models/port.py:from_llama"], "--map: got "),
], ids=["target-without-factory", "one-dtype", "padding", "dtype", "batch-of-one", "map-without-target"])
def test_bad_input_is_one_line_and_exit_2(args, words):
    result = runner.invoke(app, ["compare", "--transformers", "llama", *args])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1


def test_the_first_adders_calls_are_kept_with_the_mask_another_blocks_call_sent_first():
    from attn_ledger.probes.model.pair import _BlockCalls

    got = []
    keep = _BlockCalls("model.layers.1.", "b", lambda f, t: got.append((f, t)))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    keep({"path": "model.layers.0.self_attn", "mask": {"key": "mask0", "new": True}}, {"q": torch.zeros(1), "mask": mask})
    keep({"path": "model.layers.1.self_attn", "mask": {"key": "mask0", "new": False}}, {"q": torch.ones(1)})
    assert keep.sent == 1 and len(got) == 1
    facts, tensors = got[0]
    assert facts["side"] == "b" and facts["mask"] == {"key": "b.mask0", "new": True} and tensors["mask"] is mask


@pytest.mark.parametrize("calls, words", [
    ([{"run": "A", "call": "l.0.attn", "status": "pass"}, {"run": "B", "call": "l.0.attn", "status": "pass"}],
     "agrees with its float64 reference in runs A, B (2 calls): the error it adds comes from outside"),
    ([{"run": "A", "call": "l.0.attn", "status": "pass"},
      {"run": "B", "call": "l.0.attn", "status": "fail", "check": "reference", "reason": "r", "diagnosis": "a window of 17",
       "stage": "weights", "stage_check": "matches_reference"}],
     "run B's l.0.attn fails reference (it matches a window of 17); its stage ledger first fails at stage weights "
     "(matches_reference); run A agrees with its reference there"),
    ([], "no stage ledger of l.0's attention: no attention call inside it was captured"),
], ids=["both-agree", "b-fails", "none-captured"])
def test_the_first_adders_attention_in_words(calls, words):
    from attn_ledger.render.notes import note_text
    from attn_ledger.report import Note

    why = None if calls else "no attention call inside it was captured"
    assert words in note_text(Note("compare_attention", {"block": "l.0", "calls": calls, "why": why}))


def test_a_capture_of_the_first_adder_that_never_comes_back_says_why_and_opens_no_ledger():
    from attn_ledger.guard import CallStopped
    from attn_ledger.probes.model.adder import attention_of
    from attn_ledger.render.notes import note_text
    from attn_ledger.report import Note

    class Stopped:
        def compare_calls(self, *args):
            raise CallStopped("the worker ran past 60 s", {"timeout_s": 60})

    inputs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    att = attention_of(Stopped(), {"label": "m"}, inputs, inputs, 0, "model.layers.0")
    assert att.calls == () and att.ledger is None and att.failing is None
    assert note_text(Note("compare_attention", att.as_json())) == (
        "no stage ledger of model.layers.0's attention: the forwards that capture its attention stopped: "
        "the worker ran past 60 s")
