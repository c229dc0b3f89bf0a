"""The backward stages: run block by block over the forward's plan through the pipeline's own functions, measured.

With ``grad``, the ledger seeds ``O-bar`` on the last forward stage and runs the backward of the
score-grid stages through the pipeline's hand-written stage functions (the ``Ops`` bundle, so a
fault can be injected there), one query block at a time, over the key range the forward used:

* each block's weights are recomputed from its query rows and keys, not kept from the forward:
  keeping them would hold the whole ``[B, Nh, Tq, Tk]`` grid, which streaming exists to avoid,
  while recomputing costs one more scores and softmax per block (FlashAttention's choice too);
* ``A-bar = O-bar V^T`` and ``S-bar`` (the softmax backward) exist one block at a time; the rows
  of ``Q-bar`` are written block by block; ``K-bar`` and ``V-bar`` are summed over blocks.

Measured here (judged in :mod:`~attn_ledger.engine.judge`): non-finite values; the softmax
backward's row rule ``S-bar = A * (A-bar - rowsum(A * A-bar))`` from the pipeline's own ``A`` and
``A-bar``; zero ``K-bar`` and ``V-bar`` on keys no query may use; ``K-bar`` summed over keys is
zero (each row of ``S-bar`` sums to zero); agreement with float64 autograd of the reference on
its sampled rows (for ``K-bar`` and ``V-bar``, the part those rows contribute, so a sample stays
a sample) and with autograd of F.scaled_dot_product_attention on every row.

:func:`gradcheck` is separate: on small inputs it compares the pipeline's hand backward, run in
float64, with central differences of the pipeline's own forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from attn_ledger import tolerance
from attn_ledger.engine import measure as M
from attn_ledger.engine import plan as P
from attn_ledger.engine.execute import block_layout, block_stages
from attn_ledger.engine.measure import Agreement, Broken, Count, Measure, Peak
from attn_ledger.report import Check, bounded

if TYPE_CHECKING:
    from torch import Tensor

    from attn_ledger.maths.relations import Relation
    from attn_ledger.maths.rotary import RotarySpec

BACKWARD_STAGES = ("grad_context", "grad_weights", "grad_values", "grad_scores", "grad_q", "grad_k", "grad_sinks")
GRADCHECK_STEP = 1e-6  # central differences, float64
GRADCHECK_TOL = 2e-6  # largest |analytic - numeric| allowed per coordinate
GRADCHECK_MAX = 64  # coordinates per tensor (evenly spread beyond this)
GRADCHECK_ENTRIES = 4096  # gradcheck runs when q, k and v together have at most this many entries


@dataclass(frozen=True)
class KeyAt:
    """Where a key-major gradient (``K-bar``, ``V-bar``) goes wrong: example, head and key."""

    example: int
    head: int
    key: int

    @property
    def query(self) -> int:
        return -1  # folded like a Where: by example, head, then key

    def as_dict(self) -> dict[str, int]:
        return {"example": self.example, "head": self.head, "key": self.key}


@dataclass(frozen=True)
class Rotation:
    """Rotary positions applied before the scores: query i at ``q_start + i``, key j at j."""

    spec: "RotarySpec"
    q_start: int

    def positions(self, n: int, start: int, device: Any = None) -> "Tensor":
        import torch

        return torch.arange(n, device=device) + start  # [n]


@dataclass(frozen=True)
class HeadAt:
    """Where a per-head gradient (the sinks') goes wrong: its head."""

    head: int

    @property
    def example(self) -> int:
        return -1

    @property
    def query(self) -> int:
        return -1

    def as_dict(self) -> dict[str, int]:
        return {"head": self.head}


def key_at(where: M.Where | None) -> KeyAt | None:
    """A location measured on a ``[B, Nh, Tk, D]`` tensor (its row axis holds keys)."""
    return None if where is None else KeyAt(where.example, where.head, where.query)


class Backward:
    """One backward run over a plan; :meth:`run` yields the measurements.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k_exp, v_exp: ``[B, Nh, Tk, Dh]``, ``[B, Nh, Tk, Dv]`` as they entered the scores
            stage (rotated, kv heads expanded).
        grad_context: ``O-bar`` ``[B, Nh, Tq, Dv]``.
        ref: float64 autograd of the reference on the plan's sampled rows (:func:`reference.reference_gradients`),
            or None.
        sdpa_scale: the scale F.scaled_dot_product_attention gets (the intended one).

    After :meth:`run`: ``dq``, ``dk``, ``dv`` (before rotation, kv heads summed back; None if a stage broke),
    ``dq_post``, ``dk_exp``, ``dv_exp`` (as the stages produced them), ``dsinks`` ``[Nh]`` (the sinks' gradient,
    with sinks; None where its stage broke) and ``kept`` (whole grids when the plan keeps them).
    """

    def __init__(self, plan: P.Plan, relation: "Relation", ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor",
                 grad_context: "Tensor", *, scale: float, sdpa_scale: float, empty_zero: bool, n_kv: int,
                 rotation: Rotation | None = None, ref: "dict[str, Tensor] | None" = None, sdpa: bool = True,
                 softcap: float | None = None, sinks: "Tensor | None" = None,
                 mags: "dict[str, Tensor] | None" = None) -> None:
        import torch

        self.plan, self.relation, self.ops, self.sinks = plan, relation, ops, sinks
        self.q, self.k_exp, self.v_exp, self.go = q, k_exp, v_exp, grad_context
        self.scale, self.sdpa_scale, self.empty_zero, self.n_kv = scale, sdpa_scale, empty_zero, n_kv
        self.rotation, self.ref, self.softcap = rotation, ref, softcap
        self.rtol, self.atol = tolerance.reference(q.dtype)
        self.mags, self.dtype_name = mags, tolerance.dtype_name(q.dtype)  # the rounding rule's M (grad_magnitudes)
        b, nh, tq, dh = q.shape
        like = dict(dtype=q.dtype, device=q.device)
        # allocated outside inference mode, so they stay ordinary tensors
        self.dq_post = torch.zeros(b, nh, tq, dh, **like)  # [B, Nh, Tq, Dh]
        self.dk_exp = torch.zeros(b, nh, plan.tk, dh, **like)  # [B, Nh, Tk, Dh]
        self.dv_exp = torch.zeros(b, nh, plan.tk, v_exp.shape[-1], **like)  # [B, Nh, Tk, Dv]
        self.every_row = plan.reference_rows == tq
        self.partial: dict[str, Tensor] = {}  # K-bar, V-bar from the sampled rows alone
        if ref is not None and not self.every_row:
            self.partial = {"grad_k": torch.zeros_like(self.dk_exp), "grad_values": torch.zeros_like(self.dv_exp)}
        self.got = {} if ref is None else {key: ref[key].clone() for key in ("grad_weights", "grad_scores")}
        self.reach: "Tensor | None" = None  # [B|1, Nh|1, Tk]: keys some query may use
        self.kept: dict[str, list[Tensor]] = {}
        self.dq = self.dk = self.dv = None
        self.dk_sample = self.dv_sample = None  # K-bar, V-bar from the sampled rows (all of them: every row)
        self.ran: set[str] = set()  # stages every block so far has computed
        self.use_sdpa = sdpa
        self.sdpa_grads: "dict[str, Tensor] | None" = None  # SDPA's Q-bar, K-bar, V-bar, as dq, dk, dv are
        wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # as grad_sinks sums
        self.dsinks = None if sinks is None else torch.zeros(nh, dtype=wide, device=q.device)  # [Nh]
        self.dsinks_sample = None if sinks is None else torch.zeros(nh, dtype=wide, device=q.device)  # sampled rows

    def run(self) -> Iterator[Measure]:
        """Every block through the backward stages, then the whole-tensor measurements; stops at a broken stage."""
        import torch

        with torch.inference_mode():
            for blk in self.plan.blocks:
                if not (yield from self._block(blk)):
                    yield from self._counts()  # what was summed before the stage broke
                    return
        yield from self._counts()
        yield from self._finish()

    def _counts(self) -> Iterator[Count]:
        """Non-finite Q-bar, K-bar, V-bar and the sinks' gradient, counted once on the sums: a NaN or an infinity
        in any block's part leaves its sum non-finite (an infinity meeting its opposite becomes NaN)."""
        import torch

        if "grad_q" in self.ran:
            yield M.nonfinite("grad_q", self.dq_post, q0=0, k0=None)
        if "grad_sinks" in self.ran and self.dsinks is not None:
            bad = ~torch.isfinite(self.dsinks)  # [Nh]
            first = int(torch.argmax(bad.to(torch.uint8))) if bool(bad.any()) else None
            yield Count("grad_sinks", "nonfinite", int(bad.sum()), where=None if first is None else HeadAt(first))
        for stage, t in (("grad_values", self.dv_exp), ("grad_k", self.dk_exp)):
            if stage in self.ran:
                n = M.nonfinite(stage, t, q0=0, k0=None)
                yield Count(stage, n.name, n.n, where=key_at(n.where))

    def _block(self, blk: P.Block) -> Iterator[Measure]:
        """One block's backward; returns False when a stage broke."""
        ops, (b, nh) = self.ops, (self.plan.b, self.plan.nh)
        lay, allow_i, allow_p = block_layout(self.plan, self.relation, ops, blk)
        lo, hi, q0, q1 = lay.lo, lay.hi, blk.q0, blk.q1
        qb, kb, vb, gob = self.q[:, :, q0:q1], self.k_exp[:, :, lo:hi], self.v_exp[:, :, lo:hi], self.go[:, :, q0:q1]
        self._reachable(allow_i)
        m, w = block_stages(ops, qb, kb, None if allow_p is None else allow_p[..., lo:hi], lay.pipe_band, self.scale,
                            self.empty_zero)  # [B, Nh, rows, kw]
        grid, dh, dv = (b, nh, blk.rows, lay.width), qb.shape[-1], vb.shape[-1]
        gw = yield from _stage("grad_weights", lambda: ops.grad_weights(gob, vb), grid)
        gv = None if gw is None else (yield from _stage("grad_values", lambda: ops.grad_values(w, gob), (b, nh, lay.width, dv)))
        gs = None if gv is None else (yield from _stage("grad_scores", lambda: ops.softmax_backward(w, gw), grid))
        rule = None if gs is None else row_rule(w, gw, gs, self.rtol, self.atol, q0, lo)
        # A finite rule residual means finite A-bar and S-bar (a NaN or infinity in either makes it
        # non-finite, 0 * inf included): they are counted only when it is not.
        clean = rule is not None and math.isfinite(rule.diff)
        if gw is not None:
            yield Count("grad_weights", "nonfinite", 0) if clean else M.nonfinite("grad_weights", gw, q0=q0, k0=lo)
        if rule is not None:
            yield Count("grad_scores", "nonfinite", 0) if clean else M.nonfinite("grad_scores", gs, q0=q0, k0=lo)
            yield rule
        gsc = None if gs is None else cap_chain(gs, m, self.softcap)  # S-bar through the soft-cap, where there is one
        gq = None if gs is None else (yield from _stage("grad_q", lambda: ops.grad_q(gsc, kb, self.scale), (b, nh, blk.rows, dh)))
        gk = None if gq is None else (yield from _stage("grad_k", lambda: ops.grad_k(gsc, qb, self.scale), (b, nh, lay.width, dh)))
        self.ran.update(name for name, t in (("grad_values", gv), ("grad_q", gq)) if t is not None)
        if gk is None:
            return False
        self.ran.add("grad_k")
        self.dv_exp[:, :, lo:hi] += gv
        self.dq_post[:, :, q0:q1] = gq
        self.dk_exp[:, :, lo:hi] += gk
        share = yield from self._sinks_block(m, w, gw)
        yield from self._sample(blk, lay, w, gw, gs, gob, qb, gsc, share)
        if self.plan.keep:
            self.kept.setdefault("grad_weights", []).append(gw)
            self.kept.setdefault("grad_scores", []).append(gs)
        return True

    def _sinks_block(self, m: "Tensor", w: "Tensor", gw: "Tensor") -> Iterator[Measure]:
        """The block's part of the sinks' gradient (with sinks), summed into ``dsinks``; returns the sink's share of
        each row ``[B, Nh, rows]``, or None. A stage that breaks stops only itself: ``dsinks`` becomes None."""
        from attn_ledger.maths.pipeline import sink_share

        if self.dsinks is None:
            return None
        share = sink_share(m, self.sinks)  # [B, Nh, rows], from the pipeline's own masked scores
        got = yield from _stage("grad_sinks", lambda: self.ops.grad_sinks(share, w, gw), (self.plan.nh,))
        if got is None:
            self.dsinks = self.dsinks_sample = None
            return None
        self.dsinks += got
        self.ran.add("grad_sinks")
        return share

    def _reachable(self, allow_i: "Tensor | None") -> None:
        if allow_i is None:
            return
        seen = allow_i.any(dim=-2)  # [B|1, Nh|1, Tk]
        self.reach = seen if self.reach is None else (self.reach | seen)

    def _sample(self, blk: P.Block, lay: P.Layout, w: "Tensor", gw: "Tensor", gs: "Tensor", gob: "Tensor",
                qb: "Tensor", gsc: "Tensor", share: "Tensor | None" = None) -> Iterator[Measure]:
        """The sampled rows' A-bar and S-bar, and what those rows alone give K-bar, V-bar and the sinks' gradient."""
        if self.ref is None or blk.sample is None:
            return
        a, z = blk.sample
        at = slice(blk.sample_at, blk.sample_at + z - a)
        for key, t in (("grad_weights", gw), ("grad_scores", gs)):
            self.got[key][:, :, at, lay.lo:lay.hi].copy_(t[:, :, a:z])
        if share is not None and self.dsinks_sample is not None:
            try:
                self.dsinks_sample += self.ops.grad_sinks(share[:, :, a:z], w[:, :, a:z], gw[:, :, a:z])
            except Exception:  # the stage ran on the whole block but not on its sampled rows: nothing to compare
                self.dsinks_sample.fill_(math.nan)
        if not self.partial:
            return
        try:
            self.partial["grad_k"][:, :, lay.lo:lay.hi] += self.ops.grad_k(gsc[:, :, a:z], qb[:, :, a:z], self.scale)
            self.partial["grad_values"][:, :, lay.lo:lay.hi] += self.ops.grad_values(w[:, :, a:z], gob[:, :, a:z])
        except Exception:  # the stage ran on the whole block but not on its sampled rows: nothing to compare
            self.partial = {key: t.fill_(math.nan) for key, t in self.partial.items()}
        return
        yield  # a generator like the other stages

    def _finish(self) -> Iterator[Measure]:
        """Whole-tensor measurements once every block is done, then the two references."""
        from attn_ledger.maths.pipeline import reduce_kv

        for stage, t in (("grad_values", self.dv_exp), ("grad_k", self.dk_exp)):
            yield from self._blocked(stage, t)
        if self.softcap is None and self.sinks is None:  # through a cap, or with a sink's share, the rows of the
            # scores' gradient no longer sum to zero
            yield key_sum(self.dk_exp)
        self.dq, self.dk, self.dv = self._unrotated(self.dq_post, reduce_kv(self.dk_exp, self.n_kv),
                                                    reduce_kv(self.dv_exp, self.n_kv))
        if self.ref is not None:
            yield from self._against_float64()
        if self.use_sdpa:
            yield from self._against_sdpa()

    def _blocked(self, stage: str, t: "Tensor") -> Iterator[Peak]:
        """The largest |gradient| on a key no query may use (none: every key is used by some query)."""
        import torch

        if self.reach is None or bool(self.reach.all()):
            return
        off = ~self.reach.expand(t.shape[0], t.shape[1], t.shape[2])[..., None]  # [B, Nh, Tk, 1]
        worst = torch.where(off, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device))  # [B, Nh, Tk, D]
        value = float(worst.amax()) if worst.numel() else 0.0
        where = key_at(M.where_in(M.worst_index(worst), 0, None)) if value != 0 else None
        yield Peak(stage, "blocked_max", value, where=where)

    def _unrotated(self, dq: "Tensor", dk: "Tensor", dv: "Tensor") -> tuple["Tensor", "Tensor", "Tensor"]:
        """Q-bar and K-bar through the rotation back to the tensors before it (V is never rotated)."""
        from attn_ledger.maths.pipeline import unrotate

        r = self.rotation
        if r is None:
            return dq, dk, dv
        return (unrotate(dq, r.spec, r.positions(dq.shape[2], r.q_start)), unrotate(dk, r.spec, r.positions(dk.shape[2], 0)),
                dv)

    def _against_float64(self) -> Iterator[Agreement]:
        """The sampled rows against float64 autograd; K-bar and V-bar as those rows contribute them."""
        import torch

        from attn_ledger.maths.pipeline import reduce_kv

        ref, spans = self.ref, self.plan.reference_spans
        for key in ("grad_weights", "grad_scores"):
            yield self._float64(key, self.got[key], ref[key], spans=spans)
        dq_rows = torch.cat([self.dq[:, :, r0:r1] for r0, r1 in spans], dim=2)  # [B, Nh, R, Dh]
        yield self._float64("grad_q", dq_rows, ref["grad_q"], spans=spans, grid=False)
        if self.every_row:
            dk, dv = self.dk, self.dv
        else:
            _, dk, dv = self._unrotated(self.dq, reduce_kv(self.partial["grad_k"], self.n_kv),
                                        reduce_kv(self.partial["grad_values"], self.n_kv))
        self.dk_sample, self.dv_sample = dk, dv
        yield self._float64("grad_k", dk, ref["grad_k"], keys=True)
        yield self._float64("grad_values", dv, ref["grad_values"], keys=True)
        if self.dsinks_sample is not None and "grad_sinks" in ref:
            yield self._float64_heads("grad_sinks", self.dsinks_sample, ref["grad_sinks"])

    def _float64_heads(self, stage: str, got: "Tensor", ref: "Tensor") -> Agreement:
        """A per-head gradient ``[Nh]`` against float64 autograd, by the rounding rule where its ``M`` is known."""
        m = None if self.mags is None else self.mags.get(stage)
        as_grid = (got.reshape(1, -1, 1, 1), ref.reshape(1, -1, 1, 1))  # [1, Nh, 1, 1]: one value per head
        if m is None or m.shape != got.shape:
            a = _compare(stage, "float64", *as_grid, self.rtol, self.atol, grid=False)
        else:
            from attn_ledger.engine import rounding

            a = rounding.agreement(stage, "pipeline", *as_grid, m.reshape(1, -1, 1, 1), self.dtype_name, 0, None)
        return a if a.where is None else Agreement(**{**a.__dict__, "where": HeadAt(a.where.head)})

    def _float64(self, stage: str, got: "Tensor", ref: "Tensor", *, spans: tuple[tuple[int, int], ...] = (),
                 grid: bool = True, keys: bool = False) -> Agreement:
        """One gradient against float64 autograd: elementwise within ``c * eps * M`` where ``M`` is known
        (:func:`attn_ledger.engine.rounding.grad_magnitudes`), the reference tolerance otherwise."""
        m = None if self.mags is None else self.mags.get(stage)
        if m is None or got.shape != m.shape or got.shape != ref.shape:
            return _compare(stage, "float64", got, ref, self.rtol, self.atol, spans=spans, grid=grid, keys=keys)
        from attn_ledger.engine import rounding

        return located(rounding.agreement(stage, "pipeline", got, ref, m, self.dtype_name, 0, 0 if grid else None),
                       spans, keys)

    def _against_sdpa(self) -> Iterator[Agreement]:
        """Autograd of F.scaled_dot_product_attention on every row, compared as the stages produced them."""
        import torch
        import torch.nn.functional as F

        plan = self.plan
        if plan.b == 0 or not all(blk.layout.all_live for blk in plan.blocks):
            return  # no example, or queries with every key blocked: SDPA's rows there are not defined alike
        with torch.enable_grad():
            if plan.sdpa_whole_causal and self.softcap is None and self.sinks is None:  # exactly causal: one is_causal call, as the forward
                q, k, v = (t.detach().clone().requires_grad_(True) for t in (self.q, self.k_exp, self.v_exp))
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True, scale=self.sdpa_scale)
                gq, gk, gv = torch.autograd.grad(out, (q, k, v), self.go)
            else:
                gq, gk, gv = self._sdpa_grads_by_group()
        from attn_ledger.maths.pipeline import reduce_kv

        sq, sk, sv = self._unrotated(gq, reduce_kv(gk, self.n_kv), reduce_kv(gv, self.n_kv))
        self.sdpa_grads = {"grad_q": sq, "grad_k": sk, "grad_values": sv}
        yield _compare("grad_q", "sdpa", self.dq_post, gq, self.rtol, self.atol, grid=False)
        yield _compare("grad_k", "sdpa", self.dk_exp, gk, self.rtol, self.atol, keys=True)
        yield _compare("grad_values", "sdpa", self.dv_exp, gv, self.rtol, self.atol, keys=True)

    def _sdpa_grads_by_group(self) -> tuple["Tensor", "Tensor", "Tensor"]:
        """SDPA autograd over the forward's SDPA groups of query rows, each on the key range its mask
        uses: Q-bar row by row, K-bar and V-bar summed over groups. The relation's mask is never built
        for the whole ``[Tq, Tk]`` grid at once."""
        import torch
        import torch.nn.functional as F

        gq, gk, gv = torch.zeros_like(self.q), torch.zeros_like(self.k_exp), torch.zeros_like(self.v_exp)
        for g in self.plan.sdpa_groups:
            allow = self.relation.block(g.q0, g.q1)  # [B|1, Nh|1, rows, Tk]
            lo, hi = P.key_hull(allow, self.plan.tk)
            q = self.q[:, :, g.q0:g.q1].detach().clone().requires_grad_(True)
            k, v = (t[:, :, lo:hi].detach().clone().requires_grad_(True) for t in (self.k_exp, self.v_exp))
            mask = None if allow is None else allow[..., lo:hi]
            if self.softcap is not None or self.sinks is not None:
                from attn_ledger.engine.execute import sdpa_capped

                out = sdpa_capped(q, k, v, mask, self.sdpa_scale, self.softcap, self.sinks)  # [B, Nh, rows, Dv]
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                     scale=self.sdpa_scale)  # [B, Nh, rows, Dv]
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), self.go[:, :, g.q0:g.q1])
            gq[:, :, g.q0:g.q1] = dq
            gk[:, :, lo:hi] += dk
            gv[:, :, lo:hi] += dv
        return gq, gk, gv


