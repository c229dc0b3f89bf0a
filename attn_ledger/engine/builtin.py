"""The built-in pipeline's stages outside the score grid: head split and merge, projections, merge, output.

Each is one whole-tensor computation, measured and judged at once (no blocks): the shape,
finite values, and agreement with the float64 chain built apart from the pipeline
(:mod:`attn_ledger.maths.reference`). The merge and output compare the rows the float64 reference
sampled; the output also compares every row with the SDPA-based forward.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger.engine import checks as C
from attn_ledger.engine import stages
from attn_ledger import tolerance
from attn_ledger.report import Check, Note

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.inputs.config import RunConfig
    from attn_ledger.maths.relations import Relation
    from attn_ledger.engine.rows import Rows

AXES = stages.axes(stages.PIPELINE)


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
    from attn_ledger.maths import reference as R
    from attn_ledger.maths.pipeline import make_input, make_weights

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


def config_title(cfg: "RunConfig", relation: "Relation", device: "torch.device") -> tuple[str, dict[str, Any]]:
    """The ledger's title line and the facts of its details, from the config."""
    b, tq, tk, e, nh, nkv, dh, dv = cfg.batch_size, cfg.tq, cfg.tk, cfg.embed_dim, cfg.num_heads, cfg.nkv, cfg.dh, cfg.dv
    title = (f"ATTENTION LEDGER B={b} Tq={tq} Tk={tk} E={e} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={cfg.dtype}"
             + (f" softcap={cfg.softcap:g}" if cfg.softcap is not None else "")
             + (f" fault={cfg.fault}" if cfg.fault else ""))
    meta = {"B": b, "Tq": tq, "Tk": tk, "E": e, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": cfg.dtype, "device": str(device), "fault": cfg.fault, "input": cfg.input, "seed": cfg.seed}
    return title, meta


def input_row(rows: "Rows", cfg: "RunConfig", inp: Inputs) -> None:
    """The ``input`` row: built from the validated config, so nothing about it can fail here; the row
    states what was validated instead of carrying checks that could not fail."""
    rows.shapes["input"] = tuple(inp.x.shape)
    rows.checks["input"] = []
    rows.row_notes["input"] = Note("config_input", {"E": cfg.embed_dim, "Nh": cfg.num_heads, "Dh": cfg.dh,
                                                    "x_kv": list(inp.x_kv.shape) if cfg.query_len is not None else None})


def projections(rows: "Rows", ops: Any, cfg: "RunConfig", inp: Inputs) -> "tuple[Tensor, Tensor, Tensor] | None":
    """The q, k and v stages: project, split into heads, check each; None once one raises."""
    from attn_ledger.maths.pipeline import project

    b, tq, tk, nh, nkv = cfg.batch_size, cfg.tq, cfg.tk, cfg.num_heads, cfg.nkv
    w = inp.weights
    found = []
    for stage, x, wmat, heads, want, ref in (
        ("q", inp.x, w.wq, nh, (b, nh, tq, cfg.dh), inp.q64),  # [B, Nh, Tq, Dh]
        ("k", inp.x_kv, w.wk, nkv, (b, nkv, tk, cfg.dh), inp.k64),  # [B, Nkv, Tk, Dh]
        ("v", inp.x_kv, w.wv, nkv, (b, nkv, tk, cfg.dv), inp.v64),  # [B, Nkv, Tk, Dv]
    ):
        t = rows.run(stage, lambda: ops.split(project(x, wmat), heads))
        if t is None:
            return None
        rows.shapes[stage] = tuple(t.shape)
        rows.checks[stage] = projection(t, want, stage, ref)
        if stage == "k":
            rows.checks["k"].insert(1, C.kv_pairing_check(ops.expand, nh, nkv))
        found.append(t)
    return found[0], found[1], found[2]


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

    from attn_ledger.maths.reference import join_heads

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

    from attn_ledger.maths.pipeline import project
    from attn_ledger.maths.reference import join_heads

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


# --- the backward of the stages outside the score grid (configs, with grad) -----------------------

def grad_context(ops: Any, grad_output: "Tensor", wo: "Tensor", nh: int) -> "Tensor":
    """``O-bar`` of the output ``[B, Tq, E]`` back through the output projection and the merge: ``[B, Nh, Tq, Dv]``."""
    grad_merged = grad_output @ wo  # [B, Tq, E] @ [E, Nh*Dv] -> [B, Tq, Nh*Dv]
    return ops.split(grad_merged, nh)  # the merge's adjoint is the split: [B, Nh, Tq, Dv]


def grad_projections(ops: Any, dq: "Tensor", dk: "Tensor", dv: "Tensor", grad_output: "Tensor", x: "Tensor",
                     x_kv: "Tensor", merged: "Tensor") -> dict[str, "Tensor"]:
    """The projection weights' gradients, ``nn.Linear`` layout ``[out, in]``: ``W-bar = y-bar^T x`` summed over B and T.

    Args:
        dq: ``[B, Nh, Tq, Dh]``; dk, dv: ``[B, Nkv, Tk, *]`` (the head split's adjoint is the merge).
        grad_output: ``[B, Tq, E]``; x, x_kv: ``[B, Tq, E]``, ``[B, Tk, E]``; merged: ``[B, Tq, Nh*Dv]``.
    """

    def outer(y: "Tensor", inp: "Tensor") -> "Tensor":
        return y.reshape(-1, y.shape[-1]).transpose(0, 1) @ inp.reshape(-1, inp.shape[-1])  # [out, in]

    return {"wq": outer(ops.merge(dq), x), "wk": outer(ops.merge(dk), x_kv), "wv": outer(ops.merge(dv), x_kv),
            "wo": outer(grad_output, merged)}


def grad_input(ops: Any, dq: "Tensor", dk: "Tensor", dv: "Tensor", w: Any, cross: bool) -> dict[str, "Tensor"]:
    """``x-bar`` ``[B, Tq, E]`` (and ``x_kv-bar`` ``[B, Tk, E]`` for cross-attention) through the three projections."""
    gx = ops.merge(dq) @ w.wq  # [B, Tq, Nh*Dh] @ [Nh*Dh, E]
    gkv = ops.merge(dk) @ w.wk + ops.merge(dv) @ w.wv  # [B, Tk, E]
    return {"x": gx, "x_kv": gkv} if cross else {"x": gx + gkv}


def sdpa_chain_gradients(inp: Inputs, nh: int, nkv: int, allow: "Tensor | None", whole_causal: bool, scale: float,
                         rotation: Any, grad_output: "Tensor", softcap: float | None = None,
                         sinks: "Tensor | None" = None) -> dict[str, "Tensor"]:
    """Autograd, in the run's dtype, of the same multi-head attention built on F.scaled_dot_product_attention
    (with a soft-cap, SDPA gets the capped scores as its additive mask: :func:`~attn_ledger.engine.backends.sdpa_capped`)."""
    import torch
    import torch.nn.functional as F

    from attn_ledger.maths.reference import heads_of, join_heads, repeat_kv
    from attn_ledger.maths.rotary import apply_rotary

    cross = inp.x_kv is not inp.x
    with torch.enable_grad():
        leaves = [t.detach().clone().requires_grad_(True) for t in
                  (inp.x, inp.weights.wq, inp.weights.wk, inp.weights.wv, inp.weights.wo) + ((inp.x_kv,) if cross else ())]
        x, wq, wk, wv, wo = leaves[:5]
        xkv = leaves[5] if cross else x
        q, k, v = heads_of(x @ wq.T, nh), heads_of(xkv @ wk.T, nkv), heads_of(xkv @ wv.T, nkv)  # [B, N, T, D]
        if rotation is not None:
            q, k = apply_rotary(q, rotation.spec, offset=rotation.q_start), apply_rotary(k, rotation.spec)
        if softcap is not None or sinks is not None:
            from attn_ledger.engine.execute import sdpa_capped

            ctx = sdpa_capped(q, repeat_kv(k, nh), repeat_kv(v, nh), allow, scale, softcap, sinks)  # [B, Nh, Tq, Dv]
        else:
            ctx = F.scaled_dot_product_attention(q, repeat_kv(k, nh), repeat_kv(v, nh), attn_mask=allow, dropout_p=0.0,
                                                 is_causal=whole_causal, scale=scale)  # [B, Nh, Tq, Dv]
        out = join_heads(ctx) @ wo.T  # [B, Tq, E]
        found = torch.autograd.grad(out, leaves, grad_output)
    names = ("x", "wq", "wk", "wv", "wo") + (("x_kv",) if cross else ())
    return dict(zip(names, found))


def grad_checks(full: dict[str, "Tensor"], shapes: dict[str, tuple[int, ...]], axes: str, partial: dict[str, "Tensor"],
                ref: "dict[str, Tensor] | None", sdpa: "dict[str, Tensor] | None", sampled: str,
                stage: str = "", mags: "dict[str, Tensor] | None" = None) -> list[Check]:
    """A whole-tensor backward row: shapes, finite values, float64 autograd (on the sample) and SDPA autograd (every row).

    With ``mags`` (the rounding rule's ``M`` of each tensor, :func:`attn_ledger.engine.rounding.chain_magnitudes`)
    the float64 comparison holds every element within ``c * eps * M`` (``c`` of ``stage``) and names the
    tensor nearest its bound; without, and against SDPA, the reference tolerance applies.
    """
    got = {n: list(t.shape) for n, t in full.items()}
    want = {n: list(s) for n, s in shapes.items()}
    found = [Check(1, "shape", "pass" if got == want else "fail", reason=f"{axes} derived {want}, got {got}",
                   data={"expected": want, "got": got, "axes": axes})]
    if got != want:
        return found
    found.append(C.finite_check(sum(C.nonfinite_count(t) for t in full.values()), "gradient values"))
    for name, against, mine, theirs in (("matches_reference", f"float64 autograd ({sampled})", partial, ref),
                                        ("matches_sdpa", "autograd of the SDPA-based forward", full, sdpa)):
        if theirs is None:
            continue
        if name == "matches_reference" and mags is not None:
            found.append(_rounded_grads(stage, mine, theirs, mags, against))
            continue
        dtype = next(iter(full.values())).dtype
        rtol, atol = tolerance.reference(dtype)
        worst, excess, each = 0.0, -atol, {}
        for n, t in mine.items():
            d, ex = C.excess_error(t, theirs[n], rtol, atol * max(1.0, C.max_abs(theirs[n])))
            worst, excess, each[n] = _worst(worst, d), _worst(excess, ex), d
        check = C.compare_check(name, worst, excess, rtol, atol, against)
        found.append(Check(**{**check.__dict__, "data": {**check.data, "each": each}}))
    return found


def _rounded_grads(stage: str, mine: dict[str, "Tensor"], theirs: dict[str, "Tensor"], mags: dict[str, "Tensor"],
                   against: str) -> Check:
    """Each tensor against float64 within ``c * eps * M``; the check is the one nearest its bound (the
    others' largest |difference| and error / bound as data, ``each`` and ``ratios``)."""
    from dataclasses import replace

    from attn_ledger.engine import rounding
    from attn_ledger.engine.judge import rounded_check

    def grid(t: "Tensor") -> "Tensor":  # [1, .., *]: the agreement's four axes; its position is not used
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def ratio(a: Any) -> float:  # NaN (a NaN element, or a shape apart) is the worst
        r = (a.parts or {}).get("ratio", math.nan)
        return math.inf if math.isnan(r) else r

    found = {}
    for n, t in mine.items():
        a = rounding.agreement(stage, "pipeline", grid(t), grid(theirs[n]), grid(mags[n]), tolerance.dtype_name(t.dtype))
        found[n] = replace(a, where=None, parts={**(a.parts or {}), "tensor": n})  # a weight's entry is no grid position
    worst = max(found, key=lambda n: ratio(found[n]))
    check = rounded_check(stage, "matches_reference", found[worst], f"{against}, worst of {', '.join(found)} in {worst}")
    each = {n: a.diff for n, a in found.items()}
    ratios = {n: (a.parts or {}).get("ratio", math.nan) for n, a in found.items()}
    return replace(check, data={**check.data, "each": each, "ratios": ratios})


def _worst(a: float, b: float) -> float:
    """The larger, NaN winning (a NaN anywhere fails the comparison)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
