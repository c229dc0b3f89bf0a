"""The headline of check --module on a Hugging Face Llama layer whose softmax runs over the queries.

The layer is transformers' own (tiny config, random weights, one layer, ``tests/real_models.py``),
with an attention function registered through ``AttentionInterface`` that normalises the weights
over the queries (dim=-2) instead of the keys. The future leaks into the past as a result, but the
headline must be the check that names the cause, ``key_row_sums``, at least a factor of two past
its limit, over 5 seeds. Skipped when transformers is absent (``pip install -e '.[real]'``).
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.48")

from attn_ledger.probes.module.check import check_module  # noqa: E402
from real_models import llama  # noqa: E402

E, NH = 32, 4  # Dh = 8


def softmax_over_queries(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager attention with the bug: softmax over the queries. ``query`` ``[B, Nh, T, Dh]``."""
    from transformers.models.llama.modeling_llama import repeat_kv

    k = repeat_kv(key, module.num_key_value_groups)  # [B, Nh, T, Dh]
    v = repeat_kv(value, module.num_key_value_groups)  # [B, Nh, T, Dh]
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling  # [B, Nh, T, T]
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : k.shape[-2]]
    weights = torch.softmax(scores, dim=-2)  # over the queries
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights  # [B, T, Nh, Dh]


@pytest.fixture(autouse=True)
def quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def llama_softmax_over_queries(e: int, nh: int):
    transformers.AttentionInterface.register("softmax_over_queries", softmax_over_queries)
    return llama("softmax_over_queries")(e, nh)


@pytest.mark.parametrize("seed", range(5))
def test_llama_softmax_over_queries_headlines_the_row_sums(seed):
    report = check_module(llama_softmax_over_queries, E, NH, seed=seed)
    failed = {c.name for _, c in report.failures()}
    assert "causal_intervention_no_grad" in failed and "attention_core" in failed  # the symptoms are there
    f = report.first_finding
    assert (f.row, f.name) == ("numerics", "key_row_sums")
    assert f.check.value >= 2 * f.check.limit, (f.check.value, f.check.limit)


def test_llama_with_keys_softmax_passes_the_row_sums():
    report = check_module(llama("eager"), E, NH)
    assert report.exit_code == 0 and report.row("numerics").check("key_row_sums").passed
