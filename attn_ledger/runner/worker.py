"""Run the code a user named in a worker process, so that its hang, exit or crash is reported, never inherited.

Design, and why:

* **One worker per command, started from a fork server.** The worker is forked from
  multiprocessing's fork server, which imports torch once and runs no torch operation (so no
  thread pool exists to be lost across the fork). The first worker of a process costs one
  torch import (about 2 s), as a spawned interpreter would; a worker restarted after a crash,
  and every worker after the first in one process (a test suite), costs a fork. Plain ``fork``
  of the tool's own process is not used: its torch threads may hold locks.
* **For a kernel, the parent judges; the worker only calls.** ``check FILE:NAME`` is a
  :class:`~attn_ledger.runner.tasks.ParentTask`: this process plans the cases, makes the inputs,
  computes every reference and judges, and never imports the user's file. The worker imports it
  and runs the fixed driver (:mod:`attn_ledger.probes.common.driver`); each call of the user's function is one
  round trip (:class:`RemoteKernel`): inputs out, raw tensors and call facts back, as safetensors
  bytes. The module commands are still run whole in the worker (the same check code as
  ``--in-process``, :mod:`attn_ledger.runner.tasks`).
* **The parent keeps the clock.** Every call into user code goes through
  :func:`attn_ledger.guard.user_call`, which in the worker tells the parent "call starting: WHAT"
  and "call done". The parent alone enforces the per-call time limit, so a hang inside C code is
  caught too, and when the worker dies (exit status, signal) the parent knows which call was in
  flight and in which unit of work (a case), records that unit's L1 ``call`` finding, starts a
  fresh worker and goes on with the rest. A death while importing or building the user's object
  is bad setup: exit 2, one line.
* **A hung kernel ends the run quickly** (:class:`Limits`), as pytest's ``--maxfail`` does:
  after ``max_timeouts`` timed-out units in a row, or once ``max_time`` seconds have passed,
  the remaining units are not reached (the task's ``not_reached`` result, with the reason).
* **Nothing from the worker is unpickled.** The worker answers in JSON (and tensors as
  safetensors bytes); results are rebuilt only into the dataclasses in
  :data:`attn_ledger.runner.tasks.RESULT_TYPES`. Requests travel the
  other way pickled, which is safe: the worker trusts its parent.
* **Output captured at the file-descriptor level.** The worker's fds 1 and 2 point at a file
  the parent owns, so ``print``, ``os.write(1, ...)`` and a C library's output all land there
  (a crash's traceback from :mod:`faulthandler` too) and the tool's stdout carries exactly one
  report. The command shows what was captured on stderr (:func:`show_output`).

A worker starts in the parent's current directory with its ``sys.path``, and with the
environment the fork server started with (the first worker's): one command per process, as
the CLI runs, sees no difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from attn_ledger import errors
from attn_ledger.runner import reaper
from attn_ledger.errors import AttnLedgerError, SetupError, field_error
from attn_ledger.probes.common.driver import KernelTarget  # torch-free at import: the driver imports torch inside its functions
from attn_ledger.guard import CallStopped

TIMEOUT_S = 60.0
"""Default limit, in seconds, on each call into user code run in a worker."""

MAX_TIMEOUT_S = 86_400.0
"""The longest ``--timeout`` (and ``--max-time``) taken: one day."""

MAX_TIMEOUTS = 3
"""Default number of timed-out units in a row after which the remaining units are not reached."""

_PRELOAD = ["torch", "safetensors.torch", "attn_ledger.probes.common.driver", "attn_ledger.runner.tasks", "attn_ledger.maths.reference", "attn_ledger.maths.pipeline", "attn_ledger.maths.layer"]
_OUTPUT_TAIL_BYTES = 64 << 10  # of each worker's captured output, the part shown


class WorkerError(RuntimeError):
    """The tool's own code failed inside the worker, or the worker broke the protocol (a bug in attn-ledger)."""


@dataclass(frozen=True)
class Outcome:
    """A task's report and what the user's code wrote on stdout and stderr (captured; empty in-process)."""

    report: Any
    output: str = ""


def check_timeout(timeout: float | None, field: str = "--timeout") -> None:
    """Raises InputError naming ``field`` unless ``timeout`` is None or a number of seconds in (0, 86400]."""
    ok = (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
          and 0 < timeout <= MAX_TIMEOUT_S)
    if timeout is not None and not ok:
        raise field_error(field, timeout, f"a number of seconds > 0 and at most {MAX_TIMEOUT_S:,.0f} (one day)")


