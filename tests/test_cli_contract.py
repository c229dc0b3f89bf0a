"""The exit-status contract and the house rules every command shares.

0 pass, 1 finding, 2 bad input or usage (one line), 3 an internal error of the tool (one line
saying so; JSON output gets an ``error`` envelope). Also: the import graph has no cycles and
points down only, and the declared torch requirement admits newer releases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.render.jsondoc import schema

ROOT = Path(__file__).parent.parent
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, list(args), env={"COLUMNS": "100", **(env or {})})


def _one_line_error(r, *needles):
    err = r.stderr.strip()
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in r.output and "╭" not in err
    for n in needles:
        assert n in err, (n, err)


# --- usage errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needles", [
    (("run", "--format", "xml"), ("--format", "'xml'", "table, json, markdown, junit, github")),
    (("run", "--dtype", "int3"), ("--dtype", "'int3'", "float32")),
    (("run", "--seq-len", "abc"), ("--seq-len", "'abc'", "whole number")),
    (("run", "--bogus"), ("--bogus", "no such option")),
    (("faults", "--format", "yaml"), ("--format", "'yaml'")),
    (("check", "x.py:f", "--empty-rows", "sometimes"), ("--empty-rows", "'sometimes'", "zeros")),
    (("nosuchcommand",), ("nosuchcommand",)),
])
def test_usage_errors_are_one_line_naming_option_value_and_choices(args, needles):
    _one_line_error(invoke(*args), *needles)


def test_a_huge_option_value_is_cut_in_the_message():
    r = invoke("run", "--format", "x" * 100_000)
    _one_line_error(r, "--format")
    assert len(r.stderr) < 400


# --- internal errors: exit 3 ------------------------------------------------------------------------

def _plant_bug(monkeypatch):
    import attn_ledger.ledger as L

    def broken(*a, **k):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(L, "run_ledger", broken)


def test_a_bug_in_the_tool_is_exit_3_with_one_line(monkeypatch, tmp_path):
    _plant_bug(monkeypatch)
    out = tmp_path / "never.txt"
    r = invoke("run", "--output", str(out))
    assert r.exit_code == 3, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "--debug" in err and "planted bug" in err
    assert "Traceback" not in r.output
    assert not out.exists()


def test_a_bug_in_the_tool_gives_an_error_envelope_in_json(monkeypatch):
    _plant_bug(monkeypatch)
    r = invoke("run", "--format", "json")
    assert r.exit_code == 3
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema())
    assert doc["verdict"] == "error" and "planted bug" in doc["error"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(monkeypatch, how):
    _plant_bug(monkeypatch)
    if how == "flag":
        r = invoke("run", "--debug")
    else:
        monkeypatch.setenv("ATTN_LEDGER_DEBUG", "1")
        r = invoke("run", env={"ATTN_LEDGER_DEBUG": "1"})
    assert r.exit_code == 3 and "Traceback" in r.stderr and "planted bug" in r.stderr
    monkeypatch.delenv("ATTN_LEDGER_DEBUG", raising=False)
    os.environ.pop("ATTN_LEDGER_DEBUG", None)


def test_findings_are_never_exit_3():
    assert invoke("run", "--fault", "no-scale").exit_code == 1
    assert invoke("run").exit_code == 0


# --- --output ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["directory", "empty", "proc_file", "proc_dir", "missing_dir"])
def test_unwritable_output_is_one_line_and_nothing_written(tmp_path, where):
    target = {
        "directory": str(tmp_path),
        "empty": "",
        "proc_file": "/proc/version",
        "proc_dir": "/proc/attn-ledger-report.json",
        "missing_dir": str(tmp_path / "no" / "such" / "dir.json"),
    }[where]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = invoke("run", "--output", target)
    _one_line_error(r, "output")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_output_is_written_whole(tmp_path):
    out = tmp_path / "r.json"
    r = invoke("run", "--format", "json", "--output", str(out))
    assert r.exit_code == 0 and r.stdout == ""
    jsonschema.validate(json.loads(out.read_text()), schema())
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # the usual mode of a new file, not mkstemp's 0600


# The import graph's floors and loops: tests/test_layering.py.


# --- installing like a library --------------------------------------------------------------------

def test_torch_requirement_admits_newer_releases():
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    for version in ("2.13.0", "2.14.1", "2.15.0", "3.0.0"):
        assert torch_req.specifier.contains(version), (str(torch_req), version)
    assert not torch_req.specifier.contains("2.3.0")


def test_installed_metadata_keeps_a_newer_torch():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("attn-ledger") or [] if not Requirement(r).marker]
    (torch_req,) = [r for r in reqs if r.name == "torch"]
    assert torch_req.specifier.contains("2.15.0")


def test_help_states_the_exit_statuses():
    r = subprocess.run([sys.executable, "-m", "attn_ledger", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for word in ("0 all that was asked holds", "1 a finding", "2 bad input", "3 an internal error"):
        assert word in " ".join(r.stdout.split()), word


def test_progress_bar_leaves_nothing_on_a_stderr_that_is_not_a_terminal(capfd):
    from attn_ledger.commands.common import Progress

    with Progress("work", delay_s=0.0) as bar:  # past its delay at once
        for done in range(1, 4):
            bar(done, 4)
    assert capfd.readouterr().err == ""  # a log or a pipe gets no bar and no blank line
