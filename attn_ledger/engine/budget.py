"""The ledger's memory estimates: what a request will allocate, by part, before it runs.

The estimates model what the ledger allocates (see ``engine.plan.choose_blocks``): the inputs and
their float64 reference copies, the projection weights, the context and SDPA's, one query
block's score grids while streaming (or every grid when they are kept whole), and SDPA's own
grid for a group of rows. They are meant to land within a factor of two of the peak resident
memory, on the high side (``tests/test_limits.py`` measures it).

The headroom they are held against, and the fixed bounds, are in :mod:`attn_ledger.inputs.limits`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from attn_ledger.maths.relations import NO_RELATION, RelationSpec
from attn_ledger.inputs.limits import Estimate


SLACK = 0.25  # allocator slack and short-lived temporaries the parts do not name, as a share of the parts

REF_BYTES = 8  # the float64 reference (float32 where a device has no float64)
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def _plan(b: int, nh: int, tq: int, tk: int, block_size: int | None) -> tuple[int, bool]:
    """Query rows of the largest block and whether grids are kept whole, as the ledger plans them."""
    from attn_ledger.engine import plan

    if b * nh * tq * tk == 0:
        return max(1, min(tq, block_size or tq)), True
    if b * nh * tq * tk > 1 << 40:  # beyond any machine: the smallest block the engine would use
        return plan.MIN_BLOCK_ROWS if block_size is None else max(1, min(block_size, tq)), False
    blocks = plan.choose_blocks(b, nh, tq, tk, block_size)
    return max(q1 - q0 for q0, q1 in blocks), b * nh * tq * tk <= plan.SMALL_GRID


COMPARE = 5  # float64 copies alive while one tensor is compared with its reference (checks.excess_error)


def _grid_stage(b: int, nh: int, nkv: int, tq: int, tk: int, dh: int, dv: int, s: int, *, block_size: int | None,
                keep_grids: bool, masked: bool, ref_cast: bool, given: Iterable[str] = ()
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """The score-grid stages: (parts held from there to the end of the run, transient peaks,
    query rows the float64 reference covers).

    Held: kv heads repeated for grouped-query attention, the context and SDPA's, the float64
    reference on its sampled rows and the pipeline's values gathered beside it, and every
    score grid when grids are kept whole. Transient (one at a time): one query block's grids
    and masks while streaming (with K and V cast for the reference a few heads at a time, when ``ref_cast``),
    and the comparison of the gathered rows with the reference afterwards.
    """
    from attn_ledger.engine import execute, plan

    r = REF_BYTES
    grid = b * nh * tq * tk
    rows, small = _plan(b, nh, tq, tk, block_size)
    keep = keep_grids or small
    block = b * nh * rows * tk
    if grid <= plan.F64_BUDGET:
        ref_rows = tq
    else:  # a few rows of a few blocks (plan.sample_rows)
        ref_rows = min(tq, plan.F64_SAMPLES * max(1, plan.F64_SAMPLE // max(1, b * nh * tk * plan.F64_SAMPLES)))
    sample = b * nh * ref_rows * (3 * tk + dv)  # scores, masked scores, weights and out on the sampled rows
    held = [("kv heads repeated", b * nh * tk * (dh + dv) * s if nkv != nh else 0),
            ("context and SDPA context", 2 * b * nh * tq * dv * s),
            ("float64 reference sample and the rows gathered beside it", 2 * sample * r),
            ("score grids kept whole", 2 * 3 * grid * s if keep else 0)]  # three stages, and their concatenation
    kv_cast = min(b * nh * tk * (dh + dv) * r, max(execute.REF_CHUNK_BYTES, b * tk * (dh + dv) * r))  # <= one chunk
    sdpa_rows = max(rows, min(plan.SDPA_ROWS, tq))
    streaming = (2 * block * s + 2 * block  # two grids alive at once (a stage's input and output); two bool masks
                 + (b * nh * sdpa_rows * tk if masked else 0)  # SDPA's boolean mask for a group of rows
                 + (kv_cast if ref_cast else 0)
                 + 4 * b * nh * rows * dv * s  # value-range bounds
                 + sum(COMPARE * block * r for name in given if name in ("scores", "weights")))
    judging = 2 * b * nh * ref_rows * max(tk, dv) * r  # the sample's comparison: two float64 copies, in place
    transient = [("score-grid stages streaming", streaming), ("comparing the sampled rows", judging)]
    return [(n, v) for n, v in held if v], transient, ref_rows


BACKWARD_GRIDS = 8  # block-sized grids alive at once in a backward block: A recomputed (scores, masked
# scores, weights), A-bar, S-bar, the row rule's products, and the sampled rows' K-bar and V-bar terms


def _backward(b: int, nh: int, tq: int, tk: int, dh: int, dv: int, s: int, block_size: int | None
              ) -> tuple[list[tuple[str, int]], tuple[str, int]]:
    """``--grad``: (parts held to the end: Q-bar, K-bar, V-bar summed over blocks and SDPA autograd's,
    with the inputs SDPA differentiates and O-bar), the backward blocks' streaming peak)."""
    rows, _ = _plan(b, nh, tq, tk, block_size)
    grads = b * nh * (tq * dh + tk * (dh + dv))  # [B, Nh, Tq, Dh] and [B, Nh, Tk, Dh + Dv]
    held = [("gradients: the stages' sums and SDPA autograd's, with its inputs", 3 * grads * s),
            ("O-bar", b * nh * tq * dv * s)]
    return held, ("backward stages streaming", BACKWARD_GRIDS * b * nh * rows * tk * s)


