"""The ledger's backward rows: seed ``O-bar``, run the backward stages, check them against float64 autograd.

Rows, in order: ``grad_context`` (``O-bar``), ``grad_weights``, ``grad_values``, ``grad_scores``,
``grad_q``, ``grad_k`` and, for the built-in pipeline, ``grad_projections`` and ``grad_input``.
The score-grid stages run block by block (:mod:`attn_ledger.engine.backward`); the float64
reference differentiates the plain attention (or, for the built-in pipeline, the whole plain
multi-head attention) on the query rows the forward's reference sampled; small inputs also get a
gradcheck of the hand backward against central differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger.engine import checks as C
from attn_ledger import tolerance
from attn_ledger.engine.backward import GRADCHECK_ENTRIES, Backward, Rotation, gradcheck, located
from attn_ledger.engine.judge import AXES, Tally, judge_backward, rounded_check
from attn_ledger.engine.rows import Rows
from attn_ledger.report import Check, Note, unjudged

if TYPE_CHECKING:
    from torch import Tensor

    from attn_ledger.engine.plan import Plan
    from attn_ledger.maths.relations import Relation



@dataclass(frozen=True)
class Forward:
    """What the forward hands the backward.

    Attributes:
        q, k_exp, v_exp: as they entered the scores stage (rotated, kv heads expanded).
        q_in, k_in, v_in: the q, k, v stages' tensors (before rotation and expansion); the rows'
            gradients are with respect to these.
        refs: the reference's q, k, v (float64, before rotation).
        scale: the pipeline's score scale; sdpa_scale: the intended one (every reference's).
    """

    q: "Tensor"
    k_exp: "Tensor"
    v_exp: "Tensor"
    q_in: "Tensor"
    k_in: "Tensor"
    v_in: "Tensor"
    refs: tuple["Tensor", "Tensor", "Tensor"]
    relation: "Relation"
    plan: "Plan"
    scale: float
    sdpa_scale: float
    empty_zero: bool
    rotation: Rotation | None
    softcap: float | None = None  # the scores' soft-cap, through which the backward runs too
    sinks: "Tensor | None" = None  # [Nh] attention sinks in the softmax's denominator, or None


def sampled_words(plan: "Plan") -> str:
    return "every row" if plan.reference_rows == plan.tq else f"{plan.reference_rows} sampled rows"


def grad_rounding(fwd: Forward, go: "Tensor", ref: "dict[str, Tensor]",
                  go_ref: "Tensor | None" = None) -> "dict[str, Tensor] | None":
    """The rounding rule's ``M`` of each backward stage tensor, shaped as the reference's gradients
    (:func:`attn_ledger.engine.rounding.grad_magnitudes`): on the sampled rows, from the reference's
    q, k, v (rotated in float64 as the reference rotates them) and ``O-bar`` (``go_ref``, the
    sampled rows' float64 O-bar where the pipeline computed its own, else the pipeline's), with the
    error the pipeline's own tensors carry against those. None where the reference is not float64."""
    import torch

    from attn_ledger.engine import rounding
    from attn_ledger.engine.execute import sample_allow, sample_rows
    from attn_ledger.maths.reference import repeat_kv
    from attn_ledger.maths.rotary import apply_rotary

    if ref.get("grad_q") is None or ref["grad_q"].dtype != torch.float64:
        return None
    f64, plan = torch.float64, fwd.plan
    picked = sample_rows(plan.reference_spans, fwd.q.device)
    nh, nkv, tk = fwd.q.shape[1], fwd.k_in.shape[1], fwd.k_exp.shape[2]
    q, k, v = (t.detach().to(f64) for t in fwd.refs)
    q = q[:, :, picked]
    rot = fwd.rotation
    if rot is not None:
        q = apply_rotary(q, rot.spec, positions=picked + rot.q_start)
        k = apply_rotary(k, rot.spec, positions=torch.arange(tk, device=k.device))
    pipe_go = go[:, :, picked].detach().to(f64)
    g = pipe_go if go_ref is None else go_ref.detach().to(f64)
    carried = {"q": (fwd.q[:, :, picked].to(f64) - q).abs(), "k": (fwd.k_exp.to(f64) - repeat_kv(k, nh)).abs(),
               "v": (fwd.v_exp.to(f64) - repeat_kv(v, nh)).abs(), "go": (pipe_go - g).abs()}
    eps = tolerance.EPS.get(tolerance.dtype_name(fwd.q.dtype), tolerance.EPS["float32"])
    with torch.inference_mode():
        m = rounding.grad_magnitudes(q, k, v, g, sample_allow(fwd.relation, plan.reference_spans, tk), fwd.sdpa_scale,
                                     fwd.softcap, carried, eps, tolerance.tiny(fwd.q.dtype),
                                     rounding.accumulation(tolerance.dtype_name(fwd.q.dtype)), fwd.sinks)
        spec = None if rot is None else rot.spec
        return {"grad_weights": m["grad_weights"], "grad_scores": m["grad_scores"],
                "grad_q": rounding.unrotated(m["grad_q"], m["mag_q"], spec),
                "grad_k": rounding.per_kv(rounding.unrotated(m["grad_k"], m["mag_k"], spec), nkv),
                "grad_values": rounding.per_kv(m["grad_values"], nkv),
                **({} if "grad_sinks" not in m else {"grad_sinks": m["grad_sinks"]})}


