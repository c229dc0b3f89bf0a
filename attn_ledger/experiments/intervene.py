"""The causal intervention: change only the future, rerun, and see whether the past moved.

The contract a causal mask exists to enforce is a statement about behaviour: the output at
position i must not depend on the input at any position j > i. For each cut i this
experiment replaces the input at positions i+1.. with fresh values, reruns the forward and
measures two numbers on the output ``[B, T, E]``:

* prefix delta: max |y1 - y2| over positions 0..i. Causality needs it to be zero, within
  the dtype's tolerance.
* suffix delta: max |y1 - y2| over positions i+1... It must be clearly nonzero. If both are
  zero the intervention changed nothing and proves nothing ("vacuous").

Tolerances are torch.testing.assert_close's defaults for the output dtype, applied to the
output's own scale (max |y| of the unchanged run), because some real layers produce very
small outputs and an absolute 1e-5 would hide a leak in them.

Nothing here decides exit codes; :class:`InterventionReport` says what was found and the
command turns that into a status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from attn_ledger.report import envelope, json_number

if TYPE_CHECKING:
    import torch
    from torch import nn

GradMode = Literal["no_grad", "autograd"]
GRAD_MODES: tuple[GradMode, ...] = ("no_grad", "autograd")

# torch.testing.assert_close's default (rtol, atol) per dtype.
_DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}

# The suffix must move by at least this fraction of the output scale (and by at least ten
# prefix tolerances, which matters only for the half-precision dtypes).
SUFFIX_FRACTION = 1e-3


def tolerance_for(dtype: "torch.dtype | str") -> tuple[float, float]:
    """``(rtol, atol)``: torch.testing.assert_close's defaults for ``dtype`` (float32's for others)."""
    name = str(dtype).removeprefix("torch.")
    return _DEFAULT_TOLERANCES.get(name, _DEFAULT_TOLERANCES["float32"])


def relative_tolerance(dtype: "torch.dtype | str") -> float:
    """The fraction of an output's scale within which two results count as equal: atol + rtol."""
    rtol, atol = tolerance_for(dtype)
    return atol + rtol


def suffix_fraction(dtype: "torch.dtype | str") -> float:
    """The fraction of an output's scale by which the changed positions must move."""
    return max(SUFFIX_FRACTION, 10 * relative_tolerance(dtype))


class ForwardError(Exception):
    """The forward raised, or returned something other than a ``[B, T, E]`` tensor."""


def first_output(result: Any) -> "torch.Tensor":
    """A forward's output tensor: the result itself, or the first item of a tuple/list."""
    import torch

    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise ForwardError(f"forward returned {type(result).__name__}, expected a tensor [B, T, E] or a tuple starting with one")
    return result


def call_forward(forward: Callable[[Any], Any], x: "torch.Tensor", expect_shape: bool = True) -> "torch.Tensor":
    """Run ``forward(x)`` and return its output tensor, turning any failure into :class:`ForwardError`."""
    try:
        y = first_output(forward(x))
    except ForwardError:
        raise
    except Exception as exc:  # the user's forward may raise anything
        raise ForwardError(f"forward raised {type(exc).__name__} on input {tuple(x.shape)}: {_first_line(exc)}") from None
    if expect_shape and tuple(y.shape) != tuple(x.shape):
        raise ForwardError(f"forward returned shape {tuple(y.shape)} for input {tuple(x.shape)} [B, T, E], expected the same shape")
    return y


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _grad_context(grad_mode: GradMode):
    import torch

    return torch.no_grad() if grad_mode == "no_grad" else torch.enable_grad()


def _run(forward: Callable, x: "torch.Tensor", grad_mode: GradMode) -> "torch.Tensor":
    with _grad_context(grad_mode):
        x_in = x.detach().clone()
        if grad_mode == "autograd":
            x_in.requires_grad_(True)
        y = call_forward(forward, x_in)
    return y.detach()


def abs_delta(y1: "torch.Tensor", y2: "torch.Tensor") -> "torch.Tensor":
    """``|y1 - y2|`` in float64, where two equal non-finite values count as no change."""
    import torch

    a, b = y1.detach().to(torch.float64), y2.detach().to(torch.float64)
    d = (a - b).abs()
    same_nonfinite = (~torch.isfinite(a)) & (~torch.isfinite(b)) & ((a == b) | (a.isnan() & b.isnan()))
    d = torch.where(same_nonfinite, torch.zeros_like(d), d)
    return torch.nan_to_num(d, nan=math.inf)


