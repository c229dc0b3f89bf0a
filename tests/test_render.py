"""The one face: JSON against the published schema, JUnit, GitHub annotations, tables at 80 columns."""

from __future__ import annotations

import json
import math
from xml.etree import ElementTree as ET

import jsonschema
import pytest

from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import run_ledger
from attn_ledger.render import FORMATS, render
from attn_ledger.render.jsondoc import error_json, report_json, schema
from attn_ledger.render.table import render_table, wrap_words
from attn_ledger.render.text import describe
from attn_ledger.report import Check, Report, Row, bounded, counted, first_finding_of, row_status, unjudged


def _ledger(**overrides):
    return run_ledger(load_config(overrides=overrides), keep_going=True)


def _validate(doc):
    jsonschema.validate(doc, schema())


# --- the model ------------------------------------------------------------------------------

def test_bounded_and_counted_judge_from_their_numbers():
    assert bounded(4, "x", "err", 1e-7, 1e-6).status == "pass"
    assert bounded(4, "x", "err", 1e-5, 1e-6).status == "fail"
    assert bounded(4, "x", "err", math.nan, 1e-6).status == "fail"
    assert bounded(4, "x", "err", 1e-5, 1e-6, warn_only=True).status == "warn"
    assert bounded(4, "x", "power", 0.3, 0.5, op=">=").status == "fail"
    assert bounded(4, "x", "power", 0.7, 0.5, op=">=").status == "pass"
    assert counted(3, "x", "bad", 0).status == "pass" and counted(3, "x", "bad", 2).status == "fail"


def test_statuses_and_levels_are_validated():
    with pytest.raises(ValueError):
        Check(1, "x", "ok")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Check(5, "x", "pass")


def test_first_finding_is_the_first_row_then_the_lowest_level():
    rows = (
        Row("a", "pass", (counted(3, "fine", "bad", 0),)),
        Row("b", "fail", (counted(3, "l3", "bad", 1), counted(2, "l2", "bad", 1))),
        Row("c", "fail", (counted(1, "l1", "bad", 1),)),
    )
    f = first_finding_of(rows)
    assert (f.row, f.level, f.name) == ("b", 2, "l2")
    assert Report("run", "t", rows).verdict == "fail" and Report("run", "t", rows[:1]).exit_code == 0


def test_row_status_from_checks():
    assert row_status([counted(1, "a", "x", 0), counted(1, "b", "x", 1)]) == "fail"
    assert row_status([bounded(1, "a", "x", 2, 1, warn_only=True)]) == "warn"
    assert row_status([unjudged(1, "a", "not_applicable", "B = 1")]) == "not_applicable"
    assert row_status([counted(1, "a", "x", 0)]) == "pass"


def test_sentences_are_rendered_from_fields():
    c = Check(4, "matches_reference", "fail", "max |diff| vs float64", 0.5, rtol=1e-5, atol=2e-5,
              location={"example": 1, "head": 0})
    assert describe(c) == "max |diff| vs float64 = 0.5 (rtol 1e-05, atol 2e-05) at example 1, head 0"
    assert describe(bounded(3, "x", "err", 3, 2)) == "err = 3 (limit 2)"
    assert describe(unjudged(1, "x", "not_applicable", "B = 1")) == "B = 1"


# --- JSON ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", [None, "split-reshape", "mask-polarity", "no-scale"])
def test_ledger_json_validates_and_carries_first_finding(fault):
    led = _ledger(fault=fault)
    doc = json.loads(render(led, "json"))
    _validate(doc)
    assert doc["schema_version"] == 2 and doc["command"] == "run"
    if fault is None:
        assert doc["verdict"] == "pass" and doc["first_finding"] is None
    else:
        assert doc["verdict"] == "fail" and doc["first_finding"]["row"] == led.first_finding.row
        assert doc["first_finding"]["check"] == led.first_finding.name


def test_error_envelope_validates():
    doc = error_json("run", "RuntimeError: boom")
    _validate(doc)
    assert doc["verdict"] == "error"
    with pytest.raises(jsonschema.ValidationError):
        _validate({k: v for k, v in doc.items() if k != "error"})


def test_schema_rejects_a_pass_with_a_finding():
    doc = json.loads(render(_ledger(fault="no-scale"), "json"))
    doc["verdict"] = "pass"
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