def core_backward(rows: Rows, ops: Any, fwd: Forward, go: "Tensor", ref: "dict[str, Tensor]", *,
                  replay: bool, go_ref: "Tensor | None" = None) -> Backward | None:
    """The backward's score-grid stages: run, judged, gradcheck on small inputs, and the gradients kept."""
    b, nh, tq, dh = fwd.q.shape
    nkv, tk, dv = fwd.k_in.shape[1], fwd.k_exp.shape[2], fwd.v_exp.shape[-1]
    run = Backward(fwd.plan, fwd.relation, ops, fwd.q, fwd.k_exp, fwd.v_exp, go, scale=fwd.scale,
                   sdpa_scale=fwd.sdpa_scale, empty_zero=fwd.empty_zero, n_kv=nkv, rotation=fwd.rotation, ref=ref,
                   softcap=fwd.softcap, sinks=fwd.sinks, mags=grad_rounding(fwd, go, ref, go_ref))
    tally = Tally.of(run.run())
    derived = {"grad_weights": (b, nh, tq, tk), "grad_values": (b, nkv, tk, dv), "grad_scores": (b, nh, tq, tk),
               "grad_q": (b, nh, tq, dh), "grad_k": (b, nkv, tk, dh), "grad_sinks": (nh,)}
    verdicts = judge_backward(tally, tolerance.dtype_name(fwd.q.dtype), derived=derived, sampled=sampled_words(fwd.plan))
    for stage, checks in verdicts.checks.items():
        broken = tally.broken.get((stage, "pipeline"))
        if broken is not None and broken.raised is not None:
            rows.raised[stage] = broken.raised
        if checks or stage in rows.raised:
            rows.stage(stage, derived[stage], checks)
    if run.dq is None:
        return None
    if sum(t.numel() for t in (fwd.q_in, fwd.k_in, fwd.v_in)) <= GRADCHECK_ENTRIES:
        allow = fwd.relation.block(0, tq)
        for stage, check in gradcheck(ops, fwd.q_in, fwd.k_in, fwd.v_in, go, allow, fwd.scale, fwd.empty_zero,
                                      fwd.rotation, fwd.softcap).items():
            rows.checks[stage].append(check)
    if replay:
        rows.checks["grad_k"].append(_replayed(ops, fwd, go, run))
    rows.tensors.update({"grad_q": run.dq, "grad_k": run.dk, "grad_values": run.dv})
    if run.dsinks is not None:
        rows.tensors["grad_sinks"] = run.dsinks  # [Nh]
    for key, parts in run.kept.items():
        import torch

        rows.tensors[key] = torch.cat(parts, dim=2)  # [B, Nh, Tq, Tk]
    return run


