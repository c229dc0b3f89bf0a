"""Judging: fold measurements over blocks, then turn the folded numbers into checks.

:class:`Tally` folds what execution yields: counts add up, peaks and agreements keep the
largest value (NaN wins, so a NaN anywhere fails), and each keeps where its worst or first
violation was. :func:`judge` turns a tally into the checks of the four score-grid stages
under the one tolerance policy (:mod:`attn_ledger.tolerance`), each failing one with its
location; checks are built by the functions of :mod:`attn_ledger.engine.checks` and one local
function per remaining kind (:func:`_compare`, :func:`_factor`, :func:`_bound`, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

from attn_ledger.engine import checks as C
from attn_ledger.engine import stages
from attn_ledger import tolerance
from attn_ledger.engine.measure import Agreement, Broken, Count, Measure, Peak, Where
from attn_ledger.report import Check, bounded, unjudged

GRID_STAGES = ("scores", "masked_scores", "weights", "context")
AXES = stages.axes(stages.PIPELINE)  # every stage's axes, the score grid's and the backward's among them
GIVEN_NAMES = {"scores": "scores", "weights": "weights", "context": "out"}  # the user's tensor at each stage


def _fold_max(a: float | None, b: float) -> float:
    if a is None:
        return b
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def _worse(new: float | None, old: float | None) -> bool:
    """Whether ``new`` replaces ``old`` as the largest (a NaN replaces any number, never another NaN)."""
    if new is None:
        return False
    if old is None:
        return True
    if math.isnan(old):
        return False
    return math.isnan(new) or new > old


def _first(a: Where | None, b: Where | None) -> Where | None:
    if a is None or b is None:
        return a or b
    order = lambda w: (w.example, w.head, w.query, -1 if w.key is None else w.key)  # noqa: E731
    return min(a, b, key=order)


@dataclass
class Tally:
    """Measurements folded over blocks, keyed by what they measure."""

    counts: dict[tuple[str, str, str], Count] = field(default_factory=dict)
    peaks: dict[tuple[str, str, str], Peak] = field(default_factory=dict)
    agreements: dict[tuple, Agreement] = field(default_factory=dict)
    broken: dict[tuple[str, str], Broken] = field(default_factory=dict)

    @classmethod
    def of(cls, measures: Iterable[Measure]) -> "Tally":
        t = cls()
        for m in measures:
            t.add(m)
        return t

    def add(self, m: Measure) -> None:
        if isinstance(m, Count):
            self._count(m)
        elif isinstance(m, Peak):
            self._peak(m)
        elif isinstance(m, Agreement):
            self._agreement(m)
        else:
            self.broken.setdefault((m.stage, m.of), m)

    def _count(self, m: Count) -> None:
        key = (m.stage, m.of, m.name)
        old = self.counts.get(key)
        self.counts[key] = m if old is None else Count(m.stage, m.name, old.n + m.n, m.of, _first(old.where, m.where))

    def _peak(self, m: Peak) -> None:
        key = (m.stage, m.of, m.name)
        old = self.peaks.get(key)
        if old is None or _worse(m.value, old.value):
            self.peaks[key] = m

    def _agreement(self, m: Agreement) -> None:
        old = self.agreements.get(m.key)
        if old is None:
            self.agreements[m.key] = m
            return
        take = _worse(m.excess, old.excess)
        self.agreements[m.key] = replace(old, diff=_fold_max(old.diff, m.diff),
                                         excess=_fold_max(old.excess, m.excess) if m.excess is not None else old.excess,
                                         where=m.where if take else old.where,
                                         parts=m.parts if take and m.parts is not None else old.parts)

    def count(self, stage: str, name: str, of: str = "pipeline") -> Count | None:
        return self.counts.get((stage, of, name))

    def peak(self, stage: str, name: str, of: str = "pipeline") -> Peak | None:
        return self.peaks.get((stage, of, name))

    def agreement(self, stage: str, of: str, against: str, backend: str | None = None,
                  dtype: str | None = None) -> Agreement | None:
        return self.agreements.get((stage, of, against, backend, dtype))

    def reached(self, stage: str, of: str = "pipeline") -> bool:
        """Whether some block measured this stage (its nonfinite count is the first thing measured)."""
        name = "pairs" if stage == "masked_scores" else "nonfinite"
        return (stage, of, name) in self.counts

    def backends(self) -> list[tuple[str, str, str]]:
        """``(backend, dtype, against)`` of every pinned backend measured, in the order first measured."""
        return [(k[3], k[4], k[2]) for k in self.agreements if k[3] is not None]


@dataclass
class Verdicts:
    """The checks of each score-grid stage (a failing one with its location), and the backend matrix's cells."""

    checks: dict[str, list[Check]] = field(default_factory=dict)
    backends: list[tuple[str, str, bool]] = field(default_factory=list)

    def add(self, stage: str, check: Check, where: Where | None = None) -> Check:
        if where is not None and check.failed:
            check = replace(check, location=where.as_dict())
        self.checks.setdefault(stage, []).append(check)
        return check


