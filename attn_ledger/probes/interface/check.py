"""Black-box checks for a function registered in transformers' ``AttentionInterface``.

The protocol (transformers 5, every decoder family)::

    def my_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        ...
        return attn_output, attn_weights  # [B, Tq, H, D] (transposed back), [B, H, Tq, Tk] or None

The function is called in the worker as a layer calls it (:mod:`attn_ledger.probes.interface.driver`:
the stand-in module, transformers' own masks, the families' keyword arguments); everything here runs
in the tool's own process from the raw tensors that come back, with no transformers import.

Checks, at the ledger's levels:

* L1 ``call`` (returns on a legal case), ``layout`` (the output is ``[B, Tq, H, D]``; one returned
  as ``[B, H, Tq, D]`` is named), ``dtype``;
* L3 ``finite`` (rows with an allowed key), ``padded_rows`` (a query whose every key is padding
  follows the contract: ``finite``, the default, takes any finite row, so eager's uniform rows and
  sdpa's zero rows both pass, and NaN or inf is a finding; ``zeros``; ``any``), ``weights_sum``
  (returned weights sum to one over the keys, or to one minus the sink's share with sinks);
* L4 ``reference`` (agreement with a float64 reference that applies the case's scaling, mask,
  window, soft-cap and sinks; on a failure the output is compared with the reference of each bug
  the protocol invites, and a match names it: kv heads tiled, scaling ignored, mask polarity
  flipped, soft-cap ignored, sinks dropped, a window one too wide, the output not transposed back).

The tolerance is the kernel rule of :func:`attn_ledger.tolerance.kernel_bound`: a factor times the
error of the plain same-dtype computation (eager's order and sdpa's, the larger), plus a floor.
A case in training mode (dropout given) is judged for its call, layout and finiteness only.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from attn_ledger.errors import InputError, first_line
from attn_ledger.guard import UserCodeError, rebuilt_exception
from attn_ledger.probes.interface.cases import (
    DTYPES,
    FEATURES,
    MASK_FUNCTIONS,
    ICase,
    allowed,
    case_tensors,
    interface_cases,
    parse_icase,
    perturbed,
)
from attn_ledger.report import (
    Check, Finding, Note, Report, Row, bounded, carry_diagnosis, counted, row_status, unjudged,
)
from attn_ledger.tolerance import EPS, kernel_bound

if TYPE_CHECKING:
    from torch import Tensor

PROTOCOL = "transformers"
PARAMETERS = ("module", "query", "key", "value", "attention_mask")
EMPTY_ROWS = ("finite", "zeros", "any")
CHECK_ORDER = ((1, "call"), (1, "layout"), (1, "dtype"), (2, "batch_isolation"), (2, "kv_head_isolation"),
               (2, "q_head_isolation"), (3, "finite"), (3, "padded_rows"), (3, "weights_sum"), (4, "reference"))
_POSITION = {name: i for i, (_, name) in enumerate(CHECK_ORDER)}


def is_interface(signature: Any) -> bool:
    """Whether a signature reads as an attention-interface function: its first five positional
    parameters are ``module, query, key, value, attention_mask``."""
    if not isinstance(signature, inspect.Signature):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in signature.parameters.values() if p.kind in kinds]
    return tuple(names[:5]) == PARAMETERS


# --- the declaration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Declaration:
    """What the function takes: the mask functions registered for its name (``sdpa``: sdpa's, bool masks
    or None; ``eager``: eager's additive masks; ``none``: no mask function, None with module.is_causal;
    ``flex``: flex's BlockMask; sdpa's cases include the calls without a mask), dtypes, and the features it applies itself
    (``window``: ``sliding_window``, ``softcap``, ``sinks``: ``s_aux``). An undeclared feature is never passed."""

    masks: tuple[str, ...] = ("sdpa", "eager")
    dtypes: tuple[str, ...] = tuple(DTYPES.values())
    supports: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"masks": list(self.masks), "dtypes": list(self.dtypes), "supports": list(self.supports)}


def _names(value: Any, field_name: str, choices: Sequence[str], allow_empty: bool = False) -> tuple[str, ...]:
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and not items and allow_empty:
        return ()
    if not isinstance(items, (list, tuple)) or not items:
        raise InputError(f"{field_name}: got {value!r}, expected a non-empty list of {', '.join(choices)}")
    short = {k: v for k, v in DTYPES.items()} if "float32" in choices else {}
    out: list[str] = []
    for item in items:
        name = short.get(item, item) if isinstance(item, str) else item
        if name not in choices:
            raise InputError(f"{field_name}: got {item!r}, expected one of {', '.join(choices)}")
        if name not in out:
            out.append(name)
    return tuple(sorted(out, key=list(choices).index))


def declaration(values: Mapping[str, Any], source: str = "") -> Declaration:
    """A declaration from ``masks``, ``dtypes`` and ``supports`` (None: the default); other keys are refused.

    Raises:
        InputError: an unknown key or a value of the wrong kind (one line naming it).
    """
    d: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        name = f"{source}{key}"
        if key == "masks":
            d["masks"] = _names(value, name, MASK_FUNCTIONS)
        elif key == "dtypes":
            d["dtypes"] = _names(value, name, tuple(DTYPES.values()))
        elif key == "supports":
            d["supports"] = () if value == "none" else _names(value, name, FEATURES, allow_empty=True)
        else:
            raise InputError(f"{name}: does not apply to --protocol transformers, expected masks, dtypes or supports")
    return Declaration(**d)


# --- calling ------------------------------------------------------------------------------------


def call_text(case: ICase, name: str, passes: Iterable[str]) -> str:
    """The call as a layer writes it."""
    on = set(passes)
    args = [f"dropout={0.0 if case.train is None else case.train:g}", f"scaling={case.effective_scaling:g}"]
    if "window" in on:
        args.append(f"sliding_window={case.window}")
    if "softcap" in on:
        args.append(f"softcap={case.softcap:g}")
    if "sinks" in on:
        args.append("s_aux=module.sinks")
    mask = {"sdpa": "sdpa_mask(...)", "eager": "eager_mask(...)", "none": "None",
            "flex": "flex_attention_mask(...)"}[case.mask]
    return f"{name}(module, query, key, value, {mask}, {', '.join(args)})"


def _call(target: Any, t: dict[str, "Tensor"], case: ICase, passes: list[str], returns: str, what: str,
          sinks_declared: bool = False) -> "Tensor":
    """One call through the kernel driver (in the worker for the CLI); raises what the call raised."""
    kw: dict[str, Any] = {"interface": {"case": case.id, "returns": returns, "passes": passes,
                                        "sinks_declared": sinks_declared}}
    if "sinks" in t:
        kw["sinks"] = t["sinks"]
    called = target.forward(t["query"], t["key"], t["value"], kw, what)
    error = called.facts.get("error")
    if error is not None:
        if error["kind"] == "raised":
            raise rebuilt_exception(error)
        raise UserCodeError(error["text"], error.get("what") or what, **error.get("data", {}))
    return called.tensors["out"]


# --- the reference ------------------------------------------------------------------------------


def reference(case: ICase, t: dict[str, "Tensor"], *, dtype: Any = None, scale_first: bool = False,
              **bug: Any) -> tuple["Tensor", "Tensor"]:
    """``(out [B, H, Tq, D], weights [B, H, Tq, Tk])`` of the case in ``dtype`` (float64 by default; half
    precision rounds every step and runs the softmax in float32, as eager does). ``bug`` computes a wrong
    variant instead: ``tiled`` kv heads, ``scaling`` given, ``flipped`` mask, ``softcap=None``,
    ``sinks=False``, ``window`` given."""
    import torch

    f64 = torch.float64
    rnd = dtype if dtype is not None and dtype != f64 else None

    def r(x: "Tensor") -> "Tensor":
        return x if rnd is None else x.to(rnd).to(torch.float32)

    work = torch.float32 if rnd is not None else f64
    q, k, v = (t[n].to(work) for n in ("query", "key", "value"))
    g = case.groups
    k, v = ((x.repeat(1, g, 1, 1) if bug.get("tiled") else x.repeat_interleave(g, dim=1)) for x in (k, v))
    scaling = bug.get("scaling", case.effective_scaling)
    s = r(torch.matmul(r(q * scaling), k.transpose(-2, -1))) if scale_first else r(r(q @ k.transpose(-2, -1)) * scaling)
    cap = bug.get("softcap", case.softcap)
    if cap is not None:
        s = r(torch.tanh(s / cap) * cap)
    window = bug.get("window", case.window)
    allow = allowed(ICase(**{**_fields(case), "window": window}))  # [B, 1, Tq, Tk]
    if bug.get("flipped"):
        allow = ~allow
    live = allow.any(dim=-1, keepdim=True)
    s = torch.where(allow, s, float("-inf")).where(live, 0.0)
    if case.sinks and bug.get("sinks", True):
        col = t["sinks"].to(work)[None, :, None, None].expand(*s.shape[:-1], 1)
        w = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        w = torch.softmax(s, dim=-1)
    w = r(w.where(live, 0.0))
    return r(torch.matmul(w, v)), w


def _fields(case: ICase) -> dict[str, Any]:
    return {f: getattr(case, f) for f in ICase.__dataclass_fields__}


def _bugs(case: ICase) -> list[tuple[str, dict[str, Any]]]:
    """The wrong variants worth naming for this case."""
    out: list[tuple[str, dict[str, Any]]] = []
    if case.groups > 1 and case.hkv > 1:
        out.append(("kv heads tiled (repeat) instead of repeated per group (repeat_kv)", {"tiled": True}))
    default = case.d ** -0.5
    if abs(case.effective_scaling - default) > 1e-12:
        out.append((f"scaling ignored: 1/sqrt(head_dim) = {default:g} used instead of scaling="
                    f"{case.effective_scaling:g}", {"scaling": default}))
    if abs(case.effective_scaling - 1.0) > 1e-12:
        out.append(("scaling ignored: no scaling applied (1.0)", {"scaling": 1.0}))
    if case.mask != "none":
        out.append(("the mask read with the wrong polarity (blocked where it allows)", {"flipped": True}))
    if case.softcap is not None:
        out.append(("softcap ignored: the scores were not soft-capped", {"softcap": None}))
    if case.sinks:
        out.append(("sinks dropped: s_aux (module.sinks) is not in the softmax denominator", {"sinks": False}))
    if case.window is not None:
        out.append((f"a window of {case.window + 1} keys, one wider than sliding_window={case.window}",
                    {"window": case.window + 1}))
    return out


# --- one case -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ICaseResult:
    case: ICase
    checks: tuple[Check, ...]

    @property
    def first_failure(self) -> Check | None:
        failing = [c for c in self.checks if c.failed]
        return min(failing, key=lambda c: (c.level, _POSITION.get(c.name, 99))) if failing else None

    @property
    def passed(self) -> bool:
        return self.first_failure is None


def _rest(after: int, why: str) -> list[Check]:
    return [unjudged(level, name, "not_reached", why) for level, name in CHECK_ORDER[after:]]


def check_icase(target: Any, case: ICase, decl: Declaration, *, name: str = "attention", seed: int = 0,
                empty_rows: str = "finite") -> ICaseResult:
    """Every check on one case. The user's mistakes become checks; a call that exits or hangs is L1 ``call``."""
    passes = [f for f in case.features if f in decl.supports]
    what = call_text(case, name, passes)
    t = case_tensors(case, seed)
    try:
        return _check(target, case, t, passes, what, empty_rows, "sinks" in decl.supports, seed)
    except UserCodeError as exc:
        return ICaseResult(case, (Check(1, "call", "fail", reason=f"{exc.what or what} {exc}", data=exc.facts()),
                                  *_rest(1, "the call did not return a result")))


