"""What a kernel says it supports, and whether it can take the protocol's arguments at all.

A :class:`Declaration` names the dtypes, mask kinds (``none``: no mask; ``causal``: the
``is_causal`` flag; ``mask``: a bool ``allow_mask``), grouped-query heads, Dv != Dh, maximum
lengths, head widths and backward a kernel supports, and the optional features it takes
(``supports``: ``softcap``, ``window``, ``sinks``; none unless declared). Cases outside it are skipped and
counted, never failed; the keyword arguments a kernel is called with follow it (a kernel
declared without ``mask`` is never passed ``allow_mask``).

It comes from three places, each overriding the one before: the defaults (everything),
``[tool.attn-ledger.check]`` in a ``pyproject.toml`` (:func:`read_table`), and the CLI's
options or the pytest helper's arguments (:func:`declaration`).

:func:`check_signature` runs before any case: by the target's signature where ``inspect``
gives one, else by one probe call on the smallest case; a target that cannot take the
arguments is a :class:`~attn_ledger.errors.SetupError` naming the missing one.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from attn_ledger.errors import AttnLedgerError, ConfigError, InputError, SetupError, did_you_mean
from attn_ledger.probes.kernel.cases import DTYPES, FEATURES, Case

MASK_KINDS = ("none", "causal", "mask")
DTYPE_NAMES = tuple(DTYPES.values())
TABLE = "tool.attn-ledger.check"
ADAPTERS = "see 'Adapters' in docs/check.md"

# Keys of [tool.attn-ledger.check] besides the declaration itself.
RUN_KEYS = ("empty_rows", "strict_precision", "strict_coverage")


@dataclass(frozen=True)
class Declaration:
    """What the kernel supports (everything unless told otherwise).

    Attributes:
        dtypes: float dtypes by name (``float32``, ``float64``, ``float16``, ``bfloat16``).
        masks: mask kinds: ``none`` (neither mask nor flag), ``causal`` (``is_causal``), ``mask`` (``allow_mask``).
        gqa: Nkv < Nh (grouped-query and multi-query heads).
        distinct_dv: Dv != Dh.
        max_tq, max_tk: the longest query and key lengths (None: no limit).
        head_dims: the head widths Dh and Dv may take (None: any).
        backward: the kernel is differentiable and its gradients are to be checked.
        supports: the optional keyword arguments it takes (``softcap``, ``window``, ``sinks``): each
            adds the cases that exercise it, and an undeclared one is never passed.
    """

    dtypes: tuple[str, ...] = DTYPE_NAMES
    masks: tuple[str, ...] = MASK_KINDS
    gqa: bool = True
    distinct_dv: bool = True
    max_tq: int | None = None
    max_tk: int | None = None
    head_dims: tuple[int, ...] | None = None
    backward: bool = True
    supports: tuple[str, ...] = ()

    def outside(self, case: Case) -> str | None:
        """Why the case is outside the declaration (a short phrase that counts cases), or None."""
        if case.dtype_name not in self.dtypes:
            return f"dtype {case.dtype_name}"
        for feature in case.features:
            if feature not in self.supports:
                return f"{feature}= (not declared)"
        kinds = case.arguments  # read from the case's relation, never from its id
        for kind, phrase in (("mask", "allow_mask"), ("causal", "is_causal"), ("none", "no mask")):
            if kind in kinds and kind not in self.masks:
                return phrase
        if case.nkv != case.nh and not self.gqa:
            return "GQA"
        if case.dv != case.dh and not self.distinct_dv:
            return "Dv != Dh"
        if self.max_tq is not None and case.tq > self.max_tq:
            return f"Tq > {self.max_tq}"
        if self.max_tk is not None and case.tk > self.max_tk:
            return f"Tk > {self.max_tk}"
        if self.head_dims is not None and (case.dh not in self.head_dims or case.dv not in self.head_dims):
            return "head width"
        return None

    def keywords(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments a case passes, less those the kernel declares it does not take."""
        kw = dict(kwargs)
        if "mask" not in self.masks and kw.get("allow_mask") is None:
            kw.pop("allow_mask", None)
        if "causal" not in self.masks and not kw.get("is_causal"):
            kw.pop("is_causal", None)
        for feature in FEATURES:
            if feature not in self.supports:
                kw.pop(feature, None)
        return kw

    def protocol_keywords(self) -> tuple[str, ...]:
        """The keyword arguments the kernel must accept under this declaration."""
        names = []
        if "mask" in self.masks:
            names.append("allow_mask")
        if "causal" in self.masks:
            names.append("is_causal")
        return (*names, "scale", *(f for f in FEATURES if f in self.supports))

    def is_default(self) -> bool:
        return self == Declaration()

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


