"""Heatmaps and the HTML page without a browser: which cells are marked, which example is drawn,
the terminal layout at 80 columns, pooling and the message beyond the drawable size, and a page
that loads nothing. The page in a real browser: tests/test_html_browser.py."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import ledger_on_qkv, run_ledger
from attn_ledger.render.heatmap import TERMINAL_LIMIT, render_heatmap, shade
from attn_ledger.render.html import HTML_LIMIT, render_html, weight_fill
from attn_ledger.render.pictures import MASK_CATEGORIES, NotDrawn, build_picture

runner = CliRunner()
ROOT = Path(__file__).parent.parent


def invoke(*args: str, columns: int = 80):
    return runner.invoke(app, list(args), env={"COLUMNS": str(columns)})


@pytest.fixture(scope="module")
def polarity():
    return run_ledger(load_config(overrides={"fault": "mask-polarity"}))


@pytest.fixture(scope="module")
def healthy():
    return run_ledger(load_config())


def _causal_forbidden(t: int) -> set[tuple[int, int]]:
    return {(i, j) for i in range(t) for j in range(t) if j > i}


# --- the cells a failing check points at ------------------------------------------------------


def test_mask_polarity_marks_as_many_cells_as_each_check_counts(polarity):
    marks = polarity.tensors["marks"]
    for key in ("masked_scores.forbidden_excluded", "masked_scores.allowed_kept", "masked_scores.no_fully_blocked_query"):
        stage, _, name = key.partition(".")
        assert int(marks[key].sum()) == polarity.check(stage, name).value
    leaked = marks["masked_scores.forbidden_excluded"]  # [B, Nh, Tq, Tk]
    assert {(i, j) for i, j in leaked[0, 0].nonzero().tolist()} == _causal_forbidden(5)
    assert marks["masked_scores.no_fully_blocked_query"][0, 0].nonzero().flatten().tolist() == [4]


def test_failing_checks_are_located_at_their_first_cell(polarity):
    assert polarity.check("masked_scores", "forbidden_excluded").location == {"example": 0, "head": 0, "query": 0, "key": 1}
    assert polarity.check("masked_scores", "allowed_kept").location == {"example": 0, "head": 0, "query": 0, "key": 0}
    assert polarity.first_finding.check.location == {"example": 0, "head": 0, "query": 4}


def test_a_passing_run_marks_nothing(healthy):
    assert "marks" not in healthy.tensors
    assert all(c.location is None for _, c in healthy.checks())
    pic = build_picture(healthy, "weights", TERMINAL_LIMIT)
    assert pic.marks == () and all(not m for h in pic.heads for row in h.marked for m in row)


def _leak_in_example_1():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 4, 8, generator=g) for _ in range(3))  # [B, Nh, T, Dh]
    allow = torch.ones(4, 4, dtype=torch.bool).tril()  # [Tq, Tk]
    w = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allow, float("-inf")).softmax(-1)  # [B, Nh, Tq, Tk]
    w[1, 0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # example 1, query 0 puts half its weight on key 1
    return ledger_on_qkv(q, k, v, mask="causal", weights=w)


def test_the_diverging_example_is_drawn_and_named():
    report = _leak_in_example_1()
    finding = report.first_finding
    assert (finding.row, finding.name) == ("weights", "user_weights_forbidden_weight")
    assert finding.check.location == {"example": 1, "head": 0, "query": 0, "key": 1}
    pic = build_picture(report, "weights", TERMINAL_LIMIT)
    assert (pic.example, pic.examples, pic.source) == (1, 2, "given weights")
    assert "user_weights_forbidden_weight" in pic.why
    marked = {(i, j) for i, row in enumerate(pic.heads[0].marked) for j, m in enumerate(row) if m}
    assert marked == {(0, 1)}
    assert pic.heads[0].values[0][:2] == [0.5, 0.5]


def test_a_finding_no_cell_explains_draws_its_located_example_without_marks():
    report = run_ledger(load_config(overrides={"fault": "no-scale"}))  # scores differ from the reference: no cell
    where = report.first_finding.check.location  # the engine locates the largest difference
    assert where is not None and set(where) == {"example", "head", "query", "key"}
    pic = build_picture(report, "weights", TERMINAL_LIMIT)
    assert pic.example == where["example"] and pic.marks == ()


# --- the terminal heatmap ---------------------------------------------------------------------


def _panel(text: str, head: int, tq: int, tk: int) -> list[list[str]]:
    """The two-character cells of one head's panel (rendered narrow, so one panel a line group)."""
    lines = text.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.startswith(f"head {head}"))
    rows = lines[top + 2: top + 2 + tq]
    label_w = len(f"q{tq - 1}") + 2
    assert [r.split()[0].rstrip("!") for r in rows] == [f"q{i}" for i in range(tq)]
    return [[r[label_w + 2 * j: label_w + 2 * j + 2] for j in range(tk)] for r in rows]