# long: the checks of one case in their order, each a few lines, kept in one place so the order reads as the table
def _check(target: Any, case: ICase, t: dict[str, "Tensor"], passes: list[str], what: str,
           empty_rows: str, sd: bool, seed: int = 0) -> ICaseResult:
    import torch

    try:
        out = _call(target, t, case, passes, "output", what, sd)
    except UserCodeError:
        raise
    except Exception as exc:  # the user's code: a finding
        msg = first_line(exc)
        hint = ""
        if case.groups > 1 and ("size" in msg or "shape" in msg or "match" in msg):
            hint = (f" (with {case.h} query heads over {case.hkv} kv heads: are the kv heads repeated by "
                    f"module.num_key_value_groups = {case.groups}?)")
        return ICaseResult(case, (Check(1, "call", "fail", reason=f"{what} raised {type(exc).__name__}: {msg}{hint}",
                                        data={"exception": type(exc).__name__, "message": msg}),
                                  *_rest(1, "the call raised")))
    want = [case.b, case.tq, case.h, case.d]
    got = list(out.shape)
    checks = [Check(1, "call", "pass")]
    if got != want:
        transposed = got == [case.b, case.h, case.tq, case.d]
        why = (f"returned {got}, which is [B, H, Tq, D]: the output must be transposed back to [B, Tq, H, D] "
               f"= {want} (attn_output.transpose(1, 2))" if transposed else f"returned {got}, expected [B, Tq, H, D] = {want}")
        checks.append(Check(1, "layout", "fail", reason=why, data={"expected": want, "got": got, "transposed": transposed}))
        return ICaseResult(case, (*checks, *_rest(2, "wrong output layout")))
    checks.append(Check(1, "layout", "pass", data={"expected": want}))
    dt_ok = out.dtype == t["query"].dtype
    got_dt = str(out.dtype).removeprefix("torch.")
    checks.append(Check(1, "dtype", "pass" if dt_ok else "fail", data={"expected": case.dtype_name, "got": got_dt},
                        reason="" if dt_ok else f"output {got_dt}, expected {case.dtype_name} (the inputs' dtype)"))
    o = out.double().transpose(1, 2)  # [B, H, Tq, D]
    allow = allowed(case)  # [B, 1, Tq, Tk]
    live = allow.any(dim=-1).expand(case.b, case.h, case.tq)  # [B, H, Tq]
    empty = ~live
    bad = ~torch.isfinite(o).all(dim=-1) & live
    checks.append(counted(3, "finite", "non-finite rows among queries with an allowed key", int(bad.sum()),
                          location=_first(bad)))
    checks.append(_padded_rows(o, empty, empty_rows))
    ref, ref_w = reference(case, t)
    tol, facts = _tolerance(case, t, ref, live)
    call = _Calls(target, case, passes, what, sd)
    checks += _isolation(call, t, o, live if empty_rows != "zeros" else live | empty, tol, seed)
    checks.append(_weights(target, t, case, passes, what, ref_w, live, sd))
    if case.train is not None:
        checks.append(unjudged(4, "reference", "not_applicable", f"dropout={case.train:g} in training mode is random"))
    else:
        checks.append(_reference(case, t, o, ref, live, tol, facts))
    checks.sort(key=lambda c: _POSITION[c.name])
    return ICaseResult(case, carry_diagnosis(checks, _POSITION, "the output matches"))


