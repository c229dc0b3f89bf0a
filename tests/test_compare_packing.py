"""``compare --vary packing``: each sequence apart against all of them packed into one row, position ids restarting.

Correct causal decoders pass; a registered function that lets a document's first token read the previous
document's last token (fixtures/interface/custom.py:first_token_reads_previous) is named at block 0, on the
second document's first token, while a correct registered function passes; an encoder is not applicable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.probes.model.compare import Vary, parse_vary

ROOT = Path(__file__).resolve().parents[1]
CUSTOM = ROOT / "fixtures" / "interface" / "custom.py"
runner = CliRunner()
_NAMES = iter(range(1 << 30))


def test_packing_parses_and_other_values_are_refused():
    assert parse_vary("packing") == Vary("packing", "apart", "packed")
    with pytest.raises(InputError, match="--vary: got 'packing=a,b', expected packing"):
        parse_vary("packing=a,b")


def test_packing_one_example_exits_2_with_one_line():
    result = runner.invoke(app, ["compare", "--transformers", "llama", "--vary", "packing", "--batch", "1"])
    assert result.exit_code == 2, result.output
    assert "--batch: got 1 with --vary packing, expected at least 2 examples to pack" in result.output
    assert "Traceback" not in result.output


pytest.importorskip("transformers")


def _run(model_type: str, *, implementation: str | None = None, fn: str | None = None, padding: str = "left",
         dtype: str = "float32"):
    from attn_ledger.probes.model.compare import compare, runs
    from attn_ledger.probes.model.driver import LocalModel, setup
    from attn_ledger.probes.model.inputs import InputPlan

    register = None
    if fn is not None:  # a fresh name: registrations are global to the process
        implementation, register = f"packed{next(_NAMES)}", f"{CUSTOM}:{fn}"
    r = runs(parse_vary("packing"), model_type, implementation=implementation, register=register, dtype=dtype,
             plan=InputPlan(3, 20, padding, 0))
    loaded, _ = setup(r.args())
    return compare(LocalModel(loaded), r)


CORRECT = [("llama", "sdpa", "left", "float32"), ("llama", "eager", "right", "float32"),
           ("mistral", "sdpa", "left", "float32"), ("gpt2", "eager", "left", "float32"),
           ("gpt2", "sdpa", "none", "float32"), ("llama", "sdpa", "left", "bfloat16")]


@pytest.mark.parametrize("family, implementation, padding, dtype", CORRECT,
                         ids=[f"{f}-{i}-{p}-{d}" for f, i, p, d in CORRECT])
def test_a_correct_decoder_packed_agrees_with_each_sequence_apart(family, implementation, padding, dtype):
    report = _run(family, implementation=implementation, padding=padding, dtype=dtype)
    assert report.exit_code == 0, report.first_finding
    blocks = [r for r in report.rows if r.fields.get("layer") is not None]
    assert len(blocks) == 2 and all(r.fields["added"] <= r.fields["bound"] for r in blocks)
    assert report.row("position_ids").status == "pass"  # restarting in both: each document's own positions


def test_a_first_token_that_reads_the_previous_document_is_named_at_block_0():
    assert _run("llama", fn="my_attention").exit_code == 0  # a correct function, registered the same way
    report = _run("llama", fn="first_token_reads_previous")
    assert report.exit_code == 1
    assert report.first_finding.row == "model.layers.0"
    first_adder = dict(report.details["first_adder"])
    calls = {c["run"]: c for c in first_adder.pop("attention")["calls"]}
    assert first_adder == {"block": "model.layers.0", "layer": 0}
    # the second document's first token: the first that has a document before it in the packed row
    assert report.row("model.layers.0").check("added_error").location == {"example": 1, "token": 0}
    # its stage: run B's packed call puts weight on the key before the document's first token (row 20 of the packed
    # row, the first document being 20 tokens long); that example alone in run A agrees with its reference
    assert calls["A (example 1 alone)"]["status"] == "pass"
    assert calls["B"]["check"] == "forbidden_weight" and calls["B"]["stage"] == "weights"
    assert calls["B"]["reason"].endswith("at head 0, document 1, token 0, key document 0, key token 19")


def test_a_packed_rows_location_is_said_by_document_and_token():
    from attn_ledger.probes.model.adder import packed_location

    where = {"example": 0, "head": 2, "query": 20, "key": 19}
    assert packed_location(where, [20, 15]) == {"head": 2, "document": 1, "token": 0, "key document": 0,
                                                "key token": 19}
    assert packed_location({"example": 0, "query": 34}, [20, 15]) == {"document": 1, "token": 14}
    assert packed_location({"example": 0, "query": 35}, [20, 15]) == {"document": 2, "token": 0}  # past the last


def test_an_encoder_is_not_applicable_and_exits_0():
    report = _run("bert")
    assert report.exit_code == 0
    assert [(r.name, r.status) for r in report.rows] == [("packing", "not_applicable")]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_packed_mask_whose_documents_start_one_token_late_is_named_at_the_masks_row(monkeypatch, implementation):
    import runpy

    fixture = runpy.run_path(str(ROOT / "fixtures" / "models" / "packing.py"))
    module, name = fixture["PATCH"]
    assert _run("llama", implementation=implementation).row("masks").status == "pass"  # transformers' own
    monkeypatch.setattr(f"{module}.{name}", fixture["documents_one_late"])
    report = _run("llama", implementation=implementation)
    assert report.exit_code == 1
    assert report.first_finding.row == "masks"  # a model-level row, before any block
    where = report.first_finding.check.location
    assert where["block"] == 0 and where["other_documents"] >= 1
    first_adder = dict(report.details["first_adder"])
    calls = {c["run"]: c for c in first_adder.pop("attention")["calls"]}
    assert first_adder == {"block": "model.layers.0", "layer": 0}
    # the stage: run B's packed call, judged with each document kept apart, follows its own leaky mask
    b = calls["B"]
    assert b["status"] == "fail" and b["diagnosis"] == "the call's own mask"
    if implementation == "eager":  # the weights come back: weight on another document's key
        assert (b["check"], b["stage"]) == ("forbidden_weight", "weights")
    else:  # no weights: the mask itself, against the causal relation within each document, and the context
        assert b["check"] == "relation" and "the causal relation within each packed document forbids" in b["reason"]
        assert b["stage"] == "context"
    assert calls[f"A (example {where['example']} alone)"]["status"] == "pass"


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_correct_packed_call_passes_the_judge_with_each_document_kept_apart(monkeypatch, implementation):
    """Run B's packed call is judged against the causal relation within each document: a correct model's passes
    every check, and a mask whose documents start one token late fails its relation (or its weights)."""
    import runpy

    from attn_ledger.probes.model.adder import packed_sides
    from attn_ledger.probes.model.compare import runs
    from attn_ledger.probes.model.driver import LocalModel, setup
    from attn_ledger.probes.model.inputs import InputPlan, make_inputs
    from attn_ledger.probes.model.scan import Judge, ScanOptions

    def judged():
        r = runs(parse_vary("packing"), "llama", implementation=implementation, plan=InputPlan(3, 20, "left", 0))
        loaded, _ = setup(r.args())
        inputs = make_inputs(InputPlan(**r.plan_a), loaded.facts)
        judge = Judge(loaded.facts, packed_sides(inputs["attention_mask"].bool()), ScanOptions(keep_going=True))
        LocalModel(loaded).compare_calls(inputs, inputs, 0, lambda f, t: judge.take(f, t) if f["side"] == "b" else None)
        (entry,) = judge.entries
        return {c.name: c.status for c in entry.verdict.checks}

    good = judged()
    assert "fail" not in good.values() and good["relation"] == "pass" and good["reference"] == "pass"
    fixture = runpy.run_path(str(ROOT / "fixtures" / "models" / "packing.py"))
    module, name = fixture["PATCH"]
    monkeypatch.setattr(f"{module}.{name}", fixture["documents_one_late"])
    bad = judged()
    assert bad["relation"] == "fail" and bad["reference"] == "fail"


def test_the_late_document_finder_is_named_from_the_command_line_through_its_factory():
    import json

    import transformers.masking_utils as masking_utils

    before = masking_utils.find_packed_sequence_indices
    result = runner.invoke(app, ["compare", f"{ROOT / 'fixtures' / 'models' / 'packing.py'}:one_late_llama",
                                 "--vary", "packing", "--format", "json"])
    assert result.exit_code == 1, result.output[-2000:]
    report = json.loads(result.stdout)
    assert report["first_finding"]["row"] == "masks"
    calls = {c["run"]: c for c in report["details"]["first_adder"]["attention"]["calls"]}
    assert calls["B"]["check"] == "relation" and calls["B"]["diagnosis"] == "the call's own mask"
    assert masking_utils.find_packed_sequence_indices is before  # the factory ran in the worker only