@dataclass
class Limits:
    """When a run of units stops early: the rest are then not reached.

    Attributes:
        max_timeouts: timed-out units in a row after which the run stops (None: never). A unit
            that comes back with a result resets the count; a crash or an exit neither counts
            (each costs about half a second) nor resets it.
        max_time: seconds the whole run may take (None: no bound). In a worker, a unit still
            running at expiry is stopped; in-process, expiry is seen between units only.
    """

    max_timeouts: int | None = MAX_TIMEOUTS
    max_time: float | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    timeouts: int = 0
    cut: bool = False  # a unit was stopped (or not started) when max_time ran out: the rest are not reached

    def __post_init__(self) -> None:
        if self.max_timeouts is not None and (isinstance(self.max_timeouts, bool) or not isinstance(self.max_timeouts, int)
                                              or self.max_timeouts < 1):
            raise field_error("--max-timeouts", self.max_timeouts, "a whole number >= 1")
        check_timeout(self.max_time, "--max-time")

    @property
    def end(self) -> float:
        """The monotonic time at which ``max_time`` runs out (infinity without one)."""
        return math.inf if self.max_time is None else self.started + self.max_time

    def record(self, timed_out: bool, completed: bool) -> None:
        """Count a unit that ended: a timeout adds one, a unit that came back with a result resets the count."""
        if timed_out:
            self.timeouts += 1
        elif completed:
            self.timeouts = 0

    def stop(self) -> tuple[str, dict[str, Any]] | None:
        """Why the remaining units are not reached, as words and as values; None while they run. The run
        stops as soon as ``max_timeouts`` units in a row timed out, so the values count them."""
        from attn_ledger.render.notes import stop_text

        if self.max_timeouts is not None and self.timeouts >= self.max_timeouts:
            data: dict[str, Any] = {"stopped_by": "max_timeouts", "max_timeouts": self.max_timeouts}
        elif time.monotonic() >= self.end:
            data = {"stopped_by": "max_time", "max_time_s": self.max_time}
        else:
            return None
        return "not reached: " + stop_text(data), data


def run_user_task(name: str, args: dict[str, Any], *, in_process: bool = False, timeout: float | None = None,
                  progress: Callable[[int, int], None] | None = None, limits: Limits | None = None) -> Outcome:
    """Run task ``name`` of :data:`attn_ledger.runner.tasks.TASKS` in a worker, or here with ``in_process``.

    Args:
        name: the task.
        args: its plain-data arguments; ``args["field"]`` names the option that gave the user's object.
        in_process: run in this process (for debugging): ``SystemExit`` from user code is still a
            finding and its stdout goes to stderr, but a hang or a crash is not caught.
        timeout: seconds per call into user code; None means :data:`TIMEOUT_S` in a worker and no
            limit in-process.
        progress: ``callback(done, total)``.
        limits: when the run stops early (default :class:`Limits`: after 3 timeouts in a row).

    Raises:
        AttnLedgerError: bad input or setup (the user's object cannot be imported or built).
        WorkerError: a bug in attn-ledger surfaced in the worker.
    """
    from attn_ledger.runner.tasks import TASKS

    check_timeout(timeout)
    limits = limits or Limits()
    task = TASKS[name]
    if in_process:
        import torch  # noqa: F401 - before the user's import, which should not spend its time limit loading torch

        from attn_ledger.guard import in_process as in_process_policy

        with in_process_policy(timeout, stdout_to_stderr=True):
            return Outcome(_run_here(task, args, progress, limits))
    with _run_directory() as tmp, _Supervisor(Path(tmp), timeout or TIMEOUT_S) as sup:
        report = _run_supervised(sup, name, task, args, progress, limits)
        return Outcome(report, sup.output())


@contextlib.contextmanager
def _run_directory() -> Iterator[str]:
    """The task's temporary directory; on the way out, every process started meanwhile ends first.

    This process becomes their subreaper (:mod:`attn_ledger.runner.reaper`), so a child the user's code
    forks, even one in a session of its own, is found and ended when the worker is gone; only
    then is the directory (the captured output it may still hold open) removed.
    """
    before = reaper.snapshot()
    reaper.become_subreaper()
    with tempfile.TemporaryDirectory(prefix="attn-ledger-") as tmp:
        try:
            yield tmp
        finally:
            reaper.end_descendants(before, keep=reaper.helper_pids())


