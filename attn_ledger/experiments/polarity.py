"""Which boolean convention each attention API uses, what the wrong one does, and what a mask file holds.

A boolean mask has no meaning of its own: ``F.scaled_dot_product_attention`` keeps the
pairs marked True, ``nn.MultiheadAttention`` drops them. This module

* probes each installed API with a two-key call to learn its convention, and quotes the
  sentence of its installed documentation that states it (:func:`conventions`);
* sends one causal allow relation through the manual pipeline, SDPA and
  MultiheadAttention, in the right and in the inverted polarity, against a float64
  causal reference (:func:`polarity_rows`);
* audits a query row with every key blocked on each path (:func:`blocked_row_audit`);
* fingerprints a user's mask file against an expected relation (:func:`fingerprint`).

Axes: B batch, Nh heads, Tq queries, Tk keys, E model width, Dh head width, Dv value width.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.errors import TensorFileError, field_error, first_line
from attn_ledger.render.notes import POLARITY_MEANING
from attn_ledger.report import Check, Note, Report, Row, bounded, row_status
from attn_ledger.seeding import generator
from attn_ledger.tolerance import PROBE_ATOL

if TYPE_CHECKING:
    import torch

COMMAND = "polarity"
ALLOW, BLOCK = "allow", "block"
MEANING = POLARITY_MEANING  # what True means in each polarity (the renderer's words)
TOLERANCE = PROBE_ATOL  # float32 outputs against the float64 reference
LARGE_NEGATIVE = -1e4  # additive-mask values at or below this count as "blocked"

B, NH, T, E = 2, 2, 4, 8  # the worked example's sizes: Dh = E / Nh = 4


# --- conventions: probe and documentation ----------------------------------------------

@dataclass(frozen=True)
class Convention:
    """One API argument's boolean convention, as probed and as documented.

    Attributes:
        api: e.g. ``"F.scaled_dot_product_attention attn_mask"``.
        probed: ``"allow"`` or ``"block"``, from a two-key call with mask ``[True, False]``.
        documented: the convention the quoted sentence states, or None if none was found.
        doc_line: the sentence of the installed docstring, or None.
        source: where the sentence was looked for.
    """

    api: str
    probed: str
    documented: str | None
    doc_line: str | None
    source: str

    @property
    def agree(self) -> bool:
        return self.documented is not None and self.documented == self.probed

    def as_dict(self) -> dict[str, Any]:
        return {"api": self.api, "probed": self.probed, "documented": self.documented, "doc_line": self.doc_line,
                "source": self.source, "agree": self.agree}


def param_section(doc: str | None, name: str) -> str:
    """The text of one ``name: ...`` or ``name (type): ...`` entry of a docstring's Args, on one line."""
    if not doc:
        return ""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"^(\s*){re.escape(name)}(\s*\([^)]*\))?\s*:", line)
        if not m:
            continue
        indent = len(m.group(1))
        body = [line.strip()]
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt.strip())
        return " ".join(s for s in body if s)
    return ""


def doc_sentence(text: str) -> str | None:
    """The first sentence that says what a True value of a boolean (binary) mask means."""
    for sentence in re.split(r"(?<=\.)\s+", text):
        if "True" in sentence and re.search(r"\b(bool|boolean|binary)\b", sentence, re.IGNORECASE):
            return sentence.strip()
    return None


def doc_polarity(sentence: str | None) -> str | None:
    """``"block"`` or ``"allow"`` from the wording of a documentation sentence; None if it says neither."""
    if not sentence:
        return None
    s = sentence.lower().replace("*", "").replace("`", "")
    if any(w in s for w in ("not allowed", "ignored", "blocked", "masked out", "prevent")):
        return BLOCK
    if any(w in s for w in ("take part", "may use", "allowed to attend", "participate", "may attend")):
        return ALLOW
    return None


def probe_sdpa() -> str:
    """Call SDPA on two keys with equal scores, values 0 and 1, mask ``[True, False]``: which key was kept?"""
    import torch
    import torch.nn.functional as F

    q = torch.zeros(1, 1, 1, 1)  # [B, Nh, Tq, Dh]
    k = torch.zeros(1, 1, 2, 1)  # [B, Nh, Tk, Dh]
    v = torch.tensor([0.0, 1.0]).reshape(1, 1, 2, 1)  # [B, Nh, Tk, Dv]
    mask = torch.tensor([[True, False]])  # [Tq, Tk]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return ALLOW if float(out) < 0.5 else BLOCK


