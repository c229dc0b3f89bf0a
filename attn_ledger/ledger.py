"""The attention ledger: run attention as named stages, check each, name the first divergence.

Three entry points build a :class:`~attn_ledger.report.Report`:

* :func:`run_ledger` runs the built-in multi-head attention from a :class:`RunConfig`
  (stages ``input`` .. ``output``), optionally with one deliberate fault.
* :func:`ledger_on_qkv` / :func:`run_ledger_tensors` run given or saved Q, K, V (and
  optionally the user's own ``scores``, ``weights`` and ``out``) through ``input``,
  ``scores``, ``masked_scores``, ``weights`` and ``context``.

Both may add a ``rope`` row before the scores (rotary positions), always add a ``properties``
row after the forward stages (boundary properties on a probe, :mod:`attn_ledger.engine.properties`)
and, with ``grad``, the backward rows after it (:mod:`attn_ledger.engine.backward_rows`). ``replay``
runs the forward again and checks the two bitwise.

This module orchestrates the engine (:mod:`attn_ledger.engine`): the relation is parsed
and built (``relations``); the score-grid stages are planned (``plan``), run block by
block (``execute``), and the measurements folded and judged (``judge``), all through
``grid``; the built-in pipeline's other stages are measured whole (``builtin``); rotary
positions, properties, replay and the backward rows have their own modules (``positions``,
``properties``, ``replay``, ``backward_rows``); ``assemble`` turns the rows into the report. Checks are folded over blocks,
so the first divergence is the first by stage order over all blocks. The float64
reference may run on a sample of query rows at large sizes (the ledger says which); the
SDPA reference runs on every row.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

from attn_ledger.engine import assemble, builtin, given as inputs
from attn_ledger.maths import relations
from attn_ledger.engine.backends import SDPA_BACKENDS, resolve_backends
from attn_ledger.devices import reference_dtype, resolve_device, torch_dtype
from attn_ledger.engine.execute import ProgressFn
from attn_ledger.engine.grid import Grid, run_grid, scale_meta, sinks_meta, softcap_meta
from attn_ledger.engine.positions import rope_row
from attn_ledger.engine.properties import properties_row
from attn_ledger.engine.rows import Rows
from attn_ledger.report import Report

if TYPE_CHECKING:
    from torch import Tensor

    from attn_ledger.inputs.config import RunConfig
    from attn_ledger.maths.relations import Relation, RelationSpec

__all__ = ["CONFIG_STAGES", "TENSOR_STAGES", "SDPA_BACKENDS", "ProgressFn", "ledger_on_qkv", "resolve_backends",
           "run_ledger", "run_ledger_tensors"]

CONFIG_STAGES = ("input", "head_roundtrip", "q", "k", "v", "scores", "masked_scores", "weights", "context", "merged", "output")
TENSOR_STAGES = ("input", "scores", "masked_scores", "weights", "context")


def config_stages(rope: bool = False, grad: bool = False, sinks: bool = False) -> tuple[str, ...]:
    """The built-in pipeline's rows, in order (:mod:`attn_ledger.engine.stages`): ``rope`` after ``v``, ``properties``
    after ``output``, the backward last (``grad_sinks`` in it with sinks)."""
    from attn_ledger.engine import stages

    return stages.stage_names(stages.PIPELINE, rope=rope, grad=grad, sinks=sinks)


def tensor_stages(rope: bool = False, grad: bool = False, sinks: bool = False) -> tuple[str, ...]:
    """The rows of a ledger on given Q, K, V, in order."""
    from attn_ledger.engine import stages

    return stages.stage_names(stages.TENSORS, rope=rope, grad=grad, sinks=sinks)


def run_ledger(config: "RunConfig", *, keep_going: bool = False, progress: ProgressFn | None = None,
               backends: "str | list[str] | None" = None, ops: Any = None) -> Report:
    """Run the built-in multi-head attention as named stages and check each.

    Args:
        config: a validated :class:`~attn_ledger.inputs.config.RunConfig` (``grad``, ``replay``, ``rope``,
            ``scale`` and ``temperature`` among its keys).
        keep_going: evaluate every row after the first divergence (marked ``downstream``)
            instead of stopping there (later rows ``not_reached``).
        progress: optional ``callback(done, total)`` over query blocks.
        backends: ``"all"`` or SDPA backend names: the context comparison per backend (see :func:`ledger_on_qkv`).
        ops: stage functions to run instead of the built-in ones (a :class:`~attn_ledger.maths.pipeline.Ops`;
            for testing an implementation of the stages, or the ledger itself); the config's fault is then ignored.

    Returns:
        The :class:`~attn_ledger.report.Report`; ``report.first_finding`` is the diagnosis.
    """
    from attn_ledger.maths.pipeline import ops_for, with_sinks, with_softcap

    cfg = config
    device, dtype = resolve_device(cfg.device), torch_dtype(cfg.dtype)
    b, tq, tk, nh = cfg.batch_size, cfg.tq, cfg.tk, cfg.num_heads
    relation = relations.build(cfg.relation, b, nh, tq, tk, device)
    sinks = inputs.sinks_tensor(cfg.sink_logits, nh, dtype, device)
    ops = with_sinks(with_softcap(ops or ops_for(cfg.fault), cfg.softcap), sinks)
    spec = cfg.rope_spec
    rows = Rows()
    title, meta = builtin.config_title(cfg, relation, device)
    inp = builtin.make_inputs(cfg, dtype, device, reference_dtype(device))
    order = config_stages(spec is not None, cfg.grad, sinks is not None)
    empty_zero = cfg.empty_rows == "zeros"

    def done() -> Report:
        assemble.arrays(rows, meta, False)
        return assemble.finish("run", title, order, rows, keep_going, meta, relation, tq, tk, empty_zero)

    entered = _before_scores(rows, ops, cfg, inp, spec, keep_going)
    if entered is None:
        return done()
    qkv, ((q, k, v), refs) = entered
    expanded = rows.run("scores", lambda: (ops.expand(k, nh), ops.expand(v, nh)))  # [B, Nh, Tk, Dh], [B, Nh, Tk, Dv]
    if expanded is None:
        return done()
    k_exp, v_exp = expanded
    scale = scale_meta(rows, meta, cfg.scale, cfg.temperature, cfg.dh)
    softcap_meta(rows, meta, cfg.softcap, backends)
    sinks_meta(rows, meta, sinks)
    run_scale = ops.scale_for(cfg.dh, scale)
    grid = run_grid(rows, meta, ops, q, k_exp, v_exp, refs, relation, run_scale, empty_zero, ref_scale=scale,
                    block_size=cfg.block_size, keep_grids=cfg.keep_grids, progress=progress, backends=backends,
                    softcap=cfg.softcap, sinks=sinks)
    if grid.context is None or (rows.failed() and not keep_going):
        return done()
    _after_context(rows, ops, cfg, inp, relation, grid, (q, k_exp, v_exp), qkv, run_scale, scale, keep_going)
    return done()


def _before_scores(rows: Rows, ops: Any, cfg: "RunConfig", inp: builtin.Inputs, spec: Any, keep_going: bool) -> tuple | None:
    """The built-in pipeline up to the scores: input, head round trip, projections, rotary positions.

    Returns:
        ``(qkv, ((q, k, v), refs))``: the projections, and what enters the scores with its references;
        None where the ledger stops before the scores.
    """
    b, tq, nh = cfg.batch_size, cfg.tq, cfg.num_heads
    builtin.input_row(rows, cfg, inp)
    found = rows.run("head_roundtrip", lambda: builtin.head_roundtrip(ops, b, tq, cfg.embed_dim, nh, cfg.dv))
    if found is not None:
        rows.shapes["head_roundtrip"], rows.checks["head_roundtrip"] = found
    if rows.raised or (rows.failed() and not keep_going):
        return None
    qkv = builtin.projections(rows, ops, cfg, inp)
    if qkv is None or (rows.failed() and not keep_going):
        return None
    rotated = rope_row(rows, ops, spec, qkv, (inp.q64, inp.k64, inp.v64), saved=False)
    if rotated is None or (rows.failed() and not keep_going):
        return None
    return qkv, rotated


def _after_context(rows: Rows, ops: Any, cfg: "RunConfig", inp: builtin.Inputs, relation: "Relation", grid: Grid,
                   entered: tuple, qkv: tuple, run_scale: float, scale: float, keep_going: bool) -> None:
    """The built-in pipeline after the score grid: merge, output (and replay), properties, the backward."""
    from attn_ledger.engine import backward_rows
    from attn_ledger.engine.backward import Rotation
    from attn_ledger.engine.replay import replay_config

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
        rows.checks["output"].append(replay_config(ops, cfg, inp, spec, relation, grid.plan, run_scale, out[0]))
    if rows.failed() and not keep_going:
        return
    properties_row(rows, ops, *entered, relation, run_scale, cfg.grad)
    if cfg.grad and not (rows.failed() and not keep_going):
        fwd = backward_rows.Forward(*entered, *qkv, (inp.q64, inp.k64, inp.v64), relation, grid.plan, run_scale, scale,
                                    cfg.empty_rows == "zeros", None if spec is None else Rotation(spec, cfg.tk - tq),
                                    cfg.softcap, ops.sinks)
        backward_rows.config_backward(rows, ops, cfg, inp, fwd, merged[0], relation, keep_going)


# --- given or saved tensors -------------------------------------------------------------

def ledger_on_qkv(  # long for its documented arguments; the body is the stages in order
    q: "Tensor",
    k: "Tensor",
    v: "Tensor",
    *,
    allow_mask: "Tensor | None" = None,
    key_valid: "Tensor | None" = None,
    mask: "str | RelationSpec" = "none",
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
    softcap: float | None = None,
    sinks: Any = None,
    bias: "Tensor | None" = None,
    out_layout: str = "bhtd",
) -> Report:
    """Run the ledger on given Q, K, V (and optionally the user's own intermediates and gradients).

    Args:
        q: ``[B, Tq, Dh]`` (one head) or ``[B, Nh, Tq, Dh]``.
        k: ``[B, Tk, Dh]`` or ``[B, Nkv, Tk, Dh]`` (Nkv divides Nh).
        v: ``[B, Tk, Dv]`` or ``[B, Nkv, Tk, Dv]``.
        allow_mask: bool ``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, Nh, Tq, Tk]``, True = may attend.
        key_valid: bool ``[B, Tk]``, True = a real key (placed as ``[B, 1, 1, Tk]``).
        mask: relations to add by name, joined by ``+``: ``causal`` (bottom-right),
            ``causal-top-left``, ``sliding-window`` (with ``window``), ``prefix-lm`` (with ``prefix_len``);
            or a :class:`~attn_ledger.maths.relations.RelationSpec` parsed already (its own window and prefix_len
            apply where those arguments are None).
        scores, weights, out: the user's own intermediates (scores scaled, before masking),
            shaped like the derived grid / context; each is compared with the reference, and
            one of another shape is an L1 finding (``user_*_shape``) at its stage.
        empty_rows: ``"error"`` (a query with every key blocked is a divergence) or
            ``"zeros"`` (such rows are declared and must come out as zeros).
        backends: ``"all"`` or SDPA backend names (math, flash, efficient, cudnn): repeat the
            context comparison per backend the device offers, as ``sdpa[backend,dtype]`` checks.
        scale, temperature: the score scale is ``scale / temperature`` (default ``1/sqrt(Dh)``), in the
            pipeline and every reference alike.
        softcap: the scaled scores become ``softcap * tanh(s / softcap)`` before the mask (Gemma 2's
            logit soft-capping), in the pipeline and every reference alike (not with ``grad`` or ``backends``).
        sinks: attention sinks, one logit per query head (gpt-oss's ``s_aux``): a tensor ``[Nh]``, a number for
            every head or a sequence of Nh numbers; each is one more column of the softmax, in the denominator only.
        bias: an additive bias on the scores (T5's ``position_bias``, ALiBi), broadcastable to ``[B, Nh, Tq, Tk]``:
            the scores stage is ``q k^T scale`` (capped) plus it, in the pipeline and every reference (not with
            ``grad``, ``backends`` or ``replay``).
        out_layout: ``bhtd`` (``out`` is ``[B, Nh, Tq, Dv]``) or ``bthd`` (``[B, Tq, Nh, Dv]``, as transformers'
            attention functions return it).
        rope: rotary positions applied to q and k before the scores (a :class:`~attn_ledger.maths.rotary.RotarySpec`
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
    from attn_ledger.maths.pipeline import HEALTHY, with_sinks, with_softcap

    inputs.validate_qkv(q, k, v)
    one_head = q.dim() == 3
    if one_head:
        q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, T, D]
    b, nh, tq, dh = q.shape
    tk, dv = k.shape[2], v.shape[-1]
    relations.check_saved(allow_mask, key_valid, b, nh, tq, tk)
    spec = relations.resolve(mask, tq=tq, tk=tk, window=window, prefix_len=prefix_len, allowed=relations.TENSOR_RELATIONS)
    relation = relations.build(spec, b, nh, tq, tk, q.device, allow_mask, key_valid)
    if empty_rows not in ("error", "zeros"):
        raise InputError(f"empty_rows: got {empty_rows!r}, expected 'error' or 'zeros'")
    rotation_spec = inputs.rope_spec(rope, dh)
    grads = {n: t for n, t in (grads or {}).items() if t is not None}
    inputs.check_options(scale, temperature, grad, grad_output, grads, softcap)
    sink_t = inputs.sinks_tensor(sinks, nh, q.dtype, q.device)
    bias_t = inputs.bias_grid(bias, b, nh, tq, tk, q.dtype)
    if bias_t is not None:
        for option, given_ in (("grad", grad), ("backends", backends), ("replay", replay)):
            if given_:
                raise InputError(f"{option}: got it with a bias, expected a bias only on the forward's own comparisons")
    out = inputs.out_in_layout(out, out_layout) if not one_head else out
    given, broken = inputs.given_tensors({"scores": scores, "weights": weights, "out": out}, one_head, b, nh, tq, tk, dv)
    rows = Rows()
    title, meta = inputs.tensor_rows(rows, q, k, v, one_head, relation, source, given)
    title += f" softcap={softcap:g}" if softcap is not None else ""
    title += " sinks" if sink_t is not None else ""
    title += f" bias {list(bias.shape)}" if bias_t is not None else ""
    order = tensor_stages(rotation_spec is not None, grad, sink_t is not None)
    empty_zero = empty_rows == "zeros"

    def done() -> Report:
        assemble.arrays(rows, meta, one_head)
        aligned = (("allow_mask alignment: " + relations.alignment_of(allow_mask, b, nh, tq, tk),)
                   if allow_mask is not None and tq != tk else ())
        return assemble.finish("run", title, order, rows, keep_going, meta, relation, tq, tk, empty_zero,
                               assemble.TENSOR_AXES, aligned)

    rotated = rope_row(rows, HEALTHY, rotation_spec, (q, k, v), (q, k, v), saved=True)
    if rotated is None or (rows.failed() and not keep_going):
        return done()
    (qr, kr, vr), refs = rotated
    ref_scale = scale_meta(rows, meta, scale, temperature, dh)
    softcap_meta(rows, meta, softcap, backends)
    sinks_meta(rows, meta, sink_t)
    ops = with_sinks(with_softcap(HEALTHY, softcap), sink_t)
    k_exp, v_exp = HEALTHY.expand(kr, nh), HEALTHY.expand(vr, nh)
    # Q, K, V go to the reference as given: cast to its dtype and kv heads repeated by its own code
    grid = run_grid(rows, meta, ops, qr, k_exp, v_exp, refs, relation, ref_scale, empty_zero, ref_scale=ref_scale,
                    given=given, broken=tuple(broken), block_size=block_size, keep_grids=keep_grids, progress=progress,
                    backends=backends, softcap=softcap, sinks=sink_t, bias=bias_t)

    def hinted() -> Report:  # what to try next where the saved out fails (engine/hints.py); the alternatives
        from attn_ledger.engine.hints import with_tensor_hints  # tried have no sinks, so none is tried with them

        if sink_t is not None or bias_t is not None:
            return done()
        return with_tensor_hints(done(), given.get("out"), (qr, k_exp, v_exp), declared_mask=_mask_key(spec),
                                 declared_text=relation.name, allow=relation.block(0, tq), scale=ref_scale,
                                 softcap=softcap, temperature=temperature,
                                 plain_relation=allow_mask is None and key_valid is None and _mask_key(spec) != "")

    if grid.context is None or (rows.failed() and not keep_going):
        return hinted()
    _tensors_after_context(rows, ops, relation, grid, (qr, k_exp, v_exp), (q, k, v), ref_scale, empty_zero, keep_going,
                           rotation_spec=rotation_spec, grad=grad, grad_output=grad_output, grads=grads,
                           one_head=one_head, replay=replay, softcap=softcap)
    return hinted()


def _mask_key(spec: "RelationSpec") -> str:
    """The declared relation as the hints name one (``none``, ``causal``, ``sliding-window:4``); empty where it
    combines several relations (no single one then stands in for it)."""
    if not spec.names:
        return "none"
    if len(spec.names) > 1 or spec.names[0] == "prefix-lm":
        return ""
    return f"sliding-window:{spec.window}" if spec.names[0] == "sliding-window" else spec.names[0]


def _tensors_after_context(rows: Rows, ops: Any, relation: "Relation", grid: Grid, entered: tuple, given: tuple,
                           scale: float, empty_zero: bool, keep_going: bool, *, rotation_spec: Any, grad: bool,
                           grad_output: Any, grads: dict, one_head: bool, replay: bool, softcap: float | None) -> None:
    """Given tensors after the score grid: the replay, properties, the backward.

    Args:
        entered: q (rotated), k and v (rotated, kv heads expanded) as they entered the scores, ``[B, Nh, T, D]``.
        given: q, k and v as given, ``[B, Nh or Nkv, T, D]``.
    """
    from attn_ledger.engine.replay import replay_tensors

    qr, k_exp, v_exp = entered
    q, k, v = given
    if replay:
        rows.checks["context"].append(replay_tensors(grid, relation, qr, k_exp, v_exp, scale, empty_zero, ops))
    properties_row(rows, ops, qr, k_exp, v_exp, relation, scale, grad)
    if grad and not (rows.failed() and not keep_going):
        from attn_ledger.engine import backward_rows
        from attn_ledger.engine.backward import Rotation

        shift = k.shape[2] - q.shape[2]  # Tk - Tq: query i sits at position i + Tk - Tq
        fwd = backward_rows.Forward(qr, k_exp, v_exp, q, k, v, (q, k, v), relation, grid.plan, scale, scale,
                                    empty_zero, None if rotation_spec is None else Rotation(rotation_spec, shift),
                                    softcap, ops.sinks)
        backward_rows.tensor_backward(rows, fwd, grad_output, grads, one_head, replay)


def run_ledger_tensors(
    path: "str | os.PathLike[str] | Mapping[str, Tensor]",
    *,
    mask: "str | RelationSpec" = "none",
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
    softcap: float | None = None,
    sinks: Any = None,
    out_layout: str = "bhtd",
) -> Report:
    """Load a ``.pt``/``.safetensors``/``.npz`` file of q, k, v (and optional masks, intermediates and gradients
    ``grad_out``, ``dq``, ``dk``, ``dv``, ``sinks`` ``[Nh]`` and an additive ``bias``) and run the ledger (see :func:`ledger_on_qkv`).

    ``path`` may also be the file's tensors, loaded already with
    :func:`~attn_ledger.inputs.tensorio.load_tensor_file`; ``source`` then names them in the title.
    ``sinks`` given here and a ``sinks`` tensor in the file is bad input.
    """
    source = source or (str(path) if isinstance(path, (str, os.PathLike)) else "tensors")
    t = inputs.load(path, None if dtype is None else torch_dtype(dtype), resolve_device(device), source)
    return ledger_on_qkv(
        t["q"], t["k"], t["v"], allow_mask=t.get("allow_mask"), key_valid=t.get("key_valid"), mask=mask,
        window=window, prefix_len=prefix_len, scores=t.get("scores"), weights=t.get("weights"), out=t.get("out"),
        empty_rows=empty_rows, block_size=block_size, keep_grids=keep_grids, keep_going=keep_going,
        progress=progress, source=source, backends=backends, scale=scale, temperature=temperature, rope=rope,
        grad=grad, grad_output=grad_output, grads={n: t.get(n) for n in ("grad_out", "dq", "dk", "dv")}, replay=replay,
        softcap=softcap, sinks=inputs.file_sinks(t, sinks, source), bias=t.get("bias"), out_layout=out_layout)
