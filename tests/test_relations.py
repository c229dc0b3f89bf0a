"""One parser for mask relations: configs, CLI options and saved tensors are validated the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.inputs.config import load_config
from attn_ledger.maths import relations
from attn_ledger.errors import ConfigError, InputError
from attn_ledger.ledger import ledger_on_qkv

BAD = [
    ("causal+causal-top-left", {}, "mask: got 'causal+causal-top-left', expected one causal alignment, not both"),
    ("none+causal", {}, "mask: got 'none+causal', expected 'none' alone"),
    ("causal+causal", {}, "mask: got 'causal+causal', expected each relation once"),
    ("sliding-window", {}, "window: got none, expected a window length for mask 'sliding-window'"),
    ("sliding-window", {"window": 0}, "window: got 0, expected a positive window length for mask 'sliding-window'"),
    ("prefix-lm", {}, "prefix_len: got none, expected a prefix length for mask 'prefix-lm'"),
    ("prefix-lm", {"prefix_len": -1}, "prefix_len: got -1, expected a prefix length of 0 or more for mask 'prefix-lm'"),
    ("diagonal", {}, "mask: got 'diagonal', expected relations from "),
]


@pytest.mark.parametrize("mask,params,message", BAD, ids=[f"{m}{p}" for m, p, _ in BAD])
def test_config_and_tensors_reject_a_relation_with_the_same_line(mask, params, message):
    with pytest.raises(InputError) as direct:
        relations.resolve(mask, tq=4, tk=4, **params)
    assert str(direct.value).startswith(message)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    with pytest.raises(InputError) as from_tensors:
        ledger_on_qkv(q, k, v, mask=mask, **params)
    # the config's pydantic fields bound window and prefix_len first, in their own words
    if "window" not in params and "prefix_len" not in params:
        with pytest.raises(ConfigError) as from_config:
            load_config(overrides={"mask": mask, "seq_len": 4, **params})
        assert str(from_config.value) == str(direct.value)
    assert str(from_tensors.value).split(", expected")[0] == str(direct.value).split(", expected")[0]


def test_tensors_accept_only_relations_that_need_no_lengths():
    with pytest.raises(InputError, match="expected relations from none, causal, causal-top-left, sliding-window, prefix-lm"):
        relations.resolve("padding", tq=4, tk=4, valid_lengths=[4], allowed=relations.TENSOR_RELATIONS)
    spec = relations.resolve("causal+sliding-window", tq=4, tk=6, window=2, allowed=relations.TENSOR_RELATIONS)
    assert spec.names == ("causal", "sliding-window") and spec.window == 2


def test_padding_and_segments_parameters():
    with pytest.raises(InputError, match=r"valid_lengths: got 1 lengths \[5\], expected batch_size=2"):
        relations.resolve("padding", tq=5, tk=5, batch_size=2, valid_lengths=[5])
    with pytest.raises(InputError, match="valid_lengths: got 9, expected a key count between 0 and key_len=5"):
        relations.resolve("padding", tq=5, tk=5, batch_size=2, valid_lengths=[9, 1])
    with pytest.raises(InputError, match="needs self-attention"):
        relations.resolve("segments", tq=4, tk=5, segment_lengths=[5])
    spec = relations.resolve("segments", tq=5, tk=5, segment_lengths=[2, 3])
    assert spec.segment_lengths == (2, 3)


def test_built_relations_name_and_shortcut():
    rel = relations.build(relations.resolve("causal", tq=5, tk=5), 1, 1, 5, 5)
    assert (rel.name, rel.top_left_causal) == ("causal", True)
    rel = relations.build(relations.resolve("causal", tq=3, tk=5), 1, 1, 3, 5)
    assert (rel.name, rel.top_left_causal) == ("causal (bottom-right)", False)
    assert rel.block(0, 3)[0, 0].sum(dim=-1).tolist() == [3, 4, 5]
    saved = torch.ones(5, 5, dtype=torch.bool).tril()
    rel = relations.build(relations.resolve("causal", tq=5, tk=5), 1, 1, 5, 5, allow_mask=saved)
    assert (rel.name, rel.top_left_causal) == ("allow_mask [5, 5] + causal", False)


def test_saved_relation_tensors_are_checked_by_named_axes():
    relations.check_saved(torch.ones(2, 4, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool), 2, 3, 4, 5)
    with pytest.raises(InputError, match="allow_mask: got dtype float32, expected bool"):
        relations.check_saved(torch.ones(4, 5), None, 2, 3, 4, 5)
    with pytest.raises(InputError, match=r"key_valid: got shape \[5, 2\], expected \[B, Tk\]=\[2, 5\]"):
        relations.check_saved(None, torch.ones(5, 2, dtype=torch.bool), 2, 3, 4, 5)


def test_view_of_a_relation_that_differs_by_example():
    rel = relations.build(relations.resolve("causal+padding", tq=5, tk=5, batch_size=2, valid_lengths=[5, 3]), 2, 3, 5, 5)
    assert relations.varies(rel, 5) is True
    allow, b, h = relations.view(rel, 5, 1, 2)
    assert (b, h) == (1, 0)  # padding is the same for every head
    assert allow.sum(dim=-1).tolist() == [1, 2, 3, 3, 3]
    assert relations.varies(relations.build(relations.resolve("causal", tq=5, tk=5), 2, 3, 5, 5), 5) is False


def test_cli_tensors_mask_error_is_one_line_exit_2(tmp_path: Path):
    from attn_ledger.inputs.tensorio import save_tensor_file

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "qkv.safetensors"
    save_tensor_file({n: torch.randn(1, 2, 4, 8, generator=g) for n in ("q", "k", "v")}, path)
    r = CliRunner().invoke(app, ["run", "--tensors", str(path), "--mask", "causal+causal-top-left"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: mask: got 'causal+causal-top-left', expected one causal alignment, not both"]
