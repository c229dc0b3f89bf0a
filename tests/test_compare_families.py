"""Every correct pairing ``compare`` offers, on every family ``scan`` covers (the ``real`` extra; skipped without
transformers): noise is never a finding.

Each family is a small config with random weights (B = 2, T = 20). Under each implementation pair it supports
(eager against sdpa; eager against flex_attention where sdpa is refused), in float32 and in bfloat16, and under
each invariance that applies to it, a correct model must pass; where an invariance does not apply, the report says
so and exits 0. Two results here are not passes, and each is asserted as what it is:

* gpt_oss has no second implementation on a CPU (sdpa is refused, and transformers' flex attention refuses its
  sinks on a CPU), so it has no implementation pair here;
* gpt_oss under ``--vary packing`` is a real finding: its model builds its masks without the position ids, so
  transformers never detects the packed documents and each reads the ones before it (the masks row says so).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from attn_ledger.probes.model.compare import compare, parse_vary, runs  # noqa: E402
from attn_ledger.probes.model.driver import LocalModel, setup  # noqa: E402
from attn_ledger.probes.model.inputs import InputPlan  # noqa: E402

DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "gpt2")
FAMILIES = DECODERS + ("bert", "t5")
PAIRS = {"gemma2": "eager,flex_attention", "gpt_oss": None}  # the rest: eager against sdpa
RIGHT = ("bert", "t5")  # padded on the right, as encoders are
# transformers' flex attention and torch.compile under it call torch in ways torch 2.13 deprecates (not our code)
FLEX = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _forget_compiled():
    """Flex attention compiles in this process. What torch.compile learns here (after a recompile it treats the
    shapes as dynamic) must not reach the flex kernels other tests compile: the cache is emptied after each test."""
    yield
    import torch

    torch._dynamo.reset()


def _compare(family: str, vary: str, padding: str, **kw):
    r = runs(parse_vary(vary), family, plan=InputPlan(2, 20, padding, 0), **kw)
    loaded, _ = setup(r.args())
    return compare(LocalModel(loaded), r)


def _failing(report) -> list:
    return [(r.name, [c.name for c in r.checks if c.status == "fail"]) for r in report.rows if r.status == "fail"]


IMPLEMENTATIONS = [pytest.param(f, d, id=f"{f}-{d}", marks=[FLEX] if PAIRS.get(f) else [])
                   for f in FAMILIES if PAIRS.get(f, "") is not None for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("family, dtype", IMPLEMENTATIONS)
def test_each_implementation_pair_passes(family, dtype):
    pair = PAIRS.get(family) or "eager,sdpa"
    report = _compare(family, f"attn-implementation={pair}", "right" if family in RIGHT else "left", dtype=dtype)
    forward = next((r.checks[0] for r in report.rows if r.name == "forward"), None)  # a row only when it raised
    if forward is not None and "BackendCompilerFailed" in forward.reason:  # e.g. ATEN_CPU_CAPABILITY=default
        pytest.skip(f"torch.compile cannot build flex attention's kernel here: {forward.reason}")
    assert report.verdict == "pass", _failing(report)
    assert report.exit_code == 0


INVARIANCES = [(f, v) for f in FAMILIES for v in ("dtype=float32,bfloat16", "padding-side", "batch")]
INVARIANCES += [(f, v) for f in DECODERS for v in ("cache", "packing") if (f, v) != ("gpt_oss", "packing")]


@pytest.mark.parametrize("family, vary", INVARIANCES, ids=[f"{f}-{v}" for f, v in INVARIANCES])
def test_each_invariance_passes_or_says_it_does_not_apply(family, vary):
    padding = "none" if vary == "padding-side" else ("right" if family in RIGHT and vary.startswith("dtype") else "left")
    report = _compare(family, vary, padding)
    assert report.exit_code == 0, _failing(report)
    assert report.verdict == "pass", _failing(report)
    assert any(r.fields.get("layer") is not None for r in report.rows)  # blocks were compared
    if family == "t5":  # its decoder blocks' rows are the decoder's tokens, the same in both runs
        decoder = [r for r in report.rows if r.name.startswith("decoder.")]
        assert decoder and all(r.status == "pass" for r in decoder)


@pytest.mark.parametrize("vary", ["padding-side", "batch"])
def test_learned_positions_without_position_ids_are_not_applicable(vary):
    """BART embeds each position with a learned table and its inputs carry no position ids: moving a token moves
    its embedding, so its runs need not agree, and the report says so instead of failing."""
    report = _compare("bart", vary, "none" if vary == "padding-side" else "left")
    assert report.exit_code == 0
    assert [(r.name, r.status) for r in report.rows] == [(vary, "not_applicable")]
    assert "learned (encoder.embed_positions)" in report.rows[0].checks[0].reason


def test_an_encoder_decoders_blocks_are_told_apart_and_a_decoders_are_not():
    from attn_ledger.probes.model.pair import blocks_of, decoder_blocks
    from attn_ledger.probes.model.targets import build, target

    def sides(family, architecture):
        model, _ = build(target("transformers", family, seed=0), head=True)
        return decoder_blocks(model, blocks_of(model), architecture)

    assert sides("t5", "encoder-decoder") == (False, False, True, True)
    assert not any(sides("llama", "decoder"))  # its get_decoder() is its stack of blocks: none is a decoder's own


@FLEX
def test_gpt_oss_has_no_implementation_pair_on_a_cpu():
    from attn_ledger.errors import InputError

    with pytest.raises(InputError, match="sdpa"):
        _compare("gpt_oss", "attn-implementation=eager,sdpa", "left")
    report = _compare("gpt_oss", "attn-implementation=eager,flex_attention", "left")
    forward = report.row("forward").check("forward")
    assert forward.status == "fail"  # transformers refuses its sinks under flex on a CPU, or torch.compile cannot build
    assert "cannot be run on CPU with flex attention" in forward.reason or "BackendCompilerFailed" in forward.reason


def test_gpt_oss_packed_documents_read_each_other_and_the_masks_row_says_so():
    report = _compare("gpt_oss", "packing", "left")
    assert report.exit_code == 1
    assert report.first_finding.row == "masks"
    where = report.first_finding.check.location
    assert where["other_documents"] >= 1  # a query of the second document reads keys of the first
    llama = _compare("llama", "packing", "left")  # its masks are built from the position ids: documents apart
    assert llama.row("masks").status == "pass"
