"""Judging on its own: measurements fed by hand are folded over blocks and turned into checks."""

from __future__ import annotations

import math

import pytest

from attn_ledger import tolerance
from attn_ledger.engine.judge import Tally, judge
from attn_ledger.engine.measure import Agreement, Broken, Count, Peak, Where
from attn_ledger.report import find_check

DERIVED = {"scores": (2, 3, 5, 5), "masked_scores": (2, 3, 5, 5), "weights": (2, 3, 5, 5), "context": (2, 3, 5, 4)}


def healthy(dtype="float32", blocks=2):
    """What execution yields for a healthy run of ``blocks`` blocks: every count zero, every error tiny."""
    found = []
    for _ in range(blocks):
        found += [
            Count("scores", "nonfinite", 0), Peak("scores", "max_abs", 1.5),
            Count("masked_scores", "nan_or_posinf", 0), Count("masked_scores", "fully_blocked", 0),
            Count("masked_scores", "forbidden_kept", 0), Count("masked_scores", "allowed_dropped", 0),
            Count("masked_scores", "pairs", 75),
            Count("weights", "nonfinite", 0), Peak("weights", "row_sum_err", 1e-7), Peak("weights", "forbidden_max", 0.0),
            Peak("context", "range_excess", -1e-3), Count("context", "nonfinite", 0),
            Agreement("context", "pipeline", "sdpa", 1e-7, -1e-5),
        ]
    for stage in ("scores", "weights", "context"):
        found.append(Agreement(stage, "pipeline", "float64", 1e-7, -1e-5))
    return found


def checks_of(measures, dtype="float32", related=True, empty_zero=False):
    return judge(Tally.of(measures), dtype, related=related, empty_zero=empty_zero, derived=DERIVED)


def test_healthy_measurements_pass_every_check():
    v = checks_of(healthy())
    names = {stage: [c.name for c in cs] for stage, cs in v.checks.items()}
    assert names["masked_scores"] == ["shape", "finite", "no_fully_blocked_query", "forbidden_excluded", "allowed_kept"]
    assert names["context"] == ["shape", "finite", "in_value_range", "matches_reference", "matches_sdpa"]
    assert all(c.status == "pass" for cs in v.checks.values() for c in cs)
    assert find_check(v.checks["masked_scores"], "forbidden_excluded").value == 0
    assert find_check(v.checks["scores"], "exp_headroom").value == 1.5
    assert all(c.location is None for cs in v.checks.values() for c in cs)


def test_counts_add_up_over_blocks_and_keep_the_first_place():
    late, early = Where(1, 0, 40, 41), Where(0, 2, 7, 9)
    measures = healthy() + [Count("masked_scores", "forbidden_kept", 3, where=late),
                            Count("masked_scores", "forbidden_kept", 2, where=early)]
    t = Tally.of(measures)
    assert t.count("masked_scores", "forbidden_kept").n == 5
    assert t.count("masked_scores", "forbidden_kept").where == early
    v = judge(t, "float32", related=True, empty_zero=False, derived=DERIVED)
    c = find_check(v.checks["masked_scores"], "forbidden_excluded")
    assert (c.status, c.level, c.value, c.limit) == ("fail", 3, 5, 0)
    assert c.location == {"example": 0, "head": 2, "query": 7, "key": 9}


def test_a_nan_peak_in_any_block_fails_and_stays():
    t = Tally.of([Peak("weights", "row_sum_err", 1e-7), Peak("weights", "row_sum_err", math.nan, where=Where(0, 1, 3)),
                  Peak("weights", "row_sum_err", 0.5)])
    assert math.isnan(t.peak("weights", "row_sum_err").value)
    assert t.peak("weights", "row_sum_err").where == Where(0, 1, 3)


@pytest.mark.parametrize("err,ok", [(1e-7, True), (10 * tolerance.row_sum("float32"), False)])
def test_row_sums_against_the_row_sum_tolerance(err, ok):
    v = checks_of(healthy() + [Peak("weights", "row_sum_err", err, where=Where(1, 2, 4))])
    c = find_check(v.checks["weights"], "key_row_sums")
    assert (c.passed, c.value, c.limit) == (ok, err, tolerance.row_sum("float32"))
    assert c.location == (None if ok else {"example": 1, "head": 2, "query": 4})


