"""Probing a forward ``[B, T, E] -> [B, T, E]`` from outside: calling it, comparing outputs, the intervention.

Both ``check --module`` (:mod:`attn_ledger.probes.module.check`) and ``intervene``
(:mod:`attn_ledger.experiments.intervene`) build on this module; it imports neither.

The causal intervention: the output at position i must not depend on the input at any
position j > i. For each cut i it replaces the input at positions i+1.. with fresh values,
reruns the forward and measures, on the output ``[B, T, E]``:

* prefix delta: max |y1-y2| over positions 0..i. Causality needs it to be zero, within
  the dtype's tolerance.
* suffix delta: max |y1-y2| over positions i+1... It must be clearly nonzero: if both
  are zero the intervention changed nothing and proves nothing ("vacuous").

Tolerances are torch.testing.assert_close's defaults for the output dtype
(:func:`attn_ledger.tolerance.relative`), applied to the output's own scale (max |y| of the
unchanged run), because some real layers produce very small outputs and an absolute 1e-5
would hide a leak in them.

The results are data (:class:`CutResult`, :class:`InterventionResult`,
:class:`Determinism`); :func:`cut_checks`, :func:`path_check` and
:func:`determinism_check` judge them as :class:`~attn_ledger.report.Check` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

from attn_ledger.errors import SetupError, first_line
from attn_ledger.guard import UserCodeError, outcome, user_call
from attn_ledger.report import Check, bounded, counted
from attn_ledger.seeding import generator
from attn_ledger.tolerance import relative as relative_tolerance

if TYPE_CHECKING:
    import torch
    from torch import nn

GradMode = Literal["no_grad", "autograd"]
GRAD_MODES: tuple[GradMode, ...] = ("no_grad", "autograd")

# The suffix must move by at least this fraction of the output scale (and by at least ten
# prefix tolerances, which matters only for the half-precision dtypes).
SUFFIX_FRACTION = 1e-3


def suffix_fraction(dtype: "torch.dtype | str") -> float:
    """The fraction of an output's scale by which the changed positions must move."""
    return max(SUFFIX_FRACTION, 10 * relative_tolerance(dtype))


# --- calling user code -------------------------------------------------------------------

class ForwardError(Exception):
    """The forward raised, or returned something other than a ``[B, T, E]`` tensor.

    ``data`` holds the facts as values: ``input`` (shape), and ``output`` (shape) or
    ``exception`` (the exception's type name) or ``returned`` (the type returned).
    """

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.data: dict[str, Any] = data


def first_output(result: Any) -> "torch.Tensor":
    """A forward's output tensor: the result itself, or the first item of a tuple/list.

    Raises:
        ForwardError: not a tensor, or a tensor no comparison can read (sparse, on the meta device).
    """
    import torch

    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise ForwardError(f"forward returned {type(result).__name__}, expected a tensor [B, T, E] or a tuple starting with one",
                           returned=type(result).__name__)
    if result.layout != torch.strided:
        layout = str(result.layout).removeprefix("torch.")
        raise ForwardError(f"forward returned a tensor with layout {layout}, expected a dense (strided) tensor [B, T, E]",
                           layout=layout)
    if result.is_meta:
        raise ForwardError("forward returned a tensor on the meta device, which holds no values to compare", device="meta")
    return result


def call_forward(forward: Callable[[Any], Any], x: "torch.Tensor", expect_shape: bool = True,
                 what: str | None = None) -> "torch.Tensor":
    """Run ``forward(x)`` as one guarded call into user code and return its output tensor.

    Args:
        what: how to name the call in a finding (default ``forward(x) on input (B, T, E)``).

    Raises:
        ForwardError: the forward raised, or returned something other than a tensor of x's shape.
        UserCodeError: the forward exited or ran past its time limit (see :mod:`attn_ledger.guard`).
    """
    shape = list(x.shape)
    try:
        with user_call(what or f"forward(x) on input {tuple(x.shape)}"):
            result = forward(x)
        y = first_output(result)
    except ForwardError as exc:
        exc.data.setdefault("input", shape)
        raise
    except UserCodeError:
        raise
    except Exception as exc:  # the user's forward may raise anything
        raise ForwardError(f"forward raised {type(exc).__name__} on input {tuple(x.shape)}: {first_line(exc)}",
                           input=shape, exception=type(exc).__name__) from None
    if expect_shape and tuple(y.shape) != tuple(x.shape):
        raise ForwardError(f"forward returned shape {tuple(y.shape)} for input {tuple(x.shape)} [B, T, E], expected the same shape",
                           input=shape, output=list(y.shape))
    return y


