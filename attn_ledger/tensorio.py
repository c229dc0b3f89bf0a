"""Loading user tensor files safely: ``.pt`` (weights only), ``.safetensors``, ``.npz``.

Files from users are untrusted. ``.pt`` goes through ``torch.load(weights_only=True)``,
which refuses arbitrary pickled objects; ``.npz`` is read with ``allow_pickle=False``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attn_ledger.errors import TensorFileError

if TYPE_CHECKING:
    import torch

SUFFIXES = (".pt", ".pth", ".safetensors", ".npz")


def load_tensor_file(path: str | Path, field: str = "tensors") -> dict[str, "torch.Tensor"]:
    """Read every named tensor from a file.

    Args:
        path: a ``.pt``/``.pth``, ``.safetensors`` or ``.npz`` file.
        field: the option or config key the path came from, named in errors.

    Returns:
        A dict from tensor name to tensor (CPU). A ``.pt`` file holding a single
        tensor comes back as ``{"tensor": t}``.

    Raises:
        TensorFileError: missing, unreadable, unsafe, or not a mapping of tensors.
    """
    import torch

    p = Path(path)
    if not p.exists():
        raise TensorFileError(f"{field}: file not found: {str(p)!r}")
    if not p.is_file():
        raise TensorFileError(f"{field}: not a regular file: {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise TensorFileError(f"{field}: unsupported file type {suffix or '(none)'!r} for {str(p)!r}, expected one of {', '.join(SUFFIXES)}")
    try:
        if suffix in (".pt", ".pth"):
            loaded = _load_pt(p, field)
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded = load_file(str(p), device="cpu")
        else:
            loaded = _load_npz(p, field)
    except TensorFileError:
        raise
    except Exception as exc:  # the file's own fault: corrupt, truncated, wrong format
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TensorFileError(f"{field}: cannot read {str(p)!r} as {suffix}: {first}") from None
    for name, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            raise TensorFileError(f"{field}: entry {name!r} in {str(p)!r} is {type(value).__name__}, expected a tensor")
    return dict(loaded)


def _load_pt(p: Path, field: str) -> dict[str, "torch.Tensor"]:
    import pickle

    import torch

    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TensorFileError(
            f"{field}: {str(p)!r} holds pickled objects other than tensors; refused "
            "(loaded with weights_only=True), expected a dict of tensors"
        ) from None
    if isinstance(obj, torch.Tensor):
        return {"tensor": obj}
    if not isinstance(obj, dict):
        raise TensorFileError(f"{field}: {str(p)!r} holds a {type(obj).__name__}, expected a dict of named tensors")
    return {str(k): v for k, v in obj.items()}


def _load_npz(p: Path, field: str) -> dict[str, "torch.Tensor"]:
    import numpy as np
    import torch

    out: dict[str, torch.Tensor] = {}
    try:
        with np.load(str(p), allow_pickle=False) as data:
            for name in data.files:
                arr = data[name]
                out[name] = torch.from_numpy(np.ascontiguousarray(arr))
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise TensorFileError(f"{field}: {str(p)!r} holds object arrays; refused (allow_pickle=False), expected numeric arrays") from None
        raise
    return out


def save_tensor_file(tensors: dict[str, "torch.Tensor"], path: str | Path) -> None:
    """Write named tensors in the format the suffix names (used for fixtures and tests)."""
    import torch

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".pt", ".pth"):
        torch.save(dict(tensors), str(p))
    elif suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(p))
    elif suffix == ".npz":
        import numpy as np

        np.savez(str(p), **{k: v.numpy() for k, v in tensors.items()})
    else:
        raise TensorFileError(f"output: unsupported file type {suffix!r}, expected one of {', '.join(SUFFIXES)}")
