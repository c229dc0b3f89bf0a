"""One observed attention call judged against what the config implies, from raw tensors only.

The checks of a call, in the order a reader meets them (the first failing one at the lowest level is
the call's finding):

* L1 ``observed``: q ``[B, Nh, Tq, Dh]``, k ``[B, Nkv, Tk, Dh]``, v ``[B, Nkv, Tk, Dv]`` were seen, Nkv
  dividing Nh, and the call returned a tensor; ``layout``: the context is ``[B, Tq, Nh, Dv]`` as the
  attention interface returns it (``[B, Nh, Tq, Dv]`` where the observer read it from the core);
* L3 ``finite`` (every query row, padded ones included: a row nobody reads must still not be NaN),
  and where the call returned its weights ``weights_sum`` (each real query's weights sum to one, or
  to one less the sink's share) and ``forbidden_weight`` (no weight on a key the relation forbids);
* L4 ``rotary`` (q and k after rotary against the projections rotated by the family's convention),
  ``scale`` (the ``scaling`` the call got against the config's), ``relation`` (the mask the call got
  against the relation: causal, the layer's window, bidirectional, the padding), ``softcap`` and
  ``sinks`` (what the call got against the config), and ``reference``: the context against float64
  attention on the observed q, k, v under the implied relation, scale, soft-cap, bias and sinks,
  element by element within the rounding rule ``c * eps * M`` (:mod:`attn_ledger.probes.model.reference`).
  Where it fails, the variants a bug would compute (kv heads tiled, the scaling ignored, a window one
  wider, the mask's polarity flipped, the soft-cap or sinks dropped, padding ignored, the batch read as one
  sequence, the call's own mask) are computed too, and the one that matches is the diagnosis, carried to the call's finding.

Padded query rows (queries whose own token is padding: fully padded ones, and under right padding
those that still see keys) are read by nobody, so they are judged only as finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger import tolerance
from attn_ledger.probes.model.expect import Expected
from attn_ledger.probes.model.reference import attend64
from attn_ledger.report import Check, bounded, carry_diagnosis, counted, unjudged

if TYPE_CHECKING:
    from torch import Tensor

CHECK_ORDER = ((1, "observed"), (1, "layout"), (3, "finite"), (3, "weights_sum"), (3, "forbidden_weight"),
               (4, "rotary"), (4, "scale"), (4, "relation"), (4, "softcap"), (4, "sinks"), (4, "reference"))
_POSITION = {name: i for i, (_, name) in enumerate(CHECK_ORDER)}

JOINED_MOST = 2048
"""The batch-as-one-sequence variant is tried while ``B * T`` is at most this (its mask is ``(B*T)^2``)."""

REFERENCE_BUDGET = 1 << 20
"""A call's float64 reference covers every query row while ``B * Nh * Tq * Tk`` is at most this; above it,
evenly spaced rows (first and last included) up to this many grid elements."""


@dataclass
class Call:
    """One call as seen: its facts (plain data from the capture) and tensors.

    ``context`` is ``[B, Nh, Tq, Dv]`` whatever layout it came in, once ``layout`` passed.
    """

    facts: Mapping[str, Any]
    q: "Tensor | None" = None
    k: "Tensor | None" = None
    v: "Tensor | None" = None
    returned: "Tensor | None" = None
    context: "Tensor | None" = None
    weights: "Tensor | None" = None
    mask: "Tensor | None" = None
    bias: "Tensor | None" = None
    sinks: "Tensor | None" = None
    q_pre: "Tensor | None" = None
    k_pre: "Tensor | None" = None


@dataclass(frozen=True)
class Sides:
    """What the judge knows of the forward's inputs: real tokens per side (``[B, T]`` bool, ``input`` and
    ``decoder``), the decoder's position ids (``[B, T]``, or None) and, for documents packed into one row, each
    token's document (``[B, T]``, or None: a key of another document is forbidden)."""

    valid: Mapping[str, "Tensor"]
    positions: "Tensor | None" = None
    documents: "Tensor | None" = None

    def up_to(self, end: int) -> "Sides":
        """What a decode step's call sees: the tokens before ``end``."""
        def cut(t: "Tensor | None") -> "Tensor | None":
            return None if t is None else t[:, :end]

        return Sides({k: v[:, :end] for k, v in self.valid.items()}, cut(self.positions), cut(self.documents))


