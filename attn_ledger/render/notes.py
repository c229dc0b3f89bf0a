"""The sentences and pictures of notes, written from their data (:class:`~attn_ledger.report.Note`).

A report's notes (and a row's note) are data where the words follow from facts: the relation
shown and its allowed keys per query, the plan's blocks and sample, the score scale, the call that
reproduces a finding. :func:`note_text` writes any of them; a note that is still words is its own
text. Every view (table, Markdown, JUnit, GitHub, HTML, and the JSON's ``notes`` strings) writes
notes through here, so they read the same everywhere.
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Mapping

from attn_ledger.report import Note, Report


def _which(d: Mapping[str, Any]) -> str:
    return f"b={d['example']}, h={d['head']}" + ("; the example of the first finding" if d.get("at_divergence") else "")


def _allowed_keys(d: Mapping[str, Any]) -> str:
    return f"allowed keys per query ({_which(d)}): {list(d['counts'])}"


def relation_picture(allow: list[list[bool]]) -> str:
    """A text picture of a ``[Tq, Tk]`` relation, queries as rows and keys as columns (``1`` may attend)."""
    tk = len(allow[0]) if allow else 0
    lines = ["      " + " ".join(f"k{j:<2d}"[:3] for j in range(tk))]
    for i, row in enumerate(allow):
        lines.append(f"q{i:<3d}  " + " ".join(" 1 " if a else " . " for a in row))
    return "\n".join(lines)


def _relation_picture(d: Mapping[str, Any]) -> str:
    return f"intended relation ({_which(d)}), queries as rows, keys as columns:\n" + relation_picture(d["allow"])


def _values(d: Mapping[str, Any]) -> str:
    rows = "[" + ", ".join("[" + ", ".join(f"{x:.6f}" for x in row) + "]" for row in d["values"]) + "]"
    return f"{d['stage']} (b={d['example']}, h={d['head']}): {rows}"


def _given_input(d: Mapping[str, Any]) -> str:
    return (f"q {d['q']}, k {d['k']}, v {d['v']}" + (" (one head: Nh=1 inserted)" if d["one_head"] else "")
            + "; batch, widths, token counts and finite values validated on load"
            + (f"; query head h reads kv head h // {d['group']}" if d["group"] != 1 else ""))


def _config_input(d: Mapping[str, Any]) -> str:
    return (f"E == Nh*Dh: {d['E']} == {d['Nh']}*{d['Dh']} (validated with the config)"
            + (f"; keys/values from x_kv [B,Tk,E] {d['x_kv']}" if d.get("x_kv") is not None else ""))


def _probe(d: Mapping[str, Any]) -> str:
    return ("probe [B', Nh', Tq', Tk']: the first examples, heads and positions as they entered the scores stage, "
            "with the relation there")


SEED_WORDS = {"ones": "ones (every entry 1)", "identity": "identity (I on each head's [Tq, Dv] block)",
              "saved": "the saved grad_out", "saved_wrong_shape": "ones (every entry 1; the saved grad_out has the wrong shape)"}


def _grad_seed(d: Mapping[str, Any]) -> str:
    words = f"from {d['path']}" if d["seed"] == "file" else SEED_WORDS[d["seed"]]
    return f"O-bar seeded on the {d['on']}: {words}"


def _score_scale(d: Mapping[str, Any]) -> str:
    return (f"score scale S/tau = {d['S']:.6g}/{d['temperature']:g} = {d['effective']:.6g} "
            f"(default 1/sqrt(Dh) = {d['default']:.6g}), used by the pipeline, the float64 "
            "reference and SDPA alike")


def _softcap(d: Mapping[str, Any]) -> str:
    return (f"soft-cap C = {d['C']:g}: the scaled scores become C * tanh(s / C) before the mask, in the "
            "pipeline and the float64 reference; SDPA, which has no cap, gets the capped scores as its "
            f"additive mask{', and so does each pinned backend' if d.get('pinned') else ''}")


def _sinks(d: Mapping[str, Any]) -> str:
    shown = ", ".join(f"{x:.4g}" for x in d["sinks"])
    return (f"attention sinks, one logit per head ({shown}): each is one more column of the softmax, in the "
            "denominator only, and dropped before the mix, in the pipeline, the float64 reference and SDPA (given "
            "it as one more column of its additive mask); the weights over the keys sum to one minus the sink's share")


def _backends_unavailable(d: Mapping[str, Any]) -> str:
    return "SDPA backends not available here: " + ", ".join(
        f"{u['backend']},{u['dtype']} ({u['reason']})" for u in d["unavailable"])


def _query_blocks(d: Mapping[str, Any]) -> str:
    return f"score-grid stages ran in {d['blocks']} query blocks of {d['rows']} rows"


def _reference_sample(d: Mapping[str, Any]) -> str:
    shown = ", ".join(f"{r0}..{r1 - 1}" for r0, r1 in d["spans"])
    return (f"{d['dtype']} reference on a sample of {d['rows']} of {d['tq']} query rows (rows {shown}); "
            "SDPA on all rows")


def _loose_range(d: Mapping[str, Any]) -> str:
    return (f"context in_value_range: blocks over 2^{d['entries_log2']} (query, key, value-width) entries compare "
            "each row with the value range of all the block's keys, a looser bound than the keys that row may use")


def _scores_std_rows(d: Mapping[str, Any]) -> str:
    return f"scores std over the {d['rows']} query rows the float64 reference sampled"


def _cases(n: int) -> str:
    return f"{n} case" if n == 1 else f"{n} cases"


def _cases_failed(d: Mapping[str, Any]) -> str:
    verb = "fails" if d["failed"] == 1 else "fail"
    return f"{d['failed']} of {_cases(d['cases'])} {verb}; the first finding is the smallest failing case"


def _fails_first(d: Mapping[str, Any]) -> str:
    return f"L{d['level']} {d['check']} fails first in {_cases(d['cases'])} (smallest {d['smallest_case']})"


def cli_line(d: Mapping[str, Any]) -> str:
    """``attn-ledger check TARGET --case ID [options]``, quoted for a shell: pasted, it runs attn-ledger
    on that target and nothing else, whatever the target's path holds (``$(...)``, spaces, a newline)."""
    return f"{_check_command(d['target'])} --case {shlex.quote(d['case'])}{_options(d)}"


