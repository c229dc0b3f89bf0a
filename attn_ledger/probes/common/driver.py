"""The fixed driver that calls a user's kernel and captures what the call gave back: raw tensors and plain facts.

It judges nothing. In a worker (:mod:`attn_ledger.runner.worker`) it is the only code that touches the
user's function: the parent sends the inputs, the driver calls the function on copies of them
and sends back the output, the copies as the call left them, the gradients of the backward
pass, and facts a check reads as a call's outcome (it raised X, it returned a list, the output
has no ``grad_fn``). The parent compares, computes the references and decides every check.

User code runs in the driver's process and can patch the driver too. What that can fake is
limited to these raw tensors and facts: the numbers a correct kernel would have returned, never
a verdict, a reference or a tolerance. ``--in-process`` and the pytest helpers run the driver in
the tool's own process, by design, and are not protected this way.

What comes back is plain: a tensor subclass whose behaviour lives in ``__torch_function__`` is
turned into a ``torch.Tensor`` before anything reads it (``as_subclass`` with torch functions
disabled, so the subclass cannot answer for itself); a ``__torch_dispatch__`` wrapper is
materialised where torch offers a way (DTensor's ``full_tensor()``), else the call is reported as
returning what no check can read, naming the type.

Global state is watched: the default dtype, grad mode and the deterministic flags after each call,
and which ``torch.*``, ``torch.Tensor.*`` and ``torch.nn.functional.*`` callables are no longer the
objects they were before the user's file was imported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.errors import first_line
from attn_ledger.guard import UserCodeError, user_call

if TYPE_CHECKING:
    from torch import Tensor

INPUTS = ("q", "k", "v", "allow_mask")
_SENDABLE = ("float16", "bfloat16", "float32", "float64", "bool", "int8", "int16", "int32", "int64", "uint8")


@dataclass
class Called:
    """What one call gave back: raw tensors by name and facts as plain data (JSON-ready).

    Tensors: ``out``; ``q``, ``k``, ``v``, ``allow_mask`` as the call left the copies it was given;
    after a backward pass ``dq``, ``dk``, ``dv`` (those the output does not depend on are absent).
    Facts: ``error`` (how the call ended when it did not return a tensor), ``subclass`` (the type
    returned, when not a plain tensor), ``grad`` (the with-grad call: ``grad_fn``, ``raised``,
    ``backward_raised``, ``unused``), ``state`` (global state changes, see :func:`state_changes`).
    """

    tensors: dict[str, "Tensor"] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


# --- global state -------------------------------------------------------------------------------


_FOLLOW_FLAGS = {"torch.Storage"}  # rebound by torch.set_default_dtype: reported as the default dtype


def snapshot() -> dict[str, Any]:
    """The global state a call could change: flags, and the identity of torch's public callables."""
    import torch
    import torch.nn.functional as F

    ids = {}
    for prefix, space in (("torch.", torch), ("torch.nn.functional.", F)):
        for name, obj in list(vars(space).items()):
            if not name.startswith("__") and callable(obj) and prefix + name not in _FOLLOW_FLAGS:
                ids[prefix + name] = id(obj)
    for name in dir(torch.Tensor):  # inherited methods too: a patch shadows TensorBase's in Tensor's own dict
        obj = getattr(torch.Tensor, name, None)
        if not name.startswith("__") and callable(obj):
            ids["torch.Tensor." + name] = id(obj)
    return {"flags": _flags(), "ids": ids}


