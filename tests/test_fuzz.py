"""Property-based tests through the CLI runner: configs, options and tensor files.

The oracle is written here, apart from the tool: a generated input is valid by construction
(its expected verdict follows from the mask relations, computed below from their
definitions), and at most one known mutation is applied whose outcome is known: a wrong
type, an out-of-range or unused value, a wrong shape, a perturbed intermediate, a truncated
or corrupted file, a hostile pickle. Every outcome must be the expected exit status, with no
traceback, one line for an exit 2, a valid JSON report otherwise, and no mutated comparison
may pass.

Profiles: the default (CI) runs a few dozen examples in well under a minute;
``ATTN_LEDGER_FUZZ=long`` runs at least 10,000 (4,000 each of configs, options and tensor files;
the hostile files' 72 combinations are exhausted well before their 1,000). ``ATTN_LEDGER_FUZZ_REPORT=FILE`` writes the
counts (examples, mutations, outcomes) as JSON when the module finishes.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from attn_ledger.cli import app

runner = CliRunner()
LONG = os.environ.get("ATTN_LEDGER_FUZZ", "") == "long"
STATS: Counter = Counter({"tracebacks or other statuses": 0, "mutated comparisons that passed": 0})
SEED_MAX = 2**63 - 1


def fuzz(ci: int, long: int):
    """Hypothesis settings: ``ci`` examples by default (derandomized, so CI sees the same ones),
    ``long`` under ATTN_LEDGER_FUZZ=long."""
    return settings(max_examples=long if LONG else ci, deadline=None, derandomize=not LONG, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    start = time.perf_counter()
    yield
    STATS["seconds"] = round(time.perf_counter() - start)
    target = os.environ.get("ATTN_LEDGER_FUZZ_REPORT")
    if target:
        Path(target).write_text(json.dumps(dict(sorted(STATS.items())), indent=2) + "\n")


def check_outcome(r, expected: set[int], what: str) -> dict | None:
    """The outcome holds the contract: the expected status, no traceback, one line for exit 2,
    one JSON report otherwise (returned)."""
    STATS[f"exit {r.exit_code}"] += 1
    if "Traceback" in r.output or r.exit_code not in (0, 1, 2):
        STATS["tracebacks or other statuses"] += 1
    assert "Traceback" not in r.output, (what, r.output[-2000:])
    assert r.exit_code in expected, (what, r.exit_code, expected, r.stderr[-600:])
    if r.exit_code == 2:
        err = r.stderr.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1, (what, err[:600])
        assert len(err) <= 600, (what, len(err))
        return None
    doc = json.loads(r.stdout)
    assert doc["verdict"] == ("pass" if r.exit_code == 0 else "fail"), (what, doc["verdict"])
    return doc


def mutated(kind: str, r, expected: set[int]) -> None:
    """Count a mutated example; one whose expected outcome is not a pass is a mutated comparison."""
    STATS[f"mutation {kind}"] += 1
    if 0 not in expected:
        STATS["mutated comparisons"] += 1
        if r.exit_code == 0:
            STATS["mutated comparisons that passed"] += 1


# --- the relations, from their definitions --------------------------------------------------

def allowed(rel: dict, b: int, i: int, j: int, tq: int, tk: int) -> bool:
    """May query i of example b use key j under the config's relations (all in allow polarity)?"""
    pos = i + tk - tq  # query i's key position, bottom-right aligned
    ok = True
    for r in rel["mask"].split("+"):
        if r == "causal":
            ok &= j <= pos
        elif r == "causal-top-left":
            ok &= j <= i
        elif r == "sliding-window":
            ok &= pos - rel["window"] < j <= pos
        elif r == "prefix-lm":
            ok &= j < rel["prefix_len"] or j <= pos
        elif r == "padding":
            n = rel["valid_lengths"][b]
            ok &= (j < n) if rel.get("padding_side", "right") == "right" else (j >= tk - n)
        elif r == "segments":
            ids = [s for s, n in enumerate(rel["segment_lengths"]) for _ in range(n)]
            ok &= ids[i] == ids[j]
    return ok


