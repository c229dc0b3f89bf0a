"""``run --sinks S|FILE``: attention sinks (one logit per head, gpt-oss's ``s_aux``) in the ledger.

The sink is one more column of the softmax, in the denominator only, dropped before the mix: in the
pipeline, the float64 reference and SDPA (given it as one more column of its additive mask). The
weights' ``key_row_sums`` count the sink's share and ``sink_share`` checks the keys' weights against
the reference's share. The faults built to break the feature (sink dropped, sink mixed as a value,
a window one key too wide, the soft-cap after the mask) are each caught at their level, and their
healthy counterparts pass.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.engine.backends import sdpa_capped
from attn_ledger.errors import InputError
from attn_ledger.inputs.config import FAULT_NEEDS, load_config
from attn_ledger.inputs.sinks import parse_sinks
from attn_ledger.inputs.tensorio import save_tensor_file
from attn_ledger.ledger import ledger_on_qkv, run_ledger
from attn_ledger.maths.reference import reference_stages
from attn_ledger.probes import catalogue
from attn_ledger.render.notes import notes_text

runner = CliRunner()
SINKS = "0.5,-1,2"


def failing(report) -> list[tuple[str, str]]:
    return [(row.name, c.name) for row in report.rows for c in row.checks if c.failed]


def check(report, stage, name):
    return next(c for c in report.row(stage).checks if c.name == name)


@pytest.mark.parametrize("overrides", [
    {},
    {"sinks": 4.0, "mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},  # example 1 all empty
    {"mask": "none", "seq_len": 9, "block_size": 4},  # several blocks and SDPA groups
    {"mask": "sliding-window", "window": 2, "softcap": 3.0},
    {"num_kv_heads": 1, "dtype": "float64", "replay": True},
    {"dtype": "float16"},
    {"dtype": "bfloat16", "sinks": "-3,0,6"},
], ids=["default", "empty-rows", "blocks", "window-softcap", "gqa-float64-replay", "float16", "bfloat16"])
def test_a_pipeline_with_sinks_passes_with_them_stated(overrides):
    report = run_ledger(load_config(overrides={"sinks": SINKS, **overrides}))
    assert report.exit_code == 0, failing(report)
    assert check(report, "weights", "sink_share").passed
    assert check(report, "weights", "key_row_sums").passed
    assert check(report, "context", "matches_sdpa").passed
    assert report.details["sinks"] == [float(x) for x in parse_sinks(overrides.get("sinks", SINKS), 3)]
    assert any(line.startswith("attention sinks, one logit per head") for line in notes_text(report))


def test_without_sinks_there_is_no_sink_check():
    report = run_ledger(load_config())
    assert report.exit_code == 0
    assert "sink_share" not in [c.name for c in report.row("weights").checks]
    assert "sinks" not in report.details


def test_the_reference_puts_the_sink_in_the_denominator_only():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    allow = torch.ones(4, 4, dtype=torch.bool).tril()
    st = reference_stages(q, k, v, allow_mask=allow, sinks=sinks)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(5)
    e = torch.exp(s).masked_fill(~allow, 0.0)
    denom = e.sum(-1, keepdim=True) + torch.exp(sinks).reshape(1, 3, 1, 1)
    torch.testing.assert_close(st["weights"], e / denom, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["out"], (e / denom) @ v, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["weights"].sum(-1) + st["sink_share"], torch.ones(2, 3, 4, dtype=torch.float64))
    assert float(st["sink_share"].min()) > 0.01  # the sinks take a visible share
    # SDPA given the sink as one more column of its additive mask agrees
    torch.testing.assert_close(sdpa_capped(q, k, v, allow, 1 / math.sqrt(5), None, sinks), st["out"],
                               rtol=1e-10, atol=1e-12)
    # a row with no allowed key gives the sink everything: zero weights, zero context
    dead = reference_stages(q, k, v, allow_mask=torch.zeros(4, 4, dtype=torch.bool), sinks=sinks)
    assert float(dead["weights"].abs().max()) == 0.0 and float(dead["out"].abs().max()) == 0.0


@pytest.mark.parametrize("name", ["sink-dropped", "sink-in-numerator", "softcap-after-mask", "window-too-wide"])
def test_each_new_fault_is_caught_and_its_healthy_counterpart_passes(name):
    needs = FAULT_NEEDS[name]
    healthy = run_ledger(load_config(overrides=needs))
    assert healthy.exit_code == 0, failing(healthy)
    broken = run_ledger(load_config(overrides={"fault": name, **needs}))
    found = broken.first_finding
    expected = {"sink-dropped": ("weights", 3, "key_row_sums"), "sink-in-numerator": ("weights", 3, "key_row_sums"),
                "softcap-after-mask": ("scores", 4, "matches_reference"),
                "window-too-wide": ("masked_scores", 3, "forbidden_excluded")}[name]
    assert (found.row, found.level, found.name) == expected
    row = catalogue.check_fault(next(f for f in catalogue.CATALOGUE if f.name == name))
    assert row.status == "pass" and row.fields["level"] == expected[1] and row.fields["check"] == expected[2]


def test_a_dropped_sink_also_fails_against_the_reference_share():
    report = run_ledger(load_config(overrides={"fault": "sink-dropped", "sinks": SINKS}), keep_going=True)
    assert ("weights", "sink_share") in failing(report)
    assert ("weights", "matches_reference") in failing(report)


@pytest.mark.parametrize("overrides", [
    {},
    {"mask": "sliding-window", "window": 2, "softcap": 3.0, "num_kv_heads": 1},
    {"dtype": "float64", "seq_len": 9, "block_size": 4},
    {"rope": "half", "replay": True},
    {"dtype": "bfloat16"},
], ids=["default", "window-softcap-gqa", "float64-blocks", "rope-replay", "bfloat16"])
def test_the_backward_with_sinks_passes(overrides):
    report = run_ledger(load_config(overrides={"sinks": SINKS, "grad": True, **overrides}))
    assert report.exit_code == 0, failing(report)
    for stage in ("grad_q", "grad_k", "grad_values", "grad_sinks"):
        assert check(report, stage, "matches_reference").passed
    assert check(report, "grad_k", "key_sum_zero").status == "not_applicable"
    parts = check(report, "grad_sinks", "matches_reference").data["tolerance"]
    dtype = overrides.get("dtype", "float32")
    assert parts["rule"] == "c * eps * M" and parts["stage"] == "grad_sinks" and parts["dtype"] == dtype
    assert parts["ratio"] <= 0.5, parts  # a correct pipeline sits within half its bound
    assert report.row("grad_sinks").shape == (3,) and report.row("grad_sinks").axes == "[Nh]"


def test_the_sinks_gradient_row_is_there_only_with_sinks_and_grad():
    names = lambda r: [row.name for row in r.rows]  # noqa: E731
    assert "grad_sinks" not in names(run_ledger(load_config(overrides={"grad": True})))
    assert "grad_sinks" not in names(run_ledger(load_config(overrides={"sinks": SINKS})))
    with_both = names(run_ledger(load_config(overrides={"sinks": SINKS, "grad": True})))
    assert with_both.index("grad_k") + 1 == with_both.index("grad_sinks")


def _grad_sinks(fn):
    from dataclasses import replace

    from attn_ledger.maths.pipeline import HEALTHY

    return replace(HEALTHY, grad_sinks=fn)


def test_a_wrong_sinks_gradient_is_caught_at_its_row():
    from attn_ledger import tolerance
    from attn_ledger.maths.pipeline import grad_sinks

    needs = FAULT_NEEDS["grad-sinks-no-share"]
    assert run_ledger(load_config(overrides=needs)).exit_code == 0
    found = run_ledger(load_config(overrides={"fault": "grad-sinks-no-share", **needs})).first_finding
    assert (found.row, found.level, found.name) == ("grad_sinks", 4, "matches_reference")
    assert found.check.location is not None and set(found.check.location) == {"head"}
    parts = found.check.data["tolerance"]
    assert parts["ratio"] > 1 and parts["error"] > parts["bound"]
    # off by rounding errors of its own size: 256 float32 units fail there, a quarter of one passes
    eps = tolerance.EPS["float32"]
    for factor, code in ((1 + 256 * eps, 1), (1 + eps / 4, 0)):
        report = run_ledger(load_config(overrides=needs), ops=_grad_sinks(lambda *a: grad_sinks(*a) * factor))
        assert report.exit_code == code, (factor, report.first_finding)
        if code:
            assert (report.first_finding.row, report.first_finding.name) == ("grad_sinks", "matches_reference")


def test_a_sinks_gradient_that_is_not_finite_or_raises_is_named_at_its_row():
    from attn_ledger.maths.pipeline import grad_sinks

    def nan_head(*a):
        g = grad_sinks(*a)
        return g.index_fill(0, torch.tensor([2]), float("nan"))

    report = run_ledger(load_config(overrides={"sinks": SINKS, "grad": True}), ops=_grad_sinks(nan_head))
    finite = check(report, "grad_sinks", "finite")
    assert report.first_finding.row == "grad_sinks" and finite.failed and finite.location == {"head": 2}

    def raises(*a):
        raise RuntimeError("no sink gradient here")

    report = run_ledger(load_config(overrides={"sinks": SINKS, "grad": True}), ops=_grad_sinks(raises))
    assert (report.first_finding.row, report.first_finding.level) == ("grad_sinks", 1)
    assert check(report, "grad_k", "matches_reference").passed  # the other gradients are still judged


def test_saved_tensors_with_sinks_get_the_sinks_gradient_row(tmp_path):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    save_tensor_file({"q": q, "k": k, "v": v, "sinks": torch.tensor([0.3, 1.0, -2.0])}, tmp_path / "t.safetensors")
    res = runner.invoke(app, ["run", "--tensors", str(tmp_path / "t.safetensors"), "--mask", "causal", "--grad",
                              "--format", "json"])
    assert res.exit_code == 0, res.output
    row = next(r for r in json.loads(res.stdout)["rows"] if r["name"] == "grad_sinks")
    assert [c["name"] for c in row["checks"]] == ["shape", "finite", "matches_reference"]


def test_the_backward_reference_counts_the_sinks():
    """q, k, v gradients against float64 autograd: leaving the sinks out of the reference fails them."""
    from attn_ledger.maths.reference import reference_gradients

    g = torch.Generator().manual_seed(1)
    q, k, v, go = (torch.randn(1, 3, 4, 5, generator=g, dtype=torch.float64) for _ in range(4))
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    rows = torch.arange(4)
    with_s = reference_gradients(q, k, v, go, q_positions=rows, scale=0.4, sinks=sinks)
    without = reference_gradients(q, k, v, go, q_positions=rows, scale=0.4)
    assert float((with_s["grad_q"] - without["grad_q"]).abs().max()) > 1e-2
    sdpa_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa_capped(*sdpa_in, None, 0.4, None, sinks)
    got = torch.autograd.grad(out, sdpa_in, go)
    for name, t in zip(("grad_q", "grad_k", "grad_values"), got):
        torch.testing.assert_close(t, with_s[name], rtol=1e-10, atol=1e-12)
    assert with_s["grad_sinks"].shape == (3,)


def test_a_backward_fault_with_sinks_is_caught():
    report = run_ledger(load_config(overrides={"sinks": SINKS, "grad": True, "fault": "softmax-backward-no-rowsum"}))
    assert report.exit_code == 1 and report.first_finding.row == "grad_scores"


def test_the_window_convention_is_masking_utils():
    """W keys, the query's own among them: key j is allowed for query i when i - W < j <= i."""
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from attn_ledger.maths.masks import sliding_window

    fn = and_masks(causal_mask_function, sliding_window_overlay(3))
    t = torch.tensor
    theirs = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(7)] for i in range(7)])
    assert torch.equal(sliding_window(7, 7, 3), theirs), transformers.__version__


