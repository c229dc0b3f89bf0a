"""Gradients of a user's attention module: finite, reaching everything, and right.

* ``input_gradient`` (L3): one backward pass of ``out.square().mean()`` in training mode
  reaches the input, finite;
* ``parameter_gradients`` (L3): the same pass gives every trainable parameter a finite
  gradient, each one's norm kept; a parameter with no gradient at all is named in a warning
  (an unused parameter is not wrong in itself), a non-finite gradient fails;
* ``gradcheck`` (L3): :func:`torch.autograd.gradcheck` in float64 on a float64 copy of the
  user's instance, in eval mode, at B = 1 and T = 3, over at most 64 input coordinates and
  64 parameter coordinates (at least one in every parameter while there are at most 64);
  the output is read through four fixed random directions, so one check costs four backward
  passes and two forwards per coordinate instead of a full Jacobian. A module that computes
  in lower precision inside (a float32 softmax or rotary table, as many do) is detected and
  judged with looser differences, stated in the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from attn_ledger import tolerance
from attn_ledger.errors import first_line
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.probes.common.forward import ForwardError, call_forward, first_output, forward_failure, module_forward
from attn_ledger.report import Check, unjudged

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["gradcheck_check", "gradient_checks"]

MAX_COORDINATES = 64
_OUTPUT_DIRECTIONS = 4
_STRICT = tolerance.GRADCHECK
_LOOSE = tolerance.GRADCHECK_FLOAT32_INSIDE  # for modules that round to float32 inside


def _parameter_gradients(module: "nn.Module") -> Check:
    import torch

    missing, nonfinite, norms = [], [], {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            missing.append(name)
            continue
        norms[name] = float(p.grad.detach().to(torch.float64).norm())
        if not bool(torch.isfinite(p.grad).all()):
            nonfinite.append(name)
    count = len(norms) + len(missing)
    if count == 0:
        return unjudged(3, "parameter_gradients", "not_applicable", "the module has no trainable parameters")
    data = {"of": count, "no_gradient": missing, "non_finite": nonfinite, "norms": norms}
    measure = "trainable parameters with a non-finite gradient"
    if nonfinite:
        return Check(3, "parameter_gradients", "fail", measure, len(nonfinite), 0, "<=", data=data)
    if missing:
        return Check(3, "parameter_gradients", "warn", "trainable parameters with no gradient", len(missing), 0, "<=",
                     reason="no gradient reaches them (unused, or cut off by a detach)", data=data)
    return Check(3, "parameter_gradients", "pass", measure, 0, 0, "<=", data=data)


def _input_gradient(g: "torch.Tensor | None") -> Check:
    import torch

    if g is None:
        return Check(3, "input_gradient", "fail", reason="no gradient reached the input (the graph was detached)")
    bad = int((~torch.isfinite(g)).sum())
    if bad:
        return Check(3, "input_gradient", "fail", "non-finite input gradient values", bad, 0, "<=")
    return Check(3, "input_gradient", "pass", "input gradient norm", float(g.norm()))


def gradient_checks(module: "nn.Module", x: "torch.Tensor") -> list[Check]:
    """L3, in training mode: one backward pass of ``out.square().mean()`` reaches the input and every parameter."""
    import torch

    was_training = module.training
    module.train()
    try:
        module.zero_grad(set_to_none=True)
        x_in = x.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            try:
                y = call_forward(module_forward(module), x_in,
                                 what=f"forward(x) in training mode on input {tuple(x.shape)}")  # [B, T, E]
                with user_call("backward through the training-mode forward"):
                    y.square().mean().backward()
            except ForwardError as exc:
                return [forward_failure(3, "input_gradient", exc, "training mode: "),
                        unjudged(3, "parameter_gradients", "not_reached", "the training-mode forward failed")]
            except UserCodeError:
                raise
            except Exception as exc:  # the user's backward may raise anything
                why = f"backward raised {type(exc).__name__}: {first_line(exc)}"
                data = {"exception": type(exc).__name__}
                return [Check(3, "input_gradient", "fail", reason=why, data=data),
                        Check(3, "parameter_gradients", "fail", reason=why, data=data)]
        return [_input_gradient(x_in.grad), _parameter_gradients(module)]
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was_training)


# --- gradcheck -------------------------------------------------------------------------------

def _coordinates(params: list[tuple[str, "torch.Tensor"]], g: "torch.Generator") -> list["torch.Tensor"]:
    """Up to 64 coordinates over the parameters: one in each first (while they number at most 64), the rest at random."""
    import torch

    sizes = [p.numel() for _, p in params]
    total = sum(sizes)
    budget = min(MAX_COORDINATES, total)
    chosen: list[set[int]] = [set() for _ in params]
    order = torch.randperm(len(params), generator=g).tolist()
    for i in order[:budget]:
        chosen[i].add(int(torch.randint(sizes[i], (1,), generator=g)))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for flat in torch.randperm(total, generator=g).tolist():
        if sum(len(c) for c in chosen) >= budget:
            break
        i = max(n for n, s in enumerate(starts) if s <= flat)
        chosen[i].add(flat - starts[i])
    return [torch.tensor(sorted(c), dtype=torch.long) for c in chosen]


_GUARDED: Any = None


def _guarded() -> Any:
    """An autograd function whose every forward and backward is one guarded call into user code.

    gradcheck calls the module a few hundred times; each call, forward or backward, then gets
    the per-call time limit of :mod:`attn_ledger.guard` on its own, as every other call does.
    """
    global _GUARDED
    if _GUARDED is None:
        import torch

        class Guarded(torch.autograd.Function):
            @staticmethod
            def forward(ctx, xs, ps, inner):
                xs_, ps_ = xs.detach().requires_grad_(True), ps.detach().requires_grad_(True)
                with torch.enable_grad(), user_call("forward of the module's float64 copy (gradcheck)"):
                    y = inner(xs_, ps_)  # [K]
                ctx.graph = (y, xs_, ps_)
                return y.detach()

            @staticmethod
            def backward(ctx, grad):
                y, xs_, ps_ = ctx.graph
                with user_call("backward of the module's float64 copy (gradcheck)"):
                    gx, gp = torch.autograd.grad(y, (xs_, ps_), grad, retain_graph=True, allow_unused=True)
                return (torch.zeros_like(xs_) if gx is None else gx, torch.zeros_like(ps_) if gp is None else gp, None)

        _GUARDED = Guarded
    return _GUARDED


def _lower_precision_inside(module: "nn.Module", x: "torch.Tensor") -> bool:
    """Whether a float64 forward produces any floating tensor of lower precision on the way."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    from attn_ledger.guard import forwarded as is_remote

    if is_remote(module):  # the parent's stand-in: the copy runs, and is watched, in the worker
        return module.lower_precision_inside(x)
    seen = []

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
            return out

    with torch.no_grad(), _Watch():
        module(x)
    return any(d != torch.float64 for d in seen)


