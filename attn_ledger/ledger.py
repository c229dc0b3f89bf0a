"""The attention ledger: run attention as named stages, check each, name the first divergence.

Three entry points build a :class:`~attn_ledger.report.Report`:

* :func:`run_ledger` runs the built-in multi-head attention from a :class:`RunConfig`
  (stages ``input`` .. ``output``), optionally with one deliberate fault.
* :func:`ledger_on_qkv` / :func:`run_ledger_tensors` run given or saved Q, K, V (and
  optionally the user's own ``scores``, ``weights`` and ``out``) through ``input``,
  ``scores``, ``masked_scores``, ``weights`` and ``context``.

Both may add a ``rope`` row before the scores (rotary positions), always add a ``properties``
row after the forward stages (boundary properties on a probe, :mod:`attn_ledger.engine.properties`)
and, with ``grad``, the backward rows after it (:mod:`attn_ledger.ledger_backward`). ``replay``
runs the forward again and checks the two bitwise.

This module orchestrates the engine (:mod:`attn_ledger.engine`): the relation is parsed
and built (``relations``), the score-grid stages are planned (``plan``), run block by
block (``execute``), and the measurements folded and judged (``judge``); the built-in
pipeline's other stages are measured whole (``builtin``). Checks are folded over blocks,
so the first divergence is the first by stage order over all blocks. The float64
reference may run on a sample of query rows at large sizes (the ledger says which); the
SDPA reference runs on every row.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger import checks as C
from attn_ledger.cells import locate
from attn_ledger import tolerance
from attn_ledger.engine import builtin, inputs, relations
from attn_ledger.engine.backends import SDPA_BACKENDS, backend_matrix, resolve_backends
from attn_ledger.engine.execute import ProgressFn, reference_dtype
from attn_ledger.engine.judge import AXES as GRID_AXES
from attn_ledger.engine.judge import GRAD_AXES, GRID_STAGES, Verdicts
from attn_ledger.engine.measure import Broken, Where
from attn_ledger.engine.rows import Rows as _Rows
from attn_ledger.report import Report, Row, unjudged

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.config import RunConfig
    from attn_ledger.engine.relations import Relation

__all__ = ["CONFIG_STAGES", "TENSOR_STAGES", "SDPA_BACKENDS", "ProgressFn", "ledger_on_qkv", "resolve_backends",
           "run_ledger", "run_ledger_tensors"]

CONFIG_STAGES = ("input", "head_roundtrip", "q", "k", "v", "scores", "masked_scores", "weights", "context", "merged", "output")
TENSOR_STAGES = ("input", "scores", "masked_scores", "weights", "context")

AXES = {**builtin.AXES, **GRID_AXES, "rope": "[B,Nh,Tq,Dh]", "properties": "probe", **GRAD_AXES, **builtin.GRAD_AXES}
PICTURE_MAX = 16  # the relation is pictured when Tq and Tk are at most this
COUNTS_MAX = 32  # allowed keys per query are listed when Tq is at most this
ARRAY_MAX = 4096  # stage tensors with at most this many entries go into the JSON as nested arrays


def config_stages(rope: bool = False, grad: bool = False) -> tuple[str, ...]:
    """The built-in pipeline's rows, in order (:mod:`attn_ledger.stages`): ``rope`` after ``v``, ``properties``
    after ``output``, the backward last."""
    from attn_ledger import stages

    return stages.stage_names(stages.PIPELINE, rope=rope, grad=grad)


def tensor_stages(rope: bool = False, grad: bool = False) -> tuple[str, ...]:
    """The rows of a ledger on given Q, K, V, in order."""
    from attn_ledger import stages

    return stages.stage_names(stages.TENSORS, rope=rope, grad=grad)


@dataclass(frozen=True)
class _Grid:
    """What the score-grid stages hand on: the contexts, the verdicts and the plan."""

    context: "Tensor | None"
    sdpa_context: "Tensor | None"
    ref_context: dict[tuple[int, int], "Tensor"]
    verdicts: Verdicts
    plan: Any = None


def run_ledger(config: "RunConfig", *, keep_going: bool = False, progress: ProgressFn | None = None,
               backends: "str | list[str] | None" = None, ops: Any = None) -> Report:
    """Run the built-in multi-head attention as named stages and check each.

    Args:
        config: a validated :class:`~attn_ledger.config.RunConfig` (``grad``, ``replay``, ``rope``,
            ``scale`` and ``temperature`` among its keys).
        keep_going: evaluate every row after the first divergence (marked ``downstream``)
            instead of stopping there (later rows ``not_reached``).
        progress: optional ``callback(done, total)`` over query blocks.
        backends: ``"all"`` or SDPA backend names: the context comparison per backend (see :func:`ledger_on_qkv`).
        ops: stage functions to run instead of the built-in ones (a :class:`~attn_ledger.pipeline.Ops`;
            for testing an implementation of the stages, or the ledger itself); the config's fault is then ignored.

    Returns:
        The :class:`~attn_ledger.report.Report`; ``report.first_finding`` is the diagnosis.
    """
    from attn_ledger.pipeline import ops_for

    cfg = config
    device, dtype = inputs.resolve_device(cfg.device), inputs.torch_dtype(cfg.dtype)
    b, tq, tk, nh = cfg.batch_size, cfg.tq, cfg.tk, cfg.num_heads
    relation = relations.build(relations.from_config(cfg), b, nh, tq, tk, device)
    ops = ops or ops_for(cfg.fault)
    spec = cfg.rope_spec
    rows = _Rows()
    title, meta = _config_title(cfg, relation, device)
    inp = builtin.make_inputs(cfg, dtype, device, reference_dtype(device))
    order = config_stages(spec is not None, cfg.grad)
    empty_zero = cfg.empty_rows == "zeros"

    def done() -> Report:
        _arrays(rows, meta, False)
        return _finish("run", title, order, rows, keep_going, meta, relation, tq, tk, empty_zero)

    rows.shapes["input"] = tuple(inp.x.shape)
    # The input is built from the validated config, so nothing about it can fail here; the row
    # states what was validated instead of carrying checks that could not fail.
    rows.checks["input"] = []
    rows.row_notes["input"] = (f"E == Nh*Dh: {cfg.embed_dim} == {nh}*{cfg.dh} (validated with the config)"
                               + (f"; keys/values from x_kv [B,Tk,E] {list(inp.x_kv.shape)}" if cfg.query_len is not None else ""))
    found = rows.run("head_roundtrip", lambda: builtin.head_roundtrip(ops, b, tq, cfg.embed_dim, nh, cfg.dv))
    if found is not None:
        rows.shapes["head_roundtrip"], rows.checks["head_roundtrip"] = found
    if rows.raised or (rows.failed() and not keep_going):
        return done()
    qkv = _projections(rows, ops, cfg, inp)
    if qkv is None or (rows.failed() and not keep_going):
        return done()
    stages = _rotary(rows, ops, spec, qkv, (inp.q64, inp.k64, inp.v64), saved=False)
    if stages is None or (rows.failed() and not keep_going):
        return done()
    (q, k, v), refs = stages
    expanded = rows.run("scores", lambda: (ops.expand(k, nh), ops.expand(v, nh)))  # [B, Nh, Tk, Dh], [B, Nh, Tk, Dv]
    if expanded is None:
        return done()
    k_exp, v_exp = expanded
    scale = _scale_meta(rows, meta, cfg.scale, cfg.temperature, cfg.dh)
    run_scale = ops.scale_for(cfg.dh, scale)
    grid = _grid(rows, meta, ops, q, k_exp, v_exp, refs, relation, run_scale, empty_zero, ref_scale=scale,
                 block_size=cfg.block_size, keep_grids=cfg.keep_grids, progress=progress, backends=backends)
    if grid.context is None or (rows.failed() and not keep_going):
        return done()
    _after_context(rows, ops, cfg, inp, relation, grid, (q, k_exp, v_exp), qkv, run_scale, scale, keep_going)
    return done()


def _after_context(rows: _Rows, ops: Any, cfg: "RunConfig", inp: builtin.Inputs, relation: "Relation", grid: _Grid,
                   entered: tuple, qkv: tuple, run_scale: float, scale: float, keep_going: bool) -> None:
    """The built-in pipeline after the score grid: merge, output (and replay), properties, the backward."""
    from attn_ledger.engine.backward import Rotation

    b, tq, nh = cfg.batch_size, cfg.tq, cfg.num_heads
    merged = rows.run("merged", lambda: builtin.merged(ops, grid.context, grid.ref_context, b, tq, nh, cfg.dv))
    if merged is None:
        return
    rows.shapes["merged"], rows.checks["merged"] = tuple(merged[0].shape), merged[1]
    if rows.failed() and not keep_going:
        return
    out = rows.run("output", lambda: builtin.output(merged[0], inp.weights.wo, grid.sdpa_context, grid.ref_context,
                                                    b, tq, cfg.embed_dim))
    if out is None:
        return
    rows.shapes["output"], rows.checks["output"], rows.tensors["output"] = tuple(out[0].shape), out[1], out[0]
    spec = cfg.rope_spec
    if cfg.replay:
        rows.checks["output"].append(_replay_config(ops, cfg, inp, spec, relation, grid.plan, run_scale, out[0]))
    if rows.failed() and not keep_going:
        return
    _properties(rows, ops, *entered, relation, run_scale, cfg.grad)
    if cfg.grad and not (rows.failed() and not keep_going):
        fwd = _forward(*entered, qkv, (inp.q64, inp.k64, inp.v64), relation, grid.plan, run_scale, scale,
                       cfg.empty_rows == "zeros", None if spec is None else Rotation(spec, cfg.tk - tq))
        _config_backward(rows, ops, cfg, inp, fwd, merged[0], relation, keep_going)


def _rotary(rows: _Rows, ops: Any, spec: Any, qkv: tuple, refs: tuple, *, saved: bool) -> tuple | None:
    """The ``rope`` row when rotary positions are on: the rotated q, k, v and the reference's; else them unchanged."""
    from attn_ledger.engine.positions import rope_stage

    if spec is None:
        return qkv, refs
    rot = rows.run("rope", lambda: rope_stage(ops, spec, *qkv, refs, saved=saved))
    if rot is None:
        return None
    rows.stage("rope", tuple(rot.q.shape), rot.checks, rot.note)
    return (rot.q, rot.k, rot.v), (rot.q_ref, rot.k_ref, refs[2])


