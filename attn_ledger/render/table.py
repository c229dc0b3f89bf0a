"""The terminal view: a table laid out by hand so that numbers and identifiers are never split.

Columns that hold names, statuses, shapes and numbers take the width of their longest entry;
the last column (checks and notes) takes the rest and wraps at spaces only. A token wider
than its column stays whole and runs past the edge rather than being cut. Lines are built as
styled segments, so the same layout prints with colour (rich) or as plain text. Text from a
report prints with its control and bidirectional characters escaped (:func:`printable`): a
file name with a newline or a U+202E override in it stays one line that reads as it is stored.

Two views. The compact one, the default (:func:`compact_layout`): the verdict first, then a ledger
(``show_passing``) one line per row with its name, status, shape, axes, the field columns that fit
and a summary of its checks (``L1-L4 pass``, or the failing check with its value and limit); the row
of the first finding, and any row with a warning, is expanded under its line with every check, its
note and a ``^^`` pointer to where the finding was measured. Reports over many cases (``check`` on a
kernel, ``faults``, ``intervene``) keep their summary under the verdict. The detail view
(``detail=True``, ``--detail``): every check of every row, with no verdict line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from attn_ledger.render.hints import hint_lines
from attn_ledger.render.notes import note_lines, note_text, notes_text
from attn_ledger.render.text import (
    STATUS_STYLE,
    STATUS_WORD,
    bound_text,
    check_line,
    describe,
    finding_line,
    fmt_value,
    location_text,
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


def layout(report: Report, width: int = 100, detail: bool = False) -> list[Line]:
    """Every line of the table view, as styled segments.

    By default the compact view (:func:`compact_layout`): the verdict first, then a ledger
    one line per row with the row that failed expanded; reports over many cases keep their summary
    under the verdict. ``detail``: every check of every row, as below, with no verdict line.

    Side by side (name, status, shape, fields, then the checks column) while the checks
    column keeps at least ``MIN_WRAP`` characters; otherwise stacked: each row's checks on
    the lines under it, indented. A report that opens onto another (``scan``'s stage ledger of its first
    wrong call) shows that one after its own, under a heading.
    """
    if not detail:
        own = compact_layout(report, width) if report.show_passing else \
            verdict_lines(report, width) + _detail_layout(report, width)
    else:
        own = _detail_layout(report, width)
    if report.ledger is None:
        return own
    adder = (report.details or {}).get("first_adder") or {}
    if adder.get("block"):  # compare: the ledger of the first adder's failing call (or run B's first)
        heading = f"stage ledger of {adder['block']}'s attention"
    else:
        heading = f"stage ledger of {report.first_finding.row}" if report.first_finding is not None else "stage ledger"
    return own + [[], [(heading + ":", "bold")]] + layout(report.ledger, width, detail)


def _detail_layout(report: Report, width: int) -> list[Line]:
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


def _tail(report: Report, width: int, warnings: bool = True) -> list[Line]:
    """Notes, coverage, warnings (``warnings``: the compact view shows them in their rows) and the first
    finding, under the table. The first finding's line is the last but for the hints under it."""
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
    if report.show_passing and warnings:
        for row_name, c in report.warnings():
            for ln in wrap_words(printable(f"warning at {row_name}: {c.name}: {describe(c)}"), width):
                out.append([(ln, "yellow")])
    style = "bold red" if report.first_finding is not None else "bold green"
    for ln in wrap_words(printable(finding_line(report.first_finding)), width):
        out.append([(ln, style)])
    for hint in hint_lines(report):  # what to try next, under the finding, in both views
        out += [[(ln, "yellow")] for ln in wrap_words(printable(hint), width)]
    return out


def plain(lines: Sequence[Line]) -> str:
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines) + "\n"


def render_table(report: Report, width: int = 100, detail: bool = False) -> str:
    """The table as plain text: compact by default, every check of every row with ``detail``."""
    return plain(layout(report, width, detail))


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


