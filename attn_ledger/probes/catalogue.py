"""A catalogue of broken attention kernels and modules, and what each level of checking sees of them.

Every kernel here follows the kernel protocol (see :mod:`attn_ledger.probes.kernel.check`) and is
correct except for one deliberate, realistic fault. The module faults go through
:func:`attn_ledger.probes.module.check.check_module`. Where the built-in pipeline has the same
fault (``attn-ledger run --fault``), the white-box ledger's first divergence is shown
beside the black-box level, since the ledger sees every stage and ``check`` sees only
inputs and outputs.

:func:`run_catalogue` is a self-test of the tool: its exit code is 1 if any fault goes
undetected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from attn_ledger.report import LEVEL_NAMES, Check, Note, Report, Row

if TYPE_CHECKING:
    from torch import Tensor, nn


# --- shared pieces of the broken kernels ----------------------------------------------


def _expand(q: "Tensor", k: "Tensor", v: "Tensor") -> tuple["Tensor", "Tensor"]:
    """Grouped-query kv heads to one per query head: kv head g serves query heads g*group..(g+1)*group-1."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Nh, Tk, D]


def _allow(q: "Tensor", k: "Tensor", allow_mask: "Tensor | None", is_causal: bool) -> "Tensor | None":
    """The protocol's relation: allow_mask AND (if is_causal) the bottom-right causal relation."""
    import torch

    tq, tk = q.shape[-2], k.shape[-2]
    allow = allow_mask
    if is_causal:
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        causal = j <= i + (tk - tq)  # [Tq, Tk]
        allow = causal if allow is None else (allow & causal)
    return allow


def _scale(q: "Tensor", scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _masked_softmax(scores: "Tensor", allow: "Tensor | None") -> "Tensor":
    import torch

    if allow is None:
        return torch.softmax(scores, dim=-1)
    w = torch.softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)  # [B, Nh, Tq, Tk]
    return torch.nan_to_num(w, nan=0.0)  # a query with no allowed key gets zeros, as SDPA does


def _attend(q, k, v, allow_mask=None, is_causal=False, scale=None):
    """Correct manual attention; the broken kernels change one step of it."""
    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = (q * _scale(q, scale)) @ k.transpose(-2, -1)  # [B, Nh, Tq, Tk]: scale first, so float16 stays finite
    return _masked_softmax(scores, allow) @ v  # [B, Nh, Tq, Dv]


def _merge(x: "Tensor") -> "Tensor":
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # [B, T, H*D]


