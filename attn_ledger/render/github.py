"""GitHub Actions annotations: one ``::error`` line per failing check, ``::warning`` per warning.

A report over many rows (``fold_rows``) gets one annotation per distinct check and status, on its
first row (the smallest case, for ``check``), with the count of the other rows where it recurs.
"""

from __future__ import annotations

from typing import Any

from attn_ledger.render.hints import hint_lines
from attn_ledger.render.text import describe, finding_line, printable
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
    for row, c in report.checks():
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
    for kind, row, (c, more) in shown:
        title = _prop(f"attn-ledger {report.command}: {row} L{c.level} {c.name}")
        also = f" (and in {more} more {report.row_label}s)" if more else ""
        lines.append(f"::{kind} title={title}::{_escape((describe(c) or c.name) + also)}")
    if report.coverage is not None:
        cov = report.coverage
        text = f"the verdict rests on {cov.scope} checks" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
        text += f" ({cov.reason})" if cov.reason else ""
        lines.append(f"::warning title={_prop(f'attn-ledger {report.command}: coverage')}::{_escape(text)}")
    lines.append(_escape(finding_line(report.first_finding)))
    lines += [_escape(hint) for hint in hint_lines(report)]
    return "\n".join(lines) + "\n"
