"""Hints: what to try next, computed before it is said, shown under the first finding, carried as JSON ``hints``.

Each hint kind is tested shown (its alternative really explains the data) and absent (it does not):
``relation`` and ``scale`` on saved tensors (``run --tensors``), ``declare_window`` and ``declare_softcap``
on ``check --module``. The module check's headline is the check that names a cause (``key_row_sums``,
``mask_relation``, ``effective_scale``) over a symptom (a causality leak, the context differing).
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import layout_modules as L
from attn_ledger.cli import app
from attn_ledger.ledger import ledger_on_qkv
from attn_ledger.probes.module.check import check_module
from attn_ledger.render import render
from attn_ledger.render.html import render_html
from attn_ledger.render.jsondoc import report_json, schema

runner = CliRunner()
E, NH = 32, 4  # Dh = 8


def qkv(tq: int = 6, tk: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, tq, 8, generator=g), torch.randn(2, 3, tk, 8, generator=g),
            torch.randn(2, 3, tk, 8, generator=g))


def kinds(report) -> list[str]:
    return [h.kind for h in report.hints]


# --- saved tensors ------------------------------------------------------------------------------

def test_a_causal_capture_run_without_its_mask_exits_1_with_a_hint_naming_mask_causal(tmp_path):
    q, k, v = qkv()
    path = tmp_path / "capture.pt"
    torch.save({"q": q, "k": k, "v": v, "out": F.scaled_dot_product_attention(q, k, v, is_causal=True)}, path)
    res = runner.invoke(app, ["run", "--tensors", str(path)])
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("first finding: context"))
    hint = next(i for i, ln in enumerate(lines) if ln.startswith("hint:"))
    assert hint > at and all(ln.startswith("  ") for ln in lines[at + 1:hint])  # right under the finding's lines
    assert lines[hint].startswith("hint: the saved out matches bottom-right causal attention")
    assert "try --mask causal" in " ".join(lines[hint:])
    doc = json.loads(runner.invoke(app, ["run", "--tensors", str(path), "--format", "json"]).output)
    jsonschema.validate(doc, schema())
    (hint,) = doc["hints"]
    assert hint["kind"] == "relation" and hint["found"] == "causal" and hint["option"] == "--mask causal"
    assert hint["declared"] == "none" and hint["value"] < 1e-5 and hint["message"].startswith("hint: ")
    assert doc["first_finding"]["check"] == "user_out_matches_reference" and doc["verdict"] == "fail"


@pytest.mark.parametrize("tq, make, found, option", [
    (4, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "causal-top-left",
     "--mask causal-top-left"),  # SDPA's is_causal is top-left
    (6, lambda q, k, v: F.scaled_dot_product_attention(q, k, v), "none", "--mask none"),
    (6, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool).tril().triu(-2)), "sliding-window:3",
     "--mask sliding-window --window 3"),
], ids=["top-left", "no-mask", "window-3"])
def test_the_relation_that_explains_the_saved_out_is_named(tq, make, found, option):
    q, k, v = qkv(tq=tq)
    declared = "causal" if found != "causal" else "none"
    report = ledger_on_qkv(q, k, v, out=make(q, k, v), mask=declared)
    assert report.exit_code == 1 and kinds(report) == ["relation"]
    assert report.hints[0].data["found"] == found and report.hints[0].data["option"] == option


def test_no_relation_hint_where_no_relation_explains_the_saved_out():
    q, k, v = qkv()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out + 1e-3 * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # no relation gives this
    report = ledger_on_qkv(q, k, v, out=out)
    assert report.exit_code == 1 and report.first_finding.row == "context" and report.hints == ()


def test_a_declared_scale_the_saved_out_contradicts_is_named():
    q, k, v = qkv()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    report = ledger_on_qkv(q, k, v, out=out, mask="causal")
    assert report.exit_code == 1 and kinds(report) == ["scale"]
    assert report.hints[0].data["found_name"] == "1" and report.hints[0].data["option"] == "--scale 1"
    declared = ledger_on_qkv(q, k, v, out=F.scaled_dot_product_attention(q, k, v, is_causal=True), mask="causal",
                             scale=0.5)
    assert kinds(declared) == ["scale"] and declared.hints[0].data["found"] == pytest.approx(8 ** -0.5)
    assert "leaving --scale out" in declared.hints[0].data["option"]


def test_no_scale_hint_where_another_scale_made_the_saved_out():
    q, k, v = qkv()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7)  # none of 1, 1/sqrt(Dh), 1/Dh
    report = ledger_on_qkv(q, k, v, out=out, mask="causal")
    assert report.exit_code == 1 and report.hints == ()


def test_a_saved_out_that_matches_as_declared_has_no_hint():
    q, k, v = qkv()
    report = ledger_on_qkv(q, k, v, out=F.scaled_dot_product_attention(q, k, v, is_causal=True), mask="causal")
    assert report.exit_code == 0 and report.hints == ()


def test_every_view_writes_the_hint_under_the_first_finding():
    q, k, v = qkv()
    report = ledger_on_qkv(q, k, v, out=F.scaled_dot_product_attention(q, k, v, is_causal=True))
    for fmt in ("table", "markdown", "github"):
        text = render(report, fmt, width=1000)  # the finding on one line
        lines = [ln.lstrip("-* ") for ln in text.splitlines() if ln.strip()]
        at = next(i for i, ln in enumerate(lines) if "first finding: context" in ln)
        assert lines[at + 1].startswith("hint: the saved out matches bottom-right causal attention"), fmt
    page = render_html(report)
    section = page[page.index('id="first-finding"'):]
    assert section.index('class="hint"') < section.index("</section>")
    assert report_json(report)["hints"][0]["kind"] == "relation"


# --- modules ----------------------------------------------------------------------------------

class WindowAtScaleOne(L.GQAttention):
    """A window of 4 keys at softmax scale 1: the window alone does not explain the core."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.dh).transpose(1, 2)  # [B, Nh, T, Dh]
        k = self._repeat(self.k_proj(x).view(b, t, self.nkv, self.dh).transpose(1, 2))  # [B, Nh, T, Dh]
        v = self._repeat(self.v_proj(x).view(b, t, self.nkv, self.dh).transpose(1, 2))  # [B, Nh, T, Dh]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(t, x.device), scale=1.0)
        return self.o_proj(ctx.transpose(1, 2).reshape(b, t, self.nh * self.dh))


