"""Check a user's attention *module* against the contract ``[B, T, E] -> [B, T, E]``.

The factory protocol: ``factory(embed_dim, num_heads)`` returns an ``nn.Module`` whose
``forward(x)`` maps ``[B, T, E]`` to ``[B, T, E]`` (or a tuple whose first item is that).
It may come back in training mode with dropout; the checks that compare outputs run it
in eval mode, the gradient checks in training mode (gradcheck in eval mode, in float64).

Two kinds of check, in rows by aspect and ordered by level, so the first failure is the
lowest level that shows a problem:

* black-box, from calls on ``[B, T, E]``: the output layout and the T = 1 / B = 1 calls (L1),
  batch independence and, without ``causal``, permutation equivariance (L2), finite output and
  gradients (L3) and, from the observed core, each query's weights summing to 1 over the keys (L3
  ``key_row_sums``), eval determinism and the causal intervention with its controls (L4);
* observed: the forward runs once under a torch function mode that records the projections
  of the input, the q, k, v that entered the attention computation and its context
  (:mod:`attn_ledger.probes.common.observe`), whatever the module's parameter names and layout; the core
  is judged from those tensors (:mod:`attn_ledger.probes.module.core`): head split, kv pairing and
  head merge (L2), the mask relation, the effective softmax scale, rotary positions, score
  designs and the context against float64 attention (L4).

When no core can be observed (a fused kernel that never exposes q, k, v), the observed
checks are skipped and the report's ``coverage`` says the verdict rests on black-box checks.
Only a factory that raises, exits or returns no module is an error (:class:`SetupError`);
every other problem is a result. A forward or backward that exits, or runs past the time
limit of :mod:`attn_ledger.guard` (or, in a worker, crashes), stops the check: the report then
has one ``call`` row, the L1 ``call`` finding naming that call, and nothing else is reached.
The observed forwards and gradcheck are guarded calls like the others, so in a worker the
observation runs where the module runs and its results cross back as plain data.

Public: :func:`check_module` (build with the factory, then check) and
:func:`check_built_module` (check a module already built), :func:`stopped_module_report`,
:func:`validate_module_options`, :data:`ASPECTS`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from attn_ledger.probes.module import decode as decodecheck
from attn_ledger.probes.module.core import (AXIS_CHECKS, CORE_CHECKS, OBSERVED, SUM_CHECKS, Audit, Declared, audit_core,
                                            check_level)
from attn_ledger.maths.relations import module_relation
from attn_ledger.errors import field_error
from attn_ledger.errors import field_error, first_line
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.probes.common.forward import (
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
from attn_ledger.probes.module.grads import gradcheck_check, gradient_checks
from attn_ledger.report import (Check, Coverage, Finding, Note, Report, Row, Status, bounded, counted, first_finding_of,
                                row_status, unjudged)
from attn_ledger.seeding import generator, manual_seed
from attn_ledger.tolerance import relative as relative_tolerance

if TYPE_CHECKING:
    import torch
    from torch import nn

# Parameter or buffer names that suggest the module encodes positions, which makes a
# permutation probe inconclusive rather than failed, where observation found nothing positional.
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
    "axes": ((2, "batch_independence"), (2, "permutation_equivariance"), *((2, n) for n in AXIS_CHECKS)),
    "numerics": ((3, "finite_output"), (3, "input_gradient"), (3, "parameter_gradients"), (3, "gradcheck"),
                 *((3, n) for n in SUM_CHECKS)),
    "determinism": ((4, "eval_determinism"),),
    "causality": ((4, "causal_intervention_no_grad"), (4, "causal_intervention_autograd"),
                  (4, "intervention_controls"), (4, "causal_gradient_form")),
    "core": tuple((4, n) for n in CORE_CHECKS),
}
# The headline (first finding) where one observation fails several checks: a check that names a cause, most
# specific first, over a check that shows only a downstream symptom of it (see _headline).
CAUSES = ("key_row_sums", "mask_relation", "effective_scale")
SYMPTOMS = frozenset({"causal_intervention_no_grad", "causal_intervention_autograd", "causal_gradient_form",
                      "permutation_equivariance", "attention_core"})
CAUSAL_ONLY = frozenset({"causal_intervention_no_grad", "causal_intervention_autograd", "intervention_controls",
                         "causal_gradient_form"})
NOT_CAUSAL_ONLY = frozenset({"permutation_equivariance"})

def _batch_first_hint(prefix: str, mha: "nn.MultiheadAttention") -> str:
    if mha.batch_first:
        return ""
    return f"nn.MultiheadAttention at {prefix or '(root)'} has batch_first=False: it reads [B, T, E] as [T, B, E]"


def _mha_hint(module: "nn.Module") -> str:
    """The batch_first hint for any nn.MultiheadAttention inside, where no layout was recognised."""
    from torch import nn

    from attn_ledger.guard import forwarded as is_remote

    if is_remote(module):  # the parent's stand-in: what the worker saw inside the module
        prefix, _ = next(((p, f) for p, f in module.remote_facts["mha"] if not f), (None, True))
        return "" if prefix is None else (f"nn.MultiheadAttention at {prefix or '(root)'} has batch_first=False: "
                                          "it reads [B, T, E] as [T, B, E]")
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention) and not sub.batch_first:
            return _batch_first_hint(prefix, sub)
    return ""


# --- the checks -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Subject:
    """What the checks after level 1 read: the module (in eval mode), its forward, the input and output."""

    module: "nn.Module"
    fwd: Callable[[Any], Any]
    x: "torch.Tensor"  # [B, T, E]
    y: "torch.Tensor"  # [B, T, E], the eval-mode output
    seed: int
    declared: Declared

    @property
    def causal(self) -> bool:
        return self.declared.causal


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


def _permutation(s: _Subject, observed: tuple[str, ...]) -> Check:
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
    if observed:
        return Check(2, "permutation_equivariance", "inconclusive", measure, c.delta, c.tolerance, "<=",
                     reason=f"the module encodes positions ({'; '.join(observed)}), so order may legitimately matter",
                     data={**data, "positional": list(observed)})
    positional = _positional_names(s.module)
    if positional:
        return Check(2, "permutation_equivariance", "inconclusive", measure, c.delta, c.tolerance, "<=",
                     reason="the module has positional state, so order may legitimately matter",
                     data={**data, "positional": positional[:3]})
    return bounded(2, "permutation_equivariance", measure, c.delta, c.tolerance, data=data,
                   reason="without a causal mask or positional encoding, attention should not care about order "
                          "(a module that encodes positions under names this probe does not know makes this inconclusive)")


def _axis_checks(s: _Subject, hint: str, noisy: bool, positional: tuple[str, ...]) -> list[Check]:
    """L2 black-box: batch independence; without ``causal``, permutation equivariance."""
    probes: list[tuple[str, Callable[[], Check]]] = [("batch_independence", lambda: _batch_independence(s, hint))]
    if not s.causal:
        probes.append(("permutation_equivariance", lambda: _permutation(s, positional)))
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
    t = x.shape[1]
    cuts = sorted({0, (t - 1) // 2, t - 2})  # a control leaks at every cut; three show it at the edges and middle
    for name, _desc, control in builtin_controls(embed_dim, num_heads, seed, dtype):
        results[name] = causal_intervention(module_forward(control), x.to(dtype), cuts=cuts, grad_mode="no_grad",
                                            seed=seed)
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
        checks.append(Check(4, "causal_gradient_form", "fail", reason=f"backward raised {type(exc).__name__}: {first_line(exc)}",
                            data={"exception": type(exc).__name__}))
    return checks

def _numeric_checks(s: _Subject, embed_dim: int, noisy: bool) -> list[Check]:
    """L3: finite output, gradients in training mode, gradcheck in float64 (the module is left in eval mode).

    gradcheck compares the backward with finite differences of eval-mode forwards, so it is
    not reached when eval-mode calls differ.
    """
    import torch

    finite = counted(3, "finite_output", "non-finite output values", int((~torch.isfinite(s.y)).sum()))
    checks = [finite] + gradient_checks(s.module, s.x)
    s.module.eval()
    checks.append(_not_reached(3, "gradcheck", NOISY) if noisy else gradcheck_check(s.module, embed_dim, s.seed))
    s.module.eval()
    return checks


# --- the report ----------------------------------------------------------------------------

def _validate(**sizes: tuple[int, int]) -> None:
    for name, (value, low) in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise field_error(name, value, f"an integer >= {low}")


def _expected(causal: bool) -> list[tuple[int, str]]:
    """Every check this run makes, in row order."""
    skip = NOT_CAUSAL_ONLY if causal else CAUSAL_ONLY
    return [(level, name) for members in ASPECTS.values() for level, name in members if name not in skip]


def _observed(module: "nn.Module", x: "torch.Tensor", declared: Declared, embed_dim: int, noisy: bool) -> Audit:
    """The observed core's checks; not reached when eval-mode calls differ (they would judge noise)."""
    if noisy:
        return Audit({n: _not_reached(check_level(n), n, NOISY) for n in OBSERVED})
    return audit_core(module, x, declared, embed_dim=embed_dim, dtype=module_dtype(module))


