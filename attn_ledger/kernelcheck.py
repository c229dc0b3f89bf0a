"""Black-box checks for a user's attention function under the kernel protocol.

The kernel protocol::

    def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) -> Tensor

q ``[B, Nh, Tq, Dh]``, k ``[B, Nkv, Tk, Dh]``, v ``[B, Nkv, Tk, Dv]``; query head h uses kv
head ``h // (Nh // Nkv)``; ``allow_mask`` is bool, broadcastable to ``[B, Nh, Tq, Tk]``,
True = may attend; ``is_causal`` is bottom-right aligned (query i may use key j iff
``j <= i + (Tk - Tq)``); both together mean a key must be allowed by both; ``scale`` None
means ``1/sqrt(Dh)``; the result is ``[B, Nh, Tq, Dv]``.

Cases, their ids and tiers live in :mod:`attn_ledger.kernelcases`; what a kernel declares it
supports in :mod:`attn_ledger.kernelspec`; the streamed references in
:mod:`attn_ledger.kernelref`; the backward checks in :mod:`attn_ledger.kernelgrad`.

Only what is visible from outside is checked, at the levels of the ledger:

* L1 ``call`` (the function returns on a legal case), ``shape``, ``dtype``, ``grad_call``;
* L2 ``batch_isolation``, ``kv_head_isolation``, ``q_head_isolation``: perturb one batch
  element, one kv head or one query head's q; only the outputs that should move do;
* L3 ``finite``, ``convex_range`` (each output row lies inside the per-coordinate range of
  the value rows it may mix), ``forbidden_keys`` (perturbing a forbidden key's k and v
  moves nothing), ``empty_rows`` (a query whose every key is blocked follows the stated
  contract: zeros, NaN or anything), ``grad_finite``, ``grad_blocked_keys``;
* L4 ``reference`` (agreement with a float64 reference), ``precision`` (float64 cases: the
  float64 level, a warning where the kernel reaches only the float32 level),
  ``causal_intervention`` (changing the future moves no past output, and does move a later
  one), ``grad_q``, ``grad_k``, ``grad_v``.

Tolerance rule (:func:`~attn_ledger.kernelref.tolerance`): the kernel's largest error against
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

from attn_ledger.errors import InputError, SetupError
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.kernelcases import (  # noqa: F401  (re-exported: the public names of check's cases)
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
    torch_dtype,
)
from attn_ledger.kernelgrad import GradJudging, backward_checks, not_run, run_backward
from attn_ledger.kernelref import (  # noqa: F401  (FACTOR re-exported)
    FACTOR,
    first_row,
    max_over,
    plain,
    plain_error,
    plain_variants,
    row_diff,
    tolerance,
)
from attn_ledger.kernelspec import Declaration, check_signature
from attn_ledger.report import Check, Finding, Report, Row, bounded, counted, find_check, row_status, unjudged
from attn_ledger.seeding import generator

if TYPE_CHECKING:
    import torch
    from torch import Tensor

DEFAULT_GRID: tuple[Case, ...] = DEFAULT_TIER
"""The default tier's cases (kept under its old name)."""

EMPTY_ROWS = ("zeros", "nan", "any")
DEVICES = ("cpu", "cuda", "mps", "auto")
PRECISION_WARNING = "computes at float32 precision in float64"

CHECK_ORDER = (
    (1, "call"), (1, "shape"), (1, "dtype"), (1, "grad_call"),
    (2, "batch_isolation"), (2, "kv_head_isolation"), (2, "q_head_isolation"),
    (3, "finite"), (3, "convex_range"), (3, "forbidden_keys"), (3, "empty_rows"), (3, "grad_finite"),
    (3, "grad_blocked_keys"),
    (4, "reference"), (4, "precision"), (4, "causal_intervention"), (4, "grad_q"), (4, "grad_k"), (4, "grad_v"),
)
LEVEL_OF = {name: level for level, name in CHECK_ORDER}
_POSITION = {name: i for i, (_, name) in enumerate(CHECK_ORDER)}


