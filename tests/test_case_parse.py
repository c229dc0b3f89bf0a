"""A case id given to ``check --case`` is parsed once, by the command; the parsed case travels from there."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.probes.kernel import cases

ROOT = Path(__file__).resolve().parents[1]
GOOD = f"{ROOT / 'fixtures' / 'kernels' / 'good.py'}:attention"
CASE = "b1-h2kv1-tq3tk5-dh4dv4-causal-flag-rand-f32"
# every module the check of a kernel goes through, loaded before the parser is counted
ON_THE_WAY = ("attn_ledger.commands.check", "attn_ledger.runner.tasks", "attn_ledger.runner.worker",
              "attn_ledger.probes.kernel.check", "attn_ledger.probes.kernel.spec", "attn_ledger.testing")


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every id :func:`cases.parse_case` reads, in order, wherever a module holds the parser by name."""
    for name in ON_THE_WAY:
        importlib.import_module(name)
    seen: list[str] = []
    real = cases.parse_case

    def counting(case_id, *args, **kwargs):
        seen.append(case_id)
        return real(case_id, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("attn_ledger") and getattr(module, "parse_case", None) is real:
            monkeypatch.setattr(module, "parse_case", counting)
    return seen


@pytest.mark.parametrize("protocol", [[], ["--protocol", "kernel"]], ids=["detected", "kernel"])
def test_check_case_parses_the_id_once(parses, protocol):
    r = CliRunner().invoke(app, ["check", GOOD, "--case", CASE, *protocol, "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["details"]["cases_total"] == 1
    assert parses == [CASE]


def test_the_counter_sees_a_second_parse(parses):
    """The fixture counts what it should: a module that parses the id again shows up as a second call."""
    from attn_ledger.probes.kernel import check

    check.parse_case(CASE)
    cases.parse_case(CASE)
    assert parses == [CASE, CASE]
