"""Boundary properties of the score-grid stages, each checked on a small probe derived from the inputs.

The probe is the first examples, heads and positions of the tensors that entered the scores
stage (after projections and rotary positions), with the intended relation on those positions,
run through the pipeline's own stage functions (:func:`attn_ledger.maths.pipeline.attend`). A query
row the relation leaves without a key in the probe is declared empty there: its weights must be zeros.

One check per property:

* ``single_token`` (L3): the first query and key alone: its weight is 1 and its context is its
  value; with ``grad``, ``single_token_zero_grad`` (L3): autograd through the forward's functions
  gives zero query and key gradients, since a lone key's weight does not depend on its score
  (a property of the forward; the hand-written backward is checked in its own rows);
* ``equal_keys_uniform`` (L3): every key set equal to the first: each row is uniform over its
  allowed keys;
* ``permutation_equivariant`` (L4): queries and keys reversed, the relation's rows and columns
  with them (one joint permutation in self-attention): the context rows come out reversed;
* ``batch_independent`` (L4): each example alone gives the context it had in the batch
  (not applicable with one example);
* ``empty_batch`` (L1): the batch sliced to 0 runs and keeps the derived shape.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger import tolerance
from attn_ledger.report import Check, Note, bounded, unjudged

if TYPE_CHECKING:
    from attn_ledger.engine.rows import Rows
    from torch import Tensor

    from attn_ledger.maths.relations import Relation

PROBE_EXAMPLES = 2
PROBE_HEADS = 2
PROBE_TOKENS = 8
PROPERTIES = ("single_token", "single_token_zero_grad", "equal_keys_uniform", "permutation_equivariant",
              "batch_independent", "empty_batch")


def probe_of(q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", relation: "Relation") -> tuple:
    """The probe: up to PROBE_EXAMPLES examples, PROBE_HEADS heads, PROBE_TOKENS queries and keys, and the relation there."""
    b, nh = min(q.shape[0], PROBE_EXAMPLES), min(q.shape[1], PROBE_HEADS)
    nq, nk = min(q.shape[2], PROBE_TOKENS), min(k_exp.shape[2], PROBE_TOKENS)
    allow = relation.block(0, nq)  # [B|1, Nh|1, nq|1, Tk]
    if allow is not None:
        allow = allow[:b, :nh, :, :nk]
        allow = allow.expand(allow.shape[0], allow.shape[1], nq, nk)  # [B'|1, Nh'|1, nq, nk]
    return q[:b, :nh, :nq], k_exp[:b, :nh, :nk], v_exp[:b, :nh, :nk], allow


def check_properties(ops: Any, probe: tuple, scale: float, *, grad: bool) -> list[Check]:
    """Every boundary property on the probe (from :func:`probe_of`), in the order of :data:`PROPERTIES`.

    Args:
        grad: also the single token's zero query and key gradients.
    """
    import torch

    dtype = probe[0].dtype
    lim = tolerance.row_sum(dtype)
    rel = sum(tolerance.reference(dtype))
    if probe[0].shape[0] == 0:
        why = "B = 0: no example to probe"
        names = [n for n in PROPERTIES[:-1] if grad or n != "single_token_zero_grad"]
        levels = {"permutation_equivariant": 4, "batch_independent": 4}
        return [unjudged(levels.get(n, 3), n, "not_applicable", why) for n in names] + [_empty(ops, probe, scale)]
    with torch.inference_mode():  # the probes' many small operations spared autograd's bookkeeping
        found = [_single_token(ops, probe, scale, lim), *_side_by_side(ops, probe, scale, lim, rel),
                 _empty(ops, probe, scale)]
    if grad:  # autograd, so outside inference mode
        q, k, v, _ = probe
        found.insert(1, _guarded("single_token_zero_grad", 3,
                                 lambda: _zero_grad(ops, q[:, :, :1], k[:, :, :1], v[:, :, :1], scale, lim)))
    return found


def properties_row(rows: "Rows", ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", relation: "Relation",
                   scale: float, grad: bool) -> None:
    """The ``properties`` row: every property on the probe, and the probe's size as a field.

    With attention sinks the probe runs the stage functions without them: a lone key's weight and a
    row's uniform weights are properties of the softmax over the keys."""
    from attn_ledger.maths.pipeline import without_sinks

    ops = without_sinks(ops)
    probe = probe_of(q, k_exp, v_exp, relation)
    rows.stage("properties", None, check_properties(ops, probe, scale, grad=grad))
    rows.fields["properties"] = {"probe": [int(probe[0].shape[0]), int(probe[0].shape[1]), int(probe[0].shape[2]),
                                           int(probe[1].shape[2])]}
    rows.row_notes["properties"] = Note("probe")  # its sizes are the row's probe field