def _check_command(target: str) -> str:
    return f"attn-ledger check {shlex.quote(target)}"


def _options(d: Mapping[str, Any]) -> str:
    return "".join(f" {a}" for a in d["options"])  # option names and values attn-ledger itself wrote


def python_lines(d: Mapping[str, Any]) -> list[str]:
    """The Python lines that rerun one case of ``attn-ledger check``."""
    seed, device = d.get("seed") or 0, d.get("device", "cpu")
    extra = (f", seed={seed}" if seed else "") + (f", device={device!r}" if device != "cpu" else "")
    lines = ["from attn_ledger import case_inputs", f"q, k, v, kw = case_inputs({d['case']!r}{extra})"]
    if d.get("dropped"):
        lines.append(f"kw = {{key: val for key, val in kw.items() if key not in {tuple(d['dropped'])!r}}}")
    lines.append(f"out = {d['function']}(q, k, v, **kw)")
    return lines


def reproduce_lines(d: Mapping[str, Any]) -> list[str]:
    """The notes that reproduce a check's smallest failing case: its call, then the CLI line (split in two
    by a shell continuation, so that a table wrapping a long note leaves it pasteable) and the Python lines."""
    rest = cli_line(d)[len(_check_command(d["target"])) + len(" --case "):]  # the target may hold " --case "
    return [f"its call: {call_text(d['call'])}", "reproduce it:", f"{_check_command(d['target'])} \\",
            f"    --case {rest}", *python_lines(d)]


