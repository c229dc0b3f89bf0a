"""A whole model's attention calls judged as they stream in, and the report: one row per call, the first wrong
layer as the headline.

:class:`Judge` takes each call the capture sends (:mod:`attn_ledger.probes.model.capture`), reads what it
should compute from the config (:func:`attn_ledger.probes.model.expect.expect`), judges it
(:func:`attn_ledger.probes.model.judge.judge_call`) and drops its tensors, keeping only the first wrong
call's (for its stage ledger) and writing each call's tensors where ``--save`` asks. Calls stream in
the order the forward makes them; every call after the first wrong one carries its error in its
inputs, so without ``keep_going`` such calls are listed and marked ``downstream``, not judged; with it
they are judged and their failures read ``downstream``. Rows are in forward order (``entry``: the
entry into the call's attention module, then the call within it), so a call the observer saw in a
second forward sits where the first forward made it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from attn_ledger.guard import CallStopped
from attn_ledger.probes.model.expect import Declared, Expected, expect
from attn_ledger.probes.model.judge import (
    CHECK_ORDER,
    REFERENCE_BUDGET,
    Call,
    Sides,
    Verdict,
    implied,
    judge_call,
    scale_of,
)
from attn_ledger.report import Check, Coverage, Finding, Note, Report, Row, row_status, unjudged

if TYPE_CHECKING:
    from torch import Tensor

AXES = "[B,Nh,Tq,Dh]"


@dataclass(frozen=True)
class ScanOptions:
    """How calls are judged: ``keep_going`` judges the calls after the first wrong one; ``budget`` bounds the
    float64 reference per call (:data:`REFERENCE_BUDGET`); ``declared`` is what a model of one's own is meant to
    do; ``save`` is a directory to write each call's tensors into; ``ledger``: run the stage ledger of the first
    wrong call; ``every_ledger``: every judged call's too, as it arrives (the HTML page opens each)."""

    keep_going: bool = False
    budget: int = REFERENCE_BUDGET
    declared: Declared | None = None
    save: str | None = None
    ledger: bool = True
    every_ledger: bool = False


@dataclass
class Entry:
    """One call as the report shows it."""

    order: tuple[int, int]
    facts: Mapping[str, Any]
    expected: Expected | None
    verdict: Verdict | None  # None: not judged (it follows the first wrong call)
    shape: tuple[int, ...] | None = None


@dataclass
class Kept:
    """The first wrong call's tensors, kept for its stage ledger."""

    order: tuple[int, int]
    call: Call
    verdict: Verdict
    expected: Expected


