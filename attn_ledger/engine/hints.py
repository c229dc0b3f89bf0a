"""What to try next on saved tensors: alternatives to the declared mask and scale, each computed before it is said.

When the saved ``out`` fails ``user_out_matches_reference``, float64 attention is run again on the
same q, k, v (as they entered the scores) under cheap alternatives, one change at a time:

* another relation: none, causal (bottom-right), causal-top-left, a sliding window of each width
  up to :data:`MAX_WINDOW` (with the declared scale);
* another scale: 1, 1/sqrt(Dh), 1/Dh (with the declared relation).

An alternative becomes a :class:`~attn_ledger.report.Hint` only where the saved ``out`` agrees with
it within the very bound the finding used (the check's rtol/atol, or its limit for half precision).
The finding stands either way: a hint changes no status.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from attn_ledger.report import Check, Hint, Report

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["MAX_GRID", "MAX_WINDOW", "tensor_hints", "with_tensor_hints"]

MAX_WINDOW = 64  # sliding windows tried, widths 1..this (and below Tk)
MAX_GRID = 1 << 20  # B * Nh * Tq * Tk past which no alternative is tried (each is a float64 attention, up to 70 of them)
SCALES = (("1", lambda dh: 1.0), ("1/sqrt(Dh)", lambda dh: dh ** -0.5), ("1/Dh", lambda dh: 1.0 / dh))


def _excess(out: "Tensor", ref: "Tensor", c: Check) -> tuple[float, float]:
    """(max |out - ref|, how far past the finding's bound it is; <= 0 within it)."""
    import torch

    diff = (out.to(torch.float64) - ref).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if not math.isfinite(worst):
        return worst, math.inf
    if c.rtol is not None and c.atol is not None:
        return worst, float((diff - (c.atol + c.rtol * ref.abs())).max())
    if c.limit is not None:
        return worst, worst - float(c.limit)
    return worst, math.inf


def _relations(tq: int, tk: int, device: Any) -> Iterator[tuple[str, str, str, "Tensor | None"]]:
    """(mask text, how it reads, the option, allow ``[Tq, Tk]`` or None) for each relation tried."""
    from attn_ledger.maths import masks

    yield "none", "attention with no mask", "--mask none", None
    yield "causal", "bottom-right causal attention", "--mask causal", masks.causal(tq, tk, "bottom-right", device=device)
    if tq != tk:
        yield ("causal-top-left", "causal attention aligned top-left", "--mask causal-top-left",
               masks.causal(tq, tk, "top-left", device=device))
    for w in range(1, min(MAX_WINDOW, tk - 1) + 1):
        yield (f"sliding-window:{w}", f"a sliding window of {w} keys", f"--mask sliding-window --window {w}",
               masks.sliding_window(tq, tk, w, device=device))


def tensor_hints(c: Check, out: "Tensor", entered: tuple["Tensor", "Tensor", "Tensor"], *, declared_mask: str,
                 declared_text: str, allow: "Callable[[], Tensor | None]", scale: float, softcap: float | None,
                 temperature: float | None, plain_relation: bool) -> tuple[Hint, ...]:
    """The hints for a failing ``user_out_matches_reference`` check ``c``.

    Args:
        out: the saved out ``[B, Nh, Tq, Dv]``.
        entered: q, k, v as they entered the scores, ``[B, Nh, T, D]``.
        declared_mask: the mask as declared (``none``, ``causal``, ``sliding-window:4``); the relation tried
            under that name is left out.
        allow: gives the declared relation ``[B|1, Nh|1, Tq, Tk]`` (None: none), for the scale alternatives; called
            only where one is tried, so a report that needs no hint never builds it.
        scale: the score scale declared (``S / tau``).
        plain_relation: the declared relation is one named relation and nothing was saved beside it, so another
            relation may stand in for it.
    """
    from attn_ledger.maths.reference import reference_attention

    q, k, v = entered
    b, nh, tq, dh = q.shape
    tk = k.shape[2]
    if b * nh * tq * tk > MAX_GRID:
        return ()
    hints: list[Hint] = []

    def agrees(mask: "Tensor | None", s: float) -> tuple[bool, float]:
        ref = reference_attention(q, k, v, allow_mask=mask, scale=s, softcap=softcap)  # [B, Nh, Tq, Dv] float64
        worst, past = _excess(out, ref, c)
        return past <= 0, worst

    if plain_relation:
        for name, text, option, mask in _relations(tq, tk, q.device):
            if name == declared_mask:
                continue
            ok, worst = agrees(mask, scale)
            if ok:
                hints.append(Hint("relation", {"tensor": "out", "check": c.name, "declared": declared_mask,
                                               "declared_text": declared_text, "found": name, "found_text": text,
                                               "option": option, "value": worst}))
                break
    declared_allow: list["Tensor | None"] = []
    for name, of in SCALES:
        s = of(dh)
        if math.isclose(s, scale, rel_tol=1e-9):
            continue
        declared_allow = declared_allow or [allow()]
        ok, worst = agrees(declared_allow[0], s)
        if ok:
            option = ("leaving --scale out (the default is 1/sqrt(Dh))" if name == "1/sqrt(Dh)" and temperature is None
                      else f"--scale {s * (temperature or 1.0):.6g}")
            hints.append(Hint("scale", {"tensor": "out", "check": c.name, "declared": scale, "found": s,
                                        "found_name": name, "option": option, "value": worst}))
            break
    return tuple(hints)


def with_tensor_hints(report: Report, out: "Tensor | None", entered: "tuple | None", **declared: Any) -> Report:
    """``report`` with its hints, where its first finding is at the context and the saved out fails
    ``user_out_matches_reference`` there (the finding may be a lower-level check of the same out)."""
    f = report.first_finding
    if f is None or out is None or entered is None or f.row != "context":
        return report
    c = next((c for c in report.row("context").checks if c.name == "user_out_matches_reference" and c.failed), None)
    if c is None:  # the first finding at the context is another check, and the saved out matches as declared
        return report
    return replace(report, hints=report.hints + tensor_hints(c, out, entered, **declared))