def forward_failure(level: int, name: str, exc: ForwardError, prefix: str = "") -> Check:
    """A failing check for a forward that raised or returned the wrong thing (its message as the reason)."""
    return Check(level, name, "fail", reason=f"{prefix}{exc}", data=dict(exc.data))


def module_forward(module: "nn.Module") -> Callable[["torch.Tensor"], Any]:
    """``module(x)``, so a module can be handed to :func:`causal_intervention`."""
    return lambda x: module(x)


def build_module(factory: Callable[..., Any], embed_dim: int, num_heads: int, field: str = "module") -> "nn.Module":
    """Call ``factory(embed_dim, num_heads)``; a raise, an exit or a non-module is a :class:`SetupError` naming ``field``."""
    from torch import nn

    try:
        with user_call(f"factory({embed_dim}, {num_heads})"):
            module = factory(embed_dim, num_heads)
    except Exception as exc:  # the user's factory may raise (or exit) anything
        raise SetupError(f"{field}: factory({embed_dim}, {num_heads}) {outcome(exc)}") from None
    if not isinstance(module, nn.Module):
        raise SetupError(f"{field}: factory({embed_dim}, {num_heads}) returned {type(module).__name__}, expected an nn.Module")
    return module


def module_dtype(module: "nn.Module", default: "torch.dtype | None" = None) -> "torch.dtype":
    """The dtype of the module's first floating-point parameter (``default``, else float32, if none)."""
    import torch

    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return default if default is not None else torch.float32


# --- comparing outputs -----------------------------------------------------------------

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
class Closeness:
    """``max |a - b|`` against a tolerance relative to b's scale."""

    delta: float
    tolerance: float
    scale: float
    rel_tolerance: float

    @property
    def ok(self) -> bool:
        return self.delta <= self.tolerance

    def data(self) -> dict[str, float]:
        """The tolerance's parts, for a check's ``data``."""
        return {"scale": self.scale, "rel_tolerance": self.rel_tolerance}


def closeness(a: "torch.Tensor", b: "torch.Tensor", dtype: "torch.dtype") -> Closeness:
    """How far ``a`` is from ``b``, with the tolerance ``relative_tolerance(dtype) * max|b|``."""
    delta = float(abs_delta(a, b).max()) if a.numel() else 0.0
    scale = output_scale(b)
    rel = relative_tolerance(dtype)
    return Closeness(delta, rel * scale, scale, rel)


# --- the intervention ---------------------------------------------------------------------

@dataclass(frozen=True)
class CutResult:
    """One cut: the input changed at positions cut+1.., the output compared on both sides.

    Attributes:
        cut: i; positions 0..i kept, i+1.. replaced.
        prefix_delta: max |y1-y2| over positions 0..i (must be <= tolerance).
        suffix_delta: max |y1-y2| over positions i+1.. (must be > threshold).
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
    def leaked(self) -> bool:
        return not self.prefix_delta <= self.tolerance

    @property
    def moved(self) -> bool:
        return self.suffix_delta > self.threshold

    @property
    def status(self) -> str:
        """``leak``, ``nonfinite``, ``vacuous`` or ``pass``, in that order of precedence."""
        if self.leaked:
            return "leak"
        if self.nonfinite:
            return "nonfinite"
        if not self.moved:
            return "vacuous"
        return "pass"


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
    error: ForwardError | None = field(default=None, compare=False)

    @property
    def tolerance(self) -> float:
        return self.rel_tolerance * self.scale

    @property
    def threshold(self) -> float:
        return self.suffix_fraction * self.scale

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


def _grad_context(grad_mode: GradMode):
    import torch

    return torch.no_grad() if grad_mode == "no_grad" else torch.enable_grad()


def _run(forward: Callable, x: "torch.Tensor", grad_mode: GradMode) -> "torch.Tensor":
    with _grad_context(grad_mode):
        x_in = x.detach().clone()
        if grad_mode == "autograd":
            x_in.requires_grad_(True)
        y = call_forward(forward, x_in, what=f"forward(x) under {grad_mode} on input {tuple(x.shape)}")
    return y.detach()


def _replacement(x: "torch.Tensor", cut: int, seed: int) -> "torch.Tensor":
    """x with positions cut+1.. replaced by fresh values of x's own size (seeded)."""
    import torch

    g = generator(seed * 1000 + cut + 17)
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


