"""Devices and dtypes by name: the device a config or option names, its reference dtype, a dtype's name.

A base module: it imports only :mod:`attn_ledger.errors`, and torch inside each function, so that
importing it costs nothing on the ``--help`` path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attn_ledger.errors import InputError

if TYPE_CHECKING:
    import torch


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
    """float64, or float32 on a device without it (MPS)."""
    import torch

    return torch.float32 if device.type == "mps" else torch.float64


def torch_dtype(name: str) -> "torch.dtype":
    """``"float32"`` -> ``torch.float32`` (one of the four float dtypes)."""
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
