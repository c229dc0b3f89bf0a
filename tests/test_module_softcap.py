"""Soft-capped scores in ``check --module``: recognised on a probe that bends the cap, and declared.

Scores far below a cap are bent by its tanh too little to read on the user's draw, so the
core's q is scaled inside the forward until its logits reach the cap. A hand-written causal
core with Gemma 2's cap of 50 (``layout_modules.BiasedScores``) and the same core without it
carry the checks both ways; Gemma 2 itself is in ``tests/test_real_modules.py``.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import layout_modules as L
from attn_ledger.cli import app
from attn_ledger.probes.module.core import BEND_LOGITS, Declared
from attn_ledger.errors import InputError
from attn_ledger.probes.module.check import check_module
from attn_ledger.render.notes import notes_text
from attn_ledger.report import Report

E, NH = 32, 4  # Dh = 8
CAPPED = L.factory(L.BiasedScores, design="softcap", cap=50.0, gain=0.2)
PLAIN = L.factory(L.BiasedScores, design="plain", gain=0.2)
runner = CliRunner()


def check(report: Report, name: str):
    return next(c for _, c in report.checks() if c.name == name)


def test_the_users_draw_alone_stays_far_below_the_cap():
    # the premise of the probe: on the draw, the logits are far from 50, where tanh is nearly the identity
    design = check(check_module(CAPPED, E, NH), "score_design")
    assert design.data["bent"]["q_factor"] > 5 and design.data["bent"]["logits"] == BEND_LOGITS


def test_an_undeclared_cap_is_recognised_named_and_how_to_declare_it_said():
    report = check_module(CAPPED, E, NH)
    assert report.exit_code == 0 and [c.name for _, c in report.checks() if c.status != "pass"] == []
    design = check(report, "score_design")
    assert design.data["design"] == "soft-capping" and design.data["bent"]["form"] == "softcap"
    assert design.data["caps"] == pytest.approx([50.0] * NH, rel=1e-3)
    assert check(report, "effective_scale").value == pytest.approx(8 ** -0.5, rel=1e-3)
    assert [(h.kind, h.data["option"]) for h in report.hints] == [("declare_softcap", "--softcap 50")]
    assert report.details["observed"]["design"] == "soft-capping"


def test_a_declared_cap_that_the_core_applies_passes():
    report = check_module(CAPPED, E, NH, softcap=50)
    assert report.exit_code == 0 and [c.name for _, c in report.checks() if c.status != "pass"] == []
    core = check(report, "attention_core")
    assert core.data["softcap"] == 50.0 and core.data["bent"]["delta"] <= core.data["bent"]["tolerance"]
    assert not [n for n in notes_text(report) if "declare it" in n] and report.hints == ()
    assert report.details["softcap"] == 50.0 and report.title.endswith("causal, soft-cap 50")


def test_a_declared_cap_that_the_core_leaves_out_fails():
    report = check_module(PLAIN, E, NH, softcap=50)
    design, core = check(report, "score_design"), check(report, "attention_core")
    assert report.exit_code == 1 and (report.first_finding.row, report.first_finding.name) == ("core", "score_design")
    assert design.status == "fail" and design.data["bent"]["form"] == "linear"
    assert "the declared --softcap 50 is not applied: the scores stay linear in q.k up to logits of 30" in design.reason
    # on the draw alone the missing cap moves the context by less than the tolerance; the probe shows it
    assert core.status == "fail" and core.data["explained_by"] == ["score_design"]
    assert core.data["draw"]["delta"] <= core.data["draw"]["tolerance"] < core.value == core.data["bent"]["delta"]
    # undeclared, the same core is plain and passes
    plain = check_module(PLAIN, E, NH)
    assert plain.exit_code == 0 and check(plain, "score_design").data["design"] == "plain"


def test_another_cap_than_the_declared_one_fails_naming_it():
    report = check_module(L.factory(L.BiasedScores, design="softcap", cap=20.0), E, NH, softcap=50)
    design = check(report, "score_design")
    assert design.status == "fail" and design.value == pytest.approx(20.0, rel=1e-3) and design.limit == 50.0
    assert "the scores are capped at 20, not the declared --softcap 50" in design.reason


def test_an_sdpa_core_cannot_apply_a_declared_cap():
    report = check_module(L.factory(L.QueryKeyValue), E, NH, softcap=50)
    assert report.exit_code == 1 and check(report, "score_design").status == "fail"
    assert check_module(L.factory(L.QueryKeyValue), E, NH).exit_code == 0


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), True, "50"])
def test_a_cap_out_of_range_is_refused_naming_it(cap):
    with pytest.raises(InputError, match="softcap"):
        Declared(softcap=cap)
    with pytest.raises(InputError, match="softcap"):
        check_module(CAPPED, E, NH, softcap=cap)


def test_the_command_line_takes_softcap_for_a_module_only():
    spec = "tests/layout_modules.py:BiasedScores"
    res = runner.invoke(app, ["check", "--module", spec, "--embed-dim", str(E), "--heads", str(NH),
                              "--softcap", "50", "--format", "json"])
    assert res.exit_code == 1, res.output  # BiasedScores' default design is ALiBi, with no cap
    doc = json.loads(res.stdout)
    assert doc["details"]["softcap"] == 50.0 and doc["first_finding"]["check"] == "score_design"
    kernel = runner.invoke(app, ["check", "fixtures/kernels/good.py:attention", "--softcap", "50"])
    assert kernel.exit_code == 2 and "--softcap" in kernel.output


def test_the_pytest_helper_takes_the_cap_and_reproduces_it():
    from attn_ledger.testing import assert_module_matches

    assert_module_matches(CAPPED, E, NH, softcap=50, name="capped")
    with pytest.raises(AssertionError) as info:
        assert_module_matches(PLAIN, E, NH, softcap=50, name="plain")
    text = str(info.value)
    assert "score_design" in text and "--softcap 50" in text and "softcap=50" in text


def test_without_the_probe_small_linear_scores_leave_a_declared_cap_inconclusive(monkeypatch):
    import attn_ledger.probes.common.observe as observe

    monkeypatch.setattr(observe, "probe_bent", lambda *args: None)  # the probe forward did not reach the core
    report = check_module(CAPPED, E, NH, softcap=50)
    design = check(report, "score_design")
    # the draw alone is bent too little to read, so the cap it applies is neither confirmed nor refuted
    assert design.status == "inconclusive" and "bent" not in design.data
    assert "too small to show it" in design.reason
