"""Two runs of one model, judged layer by layer: what each block adds, apart from what it inherited.

:func:`runs` turns ``--vary WHAT`` into the two runs (targets, dtypes, input plans); :func:`compare` asks the
model's handle to run them (:func:`attn_ledger.probes.model.pair.run_compare`, in the worker) and judges what
streams back, here, in the tool's process. Rows, in order:

* model-level rows: ``embeddings`` (block 0's input), ``masks`` (which real keys each real query may read, as
  each block received its mask), ``position_ids`` and ``position_embeddings`` as the blocks received them;
* one row per block: its total error (B's output against A's) and its added error (B's block replayed on A's
  input, with B's own mask and positions, against A's output), judged by the ratio rule against the plain
  error at that block (:func:`attn_ledger.tolerance.compare_bound`);
* ``logits``: the ratio rule on the whole run, and token agreement: each run's top token among the other's
  top :data:`attn_ledger.tolerance.TOP_K`.

Only real rows are compared; under ``padding-side`` they are aligned by their order among the example's real
tokens (an encoder-decoder's decoder blocks, whose tokens are never padded, meet row for row), under ``cache`` each
decoded token's forward meets A's row at its position, under ``packing`` each packed document meets its own
example's rows. The first failing row is the headline, so a block that adds error is named where it first acts;
the first adder's attention calls are then judged and put through the stage ledger
(:mod:`attn_ledger.probes.model.adder`), under ``cache`` each decode step's and under ``packing`` the packed row's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger.errors import InputError, shown
from attn_ledger.report import Check, Note, Report, Row, bounded, counted, row_status, unjudged
from attn_ledger.tolerance import COMPARE_FACTOR, TOP_K, compare_bound, eps

if TYPE_CHECKING:
    from torch import Tensor

VARY_KINDS = ("attn-implementation", "dtype", "padding-side", "batch", "cache", "packing", "target")
FIXED_RUNS = {  # the kinds whose two runs are fixed: run A, run B (``WHAT=A,B`` may name them), and what they are
    "padding-side": ("left", "right", "left against right"),
    "batch": ("alone", "batched", "each example alone against the batch"),
    "cache": ("full", "cached", "the full forward against decoding through the cache"),
    "packing": ("apart", "packed", "each sequence apart against packed"),
}
DTYPES = ("float32", "bfloat16", "float16", "float64")
BUILTIN = ("eager", "sdpa", "flex_attention")


@dataclass(frozen=True)
class Vary:
    """What differs between run A and run B: ``kind`` and each run's value."""

    kind: str
    a: str
    b: str

    @property
    def words(self) -> str:
        if self.kind == "models":  # two models given to compare_models
            return f"two models ({self.a} against {self.b})"
        if self.kind == "cache":
            return "cache (the full forward against a prefill and token-by-token decode through the cache)"
        if self.kind == "packing":
            return "packing (each sequence apart against all packed into one row, position ids restarting)"
        if self.kind == "target":
            return f"target={self.b}"
        return f"{self.kind}={self.a},{self.b}"


def parse_vary(text: str) -> Vary:
    """``--vary WHAT``: ``attn-implementation=A,B``, ``dtype=A,B``, ``padding-side`` (left against right),
    ``batch`` (each example alone against the batch), ``cache`` (the full forward against a prefill and
    token-by-token decode through the model's own cache), ``packing`` (each sequence apart against all of them
    packed into one row) or ``target=FILE:FACTORY`` (another model: a port against its reference).

    Raises:
        InputError: an unknown kind, or values that are not two distinct names.
        SetupError: a target that is not ``FILE:FACTORY`` (or ``module:FACTORY``), or a missing file.
    """
    kind, eq, values = text.partition("=")
    kind = kind.strip()
    expected = "attn-implementation=A,B, dtype=A,B, padding-side, batch, cache, packing or target=FILE:FACTORY"
    if kind not in VARY_KINDS:
        raise InputError(f"--vary: got {shown(text)}, expected {expected}")
    if kind in FIXED_RUNS:
        a, b, what = FIXED_RUNS[kind]
        if eq and values.replace(" ", "") not in (f"{a},{b}", ""):
            raise InputError(f"--vary: got {shown(text)}, expected {kind} ({what})")
        return Vary(kind, a, b)
    if kind == "target":
        from attn_ledger.inputs.userload import parse_spec

        parse_spec(values.strip(), "--vary target")
        return Vary(kind, "", values.strip())
    names = [v.strip() for v in values.split(",")]
    if not eq or len(names) != 2 or not all(names) or names[0] == names[1]:
        raise InputError(f"--vary: got {shown(text)}, expected {kind}=A,B with two different values")
    if kind == "dtype":
        for name in names:
            if name not in DTYPES:
                raise InputError(f"--vary: got dtype {name!r}, expected two of {', '.join(DTYPES)}")
    return Vary(kind, names[0], names[1])