def _problem(module: "nn.Module", embed_dim: int, seed: int):
    """The float64 copy, the function of the chosen coordinates, and its starting point."""
    import copy

    import torch

    from attn_ledger.guard import forwarded as is_remote

    remote = is_remote(module)
    if remote:  # the parent's stand-in: the copy is made, and kept, in the worker; its values come back
        m64 = module
        params = [(n, p.detach()) for n, p in module.float64_copy()]
    else:
        m64 = copy.deepcopy(module).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 13)
    x = torch.randn(1, 3, embed_dim, generator=g, dtype=torch.float64)  # [1, 3, E]
    if not remote:
        params = [(n, p.detach()) for n, p in m64.named_parameters() if p.requires_grad and p.is_floating_point()]
    xi = torch.randperm(x.numel(), generator=g)[:MAX_COORDINATES]
    pis = _coordinates(params, g) if params else []
    directions = torch.randn(_OUTPUT_DIRECTIONS, x.numel(), generator=g, dtype=torch.float64)  # [K, 3E]
    split = [len(i) for i in pis]

    def inner(xs: "torch.Tensor", ps: "torch.Tensor") -> "torch.Tensor":
        from torch.func import functional_call  # here, not in a parent that only judges: it imports sympy

        xf = x.reshape(-1).scatter(0, xi, xs).reshape(x.shape)  # [1, 3, E]
        full = {n: p.reshape(-1).scatter(0, i, part).reshape(p.shape)
                for (n, p), i, part in zip(params, pis, ps.split(split))}
        y = first_output(functional_call(m64, full, (xf,)))  # [1, 3, E]
        return directions @ y.reshape(-1)  # [K]

    problem = {"x": x, "xi": xi, "params": params, "pis": pis}

    def fn(xs: "torch.Tensor", ps: "torch.Tensor") -> "torch.Tensor":
        if remote:  # the module's call is a round trip (forward and backward); the projection is made here
            y = module.coordinates(xs, ps, problem)  # [1, 3, E]
            return directions @ y.reshape(-1)  # [K]
        return _guarded().apply(xs, ps, inner)

    xs0 = x.reshape(-1)[xi].clone().requires_grad_(True)
    ps0 = (torch.cat([p.reshape(-1)[i] for (_, p), i in zip(params, pis)]) if params
           else torch.zeros(0, dtype=torch.float64)).clone().requires_grad_(True)
    if remote:  # gradcheck's central differences, each coordinate -eps then +eps, planned here and run in one request
        fn.ahead = lambda eps: module.ahead(_differences(xs0, ps0, eps), problem)  # type: ignore[attr-defined]
    return m64, x, fn, (xs0, ps0), {"inputs": len(xi), "parameters": sum(split)}


