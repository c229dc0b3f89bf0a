"""Check a user's attention *module* against the contract ``[B, T, E] -> [B, T, E]``.

The factory protocol: ``factory(embed_dim, num_heads)`` returns an ``nn.Module`` whose
``forward(x)`` maps ``[B, T, E]`` to ``[B, T, E]`` (or a tuple whose first item is that).
It may come back in training mode with dropout; the checks that compare outputs run it
in eval mode, the gradient checks in training mode.

The checks, in rows by aspect and ordered by level, so the first failure is the lowest
level that shows a problem:

* ``shape`` (L1): the output keeps ``[B, T, E]``; T = 1 and B = 1 inputs work too.
* ``axes`` (L2): each example's output is the one it gets alone (batch independence;
  this is what catches ``nn.MultiheadAttention(batch_first=False)`` fed ``[B, T, E]``);
  without ``causal``, permuting positions permutes the output.
* ``numerics`` (L3): finite output; finite gradients reach the input and every parameter
  after one backward pass.
* ``determinism`` (L4): two eval-mode calls agree bitwise.
* ``causality`` (L4, with ``causal``): the intervention on both grad paths, its controls
  and the gradient form of causality.
* ``reference`` (L4): a float64 rebuild from the module's own weights, where the
  projection layout is recognised; where it is not, the report's coverage says the
  verdict rests on black-box checks only.

Only a factory that raises, exits or returns no module is an error (:class:`SetupError`);
every other problem is a result. A forward or backward that exits, or runs past the time
limit of :mod:`attn_ledger.guard` (or, in a worker, crashes), stops the check: the report then
has one ``call`` row, the L1 ``call`` finding naming that call, and nothing else is reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger import decodecheck
from attn_ledger.errors import field_error
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.intervention import (
    ForwardError,
    build_module,
    builtin_controls,
    call_forward,
    causal_intervention,
    closeness,
    determinism_check,
    eval_determinism,
    forward_failure,
    module_dtype,
    module_forward,
    path_check,
)
from attn_ledger.report import Check, Coverage, Report, Row, Status, bounded, counted, row_status, unjudged
from attn_ledger.seeding import generator, manual_seed
from attn_ledger.tolerance import relative as relative_tolerance

if TYPE_CHECKING:
    import torch
    from torch import nn

# Parameter or buffer names that suggest the module encodes positions, which makes a
# permutation probe inconclusive rather than failed.
_POSITIONAL_HINTS = ("pos", "rotary", "rope", "alibi", "position", "wpe", "relative")

# Why checks were not judged.
FORWARD_FAILED = "the forward on [B, T, E] failed (level 1)"
NOISY = "eval-mode calls differ (see eval_determinism), so output comparisons would measure noise"

BATCH_SIZE = 2  # B of the input: at least 2, so batch independence can be judged
SEQ_LEN = 6  # T of the input

# Which row each check belongs to, in order; the rows in order. (A report whose check stopped
# at a call that did not come back has a ``call`` row before them: see stopped_module_report.)
ASPECTS: dict[str, tuple[tuple[int, str], ...]] = {
    "shape": ((1, "output_layout"), (1, "single_position"), (1, "single_example"), (1, "single_example_position")),
    "axes": ((2, "batch_independence"), (2, "permutation_equivariance")),
    "numerics": ((3, "finite_output"), (3, "input_gradient"), (3, "parameter_gradients")),
    "determinism": ((4, "eval_determinism"),),
    "causality": ((4, "causal_intervention_no_grad"), (4, "causal_intervention_autograd"),
                  (4, "intervention_controls"), (4, "causal_gradient_form")),
    "reference": ((4, "reference_rebuild"),),
}
CAUSAL_ONLY = frozenset({"causal_intervention_no_grad", "causal_intervention_autograd", "intervention_controls",
                         "causal_gradient_form"})
NOT_CAUSAL_ONLY = frozenset({"permutation_equivariance"})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


# --- layout recognition and the float64 rebuild ---------------------------------------

@dataclass(frozen=True)
class _Projections:
    """Weights in ``nn.Linear`` layout ``[out, in]`` and optional biases, plus how they were found."""

    layout: str
    owner: str
    wq: "torch.Tensor"
    wk: "torch.Tensor"
    wv: "torch.Tensor"
    wo: "torch.Tensor"
    bq: "torch.Tensor | None"
    bk: "torch.Tensor | None"
    bv: "torch.Tensor | None"
    bo: "torch.Tensor | None"
    num_heads: int
    covered: frozenset[str]
    hint: str = ""


def _linear(mod: Any) -> bool:
    from torch import nn

    return isinstance(mod, nn.Linear)


def _qualified(prefix: str, names: list[str]) -> frozenset[str]:
    return frozenset(f"{prefix}.{n}" if prefix else n for n in names)


def _batch_first_hint(prefix: str, mha: "nn.MultiheadAttention") -> str:
    if mha.batch_first:
        return ""
    return f"nn.MultiheadAttention at {prefix or '(root)'} has batch_first=False: it reads [B, T, E] as [T, B, E]"


def _mha_projections(prefix: str, sub: "nn.MultiheadAttention") -> _Projections:
    if sub._qkv_same_embed_dim:
        wq, wk, wv = sub.in_proj_weight.chunk(3, dim=0)
    else:
        wq, wk, wv = sub.q_proj_weight, sub.k_proj_weight, sub.v_proj_weight
    bq = bk = bv = None
    if sub.in_proj_bias is not None:
        bq, bk, bv = sub.in_proj_bias.chunk(3, dim=0)
    names = [n for n, _ in sub.named_parameters()]
    return _Projections("nn.MultiheadAttention", prefix, wq, wk, wv, sub.out_proj.weight, bq, bk, bv, sub.out_proj.bias,
                        sub.num_heads, _qualified(prefix, names), _batch_first_hint(prefix, sub))


def _named_projections(prefix: str, sub: "nn.Module", num_heads: int) -> _Projections | None:
    """q_proj/k_proj/v_proj with out_proj/o_proj, or a fused qkv/c_attn with c_proj/proj/out_proj."""
    children = dict(sub.named_children())
    out_name = next((n for n in ("out_proj", "o_proj", "c_proj", "proj") if _linear(children.get(n))), None)
    if out_name is None:
        return None
    out = children[out_name]
    if all(_linear(children.get(n)) for n in ("q_proj", "k_proj", "v_proj")) and out_name in ("out_proj", "o_proj"):
        q, k, v = children["q_proj"], children["k_proj"], children["v_proj"]
        names = [f"{c}.{n}" for c in ("q_proj", "k_proj", "v_proj", out_name) for n, _ in children[c].named_parameters()]
        return _Projections(f"q_proj/k_proj/v_proj + {out_name}", prefix, q.weight, k.weight, v.weight, out.weight,
                            q.bias, k.bias, v.bias, out.bias, num_heads, _qualified(prefix, names))
    fused = next((n for n in ("qkv", "c_attn") if _linear(children.get(n))), None)
    if fused is None or children[fused].out_features % 3:
        return None
    lin = children[fused]
    wq, wk, wv = lin.weight.chunk(3, dim=0)
    bq = bk = bv = None
    if lin.bias is not None:
        bq, bk, bv = lin.bias.chunk(3, dim=0)
    names = [f"{c}.{n}" for c in (fused, out_name) for n, _ in children[c].named_parameters()]
    return _Projections(f"fused {fused} + {out_name}", prefix, wq, wk, wv, out.weight, bq, bk, bv, out.bias, num_heads,
                        _qualified(prefix, names))


def recognise_layout(module: "nn.Module", num_heads: int) -> tuple[_Projections | None, str]:
    """Find the projections of a common layout, or say why none was recognised.

    Recognised: ``nn.MultiheadAttention``; ``q_proj``/``k_proj``/``v_proj`` with
    ``out_proj`` or ``o_proj``; a fused ``qkv`` or ``c_attn`` Linear with ``c_proj``,
    ``proj`` or ``out_proj``. A layout counts only if its projections hold every
    parameter of the module; anything else (a norm, a residual weight, positions)
    would make the rebuild compare against a different computation.
    """
    from torch import nn

    candidates: list[_Projections] = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            if sub.bias_k is not None or sub.add_zero_attn:
                return None, f"nn.MultiheadAttention at {prefix or '(root)'} uses add_bias_kv or add_zero_attn, which the rebuild does not model"
            candidates.append(_mha_projections(prefix, sub))
            continue
        found = _named_projections(prefix, sub, num_heads)
        if found is not None:
            candidates.append(found)
    if not candidates:
        return None, "no nn.MultiheadAttention, q_proj/k_proj/v_proj with out_proj/o_proj, or fused qkv/c_attn with c_proj/proj/out_proj"
    if len(candidates) > 1:
        return None, f"{len(candidates)} attention layouts found ({', '.join(c.layout for c in candidates)}); the rebuild needs exactly one"
    found = candidates[0]
    extra = sorted(frozenset(n for n, _ in module.named_parameters()) - found.covered)
    if extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        return None, f"{found.layout} found, but the module has parameters outside it ({shown}), so a rebuild would compute something else"
    return found, ""


def _mha_hint(module: "nn.Module") -> str:
    """The batch_first hint for any nn.MultiheadAttention inside, where no layout was recognised."""
    from torch import nn

    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention) and not sub.batch_first:
            return _batch_first_hint(prefix, sub)
    return ""


def rebuild_reference(p: _Projections, x: "torch.Tensor", causal: bool) -> "torch.Tensor":
    """The module's attention recomputed in float64 from its own weights: ``[B, T, E] -> [B, T, E]``."""
    import torch
    import torch.nn.functional as F

    from attn_ledger.pipeline import merge_heads
    from attn_ledger.reference import reference_attention

    def f64(t: "torch.Tensor | None") -> "torch.Tensor | None":
        return None if t is None else t.detach().to(torch.float64)

    x64 = x.detach().to(torch.float64)  # [B, T, E]
    nh = p.num_heads
    q = F.linear(x64, f64(p.wq), f64(p.bq))  # [B, T, Nh*Dh]
    k = F.linear(x64, f64(p.wk), f64(p.bk))  # [B, T, Nkv*Dh]
    v = F.linear(x64, f64(p.wv), f64(p.bv))  # [B, T, Nkv*Dv]
    dh = q.shape[-1] // nh
    nkv = k.shape[-1] // dh
    b, t, _ = x64.shape
    qh = q.reshape(b, t, nh, dh).transpose(1, 2)  # [B, Nh, T, Dh]
    kh = k.reshape(b, t, nkv, dh).transpose(1, 2)  # [B, Nkv, T, Dh]
    vh = v.reshape(b, t, nkv, v.shape[-1] // nkv).transpose(1, 2)  # [B, Nkv, T, Dv]
    ctx = reference_attention(qh, kh, vh, is_causal=causal)  # [B, Nh, T, Dv]
    return F.linear(merge_heads(ctx), f64(p.wo), f64(p.bo))  # [B, T, E]


# --- the checks -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Subject:
    """What the checks after level 1 read: the module (in eval mode), its forward, the input and output."""

    module: "nn.Module"
    fwd: Callable[[Any], Any]
    x: "torch.Tensor"  # [B, T, E]
    y: "torch.Tensor"  # [B, T, E], the eval-mode output
    seed: int
    causal: bool


def _not_reached(level: int, name: str, why: str) -> Check:
    return unjudged(level, name, "not_reached", why)


def _shape_checks(fwd: Callable, x: "torch.Tensor") -> tuple[list[Check], "torch.Tensor | None"]:
    import torch

    checks: list[Check] = []
    y = None
    try:
        with torch.no_grad():
            y = call_forward(fwd, x)  # [B, T, E]
        checks.append(Check(1, "output_layout", "pass", data={"input": list(x.shape), "output": list(y.shape)}))
    except ForwardError as exc:
        checks.append(forward_failure(1, "output_layout", exc))
    for name, xi in (("single_position", x[:, :1]), ("single_example", x[:1]), ("single_example_position", x[:1, :1])):
        try:
            with torch.no_grad():
                call_forward(fwd, xi.contiguous())
            checks.append(Check(1, name, "pass", data={"input": list(xi.shape)}))
        except ForwardError as exc:
            checks.append(forward_failure(1, name, exc))
    return checks, y


def _batch_independence(s: _Subject, hint: str) -> Check:
    import torch

    measure = "max |f(x)[b]-f(x[b])|"
    worst = None
    with torch.no_grad():
        for b in range(s.x.shape[0]):
            alone = call_forward(s.fwd, s.x[b : b + 1].clone())  # [1, T, E]
            c = closeness(s.y[b : b + 1], alone, s.y.dtype)
            if not c.ok:
                reason = "the module mixes examples (is the batch axis read as positions?)"
                return bounded(2, "batch_independence", measure, c.delta, c.tolerance, location={"example": b},
                               reason=f"{reason}; {hint}" if hint else reason, data={**c.data(), "hint": hint})
            if worst is None or c.delta > worst[1].delta:
                worst = (b, c)
    b, c = worst  # type: ignore[misc]
    return bounded(2, "batch_independence", measure, c.delta, c.tolerance, location={"example": b}, data=c.data())


def _positional_names(module: "nn.Module") -> list[str]:
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return [n for n in names if any(h in n.lower() for h in _POSITIONAL_HINTS)]


def _permutation(s: _Subject) -> Check:
    import torch

    t = s.x.shape[1]
    g = generator(s.seed + 5)
    perm = torch.randperm(t, generator=g)
    if t > 1 and torch.equal(perm, torch.arange(t)):
        perm = torch.roll(perm, 1)
    with torch.no_grad():
        yp = call_forward(s.fwd, s.x[:, perm].clone())  # [B, T, E], positions permuted
    c = closeness(yp, s.y[:, perm], s.y.dtype)
    measure = "max |f(x[:,p])-f(x)[:,p]|"
    data = {**c.data(), "permutation": perm.tolist()}
    if c.ok:
        return bounded(2, "permutation_equivariance", measure, c.delta, c.tolerance, data=data)
    positional = _positional_names(s.module)
    if positional:
        return Check(2, "permutation_equivariance", "inconclusive", measure, c.delta, c.tolerance, "<=",
                     reason="the module has positional state, so order may legitimately matter",
                     data={**data, "positional": positional[:3]})
    return bounded(2, "permutation_equivariance", measure, c.delta, c.tolerance, data=data,
                   reason="without a causal mask or positional encoding, attention should not care about order "
                          "(a module that encodes positions under names this probe does not know makes this inconclusive)")


def _axis_checks(s: _Subject, hint: str, noisy: bool) -> list[Check]:
    """L2: batch independence; without ``causal``, permutation equivariance."""
    probes: list[tuple[str, Callable[[], Check]]] = [("batch_independence", lambda: _batch_independence(s, hint))]
    if not s.causal:
        probes.append(("permutation_equivariance", lambda: _permutation(s)))
    checks = []
    for name, probe in probes:
        if noisy:
            checks.append(_not_reached(2, name, NOISY))
            continue
        try:
            checks.append(probe())
        except ForwardError as exc:
            checks.append(forward_failure(2, name, exc))
    return checks


def _parameter_gradients(module: "nn.Module") -> Check:
    import torch

    missing, nonfinite, count = [], [], 0
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        count += 1
        if p.grad is None:
            missing.append(name)
        elif not bool(torch.isfinite(p.grad).all()):
            nonfinite.append(name)
    if count == 0:
        return unjudged(3, "parameter_gradients", "not_applicable", "the module has no trainable parameters")
    return counted(3, "parameter_gradients", "trainable parameters without a finite gradient", len(missing) + len(nonfinite),
                   data={"of": count, "no_gradient": missing, "non_finite": nonfinite})


def _input_gradient(g: "torch.Tensor | None") -> Check:
    import torch

    if g is None:
        return Check(3, "input_gradient", "fail", reason="no gradient reached the input (the graph was detached)")
    bad = int((~torch.isfinite(g)).sum())
    if bad:
        return counted(3, "input_gradient", "non-finite input gradient values", bad)
    return Check(3, "input_gradient", "pass", "input gradient norm", float(g.norm()))


def _gradient_checks(module: "nn.Module", x: "torch.Tensor") -> list[Check]:
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
                        _not_reached(3, "parameter_gradients", "the training-mode forward failed")]
            except UserCodeError:
                raise
            except Exception as exc:  # the user's backward may raise anything
                why = f"backward raised {type(exc).__name__}: {_first_line(exc)}"
                data = {"exception": type(exc).__name__}
                return [Check(3, "input_gradient", "fail", reason=why, data=data),
                        Check(3, "parameter_gradients", "fail", reason=why, data=data)]
        return [_input_gradient(x_in.grad), _parameter_gradients(module)]
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was_training)