@dataclass
class Verdict:
    """A judged call: its checks in :data:`CHECK_ORDER`, and what the report and the stage ledger reuse."""

    checks: tuple[Check, ...]
    allow: "Tensor | None" = None  # [B, 1, Tq, Tk] the relation the config implies
    real: "Tensor | None" = None  # [B, Tq] query rows that are judged beyond finiteness
    scale: float | None = None
    softcap: float | None = None
    sampled: dict[str, Any] = field(default_factory=dict)
    example: int = 0  # the example of the reference's worst element (or 0)

    @property
    def failed(self) -> bool:
        return any(c.failed for c in self.checks)

    def first_failure(self) -> Check | None:
        failing = [c for c in self.checks if c.failed]
        return min(failing, key=lambda c: (c.level, _POSITION.get(c.name, 99))) if failing else None


def _rest(after: str, why: str) -> list[Check]:
    i = _POSITION[after] + 1
    return [unjudged(level, name, "not_reached", why) for level, name in CHECK_ORDER[i:]]


def _first(mask: "Tensor", names: tuple[str, ...] = ("example", "head", "query", "key")) -> dict[str, int] | None:
    import torch

    idx = torch.nonzero(mask)
    return None if idx.numel() == 0 else dict(zip(names, (int(x) for x in idx[0])))


# --- L1: what was seen ----------------------------------------------------------------------------


def _observed(call: Call) -> Check | None:
    """The L1 failure where q, k, v or the output cannot be read as attention; None where they can."""
    f = call.facts
    if call.q is None or call.k is None or call.v is None:
        seen = f.get("observed") or {}
        why = seen.get("failure") or (("no attention core was seen; calls it did not follow: "
                                       + ", ".join(seen.get("unexplained", []))) if seen.get("unexplained")
                                      else "no attention core was seen in its forward")
        return Check(1, "observed", "skipped", reason=why, data={"observed": False})
    q, k, v = call.q, call.k, call.v
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] \
            or q.shape[-1] != k.shape[-1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return Check(1, "observed", "fail", reason=f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} cannot "
                     "be read as [B, Nh, Tq, Dh], [B, Nkv, Tk, Dh], [B, Nkv, Tk, Dv] with Nkv dividing Nh")
    if call.returned is None:
        what = (f.get("returned") or {}).get("output") or {"type": "nothing"}
        return Check(1, "observed", "fail", reason=f"the call returned {what.get('type')}, expected a tensor "
                     "[B, Tq, Nh, Dv]", data={"returned": what})
    return None


def _layout(call: Call) -> Check:
    b, nh, tq, _ = call.q.shape
    dv = call.v.shape[-1]
    out = call.returned
    bthd = call.facts.get("context_layout", "bthd") == "bthd"
    want = [b, tq, nh, dv] if bthd else [b, nh, tq, dv]
    got = list(out.shape)
    if got == want:
        call.context = out.transpose(1, 2) if bthd else out  # [B, Nh, Tq, Dv]
        return Check(1, "layout", "pass", data={"expected": want})
    heads_first = bthd and got == [b, nh, tq, dv]
    why = (f"returned {got}, which is [B, Nh, Tq, Dv]: the output must be transposed back to [B, Tq, Nh, Dv] = "
           f"{want} (attn_output.transpose(1, 2))" if heads_first else f"returned {got}, expected {want}")
    return Check(1, "layout", "fail", reason=why, data={"expected": want, "got": got, "heads_first": heads_first})


# --- relations ------------------------------------------------------------------------------------


def expected_allow(exp: Expected, valid_k: "Tensor", tq: int, tk: int, documents: "Tensor | None" = None) -> "Tensor":
    """``[B, 1, Tq, Tk]`` bool: the relation the config implies (bottom-right causal, the window, real keys, and
    where ``documents`` ``[B, Tk]`` are given, keys of the query's own document only)."""
    import torch

    if documents is not None:
        same = documents[:, tk - tq:, None] == documents[:, None, :]  # [B, Tq, Tk]
        return expected_allow(exp, valid_k, tq, tk) & same[:, None]

    i = torch.arange(tq)[:, None] + (tk - tq)  # [Tq, 1] each query's position among the keys
    j = torch.arange(tk)[None, :]  # [1, Tk]
    rel = torch.ones(tq, tk, dtype=torch.bool)
    if exp.relation == "causal":
        rel = j <= i
        if exp.window is not None:
            rel = rel & (j > i - exp.window)
    return rel[None, None] & valid_k[:, None, None, :]  # [B, 1, Tq, Tk]


