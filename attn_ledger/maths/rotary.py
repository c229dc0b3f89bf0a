"""Rotary position embeddings: applying them, and recognising them in observed tensors.

One module serves every place that speaks of rotary positions: the pipeline applies a
:class:`RotarySpec`, and checks of a user's attention recognise one from a projection
output ``x`` and the tensor ``y`` that entered attention.

Rotary (RoFormer) splits the first ``rotated_dim`` features of each head into 2-D pairs;
pair ``j`` at position ``p`` is turned by the angle ``p * base ** (-2j / rotated_dim)``
(counter-clockwise, as complex multiplication by ``exp(i * angle)``); the remaining
features pass through. Two pairings are in use:

- ``half`` (GPT-NeoX, Llama's ``rotate_half``): pair ``j`` is features ``(j, j + rotated_dim/2)``;
- ``interleaved`` (GPT-J, the original RoFormer, Meta's complex form): pair ``j`` is
  features ``(2j, 2j + 1)``.

Axes: ``T`` is the position axis of the tensor at hand (Tq for queries, Tk for keys), Dh
the head width, P = rotated_dim / 2 the number of rotated pairs, N all leading axes
(B, Nh or Nkv) flattened together.

Public API:

- :class:`RotarySpec` ``(pairing="half", base=10000.0, rotated_dim=None)``: frozen, validated;
  ``rotated_dim=None`` rotates the whole head. ``spec.width(head_dim) -> int``.
- :func:`parse_spec` ``(text or table) -> RotarySpec``: the compact ``PAIRING[,base=B][,dim=D]``
  of ``run --rope`` and the config key ``rope``; :func:`spec_text` writes it back.
- :func:`inverse_frequencies` ``(base, rotated_dim) -> Tensor [P]`` (float64).
- :func:`pair_indices` ``(pairing, rotated_dim) -> (Tensor [P], Tensor [P])``: the two features of each pair.
- :func:`apply_rotary` ``(x, spec, *, offset=0, positions=None) -> Tensor``: rotate
  ``x [..., T, Dh]`` at positions ``offset + arange(T)`` or at ``positions``.
- :func:`recognise_rotary` ``(x, y, *, positions=0, max_offset=65536) -> RotaryObservation``:
  decide whether ``y`` is ``x`` unchanged, ``x`` rotated by a rotary spec at some position
  offset (found by fitting), or something else (never guessed).
- :func:`compare_positions` ``(q, k, v=None) -> PositionComparison``: judge the observations
  of q, k (and v) together: consistent rotary, offset between q and k, different specs, only
  one of them rotated, v rotated.

Limits of recognition (what the data cannot tell apart) are listed on :func:`recognise_rotary`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attn_ledger.errors import field_error

if TYPE_CHECKING:
    import torch
    from torch import Tensor


PAIRINGS = ("half", "interleaved")
DEFAULT_BASE = 10000.0
DEFAULT_MAX_OFFSET = 65536

# Implementations commonly compute their angles in float32 (a float32 inverse-frequency
# buffer, even when the tensors are float64), so an observed angle may be off by about
# position * float32 epsilon; recognition allows that much on top of the dtype's tolerance.
_ANGLE_EPS = 2.0 ** -23
_FIT_ROWS = 256  # leading-axis vectors used for fitting; the final residual uses all of them
_OFFSET_CHUNK = 1 << 17
_NEAR_OFFSET = 4096  # searched first


# --- the spec and applying it -------------------------------------------------------------

@dataclass(frozen=True)
class RotarySpec:
    """How rotary positions are applied.

    Attributes:
        pairing: ``"half"`` (features j and j + rotated_dim/2) or ``"interleaved"`` (2j and 2j + 1).
        base: the frequency base; pair j turns by ``base ** (-2j / rotated_dim)`` per position.
        rotated_dim: how many leading features of each head rotate (even); None means all of Dh.
    """

    pairing: str = "half"
    base: float = DEFAULT_BASE
    rotated_dim: int | None = None

    def __post_init__(self) -> None:
        if self.pairing not in PAIRINGS:
            raise field_error("rope.pairing", self.pairing, "'half' or 'interleaved'")
        if isinstance(self.base, bool) or not isinstance(self.base, (int, float)) \
                or not math.isfinite(self.base) or self.base <= 1:
            raise field_error("rope.base", self.base, "a finite number > 1")
        object.__setattr__(self, "base", float(self.base))
        rd = self.rotated_dim
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2):
            raise field_error("rope.rotated_dim", rd, "an even integer >= 2, or None for the whole head")

    def width(self, head_dim: int) -> int:
        """The rotated width for heads of ``head_dim`` features (validated against it)."""
        rd = head_dim - head_dim % 2 if self.rotated_dim is None else self.rotated_dim
        if rd > head_dim or rd < 2:
            raise field_error("rope.rotated_dim", self.rotated_dim,
                              f"an even integer from 2 to the head width {head_dim}")
        return rd


SPEC_SYNTAX = "PAIRING[,base=B][,dim=D] with PAIRING half or interleaved, e.g. half or interleaved,base=500000,dim=32"


def parse_spec(value: "str | dict | RotarySpec", field: str = "rope") -> RotarySpec:
    """A spec from its compact text ``PAIRING[,base=B][,dim=D]`` or a table ``{pairing, base, rotated_dim}``.

    ``half`` rotates the whole head at base 10000; ``interleaved,base=500000,dim=32`` rotates
    the first 32 features of each head in adjacent pairs at base 500000.

    Raises:
        InputError: one line naming ``field``, the value and the syntax.
    """
    if isinstance(value, RotarySpec):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"pairing", "base", "rotated_dim"})
        if unknown:
            raise field_error(field, value, "a table with keys pairing, base, rotated_dim")
        return _spec(value.get("pairing", "half"), value.get("base", DEFAULT_BASE), value.get("rotated_dim"), field)
    if not isinstance(value, str) or not value.strip():
        raise field_error(field, value, SPEC_SYNTAX)
    pairing, *rest = [part.strip() for part in value.split(",")]
    found: dict[str, str] = {}
    for part in rest:
        key, sep, text = part.partition("=")
        if not sep or key not in ("base", "dim") or key in found:
            raise field_error(field, value, SPEC_SYNTAX)
        found[key] = text
    try:
        base = float(found["base"]) if "base" in found else DEFAULT_BASE
        dim = int(found["dim"]) if "dim" in found else None
    except ValueError:
        raise field_error(field, value, SPEC_SYNTAX) from None
    return _spec(pairing, base, dim, field)


def _spec(pairing: object, base: object, dim: object, field: str) -> RotarySpec:
    from attn_ledger.errors import InputError

    try:
        return RotarySpec(pairing, base, dim)  # type: ignore[arg-type]
    except InputError as exc:
        raise InputError(str(exc).replace("rope.", f"{field}.", 1)) from None


def spec_text(spec: RotarySpec) -> str:
    """The compact text of a spec (:func:`parse_spec` reads it back)."""
    text = spec.pairing + ("" if spec.base == DEFAULT_BASE else f",base={spec.base:g}")
    return text + ("" if spec.rotated_dim is None else f",dim={spec.rotated_dim}")


def inverse_frequencies(base: float, rotated_dim: int) -> "Tensor":
    """``[P]`` float64: pair j turns by ``base ** (-2j / rotated_dim)`` radians per position."""
    import torch

    j = torch.arange(rotated_dim // 2, dtype=torch.float64)  # [P]
    return torch.exp(j * (-2.0 * math.log(base) / rotated_dim))  # [P]


def pair_indices(pairing: str, rotated_dim: int) -> tuple["Tensor", "Tensor"]:
    """The first and second feature of each pair, two ``[P]`` long tensors."""
    import torch

    p = rotated_dim // 2
    if pairing == "half":
        first = torch.arange(p)  # [P]
        return first, first + p
    if pairing == "interleaved":
        first = torch.arange(0, 2 * p, 2)  # [P]
        return first, first + 1
    raise field_error("rope.pairing", pairing, "'half' or 'interleaved'")


def apply_rotary(x: "Tensor", spec: RotarySpec, *, offset: int = 0,
                 positions: "Tensor | None" = None) -> "Tensor":
    """Rotate ``x`` as rotary position embeddings do; angles and products in float64.

    Args:
        x: ``[..., T, Dh]`` floating point (q as ``[B, Nh, Tq, Dh]``, k as ``[B, Nkv, Tk, Dh]``).
        spec: pairing, base and rotated width.
        offset: the position of row 0 when ``positions`` is not given (rows sit at ``offset + t``).
        positions: integer tensor broadcastable to ``x.shape[:-1]`` (e.g. ``[T]`` or ``[B, 1, T]``).

    Returns:
        ``[..., T, Dh]`` in ``x``'s dtype: the rotated features rounded once from float64,
        the features past ``rotated_dim`` unchanged.
    """
    import torch

    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise field_error("x", _describe_tensor(x), "a floating-point tensor [..., T, Dh]")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise field_error("offset", offset, "an integer")
    t, dh = x.shape[-2], x.shape[-1]
    rd = spec.width(dh)
    if positions is None:
        pos = torch.arange(t, dtype=torch.float64, device=x.device) + offset  # [T]
    else:
        pos = _checked_positions(positions, x, offset)  # broadcastable to [..., T]
    angle = pos.unsqueeze(-1) * inverse_frequencies(spec.base, rd).to(x.device)  # [..., T, P]
    cos, sin = torch.cos(angle), torch.sin(angle)  # [..., T, P]
    first, second = (i.to(x.device) for i in pair_indices(spec.pairing, rd))
    x64 = x.to(torch.float64)  # [..., T, Dh]
    a, b = x64[..., first], x64[..., second]  # [..., T, P] each
    out = x64.clone()  # [..., T, Dh]
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out.to(x.dtype)


def _checked_positions(positions: "Tensor", x: "Tensor", offset: int) -> "Tensor":
    import torch

    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype == torch.bool:
        raise field_error("positions", _describe_tensor(positions), "an integer tensor")
    if offset != 0:
        raise field_error("offset", offset, "0 when positions are given (add it to the positions)")
    try:
        torch.broadcast_shapes(tuple(positions.shape), tuple(x.shape[:-1]))
    except RuntimeError:
        raise field_error("positions", _Text(f"shape {tuple(positions.shape)}"),
                          f"a shape broadcastable to {tuple(x.shape[:-1])}") from None
    return positions.to(device=x.device, dtype=torch.float64)


class _Text(str):
    """A description shown as is (unquoted) in a field error."""

    def __repr__(self) -> str:
        return str(self)


def _describe_tensor(t: object) -> _Text:
    shape = getattr(t, "shape", None)
    if shape is None:
        return _Text(type(t).__name__)
    return _Text(f"{type(t).__name__} {getattr(t, 'dtype', '')} shape {tuple(shape)}")


# --- recognition ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RotaryObservation:
    """What the step from ``x`` (projection output) to ``y`` (attention input) was.

    Relative numbers are measured against ``max |x|`` and judged against ``tolerance``.

    Attributes:
        kind: ``"none"`` (y is x), ``"rotary"`` (y is x rotated by ``spec`` at position
            ``p + offset``) or ``"unrecognised"`` (any other change, described by the numbers).
        spec: the fitted spec (kind ``"rotary"``), with its base rounded to the fewest
            significant digits that still fit within tolerance.
        offset: y at known position p is x rotated as position ``p + offset``.
        residual: max |y - fitted| relative (for ``"none"``: max |y - x|; for
            ``"unrecognised"``: the closest rotary fit tried, NaN when none could be tried).
        tolerance: the relative tolerance (dtype tolerance plus float32 angle rounding).
        max_change: max |y - x| relative.
        norm_change: max over vectors of | |y| - |x| |, relative to the largest |x|.
        norm_preserved: ``norm_change <= tolerance``.
        position_dependent: False when one affine map explains y from x at every position,
            True when none does, None when there are too few vectors to tell.
        changed_positions: how many of the ``positions`` rows differ beyond tolerance.
        positions: T, the number of positions observed.
        first_changed_position: the first known position whose row differs, or None.
        base_fitted: the base as fitted, before rounding.
        alternatives: other specs that explain y equally well: the other pairing where it
            fits too (a single rotated pair), the narrowest rotated width where the width is
            ambiguous (unrotated-looking pairs at the end of an interleaved head).
        nonfinite: entries of x or y that are NaN or infinite (recognition is not attempted).
        head_dim: Dh.
    """

    kind: str
    spec: RotarySpec | None
    offset: int | None
    residual: float
    tolerance: float
    max_change: float
    norm_change: float
    norm_preserved: bool
    position_dependent: bool | None
    changed_positions: int
    positions: int
    first_changed_position: int | None
    base_fitted: float | None
    head_dim: int
    alternatives: tuple[RotarySpec, ...] = field(default=())
    nonfinite: int = 0

    @property
    def rotated(self) -> bool:
        return self.kind == "rotary"

    def describe(self) -> str:
        """One line, rendered from the fields."""
        if self.nonfinite:
            return f"not examined: {self.nonfinite} non-finite entries"
        if self.kind == "none":
            return f"no rotation: max |y - x| {self.max_change:.2g} of max |x| (tolerance {self.tolerance:.2g})"
        if self.kind == "rotary":
            s = self.spec
            return (f"rotary {s.pairing}, base {s.base:g}, rotated {s.width(self.head_dim)} of {self.head_dim}, "
                    f"offset {self.offset:+d}, residual {self.residual:.2g} (tolerance {self.tolerance:.2g})")
        dep = {True: "position-dependent", False: "position-independent", None: "unrecognised"}[
            self.position_dependent]
        return (f"{dep} change, not rotary: norm {'preserved' if self.norm_preserved else 'changed'} "
                f"(max {self.norm_change:.2g}), rows changed at {self.changed_positions} of {self.positions} "
                f"positions, max change {self.max_change:.2g}, closest rotary residual {self.residual:.2g} "
                f"(tolerance {self.tolerance:.2g})")


# long by its docstring (what is recognised, and the numbers it returns); the code is under 30 lines
def recognise_rotary(x: "Tensor", y: "Tensor", *, positions: "int | Tensor" = 0,
                     max_offset: int = DEFAULT_MAX_OFFSET) -> RotaryObservation:
    """Recognise rotary position embeddings between a projection output and an attention input.

    Pairing, rotated width, base and position offset are all fitted, none assumed: for each
    pairing layout (half-split with the partner of feature 0 found by a 2-D rotation fit,
    and interleaved), the best 2-D rotation of every pair at every position gives an angle
    (atan2 over all vectors); unwrapped along the positions, the slopes give the frequencies,
    whose log-linear law gives the base; the intercepts give the offset (an integer search,
    then a Gauss-Newton refinement of the base). The fitted spec is re-applied and kept only
    if the residual is within tolerance; otherwise the change is reported unrecognised.

    Args:
        x: ``[..., T, Dh]`` the projection output split into heads, before any rotation.
        y: ``[..., T, Dh]`` the tensor that entered attention.
        positions: the known positions of the T rows: an int (the first, rows consecutive)
            or a strictly increasing 1-D integer tensor ``[T]`` with steps of at most 3 (so
            the angles can be unwrapped).
        max_offset: offsets are searched in ``[-max_offset, max_offset]``.

    Limits (what the data cannot tell apart, or what is not modelled):
        - at least two positions are needed to fit; with one, a rotation is unrecognised;
        - a pair whose angle never exceeds the tolerance is invisible: the width of an
          interleaved rotation is then ambiguous (the widest fitting one is chosen and the
          narrowest listed in ``alternatives``), and with one rotated pair the base has no
          effect (the default is reported) and the pairings coincide;
        - with one rotated pair, offsets that differ by 710 (113 turns and 6e-5 rad) are told
          apart only by that residue: the best-fitting one is reported, which in half precision
          may be a multiple of 710 away;
        - one offset must hold for every vector (all of B and the heads): positions that
          differ per example or per head are unrecognised (recognise each example apart);
        - frequency-scaled variants (linear position interpolation, YaRN, Llama 3 scaling),
          rotation in the opposite sense, and rotated features that are not the leading ones
          of each head are reported unrecognised (NTK-aware scaling, a change of base only,
          is recognised with its effective base), unless the part that differs stays within
          tolerance over the positions seen;
        - in half precision, large offsets may be unrecognised (the fitted frequencies are
          too coarse to place them).
    """
    import torch

    t_pos = _recognition_positions(x, y, positions)  # [T] float64
    if isinstance(max_offset, bool) or not isinstance(max_offset, int) or max_offset < 0:
        raise field_error("max_offset", max_offset, "a non-negative integer")
    n_bad = int((~torch.isfinite(x)).sum()) + int((~torch.isfinite(y)).sum())
    dh = x.shape[-1]
    if n_bad:
        nan = float("nan")
        return RotaryObservation("unrecognised", None, None, nan, nan, nan, nan, False, None, 0,
                                 len(t_pos), None, None, dh, nonfinite=n_bad)
    dtype = x.dtype if torch.finfo(x.dtype).eps >= torch.finfo(y.dtype).eps else y.dtype
    x64 = x.detach().to("cpu", torch.float64).reshape(-1, *x.shape[-2:])  # [N, T, Dh]
    y64 = y.detach().to("cpu", torch.float64).reshape(-1, *y.shape[-2:])  # [N, T, Dh]
    seen = _Seen.measure(x64, y64, t_pos, _tolerance(dtype, float(t_pos.abs().max())))
    if seen.max_change <= seen.tol:
        return seen.observation("none", None, None, seen.max_change, position_dependent=False)
    fits = _fit_all(x64, y64, t_pos, dtype, max_offset, seen) if len(t_pos) >= 2 else []
    good = [f for f in fits if f.residual <= f.tol]
    if not good:
        best = min((f.residual for f in fits), default=float("nan"))
        return seen.observation("unrecognised", None, None, best,
                                position_dependent=_position_dependent(x64, y64, seen.tol))
    chosen = good[0]
    alternatives = tuple(f.spec for f in good[1:] if f.spec != chosen.spec)
    return seen.observation("rotary", chosen.spec, chosen.offset, chosen.residual, position_dependent=True,
                            tol=chosen.tol, base_fitted=chosen.base_fitted, alternatives=alternatives)


def _recognition_positions(x: "Tensor", y: "Tensor", positions: "int | Tensor") -> "Tensor":
    import torch

    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2 or t.shape[-2] < 1:
            raise field_error(name, _describe_tensor(t), "a floating-point tensor [..., T, Dh] with T >= 1")
    if x.shape != y.shape:
        raise field_error("y", _Text(f"shape {tuple(y.shape)}"), f"the shape of x {tuple(x.shape)}")
    t = x.shape[-2]
    if isinstance(positions, int) and not isinstance(positions, bool):
        return torch.arange(t, dtype=torch.float64) + positions  # [T]
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype == torch.bool or tuple(positions.shape) != (t,):
        raise field_error("positions", _describe_tensor(positions), f"an int or an integer tensor of shape ({t},)")
    pos = positions.detach().to("cpu", torch.float64)  # [T]
    step = pos[1:] - pos[:-1]  # [T-1]
    if t > 1 and (bool((step < 1).any()) or bool((step > 3).any())):
        raise field_error("positions", positions.tolist(), "strictly increasing, in steps of at most 3")
    return pos


def tolerance_for(dtype: "torch.dtype", max_position: float) -> float:
    """The relative tolerance recognition judges a rotation by: the dtype's, plus float32 angle rounding."""
    return _tolerance(dtype, max_position)


