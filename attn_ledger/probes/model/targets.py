"""What model a scan runs, said as plain data in the tool's process, and built from it in the worker.

A :class:`Target` is one of:

* ``transformers``: a transformers model built from its config with random weights, seeded, never
  downloading anything. ``source`` is a model type (``llama``), which gets small defaults
  (:func:`tiny_defaults`: two layers, width 64, a few hundred tokens, head width 16, sliding
  windows of 16 keys so that they bind at the scanned length), or a ``config.json``, which keeps
  its sizes unless ``tiny``. ``overrides`` (``--set key=value``) apply last.
* ``factory``: ``FILE:FACTORY``, the user's function returning an ``nn.Module`` or ``(module, inputs)``,
  inputs a dict of forward keyword arguments or one tensor.

``implementation`` selects transformers' attention implementation (``eager``, ``sdpa``,
``flex_attention``, or a name registered from ``register``, ``FILE:FN``, with a mask function:
``mask_format`` ``sdpa`` (default), ``eager``, or ``none``). Parsing and validating the plain
parts happens in the tool's process (:func:`target`); :func:`build` runs in the worker, where
transformers and the user's code are imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from attn_ledger.errors import InputError, SetupError, did_you_mean, first_line, shown

if TYPE_CHECKING:
    from torch import nn

KINDS = ("transformers", "factory")
MASK_FORMATS = ("sdpa", "eager", "none")
BUILTIN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
NO_TRANSFORMERS = ("--transformers: needs transformers, which is not installed "
                   "(pip install transformers, or attn-ledger's 'real' extra)")

WINDOW = 16
"""The sliding window of the small defaults: it binds at any scanned length above 16."""

_COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "max_position_embeddings": 2048,
           "pad_token_id": 0, "initializer_range": 0.2}
# Per family: the keys its config names differently, and the features kept small enough to see.
_FAMILIES: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24},
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 320, "n_positions": 1024,
             "bos_token_id": 1, "eos_token_id": 1, "initializer_range": 0.2},
    "bert": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 320, "max_position_embeddings": 512, "pad_token_id": 0, "initializer_range": 0.2},
    "t5": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
           "vocab_size": 320, "relative_attention_num_buckets": 8, "pad_token_id": 0, "decoder_start_token_id": 0},
}
_OWN_KEYS = {"gpt2", "bert", "t5"}  # families whose defaults are theirs alone (no common keys)


def tiny_defaults(model_type: str, present: Sequence[str] = ()) -> dict[str, Any]:
    """The small config values a model type gets (``--transformers MODEL_TYPE``, or ``--tiny``).

    Args:
        present: the keys the family's config has; the common defaults apply only to those, so a
            family that names its sizes otherwise keeps its own (known families list theirs).
    """
    own = _FAMILIES.get(model_type, {})
    if model_type in _OWN_KEYS:
        return dict(own)
    common = {k: v for k, v in _COMMON.items() if not present or k in present}
    if present and "sliding_window" in present and "sliding_window" not in own:
        common["sliding_window"] = None if model_type in ("qwen2", "qwen3") else WINDOW
    return {**common, **own}


@dataclass(frozen=True)
class Target:
    """A model to scan, as plain data (see the module docstring)."""

    kind: str
    source: str
    tiny: bool = False
    overrides: tuple[tuple[str, Any], ...] = ()
    implementation: str | None = None
    register: str | None = None
    mask_format: str = "sdpa"
    seed: int = 0
    field: str = "target"  # the option that named a factory, for its errors (``--vary target`` for run B's)

    @property
    def label(self) -> str:
        """How the report names the model."""
        return f"--transformers {self.source}" if self.kind == "transformers" else self.source

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "tiny": self.tiny,
                "overrides": [[k, v] for k, v in self.overrides], "implementation": self.implementation,
                "register": self.register, "mask_format": self.mask_format, "seed": self.seed,
                "field": self.field}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Target":
        return cls(d["kind"], d["source"], bool(d["tiny"]), tuple((k, v) for k, v in d["overrides"]),
                   d["implementation"], d["register"], d["mask_format"], int(d["seed"]), d.get("field", "target"))


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_set(items: Sequence[str] | None) -> tuple[tuple[str, Any], ...]:
    """``--set key=value`` items as (key, value) pairs; a value reads as JSON where it is JSON (numbers,
    true/false/null, lists, objects), otherwise as text.

    Raises:
        InputError: an item without ``=`` or with a key that is not a name.
    """
    out: list[tuple[str, Any]] = []
    for item in items or ():
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.fullmatch(key):
            raise InputError(f"--set: got {shown(item)}, expected key=value with a config key such as hidden_size=128")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        out.append((key, value))
    return tuple(out)


def is_config_path(source: str) -> bool:
    """Whether ``--transformers`` names a config file rather than a model type."""
    return source.endswith(".json") or "/" in source or "\\" in source or Path(source).is_file()


def target(kind: str, source: str, *, tiny: bool = False, overrides: Sequence[str] | None = None,
           implementation: str | None = None, register: str | None = None, mask_format: str | None = None,
           seed: int = 0, field: str = "target") -> Target:
    """A :class:`Target` from the options, its plain parts validated here (the rest in the worker).

    Raises:
        InputError: a malformed ``--set``, ``--tiny`` without a config file, ``--register`` without a
            name to register it under, a mask format without a registered function, an unreadable config file.
    """
    from attn_ledger.inputs.userload import parse_spec

    if kind not in KINDS:
        raise InputError(f"target: got {kind!r}, expected one of {', '.join(KINDS)}")
    pairs = parse_set(overrides)
    if kind == "transformers":
        if is_config_path(source):
            _read_config(source)
        elif tiny:
            raise InputError(f"--tiny: got it with the model type {source!r}, which is small already; "
                             "expected --tiny with a config.json")
    else:
        if tiny or pairs:
            raise InputError(f"{'--tiny' if tiny else '--set'}: applies to --transformers, not to a FILE:FACTORY target")
        parse_spec(source, field)
    if register is not None:
        if implementation is None or implementation in BUILTIN_IMPLEMENTATIONS:
            raise InputError(f"--register: got {shown(register)} with --attn-implementation "
                             f"{implementation or '(none)'}, expected a name of your own to register it under")
        parse_spec(register, "--register")
    if mask_format is not None and register is None:
        raise InputError(f"--mask-format: got {mask_format!r} without --register; it is the mask function "
                         "a registered implementation gets")
    if mask_format is not None and mask_format not in MASK_FORMATS:
        raise InputError(f"--mask-format: got {mask_format!r}, expected one of {', '.join(MASK_FORMATS)}")
    return Target(kind, source, tiny, pairs, implementation, register, mask_format or "sdpa", seed, field)


def _read_config(path: str) -> dict[str, Any]:
    from attn_ledger.inputs.paths import input_file

    p = input_file(path, "--transformers", InputError)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"--transformers: cannot read {str(path)!r} as JSON: {first_line(exc)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise InputError(f"--transformers: got {str(path)!r}, expected a config.json with a 'model_type'")
    return data


# --- the worker's side: building the model -----------------------------------------------------------


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SetupError(NO_TRANSFORMERS) from None


def model_config(t: Target) -> Any:
    """The transformers config of a ``transformers`` target, small defaults and overrides applied.

    Raises:
        InputError: an unknown model type, or an override that names no key of the config or that the
            config refuses.
    """
    require_transformers()
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if is_config_path(t.source):
        data = _read_config(t.source)
        model_type = data.pop("model_type")
    else:
        data, model_type = {}, t.source
    if model_type not in CONFIG_MAPPING:
        raise InputError(f"--transformers: got {model_type!r}, expected a model type transformers knows "
                         f"(llama, mistral, gpt2, bert, t5, ...){did_you_mean(model_type, list(CONFIG_MAPPING))}")
    present = list(AutoConfig.for_model(model_type).to_dict())
    small = tiny_defaults(model_type, present) if (t.tiny or not data) else {}
    values = {**data, **small}
    for key, value in t.overrides:
        if key not in present and key not in values:
            raise InputError(f"--set: got {key!r}, expected a key of the {model_type} config"
                             f"{did_you_mean(key, present)}")
        values[key] = value
    if "num_hidden_layers" in values and "layer_types" in present and "layer_types" not in dict(t.overrides):
        values.pop("layer_types", None)  # the config lays out its layer types again for the new depth
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # the config's own validation of a value given
        raise InputError(f"--set: the {model_type} config refuses the values given: {first_line(exc)}") from None


def register_implementation(t: Target) -> None:
    """Register the user's function under ``t.implementation`` with its mask function (user code: worker only)."""
    if t.register is None:
        return
    require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    from attn_ledger.inputs.userload import load_object

    fn = load_object(t.register, "--register")
    if not callable(fn):
        raise SetupError(f"--register: {t.register} is a {type(fn).__name__}, expected a function")
    AttentionInterface.register(t.implementation, fn)
    if t.mask_format != "none":
        AttentionMaskInterface.register(t.implementation, sdpa_mask if t.mask_format == "sdpa" else eager_mask)
    else:  # no mask: not even one an earlier registration of this name in the process gave it
        AttentionMaskInterface._global_mapping.pop(t.implementation, None)