def _numeric_checks(s: _Subject) -> list[Check]:
    """L3: finite output, then the gradient checks (which leave the module in eval mode)."""
    import torch

    finite = counted(3, "finite_output", "non-finite output values", int((~torch.isfinite(s.y)).sum()))
    checks = [finite] + _gradient_checks(s.module, s.x)
    s.module.eval()
    return checks


def _gradient_form(s: _Subject) -> Check:
    """d out_i / d x_j must vanish for every j > i and be nonzero somewhere for j <= i."""
    import torch

    b, t, e = s.x.shape
    g = generator(s.seed + 9)
    r = torch.randn(b, t, e, generator=g, dtype=torch.float64).to(s.x.dtype)  # [B, T, E] probe direction
    x_in = s.x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        y = call_forward(s.fwd, x_in)  # [B, T, E]
        grads = []
        with user_call(f"backward through forward(x) for each of {t} output positions"):
            for i in range(t):
                (gi,) = torch.autograd.grad((y[:, i] * r[:, i]).sum(), x_in, retain_graph=True, allow_unused=True)
                grads.append(torch.zeros_like(x_in) if gi is None else gi.detach())  # [B, T, E]
    per = torch.stack([gi.to(torch.float64).abs().amax(dim=(0, 2)) for gi in grads])  # [T_out, T_in]
    finite = torch.isfinite(per)
    if not bool(finite.all()):
        return counted(4, "causal_gradient_form", "non-finite entries of max |d out_i / d x_j|", int((~finite).sum()))
    tol = relative_tolerance(s.x.dtype) * float(per.max())
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # [T_out, T_in], j > i
    worst = float(per[future].max()) if t > 1 else 0.0
    data = {"max_future": worst, "rel_tolerance": relative_tolerance(s.x.dtype), "scale": float(per.max())}
    leaks = (per > tol) & future
    if bool(leaks.any()):
        i, j = (int(v) for v in leaks.nonzero()[0])
        return bounded(4, "causal_gradient_form", "max |d out_i / d x_j|, j > i", float(per[i, j]), tol,
                       location={"output": i, "input": j}, reason="the output depends on a future position", data=data)
    dead = [i for i in range(t) if not float(per[i, : i + 1].max()) > tol]
    if dead:
        i = dead[0]
        return Check(4, "causal_gradient_form", "fail", "max |d out_i / d x_j|, j <= i", float(per[i, : i + 1].max()),
                     tol, ">=", location={"output": i},
                     reason="no past position reaches this output: the gradient form is vacuous there", data=data)
    return bounded(4, "causal_gradient_form", "max |d out_i / d x_j|, j > i", worst, tol, data=data)


