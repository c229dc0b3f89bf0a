"""check_module: every check passing on a healthy module and failing on one built to break it."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

import modules_for_tests as bad
from attn_ledger.commands.common import Format, render_text
from attn_ledger.errors import InputError, SetupError
from attn_ledger.probes.module.check import ASPECTS, check_built_module, check_module
from attn_ledger.report import Report
from attn_ledger.inputs.userload import load_object

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"
E, NH = 12, 2  # an even head count, so nn.MultiheadAttention's fast path is reachable


def fixture(name: str):
    return load_object(f"{FIXTURES}:{name}")


def run(factory, causal: bool = True, **kw) -> Report:
    return check_module(factory, E, NH, causal=causal, **kw)


def check(report: Report, name: str):
    """A check by name, wherever its row."""
    return next(c for _, c in report.checks() if c.name == name)


def names(report: Report) -> set[str]:
    return {c.name for _, c in report.checks()}


SEPARATE = "separate q, k, v projections, heads [Nh=2, Dh=6]"
CHUNKED = "fused q, k, v projection, chunked [3, Nh, Dh]"


@pytest.mark.parametrize(
    "name, causal, layout",
    [
        ("causal_mha", True, CHUNKED),
        ("sdpa_causal", True, SEPARATE),
        ("fused_qkv", True, CHUNKED),
        ("sdpa_bidirectional", False, SEPARATE),
    ],
    ids=["mha-causal", "sdpa-causal", "fused-qkv", "sdpa-bidirectional"],
)
def test_healthy_modules_pass_every_check(name, causal, layout):
    report = run(fixture(name), causal)
    assert report.exit_code == 0 and report.verdict == "pass", report.failures()
    assert report.first_finding is None and report.coverage is None
    assert report.details["layout"] == layout
    assert all(c.status == "pass" for _, c in report.checks()), [c for _, c in report.checks() if not c.passed]
    assert {"output_layout", "single_position", "single_example", "single_example_position", "batch_independence",
            "head_split", "kv_pairing", "head_merge", "finite_output", "input_gradient", "parameter_gradients",
            "gradcheck", "eval_determinism", "mask_relation", "effective_scale", "rotary_positions", "score_design",
            "attention_core"} <= names(report)
    if causal:
        assert {"causal_intervention_no_grad", "causal_intervention_autograd", "intervention_controls",
                "causal_gradient_form"} <= names(report)
        assert "permutation_equivariance" not in names(report)
        assert check(report, "causal_intervention_no_grad").value == 0.0  # the past does not move at all
        controls = check(report, "intervention_controls")
        assert (controls.value, controls.limit, controls.op) == (2, 2, "==")
    else:
        assert "permutation_equivariance" in names(report)
        assert "causal_intervention_no_grad" not in names(report)
    core = check(report, "attention_core")
    assert core.value < 1e-5 and core.value <= core.limit
    assert check(report, "head_split").data["layout"] == layout
    assert check(report, "mask_relation").data["applied"] == ("causal" if causal else "bidirectional")
    grads = check(report, "parameter_gradients")
    assert set(grads.data["norms"]) == {n for n, _ in fixture(name)(E, NH).named_parameters()}
    assert all(v > 0 for v in grads.data["norms"].values())
    levels = [c.level for _, c in report.checks()]
    assert levels == sorted(levels)
    assert [r.name for r in report.rows] == [a for a in ASPECTS if a != "causality" or causal]
    assert report.details["training_mode_on_entry"] is True


def test_tiny_outputs_are_judged_on_their_own_scale():
    report = run(bad.scaled)
    assert report.exit_code == 0, report.failures()
    assert check(report, "causal_intervention_no_grad").value == 0.0
    assert check(report, "attention_core").status == "pass"
    assert check(report, "batch_independence").limit < 1e-9  # the tolerance follows the tiny output scale
    leak = run(bad.tiny_leak)
    first = leak.first_finding
    assert (first.row, first.name) == ("causality", "causal_intervention_no_grad")
    assert first.check.location == {"cut": 0, "position": 0}
    assert first.check.limit < first.check.value < 1e-5


@pytest.mark.parametrize(
    "source, name, causal, first_check, level",
    [
        ("fixture", "batch_first_confused", False, "batch_independence", 2),
        ("fixture", "dropout_at_eval", True, "eval_determinism", 4),
        ("fixture", "not_causal", True, "mask_relation", 4),  # the relation found, over the leak it causes
        ("fixture", "wrong_polarity", True, "mask_relation", 4),
        ("fixture", "hint_only_causal", True, "causal_intervention_no_grad", 4),
        ("fixture", "no_scale", True, "effective_scale", 4),
        ("fixture", "sdpa_causal", False, "mask_relation", 4),  # over the permutation it breaks
        ("test", "wrong_shape", True, "output_layout", 1),
        ("test", "always_raises", True, "output_layout", 1),
        ("test", "raises_at_t1", True, "single_position", 1),
        ("test", "non_finite", True, "finite_output", 3),
        ("test", "input_detached", True, "input_gradient", 3),
        ("test", "stateful", True, "eval_determinism", 4),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_broken_module_first_finding(source, name, causal, first_check, level):
    factory = fixture(name) if source == "fixture" else getattr(bad, name)
    report = run(factory, causal)
    assert report.exit_code == 1 and report.verdict == "fail"
    first = report.first_finding
    assert (first.name, first.level) == (first_check, level), report.failures()
    assert check(report, first_check).status == "fail"


def test_numbers_of_the_level_one_to_three_failures():
    shape = check(run(bad.wrong_shape), "output_layout")
    assert shape.data == {"input": [2, 6, 12], "output": [2, 12, 6]}
    finite = check(run(bad.non_finite), "finite_output")
    assert (finite.value, finite.limit) == (2 * 12, 0)  # the last position of both examples
    grads = check(run(bad.non_finite_gradient), "parameter_gradients")
    assert grads.status == "fail" and grads.value == 1 and grads.data["non_finite"] == ["gate"]
    assert check(run(bad.input_detached), "input_gradient").value is None  # nothing reached the input


def test_batch_first_confusion_is_named_and_the_rebuild_disagrees():
    report = run(fixture("batch_first_confused"), causal=False)
    batch = check(report, "batch_independence")
    assert batch.value > 0.1 and batch.value > batch.limit and batch.location == {"example": 0}
    assert "batch_first=False" in batch.data["hint"]
    # the core attends over the batch axis: its tensors do not have the input's positions
    core = check(report, "attention_core")
    assert core.status == "inconclusive" and "not the input's T = 6 positions" in core.reason
    assert report.coverage.scope == "black-box"
    # positions never meet in this module, so permutation cannot see the bug
    assert check(report, "permutation_equivariance").status == "pass"


def test_dropout_at_eval_leaves_comparisons_that_would_measure_noise_not_reached():
    report = run(fixture("dropout_at_eval"))
    det = check(report, "eval_determinism")
    assert det.value > 0.01 and det.limit == 0.0
    for name in ("batch_independence", "head_split", "attention_core", "mask_relation", "causal_intervention_no_grad",
                 "causal_gradient_form"):
        assert check(report, name).status == "not_reached"
    assert report.row("axes").status == "not_reached"


def test_hint_only_causal_leaks_only_on_the_inference_path():
    report = run(fixture("hint_only_causal"))
    assert check(report, "causal_intervention_no_grad").status == "fail"
    assert check(report, "causal_intervention_autograd").status == "pass"
    assert check(report, "causal_gradient_form").status == "pass"


@pytest.mark.parametrize("name", ["not_causal", "wrong_polarity"])
def test_intervention_and_gradient_form_fail_on_a_leaking_module(name):
    report = run(fixture(name))
    form = check(report, "causal_gradient_form")
    assert form.status == "fail" and form.location == {"output": 0, "input": 1}
    assert form.value > form.limit
    for mode in ("no_grad", "autograd"):
        leak = check(report, f"causal_intervention_{mode}")
        assert leak.status == "fail" and leak.location == {"cut": 0, "position": 0} and leak.value > leak.limit


def test_forward_failure_leaves_later_checks_not_reached():
    report = run(bad.always_raises)
    shape = report.row("shape")
    assert [c.status for c in shape.checks] == ["fail"] * 4
    assert shape.checks[0].data == {"input": [2, 6, 12], "exception": "ValueError"}
    assert all(c.status == "not_reached" for _, c in report.checks() if c.level > 1)
    assert [r.status for r in report.rows[1:]] == ["not_reached"] * (len(report.rows) - 1)


def test_intervention_controls_fail_when_they_do_not_leak(monkeypatch):
    import attn_ledger.probes.module.check as mc
    from attn_ledger.maths.layer import BuiltinAttention

    monkeypatch.setattr(mc, "builtin_controls", lambda e, n, seed, dtype: [
        ("causal-off", "not really off", BuiltinAttention(e, n, causal=True, seed=seed).eval())])
    report = run(fixture("sdpa_causal"))
    controls = check(report, "intervention_controls")
    assert controls.status == "fail" and (controls.value, controls.limit) == (0, 1)
    assert controls.data["controls"]["causal-off"]["verdict"] == "causal"
    assert report.first_finding.name == "intervention_controls"


def test_intervention_controls_not_applicable_when_heads_do_not_divide():
    report = check_module(bad.zeros, 12, 5)  # the module ignores num_heads; the built-in controls cannot
    controls = check(report, "intervention_controls")
    assert controls.status == "not_applicable" and controls.data == {"embed_dim": 12, "num_heads": 5}


def test_a_module_with_a_norm_before_its_projections_is_observed_whole():
    report = run(bad.with_norm)
    assert report.exit_code == 0 and report.coverage is None
    assert report.details["layout"] == SEPARATE
    assert check(report, "attention_core").status == "pass"


def test_detached_value_projection_warns_naming_the_parameters_and_fails_gradcheck():
    report = run(bad.detached_value)
    grads = check(report, "parameter_gradients")
    assert grads.status == "warn"
    # the forward still reads v_proj, so finite differences see what the backward misses
    first = report.first_finding
    assert (first.name, first.level) == ("gradcheck", 3)
    assert first.check.value > first.check.limit == 1.0
    assert first.check.location["of"] in ("input", "parameters")
    assert first.check.data["analytic"] != first.check.data["numeric"]
    assert grads.value == 2 and grads.data["no_gradient"] == ["v_proj.weight", "v_proj.bias"]
    assert set(grads.data["norms"]) == {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                        "out_proj.weight", "out_proj.bias"}
    assert grads.data["of"] == 8


def test_positional_module_makes_permutation_inconclusive():
    report = run(bad.positional, causal=False)
    perm = check(report, "permutation_equivariance")
    assert perm.status == "inconclusive" and perm.value > perm.limit
    assert perm.data["positional"] == ["pos_embedding"]
    assert report.exit_code == 0


def test_check_built_module_matches_check_module():
    import torch

    make = load_object(f"{FIXTURES.parents[1] / 'kernels' / 'good_module.py'}:make")  # no dropout
    torch.manual_seed(0)  # what check_module does before calling the factory
    a = check_built_module(make(12, 3), 12, 3, subject="m")
    b = check_module(make, 12, 3, subject="m")
    assert a.exit_code == 0 and render_text(a, Format.json) == render_text(b, Format.json)


@pytest.mark.parametrize("factory", [bad.factory_raises, bad.not_a_module], ids=["raises", "not-a-module"])
def test_factory_problems_are_setup_errors(factory):
    with pytest.raises(SetupError, match="module: factory"):
        run(factory)


@pytest.mark.parametrize("kw", [{"batch_size": 1}, {"seq_len": 1}], ids=["batch-1", "seq-1"])
def test_sizes_out_of_range_are_input_errors(kw):
    with pytest.raises(InputError):
        run(fixture("sdpa_causal"), **kw)


def test_json_and_junit_carry_the_same_finding():
    report = run(fixture("wrong_polarity"), subject="wrong_polarity")
    text = render_text(report, Format.json)
    assert text == render_text(run(fixture("wrong_polarity"), subject="wrong_polarity"), Format.json)  # byte-identical
    data = json.loads(text)
    assert (data["command"], data["verdict"]) == ("check", "fail")
    assert data["details"]["protocol"] == "module" and data["details"]["sizes"] == {"B": 2, "T": 6, "E": 12, "Nh": 2}
    assert (data["first_finding"]["row"], data["first_finding"]["check"]) == ("core", "mask_relation")  # the cause
    assert data["details"]["layout"] == SEPARATE
    assert {c["level"] for r in data["rows"] for c in r["checks"]} == {1, 2, 3, 4}
    suite = ET.fromstring(render_text(report, Format.junit)).find("testsuite")
    assert int(suite.get("tests")) == len(report.checks())
    assert int(suite.get("failures")) == len(report.failures()) == 5
    assert {c.name for _, c in report.failures()} == {"causal_intervention_no_grad", "causal_intervention_autograd",
                                                      "causal_gradient_form", "mask_relation", "attention_core"}


def test_progress_reaches_the_total():
    calls = []
    run(fixture("sdpa_causal"), progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1]