def _replayed(ops: Any, fwd: Forward, go: "Tensor", first: Backward) -> Check:
    """The backward run again: Q-bar, K-bar and V-bar bitwise the same."""
    second = Backward(fwd.plan, fwd.relation, ops, fwd.q, fwd.k_exp, fwd.v_exp, go, scale=fwd.scale,
                      sdpa_scale=fwd.sdpa_scale, empty_zero=fwd.empty_zero, n_kv=fwd.k_in.shape[1],
                      rotation=fwd.rotation, sdpa=False, softcap=fwd.softcap, sinks=fwd.sinks)
    for _ in second.run():
        pass
    from attn_ledger.engine.replay import replay_check

    return replay_check([(n, a, b) for n, a, b in (("grad_q", first.dq, second.dq), ("grad_k", first.dk, second.dk),
                                                   ("grad_values", first.dv, second.dv))],
                        ("example", "head", "row", "feature"))


# --- saved tensors: the seed and the user's own gradients ---------------------------------------------

def context_row(rows: Rows, go: "Tensor", source: dict[str, Any], given_broken: Any = None) -> None:
    """``grad_context`` for saved tensors: the seed itself, its shape and finite values."""
    b, nh, tq, dv = go.shape
    checks = [C.shape_check(go.shape, (b, nh, tq, dv), AXES["grad_context"]),
              C.finite_check(C.nonfinite_count(go), "O-bar values")]
    if given_broken is not None:
        checks.append(C.shape_check(given_broken.shape, given_broken.expected,
                                    "given grad_out " + ("[B,Tq,Dv]" if len(given_broken.expected) == 3 else "[B,Nh,Tq,Dv]"),
                                    "user_grad_out_shape"))
    rows.stage("grad_context", tuple(go.shape), checks)
    rows.row_notes["grad_context"] = Note("grad_seed", {"on": "context", **source})
    rows.tensors["grad_context"] = go


def user_grads(rows: Rows, run: Backward, ref: "dict[str, Tensor]", given: "dict[str, Tensor]", broken: list[Any],
               plan: "Plan", seeded: bool) -> None:
    """The user's saved ``dq``, ``dk``, ``dv``: shape (a wrong one is an L1 finding), then against both references."""
    import torch

    shown = {"grad_q": "[B,Nh,Tq,Dh]", "grad_k": "[B,Nkv,Tk,Dh]", "grad_values": "[B,Nkv,Tk,Dv]"}
    for b in broken:
        if b.stage == "grad_context":
            continue
        name = {"grad_q": "dq", "grad_k": "dk", "grad_values": "dv"}[b.stage]
        axes = shown[b.stage].replace("Nh,", "").replace("Nkv,", "") if len(b.expected) == 3 else shown[b.stage]
        rows.checks.setdefault(b.stage, []).append(C.shape_check(b.shape, b.expected, f"given {name} {axes}", f"user_{name}_shape"))
    rtol, atol = tolerance.reference(run.q.dtype)
    spans = plan.reference_spans
    for name, stage, mine in (("dq", "grad_q", run.dq), ("dk", "grad_k", run.dk), ("dv", "grad_values", run.dv)):
        if name not in given:
            continue
        checks = rows.checks.setdefault(stage, [])
        if not seeded:
            checks.append(unjudged(4, f"user_{name}_matches_reference", "not_applicable",
                                   "the saved grad_out could not seed the backward"))
            continue
        t = given[name]
        if stage == "grad_q":
            rows_t = torch.cat([t[:, :, r0:r1] for r0, r1 in spans], dim=2)  # [B, Nh, R, Dh]
            checks.append(_user_agree(run, stage, f"user_{name}_matches_reference", rows_t, ref[stage],
                                      f"float64 autograd ({sampled_words(plan)})", spans))
        elif run.every_row:
            checks.append(_user_agree(run, stage, f"user_{name}_matches_reference", t, ref[stage],
                                      "float64 autograd (every row)", ()))
        else:
            checks.append(unjudged(4, f"user_{name}_matches_reference", "not_applicable",
                                   "K-bar and V-bar sum over every query row; the float64 reference sampled some"))
        if run.sdpa_grads is not None:
            checks.append(_agree(f"user_{name}_matches_sdpa", t, run.sdpa_grads[stage], rtol, atol,
                                 "autograd of F.scaled_dot_product_attention (every row)"))


