"""Judge an attention module's core from what :mod:`attn_ledger.probes.common.observe` saw it compute.

The checks, by level:

* L2 ``head_split``: each head of q, k and v that entered the core is a block of columns of a
  projection output, position by position (:mod:`attn_ledger.probes.module.heads`); a split that moves
  vectors between positions or examples (a reshape without a transpose) fails;
* L2 ``kv_pairing``: query head h reads kv head h // (Nh / Nkv), through k and through v;
* L2 ``head_merge``: each head of the core's context lands, position by position, in its own
  block of the output projection's input;
* L4 ``mask_relation``: the keys each query may use (:mod:`attn_ledger.probes.module.fit`) match the
  declared relation; a narrower or wider one fails, named;
* L4 ``effective_scale``: the softmax scale fitted from the weights, times any constant that
  scaled q or k on the way, against 1/sqrt(Dh) or the declared scale; the common mistakes
  (1/sqrt(E), 1/Dh, sqrt(Dh), 1, and 1/sqrt(Dh) where another scale was declared) are named and
  fail, any other value warns;
* L4 ``rotary_positions``: rotary embeddings recognised between the projection outputs and
  the core's inputs, judged across q, k, v (:mod:`attn_ledger.maths.rotary`);
* L4 ``score_design``: what the scores hold besides ``s * q.k``: nothing, ALiBi, a relative
  position bias, soft-capping (named, passing), or a term of no recognised form (inconclusive);
  a declared soft-cap (``--softcap C``) that the scores do not apply fails. Soft-capping is read
  on a probe that bends it: the core's q scaled inside the forward until its logits reach the
  cap (or :data:`BEND_LOGITS`), since scores far below a cap are bent too little to read;
* L3 ``key_row_sums``: each query's weights (the probe's, read from the context) sum to 1 over the keys;
  weights normalised over another axis (softmax over the queries) fail here, which names the cause
  that the causality and context checks only show as symptoms;
* L4 ``attention_core``: the context against float64 attention on the observed q, k, v, with
  the expected scale, the declared relation, the declared or recognised soft-cap and the
  recognised designs (with a cap declared, on the bending probe as well). Where it disagrees,
  the checks above say why; with none failing, a refit with what was found decides between a
  design not recognised (warn or inconclusive, never a failure) and a core that is not
  attention at all (fail).

When no core is seen, every one of these is skipped and the report's coverage says the
verdict rests on black-box checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attn_ledger.probes.module.fit import BiasFit, ScoreFit, compare_relations, fit_scores, recognise_bias, relation_of
from attn_ledger.maths.relations import CAUSAL, RelationSpec, module_relation
from attn_ledger.errors import field_error
from attn_ledger.errors import field_error, first_line
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.probes.module.heads import Located, kv_heads_from_widths, layout_of, locate, pairing, trace_vectors
from attn_ledger.probes.common.forward import closeness
from attn_ledger.report import Check, Coverage, Hint, Note, bounded, counted, unjudged

if TYPE_CHECKING:
    import torch
    from torch import nn

    from attn_ledger.probes.common.observe import Core, Observation

__all__ = ["AXIS_CHECKS", "BEND_LOGITS", "CORE_CHECKS", "OBSERVED", "SUM_CHECKS", "Audit", "Declared", "audit_core",
           "check_level"]

AXIS_CHECKS = ("head_split", "kv_pairing", "head_merge")
CORE_CHECKS = ("mask_relation", "effective_scale", "rotary_positions", "score_design", "attention_core")
SUM_CHECKS = ("key_row_sums",)  # observed, but a numerical invariant: the module report's numerics row
OBSERVED = AXIS_CHECKS + SUM_CHECKS + CORE_CHECKS


def check_level(name: str) -> int:
    """The level of an observed check: 2 for the axis checks, 3 for ``key_row_sums``, 4 for the rest."""
    return 2 if name in AXIS_CHECKS else 3 if name in SUM_CHECKS else 4

# How far the bending probe drives the largest logit (or to a declared cap below it). At 30, a
# cap of 50 (Gemma 2) bends the largest logit by about 3 and a cap of 1000 by 0.01, far above
# float32's logit tolerance, while the weights stay above float32's smallest normal number.
BEND_LOGITS = 30.0

# How close a fitted soft-cap must be to the declared one.
CAP_RTOL = 1e-2

MISTAKES = {
    "1/sqrt(E)": "scaled by the model width, not the head width",
    "1/Dh": "scaled twice",
    "sqrt(Dh)": "multiplied by sqrt(Dh) instead of divided",
    "1": "not scaled",
    "1/sqrt(Dh)": "the default scale, not the declared one",
}


@dataclass(frozen=True)
class Declared:
    """What the module is meant to compute.

    Attributes:
        relation: causal (each query uses keys up to its own position), a sliding window (only the last
            ``window`` keys up to the query), or none; made by :func:`~attn_ledger.maths.relations.module_relation`.
        scale: the design's own softmax scale; None means 1/sqrt(Dh).
        softcap: the scaled scores are soft-capped, ``softcap * tanh(s / softcap)``, before
            the mask (Gemma 2's ``attn_logit_softcapping``); None means no cap.
        sinks: one sink logit per head in the softmax's denominator (gpt-oss's ``sinks``), or None.
    """

    relation: RelationSpec = CAUSAL
    scale: float | None = None
    softcap: float | None = None
    sinks: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.relation.names not in ((), ("causal",), ("sliding-window",)) or (
                self.relation.names == ("sliding-window",) and self.relation.window is None):
            raise field_error("relation", str(self.relation), "causal, sliding-window (with its window) or none")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not math.isfinite(self.scale) or self.scale <= 0):
            raise field_error("scale", self.scale, "a finite number > 0")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not math.isfinite(self.softcap) or self.softcap <= 0):
            raise field_error("softcap", self.softcap, "a finite number > 0")
        if self.sinks is not None and (not isinstance(self.sinks, tuple) or not self.sinks
                                       or not all(isinstance(x, float) and math.isfinite(x) for x in self.sinks)):
            raise field_error("sinks", self.sinks, "finite sink logits, one per head")

    @property
    def causal(self) -> bool:
        return self.relation.causal

    @property
    def window(self) -> int | None:
        return self.relation.window

    @property
    def text(self) -> str:
        return f"sliding window {self.window}" if self.window else "causal" if self.causal else "bidirectional"

    def allow(self, tq: int, tk: int) -> "torch.Tensor":
        """``[Tq, Tk]`` True where a query may use a key."""
        import torch

        from attn_ledger.maths import masks

        if self.window:
            return masks.sliding_window(tq, tk, self.window)
        if self.causal:
            return masks.causal(tq, tk)
        return torch.ones(tq, tk, dtype=torch.bool)


@dataclass(frozen=True)
class Audit:
    """The core's checks, and what was found, as plain data.

    Attributes:
        checks: by name (:data:`AXIS_CHECKS`, :data:`SUM_CHECKS` and :data:`CORE_CHECKS`).
        details: what was found (layout, core call, relation, scale, rotary, design).
        positional: what makes the module's output depend on positions (rotary, a bias),
            for the permutation probe.
        coverage: set when some checks could not run.
        notes: lines a reader needs, as data (:mod:`attn_ledger.render.notes` writes them).
        hints: what to try next, each tested (an undeclared soft-cap or window that explains the core).
    """

    checks: dict[str, Check]
    details: dict[str, Any] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    coverage: Coverage | None = None
    notes: tuple[Note, ...] = ()
    hints: tuple[Hint, ...] = ()


def scale_rtol(dtype: "torch.dtype") -> float:
    """How close a fitted scale must be to a value to count as it (:func:`attn_ledger.tolerance.fitted_scale`)."""
    from attn_ledger import tolerance

    return tolerance.fitted_scale(dtype)


def _unseen(status: str, short: str, reason: str) -> Audit:
    """Every observed check unjudged for one reason; the coverage carries the reason in full."""
    checks = {name: unjudged(check_level(name), name, status, short)  # type: ignore[arg-type]
              for name in OBSERVED}
    return Audit(checks, {"core": None}, coverage=Coverage("black-box", OBSERVED, reason))


def audit_core(module: "nn.Module", x: "torch.Tensor", declared: Declared, *, embed_dim: int,
               dtype: "torch.dtype") -> Audit:
    """Observe ``module(x)`` and judge its core (see the module docstring).

    The module's forward runs three times more (four times for a hand-written core): once
    observed, once or twice as a probe of the weights, and once with the core's q scaled to
    bend any soft-cap. A forward that raises here leaves every check skipped (the black-box
    checks report the raise).
    """
    from attn_ledger.probes.common.observe import observe_module, probe_bent, probe_weights

    try:
        with user_call(f"forward(x) observed on input {tuple(x.shape)}"):
            obs = observe_module(module, x)
    except UserCodeError:
        raise
    except Exception as exc:  # the user's forward may raise anything
        why = f"the observed forward raised {type(exc).__name__}: {first_line(exc)}"
        return _unseen("skipped", why, why)
    if obs.core is None:
        seen = f" (calls on the projections that were not understood: {', '.join(obs.unexplained[:5])})" \
            if obs.unexplained else ""
        return _unseen("skipped", "no attention core was observed",
                       "no attention core was observed: q, k and v never entered F.scaled_dot_product_attention "
                       f"or a matmul the observer could follow{seen}, so the verdict rests on black-box checks")
    core = obs.core
    t = x.shape[1]
    if obs.failure or core.q.shape[2] != t or core.k.shape[2] != t:
        why = obs.failure or (f"the core attends over {core.q.shape[2]} queries and {core.k.shape[2]} keys, "
                              f"not the input's T = {t} positions")
        return _unseen("inconclusive", why, why)
    try:
        with user_call(f"forward(x) with the core's q zeroed, on input {tuple(x.shape)}"):
            probes = probe_weights(module, x, core)
    except UserCodeError:
        raise
    except Exception as exc:  # the probe forward is the user's forward
        probes = None
        note = f"the probe forward raised {type(exc).__name__}: {first_line(exc)}"
    else:
        note = "the probe forward did not reach the same core"
    if probes is None:
        why = f"the core's weights could not be probed: {note}"
        return _unseen("inconclusive", why, why)

    def bend(factor: float) -> "Core | None":
        try:
            with user_call(f"forward(x) with the core's q scaled by {factor:.3g}, on input {tuple(x.shape)}"):
                return probe_bent(module, x, core, factor)
        except UserCodeError:
            raise
        except Exception:  # the probe forward is the user's forward; without it the cap stays unread
            return None

    return _judge(obs, core, probes, declared, embed_dim, dtype, bend)


def _judge(obs: "Observation", core: "Core", probes: tuple, declared: Declared, embed_dim: int,
           dtype: "torch.dtype", bend: Any) -> Audit:
    """Every check once the core and its probe weights are in hand (one line per check, in order)."""
    w, w0 = probes
    traced = _trace_roles(obs, core, dtype)
    merge = _merge_check(obs, core, dtype)
    relation, applied = _relation_check(w0, declared)
    bias_fit, bias = recognise_bias(w0, dtype)
    fit0 = fit_scores(core.q, _paired(core.k, core.q.shape[1]), w, w0, bias, dtype, declared.softcap)
    reach = _reach(core, fit0, w0)
    bent = _bent_probe(core, fit0, reach, w0, bias, declared, bend, dtype)
    fit = _read_cap(fit0, bent)
    factor = traced.factors["q"] * traced.factors["k"]
    scale = _scale_check(fit, factor, traced.relative_to, declared, core.q.shape[-1], embed_dim, dtype)
    rotary, positional = _rotary_check(core, traced)
    found = recognise_sinks(w0, dtype) if bias_fit.kind == "none" else None
    design = _sink_design(_design_check(bias_fit, fit, declared, bent, reach), declared, found)
    summed = _row_sums(w, w0, dtype)
    attention = _core_check(core, declared, fit, bias_fit, bias, factor, summed, (relation, scale, design), applied,
                            dtype, bent, found)
    sums = _sums_check(summed, sinks=found is not None or declared.sinks is not None)
    checks = {c.name: c for c in (traced.split, traced.pairing, merge, relation, scale, rotary, design, sums, attention)}
    if bias_fit.kind in ("alibi", "relative", "other"):
        positional.append(f"a position bias in the scores ({bias_fit.kind})")
    details = {"core": core.description, "layout": traced.layout, "relation": relation.data.get("applied_text"),
               "scale": scale.value, "rotary": rotary.data.get("spec"), "design": design.data.get("design"),
               "sinks": None if found is None else list(found)}
    coverage = None
    notes: list[Note] = []
    if traced.relative_to != "projection outputs":
        coverage = Coverage("partial", ("head_split", "kv_pairing", "rotary_positions"),
                            "q, k or v could not be traced to a projection of the input")
    hints = _hints(core, declared, fit, design, relation, attention, (bias_fit, bias), factor, dtype)
    if found is not None and declared.sinks is None and design.status == "pass":
        notes.append(Note("undeclared_sinks", {"sinks": list(found)}))
    if obs.cores > 1:
        notes.append(Note("cores_seen", {"cores": obs.cores}))
    if obs.mha:
        notes.append(Note("mha_slow_path"))
    return Audit(checks, details, tuple(positional), coverage, tuple(notes), hints)


def _hints(core: "Core", declared: Declared, fit: ScoreFit, design: Check, relation: Check, attention: Check,
           bias: tuple, factor: float, dtype: "torch.dtype") -> tuple[Hint, ...]:
    """What to declare, tested: a soft-cap the scores were read to apply (``score_design`` passing on it), or the
    sliding window the core applies in place of the declared relation, where float64 attention with that window
    (and the expected scale) reproduces the core's context."""
    import torch

    hints: list[Hint] = []
    if fit.form == "softcap" and declared.softcap is None and design.status == "pass":
        cap = sum(fit.caps) / len(fit.caps)
        hints.append(Hint("declare_softcap", {"cap": cap, "caps": list(fit.caps), "option": f"--softcap {cap:.3g}"}))
    w = relation.data.get("window")
    if relation.failed and attention.failed and relation.data.get("applied") == "sliding-window" and isinstance(w, int):
        nh, tq, tk = core.q.shape[1], core.q.shape[2], core.k.shape[2]
        expected = (declared.scale if declared.scale is not None else 1.0 / math.sqrt(core.q.shape[-1])) / factor
        caps = None if declared.softcap is None else torch.full((nh,), float(declared.softcap), dtype=torch.float64)
        bias_fit, grid = bias
        window = Declared(module_relation(True, w), scale=declared.scale, softcap=declared.softcap)
        ref = reference_context(core, window.allow(tq, tk), torch.full((nh,), expected, dtype=torch.float64),
                                grid if bias_fit.kind in ("alibi", "relative") else None, caps)
        c = closeness(core.context, ref, dtype)
        if c.ok:
            hints.append(Hint("declare_window", {"window": w, "declared": declared.text, "value": c.delta,
                                                 "tolerance": c.tolerance,
                                                 "option": f"--window {w}" if declared.causal else f"--causal --window {w}"}))
    return tuple(hints)