@dataclass(frozen=True)
class _Calls:
    """How one case calls the function, for a call on other inputs (the probes)."""

    target: Any
    case: ICase
    passes: list[str]
    what: str
    sinks_declared: bool

    def output(self, t: dict[str, "Tensor"], what: str) -> "Tensor":
        return _call(self.target, t, self.case, self.passes, "output", f"{self.what} ({what})", self.sinks_declared)


def _isolation(call: _Calls, t: dict[str, "Tensor"], o: "Tensor", judged: "Tensor", tol: float,
               seed: int) -> list[Check]:
    """L2: fresh inputs for one example, one kv head or one query head move only the outputs they feed.

    ``o`` is the output ``[B, H, Tq, D]`` on ``t``; ``judged`` ``[B, H, Tq]`` the rows held to it (a fully
    padded row, where its contract lets it hold anything finite, is not). What the reference comparison
    cannot say, these name: which example or head leaked into which."""
    case = call.case
    if case.train is not None:
        return [unjudged(2, n, "not_applicable", f"dropout={case.train:g} in training mode is random")
                for n in ("batch_isolation", "kv_head_isolation", "q_head_isolation")]
    g, h = case.hkv - 1, case.h - 1
    served = list(range(g * case.groups, (g + 1) * case.groups))
    probes = (
        ("batch_isolation", case.b >= 2, "B = 1", "example", 0, ("query", "key", "value"), [0]),
        ("kv_head_isolation", case.hkv >= 2, "Hkv = 1", "kv head", g, ("key", "value"), served),
        ("q_head_isolation", case.h >= 2, "H = 1", "query head", h, ("query",), [h]),
    )
    out = []
    for name, applies, why, unit, index, parts, feeds in probes:
        if not applies:
            out.append(unjudged(2, name, "not_applicable", why))
            continue
        fresh = perturbed(case, t, seed, parts, example=index if unit == "example" else None,
                          head=None if unit == "example" else index)
        out.append(_probe(call, name, fresh, o, judged, tol, unit, index, feeds, t))
    return out


