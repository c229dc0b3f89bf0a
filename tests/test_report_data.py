"""Data in reports, prose in render: notes, pictures, reproductions and heatmaps are data in the
report, the renderers write every sentence and picture from it, and render/ imports no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import jsonschema
import pytest

from attn_ledger.inputs.config import load_config
from attn_ledger.probes.kernel.check import check_kernel, parse_case
from attn_ledger.ledger import run_ledger
from attn_ledger.render import render
from attn_ledger.render.jsondoc import schema
from attn_ledger.render.notes import call_text, note_text, notes_text
from attn_ledger.report import Heatmap, Note, Report, Row
from attn_ledger.inputs.userload import load_object

ROOT = Path(__file__).parent.parent
RENDER = ROOT / "attn_ledger" / "render"
CASE = "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32"


@pytest.fixture(scope="module")
def ledger():
    return run_ledger(load_config(overrides={"fault": "mask-polarity"}))


@pytest.fixture(scope="module")
def checked():
    fn = load_object(f"{ROOT / 'fixtures/kernels/sdpa_is_causal.py'}:attention")
    return check_kernel(fn, [parse_case(CASE)], target="k.py:attention")


def words_in_data(report: Report) -> list[str]:
    """Notes that are words spanning several lines: a picture or a block of lines the renderers should
    have written from data (an empty list when there is none)."""
    notes = [*report.notes, *(r.note for r in report.rows)]
    return [n for n in notes if isinstance(n, str) and "\n" in n]


# --- render/ imports no torch ---------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions and TYPE_CHECKING too
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_render_module_names_torch():
    offenders = {p.name: sorted(m for m in _imports(p) if m.split(".")[0] in ("torch", "numpy"))
                 for p in sorted(RENDER.glob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


SCRIPT = """
import importlib, pkgutil, sys
import attn_ledger.render as r
for m in pkgutil.iter_modules(r.__path__):
    importlib.import_module("attn_ledger.render." + m.name)
from attn_ledger.render import FORMATS, render
from attn_ledger.render.html import render_html
from attn_ledger.report import Note, Report, Row, counted
rows = (Row("masked_scores", "fail", (counted(2, "forbidden_excluded", "forbidden pairs kept", 3),),
            note=Note("relation_picture", {"example": 0, "head": 0, "at_divergence": False,
                                           "allow": [[True, False], [True, True]]})),)
report = Report("run", "t", rows, notes=(Note("query_blocks", {"blocks": 2, "rows": 3}), "words"))
for fmt in FORMATS:
    render(report, fmt)