def _controls_check(embed_dim: int, num_heads: int, x: "torch.Tensor", seed: int) -> Check:
    """L4: the built-in pipeline at these sizes, built to leak two ways, must be reported as leaking."""
    import torch

    if embed_dim % num_heads:
        return Check(4, "intervention_controls", "not_applicable",
                     reason="the built-in controls need embed_dim divisible by num_heads",
                     data={"embed_dim": embed_dim, "num_heads": num_heads})
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    results = {}
    for name, _desc, control in builtin_controls(embed_dim, num_heads, seed, dtype):
        results[name] = causal_intervention(module_forward(control), x.to(dtype), grad_mode="no_grad", seed=seed)
    leaked = sum(r.verdict == "leak" for r in results.values())
    data = {name: {"verdict": r.verdict, "max_prefix_delta": r.max_prefix_delta, "tolerance": r.tolerance}
            for name, r in results.items()}
    return bounded(4, "intervention_controls", "controls on the built-in pipeline reported as leaks", leaked,
                   len(results), op="==", data={"controls": data},
                   reason="" if leaked == len(results) else "a control did not leak, so the probe has no power here")


def _causal_checks(s: _Subject, embed_dim: int, num_heads: int, noisy: bool) -> list[Check]:
    """L4 with ``causal``: the intervention on both grad paths, its controls, the gradient form."""
    checks = []
    for mode in ("no_grad", "autograd"):
        name = f"causal_intervention_{mode}"
        checks.append(_not_reached(4, name, NOISY) if noisy
                      else path_check(causal_intervention(s.fwd, s.x, grad_mode=mode, seed=s.seed), name))
    checks.append(_controls_check(embed_dim, num_heads, s.x, s.seed))
    if noisy:
        checks.append(_not_reached(4, "causal_gradient_form", NOISY))
        return checks
    try:
        checks.append(_gradient_form(s))
    except ForwardError as exc:
        checks.append(forward_failure(4, "causal_gradient_form", exc))
    except UserCodeError:
        raise
    except Exception as exc:  # the user's backward may raise anything
        checks.append(Check(4, "causal_gradient_form", "fail", reason=f"backward raised {type(exc).__name__}: {_first_line(exc)}",
                            data={"exception": type(exc).__name__}))
    return checks


