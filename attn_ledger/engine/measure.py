"""Measurements: typed records, and the block-level measurements that produce them.

Execution yields one record per quantity, stage and block:

* :class:`Count`: violations counted (folded by sum): ``nonfinite``, ``nan_or_posinf``,
  ``fully_blocked``, ``forbidden_kept``, ``allowed_dropped``, ``pairs``;
* :class:`Peak`: a largest value (folded by max, NaN kept): ``max_abs``, ``row_sum_err``,
  ``forbidden_max``, ``empty_row_max``, ``range_excess``;
* :class:`Agreement`: one tensor against another (folded by max): the largest |difference|
  and, where a tolerance applies, the largest excess over it (``<= 0`` is within);
* :class:`Broken`: a stage that raised or returned the wrong shape; the run stops there.

``of`` names the tensor measured: ``pipeline`` (the implementation under test), ``given``
(the user's own intermediate), ``sdpa`` (F.scaled_dot_product_attention, ``backend`` set
when one is pinned) or ``plain`` (the plain reference computed in the run's or ``dtype``'s
precision). ``against`` names the other side: ``float64``, ``sdpa`` or ``pipeline``.

Where a measurement already shows a violation, its :class:`Where` says where it is; it is
computed only then, so the healthy path pays nothing for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger.engine import checks as C

if TYPE_CHECKING:
    from torch import Tensor

EXACT_RANGE_BUDGET = 1 << 18  # entries of [B, Nh, rows, keys, Dv] for the exact value-range check
VALUE_CHUNK = 64  # key positions per precomputed (min, max) of the value rows


@dataclass(frozen=True)
class Where:
    """A grid position: example ``b``, head ``h``, query ``i`` (absolute), and key ``j`` where one applies."""

    example: int
    head: int
    query: int
    key: int | None = None

    def as_dict(self) -> dict[str, int]:
        found = {"example": self.example, "head": self.head, "query": self.query}
        return found if self.key is None else {**found, "key": self.key}


@dataclass(frozen=True)
class Measured:
    """A number (``name``) measured over the tensor ``of`` at ``stage``; ``where``: the place it points at."""

    stage: str
    name: str
    amount: float
    of: str = "pipeline"
    where: Where | None = None


class Count(Measured):
    """``n`` violations of one kind (``name``) in the tensor ``of`` at ``stage``; ``where``: the first.
    Counts add up over blocks."""

    @property
    def n(self) -> int:
        return int(self.amount)


class Peak(Measured):
    """The largest ``value`` of a quantity (``name``) over the tensor ``of`` at ``stage``; ``where``: its place.
    Peaks keep the largest over blocks (NaN wins)."""

    @property
    def value(self) -> float:
        return self.amount


@dataclass(frozen=True)
class Agreement:
    """The tensor ``of`` (pinned ``backend``, computed in ``dtype`` where given) against ``against`` at ``stage``:
    the largest |difference| and the largest excess over the tolerance (None for the factor rule; for the
    rounding rule, the worst error / bound - 1)."""

    stage: str
    of: str
    against: str
    diff: float
    excess: float | None = None
    backend: str | None = None
    dtype: str | None = None
    where: Where | None = None
    parts: dict[str, Any] | None = None  # the rounding rule's parts at the worst element (engine.rounding)

    @property
    def key(self) -> tuple[str, str, str, str | None, str | None]:
        return self.stage, self.of, self.against, self.backend, self.dtype


@dataclass(frozen=True)
class Broken:
    """A stage that raised (``raised``) or produced ``shape`` where ``expected`` was derived."""

    stage: str
    of: str = "pipeline"
    raised: BaseException | None = None
    shape: tuple[int, ...] | None = None
    expected: tuple[int, ...] | None = None


Measure = Count | Peak | Agreement | Broken


# --- where a violation is --------------------------------------------------------------

def where_in(idx: tuple[int, ...] | None, q0: int = 0, k0: int | None = 0) -> Where | None:
    """A block-local index ``(b, h, row[, column])`` as a :class:`Where` (``k0=None``: the column is not a key)."""
    if idx is None:
        return None
    key = None if k0 is None or len(idx) < 4 else k0 + idx[3]
    return Where(idx[0], idx[1], q0 + idx[2], key)


def first_index(bad: "Tensor", shape: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """The first True of ``bad`` (broadcast to ``shape`` first), in row-major order, or None."""
    import torch

    full = bad.expand(shape) if shape is not None else bad
    if full.numel() == 0:
        return None
    flat = full.reshape(-1)
    at = int(torch.argmax(flat.to(torch.uint8)))
    return unravel(at, tuple(full.shape)) if bool(flat[at]) else None


def worst_index(values: "Tensor") -> tuple[int, ...] | None:
    """Where ``values`` is largest, a NaN first."""
    import torch

    if values.numel() == 0:
        return None
    flat = values.reshape(-1)
    nan = torch.isnan(flat)
    at = int(torch.argmax(nan.to(torch.uint8))) if bool(nan.any()) else int(torch.argmax(flat))
    return unravel(at, tuple(values.shape))


def unravel(at: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(at % size)
        at //= size
    return tuple(reversed(idx))


# --- the measurements ------------------------------------------------------------------

def max_abs(t: "Tensor") -> float:
    """Largest |value| in one ``aminmax`` pass (NaN if any value is NaN), as ``checks.max_abs``."""
    import torch

    if t.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(t))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))


def excess(actual: "Tensor", expected: "Tensor", rtol: float, atol: float) -> tuple[float, float]:
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
    d = torch.sub(actual.to(torch.float64), e).abs_()  # |actual - expected|, a new tensor
    diff = float(d.amax())
    if not math.isfinite(diff):
        return C.excess_error(actual, expected, rtol, atol)
    d.sub_(e.abs(), alpha=rtol)  # |actual - expected| - rtol * |expected|
    return diff, float(d.amax()) - atol


def excess_index(actual: "Tensor", expected: "Tensor", rtol: float) -> tuple[int, ...] | None:
    """Where ``|actual - expected| - rtol * |expected|`` is largest (a NaN first); for a comparison that failed."""
    import torch

    if actual.numel() == 0 or actual.shape != expected.shape:
        return None
    a, e = actual.cpu().to(torch.float64), expected.cpu().to(torch.float64)
    d = (a - e).abs() - rtol * e.abs()
    same = (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(a) & (a == e))
    return worst_index(d.masked_fill(same, -math.inf))


def agreement(stage: str, of: str, against: str, actual: "Tensor", expected: "Tensor", rtol: float, atol: float,
              q0: int = 0, k0: int | None = 0, **kw: Any) -> Agreement:
    """``actual`` against ``expected`` as one record; the worst position located when outside the tolerance."""
    d, ex = excess(actual, expected, rtol, atol)
    where = None
    if math.isnan(ex) or ex > 0:
        where = where_in(excess_index(actual, expected, rtol), q0, k0)
    return Agreement(stage, of, against, d, ex, where=where, **kw)


def error(stage: str, of: str, actual: "Tensor", expected: "Tensor", **kw: Any) -> Agreement:
    """The largest |actual - expected|, for the half-precision factor rule (no tolerance of its own)."""
    return Agreement(stage, of, "float64", excess(actual, expected, 0, 0)[0], **kw)


def clean_allowed(m: "Tensor") -> bool:
    """Screen a region where every pair is allowed: no -inf (nothing excluded), no NaN, no +inf."""
    import torch

    if m.numel() == 0:
        return True
    lo, hi = (float(x) for x in torch.aminmax(m))
    return math.isfinite(lo) and math.isfinite(hi)


def nonfinite(stage: str, t: "Tensor", of: str = "pipeline", q0: int = 0, k0: int | None = 0,
              allow_neg_inf: bool = False) -> Count:
    """Non-finite entries of ``t`` (NaN or +inf only with ``allow_neg_inf``), located at the first."""
    import torch

    if C.all_finite(t, allow_neg_inf=allow_neg_inf):
        return Count(stage, "nan_or_posinf" if allow_neg_inf else "nonfinite", 0, of)
    bad = (torch.isnan(t) | torch.isposinf(t)) if allow_neg_inf else ~torch.isfinite(t)
    return Count(stage, "nan_or_posinf" if allow_neg_inf else "nonfinite", int(bad.sum()), of,
                 where_in(first_index(bad), q0, k0))


def scores(s: "Tensor", ai: "Tensor | None", band: tuple[int, int], headroom: float, q0: int,
           k0: int) -> tuple[list[Count | Peak], bool]:
    """Non-finite scores and the largest |score| (of allowed pairs, once it reaches ``headroom``),
    and whether every score is finite."""
    import torch

    s_lo, s_hi = (float(x) for x in torch.aminmax(s)) if s.numel() else (0.0, 0.0)  # finiteness, largest |score|
    clean = math.isfinite(s_lo) and math.isfinite(s_hi)
    count = Count("scores", "nonfinite", 0) if clean else nonfinite("scores", s, q0=q0, k0=k0)
    if math.isnan(s_lo) or math.isnan(s_hi):
        return [count, Peak("scores", "max_abs", math.nan)], False
    largest = max(abs(s_lo), abs(s_hi))
    v0, v1 = band
    if largest >= headroom and ai is not None and v1 > v0:
        # a forbidden pair never reaches exp (a padded key may hold anything): allowed pairs only
        inside = torch.where(ai[..., v0:v1], s[..., v0:v1], torch.zeros((), dtype=s.dtype, device=s.device))
        largest = max(max_abs(s[..., :v0]), max_abs(inside), max_abs(s[..., v1:]))
    return [count, Peak("scores", "max_abs", largest)], clean


def mask_counts(m: "Tensor", ai: "Tensor | None", live: "Tensor | None", empty_zero: bool, band: tuple[int, int],
                tk: int, q0: int, k0: int, outside_clean: bool = False,
                forbid: "Tensor | None" = None) -> list[Count]:
    """Masked-score counts for one block: NaN/+inf, rows with every key excluded, forbidden kept, allowed dropped.

    Outside the band ``[v0, v1)`` every pair is allowed, so there the counts are all zero
    exactly when the region holds no -inf, NaN or +inf, which one ``aminmax`` screens. The
    band (or the whole block, when a screen fails) is counted pair by pair. ``forbid``:
    ``~ai[..., v0:v1]`` when the caller already has it.
    """
    import torch

    b, nh, rows, kw = m.shape
    v0, v1 = band
    if outside_clean or (clean_allowed(m[..., :v0]) and clean_allowed(m[..., v1:])):
        a, z = v0, v1
    else:
        a, z = 0, kw
    mb = m[..., a:z]  # [B, Nh, rows, z - a]
    found = [nonfinite("masked_scores", mb, q0=q0, k0=k0 + a, allow_neg_inf=True)]
    neg = torch.isneginf(mb)  # excluded pairs
    blocked, where = 0, None
    if z - a == kw:  # else every row keeps a finite score outside the band
        dead = neg.all(dim=-1)  # [B, Nh, rows]: query rows with every key excluded
        # keys outside the block's key hull are forbidden by both relations, so they are excluded by construction
        if live is not None and empty_zero:
            dead = dead & live
        blocked = int(dead.sum())
        where = where_in(first_index(dead), q0, None) if blocked else None
    found.append(Count("masked_scores", "fully_blocked", blocked, where=where))
    if ai is not None:
        ab = ai[..., a:z]  # [B|1, Nh|1, rows, z - a]
        nab = forbid if forbid is not None and (a, z) == (v0, v1) else ~ab  # [B|1, Nh|1, rows, z - a]
        wrong = int(torch.count_nonzero(neg ^ nab))  # allowed pairs excluded + forbidden pairs kept
        dropped = int(torch.count_nonzero(neg & ab)) if wrong else 0
        kept = wrong - dropped
        found.append(Count("masked_scores", "forbidden_kept", kept,
                           where=where_in(first_index(~neg & nab, neg.shape), q0, k0 + a) if kept else None))
        found.append(Count("masked_scores", "allowed_dropped", dropped,
                           where=where_in(first_index(neg & ab, neg.shape), q0, k0 + a) if dropped else None))
    found.append(Count("masked_scores", "pairs", b * nh * rows * tk))
    return found


def weight_invariants(stage: str, of: str, w: "Tensor", ai: "Tensor | None", live: "Tensor | None",
                      empty_zero: bool, limit: float, q0: int, k0: int, band: tuple[int, int] | None = None,
                      count_nonfinite: bool = False, forbid: "Tensor | None" = None,
                      extra: "Tensor | None" = None) -> list[Count | Peak]:
    """Row sums over keys, weight on forbidden keys, and declared-empty rows, for one block.

    ``band``: key columns ``[v0, v1)`` outside which ``ai`` allows every pair; forbidden
    keys lie only inside it. ``count_nonfinite``: also count non-finite weights, cleared
    at once when every row sum is finite (a NaN or infinite weight makes its row sum so).
    ``forbid``: ``~ai[..., v0:v1]`` when the caller already has it. ``limit``: the row-sum
    tolerance, above which a value is located. ``extra``: ``[B, Nh, rows]`` what each row holds beside its
    keys (the attention sink's share), counted in its sum.
    """
    import torch

    found: list[Count | Peak] = []
    sums = w.sum(dim=-1)  # [B, Nh, rows]
    if extra is not None:
        sums = sums.to(extra.dtype) + extra  # the sink's column counted
    s_lo, s_hi = (float(x) for x in torch.aminmax(sums)) if sums.numel() else (1.0, 1.0)
    sums_finite = math.isfinite(s_lo) and math.isfinite(s_hi)
    if count_nonfinite:
        found.append(Count(stage, "nonfinite", 0, of) if sums_finite else nonfinite(stage, w, of, q0, k0))
    found.append(_row_sums(stage, of, sums, s_lo, s_hi, live, limit, q0))
    if live is not None and empty_zero and bool((~live).any()):
        empty = torch.where(~live, w.abs().amax(dim=-1), torch.zeros_like(sums))  # [B, Nh, rows]
        worst = float(empty.amax())
        found.append(Peak(stage, "empty_row_max", worst, of, where_in(worst_index(empty), q0, None) if worst > 0 else None))
    found.append(_forbidden_weight(stage, of, w, ai, sums_finite, limit, q0, k0, band, forbid))
    return found


def _row_sums(stage: str, of: str, sums: "Tensor", s_lo: float, s_hi: float, live: "Tensor | None", limit: float,
              q0: int) -> Peak:
    import torch

    if live is None:  # every row has an allowed key: the extreme row sums give the largest |sum - 1|
        err = math.nan if math.isnan(s_lo) or math.isnan(s_hi) else max(1.0 - s_lo, s_hi - 1.0, 0.0)
        errs = None
    else:
        errs = torch.where(live, (sums - 1).abs(), torch.zeros_like(sums))  # [B, Nh, rows]
        err = float(errs.amax()) if errs.numel() else 0.0
    where = None
    if math.isnan(err) or err > limit:
        errs = (sums - 1).abs() if errs is None else errs
        where = where_in(worst_index(errs), q0, None)
    return Peak(stage, "row_sum_err", err, of, where)


def _forbidden_weight(stage: str, of: str, w: "Tensor", ai: "Tensor | None", sums_finite: bool, limit: float, q0: int,
                      k0: int, band: tuple[int, int] | None, forbid: "Tensor | None") -> Peak:
    """The largest |weight| on a forbidden key (inside ``band`` when given)."""
    import torch

    v0, v1 = band if band is not None else (0, w.shape[-1])
    # a band (from plan.band_of) holds a forbidden pair by construction; without one, look
    if ai is None or v1 <= v0 or (band is None and bool(ai[..., v0:v1].all())):
        return Peak(stage, "forbidden_max", 0.0, of)
    ab = ai[..., v0:v1]  # [B|1, Nh|1, rows, v1 - v0]
    wb = w[..., v0:v1]
    if sums_finite:
        # every weight is finite (a NaN or infinite weight makes its row sum so): a weight
        # times 0 on allowed keys, times 1 on forbidden ones, is exact and leaves only the forbidden
        forb = wb * (~ab if forbid is None else forbid).to(w.dtype)
    else:
        forb = torch.where(ab, torch.zeros((), dtype=w.dtype, device=w.device), wb)
    lo, hi = (float(x) for x in torch.aminmax(forb)) if forb.numel() else (0.0, 0.0)
    value = math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)
    where = where_in(worst_index(forb.abs()), q0, k0 + v0) if math.isnan(value) or value > limit else None
    return Peak(stage, "forbidden_max", value, of, where)


def value_chunks(v: "Tensor") -> tuple["Tensor", "Tensor"] | None:
    """Per-chunk (min, max) of the value rows, ``[B, Nh, Tk // VALUE_CHUNK, Dv]`` each, for key-span ranges."""
    tk = v.shape[-2]
    n = tk // VALUE_CHUNK
    if n < 2:
        return None
    b, nh, _, dv = v.shape
    head = v[:, :, : n * VALUE_CHUNK].reshape(b, nh, n, VALUE_CHUNK, dv)
    return head.amin(dim=3), head.amax(dim=3)


def value_span(v: "Tensor", chunks: tuple["Tensor", "Tensor"] | None, lo: int, hi: int) -> tuple["Tensor", "Tensor"]:
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


def exact_range(c: "Tensor", kw: int, ai: "Tensor | None") -> bool:
    """Whether the value-range check holds each row to its own allowed keys (small blocks) or the block's."""
    b, nh, rows, dv = c.shape
    return ai is not None and b * nh * rows * kw * dv <= EXACT_RANGE_BUDGET


def sink_share_error(w: "Tensor", ref_share: "Tensor", q0: int) -> Peak:
    """The largest ``|sum over keys of w - (1 - the reference's sink share)|`` over the sampled rows ``w``
    ``[B, Nh, R, kw]`` (every key the rows may attend), ``ref_share`` ``[B, Nh, R]``."""
    import torch

    err = (w.to(ref_share.dtype).sum(dim=-1) - (1.0 - ref_share)).abs()  # [B, Nh, R]
    worst = max_abs(err) if err.numel() else 0.0
    return Peak("weights", "sink_share_err", worst, where=where_in(worst_index(err), q0, None) if worst > 0 else None)


def with_zero_value(vb: "Tensor", ai: "Tensor | None") -> tuple["Tensor", "Tensor | None", None]:
    """The value rows ``[B, Nh, kw, Dv]`` and a zero row after them, allowed to every query (an attention sink's
    value), for :func:`range_excess`; no precomputed span."""
    import torch

    vz = torch.cat([vb, vb.new_zeros(*vb.shape[:-2], 1, vb.shape[-1])], dim=-2)  # [B, Nh, kw + 1, Dv]
    if ai is None:
        return vz, None, None
    az = torch.cat([ai, ai.new_ones(*ai.shape[:-1], 1)], dim=-1)  # [B|1, Nh|1, rows, kw + 1]
    return vz, az, None


def range_excess(c: "Tensor", vb: "Tensor", ai: "Tensor | None", rtol: float, atol: float,
                 span: tuple["Tensor", "Tensor"] | None = None) -> tuple[float, tuple[int, ...] | None]:
    """How far any context coordinate lies outside the per-coordinate range of the value rows it mixes.

    Exact (per query, over its allowed keys) when small enough; otherwise per block over
    the block's key span, which is a looser bound. ``span``: that span's per-coordinate
    (min, max) ``[B, Nh, 1, Dv]`` when already known (see :func:`value_span`). Returns the
    excess and, when it is positive, the block-local ``(b, h, row, d)`` where it is largest.
    """
    import torch

    b, nh, rows, dv = c.shape
    kw = vb.shape[-2]
    if kw == 0 or c.numel() == 0:
        return 0.0, None
    if exact_range(c, kw, ai):
        wide = torch.float32 if c.device.type == "mps" else torch.float64  # float64, or float32 where the device has none
        cf = c.to(wide)
        vf = vb.to(wide)
        extremes = (vf.abs().amax(),)
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
        extremes = (hi.amax(), lo.amin())  # the largest |value| lies at an extreme
    if lo.shape[-2] == 1 < cf.shape[-2]:
        # one range per coordinate for every row: where it is finite, a rounded lo - c only falls as c grows (and
        # c - hi rises), so the largest over the rows is the one at each coordinate's least (greatest) c, exactly
        c_lo, c_hi = cf.amin(dim=-2, keepdim=True), cf.amax(dim=-2, keepdim=True)  # [B, Nh, 1, Dv] (not aminmax:
        # along a middle dim it runs several times slower than the two)
        *ends, below, above = torch.stack([*extremes, (lo - c_lo).amax(), (c_hi - hi).amax()]).tolist()
        if not all(math.isfinite(x) for x in ends):  # an infinite range: every row, as it is
            below, above = float((lo - cf).amax()), float((cf - hi).amax())
    else:
        ends = [float(x) for x in extremes]
        below, above = float((lo - cf).amax()), float((cf - hi).amax())
    tol = atol + rtol * max(abs(x) for x in ends)
    value = math.nan if math.isnan(below) or math.isnan(above) else max(below, above) - tol
    if math.isnan(value) or value > 0:
        return value, worst_index(torch.maximum(lo - cf, cf - hi))
    return value, None


def sdpa_group(context: "Tensor", sdpa_ctx: "Tensor", blocks: list[tuple[int, int]], rtol: float, atol: float,
               of: str = "pipeline") -> list[Count | Agreement]:
    """Context against SDPA for consecutive blocks: non-finite count, max |diff|, and each block's excess.

    Each block's atol is scaled by that block's largest |SDPA value|, as if compared one by one.
    The arithmetic is in float32 (float64 for float64 runs): the difference of two values
    within a factor of two of each other is exact there, and the tolerance terms carry
    rounding of about 1e-7 of their size, far below any tolerance in use.
    """
    import torch

    g0, g1 = blocks[0][0], blocks[-1][1]
    cg = context[:, :, g0:g1]  # [B, Nh, rows, Dv]
    sizes = {q1 - q0 for q0, q1 in blocks}
    if len(sizes) == 1 and cg.numel():
        r = sizes.pop()
        wide = torch.float64 if cg.dtype == torch.float64 else torch.float32
        sd = sdpa_ctx[:, :, g0:g1].to(wide)
        d = torch.sub(cg.to(wide), sd).abs_()  # [B, Nh, rows, Dv]
        diff = float(d.amax())
        if math.isfinite(diff):  # then the context is finite too: a NaN or infinity in it makes some |diff| so
            b, nh, _, dv = sd.shape
            e = sd.abs()  # [B, Nh, rows, Dv]
            per = (b, nh, len(blocks), r, dv)
            scale = e.view(per).amax(dim=(0, 1, 3, 4)).clamp_(min=1.0)  # [blocks]: max(1, max |SDPA|)
            ex = float((d.sub_(e, alpha=rtol).view(per).amax(dim=(0, 1, 3, 4)) - atol * scale).amax())  # over blocks
            where = where_in(excess_index(cg, sdpa_ctx[:, :, g0:g1], rtol), g0, None) if ex > 0 else None
            return [Count("context", "nonfinite", 0, of), Agreement("context", of, "sdpa", diff, ex, where=where)]
    found: list[Count | Agreement] = [nonfinite("context", cg, of, g0, None)]
    for q0, q1 in blocks:
        sd = sdpa_ctx[:, :, q0:q1]
        found.append(agreement("context", of, "sdpa", context[:, :, q0:q1], sd, rtol, atol * max(1.0, C.max_abs(sd)),
                               q0, None))
    return found