def _peak(*phases: tuple[str, int]) -> tuple[str, int]:
    """The busiest of moments that do not overlap, named."""
    name, n = max(phases, key=lambda p: p[1])
    return (f"{name} (the busiest moment)", n)


def estimate_attention(b: int, nh: int, nkv: int, tq: int, tk: int, dh: int, dv: int, itemsize: int, *,
                       block_size: int | None = None, keep_grids: bool = False, given: Iterable[str] = (),
                       masked: bool = True, grad: bool = False, what: str = "the ledger") -> Estimate:
    """The ledger's score-grid stages on Q, K, V already in memory (``run --tensors``), and with
    ``grad`` its backward stages.

    ``given`` names the user's own intermediates (scores, weights, out) that are compared
    block by block. The inputs themselves are not counted: they are loaded already.
    """
    held, transient, _ = _grid_stage(b, nh, nkv, tq, tk, dh, dv, itemsize, block_size=block_size,
                                     keep_grids=keep_grids, masked=masked, ref_cast=True, given=given)
    if grad:
        grad_held, streaming = _backward(b, nh, tq, tk, dh, dv, itemsize, block_size)
        held, transient = [*held, *grad_held], [*transient, streaming]
    return Estimate(what, _with_slack([*held, _peak(*transient)]), b * nh * tq * tk)


def estimate_tensors(found: "Mapping[str, Any]", *, dtype: str | None = None, block_size: int | None = None,
                     keep_grids: bool = False, mask: "RelationSpec" = NO_RELATION, grad: bool = False,
                     what: str = "run --tensors") -> Estimate | None:
    """``run --tensors`` on tensors already loaded: None when q, k, v are missing or cannot be
    attention inputs (the ledger's own validation then says why, before allocating)."""
    q, k, v = (found.get(n) for n in ("q", "k", "v"))
    if q is None or k is None or v is None or not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        return None
    q4, k4, v4 = ((t.shape[0], 1, *t.shape[1:]) if t.dim() == 3 else tuple(t.shape) for t in (q, k, v))
    b, nh, tq, dh = q4
    _, nkv, tk, _ = k4
    dv = v4[-1]
    itemsize = ITEMSIZE.get(dtype or "", q.element_size())
    given = [n for n in ("scores", "weights", "out") if n in found]
    masked = "allow_mask" in found or "key_valid" in found or mask.masked(tq, tk)
    est = estimate_attention(b, nh, nkv, tq, tk, dh, dv, itemsize, block_size=block_size, keep_grids=keep_grids,
                             given=given, masked=masked, grad=grad,
                             what=f"{what} B={b} Nh={nh} Tq={tq} Tk={tk} Dh={dh} Dv={dv}{' --grad' if grad else ''}")
    converted = sum(t.numel() * itemsize for n, t in found.items() if dtype and t.is_floating_point())
    parts = est.parts + ((("inputs converted to the run's dtype", converted),) if converted else ())
    return Estimate(est.what, parts, est.grid_entries)