def _rebuild_check(s: _Subject, layout: _Projections | None, why_not: str, noisy: bool) -> Check:
    """L4: the output against a float64 rebuild from the module's own weights."""
    if layout is None:
        return unjudged(4, "reference_rebuild", "skipped", f"layout not recognised: {why_not}")
    if noisy:
        return _not_reached(4, "reference_rebuild", NOISY)
    ref = rebuild_reference(layout, s.x, s.causal)  # [B, T, E] float64
    c = closeness(s.y, ref, s.y.dtype)
    return bounded(4, "reference_rebuild", "max |f(x)-f64_rebuild(x)|",
                   c.delta, c.tolerance, reason="" if c.ok else layout.hint,
                   data={**c.data(), "layout": layout.layout, "mask": "causal" if s.causal else "none"})


# --- the report ----------------------------------------------------------------------------

def _validate(**sizes: tuple[int, int]) -> None:
    for name, (value, low) in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise field_error(name, value, f"an integer >= {low}")


def _expected(causal: bool) -> list[tuple[int, str]]:
    """Every check this run makes, in row order."""
    skip = NOT_CAUSAL_ONLY if causal else CAUSAL_ONLY
    return [(level, name) for members in ASPECTS.values() for level, name in members if name not in skip]


def _run_checks(module: "nn.Module", x: "torch.Tensor", layout: _Projections | None, why_not: str, embed_dim: int,
                num_heads: int, causal: bool, seed: int, tick: Callable[[], None]) -> list[Check]:
    """Every check, in level order; after a failed level-1 forward, the rest are not reached.

    Eval determinism is a behaviour (L4) check, but it runs first: every later comparison
    of outputs (batch independence, permutation, rebuild, intervention) assumes an eval-mode
    output is a function of the input. When it is not, those comparisons would report
    dropout noise as a finding of their own, so they are not reached and the first finding
    is eval_determinism itself. The intervention comes before the rebuild: when both fail,
    "position 0 moved when position 1 changed" says more than "the outputs differ".
    """
    fwd = module_forward(module)
    l1, y = _shape_checks(fwd, x)
    tick()
    if y is None:
        return l1 + [_not_reached(level, name, FORWARD_FAILED) for level, name in _expected(causal)[len(l1):]]
    s = _Subject(module, fwd, x, y, seed, causal)
    det = eval_determinism(fwd, x)
    noisy = not det.identical
    tick()
    checks = l1 + _axis_checks(s, layout.hint if layout else _mha_hint(module), noisy)
    tick()
    checks += _numeric_checks(s)
    tick()
    checks.append(determinism_check(det))
    if causal:
        checks += _causal_checks(s, embed_dim, num_heads, noisy)
        tick()
    checks.append(_rebuild_check(s, layout, why_not, noisy))
    tick()
    return checks


