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
from attn_ledger.render.notes import note_text, notes_text
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
    assert (repro.data["case"], repro.data["options"], repro.data["call"]) == (
        CASE, [], "attention(q, k, v, is_causal=True)")
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
