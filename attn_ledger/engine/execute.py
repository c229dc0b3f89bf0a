"""Execution: run a plan block by block through the stage functions and yield measurements.

For each query block of the :class:`~attn_ledger.engine.plan.Plan`, the stages
``scores -> masked_scores -> weights -> context`` run through the pipeline's stage
functions (an ``Ops`` bundle) on the block's key range, and each stage yields its
measurements (:mod:`~attn_ledger.engine.measure`) as soon as it has run. A stage that
raises or returns the wrong shape yields :class:`~attn_ledger.engine.measure.Broken` and the
run stops there. Nothing here judges: tolerances enter only where a measurement is an
excess over one, and to decide whether a violation is worth locating.

The references:

* float64 (float32 where the device has none) runs once, before the blocks, on every
  sampled row; the pipeline's values on those rows are gathered block by block
  (:class:`Sample`) and compared with it once per stage, after the blocks;
* F.scaled_dot_product_attention runs on every row, a group of blocks per call (or one
  ``is_causal`` call on the whole input), and is compared group by group;
* every dtype's scores, weights and context on the sampled rows are judged against float64 by
  the rounding rule (:mod:`attn_ledger.engine.rounding`); in half precision the plain same-dtype
  reference on the sampled rows still measures the rounding error SDPA's factor rule allows for;
* with ``backends``, each pinned SDPA backend repeats the context comparison.

With a soft-cap, every reference caps the scaled scores before the mask; SDPA, which has no
cap, is handed the capped scores as its additive mask with q zeroed (:func:`sdpa_capped`). With
attention sinks (one logit per head, in the denominator only), every reference counts them; SDPA
gets them as one more column of that additive mask, over a zero key and value.

The engine runs in inference mode, which spares its many small operations the autograd
bookkeeping; the context it fills is allocated outside, so it is an ordinary tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from attn_ledger import tolerance
from attn_ledger.devices import reference_dtype
from attn_ledger.engine import measure as M
from attn_ledger.engine.backends import sdpa_capped
from attn_ledger.engine import plan as P
from attn_ledger.engine import rounding
from attn_ledger.engine.measure import Agreement, Broken, Measure, Peak
from attn_ledger.maths.pipeline import apply_mask, sink_share

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.maths.relations import Relation

ProgressFn = Callable[[int, int], None]
# Reference-dtype K and V held at once: a few query heads' worth, cast and used while still in
# cache. At (1, 32, 2048, 128) casting all of K and V first took 173 ms of CPU, 4 MiB chunks 44 ms.
REF_CHUNK_BYTES = 1 << 22


@dataclass
class _BlockState:
    """One block's tensors and layout while it runs through the stages."""

    blk: P.Block
    lay: P.Layout
    qb: "Tensor"  # [B, Nh, rows, Dh]
    kb: "Tensor"  # [B, Nh, kw, Dh]
    vb: "Tensor"  # [B, Nh, kw, Dv]
    ai: "Tensor | None"  # intended relation on the key range, [B|1, Nh|1, rows, kw]
    ap: "Tensor | None"  # the pipeline's relation on the key range
    live: "Tensor | None"  # [B, Nh, rows]: queries with an allowed key; None when all have one
    ref: "dict[str, Tensor] | None" = None  # the float64 reference on the block's sampled rows
    plain: "dict[str, Tensor] | None" = None  # the plain same-dtype reference there (half precision)
    forbid: "Tensor | None" = None  # ~ai on the band
    mags: "dict[str, Tensor] | None" = None  # the rounding rule's M on the sampled rows (given tensors)
    clean: bool = False  # every score finite

    @property
    def rows(self) -> slice:
        a, z = self.blk.sample or (0, 0)
        return slice(a, z)


