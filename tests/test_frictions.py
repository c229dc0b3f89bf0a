"""Small frictions a new user meets: the help's types and choices, "did you mean", the HTML headings, the CI install."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import Fault
from attn_ledger.errors import did_you_mean
from attn_ledger.render.html import render_html
from attn_ledger.report import Check, Report, Row

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
COMMANDS = ["run", "sweep-scale", "polarity", "intervene", "check", "faults"]


def help_text(*args: str, columns: int = 100) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]], ids=["root", *COMMANDS])
def test_help_shows_no_type_after_a_flag(command):
    text = help_text(*command)
    assert "<bool>" not in text
    assert re.search(r"--help\s+-h\s+Show this message", text)


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_help_names_a_long_choice_list_and_lists_it_whole_in_the_help(columns):
    text = help_text("run", columns=columns)
    assert re.search(r"--fault\s+<fault>\s+Inject one deliberate failure", text)
    assert re.search(r"--dtype\s+<dtype>\s+Compute dtype", text)
    words = set(re.findall(r"[\w-]+", text))
    for fault in Fault:
        assert fault.value in words, fault.value  # never cut across lines
    assert {"float32", "float64", "float16", "bfloat16"} <= words
    # short lists stay in the type column
    assert "<random|arange>" in text


def test_help_view_leaves_the_options_as_they_were():
    import typer.main

    help_text("run")
    cmd = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    fault = next(p for p in cmd.params if p.name == "fault")
    assert fault.metavar is None and fault.help == "Inject one deliberate failure into the built-in pipeline."


def _error(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    return lines[0]


def test_an_enum_value_close_to_a_choice_is_named():
    assert _error("run", "--mask", "causl").endswith("; did you mean 'causal'?")
    assert _error("run", "--mask", "causal+paddin").endswith("; did you mean 'padding'?")
    assert _error("run", "--dtype", "float31").endswith(
        "--dtype: got 'float31', expected one of float32, float64, float16, bfloat16; did you mean 'float32'?")
    assert _error("check", "x.py:f", "--empty-rows", "zero").endswith("; did you mean 'zeros'?")
    # nothing close: no guess
    assert "did you mean" not in _error("run", "--mask", "zzzz")
    assert "did you mean" not in _error("run", "--dtype", "int8")


def test_a_config_key_or_value_close_to_a_known_one_is_named(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("num_head = 3\n")
    line = _error("run", str(cfg))
    assert line.startswith("error: unknown config key 'num_head' (value 3)") and line.endswith("did you mean 'num_heads'?")
    cfg.write_text('dtype = "float31"\n')
    assert _error("run", str(cfg)).endswith("; did you mean 'float32'?")
    cfg.write_text('mask = "causl"\n')
    assert _error("run", str(cfg)).endswith("; did you mean 'causal'?")
    cfg.write_text("wibble = 3\n")
    assert "did you mean" not in _error("run", str(cfg))


def test_did_you_mean_needs_a_close_string():
    assert did_you_mean("num_head", ["num_heads", "seq_len"]) == "; did you mean 'num_heads'?"
    assert did_you_mean("xyz", ["num_heads", "seq_len"]) == ""
    assert did_you_mean(3, ["3"]) == "" and did_you_mean("", ["a"]) == ""


def test_a_passing_html_page_does_not_repeat_its_heading():
    report = Report("check", "check k.py:attention", (Row("b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32", "pass",
                                                         (Check(4, "reference", "pass"),)),), row_label="case")
    page = render_html(report)
    assert "<h2>First finding</h2><p>none: no check failed</p>" in page
    assert "first finding: none" not in page


def test_the_failing_rows_section_is_named_after_its_rows():
    failing = Row("core", "fail", (Check(4, "attention_core", "fail", reason="weights off"),))
    module = Report("check", "check --module m.py:make", (failing,), row_label="aspect")
    assert "<h2>Failing aspect (1)</h2>" in render_html(module)
    cases = Report("check", "check k.py:attention", (Row("a", "fail", (Check(4, "reference", "fail"),)),
                                                     Row("b", "fail", (Check(4, "reference", "fail"),))),
                   row_label="case")
    assert "<h2>Failing cases (2)</h2>" in render_html(cases)


def test_the_ci_page_installs_from_the_repository_not_an_index():
    page = (ROOT / "docs" / "ci.md").read_text()
    installs = [ln.strip() for ln in page.splitlines() if "pip install" in ln and "attn-ledger" in ln]
    assert installs and not any(re.fullmatch(r"pip install attn-ledger\b.*", ln) for ln in installs)
    assert 'pip install "attn-ledger @ git+$ATTN_LEDGER_GIT" pytest' in installs
    assert "pip install /path/to/attn-ledger" in page


def test_a_module_page_names_its_failing_aspects(tmp_path):
    page = tmp_path / "m.html"
    module = f"{ROOT / 'fixtures' / 'modules' / 'attention_modules.py'}:not_causal"
    result = runner.invoke(app, ["check", "--module", module, "--embed-dim", "12", "--heads", "2", "--in-process",
                                 "--html", str(page)])
    assert result.exit_code == 1, result.output
    text = page.read_text()
    assert re.search(r"<h2>Failing aspects? \(\d+\)</h2>", text) and "Failing cases" not in text


def test_a_declaration_key_close_to_a_known_one_is_named(tmp_path):
    from attn_ledger.errors import InputError
    from attn_ledger.probes.kernel.spec import from_sources

    (tmp_path / "pyproject.toml").write_text("[tool.attn-ledger.check]\nstrict_covrage = true\n")
    with pytest.raises(InputError, match=r"strict_covrage: unknown key, .*; did you mean 'strict_coverage'\?$"):
        from_sources({}, tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.attn-ledger.check]\nwibble = true\n")
    with pytest.raises(InputError) as info:
        from_sources({}, tmp_path)
    assert "did you mean" not in str(info.value)
