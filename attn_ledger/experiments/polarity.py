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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from attn_ledger.errors import TensorFileError, field_error
from attn_ledger.report import CheckedReport, Check, envelope, json_number

if TYPE_CHECKING:
    import torch

COMMAND = "polarity"
ALLOW, BLOCK = "allow", "block"
MEANING = {ALLOW: "True = takes part", BLOCK: "True = blocked"}
TOLERANCE = 1e-5  # float32 outputs against the float64 reference
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

    def to_json(self) -> dict[str, Any]:
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

    from attn_ledger import pipeline

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

    from attn_ledger import masks

    sdpa_line = doc_sentence(param_section(F.scaled_dot_product_attention.__doc__, "attn_mask"))
    mha_doc = torch.nn.MultiheadAttention.forward.__doc__
    mha_attn = doc_sentence(param_section(mha_doc, "attn_mask"))
    mha_kpm = doc_sentence(param_section(mha_doc, "key_padding_mask"))
    manual_line = next((ln.strip() for ln in (masks.__doc__ or "").splitlines() if "ALLOW polarity" in ln), None)
    if manual_line is not None:
        manual_line = " ".join((masks.__doc__ or "").split()).split("Every function here")[1].split(".")[0]
        manual_line = "Every function here" + manual_line + "."
    return (
        Convention("manual pipeline (attn_ledger.pipeline)", probe_manual(), doc_polarity(manual_line), manual_line,
                   "attn_ledger.masks.__doc__"),
        Convention("F.scaled_dot_product_attention attn_mask", probe_sdpa(), doc_polarity(sdpa_line), sdpa_line,
                   "torch.nn.functional.scaled_dot_product_attention.__doc__ (attn_mask)"),
        Convention("nn.MultiheadAttention attn_mask", probe_mha("attn_mask"), doc_polarity(mha_attn), mha_attn,
                   "torch.nn.MultiheadAttention.forward.__doc__ (attn_mask)"),
        Convention("nn.MultiheadAttention key_padding_mask", probe_mha("key_padding_mask"), doc_polarity(mha_kpm), mha_kpm,
                   "torch.nn.MultiheadAttention.forward.__doc__ (key_padding_mask)"),
    )


# --- the causal relation through each API, both polarities ------------------------------

