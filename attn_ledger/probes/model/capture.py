"""Watch every attention call of one forward, in the process where the model runs (the worker, for the CLI).

Each call is handed to a ``sink(facts, tensors)`` as soon as it returns, so a caller can judge and
drop it before the next one (:class:`Capture`). How a call is seen:

* **Through the model's own attention interface.** transformers 5 layers call
  ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``. A
  wrapper is registered under the active implementation's own name (so transformers' dispatch checks
  and mask builder, which key on the name, see nothing new) and calls the function it replaced. Eager
  has no registry entry: its function is the call site's default, so the modeling module's
  ``eager_attention_forward`` is replaced for the run. The wrapper sees the module, q and k after
  rotary, v, the exact mask the layer passes (a bool or additive tensor, None, or flex's BlockMask,
  made dense here) and every keyword (``scaling``, ``sliding_window``, ``softcap``, ``s_aux``,
  ``position_bias``), and what the function returned.
* **Projection hooks.** The interface sees q and k after rotary, so a rotary mistake is invisible
  there; the outputs of each attention module's ``q_proj``/``k_proj`` (``q_norm``/``k_norm`` where
  the family normalises heads before rotary) are kept for the judge to rotate itself.
* **The function-mode observer** (:class:`attn_ledger.probes.common.observe.ModuleWatch`) for an
  attention module whose forward bypasses the interface (GPT-2's eager with
  ``reorder_and_upcast_attn``, a model of one's own): one watch per call of the module, so every
  call yields its own core.

In a transformers model the attention modules are the innermost modules whose class name ends in
``Attention``, ``Attn`` or ``MHA`` (``LlamaAttention``, ``BertSelfAttention``, ``T5Attention``); in a model of
one's own, whose names may say nothing, they are found by watching (:func:`discover`): the innermost modules
whose call showed an attention core. Each entry
into one is numbered in order (``entry``); a module whose forward made no interface call is listed
in :attr:`Capture.unseen` with its entry, for a second forward that watches it. Axes: B, Nh query
heads, Nkv kv heads, Tq, Tk, D (q/k width), Dv.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import Tensor, nn

Sink = Callable[[dict[str, Any], dict[str, "Tensor"]], None]

_ATTENTION = re.compile(r"(?i)(attention|attn|mha)$")
_PLAIN_KWARGS = ("scaling", "dropout", "sliding_window", "softcap", "is_causal")
_Q_SOURCES = (("q_norm", "k_norm"), ("q_proj", "k_proj"), ("wq", "wk"))  # the last: Meta's Llama code and its ports


def attention_modules(model: "nn.Module") -> dict[str, "nn.Module"]:
    """``path -> module`` of the innermost modules whose class name ends in Attention, Attn or MHA, in order."""
    found = {name: m for name, m in model.named_modules() if _ATTENTION.search(type(m).__name__)}
    inner = {}
    for name, m in found.items():
        prefix = f"{name}." if name else ""
        if not any(other != name and other.startswith(prefix) for other in found):
            inner[name] = m
    return inner


@dataclass
class _Frame:
    """One entry into an attention module: its number, path, whether it is cross-attention, what it saw."""

    entry: int
    path: str
    cross: bool
    mask: Any = None
    calls: int = 0
    pre: dict[str, "Tensor"] = field(default_factory=dict)
    watch: Any = None


def _hidden(args: tuple, kwargs: dict) -> Any:
    import torch

    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("query"))
    return x if isinstance(x, torch.Tensor) else None


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _dense_mask(mask: Any, b: int, tq: int, tk: int) -> Any:
    """flex_attention's BlockMask as a dense bool ``[B, 1, Tq, Tk]`` (its mask_mod evaluated); tensors as they are."""
    import torch

    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    mod = getattr(mask, "mask_mod", None)
    if mod is None:
        return None
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(mod, b, 1, tq, tk, device="cpu")


