"""The Markdown view: the same rows and checks as the table, for pull requests and notebooks."""

from __future__ import annotations

from attn_ledger.render.hints import hint_lines
from attn_ledger.render.notes import note_text, notes_text
from attn_ledger.render.text import STATUS_WORD, check_line, describe, finding_line, fmt_value, printable, shape_text
from attn_ledger.render.text import STATUS_WORD, check_line, describe, finding_line, fmt_value, shape_text
from attn_ledger.report import Report


def _esc(text: str, keep: str = "") -> str:
    """Text for a cell or a line: control and bidirectional characters escaped as the JSON writes them
    (:func:`~attn_ledger.render.text.printable`), pipes escaped; ``keep="\\n"``: line breaks kept, as ``<br>``."""
    return printable(text, keep=keep).replace("|", "\\|").replace("\n", "<br>")


def render_markdown(report: Report) -> str:
    fields: list[str] = []
    for r in report.rows:
        fields += [k for k in r.fields if k not in fields]
    has_shape = any(r.shape is not None or r.axes for r in report.rows)
    head = [report.row_label, "status"] + (["shape", "axes"] if has_shape else []) + fields + ["checks"]
    out = [f"### {_esc(report.title)}", "", "| " + " | ".join(_esc(h) for h in head) + " |", "|" + " --- |" * len(head)]
    for r in report.rows:
        shown = [c for c in r.checks if report.show_passing or not c.passed]
        lines = []
        for c in shown:
            text = check_line(c)
            if not report.show_passing and c.judged:
                text += f": {describe(c)}"
            lines.append(_esc(text))
        if r.note:
            lines.append(_esc(note_text(r.note), keep="\n"))  # its line breaks draw a picture
        cells = [f"`{_esc(r.name)}`" if report.row_label == "case" else _esc(r.name), STATUS_WORD[r.status]]
        if has_shape:
            cells += [shape_text(r.shape), f"`{_esc(r.axes)}`" if r.axes else ""]
        cells += [_esc(fmt_value(r.fields.get(k))) for k in fields]
        cells.append("<br>".join(lines))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for note in notes_text(report):
        out.append(f"- {_esc(note)}")
    if report.coverage is not None:
        cov = report.coverage
        out.append(f"- coverage: {cov.scope}" + (f"; not run: {_esc(', '.join(cov.missing))}" if cov.missing else "")
                   + (f" ({_esc(cov.reason)})" if cov.reason else ""))
    if report.show_passing:
        for row, c in report.warnings():
            out.append(f"- warning at {_esc(row)}: {c.name}: {_esc(describe(c))}")
    out += ["", f"**{_esc(finding_line(report.first_finding))}**", ""]
    out += [f"- {_esc(hint)}" for hint in hint_lines(report)] + ([""] if report.hints else [])
    if report.ledger is not None:  # the report it opens onto (scan's stage ledger of its first wrong call), after it
        heading = f"Stage ledger of {report.first_finding.row}" if report.first_finding is not None else "Stage ledger"
        out += [f"## {_esc(heading)}", "", render_markdown(report.ledger)]
    return "\n".join(out)