def _run_checks(module: "nn.Module", x: "torch.Tensor", declared: Declared, embed_dim: int, num_heads: int,
                seed: int, tick: Callable[[], None]) -> tuple[list[Check], Audit | None]:
    """Every check, in level order; after a failed level-1 forward, the rest are not reached.

    Eval determinism is a behaviour (L4) check, but it runs first: every later comparison
    of outputs (batch independence, permutation, the observed core, the intervention)
    assumes an eval-mode output is a function of the input. When it is not, those
    comparisons would report dropout noise as a finding of their own, so they are not
    reached and the first finding is eval_determinism itself. The observation runs next,
    so the permutation probe knows whether the core encodes positions.
    """
    fwd = module_forward(module)
    l1, y = _shape_checks(fwd, x)
    tick()
    if y is None:
        return l1 + [_not_reached(level, name, FORWARD_FAILED) for level, name in _expected(declared.causal)[len(l1):]], None
    s = _Subject(module, fwd, x, y, seed, declared)
    det = eval_determinism(fwd, x)
    noisy = not det.identical
    audit = _observed(module, x, declared, embed_dim, noisy)
    tick()
    checks = l1 + _axis_checks(s, _mha_hint(module), noisy, audit.positional) + [audit.checks[n] for n in AXIS_CHECKS]
    tick()
    checks += _numeric_checks(s, embed_dim, noisy) + [audit.checks[n] for n in SUM_CHECKS]
    tick()
    checks.append(determinism_check(det))
    if declared.causal:
        checks += _causal_checks(s, embed_dim, num_heads, noisy)
        tick()
    checks += [audit.checks[n] for n in CORE_CHECKS]
    return checks, audit


