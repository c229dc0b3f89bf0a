"""The cases ``attn-ledger check`` runs a kernel on: ids, tiers, masks and inputs.

A :class:`Case` is one call of the kernel on a seeded input. Its id is readable and complete::

    b2-h8kv2-tq203tk217-dh80dv80-lpad64-causal-edge-bf16-s0.125
    |  |      |          |        |            |    |    explicit scale= (absent: 1/sqrt(Dh))
    |  |      |          |        |            |    |    then the features: -capC soft-cap, -wW window, -sinks
    |  |      |          |        |            |    dtype: f32, f64, f16, bf16
    |  |      |          |        |            inputs: rand, index, large, edge, huge
    |  |      |          |        mask relation (below)
    |  |      |          Dh, Dv
    |  |      Tq, Tk
    |  Nh query heads, Nkv kv heads
    B

Mask relations: ``none``; ``causal-flag`` (``is_causal=True``); ``causal-mask`` (the same
relation as a bool ``allow_mask [Tq, Tk]``); ``pad`` (right padding, ``[B, 1, 1, Tk]``);
``pad-causal`` (padding and ``is_causal=True``); ``pad-empty`` (the last example has no key);
``lpadN`` (left padding: example b's first ``N >> b`` keys are blocked, so example 0's first
allowed key is key N); ``gapSxL`` (keys S .. S+L-1 blocked for every query: a blocked run in
the middle). ``lpadN`` and ``gapSxL`` take a ``-causal`` suffix that adds ``is_causal=True``.

Inputs: ``rand`` standard normal; ``index`` each value encodes its coordinates; ``large`` q and
k times 12 (scores reach |s| > 100); ``edge`` q and k rescaled so that the largest scaled score
(the largest, not the largest in magnitude) sits a quarter past the point where exp overflows in the case's dtype (11.1 in float16, 88.7
in bfloat16 and float32, 709.8 in float64); ``huge`` q and k rescaled so that the largest raw
``q . k`` is four times float16's largest finite value (use with a small explicit scale: the
scaled scores stay modest while a kernel that multiplies before scaling overflows).

Features (declared by a kernel that takes them, see :mod:`attn_ledger.probes.kernel.spec`): ``-capC``
passes ``softcap=C`` (the scaled scores become ``C * tanh(s / C)`` before the mask); ``-wW`` passes
``window=W`` (query i may use key j only if ``i + (Tk - Tq) - j < W``: W keys including the query's own
position, as transformers' ``sliding_window_overlay`` defines it; combined with the other masks);
``-sinks`` passes ``sinks``, one logit per query head ``[Nh]`` that joins each row's softmax
denominator and mixes no value (gpt-oss). Cases with features are not in the tiers: they are added
for a kernel that declares them (:func:`feature_cases`).

Tiers: :data:`DEFAULT_TIER` runs fast on a CPU (the small cases that give the smallest failing
case, and a few cases at real sizes for each class of bug); :data:`FULL_TIER` adds cases at
real sizes chosen by pairwise combination of the axes (:func:`pairwise`), for nightly CI.
Every case in a tier carries the reason it is there (:class:`GridCase`).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from attn_ledger.devices import torch_dtype
from attn_ledger.probes.common.grid import GridCase, describe_tiers, pairwise, with_new
from attn_ledger.maths.relations import CAUSAL, KEY_GAP, NO_RELATION, RelationSpec
from attn_ledger.errors import InputError, shown

if TYPE_CHECKING:
    import torch
    from torch import Tensor

BASE_MASKS = ("none", "causal-flag", "causal-mask", "pad", "pad-causal", "pad-empty")
INPUTS = ("rand", "index", "large", "edge", "huge")
DTYPES = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16"}
TIERS = ("default", "full")
FEATURES = ("softcap", "window", "sinks")

LIMITS = {"B": 64, "Nh": 128, "Nkv": 128, "Tq": 4096, "Tk": 4096, "Dh": 512, "Dv": 512}
MAX_CASE_BYTES = 1 << 30  # a case (inputs, outputs, probes and the streamed reference) fits in about 1 GiB
MAX_ID_DIGITS = 8  # of each number in a case id: every limit above fits in 4; Python refuses int() past 4300

_LARGE = 12.0  # q and k scale for "large" inputs: score std about 144, so |s| > 100 occurs
# exp(x) overflows past log(largest finite value): 11.09 in float16, 88.72 in bfloat16/float32, 709.78 in float64
EXP_LIMIT = {"float16": math.log(65504.0), "bfloat16": math.log(3.3895313892515355e38),
             "float32": math.log(3.4028234663852886e38), "float64": math.log(1.7976931348623157e308)}
FLOAT16_MAX = 65504.0

_MASK_RE = (r"(?:" + "|".join(sorted(BASE_MASKS, key=len, reverse=True)) + r"|lpad\d+(?:-causal)?|gap\d+x\d+(?:-causal)?)")
_ID_RE = re.compile(
    r"^b(?P<b>\d+)-h(?P<nh>\d+)kv(?P<nkv>\d+)-tq(?P<tq>\d+)tk(?P<tk>\d+)-dh(?P<dh>\d+)dv(?P<dv>\d+)"
    r"-(?P<mask>" + _MASK_RE + r")"
    r"-(?P<inputs>" + "|".join(INPUTS) + r")-(?P<dtype>" + "|".join(DTYPES) + r")"
    r"(?:-s(?P<scale>\d+(?:\.\d+)?(?:e-?\d+)?))?"
    r"(?:-cap(?P<softcap>\d+(?:\.\d+)?))?(?:-w(?P<window>\d+))?(?P<sinks>-sinks)?$"
)
_LPAD_RE = re.compile(r"^lpad(\d+)(-causal)?$")
_GAP_RE = re.compile(r"^gap(\d+)x(\d+)(-causal)?$")


@dataclass(frozen=True)
class Case:
    """One call of the kernel: sizes, mask relation, input kind, dtype and scale (see the module docstring).

    Attributes:
        b, nh, nkv, tq, tk, dh, dv: B, Nh, Nkv, Tq, Tk, Dh, Dv.
        mask: the mask relation token.
        inputs: ``rand``, ``index``, ``large``, ``edge`` or ``huge``.
        dtype: ``f32``, ``f64``, ``f16`` or ``bf16``.
        scale: an explicit ``scale=`` argument (id suffix ``-s0.25``), or None for 1/sqrt(Dh).
        softcap: a ``softcap=`` argument (id suffix ``-cap30``), or None.
        window: a ``window=`` argument (id suffix ``-w4``), or None.
        sinks: the call passes ``sinks`` (one logit per query head; id suffix ``-sinks``).
    """

    b: int
    nh: int
    nkv: int
    tq: int
    tk: int
    dh: int
    dv: int
    mask: str = "none"
    inputs: str = "rand"
    dtype: str = "f32"
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    sinks: bool = False

    @property
    def id(self) -> str:
        return (
            f"b{self.b}-h{self.nh}kv{self.nkv}-tq{self.tq}tk{self.tk}-dh{self.dh}dv{self.dv}"
            f"-{self.mask}-{self.inputs}-{self.dtype}" + ("" if self.scale is None else f"-s{self.scale:g}")
            + ("" if self.softcap is None else f"-cap{self.softcap:g}")
            + ("" if self.window is None else f"-w{self.window}") + ("-sinks" if self.sinks else "")
        )

    @property
    def features(self) -> tuple[str, ...]:
        """The optional features the call passes (:data:`FEATURES`), in that order."""
        on = {"softcap": self.softcap is not None, "window": self.window is not None, "sinks": self.sinks}
        return tuple(f for f in FEATURES if on[f])

    @property
    def size(self) -> int:
        """Elements in q, k and v together: the order in which failing cases are compared."""
        return self.b * (self.nh * self.tq * self.dh + self.nkv * self.tk * (self.dh + self.dv))

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype]

    @cached_property
    def _parsed_mask(self) -> tuple[RelationSpec, bool]:
        return case_relation(self.mask, self.b, self.tk)  # read once per case, when first asked

    @property
    def relation(self) -> RelationSpec:
        """The relation the mask token names, with its lengths for this case's B and Tk."""
        return self._parsed_mask[0]

    @property
    def causal_flag(self) -> bool:
        """The call passes ``is_causal=True`` (for the relation's causal part)."""
        return self._parsed_mask[1]

    @property
    def arguments(self) -> tuple[str, ...]:
        """How the call passes its relation, in the declaration's mask kinds (:func:`argument_kinds`)."""
        return argument_kinds(self.relation, self.causal_flag)

    @property
    def uses_mask(self) -> bool:
        """The call passes a bool ``allow_mask``: some part of the relation is not carried by the flag."""
        return "mask" in self.arguments

    @property
    def causal(self) -> bool:
        """The relation is causal (by the flag or by the mask)."""
        return "causal" in self.relation.names

    @property
    def effective_scale(self) -> float:
        return 1.0 / math.sqrt(self.dh) if self.scale is None else self.scale

    def left_padding(self) -> list[int]:
        """Blocked leading keys per example for ``lpadN`` (``N >> b``), else zeros."""
        rel = self.relation
        if rel.padding_side != "left" or rel.valid_lengths is None:
            return [0] * self.b
        return [self.tk - n for n in rel.valid_lengths]

    def gap(self) -> tuple[int, int] | None:
        """``(start, length)`` of the blocked run for ``gapSxL``."""
        return self.relation.key_gap

    def lengths(self) -> list[int]:
        """Real keys per example for the right-padding relations."""
        rel = self.relation
        if rel.padding_side == "right" and rel.valid_lengths is not None:
            return list(rel.valid_lengths)
        return _right_padding(self.b, self.tk)

    @property
    def right_padded(self) -> bool:
        """The relation pads keys on the right (``pad``, ``pad-causal``, ``pad-empty``)."""
        return self.relation.padding_side == "right" and self.relation.valid_lengths is not None

    def memory_bytes(self) -> int:
        """A bound on what checking this case holds at once: inputs, outputs, gradients and probe copies
        in float64, the mask, and the streamed reference's query block."""
        elements = self.b * (self.nh * self.tq * (self.dh + 2 * self.dv) + self.nkv * self.tk * (self.dh + self.dv))
        return 8 * 14 * elements + 9 * self.b * self.tq * self.tk + (1 << 27)

    def call_text(self, name: str = "attention") -> str:
        """The keyword arguments of the call, as a reader would write them."""
        args = []
        gap = self.gap()
        if not self.uses_mask:
            pass
        elif self.right_padded:
            args.append(f"allow_mask=key_padding(lengths={self.lengths()})[B, 1, 1, Tk]")
        elif self.relation.padding_side == "left":
            args.append(f"allow_mask=left_padding({self.left_padding()})[B, 1, 1, Tk]")
        elif gap is not None:
            s, n = gap
            args.append(f"allow_mask=keys_blocked({s}..{s + n - 1})[1, 1, 1, Tk]")
        else:
            args.append("allow_mask=causal[Tq, Tk]")
        if self.causal_flag:
            args.append("is_causal=True")
        if self.scale is not None:
            args.append(f"scale={self.scale:g}")
        if self.softcap is not None:
            args.append(f"softcap={self.softcap:g}")
        if self.window is not None:
            args.append(f"window={self.window}")
        if self.sinks:
            args.append("sinks=sinks[Nh]")
        return f"{name}(q, k, v{''.join(', ' + a for a in args)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "B": self.b, "Nh": self.nh, "Nkv": self.nkv, "Tq": self.tq, "Tk": self.tk,
            "Dh": self.dh, "Dv": self.dv, "mask": self.mask, "inputs": self.inputs,
            "dtype": self.dtype_name, "scale": self.scale, "elements": self.size,
            **({"softcap": self.softcap} if self.softcap is not None else {}),
            **({"window": self.window} if self.window is not None else {}),
            **({"sinks": True} if self.sinks else {}),
        }


