"""What the stages of one ledger have found so far, before they become report rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from attn_ledger.report import Check, Note


@dataclass
class Rows:
    """Per stage: checks, the tensor's shape, what it raised, a note and its fields; the ledger's notes and kept tensors."""

    checks: dict[str, list[Check]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    raised: dict[str, BaseException] = field(default_factory=dict)
    row_notes: dict[str, Note] = field(default_factory=dict)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
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

    def stage(self, name: str, shape: tuple[int, ...] | None, checks: list[Check], note: Note | None = None) -> None:
        self.shapes[name], self.checks[name] = shape, list(checks)
        if note is not None:
            self.row_notes[name] = note