def has_empty_rows(rel: dict, b: int, tq: int, tk: int) -> bool:
    return any(not any(allowed(rel, e, i, j, tq, tk) for j in range(tk)) for e in range(b) for i in range(tq))


# --- configs ---------------------------------------------------------------------------------

@st.composite
def configs(draw, cli: bool = False) -> dict:
    """A valid config for the built-in pipeline, small enough to run in milliseconds."""
    nh = draw(st.integers(1, 3))
    dh = draw(st.integers(1, 4))
    cfg: dict = {"batch_size": draw(st.integers(0, 3)), "embed_dim": nh * dh, "num_heads": nh}
    if draw(st.booleans()):
        cfg["num_kv_heads"] = draw(st.sampled_from([d for d in range(1, nh + 1) if nh % d == 0]))
    if draw(st.booleans()):
        cfg["value_dim"] = draw(st.integers(1, 4))
    cross = draw(st.booleans())
    if cross:
        tq = draw(st.integers(1, 5))
        tk = draw(st.integers(1, 6))
        cfg.update(query_len=tq, key_len=tk)
    else:
        tq = tk = draw(st.integers(1, 6))
        cfg["seq_len"] = tq
    names = ["causal", "causal-top-left", "padding", "sliding-window", "prefix-lm"] + ([] if cross or cli else ["segments"])
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=3))
    if "causal" in chosen and "causal-top-left" in chosen:
        chosen.remove("causal-top-left")
    cfg["mask"] = "+".join(chosen) or "none"
    if "padding" in chosen:
        cfg["valid_lengths"] = draw(st.lists(st.integers(0, tk), min_size=cfg["batch_size"], max_size=cfg["batch_size"]))
        if not cli and draw(st.booleans()):
            cfg["padding_side"] = draw(st.sampled_from(["right", "left"]))
    if "sliding-window" in chosen:
        cfg["window"] = draw(st.integers(1, tk))
    if "prefix-lm" in chosen:
        cfg["prefix_len"] = draw(st.integers(0, tk))
    if "segments" in chosen:
        cuts = sorted(draw(st.sets(st.integers(1, tk - 1), max_size=3))) if tk > 1 else []
        edges = [0, *cuts, tk]
        cfg["segment_lengths"] = [edges[n + 1] - edges[n] for n in range(len(edges) - 1)]
    cfg["empty_rows"] = draw(st.sampled_from(["error", "zeros"]))
    cfg["dtype"] = draw(st.sampled_from(["float32", "float64"]))
    cfg["seed"] = draw(st.integers(0, SEED_MAX))
    cfg["input"] = draw(st.sampled_from(["random", "arange"]))
    return cfg


def expected_exit(cfg: dict) -> int:
    b, tq, tk = cfg["batch_size"], cfg.get("query_len", cfg.get("seq_len")), cfg.get("key_len", cfg.get("seq_len"))
    empty = cfg["mask"] != "none" and has_empty_rows(cfg, b, tq, tk)
    return 1 if empty and cfg["empty_rows"] == "error" else 0


INT_KEYS = ("batch_size", "embed_dim", "num_heads", "seed")
CONFIG_MUTATIONS = ("none", "bool", "float", "string", "seed beyond int64", "seed negative", "size zero",
                    "unknown key", "unused key", "huge size", "fault no-scale", "integer of 5000 digits", "nested deep")


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


def write_config(cfg: dict, d: Path, fmt: str, raw: str | None = None) -> Path:
    p = d / f"c.{fmt}"
    if raw is not None:
        p.write_text(raw)
    elif fmt == "json":
        p.write_text(json.dumps(cfg))
    else:
        p.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in cfg.items()))
    return p


CROSS_NO_MASK = {"batch_size": 1, "embed_dim": 4, "num_heads": 1, "query_len": 2, "key_len": 3, "mask": "none",
                 "empty_rows": "error", "dtype": "float32", "seed": 0, "input": "random"}


