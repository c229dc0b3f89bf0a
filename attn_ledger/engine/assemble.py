"""Assembling the ledger: per-stage checks become report rows with statuses, the first failing stage the finding.

Also what the rows show beside the checks: the relation's allowed keys per query and its picture
(for the example of the first finding where examples differ), as note data; the heatmaps' data
(:mod:`attn_ledger.engine.heatmaps`); and small stage tensors as nested lists in the JSON.
"""

from __future__ import annotations

from typing import Any

from attn_ledger.engine import checks as C
from attn_ledger.engine import stages
from attn_ledger.engine.locate import locate
from attn_ledger.maths import relations
from attn_ledger.engine.heatmaps import with_heatmaps
from attn_ledger.engine.measure import Where
from attn_ledger.maths.relations import Relation
from attn_ledger.engine.rows import Rows
from attn_ledger.report import Note, Report, Row, unjudged

AXES = stages.axes(stages.PIPELINE)
TENSOR_AXES = stages.axes(stages.TENSORS)
PICTURE_MAX = 16  # the relation is pictured when Tq and Tk are at most this
COUNTS_MAX = 32  # allowed keys per query are listed when Tq is at most this
ARRAY_MAX = 4096  # stage tensors with at most this many entries go into the JSON as nested arrays
ARRAY_STAGES = ("scores", "masked_scores", "weights", "context", "output", "grad_context", "grad_weights",
                "grad_values", "grad_scores", "grad_q", "grad_k", "grad_x", "grad_x_kv")


def finish(command: str, title: str, order: tuple[str, ...], rows: Rows, keep_going: bool, meta: dict[str, Any],
           relation: Relation, tq: int, tk: int, empty_zero: bool, axes: dict[str, str] | None = None,
           tail: tuple[Note, ...] = ()) -> Report:
    """Turn per-stage checks into rows with statuses; the first failing stage is the finding (``tail``: last notes).

    Rows after it are downstream evidence: with ``keep_going`` their failing checks read
    ``downstream``; without it they are not reached. Where whole grids were kept, failing grid
    checks point at their first cell and the cells are marked (:func:`attn_ledger.engine.locate.locate`).
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
    located = locate(Report(command, title, tuple(found), notes=tuple(rows.notes), details=meta, unit="check",
                            row_label="stage", tensors=rows.tensors), empty_zero)
    return with_heatmaps(located)


def _show_relation(rows: Rows, order: tuple[str, ...], meta: dict[str, Any], relation: Relation, tq: int,
                   tk: int) -> None:
    """The relation's allowed keys per query and its picture (as data: the renderers write them), for
    example 0, or, where examples (or heads) differ, for the one of the first finding, saying so."""
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
    shown = {"example": b, "head": h, "at_divergence": at_divergence}
    rows.notes.append(Note("allowed_keys", {**shown, "counts": counts}))
    if tq <= PICTURE_MAX and tk <= PICTURE_MAX and "masked_scores" in rows.checks:
        rows.row_notes["masked_scores"] = Note("relation_picture", {**shown, "allow": [[bool(a) for a in row] for row in allow.tolist()]})


def _allowed_pairs(relation: Relation, tq: int, tk: int) -> dict[str, int]:
    """``allowed``: the (query, key) pairs the relation allows for example 0, head 0 (the example shown when
    another one diverged); ``pairs``: Tq * Tk."""
    if not relation.parts:
        allowed = tq * tk
    elif relation.top_left_causal:  # query i sees min(i + 1, Tk) keys: a triangle, then full rows
        full = min(tq, tk)
        allowed = full * (full + 1) // 2 + (tq - full) * tk
    else:
        whole = relation.block(0, tq)  # [B|1, Nh|1, Tq, Tk]
        allowed = 0 if whole is None or whole.shape[0] == 0 else int(relations.view(relation, tq)[0].sum())
    return {"allowed": allowed, "pairs": tq * tk}


def arrays(rows: Rows, meta: dict[str, Any], one_head: bool) -> None:
    """Stage tensors of at most ARRAY_MAX entries, as nested lists under ``details["arrays"]`` (one head: no Nh axis)."""
    found = {}
    for name in ARRAY_STAGES:
        t = rows.tensors.get(name)
        if t is None or t.numel() > ARRAY_MAX or t.dim() < 3:
            continue
        if one_head and t.dim() == 4 and t.shape[1] == 1:
            t = t[:, 0]
        found[name] = t.detach().cpu().double().tolist()
    if found:
        meta["arrays"] = found


def _first_where(rows: Rows, order: tuple[str, ...]) -> Where | None:
    """Where the first finding's check failed, if the engine located it."""
    for stage in order:
        if stage in rows.raised:
            return None
        failing = [c for c in rows.checks.get(stage, []) if c.failed]
        if failing:
            loc = min(failing, key=lambda c: c.level).location
            return None if not loc or "example" not in loc else Where(loc["example"], loc.get("head", 0), loc.get("query", 0))
    return None
