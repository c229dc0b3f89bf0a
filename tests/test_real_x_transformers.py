"""check --module on x-transformers: a one-layer ``Encoder`` and ``Decoder`` with rotary positions.

x-transformers rotates the first half of each head (interleaved pairs) by default. Its
``max_attend_past`` counts the past keys a query may read besides its own, so a window of W
keys is ``max_attend_past=W - 1``: the planted bug is the off-by-one reading of that option.

Skipped when x-transformers is absent (``pip install -e '.[real]'`` installs it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("x_transformers")  # no __version__ to compare; pyproject sets the floor

import real_models  # noqa: E402
from attn_ledger.probes.module.check import check_module  # noqa: E402

E, NH = 32, 4  # Dh = 8
ROTARY = {"pairing": "interleaved", "base": 10000.0, "rotated_dim": 4, "head_dim": 8}


@pytest.fixture(autouse=True)
def quiet_x_transformers():
    # x-transformers logs (loguru, not a Python warning) that rotary widths under 32 suit language models poorly
    from loguru import logger

    logger.disable("x_transformers")
    yield
    logger.enable("x_transformers")


@pytest.mark.parametrize("factory, options, applied, observed", [
    ("x_encoder", {"causal": False}, "bidirectional", "einsum q @ k^T, then weights @ v"),
    ("x_decoder", {}, "causal", "einsum q @ k^T, then weights @ v"),
    ("x_decoder_flash", {}, "causal", "F.scaled_dot_product_attention(is_causal=True)"),
    ("x_decoder_window_4", {"window": 4, "seq_len": 8}, "sliding-window", "einsum q @ k^T, then weights @ v"),
], ids=["encoder", "decoder", "decoder-flash", "decoder-window-4"])
def test_x_transformers_attention_passes_with_what_it_applies_named(factory, options, applied, observed):
    report = check_module(getattr(real_models, factory), E, NH, **options)
    assert report.exit_code == 0, report.failures()
    assert [(r, c.name) for r, c in report.checks() if c.status in ("fail", "warn")] == []
    assert report.coverage is None and report.details["observed"]["core"] == observed
    assert report.details["layout"] == "separate q, k, v projections, heads [Nh=4, Dh=8]"
    assert report.check("core", "rotary_positions").data["spec"] == ROTARY
    relation = report.check("core", "mask_relation").data
    assert (relation["applied"], relation.get("window"), relation["comparison"]) == \
        (applied, options.get("window"), "same")
    scale = report.check("core", "effective_scale")
    assert scale.status == "pass" and scale.value == pytest.approx(8 ** -0.5, rel=1e-5)


def test_x_transformers_window_off_by_one_is_named_at_the_core():
    report = check_module(real_models.x_decoder_window_4_off_by_one, E, NH, window=4, seq_len=8)
    first = report.first_finding
    assert report.exit_code == 1 and (first.row, first.level, first.name) == ("core", 4, "mask_relation")
    assert (first.check.data["applied"], first.check.data["window"], first.check.data["comparison"]) == \
        ("sliding-window", 5, "wider")
