"""The terminal view: a table laid out by hand so that numbers and identifiers are never split.

Columns that hold names, statuses, shapes and numbers take the width of their longest entry;
the last column (checks and notes) takes the rest and wraps at spaces only. A token wider
than its column stays whole and runs past the edge rather than being cut. Lines are built as
styled segments, so the same layout prints with colour (rich) or as plain text. Text from a
report prints with its control and bidirectional characters escaped (:func:`printable`): a
file name with a newline or a U+202E override in it stays one line that reads as it is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from attn_ledger.render.hints import hint_lines
from attn_ledger.render.notes import note_text, notes_text
from attn_ledger.render.text import (
    STATUS_STYLE,
    STATUS_WORD,
    bound_text,
    check_line,
    describe,
    finding_line,
    fmt_value,
    printable,
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


def _field_text(value: object) -> str:
    return "-" if value is None else printable(fmt_value(value))


def _check_cell(row: Row, report: Report, width: int, folded: Sequence[str], more: int = 0) -> list[Line]:
    """The last column: folded fields, then the checks shown, then the row's note.

    The ledger (``show_passing``) lists every check as ``L2 pass name = value``; reports over
    many rows list only what did not pass, each with its sentence, and count the rest.
    """
    lines: list[Line] = []
    for key in folded:
        value = row.fields.get(key)
        if value is None:
            continue
        for ln in wrap_words(printable(f"{key} {fmt_value(value)}"), width):
            lines.append([(ln, "dim")])
    if row.status == "not_reached":
        shown: list[Check] = []
    elif report.show_passing:
        shown = list(row.checks)
    else:
        shown = [c for c in row.checks if c.status in ("fail", "warn", "inconclusive", "downstream")]
    for c in shown:
        if report.show_passing:
            text = check_line(c)
            bound = bound_text(c) if c.status in ("fail", "warn", "downstream") else ""
            text += f" ({bound})" if bound and c.value is not None else ""
        else:
            sentence = describe(c)
            text = f"L{c.level} {STATUS_WORD[c.status]} {c.name}" + (f": {sentence}" if sentence else "")
        for ln in wrap_words(printable(text), width):
            lines.append([(ln, _check_style(c))])
    if not report.show_passing and shown:
        counts = _tally(c.status for c in row.checks if c not in shown)
        if counts:
            lines += [[(ln, "dim")] for ln in wrap_words(f"({counts})", width)]
    if row.note:
        for ln in wrap_words(printable(note_text(row.note), keep="\n"), width):  # its line breaks draw a picture
            lines.append([(ln, "dim")])
    if more:
        head = _signature(row)
        for ln in wrap_words(f"and {more} more {report.row_label}s whose first finding is the same "
                             f"(L{head[1]} {head[2]})", width):  # type: ignore[index]
            lines.append([(ln, "dim")])
    return lines


def _signature(row: Row) -> tuple[str, int, str] | None:
    """What makes two rows fold into one: the first failing check, else the first warning; None if neither."""
    failing = row.first_failing()
    if failing is not None:
        return ("fail", failing.level, failing.name)
    for c in sorted(row.checks, key=lambda c: c.level):
        if c.status in ("warn", "inconclusive"):
            return (c.status, c.level, c.name)
    return None


FOLD_AT = 12  # a fold_rows report with fewer rows than this is listed whole


def fold(report: Report) -> tuple[list[Row], dict[str, int], dict[str, int]]:
    """For ``fold_rows`` reports: the rows shown (the first of each distinct finding), how many more
    rows each stands for, and the statuses of the rows not shown."""
    if len(report.rows) < FOLD_AT:
        return list(report.rows), {}, {}
    shown: list[Row] = []
    more: dict[str, int] = {}
    first: dict[tuple[str, int, str], str] = {}
    hidden: dict[str, int] = {}
    for r in report.rows:
        key = _signature(r)
        if key is None:
            hidden[r.status] = hidden.get(r.status, 0) + 1
        elif key in first:
            more[first[key]] += 1
        else:
            first[key] = r.name
            more[r.name] = 0
            shown.append(r)
    return shown, more, hidden


def _tally(statuses) -> str:
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{n} {STATUS_WORD[s]}" for s, n in counts.items())


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
    """Every line of the table view, as styled segments.

    Side by side (name, status, shape, fields, then the checks column) while the checks
    column keeps at least ``MIN_WRAP`` characters; otherwise stacked: each row's checks on
    the lines under it, indented.
    """
    rows, more, hidden = (fold(report) if report.fold_rows else (list(report.rows), {}, {}))
    names = {r.name: printable(r.name) for r in rows}
    cols = _columns(report, rows, names, width)
    out: list[Line] = [[(ln, "bold")] for ln in wrap_words(printable(report.title), width)]
    out.append(_header(report.row_label, cols))
    rule_at = len(out)
    for r in rows:
        out += _row_lines(r, report, cols, names[r.name], more.get(r.name, 0))
    out += _not_listed(hidden, report.row_label, width)
    widest = max((len("".join(t for t, _ in ln).rstrip()) for ln in out[rule_at:]), default=0)
    out.insert(rule_at, [("-" * min(width, max(widest, len("checks"))), "dim")])
    out.append([])
    out += _tail(report, width)
    return out


@dataclass(frozen=True)
class _Columns:
    """How wide each column of a table is, and which field columns fit beside the checks column."""

    name: int
    status: int
    shape: int  # 0 without a shape column
    fields: dict[str, int]  # every field's width, listed or not
    columns: list[str]  # the fields with a column of their own
    folded: list[str]  # the fields that fold into the checks column, one a line
    numeric: dict[str, bool]  # a listed field whose values are all numbers is right-aligned
    stacked: bool  # the checks go under each row, not beside it
    wrap: int  # the width the checks wrap to


STACK_INDENT = "    "  # a stacked row's checks, under it


def _columns(report: Report, rows: list[Row], names: dict[str, str], width: int) -> _Columns:
    """Size the columns: as many field columns as leave the checks column room; the rest fold into it."""
    has_shape = any(r.shape is not None or r.axes for r in rows)
    fields = _field_columns(report)
    name_w = max([len(report.row_label)] + [len(names[r.name]) for r in rows])
    status_w = max([len("status")] + [len(STATUS_WORD[r.status]) for r in rows])
    shape_w = max([len("shape / axes")] + [max(len(shape_text(r.shape)), len(printable(r.axes))) for r in rows]) if has_shape else 0
    field_w = {k: max([len(k)] + [len(_field_text(r.fields.get(k))) for r in rows]) for k in fields}
    fixed = name_w + len(GAP) + status_w + len(GAP) + (shape_w + len(GAP) if has_shape else 0)
    stacked = width - fixed < MIN_WRAP
    columns: list[str] = []
    for k in fields:
        room = width - (fixed + field_w[k] + len(GAP))
        if room < (0 if stacked else MIN_WRAP):
            break
        columns.append(k)
        fixed += field_w[k] + len(GAP)
    numeric = {k: all(isinstance(r.fields.get(k), (int, float)) or r.fields.get(k) is None for r in rows) for k in columns}
    return _Columns(name_w, status_w, shape_w, field_w, columns, fields[len(columns):], numeric, stacked,
                    width - len(STACK_INDENT) if stacked else max(MIN_WRAP, width - fixed))


def _header(label: str, cols: _Columns) -> Line:
    header: Line = [(label.ljust(cols.name) + GAP, "bold"), ("status".ljust(cols.status) + GAP, "bold")]
    if cols.shape:
        header.append(("shape / axes".ljust(cols.shape) + GAP, "bold"))
    header += [((k.rjust if cols.numeric[k] else k.ljust)(cols.fields[k]) + GAP, "bold") for k in cols.columns]
    header.append(("checks", "bold"))
    return header


def _row_lines(r: Row, report: Report, cols: _Columns, name: str, more: int) -> list[Line]:
    """One row of the table: its name, status, shape and fields, and its checks beside or under them."""
    check_lines = _check_cell(r, report, cols.wrap, cols.folded, more)
    shape_lines = [shape_text(r.shape), printable(r.axes)] if cols.shape else []
    side = [] if cols.stacked else check_lines
    out: list[Line] = []
    for i in range(max(1, len(side), len(shape_lines))):
        line: Line = [((name if i == 0 else "").ljust(cols.name) + GAP, "bold" if i == 0 else "")]
        word = STATUS_WORD[r.status] if i == 0 else ""
        line.append((word.ljust(cols.status) + GAP, STATUS_STYLE[r.status] if i == 0 else ""))
        if cols.shape:
            text = shape_lines[i] if i < len(shape_lines) else ""
            line.append((text.ljust(cols.shape) + GAP, "dim" if i == 1 else ""))
        for k in cols.columns:
            text = _field_text(r.fields.get(k)) if i == 0 and k in r.fields else ""
            line.append(((text.rjust if cols.numeric[k] else text.ljust)(cols.fields[k]) + GAP, ""))
        if i < len(side):
            line += side[i]
        out.append(line)
    if cols.stacked:
        out += [[(STACK_INDENT, "")] + ln for ln in check_lines]
    return out


def _not_listed(hidden: dict[str, int], label: str, width: int) -> list[Line]:
    """The line that counts the rows a folded table does not list."""
    if not hidden:
        return []
    text = ", ".join(f"{n} {STATUS_WORD[s]}" for s, n in hidden.items())
    return [[(ln, "dim")] for ln in wrap_words(f"not listed: {text} ({sum(hidden.values())} {label}s; "
                                               f"--format json lists every one)", width)]


def _tail(report: Report, width: int) -> list[Line]:
    """Notes, coverage, warnings and the first finding, under the table."""
    out: list[Line] = []
    for note in notes_text(report):
        for ln in wrap_words(printable(note), width):
            out.append([(ln, "dim")])
    if report.coverage is not None:
        cov = report.coverage
        text = f"coverage: {cov.scope}" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
        text += f" ({cov.reason})" if cov.reason else ""
        for ln in wrap_words(printable(text), width):
            out.append([(ln, "yellow")])
    if report.show_passing:
        for row_name, c in report.warnings():
            for ln in wrap_words(printable(f"warning at {row_name}: {c.name}: {describe(c)}"), width):
                out.append([(ln, "yellow")])
    style = "bold red" if report.first_finding is not None else "bold green"
    for ln in wrap_words(printable(finding_line(report.first_finding)), width):
        out.append([(ln, style)])
    for hint in hint_lines(report):  # what to try next, under the finding
        out += [[(ln, "yellow")] for ln in wrap_words(printable(hint), width)]
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