def _past_the_stop(task: Any, args: dict[str, Any], unit: Any, limits: Limits, stop: tuple[str, dict[str, Any]]) -> Any:
    """The result of a unit the run does not start: not reached, except the first after ``max_time`` ran out
    between units, which is where the run was cut (an L1 ``call`` failure), so that a run cut short never passes."""
    if stop[1]["stopped_by"] == "max_time" and not limits.cut:
        limits.cut = True
        return task.stopped(args, unit, f"not run: the check ran out of time (--max-time {limits.max_time:g} s)",
                            {"call": None, "max_time_s": limits.max_time})
    return task.not_reached(args, unit, *stop)


def _run_units(task: Any, args: dict[str, Any], units: list[Any], limits: Limits,
               progress: Callable[[int, int], None] | None, run_one: Callable[..., Any]) -> list[Any]:
    """Each unit through ``run_one(index, unit, progress)`` until ``limits`` stop the run; the units after the
    stop are not reached (:func:`_past_the_stop`). A lone unit gets the progress callback; several report
    their own count."""
    results = []
    for i, unit in enumerate(units):
        stop = limits.stop()
        if stop is not None:
            results.append(_past_the_stop(task, args, unit, limits, stop))
        else:
            results.append(run_one(i, unit, progress if len(units) == 1 else None))
        if progress is not None and len(units) > 1:
            progress(i + 1, len(units))
    return results


def _run_here(task: Any, args: dict[str, Any], progress: Callable[[int, int], None] | None, limits: Limits) -> Any:
    from attn_ledger.probes.common.driver import load_local
    from attn_ledger.runner.tasks import ParentTask, load_model_here, load_module_here

    judged_here = isinstance(task, ParentTask)
    if judged_here:
        loads = {"kernel": load_local, "model": load_model_here}.get(task.loads, load_module_here)
        state, plan = task.setup(args, loads)
    else:
        state, plan = task.setup(args)

    def run_one(i: int, unit: Any, one: Callable[[int, int], None] | None) -> Any:
        result = task.run(state, args, unit, one)
        limits.record(task.timed_out(result), completed=True)
        return result

    results = _run_units(task, args, plan["units"], limits, progress, run_one)
    return task.finish(state, args, plan, results) if judged_here else task.finish(args, plan, results)


def _run_supervised(sup: "_Supervisor", name: str, task: Any, args: dict[str, Any],
                    progress: Callable[[int, int], None] | None, limits: Limits) -> Any:
    from attn_ledger.runner.tasks import ParentTask

    judged_here = isinstance(task, ParentTask)
    sup.end, sup.max_time = limits.end, limits.max_time
    try:
        if judged_here:  # the worker only calls the user's code; this process plans, computes and judges
            load = (lambda target, field: RemoteKernel(sup, target, field)) if task.loads == "kernel" \
                else (lambda task_args: _remote_model(sup, task_args)) if task.loads == "model" \
                else (lambda task_args: _remote_module(sup, task_args))
            state, plan = task.setup(args, load)
        else:
            plan = sup.setup(name, args)
    except _Stopped as stop:  # --max-time ran out before the first case: there are no cases to report on
        raise field_error("--max-time", limits.max_time, f"a bound that leaves time for the cases: it ran out while "
                          f"{stop.data['call'] or 'the worker started'}", SetupError) from None
    units = plan["units"]

    def run_one(i: int, unit: Any, one: Callable[[int, int], None] | None) -> Any:
        try:
            if not sup.alive and not judged_here:
                sup.setup(name, args)  # a fresh worker imports (and builds) the user's object again
            # judged here, a call that finds the worker gone starts a fresh one first
            result = task.run(state, args, unit, one) if judged_here else sup.run(unit, one)
            limits.record(task.timed_out(result), completed=True)
            return result
        except _Stopped as stop_:
            limits.record("timeout_s" in stop_.data, completed=False)
            limits.cut = limits.cut or "max_time_s" in stop_.data
            more = "; the worker was restarted for the remaining cases" if i + 1 < len(units) else ""
            more = "" if limits.stop() is not None else more
            return task.stopped(args, unit, stop_.detail + more, stop_.data)

    results = _run_units(task, args, units, limits, progress, run_one)
    return task.finish(state, args, plan, results) if judged_here else task.finish(args, plan, results)


