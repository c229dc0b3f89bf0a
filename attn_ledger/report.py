"""The ledger as data: frozen records for checks, stage rows and whole reports.

Nothing here formats for display; numbers stay numbers. Rendering lives in
:mod:`attn_ledger.render`. Every command's JSON shares one envelope
(:func:`envelope`): ``tool``, ``version``, ``command``, ``verdict``, then the
command's own fields. The envelope only ever grows by adding fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from attn_ledger._version import __version__

Status = Literal["ok", "diverged", "not_reached", "downstream"]
Severity = Literal["error", "warning"]

LEVEL_NAMES = {1: "shape", 2: "axis semantics", 3: "numerical invariants", 4: "behaviour"}


def envelope(command: str, verdict: str, **fields: Any) -> dict[str, Any]:
    """The JSON envelope every command shares."""
    return {"tool": "attn-ledger", "version": __version__, "command": command, "verdict": verdict, **fields}


def json_number(value: float | int | None) -> float | int | str | None:
    """Numbers for JSON: NaN and infinities become strings, since JSON has no literal for them."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(value)


@dataclass(frozen=True)
class Check:
    """One invariant judged at one stage.

    Attributes:
        level: 1 shape, 2 axis semantics, 3 numerical invariants, 4 behaviour.
        name: short stable identifier, e.g. ``key_row_sums``.
        ok: True passed, False failed, None not evaluated.
        value: the measured number behind the verdict (an error, a count, ...).
        detail: one human sentence: what was measured against what.
        severity: ``"warning"`` checks are shown but never make a divergence.
    """

    level: int
    name: str
    ok: bool | None
    value: float | None = None
    detail: str = ""
    severity: Severity = "error"

    @property
    def failed(self) -> bool:
        return self.ok is False and self.severity == "error"

    def to_json(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "name": self.name,
            "ok": self.ok,
            "value": json_number(self.value),
            "detail": self.detail,
            "severity": self.severity,
        }


@dataclass(frozen=True)
class Divergence:
    """Where the computation first stopped meaning what was intended."""

    stage: str
    level: int
    check: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "level": self.level, "check": self.check, "detail": self.detail}


@dataclass(frozen=True)
class StageRow:
    """One stage of the ledger: its tensor's shape, what its axes mean, and its checks."""

    stage: str
    shape: tuple[int, ...] | None
    axes: str
    status: Status
    checks: tuple[Check, ...] = ()
    note: str = ""

    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "shape": list(self.shape) if self.shape is not None else None,
            "axes": self.axes,
            "status": self.status,
            "checks": [c.to_json() for c in self.checks],
            "note": self.note,
        }


def find_check(checks: "tuple[Check, ...] | list[Check]", name: str) -> Check:
    """The check called ``name`` (KeyError if there is none)."""
    for c in checks:
        if c.name == name:
            return c
    raise KeyError(name)


def first_divergence_of(rows: list[StageRow] | tuple[StageRow, ...]) -> Divergence | None:
    """The first stage (in order) with a failing check; within it, the lowest failing level."""
    for row in rows:
        failing = row.failing()
        if failing:
            worst = min(failing, key=lambda c: c.level)
            return Divergence(row.stage, worst.level, worst.name, worst.detail)
    return None


@dataclass(frozen=True)
class Ledger:
    """The result of one ledger run.

    Attributes:
        command: the command that produced it (``run``, ``check``, ...).
        title: one line naming the case (sizes, mask, dtype).
        rows: one :class:`StageRow` per stage, in stage order.
        first_divergence: the diagnosis, or None when every check holds.
        notes: extra lines a reader needs (sampling, mask picture, ...).
        meta: plain-number facts about the case (B, Tq, Tk, ...), for JSON.
        tensors: small intermediates kept for inspection (never serialised).
    """

    command: str
    title: str
    rows: tuple[StageRow, ...]
    first_divergence: Divergence | None
    notes: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def verdict(self) -> str:
        return "pass" if self.first_divergence is None else "diverged"

    @property
    def exit_code(self) -> int:
        return 0 if self.first_divergence is None else 1

    def row(self, stage: str) -> StageRow:
        for r in self.rows:
            if r.stage == stage:
                return r
        raise KeyError(stage)

    def check(self, stage: str, name: str) -> Check:
        try:
            return find_check(self.row(stage).checks, name)
        except KeyError:
            raise KeyError(f"{stage}.{name}") from None

    def warnings(self) -> list[tuple[str, Check]]:
        return [(r.stage, c) for r in self.rows for c in r.checks if c.severity == "warning" and c.ok is False]

    def to_json(self) -> dict[str, Any]:
        return envelope(
            self.command,
            self.verdict,
            title=self.title,
            first_divergence=self.first_divergence.to_json() if self.first_divergence else None,
            rows=[r.to_json() for r in self.rows],
            notes=list(self.notes),
            meta=self.meta,
        )

    def to_markdown(self) -> str:
        from attn_ledger.render import ledger_markdown

        return ledger_markdown(self)

    def to_rich(self) -> Any:
        from attn_ledger.render import ledger_rich

        return ledger_rich(self)


class CheckedReport:
    """Shared verdict logic for reports that carry a tuple of :class:`Check` named ``checks``."""

    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def verdict(self) -> str:
        return "pass" if self.ok else "fail"

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)


class Report(Protocol):
    """What every command hands to the CLI for rendering."""

    @property
    def exit_code(self) -> int: ...

    def to_json(self) -> dict[str, Any]: ...

    def to_markdown(self) -> str: ...

    def to_rich(self) -> Any: ...
