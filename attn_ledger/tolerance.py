"""The one tolerance policy: how close two results must be for every command to call them equal.

Each rule is keyed by the dtype the judged computation ran in, and each says what it is
measured against:

* :func:`reference`: a computation against the float64 reference, elementwise
  ``|a - ref| <= atol + rtol * |ref|`` (the ledger scales ``atol`` by ``max(1, max |ref|)``): the
  ledger's comparisons with SDPA, its backward stages and its pinned backends;
* :func:`row_sum`: how far a row of attention weights may sum from one;
* half precision (:data:`HALF_DTYPES`): the error against float64 may be at most
  :data:`HALF_FACTOR` times the error of the plain same-dtype computation, never less
  than :func:`half_floor`, since rounding to 8 or 11 bits dominates any fixed bound;
* :func:`rounding` (``check`` on a kernel, for out, dq, dk and dv against float64, and ``run``'s
  scores, weights and context and, with ``--grad``, its backward stage tensors, in every dtype): elementwise
  ``|err| <= c * eps(dtype) * M``, where ``M`` is the magnitude of the quantity's summands (the
  same computation on absolute values, :func:`attn_ledger.probes.kernel.reference.magnitudes`) and ``c`` is
  calibrated per quantity and dtype (:data:`ROUNDING_C`, with the measurement that set it). The
  suites' views (:data:`SUITES`) are kept beside it as data;
* :data:`HALF_PRECISION_RATIO`: how much worse than the float32-accumulating plain computation a
  half-precision kernel's output may be before ``check``'s ``precision`` check warns;
* :func:`kernel`: the older factor rule over the plain same-dtype computation, with a floor
  scaled by the largest value magnitude: the bound ``check``'s probes move within. A probe compares
  two calls of the kernel (on inputs that differ only where the output must not depend on them), not
  a call with float64: their difference is at most the two calls' errors, each within the rounding
  rule the reference check applies already, so no ``M`` of its own is needed. Measured over the
  correct-kernel corpus at three capabilities (scripts/margins.py), every isolation and intervention
  probe of a correct kernel differs by exactly 0 (the unmoved rows come out bit for bit), so the
  factor's size never meets a correct kernel; the near-threshold faults are caught elsewhere;
  :func:`kernel_bound` gives it with its parts as data, never infinite or NaN;
* :func:`assert_close` / :func:`relative`: torch.testing.assert_close's defaults, for
  comparing a user module's outputs with each other relative to the output's own scale
  (interventions, batch independence, permutation);
* :data:`PROBE_ATOL`: an absolute bound for float32 outputs of unit-scale probe inputs
  against float64 (``polarity``);
* the observed core of a module (``check --module``): :func:`norm_pattern` (two heads' vector
  norms are the same vectors'), :func:`logit` (a logit read back from weights),
  :func:`fitted_scale` (a fitted softmax scale equals a value), and :data:`GRADCHECK` /
  :data:`GRADCHECK_FLOAT32_INSIDE` (gradcheck's step and tolerances).

Nothing here imports torch; dtypes may be given as ``torch.dtype`` or by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# (rtol, atol) per dtype for a computation against the float64 reference.
_REFERENCE = {
    "float64": (1e-9, 1e-9),
    "float32": (2e-5, 2e-5),
    "bfloat16": (3e-2, 1e-2),
    "float16": (4e-3, 2e-3),
}

HALF_DTYPES = ("float16", "bfloat16")
HALF_FACTOR = 4.0  # an implementation may be this many times worse than the plain same-dtype computation
_HALF_FLOOR = {"float16": 1e-3, "bfloat16": 8e-3}  # the smallest plain error the factor rule divides by

MIN_ROW_SUM = 1e-5  # the row-sum tolerance is never tighter than this, whatever the dtype

KERNEL_FACTOR = HALF_FACTOR
_KERNEL_FLOOR = {"float64": 1e-10, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}
# Where the plain computation is not finite there is nothing to scale: a bound a correct kernel in that
# dtype meets on unit-scale values, times the values' scale.
_KERNEL_FALLBACK = {"float64": 1e-9, "float32": 2e-5, "float16": 1e-2, "bfloat16": 8e-2}
EPS = {"float64": 2.220446049250313e-16, "float32": 1.1920928955078125e-07, "float16": 0.0009765625,
       "bfloat16": 0.0078125}

# --- check on a kernel: error bounds from how rounding grows --------------------------------------

ROUNDING_QUANTITIES = ("out", "dq", "dk", "dv", "scores", "weights", "context", "grad_context", "grad_weights",
                       "grad_scores", "grad_q", "grad_k", "grad_values", "grad_sinks", "grad_projections",
                       "grad_input")


def _every_dtype(c: float) -> dict[str, float]:
    """One ``c`` for every dtype, in :data:`ROUNDING_C`'s order."""
    return {dtype: c for dtype in ("float64", "float32", "float16", "bfloat16")}


