"""Black-box checks for a user's attention function under the kernel protocol.

The kernel protocol::

    def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) -> Tensor

q ``[B, Nh, Tq, Dh]``, k ``[B, Nkv, Tk, Dh]``, v ``[B, Nkv, Tk, Dv]``; query head h uses kv
head ``h // (Nh // Nkv)``; ``allow_mask`` is bool, broadcastable to ``[B, Nh, Tq, Tk]``,
True = may attend; ``is_causal`` is bottom-right aligned (query i may use key j iff
``j <= i + (Tk - Tq)``); both together mean a key must be allowed by both; ``scale`` None
means ``1/sqrt(Dh)``; the result is ``[B, Nh, Tq, Dv]``.

A :class:`Case` is one call of the function on a small, seeded input. Its id is readable
and complete (``b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32``): any id of that form can
be rebuilt with :func:`parse_case`, so a failing case can be rerun on its own.

Only what is visible from outside is checked, at the levels of the ledger:

* L1 ``call`` (the function returns on a legal case), ``shape``, ``dtype``;
* L2 ``batch_isolation``, ``kv_head_isolation``, ``q_head_isolation``: perturb one batch
  element, one kv head or one query head's q; only the outputs that should move do;
* L3 ``finite``, ``convex_range`` (each output row lies inside the per-coordinate range of
  the value rows it may mix), ``forbidden_keys`` (perturbing a forbidden key's k and v
  moves nothing), ``empty_rows`` (a query whose every key is blocked follows the stated
  contract: zeros, NaN or anything);
* L4 ``reference`` (agreement with a float64 reference, with a dtype-aware tolerance) and
  ``causal_intervention`` (changing the future moves no past output, and does move a later one).

Tolerance rule: the implementation's largest error against the float64 reference may be
at most ``FACTOR`` times the error of the same reference computed plainly in the case's
dtype, plus a small floor per dtype scaled by the largest value magnitude. Every measured
check carries that tolerance as its ``limit``, the measured number as its ``value`` and the
first row past it as its ``location`` (``{"example": b, "head": h, "query": i}``).

:func:`check_kernel` returns a :class:`~attn_ledger.report.Report` with one row per case;
its first finding is the smallest failing case's first failing check, and its details
carry the lines that reproduce that case. :func:`check_case` returns one case's checks.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from attn_ledger.errors import InputError
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.report import Check, Finding, Report, Row, bounded, counted, find_check, row_status, unjudged
from attn_ledger.seeding import generator
from attn_ledger.tolerance import KERNEL_FACTOR, kernel_floor

if TYPE_CHECKING:
    import torch
    from torch import Tensor

MASKS = ("none", "causal-flag", "causal-mask", "pad", "pad-causal", "pad-empty")
INPUTS = ("rand", "index", "large")
DTYPES = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16"}
EMPTY_ROWS = ("zeros", "nan", "any")

FACTOR = KERNEL_FACTOR
"""An implementation may be this many times less accurate than the plain same-dtype reference."""

_LARGE = 12.0  # q and k scale for "large" inputs: score std about 144, so |s| > 100 occurs

CHECK_ORDER = (
    (1, "call"), (1, "shape"), (1, "dtype"),
    (2, "batch_isolation"), (2, "kv_head_isolation"), (2, "q_head_isolation"),
    (3, "finite"), (3, "convex_range"), (3, "forbidden_keys"), (3, "empty_rows"),
    (4, "reference"), (4, "causal_intervention"),
)
LEVEL_OF = {name: level for level, name in CHECK_ORDER}

_ID_RE = re.compile(
    r"^b(?P<b>\d+)-h(?P<nh>\d+)kv(?P<nkv>\d+)-tq(?P<tq>\d+)tk(?P<tk>\d+)-dh(?P<dh>\d+)dv(?P<dv>\d+)"
    r"-(?P<mask>" + "|".join(sorted(MASKS, key=len, reverse=True)) + r")"
    r"-(?P<inputs>" + "|".join(INPUTS) + r")-(?P<dtype>" + "|".join(DTYPES) + r")"
    r"(?:-s(?P<scale>\d+(?:\.\d+)?))?$"
)


# --- cases --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One call of the kernel: sizes, mask relation, input kind and dtype.

    Attributes:
        b, nh, nkv, tq, tk, dh, dv: B, Nh, Nkv, Tq, Tk, Dh, Dv.
        mask: ``none``; ``causal-flag`` (``is_causal=True``); ``causal-mask`` (the same relation
            as a bool ``allow_mask`` ``[Tq, Tk]``); ``pad`` (key padding ``[B, 1, 1, Tk]``);
            ``pad-causal`` (padding mask and ``is_causal=True`` together); ``pad-empty``
            (padding where the last example has no real key, so its rows are empty).
        inputs: ``rand`` (standard normal), ``index`` (each value encodes its own
            coordinates), ``large`` (q and k scaled so that scores reach |s| > 100).
        dtype: ``f32``, ``f64``, ``f16`` or ``bf16``.
        scale: an explicit ``scale=`` argument (id suffix ``-s0.25``), or None for the default 1/sqrt(Dh).
    """

    b: int
    nh: int
    nkv: int
    tq: int
    tk: int
    dh: int
    dv: int
    mask: str = "none"
    inputs: str = "rand"
    dtype: str = "f32"
    scale: float | None = None

    @property
    def id(self) -> str:
        return (
            f"b{self.b}-h{self.nh}kv{self.nkv}-tq{self.tq}tk{self.tk}-dh{self.dh}dv{self.dv}"
            f"-{self.mask}-{self.inputs}-{self.dtype}" + ("" if self.scale is None else f"-s{self.scale:g}")
        )

    @property
    def size(self) -> int:
        """Elements in q, k and v together: the order in which failing cases are compared."""
        return self.b * (self.nh * self.tq * self.dh + self.nkv * self.tk * (self.dh + self.dv))

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype]

    @property
    def causal(self) -> bool:
        return self.mask in ("causal-flag", "causal-mask", "pad-causal")

    def lengths(self) -> list[int]:
        """Real keys per example for the padding relations (right padding)."""
        lens = [max(1, self.tk - 1 - 2 * i) for i in range(self.b)]
        if self.mask == "pad-empty":
            lens[-1] = 0
        return lens

    def call_text(self, name: str = "attention") -> str:
        """The keyword arguments of the call, as a reader would write them."""
        args = []
        if self.mask == "causal-mask":
            args.append("allow_mask=causal[Tq, Tk]")
        elif self.mask in ("pad", "pad-causal", "pad-empty"):
            args.append(f"allow_mask=key_padding(lengths={self.lengths()})[B, 1, 1, Tk]")
        if self.mask in ("causal-flag", "pad-causal"):
            args.append("is_causal=True")
        if self.scale is not None:
            args.append(f"scale={self.scale:g}")
        return f"{name}(q, k, v{''.join(', ' + a for a in args)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "B": self.b, "Nh": self.nh, "Nkv": self.nkv, "Tq": self.tq, "Tk": self.tk,
            "Dh": self.dh, "Dv": self.dv, "mask": self.mask, "inputs": self.inputs,
            "dtype": self.dtype_name, "scale": self.scale, "elements": self.size,
        }