@dataclass(frozen=True)
class Runs:
    """The two runs as plain data: each one's target (as JSON), dtype and input plan (as JSON)."""

    vary: Vary
    target_a: dict[str, Any]
    target_b: dict[str, Any]
    dtypes: tuple[str, str]
    plan_a: dict[str, Any]
    plan_b: dict[str, Any]
    map: str | None = None  # --map FILE:FN: B's names of A's weights and blocks (--vary target)

    def args(self) -> dict[str, Any]:
        return {"target": self.target_a, "target_b": self.target_b, "dtypes": list(self.dtypes),
                "plan": self.plan_a, "plan_b": self.plan_b, "vary": [self.vary.kind, self.vary.a, self.vary.b],
                "field": "target", "map": self.map}


def runs(vary: Vary, source: str, *, overrides: Any = None, implementation: str | None = None,
         register: str | None = None, mask_format: str | None = None, dtype: str = "float32",
         plan: Any, map: str | None = None, kind: str = "transformers") -> Runs:
    """Run A and run B of ``--transformers source`` (``kind`` "factory": of the ``FILE:FACTORY`` ``source``) under
    ``vary`` (validated here, built in the worker); under ``--vary target`` run B is the other model, ``map`` naming
    A's weights and blocks in it.

    Raises:
        InputError: ``--register`` where neither implementation is a name of one's own, both are, or the varied
            kind is also given as an option; ``map`` without ``--vary target``.
        SetupError: a ``map`` that is not ``FILE:FN``.
    """
    from dataclasses import replace

    from attn_ledger.probes.model.targets import target

    def make(impl: str | None, reg: str | None) -> dict[str, Any]:
        return target(kind, source, overrides=overrides, implementation=impl, register=reg,
                      mask_format=mask_format if reg else None, seed=plan.seed).to_json()

    if map is not None and vary.kind != "target":
        raise InputError(f"--map: got {shown(map)} with --vary {vary.words}, expected --vary target=FILE:FACTORY "
                         "(the map names A's weights and blocks in another model)")
    if vary.kind == "attn-implementation":
        if implementation is not None:
            raise InputError("--attn-implementation: cannot be given with --vary attn-implementation=A,B")
        own = [n for n in (vary.a, vary.b) if n not in BUILTIN]
        if len(own) > 1:
            raise InputError(f"--vary: got {vary.words}, expected at most one name of your own (registered with --register)")
        if own and register is None:
            raise InputError(f"--vary: got {own[0]!r}, expected eager, sdpa, flex_attention, or a name given "
                             "with --register FILE:FN")
        if register is not None and not own:
            raise InputError(f"--register: got {shown(register)} with --vary {vary.words}, expected one of the two "
                             "implementations to be a name of your own to register it under")
        ta = make(vary.a, register if vary.a in own else None)
        tb = make(vary.b, register if vary.b in own else None)
        return Runs(vary, ta, tb, (dtype, dtype), plan.to_json(), plan.to_json())
    t = make(implementation, register)
    if vary.kind == "target":
        return _target_runs(vary, t, dtype, plan, map)
    if vary.kind == "dtype":
        return Runs(vary, t, t, (vary.a, vary.b), plan.to_json(), plan.to_json())
    if vary.kind in ("batch", "packing"):
        if plan.batch < 2:
            raise InputError(f"--batch: got {plan.batch} with --vary {vary.kind}, expected at least 2 examples to "
                             f"{'batch' if vary.kind == 'batch' else 'pack'}")
        return Runs(vary, t, t, (dtype, dtype), plan.to_json(), plan.to_json())
    if vary.kind == "cache":
        _cache_plan(plan)
        return Runs(vary, t, t, (dtype, dtype), plan.to_json(), plan.to_json())
    if plan.padding != "none":
        raise InputError("--padding: cannot be given with --vary padding-side (run A is left padded, run B right)")
    return Runs(vary, t, t, (dtype, dtype), replace(plan, padding="left").to_json(),
                replace(plan, padding="right").to_json())


def _target_runs(vary: Vary, t: dict[str, Any], dtype: str, plan: Any, map: str | None) -> Runs:
    """``--vary target=FILE:FACTORY``: run A is ``t``, run B the factory's model, both in ``dtype`` on one plan."""
    from dataclasses import replace

    from attn_ledger.inputs.userload import parse_spec
    from attn_ledger.probes.model.targets import target

    if map is not None:
        parse_spec(map, "--map")
    b = target("factory", vary.b, seed=plan.seed, field="--vary target").to_json()
    return Runs(replace(vary, a=str(t["source"])), t, b, (dtype, dtype), plan.to_json(), plan.to_json(), map)


