"""Backward checks for ``check`` on a kernel: dq, dk and dv against float64 autograd.

The forward checks call the kernel without grad. It is called a second time with inputs that
require grad (by the driver, :func:`attn_ledger.probes.common.driver.call_with_grad`, in the worker), and its
output is differentiated against a seeded upstream gradient; the raw gradients come back and are
judged here:

* L1 ``grad_call``: the call and the backward pass ran and a gradient reaches q, k and v. A kernel
  that raises on inputs that require grad (``flex_attention`` on the CPU) or returns an output
  without ``grad_fn`` (``out.detach().requires_grad_()``) fails: "no gradient reaches q, k, v". A
  kernel meant for inference only declares ``backward = false``; the backward checks are then
  skipped. A backward pass that raises is a failure;
* L3 ``grad_finite``: dq is finite on rows with an allowed key, dk and dv everywhere;
* L3 ``grad_blocked_keys``: keys no query of an example may use get zero dk and dv;
* L4 ``grad_q``, ``grad_k``, ``grad_v``: each gradient against the float64 reference's autograd,
  each element within ``c * eps * M`` (:func:`~attn_ledger.tolerance.rounding`), ``M`` the
  magnitude of the gradient's summands (:func:`~attn_ledger.probes.kernel.reference.magnitudes`); the plain
  computations' errors (autograd through the plain forward, torch's own in half precision, and the
  FlashAttention-style backward) and the suites' limits over them are reported beside it as data.
  The location is the element furthest past its bound. In float64 cases the bound is the float32
  level, as for the output; the float64-level ratio of each gradient is returned for the
  precision check.

Under an empty-row contract other than ``zeros``, an (example, head) slice with an empty row is
left out for dq, and an (example, kv head) slice serving such a head for dk and dv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attn_ledger.probes.kernel.reference import (Computed, Magnitudes, first_row, judge_rounding, max_over, plain_error, row_diff,
                                   suites_view, tolerance, worst_row)
from attn_ledger.report import Check, bounded, counted, unjudged

if TYPE_CHECKING:
    from torch import Tensor

GRAD_CHECKS = ((1, "grad_call"), (3, "grad_finite"), (3, "grad_blocked_keys"), (4, "grad_q"), (4, "grad_k"),
               (4, "grad_v"))
TENSORS = ("dq", "dk", "dv")
_ROW_NAMES = {"dq": ("example", "head", "query"), "dk": ("example", "kv_head", "key"),
              "dv": ("example", "kv_head", "key")}


@dataclass(frozen=True)
class GradRun:
    """What the kernel's backward gave: ``status`` ``ok`` or ``fail``, and why."""

    status: str
    reason: str = ""
    grads: dict[str, "Tensor"] = field(default_factory=dict)  # dq, dk, dv in the reference dtype
    unused: tuple[str, ...] = ()  # inputs the output does not depend on (their gradient read as zeros)


NO_GRADIENT = "no gradient reaches q, k, v"


def grad_run(grad: dict[str, Any], tensors: dict[str, "Tensor"], inputs: tuple["Tensor", "Tensor", "Tensor"],
             d_out: "Tensor", ref_dtype: Any) -> GradRun:
    """What the call with inputs that require grad, and its backward pass, gave: judged from the driver's
    facts (:func:`attn_ledger.probes.common.driver.call_with_grad`) and raw gradients.

    A call that raises, or an output with no ``grad_fn``, is a failure: no gradient reaches q, k, v, and a
    model trained with the kernel would never update them. (A kernel meant for inference only declares
    ``backward = false``, and the backward checks are skipped.) So is an output of another shape, and a
    backward pass that raises.
    """
    import torch

    from attn_ledger.guard import rebuilt_exception

    if "raised" in grad:
        exc = rebuilt_exception(grad["raised"])
        return GradRun("fail", f"{NO_GRADIENT}: the call with inputs that require grad raised "
                               f"{type(exc).__name__}: {exc}")
    out = tensors.get("out")
    if not grad.get("grad_fn"):
        return GradRun("fail", f"{NO_GRADIENT}: the output carries no gradient (no grad_fn)")
    if out is None or tuple(out.shape) != tuple(d_out.shape):
        got = None if out is None else list(out.shape)
        return GradRun("fail", f"the output with grad has shape {got}, expected {list(d_out.shape)}")
    if "backward_raised" in grad:
        exc = rebuilt_exception(grad["backward_raised"])
        return GradRun("fail", f"the backward pass raised {type(exc).__name__}: {exc}")
    grads = {}
    for name, leaf in zip(TENSORS, inputs):
        g = tensors.get(name)
        if g is None or tuple(g.shape) != tuple(leaf.shape):
            g = torch.zeros(leaf.shape, dtype=ref_dtype, device=leaf.device)
        grads[name] = g.to(device=leaf.device, dtype=ref_dtype)
    return GradRun("ok", grads=grads, unused=tuple(grad.get("unused", ())))


@dataclass(frozen=True)
class GradJudging:
    """What the gradients are judged on and against."""

    dtype: str  # the case's dtype name
    ref: Computed  # the reference with gradients
    plain: dict[str, Computed]  # the plain same-dtype computations with gradients (see kernelref.plain_variants)
    plain32: Computed | None  # float64 cases: the plain float32 computation (the float32 level)
    live: "Tensor"  # [B, Nh, Tq] rows with an allowed key
    q_slices: "Tensor"  # [B, Nh, 1] (example, head) slices judged for dq
    kv_slices: "Tensor"  # [B, Nkv, 1] (example, kv head) slices judged for dk and dv
    blocked: "Tensor"  # [B, 1, Tk] keys no query of the example may use
    score_max: float = 0.0  # the largest |scaled score| (see kernelref.tolerance)
    mags: Magnitudes | None = None  # the summands' magnitudes (kernelref.magnitudes), with gradients