def _flags() -> dict[str, Any]:
    import torch

    return {"default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "grad_enabled": torch.is_grad_enabled(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic)}


def state_changes(before: dict[str, Any], callables: bool = True) -> dict[str, Any]:
    """What differs from ``before``: ``{"flags": {name: [before, after]}, "replaced": [names]}`` (empty parts
    left out); ``callables`` False compares the flags only (a few microseconds, against about 3 ms)."""
    after = snapshot() if callables else {"flags": _flags(), "ids": {}}
    flags = {n: [before["flags"][n], v] for n, v in after["flags"].items() if before["flags"].get(n) != v}
    replaced = sorted(n for n, i in after["ids"].items() if n in before["ids"] and before["ids"][n] != i)
    return _state(flags, replaced)


def _state(flags: dict[str, Any], replaced: list[str]) -> dict[str, Any]:
    """Changed flags and replaced callables as one record, empty parts left out."""
    return {k: v for k, v in (("flags", flags), ("replaced", replaced)) if v}


# --- what a call returned -------------------------------------------------------------------------


def plain_output(out: Any) -> tuple["Tensor | None", dict[str, Any]]:
    """``out`` as a plain, dense ``torch.Tensor``, and facts: ``subclass`` (its type, if it was one) or
    ``error`` (why no check can read it: not a tensor, sparse, meta, an unmaterialisable wrapper)."""
    import torch

    if not isinstance(out, torch.Tensor):
        name = type(out).__name__
        return None, {"error": _problem(f"returned {name}, expected a Tensor [B, Nh, Tq, Dv]", returned=name)}
    facts: dict[str, Any] = {}
    cls = type(out)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        facts["subclass"] = type_name(cls)
        out, problem = _materialised(out, cls)
        if problem is not None:
            return None, {**facts, "error": problem}
    if out.layout != torch.strided:
        layout = str(out.layout).removeprefix("torch.")
        return None, {**facts, "error": _problem(f"returned a tensor with layout {layout}, expected a dense (strided) "
                                                 "Tensor", layout=layout)}
    if out.is_meta:
        return None, {**facts, "error": _problem("returned a tensor on the meta device, which holds no values to check",
                                                 device="meta")}
    dtype = str(out.dtype).removeprefix("torch.")
    if dtype not in _SENDABLE:
        return None, {**facts, "error": _problem(f"returned a {dtype} tensor, expected a float Tensor", dtype=dtype)}
    return out, facts


def _materialised(out: "Tensor", cls: type) -> tuple["Tensor | None", dict[str, Any] | None]:
    """A subclass instance as a plain tensor, or the problem that names why it cannot be one."""
    import torch

    name = type_name(cls)
    wrapper = getattr(cls, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)
    if wrapper:
        full = getattr(out, "full_tensor", None)  # DTensor: gather the shards
        if callable(full):
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = full()
            except Exception as exc:  # the subclass's own code
                return None, _problem(f"returned a {name}, whose full_tensor() raised {type(exc).__name__}: {first_line(exc)}",
                                      returned=name)
            if type(out) is torch.Tensor:
                return out, None
            return _materialised(out, type(out)) if type(out) is not cls else (None, _unreadable(name))
        return None, _unreadable(name)
    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.as_subclass(out, torch.Tensor), None


def type_name(cls: type) -> str:
    """``module.Name``; a class defined in the user's file (imported under a name of the tool's) is ``Name``."""
    module = cls.__module__ or ""
    return cls.__qualname__ if module.startswith("_attn_ledger_user_") or module == "__main__" else f"{module}.{cls.__qualname__}"


def _unreadable(name: str) -> dict[str, Any]:
    return _problem(f"returned a {name}, a __torch_dispatch__ wrapper subclass that torch offers no way to "
                    "materialise as a plain Tensor", returned=name)


def _problem(text: str, **data: Any) -> dict[str, Any]:
    return {"kind": "returned", "text": text, "data": data}


def _error_facts(exc: Exception) -> dict[str, Any]:
    """How a call ended that raised: a :class:`UserCodeError` (exit, time limit) or an ordinary exception."""
    if isinstance(exc, UserCodeError):
        return {"kind": "user_code", "text": str(exc), "what": exc.what, "data": _plain(exc.data)}
    bases = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    at_call = tb is not None and tb.tb_frame.f_code in (call_forward.__code__, call_with_grad.__code__)
    return {"kind": "raised", "type": type(exc).__name__, "bases": bases, "at_call": at_call,
            "message": first_line(exc)}


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in data.items()}


# --- the calls ------------------------------------------------------------------------------------


TENSOR_KEYWORDS = ("allow_mask", "sinks")
"""The keyword arguments that carry tensors: copied for each call and compared after it."""