def _probe(call: _Calls, name: str, fresh: dict[str, "Tensor"], o: "Tensor", judged: "Tensor", tol: float,
           unit: str, index: int, feeds: list[int], t: dict[str, "Tensor"]) -> Check:
    """One isolation probe: the rows of ``feeds`` (examples, or query heads) may move, no other may. Where
    others move, a second call on the unchanged inputs ``t`` tells a leak from an output that is random."""
    import torch

    case = call.case
    axis = 0 if unit == "example" else 1
    try:
        o2 = call.output(fresh, f"new inputs for {unit} {index}").double()
    except UserCodeError:
        raise
    except Exception as exc:  # the user's code: a finding
        return Check(2, name, "fail", reason=f"the call on new inputs for {unit} {index} raised "
                     f"{type(exc).__name__}: {first_line(exc)}")
    if list(o2.shape) != [case.b, case.tq, case.h, case.d]:
        return Check(2, name, "fail", reason=f"the output on new inputs is {list(o2.shape)}, expected "
                     f"{[case.b, case.tq, case.h, case.d]}")
    moved = torch.nan_to_num((o2.transpose(1, 2) - o).abs(), nan=math.inf).amax(dim=-1)  # [B, H, Tq]
    mine = torch.zeros_like(judged)
    mine.index_fill_(axis, torch.tensor(feeds), True)
    stay = judged & ~mine
    leaked = float(moved.masked_fill(~stay, 0.0).max())
    words = {"example": "another example's output", "kv head": "a query head the kv head does not serve",
             "query head": "another query head's output"}[unit]
    data: dict[str, Any] = {"perturbed": {unit.replace(" ", "_"): index}, "feeds": feeds}
    if leaked > tol:
        hit = (moved > tol) & judged  # [B, H, Tq]
        reached = [int(i) for i in torch.nonzero(hit.any(dim=2).any(dim=1 - axis))[:, 0]]  # examples or heads
        data["moved"] = reached
        check = bounded(2, name, f"largest move of {words}", leaked, tol, location=_first(hit & stay), data=data)
        again = _err(call.output(t, "the same inputs again").double().transpose(1, 2), o, judged)
        if again > tol:
            return replace(check, reason=f"two calls on the same inputs differ by {again:.3g} (limit {tol:.3g}): "
                           "the output is random with module.training False (dropout applied in eval?)",
                           data={**data, "repeat_difference": again})
        return replace(check, reason=_leak_words(case, unit, index, feeds, reached))
    data["moved_max"] = float(moved.masked_fill(~(judged & mine), 0.0).max())
    if data["moved_max"] <= tol:
        return Check(2, name, "inconclusive", f"largest move of {words}", leaked, tol, "<=", data=data,
                     reason="the outputs that should move did not move either, so the probe proves nothing")
    return bounded(2, name, f"largest move of {words}", leaked, tol, data=data)


