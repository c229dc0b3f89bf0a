"""Trace the heads that entered an attention core back to the columns of the projections.

A head of q (``[B, Nh, T, D]``) comes from a block of D consecutive columns of some
projection output (``[B, T, F]``), position by position; rotary positions may turn it in
between, and a constant may scale it. Neither changes the pattern of vector norms over
the B x T positions, so each observed head is matched to the block whose norm pattern it
shares (:func:`locate`), with no assumption about names or about where in the projection
the block sits. The blocks found give the layout (:func:`layout_of`): separate projections,
a fused projection chunked ``[q | k | v]`` (``[3, Nh, Dh]``), per-head interleaved
``[Nh, 3, Dh]``, grouped ``[Nkv, g + 2, Dh]``, or the columns themselves when none of those.

When a head matches no block, :func:`trace_vectors` looks for each of its vectors among all
blocks at other positions and examples: a split that moved vectors between positions (a
reshape without a transpose) is told apart from a transform that is simply unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["Located", "Moved", "layout_of", "locate", "match_tolerance", "trace_vectors"]

_ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq", "toq"},
    "k": {"k", "key", "keys", "wk", "tok"},
    "v": {"v", "value", "values", "wv", "tov"},
}


def match_tolerance(dtype: "torch.dtype") -> float:
    """How far two unit norm patterns may be apart and still be the same vectors (dtype rounding)."""
    from attn_ledger import tolerance

    return tolerance.norm_pattern(dtype)


@dataclass(frozen=True)
class Located:
    """Observed heads traced to projection blocks.

    Attributes:
        projection: per observed head, the index of its projection (or view) in the list searched.
        offset: per observed head, the first column of its block.
        factor: |observed| / |blocks| over all heads: a constant applied on the way (q scaled
            before the scores, for one).
        distance: the largest distance between a head's norm pattern and its block's.
        source: ``[B, H, T, D]`` float64, the blocks themselves, head by head.
    """

    projection: tuple[int, ...]
    offset: tuple[int, ...]
    factor: float
    distance: float
    source: "torch.Tensor"


def _finite(t: "torch.Tensor") -> "torch.Tensor":
    """float64, with non-finite entries (a query with no key reads NaN) as zeros on both sides of a match."""
    import torch

    return torch.nan_to_num(t.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)


def _unit_rows(p: "torch.Tensor") -> "torch.Tensor":
    return p / p.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _head_patterns(y64: "torch.Tensor") -> "torch.Tensor":
    """``[B, H, T, D] -> [H, B*T]``: each head's vector norms over the positions, scaled to unit length."""
    h = y64.shape[1]
    return _unit_rows(y64.norm(dim=-1).transpose(0, 1).reshape(h, -1))


def _block_patterns(p64: "torch.Tensor", d: int) -> "torch.Tensor":
    """``[B, T, F] -> [F - d + 1, B*T]``: the norm pattern of every block of d consecutive columns."""
    import torch

    b, t, f = p64.shape
    cs = torch.cat([torch.zeros(b, t, 1, dtype=torch.float64), p64.square().cumsum(-1)], dim=-1)  # [B, T, F+1]
    blocks = (cs[..., d:] - cs[..., :-d]).clamp_min(0.0).sqrt()  # [B, T, F-d+1]
    return _unit_rows(blocks.permute(2, 0, 1).reshape(f - d + 1, b * t))


def _hinted(name: str, role: str) -> bool:
    tokens = set(re.split(r"[^a-z0-9]+", name.lower()))
    return bool(tokens & _ROLE_WORDS.get(role, set()))


