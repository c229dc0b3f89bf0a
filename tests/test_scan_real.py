"""``attn-ledger scan`` on real transformers models built from small configs with random weights (the ``real``
extra; skipped without transformers).

Most scans run in this process (the same code the worker runs, a second or so each once transformers is
imported); the command line is run through its worker for the two cases the command promises: a correct
model exits 0 with one line per call, and a registered function with a bug exits 1 naming layer 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from attn_ledger.cli import app  # noqa: E402
from attn_ledger.probes.model.driver import LocalModel, setup  # noqa: E402
from attn_ledger.probes.model.inputs import InputPlan  # noqa: E402
from attn_ledger.probes.model.scan import ScanOptions, scan  # noqa: E402
from attn_ledger.probes.model.targets import target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CUSTOM = ROOT / "fixtures" / "interface" / "custom.py"
BROKEN = ROOT / "fixtures" / "models" / "broken.py"
runner = CliRunner()
_NAMES = iter(range(1 << 30))


def _scan(model_type: str | None = None, implementation: str | None = None, padding: str = "left", *,
          register: str | None = None, mask_format: str | None = None, factory: str | None = None,
          keep_going: bool = False, seq_len: int = 24, overrides: list[str] | None = None):
    if register is not None:
        implementation = f"custom{next(_NAMES)}"  # a fresh name: registrations are global to the process
    t = target("factory" if factory else "transformers", factory or model_type, implementation=implementation,
               register=register, mask_format=mask_format, overrides=overrides)
    loaded, _ = setup({"target": t.to_json()})
    return scan(LocalModel(loaded), InputPlan(2, seq_len, padding, 0), ScanOptions(keep_going=keep_going))


def _finding(report) -> tuple[str, str, str]:
    f = report.first_finding
    return f.row, f.check.name, f.check.reason


# --- the command line, through its worker -----------------------------------------------------------------


def test_a_correct_llama_exits_0_with_one_line_per_call():
    result = runner.invoke(app, ["scan", "--transformers", "llama"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("PASS: 2 calls")
    assert [ln.split()[0] for ln in lines if ln.startswith("layers.")] == ["layers.0.self_attn", "layers.1.self_attn"]


def test_a_registered_function_with_a_bug_exits_1_naming_layer_0():
    result = runner.invoke(app, ["scan", "--transformers", "llama", "--attn-implementation", "mine", "--register",
                                 f"{CUSTOM}:kv_tiled", "--padding", "left", "--format", "json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["command"] == "scan" and doc["first_finding"]["row"] == "layers.0.self_attn"
    assert "kv heads tiled" in doc["first_finding"]["message"]
    assert [r["status"] for r in doc["rows"]] == ["fail", "downstream"]
    ledger = doc["ledger"]  # the stage ledger of that call, run on its captured tensors
    assert ledger["command"] == "run" and ledger["verdict"] == "fail" and "layers.0.self_attn" in ledger["title"]
    assert ledger["first_finding"]["row"] in ("weights", "context")


def test_saved_calls_replay_through_run_tensors_t5_with_its_position_bias(tmp_path):
    from safetensors.torch import load_file

    from attn_ledger.ledger import run_ledger_tensors

    t = target("transformers", "t5")
    loaded, _ = setup({"target": t.to_json()})
    report = scan(LocalModel(loaded), InputPlan(2, 12, "right", 0), ScanOptions(save=str(tmp_path / "calls")))
    assert report.exit_code == 0
    files = sorted((tmp_path / "calls").iterdir())
    assert len(files) == 8  # the encoder's two calls per example (padded query rows left out), the decoder's four
    assert all("bias" in load_file(str(f)) for f in files)
    for f in files:
        assert run_ledger_tensors(f, out_layout="bthd", scale=1.0).verdict == "pass", f.name


# --- broken cases, each named at the first layer where it acts --------------------------------------------


@pytest.mark.parametrize("family, fn, check, words", [
    ("llama", "kv_tiled", "reference", "kv heads tiled"),
    ("gemma2", "scaling_ignored", "reference", "scaling ignored"),
    ("gemma2", "softcap_ignored", "reference", "softcap ignored"),
    ("gpt_oss", "sinks_dropped", "reference", "sinks dropped"),
    ("llama", "mask_flipped", "weights_sum", "wrong polarity"),
    ("llama", "heads_first", "layout", "transposed back"),
])
def test_each_bug_of_a_registered_function_is_named_at_layer_0(family, fn, check, words):
    report = _scan(family, register=f"{CUSTOM}:{fn}")
    row, name, reason = _finding(report)
    assert (row, name) == ("layers.0.self_attn", check) and words in reason, reason


def test_a_function_registered_without_a_mask_function_never_sees_the_padding():
    report = _scan("llama", register=f"{CUSTOM}:my_attention", mask_format="none")
    row, name, reason = _finding(report)
    assert row == "layers.0.self_attn" and "padding ignored" in reason
    relation = report.rows[0].check("relation")
    assert relation.failed and "no mask reached the call" in relation.reason


def test_gpt2_eager_that_bypasses_the_interface_is_watched_by_the_observer():
    report = _scan("gpt2", "eager", "right", overrides=["reorder_and_upcast_attn=true"])
    assert report.exit_code == 0 and report.details["passes"] == 2
    assert [r.fields["via"] for r in report.rows] == ["observer", "observer"]


# --- the families, correct under each implementation they support and both padding sides --------------------

FAMILIES = [("llama", ("eager", "sdpa")), ("mistral", ("eager", "sdpa")), ("qwen2", ("eager", "sdpa")),
            ("qwen3", ("sdpa",)), ("gemma2", ("eager",)), ("gpt_oss", ("eager",)), ("gpt2", ("eager", "sdpa")),
            ("bert", ("eager", "sdpa")), ("t5", ("eager", "sdpa"))]
CORRECT = [(f, i, p) for f, impls in FAMILIES for i in impls for p in ("left", "right")]


@pytest.mark.parametrize("family, implementation, padding", CORRECT, ids=["-".join(c) for c in CORRECT])
def test_each_family_passes_under_its_implementations_and_both_padding_sides(family, implementation, padding):
    report = _scan(family, implementation, padding)
    assert report.exit_code == 0, [(r.name, r.first_failing()) for r in report.rows if r.first_failing()]
    assert report.coverage is None and len(report.rows) == (6 if family == "t5" else 2)
    for row in report.rows:  # every call was judged against its float64 reference, with margin
        ref = row.check("reference")
        assert ref.passed and ref.data["ratio"] < 0.5, (row.name, ref.data)
        assert row.check("relation").passed


def test_what_each_family_config_says_is_judged():
    def judged(report, check):
        return [row.check(check).status for row in report.rows]

    assert judged(_scan("mistral", "sdpa"), "relation") == ["pass", "pass"]
    assert [r.fields["relation"] for r in _scan("gemma2", "eager").rows] == ["causal w16", "causal"]
    assert judged(_scan("gemma2", "eager"), "softcap") == ["pass", "pass"]
    assert judged(_scan("gpt_oss", "eager"), "sinks") == ["pass", "pass"]
    assert judged(_scan("qwen3", "sdpa"), "rotary") == ["pass", "pass"]  # judged from q_norm's output
    t5 = _scan("t5", "sdpa")
    assert [r.fields["relation"] for r in t5.rows] == ["bidirectional"] * 2 + ["causal", "bidirectional"] * 2
    gpt2 = _scan("gpt2", "eager", overrides=["scale_attn_by_inverse_layer_idx=true"])
    assert gpt2.exit_code == 0 and judged(gpt2, "scale") == ["pass", "pass"]


@pytest.mark.slow
def test_flex_attention_passes_its_block_mask_read_densely():
    # through the worker, as users run it: torch.compile warns of its own internals, which pytest makes errors here
    result = runner.invoke(app, ["scan", "--transformers", "llama", "--attn-implementation", "flex_attention",
                                 "--padding", "left", "--format", "json"])
    if result.exit_code == 1 and "raised BackendCompilerFailed" in result.stdout:  # e.g. ATEN_CPU_CAPABILITY=default
        pytest.skip("torch.compile cannot build flex attention's kernel here (BackendCompilerFailed)")
    assert result.exit_code == 0, result.output[-2000:]
    doc = json.loads(result.stdout)
    assert [[c["status"] for c in r["checks"] if c["name"] == "relation"] for r in doc["rows"]] == [["pass"], ["pass"]]


# --- mistakes in a model, each named at the first layer where it acts -------------------------------------


def _patched(monkeypatch, name: str):
    """Run factory ``name`` of fixtures/models/broken.py here, putting back what it replaces at the test's end."""
    import importlib

    sys.path.insert(0, str(BROKEN.parent))
    try:
        broken = importlib.import_module("broken")
    finally:
        sys.path.remove(str(BROKEN.parent))
    for module, attr in broken.PATCHES.get(name, []):
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, attr, getattr(mod, attr))
    return _scan(factory=f"{BROKEN}:{name}")


