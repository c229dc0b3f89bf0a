"""Views of a :class:`~attn_ledger.report.Ledger`: a rich table and Markdown. JSON is ``to_json``.

Only formatting happens here; every number arrives as a number.
"""

from __future__ import annotations

import math
from typing import Any

from attn_ledger.report import Check, Ledger, StageRow

STATUS_TEXT = {"ok": "ok", "diverged": "DIVERGED", "not_reached": "not reached", "downstream": "downstream"}
STATUS_STYLE = {"ok": "green", "diverged": "bold red", "not_reached": "dim", "downstream": "yellow"}


def fmt_value(value: float | None) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.3g}"


def mark(check: Check) -> str:
    if check.ok is None:
        return "--"
    if check.ok:
        return "ok"
    return "WARN" if check.severity == "warning" else "FAIL"


def check_line(check: Check) -> str:
    value = fmt_value(check.value)
    return f"L{check.level} {mark(check):<4} {check.name}" + (f" = {value}" if value else "")


def shape_text(row: StageRow) -> str:
    return "" if row.shape is None else "(" + ", ".join(str(d) for d in row.shape) + ")"


def divergence_line(ledger: Ledger) -> str:
    d = ledger.first_divergence
    if d is None:
        return "first divergence: none"
    return f"first divergence: {d.stage} (level {d.level}: {d.check}) - {d.detail}"


def ledger_rich(ledger: Ledger) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=ledger.title, title_justify="left", show_lines=True, expand=False)
    table.add_column("stage / status", no_wrap=True)
    table.add_column("shape / axes", no_wrap=True)
    table.add_column("checks (level, result, name = value)", overflow="fold")
    for row in ledger.rows:
        lines = Text()
        for i, c in enumerate(row.checks):
            style = "red" if c.failed else ("yellow" if c.ok is False else ("dim" if c.ok is None else ""))
            lines.append(("\n" if i else "") + check_line(c), style=style)
        if row.note:
            lines.append(("\n" if row.checks else "") + row.note, style="dim")
        stage = Text(row.stage + "\n")
        stage.append(STATUS_TEXT[row.status], style=STATUS_STYLE[row.status])
        table.add_row(stage, shape_text(row) + "\n" + row.axes, lines)
    parts: list[Any] = [table]
    for note in ledger.notes:
        parts.append(Text(note, style="dim"))
    for stage, c in ledger.warnings():
        parts.append(Text(f"warning at {stage}: {c.name}: {c.detail}", style="yellow"))
    d = ledger.first_divergence
    parts.append(Text(divergence_line(ledger), style="bold red" if d else "bold green"))
    return Group(*parts)


def ledger_markdown(ledger: Ledger) -> str:
    out = [f"### {ledger.title}", "", "| stage | shape | axes | status | checks |", "| --- | --- | --- | --- | --- |"]
    for row in ledger.rows:
        cells = "<br>".join(_md_escape(check_line(c)) for c in row.checks)
        out.append(f"| {row.stage} | {shape_text(row)} | `{row.axes}` | {STATUS_TEXT[row.status]} | {cells} |")
    out.append("")
    for note in ledger.notes:
        out.append(f"- {_md_escape(note)}")
    for stage, c in ledger.warnings():
        out.append(f"- warning at {stage}: {c.name}: {_md_escape(c.detail)}")
    out += ["", f"**{_md_escape(divergence_line(ledger))}**", ""]
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")
