"""The ledger's stage tensors against float64 by the rounding rule ``|err| <= c * eps * M``.

A healthy pipeline sits well within the bound at each stage, with the rule's parts as data; a pipeline
or a given tensor off by a few times the rounding error fails at the stage it is off at, and the
sentence names the parts.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from attn_ledger import tolerance
from attn_ledger.inputs.config import load_config
from attn_ledger.engine import rounding
from attn_ledger.ledger import run_ledger, run_ledger_tensors
from attn_ledger.maths.pipeline import HEALTHY, qk_scores
from attn_ledger.render.jsondoc import report_json
from attn_ledger.render.text import describe

STAGES = ("scores", "weights", "context")


def reference_checks(report, of: str = "matches_reference"):
    return {row.name: c for row in report.rows for c in row.checks if c.name == of}


@pytest.mark.parametrize("overrides", [
    {},
    {"dtype": "float64"},
    {"embed_dim": 64, "num_heads": 4, "num_kv_heads": 2, "seq_len": 33, "mask": "sliding-window", "window": 4},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"softcap": 1.0, "scale": 2.0},
], ids=["default", "float64", "gqa-window", "empty-rows", "softcap"])
def test_a_healthy_pipeline_sits_within_half_its_rounding_bound(overrides):
    report = run_ledger(load_config(overrides=overrides))
    assert report.exit_code == 0
    checks = reference_checks(report)
    for stage in STAGES:
        parts = checks[stage].data["tolerance"]
        assert parts["rule"] == "c * eps * M" and parts["stage"] == stage
        assert parts["dtype"] == overrides.get("dtype", "float32")
        assert parts["c"] == tolerance.rounding_c(rounding.QUANTITY[stage], parts["dtype"])
        assert parts["eps"] == tolerance.EPS[parts["dtype"]]
        assert parts["ratio"] <= 0.5, (stage, parts)


def _ops_scaled(factor: float):
    return replace(HEALTHY, scores=lambda q, k, scale: qk_scores(q, k, scale) * factor)


def test_scores_off_by_a_few_rounding_errors_fail_at_the_scores_stage_with_the_parts_named():
    eps = tolerance.EPS["float32"]
    report = run_ledger(load_config(), ops=_ops_scaled(1 + 64 * eps))
    assert report.exit_code == 1
    finding = report.first_finding
    assert (finding.row, finding.check.name) == ("scores", "matches_reference")
    parts = finding.check.data["tolerance"]
    assert parts["ratio"] > 1 and parts["error"] > parts["bound"] == pytest.approx(parts["c"] * parts["eps"] * parts["M"])
    text = describe(finding.check)
    assert "worst element: error" in text and "bound c 2 x eps 1.19e-07 x M" in text
    doc = json.loads(json.dumps(report_json(report)))  # the parts are data in the JSON too
    assert "bound c 2 x eps 1.19e-07 x M" in doc["first_finding"]["message"]
    row = next(r for r in doc["rows"] if r["name"] == "scores")
    data = next(c for c in row["checks"] if c["name"] == "matches_reference")["data"]["tolerance"]
    assert {k: data[k] for k in ("error", "bound", "c", "eps", "M")} == pytest.approx(
        {k: parts[k] for k in ("error", "bound", "c", "eps", "M")})


def test_the_same_scores_off_by_a_fraction_of_a_rounding_error_pass():
    report = run_ledger(load_config(), ops=_ops_scaled(1 + tolerance.EPS["float32"] / 4))
    assert report.exit_code == 0


@pytest.mark.parametrize("nudge, verdict", [(0.0, 0), (1e-5, 1)], ids=["sdpa-out", "out-nudged-1e-5"])
def test_a_given_out_is_judged_by_the_rounding_rule(tmp_path, nudge, verdict):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = out + nudge * out.abs().amax()
    path = tmp_path / "t.pt"
    torch.save({"q": q, "k": k, "v": v, "out": out}, path)
    report = run_ledger_tensors(str(path))
    assert report.exit_code == verdict
    check = reference_checks(report, "user_out_matches_reference")["context"]
    parts = check.data["tolerance"]
    assert parts["rule"] == "c * eps * M" and parts["stage"] == "context"
    assert (parts["ratio"] > 1) == bool(verdict)


# --- the backward's stage tensors (run --grad) -------------------------------------------------

GRAD_STAGES = ("grad_context", "grad_weights", "grad_values", "grad_scores", "grad_q", "grad_k")


@pytest.mark.parametrize("overrides", [
    {},
    {"dtype": "float64"},
    {"embed_dim": 64, "num_heads": 4, "num_kv_heads": 2, "seq_len": 33, "mask": "sliding-window", "window": 4},
    {"rope": {"pairing": "half"}, "softcap": 1.0, "scale": 2.0},
    {"dtype": "float16", "mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"dtype": "bfloat16", "mask": "causal"},
], ids=["default", "float64", "gqa-window", "rotary-softcap", "float16-empty-rows", "bfloat16-causal"])
def test_a_healthy_backward_sits_within_half_its_rounding_bound(overrides):
    report = run_ledger(load_config(overrides={**overrides, "grad": True}))
    assert report.exit_code == 0, report.first_finding
    checks = reference_checks(report)
    dtype = overrides.get("dtype", "float32")
    for stage in (*STAGES, *GRAD_STAGES):  # half precision too: the forward's stages follow the same rule
        parts = checks[stage].data["tolerance"]
        assert parts["rule"] == "c * eps * M" and parts["stage"] == stage and parts["dtype"] == dtype
        assert parts["c"] == tolerance.rounding_c(rounding.QUANTITY[stage], dtype)
        assert parts["ratio"] <= 0.5, (stage, parts)


def _grad_scaled(field: str, factor: float):
    fn = getattr(HEALTHY, field)
    return replace(HEALTHY, **{field: lambda *a, **kw: fn(*a, **kw) * factor})


GRAD_OPS = [("grad_weights", "grad_weights"), ("grad_values", "grad_values"), ("softmax_backward", "grad_scores"),
            ("grad_q", "grad_q"), ("grad_k", "grad_k")]


@pytest.mark.parametrize("field, stage", GRAD_OPS, ids=[s for _, s in GRAD_OPS])
def test_a_gradient_off_by_rounding_errors_fails_at_its_stage_with_the_parts_named(field, stage):
    """256 float32 rounding units of the gradient's own size: past the bound at that stage, and first there."""
    report = run_ledger(load_config(overrides={"grad": True}), ops=_grad_scaled(field, 1 + 256 * tolerance.EPS["float32"]))
    assert report.exit_code == 1
    finding = report.first_finding
    assert (finding.row, finding.check.name) == (stage, "matches_reference")
    parts = finding.check.data["tolerance"]
    assert parts["stage"] == stage and parts["ratio"] > 1
    assert parts["error"] > parts["bound"] == pytest.approx(parts["c"] * parts["eps"] * parts["M"])
    text = describe(finding.check)
    assert "worst element: error" in text and f"bound c {parts['c']:g} x eps 1.19e-07 x M" in text


