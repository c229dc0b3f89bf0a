"""``attn-ledger faults``: every catalogued fault is detected, at the level its nature says."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from attn_ledger import catalogue
from attn_ledger.cli import app
from attn_ledger.config import FAULTS
from attn_ledger.kernelcheck import check_case, parse_case

runner = CliRunner()


@pytest.fixture(scope="module")
def report():
    return catalogue.run_catalogue()


def test_cli_every_fault_detected_exit_0():
    res = runner.invoke(app, ["faults", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["command"] == "faults" and data["verdict"] == "pass" and data["undetected"] == []
    names = {f["fault"] for f in data["faults"]}
    assert set(FAULTS) <= names
    assert {"dropout-at-eval", "batch-first", "gqa-repeat", "causal-top-left", "float-mask-bias"} <= names


def test_an_undetectable_fault_makes_the_self_test_fail(monkeypatch):
    def correct(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
        return catalogue._attend(q, k, v, allow_mask, is_causal, scale)

    fake = catalogue.Fault("not-a-fault", "kernel", "a correct kernel labelled as faulty", correct)
    monkeypatch.setattr(catalogue, "CATALOGUE", (catalogue.CATALOGUE[4], fake))
    res = runner.invoke(app, ["faults"], env={"COLUMNS": "100"})
    assert res.exit_code == 1, res.output
    assert "UNDETECTED" in res.output and "undetected: not-a-fault" in res.output


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
    "softmax-overflow": (3, "finite"),
    "no-scale": (4, "reference"),  # only a reference sees it
    "dropout-at-eval": (4, None),  # eval-mode calls disagree
    "batch-first": (2, "batch_independence"),  # same shape out; examples read as positions
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BLACK_BOX))
def test_black_box_level(report, name):
    level, check = EXPECTED_BLACK_BOX[name]
    r = report.result(name)
    assert r.level == level, (r.level, r.check)
    if check is not None:
        assert r.check == check


def test_every_fault_detected(report):
    assert report.exit_code == 0 and not report.undetected


def test_no_scale_passes_every_local_check(report):
    r = report.result("no-scale")
    assert r.clean_levels == (1, 2, 3)


def test_causal_top_left_is_a_behaviour_error_for_decode_shapes():
    # Tq < Tk: top-left blocks keys the query may use; nothing local breaks, only the reference sees it.
    res = check_case(catalogue.causal_top_left, parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32"))
    assert (res.first_failure.level, res.first_failure.name) == (4, "reference")
    # Tq == Tk: top-left and bottom-right agree.
    assert check_case(catalogue.causal_top_left, parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")).passed


@pytest.mark.parametrize("name", FAULTS)
def test_white_box_sees_pipeline_faults_no_later_than_black_box(report, name):
    r = report.result(name)
    assert r.white_level is not None, r.note
    assert r.white_level <= r.level


def test_markdown_table(report):
    md = report.to_markdown()
    assert md.startswith("| fault | kind |") and f"{len(catalogue.CATALOGUE)} of {len(catalogue.CATALOGUE)} faults detected" in md
