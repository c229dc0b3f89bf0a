"""The ledger's stages and the checks each one carries: level, name, meaning, and when it appears.

This is the one list of which stage carries which check at which level. The ledger's judging
is tested against it (``tests/test_stages.py``: every check a ledger emits, across the faults,
mask relations, dtypes and saved-tensor inputs, appears here at its stage and level, and every
entry here is emitted by some ledger), and the stage tables in ``docs/run.md`` are generated
from it, so the documentation and the ledger cannot disagree.

A new check goes here first, with its level and one line on what it means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from attn_ledger.report import LEVEL_NAMES

PIPELINE, TENSORS = "pipeline", "tensors"
BOTH = frozenset({PIPELINE, TENSORS})


@dataclass(frozen=True)
class CheckSpec:
    """One check a stage carries.

    Attributes:
        level: 1 shape, 2 axis semantics, 3 numerical invariants, 4 behaviour.
        name: the check's name as the ledger reports it; ``BACKEND`` and ``DTYPE`` in capitals
            stand for a family of names (``sdpa[math,float32]``).
        meaning: what passing means, in one line.
        when: the condition under which the check appears; empty when it always does.
        modes: where it appears: the built-in pipeline (``run``), saved tensors (``run --tensors``).
    """

    level: int
    name: str
    meaning: str
    when: str = ""
    modes: frozenset[str] = BOTH

    def matches(self, name: str) -> bool:
        if name == self.name:
            return True
        if not any(part in self.name for part in ("BACKEND", "DTYPE")):
            return False
        pattern = re.escape(self.name).replace("BACKEND", "[a-z_]+").replace("DTYPE", "[a-z0-9]+")
        return re.fullmatch(pattern, name) is not None


ROPE, GRAD, SINK_GRAD = "rope", "grad", "grad+sinks"  # what an optional stage needs: rotary positions on, the
# backward asked for, or the backward with attention sinks
NEEDS_WORDS = {"": "", ROPE: "with --rope", GRAD: "with --grad", SINK_GRAD: "with --grad and --sinks"}


@dataclass(frozen=True)
class StageSpec:
    """One stage of the ledger: its name, its axes, what it holds, and its checks in ledger order.

    ``needs``: empty for a stage every ledger has; ``"rope"`` (rotary positions), ``"grad"`` (the
    backward) or ``"grad+sinks"`` (the backward with attention sinks) for one that appears only then.
    """

    name: str
    axes: str
    holds: str
    checks: tuple[CheckSpec, ...]
    modes: frozenset[str] = BOTH
    tensor_axes: str = ""  # the axes with saved tensors, where they differ
    needs: str = ""

    def axes_in(self, mode: str) -> str:
        return self.tensor_axes if mode == TENSORS and self.tensor_axes else self.axes


_P = frozenset({PIPELINE})
_T = frozenset({TENSORS})
_VS_F64 = "agrees with the float64 reference within the dtype's tolerance"

# Checks any computed stage may carry: a stage that raises is an L1 finding, not a crash.
ANY_STAGE: tuple[CheckSpec, ...] = (
    CheckSpec(1, "computes", "the stage returned its tensor; it raised instead (the row shows what it raised)",
              "only when the stage raises"),
)

_VS_GRAD = "agrees with float64 autograd of the reference on its sampled query rows (for K-bar and V-bar, the part those rows contribute)"
_VS_SDPA_GRAD = "agrees with autograd of F.scaled_dot_product_attention on every row"
_GRADCHECK = ("the hand backward, run in float64, agrees with central differences of the pipeline's forward "
              "(step 1e-6, within 2e-6) on up to 64 coordinates")
_SMALL = "q, k and v with at most 4096 entries in all"


# The checks most stages share: the shape, finite values, the float64 reference, SDPA.
FINITE = CheckSpec(3, "finite", "no NaN or infinity")
_VS_PROJ = CheckSpec(4, "matches_reference", "agrees with a float64 projection and split")
_VS_REF = CheckSpec(4, "matches_reference", _VS_F64)
_VS_REF_CHAIN = CheckSpec(4, "matches_reference", "agrees with the float64 reference")
_VS_GRAD_REF = CheckSpec(4, "matches_reference", _VS_GRAD)
_VS_SDPA_GRAD_ROWS = CheckSpec(4, "matches_sdpa", _VS_SDPA_GRAD, "not with queries that have every key blocked")
_GRADCHECK_SPEC = CheckSpec(4, "gradcheck", _GRADCHECK, _SMALL)


def _shape(meaning: str) -> CheckSpec:
    return CheckSpec(1, "shape", meaning)


def _derived(axes: str) -> CheckSpec:
    """The whole tensor has the derived shape ``axes``."""
    return _shape(f"the derived {axes}")


def _blocks(width: str) -> CheckSpec:
    """Every query block has the derived ``[B, Nh, rows, width]``."""
    return _shape(f"every query block has the derived [B, Nh, rows, {width}]")


def _key_parts(width: str) -> CheckSpec:
    """Every query block's part of a key-side gradient has the derived ``[B, Nh, keys, width]``."""
    return _shape(f"every query block's part has the derived [B, Nh, keys, {width}]")


