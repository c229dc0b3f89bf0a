"""The first adder's attention: each run's calls inside that block, judged and put through the stage ledger as
``scan`` does its first wrong call.

Once ``compare`` has named the first block that adds error, the worker runs each run's own forward once more under
scan's capture (:func:`attn_ledger.probes.model.pair.run_calls`), sending only that block's attention calls. Here
each run's calls go to a scan :class:`~attn_ledger.probes.model.scan.Judge` of their own (the run's model facts,
its own inputs' real tokens and positions), which judges every call against the config and runs its stage ledger
(:func:`attn_ledger.probes.model.scan.call_ledger`). What comes back is plain data per call (:class:`CallSummary`)
and the ledgers themselves: the run, the call, its first failing check with the diagnosis the reference found, and
the first stage where its ledger fails. A block whose attention passes in both runs added its error elsewhere (its
MLP, its norms), and the summary says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from attn_ledger.guard import CallStopped
from attn_ledger.report import Report, row_status

if TYPE_CHECKING:
    from torch import Tensor

RUNS = (("a", "A"), ("b", "B"))


@dataclass(frozen=True)
class CallSummary:
    """One attention call of the first adder in one run: its scan verdict and its stage ledger's first finding.

    ``run`` is the run as the report names it ("A", "B", "A (example 1 alone)"); ``call`` the call's label in scan.
    """

    run: str
    call: str
    status: str
    check: str | None = None
    reason: str = ""
    diagnosis: str | None = None
    stage: str | None = None  # the ledger's first failing stage, else where the failing check says the fault enters
    stage_check: str | None = None  # the ledger's check there (None: the stage is the check's word)
    ledger: str | None = None  # the ledger's key in the report's ``ledgers``, or why there is none

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Attention:
    """The first adder's attention in both runs: a summary per call, their stage ledgers by key, and the ledger the
    report opens onto (the first failing call's, else run B's first)."""

    block: str
    calls: tuple[CallSummary, ...]
    ledgers: Mapping[str, Report]
    why: str = ""  # why nothing was captured, where nothing was

    @property
    def failing(self) -> CallSummary | None:
        return next((c for c in self.calls if c.status == "fail"), None)

    @property
    def ledger(self) -> Report | None:
        shown = self.failing or next((c for c in self.calls if c.run.startswith("B")), None)
        return None if shown is None else self.ledgers.get(shown.ledger or "")

    def as_json(self) -> dict[str, Any]:
        return {"block": self.block, "calls": [c.as_json() for c in self.calls], "why": self.why or None}


def _summary(run: str, judge: Any, entry: Any, ledgers: dict[str, Report],
             counts: list[int] | None = None) -> CallSummary:
    """``counts``: the call is run B's packed row, of documents this many tokens long (its location is then said
    by document and token)."""
    from dataclasses import replace

    from attn_ledger.probes.model.scan import label_of

    label = label_of(entry.facts)
    if entry.verdict is None:
        return CallSummary(run, label, "not_reached", reason="not judged")
    checks = entry.verdict.checks
    first = entry.verdict.first_failure()
    if first is not None and counts and first.location:
        first = replace(first, location=packed_location(first.location, counts))
    found = judge.ledgers.get(label)
    key = f"{run}: {label}"
    stage = stage_check = None
    if isinstance(found, Report):
        ledgers[key] = found
        if found.first_finding is not None:
            stage, stage_check = found.first_finding.row, found.first_finding.name
    if stage is None and first is not None:  # the ledger's stages agree: where the check says the fault enters
        stage = (first.data or {}).get("stage")
    return CallSummary(run, label, row_status(checks), None if first is None else first.name,
                       "" if first is None else first.reason or _measured(first),
                       None if first is None else (first.data or {}).get("diagnosis"), stage, stage_check,
                       key if key in ledgers else None)


def _measured(check: Any) -> str:
    """A failing check without words, in words: what it measured, the value, and where (``finite``: which rows)."""
    from attn_ledger.render.text import fmt_value, location_text

    if not check.measure:
        return ""
    where = location_text(check.location)
    return f"{check.measure} = {fmt_value(check.value)}" + (f" at {where}" if where else "")


def attention_of(handle: Any, facts: Mapping[str, Any], inputs_a: Mapping[str, "Tensor"],
                 inputs_b: Mapping[str, "Tensor"], index: int, block: str, alone: int | None = None,
                 packed: bool = False) -> Attention:
    """Block ``index``'s attention calls in both runs (through ``handle.compare_calls``), judged and ledgered;
    ``alone``: run A is that example alone (``--vary batch``); ``packed``: run B is the examples packed into one row
    (``--vary packing``), each judged as its own document. Under ``--vary cache`` each of run B's decode steps is
    judged on the tokens up to its own (:meth:`~attn_ledger.probes.model.scan.Judge.sides_of`)."""
    from attn_ledger.probes.model.pair import alone_inputs
    from attn_ledger.probes.model.scan import Judge, ScanOptions, sides_of

    options = ScanOptions(keep_going=True, every_ledger=True)
    sides_a = sides_of(inputs_a if alone is None else alone_inputs(inputs_a, inputs_a["attention_mask"].bool(), alone))
    sides_b = packed_sides(inputs_b["attention_mask"].bool()) if packed else sides_of(inputs_b)
    judges = {"a": Judge(facts, sides_a, options), "b": Judge(facts.get("b", facts), sides_b, options)}
    names = dict(RUNS) if alone is None else {"a": f"A (example {alone} alone)", "b": "B"}

    def take(f: dict[str, Any], t: dict[str, "Tensor"]) -> None:
        judges[f["side"]].take(f, t)

    try:
        run = handle.compare_calls(inputs_a, inputs_b, index, take, alone or 0)
    except CallStopped as stop:
        return Attention(block, (), {}, why=f"the forwards that capture its attention stopped: {stop.detail}")
    ledgers: dict[str, Report] = {}
    counts = inputs_b["attention_mask"].bool().sum(-1).tolist() if packed else None
    calls = tuple(_summary(names[side], judges[side], e, ledgers, counts if side == "b" else None)
                  for side, _ in RUNS for e in judges[side].entries)
    errors = [f"run {names[side]}: {run[side]['error']}" for side, _ in RUNS if (run.get(side) or {}).get("error")]
    why = "; ".join(errors) if errors else ("" if calls else "no attention call inside it was captured")
    return Attention(block, calls, ledgers, why)


def packed_sides(valid: "Tensor") -> Any:
    """What run B of ``--vary packing`` feeds its one row ``[1, N]``: every token real, position ids restarting
    at each document, and each token's document (the example it came from)."""
    import torch

    from attn_ledger.probes.model.judge import Sides
    from attn_ledger.probes.model.pair import packed_documents, packed_positions

    every = torch.ones(1, int(valid.sum()), dtype=torch.bool)  # [1, N]
    return Sides({"input": every}, packed_positions(valid), packed_documents(valid)[None])


def packed_location(where: Mapping[str, Any], counts: list[int]) -> dict[str, Any]:
    """A location in the packed row (``query``, ``key``: positions along it) said by document (the example each
    came from) and its token within the document; the other fields as they are."""
    def split(position: int) -> tuple[int, int]:
        for doc, n in enumerate(counts):
            if position < n:
                return doc, position
            position -= n
        return len(counts), position

    out: dict[str, Any] = {}
    for name, value in where.items():
        if name == "example" and value == 0:  # the packed row is one example: said by documents instead
            continue
        if name in ("query", "key") and isinstance(value, int):
            doc, token = split(value)
            prefix = "" if name == "query" else "key "
            out[f"{prefix}document"], out[f"{prefix}token"] = doc, token
        else:
            out[name] = value
    return out
