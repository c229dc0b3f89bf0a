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
dtype, plus a small floor per dtype scaled by the largest value magnitude.
"""

from __future__ import annotations

import math
import re
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from attn_ledger.errors import InputError
from attn_ledger.report import LEVEL_NAMES, Check, envelope, find_check, json_number

if TYPE_CHECKING:
    import torch
    from torch import Tensor

MASKS = ("none", "causal-flag", "causal-mask", "pad", "pad-causal", "pad-empty")
INPUTS = ("rand", "index", "large")
DTYPES = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16"}
EMPTY_ROWS = ("zeros", "nan", "any")

FACTOR = 4.0
"""An implementation may be this many times less accurate than the plain same-dtype reference."""

_FLOOR = {"float64": 1e-10, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}
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


def default_grid() -> tuple[Case, ...]:
    """The default grid of cases (ids are stable between releases unless noted in the changelog)."""
    return DEFAULT_GRID


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
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) ^ (seed & 0xFFFFFFFF))
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
    """Every check on one case, in level order."""

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

    def to_json(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "case": self.case.to_json(),
            "verdict": "pass" if first is None else "fail",
            "first_failure": None if first is None else {"level": first.level, "check": first.name, "detail": first.detail},
            "tolerance": json_number(self.tolerance),
            "checks": [c.to_json() for c in self.checks],
        }


@dataclass(frozen=True)
class KernelCheckReport:
    """The result of ``attn-ledger check`` on a kernel-protocol function."""

    target: str
    empty_rows: str
    results: tuple[CaseResult, ...]
    skipped: tuple[str, ...] = ()
    elapsed_s: float = 0.0
    seed: int = 0

    @property
    def failing(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    @property
    def smallest_failing(self) -> CaseResult | None:
        """The failing case with the fewest input elements (ties: lowest first level, then id)."""
        failing = self.failing
        if not failing:
            return None
        return min(failing, key=lambda r: (r.case.size, r.first_failure.level, r.case.id))  # type: ignore[union-attr]

    @property
    def first_level(self) -> int | None:
        """The lowest level at which any case fails."""
        levels = [r.first_failure.level for r in self.failing]  # type: ignore[union-attr]
        return min(levels) if levels else None

    @property
    def verdict(self) -> str:
        return "pass" if not self.failing else "fail"

    @property
    def exit_code(self) -> int:
        return 0 if not self.failing else 1

    def reproduction(self, result: CaseResult | None = None) -> tuple[str, str] | None:
        """The CLI line and the Python lines that rerun a failing case (default: the smallest)."""
        result = result or self.smallest_failing
        if result is None:
            return None
        seed = f" --seed {self.seed}" if self.seed else ""
        rows = f" --empty-rows {self.empty_rows}" if self.empty_rows != "zeros" else ""
        cli = f"attn-ledger check {self.target} --case {result.case.id}{seed}{rows}"
        name = self.target.rsplit(":", 1)[-1] if ":" in self.target else "attention"
        seed_arg = f", seed={self.seed}" if self.seed else ""
        py = (
            f"q, k, v, kw = case_inputs({result.case.id!r}{seed_arg})\n"
            f"out = {name}(q, k, v, **kw)  # {result.case.call_text(name)}"
        )
        return cli, py

    def passes_through(self) -> tuple[str, ...]:
        """Checks evaluated on at least one case and failed on none, in level order."""
        seen: dict[str, bool] = {}
        for r in self.results:
            for c in r.checks:
                if c.ok is None:
                    continue
                seen[c.name] = seen.get(c.name, True) and not c.failed
        return tuple(name for _, name in CHECK_ORDER if seen.get(name))

    def to_json(self) -> dict[str, Any]:
        small = self.smallest_failing
        repro = self.reproduction()
        return envelope(
            "check",
            self.verdict,
            target=self.target,
            protocol="kernel",
            empty_rows=self.empty_rows,
            seed=self.seed,
            cases_total=len(self.results),
            cases_failed=len(self.failing),
            first_level=self.first_level,
            smallest_failing=None if small is None else {
                "case": small.case.id,
                "level": small.first_failure.level,  # type: ignore[union-attr]
                "check": small.first_failure.name,  # type: ignore[union-attr]
                "detail": small.first_failure.detail,  # type: ignore[union-attr]
                "reproduce_cli": repro[0] if repro else None,
                "reproduce_python": repro[1] if repro else None,
            },
            skipped=list(self.skipped),
            elapsed_s=json_number(round(self.elapsed_s, 3)),
            cases=[r.to_json() for r in self.results],
        )

    def to_markdown(self) -> str:
        return report_markdown(self)

    def to_rich(self) -> Any:
        return report_rich(self)

    def diagnosis(self) -> str:
        """Plain text: the summary line, each failing case's ledger, and the reproduction."""
        return report_text(self)


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


