"""The attention ledger: run attention as named stages, check each, name the first divergence.

Two entry points build a :class:`~attn_ledger.report.Report`:

* :func:`run_ledger` runs the built-in multi-head attention from a :class:`RunConfig`
  (stages ``input`` .. ``output``), optionally with one deliberate fault.
* :func:`run_ledger_tensors` / :func:`ledger_on_qkv` run saved or given Q, K, V (and
  optionally the user's own ``scores``, ``weights`` and ``out``) through ``input``,
  ``scores``, ``masked_scores``, ``weights`` and ``context``.

The score-grid stages run one block of query rows at a time. Key columns that the
relation forbids for a whole block are skipped. Checks are measured per block and
folded (max or sum) into one ledger row per stage, so the first divergence is the
first by stage order over all blocks. The float64 reference may run on a sample of
query rows at large sizes (the ledger says which); the SDPA reference runs on every block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from attn_ledger import checks as C
from attn_ledger.cells import locate
from attn_ledger.report import Check, Report, Row, bounded, counted, unjudged

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.config import RunConfig

CONFIG_STAGES = ("input", "head_roundtrip", "q", "k", "v", "scores", "masked_scores", "weights", "context", "merged", "output")
TENSOR_STAGES = ("input", "scores", "masked_scores", "weights", "context")

AXES = {
    "input": "[B,Tq,E]",
    "head_roundtrip": "[B,T,E]",
    "q": "[B,Nh,Tq,Dh]",
    "k": "[B,Nkv,Tk,Dh]",
    "v": "[B,Nkv,Tk,Dv]",
    "scores": "[B,Nh,Tq,Tk]",
    "masked_scores": "[B,Nh,Tq,Tk]",
    "weights": "[B,Nh,Tq,Tk]",
    "context": "[B,Nh,Tq,Dv]",
    "merged": "[B,Tq,Nh*Dv]",
    "output": "[B,Tq,E]",
}

SMALL_GRID = 1 << 16  # grids up to this many entries are kept whole for inspection
BLOCK_TARGET = 1 << 22  # entries of one block's score grid when streaming (16 MiB in float32)
MIN_BLOCKS = 4  # grids above SMALL_GRID run in at least this many query blocks
MIN_BLOCK_ROWS = 32  # fewer query rows per block make the matrix products inefficient
F64_BUDGET = 1 << 18  # grid entries the float64 reference covers before sampling blocks
F64_SAMPLE = 1 << 15  # grid entries of the float64 sample once the grid is over F64_BUDGET
EXACT_RANGE_BUDGET = 1 << 18  # entries of [B, Nh, rows, keys, Dv] for the exact value-range check
SDPA_ROWS = 512  # query rows per SDPA reference call, when its mask stays within BLOCK_TARGET entries
F64_SAMPLES = 3  # query blocks the float64 reference samples when the grid is over budget
REF_CAST_ONCE_BYTES = 1 << 28  # K and V up to this size in the reference dtype are cast once for all samples
REF_CHUNK_BYTES = 1 << 26  # reference-dtype K and V held at once for one sampled block
VALUE_CHUNK = 64  # key positions per precomputed (min, max) of the value rows

ProgressFn = Callable[[int, int], None]


# --- the intended relation ------------------------------------------------------------

@dataclass(frozen=True)
class Relation:
    """The intended allow relation, produced one block of query rows at a time.

    ``parts`` are functions ``(q0, q1) -> bool [B|1, Nh|1, q1-q0, Tk]`` combined by AND.
    ``top_left_causal``: known by construction to be exactly "key j <= query i" for every
    batch and head (one causal part, top-left, or bottom-right with Tq == Tk).
    """

    name: str
    parts: tuple[Callable[[int, int], "Tensor"], ...] = ()
    top_left_causal: bool = False

    def block(self, q0: int, q1: int) -> "Tensor | None":
        allow = None
        for part in self.parts:
            a = part(q0, q1)
            allow = a if allow is None else (allow & a)
        return allow


def relation_from_config(cfg: "RunConfig", device: Any = None) -> Relation:
    """Build the intended relation a config names, in allow polarity."""
    import torch

    from attn_ledger import masks

    tq, tk = cfg.tq, cfg.tk
    parts: list[Callable[[int, int], Tensor]] = []
    names: list[str] = []
    for r in cfg.relations:
        if r == "none":
            continue
        if r == "causal":
            parts.append(lambda q0, q1: masks.causal(tq, tk, "bottom-right", q0, q1, device)[None, None])
            names.append("causal (bottom-right)" if tq != tk else "causal")
        elif r == "causal-top-left":
            parts.append(lambda q0, q1: masks.causal(tq, tk, "top-left", q0, q1, device)[None, None])
            names.append("causal (top-left)")
        elif r == "padding":
            valid = masks.valid_from_lengths(cfg.valid_lengths or [], tk, cfg.padding_side, device)  # [B, Tk]
            padded = masks.key_padding(valid)  # [B, 1, 1, Tk]
            parts.append(lambda q0, q1, p=padded: p)
            names.append(f"key padding ({cfg.padding_side}) lengths {cfg.valid_lengths}")
        elif r == "sliding-window":
            w = int(cfg.window or 1)
            parts.append(lambda q0, q1: masks.sliding_window(tq, tk, w, q0, q1, device)[None, None])
            names.append(f"sliding window {w}")
        elif r == "prefix-lm":
            p = int(cfg.prefix_len or 0)
            parts.append(lambda q0, q1: masks.prefix_lm(tq, tk, p, q0, q1, device)[None, None])
            names.append(f"prefix-LM prefix {p}")
        elif r == "segments":
            ids = torch.repeat_interleave(
                torch.arange(len(cfg.segment_lengths or [])), torch.tensor(cfg.segment_lengths or [])
            ).to(device)[None]  # [1, T]
            seg = masks.segments(ids, ids)  # [1, 1, Tq, Tk]
            parts.append(lambda q0, q1, s=seg: s[:, :, q0:q1])
            names.append(f"segments {cfg.segment_lengths}")
    exact_causal = [r for r in cfg.relations if r != "none"] in (["causal-top-left"], ["causal"] if tq == tk else [])
    return Relation(" + ".join(names) or "none", tuple(parts), top_left_causal=exact_causal)


def relation_from_tensors(
    b: int, nh: int, tq: int, tk: int, allow_mask: "Tensor | None", key_valid: "Tensor | None"
) -> Relation:
    """The relation a saved ``allow_mask`` and/or ``key_valid`` declare, placed by named axes."""
    from attn_ledger import masks

    parts: list[Callable[[int, int], Tensor]] = []
    names: list[str] = []
    if allow_mask is not None:
        grid = masks.expand_to_grid(allow_mask, b, nh, tq, tk)  # [B|1, Nh|1, Tq, Tk]
        parts.append(lambda q0, q1, g=grid: g[:, :, q0:q1])
        names.append(f"allow_mask {list(allow_mask.shape)}")
    if key_valid is not None:
        padded = masks.key_padding(key_valid)  # [B, 1, 1, Tk]
        parts.append(lambda q0, q1, p=padded: p)
        names.append("key_valid [B, Tk]")
    return Relation(" + ".join(names) or "none", tuple(parts))


# --- folding measurements across blocks --------------------------------------------------

def _fold_max(a: float | None, b: float) -> float:
    if a is None:
        return b
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


@dataclass
class _Stage:
    """What one stage has measured so far."""

    shape: Optional[tuple[int, ...]] = None
    raised: Optional[BaseException] = None
    maxes: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    extra: list[Check] = field(default_factory=list)

    def max(self, key: str, value: float) -> None:
        self.maxes[key] = _fold_max(self.maxes.get(key), float(value))

    def add(self, key: str, value: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + int(value)


@dataclass
class _Run:
    """Everything the block engine needs, and what it has found."""

    stages: dict[str, _Stage]
    dtype: "torch.dtype"
    dims: dict[str, int]
    notes: list[str] = field(default_factory=list)
    kept: dict[str, list] = field(default_factory=dict)
    row_values: dict[str, str] = field(default_factory=dict)
    stop_after_divergence: bool = True


def _choose_blocks(b: int, nh: int, tq: int, tk: int, block_size: int | None) -> list[tuple[int, int]]:
    """Query blocks ``[(q0, q1), ...]``: one block for small grids, else blocks of about BLOCK_TARGET entries.

    A block's grid (16 MiB in float32) is small enough for its checks to run over it while it is warm;
    blocks of at least MIN_BLOCK_ROWS rows keep the matrix products efficient.
    """
    if block_size is None:
        per_row = max(1, b * nh * tk)
        if b * nh * tq * tk <= SMALL_GRID:
            block_size = tq
        else:
            # at least MIN_BLOCKS blocks, so keys a causal or windowed relation forbids are skipped
            block_size = max(MIN_BLOCK_ROWS, min(BLOCK_TARGET // per_row, -(-tq // MIN_BLOCKS)))
            n = -(-tq // block_size)
            block_size = -(-tq // n)  # even blocks, no short tail
    block_size = max(1, min(block_size, tq))
    return [(q0, min(q0 + block_size, tq)) for q0 in range(0, tq, block_size)]


def _sampled(blocks: list[tuple[int, int]], b: int, nh: int, tk: int) -> dict[int, tuple[int, int]]:
    """Which query rows the float64 reference covers: ``{block index: (first, end) row offsets in the block}``.

    Every row of every block when the whole grid fits F64_BUDGET; otherwise up to
    F64_SAMPLES blocks spread evenly (the first and last among them), and in each a run of
    rows sized so that all of them hold about F64_SAMPLE grid entries (at least one row a
    block): the first rows of the first block (the queries with the fewest keys), the last
    rows of the others (the most keys).
    """
    n = len(blocks)
    per_row = max(1, b * nh * tk)
    if sum(q1 - q0 for q0, q1 in blocks) * per_row <= F64_BUDGET:
        return {i: (0, q1 - q0) for i, (q0, q1) in enumerate(blocks)}
    k = min(n, F64_SAMPLES)
    picks = sorted({min(n - 1, round(i * (n - 1) / max(1, k - 1))) for i in range(k)})
    rows = max(1, F64_SAMPLE // (len(picks) * per_row))
    out: dict[int, tuple[int, int]] = {}
    for i in picks:
        size = blocks[i][1] - blocks[i][0]
        r = min(rows, size)
        out[i] = (0, r) if i == 0 else (size - r, size)
    return out


def _key_hull(*allows: "Tensor | None", tk: int) -> tuple[int, int]:
    """The smallest key range holding every key either relation allows for this block."""
    import torch

    lo, hi = tk, 0
    for a in allows:
        if a is None:
            return 0, tk
        cols = a.reshape(-1, a.shape[-1]).any(dim=0)  # [Tk]
        idx = torch.nonzero(cols).flatten()
        if idx.numel():
            lo, hi = min(lo, int(idx[0])), max(hi, int(idx[-1]) + 1)
    return (0, tk) if hi <= lo else (lo, hi)


def _column_counts(allow: "Tensor") -> tuple[Any, int]:
    """For each key column, how many (batch, head, query) rows of ``allow`` allow it (a numpy
    ``[Tk]`` array), and how many such rows there are. One reduction gives the block's key
    hull and its band."""
    flat = allow.reshape(-1, allow.shape[-1])  # [rows', Tk]
    return flat.sum(dim=0).cpu().numpy(), flat.shape[0]


def _hull(*cols: tuple[Any, int] | None, tk: int) -> tuple[int, int]:
    """The smallest key range holding every key any of the relations allows (all keys if one is None)."""
    import numpy as np

    lo, hi = tk, 0
    for c in cols:
        if c is None:
            return 0, tk
        idx = np.flatnonzero(c[0])
        if idx.size:
            lo, hi = min(lo, int(idx[0])), max(hi, int(idx[-1]) + 1)
    return (0, tk) if hi <= lo else (lo, hi)


def _band(cols: tuple[Any, int] | None, lo: int, hi: int) -> tuple[int, int]:
    """The key columns ``[v0, v1)`` (from ``lo``) where the relation is not "allowed" for every
    (batch, head, query) of the block.

    Outside the band every pair is allowed, so the mask checks there reduce to "no -inf,
    no NaN, no +inf", which one ``aminmax`` screens; the band gets the exact per-pair counts.
    """
    import numpy as np

    if cols is None:
        return 0, 0
    idx = np.flatnonzero(cols[0][lo:hi] != cols[1])
    return (int(idx[0]), int(idx[-1]) + 1) if idx.size else (0, 0)


def _widen(lo: int, hi: int, tk: int, step: int) -> tuple[int, int]:
    """``[lo, hi)`` grown to a multiple of ``step`` keys (to the right, else to the left), within ``[0, tk)``."""
    if step <= 1:
        return lo, hi
    width = min(tk, -(-(hi - lo) // step) * step)
    return (lo, lo + width) if lo + width <= tk else (tk - width, tk)


def _block_layout(relation: Relation, allow_i: "Tensor | None", allow_p: "Tensor | None", q0: int, q1: int,
                  tk: int, full_keys: bool, width_step: int = 1) -> tuple[int, int, int, int, int, int, bool]:
    """Where one block's work lies: ``(lo, hi, v0, v1, p0, p1, all_live)``.

    ``[lo, hi)``: the keys the block computes (every key either relation allows, plus one
    key every query of the block must not use, so a mask never applied still shows; all keys
    with ``full_keys``), widened to a multiple of ``width_step`` keys. ``[v0, v1)`` and
    ``[p0, p1)``: the bands, from ``lo``, outside which the intended and the pipeline's
    relation allow every pair. ``all_live``: every query has an allowed key (or there is no
    relation).

    A relation known to be exactly top-left causal gets these by arithmetic; any other is
    measured from its column counts. Both give the same numbers (tested).
    """
    step = 1 if full_keys else width_step
    if allow_i is not None and allow_p is allow_i and relation.top_left_causal and q0 < min(q1, tk):
        # query i allows keys 0..i: rows q0..q1-1 use keys 0..q1-1; columns q0+1.. are the band
        lo, hi = 0, (tk if full_keys else min(q1, tk))
        if q1 - q0 == 1 and hi < tk and not full_keys:
            hi += 1  # a one-row block allows all of 0..q0: keep key q0+1, which it must not use
        lo, hi = _widen(lo, hi, tk, step)  # the added keys lie right of q1: forbidden to every row
        v0, v1 = (q0 + 1, hi) if q0 + 1 < hi else (0, 0)
        return lo, hi, v0, v1, v0, v1, True
    cols_i = None if allow_i is None else _column_counts(allow_i)
    cols_p = cols_i if allow_p is allow_i else (None if allow_p is None else _column_counts(allow_p))
    lo, hi = (0, tk) if full_keys else _hull(cols_i, cols_p, tk=tk)
    if cols_i is not None and (lo > 0 or hi < tk) and _band(cols_i, lo, hi) == (0, 0):
        # keep one key every query of the block must not use, so a mask never applied still shows
        lo, hi = (lo, hi + 1) if hi < tk else (lo - 1, hi)
    lo, hi = _widen(lo, hi, tk, step)
    v0, v1 = _band(cols_i, lo, hi)
    p0, p1 = (0, 0) if allow_p is None else ((v0, v1) if allow_p is allow_i else _band(cols_p, lo, hi))
    all_live = cols_i is None or bool(allow_i[..., lo:hi].any(dim=-1).all())
    return lo, hi, v0, v1, p0, p1, all_live


def _clean_allowed(m: "Tensor") -> bool:
    """Screen a region where every pair is allowed: no -inf (nothing excluded), no NaN, no +inf."""
    import torch

    if m.numel() == 0:
        return True
    lo, hi = (float(x) for x in torch.aminmax(m))
    return math.isfinite(lo) and math.isfinite(hi)


def _value_chunks(v: "Tensor") -> tuple["Tensor", "Tensor"] | None:
    """Per-chunk (min, max) of the value rows, ``[B, Nh, Tk // VALUE_CHUNK, Dv]`` each, for key-span ranges."""
    tk = v.shape[-2]
    n = tk // VALUE_CHUNK
    if n < 2:
        return None
    b, nh, _, dv = v.shape
    head = v[:, :, : n * VALUE_CHUNK].reshape(b, nh, n, VALUE_CHUNK, dv)
    return head.amin(dim=3), head.amax(dim=3)


def _value_span(v: "Tensor", chunks: tuple["Tensor", "Tensor"] | None, lo: int, hi: int) -> tuple["Tensor", "Tensor"]:
    """Per-coordinate (min, max) of value rows ``lo..hi``, ``[B, Nh, 1, Dv]`` each, exact, in v's dtype."""
    import torch

    if chunks is None or hi - lo < 2 * VALUE_CHUNK:
        vs = v[:, :, lo:hi]
        return vs.amin(dim=-2, keepdim=True), vs.amax(dim=-2, keepdim=True)
    c0, c1 = -(-lo // VALUE_CHUNK), hi // VALUE_CHUNK  # whole chunks inside [lo, hi)
    cmin, cmax = chunks
    vmin = cmin[:, :, c0:c1].amin(dim=-2, keepdim=True)
    vmax = cmax[:, :, c0:c1].amax(dim=-2, keepdim=True)
    for a, z in ((lo, c0 * VALUE_CHUNK), (c1 * VALUE_CHUNK, hi)):
        if z > a:
            vmin = torch.minimum(vmin, v[:, :, a:z].amin(dim=-2, keepdim=True))
            vmax = torch.maximum(vmax, v[:, :, a:z].amax(dim=-2, keepdim=True))
    return vmin, vmax


# --- the block engine -----------------------------------------------------------------

def _attend_blocks(
    run: _Run,
    ops: Any,
    q: "Tensor",
    k_exp: "Tensor",
    v_exp: "Tensor",
    ref: tuple["Tensor", "Tensor", "Tensor"],
    relation: Relation,
    *,
    scale: float,
    ref_scale: float,
    empty_zero: bool,
    user: dict[str, "Tensor"],
    block_size: int | None,
    keep_grids: bool,
    progress: ProgressFn | None,
    backends: tuple[tuple[str, "torch.dtype"], ...] = (),
) -> tuple["Tensor | None", "Tensor", dict[tuple[int, int], "Tensor"]]:
    """Run scores -> masked_scores -> weights -> context over query blocks.

    ``ref`` holds the reference's Q ``[B, Nh, Tq, Dh]``, K ``[B, Nkv|Nh, Tk, Dh]`` and V,
    in any dtype: the sampled query rows are cast to the reference dtype (float64, or
    float32 where the device has none) and K and V with them (whole when small, a few
    heads at a time otherwise), their kv heads repeated by the reference's own code.
    The reference runs once, on every sampled row; the pipeline's values on those rows
    are gathered block by block and compared with it once per stage.

    Returns the pipeline context (or None if a stage raised), the SDPA context, and the
    reference context of every sampled block.
    """
    import torch

    st = run.stages
    b, nh, tq, _ = q.shape
    tk = k_exp.shape[-2]
    rtol, atol = C.tolerance(run.dtype)
    q_ref, k_ref, v_ref = ref
    ref_dtype = _ref_dtype(q.device)
    empty = "zeros" if empty_zero else "nan"
    blocks = _choose_blocks(b, nh, tq, tk, block_size)
    small = b * nh * tq * tk <= SMALL_GRID
    keep = keep_grids or small
    full_keys = keep or bool(user)
    sampled = _sampled(blocks, b, nh, tk)
    chunks = _value_chunks(v_exp) if b * nh * tq * tk > SMALL_GRID else None
    if len(blocks) > 1:
        run.notes.append(f"score-grid stages ran in {len(blocks)} query blocks of {blocks[0][1] - blocks[0][0]} rows")
    covered = sum(z - a for a, z in sampled.values())
    if covered < tq:
        shown = ", ".join(f"{blocks[i][0] + a}..{blocks[i][0] + z - 1}" for i, (a, z) in sorted(sampled.items()))
        run.notes.append(f"{C.dtype_name(_ref_dtype(q.device))} reference on a sample of {covered} of {tq} query rows "
                         f"(rows {shown}); SDPA on all rows")
    sample_at, at = {}, 0  # block index -> first row of its sample in the reference
    for i, (a, z) in sorted(sampled.items()):
        sample_at[i], at = at, at + z - a
    # the context is returned to the caller as an ordinary tensor; everything else the engine
    # makes stays inside inference mode, which spares each of its many small operations the
    # autograd bookkeeping (outside it, later functional use of those tensors is allowed)
    context = torch.empty(b, nh, tq, v_exp.shape[-1], dtype=run.dtype, device=q.device)
    with torch.inference_mode():
        if k_ref.dtype != ref_dtype and (k_ref.numel() + v_ref.numel()) * 8 <= REF_CAST_ONCE_BYTES:
            k_ref, v_ref = k_ref.to(ref_dtype), v_ref.to(ref_dtype)  # small enough: cast once, not per sampled block
        ref_all = _sampled_reference(q_ref, k_ref, v_ref, relation, blocks, sampled, ref_scale, empty, ref_dtype)
        sample = _Sample(ref_all)
        try:
            return _block_loop(run, ops, q, k_exp, v_exp, ref_all, sample, sample_at, relation, blocks, sampled,
                               chunks, context, scale=scale, ref_scale=ref_scale, empty_zero=empty_zero, user=user,
                               keep=keep, full_keys=full_keys, progress=progress, backends=backends, q_ref=q_ref,
                               k_ref=k_ref, v_ref=v_ref)
        finally:
            sample.judge(st, rtol, atol)


def _block_loop(run: _Run, ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", ref_all: dict[str, "Tensor"],
                sample: _Sample, sample_at: dict[int, int], relation: Relation, blocks: list[tuple[int, int]],
                sampled: dict[int, tuple[int, int]], chunks: Any, context: "Tensor", *, scale: float,
                ref_scale: float, empty_zero: bool,
                user: dict[str, "Tensor"], keep: bool, full_keys: bool, progress: ProgressFn | None,
                backends: tuple[tuple[str, "torch.dtype"], ...], q_ref: "Tensor", k_ref: "Tensor", v_ref: "Tensor",
                ) -> tuple["Tensor | None", "Tensor", dict[tuple[int, int], "Tensor"]]:
    """The body of :func:`_attend_blocks`: every block through every stage, checks folded as it goes."""
    import torch
    import torch.nn.functional as F

    from attn_ledger.reference import reference_stages, repeat_kv

    st = run.stages
    b, nh, tq, dh = q.shape
    tk = k_exp.shape[-2]
    dv = v_exp.shape[-1]
    half = C.dtype_name(run.dtype) in C.HALF_DTYPES
    rtol, atol = C.tolerance(run.dtype)
    empty = "zeros" if empty_zero else "nan"
    sdpa_ctx = torch.empty(b, nh, tq, dv, dtype=run.dtype, device=q.device)
    ref_ctx: dict[tuple[int, int], Tensor] = {}
    for key in ("scores", "masked_scores", "weights"):
        st[key].shape = (b, nh, tq, tk)
    st["context"].shape = (b, nh, tq, dv)
    allowed_counts: list[int] | None = None
    loose_range = False  # some block's value-range check used the block's key range, not each query's
    headroom = math.log(torch.finfo(run.dtype).max)  # exp overflows the run's dtype above this score
    # bfloat16 matrix products on the CPU go through oneDNN, which caches a primitive (and its
    # buffers, megabytes each) per distinct shape: key ranges in steps of tk/16 keep those few
    width_step = max(64, -(-tk // 16)) if run.dtype == torch.bfloat16 and q.device.type == "cpu" else 1
    sdpa_done, sdpa_rows = 0, _sdpa_group_rows(relation, blocks, b, nh, tk)
    pending: list[tuple[int, int]] = []  # blocks of the current SDPA group not yet compared
    if tq == tk and _plain_causal(relation, blocks, tk):
        # the intended relation is exactly causal: SDPA gets it as is_causal on the whole input, once
        sdpa_ctx = F.scaled_dot_product_attention(q, k_exp, v_exp, dropout_p=0.0, is_causal=True, scale=ref_scale)
        sdpa_done = tq

    for n_done, (q0, q1) in enumerate(blocks):
        rows = q1 - q0
        allow_i = relation.block(q0, q1)  # intended, [B|1, Nh|1, rows, Tk]
        allow_p = ops.polarity(allow_i)  # what the pipeline applies
        lo, hi, v0, v1, p0, p1, all_live = _block_layout(relation, allow_i, allow_p, q0, q1, tk, full_keys, width_step)
        kw = hi - lo
        ai = None if allow_i is None else allow_i[..., lo:hi]
        ap = None if allow_p is None else allow_p[..., lo:hi]
        if allow_i is not None and tq <= 32:
            counts = allow_i.expand(max(b, 1), allow_i.shape[1], rows, tk)[0, 0].sum(dim=-1).tolist()  # batch 0, head 0
            allowed_counts = (allowed_counts or []) + [int(c) for c in counts]
        qb = q[:, :, q0:q1]  # [B, Nh, rows, Dh]
        kb, vb = k_exp[:, :, lo:hi], v_exp[:, :, lo:hi]  # [B, Nh, kw, Dh], [B, Nh, kw, Dv]
        grid = (b, nh, rows, kw)
        # [B, Nh, rows]: which queries have an allowed key; None when all of them do
        live = None if all_live else ai.any(dim=-1).expand(b, nh, rows)

        # float64 reference (sampled blocks), and the plain same-dtype one for half precision
        ref_blk = plain_blk = None
        ra, rz = sampled.get(n_done, (0, 0))  # rows of this block the reference covers
        r_ = slice(ra, rz)
        ai_r = None if ai is None else (ai[:, :, r_] if ai.shape[2] > 1 else ai)
        if rz > ra:
            at = sample_at[n_done]
            ref_blk = {"out": ref_all["out"][:, :, at:at + rz - ra]}  # [B, Nh, rz - ra, Dv]
            ref_ctx[(q0 + ra, q0 + rz)] = ref_blk["out"]
            if half or user or backends:  # compared block by block: the block's key range of each grid stage
                for key in ("scores", "masked_scores", "weights"):
                    ref_blk[key] = ref_all[key][:, :, at:at + rz - ra, lo:hi]  # [B, Nh, rz - ra, kw]
            if half:
                plain_blk = reference_stages(qb[:, :, r_], kb, vb, allow_mask=ai_r, scale=ref_scale,
                                             empty_rows=empty, dtype=run.dtype)

        # scores
        s_st = st["scores"]
        try:
            s = ops.scores(qb, kb, scale)  # [B, Nh, rows, kw]
        except Exception as exc:  # a stage that raises is a level-1 divergence at that stage
            s_st.raised = exc
            return None, sdpa_ctx, ref_ctx
        if tuple(s.shape) != grid:
            s_st.shape = tuple(s.shape) if len(blocks) == 1 else s_st.shape
            s_st.add("shape_mismatch", 1)
            s_st.extra.append(C.shape_check(s.shape, grid, AXES["scores"], "shape"))
            return None, sdpa_ctx, ref_ctx
        s_lo, s_hi = (float(x) for x in torch.aminmax(s)) if s.numel() else (0.0, 0.0)  # finiteness, largest |score|
        if math.isnan(s_lo) or math.isnan(s_hi):
            s_st.add("nonfinite", C.nonfinite_count(s))
            s_st.max("max_abs", math.nan)
        else:
            s_st.add("nonfinite", 0 if math.isfinite(s_lo) and math.isfinite(s_hi) else C.nonfinite_count(s))
            largest = max(abs(s_lo), abs(s_hi))
            if largest >= headroom and ai is not None and v1 > v0:
                # a forbidden pair never reaches exp (a padded key may hold anything): allowed pairs only
                band = torch.where(ai[..., v0:v1], s[..., v0:v1], torch.zeros((), dtype=s.dtype, device=s.device))
                largest = max(_max_abs(s[..., :v0]), _max_abs(band), _max_abs(s[..., v1:]))
            s_st.max("max_abs", largest)
        if ref_blk is not None:
            sample.put("scores", at, s[:, :, r_], lo, hi)
            if plain_blk is not None:
                s_st.max("plain_diff", _excess(plain_blk["scores"], ref_blk["scores"], 0, 0)[0])
        if "scores" in user:
            us = user["scores"][:, :, q0 + ra:q0 + rz]
            st["user_scores"] = st.get("user_scores") or _Stage()
            _user_compare(st["user_scores"], us, ref_blk["scores"] if ref_blk is not None else None, rtol, atol)

        # masked scores: the mask function runs on the key columns where the pipeline's relation
        # is not all-allowed; on the others masking is the identity, so those columns of the
        # scores are kept as they are (and were screened finite at the scores stage).
        m_st = st["masked_scores"]
        scores_clean = math.isfinite(s_lo) and math.isfinite(s_hi)
        try:
            m = s.clone() if keep else s  # [B, Nh, rows, kw]; s itself is not used again
            if p1 > p0:
                band_in = s[..., p0:p1]
                band_out = ops.mask(band_in, ap[..., p0:p1])
                if tuple(band_out.shape) != tuple(band_in.shape):  # never let a wrong shape broadcast in
                    m_st.extra.append(C.shape_check(
                        (*band_out.shape[:-1], kw), grid, AXES["masked_scores"], "shape"))
                    return None, sdpa_ctx, ref_ctx
                m[..., p0:p1] = band_out
        except Exception as exc:
            m_st.raised = exc
            return None, sdpa_ctx, ref_ctx
        u0, u1 = (v0, v1) if p1 <= p0 else ((p0, p1) if v1 <= v0 else (min(v0, p0), max(v1, p1)))
        forbid = None if ai is None or v1 <= v0 else ~ai[..., v0:v1]  # [B|1, Nh|1, rows, v1 - v0]
        _mask_counts(m_st, m, ai, live, empty_zero, u0, u1, b, nh, rows, tk, outside_clean=scores_clean,
                     forbid=forbid if (u0, u1) == (v0, v1) else None)

        # weights
        w_st = st["weights"]
        try:
            w = ops.softmax(m, ap, empty_zero)  # [B, Nh, rows, kw]
        except Exception as exc:
            w_st.raised = exc
            return None, sdpa_ctx, ref_ctx
        if tuple(w.shape) != grid:
            w_st.extra.append(C.shape_check(w.shape, grid, AXES["weights"], "shape"))
            return None, sdpa_ctx, ref_ctx
        _weight_invariants(w_st, w, ai, live, empty_zero, band=(v0, v1), count_nonfinite=True, forbid=forbid)
        if ref_blk is not None:
            sample.put("weights", at, w[:, :, r_], lo, hi)
            if plain_blk is not None:
                w_st.max("plain_diff", _excess(plain_blk["weights"], ref_blk["weights"], 0, 0)[0])
        if "weights" in user:
            uw = user["weights"][:, :, q0:q1]
            ust = st.setdefault("user_weights", _Stage())
            ust.add("nonfinite", C.nonfinite_count(uw))
            _weight_invariants(ust, uw, ai, live, empty_zero)
            _user_compare(ust, uw[:, :, r_], ref_blk["weights"] if ref_blk is not None else None, rtol, atol)

        # context
        c_st = st["context"]
        try:
            c = ops.mix(w, vb)  # [B, Nh, rows, Dv]
        except Exception as exc:
            c_st.raised = exc
            return None, sdpa_ctx, ref_ctx
        if tuple(c.shape) != (b, nh, rows, dv):
            c_st.extra.append(C.shape_check(c.shape, (b, nh, rows, dv), AXES["context"], "shape"))
            return None, sdpa_ctx, ref_ctx
        context[:, :, q0:q1] = c
        span = None if chunks is None else _value_span(v_exp, chunks, lo, hi)
        c_st.max("range_excess", _range_excess(c, vb, ai, rtol, atol, span=span))
        loose_range = loose_range or (ai is not None and b * nh * rows * kw * dv > EXACT_RANGE_BUDGET)
        if q1 > sdpa_done:  # SDPA runs on a group of blocks at once: its kernel is faster on more rows
            sdpa_done = _sdpa_rows(sdpa_ctx, q, k_exp, v_exp, relation, q0, blocks, sdpa_rows, ref_scale)
        sd = sdpa_ctx[:, :, q0:q1]  # [B, Nh, rows, Dv]
        pending.append((q0, q1))
        if q1 - pending[0][0] >= sdpa_rows or q1 == tq:  # compare a group of blocks with SDPA in one go
            _compare_sdpa(c_st, context, sdpa_ctx, pending, rtol, atol)
            pending = []
        if ref_blk is not None:
            sample.put("out", at, c[:, :, r_])
            if half and plain_blk is not None:
                c_st.max("plain_diff", _excess(plain_blk["out"], ref_blk["out"], 0, 0)[0])
                c_st.max("sdpa_ref_diff", _excess(sd[:, :, r_], ref_blk["out"], 0, 0)[0])
        if "out" in user:
            uo = user["out"][:, :, q0:q1]
            ust = st.setdefault("user_out", _Stage())
            ust.add("nonfinite", C.nonfinite_count(uo))
            ust.max("range_excess", _range_excess(uo, vb, ai, rtol, atol, span=span))
            if not half:  # SDPA covers every row, also those the float64 sample leaves out
                d, ex = _excess(uo, sd, rtol, atol * max(1.0, _max_abs(sd)))
                ust.max("sdpa_diff", d)
                ust.max("sdpa_excess", ex)
            if ref_blk is not None:
                _user_compare(ust, uo[:, :, r_], ref_blk["out"], rtol, atol * max(1.0, _max_abs(ref_blk["out"])))
                if half and plain_blk is not None:
                    ust.max("plain_diff", _excess(plain_blk["out"], ref_blk["out"], 0, 0)[0])
        if backends:
            _backend_compare(c_st, backends, c, (qb, kb, vb), None, ai, ref_scale, None, run.dtype)
            if ref_blk is not None:
                ref_in = (q_ref[:, :, q0 + ra:q0 + rz], repeat_kv(k_ref[:, :, lo:hi], nh), repeat_kv(v_ref[:, :, lo:hi], nh))
                _backend_compare(c_st, backends, c[:, :, r_], (qb[:, :, r_], kb, vb), ref_in, ai_r, ref_scale, ref_blk, run.dtype)

        if keep:
            for name, t in (("scores", s), ("masked_scores", m), ("weights", w)):
                run.kept.setdefault(name, []).append(t)
        if progress is not None:
            progress(n_done + 1, len(blocks))

    if loose_range:
        run.notes.append("context in_value_range: blocks over 2^18 (query, key, value-width) entries compare each row with "
                         "the value range of all the block's keys, a looser bound than the keys that row may use")
    if allowed_counts is not None and len(allowed_counts) <= 32:
        run.notes.append(f"allowed keys per query (b=0, h=0): {allowed_counts}")
    if keep and b > 0 and b * nh * tq * tk <= 16 and b * nh * tq * dv <= 16:
        w_all = torch.cat(run.kept["weights"], dim=2)
        run.row_values["weights"] = "weights (b=0, h=0): " + _rows_text(w_all[0, 0])
        run.row_values["context"] = "context (b=0, h=0): " + _rows_text(context[0, 0])
    return context, sdpa_ctx, ref_ctx


def _rows_text(t: "Tensor") -> str:
    return "[" + ", ".join("[" + ", ".join(f"{x:.6f}" for x in row) + "]" for row in t.tolist()) + "]"


def _user_compare(ust: _Stage, actual: "Tensor", expected: "Tensor | None", rtol: float, atol: float) -> None:
    if expected is None:
        return
    d, ex = C.excess_error(actual, expected, rtol, atol)
    ust.max("ref_diff", d)
    ust.max("ref_excess", ex)


def _sdpa_group_rows(relation: Relation, blocks: list[tuple[int, int]], b: int, nh: int, tk: int) -> int:
    """Query rows per SDPA call: at least one ledger block, up to SDPA_ROWS while its mask stays small."""
    rows = blocks[0][1] - blocks[0][0]
    allow = None if relation.top_left_causal else relation.block(0, min(rows, blocks[-1][1]))  # [B|1, Nh|1, ..]
    mask_per_row = tk * (1 if allow is None else allow.shape[0] * allow.shape[1])  # bool mask entries per query row
    return max(rows, min(SDPA_ROWS, BLOCK_TARGET // max(1, mask_per_row)) // rows * rows)


def _sampled_reference(q: "Tensor", k: "Tensor", v: "Tensor", relation: Relation, blocks: list[tuple[int, int]],
                       sampled: dict[int, tuple[int, int]], scale: float, empty: str,
                       dtype: "torch.dtype") -> dict[str, "Tensor"]:
    """The reference's stages for every sampled row, over every key, in one call.

    Returns ``{"scores", "masked_scores", "weights": [B, Nh, R, Tk], "out": [B, Nh, R, Dv]}``
    for the R rows :func:`_sampled` picked, block after block. One call on all of them at once
    keeps the per-call cost of the reference (casts, kernel launches) from recurring per block.
    """
    import torch

    tk = k.shape[-2]
    spans = [(blocks[i][0] + a, blocks[i][0] + z) for i, (a, z) in sorted(sampled.items())]  # absolute query rows
    contiguous = all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1))
    qs = q[:, :, spans[0][0]:spans[-1][1]] if contiguous else torch.cat([q[:, :, r0:r1] for r0, r1 in spans], dim=2)
    allow = None
    if relation.parts:
        parts = []
        for r0, r1 in spans:
            a = relation.block(r0, r1)  # [B|1, Nh|1, rows|1, Tk]
            parts.append(a.expand(a.shape[0], a.shape[1], r1 - r0, tk))
        allow = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    ref = _reference_block(qs, k, v, allow, scale, empty, dtype)
    return {key: t for key, t in ref.items() if key != "allow"}


class _Sample:
    """The pipeline's scores, weights and context on the reference-sampled rows, gathered over
    blocks and compared with the reference once per stage.

    ``got`` starts as a copy of the reference, so key columns a block did not compute (outside
    its key range, where every sampled query is forbidden) compare equal; each block writes
    its own columns over it. The tolerance follows the whole-grid rule: atol scaled by the
    largest |reference value| of the sampled rows; for the scores, of the allowed pairs only,
    so that a forbidden key holding garbage (a padded position, say) cannot loosen it.
    """

    KEYS = (("scores", "scores"), ("weights", "weights"), ("out", "context"))

    def __init__(self, ref: dict[str, "Tensor"]) -> None:
        self.ref = ref
        self.got = {key: ref[key].clone() for key, _ in self.KEYS}
        self.filled = {key: 0 for key, _ in self.KEYS}  # rows written so far, block after block

    def put(self, key: str, at: int, t: "Tensor", lo: int = 0, hi: int | None = None) -> None:
        dst = self.got[key][:, :, at:at + t.shape[2]]
        (dst if key == "out" else dst[..., lo:hi]).copy_(t)
        self.filled[key] = at + t.shape[2]

    def judge(self, stages: dict[str, _Stage], rtol: float, atol: float) -> None:
        import torch

        for key, stage in self.KEYS:
            n = self.filled[key]
            if not n:
                continue
            got, ref = self.got[key][:, :, :n], self.ref[key][:, :, :n]
            if key == "scores":
                masked = self.ref["masked_scores"][:, :, :n]  # -inf on forbidden pairs
                size = _max_abs(torch.where(torch.isneginf(masked), 0.0, masked))
            else:
                size = _max_abs(ref)
            d, ex = _excess(got, ref, rtol, atol if key == "weights" else atol * max(1.0, size))
            stages[stage].max("ref_diff", d)
            stages[stage].max("ref_excess", ex)


def _reference_block(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float, empty: str,
                     dtype: "torch.dtype") -> dict[str, "Tensor"]:
    """The reference's stages for one block, a few query heads at a time when K and V are long.

    Heads are independent, so chunking over them changes nothing but the size of the
    reference-dtype copies of K and V that exist at once (at most about REF_CHUNK_BYTES).
    """
    import torch

    from attn_ledger.reference import reference_stages

    nh, nkv = q.shape[1], k.shape[1]
    group = nh // nkv  # query heads per kv head
    per_kv_head = k.shape[0] * k.shape[2] * (k.shape[3] + v.shape[3]) * torch.finfo(dtype).bits // 8
    kv_step = max(1, REF_CHUNK_BYTES // max(1, per_kv_head))
    if kv_step >= nkv:
        return reference_stages(q, k, v, allow_mask=allow, scale=scale, empty_rows=empty, dtype=dtype)
    parts: list[dict[str, Tensor]] = []
    for j0 in range(0, nkv, kv_step):
        j1 = min(j0 + kv_step, nkv)
        h0, h1 = j0 * group, j1 * group
        a = allow if allow is None or allow.shape[1] == 1 else allow[:, h0:h1]
        parts.append(reference_stages(q[:, h0:h1], k[:, j0:j1], v[:, j0:j1], allow_mask=a, scale=scale,
                                      empty_rows=empty, dtype=dtype))
    return {key: torch.cat([p[key] for p in parts], dim=1) for key in ("scores", "masked_scores", "weights", "out")}


def _plain_causal(relation: Relation, blocks: list[tuple[int, int]], tk: int) -> bool:
    """Whether the relation is exactly "key j <= query i" for every batch, head and query (Tq == Tk)."""
    from attn_ledger import masks

    if relation.top_left_causal:
        return True
    if not relation.parts:
        return False
    for q0, q1 in blocks:
        allow = relation.block(q0, q1)  # [B|1, Nh|1, rows, Tk]
        if allow is None or allow.shape[0] != 1 or allow.shape[1] != 1:
            return False
        if not bool((allow[0, 0] == masks.causal(tk, tk, "top-left", q0, q1, allow.device)).all()):
            return False
    return True


def _sdpa_rows(out: "Tensor", q: "Tensor", k: "Tensor", v: "Tensor", relation: Relation, q0: int,
               blocks: list[tuple[int, int]], group_rows: int, scale: float) -> int:
    """F.scaled_dot_product_attention on query rows ``q0 .. q0 + group_rows`` (whole blocks), into ``out``.

    The intended relation goes in as a boolean mask on the keys it allows; returns the last row done.
    """
    import torch.nn.functional as F

    q1 = min(q0 + group_rows, blocks[-1][1])
    allow = relation.block(q0, q1)  # [B|1, Nh|1, rows, Tk]
    lo, hi = _key_hull(allow, tk=k.shape[-2])
    mask = None if allow is None else allow[..., lo:hi]
    out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, lo:hi], v[:, :, lo:hi],
                                                      attn_mask=mask, dropout_p=0.0, scale=scale)
    return q1


def _compare_sdpa(c_st: _Stage, context: "Tensor", sdpa_ctx: "Tensor", done: list[tuple[int, int]],
                  rtol: float, atol: float) -> None:
    """Context against SDPA for consecutive blocks: non-finite count, max |diff|, and each block's excess.

    Each block's atol is scaled by that block's largest |SDPA value|, as if compared one by one.
    The arithmetic is in float32 (float64 for float64 runs): the difference of two values
    within a factor of two of each other is exact there, and the tolerance terms carry
    rounding of about 1e-7 of their size, far below any tolerance in use.
    """
    import torch

    g0, g1 = done[0][0], done[-1][1]
    cg = context[:, :, g0:g1]  # [B, Nh, rows, Dv]
    c_st.add("nonfinite", 0 if C.all_finite(cg) else C.nonfinite_count(cg))
    sizes = {q1 - q0 for q0, q1 in done}
    if len(sizes) == 1 and cg.numel():
        r = sizes.pop()
        wide = torch.float64 if cg.dtype == torch.float64 else torch.float32
        sd = sdpa_ctx[:, :, g0:g1].to(wide)
        d = torch.sub(cg.to(wide), sd).abs_()  # [B, Nh, rows, Dv]
        diff = float(d.amax())
        if math.isfinite(diff):
            b, nh, _, dv = sd.shape
            e = sd.abs()  # [B, Nh, rows, Dv], changed in place below
            per = (b, nh, len(done), r, dv)
            scale = e.view(per).amax(dim=(0, 1, 3, 4)).clamp_(min=1.0)  # [blocks]: max(1, max |SDPA|)
            excess = d.sub_(e.mul_(rtol)).view(per).amax(dim=(0, 1, 3, 4)) - atol * scale  # [blocks]
            c_st.max("sdpa_diff", diff)
            c_st.max("sdpa_excess", float(excess.amax()))
            return
    for q0, q1 in done:
        sd = sdpa_ctx[:, :, q0:q1]
        d, ex = _excess(context[:, :, q0:q1], sd, rtol, atol * max(1.0, C.max_abs(sd)))
        c_st.max("sdpa_diff", d)
        c_st.max("sdpa_excess", ex)


def _max_abs(t: "Tensor") -> float:
    """Largest |value| in one ``aminmax`` pass (NaN if any value is NaN), as ``checks.max_abs``."""
    import torch

    if t.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(t))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))