# c per (quantity, dtype) in ``|err| <= c * eps(dtype) * M``. Each is at least twice the worst
# error / (eps * M) measured on correct kernels, so that a correct kernel stays within half its
# bound. Measured on torch 2.13.0+cpu, AMD EPYC, with the rule as it stands: default tier at
# ATEN_CPU_CAPABILITY unset (AVX512; seeds 0-1, all kernels), default (seed 0) and avx2 (seed 1),
# and the full tier at AVX512 (seed 0: SDPA with enable_gqa, online softmax at 64 keys, split-K),
# over kernels: SDPA with enable_gqa and an explicit bottom-right mask (sdpa_adapter.py), SDPA over
# repeat_interleave (good.py), SDPA's math backend, expand + reshape then a plain softmax, einsum
# with the query heads grouped, a blocked online softmax at 16, 64 and 128 keys (online_softmax.py),
# split-K decode over 4 splits, a half kernel computing in float32 and a softmax in float32
# (float32_softmax.py; neither at the float64 level). Beside each c: the worst err / (eps * M) for
# float64 (at its own level, for precision), float32, float16, bfloat16, and in brackets the worst
# of the two imprecise half kernels (fixtures/kernels/precision), which the bound lets through to the
# precision bar (default tier, seeds 0-2, AVX512).
ROUNDING_C: dict[str, dict[str, float]] = {
    "out": _every_dtype(2.0),  # 0.09, 0.12, 0.29 (1.82), 0.23
    "dq": _every_dtype(2.0),  # 0.03, 0.05, 0.06 (0.37), 0.08
    "dk": {"float64": 2.0, "float32": 2.0, "float16": 2.0, "bfloat16": 4.0},  # 0.03, 0.21, 0.42 (0.58), 0.17
    # half dv: the upstream gradient is rounded to the dtype before the kernel sees it, the result rounds
    # again, and the imprecise kernels reach 3.8 (bfloat16 softmax) and 3.7 (float16 sum): c stays at 8
    "dv": {"float64": 2.0, "float32": 2.0, "float16": 8.0, "bfloat16": 8.0},  # 0.13, 0.37, 0.69 (3.8), 1.16 (3.7)
    # The ledger's stage tensors (``run``: attn_ledger.engine.rounding; float32 and float64 runs first, half
    # precision below). Measured over 9 configurations (the default; float64; E=256 Nh=4 T=64;
    # padding; GQA Nkv=2 with a window of 4; grad; soft-cap 1 at scale 2; temperature 0.05; rotary positions),
    # seeds 0-2, at ATEN_CPU_CAPABILITY unset (AVX512), avx2 and default, the worst err / (eps * M): scores
    # 0.49 (the default config), weights 0.30 (padding), context 0.93 (GQA, window 4, seed 0); float64 runs
    # agree exactly. Each c is at least twice that: the context's 4, so the worst correct ratio is 0.25.
    # Every `run --fault` keeps its first finding (stage and check) over those configurations and capabilities.
    "scores": _every_dtype(2.0),
    "weights": _every_dtype(2.0),
    # Half-precision runs (sums counted as accumulated in float32, subnormal weights' spacing allowed):
    # 9 configurations (the default; padding with an empty row; GQA causal; rotary interleaved with a
    # soft-cap of 5; scale 1.5, where weights go subnormal in float16; Tq = Tk = 256; Dh = 128), seeds 0-2,
    # at ATEN_CPU_CAPABILITY unset (AVX512), avx2 and default, the worst err / (eps * M): float16 scores
    # 0.64, weights 0.27, context 0.27 (Tq = Tk = 256); bfloat16 0.41, 0.28, 0.22. The context's c is 2
    # there (worst ratio 0.14), not float32's 4: the bound keeps twice the power it would have at 4.
    "context": {"float64": 4.0, "float32": 4.0, "float16": 2.0, "bfloat16": 2.0},
    # The ledger's backward stage tensors (``run --grad``: attn_ledger.engine.rounding.grad_magnitudes), the
    # same c in every dtype. Measured over 16 configurations (the forward's 9 above, causal at T = 48,
    # T = 256, Dh = 128 and four half ones), seeds 0-5 (float32 and float64) and 0-2 (half), at
    # ATEN_CPU_CAPABILITY unset (AVX512), avx2 and default, the worst err / (eps * M), float32 (float64;
    # float16; bfloat16): grad_context 0.12 (0; 0.04; 0.03), grad_weights 0.68 (0; 0.60; 0.36),
    # grad_values 0.98 (0; 0.32; 0.20; Dh = 128), grad_scores 0.12 (0.03; 0.11; 0.06), grad_q 0.08
    # (0.02; 0.04; 0.04), grad_k 0.35 (0.03; 0.12; 0.12). Each c is at least twice that: the worst
    # correct ratio is 0.34 (grad_weights). A gradient scaled by 1 + 256 float32 eps fails at its own
    # stage (tests/test_ledger_rounding.py); SDPA's autograd comparisons keep the reference tolerance.
    "grad_context": _every_dtype(1.0),
    "grad_weights": _every_dtype(2.0),
    "grad_scores": _every_dtype(1.0),
    "grad_q": _every_dtype(1.0),
    "grad_k": _every_dtype(2.0),
    "grad_values": _every_dtype(4.0),
    # The sinks' gradient (``run --sinks ... --grad``: rounding.sinks_magnitude). Measured with c = 1 over 6
    # configurations (the default; float64; padding with valid lengths 5 and 2; T=33 E=32 Nh=4 Nkv=2; bfloat16;
    # float16), sinks 0.5, seeds 0-2, at ATEN_CPU_CAPABILITY unset (AVX2 on that machine): the worst
    # err / (eps * M) was 0.015 (float32; float64 0.0088, float16 0.011, bfloat16 0.0075), so c = 1 leaves a
    # correct gradient within 1/60 of its bound; the fault grad-sinks-no-share fails it (tests/test_run_sinks.py).
    "grad_sinks": _every_dtype(1.0),
    # The built-in pipeline's last backward rows (``run --grad`` on a config): the projection weights' gradients
    # and the input's (attn_ledger.engine.rounding.chain_magnitudes), from Q-bar, K-bar and V-bar carrying their
    # own error (within their rows' bounds) and the merged context its own. Where one carried error dominates a
    # short sum (padding leaves 5 rows), it reaches an element whole, so err / (eps * M) approaches 1 by
    # construction: c is 4, not 2. Measured over 14 float32 and float64 configurations (the default; float64;
    # E=256 Nh=4 T=64; padding with an empty example; GQA Nkv=2 with a window of 4; soft-cap 1 at scale 2;
    # temperature 0.05; rotary with cross-attention Tq=3 Tk=6; causal T=48; T=256; E=256 Nh=2; cross-attention
    # Tq=3 Tk=7; T=512, rows sampled; GQA causal cross-attention Tq=9 Tk=40), seeds 0-5, and 8 half ones, seeds
    # 0-2, at ATEN_CPU_CAPABILITY unset (AVX2 on this machine, which has no AVX512), the worst err / (eps * M),
    # float32 (float64; float16; bfloat16): grad_projections 0.98 (0.28; 0.94; 0.72; padding, float16 padding,
    # bfloat16 cross), grad_input 0.65 (0.12; 0.21; 0.50; temperature 0.05, bfloat16 cross), so the worst
    # correct ratio is 0.25. A gradient 256 float32 (32 float16) rounding units off fails at its row
    # (tests/test_ledger_rounding.py); the comparison with SDPA's autograd keeps the reference tolerance.
    "grad_projections": _every_dtype(4.0),
    "grad_input": _every_dtype(4.0),
}

