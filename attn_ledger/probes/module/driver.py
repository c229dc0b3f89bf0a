"""The fixed driver for a user's attention module, and the parent's stand-in that calls it.

``check --module`` is judged in the tool's own process (:class:`~attn_ledger.runner.tasks.ParentTask`).
There the module is a :class:`RemoteModule`: an ``nn.Module`` whose every call is one round trip to
the worker, where the user's module, built by the user's factory, really runs. What crosses back
is raw: the forward's output, the gradients of a backward pass, what the function-mode observation
(:mod:`attn_ledger.probes.common.observe`) saw the forward compute, the tensors of a decode step; tensors as
safetensors bytes, everything else as plain JSON data. The checks (:mod:`attn_ledger.probes.module.check`,
:mod:`attn_ledger.probes.module.core`, :mod:`attn_ledger.probes.module.grads`, :mod:`attn_ledger.probes.module.decode`), the
references, fits and tolerances all run here, on those tensors; a probe that adapts to what it saw
(the core's q zeroed or scaled, the next decode step) is one more round trip.

The worker's side (:func:`setup`, :func:`serve`) judges nothing. User code runs in its process and
can patch it too: what that can fake is limited to these raw tensors and facts.

Backward passes stay where the graph is: a forward run with grad keeps its graph in the worker,
and the stand-in's autograd function asks for the gradients of that graph when the parent's
autograd reaches it; once the parent's graph node is freed, the next request releases the worker's. Parameters are mirrored by name
(zeros of the same shape and dtype), so that their gradients land where the checks read them.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.guard import UserCodeError, current_call, rebuilt_exception, unannounced, user_call

if TYPE_CHECKING:
    from torch import Tensor

GRAPHS_KEPT = 4096
"""At most this many forward graphs stay in the worker; the parent releases each once its own graph is gone."""


# --- observations as plain data ---------------------------------------------------------------------


def _classes() -> dict[str, type]:
    from attn_ledger.probes.module.decode import _Core
    from attn_ledger.probes.common.observe import Core, Observation, Projection

    return {"Observation": Observation, "Projection": Projection, "Core": Core, "DecodeCore": _Core}


def flatten(value: Any, tensors: dict[str, "Tensor"], memo: dict[int, str] | None = None) -> Any:
    """``value`` as JSON-ready data, its tensors moved into ``tensors`` (one key per tensor object)."""
    import dataclasses

    import torch

    memo = {} if memo is None else memo
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        key = memo.get(id(value))
        if key is None:
            key = memo[id(value)] = f"t{len(memo)}"
            tensors[key] = _plain(value)
        return {"__tensor__": key}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = "DecodeCore" if type(value).__name__ == "_Core" else type(value).__name__
        return {"__dataclass__": name, "fields": {f.name: flatten(getattr(value, f.name), tensors, memo)
                                                  for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"__tuple__": [flatten(v, tensors, memo) for v in value]}
    if isinstance(value, list):
        return [flatten(v, tensors, memo) for v in value]
    if isinstance(value, dict):
        return {"__dict__": {str(k): flatten(v, tensors, memo) for k, v in value.items()}}
    return {"__text__": str(value)}


def rebuild(data: Any, tensors: dict[str, "Tensor"]) -> Any:
    """What :func:`flatten` made, rebuilt into the observation classes only (anything else is refused)."""
    import torch

    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [rebuild(v, tensors) for v in data]
    if isinstance(data, dict) and "__tensor__" in data:
        return tensors[data["__tensor__"]]
    if isinstance(data, dict) and "__dtype__" in data:
        dtype = getattr(torch, str(data["__dtype__"]), None)
        return dtype if isinstance(dtype, torch.dtype) else str(data["__dtype__"])
    if isinstance(data, dict) and "__tuple__" in data:
        return tuple(rebuild(v, tensors) for v in data["__tuple__"])
    if isinstance(data, dict) and "__dict__" in data:
        return {k: rebuild(v, tensors) for k, v in data["__dict__"].items()}
    if isinstance(data, dict) and "__text__" in data:
        return str(data["__text__"])
    if isinstance(data, dict) and "__dataclass__" in data:
        cls = _classes().get(str(data["__dataclass__"]))
        if cls is None:
            raise ValueError(f"the worker sent a {data['__dataclass__']!r}, which is not an observation")
        return cls(**{k: rebuild(v, tensors) for k, v in data["fields"].items()})
    raise ValueError(f"the worker sent data of an unknown form: {str(data)[:100]}")


def _plain(t: "Tensor") -> "Tensor":
    """A tensor as a plain ``torch.Tensor`` (a subclass cannot answer for itself), detached."""
    import torch

    if type(t) is not torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            t = torch._C.TensorBase.as_subclass(t, torch.Tensor)
    return t.detach()


def laid_flat(tensors: dict[str, "Tensor"]) -> tuple[dict[str, "Tensor"], dict[str, list[Any]]]:
    """Tensors ready to cross as safetensors, each with its memory layout: a view (a transpose, a chunk of
    a fused projection, an expanded mask) crosses as its whole storage, flat, with its shape, strides and
    offset, so that :func:`relaid` rebuilds the same view and a reduction over it sums in the same order."""
    flat, layouts = {}, {}
    for name, t in tensors.items():
        size = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        if t.is_contiguous() and t.storage_offset() == 0 and size == t.numel():
            flat[name] = t
        else:
            flat[name] = t.detach().as_strided((size,), (1,), 0)
            layouts[name] = [list(t.shape), list(t.stride()), t.storage_offset()]
    return flat, layouts


def relaid(tensors: dict[str, "Tensor"], layouts: dict[str, list[Any]]) -> dict[str, "Tensor"]:
    """The views :func:`laid_flat` sent, rebuilt over the storage that came with them."""
    return {n: t.as_strided(*layouts[n]) if n in layouts else t for n, t in tensors.items()}


# --- the worker's side ------------------------------------------------------------------------------


@dataclass
class Built:
    """The worker's state: the user's module (and decode function), and what later calls refer back to."""

    module: Any
    decode: Any = None
    graphs: "collections.OrderedDict[int, tuple[Any, list[tuple[str, Any]]]]" = field(
        default_factory=collections.OrderedDict)
    caches: dict[int, Any] = field(default_factory=dict)
    copy64: Any = None
    ids: Any = field(default_factory=itertools.count)
    params_sent: list[list[Any]] = field(default_factory=list)


def parameter_facts(module: Any) -> list[list[Any]]:
    """``[name, shape, dtype, requires_grad]`` of each parameter, in ``named_parameters`` order."""
    return [[n, list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
            for n, p in module.named_parameters()]


def module_facts(module: Any) -> dict[str, Any]:
    """What the checks read of the module itself: its parameters and buffers by name, its mode, and any
    ``nn.MultiheadAttention`` inside (its ``batch_first``)."""
    from torch import nn

    return {"params": parameter_facts(module), "buffers": [n for n, _ in module.named_buffers()],
            "training": bool(module.training),
            "mha": [[prefix, bool(sub.batch_first)] for prefix, sub in module.named_modules()
                    if isinstance(sub, nn.MultiheadAttention)]}


def setup(module: Any, decode: Any) -> tuple[Built, dict[str, Any]]:
    """The worker's state for a module built by the user's factory, and its facts as the plan."""
    built = Built(module, decode)
    facts = module_facts(module)
    built.params_sent = facts["params"]
    return built, {"units": [0], "module": facts}


def _error(exc: Exception) -> dict[str, Any]:
    from attn_ledger.probes.common.driver import _error_facts

    return _error_facts(exc)


def _mode(module: Any, training: bool) -> None:
    if bool(module.training) != training:
        module.train(training)


def _output(result: Any) -> tuple["Tensor | None", dict[str, Any]]:
    """A forward's output as a plain tensor, or what it was instead (the parent says it as the local check would)."""
    import torch

    from attn_ledger.probes.common.driver import plain_output

    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        return None, {"returned": type(result).__name__}
    if result.layout != torch.strided:
        return None, {"layout": str(result.layout).removeprefix("torch.")}
    if result.is_meta:
        return None, {"meta": True}
    plain, facts = plain_output(result)
    if plain is None:
        return None, {"problem": facts["error"]["text"], **facts}
    return plain, facts