def observed_allow(call: Call, tq: int, tk: int) -> tuple["Tensor", "Tensor | None", str]:
    """What the call's own mask allows, ``[B, 1 or Nh, Tq, Tk]``, the additive values it carries on allowed
    keys (an ALiBi-like bias inside the mask, else None), and the mask in words."""
    import torch

    b = call.q.shape[0]
    m = call.mask
    f = call.facts
    if m is None and f.get("via") == "observer" and call.weights is not None and call.weights.shape[-2:] == (tq, tk):
        # a core the observer read, whose mask it could not see (a buffer filled in): its weights show the relation
        return (call.weights > 0).any(dim=1, keepdim=True), None, "the relation its weights show (no mask seen)"
    if m is None:
        kw, mod = f.get("kwargs") or {}, f.get("module") or {}
        eager = f.get("via") == "eager default" or f.get("implementation") == "eager"
        default = False if f.get("via") == "observer" else mod.get("is_causal", True)  # SDPA's own default, or the layer's
        causal = not eager and bool(kw.get("is_causal", default))
        window = kw.get("sliding_window") if causal and isinstance(kw.get("sliding_window"), int) else None
        i = torch.arange(tq)[:, None] + (tk - tq)
        j = torch.arange(tk)[None, :]
        rel = (j <= i) if causal else torch.ones(tq, tk, dtype=torch.bool)
        if window is not None:
            rel = rel & (j > i - window)
        said = "no mask (None)" + (", is_causal" if causal else "") + (f", sliding_window={window}" if window else "")
        return rel[None, None].expand(b, 1, tq, tk), None, said
    m = m.reshape(*([1] * (4 - m.dim())), *m.shape) if m.dim() < 4 else m
    m = m[..., -tq:, -tk:] if m.shape[-2] >= tq and m.shape[-1] >= tk else m
    if m.dtype == torch.bool:
        return m.expand(b, -1, tq, tk), None, f"bool mask {list(call.mask.shape)}"
    floor = torch.finfo(m.dtype).min / 2 if m.is_floating_point() else -1e30
    allow = m > floor
    extra = torch.where(allow, m, torch.zeros((), dtype=m.dtype))
    carried = extra if bool((extra != 0).any()) else None
    return allow.expand(b, -1, tq, tk), carried, f"additive mask {list(call.mask.shape)}"


def _relation_check(call: Call, exp: Expected, allow: "Tensor", seen: "Tensor", seen_text: str,
                    real: "Tensor", valid_k: "Tensor", packed: bool = False) -> Check:
    """L4 ``relation``: pairs (real queries only) where the call's mask and the implied relation disagree."""
    if not exp.judged:
        return unjudged(4, "relation", "not_applicable", f"the relation is not declared; the call's mask: {seen_text}")
    rows = real[:, None, :, None]  # [B, 1, Tq, 1]
    leak = seen & ~allow & rows  # [B, H, Tq, Tk]
    drop = ~seen & allow & rows
    n_leak, n_drop = int(leak.sum()), int(drop.sum())
    data: dict[str, Any] = {"mask": seen_text, "leaked": n_leak, "dropped": n_drop}
    if n_leak + n_drop == 0:
        return counted(4, "relation", "query-key pairs where the call's mask and the relation disagree", 0, data=data)
    padded = int((leak & ~valid_k[:, None, None, :]).sum())
    parts = []
    if call.mask is None and padded:
        parts.append(f"no mask reached the call, so padding never did: {padded} padded keys attended")
    elif padded:
        parts.append(f"it lets {padded} padded keys through")
    if n_leak - padded:
        parts.append(f"it allows {n_leak - padded} pairs the {_relation_words(exp, packed)} forbids")
    if n_drop:
        parts.append(f"it blocks {n_drop} pairs the {_relation_words(exp, packed)} allows")
    data.update(padded_leaked=padded, disagreement="; ".join(parts))
    return counted(4, "relation", "query-key pairs where the call's mask and the relation disagree", n_leak + n_drop,
                   location=_first(leak | drop), reason=f"mask seen: {seen_text}; " + "; ".join(parts), data=data)


def _relation_words(exp: Expected, packed: bool = False) -> str:
    words = f"causal window of {exp.window}" if exp.relation == "causal" and exp.window is not None else exp.relation
    return f"{words} relation within each packed document" if packed else words


# --- L3 ----------------------------------------------------------------------------------------------