def _excess(actual: "Tensor", expected: "Tensor", rtol: float, atol: float) -> tuple[float, float]:
    """:func:`checks.excess_error` with fewer passes over the grid; the same two numbers.

    Computed in float64 in place; when anything is non-finite it defers to
    ``checks.excess_error``, whose NaN and infinity rules then apply.
    """
    import torch

    if actual.numel() == 0 or actual.shape != expected.shape:
        return C.excess_error(actual, expected, rtol, atol)
    if actual.device.type == "mps":  # no float64 there: compare on the CPU, as checks.excess_error does
        return C.excess_error(actual.cpu(), expected.cpu(), rtol, atol)
    e = expected.to(torch.float64)
    d = actual.to(torch.float64, copy=True)
    d.sub_(e).abs_()  # |actual - expected|
    diff = float(d.amax())
    if not math.isfinite(diff):
        return C.excess_error(actual, expected, rtol, atol)
    d.sub_(e.abs_().mul_(rtol) if e is not expected else e.abs().mul_(rtol))
    return diff, float(d.amax()) - atol


def _mask_counts(st: _Stage, m: "Tensor", ai: "Tensor | None", live: "Tensor | None", empty_zero: bool,
                 v0: int, v1: int, b: int, nh: int, rows: int, tk: int, outside_clean: bool = False,
                 forbid: "Tensor | None" = None) -> None:
    """Masked-score counts for one block: NaN/+inf, rows with every key excluded, forbidden kept, allowed dropped.

    Outside the band ``[v0, v1)`` every pair is allowed, so there the counts are all zero
    exactly when the region holds no -inf, NaN or +inf, which one ``aminmax`` screens. The
    band (or the whole block, when a screen fails) is counted pair by pair. ``forbid``:
    ``~ai[..., v0:v1]`` when the caller already has it.
    """
    import torch

    kw = m.shape[-1]
    if outside_clean or (_clean_allowed(m[..., :v0]) and _clean_allowed(m[..., v1:])):
        a, z = v0, v1
    else:
        a, z = 0, kw
    mb = m[..., a:z]  # [B, Nh, rows, z - a]
    st.add("nan_or_posinf", 0 if C.all_finite(mb, allow_neg_inf=True) else C.nonfinite_count(mb, allow_neg_inf=True))
    neg = torch.isneginf(mb)  # excluded pairs
    if z - a < kw:
        blocked = 0  # every row keeps a finite score outside the band
    else:
        dead = neg.all(dim=-1)  # [B, Nh, rows]: query rows with every key excluded
        # keys outside the block's key hull are forbidden by both relations, so they are excluded by construction
        if live is not None and empty_zero:
            dead = dead & live
        blocked = int(dead.sum())
    st.add("fully_blocked", blocked)
    if ai is not None:
        ab = ai[..., a:z]  # [B|1, Nh|1, rows, z - a]
        nab = forbid if forbid is not None and (a, z) == (v0, v1) else ~ab  # [B|1, Nh|1, rows, z - a]
        wrong = int(torch.count_nonzero(neg ^ nab))  # allowed pairs excluded + forbidden pairs kept
        dropped = int(torch.count_nonzero(neg & ab)) if wrong else 0
        kept = wrong - dropped
        st.add("forbidden_kept", kept)
        st.add("allowed_dropped", dropped)
    st.add("pairs", b * nh * rows * tk)


