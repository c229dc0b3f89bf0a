"""The commands' work on user code, cut into units that :mod:`attn_ledger.runner.worker` can run anywhere.

``check FILE:NAME`` is a :class:`ParentTask`: it runs in the tool's own process, which plans the
cases, makes the inputs, computes every reference and judges; only the calls of the user's function
go to the worker, through the fixed driver (:mod:`attn_ledger.probes.common.driver`), which sends back raw tensors.
``check --module`` is a :class:`ParentTask` too: the module is built in the worker, which keeps it and
runs each call of it (forward, backward, observation, decode step) through the module driver
(:mod:`attn_ledger.probes.module.driver`, the worker-side task ``module_driver``); every check is judged here.
``intervene --module`` is judged here the same way.

A :class:`Task` is four plain functions:

* ``setup(args)`` imports the user's object (and builds the module, for a factory) and returns
  ``(state, plan)``; ``plan["units"]`` lists the units of work as plain values. A failure here
  is bad setup: exit 2.
* ``run(state, args, unit, progress)`` does one unit and returns its result (a case's result,
  a whole report).
* ``stopped(args, unit, reason, data)`` is the result of a unit whose call into user code never
  came back (an exit, a crash, the time limit): an L1 ``call`` finding with that reason and data.
* ``finish(args, plan, results)`` assembles the report.
* ``not_reached(args, unit, reason, data)`` is the result of a unit never run because the run
  stopped early (:class:`attn_ledger.runner.worker.Limits`), and ``timed_out(result)`` says whether a
  unit's result is a timed-out call (what the in-process path counts towards ``--max-timeouts``).

A :class:`Task`'s ``args`` and units are plain data (str, int, float, bool, None, lists, dicts), so they
cross a process boundary as they are; results cross as the dataclasses listed in :data:`RESULT_TYPES`
(a case's result, or a whole :class:`~attn_ledger.report.Report`). A :class:`ParentTask`'s never leave
this process, so they hold what was parsed already: a kernel check's cases are
:class:`~attn_ledger.probes.kernel.cases.Case` values, parsed once from their ids by the command.
The same four functions run in the tool's own process for ``--in-process``, so both ways give
the same report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attn_ledger.probes.module.decode import validate_decode
from attn_ledger.experiments.intervene import intervene_module, stopped_intervention
from attn_ledger.probes.common.forward import build_module
from attn_ledger.probes.kernel.check import (
    Case,
    CaseResult,
    Options,
    Plan,
    check_capabilities,
    check_case,
    failed_call,
    kernel_report,
    nothing_left,
    not_reached_case,
    plan_cases,
    with_call_notes,
)
from attn_ledger.probes.kernel.spec import declaration
from attn_ledger.probes.module.check import BATCH_SIZE, SEQ_LEN, check_built_module, stopped_module_report
from attn_ledger.report import Check, Coverage, Finding, Note, Report, Row, unjudged
from attn_ledger.seeding import manual_seed
from attn_ledger.inputs.userload import load_object

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class Task:
    """One command's work on user code, all of it run in the worker (see the module docstring)."""

    setup: Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]]
    run: Callable[[Any, dict[str, Any], Any, Progress], Any]
    stopped: Callable[[dict[str, Any], Any, str, dict[str, Any]], Any]
    finish: Callable[[dict[str, Any], dict[str, Any], list[Any]], Any]
    not_reached: Callable[[dict[str, Any], Any, str, dict[str, Any]], Any]
    timed_out: Callable[[Any], bool]