def _finite_check(call: Call, bad: "Tensor") -> Check:
    """L3 ``finite`` on ``bad`` ``[B, Nh, Tq]`` (rows with NaN or inf in the context); where a bad row's own mask
    forbids every key with ``-inf``, that is the diagnosis: its softmax is ``0 / 0``."""
    import torch

    check = counted(3, "finite", "query rows (padded ones included) with NaN or inf in the context", int(bad.sum()),
                    location=_first(bad, ("example", "head", "query")))
    m = call.mask
    if check.passed or m is None or not m.is_floating_point():
        return check
    b, nh, tq = bad.shape
    m = m.reshape(*([1] * (4 - m.dim())), *m.shape) if m.dim() < 4 else m
    if m.shape[-2] < tq or m.shape[0] not in (1, b) or m.shape[1] not in (1, nh):
        return check
    dead = torch.isneginf(m[..., -tq:, :]).all(dim=-1)  # [B or 1, Nh or 1, Tq]
    hit = bad & dead
    if not bool(hit.any()):
        return check
    diagnosis = ("a mask that forbids every key of a query row with -inf: the softmax of such a row is 0 / 0 (NaN), "
                 "where a mask of the dtype's lowest finite value leaves it finite")
    return replace(check, reason=f"the context matches {diagnosis}", location=_first(hit, ("example", "head", "query")),
                   data={**check.data, "diagnosis": diagnosis, "stage": "masked_scores"})


# --- L3 on the weights, where the call returned them -------------------------------------------------


def _weights_checks(call: Call, allow: "Tensor", real: "Tensor", dtype: str) -> list[Check]:
    import torch

    w = call.weights
    b, nh, tq, _ = call.q.shape
    tk = call.k.shape[-2]
    if w is None:
        why = "the call returned no weights" if call.facts.get("via") != "observer" else "the core's weights were not read"
        return [unjudged(3, "weights_sum", "not_applicable", why), unjudged(3, "forbidden_weight", "not_applicable", why)]
    if list(w.shape) != [b, nh, tq, tk]:
        why = f"weights {list(w.shape)}, expected [B, Nh, Tq, Tk] = {[b, nh, tq, tk]}"
        return [Check(3, "weights_sum", "fail", reason=why), unjudged(3, "forbidden_weight", "not_reached", why)]
    limit = tolerance.row_sum(dtype)
    live = real[:, None, :] & allow.any(dim=-1)  # [B, 1->Nh, Tq]
    wd = w.detach().double()
    sums = wd.sum(dim=-1)  # [B, Nh, Tq]
    checks = []
    if call.sinks is None:
        err = (sums - 1.0).abs().nan_to_num(nan=math.inf).masked_fill(~live.expand_as(sums), 0.0)
        worst = float(err.max()) if err.numel() else 0.0
        checks.append(bounded(3, "weights_sum", "max |row sum of the weights - 1| over real queries", worst, limit,
                              location=_first(err > limit) if worst > limit else None))
    else:
        over = (sums - 1.0).clamp_min(0.0).nan_to_num(nan=math.inf).masked_fill(~live.expand_as(sums), 0.0)
        worst = float(over.max()) if over.numel() else 0.0
        checks.append(bounded(3, "weights_sum", "max row sum of the weights over 1 (sinks take a share)", worst, limit,
                              location=_first(over > limit) if worst > limit else None,
                              data={"sinks": True, "note": "the share the sinks take is judged by the reference"}))
    forbidden = torch.where(~allow & real[:, None, :, None], wd.abs(), 0.0).nan_to_num(nan=math.inf)
    peak = float(forbidden.max()) if forbidden.numel() else 0.0
    checks.append(bounded(3, "forbidden_weight", "largest weight on a key the relation forbids (real queries)", peak,
                          limit, location=_first(forbidden > limit) if peak > limit else None))
    return checks


# --- L4: rotary, scale, soft-cap, sinks ---------------------------------------------------------------


def _rotary_check(call: Call, exp: Expected, positions: "Tensor | None") -> Check:
    if exp.rotary is None:
        return unjudged(4, "rotary", "not_applicable", exp.rotary_note or "no rotary positions are implied")
    if call.q_pre is None or call.k_pre is None:
        return unjudged(4, "rotary", "skipped", "the q and k projections were not seen (no q_proj/k_proj)")
    from attn_ledger.maths.rotary import RotarySpec, apply_rotary, tolerance_for

    spec = RotarySpec(exp.rotary["pairing"], exp.rotary["base"], exp.rotary["rotated_dim"])
    tq = call.q.shape[-2]
    pos = positions[:, None, -tq:] if positions is not None and positions.shape[-1] >= tq else None
    tol = tolerance_for(call.q.dtype, float(pos.abs().max()) if pos is not None else float(tq))
    err = _rotation_errors(call, spec, pos)
    data: dict[str, Any] = {"expected": {"pairing": spec.pairing, "base": spec.base, "rotated_dim": spec.rotated_dim}}
    check = bounded(4, "rotary", "max |q, k after rotary - projections rotated as the family does| / max |projection|",
                    err, tol, data=data)
    if check.passed:
        return check
    diagnosis = _rotary_diagnosis(call, spec, pos, tol)
    if diagnosis:
        data.update(diagnosis=diagnosis, stage="input")  # q and k reach the stages already rotated wrong
        check = replace(check, reason=f"q and k match {diagnosis}", data=data)
    return check