def show_output(output: str, max_lines: int = 40) -> None:
    """Write what the user's code printed to stderr, marked as such and cut to its last ``max_lines`` lines."""
    if not output.strip():
        return
    lines = output.rstrip("\n").splitlines()
    cut = len(lines) - max_lines
    shown = lines[-max_lines:] if cut > 0 else lines
    head = "note: your code wrote this on stdout/stderr (captured; stdout carries only the report):"
    body = ([f"  ... {cut} earlier lines not shown"] if cut > 0 else []) + [f"  | {line[:300]}" for line in shown]
    sys.stderr.write("\n".join([head, *body]) + "\n")
    sys.stderr.flush()


# --- the parent's side ------------------------------------------------------------------------------


_Stopped = CallStopped  # the worker died or ran past the time limit (see attn_ledger.guard.CallStopped)


def _context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process first starts its fork server
    return ctx


class _Supervisor:
    """Starts, watches and stops this command's worker; restarts it on demand after a death."""

    def __init__(self, directory: Path, timeout: float) -> None:
        self.directory, self.timeout = directory, timeout
        self.ctx = _context()
        self.proc: Any = None
        self.conn: Any = None
        self.captures: list[Path] = []
        self.call: str | None = None  # the user call in flight
        self.deadline = math.inf
        self.end, self.max_time = math.inf, None  # when the whole run's --max-time runs out, whatever is in flight
        self.killed = False
        self.on_part: Callable[[dict[str, Any], bytes], None] | None = None  # a model request's streamed calls

    def __enter__(self) -> "_Supervisor":
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None and self.proc is not None:  # Ctrl-C, SIGTERM, a bug: no time to ask politely
            self._kill()
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None

    def _start(self) -> None:
        capture = self.directory / f"output-{len(self.captures)}.txt"
        capture.touch()
        self.captures.append(capture)
        parent_end, child_end = self.ctx.Pipe(duplex=True)
        self.proc = self.ctx.Process(target=_serve, args=(child_end, str(capture)), daemon=True, name="attn-ledger-worker")
        self.proc.start()
        child_end.close()  # so that the worker's death reads as end-of-file here
        self.conn, self.call, self.killed = parent_end, None, False

    def setup(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """Start a fresh worker and load the user's object in it; a death here is a SetupError.

        Raises:
            _Stopped: ``--max-time`` ran out while the worker loaded the object (the caller says what that stops).
        """
        self.stop()
        self._start()
        self.conn.send(("setup", name, args))
        return self.setup_done(args)

    def start_setup(self, name: str, args: dict[str, Any]) -> None:
        """:meth:`setup` without waiting: :meth:`setup_done` waits for the plan (this process works meanwhile)."""
        self.stop()
        self._start()
        self.conn.send(("setup", name, args))

    def setup_done(self, args: dict[str, Any]) -> dict[str, Any]:
        """The plan of the setup started; a death here is a SetupError."""
        return self._await_setup("plan", args["field"])

    def _await_setup(self, kind: str, field: str) -> Any:
        """The answer ``kind`` to a request that sets the worker up (a plan, a loaded function): a worker
        that dies or hangs meanwhile is bad setup of ``field`` (a SetupError), unless ``--max-time`` ran out."""
        try:
            return self._await(kind, None)
        except _Stopped as stop:
            if "max_time_s" in stop.data:
                raise
            raise SetupError(f"{field}: {stop.detail}") from None

    def run(self, unit: Any, progress: Callable[[int, int], None] | None) -> Any:
        self.conn.send(("run", unit))
        return self._await("result", progress)

    def start_load(self, target: str, field: str) -> None:
        """Start a fresh worker and ask it to import the user's function; :meth:`load` waits for the answer."""
        self.stop()
        self._start()
        self.conn.send(("load", target, field))

    def load(self, target: str, field: str, started: bool = False) -> dict[str, Any]:
        """Import the user's function in a fresh worker (the driver's side); a death is a SetupError."""
        if not started:
            self.start_load(target, field)
        return self._await_setup("loaded", field)

    def call_kernel(self, kind: str, meta: dict[str, Any], data: bytes, request: str = "call") -> tuple[dict[str, Any], bytes]:
        """One call of the user's function through the driver: the facts, and the raw tensors as safetensors bytes."""
        self.conn.send((request, kind, meta, data))
        facts = self._await("called", None)
        try:
            return facts, self.conn.recv_bytes()
        except EOFError:
            raise self._death() from None

    def call_module(self, kind: str, meta: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
        """One request to the module driver (:func:`attn_ledger.probes.module.driver.serve`): facts and raw tensors back."""
        self.call, self.deadline = str(meta["what"]), time.monotonic() + self.timeout  # the worker does not announce it
        facts, blob = self.call_kernel(kind, meta, data, request="module_call")
        self.call, self.deadline = None, math.inf
        return facts, blob

    def call_model(self, kind: str, meta: dict[str, Any], data: bytes,
                   on_part: Callable[[dict[str, Any], bytes], None]) -> tuple[dict[str, Any], bytes]:
        """One request to the model driver (:func:`attn_ledger.probes.model.driver.serve`): every part it streams
        (one attention call: facts, then raw tensors) goes to ``on_part`` as it arrives; the request's facts
        and tensors come back at the end. The worker announces the forward itself (a user call)."""
        self.on_part = on_part
        try:
            return self.call_kernel(kind, meta, data, request="model_call")
        finally:
            self.on_part = None

    def _part(self, message: dict[str, Any]) -> None:
        """A streamed part: its facts now, its tensors next; handed on, then the call's clock starts again
        (the worker waited while this process judged)."""
        try:
            blob = self.conn.recv_bytes()
        except EOFError:
            raise self._death() from None
        if self.on_part is None:
            raise WorkerError("the worker sent a part outside a model request")
        self.on_part(decode(message["value"]), blob)
        if self.call is not None:
            self.deadline = time.monotonic() + self.timeout

    def _await(self, expected: str, progress: Callable[[int, int], None] | None) -> Any:
        while True:
            until = min(self.end, math.inf if self.call is None else self.deadline)
            ready = wait([self.conn, self.proc.sentinel], None if until == math.inf else max(0.0, until - time.monotonic()))
            if not ready:
                what = self.call
                self._kill()
                if until == self.end:
                    raise self._out_of_time(what)
                raise _Stopped(f"{what} timed out after {self.timeout:g} s", {"call": what, "timeout_s": self.timeout})
            if self.conn not in ready:
                raise self._death()
            try:
                message = json.loads(self.conn.recv_bytes())
            except EOFError:
                raise self._death() from None
            kind = message.get("t")
            if kind == "start":
                self.call, self.deadline = str(message["what"]), time.monotonic() + self.timeout
            elif kind == "done":
                self.call, self.deadline = None, math.inf
            elif kind == "progress":
                if progress is not None:
                    progress(int(message["done"]), int(message["total"]))
            elif kind == "part":
                self._part(message)
            elif kind == expected:
                return decode(message["value"])
            elif kind == "error":
                cls = getattr(errors, str(message["kind"]), AttnLedgerError)
                raise (cls if isinstance(cls, type) and issubclass(cls, AttnLedgerError) else AttnLedgerError)(message["message"])
            else:
                raise WorkerError(f"the worker failed:\n{message.get('trace', message)}")

    def _out_of_time(self, what: str | None) -> _Stopped:
        """The stop of the unit in flight when the run's ``--max-time`` ran out (the worker is killed)."""
        where = what if what else "the worker, between calls into your code,"
        return _Stopped(f"{where} was stopped: the check ran out of time (--max-time {self.max_time:g} s)",
                        {"call": what, "max_time_s": self.max_time})

    def _death(self) -> _Stopped:
        """The worker is gone: reap it and say which call it died in, and how."""
        what, proc = self.call, self.proc
        proc.join()
        code = proc.exitcode
        cut_off = code == 255 and _cut_off(proc)
        self._forget()
        data: dict[str, Any] = {"call": what}
        if cut_off:
            cause, data["fork_server"] = ("was stopped: the fork server that started it died (killed from outside, "
                                          "or by your code)", "died")
        elif code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            cause, data["signal"] = f"killed by signal {name}", name
        else:
            cause, data["exit_status"] = f"exited with status {code}", code
        detail = f"{what} {cause}" if what else f"the worker running your code {cause} between calls into it"
        return _Stopped(detail, data)

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker leads its own group: its children go too
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.join()
        self._forget()

    def _forget(self) -> None:
        self.conn.close()
        self.proc, self.conn, self.call, self.deadline = None, None, None, math.inf

    def stop(self) -> None:
        """Ask the worker to leave; kill it if it does not within a few seconds."""
        if self.proc is None:
            return
        try:
            self.conn.send(("exit",))
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.exitcode is None:
            self._kill()
        else:
            self._forget()

    def output(self) -> str:
        parts = []
        for path in self.captures:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - _OUTPUT_TAIL_BYTES))
                text = fh.read().decode("utf-8", errors="replace")
            if text.strip():
                parts.append(text if size <= _OUTPUT_TAIL_BYTES else "...\n" + text)
        return "\n".join(parts)