# --- the compact view, the default -------------------------------------------------------------
COMPACT_MIN = 28  # the narrowest the summary column gets before a field column is left out
STACK_BELOW = 16  # a summary column narrower than this goes under each row instead
NOT_PASSING = ("fail", "warn", "inconclusive", "downstream")  # a row's checks that its summary names first


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def verdict_text(report: Report) -> str:
    """``PASS: 11 stages, 40 checks`` or ``FAIL at head_roundtrip (L2 roundtrip_exact)``: the first line."""
    finding = report.first_finding
    if finding is not None:
        return f"FAIL at {finding.row} (L{finding.check.level} {finding.check.name})"
    checks = [c for _, c in report.checks()]
    rest: dict[str, int] = {}
    for c in checks:
        if c.status != "pass":
            rest[c.status] = rest.get(c.status, 0) + 1
    text = f"PASS: {_plural(len(report.rows), report.row_label)}, {_plural(len(checks), 'check')}"
    text += f" ({', '.join(f'{n} {STATUS_WORD[s]}' for s, n in rest.items())})" if rest else ""
    return text + (f"; coverage: {report.coverage.scope}" if report.coverage is not None else "")


def verdict_lines(report: Report, width: int) -> list[Line]:
    style = "bold red" if report.first_finding is not None else "bold green"
    return [[(ln, style)] for ln in wrap_words(printable(verdict_text(report)), width)]


def expanded(row: Row, report: Report) -> bool:
    """Whether a row prints every check under its line: the row of the first finding, or a row with a warning."""
    if report.first_finding is not None and row.name == report.first_finding.row:
        return True
    return any(c.status == "warn" for c in row.checks)


def _short_bound(c: Check) -> str:
    """The bound without the rounding rule's parts (those are in the expansion and --detail)."""
    if c.limit is not None:
        word = {"<=": "limit", ">=": "at least", "==": "expected"}.get(c.op, "limit")
        return f"{word} {fmt_value(c.limit)}"
    if c.rtol is not None or c.atol is not None:
        return f"rtol {fmt_value(c.rtol or 0.0)}, atol {fmt_value(c.atol or 0.0)}"
    return ""


def _headline(row: Row, report: Report) -> Check | None:
    """The check a row's one line names: the first finding's, else its first failing, else its first not passing."""
    if report.first_finding is not None and row.name == report.first_finding.row:
        return report.first_finding.check
    first = row.first_failing()
    if first is not None:
        return first
    for status in NOT_PASSING[1:]:
        for c in sorted(row.checks, key=lambda c: c.level):
            if c.status == status:
                return c
    return None


def summary(row: Row, report: Report) -> str:
    """A row's checks in a few words: ``L1-L4 pass``, or the check it is judged by with its value and limit;
    on an expanded row, what did not pass (``2 fail of 4 checks:``), its checks listed under it."""
    if row.status == "not_reached":
        return ""
    if row.checks and all(c.status == "downstream" for c in row.checks) and len({c.reason for c in row.checks}) == 1:
        return row.checks[0].reason  # a row left unjudged behind the finding says why once
    if row.checks and expanded(row, report):
        counts: dict[str, int] = {}
        for c in row.checks:
            if c.status in NOT_PASSING:
                counts[c.status] = counts.get(c.status, 0) + 1
        return ", ".join(f"{n} {STATUS_WORD[s]}" for s, n in counts.items()) + f" of {_plural(len(row.checks), 'check')}:"
    if not row.checks:
        lines = note_lines(row.note) if row.note else []
        return lines[0] if len(lines) == 1 else ""
    head = _headline(row, report)
    if head is not None:
        text = check_line(head)
        bound = _short_bound(head) if head.value is not None and head.status != "pass" else ""
        text += f" ({bound})" if bound else ""
        others = sum(1 for c in row.checks if c.status in NOT_PASSING) - 1
        return text + (f" (+{others} more)" if others > 0 else "")
    passed = [c for c in row.checks if c.status == "pass"]
    parts = []
    if passed:
        lo, hi = min(c.level for c in passed), max(c.level for c in passed)
        parts.append(f"L{lo} pass" if lo == hi else f"L{lo}-L{hi} pass")
    rest: dict[str, int] = {}
    for c in row.checks:
        if c.status != "pass":
            rest[c.status] = rest.get(c.status, 0) + 1
    return ", ".join(parts + [f"{n} {STATUS_WORD[s]}" for s, n in rest.items()])