@fuzz(ci=20, long=4000)
@given(cfg=configs(), mutation=st.sampled_from(CONFIG_MUTATIONS), fmt=st.sampled_from(["json", "toml"]),
       pick=st.integers(0, 10**6))
@example(cfg=dict(CROSS_NO_MASK), mutation="none", fmt="json", pick=0)  # Tq < Tk, no mask: once read as causal
def test_fuzz_configs(cfg, mutation, fmt, pick):
    STATS["examples configs"] += 1
    base = expected_exit(cfg)
    raw = None
    expected = {2}
    key = INT_KEYS[pick % len(INT_KEYS)]
    if mutation == "none":
        expected = {base}
    elif mutation == "bool":
        cfg[key] = bool(pick % 2)
    elif mutation == "float":
        cfg[key] = float(cfg[key]) + 0.5 * (pick % 2)
    elif mutation == "string":
        cfg[key] = str(cfg[key])
    elif mutation == "seed beyond int64":
        cfg["seed"] = SEED_MAX + 1 + pick
    elif mutation == "seed negative":
        cfg["seed"] = -1 - pick
    elif mutation == "size zero":
        cfg[("embed_dim", "num_heads", "seq_len" if "seq_len" in cfg else "key_len")[pick % 3]] = -(pick % 3)
    elif mutation == "unknown key":
        cfg["colour"] = pick
    elif mutation == "unused key":
        unused = [k for k, rel in (("window", "sliding-window"), ("prefix_len", "prefix-lm"), ("valid_lengths", "padding"))
                  if rel not in cfg["mask"].split("+")]
        if not unused:
            cfg["mask"], unused = "none", ["window"]
            for k in ("window", "prefix_len", "valid_lengths", "padding_side", "segment_lengths"):
                cfg.pop(k, None)
        k = unused[pick % len(unused)]
        cfg[k] = [1] * cfg["batch_size"] if k == "valid_lengths" else 1
    elif mutation == "huge size":
        cfg.update(embed_dim=10**30, num_heads=1)
        cfg.pop("num_kv_heads", None)
    elif mutation == "fault no-scale":  # scores lose 1/sqrt(Dh): seen unless Dh is 1 or nothing is computed
        cfg["fault"] = "no-scale"
        dh = cfg["embed_dim"] // cfg["num_heads"]
        expected = {1 if (dh > 1 and cfg["batch_size"] > 0) or base == 1 else 0}
    elif mutation == "integer of 5000 digits":
        raw = (json.dumps({"seed": 0})[:-2] + "9" * 5000 + "}") if fmt == "json" else "seed = " + "9" * 5000 + "\n"
    elif mutation == "nested deep":
        depth = 10 + pick % 10_000
        raw = ("[" * depth + "]" * depth) if fmt == "json" else "a = " + "[" * depth + "]" * depth + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = write_config(cfg, Path(d), fmt, raw)
        r = runner.invoke(app, ["run", str(path), "--format", "json", "--max-memory", "2G"])
    check_outcome(r, expected, (mutation, cfg))
    if mutation != "none":
        mutated(mutation, r, expected)


# --- options ---------------------------------------------------------------------------------

CLI_NAMES = {"batch_size": "--batch-size", "seq_len": "--seq-len", "query_len": "--query-len", "key_len": "--key-len",
             "embed_dim": "--embed-dim", "num_heads": "--heads", "num_kv_heads": "--num-kv-heads",
             "value_dim": "--value-dim", "mask": "--mask", "window": "--window", "prefix_len": "--prefix-len",
             "empty_rows": "--empty-rows", "dtype": "--dtype", "seed": "--seed", "input": "--input"}
OPTION_MUTATIONS = ("none", "full-width digit", "not a number", "seed beyond int64", "huge value", "unused option",
                    "unknown relation", "too many relations", "size with --tensors")