def _right_padding(b: int, tk: int, empty_last: bool = False) -> list[int]:
    """Real keys per example for ``pad``: Tk - 1, Tk - 3, ... (at least 1); ``pad-empty``: the last example none."""
    lens = [max(1, tk - 1 - 2 * i) for i in range(b)]
    if empty_last and lens:
        lens[-1] = 0
    return lens


def argument_kinds(relation: RelationSpec, causal_flag: bool) -> tuple[str, ...]:
    """The kernel protocol's mask kinds a call of ``relation`` uses: ``causal`` (``is_causal=True`` carries
    the causal part), ``mask`` (a bool ``allow_mask`` carries the rest), or ``none`` (neither)."""
    kinds = (("causal",) if causal_flag else ()) + (
        ("mask",) if set(relation.names) - ({"causal"} if causal_flag else set()) else ())
    return kinds or ("none",)


def case_relation(token: str, b: int, tk: int) -> tuple[RelationSpec, bool]:
    """A mask token (see the module docstring) as the relation it names for B and Tk, and whether the call
    passes its causal part as ``is_causal=True``: the one reader of the token vocabulary.

    ``gapSxL`` is the relation ``key-gap``, which only kernel cases name.

    Raises:
        InputError: the token is none of the mask tokens.
    """
    if token == "none":
        return NO_RELATION, False
    if token in ("causal-flag", "causal-mask"):
        return CAUSAL, token == "causal-flag"
    if token in ("pad", "pad-causal", "pad-empty"):
        flag = token == "pad-causal"
        lens = _right_padding(b, tk, empty_last=token == "pad-empty")
        return RelationSpec(("causal",) * flag + ("padding",), valid_lengths=tuple(lens)), flag
    lpad, gap = _LPAD_RE.match(token), _GAP_RE.match(token)
    if lpad:
        n, flag = int(lpad.group(1)), lpad.group(2) is not None
        lens = tuple(tk - (n >> i) for i in range(b))
        return RelationSpec(("causal",) * flag + ("padding",), valid_lengths=lens, padding_side="left"), flag
    if gap:
        flag = gap.group(3) is not None
        return RelationSpec(("causal",) * flag + (KEY_GAP,), key_gap=(int(gap.group(1)), int(gap.group(2)))), flag
    raise InputError(f"mask: got {shown(token)}, expected one of {', '.join(BASE_MASKS)}, lpadN[-causal] or "
                     "gapSxL[-causal]")


