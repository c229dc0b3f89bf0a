"""polarity: probed conventions, the seed's polarity findings, the blocked-row audit, mask fingerprints."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger import masks
from attn_ledger.cli import app
from attn_ledger.experiments import polarity as pol
from attn_ledger.tensorio import save_tensor_file

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["polarity", *args])


@pytest.fixture(scope="module")
def apis_doc() -> dict:
    result = invoke("--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def row(doc, api, correct):
    return next(r for r in doc["rows"] if r["api"] == api and r["correct"] is correct)


def test_conventions_probed_and_documented(apis_doc):
    assert apis_doc["command"] == "polarity" and apis_doc["verdict"] == "pass"
    assert apis_doc["torch_version"] == torch.__version__
    conv = {c["api"]: c for c in apis_doc["conventions"]}
    sdpa = conv["F.scaled_dot_product_attention attn_mask"]
    assert sdpa["probed"] == sdpa["documented"] == "allow" and "take part" in sdpa["doc_line"]
    mha = conv["nn.MultiheadAttention attn_mask"]
    assert mha["probed"] == mha["documented"] == "block" and "not allowed to attend" in mha["doc_line"]
    kpm = conv["nn.MultiheadAttention key_padding_mask"]
    assert kpm["probed"] == "block" and "ignored" in kpm["doc_line"]
    assert all(c["agree"] for c in apis_doc["conventions"])


def test_correct_polarity_matches_the_causal_reference(apis_doc):
    for api in ("manual", "sdpa", "mha"):
        r = row(apis_doc, api, True)
        assert r["verdict"] == "ok" and r["finite"] and r["max_abs_diff"] < 1e-5
        assert r["forbidden_weight"] == 0.0 and r["blocked_rows"] == []


def test_wrong_polarity_through_sdpa_gives_finite_wrong_numbers(apis_doc):
    r = row(apis_doc, "sdpa", False)
    assert r["finite"] is True and r["verdict"] == "wrong finite numbers"
    assert r["max_abs_diff"] > 0.5
    assert r["forbidden_weight"] == pytest.approx(1.0)


def test_wrong_polarity_through_mha_gives_nan_rows_and_weight_one_on_the_future(apis_doc):
    r = row(apis_doc, "mha", False)
    assert r["finite"] is False and r["verdict"] == "NaN" and r["max_abs_diff"] == "nan"
    assert r["forbidden_weight"] == pytest.approx(1.0)
    assert r["blocked_rows"] == [3]  # the last query: every key at or before it is blocked
    assert row(apis_doc, "manual", False)["verdict"] == "NaN"


def test_fully_blocked_row_audit(apis_doc):
    audit = apis_doc["blocked_row_audit"]
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
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["convention[F.scaled_dot_product_attention attn_mask]"]["ok"] is False
    assert checks["convention[nn.MultiheadAttention attn_mask]"]["ok"] is True


def test_documentation_line_not_found_exits_1(monkeypatch):
    monkeypatch.setattr(pol, "doc_sentence", lambda text: None)
    result = invoke("--format", "json")
    assert result.exit_code == 1
    conv = [c for c in json.loads(result.stdout)["conventions"] if not c["api"].startswith("manual")]
    assert len(conv) == 3 and all(c["doc_line"] is None and c["agree"] is False for c in conv)


def test_wrong_belief_about_a_convention_fails_the_correct_polarity_check(monkeypatch):
    monkeypatch.setattr(masks, "to_mha_bool", lambda allow: allow)  # as if MHA took allow polarity
    result = invoke("--format", "json")
    assert result.exit_code == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["correct_polarity[mha]"]["ok"] is False
    assert checks["correct_polarity[sdpa]"]["ok"] is True


def test_inverted_polarity_control_fails_when_nothing_is_detected():
    convs = pol.conventions()
    same = pol.PolarityRow("sdpa", "allow", "block", False, True, 0.0, 0.0, (), "ok")
    caught = pol.PolarityRow("sdpa", "allow", "block", False, True, 2.0, 1.0, (3,), "wrong finite numbers")
    assert pol.polarity_checks(convs, (same,))[-1].ok is False
    assert pol.polarity_checks(convs, (caught,))[-1].ok is True


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
    assert "wrong finite numbers" in text and "documentation line" in text
    table = invoke().stdout
    assert "Fully blocked row" in table and "torch " + torch.__version__ in table


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


@pytest.mark.parametrize("tensors, suffix, args, code, kind, polarity", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mask_fingerprint(tmp_path, tensors, suffix, args, code, kind, polarity):
    path = tmp_path / f"mask{suffix}"
    save_tensor_file(tensors, path)
    result = invoke("--mask", str(path), *args, "--format", "json")
    assert result.exit_code == code, result.output
    doc = json.loads(result.stdout)
    assert doc["mode"] == "mask" and doc["kind"] == kind and doc["polarity"] == polarity
    assert doc["verdict"] == ("pass" if code == 0 else "fail")
    assert doc["trap"] is kind.startswith("float 0/1")
    assert doc["advice"]


def test_causal_alignment_is_reported(tmp_path):
    for align, expected in (("bottom-right", "bottom-right"), ("top-left", "top-left")):
        path = tmp_path / f"{align}.pt"
        save_tensor_file({"mask": _causal(3, 5, align)}, path)
        doc = json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)
        assert doc["alignment"] == expected
    path = tmp_path / "square.pt"
    save_tensor_file({"mask": _causal()}, path)
    assert json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)["alignment"] == "both (Tq == Tk)"


def test_fully_blocked_rows_are_counted(tmp_path):
    path = tmp_path / "pad.pt"
    save_tensor_file({"mask": _pad([3, 0])}, path)  # example 1 has no valid key
    doc = json.loads(invoke("--mask", str(path), "--expect", "padding", "--format", "json").stdout)
    assert doc["polarity"] == "allow" and doc["fully_blocked_rows"] == 1 and doc["total_rows"] == 2
    path = tmp_path / "decode.pt"
    save_tensor_file({"mask": _causal(5, 3)}, path)  # Tq > Tk bottom-right: the first two queries see nothing
    doc = json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)
    assert doc["fully_blocked_rows"] == 2
    path = tmp_path / "plain.pt"
    save_tensor_file({"mask": _causal()}, path)
    assert json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)["fully_blocked_rows"] == 0


def test_advice_names_the_conversion(tmp_path):
    path = tmp_path / "allow.pt"
    save_tensor_file({"mask": _causal()}, path)
    advice = {a["api"]: a for a in json.loads(invoke("--mask", str(path), "--expect", "causal", "--format", "json").stdout)["advice"]}
    assert advice["F.scaled_dot_product_attention"]["unchanged"] is True
    assert advice["nn.MultiheadAttention"]["unchanged"] is False and "~mask" in advice["nn.MultiheadAttention"]["how"]
    text = invoke("--mask", str(path), "--expect", "causal").stdout
    assert "Which APIs can take it" in text


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
