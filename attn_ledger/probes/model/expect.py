"""What each attention call should compute, read from the model's config (or from declarations).

The config arrives as plain data (``config.to_dict()``, sent by the worker); nothing here imports
transformers. For one call (its module path, layer, whether it is cross-attention) :func:`expect`
gives an :class:`Expected`:

* the **relation**: causal for a decoder, bidirectional for an encoder (BERT and its kin, T5's
  encoder) and for cross-attention; a sliding window of ``sliding_window`` keys on the layers
  ``layer_types`` marks ``sliding_attention`` (Gemma 2 and gpt-oss alternate), or on every layer where
  the config has a window and no layer types (Mistral); padding from the attention mask of the side
  the queries and keys come from;
* the **scale**: ``query_pre_attn_scalar ** -0.5`` (Gemma 2), 1 for T5, GPT-2's own
  (``scale_attn_weights``, divided by ``layer_idx + 1`` with ``scale_attn_by_inverse_layer_idx``),
  a config ``scaling`` or ``attention_multiplier``, else ``head_dim ** -0.5``;
* **rotary**: the family's pairing (half-split for Llama's ``rotate_half``, adjacent pairs for
  GPT-J), ``rope_theta`` as its base, the rotated width from ``partial_rotary_factor``
  (GPT-NeoX's ``rotary_pct``, GPT-J's ``rotary_dim``); a ``rope_type`` other than ``default`` is
  not judged and says so;
* the **soft-cap** ``attn_logit_softcapping`` and **sinks** (gpt-oss).

A model that is not transformers' is judged against declarations (``--causal``, ``--window``,
``--scale``, ``--softcap``); where none is given the relation is ``found``: reported, not judged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "electra", "distilbert", "albert", "camembert", "deberta",
                      "deberta-v2", "mpnet", "modernbert", "ernie", "megatron-bert", "roformer", "xlm"})
T5_LIKE = frozenset({"t5", "mt5", "longt5", "umt5"})
ROTARY_PAIRING = {
    **{t: "half" for t in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                           "gemma2", "gemma3_text", "gpt_oss", "phi", "phi3", "olmo", "olmo2", "granite",
                           "gpt_neox", "stablelm", "starcoder2", "smollm3")},
    "gptj": "interleaved",
}
RELATIONS = ("causal", "bidirectional", "found")


@dataclass(frozen=True)
class Declared:
    """What a model of one's own is declared to do (``scan FILE:FACTORY`` options); None: not declared."""

    causal: bool | None = None
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.causal, self.window, self.scale, self.softcap))

    def to_json(self) -> dict[str, Any]:
        return {"causal": self.causal, "window": self.window, "scale": self.scale, "softcap": self.softcap}


@dataclass(frozen=True)
class Expected:
    """What one call should compute.

    Attributes:
        relation: ``causal``, ``bidirectional``, or ``found`` (nothing says: the call's own mask is reported).
        window: keys a query sees, itself included (a sliding-window layer), or None.
        scale: the softmax scale, or None where nothing says it (the call's own, or ``Dh ** -0.5``, is used).
        scale_source: where the scale comes from, in words (``query_pre_attn_scalar = 24``).
        rotary: ``{"pairing", "base", "rotated_dim"}``, or None; ``rotary_note`` says why not where a family
            has rotary that is not judged.
        softcap: the soft-cap of the scores, or None.
        sinks: the family puts sinks in the softmax's denominator (gpt-oss).
        queries, keys: which input's padding the queries and keys follow: ``input`` (``attention_mask``) or
            ``decoder`` (the decoder's, unpadded).
        layer: the call's layer number.
        judged: whether the relation comes from the config or a declaration (False: ``found``).
    """

    relation: str
    window: int | None
    scale: float | None
    scale_source: str
    rotary: Mapping[str, Any] | None
    rotary_note: str
    softcap: float | None
    sinks: bool
    queries: str
    keys: str
    layer: int | None
    judged: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"relation": self.relation, "window": self.window, "scale": self.scale,
                "scale_source": self.scale_source, "rotary": None if self.rotary is None else dict(self.rotary),
                "rotary_note": self.rotary_note, "softcap": self.softcap, "sinks": self.sinks,
                "queries": self.queries, "keys": self.keys, "layer": self.layer, "judged": self.judged}


def layer_of(facts: Mapping[str, Any]) -> int | None:
    """The call's layer: its module's ``layer_idx``, else the first number in its module path."""
    if isinstance(facts.get("layer"), int):
        return facts["layer"]
    found = re.search(r"(?:^|\.)(\d+)(?:\.|$)", str(facts.get("path", "")))
    return int(found.group(1)) if found else None