def causal_intervention(  # long by its documented arguments; the code is under 35 lines
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
    base = dict(grad_mode=grad_mode, shape=(b, t, e))
    try:
        y1 = _run(forward, x, grad_mode)  # [B, T, E]
    except ForwardError as exc:
        return InterventionResult(dtype=str(x.dtype).removeprefix("torch."), scale=0.0, error=exc,
                                  rel_tolerance=relative_tolerance(x.dtype), suffix_fraction=suffix_fraction(x.dtype), **base)
    dtype = str(y1.dtype).removeprefix("torch.")
    rel, frac = relative_tolerance(y1.dtype), suffix_fraction(y1.dtype)
    base.update(dtype=dtype, rel_tolerance=rel, suffix_fraction=frac)
    scale = output_scale(y1)
    if progress:
        progress(1, total)
    results = []
    for n, cut in enumerate(cut_list, start=2):
        try:
            y2 = _run(forward, _replacement(x, cut, seed), grad_mode)  # [B, T, E]
        except ForwardError as exc:
            return InterventionResult(scale=scale, error=exc, **base)
        per_pos = abs_delta(y1, y2).amax(dim=(0, 2))  # [T]
        tol, thr = rel * scale, frac * scale
        moved = [p for p in range(cut + 1) if not float(per_pos[p]) <= tol]
        nonfinite = int((~torch.isfinite(y1)).sum() + (~torch.isfinite(y2)).sum())
        results.append(CutResult(cut, float(per_pos[: cut + 1].max()), float(per_pos[cut + 1 :].max()), tol, thr,
                                 moved[0] if moved else None, nonfinite))
        if progress:
            progress(n, total)
    return InterventionResult(scale=scale, cuts=tuple(results), **base)


# --- judging the intervention -----------------------------------------------------------

PREFIX_MEASURE = "max |y1-y2| over positions 0..i"
SUFFIX_MEASURE = "max |y1-y2| over positions i+1.."


def cut_checks(cut: CutResult, location: Mapping[str, Any] | None = None) -> tuple[Check, ...]:
    """The three checks of one cut, in order of precedence: the prefix holds still, the outputs
    are finite, the suffix moves.

    All three are level 4: they judge one behavioural experiment, and a leak seen on finite
    prefix values is the finding even where other outputs are not finite (a query with every
    key blocked gives NaN in both runs, and the prefix still moved). ``suffix_moved`` passes
    only when the suffix delta is strictly above the threshold (an output of zeros moves by
    0, at a threshold of 0, and proves nothing).
    """
    where = dict(location or {})
    where["cut"] = cut.cut
    prefix_at = {**where, "position": cut.moved_position} if cut.leaked else where
    prefix = bounded(4, "prefix_unchanged", PREFIX_MEASURE, cut.prefix_delta, cut.tolerance, location=prefix_at,
                     reason="the past moved when only the future changed" if cut.leaked else "")
    finite = counted(4, "finite", "non-finite output values over both runs", cut.nonfinite, location=where,
                     reason="causality cannot be judged on them" if cut.nonfinite else "")
    suffix = Check(4, "suffix_moved", "pass" if cut.moved else "fail", SUFFIX_MEASURE, cut.suffix_delta,
                   cut.threshold, ">=", location=where,
                   reason="" if cut.moved else "the intervention changed nothing, so it proves nothing")
    return prefix, finite, suffix


def path_check(result: InterventionResult, name: str) -> Check:
    """L4, one check for a whole grad path: the first failing cut's number, or the largest prefix delta.

    A leak at any cut outranks the other failures of a path (non-finite output, a suffix that
    did not move), as within a cut.
    """
    if result.error is not None:
        return forward_failure(4, name, result.error)
    data = {"grad_mode": result.grad_mode, "cuts": [c.cut for c in result.cuts], "scale": result.scale,
            "rel_tolerance": result.rel_tolerance, "suffix_fraction": result.suffix_fraction,
            "threshold": result.threshold, "min_suffix_delta": result.min_suffix_delta, "verdict": result.verdict}
    failing = [c for cut in result.cuts for c in cut_checks(cut) if c.failed]
    if failing:
        first = next((c for c in failing if c.name == "prefix_unchanged"), failing[0])
        return Check(4, name, "fail", first.measure, first.value, first.limit, first.op,
                     location=first.location, reason=first.reason, data=data)
    return bounded(4, name, PREFIX_MEASURE + ", every cut", result.max_prefix_delta or 0.0, result.tolerance, data=data)


@dataclass(frozen=True)
class Determinism:
    """Two eval-mode calls on the same input: bitwise identical or not."""

    identical: bool
    max_delta: float
    error: ForwardError | None = None


def eval_determinism(forward: Callable[[Any], Any], x: "torch.Tensor") -> Determinism:
    """Call ``forward(x)`` twice under ``no_grad`` and compare bitwise (the caller sets eval mode)."""
    import torch

    try:
        with torch.no_grad():
            y1 = call_forward(forward, x.clone())
            y2 = call_forward(forward, x.clone())
    except ForwardError as exc:
        return Determinism(False, math.nan, exc)
    identical = bool(torch.equal(y1, y2)) or bool(torch.equal(y1.isnan(), y2.isnan()) and torch.equal(y1.nan_to_num(0.0), y2.nan_to_num(0.0)))
    return Determinism(identical, float(abs_delta(y1, y2).max()) if y1.numel() else 0.0)


def determinism_check(det: Determinism) -> Check:
    """L4: two eval-mode calls on the same input agree bitwise."""
    if det.error is not None:
        return forward_failure(4, "eval_determinism", det.error)
    return Check(4, "eval_determinism", "pass" if det.identical else "fail", "max |y1-y2| between two eval-mode calls",
                 det.max_delta, 0.0, "<=",
                 reason="" if det.identical else "dropout left on at evaluation, or state carried between calls")


def builtin_controls(embed_dim: int, num_heads: int, seed: int, dtype: "torch.dtype") -> list[tuple[str, str, "nn.Module"]]:
    """The two leaking controls on the built-in pipeline: masking off, and the mask in the wrong polarity."""
    from attn_ledger.maths.layer import BuiltinAttention

    return [
        ("causal-off", "built-in pipeline, causal masking disabled",
         BuiltinAttention(embed_dim, num_heads, causal=False, seed=seed, dtype=dtype).eval()),
        ("mask-polarity", "built-in pipeline, causal mask in the wrong polarity",
         BuiltinAttention(embed_dim, num_heads, causal=True, fault="mask-polarity", seed=seed, dtype=dtype).eval()),
    ]


def control_check(name: str, description: str, result: InterventionResult) -> Check:
    """L4: a control built to leak is reported as a leak, or the probe has no power here."""
    leaked = result.verdict == "leak"
    value = result.max_prefix_delta
    return Check(4, "control_leaks", "pass" if leaked else "fail", PREFIX_MEASURE + ", largest over the cuts",
                 math.nan if value is None else value, result.tolerance, ">=",
                 reason="" if leaked else "a control built to leak was not reported as a leak: the probe has no power here",
                 data={"control": name, "description": description, "verdict": result.verdict})
