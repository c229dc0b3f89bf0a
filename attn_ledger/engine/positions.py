"""The ``rope`` stage: rotary positions on q and k before the scores, through the pipeline, checked.

The pipeline's ``rope`` function (the shared :mod:`attn_ledger.maths.rotary` module, never another)
turns q and k; query i sits at position ``i + Tk - Tq`` (the last query at the last key's
position), key j at j; v is not rotated. The reference rotates its own float64 q and k the same
way, from the same spec, so every later stage compares like with like.

Checks:

* L1 ``shape``: q, k and v keep their shapes;
* L2 ``rotary_positions``: what was observed on q, k and v (:func:`attn_ledger.maths.rotary.recognise_rotary`
  at their known positions, judged together by :func:`attn_ledger.maths.rotary.compare_positions`):
  q and k rotated consistently, v never;
* L2 ``relative_positions``: one query vector and one key vector repeated along the sequence,
  rotated by the pipeline: their scores depend only on the offset between positions;
* L3 ``norms_preserved``: every q and k vector keeps its length;
* L4 ``matches_reference``: rotated q, k (and v untouched) against the float64 rotation.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger.engine import checks as C
from attn_ledger import tolerance
from attn_ledger.report import Check, Note, bounded, unjudged

if TYPE_CHECKING:
    from attn_ledger.engine.rows import Rows
    from torch import Tensor

    from attn_ledger.maths.rotary import RotarySpec

RECOGNISE_POSITIONS = 64  # positions of example 0 the recognition looks at
RECOGNISE_OFFSET = 64  # offsets it searches, +-: far ones alias in half precision; the L4 comparison sees any offset
PROBE_POSITIONS = 32  # positions of the repeated-content probe


@dataclass(frozen=True)
class Rotated:
    """What the ``rope`` stage hands on: the pipeline's q, k, v, the reference's q, k, the checks and a note."""

    q: "Tensor"
    k: "Tensor"
    v: "Tensor"
    q_ref: "Tensor"
    k_ref: "Tensor"
    checks: list[Check]
    note: Note


def rope_stage(ops: Any, spec: "RotarySpec", q: "Tensor", k: "Tensor", v: "Tensor", refs: tuple["Tensor", "Tensor", "Tensor"],
               *, saved: bool = False) -> Rotated:
    """Rotate q and k through ``ops.rope`` and check the result.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k, v: ``[B, Nkv, Tk, Dh]``, ``[B, Nkv, Tk, Dv]`` (before rotation).
        refs: the reference's q, k, v (float64, same axes), rotated here the same way.
        saved: q and k came from a file (the note says the ledger rotated them).
    """
    from attn_ledger.maths.rotary import apply_rotary, spec_text

    tq, tk, dh = q.shape[2], k.shape[2], q.shape[-1]
    start = tk - tq
    qr, kr, vr = ops.rope(q, k, v, spec, start)
    q_ref = apply_rotary(refs[0], spec, offset=start)  # [B, Nh, Tq, Dh] float64
    k_ref = apply_rotary(refs[1], spec)  # [B, Nkv, Tk, Dh] float64
    checks = [_shapes(q, k, v, qr, kr, vr)]
    if checks[0].passed:
        checks += [_positions(q, k, v, qr, kr, vr, start), _relative(ops, spec, q, k, start),
                   _norms(q, k, qr, kr), _reference(qr, kr, vr, q_ref, k_ref, refs[2])]
    note = Note("rope", {"spec": spec_text(spec), "saved": saved, "rotated": spec.width(dh), "Dh": dh,
                         "pairing": spec.pairing, "base": spec.base, "start": start})
    return Rotated(qr, kr, vr, q_ref, k_ref, checks, note)


def rope_row(rows: "Rows", ops: Any, spec: "RotarySpec | None", qkv: tuple, refs: tuple, *, saved: bool) -> tuple | None:
    """The ``rope`` row when rotary positions are on: ``((q, k, v), refs)`` rotated (the reference's too), else
    them unchanged; None when the stage raised."""
    if spec is None:
        return qkv, refs
    rot = rows.run("rope", lambda: rope_stage(ops, spec, *qkv, refs, saved=saved))
    if rot is None:
        return None
    rows.stage("rope", tuple(rot.q.shape), rot.checks, rot.note)
    return (rot.q, rot.k, rot.v), (rot.q_ref, rot.k_ref, refs[2])


def _shapes(q, k, v, qr, kr, vr) -> Check:
    got = [tuple(t.shape) for t in (qr, kr, vr)]
    want = [tuple(t.shape) for t in (q, k, v)]
    if got == want:
        return C.shape_check(qr.shape, q.shape, "[B,Nh,Tq,Dh] (and k, v unchanged in shape)")
    return Check(1, "shape", "fail", reason=f"rotation changed the shapes of q, k, v: {got}, expected {want}",
                 data={"expected": [list(s) for s in want], "got": [list(s) for s in got]})


def _positions(q, k, v, qr, kr, vr, start: int) -> Check:
    """Recognised on q, k, v at their known positions (example 0, the first positions) and judged together."""
    from attn_ledger.maths.rotary import compare_positions, recognise_rotary

    n, m = min(q.shape[2], RECOGNISE_POSITIONS), min(k.shape[2], RECOGNISE_POSITIONS)
    if q.shape[0] == 0:
        return unjudged(2, "rotary_positions", "not_applicable", "B = 0: no vector to observe")
    if n == 1 and m == 1 and start == 0:
        return unjudged(2, "rotary_positions", "not_applicable", "one position, 0: a rotation there is the identity")
    obs = [recognise_rotary(x[:1, :, :t], y[:1, :, :t], positions=p, max_offset=RECOGNISE_OFFSET)
           for x, y, t, p in ((q, qr, n, start), (k, kr, m, 0), (v, vr, m, 0))]
    judged = compare_positions(*obs)
    findings = list(judged.findings)
    if obs[0].kind == "none" and obs[1].kind == "none":
        findings.append("not_rotated")
    data = {"findings": findings, "offset_between": judged.offset_between,
            **{name: o.describe() for name, o in zip("qkv", obs)}}
    if judged.status == "inconclusive" and not findings:
        return Check(2, "rotary_positions", "inconclusive", reason=judged.describe(), data=data)
    return Check(2, "rotary_positions", "fail" if findings else "pass", "findings on q, k, v", len(findings), 0, "<=",
                 reason="" if not findings else judged.describe() if judged.findings else "neither q nor k rotated",
                 data=data)


def _relative(ops: Any, spec: "RotarySpec", q: "Tensor", k: "Tensor", start: int) -> Check:
    """One query and one key vector repeated along the sequence: scores depend only on the position offset."""
    import torch

    from attn_ledger.maths.rotary import tolerance_for

    n, m = min(q.shape[2], PROBE_POSITIONS), min(k.shape[2], PROBE_POSITIONS)
    if n < 2 or m < 2 or q.shape[0] == 0:
        return unjudged(2, "relative_positions", "not_applicable", "fewer than two query or key positions")
    qp = q[:1, :1, :1].expand(1, 1, n, q.shape[-1]).contiguous()  # [1, 1, n, Dh]: one vector at every position
    kp = k[:1, :1, :1].expand(1, 1, m, k.shape[-1]).contiguous()  # [1, 1, m, Dh]
    qr, kr, _ = ops.rope(qp, kp, kp, spec, start)
    s = qr.to(torch.float64) @ kr.to(torch.float64).transpose(-2, -1)  # [1, 1, n, m]
    drift = float((s[..., 1:, 1:] - s[..., :-1, :-1]).abs().amax())  # along each diagonal i - j
    size = max(float(s.abs().amax()), 1e-300)
    return bounded(2, "relative_positions", "max |s[i+1, j+1] - s[i, j]| / max |s|, content repeated", drift / size,
                   tolerance_for(q.dtype, float(max(n, m) + abs(start))), data={"queries": n, "keys": m})


def _norms(q: "Tensor", k: "Tensor", qr: "Tensor", kr: "Tensor") -> Check:
    import torch

    from attn_ledger.maths.rotary import tolerance_for

    worst = 0.0
    for x, y in ((q, qr), (k, kr)):
        if x.numel():
            nx = x.to(torch.float64).norm(dim=-1)  # [..., T]
            worst = _worst(worst, float((y.to(torch.float64).norm(dim=-1) - nx).abs().amax()) / max(float(nx.amax()), 1e-300))
    return bounded(3, "norms_preserved", "max | |rotated| - |vector| | / max |vector|, q and k", worst,
                   tolerance_for(q.dtype, float(max(q.shape[2], k.shape[2]))))


def _reference(qr, kr, vr, q_ref, k_ref, v_ref) -> Check:
    """Rotated q, k and the untouched v against the float64 rotation, the worst of the three."""
    rtol, atol = tolerance.reference(qr.dtype)
    worst_diff, worst_excess = 0.0, -atol
    for got, want in ((qr, q_ref), (kr, k_ref), (vr, v_ref)):
        d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
        worst_diff, worst_excess = _worst(worst_diff, d), _worst(worst_excess, ex)
    return C.compare_check("matches_reference", worst_diff, worst_excess, rtol, atol, "float64 rotation")


def _worst(a: float, b: float) -> float:
    """The larger, NaN winning."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