def interface_reproduce_lines(d: Mapping[str, Any]) -> list[str]:
    """The notes that reproduce the smallest failing case of ``check --protocol transformers``: the call as a
    layer makes it, the CLI line, and the Python lines that build the layer's arguments and call the function."""
    rest = cli_line(d)[len(_check_command(d["target"])) + len(" --case "):]
    passes = f", passes={list(d['passes'])!r}" if d.get("passes") else ""
    seed = f", seed={d['seed']}" if d.get("seed") else ""
    return [f"its call: {d['call']}", "reproduce it:", f"{_check_command(d['target'])} \\", f"    --case {rest}",
            "from attn_ledger.probes.interface.driver import layer_call",
            f"module, args, kwargs = layer_call({d['case']!r}{passes}{seed})",
            f"attn_output, attn_weights = {d['function']}(module, *args, **kwargs)"]


def _scan_inputs(d: Mapping[str, Any]) -> str:
    if "given" in d:
        return f"inputs: the factory's own ({d['given']})"
    pads = d.get("pads") or []
    padding = "no padding" if d["padding"] == "none" else f"{d['padding']} padding of {pads} positions per example"
    positions = "; position ids as generate() makes them" if d.get("position_ids") else ""
    decoder = f"; decoder {d['decoder_len']} tokens" if d.get("decoder_len") is not None else ""
    return f"inputs: B={d['batch']} T={d['seq_len']} token ids, seed {d['seed']}, {padding}{positions}{decoder}"


def _compare_runs(d: Mapping[str, Any]) -> str:
    a, b = d["padding"]
    padding = ("no padding" if a == "none" else f"{a} padding in both") if a == b else f"run A {a} padded, run B {b} padded, real tokens aligned"
    vary = d["vary"] if d["vary"].startswith("two models") else f"--vary {d['vary']}"
    return (f"{vary}: {padding}; only real tokens compared; bound = {d['factor']:g} x the plain "
            f"error at each block (eager in each run's dtype against float64) + one eps")


def _compare_attention(d: Mapping[str, Any]) -> str:
    """The first adder's attention in both runs: the failing call's check, diagnosis and ledger stage, or that
    every call agrees with its reference (the error was added outside attention)."""
    calls = d.get("calls") or []
    if not calls:
        return f"no stage ledger of {d['block']}'s attention: {d.get('why') or 'no call was captured'}"
    failing = [c for c in calls if c["status"] == "fail"]
    if not failing:
        runs = ", ".join(sorted({c["run"] for c in calls}))
        return (f"the attention of {d['block']} agrees with its float64 reference in run{'s' if ',' in runs else ''} "
                f"{runs} ({len(calls)} call{'s' if len(calls) != 1 else ''}): the error it adds comes from outside "
                "its attention calls (projections, norms, MLP)")
    parts = []
    for run in dict.fromkeys(c["run"] for c in failing):  # each run's first failing call, and how many more
        mine = [c for c in failing if c["run"] == run]
        c = mine[0]
        text = f"run {c['run']}'s {c['call']} fails {c['check']}"
        if c.get("diagnosis"):
            text += f" (it matches {c['diagnosis']})"
        elif c.get("reason"):
            text += f" ({c['reason']})"
        if c.get("stage") and c.get("stage_check"):
            text += f"; its stage ledger first fails at stage {c['stage']} ({c['stage_check']})"
        elif c.get("stage"):
            text += f"; the fault enters at stage {c['stage']}"
        if len(mine) > 1:
            text += f"; {len(mine) - 1} more of run {run}'s calls there fail"
        parts.append(text)
    agree = sorted({c["run"] for c in calls} - {c["run"] for c in failing})
    if agree:
        parts.append(f"run {', '.join(agree)} agrees with its reference there")
    return "; ".join(parts)


def _compare_first_adder(d: Mapping[str, Any]) -> str:
    """The first adder's attention, where a model-level row (masks, position ids) is the first finding."""
    return f"first adder {d['block']}: {_compare_attention(d)}"


