"""Watch an attention module compute, without editing its code or relying on its names.

:func:`observe_module` runs ``module(x)`` once under a :class:`torch.overrides.TorchFunctionMode`
that sees every torch function call and follows where the input's values flow. From the
calls themselves it records:

* **projections**: a matmul-family call (``F.linear``, ``matmul``/``@``, ``addmm`` as in
  GPT-2's ``Conv1D``, a two-operand ``einsum``) between a tensor derived from the input
  (directly, or through views and norms, but through no other projection) and a weight that
  is not; its output is kept as ``[B, T, F]`` with the input's positions;
* **the attention core**: ``F.scaled_dot_product_attention`` on tensors derived from the
  projections, or a hand-written core: the first matmul of two projection-derived tensors
  (the scores, ``q @ k^T``), and the matmul whose first operand derives from those scores
  (the mix, ``weights @ v``). Its q, k, v are the tensors that entered it, after any rotary;
  its context is what it returned;
* **the output projection**: the first projection-like call on a tensor derived from the
  core; its input is the context as it entered the output projection.

``nn.MultiheadAttention`` skips its fused fast path whenever a torch function mode is active,
and its functional forward then runs as one opaque call; the observer runs that function's
own code with its dispatch check bypassed, so the slow path's projections and core are seen.

Axes: B examples, T positions of the input, E its width, Nh query heads, Hk/Hv the heads of k
and v as they entered the core (Nh, or Nkv when the core pairs grouped heads itself), Tq/Tk
query and key positions, D the q/k head width, Dv the v head width.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Core", "ModuleWatch", "Observation", "Projection", "observe_module", "probe_bent", "probe_weights",
           "probed_core"]

# What a tensor derives from, as bit flags.
_INPUT, _PROJ, _SCORES, _CORE = 1, 2, 4, 8

# Calls that take projection outputs without being a core: shown only when no core was seen.
_PLUMBING = frozenset({
    "view", "reshape", "transpose", "permute", "contiguous", "chunk", "split", "unbind", "__getitem__", "unflatten",
    "flatten", "squeeze", "unsqueeze", "expand", "repeat", "repeat_interleave", "mul", "add", "sub", "div", "neg",
    "cat", "stack", "to", "type", "float", "double", "half", "bfloat16", "size", "dim", "clone", "detach", "narrow",
    "__mul__", "__add__", "__sub__", "__truediv__", "__rmul__", "__radd__", "__neg__", "expand_as", "type_as",
    "__setitem__", "copy_", "masked_fill", "masked_fill_", "softmax", "dropout", "numel", "__len__", "float_power",
    "linear", "addmm",  # a projection of projected values: not a core, and no reason one was missed
    "__get__",  # attribute reads (shape, dtype, T, an op overload)
})


@dataclass(frozen=True)
class Projection:
    """A matmul-family call of an input-derived tensor with a weight.

    Attributes:
        index: its order among the calls seen.
        op: ``linear``, ``matmul``, ``addmm`` or ``einsum``.
        output: ``[B, T, F]`` its output with the input's positions (a detached copy).
        weight: the weight's qualified parameter name, or ``""`` when it is not a parameter.
        inputs: for the output projection, its input in each position order it may have
            (``[B, T, F_in]`` each): the context as it entered; empty for the others.
    """

    index: int
    op: str
    output: "torch.Tensor | None"
    weight: str
    inputs: tuple["torch.Tensor", ...] = ()


@dataclass(frozen=True)
class Core:
    """The attention computation as the module ran it.

    Attributes:
        kind: ``sdpa`` (``F.scaled_dot_product_attention``) or ``matmul`` (scores, then mix).
        q: ``[B, Nh, Tq, D]``; k: ``[B, Hk, Tk, D]``; v: ``[B, Hv, Tk, Dv]``: as they entered.
        context: ``[B, Nh, Tq, Dv]`` what the core returned.
        weights: ``[B, Nh, Tq, Tk]`` the weights the mix read (``matmul``), None for ``sdpa``
            (see :func:`probe_weights`).
        ordinal: which scores call (``matmul``) or SDPA call (``sdpa``) this core is.
        description: the call(s), for a reader.
        sdpa: for ``sdpa``, the call's own arguments (q, k, attn_mask, is_causal, scale,
            enable_gqa), kept to re-call it with probe values.
        index: the call index where the core began.
    """

    kind: str
    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    context: "torch.Tensor"
    weights: "torch.Tensor | None"
    ordinal: int
    description: str
    sdpa: dict[str, Any] | None
    index: int


@dataclass(frozen=True)
class Observation:
    """What one forward showed.

    Attributes:
        projections: every projection of the input, in call order.
        core: the first attention core, or None when none was seen.
        cores: how many cores were seen (only the first is judged).
        out_projection: the first projection of the core's output, or None.
        unexplained: names of calls that took projection outputs and were not understood
            (a fused kernel, a custom op): why no core was seen.
        mha: True when ``nn.MultiheadAttention``'s functional forward ran (on its slow path).
        failure: why the core's tensors could not be put on ``[B, H, T, D]`` axes, if so.
    """

    projections: tuple[Projection, ...]
    core: Core | None
    cores: int
    out_projection: Projection | None
    unexplained: tuple[str, ...]
    mha: bool
    failure: str = ""


# --- the functions the observer understands ---------------------------------------------

@dataclass(frozen=True)
class _Tables:
    matmul: frozenset
    addmm: frozenset
    linear: frozenset
    einsum: frozenset
    sdpa: frozenset
    mha: frozenset
    plain_mha: Callable[..., Any] | None


_TABLES: _Tables | None = None


def _tables() -> _Tables:
    global _TABLES
    if _TABLES is None:
        import torch
        import torch.nn.functional as F

        t = torch.Tensor
        _TABLES = _Tables(
            matmul=frozenset({torch.matmul, t.matmul, t.__matmul__, torch.mm, t.mm, torch.bmm, t.bmm}),
            addmm=frozenset({torch.addmm, t.addmm, torch.baddbmm, t.baddbmm}),
            linear=frozenset({F.linear}),
            einsum=frozenset({torch.einsum}),
            sdpa=frozenset({F.scaled_dot_product_attention}),
            mha=frozenset({F.multi_head_attention_forward}),
            plain_mha=_undispatched(F.multi_head_attention_forward),
        )
    return _TABLES


def _undispatched(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn``'s own code with its torch-function dispatch check turned off, or None if it has none.

    ``F.multi_head_attention_forward`` begins by handing itself to any active torch function
    mode, which then sees one opaque call. Running the same code with ``has_torch_function``
    answering False lets the mode see the calls inside instead.
    """
    code = getattr(fn, "__code__", None)
    if code is None or "has_torch_function" not in code.co_names:
        return None
    scope = dict(fn.__globals__)
    scope["has_torch_function"] = lambda *args: False
    plain = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    plain.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    return plain


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _einsum_pair(equation: str, a: "torch.Tensor", b: "torch.Tensor"):
    """A two-operand einsum as a batched matmul ``A [..., M, K] @ B [..., K, N]``.

    Returns ``(A, B, swapped)`` (``swapped`` when the second operand plays A), or None when
    the equation is not one batched product with one contracted letter.
    """
    import torch

    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    xa, xb = parts
    contracted = (set(xa) & set(xb)) - set(out)
    m = [c for c in xa if c in out and c not in xb]
    n = [c for c in xb if c in out and c not in xa]
    batch = [c for c in out if c in xa and c in xb]
    if len(contracted) != 1 or len(m) != 1 or len(n) != 1 or len(set(xa)) != len(xa) or len(set(xb)) != len(xb):
        return None
    d = contracted.pop()
    if set(xa) != set(batch) | {m[0], d} or set(xb) != set(batch) | {n[0], d}:
        return None
    bs = "".join(batch)
    if out == bs + m[0] + n[0]:
        return (torch.einsum(f"{xa}->{bs}{m[0]}{d}", a), torch.einsum(f"{xb}->{bs}{d}{n[0]}", b), False)
    if out == bs + n[0] + m[0]:
        return (torch.einsum(f"{xb}->{bs}{n[0]}{d}", b), torch.einsum(f"{xa}->{bs}{d}{m[0]}", a), True)
    return None