def output_scale(y: "torch.Tensor") -> float:
    """max |y| over finite entries (0.0 when there are none)."""
    import torch

    a = y.detach().to(torch.float64).abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


@dataclass(frozen=True)
class CutResult:
    """One cut: the input changed at positions cut+1.., the output compared on both sides.

    Attributes:
        cut: i; positions 0..i kept, i+1.. replaced.
        prefix_delta: max |y1 - y2| over positions 0..i (must be <= tolerance).
        suffix_delta: max |y1 - y2| over positions i+1.. (must be > threshold).
        tolerance: the prefix bound, relative_tolerance(dtype) * scale.
        threshold: the suffix bound, suffix_fraction(dtype) * scale.
        moved_position: the first position in 0..i whose output moved beyond tolerance.
        nonfinite: count of non-finite output entries over both runs.
    """

    cut: int
    prefix_delta: float
    suffix_delta: float
    tolerance: float
    threshold: float
    moved_position: int | None
    nonfinite: int

    @property
    def status(self) -> str:
        """``leak``, ``nonfinite``, ``vacuous`` or ``pass``, in that order of precedence."""
        if not self.prefix_delta <= self.tolerance:
            return "leak"
        if self.nonfinite:
            return "nonfinite"
        if not self.suffix_delta > self.threshold:
            return "vacuous"
        return "pass"

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_json(self) -> dict[str, Any]:
        return {
            "cut": self.cut,
            "status": self.status,
            "prefix_delta": json_number(self.prefix_delta),
            "suffix_delta": json_number(self.suffix_delta),
            "tolerance": json_number(self.tolerance),
            "threshold": json_number(self.threshold),
            "moved_position": self.moved_position,
            "nonfinite": self.nonfinite,
        }


@dataclass(frozen=True)
class InterventionResult:
    """Every cut of one forward under one grad mode.

    Attributes:
        grad_mode: ``no_grad`` (the inference path) or ``autograd`` (the training path).
        shape: the input's ``(B, T, E)``.
        dtype: the output dtype's name.
        scale: max |y| of the unchanged run; tolerance and threshold are fractions of it.
        rel_tolerance: prefix bound as a fraction of scale.
        suffix_fraction: suffix bound as a fraction of scale.
        cuts: one :class:`CutResult` per cut, in cut order (empty when ``error`` is set).
        error: the forward raised or returned the wrong shape (a level-1 finding).
    """

    grad_mode: str
    shape: tuple[int, ...]
    dtype: str
    scale: float
    rel_tolerance: float
    suffix_fraction: float
    cuts: tuple[CutResult, ...] = ()
    error: str | None = None

    @property
    def verdict(self) -> str:
        """``error``, ``leak``, ``nonfinite``, ``vacuous`` or ``causal``."""
        if self.error is not None:
            return "error"
        for status in ("leak", "nonfinite", "vacuous"):
            if any(c.status == status for c in self.cuts):
                return status
        return "causal"

    @property
    def ok(self) -> bool:
        return self.verdict == "causal"

    @property
    def first_leak(self) -> CutResult | None:
        return next((c for c in self.cuts if c.status == "leak"), None)

    @property
    def max_prefix_delta(self) -> float | None:
        return max((c.prefix_delta for c in self.cuts), default=None)

    @property
    def min_suffix_delta(self) -> float | None:
        return min((c.suffix_delta for c in self.cuts), default=None)

    def summary(self) -> str:
        """One sentence: what was measured and what it means."""
        v = self.verdict
        if v == "error":
            return str(self.error)
        if v == "leak":
            c = self.first_leak
            assert c is not None
            return (
                f"future leaks: changing positions {c.cut + 1}.. moved the output at position {c.moved_position} "
                f"(cut i={c.cut}, max |delta| over 0..{c.cut} = {c.prefix_delta:.3g} > tolerance {c.tolerance:.3g})"
            )
        if v == "nonfinite":
            c = next(c for c in self.cuts if c.status == "nonfinite")
            return f"the output holds {c.nonfinite} non-finite values (cut i={c.cut}); causality cannot be judged on them"
        if v == "vacuous":
            c = next(c for c in self.cuts if c.status == "vacuous")
            return (
                f"vacuous: the intervention changed nothing (cut i={c.cut}: suffix |delta| {c.suffix_delta:.3g} "
                f"<= threshold {c.threshold:.3g}, prefix |delta| {c.prefix_delta:.3g})"
            )
        return (
            f"causal at every cut: prefix |delta| <= {self.max_prefix_delta:.3g} (tolerance "
            f"{self.rel_tolerance * self.scale:.3g}), suffix |delta| >= {self.min_suffix_delta:.3g} "
            f"(threshold {self.suffix_fraction * self.scale:.3g})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "grad_mode": self.grad_mode,
            "verdict": self.verdict,
            "ok": self.ok,
            "summary": self.summary(),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scale": json_number(self.scale),
            "rel_tolerance": self.rel_tolerance,
            "suffix_fraction": self.suffix_fraction,
            "error": self.error,
            "cuts": [c.to_json() for c in self.cuts],
        }