class Execution:
    """One run of a plan; :meth:`run` yields the measurements.

    Args:
        q: ``[B, Nh, Tq, Dh]``; k_exp, v_exp: ``[B, Nh, Tk, Dh]``, ``[B, Nh, Tk, Dv]`` (kv heads expanded).
        ref: the reference's Q, K, V (``[B, Nkv|Nh, Tk, *]``, any dtype); cast to the reference
            dtype on the sampled rows, kv heads repeated by the reference's own code.
        given: the user's own ``scores`` / ``weights`` / ``out``, shaped as the derived grid / context.
        backends: ``(name, dtype)`` pairs of pinned SDPA backends to compare the context with.

    After :meth:`run`: ``context`` (the pipeline's, or None if a stage broke), ``sdpa_context``,
    ``ref_context`` (``{(r0, r1): [B, Nh, rows, Dv]}`` per sampled span), ``kept`` (whole-grid
    pieces per stage when the plan keeps them) and ``loose_range`` (some block's value-range
    check used the block's key range, not each query's).
    """

    def __init__(self, plan: P.Plan, relation: "Relation", ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor",
                 ref: tuple["Tensor", "Tensor", "Tensor"], *, scale: float, ref_scale: float, empty_zero: bool,
                 given: "dict[str, Tensor] | None" = None, backends: tuple[tuple[str, "torch.dtype"], ...] = (),
                 progress: ProgressFn | None = None, softcap: float | None = None,
                 sinks: "Tensor | None" = None, bias: "Tensor | None" = None) -> None:
        import torch

        self.plan, self.relation, self.ops, self.softcap, self.sinks = plan, relation, ops, softcap, sinks
        self.bias = bias  # [B|1, Nh|1, Tq, Tk] added to the scores stage, or None
        self.q, self.k_exp, self.v_exp, self.ref = q, k_exp, v_exp, ref
        self.scale, self.ref_scale, self.empty_zero = scale, ref_scale, empty_zero
        self.given, self.backends, self.progress = given or {}, backends, progress
        self.dtype = q.dtype
        self.dtype_name = tolerance.dtype_name(q.dtype)
        self.half = tolerance.is_half(q.dtype)
        self.rtol, self.atol = tolerance.reference(q.dtype)
        self.sum_limit = tolerance.row_sum(q.dtype)
        self.headroom = math.log(torch.finfo(q.dtype).max)  # exp overflows the run's dtype above this score
        self.dv = v_exp.shape[-1]
        self.context: "Tensor | None" = torch.empty(plan.b, plan.nh, plan.tq, self.dv, dtype=q.dtype, device=q.device)
        self.sdpa_context: "Tensor | None" = None
        self.ref_context: dict[tuple[int, int], "Tensor"] = {}
        self.kept: dict[str, list["Tensor"]] = {}
        self.loose_range = False

    def run(self) -> Iterator[Measure]:
        """Every block through every stage, then the float64 sample's comparisons; stops at a broken stage."""
        import torch

        with torch.inference_mode():
            if self.progress is not None:  # shown from here on, through SDPA's whole-input call, long on long inputs
                self.progress(0, len(self.plan.blocks))
            self._start()
            for blk in self.plan.blocks:
                if not (yield from self._block(blk)):
                    self.context = None
                    break
                if self.progress is not None:
                    self.progress(blk.index + 1, len(self.plan.blocks))
            yield from self.sample.agreements(self.rtol, self.atol)

    def _start(self) -> None:
        """The float64 reference on every sampled row, the SDPA output buffer, and per-chunk value ranges."""
        import torch
        import torch.nn.functional as F

        plan, (q_ref, k_ref, v_ref) = self.plan, self.ref
        ref_dtype = reference_dtype(self.q.device)
        empty = "zeros" if self.empty_zero else "nan"
        rule = ref_dtype == torch.float64  # the rounding rule, half precision included
        ref, mags = sampled_reference(q_ref, k_ref, v_ref, self.relation, plan, self.ref_scale, empty, ref_dtype,
                                      self.softcap, self.sinks, (self.q, self.k_exp, self.v_exp) if rule else None,
                                      self.bias)
        self.sample = Sample(ref, plan.reference_spans)
        if mags is not None:
            self.sample.mags, self.sample.dtype = mags, self.dtype_name
        if self.sdpa_whole_causal:
            # the intended relation is exactly causal: SDPA gets it as is_causal on the whole input, once
            self.sdpa_context = F.scaled_dot_product_attention(self.q, self.k_exp, self.v_exp, dropout_p=0.0,
                                                               is_causal=True, scale=self.ref_scale)
        else:  # filled group by group
            self.sdpa_context = torch.empty(plan.b, plan.nh, plan.tq, self.dv, dtype=self.dtype, device=self.q.device)
        self.chunks = M.value_chunks(self.v_exp) if plan.value_chunks else None

    @property
    def sdpa_whole_causal(self) -> bool:
        """SDPA runs once on the whole input with is_causal (not with a cap: it is then given the capped scores)."""
        return self.plan.sdpa_whole_causal and self.softcap is None and self.sinks is None and self.bias is None

    def _bias_of(self, q0: int, q1: int, lo: int, hi: int) -> "Tensor | None":
        """The bias on query rows ``q0:q1`` and keys ``lo:hi``, in the run's dtype (None without one)."""
        if self.bias is None:
            return None
        b = self.bias if self.bias.shape[-2] == 1 else self.bias[..., q0:q1, :]
        return b[..., lo:hi].to(self.dtype)

    def _block(self, blk: P.Block) -> Iterator[Measure]:
        """One block through the four stages; returns False when a stage broke."""
        t = self._state(blk)
        s = yield from self._scores(t)
        m = None if s is None else (yield from self._masked(t, s))
        w = None if m is None else (yield from self._weights(t, m))
        c = None if w is None else (yield from self._context(t, w))
        if c is None:
            return False
        if self.plan.keep:
            for name, x in (("scores", s), ("masked_scores", m), ("weights", w)):
                self.kept.setdefault(name, []).append(x)
        return True

    def _state(self, blk: P.Block) -> _BlockState:
        """The block's relation (intended and applied), layout, inputs and reference rows."""
        from attn_ledger.maths.reference import reference_stages

        plan = self.plan
        allow_i = self.relation.block(blk.q0, blk.q1)  # intended, [B|1, Nh|1, rows, Tk]
        allow_p = self.ops.polarity(allow_i)  # what the pipeline applies
        lay = blk.layout if allow_p is allow_i else P.layout(self.relation, allow_i, allow_p, blk.q0, blk.q1, plan.tk,
                                                             plan.full_keys, plan.width_step)
        lo, hi = lay.lo, lay.hi
        ai = None if allow_i is None else allow_i[..., lo:hi]
        t = _BlockState(blk, lay, self.q[:, :, blk.q0:blk.q1], self.k_exp[:, :, lo:hi], self.v_exp[:, :, lo:hi], ai,
                        None if allow_p is None else allow_p[..., lo:hi],
                        None if lay.all_live else ai.any(dim=-1).expand(plan.b, plan.nh, blk.rows))
        if blk.sample is not None:
            a, z = blk.sample
            at = slice(blk.sample_at, blk.sample_at + z - a)
            ref_all = self.sample.ref
            t.ref = {"out": ref_all["out"][:, :, at]}  # [B, Nh, z - a, Dv]
            if self.sinks is not None:
                t.ref["sink_share"] = ref_all["sink_share"][:, :, at]  # [B, Nh, z - a]
            self.ref_context[(blk.q0 + a, blk.q0 + z)] = t.ref["out"]
            if self.half or self.given or self.backends:  # compared block by block: the block's key range
                for key in ("scores", "masked_scores", "weights"):
                    t.ref[key] = ref_all[key][:, :, at, lo:hi]  # [B, Nh, z - a, kw]
            mags = self.sample.mags
            if self.given and mags is not None:  # the given tensors are judged by the rounding rule too
                t.mags = {"scores": mags["scores"][:, :, at, lo:hi], "weights": mags["weights"][:, :, at, lo:hi],
                          "out": mags["out"][:, :, at]}
            if self.half:
                t.plain = reference_stages(t.qb[:, :, a:z], t.kb, t.vb, allow_mask=self._ai_rows(t), scale=self.ref_scale,
                                           empty_rows="zeros" if self.empty_zero else "nan", dtype=self.dtype,
                                           softcap=self.softcap, sinks=self.sinks,
                                           bias=self._bias_of(blk.q0 + a, blk.q0 + z, lo, hi))
        return t

    @staticmethod
    def _ai_rows(t: _BlockState) -> "Tensor | None":
        """The intended relation on the block's sampled rows."""
        return None if t.ai is None else (t.ai[:, :, t.rows] if t.ai.shape[2] > 1 else t.ai)

    def _scores(self, t: _BlockState) -> Iterator[Measure]:
        blk, lay = t.blk, t.lay
        grid = (self.plan.b, self.plan.nh, blk.rows, lay.width)
        try:
            s = self.ops.scores(t.qb, t.kb, self.scale)  # [B, Nh, rows, kw]
            if self.bias is not None:
                s = s + self._bias_of(blk.q0, blk.q1, lay.lo, lay.hi)  # the additive bias joins the scores
        except Exception as exc:  # a stage that raises is a level-1 divergence at that stage
            yield Broken("scores", raised=exc)
            return None
        if tuple(s.shape) != grid:
            yield Broken("scores", shape=tuple(s.shape), expected=grid)
            return None
        found, t.clean = M.scores(s, t.ai, lay.band, self.headroom, blk.q0, lay.lo)
        yield from found
        if t.ref is not None:
            self.sample.put("scores", blk.sample_at, s[:, :, t.rows], lay.lo, lay.hi)
            if t.plain is not None:
                yield M.error("scores", "plain", t.plain["scores"], t.ref["scores"], dtype=self.dtype_name)
            if "scores" in self.given:
                a, z = blk.sample
                us = self.given["scores"][:, :, blk.q0 + a:blk.q0 + z]
                if t.mags is not None:
                    yield rounding.agreement("scores", "given", us[..., lay.lo:lay.hi], t.ref["scores"],
                                             t.mags["scores"], self.dtype_name, blk.q0 + a, lay.lo)
                else:
                    yield M.agreement("scores", "given", "float64", us, t.ref["scores"], self.rtol, self.atol,
                                      blk.q0 + a, 0)
        return s

    def _masked(self, t: _BlockState, s: "Tensor") -> Iterator[Measure]:
        """Masked scores: the mask function runs on the key columns where the pipeline's relation is
        not all-allowed; on the others masking is the identity, so those columns of the scores are
        kept as they are (and were screened finite at the scores stage)."""
        import torch

        blk, lay = t.blk, t.lay
        (v0, v1), (p0, p1) = lay.band, lay.pipe_band
        try:
            m = s.clone() if self.plan.keep else s  # [B, Nh, rows, kw]; s itself is not used again
            if p1 > p0 and t.ap is not None and self.ops.mask is apply_mask:
                # the built-in mask's values, written into the band in place: no second copy of the band
                band = m[..., p0:p1]
                torch.where(t.ap[..., p0:p1], band, torch.full((), -math.inf, dtype=band.dtype, device=band.device),
                            out=band)
                band_out = None
            else:
                band_out = self.ops.mask(s[..., p0:p1], t.ap[..., p0:p1]) if p1 > p0 else None
        except Exception as exc:
            yield Broken("masked_scores", raised=exc)
            return None
        if band_out is not None:
            if tuple(band_out.shape) != tuple(s[..., p0:p1].shape):  # never let a wrong shape broadcast in
                yield Broken("masked_scores", shape=(*band_out.shape[:-1], lay.width),
                             expected=(self.plan.b, self.plan.nh, blk.rows, lay.width))
                return None
            m[..., p0:p1] = band_out
        u0, u1 = (v0, v1) if p1 <= p0 else ((p0, p1) if v1 <= v0 else (min(v0, p0), max(v1, p1)))
        t.forbid = None if t.ai is None or v1 <= v0 else ~t.ai[..., v0:v1]  # [B|1, Nh|1, rows, v1 - v0]
        yield from M.mask_counts(m, t.ai, t.live, self.empty_zero, (u0, u1), self.plan.tk, blk.q0, lay.lo,
                                 outside_clean=t.clean, forbid=t.forbid if (u0, u1) == (v0, v1) else None)
        return m

    def _weights(self, t: _BlockState, m: "Tensor") -> Iterator[Measure]:
        blk, lay = t.blk, t.lay
        try:
            w = self.ops.softmax(m, t.ap, self.empty_zero)  # [B, Nh, rows, kw]
        except Exception as exc:
            yield Broken("weights", raised=exc)
            return None
        grid = (self.plan.b, self.plan.nh, blk.rows, lay.width)
        if tuple(w.shape) != grid:
            yield Broken("weights", shape=tuple(w.shape), expected=grid)
            return None
        share = None if self.sinks is None else sink_share(m, self.sinks)  # [B, Nh, rows], from the pipeline's scores
        yield from M.weight_invariants("weights", "pipeline", w, t.ai, t.live, self.empty_zero, self.sum_limit, blk.q0,
                                       lay.lo, band=lay.band, count_nonfinite=True, forbid=t.forbid, extra=share)
        if t.ref is not None:
            self.sample.put("weights", blk.sample_at, w[:, :, t.rows], lay.lo, lay.hi)
            if share is not None:
                yield M.sink_share_error(w[:, :, t.rows], t.ref["sink_share"], blk.q0 + t.rows.start)
            if t.plain is not None:
                yield M.error("weights", "plain", t.plain["weights"], t.ref["weights"], dtype=self.dtype_name)
        if "weights" in self.given:
            uw = self.given["weights"][:, :, blk.q0:blk.q1]  # [B, Nh, rows, Tk]
            yield M.nonfinite("weights", uw, "given", blk.q0, 0)
            yield from M.weight_invariants("weights", "given", uw, t.ai, t.live, self.empty_zero, self.sum_limit,
                                           blk.q0, 0, extra=share)
            if t.ref is not None and t.mags is not None:
                yield rounding.agreement("weights", "given", uw[:, :, t.rows, lay.lo:lay.hi], t.ref["weights"],
                                         t.mags["weights"], self.dtype_name, blk.q0 + t.rows.start, lay.lo)
            elif t.ref is not None:
                yield M.agreement("weights", "given", "float64", uw[:, :, t.rows], t.ref["weights"], self.rtol,
                                  self.atol, blk.q0 + t.rows.start, 0)
        return w

    def _context(self, t: _BlockState, w: "Tensor") -> Iterator[Measure]:
        blk, lay, plan = t.blk, t.lay, self.plan
        try:
            c = self.ops.mix(w, t.vb)  # [B, Nh, rows, Dv]
        except Exception as exc:
            yield Broken("context", raised=exc)
            return None
        want = (plan.b, plan.nh, blk.rows, self.dv)
        if tuple(c.shape) != want:
            yield Broken("context", shape=tuple(c.shape), expected=want)
            return None
        self.context[:, :, blk.q0:blk.q1] = c
        span = None if self.chunks is None else M.value_span(self.v_exp, self.chunks, lay.lo, lay.hi)
        vb, ai = t.vb, t.ai
        if self.sinks is not None:  # the sink mixes a zero value: the range of the value rows and zero
            vb, ai, span = M.with_zero_value(vb, ai)
        value, idx = M.range_excess(c, vb, ai, self.rtol, self.atol, span=span)
        yield Peak("context", "range_excess", value, where=M.where_in(idx, blk.q0, None))
        self.loose_range = self.loose_range or (t.ai is not None and not M.exact_range(c, lay.width, t.ai))
        yield from self._sdpa(blk)
        sd = self.sdpa_context[:, :, blk.q0:blk.q1]  # [B, Nh, rows, Dv]
        if t.ref is not None:
            self.sample.put("out", blk.sample_at, c[:, :, t.rows])
            if self.half and t.plain is not None:
                yield M.error("context", "plain", t.plain["out"], t.ref["out"], dtype=self.dtype_name)
                yield M.error("context", "sdpa", sd[:, :, t.rows], t.ref["out"])
        if "out" in self.given:
            yield from self._given_out(t, sd, span)
        if self.backends:
            yield from self._backends(t, c)
        return c

    def _sdpa(self, blk: P.Block) -> Iterator[Measure]:
        """SDPA on a group of blocks at once (its kernel is faster on more rows), compared once the group is done."""
        import torch.nn.functional as F

        start = self.plan.group_starting_at(blk.index)
        if start is not None and not self.sdpa_whole_causal:
            allow = self.relation.block(start.q0, start.q1)  # [B|1, Nh|1, rows, Tk]
            lo, hi = P.key_hull(allow, self.plan.tk)
            mask = None if allow is None else allow[..., lo:hi]
            qb, kb, vb = self.q[:, :, start.q0:start.q1], self.k_exp[:, :, lo:hi], self.v_exp[:, :, lo:hi]
            self.sdpa_context[:, :, start.q0:start.q1] = (
                F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=0.0, scale=self.ref_scale)
                if self.softcap is None and self.sinks is None and self.bias is None
                else sdpa_capped(qb, kb, vb, mask, self.ref_scale, self.softcap, self.sinks,
                                 self._bias_of(start.q0, start.q1, lo, hi)))
        end = self.plan.group_ending_at(blk.index)
        if end is not None:
            blocks = [(b.q0, b.q1) for b in self.plan.blocks[end.first:end.end]]
            yield from M.sdpa_group(self.context, self.sdpa_context, blocks, self.rtol, self.atol)

    def _given_out(self, t: _BlockState, sd: "Tensor", span: Any) -> Iterator[Measure]:
        blk = t.blk
        uo = self.given["out"][:, :, blk.q0:blk.q1]  # [B, Nh, rows, Dv]
        yield M.nonfinite("context", uo, "given", blk.q0, None)
        vb, ai = t.vb, t.ai
        if self.sinks is not None:
            vb, ai, span = M.with_zero_value(vb, ai)
        value, idx = M.range_excess(uo, vb, ai, self.rtol, self.atol, span=span)
        yield Peak("context", "range_excess", value, "given", M.where_in(idx, blk.q0, None))
        if not self.half:  # SDPA covers every row, also those the float64 sample leaves out
            yield M.agreement("context", "given", "sdpa", uo, sd, self.rtol, self.atol * max(1.0, M.max_abs(sd)),
                              blk.q0, None)
        if t.ref is not None and t.mags is not None:
            yield rounding.agreement("context", "given", uo[:, :, t.rows], t.ref["out"], t.mags["out"], self.dtype_name,
                                     blk.q0 + t.rows.start, None)
        elif t.ref is not None:
            ref_out = t.ref["out"]
            yield M.agreement("context", "given", "float64", uo[:, :, t.rows], ref_out, self.rtol,
                              self.atol * max(1.0, M.max_abs(ref_out)), blk.q0 + t.rows.start, None)

    def _backends(self, t: _BlockState, c: "Tensor") -> Iterator[Measure]:
        """The context comparison once per pinned (backend, dtype), on every block and again on the sampled rows."""
        from attn_ledger.maths.reference import repeat_kv

        yield from backend_measures(self.backends, c, (t.qb, t.kb, t.vb), None, t.ai, self.ref_scale, None, self.dtype,
                                    t.blk.q0, self.softcap)
        if t.ref is not None:
            a, z = t.blk.sample
            q0, lo, hi, nh = t.blk.q0, t.lay.lo, t.lay.hi, self.plan.nh
            q_ref, k_ref, v_ref = self.ref
            ref_in = (q_ref[:, :, q0 + a:q0 + z], repeat_kv(k_ref[:, :, lo:hi], nh), repeat_kv(v_ref[:, :, lo:hi], nh))
            yield from backend_measures(self.backends, c[:, :, a:z], (t.qb[:, :, a:z], t.kb, t.vb), ref_in,
                                        self._ai_rows(t), self.ref_scale, t.ref, self.dtype, q0 + a, self.softcap)