def parse_case(case_id: str) -> Case:
    """Rebuild a :class:`Case` from its id.

    Raises:
        InputError: the id is malformed or names an impossible case, or one too large to check.
    """
    m = _ID_RE.match(case_id.strip())
    if m is None:
        raise InputError(
            f"case: got {case_id[:120]!r}, expected an id like 'b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32' "
            f"(masks {', '.join(BASE_MASKS)}, lpadN[-causal], gapSxL[-causal]; inputs {', '.join(INPUTS)}; "
            f"dtypes {', '.join(DTYPES)}; optional -sSCALE)"
        )
    g = m.groupdict()
    _check_digits(case_id, g)
    case = Case(*(int(g[key]) for key in ("b", "nh", "nkv", "tq", "tk", "dh", "dv")),
                mask=g["mask"], inputs=g["inputs"], dtype=g["dtype"],
                scale=None if g["scale"] is None else float(g["scale"]),
                softcap=None if g["softcap"] is None else float(g["softcap"]),
                window=None if g["window"] is None else int(g["window"]), sinks=g["sinks"] is not None)
    validate(case, case_id)
    return case


_AXIS_GROUPS = {"b": "B", "nh": "Nh", "nkv": "Nkv", "tq": "Tq", "tk": "Tk", "dh": "Dh", "dv": "Dv"}