def _get(config: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return None


def head_dim(config: Mapping[str, Any], observed: int) -> int:
    """The config's head width: ``head_dim``, or the width over the heads; the observed one where neither is set."""
    hd = _get(config, "head_dim", "d_kv")
    if isinstance(hd, int) and hd > 0:
        return hd
    width, heads = _get(config, "hidden_size", "n_embd", "d_model"), _get(config, "num_attention_heads", "n_head",
                                                                             "num_heads")
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads == 0:
        return width // heads
    return observed


def _scale(model_type: str, config: Mapping[str, Any], layer: int | None, width: int) -> tuple[float | None, str]:
    if model_type in T5_LIKE:
        return 1.0, "T5 applies no scale"
    if model_type in ("gpt2", "gpt_bigcode", "decision_transformer") and width > 0:
        s, why = (width ** -0.5, f"1/sqrt(head_dim {width})") if config.get("scale_attn_weights", True) \
            else (1.0, "scale_attn_weights false")
        if config.get("scale_attn_by_inverse_layer_idx") and layer is not None:
            s, why = s / (layer + 1), f"{why} / (layer_idx + 1 = {layer + 1})"
        return s, why
    qpas = config.get("query_pre_attn_scalar")
    if isinstance(qpas, (int, float)) and qpas > 0:
        return float(qpas) ** -0.5, f"query_pre_attn_scalar = {qpas:g}"
    for key in ("scaling", "attention_multiplier"):
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value), f"config {key} = {value:g}"
    if width <= 0:
        return None, ""
    return width ** -0.5, f"1/sqrt(head_dim {width})"


def _rotary(model_type: str, config: Mapping[str, Any], width: int) -> tuple[dict[str, Any] | None, str]:
    pairing = ROTARY_PAIRING.get(model_type)
    if pairing is None:
        return None, ""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params if isinstance(params, Mapping) else {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default":
        return None, f"rope_type {kind} (frequencies rescaled) is not judged"
    base = _get(params, "rope_theta") or _get(config, "rope_theta", "rotary_emb_base") or 10000.0
    factor = _get(params, "partial_rotary_factor") or _get(config, "partial_rotary_factor", "rotary_pct")
    rotated = config.get("rotary_dim") if model_type == "gptj" else None
    if rotated is None and isinstance(factor, (int, float)) and 0 < factor < 1:
        rotated = int(width * factor)
    rotated = rotated if isinstance(rotated, int) and 2 <= rotated < width else None
    return {"pairing": pairing, "base": float(base), "rotated_dim": rotated}, ""


def _window(config: Mapping[str, Any], layer: int | None) -> tuple[int | None, str]:
    """The layer's window and its kind; kind ``other`` for a layer type the judge does not model."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if isinstance(types, list) and types and layer is not None and layer < len(types):
        kind = types[layer]
        if kind == "sliding_attention":
            return (window if isinstance(window, int) else None), kind
        return None, kind if kind == "full_attention" else "other"
    if isinstance(window, int) and window > 0 and config.get("use_sliding_window", True) is not False:
        return window, "sliding_attention"
    return None, "full_attention"


def expect(model: Mapping[str, Any], facts: Mapping[str, Any], declared: Declared | None = None) -> Expected:
    """What the call ``facts`` describes should compute, for the model ``model`` (its ``model_type``,
    ``config``, ``architecture``; an empty config for a model of one's own)."""
    config = model.get("config") or {}
    model_type = str(model.get("model_type") or "")
    layer = layer_of(facts)
    width = head_dim(config, int(facts.get("width") or 0))
    cross = bool(facts.get("cross"))
    path = str(facts.get("path", ""))
    queries = keys = "input"
    if model.get("architecture") == "encoder-decoder" and path.startswith("decoder"):
        queries = "decoder"
        keys = "input" if cross else "decoder"
    if not model_type:
        return _declared(declared or Declared(), layer, queries, keys)
    if model.get("architecture") == "encoder" or (model.get("architecture") == "encoder-decoder" and queries == "input") \
            or cross or config.get("is_causal") is False:
        relation = "bidirectional"
    else:
        relation = "causal"
    window, kind = _window(config, layer) if relation == "causal" else (None, "full_attention")
    scale, why = _scale(model_type, config, layer, width)
    rotary, note = _rotary(model_type, config, width) if not cross else (None, "")
    softcap = config.get("attn_logit_softcapping")
    return Expected(relation if kind != "other" else "found", window, scale, why, rotary, note,
                    float(softcap) if isinstance(softcap, (int, float)) else None, model_type == "gpt_oss",
                    queries, keys, layer, judged=kind != "other")


def _declared(d: Declared, layer: int | None, queries: str, keys: str) -> Expected:
    relation = "found" if d.causal is None and d.window is None else ("causal" if d.causal is not False else
                                                                       "bidirectional")
    why = "--scale" if d.scale is not None else ""
    return Expected(relation, d.window, d.scale, why, None, "", d.softcap, False, queries, keys, layer,
                    judged=relation != "found")
