"""The built-in pipeline as an ``nn.Module``, for experiments that need a forward function.

It runs the same stage functions as the ledger (:mod:`attn_ledger.maths.pipeline`), with the
same seeded weights, so a fault injected here is the fault the ledger diagnoses.
"""

from __future__ import annotations

import torch
from torch import nn

from attn_ledger.maths import masks
from attn_ledger.maths.pipeline import make_weights, ops_for, project


class BuiltinAttention(nn.Module):
    """Multi-head self-attention ``[B, T, E] -> [B, T, E]`` built from the ledger's stages.

    Args:
        embed_dim: E.
        num_heads: Nh (E must be divisible by it).
        causal: apply the causal relation (query i may use keys j <= i).
        fault: one of :data:`attn_ledger.inputs.config.FAULTS`, or None for the healthy pipeline.
        seed: seeds the projection weights.
        num_kv_heads: Nkv for grouped-query attention (default Nh).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        causal: bool = True,
        fault: str | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.ops = ops_for(fault)
        w = make_weights(embed_dim, num_heads, self.num_kv_heads, self.head_dim, self.head_dim, seed, dtype)
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(t) for t in (w.wq, w.wk, w.wv, w.wo))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops, nh, nkv = self.ops, self.num_heads, self.num_kv_heads
        b, t, _ = x.shape
        q = ops.split(project(x, self.wq), nh)  # [B, Nh, T, Dh]
        k = ops.expand(ops.split(project(x, self.wk), nkv), nh)  # [B, Nh, T, Dh]
        v = ops.expand(ops.split(project(x, self.wv), nkv), nh)  # [B, Nh, T, Dv]
        allow = masks.causal(t, t, device=x.device)[None, None] if self.causal else None  # [1, 1, T, T]
        allow = ops.polarity(allow)
        scores = ops.scores(q, k, ops.scale_for(self.head_dim))  # [B, Nh, T, T]
        weights = ops.softmax(ops.mask(scores, allow), allow, False)  # [B, Nh, T, T]
        return project(ops.merge(ops.mix(weights, v)), self.wo)  # [B, T, E]
