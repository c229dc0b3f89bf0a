"""Every key a `run --tensors` file may hold has its shape checked before anything is compared.

The oracle is written here, apart from the tool: a consistent file whose intermediates are
computed by a plain float64 softmax attention, then one key's shape changed at a time.
A changed shape must never pass: q, k, v and the masks are refused at load (exit 2, one
line), and a given intermediate of the wrong shape is an L1 shape finding (exit 1).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from attn_ledger.cli import app
from attn_ledger.engine.given import TENSOR_NAMES
from attn_ledger.inputs.tensorio import save_tensor_file

runner = CliRunner()

B, NH, NKV, TQ, TK, DH, DV = 2, 4, 2, 3, 5, 6, 7  # all different, so a change to one axis matches no other
KEYS = ("q", "k", "v", "allow_mask", "key_valid", "scores", "weights", "out", "grad_out", "dq", "dk", "dv", "sinks",
        "bias")  # a bias is walked on its own (test_a_bias_of_a_shape_that_does_not_broadcast_is_refused): not with --grad
GRAD_KEYS = ("grad_out", "dq", "dk", "dv")  # compared by the backward stages, so the walk runs them with --grad


def consistent_file() -> dict[str, torch.Tensor]:
    """q, k, v, masks, attention sinks and the intermediates a correct attention gives, in float64."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, NH, TQ, DH, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, NKV, TK, DH, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, NKV, TK, DV, generator=g, dtype=torch.float64, requires_grad=True)
    allow = torch.ones(TQ, TK, dtype=torch.bool).tril(TK - TQ).expand(B, NH, TQ, TK).clone()  # causal, bottom-right
    key_valid = torch.ones(B, TK, dtype=torch.bool)
    key_valid[1, -1] = False  # example 1 has one padded key; no query loses every key
    kr, vr = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = q @ kr.transpose(-2, -1) / math.sqrt(DH)  # [B, Nh, Tq, Tk]
    keep = allow & key_valid[:, None, None, :]
    sinks = torch.linspace(-1.0, 1.0, NH, dtype=torch.float64)  # one logit per head, in the denominator only
    col = sinks.reshape(1, NH, 1, 1).expand(B, NH, TQ, 1)
    weights = torch.softmax(torch.cat([scores.masked_fill(~keep, float("-inf")), col], dim=-1), dim=-1)[..., :-1]
    out = weights @ vr  # [B, Nh, Tq, Dv]
    grad_out = torch.randn(B, NH, TQ, DV, generator=g, dtype=torch.float64)  # O-bar
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    found = {"q": q, "k": k, "v": v, "allow_mask": allow, "key_valid": key_valid, "scores": scores,
             "weights": weights, "out": out, "grad_out": grad_out, "dq": dq, "dk": dk, "dv": dv, "sinks": sinks}
    return {name: t.detach() for name, t in found.items()}


def reshaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` with ``t``'s dtype and values from the same distribution."""
    if t.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=t.dtype)


def wrong_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each axis one longer and one shorter, one axis dropped, one added in front."""
    out = []
    for i, n in enumerate(shape):
        out.append(shape[:i] + (n + 1,) + shape[i + 1:])
        if n > 1:
            out.append(shape[:i] + (n - 1,) + shape[i + 1:])
    out.append(shape[:-1])
    out.append((1, *shape))
    return out


def loadable(t: dict[str, torch.Tensor]) -> bool:
    """Whether q, k, v and the masks describe attention together (the shapes alone decide)."""
    q, k, v = t["q"].shape, t["k"].shape, t["v"].shape
    if not (len(q) == len(k) == len(v) and len(q) in (3, 4)):
        return False
    if len(q) == 3:
        q, k, v = ((s[0], 1, *s[1:]) for s in (q, k, v))
    b, nh, tq, dh = q
    _, nkv, tk, _ = k
    if not (k[0] == v[0] == b and k[3] == dh and v[1] == nkv and v[2] == tk and nh % nkv == 0):
        return False
    if "allow_mask" in t and tuple(t["allow_mask"].shape) not in ((tq, tk), (b, tq, tk), (b, nh, tq, tk)):
        return False
    if "sinks" in t and tuple(t["sinks"].shape) != (nh,):
        return False
    return "key_valid" not in t or tuple(t["key_valid"].shape) == (b, tk)


def headline(doc: dict) -> tuple[str, int, str] | None:
    f = doc.get("first_finding", doc.get("first_divergence"))
    return None if f is None else (f.get("row", f.get("stage")), f["level"], f["check"])


def run_file(tensors: dict[str, torch.Tensor], path) -> tuple[int, str, dict | None]:
    """Run the file, with --grad when it holds gradients (without, they are refused)."""
    save_tensor_file(tensors, path)
    grad = ["--grad"] if any(name in tensors for name in GRAD_KEYS) else []
    r = runner.invoke(app, ["run", "--tensors", str(path), "--format", "json", *grad])
    doc = json.loads(r.stdout) if r.exit_code in (0, 1) else None
    return r.exit_code, r.stderr, doc


def test_the_walk_covers_every_key_the_loader_accepts():
    assert set(KEYS) == set(TENSOR_NAMES)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_the_consistent_file_passes(tmp_path, grad):
    tensors = {name: t for name, t in consistent_file().items() if grad or name not in GRAD_KEYS}
    code, err, doc = run_file(tensors, tmp_path / "ok.pt")
    assert code == 0, err
    assert headline(doc) is None


def test_saved_gradients_without_grad_are_refused(tmp_path):
    code, err, _ = run_file(consistent_file(), tmp_path / "grads.pt")
    assert code == 0, err
    save_tensor_file(consistent_file(), tmp_path / "grads.pt")
    r = runner.invoke(app, ["run", "--tensors", str(tmp_path / "grads.pt")])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "--grad" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


CASES = [(key, shape) for key, t in consistent_file().items() for shape in wrong_shapes(tuple(t.shape))]


@pytest.mark.parametrize("key,shape", CASES, ids=[f"{k}-{list(s)}" for k, s in CASES])
def test_a_wrong_shape_on_any_key_never_passes(tmp_path, key, shape):
    tensors = consistent_file()
    if key == "allow_mask" and len(shape) in (2, 3) and shape in ((TQ, TK), (B, TQ, TK)):
        pytest.skip("a valid placement of the mask")  # [Tq, Tk] and [B, Tq, Tk] are accepted layouts
    tensors[key] = reshaped(tensors[key], shape)
    code, err, doc = run_file(tensors, tmp_path / "bad.pt")
    assert "Traceback" not in err
    if not loadable(tensors):  # q, k, v and the masks disagree: refused at load
        assert code == 2, (key, shape, code, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    else:  # they agree, so the given intermediate is the one of the wrong shape: an L1 finding
        assert code == 1, (key, shape, code, err)
        stage, level, check = headline(doc)
        assert level == 1 and check.endswith("shape"), (key, shape, headline(doc))


@pytest.mark.parametrize("shape", [(3,), (2, 2, 4, 7), (2, 2, 4), (1, 2, 4, 8)])
def test_a_saved_out_of_the_wrong_shape_is_an_l1_finding_at_context(tmp_path, shape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    code, err, doc = run_file({"q": q, "k": k, "v": v, "out": torch.randn(shape, generator=g)}, tmp_path / "o.pt")
    assert code == 1, err
    assert headline(doc) == ("context", 1, "user_out_shape")


@pytest.mark.parametrize("b,tq,tk", [(1, 2, 3), (0, 1, 2), (2, 3, 5), (2, 5, 3)])
def test_cross_attention_without_a_mask_passes(tmp_path, b, tq, tk):
    # an empty relation is not the top-left causal one, whatever Tq and Tk (it was taken for it when Tq != Tk)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(b, 2, tq, 4, generator=g), torch.randn(b, 2, tk, 4, generator=g), torch.randn(b, 2, tk, 3, generator=g)
    code, err, doc = run_file({"q": q, "k": k, "v": v}, tmp_path / "x.pt")
    assert code == 0, (err, doc and headline(doc))
    r = runner.invoke(app, ["run", "--query-len", str(max(tq, 1)), "--key-len", str(tk), "--mask", "none", "--format", "json"])
    assert r.exit_code == 0, r.stdout[-500:]


def biased_file() -> dict[str, torch.Tensor]:
    """q, k, v, the causal mask and an additive bias ``[1, Nh, Tq, Tk]``, with the output they give (float64)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, NH, TQ, DH, generator=g, dtype=torch.float64)
    k = torch.randn(B, NKV, TK, DH, generator=g, dtype=torch.float64)
    v = torch.randn(B, NKV, TK, DV, generator=g, dtype=torch.float64)
    allow = torch.ones(TQ, TK, dtype=torch.bool).tril(TK - TQ)
    bias = torch.randn(1, NH, TQ, TK, generator=g, dtype=torch.float64)
    kr, vr = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = (q @ kr.transpose(-2, -1) / math.sqrt(DH) + bias).masked_fill(~allow, float("-inf"))
    return {"q": q, "k": k, "v": v, "allow_mask": allow, "bias": bias, "out": torch.softmax(s, dim=-1) @ vr}


def _broadcasts(shape: tuple[int, ...]) -> bool:
    full = (B, NH, TQ, TK)
    four = shape if len(shape) == 4 else (shape[0], 1, *shape[1:]) if len(shape) == 3 else (1, 1, *shape) \
        if len(shape) == 2 else None
    return four is not None and all(g in (1, w) for g, w in zip(four, full)) and four[-1] == TK


@pytest.mark.parametrize("shape", wrong_shapes((1, NH, TQ, TK)), ids=lambda s: str(list(s)))
def test_a_bias_of_a_shape_that_does_not_broadcast_is_refused(tmp_path, shape):
    ok = biased_file()
    assert run_file(ok, tmp_path / "ok.pt")[0] == 0
    tensors = {**ok, "bias": reshaped(ok["bias"], shape)}
    code, err, _ = run_file(tensors, tmp_path / "bad.pt")
    if _broadcasts(shape):  # another placement of a bias: judged, and this one is not the bias the out was made with
        assert code == 1, (shape, err)
    else:
        assert code == 2 and err.startswith("error: bias: got shape") and len(err.strip().splitlines()) == 1, err