@pytest.mark.parametrize("field, stage", GRAD_OPS, ids=[s for _, s in GRAD_OPS])
def test_the_same_gradient_off_by_a_fraction_of_a_rounding_error_passes(field, stage):
    report = run_ledger(load_config(overrides={"grad": True}), ops=_grad_scaled(field, 1 + tolerance.EPS["float32"] / 4))
    assert report.exit_code == 0, report.first_finding


def test_a_saved_gradient_is_judged_by_the_rounding_rule(tmp_path):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g).requires_grad_(True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    go = torch.randn(out.shape, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    path = tmp_path / "t.pt"
    base = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "grad_out": go, "dk": dk, "dv": dv}
    torch.save({**base, "dq": dq}, path)
    good = run_ledger_tensors(str(path), grad=True)
    assert good.exit_code == 0, good.first_finding
    parts = reference_checks(good, "user_dq_matches_reference")["grad_q"].data["tolerance"]
    assert parts["rule"] == "c * eps * M" and parts["ratio"] <= 0.5
    torch.save({**base, "dq": dq * (1 + 1e-3)}, path)
    bad = run_ledger_tensors(str(path), grad=True)
    check = reference_checks(bad, "user_dq_matches_reference")["grad_q"]
    assert check.status == "fail" and check.data["tolerance"]["ratio"] > 1


@pytest.mark.parametrize("case", ["causal", "empty-rows", "softcap", "sinks", "gqa-chunked"])
def test_m_beside_the_reference_is_m_computed_alone(monkeypatch, case):
    """The sampled rows' M, computed head chunk by head chunk from the reference's own casts, scores and
    weights, leaving out the terms of a pipeline tensor that is the reference's own, equals M computed
    apart from the reference with every term, bit for bit."""
    from attn_ledger.engine import execute as X
    from attn_ledger.maths import masks

    g = torch.Generator().manual_seed(7)
    nh, nkv = (4, 2) if case == "gqa-chunked" else (4, 4)
    q = torch.randn(2, nh, 6, 8, generator=g)
    k, v = torch.randn(2, nkv, 9, 8, generator=g), torch.randn(2, nkv, 9, 5, generator=g)
    allow = masks.causal(6, 9, "bottom-right")[None, None].expand(2, nh, 6, 9).clone()
    if case == "empty-rows":
        allow[0, :, 1] = False
    softcap = 2.0 if case == "softcap" else None
    sinks = torch.linspace(-1.0, 1.0, nh) if case == "sinks" else None
    if case == "gqa-chunked":
        monkeypatch.setattr(X, "REF_CHUNK_BYTES", 1)  # one kv head at a time
    k_exp, v_exp = HEALTHY.expand(k, nh), HEALTHY.expand(v, nh)
    eps, tiny = tolerance.EPS["float32"], tolerance.tiny("float32")
    carried = (None, None if nh == nkv else k_exp, None if nh == nkv else v_exp)
    ref, mags = X.reference_chunks(q, k, v, allow, 0.3, "zeros", torch.float64, softcap, sinks,
                                   X.Rule(carried, eps, tiny, 1.0))
    alone = rounding.stage_magnitudes(q, k, v, allow, 0.3, softcap, (q, k_exp, v_exp), eps, tiny)
    for key in ("scores", "weights", "out"):
        assert torch.equal(mags[key], alone[key]), key
    assert torch.equal(ref["out"], X.reference_block(q, k, v, allow, 0.3, "zeros", torch.float64, softcap, sinks)["out"])


def test_m_takes_magnitudes_in_place_only_on_its_own_copies():
    """float32 K and V are cast to float64 copies, which M may overwrite; float64 K and V are the caller's own
    tensors, which it must leave as they were (and M is the same either way)."""
    from attn_ledger.engine import execute as X

    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64), torch.randn(1, 2, 7, 5, generator=g, dtype=torch.float64)
    k0, v0 = k.clone(), v.clone()
    rule = X.Rule((None, None, None), tolerance.EPS["float32"], 0.0, 1.0)
    _, mags64 = X.reference_chunks(q, k, v, None, 0.3, "zeros", torch.float64, rule=rule)
    assert torch.equal(k, k0) and torch.equal(v, v0)  # no |K| written over the caller's K
    kf, vf = k.float(), v.float()
    kf0 = kf.clone()
    _, mags32 = X.reference_chunks(q.float(), kf, vf, None, 0.3, "zeros", torch.float64, rule=rule)
    assert torch.equal(kf, kf0)  # the float64 copy was overwritten, not the float32 input
    alone = rounding.stage_magnitudes(q.float(), kf, vf, None, 0.3, None, None, rule.eps, 0.0)
    for key in ("scores", "weights", "out"):
        assert torch.equal(mags32[key], alone[key]), key
    assert mags64["out"].shape == mags32["out"].shape