def test_given_tensors_carry_sinks_or_take_them_from_the_option(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    sinks = torch.tensor([0.3, 1.0, -2.0])
    ref = reference_stages(q, k, v, is_causal=True, sinks=sinks)
    save_tensor_file({"q": q, "k": k, "v": v, "sinks": sinks, "out": ref["out"].float()}, tmp_path / "with.safetensors")
    save_tensor_file({"q": q, "k": k, "v": v}, tmp_path / "plain.safetensors")
    torch.save({"sinks": sinks}, tmp_path / "sinks.pt")
    res = runner.invoke(app, ["run", "--tensors", str(tmp_path / "with.safetensors"), "--mask", "causal", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["details"]["sinks"] == pytest.approx([0.3, 1.0, -2.0])
    res = runner.invoke(app, ["run", "--tensors", str(tmp_path / "plain.safetensors"), "--mask", "causal",
                              "--sinks", str(tmp_path / "sinks.pt")])
    assert res.exit_code == 0, res.output
    # the saved out was made with the sinks: without them the given out disagrees
    save_tensor_file({"q": q, "k": k, "v": v, "out": ref["out"].float()}, tmp_path / "out.safetensors")
    res = runner.invoke(app, ["run", "--tensors", str(tmp_path / "out.safetensors"), "--mask", "causal"])
    assert res.exit_code == 1
    assert ledger_on_qkv(q, k, v, mask="causal", sinks=sinks, out=ref["out"].float()).exit_code == 0


def test_backends_are_not_applicable_with_sinks():
    report = run_ledger(load_config(overrides={"sinks": SINKS}), backends="all")
    assert report.exit_code == 0
    matrix = report.details["sdpa_backends"]
    assert matrix and all(str(v).startswith("unavailable: not applicable") for m in matrix.values() for v in m.values())


@pytest.mark.parametrize("args, words", [
    (["--sinks", "1,2"], "sinks: got 2 values, expected 1 or one per query head (Nh=3)"),
    (["--sinks", "nan"], "sinks: got nan, expected finite sink logits"),
    (["--sinks", "1,inf,2"], "sinks: got inf, expected finite sink logits"),
    (["--sinks", "abc"], "sinks: got 'abc', expected a number"),
    (["--sinks", "1,,2"], "sinks: got '', expected a number"),
    (["--fault", "sink-dropped"], "fault: got 'sink-dropped', a fault in the attention sinks"),
    (["--fault", "window-too-wide"], "fault: got 'window-too-wide', a fault in the sliding window"),
])
def test_bad_sinks_are_one_line_errors_exit_2(args, words):
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_sink_files_load_safely(tmp_path):
    torch.save(torch.tensor([1.0, 2.0, 3.0]), tmp_path / "one.pt")
    assert parse_sinks(str(tmp_path / "one.pt"), 3) == (1.0, 2.0, 3.0)

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled",))

    torch.save({"sinks": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(InputError):
        parse_sinks(str(tmp_path / "evil.pt"), 3)
    torch.save({"a": torch.ones(3), "b": torch.ones(3)}, tmp_path / "two.pt")
    with pytest.raises(InputError, match="expected one tensor or one named 'sinks'"):
        parse_sinks(str(tmp_path / "two.pt"), 3)
    assert parse_sinks(torch.tensor([0.5, 0.5, 0.5]), 3) == (0.5, 0.5, 0.5)
    for shape in [(1, 3), (), (4,), (1,)]:  # a tensor is one value per head, [Nh], exactly
        with pytest.raises(InputError, match="expected one value per query head"):
            parse_sinks(torch.zeros(shape), 3)
    assert parse_sinks(2, 4) == (2.0,) * 4
    with pytest.raises(InputError):
        parse_sinks(True, 3)