def _row(name: str, checks: tuple[Check, ...]) -> Row:
    status: Status = "not_reached" if all(c.status == "not_reached" for c in checks) else row_status(checks)
    return Row(name, status, checks)


def check_module(factory: Callable[..., Any], embed_dim: int, num_heads: int, *, seed: int = 0, **options: Any) -> Report:
    """Check a module built by ``factory(embed_dim, num_heads)`` against the attention contract.

    Args:
        factory: the already-loaded callable returning an ``nn.Module``.
        embed_dim, num_heads, seed: as :func:`check_built_module` takes them; ``seed`` also seeds
            torch's generator around the factory.
        options: the other keywords of :func:`check_built_module` (``causal``, ``window``, ``scale``, ``softcap``,
            ``batch_size``, ``seq_len``, ``progress``, ``subject``, ``decode``), refused before the factory
            runs where out of range.

    Returns:
        A :class:`~attn_ledger.report.Report` (command ``check``), one row per aspect
        (:data:`ASPECTS`); ``exit_code`` 0 when no check fails, 1 on a finding.

    Raises:
        InputError: sizes, window, scale or softcap out of range, or ``decode`` without ``causal``.
        SetupError: the factory raised, exited or returned something other than an ``nn.Module``.
    """
    import torch

    bound = inspect.signature(check_built_module).bind(None, embed_dim, num_heads, seed=seed, **options)
    bound.apply_defaults()  # the declaration with check_built_module's defaults, checked before the factory runs
    given = bound.arguments
    _declared(embed_dim, num_heads, given["batch_size"], given["seq_len"], given["causal"], given["window"],
              given["scale"], given["decode"], given["softcap"], given["sinks"])
    with torch.random.fork_rng(devices=[]):
        manual_seed(seed)
        module = build_module(factory, embed_dim, num_heads)
        return check_built_module(module, embed_dim, num_heads, seed=seed, **options)


