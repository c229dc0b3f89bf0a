"""SDPA backends: F.scaled_dot_product_attention with one backend pinned, and which this device can run.

The ledger's backend matrix repeats the context comparison once per (backend, dtype) pair
that :func:`resolve_backends` finds runnable; the others are reported with torch's reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attn_ledger.engine.plan import SMALL_GRID
from attn_ledger.errors import first_line
from attn_ledger.tolerance import dtype_name

if TYPE_CHECKING:
    import torch
    from torch import Tensor

SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")  # names for torch.nn.attention.SDPBackend members
_BACKEND_MEMBERS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
BACKEND_GRID = SMALL_GRID  # grids up to this size also get the other half/float dtypes in the backend matrix


def sdpa_pinned(name: str, q: "Tensor", k: "Tensor", v: "Tensor", mask: "Tensor | None", scale: float,
                softcap: float | None = None) -> "Tensor":
    """F.scaled_dot_product_attention with one backend pinned through ``torch.nn.attention.sdpa_kernel``.

    torch explains why a pinned backend cannot run in warnings; they are collected and, if the
    call fails, become its error message (the ledger reports them, so they are not printed).
    With ``softcap``, the pinned backend gets the capped scores as its additive mask, q zeroed
    (:func:`sdpa_capped`): a backend that takes no float mask cannot run.
    """
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as said, sdpa_kernel([getattr(SDPBackend, _BACKEND_MEMBERS[name])]):
        warnings.simplefilter("always")
        try:
            if softcap is not None:
                return sdpa_capped(q, k, v, mask, scale, softcap)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)
        except RuntimeError as exc:
            why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in said if str(w.message).strip()))
            raise RuntimeError(why or str(exc)) from exc


def sdpa_capped(q: "Tensor", k: "Tensor", v: "Tensor", allow: "Tensor | None", scale: float,
                cap: float | None, sinks: "Tensor | None" = None, bias: "Tensor | None" = None) -> "Tensor":
    """SDPA's softmax and mix on soft-capped scores (and one sink per head): ``[B, Nh, rows, Dv]``.

    SDPA has no soft-cap, so it gets the capped scores ``cap * tanh(scale * q.k / cap)`` (in the
    run's dtype, -inf where forbidden) as its additive mask, with q zeroed so that its own
    scores are 0. A query with no allowed key gets what SDPA gives it under the boolean mask.
    With ``sinks`` (``[Nh]``), the mask gains one column holding each head's sink logit, over a
    zero key and a zero value: the sink is in the denominator and mixes nothing. An additive ``bias``
    (``[B|1, Nh|1, rows, kw]``) is added to the capped scores, as the pipeline's scores stage adds it.
    """
    import torch
    import torch.nn.functional as F

    s = (q * scale) @ k.transpose(-2, -1)  # [B, Nh, rows, kw]
    capped = s if cap is None else torch.tanh(s / cap) * cap
    bias = capped if bias is None else capped + bias.to(capped.dtype)
    if allow is not None:
        bias = bias.masked_fill(~allow, float("-inf"))
    if sinks is not None:
        b, nh, rows, _ = bias.shape
        col = sinks.to(bias.dtype).reshape(1, nh, 1, 1).expand(b, nh, rows, 1)
        bias = torch.cat([bias, col], dim=-1)  # [B, Nh, rows, kw + 1]
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], dim=-2)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
    out = F.scaled_dot_product_attention(torch.zeros_like(q), k, v, attn_mask=bias, dropout_p=0.0)
    if allow is not None and sinks is None:
        dead = ~allow.any(dim=-1, keepdim=True)  # [B|1, Nh|1, rows, 1]
        if bool(dead.any()):
            plain = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, dropout_p=0.0, scale=scale)
            out = torch.where(dead, plain, out)
    return out  # [B, Nh, rows, Dv]


def resolve_backends(
    requested: "str | list[str] | tuple[str, ...] | None", device: "torch.device", run_dtype: "torch.dtype",
    masked: bool, grid: int, softcap: float | None = None, sinks: bool = False,
) -> tuple[tuple[tuple[str, "torch.dtype"], ...], dict[tuple[str, str], str]]:
    """The (backend, dtype) pairs of the backend matrix that this device can run, and why the others cannot.

    Args:
        requested: ``"all"``, a comma-separated string, or a list of names from :data:`SDPA_BACKENDS`.
        masked: whether the run has a relation (the probe then passes a boolean mask, as the ledger will).
        grid: B*Nh*Tq*Tk; small grids also get float32, float16 and bfloat16 next to the run's dtype.
        softcap: the run's soft-cap: each backend is probed as the ledger will call it, with the capped
            scores as its additive mask.
        sinks: the run has attention sinks, which no SDPA backend takes: each is reported not applicable.

    Returns:
        ``(pairs, unavailable)``: pairs in matrix order; ``unavailable`` maps ``(name, dtype name)`` to the reason.
    """
    import torch

    from attn_ledger.errors import InputError

    if requested is None:
        return (), {}
    names = list(requested) if not isinstance(requested, str) else [p.strip() for p in requested.split(",") if p.strip()]
    if names == ["all"]:
        names = list(SDPA_BACKENDS)
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if bad or not names:
        raise InputError(f"backends: got {requested!r}, expected 'all' or names from {', '.join(SDPA_BACKENDS)} joined by ','")
    if sinks:  # SDPA has no sinks: no backend is asked to fake them
        return (), {(name, dtype_name(run_dtype)): "not applicable: SDPA takes no attention sinks" for name in names}
    dtypes = [run_dtype]
    if grid <= BACKEND_GRID:
        dtypes += [d for d in (torch.float32, torch.float16, torch.bfloat16) if d != run_dtype]
    pairs: list[tuple[str, torch.dtype]] = []
    unavailable: dict[tuple[str, str], str] = {}
    for name in names:
        for dt in dtypes:
            q = torch.randn(1, 2, 4, 8, device=device).to(dt)  # [B, Nh, Tq, Dh]
            mask = torch.ones(4, 4, dtype=torch.bool, device=device).tril()[None, None] if masked else None
            try:
                out = (sdpa_pinned(name, q, q, q, mask, 0.35) if softcap is None
                       else sdpa_pinned(name, q, q, q, mask, 0.35, softcap))
                if not bool(torch.isfinite(out).all()):
                    raise RuntimeError("non-finite output on the probe")
            except Exception as exc:  # a backend this device, dtype or mask cannot run is not available
                unavailable[(name, dtype_name(dt))] = first_line(exc, type(exc).__name__)
                continue
            pairs.append((name, dt))
    return tuple(pairs), unavailable


def backend_matrix(judged: "list[tuple[str, str, bool | None]]", unavailable: dict[tuple[str, str], str]) -> dict[str, dict[str, Any]]:
    """``{backend: {dtype: True | False | "unavailable: reason"}}`` from ``(backend, dtype, passed)`` triples."""
    matrix: dict[str, dict[str, Any]] = {}
    for name, dt, ok in judged:
        matrix.setdefault(name, {})[dt] = ok
    for (name, dt), why in unavailable.items():
        matrix.setdefault(name, {})[dt] = f"unavailable: {why}"
    return matrix