def backend_measures(backends: tuple[tuple[str, "torch.dtype"], ...], c: "Tensor",
                     pipe_in: tuple["Tensor", "Tensor", "Tensor"], ref_in: "tuple[Tensor, Tensor, Tensor] | None",
                     ai: "Tensor | None", scale: float, ref: "dict[str, Tensor] | None", run_dtype: "torch.dtype",
                     q0: int, softcap: float | None = None) -> Iterator[Agreement]:
    """The L4 context comparison once per (backend, dtype).

    In the run's dtype: float32/float64 compare the pipeline's context with the pinned backend
    (tolerance as ``matches_sdpa``); half precision measures the backend's error against the
    float64 reference (judged by the factor rule against the pipeline's plain error). In another
    dtype (small grids), the backend runs on the reference's inputs cast to that dtype and its
    output is measured against the float64 reference (sampled rows only), with that dtype's
    plain error beside it in half precision.
    """
    from attn_ledger.engine.backends import sdpa_pinned
    from attn_ledger.maths.reference import reference_stages

    for name, dt in backends:
        dn, half = tolerance.dtype_name(dt), tolerance.is_half(dt)
        against = "pipeline" if dt == run_dtype and not half else "float64"
        if dt != run_dtype and ref_in is None:
            continue  # other dtypes are measured on the float64-sampled rows only
        if against == "float64" and ref is None:
            continue
        qb, kb, vb = (x.to(dt) for x in (pipe_in if dt == run_dtype else ref_in))
        try:
            out = (sdpa_pinned(name, qb, kb, vb, ai, scale) if softcap is None  # [B, Nh, rows, Dv]
                   else sdpa_pinned(name, qb, kb, vb, ai, scale, softcap))
        except Exception:  # passed the probe but not this block (e.g. a mask shape): count it as failing
            yield Agreement("context", "sdpa", against, math.nan, math.nan, backend=name, dtype=dn)
            continue
        rtol, atol = tolerance.reference(dt)
        if against == "pipeline":
            yield M.agreement("context", "sdpa", "pipeline", c, out, rtol, atol * max(1.0, M.max_abs(out)), q0, None,
                              backend=name, dtype=dn)
        elif half:
            yield M.error("context", "sdpa", out, ref["out"], backend=name, dtype=dn)
            if dt != run_dtype:  # in the run's dtype the pipeline's own plain error serves
                plain = reference_stages(qb, kb, vb, allow_mask=ai, scale=scale,
                                         empty_rows="zeros" if ai is not None else "nan", dtype=dt, softcap=softcap)["out"]
                yield M.error("context", "plain", plain, ref["out"], dtype=dn)
        else:
            yield Agreement("context", "sdpa", "float64", M.excess(out, ref["out"], 0, 0)[0],
                            M.excess(out, ref["out"], rtol, atol * max(1.0, M.max_abs(ref["out"])))[1], backend=name, dtype=dn)


