"""Masks as relations between query positions and key positions.

Every function here returns a boolean tensor in ALLOW polarity (True = this query may
use this key) with its axes named in the docstring. Relations are combined only in
that one polarity, with ``&``. Conversions to an API's own convention happen at the
call site of that API, through :func:`to_sdpa_bool` or :func:`to_mha_bool`.

Alignment when Tq != Tk:
  * bottom-right (KV-cache decode): query i may use key j iff j <= i + (Tk - Tq)
  * top-left (what ``F.scaled_dot_product_attention(is_causal=True)`` does):
    query i may use key j iff j <= i
They agree when Tq == Tk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch


def _ones(tq: int, tk: int, q0: int, q1: int | None, device) -> "torch.Tensor":
    """All-True ``[q1 - q0, Tk]``: rows q0..q1 of a relation, cut down below by ``tril_``/``triu_``.

    In ``tril_(d)`` on these rows, row r (query i = q0 + r) keeps keys j <= r + d, so a
    bound ``j <= i + c`` is ``tril_(q0 + c)`` and ``j >= i + c`` is ``triu_(q0 + c)``.
    """
    import torch

    q1 = tq if q1 is None else q1
    return torch.ones(max(0, q1 - q0), tk, dtype=torch.bool, device=device)


def causal(tq: int, tk: int, align: str = "bottom-right", q0: int = 0, q1: int | None = None, device=None) -> "torch.Tensor":
    """Causal relation ``[Tq, Tk]`` (rows q0..q1 when given).

    Args:
        align: ``"bottom-right"`` (j <= i + Tk - Tq) or ``"top-left"`` (j <= i).
    """
    offset = tk - tq if align == "bottom-right" else 0
    return _ones(tq, tk, q0, q1, device).tril_(q0 + offset)  # j <= i + offset


def sliding_window(tq: int, tk: int, window: int, q0: int = 0, q1: int | None = None, device=None) -> "torch.Tensor":
    """Causal sliding window ``[Tq, Tk]``, bottom-right aligned: the last ``window`` keys up to the query."""
    offset = tk - tq  # query i sits at key position i + offset
    return _ones(tq, tk, q0, q1, device).tril_(q0 + offset).triu_(q0 + offset - window + 1)  # pos - window < j <= pos


def prefix_lm(tq: int, tk: int, prefix_len: int, q0: int = 0, q1: int | None = None, device=None) -> "torch.Tensor":
    """Prefix-LM ``[Tq, Tk]``: every query sees the first ``prefix_len`` keys, causal after that."""
    allow = _ones(tq, tk, q0, q1, device).tril_(q0 + tk - tq)  # j <= i + (Tk - Tq)
    allow[:, :max(0, prefix_len)] = True  # j < prefix_len
    return allow


def key_padding(key_valid: "torch.Tensor") -> "torch.Tensor":
    """Key padding ``[B, Tk]`` (True = real key) broadcast explicitly to ``[B, 1, 1, Tk]``."""
    return key_valid[:, None, None, :]


def valid_from_lengths(lengths: Sequence[int], tk: int, side: str = "right", device=None) -> "torch.Tensor":
    """``[B, Tk]`` key validity from per-example lengths, padding on the right (or left)."""
    import torch

    j = torch.arange(tk, device=device)[None, :]
    n = torch.tensor(list(lengths), dtype=torch.long, device=device)[:, None]
    return j < n if side == "right" else j >= (tk - n)


def segments(query_segment: "torch.Tensor", key_segment: "torch.Tensor") -> "torch.Tensor":
    """Document/segment relation: ``[B, Tq]`` and ``[B, Tk]`` ids to ``[B, 1, Tq, Tk]``, same segment only."""
    return (query_segment[:, :, None] == key_segment[:, None, :])[:, None, :, :]


def expand_to_grid(allow: "torch.Tensor", b: int, nh: int, tq: int, tk: int, name: str = "allow_mask") -> "torch.Tensor":
    """Place a saved allow mask on the score grid ``[B, Nh, Tq, Tk]`` by its named axes.

    Accepts ``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, Nh, Tq, Tk]`` and inserts the missing
    axes explicitly (never by implicit broadcasting of a 3-D tensor against 4-D).
    Returns a view of shape ``[B|1, Nh|1, Tq, Tk]``.
    """
    from attn_ledger.errors import InputError

    shape = tuple(allow.shape)
    if allow.dim() == 2 and shape == (tq, tk):
        return allow[None, None, :, :]  # [1, 1, Tq, Tk]
    if allow.dim() == 3 and shape == (b, tq, tk):
        return allow[:, None, :, :]  # [B, 1, Tq, Tk]
    if allow.dim() == 4 and shape == (b, nh, tq, tk):
        return allow
    raise InputError(
        f"{name}: got shape {list(shape)}, expected [Tq, Tk]={[tq, tk]}, [B, Tq, Tk]={[b, tq, tk]} "
        f"or [B, Nh, Tq, Tk]={[b, nh, tq, tk]}"
    )


def to_sdpa_bool(allow: "torch.Tensor") -> "torch.Tensor":
    """``F.scaled_dot_product_attention``: a boolean True takes part in attention."""
    return allow


def to_mha_bool(allow: "torch.Tensor") -> "torch.Tensor":
    """``nn.MultiheadAttention`` (attn_mask and key_padding_mask): a boolean True is blocked."""
    return ~allow