def _scale_meta(rows: _Rows, meta: dict[str, Any], s: float | None, temperature: float | None, dh: int) -> float:
    """The intended score scale S/tau, stated in the notes and details when it is not the default 1/sqrt(Dh)."""
    base = 1.0 / math.sqrt(dh) if s is None else s
    effective = base / (temperature or 1.0)
    if s is not None or temperature is not None:
        meta["scale"] = {"S": base, "temperature": temperature or 1.0, "effective": effective, "default": 1.0 / math.sqrt(dh)}
        rows.notes.append(f"score scale S/tau = {base:.6g}/{temperature or 1.0:g} = {effective:.6g} "
                          f"(default 1/sqrt(Dh) = {1.0 / math.sqrt(dh):.6g}), used by the pipeline, the float64 "
                          "reference and SDPA alike")
    return effective


def _properties(rows: _Rows, ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", relation: "Relation",
                scale: float, grad: bool) -> None:
    from attn_ledger.engine.properties import check_properties, probe_of

    probe = probe_of(q, k_exp, v_exp, relation)
    rows.stage("properties", None, check_properties(ops, q, k_exp, v_exp, relation, scale, grad=grad))
    rows.fields["properties"] = {"probe": [int(probe[0].shape[0]), int(probe[0].shape[1]), int(probe[0].shape[2]),
                                           int(probe[1].shape[2])]}
    rows.row_notes["properties"] = ("probe [B', Nh', Tq', Tk']: the first examples, heads and positions as they "
                                    "entered the scores stage, with the relation there")


