"""The JSON view: one envelope for every command, schema version 2.

The envelope: ``schema_version``, ``tool``, ``version``, ``command``, ``verdict``, ``title``,
``first_finding``, ``coverage``, ``rows``, ``notes``, ``note_data``, ``details``, ``hints``. Within a schema
version the document only ever gains fields. ``notes`` are the lines a reader sees, written from
the notes' data; ``note_data`` holds that data beside them, line for line (null for a line that
is only words), as each row's ``note_data`` does for its ``note``. The JSON Schema is published in the package
(``attn_ledger/schema/report.schema.json``, :func:`schema`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from attn_ledger._version import __version__
from attn_ledger.render.hints import hint_text
from attn_ledger.render.notes import cli_line, note_lines, note_text, notes_text, python_lines
from attn_ledger.render.text import describe
from attn_ledger.report import SCHEMA_VERSION, Check, Coverage, Finding, Hint, Note, Report, Row


def json_value(value: Any) -> Any:
    """Plain JSON: NaN and infinities become strings, tuples lists, mappings dicts."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        return json_value(value.item())
    return str(value)


def note_json(note: "str | Note") -> dict[str, Any] | None:
    """The data of a note, ``{"kind": ..., **data}``; None for a note that is words."""
    if isinstance(note, str):
        return None
    return {"kind": note.kind, **json_value(note.data)}


def notes_json(report: Report) -> list[dict[str, Any] | None]:
    """``note_data``: the data of each line of ``notes``, index for index (a note written as several lines
    carries its data on its first line, and the others are null)."""
    out: list[dict[str, Any] | None] = []
    for note in report.notes:
        lines = note_lines(note)
        out += [note_json(note)] + [None] * (len(lines) - 1)
    return out


def check_json(c: Check) -> dict[str, Any]:
    return {
        "level": c.level,
        "name": c.name,
        "status": c.status,
        "measure": c.measure,
        "value": json_value(c.value),
        "limit": json_value(c.limit),
        "op": c.op,
        "rtol": json_value(c.rtol),
        "atol": json_value(c.atol),
        "location": json_value(c.location),
        "reason": c.reason,
        "data": json_value(c.data),
        "message": describe(c),
    }


def row_json(r: Row) -> dict[str, Any]:
    return {
        "name": r.name,
        "status": r.status,
        "shape": None if r.shape is None else list(r.shape),
        "axes": r.axes,
        "fields": json_value(r.fields),
        "checks": [check_json(c) for c in r.checks],
        "note": note_text(r.note),
        "note_data": note_json(r.note) if r.note else None,
    }


def finding_json(f: Finding | None) -> dict[str, Any] | None:
    if f is None:
        return None
    c = f.check
    return {
        "row": f.row,
        "level": c.level,
        "check": c.name,
        "status": c.status,
        "value": json_value(c.value),
        "limit": json_value(c.limit),
        "op": c.op,
        "location": json_value(c.location),
        "message": describe(c),
    }


def coverage_json(cov: Coverage | None) -> dict[str, Any] | None:
    if cov is None:
        return None
    return {"scope": cov.scope, "missing": list(cov.missing), "reason": cov.reason}


def envelope(command: str, verdict: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "tool": "attn-ledger", "version": __version__,
            "command": command, "verdict": verdict}


def report_json(report: Report) -> dict[str, Any]:
    """The whole report as plain JSON data (with ``ledger``, the report it opens onto, where it has one)."""
    doc = {
        **envelope(report.command, report.verdict),
        "title": report.title,
        "first_finding": finding_json(report.first_finding),
        "coverage": coverage_json(report.coverage),
        "rows": [row_json(r) for r in report.rows],
        "notes": notes_text(report),
        "note_data": notes_json(report),
        "details": details_json(report.details),
        "hints": [hint_json(h) for h in report.hints],
    }
    if report.ledger is not None:
        doc["ledger"] = report_json(report.ledger)
    return doc


def hint_json(h: Hint) -> dict[str, Any]:
    """One hint: its ``kind``, its data's fields, and the sentence the views write from them (``message``)."""
    return {"kind": h.kind, **json_value(h.data), "message": hint_text(h)}


def details_json(details: Mapping[str, Any]) -> Any:
    """The details as plain JSON, with ``reproduce`` (``check``'s smallest failing case, as data) also
    written out as its ``cli`` line and ``python`` lines."""
    doc = json_value(details)
    repro = doc.get("reproduce") if isinstance(doc, dict) else None
    if isinstance(repro, dict) and "target" in repro:
        doc["reproduce"] = {"case": repro["case"], "cli": cli_line(repro), "python": "\n".join(python_lines(repro)),
                            **{k: v for k, v in repro.items() if k != "case"}}
    return doc


def error_json(command: str, message: str) -> dict[str, Any]:
    """The envelope written on stdout when the tool itself failed (exit status 3)."""
    return {**envelope(command, "error"), "title": "internal error", "first_finding": None,
            "coverage": None, "rows": [], "notes": [], "details": {}, "error": message}


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def schema() -> dict[str, Any]:
    """The published JSON Schema of the report document."""
    from importlib import resources

    text = resources.files("attn_ledger").joinpath("schema/report.schema.json").read_text(encoding="utf-8")
    return json.loads(text)