def _tolerance(dtype: "torch.dtype", max_position: float) -> float:
    from attn_ledger.tolerance import reference as tolerance

    rtol, _ = tolerance(dtype)
    return 4.0 * rtol + 8.0 * _ANGLE_EPS * max(1.0, max_position)


@dataclass(frozen=True)
class _Seen:
    """Model-free measurements of the change from x to y."""

    pos: "Tensor"
    scale: float
    tol: float
    max_change: float
    norm_change: float
    changed_positions: int
    first_changed: int | None
    head_dim: int

    @staticmethod
    def measure(x64: "Tensor", y64: "Tensor", pos: "Tensor", tol: float) -> "_Seen":
        scale = float(x64.abs().max()) or float(y64.abs().max()) or 1.0  # relative to x unless x is all zero
        row_change = (y64 - x64).abs().amax(dim=(0, 2)) / scale  # [T]
        norms_x = x64.norm(dim=-1)  # [N, T]
        norm_change = float((y64.norm(dim=-1) - norms_x).abs().max()) / max(float(norms_x.max()), 1e-300)
        changed = row_change > tol  # [T]
        first = int(pos[changed.nonzero()[0, 0]]) if bool(changed.any()) else None
        return _Seen(pos, scale, tol, float(row_change.max()), norm_change, int(changed.sum()), first,
                     x64.shape[-1])

    def observation(self, kind: str, spec: RotarySpec | None, offset: int | None, residual: float, *,
                    position_dependent: bool | None, tol: float | None = None, base_fitted: float | None = None,
                    alternatives: tuple[RotarySpec, ...] = ()) -> RotaryObservation:
        tol = self.tol if tol is None else tol
        return RotaryObservation(kind, spec, offset, residual, tol, self.max_change, self.norm_change,
                                 self.norm_change <= tol, position_dependent, self.changed_positions,
                                 len(self.pos), self.first_changed, base_fitted, self.head_dim, alternatives)