# --- one block through the pipeline, unmeasured (replay and the backward's recompute) ---------------

def block_stages(ops: Any, qb: "Tensor", kb: "Tensor", ap: "Tensor | None", pipe_band: tuple[int, int], scale: float,
                 empty_zero: bool) -> tuple["Tensor", "Tensor"]:
    """A block's scores and weights through the pipeline's stage functions, as :class:`Execution` runs them.

    The mask function runs on the band where the pipeline's relation is not all-allowed, as in
    :meth:`Execution._masked`, so a replay gives the same bits. Returns the masked scores and the
    weights, ``[B, Nh, rows, kw]`` each.
    """
    p0, p1 = pipe_band
    s = ops.scores(qb, kb, scale)  # [B, Nh, rows, kw]
    if p1 > p0:
        s[..., p0:p1] = ops.mask(s[..., p0:p1], ap[..., p0:p1])
    return s, ops.softmax(s, ap, empty_zero)  # [B, Nh, rows, kw] each


def block_layout(plan: P.Plan, relation: "Relation", ops: Any, blk: P.Block) -> tuple[P.Layout, "Tensor | None", "Tensor | None"]:
    """A block's layout under the relation the pipeline applies, the intended relation and the applied one."""
    allow_i = relation.block(blk.q0, blk.q1)  # intended, [B|1, Nh|1, rows, Tk]
    allow_p = ops.polarity(allow_i)  # what the pipeline applies
    lay = blk.layout if allow_p is allow_i else P.layout(relation, allow_i, allow_p, blk.q0, blk.q1, plan.tk,
                                                         plan.full_keys, plan.width_step)
    return lay, allow_i, allow_p


