"""The ledger on CUDA: the same checks as on the CPU. Skipped where CUDA is absent (CI stays on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import ledger_on_qkv, run_ledger, run_ledger_tensors
from attn_ledger.render.notes import notes_text

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = ["float32", "float16", "bfloat16"]
DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _qkv(shape=(2, 4, 64, 32), device="cuda", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for _ in range(3))


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_healthy_config_on_cuda(dtype):
    led = run_ledger(load_config(overrides={"dtype": dtype, "device": "cuda", "seq_len": 64, "embed_dim": 64, "num_heads": 4}))
    assert led.first_finding is None, led.first_finding
    assert led.details["device"].startswith("cuda")
    assert led.tensors["context"].device.type == "cuda"


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_healthy_tensors_on_cuda(dtype, mask):
    q, k, v = _qkv(dtype=DT[dtype])
    led = ledger_on_qkv(q, k, v, mask=mask)
    assert led.first_finding is None, led.first_finding
    assert led.details["device"].startswith("cuda")


@cuda
def test_streamed_blocks_on_cuda():
    q, k, v = _qkv((1, 8, 1024, 64))
    led = ledger_on_qkv(q, k, v, mask="causal", block_size=128)
    assert led.first_finding is None, led.first_finding
    assert any("query blocks" in n for n in notes_text(led))


@cuda
@pytest.mark.parametrize("fault,stage", [("no-scale", "scores"), ("mask-polarity", "masked_scores"), ("softmax-axis", "weights")])
def test_faults_are_caught_on_cuda(fault, stage):
    d = run_ledger(load_config(overrides={"device": "cuda", "fault": fault})).first_finding
    assert d is not None and d.row == stage


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_backends_matrix_on_cuda(dtype):
    q, k, v = _qkv((1, 2, 32, 64), dtype=DT[dtype])
    led = ledger_on_qkv(q, k, v, mask="causal", backends="all")
    matrix = led.details["sdpa_backends"]
    assert matrix["math"][dtype] is True
    for name, row in matrix.items():
        for dt, ok in row.items():
            assert ok is True or str(ok).startswith("unavailable"), (name, dt, ok)
    assert led.first_finding is None, led.first_finding


@cuda
def test_cli_tensors_on_cuda(tmp_path):
    from safetensors.torch import save_file

    q, k, v = _qkv(device="cpu")
    path = tmp_path / "qkv.safetensors"
    save_file({"q": q, "k": k, "v": v}, str(path))
    res = CliRunner().invoke(app, ["run", "--tensors", str(path), "--mask", "causal", "--device", "cuda",
                                   "--dtype", "bfloat16", "--backends", "all", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "pass" and data["details"]["device"].startswith("cuda")
    led = run_ledger_tensors(str(path), mask="causal", device="auto")
    assert led.details["device"].startswith("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_request_without_cuda_is_bad_input():
    res = CliRunner().invoke(app, ["run", "--device", "cuda"])
    assert res.exit_code == 2
    assert "CUDA is not available" in res.output


def test_cpu_device_is_honoured():
    q, k, v = _qkv((1, 2, 8, 4), device="cpu")
    led = ledger_on_qkv(q, k, v, mask="causal")
    assert led.details["device"] == "cpu"
    assert run_ledger(load_config(overrides={"device": "cpu"})).details["device"] == "cpu"


# --- check on a kernel, on CUDA -------------------------------------------------------------------


@cuda
def test_check_runs_the_default_tier_on_cuda_with_a_float64_reference():
    from pathlib import Path

    from attn_ledger.probes.kernel.check import DEFAULT_TIER, check_kernel
    from attn_ledger.inputs.userload import load_object

    fn = load_object(f"{Path(__file__).resolve().parents[1] / 'fixtures' / 'kernels' / 'sdpa_adapter.py'}:attention")
    report = check_kernel(fn, device="cuda")
    assert report.exit_code == 0, report.details["failures"]
    assert report.details["device"] == "cuda" and report.details["cases_total"] == len(DEFAULT_TIER)
    assert report.details["reference_dtype"] == "float64"


@cuda
def test_check_on_cuda_catches_what_it_catches_on_the_cpu():
    from pathlib import Path

    from attn_ledger.probes.kernel.check import check_kernel, parse_case
    from attn_ledger.inputs.userload import load_object

    kernels = Path(__file__).resolve().parents[1] / "fixtures" / "kernels"
    bad = load_object(f"{kernels / 'broken_backward.py'}:wrong_dq")
    case = parse_case("b2-h4kv2-tq113tk113-dh64dv64-lpad64-causal-rand-f32")
    report = check_kernel(bad, [case], device="cuda")
    assert (report.first_finding.level, report.first_finding.name) == (4, "grad_q")
    cli = CliRunner().invoke(app, ["check", f"{kernels / 'sdpa_adapter.py'}:attention", "--device", "auto", "--case",
                              case.id, "--format", "json"])
    details = json.loads(cli.stdout)["details"]
    assert cli.exit_code == 0 and (details["device"], details["reference_dtype"]) == ("cuda", "float64")