class Capture:
    """Watch a model's attention calls while entered; each call goes to ``sink`` as it returns.

    Args:
        model: the model (in the mode the caller chose).
        sink: ``sink(facts, tensors)``; the tensors are the call's own (detached), to judge or copy.
        watch: paths of attention modules to watch with the function-mode observer (a second forward
            for the modules the interface did not see); their interface calls, if any, are not sent.
        interface: whether to wrap the attention interface (False: the observer only, ``watch`` all).

    After the forward, :attr:`unseen` lists ``[entry, path]`` of attention-module calls that made no
    interface call and were not watched, and :attr:`calls` counts what went to the sink.
    """

    def __init__(self, model: "nn.Module", sink: Sink, *, watch: frozenset[str] = frozenset(),
                 interface: bool = True, modules: "dict[str, nn.Module] | None" = None) -> None:
        self.model, self.sink, self.watched, self.interface = model, sink, watch, interface
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = attention_modules(model) if modules is None else modules
        self.frames: list[_Frame] = []
        self.entries = 0
        self.calls = 0
        self.unseen: list[list[Any]] = []
        self.raised_in: dict[str, Any] | None = None  # the attention call a forward raised in, where one did
        self.handles: list[Any] = []
        self.restore: list[Callable[[], None]] = []
        self.shared: dict[int, tuple[str, Any]] = {}  # tensors sent once (a mask every layer shares), by id
        config = getattr(model, "config", None)
        self.implementation = getattr(config, "_attn_implementation", None) if config is not None else None

    # --- entering and leaving ---

    def __enter__(self) -> "Capture":
        try:
            for path, module in self.modules.items():
                self.handles.append(module.register_forward_pre_hook(self._enter_module(path), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave_module(path), with_kwargs=True,
                                                                 always_call=True))
                self._hook_projections(module)
            if self.interface and self.implementation is not None:
                self._wrap_interface()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        while self.restore:
            self.restore.pop()()
        self.handles = []
        self.frames = []

    def _wrap_interface(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        name = self.implementation
        registry = AttentionInterface._global_mapping
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        if name in local or name in registry:
            table = local if name in local else registry
            original = table[name]
            table[name] = self._wrapper(original, "interface")
            self.restore.append(lambda: table.__setitem__(name, original))
            return
        for module_name in sorted({type(m).__module__ for m in self.modules.values()}):
            source = sys.modules.get(module_name)
            original = getattr(source, "eager_attention_forward", None)
            if original is None:
                continue
            setattr(source, "eager_attention_forward", self._wrapper(original, "eager default"))
            self.restore.append(lambda s=source, o=original: setattr(s, "eager_attention_forward", o))

    def _hook_projections(self, module: "nn.Module") -> None:
        children = dict(module.named_children())
        for q_name, k_name in _Q_SOURCES:
            if q_name in children and k_name in children:
                for role, child in (("q_pre", children[q_name]), ("k_pre", children[k_name])):
                    self.handles.append(child.register_forward_hook(self._projection(module, role)))
                return

    def _projection(self, owner: "nn.Module", role: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            frame = self._frame_of(owner)
            if frame is not None and hasattr(out, "detach"):
                frame.pre[role] = out.detach()
        return hook

    def _frame_of(self, module: "nn.Module") -> _Frame | None:
        path = self.names.get(id(module))
        return next((f for f in reversed(self.frames) if f.path == path), None)

    def _enter_module(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            cross = any(kwargs.get(k) is not None for k in ("key_value_states", "encoder_hidden_states"))
            frame = _Frame(self.entries, path, cross, kwargs.get("attention_mask", kwargs.get("mask")))
            self.entries += 1
            self.frames.append(frame)
            if path in self.watched or not self.interface:
                x = _hidden(args, kwargs)
                if x is not None:
                    from attn_ledger.probes.common.observe import ModuleWatch

                    frame.watch = ModuleWatch(module, x).__enter__()
        return hook

    def _leave_module(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            frame = self.frames.pop() if self.frames and self.frames[-1].path == path else None
            if frame is None:
                return
            if frame.watch is not None:
                frame.watch.__exit__(None, None, None)
                self._send_observed(frame, module, frame.watch.observation())
            elif frame.calls == 0:
                self.unseen.append([frame.entry, path])
        return hook

    # --- one call through the interface ---

    def _wrapper(self, original: Callable[..., Any], via: str) -> Callable[..., Any]:
        def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any):
            try:
                out = original(module, query, key, value, attention_mask, *args, **kwargs)
            except BaseException:
                frame = self._frame_of(module)
                self.raised_in = {"path": self.names.get(id(module), type(module).__name__),
                                  "entry": None if frame is None else frame.entry}
                raise
            self._send_interface(module, via, query, key, value, attention_mask, kwargs, out)
            return out

        attention.__wrapped__ = original  # type: ignore[attr-defined]
        return attention

    def _send_interface(self, module: Any, via: str, q: Any, k: Any, v: Any, mask: Any, kwargs: dict, out: Any) -> None:
        import torch

        frame = self._frame_of(module)
        if frame is None:
            entry = self.entries
            self.entries += 1
            path = self.names.get(id(module), type(module).__name__)
        else:
            frame.calls += 1
            entry, path = frame.entry, frame.path
        if self.watched:  # a second forward, for the modules the first did not see: the others' calls were sent
            return
        facts: dict[str, Any] = {
            "entry": entry, "call": 0 if frame is None else frame.calls - 1, "path": path, "via": via,
            "implementation": self.implementation, "cross": bool(frame.cross) if frame else False,
            "layer": getattr(module, "layer_idx", None) if isinstance(getattr(module, "layer_idx", None), int) else None,
            "kwargs": {k: _plain(kwargs[k]) for k in _PLAIN_KWARGS if k in kwargs},
            "kwarg_names": sorted(kwargs), "context_layout": "bthd",
            "module": _module_facts(module)}
        tensors: dict[str, Tensor] = {}
        for name, t in (("q", q), ("k", k), ("v", v)):
            if isinstance(t, torch.Tensor):
                tensors[name] = t.detach()
        context, weights = (out[0], out[1] if len(out) > 1 else None) if isinstance(out, (tuple, list)) and out \
            else (out, None)
        facts["returned"] = {"output": _described(context), "weights": _described(weights)}
        if isinstance(context, torch.Tensor):
            tensors["context"] = context.detach()
        if isinstance(weights, torch.Tensor) and weights.dim() == 4:
            tensors["weights"] = weights.detach()
        b, tq, tk = q.shape[0], q.shape[-2], k.shape[-2]
        facts["mask"] = self._shared_tensor("mask", _dense_mask(mask, b, tq, tk), tensors)
        facts["mask_kind"] = "none" if mask is None else ("tensor" if isinstance(mask, torch.Tensor) else "block")
        facts["bias"] = self._shared_tensor("bias", kwargs.get("position_bias"), tensors)
        sinks = kwargs.get("s_aux")
        if isinstance(sinks, torch.Tensor):
            tensors["sinks"] = sinks.detach()
            facts["sinks_from"] = "s_aux"
        elif isinstance(getattr(module, "sinks", None), torch.Tensor):
            tensors["sinks"] = module.sinks.detach()
            facts["sinks_from"] = "module.sinks"
        if frame is not None:
            tensors.update(_heads_of(frame.pre, q, k))
        self._deliver(facts, tensors)

    def _shared_tensor(self, role: str, t: Any, tensors: dict[str, "Tensor"]) -> Any:
        """Send a tensor every layer shares (the mask, T5's position bias) once: ``{"key": K, "new": bool}``."""
        import torch

        if not isinstance(t, torch.Tensor):
            return None
        seen = self.shared.get(id(t))
        if seen is not None and seen[1] is t:
            return {"key": seen[0], "new": False}
        key = f"{role}{len(self.shared)}"
        self.shared[id(t)] = (key, t)  # held, so that its id is not reused while the forward runs
        tensors[role] = t.detach()
        return {"key": key, "new": True}

    def _deliver(self, facts: dict[str, Any], tensors: dict[str, "Tensor"]) -> None:
        facts["index"] = self.calls
        self.calls += 1
        self.sink(facts, tensors)

    # --- one call seen by the observer ---

    def _send_observed(self, frame: _Frame, module: Any, seen: Any) -> None:
        import torch

        facts: dict[str, Any] = {
            "entry": frame.entry, "call": 0, "path": frame.path, "via": "observer", "implementation": self.implementation,
            "cross": frame.cross, "layer": getattr(module, "layer_idx", None)
            if isinstance(getattr(module, "layer_idx", None), int) else None,
            "kwargs": {}, "kwarg_names": [], "context_layout": "bhtd", "module": _module_facts(module),
            "returned": {}, "observed": {"cores": seen.cores, "failure": seen.failure,
                                         "unexplained": list(seen.unexplained)}}
        core = seen.core
        tensors: dict[str, Tensor] = {}
        mask = frame.mask
        if core is not None:
            tensors.update({"q": core.q, "k": core.k, "v": core.v, "context": core.context})
            if core.weights is not None:
                tensors["weights"] = core.weights
            facts["observed"]["description"] = core.description
            call = core.sdpa or {}
            if call.get("scale") is not None:
                facts["kwargs"]["scaling"] = float(call["scale"])
            if call.get("is_causal"):
                facts["kwargs"]["is_causal"] = True
            if isinstance(call.get("attn_mask"), torch.Tensor):
                mask = call["attn_mask"]
        facts["mask"] = self._shared_tensor("mask", mask if isinstance(mask, torch.Tensor) else None, tensors)
        facts["mask_kind"] = "tensor" if facts["mask"] is not None else "none"
        facts["bias"] = None
        self._deliver(facts, tensors)


def _described(value: Any) -> dict[str, Any] | None:
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return {"type": type(value).__name__}


def _module_facts(module: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {"class": type(module).__name__}
    for name in ("is_causal", "num_key_value_groups", "head_dim", "scaling", "sliding_window", "is_cross_attention"):
        value = getattr(module, name, None)
        if value is None or isinstance(value, (bool, int, float)):
            facts[name] = value
    return facts


def _heads_of(pre: dict[str, "Tensor"], q: "Tensor", k: "Tensor") -> dict[str, "Tensor"]:
    """The projection outputs as ``[B, H, T, D]`` like q and k, where they can be read so. A decode step's k holds
    the cache too: its projection made only the new tokens, its last rows. k's projection may have fewer heads than
    the call's k, where the kv heads were paired with the query heads before the call: it keeps its own."""
    out = {}
    for role, like in (("q_pre", q), ("k_pre", k)):
        t = pre.get(role)
        b, h, tt, d = like.shape
        if t is None or t.dim() not in (3, 4) or t.shape[0] != b or (t.dim() == 4 and t.shape[3] != d) or not d:
            continue
        n, width = t.shape[1], t.shape[2] * (d if t.dim() == 4 else 1)  # [B, n, H' * D] or [B, n, H', D]
        heads = width // d
        fits = width % d == 0 and n == tt and heads == h
        if role == "k_pre":  # a cache's older rows, or kv heads paired before the call
            fits = width % d == 0 and 0 < n <= tt and 0 < heads <= h and h % heads == 0
        if fits:
            out[role] = t.reshape(b, n, heads, d).transpose(1, 2)  # [B, H', n, D]
    return out


def discover(model: "nn.Module", run: Callable[[], Any]) -> dict[str, "nn.Module"]:
    """The attention modules of a model whose class names say nothing: every module is watched through one forward
    (``run``), and those whose call showed an attention core while none of their submodules' did are kept, in order.
    """
    from attn_ledger.probes.common.observe import ModuleWatch

    found: dict[str, int] = {}
    stack: list[Any] = []
    handles = []

    def enter(path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x = _hidden(args, kwargs)
            stack.append(None if x is None else ModuleWatch(module, x).__enter__())
        return hook

    def leave(path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            watch = stack.pop() if stack else None
            if watch is not None:
                watch.__exit__(None, None, None)
                if watch.observation().core is not None:
                    found.setdefault(path, len(found))
        return hook

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(enter(path), with_kwargs=True))
            handles.append(module.register_forward_hook(leave(path), with_kwargs=True, always_call=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.named_modules())
    inner = [p for p in found if not any(o != p and o.startswith(p + ".") for o in found)]
    return {p: modules[p] for p in sorted(inner, key=found.get)}