def _blocked_keys(what: str) -> CheckSpec:
    return CheckSpec(3, "blocked_keys_zero", f"a key no query may use gets zero {what}", "not applicable when every key is used")


def _vs_chain(what: str) -> tuple[CheckSpec, CheckSpec]:
    """The built-in pipeline's projections and input gradients against both autograd references."""
    return (CheckSpec(4, "matches_reference", "agrees with float64 autograd of the whole reference on its sampled rows"),
            CheckSpec(4, "matches_sdpa", f"agrees with autograd of {what} built on F.scaled_dot_product_attention",
                      "not with queries that have every key blocked"))


def _user(name: str, stage_words: str, checks: tuple[tuple[int, str, str], ...], plural: bool = False
          ) -> tuple[CheckSpec, ...]:
    """The checks of a user's saved tensor ``name`` at a stage: its shape, then ``(level, check, meaning)`` each."""
    wrong = f"--tensors with {'' if plural else 'a '}wrong-shaped {name}"
    return (CheckSpec(1, f"user_{name}_shape", f"the given {name} {stage_words}", wrong, _T),
            *(CheckSpec(level, f"user_{name}_{check}", meaning, f"--tensors with {name}", _T) for level, check, meaning in checks))


def _user_grad(name: str, stage_words: str) -> tuple[CheckSpec, ...]:
    return _user(name, f"has the shape of {stage_words}", (
        (4, "matches_reference", f"the given {name} agrees with float64 autograd"),
        (4, "matches_sdpa", f"the given {name} agrees with autograd of F.scaled_dot_product_attention")))


def _projected(name: str, axes: str, holds: str, *middle: CheckSpec) -> StageSpec:
    """The q, k and v stages of the built-in pipeline: projected and split into heads."""
    spaced = axes.replace(",", ", ")
    return StageSpec(name, axes, holds, (_derived(spaced), *middle, FINITE, _VS_PROJ), _P)