# --- options and devices -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """How the cases are judged (beyond the case itself).

    Attributes:
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        backward: run the backward checks (a declaration without backward turns them off too).
        strict_precision: a float64 case at float32 precision fails instead of warning.
        device: ``cpu``, ``cuda`` (or ``cuda:N``), ``mps`` or ``auto``.
    """

    empty_rows: str = "zeros"
    seed: int = 0
    backward: bool = True
    strict_precision: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.empty_rows not in EMPTY_ROWS:
            raise InputError(f"empty_rows: got {self.empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InputError(f"device: got {self.device!r}, expected one of {', '.join(DEVICES)}")


def resolve_device(name: str) -> "torch.device":
    """``auto``: CUDA where there is one, else MPS, else the CPU. A device that is absent is an input error."""
    import torch

    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device: got {name!r}, but CUDA is not available here; expected cpu or auto")
    if name == "mps" and not mps:
        raise InputError("device: got 'mps', but MPS is not available here; expected cpu or auto")
    return torch.device(name)


def reference_dtype(device: "torch.device") -> "torch.dtype":
    """float64 where the device has it, float32 otherwise (MPS)."""
    import torch

    return torch.float32 if device.type == "mps" else torch.float64


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

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)


def smallest_failing(results: Iterable[CaseResult]) -> CaseResult | None:
    """The failing case with the fewest input elements (ties: lowest first level, then id)."""
    failing = [r for r in results if not r.passed]
    if not failing:
        return None
    return min(failing, key=lambda r: (r.case.size, r.first_failure.level, r.case.id))  # type: ignore[union-attr]


def reproduction(case: Case, target: str, *, options: Options | None = None,
                 declaration: Declaration | None = None, empty_rows: str | None = None,
                 seed: int | None = None) -> tuple[str, tuple[str, ...]]:
    """The CLI line and the Python lines that rerun one case of ``attn-ledger check TARGET``."""
    o = options or Options()
    o = Options(empty_rows=empty_rows or o.empty_rows, seed=o.seed if seed is None else seed, backward=o.backward,
                strict_precision=o.strict_precision, device=o.device)
    d = declaration or Declaration()
    opts = ""
    if o.seed:
        opts += f" --seed {o.seed}"
    if o.empty_rows != "zeros":
        opts += f" --empty-rows {o.empty_rows}"
    if d.masks != Declaration().masks:
        opts += f" --masks {','.join(d.masks)}"
    if not (o.backward and d.backward):
        opts += " --no-backward"
    if o.strict_precision:
        opts += " --strict-precision"
    if o.device != "cpu":
        opts += f" --device {o.device}"
    cli = f"attn-ledger check {target} --case {case.id}{opts}"
    name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    extra = (f", seed={o.seed}" if o.seed else "") + (f", device={o.device!r}" if o.device != "cpu" else "")
    python = ["from attn_ledger.kernelcheck import case_inputs", f"q, k, v, kw = case_inputs({case.id!r}{extra})"]
    dropped = [k for k in ("allow_mask", "is_causal") if k not in d.protocol_keywords()]
    if dropped:
        python.append(f"kw = {{key: val for key, val in kw.items() if key not in {tuple(dropped)!r}}}")
    python.append(f"out = {name}(q, k, v, **kw)")
    return cli, tuple(python)


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
    first = result.first_failure
    note = _decode_text(first.data["index_decode"]) if first is not None and "index_decode" in first.data else ""
    return Row(result.case.id, row_status(result.checks), result.checks, fields={"elements": result.case.size},
               note=note)


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
                  failures: list[dict[str, Any]], warnings: list[dict[str, Any]], plan: Plan, target: str,
                  o: Options, d: Declaration) -> tuple[list[str], dict[str, str] | None]:
    """The lines under the table (skips, warnings, each distinct failure, the reproduction), and the
    reproduction of the smallest failing case as data."""
    notes = list(plan.notes)
    if plan.skipped:
        why = ", ".join(f"{n} for {reason}" for reason, n in plan.skipped.items())
        notes.append(f"{_cases(plan.skipped_total)} skipped: outside the declaration ({why})")
    for g in warnings:
        if g["check"] == "precision":
            what = PRECISION_WARNING if g["cases"] == 1 else PRECISION_WARNING.replace("computes", "compute", 1)
        else:
            what = f"warn{'s' if g['cases'] == 1 else ''} at L{g['level']} {g['check']}"
        notes.append(f"{_cases(g['cases'])} {what} (warning; smallest {g['smallest_case']})"
                     + ("; --strict-precision makes it a failure" if g["check"] == "precision" else ""))
    if small is None:
        notes.append("the case passes" if len(results) == 1 else f"all {len(results)} cases pass")
        return notes, None
    cli, python = reproduction(small.case, target, options=o, declaration=d)
    command, _, rest = cli.partition(" --case ")
    verb = "fails" if len(failing) == 1 else "fail"
    notes.append(f"{len(failing)} of {_cases(len(results))} {verb}; the first finding is the smallest failing case")
    for g in failures:
        notes.append(f"L{g['level']} {g['check']} fails first in {_cases(g['cases'])} (smallest {g['smallest_case']})")
    notes += [f"its call: {small.case.call_text(target.rsplit(':', 1)[-1] if ':' in target else 'attention')}",
              "reproduce it:",
              # two lines joined by a shell continuation: the table wraps a long note, and this stays pasteable
              f"{command} \\", f"    --case {rest}", *python]
    return notes, {"case": small.case.id, "cli": cli, "python": "\n".join(python)}


def kernel_report(
    results: Sequence[CaseResult], *, target: str, options: Options | None = None,
    declaration: Declaration | None = None, plan: Plan | None = None, tier: str | None = "default",
    empty_rows: str | None = None, seed: int | None = None, skipped: Sequence[str] = (),
) -> Report:
    """The report of ``attn-ledger check`` on a kernel-protocol function: one row per case, smallest first.

    The first finding is the smallest failing case's first failing check; ``details`` holds the
    counts, each distinct failure (and warning) once with its count and smallest case, the cases
    skipped and why, and the reproduction of the smallest failing case, which the notes repeat.
    """
    o = options or Options()
    o = Options(empty_rows=empty_rows or o.empty_rows, seed=o.seed if seed is None else seed, backward=o.backward,
                strict_precision=o.strict_precision, device=o.device)
    d = declaration or Declaration()
    plan = plan or Plan(tuple(r.case for r in results), {}, tuple(skipped))
    ordered = sorted(results, key=lambda r: (r.case.size, r.case.id))
    failing = [r for r in ordered if not r.passed]
    small = smallest_failing(results)
    failures, warnings = _groups(ordered, "fail"), _groups(ordered, "warn")
    notes, repro = _report_notes(results, failing, small, failures, warnings, plan, target, o, d)
    levels = [r.first_failure.level for r in failing]  # type: ignore[union-attr]
    details = {
        "target": target, "protocol": "kernel", "tier": tier, "empty_rows": o.empty_rows, "seed": o.seed,
        "device": plan.device or o.device, "reference_dtype": plan.reference_dtype,
        "backward": o.backward and d.backward, "strict_precision": o.strict_precision, "declaration": d.to_json(),
        "cases_total": len(results), "cases_failed": len(failing), "cases_warned": sum(r.warned for r in results),
        "cases_skipped": plan.skipped_total, "skipped_by_declaration": dict(plan.skipped),
        "first_level": min(levels) if levels else None, "failures": failures, "warnings": warnings,
        "skipped": list(plan.notes), "reproduce": repro,
    }
    return Report(
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


# --- calling the user's function -------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


class _Kernel:
    """Calls the user's function on clones of the inputs (so in-place edits cannot leak between calls).

    Each call is one :func:`~attn_ledger.guard.user_call`, named by the case's call text and
    the probe it serves. A value that is not a dense tensor with values (not a tensor, sparse,
    on the meta device) is a :class:`~attn_ledger.guard.UserCodeError`, as a crash would be:
    no check can read it. Forward calls run without grad; :meth:`with_grad` runs the one call
    with grad enabled, on the leaves it is given.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], call_text: str) -> None:
        self.fn, self.kwargs, self.call_text = fn, kwargs, call_text

    def _kw(self) -> dict[str, Any]:
        kw = dict(self.kwargs)
        if kw.get("allow_mask") is not None:
            kw["allow_mask"] = kw["allow_mask"].clone()
        return kw

    def __call__(self, q: "Tensor", k: "Tensor", v: "Tensor", probe: str | None = None) -> "Tensor":
        import torch

        what = self.call_text if probe is None else f"{self.call_text} for the {probe} probe"
        q, k, v = q.clone(), k.clone(), v.clone()
        with torch.no_grad(), user_call(what):
            out = self.fn(q, k, v, **self._kw())
        return _readable(out, what)

    def with_grad(self, q: "Tensor", k: "Tensor", v: "Tensor") -> "Tensor":
        import torch

        what = f"{self.call_text} with inputs that require grad"
        with torch.enable_grad(), user_call(what):
            out = self.fn(q, k, v, **self._kw())
        return _readable(out, what)


