"""--backends: the context comparison repeated per SDPA backend and dtype, as one matrix."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.errors import InputError
from attn_ledger.ledger import SDPA_BACKENDS, ledger_on_qkv, resolve_backends, run_ledger


def _qkv(shape=(1, 2, 16, 8)):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def test_math_backend_is_always_available_on_cpu():
    pairs, unavailable = resolve_backends("all", torch.device("cpu"), torch.float32, True, 100)
    assert ("math", torch.float32) in pairs
    assert {n for n, _ in pairs} | {n for n, _ in unavailable} == set(SDPA_BACKENDS)


def test_matrix_covers_backends_and_dtypes_on_small_grids():
    q, k, v = _qkv()
    led = ledger_on_qkv(q, k, v, mask="causal", backends="all")
    assert led.first_finding is None
    matrix = led.details["sdpa_backends"]
    assert set(matrix) == set(SDPA_BACKENDS)
    assert matrix["math"] == {"float32": True, "float16": True, "bfloat16": True}
    names = [c.name for c in led.row("context").checks if c.name.startswith("sdpa[")]
    assert "sdpa[math,float32]" in names and "sdpa[math,bfloat16]" in names
    for c in led.row("context").checks:
        if c.name.startswith("sdpa["):
            assert c.level == 4 and c.status == "pass"


def test_large_grids_compare_only_the_run_dtype():
    q, k, v = _qkv((1, 2, 200, 8))
    led = ledger_on_qkv(q, k, v, mask="causal", backends="math", block_size=50)
    assert led.details["sdpa_backends"] == {"math": {"float32": True}}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_config_mode_matrix_passes_healthy_and_fails_on_a_fault(dtype):
    healthy = run_ledger(load_config(overrides={"dtype": dtype, "num_kv_heads": 1}), backends="math,flash")
    assert healthy.first_finding is None
    assert all(ok is True for row in healthy.details["sdpa_backends"].values() for ok in row.values())
    broken = run_ledger(load_config(overrides={"dtype": dtype, "fault": "no-scale"}), backends="math", keep_going=True)
    if dtype == "float32":  # the pipeline's context against each backend
        assert broken.check("context", f"sdpa[math,{dtype}]").status == "downstream"  # after scores failed
        assert broken.details["sdpa_backends"]["math"][dtype] is False
    else:  # half precision judges each backend's own error (factor rule); the pipeline fails matches_reference
        assert broken.check("context", f"sdpa[math,{dtype}]").status == "pass"
        assert broken.check("context", "matches_reference").status == "downstream"


def test_a_backend_worse_than_plain_fails_its_cell(monkeypatch):
    """A backend whose half output errs far beyond plain rounding is marked False in the matrix."""
    import attn_ledger.engine.backends as K

    real = K.sdpa_pinned

    def noisy(name, q, k, v, mask, scale):
        out = real(name, q, k, v, mask, scale)
        return out * 1.05 if name == "flash" and q.dtype == torch.float16 else out

    monkeypatch.setattr(K, "sdpa_pinned", noisy)
    q, k, v = _qkv()
    led = ledger_on_qkv(q, k, v, mask="causal", backends="math,flash")
    assert led.details["sdpa_backends"]["flash"]["float16"] is False
    assert led.details["sdpa_backends"]["math"]["float16"] is True
    assert led.first_finding.name == "sdpa[flash,float16]"


def test_unknown_backend_is_bad_input():
    q, k, v = _qkv()
    with pytest.raises(InputError, match="backends: got 'fast'"):
        ledger_on_qkv(q, k, v, backends="fast")


def test_cli_backends_json(tmp_path):
    res = CliRunner().invoke(app, ["run", "--backends", "math", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["details"]["sdpa_backends"]["math"]["float32"] is True
    res = CliRunner().invoke(app, ["run", "--backends", "nope"])
    assert res.exit_code == 2
