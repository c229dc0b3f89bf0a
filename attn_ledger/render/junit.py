"""The JUnit XML view, for CI systems that show test results.

One test case per check for reports whose unit is a check (the ledger: one per stage
check; a stage without checks, such as ``input``, adds none), one per row otherwise (a case of ``check``, a fault, an experiment row). A failing
test case's message names the check, its value and its limit. Checks that were not judged
(skipped, not applicable, not reached, downstream) are reported as skipped; warnings and
inconclusive checks pass, with the sentence in ``system-out``. A row whose own status is
``inconclusive`` (a ``check`` case that nothing past L1 judged) is skipped, never passed.
"""

from __future__ import annotations

from xml.etree import ElementTree as ET

from attn_ledger.render.notes import note_text
from attn_ledger.render.text import STATUS_WORD, bound_text, describe, fmt_value
from attn_ledger.render.text import STATUS_WORD, bound_text, describe, fmt_value, printable
from attn_ledger.report import UNJUDGED, Check, Report, Row


def _printable(tree: ET.Element) -> None:
    """Every attribute and text escaped as the JSON writes control and bidirectional characters
    (:func:`~attn_ledger.render.text.printable`); XML 1.0 cannot carry most control characters at all.
    Text keeps the line breaks that join its lines."""
    for el in tree.iter():
        for key, value in el.attrib.items():
            el.set(key, printable(value))
        if el.text:
            el.text = printable(el.text, keep="\n")


def _failure_message(row: str, c: Check) -> str:
    value = fmt_value(c.value)
    bound = bound_text(c)
    text = f"{row}: L{c.level} {c.name}"
    if value:
        text += f" = {value}"
    if bound:
        text += f" ({bound})"
    return text


def _case(suite: ET.Element, classname: str, name: str, checks: list[Check], row: Row,
          whole_row: bool = False) -> tuple[int, int]:
    case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
    failing = [c for c in checks if c.failed]
    if failing:
        first = min(failing, key=lambda c: c.level)
        el = ET.SubElement(case, "failure", message=_failure_message(row.name, first), type=f"L{first.level}")
        el.text = "\n".join(f"L{c.level} {c.name}: {describe(c)}" for c in failing)
        return 1, 0
    if checks and all(c.status in UNJUDGED for c in checks):
        ET.SubElement(case, "skipped", message=f"{STATUS_WORD[checks[0].status]}: {checks[0].reason}")
        return 0, 1
    if whole_row and row.status == "downstream":  # behind the first finding: its failures are evidence, not causes
        why = next((c.reason for c in checks if c.status == "downstream" and c.reason), "")
        ET.SubElement(case, "skipped", message="downstream" + (f": {why}" if why else " of the first finding"))
        return 0, 1
    if whole_row and row.status == "inconclusive":
        why = [c for c in checks if c.status == "inconclusive"]
        ET.SubElement(case, "skipped", message=f"inconclusive: {describe(why[-1]) if why else note_text(row.note)}")
        return 0, 1
    notes = [f"L{c.level} {c.name} {STATUS_WORD[c.status]}: {describe(c)}" for c in checks
             if c.status in ("warn", "inconclusive")]
    if notes:
        ET.SubElement(case, "system-out").text = "\n".join(notes)
    return 0, 0


def render_junit(report: Report) -> str:
    suites = ET.Element("testsuites", name="attn-ledger")
    suite = ET.SubElement(suites, "testsuite", name=f"attn-ledger {report.command}")
    tests = failures = skipped = 0
    for row in report.rows:
        if report.unit == "check":
            for c in row.checks:
                f, s = _case(suite, f"{report.command}.{row.name}", c.name, [c], row)
                tests, failures, skipped = tests + 1, failures + f, skipped + s
        else:
            f, s = _case(suite, report.command, row.name, list(row.checks), row, whole_row=True)
            tests, failures, skipped = tests + 1, failures + f, skipped + s
    for el in (suites, suite):
        el.set("tests", str(tests))
        el.set("failures", str(failures))
        el.set("errors", "0")
        el.set("skipped", str(skipped))
    _printable(suites)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
