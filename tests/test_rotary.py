"""Rotary positions: application against textbook forms, recognition, and the q/k/v judgement.

The references here are written apart from ``attn_ledger.maths.rotary`` on purpose: a per-pair
2x2 rotation with ``math.cos``/``math.sin``, Llama's ``rotate_half`` form, and Meta's
complex-multiplication form. Every recognition result is checked by its fields.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_ledger.errors import InputError
from attn_ledger.maths.rotary import (
    FINDINGS,
    RotarySpec,
    apply_rotary,
    compare_positions,
    inverse_frequencies,
    pair_indices,
    recognise_rotary,
)

# --- independent references ---------------------------------------------------------------


def textbook_rotary(x: torch.Tensor, pairing: str, base: float, rotated: int, positions: list[int]) -> torch.Tensor:
    """Pair by pair, position by position, a 2x2 rotation by p * base^(-2j/rotated), in float64."""
    out = x.to(torch.float64).clone()
    half = rotated // 2
    for t, p in enumerate(positions):
        for j in range(half):
            a_i, b_i = (j, j + half) if pairing == "half" else (2 * j, 2 * j + 1)
            theta = p * base ** (-2.0 * j / rotated)
            a, b = x[..., t, a_i].double(), x[..., t, b_i].double()
            out[..., t, a_i] = a * math.cos(theta) - b * math.sin(theta)
            out[..., t, b_i] = a * math.sin(theta) + b * math.cos(theta)
    return out


def llama_rotate_half(x: torch.Tensor, base: float, positions: torch.Tensor, angle_dtype=torch.float64) -> torch.Tensor:
    """Llama/GPT-NeoX: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=angle_dtype) / d))  # [Dh/2]
    freqs = positions.to(angle_dtype)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated_half = torch.cat((-x2, x1), dim=-1)  # [..., T, Dh]
    return x * cos + rotated_half * sin