def _differences(xs: "torch.Tensor", ps: "torch.Tensor", eps: float) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    """The points at which gradcheck evaluates ``fn``: each coordinate moved by -eps, then +eps, as it moves them."""
    points = []
    for t, other, first in ((xs, ps, True), (ps, xs, False)):
        flat = t.detach().reshape(-1)
        for c in range(flat.numel()):
            for sign in (-1, 1):
                moved = flat.clone()
                moved[c] = flat[c] - eps if sign < 0 else flat[c] + eps
                moved = moved.reshape(t.shape)
                points.append((moved, other.detach()) if first else (other.detach(), moved))
    return points


def _discrepancy(fn: Callable, inputs: tuple, rule: dict) -> tuple[float, dict[str, Any]]:
    """max over entries of |analytic - numeric| / (atol + rtol |numeric|), and where, by central differences."""
    import torch

    analytic = torch.cat([j.reshape(_OUTPUT_DIRECTIONS, -1) for j in torch.autograd.functional.jacobian(fn, inputs)],
                         dim=1)  # [K, n]
    flat = torch.cat([t.detach().reshape(-1) for t in inputs])
    sizes = [t.numel() for t in inputs]
    cols = []
    with torch.no_grad():
        for c in range(flat.numel()):
            step = torch.zeros_like(flat)
            step[c] = rule["eps"]
            hi = fn(*(flat + step).split(sizes))
            lo = fn(*(flat - step).split(sizes))
            cols.append((hi - lo) / (2 * rule["eps"]))
    numeric = torch.stack(cols, dim=1)  # [K, n]
    ratio = (analytic - numeric).abs() / (rule["atol"] + rule["rtol"] * numeric.abs())
    at = int(ratio.max(dim=0).values.argmax())
    where = {"coordinate": at if at < sizes[0] else at - sizes[0], "of": "input" if at < sizes[0] else "parameters",
             "analytic": float(analytic[:, at].abs().max()), "numeric": float(numeric[:, at].abs().max())}
    return float(ratio.max()), where


def gradcheck_check(module: "nn.Module", embed_dim: int, seed: int) -> Check:
    """L3 ``gradcheck`` (see the module docstring); skipped when the module cannot run in float64."""
    import torch

    try:
        with user_call("copying the module to float64 (gradcheck)"):
            m64, x, fn, inputs, counts = _problem(module, embed_dim, seed)
        with user_call("forward of the module's float64 copy (gradcheck)"):
            inside = _lower_precision_inside(m64, x)
        fn(*inputs)
    except UserCodeError:
        raise
    except Exception as exc:  # copying or running the user's module in float64 may fail in any way
        return unjudged(3, "gradcheck", "skipped",
                        f"the module's float64 copy could not run: {type(exc).__name__}: {first_line(exc)}")
    rule = _LOOSE if inside else _STRICT
    data = {**counts, "outputs": _OUTPUT_DIRECTIONS, "B": 1, "T": 3, **rule, "lower_precision_inside": inside}
    measure = "torch.autograd.gradcheck (float64, B=1, T=3)"
    try:
        ahead = getattr(fn, "ahead", None)
        if ahead is not None:  # the module in a worker: the finite differences in one request, not one each
            ahead(rule["eps"])
        with torch.enable_grad():  # the user's import may have left grad mode off
            ok = torch.autograd.gradcheck(fn, inputs, eps=rule["eps"], atol=rule["atol"], rtol=rule["rtol"],
                                          raise_exception=False)
    except UserCodeError:
        raise
    except Exception as exc:  # the user's backward may raise anything
        return Check(3, "gradcheck", "fail", measure, reason=f"backward raised {type(exc).__name__}: {first_line(exc)}",
                     data={**data, "exception": type(exc).__name__})
    if ok:
        return Check(3, "gradcheck", "pass", measure, data=data)
    with torch.enable_grad():
        worst, where = _discrepancy(fn, inputs, rule)
    return Check(3, "gradcheck", "fail", "max |analytic - numeric| / (atol + rtol |numeric|)", worst, 1.0, "<=",
                 location={"coordinate": where["coordinate"], "of": where["of"]},
                 reason="the backward disagrees with finite differences of the forward", data={**data, **where})