def _forward(q, k_exp, v_exp, qkv, refs, relation, plan, scale, sdpa_scale, empty_zero, rotation) -> Any:
    from attn_ledger.ledger_backward import Forward

    return Forward(q, k_exp, v_exp, qkv[0], qkv[1], qkv[2], refs, relation, plan, scale, sdpa_scale, empty_zero, rotation)


def _replay_config(ops: Any, cfg: "RunConfig", inp: builtin.Inputs, spec: Any, relation: "Relation", plan: Any,
                   scale: float, first: "Tensor") -> Any:
    """The whole forward again, from the projections to the output, compared bitwise with the first run."""
    from attn_ledger.engine.execute import replay_context
    from attn_ledger.ledger_backward import replay_check
    from attn_ledger.pipeline import project

    nh, nkv = cfg.num_heads, cfg.nkv
    w = inp.weights
    q, k, v = ops.split(project(inp.x, w.wq), nh), ops.split(project(inp.x_kv, w.wk), nkv), ops.split(project(inp.x_kv, w.wv), nkv)
    if spec is not None:
        q, k, v = ops.rope(q, k, v, spec, cfg.tk - cfg.tq)
    ctx = replay_context(plan, relation, ops, q, ops.expand(k, nh), ops.expand(v, nh), scale, cfg.empty_rows == "zeros")
    second = project(ops.merge(ctx), w.wo)  # [B, Tq, E]
    return replay_check([("output", first, second)], ("example", "query", "feature"))


def _config_backward(rows: _Rows, ops: Any, cfg: "RunConfig", inp: builtin.Inputs, fwd: Any, merged: "Tensor",
                     relation: "Relation", keep_going: bool) -> None:
    """The backward rows of the built-in pipeline: O-bar on the output, back to the projections and the input."""
    from attn_ledger.engine.builtin import sdpa_chain_gradients
    from attn_ledger.engine.execute import sample_allow, sample_rows
    from attn_ledger.ledger_backward import config_context_row, config_rows, core_backward
    from attn_ledger.reference import reference_chain_gradients

    b, tq, e = inp.x.shape
    go_out = inputs.grad_seed(cfg.grad_output, (b, tq, e), inp.x.dtype, inp.x.device, heads=cfg.num_heads)
    plan, w = fwd.plan, inp.weights
    rot = None if fwd.rotation is None else (fwd.rotation.spec, fwd.rotation.q_start)
    picked = sample_rows(plan.reference_spans, inp.x.device)
    ref = reference_chain_gradients(inp.x, None if inp.x_kv is inp.x else inp.x_kv, (w.wq, w.wk, w.wv, w.wo),
                                    cfg.num_heads, cfg.nkv, picked, go_out[:, picked],
                                    allow_mask=sample_allow(relation, plan.reference_spans, cfg.tk),
                                    scale=fwd.sdpa_scale, empty_rows="zeros" if fwd.empty_zero else "nan",
                                    rope=rot, dtype=reference_dtype(inp.x.device))
    source = _seed_words(cfg.grad_output)
    go = config_context_row(rows, ops, go_out, w.wo, cfg.num_heads, cfg.dv, ref, plan, source)
    if go is None or (rows.failed() and not keep_going):
        return
    run = core_backward(rows, ops, fwd, go, ref, replay=cfg.replay)
    if run is None or (rows.failed() and not keep_going):
        return
    sdpa = None
    if b and all(blk.layout.all_live for blk in plan.blocks):
        allow = None if plan.sdpa_whole_causal else relation.block(0, tq)
        sdpa = sdpa_chain_gradients(inp, cfg.num_heads, cfg.nkv, allow, plan.sdpa_whole_causal, fwd.sdpa_scale,
                                    fwd.rotation, go_out)
    config_rows(rows, ops, run, inp, go_out, merged, ref, sdpa, plan)


def _seed_words(value: Any) -> str:
    if value is None or value == "ones":
        return "ones (every entry 1)"
    if value == "identity":
        return "identity (I on each head's [Tq, Dv] block)"
    return f"from {value}"