STAGES: tuple[StageSpec, ...] = (
    StageSpec("input", "[B,Tq,E]", "the input (saved q, k, v with --tensors)", (), BOTH, "[B,Nh,Tq,Dh]"),
    StageSpec("head_roundtrip", "[B,T,E]", "merge(split(x)) on a deterministic arange tensor", (
        _shape("merge(split(x)) has the shape of x"),
        CheckSpec(2, "roundtrip_exact", "merge(split(x)) == x, compared by value: no value moved"),
        CheckSpec(2, "split_head_slices", "after the split, head h holds features h*Dh..(h+1)*Dh of every position"),
        CheckSpec(2, "merge_head_slices", "after the merge, each head's values are back in their own feature slice"),
    ), _P),
    _projected("q", "[B,Nh,Tq,Dh]", "queries after projection and head split"),
    _projected("k", "[B,Nkv,Tk,Dh]", "keys after projection and head split",
               CheckSpec(2, "kv_head_pairing", "with kv heads labelled by index, query head h reads kv head h // (Nh / Nkv)")),
    _projected("v", "[B,Nkv,Tk,Dv]", "values after projection and head split"),
    StageSpec("rope", "[B,Nh,Tq,Dh]", "q and k rotated by rotary positions (query i at i + Tk - Tq), v untouched", (
        _shape("q, k and v keep their shapes"),
        CheckSpec(2, "rotary_positions", "rotations recognised on q, k and v at their known positions: q and k "
                  "rotated alike, at the same offset, v never", "not applicable with one position, 0"),
        CheckSpec(2, "relative_positions", "one q and one k vector repeated along the sequence: their scores depend only "
                  "on the offset i - j"),
        CheckSpec(3, "norms_preserved", "every q and k vector keeps its length"),
        CheckSpec(4, "matches_reference", "rotated q, k (and the untouched v) agree with the float64 rotation"),
    ), needs=ROPE),
    StageSpec("scores", "[B,Nh,Tq,Tk]", "scaled scores q k^T / sqrt(Dh), before masking", (
        _blocks("Tk"), FINITE,
        CheckSpec(3, "exp_headroom", "largest |score| of an allowed pair stays below log(dtype max), where exp "
                  "overflows without max-subtraction", "a warning, never a finding"),
        _VS_REF,
        *_user("scores", "have the score grid's shape", (
            (4, "matches_reference", "the given scores agree with the float64 reference"),), plural=True),
    )),
    StageSpec("masked_scores", "[B,Nh,Tq,Tk]", "scores with forbidden pairs excluded (-inf)", (
        _blocks("Tk"),
        CheckSpec(3, "finite", "no NaN and no +inf (-inf marks an excluded key)"),
        CheckSpec(3, "no_fully_blocked_query", "no query has every key blocked, beyond rows declared empty "
                  "(empty_rows = zeros)"),
        CheckSpec(3, "forbidden_excluded", "every forbidden (query, key) score is excluded",
                  "not applicable without a mask relation"),
        CheckSpec(3, "allowed_kept", "no allowed (query, key) score is excluded", "with a mask relation"),
    )),
    StageSpec("weights", "[B,Nh,Tq,Tk]", "softmax over keys", (
        _blocks("Tk"), FINITE,
        CheckSpec(3, "key_row_sums", "each query's weights sum to 1 over keys (with sinks, over the keys and the "
                  "sink's share, computed from the pipeline's own masked scores)"),
        CheckSpec(3, "forbidden_weight", "the largest weight on a forbidden key is 0 (within the row-sum tolerance)"),
        CheckSpec(3, "empty_rows_zero", "rows declared empty hold only zeros", "empty_rows = zeros with such rows"),
        CheckSpec(4, "sink_share", "the weights over the keys sum to 1 minus the float64 reference's sink share "
                  "(within the row-sum tolerance)", "with --sinks"),
        _VS_REF,
        *_user("weights", "have the score grid's shape", (
            (3, "finite", "the given weights: no NaN or infinity"),
            (3, "key_row_sums", "the given weights sum to 1 over keys"),
            (3, "forbidden_weight", "the given weights put nothing on a forbidden key"),
            (4, "matches_reference", "the given weights agree with the float64 reference")), plural=True),
    )),
    StageSpec("context", "[B,Nh,Tq,Dv]", "weights @ v", (
        _blocks("Dv"), FINITE,
        CheckSpec(3, "in_value_range", "each row lies inside the per-coordinate range of the value rows it mixes"),
        _VS_REF,
        CheckSpec(4, "matches_sdpa", "agrees with F.scaled_dot_product_attention on the same q, k, v, scale and "
                  "mask (in its polarity, dropout off)"),
        CheckSpec(4, "sdpa[BACKEND,DTYPE]", "the same comparison with one SDPA backend pinned, in one dtype",
                  "--backends"),
        *_user("out", "has the context's shape", (
            (3, "finite", "the given out: no NaN or infinity"),
            (3, "in_value_range", "the given out lies inside the range of the value rows it may mix"),
            (4, "matches_reference", "the given out agrees with the float64 reference"))),
        CheckSpec(4, "user_out_matches_sdpa", "the given out agrees with F.scaled_dot_product_attention",
                  "--tensors with out, float32 or float64", _T),
        CheckSpec(4, "replay_bitwise", "a second run of the forward gives the same bits", "--tensors with --replay", _T),
    )),
    StageSpec("merged", "[B,Tq,Nh*Dv]", "heads merged back", (
        _derived("[B, Tq, Nh*Dv]"),
        CheckSpec(2, "merge_head_slices", "head h's context lands in features h*Dv..(h+1)*Dv"),
        _VS_REF_CHAIN,
    ), _P),
    StageSpec("output", "[B,Tq,E]", "the output projection", (
        CheckSpec(1, "external_layout", "the output keeps the external [B, Tq, E] layout"),
        FINITE, _VS_REF_CHAIN,
        CheckSpec(4, "matches_sdpa", "agrees with a forward built on F.scaled_dot_product_attention"),
        CheckSpec(4, "replay_bitwise", "a second run of the whole forward gives the same bits", "--replay"),
    ), _P),
    StageSpec("properties", "probe", "boundary properties on a probe: the first examples, heads and positions", (
        CheckSpec(3, "single_token", "the first query and key alone: weight 1, context = its value"),
        CheckSpec(3, "single_token_zero_grad", "autograd of the forward on one key gives zero query and key gradients",
                  "--grad"),
        CheckSpec(3, "equal_keys_uniform", "every key set equal: each row uniform over its allowed keys"),
        CheckSpec(4, "permutation_equivariant", "queries and keys reversed with the relation: the context rows reversed"),
        CheckSpec(4, "batch_independent", "each example alone gives its rows of the batch", "not applicable with B = 1"),
        CheckSpec(1, "empty_batch", "the batch sliced to 0 runs and keeps the derived shape"),
    )),
    StageSpec("grad_context", "[B,Nh,Tq,Dv]", "O-bar: the seed, back through the output projection and merge", (
        _derived("[B, Nh, Tq, Dv]"), FINITE,
        CheckSpec(4, "matches_reference", _VS_GRAD, modes=_P),
        CheckSpec(1, "user_grad_out_shape", "the saved grad_out has the context's shape (else the seed is ones)",
                  "--tensors with grad_out", _T),
    ), needs=GRAD),
    StageSpec("grad_weights", "[B,Nh,Tq,Tk]", "A-bar = O-bar V^T, block by block", (_blocks("Tk"), FINITE, _VS_GRAD_REF),
              needs=GRAD),
    StageSpec("grad_values", "[B,Nkv,Tk,Dv]", "V-bar = A^T O-bar, summed over query blocks and the heads of a kv head", (
        _key_parts("Dv"), FINITE, _blocked_keys("V-bar"), _VS_GRAD_REF, _VS_SDPA_GRAD_ROWS, _GRADCHECK_SPEC,
        *_user_grad("dv", "v"),
    ), needs=GRAD),
    StageSpec("grad_scores", "[B,Nh,Tq,Tk]", "S-bar, the softmax backward, block by block", (
        _blocks("Tk"), FINITE,
        CheckSpec(3, "softmax_row_rule", "per query row, S-bar = A * (A-bar - rowsum(A * A-bar)) from the same A and A-bar"),
        _VS_GRAD_REF,
    ), needs=GRAD),
    StageSpec("grad_q", "[B,Nh,Tq,Dh]", "Q-bar = scale S-bar K (turned back through the rotation with rope)", (
        _blocks("Dh"), FINITE, _VS_GRAD_REF, _VS_SDPA_GRAD_ROWS, _GRADCHECK_SPEC, *_user_grad("dq", "q"),
    ), needs=GRAD),
    StageSpec("grad_k", "[B,Nkv,Tk,Dh]", "K-bar = scale S-bar^T Q, summed over query blocks and the heads of a kv head", (
        _key_parts("Dh"), FINITE, _blocked_keys("K-bar"),
        CheckSpec(3, "key_sum_zero", "K-bar summed over keys is zero (every row of S-bar sums to zero)"),
        _VS_GRAD_REF, _VS_SDPA_GRAD_ROWS, _GRADCHECK_SPEC,
        CheckSpec(4, "replay_bitwise", "a second run of the backward gives the same Q-bar, K-bar and V-bar bits",
                  "--replay"),
        *_user_grad("dk", "k"),
    ), needs=GRAD),
    StageSpec("grad_sinks", "[Nh]", "the sinks' gradient, -sum over examples and rows of share * rowsum(A * A-bar)", (
        _derived("[Nh]"), FINITE,
        CheckSpec(4, "matches_reference", "agrees with float64 autograd of the reference with sinks on its sampled rows "
                  "(the part those rows contribute)"),
    ), needs=SINK_GRAD),
    StageSpec("grad_projections", "[out,in] Wq,Wk,Wv,Wo", "the projection weights' gradients", (
        _shape("each weight's gradient has the weight's shape"), FINITE, *_vs_chain("a forward"),
    ), _P, needs=GRAD),
    StageSpec("grad_input", "[B,Tq,E]", "x-bar (and x_kv-bar for cross-attention) through the projections", (
        _shape("the input's shape"), FINITE, *_vs_chain("a forward"),
    ), _P, needs=GRAD),
)


