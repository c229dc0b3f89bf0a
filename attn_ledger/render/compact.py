"""The compact table view, the default: a verdict first, one line per row, the row that failed expanded.

A ledger (``show_passing``) prints each row on one line: its name, status, shape and axes, the field
columns that fit, and a summary of its checks (``L1-L4 pass``, or the failing check with its value and
limit). The row of the first finding, and any row with a warning, is expanded under its line: every
check with its sentence, the row's folded fields and note (the relation picture), and a ``^^`` pointer
to where the finding was measured. ``render_table(report, detail=True)`` (``--detail``) prints every
check of every row instead (:func:`attn_ledger.render.table.layout`).

Reports over many cases (``show_passing`` false: ``check`` on a kernel, ``faults``, ``intervene``) are
already one line per row or per distinct finding; the compact view only puts the verdict line first.
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_ledger.render.notes import note_lines, note_text
from attn_ledger.render.table import (
    GAP,
    Line,
    STACK_INDENT,
    _field_text,
    _header,
    _tail,
    _Columns,
    wrap_words,
)
from attn_ledger.render.text import (
    STATUS_STYLE,
    STATUS_WORD,
    bound_text,
    check_line,
    describe,
    fmt_value,
    location_text,
    printable,
    shape_text,
)
from attn_ledger.report import Check, Report, Row

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
    unjudged = sum(1 for c in checks if c.status != "pass")
    text = f"PASS: {_plural(len(report.rows), report.row_label)}, {_plural(len(checks), 'check')}"
    text += f" ({unjudged} not passing: warnings or not judged)" if unjudged else ""
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
    lo, hi = min(c.level for c in passed), max(c.level for c in passed)
    text = f"L{lo} pass" if lo == hi else f"L{lo}-L{hi} pass"
    rest: dict[str, int] = {}
    for c in row.checks:
        if c.status != "pass":
            rest[c.status] = rest.get(c.status, 0) + 1
    return text + "".join(f", {n} {STATUS_WORD[s]}" for s, n in rest.items())


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


def _columns(report: Report, width: int) -> _Compact:
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
    lay = _columns(report, width)
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
