"""References for ``check`` on a kernel, computed a block of query rows at a time.

Two computations, written apart from the user's kernel and from the ledger's pipeline:

* the **reference**: plain attention in float64 (float32 on a device without float64);
* the **plain same-dtype computation** that sets a tolerance: the same steps with every
  result rounded to the case's dtype, accumulating in float32 for float16 and bfloat16 (as
  matrix units and CPU kernels do), and scaling q *before* the product, so that a case whose
  raw ``q . k`` leaves float16's range still has a finite plain result.

Both give the output and, given an upstream gradient, dq, dk and dv by autograd. A query block's
``[B, Nh, rows, Tk]`` grid holds about 2^21 entries (:func:`~attn_ledger.probes.kernel.cases.query_blocks`),
so the memory a case needs grows with its inputs, not with Tq x Tk.

A query whose every key is blocked gets zero weights, output and gradient here (the ``zeros``
contract); checks that use another contract exclude such rows themselves.

The features a kernel may declare are applied here as ``masking_utils`` and the eager attention
of transformers define them: ``softcap`` C makes the scaled scores ``C * tanh(s / C)`` before the
mask; ``sinks`` ``[Nh]`` adds one logit per head to each row's softmax denominator (a column that
mixes no value, so a row's weights sum to one minus the sink's share); a window is part of ``allow``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger.probes.kernel.cases import query_blocks
from attn_ledger.maths.reference import repeat_kv
from attn_ledger.tolerance import KERNEL_FACTOR, SUITES, kernel_bound

if TYPE_CHECKING:
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class Computed:
    """The output of one computation, and its gradients when an upstream gradient was given."""

    out: "Tensor"  # [B, Nh, Tq, Dv]
    dq: "Tensor | None" = None  # [B, Nh, Tq, Dh]
    dk: "Tensor | None" = None  # [B, Nkv, Tk, Dh]
    dv: "Tensor | None" = None  # [B, Nkv, Tk, Dv]
    raw_max: float = 0.0  # largest |q . k| before scaling (float64 reference only)


def capped(s: "Tensor", softcap: float | None) -> "Tensor":
    """The scores soft-capped, ``C * tanh(s / C)``, or as they are without a soft-cap."""
    import torch

    return s if softcap is None else torch.tanh(s / softcap) * softcap


def softmax_with(s: "Tensor", sinks: "Tensor | None") -> "Tensor":
    """Softmax over the last axis of masked scores ``[B, Nh, rows, Tk]``; with ``sinks`` ``[Nh]``, each head's
    sink logit joins the denominator and its column is dropped (a row with every key blocked gets zeros)."""
    import torch

    if sinks is None:
        return torch.softmax(s, dim=-1)
    col = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)  # [B, Nh, rows, 1]
    return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]


def _attend(qb: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
            rnd: "torch.dtype | None", scale_first: bool = True, softcap: float | None = None,
            sinks: "Tensor | None" = None) -> tuple["Tensor", "Tensor"]:
    """One query block: ``(out [B, Nh, rows, Dv], raw scores' largest |value| as a 0-d tensor)``.

    ``rnd``: round every result to this dtype (the plain same-dtype computation), or None.
    ``scale_first``: scale q before the product (else the product, then the scale).
    ``softcap``, ``sinks``: the features (module docstring).
    """
    import torch

    def r(t: "Tensor") -> "Tensor":
        return t if rnd is None else t.to(rnd).to(t.dtype)

    nh = qb.shape[1]
    kk = repeat_kv(k, nh)  # [B, Nh, Tk, Dh]
    vv = repeat_kv(v, nh)  # [B, Nh, Tk, Dv]
    if scale_first:
        qs = r(qb * scale)  # [B, Nh, rows, Dh]
        s = r(torch.matmul(qs, kk.transpose(-2, -1)))  # [B, Nh, rows, Tk]
    else:
        s = r(r(torch.matmul(qb, kk.transpose(-2, -1))) * scale)  # [B, Nh, rows, Tk]
    raw = s.detach().abs().amax() / scale if s.numel() else s.new_zeros(())
    if softcap is not None:
        s = r(capped(s, softcap))  # before the mask, as Gemma 2 does
    if allow is not None:
        live = allow.any(dim=-1, keepdim=True)  # [B|1, 1|Nh, rows, 1]
        s = torch.where(allow, s, float("-inf")).where(live, 0.0)  # an empty row softmaxes zeros, then is zeroed
        w = softmax_with(s, sinks).where(live, 0.0)  # [B, Nh, rows, Tk]
    else:
        w = softmax_with(s, sinks)  # [B, Nh, rows, Tk]
    return r(torch.matmul(r(w), vv)), raw  # [B, Nh, rows, Dv]


def attention(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float, *,
              compute: "torch.dtype", rounding: "torch.dtype | None" = None,
              d_out: "Tensor | None" = None, scale_first: bool = True, softcap: float | None = None,
              sinks: "Tensor | None" = None) -> Computed:
    """Attention over query blocks in ``compute`` precision, optionally rounded to ``rounding``.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]`` (any dtype; cast).
        allow: bool broadcastable to ``[B, Nh, Tq, Tk]`` with the query axis whole (True = may
            attend; ``is_causal`` already folded in), or None.
        scale: the softmax scale.
        compute: the dtype every step runs in (float64 for the reference; float32 for a
            half-precision plain computation; the case's dtype otherwise).
        rounding: round every intermediate result to this dtype (the plain computation), or None.
        d_out: an upstream gradient ``[B, Nh, Tq, Dv]``: dq, dk and dv are computed by autograd.
        scale_first: scale q before the product (else after it).
        softcap, sinks: the features (module docstring); ``sinks`` is ``[Nh]``, not differentiated.

    Returns:
        :class:`Computed` in ``compute`` precision.
    """
    import torch

    b, nh, tq, _ = q.shape
    tk = k.shape[-2]
    grads = d_out is not None
    kc = k.detach().to(compute).requires_grad_(grads)  # [B, Nkv, Tk, Dh]
    vc = v.detach().to(compute).requires_grad_(grads)  # [B, Nkv, Tk, Dv]
    outs, dqs = [], []
    dk = torch.zeros_like(kc) if grads else None
    dv = torch.zeros_like(vc) if grads else None
    raw = 0.0
    sk = None if sinks is None else sinks.detach().to(compute)
    if sk is not None and rounding is not None:
        sk = sk.to(rounding).to(compute)
    for blk in query_blocks(b, nh, tq, tk):
        qb = q[:, :, blk].detach().to(compute).requires_grad_(grads)  # [B, Nh, rows, Dh]
        ab = None if allow is None else allow[..., blk, :] if allow.shape[-2] == tq else allow
        with torch.enable_grad() if grads else torch.no_grad():
            ob, rb = _attend(qb, kc, vc, ab, scale, rounding, scale_first, softcap, sk)
            if grads:
                gq, gk, gv = torch.autograd.grad(ob, (qb, kc, vc), d_out[:, :, blk].to(compute))
                dqs.append(gq)
                dk += gk  # type: ignore[operator]
                dv += gv  # type: ignore[operator]
        outs.append(ob.detach())
        raw = max(raw, float(rb))
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(b, nh, 0, v.shape[-1], dtype=compute)
    dq = (torch.cat(dqs, dim=2) if dqs else torch.zeros_like(q, dtype=compute)) if grads else None
    return Computed(out, dq, dk, dv, raw)


def accumulate_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """Where the plain computation in ``dtype`` accumulates: float32 for half precision, else ``dtype``."""
    import torch

    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def plain(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float, dtype: "torch.dtype",
          d_out: "Tensor | None" = None, softcap: float | None = None, sinks: "Tensor | None" = None) -> Computed:
    """The plain same-dtype computation in ``dtype`` (see the module docstring)."""
    acc = accumulate_dtype(dtype)
    return attention(q, k, v, allow, scale, compute=acc, rounding=None if acc == dtype else dtype, d_out=d_out,
                     softcap=softcap, sinks=sinks)


def plain_variants(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
                   dtype: "torch.dtype", d_out: "Tensor | None" = None, softcap: float | None = None,
                   sinks: "Tensor | None" = None) -> dict[str, Computed]:
    """The plain computations a correct kernel in ``dtype`` may be as inaccurate as.

    ``scale_first``: :func:`plain`. In half precision also ``textbook``: torch's own ops in the
    dtype itself, product first and scale after, with torch's autograd in the dtype (a kernel
    written the textbook way rounds the product and its backward differently, and is not wrong
    for it). With gradients also ``flash``: the backward every FlashAttention-style kernel runs
    (:func:`flash_backward`). Where a variant is not finite (the product overflows) it gives no
    error to scale by.
    """
    feats = {"softcap": softcap, "sinks": sinks}
    out = {"scale_first": plain(q, k, v, allow, scale, dtype, d_out, **feats)}
    if accumulate_dtype(dtype) != dtype:
        out["textbook"] = attention(q, k, v, allow, scale, compute=dtype, d_out=d_out, scale_first=False, **feats)
    if d_out is not None:
        out["flash"] = flash_backward(q, k, v, allow, scale, dtype, d_out, **feats)
    return out


def flash_backward(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
                   dtype: "torch.dtype", d_out: "Tensor", softcap: float | None = None,
                   sinks: "Tensor | None" = None) -> Computed:
    """The plain backward of a FlashAttention-style kernel, in ``dtype`` (rounded as :func:`plain`).

    It takes the row term from the output, ``D = rowsum(dO * O)``, where autograd through the
    softmax takes ``rowsum(dP * P)``: equal in exact arithmetic, not in rounding, and a kernel
    that does it this way is as right as one that does not. ``dS = P * (dP - D)``,
    ``dq = dS K scale``, ``dk = dS^T Q scale``, ``dv = P^T dO``, a query block at a time. A soft-cap
    multiplies dS by its derivative ``1 - tanh^2(s / C)``; a sink's column has no dP, so ``D`` stands.
    """
    import torch

    acc = accumulate_dtype(dtype)

    def r(t: "Tensor") -> "Tensor":
        return t if acc == dtype else t.to(dtype).to(acc)

    b, nh, tq, _ = q.shape
    tk, nkv = k.shape[-2], k.shape[1]
    kk = repeat_kv(k.detach().to(acc), nh)  # [B, Nh, Tk, Dh]
    vv = repeat_kv(v.detach().to(acc), nh)  # [B, Nh, Tk, Dv]
    dk = torch.zeros_like(kk)  # [B, Nh, Tk, Dh] per query head until the end
    dv = torch.zeros_like(vv)  # [B, Nh, Tk, Dv]
    outs, dqs = [], []
    sk = None if sinks is None else r(sinks.detach().to(acc))
    for blk in query_blocks(b, nh, tq, tk):
        qs = r(q[:, :, blk].detach().to(acc) * scale)  # [B, Nh, rows, Dh]
        s = r(torch.matmul(qs, kk.transpose(-2, -1)))  # [B, Nh, rows, Tk]
        t = None if softcap is None else torch.tanh(s / softcap)  # [B, Nh, rows, Tk]
        s = s if t is None else r(t * softcap)
        if allow is not None:
            ab = allow[..., blk, :] if allow.shape[-2] == tq else allow
            live = ab.any(dim=-1, keepdim=True)
            w = softmax_with(torch.where(ab, s, float("-inf")).where(live, 0.0), sk).where(live, 0.0)
        else:
            w = softmax_with(s, sk)  # [B, Nh, rows, Tk]
        w = r(w)
        o = r(torch.matmul(w, vv))  # [B, Nh, rows, Dv]
        do = r(d_out[:, :, blk].to(acc))  # [B, Nh, rows, Dv]
        dp = r(torch.matmul(do, vv.transpose(-2, -1)))  # [B, Nh, rows, Tk]
        row = (do * o).sum(dim=-1, keepdim=True)  # [B, Nh, rows, 1]: D from the output
        ds = r(w * (dp - row))  # [B, Nh, rows, Tk]
        if t is not None:
            ds = r(ds * (1.0 - t * t))  # through the soft-cap
        dqs.append(r(torch.matmul(ds, kk)) * scale)  # [B, Nh, rows, Dh]
        dk += torch.matmul(ds.transpose(-2, -1), qs)  # [B, Nh, Tk, Dh]
        dv += torch.matmul(w.transpose(-2, -1), do)  # [B, Nh, Tk, Dv]
        outs.append(o)
    group = nh // nkv
    dk = r(dk.reshape(b, nkv, group, tk, -1).sum(dim=2))  # [B, Nkv, Tk, Dh]
    dv = r(dv.reshape(b, nkv, group, tk, -1).sum(dim=2))  # [B, Nkv, Tk, Dv]
    return Computed(torch.cat(outs, dim=2), torch.cat(dqs, dim=2), dk, dv)


def plain_error(variants: dict[str, "Tensor"], ref: "Tensor", where: "Tensor") -> tuple[float, dict[str, float]]:
    """The largest error over the variants that are finite where judged (inf if none is), and each one's error."""
    errors = {name: max_over(row_diff(t.to(ref.dtype), ref), where) for name, t in variants.items()}
    finite = [e for e in errors.values() if math.isfinite(e)]
    return (max(finite) if finite else math.inf), errors


