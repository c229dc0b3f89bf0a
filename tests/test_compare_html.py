"""``compare --html``: the page's plot of each block's total and added error against its bound, and each block's
section opening onto its stage ledgers, read from a report built here (no model, no torch).

The browser test (tests/test_html_browser.py) loads pages the command writes; this file holds the page's
structure to the report's numbers: one mark per block and series, placed on the right scale, the first adder
shaded and open, the ledgers where the report has them and a sentence where it has none.
"""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import pytest

from attn_ledger.render.html import render_html
from attn_ledger.render.layerplot import HEIGHT, TOP, BOTTOM, axis_of
from attn_ledger.report import Check, Report, Row, bounded

STAGE = Report("run", "ATTENTION LEDGER (model.layers.1.self_attn)",
               (Row("scores", "pass", (Check(3, "finite", "pass", "non-finite scores", 0, 0, "<="),)),
                Row("weights", "fail", (Check(4, "matches_reference", "fail", "max |diff|", 0.5, 1e-5, "<="),))),
               row_label="stage")


def _block(layer: int, total: float, added: float, bound: float, first: bool = False) -> Row:
    check = bounded(4, "added_error", "added error", added, bound)
    fields = {"layer": layer, "total": total, "added": added, "bound": bound, "room": bound / added if added else None}
    return Row(f"model.layers.{layer}", check.status, (check,), fields={**fields, **({"mark": "first adder"} if first else {})})


def _report(numbers: list[tuple[float, float, float]], first: int | None, attention: dict | None = None) -> Report:
    rows = [Row("masks", "pass", (Check(2, "masks", "pass", "pairs", 0, 0, "<="),), fields={"total": None})]
    rows += [_block(i, *n, first=i == first) for i, n in enumerate(numbers)]
    adder = None if first is None else {"block": f"model.layers.{first}", "layer": first,
                                       **({"attention": attention} if attention is not None else {})}
    details = {"vary": {"kind": "attn-implementation", "a": "eager", "b": "mine"}, "first_adder": adder}
    ledgers = {"A: model.layers.1.self_attn": STAGE, "B: model.layers.1.self_attn": STAGE} if attention else {}
    return Report("compare", "compare llama", tuple(rows), details=details, unit="row", row_label="layer",
                  ledgers=ledgers)


ATTENTION = {"block": "model.layers.1", "why": None, "calls": [
    {"run": "A", "call": "model.layers.1.self_attn", "status": "pass", "check": None, "reason": "", "diagnosis": None,
     "stage": None, "stage_check": None, "ledger": "A: model.layers.1.self_attn"},
    {"run": "B", "call": "model.layers.1.self_attn", "status": "fail", "check": "reference", "reason": "",
     "diagnosis": "kv heads tiled", "stage": "weights", "stage_check": "matches_reference",
     "ledger": "B: model.layers.1.self_attn"}]}