def test_an_undeclared_window_that_explains_the_core_is_hinted():
    report = check_module(L.factory(L.GQAttention, window=4), E, NH, seq_len=8)
    assert report.exit_code == 1 and report.first_finding.name == "mask_relation"
    assert kinds(report) == ["declare_window"] and report.hints[0].data["option"] == "--window 4"
    assert "declare it with --window 4" in render(report, "table")
    assert check_module(L.factory(L.GQAttention, window=4), E, NH, seq_len=8, window=4).hints == ()


def test_no_window_hint_where_the_window_alone_does_not_explain_the_core():
    report = check_module(L.factory(WindowAtScaleOne, window=4), E, NH, seq_len=8)
    assert report.exit_code == 1 and report.hints == ()


def test_an_undeclared_softcap_is_hinted_under_the_pass_and_a_declared_one_is_not():
    capped = L.factory(L.BiasedScores, design="softcap", cap=50.0, gain=0.2)
    report = check_module(capped, E, NH)
    assert report.exit_code == 0 and kinds(report) == ["declare_softcap"]
    assert report.hints[0].data["option"] == "--softcap 50"
    assert render(report, "table").rstrip().splitlines()[-1] == (
        "hint: the scores are soft-capped at 50: if that is the design, declare it with --softcap 50")
    assert check_module(capped, E, NH, softcap=50).hints == ()
    assert check_module(L.factory(L.BiasedScores, design="plain", gain=0.2), E, NH).hints == ()


# --- the headline -------------------------------------------------------------------------------

class SoftmaxOverQueries(nn.Module):
    """Causal attention whose softmax runs over the queries (dim=-2), not the keys."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.nh, self.dh = num_heads, embed_dim // num_heads
        self.qkv, self.out = nn.Linear(embed_dim, 3 * embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (p.view(b, t, self.nh, self.dh).transpose(1, 2) for p in self.qkv(x).chunk(3, -1))  # [B, Nh, T, Dh]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)  # [B, Nh, T, T]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        w = torch.softmax(s, dim=-2)  # the bug: over the queries
        return self.out((w @ v).transpose(1, 2).reshape(b, t, e))


def test_weights_over_the_wrong_axis_headline_the_row_sums_not_the_leak():
    report = check_module(SoftmaxOverQueries, E, NH)
    failed = {c.name for _, c in report.failures()}
    assert {"causal_intervention_no_grad", "key_row_sums"} <= failed  # the leak is there, a symptom
    f = report.first_finding
    assert (f.row, f.name) == ("numerics", "key_row_sums") and f.check.value >= 2 * f.check.limit
    assert report_json(report)["first_finding"]["check"] == "key_row_sums"


def test_a_symptom_stays_the_headline_where_no_cause_fails():
    report = check_module(L.factory(L.GQAttention), E, NH)
    assert report.exit_code == 0 and report.row("numerics").check("key_row_sums").passed
    from attn_ledger.probes.catalogue import CATALOGUE, MODULE_EMBED_DIM, MODULE_HEADS

    dropout = next(f for f in CATALOGUE if f.name == "dropout-at-eval")
    assert check_module(dropout.target, MODULE_EMBED_DIM, MODULE_HEADS).first_finding.name == "eval_determinism"


# --- kernels --------------------------------------------------------------------------------------

KERNEL_CASES = ("b1-h3kv3-tq3tk6-dh4dv6-causal-flag-rand-f32", "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32",
                "b1-h3kv3-tq6tk6-dh4dv6-causal-flag-rand-f32", "b1-h3kv3-tq6tk6-dh4dv6-none-rand-f32")


def kernel_report(fn):
    from attn_ledger.probes.kernel.check import check_kernel, parse_case

    return check_kernel(fn, [parse_case(i) for i in KERNEL_CASES], target="k.py:attention")


def shifted_when_not_square(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Right where Tq == Tk; elsewhere its causal output is moved by 0.01, which no alignment explains."""
    from attn_ledger.probes.catalogue import _attend

    out = _attend(q, k, v, allow_mask=allow_mask, is_causal=is_causal, scale=scale)
    return out + 0.01 if is_causal and q.shape[-2] != k.shape[-2] else out


def test_a_kernel_that_aligns_is_causal_top_left_gets_the_alignment_hint():
    from attn_ledger.probes import catalogue

    report = kernel_report(catalogue.causal_top_left)
    assert report.exit_code == 1 and kinds(report) == ["alignment"]
    d = report.hints[0].data
    assert (d["found"], d["failing"], d["passing"]) == ("top-left", 2, 1) and d["value"] <= d["limit"]
    assert "align is_causal bottom-right" in render(report, "table")


@pytest.mark.parametrize("name", ["shifted_when_not_square", "no_scale"])
def test_no_alignment_hint_where_the_alignment_does_not_explain_the_failures(name):
    from attn_ledger.probes import catalogue

    fn = shifted_when_not_square if name == "shifted_when_not_square" else catalogue.no_scale
    report = kernel_report(fn)
    assert report.exit_code == 1 and report.hints == ()
