"""``attn-ledger compare --vary target=FILE:FACTORY``: a port of Llama against transformers' Llama (the ``real`` extra;
skipped without transformers).

``fixtures/models/port.py`` names its weights and blocks its own way, mapped by ``--map ...:from_llama``. Paired
by ``repeat_interleave`` it agrees with Llama (exit 0); paired by ``repeat`` it is named at block 0, where run B's
attention call matches tiled kv heads (exit 1). Each way a port or a map can be wrong is refused with one line and
exit 2, through the worker where the port's file runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from attn_ledger.cli import app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PORT = ROOT / "fixtures" / "models" / "port.py"
MAP = ["--map", f"{PORT}:from_llama"]
runner = CliRunner()


def _compare(factory: str, *extra: str) -> object:
    return runner.invoke(app, ["compare", "--transformers", "llama", "--vary", f"target={PORT}:{factory}", *extra])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_port_paired_by_repeat_interleave_agrees_with_llama_and_exits_0(dtype):
    result = _compare("port", *MAP, "--dtype", dtype)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("PASS: 7 layers")
    assert [ln.split()[0] for ln in lines if ln[:1].strip() and ln.split()[1:2] == ["pass"]] == [
        "embeddings", "masks", "position_ids", "position_embeddings", "model.layers.0", "model.layers.1", "logits"]
    loaded = [n for n, m in list(sys.modules.items()) if n.startswith("_attn_ledger_user_")
              and str(getattr(m, "__file__", "")) == str(PORT)]
    assert not loaded, "the port's file ran in the tool's own process"


def test_the_port_paired_by_repeat_is_named_at_block_0_with_its_stage_in_json_exit_1():
    result = _compare("port_repeat", *MAP, "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["first_finding"]["row"] == "model.layers.0"
    assert report["first_finding"]["check"] == "added_error"
    assert report["details"]["vary"] == {"kind": "target", "a": "llama", "b": f"{PORT}:port_repeat"}
    rows = {r["name"]: r["status"] for r in report["rows"]}
    assert [rows[n] for n in ("embeddings", "masks", "position_ids", "position_embeddings")] == ["pass"] * 4
    calls = {c["run"]: c for c in report["details"]["first_adder"]["attention"]["calls"]}
    assert calls["A"]["status"] == "pass" and calls["A"]["call"] == "model.layers.0.self_attn"
    b = calls["B"]
    assert (b["call"], b["status"], b["check"]) == ("blocks.0.attn", "fail", "reference")
    assert b["diagnosis"] == "kv heads tiled (repeat) instead of repeated per group (repeat_kv)"
    assert (b["stage"], b["stage_check"]) == ("weights", "user_weights_matches_reference")
    assert report["ledger"]["first_finding"]["row"] == "weights"


def test_the_port_that_tiles_its_kv_heads_before_the_call_is_named_at_block_0_by_the_call_s_k():
    """Paired before the call, the call's k has one head per query head and the call is right on what it gets:
    the rotary check reads k's heads against the k projection's, and names the tiling."""
    result = _compare("port_repeat_before", *MAP, "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["first_finding"]["row"] == "model.layers.0"
    calls = {c["run"]: c for c in report["details"]["first_adder"]["attention"]["calls"]}
    assert calls["A"]["status"] == "pass"
    b = calls["B"]
    assert (b["call"], b["status"], b["check"], b["stage"]) == ("blocks.0.attn", "fail", "rotary", "input")
    assert b["diagnosis"].startswith("kv heads tiled (repeat) before the call, instead of repeated per group")
    assert report["ledger"]["verdict"] == "pass"  # the failing call's stage ledger: the attention itself is right
    good = json.loads(_compare("port", *MAP, "--format", "json").output)
    assert good["verdict"] == "pass"


BROKEN = '''
import sys

import torch

sys.path.insert(0, {where!r})
import port


def raises():
    raise RuntimeError("no port of that size")


def extra():
    model = port.port()
    model.register_parameter("gain", torch.nn.Parameter(torch.ones(1)))
    return model


def narrow():
    return port.Port(port.LlamaConfig(**{{**port.SMALL, "intermediate_size": 96}}), "repeat_interleave")


def missing(name):
    return port.from_llama(name).replace(".wq.", ".w_q.")


def twice(name):
    return port.from_llama(name).replace(".wk.", ".wq.")


def blocks_elsewhere(name):
    return port.from_llama(name) if name.endswith("weight") else "layers." + name


def crashes(name):
    raise KeyError(name)


def not_a_name(name):
    return None


class Unfinished(port.Port):
    def forward(self, input_ids, **kwargs):
        raise NotImplementedError("the port's forward is not written yet")


def unfinished():
    return Unfinished(port.LlamaConfig(**port.SMALL), "repeat_interleave")


def plain():
    return torch.nn.Sequential(torch.nn.Linear(4, 4))
'''


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ports") / "broken.py"
    path.write_text(BROKEN.format(where=str(PORT.parent)), encoding="utf-8")
    return path


@pytest.mark.parametrize("factory, mapping, words", [
    ("port", None, "--vary: A's model.embed_tokens.weight is not a weight of B, expected B to name its weights "
                   "as A does, or --map FILE:FN"),
    ("raises", None, "--vary target: {broken}:raises() raised RuntimeError: no port of that size"),
    ("extra", "PORT", "--map: B's gain is left unfilled: no weight of A maps to it, expected it to name each of "
                      "B's weights once, by one of A's"),
    ("narrow", "PORT", "--map: A's model.layers.0.mlp.gate_proj.weight has shape [128, 64] and B's "
                       "blocks.0.ffn.w1.weight [96, 64]"),
    ("port", "missing", "--map: A's model.layers.0.self_attn.q_proj.weight maps to 'blocks.0.attn.w_q.weight', "
                        "which is not a weight of B"),
    ("port", "twice", "--map: A's model.layers.0.self_attn.q_proj.weight and model.layers.0.self_attn.k_proj.weight "
                      "both map to B's blocks.0.attn.wq.weight"),
    ("port", "blocks_elsewhere", "--map: A's block model.layers.0 maps to 'layers.model.layers.0', which is not a "
                                 "module of B"),
    ("port", "crashes", "--map: {broken}:crashes('model.embed_tokens.weight') raised KeyError"),
    ("port", "not_a_name", "--map: {broken}:not_a_name('model.embed_tokens.weight') returned a NoneType, expected "
                           "B's name for it (a str)"),
], ids=["no-map", "factory-raises", "unfilled", "shape", "missing", "twice", "block", "map-raises", "not-a-name"])
def test_a_port_or_map_that_does_not_pair_is_one_line_and_exit_2(broken, factory, mapping, words):
    source = PORT if factory == "port" else broken
    extra = [] if mapping is None else ["--map", f"{PORT}:from_llama" if mapping == "PORT" else f"{broken}:{mapping}"]
    result = runner.invoke(app, ["compare", "--transformers", "llama", "--vary", f"target={source}:{factory}", *extra])
    assert result.exit_code == 2, result.output
    assert words.format(broken=broken) in result.output and "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1


def test_a_port_whose_forward_raises_is_a_finding_naming_the_port_exit_1(broken):
    result = runner.invoke(app, ["compare", "--transformers", "llama", "--vary", f"target={broken}:unfinished", *MAP])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("FAIL at forward")
    assert f"the forward of {broken}:unfinished (run B) raised NotImplementedError: the port's forward is not written" \
        in " ".join(result.output.split())


@pytest.mark.parametrize("vary, words", [
    ("target=", "--vary target: got '', expected 'path/to/file.py:NAME'"),
    (f"target={PORT}", f"--vary target: got '{PORT}', expected 'path/to/file.py:NAME'"),
    ("target=fixtures/models/absent.py:port", "--vary target: got 'fixtures/models/absent.py', expected an existing"),
], ids=["empty", "no-factory", "no-file"])
def test_a_target_that_is_not_file_factory_is_one_line_and_exit_2(vary, words):
    result = runner.invoke(app, ["compare", "--transformers", "llama", "--vary", vary])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1


# --- run A as a model of one's own ------------------------------------------------------------------------------


def test_run_a_as_a_factory_reaches_the_broken_cache_path_from_the_command_line_exit_1():
    result = runner.invoke(app, ["compare", f"{ROOT / 'fixtures' / 'models' / 'cache.py'}:one_ahead", "--vary", "cache",
                                 "--format", "json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["first_finding"]["row"] == "position_ids"
    assert report["details"]["first_adder"]["block"] == "model.layers.0"
    assert report["details"]["model"]["class"] == "PositionsOneAhead"


def test_run_a_as_the_port_against_itself_in_bfloat16_passes():
    result = runner.invoke(app, ["compare", f"{PORT}:port", "--vary", "dtype=float32,bfloat16"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("PASS: 7 layers")


@pytest.mark.parametrize("argv, words", [
    (["--transformers", "llama", "TARGET:port"], "target: expected exactly one of a model 'file.py:FACTORY' or "
                                                 "--transformers"),
    ([], "target: expected exactly one of a model 'file.py:FACTORY' or --transformers"),
    (["TARGET:port", "--set", "num_hidden_layers=3"], "--set: applies to --transformers, not to a FILE:FACTORY target"),
    (["BROKEN:plain"], "target: {broken}:plain() returned a Sequential without a transformers config, expected a "
                       "transformers model"),
], ids=["both", "neither", "set", "not-transformers"])
def test_run_a_as_a_factory_refuses_what_it_cannot_run_exit_2(broken, argv, words):
    argv = [a.replace("TARGET", str(PORT)).replace("BROKEN", str(broken)) for a in argv]
    result = runner.invoke(app, ["compare", *argv, "--vary", "dtype=float32,float64"])
    assert result.exit_code == 2, result.output
    assert words.format(broken=broken) in result.output and "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1


@pytest.fixture(scope="module")
def port_module():
    """fixtures/models/port.py imported as a test imports its own port (so that its classes' module is found)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_port_under_test", PORT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _with_llamas_weights(port_module, factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**port_module.SMALL)).eval()
    port = factory()
    port.load_state_dict({port_module.from_llama(k): v for k, v in llama.state_dict().items()})
    return llama, port


def test_assert_models_agree_takes_the_map_passes_the_port_and_names_the_tiled_one(port_module):
    from attn_ledger.testing import assert_models_agree

    assert_models_agree(*_with_llamas_weights(port_module, port_module.port), map=port_module.from_llama)
    with pytest.raises(AssertionError) as raised:
        assert_models_agree(*_with_llamas_weights(port_module, port_module.port_repeat), map=port_module.from_llama)
    text = str(raised.value)
    assert "model.layers.0" in text and "kv heads tiled (repeat) instead of repeated per group" in text


def test_compare_models_refuses_a_map_that_names_a_weight_the_port_lacks(port_module):
    from attn_ledger.errors import InputError
    from attn_ledger.probes.model.compare import compare_models

    llama, port = _with_llamas_weights(port_module, port_module.port)
    with pytest.raises(InputError, match="map: A's lm_head.weight maps to 'head', which is not a weight of B"):
        compare_models(llama, port, map=lambda n: "head" if n == "lm_head.weight" else port_module.from_llama(n))


def test_a_k_paired_before_the_call_is_read_against_its_projection_both_ways():
    """The call's k has one head per query head, its projection one per kv head: paired per group (repeat_kv) it
    agrees with the projection rotated; tiled (repeat) it does not, and the diagnosis names the tiling."""
    import torch

    from attn_ledger.maths.rotary import RotarySpec, apply_rotary
    from attn_ledger.probes.model.capture import _heads_of
    from attn_ledger.probes.model.judge import Call, _rotary_diagnosis, _rotation_errors

    spec = RotarySpec("half", 10000.0, None)
    g = torch.Generator().manual_seed(0)
    q_proj, k_proj = torch.randn(1, 5, 4 * 16, generator=g), torch.randn(1, 5, 2 * 16, generator=g)  # [B, T, H * D]
    q = apply_rotary(q_proj.view(1, 5, 4, 16).transpose(1, 2), spec)  # [1, 4, 5, 16]
    k = apply_rotary(k_proj.view(1, 5, 2, 16).transpose(1, 2), spec)  # [1, 2, 5, 16]
    for paired, right in ((k.repeat_interleave(2, dim=1), True), (k.repeat(1, 2, 1, 1), False)):
        pre = _heads_of({"q_pre": q_proj, "k_pre": k_proj}, q, paired)
        assert pre["k_pre"].shape == (1, 2, 5, 16)  # the projection keeps its own 2 heads
        call = Call({}, q=q, k=paired, q_pre=pre["q_pre"], k_pre=pre["k_pre"])
        err = _rotation_errors(call, spec, None)
        if right:
            assert err < 1e-6
        else:
            assert err > 0.1
            assert _rotary_diagnosis(call, spec, None, 1e-6).startswith("kv heads tiled (repeat) before the call")
    assert "k_pre" not in _heads_of({"k_pre": torch.randn(1, 5, 3 * 16)}, q, k.repeat(1, 2, 1, 1))  # 3 does not divide 4