@dataclass(frozen=True)
class PolarityRow:
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
        verdict: ``ok``, ``wrong finite numbers`` or ``NaN``.
    """

    api: str
    convention: str
    passed: str
    correct: bool
    finite: bool
    max_abs_diff: float
    forbidden_weight: float
    blocked_rows: tuple[int, ...]
    verdict: str

    def to_json(self) -> dict[str, Any]:
        return {"api": self.api, "convention": self.convention, "passed": self.passed, "correct": self.correct,
                "finite": self.finite, "max_abs_diff": json_number(self.max_abs_diff),
                "forbidden_weight": json_number(self.forbidden_weight), "blocked_rows": list(self.blocked_rows),
                "verdict": self.verdict}


def _verdict(out: "torch.Tensor", ref: "torch.Tensor") -> tuple[bool, float, str]:
    import torch

    finite = bool(torch.isfinite(out).all())
    diff = float((out.to(torch.float64) - ref).abs().max())
    if not finite:
        return False, diff, "NaN"
    return True, diff, "ok" if diff <= TOLERANCE else "wrong finite numbers"


def _forbidden_weight(weights: "torch.Tensor", allow: "torch.Tensor") -> float:
    import torch

    w = weights.to(torch.float64)
    keep = (~allow) & torch.isfinite(w)  # [.., Tq, Tk]
    return float(torch.where(keep, w, torch.zeros_like(w)).max())


def _seeded_case(seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
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

    from attn_ledger.pipeline import split_heads

    w = mha.in_proj_weight.detach().to(torch.float64)
    bias = mha.in_proj_bias.detach().to(torch.float64)
    x64 = x.to(torch.float64)
    q, k, v = (x64 @ w[i * E:(i + 1) * E].T + bias[i * E:(i + 1) * E] for i in range(3))  # [B, T, E] each
    return split_heads(q, mha.num_heads), split_heads(k, mha.num_heads), split_heads(v, mha.num_heads)


def _mha_out_proj(mha: "torch.nn.MultiheadAttention", heads: "torch.Tensor") -> "torch.Tensor":
    import torch

    from attn_ledger.pipeline import merge_heads

    merged = merge_heads(heads.to(torch.float64))  # [B, T, E]
    return merged @ mha.out_proj.weight.detach().to(torch.float64).T + mha.out_proj.bias.detach().to(torch.float64)


def _manual(q, k, v, mask):
    from attn_ledger import pipeline

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


def polarity_rows(convs: tuple[Convention, ...], seed: int = 0) -> tuple[PolarityRow, ...]:
    """The causal relation through manual, SDPA and MHA, each in the correct and the inverted polarity."""
    import torch

    from attn_ledger import masks
    from attn_ledger.reference import reference_stages

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
            finite, diff, verdict = _verdict(out, ref)
            seen_allow = mask if probed[api] == ALLOW else ~mask  # what the API took as allowed
            blocked = tuple(int(i) for i in torch.nonzero(~seen_allow.any(dim=-1)).flatten())
            passed = ALLOW if torch.equal(mask, allow) else BLOCK
            rows.append(PolarityRow(api, probed[api], passed, correct, finite, diff,
                                    _forbidden_weight(weights, allow), blocked, verdict))
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

    def to_json(self) -> dict[str, Any]:
        return {"api": self.api, "path": self.path, "returns": self.returns,
                "other_rows_finite": self.other_rows_finite, "detail": self.detail}


BLOCKED_Q = 1  # the query of the audit that has no allowed key


def _classify(row: "torch.Tensor", zeros: "torch.Tensor", mean_v: "torch.Tensor") -> str:
    import torch

    if not bool(torch.isfinite(row).all()):
        return "NaN"
    row64 = row.to(torch.float64)
    if torch.allclose(row64, zeros.to(torch.float64), atol=1e-5, rtol=0):
        return "zeros"
    if torch.allclose(row64, mean_v.to(torch.float64), atol=1e-5, rtol=1e-4):
        return "mean of V"
    return "other finite"


def blocked_row_audit(seed: int = 0) -> tuple[AuditRow, ...]:
    """Query 1 of 3 has every key blocked; the other queries see every key."""
    import torch
    import torch.nn.functional as F

    q, k, v, x, mha = _seeded_case(seed)
    q, k, v, x = q[:, :, :3], k[:, :, :3], v[:, :, :3], x[:, :3]
    allow = torch.ones(3, 3, dtype=torch.bool)  # [Tq, Tk]
    allow[BLOCKED_Q] = False
    others = [i for i in range(3) if i != BLOCKED_Q]
    rows: list[AuditRow] = []

    def record(api: str, path: str, fn: Callable[[], "torch.Tensor"], zeros, mean_v, detail: str = "") -> None:
        try:
            out = fn()
        except Exception as exc:  # an API refusing the input is one of the answers
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            rows.append(AuditRow(api, path, "error", None, f"{type(exc).__name__}: {first}"[:200]))
            return
        row = out[..., BLOCKED_Q, :]  # [.., D]
        rest = bool(torch.isfinite(out[..., others, :]).all())
        rows.append(AuditRow(api, path, _classify(row, zeros, mean_v), rest, detail))

    zeros_h = torch.zeros_like(v[..., 0, :])  # [B, Nh, Dv]
    mean_h = v.mean(dim=-2)  # [B, Nh, Dv]
    with torch.no_grad():
        record("manual", "masked_fill(-inf), softmax", lambda: _manual(q, k, v, allow)[0], zeros_h, mean_h)
        record("sdpa", "bool attn_mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allow), zeros_h, mean_h)
        additive = torch.zeros(3, 3).masked_fill(~allow, float("-inf"))  # [Tq, Tk]
        record("sdpa", "float attn_mask (0 / -inf)", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
               zeros_h, mean_h)

    pq, pk, pv = _mha_projections(mha, x)
    zeros_m = _mha_out_proj(mha, torch.zeros_like(pv))[:, 0]  # [B, E]: out_proj of a zero mix
    mean_m = _mha_out_proj(mha, pv.mean(dim=-2, keepdim=True).expand_as(pv))[:, 0]  # [B, E]
    block = ~allow

    def mha_call(train: bool, grad: bool, need_weights: bool) -> tuple[Callable[[], Any], list[int]]:
        calls: list[int] = []

        def fn():
            original = torch._native_multi_head_attention

            def spy(*args, **kwargs):
                calls.append(1)
                return original(*args, **kwargs)

            mha.train(train)
            torch._native_multi_head_attention = spy
            try:
                with torch.set_grad_enabled(grad):
                    out, _ = mha(x, x, x, attn_mask=block, need_weights=need_weights, average_attn_weights=False)
                return out.detach()
            finally:
                torch._native_multi_head_attention = original
                mha.eval()

        return fn, calls

    for label, train, grad, nw in (
        ("weights returned (need_weights=True, eval)", False, True, True),
        ("no weights, fast path (eval, no grad)", False, False, False),
        ("no weights, off fast path (train mode, dropout 0)", True, True, False),
    ):
        fn, calls = mha_call(train, grad, nw)

        def wrapped(fn=fn):
            return fn()[:, None]  # [B, 1, T, E]: a head axis so the row index sits at -2

        record("mha", label, wrapped, zeros_m[:, None], mean_m[:, None])
        last = rows[-1]
        if last.returns != "error":
            rows[-1] = AuditRow(last.api, last.path, last.returns, last.other_rows_finite,
                                "native fast path ran" if calls else "native fast path did not run")
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


# --- the report -------------------------------------------------------------------------

@dataclass(frozen=True)
class PolarityReport(CheckedReport):
    """``attn-ledger polarity``: conventions, the polarity table, the fully blocked row audit."""

    torch_version: str
    conventions: tuple[Convention, ...]
    rows: tuple[PolarityRow, ...]
    audit: tuple[AuditRow, ...]
    disagreements: tuple[str, ...]
    checks: tuple[Check, ...]

    def to_json(self) -> dict[str, Any]:
        return envelope(
            COMMAND, self.verdict, mode="apis", torch_version=self.torch_version,
            case={"B": B, "Nh": NH, "Tq": T, "Tk": T, "E": E, "Dh": E // NH, "relation": "causal", "tolerance": TOLERANCE},
            conventions=[c.to_json() for c in self.conventions],
            rows=[r.to_json() for r in self.rows],
            blocked_row_audit={"query": BLOCKED_Q, "rows": [r.to_json() for r in self.audit],
                               "disagreements": list(self.disagreements)},
            checks=[c.to_json() for c in self.checks],
        )

    def _tables(self) -> list[tuple[str, list[str], list[list[str]]]]:
        conv = (f"Conventions, torch {self.torch_version}: probed with mask [True, False] on two keys; "
                "documentation quoted from the installed docstring")
        conv_rows = [[c.api, MEANING[c.probed], MEANING.get(c.documented or "", "not found"),
                      "yes" if c.agree else "NO", c.doc_line or f"(no sentence found in {c.source})"]
                     for c in self.conventions]
        pol_rows = [[r.api, MEANING[r.convention], r.passed + ("" if r.correct else " (inverted)"),
                     "yes" if r.finite else "no", _num(r.max_abs_diff), _num(r.forbidden_weight),
                     ",".join(map(str, r.blocked_rows)) or "-", r.verdict] for r in self.rows]
        audit_rows = [[r.api, r.path, r.returns, {True: "yes", False: "no", None: "-"}[r.other_rows_finite], r.detail]
                      for r in self.audit]
        return [
            (conv, ["API", "probe", "documented", "agree", "documentation line"], conv_rows),
            (f"Causal relation B={B} Nh={NH} Tq=Tk={T} E={E}, against a float64 causal reference",
             ["API", "convention", "polarity passed", "finite", "max |diff|", "forbidden weight", "blocked rows", "verdict"],
             pol_rows),
            (f"Fully blocked row: query {BLOCKED_Q} of 3 has every key blocked",
             ["API", "path", "returns", "other rows finite", "detail"], audit_rows),
        ]

    def _notes(self) -> list[str]:
        notes = [f"paths of one API disagree: {d}" for d in self.disagreements] or ["all paths of each API agree on the fully blocked row"]
        return notes

    def to_markdown(self) -> str:
        out = [f"### polarity: verdict {self.verdict}", ""]
        for title, headers, rows in self._tables():
            out += [f"**{title}**", "", _md_table(headers, rows), ""]
        out += [f"- {n}" for n in self._notes()]
        out += [f"- **{_mark(c)}** `{c.name}`: {c.detail}" for c in self.checks]
        return "\n".join(out) + "\n"

    def to_rich(self) -> Any:
        return _rich_group(f"polarity: verdict {self.verdict}", self._tables(), self._notes(), self.checks)


def _num(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def _mark(c: Check) -> str:
    return {True: "ok", False: "FAIL", None: "n/a"}[c.ok]


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _rich_group(title: str, tables, notes, checks) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(title, style="bold")]
    for t_title, headers, rows in tables:
        table = Table(title=t_title, title_justify="left")
        for h in headers:
            table.add_column(h, overflow="fold")
        for row in rows:
            table.add_row(*row)
        parts.append(table)
    parts += [Text(n) for n in notes]
    for c in checks:
        line = Text()
        line.append(f"{_mark(c):>4} ", style={True: "green", False: "bold red", None: "dim"}[c.ok])
        line.append(f"{c.name}: {c.detail}")
        parts.append(line)
    return Group(*parts)


def polarity_checks(convs: tuple[Convention, ...], rows: tuple[PolarityRow, ...]) -> tuple[Check, ...]:
    """Probe agrees with documentation; the documented polarity matches the reference; the inverted one is caught."""
    checks = []
    for c in convs:
        detail = (f"probe says {MEANING[c.probed]}, documentation says "
                  f"{MEANING.get(c.documented or '', 'nothing found')}")
        checks.append(Check(4, f"convention[{c.api}]", c.agree, None, detail))
    for r in rows:
        if r.correct:
            checks.append(Check(4, f"correct_polarity[{r.api}]", r.verdict == "ok", r.max_abs_diff,
                                f"{r.api} with its documented polarity: {r.verdict}, max |diff| {_num(r.max_abs_diff)}"))
        else:
            checks.append(Check(4, f"inverted_polarity_caught[{r.api}]", r.verdict != "ok", r.max_abs_diff,
                                f"control: {r.api} with the inverted polarity: {r.verdict}, max |diff| {_num(r.max_abs_diff)}"))
    return tuple(checks)


def run_polarity(seed: int = 0, progress: Callable[[int, int], None] | None = None) -> PolarityReport:
    """Probe, compare, audit: the whole ``attn-ledger polarity`` without ``--mask``."""
    import torch

    step = progress or (lambda done, total: None)
    convs = conventions()
    step(1, 3)
    rows = polarity_rows(convs, seed)
    step(2, 3)
    audit = blocked_row_audit(seed)
    step(3, 3)
    return PolarityReport(torch.__version__, convs, rows, audit, audit_disagreements(audit), polarity_checks(convs, rows))


# --- fingerprinting a user's mask -------------------------------------------------------

@dataclass(frozen=True)
class Advice:
    """How one API can take the mask."""

    api: str
    unchanged: bool
    how: str

    def to_json(self) -> dict[str, Any]:
        return {"api": self.api, "unchanged": self.unchanged, "how": self.how}


@dataclass(frozen=True)
class MaskReport(CheckedReport):
    """``attn-ledger polarity --mask``: what the file holds, measured against the expected relation.

    Attributes:
        kind: ``bool``, ``integer 0/1``, ``float additive``, ``float 0/1`` or ``float other``.
        polarity: ``allow``, ``block`` or None (matches neither).
        alignment: for causal masks: ``bottom-right``, ``top-left`` or ``both`` (Tq == Tk).
        fully_blocked_rows: query rows (over every leading axis) with no allowed key.
        trap: the float 0/1 case: an additive API would add it and mask nothing.
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
    fully_blocked_rows: int
    total_rows: int
    trap: bool
    summary: str
    advice: tuple[Advice, ...]

    @property
    def ok(self) -> bool:
        return self.polarity is not None and not self.trap

    def to_json(self) -> dict[str, Any]:
        return envelope(
            COMMAND, self.verdict, mode="mask", path=self.path, tensor=self.name, shape=list(self.shape),
            dtype=self.dtype, expect=self.expect, padding_side=self.padding_side if self.expect == "padding" else None,
            kind=self.kind, polarity=self.polarity, alignment=self.alignment, trap=self.trap,
            fully_blocked_rows=self.fully_blocked_rows, total_rows=self.total_rows, summary=self.summary,
            advice=[a.to_json() for a in self.advice],
        )

    def _facts(self) -> list[str]:
        rel = self.expect if self.expect == "causal" else f"padding ({self.padding_side})"
        facts = [
            f"mask {self.name!r} {list(self.shape)} {self.dtype} from {self.path}, expected relation: {rel}",
            f"kind: {self.kind}; polarity: {self.polarity or 'matches neither'}"
            + (f"; alignment: {self.alignment}" if self.alignment else ""),
            f"fully blocked query rows: {self.fully_blocked_rows} of {self.total_rows}",
            self.summary,
        ]
        return facts

    def to_markdown(self) -> str:
        out = [f"### polarity --mask: verdict {self.verdict}", ""] + [f"- {f}" for f in self._facts()] + [""]
        out.append(_md_table(["API", "takes it unchanged", "how"],
                             [[a.api, "yes" if a.unchanged else "no", a.how] for a in self.advice]))
        return "\n".join(out) + "\n"

    def to_rich(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title="Which APIs can take it", title_justify="left")
        for h in ("API", "takes it unchanged", "how"):
            table.add_column(h, overflow="fold")
        for a in self.advice:
            table.add_row(a.api, "yes" if a.unchanged else "no", a.how)
        head = Text(f"polarity --mask: verdict {self.verdict}", style="bold" if self.ok else "bold red")
        return Group(head, *[Text(f) for f in self._facts()], table)