def _leak_words(case: ICase, unit: str, index: int, feeds: list[int], reached: list[int]) -> str:
    """What leaked where, in words; a kv head that feeds the query heads tiling gives is named so."""
    if unit == "example":
        return f"new inputs for example {index} moved the output of examples {reached}, expected {feeds}"
    if unit == "query head":
        return f"a new query for head {index} moved the output of query heads {reached}, expected {feeds}"
    said = f"new keys and values for kv head {index} moved query heads {reached}, expected {feeds}"
    if reached == [x for x in range(case.h) if x % case.hkv == index]:
        said += (f": kv heads tiled (repeat) instead of repeated per group (repeat_kv), so query head x reads "
                 f"kv head x % {case.hkv}, not x // {case.groups}")
    return said


def _first(mask: "Tensor") -> dict[str, int] | None:
    import torch

    idx = torch.nonzero(mask)
    return None if idx.numel() == 0 else dict(zip(("example", "head", "query"), (int(x) for x in idx[0][:3])))


def _padded_rows(o: "Tensor", empty: "Tensor", contract: str) -> Check:
    import torch

    if not bool(empty.any()):
        return unjudged(3, "padded_rows", "not_applicable", "every query has an allowed key")
    facts = {"contract": contract, "padded_rows": int(empty.sum())}
    if contract == "any":
        return Check(3, "padded_rows", "skipped", reason="the contract 'any' lets such a row hold anything", data=facts)
    if contract == "zeros":
        wrong = empty & ((o != 0) | torch.isnan(o)).any(dim=-1)
        return counted(3, "padded_rows", "fully padded query rows that are not all zeros", int(wrong.sum()),
                       location=_first(wrong), data=facts)
    wrong = empty & ~torch.isfinite(o).all(dim=-1)
    return counted(3, "padded_rows", "fully padded query rows with NaN or inf (contract: finite)", int(wrong.sum()),
                   location=_first(wrong), data=facts)


