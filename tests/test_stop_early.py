"""A hung or slow kernel ends the run quickly: ``--max-timeouts`` and ``--max-time``, as pytest's ``--maxfail``.

After N timed-out cases in a row (default 3), or once ``--max-time`` has passed, the remaining
cases are ``not_reached`` with the reason, the report says why, and the exit status is 1.
Time limits here are 1-2 s, so that a hang costs little test time.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.render.jsondoc import schema

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fixtures" / "hostile" / "kernels.py"
ONE = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"
SMALL = "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32"
CAUSAL = "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32"
CAUSAL_ONE = "b1-h1kv1-tq1tk1-dh4dv4-causal-flag-rand-f32"
runner = CliRunner()


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    yield
    assert multiprocessing.active_children() == []


def check(target: str, *cases: str, extra: tuple[str, ...] = ()):
    args = ["check", target, "--format", "json", *extra, *[a for c in cases for a in ("--case", c)]]
    return runner.invoke(app, args)


def rows_by_status(data: dict) -> dict[str, list[dict]]:
    jsonschema.validate(data, schema())  # every report here, a run cut short included, is a valid report
    out: dict[str, list[dict]] = {}
    for row in data["rows"]:
        out.setdefault(row["status"], []).append(row)
    return out


def call_check(row: dict) -> dict:
    return next(c for c in row["checks"] if c["name"] == "call")


def slow_kernel(tmp_path: Path, seconds: float) -> str:
    """A correct kernel that sleeps ``seconds`` in every call: nothing about it fails but its pace."""
    src = tmp_path / "slow.py"
    src.write_text(
        "import importlib.util, time\n"
        f"spec = importlib.util.spec_from_file_location('k', {str(KERNELS)!r})\n"
        "k = importlib.util.module_from_spec(spec); spec.loader.exec_module(k)\n"
        "def attention(q, k_, v, **kw):\n"
        f"    time.sleep({seconds})\n"
        "    return k.good(q, k_, v, **kw)\n"
    )
    return f"{src}:attention"


# --- --max-timeouts ------------------------------------------------------------------------------


def test_a_kernel_that_sleeps_forever_ends_the_default_tier_in_seconds():
    # A real process, timed as a user would: three 1 s timeouts, then the other cases are not reached.
    cmd = [sys.executable, "-m", "attn_ledger", "check", f"{KERNELS}:hangs", "--timeout", "1", "--format", "json"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "COLUMNS": "100"})
    wall = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert wall <= 30, f"the run took {wall:.1f} s"
    data = json.loads(proc.stdout)
    rows = rows_by_status(data)
    assert len(rows["fail"]) == 3 and len(rows["not_reached"]) == data["details"]["cases_total"] - 3
    for row in rows["fail"]:  # the timeouts are named
        called = call_check(row)
        assert called["status"] == "fail" and called["data"]["timeout_s"] == 1.0
        assert "timed out after 1 s" in called["reason"]
    reason = "not reached: 3 cases in a row timed out (--max-timeouts 3)"
    for row in rows["not_reached"]:
        assert {c["status"] for c in row["checks"]} == {"not_reached"}
        assert call_check(row)["reason"] == reason
        assert call_check(row)["data"] == {"stopped_by": "max_timeouts", "max_timeouts": 3}
    assert data["details"]["cases_not_reached"] == len(rows["not_reached"])
    assert data["details"]["stopped"] == {"reason": reason, "stopped_by": "max_timeouts", "max_timeouts": 3}
    assert data["first_finding"]["check"] == "call" and data["first_finding"]["status"] == "fail"
    assert f"{len(rows['not_reached'])} of {data['details']['cases_total']} cases not reached" in " ".join(data["notes"])


def test_max_timeouts_one_stops_at_the_first_hang():
    res = check(f"{KERNELS}:hangs_when_causal", ONE, CAUSAL, SMALL, extra=("--timeout", "1", "--max-timeouts", "1"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    by_id = {r["name"]: r for r in data["rows"]}
    assert by_id[ONE]["status"] == "pass"  # run before the hang
    assert call_check(by_id[CAUSAL])["data"] == {"call": "attention(q, k, v, is_causal=True)", "timeout_s": 1.0}
    assert not call_check(by_id[CAUSAL])["reason"].endswith("the remaining cases")  # nothing was restarted for them
    assert by_id[SMALL]["status"] == "not_reached"
    assert call_check(by_id[SMALL])["reason"] == "not reached: 1 case timed out (--max-timeouts 1)"


def test_a_case_that_returns_resets_the_count():
    # hang, pass, hang: never two in a row, so with --max-timeouts 2 every case runs
    res = check(f"{KERNELS}:hangs_when_causal", CAUSAL, ONE, CAUSAL_ONE, SMALL,
                extra=("--timeout", "1", "--max-timeouts", "2"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["details"]["cases_not_reached"] == 0 and data["details"]["stopped"] is None
    assert {r["name"]: r["status"] for r in data["rows"]} == {ONE: "pass", SMALL: "pass", CAUSAL: "fail", CAUSAL_ONE: "fail"}


def test_two_hangs_in_a_row_reach_max_timeouts_two():
    res = check(f"{KERNELS}:hangs_when_causal", CAUSAL, CAUSAL_ONE, ONE, extra=("--timeout", "1", "--max-timeouts", "2"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert {r["name"]: r["status"] for r in data["rows"]} == {CAUSAL: "fail", CAUSAL_ONE: "fail", ONE: "not_reached"}


def test_crashes_do_not_count_towards_max_timeouts():
    res = check(f"{KERNELS}:segfault", ONE, SMALL, CAUSAL, extra=("--timeout", "5", "--max-timeouts", "1"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["details"]["cases_not_reached"] == 0
    assert [call_check(r)["data"].get("signal") for r in data["rows"]] == ["SIGSEGV"] * 3


def test_in_process_timeouts_count_too():
    res = check(f"{KERNELS}:hangs", ONE, SMALL, CAUSAL, extra=("--in-process", "--timeout", "1", "--max-timeouts", "2"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["details"]["cases_not_reached"] == 1
    assert data["details"]["stopped"]["stopped_by"] == "max_timeouts"


# --- --max-time ----------------------------------------------------------------------------------


def test_max_time_bounds_the_whole_check_of_a_slow_correct_kernel(tmp_path):
    started = time.monotonic()
    res = check(slow_kernel(tmp_path, 0.2), extra=("--max-time", "8"))  # the whole tier would take minutes
    wall = time.monotonic() - started
    assert res.exit_code == 1, res.output  # nothing is wrong with the kernel, but the check did not finish
    assert wall < 8 + 10, f"the run took {wall:.1f} s"
    data = json.loads(res.stdout)
    rows = rows_by_status(data)
    assert set(rows) <= {"pass", "fail", "not_reached"} and len(rows["not_reached"]) > 60
    (stopped,) = rows["fail"]  # the case in flight at expiry, its call stopped
    assert call_check(stopped)["data"]["max_time_s"] == 8.0
    assert "the check ran out of time (--max-time 8 s)" in call_check(stopped)["reason"]
    reason = "not reached: the check ran out of time (--max-time 8 s)"
    assert {call_check(r)["reason"] for r in rows["not_reached"]} == {reason}
    assert data["details"]["stopped"] == {"reason": reason, "stopped_by": "max_time", "max_time_s": 8.0}
    assert any("not reached: the check ran out of time" in n for n in data["notes"])


def test_max_time_in_process_stops_between_cases_and_is_exit_1(tmp_path):
    # In-process the call in flight cannot be stopped: the run is cut at the next case, which fails as not run.
    # SMALL makes more than five calls of 0.2 s, so --max-time runs out during it (or before it): the run
    # is cut at SMALL or at ONE, and CAUSAL is never reached, however loaded the machine.
    order = (SMALL, ONE, CAUSAL)
    res = check(slow_kernel(tmp_path, 0.2), *order, extra=("--in-process", "--max-time", "1"))
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    rows = rows_by_status(data)
    status = {r["name"]: r["status"] for r in data["rows"]}
    assert [status[c] for c in order] in (["pass", "fail", "not_reached"], ["fail", "not_reached", "not_reached"])
    cut = call_check(rows["fail"][0])
    assert cut["reason"] == "not run: the check ran out of time (--max-time 1 s)"
    assert cut["data"] == {"call": None, "max_time_s": 1.0}
    assert data["first_finding"]["row"] == rows["fail"][0]["name"]
    assert data["details"]["stopped"]["stopped_by"] == "max_time"


def test_import_past_max_time_is_exit_2_naming_it(tmp_path):
    src = tmp_path / "slow_import.py"
    src.write_text("import time\ntime.sleep(60)\n")
    res = check(f"{src}:attention", ONE, extra=("--max-time", "8"))  # the worker's start (importing torch) fits
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        f"error: --max-time: got 8.0, expected a bound that leaves time for the cases: it ran out while importing {str(src)!r}"]


def test_a_check_that_finishes_within_max_time_passes():
    res = check(f"{KERNELS}:good", ONE, SMALL, extra=("--max-time", "600"))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["details"]["cases_not_reached"] == 0 and data["details"]["stopped"] is None


def test_max_time_stops_a_module_forward():
    modules = ROOT / "fixtures" / "hostile" / "modules.py"
    res = runner.invoke(app, ["check", "--module", f"{modules}:forward_hangs", "--embed-dim", "12", "--heads", "2",
                              "--max-time", "3", "--format", "json"])
    assert res.exit_code == 1, res.output
    called = json.loads(res.stdout)["rows"][0]["checks"][0]
    assert called["status"] == "fail" and called["data"]["max_time_s"] == 3.0


@pytest.mark.parametrize("option, value, expected", [
    ("--max-time", "0", "error: --max-time: got 0.0, expected a number of seconds > 0 and at most 86,400 (one day)"),
    ("--max-time", "1e10", "error: --max-time: got 10000000000.0, expected a number of seconds > 0 and at most 86,400 (one day)"),
    ("--max-timeouts", "0", "error: --max-timeouts: got 0, expected a whole number from 1 to 1048576"),
    ("--max-timeouts", "x", "error: --max-timeouts: got 'x', expected a whole number from 1 to 1048576 written in ASCII digits"),
])
def test_limits_out_of_range_are_exit_2(option, value, expected):
    res = check(f"{KERNELS}:good", ONE, extra=(option, value))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines == [expected] and "Traceback" not in res.output


def test_max_timeouts_is_for_a_kernel():
    modules = ROOT / "fixtures" / "hostile" / "modules.py"
    res = runner.invoke(app, ["check", "--module", f"{modules}:forward_hangs", "--embed-dim", "12", "--heads", "2",
                              "--max-timeouts", "2"])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("error: --max-timeouts: got '2', expected no --max-timeouts with --module")