def _cache_plan(plan: Any) -> None:
    """Refuse the inputs ``--vary cache`` cannot decode: right padding (a decoded token would follow padding) or
    an example with fewer than two real tokens (nothing to both prefill and decode).

    Raises:
        InputError: naming ``--padding`` or ``--seq-len``.
    """
    from attn_ledger.probes.model.inputs import pad_counts, prefill_length

    if plan.padding == "right":
        raise InputError("--padding: got right with --vary cache, expected left or none (decoding appends tokens "
                         "after the last real one)")
    if not prefill_length(plan.seq_len, pad_counts(plan.batch, plan.seq_len, plan.padding)):
        raise InputError(f"--seq-len: got {plan.seq_len} with --vary cache, expected enough tokens that every "
                         "example has at least two real ones (one to prefill, one to decode)")


def aligned_inputs(inputs_a: Mapping[str, "Tensor"], valid_b: "Tensor") -> dict[str, "Tensor"]:
    """Run B's inputs: A's tokens in the same order among the real positions ``valid_b``, position ids as
    ``generate()`` makes them from B's mask."""
    from attn_ledger.probes.model.inputs import generate_positions

    valid_a = inputs_a["attention_mask"].bool()
    ids = inputs_a["input_ids"].clone()
    ids[valid_b] = inputs_a["input_ids"][valid_a]
    ids[~valid_b] = inputs_a["input_ids"][~valid_a]
    out = {**inputs_a, "input_ids": ids, "attention_mask": valid_b.long()}
    if "position_ids" in inputs_a:
        out["position_ids"] = generate_positions(valid_b.long())
    return out


# --- judging what streams back -------------------------------------------------------------------------


def max_err(x: "Tensor", ref: "Tensor") -> float:
    """``max |x - ref|`` in float64 (NaN where either holds a NaN)."""
    d = (x.double() - ref.double()).abs()
    return float("nan") if d.isnan().any() else float(d.max()) if d.numel() else 0.0


def _where(d: "Tensor", rows: Mapping[str, Any]) -> dict[str, Any]:
    """Where the largest difference of ``d`` [N, ...] sits: its real row's example and position."""
    flat = int(d.reshape(d.shape[0], -1).abs().nan_to_num(float("inf")).amax(-1).argmax())
    return {"example": rows["example"][flat], "token": rows["token"][flat]}


def ratio_check(name: str, x: "Tensor", ref: "Tensor", plains: list[tuple["Tensor", "Tensor"]], dtypes: tuple[str, str],
                rows: Mapping[str, Any], measure: str) -> tuple[Check, dict[str, float]]:
    """``max |x - ref| <= factor * plain + floor``, ``plain`` the largest ``max |plain - exact|`` of ``plains``."""
    value = max_err(x, ref)
    errs = [max_err(p, e) for p, e in plains]
    plain = float("nan") if any(e != e for e in errs) else max(errs, default=0.0)
    scale = max((float(e.double().abs().max()) for _, e in plains if e.numel()), default=0.0)
    bound, parts = compare_bound(plain, scale, dtypes)
    loc = _where(x.double() - ref.double(), rows) if x.numel() else None
    if parts.get("fallback"):  # no plain error to scale: the rule cannot say what noise is here
        check = Check(4, name, "inconclusive", measure, value, reason="the plain or the float64 run is not finite "
                      "at a real token, so the bound has nothing to scale", data=parts)
        return check, {"error": value, "bound": bound, "plain": plain}
    check = bounded(4, name, measure, value, bound, location=loc, data=parts)
    return check, {"error": value, "bound": bound, "plain": plain}


class Judge:
    """Takes the parts the worker streams (``take`` is the sink) and keeps the rows they make."""

    def __init__(self, facts: Mapping[str, Any], dtypes: tuple[str, str], rows: Mapping[str, Any],
                 decoder_len: int | None = None) -> None:
        """``rows``: the input's real rows (:func:`token_rows`); ``decoder_len``: an encoder-decoder's decoder
        length, whose blocks (``facts["decoder_blocks"]``) have every decoder token as a real row."""
        import torch

        self.facts, self.dtypes, self.token_rows = facts, dtypes, rows
        self.decoder = set(facts.get("decoder_blocks") or ()) if decoder_len else set()
        every = torch.ones(len(rows["counts"]), decoder_len or 0, dtype=torch.bool)  # a decoder's tokens: all real
        self.decoder_rows = token_rows(every) if self.decoder else rows
        self.decoder_valid = every.tolist()
        self.model_rows: list[Row] = []
        self.logits_row: Row | None = None
        self.blocks: list[Row] = []
        self.valid: dict[str, Any] = {}

    def rows_of(self, block: int) -> Mapping[str, Any]:
        return self.decoder_rows if block in self.decoder else self.token_rows

    def take(self, facts: dict[str, Any], tensors: dict[str, "Tensor"]) -> None:
        if facts["part"] == "model":
            per = [self.rows_of(i) for i in range(len(facts["masks"]))]
            self.model_rows = model_rows(tensors, facts, self.dtypes, self.token_rows, per)
            self.logits_row = logits_row(tensors, self.dtypes, per[-1] if per else self.token_rows)
            self.valid = {"a": facts.get("valid_a"), "b": facts.get("valid_b")}
        else:
            i = int(facts["index"])
            valid = {"a": self.decoder_valid, "b": self.decoder_valid} if i in self.decoder else self.valid
            self.blocks.append(block_row(facts, tensors, self.dtypes, self.rows_of(i), valid))