def locate(y: "torch.Tensor", sources: Sequence["torch.Tensor"], *, role: str = "", names: Sequence[str] = (),
           dtype: "torch.dtype | None" = None) -> Located | None:
    """Find, for every head of ``y [B, H, T, D]``, the block of D columns of one source it came from.

    Args:
        y: the observed heads.
        sources: ``[B, T, F]`` each (projection outputs, or the views of an output projection's input).
        role: ``q``, ``k`` or ``v``: a source whose weight name says the role wins a tie.
        names: the sources' weight names.
        dtype: the dtype the values were computed in (tolerance); default y's.

    Returns:
        A :class:`Located`, or None when some head matches no block within tolerance (or
        is all zeros). Among equally good blocks the one in the source most heads use wins,
        then one whose weight name fits ``role``, then one aligned to D, then the first.
    """
    import torch

    b, h, t, d = y.shape
    y64 = _finite(y)
    usable = [(i, s) for i, s in enumerate(sources) if s.dim() == 3 and tuple(s.shape[:2]) == (b, t) and s.shape[2] >= d]
    if not usable or h == 0 or float(y64.norm(dim=-1).amax(dim=(0, 2)).min()) == 0.0:
        return None  # a head of zeros has no pattern to match
    tol = match_tolerance(dtype or y.dtype)
    heads = _head_patterns(y64)  # [H, B*T]
    found: list[list[tuple[float, int, int]]] = [[] for _ in range(h)]
    for i, s in usable:
        dist = torch.cdist(heads, _block_patterns(_finite(s), d))  # [H, F-d+1]
        for hh in range(h):
            for o in (dist[hh] <= tol).nonzero().flatten().tolist():
                found[hh].append((float(dist[hh, o]), i, o))
    if any(not f for f in found):
        return None
    counts: dict[int, int] = {}
    for f in found:
        best = min(f)
        counts[best[1]] = counts.get(best[1], 0) + 1
    major = max(counts, key=lambda i: counts[i])
    name_of = dict(enumerate(names))

    def key(c: tuple[float, int, int]) -> tuple:
        _, i, o = c
        return (i != major, not _hinted(name_of.get(i, ""), role), o % d != 0, i, o)

    chosen = [min(f, key=key) for f in found]
    source = torch.stack([_finite(sources[i])[:, :, o:o + d] for _, i, o in chosen], dim=1)  # [B, H, T, D]
    factor = float(y64.norm() / source.norm().clamp_min(1e-300))
    return Located(tuple(i for _, i, _ in chosen), tuple(o for _, _, o in chosen), factor,
                   max(dist for dist, _, _ in chosen), source)


@dataclass(frozen=True)
class Moved:
    """Vectors of an observed head traced to blocks at another position or example.

    Attributes:
        traced: observed vectors found (as the same direction) in some block.
        total: observed vectors.
        moved: traced vectors whose block sits at another position or example.
        first: ``(example, head, position)`` of the first moved vector, or None.
        source: ``(example, position, projection, column)`` where that vector was found.
    """

    traced: int
    total: int
    moved: int
    first: tuple[int, int, int] | None
    source: tuple[int, int, int, int] | None


def trace_vectors(y: "torch.Tensor", sources: Sequence["torch.Tensor"], dtype: "torch.dtype | None" = None) -> Moved:
    """Look for every vector of ``y [B, H, T, D]`` among the D-aligned blocks of all sources, anywhere.

    A vector is found where its direction matches a block's (cosine within tolerance of 1),
    which holds when nothing turned it on the way; rotated vectors are not found.
    """
    import torch

    b, h, t, d = y.shape
    y64 = _finite(y).reshape(b * h * t, d)  # [N, D], row (b, h, t)
    blocks, where = [], []
    for i, s in enumerate(sources):
        if s.dim() != 3 or s.shape[2] < d:
            continue
        n = s.shape[2] // d
        sb = _finite(s)[:, :, : n * d].reshape(s.shape[0], s.shape[1], n, d)  # [B', T', n, D]
        blocks.append(sb.reshape(-1, d))
        bb, tt, oo = torch.meshgrid(torch.arange(s.shape[0]), torch.arange(s.shape[1]), torch.arange(n) * d, indexing="ij")
        where.append(torch.stack([bb.flatten(), tt.flatten(), torch.full_like(bb.flatten(), i), oo.flatten()], dim=1))
    if not blocks:
        return Moved(0, b * h * t, 0, None, None)
    x = torch.cat(blocks)  # [M, D]
    at = torch.cat(where)  # [M, 4]: example, position, source, column
    cos = _unit_rows(y64) @ _unit_rows(x).T  # [N, M]
    best, idx = cos.max(dim=1)  # [N]
    tol = max(16 * match_tolerance(dtype or y.dtype), 1e-5)
    hit = (best >= 1 - tol) & (y64.norm(dim=1) > 0)  # [N]
    obs = torch.stack(torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(t), indexing="ij"), -1).reshape(-1, 3)
    src = at[idx]  # [N, 4]
    moved = hit & ((src[:, 0] != obs[:, 0]) | (src[:, 1] != obs[:, 2]))
    first = moved.nonzero().flatten()
    if len(first) == 0:
        return Moved(int(hit.sum()), b * h * t, 0, None, None)
    n0 = int(first[0])
    return Moved(int(hit.sum()), b * h * t, int(moved.sum()), tuple(obs[n0].tolist()), tuple(src[n0].tolist()))


