"""The cases ``check --protocol transformers`` calls an attention-interface function on.

A function registered in transformers' ``AttentionInterface`` is called by every layer of a model as::

    attn_output, attn_weights = fn(module, query, key, value, attention_mask,
                                   dropout=..., scaling=..., sliding_window=..., softcap=..., s_aux=..., **kwargs)

query ``[B, H, Tq, D]``, key and value ``[B, Hkv, Tk, D]``; it returns ``attn_output [B, Tq, H, D]``
(transposed back) and the weights ``[B, H, Tq, Tk]`` or None. A :class:`ICase` is one such call;
its id is readable and complete::

    b2-h4kv2-tq6tk6-d8-lpad4-eager-f32-sc0.25-w3-cap30-sinks-train0.5
    |  |      |      |  |     |     |   |      |  |     |     dropout p in training mode
    |  |      |      |  |     |     |   |      |  |     s_aux (one logit per head)
    |  |      |      |  |     |     |   |      |  soft-cap
    |  |      |      |  |     |     |   |      sliding window of W keys
    |  |      |      |  |     |     |   explicit scaling (absent: D ** -0.5, as Llama's)
    |  |      |      |  |     |     dtype: f32, f16, bf16
    |  |      |      |  |     the mask the function gets: sdpa (transformers' sdpa_mask: bool, or None with
    |  |      |      |  |     module.is_causal where sdpa's path skips it), eager (eager_mask: additive float),
    |  |      |      |  |     none (no mask function registered for the name: None, module.is_causal),
    |  |      |      |  |     flex (flex_attention_mask: a BlockMask; on CPU each new shape compiles)
    |  |      |      |  padding: nopad, lpadN (example b's first N >> b tokens padded), rpadN (its last N >> b)
    |  |      |      head width D
    |  |      Tq, Tk (Tq < Tk: decode, the queries are the last Tq positions)
    |  H query heads, Hkv kv heads
    B

Tiers: the default tier is small cases (``features``: those that need a declared feature); ``full``
adds cases at real sizes chosen pairwise over GQA groupings, lengths, head widths, padding, masks, dtypes,
scalings and windows, and over soft-caps, sinks and windows together (:data:`GRID`).

Every case is causal, as the decoder families are. The relation the judge holds a case to is built
here, apart from transformers (:func:`allowed`); the worker builds the mask with transformers' own
functions (:mod:`attn_ledger.probes.interface.driver`).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from attn_ledger.devices import torch_dtype
from attn_ledger.errors import InputError, shown
from attn_ledger.probes.common.grid import GridCase, pairwise, with_new

if TYPE_CHECKING:
    from torch import Tensor

FEATURES = ("window", "softcap", "sinks")
MASK_FUNCTIONS = ("sdpa", "eager", "none", "flex")
TIERS = ("default", "full")
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
ATTENTION_DROPOUT = 0.25  # the stand-in's module.attention_dropout: the layers pass dropout=0.0 unless training
LIMITS = {"B": 16, "H": 64, "Hkv": 64, "Tq": 1024, "Tk": 1024, "D": 256}

_ID_RE = re.compile(
    r"^b(?P<b>\d{1,4})-h(?P<h>\d{1,4})kv(?P<hkv>\d{1,4})-tq(?P<tq>\d{1,5})tk(?P<tk>\d{1,5})-d(?P<d>\d{1,4})"
    r"-(?P<pad>nopad|lpad\d{1,5}|rpad\d{1,5})-(?P<mask>sdpa|eager|none|flex)-(?P<dtype>f32|f16|bf16)"
    r"(?:-sc(?P<scaling>\d{1,6}(?:\.\d{1,8})?))?(?:-w(?P<window>\d{1,5}))?(?:-cap(?P<softcap>\d{1,5}(?:\.\d{1,4})?))?"
    r"(?P<sinks>-sinks)?(?:-train(?P<train>0\.\d{1,4}))?$"
)


@dataclass(frozen=True)
class ICase:
    """One call of the function (see the module docstring for the id)."""

    b: int
    h: int
    hkv: int
    tq: int
    tk: int
    d: int
    pad: str = "nopad"
    mask: str = "sdpa"
    dtype: str = "f32"
    scaling: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    train: float | None = None

    @property
    def id(self) -> str:
        return (f"b{self.b}-h{self.h}kv{self.hkv}-tq{self.tq}tk{self.tk}-d{self.d}-{self.pad}-{self.mask}-{self.dtype}"
                + ("" if self.scaling is None else f"-sc{self.scaling:g}")
                + ("" if self.window is None else f"-w{self.window}")
                + ("" if self.softcap is None else f"-cap{self.softcap:g}")
                + ("-sinks" if self.sinks else "") + ("" if self.train is None else f"-train{self.train:g}"))

    @property
    def size(self) -> int:
        return self.b * (self.h * self.tq + 2 * self.hkv * self.tk) * self.d

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype]

    @property
    def groups(self) -> int:
        return self.h // self.hkv

    @property
    def effective_scaling(self) -> float:
        return self.d ** -0.5 if self.scaling is None else self.scaling

    @property
    def features(self) -> tuple[str, ...]:
        on = {"window": self.window is not None, "softcap": self.softcap is not None, "sinks": self.sinks}
        return tuple(f for f in FEATURES if on[f])

    def padding(self) -> list[tuple[int, int]]:
        """Per example, the padded tokens at the start and at the end of the Tk positions."""
        if self.pad == "nopad":
            return [(0, 0)] * self.b
        n = int(self.pad[4:])
        return [((n >> i), 0) if self.pad.startswith("lpad") else (0, (n >> i)) for i in range(self.b)]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "B": self.b, "H": self.h, "Hkv": self.hkv, "Tq": self.tq, "Tk": self.tk, "D": self.d,
                "padding": self.pad, "mask": self.mask, "dtype": self.dtype_name, "scaling": self.scaling,
                "window": self.window, "softcap": self.softcap, "sinks": self.sinks, "dropout": self.train,
                "elements": self.size}


def parse_icase(case_id: str) -> ICase:
    """Rebuild an :class:`ICase` from its id.

    Raises:
        InputError: the id is malformed or names an impossible case.
    """
    m = _ID_RE.match(case_id.strip())
    if m is None:
        raise InputError(f"case: got {shown(case_id)}, expected an id like 'b2-h4kv2-tq6tk6-d8-lpad4-eager-f32' "
                         f"(padding nopad, lpadN, rpadN; masks {', '.join(MASK_FUNCTIONS)}; dtypes "
                         f"{', '.join(DTYPES)}; optional -scS, -wW, -capC, -sinks, -trainP)")
    g = m.groupdict()
    case = ICase(*(int(g[k]) for k in ("b", "h", "hkv", "tq", "tk", "d")), pad=g["pad"], mask=g["mask"],
                 dtype=g["dtype"], scaling=None if g["scaling"] is None else float(g["scaling"]),
                 window=None if g["window"] is None else int(g["window"]),
                 softcap=None if g["softcap"] is None else float(g["softcap"]), sinks=g["sinks"] is not None,
                 train=None if g["train"] is None else float(g["train"]))
    _validate(case, case_id)
    return case


def _validate(c: ICase, name: str) -> None:
    for axis, value in {"B": c.b, "H": c.h, "Hkv": c.hkv, "Tq": c.tq, "Tk": c.tk, "D": c.d}.items():
        if not 1 <= value <= LIMITS[axis]:
            raise InputError(f"case {name!r}: {axis}={value}, expected between 1 and {LIMITS[axis]}")
    if c.h % c.hkv:
        raise InputError(f"case {name!r}: Hkv must divide H: Hkv={c.hkv}, H={c.h}")
    if c.tq > c.tk:
        raise InputError(f"case {name!r}: Tq={c.tq} > Tk={c.tk}; the queries are the last Tq of the Tk positions")
    lead, tail = c.padding()[0]
    if lead + tail >= c.tk:
        raise InputError(f"case {name!r}: padding {lead + tail} must leave a token: expected less than Tk={c.tk}")
    if c.mask == "none" and (c.pad != "nopad" or c.tq not in (1, c.tk)):
        raise InputError(f"case {name!r}: mask 'none' is a call without a mask, which the layers make only "
                         "without padding and with Tq = 1 or Tq = Tk")
    if c.window is not None and c.window < 1:
        raise InputError(f"case {name!r}: window={c.window}, expected at least 1")
    if c.scaling is not None and not 0 < c.scaling <= 16:
        raise InputError(f"case {name!r}: scaling={c.scaling:g}, expected a value in (0, 16]")


# --- the grid -----------------------------------------------------------------------------------

_CASES: tuple[tuple[str, str], ...] = (
    ("b2-h4kv2-tq5tk5-d8-nopad-sdpa-f32", "GQA (2 groups), prefill, no padding: sdpa's path gives None and is_causal"),
    ("b2-h4kv2-tq5tk5-d8-nopad-eager-f32", "GQA, prefill, eager's additive causal mask"),
    ("b2-h4kv4-tq5tk5-d8-nopad-sdpa-f32", "MHA: the module has no num_key_value_groups (GPT-2, BERT, T5)"),
    ("b2-h4kv1-tq5tk5-d8-nopad-eager-f32", "multi-query (Hkv = 1)"),
    ("b2-h6kv2-tq4tk4-d8-nopad-sdpa-f32", "GQA with 3 groups: tiling and repeating differ"),
    ("b2-h6kv2-tq4tk4-d8-nopad-eager-f32", "GQA with 3 groups, eager's mask"),
    ("b2-h4kv2-tq5tk5-d8-nopad-sdpa-f32-sc0.0625", "scaling other than 1/sqrt(D) (Gemma 2's query_pre_attn_scalar)"),
    ("b2-h4kv2-tq5tk5-d8-nopad-eager-f32-sc1", "scaling 1"),
    ("b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32", "left padding 4 and 2: fully padded query rows, sdpa's bool mask"),
    ("b2-h4kv2-tq6tk6-d8-lpad4-eager-f32", "left padding 4 and 2: fully padded rows, eager's finfo.min mask"),
    ("b2-h4kv2-tq6tk6-d8-rpad2-sdpa-f32", "right padding 2 and 1, sdpa's mask"),
    ("b2-h4kv2-tq6tk6-d8-rpad2-eager-f32", "right padding 2 and 1, eager's mask"),
    ("b2-h4kv2-tq48tk48-d16-lpad32-sdpa-f32", "left padding 32 and 16: fully padded rows up to a block boundary"),
    ("b2-h4kv2-tq48tk48-d16-lpad32-eager-f32", "left padding 32 and 16, eager's mask"),
    ("b2-h4kv2-tq8tk8-d8-nopad-sdpa-f32-w3", "a sliding window of 3 keys in the mask (Mistral)"),
    ("b2-h4kv2-tq8tk8-d8-nopad-eager-f32-w3", "a sliding window of 3 in eager's mask"),
    ("b2-h4kv2-tq8tk8-d8-lpad4-sdpa-f32-w3", "a sliding window with left padding"),
    ("b2-h4kv2-tq8tk8-d8-lpad4-eager-f32-w3", "a sliding window with left padding, eager's mask"),
    ("b2-h4kv2-tq1tk7-d8-nopad-sdpa-f32", "decode (Tq = 1): sdpa's path gives None, all keys are the past"),
    ("b2-h4kv2-tq3tk7-d8-nopad-sdpa-f32", "decode with Tq < Tk: bottom-right causal"),
    ("b2-h4kv2-tq3tk7-d8-nopad-eager-f32", "decode with Tq < Tk, eager's mask"),
    ("b2-h4kv2-tq1tk7-d8-lpad2-eager-f32", "decode with left padding"),
    ("b2-h4kv2-tq5tk5-d8-nopad-sdpa-f16", "float16"),
    ("b2-h4kv2-tq6tk6-d8-lpad4-eager-f16", "float16, left padding (finfo.min of float16)"),
    ("b2-h4kv2-tq5tk5-d8-nopad-sdpa-bf16", "bfloat16"),
    ("b2-h4kv2-tq6tk6-d8-lpad4-eager-bf16", "bfloat16, left padding"),
    ("b2-h4kv2-tq5tk5-d8-nopad-eager-f32-train0.5", "training mode: dropout=0.5 given (judged for layout and finiteness)"),
    # flex's BlockMask (a function that declares --masks flex): on CPU each new shape compiles, so few
    ("b2-h4kv2-tq5tk5-d8-nopad-flex-f32", "flex's BlockMask (flex_attention_mask), GQA prefill"),
    ("b2-h4kv2-tq6tk6-d8-lpad4-flex-f32", "flex's BlockMask with left padding 4 and 2: fully padded query rows"),
    ("b2-h4kv2-tq3tk7-d8-nopad-flex-f32-w3", "flex's BlockMask, decode with Tq < Tk and a sliding window of 3"),
)
_FEATURE_CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "window": (
        ("b2-h4kv2-tq8tk8-d8-nopad-none-f32-w3", "no mask: the function applies sliding_window=3 itself"),
        ("b2-h4kv2-tq1tk9-d8-nopad-none-f32-w4", "decode, no mask: sliding_window=4 keeps the last 4 keys"),
        ("b2-h4kv2-tq8tk8-d8-nopad-none-bf16-w3", "bfloat16, no mask, sliding_window=3"),
    ),
    "softcap": (
        ("b2-h4kv2-tq5tk5-d8-nopad-eager-f32-cap1.5", "soft-cap 1.5 on scores of about 1"),
        ("b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32-sc0.5-cap2", "soft-cap with padding and scaling 0.5 (Gemma 2)"),
        ("b2-h4kv2-tq8tk8-d8-nopad-eager-bf16-sc0.5-w3-cap2", "bfloat16, soft-cap and a window (Gemma 2)"),
        ("b2-h4kv2-tq6tk6-d8-lpad4-flex-f32-cap1.5", "flex's BlockMask with a soft-cap (its score_mod)"),
    ),
    "sinks": (
        ("b2-h4kv2-tq5tk5-d8-nopad-eager-f32-sinks", "sinks: one logit per head in the denominator (gpt-oss)"),
        ("b2-h4kv2-tq6tk6-d8-lpad4-sdpa-f32-sinks", "sinks with left padding: a fully padded row"),
        ("b2-h4kv2-tq3tk7-d8-nopad-eager-f32-w3-sinks", "sinks, a window and Tq < Tk (gpt-oss)"),
        ("b2-h4kv2-tq5tk5-d8-nopad-sdpa-bf16-sinks", "bfloat16 with sinks"),
    ),
}

# The full tier: cases at real sizes, every pair of values of two axes in some case (pairwise).
_FULL_AXES: dict[str, Sequence[Any]] = {
    "heads": ((2, 4, 2), (1, 8, 1), (2, 8, 2), (2, 12, 4), (1, 16, 2), (2, 6, 6)),  # B, H, Hkv: 2, 8, 4, 3, 8, 1 groups
    "lengths": ((1, 64), (1, 257), (17, 17), (64, 64), (113, 113), (16, 100), (128, 128)),
    "d": (64, 128, 80, 32),
    "pad": ("nopad", "lpad16", "lpad48", "rpad8"),
    "mask": ("sdpa", "eager"),
    "dtype": ("f32", "f16", "bf16"),
    "scaling": (None, 0.0625, 1.0),
    "window": (None, 4, 32),
}
# Features at real sizes: what a function applies itself, alone and together (each needs its declaration).
_FULL_FEATURE_AXES: dict[str, Sequence[Any]] = {
    "features": (("softcap",), ("sinks",), ("softcap", "sinks"), ("window",), ("window", "sinks")),
    "heads": ((2, 4, 2), (1, 8, 1), (2, 12, 4)),
    "lengths": ((1, 64), (64, 64), (16, 100), (113, 113)),
    "pad": ("nopad", "lpad16"),
    "mask": ("sdpa", "eager", "none"),
    "dtype": ("f32", "f16", "bf16"),
    "window": (None, 8),
}
_FULL_COST = 1 << 23  # B * H * Tq * Tk * D at most: one full-tier case, its reference and its probes in about a second
_FULL_EXTRA: tuple[tuple[str, str], ...] = (
    ("b2-h8kv2-tq128tk128-d64-lpad48-flex-f32", "flex's BlockMask at a real size, left padding 48 and 24"),
    ("b1-h8kv1-tq1tk257-d64-lpad16-flex-f32-w32", "flex's BlockMask, decode over 257 keys with a window of 32"),
    ("b2-h8kv2-tq1tk1024-d64-lpad128-sdpa-f32", "decode over 1024 keys, left padding 128 and 64"),
    ("b2-h8kv2-tq1tk1024-d64-lpad128-eager-bf16-w256", "bfloat16 decode over 1024 keys, a window of 256, eager's mask"),
)


def needs(case: ICase) -> tuple[str, ...]:
    """The features a function must declare to be called on ``case``: a soft-cap and sinks always, a
    window where no mask carries it (mask ``none``); a window in the mask is passed only where declared."""
    return tuple(f for f in case.features if f != "window" or case.mask == "none")


def _full_valid(p: Mapping[str, Any]) -> bool:
    tq, tk = p.get("lengths", (1, 1 << 20))
    pad = p.get("pad", "nopad")
    if "lengths" in p and pad != "nopad" and int(pad[4:]) >= tk:
        return False
    if "heads" in p and p["heads"][1] == p["heads"][2] and p.get("mask") not in (None, "sdpa"):
        return False  # MHA with no num_key_value_groups (GPT-2, BERT, T5): sdpa's mask, as those families use
    if p.get("mask") == "none" and (pad != "nopad" or tq not in (1, tk)):
        return False  # no layer calls without a mask under padding or with 1 < Tq < Tk
    if p.get("mask") == "none" and "features" in p and "window" not in p["features"] and p.get("window"):
        return False  # a window with no mask is the window feature
    if "window" in p.get("features", ()) and (("window" in p and p["window"] is None)
                                              or p.get("mask") not in (None, "none")):
        return False  # the window feature: the function applies sliding_window itself, with no mask
    if "lengths" in p and "heads" in p and "d" in p:
        b, h, _ = p["heads"]
        if b * h * tq * tk * p["d"] > _FULL_COST:
            return False
    return True


def _described(c: ICase) -> str:
    """What a full-tier case exercises, as a reason."""
    parts = [f"decode over {c.tk} keys" if c.tq == 1 else (f"Tq {c.tq} < Tk {c.tk}" if c.tq < c.tk else f"T = {c.tq}"),
             "MQA" if c.hkv == 1 else ("MHA" if c.hkv == c.h else f"GQA, {c.groups} groups"), f"D {c.d}"]
    lead, tail = c.padding()[0]
    parts.append(f"left padding {lead}" if lead else (f"right padding {tail}" if tail else "no padding"))
    parts += [f"{c.mask}'s mask" if c.mask != "none" else "no mask", c.dtype_name]
    given = {"scaling": c.scaling, "window": c.window, "soft-cap": c.softcap}
    parts += [f"{word} {value:g}" for word, value in given.items() if value is not None] + ["sinks"] * c.sinks
    need = needs(c)
    return "pairwise: " + ", ".join(parts) + (f" (needs --supports {','.join(need)})" if need else "")


def _full_cases() -> list[GridCase]:
    out = []
    for axes, feature_axis in ((_FULL_AXES, False), (_FULL_FEATURE_AXES, True)):
        for p in pairwise(axes, _full_valid):
            (b, h, hkv), (tq, tk) = p["heads"], p["lengths"]
            on = p["features"] if feature_axis else ()
            d = p.get("d", 64)
            case = ICase(b, h, hkv, tq, tk, d, pad=p["pad"], mask=p["mask"], dtype=p["dtype"],
                         scaling=p.get("scaling"), window=p["window"], softcap=2.0 if "softcap" in on else None,
                         sinks="sinks" in on)
            _validate(case, case.id)
            out.append(GridCase(case, "full", _described(case)))
    out += [GridCase(parse_icase(i), "full", why) for i, why in _FULL_EXTRA]
    return out


def _grid() -> tuple[GridCase, ...]:
    first = [GridCase(parse_icase(i), "default", why) for i, why in _CASES]
    first += [GridCase(parse_icase(i), "features", f"{key}: {why}") for key, entries in _FEATURE_CASES.items()
              for i, why in entries]
    return with_new(first, _full_cases())


GRID: tuple[GridCase, ...] = _grid()
"""Every case of the protocol, with its tier (``default``, ``features``: the default tier's cases that need a
declared feature, ``full``) and reason."""


def interface_cases(supports: Iterable[str] = (), masks: Iterable[str] = MASK_FUNCTIONS,
                    tier: str = "default") -> tuple[ICase, ...]:
    """The cases for a function that takes the mask kinds ``masks`` and declares the features ``supports``:
    the default tier's (with ``full``, every tier's) whose needed features (:func:`needs`) are declared."""
    if tier not in TIERS:
        raise InputError(f"tier: got {tier!r}, expected one of {', '.join(TIERS)}")
    on, kinds = set(supports), set(masks)
    picked = [g.case for g in GRID if (tier == "full" or g.tier != "full") and set(needs(g.case)) <= on]
    return tuple(c for c in picked if c.mask in kinds or (c.mask == "none" and "sdpa" in kinds))


def reasons() -> dict[str, str]:
    return {g.case.id: g.reason for g in GRID}


# --- inputs and the relation --------------------------------------------------------------------


def case_crc(case: ICase) -> int:
    return zlib.crc32(case.id.encode())


def case_tensors(case: ICase | str, seed: int = 0) -> dict[str, "Tensor"]:
    """The exact inputs: ``query [B, H, Tq, D]``, ``key`` and ``value [B, Hkv, Tk, D]`` in the case's dtype,
    and ``sinks [H]`` with the feature; drawn on the CPU in float64 from the case's own stream."""
    import torch

    from attn_ledger.seeding import generator

    case = parse_icase(case) if isinstance(case, str) else case
    gen = generator(case_crc(case) ^ seed)
    dt = torch_dtype(case.dtype_name)
    shapes = {"query": (case.b, case.h, case.tq, case.d), "key": (case.b, case.hkv, case.tk, case.d),
              "value": (case.b, case.hkv, case.tk, case.d)}
    qk = (case.effective_scaling * math.sqrt(case.d)) ** -0.5  # q and k spread so the scaled scores are about 1
    out = {n: (torch.randn(s, generator=gen, dtype=torch.float64) * (qk if n != "value" else 1.0)).to(dt)
           for n, s in shapes.items()}
    if case.sinks:
        out["sinks"] = (torch.randn(case.h, generator=gen, dtype=torch.float64) + 0.5).to(dt)
    return out