class Judge:
    """Judges calls as they arrive (``take`` is the capture's sink) and keeps only what the report needs."""

    def __init__(self, model: Mapping[str, Any], sides: Sides, options: ScanOptions = ScanOptions()) -> None:
        self.model, self.sides, self.options = model, sides, options
        self.shared: dict[str, Tensor] = {}
        self.entries: list[Entry] = []
        self.first: Kept | None = None
        self.saved: list[dict[str, Any]] = []
        self.save_dir: str | None = None  # where --save writes while the scan runs (renamed into place at the end)
        self.ledgers: dict[str, Report] = {}

    def take(self, facts: dict[str, Any], tensors: dict[str, "Tensor"]) -> None:
        call = self._call(facts, tensors)
        order = (int(facts["entry"]), int(facts.get("call", 0)))
        width = int(call.q.shape[-1]) if call.q is not None and call.q.dim() == 4 else 0
        exp = expect(self.model, {**facts, "width": width}, self.options.declared)
        shape = tuple(call.q.shape) if call.q is not None else None
        sides = self.sides_of(facts)
        verdict = None
        if self.first is None or order < self.first.order or self.options.keep_going:
            verdict = judge_call(call, exp, sides, self.options.budget)
        self.entries.append(Entry(order, facts, exp, verdict, shape))
        if verdict is not None and verdict.failed and (self.first is None or order < self.first.order):
            self.first = Kept(order, call, verdict, exp)
        if verdict is not None and self.options.every_ledger:
            found = call_ledger(Kept(order, call, verdict, exp), sides)
            if isinstance(found, Report):
                self.ledgers[label_of(facts)] = found
        if self.save_dir is not None:
            self._save(call, exp, int(facts.get("index", len(self.entries) - 1)), label_of(facts))

    def sides_of(self, facts: Mapping[str, Any]) -> Sides:
        """The inputs as a call saw them: a decode step's call (``tokens``: its first and last token) sees the
        tokens up to its last."""
        span = facts.get("tokens")
        return self.sides if span is None else self.sides.up_to(int(span[1]) + 1)

    def _save(self, call: Call, exp: Expected, index: int, label: str) -> None:
        from attn_ledger.probes.model.replay import save_call

        if any(t is None or t.dim() != 4 for t in (call.q, call.k, call.v)):
            return
        try:
            allow, real, *_ = implied(call, exp, self.sides)
        except RuntimeError:  # q, k, v that do not make a grid: nothing to replay
            return
        self.saved += save_call(self.save_dir, index, label, call, allow, real, scale_of(call, exp), exp.softcap)

    def _call(self, facts: Mapping[str, Any], tensors: dict[str, "Tensor"]) -> Call:
        shared = {}
        for role in ("mask", "bias"):
            ref = facts.get(role)
            if ref is None:
                continue
            if ref.get("new"):
                self.shared[ref["key"]] = tensors[role]
            shared[role] = self.shared.get(ref["key"])
        return Call(facts, tensors.get("q"), tensors.get("k"), tensors.get("v"), tensors.get("context"), None,
                    tensors.get("weights"), shared.get("mask"), shared.get("bias"), tensors.get("sinks"),
                    tensors.get("q_pre"), tensors.get("k_pre"))


# --- the report ------------------------------------------------------------------------------------


def label_of(facts: Mapping[str, Any]) -> str:
    """A call's row name: its module path (``#2`` on for a module's later calls in one forward; a decode step's
    tokens after it)."""
    path = str(facts.get("path") or "(model)")
    n = int(facts.get("call", 0))
    label = path if n == 0 else f"{path}#{n + 1}"
    span = facts.get("tokens")
    if span is None:
        return label
    first, last = (int(x) for x in span)
    return f"{label}, token {first}" if first == last else f"{label}, tokens {first}..{last}"


def relation_words(exp: Expected | None) -> str:
    if exp is None:
        return ""
    if exp.relation == "causal":
        return "causal" + (f" w{exp.window}" if exp.window is not None else "")
    return exp.relation


def _row(e: Entry, first: tuple[int, int] | None, keep_going: bool, first_label: str) -> Row:
    label = label_of(e.facts)
    fields = {"layer": None if e.expected is None else e.expected.layer, "relation": relation_words(e.expected),
              "via": e.facts.get("implementation") if e.facts.get("via") != "observer" else "observer"}
    if e.verdict is None:
        why = f"not judged: its inputs carry the error of {first_label} (--keep-going judges it)"
        checks = tuple(unjudged(level, name, "downstream", why) for level, name in CHECK_ORDER)
        return Row(label, "downstream", checks, e.shape, AXES, fields=fields)
    checks = e.verdict.checks
    fields["reference_rows"] = e.verdict.sampled.get("rows")
    status = row_status(checks)
    if status == "fail" and first is not None and e.order > first:
        checks = tuple(c.with_status("downstream") if c.failed else c for c in checks)
        status = "downstream"
    return Row(label, status, checks, e.shape, AXES, fields=fields)


def _unseen_row(entry: int, path: str) -> tuple[tuple[int, int], Row]:
    why = "its forward made no attention call that the interface or the observer could read"
    checks = (Check(1, "observed", "skipped", reason=why, data={"observed": False}),
              *(unjudged(level, name, "skipped", why) for level, name in CHECK_ORDER[1:]))
    return (entry, 0), Row(path, "skipped", checks, None, AXES, fields={"via": "unseen"})


