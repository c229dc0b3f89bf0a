"""Measurement on its own: block-level measurements on tensors built by hand, and the typed records
execution yields (no judging here: the numbers and places, not pass or fail)."""

from __future__ import annotations

import math

import torch

from attn_ledger.engine import measure as M
from attn_ledger.engine import plan as PL
from attn_ledger.maths import relations
from attn_ledger.engine.execute import Execution
from attn_ledger.engine.measure import Agreement, Broken, Count, Peak, Where
from attn_ledger.maths.pipeline import HEALTHY, Ops


def _by_name(records):
    return {r.name: r for r in records}


def test_mask_counts_count_every_wrong_pair_and_place_the_first():
    allow = torch.ones(1, 1, 3, 4, dtype=torch.bool).tril()  # [B, Nh, rows, kw]: row i allows keys 0..i
    m = torch.zeros(1, 1, 3, 4)
    m[~allow] = -math.inf
    m[0, 0, 1, 3] = 0.0  # a forbidden pair kept (query 1 + q0, key 3 + k0)
    m[0, 0, 2, 0] = -math.inf  # an allowed pair dropped
    found = _by_name(M.mask_counts(m, allow, None, False, (0, 4), tk=10, q0=5, k0=2))
    assert found["forbidden_kept"].n == 1 and found["forbidden_kept"].where == Where(0, 0, 6, 5)
    assert found["allowed_dropped"].n == 1 and found["allowed_dropped"].where == Where(0, 0, 7, 2)
    assert found["fully_blocked"].n == 0 and found["nan_or_posinf"].n == 0
    assert found["pairs"].n == 1 * 1 * 3 * 10  # every (query, key) pair of the block's rows, computed or skipped


def test_mask_counts_find_rows_with_every_key_excluded():
    allow = torch.ones(2, 1, 2, 3, dtype=torch.bool)
    m = torch.zeros(2, 1, 2, 3)
    m[1, 0, 1] = -math.inf  # example 1, query 1: nothing left
    found = _by_name(M.mask_counts(m, allow, None, False, (0, 3), tk=3, q0=0, k0=0))
    assert found["fully_blocked"].n == 1 and found["fully_blocked"].where == Where(1, 0, 1)
    assert found["allowed_dropped"].n == 3


def test_weight_invariants_on_a_block():
    w = torch.tensor([[[[0.5, 0.5, 0.0], [0.2, 0.2, 0.7]]]])  # [1, 1, 2 rows, 3 keys]; row 1 sums to 1.1
    allow = torch.tensor([[[[True, True, False], [True, True, False]]]])
    found = _by_name(M.weight_invariants("weights", "pipeline", w, allow, None, False, 1e-5, q0=10, k0=0,
                                         count_nonfinite=True))
    assert found["nonfinite"].n == 0
    assert math.isclose(found["row_sum_err"].value, 0.1, rel_tol=1e-6) and found["row_sum_err"].where == Where(0, 0, 11)
    assert math.isclose(found["forbidden_max"].value, 0.7, rel_tol=1e-6)
    assert found["forbidden_max"].where == Where(0, 0, 11, 2)


def test_nonfinite_places_the_first_bad_entry():
    t = torch.zeros(2, 2, 3, 4)
    t[1, 0, 2, 1] = math.nan
    t[1, 1, 0, 0] = math.inf
    c = M.nonfinite("weights", t, q0=100, k0=7)
    assert (c.n, c.where) == (2, Where(1, 0, 102, 8))
    assert M.nonfinite("weights", torch.zeros(2, 2)).n == 0


def test_agreement_is_located_only_outside_the_tolerance():
    ref = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    near = ref.float() + 1e-7
    a = M.agreement("context", "pipeline", "float64", near, ref, 2e-5, 2e-5, q0=0, k0=None)
    assert a.excess <= 0 and a.where is None
    far = near.clone()
    far[0, 1, 2, 3] = 0.5
    a = M.agreement("context", "pipeline", "float64", far, ref, 2e-5, 2e-5, q0=8, k0=None)
    assert math.isclose(a.diff, 0.5, rel_tol=1e-6) and a.where == Where(0, 1, 10)


def test_range_excess_places_the_excursion():
    v = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]])  # [1, 1, Tk=2, Dv=2]
    c = torch.tensor([[[[1.0, 2.0], [1.0, 7.0]]]])  # row 1 coordinate 1 lies 4 above the values' max
    value, idx = M.range_excess(c, v, None, 0.0, 0.0)
    assert value == 4.0 and idx == (0, 0, 1, 1)


def _execution(ops=HEALTHY, shape=(1, 2, 40, 8), block_size=10):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    b, nh, tq, _ = shape
    rel = relations.build(relations.resolve("causal", tq=tq, tk=tq), b, nh, tq, tq)
    plan = PL.make_plan(b, nh, tq, tq, rel, block_size=block_size)
    return Execution(plan, rel, ops, q, k, v, (q, k, v), scale=8 ** -0.5, ref_scale=8 ** -0.5, empty_zero=False), plan


def test_execution_yields_typed_measurements_stage_by_stage_and_block_by_block():
    run, plan = _execution()
    found = list(run.run())
    assert all(isinstance(m, (Count, Peak, Agreement)) for m in found)
    stages = [m.stage for m in found if isinstance(m, Count) and m.name in ("nonfinite", "pairs") and m.of == "pipeline"]
    per_block = ["scores", "masked_scores", "weights"]
    assert stages[:3] == per_block  # each block: its stages in order
    assert sum(1 for m in found if isinstance(m, Count) and m.name == "pairs") == len(plan.blocks) == 4
    assert [m.stage for m in found if isinstance(m, Agreement) and m.against == "float64"] == ["scores", "weights", "context"]
    assert sum(m.n for m in found if isinstance(m, Count)
               and m.name in ("forbidden_kept", "allowed_dropped", "nonfinite", "fully_blocked")) == 0
    assert run.context is not None and not run.context.is_inference()


def test_execution_stops_at_a_stage_that_raises():
    def broken_softmax(masked, allow, empty_rows_zero):
        raise RuntimeError("no softmax today")

    run, _ = _execution(ops=Ops(softmax=broken_softmax))
    found = list(run.run())
    broken = [m for m in found if isinstance(m, Broken)]
    assert len(broken) == 1 and broken[0].stage == "weights" and "no softmax" in str(broken[0].raised)
    assert not any(m.stage == "context" and isinstance(m, (Count, Peak)) for m in found)
    assert run.context is None