def _plains(tensors: Mapping[str, "Tensor"], key: str = "", exact: str = "exact") -> list[tuple["Tensor", "Tensor"]]:
    return [(v, tensors[exact + key]) for k, v in tensors.items()
            if k.startswith("plain_") and k.endswith(key) and k.count("_") == 1 + key.count("_")]


def block_row(facts: Mapping[str, Any], t: Mapping[str, "Tensor"], dtypes: tuple[str, str],
              rows: Mapping[str, Any], valid: Mapping[str, Any] | None = None) -> Row:
    """A block's row: ``added_error`` judged, and ``finite`` where the worker sent which rows each run's block made
    not finite; the total error beside them."""
    added, nums = ratio_check("added_error", t["b_replay"], t["a_out"], _plains(t), dtypes, rows,
                              "max |B's block on A's input - A| (added error)")
    checks = (added,) if "a_made_nonfinite" not in t else (added, finite_check(t, valid or {}))
    total = max_err(t["b_out"], t["a_out"])
    fields = {"layer": int(facts["index"]), **_numbers(total, nums["error"], nums["bound"])}
    return Row(str(facts["path"]), row_status(checks), checks, fields=fields)


def finite_check(t: Mapping[str, "Tensor"], valid: Mapping[str, Any]) -> Check:
    """Rows of either run, padded ones included, that the block made not finite from a finite input. Padded rows
    are never compared between the runs, but a NaN there reaches the real rows of the next block, through keys its
    mask forbids (``0 * NaN`` is NaN), so each run's block must keep every row finite on its own."""
    count, where = 0, None
    for side, run in (("a", "A"), ("b", "B")):
        made = t.get(f"{side}_made_nonfinite")  # [B, T] bool
        if made is None or not bool(made.any()):
            continue
        count += int(made.sum())
        if where is None:
            e, p = (int(x) for x in made.nonzero()[0])
            real = valid.get(side)
            where = {"run": run, "example": e, "position": p}
            if real is not None:
                where["padded"] = not bool(real[e][p])
    return counted(3, "finite", "rows of either run, padded ones included, the block made not finite from a "
                   "finite input", count, location=where)


def model_rows(t: Mapping[str, "Tensor"], facts: Mapping[str, Any], dtypes: tuple[str, str],
               rows: Mapping[str, Any], block_rows: "list[Mapping[str, Any]] | None" = None) -> list[Row]:
    """``embeddings``, ``masks``, ``position_ids`` and ``position_embeddings``, in that order; ``block_rows``: each
    block's real rows where they differ from ``rows`` (an encoder-decoder's decoder blocks)."""
    emb, nums = ratio_check("embeddings", t["b_embed"], t["a_embed"], _plains(t, "_embed", "exact"), dtypes, rows,
                            "max |B - A| of block 0's input")
    out = [Row("embeddings", row_status((emb,)), (emb,), fields=_numbers(nums["error"], nums["error"], nums["bound"]))]  # nothing inherited: added is total
    per = block_rows or [rows] * len(facts["masks"])
    out.append(_one_check_row("masks", mask_check(t, facts["masks"], per)))
    out.append(_one_check_row("position_ids", positions_check(t, len(facts["masks"]), per)))
    out.append(_one_check_row("position_embeddings", rotary_check(t, len(facts["masks"]), dtypes, per)))
    return out


def _numbers(total: float | None = None, added: float | None = None, bound: float | None = None) -> dict[str, Any]:
    """The columns every row has (None where a row has no such number), so that the table lines them up."""
    room = (bound / added) if (added and bound is not None and added > 0) else None
    return {"total": total, "added": added, "bound": bound, "room": room}


def _one_check_row(name: str, check: Check) -> Row:
    return Row(name, row_status((check,)), (check,), fields=_numbers())