def _weight_invariants(stage: _Stage, w: "Tensor", ai: "Tensor | None", live: "Tensor | None", empty_zero: bool,
                       band: tuple[int, int] | None = None, count_nonfinite: bool = False,
                       forbid: "Tensor | None" = None) -> None:
    """Row sums over keys, weight on forbidden keys, and declared-empty rows, for one block.

    ``band``: key columns ``[v0, v1)`` outside which ``ai`` allows every pair; forbidden
    keys lie only inside it. ``count_nonfinite``: also count non-finite weights, cleared
    at once when every row sum is finite (a NaN or infinite weight makes its row sum so).
    ``forbid``: ``~ai[..., v0:v1]`` when the caller already has it.
    """
    import torch

    sums = w.sum(dim=-1)  # [B, Nh, rows]
    s_lo, s_hi = (float(x) for x in torch.aminmax(sums)) if sums.numel() else (1.0, 1.0)
    sums_finite = math.isfinite(s_lo) and math.isfinite(s_hi)
    if count_nonfinite:
        stage.add("nonfinite", 0 if sums_finite else C.nonfinite_count(w))
    if live is None:  # every row has an allowed key: the extreme row sums give the largest |sum - 1|
        err = math.nan if math.isnan(s_lo) or math.isnan(s_hi) else max(1.0 - s_lo, s_hi - 1.0, 0.0)
    else:
        errs = torch.where(live, (sums - 1).abs(), torch.zeros_like(sums))
        err = float(errs.amax()) if errs.numel() else 0.0
        if empty_zero and bool((~live).any()):
            empty = w.abs().amax(dim=-1)  # [B, Nh, rows]
            stage.max("empty_row_max", float(torch.where(~live, empty, torch.zeros_like(empty)).amax()))
    stage.max("row_sum_err", err)
    v0, v1 = band if band is not None else (0, w.shape[-1])
    # a band (from _band) holds a forbidden pair by construction; without one, look
    if ai is not None and v1 > v0 and (band is not None or not bool(ai[..., v0:v1].all())):
        ab = ai[..., v0:v1]  # [B|1, Nh|1, rows, v1 - v0]
        wb = w[..., v0:v1]
        if sums_finite:
            # every weight is finite (a NaN or infinite weight makes its row sum so): a weight
            # times 0 on allowed keys, times 1 on forbidden ones, is exact and leaves only the forbidden
            forb = wb * (~ab if forbid is None else forbid).to(w.dtype)
        else:
            forb = torch.where(ab, torch.zeros((), dtype=w.dtype, device=w.device), wb)
        lo, hi = torch.aminmax(forb) if forb.numel() else (torch.zeros(()), torch.zeros(()))
        lo, hi = float(lo), float(hi)
        stage.max("forbidden_max", math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi))
    else:
        stage.max("forbidden_max", 0.0)