def _cut_off(proc: Any) -> bool:
    """Whether the fork server that started ``proc`` died (multiprocessing then reads the worker's
    status as 255, the worker possibly still running).

    Such a worker is ended here, before it can write more (its pipe to us is about to close), and
    reaped where it was reparented to this process.
    """
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not isinstance(pid, int) or reaper.alive(pid):
        return False
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(proc.pid, 0)
    except ChildProcessError:  # reparented elsewhere: gone once the kill lands
        pass
    return True


class RemoteKernel(KernelTarget):
    """The user's kernel, called in the worker: each call is one round trip, tensors out and back as
    safetensors bytes. A :class:`~attn_ledger.probes.common.driver.KernelTarget` for :mod:`attn_ledger.probes.kernel.check`.

    A call that finds the worker gone (an earlier call crashed or timed out) first starts a fresh one,
    which imports the user's file again. A death or a timeout during a call raises :class:`CallStopped`.
    """

    def __init__(self, sup: _Supervisor, target: str, field: str) -> None:
        self.sup, self.target, self.field = sup, target, field
        self.state: dict[str, Any] = {}
        self.signature: list[list[Any]] | None = None
        self.loading = True
        sup.start_load(target, field)  # the worker imports torch and the user's file while this process plans

    def ready(self) -> None:
        """Wait until the worker has imported the user's function (SetupError if it cannot)."""
        if self.loading:
            self._load(started=True)

    def _load(self, started: bool = False) -> None:
        from attn_ledger.probes.common.driver import merge_state

        self.loading = False
        loaded = self.sup.load(self.target, self.field, started)
        self.signature = loaded["signature"]
        self.state = merge_state(self.state, loaded["state"])

    @property
    def __signature__(self) -> Any:
        """The function's signature, rebuilt from its parameters' names and kinds (no signature: not one)."""
        import inspect

        self.ready()
        if self.signature is None:
            return "no signature"
        try:
            return inspect.Signature([inspect.Parameter(name, inspect._ParameterKind(kind),
                                                        default=None if has_default else inspect.Parameter.empty)
                                      for name, kind, has_default in self.signature])
        except (TypeError, ValueError):
            return "no signature"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a RemoteKernel is called through forward() and with_grad()")

    def _call(self, kind: str, tensors: dict[str, Any], kw: dict[str, Any], meta: dict[str, Any]) -> Any:
        from attn_ledger.probes.common.driver import Called, merge_state, pack, unpack

        self.ready()
        if not self.sup.alive:
            self._load()
        mask = kw.get("allow_mask", "absent")
        if mask is not None and not isinstance(mask, str):
            tensors = {**tensors, "allow_mask": mask}
        sinks = kw.get("sinks")
        if sinks is not None:
            tensors = {**tensors, "sinks": sinks}
        meta = {**meta, "kw": {n: x for n, x in kw.items() if n not in ("allow_mask", "sinks")},
                "sinks": sinks is not None,
                "mask": "absent" if isinstance(mask, str) else "none" if mask is None else "tensor",
                "device": str(tensors["q"].device), "threads": _threads()}
        facts, blob = self.sup.call_kernel(kind, meta, pack(tensors))
        self.state = merge_state(self.state, facts.pop("state", {}))
        return Called(unpack(blob, tensors["q"].device), facts)

    def forward(self, q: Any, k: Any, v: Any, kw: dict[str, Any], what: str, grad_mode: bool = False,
                watch: bool = False) -> Any:
        return self._call("forward", {"q": q, "k": k, "v": v}, kw,
                          {"what": what, "grad_mode": grad_mode, "watch": watch})

    def with_grad(self, q: Any, k: Any, v: Any, kw: dict[str, Any], d_out: Any, what: str,
                  watch: bool = False) -> Any:
        return self._call("with_grad", {"q": q, "k": k, "v": v, "d_out": d_out}, kw, {"what": what, "watch": watch})


