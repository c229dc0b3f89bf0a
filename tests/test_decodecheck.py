"""Decode parity (check --module --decode): each scenario and each diagnosis, passing and failing."""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from typer.testing import CliRunner

import decode_cases as cases
from attn_ledger.cli import app
from attn_ledger.probes.module.decode import (
    DIAGNOSES,
    _judge_dependency,
    decode_rows,
    plan_scenarios,
    validate_decode,
)
from attn_ledger.errors import InputError, SetupError
from attn_ledger.probes.module.check import check_module
from attn_ledger.render.jsondoc import schema

E, NH, T = 16, 2, 18  # T = 18 keeps the prefill past a block of 16 and one single token after it
SCENARIOS = ("decode_tokens", "decode_chunks", "decode_prefill_5", "decode_prefill_17", "decode_two_sequences")
FIXTURE = str(cases.FIXTURE)
TESTS = str(cases.Path(cases.__file__))
runner = CliRunner()


@lru_cache(maxsize=None)
def rows_for(factory: str, decode: str, length: int = T):
    """Decode rows for a factory and decode function named in tests/decode_cases.py or the fixture file,
    once per session (each run decodes about a hundred calls)."""
    import torch

    def get(name: str):
        return getattr(cases, name, None) or cases.fixture(name)

    torch.manual_seed(0)
    module = get(factory)(E, NH)
    rows, details = decode_rows(module, get(decode), E, length=length)
    return {r.name: r for r in rows}, details


def parity(rows, name):
    return rows[name].check("decode_parity")


# --- the plan ------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [4, 8, 18, 32])
def test_plan_covers_every_position_of_every_scenario(length):
    plan = plan_scenarios(length)
    assert [sc.name for sc in plan][:2] == ["tokens", "chunks"] and plan[-1].name == "two_sequences"
    for sc in plan:
        assert sum(sc.chunks) == length and min(sc.chunks) >= 1
        assert sc.starts == tuple(sum(sc.chunks[:c]) for c in range(len(sc.chunks)))
    chunks = next(sc for sc in plan if sc.name == "chunks").chunks
    assert chunks[0] == 3 and (length < 7 or chunks[1] == 4)
    prefills = [sc.name for sc in plan if sc.name.startswith("prefill_")]
    assert prefills == [f"prefill_{p}" for p in (5, 17) if p < length]
    assert next(sc for sc in plan if sc.name == "two_sequences").calls == 2 * length


# --- the Done-when table ----------------------------------------------------------------------------

@pytest.mark.parametrize("factory, decode", [
    ("plain", "decode_list"), ("plain_rotary", "decode_list"), ("past_rotary", "decode_past")],
    ids=["list-cache", "list-cache-rotary", "past-key-values-rotary"])
def test_correct_decode_paths_pass_with_zero_findings(factory, decode):
    rows, details = rows_for(factory, decode)
    assert list(rows) == list(SCENARIOS)
    assert details["positions"] == T and details["scenarios"]["chunks"] == [3, 4, 3, 4, 3, 1]
    for name, row in rows.items():
        assert row.status == "pass", (name, row.checks)
        call, par = row.checks
        assert (call.level, call.name, call.status, call.value) == (1, "decode_call", "pass", row.fields["calls"])
        assert (par.level, par.name, par.status) == (4, "decode_parity", "pass")
        assert par.value <= par.limit and par.limit == pytest.approx(par.data["rel_tolerance"] * par.data["scale"])
        assert par.data["bad_positions"] == 0 and row.fields["first_bad"] is None
    assert rows["decode_two_sequences"].fields["calls"] == 2 * T


FIRST_BAD = {"decode_tokens": 1, "decode_chunks": 3, "decode_prefill_5": 5, "decode_prefill_17": 17,
             "decode_two_sequences": 1}


def test_offset_off_by_one_is_positions_offset_at_the_first_cached_position():
    rows, _ = rows_for("past_rotary", "decode_past_off_by_one")
    for name, first in FIRST_BAD.items():
        par = parity(rows, name)
        assert par.status == "fail" and par.value > par.limit
        assert par.location["position"] == first and par.location["chunk"] == 1
        assert par.location["chunk_start"] == first
        assert par.data["diagnosis"] == "positions_offset" and par.reason.startswith("positions offset")
        ev = par.data["evidence"]
        assert ev["query_offset"] == 1 and ev["restarting"] is False
        assert ev["query_positions"][0] == first + 1 and ev["expected_query_positions"][0] == first
        assert ev["position_encoding"] == {"kind": "rotary", "pairing": "half", "base": 10000.0, "rotated_dim": 8,
                                           "head_dim": 8}
    assert parity(rows, "decode_two_sequences").location["sequence"] == 0


