"""The plan of a ledger run: which query blocks, which keys each computes, what the references cover.

A :class:`Plan` is computed from the sizes and the intended relation alone, before any
attention runs, and never changes. It holds numbers only:

* the query blocks (one block for small grids, else blocks of about BLOCK_TARGET grid
  entries and at least MIN_BLOCK_ROWS rows), and for each its key range ``[lo, hi)``
  (keys the relation forbids for the whole block are skipped), its band (the key columns,
  from ``lo``, where the relation is not "allowed" for every query; outside it the mask
  checks reduce to one screen) and whether every query has an allowed key;
* the query rows the float64 reference covers (all of them for small grids, else a few
  runs of rows spread over the grid);
* the groups of blocks that share one F.scaled_dot_product_attention call, or whether one
  ``is_causal`` call covers the whole input.

A relation known to be top-left causal gets its layout by arithmetic; any other is measured
from its column counts, built block by block (no attention runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.maths.relations import Relation

SMALL_GRID = 1 << 16  # grids up to this many entries are kept whole for inspection
BLOCK_TARGET = 1 << 22  # entries of one block's score grid when streaming (16 MiB in float32)
MIN_BLOCKS = 4  # grids above SMALL_GRID run in at least this many query blocks
MIN_BLOCK_ROWS = 32  # fewer query rows per block make the matrix products inefficient
F64_BUDGET = 1 << 18  # grid entries the float64 reference covers before sampling blocks
F64_SAMPLE = 1 << 15  # grid entries of the float64 sample once the grid is over F64_BUDGET
F64_SAMPLES = 3  # query blocks the float64 reference samples when the grid is over budget
SDPA_ROWS = 512  # query rows per SDPA reference call, when its mask stays within BLOCK_TARGET entries


@dataclass(frozen=True)
class Layout:
    """Where one block's work lies.

    Attributes:
        lo, hi: the keys the block computes.
        band: ``(v0, v1)`` from ``lo``: outside it the intended relation allows every pair.
        pipe_band: the same for the relation the pipeline applies (equal to ``band`` when
            the pipeline applies the intended relation).
        all_live: every query has an allowed key (or there is no relation).
    """

    lo: int
    hi: int
    band: tuple[int, int]
    pipe_band: tuple[int, int]
    all_live: bool

    @property
    def width(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Block:
    """One block of query rows ``[q0, q1)`` and its layout under the intended relation.

    ``sample``: rows ``(a, z)`` of the block (offsets) the float64 reference covers, or None;
    ``sample_at``: where those rows start among all the reference's rows.
    """

    index: int
    q0: int
    q1: int
    layout: Layout
    sample: tuple[int, int] | None = None
    sample_at: int = 0

    @property
    def rows(self) -> int:
        return self.q1 - self.q0


@dataclass(frozen=True)
class SdpaGroup:
    """Consecutive blocks ``first .. end - 1`` (query rows ``[q0, q1)``) that share one SDPA call and comparison."""

    q0: int
    q1: int
    first: int
    end: int


@dataclass(frozen=True)
class Plan:
    """The immutable plan of one run; see the module docstring.

    Attributes:
        b, nh, tq, tk: B, Nh, Tq, Tk.
        blocks: the query blocks, in order.
        keep: whole grids are kept for inspection (small grids, or asked for).
        full_keys: every block computes every key (kept grids, or given intermediates to compare).
        width_step: key ranges are widened to a multiple of this many keys.
        sdpa_groups: blocks sharing one SDPA call; ``sdpa_whole_causal``: one ``is_causal`` call covers all.
        value_chunks: precompute per-chunk value ranges for the context's value-range check.
    """

    b: int
    nh: int
    tq: int
    tk: int
    blocks: tuple[Block, ...]
    keep: bool
    full_keys: bool
    width_step: int
    sdpa_groups: tuple[SdpaGroup, ...]
    sdpa_whole_causal: bool
    value_chunks: bool

    @property
    def sampled(self) -> tuple[Block, ...]:
        return tuple(blk for blk in self.blocks if blk.sample is not None)

    @property
    def reference_spans(self) -> tuple[tuple[int, int], ...]:
        """The absolute query rows ``(r0, r1)`` the float64 reference covers, block after block."""
        return tuple((blk.q0 + blk.sample[0], blk.q0 + blk.sample[1]) for blk in self.sampled)

    @property
    def reference_rows(self) -> int:
        return sum(r1 - r0 for r0, r1 in self.reference_spans)

    def group_ending_at(self, index: int) -> SdpaGroup | None:
        """The SDPA group whose last block is ``index`` (compared once that block is done)."""
        for g in self.sdpa_groups:
            if g.end - 1 == index:
                return g
        return None

    def group_starting_at(self, index: int) -> SdpaGroup | None:
        for g in self.sdpa_groups:
            if g.first == index:
                return g
        return None


def make_plan(b: int, nh: int, tq: int, tk: int, relation: "Relation", *, block_size: int | None = None,
              keep_grids: bool = False, given: bool = False, width_step: int = 1) -> Plan:
    """The plan for a ``[B, Nh, Tq, Tk]`` grid under ``relation``.

    Args:
        block_size: query rows per block (None: chosen from the sizes).
        keep_grids: keep whole grids (every block computes every key).
        given: the user's own intermediates will be compared (every block computes every key).
        width_step: widen key ranges to multiples of this (see :func:`key_step`).
    """
    grid = b * nh * tq * tk
    keep = keep_grids or grid <= SMALL_GRID
    full_keys = keep or given
    spans = choose_blocks(b, nh, tq, tk, block_size)
    sampled = sample_rows(spans, b, nh, tk)
    blocks, at = [], 0
    for i, (q0, q1) in enumerate(spans):
        if relation.top_left_causal and q0 < min(q1, tk):
            lay = causal_layout(q0, q1, tk, full_keys, width_step)  # by arithmetic, no mask built
        else:
            allow = relation.block(q0, q1)  # [B|1, Nh|1, rows, Tk]
            lay = layout(relation, allow, allow, q0, q1, tk, full_keys, width_step)
        sample = sampled.get(i)
        blocks.append(Block(i, q0, q1, lay, sample, at))
        at += 0 if sample is None else sample[1] - sample[0]
    return Plan(b, nh, tq, tk, tuple(blocks), keep, full_keys, width_step,
                sdpa_groups(relation, spans, b, nh, tk), tq == tk and plain_causal(relation, spans, tk), grid > SMALL_GRID)


def key_step(dtype: "torch.dtype", device_type: str, tk: int) -> int:
    """Key ranges in steps of Tk/16 (at least 64) for bfloat16 on the CPU, else 1.

    bfloat16 matrix products on the CPU go through oneDNN, which caches a primitive (and its
    buffers, megabytes each) per distinct shape: a few widths keep those few.
    """
    import torch

    return max(64, -(-tk // 16)) if dtype == torch.bfloat16 and device_type == "cpu" else 1


def choose_blocks(b: int, nh: int, tq: int, tk: int, block_size: int | None) -> list[tuple[int, int]]:
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


def sample_rows(blocks: list[tuple[int, int]], b: int, nh: int, tk: int) -> dict[int, tuple[int, int]]:
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


def sdpa_groups(relation: "Relation", blocks: list[tuple[int, int]], b: int, nh: int, tk: int) -> tuple[SdpaGroup, ...]:
    """Blocks grouped for SDPA: at least one block a call, up to SDPA_ROWS rows while its mask stays small."""
    rows = blocks[0][1] - blocks[0][0]
    allow = None if relation.top_left_causal else relation.block(0, min(rows, blocks[-1][1]))  # [B|1, Nh|1, ..]
    mask_per_row = tk * (1 if allow is None else allow.shape[0] * allow.shape[1])  # bool mask entries per query row
    group_rows = max(rows, min(SDPA_ROWS, BLOCK_TARGET // max(1, mask_per_row)) // rows * rows)
    groups, first = [], 0
    for i, (_, q1) in enumerate(blocks):
        if q1 - blocks[first][0] >= group_rows or i == len(blocks) - 1:
            groups.append(SdpaGroup(blocks[first][0], q1, first, i + 1))
            first = i + 1
    return tuple(groups)


def plain_causal(relation: "Relation", blocks: list[tuple[int, int]], tk: int) -> bool:
    """Whether the relation is exactly "key j <= query i" for every batch, head and query (Tq == Tk)."""
    from attn_ledger.maths import masks

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


# --- one block's layout ----------------------------------------------------------------

def layout(relation: "Relation", allow_i: "Tensor | None", allow_p: "Tensor | None", q0: int, q1: int, tk: int,
           full_keys: bool, width_step: int = 1) -> Layout:
    """One block's layout under the intended relation ``allow_i`` and the one the pipeline applies, ``allow_p``.

    ``[lo, hi)``: every key either relation allows, plus one key every query of the block must
    not use, so a mask never applied still shows (all keys with ``full_keys``), widened to a
    multiple of ``width_step`` keys. A relation known to be exactly top-left causal, applied as
    is, gets these by arithmetic; any other is measured from its column counts. Both give the
    same numbers (tested).
    """
    if allow_i is not None and allow_p is allow_i and relation.top_left_causal and q0 < min(q1, tk):
        return causal_layout(q0, q1, tk, full_keys, width_step)
    step = 1 if full_keys else width_step
    cols_i = None if allow_i is None else column_counts(allow_i)
    cols_p = cols_i if allow_p is allow_i else (None if allow_p is None else column_counts(allow_p))
    lo, hi = (0, tk) if full_keys else hull(cols_i, cols_p, tk=tk)
    if cols_i is not None and (lo > 0 or hi < tk) and band_of(cols_i, lo, hi) == (0, 0):
        # keep one key every query of the block must not use, so a mask never applied still shows
        lo, hi = (lo, hi + 1) if hi < tk else (lo - 1, hi)
    lo, hi = widen(lo, hi, tk, step)
    band = band_of(cols_i, lo, hi)
    pipe = (0, 0) if allow_p is None else (band if allow_p is allow_i else band_of(cols_p, lo, hi))
    all_live = cols_i is None or bool(allow_i[..., lo:hi].any(dim=-1).all())
    return Layout(lo, hi, band, pipe, all_live)


def causal_layout(q0: int, q1: int, tk: int, full_keys: bool, width_step: int = 1) -> Layout:
    """:func:`layout` of rows ``q0 .. q1 - 1`` (``q0 < min(q1, Tk)``) under the top-left causal relation, by arithmetic."""
    step = 1 if full_keys else width_step
    # query i allows keys 0..i: rows q0..q1-1 use keys 0..q1-1; columns q0+1.. are the band
    lo, hi = 0, (tk if full_keys else min(q1, tk))
    if q1 - q0 == 1 and hi < tk and not full_keys:
        hi += 1  # a one-row block allows all of 0..q0: keep key q0+1, which it must not use
    lo, hi = widen(lo, hi, tk, step)  # the added keys lie right of q1: forbidden to every row
    band = (q0 + 1, hi) if q0 + 1 < hi else (0, 0)
    return Layout(lo, hi, band, band, True)


def column_counts(allow: "Tensor") -> tuple[Any, int]:
    """For each key column, how many (batch, head, query) rows of ``allow`` allow it (a numpy
    ``[Tk]`` array), and how many such rows there are. One reduction gives the block's key
    hull and its band."""
    flat = allow.reshape(-1, allow.shape[-1])  # [rows', Tk]
    return flat.sum(dim=0).cpu().numpy(), flat.shape[0]


def hull(*cols: tuple[Any, int] | None, tk: int) -> tuple[int, int]:
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


def band_of(cols: tuple[Any, int] | None, lo: int, hi: int) -> tuple[int, int]:
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


def widen(lo: int, hi: int, tk: int, step: int) -> tuple[int, int]:
    """``[lo, hi)`` grown to a multiple of ``step`` keys (to the right, else to the left), within ``[0, tk)``."""
    if step <= 1:
        return lo, hi
    width = min(tk, -(-(hi - lo) // step) * step)
    return (lo, lo + width) if lo + width <= tk else (tk - width, tk)


def key_hull(allow: "Tensor | None", tk: int) -> tuple[int, int]:
    """The smallest key range holding every key ``allow`` allows (all keys without a relation)."""
    import torch

    if allow is None:
        return 0, tk
    cols = allow.reshape(-1, allow.shape[-1]).any(dim=0)  # [Tk]
    idx = torch.nonzero(cols).flatten()
    return (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, tk)