def _remote_module(sup: _Supervisor, args: dict[str, Any]) -> tuple[Any, Any]:
    """The module built by the user's factory in a fresh worker, as the parent's stand-in, and decode's."""
    from attn_ledger.probes.module.driver import Link, RemoteDecode, remote_module

    sup.start_setup("module_driver", args)  # the worker imports torch and builds the module while this process
    import attn_ledger.probes.module.check  # noqa: F401 - imports torch and the checks meanwhile

    plan = sup.setup_done(args)
    return remote_module(Link(sup), plan["module"]), (RemoteDecode() if args.get("decode") is not None else None)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# --- the worker's side ------------------------------------------------------------------------------


class _Channel:
    """The worker's end of the pipe: JSON messages to the parent."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, message_type: str, /, **fields: Any) -> None:
        self.conn.send_bytes(json.dumps({"t": message_type, **fields}).encode())

    def started(self, what: str) -> None:
        self.send("start", what=what)

    def done(self) -> None:
        self.send("done")


def _isolate(capture_path: str) -> None:
    """Own process group, no SIGINT (the parent handles Ctrl-C), fds 1 and 2 into the capture file."""
    import faulthandler
    import io

    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(capture_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Unbuffered, so that what was printed before a hang or a crash is in the file when the worker dies.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    faulthandler.enable(file=sys.stderr)


def _serve(conn: Any, capture_path: str) -> None:
    """The worker's main loop: set up a task, run its units, answer each request with one message."""
    _isolate(capture_path)
    from attn_ledger.alloc import retain_freed_memory
    from attn_ledger.guard import reporting_to
    from attn_ledger.runner.tasks import TASKS

    retain_freed_memory()
    channel = _Channel(conn)
    state: Any = None
    task: Any = None
    args: dict[str, Any] = {}
    with reporting_to(channel):
        while True:
            request = conn.recv()
            if request[0] == "exit":
                return
            try:
                if request[0] == "setup":
                    task, args = TASKS[request[1]], request[2]
                    state, plan = task.setup(args)
                    channel.send("plan", value=encode(plan))
                elif request[0] == "load":
                    state = _load(channel, request[1], request[2])
                elif request[0] == "call":
                    _call(channel, state, *request[1:])
                elif request[0] == "module_call":
                    _module_call(channel, state, *request[1:])
                elif request[0] == "model_call":
                    _model_call(channel, state, *request[1:])
                else:
                    progress = lambda done, total: channel.send("progress", done=done, total=total)  # noqa: E731
                    channel.send("result", value=encode(task.run(state, args, request[1], progress)))
            except AttnLedgerError as exc:
                channel.send("error", kind=type(exc).__name__, message=str(exc))
            except BaseException:  # noqa: BLE001 - a bug in the tool, or user code outside any guarded call
                channel.send("bug", trace=traceback.format_exc())