def _row(name: str, checks: tuple[Check, ...]) -> Row:
    status: Status = "not_reached" if all(c.status == "not_reached" for c in checks) else row_status(checks)
    return Row(name, status, checks)


def check_module(
    factory: Callable[..., Any],
    embed_dim: int,
    num_heads: int,
    *,
    causal: bool = True,
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    seq_len: int = SEQ_LEN,
    progress: Callable[[int, int], None] | None = None,
    subject: str = "module",
    decode: Callable[..., Any] | None = None,
) -> Report:
    """Check a module built by ``factory(embed_dim, num_heads)`` against the attention contract.

    Args:
        factory: the already-loaded callable returning an ``nn.Module``.
        embed_dim: E, passed to the factory and used for the input ``[B, T, E]``.
        num_heads: Nh, passed to the factory and used by the float64 rebuild.
        causal: check causality (intervention, controls, gradient form); otherwise check
            permutation equivariance.
        seed: seeds torch's generator around the factory and the forwards, and the inputs.
        batch_size: B (at least 2, so batch independence can be judged).
        seq_len: T (at least 2).
        progress: ``callback(done, total)`` after each check group.
        subject: a name for the output.
        decode: ``decode(module, x_new, cache) -> (y_new, cache)``: adds the KV-cache decode
            parity rows of :mod:`attn_ledger.decodecheck` (needs ``causal``).

    Returns:
        A :class:`~attn_ledger.report.Report` (command ``check``), one row per aspect
        (:data:`ASPECTS`); ``exit_code`` 0 when every check passes, 1 on a finding.

    Raises:
        InputError: sizes out of range, or ``decode`` without ``causal``.
        SetupError: the factory raised, exited or returned something other than an ``nn.Module``.
    """
    import torch

    _validate(embed_dim=(embed_dim, 1), num_heads=(num_heads, 1), batch_size=(batch_size, 2), seq_len=(seq_len, 2))
    if decode is not None and not causal:
        raise field_error("decode", getattr(decode, "__name__", "decode"),
                          "a causal module (decode parity compares with the causal forward)")
    with torch.random.fork_rng(devices=[]):
        manual_seed(seed)
        module = build_module(factory, embed_dim, num_heads)
        return check_built_module(module, embed_dim, num_heads, causal=causal, seed=seed, batch_size=batch_size,
                                  seq_len=seq_len, progress=progress, subject=subject, decode=decode)