def test_show_mask_marks_the_leaked_cells(polarity):
    text = render_heatmap(polarity, "mask", width=20)
    for head in range(3):
        cells = _panel(text, head, 5, 5)
        leaked = {(i, j) for i in range(5) for j in range(5) if cells[i][j] == "XX"}
        dropped = {(i, j) for i in range(5) for j in range(5) if cells[i][j] == "oo"}
        assert leaked == _causal_forbidden(5)
        assert dropped == {(i, j) for i in range(5) for j in range(5)} - _causal_forbidden(5)
    rows = [ln for ln in text.splitlines() if ln.startswith("q4")]
    assert rows and all(ln.startswith("q4!") for ln in rows)  # the row with every key blocked


def test_show_weights_shades_and_marks_the_weights(polarity):
    text = render_heatmap(polarity, "weights", width=20)
    w = polarity.tensors["weights"][0, 1]  # example 0, head 1
    cells = _panel(text, 1, 5, 5)
    for i in range(5):
        for j in range(5):
            assert cells[i][j][0] == shade(float(w[i, j]), "ascii")
            assert cells[i][j][1] == ("X" if j > i else "o")  # leaked, or allowed but excluded


def test_healthy_mask_picture_is_the_causal_relation(healthy):
    cells = _panel(render_heatmap(healthy, "mask", width=20), 0, 5, 5)
    assert {(i, j) for i in range(5) for j in range(5) if cells[i][j] == ".."} == _causal_forbidden(5)
    assert all(cells[i][j] == "##" for i in range(5) for j in range(5) if j <= i)


def test_shades_cover_zero_to_one_and_not_finite():
    assert [shade(v, "ascii") for v in (0.0, 1e-9, 0.25, 0.26, 0.5, 0.75, 1.0, 2.0, float("nan"))] == \
        [" ", ".", ".", ":", ":", "+", "#", "#", "?"]
    assert shade(0.6, "unicode") == "▓"


def test_show_weights_at_80_columns_splits_no_number_or_label():
    narrow = invoke("run", "--fault", "mask-polarity", "--seq-len", "32", "--show", "weights", "--show", "mask", "--detail", columns=80)
    wide = invoke("run", "--fault", "mask-polarity", "--seq-len", "32", "--show", "weights", "--show", "mask", "--detail", columns=400)
    assert narrow.exit_code == 1 and wide.exit_code == 1, narrow.output
    assert max(len(ln) for ln in narrow.output.splitlines()) <= 80
    assert _tokens(narrow.output) == _tokens(wide.output)  # the same tokens, only laid out again
    assert any(ln.startswith("head 1") for ln in narrow.output.splitlines())  # heads wrapped onto further lines
    assert not re.search(r"[^\x00-\x7f]", narrow.output)  # not a terminal: ASCII only


def _tokens(text: str) -> list[str]:
    """Every whitespace-separated token but the table's rule, whose length follows the width."""
    return sorted(t for t in text.split() if set(t) != {"-"})


def test_show_heads_wrap_to_the_width():
    r = invoke("run", "--seq-len", "8", "--heads", "6", "--embed-dim", "24", "--show", "weights", columns=80)
    assert r.exit_code == 0, r.output
    titles = [ln for ln in r.output.splitlines() if ln.startswith("head ")]
    assert len(titles) == 2  # 6 panels of 22 columns: 3 fit in 80, then the rest on further lines
    assert [re.findall(r"head (\d+)", t) for t in titles] == [["0", "1", "2"], ["3", "4", "5"]]
    assert max(len(ln) for ln in r.output.splitlines()) <= 80