def _keep(built: Built, y: Any, leaves: list[tuple[str, Any]]) -> int:
    handle = next(built.ids)
    built.graphs[handle] = (y, leaves)
    while len(built.graphs) > GRAPHS_KEPT:
        built.graphs.popitem(last=False)
    return handle


def _release(built: Built, handles: list[int]) -> None:
    for handle in handles:
        built.graphs.pop(handle, None)


def _forward(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    import torch

    module = built.module
    _mode(module, meta["training"])
    x = tensors["x"]
    grad = meta["grad"]
    if grad and meta["x_requires_grad"]:
        x.requires_grad_(True)
    from attn_ledger.probes.module.decode import _CoreObserver

    seen = _CoreObserver() if meta.get("observe_core") else contextlib.nullcontext()
    try:
        with torch.set_grad_enabled(grad), user_call(meta["what"]), seen:
            result = module(x)
    except Exception as exc:
        return {"error": _error(exc)}, {}
    y, facts = _output(result)
    out: dict[str, Any] = {}
    if meta.get("observe_core"):
        facts["core"] = flatten(seen.core, out)
    params = parameter_facts(module)
    if params != built.params_sent:
        built.params_sent = facts["params"] = params
    if y is None:
        return facts, out
    facts["grad_fn"] = bool(grad and y.requires_grad and y.grad_fn is not None)
    if facts["grad_fn"]:
        leaves = [("x", x)] if x.requires_grad else []
        leaves += [("p:" + n, p) for n, p in module.named_parameters() if p.requires_grad]
        facts["handle"] = _keep(built, y, leaves)
    return facts, {**out, "y": y.detach()}


def _backward(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    import torch

    from attn_ledger.probes.common.driver import warm_autograd

    warm_autograd()  # not charged to the user's backward: torch's first one with a given gradient imports ~2 s
    y, leaves = built.graphs[meta["handle"]]
    wanted = [(n, t) for n, t in leaves if n in meta["wrt"]]
    try:
        with torch.enable_grad(), user_call(meta["what"]):
            grads = torch.autograd.grad(y, [t for _, t in wanted], tensors["gy"].to(y.dtype), retain_graph=True,
                                        allow_unused=True)
    except Exception as exc:
        return {"error": _error(exc)}, {}
    return {}, {n: _plain(g) for (n, _), g in zip(wanted, grads) if g is not None}


def _observe(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """The observed forward: the whole observation, or (a probe) the core as the forward reached it again."""
    from attn_ledger.probes.common.observe import observe_module, probed_core

    _mode(built.module, meta["training"])
    try:
        with user_call(meta["what"]):
            if meta["ordinal"] is None:
                seen: Any = observe_module(built.module, tensors["x"])
            else:
                seen = probed_core(built.module, tensors["x"], meta["ordinal"], meta["factor"])
    except Exception as exc:
        return {"error": _error(exc)}, {}
    out: dict[str, Tensor] = {}
    return {"seen": flatten(seen, out)}, out


def _copy64(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """The module's float64 copy, kept here for gradcheck; its trainable floating parameters' values go back."""
    import copy

    import torch

    try:
        with user_call(meta["what"]):
            built.copy64 = copy.deepcopy(built.module).to(torch.float64).eval()
        names = [[n, list(p.shape)] for n, p in built.copy64.named_parameters()
                 if p.requires_grad and p.is_floating_point()]
    except Exception as exc:
        return {"error": _error(exc)}, {}
    return {"params": names}, {"p:" + n: p for n, p in built.copy64.named_parameters()
                               if p.requires_grad and p.is_floating_point()}


def _lower_precision(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    from attn_ledger.probes.module.grads import _lower_precision_inside

    try:
        with user_call(meta["what"]):
            return {"inside": _lower_precision_inside(built.copy64, tensors["x"])}, {}
    except Exception as exc:
        return {"error": _error(exc)}, {}


def _coordinate_call(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"], xs: "Tensor",
                     ps: "Tensor") -> tuple[Any, dict[str, Any], list[tuple[str, Any]]]:
    """The float64 copy called with the chosen coordinates of its input and parameters set to ``xs``, ``ps``."""
    import torch
    from torch.func import functional_call

    x, xi = tensors["x"], tensors["xi"]
    xs_, ps_ = xs.requires_grad_(True), ps.requires_grad_(True)
    names = [n for n, _ in meta["params"]]
    params = dict(built.copy64.named_parameters())
    pis = [tensors[f"i:{n}"] for n in names]
    try:
        with torch.enable_grad(), user_call(meta["what"]):
            xf = x.reshape(-1).scatter(0, xi, xs_).reshape(x.shape)  # [1, 3, E]
            full = {n: params[n].detach().reshape(-1).scatter(0, i, part).reshape(params[n].shape)
                    for n, i, part in zip(names, pis, ps_.split([len(i) for i in pis]))}
            result = functional_call(built.copy64, full, (xf,))
    except Exception as exc:
        return None, {"error": _error(exc)}, []
    y, facts = _output(result)
    return y, facts, [("xs", xs_), ("ps", ps_)]


def _coordinates(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """gradcheck's call of the float64 copy; its graph stays here for the backward."""
    y, facts, leaves = _coordinate_call(built, meta, tensors, tensors["xs"], tensors["ps"])
    if y is None:
        return facts, {}
    return {"handle": _keep(built, y, leaves)}, {"y": y.detach()}


def _coordinates_many(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """gradcheck's finite-difference calls, planned by the parent and run in one request, each one announced
    (so each has its own time limit); the first that does not return a tensor ends the list."""
    out = {}
    for j in range(meta["points"]):
        y, facts, _ = _coordinate_call(built, meta, tensors, tensors[f"xs{j}"], tensors[f"ps{j}"])
        if y is None:
            return {**facts, "at": j}, out
        out[f"y{j}"] = y.detach()
    return {}, out


def _decode(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """One decode step from the cache named (None: empty); the new cache stays here, named by a number."""
    import torch

    from attn_ledger.probes.module.decode import _CoreObserver

    _mode(built.module, meta["training"])
    cache = None if meta["cache"] is None else built.caches[meta["cache"]]
    try:
        with torch.no_grad(), user_call(meta["what"]):
            if meta["observe"]:
                with _CoreObserver() as seen:
                    result = built.decode(built.module, tensors["x_new"], cache)
            else:
                result = built.decode(built.module, tensors["x_new"], cache)
    except Exception as exc:
        return {"error": _error(exc)}, {}
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return {"returned": type(result).__name__}, {}
    y, new_cache = result
    handle = next(built.ids)
    built.caches[handle] = new_cache
    facts: dict[str, Any] = {"cache": handle}
    if not isinstance(y, torch.Tensor):
        return {**facts, "y_type": type(y).__name__}, {}
    if y.layout != torch.strided or y.is_meta:
        return {**facts, "y_kind": "meta" if y.is_meta else "sparse", "y_shape": list(y.shape)}, {}
    out = {"y": _plain(y)}
    if meta["observe"]:
        facts["core"] = flatten(seen.core, out)
    return facts, out


def _seed(built: Built, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    from attn_ledger.seeding import manual_seed

    manual_seed(meta["seed"])
    return {}, {}


HANDLERS: dict[str, Callable[[Built, dict[str, Any], dict[str, "Tensor"]], tuple[dict[str, Any], dict]]] = {
    "forward": _forward, "backward": _backward, "observe": _observe, "copy64": _copy64,
    "lower_precision": _lower_precision, "coordinates": _coordinates, "decode": _decode, "seed": _seed,
    "coordinates_many": _coordinates_many,
}
ANNOUNCED = frozenset({"coordinates_many"})
"""Requests of many calls: each call tells the parent it starts and ends, so each gets the time limit."""


def serve(built: Built, kind: str, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
    """One request of the parent's: the call it names, on the tensors sent; raw tensors and facts back."""
    import torch

    if torch.get_num_threads() != meta["threads"]:  # as the parent runs the check: one thread
        torch.set_num_threads(meta["threads"])
    _release(built, meta.get("release", []))
    tensors = relaid(tensors, meta.get("layouts", {}))
    if kind in ANNOUNCED:
        return HANDLERS[kind](built, meta, tensors)
    with unannounced():  # the parent named the call when it sent it, and keeps its clock from then
        return HANDLERS[kind](built, meta, tensors)


# --- the parent's side ------------------------------------------------------------------------------


def raise_error(error: dict[str, Any]) -> None:
    """Raise in this process what the user's code raised in the worker: an exit or the time limit as a
    :class:`UserCodeError`, an ordinary exception rebuilt with its type name and message."""
    if error.get("kind") == "user_code":
        raise UserCodeError(error["text"], error.get("what"), **error.get("data", {}))
    if error.get("kind") == "returned":
        raise TypeError(error["text"])
    raise rebuilt_exception(error)


class Link:
    """The parent's end of the module driver: one request out, facts and raw tensors back."""

    def __init__(self, sup: Any) -> None:
        self.sup = sup
        self.released: list[int] = []  # graphs the parent no longer holds: the worker drops them on the next request

    def call(self, kind: str, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict[str, Any], dict]:
        import torch

        from attn_ledger.probes.common.driver import pack, unpack

        released, self.released = self.released, []
        flat, layouts = laid_flat(tensors)
        facts, blob = self.sup.call_module(kind, {**meta, "threads": torch.get_num_threads(), "release": released,
                                                  "layouts": layouts}, pack(flat))
        return facts, relaid(unpack(blob), facts.pop("layouts", {}))


class _Release:
    """Held by an autograd node of the parent's: when the node is freed, the worker's graph may go."""

    def __init__(self, link: Link, handle: int) -> None:
        self.link, self.handle = link, handle

    def __del__(self) -> None:
        self.link.released.append(self.handle)


_FUNCTIONS: dict[str, Any] = {}


def _remote_forward() -> Any:
    """The autograd function of a remote forward: its backward asks the worker for the graph's gradients."""
    if "forward" not in _FUNCTIONS:
        import torch

        class RemoteForward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, remote, x, grad, *params):
                y, facts = remote._forward(x, grad, x.requires_grad)
                ctx.remote, ctx.handle = remote, facts.get("handle")
                ctx.names = ["x"] + ["p:" + n for n, p in remote.named_parameters() if p.requires_grad]
                if ctx.handle is None:
                    ctx.mark_non_differentiable(y)
                else:
                    ctx.release = _Release(remote.link, ctx.handle)
                return y

            @staticmethod
            def backward(ctx, gy):
                got = ctx.remote._backward(ctx.handle, gy, ctx.names)
                return (None, got.get("x"), None, *(got.get(n) for n in ctx.names[1:]))

        _FUNCTIONS["forward"] = RemoteForward
    return _FUNCTIONS["forward"]


def _remote_coordinates() -> Any:
    """gradcheck's call of the float64 copy, remote: y [1, 3, E] as a function of the chosen coordinates."""
    if "coordinates" not in _FUNCTIONS:
        import torch

        class RemoteCoordinates(torch.autograd.Function):
            @staticmethod
            def forward(ctx, remote, xs, ps, problem):
                ctx.remote, ctx.problem = remote, problem
                ready = problem.get("ready", {}).get(_key(xs, ps))
                if ready is not None:  # computed ahead (a finite difference): no graph unless one is asked for
                    ctx.handle, ctx.point = None, (xs.detach().clone(), ps.detach().clone())
                    return ready.clone()
                y, handle = remote._coordinates(xs, ps, problem)
                ctx.handle, ctx.release = handle, _Release(remote.link, handle)
                return y

            @staticmethod
            def backward(ctx, gy):
                if ctx.handle is None:  # the call again, with its graph kept this time
                    _, ctx.handle = ctx.remote._coordinates(*ctx.point, ctx.problem)
                    ctx.release = _Release(ctx.remote.link, ctx.handle)
                got = ctx.remote._backward(ctx.handle, gy, ["xs", "ps"],
                                           "backward of the module's float64 copy (gradcheck)")
                return None, got.get("xs"), got.get("ps"), None

        _FUNCTIONS["coordinates"] = RemoteCoordinates
    return _FUNCTIONS["coordinates"]


def _key(xs: "Tensor", ps: "Tensor") -> tuple[bytes, bytes]:
    return xs.detach().cpu().numpy().tobytes(), ps.detach().cpu().numpy().tobytes()


def _stand_in(name: str) -> Any:
    """An object whose type is named ``name``: what the worker says a call returned, for a check that names it."""
    return type(name, (), {})()


def _module_base() -> type:
    from torch import nn

    return nn.Module


def remote_module(link: Link, facts: dict[str, Any]) -> Any:
    """A :class:`RemoteModule` for the module the worker built (``facts`` from :func:`module_facts`)."""
    return _remote_class()(link, facts)


_CLASS: list[type] = []


def _remote_class() -> type:  # long: the stand-in's class body, made on first use so that importing this loads no torch
    if not _CLASS:
        import torch

        class RemoteModule(_module_base()):  # type: ignore[misc]
            """The user's module as the parent sees it: every call is a round trip to the worker.

            ``named_parameters`` yields mirrors (zeros of each parameter's shape and dtype) that
            receive the gradients a backward pass brings back; ``named_buffers`` yields the names
            with empty tensors; ``remote_facts`` holds the rest of what the worker said of the module.
            """

            forwards_user_calls = True  # attn_ledger.guard.forwarded: the checks ask this, not torch

            def __init__(self, link: Link, facts: dict[str, Any]) -> None:
                super().__init__()
                self.link = link
                self.remote_facts = facts
                self.training = bool(facts["training"])
                self.mirrors: dict[str, torch.nn.Parameter] = {}
                self.core_watch: Any = None
                self._mirror(facts["params"])

            def _mirror(self, params: list[list[Any]]) -> None:
                kept = self.mirrors
                self.mirrors = {}
                for name, shape, dtype, requires_grad in params:
                    old = kept.get(name)
                    dt = getattr(torch, dtype, torch.float32)
                    if old is not None and list(old.shape) == shape and old.dtype == dt \
                            and old.requires_grad == requires_grad:
                        self.mirrors[name] = old
                    else:
                        self.mirrors[name] = torch.nn.Parameter(torch.zeros(shape, dtype=dt),
                                                                requires_grad=requires_grad and (dt.is_floating_point or dt.is_complex))

            def train(self, mode: bool = True) -> "RemoteModule":
                self.training = bool(mode)
                return self

            def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
                yield from ((prefix + n, p) for n, p in self.mirrors.items())

            def parameters(self, recurse: bool = True):
                yield from self.mirrors.values()

            def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
                yield from ((prefix + n, torch.empty(0)) for n in self.remote_facts["buffers"])

            def named_modules(self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True):
                yield prefix, self

            def forward(self, x: "Tensor") -> "Tensor":
                grad = torch.is_grad_enabled()
                params = [p for p in self.mirrors.values() if p.requires_grad]
                if not grad or not (x.requires_grad or params):
                    y, facts = self._forward(x, grad, x.requires_grad)
                    if facts.get("handle") is not None:  # no graph here reaches it: the worker may drop it
                        self.link.released.append(facts["handle"])
                    return y
                return _remote_forward().apply(self, x, grad, *params)

            def _request(self, kind: str, meta: dict[str, Any], tensors: dict[str, "Tensor"]) -> tuple[dict, dict]:
                facts, back = self.link.call(kind, {"training": self.training, **meta}, tensors)
                if "error" in facts:
                    raise_error(facts["error"])
                return facts, back

            def _forward(self, x: "Tensor", grad: bool, x_requires_grad: bool) -> tuple["Tensor", dict[str, Any]]:
                from attn_ledger.probes.common.forward import ForwardError

                what = current_call() or f"forward(x) on input {tuple(x.shape)}"
                facts, back = self._request("forward", {"what": what, "grad": grad, "x_requires_grad": x_requires_grad,
                                                        "observe_core": self.core_watch is not None}, {"x": x.detach()})
                if "core" in facts and self.core_watch is not None and self.core_watch.core is None:
                    self.core_watch.core = rebuild(facts["core"], back)
                if "params" in facts:
                    self._mirror(facts["params"])
                if "returned" in facts:
                    name = facts["returned"]
                    raise ForwardError(f"forward returned {name}, expected a tensor [B, T, E] or a tuple starting with one",
                                       returned=name)
                if "layout" in facts:
                    raise ForwardError(f"forward returned a tensor with layout {facts['layout']}, expected a dense "
                                       "(strided) tensor [B, T, E]", layout=facts["layout"])
                if "meta" in facts:
                    raise ForwardError("forward returned a tensor on the meta device, which holds no values to compare",
                                       device="meta")
                if "problem" in facts:
                    raise ForwardError(f"forward {facts['problem']}", **facts.get("data", {}))
                return back["y"], facts

            def _backward(self, handle: int, gy: "Tensor", names: list[str], what: str | None = None) -> dict:
                what = what or current_call() or "backward through forward(x)"
                _, back = self._request("backward", {"handle": handle, "wrt": names, "what": what},
                                        {"gy": gy.contiguous()})
                return back

            @contextlib.contextmanager
            def watching_core(self) -> Any:
                """The forwards inside run under the decode check's core observer, in the worker; ``.core`` of
                what this yields is the first attention core seen (:class:`attn_ledger.probes.module.decode._CoreObserver`)."""
                self.core_watch = _Seen()
                try:
                    yield self.core_watch
                finally:
                    self.core_watch = None

            def manual_seed(self, seed: int) -> None:
                """Seed torch's generator in the worker, which the module's forwards draw from."""
                self._request("seed", {"what": "torch.manual_seed", "seed": seed}, {})

            # --- the observation and its probes (attn_ledger.probes.common.observe) ---

            def observe(self, x: "Tensor", ordinal: int | None = None, factor: float | None = None) -> Any:
                what = current_call() or f"forward(x) observed on input {tuple(x.shape)}"
                facts, back = self._request("observe", {"what": what, "ordinal": ordinal, "factor": factor},
                                            {"x": x})
                return rebuild(facts["seen"], back)

            # --- gradcheck's float64 copy (attn_ledger.probes.module.grads) ---

            def float64_copy(self) -> list[tuple[str, "Tensor"]]:
                what = current_call() or "copying the module to float64 (gradcheck)"
                facts, back = self._request("copy64", {"what": what}, {})
                return [(n, back["p:" + n]) for n, _ in facts["params"]]

            def lower_precision_inside(self, x: "Tensor") -> bool:
                what = current_call() or "forward of the module's float64 copy (gradcheck)"
                facts, _ = self._request("lower_precision", {"what": what}, {"x": x})
                return bool(facts["inside"])

            def coordinates(self, xs: "Tensor", ps: "Tensor", problem: dict[str, Any]) -> "Tensor":
                return _remote_coordinates().apply(self, xs, ps, problem)

            def ahead(self, points: list[tuple["Tensor", "Tensor"]], problem: dict[str, Any]) -> None:
                """gradcheck's finite-difference points, called in one request; :func:`_remote_coordinates`
                then finds their outputs ready. A point that raises is left to be called (and to raise) again."""
                tensors = {"x": problem["x"], "xi": problem["xi"],
                           **{f"i:{n}": i for (n, _), i in zip(problem["params"], problem["pis"])}}
                for j, (xs, ps) in enumerate(points):
                    tensors[f"xs{j}"], tensors[f"ps{j}"] = xs.detach(), ps.detach()
                facts, back = self.link.call("coordinates_many", {
                    "training": self.training, "what": "forward of the module's float64 copy (gradcheck)",
                    "points": len(points), "params": [[n, list(p.shape)] for n, p in problem["params"]]}, tensors)
                if facts.get("error", {}).get("kind") == "user_code":
                    raise_error(facts["error"])
                ready = problem.setdefault("ready", {})
                for j, (xs, ps) in enumerate(points):
                    if f"y{j}" in back:
                        ready[_key(xs, ps)] = back[f"y{j}"]

            def _coordinates(self, xs: "Tensor", ps: "Tensor", problem: dict[str, Any]) -> tuple["Tensor", int]:
                tensors = {"x": problem["x"], "xi": problem["xi"], "xs": xs.detach(), "ps": ps.detach(),
                           **{f"i:{n}": i for (n, _), i in zip(problem["params"], problem["pis"])}}
                facts, back = self._request("coordinates", {"what": "forward of the module's float64 copy (gradcheck)",
                                                            "params": [[n, list(p.shape)] for n, p in problem["params"]]},
                                            tensors)
                if "y" not in back:
                    from attn_ledger.probes.common.forward import first_output

                    first_output(_stand_in(facts.get("returned", "object")))  # raises, naming what came back
                return back["y"], facts["handle"]

            # --- decode steps (attn_ledger.probes.module.decode) ---

            def decode_step(self, x_new: "Tensor", cache: Any, what: str, observe: bool = False) -> tuple[Any, Any]:
                """One call of the user's decode function in the worker: ``((y_new, cache), core)``, with
                stand-ins where it returned something else, for the decode check to name."""
                facts, back = self._request("decode", {"what": what, "observe": observe,
                                                       "cache": None if cache is None else cache.handle}, {"x_new": x_new})
                if "returned" in facts:
                    return _stand_in(facts["returned"]), None
                handle = CacheHandle(facts["cache"])
                if "y_type" in facts:
                    return (_stand_in(facts["y_type"]), handle), None
                if "y_kind" in facts:
                    shape = facts["y_shape"]
                    y = torch.empty(shape, device="meta") if facts["y_kind"] == "meta" else torch.zeros(shape).to_sparse()
                    return (y, handle), None
                core = rebuild(facts["core"], back) if observe else None
                return (back["y"], handle), core

        _CLASS.append(RemoteModule)
    return _CLASS[0]


class _Seen:
    core: Any = None


@dataclass(frozen=True)
class CacheHandle:
    """A decode cache that stays in the worker, named by a number."""

    handle: int


class RemoteDecode:
    """The user's decode function, called in the worker on the module built there."""

    def __call__(self, module: Any, x_new: Any, cache: Any) -> Any:
        return module.decode_step(x_new, cache, current_call() or f"decode(module, x_new {tuple(x_new.shape)}, cache)")[0]


def is_remote(module: Any) -> bool:
    """Whether ``module`` is the parent's stand-in for a module in the worker."""
    from attn_ledger.guard import forwarded

    return forwarded(module)