def _paired(k: "torch.Tensor", nh: int) -> "torch.Tensor":
    """k with one head per query head: kv head j serves query heads j*g .. j*g + g - 1 (SDPA's enable_gqa)."""
    hk = k.shape[1]
    return k if hk == nh else k.repeat_interleave(nh // hk, dim=1)


# --- tracing q, k, v to the projections -----------------------------------------------------

@dataclass(frozen=True)
class _Traced:
    split: Check
    pairing: Check
    located: dict[str, Located | None]
    factors: dict[str, float]
    layout: str | None
    relative_to: str


def _trace_roles(obs: "Observation", core: "Core", dtype: "torch.dtype") -> _Traced:
    sources = [p.output for p in obs.projections]
    names = [p.weight for p in obs.projections]
    tensors = {"q": core.q, "k": core.k, "v": core.v}
    if not sources:
        why = "no projection of the module's input was observed"
        return _Traced(unjudged(2, "head_split", "skipped", why), unjudged(2, "kv_pairing", "skipped", why),
                       dict.fromkeys(tensors), dict.fromkeys(tensors, 1.0), None, "tensors entering attention")
    located = {r: locate(t, sources, role=r, names=names, dtype=dtype) for r, t in tensors.items()}
    factors = {r: (loc.factor if loc else 1.0) for r, loc in located.items()}
    relative_to = "projection outputs" if located["q"] and located["k"] else "tensors entering attention"
    missing = [r for r, loc in located.items() if loc is None]
    if missing:
        split = _split_failure(tensors, missing, sources, names, dtype)
        why = f"{', '.join(missing)} not traced to a projection, so the pairing cannot be read"
        return _Traced(split, unjudged(2, "kv_pairing", "skipped", why), located, factors, None, relative_to)
    q, k, v = located["q"], located["k"], located["v"]
    d, dv = core.q.shape[-1], core.v.shape[-1]
    used = sorted({*q.projection, *k.projection, *v.projection})
    layout = layout_of(q, k, v, [sources[i].shape[-1] for i in used], d, dv)
    roles = {r: {"projection": [names[i] or f"#{i}" for i in layout[r]["projection"]], "columns": layout[r]["columns"]}
             for r in ("q", "k", "v")}
    data = {"layout": layout["name"], **roles, "factors": factors}
    order = sorted(zip(q.projection, q.offset))
    out_of_order = [h for h, key in enumerate(zip(q.projection, q.offset)) if order.index(key) != h]
    if out_of_order:
        h = out_of_order[0]
        split = counted(2, "head_split", "query heads out of their projection's column order", len(out_of_order),
                        location={"head": h}, data=data)
    else:
        split = Check(2, "head_split", "pass", reason=f"layout: {layout['name']}", data=data)
    kv = _pairing_check(q, k, v, core, [sources[i].shape[-1] for i in used], d, dv)
    return _Traced(split, kv, located, factors, layout["name"], relative_to)


def _split_failure(tensors: dict, missing: list[str], sources: list, names: list[str], dtype: "torch.dtype") -> Check:
    """head_split for roles that match no block: vectors found at other positions fail; otherwise inconclusive."""
    for role in missing:
        moved = trace_vectors(tensors[role], sources, dtype)
        if moved.moved:
            b, h, t = moved.first
            sb, st, si, so = moved.source
            return counted(2, "head_split", f"{role} vectors taken from another position or example", moved.moved,
                           location={"example": b, "head": h, "position": t},
                           reason="the split mixes positions and heads (a reshape without a transpose?)",
                           data={"role": role, "of": moved.total, "traced": moved.traced,
                                 "source": {"example": sb, "position": st, "projection": names[si] or f"#{si}",
                                            "column": so}})
    return unjudged(2, "head_split", "inconclusive",
                    f"{', '.join(missing)} could not be traced to any projection output (a transform that "
                    "changes vector norms, such as a per-head norm, sits between)")


def _pairing_check(q: Located, k: Located, v: Located, core: "Core", widths: list[int], d: int, dv: int) -> Check:
    nh, hk = core.q.shape[1], core.k.shape[1]
    if hk == 0 or nh % hk or core.v.shape[1] != hk:
        return unjudged(2, "kv_pairing", "inconclusive",
                        f"the core's k and v heads ({hk}, {core.v.shape[1]}) do not divide its {nh} query heads")
    q_order, k_of, v_of = pairing(q, k, v, nh // hk)
    seen = len(set(k_of) | set(v_of))
    nkv = max(kv_heads_from_widths(widths, nh, d, dv) or seen, seen)
    g = nh // nkv if nh % nkv == 0 else 1
    expected = [q_order[h] // g for h in range(nh)]
    data = {"kv_heads": nkv, "group": g, "expected": expected, "k": k_of, "v": v_of}
    if nkv > seen:
        return counted(2, "kv_pairing", "kv heads no query head reads", nkv - seen, data=data)
    wrong = [h for h in range(nh) if k_of[h] != expected[h] or v_of[h] != expected[h]]
    return counted(2, "kv_pairing", "query heads reading another kv head than h // (Nh / Nkv)", len(wrong),
                   location={"head": wrong[0]} if wrong else None, data=data)


def _merge_check(obs: "Observation", core: "Core", dtype: "torch.dtype") -> Check:
    out = obs.out_projection
    if out is None or not out.inputs:
        return unjudged(2, "head_merge", "skipped", "no output projection of the core's context was observed")
    loc = locate(core.context, out.inputs, dtype=dtype)
    nh, dv = core.context.shape[1], core.context.shape[-1]
    if loc is not None:
        expected = [h * dv for h in range(nh)]
        wrong = [h for h in range(nh) if loc.offset[h] != expected[h] or loc.projection[h] != loc.projection[0]]
        return counted(2, "head_merge", "context heads outside their own columns of the output projection's input",
                       len(wrong), location={"head": wrong[0]} if wrong else None,
                       data={"columns": list(loc.offset), "expected": expected, "projection": out.weight})
    moved = trace_vectors(core.context, out.inputs, dtype)
    if moved.moved:
        b, h, t = moved.first
        sb, st, _, so = moved.source
        return counted(2, "head_merge", "context vectors merged into another position or example", moved.moved,
                       location={"example": b, "head": h, "position": t},
                       reason="the merge mixes positions and heads (a reshape without a transpose?)",
                       data={"of": moved.total, "into": {"example": sb, "position": st, "column": so}})
    return unjudged(2, "head_merge", "inconclusive",
                    "the context could not be traced into the output projection's input (something changes it between)")


# --- relation, scale, rotary, design ---------------------------------------------------------

def _relation_check(w0: "torch.Tensor", declared: Declared) -> tuple[Check, "torch.Tensor"]:
    """mask_relation, and the applied allow pattern ``[B, Nh, Tq, Tk]``."""
    allowed = w0 > 0  # [B, Nh, Tq, Tk]
    b, nh, tq, tk = allowed.shape
    want = declared.allow(tq, tk)
    at = next(((e, h) for e in range(b) for h in range(nh) if not bool((allowed[e, h] == want).all())), None)
    e, h = at if at is not None else (0, 0)
    rel = relation_of(allowed[e, h])
    cmp = compare_relations(allowed[e, h], want)
    uniform = bool((allowed == allowed[:1, :1]).all())
    data = {"applied": rel["relation"], "applied_text": rel["text"],
            **{k: v for k, v in rel.items() if k not in ("relation", "text")},
            "declared": declared.text, "uniform": uniform, **cmp}
    if at is None:
        return Check(4, "mask_relation", "pass", "query-key pairs unlike the declared relation", 0, 0, "<=",
                     reason=f"the core applies {rel['text']}, as declared", data=data), allowed
    pair = cmp["first_extra"] or cmp["first_missing"]
    word = {"narrower": "narrower than", "wider": "wider than"}.get(cmp["comparison"], "unlike")
    check = counted(4, "mask_relation", "query-key pairs unlike the declared relation",
                    cmp["extra_pairs"] + cmp["missing_pairs"],
                    location={"example": e, "head": h, "query": pair[0], "key": pair[1]},
                    reason=f"the core applies {rel['text']}, {word} the declared {declared.text}", data=data)
    return check, allowed


def _scale_check(fit: ScoreFit, factor: float, relative_to: str, declared: Declared, dh: int, embed_dim: int,
                 dtype: "torch.dtype") -> Check:
    if fit.form in ("flat", "none"):
        why = ("no query has two keys to compare" if fit.form == "flat"
               else "no single scale explains the logits, with or without soft-capping")
        return Check(4, "effective_scale", "inconclusive", reason=why,
                     data={"form": fit.form, "line_scales": [s * factor for s in fit.scales],
                           "residual": fit.linear_residual, "tolerance": fit.tolerance})
    expected = declared.scale if declared.scale is not None else 1.0 / math.sqrt(dh)
    rtol = scale_rtol(dtype)
    values = {"1/sqrt(E)": embed_dim ** -0.5, "1/Dh": 1.0 / dh, "sqrt(Dh)": math.sqrt(dh), "1": 1.0,
              "1/sqrt(Dh)": dh ** -0.5}
    mistakes = {n: v for n, v in values.items() if not math.isclose(v, expected, rel_tol=rtol)}
    scales = [s * factor for s in fit.scales]
    named = [[n for n, v in mistakes.items() if math.isclose(s, v, rel_tol=rtol)] for s in scales]
    ok = [math.isclose(s, expected, rel_tol=rtol) for s in scales]
    data = {"expected": expected, "expected_name": "declared --scale" if declared.scale is not None else "1/sqrt(Dh)",
            "per_head": scales, "head_dim": dh, "embed_dim": embed_dim, "relative_to": relative_to,
            "qk_factor": factor, "form": fit.form, "mistakes": mistakes}
    if all(ok):
        return Check(4, "effective_scale", "pass", "fitted softmax scale", scales[0], expected, "==", rtol=rtol,
                     data={**data, "named": []})
    h = next((i for i, n in enumerate(named) if n), None)
    if h is not None:
        words = " and ".join(f"{n} ({MISTAKES[n]})" for n in named[h])
        return Check(4, "effective_scale", "fail", "fitted softmax scale", scales[h], expected, "==", rtol=rtol,
                     location={"head": h}, reason=f"equals {words}", data={**data, "named": named[h]})
    h = ok.index(False)
    return Check(4, "effective_scale", "warn", "fitted softmax scale", scales[h], expected, "==", rtol=rtol,
                 location={"head": h}, data={**data, "named": []},
                 reason="a scale of the design's own? declare it with --scale")


def _rotary_check(core: "Core", traced: _Traced) -> tuple[Check, list[str]]:
    from attn_ledger.maths.rotary import compare_positions, recognise_rotary

    loc = traced.located
    if loc["q"] is None or loc["k"] is None:
        return unjudged(4, "rotary_positions", "inconclusive",
                        "q or k was not traced to a projection, so positions cannot be compared"), []
    seen = {}
    for role, t in (("q", core.q), ("k", core.k), ("v", core.v)):
        if loc[role] is not None:
            x = (loc[role].source * traced.factors[role]).to(t.dtype)  # [B, H, T, D], before any rotation
            seen[role] = recognise_rotary(x, t)
    cmp = compare_positions(seen["q"], seen["k"], seen.get("v"))
    spec = None if cmp.spec is None else {"pairing": cmp.spec.pairing, "base": cmp.spec.base,
                                          "rotated_dim": cmp.spec.width(cmp.q.head_dim), "head_dim": cmp.q.head_dim}
    data = {"findings": list(cmp.findings), "spec": spec, "offset_between": cmp.offset_between,
            **{r: _rotation_data(o) for r, o in seen.items()}}
    positional = [f"rotary positions on {r}" for r in ("q", "k") if seen[r].kind != "none"]
    if cmp.status == "pass":
        return Check(4, "rotary_positions", "pass", reason=cmp.describe(), data=data), positional
    value = cmp.offset_between if "qk_offset" in cmp.findings else None
    return Check(4, "rotary_positions", cmp.status, "q and k rotated positions apart" if value is not None else "",
                 value, 0 if value is not None else None, "==" if value is not None else "", reason=cmp.describe(),
                 data=data), positional


def _rotation_data(o: Any) -> dict:
    spec = None if o.spec is None else {"pairing": o.spec.pairing, "base": o.spec.base,
                                        "rotated_dim": o.spec.width(o.head_dim)}
    return {"kind": o.kind, "spec": spec, "offset": o.offset, "residual": o.residual, "tolerance": o.tolerance,
            "position_dependent": o.position_dependent}


@dataclass(frozen=True)
class _Bent:
    """The core as it ran with its q scaled by ``factor`` (:func:`attn_ledger.probes.common.observe.probe_bent`).

    Attributes:
        factor: what q was scaled by.
        core: q (scaled), k, v, weights and context as that forward ran them.
        fit: its scores fitted against the scaled q.
        logits: the largest |logit| the line through its scores reaches.
    """

    factor: float
    core: "Core"
    fit: ScoreFit
    logits: float


def _bend_target(declared: Declared) -> float:
    """The largest logit the bending probe aims for: :data:`BEND_LOGITS`, or a declared cap below it."""
    return min(declared.softcap, BEND_LOGITS) if declared.softcap is not None else BEND_LOGITS


def _reach(core: "Core", fit0: ScoreFit, w0: "torch.Tensor") -> float:
    """The largest |logit| of an allowed pair on the user's draw, by the line fitted to its scores (0 if none)."""
    import torch

    if fit0.form == "flat" or not fit0.scales or min(fit0.scales) <= 0:
        return 0.0
    k = _paired(core.k, core.q.shape[1]).to(torch.float64)
    qk = core.q.to(torch.float64) @ k.transpose(-2, -1)  # [B, Nh, Tq, Tk]
    allowed = w0 > 0
    logits = (qk * torch.tensor(fit0.scales, dtype=torch.float64)[None, :, None, None]).abs()
    return float(logits[allowed].max()) if bool(allowed.any()) else 0.0


def _bent_probe(core: "Core", fit0: ScoreFit, reach: float, w0: "torch.Tensor", bias: "torch.Tensor",
                declared: Declared, bend: Any, dtype: "torch.dtype") -> _Bent | None:
    """Scale the core's q until its largest logit reaches :func:`_bend_target`, and fit the scores
    of that forward. None where the user's draw already reaches it (``reach``), where nothing can
    be fitted, or where the probe forward did not reach the same core."""
    target = _bend_target(declared)
    if reach <= 0 or reach >= target:
        return None
    factor = target / reach
    probed = bend(factor)
    if probed is None:
        return None
    fit = fit_scores(probed.q, _paired(probed.k, probed.q.shape[1]), probed.weights, w0, bias, dtype,
                     declared.softcap)
    return _Bent(factor, probed, fit, target)


def _read_cap(fit0: ScoreFit, bent: _Bent | None) -> ScoreFit:
    """The user's draw's fit, or the bending probe's where only it shows a cap.

    The probe's scales need no correction: they relate the logits to the q that entered
    the scores, which the probe scaled itself.
    """
    if bent is None or fit0.form == "softcap" or bent.fit.form != "softcap":
        return fit0
    return bent.fit


def _design_check(bias: BiasFit, fit: ScoreFit, declared: Declared, bent: _Bent | None, reach: float) -> Check:
    data: dict[str, Any] = {"bias": bias.kind, "bias_magnitude": bias.magnitude, "form": fit.form,
                            "declared_softcap": declared.softcap}
    if bent is not None:
        data["bent"] = {"q_factor": bent.factor, "logits": bent.logits, "form": bent.fit.form,
                        "residual": bent.fit.residual, "linear_residual": bent.fit.linear_residual,
                        "tolerance": bent.fit.tolerance}
    parts = []
    if bias.kind == "alibi":
        parts.append("ALiBi")
        data.update(slopes=list(bias.slopes), standard_slopes=bias.standard_slopes)
    elif bias.kind == "relative":
        parts.append("relative position bias")
    if fit.form == "softcap":
        parts.append("soft-capping")
        data["caps"] = list(fit.caps)
    data["design"] = " + ".join(parts) or "plain"
    cap_check = _declared_cap(declared, fit, bent, reach, data)
    if cap_check is not None:
        return cap_check
    if bias.kind == "content":
        return Check(4, "score_design", "inconclusive", data=data,
                     reason="with every score zero, the weights still change with the input: an additive term "
                            "that is not a position bias")
    if bias.kind == "other":
        return Check(4, "score_design", "inconclusive", "max |position bias| in logits", bias.magnitude, data=data,
                     reason="an additive position bias of no recognised form (not ALiBi, not a function of j - i)")
    return Check(4, "score_design", "pass", reason=f"design: {data['design']}", data=data)


def _declared_cap(declared: Declared, fit: ScoreFit, bent: _Bent | None, reach: float,
                  data: dict[str, Any]) -> Check | None:
    """score_design where a soft-cap is declared and the scores apply another one or none; None where it holds.

    Scores that stay linear fail only where they reached the bending target (on the probe, or
    on the draw itself): below it a cap may bend them too little to see.
    """
    cap = declared.softcap
    if cap is None:
        return None
    if fit.form == "softcap":
        off = [h for h, c in enumerate(fit.caps) if not math.isclose(c, cap, rel_tol=CAP_RTOL)]
        if not off:
            return None
        h = off[0]
        return Check(4, "score_design", "fail", "fitted soft-cap", fit.caps[h], cap, "==", rtol=CAP_RTOL,
                     location={"head": h}, reason=f"the scores are capped at {fit.caps[h]:.3g}, not the declared "
                     f"--softcap {cap:g}", data=data)
    if bent is not None and bent.fit.form == "linear":
        return Check(4, "score_design", "fail", reason=f"the declared --softcap {cap:g} is not applied: the scores "
                     f"stay linear in q.k up to logits of {bent.logits:.3g} (q scaled by {bent.factor:.3g})", data=data)
    if bent is None and fit.form == "linear" and reach >= _bend_target(declared):
        return Check(4, "score_design", "fail", reason=f"the declared --softcap {cap:g} is not applied: the scores "
                     f"stay linear in q.k up to logits of {reach:.3g}", data=data)
    return Check(4, "score_design", "inconclusive", data=data,
                 reason=f"the declared --softcap {cap:g} could not be read: the scores fit neither a line nor a cap, "
                 "or stay too small to show it")


# --- the core against float64 attention -------------------------------------------------------

SINK_SHORTFALL = 10.0  # row-sum tolerances a q-zeroed row must fall short of one by to read a sink
SINK_ATOL, SINK_RTOL = 0.01, 0.01  # a declared sink logit this far from the one the weights show fails


def recognise_sinks(w0: "torch.Tensor", dtype: "torch.dtype") -> tuple[float, ...] | None:
    """One sink logit per head, read from the q-zeroed weights ``[B, Nh, Tq, Tk]``, or None.

    With q zeroed every score is 0, so a row with n allowed keys holds n weights ``1 / (n + e^s)``
    and sums to ``n / (n + e^s)``: each row gives ``s = log(n (1 - S) / S)``. Sinks are recognised
    when some row falls short of one by more than ``SINK_SHORTFALL`` row-sum tolerances and every
    row of a head gives the same logit (within what the row sums' rounding explains); a head whose
    rows sum to one has no sink (``-inf``). None when no row falls short, or when the shortfall is not
    one logit per head (rows of one head disagree, or some sum to one and others not).
    """
    import torch

    from attn_ledger import tolerance

    w = w0.to(torch.float64)
    n = (w > 0).sum(-1).to(torch.float64)  # [B, Nh, Tq]
    total = w.sum(-1)
    live = n > 0
    tol = tolerance.row_sum(dtype)
    short = live & (total < 1 - SINK_SHORTFALL * tol)
    if not bool(short.any()):
        return None
    logits = []
    for h in range(w.shape[1]):
        sh, lv = short[:, h], live[:, h]
        if not bool(sh.any()):
            if bool(((total[:, h] - 1).abs() > tol)[lv].any()):
                return None
            logits.append(-math.inf)
            continue
        if not bool(torch.equal(sh, lv)):
            return None  # some rows of the head sum to one, others fall short: not one logit
        t, k = total[:, h][sh], n[:, h][sh]
        est = torch.log(k * (1 - t) / t)
        mid = float(est.median())
        slack = float((tol / (t * (1 - t))).max())  # ds = dS / (S (1 - S))
        if float((est - mid).abs().max()) > max(slack, 1e-6):
            return None
        logits.append(mid)
    return tuple(logits)


def _sink_design(design: Check, declared: Declared, found: tuple[float, ...] | None) -> Check:
    """score_design with attention sinks: recognised ones named in the design, declared ones not applied a failure."""
    if declared.sinks is not None and found is None:
        shown = ",".join(f"{x:g}" for x in declared.sinks)
        return Check(4, "score_design", "fail", reason=f"the declared --sinks {shown} are not applied: each query's "
                     "weights sum to one over the keys, with no share left for a sink",
                     data={**design.data, "declared_sinks": list(declared.sinks)})
    if found is not None and declared.sinks is not None:
        off = [h for h, (d, f) in enumerate(zip(declared.sinks, found))
               if math.isfinite(f) and abs(d - f) > SINK_ATOL + SINK_RTOL * abs(d)]
        if off:
            h = off[0]
            return Check(4, "score_design", "fail", "sink logit the weights show", found[h], declared.sinks[h], "==",
                         rtol=SINK_RTOL, atol=SINK_ATOL,
                         reason=f"the declared --sinks differ from those the weights show: head {h} declared "
                                f"{declared.sinks[h]:g}, the weights show {found[h]:.4g}",
                         data={**design.data, "declared_sinks": list(declared.sinks), "sinks": list(found), "head": h})
    if found is None or design.status != "pass":
        return design
    name = "sinks" if design.data.get("design") == "plain" else f"{design.data.get('design')} + sinks"
    return Check(4, "score_design", "pass", reason=f"design: {name}",
                 data={**design.data, "design": name, "sinks": list(found)})


def _row_sums(w: "torch.Tensor", w0: "torch.Tensor", dtype: "torch.dtype") -> tuple[float, float]:
    """max |sum over keys of a query's weights - 1| over queries with an allowed key, and its tolerance."""
    import torch

    from attn_ledger import tolerance

    w = w.to(torch.float64)
    live = (w0 > 0).any(-1)  # [B, Nh, Tq]
    dev = (w.sum(-1) - 1).abs().nan_to_num(nan=math.inf)[live]
    return (float(dev.max()) if dev.numel() else 0.0), tolerance.row_sum(dtype)


def _sums_check(summed: tuple[float, float], sinks: bool = False) -> Check:
    """key_row_sums: max |sum over keys of a query's weights - 1| against the row-sum tolerance; not applicable
    where attention sinks take a share of each row by design (score_design judges them)."""

    value, limit = summed
    if sinks:
        return Check(3, "key_row_sums", "not_applicable", reason="attention sinks take a share of each row, so its "
                     "weights over the keys sum to less than one by design (score_design judges the sinks)")
    return bounded(3, "key_row_sums", "max |sum over keys of a query's weights - 1|", value, limit,
                   reason="" if value <= limit else "a query's weights do not sum to 1 over the keys "
                                                    "(softmax over another axis?)")


def reference_context(core: "Core", allow: "torch.Tensor", scales: "torch.Tensor", bias: "torch.Tensor | None",
                      caps: "torch.Tensor | None", sinks: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Float64 attention on the core's own q, k, v: ``[B, Nh, Tq, Dv]``.

    Args:
        allow: broadcastable to ``[B, Nh, Tq, Tk]``, True = may use.
        scales: ``[Nh]`` softmax scale per head, relative to the observed q and k.
        bias: ``[B, Nh, Tq, Tk]`` added to the logits (after any cap), or None.
        caps: ``[Nh]`` soft-capping caps, or None.
        sinks: ``[Nh]`` sink logits in the denominator only (``-inf``: none for that head), or None.
    """
    import torch

    nh = core.q.shape[1]
    q = core.q.to(torch.float64)
    k = _paired(core.k, nh).to(torch.float64)
    v = _paired(core.v, nh).to(torch.float64)
    logits = (q @ k.transpose(-2, -1)) * scales[None, :, None, None]  # [B, Nh, Tq, Tk]
    if caps is not None:
        c = caps[None, :, None, None]
        logits = c * torch.tanh(logits / c)
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~allow, float("-inf"))
    if sinks is not None:
        b, _, tq, _ = logits.shape
        col = sinks.to(torch.float64).reshape(1, nh, 1, 1).expand(b, nh, tq, 1)
        weights = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)
        return weights @ v  # [B, Nh, Tq, Dv]
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query with no key reads nothing
    return weights @ v  # [B, Nh, Tq, Dv]


def _core_check(core: "Core", declared: Declared, fit: ScoreFit, bias_fit: BiasFit, bias: "torch.Tensor",
                factor: float, summed: tuple[float, float], diagnosis: tuple[Check, ...], applied: "torch.Tensor",
                dtype: "torch.dtype", bent: _Bent | None = None, found: tuple[float, ...] | None = None) -> Check:
    """attention_core: the context against float64 attention as declared; where it differs, why.

    With a soft-cap declared, the reference applies it, and the bending probe's context is
    judged too: on the user's draw a cap far above the scores changes the context by less
    than the tolerance, so a cap left out would pass there. The reference counts the declared sinks,
    or else the ones the weights show (``found``).
    """
    import torch

    nh, tq, tk = core.q.shape[1], core.q.shape[2], core.k.shape[2]
    expected = (declared.scale if declared.scale is not None else 1.0 / math.sqrt(core.q.shape[-1])) / factor
    if declared.softcap is not None:
        caps = torch.full((nh,), float(declared.softcap), dtype=torch.float64)
    else:
        caps = torch.tensor(fit.caps, dtype=torch.float64) if fit.form == "softcap" else None
    known = bias if bias_fit.kind in ("alibi", "relative") else None
    scales = torch.full((nh,), expected, dtype=torch.float64)
    chosen = declared.sinks if declared.sinks is not None else found
    sinks = None if chosen is None else torch.tensor(chosen, dtype=torch.float64)
    ref = reference_context(core, declared.allow(tq, tk), scales, known, caps, sinks)
    c = closeness(core.context, ref, dtype)
    measure = "max |context - float64 attention on the observed q, k, v|"
    data: dict[str, Any] = {**c.data(), "scale": expected, "relation": declared.text, "row_sum_deviation": summed[0],
                            "softcap": declared.softcap, "sinks": None if chosen is None else list(chosen)}
    if declared.softcap is not None and bent is not None and c.ok:
        bent_ref = reference_context(bent.core, declared.allow(tq, tk), scales, known, caps, sinks)
        cb = closeness(bent.core.context, bent_ref, dtype)
        data["draw"] = {"delta": c.delta, "tolerance": c.tolerance}
        data["bent"] = {"q_factor": bent.factor, "delta": cb.delta, "tolerance": cb.tolerance, **cb.data()}
        if not cb.ok:
            c = cb
            measure = f"max |context - float64 attention| with q scaled by {bent.factor:.3g}"
    if c.ok:
        return Check(4, "attention_core", "pass", measure, c.delta, c.tolerance, "<=", data=data)
    failed = [d.name for d in diagnosis if d.failed]
    if summed[0] > summed[1] and chosen is None:  # with sinks the rows sum to less than one by design
        failed.append("weights_sum")
        data["reason"] = "a query's weights do not sum to 1 over the keys (softmax over another axis?)"
    if failed:
        return Check(4, "attention_core", "fail", measure, c.delta, c.tolerance, "<=",
                     reason=f"explained by {', '.join(failed)}", data={**data, "explained_by": failed})
    soft = [d for d in diagnosis if d.status in ("warn", "inconclusive")]
    if fit.form in ("linear", "softcap"):
        scales = torch.tensor(fit.scales, dtype=torch.float64)  # slopes at 0, as the reference wants with caps too
        refit = reference_context(core, applied, scales, bias, caps, sinks)
        c2 = closeness(core.context, refit, dtype)
        data["refit_delta"] = c2.delta
        if c2.ok and soft:
            status = "warn" if any(d.status == "warn" for d in soft) else "inconclusive"
            names = [d.name for d in soft]
            return Check(4, "attention_core", status, measure, c.delta, c.tolerance, "<=",
                         reason=f"a design of its own: with what {', '.join(names)} found, the core is attention",
                         data={**data, "explained_by": names})
    return Check(4, "attention_core", "fail", measure, c.delta, c.tolerance, "<=",
                 reason="not explained by the scale, the relation or a recognised design: the core computes "
                        "something other than attention on these q, k, v", data={**data, "explained_by": []})