def _replacement(x: "torch.Tensor", cut: int, seed: int) -> "torch.Tensor":
    """x with positions cut+1.. replaced by fresh values of x's own size (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + cut + 17)
    b, t, e = x.shape
    x64 = x.detach().to(torch.float64)
    rms = float(x64.square().mean().sqrt()) or 1.0
    fresh = torch.randn(b, t - cut - 1, e, generator=g, dtype=torch.float64) * rms  # [B, T-i-1, E]
    x2 = x.detach().clone()
    x2[:, cut + 1 :] = fresh.to(dtype=x.dtype, device=x.device)
    return x2


def default_cuts(seq_len: int) -> tuple[int, ...]:
    """Every cut 0..T-2 (a cut at T-1 would change nothing)."""
    return tuple(range(max(seq_len - 1, 0)))


def causal_intervention(
    forward: Callable[[Any], Any],
    x: "torch.Tensor",
    *,
    cuts: Sequence[int] | None = None,
    grad_mode: GradMode = "no_grad",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> InterventionResult:
    """Test causality by intervention on any forward ``[B, T, E] -> [B, T, E]``.

    The caller chooses the module's mode (put it in eval mode first: dropout would
    otherwise look like a leak). A forward that raises or returns the wrong shape is
    reported in ``error``, not raised.

    Args:
        forward: called as ``forward(x)``; may return a tensor or a tuple starting with one.
        x: the unchanged input ``[B, T, E]``, T >= 2.
        cuts: cut positions i in 0..T-2; None means all of them.
        grad_mode: ``no_grad`` runs under ``torch.no_grad()`` (the inference path);
            ``autograd`` runs with grad enabled and an input that requires grad (the
            training path, which some modules route differently).
        seed: seeds the replacement values.
        progress: ``callback(done, total)`` after each forward.

    Returns:
        An :class:`InterventionResult`; ``.verdict`` is ``causal`` only if every cut passes.
    """
    import torch

    if grad_mode not in GRAD_MODES:
        raise ValueError(f"grad_mode: got {grad_mode!r}, expected one of {GRAD_MODES}")
    b, t, e = x.shape
    cut_list = tuple(default_cuts(t) if cuts is None else cuts)
    total = len(cut_list) + 1
    rel = relative_tolerance(x.dtype)
    frac = suffix_fraction(x.dtype)
    base = dict(grad_mode=grad_mode, shape=(b, t, e), rel_tolerance=rel, suffix_fraction=frac)
    try:
        y1 = _run(forward, x, grad_mode)  # [B, T, E]
    except ForwardError as exc:
        return InterventionResult(dtype=str(x.dtype).removeprefix("torch."), scale=0.0, error=str(exc), **base)
    dtype = str(y1.dtype).removeprefix("torch.")
    rel, frac = relative_tolerance(y1.dtype), suffix_fraction(y1.dtype)
    base.update(rel_tolerance=rel, suffix_fraction=frac)
    scale = output_scale(y1)
    if progress:
        progress(1, total)
    results = []
    for n, cut in enumerate(cut_list, start=2):
        try:
            y2 = _run(forward, _replacement(x, cut, seed), grad_mode)  # [B, T, E]
        except ForwardError as exc:
            return InterventionResult(dtype=dtype, scale=scale, error=str(exc), **base)
        delta = abs_delta(y1, y2)  # [B, T, E]
        per_pos = delta.amax(dim=(0, 2))  # [T]
        tol, thr = rel * scale, frac * scale
        prefix = float(per_pos[: cut + 1].max())
        suffix = float(per_pos[cut + 1 :].max())
        moved = [p for p in range(cut + 1) if not float(per_pos[p]) <= tol]
        nonfinite = int((~torch.isfinite(y1)).sum() + (~torch.isfinite(y2)).sum())
        results.append(CutResult(cut, prefix, suffix, tol, thr, moved[0] if moved else None, nonfinite))
        if progress:
            progress(n, total)
    return InterventionResult(dtype=dtype, scale=scale, cuts=tuple(results), **base)


def module_forward(module: "nn.Module") -> Callable[["torch.Tensor"], Any]:
    """``module(x)``, so a module can be handed to :func:`causal_intervention`."""
    return lambda x: module(x)


@dataclass(frozen=True)
class Determinism:
    """Two eval-mode calls on the same input: bitwise identical or not."""

    identical: bool
    max_delta: float
    error: str | None = None

    def summary(self) -> str:
        if self.error is not None:
            return self.error
        if self.identical:
            return "two eval-mode calls on the same input are bitwise identical"
        return (
            f"two eval-mode calls on the same input differ (max |delta| {self.max_delta:.3g}): dropout left on at "
            "evaluation, or state carried between calls"
        )

    def to_json(self) -> dict[str, Any]:
        return {"identical": self.identical, "max_delta": json_number(self.max_delta), "error": self.error, "summary": self.summary()}


def eval_determinism(forward: Callable[[Any], Any], x: "torch.Tensor") -> Determinism:
    """Call ``forward(x)`` twice under ``no_grad`` and compare bitwise (the caller sets eval mode)."""
    import torch

    try:
        with torch.no_grad():
            y1 = call_forward(forward, x.clone())
            y2 = call_forward(forward, x.clone())
    except ForwardError as exc:
        return Determinism(False, math.nan, str(exc))
    identical = bool(torch.equal(y1, y2)) or bool(torch.equal(y1.isnan(), y2.isnan()) and torch.equal(y1.nan_to_num(0.0), y2.nan_to_num(0.0)))
    return Determinism(identical, float(abs_delta(y1, y2).max()) if y1.numel() else 0.0)


@dataclass(frozen=True)
class ControlResult:
    """A module built to leak: the test has power only if it reports a leak."""

    name: str
    description: str
    result: InterventionResult

    @property
    def failed_as_expected(self) -> bool:
        return self.result.verdict == "leak"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "failed_as_expected": self.failed_as_expected,
            "result": self.result.to_json(),
        }


@dataclass(frozen=True)
class Finding:
    """One thing that does not hold, at the lowest level that shows it."""

    level: int
    check: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "check": self.check, "detail": self.detail}


def builtin_controls(embed_dim: int, num_heads: int, seed: int, dtype: "torch.dtype") -> list[tuple[str, str, "nn.Module"]]:
    """The two leaking controls on the built-in pipeline: masking off, and the mask in the wrong polarity."""
    from attn_ledger.model import BuiltinAttention

    return [
        ("causal-off", "built-in pipeline, causal masking disabled",
         BuiltinAttention(embed_dim, num_heads, causal=False, seed=seed, dtype=dtype).eval()),
        ("mask-polarity", "built-in pipeline, causal mask in the wrong polarity",
         BuiltinAttention(embed_dim, num_heads, causal=True, fault="mask-polarity", seed=seed, dtype=dtype).eval()),
    ]


@dataclass(frozen=True)
class InterventionReport:
    """What ``attn-ledger intervene`` found: both grad paths, determinism, and the controls.

    Attributes:
        subject: what was tested (``built-in pipeline ...`` or ``module file.py:NAME``).
        shape: ``(B, T, E)``; num_heads: Nh.
        paths: one :class:`InterventionResult` per grad mode.
        determinism: two eval-mode calls compared bitwise (None if the forward failed first).
        controls: leaking modules that must be reported as leaks.
        controls_note: why controls ran where they ran, or why they did not.
        training_mode_on_entry: the module came back from its factory in training mode.
    """

    subject: str
    shape: tuple[int, ...]
    num_heads: int
    paths: tuple[InterventionResult, ...]
    determinism: Determinism | None
    controls: tuple[ControlResult, ...] = ()
    controls_note: str = ""
    training_mode_on_entry: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def findings(self) -> tuple[Finding, ...]:
        out: list[Finding] = []
        for p in self.paths:
            if p.error is not None:
                out.append(Finding(1, f"forward ({p.grad_mode})", p.error))
        if self.determinism is not None and not self.determinism.identical and self.determinism.error is None:
            out.append(Finding(4, "eval_determinism", self.determinism.summary()))
        for p in self.paths:
            if p.error is None and not p.ok:
                out.append(Finding(4, f"causal_intervention ({p.grad_mode})", p.summary()))
        for c in self.controls:
            if not c.failed_as_expected:
                out.append(Finding(4, f"control {c.name}", (
                    f"the control ({c.description}) was not reported as a leak (verdict {c.result.verdict}): "
                    "the test has no power here")))
        out.sort(key=lambda f: f.level)
        return tuple(out)

    @property
    def verdict(self) -> str:
        f = self.findings
        if not f:
            return "causal"
        first = f[0]
        if first.level == 1:
            return "error"
        if first.check.startswith("control"):
            return "no power"
        if first.check == "eval_determinism":
            return "nondeterministic"
        return next(p.verdict for p in self.paths if not p.ok)

    @property
    def exit_code(self) -> int:
        return 0 if not self.findings else 1

    def to_json(self) -> dict[str, Any]:
        b, t, e = self.shape
        return envelope(
            "intervene",
            self.verdict,
            subject=self.subject,
            sizes={"B": b, "T": t, "E": e, "Nh": self.num_heads},
            first_finding=self.findings[0].to_json() if self.findings else None,
            findings=[f.to_json() for f in self.findings],
            paths=[p.to_json() for p in self.paths],
            eval_determinism=self.determinism.to_json() if self.determinism else None,
            controls=[c.to_json() for c in self.controls],
            controls_note=self.controls_note,
            training_mode_on_entry=self.training_mode_on_entry,
            notes=list(self.notes),
        )

    def to_markdown(self) -> str:
        return _render_markdown(self)

    def to_rich(self) -> Any:
        return _render_rich(self)


def intervene_report(
    module: "nn.Module",
    x: "torch.Tensor",
    *,
    subject: str,
    num_heads: int,
    cuts: Sequence[int] | None = None,
    controls: Sequence[tuple[str, str, "nn.Module"]] = (),
    controls_note: str = "",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> InterventionReport:
    """Run the intervention on ``module`` in eval mode under both grad modes, then the controls.

    Args:
        module: the module under test; it is put into eval mode here.
        x: the input ``[B, T, E]``.
        subject: a name for the output.
        num_heads: Nh, for the output only.
        cuts: cut positions; None means 0..T-2.
        controls: ``(name, description, module)`` triples that must leak.
        controls_note: shown with the controls.
        seed: seeds the replacement values.
        progress: ``callback(done, total)``.
    """
    training = bool(module.training)
    module.eval()
    t = x.shape[1]
    n_cuts = len(default_cuts(t) if cuts is None else cuts)
    per_run = n_cuts + 1
    total = per_run * (2 + len(controls)) + 2
    done = 0

    def step(offset: int) -> Callable[[int, int], None] | None:
        if progress is None:
            return None
        return lambda d, _t: progress(offset + d, total)

    paths = []
    for mode in GRAD_MODES:
        paths.append(causal_intervention(module_forward(module), x, cuts=cuts, grad_mode=mode, seed=seed, progress=step(done)))
        done += per_run
    determinism = None
    if all(p.error is None for p in paths):
        determinism = eval_determinism(module_forward(module), x)
    done += 2
    if progress:
        progress(done, total)
    control_results = []
    for name, description, control in controls:
        control.eval()
        r = causal_intervention(module_forward(control), x, cuts=cuts, grad_mode="no_grad", seed=seed, progress=step(done))
        control_results.append(ControlResult(name, description, r))
        done += per_run
    if progress:
        progress(total, total)
    notes = []
    if training:
        notes.append("the module came back in training mode; the intervention ran it in eval mode")
    return InterventionReport(
        subject=subject,
        shape=tuple(x.shape),
        num_heads=num_heads,
        paths=tuple(paths),
        determinism=determinism,
        controls=tuple(control_results),
        controls_note=controls_note,
        training_mode_on_entry=training,
        notes=tuple(notes),
    )


# --- rendering (formats only) ------------------------------------------------------

def _g(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def _cut_rows(report: InterventionReport) -> list[list[str]]:
    rows = []
    ok_paths = [p for p in report.paths if p.error is None]
    if not ok_paths:
        return rows
    for idx, cut in enumerate(ok_paths[0].cuts):
        row = [str(cut.cut), f"{cut.cut + 1}..{report.shape[1] - 1}"]
        for p in report.paths:
            if p.error is not None:
                row += ["-", "-", "error"]
                continue
            c = p.cuts[idx]
            moved = f"@{c.moved_position}" if c.status == "leak" else ""
            row += [_g(c.prefix_delta), _g(c.suffix_delta), c.status + moved]
        rows.append(row)
    return rows


def _cut_headers(report: InterventionReport) -> list[str]:
    headers = ["cut i", "changed"]  # a status "leak@p" names the first position p <= i that moved
    for p in report.paths:
        headers += [f"{p.grad_mode} prefix", f"{p.grad_mode} suffix", f"{p.grad_mode}"]
    return headers


def _bounds_line(report: InterventionReport) -> str | None:
    p = next((p for p in report.paths if p.error is None), None)
    if p is None:
        return None
    return (
        f"output scale max|y| = {p.scale:.3g} ({p.dtype}); prefix must be <= tolerance {p.rel_tolerance * p.scale:.3g} "
        f"(= {p.rel_tolerance:.3g} x scale, torch.testing defaults); suffix must be > threshold "
        f"{p.suffix_fraction * p.scale:.3g} (= {p.suffix_fraction:.3g} x scale)"
    )


def _summary_rows(report: InterventionReport) -> list[list[str]]:
    rows = []
    for p in report.paths:
        rows.append(["subject", p.grad_mode, p.verdict, "causal", _g(p.max_prefix_delta), _g(p.min_suffix_delta),
                     "yes" if p.ok else "NO"])
    for c in report.controls:
        r = c.result
        rows.append([f"control {c.name}", r.grad_mode, r.verdict, "leak", _g(r.max_prefix_delta), _g(r.min_suffix_delta),
                     "yes" if c.failed_as_expected else "NO"])
    return rows


_SUMMARY_HEADERS = ["run", "path", "verdict", "expected", "max prefix delta", "min suffix delta", "as expected"]


def _title(report: InterventionReport) -> str:
    b, t, e = report.shape
    return f"CAUSAL INTERVENTION  {report.subject}  B={b} T={t} E={e} Nh={report.num_heads}"


def _lines(report: InterventionReport) -> list[str]:
    lines = []
    bounds = _bounds_line(report)
    if bounds:
        lines.append(bounds)
    if report.determinism is not None:
        lines.append(("eval determinism: " if report.determinism.identical else "eval determinism: FINDING: ")
                     + report.determinism.summary())
        if not report.determinism.identical:
            lines.append("the per-cut deltas above then include that randomness: make eval calls agree first, then rerun")
    if report.controls_note:
        lines.append("controls: " + report.controls_note)
    lines.extend(report.notes)
    findings = report.findings
    if findings:
        f = findings[0]
        lines.append(f"first finding: L{f.level} {f.check}: {f.detail}")
    else:
        lines.append("first finding: none")
    return lines


def _render_rich(report: InterventionReport) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(_title(report), style="bold")]
    cut_rows = _cut_rows(report)
    if cut_rows:
        table = Table(title="subject, per cut: max |y1 - y2| over the prefix 0..i and the suffix i+1..", title_justify="left")
        for h in _cut_headers(report):
            table.add_column(h, justify="right" if h.endswith(("prefix", "suffix")) else "left")
        for row in cut_rows:
            table.add_row(*row)
        parts.append(table)
    summary = Table(title="verdicts", title_justify="left")
    for h in _SUMMARY_HEADERS:
        summary.add_column(h, justify="right" if "delta" in h else "left", no_wrap=h in ("run", "path", "verdict"))
    for row in _summary_rows(report):
        summary.add_row(*row)
    parts.append(summary)
    for line in _lines(report):
        parts.append(Text(line, style="bold red" if line.startswith("first finding: L") or "FINDING" in line else ""))
    return Group(*parts)


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _render_markdown(report: InterventionReport) -> str:
    out = [f"## {_title(report)}", ""]
    cut_rows = _cut_rows(report)
    if cut_rows:
        out += _md_table(_cut_headers(report), cut_rows) + [""]
    out += _md_table(_SUMMARY_HEADERS, _summary_rows(report)) + [""]
    out += [f"- {line}" for line in _lines(report)]
    return "\n".join(out) + "\n"