@pytest.mark.parametrize("factory, row, check, words", [
    ("llama_tiled_repeat_kv", "layers.0.self_attn", "reference", "kv heads tiled"),
    ("llama_rotary_every_two", "layers.0.self_attn", "rotary", "adjacent pairs"),
    ("gemma2_window_one_too_wide", "layers.1.self_attn", "forbidden_weight", "one wider than sliding_window=16"),
    ("llama_mask_drops_last_padded_key", "layers.0.self_attn", "relation", "lets 12 padded keys through"),
])
def test_each_mistake_in_a_model_is_named_at_its_first_layer(monkeypatch, factory, row, check, words):
    report = _patched(monkeypatch, factory)
    assert _finding(report)[:2] == (row, check) and words in _finding(report)[2], _finding(report)
    first = [r.name for r in report.rows].index(row)
    assert all(r.status == "pass" for r in report.rows[:first])


def test_the_control_model_passes(monkeypatch):
    assert _patched(monkeypatch, "llama").exit_code == 0


def test_a_registered_window_one_too_wide_is_named():
    report = _scan("mistral", register=f"{CUSTOM}:window_too_wide", mask_format="none", padding="none")
    row, name, reason = _finding(report)
    assert row == "layers.0.self_attn" and "a window of 17 keys" in reason