def _rotation_errors(call: Call, spec: Any, pos: "Tensor | None", tiled: bool = False) -> float:
    """The worse of q's and k's rotation error; a decode step's k holds the cache too, and only its last rows (the
    new tokens, which the projections made) are compared."""
    k, k_pre = call.k, call.k_pre
    if k_pre is not None and k.dim() == 4 and k_pre.dim() == 4 and k.shape[-2] > k_pre.shape[-2]:
        k = k[..., -k_pre.shape[-2]:, :]
    if k_pre is not None and k.dim() == 4 and k_pre.dim() == 4 and k.shape[1] > k_pre.shape[1]:
        k_pre = _paired(k_pre, k.shape[1], tiled)  # kv heads paired before the call: as the family pairs them
    return max(_rotation_error(call.q_pre, call.q, spec, pos), _rotation_error(k_pre, k, spec, pos))


def _paired(k: "Tensor", heads: int, tiled: bool) -> "Tensor":
    """``[B, Nkv, T, D] -> [B, heads, T, D]``: each query head's kv head, repeated per group (``repeat_kv``) or,
    ``tiled``, the kv heads tiled (``repeat``)."""
    groups = heads // k.shape[1]
    return k.repeat(1, groups, 1, 1) if tiled else k.repeat_interleave(groups, dim=1)


def _rotation_error(pre: "Tensor", post: "Tensor", spec: Any, pos: "Tensor | None") -> float:
    from attn_ledger.maths.rotary import apply_rotary

    if pre.shape != post.shape:
        return math.inf
    want = apply_rotary(pre.double(), spec, positions=pos) if pos is not None else apply_rotary(pre.double(), spec)
    scale = float(pre.double().abs().max()) or 1.0
    return float((post.double() - want).abs().max()) / scale


SHIFTS = (1, -1, 2, -2)
"""Position offsets the rotary diagnosis tries: a loop that counts a token twice, or one too few."""


def _rotary_diagnosis(call: Call, spec: Any, pos: "Tensor | None", tol: float) -> str:
    from dataclasses import replace as swap

    other = "interleaved" if spec.pairing == "half" else "half"
    names = {"half": "half-split pairs (rotate_half)", "interleaved": "adjacent pairs (rotate-every-two, GPT-J)"}
    if _rotation_errors(call, swap(spec, pairing=other), pos) <= tol:
        return f"rotary over {names[other]}, where the family's convention is {names[spec.pairing]}"
    if call.k_pre is not None and call.k.shape[1] > call.k_pre.shape[1] and _rotation_errors(call, spec, pos, True) <= tol:
        return ("kv heads tiled (repeat) before the call, instead of repeated per group (repeat_kv): query head h reads "
                f"kv head h % {call.k_pre.shape[1]}")
    if float((call.q.double() - call.q_pre.double()).abs().max()) <= tol * float(call.q_pre.double().abs().max()):
        return "no rotation at all"
    if pos is not None:
        for shift in SHIFTS:
            if _rotation_errors(call, spec, pos + shift) <= tol:
                at = int(pos[0].flatten()[-1])
                return (f"rotary positions {abs(shift)} {'ahead' if shift > 0 else 'behind'}: q and k rotated as "
                        f"position {at + shift} where the token is at {at} (example 0's last query)")
    return ""


def _scale_check(call: Call, exp: Expected, width: int) -> Check:
    got = (call.facts.get("kwargs") or {}).get("scaling")
    want = exp.scale if exp.scale is not None else width ** -0.5
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return unjudged(4, "scale", "not_applicable", "the call was given no scaling; the reference applies "
                        f"{want:.6g} ({exp.scale_source or 'the head width'})")
    if exp.scale is None:
        return unjudged(4, "scale", "not_applicable", f"no scale declared; the call's scaling={got:.6g} is used")
    rel = abs(got - want) / abs(want)
    return bounded(4, "scale", "relative difference of the call's scaling from the config's", rel, 1e-6,
                   reason="" if rel <= 1e-6 else f"the call was given scaling={got:.6g}, the config implies "
                   f"{want:.6g} ({exp.scale_source})", data={"scaling": got, "expected": want, "source": exp.scale_source})