def cap_chain(gs: "Tensor", masked: "Tensor", cap: float | None) -> "Tensor":
    """``S-bar`` (the gradient of the capped scores) through the soft-cap ``C * tanh(s / C)`` to the scaled
    scores: times ``1 - (capped / C)^2``, the cap's slope; zero where a score was excluded (-inf)."""
    import torch

    if cap is None:
        return gs
    slope = 1.0 - (masked / cap) ** 2  # [B, Nh, rows, kw]
    return gs * torch.where(torch.isfinite(masked), slope, torch.zeros((), dtype=slope.dtype, device=slope.device))


def _stage(name: str, fn: Callable[[], "Tensor"], want: tuple[int, ...]) -> Iterator[Measure]:
    """One backward stage function on one block: its tensor, or None with a :class:`Broken` yielded."""
    try:
        t = fn()
    except Exception as exc:  # a stage that raises is a level-1 divergence at that stage
        yield Broken(name, raised=exc)
        return None
    if tuple(t.shape) != want:
        yield Broken(name, shape=tuple(t.shape), expected=want)
        return None
    return t


def row_rule(w: "Tensor", gw: "Tensor", gs: "Tensor", rtol: float, atol: float, q0: int, k0: int) -> Agreement:
    """``S-bar`` against ``A * (A-bar - rowsum(A * A-bar))`` from the same ``A`` and ``A-bar``, per query row.

    Within ``(atol + rtol) * max(1, max |rule|)`` everywhere: a bound uniform over the block, in a few
    passes over it (float32 arithmetic, float64 for float64 runs; rounding there is about 1e-7 of the
    values, far below the tolerance).
    """
    import torch

    wide = torch.float64 if w.dtype == torch.float64 else torch.float32
    wf, gwf = w.to(wide), gw.to(wide)
    dot = (wf.unsqueeze(-2) @ gwf.unsqueeze(-1)).squeeze(-1)  # [B, Nh, rows, 1]: sum_j A_j A-bar_j, one fused pass
    r = torch.sub(gwf, dot).mul_(wf)  # [B, Nh, rows, kw]: the rule
    lo, hi = (float(x) for x in torch.aminmax(r)) if r.numel() else (0.0, 0.0)
    size = max(1.0, abs(lo), abs(hi))
    r.sub_(gs.to(wide))  # rule - S-bar
    lo, hi = (float(x) for x in torch.aminmax(r)) if r.numel() else (0.0, 0.0)
    diff = math.nan if math.isnan(lo) or math.isnan(hi) or math.isnan(size) else max(-lo, hi)
    excess = diff - (atol + rtol) * size
    where = None
    if math.isnan(excess) or excess > 0:
        where = M.where_in(M.worst_index(r.abs_()), q0, k0)
    return Agreement("grad_scores", "pipeline", "row_rule", diff, excess, where=where)