def _weights(target: Any, t: dict[str, "Tensor"], case: ICase, passes: list[str], what: str, ref_w: "Tensor",
             live: "Tensor", sd: bool) -> Check:
    """L3: the weights the function returned sum, per live row, to what the reference's do (one, or one
    minus the sink's share)."""
    if case.train is not None:
        return unjudged(3, "weights_sum", "not_applicable", "dropout in training mode rescales the weights")
    try:
        w = _call(target, t, case, passes, "weights", f"{what} (its weights)", sd)
    except UserCodeError:
        raise
    except Exception as exc:  # the same call raised the second time: the output's checks already ran
        return Check(3, "weights_sum", "fail", reason=f"the call for its weights raised {type(exc).__name__}: "
                     f"{first_line(exc)}")
    if w.numel() == 0:
        return unjudged(3, "weights_sum", "not_applicable", "the function returns no weights (None)")
    want = [case.b, case.h, case.tq, case.tk]
    if list(w.shape) == want[:3]:  # flex's forward returns its log-sum-exp in the weights' place off the CPU
        return unjudged(3, "weights_sum", "not_applicable", "the function returns [B, H, Tq] in the weights' place "
                        "(a log-sum-exp, as flex_attention_forward gives), not weights")
    if list(w.shape) != want:
        return Check(3, "weights_sum", "fail", reason=f"weights {list(w.shape)}, expected [B, H, Tq, Tk] = {want}",
                     data={"expected": want, "got": list(w.shape)})
    sums = w.double().sum(dim=-1)  # [B, H, Tq]
    expected = ref_w.sum(dim=-1).expand_as(sums)
    err = (sums - expected).abs().masked_fill(~live, 0.0).nan_to_num(nan=math.inf)
    limit = 4 * EPS[case.dtype_name] * math.sqrt(case.tk) + 1e-9
    worst = float(err.max()) if err.numel() else 0.0
    data = {"sinks": case.sinks, "expected_min": float(expected[live].min()) if bool(live.any()) else 1.0}
    check = bounded(3, "weights_sum", "max |row sum of the weights - its expected sum|", worst, limit,
                    location=_first(err > limit) if worst > limit else None, data=data)
    if check.failed and case.sinks and float((sums - 1.0).abs().masked_fill(~live, 0.0).max()) <= limit:
        check = replace(check, reason="the weights sum to one where the sinks take a share: s_aux is not in the "
                        "denominator", data={**data, "diagnosis": "sinks dropped"})
    return check


