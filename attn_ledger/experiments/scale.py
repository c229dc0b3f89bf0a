"""Why ``1/sqrt(Dh)``: score spread and softmax sharpness against the head width Dh.

With independent, unit-variance query and key components, each product ``q_d * k_d``
has mean 0 and variance 1, so a dot product over Dh of them has standard deviation
about ``sqrt(Dh)``. Unscaled, the softmax over keys gets sharper as Dh grows for no
reason but the shape; dividing by ``sqrt(Dh)`` holds the spread near 1 and the entropy
flat. :func:`sweep` measures that; :func:`tensor_stats` measures the same numbers on a
user's saved q and k, where the assumption need not hold, and raises flags instead.
:func:`sweep_scale` is the whole ``attn-ledger sweep-scale`` command, plot included.

Both build a :class:`~attn_ledger.report.Report` with one row per head width Dh (its
statistics as fields, its own checks) and, for the sweep, a last row ``across Dh`` with
the checks that compare head widths.

Axes: B batch, Nh query heads, Nkv key/value heads, Tq queries, Tk keys, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from attn_ledger.errors import TensorFileError, field_error, shown
from attn_ledger.report import Check, Note, Report, Row, bounded, counted, row_status, unjudged
from attn_ledger.seeding import generator

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

ASSUMPTION = "q and k components independent, mean 0, variance 1"
QK_AXES = {3: "B, Tq, Dh", 4: "B, Nh, Tq, Dh"}  # the saved q's axes, by rank
ACROSS = "across Dh"  # the sweep's last row: checks that compare head widths
FIELD_NOTE = Note("scale_fields")  # what maxp, entropy and ln_tk are


@dataclass(frozen=True)
class ScaleStats:
    """Score and softmax statistics at one head width (the fields of its report row).

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

    def fields(self) -> dict[str, float]:
        """The statistics as report-row fields (Dh names the row)."""
        out = asdict(self)
        del out["dh"]
        return out


