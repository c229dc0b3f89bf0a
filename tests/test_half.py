"""float16 and bfloat16: the rounding rule against float64 (SDPA's error keeps the factor rule against a plain
same-dtype computation), and the exp headroom warning."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import ledger_on_qkv, run_ledger

HALF = ["float16", "bfloat16"]
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _qkv(shape=(1, 2, 64, 16), seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    return q * scale, k * scale, v


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("overrides", [{}, {"seq_len": 200, "embed_dim": 32, "num_heads": 4, "block_size": 7}],
                         ids=["default", "streamed"])
def test_healthy_config_passes_in_half(dtype, overrides):
    led = run_ledger(load_config(overrides={"dtype": dtype, **overrides}))
    assert led.first_finding is None, led.first_finding
    assert led.details["dtype"] == dtype


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_healthy_tensors_pass_in_half(dtype, mask, tmp_path):
    q, k, v = (t.to(DT[dtype]) for t in _qkv())
    led = ledger_on_qkv(q, k, v, mask=mask)
    assert led.first_finding is None, led.first_finding
    from safetensors.torch import save_file

    path = tmp_path / "qkv.safetensors"
    save_file({"q": q.float(), "k": k.float(), "v": v.float()}, str(path))
    res = CliRunner().invoke(app, ["run", "--tensors", str(path), "--mask", mask, "--dtype", dtype, "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verdict"] == "pass"


@pytest.mark.parametrize("dtype", HALF)
def test_context_row_shows_the_rounding_rule_and_sdpas_factor(dtype):
    led = run_ledger(load_config(overrides={"dtype": dtype}))
    c = led.check("context", "matches_sdpa")
    assert c.status == "pass"  # SDPA's own error against float64, within the factor of the plain same-dtype one
    assert c.data["factor_limit"] == 4 and c.data["factor"] <= 4 and c.data["plain_err"] > 0
    assert c.limit == 4 * max(c.data["plain_err"], c.data["floor"]) and c.value <= c.limit
    for stage in ("scores", "weights", "context"):  # the pipeline's stages: c * eps * M, as in float32
        parts = led.check(stage, "matches_reference").data["tolerance"]
        assert parts["rule"] == "c * eps * M" and parts["dtype"] == dtype and parts["ratio"] <= 0.5


@pytest.mark.parametrize("dtype", HALF)
def test_worse_than_plain_output_fails_the_rounding_rule(dtype):
    """A given out computed with a softmax scale off (5% in float16; 30% in bfloat16, whose 8 bits leave a
    5% error within a few roundings of the scores): close in absolute terms, beyond the rounding rule."""
    q, k, v = (t.to(DT[dtype]) for t in _qkv())
    scale = (1.05 if dtype == "float16" else 1.3) / 4.0  # Dh = 16
    bad = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale).to(DT[dtype])
    good = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(DT[dtype])
    c_bad = ledger_on_qkv(q, k, v, mask="causal", out=bad).check("context", "user_out_matches_reference")
    c_good = ledger_on_qkv(q, k, v, mask="causal", out=good).check("context", "user_out_matches_reference")
    assert c_good.status == "pass" and c_bad.status == "fail"
    assert c_good.data["tolerance"]["ratio"] <= 0.5 < 1 < c_bad.data["tolerance"]["ratio"]
    assert c_bad.value > c_bad.limit


@pytest.mark.parametrize("dtype", HALF)
def test_missing_scale_is_still_caught_at_scores_in_half(dtype):
    d = run_ledger(load_config(overrides={"dtype": dtype, "fault": "no-scale"})).first_finding
    assert (d.row, d.level, d.name) == ("scores", 4, "matches_reference")


def test_peaky_bfloat16_softmax_passes_under_the_rounding_rule():
    """Scores near 40 make bfloat16 weights err by ~0.02 even when computed plainly; that is not a divergence."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(scale=3.0))
    led = ledger_on_qkv(q, k, v, mask="causal")
    assert led.first_finding is None
    assert led.check("weights", "matches_reference").value > 1e-2


def test_headroom_warning_fires_without_a_divergence():
    """float16: exp overflows above log(65504) = 11.09; scores near 40 are fine with max-subtraction."""
    q, k, v = (t.to(torch.float16) for t in _qkv(scale=3.0))
    led = ledger_on_qkv(q, k, v, mask="causal")
    c = led.check("scores", "exp_headroom")
    assert c.status == "warn" and c.value > 11.1
    assert led.first_finding is None and led.verdict == "pass" and led.exit_code == 0
    assert ("scores", c) in led.warnings()
    from attn_ledger.render.jsondoc import report_json

    row = next(r for r in report_json(led)["rows"] if r["name"] == "scores")
    (j,) = [x for x in row["checks"] if x["name"] == "exp_headroom"]
    assert j["status"] == "warn" and j["value"] > j["limit"]
    assert row["status"] == "warn"


def test_headroom_passes_on_ordinary_scores():
    q, k, v = (t.to(torch.float16) for t in _qkv())
    c = ledger_on_qkv(q, k, v, mask="causal").check("scores", "exp_headroom")
    assert c.status == "pass" and c.value < 11.1
    q, k, v = _qkv(scale=3.0)  # the same scores in float32 have headroom up to 88.7
    assert ledger_on_qkv(q, k, v, mask="causal").check("scores", "exp_headroom").status == "pass"


@pytest.mark.parametrize("shape", [(2, 2, 12, 16), (2, 2, 300, 16)], ids=["whole", "streamed"])
def test_headroom_ignores_garbage_on_padded_keys(shape):
    """A padded key's score is masked before exp: huge values there are no overflow risk."""
    q, k, v = _qkv(shape)
    tk = shape[2]
    valid = torch.ones(shape[0], tk, dtype=torch.bool)
    valid[1, tk - 4:] = False  # the last four keys of batch element 1 are padding
    k = k.clone()
    k[1, :, tk - 4:] = 1e3  # and hold garbage: scores of about 1e3 there
    led = ledger_on_qkv(q, k, v, key_valid=valid)
    c = led.check("scores", "exp_headroom")
    assert c.status == "pass" and c.value < 20, c
    assert led.first_finding is None
    valid[1, tk - 4:] = True  # the same keys allowed: now exp would overflow without max-subtraction
    assert ledger_on_qkv(q, k, v, key_valid=valid).check("scores", "exp_headroom").status == "warn"


def test_headroom_warning_in_cli_json(tmp_path):
    from safetensors.torch import save_file

    q, k, v = _qkv(scale=3.0)
    path = tmp_path / "hot.safetensors"
    save_file({"q": q, "k": k, "v": v}, str(path))
    res = CliRunner().invoke(app, ["run", "--tensors", str(path), "--mask", "causal", "--dtype", "float16", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "pass" and data["first_finding"] is None
    checks = [c for r in data["rows"] for c in r["checks"] if c["name"] == "exp_headroom"]
    assert checks[0]["status"] == "warn"


def test_float16_products_on_the_cpu_match_torchs_own_to_an_ulp():
    from attn_ledger.maths.pipeline import matmul

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 4, 16, 300, generator=g).half(), torch.randn(1, 4, 300, 32, generator=g).half()
    got, native = matmul(a, b), a @ b
    assert got.dtype == torch.float16
    ulp = torch.finfo(torch.float16).eps * native.float().abs().clamp(min=1.0)
    assert bool(((got.float() - native.float()).abs() <= ulp).all())
    f32 = a.float(), b.float()
    assert torch.equal(matmul(*f32), f32[0] @ f32[1])  # other dtypes: the plain product
