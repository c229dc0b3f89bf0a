"""Read an observed attention core's weights: which keys each query uses, and what its scores are.

Given the core's q and k as they entered it (``[B, Nh, Tq, D]``, ``[B, Nh, Tk, D]`` with k
already paired to the query heads), its weights ``W`` and its weights with q zeroed ``W0``
(both ``[B, Nh, Tq, Tk]``, from :func:`attn_ledger.probes.common.observe.probe_weights`):

* the **relation** is where ``W0 > 0``: with every score 0, a key keeps a positive weight
  exactly when the mask allows it (:func:`relation_of` names it: causal, sliding window W,
  prefix-LM, packed sequences, bidirectional, ...);
* the **position bias** is ``log W0`` up to a per-query constant: zero for plain
  attention, linear in the distance per head for ALiBi, a function of ``j - i`` for a learned
  relative bias (T5), something else otherwise (:func:`recognise_bias`);
* the **scale** follows from ``log W - log W0 = s * q.k`` up to a per-query constant, a
  least-squares line per head; when no line fits, ``cap * tanh(s * q.k / cap)`` is tried
  (logit soft-capping, as in Gemma 2) (:func:`fit_scores`).

Everything here is float64 and pure: tensors in, small records out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BiasFit", "ScoreFit", "fit_scores", "logit_tolerance", "recognise_bias", "relation_of", "compare_relations"]


def logit_tolerance(dtype: "torch.dtype", magnitude: float) -> float:
    """How far a logit read back from weights computed in ``dtype`` may be off (:func:`attn_ledger.tolerance.logit`)."""
    from attn_ledger import tolerance

    return tolerance.logit(dtype, magnitude)


# --- relations ------------------------------------------------------------------------------

def relation_of(allow: "torch.Tensor") -> dict:
    """Name the relation of an allow pattern ``[Tq, Tk]`` (True = the query may use the key).

    Returns:
        ``{"relation": name, "text": words, ...parameters}`` with names ``bidirectional``,
        ``causal``, ``sliding-window`` (``window``: keys i-W+1..i), ``prefix-lm``
        (``prefix_len``), ``segments`` (``lengths``, ``within``: bidirectional or causal),
        ``local-window`` (``window``: |i - j| < W), ``strictly-causal`` (the diagonal blocked),
        ``future-only``, ``no-keys`` or ``other`` (``allowed_pairs``).
    """
    import torch

    tq, tk = allow.shape
    a = allow.to(torch.bool)
    i = torch.arange(tq)[:, None]
    j = torch.arange(tk)[None, :]
    if bool(a.all()):
        return {"relation": "bidirectional", "text": "bidirectional"}
    if not bool(a.any()):
        return {"relation": "no-keys", "text": "no keys at all"}
    if tq == tk:
        named = _square_relation(a, i, j)
        if named is not None:
            return named
    n = int(a.sum())
    return {"relation": "other", "text": f"other ({n} of {tq * tk} query-key pairs)", "allowed_pairs": n}


def _square_relation(a: "torch.Tensor", i: "torch.Tensor", j: "torch.Tensor") -> dict | None:
    import torch

    t = a.shape[0]
    causal = j <= i
    if torch.equal(a, causal):
        return {"relation": "causal", "text": "causal"}
    w = int(a.sum(-1).max())
    if torch.equal(a, causal & (j > i - w)):
        return {"relation": "sliding-window", "text": f"sliding window {w}", "window": w}
    p = 0
    while p < t and bool(a[:, p].all()):
        p += 1
    if p and torch.equal(a, causal | (j < p)):
        return {"relation": "prefix-lm", "text": f"prefix-LM {p}", "prefix_len": p}
    if torch.equal(a, j < i):
        return {"relation": "strictly-causal", "text": "strictly causal (the diagonal blocked)"}
    if torch.equal(a, j > i) or torch.equal(a, j >= i):
        return {"relation": "future-only", "text": "future keys only (causal inverted)"}
    half = (w + 1) // 2
    if torch.equal(a, (i - j).abs() < half):
        return {"relation": "local-window", "text": f"local window {half} on both sides", "window": half}
    return _segments(a, i, j)


def _segments(a: "torch.Tensor", i: "torch.Tensor", j: "torch.Tensor") -> dict | None:
    """Blocks of packed sequences: no allowed pair crosses a boundary; bidirectional or causal inside."""
    import torch

    t = a.shape[0]
    cuts = [s for s in range(1, t) if not bool(a[s:, :s].any()) and not bool(a[:s, s:].any())]
    if not cuts:
        return None
    bounds = [0, *cuts, t]
    seg = torch.zeros(t, dtype=torch.long)
    for n, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        seg[lo:hi] = n
    same = seg[:, None] == seg[None, :]
    lengths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    for within, inside in (("bidirectional", same), ("causal", same & (j <= i))):
        if torch.equal(a, inside):
            return {"relation": "segments", "text": f"packed sequences {lengths} ({within} within)",
                    "lengths": lengths, "within": within}
    return None


def compare_relations(applied: "torch.Tensor", declared: "torch.Tensor") -> dict:
    """How an applied allow pattern ``[Tq, Tk]`` differs from the declared one.

    Returns:
        ``{"comparison": same|narrower|wider|different, "extra_pairs", "missing_pairs",
        "first_extra": [i, j] or None, "first_missing": [i, j] or None}``.
    """
    extra = applied & ~declared
    missing = declared & ~applied
    ne, nm = int(extra.sum()), int(missing.sum())
    comparison = "same" if ne == nm == 0 else "narrower" if ne == 0 else "wider" if nm == 0 else "different"
    first = (lambda m: [int(v) for v in m.nonzero()[0]] if bool(m.any()) else None)
    return {"comparison": comparison, "extra_pairs": ne, "missing_pairs": nm, "first_extra": first(extra),
            "first_missing": first(missing)}


# --- the scores -----------------------------------------------------------------------------

def _centre(x: "torch.Tensor", m: "torch.Tensor") -> "torch.Tensor":
    """``x`` minus its mean over the keys in ``m`` (both ``[..., Tk]``), zero outside ``m``."""
    import torch

    xm = torch.where(m, x, torch.zeros_like(x))
    cnt = m.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(m, xm - xm.sum(-1, keepdim=True) / cnt, torch.zeros_like(x))


@dataclass(frozen=True)
class BiasFit:
    """The additive term left in the logits when every score is zero.

    Attributes:
        kind: ``none``, ``alibi`` (``-slope_h * |i - j|``), ``relative`` (a function of
            ``j - i`` per head), ``content`` (it changes with the input: not a position bias)
            or ``other`` (a position bias of another form).
        magnitude: max |bias| after taking out each query's constant.
        residual: the misfit of the recognised form (0 for ``none``).
        tolerance: the logit tolerance it was judged with.
        slopes: ALiBi's per-head slopes.
        standard_slopes: the slopes are ALiBi's geometric ``2 ** (-8 (h + 1) / Nh)``.
    """

    kind: str
    magnitude: float
    residual: float
    tolerance: float
    slopes: tuple[float, ...] = ()
    standard_slopes: bool = False

    @property
    def recognised(self) -> bool:
        return self.kind in ("none", "alibi", "relative")


def recognise_bias(w0: "torch.Tensor", dtype: "torch.dtype") -> tuple[BiasFit, "torch.Tensor"]:
    """The position bias in the zero-score weights ``w0 [B, Nh, Tq, Tk]``, and the bias itself.

    Returns:
        ``(fit, bias)`` where ``bias [B, Nh, Tq, Tk]`` is ``log w0`` centred per query over
        the allowed keys (0 elsewhere).
    """
    import torch

    w0 = w0.to(torch.float64)
    m = w0 > 0
    logw = torch.where(m, w0.clamp_min(1e-300).log(), torch.zeros_like(w0))
    bias = _centre(logw, m)  # [B, Nh, Tq, Tk]
    magnitude = float(bias.abs().max()) if bias.numel() else 0.0
    tol = logit_tolerance(dtype, magnitude)
    if magnitude <= tol:
        return BiasFit("none", magnitude, 0.0, tol), bias
    same_mask = bool((m == m[:1]).all())
    spread = float((bias - bias[:1]).abs().max())
    if not same_mask or spread > tol:
        return BiasFit("content", magnitude, spread, tol), bias
    alibi = _alibi(bias[0], m[0], tol)
    if alibi is not None:
        return alibi, bias
    rel = _relative_residual(bias[0], m[0])
    if rel <= tol:
        return BiasFit("relative", magnitude, rel, tol), bias
    return BiasFit("other", magnitude, rel, tol), bias


def _alibi(bias: "torch.Tensor", m: "torch.Tensor", tol: float) -> BiasFit | None:
    """``bias [Nh, Tq, Tk] = -slope_h * |i - j|`` (up to a per-query constant), or None."""
    import torch

    nh, tq, tk = bias.shape
    dist = -(torch.arange(tq)[:, None] - torch.arange(tk)[None, :]).abs().to(torch.float64)  # [Tq, Tk]
    dc = _centre(dist.expand(nh, tq, tk), m)  # [Nh, Tq, Tk]
    denom = dc.square().sum(dim=(1, 2))  # [Nh]
    if bool((denom == 0).any()):
        return None
    slopes = (bias * dc).sum(dim=(1, 2)) / denom  # [Nh]
    residual = float((bias - slopes[:, None, None] * dc).abs().max())
    if residual > tol:
        return None
    standard = [2.0 ** (-8.0 * (h + 1) / nh) for h in range(nh)]
    is_standard = all(math.isclose(float(s), r, rel_tol=1e-3) for s, r in zip(slopes, standard))
    return BiasFit("alibi", float(bias.abs().max()), residual, tol, tuple(float(s) for s in slopes), is_standard)


def _relative_residual(bias: "torch.Tensor", m: "torch.Tensor") -> float:
    """The misfit of ``bias [Nh, Tq, Tk] = t_h[j - i] + r_h[i]`` over the allowed pairs (least squares)."""
    import torch

    nh, tq, tk = bias.shape
    worst = 0.0
    for h in range(nh):
        i, j = m[h].nonzero(as_tuple=True)
        a = torch.zeros(len(i), (tq + tk - 1) + tq, dtype=torch.float64)  # one column per offset, one per query
        rows = torch.arange(len(i))
        a[rows, j - i + tq - 1] = 1.0
        a[rows, tq + tk - 1 + i] = 1.0
        y = bias[h][i, j]
        sol = torch.linalg.lstsq(a, y[:, None], driver="gelsd").solution  # [(Tq+Tk-1)+Tq, 1], rank-deficient by one
        worst = max(worst, float((a @ sol).flatten().sub(y).abs().max()) if len(i) else 0.0)
    return worst


@dataclass(frozen=True)
class ScoreFit:
    """The logits explained as a function of q.k, head by head.

    Attributes:
        form: ``linear`` (``s * q.k``), ``softcap`` (``cap * tanh(s * q.k / cap)``), or
            ``none`` (neither fits; ``scales`` holds the best line anyway), or ``flat``
            (no query has two usable keys: nothing to fit).
        scales: per head, s (the slope at q.k = 0, relative to the q and k that entered).
        caps: per head, the cap (``softcap`` only).
        residual: the largest misfit of the form chosen, in logits.
        tolerance: the logit tolerance.
        linear_residual: the largest misfit of the line.
    """

    form: str
    scales: tuple[float, ...]
    residual: float
    tolerance: float
    linear_residual: float
    caps: tuple[float, ...] = field(default=())


def fit_scores(q: "torch.Tensor", k: "torch.Tensor", w: "torch.Tensor", w0: "torch.Tensor", bias: "torch.Tensor",
               dtype: "torch.dtype", cap: float | None = None) -> ScoreFit:
    """Fit the logits ``log w`` against ``q.k`` per head, once the zero-score bias is taken out.

    Args:
        q: ``[B, Nh, Tq, D]``; k: ``[B, Nh, Tk, D]`` (kv heads already paired).
        w, w0: ``[B, Nh, Tq, Tk]`` the weights, and the weights with every score zero.
        bias: ``[B, Nh, Tq, Tk]`` from :func:`recognise_bias`.
        dtype: the dtype the weights were computed in.
        cap: a declared soft-cap, tried first as the cap's starting value.

    A weight below the smallest normal number of its dtype has lost its precision (a
    subnormal, or flushed to 0), so its logit is not read.
    """
    import torch

    s = q.to(torch.float64) @ k.to(torch.float64).transpose(-2, -1)  # [B, Nh, Tq, Tk]
    floor = torch.finfo(w.dtype).tiny if w.dtype.is_floating_point else 0.0
    w = w.to(torch.float64)
    m = (w0.to(torch.float64) > 0) & (w >= floor) & (w > 0)
    logw = torch.where(m, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    y = _centre(logw, m) - torch.where(m, bias, torch.zeros_like(bias))  # [B, Nh, Tq, Tk]
    y = _centre(y, m)
    sc = _centre(s, m)
    nh = q.shape[1]
    denom = sc.square().sum(dim=(0, 2, 3))  # [Nh]
    if bool((denom == 0).all()):
        return ScoreFit("flat", (), 0.0, logit_tolerance(dtype, 0.0), 0.0)
    slopes = (y * sc).sum(dim=(0, 2, 3)) / denom.clamp_min(1e-300)  # [Nh]
    lin = (y - slopes[None, :, None, None] * sc).abs()
    lin_res = float(lin.max())
    tol = logit_tolerance(dtype, float((slopes[None, :, None, None] * s).abs().max()))
    scales = tuple(float(v) for v in slopes)
    if lin_res <= tol:
        return ScoreFit("linear", scales, lin_res, tol, lin_res)
    caps, soft, worst = [], [], 0.0
    for h in range(nh):
        fit = _softcap(y[:, h], s[:, h], m[:, h], scales[h], cap)
        if fit is None:
            return ScoreFit("none", scales, lin_res, tol, lin_res)
        caps.append(fit[0])
        soft.append(fit[0] * fit[1])
        worst = max(worst, fit[2])
    if worst <= tol:
        return ScoreFit("softcap", tuple(soft), worst, tol, lin_res, tuple(caps))
    return ScoreFit("none", scales, lin_res, tol, lin_res)


def _softcap(y: "torch.Tensor", s: "torch.Tensor", m: "torch.Tensor", slope: float,
             cap: float | None = None) -> tuple[float, float, float] | None:
    """Fit ``y = centre(a * tanh(beta * s))`` (Levenberg-Marquardt on a, beta); ``(a, beta, max misfit)``.

    The starting caps span the logits seen, since a cap far above them changes nothing and
    one far below flattens everything; a declared cap is tried first.
    """
    import torch

    top = float((slope * s).abs().max()) if m.any() else 0.0
    if top == 0.0 or slope <= 0:
        return None
    best = None
    starts = [start * top for start in (0.25, 0.5, 1.0, 2.0)]
    for a0 in ([cap] if cap else []) + starts:
        a, beta = a0, slope / a0
        lam = 1e-3
        res = _cap_residual(y, s, m, a, beta)
        for _ in range(60):
            th = torch.tanh(beta * s)
            j = torch.stack([_centre(th, m)[m], _centre(a * s * (1 - th * th), m)[m]], dim=1)  # [n, 2]
            jtj = j.T @ j
            step = torch.linalg.solve(jtj + lam * torch.diag(torch.diag(jtj)) + 1e-300 * torch.eye(2), j.T @ res[m])
            a2, b2 = a + float(step[0]), beta + float(step[1])
            if a2 <= 0 or b2 <= 0:
                lam *= 10
                continue
            res2 = _cap_residual(y, s, m, a2, b2)
            if float(res2.square().sum()) < float(res.square().sum()):
                a, beta, res, lam = a2, b2, res2, lam / 10
            else:
                lam *= 10
            if lam > 1e12:
                break
        worst = float(res.abs().max())
        if best is None or worst < best[2]:
            best = (a, beta, worst)
    return best


def _cap_residual(y: "torch.Tensor", s: "torch.Tensor", m: "torch.Tensor", a: float, beta: float) -> "torch.Tensor":
    import torch

    return torch.where(m, y - _centre(a * torch.tanh(beta * s), m), torch.zeros_like(y))
