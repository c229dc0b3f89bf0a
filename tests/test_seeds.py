"""Seeds: 0..2**63-1 everywhere, and every bit of a seed changes the inputs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger import seeding
from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.errors import ConfigError
from attn_ledger.probes.kernel.check import case_inputs
from attn_ledger.maths.pipeline import make_input, make_weights

runner = CliRunner()
TOP = 2**63 - 1


def one_line_exit_2(r) -> str:
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in r.output, err
    return err


def test_small_seeds_seed_the_generator_as_manual_seed_does():
    for s in (0, 1, 12345, 2**32 - 1):
        a = torch.randn(5, generator=seeding.generator(s))
        b = torch.randn(5, generator=torch.Generator().manual_seed(s))
        assert torch.equal(a, b), s


@pytest.mark.parametrize("s", [0, 7, 2**31 + 5, 2**40, 2**62])
def test_seeds_apart_by_2_to_the_32_give_different_numbers(s):
    a = torch.randn(8, generator=seeding.generator(s))
    b = torch.randn(8, generator=seeding.generator(s + 2**32))
    assert not torch.equal(a, b)
    assert torch.equal(a, torch.randn(8, generator=seeding.generator(s)))  # and each is repeatable


def test_a_large_seed_fills_the_whole_mt19937_state_from_init_by_array():
    # torch draws 64 bits (two MT19937 outputs) per int64 value and keeps the second of them
    value = 2**40 + 3
    got = torch.empty(6, dtype=torch.int64).random_(0, 2**31, generator=seeding.generator(value)).tolist()
    mt = random.Random(value)  # Python seeds MT19937 from every bit of an integer
    words = [mt.getrandbits(32) for _ in range(12)]
    assert got == [w % 2**31 for w in words[1::2]]


def test_manual_seed_sets_the_global_generator_from_every_bit():
    seeding.manual_seed(5 + 2**32)
    a = torch.randn(4)
    seeding.manual_seed(5)
    b = torch.randn(4)
    seeding.manual_seed(5 + 2**32)
    assert not torch.equal(a, b) and torch.equal(a, torch.randn(4))


def test_run_inputs_and_weights_differ_for_seeds_2_to_the_32_apart():
    for s in (3, 2**62):
        x1, x2 = (make_input(2, 5, 12, "random", seed, torch.float32) for seed in (s, s + 2**32))
        w1, w2 = (make_weights(12, 3, 3, 4, 4, seed, torch.float32) for seed in (s, s + 2**32))
        assert not torch.equal(x1, x2) and not torch.equal(w1.wq, w2.wq)


def test_check_inputs_differ_for_seeds_2_to_the_32_apart_and_a_seed_of_2_to_the_62_works():
    case = "b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32"
    for s in (1, 2**62):
        q1, *_ = case_inputs(case, s)
        q2, *_ = case_inputs(case, s + 2**32)
        assert not torch.equal(q1, q2), s


def test_sweep_inputs_differ_for_seeds_2_to_the_32_apart():
    from attn_ledger.experiments.scale import sweep

    a = sweep((8,), 16, 16, seed=9).rows[0]
    b = sweep((8,), 16, 16, seed=9 + 2**32).rows[0]
    assert a.fields["raw_std"] != b.fields["raw_std"]


@pytest.mark.parametrize("command", [
    ["run"], ["check", "fixtures/kernels/good.py:attention", "--case", "b1-h1kv1-tq2tk2-dh4dv4-none-rand-f32"],
    ["faults"], ["intervene"], ["sweep-scale", "--dh", "8", "--queries", "8", "--keys", "8"],
])
@pytest.mark.parametrize("seed", ["18446744073709551615", str(2**64), "-1", str(-(2**63) - 1), str(TOP + 1), "1.5",
                                  "true", "７"])
def test_every_command_refuses_a_seed_outside_0_to_2_63_minus_1(command, seed):
    err = one_line_exit_2(runner.invoke(app, [*command, "--seed", seed]))
    assert "--seed" in err


def test_the_largest_seed_is_accepted():
    r = runner.invoke(app, ["run", "--seed", str(TOP), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["verdict"] == "pass"
    r = runner.invoke(app, ["check", "fixtures/kernels/good.py:attention", "--seed", str(2**62),
                            "--case", "b2-h4kv2-tq5tk9-dh8dv4-causal-flag-rand-f32"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, -1, True, 1.0, "3"])
def test_a_config_seed_outside_the_range_or_not_an_integer_is_refused(seed):
    with pytest.raises(ConfigError) as info:
        load_config(None, {"seed": seed})
    assert str(info.value).startswith("seed: got")