def as_args(cfg: dict) -> list[str]:
    args = []
    for k, v in cfg.items():
        if k == "valid_lengths":
            args += ["--valid-lengths", ",".join(map(str, v))]
        else:
            args += [CLI_NAMES[k], str(v)]
    return args


@fuzz(ci=16, long=4000)
@given(cfg=configs(cli=True), mutation=st.sampled_from(OPTION_MUTATIONS), pick=st.integers(0, 10**6))
def test_fuzz_options(cfg, mutation, pick):
    STATS["examples options"] += 1
    args = ["run", *as_args(cfg), "--format", "json"]
    expected = {2}
    int_opts = [CLI_NAMES[k] for k in ("batch_size", "embed_dim", "num_heads", "seed") if k in cfg]
    opt = int_opts[pick % len(int_opts)]

    def put(option: str, value: str) -> None:
        i = args.index(option)
        args[i + 1] = value

    if mutation == "none":
        expected = {expected_exit(cfg)}
    elif mutation == "full-width digit":
        put(opt, "".join(chr(0xFF10 + int(c)) if c.isdigit() else c for c in args[args.index(opt) + 1]))
    elif mutation == "not a number":
        put(opt, ("1e3", "0x10", "3.0", "", "1_0", "two", "--")[pick % 7])
    elif mutation == "seed beyond int64":
        put("--seed", str(SEED_MAX + 1 + pick))
    elif mutation == "huge value":  # tens of thousands of characters, echoed cut
        big = "7" * (20_000 + pick % 50_000)
        put(opt if pick % 2 else "--mask", big)
    elif mutation == "unused option":
        rels = cfg["mask"].split("+")
        unused = [o for o, rel in (("--window", "sliding-window"), ("--prefix-len", "prefix-lm"), ("--valid-lengths", "padding"))
                  if rel not in rels]
        if not unused:
            return
        args += [unused[pick % len(unused)], "1"]
    elif mutation == "unknown relation":
        put("--mask", cfg["mask"] + "+diagonal")
    elif mutation == "too many relations":
        put("--mask", "+".join(["none"] * (9 + pick % 100)))
    elif mutation == "size with --tensors":
        args = ["run", "--tensors", "unused.pt", opt, "3", "--format", "json"]
    r = runner.invoke(app, args)
    check_outcome(r, expected, (mutation, args[:12]))
    if mutation != "none":
        mutated(mutation, r, expected)


# --- tensor files ----------------------------------------------------------------------------

@st.composite
def tensor_files(draw) -> dict:
    """q, k, v and, by choice, masks and the intermediates a correct attention gives (float64 oracle)."""
    rank3 = draw(st.booleans())
    nh = 1 if rank3 else draw(st.sampled_from([1, 2, 4]))
    nkv = 1 if rank3 else draw(st.sampled_from([d for d in (1, 2, 4) if nh % d == 0]))
    b = draw(st.integers(0, 2))
    tq = draw(st.integers(1, 5))
    tk = draw(st.integers(tq, 6))  # Tk >= Tq: bottom-right causal leaves no query without a key
    dh, dv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, tq, dh, generator=g, dtype=torch.float64)
    k = torch.randn(b, nkv, tk, dh, generator=g, dtype=torch.float64)
    v = torch.randn(b, nkv, tk, dv, generator=g, dtype=torch.float64)
    keep = torch.ones(b, nh, tq, tk, dtype=torch.bool)
    t: dict = {}
    if draw(st.booleans()):
        allow = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)  # causal, bottom-right
        keep &= allow
        layout = draw(st.sampled_from(["2d", "3d", "4d"]))
        t["allow_mask"] = {"2d": allow, "3d": allow.expand(b, tq, tk), "4d": allow.expand(b, nh, tq, tk)}[layout].clone()
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(1, tk), min_size=b, max_size=b))
        kv = torch.tensor([[j < n for j in range(tk)] for n in lengths], dtype=torch.bool).reshape(b, tk)
        keep &= kv[:, None, None, :]
        t["key_valid"] = kv
    kr, vr = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = q @ kr.transpose(-2, -1) / math.sqrt(dh)  # [B, Nh, Tq, Tk]
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    out = weights @ vr  # [B, Nh, Tq, Dv]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    for name, x in (("q", q), ("k", k), ("v", v)):
        t[name] = (x[:, 0] if rank3 else x).to(dtype)
    for name, x in (("scores", scores), ("weights", weights), ("out", out)):
        if draw(st.booleans()):
            t[name] = (x[:, 0] if rank3 else x).to(dtype)
    if rank3 and "allow_mask" in t and t["allow_mask"].dim() == 4:
        t["allow_mask"] = t["allow_mask"][:, 0]
    return t


