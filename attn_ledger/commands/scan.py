"""``attn-ledger scan``: every attention call of a whole model, checked in place, the first wrong layer named."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute, spec_path
from attn_ledger.commands.options import INPUTS_PANEL, INT, MODEL_PANEL

DECLARE = "Declaration (a model that is not transformers')"

Padding = opt.choices("Padding", "none", "left", "right")
MaskFormat = opt.choices("MaskFormat", "sdpa", "eager", "none")

SetOption = opt.set_option("Override a config value (repeatable), e.g. --set num_hidden_layers=4; the value reads as JSON where it is JSON.")
ImplementationOption = opt.attn_implementation_option("transformers' attention implementation: eager, sdpa, flex_attention, or a name registered with --register. Default: the model's own.")
RegisterOption = opt.register_option("Register FN(module, query, key, value, attention_mask, ...) in transformers' AttentionInterface under --attn-implementation's name.")
MaskFormatOption = opt.mask_format_option(MaskFormat, "The mask function registered with --register: sdpa (bool masks, or None with is_causal), eager (additive), or none (no mask function: the function gets no mask). Default: sdpa.")
SeedOption = opt.seed_option("Seed for the random weights and the token ids, 0..2^63-1. Default: 0.")
TimeoutOption = opt.timeout_option(
    "Limit on each call into the model (building it, its forward), in seconds. Default 60; with --in-process, "
    "none unless given.")
TargetArgument = opt.target_argument("A model of your own: 'path/to/file.py:FACTORY', FACTORY() -> nn.Module or "
                                     "(module, inputs), inputs a dict of forward keyword arguments or a tensor.")
TransformersOption = opt.transformers_option(
    "A transformers model built from its config with random weights (never downloaded): a model type (llama, mistral, "
    "gemma2, gpt2, bert, t5, ...) gets small defaults; a config.json keeps its sizes unless --tiny.")


def scan(  # long by its options (typer reads them from the signature); the body hands them to the helpers below
    target: TargetArgument = None,
    transformers: TransformersOption = None,
    tiny: Annotated[bool, typer.Option("--tiny", rich_help_panel=MODEL_PANEL, help="With a config.json: use the small defaults of its model type (2 layers, width 64, windows of 16).")] = False,
    set_: SetOption = None,
    attn_implementation: ImplementationOption = None,
    register: RegisterOption = None,
    mask_format: MaskFormatOption = None,
    batch: opt.BatchOption = None,
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", metavar=INT, rich_help_panel=INPUTS_PANEL, help="T, tokens per example (the encoder's, for T5). Default: 24.")] = None,
    padding: Annotated[Optional[Padding], typer.Option("--padding", rich_help_panel=INPUTS_PANEL, help="Pad the examples after the first: left (as decoders generate) or right, with the matching attention_mask. Default: none.")] = None,
    decoder_len: Annotated[Optional[str], typer.Option("--decoder-len", metavar=INT, rich_help_panel=INPUTS_PANEL, help="The decoder's tokens, for an encoder-decoder (T5). Default: --seq-len.")] = None,
    seed: SeedOption = None,
    causal: Annotated[Optional[bool], typer.Option("--causal/--no-causal", rich_help_panel=DECLARE, help="Whether its attention is meant to be causal.")] = None,
    window: Annotated[Optional[str], typer.Option("--window", metavar=INT, rich_help_panel=DECLARE, help="A causal sliding window of W keys, the query included.")] = None,
    scale: Annotated[Optional[float], typer.Option("--scale", rich_help_panel=DECLARE, help="Its softmax scale, where it is not 1/sqrt(Dh).")] = None,
    softcap: Annotated[Optional[float], typer.Option("--softcap", metavar="C", rich_help_panel=DECLARE, help="It soft-caps its scaled scores, C * tanh(s / C), before the mask.")] = None,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Judge every call: without it, the calls after the first wrong one are listed and marked downstream, not judged.")] = False,
    save: Annotated[Optional[Path], typer.Option("--save", metavar="DIR", help="Write each call's tensors into DIR (a new or empty directory) as safetensors files that 'attn-ledger run --tensors' reads.")] = None,
    timeout: TimeoutOption = None,
    in_process: opt.in_process_option("Build and run the model in this process, for debugging (breakpoints); without it, the model runs in a worker process.") = False,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
    html: opt.html_option("Also write the report as one self-contained HTML page: a strip of layers, each opening its stage ledger.") = None,
) -> None:
    """Run one forward of a whole model, check every attention call in place against what its config implies,
    and name the first wrong layer, with the stage ledger of that call.

    Each call is seen through the model's own attention interface (q and k after rotary, the exact mask, the
    keywords), or by the function-mode observer where it bypasses the interface; the projections are kept to
    judge rotary. Per call: L1 what was seen and its layout; L3 finite rows, and weights summing to one with
    none on forbidden keys where the call returns them; L4 rotary, scale, relation (causal, the layer's
    window, bidirectional, padding), soft-cap, sinks, and the context against float64 attention. Padded
    query rows are judged only as finite. Exit 0 every call holds, 1 a finding, 2 bad input or setup (the
    model cannot be built, a file cannot be imported), 3 an internal error.
    """
    declared = {"--causal/--no-causal": causal, "--window": window, "--scale": scale, "--softcap": softcap}

    def build():
        from attn_ledger.runner.worker import run_user_task, show_output

        args = scan_args(target, transformers, tiny=tiny, overrides=set_, implementation=attn_implementation,
                         register=register, mask_format=mask_format.value if mask_format else None,
                         sizes={"--batch": batch, "--seq-len": seq_len, "--decoder-len": decoder_len},
                         padding=padding.value if padding else None, seed=seed, declared=declared,
                         keep_going=keep_going, save=save)
        args["options"]["every_ledger"] = html is not None  # the page opens every call onto its stage ledger
        with Progress("scanning") as bar:
            outcome = run_user_task("model_scan", args, in_process=in_process, timeout=timeout, progress=bar)
        show_output(outcome.output)
        return outcome.report

    inputs = {"target": spec_path(target), "--register": spec_path(register),
              "--transformers": transformers if transformers and transformers.endswith(".json") else None}
    execute(build, output_format, output, command="scan", detail=detail, html=html, inputs=inputs)


def scan_args(target: Optional[str], transformers: Optional[str], *, tiny: bool, overrides: Optional[list[str]],
              implementation: Optional[str], register: Optional[str], mask_format: Optional[str], sizes: dict,
              padding: Optional[str], seed: Optional[str], declared: dict, keep_going: bool,
              save: Optional[Path]) -> dict:
    """The scan task's arguments as plain data, everything that can be validated without the model validated."""
    from attn_ledger.errors import InputError
    from attn_ledger.probes.model.expect import Declared
    from attn_ledger.probes.model.inputs import InputPlan
    from attn_ledger.probes.model.judge import REFERENCE_BUDGET
    from attn_ledger.probes.model.targets import target as make_target

    kind, source = opt.model_source(target, transformers)
    seed_value = opt.seed(seed) or 0
    t = make_target(kind, source, tiny=tiny, overrides=overrides, implementation=implementation,
                    register=register, mask_format=mask_format, seed=seed_value)
    plan = InputPlan(opt.integer(sizes["--batch"], "--batch", 1) or 2, opt.integer(sizes["--seq-len"], "--seq-len", 2) or 24,
                     padding or "none", seed_value, opt.integer(sizes["--decoder-len"], "--decoder-len", 1))
    decl = None
    if kind == "transformers":
        opt.refuse_given(declared, "with --transformers (the config says what each layer computes)")
    else:
        w = opt.integer(declared["--window"], "--window", 1)
        for name in ("--scale", "--softcap"):
            value = declared[name]
            if value is not None and not (value > 0 and value != float("inf")):
                raise InputError(f"{name}: got {value!r}, expected a finite number greater than 0")
        if declared["--causal/--no-causal"] is False and w is not None:
            raise InputError("--window: cannot be used with --no-causal; a sliding window here is causal")
        decl = Declared(declared["--causal/--no-causal"], w, declared["--scale"], declared["--softcap"])
    save_dir = _save_dir(save)
    return {"target": t.to_json(), "field": "target", "plan": plan.to_json(),
            "options": {"keep_going": keep_going, "budget": REFERENCE_BUDGET,
                        "declared": None if decl is None else decl.to_json(), "save": save_dir}}


def _save_dir(save: Optional[Path]) -> Optional[str]:
    """``--save``: a directory that does not exist yet (its parent does) or is empty."""
    from attn_ledger.errors import InputError

    if save is None:
        return None
    p = Path(save)
    if p.exists() and not p.is_dir():
        raise InputError(f"--save: got {str(save)!r}, which is a file; expected a new or empty directory")
    if p.is_dir() and any(p.iterdir()):
        raise InputError(f"--save: got {str(save)!r}, which holds files already; expected a new or empty directory")
    if not p.exists() and not (p.parent if str(p.parent) else Path(".")).is_dir():
        raise InputError(f"--save: got {str(save)!r}, expected a directory whose parent exists")
    return str(p)
