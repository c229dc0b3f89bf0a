"""``run --softcap C``: the built-in pipeline, the float64 reference and saved tensors with soft-capped scores.

The scores stage ends in ``C * tanh(s / C)`` before the mask; the float64 reference applies the same
cap; SDPA, which has none, is handed the capped scores as its additive mask. A cap the code does not
apply fails: the ``softcap-after-mask`` fault, and saved intermediates computed without the cap.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.engine.execute import sdpa_capped
from attn_ledger.ledger import ledger_on_qkv, run_ledger
from attn_ledger.render.notes import notes_text
from attn_ledger.maths.reference import reference_stages
from attn_ledger.render.notes import notes_text

runner = CliRunner()


def failing(report) -> list[tuple[str, str]]:
    return [(row.name, c.name) for row in report.rows for c in row.checks if c.failed]


@pytest.mark.parametrize("overrides", [
    {},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},  # every row of example 1 empty
    {"mask": "none", "seq_len": 9, "block_size": 4},  # several blocks and SDPA groups
    {"dtype": "float16"},
    {"dtype": "float64", "replay": True},
], ids=["default", "empty-rows", "blocks", "float16", "float64-replay"])
def test_a_soft_capped_pipeline_passes_with_the_cap_stated(overrides):
    report = run_ledger(load_config(overrides={"softcap": 2.0, **overrides}))
    assert report.exit_code == 0, failing(report)
    assert "softcap=2" in report.title and report.details["softcap"] == 2.0
    assert any(n.startswith("soft-cap C = 2: the scaled scores become C * tanh(s / C)") for n in notes_text(report))


def test_the_scores_stage_holds_the_capped_scores():
    capped = run_ledger(load_config(overrides={"softcap": 0.5, "keep_grids": True}))
    plain = run_ledger(load_config(overrides={"keep_grids": True}))
    s, s0 = capped.tensors["scores"], plain.tensors["scores"]  # [B, Nh, Tq, Tk]
    assert float(s.abs().max()) < 0.5 < float(s0.abs().max())
    assert torch.allclose(s, 0.5 * torch.tanh(s0 / 0.5), atol=1e-6)


def test_the_reference_caps_the_scaled_scores_before_the_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    allow = torch.ones(4, 4, dtype=torch.bool).tril()
    st = reference_stages(q, k, v, allow_mask=allow, scale=0.5, softcap=2.0)
    s = 2.0 * torch.tanh((q @ k.transpose(-2, -1)) * 0.5 / 2.0)  # [B, Nh, Tq, Tk]
    assert torch.allclose(st["scores"], s)
    assert torch.equal(st["weights"] == 0, ~allow.expand(1, 2, 4, 4))  # forbidden keys still weigh nothing
    assert torch.allclose(st["out"], torch.softmax(s.masked_fill(~allow, -math.inf), -1) @ v)
    # SDPA on the capped scores (its additive mask, q zeroed) is the same attention
    assert torch.allclose(sdpa_capped(q, k, v, allow, 0.5, 2.0), st["out"])


def test_the_cap_applied_after_the_mask_fails_at_the_scores():
    report = run_ledger(load_config(overrides={"softcap": 50.0, "fault": "softcap-after-mask"}))
    first = report.first_finding
    assert report.exit_code == 1 and (first.row, first.name) == ("scores", "matches_reference")


def saved(cap: float | None):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))  # [B, Nh, T, Dh]
    st = reference_stages(q, k, v, is_causal=True, softcap=cap, dtype=torch.float32)
    return q, k, v, st


def test_saved_intermediates_are_judged_against_the_capped_reference():
    q, k, v, st = saved(2.0)
    good = ledger_on_qkv(q, k, v, mask="causal", scores=st["scores"], weights=st["weights"], out=st["out"],
                         softcap=2.0)
    assert good.exit_code == 0, failing(good)
    q, k, v, plain = saved(None)  # computed without the cap that is declared
    bad = ledger_on_qkv(q, k, v, mask="causal", scores=plain["scores"], weights=plain["weights"], out=plain["out"],
                        softcap=2.0)
    first = bad.first_finding
    assert bad.exit_code == 1 and (first.row, first.name) == ("scores", "user_scores_matches_reference")
    assert "softcap=2" in good.title and good.details["softcap"] == 2.0


def test_run_tensors_takes_softcap_from_the_command_line(tmp_path):
    from safetensors.torch import save_file

    q, k, v, st = saved(2.0)
    path = tmp_path / "capped.safetensors"
    save_file({"q": q, "k": k, "v": v, "out": st["out"].contiguous()}, str(path))
    args = ["run", "--tensors", str(path), "--mask", "causal", "--format", "json"]
    res = runner.invoke(app, args + ["--softcap", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["details"]["softcap"] == 2.0
    uncapped = runner.invoke(app, args)
    assert uncapped.exit_code == 1
    assert json.loads(uncapped.stdout)["first_finding"]["row"] == "context"


@pytest.mark.parametrize("args, named", [
    (["--softcap", "0"], "--softcap"),
    (["--softcap", "nan"], "--softcap"),
    (["--softcap", "inf"], "--softcap"),
    (["--fault", "softcap-after-mask"], "fault"),
], ids=["zero", "nan", "inf", "fault-without-cap"])
def test_bad_softcap_options_exit_2_naming_the_field(args, named):
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {named}") and "Traceback" not in res.output


def test_pinned_backends_get_the_capped_scores_and_agree_with_a_capped_pipeline():
    report = run_ledger(load_config(overrides={"softcap": 1.0, "scale": 2.0}), backends="math,flash")
    assert report.exit_code == 0, failing(report)
    matrix = report.details["sdpa_backends"]
    assert matrix["math"]["float32"] is True and matrix["flash"]["float32"] is True
    assert any("and so does each pinned backend" in n for n in notes_text(report))


def test_pinned_backends_fail_a_pipeline_that_caps_after_the_mask():
    report = run_ledger(load_config(overrides={"softcap": 1.0, "scale": 2.0, "fault": "softcap-after-mask",
                                               "mask": "padding", "valid_lengths": [5, 3]}),
                        backends="math,flash", keep_going=True)
    assert report.exit_code == 1
    matrix = report.details["sdpa_backends"]
    assert matrix["math"]["float32"] is False and matrix["flash"]["float32"] is False


GRAD_ROWS = ("grad_weights", "grad_values", "grad_scores", "grad_q", "grad_k", "grad_projections", "grad_input")


@pytest.mark.parametrize("overrides", [
    {},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"rope": "half"},
    {"mask": "none", "seq_len": 9, "block_size": 4},
    {"dtype": "float64"},
], ids=["default", "empty-rows", "rope", "blocks", "float64"])
def test_the_backward_runs_through_the_cap_and_agrees_with_float64_and_sdpa(overrides):
    report = run_ledger(load_config(overrides={"softcap": 2.0, "scale": 1.5, "grad": True, **overrides}))
    assert report.exit_code == 0, failing(report)
    judged = {(row.name, c.name): c.status for row in report.rows for c in row.checks}
    assert judged[("grad_q", "matches_reference")] == "pass" and judged[("grad_k", "matches_reference")] == "pass"
    assert judged[("grad_k", "key_sum_zero")] == "not_applicable"  # the cap's slope breaks the zero row sums
    if not overrides.get("mask") == "padding":  # SDPA's rows are compared where every query has a key
        assert judged[("grad_q", "matches_sdpa")] == "pass"


def test_a_backward_that_forgets_the_caps_slope_fails_at_grad_q(monkeypatch):
    from attn_ledger.engine import backward

    monkeypatch.setattr(backward, "cap_chain", lambda gs, masked, cap: gs)  # S-bar taken as the raw scores' gradient
    report = run_ledger(load_config(overrides={"softcap": 2.0, "scale": 1.5, "grad": True}))
    first = report.first_finding
    assert report.exit_code == 1 and (first.row, first.name) == ("grad_q", "matches_reference")


def test_saved_tensors_take_grad_with_a_cap():
    q, k, v, _ = saved(2.0)
    good = ledger_on_qkv(q, k, v, mask="causal", softcap=2.0, grad=True)
    assert good.exit_code == 0, failing(good)
    assert {row.name for row in good.rows} >= {"grad_q", "grad_k", "grad_values"}
