"""The built-in pipeline's stages outside the score grid: head split and merge, projections, merge, output.

Each is one whole-tensor computation, measured and judged at once (no blocks): the shape,
finite values, and agreement with the float64 chain built apart from the pipeline
(:mod:`attn_ledger.reference`). The merge and output compare the rows the float64 reference
sampled; the output also compares every row with the SDPA-based forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger import checks as C
from attn_ledger import tolerance
from attn_ledger.report import Check

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.config import RunConfig

AXES = {
    "input": "[B,Tq,E]",
    "head_roundtrip": "[B,T,E]",
    "q": "[B,Nh,Tq,Dh]",
    "k": "[B,Nkv,Tk,Dh]",
    "v": "[B,Nkv,Tk,Dv]",
    "merged": "[B,Tq,Nh*Dv]",
    "output": "[B,Tq,E]",
}


@dataclass(frozen=True)
class Inputs:
    """The built-in pipeline's input, weights and the float64 chain's Q, K, V, from a config."""

    x: "Tensor"  # [B, Tq, E]
    x_kv: "Tensor"  # [B, Tk, E] (x itself for self-attention)
    weights: Any  # pipeline.Weights
    q64: "Tensor"  # [B, Nh, Tq, Dh]
    k64: "Tensor"  # [B, Nkv, Tk, Dh]
    v64: "Tensor"  # [B, Nkv, Tk, Dv]


def make_inputs(cfg: "RunConfig", dtype: "torch.dtype", device: "torch.device", ref_dtype: "torch.dtype") -> Inputs:
    from attn_ledger import reference as R
    from attn_ledger.pipeline import make_input, make_weights

    b, tq, tk, e = cfg.batch_size, cfg.tq, cfg.tk, cfg.embed_dim
    x = make_input(b, tq, e, cfg.input, cfg.seed, dtype, device)  # [B, Tq, E]
    cross = cfg.query_len is not None
    x_kv = make_input(b, tk, e, cfg.input, cfg.seed, dtype, device, offset=7919) if cross else x  # [B, Tk, E]
    w = make_weights(e, cfg.num_heads, cfg.nkv, cfg.dh, cfg.dv, cfg.seed, dtype, device)
    # the reference chain, float64, from the same input values and weights
    x64, xkv64 = x.to(ref_dtype), x_kv.to(ref_dtype)
    q64 = R.heads_of(x64 @ w.wq.to(ref_dtype).T, cfg.num_heads)  # [B, Nh, Tq, Dh]
    k64 = R.heads_of(xkv64 @ w.wk.to(ref_dtype).T, cfg.nkv)  # [B, Nkv, Tk, Dh]
    v64 = R.heads_of(xkv64 @ w.wv.to(ref_dtype).T, cfg.nkv)  # [B, Nkv, Tk, Dv]
    return Inputs(x, x_kv, w, q64, k64, v64)


def head_roundtrip(ops: Any, b: int, tq: int, e: int, nh: int, dv: int) -> tuple[tuple[int, ...], list[Check]]:
    """Split then merge an arange tensor, compared by value; and where each head's slice goes."""
    import torch

    probe = torch.arange(max(1, min(b, 2)) * tq * e, dtype=torch.float64).reshape(-1, tq, e)  # [B', Tq, E]
    ctx_probe = torch.arange(probe.shape[0] * nh * tq * dv, dtype=torch.float64).reshape(-1, nh, tq, dv)  # [B', Nh, Tq, Dv]
    split = ops.split(probe, nh)
    rt = ops.merge(split)
    merged_probe = ops.merge(ctx_probe)
    return tuple(rt.shape), [
        C.shape_check(rt.shape, probe.shape, AXES["head_roundtrip"]),
        C.roundtrip_check(probe, rt),
        C.head_slices_check("split_head_slices", split, probe, nh, "split"),
        C.head_slices_check("merge_head_slices", ctx_probe, merged_probe, nh, "merge"),
    ]


def projection(t: "Tensor", want: tuple[int, ...], name: str, ref: "Tensor") -> list[Check]:
    """A projected and split Q, K or V: shape, finite, and agreement with the float64 projection and split."""
    rtol, atol = tolerance.reference(t.dtype)
    found = [C.shape_check(t.shape, want, AXES[name]), C.finite_check(C.nonfinite_count(t), f"{name} values")]
    if tuple(t.shape) == tuple(ref.shape):
        d, ex = C.excess_error(t, ref, rtol, atol * max(1.0, C.max_abs(ref)))
        found.append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 projection + split"))
    return found


def merged(ops: Any, context: "Tensor", ref_ctx: dict[tuple[int, int], "Tensor"], b: int, tq: int, nh: int,
           dv: int) -> tuple["Tensor", list[Check]]:
    """Heads merged back: shape, each head's slice, and the sampled rows against the float64 reference."""
    import torch

    from attn_ledger.reference import join_heads

    rtol, atol = tolerance.reference(context.dtype)
    m = ops.merge(context)  # [B, Tq, Nh*Dv]
    want_shape = (b, tq, nh * dv)
    found = [
        C.shape_check(m.shape, want_shape, AXES["merged"]),
        C.head_slices_check("merge_head_slices", context, m, nh, "merge")
        if tuple(m.shape) == want_shape else Check(2, "merge_head_slices", "fail", reason="the shape cannot hold the heads"),
    ]
    rows = sorted(ref_ctx)
    got = torch.cat([m[:, q0:q1] for q0, q1 in rows], dim=1)
    want = torch.cat([join_heads(ref_ctx[r]) for r in rows], dim=1)
    if got.shape == want.shape:
        d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
        found.append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 reference"))
    return m, found


def output(merged_ctx: "Tensor", wo: "Tensor", sdpa_ctx: "Tensor", ref_ctx: dict[tuple[int, int], "Tensor"],
           b: int, tq: int, e: int) -> tuple["Tensor", list[Check]]:
    """The output projection: the external layout, finite values, the float64 reference and the SDPA-based forward."""
    import torch

    from attn_ledger.pipeline import project
    from attn_ledger.reference import join_heads

    rtol, atol = tolerance.reference(merged_ctx.dtype)
    out = project(merged_ctx, wo)  # [B, Tq, E]
    found = [
        C.shape_check(out.shape, (b, tq, e), "[B,Tq,E] (the external layout)", "external_layout"),
        C.finite_check(C.nonfinite_count(out), "output values"),
    ]
    if tuple(out.shape) == (b, tq, e):
        rows = sorted(ref_ctx)
        wo64 = wo.to(next(iter(ref_ctx.values())).dtype)
        got = torch.cat([out[:, q0:q1] for q0, q1 in rows], dim=1)
        want = torch.cat([join_heads(ref_ctx[r]) @ wo64.T for r in rows], dim=1)
        d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
        found.append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 reference"))
        sd_out = join_heads(sdpa_ctx) @ wo.T
        d, ex = C.excess_error(out, sd_out, rtol, atol * max(1.0, C.max_abs(sd_out)))
        found.append(C.compare_check("matches_sdpa", d, ex, rtol, atol, "SDPA-based forward"))
    return out, found
