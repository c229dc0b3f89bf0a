"""The attention ledger: run attention as named stages, check each, name the first divergence.

Three entry points build a :class:`~attn_ledger.report.Report`:

* :func:`run_ledger` runs the built-in multi-head attention from a :class:`RunConfig`
  (stages ``input`` .. ``output``), optionally with one deliberate fault.
* :func:`ledger_on_qkv` / :func:`run_ledger_tensors` run given or saved Q, K, V (and
  optionally the user's own ``scores``, ``weights`` and ``out``) through ``input``,
  ``scores``, ``masked_scores``, ``weights`` and ``context``.

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
from attn_ledger.engine.judge import GRID_STAGES, Verdicts
from attn_ledger.engine.measure import Broken, Where
from attn_ledger.report import Check, Report, Row, unjudged

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.config import RunConfig
    from attn_ledger.engine.relations import Relation

__all__ = ["CONFIG_STAGES", "TENSOR_STAGES", "SDPA_BACKENDS", "ProgressFn", "ledger_on_qkv", "resolve_backends",
           "run_ledger", "run_ledger_tensors"]

CONFIG_STAGES = ("input", "head_roundtrip", "q", "k", "v", "scores", "masked_scores", "weights", "context", "merged", "output")
TENSOR_STAGES = ("input", "scores", "masked_scores", "weights", "context")

AXES = {**builtin.AXES, **GRID_AXES}
PICTURE_MAX = 16  # the relation is pictured when Tq and Tk are at most this
COUNTS_MAX = 32  # allowed keys per query are listed when Tq is at most this


@dataclass
class _Rows:
    """What the stages of one ledger have found so far."""

    checks: dict[str, list[Check]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    raised: dict[str, BaseException] = field(default_factory=dict)
    row_notes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tensors: dict[str, Any] = field(default_factory=dict)

    def failed(self) -> bool:
        return bool(self.raised) or any(c.failed for cs in self.checks.values() for c in cs)

    def run(self, stage: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None with the exception recorded: a stage that raises is a level-1 divergence there."""
        try:
            return fn()
        except Exception as exc:
            self.raised[stage] = exc
            return None


@dataclass(frozen=True)
class _Grid:
    """What the score-grid stages hand on: the contexts and the verdicts."""

    context: "Tensor | None"
    sdpa_context: "Tensor | None"
    ref_context: dict[tuple[int, int], "Tensor"]
    verdicts: Verdicts


