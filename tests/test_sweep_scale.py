"""sweep-scale: the sqrt(Dh) relationship, its controls, --tensors flags, --plot, bad input."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.experiments import scale
from attn_ledger.experiments.scale import ScaleRow, relationship_checks, sweep
from attn_ledger.tensorio import save_tensor_file

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["sweep-scale", *args])


def as_json(result) -> dict:
    return json.loads(result.stdout)


def checks_by_name(doc: dict) -> dict:
    return {c["name"]: c for c in doc["checks"]}


def test_default_sweep_reproduces_the_seed_relationship():
    result = invoke("--format", "json")
    assert result.exit_code == 0, result.output
    doc = as_json(result)
    assert doc["command"] == "sweep-scale" and doc["verdict"] == "pass"
    assert (doc["queries"], doc["keys"]) == (512, 512)
    rows = doc["rows"]
    assert [r["dh"] for r in rows] == [8, 32, 128, 512]
    for r in rows:
        assert abs(r["raw_std"] / math.sqrt(r["dh"]) - 1) <= 0.05
        assert abs(r["scaled_std"] - 1) <= 0.05
        assert r["ln_tk"] == pytest.approx(math.log(512))
        assert r["scaled_entropy"] < r["ln_tk"]
    raw_h = [r["raw_entropy"] for r in rows]
    raw_maxp = [r["raw_maxp"] for r in rows]
    assert raw_h == sorted(raw_h, reverse=True) and raw_h[0] - raw_h[-1] > 2.0
    assert raw_maxp == sorted(raw_maxp) and raw_maxp[-1] > 0.85
    scaled_h = [r["scaled_entropy"] for r in rows]
    assert max(scaled_h) - min(scaled_h) < 0.05
    assert all(c["ok"] for c in doc["checks"])


@pytest.mark.parametrize("seed", [1, 2, 3, 17, 42])
def test_default_sizes_hold_on_other_seeds(seed):
    assert sweep(seed=seed).ok


def test_small_sizes_of_the_worked_example_can_fail():
    # 64 x 32 keys is too few samples: at seed 99 the Dh=8 std misses the 5% band.
    report = sweep(queries=64, keys=32, seed=99)
    assert not report.ok
    failed = {c.name for c in report.checks if c.failed}
    assert "raw_std_tracks_sqrt_dh" in failed
    result = invoke("--queries", "64", "--keys", "32", "--seed", "99", "--format", "json")
    assert result.exit_code == 1
    assert as_json(result)["verdict"] == "fail"


def _row(dh, raw_std=None, scaled_std=1.0, raw_h=1.0, scaled_h=3.0):
    return ScaleRow(dh, math.sqrt(dh) if raw_std is None else raw_std, scaled_std, math.sqrt(dh), 0.5, 0.1,
                    raw_h, scaled_h, math.log(32))


def _failed(rows):
    return {c.name for c in relationship_checks(rows) if c.ok is False}


def test_each_relationship_check_passes_on_ideal_rows():
    rows = (_row(8, raw_h=1.7), _row(32, raw_h=0.8), _row(128, raw_h=0.3))
    assert _failed(rows) == set()


@pytest.mark.parametrize(
    "rows, name",
    [
        ((_row(8, raw_std=3.2, raw_h=1.7), _row(32, raw_h=0.8)), "raw_std_tracks_sqrt_dh"),
        ((_row(8, scaled_std=1.08, raw_h=1.7), _row(32, raw_h=0.8)), "scaled_std_near_one"),
        ((_row(8, raw_h=1.7, scaled_h=3.0), _row(32, raw_h=0.8, scaled_h=2.5)), "scaled_entropy_flat"),
        ((_row(8, raw_h=0.8), _row(32, raw_h=1.7)), "raw_entropy_falling"),
    ],
    ids=["raw-std", "scaled-std", "flat", "falling"],
)
def test_each_relationship_check_can_fail(rows, name):
    assert name in _failed(rows)


def test_missing_scale_is_caught(monkeypatch):
    """A sweep whose 'scaled' scores were never divided by sqrt(Dh) must fail."""
    real = scale.score_stats

    def unscaled(q, k):
        row, maxp, largest = real(q, k)
        return ScaleRow(row.dh, row.raw_std, row.raw_std, row.sqrt_dh, row.raw_maxp, row.raw_maxp,
                        row.raw_entropy, row.raw_entropy, row.ln_tk), maxp, largest

    monkeypatch.setattr(scale, "score_stats", unscaled)
    result = invoke("--dh", "8,32", "--queries", "128", "--keys", "128", "--format", "json")
    assert result.exit_code == 1
    failed = {c["name"] for c in as_json(result)["checks"] if c["ok"] is False}
    assert {"scaled_std_near_one", "scaled_entropy_flat"} <= failed


def test_single_dh_leaves_cross_dh_checks_unevaluated():
    report = sweep((64,), 256, 256, 0)
    by = {c.name: c for c in report.checks}
    assert by["scaled_entropy_flat"].ok is None and by["raw_entropy_falling"].ok is None
    assert by["raw_std_tracks_sqrt_dh"].ok is True
    assert report.exit_code == 0


def test_markdown_and_table_render_the_numbers(tmp_path):
    out = tmp_path / "r.md"
    result = invoke("--dh", "8,32", "--queries", "128", "--keys", "64", "--format", "markdown", "--output", str(out))
    assert result.exit_code == 0
    text = out.read_text()
    assert "| Dh | raw std |" in text and "raw_entropy_falling" in text
    result = invoke("--dh", "8,32", "--queries", "128", "--keys", "64")
    assert "sqrt(Dh)" in result.stdout and "raw_std_tracks_sqrt_dh" in result.stdout


# --- --tensors ---------------------------------------------------------------------------

def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_tensors_unit_variance_file_passes(tmp_path):
    path = tmp_path / "qk.pt"
    save_tensor_file({"q": torch.randn(2, 64, 16, generator=_gen()), "k": torch.randn(2, 64, 16, generator=_gen(1))}, path)
    result = invoke("--tensors", str(path), "--format", "json")
    assert result.exit_code == 0, result.output
    doc = as_json(result)
    assert doc["mode"] == "tensors" and doc["rows"][0]["dh"] == 16
    assert doc["saturated_rows"] == 0 and doc["total_rows"] == 128
    assert doc["dtype_max"] is None
    assert checks_by_name(doc)["saturated_rows"]["ok"] is True


def test_tensors_saturating_file_raises_the_flag(tmp_path):
    path = tmp_path / "qk.safetensors"
    q = torch.randn(1, 2, 32, 8, generator=_gen()) * 6  # [B, Nh, Tq, Dh]: std 36 after scaling
    k = torch.randn(1, 1, 32, 8, generator=_gen(1)) * 6  # [B, Nkv, Tk, Dh]
    save_tensor_file({"q": q, "k": k}, path)
    result = invoke("--tensors", str(path), "--format", "json")
    assert result.exit_code == 1
    doc = as_json(result)
    assert doc["verdict"] == "fail" and doc["saturated_rows"] > 0
    assert checks_by_name(doc)["saturated_rows"]["ok"] is False


@pytest.mark.parametrize("size, ok", [(1.0, True), (60.0, False)], ids=["roomy", "near-limit"])
def test_tensors_float16_headroom(tmp_path, size, ok):
    path = tmp_path / "qk.npz"
    q = (torch.randn(1, 16, 64, generator=_gen()).abs() * size).half()
    k = (torch.randn(1, 16, 64, generator=_gen(1)).abs() * size).half()
    save_tensor_file({"q": q, "k": k}, path)
    result = invoke("--tensors", str(path), "--format", "json")
    doc = as_json(result)
    headroom = checks_by_name(doc)["score_headroom"]
    assert doc["dtype_max"] == 65504.0
    assert headroom["ok"] is ok
    if not ok:
        assert result.exit_code == 1 and doc["headroom_factor"] < 16


@pytest.mark.parametrize(
    "tensors, needle",
    [
        ({"query": torch.randn(1, 4, 8), "k": torch.randn(1, 4, 8)}, "expected tensors named 'q' and 'k'"),
        ({"q": torch.randn(4, 8), "k": torch.randn(4, 8)}, "expected [B, T, Dh] or [B, Nh, T, Dh]"),
        ({"q": torch.full((1, 4, 8), float("nan")), "k": torch.randn(1, 4, 8)}, "NaN/inf"),
        ({"q": torch.randn(1, 4, 8), "k": torch.randn(1, 4, 6)}, "expected the same B and Dh"),
        ({"q": torch.randn(1, 3, 4, 8), "k": torch.randn(1, 2, 4, 8)}, "expected Nkv to divide Nh"),
        ({"q": torch.ones(1, 4, 8, dtype=torch.int64), "k": torch.randn(1, 4, 8)}, "floating-point"),
    ],
    ids=["no-q", "rank-2", "nan", "dh-mismatch", "nkv", "int"],
)
def test_tensors_bad_input_exits_2_and_writes_nothing(tmp_path, tensors, needle):
    path = tmp_path / "bad.pt"
    torch.save(tensors, path)
    out = tmp_path / "out.json"
    result = invoke("--tensors", str(path), "--format", "json", "--output", str(out))
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dh", "8,abc"], "--dh: got '8,abc'"),
        (["--dh", "0"], "between 1 and"),
        (["--dh", "8,8"], "distinct"),
        (["--queries", "1"], "--queries: got 1"),
        (["--tensors", "missing.pt"], "file not found"),
    ],
    ids=["not-int", "zero", "duplicate", "queries", "missing-file"],
)
def test_bad_options_exit_2(args, needle):
    result = invoke(*args)
    assert result.exit_code == 2
    assert needle in result.stderr


# --- --plot ------------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    png = tmp_path / "scale.png"
    result = invoke("--dh", "8,32", "--queries", "64", "--keys", "64", "--plot", str(png), "--format", "json")
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert as_json(result)["plot"] == str(png)


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    png = tmp_path / "scale.png"
    result = invoke("--dh", "8,32", "--plot", str(png))
    assert result.exit_code == 2
    assert "pip install 'attn-ledger[plot]'" in result.stderr
    assert not png.exists()


def test_help_names_the_options():
    result = runner.invoke(app, ["sweep-scale", "--help"])
    assert result.exit_code == 0
    for opt in ("--dh", "--queries", "--keys", "--seed", "--tensors", "--plot", "--format", "--output"):
        assert opt in result.stdout