def test_m_carries_a_pipeline_tensor_that_is_not_the_references_own():
    """A pipeline q that differs from the reference's raises M of the scores by its carried terms."""
    from attn_ledger.engine import execute as X

    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    eps = tolerance.EPS["float32"]
    own = X.reference_chunks(q, k, v, None, 0.3, "zeros", torch.float64, rule=X.Rule((None, None, None), eps, 0.0, 1.0))[1]
    off = X.reference_chunks(q, k, v, None, 0.3, "zeros", torch.float64,
                             rule=X.Rule((q + 1e-3, None, None), eps, 0.0, 1.0))[1]
    assert bool((off["scores"] > own["scores"]).all())
    assert bool((off["out"] > own["out"]).all())  # through the weights' bound


def test_the_rule_reads_non_finite_values_as_it_always_did():
    """NaN against NaN and equal infinities agree; a NaN against a number, or any error where the bound is
    zero, is infinitely past it; finite values within their bounds pass, with the worst element's parts."""
    import math

    ref = torch.tensor([[[[1.0, 2.0, 3.0]]]], dtype=torch.float64)  # [B, Nh, R, Tk]
    m = torch.ones_like(ref)
    c, eps = tolerance.rounding("scores", "float32")
    within = rounding.agreement("scores", "pipeline", ref + 0.5 * c * eps, ref, m, "float32")
    assert within.excess == pytest.approx(-0.5) and within.parts["ratio"] == pytest.approx(0.5)
    both = torch.tensor([[[[math.nan, math.inf, 3.0]]]], dtype=torch.float64)
    assert rounding.agreement("scores", "pipeline", both, both.clone(), m, "float32").excess == -1.0
    nan_vs_number = rounding.agreement("scores", "pipeline", both, ref, m, "float32")
    assert math.isinf(nan_vs_number.excess) and nan_vs_number.where is not None
    zero_bound = rounding.agreement("scores", "pipeline", ref + 1e-9, ref, torch.zeros_like(ref), "float32")
    assert math.isinf(zero_bound.excess)