def _probe_mha_module() -> "torch.nn.MultiheadAttention":
    import torch

    mha = torch.nn.MultiheadAttention(1, 1, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.fill_(1.0)
        mha.out_proj.weight.fill_(1.0)
    return mha.eval()


def probe_mha(argument: str) -> str:
    """The same two-key probe through ``nn.MultiheadAttention``'s ``attn_mask`` or ``key_padding_mask``."""
    import torch

    mha = _probe_mha_module()
    query = torch.zeros(1, 1, 1)  # [B, Tq, E]
    kv = torch.tensor([0.0, 1.0]).reshape(1, 2, 1)  # [B, Tk, E]
    mask = torch.tensor([[True, False]])  # [Tq, Tk] or [B, Tk]
    with torch.no_grad():
        out, _ = mha(query, kv, kv, need_weights=True, **{argument: mask})
    return ALLOW if float(out) < 0.5 else BLOCK


def probe_manual() -> str:
    """The same probe through the project's own stage functions."""
    import torch

    from attn_ledger.maths import pipeline

    q = torch.zeros(1, 1, 1, 1)
    k = torch.zeros(1, 1, 2, 1)
    v = torch.tensor([0.0, 1.0]).reshape(1, 1, 2, 1)
    mask = torch.tensor([[True, False]])
    out = pipeline.mix_values(pipeline.softmax_keys(pipeline.apply_mask(pipeline.qk_scores(q, k, 1.0), mask), mask, False), v)
    return ALLOW if float(out) < 0.5 else BLOCK


def conventions() -> tuple[Convention, ...]:
    """Probe each API and find the documentation sentence beside it."""
    import torch
    import torch.nn.functional as F

    from attn_ledger.maths import masks

    sdpa_line = doc_sentence(param_section(F.scaled_dot_product_attention.__doc__, "attn_mask"))
    mha_doc = torch.nn.MultiheadAttention.forward.__doc__
    mha_attn = doc_sentence(param_section(mha_doc, "attn_mask"))
    mha_kpm = doc_sentence(param_section(mha_doc, "key_padding_mask"))
    manual_line = next((ln.strip() for ln in (masks.__doc__ or "").splitlines() if "ALLOW polarity" in ln), None)
    if manual_line is not None:
        manual_line = " ".join((masks.__doc__ or "").split()).split("Every function here")[1].split(".")[0]
        manual_line = "Every function here" + manual_line + "."
    return (
        Convention("manual pipeline (attn_ledger.maths.pipeline)", probe_manual(), doc_polarity(manual_line), manual_line,
                   "attn_ledger.maths.masks.__doc__"),
        Convention("F.scaled_dot_product_attention attn_mask", probe_sdpa(), doc_polarity(sdpa_line), sdpa_line,
                   "torch.nn.functional.scaled_dot_product_attention.__doc__ (attn_mask)"),
        Convention("nn.MultiheadAttention attn_mask", probe_mha("attn_mask"), doc_polarity(mha_attn), mha_attn,
                   "torch.nn.MultiheadAttention.forward.__doc__ (attn_mask)"),
        Convention("nn.MultiheadAttention key_padding_mask", probe_mha("key_padding_mask"), doc_polarity(mha_kpm), mha_kpm,
                   "torch.nn.MultiheadAttention.forward.__doc__ (key_padding_mask)"),
    )


# --- the causal relation through each API, both polarities ------------------------------

@dataclass(frozen=True)
class PolarityCall:
    """One API called with one polarity of the causal relation.

    Attributes:
        api: ``manual``, ``sdpa`` or ``mha``.
        convention: the API's probed convention (``allow`` / ``block``).
        passed: the polarity of the tensor passed (``allow`` / ``block``).
        correct: whether ``passed`` is the API's documented convention.
        finite: whether the whole output is finite.
        max_abs_diff: largest ``|out - reference|`` (NaN where the output has NaN).
        forbidden_weight: largest weight on a key the causal relation forbids (finite weights only).
        blocked_rows: query positions the API saw with no allowed key.
    """

    api: str
    convention: str
    passed: str
    correct: bool
    finite: bool
    max_abs_diff: float
    forbidden_weight: float
    blocked_rows: tuple[int, ...]

    @property
    def row_name(self) -> str:
        return self.api if self.correct else f"{self.api} inverted"

    def fields(self) -> dict[str, Any]:
        return {"convention": self.convention, "passed": self.passed, "correct": self.correct, "finite": self.finite,
                "max_abs_diff": self.max_abs_diff, "forbidden_weight": self.forbidden_weight,
                "blocked_rows": list(self.blocked_rows)}


def _compare(out: "torch.Tensor", ref: "torch.Tensor") -> tuple[bool, float]:
    """Whether ``out`` is finite, and its largest ``|out - ref|`` (NaN where ``out`` has NaN)."""
    import torch

    return bool(torch.isfinite(out).all()), float((out.to(torch.float64) - ref).abs().max())


def _forbidden_weight(weights: "torch.Tensor", allow: "torch.Tensor") -> float:
    import torch

    w = weights.to(torch.float64)
    keep = (~allow) & torch.isfinite(w)  # [.., Tq, Tk]
    return float(torch.where(keep, w, torch.zeros_like(w)).max())


def _seeded_case(seed: int):
    import torch

    gen = generator(seed)
    dh = E // NH
    q = torch.randn(B, NH, T, dh, generator=gen)  # [B, Nh, Tq, Dh]
    k = torch.randn(B, NH, T, dh, generator=gen)  # [B, Nh, Tk, Dh]
    v = torch.randn(B, NH, T, dh, generator=gen)  # [B, Nh, Tk, Dv]
    x = torch.randn(B, T, E, generator=gen)  # [B, T, E]
    mha = torch.nn.MultiheadAttention(E, NH, batch_first=True, dropout=0.0)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.randn(3 * E, E, generator=gen) / math.sqrt(E))
        mha.in_proj_bias.copy_(torch.randn(3 * E, generator=gen) * 0.1)
        mha.out_proj.weight.copy_(torch.randn(E, E, generator=gen) / math.sqrt(E))
        mha.out_proj.bias.copy_(torch.randn(E, generator=gen) * 0.1)
    return q, k, v, x, mha.eval()