def _user_agree(run: Backward, stage: str, name: str, got: "Tensor", want: "Tensor", against: str,
                spans: tuple[tuple[int, int], ...]) -> Check:
    """A saved gradient against float64 autograd: within ``c * eps * M`` of the ledger's own stage
    (its ``M``, :func:`grad_rounding`) where known, the reference tolerance otherwise."""
    from attn_ledger.engine import rounding

    m = None if run.mags is None else run.mags.get(stage)
    if m is None or tuple(m.shape) != tuple(got.shape) or got.shape != want.shape:
        rtol, atol = tolerance.reference(got.dtype)
        return _agree(name, got, want, rtol, atol, against)
    a = rounding.agreement(stage, "given", got, want, m, tolerance.dtype_name(got.dtype), 0, None)
    return rounded_check(stage, name, located(a, spans, stage != "grad_q"), against)


def _agree(name: str, got: "Tensor", want: "Tensor", rtol: float, atol: float, against: str) -> Check:
    d, ex = C.excess_error(got, want, rtol, atol * max(1.0, C.max_abs(want)))
    return C.compare_check(name, d, ex, rtol, atol, against)


# --- the built-in pipeline: the output's O-bar, projections and input ------------------------------------

def config_context_row(rows: Rows, ops: Any, go_out: "Tensor", wo: "Tensor", nh: int, dv: int,
                       ref: "dict[str, Tensor]", plan: "Plan", source: dict[str, Any]) -> "Tensor | None":
    """``grad_context`` for the built-in pipeline: ``O-bar`` of the output back through the output projection and merge."""
    import torch

    from attn_ledger.engine.builtin import grad_context

    b, tq, _ = go_out.shape
    go = rows.run("grad_context", lambda: grad_context(ops, go_out, wo, nh))
    if go is None:
        return None
    want = (b, nh, tq, dv)
    checks = [C.shape_check(go.shape, want, AXES["grad_context"]), C.finite_check(C.nonfinite_count(go), "O-bar values")]
    if tuple(go.shape) == want:
        spans = plan.reference_spans
        got = torch.cat([go[:, :, r0:r1] for r0, r1 in spans], dim=2)  # [B, Nh, R, Dv]
        checks.append(_context_rounded(got, go_out, wo, nh, ref["grad_context"], plan))
    rows.stage("grad_context", tuple(go.shape), checks)
    rows.row_notes["grad_context"] = Note("grad_seed", {"on": "output", **source})
    rows.tensors["grad_context"] = go
    return go if tuple(go.shape) == want else None


def _context_rounded(got: "Tensor", go_out: "Tensor", wo: "Tensor", nh: int, want: "Tensor", plan: "Plan") -> Check:
    """``O-bar`` on the sampled rows against float64 within ``c * eps * M``, ``M = |O-bar of the output| |W_o|``
    (E terms, split by heads); the reference tolerance where the reference is not float64."""
    import math

    import torch

    from attn_ledger.engine import rounding
    from attn_ledger.engine.execute import sample_rows
    from attn_ledger.maths.reference import heads_of

    against = f"float64 autograd ({sampled_words(plan)})"
    if want.dtype != torch.float64:
        rtol, atol = tolerance.reference(got.dtype)
        return _agree("matches_reference", got, want, rtol, atol, against)
    picked = sample_rows(plan.reference_spans, go_out.device)
    e = go_out.shape[-1]
    m = heads_of(go_out[:, picked].to(torch.float64).abs() @ wo.to(torch.float64).abs(), nh)  # [B, Nh, R, Dv]
    m = m * (1.0 + math.sqrt(e))
    a = rounding.agreement("grad_context", "pipeline", got, want, m, tolerance.dtype_name(got.dtype), 0, None)
    return rounded_check("grad_context", "matches_reference", located(a, plan.reference_spans, False), against)