def judge(t: Tally, dtype: str, *, related: bool, empty_zero: bool,
          derived: dict[str, tuple[int, ...]]) -> Verdicts:
    """The checks of the score-grid stages from a tally.

    Args:
        dtype: the run's dtype name.
        related: the run has a relation (else nothing is forbidden and exclusion is not applicable).
        empty_zero: rows with every key blocked are declared and must be zeros.
        derived: each stage's derived shape, for its L1 check.
    """
    v = Verdicts()
    for stage in GRID_STAGES:
        v.checks[stage] = []
        if (stage, "pipeline") in t.broken:
            _broken(v, stage, t.broken[(stage, "pipeline")], f"{AXES[stage]}", "shape")
        elif t.reached(stage):
            v.add(stage, _blocks_shape(derived[stage], AXES[stage]))
    _scores(v, t, dtype)
    _masked(v, t, related, empty_zero)
    _weights(v, t, dtype)
    _context(v, t, dtype)
    for stage in ("scores", "weights", "context"):
        _given(v, t, stage, dtype)
    return v


def _broken(v: Verdicts, stage: str, b: Broken, axes: str, name: str) -> None:
    if b.raised is None:
        v.add(stage, C.shape_check(b.shape, b.expected, axes, name))


def _scores(v: Verdicts, t: Tally, dtype: str) -> None:
    if not t.reached("scores"):
        return
    n = t.count("scores", "nonfinite")
    v.add("scores", C.finite_check(n.n, "scores"), n.where)
    v.add("scores", _headroom(t.peak("scores", "max_abs").value, dtype))
    _reference(v, t, "scores", dtype)


def _masked(v: Verdicts, t: Tally, related: bool, empty_zero: bool) -> None:
    if not t.reached("masked_scores"):
        return
    bad, blocked = t.count("masked_scores", "nan_or_posinf"), t.count("masked_scores", "fully_blocked")
    v.add("masked_scores", C.finite_check(bad.n, "masked scores", allow_neg_inf=True), bad.where)
    v.add("masked_scores", C.count_check(3, "no_fully_blocked_query", blocked.n, "query rows with every key blocked"
                                         + (" (beyond rows declared empty)" if empty_zero else "")), blocked.where)
    kept, dropped = t.count("masked_scores", "forbidden_kept"), t.count("masked_scores", "allowed_dropped")
    if kept is None or not related:
        v.add("masked_scores", _not_applicable(3, "forbidden_excluded", "no relation: every key allowed"))
        return
    v.add("masked_scores", C.count_check(3, "forbidden_excluded", kept.n, "forbidden (query, key) scores not excluded"),
          kept.where)
    v.add("masked_scores", C.count_check(3, "allowed_kept", dropped.n, "allowed (query, key) scores excluded"),
          dropped.where)


def _weights(v: Verdicts, t: Tally, dtype: str) -> None:
    if not t.reached("weights"):
        return
    limit = tolerance.row_sum(dtype)
    n = t.count("weights", "nonfinite")
    v.add("weights", C.finite_check(n.n, "weights"), n.where)
    share = t.peak("weights", "sink_share_err")
    _invariants(v, t, "weights", "pipeline", "", limit, sinks=share is not None)
    if share is not None:  # attention sinks: the keys' weights leave the reference's sink share
        v.add("weights", _bound(4, "sink_share", share.value, limit,
                                "max |sum over keys - (1 - the float64 reference's sink share)|"), share.where)
    _reference(v, t, "weights", dtype)


