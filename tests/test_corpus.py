"""The correct-kernel corpus: every style passes ``check`` at every CPU capability, and its margins.

``fixtures/kernels/correct/`` holds one correct kernel-protocol attention per style. Each capability
(``ATEN_CPU_CAPABILITY`` unset, ``avx2``, ``default``) runs in its own process (``scripts/corpus.py``:
the fork server keeps the environment it started with, and torch reads the variable once), all three at
once, over every default-tier case, forward and backward, at seed 0. The full tier and the 10-seed
sweep at every capability (``scripts/margins.py``) are opt-in: ``ATTN_LEDGER_FULL=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_ledger.probes.kernel.check import DEFAULT_TIER, check_case, parse_case

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
CAPABILITIES = ("unset", "avx2", "default")
FULL = pytest.mark.skipif(os.environ.get("ATTN_LEDGER_FULL") != "1",
                          reason="the full tier and the 10-seed sweep take long: ATTN_LEDGER_FULL=1")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_attn_ledger_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


corpus = _script("corpus")


def _env(cap: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap != "unset":
        env["ATEN_CPU_CAPABILITY"] = cap
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """scripts/corpus.py at each capability, one process each, started together."""
    tmp = tmp_path_factory.mktemp("corpus")
    procs = {}
    for cap in CAPABILITIES:
        out = tmp / f"{cap}.json"
        cmd = [sys.executable, str(SCRIPTS / "corpus.py"), "--seeds", "0", "--json", str(out)]
        procs[cap] = (subprocess.Popen(cmd, env=_env(cap), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True), out)
    results = {}
    for cap, (proc, out) in procs.items():
        _, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, err[-3000:]
        results[cap] = (json.loads(out.read_text(encoding="utf-8")), err)
    return results


def test_the_corpus_has_at_least_20_styles_each_under_the_protocol():
    files = corpus.corpus_files()
    assert len(files) >= 20, [f.name for f in files]
    signature = "def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None)"
    for path in files:
        text = path.read_text(encoding="utf-8")
        loaded = re.search(r'attention = kernel_file\("([^"]+)"\)\.attention', text)
        if loaded:  # the corpus holds a fixture kernel as it is: that file takes the protocol's arguments
            text = (path.parent.parent / loaded.group(1)).read_text(encoding="utf-8")
        assert signature in text or "attention = make(" in text, path.name
    marks = {p.stem: corpus.markers(p) for p in files}
    assert marks["flex_forward"]["DECLARATION"] == {"backward": False}
    assert marks["hf_eager"]["REQUIRES"] == marks["hf_sdpa"]["REQUIRES"] == ("transformers",)


@pytest.mark.parametrize("cap", CAPABILITIES)
def test_every_correct_kernel_passes_the_default_tier_forward_and_backward(runs, cap):
    run, err = runs[cap]
    kernels, skipped = run["kernels"], run["skipped"]
    assert len(kernels) + len(skipped) >= 20 and len(kernels) >= 20, (sorted(kernels), skipped)
    if run["capability"]["fell_back"]:  # the run says so, and still runs at what torch picked
        assert f"ATEN_CPU_CAPABILITY={cap} asked for" in err and "lacks it" in err
    else:
        assert run["capability"]["requested"] == (None if cap == "unset" else cap)
    failures = {name: [(f["case"], f["check"], f["value"], f["limit"]) for f in e["failures"]]
                for name, e in kernels.items() if e["failures"]}
    assert failures == {}, f"at {cap} ({run['capability']['actual']}): {failures}"
    unexpected = {name: [(w["case"], w["check"]) for w in e["warnings"]
                         if not (w["check"] == "precision" and e["precision_warning_expected"])]
                  for name, e in kernels.items()}
    assert {n: w for n, w in unexpected.items() if w} == {}
    for name, e in kernels.items():
        assert e["cases"] == len(DEFAULT_TIER), name  # every default-tier case, none skipped
        if not e["backward"]:
            assert e["backward_cases"] == 0, name
        elif e["empty_rows"] == "zeros":
            assert e["backward_cases"] == len(DEFAULT_TIER), name
        else:  # a case whose every (example, head) slice has an empty row leaves the contract nothing to judge
            assert len(DEFAULT_TIER) - 8 <= e["backward_cases"] <= len(DEFAULT_TIER), name


def test_a_capability_the_machine_lacks_is_named_in_the_run(tmp_path):
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("zvector stands for a capability this machine lacks only on x86-64")
    out = tmp_path / "lacking.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "corpus.py"), "--only", "no-such-kernel", "--json", str(out)],
                          env=_env("zvector"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    cap = json.loads(out.read_text(encoding="utf-8"))["capability"]
    assert cap["requested"] == "zvector" and cap["fell_back"] and cap["actual"] != "ZVECTOR"
    assert f"ATEN_CPU_CAPABILITY=zvector asked for, but torch runs at {cap['actual']}: this machine lacks it" in done.stderr


def test_a_kernel_whose_package_is_missing_is_listed_as_skipped_not_run(tmp_path, monkeypatch):
    (tmp_path / "needs_nothing_here.py").write_text(
        'REQUIRES = ("attn_ledger_no_such_package",)\nraise SystemExit("imported")\n', encoding="utf-8")
    (tmp_path / "_helper.py").write_text('raise SystemExit("imported")\n', encoding="utf-8")
    monkeypatch.setattr(corpus, "CORPUS", tmp_path)
    out = corpus.run_correct("default", [0], None)
    assert out["kernels"] == {} and out["skipped"] == {"needs_nothing_here": "needs attn_ledger_no_such_package"}


def test_the_corpus_reports_a_wrong_kernel_as_a_failure(tmp_path, monkeypatch):
    # the same fold the CI test reads: a near-threshold fault dropped into the corpus shows up failing
    (tmp_path / "scale_off.py").write_text(
        (ROOT / "fixtures/kernels/near_threshold.py").read_text(encoding="utf-8")
        + "\nattention = scale_off_by_1pct\n", encoding="utf-8")
    monkeypatch.setattr(corpus, "CORPUS", tmp_path)
    from attn_ledger.probes.kernel import check as kernelcheck

    monkeypatch.setattr(kernelcheck, "tier_cases", lambda tier: DEFAULT_TIER[:12])
    out = corpus.run_correct("default", [0], None)
    entry = out["kernels"]["scale_off"]
    assert entry["cases"] == 12 and {f["check"] for f in entry["failures"]} >= {"reference"}
    worst = {(w["check"], w["dtype"]): w["ratio"] for w in out["worst"]}
    assert worst[("reference", "float32")] > 1


def _report_facts(report):
    return [(row.name, [(c.name, c.status, c.value, c.limit) for c in row.checks]) for row in report.rows]


def test_shared_references_judge_each_kernel_as_a_lone_check_does(monkeypatch):
    """Two corpus kernels and a wrong one inside one shared_references: every check's status, value and limit
    are a lone check's, the references ran once per case, and a case whose inputs differ is computed afresh."""
    from attn_ledger.inputs.userload import load_object
    from attn_ledger.probes.kernel import check as kernelcheck

    cases = DEFAULT_TIER[:4]
    fns = [load_object(f"{ROOT / 'fixtures/kernels/correct' / name}.py:attention") for name in ("einsum", "online_block16")]
    fns.append(load_object(f"{ROOT / 'fixtures/kernels/near_threshold.py'}:scale_off_by_1pct"))
    alone = [_report_facts(kernelcheck.check_kernel(fn, cases, seed=1)) for fn in fns]
    computed = []
    real = kernelcheck._compute_kernel_free
    monkeypatch.setattr(kernelcheck, "_compute_kernel_free", lambda s, d: computed.append(s.case.id) or real(s, d))
    with kernelcheck.shared_references():
        shared = [_report_facts(kernelcheck.check_kernel(fn, cases, seed=1)) for fn in fns]
        assert len(computed) == len(cases)  # once per case, not once per kernel
        kernelcheck.check_kernel(fns[0], cases[:1], seed=2)  # the same case at another seed: other inputs
        assert computed[-1] == cases[0].id and len(computed) == len(cases) + 1
    assert shared == alone