def test_rotary_restarting_at_zero_is_positions_offset_restarting():
    rows, _ = rows_for("past_rotary", "decode_past_no_offset")
    for name, first in FIRST_BAD.items():
        par = parity(rows, name)
        assert par.status == "fail" and par.location["position"] == first
        assert par.data["diagnosis"] == "positions_offset" and par.data["evidence"]["restarting"] is True
        size = par.location["chunk_size"]
        assert par.data["evidence"]["query_positions"] == list(range(size))


@pytest.mark.parametrize("factory", ["plain", "plain_rotary"])
def test_cache_sliced_one_short(factory):
    rows, _ = rows_for(factory, "decode_list_one_short")
    for name, first in FIRST_BAD.items():
        par = parity(rows, name)
        assert par.status == "fail" and par.location["position"] == first
        assert par.data["diagnosis"] == "cache_one_short" and par.data["diagnosed_by"] == "observed keys"
        ev = par.data["evidence"]
        assert ev["missing_position"] == first - 1 and ev["keys_read"] == ev["expected_keys"] - 1


@pytest.mark.parametrize("factory", ["plain", "plain_rotary"])
def test_unshifted_causal_mask_fails_on_chunks_only(factory):
    rows, _ = rows_for(factory, "decode_list_unshifted_mask")
    failing = [name for name, row in rows.items() if row.status == "fail"]
    assert failing == ["decode_chunks"]
    par = parity(rows, "decode_chunks")
    assert par.location == {"position": 3, "chunk": 1, "chunk_start": 3, "chunk_size": 4}
    assert par.data["diagnosis"] == "mask_not_shifted" and par.data["diagnosed_by"] == "changed tokens"
    # top-left alignment: row 3 reads keys 0 only, so it misses the cached 1 and 2
    assert [3, 2] in par.data["evidence"]["not_read"] and par.data["evidence"]["read_after_row"] == []


def test_state_shared_between_caches():
    rows, _ = rows_for("plain_rotary", "decode_list_shared")
    assert [n for n, r in rows.items() if r.status == "fail"] == ["decode_two_sequences"]
    par = parity(rows, "decode_two_sequences")
    assert par.location["sequence"] == 0 and par.location["position"] == 1
    assert par.data["diagnosis"] == "state_shared" and par.data["diagnosed_by"] == "decoded alone"
    ev = par.data["evidence"]
    assert ev["alone_max_delta"] <= ev["tolerance"] < ev["beside_another_delta"]


# --- diagnoses from outside, where the core cannot be observed -----------------------------------

SMALL = 8


def test_einsum_attention_passes_and_is_not_observed():
    rows, _ = rows_for("einsum", "decode_einsum", SMALL)
    assert all(r.status == "pass" for r in rows.values())


def test_one_short_found_from_outside():
    rows, _ = rows_for("einsum", "decode_einsum_one_short", SMALL)
    par = parity(rows, "decode_tokens")
    assert par.data["diagnosis"] == "cache_one_short" and par.data["evidence"]["missing_position"] == 0
    assert par.data["evidence"]["core"] == "not observed in the decode call"
    assert par.data["diagnosed_by"] in ("full forward without one position", "changed tokens")
    chunks = parity(rows, "decode_chunks")
    assert chunks.data["diagnosis"] == "cache_one_short" and chunks.data["evidence"]["missing_position"] == 2


def test_one_long_found_from_outside_and_observed():
    # the first token's key twice changes nothing (one key, softmax of two equal scores), so position 1 is first
    outside, _ = rows_for("einsum", "decode_einsum_one_long", SMALL)
    par = parity(outside, "decode_tokens")
    assert par.location["position"] == 1 and par.data["diagnosis"] == "cache_one_long"
    assert par.data["evidence"]["duplicated_position"] == 1
    assert par.data["diagnosed_by"] == "full forward with twice one position"
    observed, _ = rows_for("plain_rotary", "decode_list_one_long", SMALL)
    par = parity(observed, "decode_tokens")
    assert par.location["position"] == 1
    assert par.data["diagnosis"] == "cache_one_long" and par.data["diagnosed_by"] == "observed keys"
    assert par.data["evidence"]["duplicated_position"] == 1 and par.data["evidence"]["keys_read"] == 3


