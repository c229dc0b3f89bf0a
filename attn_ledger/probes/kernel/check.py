"""Black-box checks for a user's attention function under the kernel protocol.

Everything here runs in the tool's own process: the user's function is called through a
:class:`~attn_ledger.probes.common.driver.KernelTarget` (in a worker for the CLI), which gives back raw
tensors and call facts; every reference, bound and verdict is computed here from them.

The kernel protocol::

    def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) -> Tensor

and, for a kernel that declares them (``--supports softcap,window,sinks``), the keyword arguments
``softcap=C`` (scaled scores become ``C * tanh(s / C)`` before the mask), ``window=W`` (query i may use
key j only if ``i + (Tk - Tq) - j < W``) and ``sinks`` ``[Nh]`` (one logit per query head in each row's
softmax denominator); an undeclared feature is never passed.

q ``[B, Nh, Tq, Dh]``, k ``[B, Nkv, Tk, Dh]``, v ``[B, Nkv, Tk, Dv]``; query head h uses kv
head ``h // (Nh // Nkv)``; ``allow_mask`` is bool, broadcastable to ``[B, Nh, Tq, Tk]``,
True = may attend; ``is_causal`` is bottom-right aligned (query i may use key j iff
``j <= i + (Tk - Tq)``); both together mean a key must be allowed by both; ``scale`` None
means ``1/sqrt(Dh)``; the result is ``[B, Nh, Tq, Dv]``.

Cases, their ids and tiers live in :mod:`attn_ledger.probes.kernel.cases`; what a kernel declares it
supports in :mod:`attn_ledger.probes.kernel.spec`; the streamed references in
:mod:`attn_ledger.probes.kernel.reference`; the backward checks in :mod:`attn_ledger.probes.kernel.grad`.

Only what is visible from outside is checked, at the levels of the ledger:

* L1 ``call`` (the function returns on a legal case), ``shape``, ``dtype``, ``inputs_unchanged``
  (no call changes the tensors it is given), ``grad_call``;
* L2 ``batch_isolation``, ``kv_head_isolation``, ``q_head_isolation``: perturb one batch
  element, one kv head or one query head's q; only the outputs that should move do;
* L3 ``finite``, ``convex_range`` (each output row lies inside the per-coordinate range of
  the value rows it may mix), ``forbidden_keys`` (perturbing a forbidden key's k and v
  moves nothing), ``empty_rows`` (a query whose every key is blocked follows the stated
  contract: zeros, NaN, any finite row, or anything), ``grad_finite``, ``grad_blocked_keys``;
* L4 ``reference`` (agreement with a float64 reference), ``reference_grad_mode`` (the output with
  grad enabled, judged the same way), ``precision`` (float64 cases: the
  float64 level, a warning where the kernel reaches only the float32 level),
  ``causal_intervention`` (changing the future moves no past output, and does move a later
  one), ``grad_q``, ``grad_k``, ``grad_v``.

Tolerance rule (:func:`~attn_ledger.probes.kernel.reference.tolerance`): the kernel's largest error against
the float64 reference may be at most ``FACTOR`` times the error of the plain same-dtype
computation, plus a floor per dtype scaled by the largest value magnitude; never infinite or
NaN. A float64 case's ``reference`` bound is the float32 level (the same rule with the plain
float32 computation); ``precision`` holds it to the float64 level, as a warning unless
``strict_precision``. Every measured check carries its bound as ``limit``, the measured number
as ``value`` and the first (or worst) row past it as ``location``.

:func:`check_kernel` returns a :class:`~attn_ledger.report.Report` with one row per case, smallest
first; its first finding is the smallest failing case's first failing check, and its details
carry each distinct failure once with its count and smallest case, and the lines that reproduce
the smallest one. :func:`check_case` returns one case's checks.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from attn_ledger.devices import reference_dtype, resolve_device, torch_dtype
from attn_ledger.errors import InputError, SetupError, first_line
from attn_ledger.guard import UserCodeError, rebuilt_exception
from attn_ledger.probes.kernel.cases import (  # noqa: F401  (re-exported: the public names of check's cases)
    DEFAULT_TIER,
    DTYPES,
    FLOAT16_MAX,
    FULL_TIER,
    GRID,
    INPUTS,
    TIERS,
    Case,
    GridCase,
    case_inputs,
    case_crc,
    parse_case,
    select_cases,
    tier_cases,
)
from attn_ledger.probes.kernel.grad import GradJudging, GradRun, backward_checks, grad_run, not_run
from attn_ledger.probes.kernel.reference import (  # noqa: F401  (FACTOR re-exported)
    FACTOR,
    first_row,
    max_over,
    plain,
    plain_error,
    plain_variants,
    row_diff,
    suites_view,
    tolerance,
)
from attn_ledger.probes.kernel.spec import ADAPTERS, Declaration, check_signature, missing_from_error
from attn_ledger.report import Check, Finding, Hint, Note, Report, Row, Status, bounded, counted, find_check, row_status, unjudged
from attn_ledger.seeding import generator
from attn_ledger.tolerance import EPS, HALF_PRECISION_RATIO, is_half, tiny

if TYPE_CHECKING:
    import torch
    from torch import Tensor

DEFAULT_GRID: tuple[Case, ...] = DEFAULT_TIER
"""The default tier's cases (kept under its old name)."""

EMPTY_ROWS = ("zeros", "nan", "finite", "any")
DEVICES = ("cpu", "cuda", "mps", "auto")
PRECISION_WARNING = "computes at float32 precision in float64"
HALF_PRECISION_WARNING = "is less precise than a float32-accumulating computation in its dtype"

CHECK_ORDER = (
    (1, "call"), (1, "shape"), (1, "dtype"), (1, "inputs_unchanged"), (1, "grad_call"),
    (2, "batch_isolation"), (2, "kv_head_isolation"), (2, "q_head_isolation"),
    (3, "finite"), (3, "convex_range"), (3, "forbidden_keys"), (3, "empty_rows"), (3, "grad_finite"),
    (3, "grad_blocked_keys"),
    (4, "reference"), (4, "reference_grad_mode"), (4, "precision"), (4, "causal_intervention"), (4, "grad_q"), (4, "grad_k"), (4, "grad_v"),
)
LEVEL_OF = {name: level for level, name in CHECK_ORDER}
_POSITION = {name: i for i, (_, name) in enumerate(CHECK_ORDER)}


# --- options and devices -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """How the cases are judged (beyond the case itself).

    Attributes:
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan``, ``finite`` (any
            finite row) or ``any``.
        seed: varies the random inputs and perturbations.
        backward: run the backward checks (a declaration without backward turns them off too).
        strict_precision: a float64 case at float32 precision fails instead of warning.
        device: ``cpu``, ``cuda`` (or ``cuda:N``), ``mps`` or ``auto``.
        strict_coverage: a case with no evidence (:attr:`CaseResult.evidence`) fails instead of
            being counted inconclusive.
    """

    empty_rows: str = "zeros"
    seed: int = 0
    backward: bool = True
    strict_precision: bool = False
    device: str = "cpu"
    strict_coverage: bool = False

    def __post_init__(self) -> None:
        if self.empty_rows not in EMPTY_ROWS:
            raise InputError(f"empty_rows: got {self.empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InputError(f"device: got {self.device!r}, expected one of {', '.join(DEVICES)}")


def dtype_supported(dtype_name: str, device: "torch.device") -> bool:
    """Whether this torch build runs matmul and softmax in ``dtype_name`` on ``device``."""
    import torch

    try:
        x = torch.ones(1, 2, 2, dtype=torch_dtype(dtype_name), device=device)
        torch.softmax(x @ x, dim=-1)
        return True
    except (RuntimeError, TypeError):
        return False


def half_supported(dtype_name: str) -> bool:
    """Whether this torch build runs matmul and softmax in ``dtype_name`` on the CPU."""
    import torch

    return dtype_supported(dtype_name, torch.device("cpu"))


# --- results and the report ------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """Every check on one case, in :data:`CHECK_ORDER`, and the tolerance the output was judged with."""

    case: Case
    checks: tuple[Check, ...]
    tolerance: float | None = None

    @property
    def first_failure(self) -> Check | None:
        failing = [c for c in self.checks if c.failed]
        return min(failing, key=lambda c: c.level) if failing else None

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    @property
    def warned(self) -> bool:
        return any(c.status == "warn" for c in self.checks)

    @property
    def evidence(self) -> bool:
        """Whether a check past L1 judged the case (``pass``, ``warn`` or ``fail``).

        L1's ``call``, ``shape``, ``dtype`` and ``grad_call`` pass for any function that returns
        a tensor of the right shape and dtype (``q.new_zeros(...)`` does), so they show nothing
        about the values; a case whose every later check is inconclusive, skipped or not
        applicable has shown nothing either way.
        """
        return any(c.level > 1 and c.judged for c in self.checks)

    @property
    def inconclusive(self) -> bool:
        """No check failed, and nothing past L1 judged the case: counted inconclusive, never passed."""
        return self.passed and not self.evidence and _stopped_by(self) is None

    @property
    def status(self) -> Status:
        """The case's verdict: ``fail``, ``warn``, ``inconclusive`` (no evidence) or ``pass``.

        A case that passes on some evidence stays a pass where one of its probes is inconclusive.
        """
        if not self.passed:
            return "fail"
        if self.warned:
            return "warn"
        return "inconclusive" if self.inconclusive else "pass"

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)


EVIDENCE = "evidence"
"""The case-level check (L4) that :func:`with_evidence` adds to a case with no evidence."""


def with_evidence(result: CaseResult, strict: bool = False) -> CaseResult:
    """``result``, with an L4 ``evidence`` check where no check failed and none past L1 judged it:
    ``inconclusive``, or ``fail`` when ``strict`` (``--strict-coverage``). Other cases come back as
    they are. :func:`kernel_report` adds it as it assembles the report, so a worker's case results
    come back without it and the tool's own process judges it."""
    if not result.inconclusive or any(c.name == EVIDENCE for c in result.checks):
        return result
    unjudged_past_l1 = sorted({c.status for c in result.checks if c.level > 1})
    check = Check(4, EVIDENCE, "fail" if strict else "inconclusive", "checks past L1 that judged the case", 0, 1, ">=",
                  reason="every check past L1 is inconclusive, skipped or not applicable, so nothing shows the "
                         "output is right" + ("" if strict else "; --strict-coverage makes it a failure"),
                  data={"statuses": unjudged_past_l1})
    return replace(result, checks=(*result.checks, check))


