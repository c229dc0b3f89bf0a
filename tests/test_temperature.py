"""sweep-scale --temperatures: one fixed row of scores at several temperatures, against math.exp."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.experiments.scale import DEFAULT_SCORES, temperature_lab
from attn_ledger.render.jsondoc import schema

runner = CliRunner()
SCORES = [1.2, 0.3, -0.4, 1.8]
SEED001_ROW = [0.2915, 0.1185, 0.0589, 0.5311]  # seed 001's table at temperature 1


def softmax_by_hand(scores: list[float], tau: float) -> list[float]:
    e = [math.exp(s / tau) for s in scores]
    return [x / sum(e) for x in e]


def entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def test_distributions_match_math_exp_and_entropy_rises_with_temperature():
    r = runner.invoke(app, ["sweep-scale", "--temperatures", "0.5,1,2", "--scores", "1.2,0.3,-0.4,1.8", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema())
    rows = [row for row in doc["rows"] if row["name"].startswith("tau=")]
    assert [row["fields"]["temperature"] for row in rows] == [0.5, 1, 2]
    for row in rows:
        want = softmax_by_hand(SCORES, row["fields"]["temperature"])
        assert row["fields"]["probabilities"] == pytest.approx(want, abs=1e-6)
        assert row["fields"]["entropy"] == pytest.approx(entropy(want), abs=1e-6)
    entropies = [row["fields"]["entropy"] for row in rows]
    assert entropies[0] < entropies[1] < entropies[2]
    assert [round(p, 4) for p in rows[1]["fields"]["probabilities"]] == SEED001_ROW
    assert doc["rows"][-1]["checks"][0]["name"] == "entropy_rises" and doc["verdict"] == "pass"


def test_seed001_scores_are_the_default():
    r = runner.invoke(app, ["sweep-scale", "--temperatures", "1", "--format", "json"])
    doc = json.loads(r.stdout)
    assert doc["details"]["scores"] == list(DEFAULT_SCORES) == SCORES
    assert [round(p, 4) for p in doc["rows"][0]["fields"]["probabilities"]] == SEED001_ROW
    assert doc["rows"][-1]["checks"][0]["status"] == "not_applicable"  # one temperature: nothing to compare


def test_a_softmax_that_disagrees_with_float64_is_exit_1():
    def off(x, allow, empty_zero):
        return torch.softmax(x * 1.01, dim=-1)  # still sums to one; 1% sharper than asked

    led = temperature_lab((0.5, 1.0), softmax=off)
    assert led.exit_code == 1
    f = led.first_finding
    assert (f.row, f.level, f.name) == ("tau=0.5", 4, "matches_float64_softmax") and f.check.value > 1e-3
    assert led.check("tau=0.5", "sums_to_one").status == "pass"
    assert temperature_lab((0.5, 1.0)).check("tau=0.5", "matches_float64_softmax").status == "pass"


def test_sums_to_one_and_entropy_rises_fail_on_cases_built_to_break_them():
    def unnormalised(x, allow, empty_zero):
        return torch.exp(x - x.amax(dim=-1, keepdim=True))

    assert temperature_lab((1.0,), softmax=unnormalised).check("tau=1", "sums_to_one").status == "fail"

    def sharper_when_hotter(x, allow, empty_zero):  # x = s / tau: x * tau^2 = s * tau sharpens as tau rises
        tau = float(SCORES[0] / x[0, 0])
        return torch.softmax(x * tau * tau, dim=-1)

    led = temperature_lab((0.5, 1.0, 2.0), softmax=sharper_when_hotter)
    c = led.check("across tau", "entropy_rises")
    assert c.status == "fail" and c.value == 2 and c.data["steps"] == [[0.5, 1.0], [1.0, 2.0]]
    assert temperature_lab((0.5, 1.0, 2.0)).check("across tau", "entropy_rises").status == "pass"


@pytest.mark.parametrize("args,needle", [
    (["--temperatures", "0.5,1", "--dh", "8"], "--dh"),
    (["--temperatures", "0.5,1", "--tensors", "fixtures/qk/float16_std3.safetensors"], "--tensors"),
    (["--temperatures", "0.5,1", "--queries", "16"], "--queries"),
    (["--temperatures", "0.5,1", "--plot", "p.png"], "--plot"),
    (["--scores", "1,2"], "--scores"),
    (["--temperatures", "0,1"], "--temperatures"),
    (["--temperatures", "1,1"], "--temperatures"),
    (["--temperatures", "1,nan"], "--temperatures"),
    (["--temperatures", "1", "--scores", "1,x"], "--scores"),
])
def test_options_that_say_no(args, needle):
    r = runner.invoke(app, ["sweep-scale", *args])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and needle in err