def meta_complex(x: torch.Tensor, base: float, positions: torch.Tensor, angle_dtype=torch.float64) -> torch.Tensor:
    """Meta's original Llama: adjacent features as one complex number, times exp(i * angle)."""
    d = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=angle_dtype)[: d // 2] / d))  # [Dh/2]
    angles = torch.outer(positions.to(angle_dtype), freqs)  # [T, Dh/2]
    cis = torch.polar(torch.ones_like(angles), angles)  # [T, Dh/2] complex
    xc = torch.view_as_complex(x.to(angle_dtype).reshape(*x.shape[:-1], d // 2, 2))  # [..., T, Dh/2]
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


def gen(seed: int, shape=(2, 3, 12, 16), dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --- the spec -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,needle", [
    ({"pairing": "spiral"}, "rope.pairing: got 'spiral', expected 'half' or 'interleaved'"),
    ({"base": 1.0}, "rope.base: got 1.0, expected a finite number > 1"),
    ({"base": float("inf")}, "rope.base: got inf"),
    ({"base": "10000"}, "rope.base: got '10000'"),
    ({"rotated_dim": 7}, "rope.rotated_dim: got 7, expected an even integer >= 2"),
    ({"rotated_dim": 0}, "rope.rotated_dim: got 0"),
], ids=["pairing", "base-one", "base-inf", "base-str", "width-odd", "width-zero"])
def test_spec_rejects_bad_fields_in_one_line(kwargs, needle):
    with pytest.raises(InputError) as err:
        RotarySpec(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_spec_defaults_and_width():
    spec = RotarySpec()
    assert (spec.pairing, spec.base, spec.rotated_dim) == ("half", 10000.0, None)
    assert spec.width(64) == 64 and spec.width(7) == 6
    assert RotarySpec(rotated_dim=16).width(64) == 16
    assert RotarySpec(base=500000) == RotarySpec(base=500000.0)
    with pytest.raises(InputError, match="rope.rotated_dim: got 80, expected an even integer from 2 to the head width 64"):
        RotarySpec(rotated_dim=80).width(64)


def test_inverse_frequencies_and_pairs():
    f = inverse_frequencies(10000.0, 8)
    assert f.dtype == torch.float64
    assert f.tolist() == pytest.approx([1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75], rel=1e-15)
    assert [t.tolist() for t in pair_indices("half", 8)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [t.tolist() for t in pair_indices("interleaved", 8)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


# --- applying -------------------------------------------------------------------------------

APPLY_CASES = [
    ("half", 10000.0, None, 0), ("interleaved", 10000.0, None, 0), ("half", 500000.0, None, 5),
    ("interleaved", 1000.0, None, -3), ("half", 10000.0, 8, 2), ("interleaved", 10000.0, 6, 11),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("pairing,base,rd,offset", APPLY_CASES,
                         ids=[f"{p}-{b:g}-{r}-{o}" for p, b, r, o in APPLY_CASES])
def test_apply_matches_the_textbook_rotation(pairing, base, rd, offset, dtype):
    x = gen(1, dtype=dtype)  # [B, Nh, T, Dh]
    spec = RotarySpec(pairing, base, rd)
    got = apply_rotary(x, spec, offset=offset)
    assert got.dtype == dtype and got.shape == x.shape
    want = textbook_rotary(x, pairing, base, spec.width(16), [offset + t for t in range(12)]).to(dtype)
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    else:
        torch.testing.assert_close(got, want)  # one rounding from float64 each side
    width = spec.width(16)
    assert torch.equal(got[..., width:], x[..., width:])  # features past the rotated width pass through
    # the same check fails for the other pairing and for a shifted position
    other = "interleaved" if pairing == "half" else "half"
    wrong = textbook_rotary(x, other, base, width, [offset + t for t in range(12)]).to(dtype)
    assert float((got - wrong).abs().max()) > 0.1
    shifted = textbook_rotary(x, pairing, base, width, [offset + 1 + t for t in range(12)]).to(dtype)
    assert float((got - shifted).abs().max()) > 0.1


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_half_pairing_is_llamas_rotate_half_and_interleaved_is_complex_multiplication(base):
    x = gen(2, shape=(2, 4, 9, 32))
    pos = torch.arange(3, 12)
    torch.testing.assert_close(apply_rotary(x, RotarySpec("half", base), offset=3),
                               llama_rotate_half(x, base, pos), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(apply_rotary(x, RotarySpec("interleaved", base), positions=pos),
                               meta_complex(x, base, pos), rtol=1e-13, atol=1e-13)
    # and the two layouts are not interchangeable
    assert float((llama_rotate_half(x, base, pos) - meta_complex(x, base, pos)).abs().max()) > 0.1


def test_positions_tensor_broadcasts_per_example_and_equals_offset():
    x = gen(3, shape=(2, 3, 5, 8))
    spec = RotarySpec("interleaved")
    per_row = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])[:, None, :]  # [B, 1, T]
    got = apply_rotary(x, spec, positions=per_row)
    torch.testing.assert_close(got[0], apply_rotary(x[0], spec, offset=0), rtol=0, atol=0)
    torch.testing.assert_close(got[1], apply_rotary(x[1], spec, offset=7), rtol=0, atol=0)
    assert not torch.allclose(got[1], apply_rotary(x[1], spec, offset=0))


def test_rotation_preserves_norms_and_scores_depend_only_on_the_distance():
    q, k = gen(4, shape=(1, 2, 6, 16)), gen(5, shape=(1, 2, 6, 16))
    spec = RotarySpec("half", 10000.0)
    torch.testing.assert_close(apply_rotary(q, spec, offset=9).norm(dim=-1), q.norm(dim=-1), rtol=1e-13, atol=0)
    s0 = apply_rotary(q, spec) @ apply_rotary(k, spec).transpose(-2, -1)  # [B, Nh, Tq, Tk]
    s7 = apply_rotary(q, spec, offset=7) @ apply_rotary(k, spec, offset=7).transpose(-2, -1)
    torch.testing.assert_close(s7, s0, rtol=1e-12, atol=1e-12)
    s_off = apply_rotary(q, spec, offset=1) @ apply_rotary(k, spec).transpose(-2, -1)
    assert float((s_off - s0).abs().max()) > 0.1  # q shifted relative to k changes the scores


@pytest.mark.parametrize("call,needle", [
    (lambda x: apply_rotary(x.long(), RotarySpec()), "x: got Tensor torch.int64 shape (2, 3, 12, 16)"),
    (lambda x: apply_rotary(x, RotarySpec(rotated_dim=20)), "rope.rotated_dim: got 20"),
    (lambda x: apply_rotary(x, RotarySpec(), positions=torch.arange(12.0)), "positions: got Tensor torch.float32"),
    (lambda x: apply_rotary(x, RotarySpec(), positions=torch.arange(5)), "positions: got shape (5,), expected a shape broadcastable to (2, 3, 12)"),
    (lambda x: apply_rotary(x, RotarySpec(), offset=2, positions=torch.arange(12)), "offset: got 2, expected 0"),
    (lambda x: apply_rotary(x, RotarySpec(), offset=1.5), "offset: got 1.5, expected an integer"),
], ids=["int-x", "too-wide", "float-positions", "positions-shape", "offset-and-positions", "float-offset"])
def test_apply_rejects_bad_input_in_one_line(call, needle):
    with pytest.raises(InputError) as err:
        call(gen(0))
    assert needle in str(err.value) and "\n" not in str(err.value)


# --- recognition ----------------------------------------------------------------------------

RECOGNISE_CASES = [
    # pairing, base, rotated_dim (None: all of Dh), offset, dtype, shape [B, Nh, T, Dh]
    ("half", 10000.0, None, 0, torch.float32, (2, 4, 16, 64)),
    ("interleaved", 10000.0, None, 0, torch.float32, (2, 4, 16, 64)),
    ("half", 500000.0, None, 0, torch.float64, (1, 8, 32, 128)),
    ("interleaved", 500000.0, None, 4, torch.float32, (2, 4, 32, 64)),
    ("half", 1000.0, None, -6, torch.float32, (1, 2, 10, 32)),
    ("interleaved", 1000.0, None, 13, torch.float64, (1, 2, 10, 32)),
    ("half", 10000.0, 16, 0, torch.float32, (2, 4, 16, 64)),       # GPT-NeoX-like partial rotary
    ("interleaved", 10000.0, 32, 3, torch.float32, (1, 4, 16, 128)),  # GPT-J-like partial rotary
    ("half", 10000.0, 24, 1, torch.float64, (1, 2, 8, 48)),
    ("half", 10000.0, None, 3000, torch.float32, (1, 4, 12, 64)),    # a long prefix before these rows
    ("interleaved", 10000.0, None, -40, torch.float32, (1, 1, 48, 16)),
    ("half", 10000.0, None, 2, torch.float32, (1, 1, 6, 8)),       # a single vector per position
]


@pytest.mark.parametrize("pairing,base,rd,offset,dtype,shape", RECOGNISE_CASES,
                         ids=[f"{p}-{b:g}-{r or 'all'}-o{o}-{str(d)[6:]}-{'x'.join(map(str, s))}"
                              for p, b, r, o, d, s in RECOGNISE_CASES])
def test_recognition_recovers_pairing_base_width_and_offset(pairing, base, rd, offset, dtype, shape):
    x = gen(10 + shape[-1], shape=shape, dtype=dtype)
    y = apply_rotary(x, RotarySpec(pairing, base, rd), offset=offset)
    obs = recognise_rotary(x, y)
    assert obs.kind == "rotary" and obs.rotated
    assert obs.spec == RotarySpec(pairing, base, rd or shape[-1])  # base rounded to the value that fits
    assert obs.offset == offset
    assert obs.base_fitted == pytest.approx(base, rel=1e-3)
    assert obs.residual <= obs.tolerance
    # the data may not tell an interleaved width from a narrower one whose extra pairs never turn
    # visibly (500000 over 32 positions in float32): then the narrower is listed, never chosen
    assert all(a.pairing == "interleaved" == pairing and a.width(shape[-1]) < obs.spec.width(shape[-1])
               for a in obs.alternatives)
    assert obs.alternatives == () or (base, dtype) == (500000.0, torch.float32)
    assert obs.norm_preserved and obs.position_dependent is True
    assert obs.positions == shape[2] and obs.head_dim == shape[-1]


@pytest.mark.parametrize("seed", range(12))
def test_recognition_tells_half_from_interleaved_on_small_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    dh = (8, 16, 32, 64)[seed % 4]
    for pairing in ("half", "interleaved"):
        x = torch.randn(1, 1 + seed % 3, 4 + seed, dh, generator=g)
        offset = int(torch.randint(-50, 50, (), generator=g))
        obs = recognise_rotary(x, apply_rotary(x, RotarySpec(pairing), offset=offset))
        assert (obs.kind, obs.spec.pairing, obs.offset, obs.spec.width(dh)) == ("rotary", pairing, offset, dh)


def test_recognition_uses_the_known_positions():
    x = gen(20, shape=(1, 2, 9, 32))
    pos = torch.tensor([10, 11, 12, 14, 15, 17, 18, 19, 22])  # gaps of up to 3
    y = apply_rotary(x, RotarySpec("interleaved", 10000.0), positions=pos + 5)
    obs = recognise_rotary(x, y, positions=pos)
    assert (obs.kind, obs.offset, obs.spec.pairing) == ("rotary", 5, "interleaved")
    assert recognise_rotary(x, y, positions=10).offset != 5  # wrong known positions: another story
    start = recognise_rotary(x[..., :3, :], y[..., :3, :], positions=10)  # the first rows are consecutive
    assert (start.kind, start.offset) == ("rotary", 5)


def test_llama_style_float32_module_arithmetic_is_recognised():
    """Angles computed in float32, as Llama code does, at positions up to 2100: within the tolerance."""
    x = gen(21, shape=(2, 4, 64, 64), dtype=torch.float32)
    pos = torch.arange(2036, 2100)
    y = llama_rotate_half(x, 10000.0, pos, angle_dtype=torch.float32)
    obs = recognise_rotary(x, y, positions=0)
    assert (obs.kind, obs.spec, obs.offset) == ("rotary", RotarySpec("half", 10000.0, 64), 2036)
    z = meta_complex(x, 500000.0, pos, angle_dtype=torch.float32)
    obs = recognise_rotary(x, z, positions=pos)
    assert (obs.kind, obs.spec, obs.offset) == ("rotary", RotarySpec("interleaved", 500000.0, 64), 0)
    # float64 tensors whose frequencies were made in float32 (a float32 buffer cast up)
    x64 = x.double()
    y64 = llama_rotate_half(x64, 10000.0, torch.arange(64), angle_dtype=torch.float32).double()
    assert recognise_rotary(x64, y64).spec == RotarySpec("half", 10000.0, 64)


def test_bfloat16_rotation_is_recognised():
    x = gen(22, shape=(2, 4, 16, 64), dtype=torch.bfloat16)
    obs = recognise_rotary(x, apply_rotary(x, RotarySpec("interleaved", 10000.0), offset=2))
    assert (obs.kind, obs.spec.pairing, obs.offset) == ("rotary", "interleaved", 2)
    assert obs.spec.base == pytest.approx(10000.0, rel=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_no_rotation_is_recognised_and_a_real_change_is_not_called_none(dtype):
    x = gen(23, dtype=dtype)
    same = recognise_rotary(x, x.clone())
    assert (same.kind, same.spec, same.offset, same.max_change) == ("none", None, None, 0.0)
    assert same.position_dependent is False and same.changed_positions == 0
    eps = torch.finfo(dtype).eps
    nudged = recognise_rotary(x, x * (1 + 4 * eps))  # rounding-level differences
    assert nudged.kind == "none" and nudged.max_change <= nudged.tolerance
    changed = recognise_rotary(x, x + 1e-2 * gen(24, dtype=dtype))
    assert changed.kind == "unrecognised" and changed.max_change > changed.tolerance
    # rotary at position 0 only is the identity: nothing to see
    assert recognise_rotary(x[..., :1, :], apply_rotary(x[..., :1, :], RotarySpec())).kind == "none"


def _orthogonal(seed: int, n: int, d: int) -> torch.Tensor:
    m = gen(seed, shape=(n, d, d))
    return torch.linalg.qr(m).Q  # [n, Dh, Dh]


UNRECOGNISED_CASES = {
    # name: (transform of x [B, Nh, T, Dh] -> y, norm preserved, position dependent)
    "added-position-vector": (lambda x: x + 0.5 * gen(30, shape=(1, 1, 12, 16)), False, True),
    "orthogonal-mix-per-position": (lambda x: torch.einsum("bhtd,tde->bhte", x, _orthogonal(31, 12, 16)), True, True),
    "one-orthogonal-mix": (lambda x: x @ _orthogonal(32, 1, 16)[0], True, False),
    "scaled": (lambda x: 1.5 * x, False, False),
    "rotary-with-linear-frequencies": (
        lambda x: _rotate_with_frequencies(x, torch.linspace(1.0, 0.1, 8, dtype=torch.float64)), True, True),
    "rotation-in-the-opposite-sense": (
        lambda x: apply_rotary(x, RotarySpec(), positions=-torch.arange(12)), True, True),
    "rotary-then-scaled-by-position": (
        lambda x: apply_rotary(x, RotarySpec()) * (1 + 0.1 * torch.arange(12.0, dtype=x.dtype))[:, None], False, True),
}


def _rotate_with_frequencies(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Half-split pairs turned at frequencies that do not follow base ** (-2j / d)."""
    angle = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * freqs  # [T, P]
    a, b = x[..., :8], x[..., 8:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


@pytest.mark.parametrize("name", list(UNRECOGNISED_CASES))
def test_a_change_that_is_not_rotary_is_reported_unrecognised_with_what_was_seen(name):
    transform, norm_preserved, position_dependent = UNRECOGNISED_CASES[name]
    x = gen(33, shape=(4, 8, 12, 16))
    obs = recognise_rotary(x, transform(x))
    assert (obs.kind, obs.spec, obs.offset) == ("unrecognised", None, None)
    assert obs.norm_preserved is norm_preserved
    assert (obs.norm_change <= obs.tolerance) is norm_preserved
    assert obs.position_dependent is position_dependent
    assert obs.max_change > obs.tolerance and obs.changed_positions >= 11
    assert not obs.residual <= obs.tolerance  # the closest rotary fit (or none at all) misses


def test_unrecognised_limits_are_reported_not_guessed():
    x = gen(34, shape=(2, 2, 12, 16))
    one_row = recognise_rotary(x[..., :1, :], apply_rotary(x[..., :1, :], RotarySpec(), offset=5))
    assert one_row.kind == "unrecognised" and one_row.positions == 1 and math.isnan(one_row.residual)
    assert one_row.position_dependent is None
    bad = x.clone()
    bad[0, 0, 3, 2] = float("nan")
    obs = recognise_rotary(bad, apply_rotary(x, RotarySpec()))
    assert (obs.kind, obs.nonfinite) == ("unrecognised", 1)
    far = recognise_rotary(x, apply_rotary(x, RotarySpec(), offset=300), max_offset=100)
    assert far.kind == "unrecognised"
    assert recognise_rotary(x, apply_rotary(x, RotarySpec(), offset=300), max_offset=300).offset == 300


def test_an_invisible_tail_makes_the_interleaved_width_ambiguous_and_says_so():
    """With a huge base and few positions in float32, the last pairs never turn visibly."""
    x = gen(35, shape=(2, 4, 4, 32), dtype=torch.float32)
    y = apply_rotary(x, RotarySpec("interleaved", 1e9), offset=0)
    obs = recognise_rotary(x, y)
    assert (obs.kind, obs.spec.pairing, obs.spec.width(32)) == ("rotary", "interleaved", 32)
    assert len(obs.alternatives) == 1
    narrow = obs.alternatives[0]
    assert narrow.pairing == "interleaved" and narrow.width(32) < 32
    for spec in (obs.spec, narrow):  # both explain y within tolerance
        err = float((apply_rotary(x.double(), spec) - y.double()).abs().max()) / float(x.abs().max())
        assert err <= obs.tolerance
    # with base 10000 the last pair turns visibly and the width is not ambiguous
    obs = recognise_rotary(x, apply_rotary(x, RotarySpec("interleaved", 10000.0)))
    assert (obs.spec, obs.alternatives) == (RotarySpec("interleaved", 10000.0, 32), ())


def test_one_rotated_pair_fits_both_pairings_and_lists_the_other():
    x = gen(36, shape=(1, 2, 8, 16))
    obs = recognise_rotary(x, apply_rotary(x, RotarySpec("interleaved", 10000.0, 2), offset=1))
    assert (obs.kind, obs.spec.width(16), obs.offset) == ("rotary", 2, 1)
    assert {obs.spec.pairing, *(a.pairing for a in obs.alternatives)} == {"half", "interleaved"}


@pytest.mark.parametrize("call,needle", [
    (lambda x: recognise_rotary(x, x[..., :5, :]), "y: got shape (2, 3, 5, 16), expected the shape of x (2, 3, 12, 16)"),
    (lambda x: recognise_rotary(x.long(), x), "x: got Tensor torch.int64"),
    (lambda x: recognise_rotary(x, x, positions=torch.arange(0, 48, 4)), "positions: got [0, 4, 8"),
    (lambda x: recognise_rotary(x, x, positions=torch.arange(12).flip(0)), "strictly increasing"),
    (lambda x: recognise_rotary(x, x, positions=torch.arange(3)), "positions: got Tensor torch.int64 shape (3,)"),
    (lambda x: recognise_rotary(x, x, max_offset=-1), "max_offset: got -1"),
], ids=["shape", "int-x", "big-steps", "decreasing", "positions-length", "max-offset"])
def test_recognition_rejects_bad_input_in_one_line(call, needle):
    with pytest.raises(InputError) as err:
        call(gen(0))
    assert needle in str(err.value) and "\n" not in str(err.value)


# --- q, k and v together ----------------------------------------------------------------------


def _observe(x: torch.Tensor, spec: RotarySpec | None, offset: int = 0):
    y = x.clone() if spec is None else apply_rotary(x, spec, offset=offset)
    return recognise_rotary(x, y)


@pytest.fixture(scope="module")
def qkv():
    return gen(40, shape=(1, 4, 10, 16)), gen(41, shape=(1, 2, 10, 16)), gen(42, shape=(1, 2, 10, 16))


HALF, INTER = RotarySpec("half"), RotarySpec("interleaved")
COMPARE_CASES = {
    # name: (q spec, q offset, k spec, k offset, v spec, status, findings, offset_between)
    "consistent-half": (HALF, 0, HALF, 0, None, "pass", (), 0),
    "consistent-interleaved": (INTER, 0, INTER, 0, None, "pass", (), 0),
    "consistent-shifted-both": (HALF, 7, HALF, 7, None, "pass", (), 0),
    "no-rotation": (None, 0, None, 0, None, "pass", (), None),
    "q-one-ahead": (HALF, 1, HALF, 0, None, "fail", ("qk_offset",), 1),
    "k-restarted": (INTER, 5, INTER, 0, None, "fail", ("qk_offset",), 5),
    "only-q": (HALF, 0, None, 0, None, "fail", ("only_q_rotated",), None),
    "only-k": (None, 0, INTER, 0, None, "fail", ("only_k_rotated",), None),
    "v-rotated": (HALF, 0, HALF, 0, HALF, "fail", ("v_rotated",), 0),
    "pairings-differ": (HALF, 0, INTER, 0, None, "fail", ("qk_spec",), 0),
    "bases-differ": (HALF, 0, RotarySpec("half", 500000.0), 0, None, "fail", ("qk_spec",), 0),
}


@pytest.mark.parametrize("name", list(COMPARE_CASES))
def test_compare_positions(name, qkv):
    qs, qo, ks, ko, vs, status, findings, between = COMPARE_CASES[name]
    q, k, v = qkv
    got = compare_positions(_observe(q, qs, qo), _observe(k, ks, ko), _observe(v, vs))
    assert (got.status, got.findings, got.offset_between) == (status, findings, between)
    assert set(got.findings) <= set(FINDINGS)
    shared = qs is not None and qs == ks and qo == ko  # the spec q and k share, whatever v does
    assert got.spec == (RotarySpec(qs.pairing, qs.base, 16) if shared else None)


def test_compare_positions_is_inconclusive_on_an_unrecognised_change_but_still_fails_a_finding(qkv):
    q, k, v = qkv
    odd = recognise_rotary(k, k * (1 + 0.1 * torch.arange(10.0, dtype=k.dtype))[:, None])
    assert odd.kind == "unrecognised"
    got = compare_positions(_observe(q, HALF), odd)
    assert (got.status, got.findings) == ("inconclusive", ())
    got = compare_positions(_observe(q, HALF), odd, _observe(v, HALF))
    assert (got.status, got.findings) == ("fail", ("v_rotated",))


def test_compare_positions_accepts_an_ambiguous_width_as_the_same_spec():
    """q's narrowest-width alternative explains k's rotation: the same rotary, not a mismatch."""
    x = gen(43, shape=(2, 4, 4, 32), dtype=torch.float32)
    spec = RotarySpec("interleaved", 1e9)
    q_obs = recognise_rotary(x, apply_rotary(x, spec))
    assert q_obs.alternatives
    narrow = q_obs.alternatives[0]
    k_obs = recognise_rotary(x, apply_rotary(x, narrow))
    got = compare_positions(q_obs, k_obs)
    assert (got.status, got.findings) == ("pass", ())


def test_descriptions_are_one_line_and_carry_the_fields(qkv):
    q, k, _ = qkv
    rotary, none = _observe(q, HALF, 5), _observe(k, None)
    odd = recognise_rotary(k, k + 0.5)
    lines = [rotary.describe(), none.describe(), odd.describe(),
             compare_positions(rotary, _observe(k, HALF)).describe(), compare_positions(none, none).describe(),
             compare_positions(_observe(q, HALF, 5), _observe(k, HALF, 5)).describe()]
    assert all(isinstance(s, str) and s and "\n" not in s for s in lines)
    assert "offset +5" in lines[0] and "+5 positions apart" in lines[3]