def smallest_failing(results: Iterable[CaseResult]) -> CaseResult | None:
    """The failing case with the fewest input elements (ties: lowest first level, then id)."""
    failing = [r for r in results if not r.passed]
    if not failing:
        return None
    return min(failing, key=lambda r: (r.case.size, r.first_failure.level, r.case.id))  # type: ignore[union-attr]


def reproduction_data(case: Case, target: str, *, options: Options | None = None,
                      declaration: Declaration | None = None, empty_rows: str | None = None,
                      seed: int | None = None) -> dict[str, Any]:
    """What reruns one case of ``attn-ledger check TARGET``, as data: the target, the case, the options
    that differ from the defaults, the seed and device, the keywords the declaration drops, and the call.
    :func:`attn_ledger.render.notes.cli_line` and :func:`~attn_ledger.render.notes.python_lines` write it."""
    o = options or Options()
    o = replace(o, empty_rows=empty_rows or o.empty_rows, seed=o.seed if seed is None else seed)
    d = declaration or Declaration()
    opts: list[str] = []
    if o.seed:
        opts += ["--seed", str(o.seed)]
    if o.empty_rows != "zeros":
        opts += ["--empty-rows", o.empty_rows]
    if d.masks != Declaration().masks:
        opts += ["--masks", ",".join(d.masks)]
    if d.supports:
        opts += ["--supports", ",".join(d.supports)]
    if not (o.backward and d.backward):
        opts.append("--no-backward")
    if o.strict_precision:
        opts.append("--strict-precision")
    if o.strict_coverage:
        opts.append("--strict-coverage")
    if o.device != "cpu":
        opts += ["--device", o.device]
    name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    return {"case": case.id, "target": target, "options": opts, "seed": o.seed, "device": o.device,
            "dropped": [k for k in ("allow_mask", "is_causal") if k not in d.protocol_keywords()],
            "function": name, "call": case.call_text(name)}


def reproduction(case: Case, target: str, *, options: Options | None = None,
                 declaration: Declaration | None = None, empty_rows: str | None = None,
                 seed: int | None = None) -> tuple[str, tuple[str, ...]]:
    """The CLI line and the Python lines that rerun one case of ``attn-ledger check TARGET``.

    The CLI line is quoted for a shell (``shlex.quote``): pasted, it runs attn-ledger on that
    target and nothing else, whatever the target's path holds (``$(...)``, spaces, a newline).
    """
    from attn_ledger.render.notes import cli_line, python_lines

    data = reproduction_data(case, target, options=options, declaration=declaration, empty_rows=empty_rows, seed=seed)
    return cli_line(data), tuple(python_lines(data))


def _decode_text(decode: dict[str, Any]) -> str:
    """The index-decode facts of a check's ``data`` as the line a reader needs."""
    may = decode["may_mix"]
    keys = f"keys {may['keys'][0]}..{may['keys'][1]}" if may["keys"] else "no key"
    allowed = f"example {may['example']}, kv head {may['kv_head']}, {keys}"
    src = decode["source"]
    if src is None:
        return f"index decode: the row lies outside every value row's range; it may mix only {allowed}"
    return (f"index decode: the row reads as a mix from example {src['example']}, kv head {src['kv_head']}, "
            f"near key {src['key']:.1f}; it may mix only {allowed}")


def _case_row(result: CaseResult) -> Row:
    """One case as a report row: its checks, its size, and where index inputs tell it, the source of a wrong row."""
    stopped = _stopped_by(result)
    if stopped is not None:
        return Row(result.case.id, "not_reached", result.checks, fields={"elements": result.case.size},
                   note=stopped.reason)
    first = result.first_failure
    note = _decode_text(first.data["index_decode"]) if first is not None and "index_decode" in first.data else ""
    return Row(result.case.id, result.status, result.checks, fields={"elements": result.case.size}, note=note)


def _cases(n: int) -> str:
    return f"{n} case" if n == 1 else f"{n} cases"


def _groups(results: Sequence[CaseResult], status: str) -> list[dict[str, Any]]:
    """Cases grouped by their first check with ``status``: each group once, with its count and smallest case."""
    groups: dict[tuple[int, str], list[CaseResult]] = {}
    for r in results:
        hits = [c for c in r.checks if c.status == status]
        if hits:
            c = min(hits, key=lambda c: (c.level, _POSITION.get(c.name, 99)))
            groups.setdefault((c.level, c.name), []).append(r)
    out = []
    for (level, name), rs in groups.items():
        small = min(rs, key=lambda r: (r.case.size, r.case.id))
        out.append({"level": level, "check": name, "cases": len(rs), "smallest_case": small.case.id})
    return sorted(out, key=lambda g: (g["level"], _POSITION.get(g["check"], 99), g["smallest_case"]))


@dataclass(frozen=True)
class Plan:
    """The cases to run, and those left out with why (counted per reason)."""

    cases: tuple[Case, ...]
    skipped: dict[str, int]  # reason -> count
    notes: tuple[str, ...] = ()
    device: str = ""  # where the cases run, resolved (``auto`` made definite)
    reference_dtype: str = "float64"

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def _report_notes(results: Sequence[CaseResult], failing: Sequence[CaseResult], small: CaseResult | None,
                  failures: list[dict[str, Any]], warnings: list[dict[str, Any]], inconclusive: Sequence[CaseResult],
                  plan: Plan, target: str, o: Options, d: Declaration) -> tuple[list[str | Note], dict[str, Any] | None]:
    """The lines under the table (skips, warnings, each distinct failure, the reproduction), and the
    reproduction of the smallest failing case as data."""
    notes: list[str | Note] = list(plan.notes)
    if plan.skipped:
        why = ", ".join(f"{n} for {reason}" for reason, n in plan.skipped.items())
        notes.append(f"{_cases(plan.skipped_total)} skipped: outside the declaration ({why})")
    for g in warnings:
        if g["check"] == "precision":
            notes += _precision_notes(results)
            continue
        what = f"warn{'s' if g['cases'] == 1 else ''} at L{g['level']} {g['check']}"
        notes.append(f"{_cases(g['cases'])} {what} (warning; smallest {g['smallest_case']})")
    unreached = [r for r in results if _stopped_by(r) is not None]
    if unreached:
        notes.append(f"{len(unreached)} of {_cases(len(results))} not reached: "
                     f"{_stopped_by(unreached[0]).reason.removeprefix('not reached: ')}")  # type: ignore[union-attr]
    if inconclusive:  # smallest first
        it = "it" if len(inconclusive) == 1 else "them"
        notes.append(f"{_cases(len(inconclusive))} inconclusive: no check past L1 judged {it} (warning; smallest "
                     f"{inconclusive[0].case.id}); --strict-coverage makes {it} a failure")
    if small is None:
        passed = len(results) - len(inconclusive)
        if not inconclusive:
            notes.append("the case passes" if len(results) == 1 else f"all {len(results)} cases pass")
        else:
            notes.append(f"{passed} of {_cases(len(results))} pass{'es' if passed == 1 else ''}; "
                         f"{len(inconclusive)} inconclusive")
        return notes, None
    repro = reproduction_data(small.case, target, options=o, declaration=d)
    notes.append(Note("cases_failed", {"failed": len(failing), "cases": len(results)}))
    notes += [Note("fails_first", g) for g in failures]
    notes.append(Note("reproduce", repro))  # its call, then the CLI and Python lines, written by the renderers
    return notes, repro


def _precision_notes(results: Sequence[CaseResult]) -> list[str]:
    """One line for the float64 cases at float32 precision, one for the half-precision cases past the bar."""
    notes = []
    for kind, what in (("f64", PRECISION_WARNING), ("half", HALF_PRECISION_WARNING)):
        warned = [r for r in results if (r.case.dtype == "f64") == (kind == "f64")
                  and any(c.name == "precision" and c.status == "warn" for c in r.checks)]
        if not warned:
            continue
        small = min(warned, key=lambda r: r.case.size)
        if len(warned) > 1:
            what = what.replace("computes", "compute", 1).removeprefix("is ")
            what = what if what.startswith("compute") else f"are {what}"
        notes.append(f"{_cases(len(warned))} {what} (warning; smallest {small.case.id}); "
                     "--strict-precision makes it a failure")
    return notes