def _stopped_row(error: Mapping[str, Any], order: tuple[int, int]) -> tuple[tuple[int, int], Row]:
    where = error.get("in") or {}
    path = str(where.get("path") or "forward")
    data = {k: v for k, v in error.items() if k not in ("text", "in")}
    checks = (Check(1, "observed", "fail", reason=str(error.get("text")), data=data),
              *(unjudged(level, name, "not_reached", "the call raised") for level, name in CHECK_ORDER[1:]))
    entry = where.get("entry")
    return ((entry, 1 << 30) if isinstance(entry, int) else order), Row(path, "fail", checks, None, AXES)


def _coverage(entries: list[Entry], unseen: list[list[Any]]) -> Coverage | None:
    missing: dict[str, int] = {}
    for e in entries:
        if e.verdict is None:
            continue
        for c in e.verdict.checks:
            if c.name == "observed" and c.status == "skipped":
                missing["observed"] = missing.get("observed", 0) + 1
            elif c.name == "rotary" and (c.status == "skipped" or (e.expected is not None and e.expected.rotary_note)):
                missing["rotary"] = missing.get("rotary", 0) + 1
            elif c.name == "relation" and c.status == "not_applicable":
                missing["relation"] = missing.get("relation", 0) + 1
    if unseen:
        missing["observed"] = missing.get("observed", 0) + len(unseen)
    if not missing:
        return None
    words = {"observed": "q, k, v not observed", "rotary": "rotary not judged",
             "relation": "relation not declared (reported, not judged)"}
    reason = "; ".join(f"{words[k]} in {n} call{'s' if n != 1 else ''}" for k, n in missing.items())
    return Coverage("partial", tuple(missing), reason)


def scan_report(model: Mapping[str, Any], judge: Judge, run: Mapping[str, Any], inputs: Mapping[str, Any],
                title: str, ledger: "Report | str | None" = None) -> Report:
    """One row per call in forward order; the first wrong call's first failing check is the finding, and ``ledger``
    its stage ledger (or why it has none)."""
    first = judge.first.order if judge.first is not None else None
    stop = run.get("error")
    first_label = label_of(judge.first.call.facts) if judge.first is not None else ""
    placed = [(e.order, _row(e, first, judge.options.keep_going, first_label)) for e in judge.entries]
    placed += [_unseen_row(entry, path) for entry, path in run.get("unseen", [])]
    if stop is not None:
        placed.append(_stopped_row(stop, (1 << 30, 0)))
    placed.sort(key=lambda p: p[0])
    rows = tuple(r for _, r in placed)
    judged = [e for e in judge.entries if e.verdict is not None]
    notes: list[str | Note] = [Note("scan_inputs", dict(inputs))]
    sampled = sorted({(e.verdict.sampled["rows"], e.verdict.sampled["of"]) for e in judged
                      if e.verdict.sampled.get("rows") != e.verdict.sampled.get("of")})
    notes.append(Note("scan_reference", {"sampled": [list(s) for s in sampled], "budget": judge.options.budget}))
    if stop is not None:
        notes.append(Note("scan_stopped", {"text": stop.get("text"), "calls": run.get("calls", 0)}))
    if isinstance(ledger, str):
        notes.append(Note("scan_unreplayable", {"call": first_label, "why": ledger}))
    if judge.options.save is not None:
        from attn_ledger.probes.model.replay import saved_summary

        notes.append(Note("scan_saved", saved_summary(judge.options.save, judge.saved)))
    first_row = next((r for r in rows if r.first_failing() is not None and r.status == "fail"), None)
    finding = None if first_row is None else Finding(first_row.name, first_row.first_failing())
    details = {"model": {k: model.get(k) for k in ("label", "class", "model_type", "architecture", "implementation",
                                                   "dtype", "layers")},
               "inputs": dict(inputs), "calls": len(rows), "judged": len(judged), "passes": run.get("passes", 1),
               "first_wrong": None if first_row is None else {"call": first_row.name,
                                                              "layer": first_row.fields.get("layer")},
               "saved": list(judge.saved), "keep_going": judge.options.keep_going}
    return Report("scan", title, rows, first_finding=finding, coverage=_coverage(judge.entries, run.get("unseen", [])),
                  notes=tuple(notes), details=details, unit="row", row_label="call",
                  ledger=ledger if isinstance(ledger, Report) else None, ledgers=dict(judge.ledgers))


