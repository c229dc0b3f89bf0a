"""Check a user's attention *module* against the contract ``[B, T, E] -> [B, T, E]``.

The factory protocol: ``factory(embed_dim, num_heads)`` returns an ``nn.Module`` whose
``forward(x)`` maps ``[B, T, E]`` to ``[B, T, E]`` (or a tuple whose first item is that).
It may come back in training mode with dropout; the checks that compare outputs run it
in eval mode, the gradient checks in training mode.

Checks, ordered by level so the first failure is the lowest level that shows a problem:

* L1 shape: the output keeps ``[B, T, E]``; T = 1 and B = 1 inputs work too.
* L2 axis semantics: each example's output is the one it gets alone (batch independence;
  this is what catches ``nn.MultiheadAttention(batch_first=False)`` fed ``[B, T, E]``);
  without ``causal``, permuting positions permutes the output.
* L3 numerical invariants: finite output; finite gradients reach the input and every
  parameter after one backward pass.
* L4 behaviour: eval-mode determinism; with ``causal``, the intervention on both grad
  paths, its controls and the gradient form of causality; a float64 rebuild from the
  module's own weights where the projection layout is recognised.

Only a factory that raises or returns no module is an error (:class:`SetupError`); every
other problem is a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.errors import SetupError, field_error
from attn_ledger.experiments.intervene import (
    Finding,
    ForwardError,
    abs_delta,
    builtin_controls,
    call_forward,
    causal_intervention,
    eval_determinism,
    module_forward,
    output_scale,
    relative_tolerance,
)
from attn_ledger.report import LEVEL_NAMES, Check, envelope, find_check

if TYPE_CHECKING:
    import torch
    from torch import nn

# Parameter or buffer names that suggest the module encodes positions, which makes a
# permutation probe inconclusive rather than failed.
_POSITIONAL_HINTS = ("pos", "rotary", "rope", "alibi", "position", "wpe", "relative")


@dataclass(frozen=True)
class ModuleCheckReport:
    """The result of :func:`check_module`.

    Attributes:
        subject: how the module was named (for output only).
        embed_dim: E; num_heads: Nh; batch_size: B; seq_len: T; causal: the claim checked.
        checks: every check, ordered by level (1-4), then by the order they are listed above.
        layout: the projection layout recognised for the float64 rebuild, or None.
        notes: lines a reader needs (mode on entry, why a check could not run, ...).
    """

    subject: str
    embed_dim: int
    num_heads: int
    batch_size: int
    seq_len: int
    causal: bool
    checks: tuple[Check, ...]
    layout: str | None
    notes: tuple[str, ...] = ()

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(Finding(c.level, c.name, c.detail) for c in self.checks if c.failed)

    @property
    def first_finding(self) -> Finding | None:
        f = self.findings
        return f[0] if f else None

    @property
    def verdict(self) -> str:
        return "pass" if not self.findings else "finding"

    @property
    def exit_code(self) -> int:
        return 0 if not self.findings else 1

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)

    def to_json(self) -> dict[str, Any]:
        first = self.first_finding
        return envelope(
            "check",
            self.verdict,
            subject=self.subject,
            protocol="module",
            sizes={"B": self.batch_size, "T": self.seq_len, "E": self.embed_dim, "Nh": self.num_heads},
            causal=self.causal,
            layout=self.layout,
            first_finding=first.to_json() if first else None,
            findings=[f.to_json() for f in self.findings],
            checks=[c.to_json() for c in self.checks],
            notes=list(self.notes),
        )

    def _title(self) -> str:
        return (
            f"MODULE CHECK  {self.subject}  B={self.batch_size} T={self.seq_len} E={self.embed_dim} "
            f"Nh={self.num_heads} {'causal' if self.causal else 'not causal'}"
        )

    def _rows(self) -> list[list[str]]:
        rows = []
        for c in self.checks:
            status = "pass" if c.ok else ("not run" if c.ok is None else "FAIL")
            rows.append([f"L{c.level} {LEVEL_NAMES[c.level]}", c.name, status, c.detail])
        return rows

    def _tail(self) -> list[str]:
        first = self.first_finding
        lines = [f"layout: {self.layout or 'not recognised'}"] + list(self.notes)
        lines.append(f"first finding: L{first.level} {first.check}: {first.detail}" if first else "first finding: none")
        return lines

    def to_markdown(self) -> str:
        out = [f"## {self._title()}", "", "| level | check | result | detail |", "|---|---|---|---|"]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in self._rows()]
        out += [""] + [f"- {line}" for line in self._tail()]
        return "\n".join(out) + "\n"

    def to_rich(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=self._title(), title_justify="left")
        table.add_column("level", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("result", no_wrap=True)
        table.add_column("detail")
        for row in self._rows():
            style = "bold red" if row[2] == "FAIL" else ("dim" if row[2] == "not run" else "")
            table.add_row(*row, style=style)
        lines = [Text(line, style="bold red" if line.startswith("first finding: L") else "") for line in self._tail()]
        return Group(table, *lines)


# --- helpers -------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def build_module(factory: Callable[..., Any], embed_dim: int, num_heads: int) -> "nn.Module":
    """Call ``factory(embed_dim, num_heads)``; a raise or a non-module is a :class:`SetupError`."""
    from torch import nn

    try:
        module = factory(embed_dim, num_heads)
    except Exception as exc:  # the user's factory may raise anything
        raise SetupError(
            f"module: factory({embed_dim}, {num_heads}) raised {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    if not isinstance(module, nn.Module):
        raise SetupError(f"module: factory({embed_dim}, {num_heads}) returned {type(module).__name__}, expected an nn.Module")
    return module


def _module_dtype(module: "nn.Module") -> "torch.dtype":
    import torch

    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _close(a: "torch.Tensor", b: "torch.Tensor", dtype: "torch.dtype") -> tuple[bool, float, float]:
    """``(ok, max |a - b|, tolerance)`` with the tolerance relative to b's scale."""
    delta = float(abs_delta(a, b).max()) if a.numel() else 0.0
    tol = relative_tolerance(dtype) * output_scale(b)
    return delta <= tol, delta, tol