# --- the built-in pipeline's last backward rows: the projection weights' and the input's gradients ----------

CHAIN_STAGES = ("grad_projections", "grad_input")
CHAIN_CONFIGS = [
    {},
    {"dtype": "float64"},
    {"query_len": 3, "key_len": 7},  # cross-attention: x-bar and x_kv-bar
    {"embed_dim": 64, "num_heads": 4, "num_kv_heads": 2, "seq_len": 33, "mask": "sliding-window", "window": 4},
    {"rope": "half", "softcap": 1.0, "scale": 2.0},
    {"seq_len": 512, "embed_dim": 32, "num_heads": 4},  # over the float64 budget: the rows are sampled
    {"dtype": "float16", "mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"dtype": "bfloat16", "mask": "causal"},
]
CHAIN_IDS = ["default", "float64", "cross", "gqa-window", "rotary-softcap", "sampled", "float16-empty-rows",
             "bfloat16-causal"]


def chain_ratios(report) -> dict[str, dict[str, float]]:
    """Each chain row's float64 comparison: every tensor's worst error / bound, checked to carry the rule's parts."""
    found = {}
    for stage in CHAIN_STAGES:
        check = report.check(stage, "matches_reference")
        parts = check.data["tolerance"]
        assert parts["rule"] == "c * eps * M" and parts["stage"] == stage
        assert parts["c"] == tolerance.rounding_c(stage, parts["dtype"])
        assert parts["bound"] == pytest.approx(parts["c"] * parts["eps"] * parts["M"])
        assert parts["tensor"] in check.data["ratios"] and parts["ratio"] == max(check.data["ratios"].values())
        found[stage] = check.data["ratios"]
    return found


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("overrides", CHAIN_CONFIGS, ids=CHAIN_IDS)
def test_the_projection_and_input_gradients_sit_within_half_their_rounding_bound(overrides, seed):
    report = run_ledger(load_config(overrides={**overrides, "grad": True, "seed": seed}))
    assert report.exit_code == 0, report.first_finding
    ratios = chain_ratios(report)
    assert set(ratios["grad_projections"]) == {"wq", "wk", "wv", "wo"}
    assert set(ratios["grad_input"]) == ({"x", "x_kv"} if "query_len" in overrides else {"x"})
    assert all(r <= 0.5 for per in ratios.values() for r in per.values()), ratios


_CHAIN_SCRIPT = """
import json, sys, torch
from attn_ledger.inputs.config import load_config
from attn_ledger.ledger import run_ledger
out = {"capability": torch.backends.cpu.get_cpu_capability(), "runs": []}
for overrides in json.loads(sys.argv[1]):
    for seed in (0, 1):
        r = run_ledger(load_config(overrides={**overrides, "grad": True, "seed": seed}))
        out["runs"].append({"exit": r.exit_code, "ratios": {s: r.check(s, "matches_reference").data["ratios"]
                                                             for s in ("grad_projections", "grad_input")}})
print(json.dumps(out))
"""


@pytest.mark.parametrize("cap", ["unset", "avx2", "default"])
def test_the_chain_rows_keep_their_margin_at_each_cpu_capability(cap):
    """In a process of its own per capability (torch reads ATEN_CPU_CAPABILITY once)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap != "unset":
        env["ATEN_CPU_CAPABILITY"] = cap
    configs = [CHAIN_CONFIGS[i] for i in (0, 2, 3, 6, 7)]
    done = subprocess.run([sys.executable, "-c", _CHAIN_SCRIPT, json.dumps(configs)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    if cap != "unset" and out["capability"].lower() != cap:
        pytest.skip(f"this machine lacks {cap}: torch runs at {out['capability']}")
    assert len(out["runs"]) == 2 * len(configs) and all(r["exit"] == 0 for r in out["runs"]), out
    worst = max(v for r in out["runs"] for per in r["ratios"].values() for v in per.values())
    assert worst <= 0.5, (out["capability"], worst)


def _chain_scaled(monkeypatch, stage: str, factor: float):
    """The stage's whole computation (every tensor it returns) scaled by ``factor``."""
    from attn_ledger.engine import builtin

    name = {"grad_projections": "grad_projections", "grad_input": "grad_input"}[stage]
    real = getattr(builtin, name)
    monkeypatch.setattr(builtin, name, lambda *a, **kw: {n: t * factor for n, t in real(*a, **kw).items()})


@pytest.mark.parametrize("overrides, units", [({}, 256), ({"dtype": "float16"}, 32), ({"query_len": 3, "key_len": 7}, 256)],
                         ids=["float32", "float16", "cross"])
@pytest.mark.parametrize("stage", CHAIN_STAGES)
def test_a_projection_or_input_gradient_off_by_rounding_errors_fails_at_its_row(monkeypatch, stage, overrides, units):
    """``units`` rounding units of the gradient's own size (0.003% in float32, 3% in float16): past the bound
    at that row, the first finding, its parts named."""
    dtype = overrides.get("dtype", "float32")
    _chain_scaled(monkeypatch, stage, 1 + units * tolerance.EPS[dtype])
    report = run_ledger(load_config(overrides={**overrides, "grad": True}))
    assert report.exit_code == 1
    finding = report.first_finding
    assert (finding.row, finding.check.name) == (stage, "matches_reference")
    parts = finding.check.data["tolerance"]
    assert parts["stage"] == stage and parts["ratio"] > 1 and parts["error"] > parts["bound"]
    text = describe(finding.check)
    assert f"in {parts['tensor']}" in text and f"bound c {parts['c']:g} x eps" in text and "x M" in text


@pytest.mark.parametrize("stage", CHAIN_STAGES)
def test_the_same_projection_or_input_gradient_off_by_a_fraction_of_a_rounding_error_passes(monkeypatch, stage):
    _chain_scaled(monkeypatch, stage, 1 + tolerance.EPS["float32"] / 4)
    report = run_ledger(load_config(overrides={"grad": True}))
    assert report.exit_code == 0, report.first_finding


def test_a_gradient_past_its_own_bound_carries_only_its_bound_to_the_projections():
    """K-bar without the score scale fails at grad_k; the projections' and the input's gradients, computed from
    it, fail after it (downstream) instead of taking its error as rounding they inherit."""
    from attn_ledger.maths import pipeline as P

    report = run_ledger(load_config(overrides={"grad": True}), keep_going=True, ops=P.ops_for("grad-k-no-scale"))
    assert report.first_finding.row == "grad_k"
    for stage in CHAIN_STAGES:
        check = report.check(stage, "matches_reference")
        assert check.status == "downstream" and check.data["tolerance"]["ratio"] > 1