# --- the mode -----------------------------------------------------------------------------

class _Observer:
    """Follows the input through one forward (inside the TorchFunctionMode of :func:`_mode`).

    Every tensor produced from traced tensors gets the union of their flags, and ``sidx``,
    the latest scores call it derives from. Strong references keep every traced tensor
    alive for the forward, so an ``id`` is never reused while it is looked up.
    """

    def __init__(self, x: "torch.Tensor", names: dict[int, str], zero_q_of: int | None,
                 q_factor: float = 0.0) -> None:
        self.x = x
        self.b, self.t = x.shape[0], x.shape[1]
        self.names = names
        self.probe_of = zero_q_of
        self.q_factor = q_factor
        self.marks: dict[int, tuple[int, int]] = {id(x): (_INPUT, -1)}
        self.keep: list[Any] = [x]
        self.calls = 0
        self.tables = _tables()
        self.projections: list[Projection] = []
        self.out_projections: list[Projection] = []
        self.scores: dict[int, tuple[int, "torch.Tensor", "torch.Tensor", str]] = {}
        self.mixes: list[tuple[int, int, "torch.Tensor", "torch.Tensor", "torch.Tensor"]] = []
        self.sdpas: list[tuple[int, dict[str, Any], "torch.Tensor"]] = []
        self.unexplained: list[str] = []
        self.mha = False

    def mark(self, t: Any) -> tuple[int, int]:
        return self.marks.get(id(t), (0, -1))

    def tag(self, out: Any, flags: int, sidx: int) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                old, old_s = self.marks.get(id(leaf), (0, -1))
                self.marks[id(leaf)] = (old | flags, max(old_s, sidx))
                self.keep.append(leaf)

    def handle(self, func: Any, args: tuple, kwargs: dict, mode: Any) -> Any:
        import torch
        from torch.utils._pytree import tree_leaves

        tb = self.tables
        if func in tb.mha and tb.plain_mha is not None:
            self.mha = True
            with mode:  # run the functional forward's own code, its inner calls seen
                return tb.plain_mha(*args, **kwargs)
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        flags, sidx = 0, -1
        for leaf in leaves:
            f, s = self.mark(leaf)
            flags |= f
            sidx = max(sidx, s)
        if not flags:
            return func(*args, **kwargs)
        self.calls += 1
        extra, record, args, sidx = self.classify(func, args, kwargs, self.calls, sidx)
        out = func(*args, **kwargs)
        if record is not None:
            record(out)
        name = getattr(func, "__name__", "") or repr(func)
        if flags & _PROJ and not flags & _CORE and record is None and extra == 0 and name not in _PLUMBING \
                and name not in self.unexplained:
            self.unexplained.append(name)
        self.tag(out, flags | extra, sidx)
        if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
            self.tag(args[0], flags, sidx)  # an in-place write carries what was written
        return out

    def classify(self, func: Any, args: tuple, kwargs: dict, index: int, sidx: int):
        """``(extra flags, recorder or None, args, sidx)``; args change only to zero a probed q."""
        import torch

        tb = self.tables
        if func in tb.sdpa:
            extra, record = self.sdpa_call(args, kwargs, index)
            return extra, record, args, sidx
        if func in tb.einsum and len(args) >= 2:
            ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
            if len(ops) == 2 and isinstance(args[0], str) and all(isinstance(o, torch.Tensor) for o in ops):
                return self.einsum_call(args[0], ops, index, args, sidx)
            return 0, None, args, sidx
        if func in tb.linear and len(args) >= 2:
            a, b, op, at = args[0], args[1], "linear", None
        elif func in tb.matmul and len(args) >= 2:
            a, b, op, at = args[0], args[1], "matmul", 0
        elif func in tb.addmm and len(args) >= 3:
            a, b, op, at = args[1], args[2], getattr(func, "__name__", "addmm"), 1
        else:
            return 0, None, args, sidx
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return 0, None, args, sidx
        fa, fb = self.mark(a)[0], self.mark(b)[0]
        if fa and not fb and b.dim() == 2:
            extra, record = self.projection(a, b, op, index)
            return extra, record, args, sidx
        if at is None or not (fa and fb) or (fa | fb) & _CORE or a.dim() < 2 or b.dim() < 2:
            return 0, None, args, sidx
        if fa & _SCORES:
            if a.shape[-1] != b.shape[-2]:
                return 0, None, args, sidx
            return _CORE, self.mix(a, b, index, self.mark(a)[1]), args, sidx
        if fb & _SCORES:
            return 0, None, args, sidx
        if len(self.scores) == self.probe_of:
            args = tuple(self.probed(v) if i == at else v for i, v in enumerate(args))
            a = args[at]
        ordinal = self.scores_call(a, b, op, index)
        return _SCORES, None, args, ordinal

    def probed(self, q: "torch.Tensor") -> "torch.Tensor":
        """The probed scores call's q operand: zeroed, or scaled by ``q_factor`` to bend a soft-cap."""
        import torch

        return torch.zeros_like(q) if self.q_factor == 0.0 else q * self.q_factor

    def projection(self, act: "torch.Tensor", weight: "torch.Tensor", op: str, index: int):
        flags = self.mark(act)[0]
        name = self.names.get(id(weight), "")
        if flags & _CORE:
            def record_out(out: Any) -> None:
                self.out_projections.append(Projection(index, op, None, name, _context_views(act, self.b, self.t)))
            return 0, record_out
        if flags & _PROJ:
            return 0, None

        def record(out: Any) -> None:
            view = _positions(act, out, self.x)
            if view is not None:
                self.projections.append(Projection(index, op, view.detach().clone(), name))
        return _PROJ, record

    def scores_call(self, a: "torch.Tensor", b: "torch.Tensor", op: str, index: int) -> int:
        ordinal = len(self.scores)
        self.scores[ordinal] = (index, a.detach().clone(), b.detach().clone(), op)
        return ordinal

    def mix(self, w: "torch.Tensor", v: "torch.Tensor", index: int, sidx: int) -> Callable[[Any], None]:
        w, v = w.detach().clone(), v.detach().clone()

        def record(out: Any) -> None:
            self.mixes.append((index, sidx, w, v, out.detach().clone()))
        return record

    def einsum_call(self, equation: str, ops: list, index: int, args: tuple, sidx: int):
        import torch

        a, b = ops
        fa, fb = self.mark(a)[0], self.mark(b)[0]
        if bool(fa) != bool(fb):  # one operand traced, the other a weight
            act, weight = (a, b) if fa else (b, a)
            if weight.dim() != 2:
                return 0, None, args, sidx
            extra, record = self.projection(act, weight, "einsum", index)
            return extra, record, args, sidx
        pair = _einsum_pair(equation, a, b)
        if pair is None or (fa | fb) & _CORE:
            return 0, None, args, sidx
        left, right, swapped = pair
        first = b if swapped else a
        f_first, s_first = self.mark(first)
        if f_first & _SCORES:
            return _CORE, self.mix(left, right, index, s_first), args, sidx
        if (fa | fb) & _SCORES:
            return 0, None, args, sidx
        if len(self.scores) == self.probe_of:
            ops = [self.probed(o) if o is first else o for o in ops]
            args = (equation, *ops)
            left, right, _ = _einsum_pair(equation, *ops)
        ordinal = self.scores_call(left, right, "einsum", index)
        return _SCORES, None, args, ordinal

    def sdpa_call(self, args: tuple, kwargs: dict, index: int):
        import torch

        call = dict(zip(_SDPA_ARGS, args))
        call.update(kwargs)
        q = call.get("query")
        if not isinstance(q, torch.Tensor) or not self.mark(q)[0]:
            return 0, None
        kept = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in call.items()}

        def record(out: Any) -> None:
            if isinstance(out, torch.Tensor):
                self.sdpas.append((index, kept, out.detach().clone()))
        return _CORE, record