def _copies(q: "Tensor", k: "Tensor", v: "Tensor", kw: dict[str, Any]) -> tuple[list["Tensor"], dict[str, Any]]:
    kw = dict(kw)
    for name in TENSOR_KEYWORDS:
        if kw.get(name) is not None:
            kw[name] = kw[name].clone()
    return [q.clone(), k.clone(), v.clone()], kw


def _after(qkv: list["Tensor"], kw: dict[str, Any]) -> dict[str, "Tensor"]:
    """The copies the call was given, as it left them (detached: a leaf's values, not its graph)."""
    after = {n: t.detach() for n, t in zip(INPUTS, qkv)}
    for name in TENSOR_KEYWORDS:
        if kw.get(name) is not None:
            after[name] = kw[name]
    return after


def call_forward(fn: Callable[..., Any], q: "Tensor", k: "Tensor", v: "Tensor", kw: dict[str, Any], what: str,
                 grad_mode: bool = False) -> Called:
    """Call ``fn(q, k, v, **kw)`` on copies, with grad disabled (or enabled, inputs not requiring grad)."""
    import torch

    qkv, kw = _copies(q, k, v, kw)
    try:
        with torch.set_grad_enabled(grad_mode), user_call(what):
            out = fn(*qkv, **kw)
    except Exception as exc:
        return Called(_after(qkv, kw), {"error": _error_facts(exc)})
    plain, facts = plain_output(out)
    tensors = _after(qkv, kw)
    if plain is not None:
        tensors["out"] = plain.detach()
    return Called(tensors, facts)


@functools.lru_cache(maxsize=None)
def warm_autograd() -> None:
    """Run one tiny backward pass: torch imports about 2 s of modules on the first one with a given output
    gradient (as every kernel's backward here has), which must not be charged to the user's first backward
    against its time limit. Grad is enabled explicitly: the user's file may have disabled it at import."""
    import torch

    with torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        torch.autograd.grad(x * x, x, torch.ones(2))  # a non-scalar output with its gradient given, as below


def call_with_grad(fn: Callable[..., Any], q: "Tensor", k: "Tensor", v: "Tensor", kw: dict[str, Any],
                   d_out: "Tensor", what: str) -> Called:
    """Call ``fn`` with grad enabled on copies of q, k, v that require grad, then differentiate its output
    against ``d_out``. Facts under ``grad``: ``raised`` (the call raised an ordinary exception), ``grad_fn``
    (whether the output carries one), ``backward_raised``, ``unused`` (inputs the output does not depend on)."""
    import torch

    warm_autograd()
    qkv, kw = _copies(q, k, v, kw)
    leaves = [t.detach().requires_grad_(True) for t in qkv]
    call = f"{what} with inputs that require grad"
    try:
        with torch.enable_grad(), user_call(call):
            out = fn(*leaves, **kw)
    except UserCodeError as exc:
        return Called(_after(leaves, kw), {"error": _error_facts(exc)})
    except Exception as exc:
        return Called(_after(leaves, kw), {"grad": {"raised": _error_facts(exc)}})
    with torch._C.DisableTorchFunctionSubclass():  # a subclass does not answer for its own graph
        grad = {"grad_fn": isinstance(out, torch.Tensor) and out.grad_fn is not None and out.requires_grad}
    plain, facts = plain_output(out)
    if plain is None:
        return Called(_after(leaves, kw), facts)
    tensors = {**_after(leaves, kw), "out": plain.detach()}
    facts["grad"] = grad
    if not grad["grad_fn"] or tuple(plain.shape) != tuple(d_out.shape):
        return Called(tensors, facts)
    try:
        with torch.enable_grad(), user_call(f"the backward pass of {what}"):
            got = torch.autograd.grad(out, leaves, d_out.to(out.dtype), allow_unused=True)
    except UserCodeError as exc:
        return Called(tensors, {**facts, "error": _error_facts(exc)})
    except Exception as exc:
        grad["backward_raised"] = _error_facts(exc)
        return Called(tensors, facts)
    grad["unused"] = [name for name, g in zip(("dq", "dk", "dv"), got) if g is None]
    for name, g in zip(("dq", "dk", "dv"), got):
        if g is not None:
            g, more = plain_output(g)
            if g is not None:
                tensors[name] = g.detach()
    return Called(tensors, facts)