def kernel_report(
    results: Sequence[CaseResult], *, target: str, options: Options | None = None,
    declaration: Declaration | None = None, plan: Plan | None = None, tier: str | None = "default",
    empty_rows: str | None = None, seed: int | None = None, skipped: Sequence[str] = (),
) -> Report:
    """The report of ``attn-ledger check`` on a kernel-protocol function: one row per case, smallest first.

    The first finding is the smallest failing case's first failing check; ``details`` holds the
    counts, each distinct failure (and warning) once with its count and smallest case, the cases
    skipped and why, and the reproduction of the smallest failing case, which the notes repeat.
    Where the run stopped early (:func:`not_reached_case`), ``details["stopped"]`` says why.
    A case with no evidence past L1 gets an ``evidence`` check (:func:`with_evidence`): it is
    counted in ``cases_inconclusive``, or fails under ``options.strict_coverage``.
    """
    o = options or Options()
    o = replace(o, empty_rows=empty_rows or o.empty_rows, seed=o.seed if seed is None else seed)
    d = declaration or Declaration()
    plan = plan or Plan(tuple(r.case for r in results), {}, tuple(skipped))
    results = [with_evidence(r, o.strict_coverage) for r in results]
    ordered = sorted(results, key=lambda r: (r.case.size, r.case.id))
    failing = [r for r in ordered if not r.passed]
    small = smallest_failing(results)
    failures, warnings = _groups(ordered, "fail"), _groups(ordered, "warn")
    stopped = [(r.case.id, c) for r in results if (c := _stopped_by(r)) is not None]  # in the order run
    inconclusive = [r for r in ordered if r.inconclusive]
    notes, repro = _report_notes(results, failing, small, failures, warnings, inconclusive, plan, target, o, d)
    levels = [r.first_failure.level for r in failing]  # type: ignore[union-attr]
    details = {
        "target": target, "protocol": "kernel", "tier": tier, "empty_rows": o.empty_rows, "seed": o.seed,
        "device": plan.device or o.device, "reference_dtype": plan.reference_dtype,
        "backward": o.backward and d.backward, "strict_precision": o.strict_precision, "declaration": d.to_json(),
        "strict_coverage": o.strict_coverage,
        "cases_total": len(results), "cases_failed": len(failing), "cases_warned": sum(r.warned for r in results),
        "cases_inconclusive": len(inconclusive),
        "smallest_inconclusive": inconclusive[0].case.id if inconclusive else None,
        "cases_skipped": plan.skipped_total, "skipped_by_declaration": dict(plan.skipped),
        "first_level": min(levels) if levels else None, "failures": failures, "warnings": warnings,
        "skipped": list(plan.notes), "reproduce": repro,
        "cases_not_reached": len(stopped), "stopped": {"reason": stopped[0][1].reason, **stopped[0][1].data} if stopped else None,
    }
    return Report(
        hints=_alignment_hints(ordered, failing),
        command="check",
        title=f"check {target} (kernel protocol, {tier or 'named'} cases, empty rows: {o.empty_rows})",
        rows=tuple(_case_row(r) for r in ordered),
        first_finding=None if small is None else Finding(small.case.id, small.first_failure),  # type: ignore[arg-type]
        notes=tuple(notes),
        details=details,
        unit="row",
        row_label="case",
        show_passing=False,
        fold_rows=True,
    )


def _alignment_hints(ordered: Sequence[CaseResult], failing: Sequence[CaseResult]) -> tuple[Hint, ...]:
    """The ``alignment`` hint: every failing case is causal with Tq != Tk, some causal case with Tq == Tk passes,
    and the smallest failing case's output matches top-left causal attention within its reference bound."""
    if not failing or not all(r.case.causal and r.case.tq != r.case.tk for r in failing):
        return ()
    square = [r for r in ordered if r.case.causal and r.case.tq == r.case.tk and r.passed]
    if not square:
        return ()
    for r in failing:
        found = next((c.data.get("top_left") for c in r.checks if c.name == "reference"), None)
        if found is not None:
            if not found["matches"]:
                return ()
            return (Hint("alignment", {"found": "top-left", "expected": "bottom-right", "case": r.case.id,
                                       "failing": len(failing), "passing": len(square), "value": found["error"],
                                       "limit": found["limit"]}),)
    return ()


def with_call_notes(report: Report, results: Sequence[CaseResult], state: dict[str, Any]) -> Report:
    """The report, saying first what the calls did besides returning: a tensor subclass returned (and
    judged as a plain tensor), and torch's global state changed by the import or a call (flags, and
    callables replaced since before the import; see :func:`attn_ledger.probes.common.driver.state_changes`)."""
    notes: list[str] = []
    details: dict[str, Any] = {}
    types = [r.check("call").data.get("returned_subclass") for r in results]
    named = sorted({t for t in types if t})
    if named:
        n = sum(1 for t in types if t)
        notes.append(f"{_cases(n)} returned a tensor subclass ({', '.join(named)}); "
                     "it was judged as a plain tensor")
        details["returned_subclass"] = {"cases": n, "types": named}
    if state:
        parts = [f"{flag} {before} -> {after}" for flag, (before, after) in state.get("flags", {}).items()]
        replaced = list(state.get("replaced", ()))
        if replaced:
            more = f" and {len(replaced) - 6} more" if len(replaced) > 6 else ""
            parts.append(f"replaced {', '.join(replaced[:6])}{more} (since before the import)")
        notes.append("your code changed torch's global state: " + "; ".join(parts))
        details["global_state"] = state
    if not notes:
        return report
    return replace(report, notes=(*notes, *report.notes), details={**report.details, **details})


# --- calling the user's function -------------------------------------------------------------


class _Kernel:
    """Calls the user's function through the driver (:mod:`attn_ledger.probes.common.driver`) and reads what came back.

    ``fn`` is the user's function (called here, through a :class:`~attn_ledger.probes.common.driver.LocalKernel`) or a
    :class:`~attn_ledger.probes.common.driver.KernelTarget` that calls it elsewhere (a worker). Either way the driver
    calls it on copies of the inputs and returns raw tensors and facts; everything judged from them is
    judged here. Each call is one :func:`~attn_ledger.guard.user_call`, named by the case's call text
    and the probe it serves. A value that is not a dense tensor with values (not a tensor, sparse,
    on the meta device, an unreadable wrapper subclass) is a :class:`~attn_ledger.guard.UserCodeError`,
    as a crash would be: no check can read it. The inputs each call left behind are compared with the
    ones it was given (:attr:`changed`); a tensor subclass it returned is named in :attr:`subclass`.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], call_text: str) -> None:
        from attn_ledger.probes.common.driver import KernelTarget, LocalKernel

        self.target = fn if isinstance(fn, KernelTarget) else LocalKernel(fn)
        self.kwargs, self.call_text = kwargs, call_text
        self.changed: dict[str, list[str]] = {}  # the call -> the inputs it changed in place
        self.subclass: str | None = None

    def __call__(self, q: "Tensor", k: "Tensor", v: "Tensor", probe: str | None = None) -> "Tensor":
        what = self.call_text if probe is None else f"{self.call_text} for the {probe} probe"
        called = self.target.forward(q, k, v, self.kwargs, what, watch=probe is None)
        return self._read(called, what, (q, k, v))  # type: ignore[return-value]

    def grad_mode(self, q: "Tensor", k: "Tensor", v: "Tensor") -> "Tensor":
        """The call with grad enabled on inputs that do not require grad (the backward checks are off)."""
        what = f"{self.call_text} with grad enabled"
        called = self.target.forward(q, k, v, self.kwargs, what, grad_mode=True, watch=True)
        return self._read(called, what, (q, k, v))  # type: ignore[return-value]

    def with_grad(self, q: "Tensor", k: "Tensor", v: "Tensor", d_out: "Tensor",
                  ref_dtype: "torch.dtype") -> tuple["Tensor | None", GradRun]:
        """The call with grad enabled on inputs that require grad, and its backward pass against ``d_out``:
        the output (None where the call raised) and what the backward gave."""
        what = f"{self.call_text} with inputs that require grad"
        called = self.target.with_grad(q, k, v, self.kwargs, d_out, self.call_text, watch=True)
        grad = called.facts.get("grad", {})
        out = self._read(called, what, (q, k, v), raised_ok="raised" in grad)
        return out, grad_run(grad, called.tensors, (q, k, v), d_out, ref_dtype)

    def _read(self, called: Any, what: str, sent: tuple["Tensor", "Tensor", "Tensor"],
              raised_ok: bool = False) -> "Tensor | None":
        error = called.facts.get("error")
        if error is not None:
            if error["kind"] == "raised":
                raise rebuilt_exception(error)
            raise UserCodeError(error["text"], error.get("what") or what, **error.get("data", {}))
        if called.facts.get("subclass") and self.subclass is None:
            self.subclass = called.facts["subclass"]
        changed = changed_inputs(called.tensors, sent, self.kwargs.get("allow_mask"), self.kwargs.get("sinks"))
        if changed:
            self.changed.setdefault(what, changed)
        if raised_ok and "out" not in called.tensors:
            return None
        return called.tensors["out"].to(sent[0].device)


def changed_inputs(after: dict[str, "Tensor"], sent: tuple["Tensor", "Tensor", "Tensor"],
                   mask: "Tensor | None", sinks: "Tensor | None" = None) -> list[str]:
    """The inputs whose copies a call left different from what it was given (NaN equals NaN)."""
    import torch

    given = dict(zip(("q", "k", "v"), sent))
    if mask is not None:
        given["allow_mask"] = mask
    if sinks is not None:
        given["sinks"] = sinks
    changed = []
    for name, before in given.items():
        got = after.get(name)
        if got is None:
            continue
        got = got.to(before.device)
        same = got.shape == before.shape and got.dtype == before.dtype
        if same and before.numel():
            eq = got == before
            if before.is_floating_point():
                eq = eq | (torch.isnan(got) & torch.isnan(before))
            same = bool(eq.all())
        if not same:
            changed.append(name)
    return changed


def returned_problem(out: Any) -> tuple[str, dict[str, Any]] | None:
    """Why a kernel's return value cannot be checked, as a phrase and as values, or None.

    Example: ``("returned list, expected a Tensor [B, Nh, Tq, Dv]", {"returned": "list"})``.
    """
    from attn_ledger.probes.common.driver import plain_output

    problem = plain_output(out)[1].get("error")
    return None if problem is None else (problem["text"], problem["data"])


def failed_call(case: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    """A case whose call did not come back with a result: L1 ``call`` fails, nothing after it is reached.

    Args:
        reason: the call and how it ended (``attention(q, k, v) timed out after 2 s``).
        data: the same as values (``{"call": ..., "timeout_s": 2.0}``).
    """
    called = Check(1, "call", "fail", reason=reason, data=data)
    rest = [unjudged(level, name, "not_reached", "the call did not return a result") for level, name in CHECK_ORDER[1:]]
    return CaseResult(case, (called, *rest))


def not_reached_case(case: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    """A case the check never ran, having stopped early: every check ``not_reached``, the L1 call with why.

    Args:
        reason: why the run stopped (``not reached: 3 cases in a row timed out (--max-timeouts 3)``).
        data: the same as values (``{"stopped_by": "max_timeouts", "max_timeouts": 3}``).
    """
    called = Check(1, "call", "not_reached", reason=reason, data=data)
    return CaseResult(case, (called, *(unjudged(level, name, "not_reached", reason) for level, name in CHECK_ORDER[1:])))


def _stopped_by(result: CaseResult) -> Check | None:
    """The call check of a case that was never run (:func:`not_reached_case`), else None."""
    call = next((c for c in result.checks if c.name == "call"), None)
    return call if call is not None and call.status == "not_reached" and "stopped_by" in call.data else None


def _raised(level: int, name: str, exc: BaseException, where: str, data: dict[str, Any] | None = None) -> Check:
    """A failing check for a call of the user's function that raised."""
    message = first_line(exc)
    return Check(level, name, "fail", reason=f"{where} raised {type(exc).__name__}: {message}",
                 data={**(data or {}), "exception": type(exc).__name__, "message": message})