# The kernel suites' view, kept beside the rule as data (each finding reports their limits too):
# flash-attention's tests allow a kernel twice the error of a plain same-dtype implementation;
# PyTorch's SDPA tests (test_transformers.py, the masked case) scale a fudge factor per quantity by
# the gap between the low- and high-precision math references.
SUITES = {
    "flash_attention": {"factor": {"out": 2.0, "dq": 2.0, "dk": 2.0, "dv": 2.0}},
    "pytorch": {"factor": {"out": 4.0, "dq": 160.0, "dk": 25.0, "dv": 8.0}},
}

# A half-precision kernel's root-mean-square output error may be this many times the larger of the
# float32-accumulating plain computations' (kernelref.plain_variants: scale first, and torch's own ops in
# the dtype, product first) before ``precision`` warns. A kernel that computes as one of them sits at 1.0
# exactly, so the bar is set between the correct kernels' worst and the imprecise ones' least, at about
# their geometric mean. Measured per case over the default tier's 17 half cases (torch 2.13.0+cpu, AMD
# EPYC; seeds 0-3 at ATEN_CPU_CAPABILITY=avx2 and default, seeds 0-9 unset for SDPA with enable_gqa, einsum,
# online softmax, the hand-written softmax and the two imprecise kernels), the worst case per kernel:
# * every correct kernel of fixtures/kernels/correct at most 1.00 (float32-accumulating ones 0.68-0.86;
#   einsum, expand + reshape, transformers' eager and the like compute as the plain ones do, 1.00);
# * fixtures/kernels/precision: softmax in bfloat16 in a float16 kernel at least 7.4 on every seed (up to
#   16.1), P @ V summed in float16 at least 2.16 (its Tk=256 case; 2.25 at most). In a bfloat16 kernel
#   neither is less precise than bfloat16 itself (1.00 and 0.80): not a loss there.
# So 1.5 leaves the correct kernels at 0.67 of the bar and the float16 accumulator 1.44 times over it.
# Before, the corpus's hand-written softmax kept exp and its row sum in the half dtype (1.33-1.70); it
# now accumulates in float32, as torch.softmax does inside.
HALF_PRECISION_RATIO = 1.5