def _not_run(level: int, name: str, why: str) -> Check:
    return Check(level, name, None, detail=f"not run: {why}")


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


def recognise_layout(module: "nn.Module", num_heads: int) -> tuple[_Projections | None, str]:
    """Find the projections of a common layout, or say why none was recognised.

    Recognised: ``nn.MultiheadAttention``; ``q_proj``/``k_proj``/``v_proj`` with
    ``out_proj`` or ``o_proj``; a fused ``qkv`` or ``c_attn`` Linear with ``c_proj``,
    ``proj`` or ``out_proj``. A layout counts only if its projections hold every
    parameter of the module; anything else (a norm, a residual weight, positions)
    would make the rebuild compare against a different computation.
    """
    from torch import nn

    all_params = frozenset(n for n, _ in module.named_parameters())
    candidates: list[_Projections] = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            if sub.bias_k is not None or sub.add_zero_attn:
                return None, f"nn.MultiheadAttention at {prefix or '(root)'} uses add_bias_kv or add_zero_attn, which the rebuild does not model"
            if sub._qkv_same_embed_dim:
                wq, wk, wv = sub.in_proj_weight.chunk(3, dim=0)
            else:
                wq, wk, wv = sub.q_proj_weight, sub.k_proj_weight, sub.v_proj_weight
            bq = bk = bv = None
            if sub.in_proj_bias is not None:
                bq, bk, bv = sub.in_proj_bias.chunk(3, dim=0)
            hint = "" if sub.batch_first else (
                f"nn.MultiheadAttention at {prefix or '(root)'} has batch_first=False: it reads [B, T, E] as [T, B, E]"
            )
            names = [n for n, _ in sub.named_parameters()]
            candidates.append(_Projections(
                "nn.MultiheadAttention", prefix, wq, wk, wv, sub.out_proj.weight, bq, bk, bv, sub.out_proj.bias,
                sub.num_heads, _qualified(prefix, names), hint,
            ))
            continue
        children = dict(sub.named_children())
        out_name = next((n for n in ("out_proj", "o_proj", "c_proj", "proj") if _linear(children.get(n))), None)
        if out_name is None:
            continue
        out = children[out_name]
        if all(_linear(children.get(n)) for n in ("q_proj", "k_proj", "v_proj")) and out_name in ("out_proj", "o_proj"):
            q, k, v = children["q_proj"], children["k_proj"], children["v_proj"]
            names = [f"{c}.{n}" for c in ("q_proj", "k_proj", "v_proj", out_name) for n, _ in children[c].named_parameters()]
            candidates.append(_Projections(
                f"q_proj/k_proj/v_proj + {out_name}", prefix, q.weight, k.weight, v.weight, out.weight,
                q.bias, k.bias, v.bias, out.bias, num_heads, _qualified(prefix, names),
            ))
            continue
        fused = next((n for n in ("qkv", "c_attn") if _linear(children.get(n))), None)
        if fused is not None:
            lin = children[fused]
            if lin.out_features % 3:
                continue
            wq, wk, wv = lin.weight.chunk(3, dim=0)
            bq = bk = bv = None
            if lin.bias is not None:
                bq, bk, bv = lin.bias.chunk(3, dim=0)
            names = [f"{c}.{n}" for c in (fused, out_name) for n, _ in children[c].named_parameters()]
            candidates.append(_Projections(
                f"fused {fused} + {out_name}", prefix, wq, wk, wv, out.weight, bq, bk, bv, out.bias, num_heads,
                _qualified(prefix, names),
            ))
    if not candidates:
        return None, "no nn.MultiheadAttention, q_proj/k_proj/v_proj with out_proj/o_proj, or fused qkv/c_attn with c_proj/proj/out_proj"
    if len(candidates) > 1:
        return None, f"{len(candidates)} attention layouts found ({', '.join(c.layout for c in candidates)}); the rebuild needs exactly one"
    found = candidates[0]
    extra = sorted(all_params - found.covered)
    if extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        return None, f"{found.layout} found, but the module has parameters outside it ({shown}), so a rebuild would compute something else"
    return found, ""


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