def replay_context(plan: P.Plan, relation: "Relation", ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor",
                   scale: float, empty_zero: bool) -> "Tensor":
    """The context ``[B, Nh, Tq, Dv]`` computed again, block by block with the same key ranges, unmeasured."""
    import torch

    out = torch.empty(plan.b, plan.nh, plan.tq, v_exp.shape[-1], dtype=q.dtype, device=q.device)
    with torch.inference_mode():
        for blk in plan.blocks:
            lay, _, allow_p = block_layout(plan, relation, ops, blk)
            lo, hi = lay.lo, lay.hi
            ap = None if allow_p is None else allow_p[..., lo:hi]
            _, w = block_stages(ops, q[:, :, blk.q0:blk.q1], k_exp[:, :, lo:hi], ap, lay.pipe_band, scale, empty_zero)
            out[:, :, blk.q0:blk.q1] = ops.mix(w, v_exp[:, :, lo:hi])
    return out


# --- the float64 reference on the sampled rows ----------------------------------------------

class Sample:
    """The pipeline's scores, weights and context on the reference-sampled rows, gathered over
    blocks and compared with the reference once per stage.

    ``got`` starts as a copy of the reference, so key columns a block did not compute (outside
    its key range, where every sampled query is forbidden) compare equal; each block writes
    its own columns over it. The tolerance follows the whole-grid rule: atol scaled by the
    largest |reference value| of the sampled rows; for the scores, of the allowed pairs only,
    so that a forbidden key holding garbage (a padded position, say) cannot loosen it.
    """

    KEYS = (("scores", "scores"), ("weights", "weights"), ("out", "context"))

    def __init__(self, ref: dict[str, "Tensor"], spans: tuple[tuple[int, int], ...] = ()) -> None:
        self.ref = ref
        self.spans = spans  # absolute query rows of the sample, in order
        self.got = {key: ref[key].clone() for key, _ in self.KEYS}
        self.filled = {key: 0 for key, _ in self.KEYS}  # rows written so far, block after block
        self.mags: dict[str, "Tensor"] | None = None  # M of each stage on the sampled rows (the rounding rule)
        self.dtype = "float32"  # the run's dtype, for the rounding rule's eps and c

    def put(self, key: str, at: int, t: "Tensor", lo: int = 0, hi: int | None = None) -> None:
        dst = self.got[key][:, :, at:at + t.shape[2]]
        (dst if key == "out" else dst[..., lo:hi]).copy_(t)
        self.filled[key] = at + t.shape[2]

    def agreements(self, rtol: float, atol: float) -> list[Agreement]:
        import torch

        found = []
        for key, stage in self.KEYS:
            n = self.filled[key]
            if not n:
                continue
            got, ref = self.got[key][:, :, :n], self.ref[key][:, :, :n]
            if self.mags is not None:  # elementwise within c * eps * M
                a = rounding.agreement(stage, "pipeline", got, ref, self.mags[key][:, :, :n], self.dtype, 0,
                                       None if key == "out" else 0)
                found.append(a if a.where is None else Agreement(**{**a.__dict__, "where": self._absolute(a.where)}))
                continue
            if key == "scores":
                masked = self.ref["masked_scores"][:, :, :n]  # -inf on forbidden pairs
                size = M.max_abs(torch.where(torch.isneginf(masked), 0.0, masked))
            else:
                size = M.max_abs(ref)
            a = M.agreement(stage, "pipeline", "float64", got, ref, rtol, atol if key == "weights" else atol * max(1.0, size),
                            0, None if key == "out" else 0)
            found.append(a if a.where is None else Agreement(**{**a.__dict__, "where": self._absolute(a.where)}))
        return found

    def _absolute(self, where: M.Where) -> M.Where:
        """A row of the sample as the query it is."""
        row = where.query
        for r0, r1 in self.spans:
            if row < r1 - r0:
                return M.Where(where.example, where.head, r0 + row, where.key)
            row -= r1 - r0
        return where