def not_run(status: str, reason: str) -> list[Check]:
    """Every backward check with one status (``skipped``, ``not_applicable``, ``not_reached``) and why."""
    return [unjudged(level, name, status, reason) for level, name in GRAD_CHECKS]  # type: ignore[arg-type]


def backward_checks(run: GradRun, j: GradJudging) -> tuple[list[Check], dict[str, dict[str, float]]]:
    """The backward checks, and for each gradient its error and float64-level bound (for precision)."""
    if run.status != "ok":
        if run.status == "fail":
            rest = [unjudged(level, name, "not_reached", "the backward pass gave no gradients")
                    for level, name in GRAD_CHECKS[1:]]
            return [Check(1, "grad_call", "fail", reason=run.reason), *rest], {}
        return not_run("not_applicable", run.reason), {}
    if not bool(j.q_slices.any()):
        reason = "every (example, head) slice has an empty row, and the contract lets such a row hold anything"
        return [Check(1, "grad_call", "pass"), *not_run("not_applicable", reason)[1:]], {}
    facts: dict[str, Any] = {"unused": list(run.unused)} if run.unused else {}
    if not bool(j.q_slices.all()):  # slices with an empty row, left out under the contract nan or any
        facts["slices_judged"], facts["slices"] = int(j.q_slices.sum()), j.q_slices.numel()
    call = Check(1, "grad_call", "pass", data=facts)
    rows = {"dq": j.live & j.q_slices, "dk": j.kv_slices, "dv": j.kv_slices}  # where each gradient is judged
    checks = [call, _finite(run, rows), _blocked(run, j)]
    precision: dict[str, dict[str, float]] = {}
    for name, check_name in zip(TENSORS, ("grad_q", "grad_k", "grad_v")):
        c, p = _against_reference(run, j, name, check_name, rows[name])
        checks.append(c)
        if p:
            precision[name] = p
    return checks, precision


def _finite(run: GradRun, rows: dict[str, "Tensor"]) -> Check:
    """L3: no NaN or infinity in dq on rows with an allowed key, nor in dk and dv."""
    import torch

    counts, first = {}, None
    for name in TENSORS:
        bad = ~torch.isfinite(run.grads[name]) & rows[name][..., None]  # [B, N, T, D]
        counts[name] = int(bad.sum())
        if first is None and counts[name]:
            first = {"tensor": name, **(first_row(bad.any(-1), _ROW_NAMES[name]) or {})}
    return counted(3, "grad_finite", "non-finite gradient values (dq on rows with an allowed key, dk, dv)",
                   sum(counts.values()), location=first, data={"per_tensor": counts})


def _blocked(run: GradRun, j: GradJudging) -> Check:
    """L3: a key no query of its example may use gets dk = dv = 0."""
    import torch

    if not bool(j.blocked.any()):
        return unjudged(3, "grad_blocked_keys", "not_applicable", "every key is allowed to some query")
    where = j.blocked & j.kv_slices  # [B, Nkv|1, Tk]
    worst, loc, limits = 0.0, None, []
    for name in ("dk", "dv"):
        mag = torch.nan_to_num(run.grads[name].abs(), nan=float("inf")).amax(dim=-1)  # [B, Nkv, Tk]
        value = max_over(mag, where)
        limits.append(tolerance(j.dtype, 0.0, float(getattr(j.ref, name).abs().max()))[0])
        if value > worst:
            worst, loc = value, {"tensor": name, **(worst_row(mag, where, _ROW_NAMES[name]) or {})}
    limit = min(limits)
    return bounded(3, "grad_blocked_keys", "largest |dk| or |dv| at a key no query may use", worst, limit,
                   location=loc if worst > limit else None, data={"keys": int(j.blocked.sum())})


def _against_reference(run: GradRun, j: GradJudging, name: str, check_name: str,
                       where: "Tensor") -> tuple[Check, dict[str, Any]]:
    """L4: one gradient against the float64 reference's, each element within ``c * eps * M`` (the rounding
    rule, :func:`~attn_ledger.probes.kernel.reference.judge_rounding`), with the suites' view beside it as data."""
    ref = getattr(j.ref, name)
    got = run.grads[name]
    names = _ROW_NAMES[name]
    _, errors = plain_error({n: getattr(c, name) for n, c in j.plain.items()}, ref, where)
    judged = judge_rounding(got, ref, j.mags, name, j.dtype, where, names)
    facts = {**judged.parts, **suites_view(name, judged.max_error, errors)}
    precision: dict[str, Any] = {}
    if j.plain32 is not None:  # float64: judged at the float32 level; the float64 ratio goes to precision
        at64 = judged
        plain32_err = max_over(row_diff(getattr(j.plain32, name).to(ref.dtype), ref), where)
        judged = judge_rounding(got, ref, j.mags, name, "float32", where, names)
        precision = {"error": judged.max_error, "float64_ratio": at64.ratio, "float32_ratio": judged.ratio}
        facts = {**judged.parts, **suites_view(name, judged.max_error, {"float32": plain32_err}), "float64": at64.parts}
    failed = judged.ratio > 1.0
    data: dict[str, Any] = {"tolerance": facts}
    if name in run.unused:
        data["unused"] = True
    measure = f"max |{name} - float64 autograd {name}|"
    reason = f"no gradient reached {name[1]} (the output does not depend on it)" if name in run.unused and failed else ""
    return bounded(4, check_name, measure, judged.max_error, judged.limit, location=judged.at if failed else None,
                   data=data, reason=reason), precision
