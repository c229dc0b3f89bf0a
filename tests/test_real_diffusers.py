"""check --module on diffusers' ``Attention`` (self-attention, bidirectional), its default and classic processors.

Skipped when diffusers is absent (``pip install -e '.[real]'`` installs it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers", minversion="0.30")

import real_models  # noqa: E402
from attn_ledger.probes.module.check import check_module  # noqa: E402

E, NH = 32, 4  # Dh = 8


@pytest.mark.parametrize("factory, observed", [
    ("diffusers_attention", "F.scaled_dot_product_attention"),
    ("diffusers_attention_classic", "baddbmm q @ k^T, then weights @ v"),
], ids=["default-processor-sdpa", "classic-processor-baddbmm"])
def test_diffusers_attention_passes_with_zero_findings(factory, observed):
    report = check_module(getattr(real_models, factory), E, NH, causal=False)
    assert report.exit_code == 0, report.failures()
    assert [(r, c.name) for r, c in report.checks() if c.status in ("fail", "warn")] == []
    assert report.coverage is None and report.details["observed"]["core"] == observed
    assert report.details["layout"] == "separate q, k, v projections, heads [Nh=4, Dh=8]"
    assert report.check("core", "mask_relation").data["applied"] == "bidirectional"
    scale = report.check("core", "effective_scale")
    assert scale.status == "pass" and scale.value == pytest.approx(8 ** -0.5, rel=1e-5)
    assert report.check("core", "rotary_positions").data["spec"] is None
    assert report.check("axes", "permutation_equivariance").status == "pass"  # no positions: order must not matter


def test_diffusers_attention_without_its_scale_is_named_at_the_core():
    report = check_module(real_models.diffusers_attention_unscaled, E, NH, causal=False)
    first = report.first_finding
    assert report.exit_code == 1 and (first.row, first.level, first.name) == ("core", 4, "effective_scale")
    assert first.check.data["named"] == ["1"] and first.check.value == pytest.approx(1.0, rel=1e-5)
    # the black-box rows cannot see a scale: they still pass
    assert [r for r, c in report.checks() if c.status == "fail" and r != "core"] == []