def key_sum(dk_exp: "Tensor") -> Peak:
    """``|sum over keys of K-bar| / sum over keys of |K-bar|``, largest over (example, head, feature): zero,
    since ``K-bar = scale * S-bar^T Q`` and every row of ``S-bar`` sums to zero."""
    import torch

    if dk_exp.numel() == 0:
        return Peak("grad_k", "key_sum", 0.0)
    wide = torch.float64 if dk_exp.dtype == torch.float64 else torch.float32
    d = dk_exp.to(wide)
    ratio = d.sum(dim=2).abs() / (d.abs().sum(dim=2) + torch.finfo(wide).tiny)  # [B, Nh, Dh]
    value = float(ratio.amax())
    return Peak("grad_k", "key_sum", value)


def _compare(stage: str, against: str, got: "Tensor", ref: "Tensor", rtol: float, atol: float, *,
             spans: tuple[tuple[int, int], ...] = (), grid: bool = True, keys: bool = False) -> Agreement:
    """One gradient against a reference, atol scaled by the reference's largest value; located when outside.

    In float32 arithmetic (float64 for float64 runs): whole gradients are large, and rounding the
    reference to float32 moves it by about 1e-7 of its values, far below any tolerance here.
    """
    import torch

    if got.shape != ref.shape or not got.numel():
        a = M.agreement(stage, "pipeline", against, got, ref, rtol, atol, 0, 0 if grid else None)
    else:
        wide = torch.float64 if got.dtype == torch.float64 else torch.float32
        g, r = got.to(wide), ref.to(wide)
        d = torch.sub(g, r).abs_()  # [..]
        diff = float(d.amax())
        size = max(1.0, M.max_abs(r))
        excess = math.nan if math.isnan(diff) else float(d.sub_(r.abs().mul_(rtol)).amax()) - atol * size
        where = None
        if math.isnan(excess) or excess > 0:
            where = M.where_in(M.excess_index(got, ref, rtol), 0, 0 if grid else None)
        a = Agreement(stage, "pipeline", against, diff, excess, where=where)
    return located(a, spans, keys)