def _tolerance(case: ICase, t: dict[str, "Tensor"], ref: "Tensor", live: "Tensor") -> tuple[float, dict[str, Any]]:
    import torch

    from attn_ledger.devices import torch_dtype

    dt = torch_dtype(case.dtype_name)
    errs = []
    for first in (False, True):
        p, _ = reference(case, t, dtype=dt, scale_first=first)
        errs.append(_err(p.double(), ref, live))
    vmax = float(t["value"].double().abs().max())
    bound, facts = kernel_bound(case.dtype_name, max(errs), vmax)
    return bound, {**facts, "plain_errors": errs, "value_scale": vmax, "dtype_check": str(torch.float64)}


def _err(a: "Tensor", b: "Tensor", live: "Tensor") -> float:
    import torch

    d = torch.nan_to_num((a - b).abs(), nan=math.inf).amax(dim=-1).masked_fill(~live, 0.0)
    return float(d.max()) if d.numel() else 0.0


def _reference(case: ICase, t: dict[str, "Tensor"], o: "Tensor", ref: "Tensor", live: "Tensor", tol: float,
               facts: dict[str, Any]) -> Check:
    """L4: the output against the float64 reference on rows with an allowed key (within ``tol``, the case's
    bound, :func:`_tolerance`); a failure names the bug it matches."""
    err = _err(o, ref, live)
    data: dict[str, Any] = {"tolerance": facts}
    reason = ""
    if err > tol:
        diagnosis = _diagnose(case, t, o, live, tol)
        if diagnosis is not None:
            data["diagnosis"] = diagnosis
            reason = f"the output matches {diagnosis}"
    check = bounded(4, "reference", "max |out - float64 reference|", err, tol, data=data)
    return replace(check, reason=reason) if reason else check


def _diagnose(case: ICase, t: dict[str, "Tensor"], o: "Tensor", live: "Tensor", tol: float) -> str | None:
    if case.h == case.tq:  # [B, H, Tq, D] has the same shape as [B, Tq, H, D] here
        ref, _ = reference(case, t)
        if _err(o.transpose(1, 2), ref, live) <= tol:
            return "an output returned as [B, H, Tq, D], not transposed back to [B, Tq, H, D]"
    for text, bug in _bugs(case):
        variant, _ = reference(case, t, **bug)
        if _err(o, variant, live) <= tol:
            return text
    return None


# --- many cases, and the report ----------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """How the cases were chosen and called, for the report."""

    target: str
    declaration: Declaration
    detected: bool
    seed: int = 0
    empty_rows: str = "finite"
    skipped: Mapping[str, int] = field(default_factory=dict)
    tier: str | None = "default"  # None: the cases were named


def plan(decl: Declaration, ids: Sequence[str] | None = None,
         tier: str = "default") -> tuple[list[ICase], dict[str, int]]:
    """The cases to run (the named ones, or the tier's for the declaration) and those left out, by reason."""
    cases = [parse_icase(i) for i in ids] if ids else list(interface_cases(decl.supports, decl.masks, tier))
    todo, skipped = [], {}
    for c in cases:
        why = None
        if c.dtype_name not in decl.dtypes:
            why = f"dtype {c.dtype_name}"
        elif c.mask not in decl.masks and not (c.mask == "none" and "sdpa" in decl.masks):
            why = f"mask {c.mask}"
        elif c.mask == "none" and c.window is not None and "window" not in decl.supports:
            why = "sliding_window= (not declared)"
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            todo.append(c)
    return todo, skipped