def _scan_reference(d: Mapping[str, Any]) -> str:
    if not d["sampled"]:
        return "float64 reference: every query row of every call, in query blocks"
    sampled = ", ".join(f"{r} of {n}" for r, n in d["sampled"])
    return (f"float64 reference: evenly spaced query rows ({sampled}) where a call's B*Nh*Tq*Tk exceeds "
            f"{d['budget']}; every other check reads every row")


def _scan_unreplayable(d: Mapping[str, Any]) -> str:
    return f"no stage ledger of {d['call']}: {d['why']}"


def _scan_saved(d: Mapping[str, Any]) -> str:
    text = f"saved {d['files']} tensor file{'s' if d['files'] != 1 else ''} in {d['directory']}"
    return text + (f"; replay the first with: {d['replay']}" if d.get("replay") else "")


def _scan_stopped(d: Mapping[str, Any]) -> str:
    return f"the forward stopped after {d['calls']} attention calls: {d['text']}"



ALIGNMENT_WORDS = {
    "bottom-right": "causal, bottom-right (query i may use key j iff j <= i + Tk - Tq)",
    "top-left": "causal, top-left (query i may use key j iff j <= i), which a KV-cache decode does not want",
    "neither": "not a pure causal relation in either alignment",
}


def _allow_mask_alignment(d: Mapping[str, Any]) -> str:
    return "allow_mask alignment: " + ALIGNMENT_WORDS[d["alignment"]]


def _rope(d: Mapping[str, Any]) -> str:
    who = "the saved q and k" if d["saved"] else "q and k"
    return (f"rope {d['spec']}: {who} rotated before the scores ({d['rotated']} of Dh={d['Dh']} features, "
            f"{d['pairing']} pairs, base {d['base']:g}); query i at position i{d['start']:+d} (i + Tk - Tq), key j at "
            "j; v not rotated; the reference rotates its q and k the same way")


# --- check on a kernel: the lines under the table ---------------------------------------------

PRECISION_WARNING = "computes at float32 precision in float64"
HALF_PRECISION_WARNING = "is less precise than a float32-accumulating computation in its dtype"


def call_text(c: Mapping[str, Any]) -> str:
    """One call of the kernel protocol as a reader would write it: ``attention(q, k, v, is_causal=True)``.

    ``c``: ``function``; ``allow_mask`` (None, or ``{"kind": "causal" | "key_padding" | "left_padding" |
    "keys_blocked", ...}``); ``is_causal``; ``scale``, ``softcap``, ``window`` (None where not passed); ``sinks``.
    """
    args = []
    m = c.get("allow_mask")
    if m is not None:
        args.append("allow_mask=" + _ALLOW_MASK[m["kind"]](m))
    if c.get("is_causal"):
        args.append("is_causal=True")
    if c.get("scale") is not None:
        args.append(f"scale={c['scale']:g}")
    if c.get("softcap") is not None:
        args.append(f"softcap={c['softcap']:g}")
    if c.get("window") is not None:
        args.append(f"window={c['window']}")
    if c.get("sinks"):
        args.append("sinks=sinks[Nh]")
    return f"{c['function']}(q, k, v{''.join(', ' + a for a in args)})"


def _ints(xs: Any) -> str:
    return "[" + ", ".join(str(int(x)) for x in xs) + "]"


_ALLOW_MASK: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "causal": lambda m: "causal[Tq, Tk]",
    "key_padding": lambda m: f"key_padding(lengths={_ints(m['lengths'])})[B, 1, 1, Tk]",
    "left_padding": lambda m: f"left_padding({_ints(m['blocked'])})[B, 1, 1, Tk]",
    "keys_blocked": lambda m: f"keys_blocked({m['first']}..{m['last']})[1, 1, 1, Tk]",
}