def _pick_mask(tensors: dict[str, "torch.Tensor"], path: str) -> tuple[str, "torch.Tensor"]:
    if "mask" in tensors:
        return "mask", tensors["mask"]
    if len(tensors) == 1:
        return next(iter(tensors.items()))
    raise TensorFileError(f"--mask: {path!r} holds {sorted(tensors)}, expected a tensor named 'mask' or exactly one tensor")


def _expected_causal(shape: tuple[int, ...], align: str):
    from attn_ledger import masks

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
        sdpa_how += "[:, None, None, :]  # [B, 1, 1, Tk]"
    elif alignment == "top-left":
        sdpa_how += " (or is_causal=True, which is top-left aligned)"
    return (
        Advice("manual pipeline", is_bool and polarity == ALLOW, f"allow = {allow_expr}"),
        Advice("F.scaled_dot_product_attention", is_bool and polarity == ALLOW and expect == "causal", sdpa_how),
        Advice("nn.MultiheadAttention", is_bool and polarity == BLOCK, f"{mha_arg} = {block_expr}"),
    )


def fingerprint(path: str | Path, expect: str, padding_side: str = "right") -> MaskReport:
    """Classify a saved mask against the expected relation and say how each API can take it."""
    import torch

    from attn_ledger.tensorio import load_tensor_file

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
    dtype = str(m.dtype).replace("torch.", "")
    trap = False
    if m.dtype == torch.bool:
        kind = "bool"
        pol, align = _match(m, expect, padding_side)
        allow = None if pol is None else (m if pol == ALLOW else ~m)
    elif m.is_floating_point():
        if bool(torch.isnan(m).any()):
            raise TensorFileError(f"{name}: got NaN values in {p!r}, expected a boolean or additive mask")
        values = set(torch.unique(m).tolist())
        if values <= {0.0, 1.0} and 1.0 in values:
            kind, trap = "float 0/1", True
            pol, align = _match(m == 1.0, expect, padding_side)
            allow = None if pol is None else ((m == 1.0) if pol == ALLOW else (m == 0.0))
        elif all(v == 0.0 or v <= LARGE_NEGATIVE for v in values):
            kind = "float additive"
            blocked_value = "-inf" if float("-inf") in values else (f"{min(values):.3g}" if len(values) > 1 else "none")
            pol, align = _match(m == 0.0, expect, padding_side)
            pol = ALLOW if pol == ALLOW else None  # an additive mask has one meaning: 0 takes part
            allow = (m == 0.0) if pol else None
            kind = f"float additive (0 / {blocked_value})"
        else:
            kind = "float other"
            pol, align, allow = None, None, None
    elif m.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        values = set(torch.unique(m).tolist())
        if not values <= {0, 1}:
            raise TensorFileError(f"{name}: got integer values {sorted(values)[:6]} in {p!r}, expected 0/1, bool or float")
        kind = "integer 0/1"
        pol, align = _match(m == 1, expect, padding_side)
        allow = None if pol is None else ((m == 1) if pol == ALLOW else (m == 0))
    else:
        raise TensorFileError(f"{name}: got dtype {m.dtype} in {p!r}, expected bool, an integer 0/1 or a float mask")
    if allow is not None:
        dead = ~allow.reshape(-1, allow.shape[-1]).any(dim=-1)  # [rows]
        fully_rows, total_rows = int(dead.sum()), int(dead.numel())  # padding: one row per example
    else:
        fully_rows, total_rows = 0, int(m.reshape(-1, m.shape[-1]).shape[0])
    base_kind = "float additive" if kind.startswith("float additive") else kind
    advice = _advice(base_kind, pol, expect, align)
    if trap:
        summary = (f"float 0/1 trap: reads as the {expect} relation in {pol} polarity if cast to bool, "
                   "but an API that adds float masks to the scores would add 0 or 1 and block nothing"
                   if pol else "float 0/1 mask that matches neither polarity of the relation; as a float it blocks nothing")
    elif pol is None:
        summary = f"matches neither polarity of the expected {expect} relation"
    else:
        summary = f"{expect} relation in {pol} polarity ({MEANING.get(pol, pol)})" if base_kind != "float additive" else \
            f"{expect} relation as an additive bias: 0 takes part, large negative is blocked"
    if expect == "padding" and fully_rows:
        summary += f"; {fully_rows} example(s) have no valid key, so every query in them is fully blocked"
    return MaskReport(p, name, shape, dtype, expect, padding_side, kind, pol, align, fully_rows, total_rows,
                      trap, summary, advice)
