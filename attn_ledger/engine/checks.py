"""Small check functions: each measures one invariant and returns a :class:`Check`.

Measurements that run over query blocks come in two parts: a ``measure_*`` function
applied to one block, whose results are folded with ``max`` or ``+`` across blocks,
and a judge that turns the folded number into a :class:`Check`. Keeping the two apart
lets the same judgement serve a single-block run and a streamed one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from attn_ledger.errors import first_line
from attn_ledger.report import Check, bounded, counted
from attn_ledger.tolerance import HALF_FACTOR

if TYPE_CHECKING:
    import torch
    from torch import Tensor


# --- block measurements ---------------------------------------------------------------

def max_abs(t: "Tensor") -> float:
    if t.numel() == 0:
        return 0.0
    return float(t.abs().amax())


def nonfinite_count(t: "Tensor", allow_neg_inf: bool = False) -> int:
    """Number of NaN/inf entries (or NaN/+inf only, where -inf marks an excluded key)."""
    import torch

    if t.numel() == 0:
        return 0
    if allow_neg_inf:
        return int((torch.isnan(t) | torch.isposinf(t)).sum())
    return int((~torch.isfinite(t)).sum())


def all_finite(t: "Tensor", allow_neg_inf: bool = False) -> bool:
    """One pass: the max (and min) propagate NaN and reveal infinities."""
    import torch

    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    lo, hi = float(lo), float(hi)
    if math.isnan(lo) or math.isnan(hi) or hi == math.inf:
        return False
    return allow_neg_inf or lo != -math.inf


def excess_error(actual: "Tensor", expected: "Tensor", rtol: float, atol: float) -> tuple[float, float]:
    """(max |actual - expected|, max of |diff| - rtol*|expected| - atol); the second <= 0 means within tolerance.

    NaN anywhere in either operand (where the other is not NaN too) gives NaN.
    """
    import torch

    if actual.numel() == 0:
        return 0.0, -atol
    a = actual.to(torch.float64)
    e = expected.to(torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & (a == e)
    diff = (a - e).abs()
    diff = diff.masked_fill(both_nan | same_inf, 0.0)
    excess = diff - rtol * e.abs().masked_fill(torch.isinf(e), 0.0) - atol
    excess = excess.masked_fill(both_nan | same_inf, -atol)
    return float(diff.amax()), float(excess.amax())


# --- judgements -------------------------------------------------------------------

def shape_check(actual: Sequence[int] | None, expected: Sequence[int], axes: str, name: str = "shape") -> Check:
    """L1: the tensor has the derived dimensions."""
    ok = actual is not None and tuple(actual) == tuple(expected)
    got = None if actual is None else list(actual)
    return Check(1, name, "pass" if ok else "fail", reason=f"{axes} derived {list(expected)}, got {got or 'nothing'}",
                 data={"expected": list(expected), "got": got, "axes": axes})


def raised_check(exc: BaseException) -> Check:
    """L1: the stage raised instead of producing its tensor."""
    text = first_line(exc, "")
    return Check(1, "computes", "fail", reason=f"raised {type(exc).__name__}: {text}",
                 data={"exception": type(exc).__name__, "message": text})


def finite_check(nonfinite: int, what: str = "values", allow_neg_inf: bool = False) -> Check:
    """L3: every value finite (or, after masking, no NaN and no +inf)."""
    kind = "NaN or +inf" if allow_neg_inf else "non-finite"
    return counted(3, "finite", f"{kind} {what}", nonfinite)


def count_check(level: int, name: str, count: int, what: str) -> Check:
    """A check that passes when a counted violation never occurs."""
    return counted(level, name, what, count)


def bound_check(level: int, name: str, value: float, limit: float, what: str) -> Check:
    """Passes when a measured non-negative error is at most ``limit`` (NaN fails)."""
    return bounded(level, name, what, value, limit)


def roundtrip_check(original: "Tensor", roundtrip: "Tensor") -> Check:
    """L2: merge(split(x)) == x, compared by value on a deterministic tensor."""
    if tuple(original.shape) != tuple(roundtrip.shape):
        return Check(2, "roundtrip_exact", "fail", reason="merge(split(x)) changed the shape",
                     data={"expected": list(original.shape), "got": list(roundtrip.shape)})
    wrong = int((original != roundtrip).sum())
    return counted(2, "roundtrip_exact", "values moved by merge(split(x)) on an arange tensor", wrong,
                   data={"of": original.numel()})


def head_slices_check(name: str, split: "Tensor", source: "Tensor", n_heads: int, direction: str) -> Check:
    """L2: head h holds features h*D..(h+1)*D of every position, by value.

    Args:
        split: ``[B, Nh, T, D]``; source: ``[B, T, Nh*D]``.
        direction: words for the detail, e.g. "split" or "merge".
    """
    b, t, e = source.shape
    if tuple(split.shape) != (b, n_heads, t, e // n_heads):
        return Check(2, name, "fail", reason=f"{direction}: the shape cannot hold {n_heads} heads of the source",
                     data={"got": list(split.shape), "source": list(source.shape)})
    expected = source.reshape(b, t, n_heads, e // n_heads).permute(0, 2, 1, 3)  # [B, Nh, T, D] by construction
    wrong_mask = split != expected
    wrong = int(wrong_mask.sum())
    bad_heads = sorted({int(h) for h in wrong_mask.nonzero()[:, 1].tolist()}) if wrong else []
    return counted(2, name, f"{direction}: values from another head's slice or position", wrong,
                   data={"heads": bad_heads})


def kv_pairing_check(expand, n_heads: int, n_kv: int) -> Check:
    """L2: with kv heads labelled by their index, query head h receives kv head h // (Nh // Nkv)."""
    import torch

    probe = torch.arange(n_kv, dtype=torch.float64).reshape(1, n_kv, 1, 1).expand(1, n_kv, 2, 2)  # [1, Nkv, 2, 2]
    try:
        got = expand(probe, n_heads)  # [1, Nh, 2, 2]
    except Exception as exc:  # a broken expansion is a finding, not a crash
        return Check(2, "kv_head_pairing", "fail", reason=f"expansion raised {type(exc).__name__}: {exc}")
    group = n_heads // n_kv
    want = [h // group for h in range(n_heads)]
    if tuple(got.shape) != (1, n_heads, 2, 2):
        return Check(2, "kv_head_pairing", "fail", reason="the expansion has the wrong shape",
                     data={"got": list(got.shape), "expected": [1, n_heads, 2, 2]})
    have = [int(got[0, h, 0, 0]) for h in range(n_heads)]
    wrong = sum(a != b for a, b in zip(have, want))
    return counted(2, "kv_head_pairing", "query heads reading another kv head", wrong,
                   data={"read": have, "expected": want})


def compare_check(name: str, diff: float, excess: float, rtol: float, atol: float, against: str) -> Check:
    """L4: agreement with a reference within a dtype's tolerance (|diff| <= atol + rtol * |ref|)."""
    ok = not math.isnan(excess) and excess <= 0
    return Check(4, name, "pass" if ok else "fail", f"max |diff| vs {against}", diff, rtol=rtol, atol=atol,
                 data={"excess": excess})


def factor_check(name: str, err_impl: float, err_plain: float, floor: float, against: str, factor: float = HALF_FACTOR) -> Check:
    """L4 for half precision: the error against float64 is within ``factor`` of a plain same-dtype computation's."""
    base = max(err_plain, floor)
    ratio = err_impl / base if base > 0 else math.inf
    return bounded(4, name, f"max err vs {against}", err_impl, factor * base,
                   data={"plain_err": err_plain, "floor": floor, "factor": ratio, "factor_limit": factor})
