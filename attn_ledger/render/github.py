"""GitHub Actions annotations: one ``::error`` line per failing check, ``::warning`` per warning.

A report whose rows are calls (``scan``) gets one ``::error`` per failing call, naming the call's first failing
check and how many more failed there.

A report over many rows (``fold_rows``) gets one annotation per distinct check and status, on its
first row (the smallest case, for ``check``), with the count of the other rows where it recurs.
:func:`step_summary` is the short Markdown a job summary (``GITHUB_STEP_SUMMARY``) gets: the verdict,
the first finding and a table of the failing rows, escaped as the Markdown view escapes.
"""

from __future__ import annotations

from typing import Any

from attn_ledger.render.hints import hint_lines
from attn_ledger.render.text import STATUS_WORD, bound_text, describe, finding_line, fmt_value, printable
from attn_ledger.report import Report


def _escape(text: str) -> str:
    # Control and bidirectional characters escaped as the JSON writes them (a name from a user stays one
    # line that reads as it is stored), then GitHub's workflow-command escaping for messages and properties
    return printable(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def render_github(report: Report) -> str:
    lines = []
    seen: dict[tuple[str, int, str], int] = {}  # fold_rows: one annotation per distinct check, with a count
    shown: list[tuple[str, str, Any]] = []
    firsts = {r.name: r.first_failing() for r in report.rows} if report.row_label == "call" else {}
    for row, c in report.checks():
        if firsts and c.status == "fail" and c is not firsts[row]:
            continue  # one annotation per failing call: its first failing check
        if c.status == "fail":
            kind = "error"
        elif c.status in ("warn", "inconclusive"):
            kind = "warning"
        else:
            continue
        key = (c.status, c.level, c.name)
        if report.fold_rows and key in seen:
            shown[seen[key]][2][1] += 1
            continue
        seen[key] = len(shown)
        shown.append((kind, row, [c, 0]))
    marks = {r.name: r.fields.get("mark") for r in report.rows if r.fields.get("mark")}
    for kind, row, (c, more) in shown:
        mark = f" ({marks[row]})" if row in marks else ""  # compare's first adder
        title = _prop(f"attn-ledger {report.command}: {row} L{c.level} {c.name}{mark}")
        also = f" (and in {more} more {report.row_label}s)" if more else ""
        if firsts and kind == "error":
            others = sum(1 for r in report.rows if r.name == row for x in r.checks if x.failed) - 1
            also += f" (+{others} more failing check{'s' if others != 1 else ''} in this call)" if others else ""
        lines.append(f"::{kind} title={title}::{_escape((describe(c) or c.name) + also)}")
    if report.coverage is not None:
        cov = report.coverage
        text = f"the verdict rests on {cov.scope} checks" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
        text += f" ({cov.reason})" if cov.reason else ""
        lines.append(f"::warning title={_prop(f'attn-ledger {report.command}: coverage')}::{_escape(text)}")
    lines.append(_escape(finding_line(report.first_finding)))
    lines += [_escape(hint) for hint in hint_lines(report)]
    return "\n".join(lines) + "\n"


SUMMARY_ROWS = 20  # a job summary lists at most this many failing rows, and counts the rest


def step_summary(report: Report) -> str:
    """Markdown for a GitHub job summary: the verdict, the first finding, the failing rows in a table."""
    from attn_ledger.render.table import verdict_text
    from attn_ledger.render.markdown import _esc

    out = [f"### attn-ledger {_esc(report.command)}: {_esc(verdict_text(report))}", "", _esc(report.title), "",
           f"**{_esc(finding_line(report.first_finding))}**", ""]
    failing = [r for r in report.rows if r.status == "fail"]
    if failing:
        out += [f"| {_esc(report.row_label)} | status | first failing check | value | bound |", "| --- | --- | --- | --- | --- |"]
        for r in failing[:SUMMARY_ROWS]:
            c = r.first_failing()
            name = f"L{c.level} {c.name}" if c is not None else ""
            value = fmt_value(c.value) if c is not None else ""
            bound = bound_text(c) if c is not None else ""
            out.append(f"| {_esc(r.name)} | {STATUS_WORD[r.status]} | {_esc(name)} | {_esc(value)} | {_esc(bound)} |")
        if len(failing) > SUMMARY_ROWS:
            out += ["", f"and {len(failing) - SUMMARY_ROWS} more failing {_esc(report.row_label)}s (the JSON lists every one)"]
        out.append("")
    return "\n".join(out) + "\n"