def _readable(out: Any, what: str) -> "Tensor":
    problem = returned_problem(out)
    if problem is not None:
        raise UserCodeError(problem[0], what, **problem[1])
    return out


def returned_problem(out: Any) -> tuple[str, dict[str, Any]] | None:
    """Why a kernel's return value cannot be checked, as a phrase and as values, or None.

    Example: ``("returned list, expected a Tensor [B, Nh, Tq, Dv]", {"returned": "list"})``.
    """
    import torch

    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a Tensor [B, Nh, Tq, Dv]", {"returned": type(out).__name__}
    if out.layout != torch.strided:
        layout = str(out.layout).removeprefix("torch.")
        return f"returned a tensor with layout {layout}, expected a dense (strided) Tensor", {"layout": layout}
    if out.is_meta:
        return "returned a tensor on the meta device, which holds no values to check", {"device": "meta"}
    return None


def failed_call(case: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    """A case whose call did not come back with a result: L1 ``call`` fails, nothing after it is reached.

    Args:
        reason: the call and how it ended (``attention(q, k, v) timed out after 2 s``).
        data: the same as values (``{"call": ..., "timeout_s": 2.0}``).
    """
    called = Check(1, "call", "fail", reason=reason, data=data)
    rest = [unjudged(level, name, "not_reached", "the call did not return a result") for level, name in CHECK_ORDER[1:]]
    return CaseResult(case, (called, *rest))


def _raised(level: int, name: str, exc: BaseException, where: str, data: dict[str, Any] | None = None) -> Check:
    """A failing check for a call of the user's function that raised."""
    message = _first_line(exc)
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
    grad_run, d_out = None, None
    if o.backward and d.backward:
        d_out = s.fresh(raw, 1.0).to(ref_dtype)  # [B, Nh, Tq, Dv]
        grad_run = run_backward(kernel.with_grad, user_call, q, k, v, d_out, case.call_text(), ref_dtype)
    with_grads = grad_run is not None and grad_run.status == "ok"
    refs = _references(s, d_out if with_grads else None)
    checks = first + _forward_checks(s, refs, o)
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
        Check(1, "call", "pass"),
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

    from attn_ledger.reference import combined_allow

    allow = combined_allow(case.b, 1, case.tq, case.tk, kwargs["allow_mask"], kwargs["is_causal"], device=q.device)
    if allow is not None:
        while allow.dim() < 4:
            allow = allow[None]
        counts = allow.sum(dim=-1).expand(case.b, case.nh, case.tq)  # [B, Nh, Tq]
    else:
        counts = torch.full((case.b, case.nh, case.tq), case.tk, device=q.device)
    gen = generator(case_crc(case) + 7919 * (o.seed + 1))  # the perturbations' own stream
    qk_scale = max(float(q.double().std()) if q.numel() > 1 else 1.0, float(k.double().std()) if k.numel() > 1 else 1.0)
    out = raw.detach().to(device=q.device, dtype=ref_dtype)
    return _Setup(case, kernel, q, k, v, out, allow, counts, gen, ref_dtype, qk_scale if qk_scale > 0 else 1.0)


def _references(s: _Setup, d_out: "Tensor | None") -> dict[str, Any]:
    """The float64 reference, the plain same-dtype computation (and float32's, for float64 cases), and the
    output's tolerance; with gradients when ``d_out`` is given."""
    import torch

    from attn_ledger.kernelref import attention

    case, dt = s.case, s.q.dtype
    scale = case.effective_scale
    ref = attention(s.q, s.k, s.v, s.allow, scale, compute=s.ref_dtype, d_out=d_out)
    pl = plain_variants(s.q, s.k, s.v, s.allow, scale, dt, d_out=d_out)
    pl32 = None
    if dt == torch.float64:
        pl32 = plain(s.q, s.k, s.v, s.allow, scale, torch.float32, d_out=d_out)
    vmax = float(s.v.abs().max().double()) if s.v.numel() else 0.0
    plain_err, errors = plain_error({n: c.out for n, c in pl.items()}, ref.out, s.live)
    tol, facts = tolerance(case.dtype_name, plain_err, vmax)
    s.noise = tolerance(case.dtype_name, 0.0, vmax)[0]
    if len(errors) > 1:
        facts["plain_errors"] = errors
    err = max_over(row_diff(s.out, ref.out), s.live)
    out_precision: dict[str, float] = {}
    if pl32 is not None:  # float64: the reference check is held to the float32 level; precision to float64's
        plain32_err = max_over(row_diff(pl32.out.to(s.ref_dtype), ref.out), s.live)
        tol32, facts32 = tolerance("float32", plain32_err, vmax)
        out_precision = {"error": err, "float64_limit": tol, "float32_limit": tol32}
        facts = {**facts32, "float64": facts}
        s.tol = tol if err <= tol else tol32  # probes at the level the kernel reaches
        tol = tol32
    else:
        s.tol = tol
    return {"ref": ref, "plain": pl, "plain32": pl32, "tol": tol, "facts": facts, "err": err,
            "out_precision": out_precision}


def _forward_checks(s: _Setup, refs: dict[str, Any], o: Options) -> list[Check]:
    checks = _isolation_checks(s)
    checks += [_finite_check(s), _convex_check(s), _forbidden_probe(s), _empty_rows_check(s, o.empty_rows)]
    checks += [_reference_check(s, refs), _causal_probe(s)]
    return checks


def _reference_check(s: _Setup, refs: dict[str, Any]) -> Check:
    """L4: the output against the reference, within the tolerance."""
    err, tol = refs["err"], refs["tol"]
    wrong = (row_diff(s.out, refs["ref"].out) > tol) & s.live  # [B, Nh, Tq]
    data: dict[str, Any] = {"tolerance": refs["facts"]}
    if err > tol:
        data.update(_index_decode(s, wrong))
    return bounded(4, "reference", "max |out - float64 reference|", err, tol,
                   location=first_row(wrong) if err > tol else None, data=data)


def _precision_check(case: Case, parts: dict[str, dict[str, float]], strict: bool) -> Check:
    """L4 (float64 cases): the largest error over out, dq, dk, dv as a fraction of its float64-level bound."""
    if case.dtype != "f64":
        return unjudged(4, "precision", "not_applicable", "the case is not float64")
    if not parts:
        return unjudged(4, "precision", "not_reached", "the output was not compared with the reference")
    ratios = {name: p["error"] / p["float64_limit"] if p["float64_limit"] > 0 else math.inf for name, p in parts.items()}
    worst = max(ratios, key=lambda n: ratios[n])
    value = ratios[worst]
    within32 = all(p["error"] <= p["float32_limit"] for p in parts.values())
    check = bounded(4, "precision", "largest error / its float64-level bound (out, dq, dk, dv)", value, 1.0,
                    warn_only=not strict, location={"tensor": worst} if value > 1.0 else None,
                    data={name: dict(p) for name, p in parts.items()})
    if check.status != "pass" and within32:
        check = replace(check, reason=PRECISION_WARNING)
    return check


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
    """Which slices and keys the gradients are judged on (see :mod:`attn_ledger.kernelgrad`)."""
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
                       blocked, refs["ref"].raw_max * case.effective_scale)