def _range_excess(c: "Tensor", vb: "Tensor", ai: "Tensor | None", rtol: float, atol: float,
                  span: tuple["Tensor", "Tensor"] | None = None) -> float:
    """How far any context coordinate lies outside the per-coordinate range of the value rows it mixes.

    Exact (per query, over its allowed keys) when small enough; otherwise per block over
    the block's key span, which is a looser bound. ``span``: that span's per-coordinate
    (min, max) ``[B, Nh, 1, Dv]`` when already known (see :func:`_value_span`).
    """
    import torch

    b, nh, rows, dv = c.shape
    kw = vb.shape[-2]
    if kw == 0 or c.numel() == 0:
        return 0.0
    if ai is not None and b * nh * rows * kw * dv <= EXACT_RANGE_BUDGET:
        wide = _ref_dtype(c.device)  # float64, or float32 where the device has none
        cf = c.to(wide)
        vf = vb.to(wide)
        tol = atol + rtol * float(vf.abs().amax())
        allow = ai.expand(b, nh, rows, kw)[..., None]  # [B, Nh, rows, kw, 1]
        vv = vf[:, :, None, :, :]  # [B, Nh, 1, kw, Dv]
        lo = torch.where(allow, vv, torch.full_like(vv, math.inf)).amin(dim=-2)  # [B, Nh, rows, Dv]
        hi = torch.where(allow, vv, torch.full_like(vv, -math.inf)).amax(dim=-2)
        has = allow.any(dim=-2).expand_as(lo)
        lo = torch.where(has, lo, torch.zeros_like(lo))  # an empty row must be zeros
        hi = torch.where(has, hi, torch.zeros_like(hi))
    else:
        # float32 is enough here: a difference of two nearby floats is exact, and rounding
        # elsewhere is about 1e-7 of the values, far below the tolerance
        wide = torch.float64 if c.dtype == torch.float64 else torch.float32
        cf = c.to(wide)
        vlo, vhi = span if span is not None else (vb.amin(dim=-2, keepdim=True), vb.amax(dim=-2, keepdim=True))
        lo, hi = vlo.to(wide), vhi.to(wide)  # [B, Nh, 1, Dv]; min and max are exact in any dtype
        tol = atol + rtol * max(float(hi.amax()), -float(lo.amin()))  # largest |value| lies at an extreme
    below, above = float((lo - cf).amax()), float((cf - hi).amax())
    return math.nan if math.isnan(below) or math.isnan(above) else max(below, above) - tol