def test_unshifted_mask_found_from_outside():
    rows, _ = rows_for("einsum", "decode_einsum_unshifted_mask", SMALL)
    assert [n for n, r in rows.items() if r.status == "fail"] == ["decode_chunks"]
    par = parity(rows, "decode_chunks")
    assert par.data["diagnosis"] == "mask_not_shifted" and par.data["evidence"]["not_read"]


def test_state_outside_the_cache_found_by_a_rerun():
    rows, _ = rows_for("plain", "decode_drifting", SMALL)
    par = parity(rows, "decode_tokens")
    assert par.location["position"] == 0
    assert par.data["diagnosis"] == "state_shared" and par.data["diagnosed_by"] == "rerun"
    assert par.data["evidence"]["rerun_delta"] > par.limit


def test_output_of_another_position_is_positions_offset():
    rows, _ = rows_for("plain", "decode_lagging", SMALL)
    par = parity(rows, "decode_tokens")
    assert par.location["position"] == 1 and par.data["diagnosis"] == "positions_offset"
    assert par.data["evidence"]["output_position"] == 0 and par.data["diagnosed_by"] == "full forward"


def test_a_disagreement_that_fits_nothing_is_unexplained():
    rows, _ = rows_for("plain", "decode_scaled", SMALL)
    for row in rows.values():
        par = row.check("decode_parity")
        assert par.status == "fail" and par.location["position"] == 0
        assert par.data["diagnosis"] == "unexplained" and par.reason == DIAGNOSES["unexplained"]
        assert par.data["evidence"]["core_inputs"] == "as in the full forward"


@pytest.mark.parametrize("s, t, future, unread, expected", [
    (3, 3, [[3, 4]], [], "mask_not_shifted"),
    (3, 3, [], [[3, 2], [4, 2], [5, 2]], "cache_one_short"),
    (3, 3, [], [[3, 1], [3, 2], [4, 2]], "mask_not_shifted"),
    (3, 3, [], [[4, 3]], "mask_not_shifted"),  # a key inside the chunk
    (5, 1, [], [[5, 2], [5, 4]], "mask_not_shifted"),  # one token, several past keys
    (5, 1, [], [[5, 4]], "cache_one_short"),
    (3, 3, [], [[3, 1], [3, 2], [4, 1], [4, 2], [5, 1], [5, 2]], None),  # a chunk's worth of cache lost: no name
    (3, 3, [], [], None),
], ids=["future", "one-key-every-row", "row-dependent", "inside-chunk", "several-keys", "one-token-one-key",
        "several-keys-every-row", "as-expected"])
def test_dependency_patterns(s, t, future, unread, expected):
    found = _judge_dependency(s, t, future, unread)
    assert (found.kind if found else None) == expected


# --- level 1 and usage ----------------------------------------------------------------------

@pytest.mark.parametrize("decode, words", [
    ("decode_raises", "decode raised RuntimeError"), ("decode_wrong_shape", "shape"),
    ("decode_not_a_pair", "expected a pair"), ("decode_meta", "meta tensor")],
    ids=["raises", "wrong-shape", "not-a-pair", "meta"])
def test_bad_decode_calls_are_level_one_findings(decode, words):
    rows, _ = rows_for("plain", decode, SMALL)
    for row in rows.values():
        call, par = row.checks
        assert (call.level, call.status) == (1, "fail") and words in call.reason
        assert par.status == "not_reached"
    first = rows["decode_tokens"].check("decode_call")
    expected_chunk = 1 if decode == "decode_raises" else 0
    assert first.location["chunk"] == expected_chunk and first.location["position"] == expected_chunk


def test_validate_decode_signature():
    validate_decode(lambda module, x_new, cache: None)
    validate_decode(lambda *args: None)
    validate_decode(lambda module, x_new, cache=None, *, extra=1: None)
    for bad in (cases.decode_two_arguments, lambda module, x_new, cache, more: None, 3):
        with pytest.raises(SetupError, match="--decode"):
            validate_decode(bad)


def test_check_module_appends_decode_rows_and_refuses_non_causal():
    report = check_module(cases.fixture("plain_rotary"), E, NH, decode=cases.fixture("decode_list_one_short"))
    names = [r.name for r in report.rows]
    assert names[-5:] == list(SCENARIOS) and report.exit_code == 1
    assert report.first_finding.row == "decode_tokens" and report.first_finding.name == "decode_parity"
    assert report.details["decode"]["positions"] == 32
    with pytest.raises(InputError, match="causal"):
        check_module(cases.fixture("plain"), E, NH, causal=False, decode=cases.fixture("decode_list"))