# --- the magnitude of the summands (the rounding bound) ----------------------------------------


@dataclass(frozen=True)
class Magnitudes:
    """Per element of out, dq, dk and dv, in float64: what rounding an error is made of.

    ``summands``: ``M``, the magnitude of the quantity's summands with the error the weights carry
    from the scores folded in; ``underflow``: ``U``, the same products over the weights below the
    dtype's smallest normal (each set to one, one added to each other factor), plus one for the
    result's own rounding, so that ``eps * tiny(dtype) * U`` bounds what underflow loses. ``lengths``: how many
    terms the longest sum behind each quantity adds (Tk for out and dq, the queries a kv head serves
    for dk and dv): rounding grows with it, as ``sqrt(n)`` in practice (:func:`judge_rounding`).
    """

    summands: Computed
    underflow: Computed
    lengths: tuple[tuple[str, int], ...] = ()  # (quantity, terms in its longest sum)
    accumulate: float = 1.0  # eps of the accumulating dtype over the case dtype's

    def length(self, quantity: str) -> int:
        return dict(self.lengths).get(quantity, 1)


# long: one derivation, each quantity's magnitude in turn, kept beside the formulas its docstring gives
def magnitudes(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
               d_out: "Tensor | None" = None, accumulate: float = 1.0, tiny: float = 0.0,
               softcap: float | None = None, sinks: "Tensor | None" = None) -> Magnitudes:
    """The magnitudes ``M`` (and ``U``) of attention's summands, a query block at a time, in float64.

    The forward error of a dot product is at most a multiple of eps times the sum of its terms'
    absolute values, whatever the order of summation. Carried through attention, with P the
    float64 weights and ``A = |q| |k|^T scale`` the scores' own magnitude:

    * a weight ``P = exp(s - L)`` errs by ``E = P (|s| + sum_j P |s| + 1 + log Tk + a (A + max_j A))``
      (eps units): its score rounded to the dtype, the log-sum-exp's error (the weighted mean of
      the scores'), exp's and the row maximum's own rounding, and the error of accumulating the
      product (``a`` = ``accumulate``: eps of the dtype it accumulates in over the dtype's eps, 1
      where both are the same, 2^-13 for float16 accumulating in float32), which a stored
      log-sum-exp carries too;
    * ``out = P V``: ``M = (P + E) |V|``;
    * ``dv = P^T dO``: ``M = (P + E)^T |dO|``;
    * ``dP = dO V^T``: ``|dP| <= |dO| |V|^T``; ``D = rowsum(P dP)``: ``|D| <= rowsum(P |dP|)``;
    * ``dS = P (dP - D)``: ``|dS| + err <= (P + E)(|dP| + |D|) + P rowsum(E |dP|)``;
    * ``dq = dS K scale``: ``M = |dS| |K| scale``; ``dk = dS^T Q scale``: ``M = |dS|^T |Q| scale``,
      summed over the query heads a kv head serves.

    A sum of n terms rounds about ``sqrt(n)`` times as much as one (Higham and Mary's probabilistic
    bound; blocked and pairwise orders do better): the score's error takes ``1 + a sqrt(Dh)``, and
    :func:`judge_rounding` multiplies ``M`` by ``1 + a sqrt(n)``, n the quantity's longest sum.

    With a soft-cap, P comes from the capped scores, and the errors keep the raw scores' magnitudes
    (the cap's derivative is at most one and ``|C tanh(s / C)| <= |s|``, so they bound the capped
    scores' errors, tanh's own rounding included). With sinks, P is the sink-normalised weights, and
    the log-sum-exp's error counts the sink's share times its logit.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]``.
        allow: bool broadcastable to ``[B, Nh, Tq, Tk]`` (True = may attend), or None.
        scale: the softmax scale.
        d_out: the upstream gradient ``[B, Nh, Tq, Dv]``, or None (no gradients).

    Returns:
        :class:`Magnitudes` with ``out`` (and ``dq``, ``dk``, ``dv`` given ``d_out``).
    """
    import torch

    f64 = torch.float64
    b, nh, tq, _ = q.shape
    tk, nkv = k.shape[-2], k.shape[1]
    kk = repeat_kv(k.detach().to(f64), nh)  # [B, Nh, Tk, Dh]
    vv = repeat_kv(v.detach().to(f64), nh)  # [B, Nh, Tk, Dv]
    ka, va = kk.abs(), vv.abs()
    sk = None if sinks is None else sinks.detach().to(f64)
    grads = d_out is not None
    m_out, u_out, m_dq, u_dq = [], [], [], []
    m_dk, u_dk = torch.zeros_like(kk), torch.zeros_like(kk)  # [B, Nh, Tk, Dh] per query head until the end
    m_dv, u_dv = torch.zeros_like(vv), torch.zeros_like(vv)  # [B, Nh, Tk, Dv]
    for blk in query_blocks(b, nh, tq, tk):
        qb = q[:, :, blk].detach().to(f64)  # [B, Nh, rows, Dh]
        qa = qb.abs()
        s = torch.matmul(qb, kk.transpose(-2, -1)) * scale  # [B, Nh, rows, Tk]
        a = torch.matmul(qa, ka.transpose(-2, -1)) * abs(scale)  # [B, Nh, rows, Tk]: |q| |k| scale
        if allow is None:
            ok = torch.ones_like(s, dtype=torch.bool)
        else:
            ab = allow[..., blk, :] if allow.shape[-2] == tq else allow
            ok = ab.expand_as(s)
        live = ok.any(dim=-1, keepdim=True)  # [B, Nh, rows, 1]
        p = softmax_with(torch.where(ok, capped(s, softcap), float("-inf")).where(live, 0.0), sk).where(live, 0.0)
        ones = (ok & live & (p < tiny)).to(f64)  # [B, Nh, rows, Tk]: allowed weights below the smallest normal, set to one
        sa = s.abs()
        row = (p * sa).sum(dim=-1, keepdim=True) + 1.0 + math.log(max(tk, 1) + (sk is not None))  # [B, Nh, rows, 1]
        if sk is not None:  # the sink's share times its logit: its term in the log-sum-exp
            row = row + (1.0 - p.sum(dim=-1, keepdim=True)).clamp_min(0.0) * sk.abs()[None, :, None, None]
        acc = accumulate * (1.0 + math.sqrt(q.shape[-1]))  # q . k sums Dh products at the accumulating precision
        row = row + acc * torch.where(ok, a, 0.0).amax(dim=-1, keepdim=True)
        e = p * (sa + acc * a + row)  # [B, Nh, rows, Tk]: the weights' error from the scores (eps units)
        w = p + e
        m_out.append(torch.matmul(w, va))  # [B, Nh, rows, Dv]
        u_out.append(torch.matmul(ones, va + 1.0))
        if grads:
            do = d_out[:, :, blk].detach().to(f64).abs()  # [B, Nh, rows, Dv]
            mp = torch.matmul(do, va.transpose(-2, -1))  # [B, Nh, rows, Tk]: |dP|
            md = (p * mp).sum(dim=-1, keepdim=True)  # [B, Nh, rows, 1]: |D|
            ms = w * (mp + md) + p * (e * mp).sum(dim=-1, keepdim=True)  # [B, Nh, rows, Tk]: |dS| and its error
            us = ones * (mp + md + 1.0)
            m_dq.append(torch.matmul(ms, ka) * abs(scale))  # [B, Nh, rows, Dh]
            u_dq.append(torch.matmul(us, ka + 1.0) * abs(scale))
            m_dk += torch.matmul(ms.transpose(-2, -1), qa) * abs(scale)  # [B, Nh, Tk, Dh]
            u_dk += torch.matmul(us.transpose(-2, -1), qa + 1.0) * abs(scale)
            m_dv += torch.matmul(w.transpose(-2, -1), do)  # [B, Nh, Tk, Dv]
            u_dv += torch.matmul(ones.transpose(-2, -1), do + 1.0)

    def cat(parts: list["Tensor"], width: int) -> "Tensor":
        return torch.cat(parts, dim=2) if parts else q.new_zeros(b, nh, 0, width, dtype=f64)

    def per_kv(t: "Tensor") -> "Tensor":
        return t.reshape(b, nkv, nh // nkv, tk, -1).sum(dim=2)  # [B, Nkv, Tk, D]

    out_m, out_u = cat(m_out, v.shape[-1]), cat(u_out, v.shape[-1]) + 1.0  # + 1: the result's own rounding
    lengths = (("out", tk), ("dq", tk), ("dk", tq * (nh // nkv)), ("dv", tq * (nh // nkv)))
    if not grads:
        return Magnitudes(Computed(out_m), Computed(out_u), lengths, accumulate)
    return Magnitudes(Computed(out_m, cat(m_dq, q.shape[-1]), per_kv(m_dk), per_kv(m_dv)),
                      Computed(out_u, cat(u_dq, q.shape[-1]) + 1.0, per_kv(u_dk) + 1.0, per_kv(u_dv) + 1.0),
                      lengths, accumulate)


@dataclass(frozen=True)
class Bounded:
    """One quantity judged elementwise by ``|err| <= c * eps * (M + tiny * U)``.

    ``ratio`` is the worst err / bound over the judged elements (inf where an element errs with a
    zero bound or is NaN against a number); ``wrong`` marks the judged rows [B, N, T] with an element
    past its bound; ``at`` locates the worst element; ``parts`` are the rule's parts there.
    """

    max_error: float
    ratio: float
    limit: float  # max_error / ratio: value <= limit exactly when every element is within its bound
    wrong: "Tensor"
    at: dict[str, int] | None
    parts: dict[str, Any]


def _first_worst(ratio: "Tensor") -> int:
    """The flat index of the first element whose ratio is the largest up to a part in 1e6: elements that
    tie but for their last bits (which differ between CPU capabilities) name the same element everywhere."""
    import torch

    flat = ratio.flatten()
    top = float(flat.max())
    near = flat == top if math.isinf(top) or top <= 0.0 else flat >= top * (1.0 - 1e-6)
    return int(torch.nonzero(near)[0])


def judge_rounding(got: "Tensor", ref: "Tensor", mags: Magnitudes, quantity: str, dtype: str, where: "Tensor",
                   names: tuple[str, str, str]) -> Bounded:
    """``got`` against ``ref`` (``[B, N, T, D]``, judged on the rows ``where`` [B|1, N|1, T|1]) by
    :func:`attn_ledger.tolerance.rounding`, with its parts as data."""
    import torch

    from attn_ledger.tolerance import rounding, tiny

    c, eps = rounding(quantity, dtype)
    n = mags.length(quantity)
    growth = 1.0 + mags.accumulate * math.sqrt(n)  # the sum's own rounding, at the accumulating precision
    m = getattr(mags.summands, quantity) * growth
    u = getattr(mags.underflow, quantity)
    floor = tiny(dtype)
    bound = c * eps * (m + floor * u)  # [B, N, T, D]
    both_nan = torch.isnan(got) & torch.isnan(ref)
    err = torch.nan_to_num((got - ref).abs(), nan=math.inf).masked_fill(both_nan, 0.0)  # [B, N, T, D]
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
    sel = where[..., None].expand_as(ratio)
    ratio = torch.where(sel, ratio, 0.0)
    err_j = torch.where(sel, err, 0.0)
    if ratio.numel() == 0 or not bool(sel.any()):
        return Bounded(0.0, 0.0, 0.0, where.new_zeros(ratio.shape[:-1]), None,
                       {"rule": "c * eps * M", "c": c, "eps": eps, "dtype": dtype})
    max_error = float(err_j.max())
    flat = _first_worst(ratio)
    idx = list(torch.unravel_index(torch.tensor(flat), ratio.shape))
    idx = [int(i) for i in idx]
    worst = float(ratio.flatten()[flat])
    at = {n: i for n, i in zip(names, idx[:3])}
    e_w, m_w, u_w, b_w = (float(t.flatten()[flat]) for t in (err, m, u, bound))
    if worst == 0.0:  # nothing erred: the loosest bound judged stands as the limit
        limit = float(torch.where(sel, bound, 0.0).max())
    elif math.isinf(worst):
        limit = b_w
    else:
        limit = max_error / worst
    parts = {"rule": "c * eps * M", "quantity": quantity, "dtype": dtype, "c": c, "eps": eps, "M": m_w,
             "terms": n, "growth": growth,
             "underflow": floor * u_w, "bound": b_w, "error": e_w, "ratio": worst, "max_error": max_error,
             "at": {**at, "dim": idx[3]}}
    return Bounded(max_error, worst, limit, (ratio > 1).any(dim=-1), at, parts)


def suites_view(quantity: str, error: float, plain_errors: dict[str, float]) -> dict[str, Any]:
    """The kernel suites' view of one error, as data beside the rule: flash-attention's limit (a factor
    times the plain same-dtype error) and PyTorch's (its fudge factor for the quantity times it)."""
    finite = [e for e in plain_errors.values() if math.isfinite(e)]
    plain_err = max(finite) if finite else math.inf
    view = {name: {"factor": rule["factor"][quantity], "limit": rule["factor"][quantity] * plain_err}
            for name, rule in SUITES.items()}
    return {"plain_error": plain_err, "plain_errors": dict(plain_errors), "suites": view}


# --- tolerance and distances ------------------------------------------------------------------

FACTOR = KERNEL_FACTOR
"""An implementation may be this many times less accurate than the plain same-dtype computation."""


def tolerance(dtype: str, plain_error: float, value_scale: float, score_max: float = 0.0) -> tuple[float, dict[str, Any]]:
    """The bound on a kernel's error against the reference, and its parts as data
    (:func:`attn_ledger.tolerance.kernel_bound`)."""
    return kernel_bound(dtype, plain_error, value_scale, score_max)


def row_diff(a: "Tensor", b: "Tensor") -> "Tensor":
    """Per row (all axes but the last): largest |a - b|; NaN against non-NaN is infinite, NaN against NaN zero."""
    import torch

    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.nan_to_num((a - b).abs(), nan=math.inf).masked_fill(both_nan, 0.0)
    return d.amax(dim=-1) if d.shape[-1] else d.sum(dim=-1)


def max_over(rows: "Tensor", where: "Tensor | None" = None) -> float:
    """Largest entry of ``rows`` where ``where`` holds (0 when nothing is selected)."""
    sel = rows if where is None else rows[where.expand_as(rows)]
    return float(sel.max()) if sel.numel() else 0.0


def first_row(mask: "Tensor", names: tuple[str, str, str] = ("example", "head", "query")) -> dict[str, int] | None:
    """The first True entry of a 3-d mask as a location, or None."""
    import torch

    idx = torch.nonzero(mask)
    if idx.numel() == 0:
        return None
    return {n: int(x) for n, x in zip(names, idx[0][:3])}


def worst_row(rows: "Tensor", where: "Tensor", names: tuple[str, str, str]) -> dict[str, int] | None:
    """The location of the largest entry of a 3-d ``rows`` where ``where`` holds, or None."""
    import torch

    masked = torch.where(where.expand_as(rows), rows, -math.inf)
    if masked.numel() == 0 or not bool((masked > -math.inf).any()):
        return None
    flat = int(torch.argmax(masked))
    idx = []
    for size in reversed(masked.shape):
        idx.append(flat % size)
        flat //= size
    return {n: int(x) for n, x in zip(names, reversed(idx))}
