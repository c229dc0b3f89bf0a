"""Run configuration: a TOML/JSON file or keyword arguments, validated once, up front.

Unknown keys, wrong types and inconsistent sizes are rejected here with one line that
names the field, the value and what was expected. Nothing downstream re-validates.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from attn_ledger.maths import relations as mask_relations
from attn_ledger.errors import ConfigError, InputError, clip, did_you_mean, shown, shown_path
from attn_ledger.inputs.sinks import parse_sinks
from attn_ledger.inputs.limits import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_INT_DIGITS, MAX_MASK_CHARS, MAX_MASK_PARTS, MAX_POSITION, SEED_MAX

if TYPE_CHECKING:
    from attn_ledger.maths.rotary import RotarySpec

FAULTS = (
    "split-reshape",
    "merge-reshape",
    "k-transpose",
    "softmax-axis",
    "no-scale",
    "mask-polarity",
    "mask-after-softmax",
)

# Faults in the backward stages (need grad), in rotary positions (need rope), and faults
# that each break one boundary property of the ``properties`` row.
GRAD_FAULTS = ("softmax-backward-no-rowsum", "grad-k-no-scale", "grad-values-untransposed")
ROPE_FAULTS = ("rope-on-v", "rope-query-offset", "rope-q-only")
PROPERTY_FAULTS = ("softmax-plus-one", "scores-key-bias", "context-rows-shifted", "values-batch-mix",
                   "softmax-global-max")
CAP_FAULTS = ("softcap-after-mask",)  # faults in the soft-cap (need softcap)
SINK_FAULTS = ("sink-dropped", "sink-in-numerator")  # faults in the attention sinks (need sinks)
SINK_GRAD_FAULTS = ("grad-sinks-no-share",)  # faults in the sinks' gradient (need sinks and grad)
WINDOW_FAULTS = ("window-too-wide",)  # faults in the sliding window (need mask sliding-window)
ALL_FAULTS = (FAULTS + GRAD_FAULTS + ROPE_FAULTS + PROPERTY_FAULTS + CAP_FAULTS + SINK_FAULTS + SINK_GRAD_FAULTS
              + WINDOW_FAULTS)
GRAD_OUTPUTS = ("ones", "identity")  # or a tensor file
# what a fault needs to have its stage: the backward (grad) or rotary positions (rope)
FAULT_NEEDS: dict[str, dict[str, Any]] = {**{f: {"grad": True} for f in GRAD_FAULTS},
                                          **{f: {"rope": "half"} for f in ROPE_FAULTS},
                                          **{f: {"softcap": 50.0} for f in CAP_FAULTS},
                                          **{f: {"sinks": "0.5,-1,2"} for f in SINK_FAULTS},
                                          **{f: {"sinks": "0.5,-1,2", "grad": True} for f in SINK_GRAD_FAULTS},
                                          **{f: {"mask": "sliding-window", "window": 3} for f in WINDOW_FAULTS}}

MASK_RELATIONS = mask_relations.RELATIONS

DTYPES = ("float32", "float64", "float16", "bfloat16")


class Fault(str, Enum):
    """Deliberate failures that can be injected into the built-in pipeline."""

    split_reshape = "split-reshape"
    merge_reshape = "merge-reshape"
    k_transpose = "k-transpose"
    softmax_axis = "softmax-axis"
    no_scale = "no-scale"
    mask_polarity = "mask-polarity"
    mask_after_softmax = "mask-after-softmax"
    softmax_backward_no_rowsum = "softmax-backward-no-rowsum"
    grad_k_no_scale = "grad-k-no-scale"
    grad_values_untransposed = "grad-values-untransposed"
    rope_on_v = "rope-on-v"
    rope_query_offset = "rope-query-offset"
    rope_q_only = "rope-q-only"
    softmax_plus_one = "softmax-plus-one"
    scores_key_bias = "scores-key-bias"
    context_rows_shifted = "context-rows-shifted"
    values_batch_mix = "values-batch-mix"
    softmax_global_max = "softmax-global-max"
    softcap_after_mask = "softcap-after-mask"
    sink_dropped = "sink-dropped"
    sink_in_numerator = "sink-in-numerator"
    grad_sinks_no_share = "grad-sinks-no-share"
    window_too_wide = "window-too-wide"


# keys that only a relation of the mask uses
KEY_NEEDS = {"valid_lengths": "padding", "padding_side": "padding", "window": "sliding-window",
             "prefix_len": "prefix-lm", "segment_lengths": "segments"}


class UnusedKey(ValueError):
    """A config key or option given for a relation the mask does not include."""

    def __init__(self, key: str, value: Any, relation: str, mask: str) -> None:
        super().__init__(f"{key}: got {shown(value)}, expected it only with a mask that includes {relation!r} "
                         f"(the mask is {shown(mask)})")
        self.key, self.value, self.relation, self.mask = key, value, relation, mask

    def named(self, name: str) -> str:
        return (f"{name}: got {shown(self.value)}, expected it only with a mask that includes {self.relation!r} "
                f"(the mask is {shown(self.mask)})")


class RunConfig(BaseModel):
    """One ledger run on the built-in multi-head attention.

    ``seq_len`` sets both lengths for self-attention; ``query_len``/``key_len`` set them
    apart for cross-attention. ``mask`` is one relation name or several joined by ``+``
    (all in allow polarity): ``none``, ``causal`` (bottom-right aligned), ``causal-top-left``,
    ``padding`` (needs ``valid_lengths``), ``sliding-window`` (needs ``window``),
    ``prefix-lm`` (needs ``prefix_len``), ``segments`` (needs ``segment_lengths``).
    The text is parsed once, as the config is made: ``mask`` holds the
    :class:`~attn_ledger.maths.relations.RelationSpec` (``str(config.mask)`` gives the text back) and
    ``relation`` the same relation with its parameters, checked against the sizes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=True)

    # Strict types: a bool, a float or a string is not an integer. Sizes have no cap of their own:
    # every size is the side of some tensor, so one memory estimate bounds them all (limits.py).
    batch_size: int = Field(2, ge=0, strict=True)
    seq_len: Optional[int] = Field(None, ge=1, strict=True)
    query_len: Optional[int] = Field(None, ge=1, strict=True)
    key_len: Optional[int] = Field(None, ge=1, strict=True)
    embed_dim: int = Field(12, ge=1, strict=True)
    num_heads: int = Field(3, ge=1, strict=True)
    num_kv_heads: Optional[int] = Field(None, ge=1, strict=True)
    value_dim: Optional[int] = Field(None, ge=1, strict=True, description="Dv, the per-head value width (default Dh)")
    mask: InstanceOf[mask_relations.RelationSpec] = Field(mask_relations.CAUSAL,
                                                         description="relation names joined by '+'")
    valid_lengths: Optional[list[Annotated[int, Field(strict=True)]]] = None
    padding_side: Literal["right", "left"] = "right"
    window: Optional[int] = Field(None, ge=1, le=MAX_POSITION, strict=True)
    prefix_len: Optional[int] = Field(None, ge=0, le=MAX_POSITION, strict=True)
    segment_lengths: Optional[list[Annotated[int, Field(strict=True)]]] = None
    empty_rows: Literal["error", "zeros"] = "error"
    dtype: Literal["float32", "float64", "float16", "bfloat16"] = "float32"
    seed: int = Field(0, ge=0, le=SEED_MAX, strict=True)
    input: Literal["random", "arange"] = "random"
    fault: Optional[Fault] = None
    device: str = Field("cpu", max_length=32, strict=True)
    block_size: Optional[int] = Field(None, ge=1, le=MAX_POSITION, strict=True)
    keep_grids: bool = Field(False, strict=True)

    # the relation ``mask`` names, with the parameters its names use: set once, when the config is made
    _relation: mask_relations.RelationSpec = PrivateAttr(mask_relations.CAUSAL)
    _sinks: Optional[tuple] = PrivateAttr(None)

    @field_validator("mask", mode="before")
    @classmethod
    def _parse_mask(cls, mask: Any) -> Any:
        """Text becomes a :class:`~attn_ledger.maths.relations.RelationSpec` here, parsed once; a spec stays as it is."""
        if isinstance(mask, mask_relations.RelationSpec):
            return mask
        if not isinstance(mask, str):
            raise PydanticCustomError("string_type", "Input should be a valid string")
        if len(mask) > MAX_MASK_CHARS:
            raise PydanticCustomError("string_too_long", "String should have at most {max_length} characters",
                                      {"max_length": MAX_MASK_CHARS})
        parts = mask.count("+") + 1
        if parts > MAX_MASK_PARTS:
            raise ValueError(f"mask: got {parts} relations joined by '+', expected at most {MAX_MASK_PARTS}")
        try:
            return mask_relations.parse(mask)
        except InputError as exc:
            raise ValueError(str(exc)) from None
    grad: bool = Field(False, strict=True)
    grad_output: Optional[str] = Field(None, max_length=4096, description="ones, identity or a tensor file (with grad)")
    replay: bool = Field(False, strict=True)
    scale: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="S (default 1/sqrt(Dh))")
    temperature: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="tau: the scale is S/tau")
    softcap: Optional[float] = Field(None, gt=0, allow_inf_nan=False,
                                     description="C: the scaled scores become C*tanh(s/C) before the mask")
    rope: Optional[Any] = Field(None, description="rotary positions: PAIRING[,base=B][,dim=D], or a table")
    sinks: Optional[Any] = Field(None, description="attention sinks: a logit for every head, Nh logits, or a tensor file")

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.seq_len is not None and (self.query_len is not None or self.key_len is not None):
            raise ValueError(
                f"seq_len: got {self.seq_len} together with query_len={self.query_len}, key_len={self.key_len}, "
                "expected seq_len alone (self-attention) or query_len and key_len (cross-attention)"
            )
        if (self.query_len is None) != (self.key_len is None):
            raise ValueError(
                f"query_len/key_len: got query_len={self.query_len}, key_len={self.key_len}, expected both or neither"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads: embed_dim={self.embed_dim}, num_heads={self.num_heads}"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads: num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}"
            )
        try:
            self._relation = mask_relations.bind(
                self.mask, tq=self.tq, tk=self.tk, batch_size=self.batch_size, valid_lengths=self.valid_lengths,
                padding_side=self.padding_side, window=self.window, prefix_len=self.prefix_len,
                segment_lengths=self.segment_lengths)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if self.device not in ("cpu", "cuda", "mps", "auto") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: got {self.device!r}, expected cpu, cuda, mps or auto")
        self._backward_and_positions()
        try:
            self._sinks = parse_sinks(self.sinks, self.num_heads)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if self.fault in SINK_FAULTS + SINK_GRAD_FAULTS and self._sinks is None:
            raise ValueError(f"fault: got {self.fault!r}, a fault in the attention sinks, expected it only with sinks "
                             "(--sinks)")
        if self.fault in WINDOW_FAULTS and "sliding-window" not in self.relations:
            raise ValueError(f"fault: got {self.fault!r}, a fault in the sliding window, expected it only with mask "
                             "'sliding-window'")
        return self

    @property
    def sink_logits(self) -> Optional[tuple]:
        """The attention sinks, one finite logit per query head, or None."""
        return self._sinks

    @model_validator(mode="after")
    def _used(self) -> "RunConfig":
        """A key the chosen mask does not use is refused, not silently ignored; positions stay inside Tk."""
        relations = self.relations
        given = self.model_fields_set
        for key, relation in KEY_NEEDS.items():
            value = getattr(self, key)
            if relation not in relations and key in given and value is not None:
                raise UnusedKey(key, value, relation, str(self.mask))
        for key in ("window", "prefix_len"):
            value = getattr(self, key)
            if value is not None and value > self.tk:
                raise ValueError(f"{key}: got {value}, expected at most key_len={self.tk}")
        return self

    def _backward_and_positions(self) -> None:
        """grad_output only with grad; a fault only where its stage runs; rope fits the heads; identity fits Tq."""
        if self.grad_output is not None and not self.grad:
            raise ValueError(f"grad_output: got {self.grad_output!r}, expected it only with grad (--grad)")
        if self.fault in GRAD_FAULTS + SINK_GRAD_FAULTS and not self.grad:
            raise ValueError(f"fault: got {self.fault!r}, a fault in a backward stage, expected it only with grad (--grad)")
        if self.fault in CAP_FAULTS and self.softcap is None:
            raise ValueError(f"fault: got {self.fault!r}, a fault in the soft-cap, expected it only with softcap "
                             "(--softcap)")
        if self.fault in ROPE_FAULTS and self.rope is None:
            raise ValueError(f"fault: got {self.fault!r}, a fault in rotary positions, expected it only with rope (--rope)")
        if self.rope is not None:
            try:
                self.rope_spec.width(self.dh)  # type: ignore[union-attr]
            except InputError as exc:
                raise ValueError(str(exc)) from None
        if self.grad_output == "identity" and (self.tq != self.dv or self.embed_dim != self.num_heads * self.dv):
            raise ValueError(f"grad_output: got 'identity' (O-bar = I on each head's [Tq, Dv] block of the output), "
                             f"expected Tq == Dv and E == Nh*Dv; got Tq={self.tq}, Dv={self.dv}, E={self.embed_dim}, "
                             f"Nh={self.num_heads}")

    @property
    def rope_spec(self) -> "RotarySpec | None":
        """The rotary spec the ``rope`` key names, or None."""
        from attn_ledger.maths.rotary import parse_spec

        return None if self.rope is None else parse_spec(self.rope)

    @property
    def effective_scale(self) -> float:
        """S / tau: the score scale the pipeline and every reference use."""
        return (1.0 / math.sqrt(self.dh) if self.scale is None else self.scale) / (self.temperature or 1.0)

    @property
    def relation(self) -> mask_relations.RelationSpec:
        """The relation the mask names, with its parameters (validated against the sizes when the config was made)."""
        return self._relation

    @property
    def relations(self) -> list[str]:
        """The mask's relation names (``["none"]`` for no relation)."""
        return list(self.mask.names) or ["none"]

    @property
    def tq(self) -> int:
        return self.seq_len if self.seq_len is not None else (self.query_len if self.query_len is not None else 5)

    @property
    def tk(self) -> int:
        return self.seq_len if self.seq_len is not None else (self.key_len if self.key_len is not None else 5)

    @property
    def nkv(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dh(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def dv(self) -> int:
        return self.value_dim or self.dh


DEFAULT_CONFIG: dict[str, Any] = {
    "batch_size": 2,
    "seq_len": 5,
    "embed_dim": 12,
    "num_heads": 3,
    "mask": "causal",
    "seed": 0,
    "input": "random",
    "dtype": "float32",
}


def _describe(err: dict[str, Any], names: Mapping[str, str]) -> str:
    """One line for pydantic's first error, naming the key as the user gave it (``names``: key -> option)."""
    key = ".".join(str(p) for p in err.get("loc", ())) or "config"
    loc = names.get(key, key)
    kind = err.get("type", "")
    value = err.get("input")
    if kind == "extra_forbidden":
        known = ", ".join(RunConfig.model_fields)
        return (f"unknown config key {shown(key)} (value {shown(value)}), expected one of: {known}"
                + did_you_mean(key, RunConfig.model_fields))
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnusedKey):
        return cause.named(names.get(cause.key, cause.key))
    msg = err.get("msg", "invalid")
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if isinstance(value, dict):
        return f"{loc}: {msg}"
    ctx = err.get("ctx") or {}
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "string_too_long": ("a string of at most {} characters", "max_length")}
    if kind in bounds:
        words, field = bounds[kind]
        bound = ctx.get(field)
        expected = words.format(bound) if "{}" in words else f"{words} {bound}"
    else:
        expected = msg.removeprefix("Input should be ").removeprefix("input should be ") or "a valid value"
    return f"{loc}: got {shown(value)}, expected {expected}" + did_you_mean(value, _literal_choices(key))