def stop_text(d: Mapping[str, Any]) -> str:
    """Why the rest of a run was not reached, from its stop's data (``stopped_by`` and its bound)."""
    if d["stopped_by"] == "max_timeouts":
        n = d["max_timeouts"]
        return f"{'1 case' if n == 1 else f'{n} cases in a row'} timed out (--max-timeouts {n})"
    return f"the check ran out of time (--max-time {d['max_time_s']:g} s)"


def _stopped(d: Mapping[str, Any]) -> str:
    return "not reached: " + stop_text(d)


def _skipped_by_declaration(d: Mapping[str, Any]) -> str:
    why = ", ".join(f"{n} for {reason}" for reason, n in d["skipped"].items())
    return f"{_cases(sum(d['skipped'].values()))} skipped: outside the declaration ({why})"


def _precision_warned(d: Mapping[str, Any]) -> str:
    what = PRECISION_WARNING if d["of"] == "float64" else HALF_PRECISION_WARNING
    if d["cases"] > 1:
        what = what.replace("computes", "compute", 1).removeprefix("is ")
        what = what if what.startswith("compute") else f"are {what}"
    return f"{_cases(d['cases'])} {what} (warning; smallest {d['smallest_case']}); --strict-precision makes it a failure"


def _warned(d: Mapping[str, Any]) -> str:
    what = f"warn{'s' if d['cases'] == 1 else ''} at L{d['level']} {d['check']}"
    return f"{_cases(d['cases'])} {what} (warning; smallest {d['smallest_case']})"


def _not_reached(d: Mapping[str, Any]) -> str:
    return f"{d['not_reached']} of {_cases(d['cases'])} not reached: {stop_text(d)}"


def _inconclusive(d: Mapping[str, Any]) -> str:
    it = "it" if d["cases"] == 1 else "them"
    return (f"{_cases(d['cases'])} inconclusive: no check past L1 judged {it} (warning; smallest "
            f"{d['smallest_case']}); --strict-coverage makes {it} a failure")


def _cases_passed(d: Mapping[str, Any]) -> str:
    n, open_ = d["cases"], d["inconclusive"]
    if not open_:
        return "the case passes" if n == 1 else f"all {n} cases pass"
    passed = n - open_
    return f"{passed} of {_cases(n)} pass{'es' if passed == 1 else ''}; {open_} inconclusive"


def _returned_subclass(d: Mapping[str, Any]) -> str:
    return f"{_cases(d['cases'])} returned a tensor subclass ({', '.join(d['types'])}); it was judged as a plain tensor"


def _global_state(d: Mapping[str, Any]) -> str:
    parts = [f"{flag} {before} -> {after}" for flag, (before, after) in d.get("flags", {}).items()]
    replaced = list(d.get("replaced", ()))
    if replaced:
        more = f" and {len(replaced) - 6} more" if len(replaced) > 6 else ""
        parts.append(f"replaced {', '.join(replaced[:6])}{more} (since before the import)")
    return "your code changed torch's global state: " + "; ".join(parts)


def _index_decode(d: Mapping[str, Any]) -> str:
    may = d["may_mix"]
    keys = f"keys {may['keys'][0]}..{may['keys'][1]}" if may["keys"] else "no key"
    allowed = f"example {may['example']}, kv head {may['kv_head']}, {keys}"
    src = d["source"]
    if src is None:
        return f"index decode: the row lies outside every value row's range; it may mix only {allowed}"
    return (f"index decode: the row reads as a mix from example {src['example']}, kv head {src['kv_head']}, "
            f"near key {src['key']:.1f}; it may mix only {allowed}")


# --- check on a module, and its core -----------------------------------------------------------

def _observed_core(d: Mapping[str, Any]) -> str:
    return f"observed core: {d['core']}; layout: {d.get('layout') or 'not traced'}"