# --- one case ----------------------------------------------------------------------------------


@dataclass
class _Setup:
    """What the checks of one case read: inputs, the kernel's output, the relation and the tolerance."""

    case: Case
    kernel: _Kernel
    q: "Tensor"  # [B, Nh, Tq, Dh] case dtype
    k: "Tensor"  # [B, Nkv, Tk, Dh]
    v: "Tensor"  # [B, Nkv, Tk, Dv]
    out: "Tensor"  # [B, Nh, Tq, Dv] reference dtype
    allow: "Tensor | None"  # [B|1, 1, Tq|1, Tk] True = may attend (allow_mask and is_causal together)
    counts: "Tensor"  # [B, Nh, Tq] allowed keys per row
    gen: "torch.Generator"
    ref_dtype: "torch.dtype"
    qk_scale: float
    tol: float = 0.0  # the bound a row may move by where it must stay
    noise: float = 0.0  # the dtype's floor: a move below ten times this is no move at all
    judge_empty: bool = True  # probes judge rows with no allowed key (the zeros contract); else they hold anything
    sinks: "Tensor | None" = None  # [Nh] the sinks argument, where the case passes one

    @property
    def features(self) -> dict[str, Any]:
        """The soft-cap and sinks the references apply (the window is in ``allow``)."""
        return {"softcap": self.case.softcap, "sinks": self.sinks}

    @property
    def empty(self) -> "Tensor":
        return self.counts == 0  # [B, Nh, Tq]: every key blocked

    @property
    def live(self) -> "Tensor":
        return self.counts > 0  # [B, Nh, Tq]

    def fresh(self, t: "Tensor", scale: float) -> "Tensor":
        """New random values of ``t``'s shape and dtype (drawn on the CPU, then moved)."""
        import torch

        return (torch.randn(t.shape, generator=self.gen, dtype=torch.float64) * scale).to(t.device, t.dtype)

    def ref(self, t: "Tensor") -> "Tensor":
        return t.detach().to(device=self.q.device, dtype=self.ref_dtype)


SMALL_WORK = 1 << 27
"""A case with fewer multiply-adds per attention call (B * Nh * Tq * Tk * (Dh + Dv)) runs single-threaded."""


@contextlib.contextmanager
def _threads_for(case: Case) -> Any:
    """One intra-op thread for a small case: on tensors this size, waking threads costs more than it
    saves (several times over on a busy machine); a large case keeps torch's setting."""
    import torch

    work = case.b * case.nh * case.tq * case.tk * (case.dh + case.dv)
    before = torch.get_num_threads()
    if work >= SMALL_WORK or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_case(fn: Callable[..., Any], case: Case, *, empty_rows: str = "zeros", seed: int = 0,
               backward: bool = True, strict_precision: bool = False, device: str = "cpu",
               declaration: Declaration | None = None, options: Options | None = None) -> CaseResult:
    """Run every check on one case. Never raises for the user's mistakes; they become checks.

    A call that exits, runs past its time limit or returns something no check can read (in
    any of the case's calls, probes and the backward included) is the case's L1 ``call`` finding.
    """
    o = options or Options(empty_rows, seed, backward, strict_precision, device)
    d = declaration or Declaration()
    try:
        with _threads_for(case):
            return _check_case(fn, case, o, d)
    except UserCodeError as exc:
        return failed_call(case, f"{exc.what or case.call_text()} {exc}", exc.facts())


def _check_case(fn: Callable[..., Any], case: Case, o: Options, d: Declaration) -> CaseResult:
    dev = resolve_device(o.device)
    ref_dtype = reference_dtype(dev)
    q, k, v, kwargs = case_inputs(case, o.seed, dev)
    kw = d.keywords(kwargs)
    kernel = _Kernel(fn, kw, case.call_text())
    first, raw = _first_call(kernel, case, q, k, v)  # a UserCodeError goes up: the case's L1 call finding
    if raw is None:
        return CaseResult(case, tuple(first))
    s = _setup(case, kernel, q, k, v, raw, kwargs, o, ref_dtype)
    grad_run, d_out, grad_out, grad_exc = None, None, None, None
    if o.backward and d.backward:
        d_out = s.fresh(raw, 1.0).to(ref_dtype)  # [B, Nh, Tq, Dv]
        grad_out, grad_run = kernel.with_grad(q, k, v, d_out, ref_dtype)
    else:
        try:
            grad_out = kernel.grad_mode(q, k, v)
        except UserCodeError:
            raise
        except Exception as exc:  # the user's code: a finding of the grad-mode check
            grad_exc = exc
    with_grads = grad_run is not None and grad_run.status == "ok"
    refs = _references(s, d_out if with_grads else None)
    checks = first + _forward_checks(s, refs, o)
    checks += [_grad_mode_check(s, refs, grad_out, grad_exc, grad_run), _inputs_check(kernel)]
    precision_parts = {"out": refs["out_precision"]} if refs["out_precision"] else {}
    if grad_run is None:
        checks += not_run("skipped", "backward checks are off (--no-backward or the declaration)")
    else:
        grad_checks, parts = backward_checks(grad_run, _grad_judging(s, refs, o))
        checks += grad_checks
        precision_parts.update(parts)
    checks.append(_precision_check(case, precision_parts, o.strict_precision))
    checks = _overflow_annotated(case, refs["ref"].raw_max, checks)
    return CaseResult(case, tuple(sorted(checks, key=lambda c: _POSITION[c.name])), s.tol)


def _first_call(kernel: _Kernel, case: Case, q: "Tensor", k: "Tensor", v: "Tensor") -> tuple[list[Check], "Tensor | None"]:
    """L1: the call returns, with the right shape and dtype; the output, or None when nothing further can run."""
    try:
        raw = kernel(q, k, v)
    except UserCodeError:
        raise
    except Exception as exc:
        called = _raised(1, "call", exc, case.call_text())
        rest = [unjudged(level, name, "not_reached", "the call raised") for level, name in CHECK_ORDER[1:]]
        return [called, *rest], None
    want = [case.b, case.nh, case.tq, case.dv]
    shape_ok = list(raw.shape) == want
    got_dtype = str(raw.dtype).removeprefix("torch.")
    dtype_ok = raw.dtype == q.dtype
    checks = [
        Check(1, "call", "pass", data={"returned_subclass": kernel.subclass} if kernel.subclass else {}),
        Check(1, "shape", "pass" if shape_ok else "fail", data={"expected": want, "got": list(raw.shape)},
              reason="" if shape_ok else f"output {list(raw.shape)}, expected [B, Nh, Tq, Dv] = {want}"),
        Check(1, "dtype", "pass" if dtype_ok else "fail", data={"expected": case.dtype_name, "got": got_dtype},
              reason="" if dtype_ok else f"output {got_dtype}, expected {case.dtype_name} (the inputs' dtype)"),
    ]
    if not shape_ok:
        rest = [unjudged(level, name, "not_reached", "wrong output shape") for level, name in CHECK_ORDER[3:]]
        return checks + rest, None
    return checks, raw