def parse_case(case_id: str) -> Case:
    """Rebuild a :class:`Case` from its id.

    Raises:
        InputError: the id is malformed or names an impossible case.
    """
    m = _ID_RE.match(case_id.strip())
    if m is None:
        raise InputError(
            f"case: got {case_id!r}, expected an id like 'b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32' "
            f"(masks {', '.join(MASKS)}; inputs {', '.join(INPUTS)}; dtypes {', '.join(DTYPES)})"
        )
    g = m.groupdict()
    case = Case(*(int(g[key]) for key in ("b", "nh", "nkv", "tq", "tk", "dh", "dv")),
                mask=g["mask"], inputs=g["inputs"], dtype=g["dtype"],
                scale=None if g["scale"] is None else float(g["scale"]))
    if case.scale is not None and not 0 < case.scale <= 16:
        raise InputError(f"case {case_id!r}: scale={case.scale:g}, expected a value in (0, 16]")
    sizes = {"B": case.b, "Nh": case.nh, "Nkv": case.nkv, "Tq": case.tq, "Tk": case.tk, "Dh": case.dh, "Dv": case.dv}
    for name, value in sizes.items():
        if not 1 <= value <= 64:
            raise InputError(f"case {case_id!r}: {name}={value}, expected between 1 and 64")
    if case.nh % case.nkv:
        raise InputError(f"case {case_id!r}: Nkv must divide Nh: Nkv={case.nkv}, Nh={case.nh}")
    if case.mask == "pad-empty" and case.b < 2:
        raise InputError(f"case {case_id!r}: mask 'pad-empty' needs B >= 2, got B={case.b}")
    return case


def _grid() -> tuple[Case, ...]:
    # Shapes chosen so that the axes combine: GQA with 2 kv heads x 2 query heads each,
    # Tq != Tk, Dv != Dh, multi-query, Nh == Tk == Dh, decode (Tq = 1), Tq > Tk, T = 1.
    S = {
        "t1": (1, 1, 1, 1, 1, 4, 4),
        "gqa": (2, 4, 2, 5, 5, 8, 8),
        "cross": (2, 4, 2, 5, 9, 8, 4),
        "mqa": (2, 6, 1, 4, 7, 8, 8),
        "square": (2, 4, 4, 4, 4, 4, 4),
        "decode": (3, 2, 2, 1, 6, 8, 8),
        "tall": (1, 3, 3, 6, 3, 4, 6),
    }
    cases: list[Case] = []
    for shape in S.values():
        for mask in ("none", "causal-flag", "causal-mask", "pad", "pad-causal"):
            cases.append(Case(*shape, mask=mask))
    for key in ("gqa", "cross", "square"):
        for mask in ("none", "causal-flag", "pad-causal"):
            cases.append(Case(*S[key], mask=mask, inputs="index"))
    cases.append(Case(*S["gqa"], mask="pad-empty"))
    for key, mask in (("gqa", "causal-flag"), ("cross", "pad-causal"), ("mqa", "none")):
        cases.append(Case(*S[key], mask=mask, inputs="large"))
    for key, mask in (("cross", "causal-flag"), ("cross", "pad-causal"), ("square", "none"), ("decode", "causal-mask")):
        cases.append(Case(*S[key], mask=mask, dtype="f64"))
    # An explicit scale= argument, which a kernel may silently ignore.
    cases.append(Case(*S["gqa"], mask="causal-flag", scale=0.125))
    cases.append(Case(*S["cross"], mask="pad-causal", scale=1.0))
    for dt in ("f16", "bf16"):
        for key, mask in (("cross", "causal-flag"), ("gqa", "pad-causal"), ("t1", "none")):
            cases.append(Case(*S[key], mask=mask, dtype=dt))
        cases.append(Case(*S["gqa"], mask="causal-flag", inputs="large", dtype=dt))
        cases.append(Case(*S["cross"], mask="none", inputs="large", dtype=dt))
    return tuple(cases)