def _config_title(cfg: "RunConfig", relation: "Relation", device: "torch.device") -> tuple[str, dict[str, Any]]:
    b, tq, tk, e, nh, nkv, dh, dv = cfg.batch_size, cfg.tq, cfg.tk, cfg.embed_dim, cfg.num_heads, cfg.nkv, cfg.dh, cfg.dv
    title = (f"ATTENTION LEDGER B={b} Tq={tq} Tk={tk} E={e} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={cfg.dtype}"
             + (f" fault={cfg.fault}" if cfg.fault else ""))
    meta = {"B": b, "Tq": tq, "Tk": tk, "E": e, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": cfg.dtype, "device": str(device), "fault": cfg.fault, "input": cfg.input, "seed": cfg.seed}
    return title, meta


def _projections(rows: _Rows, ops: Any, cfg: "RunConfig", inp: builtin.Inputs) -> "tuple[Tensor, Tensor, Tensor] | None":
    """The q, k and v stages: project, split into heads, check each; None once one raises."""
    from attn_ledger.pipeline import project

    b, tq, tk, nh, nkv = cfg.batch_size, cfg.tq, cfg.tk, cfg.num_heads, cfg.nkv
    w = inp.weights
    found = []
    for stage, x, wmat, heads, want, ref in (
        ("q", inp.x, w.wq, nh, (b, nh, tq, cfg.dh), inp.q64),  # [B, Nh, Tq, Dh]
        ("k", inp.x_kv, w.wk, nkv, (b, nkv, tk, cfg.dh), inp.k64),  # [B, Nkv, Tk, Dh]
        ("v", inp.x_kv, w.wv, nkv, (b, nkv, tk, cfg.dv), inp.v64),  # [B, Nkv, Tk, Dv]
    ):
        t = rows.run(stage, lambda: ops.split(project(x, wmat), heads))
        if t is None:
            return None
        rows.shapes[stage] = tuple(t.shape)
        rows.checks[stage] = builtin.projection(t, want, stage, ref)
        if stage == "k":
            rows.checks["k"].insert(1, C.kv_pairing_check(ops.expand, nh, nkv))
        found.append(t)
    return found[0], found[1], found[2]


def _grid(rows: _Rows, meta: dict[str, Any], ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor",
          ref: tuple["Tensor", "Tensor", "Tensor"], relation: "Relation", scale: float, empty_zero: bool, *,
          ref_scale: float, given: "dict[str, Tensor] | None" = None, broken: tuple[Broken, ...] = (),
          block_size: int | None, keep_grids: bool, progress: ProgressFn | None,
          backends: "str | list[str] | None") -> _Grid:
    """The score-grid stages: plan, execute block by block, fold and judge; rows, notes and meta filled in."""
    from attn_ledger.engine.execute import Execution
    from attn_ledger.engine.judge import Tally, judge
    from attn_ledger.engine.plan import key_step, make_plan

    b, nh, tq, dh = q.shape
    tk, dv = k_exp.shape[-2], v_exp.shape[-1]
    pairs, unavailable = resolve_backends(backends, q.device, q.dtype, bool(relation.parts), b * nh * tq * tk)
    if unavailable:
        rows.notes.append("SDPA backends not available here: "
                          + ", ".join(f"{n},{dt} ({why})" for (n, dt), why in unavailable.items()))
    plan = make_plan(b, nh, tq, tk, relation, block_size=block_size, keep_grids=keep_grids, given=bool(given),
                     width_step=key_step(q.dtype, q.device.type, tk))
    run = Execution(plan, relation, ops, q, k_exp, v_exp, ref, scale=scale, ref_scale=ref_scale,
                    empty_zero=empty_zero, given=given, backends=pairs, progress=progress)
    tally = Tally.of([*broken, *run.run()])
    derived = {"scores": (b, nh, tq, tk), "masked_scores": (b, nh, tq, tk), "weights": (b, nh, tq, tk),
               "context": (b, nh, tq, dv)}
    verdicts = judge(tally, tolerance.dtype_name(q.dtype), related=bool(relation.parts), empty_zero=empty_zero,
                     derived=derived)
    for stage in GRID_STAGES:
        stopped = tally.broken.get((stage, "pipeline"))
        if stopped is not None and stopped.raised is not None:
            rows.raised[stage] = stopped.raised
        if verdicts.checks[stage] or stage in rows.raised:
            rows.checks[stage] = verdicts.checks[stage]
            one_block = stopped is not None and stopped.shape is not None and len(plan.blocks) == 1 and stage == "scores"
            rows.shapes[stage] = stopped.shape if one_block else derived[stage]
    rows.notes += _plan_notes(plan, q.device)
    if run.loose_range:
        rows.notes.append("context in_value_range: blocks over 2^18 (query, key, value-width) entries compare each row "
                          "with the value range of all the block's keys, a looser bound than the keys that row may use")
    rows.tensors.update(_kept_grids(run.kept, relation, given or {}, b, nh, tq, tk))
    if run.context is not None:
        rows.tensors["context"] = run.context
        if plan.keep and b > 0 and b * nh * tq * tk <= 16 and b * nh * tq * dv <= 16:
            rows.row_notes["weights"] = "weights (b=0, h=0): " + _rows_text(rows.tensors["weights"][0, 0])
            rows.row_notes["context"] = "context (b=0, h=0): " + _rows_text(run.context[0, 0])
    if backends is not None:
        meta["sdpa_backends"] = backend_matrix(verdicts.backends, unavailable)
    _scores_spread(rows, run, plan)
    return _Grid(run.context, run.sdpa_context, run.ref_context, verdicts, plan)


def _scores_spread(rows: _Rows, run: Any, plan: Any) -> None:
    """The scores' standard deviation over every (query, key) pair, before masking, on the float64 reference's
    rows (all of them on small grids): a field of the ``scores`` row."""
    n = run.sample.filled["scores"]
    if "scores" not in rows.checks or not n:
        return
    got = run.sample.got["scores"][:, :, :n]  # [B, Nh, R, Tk], the pipeline's scores on the sampled rows
    if got.numel() < 2:
        return
    rows.fields.setdefault("scores", {})["std"] = float(got.std())
    if plan.reference_rows < plan.tq:
        rows.fields["scores"]["std_rows"] = plan.reference_rows
        rows.notes.append(f"scores std over the {plan.reference_rows} query rows the float64 reference sampled")


def _kept_grids(kept: dict[str, list["Tensor"]], relation: "Relation", given: "dict[str, Tensor]", b: int, nh: int,
                tq: int, tk: int) -> dict[str, Any]:
    """The grids kept whole (small runs, or ``keep_grids``), with the intended relation and any given weights beside them."""
    import torch

    tensors = {name: torch.cat(parts, dim=2) for name, parts in kept.items()}  # [B, Nh, Tq, Tk] each
    allow = relation.block(0, tq) if "scores" in tensors and tensors["scores"].shape[2] == tq else None
    if allow is not None:
        tensors["allow"] = allow.expand(b, nh, tq, tk)  # [B, Nh, Tq, Tk], True = may attend
    if "weights" in given and "weights" in tensors:
        tensors["user_weights"] = given["weights"]
    return tensors


def _plan_notes(plan: Any, device: "torch.device") -> list[str]:
    """What a reader needs to know about the plan: blocks, and the rows the float64 reference covered."""
    notes = []
    if len(plan.blocks) > 1:
        notes.append(f"score-grid stages ran in {len(plan.blocks)} query blocks of {plan.blocks[0].rows} rows")
    if plan.reference_rows < plan.tq:
        shown = ", ".join(f"{r0}..{r1 - 1}" for r0, r1 in plan.reference_spans)
        notes.append(f"{tolerance.dtype_name(reference_dtype(device))} reference on a sample of {plan.reference_rows} "
                     f"of {plan.tq} query rows (rows {shown}); SDPA on all rows")
    return notes


def _rows_text(t: "Tensor") -> str:
    return "[" + ", ".join("[" + ", ".join(f"{x:.6f}" for x in row) + "]" for row in t.tolist()) + "]"


# --- assembling the ledger ---------------------------------------------------------------

def _finish(command: str, title: str, order: tuple[str, ...], rows: _Rows, keep_going: bool, meta: dict[str, Any],
            relation: "Relation", tq: int, tk: int, empty_zero: bool, axes: dict[str, str] | None = None,
            tail: tuple[str, ...] = ()) -> Report:
    """Turn per-stage checks into rows with statuses; the first failing stage is the finding (``tail``: last notes).

    Rows after it are downstream evidence: with ``keep_going`` their failing checks read
    ``downstream``; without it they are not reached. Where whole grids were kept, failing grid
    checks point at their first cell and the cells are marked (:func:`attn_ledger.cells.locate`).
    """
    _show_relation(rows, order, meta, relation, tq, tk)
    rows.notes += tail
    found: list[Row] = []
    diverged = stopped = False
    axes = axes or AXES
    for stage in order:
        checks = list(rows.checks.get(stage, []))
        if stage in rows.raised:
            checks = [C.raised_check(rows.raised[stage])] + checks
        note = rows.row_notes.get(stage, "")
        if stopped or not (stage in rows.checks or stage in rows.raised):
            found.append(Row(stage, "not_reached", tuple(unjudged(c.level, c.name, "not_reached", "") for c in checks),
                             rows.shapes.get(stage), axes[stage], note=note))
            continue
        failing = any(c.failed for c in checks)
        if failing and diverged:
            checks = [c.with_status("downstream") if c.failed else c for c in checks]
            status = "downstream"
        elif failing:
            diverged, status = True, "fail"
        else:
            status = "warn" if any(c.status == "warn" for c in checks) else "pass"
        found.append(Row(stage, status, tuple(checks), rows.shapes.get(stage), axes[stage],
                         fields=rows.fields.get(stage, {}), note=note))
        if stage in rows.raised or (diverged and not keep_going):
            stopped = True
    return locate(Report(command, title, tuple(found), notes=tuple(rows.notes), details=meta, unit="check",
                         row_label="stage", tensors=rows.tensors), empty_zero)


def _show_relation(rows: _Rows, order: tuple[str, ...], meta: dict[str, Any], relation: "Relation", tq: int,
                   tk: int) -> None:
    """The relation's allowed keys per query and its picture, for example 0, or, where examples (or
    heads) differ, for the one of the first finding, saying so."""
    from attn_ledger.masks import picture

    if "masked_scores" in rows.checks:
        rows.fields.setdefault("masked_scores", {}).update(_allowed_pairs(relation, tq, tk))
    if not relation.parts or tq > COUNTS_MAX or not ("scores" in rows.checks or "scores" in rows.raised):
        return
    where = _first_where(rows, order)
    at_divergence = where is not None and relations.varies(relation, tq)
    allow, b, h = relations.view(relation, tq, *((where.example, where.head) if at_divergence else (0, 0)))  # [Tq, Tk]
    if allow is None:  # an empty batch
        return
    counts = [int(n) for n in allow.sum(dim=-1).tolist()]
    if "masked_scores" in rows.fields:
        rows.fields["masked_scores"]["allowed"] = sum(counts)
    meta["relation_shown"] = {"example": b, "head": h, "allowed_keys_per_query": counts, "at_divergence": at_divergence}
    which = f"b={b}, h={h}" + ("; the example of the first finding" if at_divergence else "")
    rows.notes.append(f"allowed keys per query ({which}): {counts}")
    if tq <= PICTURE_MAX and tk <= PICTURE_MAX and "masked_scores" in rows.checks:
        rows.row_notes["masked_scores"] = (f"intended relation ({which}), queries as rows, keys as columns:\n"
                                           + (picture(allow) or ""))


def _allowed_pairs(relation: "Relation", tq: int, tk: int) -> dict[str, int]:
    """``allowed``: the (query, key) pairs the relation allows for example 0, head 0 (the example shown when
    another one diverged); ``pairs``: Tq * Tk."""
    if not relation.parts:
        allowed = tq * tk
    elif relation.top_left_causal:
        allowed = sum(min(i + 1, tk) for i in range(tq))
    else:
        whole = relation.block(0, tq)  # [B|1, Nh|1, Tq, Tk]
        allowed = 0 if whole is None or whole.shape[0] == 0 else int(relations.view(relation, tq)[0].sum())
    return {"allowed": allowed, "pairs": tq * tk}


def _arrays(rows: _Rows, meta: dict[str, Any], one_head: bool) -> None:
    """Stage tensors of at most ARRAY_MAX entries, as nested lists under ``details["arrays"]`` (one head: no Nh axis)."""
    found = {}
    for name in ("scores", "masked_scores", "weights", "context", "output", "grad_context", "grad_weights",
                 "grad_values", "grad_scores", "grad_q", "grad_k", "grad_x", "grad_x_kv"):
        t = rows.tensors.get(name)
        if t is None or t.numel() > ARRAY_MAX or t.dim() < 3:
            continue
        if one_head and t.dim() == 4 and t.shape[1] == 1:
            t = t[:, 0]
        found[name] = t.detach().cpu().double().tolist()
    if found:
        meta["arrays"] = found


def _first_where(rows: _Rows, order: tuple[str, ...]) -> Where | None:
    """Where the first finding's check failed, if the engine located it."""
    for stage in order:
        if stage in rows.raised:
            return None
        failing = [c for c in rows.checks.get(stage, []) if c.failed]
        if failing:
            loc = min(failing, key=lambda c: c.level).location
            return None if not loc or "example" not in loc else Where(loc["example"], loc.get("head", 0), loc.get("query", 0))
    return None


# --- given or saved tensors -------------------------------------------------------------

def ledger_on_qkv(  # long for its documented arguments; the body is the stages in order
    q: "Tensor",
    k: "Tensor",
    v: "Tensor",
    *,
    allow_mask: "Tensor | None" = None,
    key_valid: "Tensor | None" = None,
    mask: str = "none",
    window: int | None = None,
    prefix_len: int | None = None,
    scores: "Tensor | None" = None,
    weights: "Tensor | None" = None,
    out: "Tensor | None" = None,
    empty_rows: str = "error",
    block_size: int | None = None,
    keep_grids: bool = False,
    keep_going: bool = False,
    progress: ProgressFn | None = None,
    source: str = "tensors",
    backends: "str | list[str] | None" = None,
    scale: float | None = None,
    temperature: float | None = None,
    rope: Any = None,
    grad: bool = False,
    grad_output: "str | Tensor | None" = None,
    grads: "dict[str, Tensor] | None" = None,
    replay: bool = False,
) -> Report:
    """Run the ledger on given Q, K, V (and optionally the user's own intermediates and gradients).

    Args:
        q: ``[B, Tq, Dh]`` (one head) or ``[B, Nh, Tq, Dh]``.
        k: ``[B, Tk, Dh]`` or ``[B, Nkv, Tk, Dh]`` (Nkv divides Nh).
        v: ``[B, Tk, Dv]`` or ``[B, Nkv, Tk, Dv]``.
        allow_mask: bool ``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, Nh, Tq, Tk]``, True = may attend.
        key_valid: bool ``[B, Tk]``, True = a real key (placed as ``[B, 1, 1, Tk]``).
        mask: relations to add by name, joined by ``+``: ``causal`` (bottom-right),
            ``causal-top-left``, ``sliding-window`` (with ``window``), ``prefix-lm`` (with ``prefix_len``).
        scores, weights, out: the user's own intermediates (scores scaled, before masking),
            shaped like the derived grid / context; each is compared with the reference, and
            one of another shape is an L1 finding (``user_*_shape``) at its stage.
        empty_rows: ``"error"`` (a query with every key blocked is a divergence) or
            ``"zeros"`` (such rows are declared and must come out as zeros).
        backends: ``"all"`` or SDPA backend names (math, flash, efficient, cudnn): repeat the
            context comparison per backend the device offers, as ``sdpa[backend,dtype]`` checks.
        scale, temperature: the score scale is ``scale / temperature`` (default ``1/sqrt(Dh)``), in the
            pipeline and every reference alike.
        rope: rotary positions applied to q and k before the scores (a :class:`~attn_ledger.rotary.RotarySpec`
            or its text, ``PAIRING[,base=B][,dim=D]``); query i at position ``i + Tk - Tq``.
        grad: run and check the backward stages, seeded with ``grad_output`` on the context: ``"ones"``
            (default), ``"identity"`` (I on each head's ``[Tq, Dv]`` block), a tensor file or a tensor.
        grads: the user's own ``grad_out`` (the seed, then), ``dq``, ``dk``, ``dv``; each of the wrong
            shape is an L1 finding at its stage.
        replay: run the forward (and the backward) twice and check the results bitwise.

    Returns:
        The :class:`~attn_ledger.report.Report` for stages input, (rope,) scores, masked_scores, weights,
        context, properties (and the backward's).
    """
    from attn_ledger.errors import InputError
    from attn_ledger.pipeline import HEALTHY

    inputs.validate_qkv(q, k, v)
    one_head = q.dim() == 3
    if one_head:
        q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, T, D]
    b, nh, tq, dh = q.shape
    tk, dv = k.shape[2], v.shape[-1]
    relations.check_saved(allow_mask, key_valid, b, nh, tq, tk)
    spec = relations.parse(mask, tq=tq, tk=tk, window=window, prefix_len=prefix_len, allowed=relations.TENSOR_RELATIONS)
    relation = relations.build(spec, b, nh, tq, tk, q.device, allow_mask, key_valid)
    if empty_rows not in ("error", "zeros"):
        raise InputError(f"empty_rows: got {empty_rows!r}, expected 'error' or 'zeros'")
    rotation_spec = _rope_spec(rope, dh)
    grads = {n: t for n, t in (grads or {}).items() if t is not None}
    _check_options(scale, temperature, grad, grad_output, grads)
    given, broken = inputs.given_tensors({"scores": scores, "weights": weights, "out": out}, one_head, b, nh, tq, tk, dv)
    rows = _Rows()
    title, meta = _tensor_rows(rows, q, k, v, one_head, relation, source, given)
    order = tensor_stages(rotation_spec is not None, grad)
    empty_zero = empty_rows == "zeros"

    def done() -> Report:
        _arrays(rows, meta, one_head)
        aligned = (("allow_mask alignment: " + relations.alignment_of(allow_mask, b, nh, tq, tk),)
                   if allow_mask is not None and tq != tk else ())
        return _finish("run", title, order, rows, keep_going, meta, relation, tq, tk, empty_zero,
                       {**AXES, "input": "[B,Nh,Tq,Dh]"}, aligned)

    stages = _rotary(rows, HEALTHY, rotation_spec, (q, k, v), (q, k, v), saved=True)
    if stages is None or (rows.failed() and not keep_going):
        return done()
    (qr, kr, vr), refs = stages
    ref_scale = _scale_meta(rows, meta, scale, temperature, dh)
    k_exp, v_exp = HEALTHY.expand(kr, nh), HEALTHY.expand(vr, nh)
    # Q, K, V go to the reference as given: cast to its dtype and kv heads repeated by its own code
    grid = _grid(rows, meta, HEALTHY, qr, k_exp, v_exp, refs, relation, ref_scale, empty_zero, ref_scale=ref_scale,
                 given=given, broken=tuple(broken), block_size=block_size, keep_grids=keep_grids, progress=progress,
                 backends=backends)
    if grid.context is None or (rows.failed() and not keep_going):
        return done()
    if replay:
        rows.checks["context"].append(_replay_tensors(grid, relation, qr, k_exp, v_exp, ref_scale, empty_zero))
    _properties(rows, HEALTHY, qr, k_exp, v_exp, relation, ref_scale, grad)
    if grad and not (rows.failed() and not keep_going):
        from attn_ledger.engine.backward import Rotation

        fwd = _forward(qr, k_exp, v_exp, (q, k, v), (q, k, v), relation, grid.plan, ref_scale, ref_scale, empty_zero,
                       None if rotation_spec is None else Rotation(rotation_spec, tk - tq))
        _tensor_backward(rows, fwd, grad_output, grads, one_head, replay)
    return done()


