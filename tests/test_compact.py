"""The compact table view (the default) and ``--detail``; the GitHub job summary (``GITHUB_STEP_SUMMARY``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.render import render
from attn_ledger.render.table import summary, verdict_text
from attn_ledger.report import Check, Report, Row, bounded

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
STAGES = ["input", "head_roundtrip", "q", "k", "v", "scores", "masked_scores", "weights", "context", "merged",
          "output", "properties"]


def invoke(*args: str, columns: int = 80, env: dict | None = None):
    return runner.invoke(app, list(args), env={"COLUMNS": str(columns), **(env or {})})


def _ledger(**overrides):
    from attn_ledger.inputs.config import load_config
    from attn_ledger.ledger import run_ledger

    return run_ledger(load_config(overrides=overrides))


def _words(text: str) -> set[str]:
    return {w.strip(",;:()") for w in text.split() if set(w) != {"-"}} - {""}


def _row_lines(text: str) -> dict[str, list[str]]:
    """Each stage's lines: its own line and the lines under it up to the next stage's line."""
    out: dict[str, list[str]] = {}
    current = None
    for ln in text.splitlines():
        name = ln.split(" ", 1)[0]
        if name in STAGES and not ln.startswith(" "):
            current = name
            out[current] = [ln]
        elif current is not None and ln.startswith(" "):
            out[current].append(ln)
        else:
            current = None
    return out


# --- the healthy default ledger ---------------------------------------------------------------

def test_healthy_default_run_fits_24_lines_at_80_columns_and_starts_with_its_verdict():
    r = invoke("run")
    assert r.exit_code == 0, r.output
    lines = r.stdout.rstrip("\n").splitlines()
    assert len(lines) <= 24, r.stdout
    assert max(len(ln) for ln in lines) <= 80
    assert re.fullmatch(r"PASS: 12 stages, \d+ checks", lines[0])
    assert lines[-1] == "first finding: none"
    rows = _row_lines(r.stdout)
    assert list(rows) == STAGES  # stage by stage, in the seed's order
    for name in STAGES[1:]:
        assert len(rows[name]) == 1 and re.search(r"L\d(-L\d)? pass", rows[name][0]), rows[name]


def test_compact_at_80_columns_splits_no_number_or_identifier():
    led = _ledger()
    narrow, wide = render(led, "table", 80), render(led, "table", 240)
    footnote = [ln for ln in narrow.splitlines() if ln.startswith("not shown at 80 columns")]
    body = "\n".join(ln for ln in narrow.splitlines() if not ln.startswith(("not shown", "  --detail")))
    assert _words(body) <= _words(wide), _words(body) - _words(wide)
    for word in _words(body):  # every number and identifier is a whole one of the full ledger
        if re.fullmatch(r"[\d.e+-]+|[a-z]+_[a-z_]+", word):
            assert word in _words(render(led, "table", 240, detail=True)) | _words(wide), word
    assert footnote and "--detail" in narrow  # the facts left out at this width are named, not lost


@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_compact_keeps_tokens_whole_at_every_width(width):
    led = _ledger(fault="mask-polarity")
    text = render(led, "table", width)
    assert max(len(ln) for ln in text.splitlines()) <= width
    wide = render(led, "table", 400)
    assert {w for w in _words(text) if "_" in w} <= _words(wide)


# --- a failing ledger: the failing stage expanded, the rest one line each -------------------------

def test_split_reshape_expands_its_failing_stage_and_keeps_the_rest_to_one_line():
    r = invoke("run", "--fault", "split-reshape")
    assert r.exit_code == 1
    lines = r.stdout.rstrip("\n").splitlines()
    assert lines[0] == "FAIL at head_roundtrip (L2 roundtrip_exact)"
    rows = _row_lines(r.stdout)
    assert list(rows) == STAGES
    expansion = "\n".join(rows["head_roundtrip"][1:])
    for check in ("L1 pass shape", "L2 fail roundtrip_exact", "L2 fail split_head_slices", "L2 pass merge_head_slices"):
        assert check in expansion
    assert "= 96 (limit 0)" in expansion and rows["head_roundtrip"][-1].strip() == "^^ first finding: L2 roundtrip_exact"
    for name in STAGES[2:]:
        assert rows[name] == [rows[name][0]] and "not reached" in rows[name][0]
    assert lines[-2].startswith("first finding: head_roundtrip (L2 axis semantics: roundtrip_exact)")


@pytest.mark.parametrize("overrides,stage,check,where", [
    ({"fault": "split-reshape"}, "head_roundtrip", "roundtrip_exact", ""),
    ({"mask": "padding", "valid_lengths": [5, 0]}, "masked_scores", "no_fully_blocked_query", "at example 1"),
    ({"fault": "mask-polarity"}, "masked_scores", "no_fully_blocked_query", "at example 0, head 0, query 4"),
], ids=["split-reshape", "blocked-query", "inverted-polarity"])
def test_the_seeds_worked_examples_read_stage_by_stage(overrides, stage, check, where):
    """The seed's split-reshape, blocked-query and inverted-polarity ledgers: every stage in order with its
    shape, the first failing stage with its checks and the pointer under it, the closing first finding."""
    text = render(_ledger(**overrides), "table", 100)
    rows = _row_lines(text)
    assert list(rows) == STAGES
    seed_shapes = {"input": "(2, 5, 12)", "head_roundtrip": "(2, 5, 12)", "q": "(2, 3, 5, 4)", "scores": "(2, 3, 5, 5)"}
    for name, shape in seed_shapes.items():
        if "not reached" not in rows[name][0]:
            assert shape in rows[name][0]
    failing = rows[stage]
    assert " fail " in failing[0]
    assert failing[-1].strip().startswith(f"^^ first finding: L{2 if stage == 'head_roundtrip' else 3} {check}")
    assert where in failing[-1]
    after = STAGES[STAGES.index(stage) + 1:]
    assert all(len(rows[n]) == 1 and "not reached" in rows[n][0] for n in after)
    assert f"first finding: {stage} (" in text.splitlines()[-2] + text.splitlines()[-1] or f"first finding: {stage} (" in text
    if stage == "masked_scores":
        assert "allowed" in "\n".join(failing) and "intended relation" in "\n".join(failing)


def test_a_stage_with_a_warning_is_expanded_and_a_pass_is_not():
    warn = Row("scores", "warn", (Check(1, "shape", "pass"),
                                  bounded(3, "exp_headroom", "largest |score|", 20.0, 11.1, warn_only=True)))
    ok = Row("weights", "pass", (Check(1, "shape", "pass"), Check(3, "key_row_sums", "pass", value=0.0)))
    text = render(Report("run", "t", (warn, ok), row_label="stage"), "table", 100)
    lines = text.splitlines()
    assert lines[0] == "PASS: 2 stages, 4 checks (1 warn)"
    scores = lines.index(next(ln for ln in lines if ln.startswith("scores")))
    assert "L3 warn exp_headroom: largest |score| = 20 (limit 11.1)" in lines[scores + 2]
    assert [ln for ln in lines if ln.startswith("weights")][0].endswith("L1-L3 pass")
    assert not any(ln.startswith("warning at") for ln in lines)  # shown in its row, not again under the table


def test_summary_names_the_failing_check_with_its_value_and_limit():
    fail = Row("core", "fail", (bounded(4, "mask_relation", "pairs", 15, 0), bounded(4, "attention_core", "d", 1.2, 1e-5),
                                Check(4, "score_design", "pass")))
    first = Row("axes", "fail", (bounded(2, "head_merge", "d", 3, 0),))
    report = Report("check", "t", (first, fail), row_label="aspect")
    assert summary(fail, report) == "L4 fail mask_relation = 15 (limit 0) (+1 more)"
    assert summary(first, report) == "1 fail of 1 check:"  # the first finding's row: expanded under its line
    assert verdict_text(report) == "FAIL at axes (L2 head_merge)"


def test_library_renderer_is_compact_by_default_and_detail_on_request():
    led = _ledger()
    compact, detail = render(led, "table", 100), render(led, "table", 100, detail=True)
    assert compact.startswith("PASS: ") and not detail.startswith("PASS")
    assert "L2 pass roundtrip_exact = 0" in detail and "L2 pass roundtrip_exact" not in compact
    assert len(compact.splitlines()) < len(detail.splitlines())


@pytest.mark.parametrize("flag", ["--detail", "-v"])
def test_detail_flag_prints_every_check_and_leaves_other_formats_unchanged(flag):
    r = invoke("run", flag, columns=100)
    assert r.exit_code == 0
    assert r.stdout == render(_ledger(), "table", 100, detail=True)
    plain, detailed = invoke("run", "--format", "json"), invoke("run", "--format", "json", flag)
    strip = lambda d: {k: v for k, v in json.loads(d).items() if k not in ("details",)}
    assert strip(plain.stdout) == strip(detailed.stdout)


def test_check_module_is_one_line_per_aspect_with_the_failing_one_expanded():
    module = f"{ROOT / 'fixtures' / 'modules' / 'attention_modules.py'}:not_causal"
    r = invoke("check", "--module", module, "--embed-dim", "12", "--heads", "2", "--in-process")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith("FAIL at ")
    finding = lines[0].split()[2]
    aspect_lines = [ln for ln in lines if re.match(r"^[a-z_]+\s{2,}(pass|fail|warn)", ln)]
    assert len(aspect_lines) >= 5
    assert any(ln.strip().startswith("^^ first finding") for ln in lines)
    assert any(ln.startswith(finding) for ln in aspect_lines)


# --- GitHub job summary ------------------------------------------------------------------------

def test_github_format_appends_a_step_summary_and_keeps_what_was_there(tmp_path):
    path = tmp_path / "summary.md"
    path.write_text("## an earlier step\n")
    r = invoke("run", "--fault", "split-reshape", "--format", "github", env={"GITHUB_STEP_SUMMARY": str(path)})
    assert r.exit_code == 1 and r.stdout.startswith("::error ")
    text = path.read_text()
    assert text.startswith("## an earlier step\n\n### attn-ledger run: FAIL at head_roundtrip (L2 roundtrip_exact)")
    assert "**first finding: head_roundtrip (L2 axis semantics: roundtrip_exact)" in text
    assert "| head_roundtrip | fail | L2 roundtrip_exact | 96 | limit 0 |" in text
    r = invoke("run", "--format", "github", env={"GITHUB_STEP_SUMMARY": str(path)})
    assert r.exit_code == 0
    again = path.read_text()
    assert again.startswith(text) and again.count("### attn-ledger run") == 2 and "PASS: 12 stages" in again


def test_no_step_summary_for_other_formats_or_without_the_variable(tmp_path):
    path = tmp_path / "summary.md"
    path.write_text("kept\n")
    assert invoke("run", "--format", "json", env={"GITHUB_STEP_SUMMARY": str(path)}).exit_code == 0
    assert invoke("run", "--format", "github", env={"GITHUB_STEP_SUMMARY": ""}).exit_code == 0
    assert path.read_text() == "kept\n"


@pytest.mark.parametrize("where", ["missing-dir/summary.md", "."], ids=["no-directory", "a-directory"])
def test_a_bad_step_summary_path_is_one_line_and_exit_2(tmp_path, where):
    target = tmp_path / where
    r = invoke("run", "--format", "github", env={"GITHUB_STEP_SUMMARY": str(target)})
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: GITHUB_STEP_SUMMARY: got ")
    assert "Traceback" not in r.output


def test_step_summary_escapes_what_a_user_named():
    from attn_ledger.render.github import step_summary

    row = Row("a|b\u202e\n", "fail", (bounded(4, "reference", "max |diff|", 2.0, 1e-5),))
    text = step_summary(Report("check", "check k.py:attn|x", (row,), row_label="case"))
    assert "| a\\|b\\u202e\\n | fail | L4 reference | 2 | limit 1e-05 |" in text
    assert "k.py:attn\\|x" in text and "\u202e" not in text