def _check_digits(case_id: str, groups: Mapping[str, str | None]) -> None:
    """Refuse a number in the id longer than MAX_ID_DIGITS before converting it, naming its field."""
    numbers = {axis: groups[key] for key, axis in _AXIS_GROUPS.items()}
    lpad, gap = _LPAD_RE.match(groups["mask"] or ""), _GAP_RE.match(groups["mask"] or "")
    if lpad:
        numbers["left padding N (lpadN)"] = lpad.group(1)
    if gap:
        numbers["blocked run start S (gapSxL)"], numbers["blocked run length L (gapSxL)"] = gap.group(1), gap.group(2)
    if groups["scale"] is not None:
        numbers["scale (-sSCALE)"] = groups["scale"]
    if groups.get("softcap") is not None:
        numbers["soft-cap (-capC)"] = groups["softcap"]
    if groups.get("window") is not None:
        numbers["window (-wW)"] = groups["window"]
    for field, text in numbers.items():
        digits = sum(ch.isdigit() for ch in text or "")
        most = 2 * MAX_ID_DIGITS if field.startswith(("scale", "soft-cap")) else MAX_ID_DIGITS  # mantissa and exponent
        if digits > most:
            raise InputError(f"case {shown(case_id)}: {field} got {shown(text, 20)} of {digits} digits, "
                             f"expected at most {most} digits")


def validate(case: Case, case_id: str | None = None) -> None:
    """Refuse a case that cannot be built or would not fit (see :data:`LIMITS`, :data:`MAX_CASE_BYTES`)."""
    name = case_id or case.id  # bounded: each number in it has at most MAX_ID_DIGITS digits
    if case.scale is not None and not 0 < case.scale <= 16:
        raise InputError(f"case {name!r}: scale={case.scale:g}, expected a value in (0, 16]")
    if case.softcap is not None and not 0 < case.softcap <= 1e4:
        raise InputError(f"case {name!r}: softcap={case.softcap:g}, expected a value in (0, 10000]")
    if case.window is not None and not 1 <= case.window <= LIMITS["Tk"]:
        raise InputError(f"case {name!r}: window={case.window}, expected between 1 and {LIMITS['Tk']}")
    sizes = {"B": case.b, "Nh": case.nh, "Nkv": case.nkv, "Tq": case.tq, "Tk": case.tk, "Dh": case.dh, "Dv": case.dv}
    for axis, value in sizes.items():
        if not 1 <= value <= LIMITS[axis]:
            raise InputError(f"case {name!r}: {axis}={value}, expected between 1 and {LIMITS[axis]}")
    if case.nh % case.nkv:
        raise InputError(f"case {name!r}: Nkv must divide Nh: Nkv={case.nkv}, Nh={case.nh}")
    rel = case.relation
    if case.right_padded and 0 in rel.valid_lengths and case.b < 2:  # type: ignore[operator]
        raise InputError(f"case {name!r}: mask 'pad-empty' needs B >= 2, got B={case.b}")
    lead = case.left_padding()[0]
    if rel.padding_side == "left" and not 1 <= lead < case.tk:
        raise InputError(f"case {name!r}: left padding {lead} must leave a key: expected 1 <= N < Tk={case.tk}")
    gap = case.gap()
    if gap is not None and not (gap[0] >= 1 and gap[1] >= 1 and gap[0] + gap[1] < case.tk):
        raise InputError(f"case {name!r}: blocked run {gap[0]}x{gap[1]} must leave keys on both sides: "
                         f"expected S >= 1, L >= 1, S + L < Tk={case.tk}")
    need = case.memory_bytes()
    if need > MAX_CASE_BYTES:
        raise InputError(f"case {name!r}: needs about {need / 2**30:.1f} GiB to check, expected at most "
                         f"{MAX_CASE_BYTES / 2**30:.0f} GiB (smaller B, Nh or lengths)")


# --- tiers ------------------------------------------------------------------------------------


_SMALL = {
    "t1": (1, 1, 1, 1, 1, 4, 4),
    "gqa": (2, 4, 2, 5, 5, 8, 8),
    "cross": (2, 4, 2, 5, 9, 8, 4),
    "mqa": (2, 6, 1, 4, 7, 8, 8),
    "square": (2, 4, 4, 4, 4, 4, 4),
    "decode": (3, 2, 2, 1, 6, 8, 8),
    "tall": (1, 3, 3, 6, 3, 4, 6),
}
_SMALL_WHY = {
    "t1": "T = 1, B = 1, one head", "gqa": "GQA, 2 query heads per kv head", "cross": "Tq < Tk and Dv != Dh",
    "mqa": "multi-query (Nkv = 1)", "square": "Nh == Tk == Dh", "decode": "decode (Tq = 1), B = 3",
    "tall": "Tq > Tk, B = 1",
}


