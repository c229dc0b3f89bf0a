"""Attention from widely used packages, as ``check --module`` factories and ``--decode`` adapters.

transformers (Llama, Mistral, Gemma 2, GPT-2, GPT-NeoX, BERT), diffusers (``Attention``) and x-transformers
(``Encoder``/``Decoder`` with rotary positions), each from a tiny config with random weights.
Every package is imported inside the function that needs it, so this file loads without any of
them (``attn-ledger check --module tests/real_models.py:NAME`` loads it as a plain file); the
tests that use a package skip without it.

A transformers model is read as ``[B, T, E] -> [B, T, E]`` through ``inputs_embeds``
(:class:`FromEmbeddings`), one layer deep, so the layer's own code builds its masks and rotary
tables. The decode adapters (:func:`decode_transformers` and the planted bugs after it) run the
model with its own cache object (``DynamicCache``) and ``use_cache=True``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

# Random-init weights small enough (transformers' initializer_range 0.02) make every attention
# row nearly uniform, so a position bug moves the output by little more than float32 noise
# beside the residual stream; the decode factories use larger weights for a clear margin.
DECODE_INIT = 0.2


class FromEmbeddings(nn.Module):
    """A one-layer transformers model read as ``[B, T, E] -> [B, T, E]`` through ``inputs_embeds``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        for p in model.get_input_embeddings().parameters():
            p.requires_grad_(False)  # unused when inputs_embeds is given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state  # [B, T, E]


# --- transformers ------------------------------------------------------------------------------

def layer(model: str, impl: str, *, model_args: dict[str, Any] | None = None,
          **config: Any) -> Callable[[int, int], nn.Module]:
    """``factory(e, nh)`` for a one-layer ``transformers.<model>Model`` built from its ``<model>Config``: the sizes
    under the config's own names (grouped kv heads, Nkv = Nh / 2, where the model has them), then ``config``."""
    def make(e: int, nh: int) -> nn.Module:
        import transformers

        if model == "GPT2":
            sizes: dict[str, Any] = {"n_embd": e, "n_layer": 1, "n_head": nh, "vocab_size": 16, "n_positions": 64}
        else:
            sizes = {"hidden_size": e, "intermediate_size": 2 * e, "num_hidden_layers": 1, "num_attention_heads": nh,
                     "vocab_size": 16, "max_position_embeddings": 64}
        if model in ("Llama", "Mistral", "Gemma2"):
            sizes["num_key_value_heads"] = nh // 2
        if model == "Gemma2":
            sizes["head_dim"] = e // nh  # its config's default is 256
        cfg = getattr(transformers, f"{model}Config")(**sizes, attn_implementation=impl, **config)
        return FromEmbeddings(getattr(transformers, f"{model}Model")(cfg, **(model_args or {})))
    return make


def llama(impl: str, **extra: Any) -> Callable[[int, int], nn.Module]:
    """Llama: rotary (half-split), grouped-query (Nkv = Nh / 2), separate projections."""
    return layer("Llama", impl, **extra)


def mistral(impl: str, window: int) -> Callable[[int, int], nn.Module]:
    """Mistral: Llama's attention with a sliding window of ``window`` keys."""
    return layer("Mistral", impl, sliding_window=window)


def gpt2(impl: str, **extra: Any) -> Callable[[int, int], nn.Module]:
    """GPT-2: a fused ``Conv1D`` projection (``c_attn``), learned absolute positions."""
    return layer("GPT2", impl, bos_token_id=None, eos_token_id=None, **extra)


def gpt_neox(impl: str) -> Callable[[int, int], nn.Module]:
    """GPT-NeoX: a fused per-head interleaved projection, rotary on half of each head."""
    return layer("GPTNeoX", impl, rotary_pct=0.5, bos_token_id=None, eos_token_id=None)


def bert(impl: str) -> Callable[[int, int], nn.Module]:
    """BERT: bidirectional, ``query``/``key``/``value`` projections, learned absolute positions."""
    return layer("Bert", impl, model_args={"add_pooling_layer": False})


def gemma2(impl: str, cap: float | None = 50.0, **extra: Any) -> Callable[[int, int], nn.Module]:
    """Gemma 2: logits soft-capped at ``cap`` before the mask (``attn_logit_softcapping``), softmax scale
    ``query_pre_attn_scalar ** -0.5`` (1/16 by default, not 1/sqrt(Dh)), one full-attention layer."""
    return layer("Gemma2", impl, attn_logit_softcapping=cap,
                 layer_types=["full_attention"], sliding_window=64, **extra)


GEMMA2_SCALE = 256 ** -0.5  # Gemma2Config's query_pre_attn_scalar = 256


def gemma2_softcap(e: int, nh: int) -> nn.Module:
    """Gemma 2, eager, its cap of 50."""
    return gemma2("eager")(e, nh)