def _setup(case: Case, kernel: _Kernel, q: "Tensor", k: "Tensor", v: "Tensor", raw: "Tensor",
           kwargs: dict[str, Any], o: Options, ref_dtype: "torch.dtype") -> _Setup:
    import torch

    from attn_ledger.maths.reference import combined_allow
    from attn_ledger.probes.kernel.cases import window_allow

    allow = combined_allow(case.b, 1, case.tq, case.tk, kwargs["allow_mask"], kwargs["is_causal"], device=q.device)
    if case.window is not None:
        win = window_allow(case.tq, case.tk, case.window, device=q.device)  # [Tq, Tk]
        allow = win if allow is None else allow & win
    if allow is not None:
        while allow.dim() < 4:
            allow = allow[None]
        counts = allow.sum(dim=-1).expand(case.b, case.nh, case.tq)  # [B, Nh, Tq]
    else:
        counts = torch.full((case.b, case.nh, case.tq), case.tk, device=q.device)
    gen = generator(case_crc(case) + 7919 * (o.seed + 1))  # the perturbations' own stream
    qk_scale = max(float(q.double().std()) if q.numel() > 1 else 1.0, float(k.double().std()) if k.numel() > 1 else 1.0)
    out = raw.detach().to(device=q.device, dtype=ref_dtype)
    return _Setup(case, kernel, q, k, v, out, allow, counts, gen, ref_dtype, qk_scale if qk_scale > 0 else 1.0,
                  judge_empty=o.empty_rows == "zeros", sinks=kwargs.get("sinks"))


_SHARED: "dict[tuple[str, bool], tuple[tuple[Tensor, ...], dict[str, Any]]] | None" = None


@contextlib.contextmanager
def shared_references() -> Any:
    """Within it, each case's kernel-free references (:func:`_kernel_free`) are computed once and reused by
    every kernel checked on the same inputs: ``scripts/corpus.py`` judges the whole corpus of trusted
    fixtures against one set per (case, seed). A reuse is taken only where q, k, v, the mask and the
    upstream gradient are bitwise the inputs it was computed on; everything that depends on the
    kernel's output is computed afresh, so the checks and bounds are those of a lone ``check``."""
    global _SHARED
    before, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = before


def _kernel_free(s: _Setup, d_out: "Tensor | None") -> dict[str, Any]:
    """What :func:`_references` needs that does not depend on the kernel: the float64 reference, the
    magnitudes, the plain computations and their error; shared under :func:`shared_references`."""
    import torch

    inputs = tuple(t for t in (s.q, s.k, s.v, s.allow, d_out) if t is not None)
    key = (s.case.id, d_out is not None)
    if _SHARED is not None and key in _SHARED:
        seen, found = _SHARED[key]
        if len(seen) == len(inputs) and all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                                            for a, b in zip(seen, inputs)):
            return found
    found = _compute_kernel_free(s, d_out)
    if _SHARED is not None:
        _SHARED[key] = (tuple(t.clone() for t in inputs), found)
    return found


def _compute_kernel_free(s: _Setup, d_out: "Tensor | None") -> dict[str, Any]:
    import torch

    from attn_ledger.probes.kernel.reference import attention, magnitudes

    case, dt = s.case, s.q.dtype
    scale = case.effective_scale
    ft = s.features
    ref = attention(s.q, s.k, s.v, s.allow, scale, compute=s.ref_dtype, d_out=d_out, **ft)
    acc = EPS["float32"] / EPS[case.dtype_name] if is_half(case.dtype_name) else 1.0  # half accumulates in float32
    sub = tiny("float32" if dt == torch.float64 else case.dtype_name)  # the smallest normal of the judged levels
    mags = magnitudes(s.q, s.k, s.v, s.allow, scale, d_out, accumulate=acc, tiny=sub, **ft)
    pl = plain_variants(s.q, s.k, s.v, s.allow, scale, dt, d_out=d_out, **ft)
    pl32 = None
    if dt == torch.float64:
        pl32 = plain(s.q, s.k, s.v, s.allow, scale, torch.float32, d_out=d_out, **ft)
    vmax = float(s.v.abs().max().double()) if s.v.numel() else 0.0
    plain_err, errors = plain_error({n: c.out for n, c in pl.items()}, ref.out, s.live)
    plain32_err = None if pl32 is None else max_over(row_diff(pl32.out.to(s.ref_dtype), ref.out), s.live)
    return {"ref": ref, "mags": mags, "plain": pl, "plain32": pl32, "vmax": vmax, "plain_err": plain_err,
            "errors": errors, "plain32_err": plain32_err}


def _references(s: _Setup, d_out: "Tensor | None") -> dict[str, Any]:
    """The float64 reference, the summands' magnitudes that bound a kernel's error (the rounding rule),
    the plain same-dtype computation (and float32's, for float64 cases) that sets the probes' tolerance,
    and the output judged; with gradients when ``d_out`` is given."""
    from attn_ledger.probes.kernel.reference import judge_rounding

    free = _kernel_free(s, d_out)
    case = s.case
    ref, mags, pl, pl32, vmax = free["ref"], free["mags"], free["plain"], free["plain32"], free["vmax"]
    plain_err, errors = free["plain_err"], free["errors"]
    s.tol = tolerance(case.dtype_name, plain_err, vmax)[0]  # the probes' bound: two runs of the kernel
    s.noise = tolerance(case.dtype_name, 0.0, vmax)[0]
    names = ("example", "head", "query")
    judged = judge_rounding(s.out, ref.out.to(s.ref_dtype), mags, "out", case.dtype_name, s.live, names)
    out_precision: dict[str, Any] = {}
    facts = {**judged.parts, **suites_view("out", judged.max_error, errors)}
    if pl32 is not None:  # float64: the reference check is held to the float32 level; precision to float64's
        at64 = judge_rounding(s.out, ref.out, mags, "out", "float64", s.live, names)
        plain32_err = free["plain32_err"]
        judged = judge_rounding(s.out, ref.out, mags, "out", "float32", s.live, names)
        out_precision = {"error": judged.max_error, "float64_ratio": at64.ratio, "float32_ratio": judged.ratio}
        facts = {**judged.parts, **suites_view("out", judged.max_error, {"float32": plain32_err}),
                 "float64": at64.parts}
        if at64.ratio <= 1.0:
            s.tol = tolerance("float64", plain_err, vmax)[0]  # probes at the level the kernel reaches
        else:
            s.tol = tolerance("float32", plain32_err, vmax)[0]
    elif is_half(case.dtype_name):
        out_precision = half_precision(s.out, {n: c.out for n, c in pl.items()}, ref.out, s.live)
    return {"ref": ref, "mags": mags, "plain": pl, "plain32": pl32, "judged": judged, "facts": facts,
            "err": judged.max_error, "out_precision": out_precision}


def _forward_checks(s: _Setup, refs: dict[str, Any], o: Options) -> list[Check]:
    checks = _isolation_checks(s)
    checks += [_finite_check(s), _convex_check(s), _forbidden_probe(s), _empty_rows_check(s, o.empty_rows)]
    checks += [_reference_check(s, refs), _causal_probe(s)]
    return checks


def _reference_check(s: _Setup, refs: dict[str, Any]) -> Check:
    """L4: the output against the reference, each element within ``c * eps * M`` (the rounding rule)."""
    j = refs["judged"]
    data: dict[str, Any] = {"tolerance": refs["facts"]}
    failed = j.ratio > 1.0
    if failed:
        data.update(_index_decode(s, j.wrong))
        aligned = _top_left(s, j.limit)
        if aligned is not None:
            data["top_left"] = aligned
    return bounded(4, "reference", "max |out - float64 reference|", j.max_error, j.limit,
                   location=first_row(j.wrong) if failed else None, data=data)


def _top_left(s: _Setup, limit: float) -> dict[str, Any] | None:
    """For a causal case with Tq != Tk and no other mask part: the output against float64 attention with the causal
    relation aligned top-left (key j <= query i), and whether it is within the reference's ``limit``."""
    import torch

    from attn_ledger.maths import masks
    from attn_ledger.probes.kernel.reference import attention

    case = s.case
    if case.tq == case.tk or case.relation.names != ("causal",):
        return None
    allow = masks.causal(case.tq, case.tk, "top-left", device=s.q.device)[None, None]  # [1, 1, Tq, Tk]
    ref = attention(s.q, s.k, s.v, allow, case.effective_scale, compute=s.ref_dtype).out  # [B, Nh, Tq, Dv]
    error = float((s.out.to(ref.dtype) - ref).abs().max())
    return {"error": error, "limit": limit, "matches": bool(error <= limit) and error == error}


def _grad_mode_check(s: _Setup, refs: dict[str, Any], out: "Tensor | None", exc: Exception | None,
                     run: GradRun | None) -> Check:
    """L4: the output of the call with grad enabled against the reference, as the no-grad output is judged.

    With the backward checks on, it is the call on inputs that require grad (the one differentiated);
    with them off, a call with grad enabled on inputs that do not. Backends take other paths under
    autograd, and a kernel may branch on ``torch.is_grad_enabled()``.
    """
    name, measure = "reference_grad_mode", "max |out with grad enabled - float64 reference|"
    if exc is not None:
        return _raised(4, name, exc, "the call with grad enabled")
    if out is None:
        why = run.reason if run is not None and run.reason else "the call with grad enabled returned no output"
        return unjudged(4, name, "not_reached", why)
    if tuple(out.shape) != tuple(s.out.shape):
        return Check(4, name, "fail", reason=f"the output with grad enabled has shape {list(out.shape)}, "
                     f"expected {list(s.out.shape)}", data={"expected": list(s.out.shape), "got": list(out.shape)})
    from attn_ledger.probes.kernel.reference import judge_rounding

    got = s.ref(out)
    level = "float32" if s.case.dtype == "f64" else s.case.dtype_name  # as the reference check is held
    j = judge_rounding(got, refs["ref"].out.to(s.ref_dtype), refs["mags"], "out", level, s.live,
                       ("example", "head", "query"))
    return bounded(4, name, measure, j.max_error, j.limit, location=first_row(j.wrong) if j.ratio > 1.0 else None,
                   data={"tolerance": j.parts, "inputs_require_grad": run is not None})