def sampled_reference(q: "Tensor", k: "Tensor", v: "Tensor", relation: "Relation", plan: P.Plan, scale: float,
                      empty: str, dtype: "torch.dtype", softcap: float | None = None, sinks: "Tensor | None" = None,
                      pipeline: "tuple[Tensor, Tensor, Tensor] | None" = None, bias: "Tensor | None" = None
                      ) -> tuple[dict[str, "Tensor"], dict[str, "Tensor"] | None]:
    """The reference's stages for every sampled row, over every key, in one call, and with ``pipeline``
    the rounding rule's ``M`` of each stage on the same rows.

    One call on all the sampled rows at once keeps the per-call cost of the reference (casts,
    kernel launches) from recurring per block. ``M`` (:func:`rounding.stage_magnitudes`) is computed
    head chunk by head chunk beside the reference, from the reference's own float64 K and V, scores
    and weights, so none of them is computed twice.

    Args:
        pipeline: the pipeline's q, k, v as they enter the scores (kv heads expanded), whose own
            error against the reference's is carried into ``M``; one that is the reference's own
            tensor carries none.
        bias: an additive bias on the scores ``[B|1, Nh|1, Tq|1, Tk]``, or None.

    Returns:
        ``{"scores", "masked_scores", "weights": [B, Nh, R, Tk], "out": [B, Nh, R, Dv]}`` for the R rows
        the plan samples, block after block; and ``{"scores", "weights", "out"}`` of ``M`` shaped alike,
        or None without ``pipeline``.
    """
    spans = plan.reference_spans  # absolute query rows
    allow = sample_allow(relation, spans, k.shape[-2])
    rule = None
    if pipeline is not None:
        pq, pk, pv = pipeline
        dn = tolerance.dtype_name(pq.dtype)
        rule = Rule((None if pq is q else span_rows(pq, spans), None if pk is k else pk, None if pv is v else pv),
                    tolerance.EPS.get(dn, 1.0), tolerance.tiny(dn), rounding.accumulation(dn))
    ref, mags = reference_chunks(span_rows(q, spans), k, v, allow, scale, empty, dtype, softcap, sinks, rule,
                                 bias=span_rows(bias, spans))
    return {key: t for key, t in ref.items() if key != "allow"}, mags