def _softcap_check(call: Call, exp: Expected) -> Check:
    kw = call.facts.get("kwargs") or {}
    got = kw.get("softcap")
    if exp.softcap is None and got is None:
        return unjudged(4, "softcap", "not_applicable", "the config has no soft-cap and the call got none")
    if "softcap" not in kw and call.facts.get("via") == "observer":
        return unjudged(4, "softcap", "not_applicable", "seen by the observer: the reference judges the cap")
    ok = got is not None and exp.softcap is not None and abs(float(got) - exp.softcap) <= 1e-9 * exp.softcap
    return Check(4, "softcap", "pass" if ok else "fail", data={"softcap": got, "expected": exp.softcap},
                 reason="" if ok else f"the call was given softcap={got}, the config implies {exp.softcap}")


def _sinks_check(call: Call, exp: Expected) -> Check:
    if not exp.sinks:
        return unjudged(4, "sinks", "not_applicable", "no attention sinks are implied")
    given = call.facts.get("sinks_from") == "s_aux"
    reason = "" if given else ("the call was not given s_aux; the module's sinks go to the reference"
                               if call.sinks is not None else "the call was given no sinks (s_aux) and the module has none")
    return Check(4, "sinks", "pass" if given else "fail", reason=reason, data={"from": call.facts.get("sinks_from")})


# --- L4: the reference --------------------------------------------------------------------------------


def sample_rows(b: int, nh: int, tq: int, tk: int, budget: int = REFERENCE_BUDGET) -> "Tensor | None":
    """The query rows the reference covers: None (all) within ``budget`` grid elements, else evenly spaced rows."""
    import torch

    if b * nh * tq * tk <= budget:
        return None
    n = max(2, budget // max(1, b * nh * tk))
    return torch.linspace(0, tq - 1, min(n, tq)).round().long().unique()


@dataclass(frozen=True)
class _Setting:
    """What the reference computes: the implied one, or a bug's variant."""

    allow: "Tensor"
    scale: float
    softcap: float | None
    bias: "Tensor | None"
    sinks: "Tensor | None"
    tiled: bool = False
    joined: bool = False  # the batch's examples laid end to end as one sequence (``allow`` is over it)


def _joined(call: Call) -> Call:
    """The call with its examples laid end to end: q, k, v and the context as ``[1, H, B*T, D]``."""
    def flat(x: "Tensor") -> "Tensor":  # [B, H, T, D] -> [1, H, B*T, D], example after example
        return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], x.shape[3])

    return replace(call, q=flat(call.q), k=flat(call.k), v=flat(call.v), context=flat(call.context))


def _agreement(call: Call, s: _Setting, rows: "Tensor | None", judged: "Tensor", dtype: str
               ) -> tuple[float, float, Any, float]:
    """``(max |diff|, worst error / bound, where, live)`` of the context against float64 under ``s`` on ``rows``, over
    the judged rows ``s`` leaves a key (``live``: their share of the judged rows; a row with none is left out)."""
    import torch

    from attn_ledger.engine.rounding import accumulation

    if s.joined:
        if rows is not None:  # sampled rows of a joined batch: not worth the bookkeeping; it explains nothing
            return math.inf, math.inf, None, 0.0
        call, judged = _joined(call), judged.reshape(1, -1)  # [1, B*Tq]
    att = attend64(call.q, call.k, call.v, s.allow, s.scale, rows=rows, softcap=s.softcap, bias=s.bias, sinks=s.sinks,
                   tiled=s.tiled, accumulate=accumulation(dtype) if dtype in tolerance.EPS else 1.0,
                   tiny=tolerance.tiny(dtype))
    ctx = call.context if rows is None else call.context[:, :, rows]  # [B, Nh, R, Dv]
    c, eps = tolerance.rounding("out", dtype)
    err = (ctx.double() - att.context).abs().nan_to_num(nan=math.inf)
    live = judged[:, None, :] & att.live  # [B, Nh, R]
    share = float(live.sum()) / max(1, int(judged.sum()) * att.live.shape[1])
    where = live[..., None].expand_as(err)
    err = err.masked_fill(~where, 0.0)
    bound = c * eps * att.magnitude
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    at = None
    if worst > 1.0:
        idx = torch.nonzero(ratio == ratio.max())[0].tolist()
        at = {"example": idx[0], "head": idx[1], "query": int(rows[idx[2]]) if rows is not None else idx[2]}
    return (float(err.max()) if err.numel() else 0.0), worst, at, share


