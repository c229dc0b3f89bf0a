"""Attention sinks as the user gives them: one logit per query head, validated once.

``--sinks`` (and the config key ``sinks``) takes a number for every head, ``Nh`` numbers joined
by ``,``, or a tensor file (``.pt`` loaded with ``weights_only=True``, ``.safetensors``, ``.npz``)
holding one tensor, or one named ``sinks``, of one or ``Nh`` values. A tensor given directly
(``ledger_on_qkv(sinks=...)``, a ``sinks`` tensor in a ``--tensors`` file) is read the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from attn_ledger.errors import InputError

EXPECTED = "a number, one number per head joined by ',', or a tensor file of them"


def parse_sinks(value: Any, n_heads: int, field: str = "sinks") -> tuple[float, ...] | None:
    """``value`` as ``n_heads`` finite sink logits (one value is every head's), or None for none.

    Raises:
        InputError: a value that does not parse, is not finite, or whose count is neither 1 nor ``n_heads``.
    """
    if value is None:
        return None
    if _is_tensor(value) and tuple(value.shape) != (n_heads,):
        raise InputError(f"{field}: got a tensor of shape {list(value.shape)}, expected one value per query head "
                         f"[Nh] = [{n_heads}]")
    found = _values(value, field)
    if not found:
        raise InputError(f"{field}: got no values, expected {EXPECTED}")
    bad = [x for x in found if not math.isfinite(x)]
    if bad:
        raise InputError(f"{field}: got {bad[0]!r}, expected finite sink logits")
    if len(found) == 1:
        return found * n_heads
    if len(found) != n_heads:
        raise InputError(f"{field}: got {len(found)} values, expected 1 or one per query head (Nh={n_heads})")
    return found


def _values(value: Any, field: str) -> tuple[float, ...]:
    if isinstance(value, bool):
        raise InputError(f"{field}: got {value!r}, expected {EXPECTED}")
    if isinstance(value, (int, float)):
        return (float(value),)
    if isinstance(value, (list, tuple)):
        out = []
        for x in value:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise InputError(f"{field}: got {x!r} in the list, expected numbers")
            out.append(float(x))
        return tuple(out)
    if isinstance(value, str):
        return _text(value, field)
    if _is_tensor(value):
        if value.is_complex() or value.dtype == _torch_bool():
            raise InputError(f"{field}: got a {value.dtype} tensor, expected real numbers")
        return tuple(float(x) for x in value.detach().double().reshape(-1).cpu().tolist())
    raise InputError(f"{field}: got a {type(value).__name__}, expected {EXPECTED}")


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "is_floating_point") and hasattr(value, "shape")


def _torch_bool() -> Any:
    """torch.bool, read from the tensor's own module so that this module imports no torch."""
    import torch

    return torch.bool


def _text(text: str, field: str) -> tuple[float, ...]:
    """A comma list of numbers, or the path of a tensor file."""
    parts = [p.strip() for p in text.split(",")]
    try:
        return tuple(float(p) for p in parts)
    except ValueError:
        pass
    if len(parts) == 1 and names_file(text):
        return _file(Path(text), field)
    shown = next((p for p in parts if not _number(p)), text)
    raise InputError(f"{field}: got {shown!r}, expected {EXPECTED}")


def names_file(text: str) -> bool:
    """Whether ``text`` is the path of an existing file (a path too long or unreadable is not)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _file(path: Path, field: str) -> tuple[float, ...]:
    from attn_ledger.inputs.tensorio import load_tensor_file

    found = load_tensor_file(path, field)
    if "sinks" not in found and len(found) != 1:
        raise InputError(f"{field}: {str(path)!r} holds {sorted(found)}, expected one tensor or one named 'sinks'")
    t = found["sinks"] if "sinks" in found else next(iter(found.values()))
    if t.dim() != 1:
        raise InputError(f"{field}: {str(path)!r} holds a tensor of shape {list(t.shape)}, expected [Nh]")
    return _values(t, field)
