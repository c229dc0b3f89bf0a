"""Mask relations: the one parser and validator, and the relation the ledger runs with.

A relation says which (query, key) pairs may interact, in allow polarity. It is given
by name (``causal``, ``causal-top-left``, ``padding``, ``sliding-window``, ``prefix-lm``,
``segments``, ``none``, joined by ``+``) with its parameters, from a config, from CLI
options or beside saved tensors, and by saved tensors (``allow_mask``, ``key_valid``).
Every one of those paths holds a :class:`RelationSpec`: its text is read once, by
:func:`parse`, its parameters are checked against the sizes once, by :func:`bind`, and
saved tensors by :func:`check_saved`, so each input is validated once, the same way, with
one line naming the field, the value and what was expected. Nothing here imports torch
at module level.

:func:`build` turns a validated :class:`RelationSpec` (and any saved tensors) into a
:class:`Relation`, which produces the allow tensor one block of query rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from attn_ledger.errors import InputError, did_you_mean, field_error

if TYPE_CHECKING:
    from torch import Tensor

RELATIONS = ("none", "causal", "causal-top-left", "padding", "sliding-window", "prefix-lm", "segments")
# Relations that can be named beside saved tensors: padding and segments come as key_valid / allow_mask there.
TENSOR_RELATIONS = ("none", "causal", "causal-top-left", "sliding-window", "prefix-lm")
# A kernel case's blocked run of keys (``gapSxL``): a relation of the case vocabulary only, never named by run.
KEY_GAP = "key-gap"
PADDING_SIDES = ("right", "left")
# Relations that let a query use no key past its own position (bottom-right alignment for causal and the window).
_CAUSAL_NAMES = ("causal", "causal-top-left", "sliding-window")


@dataclass(frozen=True)
class RelationSpec:
    """A relation as named, with the parameters its names use: validated, no tensors yet.

    The one value every input path holds: a config's ``mask``, run's options, the names given
    beside saved tensors, a kernel case's mask token and the module check's declaration.
    ``str(spec)`` is its canonical text (``"causal+padding"``, ``"none"``), which :func:`parse`
    reads back into the same names.

    Attributes:
        names: the named relations (the kinds), combined by AND, in the order given (``none`` dropped).
        valid_lengths: real keys per example (``padding``), padded on ``padding_side``.
        window: keys up to and including the query's own position (``sliding-window``).
        prefix_len: keys every query sees (``prefix-lm``).
        segment_lengths: consecutive positions per segment (``segments``).
        key_gap: ``(start, length)`` of keys blocked for every query (:data:`KEY_GAP`, kernel cases only).
    """

    names: tuple[str, ...] = ()
    valid_lengths: tuple[int, ...] | None = None
    padding_side: str = "right"
    window: int | None = None
    prefix_len: int | None = None
    segment_lengths: tuple[int, ...] | None = None
    key_gap: tuple[int, int] | None = None

    def __str__(self) -> str:
        return "+".join(self.names) or "none"

    @property
    def alignment(self) -> str | None:
        """How the causal part is aligned when Tq != Tk: ``bottom-right``, ``top-left``, or None (no causal part)."""
        if "causal-top-left" in self.names:
            return "top-left"
        return "bottom-right" if "causal" in self.names else None

    @property
    def causal(self) -> bool:
        """No query uses a key past its own position (a causal part or a sliding window)."""
        return any(n in _CAUSAL_NAMES for n in self.names)

    def exact_causal(self, tq: int, tk: int) -> bool:
        """Exactly "key j <= query i" for every batch and head: one causal part, top-left, or bottom-right with Tq == Tk."""
        return list(self.names) in (["causal-top-left"], *([["causal"]] if tq == tk else []))

    def masked(self, tq: int, tk: int) -> bool:
        """Some named part blocks keys in a way the causal shortcut does not cover."""
        return bool(self.names) and not self.exact_causal(tq, tk)


NO_RELATION = RelationSpec()
CAUSAL = RelationSpec(("causal",))


def parse(mask: str | None, allowed: tuple[str, ...] = RELATIONS) -> RelationSpec:
    """The one parser of relation text: names from ``allowed`` joined by ``+`` (empty or None: ``none``).

    Every path that reads a relation as text comes here once, so ``run --mask causal`` parses
    its mask once (tests/test_relation_spec.py counts it). The parameters the names use are
    checked against the sizes by :func:`bind`.

    Raises:
        InputError: one line naming the field (``mask``), the value and what was expected.
    """
    names = [part.strip() for part in (mask or "none").split("+")]
    for name in names:
        if name not in allowed:
            raise InputError(f"mask: got {mask!r}, expected relations from {', '.join(allowed)} joined by '+'"
                             + did_you_mean(name, allowed))
    if "none" in names and len(names) > 1:
        raise InputError(f"mask: got {mask!r}, expected 'none' alone")
    if "causal" in names and "causal-top-left" in names:
        raise InputError(f"mask: got {mask!r}, expected one causal alignment, not both")
    if len(set(names)) != len(names):
        raise InputError(f"mask: got {mask!r}, expected each relation once")
    return RelationSpec(names=tuple(n for n in names if n != "none"))


def held(mask: "str | RelationSpec | None", allowed: tuple[str, ...] = RELATIONS) -> RelationSpec:
    """``mask`` as a :class:`RelationSpec`: text is parsed (once, here); a spec is held to ``allowed`` as it is."""
    if not isinstance(mask, RelationSpec):
        return parse(mask, allowed)
    for name in mask.names:
        if name not in allowed:
            raise InputError(f"mask: got {str(mask)!r}, expected relations from {', '.join(allowed)} joined by '+'"
                             + did_you_mean(name, allowed))
    return mask


def bind(
    spec: RelationSpec,
    *,
    tq: int,
    tk: int,
    batch_size: int | None = None,
    valid_lengths: Sequence[int] | None = None,
    padding_side: str | None = None,
    window: int | None = None,
    prefix_len: int | None = None,
    segment_lengths: Sequence[int] | None = None,
) -> RelationSpec:
    """``spec`` with the parameters its names use, each checked against the sizes.

    A parameter left None keeps the one ``spec`` holds already.

    Args:
        tq, tk: query and key positions; batch_size: B, which ``valid_lengths`` must match.

    Raises:
        InputError: one line naming the field, the value and what was expected.
    """
    names = list(spec.names)
    valid_lengths = spec.valid_lengths if valid_lengths is None else valid_lengths
    padding_side = spec.padding_side if padding_side is None else padding_side
    window = spec.window if window is None else window
    prefix_len = spec.prefix_len if prefix_len is None else prefix_len
    segment_lengths = spec.segment_lengths if segment_lengths is None else segment_lengths
    _check_padding(names, tk, batch_size, valid_lengths, padding_side)
    if "sliding-window" in names:
        if window is None:
            raise InputError("window: got none, expected a window length for mask 'sliding-window'")
        if window < 1:
            raise InputError(f"window: got {window!r}, expected a positive window length for mask 'sliding-window'")
    if "prefix-lm" in names:
        if prefix_len is None:
            raise InputError("prefix_len: got none, expected a prefix length for mask 'prefix-lm'")
        if prefix_len < 0:
            raise InputError(f"prefix_len: got {prefix_len!r}, expected a prefix length of 0 or more for mask 'prefix-lm'")
    if "segments" in names:
        if tq != tk:
            raise InputError(f"mask: 'segments' needs self-attention, got query_len={tq}, key_len={tk}")
        if not segment_lengths or sum(segment_lengths) != tk or min(segment_lengths) < 1:
            raise InputError(f"segment_lengths: got {_listed(segment_lengths)}, expected positive lengths summing to seq_len={tk}")
    return replace(
        spec,
        valid_lengths=None if valid_lengths is None else tuple(valid_lengths),
        padding_side=padding_side,
        window=window,
        prefix_len=prefix_len,
        segment_lengths=None if segment_lengths is None else tuple(segment_lengths),
    )


def resolve(mask: "str | RelationSpec | None", *, tq: int, tk: int, allowed: tuple[str, ...] = RELATIONS,
            **params: Any) -> RelationSpec:
    """:func:`held` then :func:`bind`: the relation ``mask`` names with its parameters (``params``: :func:`bind`'s)."""
    return bind(held(mask, allowed), tq=tq, tk=tk, **params)


def module_relation(causal: bool = True, window: int | None = None) -> RelationSpec:
    """The relation the module check declares: causal (bottom-right), a sliding window, or none.

    Raises:
        InputError: ``window`` is not an integer >= 1, or is given without ``causal``.
    """
    if window is None:
        return CAUSAL if causal else NO_RELATION
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise field_error("window", window, "an integer >= 1")
    if not causal:
        raise field_error("window", window, "a causal module (a sliding window is causal)")
    return RelationSpec(("sliding-window",), window=window)


def _check_padding(names: list[str], tk: int, batch_size: int | None, valid_lengths: Sequence[int] | None,
                   padding_side: str) -> None:
    if padding_side not in PADDING_SIDES:
        raise InputError(f"padding_side: got {padding_side!r}, expected one of {', '.join(PADDING_SIDES)}")
    if "padding" in names and valid_lengths is None:
        raise InputError("valid_lengths: got none, expected one key length per example for mask 'padding'")
    if valid_lengths is None:
        return
    if batch_size is not None and len(valid_lengths) != batch_size:
        raise InputError(f"valid_lengths: got {len(valid_lengths)} lengths {_listed(valid_lengths)}, "
                         f"expected batch_size={batch_size}")
    bad = [n for n in valid_lengths if not 0 <= n <= tk]
    if bad:
        raise InputError(f"valid_lengths: got {bad[0]}, expected a key count between 0 and key_len={tk}")


def _listed(values: Sequence[int] | None) -> Any:
    return None if values is None else list(values)


def check_saved(allow_mask: "Tensor | None", key_valid: "Tensor | None", b: int, nh: int, tq: int, tk: int) -> None:
    """Validate saved relation tensors: bool, and shaped by named axes.

    ``allow_mask``: ``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, Nh, Tq, Tk]``; ``key_valid``: ``[B, Tk]``.
    """
    import torch

    from attn_ledger.maths import masks
    from attn_ledger.tolerance import dtype_name

    for name, t in (("allow_mask", allow_mask), ("key_valid", key_valid)):
        if t is not None and t.dtype != torch.bool:
            raise InputError(f"{name}: got dtype {dtype_name(t.dtype)}, expected bool (True = may attend / real key)")
    if allow_mask is not None:
        masks.expand_to_grid(allow_mask, b, nh, tq, tk)  # validates the named axes
    if key_valid is not None and tuple(key_valid.shape) != (b, tk):
        raise InputError(f"key_valid: got shape {list(key_valid.shape)}, expected [B, Tk]={[b, tk]}")


# --- the relation the ledger runs with ------------------------------------------------

Part = Callable[[int, int], "Tensor"]  # (q0, q1) -> bool [B|1, Nh|1, q1-q0, Tk]


@dataclass(frozen=True)
class Relation:
    """The intended allow relation, produced one block of query rows at a time.

    ``parts`` are functions ``(q0, q1) -> bool [B|1, Nh|1, q1-q0, Tk]`` combined by AND.
    ``top_left_causal``: known by construction to be exactly "key j <= query i" for every
    batch and head (one causal part, top-left, or bottom-right with Tq == Tk).
    """

    name: str
    parts: tuple[Part, ...] = ()
    top_left_causal: bool = False

    def block(self, q0: int, q1: int) -> "Tensor | None":
        allow = None
        for part in self.parts:
            a = part(q0, q1)
            allow = a if allow is None else (allow & a)
        return allow


def build(spec: RelationSpec, b: int, nh: int, tq: int, tk: int, device: Any = None,
          allow_mask: "Tensor | None" = None, key_valid: "Tensor | None" = None) -> Relation:
    """The relation ``spec`` names, ANDed with saved ``allow_mask`` / ``key_valid`` (validated by :func:`check_saved`)."""
    parts: list[Part] = []
    names: list[str] = []
    for part, name in _saved_parts(allow_mask, key_valid, b, nh, tq, tk):
        parts.append(part)
        names.append(name)
    for name in spec.names:
        part, label = _named_part(spec, name, tq, tk, device)
        parts.append(part)
        names.append(label)
    exact_causal = allow_mask is None and key_valid is None and spec.exact_causal(tq, tk)  # an empty relation is not causal
    return Relation(" + ".join(names) or "none", tuple(parts), top_left_causal=exact_causal)


def _saved_parts(allow_mask: "Tensor | None", key_valid: "Tensor | None", b: int, nh: int, tq: int,
                 tk: int) -> list[tuple[Part, str]]:
    from attn_ledger.maths import masks

    found: list[tuple[Part, str]] = []
    if allow_mask is not None:
        grid = masks.expand_to_grid(allow_mask, b, nh, tq, tk)  # [B|1, Nh|1, Tq, Tk]
        found.append((lambda q0, q1, g=grid: g[:, :, q0:q1], f"allow_mask {list(allow_mask.shape)}"))
    if key_valid is not None:
        padded = masks.key_padding(key_valid)  # [B, 1, 1, Tk]
        found.append((lambda q0, q1, p=padded: p, "key_valid [B, Tk]"))
    return found


def _named_part(spec: RelationSpec, name: str, tq: int, tk: int, device: Any) -> tuple[Part, str]:
    """One named relation as a block function and its label."""
    import torch

    from attn_ledger.maths import masks

    if name == "causal":
        return (lambda q0, q1: masks.causal(tq, tk, "bottom-right", q0, q1, device)[None, None],
                "causal (bottom-right)" if tq != tk else "causal")
    if name == "causal-top-left":
        return lambda q0, q1: masks.causal(tq, tk, "top-left", q0, q1, device)[None, None], "causal (top-left)"
    if name == "padding":
        lengths = list(spec.valid_lengths or ())
        valid = masks.valid_from_lengths(lengths, tk, spec.padding_side, device)  # [B, Tk]
        padded = masks.key_padding(valid)  # [B, 1, 1, Tk]
        return lambda q0, q1, p=padded: p, f"key padding ({spec.padding_side}) lengths {lengths}"
    if name == "sliding-window":
        w = int(spec.window or 1)
        return lambda q0, q1: masks.sliding_window(tq, tk, w, q0, q1, device)[None, None], f"sliding window {w}"
    if name == "prefix-lm":
        p = int(spec.prefix_len or 0)
        return lambda q0, q1: masks.prefix_lm(tq, tk, p, q0, q1, device)[None, None], f"prefix-LM prefix {p}"
    if name == "segments":
        lengths = list(spec.segment_lengths or ())
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)[None]  # [1, T]
        seg = masks.segments(ids, ids)  # [1, 1, Tq, Tk]
        return lambda q0, q1, s=seg: s[:, :, q0:q1], f"segments {lengths}"
    raise InputError(f"mask: got {name!r}, expected relations from {', '.join(RELATIONS)} joined by '+'")