def _inputs_check(kernel: _Kernel) -> Check:
    """L1: every call left the tensors it was given (copies of the case's inputs) as they were."""
    changed = kernel.changed
    names = sorted({n for ns in changed.values() for n in ns}, key=("q", "k", "v", "allow_mask", "sinks").index)
    if not names:
        return Check(1, "inputs_unchanged", "pass")
    call, first = next(iter(changed.items()))
    return Check(1, "inputs_unchanged", "fail", reason=f"the call changed its inputs in place: {', '.join(first)} "
                 f"(in {call})", data={"changed": names, "calls": len(changed)})


def _precision_check(case: Case, parts: dict[str, dict[str, Any]], strict: bool) -> Check:
    """L4: how precise the kernel is beyond being correct.

    float64 cases: the largest error / its float64-level bound over out, dq, dk and dv (a kernel
    within float32's bound but not float64's computes at float32 precision). float16 and bfloat16
    cases: the output's error / the float32-accumulating plain computation's, against
    :data:`~attn_ledger.tolerance.HALF_PRECISION_RATIO`. Either warns, or fails with ``strict``.
    """
    if case.dtype not in ("f64", "f16", "bf16"):
        return unjudged(4, "precision", "not_applicable", "the case is float32")
    if not parts:
        return unjudged(4, "precision", "not_reached", "the output was not compared with the reference")
    if case.dtype != "f64":
        p = parts["out"]
        value, limit = p["ratio"], p["limit"]
        return bounded(4, "precision", "rms out error / the float32-accumulating plain computation's", value, limit,
                       warn_only=not strict, location={"tensor": "out"} if value > limit else None,
                       data={"out": dict(p)})
    ratios = {name: p["float64_ratio"] for name, p in parts.items()}
    worst = max(ratios, key=lambda n: ratios[n])
    value = ratios[worst]
    within32 = all(p["float32_ratio"] <= 1.0 for p in parts.values())
    check = bounded(4, "precision", "largest error / its float64-level bound (out, dq, dk, dv)", value, 1.0,
                    warn_only=not strict, location={"tensor": worst} if value > 1.0 else None,
                    data={name: dict(p) for name, p in parts.items()})
    if check.status != "pass" and within32:
        check = replace(check, reason=PRECISION_WARNING)
    return check


def half_precision(out: "Tensor", plains: dict[str, "Tensor"], ref: "Tensor", live: "Tensor") -> dict[str, Any]:
    """The half-precision bar's parts: the root-mean-square error of the kernel's output over rows with an
    allowed key, the plain computations' (float32-accumulating, scale first and product first: the larger
    counts, so that either way of writing attention is as precise as it need be), their ratio and the limit."""
    import torch

    sel = live[..., None].expand_as(ref)  # [B, Nh, Tq, Dv]

    def rms(t: "Tensor") -> float:
        d = (t.to(ref.dtype) - ref)[sel]
        return float(d.pow(2).mean().sqrt()) if d.numel() else 0.0

    errors = {name: rms(t) for name, t in plains.items()}
    finite = [e for e in errors.values() if math.isfinite(e)]
    plain_rms = max(finite) if finite else math.inf
    error = rms(out)
    ratio = error / plain_rms if plain_rms > 0 else (0.0 if error == 0 else math.inf)
    if not math.isfinite(plain_rms):
        ratio = 0.0 if math.isfinite(error) else math.inf
    return {"rms_error": error, "plain_rms_error": plain_rms, "plain_rms_errors": errors, "ratio": ratio,
            "limit": HALF_PRECISION_RATIO}


def _overflow_annotated(case: Case, raw_max: float, checks: list[Check]) -> list[Check]:
    """Where the raw product q . k leaves the dtype's range, say so on the finite, range and reference failures."""
    import torch

    limit = float(torch.finfo(torch_dtype(case.dtype_name)).max)
    if not raw_max > limit:
        return checks
    why = (f"the raw product q.k reaches {raw_max:.3g}, past {case.dtype_name}'s largest finite value {limit:g}: "
           f"a kernel that multiplies before scaling overflows")
    out = []
    for c in checks:
        if c.failed and c.name in ("finite", "convex_range", "reference"):
            c = replace(c, reason="; ".join(r for r in (c.reason, why) if r),
                        data={**c.data, "raw_product_max": raw_max, "dtype_max": limit})
        out.append(c)
    return out


def _grad_judging(s: _Setup, refs: dict[str, Any], o: Options) -> GradJudging:
    """Which slices and keys the gradients are judged on (see :mod:`attn_ledger.probes.kernel.grad`)."""
    case = s.case
    empty_slice = s.empty.any(dim=-1, keepdim=True)  # [B, Nh, 1]
    q_slices = ~empty_slice if o.empty_rows != "zeros" else empty_slice.new_ones(empty_slice.shape)
    group = case.nh // case.nkv
    kv_slices = q_slices.reshape(case.b, case.nkv, group, 1).all(dim=2)  # [B, Nkv, 1]
    if s.allow is None:
        blocked = s.live.new_zeros(case.b, 1, case.tk)
    else:
        blocked = ~s.allow.any(dim=-2).expand(case.b, 1, case.tk)  # [B, 1, Tk]: no query of the example may use it
    return GradJudging(case.dtype_name, refs["ref"], refs["plain"], refs["plain32"], s.live, q_slices, kv_slices,
                       blocked, refs["ref"].raw_max * case.effective_scale, refs["mags"])


# --- forward checks ----------------------------------------------------------------------------


def _not_applicable(name: str, why: str) -> Check:
    return unjudged(LEVEL_OF[name], name, "not_applicable", why)


def _probe(
    name: str, measure: str, s: _Setup, args: tuple["Tensor", "Tensor", "Tensor"],
    stay: "Tensor", move: "Tensor | None", perturbed: dict[str, Any],
) -> Check:
    """Run the kernel on perturbed inputs: ``stay`` outputs must not move, some ``move`` output must.

    The value is the largest move of a row in ``stay`` (rows with no allowed key left out under an
    empty-row contract other than ``zeros``), judged against the case's tolerance; ``data``
    says what was perturbed and how far the ``move`` rows moved. A probe whose ``move`` rows moved
    no more than ten times the dtype's floor is inconclusive: it proves nothing either way.
    """
    level, tol = LEVEL_OF[name], s.tol
    data: dict[str, Any] = {"perturbed": perturbed}
    if not s.judge_empty:  # a row with no allowed key may hold anything, moved or not
        stay = stay & s.live
    try:
        out = s.ref(s.kernel(*args, probe=name))
    except UserCodeError:
        raise  # an exit, a hang or an unreadable value: the case's L1 call finding, not this probe's
    except Exception as exc:  # the user's code: any exception is a finding
        return _raised(level, name, exc, "the call on perturbed inputs", data)
    if tuple(out.shape) != tuple(s.out.shape):
        return Check(level, name, "fail", reason="the output shape changed on perturbed inputs",
                     data={**data, "expected": list(s.out.shape), "got": list(out.shape)})
    per_row = row_diff(out, s.out)  # [B, Nh, Tq]
    leaked = max_over(per_row, stay)
    if leaked > tol:
        return bounded(level, name, measure, leaked, tol, location=first_row(stay & (per_row > tol)), data=data)
    if move is not None and move.any():
        data["moved"] = max_over(per_row, move)
        data["moved_min"] = max(10 * s.noise, 1e-12)
        if data["moved"] <= data["moved_min"]:
            return Check(level, name, "inconclusive", measure, leaked, tol, "<=", data=data,
                         reason="the outputs that should move did not move either, so the probe proves nothing")
    return bounded(level, name, measure, leaked, tol, data=data)


SHARPEN = (1.0, 8.0)
"""Spreads of the fresh queries and keys a probe draws, in units of the inputs' own: when inputs of
the inputs' spread move nothing (near-uniform weights over thousands of keys average the values out
below a half-precision floor), ones eight times wider concentrate each row on a few keys, so the
outputs that should move must move."""


def _sharpened_probe(name: str, measure: str, s: _Setup, perturb: Callable[[float], tuple["Tensor", "Tensor", "Tensor"]],
                     stay: "Tensor", move: "Tensor", perturbed: dict[str, Any]) -> Check:
    """:func:`_probe` with the fresh q and k ``perturb(spread)`` draws at each spread of :data:`SHARPEN`
    in turn, until the probe is conclusive (or the last spread leaves it inconclusive)."""
    for sharpen in SHARPEN:
        check = _probe(name, measure, s, perturb(s.qk_scale * sharpen), stay, move, {**perturbed, "sharpen": sharpen})
        if check.status != "inconclusive":
            break
    return check


