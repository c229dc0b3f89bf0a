"""Loading user tensor files safely: ``.pt`` (weights only), ``.safetensors``, ``.npz``.

Files from users are untrusted. ``.pt`` goes through ``torch.load(weights_only=True)``,
which refuses arbitrary pickled objects; ``.npz`` is read with ``allow_pickle=False``.
Before any library reads a file, its first bytes are matched against the kind its suffix
names, so a refusal says what the file is (a plain pickle, a bare ``.npy``, a safetensors
file under another name, bytes of no known kind) instead of passing on a library's
message about something else. Libraries' warnings while reading are not shown: the one
line that says what is wrong is the only output. Every entry must be a dense tensor with
values (not sparse, not on the meta device), and a file's tensors must fit in memory
(an ``.npz`` is sized from its headers before anything is decompressed).
"""

from __future__ import annotations

import struct
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from attn_ledger.errors import TensorFileError, clip, first_line, shown, shown_path
from attn_ledger.inputs.paths import input_file

if TYPE_CHECKING:
    import torch

SUFFIXES = (".pt", ".pth", ".safetensors", ".npz")
_TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickled magic number of torch.save's old format
_EXPECTED = {".pt": "a torch.save file", ".pth": "a torch.save file",
             ".safetensors": "a safetensors file", ".npz": "an .npz archive (np.savez)"}


def sniff(head: bytes, size: int) -> str:
    """What a file's first bytes say it is: ``torch-zip``, ``zip``, ``torch-legacy``, ``pickle``,
    ``npy``, ``safetensors``, ``empty`` or ``unknown`` (``torch-zip`` vs ``zip`` needs the listing)."""
    if size == 0:
        return "empty"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(_TORCH_LEGACY_MAGIC):
        return "torch-legacy"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) >= 9:
        (n,) = struct.unpack_from("<Q", head, 0)
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    return "unknown"


def _describe_kind(kind: str, head: bytes) -> str:
    return {
        "empty": "an empty file",
        "zip": "a zip archive",
        "torch-zip": "a torch.save archive",
        "npz": "an .npz archive (np.savez)",
        "npy": "a bare .npy array (np.save)",
        "torch-legacy": "a torch.save file in the old (non-zip) format",
        "pickle": f"a plain pickle (protocol {head[1] if len(head) > 1 else '?'}), not written by torch.save",
        "safetensors": "a safetensors file",
    }.get(kind, f"not a pickle, a zip archive or a safetensors file (it starts with bytes {head[:8].hex(' ')})")


def _zip_kind(p: Path) -> str:
    """``torch-zip`` (has a ``data.pkl``), ``npz`` (only ``.npy`` members) or ``zip`` (anything else)."""
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return "zip"
    if any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return "torch-zip"
    if names and all(n.endswith(".npy") for n in names):
        return "npz"
    return "zip"


def _fits(kind: str, suffix: str) -> bool:
    if suffix in (".pt", ".pth"):
        return kind in ("torch-zip", "torch-legacy")
    if suffix == ".safetensors":
        return kind == "safetensors"
    return kind == "npz"


_RENAME = {"torch-zip": ".pt", "torch-legacy": ".pt", "safetensors": ".safetensors", "npz": ".npz", "npy": None}


def _kind_error(field: str, p: Path, kind: str, head: bytes, suffix: str) -> TensorFileError:
    found = _describe_kind(kind, head)
    hint = ""
    if _RENAME.get(kind):
        hint = f"; rename it to {p.stem}{_RENAME[kind]} if that is what it is"
    elif kind == "npy":
        hint = "; save named arrays with np.savez(path, q=..., k=..., v=...)"
    return TensorFileError(f"{field}: {shown_path(p)} is {found}, expected {_EXPECTED[suffix]}{hint}")