def loadable(t: dict) -> bool:
    """Whether q, k, v and the masks describe attention together (the shapes alone decide)."""
    shapes = [tuple(t[n].shape) for n in ("q", "k", "v")]
    if not (len(set(map(len, shapes))) == 1 and len(shapes[0]) in (3, 4)):
        return False
    q, k, v = ((s[0], 1, *s[1:]) if len(s) == 3 else s for s in shapes)
    b, nh, tq, dh = q
    if not (k[0] == v[0] == b and k[3] == dh and v[1] == k[1] and v[2] == k[2] and k[1] and nh % k[1] == 0
            and tq and k[2] and dh and v[3]):
        return False
    tk = k[2]
    if "allow_mask" in t and tuple(t["allow_mask"].shape) not in ((tq, tk), (b, tq, tk), (b, nh, tq, tk)):
        return False
    return "key_valid" not in t or tuple(t["key_valid"].shape) == (b, tk)


def intermediates_fit(t: dict) -> bool:
    """Whether every given scores, weights and out has the shape q, k and v give it."""
    q, k, v = (tuple(t[n].shape) for n in ("q", "k", "v"))
    lead = q[:-2] if len(q) == 4 else q[:1]  # [B, Nh] or [B]
    want = {"scores": (*lead, q[-2], k[-2]), "weights": (*lead, q[-2], k[-2]), "out": (*lead, q[-2], v[-1])}
    return all(tuple(t[n].shape) == shape for n, shape in want.items() if n in t)


def save(t: dict, path: Path) -> None:
    if path.suffix == ".pt":
        torch.save(t, path)
    elif path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: x.contiguous() for k, x in t.items()}, str(path))
    else:
        np.savez(path, **{k: x.numpy() for k, x in t.items()})


TENSOR_MUTATIONS = ("none", "wrong shape", "perturbed intermediate", "truncated", "corrupt magic", "mask not bool",
                    "nan in q", "integer q")


@fuzz(ci=20, long=4000)
@example(t={"q": torch.ones(1, 2, 4), "k": torch.ones(1, 3, 4), "v": torch.ones(1, 3, 4)}, mutation="none",
         suffix=".pt", pick=0, delta=1.0)  # Tq < Tk, no mask: once read as causal
@given(t=tensor_files(), mutation=st.sampled_from(TENSOR_MUTATIONS), suffix=st.sampled_from([".pt", ".safetensors", ".npz"]),
       pick=st.integers(0, 10**6), delta=st.floats(0.5, 100.0))