def _guarded(name: str, level: int, fn: Callable[[], Check]) -> Check:
    """A property whose probe raises fails (the stage that raised is the finding elsewhere, or here)."""
    try:
        return fn()
    except Exception as exc:
        return _raised(name, level, exc)


def _raised(name: str, level: int, exc: Exception) -> Check:
    return Check(level, name, "fail", reason=f"the probe raised {type(exc).__name__}: {str(exc).strip()[:160]}",
                 data={"exception": type(exc).__name__})


def _run(ops: Any, q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float) -> dict[str, "Tensor"]:
    from attn_ledger.maths.pipeline import attend

    return attend(ops, q, k, v, allow, scale, True)  # probe rows without a key are declared empty


def _single_token(ops: Any, probe: tuple, scale: float, lim: float) -> Check:
    q, k, v, _ = probe
    q1, k1, v1 = q[:, :, :1], k[:, :, :1], v[:, :, :1]  # [B', Nh', 1, *]
    try:
        st = _run(ops, q1, k1, v1, None, scale)
        w_err = float((st["weights"] - 1).abs().amax())
        c_err = float((st["context"] - v1).abs().amax()) / max(1.0, float(v1.abs().amax()))
    except Exception as exc:
        return _raised("single_token", 3, exc)
    return bounded(3, "single_token", "max of |weight - 1| and |context - value| / max(1, |value|), one key",
                   _worst(w_err, c_err), lim, data={"weight_err": w_err, "context_err": c_err})


def _zero_grad(ops: Any, q1: "Tensor", k1: "Tensor", v1: "Tensor", scale: float, lim: float) -> Check:
    """Autograd through the pipeline's forward on one key: its weight cannot move, so Q-bar and K-bar are zero.

    Autograd of the forward, not the hand backward: this is a property of the forward's functions
    (the backward stages are checked in their own rows).
    """
    import torch

    with torch.enable_grad():
        qg, kg = (t.detach().clone().requires_grad_(True) for t in (q1, k1))
        ctx = _run(ops, qg, kg, v1, None, scale)["context"]  # [B', Nh', 1, Dv]
        found = torch.autograd.grad(ctx.sum(), (qg, kg), allow_unused=True)
    size = max(1.0, float(v1.abs().amax()) if v1.numel() else 0.0)
    value = 0.0
    for g in found:
        if g is not None and g.numel():
            value = _worst(value, float(g.abs().amax()) / size)
    return bounded(3, "single_token_zero_grad", "max |Q-bar|, |K-bar| / max(1, |value|), one key, O-bar = 1 "
                   "(autograd of the forward)", value, lim)


def _side_by_side(ops: Any, probe: tuple, scale: float, lim: float, rel: float) -> list[Check]:
    """``equal_keys_uniform``, ``permutation_equivariant`` and ``batch_independent`` from two runs of the stages.

    Heads are independent in every score-grid stage, so the probe, the probe with every key equal
    to the first, and the probe with its tokens reversed run as one batch of 3 x Nh' heads; each
    example alone runs as one single-example batch with the examples side by side as heads. The
    probes cost the number of small operations, not their size, so fewer calls is what makes the
    row cheap. A stage that mixed heads breaks these properties too, as it should.
    """
    import torch

    q, k, v, allow = probe  # [B', Nh', nq, Dh], [B', Nh', nk, Dh], [B', Nh', nk, Dv], [B'|1, Nh'|1, nq, nk] or None
    b, nh, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    a = None if allow is None else allow.expand(allow.shape[0], nh, nq, nk)  # [B'|1, Nh', nq, nk]
    names = (("equal_keys_uniform", 3), ("permutation_equivariant", 4))
    try:
        # [B', 3 Nh', n, D]: the three probes one after another along the heads (a flip and a cat are cheaper
        # than a gather on tensors this small)
        st = _run(ops, torch.cat((q, q, q.flip(2)), 1), torch.cat((k, k[:, :, :1].expand(k.shape), k.flip(2)), 1),
                  torch.cat((v, v, v.flip(2)), 1), None if a is None else torch.cat((a, a, a.flip((2, 3))), 1), scale)
        w, ctx = st["weights"], st["context"]  # [B', 3 Nh', nq, nk], [B', 3 Nh', nq, Dv]
        _expect_shape(w, [b, 3 * nh, nq, nk], "weights")
        _expect_shape(ctx, [b, 3 * nh, nq, v.shape[-1]], "context")
    except Exception as exc:
        found = [_raised(n, level, exc) for n, level in names]
        return found + [_guarded("batch_independent", 4, lambda: _batch(ops, probe, scale, a, rel, exc))]
    base = ctx[:, :nh]  # [B', Nh', nq, Dv]
    found = [_equal_keys(w[:, nh:2 * nh], a, lim, nk),
             _agree("permutation_equivariant", "tokens reversed", ctx[:, 2 * nh:], base.flip(2), rel,
                    {"queries": nq, "keys": nk, "joint": nq == nk})]
    return found + [_guarded("batch_independent", 4, lambda: _batch(ops, probe, scale, a, rel, base))]