# --- SDPA backends -------------------------------------------------------------------

SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")  # names for torch.nn.attention.SDPBackend members
_BACKEND_MEMBERS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
BACKEND_GRID = SMALL_GRID  # grids up to this size also get the other half/float dtypes in the backend matrix


def _sdpa_pinned(name: str, q: "Tensor", k: "Tensor", v: "Tensor", mask: "Tensor | None", scale: float) -> "Tensor":
    """F.scaled_dot_product_attention with one backend pinned through ``torch.nn.attention.sdpa_kernel``.

    torch explains why a pinned backend cannot run in warnings; they are collected and, if the
    call fails, become its error message (the ledger reports them, so they are not printed).
    """
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as said, sdpa_kernel([getattr(SDPBackend, _BACKEND_MEMBERS[name])]):
        warnings.simplefilter("always")
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)
        except RuntimeError as exc:
            why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in said if str(w.message).strip()))
            raise RuntimeError(why or str(exc)) from exc


def resolve_backends(
    requested: "str | list[str] | tuple[str, ...] | None", device: "torch.device", run_dtype: "torch.dtype",
    masked: bool, grid: int,
) -> tuple[tuple[tuple[str, "torch.dtype"], ...], dict[str, str]]:
    """The (backend, dtype) pairs of the backend matrix that this device can run, and why the others cannot.

    Args:
        requested: ``"all"``, a comma-separated string, or a list of names from :data:`SDPA_BACKENDS`.
        masked: whether the run has a relation (the probe then passes a boolean mask, as the ledger will).
        grid: B*Nh*Tq*Tk; small grids also get float32, float16 and bfloat16 next to the run's dtype.

    Returns:
        ``(pairs, unavailable)``: pairs in matrix order; ``unavailable`` maps ``"name,dtype"`` to the reason.
    """
    import torch

    from attn_ledger.errors import InputError

    if requested is None:
        return (), {}
    names = list(requested) if not isinstance(requested, str) else [p.strip() for p in requested.split(",") if p.strip()]
    if names == ["all"]:
        names = list(SDPA_BACKENDS)
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if bad or not names:
        raise InputError(f"backends: got {requested!r}, expected 'all' or names from {', '.join(SDPA_BACKENDS)} joined by ','")
    dtypes = [run_dtype]
    if grid <= BACKEND_GRID:
        dtypes += [d for d in (torch.float32, torch.float16, torch.bfloat16) if d != run_dtype]
    pairs: list[tuple[str, torch.dtype]] = []
    unavailable: dict[str, str] = {}
    for name in names:
        for dt in dtypes:
            q = torch.randn(1, 2, 4, 8, device=device).to(dt)  # [B, Nh, Tq, Dh]
            mask = torch.ones(4, 4, dtype=torch.bool, device=device).tril()[None, None] if masked else None
            try:
                out = _sdpa_pinned(name, q, q, q, mask, 0.35)
                if not bool(torch.isfinite(out).all()):
                    raise RuntimeError("non-finite output on the probe")
            except Exception as exc:  # a backend this device, dtype or mask cannot run is not available
                text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
                unavailable[f"{name},{C.dtype_name(dt)}"] = text
                continue
            pairs.append((name, dt))
    return tuple(pairs), unavailable


def _backend_compare(st: _Stage, backends: tuple[tuple[str, "torch.dtype"], ...], c: "Tensor",
                     pipe_in: tuple["Tensor", "Tensor", "Tensor"], ref_in: "tuple[Tensor, Tensor, Tensor] | None",
                     ai: "Tensor | None", scale: float, ref_blk: "dict[str, Tensor] | None", run_dtype: "torch.dtype") -> None:
    """The L4 context comparison once per (backend, dtype), folded like the others.

    In the run's dtype: float32/float64 compare the pipeline's context with the pinned backend
    (tolerance as ``matches_sdpa``); half precision compares the backend's error against the
    float64 reference with the plain same-dtype error (factor rule). In another dtype (small
    grids), the backend runs on the reference's inputs cast to that dtype and its output is
    judged against the float64 reference by that dtype's rule (sampled blocks only).
    """
    from attn_ledger.reference import reference_stages

    for name, dt in backends:
        key = f"sdpa[{name},{C.dtype_name(dt)}]"
        if dt != run_dtype and ref_in is None:
            continue  # other dtypes are measured on the float64-sampled blocks only
        qb, kb, vb = (t.to(dt) for t in (pipe_in if dt == run_dtype else ref_in))
        try:
            out = _sdpa_pinned(name, qb, kb, vb, ai, scale)  # [B, Nh, rows, Dv]
        except Exception:  # passed the probe but not this block (e.g. a mask shape): count it as failing
            st.max(f"{key}|diff", math.nan)
            st.max(f"{key}|excess", math.nan)
            continue
        half = C.dtype_name(dt) in C.HALF_DTYPES
        if dt == run_dtype and not half:
            rtol, atol = C.tolerance(dt)
            d, ex = _excess(c, out, rtol, atol * max(1.0, _max_abs(out)))
            st.max(f"{key}|diff", d)
            st.max(f"{key}|excess", ex)
        elif ref_blk is not None:
            err = _excess(out, ref_blk["out"], 0, 0)[0]
            st.max(f"{key}|diff", err)
            if half:
                if dt == run_dtype and "plain_diff" in st.maxes:
                    continue  # judged against the run's own plain error, folded into plain_diff
                plain = reference_stages(qb, kb, vb, allow_mask=ai, scale=scale,
                                         empty_rows="zeros" if ai is not None else "nan", dtype=dt)["out"]
                st.max(f"{key}|plain", _excess(plain, ref_blk["out"], 0, 0)[0])
            else:
                rtol, atol = C.tolerance(dt)
                st.max(f"{key}|excess", _excess(out, ref_blk["out"], rtol, atol * max(1.0, _max_abs(ref_blk["out"])))[1])


def _backend_checks(st: _Stage, run_dtype: "torch.dtype") -> list[Check]:
    """One L4 check per (backend, dtype) measured, named ``sdpa[backend,dtype]``, in the order measured."""
    found: list[Check] = []
    seen = list(dict.fromkeys(k.split("|")[0] for k in st.maxes if k.startswith("sdpa[")))
    for key in seen:
        dt_name = key[:-1].split(",")[1]
        diff = st.maxes.get(f"{key}|diff", math.nan)
        if dt_name in C.HALF_DTYPES:
            plain = st.maxes.get(f"{key}|plain", st.maxes.get("plain_diff", math.nan) if dt_name == C.dtype_name(run_dtype) else math.nan)
            floor = 1e-3 if dt_name == "float16" else 8e-3
            found.append(C.factor_check(key, diff, plain, floor, "float64 reference"))
        else:
            rtol, atol = C.tolerance(dt_name)
            against = "the pipeline's context" if dt_name == C.dtype_name(run_dtype) else "float64 reference"
            found.append(C.compare_check(key, diff, st.maxes.get(f"{key}|excess", math.nan), rtol, atol, against))
    return found