def _rope_spec(rope: Any, dh: int) -> Any:
    """The rotary spec ``rope`` names (validated against the head width), or None."""
    from attn_ledger.errors import InputError
    from attn_ledger.rotary import parse_spec

    if rope is None:
        return None
    spec = parse_spec(rope)
    try:
        spec.width(dh)
    except InputError as exc:
        raise InputError(str(exc)) from None
    return spec


def _check_options(scale: Any, temperature: Any, grad: bool, grad_output: Any, grads: "dict[str, Tensor]") -> None:
    """A scale or temperature that is not a positive finite number, or a backward option without ``grad``: exit 2."""
    from attn_ledger.errors import InputError

    for name, value in (("scale", scale), ("temperature", temperature)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise InputError(f"{name}: got {value!r}, expected a finite number greater than 0")

    if grad_output is not None and not grad:
        raise InputError(f"grad_output: got {grad_output if isinstance(grad_output, str) else 'a tensor'!r}, "
                         "expected it only with grad (--grad)")
    if grads and not grad:
        raise InputError(f"tensors: holds saved gradients {sorted(grads)}, expected them only with grad (--grad), "
                         "which compares them with the backward stages")
    if "grad_out" in grads and grad_output is not None:
        raise InputError("grad_output: got one together with a saved grad_out, expected one seed for O-bar")


def _replay_tensors(grid: _Grid, relation: "Relation", q: "Tensor", k_exp: "Tensor", v_exp: "Tensor", scale: float,
                    empty_zero: bool) -> Any:
    from attn_ledger.engine.execute import replay_context
    from attn_ledger.ledger_backward import replay_check
    from attn_ledger.pipeline import HEALTHY

    second = replay_context(grid.plan, relation, HEALTHY, q, k_exp, v_exp, scale, empty_zero)
    return replay_check([("context", grid.context, second)], ("example", "head", "query", "feature"))


def _tensor_backward(rows: _Rows, fwd: Any, grad_output: Any, grads: "dict[str, Tensor]", one_head: bool,
                     replay: bool) -> None:
    """The backward rows on given Q, K, V: O-bar on the context (or the saved grad_out), then the stages."""
    from attn_ledger.engine.execute import sample_allow, sample_rows
    from attn_ledger.ledger_backward import context_row, core_backward, user_grads
    from attn_ledger.pipeline import HEALTHY
    from attn_ledger.reference import reference_gradients

    q_in, k_in, v_in = fwd.q_in, fwd.k_in, fwd.v_in
    b, nh, tq, _ = q_in.shape
    shapes = {"grad_context": (b, nh, tq, v_in.shape[-1]), "grad_q": tuple(q_in.shape), "grad_k": tuple(k_in.shape),
              "grad_values": tuple(v_in.shape)}
    given, broken = inputs.given_grads(grads, one_head, shapes)
    seed_broken = next((x for x in broken if x.stage == "grad_context"), None)
    seeded = seed_broken is None
    value = given.get("grad_out", grad_output)
    go = inputs.grad_seed(value, shapes["grad_context"], q_in.dtype, q_in.device, one_head=one_head)
    source = ("the saved grad_out" if "grad_out" in given else
              "ones (every entry 1; the saved grad_out has the wrong shape)" if not seeded else _seed_words(grad_output))
    context_row(rows, go, source, seed_broken)
    plan = fwd.plan
    picked = sample_rows(plan.reference_spans, q_in.device)
    start = 0 if fwd.rotation is None else fwd.rotation.q_start
    ref = reference_gradients(q_in[:, :, picked], k_in, v_in, go[:, :, picked], q_positions=picked + start,
                              allow_mask=sample_allow(fwd.relation, plan.reference_spans, k_in.shape[2]),
                              scale=fwd.sdpa_scale, empty_rows="zeros" if fwd.empty_zero else "nan",
                              rope=None if fwd.rotation is None else (fwd.rotation.spec,),
                              dtype=reference_dtype(q_in.device))
    run = core_backward(rows, HEALTHY, fwd, go, ref, replay=replay)
    if run is not None:
        user_grads(rows, run, ref, given, broken, plan, seeded)


def _tensor_rows(rows: _Rows, q: "Tensor", k: "Tensor", v: "Tensor", one_head: bool, relation: "Relation",
                 source: str, given: "dict[str, Tensor]") -> tuple[str, dict[str, Any]]:
    """The input row, the title and the facts of a ledger on given Q, K, V."""
    b, nh, tq, dh = q.shape
    nkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = tolerance.dtype_name(q.dtype)
    rows.shapes["input"] = tuple(q.shape)
    # Q, K, V were validated on the way in (ranks, batch, widths, token counts, kv heads, finite
    # values); the row says so instead of carrying checks that could not fail.
    rows.checks["input"] = []
    rows.row_notes["input"] = (f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
                               + (" (one head: Nh=1 inserted)" if one_head else "")
                               + "; batch, widths, token counts and finite values validated on load"
                               + (f"; query head h reads kv head h // {nh // nkv}" if nkv != nh else ""))
    title = (f"ATTENTION LEDGER ({source}) B={b} Tq={tq} Tk={tk} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={dtype}")
    meta = {"B": b, "Tq": tq, "Tk": tk, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": dtype, "device": str(q.device), "given": sorted(["q", "k", "v", *given])}
    return title, meta


def run_ledger_tensors(
    path: "str | os.PathLike[str] | Mapping[str, Tensor]",
    *,
    mask: str = "none",
    window: int | None = None,
    prefix_len: int | None = None,
    empty_rows: str = "error",
    dtype: str | None = None,
    device: str = "cpu",
    block_size: int | None = None,
    keep_grids: bool = False,
    keep_going: bool = False,
    progress: ProgressFn | None = None,
    backends: "str | list[str] | None" = None,
    source: str | None = None,
    scale: float | None = None,
    temperature: float | None = None,
    rope: Any = None,
    grad: bool = False,
    grad_output: "str | None" = None,
    replay: bool = False,
) -> Report:
    """Load a ``.pt``/``.safetensors``/``.npz`` file of q, k, v (and optional masks, intermediates and gradients
    ``grad_out``, ``dq``, ``dk``, ``dv``) and run the ledger (see :func:`ledger_on_qkv`).

    ``path`` may also be the file's tensors, loaded already with
    :func:`~attn_ledger.tensorio.load_tensor_file`; ``source`` then names them in the title.
    """
    source = source or (str(path) if isinstance(path, (str, os.PathLike)) else "tensors")
    t = inputs.load(path, None if dtype is None else inputs.torch_dtype(dtype), inputs.resolve_device(device), source)
    return ledger_on_qkv(
        t["q"], t["k"], t["v"], allow_mask=t.get("allow_mask"), key_valid=t.get("key_valid"), mask=mask,
        window=window, prefix_len=prefix_len, scores=t.get("scores"), weights=t.get("weights"), out=t.get("out"),
        empty_rows=empty_rows, block_size=block_size, keep_grids=keep_grids, keep_going=keep_going,
        progress=progress, source=source, backends=backends, scale=scale, temperature=temperature, rope=rope,
        grad=grad, grad_output=grad_output, grads={n: t.get(n) for n in ("grad_out", "dq", "dk", "dv")}, replay=replay)