def test_fuzz_tensor_files(t, mutation, suffix, pick, delta):
    STATS["examples tensor files"] += 1
    expected = {2}
    corrupt = None
    given_ = [n for n in ("scores", "weights", "out") if n in t and t[n].numel()]
    if mutation == "none":
        expected = {0}
    elif mutation == "wrong shape":
        key = sorted(t)[pick % len(t)]
        shape = list(t[key].shape)
        axis = pick % (len(shape) + 1)
        shape = shape[:-1] if axis == len(shape) else shape[:axis] + [shape[axis] + 1 + pick % 2] + shape[axis + 1:]
        t[key] = torch.ones(shape, dtype=t[key].dtype)
        # q, k, v and the masks disagree: refused at load; they agree, and a given intermediate no longer
        # fits them: an L1 shape finding; everything still fits (v one wider, say, with no out): a valid file
        expected = {2} if not loadable(t) else {0} if intermediates_fit(t) else {1}
    elif mutation == "perturbed intermediate":
        if not given_:
            return
        name = given_[pick % len(given_)]
        x = t[name].clone()
        flat = x.view(-1)
        flat[pick % flat.numel()] += delta * (1 if pick % 2 else -1)
        t[name] = x
        expected = {1}
    elif mutation in ("truncated", "corrupt magic"):
        corrupt = mutation
    elif mutation == "mask not bool":
        if "allow_mask" not in t and "key_valid" not in t:
            return
        name = "allow_mask" if "allow_mask" in t else "key_valid"
        t[name] = t[name].to(torch.float32)
    elif mutation == "nan in q":
        if not t["q"].numel():
            return
        t["q"] = t["q"].clone()
        t["q"].view(-1)[pick % t["q"].numel()] = float("nan")
    elif mutation == "integer q":
        t["q"] = t["q"].to(torch.int64)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"t{suffix}"
        save(t, path)
        data = path.read_bytes()
        if corrupt == "truncated":
            path.write_bytes(data[: pick % len(data)])
        elif corrupt == "corrupt magic":
            at = pick % 4
            path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
        r = runner.invoke(app, ["run", "--tensors", str(path), "--format", "json"])
    doc = check_outcome(r, expected, (mutation, {k: list(x.shape) for k, x in t.items()}))
    if mutation == "wrong shape" and doc is not None and r.exit_code == 1:
        f = doc["first_finding"]
        assert f["level"] == 1 and f["check"].endswith("shape"), f
    if mutation != "none":
        mutated(mutation, r, expected)


# --- hostile files ---------------------------------------------------------------------------

