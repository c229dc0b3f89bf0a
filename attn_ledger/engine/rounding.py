"""The ledger's stage tensors against float64 by the rounding rule: ``|err| <= c * eps(dtype) * M``.

``M`` is, per element, the magnitude of the element's summands: the same computation on
absolute values, in float64 (:func:`attn_ledger.probes.kernel.reference.magnitudes` carries it through a
kernel's output and gradients the same way). On the sampled rows of the reference, with
``A = |q| |k|^T |scale|`` the scores' own magnitude and P the float64 weights:

* scores ``s = q k^T scale``: ``M = A (1 + sqrt(Dh)) + |s|`` (a sum of Dh products, its own
  rounding, the scale's, and tanh's under a soft-cap, whose slope is at most one);
* weights ``P = exp(s - L)``: ``M = P (|s| + A (1 + sqrt(Dh)) + row)``, ``row`` the error of the
  row's log-sum-exp or normaliser (the weighted mean of the scores' errors, ``1 + sqrt(Tk)``
  for the sum over keys, the row maximum's rounding): what a weight inherits from its score
  and from its row;
* context ``P V``: ``M = (P + E) |V| (1 + sqrt(Tk))``, E the weights' bound in eps units.

The backward's stage tensors (``run --grad``) follow the same rule with ``M`` from
:func:`grad_magnitudes`. Half-precision runs count sums as accumulated in float32
(:func:`accumulation`) and allow a subnormal result its spacing.

``c`` per stage and dtype is :data:`attn_ledger.tolerance.ROUNDING_C` (``scores``,
``weights``, ``context``, ``grad_*``), with the measurement that set it. Rows a relation
leaves empty have ``M = 0``: there the pipeline must give what the reference gives, exactly.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from attn_ledger import tolerance
from attn_ledger.engine import measure as M
from attn_ledger.engine.measure import Agreement

if TYPE_CHECKING:
    from torch import Tensor

QUANTITY = {"scores": "scores", "weights": "weights", "context": "context", "grad_context": "grad_context",
            "grad_weights": "grad_weights", "grad_scores": "grad_scores", "grad_q": "grad_q", "grad_k": "grad_k",
            "grad_values": "grad_values", "grad_sinks": "grad_sinks", "grad_projections": "grad_projections",
            "grad_input": "grad_input"}  # the stage's c in ROUNDING_C


# long by its documented arguments (the bias among them); the code is one chain of bounds
def stage_magnitudes(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
                     softcap: float | None = None,
                     carried: "tuple[Tensor | None, Tensor | None, Tensor | None] | None" = None,
                     eps: float = 1.0, tiny: float = 0.0, accumulate: float = 1.0, *,
                     known: "tuple[Tensor, Tensor | None] | None" = None,
                     bias: "Tensor | None" = None, owned: bool = False) -> dict[str, "Tensor"]:
    """``M`` of the scores, weights and context, in float64.

    Args:
        q: ``[B, Nh, R, Dh]``; k: ``[B, Nkv, Tk, Dh]``; v: ``[B, Nkv, Tk, Dv]`` (any dtype; cast).
        allow: bool broadcastable to ``[B, Nh, R, Tk]`` (True = may attend), or None.
        softcap: the cap the scores pass through before the mask, or None.
        carried: the pipeline's own q, k, v as they enter the scores stage (``[B, Nh, R, Dh]``,
            ``[B, Nh, Tk, Dh]``, ``[B, Nh, Tk, Dv]``), where they are not the reference's: the
            error they already carry (a projection's or rotation's rounding, judged at its own
            stage) is carried through, ``(|dq| |k|^T + |q| |dk|^T + |dq| |dk|^T) |scale|`` into the scores
            and ``P |dv|`` into the context, in eps units; None: the reference's own (its zero terms left out).
        tiny: the dtype's smallest normal number: a weight below it is subnormal and keeps an
            absolute error of up to ``tiny * eps`` (float16's 6e-8), so each allowed weight's
            ``M`` gets ``tiny`` and the context ``tiny`` times the allowed values' sum.
        accumulate: eps of the precision sums accumulate in over the dtype's eps (:func:`accumulation`):
            1 for float32 and float64; half precision sums in float32 (torch's CPU kernels do), so a
            sum's ``sqrt(n)`` growth is ``2^-13`` (float16) or ``2^-16`` (bfloat16) of the dtype's
            rounding, while each result still rounds once to the dtype.
        known: the float64 reference's capped (and biased) scores and (where it has no sinks, else None)
            weights on these rows, from these q, k, v, computed already; without it both are computed here.
        bias: added to the (capped) scores, broadcastable to ``[B, Nh, R, Tk]``: its size joins each score's
            magnitude (the addition's rounding).
        owned: ``k`` and ``v`` are float64 copies the caller is done with: their magnitudes are taken in place,
            while the copies are still in cache, instead of into two more tensors of their size.

    Returns:
        ``{"scores", "weights": [B, Nh, R, Tk], "out": [B, Nh, R, Dv]}``.
    """
    import torch

    from attn_ledger.maths.reference import repeat_kv

    f64 = torch.float64
    nh, dh = q.shape[1], q.shape[-1]
    tk = k.shape[-2]
    qd = q.detach().to(f64)
    kk = repeat_kv(k.detach().to(f64), nh)  # [B, Nh, Tk, Dh]
    vv = repeat_kv(v.detach().to(f64), nh)  # [B, Nh, Tk, Dv]
    bb = None if bias is None else bias.detach().to(f64)
    if known is None:
        s = _capped_scores(qd, kk, scale, softcap)
        s, weights = (s if bb is None else s + bb), None
    else:
        s, weights = known  # the reference's scores, with the bias added already
    dq, dk, dv_in = (None if c is None else (c.detach().to(f64) - r).abs()  # |pipeline - reference|
                     for c, r in zip(carried or (None, None, None), (qd, kk, vv)))
    qa, ka, va = qd.abs(), (kk.abs_() if owned else kk.abs()), (vv.abs_() if owned else vv.abs())
    # in place on fresh tensors (a small sample's cost is its number of operations), in the order written out
    a = torch.matmul(qa, ka.transpose(-2, -1)).mul_(abs(scale))  # [B, Nh, R, Tk]: |q| |k| |scale|
    if bb is not None:
        a = a + bb.abs()
    acc = accumulate
    dot = 1.0 + acc * math.sqrt(dh)  # q . k sums Dh products
    m_scores = a.mul_(dot).add_(s.abs())  # a * dot + |s|
    by_carried = _carried_scores(dq, dk, qa, ka)
    if by_carried is not None:
        m_scores = m_scores.add_(by_carried.mul_(abs(scale) / eps))
    p, ok, live = _weights(s, allow, weights)
    err_s = torch.where(ok, m_scores, 0.0)  # [B, Nh, R, Tk]: each allowed score's bound (eps units)
    row = (p * err_s).sum(dim=-1, keepdim=True).add_(err_s.amax(dim=-1, keepdim=True)).add_(1.0)
    row = row.add_(acc * math.sqrt(max(tk, 1)))  # [B, Nh, R, 1]
    # the weights' bound (eps units), p (err_s + row) + tiny on allowed pairs (a row without one has none)
    e = torch.where(ok, (err_s + row).mul_(p).add_(tiny), 0.0)  # [B, Nh, R, Tk]
    m_out = torch.matmul(p + e, va).mul_(1.0 + acc * math.sqrt(max(tk, 1)))  # [B, Nh, R, Dv]
    if tiny:
        m_out = m_out.add_(tiny * live)
    if dv_in is not None:
        m_out = m_out + torch.matmul(p + e * eps, dv_in) / eps
    return {"scores": m_scores, "weights": e, "out": m_out, "p": p, "s": s, "row": row}


def _capped_scores(qd: "Tensor", kk: "Tensor", scale: float, softcap: float | None) -> "Tensor":
    """``q k^T scale`` ``[B, Nh, R, Tk]`` in float64, soft-capped where a cap is given."""
    import torch

    s = torch.matmul(qd, kk.transpose(-2, -1)) * scale  # [B, Nh, R, Tk]
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _weights(s: "Tensor", allow: "Tensor | None", weights: "Tensor | None") -> tuple["Tensor", "Tensor", "Tensor"]:
    """P, the float64 softmax of ``s`` over the allowed keys (``weights``: the reference's, computed already from
    the same masked scores), zero on rows with no allowed key; the allowed pairs ``[B, Nh, R, Tk]``; and the
    rows with one ``[B, Nh, R, 1]``."""
    import torch

    if allow is None:  # every pair allowed: every row live
        live = torch.ones((*s.shape[:-1], 1), dtype=torch.bool, device=s.device)
        return (torch.softmax(s, dim=-1) if weights is None else weights), torch.ones_like(s, dtype=torch.bool), live
    ok = allow.expand_as(s)
    has = allow.any(dim=-1, keepdim=True)  # [B|1, Nh|1, R, 1]: rows with an allowed key
    live = has.expand(*s.shape[:-1], 1)  # [B, Nh, R, 1]
    if weights is None:
        weights = torch.softmax(torch.where(ok, s, float("-inf")).where(live, 0.0), dim=-1)
    return (weights if bool(has.all()) else weights.where(live, 0.0)), ok, live


def _carried_scores(dq: "Tensor | None", dk: "Tensor | None", qa: "Tensor", ka: "Tensor") -> "Tensor | None":
    """``|dq| |k|^T + (|q| + |dq|) |dk|^T`` ``[B, Nh, R, Tk]``: what the errors q and k carry into the scores
    (``qa``, ``ka``: ``|q|``, ``|k|``); a term whose error is None (zero) is left out, None where both are."""
    import torch

    found = None if dq is None else torch.matmul(dq, ka.transpose(-2, -1))
    if dk is not None:
        by_k = torch.matmul(qa if dq is None else qa + dq, dk.transpose(-2, -1))
        found = by_k if found is None else found + by_k
    return found


# long: one chain of bounds, stage after stage, as the backward computes them
def grad_magnitudes(q: "Tensor", k: "Tensor", v: "Tensor", go: "Tensor", allow: "Tensor | None", scale: float,
                    softcap: float | None = None, carried: "dict[str, Tensor] | None" = None,
                    eps: float = 1.0, tiny: float = 0.0,
                    accumulate: float = 1.0, sinks: "Tensor | None" = None) -> dict[str, "Tensor"]:
    """``M`` of the backward's stage tensors on the sampled rows, in float64 and in units of ``eps``.

    Each product ``z = x y`` summing ``n`` terms errs by at most ``(1 + sqrt(n)) |x| |y|`` of its own
    plus what its factors carry, ``e_x |y| + |x| e_y + eps e_x e_y`` (``e`` a factor's bound in eps
    units). Carried stage by stage, P the float64 weights and E their bound (:func:`stage_magnitudes`):

    * ``A-bar = O-bar V^T`` (Dv terms): ``|A-bar| <= |O-bar| |V|^T``;
    * ``V-bar = P^T O-bar`` (the rows' terms, summed over the query heads a kv head serves);
    * ``D = rowsum(P A-bar)`` and ``S-bar = P (A-bar - D)`` with the subtraction's and product's rounding;
    * under a soft-cap, ``S-bar`` times the cap's slope ``1 - (capped / C)^2``, whose error follows the scores';
    * ``Q-bar = scale S-bar K`` (Tk terms) and ``K-bar = scale S-bar^T Q`` (the rows' terms, per query head);
    * with sinks, the sinks' gradient ``-sum over examples and rows of share * D`` (:func:`sinks_magnitude`).

    Args:
        q: ``[B, Nh, R, Dh]`` the reference's queries on the sampled rows, as they enter the scores
            (rotated); k, v: ``[B, Nkv, Tk, *]`` likewise; go: ``O-bar`` ``[B, Nh, R, Dv]`` (the reference's).
        carried: the error the pipeline's own tensors carry against these, ``|pipeline - reference|``:
            ``q`` ``[B, Nh, R, Dh]``, ``k`` ``[B, Nh, Tk, Dh]``, ``v`` ``[B, Nh, Tk, Dv]`` (kv heads
            expanded), ``go`` ``[B, Nh, R, Dv]``; missing ones are zero.
        eps: the run dtype's epsilon (the carried errors are divided by it); tiny: its smallest normal
            number (every result may underflow by ``tiny * eps``, as in :func:`stage_magnitudes`);
            accumulate: as :func:`stage_magnitudes` takes it.

    Returns:
        ``grad_weights``, ``grad_scores`` ``[B, Nh, R, Tk]``; ``grad_q`` ``[B, Nh, R, Dh]`` and
        ``grad_k`` ``[B, Nh, Tk, Dh]`` (rotated, per query head), ``grad_values`` ``[B, Nh, Tk, Dv]``
        (per query head); and ``mag_q``, ``mag_k``: the bounds on |Q-bar|, |K-bar| themselves; with ``sinks``
        ``[Nh]``, ``grad_sinks`` ``[Nh]``.
    """
    import torch

    from attn_ledger.maths.reference import repeat_kv

    f64 = torch.float64
    nh, r, tk = q.shape[1], q.shape[2], k.shape[-2]
    group = nh // k.shape[1]
    kk, vv = (repeat_kv(t.detach().to(f64), nh) for t in (k, v))  # [B, Nh, Tk, *]
    qd, gd = q.detach().to(f64), go.detach().to(f64)
    carried = carried or {}

    def err(key: str, like: "Tensor") -> "Tensor":
        t = carried.get(key)
        return torch.zeros_like(like) if t is None else t.detach().to(f64) / eps

    eq, ek, ev, eg = err("q", qd), err("k", kk), err("v", vv), err("go", gd)
    pipe = None if not carried else (qd + eq * eps, kk + ek * eps, vv + ev * eps)
    fw = stage_magnitudes(qd, k, v, allow, scale, softcap, pipe, eps, tiny, accumulate)
    acc = accumulate
    p, e, err_s, s = fw["p"], fw["weights"], fw["scores"], fw["s"]
    qa, ka, va, ga = qd.abs(), kk.abs(), vv.abs(), gd.abs()
    vt, evt = va.transpose(-2, -1), ev.transpose(-2, -1)
    mp = torch.matmul(ga, vt)  # [B, Nh, R, Tk]: |A-bar|
    e_p = mp * (1.0 + acc * math.sqrt(v.shape[-1])) + torch.matmul(eg, vt) + torch.matmul(ga, evt) + eps * torch.matmul(eg, evt)
    n_rows = 1.0 + acc * math.sqrt(max(1, r * group))
    pt, et = p.transpose(-2, -1), e.transpose(-2, -1)
    e_v = (torch.matmul(pt, ga) * n_rows + torch.matmul(et, ga) + torch.matmul(pt, eg)
           + eps * torch.matmul(et, eg))  # [B, Nh, Tk, Dv]
    md = (p * mp).sum(dim=-1, keepdim=True)  # [B, Nh, R, 1]: |D|
    e_d = md * (1.0 + acc * math.sqrt(max(tk, 1))) + (e * mp + p * e_p + eps * e * e_p).sum(dim=-1, keepdim=True)
    ms = p * (mp + md)  # [B, Nh, R, Tk]: |S-bar|
    e_s = e * (mp + md) + (p + eps * e) * (e_p + e_d) + 2.0 * ms + tiny
    if softcap is None:
        ms_c, e_c = ms, e_s
    else:  # through the slope 1 - (capped / C)^2 (in [0, 1]); its error follows the capped score's
        fin = torch.isfinite(s)
        slope = torch.where(fin, 1.0 - (s / softcap) ** 2, 0.0).abs()
        e_sl = torch.where(fin, 2.0 * s.abs() / softcap ** 2 * err_s + 3.0, 0.0)
        ms_c = ms * slope
        e_c = e_s * slope + ms * e_sl + eps * e_s * e_sl + ms_c
    sc = abs(scale)
    mq = torch.matmul(ms_c, ka) * sc  # [B, Nh, R, Dh]: |Q-bar|
    e_q = (mq * (2.0 + acc * math.sqrt(max(tk, 1))) + (torch.matmul(e_c, ka) + torch.matmul(ms_c, ek)
                                                 + eps * torch.matmul(e_c, ek)) * sc)
    ct, ect = ms_c.transpose(-2, -1), e_c.transpose(-2, -1)
    mk = torch.matmul(ct, qa) * sc  # [B, Nh, Tk, Dh]: |K-bar| per query head
    e_k = mk * (1.0 + n_rows) + (torch.matmul(ect, qa) + torch.matmul(ct, eq) + eps * torch.matmul(ect, eq)) * sc
    found = {"grad_weights": e_p + tiny, "grad_scores": e_s, "grad_q": e_q + tiny, "grad_k": e_k + tiny,
             "grad_values": e_v + tiny,
             "mag_q": mq, "mag_k": mk}
    if sinks is not None:
        found["grad_sinks"] = sinks_magnitude(sinks, s, allow, md, e_d, fw["row"], eps, tiny, acc)
    return found


def sinks_magnitude(sinks: "Tensor", s: "Tensor", allow: "Tensor | None", md: "Tensor", e_d: "Tensor",
                    row: "Tensor", eps: float, tiny: float, accumulate: float) -> "Tensor":
    """``M`` of the sinks' gradient ``-sum_{b, i} share * D`` per head, ``[Nh]``, in units of ``eps``.

    ``share = sigmoid(x)``, ``x = sink - logsumexp(s)`` over the allowed keys: ``x`` errs by the row's
    normaliser error ``row`` and its own rounding ``|x|``, and the sigmoid's slope is ``share (1 - share)``,
    so ``e_share = share (1 - share) (row + |x|) + share``. Each term ``share * D`` errs by
    ``e_share |D| + share e_D + eps e_share e_D`` plus its own rounding, and the sum over the ``n``
    examples and rows of a head by ``(1 + sqrt(n))`` times the terms' sizes. A row with no allowed key
    (share 1, ``D`` 0) adds nothing.

    Args:
        sinks: ``[Nh]``; s: the float64 scores ``[B, Nh, R, Tk]`` (after any cap); allow: as the scores'.
        md, e_d: ``|D|`` and its bound ``[B, Nh, R, 1]`` (:func:`grad_magnitudes`); row: the row's
            normaliser bound ``[B, Nh, R, 1]`` (:func:`stage_magnitudes`).
    """
    import torch

    f64 = torch.float64
    ok = torch.ones_like(s, dtype=torch.bool) if allow is None else allow.expand_as(s)
    live = ok.any(dim=-1, keepdim=True)  # [B, Nh, R, 1]
    lse = torch.logsumexp(torch.where(ok, s, float("-inf")), dim=-1, keepdim=True)  # [B, Nh, R, 1]
    x = torch.where(live, sinks.detach().to(f64).reshape(1, -1, 1, 1) - lse, 0.0)
    share = torch.where(live, torch.sigmoid(x), 0.0)
    e_share = share * (1.0 - share) * (row + x.abs()) + share
    term = share * md
    e_term = e_share * md + share * e_d + eps * e_share * e_d + term
    n = s.shape[0] * s.shape[2]  # terms per head
    return (e_term + term * (1.0 + accumulate * math.sqrt(max(1, n)))).sum(dim=(0, 2, 3)) + tiny  # [Nh]


def chain_magnitudes(grads: "dict[str, Tensor]", carried: "dict[str, Tensor]", x: "Tensor", x_kv: "Tensor | None",
                     weights: "tuple[Tensor, Tensor, Tensor]", go: "Tensor", picked: "Tensor", eps: float,
                     tiny: float = 0.0, accumulate: float = 1.0) -> dict[str, "Tensor"]:
    """``M`` of the built-in pipeline's last backward stages, in float64 and in units of ``eps``: the
    projection weights' gradients ``W-bar = y-bar^T x`` (summed over B and the rows) and the input's
    ``x-bar = Q-bar W_q + K-bar W_k + V-bar W_v`` (per cross-attention side), on what the sampled rows give.

    Each product ``a b`` summing ``n`` terms, ``a`` carrying ``e_a`` (eps units) and ``b`` exact (an
    input or a weight), errs by at most ``|a| |b| (1 + sqrt(n)) + e_a |b| (1 + eps (1 + sqrt(n)))``;
    each addition of two such products rounds once more, by at most the sum of their magnitudes.

    Args:
        grads: the float64 reference's ``q`` ``[B, Nh, R, Dh]`` (the sampled rows ``picked``), ``k``
            ``[B, Nkv, Tk, Dh]``, ``v`` ``[B, Nkv, Tk, Dv]`` (what those rows give) and ``merged``, its
            context with the heads merged, ``[B, R, Nh*Dv]``.
        carried: the error each carries, shaped alike, in eps units (what the pipeline's own tensors
            carry: :func:`attn_ledger.engine.backward_rows.chain_rounding`).
        x: ``[B, Tq, E]``; x_kv: ``[B, Tk, E]`` for cross-attention, None for self-attention.
        weights: ``wq [Nh*Dh, E]``, ``wk [Nkv*Dh, E]``, ``wv [Nkv*Dv, E]``; go: ``O-bar`` of the output on the
            sampled rows ``[B, R, E]``; picked: ``[R]`` the sampled rows.
        tiny, accumulate: as :func:`stage_magnitudes` takes them.

    Returns:
        ``wq``, ``wk``, ``wv`` ``[out, in]``, ``wo`` ``[E, Nh*Dv]``, ``x`` ``[B, Tq, E]`` and, for
        cross-attention, ``x_kv`` ``[B, Tk, E]``.
    """
    import torch

    from attn_ledger.maths.reference import join_heads

    f64 = torch.float64
    product = functools.partial(_product, eps=eps, accumulate=accumulate)

    def flat(t: "Tensor") -> "Tensor":
        return t.reshape(-1, t.shape[-1])  # [B*T, D]

    g = {n: (join_heads(t.to(f64)) if t.dim() == 4 else t.to(f64)) for n, t in grads.items()}  # [B, T, N*D]
    e = {n: (join_heads(t.to(f64)) if t.dim() == 4 else t.to(f64)) for n, t in carried.items()}
    xs = x.to(f64)
    kv = xs if x_kv is None else x_kv.to(f64)
    wq, wk, wv = weights
    b, r = go.shape[0], picked.numel()
    n_rows, n_keys = b * r, b * kv.shape[1]
    found = {"wq": product(flat(g["q"]).T, flat(e["q"]).T, flat(xs[:, picked]), n_rows)[0],  # [Nh*Dh, E]
             "wk": product(flat(g["k"]).T, flat(e["k"]).T, flat(kv), n_keys)[0],  # [Nkv*Dh, E]
             "wv": product(flat(g["v"]).T, flat(e["v"]).T, flat(kv), n_keys)[0],  # [Nkv*Dv, E]
             "wo": product(flat(g["merged"]).T, flat(e["merged"]).T, flat(go), n_rows)[0].T}  # [E, Nh*Dv]
    gq, eq = (torch.zeros(b, xs.shape[1], t.shape[-1], dtype=f64, device=t.device) for t in (g["q"], e["q"]))
    gq[:, picked], eq[:, picked] = g["q"], e["q"]  # [B, Tq, Nh*Dh]: rows outside the sample give nothing
    m_q, size_q = product(gq, eq, wq, wq.shape[0])  # [B, Tq, E]
    m_k, size_k = product(g["k"], e["k"], wk, wk.shape[0])  # [B, Tk, E]
    m_v, size_v = product(g["v"], e["v"], wv, wv.shape[0])
    if x_kv is None:  # x-bar = Q-bar W_q + (K-bar W_k + V-bar W_v): two additions
        found["x"] = m_q + m_k + m_v + (size_k + size_v) + (size_q + size_k + size_v)
    else:
        found["x"] = m_q
        found["x_kv"] = m_k + m_v + (size_k + size_v)
    return {name: m + tiny for name, m in found.items()}  # every result may underflow by tiny * eps


def _product(a: "Tensor", e_a: "Tensor", b: "Tensor", n: int, eps: float,
             accumulate: float) -> "tuple[Tensor, Tensor]":
    """The bound of ``a @ b`` summing ``n`` terms (``a`` carrying ``e_a``, eps units; ``b`` exact), and the
    magnitude of the result itself, for an addition after it: both in float64, in units of ``eps``."""
    import torch

    bb = b.to(torch.float64).abs()
    grow = 1.0 + accumulate * math.sqrt(max(n, 1))
    size = torch.matmul(a.abs(), bb)
    spread = torch.matmul(e_a, bb)
    return size * grow + spread * (1.0 + eps * grow), size + eps * spread


def unrotated(m: "Tensor", mag: "Tensor", spec: Any) -> "Tensor":
    """A bound through the inverse rotation (cos and sin at most 1 in size, products in float64, one
    rounding): each feature of a rotated pair takes both features' bounds and one unit of their size."""
    if spec is None:
        return m
    from attn_ledger.maths.rotary import pair_indices

    first, second = (i.to(m.device) for i in pair_indices(spec.pairing, spec.width(m.shape[-1])))
    out = m.clone()
    both = m[..., first] + m[..., second] + mag[..., first] + mag[..., second]  # [..., P]
    out[..., first] = both
    out[..., second] = both
    return out


def per_kv(t: "Tensor", n_kv: int) -> "Tensor":
    """``[B, Nh, T, D]`` summed over the query heads each kv head serves: ``[B, Nkv, T, D]``."""
    b, nh = t.shape[0], t.shape[1]
    return t.reshape(b, n_kv, nh // n_kv, *t.shape[2:]).sum(dim=2)


def accumulation(dtype: str) -> float:
    """``accumulate`` of :func:`stage_magnitudes` for a run in ``dtype``: float32's eps over the dtype's in
    half precision (sums accumulate in float32), 1 otherwise."""
    return tolerance.EPS["float32"] / tolerance.EPS[dtype] if tolerance.is_half(dtype) else 1.0


def agreement(stage: str, of: str, got: "Tensor", ref: "Tensor", m: "Tensor", dtype: str, q0: int = 0,
              k0: int | None = 0, **kw: Any) -> Agreement:
    """``got`` against ``ref`` elementwise within ``c * eps * M``: the largest |difference| (``diff``),
    ``excess`` = worst error / bound - 1 (``<= 0`` within), and the rule's parts at the worst element.

    An element that errs where its bound is zero, or is NaN against a number, has an infinite
    ratio; NaN against NaN and equal infinities agree.
    """
    import torch

    c, eps = tolerance.rounding(QUANTITY[stage], dtype)
    base = {"rule": "c * eps * M", "quantity": QUANTITY[stage], "stage": stage, "dtype": dtype, "c": c, "eps": eps}
    if got.numel() == 0 or got.shape != ref.shape:
        return Agreement(stage, of, "float64", 0.0 if got.numel() == 0 else math.nan,
                         -1.0 if got.numel() == 0 else math.nan, parts=base, **kw)
    g, r = got, ref.to(torch.float64)
    err = (g - r).abs_()  # [B, Nh, R, *], in float64 (a half or float32 ``got`` is promoted exactly)
    bound = m * (c * eps)
    if m.shape == err.shape:  # one transfer: the largest error (NaN or infinite where any is), the least bound
        diff, least = torch.stack([err.amax(), bound.amin()]).tolist()
    else:
        diff, least = float(err.amax()), math.nan
    if math.isfinite(diff) and least >= 0.0:  # every error finite, every bound a number
        flat, worst, e_w, m_w = _worst_ratio(err, bound, m, least == 0.0)
    else:  # a NaN or an infinity on either side, or a bound that is NaN
        if not math.isfinite(diff):
            same = (torch.isnan(g) & torch.isnan(r)) | (torch.isinf(g) & (g == r))
            err = torch.nan_to_num(err, nan=math.inf).masked_fill(same, 0.0)
            diff = float(err.amax())
        ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
        flat = int(torch.argmax(ratio))
        worst, e_w, m_w = torch.stack([t.reshape(-1)[flat] for t in (ratio, err, m)]).tolist()
    b_w = (c * eps) * m_w  # the bound at the worst element, as ``bound`` holds it
    parts = {**base, "M": m_w, "bound": b_w, "error": e_w, "ratio": worst, "max_error": diff}
    where = M.where_in(M.unravel(flat, tuple(err.shape)), q0, k0) if worst > 1.0 else None
    return Agreement(stage, of, "float64", diff, worst - 1.0, where=where, parts=parts, **kw)


def _worst_ratio(err: "Tensor", bound: "Tensor", m: "Tensor", zero: bool) -> tuple[int, float, float, float]:
    """The element with the largest error / bound (the first, on a tie), where every error is finite and every
    bound is a number >= 0 (``zero``: some bound is 0): its flat index, ratio, error and ``M``. ``bound`` is
    overwritten.

    A bound of zero takes an infinite ratio where its element errs and zero where it does not; a bound below
    1e-300 counts as 1e-300. Written without a select on a boolean mask, and with few operations: each
    costs here more than the arithmetic on a few thousand elements."""
    import torch

    if zero:  # x / 0 is infinite where x > 0 and NaN where x == 0, which counts as 0
        live = bound.abs().sign_()  # 1 where the bound is positive, 0 where it is zero
        ratio = torch.div(err, bound.clamp_min_(1e-300).mul_(live)).nan_to_num_(nan=0.0, posinf=math.inf)
    else:
        ratio = torch.div(err, bound.clamp_min_(1e-300))
    worst, at = ratio.reshape(-1).max(dim=0)
    flat = int(at)
    m_at = m.view(-1)[flat] if m.is_contiguous() else m[M.unravel(flat, tuple(m.shape))]
    worst, e_w, m_w = torch.stack([worst, err.reshape(-1)[flat], m_at.to(worst.dtype)]).tolist()
    return flat, worst, e_w, m_w


def limit_of(a: Agreement) -> float:
    """The bound on the largest |difference| that holds exactly when every element is within its own:
    ``diff / ratio`` (the worst element's bound where the ratio is infinite or zero)."""
    ratio = 1.0 + (a.excess if a.excess is not None else math.nan)
    bound = (a.parts or {}).get("bound", 0.0)
    if math.isnan(ratio):
        return bound
    if ratio == 0.0 or math.isinf(ratio):
        return bound if ratio else max(bound, a.diff)
    return a.diff / ratio