def _isolation_checks(s: _Setup) -> list[Check]:
    """L2: perturb one example, one kv head, one query head's q; only the outputs that should move do."""
    case, q, k, v = s.case, s.q, s.k, s.v
    live = s.live
    checks = []
    if case.b >= 2:
        def one_example(spread: float) -> tuple["Tensor", "Tensor", "Tensor"]:
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[0], k2[0], v2[0] = s.fresh(q[0], spread), s.fresh(k[0], spread), s.fresh(v[0], 1.0)
            return q2, k2, v2

        stay = live.new_zeros(live.shape)
        stay[1:] = True
        checks.append(_sharpened_probe("batch_isolation", "largest move of another example's output", s, one_example,
                                       stay, live & ~stay, {"example": 0, "inputs": "q, k, v"}))
    else:
        checks.append(_not_applicable("batch_isolation", "B = 1"))
    group = case.nh // case.nkv
    if case.nkv >= 2:
        g = case.nkv - 1

        def one_kv_head(spread: float) -> tuple["Tensor", "Tensor", "Tensor"]:
            k2, v2 = k.clone(), v.clone()
            k2[:, g], v2[:, g] = s.fresh(k[:, g], spread), s.fresh(v[:, g], 1.0)
            return q, k2, v2

        served = live.new_zeros(live.shape)
        served[:, g * group:(g + 1) * group] = True  # query heads h with h // (Nh // Nkv) == g
        checks.append(_sharpened_probe("kv_head_isolation", "largest move of a query head the kv head does not serve",
                                       s, one_kv_head, ~served, live & served,
                                       {"kv_head": g, "inputs": "k, v", "serves": list(range(g * group, (g + 1) * group))}))
    else:
        checks.append(_not_applicable("kv_head_isolation", "Nkv = 1"))
    if case.nh >= 2:
        h = case.nh - 1

        def one_query_head(spread: float) -> tuple["Tensor", "Tensor", "Tensor"]:
            q2 = q.clone()
            q2[:, h] = s.fresh(q[:, h], spread)
            return q2, k, v

        mine = live.new_zeros(live.shape)
        mine[:, h] = True
        # a row with one allowed key returns that key's value whatever q is: it cannot move
        checks.append(_sharpened_probe("q_head_isolation", "largest move of another query head's output", s,
                                       one_query_head, ~mine, live & mine & (s.counts >= 2), {"head": h, "inputs": "q"}))
    else:
        checks.append(_not_applicable("q_head_isolation", "Nh = 1"))
    return checks


def _finite_check(s: _Setup) -> Check:
    """L3: no NaN or infinity in a row that has at least one allowed key."""
    import torch

    bad = ~torch.isfinite(s.out) & s.live[..., None]  # [B, Nh, Tq, Dv]
    return counted(3, "finite", "non-finite values in rows with an allowed key", int(bad.sum()),
                   location=first_row(bad.any(-1)))


def value_range(v: "Tensor", allow: "Tensor | None", nh: int, tq: int) -> tuple["Tensor", "Tensor"]:
    """Per output row, the per-coordinate min and max of the value rows it may mix: ``[B, Nh, Tq, Dv]`` each.

    A row's allowed keys form runs; the min (max) over a run from key s to key e is a running
    minimum (maximum) from s read at e. Rows share few distinct run starts (0, the left padding,
    the end of a blocked run), so one running minimum per distinct start serves them all, and
    nothing of size ``Tq x Tk x Dv`` is ever built. Rows with no allowed key get +inf / -inf.
    """
    import torch

    b, nkv, tk, dv = v.shape
    if allow is None:
        lo = v.amin(dim=2, keepdim=True).expand(b, nkv, tq, dv)  # [B, Nkv, Tq, Dv]
        hi = v.amax(dim=2, keepdim=True).expand(b, nkv, tq, dv)
    else:
        lo = v.new_full((b, nkv, tq, dv), math.inf)
        hi = v.new_full((b, nkv, tq, dv), -math.inf)
        for e in range(b):
            a = allow[min(e, allow.shape[0] - 1), 0].expand(tq, tk)  # [Tq, Tk]
            _runs_range(v[e], a, lo[e], hi[e])
    group = nh // nkv
    return lo.repeat_interleave(group, dim=1), hi.repeat_interleave(group, dim=1)  # [B, Nh, Tq, Dv]