render_html(report)
print("torch" in sys.modules)
"""


def test_render_modules_and_every_view_run_without_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --- notes are data; the renderers write them -----------------------------------------------------


def test_a_multi_line_note_in_words_is_caught():
    bad = Report("run", "t", (Row("masked_scores", "pass", note="intended relation:\n q0  1 ."),), notes=("a\nb",))
    assert words_in_data(bad) == ["a\nb", "intended relation:\n q0  1 ."]


def test_the_ledger_keeps_its_notes_and_picture_as_data(ledger):
    assert words_in_data(ledger) == []
    picture = ledger.row("masked_scores").note
    assert isinstance(picture, Note) and picture.kind == "relation_picture"
    assert picture.data["allow"][0] == [True, False, False, False, False]  # causal: query 0 sees key 0 only
    shown = next(n for n in ledger.notes if isinstance(n, Note) and n.kind == "allowed_keys")
    assert shown.data["counts"] == [1, 2, 3, 4, 5]
    assert note_text(shown) == "allowed keys per query (b=0, h=0): [1, 2, 3, 4, 5]"
    assert note_text(picture).splitlines()[0] == "intended relation (b=0, h=0), queries as rows, keys as columns:"
    assert note_text(picture).splitlines()[2] == "q0     1   .   .   .   . "


def test_check_keeps_its_reproduction_as_data(checked):
    assert words_in_data(checked) == []
    repro = next(n for n in checked.notes if isinstance(n, Note) and n.kind == "reproduce")
    assert repro.data == checked.details["reproduce"]
    assert (repro.data["case"], repro.data["options"], call_text(repro.data["call"])) == (
        CASE, [], "attention(q, k, v, is_causal=True)")
    assert repro.data["call"]["is_causal"] is True and repro.data["call"]["allow_mask"] is None
    lines = notes_text(checked)
    at = lines.index("reproduce it:")
    assert lines[at - 1] == "its call: attention(q, k, v, is_causal=True)"
    assert lines[at + 1:at + 3] == ["attn-ledger check k.py:attention \\", f"    --case {CASE}"]
    assert lines[at + 4] == f"q, k, v, kw = case_inputs({CASE!r})"


@pytest.mark.parametrize("which", ["ledger", "checked"])
def test_json_notes_are_the_lines_and_note_data_their_facts(which, request):
    report = request.getfixturevalue(which)
    doc = json.loads(render(report, "json"))
    jsonschema.validate(doc, schema())
    assert doc["notes"] == notes_text(report)
    assert len(doc["note_data"]) == len(doc["notes"])
    for line, data in zip(doc["notes"], doc["note_data"]):
        if data is not None:  # the facts alone write the line again
            assert note_text(Note(data["kind"], {k: v for k, v in data.items() if k != "kind"})).splitlines()[0] == line
    for row in doc["rows"]:
        if row["note_data"] is not None:
            kind = row["note_data"].pop("kind")
            assert note_text(Note(kind, row["note_data"])) == row["note"]


def test_every_view_with_row_notes_writes_the_picture_from_the_data(ledger):
    from attn_ledger.render.html import render_html

    for text in (render(ledger, "table"), render(ledger, "markdown"), render_html(ledger)):
        assert "q4     1   1   1   1   1" in text.replace("<br>", "\n")
    assert "q4     1   1   1   1   1" in next(r["note"] for r in json.loads(render(ledger, "json"))["rows"]
                                            if r["name"] == "masked_scores")


# --- heatmaps are plain data ------------------------------------------------------------------------


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if is_dataclass(value):
        return all(_plain(getattr(value, f.name)) for f in fields(value))
    return False


def test_heatmaps_hold_only_plain_values(ledger):
    assert set(ledger.heatmaps) == {"mask", "weights"}
    for heat in ledger.heatmaps.values():
        assert isinstance(heat, Heatmap) and _plain(heat)
        assert (1, 1) in heat.levels  # Tq = Tk = 5: every cell drawn
    counts = {m.key: m.count for m in ledger.heatmaps["mask"].marks}  # in the example drawn: 1 of 2, both alike
    assert 2 * counts["masked_scores.forbidden_excluded"] == ledger.check("masked_scores", "forbidden_excluded").value


def test_a_stage_record_that_is_not_plain_is_caught():
    class Opaque:
        pass

    assert not _plain({"values": [[Opaque()]]})


def test_notes_as_data_cross_the_worker_boundary(checked):
    from attn_ledger.runner.worker import decode, encode

    back = decode(encode(checked))
    assert back == checked and notes_text(back) == notes_text(checked)
    assert any(isinstance(n, Note) for n in back.notes)


# --- every command's notes are data ------------------------------------------------------------------


def prose_notes(report: Report) -> list[str]:
    """The notes (the report's and each row's) that are words rather than data."""
    return [n for n in (*report.notes, *(r.note for r in report.rows)) if isinstance(n, str) and n]


def _kernel_outcomes() -> Report:
    """check on a kernel with every summary line: skips by declaration and by dtype, a warning, an inconclusive
    case, a case not reached, a failure with its reproduction, and what the calls did besides returning."""
    from dataclasses import replace

    from attn_ledger.probes.kernel.check import Plan, check_case, kernel_report, not_reached_case, with_call_notes

    good = load_object(f"{ROOT / 'fixtures/kernels/good.py'}:attention")
    wrong = load_object(f"{ROOT / 'fixtures/kernels/sdpa_is_causal.py'}:attention")
    ids = ["b1-h2kv1-tq3tk5-dh4dv4-causal-flag-rand-f32", "b2-h4kv2-tq5tk9-dh8dv4-pad-causal-index-f32",
           "b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32", "b1-h1kv1-tq3tk3-dh4dv4-none-rand-f32"]
    warned = check_case(good, parse_case(ids[0]), backward=False)
    warned = replace(warned, checks=tuple(replace(c, status="warn") if c.name == "precision" else c
                                          for c in warned.checks))
    failed = check_case(wrong, parse_case(ids[1]), backward=False)
    blank = check_case(good, parse_case(ids[2]), backward=False)
    blank = replace(blank, checks=tuple(c if c.level == 1 else replace(c, status="not_applicable") for c in blank.checks))
    stopped = not_reached_case(parse_case(ids[3]), "not reached: 1 case timed out (--max-timeouts 1)",
                               {"stopped_by": "max_timeouts", "max_timeouts": 1})
    results = [warned, failed, blank, stopped]
    plan = Plan(tuple(r.case for r in results), {"dtypes outside float32": 2},
                (Note("unsupported_dtype", {"dtype": "bfloat16", "device": "cpu"}),), "cpu")
    report = kernel_report(results, target="k.py:attention", plan=plan)
    called = {**failed.check("call").data, "returned_subclass": "Agreeable"}
    failed = replace(failed, checks=tuple(replace(c, data=called) if c.name == "call" else c for c in failed.checks))
    return with_call_notes(report, [warned, failed, blank, stopped],
                           {"flags": {"default dtype": ["float32", "float64"]}, "replaced": ["torch.softmax"]})


def _module_check() -> Report:
    from attn_ledger.probes.module.check import check_module

    return check_module(load_object(f"{ROOT / 'fixtures/modules/attention_modules.py'}:gpt_oss_sinks"), 8, 2)


def _ledger_with_rope_and_alignment() -> Report:
    import torch

    from attn_ledger.ledger import ledger_on_qkv

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    allow = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)  # bottom-right causal
    return ledger_on_qkv(q, k, v, allow_mask=allow, rope="half", grad=True)


def _experiments() -> list[Report]:
    from attn_ledger.experiments.intervene import run_intervene, stopped_intervention
    from attn_ledger.experiments.polarity import fingerprint, run_polarity
    from attn_ledger.experiments.scale import plotted, sweep_scale

    return [run_intervene(overrides={"mask": "causal"}),
            stopped_intervention("module m.py:f", (2, 6, 8), 2, "forward(x) timed out after 1 s", {"call": "forward(x)"}),
            run_polarity(), fingerprint(ROOT / "fixtures/masks/causal_float01.safetensors", "causal"),
            plotted(sweep_scale(dh=(8, 16), queries=16, keys=16), "scale.png"),
            sweep_scale(tensors=ROOT / "fixtures/qk/float16_std3.safetensors")]


def _catalogue_and_timing() -> list[Report]:
    from attn_ledger.commands.common import _with_timing
    from attn_ledger.probes.catalogue import CATALOGUE, run_catalogue

    return [_with_timing(run_catalogue(CATALOGUE[:2]), 1.234567)]


BUILDERS = {"kernel": lambda: [_kernel_outcomes()], "module": lambda: [_module_check()],
            "ledger": lambda: [_ledger_with_rope_and_alignment()], "experiments": _experiments,
            "catalogue": _catalogue_and_timing}


@pytest.mark.parametrize("which", sorted(BUILDERS))
def test_every_command_keeps_its_notes_as_data_and_the_json_writes_them_again(which):
    for report in BUILDERS[which]():
        assert prose_notes(report) == [], report.command
        doc = json.loads(render(report, "json"))
        jsonschema.validate(doc, schema())
        assert doc["notes"] == notes_text(report)
        for line, data in zip(doc["notes"], doc["note_data"]):
            if data is not None:
                assert note_text(Note(data.pop("kind"), data)).splitlines()[0] == line
        for row in doc["rows"]:
            if row["note_data"] is not None:
                assert note_text(Note(row["note_data"].pop("kind"), row["note_data"])) == row["note"]


def test_the_kernel_summary_lines_read_as_before():
    lines = notes_text(_kernel_outcomes())
    assert lines[:2] == ["1 case returned a tensor subclass (Agreeable); it was judged as a plain tensor",
                         "your code changed torch's global state: default dtype float32 -> float64; replaced "
                         "torch.softmax (since before the import)"]
    assert "bfloat16 cases skipped: this torch build cannot run them on cpu" in lines
    assert "2 cases skipped: outside the declaration (2 for dtypes outside float32)" in lines
    assert "1 of 4 cases not reached: 1 case timed out (--max-timeouts 1)" in lines
    assert any(line.startswith("1 case inconclusive: no check past L1 judged it (warning; smallest ") for line in lines)
    assert "its call: attention(q, k, v, allow_mask=key_padding(lengths=[8, 6])[B, 1, 1, Tk], is_causal=True)" in lines


def test_a_report_with_words_for_notes_is_caught():
    assert prose_notes(Report("run", "t", (Row("scores", "pass", note="words"),), notes=("more words",))) == [
        "more words", "words"]


def _diagnosis_case():
    from attn_ledger.report import Check

    position = {"layout": 0, "finite": 1, "reference": 2}
    ref = Check(4, "reference", "fail", data={"diagnosis": "kv heads tiled"})
    layout = Check(1, "layout", "fail", reason="transposed")
    own = Check(1, "layout", "fail", reason="transposed", data={"diagnosis": "heads first"})
    return position, ref, layout, own


def test_the_reference_diagnosis_is_carried_to_the_first_failing_check():
    from attn_ledger.report import Check, carry_diagnosis

    position, ref, layout, own = _diagnosis_case()
    finite = Check(3, "finite", "pass")
    carried = carry_diagnosis([layout, finite, ref], position, "the output matches")
    assert carried[0].reason == "transposed; the output matches kv heads tiled"
    assert carried[0].data["diagnosis"] == "kv heads tiled"
    assert carried[1:] == (finite, ref)
    # a first failing check with a diagnosis of its own keeps it only where asked
    assert carry_diagnosis([own, ref], position, "the context matches", keep_own=True) == (own, ref)
    assert carry_diagnosis([own, ref], position, "x")[0].data["diagnosis"] == "kv heads tiled"


def test_no_diagnosis_is_carried_where_there_is_none_to_carry():
    from attn_ledger.report import Check, carry_diagnosis

    position, ref, layout, _ = _diagnosis_case()
    plain_ref = Check(4, "reference", "fail")
    assert carry_diagnosis([layout, plain_ref], position, "x") == (layout, plain_ref)  # no diagnosis
    assert carry_diagnosis([ref], position, "x") == (ref,)  # the reference is the first failing check
    passing = Check(1, "layout", "pass")
    assert carry_diagnosis([passing], position, "x") == (passing,)  # nothing failing, no reference
