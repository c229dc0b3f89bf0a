"""A captured call as ``run --tensors`` takes it: the stage ledger of the first wrong call, and ``--save``.

A call's tensors become a tensor file's: ``q``, ``k``, ``v``, ``out`` (the context as the attention function
returned it, ``[B, Tq, Nh, Dv]``: replayed with ``--out-layout bthd``), ``allow_mask`` (the relation the
config implies, ``[B, Tq, Tk]``), and where the call had them ``bias`` (T5's ``position_bias``), ``sinks``
and ``weights``. Padded query rows are read by nobody and judged only as finite, so they are left out:
where a call has some, each example is its own file holding its real query rows (a query with no allowed
key would otherwise be the ledger's finding). The stage ledger of the first wrong call is
:func:`attn_ledger.ledger.ledger_on_qkv` on the example where its worst element is, run with the scale,
soft-cap and sinks the config implies.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from torch import Tensor

    from attn_ledger.probes.model.judge import Call
    from attn_ledger.report import Report


def unreplayable(call: "Call", allow: "Tensor | None") -> str:
    """Why a call cannot go through the stages (empty where it can)."""
    if call.q is None or call.k is None or call.v is None:
        return "its q, k and v were not observed"
    if allow is None:
        return "its q, k and v cannot be read as attention's"
    if _context(call) is None:
        return "its output is not a context of the call's shape"
    return ""


def _context(call: "Call") -> "Tensor | None":
    """The context as ``[B, Tq, Nh, Dv]`` (how transformers returns it), or None where it has another shape."""
    b, nh, tq, _ = call.q.shape
    dv = call.v.shape[-1]
    if call.context is not None:
        return call.context.transpose(1, 2)
    out = call.returned
    if out is None or out.dim() != 4:
        return None
    if call.facts.get("context_layout", "bthd") == "bthd" and list(out.shape) == [b, tq, nh, dv]:
        return out
    if list(out.shape) == [b, nh, tq, dv]:  # returned heads first (a layout finding): its values replay all the same
        return out.transpose(1, 2)
    return None


def call_tensors(call: "Call", allow: "Tensor", real: "Tensor", example: int | None) -> dict[str, "Tensor"]:
    """The call's tensors for ``run --tensors``: one example's real query rows, or (``example`` None) every example
    and row (a call without padded query rows)."""
    import torch

    b, _, tq, _ = call.q.shape
    ex = slice(None) if example is None else slice(example, example + 1)
    rows = torch.arange(tq) if example is None else torch.nonzero(real[example]).flatten()  # [R]
    out: dict[str, Tensor] = {
        "q": call.q[ex][:, :, rows], "k": call.k[ex], "v": call.v[ex],
        "out": _context(call)[ex][:, rows],
        "allow_mask": allow[ex][:, 0][:, rows]}  # [B', R, Tk]
    if call.bias is not None:
        bias = call.bias if call.bias.dim() == 4 else call.bias.reshape(1, 1, *call.bias.shape[-2:])
        bias = bias if bias.shape[0] == 1 else bias[ex]
        out["bias"] = bias if bias.shape[-2] == 1 else bias[:, :, rows]
    if call.sinks is not None:
        out["sinks"] = call.sinks
    if call.weights is not None and list(call.weights.shape[:3]) == [b, call.q.shape[1], tq]:
        out["weights"] = call.weights[ex][:, :, rows]
    return {n: t.detach().contiguous() for n, t in out.items()}


def options(scale: float | None, softcap: float | None) -> list[str]:
    """The ``run --tensors`` options that replay a call as the config implies it."""
    opts = ["--out-layout", "bthd"]
    if scale is not None:
        opts += ["--scale", f"{scale:.17g}"]
    if softcap is not None:
        opts += ["--softcap", f"{softcap:g}"]
    return opts


PICTURE_GRID = 128 * 128
"""A call's stage ledger keeps its grids (for the HTML page's mask and weight pictures) up to this many
(query, key) pairs per head."""


def stage_ledger(call: "Call", allow: "Tensor", real: "Tensor", example: int, label: str, scale: float,
                 softcap: float | None) -> "Report | str":
    """The stage ledger of one call on one example's real query rows, or why it cannot be run."""
    from attn_ledger.errors import AttnLedgerError
    from attn_ledger.ledger import ledger_on_qkv

    why = unreplayable(call, allow)
    if why:
        return why
    t = call_tensors(call, allow, real, example)
    if t["q"].shape[2] == 0:
        return f"example {example} has no real query row"
    try:
        return ledger_on_qkv(t["q"], t["k"], t["v"], allow_mask=t["allow_mask"], out=t["out"], out_layout="bthd",
                             weights=t.get("weights"), scale=scale, softcap=softcap, sinks=t.get("sinks"),
                             bias=t.get("bias"), keep_grids=t["q"].shape[2] * t["k"].shape[2] <= PICTURE_GRID,
                             source=f"{label}, example {example}, {t['q'].shape[2]} real query rows")
    except AttnLedgerError as exc:  # the call's tensors are not what the ledger takes (a non-finite q, say)
        return f"the ledger does not take its tensors: {exc}"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def file_name(index: int, label: str, example: int | None) -> str:
    """``007-layers.3.self_attn.safetensors`` (``-b1`` for one example's file)."""
    name = _UNSAFE.sub("_", label).strip("_") or "call"
    return f"{index:03d}-{name}" + ("" if example is None else f"-b{example}") + ".safetensors"


def save_call(directory: str, index: int, label: str, call: "Call", allow: "Tensor", real: "Tensor",
              scale: float | None, softcap: float | None) -> list[dict[str, Any]]:
    """Write one call's tensor files into ``directory``; returns ``[{"file", "options"}]`` for each written."""
    from attn_ledger.inputs.tensorio import save_tensor_file

    if unreplayable(call, allow):
        return []
    examples: list[int | None] = [None] if bool(real.all()) else [e for e in range(real.shape[0]) if bool(real[e].any())]
    written = []
    for e in examples:
        name = file_name(index, label, e)
        save_tensor_file(call_tensors(call, allow, real, e), os.path.join(directory, name))
        written.append({"file": name, "options": options(scale, softcap)})
    return written


def saved_summary(directory: str, files: list[Mapping[str, Any]]) -> dict[str, Any]:
    """What the report says of ``--save``: the directory, the files, and the command that replays the first."""
    first = files[0] if files else None
    command = None if first is None else " ".join(["attn-ledger", "run", "--tensors",
                                                   os.path.join(directory, first["file"]), *first["options"]])
    return {"directory": directory, "files": len(files), "replay": command}