def _found(d: Mapping[str, Any]) -> str:
    rotary = d.get("rotary")
    rot = (f"rotary {rotary['pairing']}, base {rotary['base']:g}, {rotary['rotated_dim']} of {rotary['head_dim']} "
           "features" if rotary else "no rotary")
    scale = d.get("scale")
    scale_text = f"softmax scale {scale:.4g}" if isinstance(scale, float) else "softmax scale not fitted"
    return f"found: {d.get('relation')} relation; {scale_text}; {rot}; scores {d.get('design') or 'not read'}"


def _training_on_entry(d: Mapping[str, Any]) -> str:
    if d["ran"] == "intervene":
        return "the module came back in training mode; the intervention ran it in eval mode"
    return "the module came back in training mode: output comparisons ran in eval mode, gradients in training mode"


def _undeclared_sinks(d: Mapping[str, Any]) -> str:
    shown = ",".join(f"{round(x, 3) + 0.0:g}" for x in d["sinks"])
    return (f"the weights sum to less than one by a per-head amount: attention sinks with logits {shown}: "
            f"declare them with --sinks {shown}")


# --- the fault catalogue -------------------------------------------------------------------------

def _undetected(d: Mapping[str, Any]) -> str:
    return "undetected: " + ", ".join(d["faults"])


def _catalogue_columns(d: Mapping[str, Any]) -> str:
    return ("level, check: where check (black box) first sees the fault; ledger level, stage: where "
            "run --fault (the white-box ledger) first sees it, for the faults the built-in pipeline has; "
            + ", ".join(f"L{k} {v}" for k, v in d["levels"].items()))


# --- the experiments -------------------------------------------------------------------------------

def _intervention_bounds(d: Mapping[str, Any]) -> str:
    return (f"prefix: max |y1-y2| over positions 0..i, must stay within {d['rel_tolerance']:.3g} x max|y| "
            f"(torch.testing's {d['dtype']} defaults); suffix: over i+1.., must move by more than "
            f"{d['suffix_fraction']:.3g} x max|y|; max|y| = {d['scale']:.3g}")


def _controls(d: Mapping[str, Any]) -> str:
    if d["of"] == "builtin":
        return "controls: two leaking versions of the same pipeline; each must be reported as a leak"
    return ("controls: the built-in pipeline at the same sizes, which shows the probe can fail here; "
            "no fault can be injected into your module, so its own result stands alone")


POLARITY_MEANING = {"allow": "True = takes part", "block": "True = blocked"}


def _blocked_row_path(d: Mapping[str, Any]) -> str:
    return f"fully blocked row via {d['api']}, {d['path']}: {d['returns']}" + (f" ({d['detail']})" if d["detail"] else "")


def _blocked_row_agreement(d: Mapping[str, Any]) -> str:
    if d.get("api") is None:
        return "all paths of each API agree on the fully blocked row"
    return f"the paths of {d['api']} disagree on the fully blocked row: rely on none of them"


def _documented(d: Mapping[str, Any]) -> str:
    return f'documented: "{d["doc_line"]}"' if d["doc_line"] else f"documented: no sentence found in {d['source']}"


def _mask_advice(d: Mapping[str, Any]) -> str:
    if d["api"] == "any":
        return f"every API: {d['how']}"
    return f"{d['api']} {'takes it unchanged' if d['unchanged'] else 'needs a conversion'}: {d['how']}"


# --- every command ------------------------------------------------------------------------------------