def test_identical_runs_give_identical_json():
    assert render(_ledger(fault="no-scale"), "json") == render(_ledger(fault="no-scale"), "json")


# --- JUnit -----------------------------------------------------------------------------------

def _junit(report):
    root = ET.fromstring(render(report, "junit"))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    return root, suite, cases


def test_junit_counts_match_its_cases_on_a_pass():
    led = _ledger()
    root, suite, cases = _junit(led)
    n_checks = sum(len(r.checks) for r in led.rows)
    assert int(suite.get("tests")) == len(cases) == n_checks
    assert int(suite.get("failures")) == 0 == sum(1 for c in cases if c.find("failure") is not None)
    assert root.get("tests") == suite.get("tests")


def test_junit_failures_name_the_check_its_value_and_limit():
    led = _ledger(fault="split-reshape")
    _, suite, cases = _junit(led)
    failed = [c for c in cases if c.find("failure") is not None]
    assert int(suite.get("failures")) == len(failed) >= 1
    names = {(c.get("classname"), c.get("name")) for c in failed}
    assert ("run.head_roundtrip", "roundtrip_exact") in names
    msg = next(c for c in failed if c.get("name") == "roundtrip_exact").find("failure").get("message")
    assert "roundtrip_exact" in msg and "= 96" in msg and "limit 0" in msg
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert int(suite.get("skipped")) == len(skipped)


def test_junit_one_case_per_row_when_the_unit_is_a_row():
    rows = tuple(Row(f"case{i}", "fail" if i == 1 else "pass", (counted(4, "reference", "bad", i == 1),))
                 for i in range(3))
    _, suite, cases = _junit(Report("check", "t", rows, unit="row", row_label="case"))
    assert [c.get("name") for c in cases] == ["case0", "case1", "case2"]
    assert suite.get("failures") == "1" and suite.get("tests") == "3"


# --- GitHub annotations ------------------------------------------------------------------------

def test_github_annotations_one_error_per_failing_check():
    led = _ledger(fault="mask-polarity")
    lines = render(led, "github").splitlines()
    errors = [ln for ln in lines if ln.startswith("::error ")]
    assert len(errors) == len(led.failures()) >= 1
    assert all("title=" in ln and "::" in ln[8:] for ln in errors)
    assert lines[-1].startswith("first finding: masked_scores")
    assert not [ln for ln in render(_ledger(), "github").splitlines() if ln.startswith("::error")]


def test_github_warning_for_a_warn_check():
    rows = (Row("scores", "warn", (bounded(3, "exp_headroom", "largest |score|", 20.0, 11.1, warn_only=True),)),)
    out = render(Report("run", "t", rows), "github")
    assert out.startswith("::warning title=attn-ledger run%3A scores L3 exp_headroom::")


# --- tables -----------------------------------------------------------------------------------

def test_wrap_words_never_splits_a_token():
    text = "max |diff| vs float64 = 8.76e-08 (rtol 2e-05, atol 2e-05) kv_head_isolation_probe_name"
    for width in (10, 20, 40):
        lines = wrap_words(text, width)
        assert " ".join(ln.strip() for ln in lines).split() == text.split()


def _tokens(text: str) -> list[str]:
    return sorted(t for t in text.split() if set(t) != {"-"})


@pytest.mark.parametrize("fault", [None, "mask-polarity", "no-scale"])
def test_ledger_table_at_80_columns_keeps_every_token_whole(fault):
    led = _ledger(fault=fault)
    narrow, wide = render_table(led, 80, detail=True), render_table(led, 240, detail=True)
    assert _tokens(narrow) == _tokens(wide)
    assert max(len(ln) for ln in narrow.splitlines()) <= 80


def test_every_format_renders():
    led = _ledger(fault="no-scale")
    for fmt in FORMATS:
        assert render(led, fmt)
    with pytest.raises(ValueError):
        render(led, "xml")


def test_report_json_of_a_row_keeps_numbers_as_numbers():
    led = _ledger()
    doc = report_json(led)
    c = next(c for r in doc["rows"] if r["name"] == "weights" for c in r["checks"] if c["name"] == "key_row_sums")
    assert isinstance(c["value"], float) and isinstance(c["limit"], float) and c["op"] == "<="