def _small_cases() -> list[GridCase]:
    """The small cases: cheap, so the smallest failing case is usually one of them."""
    out: list[GridCase] = []

    def add(key: str, why: str, **kw: Any) -> None:
        out.append(GridCase(Case(*_SMALL[key], **kw), "default", f"small: {_SMALL_WHY[key]}; {why}"))

    for key in _SMALL:
        for mask in ("none", "causal-flag", "causal-mask", "pad", "pad-causal"):
            add(key, f"mask {mask}", mask=mask)
    for key in ("gqa", "cross", "square"):
        for mask in ("none", "causal-flag", "pad-causal"):
            add(key, f"index inputs name where a wrong value came from ({mask})", mask=mask, inputs="index")
    add("gqa", "the last example has no key: the empty-row contract", mask="pad-empty")
    for key, mask in (("gqa", "causal-flag"), ("cross", "pad-causal"), ("mqa", "none")):
        add(key, "scores past 100: an unstable softmax overflows", mask=mask, inputs="large")
    for key, mask in (("cross", "causal-flag"), ("cross", "pad-causal"), ("square", "none"), ("decode", "causal-mask")):
        add(key, "float64: the kernel's precision is judged", mask=mask, dtype="f64")
    add("gqa", "an explicit scale= that a kernel may ignore", mask="causal-flag", scale=0.125)
    add("cross", "an explicit scale= of 1", mask="pad-causal", scale=1.0)
    for dt in ("f16", "bf16"):
        for key, mask in (("cross", "causal-flag"), ("gqa", "pad-causal"), ("t1", "none")):
            add(key, f"{DTYPES[dt]}", mask=mask, dtype=dt)
        add("gqa", f"{DTYPES[dt]} with scores past 100", mask="causal-flag", inputs="large", dtype=dt)
        add("cross", f"{DTYPES[dt]} with scores past 100", mask="none", inputs="large", dtype=dt)
    return out


# Cases at real sizes in the default tier: one or two for each class of bug that small cases cannot show.
_REAL_DEFAULT = (
    ("b2-h4kv1-tq1tk1024-dh64dv64-lpad128-rand-f32",
     "decode (Tq = 1) over 1024 keys, MQA; left padding 128 and 64: the first allowed key is past a 128-key block"),
    ("b2-h4kv2-tq113tk113-dh64dv64-lpad64-causal-rand-f32",
     "prefill with left padding 64 and 32 and is_causal: whole leading key blocks blocked, empty rows for padded queries"),
    ("b1-h2kv2-tq37tk203-dh80dv80-lpad16-rand-f32",
     "left padding 16 (one 16-key block); Tq != Tk, odd lengths; Dh 80"),
    ("b2-h4kv2-tq128tk257-dh128dv128-causal-flag-rand-f32",
     "Dh 128, GQA; Tk = 257 crosses a 256-key boundary by one key; decode-style causal (Tq < Tk)"),
    ("b1-h2kv1-tq203tk217-dh40dv40-pad-causal-rand-f32", "odd lengths 203/217, Dh 40, MQA, padding with causal"),
    ("b1-h2kv2-tq64tk192-dh64dv32-gap64x64-rand-f32", "a blocked run of 64 keys in the middle (keys 64..127); Dv != Dh"),
    ("b1-h2kv2-tq64tk256-dh64dv64-none-huge-f16-s0.001",
     "float16, scale 0.001: raw q.k past 65504 while the scaled scores stay near 260 (multiply before scaling overflows)"),
    ("b1-h2kv2-tq64tk128-dh64dv64-causal-flag-edge-f16",
     "float16 at the default scale, scores a quarter past exp's overflow (11.1): an unstable softmax overflows"),
    ("b1-h2kv2-tq64tk128-dh64dv64-causal-flag-edge-bf16",
     "bfloat16 at the default scale, scores a quarter past exp's overflow (88.7)"),
    ("b2-h4kv2-tq1tk257-dh64dv64-lpad128-rand-bf16", "bfloat16 decode with left padding past a 128-key block"),
    ("b2-h4kv2-tq128tk128-dh64dv64-pad-causal-rand-f16", "float16 at a real size with padding and causal"),
    ("b1-h2kv1-tq113tk113-dh64dv64-causal-mask-rand-f64", "float64 at a real size: float32-level precision is named"),
    ("b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-f16",
     "float16, left padding 8 and 4 with is_causal: fully blocked rows (a float32 finfo.min bias is -inf here)"),
    ("b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-bf16", "bfloat16, left padding 8 and 4 with is_causal: fully blocked rows"),
)

# Axes of the full tier's pairwise cases.
_FULL_AXES: dict[str, Sequence[Any]] = {
    "lengths": ((1, 1024), (1, 203), (113, 113), (128, 128), (203, 217), (217, 203), (256, 256), (257, 257),
                (64, 1024)),
    "heads": ((1, 4, 4), (2, 8, 2), (2, 4, 1), (3, 2, 2)),
    "widths": ((64, 64), (128, 128), (80, 80), (40, 40), (64, 128)),
    "mask": ("none", "causal-flag", "causal-mask", "pad", "pad-causal", "lpad16", "lpad64", "lpad128",
             "lpad32-causal", "lpad128-causal", "gap64x64", "gap16x128-causal"),
    "dtype": ("f32", "f64", "f16", "bf16"),
    "inputs": ("rand", "large", "edge", "index"),
    "scale": (None, 0.125),
}
_FULL_COST = 1 << 26  # B * Nh * Tq * Tk * (Dh + Dv) at most: keeps one full-tier case well under a second