# --- a whole scan -----------------------------------------------------------------------------------


def sides_of(inputs: "Mapping[str, Tensor] | None") -> Sides:
    """The real tokens of each side, and the decoder's positions, from the inputs sent (none: all real)."""
    import torch

    if not inputs:
        return Sides({})
    valid: dict[str, Tensor] = {"input": inputs["attention_mask"].bool()}
    if "input_ids" not in inputs:
        return Sides(valid, inputs.get("position_ids"))
    dec = inputs.get("decoder_input_ids")
    if dec is not None:
        valid["decoder"] = torch.ones(dec.shape, dtype=torch.bool)
    positions = inputs.get("position_ids")
    if positions is None:
        ids = inputs["input_ids"]
        positions = torch.arange(ids.shape[-1]).expand(ids.shape)
    return Sides(valid, positions)


def _given_sides(given: Mapping[str, Any]) -> "dict[str, Tensor] | None":
    """The factory's own attention mask (and positions, decoder ids) as tensors, where it gave them."""
    import torch

    sides = (given or {}).get("sides") or {}
    if "attention_mask" not in sides:
        return None
    return {k: torch.tensor(v) for k, v in sides.items()}


def _inputs_note(model: Mapping[str, Any], plan: Any, inputs: "Mapping[str, Tensor] | None") -> dict[str, Any]:
    from attn_ledger.probes.model.inputs import pad_counts

    if inputs is None:
        return {"given": {k: v for k, v in (model.get("given_inputs") or {}).items() if k != "sides"}}
    note = {**plan.to_json(), "pads": pad_counts(plan.batch, plan.seq_len, plan.padding),
            "position_ids": "position_ids" in inputs}
    if "decoder_input_ids" in inputs:
        note["decoder_len"] = int(inputs["decoder_input_ids"].shape[-1])
    return note


def scan(handle: Any, plan: Any, options: ScanOptions = ScanOptions()) -> Report:
    """Scan the model behind ``handle`` (a :class:`~attn_ledger.probes.model.driver.LocalModel` or
    ``RemoteModel``) on inputs made from ``plan`` (:class:`~attn_ledger.probes.model.inputs.InputPlan`), or on
    its factory's own inputs where it gave some."""
    from attn_ledger.probes.model.inputs import make_inputs

    model = handle.facts
    given = model.get("given_inputs")
    inputs = None if given is not None else make_inputs(plan, model)
    judge = Judge(model, sides_of(inputs if inputs is not None else _given_sides(given)), options)
    with _saving(judge, options.save):
        try:
            run = handle.scan(inputs, judge.take)
        except CallStopped as stop:  # the worker died or ran out of time mid-forward: what was judged stands
            run = {"calls": len(judge.entries), "unseen": [], "error": {"text": stop.detail, **stop.data}}
    note = _inputs_note(model, plan, inputs)
    impl = model.get("implementation") or "module"
    size = "" if inputs is None else f" B={plan.batch} T={plan.seq_len} padding={plan.padding}"
    title = f"scan {model['label']} ({model['class']}, {impl}, {run.get('calls', 0)} attention calls){size}"
    ledger = first_ledger(judge) if options.ledger else None
    return scan_report(model, judge, run, note, title, ledger)


@contextlib.contextmanager
def _saving(judge: Judge, directory: str | None) -> Iterator[None]:
    """``--save``: the files go into a new directory beside ``directory``, renamed into place once the forward is
    done, so that a scan that breaks off leaves nothing half-written."""
    import os
    import shutil
    import tempfile

    if directory is None:
        yield
        return
    target = os.path.abspath(directory)
    judge.save_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))
    try:
        yield
        if os.path.isdir(target):
            os.rmdir(target)  # empty, as the command checked: replaced by the one written
        os.rename(judge.save_dir, target)
    finally:
        if os.path.isdir(judge.save_dir):
            shutil.rmtree(judge.save_dir, ignore_errors=True)
        judge.save_dir = directory