class _Page(HTMLParser):
    """Every element's tag and attributes, and the element each one sits in (by index)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], int]] = []
        self.open: list[int] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}, self.open[-1] if self.open else -1))
        if tag not in ("meta", "br", "line", "rect", "circle", "polyline", "input", "img"):
            self.open.append(len(self.elements) - 1)

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}, self.open[-1] if self.open else -1))

    def handle_endtag(self, tag):
        while self.open and self.elements[self.open[-1]][0] != tag:
            self.open.pop()
        if self.open:
            self.open.pop()

    def points(self, series: str) -> list[dict[str, str]]:
        return [a for _, a, _ in self.elements if a.get("data-series") == series]

    def inside(self, index: int, attr: str) -> list[str]:
        """``attr`` of every element within element ``index``."""
        out = []
        for i, (_, a, parent) in enumerate(self.elements):
            p = parent
            while p > index:
                p = self.elements[p][2]
            if p == index and attr in a:
                out.append(a[attr])
        return out

    def index(self, attr: str, value: str) -> int:
        return next(i for i, (_, a, _) in enumerate(self.elements) if a.get(attr) == value)


def _y(a: dict[str, str]) -> float:
    return float(a.get("cy") or a.get("y1") or float(a["y"]) + 4)


def test_the_plot_has_one_mark_per_block_and_series_and_marks_the_first_adder():
    report = _report([(1e-6, 1e-6, 4e-5), (3.0, 2.5, 3e-5), (9.0, 1e-6, 3e-5)], first=1, attention=ATTENTION)
    page = _Page(render_html(report))
    for series, field in (("total", "total"), ("added", "added"), ("bound", "bound")):
        marks = page.points(series)
        assert [m["data-layer"] for m in marks] == ["0", "1", "2"]
        assert [float(m["data-value"]) for m in marks] == pytest.approx([r.fields[field] for r in report.rows[1:]],
                                                                         rel=1e-2)
    added = page.points("added")
    assert _y(added[1]) < _y(added[0])  # a larger error sits higher
    assert [m["class"].split() for m in added] == [["pt", "added"], ["pt", "added", "first"], ["pt", "added"]]
    shaded = [a for _, a, _ in page.elements if "first-adder" in a.get("class", "").split()]
    assert [a["data-layer"] for a in shaded] == ["1"]
    svg = next(a for t, a, _ in page.elements if t == "svg" and "layer-plot" in a.get("class", ""))
    assert svg["data-scale"] == "log"  # 1e-6 to 9: the values span decades
    links = [a["href"] for _, a, _ in page.elements if "plot-layer" in a.get("class", "").split()]
    sections = [(t, a) for t, a, _ in page.elements if re.fullmatch(r"layer-\d+", a.get("id", ""))]
    assert links == ["#layer-0", "#layer-1", "#layer-2"] == ["#" + a["id"] for _, a in sections]
    assert [(t, a["data-block"], "open" in a) for t, a in sections] == [
        ("details", "model.layers.0", False), ("details", "model.layers.1", True), ("details", "model.layers.2", False)]


def test_the_first_adder_opens_onto_each_runs_stage_ledger_and_other_blocks_say_they_have_none():
    report = _report([(1e-6, 1e-6, 4e-5), (3.0, 2.5, 3e-5), (9.0, 1e-6, 3e-5)], first=1, attention=ATTENTION)
    page = _Page(render_html(report))
    ledgers = [page.inside(page.index("id", f"layer-{i}"), "data-ledger") for i in range(3)]
    assert ledgers == [[], ["A: model.layers.1.self_attn", "B: model.layers.1.self_attn"], []]
    runs = page.inside(page.index("id", "layer-1"), "data-run")
    assert runs == ["A", "B"]
    text = render_html(report)
    assert text.count("no stage ledger: only the first adder") == 2
    assert "kv heads tiled" in text and 'id="layer-1-1-row-weights"' in text  # the nested ledger's rows, its own ids


def test_a_first_adder_whose_attention_was_not_captured_says_so():
    report = _report([(1e-6, 1e-6, 4e-5), (3.0, 2.5, 3e-5)], first=1)
    page = _Page(render_html(report))
    assert page.inside(page.index("id", "layer-1"), "data-ledger") == []
    assert "no stage ledger: the attention calls of this block are not captured under --vary attn-implementation" \
        in render_html(report)


def test_a_passing_report_has_its_plot_and_no_adder():
    report = _report([(1e-6, 8e-7, 4e-6), (2e-6, 9e-7, 3e-6)], first=None)
    page = _Page(render_html(report))
    assert report.verdict == "pass"
    assert [len(page.points(s)) for s in ("total", "added", "bound")] == [2, 2, 2]
    assert not [a for _, a, _ in page.elements if "first" in a.get("class", "").split()]
    assert not [a for _, a, _ in page.elements if "first-adder" in a.get("class", "").split()]
    assert not [a for t, a, _ in page.elements if t == "details" and "open" in a]
    svg = next(a for t, a, _ in page.elements if t == "svg" and "layer-plot" in a.get("class", ""))
    assert svg["data-scale"] == "linear"  # 8e-7 to 4e-6: less than a decade apart


def test_a_zero_and_a_nan_are_placed_and_said():
    report = _report([(0.0, 0.0, 1e-6), (float("nan"), float("nan"), 1e-3)], first=1)
    page = _Page(render_html(report))
    total = page.points("total")
    assert [m["data-value"] for m in total] == ["0", "nan"]
    floor = HEIGHT - BOTTOM
    assert _y(total[0]) == pytest.approx(floor) and _y(total[1]) == pytest.approx(TOP)
    assert "not finite: drawn at the top edge" in render_html(report)


def test_no_plot_where_a_compare_has_no_block():
    report = Report("compare", "not applicable", (Row("cache", "not_applicable",
                                                     (Check(1, "cache", "not_applicable", reason="an encoder"),)),),
                    unit="row", row_label="layer")
    text = render_html(report)
    assert '<svg class="layer-plot"' not in text and 'id="layers"' not in text and 'id="layer-0"' not in text


@pytest.mark.parametrize("values, log, low, high", [
    ([1e-6, 9.9e-6], False, 0.0, 9.9e-6 * 1.1), ([1e-6, 1e-5], True, -6, -5), ([3e-7, 2.0, 0.0], True, -7, 1),
    ([0.0, math.nan], False, 0.0, 1.0)], ids=["within-a-decade", "one-decade", "with-zero", "nothing-positive"])
def test_the_axis_is_log_from_a_decade_on(values, log, low, high):
    axis = axis_of(values)
    assert (axis.log, axis.low) == (log, low) and axis.high == pytest.approx(high)
    ys = [axis.y(v) for v in sorted(v for v in values if v == v)]
    assert ys == sorted(ys, reverse=True)  # larger values higher on the page