def config_rows(rows: Rows, ops: Any, run: Backward, inp: Any, go_out: "Tensor", merged: "Tensor",
                ref: "dict[str, Tensor]", sdpa: "dict[str, Tensor] | None", plan: "Plan") -> None:
    """``grad_projections`` and ``grad_input``: from the attention's gradients, against float64 and SDPA autograd."""
    import torch

    from attn_ledger.engine.builtin import grad_checks, grad_input, grad_projections

    cross = inp.x_kv is not inp.x
    w = inp.weights
    full = rows.run("grad_projections", lambda: grad_projections(ops, run.dq, run.dk, run.dv, go_out, inp.x, inp.x_kv, merged))
    if full is None:
        return
    if run.every_row:
        partial_dq, partial_dk, partial_dv, go_s = run.dq, run.dk, run.dv, go_out
    else:  # what the sampled rows alone give: the rest of O-bar set to zero
        picked = torch.zeros(go_out.shape[1], dtype=torch.bool, device=go_out.device)
        for r0, r1 in plan.reference_spans:
            picked[r0:r1] = True
        go_s = go_out * picked[None, :, None]
        partial_dq, partial_dk, partial_dv = run.dq * picked[None, None, :, None], run.dk_sample, run.dv_sample
    partial = grad_projections(ops, partial_dq, partial_dk, partial_dv, go_s, inp.x, inp.x_kv, merged)
    shapes = {"wq": tuple(w.wq.shape), "wk": tuple(w.wk.shape), "wv": tuple(w.wv.shape), "wo": tuple(w.wo.shape)}
    words = sampled_words(plan)
    ref_w = {n: ref[f"grad_{n}"] for n in shapes}
    rows.stage("grad_projections", None, grad_checks(full, shapes, AXES["grad_projections"], partial, ref_w,
                                                     None if sdpa is None else {n: sdpa[n] for n in shapes}, words))
    rows.tensors.update({f"grad_{n}": t for n, t in full.items()})
    gin = rows.run("grad_input", lambda: grad_input(ops, run.dq, run.dk, run.dv, w, cross))
    if gin is None:
        return
    shapes_x = {"x": tuple(inp.x.shape), **({"x_kv": tuple(inp.x_kv.shape)} if cross else {})}
    part_x = grad_input(ops, partial_dq, partial_dk, partial_dv, w, cross)
    ref_x = {"x": ref["grad_x"], **({"x_kv": ref["grad_x_kv"]} if cross else {})}
    sd_x = None if sdpa is None else {n: sdpa[n] for n in shapes_x}
    rows.stage("grad_input", tuple(gin["x"].shape), grad_checks(gin, shapes_x, AXES["grad_input"], part_x, ref_x, sd_x, words))
    rows.tensors.update({f"grad_{n}": t for n, t in gin.items()})


# --- the two orchestrations: the built-in pipeline, and given q, k, v ----------------------------------------

def seed_data(value: Any) -> dict[str, Any]:
    """How ``O-bar`` was seeded, for the ``grad_context`` row's note: ``ones``, ``identity`` or a ``file``."""
    if value is None or value == "ones":
        return {"seed": "ones", "path": None}
    if value == "identity":
        return {"seed": "identity", "path": None}
    return {"seed": "file", "path": str(value)}