DEFAULT_GRID: tuple[Case, ...] = _grid()
"""The default grid of cases (ids are stable between releases unless noted in the changelog)."""


def select_cases(ids: Sequence[str] | None) -> tuple[Case, ...]:
    """The default grid, or the named cases (each id parsed, so ids outside the grid work too)."""
    if not ids:
        return DEFAULT_GRID
    return tuple(parse_case(i) for i in ids)


# --- inputs -------------------------------------------------------------------------


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def half_supported(dtype_name: str) -> bool:
    """Whether this torch build runs matmul and softmax in ``dtype_name`` on the CPU."""
    import torch

    try:
        x = torch.ones(1, 2, 2, dtype=_torch_dtype(dtype_name))
        torch.softmax(x @ x, dim=-1)
        return True
    except (RuntimeError, TypeError):
        return False


def _fill(case: Case, shape: tuple[int, ...], gen: "torch.Generator", scale: float, index: bool) -> "Tensor":
    import torch

    if index:
        # Every value names its coordinates: the flat index of (b, head, t, d), spread over [-1, 1).
        n = math.prod(shape)
        return (torch.arange(n, dtype=torch.float64).reshape(shape) * (2.0 / n) - 1.0)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _allow(case: Case) -> "Tensor | None":
    """The allow_mask argument the case passes (not combined with is_causal)."""
    from attn_ledger import masks

    if case.mask == "causal-mask":
        return masks.causal(case.tq, case.tk, "bottom-right")  # [Tq, Tk]
    if case.mask in ("pad", "pad-causal", "pad-empty"):
        return masks.key_padding(masks.valid_from_lengths(case.lengths(), case.tk))  # [B, 1, 1, Tk]
    return None


def case_inputs(case: Case | str, seed: int = 0) -> tuple["Tensor", "Tensor", "Tensor", dict[str, Any]]:
    """The exact inputs of a case: ``q, k, v, kwargs`` so that ``fn(q, k, v, **kwargs)`` reproduces it.

    Example:
        >>> q, k, v, kw = case_inputs("b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32")
        >>> out = attention(q, k, v, **kw)
    """
    import torch

    case = parse_case(case) if isinstance(case, str) else case
    gen = generator(zlib.crc32(case.id.encode()) ^ seed)  # every bit of the seed counts
    index = case.inputs == "index"
    qk_scale = _LARGE if case.inputs == "large" else 1.0
    dt = _torch_dtype(case.dtype_name)
    q = _fill(case, (case.b, case.nh, case.tq, case.dh), gen, qk_scale, index).to(dt)  # [B, Nh, Tq, Dh]
    k = _fill(case, (case.b, case.nkv, case.tk, case.dh), gen, qk_scale, index).to(dt)  # [B, Nkv, Tk, Dh]
    v = _fill(case, (case.b, case.nkv, case.tk, case.dv), gen, 1.0, index).to(dt)  # [B, Nkv, Tk, Dv]
    if index:
        q = q * 0.5  # keep q and k distinguishable (both are index-encoded) while scores stay small
    kwargs = {"allow_mask": _allow(case), "is_causal": case.mask in ("causal-flag", "pad-causal")}
    if case.scale is not None:
        kwargs["scale"] = case.scale
    return q, k, v, kwargs


# --- results ------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """Every check on one case, in level order, and the tolerance they were judged with."""

    case: Case
    checks: tuple[Check, ...]
    tolerance: float | None = None

    @property
    def first_failure(self) -> Check | None:
        failing = [c for c in self.checks if c.failed]
        return min(failing, key=lambda c: c.level) if failing else None

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    def check(self, name: str) -> Check:
        return find_check(self.checks, name)


def smallest_failing(results: Iterable[CaseResult]) -> CaseResult | None:
    """The failing case with the fewest input elements (ties: lowest first level, then id)."""
    failing = [r for r in results if not r.passed]
    if not failing:
        return None
    return min(failing, key=lambda r: (r.case.size, r.first_failure.level, r.case.id))  # type: ignore[union-attr]


def reproduction(case: Case, target: str, *, empty_rows: str = "zeros", seed: int = 0) -> tuple[str, tuple[str, ...]]:
    """The CLI line and the Python lines that rerun one case of ``attn-ledger check TARGET``."""
    seed_opt = f" --seed {seed}" if seed else ""
    rows_opt = f" --empty-rows {empty_rows}" if empty_rows != "zeros" else ""
    cli = f"attn-ledger check {target} --case {case.id}{seed_opt}{rows_opt}"
    name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    seed_arg = f", seed={seed}" if seed else ""
    python = (
        "from attn_ledger.kernelcheck import case_inputs",
        f"q, k, v, kw = case_inputs({case.id!r}{seed_arg})",
        f"out = {name}(q, k, v, **kw)",
    )
    return cli, python