def test_show_pools_beyond_the_limit_and_says_so():
    report = run_ledger(load_config(overrides={"seq_len": 64, "keep_grids": True}))
    pic = build_picture(report, "weights", TERMINAL_LIMIT)
    assert (pic.tq, pic.tk, pic.pool, pic.rows, pic.cols) == (64, 64, (2, 2), 32, 32)
    w = report.tensors["weights"][0, 2]  # example 0, head 2
    assert pic.heads[2].values[3][1] == pytest.approx(float(w[6:8, 2:4].max()))
    r = invoke("run", "--seq-len", "64", "--show", "weights", columns=80)
    assert r.exit_code == 0
    assert "pooled: Tq=64, Tk=64 drawn as 32 x 32 cells" in " ".join(r.output.split())
    assert max(len(ln) for ln in r.output.splitlines()) <= 80


def test_show_beyond_the_kept_grids_says_what_it_draws():
    r = invoke("run", "--seq-len", "128", "--show", "weights", columns=80)  # grids streamed, not kept
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "weights heatmap not drawn" in text and f"up to Tq, Tk = {TERMINAL_LIMIT} cell by cell" in text
    assert not any(ln.startswith("head ") for ln in r.output.splitlines())


def test_show_with_keep_grids_draws_a_large_grid_pooled():
    report = run_ledger(load_config(overrides={"seq_len": 128, "keep_grids": True, "fault": "mask-polarity"}))
    pic = build_picture(report, "mask", TERMINAL_LIMIT)
    assert pic.pool == (4, 4) and pic.rows == 32
    # every pooled block right of the diagonal block holds a leak; blocks left of it only dropped pairs
    assert [MASK_CATEGORIES[int(v)] for v in pic.heads[0].values[0][:3]] == ["leaked", "leaked", "leaked"]
    assert MASK_CATEGORIES[int(pic.heads[0].values[5][0])] == "dropped"


def test_show_needs_the_table_format():
    r = invoke("run", "--show", "mask", "--format", "json")
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "show" in r.output


def test_show_goes_into_the_output_file(tmp_path):
    out = tmp_path / "ledger.txt"
    r = invoke("run", "--fault", "mask-polarity", "--show", "mask", "--output", str(out))
    assert r.exit_code == 1
    assert "q4!" in out.read_text() and "XX" in out.read_text()


def test_unicode_shades_on_a_terminal(polarity):
    text = render_heatmap(polarity, "weights", width=80, charset="unicode")
    assert set("░▒▓█") & set(text)


# --- the HTML page, read as a document ------------------------------------------------------------


class _Doc(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    def having(self, attr: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if attr in a]

    def with_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if cls in a.get("class", "").split()]


def parse(text: str) -> _Doc:
    doc = _Doc()
    doc.feed(text)
    return doc


def test_page_draws_nh_x_tq_x_tk_weight_cells_and_marks_the_leaks(polarity):
    doc = parse(render_html(polarity, "attn-ledger run --fault mask-polarity"))
    assert len(doc.with_class("wcell")) == 3 * 5 * 5
    assert len(doc.with_class("mcell")) == 3 * 5 * 5
    leaked = [a for a in doc.with_class("mcell") if "masked_scores.forbidden_excluded" in a.get("data-marks", "")]
    assert len(leaked) == 3 * 10
    assert {(int(a["data-query"]), int(a["data-key"])) for a in leaked} == _causal_forbidden(5)
    assert len(doc.with_class("rowmark")) == 2 * 3  # query 4 in each head, in both pictures


def test_page_marks_the_first_finding_on_its_stage(polarity):
    doc = parse(render_html(polarity))
    first = doc.having("data-first-finding")
    assert [a["data-row"] for a in first] == ["masked_scores"]
    assert [a["data-check"] for a in doc.having("data-finding-check")] == ["no_fully_blocked_query"]
    assert [a["data-row"] for a in doc.having("data-row")][:7] == ["input", "head_roundtrip", "q", "k", "v", "scores",
                                                                   "masked_scores"]


