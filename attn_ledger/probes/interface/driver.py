"""Where an attention-interface function is called as a transformers layer calls it: in the worker.

:func:`interface_call` builds the stand-in ``module`` (what the interface functions read), the
``attention_mask`` with transformers' own mask functions (``sdpa_mask``, ``eager_mask`` and
``flex_attention_mask`` of ``masking_utils``), and the keyword arguments the families pass, then
calls the function. It is the one place transformers is imported; the tool's own process judges
what comes back and never imports it.

The call is reached through the kernel driver (:mod:`attn_ledger.probes.common.driver`): the query,
key and value travel as q, k and v, the sinks as the ``sinks`` tensor keyword, and what the case is
as the plain-data keyword ``interface`` (``{"case": id, "returns": "output" | "weights",
"passes": [features]}``). With ``returns`` ``weights`` the adapter gives back the weights the
function returned (an empty tensor for None) instead of its output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from attn_ledger.errors import SetupError
from attn_ledger.probes.interface.cases import ATTENTION_DROPOUT, ICase, padding_mask, parse_icase

if TYPE_CHECKING:
    from torch import Tensor

NO_TRANSFORMERS = ("--protocol transformers: needs transformers, which is not installed "
                   "(pip install transformers, or attn-ledger's 'real' extra)")


def require_transformers() -> None:
    """Raise :class:`SetupError` (one line, exit 2) where transformers cannot be imported."""
    try:
        import transformers.masking_utils  # noqa: F401
    except ImportError:
        raise SetupError(NO_TRANSFORMERS) from None


class _Config:
    """The stand-in's ``config``: what the interface functions read from it."""

    def __init__(self, case: ICase, name: str) -> None:
        self.sliding_window = case.window
        self._attn_implementation = name
        self.num_attention_heads = case.h
        self.num_key_value_heads = case.hkv
        self.head_dim = case.d
        self.attention_dropout = ATTENTION_DROPOUT
        self.attn_logit_softcapping = case.softcap


def stand_in(case: ICase, sinks: "Tensor | None", name: str = "attn_ledger_check", declared_sinks: bool = False,
             dtype: Any = None) -> Any:
    """The ``module`` argument: an ``nn.Module`` with what a decoder layer's attention has.

    ``num_key_value_groups`` only where the case groups heads (GPT-2, BERT and T5 have none);
    ``is_causal`` True; ``training`` as the case; ``scaling``, ``head_dim``, ``layer_idx``,
    ``attention_dropout``, ``sliding_window``, ``config`` (with ``sliding_window``), and, for a function
    that declares sinks, ``sinks`` equal to the ``s_aux`` passed: in a case without sinks, a logit of
    -inf per head, which weighs nothing (gpt-oss's eager reads ``module.sinks`` in every call).
    """
    import torch

    module = torch.nn.Module()
    if case.hkv != case.h:
        module.num_key_value_groups = case.groups
    module.is_causal = True
    module.train(case.train is not None)
    module.scaling = case.effective_scaling
    module.head_dim = case.d
    module.layer_idx = 0
    module.attention_dropout = ATTENTION_DROPOUT if case.train is None else case.train
    module.sliding_window = case.window
    module.config = _Config(case, name)
    if sinks is not None:
        module.sinks = sinks  # gpt-oss's eager reads module.sinks, others s_aux
    elif declared_sinks:
        module.sinks = torch.full((case.h,), float("-inf"), dtype=dtype)  # no sink: exp(-inf) adds nothing
    return module


def attention_mask(case: ICase, dtype: Any, device: Any = None) -> "Tensor | None":
    """The mask transformers gives a layer for this case, from its own mask functions."""
    from transformers import masking_utils as mu

    if case.mask == "none":
        return None
    fn = mu.causal_mask_function if case.window is None else mu.sliding_window_causal_mask_function(case.window)
    common = dict(batch_size=case.b, q_length=case.tq, kv_length=case.tk, q_offset=case.tk - case.tq, kv_offset=0,
                  mask_function=fn, attention_mask=padding_mask(case, device), device=device)
    if case.mask == "sdpa":
        return mu.sdpa_mask(local_size=case.window, allow_is_causal_skip=True, **common)
    if case.mask == "flex":  # a BlockMask, from flex's create_block_mask (compiled)
        import warnings

        # torch deprecates the _compile=True masking_utils passes, and its compiler's first import deprecates
        # torch.jit names of its own: warnings of the tool's call into libraries, never of the user's code
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return mu.flex_attention_mask(**common)
    return mu.eager_mask(dtype=dtype, **common)


def call_kwargs(case: ICase, passes: list[str], sinks: "Tensor | None") -> dict[str, Any]:
    """The keyword arguments, as the families pass them (only the declared features)."""
    kw: dict[str, Any] = {"dropout": 0.0 if case.train is None else case.train, "scaling": case.effective_scaling}
    if "window" in passes:
        kw["sliding_window"] = case.window  # Mistral and gpt-oss pass it; Llama passes none
    if "softcap" in passes:
        kw["softcap"] = case.softcap  # Gemma 2
    if "sinks" in passes:
        kw["s_aux"] = sinks  # gpt-oss
    return kw


def interface_call(fn: Callable[..., Any], query: "Tensor", key: "Tensor", value: "Tensor", *,
                   interface: dict[str, Any], sinks: "Tensor | None" = None) -> Any:
    """Call ``fn`` as a layer does; return its output, or its weights (``interface["returns"]``)."""
    import torch

    case = parse_icase(interface["case"])
    passes = list(interface.get("passes", ()))
    passed_sinks = sinks if "sinks" in passes else None
    module = stand_in(case, passed_sinks, declared_sinks=bool(interface.get("sinks_declared")), dtype=query.dtype)
    mask = attention_mask(case, query.dtype, query.device)
    got = fn(module, query, key, value, mask, **call_kwargs(case, passes, passed_sinks))
    out, weights = (got[0], got[1] if len(got) > 1 else None) if isinstance(got, (tuple, list)) and got else (got, None)
    if interface.get("returns") == "weights":
        return weights if isinstance(weights, torch.Tensor) else query.new_empty(0)
    return out


class InterfaceAdapter:
    """``fn`` behind the kernel driver's ``(q, k, v, **kw)`` call (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, q: "Tensor", k: "Tensor", v: "Tensor", **kw: Any) -> Any:
        return interface_call(self.fn, q, k, v, **kw)


def layer_call(case_id: str, passes: Iterable[str] = (), seed: int = 0,
               sinks_declared: bool = False) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(module, (query, key, value, attention_mask), kwargs)`` of one case, exactly as the check calls the
    function: ``fn(module, *args, **kwargs)`` reproduces it."""
    from attn_ledger.probes.interface.cases import case_tensors

    require_transformers()
    case = parse_icase(case_id)
    t = case_tensors(case, seed)
    on = list(passes)
    sinks = t.get("sinks") if "sinks" in on else None
    mask = attention_mask(case, t["query"].dtype)
    module = stand_in(case, sinks, declared_sinks=sinks_declared, dtype=t["query"].dtype)
    return module, (t["query"], t["key"], t["value"], mask), call_kwargs(case, on, sinks)