# Notes whose sentence is a template filled in from their data (``str.format_map``).
SENTENCES: dict[str, str] = {
    "unsupported_dtype": "{dtype} cases skipped: this torch build cannot run them on {device}",
    "cores_seen": "{cores} attention cores were seen; the first was judged",
    "mha_slow_path": ("nn.MultiheadAttention was observed on its slow path (its fast path is one fused call); "
                      "the black-box checks ran the path it normally takes"),
    "faults_detected": "{detected} of {faults} faults detected",
    "fault": "{name}: {summary}",
    "scale_fields": ("maxp: mean largest softmax probability per query row; entropy: mean softmax entropy "
                     "per query row, in nats; ln_tk: entropy of the uniform distribution over Tk keys"),
    "saturated": "saturated: a query row whose scaled softmax puts more than {threshold} of its weight on one key",
    "plot_written": "plot written to {path}",
    "temperature_fields": ("softmax(scores / tau) from the pipeline's softmax in float32; entropy in nats "
                           "(ln Tk = {ln_tk:.4f} is uniform)"),
    "control_rows": "control rows: the largest prefix and the smallest suffix over the cuts",
    "eval_differs": ("eval-mode calls differ, so the deltas of the cut rows include that randomness: "
                     "make eval calls agree first, then rerun"),
    "intervention_stopped": "the intervention stopped at that call; no grad path, cut or control was judged",
    "polarity_conventions": (f"allow: {POLARITY_MEANING['allow']}; block: {POLARITY_MEANING['block']}; each "
                             "convention probed on two keys with equal scores, and quoted from the installed docstring"),
    "blocked_row": "fully blocked row: query {query} of {queries} sees no key, sent through each path below",
    "elapsed": "elapsed {seconds:.2f} s",
}
TEXT: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "scan_inputs": _scan_inputs,
    "scan_reference": _scan_reference,
    "compare_runs": _compare_runs,
    "compare_attention": _compare_attention,
    "compare_first_adder": _compare_first_adder,
    "scan_stopped": _scan_stopped,
    "scan_unreplayable": _scan_unreplayable,
    "scan_saved": _scan_saved,
    "given_input": _given_input,
    "config_input": _config_input,
    "probe": _probe,
    "grad_seed": _grad_seed,
    "cases_failed": _cases_failed,
    "fails_first": _fails_first,
    "allowed_keys": _allowed_keys,
    "relation_picture": _relation_picture,
    "values": _values,
    "score_scale": _score_scale,
    "softcap": _softcap,
    "sinks": _sinks,
    "backends_unavailable": _backends_unavailable,
    "query_blocks": _query_blocks,
    "reference_sample": _reference_sample,
    "loose_range": _loose_range,
    "scores_std_rows": _scores_std_rows,
    "allow_mask_alignment": _allow_mask_alignment,
    "rope": _rope,
    "skipped_by_declaration": _skipped_by_declaration,
    "precision_warned": _precision_warned,
    "warned": _warned,
    "not_reached": _not_reached,
    "stopped": _stopped,
    "inconclusive": _inconclusive,
    "cases_passed": _cases_passed,
    "returned_subclass": _returned_subclass,
    "global_state": _global_state,
    "index_decode": _index_decode,
    "observed_core": _observed_core,
    "found": _found,
    "training_on_entry": _training_on_entry,
    "undeclared_sinks": _undeclared_sinks,
    "undetected": _undetected,
    "catalogue_columns": _catalogue_columns,
    "intervention_bounds": _intervention_bounds,
    "controls": _controls,
    "blocked_row_path": _blocked_row_path,
    "blocked_row_agreement": _blocked_row_agreement,
    "documented": _documented,
    "mask_advice": _mask_advice,
}
LINES: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "reproduce": reproduce_lines,  # one note that reads as several lines
    "interface_reproduce": interface_reproduce_lines,
}


def note_lines(note: "str | Note") -> list[str]:
    """A note as the lines a reader sees (one for most kinds; a picture keeps its line breaks in one)."""
    if isinstance(note, str):
        return [note]
    if note.kind in LINES:
        return LINES[note.kind](note.data)
    if note.kind in SENTENCES:
        return [SENTENCES[note.kind].format_map(note.data)]
    return [TEXT[note.kind](note.data)]


def note_text(note: "str | Note") -> str:
    """A note as one text (its lines joined by line breaks); ``""`` for no note."""
    return "\n".join(note_lines(note)) if note else ""


def notes_text(report: Report) -> list[str]:
    """Every note of the report as the lines the views print, in order (the JSON's ``notes``)."""
    return [line for note in report.notes for line in note_lines(note)]