def test_page_loads_nothing_from_anywhere(polarity):
    text = render_html(polarity, "attn-ledger run --fault mask-polarity --html r.html")
    doc = parse(text)
    tags = {t for t, _ in doc.elements}
    assert not tags & {"link", "img", "iframe", "object", "embed", "audio", "video", "source"}
    assert all(not a.get("src") for _, a in doc.elements)
    assert all(a["href"].startswith("#") for a in doc.having("href"))
    assert "@import" not in text and "url(" not in text
    csp = [a["content"] for t, a in doc.elements if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and csp[0].startswith("default-src 'none'")
    assert "@media print" in text


def test_page_names_version_and_command_line(polarity):
    from attn_ledger._version import __version__

    text = render_html(polarity, "attn-ledger run --fault mask-polarity --html 'my report.html'")
    doc = parse(text)
    joined = "".join(doc.text)
    assert f"attn-ledger {__version__}" in joined
    assert "attn-ledger run --fault mask-polarity --html 'my report.html'" in joined


def test_page_beyond_the_kept_grids_says_so_and_pools_what_it_has():
    streamed = run_ledger(load_config(overrides={"seq_len": 128}))
    doc = parse(render_html(streamed))
    assert [a["data-not-drawn"] for a in doc.having("data-not-drawn")] == ["mask", "weights"]
    assert not doc.with_class("wcell")
    kept = run_ledger(load_config(overrides={"seq_len": 128, "keep_grids": True}))
    doc = parse(render_html(kept))
    assert [a["data-pooled"] for a in doc.having("data-pooled")] == ["true", "true"]
    assert len(doc.with_class("wcell")) == 3 * HTML_LIMIT * HTML_LIMIT


def test_weight_colours_run_from_white_to_dark_blue():
    assert weight_fill(0.0) == "#ffffff" and weight_fill(1.0) == "#08306b"
    assert weight_fill(float("nan")) != weight_fill(0.0)
    levels = [weight_fill(v / 10) for v in range(11)]
    assert len(set(levels)) == 11


def test_run_html_writes_the_page_and_keeps_the_exit_status(tmp_path):
    page = tmp_path / "report.html"
    r = invoke("run", "--fault", "mask-polarity", "--html", str(page))
    assert r.exit_code == 1
    doc = parse(page.read_text())
    assert [a["data-row"] for a in doc.having("data-first-finding")] == ["masked_scores"]
    assert f"--html {page}" in "".join(doc.text)


def test_html_into_a_directory_is_a_usage_error(tmp_path):
    r = invoke("run", "--html", str(tmp_path))
    assert r.exit_code == 2
    assert r.output.strip().startswith("error: html:") and r.output.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []


def test_html_and_output_may_not_be_one_file(tmp_path):
    same = tmp_path / "x.html"
    r = invoke("run", "--html", str(same), "--output", str(same))
    assert r.exit_code == 2 and not same.exists()


CHECK_CASES = ("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32", "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32",
               "b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32")


def test_check_html_lists_the_failing_cases_with_their_reproduction(tmp_path):
    page = tmp_path / "r.html"
    args = ["check", str(ROOT / "fixtures/kernels/sdpa_is_causal.py") + ":attention", "--html", str(page)]
    for case in CHECK_CASES:
        args += ["--case", case]
    r = invoke(*args)
    assert r.exit_code == 1, r.output
    doc = parse(page.read_text())
    failing = [a["data-case"] for a in doc.having("data-case")]
    assert failing == list(CHECK_CASES[1:])
    smallest = CHECK_CASES[1]  # the first finding: the failing case with the fewest elements
    assert [a["data-row"] for a in doc.having("data-first-finding")] == [smallest]
    text = "".join(doc.text)
    for case in failing:
        assert f"--case {case}" in text and f"case_inputs('{case}')" in text
    assert not doc.with_class("wcell")  # check sees outputs only: no grids to draw


def test_help_and_docs_name_the_picture_options():
    run_page = (ROOT / "docs" / "run.md").read_text()
    check_page = (ROOT / "docs" / "check.md").read_text()
    run_help = invoke("run", "--help", columns=200).output
    check_help = invoke("check", "--help", columns=200).output
    for opt in ("--show", "--html"):
        assert opt in run_help and opt in run_page
    assert "--html" in check_help and "--html" in check_page