def mask_check(t: Mapping[str, "Tensor"], kinds: list[list[Any]], per: "list[Mapping[str, Any]]") -> Check:
    """Which real keys each real query may read, run B against run A, at every block where both runs' blocks
    received a mask; under ``--vary packing``, also each key of another document run B's packed mask lets a
    query read (run A, each document apart, can read none). A block given none applies its implementation's own
    rule (causal, its window), which only its output shows: such blocks are not compared here, and their added
    error judges them."""
    differ, first, compared = 0, None, []
    per_block: list[int | None] = []
    for i in range(len(kinds)):
        rows = per[i]  # block i's real rows
        a, b = (t.get(f"{s}_mask_{i}") for s in ("a", "b"))
        cross = t.get(f"b_cross_{i}")
        n = None
        if cross is not None:  # --vary packing: keys of other documents, readable in run B only
            n = int(cross.sum())
            if n and first is None:
                r = int(cross.nonzero()[0, 0])
                first = {"block": i, "example": rows["example"][r], "token": rows["token"][r],
                         "other_documents": int(cross[r])}
        if a is not None and b is not None:
            d = a != b
            n = (n or 0) + int(d.sum())
            if d.any() and first is None:
                r, k = (int(x) for x in d.nonzero()[0])
                first = {"block": i, "example": rows["example"][r], "token": rows["token"][r], "key": k,
                         "a": bool(a[r, k]), "b": bool(b[r, k])}
        per_block.append(n)
        if n is not None:
            compared.append(i)
            differ += n
    data = {"per_block": per_block, "given": [[k or "none" for k in pair] for pair in kinds]}
    if not compared:
        return Check(2, "masks", "not_applicable", reason="no block received a mask in both runs (each applied "
                     "its implementation's own rule, judged by its added error)", data=data)
    return counted(2, "masks", "real (query, key) pairs allowed in one run only", differ, location=first, data=data)


def positions_check(t: Mapping[str, "Tensor"], blocks: int, per: "list[Mapping[str, Any]]") -> Check:
    """Position ids as each block received them, at real tokens: equal in both runs."""
    differ, first, seen = 0, None, 0
    for i in range(blocks):
        rows = per[i]
        a, b = t.get(f"a_pos_{i}"), t.get(f"b_pos_{i}")
        if a is None or b is None:
            continue
        seen += 1
        d = a != b
        differ += int(d.sum())
        if first is None and d.any():
            r = int(d.nonzero()[0, 0])
            first = {"block": i, "example": rows["example"][r], "token": rows["token"][r], "a": int(a[r]), "b": int(b[r])}
    if not seen:
        return unjudged(2, "position_ids", "not_applicable", "the blocks receive no position ids")
    return counted(2, "position_ids", "real tokens whose position ids differ", differ, location=first)


def rotary_check(t: Mapping[str, "Tensor"], blocks: int, dtypes: tuple[str, str],
                 per: "list[Mapping[str, Any]]") -> Check:
    """cos and sin as each block received them, at real tokens: within twice the coarser dtype's eps."""
    worst, where, seen = 0.0, None, 0
    for i in range(blocks):
        rows = per[i]
        for part in ("cos", "sin"):
            a, b = t.get(f"a_{part}_{i}"), t.get(f"b_{part}_{i}")
            if a is None or b is None:
                continue
            seen += 1
            err = max_err(b, a)
            if not err <= worst:
                worst, where = err, {"block": i, "part": part, **_where(b.double() - a.double(), rows)}
    if not seen:
        return unjudged(4, "position_embeddings", "not_applicable", "the blocks receive no position embeddings")
    limit = 2 * max(eps(d) for d in dtypes)
    return bounded(4, "position_embeddings", "max |B - A| of cos and sin", worst, limit, location=where)


def logits_row(t: Mapping[str, "Tensor"], dtypes: tuple[str, str], rows: Mapping[str, Any]) -> Row | None:
    """The ratio rule on the logits, and token agreement: each run's top token in the other's top k."""
    if "a_logits" not in t or "b_logits" not in t:
        return None
    a, b = t["a_logits"], t["b_logits"]
    check, nums = ratio_check("logits", b, a, _plains(t, "_logits", "exact"), dtypes, rows, "max |B - A| of the logits")
    k = min(TOP_K, a.shape[-1])
    top_a, top_b = a.topk(k, -1).indices, b.topk(k, -1).indices  # [N, k]
    miss = ~(top_b == top_a[:, :1]).any(-1) | ~(top_a == top_b[:, :1]).any(-1)  # [N]
    loc = None
    if miss.any():
        r = int(miss.nonzero()[0, 0])
        loc = {"example": rows["example"][r], "token": rows["token"][r], "a": int(top_a[r, 0]), "b": int(top_b[r, 0])}
    agree = counted(4, "top_k", f"real tokens where a run's top token is not in the other's top {k}", int(miss.sum()),
                    location=loc, data={"k": k, "top1_differ": int((top_a[:, 0] != top_b[:, 0]).sum())})
    status = row_status((check, agree))
    return Row("logits", status, (check, agree), fields=_numbers(nums["error"], None, nums["bound"]))