def first_ledger(judge: Judge) -> "Report | str | None":
    """The stage ledger of the first wrong call (on the example of its finding), or why there is none."""
    if judge.first is None:
        return None
    found = judge.ledgers.get(label_of(judge.first.call.facts))
    return found if found is not None else call_ledger(judge.first, judge.sides_of(judge.first.call.facts))


def call_ledger(kept: Kept, sides: Sides) -> "Report | str":
    """A judged call's stage ledger, on the example of its finding (or its first with real query rows)."""
    from attn_ledger.probes.model.replay import stage_ledger

    call, verdict = kept.call, kept.verdict
    allow, real = verdict.allow, verdict.real
    if allow is None and call.q is not None and call.k is not None and call.q.dim() == 4 and call.k.dim() == 4:
        allow, real, *_ = implied(call, kept.expected, sides)
    if allow is None:
        return "its q, k and v were not observed"
    first = verdict.first_failure()
    at = (first.location or {}).get("example") if first is not None else None
    example = at if isinstance(at, int) and bool(real[at].any()) else verdict.example
    if not bool(real[example].any()):
        example = int(real.any(dim=1).nonzero()[0]) if bool(real.any()) else example
    return stage_ledger(call, allow, real, example, label_of(call.facts), scale_of(call, kept.expected),
                        kept.expected.softcap)


def stopped_report(target: Mapping[str, Any], reason: str, data: Mapping[str, Any]) -> Report:
    """The report of a scan whose forward never came back before any call was judged (a crash or the time limit)."""
    label = target.get("source", "model") if target.get("kind") != "transformers" else f"--transformers {target['source']}"
    checks = (Check(1, "observed", "fail", reason=reason, data=dict(data)),
              *(unjudged(level, name, "not_reached", "the forward did not return") for level, name in CHECK_ORDER[1:]))
    return Report("scan", f"scan {label}", (Row("forward", "fail", checks, None, AXES),), unit="row", row_label="call",
                  details={"model": {"label": label}, "calls": 0, "judged": 0})


def scan_model(model: Any, inputs: Any = None, *, batch: int = 2, seq_len: int = 24, padding: str = "none",
               seed: int = 0, causal: bool | None = None, window: int | None = None, scale: float | None = None,
               softcap: float | None = None, keep_going: bool = False, ledger: bool = True,
               label: str | None = None) -> Report:
    """Scan a model object in this process: every attention call of one forward, judged (see :func:`scan`).

    Args:
        model: an ``nn.Module``; a transformers model is judged against its config, another against
            ``causal``, ``window``, ``scale`` and ``softcap`` (nothing declared: the relation it shows is
            reported, not judged, and the coverage says so).
        inputs: the forward's keyword arguments (a dict) or its one tensor; None makes token ids for a
            transformers model from ``batch``, ``seq_len``, ``padding`` and ``seed``.
        keep_going: judge the calls after the first wrong one too; ``ledger``: run its stage ledger.
        label: how the report names the model (default: its class).

    Raises:
        SetupError: a model that is not transformers' without inputs.
    """
    from attn_ledger.errors import SetupError
    from attn_ledger.probes.model.driver import Loaded, LocalModel, model_facts
    from attn_ledger.probes.model.inputs import InputPlan

    facts = model_facts(model, inputs, label or type(model).__name__)
    if facts["architecture"] == "module" and inputs is None:
        raise SetupError(f"inputs: got None for a {facts['class']}, which is not a transformers model; expected its "
                         "forward's keyword arguments or input tensor")
    declared = Declared(causal, window, scale, softcap)
    options = ScanOptions(keep_going, REFERENCE_BUDGET, declared if declared.any else None, None, ledger)
    was = model.training
    model.eval()
    try:
        return scan(LocalModel(Loaded(model, inputs, facts)), InputPlan(batch, seq_len, padding, seed), options)
    finally:
        model.train(was)