def _expansion(row: Row, report: Report, folded: list[str], width: int) -> list[Line]:
    """Under an expanded row: every check (with its sentence where it did not pass), its folded fields,
    its note, and the pointer to the first finding."""
    out: list[Line] = []

    def add(text: str, style: str, keep: str = "") -> None:
        out.extend([(STACK_INDENT, ""), (ln, style)] for ln in wrap_words(printable(text, keep=keep), width))

    facts = [f"{k} {fmt_value(row.fields[k])}" for k in folded if row.fields.get(k) is not None]
    if facts:
        add(", ".join(facts), "dim")
    for c in row.checks:
        if c.status == "pass":
            add(check_line(c), "")
        else:
            sentence = describe(c) if c.value is not None or c.reason or c.measure else bound_text(c)
            add(f"L{c.level} {STATUS_WORD[c.status]} {c.name}" + (f": {sentence}" if sentence else ""),
                "red" if c.status == "fail" else "yellow" if c.status != "downstream" else "dim")
    if row.note and (row.checks or len(note_lines(row.note)) > 1):
        add(note_text(row.note), "dim", keep="\n")  # its line breaks draw a picture
    finding = report.first_finding
    if finding is not None and finding.row == row.name:
        where = location_text(finding.check.location)
        add(f"^^ first finding: L{finding.check.level} {finding.check.name}" + (f" at {where}" if where else ""),
            "bold red")
    return out


@dataclass(frozen=True)
class _Compact:
    cols: _Columns
    axes: int  # width of the axes column (0 without one)
    inline: dict[str, list[str]]  # row name -> the folded fields its summary carries


def _compact_columns(report: Report, width: int) -> _Compact:
    """Name, status, shape and axes side by side; field columns while the summary keeps ``COMPACT_MIN``."""
    rows = report.rows
    has_shape = any(r.shape is not None or r.axes for r in rows)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r.fields if k not in fields]
    name_w = max([len(report.row_label)] + [len(printable(r.name)) for r in rows])
    status_w = max([len("status")] + [len(STATUS_WORD[r.status]) for r in rows])
    shape_w = max([len("shape")] + [len(shape_text(r.shape)) for r in rows]) if has_shape else 0
    axes_w = max([len("axes")] + [len(printable(r.axes)) for r in rows]) if has_shape else 0
    field_w = {k: max([len(k)] + [len(_field_text(r.fields.get(k))) for r in rows]) for k in fields}
    fixed = name_w + status_w + 2 * len(GAP) + ((shape_w + axes_w + 2 * len(GAP)) if has_shape else 0)
    # the summary column needs no more room than its longest one-line summary, up to COMPACT_MIN
    need = min(COMPACT_MIN, max([10] + [len(summary(r, report)) for r in rows if not expanded(r, report)]))
    columns: list[str] = []
    for k in fields:
        if 2 * sum(1 for r in rows if k in r.fields) < len(rows):
            continue  # a fact of a few rows (a ledger's std) goes in their summaries, not a column of blanks
        if width - (fixed + field_w[k] + len(GAP)) < need:
            break
        columns.append(k)
        fixed += field_w[k] + len(GAP)
    numeric = {k: all(isinstance(r.fields.get(k), (int, float)) or r.fields.get(k) is None for r in rows) for k in columns}
    stacked = width - fixed < STACK_BELOW  # too narrow beside the row: the summary goes under it
    wrap = width - len(STACK_INDENT) if stacked else width - fixed
    cols = _Columns(name_w, status_w, shape_w, field_w, columns, [k for k in fields if k not in columns], numeric,
                    stacked, wrap)
    inline: dict[str, list[str]] = {}
    for r in rows:
        extra = [] if expanded(r, report) else [k for k in cols.folded if r.fields.get(k) is not None]
        text = _with_fields(summary(r, report), r, extra)
        inline[r.name] = extra if extra and len(text) <= wrap else []
    return _Compact(cols, axes_w, inline)


