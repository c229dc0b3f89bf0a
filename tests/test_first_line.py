"""errors.first_line: the one way an exception's message is quoted in a finding or an error."""

import pytest

from attn_ledger.errors import FIRST_LINE_CHARS, first_line


@pytest.mark.parametrize(("exc", "empty", "expected"), [
    (ValueError("  bad shape\nTraceback detail"), "(no message)", "bad shape"),
    (ValueError(""), "(no message)", "(no message)"),
    (ValueError("   \n  "), "", ""),
    (KeyError("q"), "(no message)", "'q'"),
    (RuntimeError(), "RuntimeError", "RuntimeError"),
    (RuntimeError("backend='inductor' raised:\nLoweringException: not supported\n  target: x"), "",
     "backend='inductor' raised: LoweringException: not supported"),
    (RuntimeError("expected one of:"), "", "expected one of:"),
], ids=["first-line", "empty", "blank", "key-error-repr", "fallback-name", "introduction-joined", "colon-alone"])
def test_first_line_takes_the_first_line_or_the_fallback(exc, empty, expected):
    assert first_line(exc, empty) == expected


def test_first_line_cuts_long_lines_unless_told_not_to():
    exc = ValueError("x" * (FIRST_LINE_CHARS + 50) + "\nsecond")
    assert first_line(exc) == "x" * FIRST_LINE_CHARS
    assert first_line(exc, limit=None) == "x" * (FIRST_LINE_CHARS + 50)