def _invariants(v: Verdicts, t: Tally, stage: str, of: str, prefix: str, limit: float, sinks: bool = False) -> None:
    """Row sums, weight on forbidden keys and declared-empty rows of the pipeline's or the given weights
    (``sinks``: each row's sum counts the sink's share)."""
    words = "given weights: " if of == "given" else ""
    for name, peak, what, lim in (
        ("key_row_sums", "row_sum_err", "max |sum over keys and the sink - 1|" if sinks else "max |sum over keys - 1|",
         limit),
        ("forbidden_weight", "forbidden_max", "largest weight on a forbidden key", limit),
        ("empty_rows_zero", "empty_row_max", "largest weight in a declared-empty row", 0.0),
    ):
        p = t.peak(stage, peak, of)
        if name == "empty_rows_zero" and (p is None or of == "given"):
            continue
        v.add(stage, _bound(3, prefix + name, 0.0 if p is None else p.value, lim, words + what), p and p.where)


def _context(v: Verdicts, t: Tally, dtype: str) -> None:
    if not t.reached("context"):
        return
    n, rng = t.count("context", "nonfinite"), t.peak("context", "range_excess")
    v.add("context", C.finite_check(n.n, "context values"), n.where)
    v.add("context", _bound(3, "in_value_range", _nonneg(0.0 if rng is None else rng.value), 0.0,
                            "largest excursion outside the mixed value rows' range"), rng and rng.where)
    plain = t.agreement("context", "plain", "float64", dtype=dtype)
    if tolerance.is_half(dtype) and plain is not None:
        _factor(v, "context", "matches_reference", t.agreement("context", "pipeline", "float64"), plain, dtype,
                "float64 reference")
        _factor(v, "context", "matches_sdpa", t.agreement("context", "sdpa", "float64"), plain, dtype,
                "float64 reference (SDPA's error)")
    else:
        _compare(v, "context", "matches_reference", t.agreement("context", "pipeline", "float64"), dtype,
                 "float64 reference")
        _compare(v, "context", "matches_sdpa", t.agreement("context", "pipeline", "sdpa"), dtype,
                 "F.scaled_dot_product_attention")
    _backend_checks(v, t, dtype)


def _backend_checks(v: Verdicts, t: Tally, dtype: str) -> None:
    """One L4 check per (backend, dtype) measured, named ``sdpa[backend,dtype]``, in the order measured."""
    for backend, dt, against in t.backends():
        name = f"sdpa[{backend},{dt}]"
        a = t.agreement("context", "sdpa", against, backend, dt)
        if tolerance.is_half(dt):
            plain = t.agreement("context", "plain", "float64", dtype=dt)
            check = _factor(v, "context", name, a, plain, dt, "float64 reference", always=True)
        else:
            words = "the pipeline's context" if against == "pipeline" else "float64 reference"
            check = _compare(v, "context", name, a, dt, words)
        v.backends.append((backend, dt, check.passed))


def _given(v: Verdicts, t: Tally, stage: str, dtype: str) -> None:
    """The user's own intermediate at ``stage``: shape, invariants, and agreement with the references."""
    what = GIVEN_NAMES[stage]
    broken = t.broken.get((stage, "given"))
    if broken is not None:
        v.add(stage, C.shape_check(broken.shape, broken.expected, _given_axes(stage, broken), f"user_{what}_shape"))
        return
    prefix = f"user_{what}_"
    if stage == "weights" and t.reached("weights", "given"):
        n = t.count("weights", "nonfinite", "given")
        v.add(stage, C.count_check(3, prefix + "finite", n.n, "non-finite values in the given weights"), n.where)
        _invariants(v, t, "weights", "given", prefix, tolerance.row_sum(dtype))
    if stage == "context" and t.reached("context", "given"):
        n, rng = t.count("context", "nonfinite", "given"), t.peak("context", "range_excess", "given")
        v.add(stage, C.count_check(3, prefix + "finite", n.n, "non-finite values in the given out"), n.where)
        v.add(stage, _bound(3, prefix + "in_value_range", _nonneg(rng.value), 0.0,
                            "given out: largest excursion outside the mixed value rows' range"), rng.where)
        plain = t.agreement("context", "plain", "float64", dtype=dtype)
        if tolerance.is_half(dtype) and plain is not None:
            _factor(v, stage, prefix + "matches_reference", t.agreement(stage, "given", "float64"), plain, dtype,
                    "float64 reference")
            return
        _compare(v, stage, prefix + "matches_reference", t.agreement(stage, "given", "float64"), dtype, "float64 reference")
        _compare(v, stage, prefix + "matches_sdpa", t.agreement(stage, "given", "sdpa"), dtype,
                 "F.scaled_dot_product_attention (every row)")
        return
    _compare(v, stage, prefix + "matches_reference", t.agreement(stage, "given", "float64"), dtype, "float64 reference")


