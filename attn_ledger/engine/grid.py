"""The score-grid stages of one ledger: plan, execute block by block, fold, judge, and fill the rows.

:func:`run_grid` is the one path from q, k, v (as they enter the scores stage) to the rows
``scores``, ``masked_scores``, ``weights`` and ``context``, for the built-in pipeline and for
given tensors alike; :func:`scale_meta` states the score scale when it is not the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_ledger import tolerance
from attn_ledger.engine.backends import backend_matrix, resolve_backends
from attn_ledger.devices import reference_dtype
from attn_ledger.engine.execute import ProgressFn
from attn_ledger.engine.judge import GRID_STAGES, Verdicts
from attn_ledger.engine.measure import EXACT_RANGE_BUDGET, Broken
from attn_ledger.engine.rows import Rows
from attn_ledger.report import Note

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.engine.plan import Plan
    from attn_ledger.maths.relations import Relation


@dataclass(frozen=True)
class Grid:
    """What the score-grid stages hand on: the contexts, the verdicts and the plan."""

    context: "Tensor | None"
    sdpa_context: "Tensor | None"
    ref_context: dict[tuple[int, int], "Tensor"]
    verdicts: Verdicts
    plan: Any = None


def scale_meta(rows: Rows, meta: dict[str, Any], s: float | None, temperature: float | None, dh: int) -> float:
    """The intended score scale S/tau, stated in the notes and details when it is not the default 1/sqrt(Dh)."""
    base = 1.0 / math.sqrt(dh) if s is None else s
    effective = base / (temperature or 1.0)
    if s is not None or temperature is not None:
        meta["scale"] = {"S": base, "temperature": temperature or 1.0, "effective": effective, "default": 1.0 / math.sqrt(dh)}
        rows.notes.append(Note("score_scale", meta["scale"]))
    return effective


def softcap_meta(rows: Rows, meta: dict[str, Any], softcap: float | None, backends: Any) -> None:
    """A soft-cap, stated in the notes and details."""
    if softcap is None:
        return
    meta["softcap"] = softcap
    rows.notes.append(Note("softcap", {"C": softcap, "pinned": backends is not None}))


def sinks_meta(rows: Rows, meta: dict[str, Any], sinks: "Tensor | None") -> None:
    """Attention sinks, one logit per head, stated in the notes and details."""
    if sinks is None:
        return
    meta["sinks"] = [float(x) for x in sinks.double().tolist()]
    rows.notes.append(Note("sinks", {"sinks": meta["sinks"]}))


def run_grid(rows: Rows, meta: dict[str, Any], ops: Any, q: "Tensor", k_exp: "Tensor", v_exp: "Tensor",
             ref: tuple["Tensor", "Tensor", "Tensor"], relation: "Relation", scale: float, empty_zero: bool, *,
             ref_scale: float, given: "dict[str, Tensor] | None" = None, broken: tuple[Broken, ...] = (),
             block_size: int | None, keep_grids: bool, progress: ProgressFn | None,
             backends: "str | list[str] | None", softcap: float | None = None,
             sinks: "Tensor | None" = None, bias: "Tensor | None" = None) -> Grid:
    """The score-grid stages: plan, execute block by block, fold and judge; rows, notes and meta filled in."""
    from attn_ledger.engine.execute import Execution
    from attn_ledger.engine.judge import Tally, judge
    from attn_ledger.engine.plan import key_step, make_plan

    b, nh, tq, dh = q.shape
    tk, dv = k_exp.shape[-2], v_exp.shape[-1]
    pairs, unavailable = resolve_backends(backends, q.device, q.dtype, bool(relation.parts), b * nh * tq * tk, softcap,
                                         sinks is not None)
    if unavailable:
        rows.notes.append(Note("backends_unavailable", {"unavailable": [
            {"backend": n, "dtype": dt, "reason": why} for (n, dt), why in unavailable.items()]}))
    plan = make_plan(b, nh, tq, tk, relation, block_size=block_size, keep_grids=keep_grids, given=bool(given),
                     width_step=key_step(q.dtype, q.device.type, tk))
    run = Execution(plan, relation, ops, q, k_exp, v_exp, ref, scale=scale, ref_scale=ref_scale,
                    empty_zero=empty_zero, given=given, backends=pairs, progress=progress, softcap=softcap,
                    sinks=sinks, bias=bias)
    tally = Tally.of([*broken, *run.run()])
    derived = {"scores": (b, nh, tq, tk), "masked_scores": (b, nh, tq, tk), "weights": (b, nh, tq, tk),
               "context": (b, nh, tq, dv)}
    verdicts = judge(tally, tolerance.dtype_name(q.dtype), related=bool(relation.parts), empty_zero=empty_zero,
                     derived=derived)
    _grid_rows(rows, tally, verdicts, plan, derived)
    rows.notes += _plan_notes(plan, q.device)
    if run.loose_range:
        rows.notes.append(Note("loose_range", {"entries_log2": EXACT_RANGE_BUDGET.bit_length() - 1}))
    rows.tensors.update(_kept_grids(run.kept, relation, given or {}, b, nh, tq, tk))
    if run.context is not None:
        rows.tensors["context"] = run.context
        if plan.keep and b > 0 and b * nh * tq * tk <= 16 and b * nh * tq * dv <= 16:
            for stage, t in (("weights", rows.tensors["weights"]), ("context", run.context)):
                rows.row_notes[stage] = Note("values", {"stage": stage, "example": 0, "head": 0,
                                                        "values": t[0, 0].double().tolist()})  # [Tq, Tk | Dv]
    if backends is not None:
        meta["sdpa_backends"] = backend_matrix(verdicts.backends, unavailable)
    _scores_spread(rows, run, plan)
    return Grid(run.context, run.sdpa_context, run.ref_context, verdicts, plan)


def _grid_rows(rows: Rows, tally: Any, verdicts: Verdicts, plan: "Plan", derived: dict[str, tuple[int, ...]]) -> None:
    """Each grid stage's checks, what it raised and its shape (the block's own where one block raised at scores)."""
    for stage in GRID_STAGES:
        stopped = tally.broken.get((stage, "pipeline"))
        if stopped is not None and stopped.raised is not None:
            rows.raised[stage] = stopped.raised
        if verdicts.checks[stage] or stage in rows.raised:
            rows.checks[stage] = verdicts.checks[stage]
            one_block = stopped is not None and stopped.shape is not None and len(plan.blocks) == 1 and stage == "scores"
            rows.shapes[stage] = stopped.shape if one_block else derived[stage]


def _scores_spread(rows: Rows, run: Any, plan: Any) -> None:
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
        rows.notes.append(Note("scores_std_rows", {"rows": plan.reference_rows}))


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


def _plan_notes(plan: Any, device: "torch.device") -> list[Note]:
    """What a reader needs to know about the plan: blocks, and the rows the float64 reference covered."""
    notes = []
    if len(plan.blocks) > 1:
        notes.append(Note("query_blocks", {"blocks": len(plan.blocks), "rows": plan.blocks[0].rows}))
    if plan.reference_rows < plan.tq:
        notes.append(Note("reference_sample", {"dtype": tolerance.dtype_name(reference_dtype(device)),
                                               "rows": plan.reference_rows, "tq": plan.tq,
                                               "spans": [[r0, r1] for r0, r1 in plan.reference_spans]}))
    return notes
