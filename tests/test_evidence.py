"""A case with no evidence is not a pass: ``cases_inconclusive``, the ``evidence`` check, ``--strict-coverage``.

No case of today's tiers lacks evidence on a kernel that returns a right-shaped output: its
``reference`` check judges it. The cases without evidence here are built from real results
whose checks past L1 could not judge (as a probe that moved nothing reads), and end to end by
making every forward check read inconclusive.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree as ET

import jsonschema
import pytest
from typer.testing import CliRunner

from attn_ledger.probes.kernel import check as kernelcheck
from attn_ledger.probes.kernel.cases import DEFAULT_TIER
from attn_ledger.cli import app
from attn_ledger.errors import InputError
from attn_ledger.probes.kernel.check import EVIDENCE, Options, check_case, failed_call, kernel_report, parse_case
from attn_ledger.probes.kernel.spec import from_sources
from attn_ledger.render import render
from attn_ledger.render.html import render_html
from attn_ledger.render.jsondoc import report_json, schema
from attn_ledger.render.notes import notes_text
from attn_ledger.testing import InconclusiveCases, assert_attention_matches, diagnosis
from attn_ledger.inputs.userload import load_object

ROOT = Path(__file__).resolve().parents[1]
GOOD = f"{ROOT / 'fixtures' / 'kernels' / 'good.py'}:attention"
good = load_object(GOOD)
runner = CliRunner()

T1 = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"  # B = Nh = Nkv = 1, no mask: every probe is not applicable
GQA = "b2-h4kv2-tq5tk5-dh8dv8-none-rand-f32"


def unjudging(result):
    """``result`` as checks that cannot judge would leave it: each judged check past L1 inconclusive."""
    return replace(result, checks=tuple(c if c.level == 1 or not c.judged else replace(c, status="inconclusive")
                                        for c in result.checks))


@pytest.fixture
def forward_checks_judge_nothing(monkeypatch):
    """Every forward check reads inconclusive, as a probe whose outputs did not move does."""
    real = kernelcheck._forward_checks
    monkeypatch.setattr(kernelcheck, "_forward_checks",
                        lambda s, refs, o: [c if not c.judged else replace(c, status="inconclusive")
                                            for c in real(s, refs, o)])
    grad_mode = kernelcheck._grad_mode_check
    monkeypatch.setattr(kernelcheck, "_grad_mode_check",
                        lambda *a: (lambda c: c if not c.judged else replace(c, status="inconclusive"))(grad_mode(*a)))


def test_a_case_whose_probes_cannot_apply_still_rests_on_its_reference():
    result = check_case(good, parse_case(T1), backward=False)
    assert {result.check(n).status for n in ("batch_isolation", "kv_head_isolation", "q_head_isolation",
                                             "forbidden_keys", "empty_rows", "causal_intervention")} == {"not_applicable"}
    assert result.check("reference").status == "pass"
    assert result.evidence and not result.inconclusive and result.status == "pass"


def test_l1_alone_is_not_evidence_and_the_case_is_counted_inconclusive():
    blank = unjudging(check_case(good, parse_case(T1), backward=False))
    assert [c.name for c in blank.checks if c.passed] == ["call", "shape", "dtype", "inputs_unchanged"]
    assert blank.passed and not blank.evidence and blank.inconclusive and blank.status == "inconclusive"
    normal = check_case(good, parse_case(GQA), backward=False)
    report = kernel_report([blank, normal], target="k.py:attention", options=Options(backward=False))
    assert report.exit_code == 0 and report.verdict == "pass" and report.first_finding is None
    row = report.row(T1)
    assert row.status == "inconclusive" and report.row(GQA).status == "pass"
    evidence = row.check(EVIDENCE)
    assert (evidence.level, evidence.status, evidence.value, evidence.limit, evidence.op) == (4, "inconclusive", 0, 1, ">=")
    assert evidence.data["statuses"] == ["inconclusive", "not_applicable", "skipped"]
    d = report.details
    assert (d["cases_total"], d["cases_failed"], d["cases_inconclusive"], d["smallest_inconclusive"]) == (2, 0, 1, T1)
    assert d["strict_coverage"] is False
    assert f"1 case inconclusive: no check past L1 judged it (warning; smallest {T1}); --strict-coverage makes it " \
           "a failure" in notes_text(report)
    assert notes_text(report)[-1] == "1 of 2 cases passes; 1 inconclusive"
    jsonschema.validate(report_json(report), schema())


def test_strict_coverage_makes_a_case_without_evidence_the_finding():
    blank = unjudging(check_case(good, parse_case(T1), backward=False))
    normal = check_case(good, parse_case(GQA), backward=False)
    report = kernel_report([normal, blank], target="k.py:attention",
                           options=Options(backward=False, strict_coverage=True))
    assert report.exit_code == 1 and report.verdict == "fail"
    assert (report.first_finding.row, report.first_finding.name) == (T1, EVIDENCE)
    assert report.row(T1).status == "fail" and report.row(GQA).status == "pass"
    d = report.details
    assert (d["cases_failed"], d["cases_inconclusive"], d["first_level"]) == (1, 0, 4)
    assert d["failures"] == [{"level": 4, "check": EVIDENCE, "cases": 1, "smallest_case": T1}]
    assert d["reproduce"]["options"] == ["--no-backward", "--strict-coverage"]
    assert report_json(report)["details"]["reproduce"]["cli"] == \
        f"attn-ledger check k.py:attention --case {T1} --no-backward --strict-coverage"
    jsonschema.validate(report_json(report), schema())


def test_a_case_with_evidence_is_never_inconclusive():
    # a failing case is a failure, however little was judged
    stopped = failed_call(parse_case(T1), "attention(q, k, v) timed out after 2 s", {"timeout_s": 2.0})
    assert stopped.status == "fail" and not stopped.inconclusive
    # a passing case with one probe that proved nothing still passes on its other checks
    normal = check_case(good, parse_case(GQA), backward=False)
    one = replace(normal, checks=tuple(replace(c, status="inconclusive") if c.name == "q_head_isolation" else c
                                       for c in normal.checks))
    report = kernel_report([one], target="k.py:attention", options=Options(backward=False, strict_coverage=True))
    assert one.status == "pass" and report.exit_code == 0 and report.details["cases_inconclusive"] == 0
    assert EVIDENCE not in {c.name for c in report.rows[0].checks}


def test_the_views_show_an_inconclusive_case_as_not_passed():
    blank = unjudging(check_case(good, parse_case(T1), backward=False))
    normal = check_case(good, parse_case(GQA), backward=False)
    report = kernel_report([blank, normal], target="k.py:attention", options=Options(backward=False))
    suite = ET.fromstring(render(report, "junit")).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "0", "1")
    skipped = [c for c in suite.findall("testcase") if c.find("skipped") is not None]
    assert [c.get("name") for c in skipped] == [T1]
    assert skipped[0].find("skipped").get("message").startswith("inconclusive: checks past L1 that judged the case = 0")
    github = render(report, "github")
    assert f"::warning title=attn-ledger check%3A {T1} L4 evidence::" in github
    table = render(report, "table")
    assert "1 case inconclusive" in table and "first finding: none" in table
    page = render_html(report)
    assert 'data-row="b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32" data-status="inconclusive"' in page


def test_check_exits_0_with_the_warning_and_1_with_strict_coverage(forward_checks_judge_nothing, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml table here
    base = ["check", GOOD, "--case", T1, "--case", GQA, "--no-backward", "--in-process"]
    lenient = runner.invoke(app, base)
    assert lenient.exit_code == 0, lenient.output
    assert "2 cases inconclusive: no check past L1 judged them" in lenient.stdout
    assert "0 of 2 cases pass; 2 inconclusive" in lenient.stdout
    data = json.loads(runner.invoke(app, base + ["--format", "json"]).stdout)
    assert (data["verdict"], data["details"]["cases_inconclusive"]) == ("pass", 2)
    assert {r["status"] for r in data["rows"]} == {"inconclusive"}
    strict = runner.invoke(app, base + ["--strict-coverage", "--format", "json"])
    assert strict.exit_code == 1
    data = json.loads(strict.stdout)
    assert (data["first_finding"]["row"], data["first_finding"]["check"]) == (T1, EVIDENCE)
    assert data["details"]["cases_failed"] == 2
    (tmp_path / "pyproject.toml").write_text("[tool.attn-ledger.check]\nstrict_coverage = true\n")
    assert runner.invoke(app, base).exit_code == 1
    assert runner.invoke(app, base + ["--lenient-coverage"]).exit_code == 0


def test_a_normal_kernel_has_no_inconclusive_case():
    result = runner.invoke(app, ["check", GOOD, "--no-backward", "--strict-coverage", "--format", "json"])
    assert result.exit_code == 0, result.stdout[-2000:]
    data = json.loads(result.stdout)
    assert data["details"]["cases_inconclusive"] == 0 and data["details"]["cases_total"] == len(DEFAULT_TIER)
    assert {r["status"] for r in data["rows"]} == {"pass"}


def test_strict_coverage_is_a_kernel_option():
    result = runner.invoke(app, ["check", "--module", "x.py:f", "--embed-dim", "8", "--heads", "2", "--strict-coverage"])
    assert result.exit_code == 2 and "--strict-coverage" in result.output
    with pytest.raises(InputError, match=r"strict_coverage: got 'yes', expected true or false"):
        from_sources({}, _table_dir('strict_coverage = "yes"'))


def _table_dir(line: str) -> Path:
    import tempfile

    d = Path(tempfile.mkdtemp())
    (d / "pyproject.toml").write_text(f"[tool.attn-ledger.check]\n{line}\n")
    return d


def test_the_pytest_helper_warns_and_fails_with_strict_coverage(forward_checks_judge_nothing):
    with pytest.warns(InconclusiveCases, match=rf"(?s)0 of 2 cases pass, 2 inconclusive.*smallest {T1}\); strict_coverage=True"):
        assert_attention_matches(good, [T1, GQA], backward=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match=rf"smallest failing case {T1}: L4 evidence"):
            assert_attention_matches(good, [T1, GQA], backward=False, strict_coverage=True)


def test_the_pytest_helper_counts_one_case_in_the_singular():
    sdpa_is_causal = load_object(f"{ROOT / 'fixtures' / 'kernels' / 'sdpa_is_causal.py'}:attention")
    report = kernelcheck.check_kernel(sdpa_is_causal, [parse_case("b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32")],
                                      backward=False)
    text = diagnosis(report)
    assert text.startswith("attention: 1 of 1 case fails;")
    assert "L4 reference fails first in 1 case (smallest" in text and "1 cases" not in text