def located(a: Agreement, spans: tuple[tuple[int, int], ...], keys: bool) -> Agreement:
    """A measured location as what it is: a key (K-bar, V-bar) or a sampled row as the query it is."""
    if a.where is None:
        return a
    if keys:
        return Agreement(**{**a.__dict__, "where": key_at(a.where)})
    if spans:  # a row of the sample, as the query it is
        row = a.where.query
        for r0, r1 in spans:
            if row < r1 - r0:
                return Agreement(**{**a.__dict__, "where": M.Where(a.where.example, a.where.head, r0 + row, a.where.key)})
            row -= r1 - r0
    return a


# --- gradcheck: the hand backward against central differences of the pipeline's forward ------------

def gradcheck(ops: Any, q: "Tensor", k: "Tensor", v: "Tensor", grad_context: "Tensor", allow: "Tensor | None",
              scale: float, empty_zero: bool, rotation: Rotation | None, softcap: float | None = None) -> dict[str, Check]:
    """The pipeline's hand backward, run in float64, against central differences of its own forward.

    ``L = sum(context * O-bar)``; for up to GRADCHECK_MAX coordinates of each of q, k, v (all of them
    when there are no more), ``(L(x + h) - L(x - h)) / 2h`` with ``h`` = GRADCHECK_STEP against the
    analytic gradient, within GRADCHECK_TOL.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k, v: ``[B, Nkv, Tk, *]`` (before rotation and kv expansion).

    Returns:
        ``{"grad_q": check, "grad_k": check, "grad_values": check}`` (level 4, ``gradcheck``).
    """
    import torch

    from attn_ledger.maths.pipeline import attend, attend_backward, reduce_kv

    x = [t.detach().to(torch.float64).contiguous() for t in (q, k, v)]
    go = grad_context.detach().to(torch.float64)
    nh, n_kv = q.shape[1], k.shape[1]
    back = Backward.__new__(Backward)  # only for its unrotation
    back.rotation = rotation

    def forward(qq: "Tensor", kk: "Tensor", vv: "Tensor") -> tuple[float, dict[str, "Tensor"], tuple]:
        qr, kr, vr = (qq, kk, vv) if rotation is None else ops.rope(qq, kk, vv, rotation.spec, rotation.q_start)
        ke, ve = ops.expand(kr, nh), ops.expand(vr, nh)
        st = attend(ops, qr, ke, ve, allow, scale, empty_zero)
        return float((st["context"] * go).sum()), st, (qr, ke, ve)

    try:
        _, st, (qr, ke, ve) = forward(*x)
        g = attend_backward(ops, go, qr, ke, ve, st["weights"], scale)
        if softcap is not None:  # through the cap's slope to the scaled scores
            gsc = cap_chain(g["grad_scores"], st["masked_scores"], softcap)
            g = {**g, "grad_q": ops.grad_q(gsc, ke, scale), "grad_k": ops.grad_k(gsc, qr, scale)}
        analytic = back._unrotated(g["grad_q"], reduce_kv(g["grad_k"], n_kv), reduce_kv(g["grad_values"], n_kv))
        return {name: _coordinates(name, i, x, analytic[i], forward) for i, name in
                enumerate(("grad_q", "grad_k", "grad_values"))}
    except Exception as exc:  # a stage that raises here raised in the run already, where it is the finding
        return {name: Check(4, "gradcheck", "fail", reason=f"raised {type(exc).__name__}: {str(exc)[:200]}")
                for name in ("grad_q", "grad_k", "grad_values")}