def _expect_shape(t: "Tensor", want: list[int], what: str) -> None:
    if list(t.shape) != want:
        raise ValueError(f"{what} of the side-by-side probes: shape {list(t.shape)}, expected {want}")


def _equal_keys(w: "Tensor", allow: "Tensor | None", lim: float, nk: int) -> Check:
    """Every key equal to the first (``w``: those weights, [B', Nh', nq, nk]): each row uniform over its allowed keys
    (zeros on a row the probe leaves without a key, which it declares empty)."""
    if allow is None:
        err = (w - 1.0 / max(nk, 1)).abs()
    else:
        # [B'|1, Nh', nq, nk]: 1/n on a row's n allowed keys, 0 elsewhere, and 0 on a row without a key (declared empty)
        uniform = allow.to(w.dtype) / allow.sum(dim=-1, keepdim=True).clamp(min=1)
        err = (w - uniform).abs()
    return bounded(3, "equal_keys_uniform", "max |weight - 1/allowed keys|, every key equal to the first",
                   float(err.amax()) if err.numel() else 0.0, lim, data={"keys": nk})


def _batch(ops: Any, probe: tuple, scale: float, allow: "Tensor | None", rel: float, whole: "Tensor | Exception") -> Check:
    """Each example alone against its rows of the batch (``whole``: the probe's context, [B', Nh', nq, Dv]).

    The examples run as one batch of one example, side by side as heads (``allow``: [B'|1, Nh', nq, nk]).
    """
    q, k, v, _ = probe
    b, nh, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if b < 2:
        return unjudged(4, "batch_independent", "not_applicable", "one example (B = 1)")
    if isinstance(whole, Exception):
        raise whole
    one = None if allow is None else allow.expand(b, nh, nq, nk).reshape(1, b * nh, nq, nk)
    alone = _run(ops, q.reshape(1, b * nh, nq, -1), k.reshape(1, b * nh, nk, -1), v.reshape(1, b * nh, nk, -1), one,
                 scale)["context"]
    return _agree("batch_independent", "each example alone", alone.reshape(b, nh, nq, -1), whole, rel,
                  {"examples": b})


def _agree(name: str, what: str, got: "Tensor", want: "Tensor", rel: float, data: dict[str, Any]) -> Check:
    if tuple(got.shape) != tuple(want.shape):
        return Check(4, name, "fail", reason=f"{what}: shape {list(got.shape)}, expected {list(want.shape)}",
                     data={**data, "got": list(got.shape), "expected": list(want.shape)})
    size = max(1.0, float(want.abs().amax()) if want.numel() else 0.0)
    diff = float((got - want).abs().amax()) / size if want.numel() else 0.0
    return bounded(4, name, f"max |context diff| / max(1, |context|), {what}", diff, rel, data=data)


def _worst(a: float, b: float) -> float:
    """The larger, NaN winning."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _empty(ops: Any, probe: tuple, scale: float) -> Check:
    """The batch sliced to 0: runs and keeps the derived shape."""
    q, k, v, allow = probe
    q0, k0, v0 = q[:0], k[:0], v[:0]
    a0 = None if allow is None else (allow[:0] if allow.shape[0] > 1 else allow)
    want = [0, q.shape[1], q.shape[2], v.shape[-1]]
    try:
        st = _run(ops, q0, k0, v0, a0, scale)
    except Exception as exc:
        return Check(1, "empty_batch", "fail", reason=f"B = 0 raised {type(exc).__name__}: {str(exc).strip()[:160]}",
                     data={"exception": type(exc).__name__, "expected": want})
    got = list(st["context"].shape)
    return Check(1, "empty_batch", "pass" if got == want else "fail",
                 reason=f"[B,Nh,Tq,Dv] derived {want} for B = 0, got {got}", data={"expected": want, "got": got})