def _reference_check(call: Call, s: _Setting, rows: "Tensor | None", judged: "Tensor", dtype: str,
                     variants: Callable[[], list[tuple[str, _Setting]]]) -> tuple[Check, int]:
    """L4 ``reference``; ``variants`` are made only where it fails (a passing call builds none of their masks)."""
    diff, ratio, at, _ = _agreement(call, s, rows, judged, dtype)
    c, eps = tolerance.rounding("out", dtype)
    limit = diff / ratio if 0 < ratio < math.inf else (0.0 if ratio == math.inf else max(diff, c * eps))
    data: dict[str, Any] = {"rule": "c * eps * M", "c": c, "eps": eps, "ratio": ratio, "dtype": dtype}
    if ratio <= 1.0:
        return bounded(4, "reference", "max |context - float64 reference| (real queries)", diff, max(limit, diff),
                       data=data), 0
    for text, variant in variants():
        _, r, _, share = _agreement(call, variant, rows, judged, dtype)
        if r <= 1.0 and share >= 0.5:  # a variant that leaves most rows no key explains nothing
            data["diagnosis"] = text
            break
    reason = f"the context matches {data['diagnosis']}" if "diagnosis" in data else \
        "no variant tried (kv tiling, scale, window, batch as one sequence, padding, polarity, soft-cap, " \
        "sinks) explains it"
    check = Check(4, "reference", "fail", "max |context - float64 reference| (real queries)", diff, limit, "<=",
                  location=at, reason=reason, data=data)
    return check, (at or {}).get("example", 0)


def _variants(call: Call, exp: Expected, s: _Setting, seen: "Tensor", seen_bias: "Tensor | None",
              valid_k: "Tensor", width: int, documents: "Tensor | None" = None) -> list[tuple[str, _Setting]]:
    """The wrong computations worth naming for this call, most specific first."""
    import torch

    nh, nkv = call.q.shape[1], call.k.shape[1]
    out: list[tuple[str, _Setting]] = []
    if nkv > 1 and nh > nkv:
        out.append(("kv heads tiled (repeat) instead of repeated per group (repeat_kv)", replace(s, tiled=True)))
    got = (call.facts.get("kwargs") or {}).get("scaling")
    scales = [(f"the scaling the call was given ({got:.6g}), not the config's ({s.scale:.6g})", got)] \
        if isinstance(got, (int, float)) and not isinstance(got, bool) else []
    scales += [(f"scaling ignored: 1/sqrt(head_dim) = {width ** -0.5:.6g} instead of {s.scale:.6g}", width ** -0.5),
               (f"no scale applied (1.0) instead of {s.scale:.6g}", 1.0)]
    for text, value in scales:
        if abs(value - s.scale) > 1e-9 * abs(s.scale):
            out.append((text, replace(s, scale=float(value))))
    tq, tk = call.q.shape[-2], call.k.shape[-2]

    def allow_of(e: Expected, valid: "Tensor") -> "Tensor":  # packed documents kept apart, as the config implies
        return expected_allow(e, valid, tq, tk, documents)

    if exp.relation == "causal" and exp.window is not None:
        wide = replace(exp, window=exp.window + 1)
        out.append((f"a window of {exp.window + 1} keys, one wider than sliding_window={exp.window}",
                    replace(s, allow=allow_of(wide, valid_k))))
        out.append(("no sliding window (the layer attended every earlier key)",
                    replace(s, allow=allow_of(replace(exp, window=None), valid_k))))
    if exp.relation == "causal":
        out.append(("no causal mask: every key attended, the future included",
                    replace(s, allow=allow_of(replace(exp, relation="bidirectional", window=None), valid_k))))
    elif exp.relation == "bidirectional":
        out.append(("a causal mask on a bidirectional layer",
                    replace(s, allow=allow_of(replace(exp, relation="causal"), valid_k))))
    b = call.q.shape[0]
    if exp.relation == "causal" and 1 < b and b * tq <= JOINED_MOST and tq == tk and s.bias is None:
        causal = torch.ones(b * tq, b * tk, dtype=torch.bool).tril()[None, None]  # [1, 1, B*Tq, B*Tk]
        out.append(("the batch read as one sequence: each example attends to the examples before it, its mask "
                    "unused", replace(s, allow=causal, joined=True)))
    if documents is not None:
        out.append(("packed documents not kept apart: a query reads earlier documents' keys",
                    replace(s, allow=expected_allow(exp, valid_k, tq, tk))))
    if not bool(valid_k.all()):
        out.append(("padding ignored: padded keys attended",
                    replace(s, allow=allow_of(exp, valid_k.new_ones(valid_k.shape)))))
    out.append(("the mask read with the wrong polarity (blocked where it allows)", replace(s, allow=~seen)))
    out.append(("the call's own mask", replace(s, allow=seen, bias=_plus(s.bias, seen_bias))))
    if exp.softcap is not None:
        out.append(("softcap ignored: the scores were not soft-capped", replace(s, softcap=None)))
    if s.sinks is not None:
        out.append(("sinks dropped: s_aux is not in the softmax denominator", replace(s, sinks=None)))
    return out


