"""The pytest helper, used the way a user would use it in their own suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attn_ledger.errors import InputError
from attn_ledger.probes.kernel.check import case_inputs, check_kernel, parse_case
from attn_ledger.render.text import describe
from attn_ledger.testing import assert_attention_matches
from attn_ledger.inputs.userload import load_object

KERNELS = Path(__file__).resolve().parents[1] / "fixtures" / "kernels"
attention = load_object(f"{KERNELS / 'good.py'}:attention")
sdpa_is_causal = load_object(f"{KERNELS / 'sdpa_is_causal.py'}:attention")


def test_my_attention_follows_the_protocol():
    assert_attention_matches(attention)


def test_selected_cases():
    assert_attention_matches(attention, ["b2-h4kv2-tq5tk9-dh8dv4-pad-causal-rand-f32", "b1-h1kv1-tq1tk1-dh4dv4-none-rand-bf16"])
    assert_attention_matches(sdpa_is_causal, "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32")


def test_failure_message_is_the_diagnosis():
    with pytest.raises(AssertionError) as info:
        assert_attention_matches(sdpa_is_causal, name="sdpa_is_causal")
    msg = str(info.value)
    assert msg.startswith("sdpa_is_causal: ")
    # Tq > Tk: top-left lets early queries read keys that bottom-right blocks, a local (L3) break
    assert "smallest failing case b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32: L3 convex_range" in msg
    assert "attn-ledger check sdpa_is_causal --case b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32" in msg
    # the case named in the message is accepted back and still fails
    case = re.search(r"--case (\S+)", msg).group(1)
    with pytest.raises(AssertionError, match="L3 convex_range"):
        assert_attention_matches(sdpa_is_causal, case)


def test_failure_message_holds_each_failing_check_and_reproduces_in_python():
    case = "b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32"
    with pytest.raises(AssertionError) as info:
        assert_attention_matches(sdpa_is_causal, case, name="sdpa_is_causal")
    msg = str(info.value)
    # every failing check of the case, as the report's sentence (value, limit, location)
    failing = check_kernel(sdpa_is_causal, [parse_case(case)]).rows[0].failing()
    # (queries 0-2 have no allowed key: they answer to empty_rows, not to causal_intervention's probe)
    assert {c.name for c in failing} == {"convex_range", "forbidden_keys", "empty_rows", "reference",
                                         "reference_grad_mode", "grad_q", "grad_k", "grad_v"}
    for c in failing:
        assert describe(c) in msg, c.name
    # the Python lines after the CLI line rerun the exact call
    python = [ln.strip() for ln in msg[msg.index("reproduce:"):].splitlines()[2:]]
    scope = {"attention": sdpa_is_causal}
    exec("\n".join(python), scope)
    q, k, v, kw = case_inputs(case)
    assert torch.equal(scope["out"], sdpa_is_causal(q, k, v, **kw))


def test_the_helper_frame_is_hidden_from_pytest_tracebacks():
    assert "__tracebackhide__" in assert_attention_matches.__code__.co_varnames


def test_empty_rows_contract():
    nan_rows = load_object(f"{KERNELS / 'manual_nan_rows.py'}:attention")
    case = "b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32"
    with pytest.raises(AssertionError, match="empty_rows"):
        assert_attention_matches(nan_rows, case)
    assert_attention_matches(nan_rows, case, empty_rows="nan")


def test_bad_case_id_is_an_input_error_not_an_assertion():
    with pytest.raises(InputError):
        assert_attention_matches(attention, "b2-nonsense")


# --- user code that exits or hangs: a failed assertion, never the end of the test run ---------------

ONE = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"


def exits(q, k, v, **kw):
    raise SystemExit(0)


def sleeps(q, k, v, **kw):
    import time

    time.sleep(3600)


def test_sys_exit_in_the_function_fails_the_assertion():
    with pytest.raises(AssertionError, match=re.escape("L1 call")) as info:
        assert_attention_matches(exits, ONE, name="exits")
    assert "attention(q, k, v) raised SystemExit(0)" in str(info.value)


def test_timeout_when_given_fails_the_case():
    with pytest.raises(AssertionError) as info:
        assert_attention_matches(sleeps, ONE, name="sleeps", timeout=1)
    assert "attention(q, k, v) timed out after 1 s" in str(info.value)


def test_no_time_limit_unless_given():
    import signal

    alarm_left = []

    def records(q, k, v, **kw):
        alarm_left.append(signal.getitimer(signal.ITIMER_REAL)[0])
        return attention(q, k, v, **kw)

    assert_attention_matches(records, ONE)
    calls = len(alarm_left)  # the call, and the one with inputs that require grad
    assert_attention_matches(records, ONE, timeout=30)
    assert set(alarm_left[:calls]) == {0.0} and all(0 < t <= 30 for t in alarm_left[calls:])
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0  # nothing left running after the call


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_timeout_must_be_positive(timeout):
    with pytest.raises(InputError, match="^timeout: got "):
        assert_attention_matches(attention, ONE, timeout=timeout)
# --- modules ----------------------------------------------------------------------------------------

from attn_ledger.testing import assert_module_matches  # noqa: E402

MODULES = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"


def test_my_module_follows_the_protocol():
    assert_module_matches(load_object(f"{KERNELS / 'good_module.py'}:make"), 12, 3)
    assert_module_matches(load_object(f"{MODULES}:sdpa_bidirectional"), 12, 2, causal=False, seq_len=5)


def test_module_failure_message_is_the_diagnosis_with_its_reproduction():
    factory = load_object(f"{MODULES}:no_scale")
    with pytest.raises(AssertionError) as info:
        assert_module_matches(factory, 12, 2, seq_len=5, name="fixtures/modules/attention_modules.py:no_scale")
    msg = str(info.value)
    first = msg.splitlines()[0]
    assert first.startswith("fixtures/modules/attention_modules.py:no_scale: module check fails; first finding: core "
                            "L4 effective_scale:")
    assert "equals 1 (not scaled)" in first
    assert "L4 attention_core" in msg and "explained by effective_scale" in msg
    assert ("attn-ledger check --module fixtures/modules/attention_modules.py:no_scale --embed-dim 12 --heads 2 "
            "--seed 0 --batch-size 2 --seq-len 5") in msg
    # the Python lines rerun the check and reach the same finding
    python = [ln.strip() for ln in msg[msg.index("reproduce:"):].splitlines()[2:]]
    scope = {"factory": factory}
    exec("\n".join(python[:-1]), scope)
    assert scope["report"].first_finding.name == "effective_scale"


def test_module_helper_names_a_file_factory_by_path_and_declarations_reach_the_command():
    from attn_ledger.testing import _factory_spec, _module_reproduction

    factory = load_object(f"{KERNELS / 'good_module.py'}:make")
    assert _factory_spec(factory) == f"{KERNELS / 'good_module.py'}:make"
    repro = _module_reproduction("f.py:make", 12, 3, {"causal": True, "window": 4, "scale": 0.25, "seed": 1,
                                                      "batch_size": 2, "seq_len": 8})
    assert repro["cli"] == ("attn-ledger check --module f.py:make --embed-dim 12 --heads 3 --window 4 --scale 0.25 "
                            "--seed 1 --batch-size 2 --seq-len 8")


def test_module_helper_frame_is_hidden_and_bad_input_is_not_an_assertion():
    assert "__tracebackhide__" in assert_module_matches.__code__.co_varnames
    with pytest.raises(InputError):
        assert_module_matches(load_object(f"{KERNELS / 'good_module.py'}:make"), 12, 3, window=4, causal=False)
