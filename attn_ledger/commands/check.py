"""``attn-ledger check``: run a user's attention function (kernel protocol) or module over a grid of cases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute, spec_path
from attn_ledger.commands.options import INT


DECLARE = "Declaration"


EmptyRows = opt.choices("EmptyRows", "zeros", "nan", "finite", "any")  # what a query with every key blocked must return
Protocol = opt.choices("Protocol", "kernel", "transformers")

# the options many commands share, with check's help text
DeviceOption = opt.device_option("Where the cases run; the reference is float64 where the device has it. Default: cpu.")
SeedOption = opt.seed_option("Seed for the random inputs and perturbations, 0..2^63-1. Default: 0.")
TimeoutOption = opt.timeout_option(
    "Limit on each call into your code (import, factory, each kernel or forward call). A call past it "
    "is named in the report as an L1 call finding (exit 2 at import or factory time). "
    "Default 60; with --in-process, none unless given.")
# the kernel's contract and declaration, each switch also read from [tool.attn-ledger.check]
BackwardOption = opt.switch_option("--backward/--no-backward", "Check dq, dk and dv against float64 autograd. "
                                   "Default: backward.")
StrictPrecisionOption = opt.switch_option("--strict-precision/--lenient-precision", "A float64 case at float32 "
                                          "precision fails. Default: lenient (a warning).")
StrictCoverageOption = opt.switch_option("--strict-coverage/--lenient-coverage", "A case that no check past L1 judged "
                                         "(all inconclusive, skipped or not applicable) fails. Default: lenient "
                                         "(counted inconclusive, a warning).")
GqaOption = opt.switch_option("--gqa/--no-gqa", "Whether it supports Nkv < Nh. Default: gqa.", DECLARE)
DistinctDvOption = opt.switch_option("--distinct-dv/--no-distinct-dv", "Whether it supports Dv != Dh. Default: "
                                     "distinct-dv.", DECLARE)


def check(  # long by its 36 options (typer reads them from the signature); the body hands them to the helpers below
    target: Annotated[
        Optional[str],
        typer.Argument(help="The attention function, 'path/to/file.py:NAME' or 'package.module:NAME' (kernel protocol)."),
    ] = None,
    protocol: Annotated[
        Optional[Protocol],
        typer.Option("--protocol", help="How the function is called: kernel (attention(q, k, v, ...)) or transformers (a function registered in transformers' AttentionInterface: fn(module, query, key, value, attention_mask, ...)). Default: detected from the signature."),
    ] = None,
    module: Annotated[
        Optional[str],
        typer.Option("--module", help="Check a module instead: 'file.py:FACTORY', FACTORY(embed_dim, num_heads) -> nn.Module."),
    ] = None,
    embed_dim: Annotated[Optional[str], typer.Option("--embed-dim", metavar=INT, help="E, for --module.")] = None,
    heads: Annotated[Optional[str], typer.Option("--heads", metavar=INT, help="Nh, for --module.")] = None,
    causal: Annotated[Optional[bool], typer.Option("--causal/--no-causal", help="Whether the module is meant to be causal (--module). Default: causal.")] = None,
    decode: Annotated[
        Optional[str],
        typer.Option("--decode", help="With --module: check its KV-cache decode path against the full forward, "
                                      "'file.py:NAME', NAME(module, x_new, cache) -> (y_new, cache)."),
    ] = None,
    window: Annotated[
        Optional[str], typer.Option("--window", metavar=INT,
                                    help="The module is meant to use a causal sliding window of W keys (--module).")
    ] = None,
    scale: Annotated[
        Optional[float], typer.Option("--scale", help="The module's own softmax scale, where it is not 1/sqrt(Dh) (--module).")
    ] = None,
    softcap: Annotated[
        Optional[float], typer.Option("--softcap", metavar="C", help="The module soft-caps its scaled scores, C * tanh(s / C), before the mask (--module; Gemma 2's attn_logit_softcapping).")
    ] = None,
    sinks: Annotated[
        Optional[str], typer.Option("--sinks", metavar="S", help="The module has attention sinks, one logit per head in the softmax's denominator (--module; gpt-oss): a number for every head or Nh numbers joined by ','.")
    ] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", metavar=INT, help="B, for --module, at least 2. Default: 2.")] = None,
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", metavar=INT, help="T, for --module, at least 2. Default: 6.")] = None,
    case: Annotated[
        Optional[list[str]], typer.Option("--case", help="Run only this case id (repeatable); any well-formed id works.")
    ] = None,
    full: Annotated[bool, typer.Option("--full", help="Run the full tier (real sizes chosen pairwise; for nightly CI) instead of the default tier.")] = False,
    list_cases: Annotated[bool, typer.Option("--list-cases", help="List the cases of the tiers with the reason for each, and exit (with --protocol transformers, that protocol's).")] = False,
    empty_rows: Annotated[
        Optional[EmptyRows], typer.Option("--empty-rows", help="Contract for a query whose every key is blocked: zeros, nan (kernel protocol only), finite (any finite row; NaN or inf is a finding) or any. Default: zeros (kernel), finite (transformers).")
    ] = None,
    backward: BackwardOption = None,
    strict_precision: StrictPrecisionOption = None,
    strict_coverage: StrictCoverageOption = None,
    device: DeviceOption = None,
    dtypes: Annotated[Optional[str], typer.Option("--dtypes", help="Dtypes the kernel supports, e.g. float16,bfloat16.", rich_help_panel=DECLARE)] = None,
    masks: Annotated[Optional[str], typer.Option("--masks", help="Mask kinds it takes: none, causal (is_causal), mask (allow_mask), e.g. none,causal; with --protocol transformers the mask functions registered for its name: sdpa, eager, none, flex.", rich_help_panel=DECLARE)] = None,
    gqa: GqaOption = None,
    distinct_dv: DistinctDvOption = None,
    max_tq: Annotated[Optional[str], typer.Option("--max-tq", metavar=INT, help="The longest Tq it takes.", rich_help_panel=DECLARE)] = None,
    max_tk: Annotated[Optional[str], typer.Option("--max-tk", metavar=INT, help="The longest Tk it takes.", rich_help_panel=DECLARE)] = None,
    head_dims: Annotated[Optional[str], typer.Option("--head-dims", help="Head widths Dh and Dv may take, e.g. 64,128.", rich_help_panel=DECLARE)] = None,
    supports: Annotated[Optional[str], typer.Option("--supports", help="Optional features it takes: softcap (softcap=C), window (window=W), sinks (sinks [Nh]), e.g. softcap,window; each adds the cases that exercise it. Default: none.", rich_help_panel=DECLARE)] = None,
    seed: SeedOption = None,
    timeout: TimeoutOption = None,
    max_timeouts: Annotated[
        Optional[str],
        typer.Option("--max-timeouts", metavar=INT, help=(
            "Stop after this many cases in a row time out (a case that returns resets the count; a crash "
            "does not count): the rest are not reached, named in the report. Default 3.")),
    ] = None,
    max_time: Annotated[
        Optional[float],
        typer.Option("--max-time", metavar="SECONDS", help=(
            "Bound on the whole check, at most 86400. At expiry the case running is stopped, the rest are not "
            "reached, the report says why, and the exit status is 1. Default: no bound.")),
    ] = None,
    in_process: opt.in_process_option(
        "Run your code in this process, for debugging (breakpoints, pdb). sys.exit in it is still a finding, "
        "but a hang or a crash is not caught: without this option your code runs in a worker process.") = False,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
    timings: Annotated[bool, typer.Option("--timings", help="Add the elapsed time to the report (JSON details.elapsed_s).")] = False,
    html: opt.html_option("Also write the report as one self-contained HTML page, with the failing cases and their reproduction.") = None,
    max_memory: Annotated[Optional[str], typer.Option("--max-memory", metavar="SIZE", help="Memory budget for --module sizes, such as 8G (default: what the machine has free).")] = None,
) -> None:
    """Check an attention function or module from outside and name the first level where it goes wrong.

    Kernel protocol: attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) with
    q [B, Nh, Tq, Dh], k [B, Nkv, Tk, Dh], v [B, Nkv, Tk, Dv] -> [B, Nh, Tq, Dv]; allow_mask True =
    may attend; is_causal bottom-right aligned. Your code runs in a worker process: a call that
    hangs, exits or crashes is that case's L1 call finding, and what it prints goes to stderr.
    What the kernel supports is declared by the options under "Declaration" or in
    [tool.attn-ledger.check] of ./pyproject.toml (options override); cases outside it are skipped
    and counted. A case that no check past L1 judged is counted inconclusive, never passed. Exit 0
    no case fails (precision warnings and inconclusive cases included; --strict-coverage makes an
    inconclusive case fail), 1 a finding, 2 bad input or setup (your file cannot be imported, the
    factory raises or exits, or the target cannot take the protocol's arguments), 3 an internal
    error.
    """
    if list_cases:
        _list_cases(output_format, output, target, module, protocol.value if protocol else "kernel")
        return
    # kernel-protocol options: None where not given (the pyproject table or the default then holds)
    kernel_options = {"--full": full or None, "--device": device.value if device else None,
                      "--backward/--no-backward": backward, "--strict-precision/--lenient-precision": strict_precision,
                      "--strict-coverage/--lenient-coverage": strict_coverage,
                      "--dtypes": dtypes, "--masks": masks, "--gqa/--no-gqa": gqa,
                      "--distinct-dv/--no-distinct-dv": distinct_dv, "--max-tq": max_tq, "--max-tk": max_tk,
                      "--head-dims": head_dims, "--supports": supports}
    declared = {"dtypes": dtypes, "masks": masks, "gqa": gqa, "distinct_dv": distinct_dv, "max_tq": max_tq,
                "max_tk": max_tk, "head_dims": head_dims, "backward": backward, "supports": supports,
                "empty_rows": empty_rows.value if empty_rows else None, "strict_precision": strict_precision,
                "strict_coverage": strict_coverage}
    module_options = {"--embed-dim": embed_dim, "--heads": heads, "--causal/--no-causal": causal, "--window": window,
                      "--scale": scale, "--softcap": softcap, "--sinks": sinks, "--batch-size": batch_size, "--seq-len": seq_len,
                      "--max-memory": max_memory}

    def build():
        from attn_ledger.inputs.userload import parse_spec
        from attn_ledger.runner.worker import Limits, run_user_task, show_output

        _refuse_targets(target, module, decode, causal)
        seed_value = opt.seed(seed) or 0
        limits = Limits(max_time=max_time, **({} if max_timeouts is None else
                                              {"max_timeouts": opt.integer(max_timeouts, "--max-timeouts", 1, 1 << 20)}))
        if module is not None:
            opt.refuse_given({"--case": case or None, "--empty-rows": empty_rows.value if empty_rows else None,
                              "--max-timeouts": max_timeouts, **kernel_options}, "with --module (it applies to a kernel-protocol function)")
            name, label = "module_check", "checking module"
            args = _module_args(module, decode, module_options, seed_value)
        else:
            opt.refuse_given(module_options, "for a kernel-protocol function (it applies to --module)")
            parse_spec(target, "target")
            name, label = "kernel_check", "checking cases"
            chosen = protocol.value if protocol else None
            if chosen == "transformers":
                opt.refuse_given({k: v for k, v in kernel_options.items()
                                  if k not in ("--full", "--dtypes", "--masks", "--supports")},
                                 "with --protocol transformers (it applies to the kernel protocol)")
            if chosen == "kernel":
                args = _kernel_args(target, case, full, declared, seed_value, device.value if device else "cpu")
            else:
                name = "attention_check"
                args = _attention_args(target, chosen, case, full, declared, seed_value,
                                       device.value if device else "cpu")
        with Progress(label) as bar:
            outcome = run_user_task(name, args, in_process=in_process, timeout=timeout, progress=bar, limits=limits)
        show_output(outcome.output)
        return outcome.report

    inputs = {"target": spec_path(target), "--module": spec_path(module), "--decode": spec_path(decode),
              "pyproject.toml": "pyproject.toml" if target is not None and Path("pyproject.toml").is_file() else None}
    execute(build, output_format, output, command="check", detail=detail, timings=timings, html=html, inputs=inputs)


def _refuse_targets(target: Optional[str], module: Optional[str], decode: Optional[str], causal: Optional[bool]) -> None:
    """Exactly one of a function and a module; --decode only with a causal --module."""
    from attn_ledger.errors import InputError

    if decode is not None and module is None:
        raise InputError(f"--decode: got {decode!r} without --module; a decode path is checked with its module")
    if decode is not None and causal is False:
        raise InputError("--decode: cannot be used with --no-causal; decode parity compares with the causal forward")
    if (target is None) == (module is None):
        raise InputError("target: expected exactly one of a function 'file.py:NAME' or --module 'file.py:FACTORY'")


def _module_args(module: str, decode: Optional[str], given: dict, seed: int) -> dict:
    """What the worker needs to check a module, as plain data, its sizes validated and its memory guarded.

    Args:
        given: the module options as typed (``--embed-dim`` -> its text, or None where not given).
    """
    from attn_ledger.errors import InputError
    from attn_ledger.engine.budget import estimate_module
    from attn_ledger.probes.module.check import BATCH_SIZE, SEQ_LEN, validate_module_options
    from attn_ledger.inputs.sinks import parse_sinks
    from attn_ledger.inputs.userload import parse_spec

    e, nh = opt.integer(given["--embed-dim"], "--embed-dim", 1), opt.integer(given["--heads"], "--heads", 1)
    if e is None or nh is None:
        raise InputError(f"--module needs --embed-dim and --heads: got embed_dim={e}, heads={nh}")
    b, t = opt.integer(given["--batch-size"], "--batch-size", 2), opt.integer(given["--seq-len"], "--seq-len", 2)
    sizes = {"batch_size": BATCH_SIZE if b is None else b, "seq_len": SEQ_LEN if t is None else t}
    w = opt.integer(given["--window"], "--window", 1)
    causal = given["--causal/--no-causal"]
    is_causal = True if causal is None else causal
    scale, softcap = given["--scale"], given["--softcap"]
    sinks = parse_sinks(given["--sinks"], nh, "--sinks")
    validate_module_options(e, nh, causal=is_causal, window=w, scale=scale, softcap=softcap, sinks=sinks, **sizes)
    opt.guard(estimate_module(e, nh, sizes["batch_size"], sizes["seq_len"], f"check --module E={e} Nh={nh}"),
              opt.memory(given["--max-memory"]))
    parse_spec(module, "--module")
    if decode is not None:
        parse_spec(decode, "--decode")
    return {"spec": module, "field": "--module", "embed_dim": e, "num_heads": nh, "causal": is_causal, "window": w,
            "scale": scale, "softcap": softcap, "sinks": None if sinks is None else list(sinks), "seed": seed,
            "decode": decode, **sizes}


def _kernel_args(target: str, case: Optional[list[str]], full: bool, declared: dict, seed: int,
                 device: str) -> dict:
    """What the check of a kernel needs: the cases (each id given parsed here, once), the options, and the
    declaration (``[tool.attn-ledger.check]`` of ./pyproject.toml under the options given)."""
    from attn_ledger.probes.kernel.check import select_cases
    from attn_ledger.probes.kernel.spec import from_sources

    decl, run = from_sources(declared)
    tier = "full" if full else "default"
    return {"target": target, "field": "target", "cases": list(select_cases(case, tier, decl.supports)),
            "tier": None if case else tier, "empty_rows": run.get("empty_rows", "zeros"), "seed": seed,
            "backward": decl.backward, "strict_precision": run.get("strict_precision", False),
            "strict_coverage": run.get("strict_coverage", False), "device": device,
            "declaration": decl.to_json()}


def _attention_args(target: str, protocol: Optional[str], case: Optional[list[str]], full: bool, declared: dict,
                    seed: int, device: str) -> dict:
    """The arguments of a check whose protocol is detected from the target's signature (or given as
    transformers): each protocol's own, read now; the kernel's may fail to read (an option meant for the
    other protocol), which is an error only if the target turns out to follow it."""
    from attn_ledger.errors import InputError

    args: dict = {"target": target, "field": "target", "protocol": protocol}
    if protocol is None:
        try:
            args["kernel"] = _kernel_args(target, case, full, declared, seed, device)
        except InputError as exc:
            args["kernel"], args["kernel_error"] = None, str(exc)
    try:
        args["interface"] = _interface_args(declared, case, full, seed)
    except InputError as exc:  # options meant for the kernel protocol: an error only if the target is not one
        if protocol is not None:
            raise
        args["interface"], args["interface_error"] = None, str(exc)
    return args


def _interface_args(declared: dict, case: Optional[list[str]], full: bool, seed: int) -> dict:
    """The transformers protocol's arguments: its declaration from the options over [tool.attn-ledger.check]."""
    from attn_ledger.errors import InputError
    from attn_ledger.probes.interface.check import declaration as interface_declaration
    from attn_ledger.probes.kernel.spec import TABLE, read_table

    table = read_table()
    keys = ("masks", "dtypes", "supports")
    given = {k: declared[k] for k in keys if declared.get(k) is not None}
    from_table = {k: table[k] for k in keys if k in table and k not in given}
    empty = declared.get("empty_rows") or table.get("empty_rows") or "finite"
    if empty not in ("finite", "zeros", "any"):
        raise InputError(f"--empty-rows: got {empty!r}, expected one of finite, zeros, any with --protocol transformers")
    interface_declaration(from_table, source=f"pyproject.toml [{TABLE}] ")  # a bad value is named before any import
    interface_declaration(given)
    return {"declared": {**from_table, **given}, "cases": list(case) if case else None, "seed": seed,
            "empty_rows": empty, "tier": "full" if full else "default"}