def score_stats(q: "torch.Tensor", k: "torch.Tensor") -> tuple[ScaleStats, "torch.Tensor", float]:
    """Statistics of ``q @ k^T`` raw and scaled, computed in float64.

    Args:
        q: ``[..., Tq, Dh]``; k: ``[..., Tk, Dh]`` with matching leading axes.

    Returns:
        The statistics, the scaled softmax's largest probability per query row ``[..., Tq]``,
        and the largest absolute raw score.
    """
    import torch

    dh = q.shape[-1]
    tk = k.shape[-2]
    if q.numel() == 0 or k.numel() == 0:  # an empty batch: nothing to measure, nothing saturated
        nan = math.nan
        return ScaleStats(dh=dh, raw_std=nan, scaled_std=nan, sqrt_dh=math.sqrt(dh), raw_maxp=nan, scaled_maxp=nan,
                          raw_entropy=nan, scaled_entropy=nan, ln_tk=math.log(tk)), q.new_zeros(q.shape[:-1]), 0.0
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64)
    raw = q64 @ k64.transpose(-2, -1)  # [..., Tq, Tk]
    scaled = raw / math.sqrt(dh)  # [..., Tq, Tk]
    out: dict[str, float] = {}
    maxp_scaled = None
    for name, s in (("raw", raw), ("scaled", scaled)):
        p = torch.softmax(s, dim=-1)  # [..., Tq, Tk]
        logp = torch.log_softmax(s, dim=-1)  # [..., Tq, Tk]
        entropy = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(dim=-1)  # [..., Tq]
        maxp = p.amax(dim=-1)  # [..., Tq]
        out[f"{name}_std"] = float(s.std())
        out[f"{name}_maxp"] = float(maxp.mean())
        out[f"{name}_entropy"] = float(entropy.mean())
        if name == "scaled":
            maxp_scaled = maxp
    stats = ScaleStats(
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
    return stats, maxp_scaled, float(raw.abs().max())


# --- judging -----------------------------------------------------------------------------

def dh_checks(s: ScaleStats) -> tuple[Check, ...]:
    """The unit-variance argument's claims about one head width: raw std ~ sqrt(Dh), scaled std ~ 1."""
    where = {"Dh": s.dh}
    return (
        bounded(4, "raw_std_tracks_sqrt_dh", "|raw std / sqrt(Dh) - 1|", abs(s.raw_std / s.sqrt_dh - 1),
                STD_TOLERANCE, location=where),
        bounded(4, "scaled_std_near_one", "|scaled std - 1|", abs(s.scaled_std - 1), STD_TOLERANCE, location=where),
    )


def across_dh_checks(stats: Sequence[ScaleStats]) -> tuple[Check, ...]:
    """The claims that compare head widths: scaled entropy flat, raw entropy falling at every step."""
    if len(stats) < 2:
        why = "needs at least two Dh values"
        return (unjudged(4, "scaled_entropy_flat", "not_applicable", why),
                unjudged(4, "raw_entropy_falling", "not_applicable", why))
    ln_tk = stats[0].ln_tk
    entropies = [s.scaled_entropy for s in stats]
    spread = max(entropies) - min(entropies)
    rises = [[a.dh, b.dh] for a, b in zip(stats, stats[1:]) if not b.raw_entropy < a.raw_entropy]
    return (
        bounded(4, "scaled_entropy_flat", "scaled entropy spread across Dh (nats)", spread, FLAT_TOLERANCE * ln_tk,
                data={"fraction_of_ln_tk": FLAT_TOLERANCE, "ln_tk": ln_tk}),
        counted(4, "raw_entropy_falling", "steps of Dh where raw entropy does not fall", len(rises),
                data={"steps": rises, "drop": stats[0].raw_entropy - stats[-1].raw_entropy}),
    )


def dh_row_name(dh: int) -> str:
    return f"Dh={dh}"


def stats_row(s: ScaleStats, checks: Sequence[Check]) -> Row:
    return Row(dh_row_name(s.dh), row_status(checks), tuple(checks), fields=s.fields())


def sweep_report(stats: Sequence[ScaleStats], queries: int, keys: int, seed: int) -> Report:
    """The sweep's report from measured statistics: one row per Dh, then the ``across Dh`` row."""
    stats = tuple(stats)
    across = across_dh_checks(stats)
    rows = tuple(stats_row(s, dh_checks(s)) for s in stats) + (Row(ACROSS, row_status(across), across),)
    details = {"mode": "sweep", "assumption": ASSUMPTION, "queries": queries, "keys": keys, "seed": seed,
               "dh": [s.dh for s in stats], "plot": None}
    title = f"sweep-scale: Tq={queries} x Tk={keys} unit-variance independent q, k; seed {seed}"
    return Report(COMMAND, title, rows, notes=(FIELD_NOTE,), details=details, unit="row", row_label="row")


# --- planning and running -------------------------------------------------------------

def parse_dh(text: str) -> tuple[int, ...]:
    """``"8,32,128"`` -> ``(8, 32, 128)``, validated: positive, distinct, at most MAX_DH."""
    parts = [p.strip() for p in str(text).split(",")]
    values: list[int] = []
    if len(parts) > MAX_DH:
        raise field_error("--dh", text, f"at most {MAX_DH} distinct widths")
    for p in parts:
        if not (p.isascii() and p.isdigit() and len(p) <= 20):  # int() would also take '８' and '1_0'
            raise field_error("--dh", text, f"comma-separated positive integers in ASCII digits, e.g. 8,32,128,512 ({shown(p)} is not)")
        v = int(p)
        if not 1 <= v <= MAX_DH:
            raise field_error("--dh", text, f"each Dh between 1 and {MAX_DH} ({v} is not)")
        values.append(v)
    if len(set(values)) != len(values):
        raise field_error("--dh", text, "distinct Dh values")
    return tuple(sorted(values))


def _check_size(name: str, value: int) -> None:
    if not 2 <= value <= MAX_T:
        raise field_error(name, value, f"an integer between 2 and {MAX_T}")


def _measure(dhs: tuple[int, ...], queries: int, keys: int, seed: int,
             progress: Callable[[int, int], None] | None) -> tuple[ScaleStats, ...]:
    """Raw and scaled score statistics for each Dh on unit-variance random q, k."""
    import torch

    gen = generator(int(seed))
    stats = []
    for i, d in enumerate(dhs):
        q = torch.randn(queries, d, generator=gen, dtype=torch.float64)  # [Tq, Dh]
        k = torch.randn(keys, d, generator=gen, dtype=torch.float64)  # [Tk, Dh]
        stats.append(score_stats(q, k)[0])
        if progress is not None:
            progress(i + 1, len(dhs))
    return tuple(stats)


def sweep(
    dh: Sequence[int] = DEFAULT_DH,
    queries: int = DEFAULT_QUERIES,
    keys: int = DEFAULT_KEYS,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Measure each Dh (sorted) on unit-variance random q, k and judge the relationship."""
    _check_size("--queries", queries)
    _check_size("--keys", keys)
    dhs = tuple(sorted(dh))
    if not dhs:
        raise field_error("--dh", "", "at least one Dh")
    return sweep_report(_measure(dhs, queries, keys, seed, progress), queries, keys, int(seed))


def _to_heads(t: "torch.Tensor", name: str, path: str) -> "torch.Tensor":
    """``[B, T, Dh]`` -> ``[B, 1, T, Dh]``; ``[B, Nh, T, Dh]`` unchanged."""
    if t.dim() == 3:
        return t[:, None, :, :]  # [B, 1, T, Dh]
    if t.dim() == 4:
        return t
    raise TensorFileError(f"{name}: got shape {list(t.shape)} in {path!r}, expected [B, T, Dh] or [B, Nh, T, Dh]")


def _std(t: "torch.Tensor") -> float:
    """Component standard deviation; NaN for fewer than two components (an empty batch)."""
    import torch

    return float(t.to(torch.float64).std()) if t.numel() > 1 else math.nan


def _load_qk(path: str | Path, max_memory: int | None = None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The file's ``q`` and ``k``, validated: present, floating point, finite."""
    import torch

    from attn_ledger.inputs.tensorio import load_tensor_file

    p = str(path)
    tensors = load_tensor_file(path, "--tensors", max_memory=max_memory)
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
    return q, k


def _headroom_check(q: "torch.Tensor", k: "torch.Tensor", largest: float) -> Check:
    """For float16/bfloat16 inputs: is the largest raw score far enough below the dtype's largest value?"""
    import torch

    half = (torch.float16, torch.bfloat16)
    if q.dtype not in half and k.dtype not in half:
        return unjudged(3, "score_headroom", "not_applicable", "q and k are neither float16 nor bfloat16")
    low = q.dtype if q.dtype in half else k.dtype
    dtype_max = float(torch.finfo(low).max)
    room = math.inf if largest == 0 else dtype_max / largest
    return bounded(3, "score_headroom", "dtype max / largest |raw score|", room, HEADROOM_FACTOR, op=">=",
                   data={"dtype": str(low).replace("torch.", ""), "dtype_max": dtype_max, "max_abs_raw_score": largest})


def tensor_stats(path: str | Path, *, max_memory: int | None = None) -> Report:
    """The sweep's statistics on a user's saved ``q`` and ``k``, with saturation and headroom flags.

    ``max_memory``: the memory budget in bytes (default: what the machine has free); a file, or
    score grids, that would not fit are refused before they are read or computed.
    """
    import torch

    from attn_ledger.inputs.limits import Estimate, require_fits
    from attn_ledger.maths.reference import repeat_kv

    p = str(path)
    q, k = _load_qk(path, max_memory)
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
    grid = b * nh * tq * tk
    require_fits(Estimate(f"sweep-scale --tensors B={b} Nh={nh} Tq={tq} Tk={tk}",
                          (("float64 q, k", b * nh * (tq + tk) * dh * 8), ("score grids", 8 * grid * 8)), grid), max_memory)
    k4 = repeat_kv(k4, nh)  # [B, Nh, Tk, Dh]
    stats, maxp, largest = score_stats(q4, k4)
    saturated = int((maxp > SATURATED_P).sum())
    total = int(maxp.numel())
    checks = (
        counted(4, "saturated_rows", "saturated query rows", saturated,
                data={"threshold": SATURATED_P, "total_rows": total}),
        _headroom_check(q, k, largest),
    )
    q_std, k_std = _std(q), _std(k)
    row = Row(dh_row_name(dh), row_status(checks), checks, shape=tuple(q.shape), axes=QK_AXES[q.dim()],
              fields={**stats.fields(), "q_std": q_std, "k_std": k_std, "max_abs_raw_score": largest})
    headroom = checks[1]
    details = {
        "mode": "tensors", "path": p, "shape_q": list(q.shape), "shape_k": list(k.shape),
        "dtype": str(q.dtype).replace("torch.", ""), "dh": [dh], "q_std": q_std, "k_std": k_std,
        "saturated_rows": saturated, "total_rows": total, "saturation_threshold": SATURATED_P,
        "max_abs_raw_score": largest, "dtype_max": headroom.data.get("dtype_max"),
        "headroom_factor": headroom.value, "plot": None,
    }
    notes = (FIELD_NOTE, Note("saturated", {"threshold": SATURATED_P}))
    return Report(COMMAND, f"sweep-scale --tensors {p}: q and k in {details['dtype']}",
                  (row,), notes=notes, details=details, unit="row", row_label="row")


def sweep_scale(
    dh: str | Sequence[int] = DEFAULT_DH,
    queries: int = DEFAULT_QUERIES,
    keys: int = DEFAULT_KEYS,
    seed: int = 0,
    tensors: str | Path | None = None,
    plot: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_memory: int | None = None,
) -> Report:
    """``attn-ledger sweep-scale``: the sweep (or ``tensors``' statistics), and a PNG at ``plot``.

    ``dh`` is a sequence of head widths or the ``--dh`` text (``"8,32,128"``). The plot's
    requirements (matplotlib, an existing directory) are checked before any work, and the
    sizes against ``max_memory`` (default: what the machine has free).
    """
    from attn_ledger.inputs.limits import require_fits
    from attn_ledger.engine.budget import estimate_sweep

    if plot is not None:
        check_plot_path(plot)
    if tensors is not None:
        report = tensor_stats(tensors, max_memory=max_memory)
    else:
        widths = parse_dh(dh) if isinstance(dh, str) else tuple(dh)
        _check_size("--queries", queries)
        _check_size("--keys", keys)
        require_fits(estimate_sweep(widths, queries, keys), max_memory)
        report = sweep(widths, queries, keys, seed, progress=progress)
    if plot is None:
        return report
    return plotted(report, write_plot(report, plot))


def plotted(report: Report, path: str | Path) -> Report:
    """The report saying that its plot is (or is about to be) written to ``path``."""
    return replace(report, details={**report.details, "plot": str(path)}, notes=(*report.notes, Note("plot_written", {"path": str(path)})))


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


def check_plot_path(path: str | Path) -> None:
    """Refuse, before any work, a ``--plot`` path without matplotlib or without an existing directory."""
    require_matplotlib()
    p = Path(path)
    try:
        parent_ok = not str(p.parent) or p.parent.is_dir()
    except OSError:  # a directory on the way that cannot be searched
        parent_ok = False
    if not parent_ok:
        raise field_error("--plot", str(p), "a file in an existing, searchable directory")


def measured_rows(report: Report) -> list[tuple[int, Row]]:
    """``(Dh, row)`` for each row that holds one head width's statistics, in Dh order."""
    return list(zip(report.details["dh"], report.rows))


def write_plot(report: Report, path: str | Path) -> str:
    """Score std and softmax entropy against Dh, raw and scaled, drawn from a report's rows, to a PNG."""
    check_plot_path(path)
    Path(path).write_bytes(plot_png(report))
    return str(path)


def plot_png(report: Report) -> bytes:
    """The PNG :func:`write_plot` writes, as bytes."""
    import io

    plt = require_matplotlib()
    measured = measured_rows(report)
    dhs = [d for d, _ in measured]
    panels = (
        ("score std", (("raw_std", "o-", "raw std"), ("sqrt_dh", "k--", "sqrt(Dh)"), ("scaled_std", "s-", "scaled std"))),
        ("mean softmax entropy (nats)", (("raw_entropy", "o-", "raw entropy"), ("scaled_entropy", "s-", "scaled entropy"),
                                         ("ln_tk", "k--", "ln(Tk), uniform"))),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (ylabel, series) in zip(axes, panels):
        for field, style, label in series:
            ax.plot(dhs, [row.fields[field] for _, row in measured], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("Dh")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    return png.getvalue()


# --- temperature: one fixed row of scores at several temperatures ---------------------------------------

DEFAULT_SCORES = (1.2, 0.3, -0.4, 1.8)  # a fixed row of four scores
TEMPERATURE_DTYPE = "float32"  # the pipeline's softmax runs in the default run dtype
ACROSS_TAU = "across tau"
MAX_VALUES = 4096


def parse_values(text: str, option: str, *, positive: bool = False, distinct: bool = False) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``: finite numbers (positive, distinct where asked), at most MAX_VALUES."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > MAX_VALUES:
        raise field_error(option, f"{len(parts)} values", f"at most {MAX_VALUES} comma-separated numbers")
    values = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise field_error(option, text, f"comma-separated numbers such as 0.5,1,2 ({p!r} is not a number)") from None
        if not math.isfinite(v) or (positive and v <= 0):
            raise field_error(option, text, f"{'positive ' if positive else ''}finite numbers ({p!r} is not)")
        values.append(v)
    if distinct and len(set(values)) != len(values):
        raise field_error(option, text, "distinct values")
    return tuple(values)


def temperature_lab(temperatures: Sequence[float], scores: Sequence[float] = DEFAULT_SCORES,
                    softmax: Callable | None = None) -> Report:
    """The softmax of one fixed row of scores at each temperature: ``softmax(scores / tau)`` and its entropy.

    The distribution comes from the pipeline's softmax (``softmax``, default
    :func:`attn_ledger.maths.pipeline.softmax_keys`) in float32, and is checked against a float64 softmax of
    the same scores written out with ``math.exp``. Lower temperatures sharpen, higher ones flatten:
    the entropy never falls as tau rises (its derivative is the scores' variance under the
    distribution over tau cubed).

    Returns:
        One row per temperature (fields: ``temperature``, ``probabilities``, ``entropy``, ``max_p``) with
        ``matches_float64_softmax`` (L4) and ``sums_to_one`` (L3), then an ``across tau`` row with
        ``entropy_rises`` (L4).
    """
    import torch

    from attn_ledger import tolerance
    from attn_ledger.maths.pipeline import softmax_keys

    fn = softmax or softmax_keys
    if not scores:
        raise field_error("--scores", "", "at least one score")
    rtol, atol = tolerance.reference(TEMPERATURE_DTYPE)
    rows, measured = [], []
    for tau in temperatures:
        x = torch.tensor(scores, dtype=torch.float32) / tau  # [Tk]
        p = [float(v) for v in fn(x[None], None, False)[0]]  # [Tk] from the pipeline's softmax
        want = _softmax64([s / tau for s in scores])
        entropy = -math.fsum(v * math.log(v) for v in p if v > 0)
        diff = max((abs(a - b) for a, b in zip(p, want)), default=0.0) if len(p) == len(want) else math.nan
        excess = max((abs(a - b) - atol - rtol * abs(b) for a, b in zip(p, want)), default=-atol) \
            if len(p) == len(want) else math.nan
        checks = (Check(4, "matches_float64_softmax", "pass" if excess <= 0 else "fail", "max |p - float64 softmax|",
                        diff, rtol=rtol, atol=atol, location={"temperature": tau}, data={"excess": excess, "float64": want}),
                  bounded(3, "sums_to_one", "|sum p - 1|", abs(math.fsum(p) - 1.0), tolerance.row_sum(TEMPERATURE_DTYPE),
                          location={"temperature": tau}))
        rows.append(Row(f"tau={tau:g}", row_status(checks), checks,
                        fields={"temperature": tau, "probabilities": p, "entropy": entropy, "max_p": max(p, default=0.0)}))
        measured.append((tau, entropy))
    across = (_entropy_rises(measured),)
    rows.append(Row(ACROSS_TAU, row_status(across), across))
    details = {"mode": "temperature", "scores": list(scores), "temperatures": list(temperatures),
               "dtype": TEMPERATURE_DTYPE, "ln_tk": math.log(len(scores)), "plot": None}
    note = Note("temperature_fields", {"ln_tk": math.log(len(scores))})
    title = f"sweep-scale --temperatures: scores {list(scores)} at tau {', '.join(f'{t:g}' for t in temperatures)}"
    return Report(COMMAND, title, tuple(rows), notes=(note,), details=details, unit="row", row_label="row")


def _softmax64(x: Sequence[float]) -> list[float]:
    """A float64 softmax written out: ``exp(x - max) / sum``."""
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = math.fsum(e)
    return [v / total for v in e]


def _entropy_rises(measured: list[tuple[float, float]]) -> Check:
    """Across temperatures in increasing order: steps where the entropy falls (beyond float32 rounding)."""
    if len(measured) < 2:
        return unjudged(4, "entropy_rises", "not_applicable", "needs at least two temperatures")
    ordered = sorted(measured)
    falls = [[a[0], b[0]] for a, b in zip(ordered, ordered[1:]) if b[1] < a[1] - 1e-6]
    return counted(4, "entropy_rises", "steps of rising tau where the entropy falls", len(falls),
                   data={"steps": falls, "entropies": [e for _, e in ordered]})