# --- what a reader is shown -------------------------------------------------------------

def varies(relation: Relation, tq: int) -> bool:
    """Whether the relation differs between examples or heads (small grids only: it builds the whole relation)."""
    allow = relation.block(0, tq)  # [B|1, Nh|1, Tq, Tk]
    if allow is None:
        return False
    flat = allow.reshape(-1, *allow.shape[2:])  # [B*Nh or fewer, Tq, Tk]
    return bool((flat != flat[:1]).any())


def view(relation: Relation, tq: int, example: int = 0, head: int = 0) -> tuple["Tensor | None", int, int]:
    """The relation ``[Tq, Tk]`` of one example and head (None without a relation), with that example
    and the head it stands for (head 0 when the relation is the same for every head)."""
    allow = relation.block(0, tq)  # [B|1, Nh|1, Tq, Tk]
    if allow is None or allow.shape[0] == 0:  # no relation, or an empty batch: no example to show
        return None, example, 0
    h = min(head, allow.shape[1] - 1) if allow.shape[1] > 1 else 0
    return allow[min(example, allow.shape[0] - 1), h].expand(tq, allow.shape[-1]), example, h


def alignment_of(allow_mask: "Tensor", b: int, nh: int, tq: int, tk: int) -> str:
    """Whether a saved mask is the causal relation aligned ``bottom-right``, ``top-left``, or ``neither``."""
    from attn_ledger.maths import masks

    grid = masks.expand_to_grid(allow_mask, b, nh, tq, tk)
    br = masks.causal(tq, tk, "bottom-right", device=allow_mask.device)
    tl = masks.causal(tq, tk, "top-left", device=allow_mask.device)
    if bool((grid == br).all()):
        return "bottom-right"
    if bool((grid == tl).all()):
        return "top-left"
    return "neither"