@dataclass(frozen=True)
class _Fit:
    spec: RotarySpec
    offset: int
    residual: float
    tol: float
    base_fitted: float


def _fit_all(x64: "Tensor", y64: "Tensor", pos: "Tensor", dtype: "torch.dtype", max_offset: int,
             seen: _Seen) -> list[_Fit]:
    """Candidate fits in order of preference: half-split, then interleaved full width, then narrowest.

    Offsets are searched near zero first, where they nearly always are, and over the whole
    ``[-max_offset, max_offset]`` only when nothing fits there.
    """
    import torch

    n, _, dh = x64.shape
    rows = torch.linspace(0, n - 1, min(n, _FIT_ROWS)).round().long().unique()
    xs, ys = x64[rows], y64[rows]  # [n', T, Dh] each
    layouts = [("half", _half_partner(xs, ys)), ("interleaved", dh // 2)] if dh >= 2 else []
    fits: list[_Fit] = []
    for reach in sorted({min(_NEAR_OFFSET, max_offset), max_offset}):
        fits = []
        for pairing, n_pairs in layouts:
            first, second = pair_indices(pairing, 2 * n_pairs)
            params = _fit_layout(xs, ys, pos, first, second, seen.tol, seen.scale, reach)
            if params is None:
                continue
            lam, offset, n_visible = params
            widths = [n_pairs] if pairing == "half" else sorted({n_pairs, n_visible}, reverse=True)
            fits += [f for w in widths if (f := _finish(x64, y64, pos, pairing, w, lam, offset, dtype, seen.scale))]
        if any(f.residual <= f.tol for f in fits):
            break
    return fits


def _finish(x64: "Tensor", y64: "Tensor", pos: "Tensor", pairing: str, n_rot: int, lam: float, offset: int,
            dtype: "torch.dtype", scale: float) -> _Fit | None:
    """The spec for ``n_rot`` rotated pairs, its base rounded where the data allows, and its residual."""
    base = math.exp(lam * n_rot) if n_rot > 1 else DEFAULT_BASE  # one pair: the base has no effect
    if not math.isfinite(base) or base <= 1:
        return None
    tol = _tolerance(dtype, float((pos + offset).abs().max()))

    def residual(b: float) -> float:
        spec = RotarySpec(pairing, b, 2 * n_rot)
        got = apply_rotary(x64, spec, positions=(pos + offset).long())  # [N, T, Dh]
        return float((got - y64).abs().max()) / scale

    for digits in range(1, 7):
        rounded = float(f"{base:.{digits - 1}e}")
        if rounded > 1 and (r := residual(rounded)) <= tol:
            return _Fit(RotarySpec(pairing, rounded, 2 * n_rot), offset, r, tol, base)
    return _Fit(RotarySpec(pairing, base, 2 * n_rot), offset, residual(base), tol, base)


def _pair_rotations(xs: "Tensor", ys: "Tensor", first: "Tensor", second: "Tensor"):
    """Best 2-D rotation of each pair at each position, over all vectors (orthogonal Procrustes).

    Returns ``(angle, strength, misfit)``, each ``[T, P]``: the angle, the weight of the
    evidence (|sum of y . R x| at the best angle) and the squared residual of that rotation.
    """
    import torch

    xa, xb, ya, yb = xs[..., first], xs[..., second], ys[..., first], ys[..., second]  # [n', T, P] each
    s = (xa * yb - xb * ya).sum(0)  # [T, P]
    c = (xa * ya + xb * yb).sum(0)  # [T, P]
    energy = (xa * xa + xb * xb + ya * ya + yb * yb).sum(0)  # [T, P]
    strength = torch.hypot(s, c)  # [T, P]
    return torch.atan2(s, c), strength, (energy - 2 * strength).clamp_min(0.0)


def _half_partner(xs: "Tensor", ys: "Tensor") -> int:
    """The feature that turns with feature 0 under half-split pairing, i.e. rotated_dim / 2."""
    import torch

    m = xs.shape[-1] // 2
    first = torch.zeros(m, dtype=torch.long)  # [M]
    second = torch.arange(1, m + 1)  # [M]
    _, strength, misfit = _pair_rotations(xs, ys, first, second)
    energy = misfit + 2 * strength  # [T, M]
    ratio = misfit.sum(0) / energy.sum(0).clamp_min(1e-300)  # [M]
    return int(ratio.argmin()) + 1


def _fit_layout(xs: "Tensor", ys: "Tensor", pos: "Tensor", first: "Tensor", second: "Tensor",
                tol: float, scale: float, max_offset: int) -> tuple[float, int, int] | None:
    """Fit ``(lam, offset, visible pairs)`` where pair j turns by ``(p + offset) * exp(-j * lam)``.

    None when the layout cannot be rotary: the first pair does not move, or the frequencies
    cannot be measured.
    """
    angle, strength, misfit = _pair_rotations(xs, ys, first, second)  # [T, P] each
    if math.sqrt(float(misfit.mean()) / (2 * xs.shape[0])) > tol * scale:
        return None  # even the best rotation of each pair misses by more than any rotary may
    change = _max_pair_change(xs, ys, first, second) / scale  # [P]
    visible = (change > tol).nonzero()
    if len(visible) == 0 or int(visible[0]) != 0:
        return None
    n_vis = int(visible[-1]) + 1
    angle, strength = angle[:, :n_vis], strength[:, :n_vis]  # [T, Pv]
    lam = _log_law(_unwrapped_slopes(angle, pos), float(pos[-1] - pos[0]), tol) if n_vis > 1 else 1.0
    if lam is None:
        return None
    offset = _search_offset(angle, strength, pos, lam, -max_offset, max_offset)
    for _ in range(2):  # the first base comes from slopes alone; refine it with the offset, then re-place
        lam = _refine_lam(angle, strength, pos + offset, lam) if n_vis > 1 else lam
        if lam is None:
            return None
        offset = _search_offset(angle, strength, pos, lam, max(-max_offset, offset - 64),
                                min(max_offset, offset + 64))
    return lam, offset, n_vis


def _max_pair_change(xs: "Tensor", ys: "Tensor", first: "Tensor", second: "Tensor") -> "Tensor":
    d = (ys - xs).abs()  # [n', T, Dh]
    return d[..., first].amax(dim=(0, 1)).maximum(d[..., second].amax(dim=(0, 1)))  # [P]


def _wrap(a: "Tensor") -> "Tensor":
    import torch

    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def _unwrapped_slopes(angle: "Tensor", pos: "Tensor") -> "Tensor":
    """``[P]``: least-squares slope of each pair's unwrapped angle against position."""
    import torch

    steps = _wrap(angle[1:] - angle[:-1])  # [T-1, P]: |true step| <= 3 < pi since frequencies <= 1
    unwrapped = torch.cat([angle[:1], angle[:1] + steps.cumsum(0)])  # [T, P]
    pc = (pos - pos.mean()).unsqueeze(-1)  # [T, 1]
    return (pc * (unwrapped - unwrapped.mean(0))).sum(0) / (pc * pc).sum()  # [P]


def _log_law(slopes: "Tensor", span: float, tol: float) -> float | None:
    """lam in ``slope_j = exp(-j * lam)`` by weighted least squares through slope_0 = 1.

    Pairs that turn too little over the positions to measure are left out; each pair is
    weighted by its inverse variance in log space, (slope * span) ** 2.
    """
    import torch

    j = torch.arange(len(slopes), dtype=torch.float64)  # [P]
    usable = (j >= 1) & (slopes > 0) & (slopes * span > 20 * tol)  # [P]
    if not bool(usable.any()):
        return None
    w = (slopes * span) ** 2  # [P]
    lam = float(-(w * j * torch.log(slopes.clamp_min(1e-300)))[usable].sum() / (w * j * j)[usable].sum())
    return lam if lam > 0 else None


def _search_offset(angle: "Tensor", strength: "Tensor", pos: "Tensor", lam: float, lo: int, hi: int) -> int:
    """The integer offset in ``[lo, hi]`` whose angles best match, the smallest |offset| among equals.

    Each pair's intercept (its angle at position 0 once the slope is taken out) must equal
    ``offset * omega_j`` modulo a turn; the cost weighs pairs by the evidence behind them.
    Every offset is scored on a few pairs spread over the frequencies (a vernier: the slow
    ones place it roughly, the fast ones exactly), then the best few on all pairs.
    """
    import torch

    n_pairs = angle.shape[1]
    omega = torch.exp(-lam * torch.arange(n_pairs, dtype=torch.float64))  # [P]
    rel = strength * torch.polar(torch.ones_like(angle), angle - pos.unsqueeze(-1) * omega)  # [T, P]
    z = rel.sum(0)  # [P]
    intercept, weight = z.angle(), z.abs()  # [P] each

    def cost(o: "Tensor", pairs: "Tensor") -> "Tensor":
        phase = o.unsqueeze(-1) * omega[pairs] - intercept[pairs]  # [C, p]
        return (weight[pairs] * (1 - torch.cos(phase))).sum(-1)  # [C]

    probe = torch.linspace(0, n_pairs - 1, min(n_pairs, 6)).round().long().unique()  # [p]
    rough = torch.cat([cost(torch.arange(a, min(a + _OFFSET_CHUNK, hi + 1), dtype=torch.float64), probe)
                       for a in range(lo, hi + 1, _OFFSET_CHUNK)])  # [hi - lo + 1]
    best = rough.topk(min(64, len(rough)), largest=False).indices.to(torch.float64) + lo  # [K]
    full = cost(best, torch.arange(n_pairs))  # [K]
    floor = float(full.min())  # the noise at the best offset; ties within it go to the smallest |offset|
    near = best[full <= 2 * floor + 1e-12 * float(weight.sum())]  # [K']
    return int(near[near.abs().argmin()])


def _refine_lam(angle: "Tensor", strength: "Tensor", abs_pos: "Tensor", lam: float) -> float | None:
    """Gauss-Newton on lam, with the offset fixed, over the wrapped angle residuals."""
    import torch

    j = torch.arange(angle.shape[1], dtype=torch.float64)  # [P]
    p = abs_pos.unsqueeze(-1)  # [T, 1]
    for _ in range(8):
        omega = torch.exp(-lam * j)  # [P]
        err = _wrap(angle - p * omega)  # [T, P]
        grad = p * j * omega  # [T, P]: d err / d lam
        denom = float((strength * grad * grad).sum())
        if denom == 0:
            break
        step = -float((strength * err * grad).sum()) / denom
        lam += step
        if lam <= 0:
            return None
        if abs(step) <= 1e-15 * lam:
            break
    return lam


def _position_dependent(x64: "Tensor", y64: "Tensor", tol: float) -> bool | None:
    """Whether one affine map ``y = x W + b`` fails to explain every position (None: too few vectors)."""
    import torch

    n, t, dh = x64.shape
    if t < 2:
        return None
    xf, yf = x64.reshape(n * t, dh), y64.reshape(n * t, dh)  # [N*T, Dh]
    rows = torch.linspace(0, n * t - 1, min(n * t, 16 * (dh + 1))).round().long().unique()
    if len(rows) < 2 * (dh + 1):
        return None
    a = torch.cat([xf[rows], torch.ones(len(rows), 1, dtype=torch.float64)], dim=1)  # [R, Dh+1]
    w = torch.linalg.lstsq(a, yf[rows]).solution  # [Dh+1, Dh]
    scale = max(float(x64.abs().max()), 1e-300)
    fitted = torch.cat([xf, torch.ones(n * t, 1, dtype=torch.float64)], dim=1) @ w  # [N*T, Dh]
    return float((fitted - yf).abs().max()) / scale > tol


# --- judging q, k and v together -------------------------------------------------------------

FINDINGS = ("v_rotated", "qk_offset", "qk_spec", "only_q_rotated", "only_k_rotated")


@dataclass(frozen=True)
class PositionComparison:
    """The rotations seen on q, k and v, judged together.

    Attributes:
        status: ``"pass"`` (a consistent rotary on q and k, or no rotation anywhere),
            ``"fail"`` (at least one finding) or ``"inconclusive"`` (an unrecognised change
            and no finding).
        findings: codes from :data:`FINDINGS`: ``v_rotated``; ``qk_offset`` (same spec, q and
            k at positions ``offset_between`` apart); ``qk_spec`` (q and k rotated by
            different specs); ``only_q_rotated``; ``only_k_rotated``.
        offset_between: ``q.offset - k.offset`` when both are rotary, else None.
        spec: the spec q and k share when they do.
        q, k, v: the observations judged (v may be None).
    """

    status: str
    findings: tuple[str, ...]
    offset_between: int | None
    spec: RotarySpec | None
    q: RotaryObservation
    k: RotaryObservation
    v: RotaryObservation | None = None

    def describe(self) -> str:
        """One line, rendered from the fields."""
        if self.status == "pass":
            if self.spec is None:
                return "no rotation on q or k"
            return (f"consistent rotary on q and k: {self.spec.pairing}, base {self.spec.base:g}, "
                    f"rotated {self.spec.width(self.q.head_dim)} of {self.q.head_dim}")
        parts = []
        for code in self.findings:
            parts.append({
                "v_rotated": "v rotated",
                "qk_offset": f"q and k rotated {self.offset_between:+d} positions apart"
                if self.offset_between is not None else "q and k at different offsets",
                "qk_spec": "q and k rotated by different specs",
                "only_q_rotated": "only q rotated",
                "only_k_rotated": "only k rotated",
            }[code])
        if self.status == "inconclusive":
            names = [n for n, o in (("q", self.q), ("k", self.k), ("v", self.v))
                     if o is not None and o.kind == "unrecognised"]
            parts.append(f"unrecognised change on {', '.join(names)}")
        return "; ".join(parts)


def compare_positions(q: RotaryObservation, k: RotaryObservation,
                      v: RotaryObservation | None = None) -> PositionComparison:
    """Judge rotary positions across q, k and v (each from :func:`recognise_rotary`).

    A consistent rotary (same spec, same offset) on q and k, with either pairing, passes, as
    does no rotation at all; v rotated, q and k at different offsets or with different specs,
    and only one of q and k rotated are findings. An unrecognised change without a finding is
    inconclusive, never a failure.
    """
    findings = []
    offset_between = spec = None
    if v is not None and v.kind == "rotary":
        findings.append("v_rotated")
    if q.kind == "rotary" and k.kind == "rotary":
        offset_between = q.offset - k.offset
        shared = _shared_spec(q, k)
        if shared is None:
            findings.append("qk_spec")
        elif offset_between != 0:
            findings.append("qk_offset")
        else:
            spec = shared
    elif q.kind == "rotary" and k.kind == "none":
        findings.append("only_q_rotated")
    elif k.kind == "rotary" and q.kind == "none":
        findings.append("only_k_rotated")
    unrecognised = any(o is not None and o.kind == "unrecognised" for o in (q, k, v))
    status = "fail" if findings else "inconclusive" if unrecognised else "pass"
    return PositionComparison(status, tuple(findings), offset_between, spec, q, k, v)


def _shared_spec(q: RotaryObservation, k: RotaryObservation) -> RotarySpec | None:
    """q's spec if some spec explains both (alternatives included, bases within 0.1 %), else None."""
    for a in (q.spec, *q.alternatives):
        for b in (k.spec, *k.alternatives):
            if a.pairing == b.pairing and a.width(q.head_dim) == b.width(k.head_dim) \
                    and math.isclose(a.base, b.base, rel_tol=1e-3):
                return a
    return None