def _decode_text(decode: dict[str, Any]) -> str:
    """The index-decode facts of a check's ``data`` as the line a reader needs."""
    may = decode["may_mix"]
    keys = f"keys {may['keys'][0]}..{may['keys'][1]}" if may["keys"] else "no key"
    allowed = f"example {may['example']}, kv head {may['kv_head']}, {keys}"
    src = decode["source"]
    if src is None:
        return f"index decode: the row lies outside every value row's range; it may mix only {allowed}"
    return (f"index decode: the row reads as a mix from example {src['example']}, kv head {src['kv_head']}, "
            f"near key {src['key']:.1f}; it may mix only {allowed}")


def _case_row(result: CaseResult) -> Row:
    """One case as a report row: its checks, its size, and where index inputs tell it, the source of a wrong row."""
    first = result.first_failure
    note = _decode_text(first.data["index_decode"]) if first is not None and "index_decode" in first.data else ""
    return Row(result.case.id, row_status(result.checks), result.checks, fields={"elements": result.case.size},
               note=note)


def kernel_report(
    results: Sequence[CaseResult], *, target: str, empty_rows: str = "zeros", seed: int = 0,
    skipped: Sequence[str] = (),
) -> Report:
    """The report of ``attn-ledger check`` on a kernel-protocol function: one row per case.

    The first finding is the smallest failing case's first failing check; ``details`` holds
    the counts and the reproduction of that case, which the notes repeat for the table.
    """
    failing = [r for r in results if not r.passed]
    small = smallest_failing(results)
    name = target.rsplit(":", 1)[-1] if ":" in target else "attention"
    notes = list(skipped)
    repro = None
    if small is None:
        notes.append(f"all {len(results)} cases pass")
    else:
        cli, python = reproduction(small.case, target, empty_rows=empty_rows, seed=seed)
        command, _, options = cli.partition(" --case ")
        repro = {"case": small.case.id, "cli": cli, "python": "\n".join(python)}
        notes += [
            f"{len(failing)} of {len(results)} cases fail; the first finding is the smallest failing case",
            f"its call: {small.case.call_text(name)}",
            "reproduce it:",
            # two lines joined by a shell continuation: the table wraps a long note, and this stays pasteable
            f"{command} \\",
            f"    --case {options}",
            *python,
        ]
    levels = [r.first_failure.level for r in failing]  # type: ignore[union-attr]
    details = {
        "target": target,
        "protocol": "kernel",
        "empty_rows": empty_rows,
        "seed": seed,
        "cases_total": len(results),
        "cases_failed": len(failing),
        "first_level": min(levels) if levels else None,
        "skipped": list(skipped),
        "reproduce": repro,
    }
    return Report(
        command="check",
        title=f"check {target} (kernel protocol, empty rows: {empty_rows})",
        rows=tuple(_case_row(r) for r in results),
        first_finding=None if small is None else Finding(small.case.id, small.first_failure),  # type: ignore[arg-type]
        notes=tuple(notes),
        details=details,
        unit="row",
        row_label="case",
        show_passing=False,
    )


# --- checking one case ----------------------------------------------------------------


def _f64(t: "Tensor") -> "Tensor":
    import torch

    return t.detach().to("cpu", torch.float64)


def _maxdiff(a: "Tensor", b: "Tensor", where: "Tensor | None" = None) -> float:
    """Largest |a - b| over ``where`` (NaN counts as infinitely far, NaN == NaN as equal)."""
    import torch

    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.nan_to_num((a - b).abs(), nan=math.inf).masked_fill(both_nan, 0.0)
    if where is not None:
        d = d[where.expand_as(d)]
    return float(d.max()) if d.numel() else 0.0


def _first_row(mask: "Tensor") -> dict[str, int] | None:
    """The first True entry of a ``[B, Nh, Tq]`` mask as a location, or None."""
    import torch

    idx = torch.nonzero(mask)
    if idx.numel() == 0:
        return None
    b, h, i = (int(x) for x in idx[0][:3])
    return {"example": b, "head": h, "query": i}