def layout_of(q: Located, k: Located, v: Located, widths: Sequence[int], d: int, dv: int) -> dict:
    """Name the layout the three roles were split from.

    Args:
        q, k, v: where each observed head came from (k and v possibly repeated per query head).
        widths: the output width F of every source.
        d, dv: the q/k and v head widths.

    Returns:
        ``{"name": str, "kv_heads": Nkv, "q": [...], "k": [...], "v": [...]}`` where each role
        lists ``{"projection": i, "columns": [first columns in head order]}``.
    """
    nh = len(q.offset)
    kv_q = sorted(set(zip(k.projection, k.offset)))
    kv_v = sorted(set(zip(v.projection, v.offset)))
    nkv = max(len(kv_q), len(kv_v))
    roles = {}
    for role, loc in (("q", q), ("k", k), ("v", v)):
        blocks = sorted(set(zip(loc.projection, loc.offset)))
        roles[role] = {"projection": sorted({p for p, _ in blocks}), "columns": [o for _, o in blocks]}
    projs = [tuple(roles[r]["projection"]) for r in ("q", "k", "v")]
    facts = {"kv_heads": nkv, **roles}
    cq, ck, cv = (roles[r]["columns"] for r in ("q", "k", "v"))
    if any(len(p) != 1 for p in projs):
        return {"name": "other: a role spans several projections", **facts}
    pq, pk, pv = (p[0] for p in projs)
    heads = f"[Nh={nh}, Dh={d}]" if nkv == nh else f"[Nh={nh}, Nkv={nkv}, Dh={d}]"
    if len({pq, pk, pv}) == 3:
        if cq == [h * d for h in range(nh)] and ck == [j * d for j in range(nkv)] and cv == [j * dv for j in range(nkv)]:
            return {"name": f"separate q, k, v projections, heads {heads}", **facts}
    elif pq == pk == pv:
        g = nh // nkv if nkv and nh % nkv == 0 else 0
        named = _fused_name(cq, ck, cv, nh, nkv, g, d, dv)
        if named:
            return {"name": f"fused q, k, v projection, {named}", **facts}
    elif pk == pv != pq and cq == [h * d for h in range(nh)]:
        if ck == [j * d for j in range(nkv)] and cv == [nkv * d + j * dv for j in range(nkv)]:
            return {"name": f"separate q; fused k, v chunked [k | v], heads {heads}", **facts}
        if ck == [j * (d + dv) for j in range(nkv)] and cv == [j * (d + dv) + d for j in range(nkv)]:
            return {"name": f"separate q; fused k, v interleaved [Nkv, 2, Dh], heads {heads}", **facts}
    return {"name": f"other: q columns {cq}, k columns {ck}, v columns {cv}", **facts}


def _fused_name(cq: list[int], ck: list[int], cv: list[int], nh: int, nkv: int, g: int, d: int, dv: int) -> str:
    if cq == [h * d for h in range(nh)] and ck == [nh * d + j * d for j in range(nkv)] \
            and cv == [nh * d + nkv * d + j * dv for j in range(nkv)]:
        return "chunked [3, Nh, Dh]" if nkv == nh and d == dv else "chunked [Nh*Dh | Nkv*Dh | Nkv*Dv]"
    if d == dv and g == 1 and cq == [3 * h * d for h in range(nh)] and ck == [3 * h * d + d for h in range(nh)] \
            and cv == [3 * h * d + 2 * d for h in range(nh)]:
        return "per-head interleaved [Nh, 3, Dh]"
    if d == dv and g > 1:
        step = (g + 2) * d
        if cq == [(h // g) * step + (h % g) * d for h in range(nh)] and ck == [j * step + g * d for j in range(nkv)] \
                and cv == [j * step + (g + 1) * d for j in range(nkv)]:
            return f"grouped [Nkv, g + 2, Dh] with g = {g}"
    return ""


def kv_heads_from_widths(widths: Sequence[int], nh: int, d: int, dv: int) -> int | None:
    """How many kv heads the projections hold, if they hold exactly q, k and v: (F - Nh*D) / (D + Dv)."""
    rest = sum(widths) - nh * d
    if rest <= 0 or rest % (d + dv):
        return None
    nkv = rest // (d + dv)
    return nkv if nkv >= 1 and nh % nkv == 0 else None


def pairing(q: Located, k: Located, v: Located, k_group: int) -> tuple[list[int], list[int], list[int]]:
    """Which kv head each query head reads through k and through v, by the kv heads' column order.

    Args:
        k_group: query heads per observed k head (1 when k was expanded to Nh heads before
            the core; Nh / Hk when the core pairs grouped heads itself, as SDPA's enable_gqa does).

    Returns:
        ``(q_order, k_of, v_of)``: each query head's place among q's blocks, and the kv head
        (rank among k's, v's blocks) it reads.
    """
    nh = len(q.offset)
    k_off = [k.offset[h // k_group] for h in range(nh)]
    v_off = [v.offset[h // k_group] for h in range(nh)]
    k_key = [(k.projection[h // k_group], o) for h, o in enumerate(k_off)]
    v_key = [(v.projection[h // k_group], o) for h, o in enumerate(v_off)]
    q_key = list(zip(q.projection, q.offset))
    order = sorted(set(q_key))
    korder, vorder = sorted(set(k_key)), sorted(set(v_key))
    return [order.index(x) for x in q_key], [korder.index(x) for x in k_key], [vorder.index(x) for x in v_key]
