"""One relation value, parsed once: every path that reads a relation holds a RelationSpec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.maths import relations
from attn_ledger.maths.relations import RelationSpec
from attn_ledger.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def parses(monkeypatch) -> list[object]:
    """Every text :func:`relations.parse` reads, in order (the real parser still answers)."""
    seen: list[object] = []
    real = relations.parse

    def counting(mask, *args, **kwargs):
        seen.append(mask)
        return real(mask, *args, **kwargs)

    monkeypatch.setattr(relations, "parse", counting)
    return seen


def test_run_mask_causal_parses_the_mask_once(parses):
    r = CliRunner().invoke(app, ["run", "--mask", "causal", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert parses == ["causal"]


def test_run_mask_with_parameters_parses_once(parses):
    r = CliRunner().invoke(app, ["run", "--mask", "causal+padding", "--valid-lengths", "5,3", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert parses == ["causal+padding"]


def test_run_tensors_mask_parses_once(parses, tmp_path: Path):
    import torch

    from attn_ledger.inputs.tensorio import save_tensor_file

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "qkv.pt"
    save_tensor_file({n: torch.randn(1, 2, 4, 8, generator=g) for n in "qkv"}, path)
    r = CliRunner().invoke(app, ["run", "--tensors", str(path), "--mask", "sliding-window", "--window", "2",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    assert parses == ["sliding-window"]


def test_the_counter_sees_a_second_parse(parses):
    """The fixture counts what it should: parsing the config's mask text again shows up as a second call."""
    cfg = load_config(overrides={"mask": "causal"})
    relations.parse(str(cfg.mask))
    assert parses == ["causal", "causal"]


def test_config_holds_the_spec_and_its_parameters():
    cfg = load_config(overrides={"mask": "causal+sliding-window", "window": 2})
    assert cfg.mask == RelationSpec(("causal", "sliding-window"))
    assert cfg.relation == RelationSpec(("causal", "sliding-window"), window=2)
    assert cfg.relation.alignment == "bottom-right" and cfg.relation.causal
    # a spec made already is taken as it is, and a copy keeps the relation
    again = load_config(overrides={"mask": cfg.mask, "window": 2})
    assert again.relation == cfg.relation
    assert cfg.model_copy(update={"keep_grids": True}).relation == cfg.relation


def _masks_in_docs() -> set[str]:
    """The relation texts the docs show: ``--mask X`` and ``mask = "X"`` (polarity's mask files left out)."""
    found: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"--mask[ =]([A-Za-z+-]+)\b(?![./])|\bmask ?= ?\"([^\"]*)\"", text):
            value = m.group(1) or m.group(2)
            if all(part in relations.RELATIONS for part in value.split("+")):
                found.add(value)
    return found


ROUND_TRIP = sorted({*relations.RELATIONS, "causal+padding", "causal+padding+sliding-window", "causal+sliding-window",
                     "padding+causal", "causal-top-left+padding", "prefix-lm+padding", "segments+causal",
                     *_masks_in_docs()})


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_canonical_text_reads_back(text):
    spec = relations.parse(text)
    assert str(spec) == text
    assert relations.parse(str(spec)) == spec


def test_docs_show_relations():
    assert {"causal", "causal+padding"} <= _masks_in_docs()


def test_text_is_canonical_after_parsing():
    assert str(relations.parse(" causal + padding ")) == "causal+padding"
    assert str(relations.parse("")) == str(relations.parse(None)) == "none"
    assert relations.parse("causal-top-left").alignment == "top-left"
    assert relations.parse("none").alignment is None and not relations.parse("prefix-lm").causal


BAD_TEXT = [
    ("causal+diagonal", "mask: got 'causal+diagonal', expected relations from none, causal, causal-top-left, padding, "
                        "sliding-window, prefix-lm, segments joined by '+'"),
    ("casual", "mask: got 'casual', expected relations from none, causal, causal-top-left, padding, sliding-window, "
               "prefix-lm, segments joined by '+'; did you mean 'causal'?"),
    ("none+padding", "mask: got 'none+padding', expected 'none' alone"),
    ("causal+causal-top-left", "mask: got 'causal+causal-top-left', expected one causal alignment, not both"),
    ("padding+padding", "mask: got 'padding+padding', expected each relation once"),
]


@pytest.mark.parametrize("text,message", BAD_TEXT, ids=[t for t, _ in BAD_TEXT])
def test_bad_text_is_one_field_named_line(text, message):
    with pytest.raises(InputError) as direct:
        relations.parse(text)
    assert str(direct.value) == message
    with pytest.raises(ConfigError) as from_config:
        load_config(overrides={"mask": text})
    assert str(from_config.value) == message
    r = CliRunner().invoke(app, ["run", "--mask", text])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [f"error: {message}"]


BAD_PARAMS = [
    ("sliding-window", {}, "window: got none, expected a window length for mask 'sliding-window'"),
    ("padding", {"valid_lengths": [5]}, "valid_lengths: got 1 lengths [5], expected batch_size=2"),
    ("padding", {"valid_lengths": [5, 9]}, "valid_lengths: got 9, expected a key count between 0 and key_len=5"),
    ("segments", {"segment_lengths": [2, 2]}, "segment_lengths: got [2, 2], expected positive lengths summing to seq_len=5"),
    ("prefix-lm", {}, "prefix_len: got none, expected a prefix length for mask 'prefix-lm'"),
]


@pytest.mark.parametrize("text,params,message", BAD_PARAMS, ids=[f"{t}{p}" for t, p, _ in BAD_PARAMS])
def test_bad_parameters_name_their_field(text, params, message):
    with pytest.raises(InputError) as bound:
        relations.bind(relations.parse(text), tq=5, tk=5, batch_size=2, **params)
    assert str(bound.value) == message
    with pytest.raises(ConfigError) as from_config:
        load_config(overrides={"mask": text, **params})
    assert str(from_config.value) == message