def backend_matrix(found: "list[Check] | tuple[Check, ...]", unavailable: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{backend: {dtype: True | False | "unavailable: reason"}}`` from the ``sdpa[backend,dtype]`` checks."""
    matrix: dict[str, dict[str, Any]] = {}
    for c in found:
        if c.name.startswith("sdpa["):
            name, dt = c.name[5:-1].split(",")
            matrix.setdefault(name, {})[dt] = c.passed
    for key, why in unavailable.items():
        name, dt = key.split(",")
        matrix.setdefault(name, {})[dt] = f"unavailable: {why}"
    return matrix


# --- judging the folded measurements ----------------------------------------------------

def _cmp(st: _Stage, name: str, key: str, against: str, rtol: float, atol: float) -> Check | None:
    if f"{key}_diff" not in st.maxes:
        return None
    return C.compare_check(name, st.maxes[f"{key}_diff"], st.maxes[f"{key}_excess"], rtol, atol, against)


def _half_floor(dtype: "torch.dtype") -> float:
    """Smallest plain same-dtype error the factor rule divides by (float16 or bfloat16)."""
    return 1e-3 if C.dtype_name(dtype) == "float16" else 8e-3


def _half_cmp(st: _Stage, dtype: "torch.dtype") -> Check | None:
    """Half precision: the error against float64 within a factor of the plain same-dtype computation's."""
    if "ref_diff" not in st.maxes or "plain_diff" not in st.maxes:
        return None
    return C.factor_check("matches_reference", st.maxes["ref_diff"], st.maxes["plain_diff"], _half_floor(dtype), "float64 reference")


def _judge_grid_stages(run: _Run, relation: Relation, empty_zero: bool) -> dict[str, list[Check]]:
    st = run.stages
    rtol, atol = C.tolerance(run.dtype)
    out: dict[str, list[Check]] = {}
    tol_sum = max(1e-5, 10 * rtol)
    half = C.dtype_name(run.dtype) in C.HALF_DTYPES

    s = st["scores"]
    out["scores"] = [*s.extra]
    if s.shape is not None and not s.extra:
        out["scores"].append(_blocks_shape_check(s.shape, AXES["scores"]))
    if "nonfinite" in s.counts:
        out["scores"].append(C.finite_check(s.counts["nonfinite"], "scores"))
        out["scores"].append(_headroom(s.maxes.get("max_abs", 0.0), run.dtype))
        out["scores"] += _reference_check(s, run.dtype, half, rtol, atol)
    if "user_scores" in st:
        out["scores"] += _user_checks(st["user_scores"], "scores", rtol, atol, tol_sum)

    m = st["masked_scores"]
    out["masked_scores"] = [*m.extra]
    if "pairs" in m.counts:
        out["masked_scores"] += [
            _blocks_shape_check(m.shape, AXES["masked_scores"]),
            C.finite_check(m.counts["nan_or_posinf"], "masked scores", allow_neg_inf=True),
            C.count_check(3, "no_fully_blocked_query", m.counts["fully_blocked"],
                          "query rows with every key blocked" + (" (beyond rows declared empty)" if empty_zero else "")),
        ]
        if "forbidden_kept" in m.counts:
            out["masked_scores"] += [
                C.count_check(3, "forbidden_excluded", m.counts["forbidden_kept"], "forbidden (query, key) scores not excluded"),
                C.count_check(3, "allowed_kept", m.counts["allowed_dropped"], "allowed (query, key) scores excluded"),
            ]
        else:
            out["masked_scores"].append(unjudged(3, "forbidden_excluded", "not_applicable", "no relation: every key allowed"))

    w = st["weights"]
    out["weights"] = [*w.extra]
    if "nonfinite" in w.counts:
        out["weights"] += [
            _blocks_shape_check(w.shape, AXES["weights"]),
            C.finite_check(w.counts["nonfinite"], "weights"),
            C.bound_check(3, "key_row_sums", w.maxes.get("row_sum_err", 0.0), tol_sum, "max |sum over keys - 1|"),
            C.bound_check(3, "forbidden_weight", w.maxes.get("forbidden_max", 0.0), tol_sum, "largest weight on a forbidden key"),
        ]
        if "empty_row_max" in w.maxes:
            out["weights"].append(C.bound_check(3, "empty_rows_zero", w.maxes["empty_row_max"], 0.0, "largest weight in a declared-empty row"))
        out["weights"] += _reference_check(w, run.dtype, half, rtol, atol)
    if "user_weights" in st:
        out["weights"] += _user_checks(st["user_weights"], "weights", rtol, atol, tol_sum)

    c_st = st["context"]
    out["context"] = [*c_st.extra]
    if "nonfinite" in c_st.counts:
        out["context"] += [
            _blocks_shape_check(c_st.shape, AXES["context"]),
            C.finite_check(c_st.counts["nonfinite"], "context values"),
            C.bound_check(3, "in_value_range", _nonneg(c_st.maxes.get("range_excess", 0.0)),
                          0.0, "largest excursion outside the mixed value rows' range"),
        ]
        if half and "plain_diff" in c_st.maxes:
            floor = 1e-3 if C.dtype_name(run.dtype) == "float16" else 8e-3
            out["context"].append(C.factor_check("matches_reference", c_st.maxes["ref_diff"], c_st.maxes["plain_diff"], floor, "float64 reference"))
            out["context"].append(C.factor_check("matches_sdpa", c_st.maxes["sdpa_ref_diff"], c_st.maxes["plain_diff"], floor, "float64 reference (SDPA's error)"))
        else:
            for ch in (_cmp(c_st, "matches_reference", "ref", "float64 reference", rtol, atol),
                       _cmp(c_st, "matches_sdpa", "sdpa", "F.scaled_dot_product_attention", rtol, atol)):
                if ch:
                    out["context"].append(ch)
    if "nonfinite" in c_st.counts:
        out["context"] += _backend_checks(c_st, run.dtype)
    if "user_out" in st:
        u = st["user_out"]
        n_bad = u.counts.get("nonfinite", 0)
        out["context"].append(counted(3, "user_out_finite", "non-finite values in the given out", n_bad))
        excess = u.maxes.get("range_excess", 0.0)
        out["context"].append(C.bound_check(3, "user_out_in_value_range", _nonneg(excess), 0.0,
                                            "given out: largest excursion outside the mixed value rows' range"))
        if half and "plain_diff" in u.maxes:
            floor = 1e-3 if C.dtype_name(run.dtype) == "float16" else 8e-3
            out["context"].append(C.factor_check("user_out_matches_reference", u.maxes["ref_diff"], u.maxes["plain_diff"], floor, "float64 reference"))
        else:
            for ch in (_cmp(u, "user_out_matches_reference", "ref", "float64 reference", rtol, atol),
                       _cmp(u, "user_out_matches_sdpa", "sdpa", "F.scaled_dot_product_attention (every row)", rtol, atol)):
                if ch:
                    out["context"].append(ch)
    return out


def _reference_check(st: _Stage, dtype: "torch.dtype", half: bool, rtol: float, atol: float) -> list[Check]:
    """L4 against the float64 reference: the factor rule in half precision, tolerances otherwise."""
    c = _half_cmp(st, dtype) if half else _cmp(st, "matches_reference", "ref", "float64 reference", rtol, atol)
    return [c] if c else []


def _nonneg(value: float) -> float:
    """An excess clipped at zero for display, NaN kept (it fails the bound)."""
    return value if math.isnan(value) else max(0.0, value)


def _blocks_shape_check(derived: tuple[int, ...] | None, axes: str) -> Check:
    """L1 for a streamed stage: every block had its derived shape (a block that did not stops the
    run and records a failing shape check instead, with the shape it had)."""
    return Check(1, "shape", "pass", reason=f"{axes} derived {list(derived or ())}; every query block had its derived shape",
                 data={"expected": list(derived or ()), "axes": axes})


def _user_checks(u: _Stage, what: str, rtol: float, atol: float, tol_sum: float) -> list[Check]:
    found: list[Check] = []
    if u.extra:
        return list(u.extra)
    if what == "weights":
        n = u.counts.get("nonfinite", 0)
        found.append(counted(3, "user_weights_finite", "non-finite values in the given weights", n))
        found.append(C.bound_check(3, "user_weights_key_row_sums", u.maxes.get("row_sum_err", 0.0), tol_sum, "given weights: max |sum over keys - 1|"))
        found.append(C.bound_check(3, "user_weights_forbidden_weight", u.maxes.get("forbidden_max", 0.0), tol_sum,
                                   "given weights: largest weight on a forbidden key"))
    ch = _cmp(u, f"user_{what}_matches_reference", "ref", "float64 reference", rtol, atol)
    if ch:
        found.append(ch)
    return found


def _headroom(max_abs_score: float, dtype: "torch.dtype") -> Check:
    """Warning: the largest |score| against the dtype's range, and whether exp overflows without max-subtraction.

    Measured block-wide, and over the allowed pairs only once that reaches the limit (a
    forbidden pair is masked before exp, whatever it holds).
    """
    import torch

    info = torch.finfo(dtype)
    limit = math.log(info.max)
    return bounded(3, "exp_headroom", "largest |score| of an allowed pair", max_abs_score, limit, warn_only=True,
                   reason=f"exp overflows {C.dtype_name(dtype)} above the limit without max-subtraction",
                   data={"dtype_max": info.max})


# --- assembling the ledger ---------------------------------------------------------------

def _finish(
    command: str,
    title: str,
    order: tuple[str, ...],
    checks: dict[str, list[Check]],
    shapes: dict[str, tuple[int, ...] | None],
    raised: dict[str, BaseException],
    keep_going: bool,
    notes: list[str],
    meta: dict[str, Any],
    tensors: dict[str, Any],
    row_notes: dict[str, str] | None = None,
    axes: dict[str, str] | None = None,
) -> Report:
    """Turn per-stage checks into rows with statuses; the first failing stage is the finding.

    Rows after it are downstream evidence: with ``keep_going`` their failing checks read
    ``downstream``; without it they are not reached.
    """
    rows: list[Row] = []
    diverged = False
    stopped = False
    row_notes = row_notes or {}
    axes = axes or AXES
    for stage in order:
        found = list(checks.get(stage, []))
        if stage in raised:
            found = [C.raised_check(raised[stage])] + found
        computed = stage in checks or stage in raised
        note = row_notes.get(stage, "")
        if stopped or not computed:
            rows.append(Row(stage, "not_reached", tuple(unjudged(c.level, c.name, "not_reached", "") for c in found),
                            shapes.get(stage), axes[stage], note=note))
            continue
        failing = any(c.failed for c in found)
        if failing and diverged:
            found = [c.with_status("downstream") if c.failed else c for c in found]
            status = "downstream"
        elif failing:
            diverged, status = True, "fail"
        else:
            status = "warn" if any(c.status == "warn" for c in found) else "pass"
        rows.append(Row(stage, status, tuple(found), shapes.get(stage), axes[stage], note=note))
        if stage in raised or (diverged and not keep_going):
            stopped = True
    return Report(command, title, tuple(rows), notes=tuple(notes), details=meta, unit="check", row_label="stage",
                  tensors=tensors)


def _resolve_device(name: str) -> "torch.device":
    import torch

    from attn_ledger.errors import InputError

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device: got {name!r}, but CUDA is not available here; expected cpu or auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise InputError("device: got 'mps', but MPS is not available here; expected cpu or auto")
    return torch.device(name)


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _ref_dtype(device: "torch.device") -> "torch.dtype":
    import torch

    return torch.float32 if device.type == "mps" else torch.float64


def run_ledger(config: "RunConfig", *, keep_going: bool = False, progress: ProgressFn | None = None,
               backends: "str | list[str] | None" = None) -> Report:
    """Run the built-in multi-head attention as named stages and check each.

    Args:
        config: a validated :class:`~attn_ledger.config.RunConfig`.
        keep_going: evaluate every row after the first divergence (marked ``downstream``)
            instead of stopping there (later rows ``not_reached``).
        progress: optional ``callback(done, total)`` over query blocks.
        backends: ``"all"`` or SDPA backend names: the context comparison per backend (see :func:`ledger_on_qkv`).

    Returns:
        The :class:`~attn_ledger.report.Report`; ``report.first_finding`` is the diagnosis.
    """
    import torch

    from attn_ledger import reference as R
    from attn_ledger.pipeline import make_input, make_weights, ops_for, project

    cfg = config
    device = _resolve_device(cfg.device)
    dtype = _torch_dtype(cfg.dtype)
    ref_dtype = _ref_dtype(device)
    b, tq, tk, e, nh, nkv, dh, dv = cfg.batch_size, cfg.tq, cfg.tk, cfg.embed_dim, cfg.num_heads, cfg.nkv, cfg.dh, cfg.dv
    ops = ops_for(cfg.fault)
    empty_zero = cfg.empty_rows == "zeros"
    cross = cfg.query_len is not None
    relation = relation_from_config(cfg, device)
    stages = {s: _Stage() for s in CONFIG_STAGES}
    run = _Run(stages, dtype, {"B": b, "Nh": nh})
    checks: dict[str, list[Check]] = {}
    raised: dict[str, BaseException] = {}
    shapes: dict[str, tuple[int, ...] | None] = {}
    rtol, atol = C.tolerance(dtype)
    title = (f"ATTENTION LEDGER B={b} Tq={tq} Tk={tk} E={e} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={cfg.dtype}"
             + (f" fault={cfg.fault}" if cfg.fault else ""))
    meta = {"B": b, "Tq": tq, "Tk": tk, "E": e, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": cfg.dtype, "device": str(device), "fault": cfg.fault, "input": cfg.input, "seed": cfg.seed}

    def stop_here() -> bool:
        return not keep_going and any(c.failed for cs in checks.values() for c in cs)

    row_notes: dict[str, str] = {}

    def done(tensors: dict[str, Any] | None = None) -> Report:
        return locate(_finish("run", title, CONFIG_STAGES, checks, shapes, raised, keep_going, run.notes, meta,
                              tensors or {}, row_notes), empty_zero)

    # input
    x = make_input(b, tq, e, cfg.input, cfg.seed, dtype, device)  # [B, Tq, E]
    x_kv = make_input(b, tk, e, cfg.input, cfg.seed, dtype, device, offset=7919) if cross else x  # [B, Tk, E]
    w = make_weights(e, nh, nkv, dh, dv, cfg.seed, dtype, device)
    shapes["input"] = tuple(x.shape)
    # The input is built from the validated config, so nothing about it can fail here; the row
    # states what was validated instead of carrying checks that could not fail.
    checks["input"] = []
    row_notes["input"] = (f"E == Nh*Dh: {e} == {nh}*{dh} (validated with the config)"
                          + (f"; keys/values from x_kv [B,Tk,E] {list(x_kv.shape)}" if cross else ""))

    # head_roundtrip: split then merge an arange tensor, compared by value
    probe = torch.arange(max(1, min(b, 2)) * tq * e, dtype=torch.float64).reshape(-1, tq, e)  # [B', Tq, E]
    ctx_probe = torch.arange(probe.shape[0] * nh * tq * dv, dtype=torch.float64).reshape(-1, nh, tq, dv)  # [B', Nh, Tq, Dv]
    try:
        split = ops.split(probe, nh)
        rt = ops.merge(split)
        merged_probe = ops.merge(ctx_probe)
        shapes["head_roundtrip"] = tuple(rt.shape)
        checks["head_roundtrip"] = [
            C.shape_check(rt.shape, probe.shape, "[B,T,E]"),
            C.roundtrip_check(probe, rt),
            C.head_slices_check("split_head_slices", split, probe, nh, "split"),
            C.head_slices_check("merge_head_slices", ctx_probe, merged_probe, nh, "merge"),
        ]
    except Exception as exc:
        raised["head_roundtrip"] = exc
        return done()
    if stop_here():
        return done()

    # reference chain, float64, from the same input values and weights
    x64, xkv64 = x.to(ref_dtype), x_kv.to(ref_dtype)
    q64 = R.heads_of(x64 @ w.wq.to(ref_dtype).T, nh)  # [B, Nh, Tq, Dh]
    k64 = R.heads_of(xkv64 @ w.wk.to(ref_dtype).T, nkv)  # [B, Nkv, Tk, Dh]
    v64 = R.heads_of(xkv64 @ w.wv.to(ref_dtype).T, nkv)  # [B, Nkv, Tk, Dv]

    # q, k, v
    try:
        q = ops.split(project(x, w.wq), nh)  # [B, Nh, Tq, Dh]
        shapes["q"] = tuple(q.shape)
        checks["q"] = _proj_checks(q, (b, nh, tq, dh), "q", q64, rtol, atol)
    except Exception as exc:
        raised["q"] = exc
        return done()
    try:
        k = ops.split(project(x_kv, w.wk), nkv)  # [B, Nkv, Tk, Dh]
        shapes["k"] = tuple(k.shape)
        checks["k"] = _proj_checks(k, (b, nkv, tk, dh), "k", k64, rtol, atol)
        checks["k"].insert(1, C.kv_pairing_check(ops.expand, nh, nkv))
    except Exception as exc:
        raised["k"] = exc
        return done()
    try:
        v = ops.split(project(x_kv, w.wv), nkv)  # [B, Nkv, Tk, Dv]
        shapes["v"] = tuple(v.shape)
        checks["v"] = _proj_checks(v, (b, nkv, tk, dv), "v", v64, rtol, atol)
    except Exception as exc:
        raised["v"] = exc
        return done()
    if stop_here():
        return done()

    # score-grid stages, streamed over query blocks
    try:
        k_exp, v_exp = ops.expand(k, nh), ops.expand(v, nh)  # [B, Nh, Tk, Dh], [B, Nh, Tk, Dv]
    except Exception as exc:
        raised["scores"] = exc
        return done()
    ref = (q64, R.repeat_kv(k64, nh), R.repeat_kv(v64, nh))
    pairs, unavailable = resolve_backends(backends, device, dtype, bool(relation.parts), b * nh * tq * tk)
    if unavailable:
        run.notes.append("SDPA backends not available here: " + ", ".join(f"{k} ({why})" for k, why in unavailable.items()))
    if backends is not None:
        meta["sdpa_backends"] = {}  # filled in from the context row's checks below
    context, sdpa_ctx, ref_ctx = _attend_blocks(
        run, ops, q, k_exp, v_exp, ref, relation, scale=ops.scale_for(dh), ref_scale=1.0 / math.sqrt(dh),
        empty_zero=empty_zero, user={}, block_size=cfg.block_size, keep_grids=cfg.keep_grids, progress=progress,
        backends=pairs)
    if backends is not None:
        meta["sdpa_backends"].update(backend_matrix(_backend_checks(stages["context"], dtype), unavailable))
    grid_checks = _judge_grid_stages(run, relation, empty_zero)
    for stage in ("scores", "masked_scores", "weights", "context"):
        if stages[stage].raised is not None:
            raised[stage] = stages[stage].raised
        if grid_checks.get(stage) or stage in raised:
            checks[stage] = grid_checks.get(stage, [])
            shapes[stage] = stages[stage].shape
    tensors = _kept_grids(run, relation, b, nh, tq, tk)
    if context is None:
        return done(tensors)
    tensors["context"] = context
    picture = _picture(relation, tq, tk, b, nh)
    if picture:
        row_notes["masked_scores"] = "intended relation (b=0, h=0), queries as rows, keys as columns:\n" + picture
    row_notes.update(run.row_values)
    if stop_here():
        return done(tensors)

    # merged and output
    try:
        merged = ops.merge(context)  # [B, Tq, Nh*Dv]
        shapes["merged"] = tuple(merged.shape)
        ref_rows = sorted(ref_ctx)
        got = torch.cat([merged[:, q0:q1] for q0, q1 in ref_rows], dim=1)
        want = torch.cat([R.join_heads(ref_ctx[r]) for r in ref_rows], dim=1)
        checks["merged"] = [
            C.shape_check(merged.shape, (b, tq, nh * dv), AXES["merged"]),
            C.head_slices_check("merge_head_slices", context, merged, nh, "merge")
            if tuple(merged.shape) == (b, tq, nh * dv) else Check(2, "merge_head_slices", "fail", reason="the shape cannot hold the heads"),
        ]
        if got.shape == want.shape:
            d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
            checks["merged"].append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 reference"))
    except Exception as exc:
        raised["merged"] = exc
        return done(tensors)
    if stop_here():
        return done(tensors)
    try:
        out = project(merged, w.wo)  # [B, Tq, E]
        shapes["output"] = tuple(out.shape)
        tensors["output"] = out
        checks["output"] = [
            C.shape_check(out.shape, (b, tq, e), "[B,Tq,E] (the external layout)", "external_layout"),
            C.finite_check(C.nonfinite_count(out), "output values"),
        ]
        if tuple(out.shape) == (b, tq, e):
            wo64 = w.wo.to(ref_dtype)
            got = torch.cat([out[:, q0:q1] for q0, q1 in ref_rows], dim=1)
            want = torch.cat([R.join_heads(ref_ctx[r]) @ wo64.T for r in ref_rows], dim=1)
            d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
            checks["output"].append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 reference"))
            sd_out = R.join_heads(sdpa_ctx) @ w.wo.T
            d, ex = C.excess_error(out, sd_out, rtol, atol * max(1.0, C.max_abs(sd_out)))
            checks["output"].append(C.compare_check("matches_sdpa", d, ex, rtol, atol, "SDPA-based forward"))
    except Exception as exc:
        raised["output"] = exc
    return done(tensors)


def _kept_grids(run: _Run, relation: Relation, b: int, nh: int, tq: int, tk: int) -> dict[str, Any]:
    """The grids kept whole (small runs, or ``keep_grids``), with the intended relation beside them."""
    import torch

    tensors = {name: torch.cat(parts, dim=2) for name, parts in run.kept.items()}  # [B, Nh, Tq, Tk] each
    allow = relation.block(0, tq) if "scores" in tensors and tensors["scores"].shape[2] == tq else None
    if allow is not None:
        tensors["allow"] = allow.expand(b, nh, tq, tk)  # [B, Nh, Tq, Tk], True = may attend
    return tensors


def _picture(relation: Relation, tq: int, tk: int, b: int, nh: int) -> str | None:
    from attn_ledger.masks import picture

    if not relation.parts or tq > 16 or tk > 16:
        return None
    allow = relation.block(0, tq)
    if allow is None:
        return None
    return picture(allow.expand(max(b, 1), -1, -1, -1)[0, 0])


def _proj_checks(t: "Tensor", want: tuple[int, ...], name: str, ref: "Tensor", rtol: float, atol: float) -> list[Check]:
    found = [C.shape_check(t.shape, want, AXES[name]), C.finite_check(C.nonfinite_count(t), f"{name} values")]
    if tuple(t.shape) == tuple(ref.shape):
        d, ex = C.excess_error(t, ref, rtol, atol * max(1.0, C.max_abs(ref)))
        found.append(C.compare_check("matches_reference", d, ex, rtol, atol, "float64 projection + split"))
    return found


# --- saved or given tensors -----------------------------------------------------------

TENSOR_NAMES = ("q", "k", "v", "allow_mask", "key_valid", "scores", "weights", "out")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _validate_qkv(q: "Tensor", k: "Tensor", v: "Tensor") -> None:
    """Reject Q, K, V that cannot describe attention, with one line naming what is wrong."""
    import torch

    from attn_ledger.errors import InputError

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: got {type(t).__name__}, expected a tensor")
        if t.dim() not in (3, 4):
            raise InputError(f"{name}: got rank {t.dim()} shape {list(t.shape)}, expected [B, T, D] or [B, Nh, T, D]")
        if C.dtype_name(t.dtype) not in FLOAT_DTYPES:
            raise InputError(f"{name}: got dtype {C.dtype_name(t.dtype)}, expected one of {', '.join(FLOAT_DTYPES)}")
    if not (q.dim() == k.dim() == v.dim()):
        raise InputError(f"q/k/v: got ranks {q.dim()}, {k.dim()}, {v.dim()}, expected the same rank for all three")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"q/k/v: got dtypes {C.dtype_name(q.dtype)}, {C.dtype_name(k.dtype)}, {C.dtype_name(v.dtype)}, expected one dtype")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise InputError(f"batch: got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}, expected the same batch size B")
    if k.shape[-2] != v.shape[-2]:
        raise InputError(f"Tk: got k {k.shape[-2]} key positions and v {v.shape[-2]}, expected K and V token counts to match")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"Dh: got q width {q.shape[-1]} and k width {k.shape[-1]}, expected Q and K widths to match")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-2] == 0:
            raise InputError(f"{name}: got 0 token positions in shape {list(t.shape)}, expected at least one")
        if t.shape[-1] == 0:
            raise InputError(f"{name}: got feature width 0 in shape {list(t.shape)}, expected a nonzero width")
    if q.dim() == 4:
        nh, nkv = q.shape[1], k.shape[1]
        if k.shape[1] != v.shape[1]:
            raise InputError(f"Nkv: got k {k.shape[1]} heads and v {v.shape[1]}, expected the same number of kv heads")
        if nh == 0 or nkv == 0 or nh % nkv:
            raise InputError(f"Nkv: got Nh={nh} query heads and Nkv={nkv} kv heads, expected Nkv to divide Nh")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and not C.all_finite(t):
            raise InputError(f"{name}: holds {C.nonfinite_count(t)} NaN or inf values, expected finite inputs")