def stage_names(mode: str = PIPELINE, *, rope: bool = False, grad: bool = False,
                sinks: bool = False) -> tuple[str, ...]:
    """The ledger's rows, in order, for the built-in pipeline or for saved tensors (``rope``, ``grad``, ``sinks``:
    with those on)."""
    on = {"": True, ROPE: rope, GRAD: grad, SINK_GRAD: grad and sinks}
    return tuple(s.name for s in STAGES if mode in s.modes and on[s.needs])


def axes(mode: str = PIPELINE) -> dict[str, str]:
    """Every stage's axes as its row shows them, for the built-in pipeline or for saved tensors."""
    return {s.name: s.axes_in(mode) for s in STAGES}


def find(stage: str, name: str) -> CheckSpec | None:
    """The entry for a check the ledger reported at ``stage``, or None if the list does not have it."""
    for spec in STAGES:
        if spec.name == stage:
            for c in (*spec.checks, *ANY_STAGE):
                if c.matches(name):
                    return c
    return None


def markdown_table(mode: str = PIPELINE) -> str:
    """The stage table of ``docs/run.md``: one line per check, grouped by stage, for one mode."""
    if mode not in (PIPELINE, TENSORS):
        raise ValueError(f"mode: got {mode!r}, expected {PIPELINE!r} or {TENSORS!r}")
    lines = ["| stage | axes | level | check | passes when | appears |", "| --- | --- | --- | --- | --- | --- |"]
    for spec in STAGES:
        if mode not in spec.modes:
            continue
        checks = [c for c in spec.checks if mode in c.modes]
        head = f"| `{spec.name}` | `{spec.axes_in(mode)}` "
        if not checks:
            lines.append(head + f"| | | {spec.holds}: validated before anything runs (bad input is exit 2, not a row) | |")
            continue
        for i, c in enumerate(checks):
            lead = head if i == 0 else "| | "
            appears = "; ".join(part for part in (NEEDS_WORDS[spec.needs], c.when) if part) or "always"
            lines.append(f"{lead}| L{c.level} {LEVEL_NAMES[c.level]} | `{c.name}` | {_cell(c.meaning)} | {_cell(appears)} |")
    for c in ANY_STAGE:
        lines.append(f"| any computed stage | | L{c.level} {LEVEL_NAMES[c.level]} | `{c.name}` | {_cell(c.meaning)} | {_cell(c.when)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