def _mha_projections(mha: "torch.nn.MultiheadAttention", x: "torch.Tensor"):
    """MultiheadAttention's own q, k, v ``[B, Nh, T, Dh]`` in float64, by its weights, for the reference."""
    import torch

    from attn_ledger.maths.pipeline import split_heads

    w = mha.in_proj_weight.detach().to(torch.float64)
    bias = mha.in_proj_bias.detach().to(torch.float64)
    x64 = x.to(torch.float64)
    q, k, v = (x64 @ w[i * E:(i + 1) * E].T + bias[i * E:(i + 1) * E] for i in range(3))  # [B, T, E] each
    return split_heads(q, mha.num_heads), split_heads(k, mha.num_heads), split_heads(v, mha.num_heads)


def _mha_out_proj(mha: "torch.nn.MultiheadAttention", heads: "torch.Tensor") -> "torch.Tensor":
    import torch

    from attn_ledger.maths.pipeline import merge_heads

    merged = merge_heads(heads.to(torch.float64))  # [B, T, E]
    return merged @ mha.out_proj.weight.detach().to(torch.float64).T + mha.out_proj.bias.detach().to(torch.float64)


def _manual(q, k, v, mask):
    from attn_ledger.maths import pipeline

    scores = pipeline.qk_scores(q, k, 1.0 / math.sqrt(q.shape[-1]))  # [B, Nh, Tq, Tk]
    weights = pipeline.softmax_keys(pipeline.apply_mask(scores, mask), mask, False)  # [B, Nh, Tq, Tk]
    return pipeline.mix_values(weights, v), weights  # [B, Nh, Tq, Dv]


def _sdpa(q, k, v, mask):
    import torch
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Nh, Tq, Dv]
    # SDPA returns no weights; with V = I its output is the weight matrix itself.
    eye = torch.eye(k.shape[-2]).expand(*k.shape[:-1], k.shape[-2])  # [B, Nh, Tk, Tk]
    return out, F.scaled_dot_product_attention(q, k, eye, attn_mask=mask)  # [B, Nh, Tq, Tk]


def polarity_calls(convs: tuple[Convention, ...], seed: int = 0) -> tuple[PolarityCall, ...]:
    """The causal relation through manual, SDPA and MHA, each in the correct and the inverted polarity."""
    import torch

    from attn_ledger.maths import masks
    from attn_ledger.maths.reference import reference_stages

    probed = {"manual": convs[0].probed, "sdpa": convs[1].probed, "mha": convs[2].probed}
    q, k, v, x, mha = _seeded_case(seed)
    allow = masks.causal(T, T)  # [Tq, Tk]
    ref_qkv = reference_stages(q, k, v, allow_mask=allow)["out"]  # [B, Nh, Tq, Dv]
    pq, pk, pv = _mha_projections(mha, x)
    ref_mha = _mha_out_proj(mha, reference_stages(pq, pk, pv, allow_mask=allow)["out"])  # [B, T, E]
    documented = {"manual": allow, "sdpa": masks.to_sdpa_bool(allow), "mha": masks.to_mha_bool(allow)}
    rows = []
    for api in ("manual", "sdpa", "mha"):
        for correct in (True, False):
            mask = documented[api] if correct else ~documented[api]  # [Tq, Tk]
            with torch.no_grad():
                if api == "manual":
                    out, weights = _manual(q, k, v, mask)
                    ref = ref_qkv
                elif api == "sdpa":
                    out, weights = _sdpa(q, k, v, mask)
                    ref = ref_qkv
                else:
                    out, weights = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
                    ref = ref_mha
            finite, diff = _compare(out, ref)
            seen_allow = mask if probed[api] == ALLOW else ~mask  # what the API took as allowed
            blocked = tuple(int(i) for i in torch.nonzero(~seen_allow.any(dim=-1)).flatten())
            passed = ALLOW if torch.equal(mask, allow) else BLOCK
            rows.append(PolarityCall(api, probed[api], passed, correct, finite, diff,
                                     _forbidden_weight(weights, allow), blocked))
    return tuple(rows)


