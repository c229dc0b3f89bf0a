"""The observed core's checks, each passing and failing: scales named, relations named, designs
recognised (never failing), a core that is not attention, the merge, gradcheck."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import layout_modules as L
from attn_ledger.probes.module.check import check_module
from attn_ledger.report import Report
from attn_ledger.inputs.userload import load_object
from test_modulecheck import FIXTURES

E, NH = 32, 4  # Dh = 8


def run(factory, e: int = E, nh: int = NH, **kw) -> Report:
    return check_module(factory, e, nh, **kw)


def check(report: Report, name: str):
    return next(c for _, c in report.checks() if c.name == name)


# --- effective scale ----------------------------------------------------------------------------

@pytest.mark.parametrize("scale, named, value", [
    ("none", ["1"], 1.0),
    ("times", ["sqrt(Dh)"], math.sqrt(8)),
    ("model", ["1/sqrt(E)"], E ** -0.5),
], ids=["unscaled", "multiplied", "model-width"])
def test_named_scale_mistakes_fail(scale, named, value):
    report = run(L.factory(L.WqWkWv, scale=scale))
    c = check(report, "effective_scale")
    assert c.status == "fail" and c.data["named"] == named
    assert math.isclose(c.value, value, rel_tol=1e-3) and c.location == {"head": 0}
    assert report.first_finding.name == "effective_scale"


def test_coinciding_mistakes_are_both_named():
    # E = 16, Nh = 4: Dh = 4, so 1/sqrt(E) = 1/4 = 1/Dh
    c = check(run(L.factory(L.WqWkWv, scale="model"), e=16, nh=4), "effective_scale")
    assert c.status == "fail" and c.data["named"] == ["1/sqrt(E)", "1/Dh"]


def test_a_scale_of_the_designs_own_warns_until_declared():
    report = run(L.factory(L.ToQKV, own_scale=0.1), causal=False)
    c = check(report, "effective_scale")
    assert report.exit_code == 0 and c.status == "warn" and c.data["named"] == []
    assert math.isclose(c.value, 0.1, rel_tol=1e-3)
    core = check(report, "attention_core")
    assert core.status == "warn" and core.data["explained_by"] == ["effective_scale"]
    declared = run(L.factory(L.ToQKV, own_scale=0.1), causal=False, scale=0.1)
    assert check(declared, "effective_scale").status == "pass"
    assert check(declared, "effective_scale").data["expected_name"] == "declared --scale"
    assert check(declared, "attention_core").status == "pass"


def test_the_unscaled_fixture_is_named():
    c = check(check_module(load_object(f"{FIXTURES}:no_scale"), 12, 2), "effective_scale")
    assert c.status == "fail" and c.data["named"] == ["1"]


def test_scale_applied_to_q_before_the_scores_counts():
    # nn.MultiheadAttention's need_weights path multiplies q by 1/sqrt(Dh), then bmm without a scale
    report = run(L.factory(L.MHACausal, need_weights=True))
    assert report.exit_code == 0, report.failures()
    c = check(report, "effective_scale")
    assert math.isclose(c.data["qk_factor"], 8 ** -0.5, rel_tol=1e-5) and c.status == "pass"
    assert report.details["observed"]["core"] == "baddbmm q @ k^T, then weights @ v"  # MHA's own calls, followed


# --- mask relation ----------------------------------------------------------------------------------

def test_relation_narrower_than_declared_fails_naming_it():
    report = run(L.factory(L.WqWkWv, mask="strict"))
    c = check(report, "mask_relation")
    assert c.status == "fail" and c.data["applied"] == "strictly-causal" and c.data["comparison"] == "narrower"
    assert c.data["missing_pairs"] == 6 and c.data["extra_pairs"] == 0  # the diagonal, T = 6


def test_causal_module_declared_bidirectional_is_narrower():
    c = check(run(L.factory(L.WqWkWv), causal=False), "mask_relation")
    assert (c.status, c.data["applied"], c.data["comparison"]) == ("fail", "causal", "narrower")


def test_causal_module_declared_with_a_window_is_wider():
    c = check(run(L.factory(L.WqWkWv), window=2), "mask_relation")
    assert (c.status, c.data["applied"], c.data["comparison"]) == ("fail", "causal", "wider")
    assert c.data["declared"] == "sliding window 2"


def test_window_as_wide_as_the_sequence_is_the_causal_relation():
    # at T = 6 a window of 8 keys never cuts: the relation is causal, and that is what was declared
    c = check(run(L.factory(L.GQAttention, window=8), window=8), "mask_relation")
    assert (c.status, c.data["applied"]) == ("pass", "causal")


# --- designs: named, or inconclusive, never failing ----------------------------------------------

def test_alibi_is_named_with_its_slopes():
    report = run(L.factory(L.BiasedScores, design="alibi"))
    c = check(report, "score_design")
    assert report.exit_code == 0 and c.status == "pass" and c.data["design"] == "ALiBi"
    assert c.data["standard_slopes"] is True
    assert c.data["slopes"] == pytest.approx([2 ** (-8 * (h + 1) / NH) for h in range(NH)], rel=1e-3)
    assert check(report, "attention_core").status == "pass"


def test_relative_position_bias_is_named():
    report = run(L.factory(L.BiasedScores, design="t5"))
    c = check(report, "score_design")
    assert report.exit_code == 0 and c.data["design"] == "relative position bias" and c.data["bias"] == "relative"


def test_soft_capping_is_named_with_its_cap():
    report = run(L.factory(L.BiasedScores, design="softcap", cap=2.0))
    c = check(report, "score_design")
    assert report.exit_code == 0 and c.data["design"] == "soft-capping"
    assert c.data["caps"] == pytest.approx([2.0] * NH, rel=1e-2)
    assert check(report, "effective_scale").value == pytest.approx(8 ** -0.5, rel=1e-2)


def test_unrecognised_bias_is_inconclusive_not_a_failure():
    report = run(L.factory(L.BiasedScores, design="table"))
    assert report.exit_code == 0
    design = check(report, "score_design")
    assert design.status == "inconclusive" and design.data["bias"] == "other"
    core = check(report, "attention_core")
    assert core.status == "inconclusive" and core.data["explained_by"] == ["score_design"]
    assert core.data["refit_delta"] <= core.limit


def test_unrecognised_rotary_is_inconclusive_not_a_failure():
    report = run(L.factory(L.GQAttention, rotary="half", stretch=2.0))
    c = check(report, "rotary_positions")
    assert report.exit_code == 0 and c.status == "inconclusive"
    assert c.data["q"]["kind"] == "unrecognised" and c.data["q"]["position_dependent"] is True


def test_observed_rotary_makes_permutation_inconclusive():
    report = run(L.factory(L.GQAttention, rotary="half", bidirectional=True), causal=False)
    perm = check(report, "permutation_equivariance")
    assert report.exit_code == 0 and perm.status == "inconclusive"
    assert perm.data["positional"] == ["rotary positions on q", "rotary positions on k"]
    plain = check(run(L.factory(L.GQAttention, bidirectional=True), causal=False), "permutation_equivariance")
    assert plain.status == "pass"


# --- a core that is not attention, and the merge ---------------------------------------------------

def test_softmax_over_queries_is_a_core_that_is_not_attention():
    report = run(L.factory(L.WqWkWv, mask="softmax-over-queries"))
    core = check(report, "attention_core")
    assert core.status == "fail" and "weights_sum" in core.data["explained_by"]
    assert core.data["row_sum_deviation"] > 0.1


def test_merge_without_transpose_fails_head_merge():
    report = run(L.factory(L.WqWkWv, merge_no_transpose=True))
    c = check(report, "head_merge")
    assert c.status == "fail" and c.level == 2 and c.value > 0
    assert report.first_finding.name == "head_merge"
    assert c.location == {"example": 0, "head": 0, "position": 1}
    ok = check(run(L.factory(L.WqWkWv)), "head_merge")
    assert ok.status == "pass" and ok.data["columns"] == [0, 8, 16, 24]


# --- gradcheck ------------------------------------------------------------------------------------

def test_gradcheck_passes_on_a_correct_module_within_its_budget():
    c = check(run(L.factory(L.WqWkWv)), "gradcheck")
    assert c.status == "pass"
    assert c.data["inputs"] == 64 and c.data["parameters"] == 64 and c.data["B"] == 1 and c.data["T"] == 3
    assert c.data["lower_precision_inside"] is False and c.data["eps"] == 1e-6


def test_gradcheck_fails_on_a_wrong_backward():
    report = run(L.factory(L.WrongGradient))
    c = check(report, "gradcheck")
    assert c.status == "fail" and c.value > c.limit == 1.0
    assert report.first_finding.name == "gradcheck"
    assert c.data["analytic"] == pytest.approx(2 * c.data["numeric"], rel=1e-3)


@pytest.mark.parametrize("factory", [L.factory(L.Float32Softmax), L.factory(L.GQAttention, rotary="half")],
                         ids=["float32-softmax", "float32-rotary-tables"])
def test_gradcheck_allows_for_float32_inside_a_float64_copy(factory):
    c = check(run(factory), "gradcheck")
    assert c.status == "pass" and c.data["lower_precision_inside"] is True and c.data["eps"] == 1e-2


@pytest.mark.parametrize("name, status", [("WqWkWv", "pass"), ("WrongGradient", "fail")])
def test_gradcheck_through_the_worker_matches_in_process(name, status, tmp_path):
    """In a worker, gradcheck's finite differences run in one request and its backward passes are round
    trips to the graph kept there; the check's numbers are the ones the in-process check computes."""
    import json

    from typer.testing import CliRunner

    from attn_ledger.cli import app

    path = Path(L.__file__).resolve()
    (tmp_path / "made.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('layout_modules_copy', {str(path)!r})\n"
        "L = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(L)\n"
        f"make = L.factory(L.{name})\n")
    args = ["check", "--module", f"{tmp_path / 'made.py'}:make", "--embed-dim", str(E), "--heads", str(NH),
            "--format", "json"]
    worker, here = CliRunner().invoke(app, args), CliRunner().invoke(app, [*args, "--in-process"])
    assert worker.exit_code == here.exit_code, worker.output[-2000:]
    checks = {c["name"]: c for r in json.loads(worker.stdout)["rows"] for c in r["checks"]}
    assert checks["gradcheck"]["status"] == status
    assert worker.stdout == here.stdout