class _Kernel:
    """Calls the user's function on clones of the inputs (so in-place edits cannot leak between calls).

    Each call is one :func:`~attn_ledger.guard.user_call`, named by the case's call text and
    the probe it serves. A value that is not a dense tensor with values (not a tensor, sparse,
    on the meta device) is a :class:`~attn_ledger.guard.UserCodeError`, as a crash would be:
    no check can read it.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], call_text: str) -> None:
        self.fn, self.kwargs, self.call_text = fn, kwargs, call_text

    def __call__(self, q: "Tensor", k: "Tensor", v: "Tensor", probe: str | None = None) -> "Tensor":
        import torch

        kw = dict(self.kwargs)
        if kw.get("allow_mask") is not None:
            kw["allow_mask"] = kw["allow_mask"].clone()
        what = self.call_text if probe is None else f"{self.call_text} for the {probe} probe"
        q, k, v = q.clone(), k.clone(), v.clone()
        with torch.no_grad(), user_call(what):
            out = self.fn(q, k, v, **kw)
        problem = returned_problem(out)
        if problem is not None:
            raise UserCodeError(problem[0], what, **problem[1])
        return out


def returned_problem(out: Any) -> tuple[str, dict[str, Any]] | None:
    """Why a kernel's return value cannot be checked, as a phrase and as values, or None.

    Example: ``("returned list, expected a Tensor [B, Nh, Tq, Dv]", {"returned": "list"})``.
    """
    import torch

    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a Tensor [B, Nh, Tq, Dv]", {"returned": type(out).__name__}
    if out.layout != torch.strided:
        layout = str(out.layout).removeprefix("torch.")
        return f"returned a tensor with layout {layout}, expected a dense (strided) Tensor", {"layout": layout}
    if out.is_meta:
        return "returned a tensor on the meta device, which holds no values to check", {"device": "meta"}
    return None


def _raised(level: int, name: str, exc: BaseException, where: str, data: dict[str, Any] | None = None) -> Check:
    """A failing check for a call of the user's function that raised."""
    message = _first_line(exc)
    return Check(level, name, "fail", reason=f"{where} raised {type(exc).__name__}: {message}",
                 data={**(data or {}), "exception": type(exc).__name__, "message": message})


def _probe(
    name: str, measure: str, kernel: _Kernel, args: tuple["Tensor", "Tensor", "Tensor"], base: "Tensor",
    stay: "Tensor", move: "Tensor | None", tol: float, perturbed: dict[str, Any],
) -> Check:
    """Run the kernel on perturbed inputs: ``stay`` outputs must not move, some ``move`` output must.

    The value is the largest move of a row in ``stay``, judged against ``tol``; ``data`` says
    what was perturbed and how far the ``move`` rows moved. A probe whose ``move`` rows barely
    moved is inconclusive: it proves nothing either way.
    """
    level = LEVEL_OF[name]
    data: dict[str, Any] = {"perturbed": perturbed}
    try:
        out = _f64(kernel(*args, probe=name))
    except UserCodeError:
        raise  # an exit, a hang or an unreadable value: the case's L1 call finding, not this probe's
    except Exception as exc:  # the user's code: any exception is a finding
        return _raised(level, name, exc, "the call on perturbed inputs", data)
    if tuple(out.shape) != tuple(base.shape):
        return Check(level, name, "fail", reason="the output shape changed on perturbed inputs",
                     data={**data, "expected": list(base.shape), "got": list(out.shape)})
    per_row = _row_diff(out, base)  # [B, Nh, Tq]
    leaked = float(per_row[stay].max()) if stay.any() else 0.0
    if leaked > tol:
        return bounded(level, name, measure, leaked, tol, location=_first_row(stay & (per_row > tol)), data=data)
    if move is not None and move.any():
        data["moved"] = float(per_row[move].max())
        data["moved_min"] = max(10 * tol, 1e-12)
        if data["moved"] <= data["moved_min"]:
            return Check(level, name, "inconclusive", measure, leaked, tol, "<=", data=data,
                         reason="the outputs that should move did not move either, so the probe proves nothing")
    return bounded(level, name, measure, leaked, tol, data=data)


