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
    return [f"its call: {d['call']}", "reproduce it:", f"{_check_command(d['target'])} \\", f"    --case {rest}",
            *python_lines(d)]


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
    return (f"--vary {d['vary']}: {padding}; only real tokens compared; bound = {d['factor']:g} x the plain "
            f"error at each block (eager in each run's dtype against float64) + one eps")


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


TEXT: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "scan_inputs": _scan_inputs,
    "scan_reference": _scan_reference,
    "compare_runs": _compare_runs,
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
    return [TEXT[note.kind](note.data)]


def note_text(note: "str | Note") -> str:
    """A note as one text (its lines joined by line breaks); ``""`` for no note."""
    return "\n".join(note_lines(note)) if note else ""


def notes_text(report: Report) -> list[str]:
    """Every note of the report as the lines the views print, in order (the JSON's ``notes``)."""
    return [line for note in report.notes for line in note_lines(note)]