class _Marker:
    """Pickled as a call that would create a file: it must never run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@fuzz(ci=6, long=1000)
@given(kind=st.sampled_from(["torch.save archive", "plain pickle", "legacy torch.save", "npz object array"]),
       protocol=st.integers(0, pickle.HIGHEST_PROTOCOL), where=st.sampled_from(["value", "key list", "nested"]))
def test_fuzz_hostile_files_never_run(kind, protocol, where):
    STATS["examples hostile files"] += 1
    with tempfile.TemporaryDirectory() as d:
        marker = str(Path(d) / "ran")
        payload = _Marker(marker)
        obj = {"q": payload} if where == "value" else [payload] if where == "key list" else {"q": {"inner": [payload]}}
        path = Path(d) / ("t.npz" if kind == "npz object array" else "t.pt")
        if kind == "torch.save archive":
            torch.save(obj, path)
        elif kind == "legacy torch.save":
            torch.save(obj, path, _use_new_zipfile_serialization=False)
        elif kind == "plain pickle":
            path.write_bytes(pickle.dumps(obj, protocol=protocol))
        else:
            np.savez(path, q=np.array([payload, 1], dtype=object))
        r = runner.invoke(app, ["run", "--tensors", str(path), "--format", "json"])
        check_outcome(r, {2}, (kind, protocol, where))
        assert not os.path.exists(marker), "a pickled call ran"
        assert "Warning" not in r.stderr
    mutated(kind, r, {2})


# --- outputs never destroy inputs --------------------------------------------------------------

MODULE = ["--embed-dim", "4", "--heads", "1"]
# (id, the input's file, the field that names it, the command line with {in} for the input's path)
CLASH_INPUTS = [
    ("run-config", "cfg.toml", "config", ["run", "{in}"]),
    ("run-tensors", "t.safetensors", "--tensors", ["run", "--tensors", "{in}"]),
    ("run-grad-output", "seed.safetensors", "--grad-output", ["run", "--tensors", "t.safetensors", "--grad",
                                                               "--grad-output", "{in}"]),
    ("run-config-grad-output", "seed.safetensors", "grad_output", ["run", "grad.toml"]),
    ("check-target", "k.py", "target", ["check", "{in}:attention"]),
    ("check-module", "m.py", "--module", ["check", "--module", "{in}:make", *MODULE]),
    ("check-decode", "dec.py", "--decode", ["check", "--module", "m.py:make", *MODULE, "--decode", "{in}:decode"]),
    ("check-pyproject", "pyproject.toml", "pyproject.toml", ["check", "k.py:attention"]),
    ("intervene-config", "cfg.toml", "config", ["intervene", "{in}"]),
    ("intervene-module", "m.py", "--module", ["intervene", "--module", "{in}:make", *MODULE]),
    ("polarity-mask", "mask.pt", "--mask", ["polarity", "--mask", "{in}", "--expect", "causal"]),
    ("sweep-tensors", "t.safetensors", "--tensors", ["sweep-scale", "--tensors", "{in}"]),
]
OUTPUT_FIELDS = {"run": ("--output", "--html"), "check": ("--output", "--html"), "intervene": ("--output",),
                 "polarity": ("--output",), "sweep-scale": ("--output", "--plot")}
CLASH_MATRIX = [(case, out) for case in CLASH_INPUTS for out in OUTPUT_FIELDS[case[3][0]]]
ALIASES = ["same", "dot-slash", "absolute", "symlink", "hardlink"]


def clash_dir(d: Path) -> None:
    """Every input a command of the matrix reads, each with content of its own."""
    for name in ("cfg.toml", "t.safetensors", "seed.safetensors", "k.py", "m.py", "dec.py", "mask.pt"):
        (d / name).write_bytes(f"the input {name}, not to be overwritten\n".encode())
    (d / "grad.toml").write_text('grad = true\ngrad_output = "seed.safetensors"\n')
    (d / "pyproject.toml").write_text('[tool.attn-ledger.check]\ndtypes = "float32"\n')


def alias(d: Path, name: str, how: str) -> str:
    """A path to the input ``name`` that is written differently or is another directory entry."""
    if how == "same":
        return name
    if how == "dot-slash":
        return f"./{name}"
    if how == "absolute":
        return str(d / name)
    link = d / f"link-to-{name}"
    if how == "symlink":
        link.symlink_to(name)
    else:
        os.link(d / name, link)
    return link.name


def hashes(d: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if not p.is_symlink()}


@pytest.mark.parametrize("how", ALIASES)
@pytest.mark.parametrize("case, out", CLASH_MATRIX, ids=[f"{c[0]}-{o.lstrip('-')}" for c, o in CLASH_MATRIX])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(case, out, how, tmp_path, monkeypatch):
    """Each input against each output, the output's path written five ways: exit 2 with one line that
    names both fields, and every file as it was (by hash), no file added."""
    name, input_file, field, argv = case
    monkeypatch.chdir(tmp_path)
    clash_dir(tmp_path)
    target = alias(tmp_path, input_file, how)
    before = hashes(tmp_path)
    r = runner.invoke(app, [a.replace("{in}", input_file) for a in argv] + [out, target])
    STATS["examples output clashes"] += 1
    check_outcome(r, {2}, (name, out, how))
    assert f"{out.lstrip('-')}: got {str(Path(target))!r}, the same file as the input {field}" in r.stderr, r.stderr
    assert hashes(tmp_path) == before
    mutated("output clash", r, {2})


@pytest.mark.parametrize("how", ["same", "dot-slash", "absolute", "symlink", "hardlink"])
@pytest.mark.parametrize("command, first, second", [("run", "--output", "--html"), ("check", "--output", "--html"),
                                                     ("sweep-scale", "--output", "--plot")])
def test_two_outputs_that_are_one_file_are_refused(command, first, second, how, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clash_dir(tmp_path)
    (tmp_path / "report.txt").write_text("the report of yesterday\n")
    other = alias(tmp_path, "report.txt", how)
    before = hashes(tmp_path)
    args = {"run": ["run"], "check": ["check", "k.py:attention"], "sweep-scale": ["sweep-scale"]}[command]
    r = runner.invoke(app, args + [first, "report.txt", second, other])
    check_outcome(r, {2}, (command, second, how))
    assert f"{second.lstrip('-')}: got {str(Path(other))!r}, the same file as {first}" in r.stderr, r.stderr
    assert hashes(tmp_path) == before


# --- signals during a hung check ----------------------------------------------------------------

HOSTILE = Path(__file__).resolve().parents[1] / "fixtures" / "hostile" / "kernels.py"


def _marked(marker: str) -> list[int]:
    """The running processes whose environment holds ``marker`` (every process a run starts inherits it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper and /proc are Linux's")
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_hung_check_leaves_no_process_and_no_temporary_directory(signum, status, tmp_path):
    """The kernel hangs; the tool is signalled while the call is in flight. It exits with the signal's
    status, and nothing it started (worker, fork server, resource tracker) nor its temporary directory
    remains; the --output it was asked for is not written."""
    tmp, pids, report = tmp_path / "tmp", tmp_path / "pids", tmp_path / "report.json"
    tmp.mkdir()
    marker = f"ATTN_LEDGER_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "TMPDIR": str(tmp), "ATTN_LEDGER_TEST_PIDS": str(pids), marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attn_ledger", "check", f"{HOSTILE}:hangs_noting_start", "--case",
         "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32", "--timeout", "600", "--format", "json", "--output", str(report)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's background job ignores SIGINT
    try:
        deadline = time.monotonic() + 240
        while not (pids.exists() and pids.read_text().strip()):  # the kernel says its call is in flight
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        assert len(_marked(marker)) >= 3  # the tool, the fork server and the worker at least
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    STATS[f"signals {signal.Signals(signum).name}"] += 1
    assert proc.returncode == status, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert _marked(marker) == []
    assert list(tmp.iterdir()) == []
    assert not report.exists()


# --- hostile kernels: each tries to get a wrong kernel past check, or do more than return -----------

HOSTILE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "hostile"
# name -> the check built to catch it (tests/test_judge.py shows it is that check, on one case)
JUDGE_KERNELS = {"judge_subclass": "reference", "judge_patched_softmax": "reference",
                 "judge_patch_check_case": "reference", "judge_patch_reference": "reference",
                 "judge_grad_mode": "reference_grad_mode", "judge_detached": "grad_call",
                 "judge_clobbers": "inputs_unchanged", "judge_dispatch_wrapper": "call"}
JUDGE_CASES = ["b2-h4kv2-tq5tk9-dh8dv4-pad-rand-f32", "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32",
               "b1-h3kv3-tq6tk3-dh4dv6-pad-causal-rand-f64", "b2-h2kv1-tq4tk7-dh8dv8-none-rand-bf16"]


@fuzz(ci=4, long=200)
@given(name=st.sampled_from(sorted(JUDGE_KERNELS)), case=st.sampled_from(JUDGE_CASES), seed=st.integers(0, 2**31),
       backward=st.booleans())
def test_fuzz_hostile_kernels_never_pass(name, case, seed, backward):
    STATS["examples hostile kernels"] += 1
    backward = backward or name == "judge_detached"  # declared inference-only, a detached output is what it says
    args = ["check", f"{HOSTILE_DIR / name}.py:attention", "--case", case, "--seed", str(seed), "--format", "json",
            "--timeout", "60", *([] if backward else ["--no-backward"])]
    r = runner.invoke(app, args)
    doc = check_outcome(r, {1}, (name, case, seed, backward))
    failing = {c["name"] for row in doc["rows"] for c in row["checks"] if c["status"] == "fail"}
    assert JUDGE_KERNELS[name] in failing, (name, case, seed, failing)
    mutated(f"hostile kernel {name}", r, {1})