# --- forward checks ----------------------------------------------------------------------------


def _not_applicable(name: str, why: str) -> Check:
    return unjudged(LEVEL_OF[name], name, "not_applicable", why)


def _probe(
    name: str, measure: str, s: _Setup, args: tuple["Tensor", "Tensor", "Tensor"],
    stay: "Tensor", move: "Tensor | None", perturbed: dict[str, Any],
) -> Check:
    """Run the kernel on perturbed inputs: ``stay`` outputs must not move, some ``move`` output must.

    The value is the largest move of a row in ``stay``, judged against the case's tolerance; ``data``
    says what was perturbed and how far the ``move`` rows moved. A probe whose ``move`` rows moved
    no more than ten times the dtype's floor is inconclusive: it proves nothing either way.
    """
    level, tol = LEVEL_OF[name], s.tol
    data: dict[str, Any] = {"perturbed": perturbed}
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
    """L3: each output row lies inside the per-coordinate range of the value rows it may mix."""
    import torch

    lo, hi = value_range(s.v.to(s.ref_dtype), s.allow, s.case.nh, s.case.tq)  # [B, Nh, Tq, Dv] each
    outside = torch.clamp(torch.maximum(lo - s.out, s.out - hi), min=0.0)  # [B, Nh, Tq, Dv]
    outside = torch.nan_to_num(outside, nan=0.0).amax(dim=-1).masked_fill(s.empty, 0.0)  # [B, Nh, Tq]
    worst = float(outside.max()) if outside.numel() else 0.0
    wrong = outside > s.tol  # [B, Nh, Tq]
    return bounded(3, "convex_range", "largest distance of an output outside its value rows' range", worst, s.tol,
                   location=first_row(wrong), data=_index_decode(s, wrong))