_TINY = {"float64": 2.2250738585072014e-308, "float32": 1.1754943508222875e-38, "float16": 6.103515625e-05,
         "bfloat16": 1.1754943508222875e-38}


def tiny(dtype: "torch.dtype | str") -> float:
    """The smallest normal number of ``dtype``: below it a result loses precision to underflow."""
    return _TINY.get(dtype_name(dtype), _TINY["float32"])


def rounding_c(quantity: str, dtype: "torch.dtype | str") -> float:
    """``c`` of :func:`rounding` for ``quantity`` (out, dq, dk, dv) computed in ``dtype``."""
    if quantity not in ROUNDING_C:
        raise ValueError(f"quantity: got {quantity!r}, expected one of {', '.join(ROUNDING_QUANTITIES)}")
    per = ROUNDING_C[quantity]
    return per.get(dtype_name(dtype), per["float32"])


def rounding(quantity: str, dtype: "torch.dtype | str") -> tuple[float, float]:
    """``(c, eps)``: an element of ``quantity`` computed in ``dtype`` may be off float64 by at most
    ``c * eps * M``, ``M`` its summands' magnitude (with the underflow term, ``tiny(dtype) * U``)."""
    return rounding_c(quantity, dtype), EPS.get(dtype_name(dtype), EPS["float32"])


