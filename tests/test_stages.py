"""The ledger against its list of checks (attn_ledger.engine.stages), the list the docs' stage table is made from.

Every check a ledger reports, across the pipeline faults, the mask relations, the dtypes,
declared-empty rows, SDPA backends and saved-tensor inputs, must be in the list at its stage
and level; every entry of the list must be reported by one of those ledgers; and the ledger's
rows come in the list's order.
"""

from __future__ import annotations

import pytest
import torch

from attn_ledger.engine import stages
from attn_ledger.inputs.config import FAULT_NEEDS, Fault, load_config
from attn_ledger.ledger import ledger_on_qkv, run_ledger, run_ledger_tensors
from attn_ledger.report import Report

FIXTURES = __import__("pathlib").Path(__file__).parent.parent / "fixtures"


CONFIGS = [
    *({"fault": f.value, **FAULT_NEEDS.get(f.value, {})} for f in Fault),
    {"grad": True, "replay": True, "rope": "half"},
    {"grad": True, "mask": "padding", "valid_lengths": [5, 3]},  # keys no query of example 1 may use
    {"grad": True, "mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"grad": True, "query_len": 3, "key_len": 6, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 16},
    {"batch_size": 1},
    {"fault": "k-transpose", "seq_len": 4, "num_heads": 4, "embed_dim": 16},  # Nh == T == Dh: it does not raise
    {"mask": "none"},
    {"mask": "padding", "valid_lengths": [5, 3]},
    {"mask": "causal+padding", "valid_lengths": [5, 3], "padding_side": "left"},
    {"mask": "sliding-window", "window": 2},
    {"mask": "prefix-lm", "prefix_len": 2},
    {"mask": "padding", "valid_lengths": [5, 0], "empty_rows": "zeros"},
    {"num_heads": 4, "num_kv_heads": 2, "embed_dim": 16},
    {"query_len": 3, "key_len": 6},
    {"dtype": "float64"},
    {"dtype": "float16"},
    {"dtype": "bfloat16"},
]


def _id(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _emitted(report: Report) -> list[tuple[str, int, str]]:
    return [(row.name, c.level, c.name) for row in report.rows for c in row.checks]


def _tensor_reports() -> list[Report]:
    reports = [run_ledger_tensors(str(p), keep_going=True) for p in sorted((FIXTURES / "tensors").iterdir())]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))  # [B, Nh, T, Dh]
    grid = torch.zeros(1, 2, 4, 3)  # [B, Nh, Tq, Tk - 1]: the wrong shape
    out = torch.zeros(1, 2, 4, 7)  # [B, Nh, Tq, Dv - 1]: the wrong shape
    reports.append(ledger_on_qkv(q, k, v, mask="causal", scores=grid, weights=grid, out=out, keep_going=True))
    go = torch.randn(1, 2, 4, 8, generator=g)
    with torch.enable_grad():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ctx = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        dq, dk, dv = torch.autograd.grad(ctx, leaves, go)
    saved = {"grad_out": go, "dq": dq, "dk": dk, "dv": dv}
    reports.append(ledger_on_qkv(q, k, v, mask="causal", grad=True, grads=saved, replay=True, rope="half", keep_going=True))
    wrong = {n: torch.zeros(1, 2, 4, 7) for n in saved}  # every one a width short
    reports.append(ledger_on_qkv(q, k, v, mask="causal", grad=True, grads=wrong, keep_going=True))
    return reports


@pytest.fixture(scope="module")
def ledgers() -> dict[str, Report]:
    found = {_id(cfg): run_ledger(load_config(overrides=cfg), keep_going=True) for cfg in CONFIGS}
    found["backends"] = run_ledger(load_config(), keep_going=True, backends="all")
    for i, report in enumerate(_tensor_reports()):
        found[f"tensors{i}"] = report
    return found


def test_every_reported_check_is_listed_at_its_stage_and_level(ledgers):
    for label, report in ledgers.items():
        for stage, level, name in _emitted(report):
            spec = stages.find(stage, name)
            assert spec is not None, (
                f"{label}: the ledger reports {name!r} at stage {stage!r}, which attn_ledger/engine/stages.py does not "
                f"list: add it there (its level and one line on what it means); docs/run.md is generated from it")
            assert spec.level == level, f"{label}: {stage}.{name} is L{level}, attn_ledger/engine/stages.py says L{spec.level}"


def test_every_listed_check_is_reported_by_some_ledger(ledgers):
    reported = {(stage, name) for r in ledgers.values() for stage, _, name in _emitted(r)}
    for spec in stages.STAGES:
        for c in (*spec.checks, *(stages.ANY_STAGE if spec.name == "scores" else ())):
            assert any(stage == spec.name and c.matches(name) for stage, name in reported), (
                f"attn_ledger/engine/stages.py lists {spec.name}.{c.name} but no ledger here reports it")


def test_rows_come_in_the_listed_order(ledgers):
    assert tuple(r.name for r in ledgers["fault=no-scale"].rows) == stages.stage_names(stages.PIPELINE)
    assert tuple(r.name for r in ledgers["tensors0"].rows) == stages.stage_names(stages.TENSORS)


def test_axes_are_the_ledgers(ledgers):
    for label, mode in (("fault=no-scale", stages.PIPELINE), ("tensors0", stages.TENSORS)):
        for row in ledgers[label].rows:
            spec = next(s for s in stages.STAGES if s.name == row.name)
            assert spec.axes_in(mode) == row.axes, (label, row.name)


def test_checks_within_a_stage_come_in_the_listed_order(ledgers):
    for label, report in ledgers.items():
        for row in report.rows:
            spec = next(s for s in stages.STAGES if s.name == row.name)
            listed = [c for c in spec.checks]
            positions = [next(i for i, c in enumerate(listed) if c.matches(ch.name))
                         for ch in row.checks if ch.name not in {c.name for c in stages.ANY_STAGE}]
            assert positions == sorted(positions), (label, row.name, [c.name for c in row.checks])


def test_a_check_missing_from_the_list_is_caught():
    assert stages.find("scores", "matches_reference").level == 4
    assert stages.find("context", "sdpa[math,float32]").level == 4
    assert stages.find("context", "sdpa[math]") is None
    assert stages.find("scores", "key_row_sums") is None  # a weights check, not a scores one
    assert stages.find("no_such_stage", "shape") is None


def test_markdown_table_has_a_line_per_check():
    table = stages.markdown_table(stages.PIPELINE)
    n_checks = sum(len([c for c in s.checks if stages.PIPELINE in c.modes]) for s in stages.STAGES
                   if stages.PIPELINE in s.modes)
    body = table.splitlines()[2:]
    assert len(body) == n_checks + 1 + len(stages.ANY_STAGE)  # the input row has no check
    assert "`user_out_matches_reference`" not in table
    assert "`user_out_matches_reference`" in stages.markdown_table(stages.TENSORS)
    with pytest.raises(ValueError, match="mode"):
        stages.markdown_table("gpu")