def _shape_checks(fwd: Callable, x: "torch.Tensor") -> tuple[list[Check], "torch.Tensor | None"]:
    import torch

    checks: list[Check] = []
    b, t, e = x.shape
    y = None
    try:
        with torch.no_grad():
            y = call_forward(fwd, x)
        checks.append(Check(1, "output_layout", True, detail=f"input {tuple(x.shape)} [B, T, E] -> output {tuple(y.shape)} [B, T, E]"))
    except ForwardError as exc:
        checks.append(Check(1, "output_layout", False, detail=str(exc)))
    for name, xi, what in (
        ("single_position", x[:, :1], "T = 1"),
        ("single_example", x[:1], "B = 1"),
        ("single_example_position", x[:1, :1], "B = 1, T = 1"),
    ):
        try:
            with torch.no_grad():
                call_forward(fwd, xi.contiguous())
            checks.append(Check(1, name, True, detail=f"{what}: input {tuple(xi.shape)} -> same shape"))
        except ForwardError as exc:
            checks.append(Check(1, name, False, detail=f"{what}: {exc}"))
    return checks, y


def _batch_independence(fwd: Callable, x: "torch.Tensor", y: "torch.Tensor", hint: str) -> Check:
    import torch

    worst, tol_used = 0.0, 0.0
    with torch.no_grad():
        for b in range(x.shape[0]):
            alone = call_forward(fwd, x[b : b + 1].clone())  # [1, T, E]
            ok, delta, tol = _close(y[b : b + 1], alone, y.dtype)
            if delta > worst or b == 0:
                worst, tol_used = max(worst, delta), tol
            if not ok:
                detail = (
                    f"example {b}'s output in the batch differs from its output alone: max |delta| {delta:.3g} > "
                    f"tolerance {tol:.3g}; the module mixes examples (is the batch axis read as positions?)"
                )
                if hint:
                    detail += f"; {hint}"
                return Check(2, "batch_independence", False, delta, detail)
    return Check(2, "batch_independence", True, worst,
                 f"each example's output equals its output alone: max |delta| {worst:.3g} <= tolerance {tol_used:.3g}")


def _positional_names(module: "nn.Module") -> list[str]:
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return [n for n in names if any(h in n.lower() for h in _POSITIONAL_HINTS)]


