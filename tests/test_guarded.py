"""User code runs guarded: a hang, an exit, a crash or a print is reported, never inherited.

Through the CLI (typer's runner, and one real subprocess for the file-descriptor level), on the
hostile kernels and modules in fixtures/hostile/. Time limits here are 2 s, so that a hang
costs 2 s of test time.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.probes.kernel.cases import parse_case

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fixtures" / "hostile" / "kernels.py"
MODULES = ROOT / "fixtures" / "hostile" / "modules.py"
ONE = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"
CAUSAL = "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32"
SMALL = "b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32"
runner = CliRunner()


def check_kernel(name: str, *cases: str, extra: tuple[str, ...] = ()):
    args = ["check", f"{KERNELS}:{name}", "--format", "json", "--timeout", "2", *extra]
    return runner.invoke(app, args + [a for c in cases or (ONE,) for a in ("--case", c)])


def first_failures(res) -> list[dict | None]:
    """Per case row, its lowest-level failing check (as JSON), or None."""
    out = []
    for row in json.loads(res.stdout)["rows"]:
        failing = [c for c in row["checks"] if c["status"] == "fail"]
        out.append(min(failing, key=lambda c: c["level"]) if failing else None)
    return out


def one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    yield
    assert multiprocessing.active_children() == []


# --- kernels: each ends as that case's L1 call finding, exit 1, JSON on stdout valid ----------------


CALL = "attention(q, k, v)"
KERNEL_OUTCOMES = [
    ("hangs", "timed out after 2 s", {"timeout_s": 2.0}),
    ("sys_exit_0", "raised SystemExit(0)", {"exception": "SystemExit", "message": "0"}),
    ("os_exit_0", "exited with status 0", {"exit_status": 0}),
    ("segfault", "killed by signal SIGSEGV", {"signal": "SIGSEGV"}),
    ("sigsegv", "killed by signal SIGSEGV", {"signal": "SIGSEGV"}),
    ("returns_meta", "returned a tensor on the meta device, which holds no values to check", {"device": "meta"}),
    ("returns_sparse", "returned a tensor with layout sparse_coo, expected a dense (strided) Tensor",
     {"layout": "sparse_coo"}),
    ("returns_list", "returned list, expected a Tensor [B, Nh, Tq, Dv]", {"returned": "list"}),
]


@pytest.mark.parametrize("name, cause, facts", KERNEL_OUTCOMES, ids=[k[0] for k in KERNEL_OUTCOMES])
def test_kernel_that_never_returns_a_result_is_an_l1_call_finding(name, cause, facts):
    res = check_kernel(name)
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert (data["verdict"], data["details"]["cases_failed"]) == ("fail", 1)
    assert (data["first_finding"]["row"], data["first_finding"]["level"], data["first_finding"]["check"]) == (ONE, 1, "call")
    call, *rest = data["rows"][0]["checks"]
    assert (call["status"], call["reason"], call["data"]) == ("fail", f"{CALL} {cause}", {"call": CALL, **facts})
    assert {c["status"] for c in rest} == {"not_reached"}  # nothing after the call was judged


def test_after_a_hang_the_worker_restarts_and_the_remaining_cases_run():
    # One hang is below --max-timeouts (default 3), so the run goes on; tests/test_stop_early.py
    # has the runs that stop.
    res = check_kernel("hangs_when_causal", ONE, CAUSAL, SMALL)
    assert res.exit_code == 1, res.output
    assert json.loads(res.stdout)["details"]["cases_not_reached"] == 0
    one, causal, small = first_failures(res)
    assert one is None  # the result from before the hang is kept
    assert small is None  # SMALL ran in a fresh worker after CAUSAL's hang
    assert (causal["level"], causal["name"]) == (1, "call")
    assert causal["reason"] == ("attention(q, k, v, is_causal=True) timed out after 2 s; "
                                "the worker was restarted for the remaining cases")
    assert causal["data"] == {"call": "attention(q, k, v, is_causal=True)", "timeout_s": 2.0}


def test_timeout_names_the_probe_in_flight(tmp_path):
    # Returns at once for the first two calls (the call, and the one with inputs that require grad),
    # hangs from the third (the first probe) on.
    src = tmp_path / "second_call_hangs.py"
    src.write_text(
        f"import importlib.util, time\n"
        f"spec = importlib.util.spec_from_file_location('k', {str(KERNELS)!r})\n"
        f"k = importlib.util.module_from_spec(spec); spec.loader.exec_module(k)\n"
        f"calls = []\n"
        f"def attention(q, k_, v, **kw):\n"
        f"    calls.append(1)\n"
        f"    if len(calls) > 2:\n"
        f"        time.sleep(3600)\n"
        f"    return k.good(q, k_, v, **kw)\n"
    )
    res = runner.invoke(app, ["check", f"{src}:attention", "--case", CAUSAL, "--timeout", "2", "--format", "json"])
    first = first_failures(res)[0]
    assert res.exit_code == 1 and (first["level"], first["name"]) == (1, "call")
    assert first["data"] == {"call": "attention(q, k, v, is_causal=True) for the batch_isolation probe", "timeout_s": 2.0}


# --- output: stdout is exactly one report --------------------------------------------------------


def test_kernel_that_prints_and_is_right_passes_with_its_output_on_stderr():
    res = check_kernel("prints", ONE, SMALL)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # the whole of stdout is one JSON document
    assert (data["verdict"], data["details"]["cases_failed"]) == ("pass", 0)
    for text in ("print from the kernel", "os.write(1) from the kernel", "os.write(2) from the kernel"):
        assert text in res.stderr and text not in res.stdout


def test_printed_fake_verdict_never_reaches_stdout_fd_level():
    # A real process: only here does the worker's file descriptor 1 matter.
    cmd = [sys.executable, "-m", "attn_ledger", "check", f"{KERNELS}:prints_fake_verdict", "--case", SMALL,
           "--format", "json", "--timeout", "30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["verdict"] == "fail" and data["details"]["cases_failed"] == 1
    assert data["first_finding"]["check"] == "reference"
    assert '{"verdict": "pass"}' in proc.stderr and '"pass"}' not in proc.stdout


def test_in_process_output_goes_to_stderr_at_fd_level(capfd):
    res = check_kernel("prints", ONE, extra=("--in-process",))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verdict"] == "pass"
    assert "print from the kernel" in res.stderr and "print from the kernel" not in res.stdout
    fds = capfd.readouterr()
    assert "os.write(1) from the kernel" in fds.err and "os.write(1) from the kernel" not in fds.out


# --- --in-process: exits are still findings; the time limit is the option's ----------------------


IN_PROCESS = [k for k in KERNEL_OUTCOMES if k[0] in ("sys_exit_0", "returns_meta", "returns_sparse", "returns_list")]


@pytest.mark.parametrize("name, cause, facts", IN_PROCESS, ids=[k[0] for k in IN_PROCESS])
def test_in_process_findings_match_the_worker(name, cause, facts):
    res = check_kernel(name, extra=("--in-process",))
    assert res.exit_code == 1, res.output
    first = first_failures(res)[0]
    assert (first["level"], first["name"], first["reason"], first["data"]) == (1, "call", f"{CALL} {cause}",
                                                                              {"call": CALL, **facts})


def test_in_process_timeout_stops_python_code():
    res = runner.invoke(app, ["check", f"{KERNELS}:hangs", "--case", ONE, "--in-process", "--timeout", "1",
                              "--format", "json"])
    assert res.exit_code == 1, res.output
    assert first_failures(res)[0]["data"] == {"call": CALL, "timeout_s": 1.0}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_must_be_positive_and_finite(value):
    res = runner.invoke(app, ["check", f"{KERNELS}:good", "--case", ONE, "--timeout", value])
    assert res.exit_code == 2
    assert one_error_line(res).startswith("error: --timeout: got ")


# --- import and factory: exit 2, one line -------------------------------------------------------


IMPORTS = {
    "sys-exit-3": ("import sys\nsys.exit(3)\n", "raised SystemExit(3)"),
    "raises": ("raise RuntimeError('not importable today')\n", "raised RuntimeError: not importable today"),
    "os-exit-3": ("import os\nos._exit(3)\n", "exited with status 3"),
    "hangs": ("import time\ntime.sleep(3600)\n", "timed out after 2 s"),
}
# A hang at import takes the same path for a kernel and a module: one 2 s hang is enough.
IMPORT_CASES = [(mode, key) for mode in ("kernel", "module") for key in IMPORTS if (mode, key) != ("module", "hangs")]


@pytest.mark.parametrize("mode, key", IMPORT_CASES, ids=[f"{m}-{k}" for m, k in IMPORT_CASES])
def test_import_that_fails_is_a_setup_error(tmp_path, mode, key):
    source, expected = IMPORTS[key]
    src = tmp_path / "user.py"
    src.write_text(source)
    args = ["check", f"{src}:attention"] if mode == "kernel" else [
        "check", "--module", f"{src}:make", "--embed-dim", "12", "--heads", "2"]
    out = tmp_path / "report.json"
    res = runner.invoke(app, args + ["--timeout", "2", "--format", "json", "--output", str(out)])
    assert res.exit_code == 2, res.output
    field = "target" if mode == "kernel" else "--module"
    assert one_error_line(res) == f"error: {field}: importing {str(src)!r} {expected}"
    assert res.stdout == "" and not out.exists()


@pytest.mark.parametrize("factory, expected", [
    ("factory_sys_exit_3", "factory(12, 2) raised SystemExit(3)"),
    ("factory_raises", "factory(12, 2) raised RuntimeError: cannot build this module"),
    ("factory_os_exit_3", "factory(12, 2) exited with status 3"),
])
@pytest.mark.parametrize("command", ["check", "intervene"])
def test_factory_that_fails_is_a_setup_error(factory, expected, command):
    res = runner.invoke(app, [command, "--module", f"{MODULES}:{factory}", "--embed-dim", "12", "--heads", "2",
                              "--timeout", "2", "--format", "json"])
    assert res.exit_code == 2, res.output
    assert one_error_line(res) == f"error: --module: {expected}"


def test_factory_exit_in_process_is_a_setup_error_too():
    res = runner.invoke(app, ["check", "--module", f"{MODULES}:factory_sys_exit_3", "--embed-dim", "12", "--heads", "2",
                              "--in-process"])
    assert res.exit_code == 2 and one_error_line(res) == "error: --module: factory(12, 2) raised SystemExit(3)"


# --- modules: a forward that hangs or exits ------------------------------------------------------


MODULE_OUTCOMES = [
    ("forward_hangs", "forward(x) on input (2, 6, 12)", "timed out after 2 s", {"timeout_s": 2.0}),
    ("forward_sys_exit", "forward(x) on input (2, 6, 12)", "raised SystemExit(0)", {"exception": "SystemExit", "message": "0"}),
    ("forward_os_exit", "forward(x) on input (2, 6, 12)", "exited with status 0", {"exit_status": 0}),
    ("hangs_in_training", "forward(x) in training mode on input (2, 6, 12)", "timed out after 2 s", {"timeout_s": 2.0}),
]


@pytest.mark.parametrize("factory, call, cause, facts", MODULE_OUTCOMES, ids=[m[0] for m in MODULE_OUTCOMES])
def test_check_module_forward_that_never_returns_is_an_l1_call_finding(factory, call, cause, facts):
    res = runner.invoke(app, ["check", "--module", f"{MODULES}:{factory}", "--embed-dim", "12", "--heads", "2",
                              "--timeout", "2", "--format", "json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    first = data["first_finding"]
    assert (first["row"], first["level"], first["check"]) == ("call", 1, "call")
    (called,) = data["rows"][0]["checks"]
    assert (called["reason"], called["data"]) == (f"{call} {cause}", {"call": call, **facts})
    assert {c["status"] for r in data["rows"][1:] for c in r["checks"]} == {"not_reached"}
    assert data["coverage"]["scope"] == "stopped"


def test_check_module_meta_output_is_an_l1_finding():
    res = runner.invoke(app, ["check", "--module", f"{MODULES}:forward_returns_meta", "--embed-dim", "12", "--heads", "2",
                              "--format", "json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    first = data["first_finding"]
    assert (first["level"], first["check"]) == (1, "output_layout")
    layout = data["rows"][0]["checks"][0]
    assert layout["data"] == {"device": "meta", "input": [2, 6, 12]}
    assert layout["reason"] == "forward returned a tensor on the meta device, which holds no values to compare"


NO_GRAD_CALL = "forward(x) under no_grad on input (2, 5, 12)"


@pytest.mark.parametrize("factory, cause, facts", [m[0:1] + m[2:] for m in MODULE_OUTCOMES[:3]],
                         ids=[m[0] for m in MODULE_OUTCOMES[:3]])
def test_intervene_module_forward_that_never_returns_is_an_l1_call_finding(factory, cause, facts):
    res = runner.invoke(app, ["intervene", "--module", f"{MODULES}:{factory}", "--embed-dim", "12", "--heads", "2",
                              "--timeout", "2", "--format", "json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert (data["first_finding"]["row"], data["first_finding"]["level"], data["first_finding"]["check"]) == ("call", 1, "call")
    (row,) = data["rows"]  # no path, cut or control was judged
    (called,) = row["checks"]
    assert (called["reason"], called["data"]) == (f"{NO_GRAD_CALL} {cause}", {"call": NO_GRAD_CALL, **facts})


def test_intervene_in_process_exit_is_the_same_finding():
    res = runner.invoke(app, ["intervene", "--module", f"{MODULES}:forward_sys_exit", "--embed-dim", "12", "--heads", "2",
                              "--in-process", "--format", "json"])
    assert res.exit_code == 1, res.output
    called = json.loads(res.stdout)["rows"][0]["checks"][0]
    assert called["data"] == {"call": NO_GRAD_CALL, "exception": "SystemExit", "message": "0"}


def test_intervene_timeout_needs_a_module():
    res = runner.invoke(app, ["intervene", "--timeout", "2"])
    assert res.exit_code == 2 and one_error_line(res).startswith("error: --timeout/--max-time/--in-process: apply only with --module")


# --- the pieces: the guard, the relay of errors, results as plain data ----------------------------


class _UserBaseException(BaseException):
    pass


@pytest.mark.parametrize("raised, expected", [
    (SystemExit(0), "raised SystemExit(0)"),
    (SystemExit(), "raised SystemExit()"),
    (_UserBaseException("odd"), "raised _UserBaseException('odd')"),
])
def test_guard_turns_any_base_exception_into_a_user_code_error(raised, expected):
    from attn_ledger.guard import UserCodeError, outcome, user_call

    with pytest.raises(UserCodeError) as info:
        with user_call("f(x)"):
            raise raised
    assert (info.value.what, outcome(info.value)) == ("f(x)", expected)
    assert info.value.facts()["exception"] == type(raised).__name__


def test_guard_lets_ordinary_exceptions_and_ctrl_c_through_in_process():
    from attn_ledger.guard import outcome, user_call

    with pytest.raises(ValueError) as info:
        with user_call("f(x)"):
            raise ValueError("bad\nsecond line")
    assert outcome(info.value) == "raised ValueError: bad"
    with pytest.raises(KeyboardInterrupt):
        with user_call("f(x)"):
            raise KeyboardInterrupt


def test_in_process_time_limit_gives_back_an_outer_alarm():
    import signal

    from attn_ledger.guard import in_process, user_call

    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        with in_process(timeout=5), user_call("f(x)"):
            inside = signal.getitimer(signal.ITIMER_REAL)[0]
        after = signal.getitimer(signal.ITIMER_REAL)[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert 0 < inside <= 5 and 90 < after <= 100


# What `check` hands the task for a kernel: the cases, parsed from their ids, and the options.
KERNEL_ARGS = {"target": f"{KERNELS}:good", "field": "target", "cases": [parse_case(ONE)], "tier": None,
               "empty_rows": "zeros", "seed": 0, "backward": True, "strict_precision": False, "device": "cpu", "declaration": {}}


def test_worker_relays_bad_input_as_the_same_error():
    from attn_ledger.errors import InputError
    from attn_ledger.runner.worker import run_user_task

    args = {**KERNEL_ARGS, "empty_rows": "ones"}
    with pytest.raises(InputError, match="^empty_rows: got 'ones'"):
        run_user_task("kernel_check", args, timeout=30)


def test_a_bug_in_the_worker_is_not_a_finding(tmp_path):
    from attn_ledger.runner.worker import WorkerError, _Supervisor

    with _Supervisor(tmp_path, 30) as sup:
        sup.start_load(f"{KERNELS}:good", "target")
        sup.load(f"{KERNELS}:good", "target", started=True)
        with pytest.raises(WorkerError, match="KeyError: 'threads'"):
            sup.call_kernel("forward", {}, b"")  # a request the driver cannot read: the tool's own bug


def test_a_bug_in_the_tool_while_judging_is_its_own_error_never_a_finding():
    from attn_ledger.runner.worker import run_user_task

    args = {key: value for key, value in KERNEL_ARGS.items() if key != "seed"}
    with pytest.raises(KeyError, match="seed"):  # the parent judges: its bug is raised here (exit 3 in the CLI)
        run_user_task("kernel_check", args, timeout=30)


def test_results_cross_as_plain_data_and_only_into_result_types():
    import math

    from attn_ledger.probes.kernel.check import CaseResult, kernel_report, parse_case
    from attn_ledger.render.jsondoc import report_json
    from attn_ledger.report import Check, bounded
    from attn_ledger.runner.worker import WorkerError, decode, encode

    checks = (bounded(3, "finite", "non-finite values", math.nan, 0, location={"example": 0, "head": 1, "query": 2}),
              Check(4, "reference", "pass", "max |diff|", math.inf, 1e-6, "<=", data={"tolerance": {"factor": 4.0}}))
    result = CaseResult(parse_case(ONE), checks, 1e-6)
    back = decode(json.loads(json.dumps(encode(result))))
    assert back.case == result.case and back.tolerance == 1e-6 and isinstance(back.checks, tuple)
    assert math.isnan(back.checks[0].value) and back.checks[0].location == {"example": 0, "head": 1, "query": 2}
    assert back.checks[1] == result.checks[1]
    report = kernel_report([result], target="k.py:attention")
    again = decode(json.loads(json.dumps(encode(report))))
    assert report_json(again) == report_json(report) and report_json(report)["first_finding"]["check"] == "finite"
    with pytest.raises(WorkerError, match="'Ledger', which is not a result type"):
        decode({"__dataclass__": "Ledger", "fields": {}})
    with pytest.raises(TypeError):
        encode(object())


@pytest.mark.parametrize("decode, cause, facts", [
    ("decode_sys_exit", "raised SystemExit(0)", {"exception": "SystemExit", "message": "0"}),
    ("decode_hangs", "timed out after 2 s", {"timeout_s": 2.0}),
], ids=["sys-exit", "hangs"])
def test_check_module_decode_that_never_returns_is_an_l1_call_finding(decode, cause, facts):
    res = runner.invoke(app, ["check", "--module", f"{MODULES}:position_wise", "--decode", f"{MODULES}:{decode}",
                              "--embed-dim", "12", "--heads", "2", "--timeout", "2", "--format", "json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    call = "decode(module, x_new (2, 1, 12), cache)"  # the second call of the first scenario, one token each
    (called,) = data["rows"][0]["checks"]
    assert (data["first_finding"]["check"], called["reason"], called["data"]) == ("call", f"{call} {cause}",
                                                                                 {"call": call, **facts})


# --- global state the user's import leaves: the tool's own grad work runs under enable_grad ------------------


GRAD_OFF = "import torch\ntorch.set_grad_enabled(False)\n"


def _importing(tmp_path: Path, path: Path, names: tuple[str, ...], grad_off: bool) -> Path:
    src = tmp_path / f"{'off' if grad_off else 'on'}_{path.stem}.py"
    src.write_text((GRAD_OFF if grad_off else "") +
                   f"import importlib.util\nspec = importlib.util.spec_from_file_location('u', {str(path)!r})\n"
                   "u = importlib.util.module_from_spec(spec); spec.loader.exec_module(u)\n" +
                   "".join(f"{n} = u.{n}\n" for n in names))
    return src


@pytest.mark.parametrize("extra", [(), ("--in-process",)], ids=["worker", "in-process"])
def test_a_kernel_file_that_disables_grad_at_import_is_checked_normally(tmp_path, extra):
    reports = []
    for grad_off in (True, False):
        src = _importing(tmp_path, KERNELS, ("good",), grad_off)
        res = runner.invoke(app, ["check", f"{src}:good", "--case", ONE, "--case", SMALL, "--case", CAUSAL,
                                  "--format", "json", *extra])
        assert res.exit_code == 0, res.output
        reports.append(json.loads(res.stdout))
    off, on = reports
    assert off["rows"] == on["rows"]  # every check, the backward ones included, as without the import's switch
    grads = [c for r in off["rows"] for c in r["checks"] if c["name"] in ("grad_call", "grad_q", "grad_k", "grad_v")]
    assert len(grads) == 12 and {c["status"] for c in grads} == {"pass"}


def test_a_module_file_that_disables_grad_at_import_is_checked_normally(tmp_path):
    modules = ROOT / "fixtures" / "modules" / "attention_modules.py"
    reports = []
    for grad_off in (True, False):
        src = _importing(tmp_path, modules, ("sdpa_causal",), grad_off)
        res = runner.invoke(app, ["check", "--module", f"{src}:sdpa_causal", "--embed-dim", "12", "--heads", "2",
                                  "--format", "json"])
        assert res.exit_code == 0, res.output
        reports.append(json.loads(res.stdout))
    off, on = reports
    assert off["rows"] == on["rows"]
    gradcheck = next(c for r in off["rows"] for c in r["checks"] if c["name"] == "gradcheck")
    assert gradcheck["status"] == "pass"


def test_warm_autograd_runs_with_grad_mode_off():
    import torch

    from attn_ledger.probes.common.driver import warm_autograd

    with torch.no_grad():
        warm_autograd()  # raised RuntimeError (no grad_fn) before