def load_tensor_file(path: str | Path, field: str = "tensors", *, max_memory: int | None = None) -> dict[str, "torch.Tensor"]:
    """Read every named tensor from a file.

    Args:
        path: a ``.pt``/``.pth``, ``.safetensors`` or ``.npz`` file.
        field: the option or config key the path came from, named in errors.
        max_memory: the memory budget in bytes (default: what the machine has, see
            :mod:`attn_ledger.inputs.limits`); a file whose tensors would not fit is refused.

    Returns:
        A dict from tensor name to tensor (CPU, dense). A ``.pt`` file holding a single
        tensor comes back as ``{"tensor": t}``.

    Raises:
        TensorFileError: missing, unreadable, of another kind than its suffix says, unsafe,
            not a mapping of tensors, or holding sparse or meta tensors.
        ResourceError: the file's tensors would not fit in memory.
    """
    from attn_ledger.inputs import limits

    p = input_file(path, field, TensorFileError)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise TensorFileError(f"{field}: unsupported file type {shown(suffix or '(none)')} for {shown_path(p)}, "
                              f"expected one of {', '.join(SUFFIXES)}")
    size = p.stat().st_size
    try:
        with open(p, "rb") as fh:
            head = fh.read(64)
    except OSError as exc:
        raise TensorFileError(f"{field}: cannot read {shown_path(p)}: {exc.strerror or exc}") from None
    kind = sniff(head, size)
    if kind == "zip":
        kind = _zip_kind(p)
    if not _fits(kind, suffix):
        raise _kind_error(field, p, kind, head, suffix)
    declared = _npz_bytes(p, field) if suffix == ".npz" else size
    limits.require_fits(limits.Estimate(f"loading {shown_path(p)}", (("its tensors", declared),)), max_memory)
    with warnings.catch_warnings(record=True):  # a library's warnings are not the user's business here
        warnings.simplefilter("always")
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
            first = first_line(exc, type(exc).__name__, limit=None)  # clip cuts it, saying how long it was
            raise TensorFileError(f"{field}: cannot read {shown_path(p)} as {_EXPECTED[suffix]}: {clip(first)}") from None
    for name, value in loaded.items():
        _check_entry(field, p, name, value)
    return dict(loaded)


def _check_entry(field: str, p: Path, name: str, value: object) -> None:
    """A loaded entry must be a dense tensor holding values."""
    import torch

    where = f"{field}: entry {shown(name)} in {shown_path(p)}"
    if not isinstance(value, torch.Tensor):
        raise TensorFileError(f"{where} is {type(value).__name__}, expected a tensor")
    if value.is_nested:
        raise TensorFileError(f"{where} is a nested tensor, expected a dense tensor")
    if value.layout != torch.strided:
        raise TensorFileError(f"{where} is a sparse tensor ({str(value.layout).replace('torch.', '')}), expected a dense tensor")
    if value.is_meta or value.device.type == "meta":
        raise TensorFileError(f"{where} is on the meta device (a shape without values), expected a tensor with values")
    if value.is_quantized:
        raise TensorFileError(f"{where} is a quantized tensor, expected a floating-point or bool tensor")


def _load_pt(p: Path, field: str) -> dict[str, "torch.Tensor"]:
    import pickle

    import torch

    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TensorFileError(
            f"{field}: {shown_path(p)} holds pickled objects other than tensors; refused "
            "(loaded with weights_only=True), expected a dict of tensors"
        ) from None
    if isinstance(obj, torch.Tensor):
        return {"tensor": obj}
    if not isinstance(obj, dict):
        raise TensorFileError(f"{field}: {shown_path(p)} holds a {type(obj).__name__}, expected a dict of named tensors")
    return {str(k): v for k, v in obj.items()}


def _npz_bytes(p: Path, field: str) -> int:
    """The bytes an ``.npz`` archive's arrays take once read, from their headers (nothing decompressed)."""
    import numpy as np

    total = 0
    try:
        with zipfile.ZipFile(p) as z:
            for info in z.infolist():
                with z.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
                n = 1
                for d in shape:
                    n *= int(d)
                total += n * dtype.itemsize
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        first = first_line(exc, type(exc).__name__, limit=None)
        raise TensorFileError(f"{field}: cannot read {shown_path(p)} as an .npz archive (np.savez): {clip(first)}") from None
    return total


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
            raise TensorFileError(f"{field}: {shown_path(p)} holds object arrays; refused (allow_pickle=False), "
                                  "expected numeric arrays") from None
        raise
    except TypeError as exc:  # a dtype torch has no tensor for (strings, unsigned widths)
        raise TensorFileError(f"{field}: {shown_path(p)} holds an array torch cannot hold ({exc}), expected numeric arrays") from None
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
