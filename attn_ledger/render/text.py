"""The words and numbers every view shares: a check's sentence, value formatting, status words.

Sentences are rendered from a check's fields; nothing in a report stores them.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Mapping

from attn_ledger.report import LEVEL_NAMES, STATUSES, Check, Finding, Report

STATUS_WORD = {s: s.replace("_", " ") for s in STATUSES}
STATUS_STYLE = {
    "pass": "green",
    "fail": "bold red",
    "warn": "yellow",
    "inconclusive": "yellow",
    "skipped": "dim",
    "not_applicable": "dim",
    "not_reached": "dim",
    "downstream": "yellow",
}


BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
"""Characters that reorder the text around them on a terminal (embeddings, overrides, isolates, marks)."""
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def printable(text: str, keep: str = "") -> str:
    """``text`` with control characters, line separators and bidirectional controls escaped as JSON
    writes them (``\\n``, ``\\u202e``), so that a name or a path from a user prints as one line that
    reads as it is stored. ``keep``: characters left as they are (a note's own line breaks)."""
    if text.isprintable():  # no control, format or separator character: the common case
        return text
    return "".join(_escape(c) if c not in keep and _unsafe(c) else c for c in text)


def _unsafe(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Zl", "Zp") or c in BIDI_CONTROLS


def _escape(c: str) -> str:
    return _NAMED_ESCAPES.get(c, f"\\u{ord(c):04x}")


def nonfinite_text(value: float) -> str | None:
    """How every view writes a float that is not a finite number (``nan``, ``inf``, ``-inf``); None for one that is."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return None


def fmt_value(value: Any) -> str:
    """A number as a reader wants it: integers whole, others to three significant digits."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return nonfinite_text(value)  # type: ignore[return-value]
        if value.is_integer() and abs(value) < 1e9:
            return str(int(value))
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    return str(value)


def location_text(location: Mapping[str, Any] | None) -> str:
    if not location:
        return ""
    return ", ".join(f"{k} {fmt_value(v)}" for k, v in location.items())


def bound_text(check: Check) -> str:
    """``limit 4e-06``, ``at least 0.5``, ``expected 0`` or ``rtol 2e-05, atol 2e-05``."""
    parts = []
    if check.limit is not None:
        word = {"<=": "limit", ">=": "at least", "==": "expected"}.get(check.op, "limit")
        parts.append(f"{word} {fmt_value(check.limit)}")
    if check.rtol is not None or check.atol is not None:
        parts.append(f"rtol {fmt_value(check.rtol or 0.0)}, atol {fmt_value(check.atol or 0.0)}")
    rule = rounding_text(check.data.get("tolerance")) if check.status != "pass" and isinstance(check.data, Mapping) else ""
    if rule:
        parts.append(rule)
    return ", ".join(parts)


def rounding_text(parts: Any) -> str:
    """``worst element: error 6.3e-06, bound c 2 x eps 1.19e-07 x M 26.3 = 6.27e-06 (error / bound 1.01)``:
    the rounding rule's parts (``check.data["tolerance"]``) at the element nearest its bound."""
    if not isinstance(parts, Mapping) or parts.get("rule") != "c * eps * M" or "bound" not in parts:
        return ""
    m = fmt_value(parts["M"])
    under = parts.get("underflow", 0.0)
    if under and under > 1e-3 * parts["M"]:
        m = f"({m} + underflow {fmt_value(under)})"
    return (f"worst element: error {fmt_value(parts['error'])}, bound c {fmt_value(parts['c'])} x eps "
            f"{fmt_value(parts['eps'])} x M {m} = {fmt_value(parts['bound'])} "
            f"(error / bound {fmt_value(parts['ratio'])})")


def describe(check: Check) -> str:
    """One sentence for a check, from its fields: what was measured, the bound, where, why."""
    text = ""
    if check.value is not None:
        text = f"{check.measure} = {fmt_value(check.value)}" if check.measure else fmt_value(check.value)
        bound = bound_text(check)
        if bound:
            text += f" ({bound})"
    elif check.measure:
        text = check.measure
    where = location_text(check.location)
    if where:
        text += f" at {where}"
    if check.reason:
        text = f"{text}; {check.reason}" if text else check.reason
    return text


def check_line(check: Check) -> str:
    """``L2 FAIL roundtrip_exact = 96``: level, status word, name and value, for tables."""
    value = fmt_value(check.value)
    return f"L{check.level} {STATUS_WORD[check.status]} {check.name}" + (f" = {value}" if value else "")


def finding_line(finding: Finding | None, label: str = "first finding") -> str:
    """The headline every command prints last."""
    if finding is None:
        return f"{label}: none"
    c = finding.check
    return f"{label}: {finding.row} (L{c.level} {LEVEL_NAMES[c.level]}: {c.name}) - {describe(c)}"


def verdict_line(report: Report) -> str:
    return finding_line(report.first_finding)


def shape_text(shape: tuple[int, ...] | None) -> str:
    return "" if shape is None else "(" + ", ".join(str(d) for d in shape) + ")"