# --- a query row with every key blocked -------------------------------------------------

@dataclass(frozen=True)
class AuditRow:
    """What one path returns for a query whose every key is blocked.

    Attributes:
        api: ``manual``, ``sdpa`` or ``mha``.
        path: how it was called.
        returns: ``NaN``, ``zeros``, ``mean of V``, ``other finite`` or ``error``.
        other_rows_finite: whether the queries that had keys came back finite.
        detail: the error's first line, or whether MHA's fast path ran.
    """

    api: str
    path: str
    returns: str
    other_rows_finite: bool | None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"api": self.api, "path": self.path, "returns": self.returns,
                "other_rows_finite": self.other_rows_finite, "detail": self.detail}


BLOCKED_Q = 1  # the query of the audit that has no allowed key


def _classify(row: "torch.Tensor", zeros: "torch.Tensor", mean_v: "torch.Tensor") -> str:
    import torch

    if not bool(torch.isfinite(row).all()):
        return "NaN"
    row64 = row.to(torch.float64)
    if torch.allclose(row64, zeros.to(torch.float64), atol=PROBE_ATOL, rtol=0):
        return "zeros"
    if torch.allclose(row64, mean_v.to(torch.float64), atol=PROBE_ATOL, rtol=1e-4):
        return "mean of V"
    return "other finite"


def _audit_path(api: str, path: str, fn: Callable[[], "torch.Tensor"], zeros: "torch.Tensor",
                mean_v: "torch.Tensor", detail: str = "") -> AuditRow:
    """Call one path on the audit's three queries and say what the fully blocked one got back.

    ``fn`` returns ``[..., Tq, D]``; ``zeros`` and ``mean_v`` are ``[..., D]``.
    """
    import torch

    try:
        out = fn()  # [..., Tq, D]
    except Exception as exc:  # an API refusing the input is one of the answers
        return AuditRow(api, path, "error", None, f"{type(exc).__name__}: {first_line(exc, type(exc).__name__)}"[:200])
    others = [i for i in range(out.shape[-2]) if i != BLOCKED_Q]
    rest = bool(torch.isfinite(out[..., others, :]).all())
    return AuditRow(api, path, _classify(out[..., BLOCKED_Q, :], zeros, mean_v), rest, detail)


def _mha_spied(mha: "torch.nn.MultiheadAttention", x: "torch.Tensor", block: "torch.Tensor", train: bool,
               grad: bool, need_weights: bool) -> tuple[Callable[[], "torch.Tensor"], list[int]]:
    """A call of ``mha`` in the given mode, and a list that grows when its native fast path runs."""
    import torch

    calls: list[int] = []

    def fn() -> "torch.Tensor":
        original = torch._native_multi_head_attention

        def spy(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        mha.train(train)
        torch._native_multi_head_attention = spy
        try:
            with torch.set_grad_enabled(grad):
                out, _ = mha(x, x, x, attn_mask=block, need_weights=need_weights, average_attn_weights=False)
            return out.detach()[:, None]  # [B, 1, T, E]: a head axis so the row index sits at -2
        finally:
            torch._native_multi_head_attention = original
            mha.eval()

    return fn, calls


MHA_AUDIT_PATHS = (  # label, train mode, grad enabled, need_weights
    ("weights returned (need_weights=True, eval)", False, True, True),
    ("no weights, fast path (eval, no grad)", False, False, False),
    ("no weights, off fast path (train mode, dropout 0)", True, True, False),
)


def blocked_row_audit(seed: int = 0) -> tuple[AuditRow, ...]:
    """Query 1 of 3 has every key blocked; the other queries see every key."""
    import torch
    import torch.nn.functional as F

    q, k, v, x, mha = _seeded_case(seed)
    q, k, v, x = q[:, :, :3], k[:, :, :3], v[:, :, :3], x[:, :3]
    allow = torch.ones(3, 3, dtype=torch.bool)  # [Tq, Tk]
    allow[BLOCKED_Q] = False
    additive = torch.zeros(3, 3).masked_fill(~allow, float("-inf"))  # [Tq, Tk]
    zeros_h = torch.zeros_like(v[..., 0, :])  # [B, Nh, Dv]
    mean_h = v.mean(dim=-2)  # [B, Nh, Dv]
    with torch.no_grad():
        rows = [
            _audit_path("manual", "masked_fill(-inf), softmax", lambda: _manual(q, k, v, allow)[0], zeros_h, mean_h),
            _audit_path("sdpa", "bool attn_mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allow),
                        zeros_h, mean_h),
            _audit_path("sdpa", "float attn_mask (0 / -inf)",
                        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive), zeros_h, mean_h),
        ]
    pq, pk, pv = _mha_projections(mha, x)
    zeros_m = _mha_out_proj(mha, torch.zeros_like(pv))[:, None, 0]  # [B, 1, E]: out_proj of a zero mix
    mean_m = _mha_out_proj(mha, pv.mean(dim=-2, keepdim=True).expand_as(pv))[:, None, 0]  # [B, 1, E]
    for label, train, grad, need_weights in MHA_AUDIT_PATHS:
        fn, calls = _mha_spied(mha, x, ~allow, train, grad, need_weights)
        row = _audit_path("mha", label, fn, zeros_m, mean_m)
        if row.returns != "error":
            row = replace(row, detail="native fast path ran" if calls else "native fast path did not run")
        rows.append(row)
    return tuple(rows)