def _literal_choices(key: str) -> tuple[str, ...]:
    """The values a ``Literal`` field of :class:`RunConfig` takes (``()`` for any other field)."""
    from typing import get_args, get_origin

    field = RunConfig.model_fields.get(key)
    if field is None:
        return ()
    kinds = [field.annotation, *get_args(field.annotation)]
    return tuple(v for t in kinds if get_origin(t) is Literal for v in get_args(t) if isinstance(v, str))


def make_config(values: dict[str, Any], source: str = "config", names: Mapping[str, str] | None = None) -> RunConfig:
    """Validate a dict of settings into a :class:`RunConfig`.

    Args:
        names: how the user spelled a key (``{"valid_lengths": "--valid-lengths"}`` for a CLI
            option), used in the message.

    Raises:
        ConfigError: one line naming the field, the value and what was expected.
    """
    try:
        return RunConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        prefix = "" if source == "config" else f"{source}: "
        raise ConfigError(prefix + _describe(first, names or {})) from None
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


class _LongInteger(Exception):
    """An integer literal longer than MAX_INT_DIGITS, met while parsing."""


def _bounded_int(text: str) -> int:
    """JSON's integers, refused beyond MAX_INT_DIGITS digits before Python converts them."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongInteger(len(text.lstrip("-")))
    return int(text)


def nesting_depth(text: str, limit: int = MAX_CONFIG_DEPTH) -> int:
    """How deep ``[``/``{`` nest outside strings and comments; counting stops once past ``limit``.

    Read before parsing, so a file nested thousands deep is refused without recursing into it.
    Quotes toggle a string (a backslash escapes inside double quotes); ``#`` starts a TOML
    comment outside strings.
    """
    depth = deepest = 0
    quote = ""
    escaped = comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a plain dict (not yet validated).

    Bounded: at most MAX_CONFIG_BYTES, nesting at most MAX_CONFIG_DEPTH deep, integers of at
    most MAX_INT_DIGITS digits; beyond any of these it is one line, exit 2.
    """
    from attn_ledger.inputs.paths import input_file

    p = input_file(path, "config", ConfigError)
    name = shown_path(p)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(f"config: unsupported file type {shown(suffix or '(none)')} for {name}, expected .toml or .json")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {name} holds {size} bytes, expected at most {MAX_CONFIG_BYTES}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config: {name} is not UTF-8 text (byte {exc.start}), expected a .toml or .json file") from None
    except OSError as exc:
        raise ConfigError(f"config: cannot read {name}: {exc.strerror or exc}") from None
    depth = nesting_depth(text)
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"config: {name} nests lists or tables more than {MAX_CONFIG_DEPTH} deep, "
                          f"expected at most {MAX_CONFIG_DEPTH} levels")
    try:
        if suffix == ".json":
            try:
                data = json.loads(text, parse_int=_bounded_int)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config: malformed JSON in {name}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
            except _LongInteger as exc:
                raise ConfigError(f"config: {name} holds an integer of {exc.args[0]} digits, "
                                  f"expected at most {MAX_INT_DIGITS} digits") from None
        else:
            import tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config: malformed TOML in {name}: {clip(str(exc))}") from None
            except ValueError as exc:  # an integer past Python's conversion limit
                raise ConfigError(f"config: {name} holds a value TOML cannot convert ({clip(str(exc))}), "
                                  f"expected integers of at most {MAX_INT_DIGITS} digits") from None
    except RecursionError:  # the scan above bounds nesting; this only guards against what it cannot see
        raise ConfigError(f"config: {name} nests too deeply to parse, expected at most {MAX_CONFIG_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {name} holds a {type(data).__name__}, expected a table of keys")
    _check_parsed(data, name)
    return data


def _check_parsed(data: dict[str, Any], name: str) -> None:
    """What the text scan cannot see, refused in the parsed values (without recursing into them).

    Nesting: TOML's dotted keys and table headers (``[a.b.c]``) nest tables without a bracket
    per level, so the depth is measured again here, whatever the syntax. Integers: TOML has no
    integer hook, so one longer than MAX_INT_DIGITS is refused here.
    """
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        values = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for v in values:
            if isinstance(v, int) and abs(v) >= 10**MAX_INT_DIGITS:
                raise ConfigError(f"config: {name} holds an integer of {len(str(abs(v)))} digits, "
                                  f"expected at most {MAX_INT_DIGITS} digits")
            if isinstance(v, (dict, list)):
                if depth + 1 > MAX_CONFIG_DEPTH:
                    raise ConfigError(f"config: {name} nests lists or tables (dotted keys and table headers "
                                      f"included) more than {MAX_CONFIG_DEPTH} deep, "
                                      f"expected at most {MAX_CONFIG_DEPTH} levels")
                stack.append((v, depth + 1))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                option_names: Mapping[str, str] | None = None) -> RunConfig:
    """The embedded default, updated by a config file, updated by explicit overrides (CLI options).

    Args:
        option_names: key -> the option that sets it (``{"valid_lengths": "--valid-lengths"}``);
            a message about a key that came from an option names the option.
    """
    values: dict[str, Any] = dict(DEFAULT_CONFIG)
    if path is not None:
        data = read_config_file(path)
        if "query_len" in data or "key_len" in data:
            values.pop("seq_len", None)
        values.update(data)
    names: dict[str, str] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in ("query_len", "key_len"):
            values.pop("seq_len", None)
        if key == "seq_len":
            values.pop("query_len", None)
            values.pop("key_len", None)
        values[key] = value
        if option_names and key in option_names:
            names[key] = option_names[key]
    return make_config(values, names=names)