def test_a_spec_is_held_to_the_names_its_path_takes():
    spec = relations.parse("padding")
    with pytest.raises(InputError, match="mask: got 'padding', expected relations from none, causal, causal-top-left, "
                                         "sliding-window, prefix-lm joined by"):
        relations.held(spec, relations.TENSOR_RELATIONS)
    assert relations.held(relations.CAUSAL, relations.TENSOR_RELATIONS) is relations.CAUSAL


def test_module_relation_and_its_errors():
    assert relations.module_relation() == relations.CAUSAL
    assert relations.module_relation(False) == relations.NO_RELATION
    assert relations.module_relation(True, 4) == RelationSpec(("sliding-window",), window=4)
    with pytest.raises(InputError, match=r"^window: got 0, expected an integer >= 1$"):
        relations.module_relation(True, 0)
    with pytest.raises(InputError, match=r"^window: got 3, expected a causal module \(a sliding window is causal\)$"):
        relations.module_relation(False, 3)


def test_relations_import_no_torch():
    import subprocess
    import sys

    code = "import sys, attn_ledger.maths.relations; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_module_declaration_holds_the_relation():
    from attn_ledger.probes.module.core import Declared

    window = Declared(relations.module_relation(True, 4))
    assert (window.relation, window.causal, window.window, window.text) == (
        RelationSpec(("sliding-window",), window=4), True, 4, "sliding window 4")
    assert window.allow(4, 4).sum(dim=-1).tolist() == [1, 2, 3, 4]
    assert (Declared().causal, Declared().text) == (True, "causal")
    open_ = Declared(relations.module_relation(False))
    assert (open_.causal, open_.window, open_.text) == (False, None, "bidirectional")
    with pytest.raises(InputError, match=r"^relation: got 'prefix-lm', expected causal, sliding-window"):
        Declared(RelationSpec(("prefix-lm",), prefix_len=2))


def test_module_window_without_causal_is_one_line_exit_2():
    module = str(ROOT / "fixtures" / "modules" / "attention_modules.py") + ":CausalMHA"
    r = CliRunner().invoke(app, ["check", "--module", module, "--embed-dim", "12", "--heads", "3", "--no-causal",
                                 "--window", "3"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["error: window: got 3, expected a causal module (a sliding window is causal)"]


CASE_MASKS = [  # token, B, Tk -> the relation's text, its lengths, the padded side, the blocked run, the flag, the kinds
    ("none", 2, 9, "none", None, "right", None, False, ("none",)),
    ("causal-flag", 2, 9, "causal", None, "right", None, True, ("causal",)),
    ("causal-mask", 2, 9, "causal", None, "right", None, False, ("mask",)),
    ("pad", 2, 9, "padding", (8, 6), "right", None, False, ("mask",)),
    ("pad-causal", 2, 9, "causal+padding", (8, 6), "right", None, True, ("causal", "mask")),
    ("pad-empty", 3, 9, "padding", (8, 6, 0), "right", None, False, ("mask",)),
    ("lpad4", 2, 9, "padding", (5, 7), "left", None, False, ("mask",)),
    ("lpad4-causal", 2, 9, "causal+padding", (5, 7), "left", None, True, ("causal", "mask")),
    ("gap2x3", 2, 9, "key-gap", None, "right", (2, 3), False, ("mask",)),
    ("gap2x3-causal", 2, 9, "causal+key-gap", None, "right", (2, 3), True, ("causal", "mask")),
]


@pytest.mark.parametrize("token,b,tk,text,lengths,side,gap,flag,kinds", CASE_MASKS, ids=[c[0] for c in CASE_MASKS])
def test_a_case_mask_token_is_a_relation(token, b, tk, text, lengths, side, gap, flag, kinds):
    from attn_ledger.probes.kernel.cases import Case, argument_kinds, case_relation

    spec, causal_flag = case_relation(token, b, tk)
    assert (str(spec), spec.valid_lengths, spec.padding_side, spec.key_gap, causal_flag) == (text, lengths, side, gap, flag)
    assert argument_kinds(spec, causal_flag) == kinds
    case = Case(b, 2, 2, 4, tk, 8, 8, mask=token)
    assert (case.relation, case.causal_flag, case.uses_mask) == (spec, flag, "mask" in kinds)


def test_a_bad_case_mask_token_names_its_field():
    from attn_ledger.probes.kernel.cases import case_relation

    with pytest.raises(InputError, match=r"^mask: got 'lpad', expected one of none, causal-flag, causal-mask, pad, "
                                         r"pad-causal, pad-empty, lpadN\[-causal\] or gapSxL\[-causal\]$"):
        case_relation("lpad", 2, 9)


def test_a_case_reads_its_mask_token_once(monkeypatch):
    from attn_ledger.probes.kernel import cases as kernelcases
    from attn_ledger.probes.kernel.spec import Declaration

    seen: list[str] = []
    real = kernelcases.case_relation
    monkeypatch.setattr(kernelcases, "case_relation", lambda token, b, tk: (seen.append(token), real(token, b, tk))[1])
    case = kernelcases.parse_case("b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-f32")
    kernelcases.case_inputs(case)
    assert case.call_text() == "attention(q, k, v, allow_mask=left_padding([8, 4])[B, 1, 1, Tk], is_causal=True)"
    assert Declaration(masks=("none", "mask")).outside(case) == "is_causal"
    assert (case.causal, case.left_padding(), case.gap(), case.to_json()["mask"]) == (True, [8, 4], None, "lpad8-causal")
    assert seen == ["lpad8-causal"]