def check_built_module(
    module: "nn.Module",
    embed_dim: int,
    num_heads: int,
    *,
    causal: bool = True,
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    seq_len: int = SEQ_LEN,
    progress: Callable[[int, int], None] | None = None,
    subject: str = "module",
    decode: Callable[..., Any] | None = None,
) -> Report:
    """:func:`check_module` on a module already built; torch's global generator goes on from where the caller left it.

    A call into the module (or into ``decode``) that exits or runs past its time limit stops
    the check (see :func:`stopped_module_report`).
    """
    import torch

    total, done = (6 if causal else 5) + (len(decodecheck.plan_scenarios()) if decode is not None else 0), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    training_on_entry = bool(module.training)
    param_dtype = module_dtype(module)
    dtype = str(param_dtype).removeprefix("torch.")
    sizes = {"B": batch_size, "T": seq_len, "E": embed_dim, "Nh": num_heads}
    g = generator(seed)
    x = torch.randn(batch_size, seq_len, embed_dim, generator=g, dtype=torch.float64).to(param_dtype)  # [B, T, E]
    module.eval()
    layout, why_not = recognise_layout(module, num_heads)
    try:
        checks = _run_checks(module, x, layout, why_not, embed_dim, num_heads, causal, seed, tick)
        decoded = decodecheck.decode_rows(module, decode, embed_dim, seed=seed, progress=lambda d, t: tick()) \
            if decode is not None else None
    except UserCodeError as exc:
        return stopped_module_report(subject, sizes, causal, f"{exc.what} {exc}", exc.facts(), dtype, training_on_entry)
    if progress:
        progress(total, total)
    report = _module_report(checks, subject, sizes, causal, layout, why_not, dtype, training_on_entry)
    return report if decoded is None else decodecheck.with_decode(report, *decoded)