def estimate_run(cfg: Any, *, what: str | None = None) -> Estimate:
    """``run`` on the built-in pipeline (``cfg`` a :class:`~attn_ledger.inputs.config.RunConfig`): what the run holds, plus its busiest moment: the
    projections compared with their float64 chain, the score-grid stages streaming, the sampled
    rows compared, or the merge and output stages compared on every row."""
    b, tq, tk, e, nh, nkv, dh, dv = cfg.batch_size, cfg.tq, cfg.tk, cfg.embed_dim, cfg.num_heads, cfg.nkv, cfg.dh, cfg.dv
    s, r = ITEMSIZE[cfg.dtype], REF_BYTES
    cross = cfg.query_len is not None
    label = what or f"run B={b} Tq={tq} Tk={tk} E={e} Nh={nh} Dv={dv} {cfg.dtype}{' --grad' if cfg.grad else ''}"
    tokens = b * (tq + (tk if cross else 0))
    weights = e * (nh * dh + nkv * dh + nkv * dv + nh * dv)
    largest_weight = e * max(nh * dh, nkv * dv, nh * dv)
    probe = min(b, 2) * tq  # the head split/merge round trip runs on at most two examples, in float64
    masked = cfg.relation.masked(tq, tk)
    held, transient, ref_rows = _grid_stage(b, nh, nkv, tq, tk, dh, dv, s, block_size=cfg.block_size,
                                            keep_grids=cfg.keep_grids, masked=masked, ref_cast=False)
    projections = max(tokens * e * r, 2 * largest_weight * r,
                      COMPARE * r * max(b * nh * tq * dh, b * nkv * tk * dh, b * nkv * tk * dv))
    # merged and SDPA's merged context, the output and SDPA's, on every row; the output compared
    # with SDPA's on every row, the merged context with the reference on its rows
    merging = 2 * s * b * tq * (nh * dv + e) + COMPARE * r * (b * tq * e + b * ref_rows * nh * dv) + e * nh * dv * r
    phases = [("projections compared", projections), *transient, ("merge and output compared", merging)]
    if cfg.grad:
        grad_held, streaming = _backward(b, nh, tq, tk, dh, dv, s, cfg.block_size)
        # and the projections' and the input's gradients, each with its float64 autograd reference
        held = [*held, *grad_held, ("projection and input gradients", 2 * (weights + tokens * e) * (s + r))]
        phases.append(streaming)
    parts = [
        ("inputs and their float64 copies", tokens * e * (s + r)),
        ("projection weights", weights * s),
        ("q, k, v and their float64 copies", (b * nh * tq * dh + b * nkv * tk * (dh + dv)) * (s + r)
         + (b * nh * tk * (dh + dv) * r if nkv != nh else 0)),
        ("head split/merge probes", probe * e * 2 * r + probe * nh * dv * 2 * r),
        *held,
        _peak(*phases),
    ]
    return Estimate(label, _with_slack(parts), b * nh * tq * tk)


def _with_slack(parts: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The named parts, and SLACK of their sum for what they leave out (allocator rounding,
    short-lived temporaries; tests/test_limits.py measures the whole against the peak)."""
    named = [(n, int(v)) for n, v in parts if v]
    total = sum(v for _, v in named)
    return (*named, ("allocator slack and temporaries", int(SLACK * total))) if total else ()


def estimate_sweep(dhs: Iterable[int], queries: int, keys: int) -> Estimate:
    """``sweep-scale``: float64 q ``[Tq, Dh]``, k ``[Tk, Dh]`` and a few ``[Tq, Tk]`` grids per Dh, one Dh at a time."""
    dhs = list(dhs)
    widest = max(dhs, default=1)
    parts = (("q and k", (queries + keys) * widest * 8), ("score grids", 6 * queries * keys * 8))
    return Estimate(f"sweep-scale Tq={queries} Tk={keys} Dh up to {widest}", parts, queries * keys * len(dhs))


def estimate_module(embed_dim: int, num_heads: int, batch: int, seq_len: int, what: str) -> Estimate:
    """A module of width ``embed_dim`` run at ``[batch, seq_len, E]``, sized as the built-in attention.

    A user's module may hold more than an attention layer's projections; this bounds what the
    tool itself feeds it and keeps of its outputs.
    """
    parts = (("weights", 4 * embed_dim * embed_dim * 8),
             ("activations", 12 * batch * seq_len * embed_dim * 8),
             ("score grids", 6 * batch * num_heads * seq_len * seq_len * 8))
    return Estimate(what, parts, batch * num_heads * seq_len * seq_len)