def _split(x: "Tensor", h: int) -> "Tensor":
    b, t, e = x.shape
    return x.reshape(b, t, h, e // h).transpose(1, 2)  # [B, H, T, D]


# --- the broken kernels ---------------------------------------------------------------


def split_reshape(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Works in [B, T, E] layout inside and splits heads with ``reshape(B, H, T, D)`` (no transpose)."""

    def bad_split(x):
        b, h, t, d = x.shape
        return _merge(x).reshape(b, h, t, d)  # [B, H, T, D] in shape only: heads hold half-positions

    def bad_unsplit(x):
        b, h, t, d = x.shape
        return _split(x.reshape(b, t, h * d), h)  # the inverse reshape, then the correct layout

    out = _attend(bad_split(q), bad_split(k), bad_split(v), allow_mask, is_causal, scale)
    return bad_unsplit(out)


def merge_reshape(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Merges heads for the output with ``reshape(B, Tq, Nh*Dv)`` (no transpose), then splits correctly."""
    out = _attend(q, k, v, allow_mask, is_causal, scale)  # [B, Nh, Tq, Dv]
    b, h, t, d = out.shape
    return _split(out.reshape(b, t, h * d), h)


def k_transpose(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """``k.transpose(1, 2)`` where ``k.transpose(-2, -1)`` was meant: runs only when Nh == Tk == Dh."""
    k, v = _expand(q, k, v)
    scores = q @ k.transpose(1, 2) * _scale(q, scale)  # meant [B, Nh, Tq, Tk]
    return _masked_softmax(scores, _allow(q, k, allow_mask, is_causal)) @ v


def softmax_axis(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Softmax over the query axis (dim=-2) instead of the key axis."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = q @ k.transpose(-2, -1) * _scale(q, scale)  # [B, Nh, Tq, Tk]
    if allow is not None:
        scores = scores.masked_fill(~allow, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-2), nan=0.0) @ v


def no_scale(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Forgets the 1/sqrt(Dh) scale."""
    return _attend(q, k, v, allow_mask, is_causal, scale=1.0)


def scale_ignored(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Accepts ``scale=`` and always uses 1/sqrt(Dh) instead."""
    return _attend(q, k, v, allow_mask, is_causal, scale=None)


def mask_polarity(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Treats the allow relation as a block relation (``masked_fill(allow, -inf)``), as nn.MultiheadAttention would."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = q @ k.transpose(-2, -1) * _scale(q, scale)
    if allow is not None:
        scores = scores.masked_fill(allow, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def mask_after_softmax(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Normalises first, then zeroes the forbidden weights: rows no longer sum to one."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    w = torch.softmax(q @ k.transpose(-2, -1) * _scale(q, scale), dim=-1)  # [B, Nh, Tq, Tk]
    if allow is not None:
        w = w * allow
    return w @ v


def gqa_repeat(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Grouped-query kv heads tiled with ``repeat`` instead of ``repeat_interleave``."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # kv head h % Nkv, not h // group
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_allow(q, k, allow_mask, is_causal), scale=scale)


def causal_top_left(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Forwards ``is_causal`` to F.scaled_dot_product_attention, whose causal relation is top-left aligned."""
    import torch
    import torch.nn.functional as F

    k, v = _expand(q, k, v)
    if is_causal and allow_mask is not None:
        tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        allow_mask, is_causal = allow_mask & tril, False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allow_mask, is_causal=is_causal, scale=scale)


def float_mask_bias(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Adds the 0/1 allow relation to the scores as a float bias: forbidden keys get +0, not -inf."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = q @ k.transpose(-2, -1) * _scale(q, scale)
    if allow is not None:
        scores = scores + allow.to(scores.dtype)
    return torch.softmax(scores, dim=-1) @ v


def softmax_overflow(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """A hand-written softmax, ``exp(s) / exp(s).sum()``, without subtracting the row maximum."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    e = torch.exp(q @ k.transpose(-2, -1) * _scale(q, scale))  # overflows once s > ~88 in float32
    if allow is not None:
        e = e * allow
    w = e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
    return w @ v


# --- near-threshold faults: just past what a correct kernel's rounding can explain ---------------

SCALE_ERROR = 0.01  # the scale off by 1%
LEAKED_WEIGHT = 1e-3  # the weight a row gives its forbidden keys, taken from its allowed ones


def scale_off_by_1pct(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Multiplies the scores by the scale times 1.01 (a rounded constant, a wrong head width)."""
    return _attend(q, k, v, allow_mask, is_causal, _scale(q, scale) * (1 + SCALE_ERROR))


def leaked_weight(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Gives 1e-3 of each row's weight to its forbidden keys (spread evenly), the rest to the allowed ones."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = (q * _scale(q, scale)) @ k.transpose(-2, -1)  # [B, Nh, Tq, Tk]
    w = _masked_softmax(scores, allow)  # [B, Nh, Tq, Tk]
    if allow is not None:
        blocked = (~allow).expand_as(w).to(w.dtype)  # [B, Nh, Tq, Tk]
        n_blocked = blocked.sum(dim=-1, keepdim=True)
        leaks = ((n_blocked > 0) & allow.any(dim=-1, keepdim=True)).to(w.dtype)  # [B, Nh, Tq, 1]
        w = w * (1 - LEAKED_WEIGHT * leaks) + LEAKED_WEIGHT * leaks * blocked / n_blocked.clamp_min(1)
    return w @ v  # [B, Nh, Tq, Dv]


def softmax_bf16(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """Rounds the scores to bfloat16 and takes the softmax there, whatever the input dtype."""
    import torch

    k, v = _expand(q, k, v)
    allow = _allow(q, k, allow_mask, is_causal)
    scores = (q * _scale(q, scale)) @ k.transpose(-2, -1)  # [B, Nh, Tq, Tk]
    return _masked_softmax(scores.to(torch.bfloat16), allow).to(q.dtype) @ v  # [B, Nh, Tq, Dv]


# --- the broken modules -----------------------------------------------------------------


def _fused_projections(layer: "nn.Module", embed_dim: int, num_heads: int) -> None:
    """A fused layer's projections, without bias: ``qkv`` (E -> 3E) and ``out`` (E -> E)."""
    from torch import nn

    layer.num_heads = num_heads
    layer.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
    layer.out = nn.Linear(embed_dim, embed_dim, bias=False)


def _dropout_module(embed_dim: int, num_heads: int) -> "nn.Module":
    """Passes ``dropout_p=0.1`` to F.scaled_dot_product_attention whether or not the module is training."""
    import torch.nn.functional as F
    from torch import nn

    class DropoutAtEval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _fused_projections(self, embed_dim, num_heads)

        def forward(self, x):
            b, t, e = x.shape
            q, k, v = (_split(p, self.num_heads) for p in self.qkv(x).chunk(3, dim=-1))  # [B, Nh, T, Dh]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)  # ignores self.training
            return self.out(_merge(o))  # [B, T, E]

    return DropoutAtEval()


def _batch_first_module(embed_dim: int, num_heads: int) -> "nn.Module":
    """nn.MultiheadAttention left at ``batch_first=False`` and fed ``[B, T, E]`` (no mask, so nothing raises)."""
    from torch import nn

    class BatchFirstConfusion(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(embed_dim, num_heads, bias=False)  # expects [T, B, E]

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]  # reads B as positions and T as examples

    return BatchFirstConfusion()


def _softcap_dropped_module(embed_dim: int, num_heads: int) -> "nn.Module":
    """A causal layer declared soft-capped (Gemma 2's ``attn_logit_softcapping = 50``) whose hand-written
    core leaves the cap out: ``softmax(s)`` where ``softmax(50 * tanh(s / 50))`` was meant."""
    import torch
    from torch import nn

    class SoftcapDropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _fused_projections(self, embed_dim, num_heads)

        def forward(self, x):
            t = x.shape[1]
            q, k, v = (_split(p, self.num_heads) for p in self.qkv(x).chunk(3, dim=-1))  # [B, Nh, T, Dh]
            s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, Nh, T, T]; the cap belongs here
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            w = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            return self.out(_merge(w @ v))  # [B, T, E]

    return SoftcapDropped()


def _sinks_unused_module(embed_dim: int, num_heads: int) -> "nn.Module":
    """A causal layer with one sink logit per head (gpt-oss's ``self.sinks``) that its hand-written core never
    reads: ``softmax(s)`` where ``softmax(cat([s, sinks]))[..., :-1]`` was meant."""
    import torch
    from torch import nn

    class SinksUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _fused_projections(self, embed_dim, num_heads)
            self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, num_heads))  # declared, never read

        def forward(self, x):
            t = x.shape[1]
            q, k, v = (_split(p, self.num_heads) for p in self.qkv(x).chunk(3, dim=-1))  # [B, Nh, T, Dh]
            s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, Nh, T, T]
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            w = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)  # the sinks belong in this softmax
            return self.out(_merge(w @ v))  # [B, T, E]

    return SinksUnused()


# --- the catalogue ----------------------------------------------------------------------

MODULE_EMBED_DIM, MODULE_HEADS = 12, 3  # the sizes the module faults are built and checked at


@dataclass(frozen=True)
class Fault:
    """One deliberate failure.

    Attributes:
        name: stable id (the pipeline's fault name where it has one).
        kind: ``kernel`` (checked with the kernel protocol), ``module`` (check_module) or ``ledger`` (a fault in a
            feature only the built-in pipeline has here, sinks or a window: seen by ``run --fault`` alone).
        summary: what the code does wrong, in one line.
        target: the broken kernel function, or the module factory.
        pipeline_fault: the same fault in the built-in pipeline (``run --fault``), if any.
        module_causal: for modules, whether the module is meant to be causal.
        module_softcap: for modules, the soft-cap declared (``check --module --softcap``), or None.
        near_threshold: a fault just past what rounding explains (its margin is printed by
            ``scripts/margins.py``).
    """

    name: str
    kind: str
    summary: str
    target: Callable[..., Any] | None
    pipeline_fault: str | None = None
    module_causal: bool = True
    near_threshold: bool = False
    module_softcap: float | None = None
    module_sinks: Any = None  # for modules, the sinks declared (check --module --sinks), or None


CATALOGUE: tuple[Fault, ...] = (
    Fault("split-reshape", "kernel", "bad split: heads re-split from [B, T, E] with reshape, no transpose",
          split_reshape, "split-reshape"),
    Fault("merge-reshape", "kernel", "bad merge: heads merged with reshape, no transpose, then split correctly",
          merge_reshape, "merge-reshape"),
    Fault("k-transpose", "kernel", "wrong transpose: k.transpose(1, 2) for k.transpose(-2, -1)",
          k_transpose, "k-transpose"),
    Fault("softmax-axis", "kernel", "softmax over queries (dim=-2), not keys", softmax_axis, "softmax-axis"),
    Fault("no-scale", "kernel", "missing 1/sqrt(Dh) scale", no_scale, "no-scale"),
    Fault("mask-polarity", "kernel", "allow mask used as a block mask (inverted polarity)", mask_polarity,
          "mask-polarity"),
    Fault("mask-after-softmax", "kernel", "forbidden weights zeroed after softmax", mask_after_softmax,
          "mask-after-softmax"),
    Fault("dropout-at-eval", "module", "dropout_p passed to SDPA regardless of .training", _dropout_module),
    Fault("batch-first", "module", "nn.MultiheadAttention(batch_first=False) fed [B, T, E], not causal",
          _batch_first_module, module_causal=False),
    Fault("softcap-dropped", "module", "a layer declared soft-capped at 50 (--softcap 50) whose core leaves the cap out",
          _softcap_dropped_module, module_softcap=50.0),
    Fault("gqa-repeat", "kernel", "grouped-query kv heads paired by repeat, not repeat_interleave", gqa_repeat),
    Fault("causal-top-left", "kernel", "is_causal forwarded to SDPA: top-left where decode needs bottom-right",
          causal_top_left),
    Fault("float-mask-bias", "kernel", "0/1 float allow mask added to the scores as a bias", float_mask_bias),
    Fault("softmax-overflow", "kernel", "hand-written softmax without subtracting the row max", softmax_overflow),
    Fault("scale-ignored", "kernel", "an explicit scale= argument silently replaced by 1/sqrt(Dh)", scale_ignored),
    Fault("scale-off-1pct", "kernel", "the scale multiplied by 1.01", scale_off_by_1pct, near_threshold=True),
    Fault("leaked-weight", "kernel", "1e-3 of each row's weight spread over its forbidden keys", leaked_weight,
          near_threshold=True),
    Fault("softmax-bf16", "kernel", "softmax taken in bfloat16 whatever the input dtype", softmax_bf16,
          near_threshold=True),
    Fault("sinks-unused", "module", "a layer declared with attention sinks (--sinks -1,0,1) whose core never uses them",
          _sinks_unused_module, module_sinks=(-1.0, 0.0, 1.0)),
    Fault("sink-dropped", "ledger", "attention sinks (--sinks) accepted and dropped: softmax over the keys alone",
          None, "sink-dropped"),
    Fault("sink-in-numerator", "ledger", "the sink's weight mixed as if it were a key's value, the first key's "
          "weight dropped instead", None, "sink-in-numerator"),
    Fault("softcap-after-mask", "ledger", "the soft-cap (--softcap) applied after the mask: a forbidden key's -inf "
          "becomes -cap", None, "softcap-after-mask"),
    Fault("window-too-wide", "ledger", "a sliding window of W keys (the query's own among them, as transformers' "
          "masking_utils counts) kept W + 1", None, "window-too-wide"),
)

NEAR_THRESHOLD: tuple[Fault, ...] = tuple(f for f in CATALOGUE if f.near_threshold)
"""The faults just past what rounding explains, whose margins ``scripts/margins.py`` prints."""


def _passes(checks: Iterable[Check]) -> list[dict[str, Any]]:
    """Checks judged at least once and never failed, by level (first-seen order within a level)."""
    seen: dict[tuple[int, str], bool] = {}
    for c in checks:
        if c.judged:
            seen[(c.level, c.name)] = seen.get((c.level, c.name), True) and not c.failed
    held = sorted((key for key, ok in seen.items() if ok), key=lambda key: key[0])
    return [{"level": level, "check": name} for level, name in held]


def _clean(checks: Iterable[Check]) -> list[int]:
    """Levels with at least one judged check and no failure."""
    judged, failed = set(), set()
    for c in checks:
        if c.judged:
            judged.add(c.level)
        if c.failed:
            failed.add(c.level)
    return sorted(judged - failed)


@dataclass(frozen=True)
class _BlackBox:
    """What ``check`` saw of one fault: the lowest failing level, its check and case, and every check judged."""

    level: int | None
    check: str | None
    case: str | None
    checks: tuple[Check, ...]


def _kernel_view(fault: Fault, seed: int) -> _BlackBox:
    """The lowest level any case fails at, and the check that fails there on the smallest such case."""
    from attn_ledger.probes.kernel.check import check_kernel, parse_case

    report = check_kernel(fault.target, target=f"attn_ledger.probes.catalogue:{fault.target.__name__}", seed=seed)
    failing = [(row.name, c) for row in report.rows if (c := row.first_failing()) is not None]
    checks = tuple(c for _, c in report.checks())
    if not failing:
        return _BlackBox(None, None, None, checks)
    level = min(c.level for _, c in failing)
    case, first = min(((name, c) for name, c in failing if c.level == level),
                      key=lambda item: (parse_case(item[0]).size, item[0]))
    return _BlackBox(level, first.name, case, checks)


def _module_view(fault: Fault, seed: int) -> _BlackBox:
    from attn_ledger.probes.module.check import check_module

    report = check_module(fault.target, MODULE_EMBED_DIM, MODULE_HEADS, causal=fault.module_causal, seed=seed,
                          subject=fault.name, softcap=fault.module_softcap, sinks=fault.module_sinks)
    first = report.first_finding
    checks = tuple(c for _, c in report.checks())
    return _BlackBox(None if first is None else first.level, None if first is None else first.name, None, checks)


def _ledger_view(fault: Fault) -> _BlackBox:
    """A ``ledger`` fault: the built-in pipeline's first finding with it, under the feature it breaks."""
    from attn_ledger.inputs.config import FAULT_NEEDS, load_config
    from attn_ledger.ledger import run_ledger

    report = run_ledger(load_config(overrides={"fault": fault.pipeline_fault, **FAULT_NEEDS.get(fault.pipeline_fault, {})}))
    first = report.first_finding
    checks = tuple(c for _, c in report.checks())
    return _BlackBox(None if first is None else first.level, None if first is None else first.name, None, checks)


def _white_box(pipeline_fault: str) -> dict[str, Any]:
    """The ledger's first finding on the built-in pipeline with the same fault (``run --fault``), under what
    the fault needs to have its stage (``FAULT_NEEDS``)."""
    from attn_ledger.inputs.config import FAULT_NEEDS, load_config
    from attn_ledger.ledger import run_ledger

    f = run_ledger(load_config(overrides={"fault": pipeline_fault, **FAULT_NEEDS.get(pipeline_fault, {})})).first_finding
    found = {"level": None, "stage": None, "check": None} if f is None else {"level": f.level, "stage": f.row,
                                                                            "check": f.name}
    return {"fault": pipeline_fault, **found}


def check_fault(fault: Fault, seed: int = 0) -> Row:
    """Run one fault through ``check`` (and the white-box ledger where the pipeline has it).

    Returns:
        A passing row when some check fails on the fault (its ``detected`` check at the level
        it was seen, naming that check and, for kernels, the smallest case), a failing row when
        none does. The check's ``data`` holds the white-box view, the checks that passed all
        the way through and the levels where nothing failed.
    """
    views = {"kernel": lambda: _kernel_view(fault, seed), "module": lambda: _module_view(fault, seed),
             "ledger": lambda: _ledger_view(fault)}
    view = views[fault.kind]()
    white = None if fault.pipeline_fault is None else _white_box(fault.pipeline_fault)
    data = {"kind": fault.kind, "check": view.check, "case": view.case, "white_box": white,
            "passes_through": _passes(view.checks), "clean_levels": _clean(view.checks)}
    if view.level is None:
        check = Check(4, "detected", "fail", reason="no check failed at any level", data=data)
    else:
        check = Check(view.level, "detected", "pass", f"first failing check {view.check}",
                      location=None if view.case is None else {"case": view.case}, data=data)
    fields: dict[str, Any] = {"level": view.level, "check": view.check or "-", "ledger level": None,
                              "ledger stage": "-"}
    if white is not None:
        fields.update({"ledger level": white["level"], "ledger stage": white["stage"] or "none"})
    return Row(fault.name, check.status, (check,), fields=fields)


def run_catalogue(
    faults: Sequence[Fault] | None = None, *, seed: int = 0, progress: Callable[[int, int], None] | None = None
) -> Report:
    """Run every fault of the catalogue (or the given ones): one row per fault.

    The first finding is the first undetected fault; exit code 1 if any goes undetected.
    """
    todo = CATALOGUE if faults is None else tuple(faults)
    rows = []
    for i, fault in enumerate(todo):
        rows.append(check_fault(fault, seed))
        if progress is not None:
            progress(i + 1, len(todo))
    undetected = [r.name for r in rows if r.status == "fail"]
    notes = [Note("faults_detected", {"detected": len(rows) - len(undetected), "faults": len(rows)})]
    if undetected:
        notes.append(Note("undetected", {"faults": undetected}))
    notes += [Note("fault", {"name": f.name, "summary": f.summary}) for f in todo]
    notes.append(Note("catalogue_columns", {"levels": dict(LEVEL_NAMES)}))
    details = {
        "faults_total": len(rows),
        "undetected": undetected,
        "faults": [{"name": f.name, "kind": f.kind, "summary": f.summary, "pipeline_fault": f.pipeline_fault}
                   for f in todo],
        "module_sizes": {"E": MODULE_EMBED_DIM, "Nh": MODULE_HEADS},
        "seed": seed,
    }
    return Report("faults", "FAULT CATALOGUE: which level first sees each fault", tuple(rows), notes=tuple(notes),
                  details=details, unit="row", row_label="fault", show_passing=False)