def stopped_module_report(subject: str, sizes: dict[str, int], causal: bool, reason: str, data: dict[str, Any],
                          dtype: str | None = None, training_on_entry: bool = False) -> Report:
    """The report when a call into the module did not come back (an exit, the time limit, a crash).

    Its ``call`` row holds the L1 ``call`` finding (``reason`` and ``data`` say which call and
    how it ended); every other check is not reached, since no later call could be trusted to return.
    """
    called = Check(1, "call", "fail", reason=reason, data=data)
    rest = [_not_reached(level, name, "the check stopped at a call that did not return") for level, name in _expected(causal)]
    return _module_report([called, *rest], subject, sizes, causal, None, "", dtype, training_on_entry, stopped=True)


def _module_report(checks: list[Check], subject: str, sizes: dict[str, int], causal: bool,
                   layout: _Projections | None, why_not: str, dtype: str | None, training_on_entry: bool,
                   stopped: bool = False) -> Report:
    """The checks in rows by aspect; coverage says so where the float64 rebuild could not run."""
    by_name = {c.name: c for c in checks}
    rows = [_row(aspect, found) for aspect, members in ASPECTS.items()
            if (found := tuple(by_name[n] for _, n in members if n in by_name))]
    if "call" in by_name:  # the check stopped at a call into the module that did not return
        rows.insert(0, Row("call", by_name["call"].status, (by_name["call"],)))
    notes = [f"rebuild layout: {layout.layout}"] if layout else []
    if training_on_entry:
        notes.append("the module came back in training mode: output comparisons ran in eval mode, gradients in training mode")
    coverage = None if layout else Coverage("black-box", ("reference_rebuild",), f"layout not recognised: {why_not}")
    if stopped:
        coverage = Coverage("stopped", tuple(n for _, n in _expected(causal)),
                            "a call into the module did not come back, so no other check ran")
    details = {"subject": subject, "protocol": "module", "sizes": sizes, "causal": causal,
               "layout": layout.layout if layout else None, "dtype": dtype,
               "training_mode_on_entry": training_on_entry}
    title = (f"MODULE CHECK {subject} B={sizes['B']} T={sizes['T']} E={sizes['E']} Nh={sizes['Nh']} "
             f"{'causal' if causal else 'not causal'}")
    return Report("check", title, tuple(rows), coverage=coverage, notes=tuple(notes), details=details,
                  unit="check", row_label="aspect")


__all__ = ["ASPECTS", "check_module", "check_built_module", "build_module", "stopped_module_report",
           "recognise_layout", "rebuild_reference"]