def signature_of(fn: Callable[..., Any]) -> list[list[Any]] | None:
    """The parameters of ``fn`` as ``[name, kind, has_default]`` (kinds as :class:`inspect.Parameter` numbers),
    or None where ``inspect`` finds no signature (a builtin)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [[p.name, int(p.kind), p.default is not inspect.Parameter.empty] for p in sig.parameters.values()]


class KernelTarget:
    """Where a kernel is called: :class:`LocalKernel` here, ``attn_ledger.runner.worker.RemoteKernel`` in a worker.

    Both answer ``forward(q, k, v, kw, what, grad_mode=False, watch=False)`` and
    ``with_grad(q, k, v, kw, d_out, what, watch=False)`` with a :class:`Called` (``watch``: also compare
    torch's callables with the baseline, about 3 ms), and keep in ``state`` the global state changes seen.
    ``__signature__`` is the function's signature, or not a Signature where it has none.
    """

    state: dict[str, Any]

    def ready(self) -> None:
        """Return once the function is loaded where it will be called (raises SetupError if it cannot be)."""


class LocalKernel(KernelTarget):
    """The user's function in this process: ``--in-process``, the pytest helpers, ``check_kernel(fn)``.

    The same driver calls, without a process boundary (nothing here is protected from the user's code).
    ``state`` accumulates the global state changes seen since ``baseline`` (see :func:`merge_state`).
    """

    def __init__(self, fn: Callable[..., Any], baseline: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.baseline = baseline
        self.state: dict[str, Any] = {}

    @property
    def __signature__(self) -> Any:
        import inspect

        try:
            return inspect.signature(self.fn)
        except (TypeError, ValueError):
            return "no signature"  # not a Signature: inspect.signature(self) raises TypeError, as for fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def _watched(self, called: Called, watch: bool) -> Called:
        if self.baseline is not None:
            self.state = merge_state(self.state, state_changes(self.baseline, watch))
        return called

    def forward(self, q: "Tensor", k: "Tensor", v: "Tensor", kw: dict[str, Any], what: str,
                grad_mode: bool = False, watch: bool = False) -> Called:
        return self._watched(call_forward(self.fn, q, k, v, kw, what, grad_mode), watch)

    def with_grad(self, q: "Tensor", k: "Tensor", v: "Tensor", kw: dict[str, Any], d_out: "Tensor",
                  what: str, watch: bool = False) -> Called:
        return self._watched(call_with_grad(self.fn, q, k, v, kw, d_out, what), watch)


def merge_state(seen: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Every change seen so far: a flag keeps its first change, replaced callables are the union."""
    flags = {**new.get("flags", {}), **seen.get("flags", {})}
    replaced = sorted(set(seen.get("replaced", ())) | set(new.get("replaced", ())))
    return _state(flags, replaced)


def load_local(target: str, field: str) -> LocalKernel:
    """Import the user's function here, with the global state snapshotted before the import."""
    from attn_ledger.inputs.userload import load_object

    import torch

    grad = torch.is_grad_enabled()
    baseline = snapshot()
    kernel = LocalKernel(load_object(target, field), baseline)
    kernel.state = state_changes(baseline)  # what the import changed
    torch.set_grad_enabled(grad)  # reported, not kept: this process goes on judging (every call sets its own mode)
    return kernel


# --- tensors as plain data ------------------------------------------------------------------------


def pack(tensors: dict[str, "Tensor"]) -> bytes:
    """Tensors as safetensors bytes (CPU, contiguous, no shared storage): data, never code."""
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").clone(memory_format=_contiguous()) for n, t in tensors.items()})


def unpack(data: bytes, device: Any = None) -> dict[str, "Tensor"]:
    from safetensors.torch import load

    tensors = load(data)
    return tensors if device is None else {n: t.to(device) for n, t in tensors.items()}


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format
