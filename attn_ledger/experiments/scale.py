"""Why ``1/sqrt(Dh)``: score spread and softmax sharpness against the head width Dh.

With independent, unit-variance query and key components, each product ``q_d * k_d``
has mean 0 and variance 1, so a dot product over Dh of them has standard deviation
about ``sqrt(Dh)``. Unscaled, the softmax over keys gets sharper as Dh grows for no
reason but the shape; dividing by ``sqrt(Dh)`` holds the spread near 1 and the entropy
flat. :func:`sweep` measures that; :func:`tensor_stats` measures the same numbers on a
user's saved q and k, where the assumption need not hold, and raises flags instead.

Axes: B batch, Nh query heads, Nkv key/value heads, Tq queries, Tk keys, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from attn_ledger.errors import TensorFileError, field_error
from attn_ledger.report import CheckedReport, Check, envelope, json_number

if TYPE_CHECKING:
    import torch

COMMAND = "sweep-scale"
DEFAULT_DH = (8, 32, 128, 512)
# 512 x 512 keeps every check inside its tolerance for at least 99 of 100 seeds
# (scripts/seed_sweep.py); the 64 x 32 of the worked example misses at Dh = 8.
DEFAULT_QUERIES = 512
DEFAULT_KEYS = 512
MAX_T = 4096
MAX_DH = 8192

STD_TOLERANCE = 0.05  # raw std within 5% of sqrt(Dh); scaled std within 5% of 1
FLAT_TOLERANCE = 0.02  # scaled entropy spread across Dh, as a fraction of ln(Tk)
SATURATED_P = 0.99  # a row whose largest probability exceeds this is saturated
HEADROOM_FACTOR = 16.0  # flag half-precision scores within this factor of the dtype's max


@dataclass(frozen=True)
class ScaleRow:
    """Score and softmax statistics at one head width.

    Attributes:
        dh: head width Dh.
        raw_std: standard deviation of ``q . k`` over every (query, key) pair.
        scaled_std: the same after dividing by ``sqrt(Dh)``.
        sqrt_dh: ``sqrt(Dh)``, what ``raw_std`` should track under the assumption.
        raw_maxp, scaled_maxp: mean over query rows of the largest softmax probability.
        raw_entropy, scaled_entropy: mean softmax entropy per query row, in nats.
        ln_tk: ``ln(Tk)``, the entropy of the uniform distribution over Tk keys.
    """

    dh: int
    raw_std: float
    scaled_std: float
    sqrt_dh: float
    raw_maxp: float
    scaled_maxp: float
    raw_entropy: float
    scaled_entropy: float
    ln_tk: float

    def to_json(self) -> dict[str, Any]:
        return {k: json_number(v) for k, v in self.__dict__.items()}


def score_stats(q: "torch.Tensor", k: "torch.Tensor") -> tuple[ScaleRow, "torch.Tensor", float]:
    """Statistics of ``q @ k^T`` raw and scaled, computed in float64.

    Args:
        q: ``[..., Tq, Dh]``; k: ``[..., Tk, Dh]`` with matching leading axes.

    Returns:
        The row, the scaled softmax's largest probability per query row ``[..., Tq]``,
        and the largest absolute raw score.
    """
    import torch

    dh = q.shape[-1]
    tk = k.shape[-2]
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64)
    raw = q64 @ k64.transpose(-2, -1)  # [..., Tq, Tk]
    scaled = raw / math.sqrt(dh)  # [..., Tq, Tk]
    out: dict[str, float] = {}
    maxp_scaled = None
    for name, s in (("raw", raw), ("scaled", scaled)):
        p = torch.softmax(s, dim=-1)  # [..., Tq, Tk]
        logp = torch.log_softmax(s, dim=-1)
        entropy = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(dim=-1)  # [..., Tq]
        maxp = p.amax(dim=-1)  # [..., Tq]
        out[f"{name}_std"] = float(s.std())
        out[f"{name}_maxp"] = float(maxp.mean())
        out[f"{name}_entropy"] = float(entropy.mean())
        if name == "scaled":
            maxp_scaled = maxp
    row = ScaleRow(
        dh=dh,
        raw_std=out["raw_std"],
        scaled_std=out["scaled_std"],
        sqrt_dh=math.sqrt(dh),
        raw_maxp=out["raw_maxp"],
        scaled_maxp=out["scaled_maxp"],
        raw_entropy=out["raw_entropy"],
        scaled_entropy=out["scaled_entropy"],
        ln_tk=math.log(tk),
    )
    return row, maxp_scaled, float(raw.abs().max())


def relationship_checks(rows: Sequence[ScaleRow]) -> tuple[Check, ...]:
    """The four claims of the unit-variance argument, each judged on the measured rows."""
    checks: list[Check] = []
    worst_raw = max(rows, key=lambda r: abs(r.raw_std / r.sqrt_dh - 1))
    err_raw = abs(worst_raw.raw_std / worst_raw.sqrt_dh - 1)
    checks.append(Check(
        4, "raw_std_tracks_sqrt_dh", err_raw <= STD_TOLERANCE, err_raw,
        f"largest |raw std / sqrt(Dh) - 1| = {err_raw:.4f} at Dh={worst_raw.dh}, tolerance {STD_TOLERANCE}",
    ))
    worst_scaled = max(rows, key=lambda r: abs(r.scaled_std - 1))
    err_scaled = abs(worst_scaled.scaled_std - 1)
    checks.append(Check(
        4, "scaled_std_near_one", err_scaled <= STD_TOLERANCE, err_scaled,
        f"largest |scaled std - 1| = {err_scaled:.4f} at Dh={worst_scaled.dh}, tolerance {STD_TOLERANCE}",
    ))
    if len(rows) < 2:
        checks.append(Check(4, "scaled_entropy_flat", None, None, "needs at least two Dh values"))
        checks.append(Check(4, "raw_entropy_falling", None, None, "needs at least two Dh values"))
        return tuple(checks)
    ln_tk = rows[0].ln_tk
    spread = max(r.scaled_entropy for r in rows) - min(r.scaled_entropy for r in rows)
    checks.append(Check(
        4, "scaled_entropy_flat", spread <= FLAT_TOLERANCE * ln_tk, spread,
        f"scaled entropy spread across Dh = {spread:.4f} nats, tolerance {FLAT_TOLERANCE} * ln(Tk) = {FLAT_TOLERANCE * ln_tk:.4f}",
    ))
    rises = [(a.dh, b.dh) for a, b in zip(rows, rows[1:]) if not b.raw_entropy < a.raw_entropy]
    drop = rows[0].raw_entropy - rows[-1].raw_entropy
    checks.append(Check(
        4, "raw_entropy_falling", not rises, drop,
        "raw entropy falls at every step of Dh" if not rises
        else "raw entropy does not fall from Dh=" + ", ".join(f"{a} to {b}" for a, b in rises),
    ))
    return tuple(checks)


@dataclass(frozen=True)
class SweepReport(CheckedReport):
    """``sweep-scale`` without ``--tensors``: the synthetic sweep and its relationship checks."""

    rows: tuple[ScaleRow, ...]
    checks: tuple[Check, ...]
    queries: int
    keys: int
    seed: int
    plot: str | None = None

    def to_json(self) -> dict[str, Any]:
        return envelope(
            COMMAND, self.verdict, mode="sweep",
            assumption="q and k components independent, mean 0, variance 1",
            queries=self.queries, keys=self.keys, seed=self.seed,
            rows=[r.to_json() for r in self.rows],
            checks=[c.to_json() for c in self.checks],
            plot=self.plot,
        )

    def to_markdown(self) -> str:
        return _markdown(self.title(), self.rows, self.checks, (), self.plot)

    def to_rich(self) -> Any:
        return _rich(self.title(), self.rows, self.checks, (), self.plot, self.ok)

    def title(self) -> str:
        return (f"sweep-scale: Tq={self.queries} x Tk={self.keys} unit-variance independent q, k; "
                f"seed {self.seed}; verdict {self.verdict}")


@dataclass(frozen=True)
class TensorScaleReport(CheckedReport):
    """``sweep-scale --tensors``: the same statistics on saved q and k, with flags.

    Attributes:
        path: the file read.
        shape_q, shape_k: as loaded.
        dtype: the dtype of q (and k).
        row: the statistics at the file's Dh.
        saturated_rows: query rows whose scaled softmax puts more than 0.99 on one key.
        total_rows: all query rows (B * Nh * Tq).
        max_abs_raw_score: largest ``|q . k|`` before scaling.
        dtype_max: the dtype's largest finite value, for float16/bfloat16 only.
        q_std, k_std: component standard deviations, to compare with the unit-variance case.
        flags: the checks behind the exit status.
    """

    path: str
    shape_q: tuple[int, ...]
    shape_k: tuple[int, ...]
    dtype: str
    row: ScaleRow
    saturated_rows: int
    total_rows: int
    max_abs_raw_score: float
    dtype_max: float | None
    q_std: float
    k_std: float
    flags: tuple[Check, ...]
    plot: str | None = None

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.flags)

    def facts(self) -> tuple[str, ...]:
        lines = [
            f"q {list(self.shape_q)} k {list(self.shape_k)} {self.dtype}; component std q {self.q_std:.4f}, k {self.k_std:.4f}",
            f"saturated rows (largest probability > {SATURATED_P}): {self.saturated_rows} of {self.total_rows}",
            f"largest |raw score| {self.max_abs_raw_score:.4g}",
        ]
        if self.dtype_max is not None:
            lines.append(f"{self.dtype} largest finite value {self.dtype_max:.6g}; headroom factor "
                         f"{_headroom(self.dtype_max, self.max_abs_raw_score):.4g}")
        return tuple(lines)

    def to_json(self) -> dict[str, Any]:
        return envelope(
            COMMAND, self.verdict, mode="tensors", path=self.path,
            shape_q=list(self.shape_q), shape_k=list(self.shape_k), dtype=self.dtype,
            rows=[self.row.to_json()],
            q_std=json_number(self.q_std), k_std=json_number(self.k_std),
            saturated_rows=self.saturated_rows, total_rows=self.total_rows,
            saturation_threshold=SATURATED_P,
            max_abs_raw_score=json_number(self.max_abs_raw_score),
            dtype_max=json_number(self.dtype_max),
            headroom_factor=None if self.dtype_max is None else json_number(_headroom(self.dtype_max, self.max_abs_raw_score)),
            checks=[c.to_json() for c in self.flags],
            plot=self.plot,
        )

    def title(self) -> str:
        return f"sweep-scale --tensors {self.path}: Dh={self.row.dh}; verdict {self.verdict}"

    def to_markdown(self) -> str:
        return _markdown(self.title(), (self.row,), self.flags, self.facts(), self.plot)

    def to_rich(self) -> Any:
        return _rich(self.title(), (self.row,), self.flags, self.facts(), self.plot, self.ok)


def _headroom(dtype_max: float, largest: float) -> float:
    return math.inf if largest == 0 else dtype_max / largest


# --- planning and running -------------------------------------------------------------

def parse_dh(text: str) -> tuple[int, ...]:
    """``"8,32,128"`` -> ``(8, 32, 128)``, validated: positive, distinct, at most MAX_DH."""
    parts = [p.strip() for p in str(text).split(",")]
    values: list[int] = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise field_error("--dh", text, f"comma-separated positive integers, e.g. 8,32,128,512 ({p!r} is not an integer)") from None
        if not 1 <= v <= MAX_DH:
            raise field_error("--dh", text, f"each Dh between 1 and {MAX_DH} ({v} is not)")
        values.append(v)
    if len(set(values)) != len(values):
        raise field_error("--dh", text, "distinct Dh values")
    return tuple(sorted(values))


def _check_size(name: str, value: int) -> None:
    if not 2 <= value <= MAX_T:
        raise field_error(name, value, f"an integer between 2 and {MAX_T}")


def sweep(
    dh: Sequence[int] = DEFAULT_DH,
    queries: int = DEFAULT_QUERIES,
    keys: int = DEFAULT_KEYS,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SweepReport:
    """Measure raw and scaled score statistics for each Dh on unit-variance random q, k."""
    import torch

    _check_size("--queries", queries)
    _check_size("--keys", keys)
    dhs = tuple(sorted(dh))
    if not dhs:
        raise field_error("--dh", "", "at least one Dh")
    gen = torch.Generator().manual_seed(int(seed))
    rows = []
    for i, d in enumerate(dhs):
        q = torch.randn(queries, d, generator=gen, dtype=torch.float64)  # [Tq, Dh]
        k = torch.randn(keys, d, generator=gen, dtype=torch.float64)  # [Tk, Dh]
        row, _, _ = score_stats(q, k)
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(dhs))
    rows_t = tuple(rows)
    return SweepReport(rows_t, relationship_checks(rows_t), queries, keys, int(seed))


def _to_heads(t: "torch.Tensor", name: str, path: str) -> "torch.Tensor":
    """``[B, T, Dh]`` -> ``[B, 1, T, Dh]``; ``[B, Nh, T, Dh]`` unchanged."""
    if t.dim() == 3:
        return t[:, None, :, :]  # [B, 1, T, Dh]
    if t.dim() == 4:
        return t
    raise TensorFileError(f"{name}: got shape {list(t.shape)} in {path!r}, expected [B, T, Dh] or [B, Nh, T, Dh]")


def tensor_stats(path: str | Path) -> TensorScaleReport:
    """The sweep's statistics on a user's saved ``q`` and ``k``, with saturation and headroom flags."""
    import torch

    from attn_ledger.reference import repeat_kv
    from attn_ledger.tensorio import load_tensor_file

    p = str(path)
    tensors = load_tensor_file(path, "--tensors")
    missing = [n for n in ("q", "k") if n not in tensors]
    if missing:
        raise TensorFileError(f"--tensors: {p!r} holds {sorted(tensors)}, expected tensors named 'q' and 'k' (missing {missing})")
    q, k = tensors["q"], tensors["k"]
    for name, t in (("q", q), ("k", k)):
        if not t.is_floating_point():
            raise TensorFileError(f"{name}: got dtype {t.dtype} in {p!r}, expected a floating-point tensor")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise TensorFileError(f"{name}: got {bad} NaN/inf values in {p!r}, expected finite activations")
    q4 = _to_heads(q, "q", p)  # [B, Nh, Tq, Dh]
    k4 = _to_heads(k, "k", p)  # [B, Nkv, Tk, Dh]
    if q.dim() != k.dim():
        raise TensorFileError(f"k: got rank {k.dim()} with q of rank {q.dim()} in {p!r}, expected the same rank")
    b, nh, tq, dh = q4.shape
    bk, nkv, tk, dhk = k4.shape
    if bk != b or dhk != dh:
        raise TensorFileError(f"k: got shape {list(k.shape)} with q {list(q.shape)} in {p!r}, expected the same B and Dh")
    if nkv < 1 or nh % nkv:
        raise TensorFileError(f"k: got Nkv={nkv} with Nh={nh} in {p!r}, expected Nkv to divide Nh")
    if tq < 1 or tk < 2 or dh < 1:
        raise TensorFileError(f"k: got Tq={tq}, Tk={tk}, Dh={dh} in {p!r}, expected Tq >= 1, Tk >= 2, Dh >= 1")
    k4 = repeat_kv(k4, nh)  # [B, Nh, Tk, Dh]
    row, maxp, largest = score_stats(q4, k4)
    saturated = int((maxp > SATURATED_P).sum())
    total = int(maxp.numel())
    flags = [Check(
        4, "saturated_rows", saturated == 0, float(saturated),
        f"{saturated} of {total} query rows put more than {SATURATED_P} of their weight on one key after 1/sqrt(Dh) scaling",
    )]
    dtype_max = None
    if q.dtype in (torch.float16, torch.bfloat16) or k.dtype in (torch.float16, torch.bfloat16):
        low = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dtype_max = float(torch.finfo(low).max)
        low_name = str(low).replace("torch.", "")
        room = _headroom(dtype_max, largest)
        flags.append(Check(
            3, "score_headroom", room >= HEADROOM_FACTOR, room,
            f"largest |raw score| {largest:.4g} is a factor {room:.4g} below the {low_name} limit {dtype_max:.6g}; "
            f"flagged under {HEADROOM_FACTOR:g}",
        ))
    return TensorScaleReport(
        path=p, shape_q=tuple(q.shape), shape_k=tuple(k.shape), dtype=str(q.dtype).replace("torch.", ""),
        row=row, saturated_rows=saturated, total_rows=total, max_abs_raw_score=largest, dtype_max=dtype_max,
        q_std=float(q.to(torch.float64).std()), k_std=float(k.to(torch.float64).std()), flags=tuple(flags),
    )


# --- plot -------------------------------------------------------------------------------

def require_matplotlib() -> Any:
    """Import matplotlib with the Agg backend, or explain how to install it."""
    from attn_ledger.errors import SetupError

    try:
        import matplotlib
    except ImportError:
        raise SetupError("--plot: matplotlib is not installed, expected it for plotting; pip install 'attn-ledger[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(rows: Sequence[ScaleRow], path: str | Path) -> str:
    """Score std and softmax entropy against Dh, raw and scaled, to a PNG."""
    plt = require_matplotlib()
    p = Path(path)
    if not p.parent.is_dir() and str(p.parent):
        raise field_error("--plot", str(p), "a file in an existing directory")
    dhs = [r.dh for r in rows]
    panels = (
        ("score std", (("raw_std", "o-", "raw std"), ("sqrt_dh", "k--", "sqrt(Dh)"), ("scaled_std", "s-", "scaled std"))),
        ("mean softmax entropy (nats)", (("raw_entropy", "o-", "raw entropy"), ("scaled_entropy", "s-", "scaled entropy"),
                                         ("ln_tk", "k--", "ln(Tk), uniform"))),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (ylabel, series) in zip(axes, panels):
        for field, style, label in series:
            ax.plot(dhs, [getattr(r, field) for r in rows], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("Dh")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(str(p), format="png")
    finally:
        plt.close(fig)
    return str(p)


# --- rendering (formatting only) --------------------------------------------------------

_HEADERS = ("Dh", "raw std", "scaled std", "sqrt(Dh)", "raw maxp", "scaled maxp", "raw H", "scaled H", "ln(Tk)")


def _cells(r: ScaleRow) -> list[str]:
    return [str(r.dh), f"{r.raw_std:.4f}", f"{r.scaled_std:.4f}", f"{r.sqrt_dh:.4f}", f"{r.raw_maxp:.4f}",
            f"{r.scaled_maxp:.4f}", f"{r.raw_entropy:.4f}", f"{r.scaled_entropy:.4f}", f"{r.ln_tk:.4f}"]


def _mark(c: Check) -> str:
    return {True: "ok", False: "FAIL" if c.severity == "error" else "warn", None: "n/a"}[c.ok]


def _markdown(title: str, rows, checks, facts, plot) -> str:
    out = [f"### {title}", "", "| " + " | ".join(_HEADERS) + " |", "|" + "---|" * len(_HEADERS)]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    out += ["", "maxp: mean largest softmax probability per query row; H: mean softmax entropy (nats).", ""]
    out += [f"- {f}" for f in facts]
    out += [f"- **{_mark(c)}** `{c.name}`: {c.detail}" for c in checks]
    if plot:
        out.append(f"- plot written to `{plot}`")
    return "\n".join(out) + "\n"


def _rich(title: str, rows, checks, facts, plot, ok: bool) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    for h in _HEADERS:
        table.add_column(h, justify="right", min_width=7 if h != "Dh" else 4)
    for r in rows:
        table.add_row(*_cells(r))
    parts: list[Any] = [table, Text("maxp: mean largest softmax probability per query row; H: mean softmax entropy (nats).")]
    parts += [Text(f) for f in facts]
    for c in checks:
        style = {True: "green", False: "bold red", None: "dim"}[c.ok]
        line = Text()
        line.append(f"{_mark(c):>4} ", style=style)
        line.append(f"{c.name}: {c.detail}")
        parts.append(line)
    if plot:
        parts.append(Text(f"plot written to {plot}"))
    return Group(*parts)