def _uniform_empty_rows(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    """transformers' eager convention: blocked keys get the dtype's lowest score, so a row with every
    key blocked comes out uniform over its keys (not zeros)."""
    import torch

    nh, tq, tk = q.shape[1], q.shape[-2], k.shape[-2]
    k = k.repeat_interleave(nh // k.shape[1], dim=1)  # [B, Nh, Tk, Dh]
    v = v.repeat_interleave(nh // v.shape[1], dim=1)  # [B, Nh, Tk, Dv]
    scores = (q * (q.shape[-1] ** -0.5 if scale is None else scale)) @ k.transpose(-2, -1)  # [B, Nh, Tq, Tk]
    allow = allow_mask
    if is_causal:
        causal = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        allow = causal if allow is None else allow & causal
    if allow is not None:
        scores = scores + torch.zeros(allow.shape, dtype=q.dtype).masked_fill(~allow, torch.finfo(q.dtype).min)
    return torch.softmax(scores, dim=-1) @ v  # [B, Nh, Tq, Dv]


@pytest.mark.parametrize("case", ["b1-h3kv3-tq6tk3-dh4dv6-causal-flag-rand-f32",  # Tq > Tk: early queries see no key
                                  "b2-h4kv2-tq5tk5-dh8dv8-pad-empty-rand-f32"])
def test_rows_with_no_allowed_key_answer_to_the_empty_rows_contract_only(case):
    c = parse_case(case)
    loose = check_case(_uniform_empty_rows, c, empty_rows="any")
    assert loose.passed, loose.first_failure
    judged = {ch.name for ch in loose.checks if ch.judged}
    assert {"forbidden_keys", "reference"} <= judged
    strict = check_case(_uniform_empty_rows, c)  # the default contract wants zeros there
    assert strict.first_failure.name == "empty_rows"


@FULL
@pytest.mark.slow
def test_the_full_tier_through_the_margins_script_keeps_every_margin(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "margins.py"), "--seeds", "1", "--tier", "full", "--json",
                           str(tmp_path / "margins.json")], capture_output=True, text=True, timeout=14400)
    assert done.returncode == 0, done.stdout[-4000:]


@FULL
@pytest.mark.slow
def test_the_corpus_passes_the_full_tier_at_every_capability(tmp_path):
    for cap in CAPABILITIES:
        out = tmp_path / f"{cap}.json"
        subprocess.run([sys.executable, str(SCRIPTS / "corpus.py"), "--tier", "full", "--json", str(out)],
                       env=_env(cap), check=True, timeout=7200)
        kernels = json.loads(out.read_text(encoding="utf-8"))["kernels"]
        assert {n: e["failures"] for n, e in kernels.items() if e["failures"]} == {}, cap


@FULL
@pytest.mark.slow
def test_the_ten_seed_sweep_keeps_every_margin_and_catches_every_near_threshold_fault(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "margins.py"), "--seeds", "10", "--json",
                           str(tmp_path / "margins.json")], capture_output=True, text=True, timeout=14400)
    assert done.returncode == 0, done.stdout[-4000:]
    folded = json.loads((tmp_path / "margins.json").read_text(encoding="utf-8"))
    margins = _script("margins")
    assert all(w["ratio"] <= margins.margin(w["check"], w["dtype"]) for w in folded["worst"])
    assert all(p["caught"] == p["runs"] == 30 for p in folded["power"].values())