def _given_axes(stage: str, broken: Broken) -> str:
    shown = "[B,Nh,Tq,Dv]" if stage == "context" else "[B,Nh,Tq,Tk]"
    one_head = broken.expected is not None and len(broken.expected) == 3
    return f"given {GIVEN_NAMES[stage]} {shown.replace('Nh,', '') if one_head else shown}"


def _reference(v: Verdicts, t: Tally, stage: str, dtype: str) -> None:
    """L4 against the float64 reference: the factor rule in half precision, tolerances otherwise."""
    if tolerance.is_half(dtype):
        plain = t.agreement(stage, "plain", "float64", dtype=dtype)
        _factor(v, stage, "matches_reference", t.agreement(stage, "pipeline", "float64"), plain, dtype,
                "float64 reference")
    else:
        _compare(v, stage, "matches_reference", t.agreement(stage, "pipeline", "float64"), dtype, "float64 reference")


def _rounded(v: Verdicts, stage: str, name: str, a: Agreement, against: str) -> Check:
    """L4: every element within ``c * eps * M`` of the reference (:mod:`attn_ledger.engine.rounding`),
    the rule's parts as data (``tolerance``) and in the sentence."""
    from attn_ledger.engine.rounding import limit_of

    parts = dict(a.parts or {})
    check = C.bound_check(4, name, a.diff, limit_of(a), f"max |diff| vs {against}")
    return v.add(stage, replace(check, data={"excess": a.excess, "tolerance": parts}), a.where)


def rounded_check(stage: str, name: str, a: Agreement, against: str) -> Check:
    """:func:`_rounded` for one agreement outside a tally: the check, located when it fails."""
    return _rounded(Verdicts(), stage, name, a, against)


# --- one function per kind of check ---------------------------------------------------------

def _compare(v: Verdicts, stage: str, name: str, a: Agreement | None, dtype: str, against: str) -> Check | None:
    """L4: agreement within the dtype's reference tolerance (nothing when it was not measured)."""
    if a is None:
        return None
    if a.parts is not None and a.parts.get("rule") == "c * eps * M":
        return _rounded(v, stage, name, a, against)
    rtol, atol = tolerance.reference(dtype)
    check = C.compare_check(name, a.diff, math.nan if a.excess is None else a.excess, rtol, atol, against)
    return v.add(stage, check, a.where)


def _factor(v: Verdicts, stage: str, name: str, a: Agreement | None, plain: Agreement | None, dtype: str,
            against: str, always: bool = False) -> Check | None:
    """L4 in half precision: the error against float64 within HALF_FACTOR of the plain same-dtype error;
    by the rounding rule instead where ``a`` was measured by it (the pipeline's and the given tensors
    against float64: :mod:`attn_ledger.engine.rounding`)."""
    if a is not None and a.parts is not None and a.parts.get("rule") == "c * eps * M":
        return _rounded(v, stage, name, a, against)
    if (a is None or plain is None) and not always:
        return None
    check = C.factor_check(name, math.nan if a is None else a.diff, math.nan if plain is None else plain.diff,
                           tolerance.half_floor(dtype), against, tolerance.HALF_FACTOR)
    return v.add(stage, check, a and a.where)


def _bound(level: int, name: str, value: float, limit: float, what: str) -> Check:
    return C.bound_check(level, name, value, limit, what)


def _not_applicable(level: int, name: str, why: str) -> Check:
    return unjudged(level, name, "not_applicable", why)


def _blocks_shape(derived: tuple[int, ...] | None, axes: str) -> Check:
    """L1 for a streamed stage: every block had its derived shape (a block that did not stops the
    run and records a failing shape check instead, with the shape it had)."""
    return Check(1, "shape", "pass", reason=f"{axes} derived {list(derived or ())}; every query block had its derived shape",
                 data={"expected": list(derived or ()), "axes": axes})


def _headroom(max_abs_score: float, dtype: str) -> Check:
    """Warning: the largest |score| against the dtype's range, and whether exp overflows without max-subtraction.

    Measured block-wide, and over the allowed pairs only once that reaches the limit (a
    forbidden pair is masked before exp, whatever it holds).
    """
    import torch

    info = torch.finfo(getattr(torch, dtype))
    return bounded(3, "exp_headroom", "largest |score| of an allowed pair", max_abs_score, math.log(info.max),
                   warn_only=True, reason=f"exp overflows {dtype} above the limit without max-subtraction",
                   data={"dtype_max": info.max})