# --- reading a declaration ------------------------------------------------------------------


def _list(value: Any, field: str, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None) -> tuple[str, ...]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise InputError(f"{field}: got {value!r}, expected a non-empty list of {', '.join(choices)}")
    out = []
    for item in items:
        name = (aliases or {}).get(item, item) if isinstance(item, str) else item
        if name not in choices:
            raise InputError(f"{field}: got {item!r}, expected one of {', '.join(choices)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def _int(value: Any, field: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"[0-9]{1,9}", value.strip()):
            value = int(value.strip())
        else:
            raise InputError(f"{field}: got {value!r}, expected a whole number >= {low}")
    if value < low or value > 1 << 30:
        raise InputError(f"{field}: got {value!r}, expected a whole number between {low} and {1 << 30}")
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{field}: got {value!r}, expected true or false")
    return value


def _widths(value: Any, field: str) -> tuple[int, ...]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise InputError(f"{field}: got {value!r}, expected a non-empty list of head widths")
    return tuple(sorted({_int(i, field) for i in items}))


_DTYPE_ALIASES = {short: long for short, long in DTYPES.items()}

_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "dtypes": lambda v, f: _list(v, f, DTYPE_NAMES, _DTYPE_ALIASES),
    "masks": lambda v, f: _list(v, f, MASK_KINDS),
    "gqa": _bool,
    "distinct_dv": _bool,
    "max_tq": _int,
    "max_tk": _int,
    "head_dims": _widths,
    "backward": _bool,
    "supports": lambda v, f: _features(v, f),
}


def _features(value: Any, field: str) -> tuple[str, ...]:
    """The declared features: a list of softcap, window, sinks (empty, or ``none``: none)."""
    if value in ("", "none", [], ()):
        return ()
    return tuple(sorted(_list(value, field, FEATURES), key=FEATURES.index))


def declaration(values: Mapping[str, Any], base: Declaration | None = None, source: str = "") -> Declaration:
    """``base`` (default: everything) with the given fields replaced; None values are left alone.

    Raises:
        InputError: an unknown field or a value of the wrong kind (one line naming it).
    """
    changes = {}
    for key, value in values.items():
        if value is None:
            continue
        field = f"{source}{key}"
        if key not in _PARSERS:
            raise InputError(f"{field}: unknown key, expected one of {', '.join([*_PARSERS, *RUN_KEYS])}"
                             + did_you_mean(key, [*_PARSERS, *RUN_KEYS]))
        changes[key] = _PARSERS[key](value, field)
    return replace(base or Declaration(), **changes)


def read_table(directory: str | Path | None = None) -> dict[str, Any]:
    """``[tool.attn-ledger.check]`` from ``pyproject.toml`` in ``directory`` (default: the current one), or ``{}``.

    Raises:
        ConfigError: the file exists but cannot be read, is not TOML, or the table is not a table.
    """
    import tomllib

    path = Path(directory or ".") / "pyproject.toml"
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"pyproject.toml: cannot read {str(path)!r}: {exc}") from None
    if len(text) > 1 << 20:
        raise ConfigError(f"pyproject.toml: {str(path)!r} is {len(text)} characters, expected at most {1 << 20}")
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ConfigError(f"pyproject.toml: malformed TOML in {str(path)!r}: {str(exc)[:200]}") from None
    table = data.get("tool", {}).get("attn-ledger", {}).get("check", {})
    if not isinstance(table, dict):
        raise ConfigError(f"pyproject.toml [{TABLE}]: expected a table, got {type(table).__name__}")
    return table