def audit_disagreements(rows: tuple[AuditRow, ...]) -> tuple[str, ...]:
    """One line per API whose paths return different things for the fully blocked row."""
    lines = []
    for api in dict.fromkeys(r.api for r in rows):
        mine = [r for r in rows if r.api == api]
        kinds = {r.returns for r in mine}
        if len(kinds) > 1:
            lines.append(f"{api}: " + "; ".join(f"{r.path} -> {r.returns}" for r in mine))
    return tuple(lines)


# --- judging and the report ----------------------------------------------------------

# the polarity report's rows: the three APIs called with the causal relation (each in its
# documented and its inverted polarity), then the convention-only row of key_padding_mask
KPM_ROW = "mha key_padding_mask"
CONVENTION_ROWS = ("manual", "sdpa", "mha", KPM_ROW)  # in the order of conventions()


def convention_check(c: Convention) -> Check:
    """The probe and the installed documentation agree on what True means."""
    said = MEANING.get(c.documented or "", f"nothing found in {c.source}")
    return Check(4, "convention", "pass" if c.agree else "fail",
                 reason=f"probe: {MEANING[c.probed]}; documentation: {said}",
                 data={"api": c.api, "probed": c.probed, "documented": c.documented, "doc_line": c.doc_line,
                       "source": c.source})


def polarity_check(call: PolarityCall) -> Check:
    """The documented polarity matches the float64 reference; the inverted one (the control) does not."""
    measure = "max |diff| vs float64 causal reference"
    data = {"finite": call.finite}
    if call.correct:
        return bounded(4, "correct_polarity", measure, call.max_abs_diff, TOLERANCE, data=data)
    # a non-finite output (NaN diff) is a caught inversion: the value is kept as measured
    caught = not call.finite or call.max_abs_diff >= TOLERANCE
    return Check(4, "inverted_polarity_caught", "pass" if caught else "fail", measure, call.max_abs_diff,
                 TOLERANCE, ">=", reason="" if call.finite else "the output is not finite", data=data)


def _doc_note(c: Convention) -> Note:
    return Note("documented", {"doc_line": c.doc_line, "source": c.source})