def run_ledger(config: "RunConfig", *, keep_going: bool = False, progress: ProgressFn | None = None,
               backends: "str | list[str] | None" = None) -> Report:
    """Run the built-in multi-head attention as named stages and check each.

    Args:
        config: a validated :class:`~attn_ledger.config.RunConfig`.
        keep_going: evaluate every row after the first divergence (marked ``downstream``)
            instead of stopping there (later rows ``not_reached``).
        progress: optional ``callback(done, total)`` over query blocks.
        backends: ``"all"`` or SDPA backend names: the context comparison per backend (see :func:`ledger_on_qkv`).

    Returns:
        The :class:`~attn_ledger.report.Report`; ``report.first_finding`` is the diagnosis.
    """
    from attn_ledger.pipeline import ops_for

    cfg = config
    device, dtype = inputs.resolve_device(cfg.device), inputs.torch_dtype(cfg.dtype)
    b, tq, tk, nh = cfg.batch_size, cfg.tq, cfg.tk, cfg.num_heads
    relation = relations.build(relations.from_config(cfg), b, nh, tq, tk, device)
    ops = ops_for(cfg.fault)
    rows = _Rows()
    title, meta = _config_title(cfg, relation, device)
    inp = builtin.make_inputs(cfg, dtype, device, reference_dtype(device))

    def done() -> Report:
        return _finish("run", title, CONFIG_STAGES, rows, keep_going, meta, relation, tq, tk, cfg.empty_rows == "zeros")

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
    q, k, v = qkv
    expanded = rows.run("scores", lambda: (ops.expand(k, nh), ops.expand(v, nh)))  # [B, Nh, Tk, Dh], [B, Nh, Tk, Dv]
    if expanded is None:
        return done()
    k_exp, v_exp = expanded
    grid = _grid(rows, meta, ops, q, k_exp, v_exp, (inp.q64, inp.k64, inp.v64), relation, ops.scale_for(cfg.dh),
                 cfg.empty_rows == "zeros", block_size=cfg.block_size, keep_grids=cfg.keep_grids, progress=progress,
                 backends=backends)
    if grid.context is None or (rows.failed() and not keep_going):
        return done()
    merged = rows.run("merged", lambda: builtin.merged(ops, grid.context, grid.ref_context, b, tq, nh, cfg.dv))
    if merged is None:
        return done()
    rows.shapes["merged"], rows.checks["merged"] = tuple(merged[0].shape), merged[1]
    if rows.failed() and not keep_going:
        return done()
    out = rows.run("output", lambda: builtin.output(merged[0], inp.weights.wo, grid.sdpa_context, grid.ref_context,
                                                    b, tq, cfg.embed_dim))
    if out is not None:
        rows.shapes["output"], rows.checks["output"], rows.tensors["output"] = tuple(out[0].shape), out[1], out[0]
    return done()


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
          given: "dict[str, Tensor] | None" = None, broken: tuple[Broken, ...] = (), block_size: int | None,
          keep_grids: bool, progress: ProgressFn | None, backends: "str | list[str] | None") -> _Grid:
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
    run = Execution(plan, relation, ops, q, k_exp, v_exp, ref, scale=scale, ref_scale=1.0 / math.sqrt(dh),
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
    return _Grid(run.context, run.sdpa_context, run.ref_context, verdicts)


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
        found.append(Row(stage, status, tuple(checks), rows.shapes.get(stage), axes[stage], note=note))
        if stage in rows.raised or (diverged and not keep_going):
            stopped = True
    return locate(Report(command, title, tuple(found), notes=tuple(rows.notes), details=meta, unit="check",
                         row_label="stage", tensors=rows.tensors), empty_zero)


def _show_relation(rows: _Rows, order: tuple[str, ...], meta: dict[str, Any], relation: "Relation", tq: int,
                   tk: int) -> None:
    """The relation's allowed keys per query and its picture, for example 0, or, where examples (or
    heads) differ, for the one of the first finding, saying so."""
    from attn_ledger.masks import picture

    if not relation.parts or tq > COUNTS_MAX or not ("scores" in rows.checks or "scores" in rows.raised):
        return
    where = _first_where(rows, order)
    at_divergence = where is not None and relations.varies(relation, tq)
    allow, b, h = relations.view(relation, tq, *((where.example, where.head) if at_divergence else (0, 0)))  # [Tq, Tk]
    if allow is None:  # an empty batch
        return
    counts = [int(n) for n in allow.sum(dim=-1).tolist()]
    meta["relation_shown"] = {"example": b, "head": h, "allowed_keys_per_query": counts, "at_divergence": at_divergence}
    which = f"b={b}, h={h}" + ("; the example of the first finding" if at_divergence else "")
    rows.notes.append(f"allowed keys per query ({which}): {counts}")
    if tq <= PICTURE_MAX and tk <= PICTURE_MAX and "masked_scores" in rows.checks:
        rows.row_notes["masked_scores"] = (f"intended relation ({which}), queries as rows, keys as columns:\n"
                                           + (picture(allow) or ""))


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

def ledger_on_qkv(
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
) -> Report:
    """Run the ledger on given Q, K, V (and optionally the user's own intermediates).

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

    Returns:
        The :class:`~attn_ledger.report.Report` for stages input, scores, masked_scores, weights, context.
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
    given, broken = inputs.given_tensors({"scores": scores, "weights": weights, "out": out}, one_head, b, nh, tq, tk, dv)
    rows = _Rows()
    title, meta = _tensor_rows(rows, q, k, v, one_head, relation, source, given)
    # Q, K, V go to the reference as given: cast to its dtype and kv heads repeated by its own code
    _grid(rows, meta, HEALTHY, q, HEALTHY.expand(k, nh), HEALTHY.expand(v, nh), (q, k, v), relation, 1.0 / math.sqrt(dh),
          empty_rows == "zeros", given=given, broken=tuple(broken), block_size=block_size, keep_grids=keep_grids,
          progress=progress, backends=backends)
    aligned = (("allow_mask alignment: " + relations.alignment_of(allow_mask, b, nh, tq, tk),)
               if allow_mask is not None and tq != tk else ())
    return _finish("run", title, TENSOR_STAGES, rows, keep_going, meta, relation, tq, tk, empty_rows == "zeros",
                   {**AXES, "input": "[B,Nh,Tq,Dh]"}, aligned)


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
) -> Report:
    """Load a ``.pt``/``.safetensors``/``.npz`` file of q, k, v (and optional masks and intermediates) and run the ledger.

    ``path`` may also be the file's tensors, loaded already with
    :func:`~attn_ledger.tensorio.load_tensor_file`; ``source`` then names them in the title.
    """
    source = source or (str(path) if isinstance(path, (str, os.PathLike)) else "tensors")
    t = inputs.load(path, None if dtype is None else inputs.torch_dtype(dtype), inputs.resolve_device(device), source)
    return ledger_on_qkv(
        t["q"], t["k"], t["v"], allow_mask=t.get("allow_mask"), key_valid=t.get("key_valid"), mask=mask,
        window=window, prefix_len=prefix_len, scores=t.get("scores"), weights=t.get("weights"), out=t.get("out"),
        empty_rows=empty_rows, block_size=block_size, keep_grids=keep_grids, keep_going=keep_going,
        progress=progress, source=source, backends=backends)
