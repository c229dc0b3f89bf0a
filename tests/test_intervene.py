"""The causal intervention: the seed's numbers, both controls failing, both grad paths, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import modules_for_tests as bad
from attn_ledger.cli import app
from attn_ledger.experiments.intervene import (
    builtin_controls,
    causal_intervention,
    intervene_report,
    module_forward,
)
from attn_ledger.model import BuiltinAttention
from attn_ledger.pipeline import make_input

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


@pytest.mark.parametrize("name", ["causal-off", "mask-polarity"])
def test_each_control_fails(name):
    controls = {n: m for n, _d, m in builtin_controls(12, 3, 0, torch.float32)}
    result = causal_intervention(module_forward(controls[name]), x_default())
    assert result.verdict == "leak"
    leak = result.first_leak
    assert (leak.cut, leak.moved_position) == (0, 0)
    assert result.max_prefix_delta > 0.3  # the seed: 0.38 (masking off) and 0.66 (wrong polarity)


@pytest.mark.parametrize("mode", ["no_grad", "autograd"])
def test_one_cut(mode):
    result = causal_intervention(module_forward(BuiltinAttention(12, 3).eval()), x_default(), cuts=[2], grad_mode=mode)
    assert [c.cut for c in result.cuts] == [2] and result.ok and result.grad_mode == mode


def test_vacuous_when_nothing_changes():
    result = causal_intervention(module_forward(bad.zeros(12, 2).eval()), x_default())
    assert result.verdict == "vacuous"
    assert "vacuous: the intervention changed nothing" in result.summary()


def test_non_finite_output_cannot_pass():
    result = causal_intervention(module_forward(bad.non_finite(12, 2).eval()), x_default())
    assert result.verdict == "nonfinite"


def test_tiny_outputs_keep_their_power():
    assert causal_intervention(module_forward(bad.scaled(12, 2).eval()), x_default()).verdict == "causal"
    leak = causal_intervention(module_forward(bad.tiny_leak(12, 2).eval()), x_default())
    assert leak.verdict == "leak" and leak.max_prefix_delta < 1e-6


@pytest.mark.parametrize("factory, verdict", [(bad.wrong_shape, "error"), (bad.always_raises, "error")], ids=["shape", "raises"])
def test_forward_failure_is_a_level_one_finding(factory, verdict):
    report = intervene_report(factory(12, 2), x_default(), subject="m", num_heads=2)
    assert report.verdict == verdict and report.exit_code == 1
    assert report.findings[0].level == 1


def test_hint_only_module_leaks_only_under_no_grad():
    from attn_ledger.userload import load_object

    module = load_object(f"{FIXTURES}:hint_only_causal")(12, 2)
    report = intervene_report(module, x_default(), subject="hint", num_heads=2)
    by_mode = {p.grad_mode: p for p in report.paths}
    assert by_mode["no_grad"].verdict == "leak" and by_mode["autograd"].verdict == "causal"
    assert report.exit_code == 1 and report.findings[0].check == "causal_intervention (no_grad)"


@pytest.mark.parametrize("name", ["dropout_at_eval", "stateful"])
def test_eval_nondeterminism_is_its_own_finding(name):
    from attn_ledger.userload import load_object

    factory = load_object(f"{FIXTURES}:{name}") if name == "dropout_at_eval" else bad.stateful
    torch.manual_seed(0)
    report = intervene_report(factory(12, 2), x_default(), subject=name, num_heads=2)
    assert report.determinism.identical is False and report.determinism.max_delta > 0
    assert any(f.check == "eval_determinism" for f in report.findings)
    assert report.exit_code == 1


def test_a_control_that_does_not_leak_means_no_power():
    healthy = BuiltinAttention(12, 3).eval()
    report = intervene_report(BuiltinAttention(12, 3), x_default(), subject="b", num_heads=3,
                              controls=[("fake", "a causal module posing as a control", healthy)])
    assert report.verdict == "no power" and report.exit_code == 1


# --- the command ------------------------------------------------------------------------

def test_cli_default_passes_with_both_controls_failing():
    res = runner.invoke(app, ["intervene", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["tool"], data["command"], data["verdict"]) == ("attn-ledger", "intervene", "causal")
    assert [p["grad_mode"] for p in data["paths"]] == ["no_grad", "autograd"]
    assert all(p["cuts"][0]["prefix_delta"] == 0.0 for p in data["paths"])
    assert [(c["name"], c["failed_as_expected"]) for c in data["controls"]] == [("causal-off", True), ("mask-polarity", True)]
    assert data["eval_determinism"]["identical"] is True


def test_cli_fault_from_config_leaks(tmp_path):
    cfg = tmp_path / "polarity.toml"
    cfg.write_text('fault = "mask-polarity"\n')
    res = runner.invoke(app, ["intervene", str(cfg), "--format", "json", "--no-controls"])
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["verdict"] == "leak"
    assert data["first_finding"]["detail"].startswith("future leaks: changing positions 1.. moved the output at position 0")


def test_cli_module_table_and_markdown(tmp_path):
    spec = f"{FIXTURES}:hint_only_causal"
    res = runner.invoke(app, ["intervene", "--module", spec, "--embed-dim", "12", "--heads", "2"])
    assert res.exit_code == 1
    assert "first finding: L4 causal_intervention (no_grad)" in res.stdout
    out = tmp_path / "r.md"
    res = runner.invoke(app, ["intervene", "--module", f"{FIXTURES}:sdpa_causal", "--embed-dim", "12", "--heads", "2",
                              "--at", "1", "--format", "markdown", "--output", str(out)])
    assert res.exit_code == 0 and res.stdout == ""
    text = out.read_text()
    assert "| 1 | 2..4 | 0 |" in text and "first finding: none" in text


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