def _plus(a: "Tensor | None", b: "Tensor | None") -> "Tensor | None":
    if a is None or b is None:
        return a if b is None else b
    return a + b


# --- one call ------------------------------------------------------------------------------------------


def implied(call: Call, exp: Expected, sides: Sides) -> tuple["Tensor", "Tensor", "Tensor", "Tensor | None", str]:
    """``(allow, real, seen, seen_bias, seen_text)``: the relation the config implies ``[B, 1, Tq, Tk]`` (the call's own
    where nothing says it), the query rows judged beyond finiteness ``[B, Tq]``, and the call's own mask."""
    b, _, tq, _ = call.q.shape
    tk = call.k.shape[-2]
    valid_q, valid_k = _side(sides, exp.queries, b, tq), _side(sides, exp.keys, b, tk)
    seen, seen_bias, seen_text = observed_allow(call, tq, tk)
    allow = expected_allow(exp, valid_k, tq, tk, _documents(sides, exp.keys, b, tk)) if exp.judged else seen
    real = valid_q & allow.any(dim=-1).any(dim=1)  # [B, Tq]
    return allow, real, seen, seen_bias, seen_text


def scale_of(call: Call, exp: Expected) -> float:
    """The scale the reference applies: the config's, else the call's own ``scaling``, else ``Dh ** -0.5``."""
    got = (call.facts.get("kwargs") or {}).get("scaling")
    if exp.scale is not None:
        return exp.scale
    return float(got) if isinstance(got, (int, float)) and not isinstance(got, bool) else call.q.shape[-1] ** -0.5



def judge_call(call: Call, exp: Expected, sides: Sides, budget: int = REFERENCE_BUDGET) -> Verdict:
    """Every check of one call (see the module docstring)."""
    import torch

    seen_fail = _observed(call)
    if seen_fail is not None:
        return Verdict((seen_fail, *_rest("observed", "q, k, v or the output were not seen")))
    checks = [Check(1, "observed", "pass")]
    checks.append(_layout(call))
    if checks[-1].failed:
        return Verdict((*checks, *_rest("layout", "wrong output layout")))
    b, nh, tq, width = call.q.shape
    tk = call.k.shape[-2]
    dtype = tolerance.dtype_name(call.context.dtype)
    valid_k = _side(sides, exp.keys, b, tk)
    allow, real, seen, seen_bias, seen_text = implied(call, exp, sides)
    bad = ~torch.isfinite(call.context).all(dim=-1)  # [B, Nh, Tq]
    checks.append(_finite_check(call, bad))
    checks += _weights_checks(call, allow, real, dtype)
    checks.append(_rotary_check(call, exp, sides.positions))
    checks.append(_scale_check(call, exp, width))
    documents = _documents(sides, exp.keys, b, tk)
    checks.append(_relation_check(call, exp, allow, seen, seen_text, real, valid_k, documents is not None))
    checks.append(_softcap_check(call, exp))
    checks.append(_sinks_check(call, exp))
    scale = scale_of(call, exp)
    bias = call.bias if exp.judged else _plus(call.bias, seen_bias)
    s = _Setting(allow, scale, exp.softcap, bias, call.sinks)
    rows = sample_rows(b, nh, tq, tk, budget)
    judged = real if rows is None else real[:, rows]
    ref, example = _reference_check(call, s, rows, judged, dtype,
                                    lambda: _variants(call, exp, s, seen, seen_bias, valid_k, width, documents))
    checks.append(ref)
    sampled = {"rows": tq if rows is None else int(rows.numel()), "of": tq}
    return Verdict(carry_diagnosis(checks, _POSITION, "the context matches", keep_own=True), allow, real, scale,
                   exp.softcap, sampled, example)


def _documents(sides: Sides, name: str, b: int, t: int) -> "Tensor | None":
    """``[B, T]`` each token's document where the input side holds packed documents of that shape, else None."""
    d = sides.documents
    return d if d is not None and name == "input" and tuple(d.shape) == (b, t) else None


def _side(sides: Sides, name: str, b: int, t: int) -> "Tensor":
    """``[B, T]`` real tokens of a side (all real where the inputs say nothing of it, or their length differs)."""
    import torch

    v = sides.valid.get(name)
    if v is None or tuple(v.shape) != (b, t):
        return torch.ones(b, t, dtype=torch.bool)
    return v.bool()
