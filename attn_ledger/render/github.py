"""GitHub Actions annotations: one ``::error`` line per failing check, ``::warning`` per warning."""

from __future__ import annotations

from attn_ledger.render.text import describe, finding_line
from attn_ledger.report import Report


def _escape(text: str) -> str:
    # GitHub's workflow-command escaping for messages and property values
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def render_github(report: Report) -> str:
    lines = []
    for row, c in report.checks():
        if c.status == "fail":
            kind = "error"
        elif c.status in ("warn", "inconclusive"):
            kind = "warning"
        else:
            continue
        title = _prop(f"attn-ledger {report.command}: {row} L{c.level} {c.name}")
        lines.append(f"::{kind} title={title}::{_escape(describe(c) or c.name)}")
    if report.coverage is not None:
        cov = report.coverage
        text = f"the verdict rests on {cov.scope} checks" + (f"; not run: {', '.join(cov.missing)}" if cov.missing else "")
        text += f" ({cov.reason})" if cov.reason else ""
        lines.append(f"::warning title={_prop(f'attn-ledger {report.command}: coverage')}::{_escape(text)}")
    lines.append(_escape(finding_line(report.first_finding)))
    return "\n".join(lines) + "\n"