def _load(channel: _Channel, target: str, field: str) -> tuple[Any, dict[str, Any]]:
    """The driver's side of :meth:`_Supervisor.load`: snapshot torch, import, say the signature and what changed."""
    from attn_ledger.probes.common.driver import signature_of, snapshot, state_changes
    from attn_ledger.inputs.userload import load_object

    baseline = snapshot()  # before the user's file runs
    fn = load_object(target, field)
    channel.send("loaded", value=encode({"signature": signature_of(fn), "state": state_changes(baseline)}))
    return fn, baseline


def _call(channel: _Channel, state: tuple[Any, dict[str, Any]], kind: str, meta: dict[str, Any], data: bytes) -> None:
    """The driver's side of :meth:`_Supervisor.call_kernel`: one call on the tensors sent, raw tensors back."""
    from attn_ledger.probes.common.driver import call_forward, call_with_grad, pack, state_changes, unpack

    import torch

    fn, baseline = state
    if torch.get_num_threads() != meta["threads"]:  # as the parent runs the case: one thread for a small one
        torch.set_num_threads(meta["threads"])
    tensors = unpack(data, meta["device"])
    kw = dict(meta["kw"])
    if meta["mask"] != "absent":
        kw["allow_mask"] = tensors.get("allow_mask")
    if meta.get("sinks"):
        kw["sinks"] = tensors.get("sinks")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if "interface" in kw:  # check --protocol transformers: called as a transformers layer calls it
        from attn_ledger.probes.interface.driver import InterfaceAdapter

        fn = InterfaceAdapter(fn)
    if kind == "forward":
        called = call_forward(fn, q, k, v, kw, meta["what"], meta["grad_mode"])
    else:
        called = call_with_grad(fn, q, k, v, kw, tensors["d_out"], meta["what"])
    called.facts["state"] = state_changes(baseline, meta["watch"])
    try:
        blob = pack(called.tensors)
    except Exception as exc:  # noqa: BLE001 - a tensor safetensors cannot carry: what no check can read
        text = f"returned a tensor that cannot be sent back ({type(exc).__name__}: {str(exc)[:100]})"
        called.facts["error"] = {"kind": "returned", "text": text, "data": {}}
        blob = pack({})
    channel.send("called", value=encode(called.facts))
    channel.conn.send_bytes(blob)