def gemma2_cap_dropped(e: int, nh: int) -> nn.Module:
    """Bug: Gemma 2 configured with a cap of 50 whose attention layers skip it (as an attention function that
    ignores ``softcap`` does)."""
    module = gemma2("eager")(e, nh)
    for block in module.model.layers:
        block.self_attn.attn_logit_softcapping = None  # read by forward on each call
    return module


def llama_decode(e: int, nh: int) -> nn.Module:
    """Llama with SDPA and weights large enough for decode bugs to show (:data:`DECODE_INIT`)."""
    return llama("sdpa", initializer_range=DECODE_INIT)(e, nh)


def gpt2_decode(e: int, nh: int) -> nn.Module:
    """GPT-2 with eager attention and weights large enough for decode bugs to show."""
    return gpt2("eager", initializer_range=DECODE_INIT)(e, nh)


# --- transformers' own cache as the decode protocol -------------------------------------------

def _cache_keyword(model: nn.Module) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` from transformers 5.x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step(module: FromEmbeddings, x_new: torch.Tensor, cache: Any, first: int) -> tuple[torch.Tensor, Any]:
    """One call of the model on ``x_new [B, t, E]`` at positions ``first..first + t - 1``, with its cache."""
    model = module.model
    positions = torch.arange(first, first + x_new.shape[1]).unsqueeze(0)  # [1, t]
    out = model(inputs_embeds=x_new, position_ids=positions, use_cache=True, **{_cache_keyword(model): cache})
    returned = out.cache if "cache" in out else out.past_key_values  # named by version
    return out.last_hidden_state, returned  # [B, t, E]


def _cached(cache: Any) -> int:
    """Positions held by the cache the model returned: a ``Cache`` object, or (GPT-2 before
    transformers 4.5x) a tuple of ``(k, v)`` per layer, k ``[B, Nh, Tk, Dh]``."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return cache.get_seq_length()
    return cache[0][0].shape[-2]


def decode_transformers(module: FromEmbeddings, x_new: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """transformers' own decode: a ``DynamicCache`` made on the first call, positions counted from its length."""
    return _step(module, x_new, cache, _cached(cache))


def decode_transformers_off_by_one(module: FromEmbeddings, x_new: torch.Tensor, cache: Any):
    """Bug: ``position_ids`` start one past the cached length once a cache exists."""
    return _step(module, x_new, cache, _cached(cache) + (cache is not None))


def decode_transformers_positions_restart(module: FromEmbeddings, x_new: torch.Tensor, cache: Any):
    """Bug: ``position_ids`` start at 0 on every call (the cached length never added)."""
    return _step(module, x_new, cache, 0)


# --- diffusers ----------------------------------------------------------------------------------

def diffusers_attention(e: int, nh: int, **extra: Any) -> nn.Module:
    """diffusers' ``Attention``, self-attention, its default processor (``AttnProcessor2_0``, SDPA)."""
    from diffusers.models.attention_processor import Attention

    return Attention(query_dim=e, heads=nh, dim_head=e // nh, **extra)


def diffusers_attention_classic(e: int, nh: int) -> nn.Module:
    """diffusers' ``Attention`` with its classic ``AttnProcessor`` (scores by ``baddbmm``, softmax by hand)."""
    from diffusers.models.attention_processor import AttnProcessor

    return diffusers_attention(e, nh, processor=AttnProcessor())


def diffusers_attention_unscaled(e: int, nh: int) -> nn.Module:
    """Bug: ``scale_qk=False``, so the scores are not scaled at all (the processor then chosen honours it)."""
    return diffusers_attention(e, nh, scale_qk=False)


# --- x-transformers ------------------------------------------------------------------------------

def x_encoder(e: int, nh: int) -> nn.Module:
    """x-transformers: a one-layer ``Encoder`` (bidirectional) with rotary positions."""
    from x_transformers import Encoder

    return Encoder(dim=e, depth=1, heads=nh, attn_dim_head=e // nh, rotary_pos_emb=True)


def x_decoder(e: int, nh: int, **extra: Any) -> nn.Module:
    """x-transformers: a one-layer ``Decoder`` (causal) with rotary positions, einsum scores."""
    from x_transformers import Decoder

    return Decoder(dim=e, depth=1, heads=nh, attn_dim_head=e // nh, rotary_pos_emb=True, **extra)


def x_decoder_flash(e: int, nh: int) -> nn.Module:
    """The same ``Decoder`` on its SDPA path (``attn_flash=True``)."""
    return x_decoder(e, nh, attn_flash=True)


def x_decoder_window_4(e: int, nh: int) -> nn.Module:
    """A ``Decoder`` whose queries read 4 keys: ``max_attend_past`` counts the past keys besides the query's own."""
    return x_decoder(e, nh, attn_max_attend_past=3)


def x_decoder_window_4_off_by_one(e: int, nh: int) -> nn.Module:
    """Bug: ``max_attend_past=4`` for a window of 4 keys, which lets each query read 5."""
    return x_decoder(e, nh, attn_max_attend_past=4)
