"""Run configuration: a TOML/JSON file or keyword arguments, validated once, up front.

Unknown keys, wrong types and inconsistent sizes are rejected here with one line that
names the field, the value and what was expected. Nothing downstream re-validates.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from attn_ledger.engine import relations as mask_relations
from attn_ledger.errors import ConfigError, InputError

if TYPE_CHECKING:
    from attn_ledger.rotary import RotarySpec

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
ALL_FAULTS = FAULTS + GRAD_FAULTS + ROPE_FAULTS + PROPERTY_FAULTS
GRAD_OUTPUTS = ("ones", "identity")  # or a tensor file
# what a fault needs to have its stage: the backward (grad) or rotary positions (rope)
FAULT_NEEDS: dict[str, dict[str, Any]] = {**{f: {"grad": True} for f in GRAD_FAULTS},
                                          **{f: {"rope": "half"} for f in ROPE_FAULTS}}

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


class RunConfig(BaseModel):
    """One ledger run on the built-in multi-head attention.

    ``seq_len`` sets both lengths for self-attention; ``query_len``/``key_len`` set them
    apart for cross-attention. ``mask`` is one relation name or several joined by ``+``
    (all in allow polarity): ``none``, ``causal`` (bottom-right aligned), ``causal-top-left``,
    ``padding`` (needs ``valid_lengths``), ``sliding-window`` (needs ``window``),
    ``prefix-lm`` (needs ``prefix_len``), ``segments`` (needs ``segment_lengths``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=True)

    batch_size: int = Field(2, ge=0)
    seq_len: Optional[int] = Field(None, ge=1)
    query_len: Optional[int] = Field(None, ge=1)
    key_len: Optional[int] = Field(None, ge=1)
    embed_dim: int = Field(12, ge=1)
    num_heads: int = Field(3, ge=1)
    num_kv_heads: Optional[int] = Field(None, ge=1)
    value_dim: Optional[int] = Field(None, ge=1, description="Dv, the per-head value width (default Dh)")
    mask: str = "causal"
    valid_lengths: Optional[list[int]] = None
    padding_side: Literal["right", "left"] = "right"
    window: Optional[int] = Field(None, ge=1)
    prefix_len: Optional[int] = Field(None, ge=0)
    segment_lengths: Optional[list[int]] = None
    empty_rows: Literal["error", "zeros"] = "error"
    dtype: Literal["float32", "float64", "float16", "bfloat16"] = "float32"
    seed: int = 0
    input: Literal["random", "arange"] = "random"
    fault: Optional[Fault] = None
    device: str = "cpu"
    block_size: Optional[int] = Field(None, ge=1)
    keep_grids: bool = False
    grad: bool = False
    grad_output: Optional[str] = Field(None, description="ones, identity or a tensor file (with grad)")
    replay: bool = False
    scale: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="S (default 1/sqrt(Dh))")
    temperature: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="tau: the scale is S/tau")
    rope: Optional[Any] = Field(None, description="rotary positions: PAIRING[,base=B][,dim=D], or a table")

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
            mask_relations.parse(self.mask, tq=self.tq, tk=self.tk, batch_size=self.batch_size,
                            valid_lengths=self.valid_lengths, padding_side=self.padding_side, window=self.window,
                            prefix_len=self.prefix_len, segment_lengths=self.segment_lengths)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if self.device not in ("cpu", "cuda", "mps", "auto") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: got {self.device!r}, expected cpu, cuda, mps or auto")
        self._backward_and_positions()
        return self

    def _backward_and_positions(self) -> None:
        """grad_output only with grad; a fault only where its stage runs; rope fits the heads; identity fits Tq."""
        if self.grad_output is not None and not self.grad:
            raise ValueError(f"grad_output: got {self.grad_output!r}, expected it only with grad (--grad)")
        if self.fault in GRAD_FAULTS and not self.grad:
            raise ValueError(f"fault: got {self.fault!r}, a fault in a backward stage, expected it only with grad (--grad)")
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
        from attn_ledger.rotary import parse_spec

        return None if self.rope is None else parse_spec(self.rope)

    @property
    def effective_scale(self) -> float:
        """S / tau: the score scale the pipeline and every reference use."""
        return (1.0 / math.sqrt(self.dh) if self.scale is None else self.scale) / (self.temperature or 1.0)

    @property
    def relations(self) -> list[str]:
        return mask_relations.split_names(self.mask)

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


def _describe(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ())) or "config"
    kind = err.get("type", "")
    value = err.get("input")
    if kind == "extra_forbidden":
        known = ", ".join(RunConfig.model_fields)
        return f"unknown config key {loc!r} (value {value!r}), expected one of: {known}"
    msg = err.get("msg", "invalid")
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if isinstance(value, dict):
        return f"{loc}: {msg}"
    expected = msg.removeprefix("Input should be ").removeprefix("input should be ") or "a valid value"
    return f"{loc}: got {value!r}, expected {expected}"


def make_config(values: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a dict of settings into a :class:`RunConfig`.

    Raises:
        ConfigError: one line naming the field, the value and what was expected.
    """
    try:
        return RunConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        prefix = "" if source == "config" else f"{source}: "
        raise ConfigError(prefix + _describe(first)) from None
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a plain dict (not yet validated)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config: file not found: {str(p)!r}")
    if not p.is_file():
        raise ConfigError(f"config: not a regular file: {str(p)!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: cannot read {str(p)!r}: {exc}") from None
    suffix = p.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config: malformed JSON in {str(p)!r}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    elif suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: malformed TOML in {str(p)!r}: {exc}") from None
    else:
        raise ConfigError(f"config: unsupported file type {suffix or '(none)'!r} for {str(p)!r}, expected .toml or .json")
    if not isinstance(data, dict):
        raise ConfigError(f"config: {str(p)!r} holds a {type(data).__name__}, expected a table of keys")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The embedded default, updated by a config file, updated by explicit overrides (CLI options)."""
    values: dict[str, Any] = dict(DEFAULT_CONFIG)
    if path is not None:
        data = read_config_file(path)
        if "query_len" in data or "key_len" in data:
            values.pop("seq_len", None)
        values.update(data)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in ("query_len", "key_len"):
            values.pop("seq_len", None)
        if key == "seq_len":
            values.pop("query_len", None)
            values.pop("key_len", None)
        values[key] = value
    return make_config(values)