def build(t: Target, head: bool = False) -> tuple["nn.Module", Any]:
    """The model (in eval mode) and the inputs its factory gave (None for a transformers target).

    ``head``: a transformers decoder is built with its language-model head (``AutoModelForCausalLM``), so its
    forward gives logits (``compare``); other architectures are built as without it.
    """
    import torch

    from attn_ledger.seeding import manual_seed

    register_implementation(t)
    if t.kind == "transformers":
        from transformers import AutoModel, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = model_config(t)
        causal_lm = head and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.is_encoder_decoder
        auto = AutoModelForCausalLM if causal_lm else AutoModel
        manual_seed(t.seed)
        try:
            model = auto.from_config(config, attn_implementation=t.implementation)
        except (ValueError, ImportError, KeyError) as exc:
            raise InputError(f"--attn-implementation: {config.model_type} cannot be built with "
                             f"{t.implementation!r}: {first_line(exc)}") from None
        return model.eval(), None
    model, given = _from_factory(t)
    if t.implementation is not None:
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise InputError(f"--attn-implementation: got {t.implementation!r}, but {t.source} builds a "
                             f"{type(model).__name__}, which has no set_attn_implementation")
        with torch.no_grad():
            setter(t.implementation)
    return model.eval(), given


def _from_factory(t: Target) -> tuple[Any, Any]:
    import torch

    from attn_ledger.guard import UserCodeError, user_call
    from attn_ledger.inputs.userload import load_object
    from attn_ledger.seeding import manual_seed

    factory = load_object(t.source, t.field)
    manual_seed(t.seed)
    try:
        with user_call(f"{t.source}()"):
            made = factory()
    except UserCodeError as exc:
        raise SetupError(f"{t.field}: {t.source}() {exc}") from None
    except Exception as exc:
        raise SetupError(f"{t.field}: {t.source}() raised {type(exc).__name__}: {first_line(exc)}") from None
    model, given = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(model, torch.nn.Module):
        raise SetupError(f"{t.field}: {t.source}() returned {type(made).__name__}, expected an nn.Module "
                         "or (module, inputs)")
    if given is not None and not isinstance(given, (dict, torch.Tensor)):
        raise SetupError(f"{t.field}: {t.source}() returned inputs of type {type(given).__name__}, expected a dict "
                         "of forward keyword arguments or a tensor")
    return model, given