def _full_valid(p: Mapping[str, Any]) -> bool:
    tq, tk = p.get("lengths", (1, 1 << 20))
    rel, _ = case_relation(p.get("mask", "none"), 1, tk)
    if rel.padding_side == "left" and "lengths" in p and rel.valid_lengths[0] <= 0:  # type: ignore[index]
        return False  # lpadN with N >= Tk
    if rel.key_gap is not None and "lengths" in p and sum(rel.key_gap) >= tk:
        return False
    if p.get("inputs") == "index" and p.get("dtype") in ("f16", "bf16"):
        return False  # half precision cannot tell index-encoded values apart at real sizes
    if "lengths" in p and "heads" in p and "widths" in p:
        b, nh, _ = p["heads"]
        dh, dv = p["widths"]
        if b * nh * tq * tk * (dh + dv) > _FULL_COST:
            return False
    return True


def _features(c: Case) -> str:
    """What a real-size case exercises, as a reason."""
    parts = []
    if c.tq == 1:
        parts.append(f"decode over {c.tk} keys")
    elif c.tq != c.tk:
        parts.append(f"Tq {c.tq} != Tk {c.tk}")
    else:
        parts.append(f"T = {c.tq}")
    parts.append("MQA" if c.nkv == 1 and c.nh > 1 else ("GQA" if c.nkv < c.nh else "MHA"))
    parts.append(f"Dh {c.dh}" + (f", Dv {c.dv}" if c.dv != c.dh else ""))
    gap = c.gap()
    if c.relation.padding_side == "left":
        parts.append(f"left padding {c.left_padding()[0]}" + (" with is_causal" if c.causal_flag else ""))
    elif gap is not None:
        s, n = gap
        parts.append(f"{n} blocked keys from key {s}" + (" with is_causal" if c.causal_flag else ""))
    else:
        parts.append(f"mask {c.mask}")
    parts.append(f"{c.inputs} inputs")
    parts.append(c.dtype_name)
    if c.scale is not None:
        parts.append(f"scale {c.scale:g}")
    return "pairwise: " + ", ".join(parts)


def _full_cases() -> list[GridCase]:
    out = []
    for p in pairwise(_FULL_AXES, _full_valid):
        (tq, tk), (b, nh, nkv), (dh, dv) = p["lengths"], p["heads"], p["widths"]
        case = Case(b, nh, nkv, tq, tk, dh, dv, mask=p["mask"], inputs=p["inputs"], dtype=p["dtype"], scale=p["scale"])
        out.append(GridCase(case, "full", _features(case)))
    extra = (
        ("b2-h4kv2-tq1tk1024-dh128dv128-lpad128-rand-f16", "float16 decode, left padding 128: first allowed key past 128"),
        ("b1-h4kv4-tq128tk512-dh128dv128-none-huge-f16-s0.001", "float16, Dh 128, raw q.k past 65504, scale 0.001"),
        ("b1-h2kv1-tq64tk256-dh64dv64-causal-flag-huge-bf16-s0.001", "bfloat16 with raw q.k past 65504, scale 0.001"),
        ("b2-h4kv2-tq256tk256-dh64dv64-lpad192-causal-edge-f16",
         "float16 prefill, left padding 192 and 96 with is_causal, scores past exp's overflow"),
        ("b1-h8kv1-tq1tk2048-dh64dv64-lpad256-rand-bf16", "bfloat16 decode over 2048 keys, left padding 256"),
    )
    out += [GridCase(parse_case(i), "full", why) for i, why in extra]
    return out


def _tiers() -> tuple[GridCase, ...]:
    small = _small_cases()
    real = [GridCase(parse_case(i), "default", why) for i, why in _REAL_DEFAULT]
    return with_new(small + real, _full_cases())


GRID: tuple[GridCase, ...] = _tiers()
"""Every case of every tier, with its tier and reason (ids are stable between releases unless the changelog says)."""

DEFAULT_TIER: tuple[Case, ...] = tuple(g.case for g in GRID if g.tier == "default")
FULL_TIER: tuple[Case, ...] = tuple(g.case for g in GRID)


