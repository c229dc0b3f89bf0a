"""scripts/same_reports.py: where two reports differ, and its exit status on bad arguments."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("attn_ledger_same_reports", ROOT / "scripts" / "same_reports.py")
same_reports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_reports)


def test_equal_reports_have_no_difference():
    report = {"rows": [{"name": "scores", "checks": [{"value": 1.5e-7, "status": "pass"}]}], "notes": ["a"]}
    assert same_reports.first_difference(report, {"rows": [{"name": "scores", "checks": [
        {"value": 1.5e-7, "status": "pass"}]}], "notes": ["a"]}) is None


@pytest.mark.parametrize(("after", "where"), [
    ({"rows": [{"checks": [{"value": 1.5000000000000002e-7}]}]}, "/rows[0]/checks[0]/value"),  # one ulp
    ({"rows": [{"checks": [{"value": 1.5e-7}, {"value": 0.0}]}]}, "/rows[0]/checks: 1 items | 2"),
    ({"rows": [{"checks": [{"value": 1.5e-7, "where": None}]}]}, "/rows[0]/checks[0]/where: only on one side"),
    ({"rows": [{"checks": [{"value": "1.5e-7"}]}]}, "/rows[0]/checks[0]/value"),  # a number become a string
])
def test_the_first_difference_is_named_by_its_path(after, where):
    before = {"rows": [{"checks": [{"value": 1.5e-7}]}]}
    found = same_reports.first_difference(before, after)
    assert found is not None and found.startswith(where)


def test_bad_arguments_exit_2():
    assert same_reports.main(["--baseline", "no-such-revision"]) == 2
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "same_reports.py")], capture_output=True, text=True)
    assert done.returncode == 2 and "--baseline: got nothing, expected a git revision" in done.stderr