def check_built_module(  # long by its documented arguments; the code is about 30 lines
    module: "nn.Module",
    embed_dim: int,
    num_heads: int,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    seq_len: int = SEQ_LEN,
    progress: Callable[[int, int], None] | None = None,
    subject: str = "module",
    decode: Callable[..., Any] | None = None,
) -> Report:
    """Check a module already built against the attention contract; torch's global generator goes on from where the
    caller left it (:func:`check_module` builds it from a factory first).

    Args:
        module: the ``nn.Module`` (put in eval mode for the checks).
        embed_dim: E, used for the input ``[B, T, E]``.
        num_heads: Nh (the checks read the head count the module uses).
        causal: the module is meant to be causal: check causality (intervention, controls,
            gradient form) and expect the causal relation; otherwise check permutation
            equivariance and expect a bidirectional core.
        window: with ``causal``, the module is meant to use a sliding window of this many keys
            (query i uses keys i-window+1..i).
        scale: the design's own softmax scale, where it is not 1/sqrt(Dh).
        softcap: the scaled scores are soft-capped, ``softcap * tanh(s / softcap)``, before the
            mask (Gemma 2's ``attn_logit_softcapping``); a cap the core does not apply fails.
        sinks: attention sinks, one logit per head in the softmax's denominator (gpt-oss's ``sinks``): a number
            for every head, a sequence of Nh, or their text (``--sinks``); sinks the core does not apply fail.
            Undeclared sinks the weights show pass, named.
        seed: seeds the inputs and torch's generator around the forwards.
        batch_size: B (at least 2, so batch independence can be judged).
        seq_len: T (at least 2).
        progress: ``callback(done, total)`` after each check group.
        subject: a name for the output.
        decode: ``decode(module, x_new, cache) -> (y_new, cache)``: adds the KV-cache decode
            parity rows of :mod:`attn_ledger.probes.module.decode` (needs ``causal``).

    A call into the module (or into ``decode``) that exits or runs past its time limit stops
    the check (see :func:`stopped_module_report`).

    Returns:
        A :class:`~attn_ledger.report.Report` (command ``check``), one row per aspect
        (:data:`ASPECTS`); ``exit_code`` 0 when no check fails, 1 on a finding.

    Raises:
        InputError: sizes, window, scale or softcap out of range, or ``decode`` without ``causal``.
    """
    import torch

    declared = _declared(embed_dim, num_heads, batch_size, seq_len, causal, window, scale, decode, softcap, sinks)
    total, done = (5 if causal else 4) + (len(decodecheck.plan_scenarios()) if decode is not None else 0), 0

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
    try:
        with _one_thread():
            checks, audit = _run_checks(module, x, declared, embed_dim, num_heads, seed, tick)
            decoded = decodecheck.decode_rows(module, decode, embed_dim, seed=seed, progress=lambda d, t: tick()) \
                if decode is not None else None
    except UserCodeError as exc:
        return stopped_module_report(subject, sizes, causal, f"{exc.what} {exc}", exc.facts(), dtype, training_on_entry,
                                     window=window, scale=scale, softcap=softcap, sinks=declared.sinks)
    if progress:
        progress(total, total)
    report = _module_report(checks, subject, sizes, declared, audit, dtype, training_on_entry)
    return report if decoded is None else decodecheck.with_decode(report, *decoded)


def stopped_module_report(subject: str, sizes: dict[str, int], causal: bool, reason: str, data: dict[str, Any],
                          dtype: str | None = None, training_on_entry: bool = False, *, window: int | None = None,
                          scale: float | None = None, softcap: float | None = None, sinks: Any = None) -> Report:
    """The report when a call into the module did not come back (an exit, the time limit, a crash).

    Its ``call`` row holds the L1 ``call`` finding (``reason`` and ``data`` say which call and
    how it ended); every other check is not reached, since no later call could be trusted to return.
    """
    called = Check(1, "call", "fail", reason=reason, data=data)
    rest = [_not_reached(level, name, "the check stopped at a call that did not return") for level, name in _expected(causal)]
    declared = Declared(module_relation(causal, window), scale=scale, softcap=softcap, sinks=sinks)
    return _module_report([called, *rest], subject, sizes, declared, None, dtype, training_on_entry, stopped=True)


def validate_module_options(embed_dim: int, num_heads: int, *, causal: bool = True, window: int | None = None,
                            scale: float | None = None, batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN,
                            softcap: float | None = None, sinks: Any = None) -> None:
    """Refuse, before anything runs, sizes and declarations :func:`check_module` would refuse.

    Raises:
        InputError: naming the option, the value and what was expected.
    """
    _declared(embed_dim, num_heads, batch_size, seq_len, causal, window, scale, softcap=softcap, sinks=sinks)