def _nonneg(value: float) -> float:
    """An excess clipped at zero for display, NaN kept (it fails the bound)."""
    return value if math.isnan(value) else max(0.0, value)


# --- the backward stages ---------------------------------------------------------------------

GRAD_GRID_STAGES = ("grad_weights", "grad_values", "grad_scores", "grad_q", "grad_k")


def judge_backward(t: Tally, dtype: str, *, derived: dict[str, tuple[int, ...]], sampled: str) -> Verdicts:
    """The checks of the backward's score-grid stages from a tally.

    Args:
        derived: each stage's derived shape (its L1 check).
        sampled: how the float64 reference covered the rows, for its checks' words.
    """
    v = Verdicts()
    for stage in GRAD_GRID_STAGES:
        v.checks[stage] = []
        if (stage, "pipeline") in t.broken:
            _broken(v, stage, t.broken[(stage, "pipeline")], AXES[stage], "shape")
            continue
        if not t.reached(stage):
            continue
        v.add(stage, _blocks_shape(derived[stage], AXES[stage]))
        n = t.count(stage, "nonfinite")
        v.add(stage, C.finite_check(n.n, stage.replace("_", " ") + " values"), n.where)
        if stage == "grad_scores":
            rule = t.agreement(stage, "pipeline", "row_rule")
            rtol, atol = tolerance.reference(dtype)
            v.add(stage, Check(3, "softmax_row_rule", "pass" if rule.excess is not None and rule.excess <= 0 else "fail",
                               "max |S-bar - A*(A-bar - rowsum(A*A-bar))|, per query row", rule.diff, rtol=rtol,
                               atol=atol, data={"excess": rule.excess}), rule.where)
        if stage in ("grad_values", "grad_k"):
            _blocked_keys(v, t, stage)
        if stage == "grad_k":
            p = t.peak(stage, "key_sum")
            if p is None:
                v.add(stage, _not_applicable(3, "key_sum_zero", "soft-capped scores or attention sinks: the cap's slope "
                                             "or the sink's share leaves the rows of the scores' gradient summing to "
                                             "other than zero"))
            else:
                v.add(stage, _bound(3, "key_sum_zero", p.value, tolerance.row_sum(dtype),
                                    "max |sum over keys of K-bar| / sum over keys of |K-bar|"))
        _compare(v, stage, "matches_reference", t.agreement(stage, "pipeline", "float64"), dtype,
                 f"float64 autograd ({sampled})")
        _compare(v, stage, "matches_sdpa", t.agreement(stage, "pipeline", "sdpa"), dtype,
                 "autograd of F.scaled_dot_product_attention")
    _sinks_gradient(v, t, dtype, derived.get("grad_sinks"), sampled)
    return v


def _sinks_gradient(v: Verdicts, t: Tally, dtype: str, derived: tuple[int, ...] | None, sampled: str) -> None:
    """The sinks' gradient ``[Nh]`` (with sinks): its shape, finite, against float64 autograd."""
    stage = "grad_sinks"
    if (stage, "pipeline") in t.broken:
        v.checks[stage] = []
        _broken(v, stage, t.broken[(stage, "pipeline")], AXES[stage], "shape")
        return
    if not t.reached(stage):
        return
    v.checks[stage] = []
    v.add(stage, Check(1, "shape", "pass", reason=f"{AXES[stage]} derived {list(derived or ())}; every query block's "
                       "part had it", data={"expected": list(derived or ()), "axes": AXES[stage]}))
    n = t.count(stage, "nonfinite")
    v.add(stage, C.finite_check(n.n, "sinks' gradient values"), n.where)
    _compare(v, stage, "matches_reference", t.agreement(stage, "pipeline", "float64"), dtype,
             f"float64 autograd ({sampled}, the part those rows contribute)")


def _blocked_keys(v: Verdicts, t: Tally, stage: str) -> None:
    p = t.peak(stage, "blocked_max")
    if p is None:
        v.add(stage, _not_applicable(3, "blocked_keys_zero", "every key is used by some query"))
        return
    v.add(stage, _bound(3, "blocked_keys_zero", p.value, 0.0, "largest |gradient| on a key no query may use"), p.where)