def interface_report(results: Sequence[ICaseResult], run: Run) -> Report:
    """One row per case, smallest first; the first finding is the smallest failing case's first failing check."""
    ordered = sorted(results, key=lambda r: (r.case.size, r.case.id))
    failing = [r for r in ordered if not r.passed]
    small = min(failing, key=lambda r: (r.case.size, r.first_failure.level, r.case.id)) if failing else None  # type: ignore[union-attr]
    name = run.target.rsplit(":", 1)[-1] if ":" in run.target else "attention"
    how = "detected from the signature (module, query, key, value, attention_mask, ...)" if run.detected else "given"
    notes: list[str | Note] = [f"protocol: transformers AttentionInterface, {how}"]
    if run.skipped:
        notes.append(f"{sum(run.skipped.values())} cases skipped: outside the declaration ("
                     + ", ".join(f"{n} for {k}" for k, n in run.skipped.items()) + ")")
    repro = None
    if small is None:
        notes.append(f"all {len(ordered)} cases pass" if len(ordered) != 1 else "the case passes")
    else:
        first = small.first_failure
        passes = [f for f in small.case.features if f in run.declaration.supports]
        repro = {"case": small.case.id, "target": run.target, "function": name, "seed": run.seed,
                 "passes": passes, "call": call_text(small.case, name, passes),
                 "options": _options(run)}
        notes.append(Note("cases_failed", {"failed": len(failing), "cases": len(ordered)}))
        notes.append(Note("interface_reproduce", repro))
    details = {"target": run.target, "protocol": PROTOCOL, "detected": run.detected, "seed": run.seed,
               "tier": run.tier,
               "empty_rows": run.empty_rows, "declaration": run.declaration.to_json(), "cases_total": len(ordered),
               "cases_failed": len(failing), "cases_skipped": sum(run.skipped.values()),
               "skipped_by_declaration": dict(run.skipped),
               "first_level": small.first_failure.level if small else None,  # type: ignore[union-attr]
               "reproduce": repro}
    rows = tuple(Row(r.case.id, row_status(r.checks), r.checks, fields={"elements": r.case.size}) for r in ordered)
    return Report(command="check", title=f"check {run.target} (transformers protocol, {how.split(' (')[0]}, "
                                         f"{run.tier or 'named'} cases, padded rows: {run.empty_rows})",
                  rows=rows, first_finding=None if small is None else Finding(small.case.id, small.first_failure),  # type: ignore[arg-type]
                  notes=tuple(notes), details=details, unit="row", row_label="case", show_passing=False,
                  fold_rows=True)


def _options(run: Run) -> list[str]:
    opts = ["--protocol", PROTOCOL]
    d = run.declaration
    if d.masks != Declaration().masks:
        opts += ["--masks", ",".join(d.masks)]
    if d.supports:
        opts += ["--supports", ",".join(d.supports)]
    if run.seed:
        opts += ["--seed", str(run.seed)]
    if run.empty_rows != "finite":
        opts += ["--empty-rows", run.empty_rows]
    return opts


def check_interface(fn: Callable[..., Any], ids: Sequence[str] | None = None, *, target: str = "attention",
                    declaration: Declaration | None = None, seed: int = 0, empty_rows: str = "finite",
                    detected: bool = False, tier: str = "default") -> Report:
    """Run an attention-interface function over its cases, in this process (the pytest helper, the library).

    Raises:
        SetupError: transformers is not installed, or the declaration leaves no case.
        InputError: a malformed case id or contract.
    """
    from attn_ledger.errors import SetupError
    from attn_ledger.probes.common.driver import KernelTarget, LocalKernel
    from attn_ledger.probes.interface.driver import InterfaceAdapter, require_transformers

    require_transformers()
    if empty_rows not in EMPTY_ROWS:
        raise InputError(f"empty_rows: got {empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
    d = declaration or Declaration()
    cases, skipped = plan(d, ids, tier)
    if not cases:
        raise SetupError("declaration: leaves no case to run")
    kernel = fn if isinstance(fn, KernelTarget) else LocalKernel(InterfaceAdapter(fn))
    name = target.rsplit(":", 1)[-1]
    results = [check_icase(kernel, c, d, name=name, seed=seed, empty_rows=empty_rows) for c in cases]
    return interface_report(results, Run(target, d, detected, seed, empty_rows, skipped, None if ids else tier))