# --- a whole compare ----------------------------------------------------------------------------------------


def token_rows(valid_b: "Tensor") -> dict[str, Any]:
    """For each real row as sent (run B's order): its example and its index among the example's real tokens."""
    example, token, counts = [], [], []
    for bi in range(valid_b.shape[0]):
        n = int(valid_b[bi].sum())
        counts.append(n)
        example += [bi] * n
        token += list(range(n))
    return {"example": example, "token": token, "counts": counts}


def compare(handle: Any, runs_: Runs, given: "Mapping[str, Tensor] | None" = None) -> Report:
    """Run both runs through ``handle`` (a :class:`~attn_ledger.probes.model.driver.LocalModel` or ``RemoteModel``
    built from :meth:`Runs.args`) and judge them; on ``given`` inputs (both runs), else on inputs made from the
    runs' plans."""
    from attn_ledger.probes.model.inputs import InputPlan, make_inputs, valid_positions, pad_counts

    facts = handle.facts
    refusal = {"cache": lambda: cache_refusal(facts, given), "packing": lambda: packing_refusal(facts)}
    why = refusal[runs_.vary.kind]() if runs_.vary.kind in refusal else ""
    if why:
        return not_applicable_report(facts, runs_, runs_.vary.kind, why)
    if given is not None:
        inputs_a = inputs_b = dict(given)
        valid_b = given["attention_mask"].bool()
    else:
        plan_a, plan_b = InputPlan(**runs_.plan_a), InputPlan(**runs_.plan_b)
        inputs_a = make_inputs(plan_a, facts)
        valid_b = valid_positions(pad_counts(plan_b.batch, plan_b.seq_len, plan_b.padding), plan_b.seq_len,
                                  plan_b.padding)
        inputs_b = aligned_inputs(inputs_a, valid_b) if plan_b.padding != plan_a.padding else inputs_a
    why = positions_refusal(facts, inputs_a) if runs_.vary.kind in ("padding-side", "batch") else ""
    if why:
        return not_applicable_report(facts, runs_, runs_.vary.kind, why)
    dec = inputs_b.get("decoder_input_ids")
    judge = Judge(facts, runs_.dtypes, token_rows(valid_b), None if dec is None else int(dec.shape[1]))
    run = handle.compare(inputs_a, inputs_b, judge.take)
    report = compare_report(facts, runs_, judge, run)
    if runs_.vary.kind == "cache":
        report = _with_decode(report, valid_b)
    first = report.details.get("first_adder")
    if first is None or not hasattr(handle, "compare_calls"):
        return report
    from attn_ledger.probes.model.adder import attention_of

    alone = None
    if runs_.vary.kind in ("batch", "packing"):  # run A is one forward per example: the one the finding is on
        where = (report.first_finding.check.location or {}) if report.first_finding else {}
        if "example" not in where:
            where = report.row(first["block"]).check("added_error").location or {}
        alone = int(where.get("example", 0))
    return with_attention(report, attention_of(handle, facts, inputs_a, inputs_b, first["layer"], first["block"],
                                               alone, packed=runs_.vary.kind == "packing"))


def _with_decode(report: Report, valid: "Tensor") -> Report:
    """The report with how run B decoded: its prefill's length and the tokens decoded one at a time after it."""
    from dataclasses import replace

    from attn_ledger.probes.model.inputs import prefill_length

    t = valid.shape[1]
    prefill = prefill_length(t, (~valid).sum(-1).tolist())
    return replace(report, details={**report.details, "cache": {"prefill": prefill, "decoded": t - prefill}})


def cache_refusal(facts: Mapping[str, Any], given: "Mapping[str, Tensor] | None") -> str:
    """Why ``--vary cache`` does not apply to this model (or these inputs), or "" where it does.

    Raises:
        InputError: given inputs that cannot be decoded (padding after a real token, or an example with fewer
            than two real tokens).
    """
    if facts.get("architecture") != "decoder":
        arch = str(facts.get("architecture"))
        return f"{facts.get('label')} is {'an' if arch[:1] in 'aeiou' else 'a'} {arch}: a cache is a decoder's"
    if not facts.get("takes_use_cache"):
        return f"{facts.get('label')}'s forward takes no use_cache: it keeps no cache of its own"
    if given is not None:
        from attn_ledger.probes.model.inputs import prefill_length

        valid = given["attention_mask"].bool()
        if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
            raise InputError("inputs: attention_mask has padding after a real token, expected left padding or none "
                             "under cache (decoding appends tokens after the last real one)")
        if not prefill_length(valid.shape[1], (~valid).sum(-1).tolist()):
            raise InputError("inputs: an example has fewer than two real tokens, expected at least two under cache "
                             "(one to prefill, one to decode)")
    return ""