def _coordinates(name: str, which: int, x: list["Tensor"], analytic: "Tensor", forward: Callable) -> Check:
    """Central differences on evenly spread coordinates of input ``which`` against ``analytic``."""
    n = x[which].numel()
    count = min(n, GRADCHECK_MAX)
    picks = sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})  # evenly spread, all when few
    worst, at = 0.0, None
    for idx in picks:
        plus, minus = (t.clone() for t in (x[which], x[which]))
        plus.view(-1)[idx] += GRADCHECK_STEP
        minus.view(-1)[idx] -= GRADCHECK_STEP
        lp = forward(*[plus if i == which else t for i, t in enumerate(x)])[0]
        lm = forward(*[minus if i == which else t for i, t in enumerate(x)])[0]
        diff = abs((lp - lm) / (2 * GRADCHECK_STEP) - float(analytic.reshape(-1)[idx]))
        if math.isnan(diff) or diff > worst:
            worst, at = diff, idx
            if math.isnan(diff):
                break
    where = None if at is None or worst <= GRADCHECK_TOL else dict(zip(("example", "head", "row", "feature"),
                                                                        M.unravel(at, tuple(x[which].shape))))
    return bounded(4, "gradcheck", "max |analytic - central difference| (float64)", worst, GRADCHECK_TOL,
                   location=where, data={"coordinates": len(picks), "of": n, "step": GRADCHECK_STEP, "of_tensor": name})
