"""polarity: probed conventions, the seed's polarity findings, the blocked-row audit, mask fingerprints."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.maths import masks
from attn_ledger.cli import app
from attn_ledger.experiments import polarity as pol
from attn_ledger.render import render
from attn_ledger.render.text import fmt_value
from attn_ledger.inputs.tensorio import save_tensor_file

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["polarity", *args])


@pytest.fixture(scope="module")
def apis_doc() -> dict:
    result = invoke("--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def row(doc, name) -> dict:
    return next(r for r in doc["rows"] if r["name"] == name)


def check(doc, row_name, check_name) -> dict:
    return next(c for c in row(doc, row_name)["checks"] if c["name"] == check_name)


def test_rows_are_one_per_api_call_then_key_padding_mask(apis_doc):
    assert apis_doc["command"] == "polarity" and apis_doc["verdict"] == "pass" and apis_doc["first_finding"] is None
    assert [r["name"] for r in apis_doc["rows"]] == [
        "manual", "manual inverted", "sdpa", "sdpa inverted", "mha", "mha inverted", "mha key_padding_mask"]
    assert all(r["status"] == "pass" for r in apis_doc["rows"])
    details = apis_doc["details"]
    assert details["mode"] == "apis" and details["torch_version"] == torch.__version__
    assert details["case"] == {"B": 2, "Nh": 2, "Tq": 4, "Tk": 4, "E": 8, "Dh": 4, "relation": "causal",
                               "tolerance": 1e-5}


def test_conventions_probed_and_documented(apis_doc):
    conv = {c["api"]: c for c in apis_doc["details"]["conventions"]}
    sdpa = conv["F.scaled_dot_product_attention attn_mask"]
    assert sdpa["probed"] == sdpa["documented"] == "allow" and "take part" in sdpa["doc_line"]
    mha = conv["nn.MultiheadAttention attn_mask"]
    assert mha["probed"] == mha["documented"] == "block" and "not allowed to attend" in mha["doc_line"]
    kpm = conv["nn.MultiheadAttention key_padding_mask"]
    assert kpm["probed"] == "block" and "ignored" in kpm["doc_line"]
    assert all(c["agree"] for c in apis_doc["details"]["conventions"])
    for name, api in (("manual", "manual pipeline (attn_ledger.maths.pipeline)"), ("sdpa", "F.scaled_dot_product_attention attn_mask"),
                      ("mha", "nn.MultiheadAttention attn_mask"), ("mha key_padding_mask", "nn.MultiheadAttention key_padding_mask")):
        c = check(apis_doc, name, "convention")
        assert c["status"] == "pass" and c["data"]["api"] == api
        assert c["data"]["probed"] == c["data"]["documented"] == conv[api]["probed"]
        assert row(apis_doc, name)["fields"]["convention"] == conv[api]["probed"]
    assert [c["name"] for c in row(apis_doc, "sdpa inverted")["checks"]] == ["inverted_polarity_caught"]


def test_correct_polarity_matches_the_causal_reference(apis_doc):
    for api in ("manual", "sdpa", "mha"):
        f = row(apis_doc, api)["fields"]
        assert f["correct"] is True and f["finite"] is True and f["max_abs_diff"] < 1e-5
        assert f["forbidden_weight"] == 0.0 and f["blocked_rows"] == []
        c = check(apis_doc, api, "correct_polarity")
        assert c["status"] == "pass" and c["value"] == f["max_abs_diff"] and (c["limit"], c["op"]) == (1e-5, "<=")
    assert row(apis_doc, "mha")["fields"]["passed"] == "block" and row(apis_doc, "sdpa")["fields"]["passed"] == "allow"


def test_wrong_polarity_through_sdpa_gives_finite_wrong_numbers(apis_doc):
    f = row(apis_doc, "sdpa inverted")["fields"]
    assert f["correct"] is False and f["passed"] == "block"
    assert f["finite"] is True and f["max_abs_diff"] > 0.5
    assert f["forbidden_weight"] == pytest.approx(1.0)
    c = check(apis_doc, "sdpa inverted", "inverted_polarity_caught")
    assert c["status"] == "pass" and c["value"] == f["max_abs_diff"] and c["data"]["finite"] is True


def test_wrong_polarity_through_mha_gives_nan_rows_and_weight_one_on_the_future(apis_doc):
    f = row(apis_doc, "mha inverted")["fields"]
    assert f["finite"] is False and f["max_abs_diff"] == "nan"
    assert f["forbidden_weight"] == pytest.approx(1.0)
    assert f["blocked_rows"] == [3]  # the last query: every key at or before it is blocked
    c = check(apis_doc, "mha inverted", "inverted_polarity_caught")
    assert c["status"] == "pass" and c["value"] == "nan" and c["data"]["finite"] is False
    assert row(apis_doc, "manual inverted")["fields"]["finite"] is False


def test_fully_blocked_row_audit(apis_doc):
    audit = apis_doc["details"]["blocked_row_audit"]
    assert audit["query"] == 1
    got = {(r["api"], r["path"]): r for r in audit["rows"]}
    assert got[("manual", "masked_fill(-inf), softmax")]["returns"] == "NaN"
    assert {r["api"] for r in audit["rows"]} == {"manual", "sdpa", "mha"}
    mha_paths = [r for r in audit["rows"] if r["api"] == "mha"]
    assert len(mha_paths) == 3
    assert all(r["returns"] in {"NaN", "zeros", "mean of V", "other finite", "error"} for r in audit["rows"])
    fast = next(r for r in mha_paths if "fast path (eval" in r["path"])
    assert "fast path" in fast["detail"]
    kinds = {r["returns"] for r in mha_paths}
    assert (len(kinds) > 1) == any(d.startswith("mha:") for d in audit["disagreements"])


def test_audit_disagreements_lists_only_split_apis():
    rows = (pol.AuditRow("a", "p1", "NaN", True), pol.AuditRow("a", "p2", "zeros", True),
            pol.AuditRow("b", "p1", "zeros", True), pol.AuditRow("b", "p2", "zeros", True))
    lines = pol.audit_disagreements(rows)
    assert len(lines) == 1 and lines[0].startswith("a: p1 -> NaN; p2 -> zeros")


def test_probe_disagreeing_with_documentation_exits_1(monkeypatch):
    monkeypatch.setattr(pol, "probe_sdpa", lambda: pol.BLOCK)
    result = invoke("--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    c = check(doc, "sdpa", "convention")
    assert c["status"] == "fail" and (c["data"]["probed"], c["data"]["documented"]) == ("block", "allow")
    assert check(doc, "mha", "convention")["status"] == "pass"
    assert doc["first_finding"]["row"] == "sdpa" and doc["first_finding"]["check"] == "convention"


def test_documentation_line_not_found_exits_1(monkeypatch):
    monkeypatch.setattr(pol, "doc_sentence", lambda text: None)
    result = invoke("--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    conv = [c for c in doc["details"]["conventions"] if not c["api"].startswith("manual")]
    assert len(conv) == 3 and all(c["doc_line"] is None and c["agree"] is False for c in conv)
    for name in ("sdpa", "mha", "mha key_padding_mask"):
        c = check(doc, name, "convention")
        assert c["status"] == "fail" and c["data"]["documented"] is None
    assert check(doc, "manual", "convention")["status"] == "pass"


def test_wrong_belief_about_a_convention_fails_the_correct_polarity_check(monkeypatch):
    monkeypatch.setattr(masks, "to_mha_bool", lambda allow: allow)  # as if MHA took allow polarity
    result = invoke("--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    c = check(doc, "mha", "correct_polarity")
    assert c["status"] == "fail" and c["value"] == "nan"  # the last query sees every key blocked: NaN
    assert check(doc, "sdpa", "correct_polarity")["status"] == "pass"
    assert doc["first_finding"]["row"] == "mha" and doc["first_finding"]["check"] == "correct_polarity"


def _call(correct, finite, diff):
    return pol.PolarityCall("sdpa", "allow", "allow" if correct else "block", correct, finite, diff, 0.0, ())


@pytest.mark.parametrize(
    "call, status",
    [
        (_call(True, True, 1e-7), "pass"),
        (_call(True, True, 2.0), "fail"),
        (_call(True, False, float("nan")), "fail"),
        (_call(False, True, 2.0), "pass"),
        (_call(False, False, float("nan")), "pass"),
        (_call(False, True, 0.0), "fail"),
    ],
    ids=["correct-matches", "correct-wrong-numbers", "correct-nan", "inverted-caught", "inverted-nan-caught",
         "inverted-unnoticed"],
)
def test_polarity_check_passes_and_fails(call, status):
    c = pol.polarity_check(call)
    assert c.name == ("correct_polarity" if call.correct else "inverted_polarity_caught")
    assert c.status == status and c.limit == pol.TOLERANCE
    assert c.value == call.max_abs_diff or (c.value != c.value and call.max_abs_diff != call.max_abs_diff)


def test_inverted_polarity_control_fails_the_report_when_nothing_is_detected():
    convs = pol.conventions()
    calls = (_call(True, True, 1e-7), _call(False, True, 0.0))
    audit = (pol.AuditRow("sdpa", "p", "zeros", True),)
    report = pol.polarity_report("x", convs, calls, audit)
    assert report.verdict == "fail" and report.exit_code == 1
    assert report.first_finding.row == "sdpa inverted" and report.first_finding.name == "inverted_polarity_caught"
    assert report.row("sdpa").status == "pass" and report.row("sdpa inverted").status == "fail"


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ("A boolean mask where a value of True indicates that the element *should* take part in attention.", "allow"),
        ("For a binary mask, a ``True`` value indicates that the corresponding position is not allowed to attend.", "block"),
        ("For a binary mask, a True value means the key will be ignored.", "block"),
        ("A boolean mask selects things.", None),
        (None, None),
    ],
    ids=["sdpa", "mha", "kpm", "vague", "missing"],
)
def test_doc_polarity(sentence, expected):
    assert pol.doc_polarity(sentence) == expected


def test_param_section_stops_at_the_next_argument():
    doc = "Args:\n    a: first.\n        A boolean mask where True blocks.\n    b: second.\n"
    assert pol.param_section(doc, "a") == "a: first. A boolean mask where True blocks."
    assert pol.param_section(doc, "c") == ""


def test_table_and_markdown_render(tmp_path):
    out = tmp_path / "p.md"
    assert invoke("--format", "markdown", "--output", str(out)).exit_code == 0
    text = out.read_text()
    assert "| api | status |" in text and "inverted_polarity_caught" in text
    table = invoke().stdout
    assert "mha key_padding_mask" in table and "torch " + torch.__version__ in table


def _tokens(text: str) -> set[str]:
    return {t for t in text.split() if any(ch.isdigit() for ch in t) or "_" in t}


def test_table_at_80_columns_keeps_every_number_and_identifier_whole():
    report = pol.run_polarity()
    wide, narrow = render(report, "table", 240, detail=True), render(report, "table", 80, detail=True)
    assert _tokens(wide) <= _tokens(narrow)
    words = narrow.split()
    for r in report.rows:
        assert r.name in narrow
        for value in r.fields.values():
            assert fmt_value(value) in words or fmt_value(value) in narrow
        for c in r.checks:
            assert c.name in words


def test_json_is_identical_on_a_second_run(apis_doc):
    assert json.loads(invoke("--format", "json").stdout) == apis_doc
    assert invoke("--format", "json").stdout == invoke("--format", "json").stdout


def test_junit_has_one_case_per_row():
    from xml.etree import ElementTree as ET

    result = invoke("--format", "junit")
    assert result.exit_code == 0
    suite = ET.fromstring(result.stdout).find("testsuite")
    assert len(suite.findall("testcase")) == int(suite.get("tests")) == 7 and suite.get("failures") == "0"


# --- --mask fingerprints -------------------------------------------------------------------

def _causal(tq=4, tk=4, align="bottom-right"):
    return masks.causal(tq, tk, align)


def _pad(lengths, tk=5, side="right"):
    return masks.valid_from_lengths(lengths, tk, side)


NEG_INF = float("-inf")

CASES = [
    # id, tensors, suffix, args, exit, kind, polarity
    ("causal-allow", {"mask": _causal()}, ".pt", ["--expect", "causal"], 0, "bool", "allow"),
    ("causal-block-batched", {"mask": ~_causal().expand(2, 3, 4, 4).contiguous()}, ".safetensors",
     ["--expect", "causal"], 0, "bool", "block"),
    ("causal-additive", {"m": torch.zeros(4, 4).masked_fill(~_causal(), NEG_INF)}, ".npz",
     ["--expect", "causal"], 0, "float additive (0 / -inf)", "allow"),
    ("causal-large-negative", {"mask": torch.zeros(4, 4).masked_fill(~_causal(), -1e9)}, ".pt",
     ["--expect", "causal"], 0, "float additive (0 / -1e+09)", "allow"),
    ("causal-float01-trap", {"mask": _causal().float()}, ".pt", ["--expect", "causal"], 1, "float 0/1", "allow"),
    ("causal-integer", {"mask": _causal().to(torch.uint8)}, ".pt", ["--expect", "causal"], 0, "integer 0/1", "allow"),
    ("causal-neither", {"mask": torch.eye(4, dtype=torch.bool)}, ".pt", ["--expect", "causal"], 1, "bool", None),
    ("causal-bias", {"mask": torch.arange(16.0).reshape(4, 4) * -0.5}, ".pt", ["--expect", "causal"], 1, "float other", None),
    ("additive-wrong-relation", {"mask": torch.zeros(4, 4).masked_fill(_causal(), NEG_INF)}, ".pt",
     ["--expect", "causal"], 1, "float additive (0 / -inf)", None),
    ("padding-right-allow", {"mask": _pad([5, 3])}, ".pt", ["--expect", "padding"], 0, "bool", "allow"),
    ("padding-right-block", {"mask": ~_pad([5, 3])}, ".npz", ["--expect", "padding"], 0, "bool", "block"),
    ("padding-left", {"mask": _pad([2, 4], side="left")}, ".pt",
     ["--expect", "padding", "--padding-side", "left"], 0, "bool", "allow"),
    # a left-padded allow mask is the complement of a right-padded block mask: --padding-side decides
    ("padding-left-read-as-right", {"mask": _pad([2, 4], side="left")}, ".pt", ["--expect", "padding"], 0, "bool", "block"),
    ("padding-gap", {"mask": torch.tensor([[True, False, True, False]])}, ".pt", ["--expect", "padding"], 1, "bool", None),
    ("padding-float01-trap", {"mask": _pad([5, 3]).float()}, ".pt", ["--expect", "padding"], 1, "float 0/1", "allow"),
]


def mask_doc(tmp_path, tensors, *args, suffix=".pt") -> tuple[int, dict]:
    path = tmp_path / f"mask{suffix}"
    save_tensor_file(tensors, path)
    result = invoke("--mask", str(path), *args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("tensors, suffix, args, code, kind, polarity", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mask_fingerprint(tmp_path, tensors, suffix, args, code, kind, polarity):
    exit_code, doc = mask_doc(tmp_path, tensors, *args, suffix=suffix)
    assert exit_code == code, doc
    details = doc["details"]
    assert details["mode"] == "mask" and details["kind"] == kind and details["polarity"] == polarity
    assert doc["verdict"] == ("pass" if code == 0 else "fail")
    assert details["trap"] is kind.startswith("float 0/1")
    assert details["advice"]
    (mask_row,) = doc["rows"]
    assert mask_row["name"] == details["tensor"] and mask_row["shape"] == details["shape"]
    assert mask_row["fields"]["kind"] == kind and mask_row["fields"]["polarity"] == polarity
    checks = {c["name"]: c for c in mask_row["checks"]}
    assert checks["relation_match"]["status"] == ("fail" if polarity is None else "pass")
    assert checks["relation_match"]["data"]["polarity"] == polarity
    trap = "fail" if kind.startswith("float 0/1") else ("pass" if kind.startswith("float") else "not_applicable")
    assert checks["float_01_trap"]["status"] == trap
    if code:
        assert doc["first_finding"]["row"] == mask_row["name"]
        assert doc["first_finding"]["check"] == ("relation_match" if polarity is None else "float_01_trap")
    else:
        assert doc["first_finding"] is None


def test_causal_alignment_is_reported(tmp_path):
    for align in ("bottom-right", "top-left"):
        _, doc = mask_doc(tmp_path, {"mask": _causal(3, 5, align)}, "--expect", "causal")
        assert doc["details"]["alignment"] == doc["rows"][0]["fields"]["alignment"] == align
    _, doc = mask_doc(tmp_path, {"mask": _causal()}, "--expect", "causal")
    assert doc["details"]["alignment"] == "both (Tq == Tk)"
    _, doc = mask_doc(tmp_path, {"mask": _pad([5, 3])}, "--expect", "padding")
    assert doc["details"]["alignment"] is None and "alignment" not in doc["rows"][0]["fields"]
    assert doc["details"]["padding_side"] == "right"


def test_fully_blocked_rows_are_counted(tmp_path):
    _, doc = mask_doc(tmp_path, {"mask": _pad([3, 0])}, "--expect", "padding")  # example 1 has no valid key
    assert doc["details"]["polarity"] == "allow"
    assert (doc["details"]["fully_blocked_rows"], doc["details"]["total_rows"]) == (1, 2)
    assert (doc["rows"][0]["fields"]["fully_blocked_rows"], doc["rows"][0]["fields"]["total_rows"]) == (1, 2)
    # Tq > Tk bottom-right: the first two queries see nothing
    _, doc = mask_doc(tmp_path, {"mask": _causal(5, 3)}, "--expect", "causal")
    assert doc["details"]["fully_blocked_rows"] == doc["rows"][0]["fields"]["fully_blocked_rows"] == 2
    _, doc = mask_doc(tmp_path, {"mask": _causal()}, "--expect", "causal")
    assert doc["details"]["fully_blocked_rows"] == 0
    # a mask that matches neither polarity has no reading to count with
    _, doc = mask_doc(tmp_path, {"mask": torch.eye(4, dtype=torch.bool)}, "--expect", "causal")
    assert doc["details"]["fully_blocked_rows"] is None and doc["details"]["total_rows"] == 4


def test_advice_names_the_conversion(tmp_path):
    path = tmp_path / "allow.pt"
    save_tensor_file({"mask": _causal()}, path)
    doc = json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)
    advice = {a["api"]: a for a in doc["details"]["advice"]}
    assert advice["F.scaled_dot_product_attention"]["unchanged"] is True
    assert advice["nn.MultiheadAttention"]["unchanged"] is False and "~mask" in advice["nn.MultiheadAttention"]["how"]
    text = invoke("--mask", str(path), "--expect", "causal").stdout
    assert "nn.MultiheadAttention needs a conversion: attn_mask = ~mask" in text


def test_mask_table_at_80_columns_keeps_every_number_and_identifier_whole(tmp_path):
    path = tmp_path / "pad.pt"
    save_tensor_file({"mask": _pad([3, 0])}, path)
    report = pol.fingerprint(path, "padding")
    wide, narrow = render(report, "table", 240, detail=True), render(report, "table", 80, detail=True)
    assert _tokens(wide) <= _tokens(narrow)
    assert "mask[:,None,None,:]" in narrow.split()


@pytest.mark.parametrize(
    "tensors, args, needle",
    [
        ({"a": _causal(), "b": _causal()}, ["--expect", "causal"], "expected a tensor named 'mask' or exactly one tensor"),
        ({"mask": torch.ones(4, dtype=torch.bool)}, ["--expect", "causal"], "expected [..., Tq, Tk]"),
        ({"mask": torch.ones(2, 3, 4, dtype=torch.bool)}, ["--expect", "padding"], "expected [B, Tk] or [B, 1, 1, Tk]"),
        ({"mask": torch.full((4, 4), 2)}, ["--expect", "causal"], "expected 0/1"),
        ({"mask": torch.full((4, 4), float("nan"))}, ["--expect", "causal"], "NaN"),
    ],
    ids=["several-tensors", "rank-1", "padding-rank-3", "int-values", "nan"],
)
def test_mask_bad_input_exits_2(tmp_path, tensors, args, needle):
    path = tmp_path / "m.pt"
    torch.save(tensors, path)
    out = tmp_path / "o.json"
    result = invoke("--mask", str(path), *args, "--output", str(out))
    assert result.exit_code == 2
    assert needle in result.stderr and not out.exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mask", "nowhere.pt", "--expect", "causal"], "file not found"),
        (["--mask", "x.pt"], "--mask: got 'x.pt', expected it together with --expect"),
        (["--expect", "causal"], "--expect: got 'causal', expected it together with --mask"),
    ],
    ids=["missing", "no-expect", "no-mask"],
)
def test_usage_errors_exit_2(args, needle):
    result = invoke(*args)
    assert result.exit_code == 2
    assert needle in result.stderr
