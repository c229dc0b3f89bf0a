"""``attn-ledger faults``: every catalogued fault is detected, at the level its nature says."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from typer.testing import CliRunner

from attn_ledger.probes import catalogue
from attn_ledger.cli import app
from attn_ledger.inputs.config import FAULTS
from attn_ledger.probes.kernel.check import check_case, parse_case

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    return catalogue.run_catalogue()


def detected(report, name):
    """The one check of a fault's row: detected at level L by a check, or not."""
    (check,) = report.row(name).checks
    return check


def test_cli_every_fault_detected_exit_0(monkeypatch):
    # two faults, a kernel and a module, keep the command quick; the whole catalogue runs in `report`
    monkeypatch.setattr(catalogue, "CATALOGUE", (catalogue.CATALOGUE[4], catalogue.CATALOGUE[8]))
    res = runner.invoke(app, ["faults", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["command"], data["verdict"], data["first_finding"]) == ("faults", "pass", None)
    assert data["details"]["undetected"] == [] and "elapsed_s" not in data["details"]
    assert [(r["name"], r["status"]) for r in data["rows"]] == [("no-scale", "pass"), ("batch-first", "pass")]
    assert res.stdout == runner.invoke(app, ["faults", "--format", "json"]).stdout  # byte-identical


def test_an_undetectable_fault_makes_the_self_test_fail(monkeypatch):
    def correct(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
        return catalogue._attend(q, k, v, allow_mask, is_causal, scale)

    fake = catalogue.Fault("not-a-fault", "kernel", "a correct kernel labelled as faulty", correct)
    monkeypatch.setattr(catalogue, "CATALOGUE", (catalogue.CATALOGUE[4], fake))
    res = runner.invoke(app, ["faults", "--format", "json", "--timings"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "fail" and data["details"]["undetected"] == ["not-a-fault"]
    assert (data["first_finding"]["row"], data["first_finding"]["check"]) == ("not-a-fault", "detected")
    assert [r["status"] for r in data["rows"]] == ["pass", "fail"]
    assert data["details"]["elapsed_s"] >= 0  # only with --timings
    junit = runner.invoke(app, ["faults", "--format", "junit"])
    suite = ET.fromstring(junit.stdout).find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")


# Levels from what each fault is: where the computation first stops meaning what was intended,
# as far as inputs and outputs can show it.
EXPECTED_BLACK_BOX = {
    "k-transpose": (1, "call"),  # raises unless Nh == Tk == Dh
    "split-reshape": (2, None),  # heads and positions mixed
    "merge-reshape": (2, None),
    "gqa-repeat": (2, "kv_head_isolation"),
    "softmax-axis": (3, None),  # no longer a convex combination
    "mask-after-softmax": (3, None),
    "mask-polarity": (3, None),
    "float-mask-bias": (3, None),  # forbidden keys still take part
    "softmax-overflow": (3, None),  # non-finite output, or gradients, where exp(s) overflows
    # only a reference sees it, except where the unscaled float16 product of the 'huge' case overflows
    "no-scale": (3, "finite"),
    "dropout-at-eval": (4, None),  # eval-mode calls disagree
    "batch-first": (2, "batch_independence"),  # same shape out; examples read as positions
    "softcap-dropped": (4, "score_design"),  # the declared cap, bent on a probe, is not in the core
    # near threshold: just past what rounding explains
    "scale-off-1pct": (4, "reference"),  # every local invariant holds; only the reference sees it
    "leaked-weight": (3, None),  # forbidden keys take part, a little
    "softmax-bf16": (3, None),  # weights rounded to bfloat16 no longer make a convex combination in float32
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BLACK_BOX))
def test_black_box_level(report, name):
    level, check_name = EXPECTED_BLACK_BOX[name]
    check = detected(report, name)
    row = report.row(name)
    assert check.status == "pass" and row.status == "pass"
    assert check.level == level == row.fields["level"], (check.level, check.data["check"])
    assert row.fields["check"] == check.data["check"]
    if check_name is not None:
        assert check.data["check"] == check_name


def test_kernel_faults_name_their_smallest_case(report):
    check = detected(report, "no-scale")
    case = parse_case(check.data["case"])
    assert check.location == {"case": case.id}
    assert check_case(catalogue.no_scale, case).first_failure.name == check.data["check"] == "finite"
    assert case.inputs == "huge" and case.dtype == "f16"  # the raw product passes 65504 before any scale
    assert detected(report, "batch-first").data["case"] is None  # modules have no cases


def test_every_fault_detected(report):
    assert report.exit_code == 0 and report.first_finding is None
    assert report.details["undetected"] == []
    names = [r.name for r in report.rows]
    assert names == [f.name for f in catalogue.CATALOGUE]
    assert set(FAULTS) <= set(names)
    assert {"dropout-at-eval", "batch-first", "gqa-repeat", "causal-top-left", "float-mask-bias"} <= set(names)
    assert all(r.status == "pass" for r in report.rows)


def test_no_scale_passes_every_local_check_but_overflow(report):
    data = detected(report, "no-scale").data
    # L3 finite fails only where the unscaled float16 product overflows; every other local check holds
    assert data["clean_levels"] == [1, 2]
    for name in ("convex_range", "forbidden_keys", "empty_rows", "grad_blocked_keys"):
        assert {"level": 3, "check": name} in data["passes_through"], name
    assert {"level": 4, "check": "causal_intervention"} in data["passes_through"]
    assert {"level": 4, "check": "reference"} not in data["passes_through"]
    levels = [p["level"] for p in data["passes_through"]]
    assert levels == sorted(levels)


def test_causal_top_left_is_a_behaviour_error_for_decode_shapes():
    # Tq < Tk: top-left blocks keys the query may use; nothing local breaks, only the reference sees it.
    res = check_case(catalogue.causal_top_left, parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32"))
    assert (res.first_failure.level, res.first_failure.name) == (4, "reference")
    # Tq == Tk: top-left and bottom-right agree.
    assert check_case(catalogue.causal_top_left, parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")).passed


@pytest.mark.parametrize("name", FAULTS)
def test_white_box_sees_pipeline_faults_no_later_than_black_box(report, name):
    check = detected(report, name)
    white = check.data["white_box"]
    assert white["fault"] == name and white["level"] is not None
    if name == "no-scale":  # the black box's L3 is a float16 overflow that the float32 pipeline never meets
        assert (check.level, check.data["check"], white["level"]) == (3, "finite", 4)
    else:
        assert white["level"] <= check.level
    fields = report.row(name).fields
    assert (fields["ledger level"], fields["ledger stage"]) == (white["level"], white["stage"])


def test_faults_outside_the_pipeline_have_no_white_box(report):
    assert detected(report, "gqa-repeat").data["white_box"] is None
    assert (report.row("gqa-repeat").fields["ledger level"], report.row("gqa-repeat").fields["ledger stage"]) == (None, "-")


def test_near_threshold_faults_are_catalogued_and_written_as_fixtures_alike():
    import torch

    from attn_ledger.probes.kernel.check import case_inputs
    from attn_ledger.inputs.userload import load_object

    names = [f.name for f in catalogue.NEAR_THRESHOLD]
    assert names == ["scale-off-1pct", "leaked-weight", "softmax-bf16"]
    case = parse_case("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32")
    q, k, v, _ = case_inputs(case, 0, torch.device("cpu"))
    allow = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    allow[0, ..., :3] = False  # left padding of three keys in the first example
    for fault in catalogue.NEAR_THRESHOLD:
        fixture = load_object(f"{ROOT / 'fixtures/kernels/near_threshold.py'}:{fault.target.__name__}")
        kw = {"allow_mask": allow, "is_causal": True, "scale": 0.3}
        mine, theirs = fault.target(q, k, v, **kw), fixture(q, k, v, **kw)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert not torch.equal(mine, catalogue._attend(q, k, v, allow, True, 0.3)), fault.name  # it is a fault


@pytest.mark.parametrize("seed", range(10))
def test_a_dropped_soft_cap_is_caught_at_every_seed(seed):
    fault = next(f for f in catalogue.CATALOGUE if f.name == "softcap-dropped")
    row = catalogue.check_fault(fault, seed)
    assert row.status == "pass" and row.fields["check"] == "score_design"


def test_the_layer_with_the_dropped_cap_is_a_correct_uncapped_one():
    from attn_ledger.probes.module.check import check_module

    fault = next(f for f in catalogue.CATALOGUE if f.name == "softcap-dropped")
    assert check_module(fault.target, catalogue.MODULE_EMBED_DIM, catalogue.MODULE_HEADS).exit_code == 0
