"""Views of a :class:`~attn_ledger.report.Report`. Renderers read reports; reports never import them.

:func:`render` turns a report into text in one of :data:`FORMATS`.
"""

from __future__ import annotations

from attn_ledger.report import Report

FORMATS = ("table", "json", "markdown", "junit", "github")


def render(report: Report, fmt: str = "table", width: int = 100, detail: bool = False) -> str:
    """The report as text: ``table`` (plain, laid out for ``width`` columns), ``json``,
    ``markdown``, ``junit`` (JUnit XML) or ``github`` (workflow annotations).

    The table is compact unless ``detail``: the verdict first, one line per row, the row of the first
    finding (and any row with a warning) expanded with every check. ``detail=True`` lists every check
    of every row with its value. The other formats carry everything either way."""
    if fmt == "table":
        from attn_ledger.render.table import render_table

        return render_table(report, width, detail)
    if fmt == "json":
        from attn_ledger.render.jsondoc import dumps, report_json

        return dumps(report_json(report))
    if fmt == "markdown":
        from attn_ledger.render.markdown import render_markdown

        return render_markdown(report)
    if fmt == "junit":
        from attn_ledger.render.junit import render_junit

        return render_junit(report)
    if fmt == "github":
        from attn_ledger.render.github import render_github

        return render_github(report)
    raise ValueError(f"format: got {fmt!r}, expected one of {', '.join(FORMATS)}")