def _row_diff(a: "Tensor", b: "Tensor") -> "Tensor":
    """Per output row ``[B, Nh, Tq]``: largest |a - b| over Dv; NaN against non-NaN is infinite."""
    import torch

    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.nan_to_num((a - b).abs(), nan=math.inf).masked_fill(both_nan, 0.0)
    return d.amax(dim=-1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


def _index_decode(case: Case, out: "Tensor", allow_full: "Tensor", rows: "Tensor") -> dict[str, Any]:
    """For index-encoded inputs: where the first marked output row's values came from.

    Each value of v is its own flat index (b, kv head, t, d) spread over [-1, 1), and each
    (b, kv head) owns a contiguous range, so coordinate 0 of an output row, a convex
    combination of value rows, decodes to the example and kv head it was mixed from and to
    a (weighted) key position. Returns ``{"index_decode": {"source": ..., "may_mix": ...}}``
    (``source`` None when the row lies outside every value row's range), or ``{}`` when the
    inputs are not index-encoded or the row is not finite.
    """
    import torch

    if case.inputs != "index" or not bool(rows.any()):
        return {}
    b, h, i = (int(x) for x in torch.nonzero(rows)[0][:3])
    n_total = case.b * case.nkv * case.tk * case.dv
    x = float(out[b, h, i, 0])
    if not math.isfinite(x):
        return {}
    n0 = (x + 1.0) * n_total / 2.0  # fractional flat index of coordinate 0
    allowed = torch.nonzero(allow_full[b, h, i]).flatten().tolist()
    may = {"example": b, "kv_head": h // (case.nh // case.nkv), "keys": [allowed[0], allowed[-1]] if allowed else []}
    source = None
    if -0.5 <= n0 < n_total:
        block = int(n0 // (case.tk * case.dv))
        key = (n0 - block * case.tk * case.dv) / case.dv
        source = {"example": block // case.nkv, "kv_head": block % case.nkv, "key": round(key, 2)}
    return {"index_decode": {"source": source, "may_mix": may}}


def _not_applicable(name: str, why: str) -> Check:
    return unjudged(LEVEL_OF[name], name, "not_applicable", why)


def _not_reached(names: Iterable[tuple[int, str]], why: str) -> list[Check]:
    return [unjudged(level, name, "not_reached", why) for level, name in names]


@dataclass(frozen=True)
class _Setup:
    """What the checks of one case read: the inputs, the kernel's output, the relation and the tolerance."""

    case: Case
    kernel: _Kernel
    q: "Tensor"  # [B, Nh, Tq, Dh]
    k: "Tensor"  # [B, Nkv, Tk, Dh]
    v: "Tensor"  # [B, Nkv, Tk, Dv]
    out: "Tensor"  # [B, Nh, Tq, Dv] float64
    allow: "Tensor"  # [B, Nh, Tq, Tk] True = may attend (allow_mask and is_causal together)
    tol: float
    gen: "torch.Generator"

    @property
    def empty(self) -> "Tensor":
        return ~self.allow.any(dim=-1)  # [B, Nh, Tq]: every key blocked

    @property
    def qk_scale(self) -> float:
        return _LARGE if self.case.inputs == "large" else 1.0

    def fresh(self, t: "Tensor", scale: float) -> "Tensor":
        """New random values of ``t``'s shape and dtype."""
        import torch

        return (torch.randn(t.shape, generator=self.gen, dtype=torch.float64) * scale).to(self.q.dtype)


def check_case(fn: Callable[..., Any], case: Case, *, empty_rows: str = "zeros", seed: int = 0) -> CaseResult:
    """Run every check on one case. Never raises for the user's mistakes; they become checks.

    A call that exits, runs past its time limit or returns something no check can read (in
    any of the case's calls, probes included) is the case's L1 ``call`` finding.
    """
    if empty_rows not in EMPTY_ROWS:
        raise InputError(f"empty_rows: got {empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
    try:
        return _check_case(fn, case, empty_rows, seed)
    except UserCodeError as exc:
        return failed_call(case, f"{exc.what or case.call_text()} {exc}", exc.facts())


def failed_call(case: Case, reason: str, data: dict[str, Any]) -> CaseResult:
    """A case whose call did not come back with a result: L1 ``call`` fails, nothing after it is reached.

    Args:
        reason: the call and how it ended (``attention(q, k, v) timed out after 2 s``).
        data: the same as values (``{"call": ..., "timeout_s": 2.0}``).
    """
    called = Check(1, "call", "fail", reason=reason, data=data)
    return CaseResult(case, (called, *_not_reached(CHECK_ORDER[1:], "the call did not return a result")))


def _check_case(fn: Callable[..., Any], case: Case, empty_rows: str, seed: int) -> CaseResult:
    import torch

    from attn_ledger.reference import combined_allow, reference_attention

    q, k, v, kwargs = case_inputs(case, seed)
    kernel = _Kernel(fn, kwargs, case.call_text())
    gen = generator(zlib.crc32(case.id.encode()) + 7919 * (seed + 1))
    dt = q.dtype

    try:
        raw = kernel(q, k, v)
    except UserCodeError:
        raise
    except Exception as exc:
        called = _raised(1, "call", exc, case.call_text())
        return CaseResult(case, (called, *_not_reached(CHECK_ORDER[1:], "the call raised")))
    want = [case.b, case.nh, case.tq, case.dv]
    shape_ok = list(raw.shape) == want
    got_dtype = str(raw.dtype).removeprefix("torch.")
    checks = [
        Check(1, "call", "pass"),
        Check(1, "shape", "pass" if shape_ok else "fail", data={"expected": want, "got": list(raw.shape)},
              reason="" if shape_ok else f"output {list(raw.shape)}, expected [B, Nh, Tq, Dv] = {want}"),
        Check(1, "dtype", "pass" if raw.dtype == dt else "fail", data={"expected": case.dtype_name, "got": got_dtype},
              reason="" if raw.dtype == dt else f"output {got_dtype}, expected {case.dtype_name} (the inputs' dtype)"),
    ]
    if not shape_ok:
        return CaseResult(case, (*checks, *_not_reached(CHECK_ORDER[3:], "wrong output shape")))

    out = _f64(raw)  # [B, Nh, Tq, Dv]
    allow = combined_allow(case.b, case.nh, case.tq, case.tk, kwargs["allow_mask"], kwargs["is_causal"])
    full = torch.ones(case.b, case.nh, case.tq, case.tk, dtype=torch.bool)
    allow_full = full if allow is None else (full & allow)  # [B, Nh, Tq, Tk]
    live = allow_full.any(dim=-1)  # [B, Nh, Tq]
    ref64 = reference_attention(q, k, v, **kwargs)  # [B, Nh, Tq, Dv] float64
    plain = _f64(reference_attention(q, k, v, **kwargs, dtype=dt))  # [B, Nh, Tq, Dv]
    vmax = float(v.abs().max().double()) if v.numel() else 0.0
    plain_err = _maxdiff(plain, ref64, live[..., None])
    floor = kernel_floor(case.dtype_name, vmax)
    tol = FACTOR * plain_err + floor
    s = _Setup(case, kernel, q, k, v, out, allow_full, tol, gen)

    checks += _isolation_checks(s)
    checks += [_finite_check(s), _convex_check(s), _forbidden_probe(s), _empty_rows_check(s, empty_rows)]
    err = _maxdiff(out, ref64, live[..., None])
    wrong_rows = (_row_diff(out, ref64) > tol) & live  # [B, Nh, Tq]
    tolerance = {"factor": FACTOR, "plain_error": plain_err, "floor": floor, "dtype": case.dtype_name}
    checks.append(bounded(4, "reference", "max |out - float64 reference|", err, tol,
                          location=_first_row(wrong_rows) if err > tol else None,
                          data={"tolerance": tolerance, **(_index_decode(case, out, allow_full, wrong_rows) if err > tol else {})}))
    checks.append(_causal_probe(s))
    return CaseResult(case, tuple(checks), tol)


def _isolation_checks(s: _Setup) -> list[Check]:
    """L2: perturb one example, one kv head, one query head's q; only the outputs that should move do."""
    import torch

    case, q, k, v, out = s.case, s.q, s.k, s.v, s.out
    live = ~s.empty
    checks = []
    if case.b >= 2:
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[0], k2[0], v2[0] = s.fresh(q[0], s.qk_scale), s.fresh(k[0], s.qk_scale), s.fresh(v[0], 1.0)
        stay = torch.zeros_like(live)
        stay[1:] = True
        checks.append(_probe("batch_isolation", "largest move of another example's output", s.kernel, (q2, k2, v2),
                             out, stay, live & ~stay, s.tol, {"example": 0, "inputs": "q, k, v"}))
    else:
        checks.append(_not_applicable("batch_isolation", "B = 1"))
    group = case.nh // case.nkv
    if case.nkv >= 2:
        g = case.nkv - 1
        k2, v2 = k.clone(), v.clone()
        k2[:, g], v2[:, g] = s.fresh(k[:, g], s.qk_scale), s.fresh(v[:, g], 1.0)
        served = torch.zeros_like(live)
        served[:, g * group:(g + 1) * group] = True  # query heads h with h // (Nh // Nkv) == g
        checks.append(_probe("kv_head_isolation", "largest move of a query head the kv head does not serve",
                             s.kernel, (q, k2, v2), out, ~served, live & served, s.tol,
                             {"kv_head": g, "inputs": "k, v", "serves": list(range(g * group, (g + 1) * group))}))
    else:
        checks.append(_not_applicable("kv_head_isolation", "Nkv = 1"))
    if case.nh >= 2:
        h = case.nh - 1
        q2 = q.clone()
        q2[:, h] = s.fresh(q[:, h], s.qk_scale)
        mine = torch.zeros_like(live)
        mine[:, h] = True
        # a row with one allowed key returns that key's value whatever q is: it cannot move
        checks.append(_probe("q_head_isolation", "largest move of another query head's output", s.kernel, (q2, k, v),
                             out, ~mine, live & mine & (s.allow.sum(-1) >= 2), s.tol, {"head": h, "inputs": "q"}))
    else:
        checks.append(_not_applicable("q_head_isolation", "Nh = 1"))
    return checks


def _finite_check(s: _Setup) -> Check:
    """L3: no NaN or infinity in a row that has at least one allowed key."""
    import torch

    bad = (~torch.isfinite(s.out)).any(-1) & ~s.empty  # [B, Nh, Tq]
    n = int((~torch.isfinite(s.out) & ~s.empty[..., None]).sum())
    return counted(3, "finite", "non-finite values in rows with an allowed key", n, location=_first_row(bad))


def _convex_check(s: _Setup) -> Check:
    """L3: each output row lies inside the per-coordinate range of the value rows it may mix."""
    import torch

    from attn_ledger.reference import repeat_kv

    vv = repeat_kv(s.v.double(), s.case.nh)[:, :, None, :, :]  # [B, Nh, 1, Tk, Dv]
    a5 = s.allow[..., None]  # [B, Nh, Tq, Tk, 1]
    lo = torch.where(a5, vv, math.inf).amin(dim=-2)  # [B, Nh, Tq, Dv]
    hi = torch.where(a5, vv, -math.inf).amax(dim=-2)  # [B, Nh, Tq, Dv]
    outside = torch.clamp(torch.maximum(lo - s.out, s.out - hi), min=0.0)  # [B, Nh, Tq, Dv]
    outside = torch.nan_to_num(outside, nan=0.0).amax(dim=-1).masked_fill(s.empty, 0.0)  # [B, Nh, Tq]
    worst = float(outside.max()) if outside.numel() else 0.0
    wrong = outside > s.tol  # [B, Nh, Tq]
    return bounded(3, "convex_range", "largest distance of an output outside its value rows' range", worst, s.tol,
                   location=_first_row(wrong), data=_index_decode(s.case, s.out, s.allow, wrong))


def _empty_rows_check(s: _Setup, contract: str) -> Check:
    """L3: a query whose every key is blocked returns what the contract says (zeros, NaN or anything)."""
    import torch

    empty = s.empty
    if not empty.any():
        return _not_applicable("empty_rows", "every query has an allowed key")
    n = int(empty.sum())
    rows = s.out[empty]  # [n_empty, Dv]
    facts: dict[str, Any] = {"contract": contract, "empty_rows": n}
    if contract == "any":
        return Check(3, "empty_rows", "skipped", reason="the contract 'any' lets such a row hold anything", data=facts)
    if contract == "zeros":
        wrong = empty & ((s.out != 0) | torch.isnan(s.out)).any(-1)  # [B, Nh, Tq]
        facts["rows_with_nan"] = int(torch.isnan(rows).any(dim=-1).sum())
        facts["largest_finite_abs"] = float(torch.nan_to_num(rows.abs(), nan=0.0).max())
        return counted(3, "empty_rows", "rows with every key blocked that are not all zeros", int(wrong.sum()),
                       location=_first_row(wrong), data=facts)
    wrong = empty & ~torch.isnan(s.out).all(-1)  # [B, Nh, Tq]
    return counted(3, "empty_rows", "rows with every key blocked that are not all NaN", int(wrong.sum()),
                   location=_first_row(wrong), data=facts)


def _forbidden_probe(s: _Setup) -> Check:
    """L3: new k and v at keys a row may not use move nothing in that row."""
    import torch

    case, allow_full = s.case, s.allow
    if bool(allow_full.all()):
        return _not_applicable("forbidden_keys", "no key is forbidden in this case")
    # Probe 1: keys no query of an example may use (padding). Probe 2: the last key (the future, if causal).
    padded = ~allow_full.any(dim=1).any(dim=1)  # [B, Tk]
    last = torch.zeros(case.b, case.tk, dtype=torch.bool)  # [B, Tk]
    last[:, -1] = True
    worst_ok: Check | None = None
    for keys, which in ((padded, {"keys": "padded"}), (last, {"keys": "last", "key": case.tk - 1})):
        if not keys.any():
            continue
        uses = (allow_full & keys[:, None, None, :]).any(dim=-1)  # [B, Nh, Tq]: may use a perturbed key
        stay = ~uses
        if not stay.any():
            continue
        k2, v2 = s.k.clone(), s.v.clone()
        sel = keys[:, None, :].expand(case.b, case.nkv, case.tk)  # [B, Nkv, Tk]
        k2[sel] = s.fresh(k2[sel], s.qk_scale)
        v2[sel] = s.fresh(v2[sel], 1.0)
        c = _probe("forbidden_keys", "largest move of a row that may not use the changed keys", s.kernel,
                   (s.q, k2, v2), s.out, stay, None, s.tol, {**which, "inputs": "k, v", "rows": int(stay.sum())})
        if c.failed:
            return c
        worst_ok = c
    return worst_ok or _not_applicable("forbidden_keys", "no probe leaves a row that must stay")


def _causal_probe(s: _Setup) -> Check:
    """L4: changing the future (later queries, keys after the kept query) moves no earlier output."""
    import torch

    case = s.case
    if not case.causal:
        return _not_applicable("causal_intervention", "the case is not causal")
    if case.tq < 2:
        return _not_applicable("causal_intervention", "Tq = 1 has no later query")
    c = (case.tq - 1) // 2  # last query kept
    p = c + case.tk - case.tq  # its position on the key axis (bottom-right)
    q2, k2, v2 = s.q.clone(), s.k.clone(), s.v.clone()
    q2[:, :, c + 1:] = s.fresh(s.q[:, :, c + 1:], s.qk_scale)
    j0 = max(p + 1, 0)
    k2[:, :, j0:] = s.fresh(s.k[:, :, j0:], s.qk_scale)
    v2[:, :, j0:] = s.fresh(s.v[:, :, j0:], 1.0)
    live = ~s.empty
    before = torch.zeros_like(live)
    before[:, :, :c + 1] = True
    return _probe("causal_intervention", "largest move of an output before the changed future", s.kernel,
                  (q2, k2, v2), s.out, before, live & ~before, s.tol,
                  {"queries_from": c + 1, "keys_from": j0, "inputs": "q, k, v"})


def runnable_cases(cases: Iterable[Case]) -> tuple[list[Case], list[str]]:
    """The cases this torch build can run on the CPU, and a note for each dtype it cannot."""
    todo = list(cases)
    skipped: list[str] = []
    for name in ("f16", "bf16"):
        if any(c.dtype == name for c in todo) and not half_supported(DTYPES[name]):
            skipped.append(f"{DTYPES[name]} cases skipped: this torch build cannot run them on the CPU")
            todo = [c for c in todo if c.dtype != name]
    return todo, skipped


def check_kernel(
    fn: Callable[..., Any],
    cases: Iterable[Case] | None = None,
    *,
    target: str = "attention",
    empty_rows: str = "zeros",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run a kernel-protocol function over a grid of cases.

    Args:
        fn: ``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``.
        cases: cases to run (default: :data:`DEFAULT_GRID`).
        target: how the function was named, for the reproduction line.
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        progress: ``callback(done, total)``.

    Returns:
        A :class:`~attn_ledger.report.Report` with one row per case (see :func:`kernel_report`);
        its ``exit_code`` is 0 when every case passes, else 1.
    """
    if empty_rows not in EMPTY_ROWS:
        raise InputError(f"empty_rows: got {empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
    todo, skipped = runnable_cases(DEFAULT_GRID if cases is None else cases)
    results = []
    for i, case in enumerate(todo):
        results.append(check_case(fn, case, empty_rows=empty_rows, seed=seed))
        if progress is not None:
            progress(i + 1, len(todo))
    return kernel_report(results, target=target, empty_rows=empty_rows, seed=seed, skipped=skipped)