@pytest.mark.parametrize("excess,ok", [(-1e-6, True), (3e-5, False), (math.nan, False)])
def test_reference_agreement_by_its_excess(excess, ok):
    measures = [m for m in healthy() if not (isinstance(m, Agreement) and m.stage == "context" and m.against == "float64")]
    v = checks_of(measures + [Agreement("context", "pipeline", "float64", 4e-5, excess, where=Where(0, 0, 2))])
    c = find_check(v.checks["context"], "matches_reference")
    assert c.passed is ok and c.value == 4e-5 and (c.rtol, c.atol) == tolerance.reference("float32")
    assert c.location == (None if ok else {"example": 0, "head": 0, "query": 2})


@pytest.mark.parametrize("err,ok", [(3.9e-3, True), (4.1e-3, False)])
def test_half_precision_factor_rule(err, ok):
    """float16: the pipeline's error may be HALF_FACTOR times the plain float16 error (floor 1e-3)."""
    measures = [m for m in healthy() if not (isinstance(m, Agreement) and m.against == "float64")]
    measures += [Agreement("context", "plain", "float64", 5e-4, dtype="float16"),
                 Agreement("context", "pipeline", "float64", err, 1.0),
                 Agreement("context", "sdpa", "float64", 1e-3)]
    v = checks_of(measures, dtype="float16")
    c = find_check(v.checks["context"], "matches_reference")
    assert c.passed is ok and c.value == err and c.limit == pytest.approx(4e-3)
    assert find_check(v.checks["context"], "matches_sdpa").status == "pass"
    assert tolerance.half_floor("float16") * tolerance.HALF_FACTOR == pytest.approx(4e-3)


def test_no_relation_makes_exclusion_not_applicable():
    measures = [m for m in healthy() if m.stage != "masked_scores" or m.name not in ("forbidden_kept", "allowed_dropped")]
    v = checks_of(measures, related=False)
    c = find_check(v.checks["masked_scores"], "forbidden_excluded")
    assert c.status == "not_applicable"


def test_a_broken_stage_is_its_failing_shape_check_and_nothing_after():
    measures = healthy(blocks=1)[:7] + [Broken("weights", shape=(2, 1, 5, 5), expected=(2, 3, 5, 5))]
    v = checks_of(measures)
    assert [(c.name, c.status, c.level) for c in v.checks["weights"]] == [("shape", "fail", 1)]
    assert v.checks["context"] == []


@pytest.mark.parametrize("shape", [(3,), (2, 2, 4, 7), (2, 2, 4), (1, 2, 4, 8)])
def test_given_out_of_the_wrong_shape_is_a_level_one_check_at_context(shape):
    v = checks_of(healthy() + [Broken("context", "given", shape=shape, expected=(2, 2, 4, 8))])
    c = find_check(v.checks["context"], "user_out_shape")
    assert (c.status, c.level, c.data["got"], c.data["expected"]) == ("fail", 1, list(shape), [2, 2, 4, 8])
    assert not any(x.name.startswith("user_out_") and x.name != "user_out_shape" for x in v.checks["context"])


def test_pinned_backends_become_one_check_each_in_order():
    measures = healthy() + [
        Agreement("context", "sdpa", "pipeline", 1e-7, -1e-5, backend="math", dtype="float32"),
        Agreement("context", "sdpa", "float64", 2e-3, backend="math", dtype="float16"),
        Agreement("context", "plain", "float64", 1e-3, dtype="float16"),
        Agreement("context", "sdpa", "float64", 5e-2, backend="flash", dtype="float16"),
    ]
    v = checks_of(measures)
    names = [c.name for c in v.checks["context"] if c.name.startswith("sdpa[")]
    assert names == ["sdpa[math,float32]", "sdpa[math,float16]", "sdpa[flash,float16]"]
    assert v.backends == [("math", "float32", True), ("math", "float16", True), ("flash", "float16", False)]