# --- targets from a config file, and what cannot be built ----------------------------------------------------


def test_a_config_json_keeps_its_sizes_unless_tiny(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 96, "intermediate_size": 128,
                                "num_hidden_layers": 3, "num_attention_heads": 3, "num_key_value_heads": 1,
                                "vocab_size": 100}))
    kept = _scan(str(path), "eager", seq_len=12)
    assert kept.exit_code == 0 and len(kept.rows) == 3 and kept.rows[0].shape == (2, 3, 12, 32)
    t = target("transformers", str(path), tiny=True, implementation="eager")
    loaded, _ = setup({"target": t.to_json()})
    assert loaded.facts["layers"] == 2 and loaded.facts["config"]["hidden_size"] == 64


@pytest.mark.parametrize("args, words", [
    (["--transformers", "lama"], "did you mean 'llama'"),
    (["--transformers", "llama", "--set", "hiden_size=8"], "--set: got 'hiden_size'"),
    (["--transformers", "gemma2", "--attn-implementation", "sdpa"], "--attn-implementation"),
    (["--transformers", "llama", "--set", "num_attention_heads=3"], "--set: the llama config refuses"),
    (["--transformers", "gpt2", "--seq-len", "2048"], "--seq-len: got 2048, expected at most 1024"),
])
def test_a_model_that_cannot_be_built_is_one_line_and_exit_2(args, words):
    result = runner.invoke(app, ["scan", *args, "--in-process"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output


def test_a_layer_that_bypasses_the_interface_is_watched_while_the_others_are_seen_once():
    import types

    import torch
    from transformers.models.llama import modeling_llama as ml

    loaded, _ = setup({"target": target("transformers", "llama", implementation="eager").to_json()})
    attn = loaded.model.layers[1].self_attn

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, t, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = ml.repeat_kv(k, self.num_key_value_groups), ml.repeat_kv(v, self.num_key_value_groups)
        w = torch.softmax(q @ k.transpose(2, 3) * self.scaling + attention_mask, dim=-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, t, -1)), w

    attn.forward = types.MethodType(forward, attn)  # the same computation, written without the interface
    report = scan(LocalModel(loaded), InputPlan(2, 12, "left", 0))
    assert [(r.name, r.fields["via"]) for r in report.rows] == [("layers.0.self_attn", "eager"),
                                                                 ("layers.1.self_attn", "observer")]
    assert report.exit_code == 0 and report.details["passes"] == 2