def _declared(embed_dim: int, num_heads: int, batch_size: int, seq_len: int, causal: bool, window: int | None,
              scale: float | None, decode: Callable[..., Any] | None = None,
              softcap: float | None = None, sinks: Any = None) -> Declared:
    from attn_ledger.inputs.sinks import parse_sinks

    _validate(embed_dim=(embed_dim, 1), num_heads=(num_heads, 1), batch_size=(batch_size, 2), seq_len=(seq_len, 2))
    if decode is not None and not causal:
        raise field_error("decode", getattr(decode, "__name__", "decode"),
                          "a causal module (decode parity compares with the causal forward)")
    return Declared(module_relation(causal, window), scale=None if scale is None else float(scale),
                    softcap=float(softcap) if isinstance(softcap, int) and not isinstance(softcap, bool) else softcap,
                    sinks=parse_sinks(sinks, num_heads))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run on one intra-op thread, then restore the count.

    The module check calls the module hundreds of times on tensors of a few thousand
    values, where a second thread adds only synchronisation: on a busy machine a small
    matmul took 1.2 ms on two threads and 5 us on one.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _module_report(checks: list[Check], subject: str, sizes: dict[str, int], declared: Declared, audit: Audit | None,
                   dtype: str | None, training_on_entry: bool, stopped: bool = False) -> Report:
    """The checks in rows by aspect; coverage where the core could not be observed in full, or the check stopped."""
    by_name = {c.name: c for c in checks}
    rows = [_row(aspect, found) for aspect, members in ASPECTS.items()
            if (found := tuple(by_name[n] for _, n in members if n in by_name))]
    if "call" in by_name:  # the check stopped at a call into the module that did not return
        rows.insert(0, Row("call", by_name["call"].status, (by_name["call"],)))
    found = dict(audit.details) if audit else {}
    notes: list[Note] = []
    if found.get("core"):
        notes.append(Note("observed_core", {"core": found["core"], "layout": found.get("layout")}))
        notes.append(Note("found", {key: found.get(key) for key in ("relation", "scale", "rotary", "design")}))
    notes += list(audit.notes) if audit else []
    if training_on_entry:
        notes.append(Note("training_on_entry", {"ran": "check"}))
    details = {"subject": subject, "protocol": "module", "sizes": sizes, "causal": declared.causal,
               "window": declared.window, "scale": declared.scale, "softcap": declared.softcap,
               "sinks": None if declared.sinks is None else list(declared.sinks),
               "relation": declared.text,
               "layout": found.get("layout"), "observed": found if found.get("core") else None, "dtype": dtype,
               "training_mode_on_entry": training_on_entry}
    coverage = audit.coverage if audit else None
    if stopped:
        coverage = Coverage("stopped", tuple(n for _, n in _expected(declared.causal)),
                            "a call into the module did not come back, so no other check ran")
    hints = audit.hints if audit else ()
    title = (f"MODULE CHECK {subject} B={sizes['B']} T={sizes['T']} E={sizes['E']} Nh={sizes['Nh']} "
             f"{declared.text if declared.causal else 'not causal'}"
             f"{f', soft-cap {declared.softcap:g}' if declared.softcap is not None else ''}"
             f"{', sinks' if declared.sinks is not None else ''}")
    return Report("check", title, tuple(rows), first_finding=_headline(rows), coverage=coverage, notes=tuple(notes),
                  details=details, unit="check", row_label="aspect", hints=hints)


def _headline(rows: list[Row]) -> Finding | None:
    """The first finding by row order, unless it is a symptom (:data:`SYMPTOMS`: a causality leak, a permutation,
    the context differing) and a check that names a cause failed too (:data:`CAUSES`, the most specific first):
    then that cause. Weights normalised over the queries leak the future and change the context; the row sums
    say why."""
    first = first_finding_of(rows)
    if first is None or first.name not in SYMPTOMS:
        return first
    failed = {c.name: (r.name, c) for r in rows for c in r.checks if c.failed}
    cause = next((failed[n] for n in CAUSES if n in failed), None)
    return first if cause is None else Finding(*cause)


__all__ = ["ASPECTS", "BATCH_SIZE", "SEQ_LEN", "Declared", "build_module", "check_built_module", "check_module",
           "stopped_module_report", "validate_module_options"]