def config_backward(rows: Rows, ops: Any, cfg: Any, inp: Any, fwd: Forward, merged: "Tensor", relation: "Relation",
                    keep_going: bool) -> None:
    """The backward rows of the built-in pipeline: O-bar on the output, back to the projections and the input."""
    from attn_ledger.engine import given as inputs
    from attn_ledger.engine.builtin import sdpa_chain_gradients
    from attn_ledger.devices import reference_dtype
    from attn_ledger.engine.execute import sample_allow, sample_rows
    from attn_ledger.maths.reference import reference_chain_gradients

    b, tq, e = inp.x.shape
    go_out = inputs.grad_seed(cfg.grad_output, (b, tq, e), inp.x.dtype, inp.x.device, heads=cfg.num_heads)
    plan, w = fwd.plan, inp.weights
    rot = None if fwd.rotation is None else (fwd.rotation.spec, fwd.rotation.q_start)
    picked = sample_rows(plan.reference_spans, inp.x.device)
    ref = reference_chain_gradients(inp.x, None if inp.x_kv is inp.x else inp.x_kv, (w.wq, w.wk, w.wv, w.wo),
                                    cfg.num_heads, cfg.nkv, picked, go_out[:, picked],
                                    allow_mask=sample_allow(relation, plan.reference_spans, cfg.tk),
                                    scale=fwd.sdpa_scale, empty_rows="zeros" if fwd.empty_zero else "nan",
                                     rope=rot, dtype=reference_dtype(inp.x.device), softcap=fwd.softcap,
                                    sinks=fwd.sinks)
    go = config_context_row(rows, ops, go_out, w.wo, cfg.num_heads, cfg.dv, ref, plan, seed_data(cfg.grad_output))
    if go is None or (rows.failed() and not keep_going):
        return
    run = core_backward(rows, ops, fwd, go, ref, replay=cfg.replay, go_ref=ref.get("grad_context"))
    if run is None or (rows.failed() and not keep_going):
        return
    sdpa = None
    if b and all(blk.layout.all_live for blk in plan.blocks):
        whole = plan.sdpa_whole_causal and fwd.softcap is None and fwd.sinks is None
        allow = None if whole else relation.block(0, tq)
        sdpa = sdpa_chain_gradients(inp, cfg.num_heads, cfg.nkv, allow, whole, fwd.sdpa_scale, fwd.rotation, go_out,
                                    fwd.softcap, fwd.sinks)
    config_rows(rows, ops, run, inp, go_out, merged, ref, sdpa, plan)


def tensor_backward(rows: Rows, fwd: Forward, grad_output: Any, grads: "dict[str, Tensor]", one_head: bool,
                    replay: bool) -> None:
    """The backward rows on given Q, K, V: O-bar on the context (or the saved grad_out), then the stages."""
    from attn_ledger.engine import given as inputs
    from attn_ledger.devices import reference_dtype
    from attn_ledger.engine.execute import sample_allow, sample_rows
    from attn_ledger.maths.pipeline import HEALTHY, with_sinks, with_softcap
    from attn_ledger.maths.reference import reference_gradients

    q_in, k_in, v_in = fwd.q_in, fwd.k_in, fwd.v_in
    b, nh, tq, _ = q_in.shape
    shapes = {"grad_context": (b, nh, tq, v_in.shape[-1]), "grad_q": tuple(q_in.shape), "grad_k": tuple(k_in.shape),
              "grad_values": tuple(v_in.shape)}
    given, broken = inputs.given_grads(grads, one_head, shapes)
    seed_broken = next((x for x in broken if x.stage == "grad_context"), None)
    seeded = seed_broken is None
    value = given.get("grad_out", grad_output)
    go = inputs.grad_seed(value, shapes["grad_context"], q_in.dtype, q_in.device, one_head=one_head)
    source = ({"seed": "saved", "path": None} if "grad_out" in given else
              {"seed": "saved_wrong_shape", "path": None} if not seeded else seed_data(grad_output))
    context_row(rows, go, source, seed_broken)
    plan = fwd.plan
    picked = sample_rows(plan.reference_spans, q_in.device)
    start = 0 if fwd.rotation is None else fwd.rotation.q_start
    ref = reference_gradients(q_in[:, :, picked], k_in, v_in, go[:, :, picked], q_positions=picked + start,
                              allow_mask=sample_allow(fwd.relation, plan.reference_spans, k_in.shape[2]),
                              scale=fwd.sdpa_scale, empty_rows="zeros" if fwd.empty_zero else "nan",
                              rope=None if fwd.rotation is None else (fwd.rotation.spec,),
                              dtype=reference_dtype(q_in.device), softcap=fwd.softcap, sinks=fwd.sinks)
    run = core_backward(rows, with_sinks(with_softcap(HEALTHY, fwd.softcap), fwd.sinks), fwd, go, ref, replay=replay)
    if run is not None:
        user_grads(rows, run, ref, given, broken, plan, seeded)