MODULE = ["check", "--module", f"{FIXTURE}:plain_rotary", "--embed-dim", str(E), "--heads", str(NH)]


@pytest.mark.parametrize("args", [
    ["check", "--decode", f"{FIXTURE}:decode_list"],
    ["check", f"{FIXTURE}:decode_list", "--decode", f"{FIXTURE}:decode_list"],
    MODULE + ["--no-causal", "--decode", f"{FIXTURE}:decode_list"],
    MODULE + ["--decode", f"{TESTS}:decode_two_arguments"],
    MODULE + ["--decode", f"{FIXTURE}:no_such_name"],
    MODULE + ["--decode", "missing.py:decode"],
], ids=["without-module", "with-kernel", "no-causal", "signature", "missing-name", "missing-file"])
def test_cli_decode_usage_errors_exit_2_with_one_line(args, tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(app, args + ["--output", str(out)])
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and "--decode" in res.output and not out.exists()


def test_cli_decode_pass_and_level_one_failure():
    import jsonschema

    good = runner.invoke(app, MODULE + ["--decode", f"{FIXTURE}:decode_list", "--format", "json"])
    assert good.exit_code == 0, good.output
    doc = json.loads(good.stdout)
    jsonschema.validate(doc, schema())
    decoded = [r for r in doc["rows"] if r["name"].startswith("decode_")]
    assert [r["name"] for r in decoded] == list(SCENARIOS) and {r["status"] for r in decoded} == {"pass"}
    bad = runner.invoke(app, MODULE + ["--decode", f"{TESTS}:decode_raises", "--format", "json"])
    assert bad.exit_code == 1
    first = json.loads(bad.stdout)["first_finding"]
    assert (first["row"], first["level"], first["check"]) == ("decode_tokens", 1, "decode_call")


def test_docs_show_the_protocol_with_the_fixture_adapters_and_help_names_decode():
    import inspect

    doc = (cases.Path(__file__).resolve().parents[1] / "docs" / "check-decode.md").read_text()
    assert "def NAME(module, x_new, cache):" in doc
    for name in ("causal_allowed", "decode_list", "decode_past", "PastAttention"):
        assert inspect.getsource(cases.fixture(name)).rstrip() in doc, name
    for scenario in SCENARIOS:
        assert f"`{scenario}`" in doc
    for kind in DIAGNOSES:
        assert f"`{kind}`" in doc
    res = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--decode" in res.output


def test_grouped_kv_heads_repeated_in_decode_and_not_in_the_full_forward():
    # the full forward gives SDPA Nkv kv heads (enable_gqa), the decode path Nh repeated ones: positions
    # are still read off the observed keys, so the offset is named rather than left unexplained
    E4, NH4 = 16, 4
    import torch

    rows = {}
    for decode in ("decode_grouped", "decode_grouped_off_by_one"):
        torch.manual_seed(0)
        found, _ = decode_rows(cases.grouped_rotary(E4, NH4), getattr(cases, decode), E4, length=SMALL)
        rows[decode] = {r.name: r for r in found}
    assert all(r.status == "pass" for r in rows["decode_grouped"].values())
    for name, row in rows["decode_grouped_off_by_one"].items():
        par = row.check("decode_parity")
        assert par.status == "fail" and par.data["diagnosis"] == "positions_offset", name
        assert par.data["diagnosed_by"] == "observed q and k" and par.data["evidence"]["query_offset"] == 1
        assert par.data["evidence"]["keys_misplaced"] == par.location["chunk_size"]  # the new keys only


@pytest.mark.parametrize("factory, decode, diagnosis", [("past_rotary", "decode_past_off_by_one", "positions_offset"),
                                                       ("plain_rotary", "decode_list_one_short", "cache_one_short")])
def test_cli_decode_judged_apart_from_the_worker_matches_in_process(factory, decode, diagnosis):
    """Through the worker every decode step, the full forwards and the observed cores are round trips;
    the report is the one the in-process check makes, diagnosis included."""
    args = ["check", "--module", f"{FIXTURE}:{factory}", "--decode", f"{FIXTURE}:{decode}", "--embed-dim", "64",
            "--heads", "4", "--format", "json"]
    worker = runner.invoke(app, args)
    here = runner.invoke(app, [*args, "--in-process"])
    assert worker.exit_code == here.exit_code == 1, worker.output[-2000:]
    assert worker.stdout == here.stdout
    rows = {r["name"]: r for r in json.loads(worker.stdout)["rows"]}
    assert rows["decode_prefill_5"]["fields"]["diagnosis"] == diagnosis
