"""The causal intervention: the seed's numbers, both controls failing, both grad paths, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import torch
from typer.testing import CliRunner

import modules_for_tests as bad
from attn_ledger.cli import app
from attn_ledger.experiments.intervene import intervene_report
from attn_ledger.probes.common.forward import (
    CutResult,
    builtin_controls,
    causal_intervention,
    cut_checks,
    module_forward,
    path_check,
)
from attn_ledger.maths.layer import BuiltinAttention
from attn_ledger.maths.pipeline import make_input

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"
runner = CliRunner()


def x_default() -> torch.Tensor:
    return make_input(2, 5, 12, "random", 0, torch.float32)  # [B, T, E], the embedded default


def test_causal_builtin_prefix_exactly_zero_suffix_clearly_nonzero():
    result = causal_intervention(module_forward(BuiltinAttention(12, 3).eval()), x_default())
    assert result.verdict == "causal"
    assert [c.cut for c in result.cuts] == [0, 1, 2, 3]
    for cut in result.cuts:
        assert cut.prefix_delta == 0.0
        assert cut.suffix_delta > 0.1  # the seed saw 0.39 at i=2; anything near 0 would be vacuous
        assert cut.suffix_delta > 100 * cut.threshold
        assert [(c.name, c.status) for c in cut_checks(cut)] == [
            ("prefix_unchanged", "pass"), ("finite", "pass"), ("suffix_moved", "pass")]


@pytest.mark.parametrize("name", ["causal-off", "mask-polarity"])
def test_each_control_fails(name):
    controls = {n: m for n, _d, m in builtin_controls(12, 3, 0, torch.float32)}
    result = causal_intervention(module_forward(controls[name]), x_default())
    assert result.verdict == "leak"
    leak = result.first_leak
    assert (leak.cut, leak.moved_position) == (0, 0)
    assert result.max_prefix_delta > 0.3  # the seed: 0.38 (masking off) and 0.66 (wrong polarity)
    check = path_check(result, "causal")
    assert check.status == "fail" and check.location == {"cut": 0, "position": 0} and check.value > check.limit


@pytest.mark.parametrize("mode", ["no_grad", "autograd"])
def test_one_cut(mode):
    result = causal_intervention(module_forward(BuiltinAttention(12, 3).eval()), x_default(), cuts=[2], grad_mode=mode)
    assert [c.cut for c in result.cuts] == [2] and result.ok and result.grad_mode == mode


@pytest.mark.parametrize(
    "cut, failing",
    [
        (CutResult(0, 0.5, 1.0, 1e-5, 1e-3, 0, 0), {"prefix_unchanged"}),
        (CutResult(0, 0.0, 0.0, 0.0, 0.0, None, 0), {"suffix_moved"}),  # zeros: nothing moved at a threshold of 0
        (CutResult(0, 0.0, 1.0, 1e-5, 1e-3, None, 3), {"finite"}),
        (CutResult(0, 0.0, 1.0, 1e-5, 1e-3, None, 0), set()),
    ],
    ids=["leak", "vacuous", "nonfinite", "pass"],
)
def test_cut_checks_fail_one_by_one(cut, failing):
    checks = {c.name: c for c in cut_checks(cut)}
    assert {n for n, c in checks.items() if c.failed} == failing
    assert (checks["prefix_unchanged"].value, checks["prefix_unchanged"].limit) == (cut.prefix_delta, cut.tolerance)
    assert (checks["suffix_moved"].value, checks["suffix_moved"].limit) == (cut.suffix_delta, cut.threshold)
    assert checks["finite"].value == cut.nonfinite


def test_vacuous_when_nothing_changes():
    result = causal_intervention(module_forward(bad.zeros(12, 2).eval()), x_default())
    assert result.verdict == "vacuous"
    assert all(c.suffix_delta == 0.0 for c in result.cuts)
    report = intervene_report(bad.zeros(12, 2), x_default(), subject="zeros", num_heads=2)
    assert report.exit_code == 1 and report.first_finding.name == "suffix_moved"


def test_non_finite_output_cannot_pass():
    result = causal_intervention(module_forward(bad.non_finite(12, 2).eval()), x_default())
    assert result.verdict == "nonfinite"
    report = intervene_report(bad.non_finite(12, 2), x_default(), subject="inf", num_heads=2)
    first = report.first_finding
    assert (first.row, first.name, first.level) == ("no_grad i=0", "finite", 4) and first.check.value > 0


def test_tiny_outputs_keep_their_power():
    assert causal_intervention(module_forward(bad.scaled(12, 2).eval()), x_default()).verdict == "causal"
    leak = causal_intervention(module_forward(bad.tiny_leak(12, 2).eval()), x_default())
    assert leak.verdict == "leak" and leak.max_prefix_delta < 1e-6


@pytest.mark.parametrize("factory", [bad.wrong_shape, bad.always_raises], ids=["shape", "raises"])
def test_forward_failure_is_a_level_one_finding(factory):
    report = intervene_report(factory(12, 2), x_default(), subject="m", num_heads=2)
    assert report.verdict == "fail" and report.exit_code == 1
    assert report.details["paths"] == {"no_grad": "error", "autograd": "error"}
    first = report.first_finding
    assert (first.row, first.name, first.level) == ("no_grad", "forward", 1)
    assert first.check.data["input"] == [2, 5, 12]


def test_hint_only_module_leaks_only_under_no_grad():
    from attn_ledger.inputs.userload import load_object

    module = load_object(f"{FIXTURES}:hint_only_causal")(12, 2)
    report = intervene_report(module, x_default(), subject="hint", num_heads=2)
    assert report.details["paths"] == {"no_grad": "leak", "autograd": "causal"}
    assert [r.status for r in report.rows if r.name.startswith("no_grad")] == ["fail"] * 4
    assert [r.status for r in report.rows if r.name.startswith("autograd")] == ["pass"] * 4
    first = report.first_finding
    assert (first.row, first.name) == ("no_grad i=0", "prefix_unchanged")
    assert first.check.location == {"cut": 0, "position": 0}
    assert report.row("no_grad i=0").fields["prefix"] == first.check.value
    assert report.exit_code == 1


@pytest.mark.parametrize("name", ["dropout_at_eval", "stateful"])
def test_eval_nondeterminism_is_its_own_finding(name):
    from attn_ledger.inputs.userload import load_object

    factory = load_object(f"{FIXTURES}:{name}") if name == "dropout_at_eval" else bad.stateful
    torch.manual_seed(0)
    report = intervene_report(factory(12, 2), x_default(), subject=name, num_heads=2)
    det = report.check("determinism", "eval_determinism")
    assert det.status == "fail" and det.value > det.limit == 0.0
    assert report.first_finding.name == "eval_determinism"
    assert report.exit_code == 1


def test_a_control_that_does_not_leak_means_no_power():
    healthy = BuiltinAttention(12, 3).eval()
    report = intervene_report(BuiltinAttention(12, 3), x_default(), subject="b", num_heads=3,
                              controls=[("fake", "a causal module posing as a control", healthy)])
    assert report.verdict == "fail" and report.exit_code == 1
    first = report.first_finding
    assert (first.row, first.name) == ("control fake", "control_leaks")
    assert first.check.value == 0.0 and first.check.data["verdict"] == "causal"
    assert report.coverage is None


def test_without_controls_the_coverage_says_so():
    report = intervene_report(BuiltinAttention(12, 3), x_default(), subject="b", num_heads=3)
    assert report.exit_code == 0
    assert report.coverage.missing == ("control_leaks",)


# --- the command ------------------------------------------------------------------------

def test_cli_default_passes_with_both_controls_failing():
    res = runner.invoke(app, ["intervene", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["tool"], data["command"], data["verdict"], data["first_finding"]) == ("attn-ledger", "intervene", "pass", None)
    assert data["details"]["paths"] == {"no_grad": "causal", "autograd": "causal"}
    rows = {r["name"]: r for r in data["rows"]}
    assert [n for n in rows if n.startswith("no_grad")] == [f"no_grad i={i}" for i in range(4)]
    assert all(rows[f"{m} i=0"]["fields"]["prefix"] == 0.0 for m in ("no_grad", "autograd"))
    for control in ("control causal-off", "control mask-polarity"):
        check = rows[control]["checks"][0]
        assert (rows[control]["status"], check["name"], check["data"]["verdict"]) == ("pass", "control_leaks", "leak")
        assert check["value"] > check["limit"]
    assert rows["determinism"]["checks"][0]["value"] == 0.0
    assert data["coverage"] is None
    again = runner.invoke(app, ["intervene", "--format", "json"])
    assert again.stdout == res.stdout  # byte-identical


def test_cli_fault_from_config_leaks(tmp_path):
    cfg = tmp_path / "polarity.toml"
    cfg.write_text('fault = "mask-polarity"\n')
    res = runner.invoke(app, ["intervene", str(cfg), "--format", "json", "--no-controls"])
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["verdict"] == "fail" and data["details"]["paths"]["no_grad"] == "leak"
    first = data["first_finding"]
    assert (first["row"], first["check"], first["location"]) == ("no_grad i=0", "prefix_unchanged", {"cut": 0, "position": 0})
    assert first["value"] > first["limit"]
    assert data["coverage"]["missing"] == ["control_leaks"]


def test_cli_module_table_markdown_and_junit(tmp_path):
    spec = f"{FIXTURES}:hint_only_causal"
    res = runner.invoke(app, ["intervene", "--module", spec, "--embed-dim", "12", "--heads", "2", "--format", "junit"])
    assert res.exit_code == 1
    suite = ET.fromstring(res.stdout).find("testsuite")
    assert (int(suite.get("tests")), int(suite.get("failures"))) == (1 + 8 + 2, 4)  # determinism, 2 x 4 cuts, 2 controls
    out = tmp_path / "r.md"
    res = runner.invoke(app, ["intervene", "--module", f"{FIXTURES}:sdpa_causal", "--embed-dim", "12", "--heads", "2",
                              "--at", "1", "--format", "json", "--output", str(out)])
    assert res.exit_code == 0 and res.stdout == ""
    data = json.loads(out.read_text())
    assert data["details"]["cuts"] == [1]
    assert [r["name"] for r in data["rows"]] == ["determinism", "no_grad i=1", "autograd i=1", "control causal-off",
                                                 "control mask-polarity"]
    assert data["rows"][1]["fields"]["prefix"] == 0.0 and data["first_finding"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--module", "missing.py:f", "--embed-dim", "12", "--heads", "2"], "file not found"),
        (["--module", f"{FIXTURES}:no_such", "--embed-dim", "12", "--heads", "2"], "has no attribute 'no_such'"),
        (["--module", f"{Path(__file__).parent / 'modules_for_tests.py'}:factory_raises", "--embed-dim", "12", "--heads", "2"], "raised ValueError"),
        (["--module", f"{FIXTURES}:sdpa_causal"], "needs --embed-dim and --heads"),
        (["--at", "4"], "--at: got 4"),
        (["--seq-len", "1"], "seq_len: got 1"),
        (["--heads", "5"], "divisible"),
    ],
    ids=["missing-file", "missing-name", "factory-raises", "no-sizes", "at-range", "seq-1", "heads"],
)
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "never.json"
    res = runner.invoke(app, ["intervene", *args, "--output", str(out)])
    assert res.exit_code == 2
    assert message in res.stderr and res.stderr.count("\n") == 1
    assert not out.exists()


def test_help_names_the_contract():
    res = runner.invoke(app, ["intervene", "--help"])
    assert res.exit_code == 0
    for text in ("--module", "--at", "--no-controls", "no_grad"):
        assert text in res.stdout