def positions_refusal(facts: Mapping[str, Any], inputs: Mapping[str, "Tensor"]) -> str:
    """Why ``--vary padding-side`` or ``batch`` (which move an example's real tokens to other positions) does not
    apply to this model, or "" where it does: learned absolute positions, and no position ids in its inputs to
    keep each token at its own (an encoder-decoder such as BART)."""
    learned = facts.get("learned_positions") or []
    if learned and "position_ids" not in inputs:
        return (f"{facts.get('label')}'s positions are learned ({learned[0]}) and its inputs carry no position_ids: "
                "a token moved to another position is embedded differently, so its runs need not agree")
    return ""


def packing_refusal(facts: Mapping[str, Any]) -> str:
    """Why ``--vary packing`` does not apply to this model, or "" where it does: a causal decoder that takes
    position ids (transformers finds the packed documents from them, given no attention mask)."""
    if facts.get("architecture") != "decoder":
        arch = str(facts.get("architecture"))
        return (f"{facts.get('label')} is {'an' if arch[:1] in 'aeiou' else 'a'} {arch}: packing with restarting "
                "position ids is a causal decoder's")
    if not facts.get("takes_position_ids"):
        return f"{facts.get('label')}'s forward takes no position_ids: it cannot tell packed documents apart"
    return ""


def not_applicable_report(facts: Mapping[str, Any], runs_: Runs, name: str, reason: str) -> Report:
    """The report of a ``--vary`` the model's family does not allow: one row, not applicable, saying why."""
    check = Check(1, name, "not_applicable", reason=reason)
    title = f"compare {facts.get('label')} ({facts.get('class')}) --vary {runs_.vary.kind}: not applicable"
    details = {"vary": {"kind": runs_.vary.kind, "a": runs_.vary.a, "b": runs_.vary.b}, "first_adder": None,
               "model": {k: facts.get(k) for k in ("label", "class", "model_type", "architecture", "layers")}}
    return Report("compare", title, (Row(name, "not_applicable", (check,)),), details=details, unit="row",
                  row_label="layer")


def with_attention(report: Report, attention: Any) -> Report:
    """The report with the first adder's attention (:class:`~attn_ledger.probes.model.adder.Attention`): its words
    on the first adder's first failing check (and so on the headline), the details, and the stage ledgers, the
    report opening onto the failing call's."""
    from dataclasses import replace

    from attn_ledger.render.notes import note_text
    from attn_ledger.report import first_finding_of

    words = note_text(Note("compare_attention", attention.as_json()))
    rows = []
    for r in report.rows:
        if r.name == attention.block and r.fields.get("mark") == "first adder":
            first = r.first_failing()  # the headline's check: added_error, or finite where the block made a NaN
            checks = tuple(replace(c, reason=words) if c is first else c for c in r.checks)
            r = Row(r.name, r.status, checks, r.shape, r.axes, fields=r.fields)
        rows.append(r)
    details = {**report.details, "first_adder": {**report.details["first_adder"], "attention": attention.as_json()}}
    finding = first_finding_of(rows)
    notes = report.notes
    if finding is not None and finding.row != attention.block:  # a model-level row leads: say what the block's calls show
        notes = (*notes, Note("compare_first_adder", attention.as_json()))
    return replace(report, rows=tuple(rows), first_finding=finding, details=details, ledger=attention.ledger,
                   ledgers=dict(attention.ledgers), notes=notes)


def compare_report(facts: Mapping[str, Any], runs_: Runs, judge: Judge, run: Mapping[str, Any]) -> Report:
    """Model-level rows, then one row per block, then the logits; the first failing row is the headline."""
    rows: list[Row] = [*judge.model_rows, *sorted(judge.blocks, key=lambda r: r.fields["layer"])]
    if judge.logits_row is not None:
        rows.append(judge.logits_row)
    if run.get("error"):
        rows.append(Row("forward", "fail", (Check(1, "forward", "fail", reason=str(run["error"])),)))
    first = next((r for r in rows if r.fields.get("layer") is not None and r.status == "fail"), None)
    if first is not None:
        rows = [r if r is not first else Row(r.name, r.status, r.checks, r.shape, r.axes,
                                             fields={**r.fields, "mark": "first adder"}) for r in rows]
    b = facts.get("b", {})
    plan = runs_.plan_a
    vary = runs_.vary.words if runs_.vary.kind == "models" else f"--vary {runs_.vary.words}"
    title = (f"compare {facts['label']} ({facts['class']}, {len(judge.blocks)} blocks) {vary}: "
             f"A {facts.get('implementation')} {runs_.dtypes[0]}, B {b.get('implementation')} {runs_.dtypes[1]}, "
             f"B={plan['batch']} T={plan['seq_len']}")
    note = Note("compare_runs", {"vary": runs_.vary.words, "dtypes": list(runs_.dtypes), "factor": COMPARE_FACTOR,
                                 "padding": [runs_.plan_a["padding"], runs_.plan_b["padding"]]})
    details = {"vary": {"kind": runs_.vary.kind, "a": runs_.vary.a, "b": runs_.vary.b},
               "dtypes": list(runs_.dtypes), "inputs": {"a": runs_.plan_a, "b": runs_.plan_b},
               "model": {k: facts.get(k) for k in ("label", "class", "model_type", "architecture", "layers")},
               "implementations": [facts.get("implementation"), b.get("implementation")],
               "first_adder": None if first is None else {"block": first.name, "layer": first.fields["layer"]}}
    return Report("compare", title, tuple(rows), notes=(note,), details=details, unit="row", row_label="layer")