def _empty_rows_check(s: _Setup, contract: str) -> Check:
    """L3: a query whose every key is blocked returns what the contract says (zeros, NaN or anything)."""
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
    """Before any case: can the target take the protocol's arguments? (See :func:`~attn_ledger.kernelspec.check_signature`.)"""
    def probe(names: tuple[str, ...]) -> None:
        case = min(plan.cases, key=lambda c: (c.size, c.id)) if plan.cases else parse_case(
            "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32")
        q, k, v, _ = case_inputs(case, options.seed, resolve_device(options.device))
        kw = {"allow_mask": None, "is_causal": False, "scale": 1.0 / math.sqrt(case.dh)}
        try:
            _Kernel(fn, {n: kw[n] for n in names}, "the argument probe")(q, k, v)
        except UserCodeError as exc:  # an exit or a hang before any case: the target cannot be checked
            raise SetupError(f"target: {target}: {exc.what} {exc}") from None

    return check_signature(fn, declaration, target, probe)


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
) -> Report:
    """Run a kernel-protocol function over a tier of cases, or the given cases.

    Args:
        fn: ``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``.
        cases: cases to run (default: the ``tier``'s).
        tier: ``default`` or ``full`` (used when ``cases`` is None).
        target: how the function was named, for the reproduction line.
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        backward: run the backward checks.
        strict_precision: a float64 case at float32 precision fails instead of warning.
        device: where the cases run (``cpu``, ``cuda``, ``mps``, ``auto``).
        declaration: what the kernel supports; cases outside it are skipped and counted.
        progress: ``callback(done, total)``.

    Returns:
        A :class:`~attn_ledger.report.Report` with one row per case (see :func:`kernel_report`);
        its ``exit_code`` is 0 when every case passes (warnings included), else 1.

    Raises:
        SetupError: the target cannot take the protocol's arguments, or nothing is left to run.
        InputError: a bad option.
    """
    o = Options(empty_rows, seed, backward, strict_precision, device)
    d = declaration or Declaration()
    plan = plan_cases(tier_cases(tier) if cases is None else cases, d, o.device)
    if not plan.cases:
        why = ", ".join(f"{n} for {reason}" for reason, n in plan.skipped.items()) or "; ".join(plan.notes)
        raise SetupError(f"declaration: leaves no case to run ({why})")
    check_capabilities(fn, plan, d, target, o)
    results = []
    for i, case in enumerate(plan.cases):
        results.append(check_case(fn, case, options=o, declaration=d))
        if progress is not None:
            progress(i + 1, len(plan.cases))
    return kernel_report(results, target=target, options=o, declaration=d, plan=plan,
                         tier=tier if cases is None else None)