# torch.testing.assert_close's default (rtol, atol) per dtype.
_ASSERT_CLOSE = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}

PROBE_ATOL = 1e-5


def dtype_name(dtype: "torch.dtype | str") -> str:
    """``torch.float32`` or ``"float32"`` -> ``"float32"``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def reference(dtype: "torch.dtype | str") -> tuple[float, float]:
    """``(rtol, atol)`` for a ``dtype`` computation against the float64 reference (float32's for others)."""
    return _REFERENCE.get(dtype_name(dtype), _REFERENCE["float32"])


def is_half(dtype: "torch.dtype | str") -> bool:
    return dtype_name(dtype) in HALF_DTYPES


def half_floor(dtype: "torch.dtype | str") -> float:
    """The smallest plain same-dtype error the half-precision factor rule divides by."""
    return _HALF_FLOOR.get(dtype_name(dtype), _HALF_FLOOR["bfloat16"])


def row_sum(dtype: "torch.dtype | str") -> float:
    """How far a row of weights may sum from one, and the largest weight allowed on a forbidden key."""
    return max(MIN_ROW_SUM, 10 * reference(dtype)[0])


def kernel_floor(dtype: "torch.dtype | str", value_scale: float) -> float:
    """The floor of :func:`kernel`: a small error per dtype, scaled by ``1 + value_scale`` (largest |value|)."""
    return _KERNEL_FLOOR.get(dtype_name(dtype), _KERNEL_FLOOR["float32"]) * (1.0 + value_scale)


def kernel(dtype: "torch.dtype | str", plain_err: float, value_scale: float) -> float:
    """``check``'s bound on a kernel's error against float64: KERNEL_FACTOR times the plain
    same-dtype error, plus :func:`kernel_floor`."""
    return KERNEL_FACTOR * plain_err + kernel_floor(dtype, value_scale)


def kernel_bound(dtype: "torch.dtype | str", plain_error: float, value_scale: float,
                 score_max: float = 0.0) -> tuple[float, dict[str, Any]]:
    """:func:`kernel` with its parts as data (``factor``, ``plain_error``, ``floor``, ``dtype``).

    Never infinite or NaN: where ``plain_error`` is not finite the bound is a per-dtype fallback
    times ``1 + value_scale``, and the parts say so (``fallback``).

    ``score_max`` (for gradients): the largest |scaled score|. A score that large carries an error
    of about ``eps * score_max`` in any kernel, however it orders its work, and a gradient inherits
    it at its own scale; ``KERNEL_FACTOR * eps * score_max * value_scale`` is added (``score_term``),
    so that a kernel that recomputes the weights (as FlashAttention-style backward passes do) is not
    held to the luck of the plain computation's rounding.
    """
    name = dtype_name(dtype)
    scale = value_scale if math.isfinite(value_scale) else 0.0
    floor = kernel_floor(name, scale)
    facts: dict[str, Any] = {"factor": KERNEL_FACTOR, "plain_error": plain_error, "floor": floor, "dtype": name}
    extra = 0.0
    if score_max > 0 and math.isfinite(score_max):
        extra = facts["score_term"] = KERNEL_FACTOR * EPS.get(name, EPS["float32"]) * score_max * scale
    if not math.isfinite(plain_error):
        facts["fallback"] = f"the plain {name} computation is not finite; the bound is the {name} floor"
        return _KERNEL_FALLBACK.get(name, _KERNEL_FALLBACK["float32"]) * (1.0 + scale) + extra, facts
    return KERNEL_FACTOR * plain_error + floor + extra, facts


def assert_close(dtype: "torch.dtype | str") -> tuple[float, float]:
    """``(rtol, atol)``: torch.testing.assert_close's defaults for ``dtype`` (float32's for others)."""
    return _ASSERT_CLOSE.get(dtype_name(dtype), _ASSERT_CLOSE["float32"])


def relative(dtype: "torch.dtype | str") -> float:
    """The fraction of an output's scale within which two results count as equal: atol + rtol."""
    rtol, atol = assert_close(dtype)
    return atol + rtol


# --- the observed core of a module (check --module) -------------------------------------------

_EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def eps(dtype: "torch.dtype | str") -> float:
    """The machine epsilon of ``dtype`` (float32's for others)."""
    return _EPS.get(dtype_name(dtype), _EPS["float32"])


def norm_pattern(dtype: "torch.dtype | str") -> float:
    """How far apart two unit patterns of vector norms over positions may be and still be the same
    vectors, rotated or scaled (rounding of ``dtype``, never below float32-sized rotation tables)."""
    return max(8.0 * eps(dtype), 1e-6)


def logit(dtype: "torch.dtype | str", magnitude: float) -> float:
    """How far a logit read back from weights computed in ``dtype`` may be off, for logits up to
    ``magnitude``. Never tighter than float32's: implementations often compute the softmax or
    the rotary tables in float32 even for float64 inputs."""
    return 64.0 * max(eps(dtype), _EPS["float32"]) * (1.0 + magnitude)


def fitted_scale(dtype: "torch.dtype | str") -> float:
    """The relative tolerance within which a fitted softmax scale counts as a given value."""
    return 5e-2 if is_half(dtype) else 1e-3


# torch.autograd.gradcheck's defaults, and the rule for a module that rounds to float32 inside,
# where a central difference is only as good as float32 allows (best near a step of float32's
# eps ** (1/3), about 5e-3, good to about 1e-5 of the output).
GRADCHECK = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3}
GRADCHECK_FLOAT32_INSIDE = {"eps": 1e-2, "atol": 1e-3, "rtol": 1e-2}