def polarity_report(torch_version: str, convs: tuple[Convention, ...], calls: tuple[PolarityCall, ...],
                    audit: tuple[AuditRow, ...]) -> Report:
    """One row per API call (its convention check on the documented-polarity row), then key_padding_mask."""
    by_row = dict(zip(CONVENTION_ROWS, convs))
    rows = []
    for call in calls:
        checks = (convention_check(by_row[call.api]),) if call.correct else ()
        checks += (polarity_check(call),)
        note = _doc_note(by_row[call.api]) if call.correct else ""
        rows.append(Row(call.row_name, row_status(checks), checks, fields=call.fields(), note=note))
    kpm = by_row[KPM_ROW]
    kpm_checks = (convention_check(kpm),)
    rows.append(Row(KPM_ROW, row_status(kpm_checks), kpm_checks, fields={"convention": kpm.probed},
                    note=_doc_note(kpm)))
    disagreements = audit_disagreements(audit)
    notes = [Note("polarity_conventions"), Note("blocked_row", {"query": BLOCKED_Q, "queries": 3})]
    notes += [Note("blocked_row_path", r.as_dict()) for r in audit]
    split = [api for api in dict.fromkeys(r.api for r in audit) if len({r.returns for r in audit if r.api == api}) > 1]
    notes += [Note("blocked_row_agreement", {"api": api}) for api in split] or [
        Note("blocked_row_agreement", {"api": None})]
    details = {
        "mode": "apis", "torch_version": torch_version,
        "case": {"B": B, "Nh": NH, "Tq": T, "Tk": T, "E": E, "Dh": E // NH, "relation": "causal", "tolerance": TOLERANCE},
        "conventions": [c.as_dict() for c in convs],
        "blocked_row_audit": {"query": BLOCKED_Q, "rows": [r.as_dict() for r in audit],
                              "disagreements": list(disagreements)},
    }
    title = (f"polarity: boolean mask conventions, torch {torch_version}; causal relation B={B} Nh={NH} "
             f"Tq=Tk={T} E={E} against a float64 reference")
    return Report(COMMAND, title, tuple(rows), notes=tuple(notes), details=details, unit="row", row_label="api")


def run_polarity(seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Report:
    """Probe, compare, audit: the whole ``attn-ledger polarity`` without ``--mask``."""
    import torch

    step = progress or (lambda done, total: None)
    convs = conventions()
    step(1, 3)
    calls = polarity_calls(convs, seed)
    step(2, 3)
    audit = blocked_row_audit(seed)
    step(3, 3)
    return polarity_report(torch.__version__, convs, calls, audit)


# --- fingerprinting a user's mask -------------------------------------------------------

@dataclass(frozen=True)
class Advice:
    """How one API can take the mask."""

    api: str
    unchanged: bool
    how: str

    def as_dict(self) -> dict[str, Any]:
        return {"api": self.api, "unchanged": self.unchanged, "how": self.how}


@dataclass(frozen=True)
class MaskFingerprint:
    """What a mask file holds, measured against the expected relation.

    Attributes:
        path, name: the file and the tensor read from it.
        shape, dtype: as loaded.
        expect, padding_side: the relation asked for (the side only matters for padding).
        kind: ``bool``, ``integer 0/1``, ``float additive (0 / ...)``, ``float 0/1`` or ``float other``.
        polarity: ``allow``, ``block`` or None (matches neither).
        alignment: for causal masks: ``bottom-right``, ``top-left`` or ``both (Tq == Tk)``.
        fully_blocked_rows: query rows (over every leading axis; one per example for padding)
            with no allowed key, of ``total_rows``; None when the mask matches neither polarity.
        trap: the float 0/1 case: an additive API would add it and mask nothing.
        advice: how each API can take the mask.
    """

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    expect: str
    padding_side: str
    kind: str
    polarity: str | None
    alignment: str | None
    fully_blocked_rows: int | None
    total_rows: int
    trap: bool
    advice: tuple[Advice, ...]

    @property
    def additive(self) -> bool:
        return self.kind.startswith("float additive")


def mask_checks(fp: MaskFingerprint) -> tuple[Check, ...]:
    """The mask encodes the expected relation in some polarity; it is not the float 0/1 trap."""
    rel = fp.expect if fp.expect == "causal" else f"padding ({fp.padding_side})"
    data = {"expect": fp.expect, "polarity": fp.polarity, "alignment": fp.alignment}
    if fp.polarity is None:
        match = Check(2, "relation_match", "fail", reason=f"matches neither polarity of the {rel} relation", data=data)
    elif fp.additive:
        match = Check(2, "relation_match", "pass", data=data,
                      reason=f"the {rel} relation as an additive bias: 0 takes part, large negative is blocked")
    else:
        match = Check(2, "relation_match", "pass", data=data,
                      reason=f"the {rel} relation in {fp.polarity} polarity ({MEANING[fp.polarity]})")
    if not fp.kind.startswith("float"):
        trap = Check(2, "float_01_trap", "not_applicable", reason="not a float mask")
    elif fp.trap:
        read = f"; cast to bool it reads as the {rel} relation in {fp.polarity} polarity" if fp.polarity else ""
        trap = Check(2, "float_01_trap", "fail", data={"values": [0.0, 1.0]},
                     reason="float 0/1 values: an API that adds a float mask to the scores adds 0 or 1 and blocks "
                            "nothing" + read)
    else:
        trap = Check(2, "float_01_trap", "pass", reason="the float values are not 0/1")
    return match, trap


def mask_report(fp: MaskFingerprint) -> Report:
    """``polarity --mask``: one row for the mask (its fingerprint as fields), advice per API as notes."""
    checks = mask_checks(fp)
    fields = {"kind": fp.kind, "polarity": fp.polarity, "fully_blocked_rows": fp.fully_blocked_rows,
              "total_rows": fp.total_rows}
    if fp.expect == "causal":
        fields["alignment"] = fp.alignment
    axes = "..., Tq, Tk" if fp.expect == "causal" else ("B, 1, 1, Tk" if len(fp.shape) == 4 else "B, Tk")
    row = Row(fp.name, row_status(checks), checks, shape=fp.shape, axes=axes, fields=fields)
    notes = [Note("mask_advice", a.as_dict()) for a in fp.advice]
    details = {
        "mode": "mask", "path": fp.path, "tensor": fp.name, "shape": list(fp.shape), "dtype": fp.dtype,
        "expect": fp.expect, "padding_side": fp.padding_side if fp.expect == "padding" else None,
        "kind": fp.kind, "polarity": fp.polarity, "alignment": fp.alignment, "trap": fp.trap,
        "fully_blocked_rows": fp.fully_blocked_rows, "total_rows": fp.total_rows,
        "advice": [a.as_dict() for a in fp.advice],
    }
    rel = fp.expect if fp.expect == "causal" else f"padding ({fp.padding_side})"
    title = f"polarity --mask {fp.path}: tensor {fp.name!r}, {fp.dtype}, expected relation {rel}"
    return Report(COMMAND, title, (row,), notes=tuple(notes), details=details, unit="row", row_label="tensor")


def _pick_mask(tensors: dict[str, "torch.Tensor"], path: str) -> tuple[str, "torch.Tensor"]:
    if "mask" in tensors:
        return "mask", tensors["mask"]
    if len(tensors) == 1:
        return next(iter(tensors.items()))
    raise TensorFileError(f"--mask: {path!r} holds {sorted(tensors)}, expected a tensor named 'mask' or exactly one tensor")


def _expected_causal(shape: tuple[int, ...], align: str):
    from attn_ledger.maths import masks

    return masks.causal(shape[-2], shape[-1], align)  # [Tq, Tk], broadcast over leading axes


def _padding_rows(m: "torch.Tensor", side: str) -> bool:
    """Each row of ``[..., Tk]`` reads 1..10..0 (right) or 0..01..1 (left); some row has a 1.

    A row of all zeros fits (an example with no valid key); a mask of nothing but such
    rows does not, so the allow and block readings never both fit.
    """
    import torch

    rows = m.reshape(-1, m.shape[-1]).to(torch.int64)  # [rows, Tk]
    n = rows.sum(dim=-1, keepdim=True)  # [rows, 1]
    j = torch.arange(m.shape[-1])[None, :]
    want = j < n if side == "right" else j >= (m.shape[-1] - n)
    return bool((n >= 1).any()) and bool(torch.equal(rows.bool(), want))


def _match(allow_like: "torch.Tensor", expect: str, side: str) -> tuple[str | None, str | None]:
    """Polarity and (for causal) alignment of a boolean tensor against the expected relation."""
    import torch

    if expect == "causal":
        found: list[tuple[str, str]] = []
        for align in ("bottom-right", "top-left"):
            rel = _expected_causal(tuple(allow_like.shape), align)
            rel_b = rel.expand_as(allow_like)
            if torch.equal(allow_like, rel_b):
                found.append((ALLOW, align))
            elif torch.equal(~allow_like, rel_b):
                found.append((BLOCK, align))
        if not found:
            return None, None
        pol = found[0][0]
        aligns = [a for p, a in found if p == pol]
        return pol, "both (Tq == Tk)" if len(aligns) == 2 else aligns[0]
    if _padding_rows(allow_like, side):
        return ALLOW, None
    if _padding_rows(~allow_like, side):
        return BLOCK, None
    return None, None


def _advice(kind: str, polarity: str | None, expect: str, alignment: str | None) -> tuple[Advice, ...]:
    if polarity is None:
        return (Advice("any", False, f"build the {expect} relation again in allow polarity (True = may attend), "
                                     "then convert it for each API"),)
    if kind == "float 0/1":
        as_allow = "mask.bool()" if polarity == ALLOW else "~mask.bool()"
        return (
            Advice("manual pipeline", False, f"allow = {as_allow}"),
            Advice("F.scaled_dot_product_attention", False,
                   f"attn_mask = {as_allow} (a float 0/1 would be added to the scores and mask nothing)"),
            Advice("nn.MultiheadAttention", False, f"attn_mask = ~({as_allow}) (a float 0/1 would be added and mask nothing)"),
        )
    if kind == "float additive":
        conv = "allow = mask == 0"
        out = [Advice("manual pipeline", False, conv),
               Advice("F.scaled_dot_product_attention", True, "attn_mask = mask.to(q.dtype) (added to the scores)"),
               Advice("nn.MultiheadAttention", True, "attn_mask / key_padding_mask = mask (added to the scores)")]
        return tuple(out)
    cast = ".bool()" if kind == "integer 0/1" else ""
    allow_expr = f"mask{cast}" if polarity == ALLOW else f"~mask{cast}"
    block_expr = f"~mask{cast}" if polarity == ALLOW else f"mask{cast}"
    is_bool = kind == "bool"
    mha_arg = "key_padding_mask" if expect == "padding" else "attn_mask"
    sdpa_how = f"attn_mask = {allow_expr}"
    if expect == "padding":
        sdpa_how += "[:,None,None,:] (shape [B,1,1,Tk])"  # no spaces: a table wraps it whole
    elif alignment == "top-left":
        sdpa_how += " (or is_causal=True, which is top-left aligned)"
    return (
        Advice("manual pipeline", is_bool and polarity == ALLOW, f"allow = {allow_expr}"),
        Advice("F.scaled_dot_product_attention", is_bool and polarity == ALLOW and expect == "causal", sdpa_how),
        Advice("nn.MultiheadAttention", is_bool and polarity == BLOCK, f"{mha_arg} = {block_expr}"),
    )


def _read_mask(m: "torch.Tensor", expect: str, side: str, name: str, p: str):
    """``(kind, polarity, alignment, allow, trap)`` of a mask; ``allow`` is its allow-polarity reading or None."""
    import torch

    if m.dtype == torch.bool:
        pol, align = _match(m, expect, side)
        return "bool", pol, align, None if pol is None else (m if pol == ALLOW else ~m), False
    if m.is_floating_point():
        if bool(torch.isnan(m).any()):
            raise TensorFileError(f"{name}: got NaN values in {p!r}, expected a boolean or additive mask")
        values = set(torch.unique(m).tolist())
        if values <= {0.0, 1.0} and 1.0 in values:
            pol, align = _match(m == 1.0, expect, side)
            return "float 0/1", pol, align, None if pol is None else ((m == 1.0) if pol == ALLOW else (m == 0.0)), True
        if all(v == 0.0 or v <= LARGE_NEGATIVE for v in values):
            blocked_value = "-inf" if float("-inf") in values else (f"{min(values):.3g}" if len(values) > 1 else "none")
            pol, align = _match(m == 0.0, expect, side)
            pol = ALLOW if pol == ALLOW else None  # an additive mask has one meaning: 0 takes part
            return f"float additive (0 / {blocked_value})", pol, align, (m == 0.0) if pol else None, False
        return "float other", None, None, None, False
    if m.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        values = set(torch.unique(m).tolist())
        if not values <= {0, 1}:
            raise TensorFileError(f"{name}: got integer values {sorted(values)[:6]} in {p!r}, expected 0/1, bool or float")
        pol, align = _match(m == 1, expect, side)
        return "integer 0/1", pol, align, None if pol is None else ((m == 1) if pol == ALLOW else (m == 0)), False
    raise TensorFileError(f"{name}: got dtype {m.dtype} in {p!r}, expected bool, an integer 0/1 or a float mask")


def classify_mask(path: str | Path, expect: str, padding_side: str = "right") -> MaskFingerprint:
    """Read a saved mask and measure it against the expected relation."""
    from attn_ledger.inputs.tensorio import load_tensor_file

    if expect not in ("causal", "padding"):
        raise field_error("--expect", expect, "causal or padding")
    if padding_side not in ("right", "left"):
        raise field_error("--padding-side", padding_side, "right or left")
    p = str(path)
    name, m = _pick_mask(load_tensor_file(path, "--mask"), p)
    shape = tuple(m.shape)
    if expect == "causal" and (m.dim() < 2 or 0 in shape):
        raise TensorFileError(f"{name}: got shape {list(shape)} in {p!r}, expected [..., Tq, Tk] for a causal mask")
    if expect == "padding" and m.dim() == 4 and shape[1] == 1 and shape[2] == 1:
        m = m[:, 0, 0, :]  # [B, Tk]
    if expect == "padding" and (m.dim() != 2 or 0 in m.shape):
        raise TensorFileError(f"{name}: got shape {list(shape)} in {p!r}, expected [B, Tk] or [B, 1, 1, Tk] for a padding mask")
    kind, pol, align, allow, trap = _read_mask(m, expect, padding_side, name, p)
    if allow is not None:
        dead = ~allow.reshape(-1, allow.shape[-1]).any(dim=-1)  # [rows]
        fully_rows, total_rows = int(dead.sum()), int(dead.numel())  # padding: one row per example
    else:  # no reading of the mask to count with
        fully_rows, total_rows = None, int(m.reshape(-1, m.shape[-1]).shape[0])
    base_kind = "float additive" if kind.startswith("float additive") else kind
    return MaskFingerprint(p, name, shape, str(m.dtype).replace("torch.", ""), expect, padding_side, kind, pol, align,
                           fully_rows, total_rows, trap, _advice(base_kind, pol, expect, align))


def fingerprint(path: str | Path, expect: str, padding_side: str = "right") -> Report:
    """Classify a saved mask against the expected relation and say how each API can take it."""
    return mask_report(classify_mask(path, expect, padding_side))


def polarity(mask: str | Path | None = None, expect: str | None = None, padding_side: str = "right",
             progress: Callable[[int, int], None] | None = None) -> Report:
    """``attn-ledger polarity``: the API conventions, or with ``mask`` and ``expect``, a mask's fingerprint."""
    if mask is None and expect is None:
        return run_polarity(progress=progress)
    if mask is None:
        raise field_error("--expect", expect, "it together with --mask FILE")
    if expect is None:
        raise field_error("--mask", str(mask), "it together with --expect causal|padding")
    return fingerprint(mask, expect, padding_side)