def stopped_report(args: Mapping[str, Any], reason: str, data: Mapping[str, Any]) -> Report:
    """The report of a compare whose forwards never came back (a crash or the time limit)."""
    from attn_ledger.probes.model.targets import Target

    label = Target.from_json(args["target"]).label
    check = Check(1, "forward", "fail", reason=reason, data=dict(data))
    return Report("compare", f"compare {label}", (Row("forward", "fail", (check,)),), unit="row", row_label="layer",
                  details={"model": {"label": label}})


def compare_models(a: Any, b: Any, inputs: "Mapping[str, Tensor] | None" = None, *, batch: int = 2, seq_len: int = 24,
                   padding: str = "left", seed: int = 0, label: str | None = None, cache: bool = False,
                   map: Callable[[str], str] | None = None) -> Report:  # long: its arguments' documentation
    """Compare two runs of one transformers model, or a model and its port, in this process, block by block (see
    :func:`compare`).

    Args:
        a: run A, the reference: a transformers model (its weights, dtype and attention implementation as given).
        b: run B: the same model run another way (another attention implementation, dtype, a registered function),
            holding the same weights (``b = copy.deepcopy(a)`` then ``b.set_attn_implementation("sdpa")``, say).
            Neither model is changed: the plain models the bound is made of are copies of ``a``.
        inputs: the forward's ``input_ids`` and ``attention_mask`` (and ``position_ids``), ``[B, T]``, both runs'; None
            makes token ids from ``batch``, ``seq_len``, ``padding`` and ``seed``.
        label: how the report names the model (default: A's class).
        cache: run B is a prefill of the first tokens, then one forward per token through B's own cache
            (``--vary cache``); A the full forward. ``b`` may be ``a`` itself, or a model whose cache path is in
            question. Decoders only (the report says it is not applicable otherwise); left padding or none.
        map: ``b`` is another model (a port of ``a``) that names ``a``'s weights and blocks ``map(name)``
            (``--vary target``'s ``--map``); it must hold ``a``'s weights under those names.

    Raises:
        InputError: inputs without ``input_ids`` and ``attention_mask`` of one shape ``[B, T]``; models whose weights
            do not pair by name (through ``map``) or by shape; a model with no list of blocks; a block of ``a`` that
            ``map`` names and ``b`` lacks; under ``cache``, inputs it cannot decode.
    """
    from attn_ledger.probes.model.driver import LocalModel, model_facts
    from attn_ledger.probes.model.inputs import InputPlan
    from attn_ledger.probes.model.pair import Names, matched_weights, pair_of

    name = label or type(a).__name__
    names = Names(None, map is not None, map, "map" if map is not None else "b")
    matched_weights(a, b, names)
    if inputs is not None:
        ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
        if ids is None or mask is None or ids.dim() != 2 or tuple(ids.shape) != tuple(mask.shape):
            raise InputError(f"inputs: got {sorted(inputs)}, expected input_ids and attention_mask of one shape [B, T]")
        batch, seq_len = (int(n) for n in ids.shape)
    if cache and inputs is None:
        _cache_plan(InputPlan(batch, seq_len, padding, seed))
    was = a.training, b.training
    a.eval(), b.eval()
    try:
        pair = pair_of(a, b, name, name if map is None else type(b).__name__, model_facts, cached=cache,
                       names=names if map is not None else None)
        dtypes = (pair.facts["dtype"], pair.facts["b"]["dtype"])
        impls = (pair.facts.get("implementation"), pair.facts["b"].get("implementation"))
        plan = InputPlan(batch, seq_len, "none" if inputs is not None else padding, seed).to_json()
        if inputs is not None:
            plan["padding"] = "given"  # whatever the given mask pads
        vary = Vary("cache", "full", "cached") if cache else \
            Vary("models", f"{impls[0]} {dtypes[0]}", f"{impls[1]} {dtypes[1]}")
        r = Runs(vary, {}, {}, dtypes, plan, plan)
        return compare(LocalModel(pair), r, inputs)  # type: ignore[arg-type]
    finally:
        a.train(was[0]), b.train(was[1])
