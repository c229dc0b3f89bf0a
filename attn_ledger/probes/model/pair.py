"""Two runs of one model in the worker, block by block, and the replays that localise what each block adds.

The worker builds run A and run B from their targets (:func:`setup`), copies A's weights into B (so both see
the same weights, whatever B's dtype), and keeps beside them the plain computations the bound is made of: A's
model with transformers' eager attention in each run's dtype, and in float64 with SDPA (A's weights, never B's,
which may be rounded already; eager takes its softmax in float32). A ``compare`` request (:func:`run_compare`) runs:

* A's forward on A's inputs, keeping each block's input and output;
* B's forward on B's inputs, keeping the same, and inside each block's ``forward_pre_hook(with_kwargs=True)``
  replaying the block once more on A's input (its real rows moved to B's positions, cast to B's dtype) with
  B's own keyword arguments: B's mask, position ids and position embeddings;
* each plain model's forward on B's inputs, replaying its blocks on the same A input the same way. A padded
  query row that reads no key is not finite in eager attention at float64 (its softmax, taken in float32, sees
  only -inf); the plain runs set such rows to 0 after each block, so that their padded keys carry no NaN into
  the real rows (a real row never reads them) and the whole run stays a reference for the logits.

Under ``--vary target`` run B is another model (a port): A's weights go into it under the names ``--map`` gives
them (:class:`Names`, :func:`matched_weights`), and each of A's blocks is watched in B at the path the same map gives
(:func:`mapped_blocks`); the rest is as for one model run two ways.

Under ``--vary cache`` run B is a prefill, then one forward per token through the model's own cache, each block
replayed on A's rows of the same positions with a cache of the replays' own; under ``--vary packing`` run A is each
sequence apart and run B one forward of them all packed into one row. Either way B's forwards are laid out as one
forward of A's layout, so what follows is the same for every kind.

Every run also keeps the keyword arguments its blocks received (masks, position ids, position embeddings) and
its logits. Only real rows are sent back (``valid`` masks, one per run, the same count per example), and per block
and run which rows, padded ones included, the block made not finite from a finite input; one part per block and
one for the model, as plain facts and raw tensors; nothing here judges.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger.errors import InputError, first_line
from attn_ledger.guard import UserCodeError, user_call

if TYPE_CHECKING:
    from torch import Tensor, nn

Sink = Callable[[dict[str, Any], dict[str, "Tensor"]], None]


@dataclass
class Pair:
    """The worker's state: run A's and run B's models, the plain models by dtype name, and the float64 model."""

    a: Any
    b: Any
    plain: dict[str, Any]
    exact: Any
    blocks: list[str]
    facts: dict[str, Any]
    alone: bool = False  # --vary batch: run A is one forward per example, alone
    cached: bool = False  # --vary cache: run B is a prefill, then one token at a time through the model's cache
    packed: bool = False  # --vary packing: run A is each sequence apart, run B all of them packed into one row
    blocks_b: list[str] | None = None  # B's paths of A's blocks, where B is another model (--vary target)
    decoder: tuple[bool, ...] = ()  # per block: an encoder-decoder's decoder block (its rows: the decoder's tokens)

    @property
    def paths_b(self) -> list[str]:
        return self.blocks if self.blocks_b is None else self.blocks_b


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def blocks_of(model: "nn.Module") -> list[str]:
    """The paths of the blocks that hold the attention modules: the items of the first ``ModuleList`` above each."""
    from torch import nn

    from attn_ledger.probes.model.capture import attention_modules

    lists = {name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    out: list[str] = []
    for path in attention_modules(model):
        parts = path.split(".")
        for j in range(1, len(parts)):
            if ".".join(parts[:j]) in lists:
                block = ".".join(parts[:j + 1])
                if block not in out:
                    out.append(block)
                break
    return out


def decoder_blocks(model: "nn.Module", blocks: list[str], architecture: str) -> tuple[bool, ...]:
    """Per block, whether it sits in an encoder-decoder's decoder (``model.get_decoder()``): its rows are the
    decoder's tokens, not the input's. All False for any other ``architecture``."""
    get = getattr(model, "get_decoder", None)
    if architecture != "encoder-decoder" or not callable(get):
        return tuple(False for _ in blocks)
    try:
        dec = get()
    except (AttributeError, NotImplementedError, TypeError):
        return tuple(False for _ in blocks)
    if dec is None or dec is model:
        return tuple(False for _ in blocks)
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names.get(id(dec))
    if not prefix:
        return tuple(False for _ in blocks)
    return tuple(b.startswith(prefix + ".") for b in blocks)


def row_masks(pair: "Pair", valid: "Tensor", inputs: Mapping[str, Any]) -> list["Tensor"]:
    """Per block, its real rows ``[B, T]``: ``valid`` (the input's real tokens), or for a decoder block every one of
    the decoder's tokens (the decoder input is never padded)."""
    import torch

    dec = inputs.get("decoder_input_ids")
    every = None if dec is None else torch.ones(dec.shape, dtype=torch.bool)
    return [every if (d and every is not None) else valid
            for d in (pair.decoder or tuple(False for _ in pair.blocks))]


def _plain_copy(model: "nn.Module", dtype: str, implementations: tuple[str, ...] = ("eager",)) -> "nn.Module":
    """A's model in ``dtype`` with the first of ``implementations`` transformers sets on it (its own otherwise)."""
    import torch

    twin = copy.deepcopy(model)
    setter = getattr(twin, "set_attn_implementation", None)
    for name in implementations if setter is not None else ():
        try:
            with torch.no_grad():
                setter(name)
            break
        except (ValueError, ImportError, KeyError):
            continue
    experts = getattr(twin, "set_experts_implementation", None)
    if dtype == "float64" and experts is not None and getattr(twin.config, "_experts_implementation", "eager") != "eager":
        try:  # a mixture of experts' default kernel, torch's grouped matmul, takes no float64: the plain loop does
            experts("eager")
        except (ValueError, ImportError, KeyError):
            pass
    return twin.to(_dtype(dtype)).eval()


def setup(args: dict[str, Any], model_facts: Callable[..., dict[str, Any]]) -> tuple[Pair, dict[str, Any]]:
    """Build both runs (user code runs here only), B with A's weights, and the plain models; say what they are
    (``model_facts``: :func:`attn_ledger.probes.model.driver.model_facts`, which imports this module). Under
    ``--vary target`` B is another model, its weights and blocks named through ``--map`` where one is given."""
    import torch

    from attn_ledger.probes.model.targets import Target, build

    ta, tb = Target.from_json(args["target"]), Target.from_json(args["target_b"])
    kind = (args.get("vary") or [""])[0]
    # the map's file is imported before B's factory's: importing one file again after B is built would leave B's
    # classes in a module that sys.modules no longer holds, where the capture looks for its attention function
    names = Names(args.get("map"), kind == "target", field="--map" if args.get("map") else "--vary")
    a, _ = build(ta, head=True)
    if not hasattr(getattr(a, "config", None), "to_json_string"):
        raise InputError(f"target: {ta.source}() returned a {type(a).__name__} without a transformers config, expected "
                         "a transformers model (the tokens compare runs are made from its config)")
    b, _ = build(tb, head=True)
    with torch.no_grad():
        b.load_state_dict(matched_weights(a, b, names))
    da, db = args["dtypes"]
    a, b = a.to(_dtype(da)).eval(), b.to(_dtype(db)).eval()
    pair = pair_of(a, b, ta.label, tb.label, model_facts, alone=kind in ("batch", "packing"), cached=kind == "cache",
                   packed=kind == "packing", names=names if kind == "target" else None)
    return pair, {"units": [0], "model": pair.facts}


class Names:
    """How B names A's weights and blocks: ``--map FILE:FN`` (``spec``; ``FN(name) -> name``, user code: the worker
    only) or a function given (``fn``, :func:`~attn_ledger.probes.model.compare.compare_models`'s ``map``), else as
    A does. Each name goes through :meth:`__call__`, which refuses what is not a name.

    Args:
        other: B is another model (``--vary target``), not A run another way; it changes what errors expect.
        field: the option errors name: the map's (``--map``), or the one that made B where nothing maps (``--vary``).
    """

    def __init__(self, spec: str | None, other: bool = False, fn: Callable[[str], str] | None = None,
                 field: str = "--vary") -> None:
        from attn_ledger.inputs.userload import load_object

        if fn is None and spec is not None:
            fn = load_object(spec, field)
        self.spec, self.other, self.field, self.fn = spec, other, field, fn

    def __call__(self, name: str) -> str:
        if self.fn is None:
            return name
        what = f"{self.spec or getattr(self.fn, '__name__', 'map')}({name!r})"
        try:
            with user_call(what):
                out = self.fn(name)
        except UserCodeError as exc:
            raise InputError(f"{self.field}: {what} {exc}") from None
        except Exception as exc:
            raise InputError(f"{self.field}: {what} raised {type(exc).__name__}: {first_line(exc)}") from None
        if not isinstance(out, str):
            raise InputError(f"{self.field}: {what} returned a {type(out).__name__}, expected B's name for it (a str)")
        return out

    def refused(self, text: str) -> InputError:
        """A one-line error about the names, with what was expected."""
        if self.fn is not None:
            return InputError(f"{self.field}: {text}, expected it to name each of B's weights once, by one of A's")
        if self.other:
            return InputError(f"{self.field}: {text}, expected B to name its weights as A does, or --map FILE:FN")
        return InputError(f"{self.field}: {text}, expected one model run two ways")


def matched_weights(a: "nn.Module", b: "nn.Module", names: Names) -> dict[str, Any]:
    """A's weights (its state dict) under the names ``names`` gives them in B: B's state dict of A's weights.

    Raises:
        InputError: a name B has no weight of, a B weight that no weight of A or two of them fill, a shape that
            differs.
    """
    from attn_ledger.errors import did_you_mean

    sa, sb = a.state_dict(), b.state_dict()
    moved: dict[str, tuple[str, Any]] = {}
    for name, t in sa.items():
        to = names(name)
        if to not in sb:
            raise names.refused(f"A's {name} {'is' if to == name else f'maps to {to!r}, which is'} not a weight "
                                f"of B{did_you_mean(to, list(sb))}")
        if to in moved:
            raise names.refused(f"A's {moved[to][0]} and {name} both map to B's {to}")
        if tuple(sb[to].shape) != tuple(t.shape):
            raise names.refused(f"A's {name} has shape {list(t.shape)} and B's {to} {list(sb[to].shape)}")
        moved[to] = (name, t)
    left = [n for n in sb if n not in moved]
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise names.refused(f"B's {left[0]}{more} is left unfilled: no weight of A maps to it")
    return {to: t for to, (_, t) in moved.items()}


def mapped_blocks(blocks: list[str], b: "nn.Module", names: Names) -> list[str]:
    """B's blocks, each A's block path as ``names`` gives it.

    Raises:
        InputError: a path that is not a module of B.
    """
    from attn_ledger.errors import did_you_mean

    modules = dict(b.named_modules())
    out = []
    for path in blocks:
        to = names(path)
        if to not in modules:
            raise names.refused(f"A's block {path} {'is' if to == path else f'maps to {to!r}, which is'} not a "
                                f"module of B{did_you_mean(to, list(modules))}")
        out.append(to)
    return out


def pair_of(a: "nn.Module", b: "nn.Module", label_a: str, label_b: str, model_facts: Callable[..., dict[str, Any]],
            alone: bool = False, cached: bool = False, packed: bool = False, names: Names | None = None) -> Pair:
    """Two built runs (in eval mode, each in its dtype) and the plain models beside them: A's model with eager
    attention in each run's dtype, and in float64. ``names``: B is another model, its blocks A's as these name them.

    Raises:
        InputError: A has no list of blocks holding its attention modules; a block ``names`` gives that B lacks.
    """
    da, db = (str(next(m.parameters()).dtype).removeprefix("torch.") for m in (a, b))
    plain = {d: _plain_copy(a, d) for d in dict.fromkeys((da, db))}
    # transformers' eager attention takes its softmax in float32; SDPA computes in float64 throughout
    exact = _plain_copy(a, "float64", ("sdpa", "eager"))
    facts = model_facts(a, None, label_a)
    facts["b"] = model_facts(b, None, label_b)
    blocks = blocks_of(a)
    facts["blocks"] = blocks
    if not blocks:
        raise InputError(f"target: {label_a} has no list of blocks holding its attention modules to compare")
    blocks_b = blocks if names is None else mapped_blocks(blocks, b, names)
    if blocks_b != blocks:
        facts["b"]["blocks"] = blocks_b
    decoder = decoder_blocks(a, blocks, facts["architecture"])
    facts["decoder_blocks"] = [i for i, d in enumerate(decoder) if d]
    return Pair(a, b, plain, exact, blocks, facts, alone, cached, packed, blocks_b, decoder)


# --- one forward, watched block by block ------------------------------------------------------------------


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


def _hidden_of(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _with_hidden(args: tuple, kwargs: dict, h: Any) -> tuple[tuple, dict]:
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


@dataclass
class Seen:
    """What one forward kept: per block its input, output, replay output and keyword arguments; the logits."""

    inputs: list[Any]
    outputs: list[Any]
    replays: list[Any]
    kwargs: list[dict[str, Any]]
    logits: Any = None


class Watch:
    """Hooks on a model's blocks while entered: keep what :class:`Seen` holds; where ``replay_on`` gives A's
    inputs, run each block once more on them (``moved(h_a, h_own)`` places A's rows among the block's own)."""

    def __init__(self, model: "nn.Module", blocks: list[str], replay_on: list[Any] | None = None,
                 moved: Callable[[Any, Any], Any] | list[Callable[[Any, Any], Any]] | None = None, padded: Any = None,
                 swap: Callable[[tuple, dict], tuple[tuple, dict]] | None = None) -> None:
        """``moved`` and ``padded`` (rows whose non-finite values are zeroed, ``[B, T]``) are one for every block,
        or a list with one per block (an encoder-decoder's decoder blocks have rows of their own)."""
        n = len(blocks)
        self.model, self.blocks, self.replay_on, self.moved, self.padded = model, blocks, replay_on, moved, padded
        self.swap = swap  # the replay's arguments from the block's own (--vary cache: the replays' own cache)
        self.seen = Seen([None] * n, [None] * n, [None] * n, [{} for _ in range(n)])
        self.handles: list[Any] = []
        self.replaying = False

    def __enter__(self) -> "Watch":
        modules = dict(self.model.named_modules())
        for i, path in enumerate(self.blocks):
            m = modules[path]
            self.handles.append(m.register_forward_pre_hook(self._pre(i, m), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, i: int, module: Any) -> Callable[..., None]:
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            if self.replaying:
                return
            h = _hidden_of(args, kwargs)
            self.seen.inputs[i] = h.detach().clone()
            self.seen.kwargs[i] = {k: kwargs.get(k) for k in ("attention_mask", "position_ids", "position_embeddings")}
            if self.replay_on is not None:
                move = self.moved[i] if isinstance(self.moved, list) else self.moved
                ha = move(self.replay_on[i], h)  # A's real rows at this run's positions, in its dtype
                self.replaying = True
                try:
                    r_args, r_kwargs = _with_hidden(*((args, kwargs) if self.swap is None else self.swap(args, kwargs)), ha)
                    self.seen.replays[i] = _first(module(*r_args, **r_kwargs)).detach().clone()
                finally:
                    self.replaying = False
        return hook

    def _post(self, i: int) -> Callable[..., Any]:
        def hook(mod: Any, args: tuple, out: Any) -> Any:
            if self.replaying:
                return None
            h = _first(out)
            padded = self.padded[i] if isinstance(self.padded, list) else self.padded
            if padded is not None and not h[padded].isfinite().all():
                h = h.clone()  # [B, T, E]
                h[padded] = h[padded].nan_to_num(0.0, 0.0, 0.0)
                out = (h, *out[1:]) if isinstance(out, tuple) else h
            self.seen.outputs[i] = h.detach().clone()
            return out
        return hook


def _forward(model: Any, watch: Watch, inputs: Mapping[str, Any], label: str) -> Seen:
    import torch

    kwargs = {"use_cache": False, **inputs}  # --vary cache's run B passes its cache and use_cache=True
    try:
        with torch.no_grad(), watch, user_call(f"the forward of {label}"):
            out = model(**kwargs)
    except UserCodeError as exc:
        raise InputError(f"the forward of {label} {exc}") from None
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # the model's or a registered function's
        raise _Raised(f"the forward of {label} raised {type(exc).__name__}: {first_line(exc)}") from None
    logits = getattr(out, "logits", None)
    watch.seen.logits = None if logits is None else logits.detach()
    return watch.seen


class _Raised(Exception):
    """A run's forward raised: a finding of the compare, not a setup error."""


def mover(valid_a: "Tensor", valid_b: "Tensor", pads: bool = True) -> Callable[[Any, Any], Any]:
    """``moved(h_a, h_own)``: A's hidden states laid out as this run's, in its dtype: A's real rows at this run's
    real positions, and (``pads``) A's padded rows at its padded ones (both runs have as many of each per example);
    without ``pads`` (A had no padded rows: each example ran alone) the run keeps its own padded rows."""
    def moved(h_a: "Tensor", h_own: "Tensor") -> "Tensor":
        out = h_own.clone()
        out[valid_b] = h_a[valid_a].to(out.dtype)
        if pads:
            out[~valid_b] = h_a[~valid_a].to(out.dtype)
        return out
    return moved


# --- --vary batch: each example alone, laid out as the batch -----------------------------------------------


def alone_inputs(inputs: Mapping[str, Any], valid: "Tensor", example: int) -> dict[str, Any]:
    """One example's forward alone: its real tokens only (no padding), position ids from 0."""
    import torch

    idx = valid[example].nonzero().flatten()  # [n] its real positions
    out: dict[str, Any] = {}
    for name, t in inputs.items():
        if name == "position_ids":
            out[name] = torch.arange(idx.numel())[None]  # [1, n]
        elif name in ("input_ids", "attention_mask"):
            out[name] = t[example, idx][None]  # [1, n]
        else:
            out[name] = t[example:example + 1]
    return out


def _embedding_pairs(kwargs: list[dict[str, Any]], put: Callable[[list[Any]], Any]) -> tuple[Any, Any] | None:
    """The (cos, sin) position embeddings of several forwards' block kwargs, each put together by ``put``; None
    where a forward's block got none."""
    emb = [k.get("position_embeddings") for k in kwargs]
    if any(not isinstance(e, (tuple, list)) or len(e) != 2 for e in emb):
        return None
    return tuple(put([e[j] for e in emb]) for j in (0, 1))


def _placed(parts: list[Any], valid: "Tensor") -> Any:
    """Per-example ``[1, n_b, ...]`` tensors as one ``[B, T, ...]`` (zeros at padded positions), or None where an
    example has none."""
    import torch

    if any(p is None for p in parts):
        return None
    out = parts[0].new_zeros(*valid.shape, *parts[0].shape[2:])
    for bi, p in enumerate(parts):
        out[bi, valid[bi]] = p[0].to(out.dtype)
    return out


def _placed_mask(masks: list[Any], valid: "Tensor") -> Any:
    """Each example's mask, as it allows its own real keys, placed in a ``[B, 1, T, T]`` bool mask of the batch's
    layout (padded pairs blocked); None where an example's block got none."""
    import torch

    b, t = valid.shape
    out = torch.zeros(b, t, t, dtype=torch.bool)
    for bi, m in enumerate(masks):
        n = int(valid[bi].sum())
        allow = allowed(m, torch.ones(1, n, dtype=torch.bool))
        if allow is None:
            return None
        idx = valid[bi].nonzero().flatten()
        out[bi, idx[:, None], idx[None, :]] = allow[0]
    return out[:, None]  # [B, 1, T, T]


def _alone(model: Any, blocks: list[str], inputs: Mapping[str, Any], valid: "Tensor", label: str,
           rows: list["Tensor"] | None = None) -> Seen:
    """Run A of ``--vary batch``: one forward per example alone, what each block kept laid out as the batch (block
    ``i``'s at its real rows ``rows[i]``, ``valid`` where not given)."""
    seen = [_forward(model, Watch(model, blocks), alone_inputs(inputs, valid, e), f"{label} (run A, example {e} alone)")
            for e in range(valid.shape[0])]
    n = len(blocks)
    out = Seen([None] * n, [None] * n, [None] * n, [{} for _ in range(n)])
    for i in range(n):
        here = valid if rows is None else rows[i]
        out.inputs[i] = _placed([s.inputs[i] for s in seen], here)
        out.outputs[i] = _placed([s.outputs[i] for s in seen], here)
        kw = [s.kwargs[i] for s in seen]
        pairs = _embedding_pairs(kw, lambda parts, here=here: _placed(parts, here))
        out.kwargs[i] = {"attention_mask": _placed_mask([k.get("attention_mask") for k in kw], here),
                         "position_ids": _placed([k.get("position_ids") for k in kw], here),
                         "position_embeddings": pairs}
    out.logits = _placed([s.logits for s in seen], valid if rows is None else rows[-1])  # the decoder's, if any
    return out


# --- --vary cache: a prefill, then one token at a time through the model's own cache -----------------------


def cache_steps(seq_len: int, prefill: int) -> list[tuple[int, int]]:
    """``--vary cache``'s forwards as ``(start, end)`` query positions: the prefill, then one per decoded token."""
    return [(0, prefill), *((t, t + 1) for t in range(prefill, seq_len))]


def _cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its cache by (``cache`` in newer transformers, else ``past_key_values``)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: Any) -> Any:
    """An empty cache of the kind the model makes for itself (its sliding layers where its config has them)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _step_inputs(inputs: Mapping[str, Any], start: int, end: int, keyword: str, cache: Any) -> dict[str, Any]:
    """One forward of the decode: tokens ``start..end-1`` with their position ids (as ``generate()`` passes them),
    the padding mask of every token so far, and the model's cache."""
    out: dict[str, Any] = {}
    for name, t in inputs.items():
        if name == "attention_mask":
            out[name] = t[:, :end]  # [B, end]
        elif name in ("input_ids", "position_ids"):
            out[name] = t[:, start:end]  # [B, end - start]
        else:
            out[name] = t
    return {**out, keyword: cache, "use_cache": True}


def _swapped(cache: Any) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """The replay's arguments: the block's own, its cache (by position or by name) replaced by ``cache`` (the
    replays' own, which holds what the block computed from A's inputs, so a replay neither reads nor grows the
    live cache)."""
    from transformers.cache_utils import Cache

    def swap(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (tuple(cache if isinstance(v, Cache) else v for v in args),
                {k: (cache if isinstance(v, Cache) else v) for k, v in kwargs.items()})
    return swap


def _cached(model: Any, blocks: list[str], inputs: Mapping[str, Any], valid: "Tensor", h_a: list[Any],
            label: str) -> Seen:
    """Run B of ``--vary cache``: a prefill, then one forward per token through the model's own cache, each block
    replayed on A's rows of the same positions; what the forwards kept laid out as one forward's."""
    from attn_ledger.probes.model.inputs import prefill_length

    b, t = valid.shape
    prefill = prefill_length(t, (~valid).sum(-1).tolist())
    keyword, live, replays = _cache_keyword(model), _new_cache(model), _new_cache(model)
    seen = []
    for s, e in cache_steps(t, prefill):
        watch = Watch(model, blocks, [h[:, s:e] for h in h_a], lambda ha, h: ha.to(h.dtype), swap=_swapped(replays))
        seen.append(_forward(model, watch, _step_inputs(inputs, s, e, keyword, live), f"{label}, tokens {s}..{e - 1}"))
    return _joined(seen, b, t)


def _cat(parts: list[Any], b: int) -> Any:
    """Per-forward ``[B or 1, n, ...]`` tensors joined along their positions, or None where one is missing."""
    import torch

    if any(p is None for p in parts):
        return None
    return torch.cat([p.expand(b, *p.shape[1:]) for p in parts], 1)


def _joined_mask(masks: list[Any], steps: list[tuple[int, int]], b: int, t: int) -> Any:
    """Each forward's mask as a bool ``[B, 1, T, T]`` over absolute key positions (a cache that keeps only its
    window gives the last keys so far); None where a forward's block got none."""
    import torch

    from attn_ledger.probes.model.capture import _dense_mask

    out = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for m, (s, e) in zip(masks, steps):
        if isinstance(m, dict):  # per layer type
            m = next(iter(m.values()), None)
        kl = m.shape[-1] if isinstance(m, torch.Tensor) else e
        m = _dense_mask(m, b, e - s, kl)
        if m is None:
            return None
        if m.dtype != torch.bool:
            m = m > torch.finfo(m.dtype).min / 2
        out[:, :, s:e, e - kl:e] = m.expand(b, 1, e - s, kl)
    return out


def _joined(seen: list[Seen], b: int, t: int) -> Seen:
    """The decode's forwards as one forward's :class:`Seen`: each block's rows, keyword arguments and the logits
    joined along the positions."""
    n = len(seen[0].inputs)
    sizes = [s.inputs[0].shape[1] for s in seen]
    ends = [sum(sizes[:j + 1]) for j in range(len(sizes))]
    steps = [(e - k, e) for e, k in zip(ends, sizes)]
    out = Seen([None] * n, [None] * n, [None] * n, [{} for _ in range(n)])
    for i in range(n):
        out.inputs[i] = _cat([s.inputs[i] for s in seen], b)
        out.outputs[i] = _cat([s.outputs[i] for s in seen], b)
        out.replays[i] = _cat([s.replays[i] for s in seen], b)
        kw = [s.kwargs[i] for s in seen]
        pairs = _embedding_pairs(kw, lambda parts: _cat(parts, b))
        pos = [k.get("position_ids") for k in kw]
        out.kwargs[i] = {"attention_mask": _joined_mask([k.get("attention_mask") for k in kw], steps, b, t),
                         "position_ids": _cat([None if p is None else p.reshape(-1, p.shape[-1]) for p in pos], b),
                         "position_embeddings": pairs}
    out.logits = _cat([s.logits for s in seen], b)
    return out


# --- --vary packing: every example's real tokens in one row, position ids restarting --------------------------


def packed_inputs(inputs: Mapping[str, Any], valid: "Tensor") -> dict[str, Any]:
    """All examples' real tokens in one row ``[1, N]``, example after example, position ids restarting at 0 for
    each, and no attention mask (transformers finds the documents from the position ids, given no mask and no
    cache)."""
    return {"input_ids": inputs["input_ids"][valid][None], "position_ids": packed_positions(valid)}  # [1, N]


def packed_positions(valid: "Tensor") -> "Tensor":
    """``[1, N]``: each real token's position within its own example, example after example (the packed row's)."""
    return (valid.long().cumsum(-1) - 1)[valid][None]


def packed_documents(valid: "Tensor") -> "Tensor":
    """``[N]``: each real token's example, example after example (the packed row's documents)."""
    import torch

    return torch.repeat_interleave(torch.arange(valid.shape[0]), valid.sum(-1))


def _spread(x: Any, valid: "Tensor") -> Any:
    """A packed ``[1, N, ...]`` tensor laid out as the batch ``[B, T, ...]`` (zeros at padded positions)."""
    if x is None:
        return None
    out = x.new_zeros(*valid.shape, *x.shape[2:])
    out[valid] = x[0]
    return out


def _spread_mask(mask: Any, valid: "Tensor") -> Any:
    """The packed row's mask, each document's own (query, key) block placed in a ``[B, 1, T, T]`` bool mask of the
    batch's layout; None where the block got none. What a document may read of another is not in this layout:
    its block's added error shows it."""
    import torch

    n = int(valid.sum())
    allow = allowed(mask, torch.ones(1, n, dtype=torch.bool))
    if allow is None:
        return None
    b, t = valid.shape
    out = torch.zeros(b, t, t, dtype=torch.bool)
    start = 0
    for bi in range(b):
        idx = valid[bi].nonzero().flatten()
        k = idx.numel()
        out[bi, idx[:, None], idx[None, :]] = allow[0, start:start + k, start:start + k]
        start += k
    return out[:, None]  # [B, 1, T, T]


def _other_documents(mask: Any, valid: "Tensor") -> Any:
    """Per real query row of the packed row (``[N]``, example after example): how many keys of other documents
    its mask lets it read; None where the block got no mask."""
    import torch

    n = int(valid.sum())
    allow = allowed(mask, torch.ones(1, n, dtype=torch.bool))
    if allow is None:
        return None
    doc = packed_documents(valid)  # [N] each row's document
    return (allow[0] & (doc[:, None] != doc[None, :])).sum(-1)  # [N]


def _packed(model: Any, blocks: list[str], inputs: Mapping[str, Any], valid: "Tensor", h_a: list[Any],
            label: str) -> Seen:
    """Run B of ``--vary packing``: one forward of the packed row, each block replayed on A's rows packed the same
    way; what it kept laid out as the batch."""
    def moved(ha: "Tensor", h: "Tensor") -> "Tensor":
        return ha[valid][None].to(h.dtype)  # [1, N, E]

    seen = _forward(model, Watch(model, blocks, h_a, moved), packed_inputs(inputs, valid), label)
    n = len(blocks)
    out = Seen([None] * n, [None] * n, [None] * n, [{} for _ in range(n)])
    for i in range(n):
        out.inputs[i], out.outputs[i], out.replays[i] = (_spread(x[i], valid) for x in
                                                         (seen.inputs, seen.outputs, seen.replays))
        kw = seen.kwargs[i]
        emb = kw.get("position_embeddings")
        pos = kw.get("position_ids")
        out.kwargs[i] = {"attention_mask": _spread_mask(kw.get("attention_mask"), valid),
                         "position_ids": None if pos is None else _spread(pos.reshape(1, -1), valid),
                         "position_embeddings": tuple(_spread(e, valid) for e in emb)
                         if isinstance(emb, (tuple, list)) and len(emb) == 2 else None,
                         "other_documents": _other_documents(kw.get("attention_mask"), valid)}
    out.logits = _spread(seen.logits, valid)
    return out


def run_compare(pair: Pair, inputs_a: Mapping[str, Any], inputs_b: Mapping[str, Any], sink: Sink) -> dict[str, Any]:
    """The runs (see the module docstring); each block's real rows and the model's rows go to ``sink``."""
    valid_a, valid_b = inputs_a["attention_mask"].bool(), inputs_b["attention_mask"].bool()
    blocks, label = pair.blocks, pair.facts["label"]
    rows_a, rows_b = row_masks(pair, valid_a, inputs_a), row_masks(pair, valid_b, inputs_b)  # per block
    try:
        seen_a = _alone(pair.a, blocks, inputs_a, valid_a, label, rows_a) if pair.alone else \
            _forward(pair.a, Watch(pair.a, blocks), inputs_a, f"{label} (run A)")
        moved: Any = [mover(ra, rb, pads=not pair.alone) for ra, rb in zip(rows_a, rows_b)]
        padded = [~rb for rb in rows_b]
        if pair.cached:
            seen_b = _cached(pair.b, pair.paths_b, inputs_b, valid_b, seen_a.inputs, f"{label} (run B)")
        elif pair.packed:
            seen_b = _packed(pair.b, pair.paths_b, inputs_b, valid_b, seen_a.inputs, f"{label} (run B, packed)")
        else:
            seen_b = _forward(pair.b, Watch(pair.b, pair.paths_b, seen_a.inputs, moved), inputs_b,
                              f"{pair.facts['b'].get('label', label)} (run B)")
        plain = {d: _forward(m, Watch(m, blocks, seen_a.inputs, moved, padded), inputs_b, f"plain {d} {label}")
                 for d, m in pair.plain.items()}
        exact = _forward(pair.exact, Watch(pair.exact, blocks, seen_a.inputs, moved, padded), inputs_b,
                         f"float64 {label}")
    except _Raised as exc:
        return {"error": str(exc)}
    _send_model(sink, seen_a, seen_b, plain, exact, rows_a, rows_b)
    for i in range(len(blocks)):
        va, vb = rows_a[i], rows_b[i]
        rows = {"a_out": seen_a.outputs[i][va], "b_out": seen_b.outputs[i][vb],
                "b_replay": seen_b.replays[i][vb], "exact": exact.replays[i][vb]}
        rows.update({f"plain_{d}": s.replays[i][vb] for d, s in plain.items()})
        rows.update(_made_not_finite(seen_a, seen_b, i))
        sink({"part": "block", "index": i, "path": blocks[i], "decoder": bool(pair.decoder and pair.decoder[i])},
             _float(rows))
    return {"blocks": len(blocks)}


def _made_not_finite(seen_a: Seen, seen_b: Seen, i: int) -> dict[str, Any]:
    """Each run's rows ``[B, T]``, padded ones included, where block ``i``'s output is not finite though its input
    is: a padded row nobody reads still carries its NaN into the next block, as a key its mask forbids."""
    out = {}
    for side, seen in (("a", seen_a), ("b", seen_b)):
        h, o = seen.inputs[i], seen.outputs[i]
        if h is not None and o is not None and h.shape == o.shape:
            out[f"{side}_made_nonfinite"] = h.isfinite().flatten(2).all(-1) & ~o.isfinite().flatten(2).all(-1)  # [B, T]
    return out


def _float(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Half tensors as float32 (exactly), to travel; float32 and float64 as they are."""
    import torch

    return {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).contiguous()
            for k, v in tensors.items() if v is not None}


def allowed(mask: Any, valid: "Tensor") -> Any:
    """A mask as a block receives it, as bool ``[B, Tq, Tk]`` (True: the key may be read), or None where the
    block got none (the implementation applies its own rule). An additive mask allows what is not near its
    dtype's lowest value; a flex BlockMask is evaluated."""
    import torch

    from attn_ledger.probes.model.capture import _dense_mask

    if isinstance(mask, dict):  # per layer type
        mask = next(iter(mask.values()), None)
    b, t = valid.shape
    mask = _dense_mask(mask, b, t, t)
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask.expand(b, mask.shape[1], t, t)[:, 0]  # [B, Tq, Tk]


def _send_model(sink: Sink, a: Seen, b: Seen, plain: Mapping[str, Seen], exact: Seen, rows_a: list["Tensor"],
                rows_b: list["Tensor"]) -> None:
    """The model-level part: embeddings (block 0's input), each block's mask, position ids and position
    embeddings as the blocks received them, and the logits (the last block's rows), each run's real rows only
    (``rows_a``, ``rows_b``: per block)."""
    valid_a, valid_b = rows_a[0], rows_b[0]
    tensors: dict[str, Any] = {"a_embed": a.inputs[0][valid_a], "b_embed": b.inputs[0][valid_b],
                               "exact_embed": exact.inputs[0][valid_b]}
    tensors.update({f"plain_{d}_embed": s.inputs[0][valid_b] for d, s in plain.items()})
    masks: list[list[Any]] = []
    for i in range(len(a.inputs)):
        kinds = []
        for side, seen, valid in (("a", a, rows_a[i]), ("b", b, rows_b[i])):
            kw = seen.kwargs[i]
            m = allowed(kw.get("attention_mask"), valid)
            kinds.append(None if m is None else "tensor")
            if m is not None:
                tensors[f"{side}_mask_{i}"] = _real_square(m, valid)
            pos = kw.get("position_ids")
            if pos is not None:
                tensors[f"{side}_pos_{i}"] = pos.expand(valid.shape)[valid]
            if kw.get("other_documents") is not None:  # --vary packing's run B: keys of other documents read
                tensors[f"{side}_cross_{i}"] = kw["other_documents"]
            emb = kw.get("position_embeddings")
            if isinstance(emb, (tuple, list)) and len(emb) == 2:
                tensors[f"{side}_cos_{i}"] = emb[0].expand(*valid.shape, emb[0].shape[-1])[valid]
                tensors[f"{side}_sin_{i}"] = emb[1].expand(*valid.shape, emb[1].shape[-1])[valid]
        masks.append(kinds)
    last_a, last_b = rows_a[-1], rows_b[-1]
    for side, seen, valid in (("a", a, last_a), ("b", b, last_b), ("exact", exact, last_b)):
        if seen.logits is not None:
            tensors[f"{side}_logits"] = seen.logits[valid]
    for d, s in plain.items():
        if s.logits is not None:
            tensors[f"plain_{d}_logits"] = s.logits[last_b]
    sink({"part": "model", "masks": masks, "valid_a": valid_a.tolist(), "valid_b": valid_b.tolist()}, _float(tensors))


def _real_square(m: "Tensor", valid: "Tensor") -> "Tensor":
    """``[B, Tq, Tk]`` bool restricted to real queries and real keys, per example, as ``[N, n_b]`` rows padded with
    False to the longest example: row ``r`` of example ``b`` holds which of its real keys the real query reads."""
    import torch

    rows = []
    width = int(valid.sum(-1).max())
    for bi in range(valid.shape[0]):
        sub = m[bi][valid[bi]][:, valid[bi]]  # [n_b, n_b]
        rows.append(torch.nn.functional.pad(sub, (0, width - sub.shape[1]), value=False))
    return torch.cat(rows)  # [N, n_max]


# --- the first adder's attention, as scan captures it ----------------------------------------------------


class _BlockCalls:
    """A capture sink that passes on only the calls inside one block, each with the mask and bias it shares with
    other blocks' calls resent (the capture sends a shared tensor once, perhaps with a call this sink drops)."""

    def __init__(self, prefix: str, side: str, sink: Sink) -> None:
        self.prefix, self.side, self.sink = prefix, side, sink
        self.shared: dict[str, Any] = {}
        self.sent = 0

    def __call__(self, facts: dict[str, Any], tensors: dict[str, "Tensor"]) -> None:
        for role in ("mask", "bias"):
            ref = facts.get(role)
            if ref is not None and ref.get("new"):
                self.shared[ref["key"]] = tensors[role]
        if not str(facts.get("path") or "").startswith(self.prefix):
            return
        facts, tensors = {**facts, "side": self.side}, dict(tensors)
        for role in ("mask", "bias"):
            ref = facts.get(role)
            if ref is not None:
                facts[role] = {"key": f"{self.side}.{ref['key']}", "new": True}
                tensors[role] = self.shared[ref["key"]]
        self.sent += 1
        self.sink(facts, tensors)


def run_calls(pair: Pair, inputs_a: Mapping[str, Any], inputs_b: Mapping[str, Any], index: int, sink: Sink,
              scan_forward: Callable[[Any, dict[str, Any], Mapping[str, Any], Sink], dict[str, Any]],
              example: int = 0) -> dict[str, Any]:
    """Each run's own forward once more under scan's capture (``scan_forward(model, facts, inputs, sink)``:
    :func:`attn_ledger.probes.model.driver.run_scan`, which imports this module), sending only the attention calls
    inside block ``index``, ``side`` ("a" or "b") added to their facts. Under ``--vary batch`` run A is ``example``
    alone."""
    out: dict[str, Any] = {}
    if pair.alone:  # run A of --vary batch: the example the block's error is worst on, alone
        inputs_a = alone_inputs(inputs_a, inputs_a["attention_mask"].bool(), example)
    for side, model, inputs, facts, paths in (("a", pair.a, inputs_a, pair.facts, pair.blocks),
                                              ("b", pair.b, inputs_b, pair.facts["b"], pair.paths_b)):
        prefix = paths[index] + "."
        keep = _BlockCalls(prefix, side, sink)
        if side == "b" and pair.cached:
            run = _decode_calls(model, facts, inputs, keep, scan_forward)
        elif side == "b" and pair.packed:
            run = scan_forward(model, facts, packed_inputs(inputs, inputs["attention_mask"].bool()), keep)
        else:
            run = scan_forward(model, facts, inputs, keep)
        out[side] = {"calls": keep.sent, "error": (run.get("error") or {}).get("text"),
                     "unseen": [p for _, p in run.get("unseen", []) if str(p).startswith(prefix)]}
    return out


STEP_ENTRIES = 1_000_000
"""A decode step's calls are numbered after every earlier step's: entry ``step * STEP_ENTRIES + entry``."""


def _decode_calls(model: Any, facts: dict[str, Any], inputs: Mapping[str, Any], sink: Sink,
                  scan_forward: Callable[[Any, dict[str, Any], Mapping[str, Any], Sink], dict[str, Any]]
                  ) -> dict[str, Any]:
    """Run B of ``--vary cache`` under scan's capture: the prefill, then one forward per token through the model's
    own cache, each call's facts given ``tokens`` (its first and last query token) and an entry after the earlier
    steps'."""
    from attn_ledger.probes.model.inputs import prefill_length

    valid = inputs["attention_mask"].bool()
    t = valid.shape[1]
    keyword, live = _cache_keyword(model), _new_cache(model)
    out: dict[str, Any] = {"calls": 0, "unseen": []}
    for step, (s, e) in enumerate(cache_steps(t, prefill_length(t, (~valid).sum(-1).tolist()))):
        def tagged(f: dict[str, Any], tensors: dict[str, Any], s: int = s, e: int = e, step: int = step) -> None:
            sink({**f, "tokens": [s, e - 1], "entry": step * STEP_ENTRIES + int(f["entry"])}, tensors)

        run = scan_forward(model, facts, _step_inputs(inputs, s, e, keyword, live), tagged)
        out["calls"] += run.get("calls", 0)
        out["unseen"] += run.get("unseen", [])
        if run.get("error"):
            out["error"] = run["error"]
            break
    return out
