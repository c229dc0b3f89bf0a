"""Given Q, K, V and the user's own intermediates: validated once, before anything runs.

Q, K and V that cannot describe attention are bad input (one line, exit 2). A user's own
``scores``, ``weights`` or ``out`` of the wrong shape is not bad input but a finding: it
comes back as a :class:`~attn_ledger.engine.measure.Broken` measurement, judged as an L1
``user_*_shape`` check at its stage.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Mapping

from attn_ledger.engine.measure import Broken
from attn_ledger.errors import InputError, TensorFileError
from attn_ledger.report import Note
from attn_ledger.tolerance import dtype_name

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from attn_ledger.maths.relations import Relation
    from attn_ledger.engine.rows import Rows

TENSOR_NAMES = ("q", "k", "v", "allow_mask", "key_valid", "scores", "weights", "out", "grad_out", "dq", "dk", "dv",
                "sinks", "bias")
OUT_LAYOUTS = ("bhtd", "bthd")  # a saved ``out`` as [B, Nh, Tq, Dv] (the context's own) or [B, Tq, Nh, Dv] (transformers')
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
GIVEN = (("scores", "scores"), ("weights", "weights"), ("out", "context"))  # (name, the stage it is compared at)
GIVEN_GRADS = (("grad_out", "grad_context"), ("dq", "grad_q"), ("dk", "grad_k"), ("dv", "grad_values"))


def validate_qkv(q: "Tensor", k: "Tensor", v: "Tensor") -> None:
    """Reject Q, K, V that cannot describe attention, with one line naming what is wrong."""
    import torch

    from attn_ledger.engine import checks as C

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: got {type(t).__name__}, expected a tensor")
        if t.dim() not in (3, 4):
            raise InputError(f"{name}: got rank {t.dim()} shape {list(t.shape)}, expected [B, T, D] or [B, Nh, T, D]")
        if dtype_name(t.dtype) not in FLOAT_DTYPES:
            raise InputError(f"{name}: got dtype {dtype_name(t.dtype)}, expected one of {', '.join(FLOAT_DTYPES)}")
    if not (q.dim() == k.dim() == v.dim()):
        raise InputError(f"q/k/v: got ranks {q.dim()}, {k.dim()}, {v.dim()}, expected the same rank for all three")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"q/k/v: got dtypes {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}, "
                         "expected one dtype")
    _check_sizes(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and not C.all_finite(t):
            raise InputError(f"{name}: holds {C.nonfinite_count(t)} NaN or inf values, expected finite inputs")


def _check_sizes(q: "Tensor", k: "Tensor", v: "Tensor") -> None:
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise InputError(f"batch: got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}, expected the same batch size B")
    if k.shape[-2] != v.shape[-2]:
        raise InputError(f"Tk: got k {k.shape[-2]} key positions and v {v.shape[-2]}, expected K and V token counts to match")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"Dh: got q width {q.shape[-1]} and k width {k.shape[-1]}, expected Q and K widths to match")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-2] == 0:
            raise InputError(f"{name}: got 0 token positions in shape {list(t.shape)}, expected at least one")
        if t.shape[-1] == 0:
            raise InputError(f"{name}: got feature width 0 in shape {list(t.shape)}, expected a nonzero width")
    if q.dim() == 4:
        nh, nkv = q.shape[1], k.shape[1]
        if k.shape[1] != v.shape[1]:
            raise InputError(f"Nkv: got k {k.shape[1]} heads and v {v.shape[1]}, expected the same number of kv heads")
        if nh == 0 or nkv == 0 or nh % nkv:
            raise InputError(f"Nkv: got Nh={nh} query heads and Nkv={nkv} kv heads, expected Nkv to divide Nh")


def given_tensors(found: "dict[str, Tensor | None]", one_head: bool, b: int, nh: int, tq: int, tk: int,
                  dv: int) -> tuple["dict[str, Tensor]", list[Broken]]:
    """The user's own intermediates placed as ``[B, Nh, Tq, *]``, and a :class:`Broken` for each of the wrong shape.

    ``scores`` and ``weights`` must have the derived grid's shape, ``out`` the context's
    (without the head axis when Q, K, V have none). A wrong shape never broadcasts in.
    """
    grid = (b, nh, tq, tk)
    return _placed(found, GIVEN, {"scores": grid, "weights": grid, "context": (b, nh, tq, dv)}, one_head)


def given_grads(found: "dict[str, Tensor | None]", one_head: bool, shapes: dict[str, tuple[int, ...]]
                ) -> tuple["dict[str, Tensor]", list[Broken]]:
    """The user's saved gradients placed with a head axis, and a :class:`Broken` for each of the wrong shape.

    ``grad_out`` must have the context's shape, ``dq``/``dk``/``dv`` those of q, k, v (without the head
    axis when Q, K, V have none). ``shapes``: stage -> derived shape with the head axis.
    """
    return _placed(found, GIVEN_GRADS, shapes, one_head)


def _placed(found: "dict[str, Tensor | None]", names: tuple[tuple[str, str], ...], shapes: dict[str, tuple[int, ...]],
            one_head: bool) -> tuple["dict[str, Tensor]", list[Broken]]:
    """Each tensor of ``names`` (name, stage) that is there, with a head axis inserted for one head, where it has the
    stage's derived shape; a :class:`Broken` (the expected shape as the user's tensor would have it) where not."""
    given: dict[str, Tensor] = {}
    broken: list[Broken] = []
    for name, stage in names:
        t = found.get(name)
        if t is None:
            continue
        if not t.is_floating_point():
            raise InputError(f"{name}: got dtype {dtype_name(t.dtype)}, expected a floating-point tensor")
        want = shapes[stage]
        t4 = t[:, None] if (one_head and t.dim() == 3) else t
        if tuple(t4.shape) != want:
            broken.append(Broken(stage, "given", shape=tuple(t.shape), expected=want if not one_head else (want[0], *want[2:])))
        else:
            given[name] = t4
    return given, broken


def grad_seed(value: "str | Tensor | None", shape: tuple[int, ...], dtype: "torch.dtype", device: "torch.device",
              *, heads: int | None = None, one_head: bool = False) -> "Tensor":
    """``O-bar`` for the last forward stage: ``ones``, ``identity``, a tensor file, or a tensor.

    Args:
        value: None or ``"ones"`` (every entry 1); ``"identity"`` (I on each head's ``[Tq, Dv]`` block,
            which needs Tq == Dv); a path to a ``.pt``/``.safetensors``/``.npz`` file holding one tensor
            (or one named ``grad_out``) of ``shape``; or a tensor of ``shape``.
        shape: ``[B, Nh, Tq, Dv]`` (the context), or ``[B, Tq, E]`` (the output) with ``heads`` = Nh.
        one_head: the inputs had no head axis: a seed of ``[B, Tq, Dv]`` is expected (and accepted).

    Raises:
        InputError: identity where Tq != Dv, or a file that is unsafe, unreadable or of another shape.
    """
    import torch

    if value is None or (isinstance(value, str) and value == "ones"):
        return torch.ones(shape, dtype=dtype, device=device)
    if isinstance(value, str) and value == "identity":
        return _identity_seed(shape, heads, dtype, device)
    t = value if isinstance(value, torch.Tensor) else _seed_file(str(value))
    if not t.is_floating_point():
        raise InputError(f"grad_output: got dtype {dtype_name(t.dtype)}, expected a floating-point tensor")
    got = list(t.shape)
    if one_head and t.dim() == 3:
        t = t[:, None]  # one head: [B, Tq, Dv] -> [B, 1, Tq, Dv]
    if tuple(t.shape) != tuple(shape):
        want = [shape[0], *shape[2:]] if one_head else list(shape)
        raise InputError(f"grad_output: got shape {got}, expected the shape of the stage it seeds, {want}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise InputError("grad_output: holds NaN or inf values, expected a finite gradient")
    return t.to(dtype=dtype, device=device)


def _identity_seed(shape: tuple[int, ...], heads: int | None, dtype: "torch.dtype", device: "torch.device") -> "Tensor":
    import torch

    if heads is None:  # the context [B, Nh, Tq, Dv]
        b, nh, tq, dv = shape
    else:  # the output [B, Tq, E], its features in Nh blocks of Dv
        b, tq, e = shape
        nh, dv = heads, shape[-1] // heads
    if tq != dv:
        raise InputError(f"grad_output: got 'identity' (I on each head's [Tq, Dv] block), expected Tq == Dv; "
                         f"got Tq={tq}, Dv={dv}")
    eye = torch.eye(tq, dtype=dtype, device=device).expand(b, nh, tq, dv)  # [B, Nh, Tq, Dv]
    return eye.clone() if heads is None else eye.transpose(1, 2).reshape(b, tq, nh * dv)  # [B, Tq, Nh*Dv]


def _seed_file(path: str) -> "Tensor":
    from attn_ledger.inputs.tensorio import load_tensor_file

    found = load_tensor_file(path, "grad_output")
    if "grad_out" in found:
        return found["grad_out"]
    if len(found) != 1:
        raise TensorFileError(f"grad_output: {path!r} holds {sorted(found) or 'nothing'}, expected one tensor "
                              "(or one named 'grad_out')")
    return next(iter(found.values()))


def load(path: "str | os.PathLike[str] | Mapping[str, Tensor]", dtype: "torch.dtype | None",
         device: "torch.device", source: str | None = None) -> dict[str, "Tensor"]:
    """The tensors of a ``.pt`` / ``.safetensors`` / ``.npz`` file, named from :data:`TENSOR_NAMES`, on ``device``
    (floating-point ones cast to ``dtype`` when given). ``path`` may also be the file's tensors, loaded already
    with :func:`~attn_ledger.inputs.tensorio.load_tensor_file`, and ``source`` the name messages give them."""
    from attn_ledger.inputs.tensorio import load_tensor_file

    found = load_tensor_file(path, "tensors") if isinstance(path, (str, os.PathLike)) else dict(path)
    name = source or (str(path) if isinstance(path, (str, os.PathLike)) else "tensors")
    unknown = sorted(set(found) - set(TENSOR_NAMES))
    if unknown:
        raise TensorFileError(f"tensors: {name!r} holds unexpected tensor {unknown[0]!r}, "
                              f"expected names from {', '.join(TENSOR_NAMES)}")
    missing = [n for n in ("q", "k", "v") if n not in found]
    if missing:
        raise TensorFileError(f"tensors: {name!r} has no {missing[0]!r} tensor (found {sorted(found) or 'none'}), "
                              "expected q, k and v")
    t = {n: x.to(device) for n, x in found.items()}
    if dtype is not None:
        for n in ("q", "k", "v", "scores", "weights", "out", "grad_out", "dq", "dk", "dv", "bias"):
            if n in t and t[n].is_floating_point():
                t[n] = t[n].to(dtype)
    return t


def bias_grid(bias: "Tensor | None", b: int, nh: int, tq: int, tk: int, dtype: "torch.dtype") -> "Tensor | None":
    """An additive bias on the scores as ``[B|1, Nh|1, Tq|1, Tk]`` in the run's dtype (None without one).

    Accepted shapes: ``[Tq, Tk]``, ``[B, Tq, Tk]`` and 4-D ones broadcastable to ``[B, Nh, Tq, Tk]``
    (T5's ``position_bias`` is ``[1, Nh, Tq, Tk]``).

    Raises:
        InputError: not floating point, a shape that does not broadcast, or NaN (an infinite entry is a mask's
            business, not a bias's).
    """
    import torch

    if bias is None:
        return None
    if not bias.is_floating_point():
        raise InputError(f"bias: got dtype {dtype_name(bias.dtype)}, expected a floating-point tensor")
    t = bias[:, None] if bias.dim() == 3 else bias[None, None] if bias.dim() == 2 else bias
    ok = t.dim() == 4 and all(got in (1, want) for got, want in zip(t.shape, (b, nh, tq, tk))) and t.shape[-1] == tk
    if not ok:
        raise InputError(f"bias: got shape {list(bias.shape)}, expected one broadcastable to [B, Nh, Tq, Tk] = "
                         f"{[b, nh, tq, tk]} ([Tq, Tk], [B, Tq, Tk] or 4-D)")
    if not bool(torch.isfinite(t).all()):
        raise InputError("bias: holds NaN or inf values, expected a finite additive bias (a mask goes in allow_mask)")
    return t.to(dtype)


def out_in_layout(out: "Tensor | None", layout: str) -> "Tensor | None":
    """A saved ``out`` as ``[B, Nh, Tq, Dv]``: given in ``bthd`` (``[B, Tq, Nh, Dv]``) it is transposed."""
    if layout not in OUT_LAYOUTS:
        raise InputError(f"out_layout: got {layout!r}, expected one of {', '.join(OUT_LAYOUTS)}")
    if out is None or layout == "bhtd":
        return out
    if out.dim() != 4:
        raise InputError(f"out: got rank {out.dim()} shape {list(out.shape)} with out_layout bthd, expected "
                         "[B, Tq, Nh, Dv]")
    return out.transpose(1, 2)


# --- the options of a ledger on given tensors, and its input row ----------------------------------

def rope_spec(rope: Any, dh: int) -> Any:
    """The rotary spec ``rope`` names (validated against the head width), or None."""
    from attn_ledger.maths.rotary import parse_spec

    if rope is None:
        return None
    spec = parse_spec(rope)
    try:
        spec.width(dh)
    except InputError as exc:
        raise InputError(str(exc)) from None
    return spec


def sinks_tensor(sinks: Any, n_heads: int, dtype: "torch.dtype", device: "torch.device") -> "Tensor | None":
    """The attention sinks (:func:`~attn_ledger.inputs.sinks.parse_sinks`) as a ``[Nh]`` tensor in the run's dtype, or None."""
    import torch

    from attn_ledger.inputs.sinks import parse_sinks

    found = parse_sinks(sinks, n_heads)
    return None if found is None else torch.tensor(found, dtype=dtype, device=device)


def file_sinks(t: "Mapping[str, Tensor]", sinks: Any, source: str) -> Any:
    """The sinks of a ledger on saved tensors: ``sinks`` given, or the file's ``sinks`` tensor, not both."""
    if "sinks" in t and sinks is not None:
        raise InputError(f"sinks: got --sinks and a 'sinks' tensor in {source!r}, expected one or the other")
    return t.get("sinks", sinks)


def check_options(scale: Any, temperature: Any, grad: bool, grad_output: Any, grads: "dict[str, Tensor]",
                  softcap: Any = None) -> None:
    """A scale, temperature or soft-cap that is not a positive finite number, or a backward option without
    ``grad``: exit 2."""
    for name, value in (("scale", scale), ("temperature", temperature), ("softcap", softcap)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise InputError(f"{name}: got {value!r}, expected a finite number greater than 0")

    if grad_output is not None and not grad:
        raise InputError(f"grad_output: got {grad_output if isinstance(grad_output, str) else 'a tensor'!r}, "
                         "expected it only with grad (--grad)")
    if grads and not grad:
        raise InputError(f"tensors: holds saved gradients {sorted(grads)}, expected them only with grad (--grad), "
                         "which compares them with the backward stages")
    if "grad_out" in grads and grad_output is not None:
        raise InputError("grad_output: got one together with a saved grad_out, expected one seed for O-bar")


def tensor_rows(rows: "Rows", q: "Tensor", k: "Tensor", v: "Tensor", one_head: bool, relation: "Relation",
                source: str, given: "dict[str, Tensor]") -> tuple[str, dict[str, Any]]:
    """The input row, the title and the facts of a ledger on given Q, K, V."""
    b, nh, tq, dh = q.shape
    nkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = dtype_name(q.dtype)
    rows.shapes["input"] = tuple(q.shape)
    # Q, K, V were validated on the way in (ranks, batch, widths, token counts, kv heads, finite
    # values); the row says so instead of carrying checks that could not fail.
    rows.checks["input"] = []
    rows.row_notes["input"] = Note("given_input", {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                                                   "one_head": one_head, "group": nh // nkv})
    title = (f"ATTENTION LEDGER ({source}) B={b} Tq={tq} Tk={tk} Nh={nh}" + (f" Nkv={nkv}" if nkv != nh else "")
             + f" Dh={dh}" + (f" Dv={dv}" if dv != dh else "") + f" mask={relation.name} dtype={dtype}")
    meta = {"B": b, "Tq": tq, "Tk": tk, "Nh": nh, "Nkv": nkv, "Dh": dh, "Dv": dv, "mask": relation.name,
            "dtype": dtype, "device": str(q.device), "given": sorted(["q", "k", "v", *given])}
    return title, meta