def _same(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    import torch

    return tuple(a.shape) == tuple(b.shape) and bool(torch.equal(a, b))


def _positions(act: "torch.Tensor", out: Any, x: "torch.Tensor") -> "torch.Tensor | None":
    """A projection's output as ``[B, T, F]``, from how its input is laid out against the module's input.

    ``[B, T, E]`` stays; ``[T, B, E]`` (``nn.MultiheadAttention`` without batch_first's
    transpose undone) is transposed back; ``[B*T, E]`` (GPT-2's ``Conv1D``) is unflattened,
    B-major unless the input equals the T-major flattening. Where B == T, the values decide.
    """
    import torch

    b, t, _ = x.shape
    if not isinstance(out, torch.Tensor):
        return None
    if act.dim() == 3 and out.dim() == 3:
        if tuple(act.shape[:2]) == (b, t) and not (b == t and _same(act.transpose(0, 1), x) and not _same(act, x)):
            return out
        if tuple(act.shape[:2]) == (t, b):
            return out.transpose(0, 1)
        return None
    if act.dim() == 2 and out.dim() == 2 and act.shape[0] == b * t:
        if b > 1 and t > 1 and _same(act, x.transpose(0, 1).reshape(b * t, -1)) and not _same(act, x.reshape(b * t, -1)):
            return out.reshape(t, b, -1).transpose(0, 1)
        return out.reshape(b, t, -1)
    if out.dim() == 3 and tuple(out.shape[:2]) == (b, t):
        return out
    return None


def _context_views(act: "torch.Tensor", b: int, t: int) -> tuple["torch.Tensor", ...]:
    """The output projection's input as ``[B, T, F]`` in each position order it may be in."""
    a = act.detach()
    views = []
    if a.dim() == 3 and tuple(a.shape[:2]) == (b, t):
        views.append(a)
    if a.dim() == 3 and tuple(a.shape[:2]) == (t, b):
        views.append(a.transpose(0, 1))
    if a.dim() == 2 and a.shape[0] == b * t:
        views += [a.reshape(b, t, -1), a.reshape(t, b, -1).transpose(0, 1)]
    return tuple(v.clone() for v in views)


def _mode(observer: _Observer):
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return observer.handle(func, args, kwargs or {}, self)

    return _Mode()


# --- putting tensors on named axes ----------------------------------------------------------

def _heads(t: "torch.Tensor", b: int) -> "torch.Tensor | None":
    """``[*lead, T, D] -> [B, H, T, D]``: the first lead axis is B, or the leads flatten B-major."""
    if t.dim() < 2:
        return None
    lead = tuple(t.shape[:-2])
    n = 1
    for s in lead:
        n *= s
    if not lead:
        return t.reshape(1, 1, *t.shape) if b == 1 else None
    if lead[0] == b:
        return t.reshape(b, n // b, *t.shape[-2:])
    if n % b == 0:
        return t.reshape(b, n // b, *t.shape[-2:])
    return None


def _broadcast(*ts: "torch.Tensor") -> list["torch.Tensor"]:
    import torch

    lead = torch.broadcast_shapes(*(tuple(t.shape[:-2]) for t in ts))
    return [t.expand(*lead, *t.shape[-2:]) for t in ts]


def _matmul_core(obs: _Observer, mix: tuple) -> tuple[Core | None, str]:
    index, sidx, w, v, out = mix
    if sidx not in obs.scores:
        return None, "the weights of a matmul core could not be traced to its scores"
    s_index, a, bt, op = obs.scores[sidx]
    # Each call broadcasts on its own: the scores may be taken on [B*Nh, T, Dh] and viewed as
    # [B, Nh, Tq, Tk] before the weights meet v (transformers' GPT-NeoX eager path, 4.x).
    try:
        a, bt = _broadcast(a, bt)
        w, v = _broadcast(w, v)
    except RuntimeError:
        return None, "the core's operands do not broadcast together"
    parts = [_heads(a, obs.b), _heads(bt.transpose(-2, -1), obs.b), _heads(v, obs.b), _heads(out, obs.b),
             _heads(w, obs.b)]
    if any(p is None for p in parts):
        return None, f"the core's tensors {tuple(a.shape)} cannot be read as [B, H, T, D] with B = {obs.b}"
    if len({p.shape[1] for p in parts}) != 1:
        return None, f"the scores {tuple(a.shape)} and the weights {tuple(w.shape)} have other head counts"
    q, k, vv, ctx, ww = parts
    desc = f"{op} q @ k^T, then weights @ v"
    return Core("matmul", q, k, vv, ctx, ww, sidx, desc, None, s_index), ""


def _sdpa_core(obs: _Observer, call: tuple, ordinal: int) -> tuple[Core | None, str]:
    index, kept, out = call
    q, k, v = kept["query"], kept["key"], kept["value"]
    gqa = bool(kept.get("enable_gqa", False))
    if not gqa:
        try:
            q, k, v = _broadcast(q, k, v)
        except RuntimeError:
            return None, "SDPA's q, k, v do not broadcast together"
    parts = [_heads(q, obs.b), _heads(k, obs.b), _heads(v, obs.b), _heads(out, obs.b)]
    if any(p is None for p in parts):
        return None, f"SDPA's tensors {tuple(q.shape)} cannot be read as [B, H, T, D] with B = {obs.b}"
    flags = [f"{name}={kept[name]}" for name in ("is_causal", "scale", "enable_gqa") if kept.get(name)]
    if kept.get("attn_mask") is not None:
        flags.insert(0, "attn_mask")
    desc = f"F.scaled_dot_product_attention({', '.join(flags)})" if flags else "F.scaled_dot_product_attention"
    return Core("sdpa", *parts, None, ordinal, desc, kept, index), ""


def _parameter_names(module: "nn.Module") -> dict[int, str]:
    names = {id(p): n for n, p in module.named_parameters()}
    names.update({id(t): n for n, t in module.named_buffers()})
    return names


def observe_module(module: "nn.Module", x: "torch.Tensor", *, zero_q_of: int | None = None) -> Observation:
    """Run ``module(x)`` once under no_grad and record what it computed (see the module docstring).

    Args:
        module: in the mode the caller chose (eval for a faithful core).
        x: ``[B, T, E]``.
        zero_q_of: a probe: zero the q operand of this scores call (by ordinal) before it runs.

    Raises:
        Exception: whatever the module's forward raises (the caller turns it into a result).
    """
    import torch

    from attn_ledger.guard import forwarded as is_remote

    if is_remote(module) and zero_q_of is None:  # the parent's stand-in: observed where the module runs
        return module.observe(x)
    obs = _Observer(x, _parameter_names(module), zero_q_of)
    with torch.no_grad(), _mode(obs):
        module(x)
    return _assemble(obs)


class ModuleWatch:
    """The observation of one call of a module inside a larger forward, entered and left by hooks.

    A whole model runs many attention modules; :func:`observe_module` follows one input through one
    forward and judges its first core only. Here each attention module's call is watched on its own,
    from its own input, so every call yields its own core: enter when the module's forward starts
    (a forward pre-hook), leave when it returns (a forward hook), then read :meth:`observation`.
    """

    def __init__(self, module: "nn.Module", x: "torch.Tensor") -> None:
        self.obs = _Observer(x, _parameter_names(module), None)
        self.mode = _mode(self.obs)

    def __enter__(self) -> "ModuleWatch":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)

    def observation(self) -> Observation:
        return _assemble(self.obs)


def probed_core(module: "nn.Module", x: "torch.Tensor", ordinal: int, factor: float | None = None) -> Core | None:
    """A matmul core as one more forward reaches it, its scores call's q operand zeroed (``factor`` None) or
    scaled by ``factor``; None when that forward no longer reaches the scores call ``ordinal``."""
    import torch

    from attn_ledger.guard import forwarded as is_remote

    if is_remote(module):  # the forward runs where the module runs; its core comes back as tensors
        return module.observe(x, ordinal, factor)
    obs = _Observer(x, {}, ordinal) if factor is None else _Observer(x, {}, ordinal, factor)
    with torch.no_grad(), _mode(obs):
        module(x)
    mix = next((m for m in obs.mixes if m[1] == ordinal), None)
    if mix is None:
        return None
    probed, _ = _matmul_core(obs, mix)
    return probed


def _assemble(obs: _Observer) -> Observation:
    candidates = [(m[0], "matmul", m) for m in obs.mixes] + [(s[0], "sdpa", s) for s in obs.sdpas]
    candidates.sort(key=lambda c: c[0])
    core, failure = None, ""
    if candidates:
        _, kind, first = candidates[0]
        core, failure = _matmul_core(obs, first) if kind == "matmul" else _sdpa_core(obs, first, 0)
    out = next((p for p in obs.out_projections if core is None or p.index > core.index), None)
    unexplained = tuple(obs.unexplained) if not candidates else ()
    return Observation(tuple(obs.projections), core, len(candidates), out, unexplained, obs.mha, failure)


def probe_weights(module: "nn.Module", x: "torch.Tensor", core: Core) -> tuple["torch.Tensor", "torch.Tensor"] | None:
    """The core's attention weights, and its weights with q zeroed: ``([B, Nh, Tq, Tk], [B, Nh, Tq, Tk])``.

    With q zeroed every score is 0, so what remains in the weights is the mask and any
    additive position bias. For an SDPA core both come from re-calling SDPA with the module's
    own arguments and the identity as v; for a matmul core the weights are the ones the mix
    read, and the zeroed-q weights come from one more forward with the scores call's q
    operand zeroed. None when that forward no longer reaches the same core.
    """
    import torch
    import torch.nn.functional as F

    if core.kind == "sdpa":
        call = core.sdpa
        assert call is not None
        q, k = call["query"], call["key"]
        tk = k.shape[-2]
        eye = torch.eye(tk, dtype=call["value"].dtype).expand(*k.shape[:-2], tk, tk)  # [*lead, Tk, Tk]
        kw = {n: call[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa") if n in call}
        with torch.no_grad():
            w = F.scaled_dot_product_attention(q, k, eye, dropout_p=0.0, **kw)  # [*lead, Tq, Tk]
            w0 = F.scaled_dot_product_attention(torch.zeros_like(q), k, eye, dropout_p=0.0, **kw)
        if not call.get("enable_gqa"):
            w, w0 = (t.expand(*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), *t.shape[-2:]) for t in (w, w0))
        b = x.shape[0]
        return _heads(w, b), _heads(w0, b)
    probed = probed_core(module, x, core.ordinal)
    if probed is None or probed.weights is None or probed.weights.shape != core.weights.shape:
        return None
    return core.weights, probed.weights


def probe_bent(module: "nn.Module", x: "torch.Tensor", core: Core, factor: float) -> Core | None:
    """The core as it runs with its q scaled by ``factor``: its q, k, v, weights and context.

    Scores far below a soft-cap are bent by its tanh too little to read; scaling the q that
    enters the scores (inside the forward, so no norm undoes it) brings them up to the cap.
    For an SDPA core, SDPA is called again with the module's own arguments and the scaled q
    (the identity as v for the weights); for a matmul core, one more forward runs with the
    scores call's q operand scaled. None when that forward no longer reaches the same core.
    """
    import dataclasses

    import torch
    import torch.nn.functional as F

    if core.kind == "sdpa":
        call = core.sdpa
        assert call is not None
        q, k, v = call["query"] * factor, call["key"], call["value"]
        tk = k.shape[-2]
        eye = torch.eye(tk, dtype=v.dtype).expand(*k.shape[:-2], tk, tk)  # [*lead, Tk, Tk]
        kw = {n: call[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa") if n in call}
        with torch.no_grad():
            w = F.scaled_dot_product_attention(q, k, eye, dropout_p=0.0, **kw)  # [*lead, Tq, Tk]
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, **kw)  # [*lead, Tq, Dv]
        if not call.get("enable_gqa"):
            lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
            q, w = (t.expand(*lead, *t.shape[-2:]) for t in (q, w))
        b = x.shape[0]
        parts = [_heads(q, b), _heads(w, b), _heads(ctx, b)]
        if any(p is None for p in parts) or parts[0].shape != core.q.shape:
            return None
        return dataclasses.replace(core, q=parts[0], weights=parts[1], context=parts[2])
    probed = probed_core(module, x, core.ordinal, factor)
    if probed is None or probed.weights is None or probed.q.shape != core.q.shape \
            or probed.weights.shape != core.weights.shape:
        return None
    return probed