def perturbed(case: ICase, t: dict[str, "Tensor"], seed: int, parts: Iterable[str], *, example: int | None = None,
              head: int | None = None) -> dict[str, "Tensor"]:
    """``t`` with fresh values for one example (``example``) or one head (``head``: a query head of
    ``query``, a kv head of ``key`` and ``value``) of the tensors ``parts``, drawn as :func:`case_tensors`
    draws them from a stream of their own; every other value is ``t``'s."""
    import torch

    from attn_ledger.seeding import generator

    gen = generator(case_crc(case) ^ seed ^ 0x150)
    qk = (case.effective_scaling * math.sqrt(case.d)) ** -0.5
    out = dict(t)
    for name in parts:
        x = t[name].clone()
        at = (example,) if example is not None else (slice(None), head)
        shape = x[at].shape
        x[at] = (torch.randn(shape, generator=gen, dtype=torch.float64) * (qk if name != "value" else 1.0)).to(x.dtype)
        out[name] = x
    return out


def padding_mask(case: ICase, device: Any = None) -> "Tensor":
    """The 2-D ``attention_mask`` a tokenizer gives: ``[B, Tk]`` True (1) at real tokens."""
    import torch

    j = torch.arange(case.tk, device=device)
    rows = [(j >= lead) & (j < case.tk - tail) for lead, tail in case.padding()]
    return torch.stack(rows)


def allowed(case: ICase, device: Any = None) -> "Tensor":
    """``[B, 1, Tq, Tk]`` True where query i may use key j: causal bottom-right (query i sits at position
    ``i + Tk - Tq``), within the window (``pos - j < W``), and key j is a real token."""
    import torch

    i = torch.arange(case.tq, device=device)[:, None] + (case.tk - case.tq)
    j = torch.arange(case.tk, device=device)[None, :]
    rel = j <= i
    if case.window is not None:
        rel = rel & (i - j < case.window)
    return rel[None, None] & padding_mask(case, device)[:, None, None, :]