def span_rows(x: "Tensor | None", spans: tuple[tuple[int, int], ...]) -> "Tensor | None":
    """``x`` ``[.., T, D]`` (q, or a bias grid ``[.., Tq, Tk]``) on the query rows of ``spans``, one span after
    another: ``[.., R, D]``. None stays None; a grid of one query row (broadcast over the queries) is kept."""
    import torch

    if x is None or x.shape[-2] == 1:
        return x
    contiguous = all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1))
    return x[..., spans[0][0]:spans[-1][1], :] if contiguous else torch.cat([x[..., r0:r1, :] for r0, r1 in spans], dim=-2)


def sample_allow(relation: "Relation", spans: tuple[tuple[int, int], ...], tk: int) -> "Tensor | None":
    """The intended relation on the sampled rows, one span after another: ``[B|1, Nh|1, R, Tk]``, or None."""
    import torch

    if not relation.parts:
        return None
    parts = []
    for r0, r1 in spans:
        a = relation.block(r0, r1)  # [B|1, Nh|1, rows|1, Tk]
        parts.append(a.expand(a.shape[0], a.shape[1], r1 - r0, tk))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def sample_rows(spans: tuple[tuple[int, int], ...], device: Any = None) -> "Tensor":
    """``[R]``: the absolute query rows of the sample, span after span."""
    import torch

    return torch.cat([torch.arange(r0, r1, device=device) for r0, r1 in spans]) if spans else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class Rule:
    """What the rounding rule's ``M`` needs beside the reference's inputs: the pipeline's q, k, v as they enter
    the scores (kv heads expanded; None where it is the reference's own tensor), and the run dtype's eps,
    smallest normal number and accumulation (:func:`rounding.stage_magnitudes`)."""

    carried: "tuple[Tensor | None, Tensor | None, Tensor | None]"
    eps: float
    tiny: float
    accumulate: float


