"""check_module: every check passing on a healthy module and failing on one built to break it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import modules_for_tests as bad
from attn_ledger.commands.common import Format, render_text
from attn_ledger.errors import InputError, SetupError
from attn_ledger.modulecheck import check_module, recognise_layout
from attn_ledger.userload import load_object

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"
E, NH = 12, 2  # an even head count, so nn.MultiheadAttention's fast path is reachable


def fixture(name: str):
    return load_object(f"{FIXTURES}:{name}")


def run(factory, causal: bool = True, **kw):
    return check_module(factory, E, NH, causal=causal, **kw)


@pytest.mark.parametrize(
    "name, causal, layout",
    [
        ("causal_mha", True, "nn.MultiheadAttention"),
        ("sdpa_causal", True, "q_proj/k_proj/v_proj + out_proj"),
        ("fused_qkv", True, "fused qkv + proj"),
        ("sdpa_bidirectional", False, "q_proj/k_proj/v_proj + out_proj"),
    ],
    ids=["mha-causal", "sdpa-causal", "fused-qkv", "sdpa-bidirectional"],
)
def test_healthy_modules_pass_every_check(name, causal, layout):
    report = run(fixture(name), causal)
    assert report.exit_code == 0, report.findings
    assert report.first_finding is None
    assert report.layout == layout
    assert all(c.ok is True for c in report.checks), [c for c in report.checks if c.ok is not True]
    names = {c.name for c in report.checks}
    assert {"output_layout", "single_position", "single_example", "batch_independence", "finite_output",
            "input_gradient", "parameter_gradients", "eval_determinism", "reference_rebuild"} <= names
    if causal:
        assert {"causal_intervention_no_grad", "causal_intervention_autograd", "intervention_controls",
                "causal_gradient_form"} <= names
        assert report.check("causal_intervention_no_grad").value == 0.0  # the past does not move at all
    else:
        assert "permutation_equivariance" in names
    assert report.check("reference_rebuild").value < 1e-5
    levels = [c.level for c in report.checks]
    assert levels == sorted(levels)
    assert "came back in training mode" in " ".join(report.notes)


def test_tiny_outputs_are_judged_on_their_own_scale():
    report = run(bad.scaled)
    assert report.exit_code == 0, report.findings
    assert report.check("causal_intervention_no_grad").value == 0.0
    assert report.check("reference_rebuild").ok is True
    leak = run(bad.tiny_leak)
    assert leak.first_finding.check == "causal_intervention_no_grad"
    assert "moved the output at position 0" in leak.first_finding.detail


@pytest.mark.parametrize(
    "source, name, causal, first_check, level",
    [
        ("fixture", "batch_first_confused", False, "batch_independence", 2),
        ("fixture", "dropout_at_eval", True, "eval_determinism", 4),
        ("fixture", "not_causal", True, "causal_intervention_no_grad", 4),
        ("fixture", "wrong_polarity", True, "causal_intervention_no_grad", 4),
        ("fixture", "hint_only_causal", True, "causal_intervention_no_grad", 4),
        ("fixture", "no_scale", True, "reference_rebuild", 4),
        ("fixture", "sdpa_causal", False, "permutation_equivariance", 2),
        ("test", "wrong_shape", True, "output_layout", 1),
        ("test", "always_raises", True, "output_layout", 1),
        ("test", "raises_at_t1", True, "single_position", 1),
        ("test", "non_finite", True, "finite_output", 3),
        ("test", "input_detached", True, "input_gradient", 3),
        ("test", "detached_value", True, "parameter_gradients", 3),
        ("test", "stateful", True, "eval_determinism", 4),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_broken_module_first_finding(source, name, causal, first_check, level):
    factory = fixture(name) if source == "fixture" else getattr(bad, name)
    report = run(factory, causal)
    assert report.exit_code == 1
    first = report.first_finding
    assert (first.check, first.level) == (first_check, level), report.findings
    assert report.check(first_check).ok is False


def test_batch_first_confusion_is_named_and_the_rebuild_disagrees():
    report = run(fixture("batch_first_confused"), causal=False)
    detail = report.check("batch_independence").detail
    assert "batch_first=False" in detail
    assert report.check("batch_independence").value > 0.1
    assert report.check("reference_rebuild").ok is False
    assert "batch_first=False" in report.check("reference_rebuild").detail
    # positions never meet in this module, so permutation cannot see the bug
    assert report.check("permutation_equivariance").ok is True


def test_dropout_at_eval_skips_comparisons_that_would_measure_noise():
    report = run(fixture("dropout_at_eval"))
    assert report.check("eval_determinism").value > 0.01
    for name in ("batch_independence", "reference_rebuild", "causal_intervention_no_grad", "causal_gradient_form"):
        assert report.check(name).ok is None
        assert "not run" in report.check(name).detail


def test_hint_only_causal_leaks_only_on_the_inference_path():
    report = run(fixture("hint_only_causal"))
    assert report.check("causal_intervention_no_grad").ok is False
    assert report.check("causal_intervention_autograd").ok is True
    assert report.check("causal_gradient_form").ok is True


@pytest.mark.parametrize("name", ["not_causal", "wrong_polarity"])
def test_gradient_form_fails_on_a_leaking_module(name):
    check = run(fixture(name)).check("causal_gradient_form")
    assert check.ok is False
    assert "d out_0 / d x_1" in check.detail


def test_forward_failure_leaves_later_checks_not_run():
    report = run(bad.always_raises)
    assert "forward raised ValueError on input (2, 6, 12): forward is broken" in report.check("output_layout").detail
    assert all(c.ok is None for c in report.checks if c.level > 1)


def test_intervention_controls_fail_when_they_do_not_leak(monkeypatch):
    import attn_ledger.modulecheck as mc
    from attn_ledger.model import BuiltinAttention

    monkeypatch.setattr(mc, "builtin_controls", lambda e, n, seed, dtype: [
        ("causal-off", "not really off", BuiltinAttention(e, n, causal=True, seed=seed).eval())])
    check = run(fixture("sdpa_causal")).check("intervention_controls")
    assert check.ok is False
    assert "no power" in check.detail


def test_layout_not_recognised_says_why():
    report = run(bad.with_norm)
    assert report.exit_code == 0
    assert report.layout is None
    check = report.check("reference_rebuild")
    assert check.ok is None and "norm.weight" in check.detail


def test_positional_module_makes_permutation_inconclusive():
    report = run(bad.positional, causal=False)
    check = report.check("permutation_equivariance")
    assert check.ok is None
    assert "inconclusive" in check.detail and "pos_embedding" in check.detail
    assert report.exit_code == 0


def test_recognise_layout_mha_batch_first_hint():
    proj, why = recognise_layout(fixture("batch_first_confused")(E, NH), NH)
    assert why == "" and proj.layout == "nn.MultiheadAttention" and "batch_first=False" in proj.hint


@pytest.mark.parametrize("factory", [bad.factory_raises, bad.not_a_module], ids=["raises", "not-a-module"])
def test_factory_problems_are_setup_errors(factory):
    with pytest.raises(SetupError, match="module: factory"):
        run(factory)


@pytest.mark.parametrize("kw", [{"batch_size": 1}, {"seq_len": 1}], ids=["batch-1", "seq-1"])
def test_sizes_out_of_range_are_input_errors(kw):
    with pytest.raises(InputError):
        run(fixture("sdpa_causal"), **kw)


def test_renderings_carry_the_same_findings():
    report = run(fixture("wrong_polarity"), subject="wrong_polarity")
    data = json.loads(render_text(report, Format.json))
    assert data["command"] == "check" and data["verdict"] == "finding" and data["protocol"] == "module"
    assert data["first_finding"]["check"] == "causal_intervention_no_grad"
    assert data["layout"] == "q_proj/k_proj/v_proj + out_proj"
    assert {c["level"] for c in data["checks"]} == {1, 2, 3, 4}
    md = report.to_markdown()
    assert "| L4 behaviour | causal_intervention_no_grad | FAIL |" in md
    table = render_text(report, Format.table, width=100)
    assert "first finding: L4 causal_intervention_no_grad" in table


def test_progress_reaches_the_total():
    calls = []
    run(fixture("sdpa_causal"), progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1]