def _permutation(fwd: Callable, module: "nn.Module", x: "torch.Tensor", y: "torch.Tensor", seed: int) -> Check:
    import torch

    t = x.shape[1]
    g = torch.Generator().manual_seed(seed + 5)
    perm = torch.randperm(t, generator=g)
    if t > 1 and torch.equal(perm, torch.arange(t)):
        perm = torch.roll(perm, 1)
    with torch.no_grad():
        yp = call_forward(fwd, x[:, perm].clone())  # [B, T, E], positions permuted
    ok, delta, tol = _close(yp, y[:, perm], y.dtype)
    order = perm.tolist()
    if ok:
        return Check(2, "permutation_equivariance", True, delta,
                     f"permuting positions {order} permutes the output: max |delta| {delta:.3g} <= tolerance {tol:.3g}")
    positional = _positional_names(module)
    if positional:
        return Check(2, "permutation_equivariance", None, delta,
                     f"inconclusive: output not permuted with the input (max |delta| {delta:.3g}), but the module has "
                     f"positional state ({', '.join(positional[:3])}), so order may legitimately matter")
    return Check(2, "permutation_equivariance", False, delta,
                 f"permuting positions {order} does not permute the output: max |delta| {delta:.3g} > tolerance {tol:.3g}; "
                 "without a causal mask or positional encoding, attention should not care about order "
                 "(if the module encodes positions under names this probe does not know, this is inconclusive)")


def _gradient_checks(module: "nn.Module", x: "torch.Tensor") -> list[Check]:
    import torch

    was_training = module.training
    module.train()
    checks: list[Check] = []
    try:
        module.zero_grad(set_to_none=True)
        x_in = x.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            try:
                y = call_forward(module_forward(module), x_in)
                loss = y.square().mean()
                loss.backward()
            except ForwardError as exc:
                return [Check(3, "input_gradient", False, detail=f"training mode: {exc}"),
                        _not_run(3, "parameter_gradients", "the training-mode forward failed")]
            except Exception as exc:
                msg = f"backward raised {type(exc).__name__}: {_first_line(exc)}"
                return [Check(3, "input_gradient", False, detail=msg), Check(3, "parameter_gradients", False, detail=msg)]
        g = x_in.grad
        if g is None:
            checks.append(Check(3, "input_gradient", False, detail="no gradient reached the input (the graph was detached)"))
        elif not bool(torch.isfinite(g).all()):
            checks.append(Check(3, "input_gradient", False, detail=f"the input gradient holds {int((~torch.isfinite(g)).sum())} non-finite values"))
        else:
            norm = float(g.norm())
            checks.append(Check(3, "input_gradient", True, norm, f"finite gradient reaches the input, norm {norm:.3g}"))
        missing, nonfinite, count = [], [], 0
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            count += 1
            if p.grad is None:
                missing.append(name)
            elif not bool(torch.isfinite(p.grad).all()):
                nonfinite.append(name)
        if missing or nonfinite:
            parts = []
            if missing:
                parts.append(f"no gradient: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
            if nonfinite:
                parts.append(f"non-finite gradient: {', '.join(nonfinite[:4])}")
            checks.append(Check(3, "parameter_gradients", False, float(len(missing) + len(nonfinite)),
                                f"{len(missing) + len(nonfinite)} of {count} parameters: " + "; ".join(parts)))
        elif count == 0:
            checks.append(Check(3, "parameter_gradients", None, 0.0, "not applicable: the module has no trainable parameters"))
        else:
            checks.append(Check(3, "parameter_gradients", True, float(count),
                                f"finite gradients reach all {count} trainable parameters after one backward pass"))
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was_training)
    return checks


def _gradient_form(fwd: Callable, x: "torch.Tensor", seed: int) -> Check:
    """d out_i / d x_j must vanish for every j > i and be nonzero somewhere for j <= i."""
    import torch

    b, t, e = x.shape
    g = torch.Generator().manual_seed(seed + 9)
    r = torch.randn(b, t, e, generator=g, dtype=torch.float64).to(x.dtype)  # [B, T, E] probe direction
    x_in = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        y = call_forward(fwd, x_in)  # [B, T, E]
        grads = []
        for i in range(t):
            (gi,) = torch.autograd.grad((y[:, i] * r[:, i]).sum(), x_in, retain_graph=True, allow_unused=True)
            grads.append(torch.zeros_like(x_in) if gi is None else gi.detach())  # [B, T, E]
    per = torch.stack([gi.to(torch.float64).abs().amax(dim=(0, 2)) for gi in grads])  # [T_out, T_in]
    scale = float(per[torch.isfinite(per)].max()) if bool(torch.isfinite(per).any()) else 0.0
    tol = relative_tolerance(x.dtype) * scale
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    if not bool(torch.isfinite(per).all()):
        return Check(4, "causal_gradient_form", False, None, "the gradients d out_i / d x_j hold non-finite values")
    leaks = (per > tol) & future
    if bool(leaks.any()):
        i, j = (int(v) for v in leaks.nonzero()[0])
        worst = float(per[future].max())
        return Check(4, "causal_gradient_form", False, worst,
                     f"d out_{i} / d x_{j} is nonzero ({float(per[i, j]):.3g} > tolerance {tol:.3g}) with j > i: "
                     "the output depends on a future position")
    past_dead = [i for i in range(t) if not float(per[i, : i + 1].max()) > tol]
    if past_dead:
        return Check(4, "causal_gradient_form", False, 0.0,
                     f"d out_{past_dead[0]} / d x_j is zero for every j <= {past_dead[0]}: the gradient form is vacuous there")
    worst = float(per[future].max()) if t > 1 else 0.0
    return Check(4, "causal_gradient_form", True, worst,
                 f"d out_i / d x_j <= {worst:.3g} for all j > i (tolerance {tol:.3g}) and nonzero for some j <= i at every i")