def reference_block(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float, empty: str,
                    dtype: "torch.dtype", softcap: float | None = None, sinks: "Tensor | None" = None,
                    bias: "Tensor | None" = None) -> dict[str, "Tensor"]:
    """The reference's stages for the sampled rows, a few query heads at a time when K and V are long
    (:func:`reference_chunks` without the rounding rule)."""
    return reference_chunks(q, k, v, allow, scale, empty, dtype, softcap, sinks, bias=bias)[0]


def reference_chunks(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float, empty: str,
                     dtype: "torch.dtype", softcap: float | None = None, sinks: "Tensor | None" = None,
                     rule: Rule | None = None, bias: "Tensor | None" = None
                     ) -> tuple[dict[str, "Tensor"], dict[str, "Tensor"] | None]:
    """The reference's stages for the sampled rows, and with ``rule`` the rounding rule's ``M`` of each stage,
    a few query heads at a time when K and V are long.

    Heads are independent, so chunking over them changes nothing but the size of the
    reference-dtype copies of K and V that exist at once (at most about REF_CHUNK_BYTES, or
    one kv head's): each chunk is cast once and used, by the reference and then by ``M``, while it
    is still in cache.
    """
    import torch

    from attn_ledger.maths.reference import reference_stages

    nh, nkv = q.shape[1], k.shape[1]
    group = nh // nkv  # query heads per kv head
    per_kv_head = k.shape[0] * k.shape[2] * (k.shape[3] + v.shape[3]) * torch.finfo(dtype).bits // 8
    kv_step = max(1, REF_CHUNK_BYTES // max(1, per_kv_head))
    parts: list[dict[str, Tensor]] = []
    mags: list[dict[str, Tensor]] = []
    for j0 in range(0, nkv, kv_step):
        j1 = min(j0 + kv_step, nkv)
        h0, h1 = j0 * group, j1 * group
        whole = j0 == 0 and j1 == nkv
        qc, kc, vc = (q, k, v) if whole else (q[:, h0:h1], k[:, j0:j1], v[:, j0:j1])
        k64, v64 = kc.to(dtype), vc.to(dtype)  # cast once, for the reference and M alike
        owned = k64 is not kc and v64 is not vc  # copies (not the caller's tensors): M may overwrite them
        kc, vc = k64, v64
        a = allow if allow is None or allow.shape[1] == 1 or whole else allow[:, h0:h1]
        sc = sinks if sinks is None or whole else sinks[h0:h1]
        bc = bias if bias is None or bias.shape[1] == 1 or whole else bias[:, h0:h1]
        ref = reference_stages(qc, kc, vc, allow_mask=a, scale=scale, empty_rows=empty, dtype=dtype, softcap=softcap,
                               sinks=sc, bias=bc)
        parts.append(ref)
        if rule is not None:
            carried = rule.carried if whole else tuple(None if c is None else c[:, h0:h1] for c in rule.carried)
            known = (ref["scores"], ref["weights"] if sinks is None else None)  # with sinks, M's weights have none
            m = rounding.stage_magnitudes(qc, kc, vc, a, scale, softcap, carried, rule.eps, rule.tiny, rule.accumulate,
                                          known=known, bias=bc, owned=owned)  # kc, vc not used after it
            mags.append({key: m[key] for key in ("scores", "weights", "out")})
    if len(parts) == 1:
        return parts[0], mags[0] if mags else None
    keys = ("scores", "masked_scores", "weights", "out") + (() if sinks is None else ("sink_share",))
    ref = {key: torch.cat([p[key] for p in parts], dim=1) for key in keys}
    return ref, {key: torch.cat([m[key] for m in mags], dim=1) for key in mags[0]} if mags else None