def _module_call(channel: _Channel, state: Any, kind: str, meta: dict[str, Any], data: bytes) -> None:
    """The module driver's side of :meth:`_Supervisor.call_module`: one call on the tensors sent, raw tensors back."""
    from attn_ledger.probes.common.driver import pack, unpack
    from attn_ledger.probes.module.driver import laid_flat, serve

    facts, tensors = serve(state, kind, meta, unpack(data))
    try:
        flat, facts["layouts"] = laid_flat(tensors)
        blob = pack(flat)
    except Exception as exc:  # noqa: BLE001 - a tensor safetensors cannot carry: what no check can read
        text = f"returned a tensor that cannot be sent back ({type(exc).__name__}: {str(exc)[:100]})"
        facts, blob = {"error": {"kind": "returned", "text": text, "data": {}}}, pack({})
    channel.send("called", value=encode(facts))
    channel.conn.send_bytes(blob)


def _model_call(channel: _Channel, state: Any, kind: str, meta: dict[str, Any], data: bytes) -> None:
    """The model driver's side of :meth:`_Supervisor.call_model`: each attention call streamed as a part, then
    the request's facts."""
    from attn_ledger.probes.common.driver import pack, unpack
    from attn_ledger.probes.model.driver import serve

    def send(facts: dict[str, Any], tensors: dict[str, Any]) -> None:
        channel.send("part", value=encode(facts))
        channel.conn.send_bytes(pack(tensors))

    facts, tensors = serve(state, kind, meta, unpack(data), send)
    channel.send("called", value=encode(facts))
    channel.conn.send_bytes(pack(tensors))


def _remote_model(sup: _Supervisor, args: dict[str, Any]) -> Any:
    """The model built in a fresh worker, as the tool's handle on it."""
    from attn_ledger.probes.model.driver import RemoteModel

    sup.start_setup("model_driver", args)  # the worker imports torch and transformers and builds the model
    import attn_ledger.probes.model.scan  # noqa: F401 - imports torch and the judge meanwhile

    plan = sup.setup_done(args)
    return RemoteModel(sup, plan["model"])


# --- results as plain data --------------------------------------------------------------------------


def encode(value: Any) -> Any:
    """A result as JSON-ready data: dataclasses, tuples and dicts tagged so that :func:`decode` rebuilds them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Fields outside comparison (a report's tensors kept for inspection) stay behind.
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init and f.compare}
        return {"__dataclass__": type(value).__name__, "fields": fields}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}
    raise TypeError(f"cannot send a {type(value).__name__} from the worker")


def decode(data: Any) -> Any:
    """Rebuild what :func:`encode` made, into the classes of :data:`attn_ledger.runner.tasks.RESULT_TYPES` only.

    Raises:
        WorkerError: a class outside that list, or data of an unknown form.
    """
    from attn_ledger.runner.tasks import RESULT_TYPES

    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict) and "__tuple__" in data:
        return tuple(decode(v) for v in data["__tuple__"])
    if isinstance(data, dict) and "__dict__" in data:
        return {k: decode(v) for k, v in data["__dict__"].items()}
    if isinstance(data, dict) and "__dataclass__" in data:
        cls = next((c for c in RESULT_TYPES if c.__name__ == data["__dataclass__"]), None)
        if cls is None:
            raise WorkerError(f"the worker sent a {data['__dataclass__']!r}, which is not a result type")
        return cls(**{k: decode(v) for k, v in data["fields"].items()})
    raise WorkerError(f"the worker sent data of an unknown form: {str(data)[:100]}")
