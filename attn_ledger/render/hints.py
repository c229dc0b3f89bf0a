"""The hints' sentences: what to try next, written from each :class:`~attn_ledger.report.Hint`'s data.

Every renderer calls :func:`hint_lines` right under the first-finding line, so the table, Markdown,
GitHub and HTML views say the same words. A hint was tested before it was made (its data holds the
measurement), so the sentence states what the data matched, then the option that declares it.
"""

from __future__ import annotations

from typing import Any, Mapping

from attn_ledger.report import Hint, Report

__all__ = ["hint_lines", "hint_text"]


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _relation(d: Mapping[str, Any]) -> str:
    return (f"the saved {d.get('tensor', 'out')} matches {d['found_text']} (max |diff| {_num(d['value'])}, within the "
            f"same bound), not the declared {d['declared_text']}: try {d['option']}")


def _scale(d: Mapping[str, Any]) -> str:
    value = "" if d["found_name"] == "1" else f" = {_num(d['found'])}"
    return (f"the saved {d.get('tensor', 'out')} matches attention with scale {d['found_name']}{value} "
            f"(max |diff| {_num(d['value'])}, within the same bound), not the declared {_num(d['declared'])}: "
            f"try {d['option']}")


def _softcap(d: Mapping[str, Any]) -> str:
    return f"the scores are soft-capped at {d['cap']:.3g}: if that is the design, declare it with {d['option']}"


def _window(d: Mapping[str, Any]) -> str:
    return (f"the core applies a sliding window of {d['window']} keys, and the core is attention with it: "
            f"if that is the design, declare it with {d['option']}")


def _alignment(d: Mapping[str, Any]) -> str:
    return (f"every failing case ({d['failing']}) is causal with Tq != Tk, while {d['passing']} causal "
            f"{'case' if d['passing'] == 1 else 'cases'} with Tq == Tk {'passes' if d['passing'] == 1 else 'pass'}, and {d['case']}'s output matches {d['found']} causal attention (max |diff| "
            f"{_num(d['value'])}, within its bound): align is_causal {d['expected']} (key j <= query i + Tk - Tq), as "
            "the protocol says; F.scaled_dot_product_attention's is_causal is top-left")


WRITERS = {"relation": _relation, "scale": _scale, "declare_softcap": _softcap, "declare_window": _window,
           "alignment": _alignment}


def hint_text(hint: Hint) -> str:
    """One hint as a sentence, ``hint: ...``."""
    return "hint: " + WRITERS[hint.kind](hint.data)


def hint_lines(report: Report) -> list[str]:
    """The report's hints, one sentence each, in order (empty when it has none)."""
    return [hint_text(h) for h in report.hints]
