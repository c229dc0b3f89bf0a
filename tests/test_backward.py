"""The backward stages (run --grad): seed 000's reverse-mode numbers, the fault table, every check passing
and failing, saved gradients, streaming, and the options that say no."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.maths import pipeline as P
from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.engine.backward import GRADCHECK_TOL
from attn_ledger.ledger import config_stages, ledger_on_qkv, run_ledger, tensor_stages
from attn_ledger.render.notes import note_text, notes_text

runner = CliRunner()
SEED000 = "fixtures/tensors/seed000.safetensors"

# seed 000: O-bar = I on its worked Q, K, V; the gradients to six decimals
Q_BAR = [[0.079000, -0.039500], [-0.014389, 0.007195]]
K_BAR = [[-0.007195, 0.062847], [0.007195, -0.062847]]
V_BAR = [[0.014166, 0.999151], [0.985834, 0.000849]]


def seed000():
    q = torch.tensor([[[0.0, 3.0], [2.0, -1.0]]], dtype=torch.float64)
    k = torch.tensor([[[3.0, 0.0], [-1.0, 2.0]]], dtype=torch.float64)
    v = torch.tensor([[[3.0, -3.0], [1.0, 3.0]]], dtype=torch.float64)
    return q, k, v


def run_json(*args: str) -> tuple[int, dict]:
    r = runner.invoke(app, ["run", *args, "--format", "json"])
    return r.exit_code, json.loads(r.stdout)


def test_seed000_gradients_to_six_decimals_from_the_json():
    code, doc = run_json("--tensors", SEED000, "--grad", "--grad-output", "identity")
    assert code == 0 and doc["verdict"] == "pass"
    arrays = doc["details"]["arrays"]
    for name, want in (("grad_q", Q_BAR), ("grad_k", K_BAR), ("grad_values", V_BAR)):
        got = arrays[name][0]  # one head: [B, T, D]
        assert [[round(x, 6) for x in row] for row in got] == want, name
    assert arrays["grad_context"] == [[[1.0, 0.0], [0.0, 1.0]]]  # O-bar = I
    assert [r["name"] for r in doc["rows"]] == list(tensor_stages(grad=True))


def test_seed000_gradcheck_twelve_coordinates_within_2e_6():
    led = ledger_on_qkv(*seed000(), grad=True, grad_output="identity")
    checks = [led.check(stage, "gradcheck") for stage in ("grad_q", "grad_k", "grad_values")]
    assert sum(c.data["coordinates"] for c in checks) == 12
    assert all(c.status == "pass" and c.value <= 2e-6 and c.limit == GRADCHECK_TOL == 2e-6 for c in checks)
    assert all(c.data["step"] == 1e-6 for c in checks)


def test_seed000_single_token_weight_one_and_zero_gradients():
    q, k, v = seed000()
    value = torch.tensor([[[5.0, -2.0]]], dtype=torch.float64)
    led = ledger_on_qkv(q[:, :1], k[:, :1], value, grad=True)
    assert led.first_finding is None
    assert torch.equal(led.tensors["weights"][0, 0], torch.ones(1, 1, dtype=torch.float64))
    assert torch.equal(led.tensors["context"][0, 0], value[0])
    assert torch.equal(led.tensors["grad_q"], torch.zeros_like(led.tensors["grad_q"]))
    assert torch.equal(led.tensors["grad_k"], torch.zeros_like(led.tensors["grad_k"]))
    props = led.row("properties")
    assert props.check("single_token").value == 0 and props.check("single_token_zero_grad").value == 0


def test_the_backward_matches_autograd_on_a_healthy_config():
    led = run_ledger(load_config(overrides={"grad": True}))
    assert led.first_finding is None
    assert [r.name for r in led.rows] == list(config_stages(grad=True))
    for stage in ("grad_weights", "grad_values", "grad_scores", "grad_q", "grad_k", "grad_projections", "grad_input"):
        c = led.check(stage, "matches_reference")
        assert c.status == "pass" and c.value < 1e-5, (stage, c)


# --- the fault table ---------------------------------------------------------------------------

FAULTS = [
    ("softmax-backward-no-rowsum", {}, "grad_scores", 3, "softmax_row_rule"),
    ("grad-k-no-scale", {}, "grad_k", 4, "matches_reference"),
    ("grad-values-untransposed", {"query_len": 3, "key_len": 5}, "grad_values", 1, "computes"),
    ("grad-values-untransposed", {}, "grad_values", 4, "matches_reference"),
]


@pytest.mark.parametrize("fault,extra,row,level,check", FAULTS, ids=[f"{f}{'-cross' if e else ''}" for f, e, *_ in FAULTS])
def test_backward_fault_is_caught_where_the_table_says(fault, extra, row, level, check):
    led = run_ledger(load_config(overrides={"fault": fault, "grad": True, **extra}))
    f = led.first_finding
    assert (f.row, f.level, f.name) == (row, level, check)
    for name in ("grad_context", "grad_weights"):
        assert led.row(name).status == "pass"


def test_sdpa_gradients_stream_over_query_groups_and_still_see_a_wrong_k_bar(monkeypatch):
    # a padded relation over more query rows than one SDPA group: SDPA autograd runs group by group
    # (the mask never built for the whole grid), K-bar and V-bar summed over the groups
    from attn_ledger.engine.backward import Backward

    groups = []
    by_group = Backward._sdpa_grads_by_group

    def counted(self):
        groups.append(len(self.plan.sdpa_groups))
        return by_group(self)

    monkeypatch.setattr(Backward, "_sdpa_grads_by_group", counted)
    sizes = {"seq_len": 1100, "mask": "padding", "valid_lengths": [1100, 900], "grad": True, "embed_dim": 16,
             "num_heads": 2}

    def sdpa_checks(**extra):
        report = run_ledger(load_config(None, {**sizes, **extra}), keep_going=True)
        return {row.name: c for row in report.rows for c in row.checks
                if c.name == "matches_sdpa" and row.name in ("grad_q", "grad_k", "grad_values")}

    healthy = sdpa_checks()
    assert groups and groups[0] >= 2
    assert {name: c.status for name, c in healthy.items()} == dict.fromkeys(("grad_q", "grad_k", "grad_values"), "pass")
    broken = sdpa_checks(fault="grad-k-no-scale")
    assert broken["grad_k"].status == "fail" and broken["grad_q"].status == "pass"


def test_detection_does_not_depend_on_the_fault_name():
    """The same broken function swapped in under no fault name is caught where the named fault is."""
    ops = replace(P.HEALTHY, softmax_backward=P.ops_for("softmax-backward-no-rowsum").softmax_backward)
    led = run_ledger(load_config(overrides={"grad": True}), ops=ops)
    assert (led.first_finding.row, led.first_finding.name) == ("grad_scores", "softmax_row_rule")
    assert led.check("grad_scores", "softmax_row_rule").location is not None


def test_the_row_rule_passes_and_gradcheck_fails_without_the_row_sum():
    healthy = run_ledger(load_config(overrides={"grad": True}))
    broken = run_ledger(load_config(overrides={"grad": True, "fault": "softmax-backward-no-rowsum"}), keep_going=True)
    assert healthy.check("grad_scores", "softmax_row_rule").status == "pass"
    assert broken.check("grad_scores", "softmax_row_rule").status == "fail"
    assert broken.check("grad_scores", "softmax_row_rule").value > 1e-3
    for stage in ("grad_q", "grad_k"):
        assert healthy.check(stage, "gradcheck").status == "pass"
        assert broken.check(stage, "gradcheck").status == "downstream"
        assert broken.check(stage, "gradcheck").value > 1e-3


# --- each check failing on a case built to break it ---------------------------------------------------

def _plus(fn, amount):
    return lambda *a: fn(*a) + amount


def _nan_at_first(fn):
    def broken(*a):
        t = fn(*a).clone()
        t.view(-1)[0] = math.nan
        return t
    return broken


BROKEN = [
    ("grad_weights", "finite", {"grad_weights": _nan_at_first(P.grad_weights)}, {}),
    ("grad_weights", "matches_reference", {"grad_weights": _plus(P.grad_weights, 0.01)}, {}),
    ("grad_values", "finite", {"grad_values": _nan_at_first(P.grad_values)}, {}),
    ("grad_values", "blocked_keys_zero", {"grad_values": _plus(P.grad_values, 0.01)},
     {"mask": "padding", "valid_lengths": [5, 3]}),
    ("grad_values", "matches_sdpa", {"grad_values": _plus(P.grad_values, 0.01)}, {}),
    ("grad_values", "gradcheck", {"grad_values": _plus(P.grad_values, 0.01)}, {}),
    ("grad_scores", "finite", {"softmax_backward": _nan_at_first(P.softmax_backward)}, {}),
    ("grad_q", "finite", {"grad_q": _nan_at_first(P.grad_q)}, {}),
    ("grad_q", "matches_reference", {"grad_q": lambda gs, k, scale: P.grad_q(gs, k, 2 * scale)}, {}),
    ("grad_q", "matches_sdpa", {"grad_q": lambda gs, k, scale: P.grad_q(gs, k, 2 * scale)}, {}),
    ("grad_q", "gradcheck", {"grad_q": lambda gs, k, scale: P.grad_q(gs, k, 2 * scale)}, {}),
    ("grad_k", "finite", {"grad_k": _nan_at_first(P.grad_k)}, {}),
    ("grad_k", "blocked_keys_zero", {"grad_k": _plus(P.grad_k, 0.01)}, {"mask": "padding", "valid_lengths": [5, 3]}),
    ("grad_k", "key_sum_zero", {"grad_k": _plus(P.grad_k, 0.01)}, {}),
    ("grad_k", "matches_sdpa", {"grad_k": P.ops_for("grad-k-no-scale").grad_k}, {}),
    ("grad_k", "gradcheck", {"grad_k": P.ops_for("grad-k-no-scale").grad_k}, {}),
    ("grad_projections", "matches_reference", {"grad_k": P.ops_for("grad-k-no-scale").grad_k}, {}),
    ("grad_projections", "matches_sdpa", {"grad_k": P.ops_for("grad-k-no-scale").grad_k}, {}),
    ("grad_input", "matches_reference", {"grad_q": lambda gs, k, scale: P.grad_q(gs, k, 2 * scale)}, {}),
    ("grad_input", "matches_sdpa", {"grad_q": lambda gs, k, scale: P.grad_q(gs, k, 2 * scale)}, {}),
    ("grad_context", "matches_reference", {"split": P.ops_for("split-reshape").split}, {}),
]


@pytest.mark.parametrize("stage,check,swap,extra", BROKEN, ids=[f"{s}.{c}" for s, c, *_ in BROKEN])
def test_backward_check_fails_on_a_case_built_to_break_it(stage, check, swap, extra):
    cfg = load_config(overrides={"grad": True, **extra})
    broken = run_ledger(cfg, keep_going=True, ops=replace(P.HEALTHY, **swap)).check(stage, check)
    assert broken.status in ("fail", "downstream"), broken
    assert run_ledger(cfg, keep_going=True).check(stage, check).status == "pass"


def test_blocked_keys_get_exactly_zero_gradients():
    led = run_ledger(load_config(overrides={"grad": True, "mask": "padding", "valid_lengths": [5, 3]}))
    assert led.first_finding is None
    for stage in ("grad_values", "grad_k"):
        assert led.check(stage, "blocked_keys_zero").value == 0
    assert (led.tensors["grad_k"][1, :, 3:] == 0).all() and (led.tensors["grad_values"][1, :, 3:] == 0).all()
    assert run_ledger(load_config(overrides={"grad": True})).check("grad_k", "blocked_keys_zero").status == "not_applicable"


def test_a_backward_stage_that_raises_is_level_one_and_stops_there():
    def raising(*a):
        raise RuntimeError("no backward here")

    led = run_ledger(load_config(overrides={"grad": True}), ops=replace(P.HEALTHY, grad_q=raising))
    f = led.first_finding
    assert (f.row, f.level, f.name) == ("grad_q", 1, "computes") and "no backward here" in f.check.reason
    assert led.row("grad_k").status == "not_reached"


def test_a_backward_stage_of_the_wrong_shape_is_level_one():
    led = run_ledger(load_config(overrides={"grad": True}),
                     ops=replace(P.HEALTHY, grad_weights=lambda go, v: P.grad_weights(go, v)[..., :-1]))
    f = led.first_finding
    assert (f.row, f.level, f.name) == ("grad_weights", 1, "shape")
    assert f.check.data["expected"] == [2, 3, 5, 5] and f.check.data["got"] == [2, 3, 5, 4]


# --- configs: GQA, cross-attention, rope, dtypes, blocks --------------------------------------------

@pytest.mark.parametrize("extra", [
    {"num_heads": 4, "num_kv_heads": 2, "embed_dim": 16},
    {"query_len": 3, "key_len": 7},
    {"rope": "half", "query_len": 3, "key_len": 6},
    {"rope": "interleaved,dim=2"},
    {"mask": "sliding-window", "window": 2},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"dtype": "float64"},
    {"dtype": "bfloat16"},
    {"value_dim": 3},
], ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_healthy_backward_passes(extra):
    led = run_ledger(load_config(overrides={"grad": True, **extra}))
    assert led.first_finding is None, led.first_finding


def test_streamed_backward_equals_the_one_block_backward():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 96, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole = ledger_on_qkv(q, k, v, mask="causal", grad=True)
    blocked = ledger_on_qkv(q, k, v, mask="causal", grad=True, block_size=32)
    assert whole.first_finding is None and blocked.first_finding is None
    assert any("3 query blocks" in n for n in notes_text(blocked))
    for name in ("grad_q", "grad_k", "grad_values"):
        torch.testing.assert_close(blocked.tensors[name], whole.tensors[name], rtol=1e-12, atol=1e-12)


def test_sampled_rows_compare_the_part_of_k_bar_they_contribute():
    big = {"grad": True, "seq_len": 512, "embed_dim": 32, "num_heads": 4}  # over the float64 budget: rows sampled
    led = run_ledger(load_config(overrides=big))
    assert led.first_finding is None
    assert "sampled rows" in led.check("grad_k", "matches_reference").measure
    assert "sampled rows" in led.check("grad_projections", "matches_reference").measure
    f = run_ledger(load_config(overrides={**big, "fault": "grad-k-no-scale"})).first_finding
    assert (f.row, f.level, f.name) == ("grad_k", 4, "matches_reference")


# --- saved gradients -----------------------------------------------------------------------------

def _autograd(q, k, v, go):
    with torch.enable_grad():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
        return torch.autograd.grad(out, leaves, go)


def test_saved_gradients_are_compared_with_the_backward_stages():
    q, k, v = (t[:, None] for t in seed000())
    go = torch.eye(2, dtype=torch.float64)[None, None]
    dq, dk, dv = _autograd(q, k, v, go)
    led = ledger_on_qkv(q, k, v, grad=True, grads={"grad_out": go, "dq": dq, "dk": dk, "dv": dv})
    assert led.first_finding is None
    for name, stage in (("dq", "grad_q"), ("dk", "grad_k"), ("dv", "grad_values")):
        assert led.check(stage, f"user_{name}_matches_reference").status == "pass"
        assert led.check(stage, f"user_{name}_matches_sdpa").status == "pass"
    bad = ledger_on_qkv(q, k, v, grad=True, grads={"grad_out": go, "dq": dq, "dk": dk / math.sqrt(2), "dv": dv})
    f = bad.first_finding
    assert (f.row, f.level, f.name) == ("grad_k", 4, "user_dk_matches_reference")


@pytest.mark.parametrize("name,stage", [("dq", "grad_q"), ("dk", "grad_k"), ("dv", "grad_values"),
                                        ("grad_out", "grad_context")])
def test_a_saved_gradient_of_the_wrong_shape_is_an_l1_finding(name, stage):
    q, k, v = seed000()  # one head: [B, T, D]
    led = ledger_on_qkv(q, k, v, grad=True, grads={name: torch.zeros(1, 2, 3, dtype=torch.float64)})
    f = led.first_finding
    assert (f.row, f.level, f.name) == (stage, 1, f"user_{name}_shape")
    assert f.check.data["got"] == [1, 2, 3] and f.check.data["expected"] == [1, 2, 2]


def test_saved_gradients_from_a_file(tmp_path):
    q, k, v = (t[:, None].float() for t in seed000())
    go = torch.eye(2)[None, None]
    dq, dk, dv = _autograd(q, k, v, go)
    path = tmp_path / "grads.pt"
    torch.save({"q": q, "k": k, "v": v, "grad_out": go, "dq": dq, "dk": dk, "dv": dv * 2}, path)
    code, doc = run_json("--tensors", str(path), "--grad")
    assert code == 1
    assert (doc["first_finding"]["row"], doc["first_finding"]["check"]) == ("grad_values", "user_dv_matches_reference")
    r = runner.invoke(app, ["run", "--tensors", str(path)])
    assert r.exit_code == 2 and "--grad" in r.stderr  # saved gradients without --grad: nothing would compare them


def test_grad_output_from_a_file(tmp_path):
    seed = tmp_path / "seed.pt"
    torch.save({"grad_out": torch.eye(2)[None]}, seed)
    code, doc = run_json("--tensors", SEED000, "--grad", "--grad-output", str(seed))
    assert code == 0
    assert [[round(x, 6) for x in row] for row in doc["details"]["arrays"]["grad_q"][0]] == Q_BAR
    torch.save({"grad_out": torch.ones(1, 3, 2)}, seed)
    r = runner.invoke(app, ["run", "--tensors", SEED000, "--grad", "--grad-output", str(seed)])
    assert r.exit_code == 2 and "grad_output" in r.stderr and "[1, 3, 2]" in r.stderr


# --- options that say no -----------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--grad-output", "ones"], "grad_output"),
    (["--tensors", SEED000, "--grad-output", "identity"], "grad_output"),
    (["--fault", "grad-k-no-scale"], "fault"),
    (["--fault", "rope-on-v"], "fault"),
    (["--grad", "--grad-output", "identity"], "Tq == Dv"),  # default config: Tq = 5, Dv = 4
    (["--tensors", SEED000, "--grad", "--grad-output", "nothing.pt"], "grad_output"),
])
def test_options_the_mode_does_not_use_are_refused(args, needle):
    r = runner.invoke(app, ["run", *args])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and needle in err


def test_identity_seed_on_a_config_where_tq_equals_dv():
    from attn_ledger.engine.given import grad_seed

    led = run_ledger(load_config(overrides={"grad": True, "grad_output": "identity", "seq_len": 4}))
    assert led.first_finding is None and "identity" in note_text(led.row("grad_context").note)
    seed = grad_seed("identity", (2, 4, 12), torch.float32, torch.device("cpu"), heads=3)  # [B, Tq, E]
    heads = seed.reshape(2, 4, 3, 4).transpose(1, 2)  # [B, Nh, Tq, Dv]
    assert torch.equal(heads, torch.eye(4).expand(2, 3, 4, 4))