# --- compare: two runs of one model, block by block ------------------------------------------------

# Measured with scripts/compare_margins.py (torch 2.13.0+cpu, transformers 5.25.0, AMD EPYC), B=2 T=24 left
# padded (padding-side: none against left/right), seeds 0-1, over llama, mistral, qwen2, gemma2 (eager against
# flex_attention, which it takes where SDPA is refused) and gpt2, each under eager against sdpa in float32 and
# bfloat16, dtype=float32,bfloat16 and padding-side in float32 and bfloat16, at ATEN_CPU_CAPABILITY=avx2 and
# default (llama, mistral, qwen2, gpt2; gemma2's flex_attention does not compile at default, and gemma2 at
# default was measured under dtype and padding-side only): the worst added / plain of a block is 1.96 (gemma2,
# eager against flex_attention in bfloat16, avx2), of the logits 1.30 (the same), of the embeddings 1.00 (a
# cast to bfloat16 is the plain computation itself). So 4 keeps every correct pairing within half its bound;
# the broken functions of fixtures/interface/custom.py add 2e5 to 4e5 times their bound (tests/test_compare_real.py).
COMPARE_FACTOR = 4.0
"""A block's added error (B's block on A's input against A's output) may be this many times the plain error at
that block: the largest ``max |plain - exact|`` over the runs' dtypes, ``plain`` A's block with eager attention
in that dtype and ``exact`` the same block in float64, both on the same input. The same rule gates the
embeddings and the logits (there ``plain`` is the whole plain run against the whole float64 run)."""

TOP_K = 5
"""Token agreement on the logits (vLLM's rule): each run's top token must be among the other's top ``TOP_K``."""


def compare_bound(plain_error: float, scale: float, dtypes: tuple[str, str] | list[str]) -> tuple[float, dict[str, Any]]:
    """``COMPARE_FACTOR * plain_error + floor``, the floor one eps of the coarser dtype times ``scale`` (the
    largest |exact| value), so that a plain error of exactly 0 leaves room for one rounding; with its parts."""
    coarse = max(eps(d) for d in dtypes)
    s = scale if math.isfinite(scale) else 0.0
    floor = coarse * s
    facts: dict[str, Any] = {"factor": COMPARE_FACTOR, "plain_error": plain_error, "floor": floor}
    if not math.isfinite(plain_error):
        facts["fallback"] = "the plain computation is not finite; the bound is the floor"
        return COMPARE_FACTOR * floor, facts
    return COMPARE_FACTOR * plain_error + floor, facts
