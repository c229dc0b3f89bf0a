"""The kernel protocol's optional features: ``softcap=``, ``window=`` and ``sinks=``.

A correct kernel that declares them passes their cases; one that ignores or misapplies a declared
feature fails at its level; an undeclared feature is never passed. Runs in-process on the feature
cases only (a few seconds).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from attn_ledger.errors import InputError, SetupError
from attn_ledger.probes.kernel.cases import FEATURES, case_inputs, feature_cases, parse_case, select_cases, window_allow
from attn_ledger.probes.kernel.check import check_kernel
from attn_ledger.probes.kernel.reference import attention as reference
from attn_ledger.probes.kernel.spec import Declaration, declaration

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "kernels"))
import features as F  # noqa: E402

ALL = Declaration(supports=FEATURES)


def _first(fn, supports, **kw):
    report = check_kernel(fn, feature_cases(supports), declaration=Declaration(supports=supports), **kw)
    ff = report.first_finding
    return report, (None if ff is None else (ff.check.level, ff.check.name, ff.row))


def test_ids_round_trip_and_name_the_features():
    for case in feature_cases(FEATURES):
        assert parse_case(case.id) == case
    c = parse_case("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-large-f32-cap30-w4-sinks")
    assert (c.softcap, c.window, c.sinks, c.features) == (30.0, 4, True, FEATURES)
    assert "softcap=30" in c.call_text() and "window=4" in c.call_text() and "sinks=sinks[Nh]" in c.call_text()
    with pytest.raises(InputError, match="window=0"):
        parse_case("b1-h1kv1-tq2tk2-dh4dv4-causal-flag-rand-f32-w0")


def test_feature_cases_only_for_declared_features():
    assert feature_cases(()) == ()
    assert all(c.features == ("softcap",) for c in feature_cases(("softcap",)))
    both = feature_cases(("softcap", "window"))
    assert any(c.features == ("softcap", "window") for c in both)
    assert not any(c.sinks for c in both)
    assert select_cases(None, "default", ("sinks",))[-1].sinks
    assert len(select_cases(None)) == len(select_cases(None, "default", ()))


def test_declaration_reads_supports():
    assert declaration({"supports": "window,softcap"}).supports == ("softcap", "window")
    assert declaration({"supports": []}).supports == ()
    with pytest.raises(InputError, match="supports: got 'bogus'"):
        declaration({"supports": "bogus"})
    d = Declaration(supports=("sinks",))
    assert d.protocol_keywords()[-1] == "sinks"
    kw = Declaration().keywords({"softcap": 2.0, "window": 3, "sinks": torch.zeros(1), "scale": None})
    assert set(kw) == {"scale"}  # an undeclared feature is never passed
    assert parse_case("b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32-sinks").id.endswith("-sinks")
    assert Declaration().outside(parse_case("b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32-sinks")) == "sinks= (not declared)"


def test_window_counts_the_query_itself():
    allow = window_allow(3, 5, 2)  # bottom-right: query i sits at key i + 2; the future is the causal part's
    assert allow[0].tolist() == [False, True, True, True, True]  # query 0 at key 2: keys 1 and 2 (and later)
    assert allow[2].tolist() == [False, False, False, True, True]  # query 2 at key 4: keys 3 and 4


def test_reference_applies_softcap_and_sinks():
    q, k, v, kw = case_inputs("b1-h2kv2-tq3tk3-dh4dv4-none-large-f64-cap2-sinks")
    s = (q @ k.transpose(-2, -1)) / 2.0
    c = 2.0 * torch.tanh(s / 2.0)
    e = torch.exp(c)
    w = e / (e.sum(-1, keepdim=True) + torch.exp(kw["sinks"])[None, :, None, None])
    got = reference(q, k, v, None, 0.5, compute=torch.float64, softcap=2.0, sinks=kw["sinks"]).out
    assert torch.allclose(got, w @ v, atol=1e-12)


def test_correct_kernel_passes_every_feature_case():
    report = check_kernel(F.attention, feature_cases(FEATURES), declaration=ALL)
    assert report.exit_code == 0, report.first_finding
    assert report.details["cases_total"] == len(feature_cases(FEATURES)) > 20


def test_correct_kernel_without_features_passes_by_default():
    report = check_kernel(F.no_features, [parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")])
    assert report.exit_code == 0


def test_undeclared_kernel_cannot_take_a_declared_feature():
    with pytest.raises(SetupError, match="'sinks'"):
        check_kernel(F.no_features, feature_cases(("sinks",)), declaration=Declaration(supports=("sinks",)))


@pytest.mark.parametrize("fn, supports, level", [
    (F.softcap_ignored, ("softcap",), 4),
    (F.softcap_after_mask, ("softcap",), 3),
    (F.window_too_wide, ("window",), 3),
    (F.sinks_dropped, ("sinks",), 4),
    (F.sinks_in_numerator, ("sinks",), 4),
])
def test_a_kernel_that_misapplies_a_declared_feature_fails(fn, supports, level):
    report, first = _first(fn, supports, backward=False)
    assert report.exit_code == 1
    assert first[0] == level, first
    assert first[2] in {c.id for c in feature_cases(supports)}


def test_backward_through_features_is_judged():
    """The gradients of a correct kernel agree through the soft-cap and the sinks; a kernel whose
    backward skips the soft-cap's derivative fails grad_q."""
    cases = [parse_case("b2-h4kv2-tq5tk9-dh8dv4-pad-causal-large-f32-cap30-w4"),
             parse_case("b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32-sinks")]
    assert check_kernel(F.attention, cases, declaration=ALL).exit_code == 0

    class CapNoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, s, c):
            return c * torch.tanh(s / c)

        @staticmethod
        def backward(ctx, g):
            return g, None  # the derivative of the cap left out

    def wrong_backward(q, k, v, *, allow_mask=None, is_causal=False, scale=None, softcap=None, window=None, sinks=None):
        s = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-2, -1)) * (scale or 1 / math.sqrt(q.shape[-1]))
        s = CapNoGrad.apply(s, softcap)
        tq, tk = s.shape[-2:]
        i = torch.arange(tq)[:, None] + tk - tq
        j = torch.arange(tk)[None]
        allow = (j <= i) if is_causal else torch.ones(tq, tk, dtype=torch.bool)
        s = s.masked_fill(~allow, float("-inf"))
        return torch.softmax(s, -1) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)

    case = parse_case("b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32-cap1.5")
    report = check_kernel(wrong_backward, [case], declaration=ALL)
    assert report.exit_code == 1 and report.first_finding.check.name.startswith("grad_")


def test_window_is_transformers_sliding_window():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    fn = masking_utils.sliding_window_causal_mask_function(3)
    ours = window_allow(6, 6, 3) & torch.ones(6, 6, dtype=torch.bool).tril()
    t = torch.tensor
    theirs = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(6)] for i in range(6)])
    assert torch.equal(ours, theirs)