def split_table(table: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table's declaration keys and its run keys (:data:`RUN_KEYS`), apart."""
    decl = {k: v for k, v in table.items() if k not in RUN_KEYS}
    run = {k: v for k, v in table.items() if k in RUN_KEYS}
    for key in ("strict_precision", "strict_coverage"):
        if key in run:
            _bool(run[key], f"[{TABLE}] {key}")
    if "empty_rows" in run and run["empty_rows"] not in ("zeros", "nan", "finite", "any"):
        raise InputError(f"[{TABLE}] empty_rows: got {run['empty_rows']!r}, expected one of zeros, nan, finite, any")
    return decl, run


# --- can the target take the protocol's arguments? --------------------------------------------


def _missing_by_signature(fn: Callable[..., Any], names: tuple[str, ...]) -> str | None | bool:
    """The first protocol argument the signature cannot bind, None if all bind, False if there is no signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(object(), object(), object())
    except TypeError:
        return "q, k, v (three positional tensors)"
    for name in names:
        try:
            sig.bind(object(), object(), object(), **{name: None})
        except TypeError:
            return name
    return None


_ARG_RE = re.compile(r"argument '?(\w+)'?|'(\w+)' is an invalid keyword")


def missing_from_error(exc: BaseException, names: tuple[str, ...]) -> str | None:
    """The protocol argument a ``TypeError`` complains about, or None if it names none of them."""
    if not isinstance(exc, TypeError):
        return None
    text = str(exc)
    for m in _ARG_RE.finditer(text):
        name = m.group(1) or m.group(2)
        if name in names:
            return name
    for name in names:
        if f"'{name}'" in text or f" {name}" in text and "unexpected" in text:
            return name
    return None


def check_signature(fn: Callable[..., Any], decl: Declaration, target: str,
                    probe: Callable[[tuple[str, ...]], None]) -> str:
    """Make sure the target can take ``q, k, v`` and the keywords the declaration implies.

    ``probe(names)`` calls the target once on the smallest case, passing those keywords explicitly
    (``allow_mask=None, is_causal=False, scale=1/sqrt(Dh)``); it is used only where ``inspect``
    finds no signature (a builtin such as SDPA). Returns how the arguments
    were checked: ``"signature"`` or ``"probe"``.

    Raises:
        SetupError: an argument is missing; one line naming it and pointing to the adapters.
    """
    names = decl.protocol_keywords()
    missing = _missing_by_signature(fn, names)
    how = "signature"
    if missing is False:
        how = "probe"
        try:
            probe(names)
            missing = None
        except AttnLedgerError:  # the probe's own verdict (an exit, a hang, arguments refused): bad setup
            raise
        except Exception as exc:  # the user's code: only a complaint about an argument means the same
            missing = missing_from_error(exc, names)
    if missing:
        hint = ""
        if missing == "allow_mask":
            hint = " or declare the mask kinds it takes (--masks none,causal)"
        elif missing == "is_causal":
            hint = " or declare the mask kinds it takes (--masks none,mask)"
        raise SetupError(f"target: {target} does not take the kernel protocol's argument {missing!r}; "
                         f"wrap it in an adapter ({ADAPTERS}){hint}")
    return how


def from_sources(options: Mapping[str, Any], directory: str | Path | None = None,
                 source: str = "pyproject.toml") -> tuple[Declaration, dict[str, Any]]:
    """The declaration and run settings: ``[tool.attn-ledger.check]`` in ``directory``, then ``options``.

    ``options`` holds declaration fields and :data:`RUN_KEYS` as given on the command line or to
    the pytest helper; a None value leaves the table's (or the default) in force.
    """
    table = read_table(directory)
    decl_table, run = split_table(table)
    decl = declaration(decl_table, source=f"{source} [{TABLE}] ")
    decl = declaration({k: v for k, v in options.items() if k not in RUN_KEYS}, base=decl)
    for key in RUN_KEYS:
        if options.get(key) is not None:
            run[key] = options[key]
    return decl, run
