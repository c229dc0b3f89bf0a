"""The terminal view: a table laid out by hand so that numbers and identifiers are never split.

Columns that hold names, statuses, shapes and numbers take the width of their longest entry;
the last column (checks and notes) takes the rest and wraps at spaces only. A token wider
than its column stays whole and runs past the edge rather than being cut. Lines are built as
styled segments, so the same layout prints with colour (rich) or as plain text.
"""

from __future__ import annotations

from typing import Any, Sequence

from attn_ledger.render.text import (
    STATUS_STYLE,
    STATUS_WORD,
    check_line,
    describe,
    finding_line,
    fmt_value,
    shape_text,
)
from attn_ledger.report import Check, Report, Row

Segment = tuple[str, str]  # (text, rich style)
Line = list[Segment]

GAP = "  "
MIN_WRAP = 28  # narrowest the wrapping column is allowed to get before field columns fold into it


def wrap_words(text: str, width: int, indent: str = "  ") -> list[str]:
    """Wrap at spaces only; continuation lines are indented; a long token is never split."""
    width = max(width, 8)
    out: list[str] = []
    for para in text.split("\n"):
        words = para.split(" ")
        line = words[0]
        for word in words[1:]:
            if len(line) + 1 + len(word) <= width:
                line += " " + word
            else:
                out.append(line)
                line = indent + word
        out.append(line)
    return out


def _check_cell(row: Row, report: Report, width: int, fields_inline: bool) -> list[Line]:
    lines: list[Line] = []
    if fields_inline:
        for key, value in row.fields.items():
            for ln in wrap_words(f"{key} {fmt_value(value)}", width):
                lines.append([(ln, "")])
    shown = [] if row.status == "not_reached" else [c for c in row.checks if report.show_passing or not c.passed]
    for c in shown:
        text = check_line(c)
        if not report.show_passing and c.status not in ("not_applicable", "not_reached", "skipped"):
            sentence = describe(c)
            text = f"{text}: {sentence}" if sentence else text
        style = _check_style(c)
        for ln in wrap_words(text, width):
            lines.append([(ln, style)])
    if not report.show_passing:
        n_pass = sum(1 for c in row.checks if c.passed)
        if n_pass and shown:
            lines.append([(f"({n_pass} checks pass)", "dim")])
    if row.note:
        for ln in wrap_words(row.note, width):
            lines.append([(ln, "dim")])
    return lines


def _check_style(c: Check) -> str:
    if c.status == "fail":
        return "red"
    if c.status in ("warn", "inconclusive"):
        return "yellow"
    if c.status != "pass":
        return "dim"
    return ""


def _field_columns(report: Report) -> list[str]:
    keys: list[str] = []
    for r in report.rows:
        for k in r.fields:
            if k not in keys:
                keys.append(k)
    return keys


def layout(report: Report, width: int = 100) -> list[Line]:
    """Every line of the table view, as styled segments."""
    rows = report.rows
    has_shape = any(r.shape is not None or r.axes for r in rows)
    fields = _field_columns(report)
    label = report.row_label
    name_w = max([len(label)] + [len(r.name) for r in rows])
    status_w = max([len("status")] + [len(STATUS_WORD[r.status]) for r in rows])
    shape_w = max([len("shape / axes")] + [max(len(shape_text(r.shape)), len(r.axes)) for r in rows]) if has_shape else 0
    field_w = {k: max([len(k)] + [len(fmt_value(r.fields.get(k))) for r in rows]) for k in fields}
    fixed = name_w + len(GAP) + status_w + len(GAP) + (shape_w + len(GAP) if has_shape else 0)
    with_fields = fixed + sum(w + len(GAP) for w in field_w.values())
    fields_inline = bool(fields) and width - with_fields < MIN_WRAP
    if not fields_inline:
        fixed = with_fields
    wrap_w = max(MIN_WRAP, width - fixed)

    out: list[Line] = []
    for ln in wrap_words(report.title, width):
        out.append([(ln, "bold")])
    header: Line = [(label.ljust(name_w) + GAP, "bold"), ("status".ljust(status_w) + GAP, "bold")]
    if has_shape:
        header.append(("shape / axes".ljust(shape_w) + GAP, "bold"))
    if not fields_inline:
        header += [(k.rjust(field_w[k]) + GAP, "bold") for k in fields]
    header.append(("checks", "bold"))
    out.append(header)
    rule_at = len(out)
    for r in rows:
        left: list[list[Segment]] = []
        check_lines = _check_cell(r, report, wrap_w, fields_inline)
        shape_lines = [shape_text(r.shape), r.axes] if has_shape else []
        n = max(1, len(check_lines), len(shape_lines) if has_shape else 1)
        for i in range(n):
            line: Line = []
            line.append(((r.name if i == 0 else "").ljust(name_w) + GAP, "bold" if i == 0 else ""))
            word = STATUS_WORD[r.status] if i == 0 else ""
            line.append((word.ljust(status_w) + GAP, STATUS_STYLE[r.status] if i == 0 else ""))
            if has_shape:
                text = shape_lines[i] if i < len(shape_lines) else ""
                line.append((text.ljust(shape_w) + GAP, "dim" if i == 1 else ""))
            if not fields_inline:
                for k in fields:
                    text = fmt_value(r.fields.get(k)) if i == 0 and k in r.fields else ""
                    line.append((text.rjust(field_w[k]) + GAP, ""))
            if i < len(check_lines):
                line += check_lines[i]
            left.append(line)
        out += left
    widest = max((sum(len(t) for t, _ in ln) for ln in out[rule_at:]), default=0)
    out.insert(rule_at, [("-" * min(width, max(widest, fixed + len("checks"))), "dim")])
    out.append([])
    for note in report.notes:
        for ln in wrap_words(note, width):
            out.append([(ln, "dim")])
    if report.coverage is not None:
        cov = report.coverage
        text = f"coverage: {cov.scope}" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
        text += f" ({cov.reason})" if cov.reason else ""
        for ln in wrap_words(text, width):
            out.append([(ln, "yellow")])
    if report.show_passing:
        for row_name, c in report.warnings():
            for ln in wrap_words(f"warning at {row_name}: {c.name}: {describe(c)}", width):
                out.append([(ln, "yellow")])
    style = "bold red" if report.first_finding is not None else "bold green"
    for ln in wrap_words(finding_line(report.first_finding), width):
        out.append([(ln, style)])
    return out


def plain(lines: Sequence[Line]) -> str:
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines) + "\n"


def render_table(report: Report, width: int = 100) -> str:
    """The table as plain text."""
    return plain(layout(report, width))


def rich_lines(lines: Sequence[Line]) -> Any:
    """The table as rich renderables (one Text a line, never re-wrapped by rich)."""
    from rich.text import Text

    texts = []
    for line in lines:
        t = Text(no_wrap=True, overflow="ignore")
        for text, style in line:
            t.append(text, style=style or None)
        t.rstrip()
        texts.append(t)
    return texts