@dataclass(frozen=True)
class ParentTask:
    """One command's work judged in the tool's own process: only the calls into user code leave it.

    ``setup(args, load)`` gets ``load(target, field)``, which imports the user's function where it is
    to be called and returns a :class:`~attn_ledger.probes.common.driver.KernelTarget` (in a worker:
    :class:`attn_ledger.runner.worker.RemoteKernel`; in-process: :class:`attn_ledger.probes.common.driver.LocalKernel`).
    ``run`` and ``finish`` get that state too; a call that never came back raises
    :class:`~attn_ledger.guard.CallStopped` up to the unit's loop, which records ``stopped``.
    """

    setup: Callable[[dict[str, Any], Callable[[str, str], Any]], tuple[Any, dict[str, Any]]]
    run: Callable[[Any, dict[str, Any], Any, Progress], Any]
    stopped: Callable[[dict[str, Any], Any, str, dict[str, Any]], Any]
    finish: Callable[[Any, dict[str, Any], dict[str, Any], list[Any]], Any]
    not_reached: Callable[[dict[str, Any], Any, str, dict[str, Any]], Any]
    timed_out: Callable[[Any], bool]
    loads: str = "kernel"
    """What ``setup``'s ``load`` gives: ``kernel``, a kernel target; ``module``, ``load(args)`` builds the
    module with the user's factory and loads the decode function: ``(module, decode)`` (in a worker:
    :class:`attn_ledger.probes.module.driver.RemoteModule` and a stand-in for decode; in-process: the objects)."""


# --- check FILE:NAME: one unit per case -----------------------------------------------------------

def _kernel_options(args: dict[str, Any]) -> Options:
    return Options(args["empty_rows"], args["seed"], args["backward"], args["strict_precision"], args["device"],
                   args.get("strict_coverage", False))


def _kernel_setup(args: dict[str, Any], load: Callable[[str, str], Any]) -> tuple[Any, dict[str, Any]]:
    """Import the target, leave out the cases outside the declaration, and check it takes the protocol's
    arguments (its signature, or one probe call): all before any case, all bad setup if they fail."""
    from attn_ledger.errors import SetupError
    from attn_ledger.guard import CallStopped

    fn = load(args["target"], args["field"])
    decl = declaration(args["declaration"])
    plan = plan_cases(list(args["cases"]), decl, args["device"])
    fn.ready()  # an import that fails is named before a declaration that leaves nothing to run
    if not plan.cases:
        raise SetupError(f"declaration: leaves no case to run ({nothing_left(plan)})")
    try:
        check_capabilities(fn, plan, decl, args["target"], _kernel_options(args))
    except CallStopped as stop:  # the probe call crashed the worker or hung: the target cannot be checked
        raise SetupError(f"target: {args['target']}: {stop.detail}") from None
    return fn, {"units": list(plan.cases), "skipped": plan.skipped, "notes": list(plan.notes),
                "device": plan.device, "reference_dtype": plan.reference_dtype}


def _kernel_run(fn: Any, args: dict[str, Any], unit: Case, progress: Progress) -> CaseResult:
    return check_case(fn, unit, options=_kernel_options(args), declaration=declaration(args["declaration"]))