def _list_cases(fmt: Format, output: Optional[Path], target: Optional[str], module: Optional[str],
                protocol: str) -> None:
    """Every case of every tier of a protocol with its tier and reason: a table, or JSON with ``--format json``."""
    import json

    from attn_ledger.commands.common import fail, write_atomic
    from attn_ledger.errors import AttnLedgerError
    from attn_ledger.probes.common.grid import describe_tiers
    from attn_ledger.render.table import wrap_words

    if target is not None or module is not None:
        given = target if target is not None else f"--module {module}"
        raise fail(f"--list-cases: got it with {given!r}, expected no target or --module: it lists the cases and runs nothing")
    if protocol == "transformers":
        from attn_ledger.probes.interface.cases import GRID as grid

        flex = sum(g.case.mask == "flex" for g in grid)
        who = f"a function declares (--supports); {flex} of all these are flex's, for --masks flex"
    else:
        from attn_ledger.probes.kernel.cases import GRID, feature_grid

        grid, who = GRID + feature_grid(), "a kernel declares (--supports)"
    entries = describe_tiers(grid)
    if fmt is Format.json:
        text = json.dumps({"command": "check --list-cases", "protocol": protocol, "cases": entries}, indent=2) + "\n"
    elif fmt is Format.table:
        width = max(len(e["id"]) for e in entries)
        lines = [f"{'case'.ljust(width)}  tier     reason"]
        pad = width + 11  # the id, the tier and their gaps
        for e in entries:
            reason = wrap_words(e["reason"], max(40, 100 - pad), indent="")
            lines.append(f"{e['id'].ljust(width)}  {e['tier'].ljust(7)}  {reason[0]}")
            lines += [" " * pad + more for more in reason[1:]]
        counts = {t: sum(e["tier"] == t for e in entries) for t in ("default", "full", "features")}
        lines += wrap_words(f"{counts['default']} cases in the default tier; --full adds {counts['full']}; "
                            f"{counts['features']} more for the features {who}", 100, indent="")
        text = "\n".join(lines) + "\n"
    else:
        raise fail(f"--format: got {fmt.value!r} with --list-cases, expected table or json")
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        write_atomic(output, text)
    except AttnLedgerError as exc:
        raise fail(str(exc)) from None