# Cases for the features a kernel declares: small ones that show each bug, a few at real sizes.
_FEATURE_CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "softcap": (
        ("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-cap1.5", "a soft-cap of 1.5 on scores of about 1: every row changes"),
        ("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-large-f32-cap30",
         "Gemma 2's soft-cap of 30 on scores past 100, with padding: applied before the mask"),
        ("b2-h4kv2-tq5tk5-dh8dv8-none-index-f32-cap2", "soft-cap with index inputs: where a wrong value came from"),
        ("b2-h4kv4-tq4tk4-dh4dv4-none-large-f64-cap20", "float64 with a soft-cap: the kernel's precision is judged"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-large-f16-cap30", "float16 with a soft-cap of 30 on scores past 100"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-large-bf16-cap30", "bfloat16 with a soft-cap of 30 on scores past 100"),
        ("b2-h4kv2-tq64tk128-dh64dv64-causal-flag-large-f32-cap50", "a soft-cap of 50 at a real size, decode-style causal"),
    ),
    "window": (
        ("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-w2", "a window of 2 keys (the query and the one before)"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32-w3", "a window of 3 with Tq < Tk: bottom-right aligned"),
        ("b3-h2kv2-tq1tk6-dh8dv8-causal-mask-rand-f32-w4", "decode (Tq = 1) with a window of 4 and the causal part as a mask"),
        ("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32-w4", "a window with right padding"),
        ("b2-h4kv2-tq24tk24-dh16dv16-lpad8-causal-rand-f32-w6", "a window with left padding: fully blocked rows"),
        ("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-index-f32-w2", "a window with index inputs: where a wrong value came from"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f64-w3", "float64 with a window"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f16-w3", "float16 with a window"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-bf16-w3", "bfloat16 with a window"),
        ("b2-h4kv2-tq128tk128-dh64dv64-causal-flag-rand-f32-w32", "a window of 32 at a real size"),
    ),
    "sinks": (
        ("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-sinks", "sinks: one logit per head in each row's denominator"),
        ("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32-sinks", "sinks with padding and Tq < Tk"),
        ("b3-h2kv2-tq1tk6-dh8dv8-none-rand-f32-sinks", "decode (Tq = 1) with sinks, no mask"),
        ("b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32-sinks", "sinks and a query with no key: the sink takes all the weight"),
        ("b2-h4kv2-tq5tk5-dh8dv8-none-index-f32-sinks", "sinks with index inputs"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f64-sinks", "float64 with sinks"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f16-sinks", "float16 with sinks"),
        ("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-bf16-sinks", "bfloat16 with sinks"),
        ("b2-h4kv2-tq113tk113-dh64dv64-lpad64-causal-rand-f32-sinks", "sinks at a real size with left padding"),
    ),
    "softcap+window": (
        ("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-large-f32-cap30-w4", "Gemma 2's soft-cap and a window together"),
    ),
    "window+sinks": (
        ("b2-h4kv2-tq5tk9-dh8dv4-lpad4-causal-rand-f32-w3-sinks", "gpt-oss: a window and sinks together"),
    ),
}


def feature_cases(supports: Iterable[str]) -> tuple[Case, ...]:
    """The cases that exercise the declared features (every feature of a case declared), in a stable order."""
    on = set(supports)
    out = []
    for key, entries in _FEATURE_CASES.items():
        if set(key.split("+")) <= on:
            out += [parse_case(i) for i, _ in entries]
    return tuple(out)


def feature_grid() -> tuple[GridCase, ...]:
    """The feature cases with their reasons, for ``--list-cases`` (tier ``features``)."""
    return tuple(GridCase(parse_case(i), "features", f"{key}: {why}")
                 for key, entries in _FEATURE_CASES.items() for i, why in entries)


def tier_cases(tier: str = "default") -> tuple[Case, ...]:
    """The cases of a tier: ``default``, or ``full`` (the default tier and the pairwise cases)."""
    if tier not in TIERS:
        raise InputError(f"tier: got {tier!r}, expected one of {', '.join(TIERS)}")
    return DEFAULT_TIER if tier == "default" else FULL_TIER


def grid_entry(case: Case) -> GridCase | None:
    for g in GRID:
        if g.case == case:
            return g
    return None


def select_cases(ids: Sequence[str] | None, tier: str = "default", supports: Iterable[str] = ()) -> tuple[Case, ...]:
    """The tier's cases and those of the declared features, or the named cases (each id parsed, so ids
    outside the grid work too)."""
    if not ids:
        return tier_cases(tier) + feature_cases(supports)
    return tuple(parse_case(i) for i in ids)


# --- inputs -----------------------------------------------------------------------------------


def _fill(shape: tuple[int, ...], gen: "torch.Generator", scale: float, index: bool) -> "Tensor":
    import torch

    if index:
        # Every value names its coordinates: the flat index of (b, head, t, d), spread over [-1, 1).
        n = math.prod(shape)
        return torch.arange(n, dtype=torch.float64).reshape(shape) * (2.0 / n) - 1.0
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def query_blocks(b: int, nh: int, tq: int, tk: int, budget: int = 1 << 21) -> list[slice]:
    """Slices of the query axis so that one block's ``[B, Nh, rows, Tk]`` grid holds about ``budget`` entries."""
    rows = max(1, budget // max(1, b * nh * tk))
    return [slice(i, min(i + rows, tq)) for i in range(0, tq, rows)]


def max_abs_scores(q: "Tensor", k: "Tensor", signed: bool = False) -> float:
    """Largest ``|q . k|`` (``signed``: largest ``q . k``) over every (example, head, query, key), in
    float64, a query block at a time."""
    import torch

    from attn_ledger.maths.reference import repeat_kv

    b, nh, tq, _ = q.shape
    kk = repeat_kv(k.double(), nh)  # [B, Nh, Tk, Dh]
    worst = 0.0
    for blk in query_blocks(b, nh, tq, k.shape[-2]):
        s = torch.matmul(q[:, :, blk].double(), kk.transpose(-2, -1))  # [B, Nh, rows, Tk]
        worst = max(worst, float((s if signed else s.abs()).max()))
    return worst


def _rescale(case: Case, q: "Tensor", k: "Tensor") -> tuple["Tensor", "Tensor"]:
    """``edge`` and ``huge`` inputs: q and k times one factor, chosen so the largest score hits its target."""
    raw = max_abs_scores(q, k, signed=case.inputs == "edge")  # exp overflows on the positive side
    if raw <= 0.0:
        return q, k
    if case.inputs == "edge":
        target = 1.25 * EXP_LIMIT[case.dtype_name] / case.effective_scale  # raw product whose scaled score is the target
    else:
        target = 4.0 * FLOAT16_MAX
    f = math.sqrt(target / raw)
    return q * f, k * f


def window_allow(tq: int, tk: int, window: int, device: Any = None) -> "Tensor":
    """``[Tq, Tk]`` True where key j is within the window of query i: ``i + (Tk - Tq) - j < window``
    (bottom-right positions; W keys back including the query's own; later keys are left to the causal part)."""
    import torch

    i = torch.arange(tq, device=device)[:, None] + (tk - tq)
    j = torch.arange(tk, device=device)[None, :]
    return (i - j) < window


def case_sinks(case: Case, seed: int = 0, device: Any = None) -> "Tensor | None":
    """The ``sinks`` argument ``[Nh]`` in the case's dtype (None without the feature): drawn from the case's
    own stream, about as large as its scores, so the sink's share of a row is neither 0 nor 1."""
    import torch

    from attn_ledger.seeding import generator

    if not case.sinks:
        return None
    gen = generator(case_crc(case) ^ seed ^ 0x5157)
    s = torch.randn(case.nh, generator=gen, dtype=torch.float64) + 0.5
    return s.to(device=device, dtype=torch_dtype(case.dtype_name))


def allow_argument(case: Case, device: Any = None) -> "Tensor | None":
    """The ``allow_mask`` argument the case passes (not combined with ``is_causal``)."""
    import torch

    from attn_ledger.maths import masks

    if not case.uses_mask:
        return None
    if case.right_padded:
        return masks.key_padding(masks.valid_from_lengths(case.lengths(), case.tk, device=device))  # [B, 1, 1, Tk]
    if case.relation.padding_side == "left":
        j = torch.arange(case.tk, device=device)
        lead = torch.tensor(case.left_padding(), device=device)[:, None]
        return (j[None, :] >= lead)[:, None, None, :]  # [B, 1, 1, Tk]
    gap = case.gap()
    if gap is not None:
        j = torch.arange(case.tk, device=device)
        return ((j < gap[0]) | (j >= gap[0] + gap[1]))[None, None, None, :]  # [1, 1, 1, Tk]
    return masks.causal(case.tq, case.tk, "bottom-right", device=device)  # [Tq, Tk]: the causal part as a mask


def case_inputs(case: Case | str, seed: int = 0, device: Any = None) -> tuple["Tensor", "Tensor", "Tensor", dict[str, Any]]:
    """The exact inputs of a case: ``q, k, v, kwargs`` so that ``fn(q, k, v, **kwargs)`` reproduces it.

    The values are drawn on the CPU (so every device gets the same inputs) and then moved.

    Example:
        >>> q, k, v, kw = case_inputs("b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32")
        >>> out = attention(q, k, v, **kw)
    """
    import torch

    from attn_ledger.seeding import generator

    case = parse_case(case) if isinstance(case, str) else case
    gen = generator(case_crc(case) ^ seed)  # every bit of the seed counts
    index = case.inputs == "index"
    qk_scale = _LARGE if case.inputs == "large" else 1.0
    dt = torch_dtype(case.dtype_name)
    q = _fill((case.b, case.nh, case.tq, case.dh), gen, qk_scale, index)  # [B, Nh, Tq, Dh]
    k = _fill((case.b, case.nkv, case.tk, case.dh), gen, qk_scale, index)  # [B, Nkv, Tk, Dh]
    v = _fill((case.b, case.nkv, case.tk, case.dv), gen, 1.0, index)  # [B, Nkv, Tk, Dv]
    if index:
        q = q * 0.5  # keep q and k distinguishable (both are index-encoded) while scores stay small
    if case.inputs in ("edge", "huge"):
        q, k = _rescale(case, q, k)
    q, k, v = (t.to(device=device, dtype=dt) for t in (q, k, v))
    kwargs: dict[str, Any] = {"allow_mask": allow_argument(case, device), "is_causal": case.causal_flag}
    if case.scale is not None:
        kwargs["scale"] = case.scale
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.window is not None:
        kwargs["window"] = case.window
    if case.sinks:
        kwargs["sinks"] = case_sinks(case, seed, device)
    return q, k, v, kwargs


def case_crc(case: Case) -> int:
    """A stable number per case id, mixed with the seed into the generators' seeds."""
    return zlib.crc32(case.id.encode())