def _with_fields(text: str, row: Row, keys: list[str]) -> str:
    facts = ", ".join(f"{k} {fmt_value(row.fields[k])}" for k in keys)
    return f"{text}; {facts}" if text and facts else (text or facts)


def _row_line(r: Row, report: Report, lay: _Compact) -> list[Line]:
    cols = lay.cols
    line: Line = [(printable(r.name).ljust(cols.name) + GAP, "bold"),
                  (STATUS_WORD[r.status].ljust(cols.status) + GAP, STATUS_STYLE[r.status])]
    if cols.shape:
        line += [(shape_text(r.shape).ljust(cols.shape) + GAP, ""), (printable(r.axes).ljust(lay.axes) + GAP, "dim")]
    for k in cols.columns:
        text = _field_text(r.fields.get(k)) if k in r.fields else ""
        line.append(((text.rjust if cols.numeric[k] else text.ljust)(cols.fields[k]) + GAP, ""))
    pad = sum(len(t) for t, _ in line)
    text = printable(_with_fields(summary(r, report), r, lay.inline[r.name]))
    style = "red" if r.status == "fail" else "yellow" if r.status in ("warn", "inconclusive") else ""
    parts = wrap_words(text, cols.wrap) if text else [""]
    if cols.stacked:
        return [line] + [[(STACK_INDENT, ""), (p, style)] for p in parts if p]
    out = [line + [(parts[0], style)]]
    out += [[(" " * pad, ""), (p, style)] for p in parts[1:]]
    return out


def _left_out(report: Report, lay: _Compact, width: int) -> list[Line]:
    """One line naming the fields the compact lines leave out at this width."""
    missing = [k for k in lay.cols.folded
               if any(r.fields.get(k) is not None and k not in lay.inline[r.name] and not expanded(r, report)
                      for r in report.rows)]
    if not missing:
        return []
    text = f"not shown at {width} columns: {', '.join(missing)}; --detail shows them"
    return [[(ln, "dim")] for ln in wrap_words(printable(text), width)]


def compact_layout(report: Report, width: int = 100) -> list[Line]:
    """Every line of the compact view, as styled segments (see the module's docstring)."""
    lay = _compact_columns(report, width)
    cols = lay.cols
    out = verdict_lines(report, width)
    out += [[(ln, "bold")] for ln in wrap_words(printable(report.title), width)]
    header = _header(report.row_label, cols)
    if cols.shape:  # shape and axes in columns of their own, on the row's one line
        header[2] = ("shape".ljust(cols.shape) + GAP + "axes".ljust(lay.axes) + GAP, "bold")
    out.append(header[:-1] if cols.stacked else header)  # stacked: the checks are under each row, unheaded
    rule_at = len(out)
    for r in report.rows:
        out += _row_line(r, report, lay)
        if expanded(r, report):
            out += _expansion(r, report, [k for k in cols.folded if k not in lay.inline[r.name]],
                              width - len(STACK_INDENT))
    out += _left_out(report, lay, width)
    widest = max((len("".join(t for t, _ in ln).rstrip()) for ln in out[rule_at:]), default=0)
    out.insert(rule_at, [("-" * min(width, max(widest, len("checks"))), "dim")])
    out.append([])
    out += _tail(report, width, warnings=False)
    return out