def _fmt(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else str(x)


def _where_first(mask: "Tensor") -> str:
    """Coordinates ``[b, h, i]`` of the first True entry of a ``[B, Nh, Tq]`` mask."""
    import torch

    idx = torch.nonzero(mask)
    if idx.numel() == 0:
        return "-"
    b, h, i = (int(x) for x in idx[0][:3])
    return f"[b={b}, h={h}, i={i}]"


class _Kernel:
    """Calls the user's function on clones of the inputs (so in-place edits cannot leak between calls)."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, kwargs

    def __call__(self, q: "Tensor", k: "Tensor", v: "Tensor") -> "Tensor":
        import torch

        kw = dict(self.kwargs)
        if kw.get("allow_mask") is not None:
            kw["allow_mask"] = kw["allow_mask"].clone()
        with torch.no_grad():
            out = self.fn(q.clone(), k.clone(), v.clone(), **kw)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"returned {type(out).__name__}, expected a Tensor")
        return out


def _probe(
    name: str, kernel: _Kernel, args: tuple["Tensor", "Tensor", "Tensor"], base: "Tensor",
    stay: "Tensor", move: "Tensor | None", tol: float, what: str,
) -> Check:
    """Run the kernel on perturbed inputs: ``stay`` outputs must not move, some ``move`` output must."""
    level = LEVEL_OF[name]
    try:
        out = _f64(kernel(*args))
    except Exception as exc:  # the user's code: any exception is a finding
        return Check(level, name, False, None, f"{what}: the call raised {type(exc).__name__}: {_first_line(exc)}")
    if tuple(out.shape) != tuple(base.shape):
        return Check(level, name, False, None, f"{what}: output shape changed to {list(out.shape)}")
    per_row = _row_diff(out, base)  # [B, Nh, Tq]
    leaked = float(per_row[stay].max()) if stay.any() else 0.0
    if leaked > tol:
        where = _where_first(stay & (per_row > tol))
        return Check(level, name, False, leaked,
                     f"{what}: output {where} moved by {_fmt(leaked)} but should not (tolerance {_fmt(tol)})")
    if move is not None and move.any():
        moved = float(per_row[move].max())
        if moved <= max(10 * tol, 1e-12):
            # A probe that moved nothing proves nothing either way: report it, do not judge on it.
            return Check(level, name, None, moved,
                         f"{what}: inconclusive, the outputs that should move changed by only {_fmt(moved)} "
                         f"and nothing that should stay moved")
        return Check(level, name, True, leaked,
                     f"{what}: outputs that should stay moved {_fmt(leaked)} (tolerance {_fmt(tol)}); "
                     f"the ones that should move moved {_fmt(moved)}")
    return Check(level, name, True, leaked, f"{what}: outputs that should stay moved {_fmt(leaked)} (tolerance {_fmt(tol)})")


def _row_diff(a: "Tensor", b: "Tensor") -> "Tensor":
    """Per output row ``[B, Nh, Tq]``: largest |a - b| over Dv; NaN against non-NaN is infinite."""
    import torch

    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.nan_to_num((a - b).abs(), nan=math.inf).masked_fill(both_nan, 0.0)
    return d.amax(dim=-1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


def _index_source(case: Case, out: "Tensor", allow_full: "Tensor", rows: "Tensor") -> str:
    """For index-encoded inputs: say where the worst output row's values came from.

    Each value of v is its own flat index (b, kv head, t, d) spread over [-1, 1), and each
    (b, kv head) owns a contiguous range, so coordinate 0 of an output row, a convex
    combination of value rows, decodes to the batch element and kv head it was mixed from
    and to a (weighted) key position.
    """
    import torch

    if case.inputs != "index" or not bool(rows.any()):
        return ""
    b, h, i = (int(x) for x in torch.nonzero(rows)[0][:3])
    n_total = case.b * case.nkv * case.tk * case.dv
    x = float(out[b, h, i, 0])
    if not math.isfinite(x):
        return ""
    n0 = (x + 1.0) * n_total / 2.0  # fractional flat index of coordinate 0
    group = case.nh // case.nkv
    allowed = torch.nonzero(allow_full[b, h, i]).flatten().tolist()
    own = (f"batch {b}, kv head {h // group}, keys "
           + (f"{allowed[0]}..{allowed[-1]}" if allowed else "none"))
    if not -0.5 <= n0 < n_total:
        return f"; out[b={b}, h={h}, i={i}] lies outside every value row's range (it may mix {own})"
    block = int(n0 // (case.tk * case.dv))
    pos = (n0 - block * case.tk * case.dv) / case.dv
    return (f"; index decode: read as a mix of value rows, out[b={b}, h={h}, i={i}] comes from batch {block // case.nkv}, "
            f"kv head {block % case.nkv}, near key {pos:.1f} (it may mix only {own})")


def _not_run(name: str, why: str) -> Check:
    return Check(LEVEL_OF[name], name, None, None, why)


def check_case(fn: Callable[..., Any], case: Case, *, empty_rows: str = "zeros", seed: int = 0) -> CaseResult:
    """Run every check on one case. Never raises for the user's mistakes; they become checks."""
    import torch

    from attn_ledger.reference import combined_allow, reference_attention, repeat_kv

    if empty_rows not in EMPTY_ROWS:
        raise InputError(f"empty_rows: got {empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
    q, k, v, kwargs = case_inputs(case, seed)
    kernel = _Kernel(fn, kwargs)
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 7919 * (seed + 1))
    dt = q.dtype
    checks: list[Check] = []

    try:
        raw = kernel(q, k, v)
    except Exception as exc:
        checks.append(Check(1, "call", False, None,
                            f"{case.call_text()} raised {type(exc).__name__}: {_first_line(exc)}"))
        checks += [_not_run(n, "not evaluated: the call raised") for _, n in CHECK_ORDER[1:]]
        return CaseResult(case, tuple(checks))
    checks.append(Check(1, "call", True, None, f"{case.call_text()} returned"))
    want = (case.b, case.nh, case.tq, case.dv)
    shape_ok = tuple(raw.shape) == want
    checks.append(Check(1, "shape", shape_ok, None,
                        f"output {list(raw.shape)}, expected [B, Nh, Tq, Dv] = {list(want)}"))
    checks.append(Check(1, "dtype", raw.dtype == dt, None,
                        f"output {str(raw.dtype).removeprefix('torch.')}, expected {case.dtype_name} (the inputs' dtype)"))
    if not shape_ok:
        checks += [_not_run(n, "not evaluated: wrong output shape") for _, n in CHECK_ORDER[3:]]
        return CaseResult(case, tuple(checks))

    out = _f64(raw)  # [B, Nh, Tq, Dv]
    allow = combined_allow(case.b, case.nh, case.tq, case.tk, kwargs["allow_mask"], kwargs["is_causal"])
    full = torch.ones(case.b, case.nh, case.tq, case.tk, dtype=torch.bool)
    allow_full = full if allow is None else (full & allow)  # [B, Nh, Tq, Tk]
    empty = ~allow_full.any(dim=-1)  # [B, Nh, Tq]
    live = ~empty
    ref64 = reference_attention(q, k, v, **kwargs)  # [B, Nh, Tq, Dv] float64
    plain = _f64(reference_attention(q, k, v, **kwargs, dtype=dt))
    vmax = float(v.abs().max().double()) if v.numel() else 0.0
    plain_err = _maxdiff(plain, ref64, live[..., None])
    tol = FACTOR * plain_err + _FLOOR[case.dtype_name] * (1.0 + vmax)
    x64 = lambda t: t.double()  # noqa: E731

    def fresh(t: "Tensor", scale: float) -> "Tensor":
        return (torch.randn(t.shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    qk_scale = _LARGE if case.inputs == "large" else 1.0

    # L2: isolation probes.
    if case.b >= 2:
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[0], k2[0], v2[0] = fresh(q[0], qk_scale), fresh(k[0], qk_scale), fresh(v[0], 1.0)
        stay = torch.zeros_like(empty)
        stay[1:] = True
        checks.append(_probe("batch_isolation", kernel, (q2, k2, v2), out, stay, live & ~stay, tol,
                             "new q, k, v for batch element 0"))
    else:
        checks.append(_not_run("batch_isolation", "not applicable: B = 1"))
    group = case.nh // case.nkv
    if case.nkv >= 2:
        g = case.nkv - 1
        k2, v2 = k.clone(), v.clone()
        k2[:, g], v2[:, g] = fresh(k[:, g], qk_scale), fresh(v[:, g], 1.0)
        served = torch.zeros_like(empty)
        served[:, g * group:(g + 1) * group] = True  # query heads h with h // (Nh // Nkv) == g
        checks.append(_probe("kv_head_isolation", kernel, (q, k2, v2), out, ~served, live & served, tol,
                             f"new k, v for kv head {g} (serves query heads {g * group}..{(g + 1) * group - 1})"))
    else:
        checks.append(_not_run("kv_head_isolation", "not applicable: Nkv = 1"))
    if case.nh >= 2:
        h = case.nh - 1
        q2 = q.clone()
        q2[:, h] = fresh(q[:, h], qk_scale)
        mine = torch.zeros_like(empty)
        mine[:, h] = True
        checks.append(_probe("q_head_isolation", kernel, (q2, k, v), out, ~mine,
                             live & mine & (allow_full.sum(-1) >= 2), tol, f"new q for query head {h}"))
    else:
        checks.append(_not_run("q_head_isolation", "not applicable: Nh = 1"))

    # L3: numerical invariants.
    nonfinite = int((~torch.isfinite(out) & live[..., None]).sum())
    checks.append(Check(3, "finite", nonfinite == 0, float(nonfinite),
                        f"{nonfinite} non-finite values in rows with at least one allowed key"
                        + (f", first at {_where_first((~torch.isfinite(out)).any(-1) & live)}" if nonfinite else "")))
    vv = repeat_kv(x64(v), case.nh)[:, :, None, :, :]  # [B, Nh, 1, Tk, Dv]
    a5 = allow_full[..., None]  # [B, Nh, Tq, Tk, 1]
    lo = torch.where(a5, vv, math.inf).amin(dim=-2)  # [B, Nh, Tq, Dv]
    hi = torch.where(a5, vv, -math.inf).amax(dim=-2)
    outside = torch.clamp(torch.maximum(lo - out, out - hi), min=0.0)
    outside = torch.nan_to_num(outside, nan=0.0).amax(dim=-1).masked_fill(empty, 0.0)  # [B, Nh, Tq]
    worst = float(outside.max()) if outside.numel() else 0.0
    checks.append(Check(3, "convex_range", worst <= tol, worst,
                        f"largest distance of an output row outside the range of the value rows it may mix: "
                        f"{_fmt(worst)} (tolerance {_fmt(tol)})"
                        + (f", at {_where_first(outside > tol)}" + _index_source(case, out, allow_full, outside > tol)
                           if worst > tol else "")))
    checks.append(_forbidden_probe(kernel, case, q, k, v, out, allow_full, fresh, qk_scale, tol))
    if empty.any():
        rows = out[empty]  # [n_empty, Dv]
        n = int(empty.sum())
        if empty_rows == "zeros":
            n_nan = int(torch.isnan(rows).any(dim=-1).sum())
            bad = float(torch.nan_to_num(rows.abs(), nan=0.0).max())
            ok = bad == 0.0 and n_nan == 0
            nonzero = empty & ((out.abs() > 0) | torch.isnan(out)).any(-1)
            detail = (f"{n} rows have every key blocked; contract 'zeros': {n_nan} rows hold NaN, "
                      f"largest finite |value| {_fmt(bad)}" + ("" if ok else f", first at {_where_first(nonzero)}"))
            checks.append(Check(3, "empty_rows", ok, float(n_nan) if n_nan else bad, detail))
        elif empty_rows == "nan":
            n_nan = int(torch.isnan(rows).all(dim=-1).sum())
            checks.append(Check(3, "empty_rows", n_nan == n, float(n - n_nan),
                                f"{n} rows have every key blocked; contract 'nan': {n - n_nan} of them are not all NaN"))
        else:
            checks.append(Check(3, "empty_rows", None, None,
                                f"{n} rows have every key blocked; contract 'any': not judged"))
    else:
        checks.append(_not_run("empty_rows", "not applicable: every query has an allowed key"))

    # L4: behaviour.
    err = _maxdiff(out, ref64, live[..., None])
    wrong_rows = _row_diff(out, ref64).masked_fill(empty, 0) > tol  # [B, Nh, Tq]
    checks.append(Check(4, "reference", err <= tol, err,
                        f"max |out - float64 reference| {_fmt(err)}; tolerance {_fmt(tol)} = {FACTOR:g} x "
                        f"plain {case.dtype_name} reference error {_fmt(plain_err)} + floor"
                        + (f"; first wrong row {_where_first(wrong_rows)}" + _index_source(case, out, allow_full, wrong_rows)
                           if err > tol else "")))
    checks.append(_causal_probe(kernel, case, q, k, v, out, live, fresh, qk_scale, tol))
    return CaseResult(case, tuple(checks), tol)


def _forbidden_probe(kernel, case, q, k, v, out, allow_full, fresh, qk_scale, tol) -> Check:
    import torch

    if bool(allow_full.all()):
        return _not_run("forbidden_keys", "not applicable: no key is forbidden in this case")
    # Probe 1: keys no query of an example may use (padding). Probe 2: the last key (the future, if causal).
    padded = ~allow_full.any(dim=1).any(dim=1)  # [B, Tk]
    last = torch.zeros(case.b, case.tk, dtype=torch.bool)
    last[:, -1] = True
    worst_ok: Check | None = None
    for keys, what in ((padded, "padded keys"), (last, f"key {case.tk - 1}")):
        if not keys.any():
            continue
        uses = (allow_full & keys[:, None, None, :]).any(dim=-1)  # [B, Nh, Tq]: may use a perturbed key
        stay = ~uses
        if not stay.any():
            continue
        k2, v2 = k.clone(), v.clone()
        sel = keys[:, None, :].expand(case.b, case.nkv, case.tk)  # [B, Nkv, Tk]
        k2[sel] = fresh(k2[sel], qk_scale)
        v2[sel] = fresh(v2[sel], 1.0)
        c = _probe("forbidden_keys", kernel, (q, k2, v2), out, stay, None, tol,
                   f"new k, v at {what}, forbidden for {int(stay.sum())} query rows")
        if c.failed:
            return c
        worst_ok = c
    return worst_ok or _not_run("forbidden_keys", "not applicable: no probe leaves a row that must stay")


def _causal_probe(kernel, case, q, k, v, out, live, fresh, qk_scale, tol) -> Check:
    import torch

    if not case.causal:
        return _not_run("causal_intervention", "not applicable: the case is not causal")
    if case.tq < 2:
        return _not_run("causal_intervention", "not applicable: Tq = 1 has no later query")
    c = (case.tq - 1) // 2  # last query kept
    p = c + case.tk - case.tq  # its position on the key axis (bottom-right)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, c + 1:] = fresh(q[:, :, c + 1:], qk_scale)
    j0 = max(p + 1, 0)
    k2[:, :, j0:] = fresh(k[:, :, j0:], qk_scale)
    v2[:, :, j0:] = fresh(v[:, :, j0:], 1.0)
    before = torch.zeros_like(live)
    before[:, :, :c + 1] = True
    return _probe("causal_intervention", kernel, (q2, k2, v2), out, before, live & ~before, tol,
                  f"new q at queries > {c} and k, v at keys >= {j0}")


def check_kernel(
    fn: Callable[..., Any],
    cases: Iterable[Case] | None = None,
    *,
    target: str = "attention",
    empty_rows: str = "zeros",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> KernelCheckReport:
    """Run a kernel-protocol function over a grid of cases.

    Args:
        fn: ``attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)``.
        cases: cases to run (default: :data:`DEFAULT_GRID`).
        target: how the function was named, for the reproduction line.
        empty_rows: contract for a query whose every key is blocked: ``zeros``, ``nan`` or ``any``.
        seed: varies the random inputs and perturbations.
        progress: ``callback(done, total)``.

    Returns:
        A :class:`KernelCheckReport`; its ``exit_code`` is 0 when every case passes, else 1.
    """
    if empty_rows not in EMPTY_ROWS:
        raise InputError(f"empty_rows: got {empty_rows!r}, expected one of {', '.join(EMPTY_ROWS)}")
    todo = list(DEFAULT_GRID if cases is None else cases)
    skipped: list[str] = []
    for name in ("f16", "bf16"):
        if any(c.dtype == name for c in todo) and not half_supported(DTYPES[name]):
            skipped.append(f"{DTYPES[name]} cases skipped: this torch build cannot run them on the CPU")
            todo = [c for c in todo if c.dtype != name]
    start = time.perf_counter()
    results = []
    for i, case in enumerate(todo):
        results.append(check_case(fn, case, empty_rows=empty_rows, seed=seed))
        if progress is not None:
            progress(i + 1, len(todo))
    return KernelCheckReport(target, empty_rows, tuple(results), tuple(skipped), time.perf_counter() - start, seed)


# --- rendering (formatting only) ----------------------------------------------------------


def _status(c: Check) -> str:
    return "pass" if c.ok else ("-" if c.ok is None else ("FAIL" if c.severity == "error" else "warn"))


def _indent(text: str) -> str:
    return "\n".join("  " + ln for ln in text.splitlines())


def _mark(c: Check, res: CaseResult) -> str:
    return "FIRST" if c is res.first_failure else _status(c)


def _summary_line(r: KernelCheckReport) -> str:
    n, nf = len(r.results), len(r.failing)
    if not nf:
        return f"{r.target}: all {n} cases pass (empty rows: {r.empty_rows})"
    s = r.smallest_failing
    f = s.first_failure  # type: ignore[union-attr]
    return (f"{r.target}: {nf} of {n} cases fail; first level reached: L{r.first_level}; "
            f"smallest failing case {s.case.id}: L{f.level} {f.name}")  # type: ignore[union-attr]


def _ordered(res: CaseResult) -> list[Check]:
    """The first failing check first, then the rest in level order."""
    first = res.first_failure
    rest = [c for c in res.checks if c is not first]
    return ([first] if first else []) + rest


def report_text(r: KernelCheckReport, max_cases: int = 3) -> str:
    """Plain text diagnosis (what the pytest helper puts in its AssertionError)."""
    lines = [_summary_line(r)]
    failing = sorted(r.failing, key=lambda x: (x.case.size, x.case.id))
    for res in failing[:max_cases]:
        lines.append("")
        lines.append(f"case {res.case.id}   {res.case.call_text()}")
        for c in _ordered(res):
            if c.ok is None:
                continue
            lines.append(f"  L{c.level} {c.name:<20} {_mark(c, res):<5} {c.detail}")
    if len(failing) > max_cases:
        lines.append(f"\n... and {len(failing) - max_cases} more failing cases")
    repro = r.reproduction()
    if repro:
        lines += ["", "reproduce:", f"  {repro[0]}", "  from attn_ledger.kernelcheck import case_inputs",
                  _indent(repro[1])]
    return "\n".join(lines)


def report_markdown(r: KernelCheckReport) -> str:
    out = [f"# attn-ledger check: {r.target}", "", _summary_line(r), ""]
    for res in sorted(r.failing, key=lambda x: (x.case.size, x.case.id)):
        out += [f"## Case `{res.case.id}`", "", f"`{res.case.call_text()}`", "",
                "| level | check | status | value | detail |", "|---|---|---|---|---|"]
        for c in _ordered(res):
            val = "" if c.value is None else _fmt(c.value)
            out.append(f"| L{c.level} | {c.name} | {_mark(c, res)} | {val} | {c.detail.replace('|', chr(92) + '|')} |")
        out.append("")
    out += ["## Cases", "", "| case | elements | result | first failure |", "|---|---|---|---|"]
    for res in r.results:
        f = res.first_failure
        out.append(f"| `{res.case.id}` | {res.case.size} | {'pass' if f is None else 'FAIL'} | "
                   f"{'' if f is None else f'L{f.level} {f.name}'} |")
    out.append("")
    for note in r.skipped:
        out.append(f"- {note}")
    repro = r.reproduction()
    if repro:
        out += ["## Reproduce the smallest failing case", "", "```", repro[0], "```", "", "```python",
                "from attn_ledger.kernelcheck import case_inputs", repro[1], "```", ""]
    return "\n".join(out)


def report_rich(r: KernelCheckReport) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def line(text: str, style: str = "") -> Text:
        # never wrapped, so a reproduction line stays one line to copy
        return Text(text, style=style, no_wrap=True, overflow="ignore")

    parts: list[Any] = []
    smallest = r.smallest_failing
    for res in sorted(r.failing, key=lambda x: (x is not smallest, x.case.size, x.case.id)):
        # The smallest failing case gets its whole ledger; the others show only their failing checks.
        full = res is smallest
        passed = sum(1 for c in res.checks if c.ok)
        title = f"case {res.case.id}   {res.case.call_text()}"
        t = Table(title=Text(title if full else f"{title}   ({passed} checks pass)"), title_justify="left",
                  show_edge=False, expand=False)
        for col in ("level", "check", "status", "detail"):
            t.add_column(col, no_wrap=col != "detail", overflow="fold")
        for c in _ordered(res):
            if not full and not c.failed:
                continue
            first = c is res.first_failure
            t.add_row(f"L{c.level}", c.name, "FIRST" if first else _status(c), Text(c.detail),
                      style="bold red" if first else ("dim" if c.ok is None else None))
        parts += [t, Text("")]
    summary = Table(title="cases", title_justify="left", show_edge=False)
    for col in ("case", "elements", "result", "first failure"):
        summary.add_column(col, no_wrap=col != "first failure", overflow="fold")
    for res in r.results:
        f = res.first_failure
        summary.add_row(res.case.id, str(res.case.size), "pass" if f is None else "FAIL",
                        "" if f is None else f"L{f.level} {f.name} ({LEVEL_NAMES[f.level]})",
                        style=None if f is None else "red")
    parts.append(summary)
    for note in r.skipped:
        parts.append(Text(note, style="yellow"))
    parts.append(Text(_summary_line(r), style="bold"))
    repro = r.reproduction()
    if repro:
        cli = repro[0].replace(" --case ", " \\\n      --case ", 1)
        py = "from attn_ledger.kernelcheck import case_inputs\n" + repro[1]
        parts += [Text("reproduce the smallest failing case:"), line(_indent(cli)), line(_indent(py))]
    return Group(*parts)