def ledger_on_qkv(
    q: "Tensor",
    k: "Tensor",
    v: "Tensor",
    *,
    allow_mask: "Tensor | None" = None,
    key_valid: "Tensor | None" = None,
    mask: str = "none",
    window: int | None = None,
    prefix_len: int | None = None,
    scores: "Tensor | None" = None,
    weights: "Tensor | None" = None,
    out: "Tensor | None" = None,
    empty_rows: str = "error",
    block_size: int | None = None,
    keep_grids: bool = False,
    keep_going: bool = False,
    progress: ProgressFn | None = None,
    source: str = "tensors",
    backends: "str | list[str] | None" = None,
) -> Report:
    """Run the ledger on given Q, K, V (and optionally the user's own intermediates).

    Args:
        q: ``[B, Tq, Dh]`` (one head) or ``[B, Nh, Tq, Dh]``.
        k: ``[B, Tk, Dh]`` or ``[B, Nkv, Tk, Dh]`` (Nkv divides Nh).
        v: ``[B, Tk, Dv]`` or ``[B, Nkv, Tk, Dv]``.
        allow_mask: bool ``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, Nh, Tq, Tk]``, True = may attend.
        key_valid: bool ``[B, Tk]``, True = a real key (placed as ``[B, 1, 1, Tk]``).
        mask: relations to add by name, joined by ``+``: ``causal`` (bottom-right),
            ``causal-top-left``, ``sliding-window`` (with ``window``), ``prefix-lm`` (with ``prefix_len``).
        scores, weights, out: the user's own intermediates (scores scaled, before masking),
            shaped like the derived grid / context; each is compared with the reference.
        empty_rows: ``"error"`` (a query with every key blocked is a divergence) or
            ``"zeros"`` (such rows are declared and must come out as zeros).
        backends: ``"all"`` or SDPA backend names (math, flash, efficient, cudnn): repeat the
            context comparison per backend the device offers, as ``sdpa[backend,dtype]`` checks.

    Returns:
        The :class:`~attn_ledger.report.Report` for stages input, scores, masked_scores, weights, context.
    """
    import torch

    from attn_ledger import masks
    from attn_ledger.errors import InputError
    from attn_ledger.pipeline import HEALTHY

    _validate_qkv(q, k, v)
    one_head = q.dim() == 3
    if one_head:
        q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, T, D]
    b, nh, tq, dh = q.shape
    nkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = q.dtype
    for name, t in (("allow_mask", allow_mask), ("key_valid", key_valid)):
        if t is not None and t.dtype != torch.bool:
            raise InputError(f"{name}: got dtype {C.dtype_name(t.dtype)}, expected bool (True = may attend / real key)")
    if allow_mask is not None:
        masks.expand_to_grid(allow_mask, b, nh, tq, tk)  # validates the named axes
    if key_valid is not None and tuple(key_valid.shape) != (b, tk):
        raise InputError(f"key_valid: got shape {list(key_valid.shape)}, expected [B, Tk]={[b, tk]}")
    relation = relation_from_tensors(b, nh, tq, tk, allow_mask, key_valid)
    extra_parts: list[Callable[[int, int], Tensor]] = []
    extra_names: list[str] = []
    for r in [p.strip() for p in (mask or "none").split("+")]:
        if r == "none":
            continue
        if r == "causal":
            extra_parts.append(lambda q0, q1: masks.causal(tq, tk, "bottom-right", q0, q1, q.device)[None, None])
            extra_names.append("causal (bottom-right)" if tq != tk else "causal")
        elif r == "causal-top-left":
            extra_parts.append(lambda q0, q1: masks.causal(tq, tk, "top-left", q0, q1, q.device)[None, None])
            extra_names.append("causal (top-left)")
        elif r == "sliding-window":
            if not window or window < 1:
                raise InputError(f"window: got {window!r}, expected a positive window length for mask 'sliding-window'")
            extra_parts.append(lambda q0, q1: masks.sliding_window(tq, tk, window, q0, q1, q.device)[None, None])
            extra_names.append(f"sliding window {window}")
        elif r == "prefix-lm":
            if prefix_len is None or prefix_len < 0:
                raise InputError(f"prefix_len: got {prefix_len!r}, expected a prefix length for mask 'prefix-lm'")
            extra_parts.append(lambda q0, q1: masks.prefix_lm(tq, tk, prefix_len, q0, q1, q.device)[None, None])
            extra_names.append(f"prefix-LM prefix {prefix_len}")
        else:
            raise InputError(f"mask: got {mask!r}, expected none, causal, causal-top-left, sliding-window or prefix-lm joined by '+'")
    if extra_parts:
        names = [n for n in (relation.name if relation.parts else "", *extra_names) if n]
        exact_causal = not relation.parts and extra_names in (["causal (top-left)"], ["causal"])
        relation = Relation(" + ".join(names), relation.parts + tuple(extra_parts), top_left_causal=exact_causal)
    if empty_rows not in ("error", "zeros"):
        raise InputError(f"empty_rows: got {empty_rows!r}, expected 'error' or 'zeros'")

    stages = {s: _Stage() for s in TENSOR_STAGES}
    run = _Run(stages, dtype, {"B": b, "Nh": nh})
    grid, ctx_shape = (b, nh, tq, tk), (b, nh, tq, dv)
    user: dict[str, Tensor] = {}
    for name, t, want in (("scores", scores, grid), ("weights", weights, grid), ("out", out, ctx_shape)):
        if t is None:
            continue
        if not t.is_floating_point():
            raise InputError(f"{name}: got dtype {C.dtype_name(t.dtype)}, expected a floating-point tensor")
        t4 = t[:, None] if (one_head and t.dim() == 3) else t
        st = stages.setdefault(f"user_{name}", _Stage())
        if tuple(t4.shape) != want:
            shown = "[B,Nh,Tq,Tk]" if name != "out" else "[B,Nh,Tq,Dv]"
            st.extra.append(C.shape_check(t.shape, want if not one_head else (want[0], *want[2:]),
                                          f"given {name} {shown if not one_head else shown.replace('Nh,', '')}", f"user_{name}_shape"))
        else:
            user[name] = t4
    checks: dict[str, list[Check]] = {}
    shapes: dict[str, tuple[int, ...] | None] = {"input": tuple(q.shape)}
    raised: dict[str, BaseException] = {}
    # Q, K, V were validated on the way in (ranks, batch, widths, token counts, kv heads, finite
    # values); the row says so instead of carrying checks that could not fail.
    checks["input"] = []
    k_exp, v_exp = HEALTHY.expand(k, nh), HEALTHY.expand(v, nh)
    ref = (q, k, v)  # cast to ref_dtype and kv heads repeated by the reference, one sampled block at a time
    pairs, unavailable = resolve_backends(backends, q.device, dtype, bool(relation.parts), b * nh * tq * tk)
    if unavailable:
        run.notes.append("SDPA backends not available here: " + ", ".join(f"{k} ({why})" for k, why in unavailable.items()))
    context, _, _ = _attend_blocks(
        run, HEALTHY, q, k_exp, v_exp, ref, relation, scale=1.0 / math.sqrt(dh), ref_scale=1.0 / math.sqrt(dh),
        empty_zero=empty_rows == "zeros", user=user, block_size=block_size, keep_grids=keep_grids, progress=progress,
        backends=pairs)
    grid_checks = _judge_grid_stages(run, relation, empty_rows == "zeros")
    for stage in ("scores", "masked_scores", "weights", "context"):
        if stages[stage].raised is not None:
            raised[stage] = stages[stage].raised
        checks[stage] = grid_checks.get(stage, [])
        shapes[stage] = stages[stage].shape
    tensors = _kept_grids(run, relation, b, nh, tq, tk)
    if "weights" in user and "weights" in tensors:
        tensors["user_weights"] = user["weights"]
    if context is not None:
        tensors["context"] = context
    row_notes = {"input": f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}" + (" (one head: Nh=1 inserted)" if one_head else "")
                 + "; batch, widths, token counts and finite values validated on load"
                 + (f"; query head h reads kv head h // {nh // nkv}" if nkv != nh else "")}
    picture = _picture(relation, tq, tk, b, nh)
    if picture:
        row_notes["masked_scores"] = "intended relation (b=0, h=0), queries as rows, keys as columns:\n" + picture
    row_notes.update(run.row_values)
    if allow_mask is not None and tq != tk:
        run.notes.append("allow_mask alignment: " + _alignment_of(allow_mask, b, nh, tq, tk))
    title = (f"ATTENTION LEDGER ({source}) B={b} Tq={tq} Tk={tk} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={C.dtype_name(dtype)}")
    meta = {"B": b, "Tq": tq, "Tk": tk, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": C.dtype_name(dtype), "device": str(q.device), "given": sorted(["q", "k", "v", *user])}
    axes = {**AXES, "input": "[B,Nh,Tq,Dh]"}
    led = locate(_finish("run", title, TENSOR_STAGES, checks, shapes, raised, keep_going, run.notes, meta, tensors,
                         row_notes, axes), empty_rows == "zeros")
    if backends is not None:
        meta["sdpa_backends"] = backend_matrix(led.row("context").checks, unavailable)
    return led


def _alignment_of(allow_mask: "Tensor", b: int, nh: int, tq: int, tk: int) -> str:
    """Say whether a saved mask is the causal relation aligned top-left, bottom-right, or neither."""
    from attn_ledger import masks

    grid = masks.expand_to_grid(allow_mask, b, nh, tq, tk)
    br = masks.causal(tq, tk, "bottom-right", device=allow_mask.device)
    tl = masks.causal(tq, tk, "top-left", device=allow_mask.device)
    if bool((grid == br).all()):
        return "causal, bottom-right (query i may use key j iff j <= i + Tk - Tq)"
    if bool((grid == tl).all()):
        return "causal, top-left (query i may use key j iff j <= i), which a KV-cache decode does not want"
    return "not a pure causal relation in either alignment"


def run_ledger_tensors(
    path: str,
    *,
    mask: str = "none",
    window: int | None = None,
    prefix_len: int | None = None,
    empty_rows: str = "error",
    dtype: str | None = None,
    device: str = "cpu",
    block_size: int | None = None,
    keep_grids: bool = False,
    keep_going: bool = False,
    progress: ProgressFn | None = None,
    backends: "str | list[str] | None" = None,
) -> Report:
    """Load a ``.pt``/``.safetensors``/``.npz`` file of q, k, v (and optional masks and intermediates) and run the ledger."""
    from attn_ledger.errors import TensorFileError
    from attn_ledger.tensorio import load_tensor_file

    found = load_tensor_file(path, "tensors")
    unknown = sorted(set(found) - set(TENSOR_NAMES))
    if unknown:
        raise TensorFileError(f"tensors: {path!r} holds unexpected tensor {unknown[0]!r}, expected names from {', '.join(TENSOR_NAMES)}")
    missing = [n for n in ("q", "k", "v") if n not in found]
    if missing:
        raise TensorFileError(f"tensors: {path!r} has no {missing[0]!r} tensor (found {sorted(found) or 'none'}), expected q, k and v")
    dev = _resolve_device(device)
    t = {n: x.to(dev) for n, x in found.items()}
    if dtype is not None:
        dt = _torch_dtype(dtype)
        for n in ("q", "k", "v", "scores", "weights", "out"):
            if n in t and t[n].is_floating_point():
                t[n] = t[n].to(dt)
    return ledger_on_qkv(
        t["q"], t["k"], t["v"], allow_mask=t.get("allow_mask"), key_valid=t.get("key_valid"), mask=mask,
        window=window, prefix_len=prefix_len, scores=t.get("scores"), weights=t.get("weights"), out=t.get("out"),
        empty_rows=empty_rows, block_size=block_size, keep_grids=keep_grids, keep_going=keep_going,
        progress=progress, source=str(path), backends=backends)