def _intervention_check(result: Any, name: str) -> Check:
    if result.error is not None:
        return Check(4, name, False, None, result.error)
    value = result.max_prefix_delta
    return Check(4, name, result.ok, value, result.summary())


def _controls_check(embed_dim: int, num_heads: int, x: "torch.Tensor", seed: int) -> Check:
    import torch

    if embed_dim % num_heads:
        return _not_run(4, "intervention_controls", f"the built-in controls need embed_dim divisible by num_heads: {embed_dim}, {num_heads}")
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    parts, ok = [], True
    for name, _desc, control in builtin_controls(embed_dim, num_heads, seed, dtype):
        r = causal_intervention(module_forward(control), x.to(dtype), grad_mode="no_grad", seed=seed)
        leaked = r.verdict == "leak"
        ok = ok and leaked
        parts.append(f"{name}: {r.verdict} (max prefix |delta| {r.max_prefix_delta:.3g})")
    detail = "built-in pipeline at these sizes, " + "; ".join(parts)
    detail += ": both leak, so the probe can fail here" if ok else ": a control did not leak, so the probe has no power here"
    return Check(4, "intervention_controls", ok, None, detail)


def check_module(
    factory: Callable[..., Any],
    embed_dim: int,
    num_heads: int,
    *,
    causal: bool = True,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 6,
    progress: Callable[[int, int], None] | None = None,
    subject: str = "module",
) -> ModuleCheckReport:
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

    Returns:
        A :class:`ModuleCheckReport`; ``exit_code`` 0 when every check passes, 1 on a finding.

    Raises:
        InputError: sizes out of range.
        SetupError: the factory raised or returned something other than an ``nn.Module``.
    """
    import torch

    for fname, value, low in (("embed_dim", embed_dim, 1), ("num_heads", num_heads, 1), ("batch_size", batch_size, 2), ("seq_len", seq_len, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise field_error(fname, value, f"an integer >= {low}")
    total = 7
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_module(factory, embed_dim, num_heads)
        training_on_entry = bool(module.training)
        dtype = _module_dtype(module)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, seq_len, embed_dim, generator=g, dtype=torch.float64).to(dtype)  # [B, T, E]
        fwd = module_forward(module)
        notes: list[str] = []
        if training_on_entry:
            notes.append("the module came back in training mode: output comparisons ran in eval mode, gradients in training mode")
        module.eval()

        l1, y = _shape_checks(fwd, x)
        tick()
        layout, why_not = recognise_layout(module, num_heads)
        if y is None:
            reason = "the forward on [B, T, E] failed (level 1)"
            names = [(2, "batch_independence")]
            names += [] if causal else [(2, "permutation_equivariance")]
            names += [(3, "finite_output"), (3, "input_gradient"), (3, "parameter_gradients"), (4, "eval_determinism")]
            if causal:
                names += [(4, "causal_intervention_no_grad"), (4, "causal_intervention_autograd"),
                          (4, "intervention_controls"), (4, "causal_gradient_form")]
            names += [(4, "reference_rebuild")]
            rest = [_not_run(level, name, reason) for level, name in names]
            return _finish(subject, embed_dim, num_heads, batch_size, seq_len, causal, l1 + rest,
                           layout.layout if layout else None, notes, progress, total)

        # Eval determinism is a behaviour (L4) check, but it runs first: every later
        # comparison of outputs (batch independence, permutation, rebuild, intervention)
        # assumes an eval-mode output is a function of the input. When it is not, those
        # comparisons would report dropout noise as a finding of their own, so they are
        # marked not run and the first finding is eval_determinism itself.
        det = eval_determinism(fwd, x)
        det_check = Check(4, "eval_determinism", det.identical, det.max_delta, det.summary())
        noisy = "eval-mode calls differ (see eval_determinism), so output comparisons would measure noise"
        tick()

        l2: list[Check] = []
        if det.identical:
            try:
                l2.append(_batch_independence(fwd, x, y, layout.hint if layout else _mha_hint(module)))
            except ForwardError as exc:
                l2.append(Check(2, "batch_independence", False, detail=str(exc)))
        else:
            l2.append(_not_run(2, "batch_independence", noisy))
        if not causal:
            if det.identical:
                try:
                    l2.append(_permutation(fwd, module, x, y, seed))
                except ForwardError as exc:
                    l2.append(Check(2, "permutation_equivariance", False, detail=str(exc)))
            else:
                l2.append(_not_run(2, "permutation_equivariance", noisy))
        tick()

        finite = bool(torch.isfinite(y).all())
        l3 = [Check(3, "finite_output", finite, float((~torch.isfinite(y)).sum()),
                    "every output value is finite" if finite else f"{int((~torch.isfinite(y)).sum())} output values are not finite")]
        l3 += _gradient_checks(module, x)
        module.eval()
        tick()

        l4: list[Check] = [det_check]
        # The intervention comes before the rebuild: when both fail, "position 0 moved when
        # position 1 changed" says more than "the outputs differ".
        if causal:
            if det.identical:
                for mode in ("no_grad", "autograd"):
                    r = causal_intervention(fwd, x, grad_mode=mode, seed=seed)
                    l4.append(_intervention_check(r, f"causal_intervention_{mode}"))
            else:
                l4 += [_not_run(4, "causal_intervention_no_grad", noisy), _not_run(4, "causal_intervention_autograd", noisy)]
            tick()
            l4.append(_controls_check(embed_dim, num_heads, x, seed))
            try:
                l4.append(_gradient_form(fwd, x, seed) if det.identical else _not_run(4, "causal_gradient_form", noisy))
            except ForwardError as exc:
                l4.append(Check(4, "causal_gradient_form", False, detail=str(exc)))
            except Exception as exc:
                l4.append(Check(4, "causal_gradient_form", False, detail=f"backward raised {type(exc).__name__}: {_first_line(exc)}"))
        if layout is None:
            l4.append(_not_run(4, "reference_rebuild", f"layout not recognised: {why_not}"))
        elif not det.identical:
            l4.append(_not_run(4, "reference_rebuild", noisy))
        else:
            ref = rebuild_reference(layout, x, causal)  # [B, T, E] float64
            ok, delta, tol = _close(y, ref, y.dtype)
            detail = (f"{layout.layout}: output vs float64 rebuild from the module's weights "
                      f"({'causal' if causal else 'no'} mask), max |delta| {delta:.3g} {'<=' if ok else '>'} tolerance {tol:.3g}")
            if not ok and layout.hint:
                detail += f"; {layout.hint}"
            l4.append(Check(4, "reference_rebuild", ok, delta, detail))
        tick()
    return _finish(subject, embed_dim, num_heads, batch_size, seq_len, causal, l1 + l2 + l3 + l4,
                   layout.layout if layout else None, notes, progress, total)


def _mha_hint(module: "nn.Module") -> str:
    from torch import nn

    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention) and not sub.batch_first:
            return f"nn.MultiheadAttention at {prefix or '(root)'} has batch_first=False: it reads [B, T, E] as [T, B, E]"
    return ""


def _finish(subject, embed_dim, num_heads, batch_size, seq_len, causal, checks, layout, notes, progress, total) -> ModuleCheckReport:
    if progress:
        progress(total, total)
    ordered = tuple(sorted(checks, key=lambda c: c.level))  # stable: keeps the listed order within a level
    return ModuleCheckReport(subject, embed_dim, num_heads, batch_size, seq_len, causal, ordered, layout, tuple(notes))


__all__ = ["ModuleCheckReport", "check_module", "build_module", "recognise_layout", "rebuild_reference"]