def _kernel_stopped(args: dict[str, Any], unit: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    return failed_call(unit, reason, data)


def _kernel_not_reached(args: dict[str, Any], unit: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    return not_reached_case(unit, reason, data)


def _kernel_timed_out(result: CaseResult) -> bool:
    return any(c.failed and "timeout_s" in c.data for c in result.checks)


def _kernel_finish(fn: Any, args: dict[str, Any], plan: dict[str, Any], results: list[Any]) -> Report:
    cases = tuple(plan["units"])
    report = kernel_report(results, target=args["target"], options=_kernel_options(args),
                           declaration=declaration(args["declaration"]), tier=args["tier"],
                           plan=Plan(cases, dict(plan["skipped"]), tuple(plan["notes"]), plan["device"],
                                     plan["reference_dtype"]))
    return with_call_notes(report, results, fn.state)


# --- check FILE:NAME, the protocol detected: kernel, or transformers' attention interface --------------

def _attention_setup(args: dict[str, Any], load: Callable[[str, str], Any]) -> tuple[Any, dict[str, Any]]:
    """Import the target, detect its protocol from its signature (unless given), and set up that protocol's
    cases. Units are ``(PROTOCOL, CASE)`` so that a stopped unit knows its protocol."""
    from attn_ledger.errors import SetupError
    from attn_ledger.probes.interface.check import PROTOCOL, is_interface

    fn = load(args["target"], args["field"])
    fn.ready()
    given = args.get("protocol")
    protocol = given or (PROTOCOL if is_interface(fn.__signature__) else "kernel")
    if protocol == "kernel":
        kargs = args.get("kernel")
        if kargs is None:
            raise SetupError(args.get("kernel_error") or "target: the kernel protocol's options could not be read")
        state, plan = _kernel_setup({**kargs, "target": args["target"], "field": args["field"]}, lambda *_: fn)
        return ("kernel", state, kargs), {**plan, "units": [("kernel", u) for u in plan["units"]]}
    return _interface_setup(fn, args, detected=given is None)


def _interface_setup(fn: Any, args: dict[str, Any], detected: bool) -> tuple[Any, dict[str, Any]]:
    import importlib.util

    from attn_ledger.errors import SetupError
    from attn_ledger.probes.common.driver import LocalKernel
    from attn_ledger.probes.interface.check import declaration as interface_declaration, plan as interface_plan
    from attn_ledger.probes.interface.driver import NO_TRANSFORMERS, InterfaceAdapter

    if importlib.util.find_spec("transformers") is None:  # transformers itself is imported in the worker only
        raise SetupError(NO_TRANSFORMERS)
    iargs = args.get("interface")
    if iargs is None:
        raise SetupError(f"target: {args['target']} follows the transformers protocol (detected from its signature), "
                         f"and {args.get('interface_error') or 'its options could not be read'}")
    decl = interface_declaration(iargs["declared"], source=iargs.get("source", ""))
    cases, skipped = interface_plan(decl, iargs.get("cases"), iargs.get("tier") or "default")
    if not cases:
        raise SetupError("declaration: leaves no case to run")
    if isinstance(fn, LocalKernel):
        fn.fn = InterfaceAdapter(fn.fn)  # in this process; a worker wraps it for each call it is sent
    state = ("transformers", fn, {**iargs, "declaration": decl.to_json(), "detected": detected, "skipped": skipped})
    return state, {"units": [("transformers", c) for c in cases]}


def _attention_run(state: Any, args: dict[str, Any], unit: tuple[str, Any], progress: Progress) -> Any:
    protocol, fn, pargs = state
    case = unit[1]
    if protocol == "kernel":
        return _kernel_run(fn, {**pargs, "target": args["target"]}, case, progress)
    from attn_ledger.probes.interface.check import check_icase, declaration as interface_declaration

    return check_icase(fn, case, interface_declaration(pargs["declaration"]),
                       name=args["target"].rsplit(":", 1)[-1], seed=pargs["seed"], empty_rows=pargs["empty_rows"])


def _interface_failed(case: Any, reason: str, data: dict[str, Any], status: str = "fail") -> Any:
    from attn_ledger.probes.interface.check import CHECK_ORDER, ICaseResult

    rest = [unjudged(level, name, "not_reached", reason) for level, name in CHECK_ORDER[1:]]
    return ICaseResult(case, (Check(1, "call", status, reason=reason, data=data), *rest))  # type: ignore[arg-type]


def _attention_stopped(args: dict[str, Any], unit: tuple[str, Any], reason: str, data: dict[str, Any]) -> Any:
    protocol, case = unit
    return _kernel_stopped(args, case, reason, data) if protocol == "kernel" else _interface_failed(case, reason, data)


def _attention_not_reached(args: dict[str, Any], unit: tuple[str, Any], reason: str, data: dict[str, Any]) -> Any:
    protocol, case = unit
    if protocol == "kernel":
        return _kernel_not_reached(args, case, reason, data)
    return _interface_failed(case, reason, data, "not_reached")


def _attention_timed_out(result: Any) -> bool:
    return any(c.failed and "timeout_s" in c.data for c in result.checks)


def _attention_finish(state: Any, args: dict[str, Any], plan: dict[str, Any], results: list[Any]) -> Report:
    protocol, fn, pargs = state
    if protocol == "kernel":
        units = [case for _, case in plan["units"]]
        return _kernel_finish(fn, {**pargs, "target": args["target"]}, {**plan, "units": units}, results)
    from attn_ledger.probes.interface.check import Run, declaration as interface_declaration, interface_report

    run = Run(args["target"], interface_declaration(pargs["declaration"]), pargs["detected"], pargs["seed"],
              pargs["empty_rows"], pargs["skipped"], None if pargs.get("cases") else pargs.get("tier") or "default")
    return interface_report(results, run)


# --- check --module FILE:FACTORY and intervene --module: one unit ---------------------------------

def _module_setup(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    factory = load_object(args["spec"], args["field"])
    # Seeded just before the factory, as check_module does in-process, so both draw the same weights;
    # the worker is disposable, so its global generator need not be restored.
    manual_seed(args["seed"])
    return build_module(factory, args["embed_dim"], args["num_heads"], args["field"]), {"units": [0]}


def _only(args: dict[str, Any], plan: dict[str, Any], results: list[Any]) -> Any:
    return results[0]


def _never(result: Any) -> bool:
    return False  # one unit: nothing remains to stop after it


def _module_check_setup(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    decode = None
    if args.get("decode") is not None:
        decode = load_object(args["decode"], "--decode")
        validate_decode(decode, "--decode")
    module, plan = _module_setup(args)
    return (module, decode), plan


def load_module_here(args: dict[str, Any]) -> tuple[Any, Any]:
    """``(module, decode)`` built and loaded in this process (``--in-process``: the objects themselves)."""
    return _module_check_setup(args)[0]


def _module_driver_setup(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The worker's side of ``check --module``: build the module, keep it for the parent's calls, say its facts."""
    from attn_ledger.probes.module.driver import setup

    module, decode = load_module_here(args)
    return setup(module, decode)


def _module_parent_setup(args: dict[str, Any], load: Callable[[dict[str, Any]], Any]) -> tuple[Any, dict[str, Any]]:
    return load(args), {"units": [0]}


def _module_parent_finish(state: Any, args: dict[str, Any], plan: dict[str, Any], results: list[Any]) -> Report:
    return results[0]


def _module_check_run(state: Any, args: dict[str, Any], unit: Any, progress: Progress) -> Report:
    module, decode = state
    return check_built_module(module, args["embed_dim"], args["num_heads"], causal=args["causal"],
                              window=args.get("window"), scale=args.get("scale"), softcap=args.get("softcap"),
                              sinks=args.get("sinks"), seed=args["seed"],
                              batch_size=args.get("batch_size", BATCH_SIZE), seq_len=args.get("seq_len", SEQ_LEN),
                              progress=progress, subject=args["spec"], decode=decode)


def _module_check_stopped(args: dict[str, Any], unit: Any, reason: str, data: dict[str, Any]) -> Report:
    sizes = {"B": args.get("batch_size", BATCH_SIZE), "T": args.get("seq_len", SEQ_LEN), "E": args["embed_dim"],
             "Nh": args["num_heads"]}
    return stopped_module_report(args["spec"], sizes, args["causal"], reason, data, window=args.get("window"),
                                 scale=args.get("scale"), softcap=args.get("softcap"),
                                 sinks=None if args.get("sinks") is None else tuple(args["sinks"]))


def _intervene_run(state: Any, args: dict[str, Any], unit: Any, progress: Progress) -> Report:
    return intervene_module(state[0], args, progress)


def _intervene_stopped(args: dict[str, Any], unit: Any, reason: str, data: dict[str, Any]) -> Report:
    shape = (args["batch_size"], args["seq_len"], args["embed_dim"])
    return stopped_intervention(f"module {args['spec']}", shape, args["num_heads"], reason, data, args["cuts"] or ())


# --- scan: a whole model in the worker, judged here ------------------------------------------------

def load_model_here(args: dict[str, Any]) -> Any:
    """The model built in this process (``--in-process``): a handle with the same ``facts`` and ``scan``."""
    from attn_ledger.probes.model.driver import LocalModel, setup

    loaded, _ = setup(args)
    return LocalModel(loaded)


def _model_driver_setup(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The worker's side of ``scan``: build the model, keep it for the scan request, say what it is."""
    from attn_ledger.probes.model.driver import setup

    return setup(args)


def _scan_options(args: dict[str, Any]) -> Any:
    from attn_ledger.probes.model.expect import Declared
    from attn_ledger.probes.model.scan import ScanOptions

    o = args["options"]
    return ScanOptions(bool(o.get("keep_going")), int(o["budget"]), Declared(**o["declared"]) if o.get("declared")
                       else None, o.get("save"), bool(o.get("ledger", True)), bool(o.get("every_ledger")))


def _scan_run(handle: Any, args: dict[str, Any], unit: Any, progress: Progress) -> Report:
    from attn_ledger.probes.model.inputs import InputPlan
    from attn_ledger.probes.model.scan import scan

    return scan(handle, InputPlan(**args["plan"]), _scan_options(args))


def _scan_stopped(args: dict[str, Any], unit: Any, reason: str, data: dict[str, Any]) -> Report:
    from attn_ledger.probes.model.scan import stopped_report

    return stopped_report(args["target"], reason, data)


def _compare_run(handle: Any, args: dict[str, Any], unit: Any, progress: Progress) -> Report:
    from attn_ledger.probes.model.compare import Runs, Vary, compare

    runs = Runs(Vary(*args["vary"]), args["target"], args["target_b"], tuple(args["dtypes"]), args["plan"],
                args["plan_b"])
    return compare(handle, runs)


def _compare_stopped(args: dict[str, Any], unit: Any, reason: str, data: dict[str, Any]) -> Report:
    from attn_ledger.probes.model.compare import stopped_report

    return stopped_report(args, reason, data)


# A module's one unit not reached (--max-time spent on the import and the factory) is stopped before its call.
TASKS: dict[str, Task | ParentTask] = {
    "attention_check": ParentTask(_attention_setup, _attention_run, _attention_stopped, _attention_finish,
                                  _attention_not_reached, _attention_timed_out),
    "kernel_check": ParentTask(_kernel_setup, _kernel_run, _kernel_stopped, _kernel_finish, _kernel_not_reached,
                         _kernel_timed_out),
    "module_check": ParentTask(_module_parent_setup, _module_check_run, _module_check_stopped, _module_parent_finish,
                               _module_check_stopped, _never, loads="module"),
    "module_driver": Task(_module_driver_setup, _module_check_run, _module_check_stopped, _only,
                          _module_check_stopped, _never),
    "intervene_module": ParentTask(_module_parent_setup, _intervene_run, _intervene_stopped, _module_parent_finish,
                                   _intervene_stopped, _never, loads="module"),
    "model_scan": ParentTask(_module_parent_setup, _scan_run, _scan_stopped, _module_parent_finish, _scan_stopped,
                             _never, loads="model"),
    "model_compare": ParentTask(_module_parent_setup, _compare_run, _compare_stopped, _module_parent_finish,
                                _compare_stopped, _never, loads="model"),
    "model_driver": Task(_model_driver_setup, _scan_run, _scan_stopped, _only, _scan_stopped, _never),
}

RESULT_TYPES: tuple[type, ...] = (Check, Row, Finding, Coverage, Note, Report, Case, CaseResult)
# (an attention-interface case's result never crosses: its task is judged in this process)
"""The only classes a worker's result may be rebuilt into (a plan and a unit are plain data)."""