def _runs_range(v: "Tensor", a: "Tensor", lo: "Tensor", hi: "Tensor") -> None:
    """Fill ``lo``/``hi`` ``[Nkv, Tq, Dv]`` from value rows ``v [Nkv, Tk, Dv]`` over the runs of ``a [Tq, Tk]``."""
    import torch
    import torch.nn.functional as F

    tq, tk = a.shape
    cache: dict[int, tuple["Tensor", "Tensor"]] = {}
    rows_per = max(1, (1 << 20) // max(1, tk))
    for i0 in range(0, tq, rows_per):
        ab = a[i0:i0 + rows_per]  # [rows, Tk]
        starts = ab & ~F.pad(ab[:, :-1], (1, 0), value=False)  # a run of allowed keys begins here
        ends = ab & ~F.pad(ab[:, 1:], (0, 1), value=False)  # ... and ends here
        runs = starts.sum(dim=-1)  # [rows]
        cs, ce = starts.cumsum(dim=-1), ends.cumsum(dim=-1)
        for r in range(int(runs.max()) if runs.numel() else 0):
            has = runs > r
            s_r = ((cs == r + 1) & starts).int().argmax(dim=-1)  # [rows] start of run r
            e_r = ((ce == r + 1) & ends).int().argmax(dim=-1)  # [rows] end of run r
            for s0 in torch.unique(s_r[has]).tolist():
                if s0 not in cache:
                    cache[s0] = (v[:, s0:].cummin(dim=1).values, v[:, s0:].cummax(dim=1).values)  # [Nkv, Tk-s0, Dv]
                cmin, cmax = cache[s0]
                sel = torch.nonzero(has & (s_r == s0)).flatten()
                at = e_r[sel] - s0
                idx = sel + i0
                lo[:, idx] = torch.minimum(lo[:, idx], cmin[:, at])
                hi[:, idx] = torch.maximum(hi[:, idx], cmax[:, at])


def _convex_check(s: _Setup) -> Check:
    """L3: each output row lies inside the per-coordinate range of the value rows it may mix (and zero,
    with sinks: the sink's share of the weights mixes no value)."""
    import torch

    lo, hi = value_range(s.v.to(s.ref_dtype), s.allow, s.case.nh, s.case.tq)  # [B, Nh, Tq, Dv] each
    if s.sinks is not None:
        lo, hi = lo.clamp_max(0.0), hi.clamp_min(0.0)
    outside = torch.clamp(torch.maximum(lo - s.out, s.out - hi), min=0.0)  # [B, Nh, Tq, Dv]
    outside = torch.nan_to_num(outside, nan=0.0).amax(dim=-1).masked_fill(s.empty, 0.0)  # [B, Nh, Tq]
    worst = float(outside.max()) if outside.numel() else 0.0
    wrong = outside > s.tol  # [B, Nh, Tq]
    return bounded(3, "convex_range", "largest distance of an output outside its value rows' range", worst, s.tol,
                   location=first_row(wrong), data=_index_decode(s, wrong))


def _empty_rows_check(s: _Setup, contract: str) -> Check:
    """L3: a query whose every key is blocked returns what the contract says (zeros, NaN, any finite row, or
    anything)."""
    import torch

    empty = s.empty
    if not empty.any():
        return _not_applicable("empty_rows", "every query has an allowed key")
    n = int(empty.sum())
    rows = s.out[empty]  # [n_empty, Dv]
    facts: dict[str, Any] = {"contract": contract, "empty_rows": n}
    if contract == "any":
        return Check(3, "empty_rows", "skipped", reason="the contract 'any' lets such a row hold anything", data=facts)
    if contract == "zeros":
        wrong = empty & ((s.out != 0) | torch.isnan(s.out)).any(-1)  # [B, Nh, Tq]
        facts["rows_with_nan"] = int(torch.isnan(rows).any(dim=-1).sum())
        facts["largest_finite_abs"] = float(torch.nan_to_num(rows.abs(), nan=0.0).max())
        return counted(3, "empty_rows", "rows with every key blocked that are not all zeros", int(wrong.sum()),
                       location=first_row(wrong), data=facts)
    if contract == "finite":
        wrong = empty & ~torch.isfinite(s.out).all(-1)  # [B, Nh, Tq]
        facts["rows_with_nan"] = int(torch.isnan(rows).any(dim=-1).sum())
        return counted(3, "empty_rows", "rows with every key blocked that hold NaN or inf (contract: finite)",
                       int(wrong.sum()), location=first_row(wrong), data=facts)
    wrong = empty & ~torch.isnan(s.out).all(-1)  # [B, Nh, Tq]
    return counted(3, "empty_rows", "rows with every key blocked that are not all NaN", int(wrong.sum()),
                   location=first_row(wrong), data=facts)


def _forbidden_probe(s: _Setup) -> Check:
    """L3: new k and v at keys a row may not use move nothing in that row."""
    case, allow = s.case, s.allow
    if allow is None or bool(allow.all()):
        return _not_applicable("forbidden_keys", "no key is forbidden in this case")
    # Probe 1: keys no query of an example may use (padding, a blocked run). Probe 2: the last key (the future, if causal).
    padded = ~allow.any(dim=-2)[:, 0].expand(case.b, case.tk)  # [B, Tk]
    last = padded.new_zeros(case.b, case.tk)  # [B, Tk]
    last[:, -1] = True
    worst_ok: Check | None = None
    for keys, which in ((padded, {"keys": "padded"}), (last, {"keys": "last", "key": case.tk - 1})):
        if not keys.any():
            continue
        uses = (allow & keys[:, None, None, :]).any(dim=-1).expand(case.b, case.nh, case.tq)  # [B, Nh, Tq]
        stay = ~uses & s.live  # a row with no allowed key answers to empty_rows' contract, not to this probe
        if not stay.any():
            continue
        k2, v2 = s.k.clone(), s.v.clone()
        sel = keys[:, None, :].expand(case.b, case.nkv, case.tk)  # [B, Nkv, Tk]
        k2[sel] = s.fresh(k2[sel], s.qk_scale)
        v2[sel] = s.fresh(v2[sel], 1.0)
        c = _probe("forbidden_keys", "largest move of a row that may not use the changed keys", s,
                   (s.q, k2, v2), stay, None, {**which, "inputs": "k, v", "rows": int(stay.sum())})
        if c.failed:
            return c
        worst_ok = c
    return worst_ok or _not_applicable("forbidden_keys", "no probe leaves a row that must stay")


def _causal_probe(s: _Setup) -> Check:
    """L4: changing the future (later queries, keys after the kept query) moves no earlier output."""
    case = s.case
    if not case.causal:
        return _not_applicable("causal_intervention", "the case is not causal")
    if case.tq < 2:
        return _not_applicable("causal_intervention", "Tq = 1 has no later query")
    c = (case.tq - 1) // 2  # last query kept
    p = c + case.tk - case.tq  # its position on the key axis (bottom-right)
    q2, k2, v2 = s.q.clone(), s.k.clone(), s.v.clone()
    q2[:, :, c + 1:] = s.fresh(s.q[:, :, c + 1:], s.qk_scale)
    j0 = max(p + 1, 0)
    k2[:, :, j0:] = s.fresh(s.k[:, :, j0:], s.qk_scale)
    v2[:, :, j0:] = s.fresh(s.v[:, :, j0:], 1.0)
    live = s.live
    before = live.new_zeros(live.shape)
    before[:, :, :c + 1] = True
    return _probe("causal_intervention", "largest move of an output before the changed future", s,
                  (q2, k2, v2), before & live, live & ~before, {"queries_from": c + 1, "keys_from": j0, "inputs": "q, k, v"})


def _index_decode(s: _Setup, rows: "Tensor") -> dict[str, Any]:
    """For index-encoded inputs: where the first marked output row's values came from.

    Each value of v is its own flat index (b, kv head, t, d) spread over [-1, 1), and each
    (b, kv head) owns a contiguous range, so coordinate 0 of an output row, a convex
    combination of value rows, decodes to the example and kv head it was mixed from and to
    a (weighted) key position. Returns ``{"index_decode": {"source": ..., "may_mix": ...}}``
    (``source`` None when the row lies outside every value row's range), or ``{}`` when the
    inputs are not index-encoded or the row is not finite.
    """
    import torch

    case = s.case
    if case.inputs != "index" or not bool(rows.any()):
        return {}
    b, h, i = (int(x) for x in torch.nonzero(rows)[0][:3])
    n_total = case.b * case.nkv * case.tk * case.dv
    x = float(s.out[b, h, i, 0])
    if not math.isfinite(x):
        return {}
    n0 = (x + 1.0) * n_total / 2.0  # fractional flat index of coordinate 0
    if s.allow is None:
        allowed = [0, case.tk - 1]
    else:
        row = s.allow[min(b, s.allow.shape[0] - 1), 0, min(i, s.allow.shape[2] - 1)]  # [Tk]
        allowed = torch.nonzero(row).flatten().tolist()
    may = {"example": b, "kv_head": h // (case.nh // case.nkv), "keys": [allowed[0], allowed[-1]] if allowed else []}
    source = None
    if -0.5 <= n0 < n_total:
        block = int(n0 // (case.tk * case.dv))
        key = (n0 - block * case.tk * case.dv) / case.dv
        source = {"example": block // case.nkv, "kv_head": block % case.nkv, "key": round(key, 2)}
    return {"index_decode": {"source": source, "may_mix": may}}


# --- the grid ----------------------------------------------------------------------------------


def plan_cases(cases: Iterable[Case], declaration: Declaration | None = None, device: str = "cpu") -> Plan:
    """The cases to run: those inside the declaration that this torch build can run on ``device``."""
    d = declaration or Declaration()
    dev = resolve_device(device)
    todo: list[Case] = []
    skipped: dict[str, int] = {}
    notes: list[str] = []
    unsupported = {name for name in DTYPES.values() if not dtype_supported(name, dev)}
    if dev.type == "mps":  # no float64 there
        unsupported.add("float64")
    for case in cases:
        why = d.outside(case)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
        elif case.dtype_name in unsupported:
            notes.append(case.dtype_name)
        else:
            todo.append(case)
    lacking = sorted(set(notes))
    texts = tuple(f"{name} cases skipped: this torch build cannot run them on {dev.type}" for name in lacking)
    return Plan(tuple(todo), skipped, texts, str(dev), str(reference_dtype(dev)).removeprefix("torch."))


def check_capabilities(fn: Callable[..., Any], plan: Plan, declaration: Declaration, target: str,
                       options: Options) -> str:
    """Before any case: can the target take the protocol's arguments? (See :func:`~attn_ledger.probes.kernel.spec.check_signature`.)"""
    def probe(names: tuple[str, ...]) -> None:
        case = min(plan.cases, key=lambda c: (c.size, c.id)) if plan.cases else parse_case(
            "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32")
        q, k, v, _ = case_inputs(case, options.seed, resolve_device(options.device))
        kw = {"allow_mask": None, "is_causal": False, "scale": 1.0 / math.sqrt(case.dh),
              "softcap": None, "window": None, "sinks": None}
        try:
            _Kernel(fn, {n: kw[n] for n in names}, "the argument probe")(q, k, v)
        except UserCodeError as exc:  # an exit or a hang before any case: the target cannot be checked
            raise SetupError(f"target: {target}: {exc.what} {exc}") from None
        except TypeError as exc:
            if missing_from_error(exc, names) is None and _raised_by_the_call(exc):
                given = ", ".join(["q, k, v", *(f"{n}=" for n in names)])
                raise SetupError(f"target: {target} cannot take the kernel protocol's arguments ({given}): "
                                 f"the first call raised TypeError: {first_line(exc)}; "
                                 f"wrap it in an adapter ({ADAPTERS})") from None
            raise

    return check_signature(fn, declaration, target, probe)


def _raised_by_the_call(exc: BaseException) -> bool:
    """True when ``exc`` rose from the call itself (argument binding, or a builtin refusing its arguments),
    not from inside the user's Python code: the innermost frame of its traceback is :class:`_Kernel`'s call."""
    if getattr(exc, "at_call", False):  # rebuilt from the driver's facts, which looked at the traceback there
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is _Kernel.__call__.__code__


def check_kernel(
    fn: Callable[..., Any],
    cases: Iterable[Case] | None = None,
    *,
    tier: str = "default",
    target: str = "attention",
    empty_rows: str = "zeros",
    seed: int = 0,
    backward: bool = True,
    strict_precision: bool = False,
    device: str = "cpu",
    declaration: Declaration | None = None,
    progress: Callable[[int, int], None] | None = None,
    strict_coverage: bool = False,
) -> Report:
    """Run a kernel-protocol function over a tier of cases, or the given cases.

    Args:
        fn: ``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``.
        cases: cases to run (default: the ``tier``'s, and those of the features the declaration supports).
        tier: ``default`` or ``full`` (used when ``cases`` is None).
        target: how the function was named, for the reproduction line.
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan``, ``finite`` (any
            finite row) or ``any``.
        seed: varies the random inputs and perturbations.
        backward: run the backward checks.
        strict_precision: a float64 case at float32 precision fails instead of warning.
        device: where the cases run (``cpu``, ``cuda``, ``mps``, ``auto``).
        declaration: what the kernel supports; cases outside it are skipped and counted.
        progress: ``callback(done, total)``.
        strict_coverage: a case with no evidence past L1 fails instead of being counted inconclusive.

    Returns:
        A :class:`~attn_ledger.report.Report` with one row per case (see :func:`kernel_report`);
        its ``exit_code`` is 0 when no case fails (warnings and inconclusive cases included), else 1.

    Raises:
        SetupError: the target cannot take the protocol's arguments, or nothing is left to run.
        InputError: a bad option.
    """
    o = Options(empty_rows, seed, backward, strict_precision, device, strict_coverage)
    d = declaration or Declaration()
    from attn_ledger.probes.kernel.cases import feature_cases

    plan = plan_cases(tier_cases(tier) + feature_cases(d.supports) if cases is None else cases, d, o.device)
    if not plan.cases:
        why = ", ".join(f"{n} for {reason}" for reason, n in plan.skipped.items()) or "; ".join(plan.notes)
        raise SetupError(f"declaration: leaves no case to run ({why})")
    from attn_ledger.probes.common.driver import KernelTarget, LocalKernel, snapshot

    kernel = fn if isinstance(fn, KernelTarget) else LocalKernel(fn, snapshot())
    check_capabilities(kernel, plan, d, target, o)
    results = []
    for i, case in enumerate(plan.cases):
        results.append(check_case(kernel, case, options=o, declaration=d))
        if progress is not None:
            progress(i + 1, len(plan.cases))
    report = kernel_report(results, target=target, options=o, declaration=d, plan=plan,
                           tier=tier if cases is None else None)
    return with_call_notes(report, results, kernel.state)
